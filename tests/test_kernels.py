"""The seed kernels through the DNF → JAX path against independent float64 references,
and against jax.nn in float32; jit, vmap, grad and make_jaxpr on each."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import references as R
from helpers import rel_err
from moajax.kernels import attention, block, decode, logsumexp, rmsnorm, rmsnorm_matmul, swiglu

# float64 end to end: errors are a few ulps times the depth of the sum trees.
F64 = 1e-12
# float32 vs jax.nn (XLA's own float32 softmax/dots): ~10 ulps of float32 (1.2e-7 each).
F32 = 2e-6

rng = np.random.default_rng(42)


def randn(*shape):
    return rng.standard_normal(shape)


def block_params(D=8, N=2, H=4, F=12):
    return dict(attn_norm=randn(D), wq=randn(D, N, H) / 2, wk=randn(D, N, H) / 2, wv=randn(D, N, H) / 2,
                wo=randn(N, H, D) / 2, mlp_norm=randn(D), w_gate=randn(D, F) / 2, w_up=randn(D, F) / 2,
                w_down=randn(F, D) / 2)


@pytest.mark.parametrize("T,S,H,E", [(8, 12, 4, 6), (5, 5, 3, 3), (1, 7, 8, 2), (9, 4, 72, 5)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_attention_float64(T, S, H, E, is_causal):
    q, k, v = randn(T, H), randn(S, H), randn(S, E)
    out = attention(q, k, v, is_causal=is_causal)
    assert out.dtype == jnp.float64
    assert rel_err(out, R.attention(q, k, v, is_causal=is_causal)) <= F64
    assert rel_err(attention(q, k, v, scale=0.3), R.attention(q, k, v, scale=0.3)) <= F64


def test_attention_matches_jax_nn_float32():
    q, k, v = (randn(16, 8).astype(np.float32) for _ in range(3))
    ours = attention(q, k, v)
    theirs = jax.nn.dot_product_attention(q[None, :, None], k[None, :, None], v[None, :, None])[0, :, 0]
    assert ours.dtype == jnp.float32
    assert rel_err(ours, theirs) <= F32
    ours_c = attention(q, k, v, is_causal=True)
    theirs_c = jax.nn.dot_product_attention(q[None, :, None], k[None, :, None], v[None, :, None], is_causal=True)[0, :, 0]
    assert rel_err(ours_c, theirs_c) <= F32


def test_decode_float64():
    q, k, v = randn(6), randn(20, 6), randn(20, 3)
    assert rel_err(decode(q, k, v), R.decode(q, k, v)) <= F64


def test_rmsnorm_float64():
    x, w = randn(7, 16), randn(16)
    assert rel_err(rmsnorm(x, w), R.rmsnorm(x, w)) <= F64
    assert rel_err(rmsnorm(x, w, eps=0.5), R.rmsnorm(x, w, eps=0.5)) <= F64


def test_rmsnorm_matmul_float64():
    x, w, W = randn(7, 16), randn(16), randn(16, 5)
    assert rel_err(rmsnorm_matmul(x, w, W), R.rmsnorm(x, w) @ W) <= F64
    assert rel_err(rmsnorm_matmul(x, w, W, eps=0.5), R.rmsnorm(x, w, eps=0.5) @ W) <= F64


def test_logsumexp_float64_is_overflow_free():
    x = randn(6, 40) * 30 + 700  # exp(x) alone overflows float64 past ~709.8
    m = x.max(axis=-1, keepdims=True)
    ref = (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))[:, 0]
    out = logsumexp(x)
    assert np.all(np.isfinite(out))
    assert rel_err(out, ref) <= F64


def test_grad_of_rmsnorm_matmul_and_logsumexp_float64():
    """The compiled adjoints against jax.grad of plain-jnp formulas (float64)."""
    x, w, W, g = randn(7, 16), randn(16), randn(16, 5), randn(7, 5)

    def plain(x, w, W):
        return (x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * w) @ W

    ours = jax.grad(lambda *a: jnp.sum(rmsnorm_matmul(*a) * g), argnums=(0, 1, 2))(x, w, W)
    theirs = jax.grad(lambda *a: jnp.sum(plain(*a) * g), argnums=(0, 1, 2))(x, w, W)
    for a, b in zip(ours, theirs):
        assert rel_err(a, b) <= F64
    y, gy = randn(6, 9), randn(6)
    ours = jax.grad(lambda y: jnp.sum(logsumexp(y) * gy))(y)
    soft = np.exp(y - y.max(-1, keepdims=True))
    assert rel_err(ours, gy[:, None] * soft / soft.sum(-1, keepdims=True)) <= F64


def test_swiglu_float64():
    args = randn(7, 6), randn(6, 12), randn(6, 12), randn(12, 6)
    assert rel_err(swiglu(*args), R.swiglu(*args)) <= F64


@pytest.mark.parametrize("is_causal", [False, True])
def test_block_float64(is_causal):
    x, p = randn(6, 8), block_params()
    out = block(x, *p.values(), is_causal=is_causal)
    assert rel_err(out, R.block(x, **p, is_causal=is_causal)) <= F64


def test_bfloat16_accumulates_in_float32():
    q, k, v = (jnp.asarray(randn(8, 4), jnp.bfloat16) for _ in range(3))
    out = attention(q, k, v)
    assert out.dtype == jnp.bfloat16
    ref = R.attention(*(np.asarray(a.astype(jnp.float32), np.float64) for a in (q, k, v)))
    # one bf16 rounding of the output (2^-8 relative) dominates: float32 inside
    assert rel_err(out.astype(jnp.float32), ref) <= 2 ** -8
    d = attention.dnf(q, k, v)
    assert d.output.dtype == jnp.bfloat16
    assert "float32" in d.pretty()


# ---- JAX transformations


def all_kernels():
    x, p = randn(6, 8), block_params()
    return [
        (attention, (randn(8, 4), randn(12, 4), randn(12, 6)), {}),
        (decode, (randn(4), randn(12, 4), randn(12, 6)), {}),
        (rmsnorm, (randn(7, 16), randn(16)), {}),
        (swiglu, (randn(7, 6), randn(6, 12), randn(6, 12), randn(12, 6)), {}),
        (rmsnorm_matmul, (randn(7, 16), randn(16), randn(16, 5)), {}),
        (logsumexp, (randn(5, 11),), {}),
        (block, (x, *p.values()), {"is_causal": True}),
    ]


@pytest.mark.parametrize("kern,args,opts", all_kernels(), ids=lambda x: getattr(x, "name", ""))
def test_make_jaxpr_jit(kern, args, opts):
    jaxpr = jax.make_jaxpr(lambda *a: kern(*a, **opts))(*args)
    assert len(jaxpr.eqns) > 0
    eager = kern(*args, **opts)
    jitted = jax.jit(lambda *a: kern(*a, **opts))(*args)
    assert rel_err(jitted, eager) <= F64


def test_vmap_over_batch_attention():
    B = 3
    q, k, v = randn(B, 8, 4), randn(B, 12, 4), randn(B, 12, 6)
    out = jax.vmap(attention)(q, k, v)
    ref = np.stack([R.attention(q[b], k[b], v[b]) for b in range(B)])
    assert rel_err(out, ref) <= F64


def test_vmap_over_batch_all_kernels():
    B = 2
    for kern, args, opts in all_kernels():
        batched = [np.stack([a] + [randn(*np.shape(a)) for _ in range(B - 1)]) for a in args]
        got = jax.vmap(lambda *a: kern(*a, **opts))(*batched)
        for b in range(B):
            assert rel_err(got[b], kern(*[a[b] for a in batched], **opts)) <= F64


def test_grad_attention_matches_reference_backward():
    q, k, v, g = randn(6, 4), randn(9, 4), randn(9, 5), randn(6, 5)
    for causal in (False, True):
        loss = lambda q, k, v: jnp.sum(attention(q, k, v, is_causal=causal) * g)
        dq, dk, dv = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
        rq, rk, rv = R.attention_backward(q, k, v, g, is_causal=causal)
        for got, want in ((dq, rq), (dk, rk), (dv, rv)):
            assert rel_err(got, want) <= 1e-11


def test_grad_decode_rmsnorm_swiglu():
    q, k, v, g = randn(4), randn(9, 4), randn(9, 5), randn(5)
    dq, dk, dv = jax.grad(lambda q, k, v: jnp.sum(decode(q, k, v) * g), argnums=(0, 1, 2))(q, k, v)
    rq, rk, rv = R.attention_backward(q[None], k, v, g[None])
    assert rel_err(dq, rq[0]) <= 1e-11 and rel_err(dk, rk) <= 1e-11 and rel_err(dv, rv) <= 1e-11

    x, w, gz = randn(5, 8), randn(8), randn(5, 8)
    dx, dw = jax.grad(lambda x, w: jnp.sum(rmsnorm(x, w) * gz), argnums=(0, 1))(x, w)
    rx, rw = R.rmsnorm_backward(x, w, gz)
    assert rel_err(dx, rx) <= 1e-11 and rel_err(dw, rw) <= 1e-11

    args = randn(5, 6), randn(6, 10), randn(6, 10), randn(10, 6)
    gf = randn(5, 6)
    grads = jax.grad(lambda *a: jnp.sum(swiglu(*a) * gf), argnums=(0, 1, 2, 3))(*args)
    refs = R.swiglu_backward(*args, gf)
    for got, want in zip(grads, refs):
        assert rel_err(got, want) <= 1e-11


def test_grad_block_directional_derivative():
    # ⟨∇f(x), u⟩ against a central difference of the float64 reference block
    x, p, u = randn(6, 8), block_params(), randn(6, 8)
    gx = jax.grad(lambda x: jnp.sum(block(x, *p.values(), is_causal=True) ** 2))(x)
    f = lambda x: np.sum(R.block(x, **p, is_causal=True) ** 2)
    eps = 1e-6
    fd = (f(x + eps * u) - f(x - eps * u)) / (2 * eps)
    assert abs(float(np.sum(np.asarray(gx) * u)) - fd) <= 1e-6 * max(1.0, abs(fd))


def test_kernel_argument_errors():
    with pytest.raises(ValueError, match="argument 'key' must have rank 2"):
        attention(randn(4, 4), randn(4), randn(4, 4))
    with pytest.raises(ValueError, match="dimension 'h' is 4 in argument 'query' but 5 in argument 'key'"):
        attention(randn(4, 4), randn(6, 5), randn(6, 4))
    with pytest.raises(TypeError, match="unknown option"):
        attention(randn(4, 4), randn(4, 4), randn(4, 4), bogus=1)
    with pytest.raises(TypeError, match="expected 3 arrays"):
        attention(randn(4, 4), randn(4, 4))
