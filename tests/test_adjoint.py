"""Adjoints derived in the algebra (moajax.adjoint): random expressions against jax.grad of the
reference, the seed kernels against the independent float64 backward references and the
hand-written paper kernels, and the errors for what has no rule.

Tolerance: float64 throughout. The derived backward and jax.grad of the reference compute the
same sums in different orders (and the softmax's Δ in another form), a few ulps per op over
a depth ≤ ~30: rel ≤ 1e-10 leaves four orders of margin."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import references as R
from exprgen import expressions
from helpers import inputs_of, op_by_op, rel_err, scaled_err
from moajax import adjoint, moa, reference
from moajax.adjoint import AdjointError
from moajax.kernels import attention_backward, rmsnorm_forward_backward, swiglu_forward_backward
from moajax.kernels.attention import attention, decode, mha
from moajax.kernels.mlp import swiglu
from moajax.kernels.norm import rmsnorm
from moajax.psi import reduce_to_dnf

F64 = 1e-10


@settings(max_examples=300)
@given(expressions(max_ops=6))
def test_derived_adjoint_equals_jax_grad_of_the_reference(case):
    expr, values, _ = case
    inputs = inputs_of(expr)
    if not inputs or not adjoint.differentiable(expr.dtype):
        return  # nothing to differentiate (a bool result, or constants only)
    d_out = moa.array("d_out", expr.shape, expr.dims, expr.dtype)
    grads = adjoint.vjp([expr], [d_out], inputs)  # every operation the generator uses has a rule
    grads = [adjoint.zeros_like(x) if d is None else d for x, d in zip(inputs, grads)]
    names = tuple(f"d_{x.name}" for x in inputs)
    dnf, _ = reduce_to_dnf("adjoint", inputs + [d_out], tuple(grads), names, record=False)
    assert dnf.arrays_read() <= {x.name for x in inputs} | {"d_out"}  # a DNF: inputs only
    g = np.random.default_rng(len(names)).standard_normal(expr.shape)
    args = [values[x.name] for x in inputs]
    fwd, _ = reduce_to_dnf("forward", inputs, expr, record=False)
    with op_by_op():
        got = reference.to_jax(dnf)(*args, g)
        got = got if isinstance(got, tuple) else (got,)
        _, pullback = jax.vjp(reference.to_jax(fwd), *[jnp.asarray(a) for a in args])
        want = pullback(jnp.asarray(g))
    for name, a, b in zip(names, got, want):
        # the inputs and d_out are standard normals: where a gradient cancels to 0 (d/dx of
        # a − a), its rounding residue is relative to that O(1) scale, not to 0
        assert scaled_err(a, b) <= F64, name


def _rand(*shapes, seed=0):
    r = np.random.default_rng(seed)
    return [r.standard_normal(s) for s in shapes]


@pytest.mark.parametrize("t,s,h,e,causal", [(8, 12, 4, 6, False), (5, 7, 3, 2, True), (1, 9, 4, 4, False)])
def test_derived_attention_backward_equals_paper_ii(t, s, h, e, causal):
    q, k, v, g = _rand((t, h), (s, h), (s, e), (t, e), seed=t)
    got = attention.adjoint()(q, k, v, g, is_causal=causal)
    want = R.attention_backward(q, k, v, g, is_causal=causal)
    hand = attention_backward(q, k, v, g, is_causal=causal)  # paper II's kernel, kept as a reference
    for a, b, c in zip(got, want, hand):
        assert rel_err(a, b) <= F64 and rel_err(c, b) <= F64


def test_derived_mha_backward_with_gqa():
    B, T, S, N, K, H = 2, 5, 6, 4, 2, 3
    q, k, v, g = _rand((B, T, N, H), (B, S, K, H), (B, S, K, H), (B, T, N, H), seed=3)
    got = mha.adjoint()(q, k, v, g, is_causal=True)
    want = R.mha_backward(q, k, v, g, is_causal=True)
    for a, b in zip(got, want[:3]):
        assert rel_err(a, b) <= F64


def test_derived_rmsnorm_and_swiglu_backward_equal_paper_iv():
    x, w, gz = _rand((6, 8), (8,), (6, 8), seed=1)
    dx, dw = rmsnorm.adjoint()(x, w, gz, eps=1e-5)
    rx, rw = R.rmsnorm_backward(x, w, gz, eps=1e-5)
    _, hx, hw = rmsnorm_forward_backward(x, w, gz, eps=1e-5)
    assert rel_err(dx, rx) <= F64 and rel_err(dw, rw) <= F64 and rel_err(hx, rx) <= F64 and rel_err(hw, rw) <= F64
    z, wg, wu, wd, gf = _rand((5, 4), (4, 7), (4, 7), (7, 4), (5, 4), seed=2)
    got = swiglu.adjoint()(z, wg, wu, wd, gf)
    want = R.swiglu_backward(z, wg, wu, wd, gf)
    hand = swiglu_forward_backward(z, wg, wu, wd, gf)[1:]
    for a, b, c in zip(got, want, hand):
        assert rel_err(a, b) <= F64 and rel_err(c, b) <= F64


def test_adjoint_kernel_interface():
    adj = attention.adjoint()
    assert [p.name for p in adj.params] == ["query", "key", "value", "d_out"]
    assert adj.output_names == ("d_query", "d_key", "d_value") and "is_causal" in adj.options
    dnf = adj.dnf()
    assert [o.name for o in dnf.outputs] == ["d_query", "d_key", "d_value"]
    assert dnf.arrays_read() == {"query", "key", "value", "d_out"}
    only_v = decode.adjoint(wrt=("value",))
    assert only_v.output_names == ("d_value",)
    with pytest.raises(ValueError, match="wrt names 'nope'"):
        decode.adjoint(wrt=("nope",))


def test_the_softmax_identity_holds_the_max_constant():
    # softmax subtracts its row max through stop_gradient: the adjoint has no selection term
    a = moa.array("a", (3, 5), "t s", np.float64)
    g = moa.array("d_out", (3, 5), "t s", np.float64)
    (da,) = adjoint.vjp([moa.softmax(a)], [g], [a])
    assert not any(isinstance(x, moa.Map) and x.op.name == "eq" for x in moa.nodes(da))
    (dm,) = adjoint.vjp([moa.amax(a, -1)], [moa.array("d_m", (3,), "t", np.float64)], [a])
    assert any(isinstance(x, moa.Map) and x.op.name == "eq" for x in moa.nodes(dm))  # selection


def test_paths_into_a_16_bit_operand_meet_in_float32_and_round_once():
    """x bfloat16 read through two widening casts: Y = float32(x) × a − float32(x) × b, with
    a = 1 + 3·2⁻¹² and b = 1 (float32). dx = a − b = 3·2⁻¹², a bfloat16 value: the two paths'
    cotangents are summed in float32, then rounded once. Rounded at each cast (before
    2026-12-06) they were bfloat16 1 and −1, and dx came out 0."""
    bf16 = jnp.bfloat16
    x = moa.array("x", (4,), ("n",), bf16)
    a, b = (moa.array(n, (4,), ("n",), np.float32) for n in ("a", "b"))
    y = moa.cast(x, np.float32) * a - moa.cast(x, np.float32) * b
    d_y = moa.array("d_y", (4,), ("n",), np.float32)
    (dx,) = adjoint.vjp([y], [d_y], [x])
    assert dx.dtype == bf16  # (the cotangent of x, in x's dtype)
    dnf, _ = reduce_to_dnf("adjoint", [x, a, b, d_y], (dx,), ("d_x",), record=False)
    one = np.ones(4, np.float32)
    got = reference.to_jax(dnf)(np.ones(4, bf16), one + 3 * 2.0 ** -12, one, one)
    assert got.dtype == bf16 and np.array_equal(np.asarray(got, np.float64), np.full(4, 3 * 2.0 ** -12))


def test_a_16_bit_constant_is_read_widened_as_its_own_dtype_holds_it():
    """float32(maximum(x, 0.1)) and float32(x × 0.3) for bfloat16 x: the cotangent reaching
    them is float32, and the rules read the constants as bfloat16 holds them (0.1 → 0.10009765625,
    0.3 → 0.30078125), as the forward used them. Widened from the Python numbers (found by
    review), a tie at x = bfloat16(0.1) was missed (dx 1, where JAX gives ½) and dx of x × 0.3 was
    a bfloat16 ulp off g × bfloat16(0.3)."""
    bf16 = jnp.bfloat16
    x = moa.array("x", (3,), ("i",), bf16)
    xv = np.asarray([0.1, 0.2, 0.05], bf16)

    def dx(y, g):
        d = moa.array("d", y.shape, y.dims, y.dtype)
        (grad,) = adjoint.vjp([y], [d], [x])
        dnf, _ = reduce_to_dnf("adjoint", [x, d], (grad,), ("d_x",), record=False)
        return np.asarray(reference.to_jax(dnf)(xv, g), np.float64)

    g = np.full(3, 1.5, np.float32)
    want = jax.grad(lambda x: jnp.sum(jnp.maximum(x, bf16(0.1)).astype(np.float32) * 1.5))(jnp.asarray(xv))
    assert np.array_equal(dx(moa.cast(moa.maximum(x, 0.1), np.float32), g), np.asarray(want, np.float64))  # ½ at the tie
    exact = np.asarray(np.asarray(1.5 * float(np.asarray(0.3, bf16)), np.float64).astype(bf16), np.float64)
    assert np.array_equal(dx(moa.cast(x * 0.3, np.float32), g), np.full(3, exact))


def test_a_16_bit_subexpressions_rules_read_its_values_widened():
    """Z = float32(⌈/ (exp(X) × X) +.× W) for bfloat16 X [3 4], W [4 2]: the cotangent reaching
    the bfloat16 part is float32, and each rule (the inner product, the max's selection, ×,
    exp) reads the bfloat16 values it needs widened, exactly (without ``widened`` the rules
    raise MoATypeError: this bound cannot tell carried cotangents from rounded ones — the test
    above does). Against float64 of the same
    formula on those rounded values (dX = G·Wᵀ at the max rows × exp(X)(1 + X)), rounded to
    bfloat16 once: within one bfloat16 ulp (2⁻⁷ of the value; float32 sums and float64 may
    round to neighbours)."""
    bf16 = jnp.bfloat16
    X = moa.array("X", (3, 4), ("t", "d"), bf16)
    W = moa.array("W", (4, 2), ("d", "f"), bf16)
    U = moa.exp(X) * X
    Z = moa.cast(moa.reduce("max", U @ W, 0), np.float32)
    g = moa.array("g", (2,), ("f",), np.float32)
    dX, dW = adjoint.vjp([Z], [g], [X, W])
    assert dX.dtype == bf16 and dW.dtype == bf16
    dnf, _ = reduce_to_dnf("adjoint", [X, W, g], (dX, dW), ("d_X", "d_W"), record=False)
    r = np.random.default_rng(3)
    xv, wv = (np.asarray(r.standard_normal(sh), bf16) for sh in ((3, 4), (4, 2)))
    gv = r.standard_normal(2).astype(np.float32)
    got = [np.asarray(v, np.float64) for v in reference.to_jax(dnf)(xv, wv, gv)]
    x64, w64 = np.asarray(xv, np.float64), np.asarray(wv, np.float64)
    e64 = np.asarray(np.exp(xv.astype(np.float32)).astype(bf16), np.float64)  # exp(X) as bfloat16 rounds it
    u = np.asarray((e64 * x64).astype(bf16), np.float64)  # U, rounded as its bfloat16 product
    v = np.asarray((u @ w64).astype(bf16), np.float64)  # U +.× W in bfloat16
    hit = (v == v.max(axis=0)).astype(np.float64)
    dv = hit * gv / hit.sum(axis=0)  # [t f]
    du = dv @ w64.T
    want_x = du * (e64 + x64 * e64)  # d(exp(X) × X) = (exp(X) + X·exp(X)) dU
    want_w = u.T @ dv
    for got_, want in ((got[0], want_x), (got[1], want_w)):
        rounded = np.asarray(want.astype(bf16), np.float64)
        assert np.all(np.abs(got_ - rounded) <= 2.0 ** -7 * np.abs(rounded) + 1e-30)


def test_operations_without_a_rule_are_named():
    a = moa.array("a", (3, 4), "t s", np.float64)
    w = moa.array("w", (4,), "s", np.float64)
    captured = moa.omega(lambda row: row * w, 1)(a)  # w captured, not an argument
    with pytest.raises(AdjointError, match="captures w"):
        adjoint.vjp([captured], [moa.array("g", (3, 4), "t s", np.float64)], [a, w])


def test_bool_and_int_inputs_get_no_cotangent():
    x = moa.array("x", (4,), "i", np.float64)
    m = moa.array("m", (4,), "i", np.bool_)
    n = moa.array("n", (4,), "i", np.int32)
    y = moa.where(m, x * moa.cast(n, np.float64), 0.0)
    dx, dm, dn = adjoint.vjp([y], [moa.array("g", (4,), "i", np.float64)], [x, m, n])
    assert dx is not None and dm is None and dn is None


def test_a_max_selection_equals_jax_grad_wherever_its_two_evaluations_agree():
    """dA of ⌈/ is (A = Y) × dY ÷ #(A = Y): the hit and its count are separate evaluations of
    A = Y (the DNF keeps no intermediate). For (x ×.× x) ⌈.+ (x ×.× x) at this x (found by
    hypothesis in test_identities) the jitted reference fuses them differently, and the count
    misses where the hit fires: ±inf, loud, as jax.grad's own reduce_max rule gives 0/0 on
    x0 ⌈.+ u (test_derived_adjoint_equals_jax_grad_of_the_reference found it). Op by op
    (helpers.op_by_op), in NumPy on the un-reduced rule, and in moajax's compiled kernel of the
    derived DNF, the gradient is jax.grad's (no ties here)."""
    from moajax import machines, numpy_eval, runtime, schedule

    x_val = np.array([0.54784675, -0.92085314])
    x = moa.array("x0", (2,), None, np.float64)
    A = moa.outer(moa.mul, x, x)
    expr = moa.inner("max", moa.add, A, A)
    d_out = moa.array("d_out", expr.shape, expr.dims, expr.dtype)
    (grad,) = adjoint.vjp([expr], [d_out], [x])
    adj, _ = reduce_to_dnf("adjoint", [x, d_out], (grad,), ("d_x0",), record=False)
    g = np.random.default_rng(3).standard_normal(expr.shape)

    def plain(v):  # ⟨i j⟩: max over k of v_i v_k + v_k v_j
        a = jnp.outer(v, v)
        return jnp.max(a[:, :, None] + a[None, :, :], axis=1)

    with op_by_op():
        want = np.asarray(jax.grad(lambda v: jnp.sum(plain(v) * g))(jnp.asarray(x_val)))  # float64 (conftest)
        assert rel_err(reference.to_jax(adj)(x_val, g), want) <= F64
    assert rel_err(numpy_eval.evaluate(grad, {"x0": x_val, "d_out": g}), want) <= F64
    compiled = runtime.lowered(schedule.derive(adj, machines.local()), "xla")(x_val, g)
    assert rel_err(np.asarray(compiled), want) <= F64


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_reference_reads_an_instance_of_a_reduction_from_the_general_one(dtype):
    """(x +.× w) = ⟨0⟩ψ(x +.× w) at row 0 is true, bit for bit: the DNF holds Σ_c x[b,c]·w[c]
    over every row b and at b = 0, one value (a selection compares them: ⌈/'s adjoint, the
    cases hypothesis found). Evaluated apart — a matrix-vector and a vector-vector einsum —
    they rounded apart for each of these draws (before 2026-12-06); the reference reads the
    instance from the general reduction (``reference.Evaluator.reduce_once``)."""
    n = 1000
    x = moa.array("x", (5, n), "b c", dtype)
    w = moa.array("w", (n,), "c", dtype)
    a = moa.dot(x, w)
    dnf, _ = reduce_to_dnf("f", [x, w], moa.eq(a, moa.psi((0,), a)), record=False)
    for seed in range(16, 20):
        r = np.random.default_rng(seed)
        with op_by_op():
            out = reference.to_jax(dnf)(r.standard_normal((5, n)).astype(dtype), r.standard_normal(n).astype(dtype))
        assert bool(out[0])


