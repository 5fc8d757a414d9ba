"""``moajax.transformer_block`` and ``transformer_stack``: the pre-norm block (RMSNorm →
GQA attention with RoPE → residual → RMSNorm → SwiGLU → residual) as its DSL kernels, against
a plain-jnp float64 block written here independently (its gradients by jax.grad), under jit,
vmap and lax.scan; bad params named.

Tolerances: float64 rel ≤ 1e-12 forward, ≤ 1e-11 gradients (sums of ≤ 32 terms in other
orders through three kernels and four projections: a few ulps each)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moajax
from helpers import rel_err

B, T, D, N, K, H, F = 2, 7, 12, 4, 2, 6, 16


def _params(seed=0, dtype=np.float64, layers=None):
    r = np.random.default_rng(seed)
    lead = () if layers is None else (layers,)
    shapes = {"attn_norm": (D,), "wq": (D, N, H), "wk": (D, K, H), "wv": (D, K, H), "wo": (N, H, D),
              "mlp_norm": (D,), "w_gate": (D, F), "w_up": (D, F), "w_down": (F, D)}
    p = {}
    for name, shape in shapes.items():
        scale = 1.0 if name.endswith("norm") else 1 / np.sqrt(shape[0])
        base = 1.0 if name.endswith("norm") else 0.0
        p[name] = (base + scale * r.standard_normal(lead + shape)).astype(dtype)
    return p


def _reference(p, x, *, is_causal=True, eps=1e-6, rope_theta=None):
    def norm(x, w):
        return w * x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)

    def rotate(x):  # the pair (x_i, x_{i+H/2}) turned by t·θ^(−2i/H)
        half = H // 2
        ang = np.arange(T)[:, None] * rope_theta ** (-2.0 * np.arange(half)[None] / H)
        c, s = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
        lo, hi = x[..., :half], x[..., half:]
        return jnp.concatenate([lo * c - hi * s, hi * c + lo * s], axis=-1)

    a = norm(x, p["attn_norm"])
    q, k, v = (jnp.einsum("btd,dnh->btnh", a, p[w]) for w in ("wq", "wk", "wv"))
    if rope_theta is not None:
        q, k = rotate(q), rotate(k)
    k, v = jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2)  # query head n reads kv head n // G
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
    if is_causal:
        s = jnp.where(np.tril(np.ones((T, T), bool)), s, -jnp.inf)
    o = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v)
    h = x + jnp.einsum("btnh,nhd->btd", o, p["wo"])
    m = norm(h, p["mlp_norm"])
    u = m @ p["w_gate"]
    return h + (u * jax.nn.sigmoid(u) * (m @ p["w_up"])) @ p["w_down"]


def _x(seed=1, dtype=np.float64, lead=(B,)):
    return np.random.default_rng(seed).standard_normal(lead + (T, D)).astype(dtype)


@pytest.mark.parametrize("rope_theta", [None, 10000.0])
def test_block_with_gqa_and_rope_matches_the_reference(rope_theta):
    p, x = _params(), _x()
    f = jax.jit(lambda p, x: moajax.transformer_block(p, x, rope_theta=rope_theta))
    assert rel_err(f(p, x), _reference(p, x, rope_theta=rope_theta)) <= 1e-12
    g = np.random.default_rng(2).standard_normal(x.shape)
    got = jax.jit(jax.grad(lambda p, x: jnp.sum(moajax.transformer_block(p, x, rope_theta=rope_theta) * g),
                           argnums=(0, 1)))(p, x)
    want = jax.grad(lambda p, x: jnp.sum(_reference(p, x, rope_theta=rope_theta) * g), argnums=(0, 1))(p, x)
    for name in p:
        assert rel_err(got[0][name], want[0][name]) <= 1e-11, name
    assert rel_err(got[1], want[1]) <= 1e-11


def test_block_on_pallas_interpret_not_causal():
    p, x = _params(3), _x(4)
    got = moajax.transformer_block(p, x, is_causal=False, implementation="pallas_interpret")
    assert rel_err(got, _reference(p, x, is_causal=False)) <= 1e-12


def test_stack_scans_the_layers_and_vmap_batches_the_block():
    ps, x = _params(5, layers=2), _x(6)
    out = jax.jit(lambda ps, x: moajax.transformer_stack(ps, x, rope_theta=500.0))(ps, x)
    want = x
    for i in range(2):
        want = _reference({k: v[i] for k, v in ps.items()}, want, rope_theta=500.0)
    assert rel_err(out, want) <= 1e-12
    p, xs = _params(7), _x(8, lead=(3, B))
    out = jax.vmap(lambda x: moajax.transformer_block(p, x))(xs)
    for i in range(3):
        assert rel_err(out[i], _reference(p, xs[i])) <= 1e-12


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_rope_in_16_bits_rounds_only_its_result(dtype):
    """rope in bfloat16/float16: the angles t·θ^(−2i/H), their cos and sin and the rotation
    in float32, then one rounding to x's dtype, so the result is within one rounding of the
    float64 rotation of the same 16-bit x: |err| ≤ 2^−p |exact| (p = 8 for bfloat16's 8-bit
    significand, 11 for float16's), with a float32 margin. Before, the angles were 16-bit
    (a position past 256 is not even a bfloat16): an error of 0.18 at T = 256 in bfloat16."""
    from moajax.api import rope

    T_, Hh = 256, 16
    x = jnp.asarray(np.random.default_rng(3).standard_normal((1, T_, 2, Hh)), dtype)
    half = Hh // 2
    ang = np.arange(T_)[:, None] * 1e4 ** (-2.0 * np.arange(half)[None] / Hh)
    c, s = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
    xf = np.asarray(x, np.float64)
    lo, hi = xf[..., :half], xf[..., half:]
    exact = np.concatenate([lo * c - hi * s, hi * c + lo * s], axis=-1)
    got = np.asarray(rope(x, np.arange(T_), 1e4), np.float64)
    p = 8 if dtype == "bfloat16" else 11
    assert np.all(np.abs(got - exact) <= 2.0**-p * np.abs(exact) + 1e-5), np.max(np.abs(got - exact))


def test_bad_params_are_named():
    p, x = _params(), _x()
    missing = {k: v for k, v in p.items() if k != "wo"}
    with pytest.raises(ValueError, match="transformer_block: params is missing 'wo'"):
        moajax.transformer_block(missing, x)
    with pytest.raises(ValueError, match=r"params\['wk'\] has shape \[12, 2, 5\]: its H is 5, elsewhere 6"):
        moajax.transformer_block({**p, "wk": p["wk"][..., :5]}, x)
    with pytest.raises(TypeError, match="transformer_block: w_up has dtype float32"):
        moajax.transformer_block({**p, "w_up": p["w_up"].astype(np.float32)}, x)
    with pytest.raises(ValueError, match="transformer_block: x must be"):
        moajax.transformer_block(p, x[0])
    with pytest.raises(ValueError, match="not a multiple"):
        moajax.transformer_block({**p, "wk": p["wk"][:, :1].repeat(3, 1), "wv": p["wv"][:, :1].repeat(3, 1)}, x)
    with pytest.raises(ValueError, match="rope_theta needs an even head dim"):
        moajax.transformer_block(p, x, rope_theta=-1.0)
    with pytest.raises(ValueError, match="rope_theta needs an even head dim and a finite"):
        moajax.transformer_block(p, x, rope_theta=float("inf"))
    with pytest.raises(TypeError, match="rope_theta must be a static Python number, got str"):
        moajax.transformer_block(p, x, rope_theta="1e4")
    with pytest.raises(TypeError, match="params must be a dict"):
        moajax.transformer_block([p], x)
    # named as the block's (they named rms_norm and dot_product_attention: a helper's fuzz)
    with pytest.raises(ValueError, match="transformer_block: eps must be a positive finite number"):
        moajax.transformer_block(p, x, eps=0.0)
    with pytest.raises(TypeError, match="transformer_block: is_causal must be a static bool"):
        moajax.transformer_block(p, x, is_causal=1)
    with pytest.raises(ValueError, match="transformer_block: implementation must be"):
        moajax.transformer_block(p, x, implementation="cudnn")
    with pytest.raises(ValueError, match="transformer_block: zero-size dimension K"):  # (was a ZeroDivisionError)
        moajax.transformer_block({**p, "wk": p["wk"][:, :0], "wv": p["wv"][:, :0]}, x)
    with pytest.raises(ValueError, match="transformer_block: zero-size dimension B"):
        moajax.transformer_block(p, x[:0])
    stacked = _params(layers=2)
    with pytest.raises(TypeError, match=r"transformer_stack: stacked_params\['note'\] must be an array"):
        moajax.transformer_stack({**stacked, "note": 1.0}, x)
