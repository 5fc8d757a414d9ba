"""``moajax validate``: the cost model checked against measurement, kernel by kernel — the
seed's main job (REFERENCE.md §4–5), on whatever machine runs it.

For each seed kernel and size n: derive its ONF plan for the machine profile, run it in
float64 (decode in float32, as the seed did) against an independent plain-jnp float64
reference (the error column), time it (sizes swept inside one process after a warm-up: the
seed's lesson — process start-up and first compilations otherwise swamp small sizes), and
predict its time by the papers' model T ≈ α·F + β·M, with F the cost model's flops, M its
modelled bytes, α = 1/peak and β = 1/bandwidth from the profile (``moajax measure`` times
this machine's). There are no hardware counters here, so the compiled executable's own cost
analysis (XLA's flops and bytes accessed) stands beside the model's. Where measured and
predicted differ by more than 2×, the row says why, from what the run shows. With a GPU profile,
in a process that has the GPU, the Pallas kernels run, predicted with that GPU's ONFs.

Kernels (``KERNELS``): the attention forward; the attention adjoint under each backward ONF
(owner, split, atomic); forward + backward (``jax.grad``); both again with query and key
lengths [n, n/2] (the second sequence half padding: the model counts the tiles the lengths
leave out, given their values — ``cost.estimate``'s ``values``); one decode step; RMSNorm and
the gated MLP, forward + backward; the transformer block, forward + backward.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from moajax import cost, machines

# the seed's sizes (REFERENCE.md §5): attention B=2, D=64, N = 64…8192; decode d = 64,
# n = 1024…2²⁰; block D = 64, D_ff = 256, tokens up to 65536 for the norm and the MLP
FULL = {
    "attention": tuple(2**k for k in range(6, 14)),
    "decode": tuple(2**k for k in range(10, 21)),
    "tokens": tuple(2**k for k in range(8, 17)),
}
QUICK = {"attention": (64, 256, 1024), "decode": (1024, 16384, 262144), "tokens": (256, 2048, 16384)}
D_HEAD, D_MODEL, D_FF = 64, 64, 256


@dataclasses.dataclass
class Built:
    """One kernel at one size, ready to run: ``run(*args)`` (jitted), the reference (float64,
    plain jnp, called only where its scores fit ``REFERENCE_BYTES``), the ONFs that run (for
    the cost model), and a plain JAX baseline (jax.nn / jnp) whose temp memory stands beside
    moajax's."""

    run: Callable
    args: tuple
    reference: Callable  # () -> the reference's outputs (computed only where it fits REFERENCE_BYTES)
    onfs: tuple
    baseline: Callable | None
    dtype: str
    reference_bytes: int = 0  # what the reference materialises (its [t s] scores)
    # work outside the DSL kernels (the block's projections: jnp dots), as (flops, bytes)
    extra: tuple = (0.0, 0.0)
    # the runtime scalars the ONFs' skips read (sequence lengths), for the cost model
    values: dict | None = None


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    what: str
    sizes: str  # the key of QUICK / FULL
    build: Callable  # (n, machine, implementation) -> Built


@dataclasses.dataclass(frozen=True)
class Row:
    kernel: str
    n: int
    dtype: str
    error: float
    measured_s: float
    predicted_s: float
    model_flops: float
    xla_flops: float
    model_bytes: float
    xla_bytes: float
    temp_bytes: int
    baseline_temp_bytes: int
    why: str

    @property
    def ratio(self) -> float:
        return self.measured_s / self.predicted_s if self.predicted_s > 0 else math.inf


COLUMNS = ("kernel", "n", "dtype", "rel. error", "measured s", "predicted s", "measured / predicted",
           "model GFLOP", "XLA GFLOP", "model MB", "XLA MB", "temp MiB", "baseline temp MiB", "why (if > 2× off)")


# ----------------------------------------------------------------------------- references
# plain jnp, float64, written from the formulas (REFERENCE.md §2–3), not from moajax's kernels