@pytest.mark.parametrize("op", ["add", "sub", "mul"])
def test_the_reference_reads_no_instance_beyond_the_general_reductions_range(op):
    """(x ⧺ x) op.× (x ⧺ x), x [1, 2] (hypothesis found it): the adjoint sums d_out at ⟨a …⟩,
    a < 1, and at ⟨1 …⟩, the catenation's second half. ⟨1⟩ matches the first sum with a := 1,
    beyond the range its array holds (a's extent is 1); read from it (clipped to row 0), the
    gradient was wrong. The reference reads an instance only within the general one's range."""
    x1 = moa.array("x1", (1, 2), "a b", np.float64)
    c = moa.catenate(x1, x1, axis=0)
    expr = moa.outer(getattr(moa, op), c, c)
    d_out = moa.array("d_out", expr.shape, expr.dims, expr.dtype)
    (grad,) = adjoint.vjp([expr], [d_out], [x1])
    dnf, _ = reduce_to_dnf("adjoint", [x1, d_out], (grad,), ("d_x1",), record=False)
    x = np.array([[0.54784675, -0.92085314]])
    g = np.random.default_rng(1).standard_normal(expr.shape)
    with op_by_op():
        got = reference.to_jax(dnf)(x, g)
    # independent: Y[i j k l] = c[i j] op c[k l], c = x ⧺ x, so both halves of c are x
    cc = np.concatenate([x, x])
    if op == "mul":
        dc = np.einsum("ijkl,kl->ij", g, cc) + np.einsum("ijkl,ij->kl", g, cc)
    else:
        dc = g.sum((2, 3)) + (1 if op == "add" else -1) * g.sum((0, 1))
    assert rel_err(got, dc[:1] + dc[1:]) <= F64
