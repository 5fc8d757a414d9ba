"""Scaled dot-product attention (paper I), multi-head with GQA, and one decode step (paper III).

For one head:  Out = softmax(scale · Q +.× ⍉K  [+ bias] [masked]) +.× V.
Multi-head in jax.nn's [B, T, N, H] layout is the same cell under Ω over batch, kv head and
query group: with N = K·G query heads, ⟨b t n⟩ reads the kv head ⌊n/G⌋ (ψ-selection; K and V
are never repeated).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from moajax import moa
from moajax.kernel import kernel
from moajax.kernels.common import accumulation_dtype, large_negative


def causal_keep(t: int, s: int, dims=("t", "s")) -> moa.Array:
    """ι t ≥.× ι s: keep key s for query t when s ≤ t (top-left aligned, like jnp.tril)."""
    return moa.outer(moa.ge, moa.iota(t, dims[0]), moa.iota(s, dims[1]))


def _with_cell(score: moa.Array, x: moa.Array, axes: tuple, fn):
    """fn(score, x) where x holds only the ``axes`` ("t", "s") of the [t, s] score cell."""
    if axes == ("t", "s") or axes == ():
        return fn(score, x)
    if axes == ("s",):
        return moa.omega(fn, (1, 1))(score, x)  # x is the same for every row
    if axes == ("t",):
        return moa.omega(fn, (1, 0))(score, x)  # one value per row
    raise ValueError(f"unsupported cell axes {axes}")


def window_keep(t: int, s: int, window: tuple, dims=("t", "s")) -> moa.Array:
    """(ι t ≤.× ι s + left) ∧ (ι t + right ≥.× ι s): key s within [t − left, t + right] (jax.nn's
    ``local_window_size``)."""
    left, right = window
    it, is_ = moa.iota(t, dims[0]), moa.iota(s, dims[1])
    return moa.logical_and(moa.outer(moa.le, it, is_ + left), moa.outer(moa.ge, it + right, is_))


def scored(score: moa.Array, score_mod, batch, head) -> moa.Array:
    """score_mod(score, batch, head, q_idx, kv_idx) for every element of the [t s] score
    (FlexAttention's contract): a traced scalar function (``moajax.trace.ScalarFn``, with its
    constants as moa arrays: ``score_mod = (fn, consts)``) applied by scalar extension, q_idx
    and kv_idx being ι t and ι s spread over the cell."""
    fn, consts = score_mod
    (t, s), (dt, ds) = score.shape, score.dims
    q_idx = moa.omega(lambda i, row: moa.omega(lambda _, ii: ii, (0, 0))(row, i), (0, 1))(
        moa.iota(t, dt), moa.iota(s, ds))
    kv_idx = moa.omega(lambda _, row: row, (0, 1))(moa.iota(t, dt), moa.iota(s, ds))
    out = fn.apply([score, batch, head, q_idx, kv_idx], consts)
    if out.shape != score.shape:  # a constant score (uniform attention), read in every cell
        out = moa.omega(lambda _, c: c, (0, 0))(score, out)
    return out if out.dtype == score.dtype else moa.cast(out, score.dtype)


def attention_scores(q, k, *, scale: float, is_causal: bool, bias=None, bias_axes=(), mask=None, mask_axes=(),
                     window=None, q_length=None, kv_length=None, score_mod=None, batch=None, head=None):
    """scale · Q +.× ⍉K [+ bias] [score_mod] [masked] for q [t h], k [s h] (accumulation
    dtype); masked (set to jax.nn's large negative): a bool ``mask``, causal, a local
    ``window`` (left, right), the lengths (scalars); ``score_mod`` (``scored``) with this
    cell's batch and head indices. A score_mod's −∞ is that large negative (it masks like
    ``mask``; where its code can give ±∞); a bias' is half of it (the key stays kept)."""
    score = moa.name("score", (q @ moa.transpose(k)) * scale)
    big = large_negative(score.dtype)
    if bias is not None:
        # a −∞ bias is held at half the fill: a row whose every kept key has one then averages
        # V over its kept keys (equal scores), however the walks skip masked tiles — which
        # leave out the fill only where a kept key scores above it (``masked``). As −∞, such a
        # row took its weights from the masked keys of the tiles walked (jax.nn's: from all
        # its masked keys, NaN where there are none), and its gradients were NaN on a GPU.
        # Not the fill itself (then the row would need every key, skipped ones too); a select
        # on −∞ alone, whose cotangent (dBias is 0 there) reads the bias it adds anyway
        bias = moa.where(moa.ne(bias, -np.inf), bias, big / 2)
        score = _with_cell(score, bias, bias_axes, moa.add)
    if score_mod is not None:
        score = scored(score, score_mod, batch, head)
    if score_mod is not None and score_mod[0].infinite:
        # a −∞ from the score_mod (a mask written FlexAttention's way) is jax.nn's masked
        # logit, as from ``mask``: a row with no finite score averages V with finite gradients,
        # where −∞ − −∞ would have made it NaN. Written c ? x : m₀ with c = (x ≠ −∞) — a mask
        # on data, so tile skipping keeps only the bounds that need no guard (``masked``: a
        # row whose every key is masked averages all its keys, skipped tiles too), as for
        # ``mask``; a select on −∞ alone, so a NaN stays NaN. Only where the score_mod's code
        # can give ±∞ (``trace.may_be_infinite``): a mask on data costs the row guard's checks
        # (``onf.RowGuard``) and, on a GPU, smaller forward tiles where the check's registers
        # do not fit (gpu_report.md, "causal mask"). (Its table gradients' spills were a
        # layout, gone with ``rewrites.conditions_out``: table_grad_spills_ptx.md.)
        score = moa.where(moa.ne(score, -np.inf), score, big)
    if mask is not None:
        score = _with_cell(score, mask, mask_axes, lambda s, m: moa.where(m, s, big))
    t, s, dims = q.shape[0], k.shape[0], (q.dims[0], k.dims[0])
    if is_causal:
        score = moa.where(causal_keep(t, s, dims), score, big)
    if window is not None:
        score = moa.where(window_keep(t, s, window, dims), score, big)
    # the lengths (jax.nn's query_seq_lengths, key_value_seq_lengths; scalars of this batch
    # element): keep the rows ι t < q_length and the keys ι s < kv_length
    for length, axes, n, d in ((q_length, ("t",), t, dims[0]), (kv_length, ("s",), s, dims[1])):
        if length is not None:
            score = _with_cell(score, moa.lt(moa.iota(n, d), length), axes, lambda x, m: moa.where(m, x, big))
    return score


def attention_probs(q, k, **scores):
    """P = softmax(``attention_scores``) along the keys."""
    return moa.softmax(attention_scores(q, k, **scores), axis=-1)


def attention_lse(q, k, *, held: bool = True, **scores):
    """stop_gradient(⌈/S + log +/exp(S − ⌈/S)) of S = ``attention_scores`` along the keys
    (``moa.softmax_lse``: the softmax's own max and sum): the log-normaliser per row, held
    constant under differentiation (jax.nn's ``return_residual``; a fully masked row gives
    its large negative + log S, as jax.nn does). Not ``held``: lse itself, differentiable
    (d lse = P ⊙ dS summed over the keys: what a merge of partial attentions differentiates)."""
    lse = moa.softmax_lse(attention_scores(q, k, **scores), axis=-1)
    return moa.stop_gradient(lse) if held else lse


def attention_cell(q, k, v, *, scale: float, is_causal: bool, q_length=None, **extras):
    """The per-head definition: q [t h], k [s h], v [s e] (already in the accumulation dtype);
    the rows past ``q_length`` are 0 (as jax.nn gives them)."""
    out = attention_probs(q, k, scale=scale, is_causal=is_causal, q_length=q_length, **extras) @ v
    if q_length is None:
        return out
    rows = moa.lt(moa.iota(q.shape[0], q.dims[0]), q_length)
    return moa.omega(lambda row, keep: moa.where(keep, row, 0.0), (1, 0))(out, rows)


def attention_grads(q, k, v, d_out, probs, *, scale: float):
    """Paper II, algorithm 1, as array math over the probabilities P [t s]:

        dV = ⍉P +.× dO      dP = dO +.× ⍉V      Δ = +/ (P × dP) along s
        dS = scale · P × (dP −Ω⟨1 0⟩ Δ)      dQ = dS +.× K      dK = ⍉dS +.× Q

    Δ is the paper's corr (= +/ dO × Out); every transpose is a reordered read. A masked
    score has P = 0 exactly, so its dS is 0 (it is a constant of the forward)."""
    dv = moa.transpose(probs) @ d_out
    dp = moa.name("dprobs", d_out @ moa.transpose(v))
    delta = moa.name("delta", moa.sum(probs * dp, axis=-1))
    ds = moa.name("dscore", probs * moa.omega(moa.sub, (1, 0))(dp, delta) * scale)
    return ds @ k, moa.transpose(ds) @ q, dv

@kernel(example=dict(t=8, s=12, h=4, e=6))
def attention(query: "t h", key: "s h", value: "s e", *, scale: float | None = None, is_causal: bool = False):
    """Out = softmax(scale · Q +.× ⍉K) +.× V; ⍉K is a reordered read, never a buffer."""
    acc = accumulation_dtype(query.dtype)
    q, k, v = moa.cast(query, acc), moa.cast(key, acc), moa.cast(value, acc)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    return moa.cast(attention_cell(q, k, v, scale=scale, is_causal=is_causal), query.dtype)


def _per_head(query, key, value, d_out, scale):
    acc = accumulation_dtype(query.dtype)
    q, k, v, g = (moa.cast(a, acc) for a in (query, key, value, d_out))
    return q, k, v, g, 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)