def _ref_attention(q, k, v, causal=False):
    import jax
    import jax.numpy as jnp

    s = jnp.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(q.shape[-1])
    if causal:
        t, n = q.shape[1], k.shape[1]
        s = jnp.where(jnp.tril(jnp.ones((t, n), bool)), s, -jnp.inf)
    return jnp.einsum("bnts,bsne->btne", jax.nn.softmax(s, axis=-1), v)


def _ref_attention_lengths(q, k, v, query_seq_lengths, key_value_seq_lengths):
    """Attention over the keys inside each batch element's key length; its rows past the query
    length 0 (jax.nn's)."""
    import jax
    import jax.numpy as jnp

    s = jnp.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(q.shape[-1])
    keys = jnp.arange(k.shape[1])[None, :] < key_value_seq_lengths[:, None]  # [b s]
    s = jnp.where(keys[:, None, None, :], s, -jnp.inf)
    out = jnp.einsum("bnts,bsne->btne", jax.nn.softmax(s, axis=-1), v)
    rows = jnp.arange(q.shape[1])[None, :] < query_seq_lengths[:, None]  # [b t]
    return jnp.where(rows[:, :, None, None], out, 0.0)


def _ref_rmsnorm(x, w, eps=1e-6):
    import jax.numpy as jnp

    return w * x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def _ref_mlp(x, wg, wu, wd):
    import jax

    return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd


def _ref_block(p, x):
    import jax.numpy as jnp

    h = _ref_rmsnorm(x, p["attn_norm"])
    q, k, v = (jnp.einsum("btd,dnh->btnh", h, p[w]) for w in ("wq", "wk", "wv"))
    x = x + jnp.einsum("btnh,nhd->btd", _ref_attention(q, k, v, causal=True), p["wo"])
    return x + _ref_mlp(_ref_rmsnorm(x, p["mlp_norm"]), p["w_gate"], p["w_up"], p["w_down"])


# ----------------------------------------------------------------------------- cases


# the most a reference may materialise (its float64 [t s] scores and their gradient); past it the
# error column says "—" (the seed's largest sizes: the kernels run, their O(n²) reference would not)
REFERENCE_BYTES = 3 << 30


def _scores_bytes(batch: int, n: int) -> int:
    """The float64 [b t s] scores, probabilities and their cotangent a plain reference holds."""
    return 3 * batch * n * n * 8


def _rng(n):
    import numpy as np

    return np.random.default_rng(n)


def _arrays(shapes, dtype, seed):
    import jax.numpy as jnp

    r = _rng(seed)
    return tuple(jnp.asarray(r.standard_normal(s), dtype) for s in shapes)


def _plan(onf) -> tuple:
    return onf if isinstance(onf, tuple) else (onf,)


def _loss_grad(f, argnums, g):
    """jit(grad) of Σ f(…) × g: forward + backward, every gradient."""
    import jax
    import jax.numpy as jnp

    return jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * g), argnums=argnums))


def _attention_forward(n, machine, impl):
    import jax
    import jax.numpy as jnp

    import moajax

    q, k, v = _arrays([(2, n, 1, D_HEAD)] * 3, jnp.float64, n)
    kern = _mha()
    return Built(jax.jit(lambda q, k, v: moajax.dot_product_attention(q, k, v, implementation=impl)), (q, k, v),
                 lambda: (_ref_attention(q, k, v),), _derived(kern.dnf(q, k, v), machine),
                 jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v)), "float64", _scores_bytes(2, n))


def _mha():
    from moajax.kernels.attention import mha_kernel

    return mha_kernel(None, None, False)


