"""The CPU knob ``cpu_batches`` (a batch walk laid out with the batch axes, before the rows:
``Program.batch_walks``, ``tiles.ranges.var_order``) on the kernels whose schedules set it,
against the same ONFs laid out without it, in one process: each jit(grad) compiled twice (the
knob cleared in ``var_order`` for "off", after clearing JAX's caches), the two alternated;
best and median, the executables' temp memory, and whether XLA got the same HLO.

    python scripts/bench_cpu_batches.py [--reps 15] [--out bench/results/cpu_batches_cpu.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cpu_batches_cpu.md"))
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    import moajax
    import moajax.tiles.backend as backend
    import moajax.tiles.operands as operands
    import moajax.tiles.ranges as ranges
    from moajax.timing import alternating, machine_line, write_results

    r = np.random.default_rng(0)

    def a(*shape):
        return jnp.asarray(r.standard_normal(shape), jnp.float32)

    cases = {}
    q, k, v, g = a(1, 1024, 8, 64), a(1, 1024, 2, 64), a(1, 1024, 2, 64), a(1, 1024, 8, 64)
    for causal in (False, True):
        cases[f"GQA 8 over 2 heads, T = S = 1024{', causal' if causal else ''}"] = (jax.grad(
            lambda q, k, v, c=causal: jnp.sum(moajax.dot_product_attention(q, k, v, is_causal=c) * g),
            argnums=(0, 1, 2)), (q, k, v))
    T = 512
    q2, k2, v2, g2 = (a(1, T, 8, 64) for _ in range(4))

    def relpos(q, k, v, tab):
        mod = lambda s, b, h, qi, ki: s + tab[jnp.clip(qi - ki, -32, 32) + 32]  # noqa: E731
        return jnp.sum(moajax.dot_product_attention(q, k, v, score_mod=mod, is_causal=True) * g2)
    cases["relative-position table (65), T = S = 512, causal"] = (jax.grad(relpos, argnums=(0, 1, 2, 3)),
                                                                  (q2, k2, v2, a(65)))
    q3, k3, v3, g3 = (a(2, T, 8, 64) for _ in range(4))
    cases["[1, N, T, S] bias, B = 2, T = S = 512"] = (jax.grad(
        lambda q, k, v, b: jnp.sum(moajax.dot_product_attention(q, k, v, b) * g3), argnums=(0, 1, 2, 3)),
        (q3, k3, v3, a(1, 8, T, T)))
    cases["RMSNorm's weight, 256 rows of 2048"] = (jax.grad(
        lambda w, x: jnp.sum(jnp.sin(moajax.rms_norm(x, w)))), (a(2048), a(256, 2048)))
    B, Tq = 8, 128

    def shared_query(q, k, v):
        out = jax.vmap(lambda k, v: moajax.dot_product_attention(q, k, v, is_causal=True))(k, v)
        return jnp.sum(jnp.sin(out))
    cases["vmap over 8, query shared, causal, T = S = 128"] = (jax.grad(shared_query),
                                                             (a(Tq, 4, 64), a(B, Tq, 4, 64), a(B, Tq, 4, 64)))

    laid_out = ranges.var_order

    def without_knob(onf):
        if onf.knobs.cpu_batches:
            onf = onf.replace(knobs=dataclasses.replace(onf.knobs, cpu_batches=()))
        return laid_out(onf)

    def use(order):  # (the modules that imported it by name)
        ranges.var_order = backend.var_order = operands.var_order = order

    lines = ["# The CPU knob cpu_batches: a batch walk laid out with the batch axes", "", machine_line(),
             f"Run: `python scripts/bench_cpu_batches.py --reps {args.reps}` — float32 jit(grad); each kernel's ONFs "
             "as derived, lowered with the knob (on) and with it cleared in the layout (off), the two alternated in "
             "one process; best and median; temp: the executable's temp allocation.", "",
             "| case | off best ms | off median ms | on best ms | on median ms | off/on (best) | temp off → on MiB | same HLO |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, (fn, xs) in cases.items():
        compiled = {}
        for mode, order in (("off", without_knob), ("on", laid_out)):
            use(order)
            jax.clear_caches()
            compiled[mode] = jax.jit(fn).lower(*xs).compile()
        use(laid_out)
        times = alternating(compiled, xs, reps=args.reps)
        temp = {m: c.memory_analysis().temp_size_in_bytes / 2**20 for m, c in compiled.items()}
        same = compiled["off"].as_text() == compiled["on"].as_text()
        off, on = times["off"], times["on"]
        lines.append(f"| {name} | {min(off) * 1e3:.2f} | {statistics.median(off) * 1e3:.2f} | {min(on) * 1e3:.2f} | "
                     f"{statistics.median(on) * 1e3:.2f} | {min(off) / min(on):.2f}× | {temp['off']:.1f} → "
                     f"{temp['on']:.1f} | {'yes' if same else 'no'} |")
    write_results(args.out, lines)


if __name__ == "__main__":
    main()
