"""The CPU's layout knobs, each against the same ONFs laid out without it, in one process:
``cpu_batches`` (a batch walk laid out with the batch axes, before the rows:
``Program.batch_walks``), its part ``dot_batches`` (a dot's batch axis held whole laid out
before the rows: ``Program.dot_batches``; off keeps the batch walks) and ``cpu_vectorised``
(a program that walks nothing in tiles keeps the outputs' axis order). Each jit(grad) is compiled twice — the knob as derived (on), and
cleared in the layout (off), after clearing JAX's caches — beside plain jnp where given; the
contenders alternated; best and median, the executables' temp memory, and whether the two
moajax programs are the same HLO.

    python scripts/bench_cpu_layout.py --knob cpu_batches     # bench/results/cpu_batches_cpu.md
    python scripts/bench_cpu_layout.py --knob dot_batches     # bench/results/cpu_dot_batches_cpu.md
    python scripts/bench_cpu_layout.py --knob cpu_vectorised  # bench/results/cpu_order_cpu.md
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = {"cpu_batches": "cpu_batches_cpu.md", "dot_batches": "cpu_dot_batches_cpu.md",
       "cpu_vectorised": "cpu_order_cpu.md"}


def cases(knob: str) -> dict:
    """name: (the loss's grad, its arguments, plain jnp's grad or None) for the knob."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import moajax

    r = np.random.default_rng(0)

    def a(*shape, scale=1.0):
        return jnp.asarray(r.standard_normal(shape) * scale, jnp.float32)

    out = {}
    if knob == "dot_batches":
        def attn(res, **kw):
            return jax.grad(lambda q, k, v, g: jnp.sum(moajax.dot_product_attention(q, k, v, residuals=res, **kw) * g),
                            argnums=(0, 1, 2))
        T = 1024
        mha = (a(1, T, 8, 64), a(1, T, 8, 64), a(1, T, 8, 64), a(1, T, 8, 64))
        gqa = (a(1, T, 8, 64), a(1, T, 2, 64), a(1, T, 2, 64), a(1, T, 8, 64))
        # ("recompute": the backward's own kernels recompute the statistics, as "none" did until
        # 2026-12-07, when the knob was measured; save: a control, its Δ read from Out)
        for res in ("recompute", "save"):
            out[f"residuals {res}: T = S = {T}, 8 heads of 64"] = (attn(res), mha, None)
        out[f"residuals recompute: T = S = {T}, 8 heads of 64, causal"] = (attn("recompute", is_causal=True), mha,
                                                                            None)
        out[f"residuals recompute: GQA 8 over 2 heads, T = S = {T}"] = (attn("recompute"), gqa, None)
        slopes = a(8)

        def alibi(q, k, v, sl, g):
            mod = lambda s, b, h, qi, ki: s - sl[h] * jnp.abs(qi - ki)  # noqa: E731
            return jnp.sum(moajax.dot_product_attention(q, k, v, score_mod=mod, residuals="recompute") * g)
        q2 = tuple(a(1, 512, 8, 64) for _ in range(3))
        out["residuals recompute: ALiBi slopes, T = S = 512"] = (jax.grad(alibi, argnums=(0, 1, 2, 3)),
                                                                  q2 + (slopes, a(1, 512, 8, 64)), None)
        x = a(4096, 1024)
        out["RMSNorm residuals none, 4096 rows of 1024"] = (jax.grad(
            lambda x, w: jnp.sum(jnp.sin(moajax.rms_norm(x, w, residuals="none"))), argnums=(0, 1)), (x, a(1024)), None)
        return out
    if knob == "cpu_batches":
        q, k, v, g = a(1, 1024, 8, 64), a(1, 1024, 2, 64), a(1, 1024, 2, 64), a(1, 1024, 8, 64)
        for causal in (False, True):
            out[f"GQA 8 over 2 heads, T = S = 1024{', causal' if causal else ''}"] = (jax.grad(
                lambda q, k, v, c=causal: jnp.sum(moajax.dot_product_attention(q, k, v, is_causal=c) * g),
                argnums=(0, 1, 2)), (q, k, v), None)
        q2, k2, v2, g2 = (a(1, 512, 8, 64) for _ in range(4))

        def relpos(q, k, v, tab):
            mod = lambda s, b, h, qi, ki: s + tab[jnp.clip(qi - ki, -32, 32) + 32]  # noqa: E731
            return jnp.sum(moajax.dot_product_attention(q, k, v, score_mod=mod, is_causal=True) * g2)
        out["relative-position table (65), T = S = 512, causal"] = (jax.grad(relpos, argnums=(0, 1, 2, 3)),
                                                                    (q2, k2, v2, a(65)), None)
        g3 = a(2, 512, 8, 64)
        out["[1, N, T, S] bias, B = 2, T = S = 512"] = (jax.grad(
            lambda q, k, v, b: jnp.sum(moajax.dot_product_attention(q, k, v, b) * g3), argnums=(0, 1, 2, 3)),
            (a(2, 512, 8, 64), a(2, 512, 8, 64), a(2, 512, 8, 64), a(1, 8, 512, 512)), None)
        out["RMSNorm's weight, 256 rows of 2048"] = (jax.grad(
            lambda w, x: jnp.sum(jnp.sin(moajax.rms_norm(x, w)))), (a(2048), a(256, 2048)), None)

        def shared_query(q, k, v):
            return jnp.sum(jnp.sin(jax.vmap(lambda k, v: moajax.dot_product_attention(q, k, v, is_causal=True))(k, v)))
        out["vmap over 8, query shared, causal, T = S = 128"] = (
            jax.grad(shared_query), (a(128, 4, 64), a(8, 128, 4, 64), a(8, 128, 4, 64)), None)
        return out

    def plain_norm(x, g):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * g

    for n, d in ((256, 4096), (4096, 512), (4096, 4096)):
        out[f"RMSNorm, {n} rows of {d}"] = (
            jax.grad(lambda x, g, dy: jnp.sum(moajax.rms_norm(x, g) * dy), argnums=(0, 1)), (a(n, d), a(d), a(n, d)),
            jax.grad(lambda x, g, dy: jnp.sum(plain_norm(x, g) * dy), argnums=(0, 1)))
    out["gated MLP, 1024 rows, D = 512, F = 1408"] = (
        jax.grad(lambda x, wg, wu, wd: jnp.sum(jnp.sin(moajax.gated_mlp(x, wg, wu, wd))), argnums=(0, 1, 2, 3)),
        (a(1024, 512), a(512, 1408, scale=0.05), a(512, 1408, scale=0.05), a(1408, 512, scale=0.03)), None)
    for T, causal in ((128, True), (1024, False)):
        out[f"attention, T = S = {T}, 8 heads of 64{', causal' if causal else ''}"] = (
            jax.grad(lambda q, k, v, c=causal: jnp.sum(jnp.sin(moajax.dot_product_attention(q, k, v, is_causal=c))),
                     argnums=(0, 1, 2)), tuple(a(1, T, 8, 64) for _ in range(3)), None)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--knob", choices=sorted(OUT), required=True)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=None, help="default bench/results/" + " or ".join(OUT.values()))
    args = ap.parse_args()

    import jax

    from moajax.onf import ONF
    from moajax.timing import alternating, machine_line, write_results

    derived = ONF.axis_order

    def without_knob(onf, vectorised=None):  # (the schedule still sets the knob; the layout ignores it)
        if args.knob == "cpu_vectorised":
            return derived(onf, vectorised=False if vectorised is None else vectorised)
        # cpu_batches: none kept; dot_batches: the batch walks kept, the dots' batch axes not
        walks = {v.name for v in onf.program.batch_walks()} if args.knob == "dot_batches" else set()
        kept = tuple(n for n in onf.knobs.cpu_batches if n in walks)
        return derived(onf.replace(knobs=dataclasses.replace(onf.knobs, cpu_batches=kept)), vectorised=vectorised)

    title = {"cpu_batches": "a batch walk laid out with the batch axes",
             "dot_batches": "a dot's batch axis held whole laid out before the rows",
             "cpu_vectorised": "a program that walks nothing in tiles keeps the outputs' order"}[args.knob]
    knob = "cpu_batches, its dots' batch axes (dot_batches)" if args.knob == "dot_batches" else args.knob
    lines = [f"# The CPU knob {knob}: {title}", "", machine_line(),
             f"Run: `python scripts/bench_cpu_layout.py --knob {args.knob} --reps {args.reps}` — float32 jit(grad); "
             "moajax's ONFs as derived, lowered with the knob (on) and with it cleared in the layout (off), beside "
             "plain jnp where given, alternated in one process; best and median; temp: the executable's temp "
             "allocation.", "",
             "| case | off best ms | on best ms | jnp best ms | off median | on median | jnp median | off/on (best) "
             "| on vs jnp (best) | temp off → on MiB | same HLO |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, (fn, xs, plain) in cases(args.knob).items():
        compiled = {}
        # (on first: the schedule, cached, is derived under the layout it chooses by —
        # ``schedule._cpu_batches`` asks ``axis_order`` whether a dot batch moves — and "off"
        # then only lays it out without the knob; off first, both would be off. Not
        # ``rules_patched.forget``: re-derived, even the controls' programs differ in text)
        for mode, order in (("on", derived), ("off", without_knob)):
            ONF.axis_order = order
            jax.clear_caches()
            compiled[mode] = jax.jit(fn).lower(*xs).compile()
        ONF.axis_order = derived
        if plain is not None:
            compiled["jnp"] = jax.jit(plain).lower(*xs).compile()
        times = alternating(compiled, xs, reps=args.reps)
        best = {m: min(t) * 1e3 for m, t in times.items()}
        med = {m: statistics.median(t) * 1e3 for m, t in times.items()}
        temp = {m: c.memory_analysis().temp_size_in_bytes / 2**20 for m, c in compiled.items()}
        same = compiled["off"].as_text() == compiled["on"].as_text()
        jnp_cols = (f"{best['jnp']:.2f}", f"{med['jnp']:.2f}", f"{best['jnp'] / best['on']:.2f}×") if plain else ("—",) * 3
        lines.append(f"| {name} | {best['off']:.2f} | {best['on']:.2f} | {jnp_cols[0]} | {med['off']:.2f} | "
                     f"{med['on']:.2f} | {jnp_cols[1]} | {best['off'] / best['on']:.2f}× | {jnp_cols[2]} | "
                     f"{temp['off']:.1f} → {temp['on']:.1f} | {'yes' if same else 'no'} |")
    write_results(args.out or str(ROOT / "bench" / "results" / OUT[args.knob]), lines)


if __name__ == "__main__":
    main()
