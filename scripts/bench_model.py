#!/usr/bin/env python3
"""Issue 11's two CPU benchmarks, each contender beside its baseline in one process.

--block   jit(grad) of the pre-norm block (``moajax.transformer_block``: RMSNorm, causal
          attention, SwiGLU as DSL kernels) against jit(grad) of the same block in plain jnp
          with jax.nn attention inside; T = 4096, D = 512, 8 heads of 64, F = 1408, float32,
          gradients w.r.t. x and every parameter; time (best and median of alternating runs)
          and compiled temp memory. Target: ≥ 1.5× faster with ≤ 1/4 of the temp memory.
--mlp     the gated MLP's residual policies (recompute U and V; keep U, paper IV's; keep U
          and V) under jit(grad) w.r.t. x and the weights, beside plain jnp, with the cost
          model's GEMM units and paper IV's element count per policy.
--decode  one decode step (``moajax.decode_attention``) over a cache of 2²⁰ keys, d = 64,
          float32, one head, against a same-run elementwise pass over the same cache
          (``kc + 1``): decode's bytes read ÷ its time against the pass's bytes read and
          written ÷ its time. Target: ≥ 70 % of that bandwidth.

Results: bench/results/model_cpu.md (machine and date on the first lines).

    python scripts/bench_model.py            # both
    python scripts/bench_model.py --block --reps 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _block(args, lines):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import moajax
    from moajax.timing import alternating
    from plain_block import block_params, plain_block, rms_norm

    T, D, N, H, F = args.tokens, 512, 8, 64, 1408
    r = np.random.default_rng(0)
    p = block_params(r, D, N, H, F, jnp.float32)
    x = jnp.asarray(r.standard_normal((1, T, D)), jnp.float32)
    g = jnp.asarray(r.standard_normal((1, T, D)), jnp.float32)

    fns = {"moajax block": lambda p, x: moajax.transformer_block(p, x, is_causal=True), "plain jnp block": plain_block}
    compiled, temps = {}, {}
    for name, f in fns.items():
        c = jax.jit(jax.grad(lambda p, x, f=f: jnp.sum(f(p, x) * g), argnums=(0, 1))).lower(p, x).compile()
        mem = c.memory_analysis()
        temps[name] = int(getattr(mem, "temp_size_in_bytes", -1)) if mem is not None else -1
        compiled[name] = c
    times = alternating(compiled, (p, x), reps=args.reps)
    got, want = compiled["moajax block"](p, x), compiled["plain jnp block"](p, x)
    err = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in
              zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    lines += [f"## Block jit(grad): T = {T}, D = {D}, {N} heads of {H}, F = {F}, float32, causal", "",
              "| impl | best s | median s | speed-up (best) | temp MiB | temp ratio |", "|---|---:|---:|---:|---:|---:|"]
    base_t, base_m = min(times["plain jnp block"]), temps["plain jnp block"]
    for name in fns:
        t = min(times[name])
        lines.append(f"| {name} | {t:.4f} | {statistics.median(times[name]):.4f} | {base_t / t:.2f}× | "
                     f"{temps[name] / 2**20:.1f} | {temps[name] / base_m:.3f} |")
    sp, ratio = base_t / min(times["moajax block"]), temps["moajax block"] / base_m
    lines += ["", f"Max relative difference of the gradients vs the plain block: {err:.1e}.", "",
              f"- Target ≥ 1.5× faster: {'met' if sp >= 1.5 else 'NOT met'} ({sp:.2f}×); ≤ 1/4 of the temp memory: "
              f"{'met' if ratio <= 0.25 else 'NOT met'} ({ratio:.3f}).", ""]
    # the block's parts: where its time and memory go
    m = p["mlp_norm"]
    parts = {
        "moajax gated_mlp": lambda x: moajax.gated_mlp(x, p["w_gate"], p["w_up"], p["w_down"]),
        "plain jnp MLP": lambda x: (jax.nn.silu(x @ p["w_gate"]) * (x @ p["w_up"])) @ p["w_down"],
        "moajax rms_norm": lambda x: moajax.rms_norm(x, m),
        "plain jnp RMSNorm": lambda x: rms_norm(x, m),
    }
    compiled, temps = {}, {}
    for name, f in parts.items():
        c = jax.jit(jax.grad(lambda x, f=f: jnp.sum(f(x) * g))).lower(x).compile()
        mem = c.memory_analysis()
        temps[name] = int(getattr(mem, "temp_size_in_bytes", -1)) if mem is not None else -1
        compiled[name] = c
    times = alternating(compiled, (x,), reps=args.reps)
    lines += ["Its parts alone, jit(grad) w.r.t. x:", "", "| impl | best s | median s | temp MiB |", "|---|---:|---:|---:|"]
    for name in parts:
        lines.append(f"| {name} | {min(times[name]):.4f} | {statistics.median(times[name]):.4f} | "
                     f"{temps[name] / 2**20:.1f} |")
    lines.append("")


def _mlp(args, lines):
    """The gated MLP's residual policies (what the forward keeps for the backward), jit(grad)
    w.r.t. x and the three weights, beside plain jnp; with the cost model's counts."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import moajax
    from moajax import cost, machines, schedule
    from moajax.kernels.mlp import swiglu
    from moajax.timing import alternating

    T, D, F = args.tokens, 512, 1408
    r = np.random.default_rng(2)
    x = jnp.asarray(r.standard_normal((T, D)), jnp.float32)
    ws = [jnp.asarray(r.standard_normal(s) / np.sqrt(s[0]), jnp.float32) for s in [(D, F), (D, F), (F, D)]]
    g = jnp.asarray(r.standard_normal((T, D)), jnp.float32)
    policies = {"recompute U, V (none)": "none", "keep U (paper IV)": ("gate",), "keep U, V": ("gate", "up")}
    fns = {name: (lambda x, a, b, c, res=res: moajax.gated_mlp(x, a, b, c, residuals=res))
           for name, res in policies.items()}
    fns["plain jnp"] = lambda x, a, b, c: (jax.nn.silu(x @ a) * (x @ b)) @ c
    compiled, temps = {}, {}
    for name, f in fns.items():
        c = jax.jit(jax.grad(lambda *a, f=f: jnp.sum(f(*a) * g), argnums=(0, 1, 2, 3))).lower(x, *ws).compile()
        temps[name] = int(c.memory_analysis().temp_size_in_bytes)
        compiled[name] = c
    times = alternating(compiled, (x, *ws), reps=args.reps)
    want = compiled["plain jnp"](x, *ws)
    S = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, *ws)]
    m, unit = machines.local(), 2 * T * D * F

    def units(dnf):
        plan = schedule.derive_plan(dnf, m)
        return sum(cost.estimate(o).matmul_flops for o in (plan if isinstance(plan, tuple) else (plan,))) / unit

    lines += [f"## Gated MLP jit(grad) w.r.t. x and the weights: n = {T}, d = {D}, d_ff = {F}, float32", "",
              "Residual policy = what the forward saves for the backward (an ONF choice: `residuals=` or "
              "`Preset.of(residuals=...)`). GEMM units: the cost model's contraction flops ÷ 2·n·d·d_ff for the "
              "forward + backward plans. Paper IV count: `Kernel.interface_ledger`, token-proportional arrays, "
              "Z and dZ charged to the RMSNorm (n·d and n·d_ff as multiples).", "",
              "| impl | best s | median s | vs plain (best) | temp MiB | GEMM units fwd + bwd | paper IV count | max rel diff |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    base = min(times["plain jnp"])
    for name in fns:
        t = min(times[name])
        err = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(compiled[name](x, *ws), want))
        if name in policies:
            res = policies[name]
            labels = res if isinstance(res, tuple) else ()
            fwd = swiglu.saving_forward(*S, labels=labels).dnf(*S)
            adj, a = swiglu.saved_adjoint(*S, labels=labels) if labels else (swiglu.adjoint(*S), S + [S[0]])
            gemm = f"{units(fwd):.2f} + {units(adj.dnf(*a)):.2f}"
            el = cost.ledger_elements(swiglu.interface_ledger(*S, residuals=res), per="n", charged_elsewhere=("z", "d_z"))
            count = "2·nd" + (f" + {(el - 2 * T * D) // (T * F)}·n·d_ff" if el > 2 * T * D else "")
        else:
            gemm, count = "3 + 6 (autodiff)", "—"
        lines.append(f"| {name} | {t:.4f} | {statistics.median(times[name]):.4f} | {base / t:.2f}× | "
                     f"{temps[name] / 2**20:.1f} | {gemm} | {count} | {err:.1e} |")
    lines.append("")


