"""ONF → Pallas (Triton backend): the GPU lowering.

One ``pallas_call`` per kernel of the ONF: each stage placed in memory gets its own (it
writes a main-memory array), and the final programs compute the outputs. An output the ONF
accumulates atomically over a grid axis (``ONF.accumulate``) is zero-initialised and every
program ``atomic_add``s its partial sum into it (scatter-add). The grid is the
ONF's grid axes, flattened into one launch dimension (program id → tile index per axis by
div/mod, so any number of grid axes fits Triton's grid); inside a program, the kernel body
is the same tile evaluator as the XLA backend (``moajax.tiles``) with reads from the
operand refs (``pl.ds`` windows, scalar indices for tile-1 axes such as batch and head),
contractions as 2-D ``dot_general``s (``tl.dot``) and sequential axes as ``fori_loop``s.

Triton needs power-of-two block shapes: every tile that becomes an array axis must be one
(whole axes are padded to the next power of two by the ONF's pad-and-mask tail policy).
``interpret=True`` runs the very same kernels on the CPU.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from moajax import dnf as D
from moajax.onf import ONF, ONFError
from moajax.reference import Named, align
from moajax.tiles import stages as S
from moajax.tiles.backend import Backend, is_static_full
from moajax.tiles.evaluate import TileEval
from moajax.tiles.operands import input_origins, prepare_inputs
from moajax.tiles.ranges import Range, broadcast_to_vars
from moajax.tiles.scope import ProgramState
from moajax.tiles.skipping import walk


def _is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def check(onf: ONF) -> ONF:
    """Raise ONFError for anything the Triton backend cannot express; returns the ONF."""
    onf.validate()
    name = onf.dnf.name
    # the two conditions are the ONF's (``schedule`` derives GPU ONFs that meet them)
    if walking := onf.written_walking():
        stage, seq = walking[0]
        raise ONFError(
            f"{name}: {stage!r} is written while walking {list(seq)} in sequence; "
            "the Triton backend walks at most one of its own axes per program"
        )
    if rows := onf.rows_across_walks():
        stage, over = rows[0]
        raise ONFError(
            f"{name}: stage {stage!r} stores a row over the sequential axis {list(over)} on chip; "
            "Triton has no indexable on-chip scratch — recompute it (store 'recompute') or place it in "
            "memory (rewrites.place)"
        )
    for a in onf.axes:
        size = a.block
        if size != 1 and not _is_pow2(size):
            raise ONFError(
                f"{name}: axis {a.name!r} runs in tiles of {size}; the Triton backend needs power-of-two "
                "tiles (pad the axis: tile = next power of two, tail 'pad')"
            )
    for e in onf.program.exprs():
        for x in D.walk(e):
            if isinstance(x, D.Red):
                a = onf.axis_of(x.var)
                if a.role == "whole" and a.tile < x.var.extent:
                    raise ONFError(f"{name}: axis {x.var.name!r} is whole but its tile {a.tile} < extent {x.var.extent}")
    for x in _all_reads(onf):
        for ax, ix in enumerate(x.index):
            if ix.is_const or ix.as_shifted_var() is not None:
                continue
            if ix.window_var(lambda v: onf.axis_of(v).tile == 1 or v.extent == 1) is not False:
                continue
            for v in ix.free_vars():
                a = onf.axis_of(v)
                if a.tile != 1 and not (a.role == "whole" and v.extent == 1):
                    raise ONFError(
                        f"{name}: {x.array} is read at axis {ax} with the index {ix}, which varies inside a "
                        f"tile of {v.name!r}; the Triton backend reads contiguous windows only (tile {v.name!r} by 1)"
                    )
    return onf


def _all_reads(onf: ONF):
    seen = set()
    for e in onf.program.exprs():
        for x in D.walk(e):
            if isinstance(x, D.Read) and id(x) not in seen:
                seen.add(id(x))
                yield x


class PallasBackend(Backend):
    """Reads from refs with pl.ds windows; contractions as tl.dot (2-D) or multiply-sum.
    Triton has no indexable on-chip scratch: no stored rows."""

    stored_rows = False
    walks_parts = True
    joint_sums = True

    def __init__(self, onf: ONF, refs: dict, shapes: dict, perms: dict, origins: dict | None = None,
                 interpret: bool = False):
        super().__init__(onf, perms)
        self.refs = refs
        self.interpret = interpret
        self.shapes = shapes
        # per input, per physical axis, where its position 0 is stored: zeros before it for a
        # window shifted back (``operands.input_origins``), every index into it moved by as much
        origins = origins or {}
        self.origins = {n: tuple(origins.get(n, (0,) * len(p))[q] for q in p) for n, p in perms.items()}

    pow2_blocks = True
    # interpreted on a CPU, a float32 dot under TF32 (``Knobs.dot_precision``) takes its
    # operands as a tensor core does: "truncated" (the 13 low mantissa bits ignored, Triton's
    # tf32 given float32 registers; triton-lang/triton#4574) or "rounded" (to nearest);
    # None: whole, as the CPU's dot takes them (the default: a float32 test's tolerance is
    # float32's). For studies of a GPU's float32 numerics (scripts/precision_tf32_table_grad.py);
    # read when a kernel is traced: set before the first call, or forget what was traced
    # (jax.clear_caches(), runtime.lowered.cache_clear())
    interpret_tf32: str | None = None

    def _index(self, ev: TileEval, index, shape, what: str):
        import jax.numpy as jnp
        from jax.experimental import pallas as pl

        idx, vars_ = [], []
        for ax, ix in enumerate(index):
            sv = ix.as_shifted_var()
            if ix.is_const:
                idx.append(int(ix.const))
            elif sv is not None and sv[0] in ev.ranges:
                v, c = sv
                i, keeps = _window(ev.ranges[v], shape[ax], c)
                idx.append(i)
                vars_ += [v] if keeps else []
            else:
                v = ix.window_var(lambda w: w in ev.ranges and ev.ranges[w].size == 1)
                if v is None:
                    val = ev.index_named(ix)
                    idx.append(val.data.astype(jnp.int32) if hasattr(val.data, "astype") else val.data)
                elif v is False or v not in ev.ranges:
                    raise ONFError(f"{what}: index {ix} varies inside a tile (not a contiguous window)")
                else:
                    # v + (scalars): a window of v's tile starting at the index of its first element
                    env = {w: ev.ranges[w].start for w in ix.free_vars()}
                    idx.append(pl.ds(ix.evaluate(env), ev.ranges[v].size))
                    vars_.append(v)
        return tuple(idx), vars_

    def gather(self, array: str, at: tuple):
        at = tuple(i + o if o else i for i, o in zip(at, self.origins[array]))
        return self.refs[array][at]  # a Triton gather load (the table stays in global memory / L1)

    def read(self, ev: TileEval, e: D.Read) -> Named:
        ref = self.refs[e.array]
        shape = self.shapes[e.array]
        # v + c, c < 0 (the second part of a catenate, ⟨(n − 3) d⟩ψy; a take's shift): its
        # window starts before 0 and may end past the array, where a pl.ds is clamped (in
        # interpret mode: every element of the tile shifted, the kept ones too, or refused)
        # or loads out of bounds (on a GPU). The input is stored with zeros around it
        # (``operands.input_padding(before=True)``), A[i] at i + origin: each in-range i
        # reads A[i] exactly, the overhang 0 (a ``where`` drops it)
        index = tuple(e.index[p] + o if o else e.index[p] for p, o in zip(self.perms[e.array], self.origins[e.array]))
        idx, vars_ = self._index(ev, index, shape, f"{self.onf.dnf.name}: {e.array}")
        return Named(ref[idx], vars_)

    def window(self, ev: TileEval, full: S.InMemory) -> Named:
        """A stage in memory arrives as a ref over the padded extents of its variables."""
        ref = full.value.data
        idx, out = [], []
        for ax, v in enumerate(full.value.vars):
            r = ev.ranges.get(v)
            i, keeps = (slice(None), True) if r is None else _window(r, ref.shape[ax])
            idx.append(i)
            out += [v] if keeps else []
        return Named(ref[tuple(idx)], out)

    def contract(self, a: Named, b: Named, v, out_dtype) -> Named:
        import jax.numpy as jnp

        da, db = self.operands(a, b, out_dtype)
        shared = set(a.vars) & set(b.vars) - {v}
        two_d = da.ndim == 2 and db.ndim == 2 and not shared and min(da.shape + db.shape) >= 16
        if two_d:
            if self.dot_layout == "tile" and _rows_follow(b, a, v, self.rank):
                # Σ_v a·b = (Σ_v b·a) with its axes swapped (Knobs.dot_layout): b as the left
                # operand gives the result in the tile layout its consumers read, so no
                # transpose of the accumulator (a layout conversion on Triton), its rows the
                # axis the program owns (dK/dV's scores K·Qᵀ: 64 key rows, where Q·Kᵀ had the
                # 32 queries of a step and Hopper's wgmma takes 64 rows at least)
                a, b, da, db = b, a, db, da
            out = self._dot(da, db, a.vars.index(v), b.vars.index(v), out_dtype)
            out_vars = [x for x in a.vars if x != v] + [x for x in b.vars if x != v]
            return Named(out, out_vars)
        if not shared:
            # a 3-D tile (GQA's [t h g] queries with the group held whole): its free axes
            # folded into the dot's rows
            folded = self._folded_dot(a, b, da, db, (v,), out_dtype)
            if folded is not None:
                return folded
        # small or batched tiles: multiply and sum (Triton's dot needs 2-D tiles ≥ 16), each
        # operand as it is, not rounded to 16 bits (``operands``): no tensor core takes it, and
        # a float32 factor rounded per term spoils a sum whose terms cancel (bfloat16 ALiBi
        # slopes' gradient: Σ_t Σ_s of P × dP × |i − j| and of P × Δ × |i − j|, apart)
        datas, vs = align([Named(a.data.astype(out_dtype), a.vars), Named(b.data.astype(out_dtype), b.vars)],
                          self.rank)
        prod = datas[0] * datas[1]
        ax = vs.index(v)
        return Named(jnp.sum(prod, axis=ax), vs[:ax] + vs[ax + 1:])

    def _dot(self, x, y, cx: int, cy: int, out_dtype):
        """The one tl.dot of two 2-D tiles over their axes ``cx`` and ``cy``: float32 (and
        wider) operands in the ONF's precision (``Knobs.dot_precision``), 16-bit ones as they
        are, accumulated in ``out_dtype``."""
        from jax import lax

        prec = self.precision if np.dtype(x.dtype).itemsize >= 4 else None
        if self.interpret and self.interpret_tf32 and prec == lax.Precision.DEFAULT and x.dtype == np.float32:
            # a tensor core's TF32 operands, which a CPU's dot would take whole
            x, y, prec = _tf32(x, self.interpret_tf32), _tf32(y, self.interpret_tf32), lax.Precision.HIGHEST
        if self.interpret and np.dtype(x.dtype).itemsize < np.dtype(out_dtype).itemsize:
            # interpreted on a CPU, whose XLA runs no 16-bit × 16-bit → float32 dot (DotThunk's
            # "Unsupported element type"): the operands widened first, as exact (a product of
            # two 16-bit floats fits float32's 24 bits), the sums float32 as the GPU's
            x, y, prec = x.astype(out_dtype), y.astype(out_dtype), lax.Precision.HIGHEST
        return lax.dot_general(x, y, (((cx,), (cy,)), ((), ())), precision=prec, preferred_element_type=out_dtype)

    def contract_joint(self, a: Named, b: Named, vs: tuple, out_dtype):
        """Σ_{vs} a·b as one tl.dot: each operand's summed axes folded into the dot's inner
        dimension (GQA's Σ_t Σ_g dS·Q over t·g), its other axes into its rows; None where an
        axis is in both operands but not summed (a batch axis) or a side is under 16."""
        if (set(a.vars) & set(b.vars)) - set(vs):
            return None
        da, db = self.operands(a, b, out_dtype)
        return self._folded_dot(a, b, da, db, vs, out_dtype)

    def _folded_dot(self, a: Named, b: Named, da, db, vs: tuple, out_dtype):
        """Σ_{vs} a·b with no batch axis as dot(A, Bᵀ): A the tile ``da`` transposed to
        (its free axes…, vs…) and reshaped to (their product, the product of vs), B likewise;
        the result reshaped back to a's free axes then b's. None where a side is under
        Triton's 16."""
        import math

        from jax import lax

        fa, fb = [x for x in a.vars if x not in vs], [x for x in b.vars if x not in vs]
        sa = [da.shape[a.vars.index(x)] for x in fa]
        sb = [db.shape[b.vars.index(x)] for x in fb]
        k = math.prod(da.shape[a.vars.index(x)] for x in vs)
        m, n = math.prod(sa), math.prod(sb)
        if min(m, n, k) < 16:
            return None
        ta = lax.transpose(da, [a.vars.index(x) for x in fa + list(vs)]).reshape(m, k)
        tb = lax.transpose(db, [b.vars.index(x) for x in fb + list(vs)]).reshape(n, k)
        return Named(self._dot(ta, tb, 1, 1, out_dtype).reshape(tuple(sa + sb)), fa + fb)


def _tf32(x, how: str):
    """x (float32) with TF32's 10 mantissa bits: its 13 low bits cleared ("truncated") or
    rounded to nearest, ties away from zero ("rounded", PTX's cvt.rna.tf32.f32)."""
    import jax.numpy as jnp
    from jax import lax

    if how not in ("truncated", "rounded"):
        raise ValueError(f"interpret_tf32 must be None, 'truncated' or 'rounded', got {how!r}")
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    if how == "rounded":  # half of the dropped bits' unit added to the magnitude, then cut
        bits = bits + jnp.uint32(1 << 12)
    return lax.bitcast_convert_type(bits & jnp.uint32(0xFFFFE000), jnp.float32)


def _rows_follow(a: Named, b: Named, v, rank) -> bool:
    """Is Σ_v a·b of two 2-D tiles, as dot(a, b), in the canonical order (``ranges.var_order``)
    where dot(b, a) would not be? (the rows of a dot are its left operand's free axis)"""
    (i,), (j,) = [x for x in a.vars if x != v], [x for x in b.vars if x != v]
    return rank.get(i.name, 1 << 20) < rank.get(j.name, 1 << 20)


def _window(r: Range, length: int, offset: int = 0):
    """The index of range r (+ ``offset``) into an axis of ``length``, and whether it keeps
    the axis: a scalar for a tile of one, the whole axis, or a ``pl.ds`` window."""
    from jax.experimental import pallas as pl

    if r.size == 1:
        return r.start + offset, False
    if is_static_full(r, length, offset):
        return slice(None), True
    return pl.ds(r.start + offset, r.size), True


def _grid_axes(onf: ONF, vars_) -> list:
    return [v for v in vars_ if onf.axis_of(v).role == "grid"]


def _ranges_for(onf: ONF, vars_, pid) -> dict:
    """Program id → the tile of every grid axis (row-major over the grid); other axes whole."""
    ranges = {}
    grid = _grid_axes(onf, vars_)
    counts = [onf.axis_of(v).ntiles for v in grid]
    rem = pid
    idx = {}
    for v, n in reversed(list(zip(grid, counts))):
        idx[v] = rem % n
        rem = rem // n
    for v in vars_:
        a = onf.axis_of(v)
        if v in idx:
            ranges[v] = Range(idx[v] * a.tile, a.tile, v.extent)
        else:
            ranges[v] = Range(0, a.whole_size(pow2=True), v.extent)
    return ranges


def _out_index(ev: TileEval, vars_, shape, int32: bool = False) -> tuple:
    """The window of an output (of ``shape``) that a program writes: its ranges of the
    output's variables. ``int32``: every start an int32 (no bare slice, no Python int) — an
    atomic update's indices must share one integer type, and Python ints are int64 when
    float64 is on."""
    from jax.experimental import pallas as pl

    out = []
    for v, n in zip(vars_, shape):
        i, _ = _window(ev.ranges[v], n)
        if int32:
            if isinstance(i, slice):
                i = pl.ds(np.int32(0), n)
            elif isinstance(i, pl.Slice):
                i = pl.ds(_i32(i.start), i.size)
            else:
                i = _i32(i)
        out.append(i)
    return tuple(out)


def _i32(x):
    import jax.numpy as jnp

    return np.int32(x) if isinstance(x, (int, np.integer)) else jnp.asarray(x, jnp.int32)


def _padded_shape(onf: ONF, vars_) -> tuple:
    """The shape of a kernel's output (or memory stage) buffer: whole tiles of a tiled grid
    axis; a power-of-two block of any other (a later kernel may read it whole)."""
    out = []
    for v in vars_:
        a = onf.axis_of(v)
        out.append(a.padded if a.role == "grid" and a.tile > 1 else a.whole_size(pow2=True))
    return tuple(out)


def lower(onf: ONF, *, interpret: bool = False, debug: bool = False) -> Callable:
    """The ONF as a JAX function built from ``pallas_call``s (Triton backend)."""
    import jax
    from jax.experimental import pallas as pl

    from moajax import compat

    check(onf)
    dnf = onf.dnf
    origins = input_origins(onf)  # zeros before 0 where a read's window is shifted back
    defs = {n: st for st in onf.program.stages for n in st.defines}
    from jax.experimental.pallas import triton as plgpu

    params = compat.triton_compiler_params(plgpu, onf.knobs.num_warps, onf.knobs.num_stages)

    def target(name: str, vars_: tuple, dtype) -> tuple:
        """(name, vars, dtype, scatter stage or None, the grid variables its programs own)."""
        st = defs[name]
        chain = onf.scatter_vars(st)  # (a partial sums over the programs' tiles of these too)
        grid = _grid_axes(onf, tuple(vars_) + tuple(v for v in chain if v not in vars_))
        return (name, tuple(vars_), dtype, st if chain else None, tuple(grid))

    def run_kernel(arrays: dict, perms: dict, memory: dict, targets: list, label: str):
        """One pallas_call computing every target over their (shared) grid. A plain target is
        written by the program that owns its tile; a scattered one (``ONF.accumulate``) is
        zero-initialised and every program ``atomic_add``s its partial Σ over its own tile of
        the grid variable — walking a sequential axis of the target in tiles, one add each."""
        import jax.numpy as jnp

        names, mem_names = list(arrays), list(memory)
        grid_vars = list(targets[0][4])
        n_prog = int(math.prod(onf.axis_of(v).ntiles for v in grid_vars)) or 1
        # the programs' own ranges: the grid, and the whole axes of the targets they own
        # (a sequential axis of a target is walked in tiles, each tile written once)
        own_vars = grid_vars + [v for t in targets if t[3] is None for v in t[1]
                                if v not in grid_vars and onf.axis_of(v).role != "sequential"]
        out_shapes, zeros, aliases = [], [], {}
        for i, (_, tvars, dt, sst, _) in enumerate(targets):
            dt = np.dtype(dt) if sst is None else sst.accumulated.dtype
            out_shapes.append(jax.ShapeDtypeStruct(_padded_shape(onf, tvars), dt))
            if sst is not None:
                aliases[len(names) + len(mem_names) + len(zeros)] = i
                zeros.append(jnp.zeros(out_shapes[-1].shape, dt))
        shapes = {n: tuple(arrays[n].shape) for n in names}

        def kernel(*refs):
            in_refs = dict(zip(names, refs[: len(names)]))
            mem_refs = refs[len(names): len(names) + len(mem_names)]
            o_refs = refs[len(names) + len(mem_names) + len(zeros):]
            backend = PallasBackend(onf, in_refs, shapes, perms, origins, interpret)
            values = {m: S.InMemory(Named(ref, memory[m][0]), {}) for m, ref in zip(mem_names, mem_refs)}
            state = ProgramState(onf, backend, {n: st for n, st in defs.items() if n not in memory}, values)
            ev = TileEval(state, _ranges_for(onf, own_vars, pl.program_id(0)))
            writes = []
            emits: dict = {}  # v → [S.Emit]: scattered targets walked over v, written to memory
            joins: dict = {}  # id(emit) → its S.Emit
            for (tname, tvars, dt, sst, _), oref in zip(targets, o_refs):
                # a plain target is its stage's value, written; a scattered one its partial
                # sum over this program's tile of the grid variable, atomically added
                body = D.Ref(tname, tvars, dt) if sst is None else sst.accumulated

                def emit(ctx, body=body, tvars=tvars, oref=oref, add=sst is not None):
                    data = broadcast_to_vars(ctx.eval(body), tvars, ctx.ranges).astype(oref.dtype)
                    if add:
                        plgpu.atomic_add(oref, _out_index(ctx, tvars, oref.shape, int32=True), data)
                    else:
                        oref[_out_index(ctx, tvars, oref.shape)] = data

                v = onf.written_over(tvars)
                skip = onf.skip_of(tname, v) if sst is not None and v is not None else None
                writes.append((emit, tvars, v, skip, body))
                if sst is not None and v is not None:
                    ev.hoist([body], v)
                    joins[id(emit)] = S.Emit(lambda ctx, _, emit=emit: emit(ctx), skip)
                    emits.setdefault(v, []).append(joins[id(emit)])
            # sibling reductions over one walked axis share one loop (dK and dV: P once per
            # tile), and so do the scattered partials written over that axis (the fused
            # backward: dQ's Σ_s, dK's and dV's partials — P once per tile, 5 contractions)
            S.together(ev, [t[0] for t in targets if t[3] is None], emits)
            left = {id(em) for es in emits.values() for em in es}  # no shared loop took these
            for emit, tvars, v, skip, body in writes:
                if v is None:
                    emit(ev.within(tvars))  # the target's whole axes
                    continue
                if id(emit) in joins and id(joins[id(emit)]) not in left:
                    continue  # written in a shared loop
                ev.hoist([body], v)

                def step(sub, carry, emit=emit):
                    emit(sub)
                    return carry

                walk(ev, [skip], v, step, jnp.int32(0))

        call = pl.pallas_call(
            kernel,
            out_shape=out_shapes,
            grid=(n_prog,),
            input_output_aliases=aliases,
            compiler_params=params,
            interpret=interpret,
            debug=debug,
            name=f"moajax_{dnf.name}" + (f"_{label}" if label else ""),
        )
        return call(*[arrays[n] for n in names], *[memory[m][1] for m in mem_names], *zeros)

    def fn(*inputs):
        import jax.numpy as jnp

        if len(inputs) != len(dnf.inputs):
            raise TypeError(f"{dnf.name}: expected {len(dnf.inputs)} arrays, got {len(inputs)}")
        inputs = [jnp.asarray(a) for a in inputs]
        arrays, perms = prepare_inputs(onf, inputs, before=True)
        memory: dict = {}  # stage name → (vars, padded array)
        for st in onf.program.stages:
            if st.place != "memory":
                continue
            # every result of one stage shares the grid of its first result's variables
            targets = [target(n, st.result_vars(n), st.dtype(n)) for n in st.defines]
            targets = [t[:4] + (targets[0][4],) for t in targets]
            label = st.name if len(dnf.outputs) > 1 or targets[0][3] is not None else ""
            for t, arr in zip(targets, run_kernel(arrays, perms, dict(memory), targets, label)):
                memory[t[0]] = (t[1], arr)
        # the outputs: one launch per grid (the fused backward's Out, dQ, dK, dV share one)
        outs = dict(onf.program.outputs)
        groups: dict = {}
        for o in dnf.outputs:
            t = target(outs[o.name], tuple(o.vars), o.dtype)
            groups.setdefault(frozenset(t[4]), []).append((o, t))
        results = {}
        for members in groups.values():
            label = "_".join(o.name for o, _ in members) if len(groups) > 1 else ""
            arrs = run_kernel(arrays, perms, dict(memory), [t for _, t in members], label)
            for (o, _), arr in zip(members, arrs):
                results[o.name] = arr[tuple(slice(0, v.extent) for v in o.vars)].astype(o.dtype)
        res = [results[o.name] for o in dnf.outputs]
        return res[0] if len(res) == 1 else tuple(res)

    fn.__name__ = f"{dnf.name}_pallas"
    return fn
