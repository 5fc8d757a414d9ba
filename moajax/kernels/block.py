"""The pre-norm transformer block (paper IV): norm → QKV → attention → residual → norm → MLP → residual."""

from __future__ import annotations

from moajax import moa
from moajax.kernel import kernel
from moajax.kernels.attention import attention
from moajax.kernels.mlp import swiglu
from moajax.kernels.norm import rmsnorm


@kernel(example=dict(t=6, d=8))
def residual_add(x: "t d", y: "t d"):
    """h = x + y: the block's residual connection (its gradient passes through unchanged)."""
    return x + y


@kernel(example=dict(t=6, d=8, n=2, h=4, f=12))
def block(
    x: "t d", attn_norm: "d", wq: "d n h", wk: "d n h", wv: "d n h", wo: "n h d",
    mlp_norm: "d", w_gate: "d f", w_up: "d f", w_down: "f d",
    *, eps: float = 1e-6, is_causal: bool = False, scale: float | None = None,
):
    """y = h + swiglu(rmsnorm(h)),  h = x + +/ₙ Ω⟨2 2⟩(+.×)(attention per head, W_o)."""
    xn = rmsnorm.define(x, attn_norm, eps=eps)
    # per-head projections, heads first: ⍉⟨1 0 2⟩ (xn +.× W) has ρ = ⟨n t h⟩
    q, k, v = (moa.transpose(xn @ w, (1, 0, 2)) for w in (wq, wk, wv))
    heads = moa.omega(lambda a, b, c: attention.define(a, b, c, scale=scale, is_causal=is_causal), (2, 2, 2))(q, k, v)
    proj = moa.sum(moa.omega(moa.dot, (2, 2))(heads, wo), axis=0)  # Σ_n heads[n] +.× W_o[n]
    h = moa.name("residual", x + proj)
    return h + swiglu.define(rmsnorm.define(h, mlp_norm, eps=eps), w_gate, w_up, w_down)