@kernel(example=dict(t=8, s=12, h=4, e=6), outputs=("dq", "dk", "dv"))
def attention_backward(query: "t h", key: "s h", value: "s e", d_out: "t e", *,
                       scale: float | None = None, is_causal: bool = False):
    """(dQ, dK, dV) of Σ Out × dO, Out = softmax(scale · Q +.× ⍉K) +.× V (paper II, alg. 1)."""
    q, k, v, g, scale = _per_head(query, key, value, d_out, scale)
    p = attention_probs(q, k, scale=scale, is_causal=is_causal)
    dq, dk, dv = attention_grads(q, k, v, g, p, scale=scale)
    return moa.cast(dq, query.dtype), moa.cast(dk, key.dtype), moa.cast(dv, value.dtype)


@kernel(example=dict(t=8, s=12, h=4, e=6), outputs=("out", "dq", "dk", "dv"))
def attention_forward_backward(query: "t h", key: "s h", value: "s e", d_out: "t e", *,
                               scale: float | None = None, is_causal: bool = False):
    """Out and (dQ, dK, dV) from one P (paper II, alg. 2: the softmax row is computed once)."""
    q, k, v, g, scale = _per_head(query, key, value, d_out, scale)
    p = attention_probs(q, k, scale=scale, is_causal=is_causal)
    dq, dk, dv = attention_grads(q, k, v, g, p, scale=scale)
    return (moa.cast(p @ v, query.dtype), moa.cast(dq, query.dtype), moa.cast(dk, key.dtype),
            moa.cast(dv, value.dtype))


