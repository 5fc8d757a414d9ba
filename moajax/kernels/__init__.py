"""The seed kernels, each defined in a few lines of the algebra (papers I, III, IV)."""

from moajax.kernels.attention import attention, decode, mha
from moajax.kernels.block import block
from moajax.kernels.mlp import swiglu
from moajax.kernels.norm import rmsnorm

__all__ = ["attention", "decode", "mha", "rmsnorm", "swiglu", "block"]
