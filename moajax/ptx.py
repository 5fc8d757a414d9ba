"""GPU checks without a GPU: lower for CUDA, compile the Triton IR to PTX, read ptxas' report.

    kernels = triton_kernels(fn, *args)      # the Triton kernels of a CUDA lowering
    ptx, smem = compile_ptx(kernel, "sm_80")  # needs the jax-cuda12-plugin wheel
    info = ptxas_info(ptx, "sm_80")           # registers, spill bytes, stack (needs ptxas)

Technique: ``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`` emits a
``stablehlo.custom_call @__gpu$xla.gpu.triton`` whose backend_config holds the Triton IR;
jaxlib's Triton ``compile`` (``compat.triton_compiler``) turns it into PTX for a compute capability; ``ptxas -v``
prints registers and spills; atomics are the ``atom.``/``red.`` instructions of the PTX.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

class ToolMissing(RuntimeError):
    """The offline GPU toolchain (CUDA plugin or ptxas) is not installed."""


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    name: str
    ir: bytes
    num_warps: int
    num_stages: int
    grid: tuple


@dataclasses.dataclass(frozen=True)
class PtxReport:
    kernel: str
    arch: str
    smem_bytes: int
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    atomics: int
    # tensor-core instructions: Hopper's warpgroup ``wgmma.mma_async`` and the warp-level
    # ``mma.sync`` (Ampere's; on sm_90a the fallback for a dot wgmma cannot take)
    wgmma: int = 0
    mma_sync: int = 0


def triton_kernels(fn, *args) -> list[TritonKernel]:
    """The Triton kernels in the CUDA lowering of ``fn(*args)`` (args may be ShapeDtypeStructs)."""
    from moajax import compat

    ir = compat.mlir_ir()
    mod = compat.trace_lower(fn, *args).compiler_ir("stablehlo")
    out = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for x in block.operations:
                    if x.operation.name == "stablehlo.custom_call":
                        target = ir.StringAttr(x.attributes["call_target_name"]).value
                        if "triton" in target:
                            cfg = x.attributes["mhlo.backend_config"]
                            out.append(TritonKernel(
                                name=ir.StringAttr(cfg["name"]).value,
                                ir=ir.StringAttr(cfg["ir"]).value_bytes,
                                num_warps=ir.IntegerAttr(cfg["num_warps"]).value,
                                num_stages=ir.IntegerAttr(cfg["num_stages"]).value,
                                grid=tuple(ir.IntegerAttr(cfg[f"grid_{a}"]).value for a in "xyz"),
                            ))
                    walk(x.operation)

    walk(mod.operation)
    return out


def compiler_available() -> str | None:
    """None if Triton → PTX compilation is available here, else the reason it is not."""
    from moajax import compat

    try:
        triton = compat.triton_compiler()
    except Exception as e:  # pragma: no cover
        return f"jaxlib's Triton compiler is unavailable ({e})"
    if not hasattr(triton, "compile"):  # jaxlib ≥ 0.11: Triton is compiled inside XLA only
        return f"jaxlib {jaxlib_version_text()} compiles Triton to PTX only inside XLA (no offline compile)"
    try:
        import jax

        jax.devices()  # plugins register their compilation handlers on backend start-up
        if not triton.has_compilation_handler("CUDA"):
            return "no CUDA Triton compilation handler: install the `gpu` extra (jax-cuda12-plugin)"
    except Exception as e:  # pragma: no cover
        return f"Triton compilation handler check failed ({e})"
    return None



def offline_or_exit() -> None:
    """For the offline scripts: a SystemExit that says why Triton → PTX cannot compile here."""
    reason = compiler_available()
    if reason:
        raise SystemExit(f"cannot compile offline: {reason}")


def jaxlib_version_text() -> str:
    """The installed jaxlib's version ("0.10.2"): its Triton is what compiles offline."""
    import jaxlib

    return getattr(jaxlib, "__version__", "?")


