"""The values an index variable takes inside one program, and how tile arrays are laid out.

A ``Range`` is start … start+size−1 of one variable (its true extent beside it); a tile array
is laid out over its variables in one canonical order per ONF (``var_order``), so that a
contraction's natural output (batch, rows, columns) needs no transpose and loop carries keep
one layout.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from moajax.ix import Ix
from moajax.onf import ONF
from moajax.reference import Named


@dataclasses.dataclass(frozen=True)
class Range:
    """The values start … start+size−1 of one index variable (``extent`` is its true size)."""

    start: Any
    size: int
    extent: int

    @property
    def may_overrun(self) -> bool:
        """Can start + size exceed the extent? (then the tail must be masked)"""
        if isinstance(self.start, (int, np.integer)):
            return int(self.start) + self.size > self.extent
        return self.extent % self.size != 0 if self.size else False


def same_range(r: Range, b: Range | None) -> bool:
    """Are r and b statically the same values? (traced starts compare by identity)"""
    if b is None:
        return False
    if r is b:
        return True
    static = isinstance(r.start, (int, np.integer)) and isinstance(b.start, (int, np.integer))
    return static and int(r.start) == int(b.start) and r.size == b.size


def var_order(onf: ONF) -> dict:
    """The canonical axis order of tile arrays: ``ONF.axis_order`` (the layout is the
    schedule's: its roles and knobs)."""
    return onf.axis_order()


def _i32(x):
    """An int32 scalar: NumPy for a static start (a literal in kernels), traced otherwise."""
    if isinstance(x, (int, np.integer)):
        return np.int32(x)
    return x.astype(np.int32) if hasattr(x, "astype") else x


def index_values(ranges: Mapping, ix: Ix) -> Named:
    """The values of an index expression over the given ranges (int32); a variable whose
    range has size 1 is a scalar, every other one an axis."""
    import jax.numpy as jnp

    vs = sorted(ix.free_vars())
    for v in vs:
        if v not in ranges:
            raise KeyError(f"index variable {v.name} has no range in this program")
    axes = [v for v in vs if ranges[v].size != 1]
    env = {}
    for v in vs:
        r = ranges[v]
        if r.size == 1:
            env[v] = _i32(r.start)
        else:
            shape = [1] * len(axes)
            shape[axes.index(v)] = r.size
            env[v] = (_i32(r.start) + jnp.arange(r.size, dtype=jnp.int32)).reshape(shape)
    val = ix.evaluate(env)
    val = val.astype(jnp.int32) if hasattr(val, "astype") else np.int32(val)
    if axes:
        val = jnp.broadcast_to(val, tuple(ranges[v].size for v in axes))
    return Named(val, axes)


def broadcast_to_vars(x: Named, vars_: tuple, ranges: Mapping) -> Any:
    """x's data laid out (and broadcast) over ``vars_`` (non-scalar ones), in that order."""
    import jax.numpy as jnp

    order = tuple(v for v in vars_ if ranges[v].size != 1)
    extra = [v for v in x.vars if v not in order]
    if extra:
        raise AssertionError(f"value over {x.vars} has variables {extra} outside {order}")
    present = [v for v in order if v in x.vars]
    d = x.data
    full = tuple(ranges[v].size for v in order)
    if isinstance(d, np.ndarray) and d.ndim == 0:
        # a literal of the DNF (an output that is a constant: the tangent of a held-constant
        # value): filled from the scalar, so that a kernel's trace captures no array constant
        return jnp.full(full, d[()], d.dtype)
    perm = [x.vars.index(v) for v in present]
    if perm != list(range(len(perm))):
        d = jnp.transpose(d, perm)
    shape = [ranges[v].size if v in x.vars else 1 for v in order]
    if d.ndim != len(shape):
        d = jnp.reshape(d, shape)
    if tuple(d.shape) != full:
        d = jnp.broadcast_to(d, full)
    return d
