"""jax.grad of the MLP and RMSNorm under jax.vmap over examples that share the weights (the
Equinox way) beside the same call on x [B, T, D] (the kernel's own leading axes) and plain
jnp: each jit(grad) over the weights, its executable's temp memory (XLA's memory analysis)
and its wall time, the contenders alternated in one process; best and median. The
vmap/leading-axes ratios compare across runs of different code (``--label`` names the run).

    python scripts/bench_vmap_grad.py [--batch 8] [--tokens 128] [--dim 512] [--ff 1408] [--reps 20]
                                      [--label TEXT] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--ff", type=int, default=1408)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--label", default="this tree")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "vmap_grad_cpu.md"))
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    import moajax
    from moajax.timing import alternating, machine_line, write_results

    B, T, D, F = args.batch, args.tokens, args.dim, args.ff
    r = np.random.default_rng(0)
    x = jnp.asarray(r.standard_normal((B, T, D)), jnp.float32)
    s = 1 / np.sqrt(D)
    mlp_w = tuple(jnp.asarray(s * r.standard_normal(shape), jnp.float32) for shape in ((D, F), (D, F), (F, D)))
    norm_w = (jnp.asarray(1 + r.standard_normal(D) / 20, jnp.float32),)

    def plain_mlp(x, wg, wu, wd):
        return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd

    def plain_norm(x, w):
        return w * x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)

    kernels = {"gated_mlp": (moajax.gated_mlp, plain_mlp, mlp_w), "rms_norm": (moajax.rms_norm, plain_norm, norm_w)}
    lines = ["# jax.grad of a vmap over examples sharing the weights, on the CPU", "", machine_line(),
             f"Run: `python scripts/bench_vmap_grad.py --batch {B} --tokens {T} --dim {D} --ff {F} --reps {args.reps}"
             f" --label '{args.label}'` — float32, jit(grad) over the weights of Σ sin(f(x)); one process, the "
             "contenders alternated; best and median; temp: the executable's temp allocation.", "",
             "| run | kernel | contender | temp MiB | best ms | median ms | best vs leading axes | max rel diff vs leading |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for name, (fn, plain, ws) in kernels.items():
        n = len(ws)

        def loss_of(f):
            return jax.jit(jax.grad(lambda ws, x: jnp.sum(jnp.sin(f(x, *ws)))))

        contenders = {
            "vmap over B (weights shared)": loss_of(lambda x, *ws: jax.vmap(lambda e: fn(e, *ws))(x)),
            "leading axes x [B, T, D]": loss_of(fn),
            "plain jnp": loss_of(plain),
        }
        compiled = {c: f.lower(ws, x).compile() for c, f in contenders.items()}
        want = compiled["leading axes x [B, T, D]"](ws, x)
        diff = {c: max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(f(ws, x), want))
                for c, f in compiled.items()}
        times = alternating(compiled, (ws, x), reps=args.reps)
        base = min(times["leading axes x [B, T, D]"])
        for c, ts in times.items():
            temp = compiled[c].memory_analysis().temp_size_in_bytes / 2**20
            lines.append(f"| {args.label} | {name} (weights: {n}) | {c} | {temp:.1f} | {min(ts) * 1e3:.2f} | "
                         f"{statistics.median(ts) * 1e3:.2f} | {base / min(ts):.2f}× | {diff[c]:.1e} |")
    write_results(args.out, lines)


if __name__ == "__main__":
    main()
