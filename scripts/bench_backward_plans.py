#!/usr/bin/env python3
"""The attention adjoint on this CPU under its three XLA plans, side by side in one process.

The adjoint kernel of multi-head attention (dQ, dK, dV; ``mha_kernel(...).adjoint``, derived in
the algebra) — recomputing the softmax's statistics, or reading the saved ones and Out — is run as
  - fused: one ONF (``schedule.derive``): on the CPU programs own key tiles and walk the
    query tiles once, dQ scatter-added over them (FlashAttention-2's order: the fewest
    outputs scatter-added), the score, dP and P computed once per tile;
  - split: one ONF per output (``schedule.split_outputs``), each output's rows owned;
  - owner: one ONF per row owner (``schedule.plan_groups``: dQ owning query tiles, dK and dV
    together owning key tiles, their Σ_t in one loop sharing P).
``schedule.derive_plan`` takes the owner plan where the fused plan scatter-adds, except on a CPU
where it adds one output in a walk and does less reduction work (``schedule.plan_work``); this
table is the measurement behind that rule.
Contenders alternate; best and median of the repetitions. B=1, N=8, H=E=64, float32.
Results: bench/results/backward_plans_cpu.md.

A second table: few keys against many queries (T = 4096, S = 256, 512: a ring's piece of K and
V, cross-attention), the adjoint reading the saved statistics, where every key is one row tile:
the fused plan's walk over key tiles is one step (``lower_xla._one_pass``); the owner plan there
stages the shared score in memory first (``schedule.staged_parts``: [t s] up to 4 × Q), the
plan derive_plan took before it took the fused one. Temp: the compiled executable's.

    python scripts/bench_backward_plans.py                  # S = T = 1024 2048 4096
    python scripts/bench_backward_plans.py --sizes 1024 --reps 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _side_by_side(plans: dict, arrays, reps: int):
    """Each plan jitted, run, and timed alternating with the others: (the jitted functions,
    name → times, name → the max relative difference of its outputs from the fused plan's)."""
    import jax
    import jax.numpy as jnp

    from moajax import runtime, timing

    fns = {n: jax.jit(runtime.lowered(p, "xla")) for n, p in plans.items()}
    got = {n: f(*arrays) for n, f in fns.items()}
    diff = {n: max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(got[n], got["fused"]))
            for n in fns}
    return fns, timing.alternating(fns, arrays, reps=reps), diff


