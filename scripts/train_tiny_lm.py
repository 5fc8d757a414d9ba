#!/usr/bin/env python3
"""Train a tiny decoder with moajax blocks and the same model in plain jnp, side by side.

Synthetic data made here: token sequences from a fixed random Markov chain over a vocabulary
of 256 (each token has 4 likely successors), so the loss can fall from ln 256 ≈ 5.5 towards
the chain's entropy. The model: an embedding, ``moajax.transformer_stack`` of 2 pre-norm
blocks (D = 64, 4 query heads and 2 kv heads of 16, F = 128, causal, RoPE), a final RMSNorm
and an unembedding; next-token cross-entropy; Adam written out in a few lines. The plain-jnp
model is the same math with jax.nn attention, from the same initialisation, fed the same
batches. A progress line every 25 steps; the two loss curves go to bench/results/tiny_lm_cpu.md
(a table) and tiny_lm_cpu.png (with matplotlib: ``pip install -e '.[plot]'``).

    python scripts/train_tiny_lm.py              # 300 steps
    python scripts/train_tiny_lm.py --steps 50
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
V, D, N, K, H, F, L = 256, 64, 4, 2, 16, 128, 2


def batches(steps: int, batch: int, T: int, seed: int = 0):
    import numpy as np

    r = np.random.default_rng(seed)
    succ = r.integers(0, V, (V, 4))  # each token's 4 likely successors
    probs = np.array([0.55, 0.25, 0.12, 0.08])
    for _ in range(steps):
        x = np.empty((batch, T + 1), np.int32)
        x[:, 0] = r.integers(0, V, batch)
        for t in range(T):
            x[:, t + 1] = succ[x[:, t], r.choice(4, batch, p=probs)]
        yield x


def init(seed: int = 1):
    import jax.numpy as jnp
    import numpy as np

    r = np.random.default_rng(seed)
    g = lambda *s: jnp.asarray(r.standard_normal(s) / np.sqrt(s[0] if len(s) < 3 else s[-3]), jnp.float32)  # noqa: E731
    layers = {"attn_norm": jnp.ones((L, D)), "mlp_norm": jnp.ones((L, D)),
              "wq": jnp.stack([g(D, N, H) for _ in range(L)]), "wk": jnp.stack([g(D, K, H) for _ in range(L)]),
              "wv": jnp.stack([g(D, K, H) for _ in range(L)]), "wo": jnp.stack([g(N, H, D) / 2 for _ in range(L)]),
              "w_gate": jnp.stack([g(D, F) for _ in range(L)]), "w_up": jnp.stack([g(D, F) for _ in range(L)]),
              "w_down": jnp.stack([g(F, D) / 2 for _ in range(L)])}
    return {"embed": g(V, D), "layers": layers, "final_norm": jnp.ones((D,)), "unembed": g(D, V)}


def moajax_logits(p, tokens):
    import moajax

    h = p["embed"][tokens]
    h = moajax.transformer_stack(p["layers"], h, is_causal=True, rope_theta=10000.0)
    return moajax.rms_norm(h, p["final_norm"]) @ p["unembed"]


def plain_logits(p, tokens):
    import jax

    from plain_block import plain_block, rms_norm

    h = jax.lax.scan(lambda h, lp: (plain_block(lp, h, rope_theta=10000.0), None), p["embed"][tokens], p["layers"])[0]
    return rms_norm(h, p["final_norm"]) @ p["unembed"]


def trainer(logits_fn, lr: float):
    import jax
    import jax.numpy as jnp

    def loss(p, x):
        logp = jax.nn.log_softmax(logits_fn(p, x[:, :-1]), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, x[:, 1:, None], axis=-1))

    @jax.jit
    def step(p, m, v, i, x):  # Adam, β = (0.9, 0.999)
        val, g = jax.value_and_grad(loss)(p, x)
        m = jax.tree.map(lambda a, b: 0.9 * a + 0.1 * b, m, g)
        v = jax.tree.map(lambda a, b: 0.999 * a + 0.001 * b * b, v, g)
        mh, vh = 1 - 0.9 ** (i + 1), 1 - 0.999 ** (i + 1)
        p = jax.tree.map(lambda w, a, b: w - lr * (a / mh) / (jnp.sqrt(b / vh) + 1e-8), p, m, v)
        return p, m, v, val

    return step


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "tiny_lm_cpu.md"))
    args = ap.parse_args()

    import jax
    import numpy as np

    from moajax.timing import machine_line, write_results

    runs = {name: [fn, init(), None, None, []] for name, fn in (("moajax", moajax_logits), ("plain jnp", plain_logits))}
    for r in runs.values():
        r[2] = jax.tree.map(lambda a: 0 * a, r[1])
        r[3] = jax.tree.map(lambda a: 0 * a, r[1])
        r[0] = trainer(r[0], args.lr)
    clock = {name: 0.0 for name in runs}
    for i, x in enumerate(batches(args.steps, args.batch, args.tokens)):
        for name, r in runs.items():
            t = time.perf_counter()
            r[1], r[2], r[3], val = r[0](r[1], r[2], r[3], i, x)
            r[4].append(float(val))
            clock[name] += time.perf_counter() - t if i else 0.0  # step 0 compiles
        if i % 25 == 0 or i == args.steps - 1:
            a, b = runs["moajax"][4][-1], runs["plain jnp"][4][-1]
            print(f"step {i:4d}  loss moajax {a:.4f}  plain jnp {b:.4f}  |Δ| {abs(a - b):.1e}", flush=True)
    la, lb = np.array(runs["moajax"][4]), np.array(runs["plain jnp"][4])
    lines = ["# A tiny decoder trained with moajax blocks and in plain jnp", "", machine_line(),
             f"Run: `python scripts/train_tiny_lm.py` — {L} blocks, D = {D}, {N} query / {K} kv heads of {H}, "
             f"F = {F}, vocabulary {V}, causal with RoPE; batches of {args.batch} × {args.tokens} tokens from a "
             f"fixed Markov chain (made by the script); Adam, lr {args.lr}; the same initialisation and batches.",
             "", "| step | loss moajax | loss plain jnp | abs. difference |", "|---:|---:|---:|---:|"]
    for i in sorted(set(range(0, args.steps, 25)) | {args.steps - 1}):
        lines.append(f"| {i} | {la[i]:.4f} | {lb[i]:.4f} | {abs(la[i] - lb[i]):.1e} |")
    steps = max(args.steps - 1, 1)
    lines += ["", f"Largest difference over all {args.steps} steps: {np.max(np.abs(la - lb)):.1e} "
              f"(relative {np.max(np.abs(la - lb) / lb):.1e}). Time per step after the first (compile): moajax "
              f"{1e3 * clock['moajax'] / steps:.1f} ms, plain jnp {1e3 * clock['plain jnp'] / steps:.1f} ms."]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(la, label="moajax blocks")
        ax.plot(lb, "--", label="plain jnp")
        ax.set_xlabel("step")
        ax.set_ylabel("next-token cross-entropy")
        ax.legend()
        fig.tight_layout()
        png = Path(args.out).with_suffix(".png")
        fig.savefig(png, dpi=120)
        lines.append(f"Plot: `{png.name}`.")
    except ImportError:
        lines.append("No plot: matplotlib is not installed (`pip install -e '.[plot]'`).")
    write_results(args.out, lines)


if __name__ == "__main__":
    sys.exit(main())
