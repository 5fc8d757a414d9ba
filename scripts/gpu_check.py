#!/usr/bin/env python3
"""GPU check on a real NVIDIA GPU (the lent H200, a Delta node): correctness, then timing.

Sections, most wanted first, each written to ``gpu_check.md`` as soon as it ends (a run cut
short keeps what it finished), each skipped once the time budget (``--budget``) is spent:

1. the forward Pallas kernel against the float64 NumPy reference (float64/32, bfloat16,
   float16; causal, GQA, head dim 72, T ≠ S);
2. ``jax.grad`` under each backward ONF (owner, split, atomic) against the float64 backward;
3. the fused forward+backward's atomic ONF (paper II) against the float64 references;
4. issue 10's targets: ``jit(grad)`` at S = 1024, 4096, 8192 (B = 1, N = 8, H = 64) under
   each backward ONF beside ``jax.grad`` of jax.nn (xla, cudnn), alternated in one process,
   with each compiled program's temp memory; moajax's temp memory at S = 16384 and 32768;
5. the forward beside jax.nn at transformer sizes;
6. the fused forward+backward's time; issue 11's decode and block gradient; RMSNorm→matmul in
   bfloat16 against the two ops in XLA; RMSNorm alone and its gradient (both residual policies)
   against XLA, its dX kernel under the default ONF beside one row a program; the gated MLP's
   bfloat16 gradient against XLA.

float32 follows ``jax.default_matmul_precision`` in moajax as in jax.nn: under JAX's default
both take TF32 dots on this GPU; "ieee" rows run under ``jax.default_matmul_precision
("highest")`` (IEEE float32). The correctness rows "float32" are IEEE, "float32 tf32" the default.

Timing: the contenders of one row group are compiled first, then run in turn
(``moajax.timing.alternating``), the median of the rounds quoted. ``--quick`` shrinks every
size (a dry run of the script itself, on any machine). It needs only jax and numpy:

    scripts/gpu_check.sh                 # on the GPU machine; results in $OUT or bench/results/
    python scripts/gpu_check.py --quick --out DIR     # the script's own dry run, on a CPU
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "scripts")]


class Report:
    """The markdown report: lines appended, the file rewritten after each section."""

    def __init__(self, path: Path, budget_s: float, only=None):
        self.path, self.lines, self.t0, self.budget, self.only = path, [], time.perf_counter(), budget_s, only
        path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, *lines):
        for line in lines:
            self.lines.append(line)
            print(line, flush=True)

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)

    def section(self, title: str, head: str, need_s: float) -> bool:
        """Start a section if ``need_s`` seconds are left, else say it was not run."""
        self.add("", f"## {title}", "")
        if self.only and int(title.split(".")[0]) not in self.only:
            self.add("Not run: not asked for (--only).")
            return False
        if self.left() < need_s:
            self.add(f"Not run: {self.left():.0f} s of the {self.budget:.0f} s budget left, it needs about {need_s:.0f}.")
            return False
        self.add(head, _rule(head))
        return True

    def flush(self):
        self.add("", f"({time.perf_counter() - self.t0:.0f} s into the run)")
        self.path.write_text("\n".join(self.lines) + "\n")


def _rule(head: str) -> str:
    cells = head.strip("|").split("|")
    return "|" + "|".join("---:" if c.strip() in ("ms", "rel. error", "bound", "TFLOP/s", "temp MiB",
                                                   "vs jax.nn xla", "vs jax.nn") or "×" in c else "---"
                          for c in cells) + "|"


def _fail(e: Exception) -> str:
    traceback.print_exc()
    return f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=float(os.environ.get("GPU_CHECK_BUDGET", 400)),
                    help="seconds; a section that would not fit is skipped (default 400)")
    ap.add_argument("--quick", action="store_true", help="every size small: a dry run of the script")
    ap.add_argument("--only", type=int, nargs="*", default=None, help="run only these sections (numbers)")
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "results")))
    args = ap.parse_args()

    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np

    import moajax
    import references as R
    from moajax import machines, ptx, schedule
    from moajax.kernels import attention_forward_backward
    from moajax.schedule import Preset
    from moajax.timing import alternating

    quick = args.quick
    rep = Report(Path(args.out) / "gpu_check.md", args.budget, args.only)
    dev = jax.devices()[0]
    rep.add(f"# GPU check: {getattr(dev, 'device_kind', dev)}, JAX {jax.__version__}, "
            f"{datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}"
            + (" (--quick: small sizes)" if quick else ""), "")
    # the GPU's profile derives its tilings with the spill check (machines.for_device): say
    # whether this machine's toolchain let it run, and with which ptxas
    missing = ptx.toolchain_missing()
    rep.add(f"Spill check of the derived tilings: {f'off, {missing}' if missing else f'on, ptxas {ptx.ptxas_version()}'}.")
    machine = machines.for_device(dev)
    rep.add(f"Machine profile: {machine.name}.")
    rng = np.random.default_rng(0)
    bounds = {"float64": 1e-12, "float32": 2e-6, "bfloat16": 2e-2, "float16": 4e-3,
              # TF32 keeps 10 mantissa bits: 2⁻¹¹ per rounded input, through QKᵀ, exp and PV
              "float32 tf32": 5e-3}
    # gradients: one more rounding chain than the forward (P recomputed, dS = P (dP − Δ));
    # TF32: dP and dS's two dots round their inputs to 10 mantissa bits again
    grad_bounds = {"float64": 1e-12, "float32": 1e-5, "bfloat16": 3e-2, "float16": 6e-3, "float32 tf32": 1e-2}
    bad = []  # the correctness rows over their bound

    def rel(got, want):
        got = np.asarray(got, np.float64)
        if not np.all(np.isfinite(got)):
            return float("inf")
        return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))

    def draw(shape, dt):
        return jnp.asarray(rng.standard_normal(shape), dt)

    def precision(dt):
        """The matmul precision a correctness row runs under: "float32" IEEE float32
        (jax.default_matmul_precision("highest")); "float32 tf32" JAX's default, TF32 dots on
        this GPU (moajax's float32 dots follow the config, as XLA's)."""
        return jax.default_matmul_precision("highest") if dt == "float32" else contextlib.nullcontext()

    def ieee(f):
        """f traced under jax.default_matmul_precision("highest"): IEEE float32 dots."""
        def g(*a):
            with jax.default_matmul_precision("highest"):
                return f(*a)
        return g

    def check(before, label, after, bound, error):
        """One correctness row: ``error()`` is the relative error against the float64
        reference; a failure is a finding, recorded in the row (NaN, not ok)."""
        try:
            err = error()
        except Exception as e:
            err, label = float("nan"), f"{label}: {_fail(e)}"
        ok = err <= bound
        bad.extend([] if ok else [label])
        rep.add("| " + " | ".join([*before, label, *after, f"{err:.2e}", f"{bound:.0e}", "yes" if ok else "NO"]) + " |")

    # ---- 1. forward correctness
    cases = [("plain", dict(B=2, T=256, S=256, N=4, K=4, H=64)),
             ("causal GQA T≠S", dict(B=1, T=200, S=333, N=8, K=2, H=64, causal=True)),
             ("head dim 72", dict(B=1, T=128, S=96, N=2, K=1, H=72))]

    def forward_error(dt, c):
        causal = c.get("causal", False)
        q, k, v = (draw((c["B"], L, n, c["H"]), dt.split()[0])
                   for L, n in ((c["T"], c["N"]), (c["S"], c["K"]), (c["S"], c["K"])))
        with precision(dt):
            out = jax.jit(lambda a, b, d: moajax.dot_product_attention(a, b, d, is_causal=causal))(q, k, v)
        return rel(out, R.mha(*(np.asarray(x.astype(jnp.float64)) for x in (q, k, v)), is_causal=causal))

    if rep.section("1. Forward: Pallas kernel against the float64 NumPy reference",
                   "| dtype | case | rel. error | bound | ok |", 20):
        for dt, bound in bounds.items():
            for label, c in cases:
                check([dt], label, [], bound, lambda: forward_error(dt, c))
        rep.flush()

    # ---- 2. gradient correctness under each backward ONF
    def grad_error(plan, dt, c):
        causal = c.get("causal", False)
        dtype = dt.split()[0]
        q = draw((c["B"], c["T"], c["N"], c["H"]), dtype)
        k, v = (draw((c["B"], c["S"], c["K"], c["H"]), dtype) for _ in range(2))
        g = draw((c["B"], c["T"], c["N"], c["H"]), dtype)
        # the cotangent is g itself, unrounded: the product summed in at least float32
        acc = jnp.promote_types(dtype, jnp.float32)
        f = jax.jit(jax.grad(lambda a, b, d: jnp.sum((moajax.dot_product_attention(
            a, b, d, is_causal=causal, onf=Preset.of(backward=plan)) * g).astype(acc)), argnums=(0, 1, 2)))
        want = R.mha_backward(*(np.asarray(x.astype(jnp.float64)) for x in (q, k, v, g)), is_causal=causal)
        with precision(dt):
            got = f(q, k, v)
        return max(rel(a, b) for a, b in zip(got, want))

    if rep.section("2. jax.grad under each backward ONF against the float64 backward (worst of dq, dk, dv)",
                   "| backward | dtype | case | rel. error | bound | ok |", 30):
        for plan in ("owner", "split", "atomic"):
            for dt in ("float32", "bfloat16", "float64") + (("float32 tf32",) if plan == "owner" else ()):
                for label, c in cases[:2]:
                    check([plan, dt], label, [], grad_bounds[dt], lambda: grad_error(plan, dt, c))
        rep.flush()

    # ---- 3. the fused forward+backward (paper II): dK, dV scatter-added with atomics
    import pallas_kernels

    # without a GPU (the --quick dry run) the Pallas kernel is an A100 profile's, interpreted
    on_gpu = dev.platform == "gpu"
    pallas_machine = machine if on_gpu else machines.load("delta-a100")

    def fused_error(dt, T, S, H, causal):
        a = [draw(s_, dt) for s_ in ((T, H), (S, H), (S, H), (T, H))]
        with precision(dt):
            onf = schedule.derive(attention_forward_backward.dnf(*a, is_causal=causal), pallas_machine)
        got = jax.jit(pallas_kernels.lower(onf, interpret=not on_gpu))(*a)
        a64 = [np.asarray(x.astype(jnp.float64)) for x in a]
        want = (R.attention(*a64[:3], is_causal=causal),) + R.attention_backward(*a64, is_causal=causal)
        return max(rel(g, w) for g, w in zip(got, want))

    if rep.section(f"3. Fused forward+backward, atomic scatter-add ONF ({machine.name} profile)",
                   "| dtype | T·S·H | causal | rel. error | bound | ok |", 20):
        for dt in (d for d in bounds if " " not in d):
            for (T, S, H, causal) in (((128, 128, 32, False), (60, 140, 24, True)) if quick else
                                      ((512, 512, 64, False), (300, 700, 72, True))):
                check([dt], f"{T}·{S}·{H}", [str(causal)], grad_bounds[dt], lambda: fused_error(dt, T, S, H, causal))
        rep.flush()

    # ---- timing helpers
    def compiled(f, *a):
        """(compiled, temp MiB) or raises: the program compiled once, run by every timing (one
        compiled already, as it is)."""
        c = f if isinstance(f, jax.stages.Compiled) else jax.jit(f).lower(*a).compile()
        try:
            temp = c.memory_analysis().temp_size_in_bytes / 2**20
        except Exception:
            temp = float("nan")
        return c, temp

    def race(rows, contenders, a, flops, reps, base_name):
        """Compile every contender, alternate the ones that compiled, add a row each."""
        ready, temps = {}, {}
        for name, f in contenders.items():
            try:
                ready[name], temps[name] = compiled(f, *a)
            except Exception as e:
                rep.add(f"| {rows} | {name} | — | — | — | — | {_fail(e)} |")
        if not ready:
            return {}
        try:
            times = {n: statistics.median(ts) for n, ts in alternating(ready, a, reps=reps, warmups=2).items()}
        except Exception as e:  # one failing at run time: time the others alone
            rep.add(f"| {rows} | (alternation) | — | — | — | — | {_fail(e)} |")
            times = {}
            for n, c in ready.items():
                try:
                    times[n] = statistics.median(alternating({n: c}, a, reps=reps, warmups=2)[n])
                except Exception as e2:
                    rep.add(f"| {rows} | {n} | — | — | — | — | {_fail(e2)} |")
        base = times.get(base_name)
        for n, t in times.items():
            rate = f"{flops / t / 1e12:.1f}" if flops else "—"
            rep.add(f"| {rows} | {n} | {t * 1e3:.3f} | {rate} | {temps[n]:.0f} | "
                    f"{f'{base / t:.2f}×' if base else '—'} | |")
        return times

    def grad_fn(attn):
        return jax.grad(lambda a, b, d: jnp.sum(attn(a, b, d).astype(jnp.float32)), argnums=(0, 1, 2))

    def moajax_attn(causal, **kw):
        return lambda a, b, d: moajax.dot_product_attention(a, b, d, is_causal=causal, **kw)

    def jaxnn_attn(causal, impl):
        return lambda a, b, d: jax.nn.dot_product_attention(a, b, d, is_causal=causal, implementation=impl)

    # ---- 4. issue 10's targets: jit(grad) per backward ONF beside jax.grad of jax.nn
    N, H = (2, 32) if quick else (8, 64)
    sizes = (128, 256) if quick else (1024, 4096, 8192)
    head = "| dtype, S, causal | impl | ms | TFLOP/s | temp MiB | vs jax.nn xla | error |"
    if rep.section(f"4. jit(grad) w.r.t. q, k, v (B = 1, N = {N}, H = {H}): the backward ONFs beside jax.grad "
                   "of jax.nn; TFLOP/s counts 14·T·S·N·H (halved when causal); median of alternated rounds; "
                   "float32 at JAX's default matmul precision (TF32 dots, moajax's as XLA's) but the ieee rows",
                   head, 40):
        causal_speedup = {}
        for dt in ("float32", "bfloat16"):
            for S in sizes:
                if dt == "bfloat16" and S != sizes[1]:
                    continue
                for causal in (False, True):
                    if rep.left() < 15:
                        rep.add(f"| {dt}, {S}, {causal} | (not run: time) | | | | | |")
                        continue
                    q, k, v = (draw((1, S, N, H), dt) for _ in range(3))
                    con = {f"moajax {b}": grad_fn(moajax_attn(causal, onf=Preset.of(backward=b)))
                           for b in ("owner", "split", "atomic")}
                    # the dots in tile layout (Knobs.dot_layout): dK/dV's scores as K·Qᵀ, rows
                    # its own keys, so that Hopper's wgmma takes them (mma.sync under Q·Kᵀ)
                    con["moajax owner tile dots"] = grad_fn(moajax_attn(causal, onf=Preset.of(
                        backward="owner", dot_layout="tile")))
                    if dt == "float32":  # both at IEEE float32 (the rows above: TF32 dots, JAX's default)
                        con["moajax owner ieee"] = ieee(grad_fn(moajax_attn(causal, onf=Preset.of(backward="owner"))))
                        con["jax.nn xla ieee"] = ieee(grad_fn(jaxnn_attn(causal, "xla")))
                    if dt == "bfloat16":  # holding nothing: the saving forward rerun in the backward
                        # ("none", 2026-12-07) against the adjoint recomputing max, ℓ and Δ itself
                        for res in ("none", "recompute"):
                            con[f"moajax owner residuals {res}"] = grad_fn(moajax_attn(causal, onf=Preset.of(
                                backward="owner", residuals=res)))
                    con["jax.nn xla"] = grad_fn(jaxnn_attn(causal, "xla"))
                    if dt != "float32":  # cuDNN's fused attention takes 16-bit inputs only
                        con["jax.nn cudnn"] = grad_fn(jaxnn_attn(causal, "cudnn"))
                    flops = 14 * S * S * N * H / (2 if causal else 1)
                    t = race(f"{dt}, {S}, {causal}", con, (q, k, v), flops, 5 if S >= 8192 else 10, "jax.nn xla")
                    if "moajax owner" in t:
                        causal_speedup[(dt, S, causal)] = t["moajax owner"]
        # GQA training (never timed on a GPU before): the group's query heads share each kv
        # head's dK and dV tiles; bfloat16, N query heads over N / 4 kv heads
        S, K = sizes[1], max(1, N // 4)
        for causal in (False, True):
            if rep.left() < 15:
                rep.add(f"| bfloat16, {S}, {causal}, GQA {N}/{K} | (not run: time) | | | | | |")
                continue
            q = draw((1, S, N, H), "bfloat16")
            k, v = (draw((1, S, K, H), "bfloat16") for _ in range(2))
            con = {"moajax owner": grad_fn(moajax_attn(causal)),
                   "moajax owner tile dots": grad_fn(moajax_attn(causal, onf=Preset.of(dot_layout="tile"))),
                   # dK's two terms of dS under Σ_g in one walk (rewrites.fuse_sums: the CPU's
                   # default; offline fewer registers on every GPU profile: fuse_sums_gpu.md)
                   "moajax owner one walk": grad_fn(moajax_attn(causal, onf=Preset.of(fuse_sums=True))),
                   "jax.nn xla": grad_fn(jaxnn_attn(causal, "xla")),
                   "jax.nn cudnn": grad_fn(jaxnn_attn(causal, "cudnn"))}
            race(f"bfloat16, {S}, {causal}, GQA {N}/{K}", con, (q, k, v),
                 14 * S * S * N * H / (2 if causal else 1), 10, "jax.nn xla")
        # float32 GQA under each backward ONF: on the H200 the atomic and split plans hold the
        # group whole, 3-D tiles contracted as 2-D dots (``Backend.joint_sums``; never timed)
        if rep.left() < 15:
            rep.add(f"| float32, {S}, True, GQA {N}/{K} | (not run: time) | | | | | |")
        else:
            q = draw((1, S, N, H), "float32")
            k, v = (draw((1, S, K, H), "float32") for _ in range(2))
            con = {f"moajax {b}": grad_fn(moajax_attn(True, onf=Preset.of(backward=b)))
                   for b in ("owner", "split", "atomic")}
            # (dK + dV offline: 166-169 registers in one walk against 254-255 in two)
            con["moajax owner one walk"] = grad_fn(moajax_attn(True, onf=Preset.of(backward="owner", fuse_sums=True)))
            con["jax.nn xla"] = grad_fn(jaxnn_attn(True, "xla"))
            race(f"float32, {S}, True, GQA {N}/{K}", con, (q, k, v), 14 * S * S * N * H / 2, 10, "jax.nn xla")
        # a score_mod closing over an array (ALiBi's slopes, B = 2): its gradient joins dQ and dK
        # under "atomic" and "split" (each program adds its partial over its own query tile,
        # batch element and head), under "owner" it is a split-K kernel of its own (never
        # timed); jax.nn takes ALiBi as a materialised [1 N T S] bias, whose gradient it computes
        if rep.left() < 15:
            rep.add(f"| bfloat16, {S}, True, B = 2, ALiBi | (not run: time) | | | | | |")
        else:
            q, k, v = (draw((2, S, N, H), "bfloat16") for _ in range(3))
            slopes = jnp.asarray(2.0 ** -np.arange(1, N + 1), jnp.float32)

            def alibi_grad(plan):
                def loss(a, b, d, c):
                    mod = lambda s, bi, h, i, j: s + c[h] * (j - i).astype(s.dtype)  # noqa: E731
                    return jnp.sum(moajax.dot_product_attention(
                        a, b, d, is_causal=True, score_mod=mod, onf=Preset.of(backward=plan)).astype(jnp.float32))
                return jax.grad(loss, argnums=(0, 1, 2, 3))

            def jaxnn_alibi(a, b, d, c):
                pos = jnp.arange(S)
                bias = (c[:, None, None] * (pos[None, None, :] - pos[None, :, None]))[None].astype(a.dtype)
                return jnp.sum(jax.nn.dot_product_attention(a, b, d, bias, is_causal=True).astype(jnp.float32))

            # and inside 4 documents masked FlexAttention's way (−∞: a mask on data beside the
            # slopes, whose gradient kernel spilled 1 KB a thread offline before 2026-12-05)
            doc = jnp.asarray(np.arange(S) * 4 // S, jnp.int32)

            def alibi_documents(a, b, d, c):
                mod = lambda s, bi, h, i, j: jnp.where(  # noqa: E731
                    doc[i] == doc[j], s + c[h] * (j - i).astype(s.dtype), -jnp.inf)
                return jnp.sum(moajax.dot_product_attention(a, b, d, is_causal=True, score_mod=mod).astype(jnp.float32))

            def without_the_test(fn):
                """``fn`` traced with the slopes taken finite, as before 2026-12-05: one kernel,
                no run-time test of the slopes for ±∞ (a lax.cond between two kernels)."""
                from moajax.timing import one_score_mod_kernel

                def run(*a):
                    with one_score_mod_kernel():
                        return fn(*a)
                return run

            con = {f"moajax {b}": alibi_grad(b) for b in ("owner", "split", "atomic")}
            con["moajax owner, one kernel (no run-time test)"] = without_the_test(alibi_grad("owner"))
            con["moajax owner, in documents"] = jax.grad(alibi_documents, argnums=(0, 1, 2, 3))
            con["jax.nn xla"] = jax.grad(jaxnn_alibi, argnums=(0, 1, 2, 3))
            race(f"bfloat16, {S}, True, B = 2, ALiBi", con, (q, k, v, slopes), 2 * 14 * S * S * N * H / 2, 10,
                 "jax.nn xla")
        # document masking beside causal (never timed on a GPU): a bool [T, S] mask, and the same
        # mask as a score_mod's −∞ — masks on data, whose causal skips the rows' statistics guard
        # (``onf.RowGuard``, since 2026-12-05; before, their forward walked every tile)
        if rep.left() < 15:
            rep.add(f"| bfloat16, {S}, True, document mask | (not run: time) | | | | | |")
        else:
            q, k, v = (draw((1, S, N, H), "bfloat16") for _ in range(3))
            doc = jnp.asarray(np.arange(S) * 4 // S, jnp.int32)
            mask = doc[:, None] == doc[None, :]
            minus_inf = lambda s, b, h, i, j: jnp.where(doc[i] == doc[j], s, -jnp.inf)  # noqa: E731
            con = {"moajax bool mask": grad_fn(moajax_attn(True, mask=mask)),
                   "moajax score_mod −∞": grad_fn(moajax_attn(True, score_mod=minus_inf)),
                   "moajax causal, no mask": grad_fn(moajax_attn(True)),
                   "jax.nn xla": grad_fn(lambda a, b, d: jax.nn.dot_product_attention(
                       a, b, d, mask=mask, is_causal=True, implementation="xla"))}
            race(f"bfloat16, {S}, True, document mask", con, (q, k, v), 14 * S * S * N * H / 2, 10, "jax.nn xla")
        rep.add("", "Causal against non-causal, moajax owner (the skipped tiles): " + ", ".join(
            f"{dt} S = {S}: {causal_speedup[(dt, S, False)] / causal_speedup[(dt, S, True)]:.2f}×"
            for (dt, S, c) in causal_speedup if not c and (dt, S, True) in causal_speedup))
        # temp memory at long sequences (issue 10: ≤ 1 GiB at 16384, ≤ 2 GiB at 32768), and
        # the time where it fits the budget
        for S in ((512, 1024) if quick else (16384, 32768)):
            if rep.left() < 30:
                rep.add(f"| float32, {S}, True | moajax owner | (not run: time) | | | | |")
                continue
            q = draw((1, S, N, H), "float32")
            race(f"float32, {S}, True", {"moajax owner": grad_fn(moajax_attn(True))}, (q, q, q),
                 14 * S * S * N * H / 2, 3, "")
        rep.flush()

    # ---- 5. the forward beside jax.nn
    shapes = ((1, 256, 2, 32),) if quick else ((4, 2048, 16, 64), (1, 8192, 16, 128), (1, 16384, 8, 64))
    if rep.section("5. Forward beside jax.nn (median of alternated rounds); TFLOP/s counts 4·B·T²·N·H (halved when causal); "
                   "float32 at JAX's default matmul precision (TF32 dots) but the ieee rows",
                   "| dtype, B·T·N·H, causal | impl | ms | TFLOP/s | temp MiB | vs jax.nn xla | error |", 40):
        for dt in ("bfloat16", "float32"):
            for (B, T, n, h) in shapes:
                for causal in (False, True):
                    if rep.left() < 15:
                        rep.add(f"| {dt}, {B}·{T}·{n}·{h}, {causal} | (not run: time) | | | | | |")
                        continue
                    q = draw((B, T, n, h), dt)
                    con = {"moajax": moajax_attn(causal)}
                    if causal:  # the interior tiles walked without the mask (off by default on a GPU)
                        con["moajax interior unmasked"] = moajax_attn(True, onf=Preset.of(unmask_interior=True))
                    if dt == "float32":  # both at IEEE float32 (the rows above: TF32 dots, JAX's default)
                        con["moajax ieee"] = ieee(moajax_attn(causal))
                        con["jax.nn xla ieee"] = ieee(jaxnn_attn(causal, "xla"))
                        # TF32 at the 16-bit tables' tile, which the float32 table (IEEE's FMA
                        # dots) does not reach: 0 spills offline on sm_80/86/90a at H = 64
                        # (smem_sweep_tf32.md); over the A40's shared memory
                        con["moajax 128×64"] = moajax_attn(causal, onf=Preset.of(
                            target="gpu", tiles={"t": 128, "s": 64}, num_warps=8, num_stages=2))
                    con["jax.nn xla"] = jaxnn_attn(causal, "xla")
                    if dt != "float32":
                        con["jax.nn cudnn"] = jaxnn_attn(causal, "cudnn")
                    race(f"{dt}, {B}·{T}·{n}·{h}, {causal}", con, (q, q, q),
                         4 * B * T * T * n * h / (2 if causal else 1), 10, "jax.nn xla")
        rep.flush()

    # ---- 6. the fused forward+backward (one head, atomics), decode, the block's gradient
    if rep.section("6. Fused forward+backward (one head, float32), decode, the block's gradient",
                   "| case | impl | ms | TFLOP/s | temp MiB | vs jax.nn | error |", 40):
        for T, h in (((256, 32),) if quick else ((2048, 64), (8192, 64))):
            q = draw((T, h), "float32")
            # (the --quick dry run on a CPU: section 3's A100 ONF, interpreted)
            onf = schedule.derive(attention_forward_backward.dnf(q, q, q, q), pallas_machine)

            def ref(a, b, c, g):
                out, vjp = jax.vjp(lambda x, y, z: jax.nn.dot_product_attention(
                    x[None, :, None], y[None, :, None], z[None, :, None], implementation="xla")[0, :, 0], a, b, c)
                return (out,) + vjp(g)

            race(f"fused fwd+bwd T = {T}, H = {h}", {"jax.nn": ref, "moajax (atomic ONF)": pallas_kernels.lower(onf, interpret=not on_gpu)},
                 (q, q, q, q), 18 * T * T * h, 10, "jax.nn")
        B, S, n, K, h = (2, 512, 4, 2, 32) if quick else (8, 32768, 32, 8, 128)
        q = draw((B, n, h), "bfloat16")
        kc = draw((B, S, K, h), "bfloat16")
        lengths = jnp.asarray(rng.integers(S // 4, S + 1, B), jnp.int32)
        race(f"decode B={B} S={S} N={n} K={K} H={h} bf16",
             {"jax.nn": lambda q, k, v, l: jax.nn.dot_product_attention(q[:, None], k, v, key_value_seq_lengths=l)[:, 0],
              "moajax": moajax.decode_attention}, (q, kc, kc, lengths), 4 * B * S * n * h, 10, "jax.nn")
        from plain_block import plain_block

        T, D, F = (256, 64, 128) if quick else (4096, 512, 1408)
        x = draw((1, T, D), "float32")
        shp = {"attn_norm": (D,), "wq": (D, 8, D // 8), "wk": (D, 8, D // 8), "wv": (D, 8, D // 8), "wo": (8, D // 8, D),
               "mlp_norm": (D,), "w_gate": (D, F), "w_up": (D, F), "w_down": (F, D)}
        p = {k_: jnp.asarray(rng.standard_normal(s_) / np.sqrt(s_[0]), jnp.float32) for k_, s_ in shp.items()}

        def grad_of(f):
            return jax.grad(lambda p, x: jnp.sum(f(p, x)), argnums=(0, 1))

        race(f"block grad T={T} D={D} F={F} f32",
             {"jax.nn": grad_of(plain_block), "moajax": grad_of(lambda p, x: moajax.transformer_block(p, x, is_causal=True))},
             (p, x), None, 10, "jax.nn")
        # RMSNorm fused into the matmul after it, bfloat16 (128 × 128 tiles, a 64-wide walk
        # over d since 1fb135f; 32 × 128 × 16 before): against the two ops in XLA
        from moajax.kernels import rmsnorm_matmul

        n, d, f = (256, 128, 256) if quick else (4096, 1024, 4096)
        x, g, w = draw((n, d), "bfloat16"), draw((d,), "bfloat16"), draw((d, f), "bfloat16") / np.sqrt(d)

        def rms_then_dot(x, g, w):
            xf = x.astype(jnp.float32)
            z = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6) * g.astype(jnp.float32)
            return jnp.dot(z, w.astype(jnp.float32)).astype(x.dtype)

        race(f"rmsnorm→matmul n={n} d={d} f={f} bf16", {"jax.nn": rms_then_dot, "moajax": rmsnorm_matmul},
             (x, g, w), 2 * n * d * f, 20, "jax.nn")
        # RMSNorm alone over Llama's width: whole rows, 8 a program on the H200
        # (schedule.GPU_NARROW_ROWS, 2026-12-06; before, no GPU ONF fitted at d = 4096 in float32
        # and the CUDA lowering ran the CPU's XLA loops), against the op in XLA
        n, d = (256, 4096) if quick else (4096, 4096)

        def rms(x, g):
            xf = x.astype(jnp.float32)
            return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6)
                    * g.astype(jnp.float32)).astype(x.dtype)

        for dt in ("float32", "bfloat16"):
            race(f"rmsnorm n={n} d={d} {dt}", {"jax.nn": rms, "moajax": moajax.rms_norm},
                 (draw((n, d), dt), draw((d,), dt)), None, 20, "jax.nn")
        # RMSNorm's gradient under both residual policies (since 2026-12-06 "auto" saves r on a GPU:
        # the adjoint reading it runs two kernels, dX owning whole rows and dW columns; before, its
        # fused kernel walked every row's Σ_d once per column tile, 11 ms on the A100 by the
        # model at 4096 × 4096 in float32), and its dX kernel alone under two ONFs: the default's
        # rows a program against one row a program (0 spills offline); bench/results/adjoint_plans_ptx.md
        from moajax.kernels.norm import rmsnorm as rms_kernel

        def rms_grad(f):
            return jax.grad(lambda x, g, dy: jnp.sum((f(x, g) * dy).astype(jnp.float32)), argnums=(0, 1))

        for dt in ("float32", "bfloat16"):
            x, g, dy = draw((n, d), dt), draw((d,), dt), draw((n, d), dt)
            race(f"rmsnorm grad n={n} d={d} {dt}",
                 {"jax.nn": rms_grad(rms), "moajax": rms_grad(moajax.rms_norm),
                  "moajax residuals=none": rms_grad(lambda x, g: moajax.rms_norm(x, g, residuals="none")),
                  # (a GPU's "none" reruns the saving forward where its flops pay, which the H200's
                  # profile counts: 2026-12-07; "recompute" keeps what "none" ran before)
                  "moajax residuals=recompute": rms_grad(lambda x, g: moajax.rms_norm(x, g, residuals="recompute")),
                  "moajax residuals=save": rms_grad(lambda x, g: moajax.rms_norm(x, g, residuals="save"))},
                 (x, g, dy), None, 20, "jax.nn")
        # the gated MLP's gradient in bfloat16 at Llama's widths: until 2026-12-06 the A100 and the
        # H200 ran one fused kernel (64 programs owning tiles of d, walking n and f: 28.6 ms on the
        # H200 by the model), now the owner plan staging U, V, G_H (0.45 ms by the model)
        nm, dm, fm = (256, 128, 256) if quick else (4096, 1024, 4096)
        xm = draw((nm, dm), "bfloat16")
        wg, wu, wd = ((draw(s_, "bfloat16") / np.sqrt(s_[0])).astype(jnp.bfloat16) for s_ in ((dm, fm), (dm, fm), (fm, dm)))

        def mlp_xla(x, wg, wu, wd):
            return jnp.dot(jax.nn.silu(jnp.dot(x, wg)) * jnp.dot(x, wu), wd)

        def mlp_grad(f):
            return jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2, 3))

        race(f"gated_mlp grad n={nm} d={dm} f={fm} bf16", {"jax.nn": mlp_grad(mlp_xla), "moajax": mlp_grad(moajax.gated_mlp)},
             (xm, wg, wu, wd), 6 * 2 * nm * dm * fm, 20, "jax.nn")
        try:
            specs = [jax.ShapeDtypeStruct((n, d), jnp.float32), jax.ShapeDtypeStruct((d,), jnp.float32)]
            adj = rms_kernel.adjoint(*specs)
            plan = schedule.derive_plan(adj.dnf(*specs, specs[0]), pallas_machine)
            dx = next(o for o in (plan if isinstance(plan, tuple) else (plan,)) if o.dnf.name.endswith("d_x"))
            whole = schedule.derive(dx.dnf, pallas_machine, tiles={"n": 1})
            interp = not on_gpu  # (--quick on a CPU: the interpreter, a dry run)
            race(f"rmsnorm dX kernel n={n} d={d} float32",
                 {f"default ONF ({' '.join(f'{a.name} {a.tile}' for a in dx.axes)})":
                  pallas_kernels.lower(dx, interpret=interp),
                  f"one row a program ({' '.join(f'{a.name} {a.tile}' for a in whole.axes)})":
                  pallas_kernels.lower(whole, interpret=interp)},
                 [jnp.abs(draw(i.shape, "float32")) + 1 for i in dx.dnf.inputs], None, 20,
                 f"default ONF ({' '.join(f'{a.name} {a.tile}' for a in dx.axes)})")
        except Exception as e:
            rep.add(f"| rmsnorm dX kernel n={n} d={d} float32 | — | — | — | — | — | {_fail(e)} |")
        rep.flush()

    # ---- 7. a bfloat16 score_mod table's gradient: Δ read from Out (saved) or from keys (none)
    if rep.section("7. bfloat16 attention: the ALiBi slopes' gradient (and dq, dk, dv) against float64, slopes in "
                   "float32 and bfloat16, residuals save and recompute (`bench/results/table_grad_precision.md`, the "
                   "H200's schedule in interpret mode: float32 slopes 1.1e-3 to 6.8e-3 under both, their gradient "
                   "recomputing Δ from the keys; bfloat16 slopes 1.4e-3 to 7.6e-3, floor 1.3e-3 to 2.8e-3, since "
                   "2026-12-06 carried in float32 and recomputing Δ too, up to 4.9e-1 before; jax.nn's with the "
                   "same scores as a bias beside them); recorded, not checked",
                   "| T, S, H | slopes | query lengths | residuals | path | slopes' gradient | dq | dk | dv | its floor |", 90):
        try:
            from precision_table_grad import rows

            for case, sdt, lengths, res, path, errs in rows(("pallas",) if on_gpu else ("pallas_interpret",)):
                rep.add(f"| {case} | {sdt} | {lengths} | {res} | {path} | " + " | ".join(f"{e:.1e}" for e in errs) + " |")
        except Exception as e:
            rep.add(f"| — | — | — | — | — | {_fail(e)} | | | | |")
        rep.flush()

    # ---- 8. the forward alone with query lengths: programs past a length walk no key tile
    T8, N8, H8 = (256, 2, 32) if quick else (4096, 16, 64)
    if rep.section(f"8. The forward alone with query lengths [T, T/2] (B = 2, T = S = {T8}, N = {N8}, H = {H8}): the "
                   "rows past a length left out (`onf.dead_rows`, 2026-12-06) and walked (the rule patched out, "
                   "as before); the CPU's: 0.74× and 0.72× moajax without lengths against 1.01× and 0.98× walked "
                   "(`bench/results/lengths_forward_cpu.md`); then jit(grad), its saving forward's statistics saved "
                   "guarded (`identities.guard_statistics`, 2026-12-07) and unguarded; median of alternated rounds",
                   "| dtype | impl | ms | TFLOP/s | temp MiB | vs moajax without lengths | error |", 40):
        try:
            from rules_patched import dead_rows_walked, statistics_unguarded

            for dt in ("bfloat16", "float32"):
                q = draw((2, T8, N8, H8), dt)
                lengths = jnp.asarray([T8, T8 // 2], jnp.int32)
                con = {"moajax, no lengths": moajax_attn(False),
                       "moajax, query lengths": moajax_attn(False, query_seq_lengths=lengths)}
                with dead_rows_walked():  # compiled inside: its kernels walk every key tile
                    walked = compiled(moajax_attn(False, query_seq_lengths=lengths), q, q, q)[0]
                con["moajax, query lengths, dead rows walked"] = walked
                con["jax.nn xla, query lengths"] = lambda a, b, d: jax.nn.dot_product_attention(
                    a, b, d, query_seq_lengths=lengths, implementation="xla")
                if dt != "float32":
                    con["jax.nn cudnn, query lengths"] = lambda a, b, d: jax.nn.dot_product_attention(
                        a, b, d, query_seq_lengths=lengths, key_value_seq_lengths=jnp.asarray([T8, T8], jnp.int32),
                        implementation="cudnn")
                race(dt, con, (q, q, q), 4 * 2 * T8 * T8 * N8 * H8, 10, "moajax, no lengths")
                # beside them the cost model's speed-up, given the lengths' values, for this
                # machine's ONFs (the CPU's: 0.75× the time, 1.00× walked; lengths_forward_cpu.md)
                from moajax import cost

                plain = cost.estimate(moajax.attention_onf(q, q, q, machine=machine), machine).time_s
                for walk in (False, True):
                    with dead_rows_walked() if walk else contextlib.nullcontext():
                        onf = moajax.attention_onf(q, q, q, query_seq_lengths=lengths, machine=machine)
                    t = cost.estimate(onf, machine, values={"query_seq_lengths": np.asarray(lengths)}).time_s
                    rep.add(f"| {dt} | cost model ({machine.name}), query lengths{', dead rows walked' if walk else ''} "
                            f"| | | | {plain / t:.2f}× | |")
            # jit(grad): the saving forward leaves the rows out too where its statistics are
            # saved guarded (``identities.guard_statistics``, 2026-12-07); the CPU's: 0.94× and
            # 0.93× moajax without lengths against 1.00× and 0.97× unguarded, 0.90× and 0.85×
            # against 0.99× and 0.95× in a second run (lengths_grad_cpu.md)
            for dt in ("bfloat16", "float32"):
                if rep.left() < 15:
                    rep.add(f"| {dt} grad | (not run: time) | | | | | |")
                    continue
                q = draw((2, T8, N8, H8), dt)
                lengths = jnp.asarray([T8, T8 // 2], jnp.int32)
                con = {"grad: moajax, no lengths": grad_fn(moajax_attn(False)),
                       "grad: moajax, query lengths": grad_fn(moajax_attn(False, query_seq_lengths=lengths))}
                with statistics_unguarded():  # compiled inside: the statistics saved at every row
                    con["grad: moajax, query lengths, statistics unguarded"] = compiled(
                        grad_fn(moajax_attn(False, query_seq_lengths=lengths)), q, q, q)[0]
                con["grad: jax.nn xla, query lengths"] = grad_fn(lambda a, b, d: jax.nn.dot_product_attention(
                    a, b, d, query_seq_lengths=lengths, implementation="xla"))
                race(f"{dt} grad", con, (q, q, q), 14 * 2 * T8 * T8 * N8 * H8, 10, "grad: moajax, no lengths")
        except Exception as e:
            rep.add(f"| — | — | — | — | — | — | {_fail(e)} |")
        rep.flush()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