def _attention_backward(plan_name):
    def build(n, machine, impl):
        import jax
        import jax.numpy as jnp

        from moajax import runtime, schedule
        from moajax.schedule import Preset

        q, k, v, g = _arrays([(2, n, 1, D_HEAD)] * 4, jnp.float64, n)
        kern = _mha()
        out, *saved = kern.saving_forward(q, k, v).compiled(q, k, v)(q, k, v)
        adj, specs = kern.saved_adjoint(q, k, v)
        args = (q, k, v, g, *saved, out)
        dnf = adj.dnf(*args)
        plan = {"owner": "owner", "atomic": "fused",
                "split": (("d_query", "d_key"), ("d_value",))}[plan_name]
        onfs = _plan(schedule.derive_plan(dnf, machine, Preset.of(plan=plan)))
        order = tuple(o.name for o in dnf.outputs)
        return Built(jax.jit(runtime.lowered(onfs if len(onfs) > 1 else onfs[0], impl, order)), args,
                     lambda: jax.vjp(_ref_attention, q, k, v)[1](g), onfs,
                     jax.jit(lambda q, k, v, g, *_: jax.vjp(jax.nn.dot_product_attention, q, k, v)[1](g)), "float64",
                     _scores_bytes(2, n))

    return build


def _attention_grad(n, machine, impl):
    import jax
    import jax.numpy as jnp

    import moajax

    q, k, v, g = _arrays([(2, n, 1, D_HEAD)] * 4, jnp.float64, n)
    kern = _mha()
    adj, specs = kern.saved_adjoint(q, k, v)
    onfs = _derived(kern.saving_forward(q, k, v).dnf(q, k, v), machine) + _derived(adj.dnf(*specs), machine)
    f = _loss_grad(lambda q, k, v: moajax.dot_product_attention(q, k, v, implementation=impl), (0, 1, 2), g)
    return Built(f, (q, k, v), lambda: jax.vjp(_ref_attention, q, k, v)[1](g), onfs,
                 _loss_grad(jax.nn.dot_product_attention, (0, 1, 2), g), "float64", _scores_bytes(2, n))


def _lengths(n):
    """Two sequences, the second half padding: lengths [n, n/2] for the queries and the keys."""
    import jax.numpy as jnp

    ql = kl = jnp.asarray([n, n // 2], jnp.int32)
    return ql, kl, {"query_seq_lengths": ql, "key_value_seq_lengths": kl}


def _attention_lengths(n, machine, impl):
    import jax
    import jax.numpy as jnp

    import moajax
    from moajax.kernels.attention import mha_kernel

    q, k, v = _arrays([(2, n, 1, D_HEAD)] * 3, jnp.float64, n)
    ql, kl, kw = _lengths(n)
    kern = mha_kernel(None, None, False, True, True)
    return Built(jax.jit(lambda q, k, v: moajax.dot_product_attention(q, k, v, implementation=impl, **kw)), (q, k, v),
                 lambda: (_ref_attention_lengths(q, k, v, ql, kl),), _derived(kern.dnf(q, k, v, ql, kl), machine),
                 jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, **kw)), "float64", _scores_bytes(2, n),
                 values=kw)


def _attention_lengths_grad(n, machine, impl):
    import jax
    import jax.numpy as jnp

    import moajax
    from moajax.kernels.attention import mha_kernel

    q, k, v, g = _arrays([(2, n, 1, D_HEAD)] * 4, jnp.float64, n)
    ql, kl, kw = _lengths(n)
    kern = mha_kernel(None, None, False, True, True)
    adj, specs = kern.saved_adjoint(q, k, v, ql, kl)
    onfs = _derived(kern.saving_forward(q, k, v, ql, kl).dnf(q, k, v, ql, kl), machine) + _derived(adj.dnf(*specs), machine)
    f = _loss_grad(lambda q, k, v: moajax.dot_product_attention(q, k, v, implementation=impl, **kw), (0, 1, 2), g)
    ref = lambda q, k, v: _ref_attention_lengths(q, k, v, ql, kl)  # noqa: E731
    return Built(f, (q, k, v), lambda: jax.vjp(ref, q, k, v)[1](g), onfs,
                 _loss_grad(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, **kw), (0, 1, 2), g), "float64",
                 _scores_bytes(2, n), values=kw)


