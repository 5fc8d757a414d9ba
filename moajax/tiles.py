"""Evaluate ONF programs over tiles: the kernel body both backends emit.

Inside one program every index variable has a ``Range`` — a start (a Python int or a
traced scalar: program id × tile, loop counter × tile) and a static size. Expressions are
evaluated to ``Named`` arrays over exactly the variables they use (a variable whose range
has size 1 is a scalar, never an axis), so a loop-invariant subexpression is computed once,
outside the loop that does not use it (the evaluator of a loop body defers to its parent).
A +-reduction of a product is a contraction (one dot_general); a reduction over a
``sequential`` axis is a loop over its tiles carrying the monoid's accumulator; tiles past
the end of a padded axis contribute the monoid's identity (pad and mask).

Backends supply how inputs are read, how contractions run, and how loops are built.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from moajax import dnf as D
from moajax import ops as _ops
from moajax.ix import Ix, Var
from moajax.onf import ONF, OnlineStage, Stage
from moajax.reference import Named, product_factors
from moajax.reference import align as _align


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


def var_order(onf: ONF) -> dict:
    """The canonical axis order of tile arrays: batch-like grid axes (tile 1) first, then the
    tiled grid axes, then sequential, then whole ones — so a contraction's natural output
    (batch, rows, columns) needs no transpose and loop carries keep one layout."""
    out_vars = []
    for o in onf.dnf.outputs:
        out_vars += [v for v in o.vars if v not in out_vars]
    names = [v.name for v in out_vars]
    for v in sorted(onf.program.vars(), key=lambda v: v.name):
        if v.name not in names:
            names.append(v.name)

    def key(n):
        a = next((x for x in onf.axes if x.name == n), None)
        role = a.role if a is not None else "whole"
        group = {"grid": 0 if (a is not None and a.tile == 1) else 1, "sequential": 2, "whole": 3}[role]
        return (group, names.index(n))

    return {n: i for i, n in enumerate(sorted(names, key=key))}


@dataclasses.dataclass(frozen=True)
class InMemory:
    """A stage value held over more of an axis than one tile: a stage in main memory (over
    the padded extents of its variables) or a stored row (over a whole sequential axis).
    Reads take the window of the current ranges relative to ``base``."""

    value: Named
    base: dict = dataclasses.field(default_factory=dict)


def _same_range(r: Range, b: Range | None) -> bool:
    if b is None:
        return False
    if r is b:
        return True
    static = isinstance(r.start, (int, np.integer)) and isinstance(b.start, (int, np.integer))
    return static and int(r.start) == int(b.start) and r.size == b.size


class Backend:
    """What differs between XLA and Pallas: reads, contractions, loops.

    Every backend contracts in full precision (float32 dots are IEEE float32, not TF32),
    downcasts a float32 operand next to a 16-bit one only under ``knobs.lowp_dots``, lays
    tiles out in the ONF's canonical variable order, and reads operand ``a`` with its
    axes permuted by ``perms[a]`` (its physical layout: γ, or the XLA loop order)."""

    def __init__(self, onf: ONF, perms: dict):
        from jax import lax

        self.onf = onf
        self.perms = perms
        self.precision = lax.Precision.HIGHEST
        self.lowp_dots = onf.knobs.lowp_dots
        self.rank = var_order(onf)

    def read(self, ev: "TileEval", read: D.Read) -> Named:  # pragma: no cover - interface
        raise NotImplementedError

    def contract(self, a: Named, b: Named, var: Var, out_dtype) -> Named:  # pragma: no cover
        raise NotImplementedError

    def operands(self, a: Named, b: Named, out_dtype):
        """The two contraction operands in one dtype: 16-bit both when ``lowp_dots`` and one
        operand is 16-bit, else both in the accumulation dtype."""
        da, db = a.data, b.data
        if da.dtype != db.dtype:
            low = da.dtype if da.dtype.itemsize < db.dtype.itemsize else db.dtype
            if self.lowp_dots and low.itemsize == 2:
                return da.astype(low), db.astype(low)
            return da.astype(out_dtype), db.astype(out_dtype)
        return da, db

    def fori_loop(self, n, body, init):
        from jax import lax

        return lax.fori_loop(0, n, body, init)

    def window(self, ev: "TileEval", full: "InMemory") -> Named:
        return window_array(ev, full)

    def whole(self, axis) -> int:
        """The range size of a variable evaluated over all of it (every tile at once)."""
        return axis.padded if axis.role != "whole" else max(axis.tile, axis.extent)


def _np_dtype(d):
    return np.dtype(d)


def _i32(x):
    """An int32 scalar: NumPy for a static start (a literal in kernels), traced otherwise."""
    if isinstance(x, (int, np.integer)):
        return np.int32(x)
    return x.astype(np.int32) if hasattr(x, "astype") else x


def broadcast_to_vars(x: Named, vars_: tuple, ranges: dict) -> Any:
    """x's data laid out (and broadcast) over ``vars_`` (non-scalar ones), in that order."""
    import jax.numpy as jnp

    order = tuple(v for v in vars_ if ranges[v].size != 1)
    extra = [v for v in x.vars if v not in order]
    if extra:
        raise AssertionError(f"value over {x.vars} has variables {extra} outside {order}")
    present = [v for v in order if v in x.vars]
    d = x.data
    perm = [x.vars.index(v) for v in present]
    if perm != list(range(len(perm))):
        d = jnp.transpose(d, perm)
    shape = [ranges[v].size if v in x.vars else 1 for v in order]
    if d.ndim != len(shape):
        d = jnp.reshape(d, shape)
    full = tuple(ranges[v].size for v in order)
    if tuple(d.shape) != full:
        d = jnp.broadcast_to(d, full)
    return d


