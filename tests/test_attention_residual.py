"""jax.nn's ``return_residual``: ``moajax.dot_product_attention`` returns (Out, lse), lse the
rows' log-sum-exp of the masked scores [B, T, N], held constant under differentiation — for
every variant, against the independent float64 reference (tests/references.py: ``mha_lse``),
and against jax.nn itself in float32 (the drop-in contract: shape, dtype, the fully masked
rows' value).

Tolerances: float64 rel ≤ 1e-12 and float32 rel ≤ 1e-5, as in test_attention_variants.py (a
row of ≤ 16 keys summed in another order: a few ulps); lse is compared relative to max(|lse|,
1) over the rows that keep a key, and a fully masked row (jax.nn's large negative + log S,
−1.3e308 in float64) on its own, relative to itself."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import moajax
import references as R
from helpers import rel_err, scaled_err
from test_attention_variants import CASES, F32, F64, IMPLS, _extras, _qkv


def _lse_close(got, want, tol):
    """The kept rows within tol of max(|lse|, 1); the fully masked rows within tol of themselves."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape and np.all(np.isfinite(got))
    masked = want < 1e30 * -1.0  # the large negative fill (−2.4e38 in float32), not a score
    ok = np.all(np.abs(got[masked] - want[masked]) <= tol * np.abs(want[masked]))
    return ok and scaled_err(got[~masked], want[~masked]) <= tol


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(CASES))
def test_every_variant_returns_out_and_its_lse_float64(case, impl):
    K, kw = CASES[case]
    q, k, v, _ = _qkv(K, 11)
    bias, kw = _extras(kw, 12)
    out, lse = moajax.dot_product_attention(q, k, v, bias, implementation=impl, return_residual=True, **kw)
    assert lse.shape == q.shape[:3] and lse.dtype == q.dtype
    assert rel_err(out, R.mha_variants(q, k, v, bias=bias, **kw)) <= F64
    assert _lse_close(lse, R.mha_lse(q, k, v, bias=bias, **kw), F64)


@pytest.mark.parametrize("case", ["MQA, causal, lengths, window", "bias, mask, lengths, window",
                                  "kv lengths, one empty"])
def test_float32_matches_jax_nn_return_residual(case):
    K, kw = CASES[case]
    q, k, v, _ = _qkv(K, 13, np.float32)
    bias, kw = _extras(kw, 14)
    bias = None if bias is None else bias.astype(np.float32)
    out, lse = moajax.dot_product_attention(q, k, v, bias, return_residual=True, **kw)
    want_out, want_lse = jax.nn.dot_product_attention(q, k, v, bias, return_residual=True, **kw)
    assert lse.dtype == want_lse.dtype == np.float32 and lse.shape == want_lse.shape
    assert rel_err(out, want_out) <= F32
    assert _lse_close(lse, want_lse, F32)
    assert _lse_close(lse, R.mha_lse(q, k, v, bias=bias, **kw), F32)


_FORWARDS: dict = {}


def _forward(window, causal):
    """jit(out, lse) per static configuration, the lengths runtime arguments; tiles of 2, so the
    online loop walks several key tiles and skips the masked ones (lse reads what it kept)."""
    key = (window, causal)
    if key not in _FORWARDS:
        tiles = moajax.Preset.of(tiles={"t": 2, "s": 2})
        _FORWARDS[key] = jax.jit(lambda q, k, v, ql, kvl: moajax.dot_product_attention(
            q, k, v, is_causal=causal, local_window_size=window, query_seq_lengths=ql, key_value_seq_lengths=kvl,
            return_residual=True, implementation="xla", onf=tiles))
    return _FORWARDS[key]


