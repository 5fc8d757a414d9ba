"""What differs between the XLA and the Pallas backends: reads, contractions, loops."""

from __future__ import annotations

import numpy as np

from moajax import dnf as D
from moajax.ix import Var
from moajax.onf import ONF
from moajax.reference import Named
from moajax.tiles.ranges import Range, var_order


class Backend:
    """Reads, contractions and loops, for one ONF.

    Every backend contracts in full precision (float32 dots are IEEE float32, not TF32)
    unless ``knobs.dot_precision`` is "tensorfloat32" (a GPU's float32 dots on TF32: a GPU
    ONF's default under JAX's default matmul precision, ``schedule.derive``),
    downcasts a float32 operand next to a 16-bit one only under ``knobs.lowp_dots``, lays
    tiles out in the ONF's canonical variable order, and reads operand ``a`` with its axes
    permuted by ``perms[a]`` (its physical layout: γ, or the XLA loop order). A variable
    taken whole spans ``Axis.whole_size(pow2_blocks)``: Triton's blocks are powers of two."""

    pow2_blocks = False
    stored_rows = True  # can a stage be held as a row over a sequential axis (on-chip scratch)?
    # a reduction over the tiles of a grid axis the program does not own (a split-K combine, Σ
    # over the parts): one tile per step (a GPU program holds one part's block, not all of them
    # at once) or one vectorised step (XLA)
    walks_parts = False
    # where a contraction's scalar factors go (Σ_s dS·K·c: attention's scale in dQ): False —
    # into the first operand that holds the others (a register tile on a GPU, where one more
    # live tile spills); True — onto the result where it is smaller than both operands, since
    # each elementwise pass sweeps its array through memory (XLA: c × dQ's [t h] partial is an
    # eighth of a pass over the [s t] dS). Not onto the other operand where the result is
    # larger: the first one is the hoisted one (the forward's scale stays on the Q tile, out
    # of the walk over key tiles)
    scalars_on_smaller_result = False
    # Σ_v Σ_w of a product, w held whole in the tile, as one contraction over (v, w)
    # (``contract_joint``): GQA's dK partial Σ_t Σ_g dS·Q in a program owning query tiles with
    # the group held whole is one 2-D dot on Triton over t·g rows, where Σ_g alone (t a batch
    # axis of both operands) is a multiply-and-sum of 3-D tiles, no tensor cores; on XLA one
    # dot_general over both, where Σ_g alone is a batched dot then a sum over t (a [g, …] or,
    # under a vmap's Σ_b of a shared operand, a [b, …] value, then summed)
    joint_sums = False

    def __init__(self, onf: ONF, perms: dict):
        from jax import lax

        self.onf = onf
        self.perms = perms
        # DEFAULT: TF32 for float32 operands in Pallas' Triton lowering; float32 on a CPU
        self.precision = lax.Precision.HIGHEST if onf.knobs.dot_precision == "highest" else lax.Precision.DEFAULT
        self.lowp_dots = onf.knobs.lowp_dots
        self.dot_layout = onf.knobs.dot_layout
        self.rank = var_order(onf)

    def read(self, ev, read: D.Read) -> Named:  # pragma: no cover - interface
        raise NotImplementedError

    def select(self, ev, read: D.Read, pos: int, index: Named, dtype) -> Named:
        """⟨… i …⟩ψA for every i of ``index`` (``dnf.selection``: a table read at a computed
        index), 0 where i is outside A's axis ``pos``; the other indices are constants."""
        import jax.numpy as jnp

        n = read.index[pos].as_var().extent
        i = index.data.astype(jnp.int32)
        at = []  # A's physical axes (γ: ``perms``), the computed one clipped into bounds
        for p in self.perms[read.array]:
            at.append(jnp.clip(i, 0, n - 1) if p == pos else int(read.index[p].const))
        val = self.gather(read.array, tuple(at)).astype(dtype)
        return Named(jnp.where((i >= 0) & (i < n), val, jnp.zeros((), dtype)), index.vars)

    def bin_sum(self, bins, values, size: int, axis: int):
        """out[c, k…, w…] = Σ_r ((bins[r, k…] = c) ? values[r, k…, w…] : 0) for c < ``size``,
        r the rows' axis ``axis`` (a table's gradient, ``TileEval.scatter_sum``); a bin
        outside 0 … size−1 adds nothing. Here a loop over the bins, each a masked Σ of the
        tile: no scatter into a block (Triton has none) and no [c, r, …] one-hot in registers
        — |c| selects per element, as the one-hot Σ, in one tile's room. A backend with a
        scatter-add (XLA) adds each element once instead."""
        import jax.numpy as jnp
        from jax import lax

        b = bins.reshape(bins.shape + (1,) * (values.ndim - bins.ndim))
        slab = values.shape[:axis] + values.shape[axis + 1:]
        at = lax.broadcasted_iota(jnp.int32, (size,) + slab, 0)
        zero = jnp.zeros((), values.dtype)

        def one(c, out):
            got = jnp.sum(jnp.where(b == c, values, zero), axis=axis)
            return jnp.where(at == c, got[None], out)

        # int32 bounds: the loop index meets int32 bins (Python ints are int64 under x64)
        return lax.fori_loop(jnp.int32(0), jnp.int32(size), one, jnp.zeros((size,) + slab, values.dtype))

    def gather(self, array: str, at: tuple):  # pragma: no cover - interface
        """A[at]: the input array indexed by ints and one int array (the same shape out)."""
        raise NotImplementedError

    def contract(self, a: Named, b: Named, var: Var, out_dtype) -> Named:  # pragma: no cover - interface
        raise NotImplementedError

    def contract_joint(self, a: Named, b: Named, vs: tuple, out_dtype):  # pragma: no cover - interface
        """Σ_{vs} a·b as one contraction, or None where this backend cannot (``joint_sums``)."""
        return None

    def window(self, ev, full) -> Named:  # pragma: no cover - interface
        """The current ranges' window of a stage value held in memory (``stages.InMemory``)."""
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

    def fori_loop(self, n, body, init, start=0):
        """body(i, carry) for i = start … start + n − 1 (a traced start or n: the visited span
        of a loop whose masked tiles are skipped, ``tiles.skipping``), i an int32."""
        import jax.numpy as jnp
        from jax import lax

        # an int32 counter whatever jax_enable_x64 says: lax.fori_loop over static bounds
        # scans with a Python-int (int64 under x64) counter, which Pallas' Triton lowering makes
        # the loop's induction variable, converted each step (on sm_90a the H200's float32
        # SwiGLU dZ went from 0 to 8 B of spills under x64). The same scan, its counter int32:
        if isinstance(start, (int, np.integer)) and isinstance(n, (int, np.integer)):
            def step(carry, _):
                i, c = carry
                return (i + np.int32(1), body(i, c)), None

            return lax.scan(step, (np.int32(start), init), None, length=int(n))[0][1]
        start = jnp.asarray(start, jnp.int32)
        return lax.fori_loop(start, start + jnp.asarray(n, jnp.int32), body, init)

    def whole(self, v: Var) -> Range:
        """The range of ``v`` evaluated over all of it (every tile at once)."""
        return Range(0, self.onf.axis_of(v).whole_size(self.pow2_blocks), v.extent)


def full_ranges(backend: Backend, vars_) -> dict:
    """Every variable of ``vars_`` over all of it (a program that owns the whole grid)."""
    return {v: backend.whole(v) for v in vars_}


def is_static_full(r: Range, length: int, offset: int = 0) -> bool:
    """Does r (shifted by ``offset``) statically cover 0 … length−1: the whole axis, no slice?"""
    return isinstance(r.start, (int, np.integer)) and int(r.start) + offset == 0 and r.size == length