@kernel(example=dict(s=16, h=4, e=6))
def decode(query: "h", key: "s h", value: "s e", *, scale: float | None = None):
    """out = softmax(scale · K +.× q) +.× V: one query row against the cache."""
    acc = accumulation_dtype(query.dtype)
    q, k, v = moa.cast(query, acc), moa.cast(key, acc), moa.cast(value, acc)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    score = moa.name("score", (k @ q) * scale)
    return moa.cast(moa.softmax(score, axis=-1) @ v, query.dtype)


# ----------------------------------------------------------------------------- multi-head


def _split_heads_levels(x: moa.Array, shape4, N: int, K: int, dims_ts=("t", "s")):
    """Prepare a bias/mask array broadcastable to [B, N, T, S] for the Ω levels (b, kv, g).

    Returns (array whose leading axes are its levels, levels present, cell axes present)."""
    B_, N_, T_, S_ = shape4
    G = N // K
    keep_b, keep_n, keep_t, keep_s = B_ != 1, N_ != 1, T_ != 1, S_ != 1
    # drop the size-1 (broadcast) axes: a reshape onto the remaining ones
    new_shape, new_dims = [], []
    for keep, size, d in ((keep_b, B_, "b"), (keep_n, N_, "n"), (keep_t, T_, dims_ts[0]), (keep_s, S_, dims_ts[1])):
        if keep:
            new_shape.append(size)
            new_dims.append(d)
    x = moa.reshape(x, tuple(new_shape), dims=tuple(new_dims)) if tuple(new_shape) != x.shape else x
    levels = []
    if keep_b:
        levels.append("b")
    if keep_n:
        # split the query heads n = kv·G + g
        pos = new_dims.index("n")
        shp = list(x.shape)
        dims = list(x.dims)
        shp[pos: pos + 1] = [K, G]
        dims[pos: pos + 1] = ["n_kv", "g"]
        x = moa.reshape(x, tuple(shp), dims=tuple(dims))
        levels += ["kv", "g"]
    cell_axes = tuple(a for a, keep in (("t", keep_t), ("s", keep_s)) if keep)
    return x, tuple(levels), cell_axes


