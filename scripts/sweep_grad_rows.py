"""jit(grad) of attention against the row tile: the default schedule's rows per program beside
fixed ones (``Preset.of(tiles={"t": …})``, which the backward takes too) and jax.nn, alternating
in one process; best and median of the repetitions.

The CPU schedule's row tile keeps a score tile near 1/8 of the last-level cache
(``schedule._cpu_rows``), calibrated on the forward; this measures what it gives the gradient on
the machine at hand (a small last-level cache gives small row tiles, and the fused adjoint
walks every key tile and scatter-adds dK and dV once per row tile).

    python scripts/sweep_grad_rows.py [--size 4096] [--rows 256 512 1024 4096] [--out FILE]
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
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--rows", type=int, nargs="*", default=[256, 512, 1024, 4096])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "grad_rows_cpu.md"))
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    import moajax
    from moajax.timing import alternating, machine_line, write_results

    S, N, H = args.size, 8, 64
    rng = np.random.default_rng(0)
    operands = tuple(jnp.asarray(rng.standard_normal((1, S, N, H)), jnp.float32) for _ in range(4))

    def grad_of(att):
        return jax.jit(jax.grad(lambda q, k, v, g: jnp.sum(att(q, k, v) * g), argnums=(0, 1, 2)))

    fns = {"moajax, default rows": grad_of(moajax.dot_product_attention)}
    for t in args.rows:
        onf = moajax.Preset.of(tiles={"t": t})
        fns[f"moajax, rows {t}"] = grad_of(lambda q, k, v, onf=onf: moajax.dot_product_attention(q, k, v, onf=onf))
    fns["jax.nn"] = grad_of(jax.nn.dot_product_attention)
    compiled, temp = {}, {}
    for name, f in fns.items():
        compiled[name] = f.lower(*operands).compile()
        mem = compiled[name].memory_analysis()
        temp[name] = int(getattr(mem, "temp_size_in_bytes", 0)) if mem is not None else -1
    default_rows = moajax.attention_onf(*operands[:3]).axis("t").tile
    times = alternating(compiled, operands, reps=args.reps)
    base = min(times["jax.nn"])
    lines = [
        "# jit(grad) of attention against the CPU row tile",
        "",
        machine_line(),
        f"Run: `python scripts/sweep_grad_rows.py --size {S}` — B=1, T = S = {S}, N=8, H=64, float32; jit(grad) of "
        f"sum(attention · G) w.r.t. q, k, v; the contenders alternate in one process, best and median of {args.reps} "
        f"after a warm-up. The default schedule's forward takes rows of {default_rows} here.",
        "",
        "| impl | best s | median s | vs jax.nn (best) | temp MiB |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, ts in times.items():
        lines.append(f"| {name} | {min(ts):.3f} | {statistics.median(ts):.3f} | {base / min(ts):.2f}× | "
                     f"{temp[name] / 2**20:.1f} |")
    write_results(args.out, lines)


if __name__ == "__main__":
    main()
