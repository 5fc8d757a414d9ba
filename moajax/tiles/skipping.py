"""Masked tiles in a program: which tiles of a walked variable its loop visits (``ONF.skips``).

A loop over the tiles of w serves one or more stages; each stage's ``Skip`` bounds the w its
body is not the identity for, over the program's rows (its grid tile of each row variable,
the whole extent of a variable it does not own). The loop visits the union of the stages'
spans, from its first tile on: ``(first, count)``, traced where a bound reads a program id or
a runtime length. A stage without a skip makes the loop visit every tile. Every masked walk
runs through ``walk``, which also splits off the interior tiles — those the bounds keep
entirely — into a loop that evaluates no mask (``Skip.interior``).
"""

from __future__ import annotations

import functools

import numpy as np

from moajax import dnf as D
from moajax import masked
from moajax.ix import Var
from moajax.onf import RowGuard
from moajax.reference import Named
from moajax.tiles.masking import valid
from moajax.tiles.ranges import Range


def skip_for(onf, red: D.Red):
    """The skip derived for this reduction (a stage's top reduction), or None."""
    for sk in onf.skips:
        if sk.of is red and sk.var == red.var:
            return sk
    return None


def _box(ev, vars_, loop: Var, padded: bool = False) -> dict:
    """[lo, hi] of each variable over this program's rows (the loop's own: all of it);
    ``padded``: a tile's rows past the extent counted in."""
    import jax.numpy as jnp

    box = {}
    for v in vars_:
        r = ev.ranges.get(v)
        if r is None or v == loop:
            box[v] = (0, v.extent - 1)
        elif padded:
            box[v] = (r.start, r.start + r.size - 1)
        elif isinstance(r.start, int):
            box[v] = (r.start, min(r.start + r.size, v.extent) - 1)
        else:
            box[v] = (r.start, jnp.minimum(r.start + r.size, v.extent) - 1)
    return box


def _read(ev):
    """A runtime scalar's values over this program's rows (a length of its batch elements).
    Where the length's index is not bound here — a walk nested in a sum over the batch (a
    score_mod table's gradient, Σ_b Σ_t Σ_s, with query lengths), whose span the loop over b
    does not enclose — over every batch element: ``masked._extreme`` takes their max or min,
    a span that holds every element's tiles. Read in windows of a power of two (Triton's
    block sizes): [0, P) and [n − P, n), P the largest power of two ≤ n, which cover 0 … n − 1
    (the pieces, a tuple, for ``masked._extreme``)."""
    def read(r):
        free = sorted((v for v in D.mentioned_vars(r) if v not in ev.ranges), key=lambda v: v.name)
        if not free:
            return ev.eval(r).data
        windows = [{}]
        for v in free:
            p = 1 << (v.extent.bit_length() - 1)
            windows = [{**w, v: Range(a, p, v.extent)} for w in windows for a in sorted({0, v.extent - p})]
        return tuple(ev.child(w).eval(r).data for w in windows)
    return read


class _Folding:
    """jax.numpy for the spans' index arithmetic, computed in NumPy where no operand is traced
    (a bound that reads neither a program id nor a runtime length): Pallas' Triton lowering of
    a comparison of folded constants met an i1 where it expected an i32 (AssertionError ('i1',
    'i32'): the adjoint's dQ kernel of causal attention with lengths on the H200 profile, and
    of a vmapped causal gradient), so no constant-only operation reaches the kernel."""

    def __getattr__(self, name):
        import jax
        import jax.numpy as jnp

        folded, traced = getattr(np, name), getattr(jnp, name)

        def op(*args, **kw):
            leaves = jax.tree_util.tree_leaves((args, kw))
            return (traced if any(isinstance(x, jax.core.Tracer) for x in leaves) else folded)(*args, **kw)

        return op


_fold = _Folding()


