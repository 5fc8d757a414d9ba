"""jax.nn's attention variants through ``moajax.dot_product_attention``, forward and backward:
a local window, the query and key/value sequence lengths, causal, a bool mask, a bias (with its
gradient), GQA — alone and combined — against the independent float64 reference
(tests/references.py: ``mha_variants``), on XLA and on Pallas-interpret.

Tolerances: float64 rel ≤ 1e-12 — the compiled loops and the reference sum a row of ≤ 16 keys
in different orders (online rescaling, tiles): a few ulps, four orders under the bound;
float32 rel ≤ 1e-5 — float32 rounding (6e-8 per op) over a softmax and two contractions of
≤ 16 terms, as against the float64 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import moajax
import references as R
from helpers import jnp_attention, rel_err, scaled_err, score_mod_grads_f64, walk_eqns

F64, F32 = 1e-12, 1e-5
IMPLS = ["xla", "pallas_interpret"]
B, T, S, N, H = 2, 7, 9, 4, 3


def _qkv(K, seed, dtype=np.float64, T=T, S=S, N=N):
    r = np.random.default_rng(seed)
    q, k, v, g = (r.standard_normal(s).astype(dtype) for s in [(B, T, N, H), (B, S, K, H), (B, S, K, H), (B, T, N, H)])
    return q, k, v, g


def _grads(q, k, v, g, impl, bias=None, **kw):
    def f(q, k, v, bias):
        return jnp.sum(moajax.dot_product_attention(q, k, v, bias, implementation=impl, **kw) * g)

    return jax.jit(jax.grad(f, argnums=(0, 1, 2) + ((3,) if bias is not None else ())))(q, k, v, bias)


# one case per variant and the combinations the issue names
LENGTHS = dict(query_seq_lengths=np.array([5, 7], np.int32), key_value_seq_lengths=np.array([9, 3], np.int32))
CASES = {
    "window": (2, dict(local_window_size=2)),
    "window (left, right)": (2, dict(local_window_size=(1, 3))),
    "causal with window": (4, dict(is_causal=True, local_window_size=(2, 0))),
    "query lengths": (4, dict(query_seq_lengths=np.array([5, 0], np.int32))),
    "kv lengths, one empty": (2, dict(key_value_seq_lengths=np.array([0, 4], np.int32))),
    "GQA with lengths": (2, LENGTHS),
    "MQA, causal, lengths, window": (1, dict(is_causal=True, local_window_size=1, **LENGTHS)),
    "bias with mask": (2, dict(bias=True, mask=True)),
    "bias, mask, lengths, window": (2, dict(bias=True, mask=True, local_window_size=(3, 1), **LENGTHS)),
}


def _extras(kw, seed):
    kw = dict(kw)
    r = np.random.default_rng(seed)
    bias = r.standard_normal((B, N, T, S)) if kw.pop("bias", False) else None
    if kw.pop("mask", False):
        kw["mask"] = r.random((B, 1, T, S)) < 0.7
    return bias, kw


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(CASES))
def test_variants_float64_forward_and_grads(case, impl):
    K, kw = CASES[case]
    q, k, v, g = _qkv(K, 1)
    bias, kw = _extras(kw, 2)
    got = moajax.dot_product_attention(q, k, v, bias, implementation=impl, **kw)
    assert rel_err(got, R.mha_variants(q, k, v, bias=bias, **kw)) <= F64
    want = R.mha_variants(q, k, v, bias=bias, dout=g, **kw)
    grads = _grads(q, k, v, g, impl, bias, **kw)
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), grads, want):
        assert _close(a, b, F64), name


@pytest.mark.parametrize("case", ["GQA with lengths", "bias, mask, lengths, window"])
def test_variants_float32(case):
    K, kw = CASES[case]
    q, k, v, g = _qkv(K, 3, np.float32)
    bias, kw = _extras(kw, 4)
    bias = None if bias is None else bias.astype(np.float32)
    got = moajax.dot_product_attention(q, k, v, bias, **kw)
    assert got.dtype == np.float32 and rel_err(got, R.mha_variants(q, k, v, bias=bias, **kw)) <= F32
    want = R.mha_variants(q, k, v, bias=bias, dout=g, **kw)
    for a, b in zip(_grads(q, k, v, g, None, bias, **kw), want):
        assert rel_err(a, b) <= F32


def test_fully_masked_rows_match_jax_nn_and_have_finite_gradients():
    # every key of batch 1 is padded away: jax.nn averages V there; the gradients stay finite
    q, k, v, g = _qkv(2, 5, np.float32)
    kw = dict(key_value_seq_lengths=np.array([6, 0], np.int32), local_window_size=1)
    got = moajax.dot_product_attention(q, k, v, **kw)
    assert rel_err(got, jax.nn.dot_product_attention(q, k, v, **kw)) <= F32
    for d in _grads(q, k, v, g, None, **kw):
        assert np.all(np.isfinite(d))


def test_lengths_are_runtime_values_under_jit_and_vmap():
    q, k, v, _ = _qkv(2, 6)
    f = jax.jit(lambda q, ql: moajax.dot_product_attention(q, k, v, query_seq_lengths=ql))
    for ql in ([7, 2], [1, 6]):  # one compilation, two lengths
        ql = np.array(ql, np.int32)
        assert rel_err(f(q, ql), R.mha_variants(q, k, v, query_seq_lengths=ql)) <= F64
    # vmap over an extra leading axis of the query and its lengths
    qs = np.stack([q, q[:, ::-1]])
    qls = np.array([[7, 2], [3, 3]], np.int32)
    out = jax.vmap(lambda q, ql: moajax.dot_product_attention(q, k, v, query_seq_lengths=ql))(qs, qls)
    for i in range(2):
        assert rel_err(out[i], R.mha_variants(qs[i], k, v, query_seq_lengths=qls[i])) <= F64


_COMPILED: dict = {}
TILES = moajax.Preset.of(tiles={"t": 2, "s": 2})


def _compiled(window, causal, residuals="auto"):
    """jit(value and grads) per static configuration; the lengths are runtime arguments (a
    length equal to its sequence's pads nothing)."""
    key = (window, causal, residuals)
    if key not in _COMPILED:
        def run(q, k, v, g, ql, kvl):
            kw = dict(is_causal=causal, local_window_size=window, query_seq_lengths=ql, key_value_seq_lengths=kvl)
            # tiles of 2: several per axis, so the loops skip masked tiles (test_masked_tiles.py)
            att = lambda q, k, v: moajax.dot_product_attention(q, k, v, implementation="xla", onf=TILES,  # noqa: E731
                                                               residuals=residuals, **kw)
            out, pullback = jax.vjp(att, q, k, v)  # the forward once: what it computes and saves
            return out, pullback(g)

        _COMPILED[key] = jax.jit(run)
    return _COMPILED[key]


def _close(a, b, tol):
    """max |a − b| ≤ tol · max(max |b|, 1): relative to the gradient, or to the O(1) scale of the
    standard-normal inputs where the gradient is 0 (a window of 0 makes P one-hot: dQ = 0, and
    the reference's rounding leaves ~1e-17 there)."""
    return scaled_err(a, b) <= tol


WINDOWS = [None, 0, 1, (0, 2), (3, 1)]


@settings(max_examples=300, deadline=None)
@given(
    shape=st.sampled_from([(1, 4, 6, 2, 1), (2, 5, 5, 2, 2), (1, 6, 3, 4, 2)]),  # (B, T, S, N, K)
    window=st.sampled_from(WINDOWS),
    causal=st.booleans(),
    which=st.sampled_from(["none", "q", "kv", "both"]),  # which lengths pad (the others are full)
    seed=st.integers(0, 2**16),
)
def test_random_windows_lengths_and_groupings(shape, window, causal, which, seed):
    Bh, Th, Sh, Nh, Kh = shape
    # the residual policy, by configuration (one compile each, as without it): "auto" (saves on
    # this CPU) or "none" (holds nothing, the saving forward rerun in the backward), each over
    # every window and both causalities
    residuals = ("auto", "none")[(WINDOWS.index(window) + causal) % 2]
    r = np.random.default_rng(seed)
    q = r.standard_normal((Bh, Th, Nh, 2))
    k = r.standard_normal((Bh, Sh, Kh, 2))
    v = r.standard_normal((Bh, Sh, Kh, 2))
    g = r.standard_normal((Bh, Th, Nh, 2))
    ql = r.integers(0, Th + 1, Bh).astype(np.int32) if which in ("q", "both") else np.full(Bh, Th, np.int32)
    kvl = r.integers(0, Sh + 1, Bh).astype(np.int32) if which in ("kv", "both") else np.full(Bh, Sh, np.int32)
    kw = dict(is_causal=causal, local_window_size=window, query_seq_lengths=ql, key_value_seq_lengths=kvl)
    got, grads = _compiled(window, causal, residuals)(q, k, v, g, ql, kvl)
    assert _close(got, R.mha_variants(q, k, v, **kw), F64)
    for a, b in zip(grads, R.mha_variants(q, k, v, dout=g, **kw)):
        assert _close(a, b, F64)


def test_check_grads_in_reverse_mode():
    from jax.test_util import check_grads

    q, k, v, _ = _qkv(2, 7)
    kw = dict(is_causal=True, local_window_size=(2, 1), key_value_seq_lengths=np.array([8, 5], np.int32))
    check_grads(lambda q, k, v: moajax.dot_product_attention(q, k, v, **kw), (q, k, v), order=1, modes=("rev",))


@pytest.mark.parametrize("impl", IMPLS)
def test_second_derivatives_through_the_saved_residuals(impl):
    """The default call saves its row statistics and Out for the backward; a second derivative
    runs the saving forward's own tangent and adjoint kernels (and the backward's): Hessian-vector
    products and grad of grad, float64, against check_grads (order 2: numerical
    differences, reverse over reverse) and a float64 jnp composition that JAX differentiates
    itself (rel ≤ 1e-12: as the first derivatives, a few ulps of row sums in other orders)."""
    from jax.test_util import check_grads

    q, k, v, g = _qkv(2, 21)
    bias = np.random.default_rng(22).standard_normal((B, N, T, S))
    kw = dict(is_causal=True, local_window_size=(3, 0), query_seq_lengths=np.array([7, 5], np.int32),
              key_value_seq_lengths=np.array([6, 9], np.int32))
    keep, rows = R.variant_keep(B, N, T, S, **{n: kw[n] for n in ("local_window_size", "query_seq_lengths",
                                                                 "key_value_seq_lengths")})
    keep = keep & np.tril(np.ones((T, S), bool))

    def ours(q, k, v, bias):
        return moajax.dot_product_attention(q, k, v, bias, implementation=impl, **kw)

    def theirs(q, k, v, bias):
        return jnp_attention(q, k, v, bias, keep, rows)

    def grad_norm(f):  # ½ Σ |∇ sum(sin(f) · g)|², whose gradient needs f's second derivative
        inner = jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a)) * g), argnums=(0, 1, 2, 3))
        return jax.jit(jax.grad(lambda *a: sum(jnp.sum(d * d) for d in inner(*a)) / 2, argnums=(0, 1, 2, 3)))

    def hvp(f):
        inner = jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a)) * g), argnums=(0, 1, 2, 3))
        return jax.jit(lambda *a: jax.jvp(inner, a, (g, k, v, bias))[1])

    for a, b in zip(grad_norm(ours)(q, k, v, bias) + hvp(ours)(q, k, v, bias),
                    grad_norm(theirs)(q, k, v, bias) + hvp(theirs)(q, k, v, bias)):
        assert rel_err(a, b) <= F64
    if impl == "xla":  # the numerical check once: the kernels' derivatives are the same algebra on both
        check_grads(lambda q, k, v: ours(q, k, v, bias), (q, k, v), order=2, modes=("rev",))


