"""The gradient of attention with a relative-position table (score_mod) on the CPU.

score + table[clip(q_idx − kv_idx) + R/2]: the forward reads the table at a computed index (a
gather, ``dnf.selection``), the gradient adds every score's dS into its bin (a scatter-add,
``dnf.one_hot_write``). The contenders, alternated in one process (best and median):

- moajax, table gradient scatter-added (the XLA backend's lowering of the one-hot Σ);
- moajax, the table gradient binned by a loop over the entries (``Backend.bin_sum``: what the
  Pallas kernels do, Triton having no scatter into a block), on XLA;
- moajax, the same DNF lowered as written: the one-hot Σ over [entries, t, s] (the lowering
  before the scatter; ``dnf.one_hot_write`` switched off while that contender is traced);
- moajax without a score_mod (the floor: plain causal attention);
- moajax with the table materialised as a [1, 1, T, S] bias, its gradient summed into bins;
- jax.nn with that bias (XLA), its gradient through the gather by JAX's autodiff;
- moajax without the run-time test of the table (a jit argument, its values unseen while
  tracing): the kernel that takes the table finite, alone (before 2026-12-05: a −∞ in the
  table gave NaN or a wrong row), and the kernel with the masked fill, alone (what the test
  picks for a table holding ±∞: a mask on data, with the row guard's checks).

`python scripts/bench_score_mod.py` writes bench/results/score_mod_grad_cpu.md.

`python scripts/bench_score_mod.py --alibi` times ALiBi's per-head slopes instead (score −
slope[h]·|q_idx − kv_idx|, the slopes' gradient a Σ over the heads' one-hot write), writing
bench/results/alibi_grad_cpu.md: moajax; moajax with its slopes' two terms of dS walked apart
(``rules_patched.guarded_sums_apart``: the tree before 2026-12-07) and, recomputing the
statistics in the backward's kernels, with the keys walked outside the queries
(``rules_patched.row_walks_inside``); moajax without a score_mod (the floor); jax.nn with the
slopes as an [N, T, S] bias (XLA); causal and not, residuals "save", "recompute" and "none" (the
saving forward rerun in the backward, beside "recompute": what "none" ran before 2026-12-07);
then jit(value_and_grad) under "save", "none", "recompute" and ``jax.checkpoint`` of "save"
(the three that hold nothing between forward and backward).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = flags.DEFINE_string("out", str(ROOT / "bench" / "results" / "score_mod_grad_cpu.md"), "the results file")
SEQ = flags.DEFINE_list("seq", ["1024"], "sequence lengths (T = S)")
ENTRIES = flags.DEFINE_list("entries", ["9", "65"], "table sizes R")
REPS = flags.DEFINE_integer("reps", 3, "timed rounds")
ALIBI = flags.DEFINE_bool("alibi", False, "ALiBi's per-head slopes instead (bench/results/alibi_grad_cpu.md)")
FINITE = "moajax, one kernel: the table taken finite"
MASKED = "moajax, one kernel: the masked fill"


def _rows(rows, base_name: str, lead: str, untabled: str | None) -> list:
    """One table row per contender of ``compiled_contenders``' rows: best and median s, the
    best over ``base_name``'s, temp, the gradient's difference (``untabled`` for the
    contender without a score_mod; None: no such column)."""
    import numpy as np

    base = min(rows[base_name][0])
    return [f"| {lead} | {name} | {min(ts):.4f} | {float(np.median(ts)):.4f} | {min(ts) / base:.2f}× | {temp:.1f} |"
            + ("" if untabled is None else f" {untabled if name == 'moajax, no score_mod' else f'{diff:.1e}'} |")
            for name, (ts, temp, diff) in rows.items()]


def main(argv):
    del argv
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np

    import moajax
    from moajax import dnf as D
    from moajax import lower_xla
    from moajax.tiles.backend import Backend
    from moajax.timing import compiled_contenders, machine_line, one_score_mod_kernel, write_results

    if ALIBI.value:
        return alibi()
    B, N, H = 1, 8, 64
    lines = [f"# Attention gradient with a relative-position table (score_mod), CPU ({machine_line()})", "",
             "`python scripts/bench_score_mod.py` — jit(grad) w.r.t. q, k, v and the table; B = 1, N = 8, H = 64, "
             "causal, float32; score + table[clip(q_idx − kv_idx, −R/2, R/2) + R/2]. Contenders alternate in one "
             f"process; best and median of {REPS.value} rounds after a warm-up. 'bins by a loop': the table "
             "gradient binned one entry at a time (what the Pallas kernels do) on XLA; 'one-hot Σ': lowered as "
             "the DNF writes it (the lowering before the scatter), in the same run. The plan: dQ, dK + dV and "
             "the table's gradient (its Σ_s Σ_t walked in 256 × 256 tiles, the two terms of dS in one walk) "
             "are three kernels. The table is a jit argument: the default contenders compile two plans under a "
             "lax.cond that tests the table for ±∞ when it runs (the masked fill's kernel where it holds one); "
             "'one kernel': without that test, the table taken finite (the kernel before 2026-12-05) or "
             "with the masked fill (a mask on data). Temp: the compiled executable's temp allocation.", "",
             "| T = S | R | contender | best s | median s | vs scatter-add | temp MiB | max rel. diff of d table vs jax.nn |",
             "|---:|---:|---|---:|---:|---:|---:|---:|"]
    r = np.random.default_rng(0)
    for T in (int(x) for x in SEQ.value):
        q, k, v, g = (jnp.asarray(r.standard_normal((B, T, N, H)).astype(np.float32)) for _ in range(4))
        for R in (int(x) for x in ENTRIES.value):
            half = R // 2
            table = jnp.asarray(r.standard_normal(R).astype(np.float32))
            t_idx, s_idx = jnp.arange(T)[:, None], jnp.arange(T)[None, :]

            def relpos(q, k, v, tab):
                mod = lambda s, b, h, qi, ki: s + tab[jnp.clip(qi - ki, -half, half) + half]  # noqa: E731
                return jnp.sum(moajax.dot_product_attention(q, k, v, score_mod=mod, is_causal=True) * g)

            def as_bias(attend):
                def loss(q, k, v, tab):
                    bias = tab[jnp.clip(t_idx - s_idx, -half, half) + half][None, None]
                    return jnp.sum(attend(q, k, v, bias) * g)
                return loss

            def plain(q, k, v, tab):
                return jnp.sum(moajax.dot_product_attention(q, k, v, is_causal=True) * g)

            moa_bias = as_bias(lambda q, k, v, b: moajax.dot_product_attention(q, k, v, b, is_causal=True))
            nn_bias = as_bias(lambda q, k, v, b: jax.nn.dot_product_attention(q, k, v, b, is_causal=True,
                                                                               implementation="xla"))
            args = (q, k, v, table)
            losses = {"moajax, scatter-add": relpos, "moajax, bins by a loop": relpos, "moajax, one-hot Σ": relpos,
                      "moajax, no score_mod": plain, "moajax, [T, S] bias": moa_bias, "jax.nn, [T, S] bias": nn_bias,
                      FINITE: relpos, MASKED: relpos}
            # compiled ahead of time, each after clearing JAX's trace caches (the kernels are
            # lowered when traced): the loop contender with the Pallas kernels' binning, the
            # one-hot contender with the one-hot write not recognised
            fns = {}
            scatter_add, one_hot_write = lower_xla.XlaBackend.bin_sum, D.one_hot_write
            for name, loss in losses.items():
                lower_xla.XlaBackend.bin_sum = Backend.bin_sum if name == "moajax, bins by a loop" else scatter_add
                D.one_hot_write = (lambda v, body: None) if name == "moajax, one-hot Σ" else one_hot_write
                jax.clear_caches()
                # one kernel, no run-time test: the table taken finite, or taken to hold ±∞
                with (one_score_mod_kernel(masked=name == MASKED) if name in (FINITE, MASKED)
                      else contextlib.nullcontext()):
                    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(*args)
                if name.startswith("moajax, ") and loss is relpos and (
                        ("scatter" in lowered.as_text()) != (name in ("moajax, scatter-add", FINITE, MASKED))):
                    raise SystemExit(f"{name}: the lowering is not the one named")
                if loss is relpos and ("stablehlo.case" in lowered.as_text()) == (name in (FINITE, MASKED)):
                    raise SystemExit(f"{name}: the run-time test of the table is not as named")
                fns[name] = lowered.compile()
            lower_xla.XlaBackend.bin_sum, D.one_hot_write = scatter_add, one_hot_write
            rows = compiled_contenders(fns, args, reps=REPS.value, reference="jax.nn, [T, S] bias",
                                       pick=lambda grads: grads[3])
            lines += _rows(rows, "moajax, scatter-add", f"{T} | {R}", "— (no table)")
    lines += ["", "vs scatter-add: the contender's best time over the scatter-add's (above 1: slower)."]
    write_results(OUT.value, lines)


def alibi():
    """ALiBi's slopes (``--alibi``): the rule that walks the slopes' two terms of dS once
    against the tree before it, jax.nn with the slopes as a bias, each residual policy."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import moajax
    from moajax.timing import compiled_contenders, machine_line, write_results
    from rules_patched import forget, guarded_sums_apart, row_walks_inside

    B, N, H = 1, 8, 64
    lines = [f"# Attention gradient with ALiBi slopes (score_mod), CPU ({machine_line()})", "",
             "`python scripts/bench_score_mod.py --alibi` — jit(grad) w.r.t. q, k, v and the slopes; B = 1, N = 8, "
             "H = 64, float32; score − slope[h]·|q_idx − kv_idx|. Contenders alternate in one process; "
             f"best and median of {REPS.value} rounds after a warm-up. 'terms apart': the slopes' gradient with its "
             "two terms of dS (each under the head's one-hot write) walked in two passes, as before 2026-12-07 "
             "(`rewrites._one_guard_over_sums` patched out: `scripts/rules_patched.py`); 'row walks inside' (residuals "
             "\"recompute\"): the slopes' kernel walking the keys outside the queries, as the adjoint writes them, the "
             "rows' max, ℓ and Δ recomputed in every key tile, as before 2026-12-07 (`rewrites.row_walks_out` "
             "patched out); 'residuals recompute' (under \"none\"): nothing held, the backward's kernels recomputing "
             "the statistics, what \"none\" ran until 2026-12-07 (\"none\" now reruns the saving forward in the "
             "backward, then the adjoint reading what it saved); 'no score_mod': the same "
             "attention without slopes, the floor. Temp: the compiled executable's temp allocation. Diff: the slopes' "
             "gradient against jax.nn's. residuals: the policy asked for; \"save\" is the default's choice on this CPU.", "",
             "| T = S | causal | residuals | contender | best s | median s | vs moajax | temp MiB | max rel. diff of d slopes vs jax.nn |",
             "|---:|---|---|---|---:|---:|---:|---:|---:|"]
    def loss_of(g, causal, res, slopes_on=True):
        """sum(attention · g) as a function of q, k, v and the slopes (unused without them)."""
        def loss(q, k, v, sl):
            mod = (lambda s, b, h, qi, ki: s - sl[h] * jnp.abs(qi - ki)) if slopes_on else None  # noqa: E731
            return jnp.sum(moajax.dot_product_attention(q, k, v, score_mod=mod, is_causal=causal,
                                                        residuals=res) * g)
        return loss

    held = ["", "## Holding nothing between forward and backward: residuals \"none\", \"recompute\" or "
            "jax.checkpoint", "",
            "jit(value_and_grad) — the loss's value is used, so the forward runs — with the slopes, "
            "T = S as above: residuals \"save\" (the row statistics held for the backward), \"none\" "
            "(nothing held; the backward reruns the saving forward, then the saved adjoint), "
            "\"recompute\" (nothing held; the backward's kernels recompute the statistics: \"none\" until "
            "2026-12-07) and `jax.checkpoint` of the \"save\" call (nothing held either: what \"none\" "
            "now does, by JAX's rematerialisation). Best and median of the same rounds; temp: the "
            "compiled executable's temp allocation.", "",
            "| T = S | causal | contender | best s | median s | vs save | temp MiB |",
            "|---:|---|---|---:|---:|---:|---:|"]
    r = np.random.default_rng(0)
    for T in (int(x) for x in SEQ.value):
        q, k, v, g = (jnp.asarray(r.standard_normal((B, T, N, H)).astype(np.float32)) for _ in range(4))
        slopes = jnp.asarray(2.0 ** -np.arange(1, N + 1), jnp.float32)
        dist = jnp.abs(jnp.arange(T)[:, None] - jnp.arange(T)[None, :]).astype(jnp.float32)
        args = (q, k, v, slopes)
        for causal, res in ((True, "save"), (False, "save"), (True, "recompute"), (False, "recompute"),
                            (True, "none"), (False, "none")):
            moa = loss_of(g, causal, res)

            def nn(q, k, v, sl, causal=causal):
                bias = (-sl[:, None, None] * dist)[None]
                return jnp.sum(jax.nn.dot_product_attention(q, k, v, bias, is_causal=causal,
                                                            implementation="xla") * g)

            fns = {}
            before = {"save": ("moajax, terms apart", moa, guarded_sums_apart),
                      "recompute": ("moajax, row walks inside", moa, row_walks_inside),
                      "none": ("moajax, residuals recompute", loss_of(g, causal, "recompute"), None)}[res]
            for name, loss, ctx in (("moajax", moa, None), before,
                                    ("moajax, no score_mod", loss_of(g, causal, res, slopes_on=False), None),
                                    ("jax.nn, [N, T, S] bias", nn, None)):
                forget()
                with ctx() if ctx is not None else contextlib.nullcontext():
                    fns[name] = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(*args).compile()
            rows = compiled_contenders(fns, args, reps=REPS.value, reference="jax.nn, [N, T, S] bias",
                                       pick=lambda grads: grads[3])
            lines += _rows(rows, "moajax", f"{T} | {'yes' if causal else 'no'} | {res}", "— (no slopes)")
        for causal in (True, False):
            fns = {name: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3))).lower(*args).compile()
                   for name, f in (("save", loss_of(g, causal, "save")), ("none", loss_of(g, causal, "none")),
                                   ("recompute", loss_of(g, causal, "recompute")),
                                   ("jax.checkpoint of save", jax.checkpoint(loss_of(g, causal, "save"))))}
            rows = compiled_contenders(fns, args, reps=REPS.value, reference="save", pick=lambda out: out[1][3])
            held += _rows(rows, "save", f"{T} | {'yes' if causal else 'no'}", None)
    lines += ["", "vs moajax: the contender's best time over moajax's (above 1: slower)."] + held
    write_results(OUT.value if OUT.present else str(ROOT / "bench" / "results" / "alibi_grad_cpu.md"), lines)


if __name__ == "__main__":
    app.run(main)
