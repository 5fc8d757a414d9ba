#!/usr/bin/env python3
"""jit(grad) of a kernel written in the DSL: ReLU² attention, moajax vs the same math in jnp.

    out = relu(scale · Q Kᵀ)² V          (no softmax: a kernel only the DSL knows)

over N heads by ``jax.vmap``, float32, h = e = 64. moajax runs the kernel's ONF (XLA loops on
this CPU) and, under jax.grad, its adjoint kernel derived in the algebra (``moajax.adjoint``);
plain jnp materialises the [t, s] scores. The contenders run in turn in one process (best
and median of the repetitions); temp = the compiled executable's temp allocation.
Results: bench/results/kernel_grad_cpu.md (machine and date on the first lines).

    python scripts/bench_kernel_grad.py                    # t = s = 1024 4096 8192
    python scripts/bench_kernel_grad.py --sizes 1024 --reps 3
    python scripts/bench_kernel_grad.py --softmax          # softmax attention written in the DSL instead
                                                           # (its forward saves the row max and sum)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="*", default=[1024, 4096, 8192])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--reps", type=int, default=0, help="timed repetitions per contender (default: by size)")
    ap.add_argument("--softmax", action="store_true", help="softmax(scale · Q Kᵀ) V instead of ReLU²")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    args.out = args.out or str(ROOT / "bench" / "results" / f"kernel_grad{'_softmax' if args.softmax else ''}_cpu.md")

    import jax
    import jax.numpy as jnp
    import numpy as np

    import moajax
    from moajax import moa
    from moajax.timing import alternating, machine_line, write_results

    scale = 0.125

    @moajax.kernel(register=False)
    def relu2_attention(query: "t h", key: "s h", value: "s e"):
        a = moa.maximum(moa.dot(query, moa.transpose(key)) * scale, 0.0)
        return moa.dot(a * a, value)

    @moajax.kernel(register=False)
    def softmax_attention(query: "t h", key: "s h", value: "s e"):
        return moa.dot(moa.softmax(moa.dot(query, moa.transpose(key)) * scale, axis=-1), value)

    def relu2_jnp(q, k, v):
        a = jnp.maximum(q @ k.T * scale, 0.0)
        return (a * a) @ v

    def softmax_jnp(q, k, v):
        return jax.nn.softmax(q @ k.T * scale, axis=-1) @ v

    kernel_fn, plain = (softmax_attention, softmax_jnp) if args.softmax else (relu2_attention, relu2_jnp)

    def grad_of(f):
        return jax.jit(jax.grad(lambda q, k, v, g: jnp.sum(jax.vmap(f)(q, k, v) * g), argnums=(0, 1, 2)))

    impls = {"moajax": grad_of(kernel_fn), "plain jnp": grad_of(plain)}
    rng = np.random.default_rng(0)
    rows = []
    for T in args.sizes:
        q, k, v, g = (jnp.asarray(rng.standard_normal((args.heads, T, 64)), jnp.float32) for _ in range(4))
        compiled, temp = {}, {}
        for name, f in impls.items():
            c = f.lower(q, k, v, g).compile()
            compiled[name] = c
            temp[name] = c.memory_analysis().temp_size_in_bytes
        reps = args.reps or (7 if T <= 1024 else 5 if T <= 4096 else 3)
        times = alternating(compiled, (q, k, v, g), reps=reps)
        err = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
                  for a, b in zip(compiled["moajax"](q, k, v, g), compiled["plain jnp"](q, k, v, g)))
        rows.append((T, times, temp, err))
        for name in impls:
            print(f"t=s={T:6d} {name:10s} best {min(times[name]):8.4f} s  median {statistics.median(times[name]):8.4f} s"
                  f"  temp {temp[name] / 2**20:9.1f} MiB", flush=True)

    lines = [
        f"# jit(grad) of a DSL kernel on the CPU: {'softmax' if args.softmax else 'ReLU²'} attention, moajax vs plain jnp",
        "",
        machine_line(),
        f"Run: `python scripts/bench_kernel_grad.py{' --softmax' if args.softmax else ''}` — out = "
        f"{'softmax(0.125 · Q Kᵀ) V' if args.softmax else 'relu(0.125 · Q Kᵀ)² V'}, {args.heads} heads by jax.vmap, "
        "h = e = 64, float32, t = s; d/d(q, k, v) of sum(out · G). The contenders run in turn in one process; "
        "best and median of the repetitions. moajax's backward is the adjoint kernel derived in the algebra.",
        "",
        "| t = s | impl | best s | median s | speed-up (best, vs plain jnp) | temp MiB | note |",
        "|---:|---|---:|---:|---:|---:|---|",
    ]
    for T, times, temp, err in rows:
        base = min(times["plain jnp"])
        for name in impls:
            best = min(times[name])
            note = f"max rel. diff vs plain jnp {err:.1e}" if name == "moajax" else ""
            lines.append(f"| {T} | {name} | {best:.4f} | {statistics.median(times[name]):.4f} | {base / best:.2f}× | "
                         f"{temp[name] / 2**20:.1f} | {note} |")
    lines += ["", "## Targets (issue 9, set for ReLU²)", ""] if not args.softmax else []
    by = {T: (times, temp) for T, times, temp, _ in rows}
    if 4096 in by and not args.softmax:
        times, _ = by[4096]
        sp = min(times["plain jnp"]) / min(times["moajax"])
        spm = statistics.median(times["plain jnp"]) / statistics.median(times["moajax"])
        lines.append(f"- t = s = 4096: moajax {sp:.2f}× plain jnp by best time, {spm:.2f}× by median "
                     f"(target ≥ 1.5×: {'met' if min(sp, spm) >= 1.5 else 'NOT met'}).")
    if 8192 in by and not args.softmax:
        _, temp = by[8192]
        lines.append(f"- t = s = 8192: temp memory {temp['moajax'] / 2**20:.1f} MiB (target ≤ 64 MiB: "
                     f"{'met' if temp['moajax'] <= 64 * 2**20 else 'NOT met'}); plain jnp {temp['plain jnp'] / 2**20:.0f} MiB.")
    write_results(args.out, lines)


if __name__ == "__main__":
    sys.exit(main())
