"""How far a bfloat16 score_mod table's gradient is from float64 under each residual policy.

A table's gradient (ALiBi's slopes: Σ over rows and keys of dS × |i − j|) sums dS over whole
rows, where Σ_s dS = Σ_s P × (dP − Δ) is 0 only if Δ = +/(P × dP) for the backward's own P.
Under residuals "save" the backward reads Δ = +/(dO × O) from the saved Out (Δ-from-output);
on a GPU in bfloat16 the forward rounded P to bfloat16 for its dot with V, so that Δ is not the
backward's, and every row adds its mismatch. Under "recompute" (what "none" was until
2026-12-07: "none" now reruns the saving forward and reads Out) the backward computes Δ from its own
P. Cases: the H200's Pallas schedule run in interpret mode on the CPU ('pallas', the GPU's
16-bit dots) and the CPU's XLA kernels ('xla'), both on the same bfloat16 inputs, against
float64 (the XLA path on the inputs widened). Error: max |grad − grad64| over max |grad64|,
per argument. Nothing is timed.

`python scripts/precision_table_grad.py` writes bench/results/table_grad_precision.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from h200_interpret import on_the_h200s_schedule, relative_errors  # noqa: E402

OUT = flags.DEFINE_string("out", str(ROOT / "bench" / "results" / "table_grad_precision.md"), "the results file")


def rows(impls) -> list:
    """(case, slopes' dtype, query lengths, residuals, path, [error of slopes, dq, dk, dv, the slopes' floor])
    per case, policy and
    implementation in ``impls`` ("pallas" on a GPU; "pallas_interpret" runs the schedule
    ``runtime.gpu_machine`` gives on the CPU; "xla"), against float64 (XLA on the widened
    inputs; jax_enable_x64 must be on)."""
    import itertools

    import jax
    import jax.numpy as jnp
    import numpy as np

    import moajax
    from moajax.schedule import Preset

    out = []
    r = np.random.default_rng(1)
    for T, S, H in ((30, 2, 8), (64, 64, 32)):
        q = jnp.asarray(r.normal(size=(1, T, 8, H)), jnp.bfloat16)
        k, v = (jnp.asarray(r.normal(size=(1, S, 4, H)), jnp.bfloat16) for _ in range(2))
        w = jnp.asarray(r.normal(size=(1, T, 8, H)), jnp.float32)
        drawn = r.uniform(0.05, 0.5, size=8)
        for sdt, lengths, res in itertools.product(("float32", "bfloat16"), (None, jnp.asarray([T * 17 // 30], jnp.int32)),
                                                   ("save", "recompute", "jax.nn")):
            slopes = jnp.asarray(drawn, sdt)
            at = jnp.abs(jnp.arange(T)[:, None] - jnp.arange(S)[None, :])

            def nn_loss(slopes, q, k, v, impl, lengths=lengths):
                # jax.nn with the same scores: the bias −slope[h]·|i − j| in the slopes' dtype
                bias = (-slopes[:, None, None] * at.astype(slopes.dtype))[None]
                o = jax.nn.dot_product_attention(q, k, v, bias=bias, query_seq_lengths=lengths, implementation=impl)
                return jnp.sum(o.astype(w.dtype) * w)

            def loss(slopes, q, k, v, impl, res="recompute" if res == "jax.nn" else res, lengths=lengths):
                mod = lambda s, b, h, i, j: s - slopes[h] * jnp.abs(i - j)  # noqa: E731
                o = moajax.dot_product_attention(q, k, v, score_mod=mod, query_seq_lengths=lengths,
                                                 implementation=impl, onf=Preset.of(residuals=res))
                return jnp.sum(o.astype(w.dtype) * w)

            grad = jax.grad(loss, argnums=(0, 1, 2, 3))
            want = grad(*(x.astype(jnp.float64) for x in (slopes, q, k, v)), "xla")
            if res == "jax.nn":  # (its own float64 agrees with moajax's to 1e-12 or so)
                grad, impls_ = jax.grad(nn_loss, argnums=(0, 1, 2, 3)), ("xla",)
            else:
                impls_ = impls
            for impl in impls_:
                got = jax.jit(grad, static_argnums=4)(slopes, q, k, v, impl)
                errs = relative_errors(got, want)
                # the floor: the float64 slopes' gradient rounded to the slopes' dtype
                floor = float(jnp.max(jnp.abs(want[0].astype(sdt).astype(jnp.float64) - want[0])) / jnp.max(jnp.abs(want[0])))
                out.append((f"{T}, {S}, {H}", sdt, "—" if lengths is None else str(int(lengths[0])),
                            "—" if res == "jax.nn" else res,
                            "jax.nn" if res == "jax.nn" else impl.replace("_interpret", ""), errs + [floor]))
    return out


def main(argv):
    del argv
    on_the_h200s_schedule()
    from moajax.timing import machine_line, write_results

    lines = [f"# A bfloat16 score_mod table's gradient against float64 ({machine_line()})", "",
             "`python scripts/precision_table_grad.py` — attention with ALiBi slopes (float32 or bfloat16, closed over: "
             "score − slope[h]·|i − j|), bfloat16 q, k, v [1, T, 8, H] and [1, S, 4, H] (GQA), the loss "
             "sum(out × w); error = max |grad − float64's| over max |float64's|. 'pallas': the H200's Pallas "
             "schedule in interpret mode (16-bit dots); 'xla': the CPU's kernels. Nothing is timed. On a GPU, "
             "`scripts/gpu_check.py` section 7 runs the same rows on the device.", "",
             "| T, S, H | slopes | query lengths | residuals | path | slopes' gradient | dq | dk | dv | its floor |",
             "|---|---|---|---|---|---:|---:|---:|---:|---:|"]
    for case, sdt, lengths, res, path, errs in rows(("pallas_interpret", "xla")):
        lines.append(f"| {case} | {sdt} | {lengths} | {res} | {path} | " + " | ".join(f"{e:.1e}" for e in errs) + " |")
    lines += ["", "'jax.nn': jax.grad of jax.nn.dot_product_attention (XLA) with the same scores, the bias "
              "−slope[h]·|i − j| computed in the slopes' dtype (no residuals to choose). 'its floor': the float64 "
              "slopes' gradient rounded to the slopes' dtype, against itself.", "",
              "The slopes' gradient sums dS × |i − j| over rows and keys, where Σ_s dS = 0 in every row: it is the "
              "small difference of large sums. Three changes of 2026-12-06 keep it there:",
              "- the adjoint carries each cotangent in the widest dtype that reached it and rounds it once "
              "(`moajax.adjoint`): before, the two paths into the bfloat16 product slope × |i − j| (through a row's "
              "numerator and through its sum) were each rounded to bfloat16 at the cast back to float32 and "
              "summed in bfloat16 apart — 1.2e-1 (save, xla) and 1.2e-1 (none, pallas) at 30, 2, 8;",
              "- a Pallas multiply-and-sum (a contraction no tensor core takes: its operands share a variable) "
              "takes its float32 factor unrounded (`pallas_kernels/lower.py`); rounded to bfloat16 for the "
              "16-bit dots, per term, the 'save' pallas row at 30, 2, 8 was 8.7e-2 with the other two changes alone (an ad hoc run);",
              "- after a forward whose dots round (a GPU's 16-bit dots, P to 2⁻⁹; not TF32, not measured), a "
              "gradient summing Δ over rows and keys recomputes Δ rather than read it from Out "
              "(`identities._summed_over_rows_and_keys`), as a float32 gradient beside a bfloat16 Out already did "
              "(5.1e-2 → 1.1e-3 at 30, 2, 8 before this). dq and dk read Δ from Out, as FlashAttention-2's "
              "backward does. On a CPU the forward's float32 Out is read by every gradient (XLA's dots round only "
              "their sums): the 'xla' rows read it, the 'pallas' rows (the GPU's schedule) recompute.",
              "Before these, the bfloat16-slopes rows were (slopes' gradient): 30, 2, 8 — save pallas 2.6e-1, save "
              "xla 1.2e-1, none pallas 1.2e-1, none xla 2.1e-3; with lengths 4.9e-1, 1.3e-1, 3.5e-2, 5.8e-3; 64, 64, "
              "32 — 1.3e-2, 7.8e-3, 8.9e-3, 2.6e-3; with lengths 1.9e-2, 9.1e-3, 1.9e-2, 8.1e-3 (\"none\" then: what "
              "\"recompute\" is since 2026-12-07, when \"none\" began to rerun the saving forward)."]
    write_results(OUT.value, lines)


if __name__ == "__main__":
    app.run(main)