def toolchain_missing() -> str | None:
    """None if Triton → PTX compilation and ptxas are both here, else why not."""
    return compiler_available() or (None if ptxas_path() else "ptxas not found")

def ptxas_path() -> str | None:
    """ptxas from the nvidia-cuda-nvcc wheel (matches the plugin's PTX version), else PATH."""
    try:
        import nvidia.cuda_nvcc  # type: ignore

        for base in getattr(nvidia.cuda_nvcc, "__path__", []):
            p = Path(base) / "bin" / "ptxas"
            if p.exists():
                if not os.access(p, os.X_OK):
                    p.chmod(p.stat().st_mode | 0o111)
                return str(p)
    except Exception:
        pass
    return shutil.which("ptxas")


def ptxas_version() -> str:
    """ptxas' release line (e.g. "release 12.9, V12.9.86"): what a report names instead of a path."""
    exe = ptxas_path()
    if exe is None:
        raise ToolMissing("ptxas not found: install the `gpu` extra (nvidia-cuda-nvcc-cu12) or the CUDA toolkit")
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout
    m = re.search(r"release [^\n]*", out)
    return m.group(0).strip() if m else out.strip().splitlines()[-1]


def compile_ptx(kernel: TritonKernel, arch: str) -> tuple[str, int]:
    """(PTX text, shared memory bytes) of a Triton kernel for ``arch`` (sm_80, sm_86, sm_90a)."""
    reason = compiler_available()
    if reason:
        raise ToolMissing(reason)
    from moajax import compat
    from moajax.machines import arch_capability

    cc = arch_capability(arch)
    if cc is None:
        raise ValueError(f"compile_ptx: unknown arch {arch!r} (machines.SHARED_MEMORY_BY_CAPABILITY lists the known)")
    res = compat.triton_compiler().compile("CUDA", kernel.ir, cc, num_warps=kernel.num_warps, num_ctas=1,
                         num_stages=kernel.num_stages)
    asm = res.asm if isinstance(res.asm, str) else res.asm.decode()
    return asm, int(res.smem_bytes)


