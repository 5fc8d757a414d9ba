#!/usr/bin/env python3
"""Can a register model replace the GPU tile tables? A check against the compiler.

For every row of ``bench/results/smem_sweep.md`` (1296 ptxas compilations of the attention
forward and the fused forward+backward over tilings × warps × stages × sm_80/sm_86/sm_90a)
this computes the register-resident bytes the cost model counts (``cost.register_bytes``:
accumulators and the largest contraction tile), plus the input tiles a program loads, in
32-bit words per thread, and asks per kernel and dtype whether a threshold on it separates
the tilings ptxas spills (> 16 B of spill stores) from those it does not. No GPU is used.

    python scripts/fit_registers.py          # writes bench/results/register_model.md
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    import argparse

    import jax

    # (--help must not run the fit: it rewrites the committed table)
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog="Writes bench/results/register_model.md.").parse_args()

    jax.config.update("jax_enable_x64", True)
    from moajax import cost, gpu_report, timing

    rows = []
    for line in (ROOT / "bench" / "results" / "smem_sweep.md").read_text().splitlines():
        p = [x.strip() for x in line.split("|")[1:-1]]
        if len(p) == 12 and p[0] in ("forward", "fwd+bwd"):
            rows.append(p)
    words: dict = {}
    out = []
    for kernel, dt, h, bt, bs, w, st, arch, _, _, regs, spill in rows:
        key = (kernel, dt, int(h), int(bt), int(bs), int(w), int(st))
        if key not in words:
            onf = gpu_report.sweep_onf(*key)
            _, stages = cost._kernel_stages(onf)[-1]
            seq = {a.name for a in onf.axes if a.role == "sequential"}
            loaded = sum(size * item for size, item, _ in cost._loaded_tiles(onf, stages, seq))
            words[key] = (cost.register_bytes(onf) + loaded) / 4 / (32 * int(w))
        out.append((kernel, dt, words[key], int(spill)))
    lines = ["# A register model against ptxas: does register-resident data per thread predict spills?", "",
             timing.machine_line(),
             "Run: `python scripts/fit_registers.py` — over the rows of `bench/results/smem_sweep.md`; words = "
             "(cost.register_bytes + loaded input tiles) / 4 / threads. A threshold separates the classes only if "
             "the smallest spilling value exceeds the largest clean one.", "",
             "| kernel | dtype | rows spilling (> 16 B) | smallest words/thread spilling | rows clean | "
             "largest words/thread clean | clean rows above the smallest spilling | separable |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for kernel in ("forward", "fwd+bwd"):
        for dt in ("float16", "float32", "float64"):
            sp = [x for k, d, x, s in out if k == kernel and d == dt and s > 16]
            ok = [x for k, d, x, s in out if k == kernel and d == dt and s == 0]
            lo = min(sp) if sp else float("inf")
            above = sum(1 for x in ok if x >= lo)
            lines.append(f"| {kernel} | {dt} | {len(sp)} | {lo:.1f} | {len(ok)} | {max(ok):.1f} | {above} | "
                         f"{'yes' if above == 0 else 'no'} |")
    timing.write_results(str(ROOT / "bench" / "results" / "register_model.md"), lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
