#!/usr/bin/env python3
"""What jax.nn's ``return_residual`` costs: the attention forward with and without the rows'
log-sum-exp, moajax and jax.nn, alternating in one process (CPU).

moajax computes lse in the pass that computes Out (the softmax's own row max and sum, one row
sum for both); jax.nn takes a second logsumexp over its materialised [T, S] scores. Best and
median of the repetitions after a warm-up; temp = the compiled executable's temp allocation.

    python scripts/bench_residual.py                  # writes bench/results/attention_residual_cpu.md
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parent.parent
OUT = flags.DEFINE_string("out", str(ROOT / "bench" / "results" / "attention_residual_cpu.md"), "the results file")
SIZES = flags.DEFINE_list("sizes", ["1024", "4096"], "T = S")
REPS = flags.DEFINE_integer("reps", 7, "timed runs per contender")


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    import numpy as np

    import moajax
    from moajax.timing import alternating, machine_line, write_results

    N, H = 8, 64
    lines = ["# Attention forward with jax.nn's residual (the rows' log-sum-exp) on the CPU", "", machine_line(),
             f"Run: `python scripts/bench_residual.py` — B = 1, N = {N}, H = {H}, float32, T = S, not causal; the four "
             f"contenders alternate in one process (each round starting one later), {REPS.value} timed runs each after "
             "a warm-up; best and median. The last column is each time over the same implementation's without "
             "the residual.", "",
             "| S | impl | best ms | median ms | temp MiB | ÷ without lse (best) | max rel. diff vs jax.nn |",
             "|---:|---|---:|---:|---:|---:|---|"]
    for S in (int(s) for s in SIZES.value):
        r = np.random.default_rng(S)
        q, k, v = (jnp.asarray(r.standard_normal((1, S, N, H)), jnp.float32) for _ in range(3))
        fns = {
            "moajax": jax.jit(lambda q, k, v: moajax.dot_product_attention(q, k, v)),
            "moajax, return_residual": jax.jit(lambda q, k, v: moajax.dot_product_attention(q, k, v,
                                                                                          return_residual=True)),
            "jax.nn": jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v)),
            "jax.nn, return_residual": jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v,
                                                                                          return_residual=True)),
        }
        ref = fns["jax.nn, return_residual"](q, k, v)
        times = alternating(fns, (q, k, v), reps=REPS.value)
        for name, f in fns.items():
            got = f(q, k, v)
            got = got if isinstance(got, tuple) else (got,)
            diff = ", ".join(f"{label} {float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))):.1e}"
                             for label, a, b in zip(("out", "lse"), got, ref))
            temp = f.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes / 2**20
            base = min(times[name.split(",")[0]])
            lines.append(f"| {S} | {name} | {1e3 * min(times[name]):.1f} | {1e3 * statistics.median(times[name]):.1f} "
                         f"| {temp:.1f} | {min(times[name]) / base:.2f} | {diff} |")
    write_results(OUT.value, lines + [""])


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    app.run(main)
