"""Checks of tests/references.py against facts independent of its formulas.

Backward references are compared with central finite differences of the
forward references; forward references are checked with algebraic
identities (softmax invariances, masking equivalences, GQA head repetition,
closed-form RMS values, residual identities) and a hand-computed example.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import references as ref  # noqa: E402

FD_STEP = 1e-6
FD_RTOL = 1e-6
RTOL = 1e-12
ATOL = 1e-12


def rng(seed=0):
    return np.random.default_rng(seed)


def numerical_grad(f, x, step=FD_STEP):
    """Central finite-difference gradient of scalar f at float64 array x."""
    x = np.array(x, dtype=np.float64)
    grad = np.zeros_like(x)
    flat_x = x.reshape(-1)
    flat_g = grad.reshape(-1)
    for i in range(flat_x.size):
        orig = flat_x[i]
        flat_x[i] = orig + step
        fp = f(x)
        flat_x[i] = orig - step
        fm = f(x)
        flat_x[i] = orig
        flat_g[i] = (fp - fm) / (2.0 * step)
    return grad


def rel_err(a, b):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    denom = max(np.linalg.norm(a), np.linalg.norm(b), 1e-300)
    return np.linalg.norm(a - b) / denom


def assert_grad_close(analytic, numeric, name):
    assert analytic.shape == numeric.shape, (name, analytic.shape, numeric.shape)
    assert np.all(np.isfinite(analytic)), name
    err = rel_err(analytic, numeric)
    assert err <= FD_RTOL, f"{name}: relative error {err:.3e} > {FD_RTOL}"


def check_fd(forward, backward_grads, args, cotangent, names):
    """Compare backward grads with FD of sum(forward(*args) * cotangent)."""
    for i, name in enumerate(names):

        def f(xi, i=i):
            a = list(args)
            a[i] = xi
            return float(np.sum(forward(*a) * cotangent))

        assert_grad_close(backward_grads[i], numerical_grad(f, args[i]), name)


# ---------------------------------------------------------------------------
# large_negative
# ---------------------------------------------------------------------------


def test_large_negative_values():
    assert ref.large_negative(np.float32) == -0.7 * float(np.finfo(np.float32).max)
    assert ref.large_negative(np.float64) == -0.7 * float(np.finfo(np.float32).max)  # jax.nn's cap
    assert np.isfinite(ref.large_negative(np.float64))


# ---------------------------------------------------------------------------
# attention forward
# ---------------------------------------------------------------------------


def test_attention_hand_computed():
    # scores = [0, log 3] -> weights [1/4, 3/4]; v = [0, 4] -> 3.
    q = np.array([[1.0]])
    k = np.array([[0.0], [np.log(3.0)]])
    v = np.array([[0.0], [4.0]])
    out = ref.attention(q, k, v, scale=1.0)
    np.testing.assert_allclose(out, [[3.0]], rtol=1e-14)
    # Default scale is 1/sqrt(H): with H = 4 and q = 2*ones, q.k/sqrt(4) = sum(k).
    q4 = 2.0 * np.ones((1, 4))
    k4 = np.array([[0.0, 0.0, 0.0, 0.0], [np.log(3.0), 0.0, 0.0, 0.0]])
    np.testing.assert_allclose(ref.attention(q4, k4, v), [[3.0]], rtol=1e-14)


def test_attention_ones_value_gives_ones():
    r = rng(1)
    T, S, H = 5, 7, 4
    q, k = r.normal(size=(T, H)), r.normal(size=(S, H))
    out = ref.attention(q, k, np.ones((S, 3)), is_causal=True)
    np.testing.assert_allclose(out, np.ones((T, 3)), rtol=1e-14)


def test_attention_identity_value_gives_probabilities():
    r = rng(2)
    T, S, H = 6, 8, 5
    q, k = r.normal(size=(T, H)), r.normal(size=(S, H))
    P = ref.attention(q, k, np.eye(S))
    assert np.all(P > 0)
    np.testing.assert_allclose(P.sum(axis=-1), np.ones(T), rtol=1e-14)
    # Ratio of probabilities = exp(score difference): independent softmax check.
    scores = (q @ k.T) / np.sqrt(H)
    np.testing.assert_allclose(
        np.log(P[:, 1:] / P[:, :1]), scores[:, 1:] - scores[:, :1], rtol=1e-10,
        atol=1e-12,
    )


def test_attention_bias_constant_invariance():
    r = rng(3)
    T, S, H, E = 5, 6, 4, 3
    q, k, v = r.normal(size=(T, H)), r.normal(size=(S, H)), r.normal(size=(S, E))
    base = ref.attention(q, k, v)
    np.testing.assert_allclose(ref.attention(q, k, v, bias=123.0), base, rtol=1e-12)
    row_const = r.normal(size=(T, 1)) * 50.0
    np.testing.assert_allclose(
        ref.attention(q, k, v, bias=row_const), base, rtol=1e-12, atol=1e-14
    )
    # A non-constant bias must change the result (guards against bias ignored).
    assert not np.allclose(ref.attention(q, k, v, bias=r.normal(size=(T, S))), base)


def test_attention_bias_shifts_scores():
    # log(P[t,s] / P[t,0]) must equal scores[t,s] - scores[t,0] with
    # scores = scale * q k^T + bias.
    r = rng(4)
    T, S, H = 3, 4, 2
    q, k = r.normal(size=(T, H)), r.normal(size=(S, H))
    bias = r.normal(size=(T, S))
    P = ref.attention(q, k, np.eye(S), scale=0.7, bias=bias)
    scores = 0.7 * (q @ k.T) + bias
    np.testing.assert_allclose(
        np.log(P / P[:, :1]), scores - scores[:, :1], rtol=1e-10, atol=1e-12
    )


@pytest.mark.parametrize("T,S", [(5, 5), (4, 7), (7, 4)])
def test_attention_causal_equals_tril_mask(T, S):
    r = rng(5)
    H, E = 3, 2
    q, k, v = r.normal(size=(T, H)), r.normal(size=(S, H)), r.normal(size=(S, E))
    tril = np.array([[s <= t for s in range(S)] for t in range(T)])
    a = ref.attention(q, k, v, is_causal=True)
    b = ref.attention(q, k, v, mask=tril)
    np.testing.assert_allclose(a, b, rtol=1e-14, atol=0)
    # Row 0 attends only to key 0.
    np.testing.assert_allclose(a[0], v[0], rtol=1e-14)
    # And differs from unmasked attention.
    assert not np.allclose(a, ref.attention(q, k, v))


def test_attention_mask_and_causal_combine_with_and():
    r = rng(6)
    T, S, H, E = 5, 5, 3, 2
    q, k, v = r.normal(size=(T, H)), r.normal(size=(S, H)), r.normal(size=(S, E))
    mask = r.random((T, S)) < 0.6
    mask[:, 0] = True
    tril = np.tril(np.ones((T, S), dtype=bool))
    np.testing.assert_allclose(
        ref.attention(q, k, v, mask=mask, is_causal=True),
        ref.attention(q, k, v, mask=mask & tril),
        rtol=1e-14,
    )


def test_attention_masked_keys_are_dropped():
    # Masking a key equals deleting that key from k and v.
    r = rng(7)
    T, S, H, E = 4, 6, 3, 2
    q, k, v = r.normal(size=(T, H)), r.normal(size=(S, H)), r.normal(size=(S, E))
    keep = np.array([True, False, True, True, False, True])
    np.testing.assert_allclose(
        ref.attention(q, k, v, mask=keep[None, :]),
        ref.attention(q, k[keep], v[keep]),
        rtol=1e-13,
    )


def test_attention_fully_masked_row_is_mean_of_v():
    r = rng(8)
    T, S, H, E = 4, 6, 3, 2
    q, k, v = r.normal(size=(T, H)), r.normal(size=(S, H)), r.normal(size=(S, E))
    mask = np.ones((T, S), dtype=bool)
    mask[2] = False
    out = ref.attention(q, k, v, mask=mask, bias=r.normal(size=(T, S)))
    np.testing.assert_allclose(out[2], v.mean(axis=0), rtol=1e-13)
    assert np.all(np.isfinite(out))


# ---------------------------------------------------------------------------
# attention backward (finite differences)
# ---------------------------------------------------------------------------


ATTN_CASES = [
    dict(),
    dict(scale=0.37),
    dict(is_causal=True),
    dict(bias="rand"),
    dict(mask="rand", is_causal=True, bias="rand"),
    dict(mask="row_off"),
]


@pytest.mark.parametrize("case", range(len(ATTN_CASES)))
def test_attention_backward_fd(case):
    r = rng(100 + case)
    T, S, H, E = 5, 6, 4, 3
    q, k, v = r.normal(size=(T, H)), r.normal(size=(S, H)), r.normal(size=(S, E))
    dout = r.normal(size=(T, E))
    kw = dict(ATTN_CASES[case])
    if kw.get("bias") == "rand":
        kw["bias"] = r.normal(size=(T, S))
    if kw.get("mask") == "rand":
        m = r.random((T, S)) < 0.7
        m[:, 0] = True
        kw["mask"] = m
    elif kw.get("mask") == "row_off":
        m = np.ones((T, S), dtype=bool)
        m[1] = False
        m[3, 2:] = False
        kw["mask"] = m

    grads = ref.attention_backward(q, k, v, dout, **kw)
    check_fd(
        lambda q_, k_, v_: ref.attention(q_, k_, v_, **kw),
        grads,
        (q, k, v),
        dout,
        ("dq", "dk", "dv"),
    )


def test_attention_backward_fully_masked_row_has_zero_dq():
    r = rng(9)
    T, S, H, E = 3, 4, 2, 2
    q, k, v = r.normal(size=(T, H)), r.normal(size=(S, H)), r.normal(size=(S, E))
    mask = np.ones((T, S), dtype=bool)
    mask[1] = False
    dq, _, _ = ref.attention_backward(q, k, v, r.normal(size=(T, E)), mask=mask)
    np.testing.assert_array_equal(dq[1], 0.0)
    assert np.any(dq[0] != 0.0)


# ---------------------------------------------------------------------------
# mha
# ---------------------------------------------------------------------------


def test_mha_equal_heads_is_per_head_attention():
    r = rng(10)
    B, T, S, N, H, E = 2, 4, 5, 3, 4, 2
    query = r.normal(size=(B, T, N, H))
    key = r.normal(size=(B, S, N, H))
    value = r.normal(size=(B, S, N, E))
    out = ref.mha(query, key, value, is_causal=True)
    assert out.shape == (B, T, N, E)
    for b in range(B):
        for n in range(N):
            np.testing.assert_allclose(
                out[b, :, n],
                ref.attention(query[b, :, n], key[b, :, n], value[b, :, n],
                              is_causal=True),
                rtol=1e-14,
            )


def test_mha_gqa_equals_repeated_kv_heads():
    r = rng(11)
    B, T, S, N, K, H, E = 2, 5, 6, 4, 2, 3, 4
    query = r.normal(size=(B, T, N, H))
    key = r.normal(size=(B, S, K, H))
    value = r.normal(size=(B, S, K, E))
    bias = r.normal(size=(1, N, T, S))
    mask = r.random((B, 1, T, S)) < 0.7
    mask[..., 0] = True
    kw = dict(bias=bias, mask=mask, scale=0.5)
    key_rep = np.repeat(key, N // K, axis=2)
    value_rep = np.repeat(value, N // K, axis=2)
    np.testing.assert_allclose(
        ref.mha(query, key, value, **kw),
        ref.mha(query, key_rep, value_rep, **kw),
        rtol=1e-14,
    )
    # Head 1 uses kv head 0, head 2 uses kv head 1 (not the interleaved order).
    out = ref.mha(query, key, value)
    np.testing.assert_allclose(
        out[0, :, 1], ref.attention(query[0, :, 1], key[0, :, 0], value[0, :, 0]),
        rtol=1e-14,
    )
    np.testing.assert_allclose(
        out[0, :, 2], ref.attention(query[0, :, 2], key[0, :, 1], value[0, :, 1]),
        rtol=1e-14,
    )


@pytest.mark.parametrize("K,causal", [(4, False), (2, True), (1, False)])
def test_mha_backward_fd(K, causal):
    r = rng(200 + K)
    B, T, S, N, H, E = 2, 3, 4, 4, 2, 3
    query = r.normal(size=(B, T, N, H))
    key = r.normal(size=(B, S, K, H))
    value = r.normal(size=(B, S, K, E))
    dout = r.normal(size=(B, T, N, E))
    mask = r.random((B, 1, T, S)) < 0.75
    mask[..., 0] = True
    kw = dict(bias=r.normal(size=(N, T, S)), mask=mask, is_causal=causal)
    grads = ref.mha_backward(query, key, value, dout, **kw)
    check_fd(
        lambda a, b, c: ref.mha(a, b, c, **kw),
        grads,
        (query, key, value),
        dout,
        ("dquery", "dkey", "dvalue"),
    )


def test_mha_backward_gqa_equals_summed_repeated_grads():
    r = rng(12)
    B, T, S, N, K, H, E = 1, 4, 5, 4, 2, 3, 2
    query = r.normal(size=(B, T, N, H))
    key = r.normal(size=(B, S, K, H))
    value = r.normal(size=(B, S, K, E))
    dout = r.normal(size=(B, T, N, E))
    dq, dk, dv = ref.mha_backward(query, key, value, dout)
    g = N // K
    dq_r, dk_r, dv_r = ref.mha_backward(
        query, np.repeat(key, g, axis=2), np.repeat(value, g, axis=2), dout
    )
    np.testing.assert_allclose(dq, dq_r, rtol=1e-13)
    np.testing.assert_allclose(dk, dk_r.reshape(B, S, K, g, H).sum(3), rtol=1e-13)
    np.testing.assert_allclose(dv, dv_r.reshape(B, S, K, g, E).sum(3), rtol=1e-13)


# ---------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [None, 0.3])
def test_decode_equals_attention_t1(scale):
    r = rng(13)
    S, H, E = 9, 5, 3
    q, k, v = r.normal(size=(H,)), r.normal(size=(S, H)), r.normal(size=(S, E))
    out = ref.decode(q, k, v, scale=scale)
    assert out.shape == (E,)
    np.testing.assert_allclose(
        out, ref.attention(q[None, :], k, v, scale=scale)[0], rtol=1e-14
    )


# ---------------------------------------------------------------------------
# rmsnorm
# ---------------------------------------------------------------------------


def test_rmsnorm_unit_rms_eps0():
    r = rng(14)
    x = r.normal(size=(6, 5)) * 3.0
    z = ref.rmsnorm(x, np.ones(5), eps=0.0)
    np.testing.assert_allclose(np.sqrt(np.mean(z**2, axis=-1)), 1.0, rtol=1e-14)
    # Direction is preserved.
    np.testing.assert_allclose(z / np.linalg.norm(z, axis=1, keepdims=True),
                               x / np.linalg.norm(x, axis=1, keepdims=True),
                               rtol=1e-14)


def test_rmsnorm_rms_with_eps():
    # z = x / sqrt(m + eps) with m = mean(x^2)  =>  rms(z) = 1/sqrt(1 + eps/m).
    r = rng(15)
    x = r.normal(size=(5, 4)) * 0.1
    eps = 1e-2
    z = ref.rmsnorm(x, np.ones(4), eps=eps)
    m = np.mean(x**2, axis=-1)
    np.testing.assert_allclose(
        np.sqrt(np.mean(z**2, axis=-1)), 1.0 / np.sqrt(1.0 + eps / m), rtol=1e-13
    )


def test_rmsnorm_weight_scales_columns_and_scale_invariance():
    r = rng(16)
    x = r.normal(size=(4, 6))
    w = r.normal(size=(6,))
    np.testing.assert_allclose(
        ref.rmsnorm(x, w, eps=0.0), w * ref.rmsnorm(x, np.ones(6), eps=0.0),
        rtol=1e-14,
    )
    np.testing.assert_allclose(
        ref.rmsnorm(7.5 * x, w, eps=0.0), ref.rmsnorm(x, w, eps=0.0), rtol=1e-13
    )


@pytest.mark.parametrize("eps", [1e-6, 1e-2])
def test_rmsnorm_backward_fd(eps):
    r = rng(17)
    N, D = 4, 5
    x, w, g = r.normal(size=(N, D)), r.normal(size=(D,)), r.normal(size=(N, D))
    grads = ref.rmsnorm_backward(x, w, g, eps=eps)
    check_fd(
        lambda x_, w_: ref.rmsnorm(x_, w_, eps=eps), grads, (x, w), g, ("dx", "dw")
    )


# ---------------------------------------------------------------------------
# silu / swiglu
# ---------------------------------------------------------------------------


def test_silu_values_and_stability():
    u = np.array([-800.0, -30.0, -1.0, 0.0, 1.0, 30.0, 800.0])
    with np.errstate(over="raise", invalid="raise", divide="raise", under="ignore"):
        s = ref.silu(u)
        ds = ref.silu_grad(u)
    expected = u / (1.0 + np.exp(-np.clip(u, -700, 700)))
    np.testing.assert_allclose(s, expected, rtol=1e-14, atol=1e-300)
    assert s[3] == 0.0 and ds[3] == 0.5
    np.testing.assert_allclose(ds[[0, -1]], [0.0, 1.0], atol=1e-300)


def test_silu_grad_fd():
    u = rng(18).normal(size=(4, 5)) * 4.0
    num = numerical_grad(lambda x: float(np.sum(ref.silu(x))), u)
    assert_grad_close(ref.silu_grad(u), num, "silu_grad")


def test_swiglu_matches_explicit_loops():
    r = rng(19)
    N, D, F = 3, 4, 5
    z = r.normal(size=(N, D))
    wg, wu, wd = r.normal(size=(D, F)), r.normal(size=(D, F)), r.normal(size=(F, D))
    out = ref.swiglu(z, wg, wu, wd)
    expected = np.zeros((N, D))
    for i in range(N):
        for f in range(F):
            a = sum(z[i, d] * wg[d, f] for d in range(D))
            b = sum(z[i, d] * wu[d, f] for d in range(D))
            h = a / (1.0 + np.exp(-a)) * b
            expected[i] += h * wd[f]
    np.testing.assert_allclose(out, expected, rtol=1e-12)


def test_swiglu_backward_fd():
    r = rng(20)
    N, D, F = 4, 3, 5
    z = r.normal(size=(N, D))
    wg, wu, wd = r.normal(size=(D, F)), r.normal(size=(D, F)), r.normal(size=(F, D))
    g = r.normal(size=(N, D))
    grads = ref.swiglu_backward(z, wg, wu, wd, g)
    check_fd(
        ref.swiglu, grads, (z, wg, wu, wd), g, ("dz", "dw_gate", "dw_up", "dw_down")
    )


# ---------------------------------------------------------------------------
# block
# ---------------------------------------------------------------------------


def _block_params(r, D=6, N=2, H=3, F=5):
    return dict(
        attn_norm=r.normal(size=(D,)),
        wq=r.normal(size=(D, N, H)),
        wk=r.normal(size=(D, N, H)),
        wv=r.normal(size=(D, N, H)),
        wo=r.normal(size=(N, H, D)),
        mlp_norm=r.normal(size=(D,)),
        w_gate=r.normal(size=(D, F)),
        w_up=r.normal(size=(D, F)),
        w_down=r.normal(size=(F, D)),
    )


@pytest.mark.parametrize("is_causal", [False, True])
def test_block_zero_output_projections_is_identity(is_causal):
    r = rng(21)
    x = r.normal(size=(7, 6))
    p = _block_params(r)
    p["wo"] = np.zeros_like(p["wo"])
    p["w_down"] = np.zeros_like(p["w_down"])
    np.testing.assert_array_equal(ref.block(x, is_causal=is_causal, **p), x)


def test_block_nonzero_weights_change_x_and_causality():
    r = rng(22)
    T = 6
    x = r.normal(size=(T, 6))
    p = _block_params(r)
    y = ref.block(x, is_causal=True, **p)
    assert y.shape == x.shape and not np.allclose(y, x)
    # Causal block: perturbing the last token leaves earlier outputs unchanged.
    x2 = x.copy()
    x2[-1] += 1.0
    y2 = ref.block(x2, is_causal=True, **p)
    np.testing.assert_array_equal(y2[:-1], y[:-1])
    assert not np.allclose(y2[-1], y[-1])
    # Without causality every row changes.
    yn, yn2 = ref.block(x, **p), ref.block(x2, **p)
    assert not np.allclose(yn[0], yn2[0])


def test_block_zero_mlp_is_attention_residual():
    # With w_down = 0 the block is x + sum_n attention_n @ wo_n; for a single
    # head with H = D, wq = wk = 0 gives uniform attention: x + mean_t(a Wv) Wo.
    r = rng(23)
    T, D = 5, 4
    x = r.normal(size=(T, D))
    p = _block_params(r, D=D, N=1, H=D)
    p["wq"] = np.zeros_like(p["wq"])
    p["w_down"] = np.zeros_like(p["w_down"])
    a = ref.rmsnorm(x, p["attn_norm"])
    vproj = a @ p["wv"][:, 0, :]
    expected = x + vproj.mean(axis=0, keepdims=True) @ p["wo"][0]
    np.testing.assert_allclose(ref.block(x, **p), expected, rtol=1e-13, atol=1e-14)


# ---------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------


def test_shape_validation_raises_value_error():
    r = rng(24)
    q, k, v = r.normal(size=(3, 2)), r.normal(size=(4, 2)), r.normal(size=(4, 2))
    with pytest.raises(ValueError, match="k"):
        ref.attention(q, r.normal(size=(4, 3)), v)
    with pytest.raises(ValueError, match="v"):
        ref.attention(q, k, r.normal(size=(5, 2)))
    with pytest.raises(ValueError, match="mask"):
        ref.attention(q, k, v, mask=np.ones((2, 4), dtype=bool))
    with pytest.raises(ValueError, match="bias"):
        ref.attention(q, k, v, bias=np.ones((3, 3)))
    with pytest.raises(ValueError, match="dout"):
        ref.attention_backward(q, k, v, np.ones((3, 3)))
    with pytest.raises(ValueError, match="key"):
        ref.mha(r.normal(size=(1, 3, 3, 2)), r.normal(size=(1, 4, 2, 2)),
                r.normal(size=(1, 4, 2, 2)))
    with pytest.raises(ValueError, match="q"):
        ref.decode(q, k, v)
    with pytest.raises(ValueError, match="w"):
        ref.rmsnorm(q, np.ones(3))
    with pytest.raises(ValueError, match="g"):
        ref.rmsnorm_backward(q, np.ones(2), np.ones((2, 2)))
    with pytest.raises(ValueError, match="w_down"):
        ref.swiglu(q, np.ones((2, 4)), np.ones((2, 4)), np.ones((4, 3)))
    p = _block_params(r)
    p["wo"] = np.zeros((2, 3, 5))
    with pytest.raises(ValueError, match="wo"):
        ref.block(r.normal(size=(4, 6)), **p)
