"""``moajax.decode_attention``: one query per head against a key/value cache with ragged
lengths (paper III), GQA/MQA, against the independent float64 single-head reference
(tests/references.py ``decode``) applied per batch element and head over the first
``lengths[b]`` keys; the step equals the last row of full causal attention over the prefix;
both carries; the GPU schedule splits the walk (flash-decoding); bad input.

Tolerance: float64 rel ≤ 1e-12 (a softmax over ≤ 40 keys summed in another order)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import moajax
import references as R
from helpers import rel_err
from moajax import machines, schedule
from moajax.kernels.attention import mha_kernel
from moajax.schedule import Preset


def _case(B=3, S=40, N=4, K=2, H=8, seed=0):
    r = np.random.default_rng(seed)
    return r.standard_normal((B, N, H)), r.standard_normal((B, S, K, H)), r.standard_normal((B, S, K, H))


def _ref(q, kc, vc, lengths):
    B, N, _ = q.shape
    K = kc.shape[2]
    out = np.zeros(q.shape[:2] + (vc.shape[-1],))
    for b in range(B):
        for n in range(N):
            kv = n // (N // K)
            L = int(lengths[b])
            if L == 0:  # no key kept: jax.nn's fully masked row averages every cache entry
                out[b, n] = np.mean(vc[b, :, kv], axis=0)
            else:
                out[b, n] = R.decode(q[b, n], kc[b, :L, kv], vc[b, :L, kv])
    return out


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_ragged_decode_matches_the_reference(impl):
    q, kc, vc = _case()
    lengths = np.array([40, 17, 1], np.int32)
    got = jax.jit(lambda q, k, v, l: moajax.decode_attention(q, k, v, l, implementation=impl))(q, kc, vc, lengths)
    assert rel_err(got, _ref(q, kc, vc, lengths)) <= 1e-12


def test_lengths_under_jit_clamp_in_their_own_width():
    """Lengths are not checked under jit (their values are unknown); past the ends they act as
    the nearest end, in whatever integer width they come: an int64 2**32 is the whole cache,
    and −2**32 none of it. It was cast to int32 first, where 2**32 is 0: no key kept (a
    helper's fuzz)."""
    q, kc, vc = _case()
    step = jax.jit(moajax.decode_attention)
    got = step(q, kc, vc, jnp.asarray([2**32, 17, -(2**32)], jnp.int64))
    assert rel_err(got, _ref(q, kc, vc, np.array([40, 17, 0]))) <= 1e-12


def test_a_step_is_the_last_row_of_causal_attention_over_the_prefix():
    r = np.random.default_rng(1)
    T, N, K, H = 9, 4, 1, 8  # MQA
    qs, ks, vs = r.standard_normal((1, T, N, H)), r.standard_normal((1, T, K, H)), r.standard_normal((1, T, K, H))
    full = moajax.dot_product_attention(qs, ks, vs, is_causal=True)
    cache_k = np.concatenate([ks, np.zeros((1, 7, K, H))], axis=1)  # a longer buffer, padded
    cache_v = np.concatenate([vs, np.zeros((1, 7, K, H))], axis=1)
    step = moajax.decode_attention(qs[:, -1], cache_k, cache_v, np.array([T], np.int32))
    assert rel_err(step, full[:, -1]) <= 1e-12


def test_the_passes_carry_gives_the_same_step():
    q, kc, vc = _case(seed=2)
    lengths = np.array([3, 40, 22], np.int32)
    a = moajax.decode_attention(q, kc, vc, lengths, onf=Preset.of(carry="passes"))
    assert rel_err(a, _ref(q, kc, vc, lengths)) <= 1e-12


def test_the_gpu_schedule_splits_the_cache_walk():
    # B·N = 8 programs cannot fill an H200: split-K over the cache, the softmax monoid's combine
    specs = [jax.ShapeDtypeStruct((1, 1, 8, 128), np.float16), jax.ShapeDtypeStruct((1, 32768, 2, 128), np.float16),
             jax.ShapeDtypeStruct((1, 32768, 2, 128), np.float16), jax.ShapeDtypeStruct((1,), np.int32)]
    onf = schedule.derive(mha_kernel(None, None, True, False, True).dnf(*specs), machines.load("h200"))
    assert any(h.startswith("split_k(s") for h in onf.history), onf.history
    assert onf.skips  # the keys past the length are skipped in each part


@settings(max_examples=60, deadline=None)
@given(shape=st.sampled_from([(2, 10, 4, 2), (1, 7, 2, 1), (3, 5, 2, 2)]), seed=st.integers(0, 2**16))
def test_random_ragged_lengths(shape, seed):
    B, S, N, K = shape
    q, kc, vc = _case(B, S, N, K, 4, seed)
    lengths = np.random.default_rng(seed).integers(0, S + 1, B).astype(np.int32)
    got = _jitted(shape)(q, kc, vc, lengths)
    assert rel_err(got, _ref(q, kc, vc, lengths)) <= 1e-12


_JIT: dict = {}


def _jitted(shape):
    if shape not in _JIT:
        _JIT[shape] = jax.jit(lambda q, k, v, l: moajax.decode_attention(q, k, v, l, implementation="xla"))
    return _JIT[shape]


def test_bad_input_is_named():
    q, kc, vc = _case()
    with pytest.raises(ValueError, match="decode_attention: zero-size dimension in query"):
        moajax.decode_attention(q, kc[:, :, :0], vc[:, :, :0])  # no kv heads (was a ZeroDivisionError)
    with pytest.raises(ValueError, match="decode_attention: lengths must lie in 0 … 40"):
        moajax.decode_attention(q, kc, vc, np.array([41, 1, 1], np.int32))
    with pytest.raises(ValueError, match="decode_attention: lengths must lie in 0 … 40"):
        moajax.decode_attention(q, kc, vc, np.array([-1, 1, 1], np.int32))
    with pytest.raises(ValueError, match="decode_attention: lengths must have shape"):
        moajax.decode_attention(q, kc, vc, np.array([1, 1], np.int32))
    with pytest.raises(TypeError, match="decode_attention: lengths must be an integer array"):
        moajax.decode_attention(q, kc, vc, np.array([1.0, 1.0, 1.0]))
    with pytest.raises(TypeError, match="decode_attention: v_cache has dtype float32"):
        moajax.decode_attention(q, kc, vc.astype(np.float32))
    with pytest.raises(ValueError, match="decode_attention: query must be"):
        moajax.decode_attention(q[None], kc, vc)
    with pytest.raises(ValueError, match="decode_attention: k_cache has shape"):
        moajax.decode_attention(q, kc[..., :4], vc)
    with pytest.raises(ValueError, match="not a multiple"):
        moajax.decode_attention(q[:, :3], kc, vc)


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_split_parts_past_the_length_are_skipped(impl):
    # the cache walk split in 4 parts of 15 keys: the kept key is sought over the whole walk
    # (a part with none adds 0 to the monoid combine), so a part wholly past a batch element's
    # length walks no tile — NaN planted there never reaches the result. A length of 0 (no key
    # at all) walks every tile: jax.nn's average over the whole cache.
    q, kc, vc = _case(B=3, S=60, seed=4)
    lengths = np.array([20, 60, 0], np.int32)
    split = dict(split={"s": 4}, tiles={"s": 4})
    want = _ref(q, kc, vc, lengths)
    got = moajax.decode_attention(q, kc, vc, lengths, implementation=impl, onf=Preset.of(**split))
    walked = moajax.decode_attention(q, kc, vc, lengths, implementation=impl, onf=Preset.of(skip=False, **split))
    assert np.array_equal(np.asarray(got), np.asarray(walked))
    assert rel_err(got, want) <= 1e-12
    kc, vc = kc.copy(), vc.copy()
    kc[0, 30:], vc[0, 30:] = np.nan, np.nan  # parts 2 and 3 of batch element 0
    poisoned = moajax.decode_attention(q, kc, vc, lengths, implementation=impl, onf=Preset.of(**split))
    if impl == "pallas_interpret":  # one program per batch element (XLA runs the batch at once)
        assert np.array_equal(np.asarray(poisoned), np.asarray(got))


# ----------------------------------------------------------------------------- kv_append


def test_kv_append_writes_in_place_under_donation():
    cache = jnp.zeros((2, 64, 2, 8))
    new = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 2, 8)))
    step = jax.jit(moajax.kv_append, donate_argnums=0)
    ptr = cache.unsafe_buffer_pointer()
    out = step(cache, new, jnp.array([5, 61], jnp.int32))
    assert cache.is_deleted() and out.unsafe_buffer_pointer() == ptr  # the donated buffer is reused
    want = np.zeros((2, 64, 2, 8))
    want[0, 5:8], want[1, 61:64] = new[0], new[1]
    assert np.array_equal(np.asarray(out), want)
    text = jax.jit(moajax.kv_append).lower(jnp.zeros((2, 64, 2, 8)), new, jnp.array([0, 0], jnp.int32)).as_text()
    assert "scatter" in text and "dynamic_update_slice" not in text  # the T_new rows, not the buffer