def _note(name: str, diff: dict) -> str:
    return f"max rel. diff vs fused {diff[name]:.1e}" if name != "fused" else ""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="*", default=[1024, 2048, 4096])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--queries", type=int, default=4096, help="T of the few-keys table")
    ap.add_argument("--few_keys", type=int, nargs="*", default=[256, 512], help="S of the few-keys table")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "backward_plans_cpu.md"))
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from moajax import machines, schedule, timing
    from moajax.kernels.attention import mha_kernel

    kern = mha_kernel(None, None, False)
    machine = machines.local()
    rows = []
    for S in args.sizes:
        spec = jax.ShapeDtypeStruct((1, S, args.heads, 64), np.float32)
        r = np.random.default_rng(0)
        primal = [jnp.asarray(r.standard_normal(spec.shape), jnp.float32) for _ in range(4)]
        # the adjoint that recomputes the softmax's statistics, and the one jax.grad runs when
        # the forward saves them and Out (its Δ = +/(dO × O): moajax.identities)
        saving = kern.with_row_statistics().compiled(spec, spec, spec)
        out, *saved = saving(*primal[:3])
        for variant, adj, arrays in (
                ("recompute", kern.adjoint(spec, spec, spec), primal),
                ("saved", kern.adjoint(spec, spec, spec, saved=True), primal + list(saved) + [out])):
            dnf = adj.dnf(*arrays)
            owner = schedule.plan_groups(dnf, "owner", machine)
            plans = {"fused": schedule.derive(dnf, machine),
                     "split": tuple(schedule.derive(d, machine) for d in schedule.split_outputs(dnf)),
                     "owner": tuple(schedule.derive(d, machine) for d in schedule.split_outputs(dnf, owner))}
            chosen = schedule.derive_plan(dnf, machine)
            # by the outputs each kernel computes (a staged plan's first kernel, dden, none)
            groups = [g for g in (tuple(o.name for o in c.dnf.outputs if o.name in {x.name for x in dnf.outputs})
                                  for c in (chosen if isinstance(chosen, tuple) else (chosen,))) if g]
            chosen = "fused" if len(groups) == 1 else "split" if all(len(g) == 1 for g in groups) else "owner"
            _, times, diff = _side_by_side(plans, arrays, args.reps)
            for n, ts in times.items():
                picked = "yes" if n == chosen else ""
                rows.append(f"| {S} | {variant} | {n} | {min(ts):.4f} | {statistics.median(ts):.4f} | "
                            f"{statistics.median(times['fused']) / statistics.median(ts):.2f}× | {picked} | "
                            f"{_note(n, diff)} |")
    few = []
    for S in args.few_keys:
        T = args.queries
        r = np.random.default_rng(0)
        q, g = (jnp.asarray(r.standard_normal((1, T, args.heads, 64)), jnp.float32) for _ in range(2))
        k, v = (jnp.asarray(r.standard_normal((1, S, args.heads, 64)), jnp.float32) for _ in range(2))
        out, *saved = kern.with_row_statistics().compiled(q, k, v)(q, k, v)
        adj = kern.adjoint(q, k, v, saved=True)
        arrays = [q, k, v, g, *saved, out]
        dnf = adj.dnf(*arrays)
        owner = schedule.plan_groups(dnf, "owner", machine)
        plans = {"fused": schedule.derive(dnf, machine),
                 "owner, staged": tuple(schedule.derive(d, machine) for d in schedule.staged_parts(dnf, owner)),
                 "owner": tuple(schedule.derive(d, machine) for d in schedule.split_outputs(dnf, owner))}
        chosen = schedule.derive_plan(dnf, machine)
        fns, times, diff = _side_by_side(plans, arrays, args.reps)
        temp = {n: f.lower(*arrays).compile().memory_analysis().temp_size_in_bytes for n, f in fns.items()}
        for n, ts in times.items():
            picked = "yes" if chosen == plans[n] else ""
            few.append(f"| {T} | {S} | {n} | {len(plans[n]) if isinstance(plans[n], tuple) else 1} | {min(ts):.4f} | "
                       f"{statistics.median(ts):.4f} | {statistics.median(times['fused']) / statistics.median(ts):.2f}× | "
                       f"{temp[n] / 2**20:.1f} MiB | {picked} | {_note(n, diff)} |")
    lines = [
        "# The attention adjoint (dQ, dK, dV) on the CPU: fused, split and owner XLA plans",
        "",
        timing.machine_line(),
        f"Run: `python scripts/bench_backward_plans.py` — B=1, N={args.heads}, H=E=64, float32, T = S; the adjoint "
        "kernel alone (no forward); contenders alternate in one process.",
        "",
        "| S | adjoint | plan | best s | median s | speed-up vs fused (median) | derive_plan picks | note |",
        "|---:|---|---|---:|---:|---:|---|---|",
        *rows,
    ]
    if few:
        lines += ["", "## Few keys against many queries: every key in one row tile", "",
                  f"The adjoint reading the saved statistics, B=1, N={args.heads}, H=E=64, float32. Kernels: the "
                  "plan's ONFs (a staged plan's first kernel computes the shared score into memory).", "",
                  "| T | S | plan | kernels | best s | median s | speed-up vs fused (median) | temp | "
                  "derive_plan picks | note |", "|---:|---:|---|---:|---:|---:|---:|---:|---|---|", *few]
    timing.write_results(args.out, lines)


if __name__ == "__main__":
    main()