def mha_expression(query, key, value, bias=None, mask=None, q_lengths=None, kv_lengths=None, *, scale: float,
                   is_causal: bool, window=None, score_mod=None, residual: bool = False):
    """Multi-head attention in jax.nn's layout, as an array expression over moa inputs:
    query [b t n h], key [b s n_kv h], value [b s n_kv e], bias/mask broadcastable to [b n t s],
    the sequence lengths [b] (int), a local ``window`` (left, right) or None, a ``score_mod``
    (fn, its constants as moa inputs) or None. With ``residual``: (Out, lse [b t n]), lse the
    rows' ``attention_lse`` (jax.nn's ``return_residual``), built from the same scores; held
    constant, or differentiable where ``residual`` is "live"."""
    B, T, N, H = query.shape
    _, S, K, _ = key.shape
    E = value.shape[-1]
    G = N // K
    acc = accumulation_dtype(query.dtype)
    q = moa.cast(moa.transpose(moa.reshape(query, (B, T, K, G, H), ("b", "t", "n_kv", "g", "h")), (0, 2, 3, 1, 4)), acc)
    k = moa.cast(moa.transpose(key, (0, 2, 1, 3)), acc)  # [b kv s h]
    v = moa.cast(moa.transpose(value, (0, 2, 1, 3)), acc)  # [b kv s e]
    # operands per Ω level: (array, levels it varies along)
    ops_ = [(q, ("b", "kv", "g")), (k, ("b", "kv")), (v, ("b", "kv"))]
    extra = {}
    if bias is not None:
        b4 = (1,) * (4 - bias.rank) + tuple(bias.shape)
        x, lv, cax = _split_heads_levels(moa.cast(bias, acc), b4, N, K)
        extra["bias"] = (len(ops_), cax)
        ops_.append((x, lv))
    if mask is not None:
        m4 = (1,) * (4 - mask.rank) + tuple(mask.shape)
        x, lv, cax = _split_heads_levels(mask, m4, N, K)
        extra["mask"] = (len(ops_), cax)
        ops_.append((x, lv))
    for name, lengths in (("q_length", q_lengths), ("kv_length", kv_lengths)):
        if lengths is not None:  # one scalar per batch element: a cell of the b level only
            extra[name] = (len(ops_), None)
            ops_.append((lengths, ("b",)))
    if score_mod is not None:  # the cell's batch index b, its head's (kv, g), the constants
        fn, consts = score_mod
        extra["score_mod"] = (len(ops_), len(consts))
        ops_ += [(moa.iota(B, "b"), ("b",)), (moa.iota(K, "n_kv"), ("kv",)), (moa.iota(G, "g"), ("g",))]
        ops_ += [(c, ()) for c in consts]

    def cell(*cells, of=attention_cell):
        kw = {}
        if "bias" in extra:
            i, cax = extra["bias"]
            kw.update(bias=cells[i], bias_axes=cax)
        if "mask" in extra:
            i, cax = extra["mask"]
            kw.update(mask=cells[i], mask_axes=cax)
        kw.update({name: cells[extra[name][0]] for name in ("q_length", "kv_length") if name in extra})
        if "score_mod" in extra:
            i, n = extra["score_mod"]
            kw.update(score_mod=(score_mod[0], cells[i + 3:i + 3 + n]), batch=cells[i],
                      head=cells[i + 1] * G + cells[i + 2])  # n = kv·G + g
        if of is attention_lse:
            return attention_lse(cells[0], cells[1], held=residual != "live", scale=scale, is_causal=is_causal,
                                 window=window, **kw)
        return attention_cell(cells[0], cells[1], cells[2], scale=scale, is_causal=is_causal, window=window, **kw)

    # Ω over the levels b, kv, g, outermost first: an operand joins a level's frame only if it
    # varies along it (so K and V are shared by the G query heads of their kv head)
    def nest(level_idx, arrays_levels, of=attention_cell):
        levels = ("b", "kv", "g")
        if level_idx == len(levels):
            return cell(*[a for a, _ in arrays_levels], of=of)
        lev = levels[level_idx]
        ranks = []
        for a, lv in arrays_levels:
            ranks.append(a.rank - 1 if lev in lv else a.rank)

        def inner(*cells):
            return nest(level_idx + 1, [(c, lv) for c, (_, lv) in zip(cells, arrays_levels)], of)

        return moa.omega(inner, tuple(ranks))(*[a for a, _ in arrays_levels])

    out = nest(0, ops_)  # [b kv g t e]
    out = moa.transpose(out, (0, 3, 1, 2, 4))  # [b t kv g e]
    out = moa.cast(moa.reshape(out, (B, T, N, E), dims=("b", "t", "n", "e")), query.dtype)
    if not residual:
        return out
    lse = moa.transpose(nest(0, ops_, attention_lse), (0, 3, 1, 2))  # [b kv g t] → [b t kv g]
    lse = moa.cast(moa.reshape(lse, (B, T, N), dims=("b", "t", "n")), query.dtype)
    # held constant outside its cast too: a 16-bit lse's value before rounding is no residual
    return out, (lse if residual == "live" else moa.stop_gradient(lse))


