#!/usr/bin/env python3
"""What a GPU without the spill check runs, offline (PTX through ptxas, no GPU): jaxlib ≥ 0.11
compiles Triton to PTX only inside XLA (``moajax.ptx``), so a GPU machine on such a JAX derives
each kernel's tiling as the tables' first fit, unchecked. For every default ONF of the
gpu-report's matrix (forward, fused forward+backward, model kernels, the training plans'
kernels, tangents, score_mod tables) on the chosen profiles: the ONF derived with the spill
check (what jaxlib 0.10 derives) against the same DNF without it, and — where they differ —
each one's tiles, warps, registers and spill bytes.

    python scripts/ptx_unchecked_tilings.py --profile h200   # bench/results/unchecked_tilings_ptx.md
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = flags.DEFINE_string("out", str(ROOT / "bench" / "results" / "unchecked_tilings_ptx.md"), "the results file")
PROFILES = flags.DEFINE_multi_string("profile", ["h200"], "GPU profiles (configs/*.toml names)")


def main(argv):
    del argv
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_enable_x64", True)
    from moajax import gpu_report, ptx, schedule
    from moajax.onf import ONFError
    from moajax.timing import machine_line, write_results

    ptx.offline_or_exit()
    gpus = [m for m in gpu_report.gpus() if m.name in PROFILES.value]
    if not gpus:
        raise SystemExit(f"no GPU profile named {PROFILES.value}")
    families = (gpu_report.default_cases, gpu_report.backward_cases, gpu_report.model_cases,
                gpu_report.model_training_cases, gpu_report.training_cases, gpu_report.tangent_cases,
                gpu_report.score_mod_cases)

    def tiling(o) -> str:
        tiles = " ".join(f"{a.name}={a.tile}" for a in o.axes if a.tile > 1 and a.tile < a.extent)
        return f"{tiles or 'whole'}, {o.knobs.num_warps} warps"

    def compiled(o, arch) -> str:
        reps = ptx.onf_reports(o, arch)
        return (" + ".join(str(r.registers) for r in reps) + " regs; " +
                " + ".join(f"{r.spill_stores}/{r.spill_loads}" for r in reps) + " B")

    lines = [f"# Tilings a GPU runs without the spill check, offline PTX ({machine_line()}; ptxas "
             f"{ptx.ptxas_version()}; no GPU used)", "",
             "`python scripts/ptx_unchecked_tilings.py` — " + " ".join((__doc__ or "").split("\n\n")[0].split()), "",
             "Rows: only the kernels whose ONF differs. Tiles: the lifted axes' tiles below their extents; "
             "registers and spill store/load bytes per kernel of the ONF.", "",
             "| machine | kernel | checked: tiling | checked: registers, spills | unchecked: tiling | "
             "unchecked: registers, spills |", "|---|---|---|---|---|---|"]
    same = differ = 0
    for m in gpus:
        unchecked = dataclasses.replace(m, spill_check=False)
        for family in families:
            for label, _, onf in family(targets=[m]):
                if isinstance(onf, ONFError):
                    continue
                off = schedule.derive(onf.dnf, unchecked)
                if str(off) == str(onf):
                    same += 1
                    continue
                differ += 1
                lines.append(f"| {m.name} | {label} | {tiling(onf)} | {compiled(onf, m.arch)} | {tiling(off)} | "
                             f"{compiled(off, m.arch)} |")
                print(lines[-1], flush=True)
    lines += ["", f"{differ} of {same + differ} default ONFs differ without the spill check."]
    write_results(OUT.value, lines)


if __name__ == "__main__":
    app.run(main)
