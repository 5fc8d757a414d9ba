"""ONF → XLA: the CPU backend.

The grid is vectorised (every grid program at once, as batch dimensions of the tile ops)
except the grid axes the ONF's ``cpu_loop`` knob walks with an outer ``lax.map``;
sequential axes are ``lax.fori_loop``s over tiles (an output's own sequential axis an outer
``lax.map`` over its tiles); contractions are dot_generals. Stages
placed in memory are computed first, each over its whole index space. Inputs are padded
to whole tiles (pad-and-mask tails) and stored in their γ layout (column-major operands
are physically transposed once).
"""

from __future__ import annotations

import string
from typing import Callable

import numpy as np

from moajax import dnf as D
from moajax.ix import Ix, Var
from moajax.onf import ONF, ONFError, Stage
from moajax.reference import Named, align
from moajax.tiles import skipping
from moajax.tiles import stages as S
from moajax.tiles.backend import Backend, full_ranges, is_static_full
from moajax.tiles.evaluate import TileEval
from moajax.tiles.operands import prepare_inputs
from moajax.tiles.ranges import Range, broadcast_to_vars
from moajax.tiles.scope import ProgramState


# ----------------------------------------------------------------------------- backend


class XlaBackend(Backend):
    """Reads are (dynamic) slices, gathers where an index is computed; contractions einsums."""

    scalars_on_smaller_result = True
    # Σ_b Σ_t x·g as one dot_general over (b, t), never a [b, …] batch of partials then a
    # sum: a vmapped weight's gradient summed inside the kernel (``Kernel.batched``)
    joint_sums = True

    def __init__(self, onf: ONF, arrays: dict, perms: dict):
        super().__init__(onf, perms)
        self.arrays = arrays

    def window(self, ev, full) -> Named:
        return S.window_array(ev, full)

    def gather(self, array: str, at: tuple):
        return self.arrays[array][at]

    def bin_sum(self, bins, values, size: int, axis: int):
        """One scatter-add: each element added once into its bin (the rows other than
        ``axis`` index themselves; bins past the end are dropped)."""
        import jax.numpy as jnp

        kept = [d for d in range(bins.ndim) if d != axis]
        at = (bins,) + tuple(jnp.broadcast_to(jnp.reshape(jnp.arange(bins.shape[d]), [
            bins.shape[d] if u == d else 1 for u in range(bins.ndim)]), bins.shape) for d in kept)
        zeros = jnp.zeros((size,) + tuple(bins.shape[d] for d in kept) + values.shape[bins.ndim:], values.dtype)
        return zeros.at[at].add(values, mode="drop")

    def read(self, ev: TileEval, e: D.Read) -> Named:
        import jax.numpy as jnp
        from jax import lax

        arr = self.arrays[e.array]
        index = tuple(e.index[p] for p in self.perms[e.array])
        starts, sizes, kinds = [], [], []
        pads = [(0, 0)] * arr.ndim  # zeros around an axis a shifted window overhangs
        for ax, ix in enumerate(index):
            dim = arr.shape[ax]
            sv = ix.as_shifted_var()
            if ix.is_const:
                starts.append(int(np.clip(ix.const, 0, dim - 1)))
                sizes.append(1)
                kinds.append(("idx", None))
            elif sv is not None and sv[0] in ev.ranges:
                v, c = sv
                r = ev.ranges[v]
                if r.size == 1:
                    starts.append(r.start + c)
                    sizes.append(1)
                    kinds.append(("idx", None))
                elif is_static_full(r, dim, c):
                    starts.append(0)
                    sizes.append(dim)
                    kinds.append(("axis", v))
                else:
                    # v + c, c < 0 (the second part of a catenate, ⟨(n − 3) d⟩ψy): its window
                    # may start before 0 or end past the array (input padding covers c ≥ 0
                    # only, ``operands.input_padding``); there lax.dynamic_slice would fail
                    # (a window wider than the axis) or clamp its start, shifting every
                    # element of the tile, the kept ones too. Zeros pad the overhang: each
                    # in-range i reads A[i] exactly, the rest 0 (a ``where`` drops them)
                    lo, hi = self._overhang(v, r, c, dim)
                    pads[ax] = (lo, hi)
                    starts.append(r.start + c + lo)
                    sizes.append(r.size)
                    kinds.append(("axis", v))
            else:
                vs = ix.free_vars()
                if all(ev.ranges[w].size == 1 for w in vs):
                    val = ev.index_named(ix).data
                    starts.append(jnp.clip(val, 0, dim - 1))
                    sizes.append(1)
                    kinds.append(("idx", None))
                else:
                    starts.append(0)
                    sizes.append(dim)
                    kinds.append(("gather", ev.index_named(ix)))
        if any(lo or hi for lo, hi in pads):
            arr = jnp.pad(arr, pads)
        if any(not (isinstance(s, int) and s == 0 and n == d) for s, n, d in zip(starts, sizes, arr.shape)):
            arr = lax.dynamic_slice(arr, [jnp.asarray(s, jnp.int32) for s in starts], sizes)
        keep = [ax for ax, (k, _) in enumerate(kinds) if k != "idx"]
        if len(keep) != arr.ndim:
            arr = jnp.reshape(arr, [arr.shape[ax] for ax in keep])
        kinds = [kinds[ax] for ax in keep]
        vars_: list = []
        gathers = [(i, g) for i, (k, g) in enumerate(kinds) if k == "gather"]
        axis_vars = [g for k, g in kinds if k == "axis"]
        gvars = [v for _, g in gathers for v in g.vars]
        if gathers and (len(set(gvars)) != len(gvars) or set(gvars) & set(axis_vars) or len(set(axis_vars)) != len(axis_vars)):
            return self._gather_all(ev, e, arr, kinds)
        if not gathers and len(set(axis_vars)) != len(axis_vars):
            return self._gather_all(ev, e, arr, kinds)
        # one take per gathered axis (a computed index, e.g. the GQA head ⌊n/G⌋)
        pos = 0
        for k, g in kinds:
            if k == "axis":
                vars_.append(g)
                pos += 1
            else:
                idx = jnp.clip(g.data.reshape(-1), 0, arr.shape[pos] - 1)
                arr = jnp.take(arr, idx, axis=pos)
                shape = arr.shape[:pos] + tuple(g.data.shape) + arr.shape[pos + 1:]
                arr = jnp.reshape(arr, shape)
                vars_.extend(g.vars)
                pos += len(g.vars)
        return Named(arr, vars_)

    def _overhang(self, v: Var, r: Range, c: int, dim: int) -> tuple[int, int]:
        """How far the window r + c of v reaches before 0 and past ``dim``: (lo, hi) ≥ 0.
        A static start: exactly. A traced one (a tile i·tile of a loop over v's tiles, i <
        ntiles) lies in 0 … whole − size, so the window in c … whole + c − 1."""
        if isinstance(r.start, (int, np.integer)):
            first, last = int(r.start) + c, int(r.start) + c + r.size
        else:
            first, last = c, max(self.whole(v).size, r.size) + c
        return max(0, -first), max(0, last - dim)

    def _gather_all(self, ev, e, arr, kinds):
        """A general read: one broadcast index array per axis (clipped into bounds)."""
        import jax.numpy as jnp

        parts = []
        for k, g in kinds:
            if k == "axis":
                idx = ev.index_named(Ix.of(g))
                r = ev.ranges[g]
                parts.append(Named(idx.data - jnp.asarray(r.start, jnp.int32), idx.vars))
            else:
                parts.append(g)
        datas, vs = align(parts)
        full = tuple(v_.extent if v_ not in ev.ranges else ev.ranges[v_].size for v_ in vs)
        idx = tuple(jnp.clip(jnp.broadcast_to(d, full), 0, arr.shape[ax] - 1) for ax, d in enumerate(datas))
        return Named(arr[idx], vs)

    def contract(self, a: Named, b: Named, v: Var, out_dtype) -> Named:
        return self.contract_joint(a, b, (v,), out_dtype)

    def contract_joint(self, a: Named, b: Named, vs: tuple, out_dtype) -> Named:
        """Σ_{vs} a·b as one einsum: the variables both hold and do not sum are its batch."""
        import jax.numpy as jnp

        da, db = self.operands(a, b, out_dtype)
        if da.dtype == db.dtype and da.dtype.itemsize < np.dtype(out_dtype).itemsize:
            # two 16-bit operands, a wider sum: XLA CPU's dot runtime takes no mixed dtypes
            # (BF16 × BF16 = F32 fails to dispatch where no pass widens it): widened here, exactly
            da, db = da.astype(out_dtype), db.astype(out_dtype)
        allv = list(a.vars) + [x for x in b.vars if x not in a.vars]
        letters = {x: string.ascii_letters[i] for i, x in enumerate(allv)}
        rank = self.rank
        out_vars = sorted((x for x in allv if x not in vs), key=lambda x: rank.get(x.name, 1 << 20))
        spec = (
            "".join(letters[x] for x in a.vars) + "," + "".join(letters[x] for x in b.vars)
            + "->" + "".join(letters[x] for x in out_vars)
        )
        out = jnp.einsum(spec, da, db, precision=self.precision, preferred_element_type=out_dtype)
        return Named(out, out_vars)


