"""Sequence lengths (jax.nn's query_seq_lengths, key_value_seq_lengths) under jit(grad) on the CPU.

The contenders, jit(grad) w.r.t. q, k and v, alternated in one process (best and median):
moajax without lengths, with query lengths, the same with the saving forward's statistics
unguarded (``rules_patched.statistics_unguarded``: the tree before 2026-12-07), with key/value lengths, with both;
jax.nn (XLA) with both. The lengths are [T, T/2] over a batch of 2: the second sequence is
half padding.

What it watches: the backward's Δ = +/(P × dP) per query row is +/(dO × O) read from the
saved output (``identities.delta_from_output``) — one pass over the head dim instead of a pass
over every key with two contractions. With query lengths the output and its cotangent are
guarded (0 past a row's length); the identity sees through the guard since 2026-12-06 (0 = 0
past it). The column 'Δ reads O' checks that it fired on the kernel the call runs. And the
saving forward: since 2026-12-07 it writes its row statistics (t < L) ? z : z̄, z̄ their closed
form past the length (the fill, and S: ``identities.guard_statistics``), so it leaves out the
rows past it as the plain forward does; the last column checks its ONF on this machine.
Beside each measured ratio stands the cost model's, given the lengths' values (``predicted``).

`python scripts/bench_lengths.py` writes bench/results/lengths_grad_cpu.md.
"""

from __future__ import annotations

import contextlib
import functools

import os
import sys
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rules_patched import dead_rows_walked, statistics_unguarded  # noqa: E402

OUT = flags.DEFINE_string("out", str(ROOT / "bench" / "results" / "lengths_grad_cpu.md"), "the results file")
SEQ = flags.DEFINE_list("seq", ["1024", "2048"], "sequence lengths (T = S)")
REPS = flags.DEFINE_integer("reps", 7, "timed rounds")
NOTE = flags.DEFINE_string("note", "", "a line under the title (what tree ran)")
FORWARD = flags.DEFINE_bool("forward", False, "time the forward alone (inference) instead, with the rule that leaves "
                            "out the rows past a query length (``onf.dead_row_conditions``, as ``masked`` calls it) on and off; writes "
                            "bench/results/lengths_forward_cpu.md unless --out is given")