class TileEval:
    """Evaluates DNF/ONF expressions for one program (or one loop iteration within it)."""

    def __init__(self, onf: ONF, backend: Backend, ranges: dict, stages: dict, parent: "TileEval | None" = None,
                 loop_var: Var | None = None, stage_defs: dict | None = None):
        self.onf = onf
        self.backend = backend
        self.ranges = dict(ranges)
        self.stages = stages  # name → Named (computed stage values visible here)
        self.parent = parent
        self.loop_var = loop_var
        self.memo: dict = {}
        self.stage_defs = stage_defs if stage_defs is not None else {}
        self.rank = parent.rank if parent is not None else var_order(onf)
        if parent is None:
            # whole axes have one range everywhere: define it once, at the root, so that any
            # subexpression over them can be evaluated (and hoisted) outside every loop
            for v in onf.program.vars():
                a = onf.axis_of(v)
                if a.role == "whole" and v not in self.ranges:
                    self.ranges[v] = Range(0, backend.whole(a), v.extent)

    def align(self, parts):
        return _align(parts, self.rank)

    def canon(self, x: Named) -> Named:
        """x with its axes in the program's canonical variable order (a transpose if needed)."""
        import jax.numpy as jnp

        order = sorted(x.vars, key=lambda v: self.rank.get(v.name, 1 << 20))
        if list(order) == list(x.vars):
            return x
        return Named(jnp.transpose(x.data, [x.vars.index(v) for v in order]), order)

    def ordered(self, vars_) -> tuple:
        return tuple(sorted(vars_, key=lambda v: self.rank.get(v.name, 1 << 20)))

    # ---- contexts
    def child(self, var: Var, rng: Range) -> "TileEval":
        ranges = dict(self.ranges)
        ranges[var] = rng
        return TileEval(self.onf, self.backend, ranges, self.stages, parent=self, loop_var=var,
                        stage_defs=self.stage_defs)

    def range_of(self, v: Var) -> Range:
        r = self.ranges.get(v)
        if r is None:
            raise KeyError(f"index variable {v.name} has no range in this program")
        return r

    # ---- index values
    def index_named(self, ix: Ix) -> Named:
        """The values of an index expression over the current ranges (int32)."""
        import jax.numpy as jnp

        vs = sorted(ix.free_vars())
        axes = [v for v in vs if self.range_of(v).size != 1]
        env = {}
        for v in vs:
            r = self.range_of(v)
            if r.size == 1:
                env[v] = _i32(r.start)
            else:
                shape = [1] * len(axes)
                shape[axes.index(v)] = r.size
                env[v] = (_i32(r.start) + jnp.arange(r.size, dtype=jnp.int32)).reshape(shape)
        val = ix.evaluate(env)
        val = val.astype(jnp.int32) if hasattr(val, "astype") else np.int32(val)
        if axes:
            val = jnp.broadcast_to(val, tuple(self.range_of(v).size for v in axes))
        return Named(val, axes)

    def valid(self, v: Var) -> Named | None:
        """v < extent over v's range, when the range can run past the end (else None)."""
        import jax.numpy as jnp

        r = self.range_of(v)
        if not r.may_overrun:
            return None
        idx = self.index_named(Ix.of(v))
        return Named(idx.data < jnp.int32(r.extent), idx.vars)

    # ---- evaluation
    def lookup(self, e: D.Expr):
        """A value of e already computed here or, if e does not use this loop's variable, in an
        enclosing context (outside the loop)."""
        hit = self.memo.get(id(e))
        if hit is not None and hit[0] is e:
            return hit[1]
        if self.parent is not None and self.loop_var not in e.free:
            return self.parent.lookup(e)
        return None

    def eval(self, e: D.Expr) -> Named:
        hit = self.lookup(e)
        if hit is not None:
            return hit
        # computed (and remembered) here: a value made while tracing a loop body must never
        # be stored in an enclosing context (it would leak out of the loop's trace)
        out = self._eval(e)
        self.memo[id(e)] = (e, out)
        return out

    def hoist_invariants(self, exprs, v: Var) -> None:
        """Evaluate here, before a loop over v is traced, the largest subexpressions of
        ``exprs`` that do not use v: loop-invariant code motion."""
        done: set = set()

        def go(e):
            if id(e) in done:
                return
            done.add(id(e))
            if v not in e.free:
                if not isinstance(e, (D.Lit, D.IndexValue)) and all(x in self.ranges for x in e.free):
                    self.eval(e)
                    return
            for c in e.children:
                go(c)

        for e in exprs:
            if e is not None:
                go(e)

    def _eval(self, e):

        if isinstance(e, D.Read):
            return self.canon(self.backend.read(self, e))
        if isinstance(e, D.Lit):
            # a NumPy constant: it becomes a literal of the trace (a kernel may not capture arrays)
            return Named(np.asarray(e.value, dtype=e.dtype), ())
        if isinstance(e, D.IndexValue):
            n = self.index_named(e.ix)
            return Named(n.data.astype(e.dtype), n.vars)
        if isinstance(e, D.Tag):
            return self.eval(e.body)
        if isinstance(e, D.Convert):
            x = self.eval(e.arg)
            return Named(x.data.astype(e.dtype), x.vars)
        if isinstance(e, D.Call):
            parts = [self.eval(c) for c in e.children]
            if all(isinstance(p.data, np.ndarray) and not p.vars for p in parts):
                # constant folding in NumPy: kernels may not capture computed constants
                with np.errstate(all="ignore"):
                    val = _ops.OPS[e.op].np_fn(*[p.data for p in parts])
                return Named(np.asarray(val, dtype=e.dtype), ())
            datas, vs = self.align(parts)
            return Named(_ops.OPS[e.op].jnp_fn()(*datas), vs)
        if isinstance(e, D.Ref):
            return self.ref(e)
        if isinstance(e, D.Red):
            return self.reduce(e)
        raise TypeError(f"cannot evaluate {type(e).__name__} in a tile")

    def ref(self, e: D.Ref) -> Named:
        val = self.stages.get(e.stage)
        if isinstance(val, InMemory):
            val = self.window(val)
        if val is None:
            raise AssertionError(f"stage {e.stage!r} is read before it is computed (run_stages first)")
        src_vars = self.stage_defs[e.stage].result_vars(e.stage) if e.stage in self.stage_defs else None
        want = tuple(i.as_var() for i in e.index)
        if src_vars is not None and tuple(src_vars) != want:
            ren = dict(zip(src_vars, want))
            return Named(val.data, tuple(ren.get(v, v) for v in val.vars))
        return val

    def window(self, full: "InMemory") -> Named:
        """The current ranges' window of a stage held in main memory over its padded extents."""
        return self.backend.window(self, full)


    # ---- reductions
    def reduce(self, e: D.Red) -> Named:
        return self.reduce_over(e.monoid, e.var, e.body, e.free)

    def reduce_over(self, monoid: str, v: Var, body: D.Expr, result_free) -> Named:
        import jax.numpy as jnp

        axis = self.onf.axis_of(v)
        mono = _ops.MONOIDS[monoid]
        dtype = body.dtype
        out_vars = self.ordered(x for x in result_free if self.range_of(x).size != 1)
        if axis.role == "sequential" and axis.ntiles > 1:
            shape = tuple(self.range_of(x).size for x in out_vars)
            init = jnp.full(shape, mono.identity(dtype), dtype)
            self.hoist_invariants([body], v)

            def step(i, acc):
                start = i * axis.tile
                sub = self.child(v, Range(start, axis.tile, v.extent))
                part = sub.tile_reduce(mono, v, body)
                part_d = broadcast_to_vars(part, out_vars, self.ranges)
                return _ops.OPS[mono.op].jnp_fn()(acc, part_d)

            acc = self.backend.fori_loop(axis.ntiles, step, init)
            return Named(acc, out_vars)
        if axis.role == "grid" and v in self.ranges:
            # a stage accumulated across programs (ONF.accumulate): this program's partial
            # sum is over its own tile of v (the XLA backend's tile is the whole grid)
            return self.tile_reduce(mono, v, body)
        rng = Range(0, self.backend.whole(axis), v.extent)
        sub = self if _same_range(rng, self.ranges.get(v)) else self.child(v, rng)
        return sub.tile_reduce(mono, v, body)

    def tile_reduce(self, mono, v: Var, body: D.Expr) -> Named:
        """The monoid reduction of body over v's current range (with tail masking)."""
        import jax.numpy as jnp

        mask = self.valid(v)
        if mono.name == "add":
            factors = product_factors(body)
            if len(factors) >= 2:
                return self.contract(factors, v, body.dtype, mask)
        x = self.eval(body)
        if mask is not None:
            datas, vs = self.align([mask, x])
            x = Named(jnp.where(datas[0], datas[1], mono.identity(body.dtype)), vs)
        if v not in x.vars:
            if self.range_of(v).size == 1:
                return x
            x = Named(jnp.broadcast_to(x.data[None], (self.range_of(v).size,) + x.data.shape), (v,) + x.vars)
        ax = x.vars.index(v)
        return Named(mono.jnp_reduce(x.data, axis=ax), x.vars[:ax] + x.vars[ax + 1:])

    def contract(self, factors, v: Var, out_dtype, mask=None) -> Named:
        """Σ_v Π factors: split the factors into two operands of one dot_general."""
        zeros = [zero_padded(f, v) for f in factors]
        return self.contract_named([self.factor(f) for f in factors], v, out_dtype, zeros)

    def factor(self, f: D.Expr) -> Named:
        """A contraction operand: a 16-bit value converted to float32 stays 16-bit (the dot
        accumulates in float32, so the products are identical)."""
        if isinstance(f, D.Convert) and f.dtype == np.float32 and f.arg.dtype.itemsize == 2:
            return self.eval(f.arg)
        return self.eval(f)

    # ---- stages
    def run_stages(self, roots) -> None:
        """Compute, in program order, every local stage the names ``roots`` depend on."""
        need: set = set()
        stack = list(roots)
        while stack:
            n = stack.pop()
            if n in need or n in self.stages or n not in self.stage_defs:
                continue
            need.add(n)
            for e in self.stage_defs[n].exprs():
                if e is not None:
                    stack.extend(x.stage for x in D.walk(e) if isinstance(x, D.Ref))
        done: set = set()
        for st in self.onf.program.stages:
            if any(n in need for n in st.defines) and st.name not in done:
                self.compute_stage(st)
                done.update(st.defines)

    def compute_stage(self, st) -> None:
        """Compute a stage's value(s) in this context and record them."""
        if isinstance(st, OnlineStage):
            for name, val in self.online(st).items():
                self.stages[name] = val
            return
        self.stages[st.name] = self.stage_value(st)

    def stage_value(self, st: Stage):
        import jax.numpy as jnp

        seq = [v for v in st.vars if self.onf.axis_of(v).role == "sequential" and v not in self.ranges]
        if not seq:
            ctx = self
            for v in st.vars:
                if v not in ctx.ranges:
                    a = self.onf.axis_of(v)
                    ctx = ctx.child(v, Range(0, self.backend.whole(a), v.extent))
            val = ctx.eval(st.body)
            return val
        # a stored row over a sequential axis: fill it tile by tile
        v = seq[0]
        a = self.onf.axis_of(v)
        ranges = dict(self.ranges)
        ranges[v] = Range(0, a.padded, v.extent)  # a row over every tile of v
        for w in st.vars:
            if w not in ranges:
                aw = self.onf.axis_of(w)
                ranges[w] = Range(0, self.backend.whole(aw), w.extent)
        order = self.ordered(w for w in st.vars if ranges[w].size != 1)
        shape = tuple(ranges[w].size for w in order)
        buf = jnp.zeros(shape, st.body.dtype)
        ax = order.index(v)
        self.hoist_invariants([st.body], v)

        def step(i, buf):
            sub = self.child(v, Range(i * a.tile, a.tile, v.extent))
            for w in st.vars:
                if w not in sub.ranges:
                    sub.ranges[w] = ranges[w]
            val = broadcast_to_vars(sub.eval(st.body), order, {**ranges, v: sub.ranges[v]})
            from jax import lax

            if a.tile == 1:  # a tile of one is a scalar index: the axis comes back as length 1
                val = jnp.expand_dims(val, ax)
            return lax.dynamic_update_slice_in_dim(buf, val.astype(buf.dtype), i * a.tile, ax)

        buf = self.backend.fori_loop(a.ntiles, step, buf)
        return InMemory(Named(buf, order), {w: ranges[w] for w in order})

    def online(self, st: OnlineStage) -> dict:
        """One pass over st.var: running max m, sums rescaled by exp(m_old − m_new)."""
        import jax.numpy as jnp

        v = st.var
        axis = self.onf.axis_of(v)
        dtype = st.logit.dtype
        mvars = self.ordered(x for x in st.max_vars if self.range_of(x).size != 1)
        svars = [self.ordered(x for x in vs if self._size(x) != 1) for _, vs, _ in st.sums]
        for _, vs, _ in st.sums:
            for x in vs:
                if x not in self.ranges:
                    a = self.onf.axis_of(x)
                    self.ranges[x] = Range(0, self.backend.whole(a), x.extent)
        m0 = jnp.full(tuple(self.range_of(x).size for x in mvars), -jnp.inf, dtype)
        acc0 = tuple(jnp.zeros(tuple(self.range_of(x).size for x in sv), dtype) for sv in svars)

        def step(ctx: "TileEval", m, accs):
            f = ctx.eval(st.logit)
            mask = ctx.valid(v)
            if mask is not None:
                datas, vs = self.align([mask, f])
                f = Named(jnp.where(datas[0], datas[1], -jnp.inf), vs)
            if v in f.vars:
                ax = f.vars.index(v)
                m_tile = Named(jnp.max(f.data, axis=ax), f.vars[:ax] + f.vars[ax + 1:])
            else:
                m_tile = f
            m_tile_d = broadcast_to_vars(m_tile, mvars, self.ranges)
            m_new = jnp.maximum(m, m_tile_d)
            # a row that has seen only −∞ keeps a 0 shift (no −∞ − −∞)
            m_safe = jnp.where(m_new == -jnp.inf, np.zeros((), dtype), m_new)
            alpha = jnp.exp(m - m_safe)
            ms = Named(m_safe, mvars)
            datas, vs = self.align([f, ms])
            p = Named(jnp.exp(datas[0] - datas[1]), vs)
            new_accs = []
            for (name, svs, w), acc, sv in zip(st.sums, accs, svars):
                if w is None:
                    ax = p.vars.index(v) if v in p.vars else None
                    contrib = Named(jnp.sum(p.data, axis=ax), p.vars[:ax] + p.vars[ax + 1:]) if ax is not None else p
                else:
                    wf = product_factors(w)
                    vals = [p] + [ctx.factor(x) for x in wf]
                    # p is exactly 0 past the end of v (its logits were masked to −∞)
                    zeros = [True] + [zero_padded(x, v) for x in wf]
                    contrib = ctx.contract_named(vals, v, dtype, zeros)
                contrib_d = broadcast_to_vars(contrib, sv, self.ranges)
                alpha_d = broadcast_to_vars(Named(alpha, mvars), sv, self.ranges)
                new_accs.append(acc * alpha_d + contrib_d)
            return m_new, tuple(new_accs)

        if axis.role == "sequential" and axis.ntiles > 1:
            self.hoist_invariants(st.exprs(), v)

            def body(i, carry):
                m, accs = carry
                ctx = self.child(v, Range(i * axis.tile, axis.tile, v.extent))
                return step(ctx, m, accs)

            m, accs = self.backend.fori_loop(axis.ntiles, body, (m0, acc0))
        else:
            rng = Range(0, self.backend.whole(axis), v.extent)
            m, accs = step(self if _same_range(rng, self.ranges.get(v)) else self.child(v, rng), m0, acc0)
        out = {st.max_name: Named(m, mvars)}
        for (name, _, _), acc, sv in zip(st.sums, accs, svars):
            out[name] = Named(acc, sv)
        return out

    def _size(self, x: Var) -> int:
        r = self.ranges.get(x)
        if r is not None:
            return r.size
        return self.onf.axis_of(x).padded

    def contract_named(self, vals: list, v: Var, out_dtype, zeros=None) -> Named:
        """Σ_v of a product of already-evaluated operands (padded positions of v masked).

        ``zeros[i]``: operand i is already exactly 0 past the end of v (a read of a
        zero-padded input), so it needs no mask — and if one operand is, none does."""
        import jax.numpy as jnp

        mask = self.valid(v)
        if mask is not None and zeros is not None and any(zeros):
            # one exact-zero operand makes every padded product 0 (the others are reads of
            # zero-padded inputs or finite values: no 0·NaN)
            if all(z or v not in x.vars for z, x in zip(zeros, vals)):
                mask = None
        if mask is not None:
            # every factor that uses v is zeroed past the end (0·NaN would poison the sum)
            fixed = []
            for x in vals:
                if v in x.vars:
                    datas, vs = self.align([mask, x])
                    x = Named(jnp.where(datas[0], datas[1], np.zeros((), x.data.dtype)), vs)
                fixed.append(x)
            vals = fixed
        if self.range_of(v).size == 1 or not any(v in x.vars for x in vals):
            datas, vs = self.align(vals)
            prod = datas[0].astype(out_dtype)
            for d in datas[1:]:
                prod = prod * d.astype(out_dtype)
            n = 1 if self.range_of(v).size == 1 else self.range_of(v).size
            return Named(prod * np.asarray(n, out_dtype) if n != 1 else prod, vs)
        a, b = _two_operands(vals, v, self.rank)
        if b is None:
            ax = a.vars.index(v)
            return Named(jnp.sum(a.data.astype(out_dtype), axis=ax), a.vars[:ax] + a.vars[ax + 1:])
        return self.backend.contract(a, b, v, out_dtype)


