"""Does a GPU's TF32 forward spoil a score_mod table's gradient that reads Δ from its Out?

A table's gradient (ALiBi's slopes, a relative-position table) sums dS = P × (dP − Δ) over
rows and keys, where Σ_s dS = 0 in every row only if Δ = +/(P × dP) for the backward's own P.
After a 16-bit forward moajax recomputes Δ for such a gradient (``Kernel.gpu_dots_round``:
Out's P was rounded to 2⁻⁹, 1.6e-1 off on ALiBi's bfloat16 slopes, an ad hoc run). A
float32 forward on a GPU takes TF32 dots under JAX's default (P and V to 10 mantissa bits),
and the gradient reads Δ from its Out: is that good to TF32's own error?

No GPU here: the H200's Pallas schedule runs in interpret mode on the CPU with its float32
dots' operands cut to TF32 (``PallasBackend.interpret_tf32``: "truncated", what a tensor
core given float32 registers does, or "rounded" to nearest). Paths: 'reads Out' (what a GPU
runs: residuals "save", Δ = +/(dO × O)); 'recomputes Δ' (the same with TF32 counted as
rounding: ``gpu_dots_round`` made True); 'none' (residuals "recompute", which recompute
every statistic in the backward's kernels: what "none" was until 2026-12-07); 'xla' (the CPU's
kernels, IEEE float32: the float32 floor). Error: max |grad − float64's| over max
|float64's|, per argument; float64 is the XLA path on the inputs widened. Nothing is timed.

`python scripts/precision_tf32_table_grad.py` writes bench/results/table_grad_precision_tf32.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from h200_interpret import on_the_h200s_schedule, relative_errors  # noqa: E402
from rules_patched import forget  # noqa: E402

OUT = flags.DEFINE_string("out", str(ROOT / "bench" / "results" / "table_grad_precision_tf32.md"), "the results file")
CASES = (  # (T = S, H, causal, query lengths as a fraction of T or None, score_mod)
    (64, 32, False, None, "alibi"), (64, 32, False, 17 / 30, "alibi"),
    (256, 64, False, None, "alibi"), (256, 64, False, 17 / 30, "alibi"), (512, 64, True, None, "alibi"),
    (256, 64, False, None, "relpos"), (512, 64, True, None, "relpos"))
PATHS = (("reads Out", "pallas_interpret", "save", None), ("recomputes Δ", "pallas_interpret", "save", True),
         ("none", "pallas_interpret", "recompute", None))


def rows() -> list:
    """(case, tf32 mode, path, [error of the table's gradient, dq, dk, dv]) per case, TF32
    mode and path, and the 'xla' row per case (jax_enable_x64 must be on)."""
    import importlib

    import jax
    import jax.numpy as jnp
    import numpy as np

    import moajax
    from moajax.kernel import Kernel
    from moajax.schedule import Preset

    backend = importlib.import_module("pallas_kernels.lower").PallasBackend
    rounds = Kernel.gpu_dots_round
    out = []
    r = np.random.default_rng(1)
    for T, H, causal, frac, mod_name in CASES:
        q = jnp.asarray(r.normal(size=(1, T, 8, H)), jnp.float32)
        k, v = (jnp.asarray(r.normal(size=(1, T, 4, H)), jnp.float32) for _ in range(2))
        w = jnp.asarray(r.normal(size=(1, T, 8, H)), jnp.float32)
        table = jnp.asarray(r.uniform(0.05, 0.5, size=8) if mod_name == "alibi" else r.normal(size=(8, 17)),
                            jnp.float32)
        lengths = None if frac is None else jnp.asarray([int(T * frac)], jnp.int32)

        def loss(table, q, k, v, impl, res):
            if mod_name == "alibi":
                mod = lambda s, b, h, i, j: s - table[h] * jnp.abs(i - j)  # noqa: E731
            else:  # a relative-position table of 17 offsets per head
                mod = lambda s, b, h, i, j: s + table[h, jnp.clip(i - j, -8, 8) + 8]  # noqa: E731
            o = moajax.dot_product_attention(q, k, v, score_mod=mod, is_causal=causal, query_seq_lengths=lengths,
                                             implementation=impl, onf=Preset.of(residuals=res))
            return jnp.sum(o * w)

        case = f"{T}, {H}, {mod_name}" + (", causal" if causal else "") + ("" if lengths is None else f", lengths {int(lengths[0])}")
        grad = jax.grad(loss, argnums=(0, 1, 2, 3))
        want = grad(*(x.astype(jnp.float64) for x in (table, q, k, v)), "xla", "recompute")

        def errors(impl, res):
            got = jax.jit(grad, static_argnums=(4, 5))(table, q, k, v, impl, res)
            return relative_errors(got, want)

        forget()
        out.append((case, "—", "xla (IEEE float32)", errors("xla", "save")))
        for mode in ("truncated", "rounded"):
            for label, impl, res, force in PATHS:
                backend.interpret_tf32 = mode
                Kernel.gpu_dots_round = rounds if force is None else (lambda self, key, options: True)
                forget()
                try:
                    out.append((case, mode, label, errors(impl, res)))
                finally:
                    backend.interpret_tf32, Kernel.gpu_dots_round = None, rounds
                print(out[-1], flush=True)
    return out


def main(argv):
    del argv
    on_the_h200s_schedule()
    from moajax import compat
    from moajax.timing import machine_line, write_results

    assert compat.default_dot_precision() == "tensorfloat32", "JAX's default matmul precision was changed"
    lines = [f"# A float32 score_mod table's gradient after a TF32 forward, against float64 ({machine_line()})", "",
             "`python scripts/precision_tf32_table_grad.py` — attention with a score_mod table closed over (ALiBi's "
             "slopes, score − slope[h]·|i − j|, or a relative-position table of 17 offsets per head, score + "
             "table[h, clip(i − j, −8, 8) + 8]), float32 q [1, T, 8, H], k and v [1, T, 4, H] (GQA), the loss "
             "sum(out × w); error = max |grad − float64's| over max |float64's|. The H200's Pallas schedules run "
             "in interpret mode with their float32 dots' operands cut to TF32 (`PallasBackend.interpret_tf32`): "
             "'truncated' (13 low bits dropped, as a tensor core given float32 registers does) or 'rounded' (to "
             "nearest). No GPU ran this: it is an emulation of the dots' inputs; the sums are the CPU's float32. "
             "Nothing is timed.", "",
             "| T = S, H, score_mod | TF32 | path | table's gradient | dq | dk | dv |", "|---|---|---|---:|---:|---:|---:|"]
    got = rows()
    for case, mode, path, errs in got:
        lines.append(f"| {case} | {mode} | {path} | " + " | ".join(f"{e:.1e}" for e in errs) + " |")
    lines.append("")
    for mode in ("truncated", "rounded"):
        table = {p: [e[0] for _, m, q, e in got if m == mode and q == p] for p, *_ in PATHS}
        others = max(x for _, m, _, e in got if m == mode for x in e[1:])
        ratio = max(a / b for a, b in zip(table["reads Out"], table["recomputes Δ"]))
        lines.append(f"- {mode}: the table's gradient reading Out {min(table['reads Out']):.1e} to "
                     f"{max(table['reads Out']):.1e}, recomputing Δ {min(table['recomputes Δ']):.1e} to "
                     f"{max(table['recomputes Δ']):.1e} (reading Out at most {ratio:.1f}× recomputing), residuals "
                     f"\"recompute\" {min(table['none']):.1e} to {max(table['none']):.1e}; dq, dk and dv of the "
                     f"same runs up to {others:.1e}.")
    lines += ["", "'reads Out': what a GPU runs for a float32 forward (residuals \"save\"; Δ = +/(dO × O) read from "
              "the saved Out, TF32 not counted as rounding by `Kernel.gpu_dots_round`); 'recomputes Δ': the same "
              "with TF32 counted (Δ = +/(P × dP) from the backward's own P); 'none': residuals \"recompute\" "
              "(\"none\" until 2026-12-07, which now reruns the saving forward); 'xla': the CPU's kernels in IEEE "
              "float32, the floor without TF32."]
    write_results(OUT.value, lines)


if __name__ == "__main__":
    app.run(main)
