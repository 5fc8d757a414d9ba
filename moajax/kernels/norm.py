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