# ----------------------------------------------------------------------------- driver


def lower(onf: ONF) -> Callable:
    """The ONF as a JAX function of the DNF's inputs, lowered to XLA loops and dot_generals."""
    onf.validate()
    dnf = onf.dnf
    defs = {n: st for st in onf.program.stages for n in st.defines}
    out_stage = dict(onf.program.outputs)

    def fn(*arrays):
        import jax.numpy as jnp

        if len(arrays) != len(dnf.inputs):
            raise TypeError(f"{dnf.name}: expected {len(dnf.inputs)} arrays, got {len(arrays)}")
        arrays = [jnp.asarray(a) for a in arrays]
        for spec, a in zip(dnf.inputs, arrays):
            if tuple(a.shape) != tuple(spec.shape):
                raise ValueError(f"{dnf.name}: input {spec.name!r} has shape {a.shape}, expected {spec.shape}")
        backend = XlaBackend(onf, *prepare_inputs(onf, arrays, canonical=True))
        values: dict = {}

        def scope(ranges):
            local = {n: st for n, st in defs.items() if n not in values}
            return TileEval(ProgramState(onf, backend, local, dict(values)), ranges)

        # stages in main memory: each over its whole index space, in program order
        for st in onf.program.stages:
            if st.place != "memory":
                continue
            ev = scope(full_ranges(backend, st.index_vars))
            S.run(ev, [x.stage for e in st.exprs() if e is not None for x in D.walk(e) if isinstance(x, D.Ref)])
            S.compute(ev, st)
            for n in st.defines:
                values[n] = S.InMemory(ev.values[n])

        # outputs walked by the same loops (and scatter-added over the same grid axis, or not)
        # are computed by one program: their tiles share every common subexpression
        groups: dict = {}
        for o in dnf.outputs:
            stage = onf.program.stage_of(out_stage[o.name])
            # walked by an outer loop over tiles: the grid axes the cpu_loop knob names, and the
            # output's own sequential axes (written tile by tile, never over all of them at once)
            loops = tuple(v for v in o.vars if (v.name in onf.knobs.cpu_loop or onf.axis_of(v).role == "sequential")
                          and onf.axis_of(v).ntiles > 1)
            groups.setdefault((loops, onf.scatter_var(stage)), []).append((o, stage, out_stage[o.name]))
        results = {}
        for plain_key, scatter_key in _one_pass_pairs(onf, groups):
            plain, scattered = groups.pop(plain_key), groups.pop(scatter_key)
            datas = _one_pass(onf, backend, scope, plain, scattered, scatter_key[1], scatter_key[0][0])
            for (o, _, _), data in zip(plain + scattered, datas):
                results[o.name] = data
        for (loops, scatter), members in groups.items():
            for (o, _, _), data in zip(members, _program_group(onf, backend, scope, members, loops, scatter)):
                results[o.name] = data
        outs = [results[o.name] for o in dnf.outputs]
        return outs[0] if len(outs) == 1 else tuple(outs)

    fn.__name__ = f"{dnf.name}_xla"
    return fn