@pytest.mark.parametrize("side", [2**31 - 1, 2**40])
def test_a_window_wider_than_the_sequences_keeps_every_key(side):
    """local_window_size = (w, w) with w ≥ max(T, S) masks nothing: jax.nn's result without a
    window (causal: (w, 0) is causal). Before, s − t + w wrapped in the kernel's int32 index
    arithmetic at w = 2**31 − 1 and masked every key (a wrong answer); 2**40 raised a bare
    OverflowError. A side is clamped to max(T, S), which keeps the same keys."""
    q, k, v, g = _qkv(2, 13)
    for kw, ref in ((dict(local_window_size=(side, side)), {}),
                    (dict(local_window_size=(side, 0), is_causal=True), dict(is_causal=True))):
        assert rel_err(moajax.dot_product_attention(q, k, v, **kw), R.mha_variants(q, k, v, **ref)) <= F64
    grads = jax.grad(lambda q: jnp.sum(moajax.dot_product_attention(q, k, v, local_window_size=side) * g))(q)
    assert _close(grads, R.mha_variants(q, k, v, dout=g)[0], F64)


def test_bad_variant_arguments_are_named():
    q, k, v, _ = _qkv(2, 8)
    attn = moajax.dot_product_attention
    with pytest.raises(ValueError, match="local_window_size must be ≥ 0"):
        attn(q, k, v, local_window_size=-1)
    with pytest.raises(TypeError, match="local_window_size must hold ints"):
        attn(q, k, v, local_window_size=(1.5, 2))
    with pytest.raises(TypeError, match="local_window_size must be an int or a \\(left, right\\) pair"):
        attn(q, k, v, local_window_size=(1, 2, 3))
    with pytest.raises(TypeError, match="query_seq_lengths must be an integer array"):
        attn(q, k, v, query_seq_lengths=np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="key_value_seq_lengths must have shape \\[2\\]"):
        attn(q, k, v, key_value_seq_lengths=np.array([1, 2, 3], np.int32))
    with pytest.raises(ValueError, match="query_seq_lengths must lie in 0 … 7"):
        attn(q, k, v, query_seq_lengths=np.array([1, 8], np.int32))


def test_the_cuda_lowering_of_grad_holds_pallas_forward_and_backward_kernels():
    from moajax.ptx import triton_kernels

    S = jax.ShapeDtypeStruct
    q, k, ql = S((2, 128, 4, 32), jnp.float32), S((2, 128, 2, 32), jnp.float32), S((2,), jnp.int32)

    def loss(q, k, v, ql, kvl):  # squared: the backward needs the forward's output
        return jnp.sum(moajax.dot_product_attention(q, k, v, query_seq_lengths=ql, key_value_seq_lengths=kvl,
                                                    local_window_size=(32, 0), is_causal=True) ** 2)

    names = [x.name for x in triton_kernels(jax.grad(loss, argnums=(0, 1, 2)), q, k, k, ql, ql)]
    assert any(n.startswith("moajax_mha_qlen_kvlen") and "adjoint" not in n for n in names), names
    assert any(n.startswith("moajax_mha_qlen_kvlen_adjoint") for n in names), names


# ----------------------------------------------------------------------------- score_mod

SLOPES = np.array([0.5, 0.25, 0.125, 0.0625])
TABLE = np.random.default_rng(9).standard_normal(7)


def _alibi(s, b, h, q_idx, kv_idx):
    return s + jnp.asarray(SLOPES)[h] * (kv_idx - q_idx)


