"""jax.grad of the MLP, RMSNorm, a column max (a selection) and causal attention under
jax.vmap over examples that share the weights (the Equinox way; attention shares its query)
beside the same call on [B, …] (the shared operands broadcast: the MLP's and RMSNorm's own
leading axes) and plain jnp: each jit(grad) over the weights, its executable's temp memory (XLA's memory analysis)
and its wall time, the contenders alternated in one process; best and median. The
vmap/leading-axes ratios compare across runs of different code (``--label`` names the run).

    python scripts/bench_vmap_grad.py [--batch 8] [--tokens 128] [--dim 512] [--ff 1408] [--reps 20]
                                      [--heads 4] [--head-dim 64] [--label TEXT] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--ff", type=int, default=1408)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--label", default="this tree")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "vmap_grad_cpu.md"))
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    import moajax
    from moajax import moa
    from moajax.timing import alternating, machine_line, write_results

    B, T, D, F = args.batch, args.tokens, args.dim, args.ff
    r = np.random.default_rng(0)
    x = jnp.asarray(r.standard_normal((B, T, D)), jnp.float32)
    s = 1 / np.sqrt(D)
    mlp_w = tuple(jnp.asarray(s * r.standard_normal(shape), jnp.float32) for shape in ((D, F), (D, F), (F, D)))
    norm_w = (jnp.asarray(1 + r.standard_normal(D) / 20, jnp.float32),)

    def plain_mlp(x, wg, wu, wd):
        return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd

    def plain_norm(x, w):
        return w * x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)

    @moajax.kernel(example=dict(n=5, d=3, f=4), register=False)
    def column_max(x: "n d", w: "d f"):
        """⌈/ over the rows of tanh(x +.× W): a selection; W's gradient is Σ_b Σ_n."""
        return moa.amax(moa.tanh(moa.dot(x, w)), 0)

    @moajax.kernel(example=dict(b=2, n=5, d=3, f=4), register=False)
    def column_max_each(x: "b n d", w: "d f"):
        """⌈/ over the rows of each tanh(x_b +.× W): the batch in the kernel."""
        return moa.omega(lambda y: moa.amax(y, 0), (2,))(moa.tanh(moa.dot(x, w)))

    # attention's query shared by the batch (learned latent queries), keys and values per
    # example, causal: dQ is Σ_b of each example's
    N, H = args.heads, args.head_dim
    kv = tuple(jnp.asarray(r.standard_normal((B, T, N, H)), jnp.float32) for _ in range(2))
    query = (jnp.asarray(r.standard_normal((T, N, H)), jnp.float32),)

    def big(ws):
        return tuple(jnp.broadcast_to(w, (B,) + w.shape) for w in ws)

    # name: (shared, batched, one example's call (shared, example), the call on [B, …], plain jnp)
    kernels = {
        "gated_mlp": (mlp_w, (x,), lambda ws, e: moajax.gated_mlp(*e, *ws),
                      lambda ws, b: moajax.gated_mlp(*b, *ws), lambda ws, b: plain_mlp(*b, *ws)),
        "rms_norm": (norm_w, (x,), lambda ws, e: moajax.rms_norm(*e, *ws),
                     lambda ws, b: moajax.rms_norm(*b, *ws), lambda ws, b: plain_norm(*b, *ws)),
        "column_max": (mlp_w[:1], (x,), lambda ws, e: column_max(*e, *ws),
                       lambda ws, b: column_max_each(*b, *ws),
                       lambda ws, b: jnp.max(jnp.tanh(b[0] @ ws[0]), axis=-2)),
        "causal attention, query shared": (
            query, kv, lambda ws, e: moajax.dot_product_attention(*ws, *e, is_causal=True),
            lambda ws, b: moajax.dot_product_attention(*big(ws), *b, is_causal=True),
            lambda ws, b: jax.nn.dot_product_attention(*big(ws), *b, is_causal=True)),
    }
    lines = ["# jax.grad of a vmap over examples sharing the weights, on the CPU", "", machine_line(),
             f"Run: `python scripts/bench_vmap_grad.py --batch {B} --tokens {T} --dim {D} --ff {F} --heads {N}"
             f" --head-dim {H} --reps {args.reps} --label '{args.label}'` — float32, jit(grad) over the shared"
             " operands of Σ sin(f(…)); one process, the contenders alternated; best and median; temp: the"
             " executable's temp allocation.", "",
             "| run | kernel | contender | temp MiB | best ms | median ms | best vs leading axes | max rel diff vs leading |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for name, (ws, xs, one, leading, plain) in kernels.items():
        def loss_of(f):
            return jax.jit(jax.grad(lambda ws, xs: jnp.sum(jnp.sin(f(ws, xs)))))

        contenders = {
            "vmap over B (weights shared)": loss_of(lambda ws, xs: jax.vmap(lambda *e: one(ws, e))(*xs)),
            "leading axes [B, …]": loss_of(leading),
            "plain jnp": loss_of(plain),
        }
        compiled = {c: f.lower(ws, xs).compile() for c, f in contenders.items()}
        want = compiled["leading axes [B, …]"](ws, xs)
        diff = {c: max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(f(ws, xs), want))
                for c, f in compiled.items()}
        times = alternating(compiled, (ws, xs), reps=args.reps)
        base = min(times["leading axes [B, …]"])
        for c, ts in times.items():
            temp = compiled[c].memory_analysis().temp_size_in_bytes / 2**20
            lines.append(f"| {args.label} | {name} (shared: {len(ws)}) | {c} | {temp:.1f} | {min(ts) * 1e3:.2f} | "
                         f"{statistics.median(ts) * 1e3:.2f} | {base / min(ts):.2f}× | {diff[c]:.1e} |")
    write_results(args.out, lines)


if __name__ == "__main__":
    main()