def span(ev, skips, v: Var):
    """(first tile, number of tiles) of v that a loop serving stages with these ``skips``
    (None for a stage without one) visits in scope ``ev``."""
    import jax.numpy as jnp

    axis = ev.onf.axis_of(v)
    if not skips or any(sk is None for sk in skips):
        return 0, axis.ntiles
    firsts, ends = [], []
    for sk in skips:
        vars_ = {t for b in sk.bounds + sk.rows for t, _ in b.terms if isinstance(t, Var)}
        affine = sk.guard is not None and not isinstance(sk.guard, RowGuard)
        if affine:
            vars_ |= {t for c in sk.guard.conds + sk.guard.exempt for t, _ in c.terms if isinstance(t, Var)}
        box = _box(ev, vars_, v)
        read = _read(ev)
        if not any(sk.kept + sk.rows_kept):
            ok = True
        elif affine:
            ok = masked.guard_holds(sk.guard, box, read, _fold)
        else:  # the statistics read before the walk; an online pass's own max, after it (``tiles.online``)
            ok = rows_keep_keys(ev, sk.guard, v) if sk.guard.stats else True
        first, count = masked.tile_span(sk, axis.tile, axis.ntiles, box, read, _fold, ok)
        firsts.append(_fold.where(count > 0, first, axis.ntiles))
        ends.append(_fold.where(count > 0, first + count, 0))
    # pairwise (Triton has no reduction over a stack of scalars)
    first, end = functools.reduce(_fold.minimum, firsts), functools.reduce(_fold.maximum, ends)
    first = _fold.minimum(first, axis.ntiles).astype(jnp.int32)
    return first, _fold.maximum(end - first, 0).astype(jnp.int32)


def all_rows(ev, good: Named):
    """1 (int32) where ``good`` holds at every row of this scope, else 0 — a row past the end
    of one of its variables passing (a tile's padding rows: their reads are 0 and their masks
    false, no row of the problem). A min of int32: Triton's and the Triton source's reductions
    have no reduce_and, and Triton carries no i1 well."""
    import jax.numpy as jnp

    for u in good.vars:
        inside = valid(ev, u)
        if inside is not None:
            datas, vs = ev.align([good, inside])
            good = Named(jnp.logical_or(datas[0], jnp.logical_not(datas[1])), vs)
    return jnp.min(good.data.astype(jnp.int32))


# the rows of a statistic read per step of ``rows_keep_keys``: a few loads per program where
# the check runs over the walked variable (a program owning key tiles reads every query's)
ROW_CHECK_ELEMENTS = 1024


