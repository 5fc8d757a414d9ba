"""Independent float64 NumPy references for moajax kernels.

Pure NumPy, float64 throughout. Written independently of the moajax package;
used by the test-suite as ground truth for attention, RMSNorm, SwiGLU and a
pre-norm transformer block (forward and backward).
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "large_negative",
    "attention",
    "attention_backward",
    "mha",
    "mha_backward",
    "decode",
    "rmsnorm",
    "rmsnorm_backward",
    "silu",
    "silu_grad",
    "swiglu",
    "swiglu_backward",
    "block",
]


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def large_negative(dtype):
    """Finite fill value for masked scores: -0.7 * min(finfo(dtype).max, finfo(float32).max).

    Mirrors jax.nn.dot_product_attention (which caps the max at float32's), so a fully
    masked row softmaxes to the uniform distribution (i.e. returns the mean of v).
    """
    return -0.7 * min(float(np.finfo(dtype).max), float(np.finfo(np.float32).max))


def _f64(x):
    return np.asarray(x, dtype=np.float64)


def _check_ndim(name, x, ndim):
    if x.ndim != ndim:
        raise ValueError(f"{name} must have rank {ndim}, got shape {x.shape}")


def _broadcast(name, x, shape):
    try:
        return np.broadcast_to(x, shape)
    except ValueError:
        raise ValueError(
            f"{name} with shape {np.shape(x)} is not broadcastable to {shape}"
        ) from None


def _scale(scale, H):
    if scale is None:
        return 1.0 / np.sqrt(H)
    return float(scale)


def _keep_mask(T, S, mask, is_causal):
    """Boolean [T, S] keep-mask (True = keep), or None if nothing is masked."""
    keep = None
    if mask is not None:
        m = np.asarray(mask)
        if m.dtype != np.bool_:
            raise ValueError(f"mask must be boolean, got dtype {m.dtype}")
        keep = _broadcast("mask", m, (T, S)).copy()
    if is_causal:
        causal = np.tril(np.ones((T, S), dtype=bool))
        keep = causal if keep is None else (keep & causal)
    return keep


def _softmax(s):
    """Stable softmax over the last axis: exp(s - max) / sum(exp(s - max))."""
    m = np.max(s, axis=-1, keepdims=True)
    e = np.exp(s - m)
    return e / np.sum(e, axis=-1, keepdims=True)


def _check_attention_args(q, k, v):
    _check_ndim("q", q, 2)
    _check_ndim("k", k, 2)
    _check_ndim("v", v, 2)
    T, H = q.shape
    S, Hk = k.shape
    if Hk != H:
        raise ValueError(f"k must have shape [S, {H}] to match q, got {k.shape}")
    if v.shape[0] != S:
        raise ValueError(f"v must have shape [{S}, E] to match k, got {v.shape}")
    return T, S, H


def _attention_probs(q, k, scale, bias, mask, is_causal):
    """Return (P, keep, scale) with P = softmax(masked(scale * q @ k.T + bias))."""
    T, H = q.shape
    S = k.shape[0]
    scale = _scale(scale, H)
    scores = scale * (q @ k.T)
    if bias is not None:
        scores = scores + _broadcast("bias", _f64(bias), (T, S))
    keep = _keep_mask(T, S, mask, is_causal)
    if keep is not None:
        scores = np.where(keep, scores, large_negative(np.float64))
    return _softmax(scores), keep, scale


# --------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------


def attention(q, k, v, *, scale=None, bias=None, mask=None, is_causal=False):
    """Single-head attention: softmax(mask(scale * q k^T + bias)) v.

    q [T,H], k [S,H], v [S,E] -> [T,E]; scale defaults to 1/sqrt(H); masked
    scores (mask False or s > t when causal) become large_negative(float64).
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    _check_attention_args(q, k, v)
    P, _, _ = _attention_probs(q, k, scale, bias, mask, is_causal)
    return P @ v


def attention_backward(
    q, k, v, dout, *, scale=None, bias=None, mask=None, is_causal=False, return_dbias=False
):
    """Gradient of sum(attention(q,k,v) * dout) w.r.t. (q, k, v) (and, with
    ``return_dbias``, w.r.t. a full [T, S] bias: dS itself, appended).

    dV = P^T dO; dS = P * (dO V^T - rowsum(dO * O)); dQ = scale dS K;
    dK = scale dS^T Q; masked scores are constants so their dS is zero.
    """
    q, k, v, dout = _f64(q), _f64(k), _f64(v), _f64(dout)
    T, S, H = _check_attention_args(q, k, v)
    E = v.shape[1]
    if dout.shape != (T, E):
        raise ValueError(f"dout must have shape {(T, E)}, got {dout.shape}")
    P, keep, scale = _attention_probs(q, k, scale, bias, mask, is_causal)
    out = P @ v
    dv = P.T @ dout
    dP = dout @ v.T
    delta = np.sum(dout * out, axis=-1, keepdims=True)
    dS = P * (dP - delta)
    if keep is not None:
        dS = np.where(keep, dS, 0.0)
    dq = scale * (dS @ k)
    dk = scale * (dS.T @ q)
    return (dq, dk, dv, dS) if return_dbias else (dq, dk, dv)


# --------------------------------------------------------------------------
# multi-head attention (jax.nn.dot_product_attention layout)
# --------------------------------------------------------------------------


def _check_mha_args(query, key, value):
    _check_ndim("query", query, 4)
    _check_ndim("key", key, 4)
    _check_ndim("value", value, 4)
    B, T, N, H = query.shape
    Bk, S, K, Hk = key.shape
    if Bk != B or Hk != H:
        raise ValueError(
            f"key must have shape [{B}, S, K, {H}] to match query, got {key.shape}"
        )
    if value.shape[:3] != (B, S, K):
        raise ValueError(
            f"value must have shape [{B}, {S}, {K}, E] to match key, "
            f"got {value.shape}"
        )
    if K == 0 or N % K != 0:
        raise ValueError(
            f"key: number of query heads N={N} must be a multiple of "
            f"kv heads K={K}"
        )
    return B, T, N, H, S, K


def _mha_extras(bias, mask, B, N, T, S):
    b = None if bias is None else _broadcast("bias", _f64(bias), (B, N, T, S))
    m = None
    if mask is not None:
        m = np.asarray(mask)
        if m.dtype != np.bool_:
            raise ValueError(f"mask must be boolean, got dtype {m.dtype}")
        m = _broadcast("mask", m, (B, N, T, S))
    return b, m


def mha(query, key, value, *, bias=None, mask=None, scale=None, is_causal=False):
    """Grouped-query attention in [B,T,N,H] layout -> [B,T,N,E].

    Query head n attends with kv head n // (N // K); bias/mask broadcast to
    [B,N,T,S]; each (b, n) slice is `attention`.
    """
    query, key, value = _f64(query), _f64(key), _f64(value)
    B, T, N, H, S, K = _check_mha_args(query, key, value)
    E = value.shape[3]
    b_full, m_full = _mha_extras(bias, mask, B, N, T, S)
    group = N // K
    out = np.zeros((B, T, N, E), dtype=np.float64)
    for b in range(B):
        for n in range(N):
            kv = n // group
            out[b, :, n, :] = attention(
                query[b, :, n, :],
                key[b, :, kv, :],
                value[b, :, kv, :],
                scale=scale,
                bias=None if b_full is None else b_full[b, n],
                mask=None if m_full is None else m_full[b, n],
                is_causal=is_causal,
            )
    return out


def mha_backward(
    query, key, value, dout, *, bias=None, mask=None, scale=None, is_causal=False, return_dbias=False
):
    """Gradient of sum(mha(query,key,value) * dout) w.r.t. (query, key, value) (and, with
    ``return_dbias``, w.r.t. a full [B, N, T, S] bias, appended).

    Per-(b, n) `attention_backward`; dkey/dvalue sum over the query heads
    sharing a kv head.
    """
    query, key, value, dout = _f64(query), _f64(key), _f64(value), _f64(dout)
    B, T, N, H, S, K = _check_mha_args(query, key, value)
    E = value.shape[3]
    if dout.shape != (B, T, N, E):
        raise ValueError(f"dout must have shape {(B, T, N, E)}, got {dout.shape}")
    b_full, m_full = _mha_extras(bias, mask, B, N, T, S)
    group = N // K
    dquery = np.zeros_like(query)
    dkey = np.zeros_like(key)
    dvalue = np.zeros_like(value)
    dbias = np.zeros((B, N, T, S))
    for b in range(B):
        for n in range(N):
            kv = n // group
            dq, dk, dv, dbias[b, n] = attention_backward(
                query[b, :, n, :],
                key[b, :, kv, :],
                value[b, :, kv, :],
                dout[b, :, n, :],
                scale=scale,
                bias=None if b_full is None else b_full[b, n],
                mask=None if m_full is None else m_full[b, n],
                is_causal=is_causal,
                return_dbias=True,
            )
            dquery[b, :, n, :] = dq
            dkey[b, :, kv, :] += dk
            dvalue[b, :, kv, :] += dv
    return (dquery, dkey, dvalue, dbias) if return_dbias else (dquery, dkey, dvalue)


def variant_keep(B, N, T, S, *, mask=None, local_window_size=None, query_seq_lengths=None,
                 key_value_seq_lengths=None):
    """(keep [B,N,T,S] or None, query rows kept [B,T] or None) for jax.nn's variants: a bool
    mask, a local window (int w or (left, right): t - left <= s <= t + right) and the
    per-batch sequence lengths (t < q_len[b], s < kv_len[b])."""
    keep = None if mask is None else np.broadcast_to(np.asarray(mask, bool), (B, N, T, S)).copy()
    t = np.arange(T)[:, None]
    s = np.arange(S)[None, :]
    if local_window_size is not None:
        left, right = ((local_window_size, local_window_size) if np.isscalar(local_window_size)
                       else local_window_size)
        win = np.broadcast_to((s >= t - left) & (s <= t + right), (B, N, T, S))
        keep = win.copy() if keep is None else keep & win
    rows = None
    if query_seq_lengths is not None or key_value_seq_lengths is not None:
        ql = np.full(B, T) if query_seq_lengths is None else np.asarray(query_seq_lengths)
        kl = np.full(B, S) if key_value_seq_lengths is None else np.asarray(key_value_seq_lengths)
        pad = np.stack([(t < ql[b]) & (s < kl[b]) for b in range(B)])[:, None]  # [B,1,T,S]
        pad = np.broadcast_to(pad, (B, N, T, S))
        keep = pad.copy() if keep is None else keep & pad
        if query_seq_lengths is not None:
            rows = np.stack([np.arange(T) < ql[b] for b in range(B)])
    return keep, rows


def mha_variants(query, key, value, *, bias=None, mask=None, scale=None, is_causal=False,
                 local_window_size=None, query_seq_lengths=None, key_value_seq_lengths=None, dout=None):
    """jax.nn.dot_product_attention with its variants, float64: the output, or with ``dout``
    the gradients (dquery, dkey, dvalue, dbias [B,N,T,S]) of sum(out * dout). Rows past the
    query length are 0 (so their dout does not flow back)."""
    B, T, N, _ = np.shape(query)
    S = np.shape(key)[1]
    keep, rows = variant_keep(B, N, T, S, mask=mask, local_window_size=local_window_size,
                              query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths)
    zero = (lambda x: x) if rows is None else (lambda x: x * rows[:, :, None, None])
    if dout is None:
        return zero(mha(query, key, value, bias=bias, mask=keep, scale=scale, is_causal=is_causal))
    return mha_backward(query, key, value, zero(_f64(dout)), bias=bias, mask=keep, scale=scale,
                        is_causal=is_causal, return_dbias=True)


def mha_lse(query, key, value, *, bias=None, mask=None, scale=None, is_causal=False, local_window_size=None,
            query_seq_lengths=None, key_value_seq_lengths=None):
    """jax.nn's residual (return_residual=True), float64: the log-sum-exp over the keys of the
    scores [B,T,N], each masked score (mask, causal, window, lengths: query rows past their
    length too) replaced by the inputs' dtype's large negative, as jax.nn does (a fully masked
    row: large negative + log S)."""
    fill = large_negative(np.asarray(query).dtype)
    query, key, value = _f64(query), _f64(key), _f64(value)
    B, T, N, H, S, K = _check_mha_args(query, key, value)
    keep, _ = variant_keep(B, N, T, S, mask=mask, local_window_size=local_window_size,
                           query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths)
    b_full, _ = _mha_extras(bias, None, B, N, T, S)
    out = np.zeros((B, T, N))
    for b in range(B):
        for n in range(N):
            kv = n // (N // K)
            s = _scale(scale, H) * (query[b, :, n] @ key[b, :, kv].T)
            if b_full is not None:
                s = s + b_full[b, n]
            k_ = _keep_mask(T, S, None if keep is None else keep[b, n], is_causal)
            if k_ is not None:
                s = np.where(k_, s, fill)
            m = s.max(axis=1)
            out[b, :, n] = m + np.log(np.exp(s - m[:, None]).sum(axis=1))
    return out


# --------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------


def decode(q, k, v, *, scale=None):
    """Single-query attention: softmax(scale * k q) v.

    q [H], k [S,H], v [S,E] -> [E]; scale defaults to 1/sqrt(H).
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    _check_ndim("q", q, 1)
    _check_ndim("k", k, 2)
    _check_ndim("v", v, 2)
    if k.shape[1] != q.shape[0]:
        raise ValueError(f"k must have shape [S, {q.shape[0]}], got {k.shape}")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"v must have shape [{k.shape[0]}, E], got {v.shape}")
    s = _scale(scale, q.shape[0]) * (k @ q)
    return _softmax(s) @ v


# --------------------------------------------------------------------------
# RMSNorm
# --------------------------------------------------------------------------


def _check_rmsnorm_args(x, w):
    _check_ndim("x", x, 2)
    _check_ndim("w", w, 1)
    if w.shape[0] != x.shape[1]:
        raise ValueError(f"w must have shape [{x.shape[1]}], got {w.shape}")


def rmsnorm(x, w, *, eps=1e-6):
    """RMSNorm over rows: r = sqrt(mean(x^2, -1) + eps); z = w * x / r.

    x [N,D], w [D] -> [N,D].
    """
    x, w = _f64(x), _f64(w)
    _check_rmsnorm_args(x, w)
    r = np.sqrt(np.mean(x * x, axis=-1) + eps)
    return w * x / r[:, None]


def rmsnorm_backward(x, w, g, *, eps=1e-6):
    """Gradient of sum(rmsnorm(x, w) * g) w.r.t. (x, w).

    xhat = x/r; dx = (g w - xhat * sum_d(g w xhat) / D) / r; dw = sum_rows g xhat.
    """
    x, w, g = _f64(x), _f64(w), _f64(g)
    _check_rmsnorm_args(x, w)
    if g.shape != x.shape:
        raise ValueError(f"g must have shape {x.shape}, got {g.shape}")
    D = x.shape[1]
    r = np.sqrt(np.mean(x * x, axis=-1) + eps)[:, None]
    xhat = x / r
    gw = g * w
    corr = np.sum(gw * xhat, axis=-1, keepdims=True)
    dx = (gw - xhat * corr / D) / r
    dw = np.sum(g * xhat, axis=0)
    return dx, dw


# --------------------------------------------------------------------------
# SiLU / SwiGLU
# --------------------------------------------------------------------------


def _sigmoid(u):
    """Stable logistic: 1/(1+e^-u) for u >= 0, e^u/(1+e^u) otherwise."""
    e = np.exp(-np.abs(u))
    return np.where(u >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def silu(u):
    """SiLU: u * sigmoid(u)."""
    u = _f64(u)
    return u * _sigmoid(u)


def silu_grad(u):
    """d silu / du = sigmoid(u) * (1 + u * (1 - sigmoid(u)))."""
    u = _f64(u)
    s = _sigmoid(u)
    return s * (1.0 + u * (1.0 - s))


def _check_swiglu_args(z, w_gate, w_up, w_down):
    _check_ndim("z", z, 2)
    _check_ndim("w_gate", w_gate, 2)
    _check_ndim("w_up", w_up, 2)
    _check_ndim("w_down", w_down, 2)
    D = z.shape[1]
    if w_gate.shape[0] != D:
        raise ValueError(f"w_gate must have shape [{D}, F], got {w_gate.shape}")
    F = w_gate.shape[1]
    if w_up.shape != (D, F):
        raise ValueError(f"w_up must have shape {(D, F)}, got {w_up.shape}")
    if w_down.shape != (F, D):
        raise ValueError(f"w_down must have shape {(F, D)}, got {w_down.shape}")


def swiglu(z, w_gate, w_up, w_down):
    """SwiGLU MLP: (silu(z W_gate) * (z W_up)) W_down; z [N,D] -> [N,D]."""
    z, w_gate, w_up, w_down = _f64(z), _f64(w_gate), _f64(w_up), _f64(w_down)
    _check_swiglu_args(z, w_gate, w_up, w_down)
    U = z @ w_gate
    V = z @ w_up
    return (silu(U) * V) @ w_down


def swiglu_backward(z, w_gate, w_up, w_down, g):
    """Gradient of sum(swiglu(z, ...) * g) w.r.t. (z, w_gate, w_up, w_down).

    GH = g W_down^T; GV = GH silu(U); GU = GH V silu'(U);
    dz = GU W_gate^T + GV W_up^T; dW_gate = z^T GU; dW_up = z^T GV; dW_down = H^T g.
    """
    z, w_gate, w_up, w_down = _f64(z), _f64(w_gate), _f64(w_up), _f64(w_down)
    g = _f64(g)
    _check_swiglu_args(z, w_gate, w_up, w_down)
    if g.shape != z.shape:
        raise ValueError(f"g must have shape {z.shape}, got {g.shape}")
    U = z @ w_gate
    V = z @ w_up
    sU = silu(U)
    H = sU * V
    GH = g @ w_down.T
    GV = GH * sU
    GU = GH * V * silu_grad(U)
    dz = GU @ w_gate.T + GV @ w_up.T
    dw_gate = z.T @ GU
    dw_up = z.T @ GV
    dw_down = H.T @ g
    return dz, dw_gate, dw_up, dw_down


# --------------------------------------------------------------------------
# transformer block
# --------------------------------------------------------------------------


def block(
    x,
    *,
    attn_norm,
    wq,
    wk,
    wv,
    wo,
    mlp_norm,
    w_gate,
    w_up,
    w_down,
    eps=1e-6,
    is_causal=False,
    scale=None,
):
    """Pre-norm transformer block on one sequence x [T,D].

    h = x + sum_n attention(a Wq_n, a Wk_n, a Wv_n) Wo_n with a = rmsnorm(x, attn_norm);
    y = h + swiglu(rmsnorm(h, mlp_norm), w_gate, w_up, w_down).
    """
    x = _f64(x)
    attn_norm, mlp_norm = _f64(attn_norm), _f64(mlp_norm)
    wq, wk, wv, wo = _f64(wq), _f64(wk), _f64(wv), _f64(wo)
    w_gate, w_up, w_down = _f64(w_gate), _f64(w_up), _f64(w_down)

    _check_ndim("x", x, 2)
    T, D = x.shape
    _check_ndim("attn_norm", attn_norm, 1)
    if attn_norm.shape != (D,):
        raise ValueError(f"attn_norm must have shape {(D,)}, got {attn_norm.shape}")
    _check_ndim("mlp_norm", mlp_norm, 1)
    if mlp_norm.shape != (D,):
        raise ValueError(f"mlp_norm must have shape {(D,)}, got {mlp_norm.shape}")
    _check_ndim("wq", wq, 3)
    if wq.shape[0] != D:
        raise ValueError(f"wq must have shape [{D}, N, H], got {wq.shape}")
    _, N, H = wq.shape
    _check_ndim("wk", wk, 3)
    if wk.shape != (D, N, H):
        raise ValueError(f"wk must have shape {(D, N, H)}, got {wk.shape}")
    _check_ndim("wv", wv, 3)
    if wv.shape[:2] != (D, N):
        raise ValueError(f"wv must have shape [{D}, {N}, E], got {wv.shape}")
    E = wv.shape[2]
    _check_ndim("wo", wo, 3)
    if wo.shape != (N, E, D):
        raise ValueError(f"wo must have shape {(N, E, D)}, got {wo.shape}")
    _check_ndim("w_gate", w_gate, 2)
    if w_gate.shape[0] != D:
        raise ValueError(f"w_gate must have shape [{D}, F], got {w_gate.shape}")

    a = rmsnorm(x, attn_norm, eps=eps)
    q = np.einsum("td,dnh->tnh", a, wq)
    k = np.einsum("td,dnh->tnh", a, wk)
    v = np.einsum("td,dnh->tnh", a, wv)
    heads = np.stack(
        [
            attention(q[:, n], k[:, n], v[:, n], scale=scale, is_causal=is_causal)
            for n in range(N)
        ],
        axis=1,
    )  # [T, N, E]
    h = x + np.einsum("tnh,nhd->td", heads, wo)
    return h + swiglu(rmsnorm(h, mlp_norm, eps=eps), w_gate, w_up, w_down)