def _program_group(onf: ONF, backend, scope, members, loops, scatter) -> list:
    """The outputs ``members`` ((output, its stage, the stage result it is)) computed together
    in each tile of ``loops``, sharing their tiles' common subexpressions. An atomically
    accumulated output: the vectorised grid holds every program's partial at once, so the
    scatter-add is the sum over the whole grid axis — or, when the cpu_loop knob walks that
    axis or its partials have masked tiles, a loop adding one tile's partial at a time (the
    masked tiles skipped)."""
    import jax.numpy as jnp

    all_vars = []
    for o, _, _ in members:
        all_vars += [v for v in o.vars if v not in all_vars]
    ranges = full_ranges(backend, tuple(all_vars) + ((scatter,) if scatter is not None else ()))
    # the scatter axis walked tile by tile where the cpu_loop knob names it
    walked = scatter is not None and scatter.name in onf.knobs.cpu_loop
    # ... and, on the per-program path, where its partials have masked tiles (a causal dQ over
    # key tiles): vectorised over the whole grid, those would be computed and masked, never
    # skipped. (``_rows_then_tiles``, taken only under the knob, walks every tile.)
    masked_walk = scatter is not None and not walked and onf.axis_of(scatter).ntiles > 1 and any(
        onf.skip_of(st.name, scatter) is not None for _, st, _ in members)

    def program(rs):
        ev = scope(rs)
        if walked or masked_walk:
            bodies = [st.accumulated for _, st, _ in members]  # partials add up in the accumulation dtype

            def add(sub, accs):
                return tuple(acc + broadcast_to_vars(sub.eval(b), tuple(o.vars), rs)
                             for acc, b, (o, _, _) in zip(accs, bodies, members))

            ev.hoist(bodies, scatter)
            init = tuple(jnp.zeros(tuple(rs[v].size for v in o.vars if rs[v].size != 1), b.dtype)
                         for b, (o, _, _) in zip(bodies, members))
            # only the tiles of the scatter axis whose partials are not all 0 over these rows
            # (a causal dQ's key tiles past its query tile): masked tiles are skipped, not
            # computed and masked — never read, so NaN there cannot reach the sums
            return skipping.walk(ev, [onf.skip_of(st.name, scatter) for _, st, _ in members], scatter, add, init)
        S.run(ev, [name for _, _, name in members])
        return tuple(broadcast_to_vars(ev.eval(D.Ref(name, o.vars, o.dtype)), tuple(o.vars), rs)
                     for o, _, name in members)

    if walked and len(loops) == 1 and _row_statistics(onf, [st.accumulated for _, st, _ in members], scatter, loops[0]):
        datas = _rows_then_tiles(onf, backend, scope, members, loops[0], scatter, ranges)
    else:
        datas = program(ranges) if not loops else _looped(onf, program, ranges, list(loops),
                                                           [o.vars for o, _, _ in members])
    out = []
    for (o, _, _), data in zip(members, datas):
        # slice the padding off, restore size-1 axes
        data = data[tuple(slice(0, v.extent) for v in o.vars if ranges[v].size != 1)]
        out.append(jnp.reshape(data, tuple(v.extent for v in o.vars)).astype(o.dtype))
    return out


