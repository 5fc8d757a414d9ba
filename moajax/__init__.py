"""moajax: Mathematics of Arrays kernels for JAX.

array math (``moajax.moa``) → ψ-reduction → DNF (``moajax.dnf``) → ONF schedule for a machine
(``moajax.onf``, ``moajax.rewrites``, ``moajax.schedule``) → XLA (CPU) or Pallas (GPU) kernels.
"""

from moajax import moa
from moajax.api import (attention_onf, decode_attention, dot_product_attention, gated_mlp, kv_append, rms_norm,
                        traced_onfs, transformer_block, transformer_stack)
from moajax.dnf import DNF
from moajax.kernel import Kernel, kernel
from moajax.moa import MoAShapeError, MoATypeError
from moajax.onf import ONF, ONFError
from moajax.psi import Derivation, psi_reduce
from moajax.ring import ring_attention
from moajax.schedule import Preset

__version__ = "0.1.0"

__all__ = [
    "moa", "kernel", "Kernel", "DNF", "Derivation", "psi_reduce", "MoAShapeError", "MoATypeError",
    "ONF", "ONFError", "Preset", "dot_product_attention", "attention_onf", "rms_norm", "gated_mlp",
    "decode_attention", "kv_append", "transformer_block", "transformer_stack", "ring_attention", "traced_onfs",
]