def _decode(n, machine, impl):
    import jax
    import jax.numpy as jnp

    import moajax

    q, kc, vc = _arrays([(1, 1, D_HEAD), (1, n, 1, D_HEAD), (1, n, 1, D_HEAD)], jnp.float32, n)
    kern = _mha()
    q4 = q[:, None]
    ref = lambda: (_ref_attention(*(a.astype(jnp.float64) for a in (q4, kc, vc)))[:, 0],)  # noqa: E731
    return Built(jax.jit(lambda q, k, v: moajax.decode_attention(q, k, v, implementation=impl)), (q, kc, vc),
                 ref, _derived(kern.dnf(q4, kc, vc), machine),
                 jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q[:, None], k, v)[:, 0]), "float32")


def _kernel_grad_onfs(kern, arrays, machine):
    """The ONFs jax.grad runs for a DSL kernel on ``machine``: its forward's, then its adjoint's."""
    import jax

    outs = kern._build(arrays, {})[1]
    cts = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in (outs if isinstance(outs, tuple) else (outs,))]
    return _derived(kern.dnf(*arrays), machine) + _derived(kern.adjoint(*arrays).dnf(*arrays, *cts), machine)


def _derived(dnf, machine) -> tuple:
    """The plan of ``dnf`` for ``machine`` (what a call runs there: ``schedule.derive_plan``)."""
    from moajax import schedule

    return _plan(schedule.derive_plan(dnf, machine))


def _rmsnorm(n, machine, impl):
    import jax
    import jax.numpy as jnp

    import moajax
    from moajax.kernels.norm import rmsnorm

    x, w, g = _arrays([(n, D_MODEL), (D_MODEL,), (n, D_MODEL)], jnp.float64, n)
    return Built(_loss_grad(lambda x, w: moajax.rms_norm(x, w, implementation=impl), (0, 1), g), (x, w),
                 lambda: jax.vjp(_ref_rmsnorm, x, w)[1](g),
                 _kernel_grad_onfs(rmsnorm, (x, w), machine), _loss_grad(_ref_rmsnorm, (0, 1), g), "float64")


def _mlp(n, machine, impl):
    import jax
    import jax.numpy as jnp

    import moajax
    from moajax.kernels.mlp import swiglu

    x, wg, wu, wd, g = _arrays([(n, D_MODEL), (D_MODEL, D_FF), (D_MODEL, D_FF), (D_FF, D_MODEL), (n, D_MODEL)],
                               jnp.float64, n)
    return Built(_loss_grad(lambda *a: moajax.gated_mlp(*a, implementation=impl), (0, 1, 2, 3), g),
                 (x, wg, wu, wd), lambda: jax.vjp(_ref_mlp, x, wg, wu, wd)[1](g),
                 _kernel_grad_onfs(swiglu, (x, wg, wu, wd), machine),
                 _loss_grad(_ref_mlp, (0, 1, 2, 3), g), "float64")


