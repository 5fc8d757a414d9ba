"""Small definitions the kernels share (all in the algebra)."""

from __future__ import annotations

import numpy as np



def accumulation_dtype(dtype) -> np.dtype:
    """float32 accumulation for 16-bit floats; float32 and float64 accumulate in themselves."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype.itemsize < 4 else dtype


def large_negative(dtype) -> float:
    """The finite fill jax.nn uses for masked logits, −0.7·max, the max capped at float32's (as
    jax.nn caps it: float64 fills with −2.4e38 too, which its log-sum-exp residual shows): a
    fully masked row averages V."""
    import jax.numpy as jnp

    return float(-0.7 * min(float(jnp.finfo(dtype).max), float(jnp.finfo(np.float32).max)))
