"""What carrying cotangents in the widest dtype that reached them costs and buys, on the CPU.

Since 2026-12-06 ``moajax.adjoint`` keeps a cotangent in the widest dtype that reached it and
rounds it once, to the dtype of the array asked for; before, each widening cast (bfloat16 →
float32) rounded the cotangent passing back through it. This script derives both in one
process — 'carried' as the library does, 'rounded at each cast' with ``adjoint.joined``
patched to give the narrower operand's dtype (the old rule) — and times jit(grad) of each
alternately, with the gradients' error against float64 (the same call on the inputs widened):

- the pre-norm transformer block (``moajax.transformer_block``), bfloat16 x and weights,
  T = 1024, D = 512, 8 heads of 64, F = 1408, causal; gradients w.r.t. x and every weight;
- attention with bfloat16 ALiBi slopes (closed over, score − slope[h]·|i − j|), bfloat16 q, k,
  v [1, 1024, 8, 64], causal; gradients w.r.t. q, k, v and the slopes.

Error: per gradient, max |grad − float64's| over max |float64's|; the table shows the largest
over the weights (block) or q, k, v, and the slopes' apart.

`python scripts/bench_carried_cotangents.py` writes bench/results/carried_cotangents_cpu.md.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from rules_patched import forget  # noqa: E402

OUT = flags.DEFINE_string("out", str(ROOT / "bench" / "results" / "carried_cotangents_cpu.md"), "the results file")
REPS = flags.DEFINE_integer("reps", 5, "timed rounds")
TOKENS = flags.DEFINE_integer("tokens", 1024, "T (= S)")


def main(argv):
    del argv
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np

    jax.config.update("jax_enable_x64", True)
    import moajax
    from moajax import adjoint
    from moajax.timing import alternating, machine_line, write_results
    from plain_block import block_params

    T, D, N, H, F = TOKENS.value, 512, 8, 64, 1408
    r = np.random.default_rng(0)
    p = block_params(r, D, N, H, F, jnp.bfloat16)
    x = jnp.asarray(r.standard_normal((1, T, D)), jnp.bfloat16)
    gb = jnp.asarray(r.standard_normal((1, T, D)), jnp.float32)

    def block_loss(p, x):
        return jnp.sum(moajax.transformer_block(p, x, is_causal=True).astype(gb.dtype) * gb)

    q, k, v = (jnp.asarray(r.standard_normal((1, T, N, H)), jnp.bfloat16) for _ in range(3))
    ga = jnp.asarray(r.standard_normal((1, T, N, H)), jnp.float32)
    slopes = jnp.asarray(r.uniform(0.05, 0.5, size=N), jnp.bfloat16)

    def alibi_loss(q, k, v, slopes):
        mod = lambda s, b, h, i, j: s - slopes[h] * jnp.abs(i - j)  # noqa: E731
        return jnp.sum(moajax.dot_product_attention(q, k, v, score_mod=mod, is_causal=True).astype(ga.dtype) * ga)

    cases = {"block": (block_loss, (p, x), (0, 1)), "ALiBi attention": (alibi_loss, (q, k, v, slopes), (0, 1, 2, 3))}
    rule = adjoint.joined
    old = lambda a, b: np.dtype(b)  # noqa: E731 — a cast's operand's dtype: rounded at each cast
    lines = [f"# Cotangents carried wide or rounded at each cast, CPU ({machine_line()})", "",
             __doc__.split("\n\n", 1)[1].split("`python")[0].strip(), "",
             "| case | contender | best s | median s | vs carried | temp MiB | max error, the other gradients | "
             "error, slopes |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for case, (loss, args, argnums) in cases.items():
        grad = jax.grad(loss, argnums=argnums)
        forget()
        want = grad(*jax.tree.map(lambda a: a.astype(jnp.float64), args))
        fns, errs = {}, {}
        for name, joined in (("carried", rule), ("rounded at each cast", old)):
            adjoint.joined = joined
            forget()
            try:
                fns[name] = jax.jit(grad).lower(*args).compile()
                got = fns[name](*args)
            finally:
                adjoint.joined = rule
            e = [float(jnp.max(jnp.abs(a.astype(jnp.float64) - b)) / jnp.max(jnp.abs(b)))
                 for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))]
            errs[name] = (max(e[:-1]), e[-1]) if case != "block" else (max(e), None)
        times = alternating(fns, args, reps=REPS.value)
        base = min(times["carried"])
        for name, ts in times.items():
            temp = fns[name].memory_analysis().temp_size_in_bytes / 2**20
            main_err, slope_err = errs[name]
            lines.append(f"| {case} | {name} | {min(ts):.4f} | {statistics.median(ts):.4f} | {min(ts) / base:.2f}× | "
                         f"{temp:.1f} | {main_err:.1e} | {'—' if slope_err is None else f'{slope_err:.1e}'} |")
    lines += ["", "vs carried: the contender's best time over the carried one's (above 1: slower). On a CPU the "
              "saving forward's Out is read by the slopes' gradient either way (``Kernel.gpu_dots_round``: only "
              "after a GPU's 16-bit dots does it recompute Δ)."]
    write_results(OUT.value, lines)


if __name__ == "__main__":
    app.run(main)
