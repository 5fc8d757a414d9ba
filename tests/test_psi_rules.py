"""One test per ψ-reduction rule: the rule fires, the DNF has the expected index arithmetic,
and the value equals the NumPy evaluation of the un-reduced expression."""

import numpy as np
import pytest

from helpers import rel_err
from moajax import dnf as D
from moajax import moa, numpy_eval, reference
from moajax.ix import Ix, Var
from moajax.psi import psi_reduce


def check(expr, inputs, rule):
    dnf, der = psi_reduce(expr, "t")
    assert rule in der.rules_used(), der.pretty()
    got = np.asarray(reference.to_jax(dnf)(*[inputs[s.name] for s in dnf.inputs]))
    want = numpy_eval.evaluate(expr, inputs)
    if want.dtype == np.bool_:
        assert np.array_equal(got, want)
    else:
        assert rel_err(got, want) <= 1e-12
    return dnf


def arr(name, shape, dims=None):
    return moa.array(name, shape, dims, np.float64)


R = np.random.default_rng(1)


def data(*shapes):
    return [R.standard_normal(s) for s in shapes]


def only_read(dnf):
    rs = dnf.reads()
    assert len(rs) == 1
    return rs[0]


def test_rule_input():
    a = arr("a", (2, 3), "i j")
    d = check(a, {"a": data((2, 3))[0]}, "ψ-input")
    r = only_read(d)
    assert r.array == "a" and [i.as_var().name for i in r.index] == ["i", "j"]


def test_rule_transpose():
    a = arr("a", (2, 3, 4), "i j k")
    d = check(moa.transpose(a, (2, 0, 1)), {"a": data((2, 3, 4))[0]}, "ψ-transpose")
    # ⟨k i j⟩ψ ⍉A = ⟨i j k⟩ψ A: the read is A in its own order, no transposed copy
    r = only_read(d)
    assert [i.as_var().name for i in r.index] == ["i", "j", "k"]
    assert [v.name for v in d.output.vars] == ["k", "i", "j"]


@pytest.mark.parametrize("k", [2, -2])
def test_rule_take(k):
    a = arr("a", (5, 3), "i j")
    d = check(moa.take(k, a), {"a": data((5, 3))[0]}, "ψ-take")
    r = only_read(d)
    assert r.index[0] == Ix.of(Var("i", 2)) + (0 if k > 0 else 3)


@pytest.mark.parametrize("k", [2, -2])
def test_rule_drop(k):
    a = arr("a", (5, 3), "i j")
    d = check(moa.drop(k, a), {"a": data((5, 3))[0]}, "ψ-drop")
    r = only_read(d)
    assert r.index[0] == Ix.of(Var("i", 3)) + (2 if k > 0 else 0)


def test_rule_reverse():
    a = arr("a", (5,), "i")
    d = check(moa.reverse(a), {"a": data((5,))[0]}, "ψ-reverse")
    assert only_read(d).index[0] == 4 - Ix.of(Var("i", 5))


def test_rule_rotate():
    a = arr("a", (5, 2), "i j")
    d = check(moa.rotate(7, a), {"a": data((5, 2))[0]}, "ψ-rotate")
    assert "mod 5" in str(only_read(d).index[0])


def test_rule_reshape_roundtrip_collapses():
    a = arr("a", (3, 4), "i j")
    back = moa.reshape(moa.ravel(a), (3, 4), dims="i j")
    d = check(back, {"a": data((3, 4))[0]}, "ψ-reshape")
    # γ⁻¹(γ(p)) = p: the index arithmetic simplifies back to plain variables
    assert [i.as_var().name for i in only_read(d).index] == ["i", "j"]


@pytest.mark.parametrize("gamma", ["C", "F"])
def test_rule_reshape_gamma(gamma):
    a = arr("a", (2, 6), "i j")
    check(moa.reshape(a, (3, 4), gamma=gamma), {"a": data((2, 6))[0]}, "ψ-reshape")


def test_rule_catenate():
    a, b = arr("a", (2, 3)), arr("b", (4, 3))
    x, y = data((2, 3), (4, 3))
    d = check(moa.catenate(a, b), {"a": x, "b": y}, "ψ-catenate")
    assert d.arrays_read() == {"a", "b"}
    # a take that stays inside the first operand selects it statically
    d2 = check(moa.take(2, moa.catenate(a, b)), {"a": x, "b": y}, "ψ-catenate")
    assert d2.arrays_read() == {"a"}


def test_rule_psi():
    a = arr("a", (3, 4), "i j")
    d = check(moa.psi((2,), a), {"a": data((3, 4))[0]}, "ψ-psi")
    assert only_read(d).index[0] == Ix.of(2)


def test_rule_iota():
    d = check(moa.cast(moa.iota(5), np.float64) * 2.0, {}, "ψ-iota")
    assert any(isinstance(x, D.IndexValue) for x in D.walk(d.output.body))


def test_rule_map_scalar_extension():
    a = arr("a", (3,), "i")
    d = check(moa.exp(a) * 2.0 + a, {"a": data((3,))[0]}, "ψ-map")
    assert isinstance(d.output.body, D.Call)


def test_rule_cast():
    a = moa.array("a", (3,), "i", np.int32)
    check(moa.cast(a, np.float64), {"a": np.arange(3, dtype=np.int32)}, "ψ-cast")


