"""What a CPU pays to trace and lower a jitted moajax call, with the GPU branch traced lazily
(``compat.platform_dependent``: only when a lowering for CUDA asks) against every branch traced
at each call (``lax.platform_dependent``, as before), alternating in one process; best and median.

Each call is at a shape not seen before (one more row per call), so each pays what the first
call of a kernel at a new shape pays: its DNF, its ONFs, its derived kernels, and JAX's trace
(at a shape already seen, JAX's caches hold the traced branches and both modes cost the same).

    python scripts/bench_trace.py [--reps 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "trace_cpu.md"))
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    import moajax
    from moajax import compat
    from moajax.timing import machine_line, write_results

    rng = np.random.default_rng(0)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[-1]), jnp.float32)  # noqa: E731
    att = moajax.dot_product_attention
    calls = {  # name: (function, operands for a sequence / token count n)
        "attention forward": (lambda q, k, v: att(q, k, v), lambda n: (draw(2, n, 8, 64), draw(2, 256, 8, 64),
                                                                        draw(2, 256, 8, 64))),
        "attention grad, causal": (jax.grad(lambda q, k, v: jnp.sum(att(q, k, v, is_causal=True) ** 2),
                                            argnums=(0, 1, 2)), lambda n: tuple(draw(2, n, 8, 64) for _ in range(3))),
        "rms_norm grad": (jax.grad(lambda x, w: jnp.sum(moajax.rms_norm(x, w) ** 2), argnums=(0, 1)),
                          lambda n: (draw(n, 512), draw(512))),
        "gated_mlp grad": (jax.grad(lambda x, a, b, c: jnp.sum(moajax.gated_mlp(x, a, b, c) ** 2), argnums=(0, 1, 2, 3)),
                           lambda n: (draw(n, 512), draw(512, 1024), draw(512, 1024), draw(1024, 512))),
    }
    lazy = compat._platform_call_primitive
    modes = {"GPU branch traced lazily": lazy, "every branch traced (lax.platform_dependent)": lambda: None}

    def once(fn, operands):
        t = time.perf_counter()
        jax.jit(lambda *a: fn(*a)).trace(*operands).lower()  # a new function: JAX traces it again
        return time.perf_counter() - t

    times = {(c, m): [] for c in calls for m in modes}
    n = 256
    for _ in range(args.reps):
        for c, (fn, operands) in calls.items():
            for m, mode in modes.items():
                compat._platform_call_primitive = mode
                n += 1
                times[c, m].append(once(fn, operands(n)))
    compat._platform_call_primitive = lazy
    lines = [
        "# Trace and lower of a jitted moajax call on a CPU: the GPU branch lazy against eager",
        "",
        machine_line(),
        f"Run: `python scripts/bench_trace.py --reps {args.reps}` — `jax.jit(f).trace(...).lower()`, "
        "each call at a new shape (T or the tokens from 257 on, one more each call: what a first call "
        "at a shape pays, moajax's derivation included); the two modes alternate in one process; best and median. "
        "Attention B=2, N=8, H=64 (the forward's S = 256); rms_norm d = 512; gated_mlp d = 512, f = 1024; float32.",
        "",
        "| call | mode | best s | median s | eager ÷ lazy (median) |",
        "|---|---|---:|---:|---:|",
    ]
    for c in calls:
        (lazy_name, eager_name) = modes
        ratio = statistics.median(times[c, eager_name]) / statistics.median(times[c, lazy_name])
        for m in modes:
            ts = times[c, m]
            lines.append(f"| {c} | {m} | {min(ts):.3f} | {statistics.median(ts):.3f} | "
                         f"{f'{ratio:.2f}×' if m == eager_name else ''} |")
    write_results(args.out, lines)


if __name__ == "__main__":
    main()