def _one_pass_pairs(onf: ONF, groups: dict) -> list:
    """(plain group, scattered group) pairs one walk can compute: outputs scatter-added over
    the grid axis r the cpu_loop walks (or r in one tile), written tile by tile over their
    sequential axis v, and outputs owned per tile of r whose stages reduce over v (the fused
    backward's dK, dV and dQ)."""
    out = []
    for (loops, scatter), members in groups.items():
        if scatter is None or len(loops) != 1 or not onf.rows_walked_once(scatter):
            continue
        # r in one tile (few keys, or a cache that holds them all): the walk over r is one
        # step, and the plain outputs are not looped over it
        v, key = loops[0], ((scatter,) if onf.axis_of(scatter).ntiles > 1 else (), None)
        if key not in groups or onf.axis_of(v).role != "sequential":
            continue
        need = onf.program.reads([name for _, _, name in groups[key]])
        if any(isinstance(st, Stage) and st.reduction is not None and st.reduction.var == v
               for st in onf.program.stages if st.name in need):
            out.append((key, (loops, scatter)))
    return out


def _one_pass(onf: ONF, backend, scope, plain, scattered, r, v) -> list:
    """FlashAttention-2's backward on the CPU: per tile of r (the programs' rows), one walk of
    v's tiles computes the plain outputs' Σ_v (dQ's) and adds the scattered outputs' partials
    (dK's, dV's) into their buffers — what their bodies share (P, dP, dS) once per tile. The
    plain outputs' tiles are written per tile of r; every buffer is carried by the walk over r."""
    import jax.numpy as jnp
    from jax import lax

    ar = onf.axis_of(r)
    members = plain + scattered
    all_vars = []
    for o, _, _ in members:
        all_vars += [w for w in o.vars if w not in all_vars]
    ranges = full_ranges(backend, tuple(all_vars) + (r,))
    orders = [tuple(w for w in o.vars if ranges[w].size != 1) for o, _, _ in members]
    bodies = [st.accumulated for _, st, _ in scattered]
    root = scope({w: rg for w, rg in ranges.items() if w != v})  # v is walked, never whole
    root.hoist(bodies, r)

    def over_rows(i, bufs):
        rows = root.child({r: Range(i * ar.tile, ar.tile, r.extent)})
        rows.hoist(bodies, v)
        emits = []
        for buf, body, (_, st, _), order in zip(bufs[len(plain):], bodies, scattered, orders[len(plain):]):
            def update(tile, acc, body=body, order=order):
                rs = {**ranges, v: tile.ranges[v]}
                part = jnp.reshape(broadcast_to_vars(tile.eval(body), order, rs), [rs[w].size for w in order])
                ax, start = order.index(v), tile.ranges[v].start
                cur = lax.dynamic_slice_in_dim(acc, start, rs[v].size, ax)
                return lax.dynamic_update_slice_in_dim(acc, cur + part.astype(acc.dtype), start, ax)

            emits.append(S.Emit(update, onf.skip_of(st.name, v), buf))
        pending = {v: list(emits)}
        S.together(rows, [name for _, _, name in plain], pending)
        if pending.get(v):
            raise AssertionError(f"{onf.dnf.name}: the scattered outputs found no loop over {v.name} to join")
        S.run(rows, [name for _, _, name in plain])
        out = []
        for buf, (o, _, name), order in zip(bufs, plain, orders):
            tile = broadcast_to_vars(rows.eval(D.Ref(name, o.vars, o.dtype)), order, rows.ranges)
            tile = jnp.reshape(tile, [rows.ranges[w].size for w in order]).astype(buf.dtype)
            out.append(lax.dynamic_update_slice_in_dim(buf, tile, i * ar.tile, order.index(r)))
        return tuple(out) + tuple(em.result for em in emits)

    init = tuple(jnp.zeros(tuple(ranges[w].size for w in order), o.dtype if k < len(plain) else st.accumulated.dtype)
                 for k, ((o, st, _), order) in enumerate(zip(members, orders)))
    datas = backend.fori_loop(ar.ntiles, over_rows, init)
    out = []
    for (o, _, _), data in zip(members, datas):
        data = data[tuple(slice(0, w.extent) for w in o.vars if ranges[w].size != 1)]
        out.append(jnp.reshape(data, tuple(w.extent for w in o.vars)).astype(o.dtype))
    return out


