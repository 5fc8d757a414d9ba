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


def silu_grad(u: moa.Array) -> moa.Array:
    """silu′(u) = σ(u) (1 + u (1 − σ(u)))."""
    s = moa.sigmoid(u)
    return s * (1.0 + u * (1.0 - s))


@kernel(example=dict(n=8, d=6, f=12), outputs=("f", "dz", "dw_gate", "dw_up", "dw_down"))
def swiglu_forward_backward(z: "n d", w_gate: "d f", w_up: "d f", w_down: "f d", g: "n d"):
    """F = H +.× W_d with (dZ, dW_g, dW_u, dW_d) for G = ∂L/∂F (paper IV).

    Every transpose is a reordered read:
    GH = G +.× ⍉W_d,  GV = GH ⊙ silu(U),  GU = GH ⊙ V ⊙ silu′(U),
    dZ = GU +.× ⍉W_g + GV +.× ⍉W_u,  dW_g = ⍉Z +.× GU,  dW_u = ⍉Z +.× GV,  dW_d = ⍉H +.× G."""
    acc = accumulation_dtype(z.dtype)
    z_, wg, wu, wd, g_ = (moa.cast(a, acc) for a in (z, w_gate, w_up, w_down, g))
    u = moa.name("gate", z_ @ wg)
    v = moa.name("up", z_ @ wu)
    h = moa.name("hidden", moa.silu(u) * v)
    gh = moa.name("dhidden", g_ @ moa.transpose(wd))
    gv = moa.name("dup", gh * moa.silu(u))
    gu = moa.name("dgate", gh * v * silu_grad(u))
    zt = moa.transpose(z_)
    dz = gu @ moa.transpose(wg) + gv @ moa.transpose(wu)
    return (moa.cast(h @ wd, z.dtype), moa.cast(dz, z.dtype), moa.cast(zt @ gu, w_gate.dtype),
            moa.cast(zt @ gv, w_up.dtype), moa.cast(moa.transpose(h) @ g_, w_down.dtype))
