#!/usr/bin/env python3
"""The plans ``jax.grad`` of ``rms_norm`` and ``gated_mlp`` runs on each GPU profile, offline
(PTX through ptxas, no GPU): for each adjoint (RMSNorm's recomputing r and reading it saved;
SwiGLU's) at Llama's sizes, the kernels ``schedule.derive_plan`` takes with the spill check on
(as ``moajax gpu-report``), each kernel's tiling, the cost model's time, and ptxas' registers,
shared memory and spill bytes; beside it the cost model's time of the one fused kernel, and
whether the residual policy "auto" saves r (``Kernel._saving_pays`` on that profile).

    python scripts/ptx_adjoint_plans.py            # bench/results/adjoint_plans_ptx.md
    python scripts/ptx_adjoint_plans.py --out F --title "..."   # (another checkout's run)
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path
from unittest import mock

from absl import app, flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = flags.DEFINE_string("out", str(ROOT / "bench" / "results" / "adjoint_plans_ptx.md"), "the results file")
TITLE = flags.DEFINE_string("title", "", "a heading for this run (default: the commit's)")


def main(argv):
    del argv
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import subprocess

    import jax
    import numpy as np

    from moajax import cost, ptx, runtime, schedule
    from moajax.gpu_report import gpus
    from moajax.kernels.mlp import swiglu
    from moajax.kernels.norm import rmsnorm
    from moajax.onf import ONFError
    from moajax.timing import table_lines, write_results

    ptx.offline_or_exit()
    S = jax.ShapeDtypeStruct

    def cases(dt):
        t = np.dtype(dt)
        for n, d in ((4096, 4096), (256, 8192)):
            sp = [S((n, d), t), S((d,), t)]
            yield f"rmsnorm recomputing r {dt} n={n} d={d}", rmsnorm, sp, rmsnorm.adjoint(*sp).dnf(*sp, S((n, d), t))
            adj, args = rmsnorm.saved_adjoint(*sp)
            yield f"rmsnorm reading r saved {dt} n={n} d={d}", rmsnorm, sp, adj.dnf(*args)
        sp = [S((4096, 1024), t), S((1024, 4096), t), S((1024, 4096), t), S((4096, 1024), t)]
        yield f"swiglu {dt} n=4096 d=1024 f=4096", swiglu, sp, swiglu.adjoint(*sp).dnf(*sp, S((4096, 1024), t))

    rows = []
    for dt in ("float32", "bfloat16"):
        for label, kern, specs, dnf in cases(dt):
            for m in gpus():
                with mock.patch.object(runtime, "gpu_machine", lambda path="pallas", m=m: m):
                    saves = "yes" if kern._saving_pays(kern._key(specs, {}), {}, "pallas") else "no"
                try:
                    fused = f"{cost.estimate(schedule.derive(dnf, m), m).time_s * 1e6:.1f}"
                except ONFError:
                    fused = "none fits"
                try:
                    plan = schedule.derive_plan(dnf, m)
                except ONFError as e:
                    rows.append((label, m.name, "—", "none fits", str(e)[:60], "", "", "", "", fused, saves))
                    continue
                plan = plan if isinstance(plan, tuple) else (plan,)
                total = cost.sequence(cost.estimate(o, m) for o in plan).time_s * 1e6
                for k, o in enumerate(plan):
                    reps = ptx.onf_reports(o, m.arch)
                    rows.append((label if k == 0 else "", m.name if k == 0 else "", f"{total:.1f}" if k == 0 else "",
                                 o.dnf.name[len(dnf.name):].lstrip("_") or "(fused)",
                                 " ".join(f"{a.name} {a.tile} {a.role}" for a in o.axes),
                                 f"{cost.estimate(o, m).time_s * 1e6:.1f}",
                                 "/".join(str(r.registers) for r in reps), "/".join(str(r.smem_bytes) for r in reps),
                                 "/".join(str(r.spill_stores + r.spill_loads) for r in reps),
                                 fused if k == 0 else "", saves if k == 0 else ""))
    head = ("| adjoint | machine | plan µs (model) | kernel | axes (tile, role) | kernel µs (model) | registers "
            "| smem B (ptxas) | spill B | fused kernel µs (model) | \"auto\" saves r |")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    lines = [
        f"## {TITLE.value or 'At ' + commit}",
        "",
        f"Date {datetime.date.today().isoformat()}; JAX {jax.__version__}; ptxas {ptx.ptxas_version()}; "
        "`python scripts/ptx_adjoint_plans.py`. Each profile with its spill check on. Times are the cost "
        "model's (untimed on a GPU); registers, shared memory and spills are ptxas' for each Pallas call of a "
        "kernel (a/b: two calls, e.g. split-K's parts and their combine).",
        "",
        *table_lines(head, rows),
    ]
    write_results(OUT.value, lines)


if __name__ == "__main__":
    app.run(main)
