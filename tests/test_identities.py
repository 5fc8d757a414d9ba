"""The papers' identities as rewrites of adjoint DNFs (moajax.identities), and the matcher
they stand on (moajax.dnf.match).

output-reuse: where the forward's output Y = c · Σ_s G is held, the adjoint's a · Σ_s G is
(a ÷ c) · Y. Δ-from-output: the adjoint's Σ_s F × (dY +.× ⍉W) becomes (F ÷ G) · +/(dY × Y)
— for softmax attention, paper II's Δ = +/(P × dP) = +/(dO × O). Each rewritten adjoint is checked against independent float64
references; sums are reordered, so float64 agrees to a few ulps per op: rel ≤ 1e-10."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import moajax
import references as R
from exprgen import expressions
from helpers import op_by_op, rel_err
from moajax import adjoint, compat, identities, moa, reference
from moajax import dnf as D
from moajax.ix import Ix, Var
from moajax.kernels import attention
from moajax.kernels.attention import mha_kernel
from moajax.psi import reduce_to_dnf

F64 = 1e-10
S = jax.ShapeDtypeStruct


def _saved_adjoint(kern, specs, rounded=True, **options):
    """(the adjoint that reads the forward's statistics and outputs, its argument specs);
    ``rounded``: after a forward whose dots round (a GPU's), or not (an XLA forward on a CPU)."""
    key = kern._key(specs, options)
    adj = kern._adjoint_for(key, options, True, rounded=rounded)
    outs = kern._build(specs, options)[1]
    outs = outs if isinstance(outs, tuple) else (outs,)
    cts = [S(o.shape, o.dtype) for o in outs]
    return adj, list(specs) + cts + kern._saved_specs(specs, options) + cts


def _labelled(dnf, label):
    return [x for o in dnf.outputs for x in D.walk(o.body) if isinstance(x, D.Tag) and x.label == label]


@pytest.mark.parametrize("causal", [False, True])
def test_attention_adjoint_reads_delta_from_the_output(causal):
    t, s, h, e = 6, 9, 4, 5
    with compat.enable_x64_context(True):
        specs = [S((t, h), np.float64), S((s, h), np.float64), S((s, e), np.float64)]
        adj, aspecs = _saved_adjoint(attention, specs, is_causal=causal)
        der = adj.derivation(*aspecs, is_causal=causal)
        assert identities.DELTA_FROM_OUTPUT in der.rules_used()
        dnf = adj.dnf(*aspecs, is_causal=causal)
        # the denominator's cotangent −Δ/l reads dO and O (one pass over e), not V (a pass over s)
        ddens = _labelled(dnf, "dden")
        assert ddens and all({r.array for r in D.reads(x)} == {"d_out", "out", "saved1"} for x in ddens)
        r = np.random.default_rng(1)
        q, k, v, g = (r.standard_normal(shape) for shape in ((t, h), (s, h), (s, e), (t, e)))
        saving = attention.with_row_statistics()
        *stats, out = saving.reference(q, k, v, is_causal=causal)
        got = adj.reference(q, k, v, g, *stats, out, is_causal=causal)
    for a, b in zip(got, R.attention_backward(q, k, v, g, is_causal=causal)):
        assert rel_err(a, b) <= F64


@pytest.mark.parametrize("kv_heads", [4, 2])  # multi-head, and GQA (two query heads per kv head)
def test_mha_grad_runs_the_rewritten_adjoint(kv_heads):
    B, T, N, H = 2, 7, 4, 3
    r = np.random.default_rng(kv_heads)
    q, g = r.standard_normal((B, T, N, H)), r.standard_normal((B, T, N, H))
    k, v = r.standard_normal((B, T, kv_heads, H)), r.standard_normal((B, T, kv_heads, H))
    kern = mha_kernel(None, None, kv_heads != N)
    with compat.enable_x64_context(True):
        specs = [S(x.shape, np.float64) for x in (q, k, v)]
        adj, aspecs = _saved_adjoint(kern, specs, is_causal=True)
        assert identities.DELTA_FROM_OUTPUT in adj.derivation(*aspecs, is_causal=True).rules_used()
        got = jax.grad(lambda *a: jnp.sum(moajax.dot_product_attention(*a, is_causal=True) * g),
                       argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(got, R.mha_backward(q, k, v, g, is_causal=True)):
        assert rel_err(a, b) <= F64


@moajax.kernel(example=dict(t=5, s=8, h=3, e=4), register=False)
def normalised_relu_attention(query: "t h", key: "s h", value: "s e"):
    """(A +.× V) ÷ +/A with A = relu(Q +.× ⍉K) + 1: a normaliser that is not a softmax."""
    a = moa.maximum(moa.dot(query, moa.transpose(key)), 0.0) + 1.0
    den = moa.name("den", moa.sum(a, axis=-1))
    return moa.omega(moa.div, (1, 0))(moa.dot(a, value), den)


def test_the_identity_is_not_about_softmax():
    """Y = (A +.× V) ÷ l: the adjoint's cotangent of l is −+/(dY × (A +.× V)) ÷ l², where
    A +.× V = Y · l is read back (output-reuse): −+/(dY × Y) ÷ l, no pass over s."""
    t, s, h, e = 5, 8, 3, 4
    r = np.random.default_rng(5)
    q, k, v, g = r.standard_normal((t, h)), r.standard_normal((s, h)), r.standard_normal((s, e)), r.standard_normal((t, e))
    with compat.enable_x64_context(True):
        specs = [S(x.shape, np.float64) for x in (q, k, v)]
        adj, aspecs = _saved_adjoint(normalised_relu_attention, specs)
        assert identities.OUTPUT_REUSE in adj.derivation(*aspecs).rules_used()
        (dden,) = {x for x in _labelled(adj.dnf(*aspecs), "dden")}
        assert "value" not in {r.array for r in D.reads(dden)}
        got = jax.grad(lambda *a: jnp.sum(normalised_relu_attention(*a) * g), argnums=(0, 1, 2))(q, k, v)
    a = np.maximum(q @ k.T, 0) + 1
    l = a.sum(-1, keepdims=True)
    y = a @ v / l
    # independent float64 backward: dA = (dY ⍉V − +/(dY × Y)) ÷ l, through relu
    da = (g @ v.T - (g * y).sum(-1, keepdims=True)) / l * (q @ k.T > 0)
    want = (da @ k, da.T @ q, (a / l).T @ g)
    for x, w in zip(got, want):
        assert rel_err(x, w) <= F64


def test_a_rounded_output_is_not_read_back_its_value_before_rounding_is():
    # bfloat16 attention casts its float32 output down: reading the bfloat16 Out back would
    # change Δ by its rounding, so the forward also saves Out before the cast, and Δ reads that
    specs = [S((4, 8), jnp.bfloat16), S((6, 8), jnp.bfloat16), S((6, 8), jnp.bfloat16)]
    adj, aspecs = _saved_adjoint(attention, specs)
    assert identities.DELTA_FROM_OUTPUT in adj.derivation(*aspecs).rules_used()
    dnf = adj.dnf(*aspecs)
    held = [i.name for i in dnf.inputs if i.name.startswith("saved") and i.shape == (4, 8)]
    assert held and dnf.input(held[0]).dtype == np.float32 and held[0] in dnf.arrays_read()
    assert "out" not in dnf.arrays_read()
    r = np.random.default_rng(4)
    q, k, v, g = (jnp.asarray(r.standard_normal(x), jnp.bfloat16) for x in ((4, 8), (6, 8), (6, 8), (4, 8)))
    got = jax.grad(lambda *a: jnp.sum(attention(*a).astype(jnp.float32) * g.astype(jnp.float32)),
                   argnums=(0, 1, 2))(q, k, v)
    want = R.attention_backward(*(np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v, g)))
    for a, b in zip(got, want):
        # float32 inside; each gradient is rounded once to bfloat16 (2^-8 relative): 2^-7
        assert rel_err(np.asarray(a.astype(jnp.float32)), b) <= 2 ** -7


@pytest.mark.parametrize("kv_lengths", [False, True])
def test_the_identity_reads_through_a_query_length_guard(kv_lengths):
    """Out = (t < L[b] ? Σ_s P × V : 0), and dOut is guarded alike (jax.nn's rows past a query
    length are 0 and pass no cotangent back): Δ = +/(dO × O) holds on both sides of the guard
    (0 = 0 past it), so the adjoint reads Out instead of summing P × dP over the keys. A batch
    element of length 0 (every row guarded) has finite, zero gradients."""
    B, T, N, H = 3, 7, 2, 3
    r = np.random.default_rng(11)
    q, k, v, g = (r.standard_normal((B, T, N, H)) for _ in range(4))
    ql = np.asarray([7, 4, 0], np.int32)
    kl = np.asarray([5, 7, 3], np.int32) if kv_lengths else None
    kern = mha_kernel(None, None, False, True, kv_lengths)
    with compat.enable_x64_context(True):
        specs = [S(x.shape, np.float64) for x in (q, k, v)] + [S((B,), np.int32)] * (1 + kv_lengths)
        adj, aspecs = _saved_adjoint(kern, specs)
        assert identities.DELTA_FROM_OUTPUT in adj.derivation(*aspecs).rules_used()
        extra = dict(key_value_seq_lengths=jnp.asarray(kl)) if kv_lengths else {}
        got = jax.grad(lambda *a: jnp.sum(moajax.dot_product_attention(
            *a, query_seq_lengths=jnp.asarray(ql), **extra) * g), argnums=(0, 1, 2))(q, k, v)
    want = R.mha_variants(q, k, v, query_seq_lengths=ql, key_value_seq_lengths=kl, dout=g)[:3]
    for a, b in zip(got, want):
        assert np.all(np.isfinite(a)) and rel_err(a, b) <= F64
    assert not np.any(np.asarray(got[0])[2])  # (every row of batch element 2 past its length)


def test_a_finer_gradient_recomputes_delta_rather_than_read_a_16_bit_output():
    """bfloat16 attention with ALiBi slopes in float32: the 16-bit forward's Out carries its
    dots' rounding of P (a GPU's), so Δ = +/(dO × O) is good to 2⁻⁹. dQ, dK and dV (bfloat16)
    read it; the slopes' float32 gradient sums P × dP over the keys itself (Σ_s dS cancels
    only against its own P: bench/results/table_grad_precision.md)."""
    from moajax.api import _check_score_mod

    slopes = jnp.linspace(0.1, 0.4, 4, dtype=jnp.float32)
    fn = _check_score_mod(lambda s, b, h, i, j: s - slopes[h] * jnp.abs(i - j), jnp.bfloat16)
    kern = mha_kernel(None, None, True, score_mod=fn)
    specs = [S((1, 6, 4, 8), jnp.bfloat16), S((1, 5, 2, 8), jnp.bfloat16), S((1, 5, 2, 8), jnp.bfloat16),
             S((4,), jnp.float32)]
    adj, aspecs = _saved_adjoint(kern, specs)
    dnf = adj.dnf(*aspecs)
    held = {i.name for i in dnf.inputs if i.name.startswith("saved") and i.dtype == np.float32
            and i.shape == (6, 4, 8)}  # (Out before rounding, in its rows' layout)
    assert held
    reads = {o.name: {x.array for x in D.reads(o.body)} for o in dnf.outputs}
    (d_slopes,) = [o.name for o in dnf.outputs if o.dtype == np.float32]
    assert not reads[d_slopes] & held and "value" in reads[d_slopes]  # (dP = dO +.× ⍉V, summed)
    assert all(reads[o.name] & held for o in dnf.outputs if o.name != d_slopes and o.name != "d_value")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_a_table_gradient_recomputes_delta_after_a_forward_with_rounded_dots(dtype):
    """ALiBi slopes in the queries' dtype (bfloat16 or float32): the slopes' gradient sums dS ×
    |i − j| over rows and keys, the difference of the rows' sums (Σ_s dS = 0), so a Δ read from
    an Out its dots rounded (a GPU's: 16-bit operands, TF32) adds each row's error unreduced.
    After such a forward it sums P × dP over the keys itself, whatever its dtype; after an XLA
    forward on a CPU (``rounded=False``: its float32 dots round only their sums) it reads Out,
    as dQ and dK do after either (bench/results/table_grad_precision.md)."""
    from moajax.api import _check_score_mod

    slopes = jnp.linspace(0.1, 0.4, 4, dtype=dtype)
    fn = _check_score_mod(lambda s, b, h, i, j: s - slopes[h] * jnp.abs(i - j), dtype)
    kern = mha_kernel(None, None, True, score_mod=fn)
    specs = [S((1, 6, 4, 8), dtype), S((1, 5, 2, 8), dtype), S((1, 5, 2, 8), dtype), S((4,), dtype)]
    # (a GPU's forward rounds its dots to 16 bits only for a 16-bit Out; TF32 is not counted)
    assert kern.gpu_dots_round(kern._key(specs, {}), {}) is (dtype == jnp.bfloat16)
    for rounded in (True, False):
        adj, aspecs = _saved_adjoint(kern, specs, rounded=rounded)
        dnf = adj.dnf(*aspecs)
        held = {i.name for i in dnf.inputs if i.name.startswith("saved") and i.shape == (6, 4, 8)} | {"out"}
        reads = {o.name: {x.array for x in D.reads(o.body)} for o in dnf.outputs}
        d_slopes = dnf.outputs[-1].name
        assert bool(reads[d_slopes] & held) is not rounded, rounded
        assert "value" in reads[d_slopes]  # (dP = dO +.× ⍉V, summed either way)
        assert all(reads[o.name] & held for o in dnf.outputs[:2]), rounded  # dQ, dK


def test_delta_summed_over_rows_and_keys_is_found_where_it_stands():
    """``_summed_over_rows_and_keys`` on hand-built sums of a row's Δ(t): under Σ_t alone (dK's
    form), under Σ_s alone (dQ's), under both (a table's), and a Δ the body no longer holds."""
    t, s, e = Var("t", 3), Var("s", 4), Var("e", 2)
    f = np.dtype(np.float64)
    delta = D.Red("add", e, D.Call("mul", (D.Read("d_out", (t, e), f), D.Read("out", (t, e), f))))
    w = D.Read("w", (t, s), f)
    term = D.Call("mul", (w, delta))
    assert not identities._summed_over_rows_and_keys(D.Red("add", t, term), [delta])
    assert not identities._summed_over_rows_and_keys(D.Red("add", s, term), [delta])
    assert identities._summed_over_rows_and_keys(D.Red("add", t, D.Red("add", s, term)), [delta])
    assert identities._summed_over_rows_and_keys(D.Red("add", t, w), [delta])  # (not found: its sums unknown)


@pytest.mark.parametrize("guarded", ["s", "t"])
def test_a_cotangents_guard_on_the_summed_variable_keeps_it_in_the_sum(guarded):
    """Y = +/(P × V) over s; the adjoint's Σ_s P × Σ_e ((g < 2) ? dY : 0) × V. A guard on t
    moves out of Σ_s with dY (Δ = Σ_e ((t < 2) ? dY : 0) × Y); one on s cannot — moved out,
    it left s unbound, or read the output's own s (found by review, 2026-12-06)."""
    T, S_, E = 3, 4, 2
    f = np.float64
    t, s, e = Var("t", T), Var("s", S_), Var("e", E)

    def mul(a, b):
        return D.Call("mul", (a, b))

    ins = (D.InputSpec("P", (T, S_), ("t", "s"), np.dtype(f)), D.InputSpec("V", (S_, E), ("s", "e"), np.dtype(f)))
    y = D.Output("y", (T, E), ("t", "e"), (t, e), D.Red("add", s, mul(D.Read("P", (t, s), f), D.Read("V", (s, e), f))))
    g = D.Call("lt", (D.IndexValue({"s": s, "t": t}[guarded]), D.Lit(2, np.int32)))
    dy = D.Call("where", (g, D.Read("d_out", (t, e), f), D.Lit(0.0, f)))
    body = D.Red("add", s, mul(D.Read("P", (t, s), f), D.Red("add", e, mul(dy, D.Read("V", (s, e), f)))))
    adj = D.DNF("adjoint", ins + (D.InputSpec("d_out", (T, E), ("t", "e"), np.dtype(f)),
                                  D.InputSpec("y", (T, E), ("t", "e"), np.dtype(f))),
                (D.Output("d_x", (T, S_), ("t", "s"), (t, s), body),))
    new, applied = identities.delta_from_output(adj, D.DNF("forward", ins, (y,)), {"d_out": "y"}, {"y": "y"}, {})
    assert [a.rule for a in applied] == ([] if guarded == "s" else [identities.DELTA_FROM_OUTPUT])
    r = np.random.default_rng(0)
    p, v, d = r.standard_normal((T, S_)), r.standard_normal((S_, E)), r.standard_normal((T, E))
    with compat.enable_x64_context(True):
        got, want = (np.asarray(reference.to_jax(x)(p, v, d, p @ v)) for x in (new, adj))
    assert rel_err(got, want) <= F64


@settings(max_examples=150, deadline=None)
@given(expressions(max_ops=6))
def test_delta_from_output_keeps_the_meaning_of_random_adjoints(case):
    """Wherever it fires on a random expression's adjoint, the rewrite keeps its values."""
    expr, values, _ = case
    found = {x.name: x for x in moa.nodes(expr) if isinstance(x, moa.Input)}
    inputs = [found[n] for n in sorted(found)]
    if not inputs or not adjoint.differentiable(expr.dtype):
        return
    d_out = moa.array("d_out", expr.shape, expr.dims, expr.dtype)
    grads = [adjoint.zeros_like(x) if d is None else d for x, d in zip(inputs, adjoint.vjp([expr], [d_out], inputs))]
    names = tuple(f"d_{x.name}" for x in inputs)
    y = moa.array("y", expr.shape, expr.dims, expr.dtype)
    adj, _ = reduce_to_dnf("adjoint", inputs + [d_out, y], tuple(grads), names, record=False)
    fwd, _ = reduce_to_dnf("forward", inputs, expr, ("y",), record=False)
    new, applied = identities.delta_from_output(adj, fwd, {"d_out": "y"}, {"y": "y"}, {})
    args = [values[x.name] for x in inputs]
    g = np.random.default_rng(3).standard_normal(expr.shape)
    with op_by_op():  # helpers.op_by_op: a selection's hit and count from one evaluation
        yv = reference.to_jax(fwd)(*args)
        before = reference.to_jax(adj)(*args, g, yv)
        after = reference.to_jax(new)(*args, g, yv)
    for a, b in zip(before if isinstance(before, tuple) else (before,), after if isinstance(after, tuple) else (after,)):
        assert rel_err(b, a) <= F64


def test_match_binds_index_parameters_up_to_alpha_renaming():
    t, n, kv, g, s, s2 = Var("t", 4), Var("n", 6), Var("kv", 3), Var("g", 2), Var("s", 5), Var("s2", 5)
    f32 = np.float32
    # pattern: Σ_s q[g + 2·kv, s] × k[kv, s]  (over the parameters kv, g)
    pat = D.Red("add", s, D.Call("mul", (D.Read("q", (Ix.of(g) + Ix.of(kv) * 2, s), f32), D.Read("k", (kv, s), f32))))
    # term: Σ_s2 q[n, s2] × k[⌊n/2⌋, s2]: kv ↦ ⌊n/2⌋, then g ↦ n − 2·⌊n/2⌋ (the q read comes first)
    term = D.Red("add", s2, D.Call("mul", (D.Read("q", (n, s2), f32), D.Read("k", (Ix.of(n).floordiv(2), s2), f32))))
    env = D.match(pat, term, {kv, g})
    assert env is not None and env[kv] == Ix.of(n).floordiv(2)
    assert (Ix.of(g) + Ix.of(kv) * 2).substitute(env) == Ix.of(n)
    # a different array, a different monoid, or two unknowns in every index: no match
    assert D.match(pat, D.Red("max", s2, term.body), {kv, g}) is None
    assert D.match(D.Read("q", (Ix.of(g) + Ix.of(kv), t), f32), D.Read("q", (n, t), f32), {kv, g}) is None
    assert D.match(D.Read("q", (kv, t), f32), D.Read("p", (n, t), f32), {kv}) is None
