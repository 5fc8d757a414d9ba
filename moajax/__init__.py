"""moajax: Mathematics of Arrays kernels for JAX.

array math (``moajax.moa``) → ψ-reduction → DNF (``moajax.dnf``) → DNF → JAX reference
(``moajax.reference``); kernels are defined with ``@moajax.kernel``.
"""

from moajax import moa
from moajax.dnf import DNF
from moajax.kernel import Kernel, kernel
from moajax.moa import MoAShapeError, MoATypeError
from moajax.psi import Derivation, psi_reduce

__version__ = "0.1.0"

__all__ = ["moa", "kernel", "Kernel", "DNF", "Derivation", "psi_reduce", "MoAShapeError", "MoATypeError"]
