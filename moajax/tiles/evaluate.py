"""``TileEval``: DNF/ONF expressions evaluated over the ranges of one scope.

Every expression becomes a ``Named`` array over exactly the variables it uses, laid out in
the program's canonical order. Reads go to the backend; a ``Ref`` reads a stage value
(windowed when it is held in memory); a reduction over a sequential axis is a loop over its
tiles carrying the monoid's accumulator, over a whole axis one step, over the program's own
grid tile a partial (to be scatter-added). Σ of a product is a contraction (``contract``).
"""

from __future__ import annotations

import numpy as np

from moajax import dnf as D
from moajax import masked
from moajax import ops as _ops
from moajax.ix import Ix, Var
from moajax.reference import Named, align
from moajax.tiles import skipping
from moajax.tiles.contract import contract_factors, contract_joint, product
from moajax.tiles.masking import fill_past_end, valid
from moajax.tiles.ranges import broadcast_to_vars, index_values, same_range
from moajax.tiles.scope import Scope


def _true(x: Named) -> bool:
    """Is x the constant true (a condition a walk's interior holds, ``Scope.holds``)?"""
    return isinstance(x.data, np.ndarray) and x.data.dtype == np.bool_ and not x.vars and bool(x.data)


class TileEval(Scope):
    """Evaluates expressions in one scope of one program (``Scope``: ranges and memo)."""

    # ---- layout
    def align(self, parts):
        return align(parts, self.rank)

    def ordered(self, vars_) -> tuple:
        return tuple(sorted(vars_, key=lambda v: self.rank.get(v.name, 1 << 20)))

    def canon(self, x: Named) -> Named:
        """x with its axes in the program's canonical variable order (a transpose if needed)."""
        import jax.numpy as jnp

        order = self.ordered(x.vars)
        if list(order) == list(x.vars):
            return x
        return Named(jnp.transpose(x.data, [x.vars.index(v) for v in order]), order)

    def index_named(self, ix: Ix) -> Named:
        """The values of an index expression over this scope's ranges (int32)."""
        return index_values(self.ranges, ix)

    # ---- evaluation
    def eval(self, e: D.Expr) -> Named:
        hit = self.lookup(e)
        if hit is not None:
            return hit
        key = self._same_contraction(e)
        if key is not e:
            hit = self.lookup(key)
            if hit is not None:
                return hit
        out = self._eval(e)
        self.remember(e, out)
        if key is not e:
            self.remember(key, out)
        return out

    def _same_contraction(self, e: D.Expr) -> D.Expr:
        """One name for Σ_v of a product whatever the order of its factors: the adjoint writes
        the score as Σ_h (q × c) × k in dQ's body and Σ_h q × (k × c) in dK's — one
        contraction, computed once per tile where both are evaluated (the fused backward).
        Only the name: each is evaluated as written (the factors' grouping is a schedule
        the tile tables were calibrated for)."""
        if not (isinstance(e, D.Red) and e.monoid == "add"):
            return e
        cache = self.state.__dict__.setdefault("_contractions", {})
        hit = cache.get(id(e))
        if hit is not None and hit[0] is e:
            return hit[1]
        factors = D.product_factors(e.body)
        key = e
        if len(factors) >= 2:
            ordered = sorted(factors, key=D.show)
            if ordered != factors:
                key = D.Red("add", e.var, D.product(ordered, e.body.dtype))
        cache[id(e)] = (e, key)
        return key

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
            if self.holds and e.op in masked.COMPARISONS and masked.held(e, self.holds):
                return Named(np.asarray(True), ())  # a bound of this walk's interior (``skipping.walk``)
            parts = [self.eval(c) for c in e.children]
            if self.holds and e.op == "where" and _true(parts[0]):  # c ? x : y with c true: x
                x = parts[1]
                return x if x.data.dtype == e.dtype else Named(x.data.astype(e.dtype), x.vars)
            if self.holds and e.op == "logical_and" and any(_true(p) for p in parts):  # true ∧ c: c
                return next((p for p in parts if not _true(p)), parts[0])
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
            sel = D.selection(e)
            if sel is not None:  # a table read at a computed index: a gather, not a one-hot Σ
                read, pos, index = sel
                return self.backend.select(self, read, pos, self.eval(index), e.dtype)
            return self.reduce(e.monoid, e.var, e.body, e.free, skipping.skip_for(self.onf, e))
        raise TypeError(f"cannot evaluate {type(e).__name__} in a tile")

    def ref(self, e: D.Ref) -> Named:
        """A stage's value read at e's index (the stage's own variables, renamed); a local
        stage not computed yet is computed here, on demand (``stages.compute``)."""
        from moajax.tiles import stages
        from moajax.tiles.stages import InMemory

        defs = self.state.defs
        src_vars = defs[e.stage].result_vars(e.stage) if e.stage in defs else ()
        val = self.stage_value(e.stage, src_vars)
        if val is None:
            if e.stage not in defs:
                raise AssertionError(f"stage {e.stage!r} is neither computed nor defined in this program")
            stages.compute(self, defs[e.stage])
            val = self.values[e.stage]
        if isinstance(val, InMemory):
            val = self.backend.window(self, val)
        src_vars = src_vars or None
        want = tuple(i.as_var() for i in e.index)
        if src_vars is not None and tuple(src_vars) != want:
            ren = dict(zip(src_vars, want))
            return Named(val.data, tuple(ren.get(v, v) for v in val.vars))
        return val

    # ---- reductions
    def reduce(self, monoid: str, v: Var, body: D.Expr, result_free, skip=None) -> Named:
        """op_v body: a loop over the tiles of a sequential v (those ``skip`` leaves in), this
        program's partial over its own grid tile of v (a scatter-added stage), else one step
        over all of v."""
        import jax.numpy as jnp

        axis = self.onf.axis_of(v)
        mono = _ops.MONOIDS[monoid]
        parts = (axis.role == "grid" and axis.ntiles > 1 and v not in self.ranges and self.backend.walks_parts)
        if (axis.role == "sequential" or parts) and axis.ntiles > 1:
            out_vars = self.ordered(x for x in result_free if self.range_of(x).size != 1)
            init = jnp.full(tuple(self.range_of(x).size for x in out_vars), mono.identity(body.dtype), body.dtype)
            self.hoist([body], v)

            def step(sub, acc):
                part = sub.tile_reduce(mono, v, body)
                return _ops.OPS[mono.op].jnp_fn()(acc, broadcast_to_vars(part, out_vars, self.ranges))

            return Named(skipping.walk(self, [skip], v, step, init), out_vars)
        if axis.role == "grid" and v in self.ranges:
            if D.Red(monoid, v, body) not in self._scattered() and self._combines_parts(body, v):
                # split_k's combine op_{r₀} of partials in memory, read by a later kernel whose
                # programs own tiles of r₀ too (a split dQ's Σ_{s₀} beside its online pass'
                # ⌈_{s₀}): over every part, not this program's own (before, each program
                # normalised by its own part's max and sum: a wrong dQ, found by a fuzz). A
                # scatter-added partial's own Σ stays over its tile, whatever it reads
                return self.child({v: self.backend.whole(v)}).tile_reduce(mono, v, body)
            # a stage accumulated across programs (ONF.accumulate): this program's partial
            # sum is over its own tile of v (the XLA backend's tile is the whole grid)
            return self.tile_reduce(mono, v, body)
        rng = self.backend.whole(v)
        sub = self if same_range(rng, self.ranges.get(v)) else self.child({v: rng})
        return sub.tile_reduce(mono, v, body)

    def _scattered(self) -> frozenset:
        """The reductions whose partials programs scatter-add (``ONF.scatter_chain``): over
        their own tiles, whatever they read."""
        hit = self.state.__dict__.get("_scattered")
        if hit is None:
            hit = frozenset(r for st in self.onf.program.stages for r in self.onf.scatter_chain(st))
            self.state.__dict__["_scattered"] = hit
        return hit

    def _combines_parts(self, body: D.Expr, v: Var) -> bool:
        """Does ``body`` read, along v, a stage held in memory (the partials a split wrote)?"""
        return any(isinstance(x, D.Ref) and v in x.free and self.onf.program.stage_of(x.stage).place == "memory"
                   for x in D.walk(body))

    def reduce_together(self, reds, skips=None, v: Var | None = None, emits=()) -> list:
        """Several reductions ``(monoid, v, body, result_free)`` over one sequential v in one
        loop over its tiles, carrying every accumulator: one tile scope per step, so what
        their bodies share (the probabilities of dK's and dV's Σ_t) is computed once per tile.
        ``emits`` (``stages.Emit``): outputs written tile by tile over v in the same loop (the
        fused backward's dK and dV partials beside dQ's Σ_s: P once per tile), each carried
        (its ``result`` set after the loop) or written to memory. The loop visits the union of
        the tiles their skips leave in."""
        import jax.numpy as jnp

        v = reds[0][1] if v is None else v
        monos = [_ops.MONOIDS[m] for m, *_ in reds]
        outs = [self.ordered(x for x in free if self.range_of(x).size != 1) for *_, free in reds]
        inits = tuple(jnp.full(tuple(self.range_of(x).size for x in ov), mono.identity(body.dtype), body.dtype)
                      for (_, _, body, _), mono, ov in zip(reds, monos, outs))
        self.hoist([body for _, _, body, _ in reds], v)
        skips = list(skips) if skips is not None else [None] * len(reds)
        carried = [em for em in emits if em.init is not None]

        def step(sub, state):
            accs, ems = state
            new = tuple(_ops.OPS[mono.op].jnp_fn()(acc, broadcast_to_vars(sub.tile_reduce(mono, v, body), ov,
                                                                          self.ranges))
                        for acc, mono, ov, (_, _, body, _) in zip(accs, monos, outs, reds))
            it = iter(ems)
            ems = tuple(em.update(sub, next(it)) if em.init is not None else em.update(sub, None)
                        for em in emits)
            return new, tuple(x for x, em in zip(ems, emits) if em.init is not None)

        res, ems = skipping.walk(self, skips + [em.skip for em in emits], v, step,
                                 (inits, tuple(em.init for em in carried)))
        for em, val in zip(carried, ems):
            em.result = val
        return [Named(r, ov) for r, ov in zip(res, outs)]

    def tile_reduce(self, mono, v: Var, body: D.Expr) -> Named:
        """The monoid reduction of body over v's range in this scope (past the end: the identity)."""
        import jax.numpy as jnp

        if mono.name == "add":
            hot = D.one_hot_write(v, body)
            if hot is not None:
                return self.scatter_sum(v, *hot)
            factors = D.product_factors(body)
            terms = D.distributed(body, factors, v)
            if terms is not None:
                # Σ_v c × (a ± b) = Σ_v c × a ± Σ_v c × b: each a contraction, never the
                # [rows, v, columns] products summed (the MLP's dZ = Σ_f GH × (… × W_u + … × W_g))
                op, terms = terms
                datas, vs = self.align([self.tile_reduce(mono, v, t) for t in terms])
                return Named(_ops.OPS[op].jnp_fn()(*datas), vs)
            if len(factors) >= 2:
                joint = self._joint_sum_scaled(v, factors) if self.backend.joint_sums else None
                return joint if joint is not None else contract_factors(self, factors, v, body.dtype)
            if self.backend.joint_sums:
                joint = self._joint_sum(v, body)
                if joint is not None:
                    return joint
        x = self.eval(body)
        mask = valid(self, v)
        if mask is not None:
            x = fill_past_end(self, x, mask, mono.identity(body.dtype))
        if v not in x.vars:
            if self.range_of(v).size == 1:
                return x
            x = Named(jnp.broadcast_to(x.data[None], (self.range_of(v).size,) + x.data.shape), (v,) + x.vars)
        ax = x.vars.index(v)
        return Named(mono.jnp_reduce(x.data, axis=ax), x.vars[:ax] + x.vars[ax + 1:])

    def _joint_sum_scaled(self, v: Var, factors):
        """Σ_v (c × Σ_w e) = c × Σ_v Σ_w e, c free of v (attention's scale on dQ's Σ_s, under
        a vmap's Σ_b of a shared query): the joint sum, then c. None where no one factor is a
        sum with the others free of v, or the joint sum declines."""
        sums = [f for f in factors if isinstance(D.untagged(f), D.Red)]
        if len(sums) != 1 or any(v in f.free for f in factors if f is not sums[0]):
            return None
        joint = self._joint_sum(v, sums[0])
        if joint is None:
            return None
        return product([joint] + [self.eval(f) for f in factors if f is not sums[0]], self.rank)

    def _joint_sum(self, v: Var, body: D.Expr):
        """Σ_v Σ_w Π f as one contraction over (v, w) (``Backend.joint_sums``), where the
        inner Σ_w is a contraction of w held whole in the tile (one step, no walk, not a
        table's gather), or a sum or difference of such products (the causal dK's two dS
        terms), each its own. A skip of w's one tile (``ONF.skips``) is not taken: the body's
        own conditions mask it, and the skip could only spare a tile masked entirely (causal
        dQ of a query shared by a vmap: Σ_b Σ_s, s whole). None: evaluate Σ_w, then Σ_v."""
        inner = body
        while isinstance(inner, D.Tag):
            inner = inner.body
        if not (isinstance(inner, D.Red) and inner.monoid == "add") or D.selection(inner) is not None:
            return None
        w = inner.var
        if self.onf.axis_of(w).ntiles > 1:
            return None
        rng = self.backend.whole(w)
        sub = self if same_range(rng, self.ranges.get(w)) else self.child({w: rng})
        return sub._joint_terms(v, w, inner.body, body.dtype)

    def _joint_terms(self, v: Var, w: Var, e: D.Expr, dtype):
        while isinstance(e, D.Tag):
            e = e.body
        if isinstance(e, D.Call) and e.op in ("add", "sub"):
            parts = [self._joint_terms(v, w, c, dtype) for c in e.children]
            if any(p is None for p in parts):
                return None
            datas, vs = self.align(parts)
            return Named(_ops.OPS[e.op].jnp_fn()(*datas), vs)
        factors = D.product_factors(e)  # (a one-hot scatter, ``D.one_hot_write``, is one factor)
        if len(factors) < 2:
            return None
        return contract_joint(self, factors, (v, w), dtype)

    def scatter_sum(self, v: Var, c: Var, index: D.Expr, value: D.Expr) -> Named:
        """Σ_v ((c = i) ? X : 0) over this scope (``dnf.one_hot_write``): X, over v's range
        and the other variables, added into the bins i − start(c) of the c range
        (``Backend.bin_sum``) — never the [c, v, …] one-hot materialised. The variables i
        does not use (the heads of a table shared by them) ride along as a window: one index
        per point of i's variables, not per element. Bins outside the c range (and X past
        the end of v) add nothing."""
        import jax.numpy as jnp

        x, i = self.eval(value), self.eval(index)
        big = lambda vars_: tuple(w for w in self.ordered(vars_) if self.range_of(w).size != 1)  # noqa: E731
        rows = big(set(i.vars) | {v})  # indexed: v and i's variables
        window = big(set(x.vars) - set(rows))  # carried whole at each index
        xd = broadcast_to_vars(x, rows + window, self.ranges)
        mask = valid(self, v)
        if mask is not None and v in rows:
            past = broadcast_to_vars(mask, rows, self.ranges).reshape(xd.shape[:len(rows)] + (1,) * len(window))
            xd = jnp.where(past, xd, jnp.zeros((), xd.dtype))
        rc = self.range_of(c)
        bins = broadcast_to_vars(i, rows, self.ranges).astype(jnp.int32) - jnp.asarray(rc.start, jnp.int32)
        bins = jnp.where((bins >= 0) & (bins < rc.size), bins, rc.size)  # outside: dropped, never wrapped
        kept = tuple(w for w in rows if w != v)
        if v in rows:
            out = self.backend.bin_sum(bins, xd, rc.size, rows.index(v))
        else:  # v of one point: each element its own row
            out = self.backend.bin_sum(bins[None], xd[None], rc.size, 0)
        if rc.size == 1:  # a value has no axis for a variable of one point
            return self.canon(Named(out[0], kept + window))
        return self.canon(Named(out, (c,) + kept + window))
