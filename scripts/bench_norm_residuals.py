"""What RMSNorm and the gated MLP keep for jax.grad, and what it costs, on the CPU.

Per case (kernel, sizes, dtype), the residual policies alternated in one process:
jit(grad) of sum(f(x, …) × g) w.r.t. every input, best and median; the compiled executable's
temp allocation; and what the pullback holds (``jax.vjp``'s residuals, the inputs included):
the arrays a training step keeps from the forward to the backward.

What it watches: a saving forward writes only the statistics its backward reads
(``Kernel.statistics_read``). In bfloat16 the statistics of RMSNorm and SwiGLU include their
float32 value before rounding, an [n d] array that neither adjoint reads; until 2026-12-06
"save" (and SwiGLU's labels) held it, and "auto" refused to save at all.

`python scripts/bench_norm_residuals.py` writes bench/results/norm_residuals_cpu.md.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = flags.DEFINE_string("out", str(ROOT / "bench" / "results" / "norm_residuals_cpu.md"), "the results file")
REPS = flags.DEFINE_integer("reps", 9, "timed rounds")
NOTE = flags.DEFINE_string("note", "", "a line under the title (what tree ran)")


def main(argv):
    del argv
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np

    import moajax
    from moajax.timing import alternating, machine_line, write_results

    lines = [f"# What RMSNorm and the gated MLP keep for jax.grad, on the CPU ({machine_line()})", ""]
    if NOTE.value:
        lines += [NOTE.value, ""]
    lines += ["`python scripts/bench_norm_residuals.py` — jit(grad) of sum(f(…) × g) w.r.t. every input under each "
              f"residual policy; the policies alternate in one process, best and median of {REPS.value} rounds "
              "after a warm-up. Temp: the compiled executable's temp allocation. Held: the bytes of what "
              "`jax.vjp`'s pullback keeps (its residuals, the inputs included). Diff: max |grad − grad under "
              "'none'| over max |grad under 'none'|, over the gradients.", "",
              "| case | residuals | best s | median s | vs none (best) | temp MiB | held MiB | diff vs none |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    r = np.random.default_rng(0)
    cases = [("rms_norm", (4096, 1024)), ("rms_norm", (4096, 4096)), ("gated_mlp", (2048, 512, 1408))]
    for dt in (jnp.bfloat16, jnp.float32):
        for name, sizes in cases:
            if name == "rms_norm":
                n, d = sizes
                args = (r.standard_normal((n, d)), 1 + 0.1 * r.standard_normal(d))
                fn, policies = moajax.rms_norm, ("auto", "none", "save")
            else:
                n, d, f = sizes
                args = (r.standard_normal((n, d)), *(r.standard_normal(s) / np.sqrt(s[0]) for s in ((d, f), (d, f), (f, d))))
                fn, policies = moajax.gated_mlp, ("auto", "none", "save", ("gate",))
            args = tuple(jnp.asarray(a, dt) for a in args)
            g = jnp.asarray(r.standard_normal(args[0].shape), dt)
            argnums = tuple(range(len(args)))

            def loss(res):
                return lambda *a: jnp.sum((fn(*a, residuals=res) * g).astype(jnp.float32))

            fns = {res: jax.jit(jax.grad(loss(res), argnums=argnums)).lower(*args).compile() for res in policies}
            held = {}
            for res in policies:
                _, pullback = jax.vjp(lambda *a, res=res: fn(*a, residuals=res), *args)
                held[res] = sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(pullback)) / 2**20
            want = [np.asarray(x, np.float64) for x in fns["none"](*args)]
            diff = {res: max(float(np.max(np.abs(np.asarray(a, np.float64) - w)) / np.max(np.abs(w)))
                             for a, w in zip(fns[res](*args), want)) for res in policies}
            times = alternating({str(res): f for res, f in fns.items()}, args, reps=REPS.value)
            base = min(times["none"])
            label = f"{name} {np.dtype(dt).name} " + " × ".join(str(s) for s in sizes)
            for res in policies:
                ts = times[str(res)]
                temp = fns[res].memory_analysis().temp_size_in_bytes / 2**20
                lines.append(f"| {label} | {res if isinstance(res, str) else repr(res)} | {min(ts):.4f} | "
                             f"{float(np.median(ts)):.4f} | {min(ts) / base:.2f}× | {temp:.1f} | {held[res]:.1f} | "
                             f"{diff[res]:.1e} |")
    lines += ["", "Sizes: rms_norm n × d; gated_mlp n × d × d_ff. 'auto' decides by the cost model's flops "
              "(`Kernel._saving_pays`), not by time or memory."]
    write_results(OUT.value, lines)


if __name__ == "__main__":
    app.run(main)