def broadcast_dims(shape) -> str:
    """The dims of a bias or mask broadcastable to [b n t s]: each axis named as the target's
    (right-aligned, as jax.nn broadcasts), a size-1 axis named apart (``b1``, ``n1``, …) so
    that it never fixes the size of the target's dimension."""
    full = ("b", "n", "t", "s")[4 - len(shape):]
    return " ".join(d + "1" if size == 1 else d for d, size in zip(full, shape))


def _mha(query, key, value, bias=None, mask=None, q_lengths=None, kv_lengths=None, *, scale: float | None = None,
         is_causal: bool = False, local_window_size=None, score_mod=None, residual: bool = False):
    B, T, N, H = query.shape
    if N % key.shape[2]:
        raise moa.MoAShapeError(f"mha: {N} query heads are not a multiple of {key.shape[2]} kv heads")
    scale = 1.0 / math.sqrt(H) if scale is None else float(scale)
    return mha_expression(query, key, value, bias, mask, q_lengths, kv_lengths, scale=scale,
                          is_causal=bool(is_causal), window=local_window_size, score_mod=score_mod,
                          residual=residual)


@kernel(example=dict(b=2, t=8, n=4, s=12, n_kv=2, h=4, e=4))
def mha(query: "b t n h", key: "b s n_kv h", value: "b s n_kv e", *, scale: float | None = None,
        is_causal: bool = False, local_window_size: tuple | None = None):
    """jax.nn layout: per (b, n), attention against kv head ⌊n·K/N⌋ (GQA by ψ-selection);
    ``local_window_size`` (left, right): key s within [t − left, t + right]."""
    return _mha(query, key, value, scale=scale, is_causal=is_causal, local_window_size=local_window_size)


def mha_kernel(bias_dims: str | None = None, mask_dims: str | None = None, grouped: bool = True,
               q_lengths: bool = False, kv_lengths: bool = False, score_mod=None, residual: bool = False):
    """``mha`` with a bias and/or a mask of these dims (``broadcast_dims``) and/or the query and
    key/value sequence lengths (int [b]) and/or a ``score_mod`` (a ``moajax.trace.ScalarFn``,
    whose constants are further arguments): one kernel per pattern, each compiled and
    differentiated like any kernel — what ``moajax.dot_product_attention`` calls. Without
    ``grouped`` (as many kv heads as query heads) key and value name their head axis ``n`` like
    the query: dQ, dK and dV then share it, so one program per head computes all three and the
    row statistics are shared. With ``residual`` it has a second output, lse [b t n] (jax.nn's
    ``return_residual``: ``attention_lse``, held constant under differentiation); with
    ``residual="live"`` lse is differentiable (the ring's forward mode merges the blocks'
    (Out, lse) and their tangents: ``moajax.ring``). One kernel object per pattern, however
    the call spells it (its compile caches are the kernel's)."""
    return _mha_kernel(bias_dims, mask_dims, bool(grouped), bool(q_lengths), bool(kv_lengths), score_mod,
                       residual if residual == "live" else bool(residual))


def score_mod_const_names(n: int) -> tuple:
    """The attention kernel's parameters for the ``n`` arrays a score_mod closes over (after
    the lengths); their gradients are d_ of these."""
    return tuple(f"score_mod_const{i}" for i in range(n))


