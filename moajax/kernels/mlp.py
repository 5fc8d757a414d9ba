"""The SwiGLU gated MLP (paper IV): F = (silu(Z·W_g) ⊙ Z·W_u) · W_d."""

from __future__ import annotations

from moajax import moa
from moajax.kernel import kernel
from moajax.kernels.common import accumulation_dtype


@kernel(example=dict(n=8, d=6, f=12))
def swiglu(z: "n d", w_gate: "d f", w_up: "d f", w_down: "f d"):
    """U = Z +.× W_g, V = Z +.× W_u, H = silu(U) ⊙ V, F = H +.× W_d."""
    acc = accumulation_dtype(z.dtype)
    z_, wg, wu, wd = (moa.cast(a, acc) for a in (z, w_gate, w_up, w_down))
    u = moa.name("gate", z_ @ wg)
    v = moa.name("up", z_ @ wu)
    h = moa.name("hidden", moa.silu(u) * v)
    return moa.cast(h @ wd, z.dtype)
