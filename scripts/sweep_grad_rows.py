"""jit(grad) of attention against the CPU row tile: the default schedule beside other CPU score-tile
budgets (a profile's ``cpu_score_tile_bytes`` under ``machines.using``: the forward's rows and the
adjoint's key tiles both follow it), fixed row tiles (``Preset.of(tiles={"t": …})``) and jax.nn,
alternating in one process; best and median of the repetitions. ``--forward``: the forward alone.

The CPU schedule's row tile makes a score tile (heads × rows × 256 keys, float32) of the budget
``schedule._cpu_cache_budget``: 1/8 of the last-level cache, at least 4 MiB. This measures the
budget on the machine at hand.

    python scripts/sweep_grad_rows.py [--size 4096] [--budgets 1 2 4 8] [--rows 256 512] [--forward] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, nargs="*", default=[4096])
    ap.add_argument("--budgets", type=float, nargs="*", default=[1, 2, 4, 8], help="MiB")
    ap.add_argument("--rows", type=int, nargs="*", default=[])
    ap.add_argument("--forward", action="store_true", help="time the forward instead of jit(grad)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "grad_rows_cpu.md"))
    args = ap.parse_args()

    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    import moajax
    from moajax import machines, schedule
    from moajax.timing import alternating, machine_line, write_results

    what = "the forward" if args.forward else "jit(grad) of sum(attention · G) w.r.t. q, k, v"
    here = machines.local()
    lines = [
        f"# {'The attention forward' if args.forward else 'jit(grad) of attention'} against the CPU score tile",
        "",
        machine_line(),
        f"Run: `python scripts/sweep_grad_rows.py --size {' '.join(map(str, args.size))} --budgets "
        f"{' '.join(f'{b:g}' for b in args.budgets)}{' --rows ' + ' '.join(map(str, args.rows)) if args.rows else ''}"
        f"{' --forward' if args.forward else ''} --reps {args.reps}` — B=1, T = S, N=8, H=64, float32; {what}; the contenders "
        f"alternate in one process, best and median of {args.reps} after a warm-up. Budget: the profile's CPU score "
        f"tile (`cpu_score_tile_bytes`); this machine's default is {schedule._cpu_cache_budget(here) / 2**20:g} MiB "
        f"(its last-level cache {here.llc_bytes / 2**20:g} MiB). Rows: the forward's rows per program at that budget.",
        "",
        "| S | impl | rows | best s | median s | vs jax.nn (best) | temp MiB |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for S in args.size:
        rng = np.random.default_rng(0)
        operands = tuple(jnp.asarray(rng.standard_normal((1, S, 8, 64)), jnp.float32) for _ in range(4))

        def compiled_of(att):
            # a new function per contender (JAX caches a jitted function's trace by the function),
            # compiled now: under ``machines.using`` the derivation is that profile's
            if args.forward:
                f = jax.jit(lambda q, k, v, g: att(q, k, v))
            else:
                f = jax.jit(jax.grad(lambda q, k, v, g: jnp.sum(att(q, k, v) * g), argnums=(0, 1, 2)))
            return f.lower(*operands).compile()

        compiled, rows = {}, {}
        contenders = [("moajax, default", None, None)]
        contenders += [(f"moajax, budget {b:g} MiB", int(b * 2**20), None) for b in args.budgets]
        contenders += [(f"moajax, rows {t}", None, t) for t in args.rows]
        for name, budget, t in contenders:
            profile = here if budget is None else dataclasses.replace(here, cpu_score_tile_bytes=budget)
            onf = moajax.Preset.of(tiles={"t": t}) if t else None
            with machines.using(profile):
                compiled[name] = compiled_of(lambda q, k, v, onf=onf: moajax.dot_product_attention(q, k, v, onf=onf))
                rows[name] = moajax.attention_onf(*operands[:3], preset=onf).axis("t").tile
        compiled["jax.nn"] = compiled_of(jax.nn.dot_product_attention)
        rows["jax.nn"] = "—"
        temp = {}
        for name, c in compiled.items():
            mem = c.memory_analysis()
            temp[name] = int(getattr(mem, "temp_size_in_bytes", 0)) if mem is not None else -1
        times = alternating(compiled, operands, reps=args.reps)
        base = min(times["jax.nn"])
        for name, ts in times.items():
            lines.append(f"| {S} | {name} | {rows[name]} | {min(ts):.4f} | {statistics.median(ts):.4f} | "
                         f"{base / min(ts):.2f}× | {temp[name] / 2**20:.1f} |")
    write_results(args.out, lines)


if __name__ == "__main__":
    main()
