"""RMSNorm (paper IV): r_t = √(Σ_d x²/D + ε), z = w ⊙ x ÷ r_t."""

from __future__ import annotations

from moajax import moa
from moajax.kernel import kernel
from moajax.kernels.common import accumulation_dtype


@kernel(example=dict(n=8, d=16))
def rmsnorm(x: "n d", weight: "d", *, eps: float = 1e-6):
    """z = w ⊙ x ÷ √(mean(x²) + ε), row by row (Ω⟨1 0⟩ divides each row by its r)."""
    acc = accumulation_dtype(x.dtype)
    xa, w = moa.cast(x, acc), moa.cast(weight, acc)
    r = moa.name("rms", moa.sqrt(moa.mean(xa * xa, axis=-1) + float(eps)))
    z = moa.omega(moa.div, (1, 0))(xa, r)
    return moa.cast(moa.omega(moa.mul, (1, 1))(z, w), x.dtype)


@kernel(example=dict(n=8, d=16), outputs=("z", "dx", "dweight"))
def rmsnorm_forward_backward(x: "n d", weight: "d", g: "n d", *, eps: float = 1e-6):
    """z = w ⊙ x̂ with (dx, dw) for g = ∂L/∂z, x̂ = x ÷ r (paper IV).

    corr = +/ (g ⊙ w ⊙ x̂) along d,  dx = (g ⊙ w − x̂ × corr ÷ D) ÷ r,  dw = +/ (g ⊙ x̂) along n."""
    acc = accumulation_dtype(x.dtype)
    xa, w, ga = moa.cast(x, acc), moa.cast(weight, acc), moa.cast(g, acc)
    r = moa.name("rms", moa.sqrt(moa.mean(xa * xa, axis=-1) + float(eps)))
    xhat = moa.name("xhat", moa.omega(moa.div, (1, 0))(xa, r))
    gw = moa.omega(moa.mul, (1, 1))(ga, w)
    corr = moa.name("corr", moa.sum(gw * xhat, axis=-1) / float(x.shape[-1]))
    dx = moa.omega(moa.div, (1, 0))(gw - moa.omega(moa.mul, (1, 0))(xhat, corr), r)
    dw = moa.sum(ga * xhat, axis=0)
    z = moa.omega(moa.mul, (1, 1))(xhat, w)
    return moa.cast(z, x.dtype), moa.cast(dx, x.dtype), moa.cast(dw, weight.dtype)


@kernel(example=dict(n=8, d=16, f=12))
def rmsnorm_matmul(x: "n d", weight: "d", w: "d f", *, eps: float = 1e-6):
    """Y = (w ⊙ x ÷ r) +.× W, r_n = √(Σ_d x²/D + ε): RMSNorm fused into the projection after it
    (paper IV's block: norm → QKV projection); the normalised rows are never stored."""
    acc = accumulation_dtype(x.dtype)
    xa, g, wa = moa.cast(x, acc), moa.cast(weight, acc), moa.cast(w, acc)
    r = moa.name("rms", moa.sqrt(moa.mean(xa * xa, axis=-1) + float(eps)))
    z = moa.omega(moa.mul, (1, 1))(moa.omega(moa.div, (1, 0))(xa, r), g)
    return moa.cast(moa.dot(z, wa), x.dtype)
