#!/usr/bin/env python3
"""Where the time of attention's gradient goes on a GPU, kernel by kernel, and which tiling
of each backward kernel is fastest: one process, the contenders of each group alternated.

For B = 1, S = T, N heads of H (defaults: the first H200 run's 4096, 8, 64), each dtype:

1. ``jit(grad)`` of moajax (the owner plan) beside jax.grad of jax.nn (xla; cudnn for 16-bit);
2. each kernel alone: the plain forward, the saving forward, the owner plan's dQ kernel and
   its dK/dV kernel (their ONFs as derived for this GPU), with their own flop counts;
3. each backward kernel under other tilings (Preset tiles and knobs): rows × walk tile,
   warps, stages; the derived one first; each under both ``Knobs.dot_layout``.

Writes ``gpu_backward_sweep.md`` to $OUT (or bench/results/) after each part.

``--ptx ARCH`` (offline, no GPU: jaxlib's Triton and ptxas, JAX_PLATFORMS=cpu) times nothing: for
the same kernels and tilings it reports ptxas' registers and spill bytes for ARCH, the H200's
profile deriving (``gpu_backward_sweep_ptx_ARCH.md``), and their tensor-core instructions: what a
tiling costs in registers, and whether its dots reach wgmma, before a GPU times it.

    python scripts/gpu_backward_sweep.py [--S 4096] [--budget 240] [--quick]
    JAX_PLATFORMS=cpu python scripts/gpu_backward_sweep.py --ptx sm_90a
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


# the other tilings tried of each backward kernel: (rows, walk tile, warps, stages)
# (64, 32, 8, 2): the H200's derived bfloat16 dK/dV tiling before its profile's own 64 × 64
# with 4 warps (configs/h200.toml, from this sweep's run of 2026-12-04), timed beside it
TILINGS = ((64, 64, 4, 2), (64, 64, 8, 2), (128, 64, 8, 2), (64, 128, 8, 2),
           (128, 128, 8, 2), (128, 32, 8, 3), (32, 64, 4, 3), (128, 64, 4, 3), (64, 32, 8, 2))


def owner_plan(specs, machine):
    """(the plain forward's ONF, the saving forward's, the owner plan's backward ONFs) of
    attention for these specs on ``machine``."""
    from moajax import compat, schedule
    from moajax.kernels.attention import mha_kernel
    from moajax.schedule import Preset

    with compat.enable_x64_context(True):
        kern = mha_kernel(None, None, False)
        fwd_dnf, saving_dnf = kern.dnf(*specs), kern.with_row_statistics(()).dnf(*specs)
        adj, adj_args = kern.saved_adjoint(*specs)
        adj_dnf = adj.dnf(*adj_args)
    plan = schedule.derive_plan(adj_dnf, machine, Preset.of(plan="owner"))
    return schedule.derive(fwd_dnf, machine), schedule.derive(saving_dnf, machine), (
        plan if isinstance(plan, tuple) else (plan,))


def tilings(o, machine, quick_limit=None, layouts=("operands", "tile")):
    """name → the backward kernel ``o`` re-derived under each of ``TILINGS`` (or the exception
    that refused it), the derived ONF first; each under every ``Knobs.dot_layout`` of
    ``layouts`` (a name ends in ", tile dots" for "tile")."""
    from moajax import rewrites, schedule
    from moajax.schedule import Preset

    rows = next(a for a in o.axes if a.role == "grid" and a.tile > 1)
    walk = next(a for a in o.axes if a.role == "sequential")
    out = {}
    for layout in layouts:
        tail = "" if layout == "operands" else f", {layout} dots"
        out["derived" + tail] = rewrites.with_knobs(o, dot_layout=layout) if o.knobs.dot_layout != layout else o
        for (bt, bs, w, st) in TILINGS:
            if quick_limit is not None and bt > quick_limit:
                continue
            name = f"{rows.name} {bt} × {walk.name} {bs}, {w} warps, {st} stages{tail}"
            try:
                out[name] = schedule.derive(o.dnf, machine, Preset.of(tiles={rows.name: bt, walk.name: bs},
                                                                    num_warps=w, num_stages=st, dot_layout=layout))
            except Exception as e:
                out[name] = e
    return out


def ptx_report(args):
    """Registers and spills of each backward kernel's tilings for one arch, offline."""
    import jax

    from moajax import machines, ptx

    S, N, H = (256, 2, 32) if args.quick else (args.S, args.heads, args.head_dim)
    machine = machines.load("h200")
    lines = [f"# Attention's backward kernels under other tilings: ptxas for {args.ptx}, offline",
             "", f"jaxlib {ptx.jaxlib_version_text()}, {ptx.ptxas_version()}; "
             f"{datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d')}. B = 1, S = T = {S}, N = {N}, "
             f"H = {H}; the owner plan's kernels as the {machine.name} profile derives them, then each tiling of "
             "`scripts/gpu_backward_sweep.py` (the ones its timed run tries). Registers a thread, and spill "
             "stores/loads in bytes, and its tensor-core instructions (static counts in the PTX: Hopper's "
             "`wgmma.mma_async`, and `mma.sync`, Ampere's, which sm_90a falls back to for a dot wgmma cannot "
             "take), per kernel the ONF launches. \"tile dots\": `Knobs.dot_layout = \"tile\"`.", "",
             "| dtype | kernel | tiling | registers | spill stores | spill loads | wgmma | mma.sync |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for dt in ("bfloat16", "float32"):
        specs = [jax.ShapeDtypeStruct((1, S, N, H), dt)] * 3
        for o in owner_plan(specs, machine)[2]:
            for name, alt in tilings(o, machine, S // 2 if args.quick else None).items():
                if isinstance(alt, Exception):
                    lines.append(f"| {dt} | {o.dnf.name} | {name} | {type(alt).__name__}: "
                                 f"{str(alt).splitlines()[0][:80]} | | | | |")
                    continue
                for r in ptx.onf_reports(alt, args.ptx):
                    lines.append(f"| {dt} | {o.dnf.name} | {name} | {r.registers} | {r.spill_stores} | {r.spill_loads} "
                                 f"| {r.wgmma} | {r.mma_sync} |")
    out = Path(args.out) / f"gpu_backward_sweep_ptx_{args.ptx}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--S", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--budget", type=float, default=240.0, help="seconds; later groups are skipped past it")
    ap.add_argument("--quick", action="store_true", help="small sizes: a dry run of the script")
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "results")))
    ap.add_argument("--ptx", default="", help="an arch (sm_80, sm_86, sm_90a): registers and spills, offline")
    args = ap.parse_args()
    if args.ptx:
        return ptx_report(args)

    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np

    import moajax
    import pallas_kernels
    from moajax import machines
    from moajax.schedule import Preset
    from moajax.timing import alternating

    t0 = time.perf_counter()
    S, N, H = (256, 2, 32) if args.quick else (args.S, args.heads, args.head_dim)
    out = Path(args.out) / "gpu_backward_sweep.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    dev = jax.devices()[0]
    gpu = dev.platform in ("gpu", "cuda")
    # without a GPU (a dry run of the script): the H200's ONFs under Pallas' interpreter
    machine = machines.for_device(dev) if gpu else machines.load("h200")
    lines = [f"# Attention's gradient kernel by kernel: {getattr(dev, 'device_kind', dev)}, JAX {jax.__version__}, "
             f"{datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
             "", f"B = 1, S = T = {S}, N = {N}, H = {H}, not causal; profile {machine.name}; medians of alternated "
             "rounds; TFLOP/s counts each program's own flops (forward 4·S²·N·H, dQ kernel 6·, dK/dV kernel 8·, "
             "jit(grad) 14·, jax.nn's gradient counted the same).", ""]

    def say(*ls):
        for line in ls:
            lines.append(line)
            print(line, flush=True)

    def flush():
        say("", f"({time.perf_counter() - t0:.0f} s into the run)")
        out.write_text("\n".join(lines) + "\n")

    rng = np.random.default_rng(0)

    def inputs(specs):
        xs = []
        for s in specs:
            x = rng.standard_normal(s.shape)
            if s.name.startswith("saved"):  # row statistics: a max and a positive sum
                x = np.abs(x) + 1.0
            xs.append(jnp.asarray(x, s.dtype))
        return xs

    def race(group, fns, a, flops, reps=20):
        ready = {}
        for name, f in fns.items():
            try:
                ready[name] = jax.jit(f).lower(*a).compile()
            except Exception as e:
                traceback.print_exc()
                say(f"| {group} | {name} | — | — | {type(e).__name__}: {str(e).splitlines()[0][:90] if str(e) else ''} |")
        if not ready:
            return {}
        times = {n: statistics.median(ts) for n, ts in alternating(ready, a, reps=reps, warmups=2).items()}
        best = min(times.values())
        for n, t in times.items():
            fl = flops[n] if isinstance(flops, dict) else flops
            say(f"| {group} | {n} | {t * 1e3:.3f} | {fl / t / 1e12:.1f} | {best / t:.2f} |")
        return times

    head = ["| group | contender | ms | TFLOP/s | best ÷ this |", "|---|---|---:|---:|---:|"]
    base = 2.0 * S * S * N * H  # one S×S×H contraction
    for dt in ("bfloat16", "float32"):
        if time.perf_counter() - t0 > args.budget:
            say("", f"## {dt}: not run (budget)")
            continue
        say("", f"## {dt}", "", *head)
        specs = [jax.ShapeDtypeStruct((1, S, N, H), dt)] * 3
        q, k, v = (jnp.asarray(rng.standard_normal((1, S, N, H)), dt) for _ in range(3))

        def loss(f):
            return jax.grad(lambda a, b, c: jnp.sum(f(a, b, c).astype(jnp.float32)), argnums=(0, 1, 2))

        con = {"moajax owner": loss(lambda a, b, c: moajax.dot_product_attention(a, b, c, onf=Preset.of(backward="owner"))),
               "jax.nn xla": loss(lambda a, b, c: jax.nn.dot_product_attention(a, b, c, implementation="xla"))}
        if dt != "float32":
            con["jax.nn cudnn"] = loss(lambda a, b, c: jax.nn.dot_product_attention(a, b, c, implementation="cudnn"))
        race("jit(grad)", con, (q, k, v), 7 * base)
        # the kernels one by one, as derived for this GPU
        fwd, saving, plan = owner_plan(specs, machine)
        fwds = (fwd, saving)
        say("", "Derived: " + "; ".join(f"`{o.dnf.name}`: " + ", ".join(
            f"{a.name} {a.role} {a.tile}" for a in o.axes if a.extent > 1 and a.tile > 1)
            + f", {o.knobs.num_warps} warps, {o.knobs.num_stages} stages" for o in fwds + plan), "", *head)
        for o in fwds + plan:
            a = inputs(o.dnf.inputs)
            kind = "dk_dv" if "d_key" in o.dnf.name else "dq" if "d_query" in o.dnf.name else "fwd"
            race(o.dnf.name, {"derived": pallas_kernels.lower(o, interpret=not gpu)}, a,
                 {"fwd": 2, "dq": 3, "dk_dv": 4}[kind] * base)
        flush()
        # other tilings of each backward kernel
        for o in plan:
            if time.perf_counter() - t0 > args.budget:
                say(f"| {o.dnf.name} | (tilings not run: budget) | | | |")
                continue
            variants = {}
            for name, alt in tilings(o, machine, S // 2 if args.quick else None).items():
                if isinstance(alt, Exception):
                    say(f"| {o.dnf.name} | {name} | — | — | {type(alt).__name__}: {str(alt).splitlines()[0][:90]} |")
                else:
                    variants[name] = pallas_kernels.lower(alt, interpret=not gpu)
            kind = "dk_dv" if "d_key" in o.dnf.name else "dq"
            race(o.dnf.name, variants, inputs(o.dnf.inputs), {"dq": 3, "dk_dv": 4}[kind] * base, reps=10)
            flush()


if __name__ == "__main__":
    main()
