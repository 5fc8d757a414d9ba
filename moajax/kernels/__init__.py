"""The seed kernels, each defined in a few lines of the algebra (papers I, III, IV)."""

from moajax.kernels.attention import attention, attention_backward, attention_forward_backward, decode, mha
from moajax.kernels.block import block, residual_add
from moajax.kernels.mlp import swiglu, swiglu_forward_backward
from moajax.kernels.norm import rmsnorm, rmsnorm_forward_backward, rmsnorm_matmul
from moajax.kernels.softmax import logsumexp

__all__ = [
    "attention", "attention_backward", "attention_forward_backward", "decode", "mha", "rmsnorm",
    "rmsnorm_forward_backward", "rmsnorm_matmul", "logsumexp", "swiglu", "swiglu_forward_backward", "block",
    "residual_add",
]
