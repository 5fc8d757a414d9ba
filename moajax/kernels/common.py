"""Small definitions the kernels share (all in the algebra)."""

from __future__ import annotations

import numpy as np



def accumulation_dtype(dtype) -> np.dtype:
    """float32 accumulation for 16-bit floats; float32 and float64 accumulate in themselves."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype.itemsize < 4 else dtype


def large_negative(dtype) -> float:
    """The finite fill jax.nn uses for masked logits (−0.7·max): a fully masked row averages V."""
    import jax.numpy as jnp

    return float(-0.7 * jnp.finfo(dtype).max)