@functools.lru_cache(maxsize=64)
def _mha_kernel(bias_dims, mask_dims, grouped, q_lengths, kv_lengths, score_mod, residual):
    import inspect

    from moajax.kernel import Kernel

    if (bias_dims is None and mask_dims is None and grouped and not q_lengths and not kv_lengths
            and score_mod is None and not residual):
        return mha
    consts = [] if score_mod is None else list(score_mod_const_names(len(score_mod.consts)))
    names = ["query", "key", "value"] + (["bias"] if bias_dims is not None else []) + (
        ["mask"] if mask_dims is not None else []) + (["query_seq_lengths"] if q_lengths else []) + (
        ["key_value_seq_lengths"] if kv_lengths else []) + consts
    as_arg = {"query_seq_lengths": "q_lengths", "key_value_seq_lengths": "kv_lengths"}

    def mha_masked(*arrays, scale=None, is_causal=False, local_window_size=None):
        n = len(names) - len(consts)
        extra = {as_arg.get(nm, nm): a for nm, a in zip(names[3:n], arrays[3:n])}
        mod = None if score_mod is None else (score_mod, arrays[n:])
        return _mha(*arrays[:3], **extra, scale=scale, is_causal=is_causal, local_window_size=local_window_size,
                    score_mod=mod, residual=residual)

    P = inspect.Parameter
    mha_masked.__signature__ = inspect.Signature(
        [P(n, P.POSITIONAL_OR_KEYWORD) for n in names]
        + [P("scale", P.KEYWORD_ONLY, default=None), P("is_causal", P.KEYWORD_ONLY, default=False),
           P("local_window_size", P.KEYWORD_ONLY, default=None)])
    dims = {p.name: " ".join(p.dims) if grouped else " ".join(p.dims).replace("n_kv", "n") for p in mha.params}
    dims.update({n: d for n, d in (("bias", bias_dims), ("mask", mask_dims)) if d is not None})
    dims.update({n: "b" for n in as_arg if n in names})
    for i, (nm, c) in enumerate(zip(consts, score_mod.consts if score_mod is not None else [])):
        dims[nm] = " ".join(f"c{i}_{a}" for a in range(np.ndim(c)))
    tag = {"query_seq_lengths": "qlen", "key_value_seq_lengths": "kvlen"}
    suffix = "".join(f"_{tag.get(n, n)}" for n in names[3:] if n not in consts) + (
        "_score_mod" if score_mod is not None else "") + ("" if grouped else "_mh") + ("_lse" if residual else "") + (
        "_live" if residual == "live" else "")
    return Kernel(mha_masked, example=mha.example, name=f"mha{suffix}", dims=dims,
                  outputs=("out", "lse") if residual else None)


def mha_dnf(qshape, kshape, vshape, dtype, bias_shape=None, bias_dtype=None, mask_shape=None,
            scale: float | None = None, is_causal: bool = False, q_lengths: bool = False, kv_lengths: bool = False,
            local_window_size: tuple | None = None, residual: bool = False, score_mod=None, consts=()):
    """The DNF of multi-head attention in jax.nn's layout for these static shapes: the DNF of
    ``mha_kernel`` (cached by the kernel), the one ``dot_product_attention`` runs (``score_mod``:
    a ``trace.ScalarFn``, ``consts`` the arrays it closes over, or their shapes)."""
    import jax

    dtype = np.dtype(dtype)
    specs = [jax.ShapeDtypeStruct(s, dtype) for s in (qshape, kshape, vshape)]
    if bias_shape is not None:
        specs.append(jax.ShapeDtypeStruct(bias_shape, np.dtype(bias_dtype)))
    if mask_shape is not None:
        specs.append(jax.ShapeDtypeStruct(mask_shape, np.bool_))
    specs += [jax.ShapeDtypeStruct((qshape[0],), np.int32) for flag in (q_lengths, kv_lengths) if flag]
    specs += [jax.ShapeDtypeStruct(np.shape(c), c.dtype if hasattr(c, "dtype") else np.asarray(c).dtype)
              for c in consts]
    k = mha_kernel(None if bias_shape is None else broadcast_dims(bias_shape),
                   None if mask_shape is None else broadcast_dims(mask_shape), kshape[2] != qshape[2],
                   q_lengths, kv_lengths, score_mod, residual)
    return k.dnf(*specs, scale=None if scale is None else float(scale), is_causal=bool(is_causal),
                 local_window_size=local_window_size)