def _relpos(s, b, h, q_idx, kv_idx):
    return s + jnp.asarray(TABLE)[jnp.clip(q_idx - kv_idx, -3, 3) + 3]


def _as_bias(name):
    """The [B,N,T,S] bias the same score_mod adds, built in numpy."""
    t, s = np.arange(T)[:, None], np.arange(S)[None, :]
    per_head = [SLOPES[h] * (s - t) if name == "alibi" else TABLE[np.clip(t - s, -3, 3) + 3] for h in range(N)]
    return np.broadcast_to(np.stack(per_head)[None], (B, N, T, S))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name,mod", [("alibi", _alibi), ("relpos", _relpos)])
def test_score_mod_equals_the_bias_it_adds(name, mod, impl):
    # ALiBi reads a per-head slope, relative position a small table at a computed index: both
    # traced into the kernel; the reference adds the same values as a bias, with causal masking
    q, k, v, g = _qkv(2, 10)
    kw = dict(is_causal=True, score_mod=mod, implementation=impl)
    got = moajax.dot_product_attention(q, k, v, **kw)
    assert rel_err(got, R.mha_variants(q, k, v, bias=_as_bias(name), is_causal=True)) <= F64
    grads = jax.grad(lambda q, k, v: jnp.sum(moajax.dot_product_attention(q, k, v, **kw) * g), (0, 1, 2))(q, k, v)
    for a, b in zip(grads, R.mha_variants(q, k, v, bias=_as_bias(name), is_causal=True, dout=g)):
        assert _close(a, b, F64)


# (the ONF's Triton source, interpreted, takes 29 s in tiles of 2: the masked-tile analysis it
# reads is the one the Pallas kernels read)
@pytest.mark.parametrize("impl,causal", [(i, c) for i in IMPLS for c in (False, True)] + [("triton_interpret", False)])
def test_minus_infinity_from_a_score_mod_masks_like_mask(impl, causal):
    """A −∞ score from a score_mod (a mask written FlexAttention's way) is jax.nn's masked
    logit: the result, the residual and the float64 gradients equal the reference with the
    same keys masked by a bool ``mask`` — including rows and a whole head with no finite score,
    which average V over all their keys as a masked row does. Before, such a row was NaN (−∞ −
    −∞ in the softmax's shift), and so was dV. Causal, in tiles of 2: the walks skip tiles,
    and a row the score_mod masks whole must still average the keys of the tiles they skip (a
    select that the masked-tile analysis did not read as a mask averaged only the walked ones,
    0.25 off at T = 40, S = 200 under the H200 profile). On XLA, Pallas-interpret and (without
    causal) the ONF's Triton source, interpreted."""
    q, k, v, g = _qkv(2, 14)
    t, s = np.arange(T)[:, None], np.arange(S)[None, :]
    keep = np.broadcast_to((t >= 2) & (s <= t + 3), (B, N, T, S)).copy()
    keep[0, 1] = False  # batch element 0, head 1: nothing kept
    kw = dict(mask=keep, is_causal=causal)
    want, want_grads, want_lse = (R.mha_variants(q, k, v, **kw), R.mha_variants(q, k, v, dout=g, **kw),
                                  R.mha_lse(q, k, v, **kw))

    # the −∞ as the kept value's alternative, and as the chosen value (which the masked-tile
    # analysis does not read as a fill: the form that went wrong)
    mods = [lambda sc, b, h, i, j: jnp.where((i >= 2) & (j <= i + 3) & ((b != 0) | (h != 1)), sc, -jnp.inf),
            lambda sc, b, h, i, j: jnp.where((i < 2) | (j > i + 3) | ((b == 0) & (h == 1)), -jnp.inf, sc)]
    for mod in mods:
        def f(q, k, v, **extra):
            return moajax.dot_product_attention(q, k, v, score_mod=mod, is_causal=causal, implementation=impl,
                                                onf=TILES if causal else None, **extra)

        assert rel_err(f(q, k, v), want) <= F64
        grads = jax.grad(lambda *a: jnp.sum(f(*a) * g), (0, 1, 2))(q, k, v)
        for a, b in zip(grads, want_grads[:3]):
            assert _close(a, b, F64)
        # the residual: a row with no finite score has jax.nn's masked log-sum-exp, fill + log S
        assert rel_err(f(q, k, v, return_residual=True)[1], want_lse) <= F64


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("variant", ["causal", "window", "plain"])
def test_minus_infinity_in_a_bias(impl, variant):
    """A −∞ bias is held at half jax.nn's fill: where a row keeps a key with a finite bias it is
    jax.nn's −∞ (its weight is 0), and a row whose every kept key has −∞ (here row 0, and all
    of batch element 0's head 1) averages V over its kept keys — in tiles of 2, however the
    walks skip masked tiles. Before, such a row took its weights from the masked keys of the
    tiles walked (Pallas: 0.10 off XLA under causal), and its gradients were NaN under the
    default plan on a GPU profile (a fuzz). Float64 against the reference with the bias so
    held; dBias is 0 at the −∞ entries."""
    from moajax.kernels.common import large_negative

    q, k, v, g = _qkv(2, 15)
    r = np.random.default_rng(16)
    bias = r.standard_normal((B, N, T, S))
    bias[r.random((B, N, T, S)) < 0.3] = -np.inf
    bias[:, :, 0] = -np.inf
    bias[0, 1] = -np.inf
    held = np.where(np.isneginf(bias), large_negative(np.float64) / 2, bias)
    kw = dict(causal=dict(is_causal=True), window=dict(local_window_size=(2, 1)), plain={})[variant]

    def f(q, k, v, bias):
        return moajax.dot_product_attention(q, k, v, bias, implementation=impl, onf=TILES, **kw)

    assert rel_err(f(q, k, v, bias), R.mha_variants(q, k, v, bias=held, **kw)) <= F64
    grads = jax.grad(lambda *a: jnp.sum(f(*a) * g), (0, 1, 2, 3))(q, k, v, bias)
    want = R.mha_variants(q, k, v, bias=held, dout=g, **kw)
    for a, b in zip(grads[:3], want[:3]):
        assert _close(a, b, F64)
    assert _close(grads[3], np.where(np.isneginf(bias), 0.0, want[3]), F64)


@settings(max_examples=300, deadline=None)
@given(shape=st.sampled_from([(1, 4, 6, 2, 1), (2, 5, 5, 2, 2)]),  # (B, T, S, N, K)
       density=st.sampled_from([0.0, 0.3, 0.8]), causal=st.booleans(), form=st.sampled_from(["kept", "chosen", "added"]),
       seed=st.integers(0, 2**16))
def test_random_minus_infinity_masks(shape, density, causal, form, seed):
    """A random −∞ mask written as a score_mod reading a concrete table at (b, h, i, j) — the
    −∞ selected as the alternative, as the choice, or added — dense, sparse (whole rows and
    heads with nothing kept) or empty — equals the same bool
    ``mask``: float64 forward and gradients on XLA in tiles of 2 against the reference."""
    Bh, Th, Sh, Nh, Kh = shape
    r = np.random.default_rng(seed)
    q, k, v, g = (r.standard_normal(s) for s in [(Bh, Th, Nh, 2), (Bh, Sh, Kh, 2), (Bh, Sh, Kh, 2), (Bh, Th, Nh, 2)])
    keep = r.random((Bh, Nh, Th, Sh)) < density
    table = jnp.asarray(keep.ravel().astype(np.int32))
    added = jnp.asarray(np.where(keep, 0.0, -np.inf).ravel())

    def mod(s, b, h, i, j):
        at = ((b * Nh + h) * Th + i) * Sh + j
        if form == "added":  # s + (0 or −∞) from a concrete float table
            return s + added[at]
        return jnp.where(table[at] == 1, s, -jnp.inf) if form == "kept" else jnp.where(table[at] == 0, -jnp.inf, s)

    def f(q, k, v):  # in tiles of 2: causal walks skip tiles
        return moajax.dot_product_attention(q, k, v, is_causal=causal, score_mod=mod, implementation="xla", onf=TILES)

    assert _close(f(q, k, v), R.mha_variants(q, k, v, mask=keep, is_causal=causal), F64)
    grads = jax.grad(lambda *a: jnp.sum(f(*a) * g), (0, 1, 2))(q, k, v)
    for a, b in zip(grads, R.mha_variants(q, k, v, mask=keep, is_causal=causal, dout=g)):
        assert _close(a, b, F64)


