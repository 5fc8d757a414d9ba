#!/usr/bin/env python3
"""Calibration of the shared-memory model for scatter-adding kernels, against the compiler.

The fused attention forward+backward (one head, T = S = 1024) is lowered with Pallas/Triton
for every tiling in a grid (dtype × head dim × rows × keys × num_warps × num_stages), its
Triton IR is compiled offline for sm_80 (A100), sm_86 (A40) and sm_90a (H100/H200), and the
shared memory Triton allocates is set beside ``moajax.cost.onchip_bytes`` (the model the
schedule uses to reject tilings). No GPU is used. The model must be ≥ the compiler
everywhere; ``tests/test_cost.py`` re-checks the committed table against the current model.

    python scripts/sweep_scatter_smem.py        # writes bench/results/scatter_smem.md
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DTYPES = ("float16", "float32", "float64")  # bfloat16 compiles as float16 does
HEADS = (64, 128)
TILES = ((16, 16), (32, 16), (16, 32), (32, 32), (64, 32), (64, 64))
WARPS = (4, 8)
STAGES = (1, 2)
ARCHS = ("sm_80", "sm_86", "sm_90a")


def main() -> int:
    import jax

    jax.config.update("jax_enable_x64", True)
    from moajax import cost, gpu_report, machines, schedule
    from moajax.kernels import attention_forward_backward
    from moajax.schedule import Preset

    reason = gpu_report.compiler_available()
    if reason:
        print(f"sweep_scatter_smem: cannot compile offline: {reason}", file=sys.stderr)
        return 2
    # a profile with no shared-memory limit, so that tilings over every real limit are measured too
    unbounded = dataclasses.replace(machines.load("h200"), shared_memory_per_block=1 << 30)
    rows = []
    for dt, h, (bt, bs), w, s in itertools.product(DTYPES, HEADS, TILES, WARPS, STAGES):
        dnf = attention_forward_backward.dnf(*[jax.ShapeDtypeStruct((1024, h), dt) for _ in range(4)])
        onf = schedule.derive(dnf, unbounded, Preset.of(tiles={"t": bt, "s": bs}, num_warps=w, num_stages=s))
        model = cost.onchip_bytes(onf)
        for arch in ARCHS:
            r = gpu_report.onf_report(onf, arch)
            rows.append((dt, h, bt, bs, w, s, arch, r.smem_bytes, model, r.registers, r.spill_stores))
            print(*rows[-1], flush=True)
    ratios = [r[7] / r[8] for r in rows]
    worst = min(rows, key=lambda r: r[8] / r[7])
    out = ROOT / "bench" / "results" / "scatter_smem.md"
    lines = [
        "# Shared memory of the scatter-adding fused backward: Triton (ptxas) vs the cost model",
        "",
        f"Date {datetime.date.today().isoformat()}; JAX {jax.__version__}; machine: {machines.local().description} "
        "(no GPU: Triton IR compiled offline by `scripts/sweep_scatter_smem.py`). Kernel: "
        "attention_forward_backward, one head, T = S = 1024; tiles are rows (t) × keys (s).",
        "",
        f"{len(rows)} compilations. Model ≥ ptxas in every row: {all(r[8] >= r[7] for r in rows)}; "
        f"closest: model/ptxas = {worst[8] / worst[7]:.3f} ({' '.join(map(str, worst[:7]))}); "
        f"median ptxas/model = {statistics.median(ratios):.2f}.",
        "",
        "| dtype | H | rows | keys | warps | stages | arch | smem B (ptxas) | smem B (model) | registers | spill stores B |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")
    return 0 if all(r[8] >= r[7] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
