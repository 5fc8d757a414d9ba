#!/usr/bin/env python3
"""Stage or recompute: the owner plan's two forms on this CPU, beside the fused kernel.

Where a plan's kernels would each recompute a value they share, ``schedule.staged_parts``
computes it once in a first kernel and writes it to memory (the MLP backward's U, V, G_H;
RMSNorm's RMS; attention's QKᵀ and dO Vᵀ beside a [t s] bias), ``schedule.split_outputs``
lets each kernel recompute it. ``schedule.derive_plan`` chooses between them by the cost
model's time (``schedule._owner_plan``), then between that plan and the fused kernel. Here
each adjoint kernel (what ``jax.grad`` runs after the forward) runs under the three plans,
lowered for XLA, alternating in one process: best and median of the rounds, the compiled
executable's temp memory, and the plan ``derive_plan`` picks. Until 2026-12-05 a CPU staged
wherever the value fitted the size budget.

    python scripts/bench_staging.py            # bench/results/staging_cpu.md
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = flags.DEFINE_string("out", str(ROOT / "bench" / "results" / "staging_cpu.md"), "the results file")
REPS = flags.DEFINE_integer("reps", 5, "timed rounds")


def _cases():
    """(label, the adjoint's DNF, its arguments) for each case."""
    import jax
    import numpy as np

    from moajax.kernels.attention import mha_kernel
    from moajax.kernels.mlp import swiglu
    from moajax.kernels.norm import rmsnorm

    r = np.random.default_rng(0)
    S = lambda *s: jax.ShapeDtypeStruct(s, np.float32)  # noqa: E731
    for T in (1024, 2048):
        x = S(1, T, 8, 64)
        adj, specs = mha_kernel("b n t s", None, False).saved_adjoint(x, x, x, S(1, 8, T, T), is_causal=True)
        dnf = adj.dnf(*specs, is_causal=True)
        # the saved row sums positive, as a forward gives them
        args = [r.standard_normal(i.shape).astype(np.float32) + (3.0 if i.name == "saved1" else 0.0)
                for i in dnf.inputs]
        yield f"attention, causal, [1 8 T S] bias, T = S = {T}", dnf, args
    for n, d, f in ((1024, 64, 256), (4096, 512, 1408)):
        for name, kern, specs in (("SwiGLU", swiglu, [S(n, d), S(d, f), S(d, f), S(f, d)]),
                                  ("RMSNorm", rmsnorm, [S(n, d), S(d)])):
            dnf = kern.adjoint(*specs).dnf(*specs, S(n, d))
            args = [r.standard_normal(i.shape).astype(np.float32) for i in dnf.inputs]
            yield f"{name}, n = {n}, d = {d}" + (f", d_ff = {f}" if name == "SwiGLU" else ""), dnf, args


def main(argv):
    del argv
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from moajax import machines, runtime, schedule, timing

    m = machines.local()
    lines = [f"# Stage or recompute: the owner plan's two forms beside the fused kernel ({timing.machine_line()})", "",
             "`python scripts/bench_staging.py` — the adjoint kernel alone (what `jax.grad` runs after the "
             "forward), float32, lowered for XLA under each plan: fused (one kernel), owner staged (a first kernel "
             "writes the values the others share to memory, `schedule.staged_parts`), owner recomputing "
             "(`schedule.split_outputs`). Contenders alternate in one process; best and median of "
             f"{REPS.value} rounds. Temp: the compiled executable's. Picked: `schedule.derive_plan`'s plan "
             "(before 2026-12-05 a CPU took the staged form wherever it fitted).", "",
             "| case | plan | kernels | best s | median s | vs picked (median) | temp MiB | picked |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for label, dnf, args in _cases():
        groups = schedule.plan_groups(dnf, "owner", m)
        plans = {"fused": (schedule.derive(dnf, m),),
                 "owner staged": tuple(schedule.derive(d, m) for d in schedule.staged_parts(dnf, groups)),
                 "owner recomputing": tuple(schedule.derive(d, m) for d in schedule.split_outputs(dnf, groups))}
        chosen = schedule.derive_plan(dnf, m)
        chosen = chosen if isinstance(chosen, tuple) else (chosen,)
        order = tuple(o.name for o in dnf.outputs)
        fns = {n: jax.jit(runtime.lowered(p if len(p) > 1 else p[0], "xla", order if len(p) > 1 else None))
               for n, p in plans.items()}
        temps = {n: f.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20 for n, f in fns.items()}
        times = timing.alternating(fns, args, reps=REPS.value)
        picked = next(n for n, p in plans.items() if p == chosen)
        base = statistics.median(times[picked])
        for n, ts in times.items():
            lines.append(f"| {label} | {n} | {len(plans[n])} | {min(ts):.4f} | {statistics.median(ts):.4f} | "
                         f"{statistics.median(ts) / base:.2f}× | {temps[n]:.1f} | {'yes' if n == picked else ''} |")
            print(lines[-1], flush=True)
    lines += ["", "vs picked: the plan's median time over the picked plan's (above 1: slower).", "",
              "## jit(grad) with a bias, beside jax.nn", "",
              "`jax.grad` of sum(attention × g) w.r.t. q, k, v and a [1 8 T S] bias, causal, B = 1, N = 8, H = 64, "
              "float32: moajax's default plan (the saving forward, then the picked adjoint above) and jax.nn's XLA "
              "path, alternating in one process.", "",
              "| T = S | contender | best s | median s | vs jax.nn (median) | temp MiB |", "|---:|---|---:|---:|---:|---:|"]
    import jax.numpy as jnp
    import numpy as np

    import moajax

    for T in (1024, 2048):
        r = np.random.default_rng(1)
        q, k, v, g = (jnp.asarray(r.standard_normal((1, T, 8, 64)), jnp.float32) for _ in range(4))
        bias = jnp.asarray(r.standard_normal((1, 8, T, T)), jnp.float32)
        losses = {"moajax": lambda *a: jnp.sum(moajax.dot_product_attention(*a, is_causal=True) * g),
                  "jax.nn": lambda *a: jnp.sum(jax.nn.dot_product_attention(*a, is_causal=True,
                                                                            implementation="xla") * g)}
        fns = {n: jax.jit(jax.grad(f, argnums=(0, 1, 2, 3))).lower(q, k, v, bias).compile() for n, f in losses.items()}
        rows = timing.compiled_contenders(fns, (q, k, v, bias), reps=REPS.value, reference="jax.nn",
                                          pick=lambda grads: grads[3])
        base = statistics.median(rows["jax.nn"][0])
        for n, (ts, temp, _) in rows.items():
            lines.append(f"| {T} | {n} | {min(ts):.4f} | {statistics.median(ts):.4f} | "
                         f"{statistics.median(ts) / base:.2f}× | {temp:.1f} |")
            print(lines[-1], flush=True)
    timing.write_results(OUT.value, lines)


if __name__ == "__main__":
    app.run(main)
