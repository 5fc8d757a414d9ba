"""Default ONFs: heuristics that derive a schedule for a DNF from a machine profile.

    onf = derive(dnf, machine)                      # the default
    onf = derive(dnf, machine, carry="passes", tiles={"t": 64, "s": 32}, gamma={"key": "F"})

The program comes from the rewrites (hoist, then fuse_online for ``carry="online"``); the
lifting from the DNF's structure:

* the main reduction of each stage (keys, for attention) is ``sequential``, walked in tiles;
  the reductions nested inside a tile (the head-dim contraction) run ``whole``;
* the last output axis (the head dim of the output) is ``whole``;
* an output axis that the inputs read in the main loop do not depend on (queries: every
  query row reuses the same key/value tiles) is the ``grid`` axis with the big tile;
  other output axes (batch, heads) are ``grid`` with tile 1.

Tile sizes come from the machine: on a GPU the first candidate of a calibrated table whose
on-chip footprint fits shared memory (powers of two: Triton's block shapes) — and, where the
profile's spill check is on, that ptxas compiles without spilling; on a CPU the rows that make
a score tile of the CPU budget (``_cpu_cache_budget``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math

import numpy as np

from moajax import compat
from moajax import dnf as D
from moajax import rewrites as W
from moajax.cost import check_fits, contractions, estimate, onchip_bytes, sequence
from moajax.machines import Machine
from moajax.onf import ONF, Axis, Knobs, ONFError, Stage, initial, next_pow2


# the orders of a sequence split's blocks on a ring of devices (``moajax.ring.Ring``)
RING_BALANCES = ("zigzag", "contiguous")


@dataclasses.dataclass(frozen=True)
class Preset:
    """A partial ONF: the choices a user (or a configs/presets/*.toml file) fixes; the rest
    is derived. ``store`` maps labels to "recompute" | "onchip" | "memory"."""

    carry: str | None = None
    target: str | None = None  # "cpu" | "gpu": the machine kind it applies to (None: both)
    tiles: tuple = ()  # ((axis, tile), ...)
    roles: tuple = ()  # ((axis, role), ...)
    gamma: tuple = ()  # ((operand, "C"|"F"), ...)
    store: tuple = ()  # ((label, policy), ...)
    split: tuple = ()  # ((axis, parts), ...)
    knobs: tuple = ()  # ((knob, value), ...)
    # what a differentiated call's forward saves for its backward: "auto" (the cost model
    # decides), "save" (its row statistics and outputs), "none" (nothing: the backward reruns
    # the saving forward where that counts fewer flops, else recomputes in its own kernels),
    # "recompute" (nothing: always the latter), or a tuple of labels saved besides ("gate",:
    # paper IV's MLP keeps U); None: "auto"
    residuals: str | tuple | None = None
    # how a multi-output DNF is cut into kernels (``PLANS`` or a partition of its output names;
    # None: derived, ``derive_plan``); ``backward``: the same for this call's adjoint
    plan: object = None
    backward: object = None
    # leave out the tiles a mask provably zeroes (``rewrites.skip_masked``); None: True
    skip: bool | None = None
    # walk the tiles a mask holds on entirely without it, in a loop of their own, so that only
    # the boundary tiles evaluate it (``rewrites.unmask_interior``); None: on a CPU, not on a
    # GPU until it is timed there — offline, ptxas's register pressure moves both ways with it
    # (of the causal kernels, three tilings step down under the spill check and three up)
    unmask_interior: bool | None = None
    # walk sibling sums inside a sum once (``rewrites.fuse_sums``); None: on a CPU, not on a GPU
    fuse_sums: bool | None = None
    # the sequence split's ring order under a device mesh (``moajax.ring``): "zigzag" (every
    # step the same causal work; each kernel reorders its blocks there and back) or
    # "contiguous" (the inputs' own split, no reorder: less memory and traffic, the causal work
    # uneven); None: zigzag when causal
    ring: str | None = None
    # the rounds the ring's travelling blocks are cut into (``moajax.ring.Ring.rounds``): R
    # rounds hold 1/R of each block in flight, at R times the sends; None: 1
    ring_rounds: int | None = None

    @staticmethod
    def of(carry=None, tiles=None, roles=None, gamma=None, store=None, split=None, target=None, residuals=None,
           plan=None, backward=None, skip=None, fuse_sums=None, ring=None, ring_rounds=None,
           unmask_interior=None, **knobs) -> "Preset":
        def items(d):
            return tuple(sorted((d or {}).items()))

        if target not in (None, "cpu", "gpu"):
            raise ValueError(f"Preset: target must be None, 'cpu' or 'gpu', got {target!r}")
        for name, d in (("tiles", tiles), ("roles", roles), ("gamma", gamma), ("store", store), ("split", split)):
            if d is not None and not isinstance(d, dict):
                raise TypeError(f"Preset: {name} must be a dict (an axis or operand name → its choice), "
                                f"got {type(d).__name__}")
        unknown = sorted(set(knobs) - {f.name for f in dataclasses.fields(Knobs)})
        if unknown:
            raise TypeError(f"Preset: unknown option(s) {unknown}; the knobs are "
                            f"{sorted(f.name for f in dataclasses.fields(Knobs))}")
        if residuals is not None:
            residuals = residual_choice(residuals, "Preset")
        for name, flag in (("skip", skip), ("fuse_sums", fuse_sums), ("unmask_interior", unmask_interior)):
            if flag not in (None, True, False):
                raise TypeError(f"Preset: {name} must be a bool, got {flag!r}")
        if ring is not None and ring not in RING_BALANCES:
            raise ValueError(f"Preset: ring must be one of {RING_BALANCES}, got {ring!r}")
        if ring_rounds is not None:
            check_ring_rounds(ring_rounds, "Preset", "ring_rounds")
        return Preset(carry, target, items(tiles), items(roles), items(gamma), items(store), items(split), items(knobs),
                      residuals, _check_plan(plan, "plan"), _check_plan(backward, "backward"), skip,
                      unmask_interior, fuse_sums, ring, ring_rounds)

    def applies_to(self, machine: Machine) -> bool:
        return self.target is None or self.target == machine.kind

    @staticmethod
    def load(path) -> "Preset":
        import tomllib
        from pathlib import Path

        data = tomllib.loads(Path(path).read_text())
        data.pop("name", None)
        data.pop("description", None)
        knobs = data.pop("knobs", {})
        return Preset.of(**data, **knobs)


# how a multi-output DNF runs: "fused" (one kernel: programs own one output's rows, every output
# without that variable scatter-added, atomics on a GPU), "owner" (outputs grouped so that each
# kernel's programs own the rows of all its outputs: no atomics, each kernel recomputing what
# they share; bitwise repeatable), "per_output" (one kernel per output)
PLANS = ("fused", "owner", "per_output")


# what a differentiated call holds between its forward and its backward (``Kernel.compiled``):
# "save" its row statistics and outputs; "none" nothing, the backward recomputing them the
# cheaper way (rerunning the saving forward, or in its own kernels); "recompute" nothing, the
# backward's own kernels recomputing them (never a second forward)
RESIDUALS = ("auto", "save", "none", "recompute")


def check_ring_rounds(rounds, who: str, name: str = "rounds") -> int:
    """The ring's rounds (``moajax.ring.Ring.rounds``) as an int, or a ValueError naming ``name``:
    a positive integer, not a bool."""
    if isinstance(rounds, bool) or not isinstance(rounds, (int, np.integer)) or rounds < 1:
        raise ValueError(f"{who}: {name} must be a positive int, got {rounds!r}")
    return int(rounds)


def residual_choice(residuals, who: str):
    """A residual policy, checked: "auto", "save", "none", "recompute" (``RESIDUALS``), or a tuple of labels (``moa.name``)
    whose values the forward saves besides what "save" saves (a list is taken as a tuple)."""
    if isinstance(residuals, (tuple, list)):
        if not residuals or not all(isinstance(r, str) and r for r in residuals):
            raise ValueError(f"{who}: residuals as labels must be a non-empty tuple of label names (moa.name), "
                             f"got {residuals!r}")
        return tuple(dict.fromkeys(residuals))
    if residuals not in RESIDUALS:
        raise ValueError(f"{who}: residuals must be 'auto', 'save', 'none', 'recompute' or a tuple of labels, "
                         f"got {residuals!r}")
    return residuals


def _check_plan(plan, what: str):
    if plan == "atomic":  # the seed's name for the fused backward
        return "fused"
    if plan is None or plan in PLANS or (what == "backward" and plan == "split"):  # (attention's, ``api``)
        return plan
    if isinstance(plan, (tuple, list)) and plan and all(
            isinstance(g, (tuple, list)) and g and all(isinstance(n, str) for n in g) for g in plan):
        return tuple(tuple(g) for g in plan)
    raise ValueError(f"Preset: {what} must be None, one of {PLANS} or a partition of output names "
                     f"(a tuple of tuples of str), got {plan!r}")


def _heavy_reads(onf: ONF, loops) -> list:
    reads = []
    for st in onf.program.stages:
        for e in st.exprs():
            if e is None:
                continue
            for x in D.walk(e):
                if isinstance(x, D.Read) and x.free & set(loops):
                    reads.append(x)
    return reads


def _main_walks(onf: ONF) -> list:
    """The walked variables that are loops: a short walk beside a longer one (an adjoint's
    Δ = +/(dO × O) over the head dim, beside the walk over keys) runs whole, like a nested
    reduction, instead of making its axis a second loop of the program."""
    walked = onf.program.walked()
    longest = max((v.extent for v in walked), default=0)
    # a walk around another (GQA's Σ_g over the query heads of a kv head, around Σ_t) stays a
    # loop: held whole, it would hold every inner walk's state once per element
    around = set()
    for st in onf.program.stages:
        if st.walks is not None and st.walks.extent < longest:
            inner = {x.var for e in st.exprs() if e is not None for x in D.walk(e) if isinstance(x, D.Red)}
            if inner & (set(walked) - {st.walks}):
                around.add(st.walks)
    return [v for v in walked if v.extent > GPU_WHOLE_MAX or v.extent == longest or v in around]


def _walks(onf: ONF, place: str) -> set:
    """The variables the stages placed at ``place`` walk (``Program.walked``)."""
    return {st.walks for st in onf.program.stages if st.place == place} - {None}


def _program_outputs(onf: ONF) -> list:
    """The outputs the final program computes: not those whose stage is in main memory (a
    saved U the MLP's F reads back is written whole by a kernel of its own, before)."""
    placed = {st.name for st in onf.program.stages if st.place == "memory"}
    return [o for o in onf.dnf.outputs if dict(onf.program.outputs)[o.name] not in placed] or list(onf.dnf.outputs)


def _structure(onf: ONF, gpu: bool = False):
    """(walked loops, output variables, inner reductions, the row axis: [] or [v]).

    The row axis is the output variable (not the last) whose tile the main loop's reads
    reuse most: the queries of attention (K and V do not depend on t), the rows of a matmul
    (W does not depend on n). On a CPU only a variable no main-loop read depends on is a row
    axis (its loop tiles the cache). On a GPU a variable that some reads do depend on may be
    one too, as long as each such read stays a 2-D block (a [t s] bias or mask: rows × keys),
    so that the program's contraction is one ``tl.dot`` over a rows tile, not one row."""
    # the loops of the program that computes the outputs (a memory stage's own walk, the d of
    # a saved U = Σ_d Z × W_g, is its kernel's: inside the program it is a nested reduction)
    loops = [v for v in _main_walks(onf) if v in _walks(onf, "local")]
    out_vars = [v for o in _program_outputs(onf) for v in o.vars]
    out_vars = list(dict.fromkeys(out_vars))
    inner = set()
    for e in onf.program.exprs():
        for x in D.walk(e):
            if isinstance(x, D.Red) and x.var not in loops:
                inner.add(x.var)
    reads = _heavy_reads(onf, loops)
    if not gpu:
        if loops and set(loops) <= onf.program.batch_walks():
            # walks that are only a batch of the sums inside (a vmap's summed batch around the
            # keys, Σ_b Σ_s: dO[b t …] is read along b): the rows are those the inner sums'
            # reads share (the queries, K and V read along s)
            longest = max(v.extent for v in inner) if inner else 0
            reads = _heavy_reads(onf, [v for v in inner if v.extent == longest])
        rows = [v for v in out_vars[:-1] if reads and all(v not in r.free for r in reads) and v.extent > 1]
        return loops, out_vars, sorted(inner), rows[:1]
    blocked = set(loops) | inner | set(out_vars[-1:])  # the axes a read's block spans (tile > 1)

    def reuse(v) -> int:  # elements of the main loop's reads a tile of v shares between its rows
        return sum(int(np.prod([u.extent for u in r.free])) for r in reads if v not in r.free)

    rows = [v for v in out_vars[:-1] if reads and v.extent > 1 and reuse(v) > 0
            and all(len((r.free & blocked) | {v}) <= 2 for r in reads if v in r.free)]
    # of equal reuse, the longer: under a vmap whose keys are shared, K and V depend on neither
    # the batch nor the queries, and the batch of 2 ahead of t made the programs 1 query wide
    return loops, out_vars, sorted(inner), sorted(rows, key=lambda v: (-reuse(v), -v.extent))[:1]


# (rows, keys, num_warps, num_stages) per operand width (bytes) and held width, best first:
# the held width is the padded extent of what a program holds whole inside its contractions
# (attention's head dim, SwiGLU's d tile, a row statistic's tile of the last output axis), so
# one table serves every kernel. Chosen from sweeps compiled to PTX with ptxas (registers,
# spills, shared memory: bench/results/smem_sweep.md, gpu_report.md); where a kernel's tiling
# spills all the same (a score_mod's extra live values), the spill check steps down the table
# (``_spill_checked``). Tables, not a register model: over the 1296
# compilations of smem_sweep.md no count of register-resident words per thread separates the
# tilings ptxas spills from those it does not (bench/results/register_model.md, from
# scripts/fit_registers.py: float32 forward spilling from 88 words, spill-free up to 136).
GPU_TILES = {
    (2, 64): [(128, 64, 8, 3), (64, 64, 8, 2), (64, 32, 4, 3), (32, 32, 4, 2), (16, 16, 4, 2)],
    (2, 128): [(128, 64, 8, 2), (64, 64, 8, 2), (64, 32, 8, 2), (32, 32, 8, 2), (16, 16, 4, 2)],
    (4, 64): [(64, 32, 8, 3), (64, 16, 8, 2), (32, 16, 8, 2), (16, 16, 4, 2)],
    (4, 128): [(32, 16, 8, 2), (16, 16, 4, 2)],
    (8, 64): [(64, 32, 8, 2), (64, 16, 8, 2), (32, 16, 8, 2), (16, 16, 4, 2)],
    (8, 128): [(32, 16, 8, 2), (16, 16, 4, 2)],
}


# The same for ONFs whose programs scatter-add (the fused backward: one kernel; a row tile
# computes Out and dQ, and for each key tile its scores, dP and dS, adding into dK, dV):
# swept with ptxas on sm_80, sm_86 and sm_90a for 0 spill bytes (bench/results/gpu_report.md).
# float32 at 64 wide ends in 16 × 16 with 4 warps: through the ONF's Triton source
# (implementation="triton") sm_80 spills 40 B at 32 × 32 and 8 B at 16 × 16 with 8 warps, and
# none with 4 (ptxas of Triton 3.9; Pallas spills at none of the three). 16-bit at 64 wide
# tries 32 × 32 with 8 warps after 4: the A100's causal GQA dK/dV at S = 4096 spills at the
# first two and compiles clean there, where the next was 16 × 16 (bench/results/gqa_plans_ptx.md)
GPU_SCATTER_TILES = {
    (2, 64): [(64, 32, 8, 2), (32, 32, 4, 2), (32, 32, 8, 2), (16, 16, 8, 2)],
    (2, 128): [(64, 32, 8, 2), (32, 32, 8, 2), (16, 16, 8, 2)],
    (4, 64): [(32, 32, 8, 2), (16, 16, 8, 2), (16, 16, 4, 2)],
    (4, 128): [(16, 32, 8, 2), (16, 16, 4, 2)],
    (8, 64): [(32, 16, 8, 2), (16, 16, 8, 2), (16, 16, 8, 1)],
    (8, 128): [(16, 16, 8, 2), (16, 16, 8, 1)],
}


# The widest axis a GPU program holds whole inside a contraction (the widest head dim the
# tables above are calibrated for); a wider nested reduction is walked in tiles.
GPU_WHOLE_MAX = 128
# after the tilings at Triton's 16-row dot tiles, fewer rows a program, each held whole (for a
# kernel with dots, only where none of those fits: tried first, a matmul's 2-row programs beat
# its 128 × 128 GEMM tiles). RMSNorm's forward over d = 4096 in float32 (8192 in 16 bits) held
# 16 rows of x, 272 KB, more than any configured GPU's shared memory: no GPU ONF fitted and the
# CUDA lowering ran the CPU's XLA loops; in bfloat16 at d = 4096, 16 rows fitted and spilled
# 808 B on sm_80 (ptxas), where 8 spill none. A row a program is the classical Triton norm
# kernel (8 warps for a 4096-wide row: 16 values a thread); a dot in a tile under 16 rows is a
# multiply-and-sum (pallas_kernels.lower)
GPU_NARROW_ROWS = [(8, 16, 8, 1), (4, 16, 8, 1), (2, 16, 8, 1), (1, 16, 8, 1)]
# a row split over programs (``_gpu_tiles``' last resort for a kernel without dots): one row a
# program, the statistic's walk in tiles of 1024 (of the row's tile where narrower)
GPU_SPLIT_ROWS = [(1, 1024, 8, 1)]


def _own_floating_outputs(onf: ONF) -> list:
    """The kernel's floating outputs, less the row statistics a saving forward puts first
    (``dnf.is_saved_statistic``: float32 whatever the operands)."""
    import jax.numpy as jnp  # (NumPy's issubdtype does not count bfloat16 as floating)

    outs = [o for o in onf.dnf.outputs if jnp.issubdtype(o.dtype, jnp.floating)]
    return [o for o in outs if not D.is_saved_statistic(o.name)] or outs


def _operand_width(onf: ONF) -> int:
    """The itemsize the tile tables go by: the kernel's first own floating output's. A saving
    forward's first outputs are its float32 row statistics beside a 16-bit Out; read as 4 bytes
    they made its dots float32 FMA work, no tensor cores, on a 32 × 32 tiling: about 5.9 ms of
    bfloat16 jit(grad)'s 7.1 at S = 4096 on the H200 (inferred: the other two kernels took 1.26 ms
    alone), where the plain forward took 0.26 (bench/results/gpu_backward_sweep_h200.md)."""
    own = _own_floating_outputs(onf)
    return np.dtype(own[0].dtype).itemsize if own else 4


def _lowp_dots(onf: ONF) -> bool:
    """Contract a float32 factor with a 16-bit operand in 16 bits (``Knobs.lowp_dots``) only
    where every own output is 16-bit: a float32 output beside a 16-bit one (SwiGLU's fused
    forward + backward with a bfloat16 W_down) keeps float32 dots."""
    own = _own_floating_outputs(onf)
    return bool(own) and all(np.dtype(o.dtype).itemsize == 2 for o in own)


def _gpu_candidates(table: dict, onf: ONF, widths, machine: Machine | None = None, name: str | None = None) -> list:
    """The (rows, keys, warps, stages) candidates for this operand width and held width (the
    widest of ``widths``, padded to a power of two: the axes held whole in a contraction): the
    machine profile's own, measured on it (``Machine.gpu_tiles``, under ``name``: "tiles",
    "scatter", or "scatter_walk" for a scatter schedule walking a long sum inside a short one,
    GQA's dK and dV), then the table's."""
    item = min(_operand_width(onf), 8)
    width = max([next_pow2(w) for w in widths] or [16])
    if width > 128:
        return [(32, 16, 8, 2), (16, 16, 8, 1)]
    held = 64 if width <= 64 else 128
    name = name or ("scatter" if table is GPU_SCATTER_TILES else "tiles")
    own = machine.tilings(name, item, held) if machine else []
    return own + [c for c in table[(item, held)] if c not in own]


def _liftings(onf: ONF, cands, lift):
    """Each candidate's lifting (``lift(rows, keys)``) with its warps and stages, in the
    table's order (lazily: a lifting is built only when asked for)."""
    lowp = _lowp_dots(onf)
    for bt, bs, warps, stages in cands:
        yield W.with_knobs(lift(bt, bs), num_warps=warps, num_stages=stages, lowp_dots=lowp)


def _ranked(liftings, machine: Machine, rank: int = 0) -> ONF:
    """The first of ``liftings`` that fits the machine's shared memory by the cost model's
    upper bound (``cost.onchip_bytes``, calibrated against ptxas in bench/results/smem_sweep.md),
    else the last, for validate to name. ``rank`` k > 0: the (k+1)-th that fits, or the last
    that fits where fewer do (the spill check's next try)."""
    fitting = o = None
    for o in liftings:
        if onchip_bytes(o) <= machine.onchip_limit_bytes:
            fitting = o
            if rank == 0:
                return o
            rank -= 1
    return fitting or o


def _first_fit(onf: ONF, machine: Machine, cands, lift, rank: int = 0) -> ONF:
    """``_ranked`` over one table's candidates for one lifting (``_liftings``)."""
    return _ranked(_liftings(onf, cands, lift), machine, rank)


def _gathered(onf: ONF) -> set:
    """The variables a read indexes by more than a contiguous window (⌊n/G⌋ for GQA, a
    reshape's div/mod): Triton reads windows only, so their tiles must be 1. Of each such
    index, one variable it reads a window of (the longest) may stay tiled."""
    out = set()
    for e in onf.program.exprs():
        for x in D.walk(e):
            if not isinstance(x, D.Read):
                continue
            for ix in x.index:
                if ix.is_const or ix.as_shifted_var() is not None:
                    continue
                vs = sorted(ix.free_vars(), key=lambda v: (-v.extent, v.name))
                keep = next((w for w in vs if ix.window_var(lambda u, w=w: u != w) == w), None)
                out |= {v.name for v in vs if v != keep}
    return out


def _one_by_one(onf: ONF, axes) -> list:
    """GPU liftings with every gathered variable (``_gathered``) in tiles of 1: a grid axis
    where no stage reduces over it, else a sequential loop."""
    gathered = _gathered(onf)
    reduced = {v.name for v in onf.program.walked()}
    reduced |= {x.var.name for e in onf.program.exprs() for x in D.walk(e) if isinstance(x, D.Red)}
    return [Axis(a.name, a.extent, 1, "sequential" if a.name in reduced else "grid", a.tail)
            if a.name in gathered and a.tile != 1 else a for a in axes]


def _cpu_rows(machine: Machine, rows_ext: int, other: int, bs: int = 256) -> int:
    # CPU (XLA): the grid is vectorised except the row axis, which an outer loop walks in
    # tiles; the score tile (every batch-like program × rows × keys, float32) is made as
    # large as the budget (``_cpu_cache_budget``) allows, so that each step's dots and
    # softmax passes are large, but no larger: the whole sequence's rows at once lose.
    budget = _cpu_cache_budget(machine)
    bt = next_pow2(rows_ext)
    while bt > 128 and other * bt * bs * 4 > budget:
        bt //= 2
    return min(bt, rows_ext)


def _gpu_tiles(onf: ONF, machine: Machine, loops, out_vars, inner, rows, rank: int = 0):
    """The first lifting that fits, trying in order: the last output axis whole and every
    nested reduction whole; then the last output axis tiled over the grid (a row statistic
    over many rows, a wide matmul output), widest tile first; then, as well, each nested
    reduction walked in tiles (SwiGLU's Z·W_g inside its Σ_f: a loop inside the loop).
    ``rank`` k > 0 (the spill check's next try): the (k+1)-th that fits in that one order, so
    that the tries go on to the next structure once a structure's tilings are spent (the
    H200's float32 SwiGLU dZ at n = 4096: its 1024 columns held whole fit at 16 × 16 only,
    which spilled; the next try is the A100's 32 × 128 output tiles)."""
    def attempt(onf, loops, out_vars, inner, rows, nested, lt, it):
        # two wide walks one inside the other (a table's gradient: Σ_s Σ_t over [s × t]
        # scores) hold a tile of each, not their extents: the candidates are those for that
        # width, and the tiles at most the candidates' keys wide, as attention's [rows × keys]
        # (in the IEEE-float32 sweep of 2026-12-04 every 64 × 64 tiling of the table gradient
        # spilled, 32 × 32 none; with TF32 dots the sweep of 2026-12-05 has 64 × 32 clean and
        # some 32 × 32 with 4 warps spilling, untimed: bench/results/score_mod_tiles_gpu.md,
        # which the spill check covers either way). Other walks keep the candidates of their
        # extent, as they were calibrated (GQA's dK and dV, spill-free in gpu_report.md)
        held = [min(v.extent, it) if it and v in nested else v.extent for v in inner]
        # a last output axis tiled over the grid is held lt at a time: RMSNorm→matmul's 128
        # columns of f, not its 4096 (by the extent, the fallback for widths over 128 gave
        # 32 × 128 tiles and a 16-wide walk, and 32-row dots that sm_90a's wgmma does not take)
        held += [min(v.extent, lt) if lt else v.extent for v in out_vars[-1:]]
        cands = _gpu_candidates(GPU_TILES, onf, held, machine)
        return _liftings(onf, cands, lambda bt, bs: _apply_tiles(
            onf, loops, out_vars, inner, rows, bt, bs, gpu=True, last_tile=lt, inner_tile=it,
            nested={v: min(it, bs) for v in nested} if it else None))

    # a nested reduction wider than the widest calibrated head dim is walked from the start:
    # held whole it fits shared memory yet spills registers (SwiGLU's Σ_d, d = 1024, on sm_90a:
    # 8800 B of spill stores under ptxas with 16 × 128 output tiles)
    def wide_walks(inner):
        return [v for v in inner if next_pow2(v.extent) > GPU_WHOLE_MAX]

    def structures(onf, loops, out_vars, inner, rows):
        wide = bool(wide_walks(inner))
        nested = _nested_walks(onf, wide_walks(inner))
        if not wide:
            yield from attempt(onf, loops, out_vars, inner, rows, nested, 0, 0)
        last = out_vars[-1] if out_vars else None
        lts = [0]
        # programs owning column tiles of a row that a walk of theirs reads whole (RMSNorm's dX
        # beside its Σ_d1 dO·w·x) would each walk the row again: 32 times at d = 4096 in
        # tiles of 128, through L2, which the cost model does not charge. The rows are held
        # whole then (fewer a program: ``narrow``), as where the walk is the output's own
        # variable, and split over programs only where one row does not fit (``split_rows``)
        rewalked = last is not None and not _holds_dots(onf) and _rewalks_row(onf, last, [*loops, *inner])
        if last is not None and last not in loops and last.extent > 16 and not rewalked:
            # a reduction inside that shadows the last variable (SwiGLU's Σ_d of Z·W_g under
            # the output's d) walks an axis of its own once the programs own tiles of d
            named = W.separate_walks(onf, [last.name])
            if named is not onf:
                onf = named
                loops, out_vars, inner, rows = _structure(onf, gpu=True)
                nested = _nested_walks(onf, wide_walks(inner))
            lts = [lt for lt in (128, 64, 32, 16) if lt < next_pow2(last.extent)] or [0]
        for it in ((64, 32, 16) if wide else (0, 64, 32, 16)):
            for lt in lts:
                if (lt, it) != (0, 0) and (it == 0 or any(v.extent > it for v in inner)):
                    yield from attempt(onf, loops, out_vars, inner, rows, nested, lt, it)

    def narrow():  # the rows held whole, fewer a program than a dot takes
        return _liftings(onf, GPU_NARROW_ROWS, lambda bt, bs: _apply_tiles(
            onf, loops, out_vars, inner, rows, bt, bs, gpu=True))

    def split_rows():
        # a row wider than a program holds even alone (RMSNorm over d = 16384 in float32 on the
        # A40: x's row and the weight, 128 KB): the last axis over the grid, widest tile first,
        # the statistic's walk (Σ_d x², the output's d shadowed: ``separate_walks``) walked
        # whole by each program of the row, in tiles. Two programs a row read x's row three
        # times, as a statistics pre-pass would (one more pass than the row held whole)
        last = out_vars[-1] if out_vars else None
        if last is None or last not in loops:
            return
        named = W.separate_walks(onf, [last.name])
        if named is onf:
            return
        structure = _structure(named, gpu=True)
        top = next_pow2(last.extent) // 2
        for lt in (top >> k for k in range(top.bit_length())):
            if lt < 16:
                return
            yield from _liftings(named, GPU_SPLIT_ROWS, lambda bt, bs, lt=lt: _apply_tiles(
                named, *structure, bt, min(bs, lt), gpu=True, last_tile=lt))

    if wide_walks(inner):
        return _ranked(structures(onf, loops, out_vars, inner, rows), machine, rank)
    if not _holds_dots(onf):  # nothing to lose: the spill check's tries go on to fewer rows
        return _ranked(itertools.chain(structures(onf, loops, out_vars, inner, rows), narrow(), split_rows()),
                       machine, rank)
    best = _ranked(structures(onf, loops, out_vars, inner, rows), machine, rank)
    # with dots, fewer rows only where no tiling fits: a dot's tensor cores are worth a spill
    return best if onchip_bytes(best) <= machine.onchip_limit_bytes else _ranked(narrow(), machine, rank)


def _rewalks_row(onf: ONF, last, walks) -> bool:
    """Does one of ``walks`` read an array along the dimension ``last`` reads it: dX[n d] =
    f(⟨n d⟩ψx, Σ_d1 g(⟨n d1⟩ψx)), x's dimension 1 read by d and by the walk d1?"""
    at: dict = {}
    for e in onf.program.exprs():
        for x in D.walk(e):
            if isinstance(x, D.Read):
                for p, ix in enumerate(x.index):
                    at.setdefault((x.array, p), set()).update(ix.free_vars())
    return any(last in vs and any(w in vs for w in walks if w != last) for vs in at.values())


def _holds_dots(onf: ONF) -> bool:
    """Whether a contraction of the program is a matrix product, Σ_v a × b with each factor
    reading an axis the other does not (Q·Kᵀ; not RMSNorm's Σ_d x × x): Triton's dot, which
    takes tiles of 16 rows or more (under 16, ``pallas_kernels`` multiplies and sums)."""
    for st in onf.program.stages:
        for x in contractions(st):
            a, b = x.body.args
            if (a.free - b.free - {x.var}) and (b.free - a.free - {x.var}):
                return True
    return False


def _enclosed(onf: ONF) -> list:
    """(v, the variables of the reductions inside it) for each reduction Σ_v of the program."""
    return [(x.var, {y.var for y in D.reductions(x.body)} - {x.var})
            for e in onf.program.exprs() for x in D.reductions(e)]


def _nested_walks(onf: ONF, wide) -> set:
    """The variables of ``wide`` whose reductions hold, or lie in, a reduction over another."""
    wide = set(wide)
    out: set = set()
    if len(wide) < 2:
        return out
    for v, inside in _enclosed(onf):
        if v in wide and inside & wide:
            out |= (inside & wide) | {v}
    return out


def _nesting(e: D.Expr, v) -> int:
    """How many reductions enclose the outermost reduction over v in e (1 << 20: none)."""
    best = 1 << 20
    stack, seen = [(e, 0)], {}
    while stack:
        x, d = stack.pop()
        if seen.get(id(x), 1 << 20) <= d:  # (shared subtrees: again only when reached shallower)
            continue
        seen[id(x)] = d
        if isinstance(x, D.Red):
            if x.var == v:
                best = min(best, d)
                continue
            d += 1
        stack += [(c, d) for c in x.children]
    return best


# split-K: how many walks one kernel may be cut along (decode: one; a table's gradient: the
# heads, then the keys)
SPLIT_MAX_CUTS = 2
# split-K: each part walks at least this many tiles of its chunk (the partials and their
# combine are a second kernel and a round trip through memory: not worth it for short walks)
SPLIT_MIN_TILES = 4
# ... and the cost model must predict it at least this much faster: the roofline's idle-
# multiprocessor term is not calibrated on a GPU yet, so a modest predicted gain (attention at
# T=S=1024, N=8, H=128 in float16 on the A100: 64 programs for 108 multiprocessors, 1.28×
# predicted) does not buy a second kernel; decode (one query, one program per head over the
# cache) predicts 74× at 32768 keys.
SPLIT_MIN_GAIN = 2.0


def _split_to_fill(onf: ONF, machine: Machine) -> ONF:
    """Split-K where the programs are too few to fill the GPU (decode: one program per head
    walks the whole cache; a table's gradient: a program per few table entries walks every
    score). The longest walk of a stage that can be cut — its top reduction, else a Σ
    nested in other sums that ``rewrites.sum_to_top`` brings up — is cut into P parts, each a grid program that
    reduces its chunk to partials (for an online softmax: max, sum and accumulator per
    part), then the monoid combine (``rewrites.split_k``); P, a power of two, brings the
    programs to about twice the multiprocessors, each part walking ≥ SPLIT_MIN_TILES tiles
    (of the cut axis and of the axes walked inside it). The split is taken where the cost
    model's time (idle multiprocessors against the extra launch and the partials' round
    trip through memory) is SPLIT_MIN_GAIN times faster. Where one cut leaves the GPU short
    (the table gradient's 8 heads), the next walk is cut too: each split is a rewrite the
    next one reads."""
    for _ in range(SPLIT_MAX_CUTS):
        cut = _split_once(onf, machine)
        if cut is onf:
            break
        onf = cut
    return onf


def _split_once(onf: ONF, machine: Machine) -> ONF:
    """One split-K cut of ``_split_to_fill``, or ``onf`` itself where none pays."""
    sms = machine.multiprocessors
    programs = int(np.prod([a.ntiles for a in onf.axes if a.role == "grid"]))
    if not sms or programs >= sms:
        return onf
    walks = []  # (nested, depth, axis, tiles a program walks in the stage) for each axis split_k can cut
    for st in onf.program.stages:
        if st.walks is None:
            continue
        seq = {x.var: onf.axis_of(x.var) for e in st.exprs() if e is not None for x in D.walk(e)
               if isinstance(x, D.Red) and onf.axis_of(x.var).role == "sequential"}
        seq.setdefault(st.walks, onf.axis_of(st.walks))
        if seq[st.walks].role != "sequential":
            del seq[st.walks]
        tiles = int(np.prod([a.ntiles for a in seq.values()]))
        for v, a in seq.items():
            if v == st.walks or (isinstance(st, Stage) and W.sum_to_top(st.body, v.name) is not None):
                # (an online stage's own walk is no Red of its expressions: depth 0 as a stage's)
                depth = 0 if v == st.walks else min(_nesting(e, v) for e in st.exprs() if e is not None)
                walks.append((v != st.walks, depth, a, tiles))

    def parts_for(axis, tiles) -> int:
        parts = 1
        while (parts * 2 * programs <= 2 * sms and axis.ntiles // (parts * 2) >= 1
               and tiles // (parts * 2) >= SPLIT_MIN_TILES):
            parts *= 2
        return parts

    # a stage's own walk first, the longest: bringing a nested Σ up reorders the loop nest
    # its tiles were chosen for; of the nested ones the outermost (a table gradient's keys
    # around its queries: cut there, the nest below keeps its order)
    cuts = [(axis, parts_for(axis, tiles)) for _, _, axis, tiles in
            sorted(walks, key=lambda w: (w[0], w[1], -w[2].ntiles, -w[3]))]
    # the first cut in that order that pays: one that cannot pay (a table gradient's batch of
    # 2 around its 8 heads: at most twice the programs, 1.96×) leaves the next its turn —
    # before, it ended the search and that gradient ran as one program
    base = None
    for axis, parts in cuts:
        if parts < 2:
            continue
        try:
            split = W.split_k(onf, axis.name, parts).validate()
        except ONFError:  # a stored stage read along the axis: the walk stays whole
            continue
        if onchip_bytes(split) > machine.onchip_limit_bytes:
            continue
        base = base or estimate(onf, machine).time_s
        if base / estimate(split, machine).time_s >= SPLIT_MIN_GAIN:
            return split
    return onf


def _apply_tiles(onf: ONF, loops, out_vars, inner, rows, bt, bs, gpu: bool, last_tile: int = 0,
                 inner_tile: int = 0, nested: dict | None = None) -> ONF:
    axes = []
    for v in out_vars:
        if v == out_vars[-1] and last_tile:
            axes.append(Axis(v.name, v.extent, last_tile, "grid"))
        elif v == out_vars[-1]:
            axes.append(Axis(v.name, v.extent, next_pow2(v.extent) if gpu else v.extent, "whole"))
        elif v in rows:
            t = min(bt, next_pow2(v.extent)) if gpu else min(bt, v.extent)
            axes.append(Axis(v.name, v.extent, t, "grid"))
        else:
            axes.append(Axis(v.name, v.extent, 1, "grid"))
    around = _around_walks(onf, set(loops), inner_tile) if gpu else set()
    for v in loops:
        if v in out_vars:
            continue
        t = 1 if v in around else min(bs, next_pow2(v.extent)) if gpu else _cpu_walk_tile(v.extent, bs)
        axes.append(Axis(v.name, v.extent, t, "sequential" if t < v.extent else "whole"))
    for v in inner:
        if any(a.name == v.name for a in axes):
            continue
        if v in around:  # one at a time: held whole it would hold the inner walk's state per element
            axes.append(Axis(v.name, v.extent, 1, "sequential"))
        elif nested and v in nested:
            axes.append(Axis(v.name, v.extent, nested[v], "sequential"))
        elif inner_tile and v.extent > inner_tile:
            axes.append(Axis(v.name, v.extent, inner_tile, "sequential"))
        else:
            axes.append(Axis(v.name, v.extent, next_pow2(v.extent) if gpu else v.extent, "whole"))
    return W.lift(onf, _one_by_one(onf, axes) if gpu else axes)


# a CPU walk's tile (``_cpu_walk_tile``): a sum longer than this is walked, not held whole
CPU_WALK_TILE = 256


def _cpu_walk_tile(extent: int, bs: int) -> int:
    """A CPU walk's tile: ``bs``, or where it leaves a ragged last tile, the first tile up to
    2·bs that divides the extent (d_ff = 1408: 352). XLA masks a padded tile with a select per
    operand per step; on the 2-core EPYC the MLP's dZ took 67 ms in tiles of 256, 41 in 352."""
    if extent <= bs or extent % bs == 0:
        return min(bs, extent)
    return next((t for t in range(bs, 2 * bs + 1) if extent % t == 0), bs)


def _around_walks(onf: ONF, loops: set, inner_tile: int) -> set:
    """The nested reductions that enclose a walk — over a loop, or over a variable walked in
    tiles of ``inner_tile`` (GQA's dK = Σ_g Σ_t …: the query heads of a kv head around the
    queries): on a GPU they run one element at a time."""
    out = set()
    for v, walks in _enclosed(onf):
        # a short reduction around a longer walk (not the main loop around a nested one)
        if any((w in loops or (inner_tile and w.extent > inner_tile)) and w.extent > v.extent for w in walks):
            out.add(v)
    # a variable a memory stage is indexed by is that kernel's own axis: the ONF's one lifting
    # cannot walk it there (Triton walks at most one own axis per program) — it stays whole
    owned = {v for st in onf.program.stages if st.place == "memory" for v in st.vars}
    return out - owned


def _cpu_whole_walks(onf: ONF, loops) -> set:
    """The loops a CPU holds whole, XLA running each as one op: those whose every reduction is
    a contraction of two values read from memory (inputs, memory stages: Σ_d Z[n d] × W[d f],
    one dot; walking it in tiles only adds passes over the output's accumulator), and those
    whose every reduction sums a map over one read's points within its own variable and its
    stage's (RMSNorm's dX: Σ_d1 −(dO[n d1] × w[d1]) × x[n d1] for each n, one fused reduce:
    nothing materialised, where walking in tiles slices every operand each step)."""
    memory = {st.name for st in onf.program.stages if st.place == "memory"}
    contraction: dict = {}
    mapped: dict = {}
    for st in onf.program.stages:
        own = set(getattr(st, "vars", None) or ())
        for e in st.exprs():
            if e is None:
                continue
            for x in D.walk(e):
                if not (isinstance(x, D.Red) and x.var in loops):
                    continue
                factors = D.product_factors(D.unlabelled(x.body)) if x.monoid == "add" else []
                dot = len(factors) == 2 and all(
                    isinstance(f, D.Read) or (isinstance(f, D.Ref) and f.stage in memory) for f in factors)
                contraction[x.var] = contraction.get(x.var, True) and dot
                reads = [y for y in D.walk(x.body) if isinstance(y, D.Read)]
                span = frozenset().union(*(y.free for y in reads)) if reads else frozenset()
                # a map over one read's points: no product of reads over different axes (the
                # MLP's Σ_f g[n f] × W[d f] is a contraction: held whole as a map, its [n, f]
                # factor was materialised, the block's gradient at 266.3 MiB of temp where
                # 215.2: model_cpu.md)
                fused = (bool(own) and x.free <= own and any(y.free == span for y in reads)
                         and not any(isinstance(y, (D.Red, D.Ref)) for y in D.walk(x.body) if y is not x))
                mapped[x.var] = mapped.get(x.var, True) and fused
    return {v for v, ok in contraction.items() if ok} | {v for v, ok in mapped.items() if ok}


def _cpu_tiles(onf: ONF, machine: Machine, loops, out_vars, inner, rows):
    whole = _cpu_whole_walks(onf, loops)
    if whole:
        loops = [v for v in loops if v not in whole]
        inner = sorted(set(inner) | whole, key=lambda v: v.name)
    rows_ext = rows[0].extent if rows else 1
    other = 1
    for v in out_vars:
        if v not in rows and v != out_vars[-1]:
            other *= v.extent
    bs = CPU_WALK_TILE
    bt = _cpu_rows(machine, rows_ext, other, bs)
    # a long Σ inside another long Σ, neither a main walk (a table's gradient: Σ_n Σ_s Σ_t
    # over every score): held whole they materialise [s, t, …]; both are walked in tiles
    nested = any(isinstance(x, D.Red) and x.var in inner and x.var.extent > bs
                 and any(isinstance(y, D.Red) and y is not x and y.var in inner and y.var.extent > bs
                         for y in D.walk(x.body))
                 for e in onf.program.exprs() for x in D.walk(e))
    o = _apply_tiles(onf, loops, out_vars, inner, rows, bt, bs, gpu=False, inner_tile=bs if nested else 0)
    loop = tuple(v.name for v in rows if bt < v.extent)
    o = W.with_knobs(o, cpu_loop=loop) if loop else o
    return _cpu_batches(o)


def _cpu_batches(onf: ONF) -> ONF:
    """The batch walks held whole laid out as batches (the knob ``cpu_batches``), and the
    dots' batch axes held whole where that moves them before the rows (``Program.dot_batches``:
    attention's heads in the Δ kernel of a backward that recomputes it, laid out after its
    [t, s] rows, cost a transpose of each score tile: jit(grad) with residuals "none" at
    T = S = 1024 ran 1.44–1.53× slower; cpu_dot_batches_cpu.md)."""
    whole = {v.name for v in onf.program.vars() if onf.axis_of(v).role == "whole"}
    walks = {v.name for v in onf.program.batch_walks()} & whole
    base = W.with_knobs(onf, cpu_batches=tuple(sorted(walks))) if walks else onf
    dots = {v.name for v in onf.program.dot_batches()} & whole - walks
    if dots:
        moved = W.with_knobs(onf, cpu_batches=tuple(sorted(walks | dots)))
        if moved.axis_order() != base.axis_order():
            return moved
    return base


def _scatter_schedule(onf: ONF, machine: Machine, pinned: frozenset = frozenset(), rank: int = 0) -> ONF:
    """Outputs over different index variables (a backward: dQ[t h], dK[s h], dV[s e]) under
    the papers' ONF: the programs own tiles of a row variable r; an output that does not use
    r is c · Σ_r g and every program adds its partial (atomic scatter-add); the other main
    loops are sequential, batch-like variables of every output grid by 1. The row variable
    is the first output variable (in output order; on a CPU those leaving the fewest outputs
    scatter-added first) for which this is a valid ONF: one that no other reduction sums over
    (t for attention's backward when it recomputes the softmax: s is the softmax's axis). Only
    if there is none, a reduction over r that is a statistic of all of r (a softmax max whose
    variable shadows r) gets an axis of its own (``rewrites.separate_walks``): every program
    then computes it whole. ``pinned``: variables a preset gives another role than grid (they
    own no programs)."""
    errors = []
    shared = set.intersection(*[set(o.vars) for o in onf.dnf.outputs])
    candidates: list = []
    for o in onf.dnf.outputs:
        for r in o.vars:
            if r in candidates or r.extent < 1 or (r in shared and r != o.vars[-1] and len(shared) < len(o.vars)):
                continue  # an axis every output has (a batch) runs over programs, but owns no rows …
            candidates.append(r)
    # … unless it is the rows of them all (dK[s h] and dV[s e]: programs owning key tiles
    # compute both, no atomics): then it is tried after the others, by the reuse order below
    candidates += [v for o in onf.dnf.outputs for v in o.vars[:-1] if v in shared and v not in candidates]
    candidates = [v for v in dict.fromkeys(candidates) if v.name not in pinned]
    # a variable of extent 1 owns one row: it is valid (one program), but a longer one that
    # is valid too splits the work (a saving forward's query group g of extent 1 before t); and
    # one that every main-loop read depends on (a batch b) shares no tile between its rows: a
    # variable some read does not depend on (the queries t: K and V) goes first
    reads = _heavy_reads(onf, _main_walks(onf))
    # on a CPU, of the rest, the variable that leaves the fewest outputs scatter-added: XLA
    # carries each through the row loop as a whole buffer, updated once per tile (attention's
    # adjoint: programs owning key tiles add dQ alone, FlashAttention-2's order, where owning
    # query tiles adds dK and dV). A GPU keeps the output order: the seed's fused kernel owns
    # query rows (its 2.00× atomics)
    scattered = lambda v: 0 if machine.is_gpu else sum(v not in o.vars for o in onf.dnf.outputs)  # noqa: E731
    # on a GPU, of the rest, one that fills Triton's 16-row dot before one that cannot: under a
    # vmap whose keys are shared, K depends on neither the batch (2) nor the queries, and
    # programs owning the batch held it whole with one query each
    short = lambda v: machine.is_gpu and v.extent < 16  # noqa: E731
    candidates.sort(key=lambda v: (v.extent <= 1, all(v in r.free for r in reads), short(v), scattered(v)))
    unfit = None  # on a GPU, a valid ONF that does not fit: a later variable may fit
    # on a GPU, where no ONF fits: the batch-like variables a scattered output sums over own
    # programs too (``_summed_batch``: a score_mod table's gradient beside the batch and heads,
    # held whole 1.5 MB). Only then: where programs holding them whole fit, they sum them on
    # chip with fewer atomics, and every plan that fitted keeps its schedule
    for summed in (False, True) if machine.is_gpu else (False,):
        this_pass = None  # the first valid ONF of this pass that did not fit
        for separate in (False, True) if not summed else (False,):
            for r in candidates:
                earlier = this_pass  # (a valid ONF of an earlier variable that did not fit)
                for spread in (True, False):
                    try:
                        o = _scatter_over(onf, machine, r, separate, spread, rank, summed).validate()
                    except ONFError as err:
                        if not spread and not summed:
                            errors.append(f"{r.name}{' (separate walks)' if separate else ''}: {err}")
                        continue
                    if machine.is_gpu and o.written_walking():
                        # a GPU program writes its tiles of a result from one loop (dBias[t s] summed
                        # over a batch that owns the programs would be written walking t and s)
                        if not spread and not summed:
                            errors.append(f"{r.name}: writes {', '.join(f'{n} walking {list(v)}' for n, v in o.written_walking())}")
                        continue
                    if machine.is_gpu and onchip_bytes(o) > machine.onchip_limit_bytes:
                        # (GQA's dK in float64: programs owning query tiles hold the group whole in
                        # each, 354.5 KB on the H200; owning key tiles, the group walked, 135.7 KB)
                        this_pass = this_pass or o
                        # (the error names the one closest to fitting)
                        unfit = o if unfit is None or onchip_bytes(o) < onchip_bytes(unfit) else unfit
                        continue
                    if earlier is not None and o.axis(r.name).tile < 16:
                        # a stand-in owning rows of fewer than Triton's 16 (the heads, a batch of 1:
                        # every key then a program of its own, its dots one row wide) is not taken:
                        # the plan's own fallback (one kernel per output) does better
                        continue
                    return o
    if unfit is not None:
        return unfit  # for check_fits to name the limit
    raise ONFError(f"{onf.dnf.name}: no output variable can own the programs (" + "; ".join(errors) + ")")


def _scatter_over(onf: ONF, machine: Machine, r, separate: bool = False, spread: bool = False,
                  rank: int = 0, summed: bool = False) -> ONF:
    """The ONF whose programs own tiles of r (``_scatter_schedule``). A variable every output
    has is batch-like (grid by 1) unless it is the last of every output; with ``spread`` also
    when it is the last of only some (a saving forward's heads: the last axis of its [t n]
    statistics, not of Out [b t n e]), else it is held whole. ``summed`` (a GPU's): so is one
    that a scattered output sums over (``_summed_batch``); an ONFError where there is none."""
    outs = onf.dnf.outputs
    names: dict = {}
    for v in onf.program.vars():  # the outputs' ψ-reductions name their variables apart only
        if names.setdefault(v.name, v) != v:  # within each output: axes are named, so no fusing
            raise ONFError(f"{onf.dnf.name}: two index variables are named {v.name!r} "
                           f"(extents {names[v.name].extent} and {v.extent})")
    shared = set(outs[0].vars)
    for o in outs[1:]:
        shared &= set(o.vars)
    last = (any if spread else all)
    batch = [v for v in outs[0].vars if v in shared and v != r and last(v != o.vars[-1] for o in outs)]
    chains = {}
    if summed:
        extra, chains = _summed_batch(onf, r, batch)
        if not extra:
            raise ONFError(f"{onf.dnf.name}: no output scattered over {r.name!r} sums over a variable beside it")
        batch += extra
    for o in outs:
        if r not in o.vars and r.extent > 1:  # (over one row there is one program: no partials)
            over, rebind = chains.get(o.name, ((), {}))
            onf = W.accumulate(onf, o.name, "atomic", over=(r.name,) + over, rebind=rebind)
    if separate:
        onf = W.separate_walks(onf, [r.name] + [v.name for v in batch])
    loops = [v for v in _main_walks(onf) if v != r and v not in batch]
    gpu = machine.is_gpu
    # (a CPU's: RMSNorm's saving forward walked Σ_d x² in tiles of 256 beside the row held
    # whole, where the plain forward holds it whole)
    whole = set() if gpu else _cpu_whole_walks(onf, loops)
    rest = sorted((v for v in onf.program.vars() if v != r and v not in batch and v not in loops),
                  key=lambda v: v.name)

    def lift(bt, bs, walk_inner=False):
        # walk_inner (GPU): a short loop around a longer sum (GQA's dK, dV = Σ_g Σ_t …: the
        # query heads of a kv head around the queries) runs one element at a time and the
        # longer sum is walked in tiles of bs inside it, as ``_apply_tiles`` does: each step a
        # 2-D contraction over a tile of t. Held whole, the queries padded (T = 200 → 256)
        # times the group times a key tile took 836 KB per program in bfloat16 (the H200 has
        # 227 KB: bench/results/gpu_check_h200.md)
        around, inner = set(), set()
        if walk_inner:
            # the longest sum inside, a head dim (an output's last axis) only where nothing else is
            lasts = {o.vars[-1] for o in outs}
            for v, ws in _enclosed(onf):
                longest = max((w for w in ws if w in rest), key=lambda w: (w not in lasts, w.extent, w.name),
                              default=None)
                if v in loops and longest is not None and longest.extent > max(bs, v.extent):
                    around.add(v)
                    inner.add(longest)
        axes = [Axis(r.name, r.extent, min(bt, next_pow2(r.extent) if gpu else r.extent), "grid")]
        axes += [Axis(v.name, v.extent, 1, "grid") for v in batch]
        for v in loops:
            t = 1 if v in around else min(bs, next_pow2(v.extent)) if gpu else v.extent if v in whole else min(bs, v.extent)
            axes.append(Axis(v.name, v.extent, t, "sequential" if t < v.extent else "whole"))
        seen = {a.name for a in axes}
        for v in rest:
            if v.name not in seen:
                seen.add(v.name)
                if v in inner:
                    axes.append(Axis(v.name, v.extent, bs, "sequential"))
                else:
                    axes.append(Axis(v.name, v.extent, next_pow2(v.extent) if gpu else v.extent, "whole"))
        return W.lift(onf, _one_by_one(onf, axes) if gpu else axes)

    if gpu:
        cands = _gpu_candidates(GPU_SCATTER_TILES, onf, [v.extent for v in rest], machine)
        o = _first_fit(onf, machine, cands, lift, rank)
        if onchip_bytes(o) > machine.onchip_limit_bytes:  # none fits with the long sums held whole
            # the candidates for what stays held: the walked sums no longer count whole
            held = _gpu_candidates(GPU_SCATTER_TILES, onf, [v.extent for v in rest if v.extent <= GPU_WHOLE_MAX],
                                   machine, "scatter_walk")
            o = _first_fit(onf, machine, held, lambda bt, bs: lift(bt, bs, walk_inner=True), rank)
        return o
    # every other axis of an output's row tile but its last is vectorised beside the rows
    # (batch-like grid axes, and head axes held whole): the score tile is that deep. Not the
    # walked axes: a loop holds one tile (256) of them, the bs of the budget (counted whole,
    # a scatter-added dK[s h] over the programs' walk of s took 128-row tiles for 512)
    other = max(int(np.prod([v.extent for v in o.vars[:-1] if v != r and v not in loops])) for o in outs)
    bt = _cpu_rows(machine, r.extent, other)
    o = lift(bt, 256)
    return W.with_knobs(o, cpu_loop=(r.name,)) if bt < r.extent else o


def _summed_batch(onf: ONF, r, batch) -> tuple:
    """GPU: batch-like variables beside r that an output scatter-added over r lacks but sums
    over (a score_mod table's gradient Σ_t Σ_b Σ_n …, beside dQ[b t n h] and dK[b s n h]):
    they own programs too, and each program adds its partial over its own b and n as well
    (``rewrites.accumulate`` over (r, b, n)). Held whole instead, every program held the
    batch's and the heads' tiles: 1.5 MB for B = 2, N = 8, T = S = 256, H = 64 in float32,
    and no named atomic or split plan with a score_mod array fitted a GPU. A sum over
    another variable of the same extent that reads the inputs where v does (Σ_{n_kv} of
    query[b t n_kv h], where dQ reads query[b t n h]) stands for v: it is renamed (α).
    ``_scatter_schedule`` asks only where no ONF fits that holds them whole. Returns (the
    variables, {output: (their names, renames)})."""
    outs = onf.dnf.outputs
    owned = [o for o in outs if r in o.vars or r.extent <= 1]
    scattered = [o for o in outs if o not in owned]
    if not owned or not scattered:
        return [], {}
    lasts = {o.vars[-1] for o in outs if o.vars}
    try:
        trial = onf
        for o in scattered:
            trial = W.accumulate(trial, o.name, "atomic", over=r.name)
    except ONFError:
        return [], {}
    out_stage = dict(trial.program.outputs)
    bodies = {o.name: trial.program.stage_of(out_stage[o.name]).accumulated for o in scattered}
    own_names = {out_stage[o.name] for o in scattered}

    def positions(exprs, v) -> set:
        return {(x.array, i) for e in exprs for x in D.walk(e) if isinstance(x, D.Read)
                for i, ix in enumerate(x.index) if ix.as_var() == v}

    elsewhere = [e for st in trial.program.stages if not (set(st.defines) & own_names) for e in st.exprs()
                 if e is not None]
    found, chains = [], {o.name: ((), {}) for o in scattered}
    for v in owned[0].vars:
        if v == r or v in batch or v in lasts or v.extent <= 1 or not all(v in o.vars for o in owned):
            continue
        near = positions(elsewhere, v)  # where the outputs that own v read the inputs along it
        step = {}
        for o in scattered:
            if v in o.vars:
                continue
            red = bodies[o.name]
            if red is None:
                break
            bound = {x.var for x in D.walk(red.body) if isinstance(x, D.Red)}
            if v in bound:
                step[o.name] = {}
                continue
            like = [w for w in bound if w.extent == v.extent and positions([red.body], w) & near]
            if len(like) != 1 or v.name in {u.name for u in D.mentioned_vars(red.body)}:
                break
            step[o.name] = {like[0].name: v.name}
        else:
            ok = True
            for o in scattered:
                if o.name in step:
                    over, rebind = chains[o.name]
                    try:  # Σ_v brought up below Σ_r and the ones before it (linearity, Fubini)
                        W.accumulate(onf, o.name, "atomic", over=(r.name,) + over + (v.name,), rebind={**rebind, **step[o.name]})
                    except ONFError:
                        ok = False
            if ok:
                found.append(v)
                for o in scattered:
                    if o.name in step:
                        over, rebind = chains[o.name]
                        chains[o.name] = (over + (v.name,), {**rebind, **step[o.name]})
    return found, {n: c for n, c in chains.items() if c[0]}


def staged_parts(dnf: D.DNF, groups) -> tuple:
    """The kernels of a plan that cuts ``dnf``'s outputs into ``groups``: one DNF per group —
    after, where groups would each recompute a reduction they share (named by its label,
    ``moa.name``, where it has one), a first kernel that computes those values once into
    memory, which the groups then read as inputs (the MLP backward's U, V and G_H [n f], read
    by the dZ, dW_g/dW_u and dW_d kernels). Only a value at most ``STAGE_SIZE`` times the
    largest array of the kernel's interface is so placed — memory stays in proportion to the
    interface: U [n d_ff] beside Z [n d], never attention's scores [t s] beside Q [t h] once
    s > 4h — and only where the recomputation it removes is at least
    ``STAGE_SHARE`` of the plan's reduction work (attention's Δ = +/(dO × O), read by its dQ
    and dK/dV kernels, is not: a first kernel for it made the A100's dQ kernel spill)."""
    parts = split_outputs(dnf, groups)
    if len(parts) < 2:
        return parts
    users: dict = {}  # a value (its labels stripped) → the parts that compute it
    labels: dict = {}
    for k, part in enumerate(parts):
        for o in part.outputs:
            for x in D.walk(o.body):
                base = D.unlabelled(x)
                if isinstance(base, D.Red) and (isinstance(x, D.Tag) or base is not o.body):
                    users.setdefault(base, set()).add(k)
                    if isinstance(x, D.Tag):
                        labels.setdefault(base, x)
    budget = STAGE_SIZE * max(math.prod(a.shape) for a in dnf.inputs + dnf.outputs)
    work = sum(_reduction_points(o.body) for p in parts for o in p.outputs)
    taken = {i.name for i in dnf.inputs} | {o.name for o in dnf.outputs}
    shared: dict = {}  # the value → (its input spec, its index variables, its body with its label)
    for base, ks in users.items():
        vs = tuple(sorted(base.free, key=lambda v: (_order(dnf, v), v.name)))
        size = math.prod(v.extent for v in vs)
        if len(ks) < 2 or len({v.name for v in vs}) < len(vs) or size > budget:
            continue
        if (len(ks) - 1) * _reduction_points(base) < STAGE_SHARE * work:
            continue  # recomputing it costs next to nothing
        tag = labels.get(base)
        name = D.fresh_name(tag.label if tag is not None else f"{base.monoid}_{base.var.name}", taken)
        taken.add(name)
        spec = D.InputSpec(name, tuple(v.extent for v in vs), tuple(v.name for v in vs), base.dtype)
        shared[base] = (spec, vs, tag if tag is not None else base)
    # a value inside another shared one is computed within it (the first kernel reads neither)
    inner = {y for base in shared for y in D.walk(base.body) if y in shared}
    shared = {b: v for b, v in shared.items() if b not in inner or any(k not in _holders(users, shared, b) for k in users[b])}
    if not shared:
        return parts

    def read_shared(e: D.Expr) -> D.Expr:
        memo: dict = {}

        def go(x):  # top-down: a shared value inside another is read within the first kernel only
            hit = memo.get(id(x))
            if hit is None:
                if D.unlabelled(x) in shared:
                    spec, vs, _ = shared[D.unlabelled(x)]
                    hit = D.Read(spec.name, vs, spec.dtype)
                else:
                    hit = D.rebuild(x, [go(c) for c in x.children]) if x.children else x
                memo[id(x)] = (x, hit)
                return hit
            return hit[1]

        return go(e)

    first = D.DNF(f"{dnf.name}_shared", dnf.inputs,
                  tuple(D.Output(spec.name, spec.shape, spec.dims, vs, body) for spec, vs, body in shared.values()))
    extra = tuple(spec for spec, _, _ in shared.values())
    rest = tuple(D.DNF(p.name, dnf.inputs + extra, tuple(dataclasses.replace(o, body=read_shared(o.body))
                                                          for o in p.outputs)) for p in parts)
    return (first,) + rest


# the least share of a plan's reduction work that staging a shared value must save, and the
# most it may hold, in multiples of the largest input or output (SwiGLU's d_ff ≤ 4d)
STAGE_SHARE = 0.05
STAGE_SIZE = 4


def _reduction_points(*exprs) -> int:
    """The work of the reductions of ``exprs``: for each distinct one (over them all: nodes are
    hash-consed), the index points its body is evaluated on (its free variables and its own)."""
    reds = {x for e in exprs if e is not None for x in D.walk(e) if isinstance(x, D.Red)}
    return sum(math.prod(v.extent for v in x.free | {x.var}) for x in reds)


def _holders(users: dict, shared: dict, inner) -> set:
    """The parts that compute ``inner`` only inside another shared value."""
    return set().union(*(users[b] for b in shared if b is not inner and inner in set(D.walk(b.body))))


def _order(dnf: D.DNF, v) -> int:
    """A variable's place among the DNF's output variables (rows before columns), else last."""
    out = dnf.output_vars
    return out.index(v) if v in out else len(out)


def split_outputs(dnf: D.DNF, groups=None) -> tuple:
    """One DNF per group of output names (default: one per output), same inputs: kernels that
    together compute ``dnf``, each recomputing what its outputs share with the others."""
    by_name = {o.name: o for o in dnf.outputs}
    groups = groups or [(o.name,) for o in dnf.outputs]
    return tuple(D.DNF(f"{dnf.name}_{'_'.join(g)}", dnf.inputs, tuple(by_name[n] for n in g)) for g in groups)


def plan_groups(dnf: D.DNF, plan, machine: Machine, preset: Preset | None = None) -> tuple:
    """The output names of each kernel of ``plan`` (``PLANS`` or an explicit partition): for
    "owner", the outputs over the same row variables, where one kernel computes them without
    atomics (its programs own the rows of every output)."""
    names = [o.name for o in dnf.outputs]
    if plan == "fused":
        return (tuple(names),)
    if plan == "per_output":
        return tuple((n,) for n in names)
    if plan == "owner":
        # outputs over the same row variables (all but the last: dK[s h] and dV[s e]) are one
        # group if one kernel computes them without atomics, else each its own
        by_rows: dict = {}
        for o in dnf.outputs:
            by_rows.setdefault(frozenset(v.name for v in o.vars[:-1]), []).append(o.name)
        groups: list = []
        for g in by_rows.values():
            groups += [tuple(g)] if len(g) == 1 or _owns_all(dnf, g, machine, preset) else [(n,) for n in g]
        return tuple(sorted(groups, key=lambda g: names.index(g[0])))
    if isinstance(plan, str):
        raise ONFError(f"{dnf.name}: no plan {plan!r} for this DNF; plans are {PLANS} or a partition of {names}")
    flat = [n for g in plan for n in g]
    if sorted(flat) != sorted(names):
        raise ONFError(f"{dnf.name}: the plan {plan} must name each output once; outputs are {names}")
    return plan


def _owns_all(dnf: D.DNF, names, machine: Machine, preset: Preset | None) -> bool:
    """Does one kernel compute the outputs ``names`` with programs owning rows of them all?"""
    (sub,) = split_outputs(dnf, [tuple(names)])
    try:
        onf = derive(sub, machine, preset)
    except ONFError:
        return False
    return not any(onf.scatter_var(st) is not None for st in onf.program.stages)


def derive_plan(dnf: D.DNF, machine: Machine, preset: Preset | None = None):
    """The ONF of ``dnf`` for ``machine`` (``derive``), or for a multi-output DNF a tuple of ONFs
    that together compute it (``runtime.lowered`` runs them in turn): the preset's ``plan``
    (``plan_groups``); else one fused ONF, except where it scatter-adds or no fused schedule
    fits ("owner": no atomics, bitwise repeatable; on a CPU the fused ONF stays where it adds one
    output in a walk and does less reduction work, ``plan_work``; where none of its
    kernels fits either, one ONF per output)."""
    plan = preset.plan if preset is not None and preset.applies_to(machine) else None
    if plan is not None and len(dnf.outputs) > 1:
        groups = plan_groups(dnf, plan, machine, preset)
        try:
            if len(groups) == 1:
                return derive(dnf, machine, preset)
            # a plan named by the preset is those kernels, each recomputing what it needs (the
            # seed's atomics experiment compares exactly them): no shared first kernel
            return tuple(derive(d, machine, preset) for d in split_outputs(dnf, groups))
        except ONFError as e:
            # the plan is the user's, so it is not swapped for another; the error says so
            raise ONFError(f"{e} — in the plan {plan!r} the Preset names for {machine.name}; without it the "
                           "plan is derived (owner where no fused kernel fits)") from None
    # the fused candidate decides the plan by its structure, which the spill check (it only
    # steps the tiling down) does not change: probe it unchecked, and compile only what is kept
    probe = dataclasses.replace(machine, spill_check=False) if machine.spill_check and len(dnf.outputs) > 1 else machine
    try:
        onf = derive(dnf, probe, preset)
    except ONFError:
        if len(dnf.outputs) == 1:
            raise
        # no fused schedule fits shared memory (a score_mod's adjoint on a GPU, its program
        # holding every output's tile; SwiGLU's at n = 4096, d = 1024, f = 4096): the owner
        # plan, whose kernels share what their outputs share (dK and dV: P once per tile; the
        # MLP's staged U, V, G_H), else one kernel per output
        groups = plan_groups(dnf, "owner", machine, preset)
        if len(groups) > 1:
            plan = _owner_plan(dnf, groups, machine, probe, preset)
            if plan is not None:
                return plan
        return tuple(derive(d, machine, preset) for d in split_outputs(dnf))
    scattered = [st for st in onf.program.stages if onf.scatter_var(st) is not None]
    if scattered:
        # programs that scatter-add (atomics on a GPU; on XLA buffers carried over the row
        # tiles) give way to the "owner" plan: dQ owning query tiles, dK and dV together owning
        # key tiles in one loop sharing P — no atomics, bitwise repeatable. Except on a CPU,
        # where programs run in turn: one carried buffer costs less than recomputing, so the
        # fused ONF stays where it scatter-adds one output, its programs walk their row tiles
        # or one tile holds every row (``ONF.rows_walked_once``: XLA then computes the other
        # outputs' sums in that walk, sharing each tile's values — ``lower_xla._one_pass``) and
        # it does less reduction work than the owner plan (``plan_work``; a tie keeps owner). 4096
        # queries against 256 keys (one key tile): the fused walk holds 32.3 MiB of temp where
        # owner, staging QKᵀ and dO Vᵀ [t s] in memory, held 144.8 MiB and took 2.29× its time
        # (bench/results/backward_plans_cpu.md).
        # Attention's adjoint reading the saved statistics: programs owning key tiles add dQ
        # alone, 5 contractions per tile against owner's 7 — 1.28×, 1.56×, 1.48× owner at
        # S = 1024, 2048, 4096 (bench/results/backward_plans_cpu.md, the Xeon on 2026-12-03;
        # the EPYC the day before: 1.54×, 1.45×, 1.22×). The MLP's staged plan
        # and RMSNorm's tie, so they stay; the adjoint recomputing the statistics adds two
        # outputs (its row owner is the queries), so it stays owner though its fused plan is
        # faster there too
        groups = plan_groups(dnf, "owner", machine, preset)
        if len(groups) == 1:
            return derive(dnf, machine, preset)
        plan = _owner_plan(dnf, groups, machine, probe, preset)
        if plan is not None:
            if (not machine.is_gpu and len(scattered) == 1 and onf.rows_walked_once(onf.scatter_var(scattered[0]))
                    and plan_work((onf,)) < plan_work(plan)):
                return onf
            return plan
    elif machine.is_gpu and len(dnf.outputs) > 1:
        # a fused kernel without atomics can still recompute: to add an output over one axis
        # without atomics its programs own tiles of that axis and walk the others, and a row
        # statistic another output reads is then recomputed in every program. The saving
        # RMSNorm adjoint's programs own columns of d (dW = Σ_n, no atomics) and each walks
        # every row's Σ_d over all of d for dX: 25 ms by the model on the A40 at 4096 × 4096
        # in float32, against 0.8 ms for the recomputing adjoint's kernels; SwiGLU's bfloat16
        # adjoint at n = 4096, d = 1024, f = 4096 on the H200, its 64 programs owning tiles of
        # d and walking n and f, 28.6 ms against the A40's owner plan's 6.0. As between the
        # owner plan's own candidates (``_owner_plan``), the one the cost model times faster
        # (probed unchecked; a tie keeps the fused kernel, one launch)
        groups = plan_groups(dnf, "owner", machine, preset)
        if len(groups) > 1:
            owner = _owner_plan(dnf, groups, probe, probe, preset)
            if (owner is not None and sequence(estimate(o, machine) for o in owner).time_s
                    < estimate(onf, machine).time_s):
                return _owner_plan(dnf, groups, machine, probe, preset)
    return derive(dnf, machine, preset)


# how much faster the cost model must time recomputing than staging on a CPU to recompute
CPU_STAGE_MARGIN = 2.0


def _owner_plan(dnf: D.DNF, groups, machine: Machine, probe: Machine, preset: Preset | None):
    """The kernels of the owner plan: a first kernel staging the values the groups share in
    memory, which they read (``staged_parts``), or the groups each recomputing them
    (``split_outputs``). On a GPU, the one the cost model times faster (probed unchecked, as
    the fused candidate: the spill check steps tilings down, not the plan's structure): the
    MLP's U, V, G_H at d = 1024, 2·d flops an element against its 4-byte write and reads, are
    staged; attention's scores beside a [t s] mask or bias, 2·h flops an element that tensor
    cores recompute faster than memory moves them, are not (the H200, causal, T = S = 4096,
    N = 4, float32, the model's estimates: 0.13 ms against 0.37 with a mask, 0.19 against
    0.53 with a bias; staged, as they were until 2026-12-05, they took two [t n s] arrays of
    memory, 1 GiB at N = 8),
    nor are seed-size norms' and MLPs' (n = 1024, d = 64: one launch fewer). Registers are
    checked, not modelled: where the spill check leaves the faster plan's kernels spilling
    more than the other's, the other is taken (the seed-size SwiGLU's dZ recomputing U, V and
    G_H spills 2,112 B at the A100 table's first tiling with IEEE float32 dots, which the
    check steps past to a clean one; no kernel of the GPU reports needs the fallback).

    On a CPU, whose measured times stray from the model's by up to 3× (``moajax validate``),
    the staged plan stands unless the model times it at least ``CPU_STAGE_MARGIN`` times the
    recomputing one: attention's adjoint beside a [1 8 T S] bias (2.4× at T = 1024), whose
    staged plan took 1.16× and 1.28× the time of the fused kernel derive_plan then takes, and
    3× and 4× its temp memory (180 against 59 MiB, 668 against 165), at T = 1024 and 2048
    (``bench/results/staging_cpu.md``); not the seed-size MLP (1.3×), whose staged plan was
    the fastest. Its choice against the fused kernel is then ``plan_work``'s, which
    ``bench/results/backward_plans_cpu.md`` measured. None: neither fits."""
    found = []
    for parts in (staged_parts(dnf, groups), split_outputs(dnf, groups)):
        if found and len(parts) == len(found[0][1]):
            continue  # nothing staged: the same kernels
        try:  # (a shared first kernel that does not fit: each recomputes instead)
            found.append((tuple(derive(d, probe, preset) for d in parts), parts))
        except ONFError:
            continue
    if not found:
        return None
    times = [sequence(estimate(o, machine) for o in plan).time_s for plan, _ in found]
    if not machine.is_gpu and len(found) > 1:
        times[0] /= CPU_STAGE_MARGIN
    # a tie keeps the staged plan, the one listed first
    order = sorted(range(len(found)), key=lambda k: times[k])
    plan = tuple(derive(d, machine, preset) for d in found[order[0]][1])
    if len(order) > 1 and machine.spill_check:
        spilled = _plan_spills(plan, machine)
        if spilled:
            other = tuple(derive(d, machine, preset) for d in found[order[1]][1])
            spilled_other = _plan_spills(other, machine)
            if spilled_other is not None and spilled_other < spilled:
                return other
    return plan


def _plan_spills(plan, machine: Machine) -> int | None:
    """Spill bytes over a plan's kernels through the path they run (what the spill check
    compiled: memoised), or None where the toolchain cannot say."""
    from moajax import ptx

    try:
        return sum(ptx.spill_bytes(o, machine.arch, machine.gpu_path) for o in plan)
    except Exception:  # noqa: BLE001 - the spill check warned already; the model's choice stands
        return None


def plan_work(onfs) -> int:
    """The reduction work of a plan's kernels: in each, every distinct reduction of its program
    once — the index points its body is evaluated on — as a tile computes a value its stages
    share once (nodes are hash-consed). A first estimate: masked tiles are not discounted, a
    statistic every program recomputes (a separate walk) counts once, elementwise work and
    exps not at all."""
    return sum(_reduction_points(*o.program.exprs()) for o in onfs)


# The CPU score tile's least budget. Every host measured was fastest at a score tile of about
# 4 MiB, whatever its cache: the 2-core EPYC with 32 MiB of L3 (512 × 256 at 8 heads beat
# 256 × 256 by 1.6× and 4096 × 256 by 1.4×, bench/results/attention_forward_cpu.md) and the
# 2-core EPYC with 8 MiB of L3 and 512 KiB of L2 a core, where 1/8 of the L3 (1 MiB: 128-row
# tiles) made jit(grad) 1.45–1.48× and the forward 1.77–1.82× slower than 4 MiB at S = 1024 and
# 4096 (bench/results/cpu_score_tile_epyc_avx2.md, cpu_score_tile_forward_epyc_avx2.md; 8 and
# 16 MiB within 7 % of 4 MiB there, either way, 2 MiB nearly as slow as 1). So a tile past the L2 costs nothing
# measurable (the dots reuse each score H times for one softmax pass over it); why the small ones
# lose, a step between 256 and 512 rows, is not measured (XLA's per-step costs: each tile op
# dispatched to the thread pool, each dot's operands packed, are the likely part).
CPU_SCORE_TILE_MIN = 4 << 20


def _cpu_cache_budget(machine: Machine) -> int:
    """The bytes of a CPU score tile: the profile's ``cpu_score_tile_bytes``, else 1/8 of the
    last-level cache, at least ``CPU_SCORE_TILE_MIN``."""
    if machine.cpu_score_tile_bytes:
        return machine.cpu_score_tile_bytes
    return max(CPU_SCORE_TILE_MIN, (machine.llc_bytes or 32 * 2**20) // 8)


@functools.lru_cache(maxsize=256)
def _hoisted(dnf: D.DNF, store: tuple) -> ONF:
    """The DNF's ONF with the preset's store policies applied and its stages hoisted: the same
    for every machine (its target is set by ``derive``), and on a large adjoint (a transformer
    block's) the costliest step of a derivation, so it is made once per DNF."""
    onf = initial(dnf)
    for label, policy in store:
        if policy == "recompute":
            continue
        if policy not in ("onchip", "memory"):
            raise ONFError(f"{dnf.name}: store policy for {label!r} is {policy!r}; use recompute, onchip or memory")
        onf = W.materialize(onf, label, "local" if policy == "onchip" else "memory")
    return W.hoist(onf)


_DERIVED: collections.OrderedDict = collections.OrderedDict()  # (dnf, machine, preset, precision) → ONF or ONFError


def derive(dnf: D.DNF, machine: Machine, preset: Preset | None = None, **kw) -> ONF:
    """The default ONF of ``dnf`` for ``machine``, with a preset's (or keyword) choices applied.

    A pure function of its arguments and of ``jax.default_matmul_precision`` on a GPU (ONFs
    are immutable values; with a spill check, of the installed ptxas too), so it is made once,
    keyed by all of them: a
    plan's derivation (``derive_plan``, ``plan_groups``) and the cost model's comparison of
    residual policies ask for the same ONFs again. The machine is keyed by its ``repr`` (a
    profile holds dicts).

    On a GPU profile with ``spill_check`` (a GPU the process runs on: ``machines.for_device``;
    ``moajax gpu-report``) the tiling is the first of the table's that fit shared memory whose
    kernels ptxas compiles without spilling (``_spill_checked``)."""
    if preset is None:
        preset = Preset.of(**kw)
    elif kw:
        raise TypeError("derive: give a preset or keywords, not both")
    if not preset.applies_to(machine):
        preset = Preset()
    # a GPU's float32 dots follow jax.default_matmul_precision where the preset is silent, as
    # XLA's do (jax.nn's among them): TF32 by default, IEEE float32 under "highest"
    precision = (compat.default_dot_precision()
                 if machine.is_gpu and "dot_precision" not in dict(preset.knobs) else None)
    key = (dnf, repr(machine), preset, precision)
    hit = _DERIVED.get(key)
    if hit is None:
        try:
            hit = _derive(dnf, machine, preset, precision=precision)
            # a Preset's own tiling (tiles, warps, stages, …) is the user's, unchecked; the
            # dots' precision is arithmetic, not tiling: checked as the config's is
            tiling = [k for k, _ in preset.knobs if k != "dot_precision"]
            if machine.is_gpu and machine.spill_check and not (preset.tiles or tiling):
                hit = _spill_checked(dnf, machine, preset, hit, precision)
        except ONFError as e:
            hit = e
        _DERIVED[key] = hit
        if len(_DERIVED) > 512:
            _DERIVED.popitem(last=False)
    else:
        _DERIVED.move_to_end(key)
    if isinstance(hit, ONFError):
        raise hit.with_traceback(None)
    return hit


# How many of a table's tilings the spill check compiles at most (each try is one Triton
# compile and one ptxas run per kernel): every entry of the longest table
SPILL_CHECK_TRIES = max(len(c) for table in (GPU_TILES, GPU_SCATTER_TILES) for c in table.values())
_SPILLS_WARNED: set = set()


def _spill_checked(dnf: D.DNF, machine: Machine, preset: Preset, first: ONF, precision: str | None = None) -> ONF:
    """``first`` if its kernels compile without spilling, else the next tiling the tables offer
    that fits and does (``rank``: the k-th that fits), else the one that spills least (the
    first of equals): gpu-report names its spills. Ranks step within each table; where one
    tiling alone fits, that is the only try.

    Registers are checked, not modelled: over the 1296 compilations of smem_sweep.md no count
    of register-resident words per thread separates the tilings ptxas spills from those it
    does not (bench/results/register_model.md), and a score_mod's tanh or table gather tips
    tilings the tables chose for plain attention (8–224 B of spills on sm_80: gpu_report.md).
    The compiler is that of the path the kernels run through (``Machine.gpu_path``): jaxlib's
    Triton and ptxas for Pallas, Triton's own for the ONF's Triton source (``moajax.ptx``); where they
    are missing, or fail (a ptxas older than the PTX, an arch it does not know), the table's first
    fit stands, with one warning per profile: a check must never stop a kernel from running."""
    from moajax import ptx

    tried = []  # (spill bytes, ONF), in rank order
    o = first
    for rank in range(SPILL_CHECK_TRIES + max((len(t) for t in machine.gpu_tiles.values()), default=0)):
        if rank:
            try:
                o = _derive(dnf, machine, preset, rank, precision)
            except ONFError:
                break
        if any(o == t for _, t in tried):
            # the same ONF again: past the last tiling that fits, or two table entries that
            # clamp to one tiling (tiles capped by the extents, as the score_mod table
            # gradient's 32 × 16 with 8 warps at ranks 0 and 1 on the A40), where a later
            # rank still differs (its 4 warps, clean where 8 spill)
            continue
        try:
            spilled = ptx.spill_bytes(o, machine.arch, machine.gpu_path)
        except ONFError:  # a tiling the backend refuses (not a toolchain failure): the next rank
            continue
        except Exception as e:  # noqa: BLE001 - any toolchain failure: keep the table's choice
            if (machine.name, machine.gpu_path) not in _SPILLS_WARNED:
                _SPILLS_WARNED.add((machine.name, machine.gpu_path))
                import logging

                logging.getLogger("moajax").warning("moajax: tilings for %s (%s) are not spill-checked: %s: %s",
                                                    machine.name, machine.gpu_path, type(e).__name__, e)
            return first
        if spilled == 0:
            return _clean_or_small_spill(o, tried, machine)
        tried.append((spilled, o))
    return min(tried, key=lambda t: t[0])[1] if tried else first


# A clean tiling the cost model times more than SPILL_SLOWDOWN times slower than one tried
# before it that spills at most SPILL_TOLERATED bytes (stores and loads) is not taken over it.
# On the H200, float32 attention tilings spilling a few hundred bytes to 2 KB of stores ran
# 1.3–1.6× faster than the clean ones the check fell back to, and the two spilling about 25 KB
# a thread 6–7× slower (bench/results/gpu_backward_sweep_h200.md, gpu_backward_sweep_ptx_sm_90a.md).
# A fallback can change more than the tile: the A100's RMSNorm dW at n = d = 4096 in float32
# spills 104 B at its first tiling (split-K over n) and none at the third, which lost the split
# and walked all 4096 rows' Σ_d x² in each of 64 programs: 4.8 ms by the model against 0.14
SPILL_SLOWDOWN = 2.0
SPILL_TOLERATED = 2048


def _clean_or_small_spill(clean: ONF, tried, machine: Machine) -> ONF:
    """``clean`` (a tiling ptxas compiles without spilling), or the least-spilling of ``tried``
    that spills at most SPILL_TOLERATED bytes and that the cost model times more than
    SPILL_SLOWDOWN times faster."""
    slow = estimate(clean, machine).time_s
    small = [(s, o) for s, o in tried if s <= SPILL_TOLERATED and estimate(o, machine).time_s * SPILL_SLOWDOWN < slow]
    return min(small, key=lambda t: t[0])[1] if small else clean


def _derive(dnf: D.DNF, machine: Machine, preset: Preset, rank: int = 0, precision: str | None = None) -> ONF:
    onf = dataclasses.replace(_hoisted(dnf, preset.store), target=machine.name)
    # sibling sums inside a sum walk once (rewrites.fuse_sums) on a CPU: the table gradient's
    # two terms of dS share their scores. Not by default on a GPU: both terms live in one loop
    # body, and ptxas spills in some where two walks do not (ALiBi within documents' gradient:
    # 120 B on the A100, 228 on the H200; GQA's dK did until it ran with dV, which now takes
    # ~85 fewer registers in one walk in float32: fuse_sums_gpu.md; untimed on a GPU)
    if preset.fuse_sums if preset.fuse_sums is not None else not machine.is_gpu:
        onf = W.fuse_sums(onf)
    if not machine.is_gpu:
        # a long Σ under a short one (GQA's dK: Σ_g Σ_t) would be held whole: it goes outside,
        # to be the walk (a GPU walks the short one element by element around it instead)
        onf = W.long_sums_out(onf, CPU_WALK_TILE)
        # a statistic of the inner walk's rows read under two nested walks: that walk goes
        # outside, so the statistic is evaluated once per tile of its rows (rewrites.row_walks_out)
        onf = W.row_walks_out(onf, CPU_WALK_TILE)
    carry = preset.carry or "online"
    if carry not in ("online", "passes"):
        raise ONFError(f"{dnf.name}: carry must be 'online' or 'passes', got {carry!r}")
    if carry == "online":
        try:
            onf = W.fuse_online(onf)
        except ONFError:
            pass  # nothing softmax-shaped: the passes are the program
    if len({frozenset(o.vars) for o in _program_outputs(onf)}) > 1:
        onf = _scatter_schedule(onf, machine, frozenset(n for n, role in preset.roles if role != "grid"), rank)
    else:
        onf = W.separate_walks(onf, [v.name for v in _program_outputs(onf)[0].vars[:-1]])  # the grid's
        loops, out_vars, inner, rows = _structure(onf, machine.is_gpu)
        if machine.is_gpu:
            onf = _gpu_tiles(onf, machine, loops, out_vars, inner, rows, rank)
            if not preset.split and not preset.tiles:
                onf = _split_to_fill(onf, machine)
        else:
            onf = _cpu_tiles(onf, machine, loops, out_vars, inner, rows)
    # a preset names axes by dimension; one of extent 1 has no loop in the DNF (ψ: op/ over one
    # item is that item), so there is nothing to tile: the choice is moot, not an error. So is
    # a dimension of the inputs this kernel's program indexes by another name, or not at all:
    # a forward's Preset reaches each kernel of its adjoint (the kernel of dy for x "n", y "m"
    # combined elementwise runs over m alone); a name in no input is still an error (a typo)
    present = {v.name for v in onf.program.vars()}
    moot = {d for spec in dnf.inputs for d in spec.dims} - present
    roles = {name: role for name, role in preset.roles if name not in moot}
    walked = {x.var.name for e in onf.program.exprs() for x in D.walk(e) if isinstance(x, D.Red)}
    walked |= {v.name for v in onf.program.walked()}
    for name, t in preset.tiles:
        if name not in moot:
            role = roles.pop(name, None)
            axis = next((a for a in onf.axes if a.name == name), None)
            if axis is None:
                axis = next((onf.axis_of(v) for v in onf.program.vars() if v.name == name), None)
            if role is None and axis is not None and name in walked and int(t) < axis.extent and axis.role == "whole":
                role = "sequential"  # a walked axis held whole because it fit one tile: walk it in these tiles
            elif role is None and axis is not None and axis.role == "whole":
                # held whole and walked by nothing (attention's s in the adjoint's kernel of what
                # dQ and dK share): no loop to tile, so moot; taken, a "whole" axis of tile 32 <
                # 100 held 100, which the Triton backend refused (not a power of two)
                continue
            onf = W.tile(onf, name, int(t), role)
    for name, role in roles.items():
        onf = W.tile(onf, name, onf.axis(name).tile if name in {a.name for a in onf.axes} else 1, role)
    for name, parts in preset.split:
        if name not in moot:
            onf = W.split_k(onf, name, int(parts))
    for name, g in preset.gamma:
        onf = W.with_gamma(onf, name, g)
    if preset.knobs:
        k = dict(preset.knobs)
        for name in ("cpu_loop", "cpu_batches"):
            if name in k and isinstance(k[name], (list, str)):
                k[name] = tuple([k[name]] if isinstance(k[name], str) else k[name])
        onf = W.with_knobs(onf, **k)
    if precision is not None and precision != onf.knobs.dot_precision and _operand_width(onf) == 4:
        # float32 kernels only (``_operand_width``: the kernel's own outputs, as the tile tables
        # go by): a 16-bit kernel's dots are 16-bit, a float64 one's float64, whatever the knob
        onf = W.with_knobs(onf, dot_precision=precision)
    grid = {a.name for a in onf.axes if a.role == "grid"}
    if any(n not in grid for n in onf.knobs.cpu_loop):  # a preset made a looped axis non-grid
        onf = W.with_knobs(onf, cpu_loop=tuple(n for n in onf.knobs.cpu_loop if n in grid))
    # (a preset that walks a batch in tiles leaves cpu_batches unused: ``ONF.axis_order``)
    if not machine.is_gpu and onf.axis_order(vectorised=True) != onf.axis_order():
        # one vectorised computation (``axis_order`` takes the knob only where nothing walks in
        # tiles): an output's last axis stays last (``Knobs.cpu_vectorised``)
        onf = W.with_knobs(onf, cpu_vectorised=True)
    if machine.is_gpu and onf.knobs.lowp_dots:
        # 16-bit dots: the operands as read, the factors hoist sank into them after the dot
        # (as FlashAttention scales its scores), so that no product is rounded to 16 bits
        onf = W.factor_out_of_dots(onf)
    if machine.is_gpu:
        # a row of a stage that a walk reads tile by tile (attention's Δ[t] under programs
        # owning key tiles, walking the queries: dQ scatter-added) has no indexable place on a
        # GPU's chip: it goes to memory, computed once by a kernel of its own (FlashAttention-2's
        # Δ pre-pass)
        for stage, _ in onf.rows_across_walks():
            onf = W.place(onf, stage, "memory")
    if preset.skip is not False:
        onf = W.skip_masked(onf)
        if preset.unmask_interior if preset.unmask_interior is not None else not machine.is_gpu:
            onf = W.unmask_interior(onf)
        if not machine.is_gpu and "cpu_loop" not in dict(preset.knobs):
            onf = _loop_runtime_bounds(onf)
    return check_fits(onf.validate(), machine)


def _loop_runtime_bounds(onf: ONF) -> ONF:
    """On a CPU, the grid axes at which a skip's bound reads a runtime scalar (⟨b⟩ψlengths: a
    batch element's sequence length) join the ``cpu_loop`` knob. Vectorised, every program of
    the axis walks at once, so the walk spans the tiles of the batch's longest sequence
    (``tiles.skipping``: a bound's scalar read over the program's rows, the max); looped, each
    element walks its own. Only where the walk has tiles to leave out (more than one), and in
    a kernel that scatter-adds nothing: an adjoint whose programs own key tiles and add their
    dQ partials, looped per batch element as well, ran slower with query lengths alone (1.29×
    and 1.06× at T = S = 1024 and 2048, ``bench/results/lengths_grad_cpu.md``). A skip's dead
    rows (``Skip.rows_dead``) count as its bounds do (``bench/results/lengths_forward_cpu.md``)."""
    if any(onf.scatter_var(st) is not None for st in onf.program.stages):
        return onf
    grid = {a.name for a in onf.axes if a.role == "grid" and a.ntiles > 1}
    add: list = []
    for sk in onf.skips:
        if onf.axis_of(sk.var).ntiles <= 1:
            continue
        # (a row condition under which the values are dead too: the forward's programs past a
        # query length walk nothing only where each batch element walks its own span)
        for bound in sk.bounds + sk.dead:
            for term, _ in bound.terms:
                if isinstance(term, D.Read):
                    add += [v.name for v in sorted(term.free, key=lambda v: v.name)
                            if v.name in grid and v.name not in onf.knobs.cpu_loop and v.name not in add]
    return W.with_knobs(onf, cpu_loop=onf.knobs.cpu_loop + tuple(add)) if add else onf