def test_rule_outer():
    a, b = arr("a", (2,), "i"), arr("b", (3,), "j")
    d = check(moa.outer(moa.mul, a, b), dict(zip("ab", data((2,), (3,)))), "ψ-outer")
    assert {r.array: r.index[0].as_var().name for r in d.reads()} == {"a": "i", "b": "j"}


def test_rule_reduce_any_axis():
    a = arr("a", (2, 3, 4), "i j k")
    d = check(moa.reduce("max", a, axis=1), {"a": data((2, 3, 4))[0]}, "ψ-reduce")
    body = d.output.body
    assert isinstance(body, D.Red) and body.var.name == "j" and body.monoid == "max"


def test_rule_inner():
    a, b = arr("a", (2, 3), "i l"), arr("b", (3, 4), "l k")
    d = check(a @ b, dict(zip("ab", data((2, 3), (3, 4)))), "ψ-inner")
    body = d.output.body
    assert isinstance(body, D.Red) and body.monoid == "add" and body.var.extent == 3
    check(moa.inner("max", moa.add, a, b), dict(zip("ab", data((2, 3), (3, 4)))), "ψ-inner")


def test_rule_omega_and_cell():
    a, m = arr("a", (3, 4), "t s"), arr("m", (3,), "t")
    d = check(moa.omega(moa.sub, (1, 0))(a, m), dict(zip("am", data((3, 4), (3,)))), "ψ-omega")
    _, der = psi_reduce(moa.omega(moa.sub, (1, 0))(a, m))
    assert "ψ-cell" in der.rules_used()
    assert {r.array: tuple(i.as_var().name for i in r.index) for r in d.reads()} == {"a": ("t", "s"), "m": ("t",)}


def test_rule_cell_bound_to_an_enclosing_cell():
    # an inner Ω whose argument is a cell of the outer Ω: the inner cell's value depends on
    # the outer binding too, so two frame indices must not share one reduction (a memo bug
    # once gave ⟨b⟩ψg in both terms of ⍉Y + Y below)
    g = arr("g", (2,), "b")
    y = moa.omega(lambda _, dy: moa.omega(lambda _i, v: v, (0, 0))(moa.iota(2, "k"), dy), (1, 0))(arr("x", (2, 5), "b j"), g)
    d = check(y + moa.transpose(y), dict(zip("xg", data((2, 5), (2,)))), "ψ-cell")  # ⟨b k⟩ = g[b] + g[k]
    assert sorted(tuple(i.as_var().name for i in r.index) for r in d.reads()) == [("b",), ("k",)]


def test_rule_stop_gradient_is_transparent():
    a = arr("a", (3,), "i")
    d, _ = psi_reduce(moa.stop_gradient(a) * 2.0)
    e, _ = psi_reduce(a * 2.0)
    assert d.output.body is e.output.body


def test_rule_name():
    a = arr("a", (3,), "i")
    d = check(moa.name("row", a * 2.0), {"a": data((3,))[0]}, "ψ-name")
    assert isinstance(d.output.body, D.Tag) and d.output.body.label == "row"
    assert "row(i)" in d.pretty()


def test_derivation_prints_each_step():
    a = arr("a", (2, 3), "i j")
    _, der = psi_reduce(moa.transpose(a) * 2.0)
    text = der.pretty()
    assert "[ψ-map]" in text and "[ψ-transpose]" in text and "⟨j i⟩ψ" in text


def test_empty_reduction_is_the_identity():
    a = arr("a", (0, 3), "i j")
    d, _ = psi_reduce(moa.reduce("add", a))
    assert isinstance(d.output.body, D.Lit) and d.output.body.value == 0.0


def test_reduction_over_one_item_is_that_item():
    a, b = arr("a", (1, 3), "g j"), arr("b", (4, 1), "i g")
    d = check(moa.sum(a, 0) * 2.0, dict(a=data((1, 3))[0]), "ψ-reduce-one")
    assert not D.reductions(d.output.body) and only_read(d).index[0] == Ix.of(0)
    x = dict(a=data((1, 3))[0], b=data((4, 1))[0])
    d2 = check(moa.dot(b, a), x, "ψ-reduce-one")
    assert not D.reductions(d2.output.body)  # Σ_{g<1} of one product is that product


def test_rule_fuse_sums_and_factor_the_shared_product():
    # +/(c × a) + +/(c × b) along one axis of one extent: one pass, c factored out of both
    a, b, c = arr("a", (5, 3), "i j"), arr("b", (5, 3), "i j"), arr("c", (5, 3), "i j")
    x = dict(zip("abc", data((5, 3), (5, 3), (5, 3))))
    d = check(moa.sum(c * a, 0) + moa.sum(c * b, 0), x, "ψ-fuse-sums")
    (red,) = D.reductions(d.output.body)
    assert isinstance(red.body, D.Call) and red.body.op == "mul"  # c × (a + b)
    # sums over different extents, or of a non-float, stay two sums
    e = arr("e", (4, 3), "k j")
    d2, der = psi_reduce(moa.sum(a, 0) + moa.sum(e, 0))
    assert "ψ-fuse-sums" not in der.rules_used() and len(D.reductions(d2.output.body)) == 2