def test_decoding_over_an_appended_cache_is_causal_attention():
    # token by token: append k, v at the step's position, decode the step's query
    r = np.random.default_rng(5)
    T, N, K, H = 6, 4, 2, 8
    q, k, v = r.standard_normal((1, T, N, H)), r.standard_normal((1, T, K, H)), r.standard_normal((1, T, K, H))
    kc, vc = jnp.zeros((1, 16, K, H)), jnp.zeros((1, 16, K, H))
    steps = []
    for t in range(T):
        pos = jnp.array([t], jnp.int32)
        kc, vc = moajax.kv_append(kc, k[:, t:t + 1], pos), moajax.kv_append(vc, v[:, t:t + 1], pos)
        steps.append(moajax.decode_attention(q[:, t], kc, vc, pos + 1))
    assert rel_err(np.stack(steps, axis=1), moajax.dot_product_attention(q, k, v, is_causal=True)) <= 1e-12


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_kv_append_under_jit_drops_what_lands_outside_the_cache(dtype):
    """Under jit the positions are not checked: the entries whose rows p + i fall outside
    [0, S_max) are dropped, the rest written, for any p. Before, a negative row wrapped (p = −2
    overwrote the cache's last two rows) and an int64 p of 2**32 was cast to int32 0 (the
    front). Expected: numpy's writes of the rows that lie inside, one by one."""
    from moajax import compat

    S_max, T_new = 8, 3
    positions = [-2, -4, 6, 7, 8, 2**31 - 1] + ([2**32, -(2**40)] if dtype == np.int64 else [])
    step = jax.jit(moajax.kv_append)
    with compat.enable_x64_context(True):
        for p in positions:
            cache = np.zeros((1, S_max, 2))
            new = np.arange(1.0, 1 + 2 * T_new).reshape(1, T_new, 2)
            want = cache.copy()
            for i in range(T_new):
                if 0 <= p + i < S_max:
                    want[0, p + i] = new[0, i]
            got = step(cache, new, np.array([p], dtype))
            assert np.array_equal(got, want), (p, np.asarray(got)[0, :, 0])


