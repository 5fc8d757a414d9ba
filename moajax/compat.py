"""The differences between JAX versions moajax depends on, in one place.

Developed against JAX 0.10.2 (Python 3.11); GPU machines may carry JAX ≥ 0.11, where the
Pallas Triton backend is deprecated and CompilerParams moved. Everything version-specific
goes through here.
"""

from __future__ import annotations

import functools

import jax


@functools.lru_cache(maxsize=None)
def jax_version() -> tuple:
    parts = []
    for p in jax.__version__.split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def triton_compiler_params(plgpu, num_warps: int, num_stages: int):
    """Pallas' Triton-backend compiler params (selects Triton over Mosaic GPU).

    ``plgpu`` is ``jax.experimental.pallas.triton``, passed in by pallas_kernels (the only
    package that imports Pallas); the class was ``TritonCompilerParams`` before JAX 0.5."""
    cls = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")
    return cls(num_warps=num_warps, num_stages=num_stages)


def platform_dependent(*args, cpu, cuda, default=None):
    """Per-platform lowering inside one jitted function (only the target's branch is compiled)."""
    from jax import lax

    return lax.platform_dependent(*args, cpu=cpu, cuda=cuda, default=default or cpu)


def trace_lower(fn, *args, platforms=("cuda",)):
    """Lower a jitted function for other platforms than this machine's (e.g. CUDA on a CPU)."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=tuple(platforms))


def mlir_ir():
    """jaxlib's MLIR Python bindings (``ir``: read the attributes of a lowered module); JAX
    has no public path to them."""
    from jax._src.lib.mlir import ir

    return ir


def triton_compiler():
    """jaxlib's Triton bindings (``compile``, ``has_compilation_handler``): Triton IR → PTX
    without a GPU. Raises ImportError where this jaxlib has none."""
    from jax._src.lib import triton

    return triton


def enable_x64_context(enabled: bool = True):
    """A context manager that switches float64 on (or off) for a block."""
    try:
        return jax.enable_x64(enabled)  # JAX ≥ 0.8
    except AttributeError:  # pragma: no cover - older JAX
        from jax.experimental import enable_x64, disable_x64

        return enable_x64() if enabled else disable_x64()
