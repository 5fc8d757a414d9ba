#!/usr/bin/env python3
"""How close to XLA's CPU ceiling the attention backward is (issue 10's S = 4096 targets).

Beside moajax's adjoint (what ``jax.grad`` runs after the saving forward: its default plan),
a FlashAttention-2 backward written by hand in plain JAX — one pass, P recomputed once per tile
in 5 contractions (S = QKᵀ, dV += Pᵀ dO, dP = dO Vᵀ, dS = P ⊙ (dP − Δ), dK += dSᵀ Q, dQ += dS K),
lax.scan over key tiles outside and query tiles inside, dQ's tiles as scan outputs — at a few
tilings, in one process, alternating, with a same-run GEMM. Both read the forward's log-sum-
exp. The hand-written kernel is the bar: what XLA makes of the best-known schedule here. Beside
them the same plan lowered with a contraction's scalar factors on its first operand (the fold
before 2026-12-03: dQ's scale on the [s t] tile, not on its [t h] result). Then
each tile contraction of moajax's adjoint alone, at its tile shapes: the rate XLA's CPU dot
gives each (one of the five contracts its lhs's leading axis, the transposed form), and the
share of the adjoint's time the contractions take at those rates.

    python scripts/bench_attention_ceiling.py    # writes bench/results/attention_ceiling_cpu.md
"""

from __future__ import annotations

import sys
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parent.parent
OUT = flags.DEFINE_string("out", str(ROOT / "bench" / "results" / "attention_ceiling_cpu.md"), "the results file")
SEQ = flags.DEFINE_integer("seq", 4096, "T = S")
REPS = flags.DEFINE_integer("reps", 3, "timed runs per contender")


def _fa2_backward(n, s_len, h, bs, bt):
    """The hand-written one-pass backward (heads first: [N, S, H]); lse and Δ per row."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    scale = h**-0.5

    def bwd(q, k, v, o, do, lse):
        delta = (do * o).sum(-1)

        def over_s(dq, i):
            ks, vs = (lax.dynamic_slice_in_dim(x, i * bs, bs, 1) for x in (k, v))

            def over_t(carry, j):
                dk, dv = carry
                qt, dot = (lax.dynamic_slice_in_dim(x, j * bt, bt, 1) for x in (q, do))
                lt, dt = (lax.dynamic_slice_in_dim(x, j * bt, bt, 1) for x in (lse, delta))
                p = jnp.exp(jnp.einsum("nth,nsh->nts", qt, ks) * scale - lt[..., None])
                dv = dv + jnp.einsum("nts,nte->nse", p, dot)
                ds = p * (jnp.einsum("nte,nse->nts", dot, vs) - dt[..., None])
                dk = dk + jnp.einsum("nts,nth->nsh", ds, qt) * scale
                return (dk, dv), jnp.einsum("nts,nsh->nth", ds, ks) * scale

            zero = jnp.zeros((n, bs, h), q.dtype)
            (dk, dv), dqs = lax.scan(over_t, (zero, zero), jnp.arange(s_len // bt))
            return dq + jnp.moveaxis(dqs, 0, 1).reshape(n, s_len, h), (dk, dv)

        dq, (dks, dvs) = lax.scan(over_s, jnp.zeros((n, s_len, h), q.dtype), jnp.arange(s_len // bs))
        return dq, jnp.moveaxis(dks, 0, 1).reshape(n, s_len, h), jnp.moveaxis(dvs, 0, 1).reshape(n, s_len, h)

    return jax.jit(bwd)


def _loop_dots(jaxpr) -> list:
    """The dot_generals inside the loops of a jaxpr (the tile contractions), in trace order:
    (lhs shape, rhs shape, dimension numbers, precision, preferred dtype)."""
    out = []

    def walk(j, depth):
        for e in j.eqns:
            if e.primitive.name == "dot_general" and depth:
                out.append((e.invars[0].aval.shape, e.invars[1].aval.shape, e.params["dimension_numbers"],
                            e.params["precision"], e.params["preferred_element_type"]))
            for p in e.params.values():
                for x in p if isinstance(p, (list, tuple)) else (p,):
                    inner = getattr(x, "jaxpr", None)
                    if inner is not None:
                        walk(getattr(inner, "jaxpr", inner), depth + (e.primitive.name in ("while", "scan")))

    walk(jaxpr.jaxpr, 0)
    return out


def _dot_share(lhs, rhs, dims, precision, dtype, gemm, reps: int = 48):
    """One tile contraction's rate as a share of the GEMM's, the two alternating: the
    contraction run alone ``reps`` times in a loop (each call fed its previous output through
    an optimization barrier, so XLA neither hoists nor drops it), best of 3 each. Returns the
    share and the contraction's flops."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    from moajax.timing import alternating

    r = np.random.default_rng(1)
    a, b = (jnp.asarray(r.standard_normal(x), jnp.float32) for x in (lhs, rhs))
    dot = lambda x, y: lax.dot_general(x, y, dims, precision=precision, preferred_element_type=dtype)  # noqa: E731
    shape = jax.eval_shape(dot, a, b).shape

    def body(i, acc):
        x, y, _ = lax.optimization_barrier((a, b, acc))
        return dot(x, y)

    f = jax.jit(lambda: lax.fori_loop(0, reps, body, jnp.zeros(shape, jnp.float32)))
    times = alternating({"dot": f, "gemm": gemm}, (), reps=3)
    (ca, _), _ = dims
    flops = 2 * np.prod(shape) * np.prod([lhs[d] for d in ca])
    return (reps * flops / min(times["dot"])) / (2 * 4096**3 / min(times["gemm"])), flops


