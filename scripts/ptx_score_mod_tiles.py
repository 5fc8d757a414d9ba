#!/usr/bin/env python3
"""The score_mod table gradients on the GPU, offline (PTX through ptxas, no GPU): the default
ONF of each (ALiBi's per-head slopes, a 33-entry relative-position table; B=1, T=S=1024,
N=8, H=64, causal, float32) on every GPU profile, and a sweep of the tiles of its two nested
walks (Σ_s Σ_t: the [s × t] scores between them), warps and stages, the split over heads and
keys fixed — registers, spill bytes, the cost model's time.

What it shows: the table gradient's programs (8 heads, or 2 × 8 with the table tiled) leave a
GPU idle, so the split-K that fills it cuts the keys after the heads; and the nested walks'
[s × t] score tile spills at 64 × 64 (every tiling of it that fits) and, with 4 warps, at
64 × 32 and 32 × 64, where 32 × 32 spills nowhere.

    python scripts/ptx_score_mod_tiles.py      # bench/results/score_mod_tiles_gpu.md
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = flags.DEFINE_string("out", str(ROOT / "bench" / "results" / "score_mod_tiles_gpu.md"), "the results file")
PAIRS = ((16, 16), (32, 32), (64, 32), (32, 64), (64, 64))


def main(argv):
    del argv
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import numpy as np

    from moajax import gpu_report, machines, ptx, schedule
    from moajax.cost import estimate
    from moajax.onf import ONFError
    from moajax.schedule import Preset
    from moajax.timing import machine_line, write_results

    ptx.offline_or_exit()
    # the profiles as loaded (no spill check): 'default' is the tables' tiling
    gpus = [m for m in machines.available().values() if m.is_gpu]
    lines = [f"# score_mod table gradients on the GPU: programs, nested-walk tiles and spills, offline PTX "
             f"({machine_line()}; ptxas {ptx.ptxas_version()}; no GPU used)", "",
             "`python scripts/ptx_score_mod_tiles.py` — the table gradient of ALiBi (8 slopes) and of a 33-entry "
             "relative-position table (B = 1, T = S = 1024, N = 8, H = 64, causal, float32). 'default': the ONF "
             "this code derives; 'heads cut only': the same tiles, warps and stages, split over the heads alone "
             "(the split-K before it cut a second walk). The sweep: split over the heads (8) and the keys (16), the keys' tile (s) and the "
             "queries' tile (t) of the nested walks, warps and stages given (`Preset.of(split=…, tiles=…, "
             "num_warps=…, num_stages=…)`); a row 'does not fit' where the cost model's shared-memory bound "
             "rejects it. Programs: the launch's grid. Time: the cost model's estimate (not measured). Spills: "
             "store/load bytes of the partials kernel (the combines spill nothing).", "",
             "| machine | arch | table | ONF | s × t tiles | warps | stages | programs | model time µs | registers | "
             "spill st/ld B |", "|---|---|---|---|---|---:|---:|---:|---:|---:|---|"]

    def row(m, name, what, o):
        grid = [a for a in o.axes if a.role == "grid"]
        seq = {a.name: a.tile for a in o.axes if a.role == "sequential"}
        s_tile = seq.get("s_i", seq.get("s", "—"))
        reps = ptx.onf_reports(o, m.arch)
        lines.append(f"| {m.name} | {m.arch} | {name} | {what} | {s_tile} × {seq.get('t', '—')} | {o.knobs.num_warps} | "
                     f"{o.knobs.num_stages} | {int(np.prod([a.ntiles for a in grid]))} | "
                     f"{estimate(o, m).time_s * 1e6:.1f} | {reps[0].registers} | "
                     f"{reps[0].spill_stores}/{reps[0].spill_loads} |")
        print(lines[-1], flush=True)

    for label, m, onf in gpu_report.score_mod_cases(("float32",), targets=gpus):
        if "d_score_mod_const" not in label:
            continue
        name = label.split()[1]
        row(m, name, "default", onf)
        # the split-K before it cut a second walk: the heads alone (the tiles as the default's)
        tiles = {a.name: a.tile for a in onf.axes if a.name in ("s_i", "t")}
        one = schedule.derive(onf.dnf, m, Preset.of(split={"n_kv": 8}, tiles={"s": tiles["s_i"], "t": tiles["t"]},
                                                    num_warps=onf.knobs.num_warps, num_stages=onf.knobs.num_stages))
        row(m, name, "heads cut only", one)
        for (st, tt), warps, stages in itertools.product(PAIRS, (4, 8), (1, 2, 3)):
            kw = dict(split={"n_kv": 8, "s": 16}, tiles={"s": st, "t": tt}, num_warps=warps, num_stages=stages)
            try:
                o = schedule.derive(onf.dnf, m, Preset.of(**kw))
            except ONFError:
                lines.append(f"| {m.name} | {m.arch} | {name} | sweep | {st} × {tt} | {warps} | {stages} | | | | "
                             "does not fit |")
                continue
            row(m, name, "sweep", o)
    # the attention-shaped kernels of the score_mod cases that spill by default, against the
    # candidates of the float32 tiles table (schedule.GPU_TILES[(4, 64)]) and two more
    lines += ["", "## The score_mod kernels whose table tiling spills, against the float32 tile candidates", "",
              "Each ONF whose table tiling spills (soft-capping's forward and dQ on the A100, the relative-position "
              "dQ on the A100 and H200; the spill check of `schedule.derive` steps these down on a GPU and in "
              "`bench/results/gpu_report.md`), its rows × keys tiles, warps and stages given "
              "(`Preset.of(tiles={'t': rows, 's': keys}, num_warps=…, num_stages=…)`); the first row is the "
              "table's.", "",
              "| machine | arch | kernel | rows × keys | warps | stages | registers | spill st/ld B |",
              "|---|---|---|---|---:|---:|---:|---|"]
    spilling = lambda lab, m: (("relpos" in lab and lab.endswith("d_query") and m.name != "delta-a40")  # noqa: E731
                               or ("softcap" in lab and m.name == "delta-a100" and not lab.endswith("d_key_d_value")))
    for label, m, onf in gpu_report.score_mod_cases(("float32",), targets=gpus):
        if not spilling(label, m):
            continue
        name = " ".join(label.split()[1:2] + label.split()[3:4] + label.split()[-1:])
        for bt, bs, warps, stages in [(64, 32, 8, 3), (64, 32, 8, 2), (64, 16, 8, 2), (32, 32, 8, 2), (32, 32, 8, 3),
                                      (32, 16, 8, 2)]:
            try:
                o = schedule.derive(onf.dnf, m, Preset.of(tiles={"t": bt, "s": bs}, num_warps=warps,
                                                          num_stages=stages))
            except ONFError:
                lines.append(f"| {m.name} | {m.arch} | {name} | {bt} × {bs} | {warps} | {stages} | | does not fit |")
                continue
            r = ptx.onf_reports(o, m.arch)[0]
            lines.append(f"| {m.name} | {m.arch} | {name} | {bt} × {bs} | {warps} | {stages} | {r.registers} | "
                         f"{r.spill_stores}/{r.spill_loads} |")
            print(lines[-1], flush=True)
    write_results(OUT.value, lines)


if __name__ == "__main__":
    app.run(main)
