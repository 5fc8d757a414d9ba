"""Tangents derived in the algebra (moajax.tangent): random expressions against jax.jvp of the
reference, the transpose of each tangent against the derived adjoint, and the errors for what
has no rule.

Tolerance: float64 throughout. The derived tangent and jax.jvp of the reference compute the
same sums in different orders, a few ulps per op over a depth ≤ ~30: rel ≤ 1e-10 leaves four
orders of margin."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from exprgen import expressions
from helpers import inputs_of, op_by_op, rel_err
from moajax import adjoint, moa, reference, tangent
from moajax.kernels.attention import attention
from moajax.kernels.norm import rmsnorm
from moajax.psi import reduce_to_dnf
from moajax.tangent import TangentError

F64 = 1e-10


@settings(max_examples=300)
@given(expressions(max_ops=6))
def test_derived_tangent_equals_jax_jvp_of_the_reference(case):
    expr, values, _ = case
    inputs = [x for x in inputs_of(expr) if adjoint.differentiable(x.dtype)]
    if not inputs or not adjoint.differentiable(expr.dtype):
        return  # nothing to differentiate (a bool result, or no floating input)
    dots = [moa.array(f"t_{x.name}", x.shape, x.dims, x.dtype) for x in inputs]
    (t,) = tangent.jvp([expr], inputs, dots)  # every operation the generator uses has a rule
    t = adjoint.zeros_like(expr) if t is None else t
    rest = [x for x in inputs_of(expr) if x not in inputs]
    dnf, _ = reduce_to_dnf("tangent", inputs + rest + dots, t, record=False)
    assert dnf.arrays_read() <= {x.name for x in inputs + rest + dots}  # a DNF: inputs only
    r = np.random.default_rng(len(inputs))
    args = [values[x.name] for x in inputs]
    fixed = [values[x.name] for x in rest]
    moves = [r.standard_normal(x.shape) for x in inputs]
    fwd, _ = reduce_to_dnf("forward", inputs + rest, expr, record=False)
    with op_by_op():  # helpers.op_by_op: a selection's hit and count from one evaluation
        got = reference.to_jax(dnf)(*args, *fixed, *moves)
        want = jax.jvp(lambda *a: reference.to_jax(fwd)(*a, *fixed), [jnp.asarray(a) for a in args],
                       [jnp.asarray(m) for m in moves])[1]
    assert rel_err(got, want) <= F64


def test_the_tangent_kernel_is_the_transpose_of_the_adjoint():
    # ⟨J ẋ, ȳ⟩ = ⟨ẋ, Jᵀ ȳ⟩: the two kernels derived independently by their own rules
    specs = [jax.ShapeDtypeStruct(s, np.float64) for s in [(6, 4), (9, 4), (9, 3)]]
    r = np.random.default_rng(1)
    args = [r.standard_normal(s.shape) for s in specs]
    dots = [r.standard_normal(s.shape) for s in specs]
    ybar = r.standard_normal((6, 3))
    jx = attention.tangent(*specs).reference(*args, *dots)
    jty = attention.adjoint(*specs).reference(*args, ybar)
    lhs = np.sum(np.asarray(jx) * ybar)
    rhs = sum(np.sum(d * np.asarray(g)) for d, g in zip(dots, jty))
    assert abs(lhs - rhs) <= F64 * abs(lhs)


def test_tangent_kernel_interface():
    tk = rmsnorm.tangent()
    assert [p.name for p in tk.params] == ["x", "weight", "t_x", "t_weight"]
    assert tk.output_names == ("t_out",)
    dnf = tk.dnf()
    assert dnf.arrays_read() == {"x", "weight", "t_x", "t_weight"}
    # a tangent of a tangent kernel gets names of its own
    assert [p.name for p in tk.tangent().params][4:] == ["t2_x", "t2_weight", "t2_t_x", "t2_t_weight"]


def test_operations_without_a_rule_are_named():
    a = moa.array("a", (3, 4), "t s", np.float64)
    w = moa.array("w", (4,), "s", np.float64)
    captured = moa.omega(lambda row: row * w, 1)(a)  # w captured, not an argument
    with pytest.raises(TangentError, match="captures w"):
        tangent.jvp([captured], [a, w], [moa.array("ta", (3, 4), "t s", np.float64), moa.array("tw", (4,), "s", np.float64)])


def test_bool_and_int_inputs_carry_no_tangent_and_held_values_none():
    x = moa.array("x", (4,), "i", np.float64)
    m = moa.array("m", (4,), "i", np.bool_)
    n = moa.array("n", (4,), "i", np.int32)
    y = moa.where(m, x * moa.cast(n, np.float64), 0.0)
    tx = moa.array("tx", (4,), "i", np.float64)
    (t,) = tangent.jvp([y], [x, m, n], [tx, moa.array("tm", (4,), "i", np.bool_), moa.array("tn", (4,), "i", np.int32)])
    assert t is not None and "tm" not in moa.moa_str(t) and "tn" not in moa.moa_str(t)
    (held,) = tangent.jvp([moa.stop_gradient(x) * 2.0], [x], [tx])
    assert held is None
