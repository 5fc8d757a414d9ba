"""The public kernels: drop-in replacements for jax.nn functions, computed by the DSL.

``dot_product_attention`` takes jax.nn's arguments and layout; its DNF comes from the
multi-head attention definition (``moajax.kernels.attention``), its schedule from the
machine (or the ``onf`` argument), and inside one jitted function the CPU lowers the ONF
to XLA loops and CUDA to a Pallas (Triton) kernel.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from moajax import compat, machines, runtime
from moajax.onf import ONF
from moajax.schedule import Preset, derive

_FLOATS = ("float16", "bfloat16", "float32", "float64")


def _shape_dtype(x, name, who: str = "dot_product_attention"):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{who}: {name} must be an array, got {type(x).__name__}")
    import jax.numpy as jnp

    return tuple(int(s) for s in x.shape), np.dtype(jnp.dtype(x.dtype))


def _check_broadcast(name, shape, target, who: str = "dot_product_attention"):
    if len(shape) > len(target):
        raise ValueError(f"{who}: {name} has rank {len(shape)} > {len(target)}; it must broadcast to {list(target)}")
    full = (1,) * (len(target) - len(shape)) + tuple(shape)
    for s, t in zip(full, target):
        if s not in (1, t):
            raise ValueError(
                f"{who}: {name} shape {list(shape)} does not broadcast to [B, N, T, S] = {list(target)}"
            )


def _attention_shapes(query, key, value, bias, mask, who: str = "dot_product_attention", empty_ok: bool = False):
    """jax.nn.dot_product_attention's arguments checked (named TypeError/ValueError): the
    shapes of query, key and value (rank 4, or 3 without a batch), their one float dtype, and
    bias and mask broadcasting to [B, N, T, S]. Returns (qs, ks, vs, dtype, batched, bias
    shape, bias dtype, mask shape), the shapes of rank 4 (a batch of 1 where none was given).
    ``empty_ok``: B, T or S may be 0 (the call's result is then jax.nn's, without a kernel)."""
    qs, qd = _shape_dtype(query, "query", who)
    ks, kd = _shape_dtype(key, "key", who)
    vs, vd = _shape_dtype(value, "value", who)
    if len(qs) not in (3, 4):
        raise ValueError(f"{who}: query must have rank 4 [B, T, N, H] or 3 [T, N, H], got shape {list(qs)}")
    if len(ks) != len(qs) or len(vs) != len(qs):
        raise ValueError(
            f"{who}: key and value must have the rank of query ({len(qs)}); "
            f"got key {list(ks)}, value {list(vs)}"
        )
    if qd.name not in _FLOATS:
        raise TypeError(f"{who}: query dtype must be one of {_FLOATS}, got {qd.name}")
    if kd != qd or vd != qd:
        raise TypeError(
            f"{who}: query, key and value must share one dtype; got query {qd.name}, "
            f"key {kd.name}, value {vd.name}"
        )
    batched = len(qs) == 4
    if not batched:
        qs, ks, vs = (1,) + qs, (1,) + ks, (1,) + vs
    B, T, N, H = qs
    Bk, S, K, Hk = ks
    Bv, Sv, Kv, E = vs
    if Bk != B or Bv != B:
        raise ValueError(f"{who}: batch sizes differ: query {B}, key {Bk}, value {Bv}")
    if Hk != H:
        raise ValueError(f"{who}: key head dim {Hk} does not match query head dim {H}")
    if (Sv, Kv) != (S, K):
        raise ValueError(f"{who}: value shape {list(vs)} does not match key shape {list(ks)} in S and K")
    if K == 0 or N % K:
        raise ValueError(f"{who}: query has {N} heads, not a multiple of the {K} key/value heads")
    if min(H, E, N) == 0 or (min(B, T, S) == 0 and not empty_ok):
        raise ValueError(f"{who}: zero-size dimension in query {list(qs)}, key {list(ks)} or "
                         f"value {list(vs)}")
    target = (B, N, T, S)
    bias_shape = bias_dtype = mask_shape = None
    if bias is not None:
        bias_shape, bias_dtype = _shape_dtype(bias, "bias", who)
        if bias_dtype.name not in _FLOATS:
            raise TypeError(f"{who}: bias dtype must be floating, got {bias_dtype.name}")
        _check_broadcast("bias", bias_shape, target if batched or len(bias_shape) == 4 else target[1:], who)
        bias_shape = (1,) * (4 - len(bias_shape)) + bias_shape  # rank 4: one kernel per pattern
    if mask is not None:
        mask_shape, mask_dtype = _shape_dtype(mask, "mask", who)
        if mask_dtype != np.bool_:
            raise TypeError(f"{who}: mask must be a bool array (True = keep), got {mask_dtype.name}")
        _check_broadcast("mask", mask_shape, target if batched or len(mask_shape) == 4 else target[1:], who)
        mask_shape = (1,) * (4 - len(mask_shape)) + mask_shape  # rank 4: one kernel per pattern
    return qs, ks, vs, qd, batched, bias_shape, bias_dtype, mask_shape


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                          query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                          implementation=None, return_residual=False, score_mod=None, onf=None, residuals="auto"):
    """softmax(scale · Q Kᵀ + bias, masked) V — jax.nn.dot_product_attention's contract.

    query [B, T, N, H] (or [T, N, H]); key and value [B, S, K, H] / [B, S, K, E] with
    N % K == 0 (grouped-query attention: query head n reads kv head ⌊n·K/N⌋); bias
    (added to the logits) and mask (bool, True = keep) broadcast to [B, N, T, S];
    ``scale`` defaults to 1/√H (a number, or an array known only when the call runs: then the
    query is multiplied by scale·√H, once more rounded in a 16-bit dtype); ``is_causal`` keeps s ≤ t; ``query_seq_lengths`` and
    ``key_value_seq_lengths`` (int [B]) keep t < its query length and s < its key length (the
    rows past the query length are 0); ``local_window_size`` (an int w, or (left, right)) keeps
    t − left ≤ s ≤ t + right. A row with no key kept averages V (jax.nn's result; its
    gradients are finite). B, T or S = 0 gives jax.nn's result too: an empty Out, or zeros
    over no keys. ``return_residual``: also return the rows' log-sum-exp of the
    masked scores, lse [B, T, N] (or [T, N]) in the inputs' dtype, held constant under
    differentiation (jax.nn's residual: FlashAttention-2's L; a row with no key kept gives
    jax.nn's fill −0.7·max(float32) + log S, −inf in float16); the kernel computes it in the
    same pass as Out, from the same row max and sum. ``score_mod(score, batch, head, q_idx, kv_idx) -> score``
    (FlexAttention's contract, written with jax.numpy on scalars) rewrites each score after
    the bias and before the masks; it is traced into the kernel's array expression
    (``moajax.trace``), so both backends run it and its derivative is derived with the rest
    (an array it closes over, such as a table of relative-position biases, gets its gradient).
    A −∞ it gives masks the key as ``mask`` does (a row with none kept averages V); a float
    array it closes over as a jit argument is looked at when the call runs, the masked
    kernel run where it holds ±∞ (under jit both are compiled, and a lax.cond picks). float16/bfloat16 accumulate in float32; float32 and float64 in
    themselves (float64 is float64-accurate). A GPU's float32 dots follow
    ``jax.default_matmul_precision`` as jax.nn's do: TF32 under JAX's default, IEEE float32
    under "highest" (the gradient takes the precision of the call); a CPU's are float32.

    ``onf``: None (the machine's default schedule), a ``moajax.ONF`` derived for exactly
    these shapes, or a ``moajax.schedule.Preset`` (carry, tiles, γ, store, knobs) applied
    on top of the default. ``implementation``: None (XLA on CPU, Pallas on CUDA), "xla",
    "pallas" or "pallas_interpret" (the Pallas kernel run on the CPU), "triton" or
    "triton_interpret" (the ONF's own Triton source, through jax-triton). ``residuals`` (also a
    Preset's choice): what the forward saves for ``jax.grad`` — "save" (the softmax's row max
    and sum, O(T) per head, and Out itself, from which the backward's Δ = +/(dO × O)), "auto"
    (so where the cost model says it is cheaper), "none" (hold nothing between forward and
    backward: the backward reruns the saving forward, then the adjoint reading what it saved,
    as FlashAttention's does without a saved log-sum-exp) or "recompute" (hold nothing: the
    backward's own kernels recompute the max, sum and Δ = +/(P × dP)).

    It is a thin wrapper: the arguments are checked here, then ``moajax.kernels.mha_kernel``
    (the DSL definition for this bias/mask broadcast pattern) runs like any ``@kernel``.
    """
    import jax
    import jax.numpy as jnp

    from moajax.kernels.attention import broadcast_dims, mha_kernel

    # a bias or mask given as Python values (a float, nested lists of bools), as jax.nn takes them
    bias, mask = (x if x is None or hasattr(x, "dtype") or not isinstance(x, (bool, int, float, list, tuple))
                  else jnp.asarray(x) for x in (bias, mask))
    qs, ks, vs, qd, batched, bias_shape, bias_dtype, mask_shape = _attention_shapes(query, key, value, bias, mask,
                                                                                     empty_ok=True)
    B, T, N, H = qs
    S, K = ks[1], ks[2]
    args = [query, key, value]
    if bias is not None:
        args.append(jnp.reshape(bias, bias_shape))
    if mask is not None:
        args.append(jnp.reshape(mask, mask_shape))
    scale = runtime.check_scale(scale, "dot_product_attention", traced_ok=True)
    if isinstance(scale, jax.core.Tracer):
        # a scale known only when the call runs (a jit argument, 1/jnp.sqrt(d) under jit): the
        # query multiplied by scale·√H beside the kernel's default scale 1/√H — the same
        # softmax(scale · Q Kᵀ), differentiable in scale through the product (a 16-bit query
        # is rounded once more, as the product is stored in its dtype)
        from moajax.kernels.common import accumulation_dtype

        acc = accumulation_dtype(qd)
        args[0] = (args[0].astype(acc) * (scale.astype(acc) * math.sqrt(H))).astype(qd)
        scale = None
    flags = runtime.check_flags("dot_product_attention", is_causal=is_causal, return_residual=return_residual)
    is_causal, return_residual = flags["is_causal"], flags["return_residual"]
    window = _check_window(local_window_size, T, S)
    mod = _check_score_mod(score_mod, qd)
    if min(B, T, S) == 0:
        # no query, or no key: jax.nn's result, an empty Out, or zeros where no key is kept
        # (its fully masked rows average V, but over no keys there is nothing to average)
        if return_residual and S == 0 and B * T:
            raise ValueError("dot_product_attention: return_residual with no keys (S = 0): the rows' "
                             "log-sum-exp over no scores is not defined")
        out = jnp.zeros((B, T, N, vs[3]) if batched else (T, N, vs[3]), qd)
        if return_residual:
            return out, jnp.zeros((B, T, N) if batched else (T, N), qd)
        return out
    lengths = [_check_lengths(name, x, B, n, batched) for name, x, n in (
        ("query_seq_lengths", query_seq_lengths, T), ("key_value_seq_lengths", key_value_seq_lengths, S))]
    # in the kernel's order (``mha_kernel``): the lengths, then the arrays score_mod closes over
    args += [x for x in lengths if x is not None]
    if mod is not None:
        args += [jnp.asarray(c) for c in mod.consts]
    runtime.check_onf_argument(onf, "dot_product_attention")
    onf = _backward_plan(onf, bias is not None, mod.consts if mod is not None else ())
    runtime.check_implementation(implementation, "dot_product_attention")
    runtime.check_residuals(residuals, "dot_product_attention")

    if not batched:
        args[:3] = [jnp.reshape(a, s) for a, s in zip(args[:3], (qs, ks, vs))]
    def kernel(mod):
        return mha_kernel(None if bias_shape is None else broadcast_dims(bias_shape),
                          None if mask_shape is None else broadcast_dims(mask_shape), K != N,
                          lengths[0] is not None, lengths[1] is not None, mod, bool(return_residual))

    kern = kernel(mod)
    if bias is None and mask is None and mod is None and not any(x is not None for x in lengths) and window is None:
        from moajax import ring

        # the sequence split over devices runs the ring, each device the plain kernel: eager or under
        # jit alike (an eager call is a jitted one over the arrays' own split: XLA's partitioner)
        kern = ring.sequence_lift(kern, mha_kernel(None, None, K != N) if return_residual else None)
    # a kernel like any other: compiled per platform, its gradient the compiled adjoint kernel
    # derived in the algebra (moajax.adjoint), reading the forward's saved row statistics
    options = dict(onf=onf, implementation=implementation, residuals=residuals,
                   scale=None if scale is None else float(scale), is_causal=bool(is_causal),
                   **({} if window is None else {"local_window_size": window}))
    tables = [] if mod is None or mod.infinite else mod.traced_tables
    if tables:
        # a float table the score_mod closes over as a jit argument: its values, unseen while
        # tracing (``trace.may_be_infinite``), decide at run time whether its −∞ needs the
        # masked fill — a kernel of its own (``as_infinite``: the select is a mask on data, with
        # the row guard's checks). Without it, a row the table masks whole gave NaN or another
        # row's weights, where the same concrete table gives jax.nn's masked row
        first = len(args) - len(mod.consts)
        # (vmapped over a table, one flag for the whole batch: a cond on a batched flag, or
        # under vmap(jit), where the flag is traced unbatched and batched later, ran both kernels)
        infinite = runtime.any_over_batch(jnp.stack([jnp.any(jnp.isinf(args[first + i])) for i in tables]))
        masked = kernel(mod.as_infinite())
        if not isinstance(infinite, jax.core.Tracer):
            # known now (an eager call, jax.grad's too: a bool has no tangent): the one kernel
            # it needs. A cond built afresh in each eager call compiled both again in each
            out = (masked if bool(infinite) else kern)(*args, **options)
        else:
            # an explicit ONF is one of the two kernels' (``attention_onf``: the finite one's,
            # for a table it sees finite): that kernel runs it, the other its default schedule
            finite_options = masked_options = options
            if isinstance(onf, ONF):
                dnf_options = {k: v for k, v in options.items() if k not in ("onf", "implementation", "residuals")}
                if runtime.onf_matches(onf, masked.dnf(*args, **dnf_options)):
                    finite_options = {**options, "onf": None}
                else:
                    masked_options = {**options, "onf": None}
            out = jax.lax.cond(infinite, lambda a: masked(*a, **masked_options),
                               lambda a: kern(*a, **finite_options), args)
    else:
        out = kern(*args, **options)
    if return_residual:  # (held constant in the kernel's own definition: no cotangent flows back)
        return (out[0], out[1]) if batched else (out[0][0], out[1][0])
    return out if batched else out[0]


# the seed's backward ONFs (REFERENCE.md §5) as plans of the adjoint's outputs: "atomic" — one
# kernel whose programs own query tiles, dK and dV scatter-added; "split" — dV in a kernel of
# its own owning key tiles, dK still scatter-added beside dQ; "owner" — no atomics (dQ owning
# query tiles, dK and dV owning key tiles), bitwise repeatable, the GPU default
def _backward_plan(onf, with_bias: bool, consts=()):
    """A Preset's ``backward`` named as the seed's ONFs, as the adjoint's plan (``consts``: the
    arrays a score_mod closes over; the gradients of its float ones, like the bias', sum over t
    and s: they join dQ and dK. Left out, the plan did not name every output and every
    implementation refused; an int table has no gradient, and naming one was refused too)."""
    import dataclasses

    from moajax.adjoint import differentiable

    if not isinstance(onf, Preset) or onf.backward is None or isinstance(onf.backward, tuple):
        return onf
    if onf.backward == "split":
        from moajax.kernels.attention import score_mod_const_names

        first = ("d_query", "d_key") + (("d_bias",) if with_bias else ()) + tuple(
            f"d_{n}" for n, c in zip(score_mod_const_names(len(consts)), consts)
            if differentiable(c.dtype))  # the adjoint's own rule for which inputs get a gradient
        return dataclasses.replace(onf, backward=(first, ("d_value",)))
    return onf  # "fused" (= "atomic"), "owner", "per_output": plans of any kernel


def _check_window(w, T: int, S: int, who: str = "dot_product_attention"):
    """jax.nn's local_window_size: None, an int w (= (w, w)) or (left, right), each ≥ 0; a
    side wider than the sequences (T queries, S keys) taken as max(T, S), which keeps every key
    too: the kernel's int32 index arithmetic (s − t + left) never wraps (2**31 − 1 masked
    every key)."""
    if w is None:
        return None
    pair = (w, w) if isinstance(w, (int, np.integer)) and not isinstance(w, bool) else w
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise TypeError(f"{who}: local_window_size must be an int or a (left, right) pair of ints, got {w!r}")
    for x in pair:
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise TypeError(f"{who}: local_window_size must hold ints, got {w!r}")
        if x < 0:
            raise ValueError(f"{who}: local_window_size must be ≥ 0, got {w!r}")
    return tuple(min(int(x), max(T, S)) for x in pair)


def _check_score_mod(fn, dtype, who: str = "dot_product_attention"):
    """score_mod traced on scalars (score in the accumulation dtype, four int32 indices)."""
    if fn is None:
        return None
    import inspect

    from moajax.kernels.common import accumulation_dtype
    from moajax.trace import ScalarFn

    if not callable(fn):
        raise TypeError(f"{who}: score_mod must be callable, got {type(fn).__name__}")
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        params = None
    if params is not None and not any(p.kind == p.VAR_POSITIONAL for p in params):
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        required = [p for p in positional if p.default is p.empty]
        if len(required) > 5 or len(positional) < 5:
            raise TypeError(f"{who}: score_mod must take 5 arguments (score, batch, head, q_idx, "
                            f"kv_idx), got a function of {len(positional)}")
    acc = accumulation_dtype(dtype)
    mod = ScalarFn.trace(fn, [acc] + [np.int32] * 4, f"{who}: score_mod")
    if mod.out_dtype.kind != "f":
        raise TypeError(f"{who}: score_mod must return a floating score, got {mod.out_dtype.name}")
    return mod


def _batch_ints(who, name, x, B, top, what, also=()):
    """An int [B] argument (or one of the shapes ``also``), each value in 0 … ``top`` where
    its values are known (under jit they are not checked): a named TypeError/ValueError."""
    import jax

    shape, dtype = _shape_dtype(x, name, who)
    if dtype.kind not in "iu":
        raise TypeError(f"{who}: {name} must be an integer array, got {dtype.name}")
    if shape != (B,) and shape not in also:
        raise ValueError(f"{who}: {name} must have shape [{B}] (one per batch element), got {list(shape)}")
    if not isinstance(x, jax.core.Tracer):
        v = np.asarray(x)
        if v.size and (v.min() < 0 or v.max() > top):
            raise ValueError(f"{who}: {name} must lie in 0 … {top} ({what}), got {v.tolist()}")


def _check_lengths(name, x, B, n, batched, who: str = "dot_product_attention"):
    """A sequence-length argument: int [B] (an unbatched call: [1] or a scalar), each in 0 … n
    where its values are known (under jit they are not checked)."""
    if x is None:
        return None
    import jax.numpy as jnp

    _batch_ints(who, name, x, B, n, "the sequence length", () if batched else ((), (1,)))
    # clamped to 0 … n in its own width first, as kv_append clamps its positions: cast to
    # int32 first, a traced int64 2**32 was 0 (no key kept) where n was meant
    return jnp.reshape(jnp.clip(jnp.asarray(x), 0, n).astype(jnp.int32), (B,))


def attention_onf(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                  query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None, score_mod=None,
                  machine=None, preset: Preset | None = None, return_residual=False) -> ONF:
    """The ONF ``dot_product_attention`` would use for these arguments (for inspection/tuning;
    ``return_residual``: of the kernel that also outputs lse), on ``machine`` (a profile or
    its name; None: this one's). Its variants are ``dot_product_attention``'s, checked alike:
    the lengths (int [B]) select the kernel that reads them, and their values, where known,
    are what ``moajax.cost.estimate(onf, machine, values={"query_seq_lengths": …})`` counts
    the skipped tiles by. A score_mod's tables are taken as given: where one holds ±∞ the kernel
    that masks like ``mask`` (as an eager call runs it); a finite one, or one a jit traces, the
    other — under jit ``dot_product_attention`` picks between the two at run time, and runs an
    explicit ONF in the kernel it was derived for, the other kernel's default schedule in the
    other."""
    from moajax.kernels.attention import mha_dnf

    who = "attention_onf"
    qs, ks, vs, qd, batched, bs, bd, ms = _attention_shapes(query, key, value, bias, mask, who)
    scale = runtime.check_scale(scale, who)
    flags = runtime.check_flags(who, is_causal=is_causal, return_residual=return_residual)
    is_causal, return_residual = flags["is_causal"], flags["return_residual"]
    if preset is not None and not isinstance(preset, Preset):
        raise TypeError(f"{who}: preset must be a moajax.Preset or None, got {type(preset).__name__}")
    window = _check_window(local_window_size, qs[1], ks[1], who)
    mod = _check_score_mod(score_mod, qd, who)
    for name, x, n in (("query_seq_lengths", query_seq_lengths, qs[1]), ("key_value_seq_lengths", key_value_seq_lengths, ks[1])):
        _check_lengths(name, x, qs[0], n, batched, who)
    dnf = mha_dnf(qs, ks, vs, qd, bs, bd, ms, None if scale is None else float(scale), bool(is_causal),
                  query_seq_lengths is not None, key_value_seq_lengths is not None, window,
                  residual=bool(return_residual), score_mod=mod, consts=() if mod is None else mod.consts)
    m = machine if machine is not None else machines.local()
    if isinstance(m, str):
        m = machines.load(m)
    return derive(dnf, m, preset)


def traced_onfs(fun, *args, **kwargs) -> list:
    """The kernels ``fun(*args, **kwargs)`` runs: one ``runtime.KernelRun`` per distinct
    kernel (its ``cpu`` and ``gpu`` ONFs or plans; ``.onf``, the one this process runs), in
    the order its traced program first reaches them — a kernel called twice (a block's two
    RMSNorms) is listed once. ``fun`` may be ``jax.grad``, ``jax.vmap`` or ``jax.jit`` of
    code that calls moajax, so a training step's forward and backward kernels can be read and
    costed (``moajax.cost.estimate``). Read from the program ``jax.make_jaxpr`` traces —
    every operation a kernel emits carries its name scope (``runtime.compiled_run``) — so it
    lists what the program runs, not what tracing touched and differentiation discarded
    (``jax.grad`` runs the saving forward and the adjoint, not the plain forward or the
    tangent it traces). Inputs split over devices: the whole arrays' kernels the program
    names; each device runs one derived for its block, chosen when XLA partitions the
    program (``moajax.shard``), which a trace does not see."""
    import jax

    if not callable(fun):
        raise TypeError(f"traced_onfs: fun must be callable, got {type(fun).__name__}")
    closed = jax.make_jaxpr(functools.partial(fun, **kwargs))(*args)
    found: list = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            _kernel_indices(str(eqn.source_info.name_stack), found)
            for p in eqn.params.values():
                for sub in p if isinstance(p, (tuple, list)) else (p,):
                    inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's, or a Jaxpr
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(closed.jaxpr)
    return [runtime.kernel_run(i) for i in found]


def _kernel_indices(text: str, found: list) -> None:
    """Append to ``found`` the kernel indices of the name scopes in ``text`` not in it yet."""
    import re

    for m in re.finditer(re.escape(runtime.KERNEL_SCOPE) + r"(\d+)", text):
        if int(m.group(1)) not in found:
            found.append(int(m.group(1)))


# ----------------------------------------------------------------------------- model kernels


def _same_float_dtype(who: str, arrays: dict):
    """The one floating dtype of ``arrays`` (name → array), or a TypeError naming the odd one."""
    first = None
    for name, x in arrays.items():
        shape, dt = _shape_dtype(x, name, who)
        if dt.name not in _FLOATS:
            raise TypeError(f"{who}: {name} must be a floating array ({', '.join(_FLOATS)}), got {dt.name}")
        if first is None:
            first = (name, dt)
        elif dt != first[1]:
            raise TypeError(f"{who}: {name} has dtype {dt.name}, {first[0]} has {first[1].name}; give them one dtype")
    return first[1]


def _check_eps(eps, who: str) -> None:
    """RMSNorm's ε: a positive finite static number."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.floating, np.integer)):
        raise TypeError(f"{who}: eps must be a number, got {type(eps).__name__}")
    if not (float(eps) > 0 and math.isfinite(float(eps))):
        raise ValueError(f"{who}: eps must be a positive finite number, got {eps}")


def _features(who: str, x):
    """x [..., D] checked (one axis at least: the features), as an array."""
    import jax.numpy as jnp

    x = jnp.asarray(x)
    if x.ndim < 1:
        raise ValueError(f"{who}: x must have at least one axis (the features), got a scalar")
    return x


def _over_rows(kern, x, *weights, **kw):
    """A rows kernel (x [n, D]) on x [..., D]: its leading axes of extent 1 dropped (a free
    reshape that keeps a split of the others), then the kernel over the leading axes left
    (``Kernel.over_leading_axes``: a split of any of them over devices stays a split; a
    reshape to [B·T, D] gathered x whole where T was split). x [D] is one row."""
    lead = tuple(s for s in x.shape[:-1] if s != 1)
    y = x.reshape(lead + x.shape[-1:]) if len(lead) != x.ndim - 1 else x
    if y.ndim == 1:
        out = kern(y[None], *weights, **kw)[0]
    else:
        out = (kern if y.ndim == 2 else kern.over_leading_axes(y.ndim - 2))(y, *weights, **kw)
    return out.reshape(x.shape[:-1] + out.shape[-1:]) if out.shape[:-1] != x.shape[:-1] else out


def rms_norm(x, weight, *, eps=1e-6, onf=None, implementation=None, residuals="auto"):
    """w ⊙ x ÷ √(mean(x²) + ε) over the last axis (paper IV's RMSNorm).

    x [..., D], weight [D], one floating dtype (16-bit inputs accumulate in float32). A DSL
    kernel (``moajax.kernels.norm.rmsnorm``) compiled like any: XLA loops on a CPU, Pallas on
    CUDA; ``jax.grad`` runs its adjoint derived in the algebra. ``onf``, ``implementation``
    and ``residuals`` as for ``dot_product_attention``."""
    from moajax.kernels.norm import rmsnorm

    who = "rms_norm"
    _same_float_dtype(who, {"x": x, "weight": weight})
    x = _features(who, x)
    D = x.shape[-1]
    if tuple(weight.shape) != (D,):
        raise ValueError(f"{who}: weight has shape {list(weight.shape)}, expected [{D}] (x's last axis)")
    _check_eps(eps, who)
    runtime.check_onf_argument(onf, who)
    runtime.check_implementation(implementation, who)
    runtime.check_residuals(residuals, who)
    if 0 in x.shape[:-1]:  # no rows: nothing to normalise
        return x
    return _over_rows(rmsnorm, x, weight, eps=float(eps), onf=onf, implementation=implementation, residuals=residuals)


def gated_mlp(x, w_gate, w_up, w_down, *, onf=None, implementation=None, residuals="auto"):
    """(silu(x +.× W_g) ⊙ x +.× W_u) +.× W_d over the last axis (paper IV's SwiGLU MLP).

    x [..., D], w_gate and w_up [D, F], w_down [F, D], one floating dtype. A DSL kernel
    (``moajax.kernels.mlp.swiglu``) compiled like any; ``jax.grad`` gives dx and the weight
    gradients, reductions over the tokens, from its derived adjoint. ``residuals`` (or the
    ``onf`` Preset's): what the forward keeps for the backward — "none", "recompute" and "auto" recompute U =
    x W_g and V = x W_u; ``("gate",)`` keeps U (paper IV); ``("gate", "up")`` keeps U and V
    (paper IV's count, 2nd + 4n·d_ff: ``Kernel.interface_ledger``). Each kept [tokens, F]
    array saves the backward one contraction."""
    from moajax.kernels.mlp import swiglu

    who = "gated_mlp"
    _same_float_dtype(who, {"x": x, "w_gate": w_gate, "w_up": w_up, "w_down": w_down})
    x = _features(who, x)
    D = x.shape[-1]
    if len(w_gate.shape) != 2 or w_gate.shape[0] != D:
        raise ValueError(f"{who}: w_gate has shape {list(w_gate.shape)}, expected [{D}, F] (D = x's last axis)")
    F = int(w_gate.shape[1])
    for name, w, want in (("w_up", w_up, (D, F)), ("w_down", w_down, (F, D))):
        if tuple(w.shape) != want:
            raise ValueError(f"{who}: {name} has shape {list(w.shape)}, expected {list(want)} (w_gate is [{D}, {F}])")
    if D == 0 or F == 0:
        raise ValueError(f"{who}: zero-size dimension: x's last axis D = {D}, w_gate [{D}, {F}]")
    runtime.check_onf_argument(onf, who)
    runtime.check_implementation(implementation, who)
    runtime.check_residuals(residuals, who)
    if 0 in x.shape[:-1]:  # no tokens
        return x
    return _over_rows(swiglu, x, w_gate, w_up, w_down, onf=onf, implementation=implementation, residuals=residuals)


def decode_attention(query, k_cache, v_cache, lengths=None, *, scale=None, onf=None, implementation=None):
    """out = softmax(scale · K +.× q, the first ``lengths`` keys) +.× V: one query per head
    against a key/value cache (paper III's decode step).

    query [B, N, H]; k_cache [B, S_max, K, H], v_cache [B, S_max, K, E] with N % K == 0 (GQA/MQA
    by ψ-selection of the kv head); ``lengths`` int [B] (None: every cache entry), runtime
    values under ``jit``. The DNF is multi-head attention's with one query row — ψ-reduction
    drops its axis of extent 1, leaving K +.× q — so a decode step is the last row of full
    attention over the same prefix, and its schedule the machine's: on a GPU, split-K over the
    cache with the softmax monoid's combine (flash-decoding) where B·N programs cannot fill
    it; the keys past a length are skipped tile by tile (``rewrites.skip_masked``). The
    papers' passes or the online pass: ``onf=Preset.of(carry="passes" | "online")``."""
    who = "decode_attention"
    _same_float_dtype(who, {"query": query, "k_cache": k_cache, "v_cache": v_cache})
    qs, ks, vs = (tuple(int(d) for d in a.shape) for a in (query, k_cache, v_cache))
    if len(qs) != 3:
        raise ValueError(f"{who}: query must be [B, N, H], got shape {list(qs)}")
    if len(ks) != 4 or len(vs) != 4:
        raise ValueError(f"{who}: k_cache and v_cache must be [B, S_max, K, H] and [B, S_max, K, E], "
                         f"got {list(ks)} and {list(vs)}")
    B, N, H = qs
    if ks[0] != B or ks[3] != H:
        raise ValueError(f"{who}: k_cache has shape {list(ks)}, expected [{B}, S_max, K, {H}] (query is {list(qs)})")
    if vs[:3] != ks[:3]:
        raise ValueError(f"{who}: v_cache has shape {list(vs)}, expected [{ks[0]}, {ks[1]}, {ks[2]}, E] "
                         f"(k_cache is {list(ks)})")
    if 0 in qs + ks + vs[3:]:
        raise ValueError(f"{who}: zero-size dimension in query {list(qs)}, k_cache {list(ks)} or v_cache {list(vs)}")
    if N % ks[2]:
        raise ValueError(f"{who}: {N} query heads are not a multiple of the cache's {ks[2]} kv heads")
    if lengths is not None:
        _batch_ints(who, "lengths", lengths, B, ks[1], "the cache length")
    scale = runtime.check_scale(scale, who, traced_ok=True)
    runtime.check_onf_argument(onf, who)
    runtime.check_implementation(implementation, who)
    out = dot_product_attention(query[:, None], k_cache, v_cache, scale=scale, key_value_seq_lengths=lengths,
                                onf=onf, implementation=implementation)
    return out[:, 0]


def kv_append(cache, new, positions):
    """cache with ⟨b, positions[b] + i⟩ψ cache ← ⟨b, i⟩ψ new: the catenation of each batch
    element's cached prefix with ``new``, written into the preallocated buffer.

    cache [B, S_max, ...], new [B, T_new, ...] (the same trailing axes and dtype), positions
    int [B] (where each element's new entries start). A scatter of the T_new rows: O(new)
    work, and in place under ``jax.jit(..., donate_argnums=0)`` (the donated buffer is the
    result's). Data movement only — no arithmetic for a DNF to fuse — so it is plain JAX.
    Positions with new entries outside the buffer are refused where their values are known;
    under ``jit`` they are not checked, and entries that would land outside [0, S_max) are
    dropped (never wrapped: a negative row is not counted from the end)."""
    import jax.numpy as jnp

    who = "kv_append"
    cs, cd = _shape_dtype(cache, "cache", who)
    ns, nd = _shape_dtype(new, "new", who)
    if nd != cd:
        raise TypeError(f"{who}: new has dtype {nd.name}, cache has {cd.name}; give them one dtype")
    if len(cs) < 2 or len(ns) != len(cs) or ns[0] != cs[0] or ns[2:] != cs[2:]:
        raise ValueError(f"{who}: new has shape {list(ns)}, expected [{cs[0]}, T_new, {', '.join(map(str, cs[2:]))}] "
                         f"(cache is {list(cs)})")
    B, S_max, T = cs[0], cs[1], ns[1]
    if T > S_max:
        raise ValueError(f"{who}: new holds {T} entries a batch element, more than the cache's {S_max} (new "
                         f"{list(ns)}, cache {list(cs)})")
    _batch_ints(who, "positions", positions, B, S_max - T, f"the new {T} entries within the cache's {S_max}")
    # clamped in the positions' own width first (an int64 2**32 cast to int32 is 0, the front),
    # then a row below 0 sent past the end: .at[].set(mode="drop") wraps a negative index once
    p = jnp.asarray(positions)
    p = jnp.clip(p.astype(jnp.promote_types(p.dtype, jnp.int32)), -T - 1, S_max).astype(jnp.int32)
    rows = p[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    rows = jnp.where(rows < 0, S_max, rows)
    batch = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, T))
    return jnp.asarray(cache).at[batch, rows].set(new, mode="drop")


# ----------------------------------------------------------------------------- the block

BLOCK_PARAMS = {"attn_norm": "D", "wq": "D N H", "wk": "D K H", "wv": "D K H", "wo": "N H D", "mlp_norm": "D",
                "w_gate": "D F", "w_up": "D F", "w_down": "F D"}


def _block_dims(who: str, params, x) -> dict:
    """The block's sizes from its params and x [B, T, D], every shape and dtype checked."""
    from collections.abc import Mapping

    if not isinstance(params, Mapping):
        raise TypeError(f"{who}: params must be a dict of arrays, got {type(params).__name__}")
    missing = [k for k in BLOCK_PARAMS if k not in params]
    if missing:
        raise ValueError(f"{who}: params is missing {', '.join(map(repr, missing))} "
                         f"(it needs {', '.join(BLOCK_PARAMS)})")
    _same_float_dtype(who, {"x": x, **{k: params[k] for k in BLOCK_PARAMS}})
    if len(x.shape) != 3:
        raise ValueError(f"{who}: x must be [B, T, D], got shape {list(x.shape)}")
    dims = {"D": int(x.shape[2])}
    for name, spec in BLOCK_PARAMS.items():
        shape = tuple(int(d) for d in params[name].shape)
        letters = spec.split()
        if len(shape) != len(letters):
            raise ValueError(f"{who}: params[{name!r}] must be [{', '.join(letters)}], got shape {list(shape)}")
        for letter, n in zip(letters, shape):
            if dims.setdefault(letter, n) != n:
                raise ValueError(f"{who}: params[{name!r}] has shape {list(shape)}: its {letter} is {n}, "
                                 f"elsewhere {dims[letter]} ([{', '.join(letters)}])")
    zero = [k for k, n in dims.items() if n == 0] + [k for k, n in zip("BT", x.shape[:2]) if n == 0]
    if zero:
        raise ValueError(f"{who}: zero-size dimension {', '.join(zero)} (x {list(x.shape)}, params as "
                         f"{', '.join(f'{k}={n}' for k, n in dims.items())})")
    if dims["N"] % dims["K"]:
        raise ValueError(f"{who}: {dims['N']} query heads are not a multiple of {dims['K']} kv heads")
    return dims


def rope(x, positions, theta: float):
    """Rotary position embedding of x [B, T, N, H] (H even) at ``positions`` [T]: each half-pair
    (x_i, x_{i+H/2}) rotated by the angle t·θ^(−2i/H) (the rotate-half convention)."""
    import jax.numpy as jnp

    H = x.shape[-1]
    # the angles, their cos and sin and the rotation in float32 at least, then x's dtype: in
    # bfloat16 a position past 256 is not even representable, and t·θ^(−2i/H) rounded to 8 bits
    # before its cos put a block's output 3× further from float64 (1.8e-2 against 5.5e-3 at T = 256)
    wide = jnp.promote_types(x.dtype, jnp.float32)
    freqs = float(theta) ** (-np.arange(0, H // 2, dtype=np.float64) * 2.0 / H)
    ang = jnp.asarray(positions, wide)[:, None] * jnp.asarray(freqs, wide)[None]  # [T, H/2]
    cos, sin = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]
    x1, x2 = x[..., : H // 2].astype(wide), x[..., H // 2:].astype(wide)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def transformer_block(params, x, *, is_causal=True, eps=1e-6, rope_theta=None, onf=None, implementation=None):
    """y = h + gated_mlp(rms_norm(h)),  h = x + attention(rms_norm(x) W_q, W_k, W_v) W_o: the
    pre-norm block (paper IV) as its kernels.

    x [B, T, D]; ``params``: attn_norm [D], wq [D, N, H], wk and wv [D, K, H] (GQA when K < N),
    wo [N, H, D], mlp_norm [D], w_gate and w_up [D, F], w_down [F, D]; one floating dtype.
    With ``rope_theta`` the rotary embedding (``rope``) turns q and k. RMSNorm, attention
    and the MLP are the DSL kernels (``rms_norm``, ``dot_product_attention``, ``gated_mlp``),
    their gradients their derived adjoints; the projections are dots (float32 at full
    precision). ``onf`` and ``implementation`` go to every kernel."""
    import jax.numpy as jnp
    from jax import lax

    who = "transformer_block"
    dims = _block_dims(who, params, x)
    _check_eps(eps, who)
    is_causal = runtime.check_flags(who, is_causal=is_causal)["is_causal"]
    runtime.check_onf_argument(onf, who)
    runtime.check_implementation(implementation, who)
    if rope_theta is not None:
        if isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float, np.integer, np.floating)):
            raise TypeError(f"{who}: rope_theta must be a static Python number, got {type(rope_theta).__name__}")
        if dims["H"] % 2 or not (math.isfinite(float(rope_theta)) and float(rope_theta) > 0):
            raise ValueError(f"{who}: rope_theta needs an even head dim and a finite positive base, got "
                             f"H = {dims['H']}, rope_theta = {rope_theta}")
    kw = dict(onf=onf, implementation=implementation)
    hi = lax.Precision.HIGHEST
    p = params
    a = rms_norm(x, p["attn_norm"], eps=eps, **kw)
    q, k, v = (jnp.einsum("btd,dnh->btnh", a, p[w], precision=hi) for w in ("wq", "wk", "wv"))
    if rope_theta is not None:
        pos = jnp.arange(x.shape[1])
        q, k = rope(q, pos, rope_theta), rope(k, pos, rope_theta)
    att = dot_product_attention(q, k, v, is_causal=is_causal, **kw)
    # on a mesh of Explicit axes with the heads split, Σ over them is ambiguous to JAX: its
    # result takes x's split (JAX raised, asking for it, where jnp's einsum does the same)
    split = compat.explicit_sharding(x)
    h = x + jnp.einsum("btnh,nhd->btd", att, p["wo"], precision=hi,
                       **({} if split is None else {"out_sharding": split}))
    return h + gated_mlp(rms_norm(h, p["mlp_norm"], eps=eps, **kw), p["w_gate"], p["w_up"], p["w_down"], **kw)


def transformer_stack(stacked_params, x, **options):
    """The blocks of ``stacked_params`` (each entry with a leading layer axis) applied in turn
    by ``lax.scan``: one compiled block, L layers. ``options`` as ``transformer_block``'s."""
    import jax

    who = "transformer_stack"
    from collections.abc import Mapping

    if not isinstance(stacked_params, Mapping) or "attn_norm" not in stacked_params:
        raise ValueError(f"{who}: stacked_params must be a dict of the block's params with a leading layer axis")
    for name, v in stacked_params.items():
        if not hasattr(v, "shape") or not len(v.shape):
            raise TypeError(f"{who}: stacked_params[{name!r}] must be an array with a leading layer axis, "
                            f"got {type(v).__name__}")
    layers = {int(v.shape[0]) for v in stacked_params.values()}
    if len(layers) != 1:
        raise ValueError(f"{who}: the params' leading (layer) axes differ: {sorted(layers)} (each entry is the "
                         "block's param with a leading layer axis, [L, ...])")

    def layer(h, p):
        return transformer_block(p, h, **options), None

    return jax.lax.scan(layer, x, stacked_params)[0]
