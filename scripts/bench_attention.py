#!/usr/bin/env python3
"""Attention forward on this machine: moajax vs jax.nn vs plain-jnp, in one process.

For each sequence length S (= T) it reports, side by side: median time, GF/s (4·T·S·N·D
flops), the ratio to a same-run large GEMM's GF/s, the speed-up over jax.nn, and the
compiled temp memory (``memory_analysis().temp_size_in_bytes``). Anything whose compiled
temp memory exceeds the memory budget is skipped and the reason printed. Results go to
bench/results/attention_forward_cpu.md (machine and date on the first lines).

    python scripts/bench_attention.py                 # S = 1024 4096 8192 32768
    python scripts/bench_attention.py --sizes 1024 4096 --reps 5
    python scripts/bench_attention.py --grad     # jit(grad) instead: bench/results/attention_grad_cpu.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _mem_total() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable"):
                return int(line.split()[1]) * 1024
    except Exception:
        pass
    return 8 << 30


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="*", default=None, help="default 1024 4096 8192 32768 (--grad: 1024 4096 8192)")
    ap.add_argument("--grad", action="store_true", help="time jit(grad) of sum(attention · G) w.r.t. q, k, v instead")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=0, help="timed repetitions (default: by size)")
    ap.add_argument("--out", default="", help="default bench/results/attention_{forward,grad}_cpu.md")
    ap.add_argument("--budget-gib", type=float, default=0.0, help="skip compiled temp memory above this (default: 70%% of available RAM)")
    args = ap.parse_args()
    args.sizes = args.sizes or ([1024, 4096, 8192] if args.grad else [1024, 4096, 8192, 32768])
    args.out = args.out or str(ROOT / "bench" / "results" / f"attention_{'grad' if args.grad else 'forward'}_cpu.md")

    import jax
    import jax.numpy as jnp
    import numpy as np

    import moajax

    budget = int(args.budget_gib * 2**30) if args.budget_gib else int(0.7 * _mem_total())
    N, D = args.heads, args.head_dim
    rng = np.random.default_rng(0)

    def materialised(q, k, v):
        s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1]).astype(q.dtype)
        p = jax.nn.softmax(s, axis=-1)
        return jnp.einsum("bnts,bsnh->btnh", p, v)

    fns = {"moajax": moajax.dot_product_attention, "jax.nn": jax.nn.dot_product_attention, "plain jnp": materialised}
    if args.grad:
        # d/d(q, k, v) of sum(attention · G), G a fixed random cotangent; the forward is included
        def grad_of(f):
            return jax.grad(lambda q, k, v, g: jnp.sum(f(q, k, v) * g), argnums=(0, 1, 2))

        fns = {name: grad_of(f) for name, f in fns.items()}
    impls = {name: jax.jit(f) for name, f in fns.items()}
    # matmul flops: the forward's two (4·T·S·N·H); with --grad also the backward's four
    # (dV = Pᵀ dO, dP = dO Vᵀ, dQ = dS K, dK = dSᵀ Q): 12·T·S·N·H
    flop_factor = 12 if args.grad else 4

    from moajax.timing import machine_line, write_results
    from moajax.timing import median_seconds as timed  # one warm-up (compile + first run)

    gn = 4096
    ga = jnp.asarray(rng.standard_normal((gn, gn)), jnp.float32)
    gemm = jax.jit(jnp.dot)
    gemm_rates = [2 * gn**3 / timed(gemm, ga, ga, reps=5) / 1e9]

    rows = []
    for S in args.sizes:
        T = S
        q = jnp.asarray(rng.standard_normal((1, T, N, D)), jnp.float32)
        k = jnp.asarray(rng.standard_normal((1, S, N, D)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((1, S, N, D)), jnp.float32)
        operands = (q, k, v, jnp.asarray(rng.standard_normal((1, T, N, D)), jnp.float32)) if args.grad else (q, k, v)
        flops = flop_factor * T * S * N * D
        reps = args.reps or (10 if S <= 1024 else 5 if S <= 4096 else 3 if S <= 8192 else 1)
        res = {}
        for name, fn in impls.items():
            compiled = fn.lower(*operands).compile()
            mem = compiled.memory_analysis()
            temp = int(getattr(mem, "temp_size_in_bytes", 0)) if mem is not None else -1
            if temp > budget:
                res[name] = dict(skip=f"needs {temp / 2**30:.1f} GiB temp > {budget / 2**30:.1f} GiB budget", temp=temp)
                print(f"S={S:6d} {name:10s} skipped: {res[name]['skip']}", flush=True)
                continue
            t = timed(compiled, *operands, reps=reps)
            res[name] = dict(t=t, gfs=flops / t / 1e9, temp=temp)
            print(f"S={S:6d} {name:10s} {t:9.4f} s  {flops / t / 1e9:7.1f} GF/s  temp {temp / 2**20:9.1f} MiB", flush=True)
        if "t" in res.get("moajax", {}) and "t" in res.get("jax.nn", {}):
            out_m = jax.tree.leaves(impls["moajax"](*operands))
            out_j = jax.tree.leaves(impls["jax.nn"](*operands))
            res["moajax"]["err"] = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(out_m, out_j))
        rows.append((S, res))
    gemm_rates.append(2 * gn**3 / timed(gemm, ga, ga, reps=5) / 1e9)
    gemm_gfs = statistics.median(gemm_rates)

    lines = [
        f"# Attention {'gradient (jit(grad) w.r.t. q, k, v)' if args.grad else 'forward'} on the CPU: "
        "moajax vs jax.nn vs plain jnp",
        "",
        machine_line(),
        f"Run: `python scripts/bench_attention.py{' --grad' if args.grad else ''}` — B=1, N={N}, H={D}, float32, T = S; one process, "
        f"compiled once per size, median of repeated runs after a warm-up.",
        f"Same-run GEMM ({gn}×{gn}×{gn} float32, jitted jnp.dot): {gemm_gfs:.1f} GF/s "
        f"(before {gemm_rates[0]:.1f}, after {gemm_rates[1]:.1f}).",
        (f"GF/s counts {flop_factor}·T·S·N·H flops (the forward's two matmuls"
         + (" and the backward's four" if args.grad else "") + "). Temp = the compiled executable's temp allocation."),
        "",
        "| S | impl | median s | GF/s | % of GEMM | speed-up vs jax.nn | temp MiB | note |",
        "|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for S, res in rows:
        base = res.get("jax.nn", {}).get("t")
        for name in impls:
            r = res.get(name)
            if r is None:
                continue
            if "skip" in r:
                lines.append(f"| {S} | {name} | — | — | — | — | {r['temp'] / 2**20:.0f} | skipped: {r['skip']} |")
                continue
            sp = f"{base / r['t']:.2f}×" if base else "—"
            note = f"max rel. diff vs jax.nn {r['err']:.1e}" if "err" in r else ""
            lines.append(
                f"| {S} | {name} | {r['t']:.4f} | {r['gfs']:.1f} | {100 * r['gfs'] / gemm_gfs:.0f} % | {sp} | "
                f"{r['temp'] / 2**20:.1f} | {note} |"
            )
    by = dict(rows) if not args.grad else {}
    if not args.grad:
        lines += ["", "## Targets (issue 3)", ""]
    if 4096 in by and "t" in by[4096].get("moajax", {}) and "t" in by[4096].get("jax.nn", {}):
        m, j = by[4096]["moajax"], by[4096]["jax.nn"]
        sp, frac = j["t"] / m["t"], m["gfs"] / gemm_gfs
        lines.append(f"- S=4096: moajax {sp:.2f}× jax.nn (target ≥ 4×: {'met' if sp >= 4 else 'NOT met'}); "
                     f"{100 * frac:.0f} % of the same-run GEMM rate (target ≥ 70 %: {'met' if frac >= 0.7 else 'NOT met'}).")
    if 8192 in by and "moajax" in by[8192] and "jax.nn" in by[8192]:
        tm, tj = by[8192]["moajax"]["temp"], by[8192]["jax.nn"]["temp"]
        lines.append(f"- S=8192: temp {tm / 2**20:.1f} MiB vs jax.nn {tj / 2**20:.1f} MiB = 1/{tj / max(tm, 1):.0f} "
                     f"(target ≤ 1/10: {'met' if tm * 10 <= tj else 'NOT met'}).")
    if 32768 in by and "moajax" in by[32768]:
        r = by[32768]["moajax"]
        ran = "t" in r
        lines.append(f"- S=32768: moajax {'ran' if ran else 'did not run'} with {r['temp'] / 2**30:.2f} GiB temp "
                     f"(target < 2 GiB: {'met' if ran and r['temp'] < 2**31 else 'NOT met'}); "
                     f"jax.nn: {by[32768].get('jax.nn', {}).get('skip', 'ran')}.")
    write_results(args.out, lines)


if __name__ == "__main__":
    sys.exit(main())