def test_kv_append_bad_input_is_named():
    cache, new = np.zeros((2, 8, 2, 4)), np.ones((2, 3, 2, 4))
    with pytest.raises(ValueError, match="kv_append: positions must lie in 0 … 5"):
        moajax.kv_append(cache, new, np.array([0, 6], np.int32))
    with pytest.raises(ValueError, match="kv_append: positions must lie in 0 … 5"):
        moajax.kv_append(cache, new, np.array([-1, 0], np.int32))
    with pytest.raises(ValueError, match="kv_append: positions must have shape"):
        moajax.kv_append(cache, new, np.array([0], np.int32))
    with pytest.raises(TypeError, match="kv_append: positions must be an integer array"):
        moajax.kv_append(cache, new, np.array([0.0, 1.0]))
    with pytest.raises(ValueError, match="kv_append: new has shape"):
        moajax.kv_append(cache, new[:, :, :1], np.array([0, 0], np.int32))
    with pytest.raises(TypeError, match="kv_append: new has dtype float32"):
        moajax.kv_append(cache, new.astype(np.float32), np.array([0, 0], np.int32))
    with pytest.raises(ValueError, match=r"kv_append: new holds 10 entries a batch element, more than the cache's 8"):
        moajax.kv_append(cache, np.ones((2, 10, 2, 4)), np.array([0, 0], np.int32))  # (blamed the positions)