def _decode(args, lines):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import moajax
    from moajax.timing import alternating

    S, H = 1 << args.log2_keys, 64
    r = np.random.default_rng(1)
    q = jnp.asarray(r.standard_normal((1, 1, H)), jnp.float32)
    kc = jnp.asarray(r.standard_normal((1, S, 1, H)), jnp.float32)
    vc = jnp.asarray(r.standard_normal((1, S, 1, H)), jnp.float32)
    fns = {"decode_attention": jax.jit(lambda q, k, v: moajax.decode_attention(q, k, v)),
           "kc + 1": jax.jit(lambda q, k, v: k + 1)}
    times = alternating(fns, (q, kc, vc), reps=args.reps * 2)
    cache = S * H * 4
    bw = {"decode_attention": 2 * cache / min(times["decode_attention"]),  # reads K and V
          "kc + 1": 2 * cache / min(times["kc + 1"])}  # reads K, writes K + 1
    err = float(jnp.max(jnp.abs(fns["decode_attention"](q, kc, vc)
                                - jax.nn.dot_product_attention(q[:, None], kc, vc)[:, 0])))
    share = bw["decode_attention"] / bw["kc + 1"]
    lines += [f"## Decode: one head, cache of 2^{args.log2_keys} = {S} keys, d = {H}, float32", "",
              "| impl | best ms | median ms | bytes moved (MiB) | GB/s (best) |", "|---|---:|---:|---:|---:|"]
    for name in fns:
        lines.append(f"| {name} | {1e3 * min(times[name]):.2f} | {1e3 * statistics.median(times[name]):.2f} | "
                     f"{2 * cache / 2**20:.0f} | {bw[name] / 1e9:.2f} |")
    lines += ["", f"Max abs difference vs jax.nn: {err:.1e}.", "",
              f"- Target ≥ 70 % of the elementwise pass's bandwidth: {'met' if share >= 0.7 else 'NOT met'} "
              f"({100 * share:.0f} %).", ""]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block", action="store_true")
    ap.add_argument("--decode", action="store_true")
    ap.add_argument("--mlp", action="store_true")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--log2-keys", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "model_cpu.md"))
    args = ap.parse_args()
    both = not (args.block or args.decode or args.mlp)

    from moajax.timing import machine_line, write_results

    lines = ["# Issue 11's model benchmarks on the CPU", "", machine_line(),
             "Run: `python scripts/bench_model.py` — contenders alternate in one process (each round starting one "
             "later), best and median of the repetitions after a warm-up; temp = the compiled executable's temp "
             "allocation.", ""]
    if args.block or both:
        _block(args, lines)
    if args.mlp or both:
        _mlp(args, lines)
    if args.decode or both:
        _decode(args, lines)
    write_results(args.out, lines)


if __name__ == "__main__":
    sys.exit(main())