@settings(max_examples=300, deadline=None)
@given(
    shape=st.sampled_from([(1, 4, 6, 2, 1), (2, 5, 5, 2, 2), (1, 6, 3, 4, 2)]),  # (B, T, S, N, K)
    window=st.sampled_from([None, 0, (0, 2)]),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_windows_lengths_and_groupings(shape, window, causal, seed):
    Bh, Th, Sh, Nh, Kh = shape
    r = np.random.default_rng(seed)
    q, k, v = (r.standard_normal(s) for s in ((Bh, Th, Nh, 2), (Bh, Sh, Kh, 2), (Bh, Sh, Kh, 2)))
    ql = r.integers(0, Th + 1, Bh).astype(np.int32)
    kvl = r.integers(0, Sh + 1, Bh).astype(np.int32)
    kw = dict(is_causal=causal, local_window_size=window, query_seq_lengths=ql, key_value_seq_lengths=kvl)
    out, lse = _forward(window, causal)(q, k, v, ql, kvl)
    assert scaled_err(out, R.mha_variants(q, k, v, **kw)) <= F64
    assert _lse_close(lse, R.mha_lse(q, k, v, **kw), F64)


def test_the_residual_is_held_constant_and_out_differentiates_as_without_it():
    # jax.nn stops the gradient at its residual: a loss that reads lse gets the gradient of
    # the loss without it, and the tangent of lse is 0
    K, kw = CASES["GQA with lengths"]
    q, k, v, g = _qkv(K, 15)

    def loss(q, k, v, with_lse):
        out, lse = moajax.dot_product_attention(q, k, v, is_causal=True, return_residual=True, **kw)
        return jnp.sum(out * g) + (jnp.sum(jnp.sin(lse)) if with_lse else 0.0)

    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)(q, k, v, True)
    want = R.mha_variants(q, k, v, dout=g, is_causal=True, **kw)
    for a, b in zip(got, want):
        assert scaled_err(a, b) <= F64
    _, (_, lse_dot) = jax.jvp(lambda q: moajax.dot_product_attention(q, k, v, return_residual=True, **kw),
                              (q,), (np.ones_like(q),))
    assert np.all(np.asarray(lse_dot) == 0.0)


def test_the_forward_computes_lse_in_the_pass_that_computes_out():
    # one kernel, one online loop: lse reads the softmax's own row max and sum
    from moajax import cost, machines, schedule
    from moajax.kernels.attention import mha_kernel

    q, k, v, _ = _qkv(2, 16)
    dnf = mha_kernel(None, None, True, residual=True).dnf(q, k, v, is_causal=True)
    assert [o.name for o in dnf.outputs] == ["out", "lse"]
    for machine in ("delta-epyc-7763", "delta-a100"):
        onf = schedule.derive(dnf, machines.load(machine))
        defined = [d for st in onf.program.stages for d in st.defines]
        # the row max, the row sum, the sum against V, then the two outputs: no second row sum
        assert len(defined) == 5 and cost.estimate(onf).launches == 1, onf


def test_unbatched_vmapped_and_jitted():
    q, k, v, _ = _qkv(2, 17)
    out, lse = moajax.dot_product_attention(q[0], k[0], v[0], return_residual=True, local_window_size=1)
    assert out.shape == q.shape[1:] and lse.shape == q.shape[1:3]
    assert _lse_close(lse, R.mha_lse(q[:1], k[:1], v[:1], local_window_size=1)[0], F64)
    f = jax.jit(jax.vmap(lambda q, k, v: moajax.dot_product_attention(q, k, v, return_residual=True)))
    outs, lses = f(q, k, v)
    for b in range(q.shape[0]):
        assert _lse_close(lses[b], R.mha_lse(q[b:b + 1], k[b:b + 1], v[b:b + 1])[0], F64)
        assert rel_err(outs[b], R.mha_variants(q[b:b + 1], k[b:b + 1], v[b:b + 1])[0]) <= F64


def test_a_non_bool_return_residual_is_named():
    q, k, v, _ = _qkv(2, 18)
    for bad in ("yes", 1, None):
        with pytest.raises(TypeError, match="return_residual"):
            moajax.dot_product_attention(q, k, v, return_residual=bad)


