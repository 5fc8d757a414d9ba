"""Tails: a tile of a padded axis runs past the end of the axis; what stands there instead.

Inputs are padded with zeros to whole tiles (``tiles.operands``), so past the end of v a read
of an input along v is exactly 0; any other value there is garbage (NaN, in interpret mode).
A reduction over v must see its monoid's identity past the end: 0 for Σ, −∞ for ⌈ (and for
the logits of an online softmax, so that their exp is 0). ``valid`` says where v is inside
its extent, ``fill_past_end`` puts a value past it, ``zero_padded`` says which factors are
already exactly 0 there, and ``mask_operands`` masks a contraction's factors only where that
is needed.
"""

from __future__ import annotations

import numpy as np

from moajax import dnf as D
from moajax.ix import Ix, Var
from moajax.reference import Named
from moajax.tiles.ranges import index_values


def valid(ev, v: Var) -> Named | None:
    """v < extent over v's range in scope ``ev``, when the range can run past the end (else None)."""
    import jax.numpy as jnp

    r = ev.range_of(v)
    if not r.may_overrun:
        return None
    idx = index_values(ev.ranges, Ix.of(v))
    return Named(idx.data < jnp.int32(r.extent), idx.vars)


def fill_past_end(ev, x: Named, mask: Named, fill) -> Named:
    """x where ``mask`` holds, ``fill`` elsewhere (broadcast over both)."""
    import jax.numpy as jnp

    datas, vs = ev.align([mask, x])
    return Named(jnp.where(datas[0], datas[1], fill), vs)


def zero_padded(e: D.Expr, v: Var) -> bool:
    """Is e exactly 0 wherever v runs past its extent? True for a read of an input along an
    axis indexed by v (+ c, c ≥ 0): the backends pad inputs with zeros to whole tiles."""
    while isinstance(e, (D.Convert, D.Tag)):
        e = e.children[0]
    if isinstance(e, D.Read):
        return any(i.as_shifted_var() is not None and i.as_shifted_var()[0] == v and i.as_shifted_var()[1] >= 0
                   for i in e.index)
    return False


def mask_operands(ev, vals: list, v: Var, zeros=None) -> list:
    """The factors of Σ_v Π vals, each that uses v zeroed past the end of v (0·NaN would
    poison the sum) — unless every one of them is already exactly 0 there (``zeros[i]``:
    operand i is a read of a zero-padded input), when the products are 0 unmasked."""
    mask = valid(ev, v)
    if mask is None:
        return vals
    if zeros is not None and any(zeros) and all(z or v not in x.vars for z, x in zip(zeros, vals)):
        return vals
    return [fill_past_end(ev, x, mask, np.zeros((), x.data.dtype)) if v in x.vars else x for x in vals]