def test_which_score_mods_can_give_infinity():
    """``trace.may_be_infinite``, which decides whether the kernel maps a score_mod's −∞ to
    jax.nn's fill: an infinite literal, a concrete table with an infinite entry, a float log or
    division count; finite code, a finite table and a table known only as a jit argument (its
    values looked at when the call runs: ``traced_tables``, the next test) do not."""
    from moajax.api import _check_score_mod

    def infinite(mod):
        return _check_score_mod(mod, np.float32).infinite

    slopes, table = jnp.asarray(SLOPES), jnp.asarray([0.0, -jnp.inf, 1.0])
    assert infinite(lambda s, b, h, i, j: jnp.where(i >= j, s, -jnp.inf))
    assert infinite(lambda s, b, h, i, j: s + table[jnp.clip(i - j, 0, 2)])
    assert infinite(lambda s, b, h, i, j: s + jnp.log(1.0 * (i >= j)))
    assert infinite(lambda s, b, h, i, j: s / (i - j))
    assert not infinite(lambda s, b, h, i, j: s + slopes[h] * (j - i))
    assert not infinite(lambda s, b, h, i, j: 2.0 * jnp.tanh(s / 2.0))  # a division by a literal 2
    assert not infinite(lambda s, b, h, i, j: jnp.where(i >= j, s, jnp.finfo(jnp.float32).min))
    seen = []
    jax.jit(lambda c: seen.append(_check_score_mod(lambda s, b, h, i, j: s + c[h], np.float32)) or c)(table)
    assert not seen[0].infinite and seen[0].traced_tables == [0]
    assert _check_score_mod(lambda s, b, h, i, j: s + slopes[h], np.float32).traced_tables == []


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("how", ["jit", "vmap over the table", "vmap of jit over the table"])
def test_a_minus_infinity_in_a_table_passed_to_jit_masks_as_the_concrete_one(impl, how):
    """A float table the score_mod closes over as a jit argument, ``s + tab[i] + tab[j]`` with
    −∞ entries (rows 1 and 4 masked whole, causal, in tiles of 2): forward, dQ, dK, dV and
    d tab equal the bias tab[i] + tab[j] with the bool mask of its finite entries (jax.nn's
    masked rows: V averaged over every key), float64. ``may_be_infinite`` cannot see a traced
    table's values; before, such a row was NaN in Pallas and, on XLA, not the eager call's
    (the concrete table's) — the run-time test now picks the kernel with the masked fill. Under vmap over the table, the tables' rows each; the finite table still matches.
    Under vmap of jit, the flag traced inside the jit is batched afterwards: it is one flag
    for the whole batch, so the program holds a cond (one kernel runs), not a select of
    both kernels' results (both ran, until 2026-12-05)."""
    q, k, v, g = _qkv(2, 41, T=6, S=6)
    tabs = np.array([[0.3, -np.inf, 0.5, -0.2, -np.inf, 1.0], [0.3, 0.1, 0.5, -0.2, 0.7, 1.0]])

    def att(q, k, v, tab):
        return moajax.dot_product_attention(q, k, v, is_causal=True, implementation=impl, onf=TILES,
                                            score_mod=lambda s, b, h, i, j: s + tab[i] + tab[j])

    def value_and_grads(q, k, v, tab):
        out, pullback = jax.vjp(att, q, k, v, tab)
        return out, pullback(g)

    run = jax.jit(value_and_grads)
    if how != "jit":
        run = jax.jit(jax.vmap(value_and_grads, (None, None, None, 0)))
        if how == "vmap of jit over the table":
            run = jax.vmap(jax.jit(value_and_grads), (None, None, None, 0))
            prims = {e.primitive.name for e, _ in walk_eqns(jax.make_jaxpr(run)(q, k, v, jnp.asarray(tabs)).jaxpr)}
            assert "cond" in prims
        results = run(q, k, v, jnp.asarray(tabs))
        results = [jax.tree.map(lambda x, i=i: x[i], results) for i in range(len(tabs))]
    else:
        results = [run(q, k, v, jnp.asarray(tab)) for tab in tabs]
    for tab, (out, (dq, dk, dv, dtab)) in zip(tabs, results):
        keep = np.isfinite(tab)[:, None] & np.isfinite(tab)[None, :]
        bias = np.broadcast_to(np.where(keep, np.nan_to_num(tab[:, None] + tab[None, :], neginf=0.0), 0.0), (B, N, 6, 6))
        mask = np.broadcast_to(keep, (B, N, 6, 6))
        assert _close(out, R.mha_variants(q, k, v, bias=bias, mask=mask, is_causal=True), F64)
        rq, rk, rv, rbias = R.mha_variants(q, k, v, bias=bias, mask=mask, is_causal=True, dout=g)
        rbias = np.where(mask, rbias, 0.0).sum((0, 1))
        for a, b in zip((dq, dk, dv, dtab), (rq, rk, rv, rbias.sum(1) + rbias.sum(0))):
            assert _close(a, b, F64)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_two_dimensional_table_is_read_one_element_at_a_time(impl):
    """A table of rank 2 closed over (T5's bias per head and distance bucket, tab[h, k]; a
    document id per batch element and position, doc[b, i]): read at its C-order flat index,
    each index clamped as jnp's table[i, j] clamps it. Float64 forward and gradients (of q,
    k, v and the table, a jit argument) under GQA and causal, against the bias and bool mask
    the tables mean. Before, "only one element of a 1-D table"; a row read, tab[h][k], is
    still refused, naming the form that works."""
    q, k, v, g = _qkv(2, 23)
    r = np.random.default_rng(23)
    tab = jnp.asarray(r.standard_normal((N, 5)))
    doc = np.sort(r.integers(0, 3, (B, max(T, S))), axis=1).astype(np.int32)
    t, s = np.arange(T)[:, None], np.arange(S)[None, :]

    def att(q, k, v, tab):
        def mod(sc, b, h, i, j):
            return jnp.where(jnp.asarray(doc)[b, i] == jnp.asarray(doc)[b, j], sc + tab[h, jnp.clip(i - j, -2, 2) + 2],
                             -jnp.inf)
        return moajax.dot_product_attention(q, k, v, is_causal=True, implementation=impl, score_mod=mod)

    bias = np.broadcast_to(np.asarray(tab)[:, np.clip(t - s, -2, 2) + 2][None], (B, N, T, S))
    mask = doc[:, None, :T, None] == doc[:, None, None, :S]
    out, pullback = jax.jit(lambda *a: jax.vjp(att, *a))(q, k, v, tab)
    assert _close(out, R.mha_variants(q, k, v, bias=bias, mask=mask, is_causal=True), F64)
    rq, rk, rv, rbias = R.mha_variants(q, k, v, bias=bias, mask=mask, is_causal=True, dout=g)
    dtab = np.zeros((N, 5))
    np.add.at(dtab, (slice(None), np.clip(t - s, -2, 2) + 2), np.asarray(rbias).sum(0))
    for a, b in zip(pullback(g), (rq, rk, rv, dtab)):
        assert _close(a, b, F64)
    with pytest.raises(TypeError, match=r"reads more than one element of a table of shape \[4, 5\]; read one element "
                                        r"at a time: table\[h, k\], not a row"):
        moajax.dot_product_attention(q, k, v, score_mod=lambda sc, b, h, i, j: sc + tab[h][j % 5])