def test_the_cuda_lowering_holds_the_pallas_kernel_with_lse_and_compiles_without_spills():
    # lowered for CUDA offline: the forward that outputs lse is one Pallas kernel, and the
    # gradient runs the derived adjoint kernels (lse held constant: its cotangent unread)
    from moajax import machines, schedule
    from moajax.kernels.attention import mha_kernel
    from moajax.ptx import spill_bytes, toolchain_missing, triton_kernels

    S = jax.ShapeDtypeStruct
    q, k = S((2, 256, 4, 64), jnp.float32), S((2, 256, 2, 64), jnp.float32)

    def loss(q, k, v):
        out, lse = moajax.dot_product_attention(q, k, v, is_causal=True, return_residual=True)
        return jnp.sum(out ** 2) + jnp.sum(lse)

    names = [x.name for x in triton_kernels(jax.grad(loss, argnums=(0, 1, 2)), q, k, k)]
    assert any(n.startswith("moajax_mha_lse") and "adjoint" not in n for n in names), names
    assert any(n.startswith("moajax_mha_lse_adjoint") for n in names), names
    missing = toolchain_missing()
    if missing:
        pytest.skip(f"no offline PTX toolchain: {missing}")
    onf = schedule.derive(mha_kernel(None, None, True, residual=True).dnf(q, k, k, is_causal=True),
                          machines.load("delta-a100"))
    assert spill_bytes(onf, "sm_80") == 0, onf


def test_fully_masked_rows_give_jax_nns_value_in_every_dtype():
    # jax.nn fills masked scores with −0.7·max capped at float32's (float64 too) and takes its
    # softmax in float32: a row with no key kept has lse −2.4e38 in float32 and float64, −inf in
    # float16 and bfloat16's (−2.4e38 rounds to −3.4e38 there); rows that keep a key agree to the
    # float32 softmax jax.nn takes (rel 1e-5), and 16-bit to their dtype's rounding (2⁻⁷, 2⁻¹⁰)
    kw = dict(key_value_seq_lengths=np.array([0, 4], np.int32), is_causal=True)
    for dtype, tol in ((np.float64, F32), (np.float32, F32), (jnp.bfloat16, 2.0**-7), (np.float16, 2.0**-10)):
        q, k, v = (x.astype(dtype) for x in _qkv(2, 19, np.float32)[:3])
        got = moajax.dot_product_attention(q, k, v, return_residual=True, **kw)[1]
        want = jax.nn.dot_product_attention(q, k, v, return_residual=True, **kw)[1]
        assert got.dtype == want.dtype == dtype
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        # batch 0 keeps no key: the fill's value (float64: jax.nn's rounded to its float32 softmax)
        with np.errstate(invalid="ignore"):  # (−inf − −inf in float16)
            assert np.all((got[0] == want[0]) | (np.abs(got[0] - want[0]) <= 2.0**-24 * np.abs(want[0]))), dtype
        assert scaled_err(got[1], want[1]) <= tol, dtype


def test_the_saving_forward_saves_the_row_max_and_sum_and_one_kernel_per_pattern():
    # lse is an output the size of the rows, yet the softmax's max and sum still serve Out: the
    # forward jax.grad runs saves them (the ring's and the identities' residuals)
    from moajax.kernels.attention import mha_kernel

    q, k, v, _ = _qkv(2, 20)
    kern = mha_kernel(None, None, True, residual=True)
    names = [o.name for o in kern.with_row_statistics().dnf(q, k, v).outputs]
    assert names == ["saved0", "saved1", "out", "lse"], names
    # bfloat16: also Out before its rounding (the identities read it), not lse's (held constant)
    names = [o.name for o in kern.with_row_statistics().dnf(*(x.astype(jnp.bfloat16) for x in (q, k, v))).outputs]
    assert names == ["saved0", "saved1", "saved2", "out", "lse"], names
    assert mha_kernel(None, None, False) is mha_kernel(None, None, False, False, False, None, False)


def test_its_onf_is_inspected_and_passed_and_another_kernels_is_refused_by_its_outputs():
    q, k, v, _ = _qkv(2, 22)
    onf = moajax.attention_onf(q, k, v, is_causal=True, return_residual=True)
    assert [o.name for o in onf.dnf.outputs] == ["out", "lse"]
    out, lse = moajax.dot_product_attention(q, k, v, is_causal=True, return_residual=True, onf=onf)
    assert _lse_close(lse, R.mha_lse(q, k, v, is_causal=True), F64)
    plain = moajax.attention_onf(q, k, v, is_causal=True)
    with pytest.raises(moajax.ONFError, match=r"outputs \['out', 'lse'\]"):
        moajax.dot_product_attention(q, k, v, is_causal=True, return_residual=True, onf=plain)
