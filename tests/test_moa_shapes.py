"""One test per shape rule of the algebra, and its error cases with their messages."""

import numpy as np
import pytest

from moajax import moa
from moajax.moa import MoAShapeError, MoATypeError


def A(shape, name="A", dtype=np.float64):
    return moa.array(name, shape, None, dtype)


def test_rho_delta_tau():
    a = A((2, 3, 4))
    assert a.rho == (2, 3, 4) and a.rank == 3 and a.size == 24
    assert A(()).rank == 0 and A(()).size == 1


def test_array_declaration_errors():
    with pytest.raises(MoAShapeError, match="array 'x'.*non-negative"):
        moa.array("x", (2, -1))
    with pytest.raises(MoAShapeError, match="dims"):
        moa.array("x", (2, 3), "t")


def test_psi_partial_index_shape():
    a = A((2, 3, 4))
    assert moa.psi((1,), a).shape == (3, 4)
    assert moa.psi((1, 2), a).shape == (4,)
    assert moa.psi((), a) is a
    assert a[1, 2, 3].shape == ()


def test_psi_errors():
    a = A((2, 3))
    with pytest.raises(MoAShapeError, match=r"psi: index \[0, 0, 0\] is longer"):
        moa.psi((0, 0, 0), a)
    with pytest.raises(MoAShapeError, match=r"psi: index \[2\] is out of bounds for shape \[2, 3\]"):
        moa.psi((2,), a)


@pytest.mark.parametrize("k,expect", [(2, 2), (-1, 1), (0, 0), (5, 5)])
def test_take_shape(k, expect):
    assert moa.take(k, A((5, 3))).shape == (expect, 3)


@pytest.mark.parametrize("k,expect", [(2, 3), (-1, 4), (0, 5), (5, 0)])
def test_drop_shape(k, expect):
    assert moa.drop(k, A((5, 3))).shape == (expect, 3)


def test_take_drop_vector_and_axis():
    a = A((5, 6, 7))
    assert moa.take((2, -3), a).shape == (2, 3, 7)
    assert moa.drop(2, a, axis=2).shape == (5, 6, 5)
    assert moa.take(-2, a, axis=-1).shape == (5, 6, 2)


def test_take_drop_errors():
    with pytest.raises(MoAShapeError, match=r"take: \|6\| exceeds the axis length in shape \[5, 3\]"):
        moa.take(6, A((5, 3)))
    with pytest.raises(MoAShapeError, match=r"drop: \|-6\| exceeds"):
        moa.drop(-6, A((5, 3)))
    with pytest.raises(MoAShapeError, match="rank ≥ 1"):
        moa.take(1, A(()))
    with pytest.raises(MoAShapeError, match=r"take: axis 3 is out of range for an array of shape \[5, 3\]"):
        moa.take(1, A((5, 3)), axis=3)
    with pytest.raises(MoAShapeError, match="count vector"):
        moa.take((1, 1, 1), A((5, 3)))


def test_reverse_rotate_keep_shape():
    a = A((4, 5))
    assert moa.reverse(a).shape == (4, 5)
    assert moa.reverse(a, axis=1).shape == (4, 5)
    assert moa.rotate(7, a, axis=-1).shape == (4, 5)
    with pytest.raises(MoAShapeError, match="reverse: needs an array of rank ≥ 1"):
        moa.reverse(A(()))
    with pytest.raises(TypeError, match="rotate: shift must be an int"):
        moa.rotate(1.5, a)


def test_transpose_shape():
    a = A((2, 3, 4))
    assert moa.transpose(a).shape == (4, 3, 2)
    assert moa.transpose(a, (1, 2, 0)).shape == (3, 4, 2)
    assert moa.transpose(a, (0, 1, 2)) is a
    with pytest.raises(MoAShapeError, match=r"transpose: \[0, 0, 1\] is not a permutation of the axes of shape \[2, 3, 4\]"):
        moa.transpose(a, (0, 0, 1))


def test_reshape_shape_and_errors():
    a = A((2, 6))
    assert moa.reshape(a, (3, 4)).shape == (3, 4)
    assert moa.ravel(a).shape == (12,)
    assert moa.reshape(a, (4, 3), gamma="F").shape == (4, 3)
    with pytest.raises(MoAShapeError, match=r"reshape: cannot refill shape \[5\] \(τ=5\) from shape \[2, 6\] \(τ=12\)"):
        moa.reshape(a, (5,))
    with pytest.raises(ValueError, match="gamma must be 'C'"):
        moa.reshape(a, (12,), gamma="X")


def test_catenate_shape_and_errors():
    assert moa.catenate(A((2, 3)), A((4, 3), "B")).shape == (6, 3)
    assert moa.catenate(A((2, 3)), A((2, 5), "B"), axis=1).shape == (2, 8)
    with pytest.raises(MoAShapeError, match=r"catenate: shapes \[2, 3\] and \[2, 4\] differ off axis 0"):
        moa.catenate(A((2, 3)), A((2, 4), "B"))
    with pytest.raises(MoAShapeError, match="need equal rank"):
        moa.catenate(A((2, 3)), A((3,), "B"))
    with pytest.raises(MoATypeError, match="catenate: dtypes float64 and float32 differ"):
        moa.catenate(A((2,)), A((2,), "B", np.float32))


def test_iota():
    assert moa.iota(5).shape == (5,)
    with pytest.raises(MoAShapeError, match="iota: n must be a non-negative int"):
        moa.iota(-1)


