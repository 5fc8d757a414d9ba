#!/usr/bin/env python3
"""What a kernel costs before it runs: tracing (ψ-reduction, adjoint derivation, ONF
scheduling, lowering to a jaxpr) and XLA's compile, for the calls users make first — and
the same against an older checkout (``--baseline``), each in a fresh process.

A derivation is cached per process, so every measurement is a new Python process; the
contenders alternate (this tree, the baseline, this tree, …) and the table gives the best
and the median of ``--runs`` processes each. Cases, all float32 on the CPU:

- ``one-kernel block jit(grad)``: paper IV's block as one kernel (``moajax.kernels.block``:
  one DNF, one derived adjoint), x [6, 8], 2 × 4 heads, F = 12 — the derivation is the cost;
- ``block jit(grad)``: ``moajax.transformer_block``'s gradient (B=1, T=32, D=64, 4 × 16 heads,
  F=128, causal), traced then compiled;
- ``attention variants jit(vjp)``: window (2, 1), causal, both sequence lengths, GQA 4:2
  (B=2, T=S=64, H=16), traced then compiled;
- ``attention jit(grad)``: of ``dot_product_attention`` beside jax.nn's (B=1, T=S=128, N=4,
  H=32), traced then compiled, jax.nn first;
- ``eager grad``: ``jax.grad`` of the causal attention (B=1, T=S=64, 4 × 16) outside
  ``jax.jit``, the first call (everything) and the second (warm).

    python scripts/bench_derive.py --baseline /path/to/older/checkout   # bench/results/derive_cpu.md
    python scripts/bench_derive.py --out bench/results/derive_vs_jax_nn_cpu.md   # this tree alone
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parent.parent
OUT = flags.DEFINE_string("out", str(ROOT / "bench" / "results" / "derive_cpu.md"), "the results file")
BASELINE = flags.DEFINE_string("baseline", None, "a checkout of an older moajax to compare against")
BASELINE_NAME = flags.DEFINE_string("baseline_name", None, "what to call the baseline in the table (its commit)")
RUNS = flags.DEFINE_integer("runs", 3, "processes per contender")
CHILD = flags.DEFINE_bool("child", False, "internal: measure once in this process and print JSON")


def measure() -> dict:
    """One process' times (seconds) of every case."""
    import time

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np

    import moajax

    r = np.random.default_rng(0)
    a = lambda *s: jnp.asarray(r.standard_normal(s).astype(np.float32))  # noqa: E731
    out = {}

    def lower_compile(name, fn, *args):
        t = time.perf_counter()
        lowered = jax.jit(fn).lower(*args)
        out[f"{name}: trace"] = time.perf_counter() - t
        t = time.perf_counter()
        lowered.compile()
        out[f"{name}: compile"] = time.perf_counter() - t

    # attention's jit(grad) beside jax.nn's (B=1, T=S=128, N=4, H=32, float32): JAX warmed up
    # first by a jit of its own, so that neither pays the process' first compile
    jax.jit(lambda x: x + 1).lower(a(4)).compile()
    q, k, v = a(1, 128, 4, 32), a(1, 128, 4, 32), a(1, 128, 4, 32)
    for who, att in (("jax.nn", jax.nn.dot_product_attention), ("moajax", moajax.dot_product_attention)):
        lower_compile(f"attention jit(grad), {who}", jax.grad(
            lambda q, k, v, att=att: jnp.sum(att(q, k, v) ** 2), argnums=(0, 1, 2)), q, k, v)

    from moajax.kernels import block

    # the block as one kernel (paper IV's program: one DNF, one derived adjoint of every
    # weight), tiny: the derivation is the cost
    x, D, N, H, F = a(6, 8), 8, 2, 4, 12
    w = [jnp.ones(D), a(D, N, H) / 2, a(D, N, H) / 2, a(D, N, H) / 2, a(N, H, D) / 2, jnp.ones(D), a(D, F) / 2,
         a(D, F) / 2, a(F, D) / 2]
    lower_compile("one-kernel block jit(grad)", jax.grad(lambda x, *w: jnp.sum(block(x, *w, is_causal=True) ** 2)),
                  x, *w)

    B, T, D, N, H, F = 1, 32, 64, 4, 16, 128
    p = dict(attn_norm=jnp.ones(D), wq=a(D, N, H) / D ** 0.5, wk=a(D, N, H) / D ** 0.5, wv=a(D, N, H) / D ** 0.5,
             wo=a(N, H, D) / D ** 0.5, mlp_norm=jnp.ones(D), w_gate=a(D, F) / D ** 0.5, w_up=a(D, F) / D ** 0.5,
             w_down=a(F, D) / F ** 0.5)
    lower_compile("block jit(grad)", jax.grad(lambda p, x: jnp.sum(moajax.transformer_block(p, x) ** 2)), p,
                  a(B, T, D))

    q, k, v, g = a(2, 64, 4, 16), a(2, 64, 2, 16), a(2, 64, 2, 16), a(2, 64, 4, 16)
    lengths = (jnp.array([64, 40], jnp.int32), jnp.array([50, 64], jnp.int32))

    def variants(q, k, v, g, ql, kvl):
        att = lambda q, k, v: moajax.dot_product_attention(  # noqa: E731
            q, k, v, is_causal=True, local_window_size=(2, 1), query_seq_lengths=ql, key_value_seq_lengths=kvl)
        o, pullback = jax.vjp(att, q, k, v)
        return o, pullback(g)
    lower_compile("attention variants jit(vjp)", variants, q, k, v, g, *lengths)

    q, k, v = a(1, 64, 4, 16), a(1, 64, 4, 16), a(1, 64, 4, 16)
    grad = jax.grad(lambda q, k, v: jnp.sum(moajax.dot_product_attention(q, k, v, is_causal=True) ** 2),
                    argnums=(0, 1, 2))
    for call in ("first call", "second call"):
        t = time.perf_counter()
        jax.block_until_ready(grad(q, k, v))
        out[f"eager grad: {call}"] = time.perf_counter() - t
    return out