@settings(max_examples=25, deadline=None)
@given(shape=st.sampled_from([(4, 5), (3, 7), (2, 3, 4)]), row=st.integers(-6, 6), col=st.integers(-9, 9),
       seed=st.integers(0, 2**16))
def test_a_table_read_out_of_range_clamps_as_jax_does(shape, row, col, seed):
    """Random table reads whose indices leave the table on either side, tab[h + row, i − j +
    col] (and a third axis at b + col): the kernel's scores equal the score_mod evaluated by
    JAX itself on each (b, h, i, j) as int32 scalars under jit (jnp wraps a negative index
    once, then dynamic_slice clamps each axis), float64, XLA."""
    q, k, v, _ = _qkv(2, seed % 97)
    tab = jnp.asarray(np.random.default_rng(seed).standard_normal(shape))
    if len(shape) == 2:
        def mod(sc, b, h, i, j):
            return sc + tab[h + row, i - j + col]
    else:
        def mod(sc, b, h, i, j):
            return sc + tab[h + row, i - j + col, b + col]
    one = jax.jit(lambda b, h, i, j: mod(0.0, b, h, i, j))
    ix = [jnp.int32(x) for x in range(max(B, N, T, S))]
    bias = np.array([[[[one(ix[b], ix[h], ix[i], ix[j]) for j in range(S)] for i in range(T)] for h in range(N)]
                     for b in range(B)])
    got = moajax.dot_product_attention(q, k, v, score_mod=mod, implementation="xla")
    assert _close(got, R.mha_variants(q, k, v, bias=bias), F64)


def test_an_eager_gradient_through_a_table_picks_one_kernel_by_its_values(monkeypatch):
    """``jax.grad`` outside jit of a function whose score_mod closes over the table it
    differentiates: the table is a tracer, but its values are known (a bool has no tangent),
    so the call runs the one kernel they need, never a ``lax.cond`` (built afresh in each
    eager call, a cond compiled both kernels again in each). Its gradients equal jit's, for a
    table with −∞ entries (a row masked whole) and for a finite one."""
    q, k, v, g = _qkv(2, 17, T=5, S=5)

    def loss(q, tab):
        att = moajax.dot_product_attention(q, k, v, is_causal=True, score_mod=lambda s, b, h, i, j: s + tab[i] + tab[j])
        return jnp.sum(att * g)

    tabs = [jnp.asarray([0.2, -np.inf, 0.4, -0.1, 0.3]), jnp.asarray([0.2, 0.5, 0.4, -0.1, 0.3])]
    compiled = [jax.jit(jax.grad(loss, (0, 1)))(q, tab) for tab in tabs]

    def no_cond(*args, **kwargs):
        raise AssertionError("an eager call built a lax.cond")

    monkeypatch.setattr(jax.lax, "cond", no_cond)
    for tab, want in zip(tabs, compiled):
        for a, b in zip(jax.grad(loss, (0, 1))(q, tab), want):
            assert _close(a, b, F64)