def test_scalar_extension_shapes_and_errors():
    a, b = A((2, 3)), A((2, 3), "B")
    assert (a + b).shape == (2, 3)
    assert (a * 2.0).shape == (2, 3)
    assert (2.0 - a).shape == (2, 3)
    assert moa.exp(a).shape == (2, 3)
    assert moa.where(a < b, a, 0.0).shape == (2, 3)
    with pytest.raises(MoAShapeError, match=r"add: shapes \[\[2, 3\], \[3, 2\]\] do not agree"):
        a + A((3, 2), "C")


def test_dtype_rules():
    a = A((2,), "a", np.float32)
    i = A((2,), "i", np.int32)
    with pytest.raises(MoATypeError, match=r"add: operand dtypes \['float32', 'int32'\] differ; cast first"):
        a + i
    with pytest.raises(MoATypeError, match="exp: needs a floating dtype, got int32"):
        moa.exp(i)
    with pytest.raises(MoATypeError, match="where: condition must be bool"):
        moa.where(a, a, a)
    with pytest.raises(MoATypeError, match="cannot extend an array of dtype int32"):
        i + 0.5
    assert (a < a).dtype == np.bool_
    assert moa.cast(i, np.float32).dtype == np.float32
    assert (i + 1).dtype == np.int32


def test_outer_shape():
    assert moa.outer(moa.mul, A((2, 3)), A((4,), "B")).shape == (2, 3, 4)
    assert moa.outer(moa.ge, moa.iota(3), moa.iota(4)).dtype == np.bool_
    with pytest.raises(ValueError, match="not a binary op"):
        moa.outer(moa.exp, A((2,)), A((2,), "B"))


def test_reduce_shape_and_monoids():
    a = A((2, 3, 4))
    assert moa.reduce("add", a).shape == (3, 4)
    assert moa.reduce("max", a, axis=1).shape == (2, 4)
    assert moa.reduce(moa.maximum, a, axis=-1).shape == (2, 3)
    assert moa.mean(a, axis=2).shape == (2, 3)
    with pytest.raises(ValueError, match="no monoid for 'sub'"):
        moa.reduce("sub", a)
    with pytest.raises(MoAShapeError, match="reduce: needs an array of rank ≥ 1"):
        moa.reduce("add", A(()))
    with pytest.raises(MoATypeError, match="reduce and: needs bool"):
        moa.reduce("and", a)


def test_inner_shape_and_errors():
    assert moa.dot(A((2, 3)), A((3, 4), "B")).shape == (2, 4)
    assert moa.dot(A((5, 2, 3)), A((3, 4, 6), "B")).shape == (5, 2, 4, 6)
    assert moa.inner("max", moa.add, A((3,)), A((3,), "B")).shape == ()
    assert (A((2, 3)) @ A((3,), "B")).shape == (2,)
    with pytest.raises(MoAShapeError, match=r"inner: the last axis of shape \[2, 3\] does not match the first axis of shape \[4, 3\]"):
        moa.dot(A((2, 3)), A((4, 3), "B"))


def test_omega_frames():
    a, m = A((4, 5)), A((4,), "m")
    assert moa.omega(moa.sub, (1, 0))(a, m).shape == (4, 5)
    w = A((5,), "w")
    assert moa.omega(moa.mul, (1, 1))(a, w).shape == (4, 5)  # w's frame is empty
    assert moa.omega(lambda c: moa.sum(c), 1)(a).shape == (4,)
    assert moa.omega(moa.dot, (2, 2))(A((3, 2, 4)), A((3, 4, 5), "B")).shape == (3, 2, 5)
    assert moa.omega(moa.sub, -1)(a, a).shape == (4, 5)  # negative rank: cells of rank δ−1
    with pytest.raises(MoAShapeError, match=r"omega: frames \[\[4\], \[5\]\]"):
        moa.omega(moa.sub, (1, 0))(a, A((5,), "x"))
    with pytest.raises(ValueError, match="omega: 1 ranks for 2 arguments"):
        moa.omega(moa.sub, (1,))(a, m)


def test_softmax_and_defined_ops_are_not_primitives():
    a = A((3, 4))
    sm = moa.softmax(a)
    assert sm.shape == (3, 4)
    # softmax is built from primitives: Ω, reduce and scalar extension (its parts labelled)
    assert isinstance(sm, moa.Name) and sm.label == "probs" and isinstance(sm.arg, moa.Omega)
    assert moa.softmax(a, axis=0).shape == (3, 4)
    assert moa.logsumexp(a).shape == (3,)


def test_name_labels():
    a = A((2,))
    n = moa.name("row", a)
    assert n.shape == (2,) and n.label == "row"
    with pytest.raises(ValueError, match="label must be an identifier"):
        moa.name("not ok", a)


def test_operand_types():
    with pytest.raises(TypeError, match="expected a moajax.moa.Array or a Python scalar"):
        moa.exp("x")
    with pytest.raises(TypeError, match="axis must be an int"):
        moa.reduce("add", A((2,)), axis=0.5)


def test_take_drop_catenate_keep_the_dim_names():
    """k△A, k▽A (along any axis) and A ⧺ B keep A's dim names, the resized axis's too: a
    Preset names the axis of x ⧺ y by x's n. (Within one DNF ψ-reduction gives a variable of
    another extent under a held name another name: ``test_psi_rules``.)"""
    a = moa.array("A", (5, 3), "n d", np.float64)
    b = moa.array("B", (4, 3), "m d", np.float64)
    assert moa.take(2, a).dims == moa.drop(-2, a).dims == moa.catenate(a, b).dims == ("n", "d")
    assert moa.take(2, a, axis=1).dims == moa.catenate(a, a, axis=1).dims == ("n", "d")