def _spec(lhs, rhs, dims) -> tuple:
    """A dot_general as an einsum (n batch, k contracted, i the lhs's and j the rhs's free
    axes), and whether it is a transposed-lhs GEMM: an lhs free axis after a contracted one."""
    (ca, cb), (ba, bb) = dims

    def letters(shape, c, b, free):
        return "".join("n" if d in b else "k" if d in c else free for d in range(len(shape)))

    la, lb = letters(lhs, ca, ba, "i"), letters(rhs, cb, bb, "j")
    out = "n" * len(ba) + "i" * la.count("i") + "j" * lb.count("j")
    shapes = "×".join(map(str, lhs)) + " · " + "×".join(map(str, rhs))
    transposed = "i" in la and la.index("k") < la.index("i")
    return f"{la},{lb}->{out} ({shapes})", transposed


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    import numpy as np

    from moajax import machines, runtime, schedule
    from moajax.kernels.attention import mha_kernel
    from moajax.timing import alternating, machine_line, write_results

    S, N, H = SEQ.value, 8, 64
    r = np.random.default_rng(0)
    q, k, v, g = (jnp.asarray(r.standard_normal((1, S, N, H)), jnp.float32) for _ in range(4))
    kern = mha_kernel(None, None, False)
    out, *saved = kern.saving_forward(q, k, v).compiled(q, k, v)(q, k, v)
    adj, _ = kern.saved_adjoint(q, k, v)
    args = (q, k, v, g, *saved, out)
    dnf = adj.dnf(*args)
    plan = schedule.derive_plan(dnf, machines.local())
    moajax_bwd = jax.jit(runtime.lowered(plan, "xla", tuple(o.name for o in dnf.outputs)))
    # heads-first operands for the hand-written kernel; lse = max + log(sum) from the same forward
    heads = [jnp.moveaxis(x[0], 1, 0) for x in (q, k, v, out, g)]
    lse = jnp.moveaxis((saved[0] + jnp.log(saved[1])).reshape(S, N), 1, 0)  # saved in the rows' layout [b t n]
    fns = {"moajax adjoint (default plan)": (moajax_bwd, args)}
    # the same plan with a contraction's scalar factors folded into its first operand, as before
    # 2026-12-03 (``Backend.scalars_on_smaller_result`` off: dQ's scale on the [s t] dS, a pass more)
    from moajax import lower_xla

    lower_xla.XlaBackend.scalars_on_smaller_result = False
    try:
        first = jax.jit(runtime.lowered(plan, "xla", tuple(o.name for o in dnf.outputs))).lower(*args).compile()
    finally:
        lower_xla.XlaBackend.scalars_on_smaller_result = True
    fns["moajax adjoint, scalars on the first operand"] = (first, args)
    for bs, bt in ((512, 256), (256, 256), (512, 512)):
        fns[f"hand-written FA2, key tiles {bs} × query tiles {bt}"] = (_fa2_backward(N, S, H, bs, bt), (*heads[:4], heads[4], lse))
    ref = fns["moajax adjoint (default plan)"][0](*args)
    errs = {}
    for name, (f, a) in fns.items():
        got = f(*a)
        if name.startswith("hand"):
            got = [jnp.moveaxis(x, 0, 1)[None] for x in got]
        errs[name] = max(float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y))) for x, y in zip(got, ref))
    a = jnp.asarray(r.standard_normal((4096, 4096)), jnp.float32)
    # one alternating round over every contender and the GEMM (different arguments: wrap them)
    wrapped = {name: (lambda f=f, aa=aa: f(*aa)) for name, (f, aa) in fns.items()}
    gemm = jax.jit(lambda a: a @ a)
    wrapped["GEMM 4096³"] = lambda: gemm(a)
    times = alternating(wrapped, (), reps=REPS.value)
    gemm_rate = 2 * 4096**3 / min(times["GEMM 4096³"])
    unit = 2 * S * S * N * H  # one contraction over [T S] × H
    lines = ["# The attention backward against a hand-written FlashAttention-2 backward in plain JAX (CPU)", "",
             machine_line(),
             f"Run: `python scripts/bench_attention_ceiling.py` — B = 1, N = {N}, H = {H}, T = S = {S}, float32; the "
             "backward alone (both read the forward's row statistics); contenders and a same-run GEMM alternate in one "
             f"process, best of {REPS.value}. % of GEMM counts the backward's 5 contractions (10·T·S·N·H flops) at "
             f"the GEMM's {gemm_rate / 1e9:.0f} GF/s.", "",
             "| backward | best ms | % of GEMM | max rel. diff vs moajax |", "|---|---:|---:|---:|"]
    for name in fns:
        t = min(times[name])
        lines.append(f"| {name} | {1e3 * t:.1f} | {100 * 5 * unit / gemm_rate / t:.0f} % | {errs[name]:.1e} |")
    # the adjoint's tile contractions, each alone: what XLA's CPU dot runs them at here
    dots = _loop_dots(jax.make_jaxpr(runtime.lowered(plan, "xla", tuple(o.name for o in dnf.outputs)))(*args))
    tiles = int(np.prod([a.ntiles for a in plan.axes if a.name in ("s", "t")]))
    counts: dict = {}
    for d in dots:
        counts[d] = counts.get(d, 0) + 1
    rows, total = [], 0.0
    for (lhs, rhs, dims, prec, dt), count in counts.items():
        share, flops = _dot_share(lhs, rhs, dims, prec, dt, wrapped["GEMM 4096³"])
        total += count * tiles * flops / (share * gemm_rate)
        spec, transposed = _spec(lhs, rhs, dims)
        rows.append(f"| {spec} | {count} | {'yes' if transposed else ''} | {100 * share:.0f} % |")
    adjoint = min(times["moajax adjoint (default plan)"])
    lines += ["", "## The adjoint's tile contractions alone", "",
              f"Each dot_general of the default plan's loop body (tiles: {plan.axis('s').tile} keys × "
              f"{plan.axis('t').tile} queries, {tiles} tile pairs), run alone 48 times in a loop, best of 3, "
              "alternating with the GEMM: its rate as a share of the GEMM's. n: batch (heads), k: contracted, "
              "i, j: free. Transposed lhs: the lhs contracts an axis before its free one (dQ = Σ_s dS[s t] "
              "K[s h] from the [n s t] tile).", "",
              "| contraction | per tile pair | transposed lhs | % of GEMM |", "|---|---:|---|---:|", *rows, "",
              f"Every tile pair's contractions at these shares of the GEMM's {gemm_rate / 1e9:.0f} GF/s take "
              f"{1e3 * total:.0f} ms, {100 * total / adjoint:.0f} % of the adjoint's best {1e3 * adjoint:.0f} ms; "
              "the rest is the exps, the elementwise passes over each [n s t] tile and the loops."]
    write_results(OUT.value, lines + [""])


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    app.run(main)