def rows_keep_keys(ev, guard: RowGuard, v: Var):
    """Does every row of this program keep a key, by its statistics (``RowGuard``): X > m₀/2
    at each row, or the row exempt? A statistic indexed by the walked v (a program owning key
    tiles, walking queries) is read over all of v, in steps of whole tiles of at most
    ``ROW_CHECK_ELEMENTS`` rows that tile v's padded extent (no read past it); a variable it
    names that this scope does not bind (a group walked one head at a time), over all of it.
    Rows past the end of an axis pass (their padded reads are 0, not a statistic)."""
    import jax.numpy as jnp

    axis = ev.onf.axis_of(v)

    def passes(sub, x):  # 1 where every row of ``sub`` passes statistic x, else 0
        val = sub.eval(x)
        good = Named(val.data > np.asarray(guard.threshold, val.data.dtype), val.vars)
        for a in guard.exempt:
            datas, vs = sub.align([good, sub.eval(a)])
            good = Named(jnp.logical_or(datas[0], jnp.logical_not(datas[1])), vs)
        return all_rows(sub, good)

    def over(sc, free, x):
        # a variable the scope does not bind, all of it: in one block, unless that block (a
        # power of two on Pallas) would read past what the input is padded to — a walked axis
        # of extent 20 in tiles of 1 is padded to 20, not 32 (GQA's table gradient under the
        # owner plan: a slice error in interpret mode, a load past the array on a GPU) —, then
        # tile by tile
        if not free:
            return passes(sc, x)
        u, rest = free[0], free[1:]
        ax = sc.onf.axis_of(u)
        if sc.backend.whole(u).size <= ax.whole_size(pow2=ax.role == "whole"):
            return over(sc.child({u: sc.backend.whole(u)}), rest, x)
        return sc.backend.fori_loop(ax.ntiles, lambda i, ok: jnp.minimum(
            ok, over(sc.child({u: Range(i * ax.tile, ax.tile, u.extent)}), rest, x)), jnp.int32(1))

    def check(sc):  # 1 where every row passes, else 0
        ok = jnp.int32(1)
        for x in guard.stats:
            ok = jnp.minimum(ok, over(sc, [u for u in sorted(x.free, key=lambda u: u.name) if u not in sc.ranges], x))
        return ok

    if v in ev.ranges or not any(v in x.free for x in guard.stats) or axis.ntiles <= 1:
        return check(ev) > 0
    per = 1  # tiles a step: a power of two that divides the number of tiles
    # (one tile a step where a statistic's index moves with v and another variable in one axis,
    # ⟨b t (g + 2·n_kv)⟩ψm with the group whole: a window only while v takes its tile's values,
    # as the walk's own reads take them)
    alone = all(ix.as_shifted_var() is not None for x in guard.stats for r in D.reads(x) for ix in r.index
                if v in ix.free_vars())
    while alone and axis.ntiles % (2 * per) == 0 and 2 * per * axis.tile <= max(ROW_CHECK_ELEMENTS, axis.tile):
        per *= 2
    size = per * axis.tile

    def step(i, ok):
        return jnp.minimum(ok, check(ev.child({v: Range(i * size, size, v.extent)})))

    return ev.backend.fori_loop(axis.ntiles // per, step, jnp.int32(1)) > 0


def walk(ev, skips, v: Var, step, init):
    """step(tile scope, carried) over the tiles of v that a loop serving stages with these
    ``skips`` visits (``span``), from ``init``; the carried value after the last.

    Where a skip asks it (``Skip.interior``), the visited span splits in three loops: the
    tiles before and after the interior evaluate the mask; the interior ones
    (``masked.interior_tiles``: every bound of those skips true at every point, the padding
    included) run in a scope that holds the bounds true (``Scope.holds``), so c ? x : y is
    traced as x. A loop without a lower (upper) bound has no head (tail) loop. (An online
    pass's skip guarded by its own running max, a ``RowGuard`` without statistics, is walked
    as if it held: ``tiles.online`` checks the max after the walk.)"""
    import jax.numpy as jnp

    axis = ev.onf.axis_of(v)
    first, count = span(ev, skips, v)

    def body(holds):
        return lambda i, carried: step(ev.child({v: Range(i * axis.tile, axis.tile, v.extent)}, holds), carried)

    inner = [sk for sk in skips or () if sk is not None and sk.interior]
    if not inner or axis.ntiles <= 1:
        return ev.backend.fori_loop(count, body(frozenset()), init, first)
    bounds = [b for sk in inner for b in sk.bounds]
    box = _box(ev, {t for b in bounds for t, _ in b.terms if isinstance(t, Var)}, v, padded=True)
    ifirst, iend = masked.interior_tiles(bounds, v, axis.tile, box, _read(ev), _fold)
    end = first + count
    a = _fold.clip(ifirst, first, end).astype(jnp.int32)
    b = _fold.clip(iend, a, end).astype(jnp.int32)
    carried = init
    if any(x.coeff(v) > 0 for x in bounds):
        carried = ev.backend.fori_loop(a - first, body(frozenset()), carried, first)
    carried = ev.backend.fori_loop(b - a, body(frozenset(bounds)), carried, a)
    if any(x.coeff(v) < 0 for x in bounds):
        carried = ev.backend.fori_loop(end - b, body(frozenset()), carried, b)
    return carried
