#!/usr/bin/env python3
"""Calibration of the shared-memory model against the compiler.

The attention forward (jax.nn layout, B = 1, T = S = 1024, N = 8) and the fused forward+backward
(one head, T = S = 1024) are lowered with Pallas/Triton for every tiling in a grid (dtype ×
head dim × rows × keys × num_warps × num_stages), their Triton IR is compiled offline for
sm_80 (A100), sm_86 (A40) and sm_90a (H100/H200), and the shared memory Triton allocates is
set beside ``moajax.cost.onchip_bytes`` (the model the schedule rejects tilings by). No GPU is
used. The model must be ≥ the compiler everywhere; ``tests/test_cost.py`` re-checks the
committed table against the current model. float32 is swept with IEEE float32 dots; "float32
tf32" with TF32 dots (``Knobs.dot_precision``: a GPU's float32 default under JAX's default
matmul precision).

    python scripts/sweep_smem.py                # writes bench/results/smem_sweep.md
    python scripts/sweep_smem.py --dtypes "float32 tf32" --out bench/results/smem_sweep_tf32.md
"""

from __future__ import annotations

import datetime
import itertools
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DTYPES = ("float16", "float32", "float64")  # bfloat16 compiles as float16 does; also "float32 tf32"
HEADS = (64, 128)
WARPS = (4, 8)
ARCHS = ("sm_80", "sm_86", "sm_90a")
# (rows, keys) tilings and num_stages per kernel: the schedule's candidates and their neighbours
GRID = {
    "forward": (((16, 16), (32, 16), (64, 16), (32, 32), (64, 32), (64, 64), (128, 64), (128, 128)), (1, 2, 3)),
    "fwd+bwd": (((16, 16), (32, 16), (16, 32), (32, 32), (64, 32), (64, 64)), (1, 2)),
}


def main(argv=None) -> int:
    import argparse

    import jax

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernels", nargs="*", default=list(GRID), choices=list(GRID))
    ap.add_argument("--dtypes", nargs="*", default=list(DTYPES), choices=list(DTYPES) + ["float32 tf32"])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "smem_sweep.md"))
    args = ap.parse_args(argv)

    jax.config.update("jax_enable_x64", True)
    from moajax import cost, gpu_report, machines, ptx

    reason = ptx.compiler_available()
    if reason:
        print(f"sweep_smem: cannot compile offline: {reason}", file=sys.stderr)
        return 2
    rows = []
    for kernel in args.kernels:
        tiles, stages = GRID[kernel]
        for dt, h, (bt, bs), w, s in itertools.product(args.dtypes, HEADS, tiles, WARPS, stages):
            onf = gpu_report.sweep_onf(kernel, dt, h, bt, bs, w, s)
            model = cost.onchip_bytes(onf)
            for arch in ARCHS:
                r = ptx.onf_report(onf, arch)
                rows.append((kernel, dt, h, bt, bs, w, s, arch, r.smem_bytes, model, r.registers, r.spill_stores))
                print(*rows[-1], flush=True)
    summary = []
    for kernel in args.kernels:
        mine = [r for r in rows if r[0] == kernel]
        worst = min(mine, key=lambda r: r[9] / r[8])
        summary.append(
            f"- {kernel}: {len(mine)} compilations; model ≥ ptxas in every row: {all(r[9] >= r[8] for r in mine)}; "
            f"closest model/ptxas = {worst[9] / worst[8]:.3f} ({' '.join(map(str, worst[1:8]))}); "
            f"median ptxas/model = {statistics.median(r[8] / r[9] for r in mine):.2f}.")
    out = Path(args.out)
    lines = [
        "# Shared memory per program: Triton (ptxas) vs the cost model",
        "",
        f"Date {datetime.date.today().isoformat()}; JAX {jax.__version__}; machine: {machines.local().description} "
        "(no GPU: Triton IR compiled offline by `scripts/sweep_smem.py`). Kernels: the attention forward "
        "(jax.nn layout, B = 1, T = S = 1024, N = 8) and the fused forward+backward (one head, T = S = 1024, "
        "dK and dV scatter-added); tiles are rows (t) × keys (s). float32 dots: IEEE float32 for \"float32\", "
        "TF32 for \"float32 tf32\" (`Knobs.dot_precision`).",
        "",
        *summary,
        "",
        "| kernel | dtype | H | rows | keys | warps | stages | arch | smem B (ptxas) | smem B (model) | registers | spill stores B |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    return 0 if all(r[9] >= r[8] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
