"""The pre-norm transformer block in plain jnp with jax.nn attention: the baseline the
benchmark and training scripts put beside ``moajax.transformer_block`` (one definition for
all of them). Same params dict and conventions: RMSNorm with ε = 1e-6, causal attention,
RoPE in the rotate-half convention when ``rope_theta`` is given, a SwiGLU MLP."""

from __future__ import annotations


def rms_norm(x, w, eps: float = 1e-6):
    import jax
    import jax.numpy as jnp

    return w * x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def block_params(r, D: int, N: int, H: int, F: int, dtype) -> dict:
    """The block's params dict (``moajax.transformer_block``'s), drawn from the NumPy generator
    ``r``: each weight standard normal over √(its fan-in), the norms' weights 1 plus that."""
    import jax.numpy as jnp
    import numpy as np

    shapes = {"attn_norm": (D,), "wq": (D, N, H), "wk": (D, N, H), "wv": (D, N, H), "wo": (N, H, D),
              "mlp_norm": (D,), "w_gate": (D, F), "w_up": (D, F), "w_down": (F, D)}
    return {k: jnp.asarray((1.0 if k.endswith("norm") else 0.0) + r.standard_normal(s) / np.sqrt(s[0]), dtype)
            for k, s in shapes.items()}


def rope(x, theta: float):
    """x [B, T, N, H]: the pair (x_i, x_{i+H/2}) turned by t·θ^(−2i/H)."""
    import jax.numpy as jnp
    import numpy as np

    T, H = x.shape[1], x.shape[-1]
    ang = np.arange(T)[:, None] * theta ** (-2.0 * np.arange(H // 2)[None] / H)
    c, s = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
    lo, hi = x[..., : H // 2], x[..., H // 2:]
    return jnp.concatenate([lo * c - hi * s, hi * c + lo * s], axis=-1)


def plain_block(p, x, rope_theta: float | None = None):
    """h = x + attention(rms_norm(x) W_q, W_k, W_v) W_o;  h + SwiGLU(rms_norm(h))."""
    import jax
    import jax.numpy as jnp

    a = rms_norm(x, p["attn_norm"])
    q, k, v = (jnp.einsum("btd,dnh->btnh", a, p[w]) for w in ("wq", "wk", "wv"))
    if rope_theta is not None:
        q, k = rope(q, rope_theta), rope(k, rope_theta)
    h = x + jnp.einsum("btnh,nhd->btd", jax.nn.dot_product_attention(q, k, v, is_causal=True), p["wo"])
    m = rms_norm(h, p["mlp_norm"])
    return h + (jax.nn.silu(m @ p["w_gate"]) * (m @ p["w_up"])) @ p["w_down"]