def _run(tree: str) -> dict:
    env = dict(os.environ, PYTHONPATH=tree, JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, __file__, "--child"], env=env, cwd=tree, check=True,
                         capture_output=True, text=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv):
    del argv
    if CHILD.value:
        print(json.dumps(measure()))
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from moajax.timing import machine_line, write_results

    trees = {"this tree": str(ROOT)}
    if BASELINE.value:
        trees[BASELINE_NAME.value or "baseline"] = str(Path(BASELINE.value).resolve())
    runs = {name: [] for name in trees}
    for i in range(RUNS.value):  # alternated, one fresh process each
        for name, tree in trees.items():
            runs[name].append(_run(tree))
    cases = list(runs["this tree"][0])
    names = list(trees)
    lines = [f"# Before a kernel runs: tracing and compile time on the CPU ({machine_line()})", "",
             "`python scripts/bench_derive.py" + (" --baseline <checkout>" if BASELINE.value else "") + "` — "
             "float32; each contender a fresh process per run (derivations are cached per process), the "
             f"contenders alternated, {RUNS.value} runs each: best and median seconds. Trace: `jax.jit(f).lower` "
             "(ψ-reduction, adjoint derivation, ONF scheduling, the lowering to a jaxpr and StableHLO); compile: "
             "XLA's. Eager grad: `jax.grad` outside `jax.jit`.", "",
             "| case | " + " | ".join(f"{n} best | {n} median" for n in names)
             + (" | speed-up (best) |" if len(names) > 1 else " |"),
             "|---|" + "---:|---:|" * len(names) + ("---:|" if len(names) > 1 else "")]
    for case in cases:
        cells, best = [], {}
        for n in names:
            ts = [r[case] for r in runs[n]]
            best[n] = min(ts)
            cells.append(f"{min(ts):.2f} | {statistics.median(ts):.2f}")
        row = f"| {case} | " + " | ".join(cells)
        if len(names) > 1:
            row += f" | {best[names[1]] / best[names[0]]:.2f}×"
        lines.append(row + " |")
    write_results(OUT.value, lines)


if __name__ == "__main__":
    app.run(main)
