"""Scaled dot-product attention (paper I) and one decode step against a KV cache (paper III)."""

from __future__ import annotations

import math

from moajax import moa
from moajax.kernel import kernel
from moajax.kernels.common import accumulation_dtype, large_negative


def causal(score: moa.Array) -> moa.Array:
    """Keep s ≤ t (top-left aligned, like jnp.tril): where(ι t ≥.× ι s, score, −big)."""
    t, s = score.shape
    keep = moa.outer(moa.ge, moa.iota(t, score.dims[0]), moa.iota(s, score.dims[1]))
    return moa.where(keep, score, large_negative(score.dtype))


@kernel(example=dict(t=8, s=12, h=4, e=6))
def attention(query: "t h", key: "s h", value: "s e", *, scale: float | None = None, is_causal: bool = False):
    """Out = softmax(scale · Q +.× ⍉K) +.× V; ⍉K is a reordered read, never a buffer."""
    acc = accumulation_dtype(query.dtype)
    q, k, v = moa.cast(query, acc), moa.cast(key, acc), moa.cast(value, acc)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    score = moa.name("score", (q @ moa.transpose(k)) * scale)
    if is_causal:
        score = causal(score)
    return moa.cast(moa.softmax(score, axis=-1) @ v, query.dtype)


@kernel(example=dict(s=16, h=4, e=6))
def decode(query: "h", key: "s h", value: "s e", *, scale: float | None = None):
    """out = softmax(scale · K +.× q) +.× V: one query row against the cache."""
    acc = accumulation_dtype(query.dtype)
    q, k, v = moa.cast(query, acc), moa.cast(key, acc), moa.cast(value, acc)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    score = moa.name("score", (k @ q) * scale)
    return moa.cast(moa.softmax(score, axis=-1) @ v, query.dtype)
