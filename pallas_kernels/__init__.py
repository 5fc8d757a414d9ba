"""Pallas GPU kernels generated from moajax ONFs (the only package importing jax.experimental.pallas)."""

from pallas_kernels.lower import check, lower

__all__ = ["lower", "check"]