def _block(n, machine, impl):
    import jax
    import jax.numpy as jnp

    import moajax
    from moajax.kernels.mlp import swiglu
    from moajax.kernels.norm import rmsnorm

    B, N, H = 2, 1, D_MODEL  # the seed's block: B = 2, one head of D = 64, D_ff = 256
    T = max(1, n // B)
    shapes = {"attn_norm": (D_MODEL,), "wq": (D_MODEL, N, H), "wk": (D_MODEL, N, H), "wv": (D_MODEL, N, H),
              "wo": (N, H, D_MODEL), "mlp_norm": (D_MODEL,), "w_gate": (D_MODEL, D_FF), "w_up": (D_MODEL, D_FF),
              "w_down": (D_FF, D_MODEL)}
    vals = _arrays(list(shapes.values()) + [(B, T, D_MODEL), (B, T, D_MODEL)], jnp.float64, n)
    p = {k: (a / math.sqrt(a.shape[0]) + (1.0 if k.endswith("norm") else 0.0)) for k, a in zip(shapes, vals)}
    x, g = vals[-2:]
    f = _loss_grad(lambda p, x: moajax.transformer_block(p, x, is_causal=True, implementation=impl), (0, 1), g)
    # the block's DSL kernels; its projections are jnp dots, counted apart (``extra``)
    rows = jnp.zeros((B * T, D_MODEL))
    onfs = (_kernel_grad_onfs(rmsnorm, (rows, p["attn_norm"]), machine) * 2
            + _kernel_grad_onfs(swiglu, (rows, p["w_gate"], p["w_up"], p["w_down"]), machine))
    from moajax.kernels.attention import mha_kernel

    qs = jnp.zeros((B, T, N, H))
    kern = mha_kernel(None, None, False)
    adj, specs = kern.saved_adjoint(qs, qs, qs, is_causal=True)
    onfs += (_derived(kern.saving_forward(qs, qs, qs, is_causal=True).dnf(qs, qs, qs, is_causal=True), machine)
             + _derived(adj.dnf(*specs, is_causal=True), machine))
    # its projections (q, k, v in, o out), jnp dots: forward and the two gradients of each, 2·n·D·N·H
    # flops apiece, each reading its two operands and writing its result once
    tokens, nh = B * T, N * H
    proj = (4 * 3 * 2 * tokens * D_MODEL * nh, 4 * 3 * 8 * (tokens * D_MODEL + D_MODEL * nh + tokens * nh))
    return Built(f, (p, x), lambda: jax.vjp(_ref_block, p, x)[1](g), onfs, _loss_grad(_ref_block, (0, 1), g),
                 "float64", _scores_bytes(B, T), proj)


KERNELS = {c.name: c for c in (
    Case("attention", "attention forward (B=2, one head, d = 64)", "attention", _attention_forward),
    Case("attention_bwd_owner", "attention adjoint, owner ONF (no atomics)", "attention", _attention_backward("owner")),
    Case("attention_bwd_split", "attention adjoint, split ONF (dV apart)", "attention", _attention_backward("split")),
    Case("attention_bwd_atomic", "attention adjoint, atomic ONF (the seed's fused)", "attention",
         _attention_backward("atomic")),
    Case("attention_fwd_bwd", "attention forward + backward (jax.grad)", "attention", _attention_grad),
    Case("attention_lengths", "attention forward, query and key lengths [n, n/2] (B=2, one head)", "attention",
         _attention_lengths),
    Case("attention_lengths_fwd_bwd", "attention forward + backward, query and key lengths [n, n/2]", "attention",
         _attention_lengths_grad),
    Case("decode", "one decode step over a cache of n keys (float32)", "decode", _decode),
    Case("rmsnorm", "RMSNorm forward + backward (d = 64)", "tokens", _rmsnorm),
    Case("gated_mlp", "gated MLP forward + backward (d = 64, d_ff = 256)", "tokens", _mlp),
    Case("block", "transformer block forward + backward (B = 2, d = 64, d_ff = 256, causal)", "tokens", _block),
)}


# ----------------------------------------------------------------------------- running


def check_kernels(names) -> list:
    """The kernel names asked for, checked (None: all)."""
    if not names:
        return list(KERNELS)
    unknown = [k for k in names if k not in KERNELS]
    if unknown:
        raise ValueError(f"validate: unknown kernel(s) {unknown}; known: {', '.join(KERNELS)}")
    return list(dict.fromkeys(names))


def _rel_error(got, want) -> float:
    import jax
    import numpy as np

    errs = []
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        errs.append(float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300)))
    return max(errs)


def _xla_cost(fn, args) -> tuple:
    """(flops, bytes accessed, temp bytes) from the compiled executable's own analysis."""
    c = fn.lower(*args).compile()
    ca = c.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else (ca or {})
    mem = c.memory_analysis()
    temp = int(getattr(mem, "temp_size_in_bytes", -1)) if mem is not None else -1
    return float(ca.get("flops", float("nan"))), float(ca.get("bytes accessed", float("nan"))), temp


