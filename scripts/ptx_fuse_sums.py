#!/usr/bin/env python3
"""What walking sibling sums once (``rewrites.fuse_sums``) does to the GPU kernels it changes,
offline (PTX through ptxas, no GPU): the kernels of the gpu-report's training and score_mod
cases whose ONF differs with the rewrite — GQA's dK with dV (its two terms of dS under Σ_g)
and the tables' gradients (score_mod: ALiBi's slopes, a 33-entry relative-position table,
ALiBi within documents) — each with the rewrite off (the GPU default) and on, on every GPU profile: grid programs (and before the split-K that fills the
GPU), registers, spill bytes.

    python scripts/ptx_fuse_sums.py      # bench/results/fuse_sums_gpu.md
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = flags.DEFINE_string("out", str(ROOT / "bench" / "results" / "fuse_sums_gpu.md"), "the results file")


def main(argv):
    del argv
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np

    jax.config.update("jax_enable_x64", True)
    from moajax import gpu_report, machines, ptx, schedule
    from moajax.schedule import Preset
    from moajax.timing import machine_line, write_results

    ptx.offline_or_exit()
    # the profiles as loaded (no spill check): the tables' tilings, with fuse_sums off and on
    gpus = [m for m in machines.available().values() if m.is_gpu]
    # the kernels whose ONF the rewrite changes (found, not listed: the labels move as plans do;
    # until 2026-12-07 a list by label had lost GQA's dK, now one kernel with dV)
    cases = [c for c in gpu_report.training_cases(("bfloat16", "float32"), targets=gpus)
             + gpu_report.score_mod_cases(("float32",), targets=gpus)
             if not isinstance(c[2], Exception)
             and schedule.derive(c[2].dnf, c[1], Preset.of(fuse_sums=True))
             != schedule.derive(c[2].dnf, c[1], Preset.of(fuse_sums=False))]
    lines = [f"# Sibling sums walked once (rewrites.fuse_sums) on the GPU kernels it changes, offline PTX "
             f"({machine_line()}; ptxas {ptx.ptxas_version()}; no GPU used)", "",
             "`python scripts/ptx_fuse_sums.py` — each default GPU ONF (fuse_sums off, the GPU default) against the "
             "same DNF scheduled with `Preset.of(fuse_sums=True)`. Programs: the launch's grid (in brackets before "
             "the split-K that fills the GPU: its parts axis left out). Spills: store/load bytes per kernel of the "
             "ONF (a split ONF is a partials kernel and a combine).", "",
             "| machine | arch | kernel | fuse_sums | programs | registers | spill st/ld B |",
             "|---|---|---|---|---:|---|---|"]
    for label, m, onf in cases:
        for fused in (False, True):
            o = schedule.derive(onf.dnf, m, Preset.of(fuse_sums=fused))
            grid = [a for a in o.axes if a.role == "grid"]
            programs = int(np.prod([a.ntiles for a in grid]))
            parts = {f"{h[len('split_k('):].split(',')[0]}_o" for h in o.history if h.startswith("split_k(")}
            unsplit = int(np.prod([a.ntiles for a in grid if a.name not in parts]))
            reps = ptx.onf_reports(o, m.arch)
            lines.append(f"| {m.name} | {m.arch} | {label} | {'on' if fused else 'off'} | {programs} ({unsplit}) | "
                         f"{' + '.join(str(r.registers) for r in reps)} | "
                         f"{' + '.join(f'{r.spill_stores}/{r.spill_loads}' for r in reps)} |")
            print(lines[-1], flush=True)
    write_results(OUT.value, lines)


if __name__ == "__main__":
    app.run(main)
