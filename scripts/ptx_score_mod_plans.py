#!/usr/bin/env python3
"""The seed's backward ONFs (atomic, split, owner) of attention with a score_mod that closes
over an array (ALiBi's 8 slopes, a 33-entry relative-position table) on the GPU profiles,
offline (PTX through ptxas, no GPU): causal, B = 2, T = S = 1024, N = 8, H = 64, float32 (TF32
dots, JAX's default matmul precision) and bfloat16. Per kernel: the programs' grid axes, the
cost model's on-chip bytes and atomics, registers, spill bytes, tensor-core and atom
instructions. Under "atomic" and "split" the array's gradient joins dQ and dK's kernel: its
programs own query tiles and, beside them, the batch and the heads, and each adds its partial
Σ over its own query tile, batch element and head (``schedule._summed_batch``). Before
2026-12-05 those programs held the batch and the heads whole, and no such plan fitted a GPU.

    python scripts/ptx_score_mod_plans.py      # bench/results/score_mod_plans_ptx.md
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = flags.DEFINE_string("out", str(ROOT / "bench" / "results" / "score_mod_plans_ptx.md"), "the results file")
SHAPE = (2, 1024, 8, 64)


def main(argv):
    del argv
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from moajax import cost, gpu_report, ptx, schedule
    from moajax.api import _backward_plan
    from moajax.schedule import Preset
    from moajax.timing import machine_line, write_results

    ptx.offline_or_exit()
    mods = {name: fn for name, fn in gpu_report.score_mods().items() if name in ("alibi", "relpos")}
    gpus = gpu_report.gpus()  # derived as a GPU derives them: each profile's spill check on
    lines = [f"# The seed's backward ONFs with a score_mod array, offline PTX ({machine_line()}; ptxas "
             f"{ptx.ptxas_version()}; no GPU used)", "",
             "`python scripts/ptx_score_mod_plans.py` — the adjoint `jax.grad` runs for causal attention with a "
             f"score_mod closing over an array (B, T = S, N, H = {SHAPE}; ALiBi's 8 slopes, a 33-entry relative-"
             "position table), cut into each plan's kernels (`Preset.of(backward=…)`, as `dot_product_attention` "
             "names them: under \"split\" the array's gradient joins dQ and dK), derived on each profile as a GPU "
             "derives them (its spill check on). Float32 dots: TF32. grid: the axes whose tiles own programs "
             "(tile size). scatter: the grid axes each scatter-added output's partial sums over. On-chip KB and "
             "atomics: the cost model's. One row per Triton kernel. Spills: store/load bytes.", "",
             "| machine | arch | dtype | score_mod | plan | kernel | grid | scatter | on-chip KB | model atomics | "
             "registers | spill st/ld B | wgmma / mma.sync | atom instr. |",
             "|---|---|---|---|---|---|---|---|---:|---:|---:|---|---|---:|"]
    for m in gpus:
        for dtype in ("float32", "bfloat16"):
            for name, fn in mods.items():
                _, dnf, consts = gpu_report.score_mod_dnfs(fn, SHAPE, dtype)
                for plan in ("atomic", "split", "owner"):
                    preset = _backward_plan(Preset.of(backward=plan), False, consts)
                    try:
                        onfs = schedule.derive_plan(dnf, m, Preset.of(plan=preset.backward))
                    except Exception as e:  # a plan that does not fit is a row too
                        lines.append(f"| {m.name} | {m.arch} | {dtype} | {name} | {plan} | refused: "
                                     f"{str(e)[:160]} | | | | | | | | |")
                        print(lines[-1], flush=True)
                        continue
                    for onf in onfs if isinstance(onfs, tuple) else (onfs,):
                        grid = " ".join(f"{a.name} {a.tile}" for a in onf.axes if a.role == "grid")
                        scatter = "; ".join(f"{dict((s, o) for o, s in onf.program.outputs).get(st.name, st.name)}: "
                                            + " ".join(v.name for v in onf.scatter_vars(st))
                                            for st in onf.program.stages if onf.scatter_vars(st))
                        c = cost.estimate(onf)
                        for r in ptx.onf_reports(onf, m.arch):
                            lines.append(
                                f"| {m.name} | {m.arch} | {dtype} | {name} | {plan} | "
                                f"{r.kernel.removeprefix('moajax_mha_score_mod_mh_')} | {grid} | {scatter or '—'} | "
                                f"{c.onchip_bytes / 1024:.1f} | {c.atomics:,} | {r.registers} | "
                                f"{r.spill_stores}/{r.spill_loads} | {r.wgmma} / {r.mma_sync} | {r.atomics} |")
                            print(lines[-1], flush=True)
    write_results(OUT.value, lines)


if __name__ == "__main__":
    app.run(main)