def _why(row: Row, predicted: cost.Cost, machine) -> str:
    """Why measured and predicted differ by more than 2×, from what the run shows."""
    r = row.ratio
    if 0.5 <= r <= 2:
        return ""
    reasons = []
    if r > 2:
        if row.predicted_s < 2e-4:
            reasons.append("below ~0.2 ms the dispatch of each XLA op and loop step dominates; the model charges "
                           f"{machine.launch_overhead_us:g} µs per kernel only")
        if row.xla_flops == row.xla_flops and row.xla_flops > 1.5 * row.model_flops:
            reasons.append(f"XLA executes {row.xla_flops / max(row.model_flops, 1):.1f}× the model's flops "
                           "(padded tiles, masks and selects the model does not count)")
        reasons.append("compute-bound by the model, but the ONF's tiled loops run below the profile's GEMM peak "
                       "(small contractions per step)" if predicted.bound == "compute" else
                       "memory-bound by the model, but elementwise passes it does not count (exp, selects, "
                       "padding) take longer than its bytes")
    else:
        llc = machine.l2_cache_bytes if machine.is_gpu else machine.llc_bytes
        if llc and row.model_bytes <= 2 * llc:
            reasons.append(f"its {row.model_bytes / 1e6:.3g} MB stay in the {llc / 2**20:.3g} MiB last-level cache, "
                           "which the model's main-memory β does not credit")
        else:
            reasons.append("the model charges every re-read of an input to main memory; the caches hold them")
    return "; ".join(reasons)


def run(kernels=None, *, full: bool = False, machine=None, reps: int = 3, progress=None, sizes=None,
        implementation=None) -> list:
    """Validate ``kernels`` (names in ``KERNELS``; None: all) at the quick or the seed's
    (``full``) sizes, or ``sizes`` ({"attention"|"decode"|"tokens": (n, …)}), on ``machine``
    (a name or profile; None: this machine's), returning one ``Row`` per kernel and size.
    ``progress(i, total, text)`` is told about each step. On a CPU profile the XLA kernels run;
    on a GPU profile (in a process that has the GPU) the Pallas kernels, predicted with that
    GPU's ONFs; ``implementation`` overrides ("pallas_interpret": the GPU ONFs' Pallas kernels
    run on the CPU — their wiring, not their speed)."""
    import jax

    from moajax import timing
    from moajax.compat import enable_x64_context

    names = check_kernels(kernels)
    machine = machines.local() if machine is None else machine
    if isinstance(machine, str):
        machine = machines.load(machine)
    impl = implementation or ("pallas" if machine.is_gpu else "xla")
    if impl == "pallas" and not any(d.platform in ("gpu", "cuda") for d in jax.devices()):
        raise ValueError(f"validate: machine {machine.name!r} is a GPU profile, and this process has no GPU; "
                         "validate a CPU profile here (or run on the GPU)")
    sizes = {**(FULL if full else QUICK), **(sizes or {})}
    todo = [(name, n) for name in names for n in sizes[KERNELS[name].sizes]]
    rows = []
    with enable_x64_context(True):
        for i, (name, n) in enumerate(todo):
            if progress is not None:
                progress(i, len(todo), f"{name} n={n}")
            b = KERNELS[name].build(n, machine, impl)
            got = b.run(*b.args)  # (the warm-up: compiles)
            err = _rel_error(got, b.reference()) if b.reference_bytes <= REFERENCE_BYTES else float("nan")
            t = timing.median_seconds(b.run, *b.args, reps=reps)
            predicted = cost.sequence(cost.estimate(o, machine, values=cost.values_read(o, b.values)) for o in b.onfs)
            predicted = dataclasses.replace(predicted, flops=predicted.flops + b.extra[0],
                                            bytes_moved=predicted.bytes_moved + b.extra[1])
            alpha = 1.0 / machine.peak(b.dtype)
            beta = 1.0 / machine.bandwidth
            t_pred = alpha * predicted.flops + beta * predicted.bytes_moved
            xf, xb, temp = _xla_cost(b.run, b.args)
            base_temp = _xla_cost(b.baseline, b.args)[2] if b.baseline is not None else -1
            row = Row(name, n, b.dtype, err, t, t_pred, predicted.flops, xf, predicted.bytes_moved, xb, temp,
                      base_temp, "")
            rows.append(dataclasses.replace(row, why=_why(row, predicted, machine)))
    if progress is not None:
        progress(len(todo), len(todo), "done")
    return rows