def ptxas_info(ptx: str, arch: str, exe: str | None = None) -> dict:
    """registers, spill stores/loads and stack frame bytes from ``ptxas -v`` (``exe``: which)."""
    exe = exe or ptxas_path()
    if exe is None:
        raise ToolMissing("ptxas not found: install the `gpu` extra (nvidia-cuda-nvcc-cu12) or the CUDA toolkit")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        p = subprocess.run([exe, f"-arch={arch}", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
                           capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        raise RuntimeError(f"ptxas failed for {arch}: {p.stderr.strip()[:2000]}")
    text = p.stderr
    regs = re.findall(r"Used (\d+) registers", text)
    stores = re.findall(r"(\d+) bytes spill stores", text)
    loads = re.findall(r"(\d+) bytes spill loads", text)
    stack = re.findall(r"(\d+) bytes stack frame", text)
    return dict(registers=int(regs[-1]) if regs else 0, spill_stores=int(stores[-1]) if stores else 0,
                spill_loads=int(loads[-1]) if loads else 0, stack_bytes=int(stack[-1]) if stack else 0)


def count_atomics(ptx: str) -> int:
    """Atomic instructions (``atom.``/``red.``) in the PTX text; Triton's inline asm puts
    several instructions on one line (``mov.u32 %r1, 0x0; atom.global.gpu.acq_rel.add.f32 …``)."""
    code = "\n".join(line.split("//", 1)[0] for line in ptx.splitlines())
    return len(re.findall(r"(?:^|[\s;])(?:@!?%p\d+\s+)?(?:atom|red)\.[a-z]", code, flags=re.M))


def count_mma(ptx: str) -> tuple[int, int]:
    """(``wgmma.mma_async``, ``mma.sync``) instructions in the PTX text (static counts, comments
    left out)."""
    code = "\n".join(line.split("//", 1)[0] for line in ptx.splitlines())
    return (len(re.findall(r"\bwgmma\.mma_async\b", code)),
            len(re.findall(r"(?<![\w.])mma\.sync\b", code)))


def _report(name: str, arch: str, ptx: str, smem: int, info: dict) -> PtxReport:
    return PtxReport(name, arch, smem, info["registers"], info["spill_stores"], info["spill_loads"],
                     info["stack_bytes"], count_atomics(ptx), *count_mma(ptx))


def report(kernel: TritonKernel, arch: str) -> PtxReport:
    ptx, smem = compile_ptx(kernel, arch)
    return _report(kernel.name, arch, ptx, smem, ptxas_info(ptx, arch))


def onf_reports(onf, arch: str) -> list[PtxReport]:
    """Compile every kernel of an ONF's Pallas lowering for ``arch`` (in launch order)."""
    return list(_onf_reports(onf, arch))


def spill_bytes(onf, arch: str, path: str = "pallas") -> int:
    """Spill stores and loads, in bytes, over every kernel of an ONF for ``arch`` through one
    GPU path (what ``schedule.derive``'s spill check asks; 0: ptxas kept it in registers):
    "pallas", its Pallas lowering (jaxlib's Triton and the CUDA wheel's ptxas), or "triton",
    its generated Triton source (Triton's compiler and the ptxas its wheel carries). Raises
    ToolMissing before compiling anything where that path's toolchain is not installed."""
    if path == "triton":
        reports = _triton_source_reports(onf, arch)
    elif path == "pallas":
        reason = toolchain_missing()
        if reason:
            raise ToolMissing(reason)
        reports = _onf_reports(onf, arch)
    else:
        raise ValueError(f"spill_bytes: path must be 'pallas' or 'triton', got {path!r}")
    return sum(r.spill_stores + r.spill_loads for r in reports)


@functools.lru_cache(maxsize=1024)
def _onf_reports(onf, arch: str) -> tuple:
    # memoised: the spill check compiles a derived ONF, and gpu-report compiles it again
    import jax

    import pallas_kernels

    fn = pallas_kernels.lower(onf)
    args = [jax.ShapeDtypeStruct(i.shape, i.dtype) for i in onf.dnf.inputs]
    ks = triton_kernels(fn, *args)
    if not ks:
        raise RuntimeError(f"{onf.dnf.name}: the CUDA lowering emitted no Triton kernel")
    return tuple(report(k, arch) for k in ks)


def triton_source_reports(onf, arch: str) -> list[PtxReport]:
    """The same ONF through the other GPU path: its generated Triton source
    (``pallas_kernels.triton_source``, launched by jax-triton) compiled by Triton for ``arch``,
    read by Triton's own ptxas."""
    return list(_triton_source_reports(onf, arch))


@functools.lru_cache(maxsize=1024)
def _triton_source_reports(onf, arch: str) -> tuple:
    # memoised as _onf_reports: the check (gpu_path "triton") and gpu-report's table ask alike
    try:
        from pallas_kernels import triton_source
    except ImportError as e:  # no triton: the path cannot run here
        raise ToolMissing(f"the Triton source path needs triton: {e}") from None
    if triton_source.ptxas() is None:
        raise ToolMissing("the Triton source path: no ptxas in the triton wheel")
    out = []
    for k in triton_source.kernels(onf):
        ptx, smem = triton_source.compile_ptx(k, arch)
        try:
            info = ptxas_info(ptx, arch, triton_source.ptxas())
        except RuntimeError as e:  # a PTX newer than the older ptxas the wheel carries
            if "Unsupported .version" not in str(e):
                raise
            info = ptxas_info(ptx, arch, triton_source.ptxas(newest=True))
        out.append(_report(k.name, arch, ptx, smem, info))
    return tuple(out)


def onf_report(onf, arch: str) -> PtxReport:
    """Compile the final kernel of an ONF's Pallas lowering for ``arch``."""
    return onf_reports(onf, arch)[-1]
