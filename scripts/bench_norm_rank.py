"""RMSNorm's forward in XLA:CPU against the rank of the array it runs over: moajax's
``rms_norm`` (its kernel is defined on rows [n d], so x [1, T, D] runs as [T, D]) beside the
same plain-jnp expression, w ⊙ x · rsqrt(mean(x²) + ε), over x reshaped to [T, D], [1, T, D],
[2, T/2, D] and [64, T/64, D]; contenders alternated in one process, best and median.

    python scripts/bench_norm_rank.py [--tokens 4096] [--dim 512] [--reps 30] [--out FILE]
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
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "norm_rank_cpu.md"))
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    import moajax
    from moajax.timing import alternating, machine_line, write_results

    T, D = args.tokens, args.dim
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, T, D)), jnp.float32)
    w = jnp.asarray(1 + rng.standard_normal(D) / 20, jnp.float32)

    def plain(shape):
        def f(x):
            y = x.reshape(shape)
            return (w * y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + 1e-6)).reshape(x.shape)
        return f

    fns = {"moajax rms_norm (rows [T, D])": lambda x: moajax.rms_norm(x, w)}
    for shape in [(T, D), (1, T, D), (2, T // 2, D), (64, T // 64, D)]:
        fns[f"plain jnp over {list(shape)}"] = plain(shape)
    compiled = {n: jax.jit(f).lower(x).compile() for n, f in fns.items()}
    want = compiled[f"plain jnp over {[1, T, D]}"](x)
    diff = {n: float(jnp.max(jnp.abs(c(x) - want))) for n, c in compiled.items()}
    times = alternating(compiled, (x,), reps=args.reps)
    base = min(times[f"plain jnp over {[1, T, D]}"])
    lines = ["# RMSNorm's forward on the CPU against the rank of its array", "", machine_line(),
             f"Run: `python scripts/bench_norm_rank.py --tokens {T} --dim {D} --reps {args.reps}` — float32, "
             "one process, the contenders alternated; best and median.", "",
             "| impl | best ms | median ms | vs plain jnp over [1, T, D] (best) | max abs diff |",
             "|---|---:|---:|---:|---:|"]
    for n, ts in times.items():
        lines.append(f"| {n} | {min(ts) * 1e3:.2f} | {statistics.median(ts) * 1e3:.2f} | {base / min(ts):.2f}× | "
                     f"{diff[n]:.1e} |")
    write_results(args.out, lines)


if __name__ == "__main__":
    main()