def table(rows) -> list:
    """The rows as a markdown table (``COLUMNS``)."""
    out = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" if c in ("kernel", "dtype", COLUMNS[-1]) else "---:"
                                                            for c in COLUMNS) + "|"]
    for r in rows:
        out.append(f"| {r.kernel} | {r.n} | {r.dtype} | {'—' if r.error != r.error else f'{r.error:.1e}'} | {r.measured_s:.3g} | {r.predicted_s:.3g} | "
                   f"{r.ratio:.2f} | {r.model_flops / 1e9:.3g} | {r.xla_flops / 1e9:.3g} | {r.model_bytes / 1e6:.3g} | "
                   f"{r.xla_bytes / 1e6:.3g} | {r.temp_bytes / 2**20:.3g} | "
                   f"{r.baseline_temp_bytes / 2**20:.3g} | {r.why} |")
    return out


def plot(rows, out_dir) -> list:
    """PNG plots: per kernel, predicted and measured time against n (log-log); temp memory
    against n for moajax and the plain JAX baseline. Returns the files written ([] without
    matplotlib, the ``plot`` extra)."""
    import pathlib

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out_dir = pathlib.Path(out_dir)
    names = list(dict.fromkeys(r.kernel for r in rows))
    files = []
    cols = min(3, len(names))
    rows_n = math.ceil(len(names) / cols)
    for what, path in (("time", "validation_time.png"), ("temp", "validation_memory.png")):
        fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.4 * rows_n), squeeze=False)
        for ax, name in zip(axes.flat, names):
            rs = [r for r in rows if r.kernel == name]
            ns = [r.n for r in rs]
            if what == "time":
                ax.loglog(ns, [r.measured_s for r in rs], "o-", label="measured")
                ax.loglog(ns, [r.predicted_s for r in rs], "s--", label="predicted α·F + β·M")
                ax.set_ylabel("seconds")
            else:
                ax.loglog(ns, [max(r.temp_bytes, 1) / 2**20 for r in rs], "o-", label="moajax")
                ax.loglog(ns, [max(r.baseline_temp_bytes, 1) / 2**20 for r in rs], "s--", label="jax.nn / jnp")
                ax.set_ylabel("temp MiB")
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("n")
            ax.legend(fontsize=7)
        for ax in list(axes.flat)[len(names):]:
            ax.axis("off")
        fig.tight_layout()
        fig.savefig(out_dir / path, dpi=90)
        plt.close(fig)
        files.append(out_dir / path)
    return files


def report(rows, machine, *, full: bool) -> list:
    """validation.md: the machine, the date, JAX's version, the table, and how to read it."""
    from moajax.timing import machine_line

    off = [r for r in rows if not 0.5 <= r.ratio <= 2]
    return [
        "# moajax validate: the cost model against measurement", "",
        machine_line(),
        f"Profile: {machine.name} ({machine.description}); α = 1/peak, β = 1/bandwidth from it "
        f"({machine.memory_bandwidth_gb_s:g} GB/s). Sizes: {'the seed' if full else 'quick'}"
        f"{'' if full else ' (--full for the seed’s)'}. Timed: median of repeated runs after a warm-up, all sizes in "
        "one process; float64 except decode (float32), as the seed. Error: max |moajax − reference| / max |reference| "
        "against plain-jnp float64 references (— where a reference's O(n²) scores would pass "
        f"{REFERENCE_BYTES / 2**30:g} GiB). XLA columns: the compiled executable's cost analysis (no hardware "
        "counters here); it counts a loop's body once, not once per trip, so a kernel walking its tiles in a loop "
        "shows fewer XLA flops than it executes. Temp: the compiled executable's temp allocation, moajax against jax.nn / plain jnp.", "",
        *table(rows), "",
        f"{len(off)} of {len(rows)} rows are more than 2× off; each says why.", "",
    ]


__all__ = ["KERNELS", "Row", "COLUMNS", "run", "table", "plot", "report", "check_kernels"]
