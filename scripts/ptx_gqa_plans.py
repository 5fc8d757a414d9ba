#!/usr/bin/env python3
"""The backward ONFs (atomic, split, owner) of GQA attention on the GPU profiles, offline (PTX
through ptxas, no GPU): causal, B = 1, T = S = 4096, 8 query heads over 2 kv heads, H = 64, in
bfloat16 and float32 (TF32 dots, JAX's default matmul precision). Per kernel: how the plan
tiles the group (g whole: 3-D [t h g] tiles, contracted as 2-D dots with the group folded into
the rows, ``Backend.joint_sums``), registers, spill bytes, tensor-core and atom instructions.

    python scripts/ptx_gqa_plans.py      # bench/results/gqa_plans_ptx.md
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = flags.DEFINE_string("out", str(ROOT / "bench" / "results" / "gqa_plans_ptx.md"), "the results file")
PLANS = (("atomic", "fused"), ("split", (("d_query", "d_key"), ("d_value",))), ("owner", "owner"))


def main(argv):
    del argv
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from moajax import compat, gpu_report, ptx, schedule
    from moajax.kernels.attention import mha_kernel
    from moajax.schedule import Preset
    from moajax.timing import machine_line, write_results

    ptx.offline_or_exit()
    # derived as a GPU derives them: each profile's spill check on
    gpus = gpu_report.gpus()
    lines = [f"# GQA's backward ONFs on the GPU profiles, offline PTX ({machine_line()}; ptxas {ptx.ptxas_version()}; "
             "no GPU used)", "",
             "`python scripts/ptx_gqa_plans.py` — the adjoint `jax.grad` runs for causal GQA (B = 1, T = S = 4096, "
             "8 query heads over 2 kv heads, H = 64) cut into each plan's kernels (`Preset.of(backward=…)`), derived "
             "on each profile as a GPU derives them (its spill check on). Float32 dots: TF32 (JAX's default "
             "matmul precision). g: the group's query heads per program (whole: 4, its tiles 3-D; 1: walked one "
             "at a time). One row per Triton kernel that the plan's ONFs launch. "
             "Spills: store/load bytes.", "",
             "| machine | arch | dtype | plan | kernel | tiles | g | registers | spill st/ld B | wgmma / mma.sync | "
             "atomics |",
             "|---|---|---|---|---|---|---|---:|---|---|---:|"]
    for m in gpus:
        for dtype in ("bfloat16", "float32"):
            specs = [jax.ShapeDtypeStruct((1, 4096, 8, 64), dtype)] + [jax.ShapeDtypeStruct((1, 4096, 2, 64), dtype)] * 2
            with compat.enable_x64_context(True):
                adj, args = mha_kernel(None, None, True).saved_adjoint(*specs, is_causal=True)
                dnf = adj.dnf(*args, is_causal=True)
            for name, plan in PLANS:
                onfs = schedule.derive_plan(dnf, m, Preset.of(plan=plan))
                for onf in onfs if isinstance(onfs, tuple) else (onfs,):
                    tiles = " ".join(f"{a.name} {a.tile}" for a in onf.axes if a.name in ("t", "s") and a.role != "whole")
                    group = next((a.tile for a in onf.axes if a.name == "g"), 1)
                    for r in ptx.onf_reports(onf, m.arch):
                        lines.append(f"| {m.name} | {m.arch} | {dtype} | {name} | {r.kernel.removeprefix('moajax_mha_mh_')} "
                                     f"| {tiles} | {group} | {r.registers} | {r.spill_stores}/{r.spill_loads} | "
                                     f"{r.wgmma} / {r.mma_sync} | {r.atomics} |")
                        print(lines[-1], flush=True)
    write_results(OUT.value, lines)


if __name__ == "__main__":
    app.run(main)