def zero_padded(e: D.Expr, v: Var) -> bool:
    """Is e exactly 0 wherever v runs past its extent? True for a read of an input along an
    axis indexed by v (+ c): the backends pad inputs with zeros to whole tiles."""
    while isinstance(e, (D.Convert, D.Tag)):
        e = e.children[0]
    if isinstance(e, D.Read):
        return any(i.as_shifted_var() is not None and i.as_shifted_var()[0] == v and i.as_shifted_var()[1] >= 0
                   for i in e.index)
    return False


def window_array(ev: "TileEval", full: "InMemory") -> Named:
    """``TileEval.window`` for array-valued stages: dynamic slices relative to the stored base."""
    from jax import lax

    data, vars_ = full.value.data, list(full.value.vars)
    out_vars = []
    ax = 0
    for v in list(vars_):
        r = ev.ranges.get(v)
        b = full.base.get(v)
        if r is None or _same_range(r, b) or (b is None and isinstance(r.start, int) and r.start == 0 and r.size == data.shape[ax]):
            out_vars.append(v)
            ax += 1
            continue
        start = r.start if b is None else r.start - b.start
        if r.size == 1:
            data = lax.dynamic_index_in_dim(data, start, ax, keepdims=False)
            continue
        data = lax.dynamic_slice_in_dim(data, start, r.size, ax)
        out_vars.append(v)
        ax += 1
    return Named(data, out_vars)


def _two_operands(vals: list, v: Var, rank=None):
    """Multiply factors together until two operands remain for one dot_general.

    Factors whose variables are a subset of another factor's are folded into it (a weight
    vector into a matrix); what cannot be split into two operands both using v is
    multiplied out (the sum is then a plain reduction)."""
    import jax.numpy as jnp

    vals = list(vals)

    def mul(a: Named, b: Named) -> Named:
        datas, vs = _align([a, b], rank)
        d0, d1 = datas
        if d0.dtype != d1.dtype:
            dt = jnp.promote_types(d0.dtype, d1.dtype)
            d0, d1 = d0.astype(dt), d1.astype(dt)
        return Named(d0 * d1, vs)

    changed = True
    while len(vals) > 2 and changed:
        changed = False
        for i in range(len(vals)):
            for j in range(len(vals)):
                if i != j and set(vals[j].vars) <= set(vals[i].vars):
                    vals[i] = mul(vals[i], vals[j])
                    del vals[j]
                    changed = True
                    break
            if changed:
                break
    if len(vals) == 2 and v in vals[0].vars and v in vals[1].vars:
        return vals[0], vals[1]
    out = vals[0]
    for x in vals[1:]:
        out = mul(out, x)
    return out, None