@pytest.mark.parametrize("impl", IMPLS)
def test_score_mod_index_arithmetic_floors_as_jnp(impl):
    """A score_mod's integer // and % (jnp's floor division and remainder: lax.div and lax.rem,
    C's, with sign and a correction around them): a slope per kv-head group, c[h // 2], and a
    chunked bias, ((i − j) // 3) and ((i − j) % 3) of negative differences too, where floor
    and C's quotient differ. Before, // was "div: needs a floating dtype" and % had no
    counterpart in the algebra. Forward and float64 gradients (of q, k, v and the slopes)
    against the bias the same values make, built with NumPy's floor."""
    q, k, v, g = _qkv(2, 12)
    c = np.array([0.3, -0.7])
    t, s = np.arange(T)[:, None], np.arange(S)[None, :]
    chunk = 0.25 * ((t - s) // 3) - 0.5 * ((t - s) % 3)
    bias = np.stack([c[h // 2] * (s - t) + chunk for h in range(N)])[None].repeat(B, 0)

    def f(q, k, v, c):
        mod = lambda sc, b, h, i, j: sc + c[h // 2] * (j - i) + 0.25 * ((i - j) // 3) - 0.5 * ((i - j) % 3)  # noqa: E731
        return moajax.dot_product_attention(q, k, v, is_causal=True, score_mod=mod, implementation=impl)

    assert rel_err(f(q, k, v, jnp.asarray(c)), R.mha_variants(q, k, v, bias=bias, is_causal=True)) <= F64
    grads = jax.grad(lambda *a: jnp.sum(f(*a) * g), (0, 1, 2, 3))(q, k, v, jnp.asarray(c))
    want = R.mha_variants(q, k, v, bias=bias, is_causal=True, dout=g)
    for a, b in zip(grads[:3], want[:3]):
        assert _close(a, b, F64)
    dbias = want[3].sum(axis=0)  # [N T S]: the slopes' gradient is Σ over their heads of dBias·(j − i)
    dc = [sum(float(np.sum(dbias[h] * (s - t))) for h in range(N) if h // 2 == e) for e in range(2)]
    assert rel_err(grads[3], dc) <= F64
    with pytest.raises(TypeError, match="score_mod: rem of .*needs integer operands"):
        moajax.dot_product_attention(q, k, v, score_mod=lambda sc, *_: sc % 1.0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("table", ["float", "int"])
def test_score_mod_with_closed_over_arrays_and_lengths(table, impl):
    """A score_mod closing over an array beside query_seq_lengths and key_value_seq_lengths
    (ALiBi's slopes, or an int table read at the head): the kernel takes the lengths, then the
    closed-over arrays. Before, the call passed them the other way round, so a length array sat
    in the table's slot (with B = N, as here, of the same shape: an int table then ran with the
    lengths as its entries). An int table's one-hot read sums in ints (its zero is 0, not 0.0).
    Against the bias the score_mod adds, with the same lengths: float64 forward and gradients."""
    q, k, v, g = _qkv(2, 12)
    qlen, kvlen = np.array([7, 3], np.int32), np.array([9, 4], np.int32)
    if table == "float":
        slopes = jnp.asarray(SLOPES)
        mod = lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi)  # noqa: E731
        bias = _as_bias("alibi")
    else:
        ints = jnp.asarray([3, 1, 4, 1], jnp.int32)
        mod = lambda s, b, h, qi, ki: s + 0.5 * ints[h]  # noqa: E731
        bias = np.broadcast_to(0.5 * np.array([3, 1, 4, 1.0])[None, :, None, None], (B, N, T, S))
    kw = dict(score_mod=mod, query_seq_lengths=qlen, key_value_seq_lengths=kvlen, implementation=impl)
    ref = dict(bias=bias, query_seq_lengths=qlen, key_value_seq_lengths=kvlen)
    for f in (moajax.dot_product_attention, jax.jit(moajax.dot_product_attention, static_argnames=(
            "score_mod", "implementation"))):
        assert rel_err(f(q, k, v, **kw), R.mha_variants(q, k, v, **ref)) <= F64
    grads = jax.grad(lambda q, k, v: jnp.sum(moajax.dot_product_attention(q, k, v, **kw) * g), (0, 1, 2))(q, k, v)
    for a, b in zip(grads, R.mha_variants(q, k, v, **ref, dout=g)):
        assert _close(a, b, F64)


@pytest.mark.parametrize("plan", ["split", "atomic", "owner"])
def test_a_closed_over_score_mod_array_under_each_backward_plan(plan):
    """ALiBi's slopes closed over, under each of the seed's backward ONFs: "split" names the
    score_mod arrays' gradients with dQ and dK (before it left them out, and every
    implementation refused the plan), and with an int table beside them, none for it. Against
    the bias the score_mod adds, float64."""
    q, k, v, g = _qkv(2, 14)
    slopes = jnp.asarray(SLOPES)
    mod = lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi)  # noqa: E731
    kw = dict(score_mod=mod, onf=moajax.Preset.of(backward=plan))
    grads = jax.grad(lambda q, k, v: jnp.sum(moajax.dot_product_attention(q, k, v, **kw) * g), (0, 1, 2))(q, k, v)
    for a, b in zip(grads, R.mha_variants(q, k, v, bias=_as_bias("alibi"), dout=g)):
        assert _close(a, b, F64)
    # beside an int table (a document id per position), which has no gradient: "split" named
    # one for it, and the adjoint refused the plan ("must name each output once")
    doc = jnp.asarray(np.arange(max(T, S)) // 4, jnp.int32)
    kw["score_mod"] = lambda s, b, h, qi, ki: jnp.where(doc[qi] == doc[ki], s + slopes[h] * (ki - qi), -jnp.inf)
    keep = np.broadcast_to(np.asarray(doc)[:T, None] == np.asarray(doc)[None, :S], (B, N, T, S))
    grads = jax.grad(lambda q, k, v: jnp.sum(moajax.dot_product_attention(q, k, v, **kw) * g), (0, 1, 2))(q, k, v)
    for a, b in zip(grads, R.mha_variants(q, k, v, bias=_as_bias("alibi"), mask=keep, dout=g)):
        assert _close(a, b, F64)


def test_a_closed_over_table_gets_its_gradient():
    q, k, v, g = _qkv(2, 11)

    def loss(table):
        mod = lambda s, b, h, qi, ki: s + table[jnp.clip(qi - ki, -3, 3) + 3]  # noqa: E731
        return jnp.sum(moajax.dot_product_attention(q, k, v, score_mod=mod) * g)

    got = jax.grad(loss)(jnp.asarray(TABLE))
    dbias = R.mha_variants(q, k, v, bias=_as_bias("relpos"), dout=g)[3]
    t, s = np.arange(T)[:, None], np.arange(S)[None, :]
    bins = np.clip(t - s, -3, 3) + 3
    want = np.array([dbias.sum(axis=(0, 1))[bins == j].sum() for j in range(7)])
    assert rel_err(got, want) <= F64


def _table_grad_reference(q, k, v, g, table, offset, is_causal):
    """d table of Σ Out × g, Out with score + table[q_idx − kv_idx + offset], float64. The
    index as jnp reads it: a negative one wraps once (+ len), then it is clamped into the
    table (lax.dynamic_slice). The reference's bias gradient [B,N,T,S] is added into its bins
    (np.add.at)."""
    Tq, Sk, Rn = q.shape[1], k.shape[1], len(table)
    bins = np.arange(Tq)[:, None] - np.arange(Sk)[None, :] + offset
    bins = np.clip(np.where(bins < 0, bins + Rn, bins), 0, Rn - 1)
    bias = np.asarray(table)[bins]
    dbias = R.mha_variants(q, k, v, bias=np.broadcast_to(bias, (q.shape[0], q.shape[2], Tq, Sk)), is_causal=is_causal,
                           dout=g)[3].sum(axis=(0, 1))
    want = np.zeros(Rn)
    np.add.at(want, bins, dbias)
    return want


def _table_loss(q, k, v, g, offset, impl, **kw):
    def loss(table):
        mod = lambda s, b, h, qi, ki: s + table[qi - ki + offset]  # noqa: E731 — read as jnp reads it
        return jnp.sum(moajax.dot_product_attention(q, k, v, score_mod=mod, implementation=impl, **kw) * g)
    return loss


@pytest.mark.parametrize("impl", IMPLS)
def test_table_gradient_is_scatter_added(impl):
    """The table's gradient is the transpose of its gather: every score's dS added into its
    bin (``dnf.one_hot_write``; XLA scatter-adds, Pallas loops over the bins). Indices past
    either end of the table read as jnp reads them (wrapped once, then clamped); causal and
    GQA."""
    q, k, v, g = _qkv(2, 14)
    table = np.random.default_rng(15).standard_normal(6)
    for offset, causal in ((2, True), (-3, False)):
        got = jax.jit(jax.grad(_table_loss(q, k, v, g, offset, impl, is_causal=causal)))(jnp.asarray(table))
        assert _close(got, _table_grad_reference(q, k, v, g, table, offset, causal), F64)


@settings(max_examples=8, deadline=None)
@given(T_=st.integers(1, 12), S_=st.integers(1, 12), K=st.sampled_from([1, 2, 4]), size=st.integers(1, 24),
       offset=st.integers(-12, 12), causal=st.booleans(), seed=st.integers(0, 2**16))
def test_table_gradient_property(T_, S_, K, size, offset, causal, seed):
    q, k, v, g = _qkv(K, seed, T=T_, S=S_)
    table = np.random.default_rng(seed + 1).standard_normal(size)
    got = jax.grad(_table_loss(q, k, v, g, offset, "xla", is_causal=causal))(jnp.asarray(table))
    # a one-entry table's gradient is exactly 0 (softmax is shift-invariant): relative to the
    # O(1) scale of the summands there (``_close``)
    assert _close(got, _table_grad_reference(q, k, v, g, table, offset, causal), F64)


def test_the_table_gradient_costs_one_add_per_score_whatever_the_table_size():
    """The XLA lowering scatter-adds (a scatter in the jaxpr, no [c, t, s] one-hot), and the
    cost model counts one add per score for the table's gradient, whatever the table's size
    (the one-hot Σ costs 2 × entries per score)."""
    from moajax import cost, schedule, machines
    from moajax.api import _check_score_mod
    from moajax.kernels.attention import mha_kernel

    q, k, v, g = _qkv(2, 16, T=32, S=32)
    text = str(jax.make_jaxpr(jax.grad(_table_loss(q, k, v, g, 3, "xla")))(jnp.zeros(64)))
    assert "scatter-add" in text and "32,32,64]" not in text.replace(" ", "")
    flops = {}
    for size in (4, 64):
        table = jnp.asarray(np.linspace(0.0, 1.0, size))
        mod = _check_score_mod(lambda s, b, h, qi, ki: s + table[qi - ki], np.dtype(np.float64))
        kern = mha_kernel(None, None, True, False, False, mod)
        specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)] + [jax.ShapeDtypeStruct((size,), np.float64)]
        adj = kern.adjoint(*specs)
        dnf = adj.dnf(*specs, jax.ShapeDtypeStruct(g.shape, g.dtype))
        table_out = next(o for o in dnf.outputs if o.name.startswith("d_score_mod_const"))
        onf = schedule.derive(dnf, machines.load("delta-epyc-7763"))
        c = cost._Counter(onf)
        c.expr(table_out.body)
        flops[size] = c.flops
    # what grows with the table is the sums over s of the [entries, s, heads] partials: far
    # under one pass over the 32 × 32 scores per added entry (the one-hot Σ: ≥ 2 per score)
    assert flops[64] - flops[4] < (64 - 4) * 32 * 32


def _ref_softcap(q, k, v, cap):
    """tanh soft-capping, causal, in numpy float64: cap · tanh(scale · q kᵀ / cap)."""
    Bq, Tq, Nq, Hq = q.shape
    G = Nq // k.shape[2]
    out = np.zeros(q.shape[:3] + (v.shape[-1],))
    keep = np.tril(np.ones((Tq, k.shape[1]), bool))
    for b in range(Bq):
        for n in range(Nq):
            sc = cap * np.tanh(q[b, :, n] @ k[b, :, n // G].T / np.sqrt(Hq) / cap)
            sc = np.where(keep, sc, R.large_negative(np.float64))
            p = np.exp(sc - sc.max(-1, keepdims=True))
            out[b, :, n] = (p / p.sum(-1, keepdims=True)) @ v[b, :, n // G]
    return out


@pytest.mark.parametrize("impl", IMPLS)
def test_score_mod_soft_capping_with_causal(impl):
    q, k, v, g = _qkv(2, 12)
    kw = dict(is_causal=True, score_mod=lambda s, b, h, qi, ki: 2.0 * jnp.tanh(s / 2.0), implementation=impl)
    assert rel_err(moajax.dot_product_attention(q, k, v, **kw), _ref_softcap(q, k, v, 2.0)) <= F64
    dq = jax.grad(lambda q: jnp.sum(moajax.dot_product_attention(q, k, v, **kw) * g))(q)
    # central differences of the numpy reference: ~1e-9 of noise in float64
    num = np.zeros_like(q)
    for idx in np.ndindex(q.shape):
        d = np.zeros_like(q)
        d[idx] = 1e-6
        num[idx] = np.sum((_ref_softcap(q + d, k, v, 2.0) - _ref_softcap(q - d, k, v, 2.0)) * g) / 2e-6
    assert rel_err(dq, num) <= 1e-7


def test_bad_score_mods_are_named():
    q, k, v, _ = _qkv(2, 13)
    attn = moajax.dot_product_attention
    with pytest.raises(TypeError, match="score_mod must take 5 arguments"):
        attn(q, k, v, score_mod=lambda s, b, h: s)
    with pytest.raises(ValueError, match="score_mod: must return one scalar"):
        attn(q, k, v, score_mod=lambda s, b, h, qi, ki: jnp.stack([s, s]))
    with pytest.raises(TypeError, match="score_mod must return a floating score"):
        attn(q, k, v, score_mod=lambda s, b, h, qi, ki: s > 0)
    with pytest.raises(TypeError, match="the operation 'sin' has no counterpart"):
        attn(q, k, v, score_mod=lambda s, b, h, qi, ki: jnp.sin(s))
    with pytest.raises(TypeError, match="score_mod must be callable"):
        attn(q, k, v, score_mod=3.0)
    table = np.linspace(-1.0, 1.0, 2 * S)  # NumPy, indexed at a traced index: says what to do
    with pytest.raises(TypeError, match=r"indexes a NumPy array at a traced index; a table it reads must be a jax "
                                        r"array: jnp.asarray\(table\)"):
        attn(q, k, v, score_mod=lambda s, b, h, qi, ki: s + table[qi - ki + S])


@pytest.mark.parametrize("impl", IMPLS)
def test_a_constant_score_and_a_table_read_at_a_constant_index(impl):
    """score_mod → 1.0 (a score that reads no argument: uniform attention over the kept keys,
    here the causal running mean of V) and s · c[0] + t[1, 2] (elements of a table at
    constant indices, a static slice): float64 against references written apart, with the
    tables' gradients. The constant once failed as a shape error from the softmax
    ("axis -1 is out of range for an array of shape []", naming no score_mod), the constant
    index as "the operation 'slice' has no counterpart" (a helper's review)."""
    q, k, v, g = _qkv(2, 21)
    kw = dict(is_causal=True, implementation=impl)
    running_mean = np.cumsum(np.repeat(v, N // 2, axis=2), axis=1)[:, :T] / np.arange(1, T + 1)[None, :, None, None]
    got = moajax.dot_product_attention(q, k, v, score_mod=lambda s, b, h, i, j: 1.0, **kw)
    assert rel_err(got, running_mean) <= F64
    dv = jax.grad(lambda v: jnp.sum(moajax.dot_product_attention(
        q, k, v, score_mod=lambda s, b, h, i, j: 1.0, **kw) * g))(v)
    want_dv = np.zeros_like(v)
    for t in range(T):  # Out[t] = mean of V[:t+1] over the query heads of each kv head
        want_dv[:, : t + 1] += (g[:, t].reshape(B, 2, N // 2, H).sum(2) / (t + 1))[:, None]
    assert rel_err(dv, want_dv) <= F64
    c, tab = jnp.asarray([0.75, 2.0]), jnp.asarray(np.random.default_rng(22).standard_normal((2, 3)))

    def loss(c, tab):
        mod = lambda s, b, h, i, j: s * c[0] + tab[1, 2]  # noqa: E731
        return jnp.sum(moajax.dot_product_attention(q, k, v, score_mod=mod, **kw) * g)

    ref = lambda c0: np.sum(R.mha_variants(q, k, v, scale=c0 / np.sqrt(H), is_causal=True) * g)  # noqa: E731
    assert rel_err(loss(c, tab), ref(0.75)) <= F64  # a constant added to every score changes nothing
    dc, dtab = jax.grad(loss, argnums=(0, 1))(c, tab)
    eps = 1e-6  # central difference of the float64 reference: truncation O(eps²), rounding ≈ 1e-16/eps = 1e-10
    assert abs(float(dc[0]) - (ref(0.75 + eps) - ref(0.75 - eps)) / (2 * eps)) <= 1e-7 * abs(float(dc[0]))
    assert float(dc[1]) == 0.0 and abs(float(dtab[1, 2])) <= 1e-12 and float(jnp.abs(dtab).max()) <= 1e-12


def test_a_table_read_is_a_gather_not_a_one_hot_sum():
    """table[clip(q_idx − kv_idx)] ψ-reduces to Σ_j ((j = i) ? table[j] : 0) (its meaning);
    ``dnf.selection`` reads it as the gather it is: the XLA lowering gathers from the table
    (no [t, s, 7] one-hot), and the cost model counts one select per score, not 2 · 7."""
    from moajax import cost, dnf as D, machines, schedule
    from moajax.api import _check_score_mod
    from moajax.kernels.attention import mha_kernel

    mod = _check_score_mod(_relpos, np.dtype(np.float64))
    kern = mha_kernel(None, None, False, False, False, mod)
    specs = [jax.ShapeDtypeStruct((1, T, 1, 8), np.float64)] * 3 + [jax.ShapeDtypeStruct((7,), np.float64)]
    dnf = kern.dnf(*specs, is_causal=True)
    sels = [e for o in dnf.outputs for e in D.walk(o.body) if D.selection(e) is not None]
    assert sels and all(D.selection(e)[0].array == "score_mod_const0" for e in sels)
    q, k, v, _ = _qkv(2, 13)
    args = (q[:1, :, :1], k[:1, :, :1], v[:1, :, :1], jnp.asarray(TABLE))
    text = str(jax.make_jaxpr(lambda *a: kern(*a, is_causal=True, implementation="xla"))(*args))
    assert "gather" in text and f"{T},{S},7]" not in text.replace(" ", "")
    onf = schedule.derive(dnf, machines.load("delta-a100"))
    one_hot = D.Red("add", sels[0].var, sels[0].body)  # the same Σ, counted as a reduction
    c = cost._Counter(onf)
    c.reduction(one_hot.monoid, one_hot.var, one_hot.body)
    g = cost._Counter(onf)
    g.expr(sels[0])
    i = cost._Counter(onf)
    i.expr(D.selection(sels[0])[2])  # the index arithmetic, counted by both
    pts = cost._points(onf, set(sels[0].free))
    assert g.flops - i.flops == pts and c.flops - i.flops >= 2 * 7 * pts


def test_bfloat16_grouped_gradient_runs_eager_and_jitted():
    # both operands of a contraction bfloat16, its sum float32: XLA CPU's dot runtime takes no
    # mixed dtypes, so the CPU lowering widens them (exactly) — an eager jax.grad of a small
    # causal GQA call failed to dispatch before. Against the float64 reference of the same
    # (rounded) inputs: bfloat16's rounding of the outputs and gradients, 2⁻⁸, with margin 2⁻⁶
    r = np.random.default_rng(21)
    q, k, v, g = (jnp.asarray(r.standard_normal(s), jnp.bfloat16) for s in ((1, 8, 4, 8), (1, 8, 2, 8),
                                                                           (1, 8, 2, 8), (1, 8, 4, 8)))

    def loss(q, k, v):
        return jnp.sum(moajax.dot_product_attention(q, k, v, is_causal=True).astype(jnp.float32) * g)

    want = R.mha_variants(*(np.asarray(x, np.float64) for x in (q, k, v)), dout=np.asarray(g, np.float64),
                          is_causal=True)
    for grads in (jax.grad(loss, argnums=(0, 1, 2))(q, k, v), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)):
        for a, b in zip(grads, want):
            assert a.dtype == jnp.bfloat16 and scaled_err(np.asarray(a, np.float64), b) <= 2.0**-6


def test_a_bfloat16_tables_gradient_over_grouped_heads_under_a_causal_skip(monkeypatch):
    """bfloat16 GQA (4 query heads over 2 kv heads), causal, with a relative-position table in
    bfloat16, residuals "save", on the H200's Pallas schedule (interpret mode): the table's
    gradient recomputes Δ after a 16-bit forward (``identities``), in a kernel walking the kv
    heads one at a time, whose causal skip checks every row's saved max over the heads it
    walks. That check read the max at ⟨b t (g + 2·n_kv)⟩ with both heads' tiles at once, not a
    window (an ONFError, before ``skipping.rows_keep_keys`` stepped one tile where a
    statistic's index mixes the walked variable with another). Against XLA on the same
    bfloat16 inputs: 2e-2 of the largest entry (bfloat16 operands, dots and Out on both)."""
    from moajax import machines, runtime
    from moajax.schedule import Preset

    h200 = machines.load("h200")
    r = np.random.default_rng(14)
    q, g = (jnp.asarray(r.standard_normal((2, 8, 4, 4)), jnp.bfloat16) for _ in range(2))
    k, v = (jnp.asarray(r.standard_normal((2, 8, 2, 4)), jnp.bfloat16) for _ in range(2))
    table = jnp.asarray(np.random.default_rng(15).standard_normal(6), jnp.bfloat16)

    def loss(table, impl):
        mod = lambda s, b, h, qi, ki: s + table[qi - ki + 2]  # noqa: E731
        out = moajax.dot_product_attention(q, k, v, score_mod=mod, implementation=impl, is_causal=True,
                                           onf=Preset.of(residuals="save"))
        return jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32))

    monkeypatch.setattr(runtime, "gpu_machine", lambda path="pallas": h200)
    runtime.schedules.cache_clear()
    try:
        want = np.asarray(jax.jit(jax.grad(loss), static_argnums=1)(table, "xla"), np.float64)
        got = np.asarray(jax.jit(jax.grad(loss), static_argnums=1)(table, "pallas_interpret"), np.float64)
    finally:
        runtime.schedules.cache_clear()
    assert np.max(np.abs(got - want)) <= 2e-2 * np.max(np.abs(want))


@pytest.mark.parametrize("residuals", ["auto", "save"])
def test_second_derivatives_of_a_bfloat16_table_run_the_backward_of_each_platform(residuals):
    """bfloat16 q, k, v with bfloat16 ALiBi slopes: a GPU's 16-bit forward rounds its dots, so
    the backward a GPU runs recomputes Δ for the slopes' gradient where a CPU's reads Out, and
    the call holds both, chosen by platform. JAX differentiates through that choice: a jvp of
    the gradient (a Hessian-vector product) and grad of grad run (the first choice, a
    primitive of moajax's, had no derivative rule). Against the same derivatives of the call on
    the inputs widened to float64: 2e-2 of the largest entry, as for the first derivatives
    (bfloat16 q, k, v, Out and cotangents; 4.2e-3 and 1.1e-3 seen)."""
    from moajax.schedule import Preset

    r = np.random.default_rng(1)
    q = jnp.asarray(r.normal(size=(1, 6, 2, 4)), jnp.bfloat16)
    k, v = (jnp.asarray(r.normal(size=(1, 5, 2, 4)), jnp.bfloat16) for _ in range(2))
    w = jnp.asarray(r.normal(size=(1, 6, 2, 4)), jnp.float32)
    slopes = jnp.asarray([0.2, 0.4], jnp.bfloat16)

    def f(slopes, q, k, v):
        mod = lambda s, b, h, i, j: s - slopes[h] * jnp.abs(i - j)  # noqa: E731
        o = moajax.dot_product_attention(q, k, v, score_mod=mod, onf=Preset.of(residuals=residuals))
        return jnp.sum(o.astype(w.dtype) * w)

    def second(slopes, q, k, v):
        hvp = jax.jvp(lambda s: jax.grad(f)(s, q, k, v), (slopes,), (slopes,))[1]
        gg = jax.grad(lambda s: jnp.sum(jax.grad(f)(s, q, k, v).astype(w.dtype) ** 2))(slopes)
        return hvp, gg

    got = second(slopes, q, k, v)
    want = second(*(x.astype(jnp.float64) for x in (slopes, q, k, v)))
    for a, b in zip(got, want):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.all(np.isfinite(a)) and np.max(np.abs(a - b)) <= 2e-2 * np.max(np.abs(b)), (a, b)


@pytest.mark.parametrize("causal", [False, True])
def test_alibi_gradient_without_saved_statistics_past_one_key_tile(causal):
    """ALiBi slopes with residuals "recompute" at T = S = 320, past the CPU's walk tile (256): the
    slopes' kernel walks the keys and the queries in tiles, and the rows' max, ℓ and Δ (walks
    of the keys) sit under both — since 2026-12-07 with the queries' walk outside
    (``rewrites.row_walks_out``: evaluated once per query tile, where under Σ_s they were
    recomputed in every key tile). Every gradient against plain jnp in float64 at 1e-12 (the
    small shapes of the other tests never walk in tiles)."""
    from moajax import schedule

    r = np.random.default_rng(7)
    B, T, N, H = 1, 320, 2, 8
    q, k, v, g = (jnp.asarray(r.normal(size=(B, T, N, H))) for _ in range(4))
    slopes = jnp.asarray([0.05, 0.2])
    alibi = lambda sl: lambda s, b, h, qi, ki: s - sl[h] * jnp.abs(qi - ki)  # noqa: E731

    def ours(q, k, v, sl):
        return jnp.sum(moajax.dot_product_attention(q, k, v, score_mod=alibi(sl), is_causal=causal,
                                                    onf=schedule.Preset.of(residuals="recompute")) * g)

    got = jax.grad(ours, argnums=(0, 1, 2, 3))(q, k, v, slopes)
    want = score_mod_grads_f64(q, k, v, slopes, g, alibi, causal)
    for a, b in zip(got, want):
        assert rel_err(a, b) <= F64
    # (the slopes' kernel of each of the two plans a traced table compiles: finite, masked fill)
    runs = moajax.traced_onfs(jax.grad(ours, argnums=(0, 1, 2, 3)), q, k, v, slopes)
    onfs = [o for run in runs for o in (run.onf if isinstance(run.onf, tuple) else (run.onf,))]
    tables = [o for o in onfs if o.dnf.name.endswith("d_score_mod_const0")]
    assert tables and all("row_walks_out" in o.history and o.axis("t").role == "sequential" for o in tables), tables
