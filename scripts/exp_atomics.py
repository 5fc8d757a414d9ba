#!/usr/bin/env python3
"""The seed's first result as an experiment: atomics in the fused attention backward.

Paper II's fused kernel (programs own query rows, dK and dV scatter-added) ran 1.14–1.84×
slower than naive on the A100; ncu counted 1,073,741,824 atomic instructions at N = 2048 against
536,870,912 for the backward alone (2.00×). The seed's fix, an ONF rewrite with the DNF fixed:
dV in a kernel of its own owning key rows (no atomic), dK still atomic. moajax adds "owner"
(no atomics). For the seed's setting (float64, B = 2, N = 2048, d = 64, one head) this prints,
for each backward ONF and GPU profile, the cost model's atomics, bytes, flops and roofline
time — at the default tiles, and at the seed's own ONF (one query row per program: t tiled by
1), whose atomic counts are the seed's ncu counts exactly — and, with the offline compiler
(the ``gpu`` extra), the atom instructions ptxas finds in each kernel (sm_80, float32, N = 512
to keep the compile short). GPU timings come from ``scripts/gpu_check.sh`` on a GPU.

    python scripts/exp_atomics.py    # writes bench/results/atomics.md
"""

from __future__ import annotations

import sys
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parent.parent
FLAGS = flags.DEFINE_string("out", str(ROOT / "bench" / "results" / "atomics.md"), "the results file")
PTX = flags.DEFINE_bool("ptx", True, "also count atom instructions in the offline PTX (needs the gpu extra)")

PLANS = [("atomic (paper II's fused)", "fused"), ("split (the seed's fix)", (("d_query", "d_key"), ("d_value",))),
         ("owner (moajax's default)", "owner")]


def _adjoint(n, dtype, batch):
    import jax
    import numpy as np

    from moajax.compat import enable_x64_context
    from moajax.kernels.attention import mha_kernel

    specs = [jax.ShapeDtypeStruct((batch, n, 1, 64), np.dtype(dtype))] * 3
    with enable_x64_context(True):
        adj, args = mha_kernel(None, None, False).saved_adjoint(*specs)
        return adj.dnf(*args)


def main(argv):
    del argv
    from moajax import cost, machines, ptx, schedule
    from moajax.compat import enable_x64_context
    from moajax.schedule import Preset
    from moajax.timing import machine_line, write_results

    lines = ["# The seed's atomics result: the attention backward ONFs side by side", "", machine_line(),
             "Run: `python scripts/exp_atomics.py` — the cost model at the seed's setting (float64, B = 2, N = 2048, "
             "d = 64, one head); atomics = one read-modify-write per element and program that scatter-adds it. "
             "No GPU timings here: `scripts/gpu_check.sh` times the ONFs on a GPU.", ""]
    with enable_x64_context(True):
        dnf = _adjoint(2048, "float64", 2)
        for tiles, title in (({}, "default tiles"), ({"t": 1}, "the seed's ONF: one query row per program")):
            lines += [f"## {title}", "",
                      "| machine | ONF | kernels | atomics | vs split | GB moved | GFLOP | roofline ms |",
                      "|---|---|---:|---:|---:|---:|---:|---:|"]
            for m in (machines.load("delta-a100"), machines.load("h200")):
                counts = {}
                for label, plan in PLANS:
                    onfs = schedule.derive_plan(dnf, m, Preset.of(plan=plan, tiles=tiles))
                    onfs = onfs if isinstance(onfs, tuple) else (onfs,)
                    c = cost.sequence(cost.estimate(o, m) for o in onfs)
                    counts[label] = (c, len(onfs))
                split = counts[PLANS[1][0]][0].atomics
                for label, (c, k) in counts.items():
                    ratio = f"{c.atomics / split:.2f}×" if split else "—"
                    lines.append(f"| {m.name} | {label} | {k} | {c.atomics:,} | {ratio} | {c.bytes_moved / 1e9:.3g} | "
                                 f"{c.flops / 1e9:.4g} | {c.time_s * 1e3:.3g} |")
            lines.append("")
    lines += ["The seed's ncu counts at N = 2048: 1,073,741,824 (fused) and 536,870,912 (backward alone): 2.00×.", ""]
    if PTX.value:
        reason = ptx.toolchain_missing()
        lines += ["## atom instructions in the PTX (sm_80, float32, B = 1, N = 512, default tiles)", ""]
        if reason:
            lines.append(f"Not compiled: {reason}.")
        else:
            small = _adjoint(512, "float32", 1)
            a100 = machines.load("delta-a100")
            lines += ["| ONF | kernels | atom instructions | registers (max) | spill bytes |", "|---|---:|---:|---:|---:|"]
            for label, plan in PLANS:
                onfs = schedule.derive_plan(small, a100, Preset.of(plan=plan))
                onfs = onfs if isinstance(onfs, tuple) else (onfs,)
                reports = [r for o in onfs for r in ptx.onf_reports(o, "sm_80")]
                lines.append(f"| {label} | {len(reports)} | {sum(r.atomics for r in reports)} | "
                             f"{max(r.registers for r in reports)} | {sum(r.spill_stores for r in reports)} |")
        lines.append("")
    print(write_results(FLAGS.value, lines))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    app.run(main)
