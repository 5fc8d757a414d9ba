#!/usr/bin/env python3
"""GPU check on a real NVIDIA GPU (the lent H200, a Delta node): correctness, then timing.

Correctness: moajax.dot_product_attention's Pallas (Triton) kernel against the float64 NumPy
reference for float64/float32/bfloat16/float16, causal, GQA, head dim 72, T ≠ S; and the fused
forward+backward's atomic scatter-add ONF (paper II) against the float64 backward reference.
Timing (median of repeated runs after warm-up, device-synchronised): moajax vs
jax.nn.dot_product_attention (XLA and cuDNN where available) at transformer sizes.
Writes a markdown table to $OUT (or bench/results/) and prints it last.
Run it through scripts/gpu_check.sh; it needs only jax with CUDA and numpy.
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main():
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np

    import moajax
    import references as R
    from moajax.timing import median_seconds

    dev = jax.devices()[0]
    lines = [f"# GPU check: {getattr(dev, 'device_kind', dev)} — JAX {jax.__version__}, "
             f"{datetime.datetime.now().isoformat(timespec='minutes')}", ""]
    print(lines[0], flush=True)
    # the GPU's profile derives its tilings with the spill check (machines.for_device): say
    # whether this machine's toolchain let it run, and with which ptxas
    from moajax import ptx

    missing = ptx.toolchain_missing()
    state = f"off, {missing}" if missing else f"on, ptxas {ptx.ptxas_version()}"
    lines += [f"Spill check of the derived tilings: {state}.", ""]
    print(lines[-2], flush=True)
    rng = np.random.default_rng(0)

    # ---- correctness
    lines += ["## Correctness (Pallas kernel vs float64 NumPy reference)", "",
              "| dtype | case | rel. error | bound | ok |", "|---|---|---:|---:|---|"]
    bounds = {"float64": 1e-12, "float32": 2e-6, "bfloat16": 2e-2, "float16": 4e-3}
    cases = [("plain", dict(B=2, T=256, S=256, N=4, K=4, H=64)),
             ("causal GQA T≠S", dict(B=1, T=200, S=333, N=8, K=2, H=64, causal=True)),
             ("head dim 72", dict(B=1, T=128, S=96, N=2, K=1, H=72))]
    bad = 0
    for dt, bound in bounds.items():
        for label, c in cases:
            try:
                q = rng.standard_normal((c["B"], c["T"], c["N"], c["H"]))
                k = rng.standard_normal((c["B"], c["S"], c["K"], c["H"]))
                v = rng.standard_normal((c["B"], c["S"], c["K"], c["H"]))
                args = [jnp.asarray(a, dt) for a in (q, k, v)]
                out = jax.jit(lambda a, b, d: moajax.dot_product_attention(a, b, d, is_causal=c.get("causal", False)))(*args)
                ref = R.mha(*(np.asarray(a.astype(jnp.float64)) for a in args), is_causal=c.get("causal", False))
                err = float(np.max(np.abs(np.asarray(out, np.float64) - ref)) / np.max(np.abs(ref)))
                ok = err <= bound
            except Exception as e:  # a failure is a finding: record it
                err, ok = float("nan"), False
                traceback.print_exc()
                label += f" FAILED {type(e).__name__}: {str(e)[:80]}"
            bad += not ok
            lines.append(f"| {dt} | {label} | {err:.2e} | {bound:.0e} | {'yes' if ok else 'NO'} |")
            print(lines[-1], flush=True)

    # ---- the fused forward+backward (paper II): dK, dV scatter-added with atomics on the GPU
    import pallas_kernels
    from moajax import machines, schedule
    from moajax.kernels import attention_forward_backward
    from moajax.schedule import Preset

    machine = machines.for_device(dev)
    lines += ["", f"## Fused forward+backward, atomic scatter-add ONF ({machine.name} profile)", "",
              "| dtype | T·S·H | causal | worst rel. error (out, dq, dk, dv) | bound | ok |", "|---|---|---|---:|---:|---|"]
    for dt, bound in bounds.items():
        for (T, S, H, causal) in ((512, 512, 64, False), (300, 700, 72, True)):
            try:
                a = [rng.standard_normal(s_) for s_ in ((T, H), (S, H), (S, H), (T, H))]
                args = [jnp.asarray(x, dt) for x in a]
                onf = schedule.derive(attention_forward_backward.dnf(*args, is_causal=causal), machine)
                got = jax.jit(pallas_kernels.lower(onf))(*args)
                a64 = [np.asarray(x.astype(jnp.float64)) for x in args]
                want = (R.attention(*a64[:3], is_causal=causal),) + R.attention_backward(*a64, is_causal=causal)
                err = max(float(np.max(np.abs(np.asarray(g, np.float64) - w)) / np.max(np.abs(w))) for g, w in zip(got, want))
                ok = err <= bound
                label = f"{T}·{S}·{H}"
            except Exception as e:
                err, ok = float("nan"), False
                traceback.print_exc()
                label = f"{T}·{S}·{H} FAILED {type(e).__name__}: {str(e)[:80]}"
            bad += not ok
            lines.append(f"| {dt} | {label} | {causal} | {err:.2e} | {bound:.0e} | {'yes' if ok else 'NO'} |")
            print(lines[-1], flush=True)

    # ---- timing
    def bench(f, *a, reps=20):
        return median_seconds(f, *a, reps=reps, warmups=2)

    def table(impls, shapes, flops_per, reps, wrap):
        """One row per dtype × shape × causal × contender, jax.nn xla first (the baseline)."""
        for dt in ("bfloat16", "float32"):
            for (B, T, N, H) in shapes:
                for causal in (False, True):
                    q = jnp.asarray(rng.standard_normal((B, T, N, H)), dt)
                    flops = flops_per * B * T * T * N * H / (2 if causal else 1)
                    base = None
                    for name, f in sorted(impls.items(), key=lambda kv: kv[0] != "jax.nn xla"):
                        try:
                            t = bench(wrap(f, causal), q, q, q, reps=reps)
                        except Exception as e:
                            lines.append(f"| {dt} | {B}·{T}·{N}·{H} | {causal} | {name} | — | — | {type(e).__name__} |")
                            print(lines[-1], flush=True)
                            continue
                        base = t if name == "jax.nn xla" else base
                        rel = f"{base / t:.2f}×" if base else "—"
                        lines.append(f"| {dt} | {B}·{T}·{N}·{H} | {causal} | {name} | {t * 1e3:.3f} | "
                                     f"{flops / t / 1e12:.1f} | {rel} |")
                        print(lines[-1], flush=True)

    lines += ["", "## Timing (median of 20, after 2 warm-ups)", "",
              "| dtype | B·T·N·H | causal | impl | ms | TFLOP/s | vs jax.nn xla |", "|---|---|---|---|---:|---:|---:|"]
    impls = {
        "moajax": lambda q, k, v, c: moajax.dot_product_attention(q, k, v, is_causal=c),
        # the masked tiles walked and masked (Preset skip=False): what skipping them buys
        "moajax no skip": lambda q, k, v, c: moajax.dot_product_attention(q, k, v, is_causal=c,
                                                                          onf=Preset.of(skip=False)),
        # the interior tiles walked without the mask (off by default on a GPU until timed here)
        "moajax interior unmasked": lambda q, k, v, c: moajax.dot_product_attention(
            q, k, v, is_causal=c, onf=Preset.of(unmask_interior=True)),
        # the second GPU path: the ONF's Triton source launched by jax-triton, its tiling
        # spill-checked through that compiler (Machine.gpu_path; it can differ from Pallas')
        "moajax triton": lambda q, k, v, c: moajax.dot_product_attention(q, k, v, is_causal=c,
                                                                         implementation="triton"),
        "jax.nn xla": lambda q, k, v, c: jax.nn.dot_product_attention(q, k, v, is_causal=c, implementation="xla"),
        "jax.nn cudnn": lambda q, k, v, c: jax.nn.dot_product_attention(q, k, v, is_causal=c, implementation="cudnn"),
    }
    table(impls, ((4, 2048, 16, 64), (1, 8192, 16, 128), (1, 16384, 8, 64)), 4, 20,
          lambda f, c: jax.jit(lambda a, b, d: f(a, b, d, c)))
    # jit(grad) of attention under each of the seed's backward ONFs (plans of the derived
    # adjoint: "atomic", "split", "owner" — the default) against jax.grad of jax.nn
    lines += ["", "## jit(grad) w.r.t. q, k, v: the backward ONFs (median of 10, after 2 warm-ups)", "",
              "| dtype | B·T·N·H | causal | impl | ms | TFLOP/s (14·B·T²·N·H) | vs jax.nn xla |",
              "|---|---|---|---|---:|---:|---:|"]
    grads = {f"moajax {b}": (lambda b: lambda q, k, v, c: moajax.dot_product_attention(
        q, k, v, is_causal=c, onf=Preset.of(backward=b)))(b) for b in ("owner", "split", "atomic")}
    grads.update({f"moajax {b} triton": (lambda b: lambda q, k, v, c: moajax.dot_product_attention(
        q, k, v, is_causal=c, onf=Preset.of(backward=b), implementation="triton"))(b)
        for b in ("owner", "split", "atomic")})
    grads["moajax owner, interior unmasked"] = lambda q, k, v, c: moajax.dot_product_attention(
        q, k, v, is_causal=c, onf=Preset.of(backward="owner", unmask_interior=True))
    grads.update({f"jax.nn {i}": (lambda i: lambda q, k, v, c: jax.nn.dot_product_attention(
        q, k, v, is_causal=c, implementation=i))(i) for i in ("xla", "cudnn")})
    table(grads, ((1, 4096, 8, 64),), 14, 10, lambda f, c: jax.jit(jax.grad(
        lambda a, b, d: jnp.sum(f(a, b, d, c).astype(jnp.float32)), argnums=(0, 1, 2))))
    # the fused forward+backward (one head, atomics) against jax.grad of jax.nn (XLA), float32
    lines += ["", "| fused fwd+bwd | T·H | impl | ms | vs jax.grad(jax.nn xla) |", "|---|---|---|---:|---:|"]
    for T, H in ((2048, 64), (8192, 64)):
        q = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
        onf = schedule.derive(attention_forward_backward.dnf(q, q, q, q), machine)
        ours = jax.jit(pallas_kernels.lower(onf))

        def ref(a, b, c, g):
            out, vjp = jax.vjp(lambda x, y, z: jax.nn.dot_product_attention(
                x[None, :, None], y[None, :, None], z[None, :, None], implementation="xla")[0, :, 0], a, b, c)
            return (out,) + vjp(g)

        times = {}
        for name, f in (("jax.grad jax.nn xla", jax.jit(ref)), ("moajax (atomic ONF)", ours)):
            try:
                times[name] = bench(f, q, q, q, q, reps=10)
            except Exception as e:
                lines.append(f"| fused fwd+bwd | {T}·{H} | {name} | — | {type(e).__name__} |")
                continue
            base = times.get("jax.grad jax.nn xla")
            lines.append(f"| fused fwd+bwd | {T}·{H} | {name} | {times[name] * 1e3:.3f} | "
                         f"{(base / times[name]) if base else float('nan'):.2f}× |")
            print(lines[-1], flush=True)
    # issue 11 on the GPU: a decode step over a ragged batch (split-K by the schedule, the
    # parts past each length skipped) and the block's jit(grad), each beside jax.nn
    lines += ["", "| issue 11 | shape | impl | ms | vs jax.nn |", "|---|---|---|---:|---:|"]
    B, S, N, K, H = 8, 32768, 32, 8, 128
    q = jnp.asarray(rng.standard_normal((B, N, H)), jnp.bfloat16)
    kc = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.bfloat16)
    lengths = jnp.asarray(rng.integers(S // 4, S + 1, B), jnp.int32)
    T, D, F = 4096, 512, 1408
    x = jnp.asarray(rng.standard_normal((1, T, D)), jnp.float32)
    shapes = {"attn_norm": (D,), "wq": (D, 8, 64), "wk": (D, 8, 64), "wv": (D, 8, 64), "wo": (8, 64, D),
              "mlp_norm": (D,), "w_gate": (D, F), "w_up": (D, F), "w_down": (F, D)}
    p = {k: jnp.asarray(rng.standard_normal(v) / np.sqrt(v[0]), jnp.float32) for k, v in shapes.items()}

    from plain_block import plain_block

    def grad_of(f):
        return jax.jit(jax.grad(lambda p, x: jnp.sum(f(p, x)), argnums=(0, 1)))

    cases = [
        (f"decode B={B} S={S} N={N} K={K} H={H} bf16", (q, kc, kc, lengths), {
            "jax.nn": jax.jit(lambda q, k, v, l: jax.nn.dot_product_attention(
                q[:, None], k, v, key_value_seq_lengths=l)[:, 0]),
            "moajax": jax.jit(moajax.decode_attention)}),
        (f"block grad T={T} D={D} 8×64 F={F} f32", (p, x), {
            "jax.nn": grad_of(plain_block),
            "moajax": grad_of(lambda p, x: moajax.transformer_block(p, x, is_causal=True))}),
    ]
    for label, args, fns in cases:
        base = None
        for name, f in fns.items():
            try:
                t = bench(f, *args, reps=10)
            except Exception as e:
                lines.append(f"| issue 11 | {label} | {name} | — | {type(e).__name__} |")
                print(lines[-1], flush=True)
                continue
            base = t if name == "jax.nn" else base
            lines.append(f"| issue 11 | {label} | {name} | {t * 1e3:.3f} | {(base / t) if base else float('nan'):.2f}× |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    out = Path(os.environ.get("OUT", ROOT / "bench" / "results")) / "gpu_check.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
