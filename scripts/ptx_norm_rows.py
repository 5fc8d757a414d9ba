#!/usr/bin/env python3
"""RMSNorm alone over Llama's widths on the GPU, offline (PTX through ptxas, no GPU): the
default ONF of its forward (n = 4096 rows; d = 2048 … 16384; float32 and bfloat16) on every GPU
profile with the spill check on, as ``moajax gpu-report`` derives it — rows a program, warps,
the cost model's on-chip bytes against the profile's limit, and ptxas' spill bytes — and, for
each, the 16-row tiling the tables offered before ``schedule.GPU_NARROW_ROWS``: whether it fits
and what it spills.

    python scripts/ptx_norm_rows.py      # bench/results/norm_rows_ptx.md
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = flags.DEFINE_string("out", str(ROOT / "bench" / "results" / "norm_rows_ptx.md"), "the results file")
WIDTHS = (2048, 4096, 8192, 16384)


def main(argv):
    del argv
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np

    from moajax import cost, ptx, schedule
    from moajax.gpu_report import gpus
    from moajax.kernels.norm import rmsnorm
    from moajax.onf import ONFError
    from moajax.timing import table_lines, write_results

    ptx.offline_or_exit()
    rows = []
    for dt in ("float32", "bfloat16"):
        for d in WIDTHS:
            dnf = rmsnorm.dnf(jax.ShapeDtypeStruct((4096, d), np.dtype(dt)), jax.ShapeDtypeStruct((d,), np.dtype(dt)))
            for m in gpus():
                try:
                    o = schedule.derive(dnf, m)
                    cols = "whole" if o.axis("d").role == "whole" else f"{o.axis('d').tile} (of {d})"
                    got = (f"{o.axis('n').tile}", cols, f"{o.knobs.num_warps}", f"{cost.onchip_bytes(o)}",
                           f"{ptx.spill_bytes(o, m.arch)}")
                except ONFError:
                    got = ("none fits", "", "", "", "")
                # the 16-row tiling, d whole: the tables' last entry for widths over 128
                wide = dataclasses.replace(m, spill_check=False, shared_memory_per_block=1 << 30)
                sixteen = schedule.derive(dnf, wide, tiles={"n": 16})
                fits = cost.onchip_bytes(sixteen) <= m.onchip_limit_bytes
                rows.append((dt, d, m.name, m.arch, *got, f"{m.onchip_limit_bytes}", f"{cost.onchip_bytes(sixteen)}",
                             "yes" if fits else "no", f"{ptx.spill_bytes(sixteen, m.arch)}" if fits else "—"))
    head = ("| dtype | d | machine | arch | rows a program | columns a program | warps | on-chip B (model) | spill B | limit B "
            "| 16 rows: on-chip B | 16 rows fit | 16 rows: spill B |")
    lines = [
        "# RMSNorm over wide rows on the GPU, offline: rows a program (PTX, ptxas; no GPU)",
        "",
        f"Date {datetime.date.today().isoformat()}; JAX {jax.__version__}; ptxas {ptx.ptxas_version()}. "
        "`python scripts/ptx_norm_rows.py`: RMSNorm's forward at n = 4096 rows, each profile with its spill "
        "check on (as `moajax gpu-report`). Before `schedule.GPU_NARROW_ROWS` (2026-12-06) a program took "
        "16 rows at least: where those do not fit (\"16 rows fit: no\") no GPU ONF fitted and the CUDA "
        "lowering ran the CPU's XLA loops; where they fit and spill, they were the only try. Where one row "
        "does not fit a program alone, its columns go over the grid (`schedule.GPU_SPLIT_ROWS`, since "
        "2026-12-06: each program walks the row's Σ_d x² in tiles of 1024). Untimed.",
        "",
        *table_lines(head, rows),
    ]
    write_results(OUT.value, lines)


if __name__ == "__main__":
    app.run(main)
