"""Σ_v of a product as one dot_general: the factors split into two operands.

A +-reduction whose body is a product (``dnf.product_factors``) is a contraction. Factors
over a subset of another factor's variables are folded into it (a weight vector into a
matrix) until two operands using v remain: the backend contracts them (``Backend.contract``:
an einsum on XLA, ``tl.dot`` on Triton). What cannot be split so is multiplied out and summed.
"""

from __future__ import annotations

import functools

import numpy as np

from moajax import dnf as D
from moajax.ix import Var
from moajax.reference import Named, align
from moajax.tiles.masking import mask_operands, zero_padded


def operand(ev, f: D.Expr) -> Named:
    """A contraction operand: a 16-bit value converted to float32 stays 16-bit (the dot
    accumulates in float32, so the products are identical)."""
    if isinstance(f, D.Convert) and f.dtype == np.float32 and f.arg.dtype.itemsize == 2:
        return ev.eval(f.arg)
    return ev.eval(f)


def contract_factors(ev, factors, v: Var, out_dtype) -> Named:
    """Σ_v Π factors (DNF expressions) in scope ``ev``."""
    zeros = [zero_padded(f, v) for f in factors]
    return contract(ev, [operand(ev, f) for f in factors], v, out_dtype, zeros)


def contract_joint(ev, factors, vs: tuple, out_dtype):
    """Σ_{vs} Π factors (DNF expressions) in scope ``ev`` as one contraction over every
    variable of ``vs`` (``Backend.contract_joint``), each masked past its end; None where the
    factors do not split into two operands that both hold all of ``vs``, or the backend
    declines."""
    vals = [operand(ev, f) for f in factors]
    for v in vs:
        vals = mask_operands(ev, vals, v, [zero_padded(f, v) for f in factors])
    a, b = two_operands(vals, vs[0], ev.rank)
    if b is None or not all(v in a.vars and v in b.vars for v in vs):
        return None
    return ev.backend.contract_joint(a, b, tuple(vs), out_dtype)


def contract(ev, vals: list, v: Var, out_dtype, zeros=None) -> Named:
    """Σ_v of a product of already-evaluated operands, past-the-end positions of v masked
    (``masking.mask_operands``; ``zeros[i]``: operand i is exactly 0 there already)."""
    import jax.numpy as jnp

    vals = mask_operands(ev, vals, v, zeros)
    size = ev.range_of(v).size
    if size == 1 or not any(v in x.vars for x in vals):
        datas, vs = ev.align(vals)
        prod = datas[0].astype(out_dtype)
        for d in datas[1:]:
            prod = prod * d.astype(out_dtype)
        return Named(prod * np.asarray(size, out_dtype) if size != 1 else prod, vs)
    scalars = [x for x in vals if not x.vars] if ev.backend.scalars_on_smaller_result else []
    if scalars and len(vals) - len(scalars) >= 2:
        a, b = two_operands([x for x in vals if x.vars], v, ev.rank)
        if b is not None and _result_size(a, b, v) < min(a.data.size, b.data.size):
            out = ev.backend.contract(a, b, v, out_dtype)
            c = product(scalars)
            return Named(out.data * c.data.astype(out.data.dtype), out.vars)
    a, b = two_operands(vals, v, ev.rank)
    if b is None:
        ax = a.vars.index(v)
        return Named(jnp.sum(a.data.astype(out_dtype), axis=ax), a.vars[:ax] + a.vars[ax + 1:])
    return ev.backend.contract(a, b, v, out_dtype)


def _result_size(a: Named, b: Named, v: Var) -> int:
    """The number of elements of Σ_v a·b."""
    sizes = {w: n for x in (a, b) for w, n in zip(x.vars, x.data.shape)}
    return int(np.prod([n for w, n in sizes.items() if w != v]))


def two_operands(vals: list, v: Var, rank=None):
    """Multiply factors together until two operands remain for one dot_general: (a, b), or
    (product, None) when no split into two operands both using v exists."""
    vals = list(vals)
    changed = True
    while len(vals) > 2 and changed:
        changed = False
        for i in range(len(vals)):
            for j in range(len(vals)):
                if i != j and set(vals[j].vars) <= set(vals[i].vars):
                    vals[i] = _mul(vals[i], vals[j], rank)
                    del vals[j]
                    changed = True
                    break
            if changed:
                break
    if len(vals) == 2 and v in vals[0].vars and v in vals[1].vars:
        return vals[0], vals[1]
    out = vals[0]
    for x in vals[1:]:
        out = _mul(out, x, rank)
    return out, None


def product(vals, rank=None) -> Named:
    """Π vals (aligned by variable; mixed dtypes promoted)."""
    return functools.reduce(lambda a, b: _mul(a, b, rank), vals)


def _mul(a: Named, b: Named, rank=None) -> Named:
    """a·b (aligned by variable; mixed dtypes promoted)."""
    import jax.numpy as jnp

    datas, vs = align([a, b], rank)
    d0, d1 = datas
    if d0.dtype != d1.dtype:
        dt = jnp.promote_types(d0.dtype, d1.dtype)
        d0, d1 = d0.astype(dt), d1.astype(dt)
    return Named(d0 * d1, vs)
