#!/usr/bin/env python3
"""The seed's third result as an experiment: γ. C was faster on the CPU for the MLP (1.2–1.85×),
Fortran on the GPU for the fused norm + MLP (1.45–2.81×); the gated-MLP backward showed a
3.165× gap at N = 1024. In MoA terms the two languages differ in γ, the layout function of
each operand: row-major (C) or column-major (F). Here γ is a schedule choice
(``Preset.of(gamma=...)``) on one DNF, so the two are compared with everything else fixed.

For the gated-MLP backward (the derived adjoint: d = 64, d_ff = 256, the seed's block) and the
attention forward (B = 2, one head, d = 64), every operand C against every operand F: the time
on this CPU (alternating, one process), the cost model's flops and bytes for each, and — with
the offline compiler (the ``gpu`` extra) — registers, shared memory and spills of each ONF's
kernels compiled to PTX for the A100 (sm_80).

    python scripts/sweep_gamma.py    # writes bench/results/gamma.md
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parent.parent
OUT = flags.DEFINE_string("out", str(ROOT / "bench" / "results" / "gamma.md"), "the results file")
TOKENS = flags.DEFINE_list("tokens", ["1024", "4096", "16384"], "MLP token counts")
ATTENTION_N = flags.DEFINE_list("attention_n", ["1024", "4096"], "attention sequence lengths")
REPS = flags.DEFINE_integer("reps", 5, "timed runs per contender")
PTX = flags.DEFINE_bool("ptx", True, "compile each ONF to PTX for sm_80 (needs the gpu extra)")


def _cases():
    """(label, n, dnf) of the kernels compared, float32."""
    import jax
    import numpy as np

    from moajax.kernels.attention import mha_kernel
    from moajax.kernels.mlp import swiglu

    S = lambda *s: jax.ShapeDtypeStruct(s, np.float32)  # noqa: E731
    out = []
    for n in map(int, TOKENS.value):
        specs = [S(n, 64), S(64, 256), S(64, 256), S(256, 64)]
        out.append(("gated-MLP backward", n, swiglu.adjoint(*specs).dnf(*specs, S(n, 64))))
    for n in map(int, ATTENTION_N.value):
        out.append(("attention forward", n, mha_kernel(None, None, False).dnf(*[S(2, n, 1, 64)] * 3)))
    return out


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    import numpy as np

    from moajax import cost, machines, ptx, runtime, schedule
    from moajax.schedule import Preset
    from moajax.timing import alternating, machine_line, write_results

    cpu, a100 = machines.local(), machines.load("delta-a100")
    reason = ptx.toolchain_missing() if PTX.value else "--noptx"
    lines = ["# γ: row-major (C) against column-major (F) operands, one DNF, everything else fixed", "",
             machine_line(),
             "Run: `python scripts/sweep_gamma.py` — float32; CPU times alternate in one process (best and median of "
             f"{REPS.value}); model = the cost model for this machine's profile (CPU) and the A100's (GPU); PTX: the "
             "A100 ONF's kernels compiled offline for sm_80 (max registers, total shared memory, spill bytes).", "",
             "| kernel | n | γ | CPU best ms | CPU median ms | C ÷ F (median) | model GFLOP | model MB (CPU) | "
             "model MB (A100) | A100 roofline µs | registers | smem B | spills B |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, n, dnf in _cases():
        r = np.random.default_rng(n)
        arrays = [jnp.asarray(r.standard_normal(i.shape), i.dtype) for i in dnf.inputs]
        order = tuple(o.name for o in dnf.outputs)
        fns, models, compiled = {}, {}, {}
        for g in ("C", "F"):
            pre = Preset.of(gamma={i.name: g for i in dnf.inputs})
            plan = schedule.derive_plan(dnf, cpu, pre)
            fns[g] = jax.jit(runtime.lowered(plan, "xla", order))
            onfs = plan if isinstance(plan, tuple) else (plan,)
            gplan = schedule.derive_plan(dnf, a100, pre)
            gonfs = gplan if isinstance(gplan, tuple) else (gplan,)
            models[g] = (cost.sequence(cost.estimate(o, cpu) for o in onfs),
                         cost.sequence(cost.estimate(o, a100) for o in gonfs))
            if reason is None:
                reps = [x for o in gonfs for x in ptx.onf_reports(o, "sm_80")]
                compiled[g] = (max(x.registers for x in reps), sum(x.smem_bytes for x in reps),
                               sum(x.spill_stores + x.spill_loads for x in reps))
        got = {g: f(*arrays) for g, f in fns.items()}
        diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(got["C"]), jax.tree.leaves(got["F"])))
        times = alternating(fns, arrays, reps=REPS.value)
        med = {g: statistics.median(ts) for g, ts in times.items()}
        for g in ("C", "F"):
            c_cpu, c_gpu = models[g]
            regs, smem, spills = compiled.get(g, ("—", "—", "—"))
            lines.append(f"| {label} | {n} | {g} | {1e3 * min(times[g]):.3g} | {1e3 * med[g]:.3g} | "
                         f"{med['C'] / med['F']:.2f} | {c_cpu.flops / 1e9:.3g} | {c_cpu.bytes_moved / 1e6:.3g} | "
                         f"{c_gpu.bytes_moved / 1e6:.3g} | {c_gpu.time_s * 1e6:.3g} | {regs} | {smem} | {spills} |")
        print(lines[-2], lines[-1], f"(max |C − F| = {diff:.1e})", sep="\n", flush=True)
    lines += ["", f"PTX: {'compiled' if reason is None else 'not compiled: ' + reason}.", ""]
    write_results(OUT.value, lines)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    app.run(main)