def _row_statistics(onf: ONF, bodies, r, v) -> bool:
    """Do ``bodies`` (or the local stages they read) hold a reduction that depends on r but not
    on v — a statistic of a row tile, worth computing once per tile of r?"""
    defs = {n: st for st in onf.program.stages for n in st.defines}
    seen: set = set()
    stack = list(bodies)
    while stack:
        e = stack.pop()
        for x in D.walk(e):
            if isinstance(x, D.Red) and r in x.free and v not in x.free and v not in D.bound_vars(x):
                return True
            if isinstance(x, D.Ref) and x.stage in defs and x.stage not in seen and defs[x.stage].place == "local":
                seen.add(x.stage)
                stack.extend(y for y in defs[x.stage].exprs() if y is not None)
    return False


def _rows_then_tiles(onf: ONF, backend, scope, members, v, scatter, ranges) -> tuple:
    """Scatter-added outputs over their own sequential axis v, the cpu_loop walking the grid
    axis r they are summed over: for each tile of r (the papers' row-owning program), what does
    not depend on v is computed once, then each tile of v adds its partial into the outputs —
    the row statistics of a tile of r are never recomputed per tile of v."""
    import jax.numpy as jnp
    from jax import lax

    ar, av = onf.axis_of(scatter), onf.axis_of(v)
    bodies = [st.accumulated for _, st, _ in members]
    orders = [tuple(w for w in o.vars if ranges[w].size != 1) for o, _, _ in members]
    root = scope(ranges)
    root.hoist(bodies, scatter)

    def over_rows(i, accs):
        rows = root.child({scatter: Range(i * ar.tile, ar.tile, scatter.extent)})
        rows.hoist(bodies, v)

        def over_tiles(j, accs):
            tile = rows.child({v: Range(j * av.tile, av.tile, v.extent)})
            new = []
            for acc, b, order in zip(accs, bodies, orders):
                rs = {**ranges, v: tile.ranges[v]}
                part = jnp.reshape(broadcast_to_vars(tile.eval(b), order, rs), [rs[w].size for w in order])
                ax = order.index(v)
                cur = lax.dynamic_slice_in_dim(acc, j * av.tile, av.tile, ax)
                new.append(lax.dynamic_update_slice_in_dim(acc, cur + part.astype(acc.dtype), j * av.tile, ax))
            return tuple(new)

        return backend.fori_loop(av.ntiles, over_tiles, accs)

    init = tuple(jnp.zeros(tuple(ranges[w].size for w in order), b.dtype) for b, order in zip(bodies, orders))
    return backend.fori_loop(ar.ntiles, over_rows, init)


