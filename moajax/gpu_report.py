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
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

ARCHS = {"sm_80": "8.0", "sm_86": "8.6", "sm_90a": "9.0"}


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
    try:
        import jax

        jax.devices()  # plugins register their compilation handlers on backend start-up
        if not triton.has_compilation_handler("CUDA"):
            return "no CUDA Triton compilation handler: install the `gpu` extra (jax-cuda12-plugin)"
    except Exception as e:  # pragma: no cover
        return f"Triton compilation handler check failed ({e})"
    return None


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

    res = compat.triton_compiler().compile("CUDA", kernel.ir, ARCHS[arch], num_warps=kernel.num_warps, num_ctas=1,
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


def report(kernel: TritonKernel, arch: str) -> PtxReport:
    ptx, smem = compile_ptx(kernel, arch)
    info = ptxas_info(ptx, arch)
    return PtxReport(kernel.name, arch, smem, info["registers"], info["spill_stores"], info["spill_loads"],
                     info["stack_bytes"], count_atomics(ptx))


# ----------------------------------------------------------------------------- the CLI's matrix


def _cases(label: str, dnf_for, head_dims, dtypes, size=lambda h: f"H={h}") -> list:
    """(label, machine, default ONF — or the ONFError saying why none fits) for every
    configured GPU × dtype × head dim (or other size: ``size`` names it in the label)."""
    import numpy as np

    from moajax import machines, schedule

    from moajax.onf import ONFError

    out = []
    for m in machines.available().values():
        if not m.is_gpu:
            continue
        for dt in dtypes:
            for h in head_dims:
                try:
                    onf = schedule.derive(dnf_for(np.dtype(dt), h), m)
                except ONFError as e:  # no default fits this GPU: a finding, reported as such
                    onf = e
                out.append((f"{label} {dt} {size(h)}", m, onf))
    return out


def default_cases(head_dims=(64, 72, 128), dtypes=("float16", "bfloat16", "float32", "float64")):
    """The attention forward (jax.nn layout, B=1, T=S=1024, N=8)."""
    from moajax.kernels.attention import mha_dnf

    return _cases("mha", lambda dt, h: mha_dnf((1, 1024, 8, h), (1, 1024, 8, h), (1, 1024, 8, h), dt),
                  head_dims, dtypes)


def backward_cases(head_dims=(64, 128), dtypes=("bfloat16", "float32", "float64")):
    """The fused forward+backward (one head, T=S=1024): its default ONF scatter-adds dK, dV."""
    import jax

    from moajax.kernels import attention_forward_backward

    return _cases("fwd+bwd", lambda dt, h: attention_forward_backward.dnf(
        *[jax.ShapeDtypeStruct((1024, h), dt) for _ in range(4)]), head_dims, dtypes)


def model_cases(dtypes=("bfloat16", "float32")):
    """Kernels other than plain attention at realistic sizes: RMSNorm fused into a matmul and
    the SwiGLU MLP at n=4096, d=1024, f=4096; a row log-sum-exp over 4096 × 32768; decode of one
    query over a 32768-key cache (split-K: one program would walk it all); attention
    (jax.nn layout, B=1, T=S=1024, N=8, H=64) with a full [B N T S] bias, whose rows × keys
    tiles read 2-D blocks of the bias."""
    import jax

    from moajax.kernels import decode, logsumexp, rmsnorm_matmul, swiglu
    from moajax.kernels.attention import mha_dnf

    S = jax.ShapeDtypeStruct
    n, d, f = 4096, 1024, 4096
    mlp = "n=4096 d=1024 f=4096"
    return (
        _cases("rmsnorm→matmul", lambda dt, _: rmsnorm_matmul.dnf(S((n, d), dt), S((d,), dt), S((d, f), dt)),
               (mlp,), dtypes, size=str)
        + _cases("swiglu", lambda dt, _: swiglu.dnf(S((n, d), dt), S((d, f), dt), S((d, f), dt), S((f, d), dt)),
                 (mlp,), dtypes, size=str)
        + _cases("logsumexp", lambda dt, _: logsumexp.dnf(S((4096, 32768), dt)), ("4096×32768",), dtypes, size=str)
        + _cases("decode", lambda dt, _: decode.dnf(S((128,), dt), S((32768, 128), dt), S((32768, 128), dt)),
                 ("s=32768 H=128",), dtypes, size=str)
        + _cases("mha+bias[B N T S]", lambda dt, h: mha_dnf((1, 1024, 8, h), (1, 1024, 8, h), (1, 1024, 8, h), dt,
                                                            bias_shape=(1, 8, 1024, 1024), bias_dtype=dt),
                 (64,), dtypes)
    )


def model_training_cases(dtypes=("float32",)):
    """What ``jax.grad`` of ``rms_norm`` and ``gated_mlp`` runs on a GPU at the seed's block
    (n = 1024 tokens, d = 64, d_ff = 256), and of ``gated_mlp`` at a realistic size (n = 4096,
    d = 1024, d_ff = 4096, where no fused schedule fits and the owner plan stages U, V, G_H):
    each kernel of the adjoint's plan its own row (the staged first kernel, the weight
    gradients' split-K parts and their combine)."""
    import jax
    import numpy as np

    from moajax import machines
    from moajax.kernels.mlp import swiglu
    from moajax.kernels.norm import rmsnorm

    out = []
    for dt in dtypes:
        S = lambda *s: jax.ShapeDtypeStruct(s, np.dtype(dt))  # noqa: E731
        cases = [("rmsnorm", rmsnorm, (1024, 64, None)), ("swiglu", swiglu, (1024, 64, 256)),
                 ("swiglu", swiglu, (4096, 1024, 4096))]
        for name, kern, (n, d, f) in cases:
            specs = [S(n, d), S(d)] if f is None else [S(n, d), S(d, f), S(d, f), S(f, d)]
            dnf = kern.adjoint(*specs).dnf(*specs, S(n, d))
            for m in machines.available().values():
                if m.is_gpu:
                    out += _plan_rows(f"grad {name} adjoint {dt} n={n} d={d}" + (f" f={f}" if f else ""), dnf, m)
    return out


def _plan_rows(label: str, dnf, machine) -> list:
    """(label, machine, ONF) per kernel of ``dnf``'s default plan for ``machine`` (each named by
    its outputs), or one row with the ONFError saying why no plan fits."""
    from moajax import schedule
    from moajax.onf import ONFError

    try:
        plan = schedule.derive_plan(dnf, machine)
    except ONFError as e:
        return [(label, machine, e)]
    return [(f"{label} {onf.dnf.name[len(dnf.name) + 1:] if isinstance(plan, tuple) else ''}".rstrip(), machine, onf)
            for onf in (plan if isinstance(plan, tuple) else (plan,))]


def training_cases(dtypes=("bfloat16", "float32")):
    """What ``jax.grad`` of ``dot_product_attention`` runs on a GPU (jax.nn layout, B=1,
    T=S=1024, N=8, H=64; multi-head K=8, GQA K=2, and causal multi-head, whose loops skip the
    masked tiles: their bounds are computed in the kernel): the saving forward (Out with its
    row max and sum) and the derived adjoint's plan (one fused ONF, or one per output), each
    ONF its own row."""
    import jax
    import numpy as np

    from moajax import machines
    from moajax.kernels.attention import mha_kernel

    out = []
    for kv, causal in ((8, False), (2, False), (8, True)):
        kern = mha_kernel(None, None, kv != 8)
        for dt in dtypes:
            S = [jax.ShapeDtypeStruct((1, 1024, n, 64), np.dtype(dt)) for n in (8, kv, kv)]
            adj, args = kern.saved_adjoint(*S, is_causal=causal)
            parts = [("saving forward", kern.with_row_statistics().dnf(*S, is_causal=causal)),
                     ("adjoint", adj.dnf(*args, is_causal=causal))]
            for m in machines.available().values():
                if not m.is_gpu:
                    continue
                for what, dnf in parts:
                    out += _plan_rows(f"grad {'GQA K=2' if kv != 8 else 'MHA'}{' causal' if causal else ''} {what} "
                                      f"{dt} H=64", dnf, m)
    return out


def score_mod_cases(dtypes=("float32",)):
    """``dot_product_attention`` with a ``score_mod`` (jax.nn layout, B=1, T=S=1024, N=8, H=64,
    causal), its forward and the derived adjoint's plan: tanh soft-capping (arithmetic on the
    score), ALiBi (a per-head slope: a table read at the head index) and relative position
    (a small table read at a computed index, clip(q_idx − kv_idx) — a gather in the kernel)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from moajax import machines
    from moajax.api import _check_score_mod
    from moajax.kernels.attention import mha_kernel

    slopes = jnp.asarray(2.0 ** -np.arange(1, 9), jnp.float32)
    table = jnp.asarray(np.linspace(-1.0, 1.0, 33), jnp.float32)
    mods = {"softcap": lambda s, b, h, qi, ki: 30.0 * jnp.tanh(s / 30.0),
            "alibi": lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi).astype(s.dtype),
            "relpos": lambda s, b, h, qi, ki: s + table[jnp.clip(qi - ki, -16, 16) + 16]}
    out = []
    for dt in dtypes:
        S = [jax.ShapeDtypeStruct((1, 1024, 8, 64), np.dtype(dt))] * 3
        for name, fn in mods.items():
            mod = _check_score_mod(fn, np.dtype(dt))
            kern = mha_kernel(None, None, False, False, False, mod)
            consts = [jax.ShapeDtypeStruct(np.shape(c), np.asarray(c).dtype) for c in mod.consts]
            adj, args = kern.saved_adjoint(*S, *consts, is_causal=True)
            parts = [("forward", kern.dnf(*S, *consts, is_causal=True)), ("adjoint", adj.dnf(*args, is_causal=True))]
            for m in machines.available().values():
                if m.is_gpu:
                    for what, dnf in parts:
                        out += _plan_rows(f"score_mod {name} causal {what} {dt} H=64", dnf, m)
    return out


def sweep_onf(kernel: str, dtype: str, h: int, rows: int, keys: int, warps: int, stages: int):
    """One row of the shared-memory calibration sweep (scripts/sweep_smem.py): the attention
    ``"forward"`` (jax.nn layout, B=1, T=S=1024, N=8) or the fused ``"fwd+bwd"`` (one head,
    T=S=1024) with the given tiling, scheduled for a GPU without a shared-memory limit so that
    tilings over every real limit are compiled too."""
    import dataclasses

    import jax
    import numpy as np

    from moajax import machines, schedule
    from moajax.kernels import attention_forward_backward
    from moajax.kernels.attention import mha_dnf
    from moajax.schedule import Preset

    if kernel == "forward":
        dnf = mha_dnf((1, 1024, 8, h), (1, 1024, 8, h), (1, 1024, 8, h), np.dtype(dtype))
    elif kernel == "fwd+bwd":
        dnf = attention_forward_backward.dnf(*[jax.ShapeDtypeStruct((1024, h), dtype) for _ in range(4)])
    else:
        raise ValueError(f"sweep_onf: kernel must be 'forward' or 'fwd+bwd', got {kernel!r}")
    unbounded = dataclasses.replace(machines.load("h200"), shared_memory_per_block=1 << 30)
    return schedule.derive(dnf, unbounded, Preset.of(tiles={"t": rows, "s": keys}, num_warps=warps,
                                                     num_stages=stages))


def onf_reports(onf, arch: str) -> list[PtxReport]:
    """Compile every kernel of an ONF's Pallas lowering for ``arch`` (in launch order)."""
    import jax

    import pallas_kernels

    fn = pallas_kernels.lower(onf)
    args = [jax.ShapeDtypeStruct(i.shape, i.dtype) for i in onf.dnf.inputs]
    ks = triton_kernels(fn, *args)
    if not ks:
        raise RuntimeError(f"{onf.dnf.name}: the CUDA lowering emitted no Triton kernel")
    return [report(k, arch) for k in ks]


def triton_source_reports(onf, arch: str) -> list[PtxReport]:
    """The same ONF through the other GPU path: its generated Triton source
    (``pallas_kernels.triton_source``, launched by jax-triton) compiled by Triton for ``arch``,
    read by Triton's own ptxas."""
    from pallas_kernels import triton_source

    out = []
    for k in triton_source.kernels(onf):
        ptx, smem = triton_source.compile_ptx(k, arch)
        try:
            info = ptxas_info(ptx, arch, triton_source.ptxas())
        except RuntimeError as e:  # a PTX newer than the older ptxas the wheel carries
            if "Unsupported .version" not in str(e):
                raise
            info = ptxas_info(ptx, arch, triton_source.ptxas(newest=True))
        out.append(PtxReport(k.name, arch, smem, info["registers"], info["spill_stores"], info["spill_loads"],
                             info["stack_bytes"], count_atomics(ptx)))
    return out


def onf_report(onf, arch: str) -> PtxReport:
    """Compile the final kernel of an ONF's Pallas lowering for ``arch``."""
    return onf_reports(onf, arch)[-1]