def predicted(B: int, N: int, H: int, T: int, ql: bool, kl: bool, grad: bool) -> float:
    """The cost model's time (s) for the kernels a call runs on this machine (the forward's;
    with ``grad`` the saving forward's and the adjoint's), given the lengths' values [T, T/2]
    (``cost.estimate``'s ``values``), under whichever rules are in force."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from moajax import cost, machines
    from moajax.kernels.attention import mha_kernel

    spec = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
    lens = [jax.ShapeDtypeStruct((B,), jnp.int32)] * (ql + kl)
    kern = mha_kernel(None, None, False, ql, kl)  # (the kernel dot_product_attention runs)
    if grad:
        adj, specs = kern.saved_adjoint(spec, spec, spec, *lens)
        calls = [(kern.saving_forward(spec, spec, spec, *lens), (spec, spec, spec, *lens)), (adj, specs)]
    else:
        calls = [(kern, (spec, spec, spec, *lens))]
    lengths = np.array([T, T // 2], np.int32)
    values = {name: lengths for name, on in (("query_seq_lengths", ql), ("key_value_seq_lengths", kl)) if on}
    m = machines.local()
    total = 0.0
    for k, args in calls:
        plan = k.onf(*args, implementation="xla")
        for o in plan if isinstance(plan, tuple) else (plan,):
            total += cost.estimate(o, m, values=cost.values_read(o, values)).time_s
    return total


def forward(B: int, N: int, H: int) -> list:
    """The forward alone (jit, no statistics saved): moajax without lengths, with query lengths,
    the same with dead rows walked (``dead_rows_walked``: the rule patched to find none: the tree before
    2026-12-06's rule), with both lengths; jax.nn with query lengths and with both."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import moajax
    from moajax.timing import compiled_contenders

    lines = ["| T = S | contender | best s | median s | vs no lengths | model vs no lengths | temp MiB | "
             "max rel. diff vs jax.nn (same lengths) |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    r = np.random.default_rng(0)
    for T in (int(x) for x in SEQ.value):
        q, k, v = (jnp.asarray(r.standard_normal((B, T, N, H)).astype(np.float32)) for _ in range(3))
        lengths = jnp.asarray([T, T // 2], jnp.int32)
        cases = {"moajax, no lengths": (False, False, True), "moajax, query_seq_lengths": (True, False, True),
                 "moajax, query_seq_lengths, dead rows walked": (True, False, False),
                 "moajax, both": (True, True, True), "jax.nn, query_seq_lengths": (True, False, None),
                 "jax.nn, both": (True, True, None)}
        fns, model = {}, {}
        for name, (ql, kl, dead) in cases.items():
            kw = dict(query_seq_lengths=lengths if ql else None, key_value_seq_lengths=lengths if kl else None)
            if dead is None:
                fn = functools.partial(jax.nn.dot_product_attention, implementation="xla", **kw)
            else:
                fn = functools.partial(moajax.dot_product_attention, **kw)
            # the rule patched out for its contender, derived afresh
            with dead_rows_walked() if dead is False else contextlib.nullcontext():
                fns[name] = jax.jit(fn).lower(q, k, v).compile()
                if dead is not None:
                    model[name] = predicted(B, N, H, T, ql, kl, grad=False)
        for ql, kl in ((True, False), (True, True)):  # each against jax.nn with the same lengths
            ref = "jax.nn, query_seq_lengths" if not kl else "jax.nn, both"
            group = {n: f for n, f in fns.items() if cases[n][:2] == (ql, kl)}
            rows = compiled_contenders({**group, "moajax, no lengths": fns["moajax, no lengths"]}, (q, k, v),
                                       reps=REPS.value, reference=ref, pick=lambda o: o)
            base = min(rows["moajax, no lengths"][0])
            for name, (ts, temp, diff) in rows.items():
                pred = f"{model[name] / model['moajax, no lengths']:.2f}×" if name in model else "—"
                lines.append(f"| {T} | {name}{' (with both)' if kl and name == 'moajax, no lengths' else ''} | {min(ts):.4f} | {float(np.median(ts)):.4f} | {min(ts) / base:.2f}× | "
                             f"{pred} | {temp:.1f} | {'—' if name == 'moajax, no lengths' else f'{diff:.1e}'} |")
    return lines


def main(argv):
    del argv
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np

    import moajax
    from moajax.timing import compiled_contenders, machine_line, write_results

    B, N, H = 2, 8, 64
    if FORWARD.value:
        out = OUT.value if OUT.present else str(ROOT / "bench" / "results" / "lengths_forward_cpu.md")
        lines = [f"# Sequence lengths in the forward alone on the CPU ({machine_line()})", ""]
        lines += [NOTE.value, ""] if NOTE.value else []
        lines += [f"`python scripts/bench_lengths.py --forward` — B = {B}, N = {N}, H = {H}, float32, not causal, "
                  "lengths [T, T/2] (the second sequence half padding); jit of the forward (what inference runs, and "
                  "the forward of residuals \"none\"). Contenders alternate in one process, each group (query lengths; "
                  f"both) with moajax without lengths; best and median of {REPS.value} rounds after a warm-up. 'dead "
                  "rows walked': the rule that leaves out a program's walk where every row lies past its query length "
                  "(`onf.dead_row_conditions`, 2026-12-06) patched out, so its programs walk every key tile and the select "
                  "drops their rows, as before.", ""]
        lines += forward(B, N, H)
        lines += ["", "vs no lengths: the contender's best time over moajax's without lengths in the same group. A "
                  "quarter of the batch's query rows lie past their length; with both lengths a quarter of the keys "
                  "too (3/8 of the scores are masked). model vs no lengths: the cost model's time for the kernels the "
                  "call runs on this machine (its profile: `machines.local()`), given the lengths' values "
                  "(`cost.estimate(..., values=...)`), over its time without lengths."]
        write_results(out, lines)
        return
    lines = [f"# Sequence lengths under jit(grad) on the CPU ({machine_line()})", ""]
    if NOTE.value:
        lines += [NOTE.value, ""]
    lines += [f"`python scripts/bench_lengths.py` — B = {B}, N = {N}, H = {H}, float32, not causal, lengths "
              "[T, T/2] (the second sequence half padding); jit(grad) w.r.t. q, k, v. Contenders alternate in "
              f"one process; best and median of {REPS.value} rounds after a warm-up. Temp: the compiled "
              "executable's temp allocation. 'Δ reads O': the backward's DNF reads the saved output (the "
              "Δ-from-output identity applied), checked on the kernel the call runs. 'statistics unguarded': "
              "`identities.guard_statistics` patched out (the tree before 2026-12-07): the saving forward's row "
              "statistics read their pass at every row, so its programs past a query length walk every key tile; the "
              "last column: the saving forward's ONF on this machine records rows left out (`Skip.dead`).", "",
              "| T = S | contender | best s | median s | vs no lengths | model vs no lengths | temp MiB | "
              "max rel. diff of dq vs jax.nn (same lengths) | Δ reads O | saving forward leaves out rows past the length |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---|---|"]
    r = np.random.default_rng(0)
    for T in (int(x) for x in SEQ.value):
        q, k, v, g = (jnp.asarray(r.standard_normal((B, T, N, H)).astype(np.float32)) for _ in range(4))
        lengths = jnp.asarray([T, T // 2], jnp.int32)

        def moa(ql, kl):
            def loss(q, k, v):
                out = moajax.dot_product_attention(q, k, v, query_seq_lengths=lengths if ql else None,
                                                   key_value_seq_lengths=lengths if kl else None)
                return jnp.sum(out * g)
            return loss

        def nn(ql, kl):
            def loss(q, k, v):
                out = jax.nn.dot_product_attention(q, k, v, query_seq_lengths=lengths if ql else None,
                                                   key_value_seq_lengths=lengths if kl else None,
                                                   implementation="xla")
                return jnp.sum(out * g)
            return loss

        cases = {"moajax, no lengths": (False, False), "moajax, query_seq_lengths": (True, False),
                 "moajax, query_seq_lengths, statistics unguarded": (True, False),
                 "moajax, key_value_seq_lengths": (False, True), "moajax, both": (True, True)}
        losses = {n: moa(*c) for n, c in cases.items()}
        losses["jax.nn, both"] = nn(True, True)
        args = (q, k, v)
        fns, model = {}, {}
        for n, f in losses.items():  # (the rule patched out for its contender, derived afresh)
            with statistics_unguarded() if "unguarded" in n else contextlib.nullcontext():
                fns[n] = jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(*args).compile()
                if n in cases:
                    model[n] = predicted(B, N, H, T, *cases[n], grad=True)
        rows = compiled_contenders(fns, args, reps=REPS.value, reference="jax.nn, both", pick=lambda grads: grads[0])
        base = min(rows["moajax, no lengths"][0])
        for name, (ts, temp, diff) in rows.items():
            reads = "—"
            if name in cases:  # dq against jax.nn's with the same lengths (untimed)
                want = np.asarray(jax.jit(jax.grad(nn(*cases[name]), argnums=0))(*args), np.float64)
                got = np.asarray(fns[name](*args)[0], np.float64)
                diff = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
                from moajax.kernels.attention import mha_kernel

                ql, kl = cases[name]  # (the kernel dot_product_attention runs: kv heads = query heads)
                spec = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
                lens = [jax.ShapeDtypeStruct((B,), jnp.int32)] * (ql + kl)
                kern = mha_kernel(None, None, False, ql, kl)
                adj, specs = kern.saved_adjoint(spec, spec, spec, *lens)
                reads = "yes" if "out" in adj.dnf(*specs).arrays_read() else "no"
                with statistics_unguarded() if "unguarded" in name else contextlib.nullcontext():
                    saving = mha_kernel(None, None, False, ql, kl).saving_forward(spec, spec, spec, *lens)
                    dead = any(sk.dead for sk in saving.onf(spec, spec, spec, *lens, implementation="xla").skips)
            pred = f"{model[name] / model['moajax, no lengths']:.2f}×" if name in model else "—"
            lines.append(f"| {T} | {name} | {min(ts):.4f} | {float(np.median(ts)):.4f} | {min(ts) / base:.2f}× | "
                         f"{pred} | {temp:.1f} | {diff:.1e} | {reads} | {'—' if name not in cases else 'yes' if dead else 'no'} |")
    lines += ["", "vs no lengths: the contender's best time over moajax's without lengths (one kind of lengths masks "
              "a quarter of the batch's scores, both 3/8; the tiles masked whole are skipped). model vs no lengths: the "
              "cost model's time for the kernels the call runs on this machine (its profile: `machines.local()`), given "
              "the lengths' values (`cost.estimate(..., values=...)`), over its time without lengths."]
    write_results(OUT.value, lines)


if __name__ == "__main__":
    app.run(main)