def _looped(onf: ONF, program, ranges: dict, loops: list, out_vars) -> tuple:
    """Walk the ``loops`` axes (cpu_loop grid axes, sequential output axes) with lax.map over
    tiles; vectorise the rest. ``program`` returns one tile per output (``out_vars``: each
    output's variables, every one containing the loop variables)."""
    import jax.numpy as jnp
    from jax import lax

    axes = [onf.axis_of(v) for v in loops]
    counts = [a.ntiles for a in axes]
    total = int(np.prod(counts))
    orders = [[v for v in vs if ranges[v].size != 1] for vs in out_vars]

    def one(k):
        rs = dict(ranges)
        rem = k
        for v, a, n in reversed(list(zip(loops, axes, counts))):
            i = rem % n
            rem = rem // n
            rs[v] = Range(i * a.tile, a.tile, v.extent)
        # a looped axis in tiles of 1 is a scalar in the program: give it back its length-1 axis
        return tuple(jnp.reshape(d, [rs[v].size for v in order]) for d, order in zip(program(rs), orders))

    stacked = lax.map(one, jnp.arange(total, dtype=jnp.int32))  # per output: [total, *tile shape]
    nl = len(loops)
    out = []
    for tiles, order in zip(stacked, orders):
        tile_shape = list(tiles.shape[1:])
        # un-flatten the tile index, then interleave (ntiles, tile) per looped axis
        tiles = tiles.reshape(counts + tile_shape)
        perm, shape = [], []
        for j, v in enumerate(order):
            if v in loops:
                li = loops.index(v)
                perm += [li, nl + j]
                shape.append(counts[li] * tile_shape[j])
            else:
                perm.append(nl + j)
                shape.append(tile_shape[j])
        out.append(jnp.transpose(tiles, perm).reshape(shape))
    return tuple(out)


__all__ = ["lower", "XlaBackend", "ONFError"]
