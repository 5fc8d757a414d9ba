"""Document masking on the CPU, written four ways: what a −∞ from a score_mod costs.

Each query attends to the keys of its own document (causal): doc[q_idx] = doc[kv_idx]. The
contenders, jit(grad) w.r.t. q, k and v, alternated in one process (best and median):

- moajax, score_mod ``where(doc[i] = doc[j], s, −∞)`` — FlexAttention's way. The kernel maps
  the −∞ to jax.nn's fill (a select per score, and its cotangent in the backward), since a
  row with no finite score would otherwise be NaN (``trace.may_be_infinite``);
- moajax, the same score_mod with a finite fill (``finfo(float32).min``): no select, the
  kernels before the −∞ mapping (the difference is the select's cost; until the rows'
  statistics guarded the skips beside a mask on data, ``onf.RowGuard``, 2026-12-05, it was
  also the causal skips the −∞ form gave up: 1.24–1.27× then);
- moajax with the mask materialised as a bool [B, 1, T, S] ``mask``;
- jax.nn with that mask (XLA).

`python scripts/bench_masks.py` writes bench/results/masks_cpu.md.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = flags.DEFINE_string("out", str(ROOT / "bench" / "results" / "masks_cpu.md"), "the results file")
SEQ = flags.DEFINE_list("seq", ["1024", "2048"], "sequence lengths (T = S)")
DOCS = flags.DEFINE_integer("docs", 4, "documents per sequence (equal lengths)")
REPS = flags.DEFINE_integer("reps", 5, "timed rounds")


def main(argv):
    del argv
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np

    import moajax
    from moajax.timing import compiled_contenders, machine_line, write_results

    B, N, H = 1, 8, 64
    lines = [f"# Document masking, four ways: jit(grad) on the CPU ({machine_line()})", "",
             f"`python scripts/bench_masks.py` — B = 1, N = 8, H = 64, float32, causal, {DOCS.value} documents of "
             "equal length per sequence (a query keeps the keys of its own document); jit(grad) w.r.t. q, k, v. "
             f"Contenders alternate in one process; best and median of {REPS.value} rounds after a warm-up. "
             "'−∞': the score_mod `where(doc[i] = doc[j], s, −inf)`, whose −∞ the kernel maps to jax.nn's "
             "fill (a select per score and its cotangent; a mask on data, whose causal skips the rows' "
             "statistics guard, `onf.RowGuard`); 'finfo.min': the same with a finite fill, no select; "
             "'mask': a bool [B, 1, T, S] mask (a mask on data too). Temp: the compiled executable's temp "
             "allocation.", "",
             "| T = S | contender | best s | median s | vs −∞ | temp MiB | max rel. diff of dq vs jax.nn |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    r = np.random.default_rng(0)
    for T in (int(x) for x in SEQ.value):
        q, k, v, g = (jnp.asarray(r.standard_normal((B, T, N, H)).astype(np.float32)) for _ in range(4))
        doc = jnp.asarray(np.arange(T) * DOCS.value // T, jnp.int32)
        mask = (doc[:, None] == doc[None, :])[None, None]

        def by_score_mod(fill):
            def loss(q, k, v):
                mod = lambda s, b, h, i, j: jnp.where(doc[i] == doc[j], s, fill)  # noqa: E731
                return jnp.sum(moajax.dot_product_attention(q, k, v, score_mod=mod, is_causal=True) * g)
            return loss

        def moa_mask(q, k, v):
            return jnp.sum(moajax.dot_product_attention(q, k, v, mask=mask, is_causal=True) * g)

        def nn_mask(q, k, v):
            return jnp.sum(jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation="xla") * g)

        losses = {"moajax, score_mod −∞": by_score_mod(-jnp.inf),
                  "moajax, score_mod finfo.min": by_score_mod(float(jnp.finfo(jnp.float32).min)),
                  "moajax, bool mask": moa_mask, "jax.nn, bool mask": nn_mask}
        args = (q, k, v)
        fns = {n: jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(*args).compile() for n, f in losses.items()}
        rows = compiled_contenders(fns, args, reps=REPS.value, reference="jax.nn, bool mask", pick=lambda grads: grads[0])
        base = min(rows["moajax, score_mod −∞"][0])
        for name, (ts, temp, diff) in rows.items():
            lines.append(f"| {T} | {name} | {min(ts):.4f} | {float(np.median(ts)):.4f} | {min(ts) / base:.2f}× | "
                         f"{temp:.1f} | {diff:.1e} |")
    lines += ["", "vs −∞: the contender's best time over the −∞ score_mod's (above 1: slower)."]
    write_results(OUT.value, lines)


if __name__ == "__main__":
    app.run(main)
