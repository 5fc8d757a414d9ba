"""The cost model: what an ONF costs on a machine, predicted from the program alone.

For a DNF scheduled by an ONF (the shapes and dtypes are the DNF's) it counts

* ``flops`` (a multiply-add is 2; ``matmul_flops`` of them are in contractions) and
  ``transcendentals`` (exp, log, √, … evaluations), stage by stage, each subexpression over
  exactly the index points it is evaluated on (so recomputation across passes shows), once
  for the stages that share a loop (``_loop_groups``: a tile computes what they share once); a
  stage whose masked tiles are skipped (``ONF.skips``) counts the share of tiles it visits,
  and where its interior tiles run unmasked (``Skip.interior``), the mask's comparisons and
  selects only on the boundary tiles (``masked.masked_fraction``). A bound that reads a
  runtime scalar (a sequence length) counts given its ``values``, else keeps every tile; on
  XLA the programs of a grid axis its ``cpu_loop`` does not walk run as one, so their walk
  counts as the longest any of them needs (``_walks``), except a scatter axis XLA walks tile
  by tile to skip its partials' masked tiles (``_stage_walks``);
* the papers' element counts: ``input_elements`` (each input element once),
  ``output_elements``, ``intermediate_elements`` (every stage placed in main memory, once) —
  the classical attention forward materialises score, num and probs (3n²) and den (n);
* ``bytes_moved``: modelled main-memory traffic — inputs as the tiling streams them
  (re-read by every program that needs them, unless that working set fits in the last-level
  cache), outputs written, memory stages written and read back; γ: on a GPU a tile read
  whose innermost physical axis runs shorter than a 32-byte sector costs whole sectors, on
  XLA an input stored in another axis order costs one transposed copy;
* ``onchip_bytes`` per program, ``scratch_bytes`` in main memory, ``launches``, and
  ``atomics``: an output accumulated atomically over a grid axis (scatter-add) costs one
  atomic read-modify-write per element per program that owns a tile of that axis;
* ``time_s``: a roofline, max(compute, memory) + launch overheads, for a machine profile.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from moajax import dnf as D
from moajax.ix import Var
from moajax.onf import ONF, ONFError, OnlineStage, Stage

_TRANSCENDENTAL = {"exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "silu"}


@dataclasses.dataclass(frozen=True)
class Cost:
    flops: float
    matmul_flops: float
    transcendentals: float
    input_elements: int
    output_elements: int
    intermediate_elements: int
    bytes_moved: float
    bytes_compulsory: float
    scratch_bytes: int
    onchip_bytes: int
    atomics: int
    launches: int
    time_s: float | None = None
    bound: str | None = None

    @property
    def compulsory_elements(self) -> int:
        """Inputs read once, outputs written once, materialised intermediates once."""
        return self.input_elements + self.output_elements + self.intermediate_elements

    def pretty(self) -> str:
        t = f", roofline {self.time_s * 1e3:.3f} ms ({self.bound}-bound)" if self.time_s is not None else ""
        return (
            f"flops {self.flops:.4g} (matmul {self.matmul_flops:.4g}), transcendentals {self.transcendentals:.4g}; "
            f"elements: inputs {self.input_elements}, outputs {self.output_elements}, "
            f"intermediates {self.intermediate_elements}; bytes moved {self.bytes_moved:.4g} "
            f"(compulsory {self.bytes_compulsory:.4g}); scratch {self.scratch_bytes} B; "
            f"on-chip {self.onchip_bytes} B/program; atomics {self.atomics}; launches {self.launches}{t}"
        )


def sequence(costs) -> Cost:
    """Kernels launched one after another (a transformer block as its kernels): counts, bytes,
    atomics, launches and times add; the on-chip footprint is the largest; the bound is the
    one of the longest kernel. Every kernel counts the arrays it reads and writes, so an
    array one kernel writes and the next reads is counted by both (as the papers do)."""
    costs = list(costs)
    if not costs:
        raise ValueError("sequence: needs at least one Cost")
    add = {f.name: sum(getattr(c, f.name) for c in costs) for f in dataclasses.fields(Cost)
           if f.name not in ("onchip_bytes", "scratch_bytes", "time_s", "bound")}
    timed = all(c.time_s is not None for c in costs)
    longest = max(costs, key=lambda c: c.time_s or 0.0)
    return Cost(**add, onchip_bytes=max(c.onchip_bytes for c in costs),
                scratch_bytes=max(c.scratch_bytes for c in costs),
                time_s=sum(c.time_s for c in costs) if timed else None, bound=longest.bound if timed else None)


@dataclasses.dataclass(frozen=True)
class Movement:
    """One array crossing a kernel's interface in one phase of a training step: read from or
    written to main memory, ``elements`` of it (dims: its axes' names)."""

    phase: str  # "forward" | "backward"
    array: str
    access: str  # "read" | "write"
    elements: int
    dims: tuple


def ring_bytes(ring, query_shape, key_shape, value_shape, itemsize: int, *, backward: bool = False,
               tangent: bool = False, residuals_in_ring_order: bool = True) -> int:
    """Bytes the busiest device sends in one ring attention call (``moajax.ring``), the
    shapes being one device's blocks [b, S/P, n, h] (batch and heads already split).

    Forward: the K and V blocks travel P − 1 hops. Backward: K and V again P − 1 hops, dK and
    dV P hops (home), in the accumulation dtype (float32 or wider: a 16-bit block's partials
    are rounded once, at home). ``tangent``: the ring of tangents (forward mode, ``jax.jvp``:
    its program is the forward's and this), K, V, K̊ and V̊ P − 1 hops in the inputs' dtype.
    With the zigzag balance each array's two halves move to their slots (forward: Q, K, V in
    and Out back; backward: dOut in and dQ, dK, dV back; tangent: Q̊, K̊, V̊ in and Out̊ back);
    a half whose slot is on its own device stays. ``residuals_in_ring_order``: the backward
    (the tangent) reads the forward's Q, K, V, Out and row statistics (Q, K, V) in ring order
    (``ring_attention``: one differentiable call around both rings); False where they cross
    the contiguous split between the two (the sequence split under jit: the saving forward and
    the adjoint, or the tangent, are partitioned kernels of their own) — the forward sends its
    row max and sum back, the backward reorders them and Q, K, V and Out again, the tangent Q,
    K and V. (``return_residual``'s lse, one row statistic back with Out, is not counted.) The
    ring's ``rounds`` do not change the bytes: each piece travels the hops its block did."""
    if backward and tangent:
        raise ValueError("ring_bytes: backward and tangent are two programs; ask for one")
    P = ring.devices
    kv = (int(np.prod(key_shape)) + int(np.prod(value_shape))) * itemsize
    if tangent:
        sent = (P - 1) * 2 * kv
    else:
        sent = (P - 1) * kv + (P * kv * max(itemsize, 4) // itemsize if backward else 0)
    if ring.balance == "zigzag" and P > 1:
        q = int(np.prod(query_shape)) * itemsize
        o = int(np.prod(query_shape[:-1])) * value_shape[-1] * itemsize
        arrays = q + kv + o  # each array's halves, once
        if not residuals_in_ring_order:  # the row max and sum (float32 or wider) back, and in
            stats = 2 * int(np.prod(query_shape[:-1])) * max(itemsize, 4)
            arrays += q + kv if tangent else stats + (q + kv + o if backward else 0)
        moving = max(sum(t != d for t in ring.reorder_targets(d)) for d in range(P))
        sent += arrays * moving // 2
    return sent


def interface_ledger(forward: D.DNF, *backward: D.DNF) -> list:
    """The per-array accounting of a forward and its backward, "inputs + outputs + stored
    intermediates": each array the forward reads and writes (its saved residuals among the
    writes), then each the backward reads (the residuals read back) and writes — once each,
    whatever the schedule; a backward of several DNFs (a forward rerun, then the adjoint
    reading what it wrote) counts each's. Paper IV's counts are sums of such rows:
    ``ledger_elements``."""
    rows = []
    for phase, dnf in (("forward", forward), *(("backward", b) for b in backward)):
        read = dnf.arrays_read()
        rows += [Movement(phase, i.name, "read", math.prod(i.shape), tuple(i.dims)) for i in dnf.inputs if i.name in read]
        rows += [Movement(phase, o.name, "write", math.prod(o.shape), tuple(o.dims)) for o in dnf.outputs]
    return rows


def ledger_elements(rows, *, per: str | None = None, charged_elsewhere=()) -> int:
    """The elements moved by the ledger ``rows``: only arrays with the axis ``per`` (paper IV
    counts the token-proportional arrays, n = B·N, not the weights) and not those charged to a
    neighbouring kernel (the MLP's Z and dZ, which its RMSNorm counts: read X, write Z, read
    dZ, write dX — 4nd)."""
    return sum(r.elements for r in rows
               if (per is None or per in r.dims) and r.array not in charged_elsewhere)


def _points(onf: ONF, vars_) -> int:
    """Index points of a value over ``vars_`` evaluated over every tile at once."""
    return math.prod(onf.axis_of(v).whole_size() for v in vars_)


def _itemsize(dtype) -> int:
    return np.dtype(dtype).itemsize


@functools.lru_cache(maxsize=None)
def _on_xla(target: str) -> bool:
    """Does XLA run an ONF made for ``target`` (a CPU profile; Pallas/Triton run a GPU's)?
    It decides how a table's gradient is counted: XLA scatter-adds it (``dnf.one_hot_write``,
    one add per element), the Pallas/Triton kernels bin by a loop over the table's entries
    (``Backend.bin_sum``), |c| selects and adds per element — what the one-hot Σ counts."""
    from moajax import machines

    try:
        return not machines.load(target).is_gpu
    except ValueError:  # an ONF built for no profile ("generic") runs on XLA
        return True


class _Counter:
    """Flops of one stage: each distinct subexpression once per index point it is evaluated on.
    ``seen``: the subexpressions already counted by the stages that share this one's loop
    (``_loop_groups``), which a tile computes once for them all."""

    def __init__(self, onf: ONF, seen: dict | None = None, unmasked=(frozenset(), 1.0), grid=None):
        self.onf = onf
        self.grid = grid or {}  # {grid variable: its tiles} of the programs evaluating the stage (a GPU's)
        self.flops = 0.0
        self.matmul = 0.0
        self.trans = 0.0
        self.seen: dict = {} if seen is None else seen
        # (the bounds a walk's interior tiles hold true, the share of its visited tiles that
        # still evaluate them): a comparison among those bounds, a conjunction with one and a
        # select on them alone cost only on that share (``Skip.interior``)
        self.bounds, self.boundary = unmasked

    def points(self, vars_) -> float:
        """Index points of a value over ``vars_``, as many times as the programs evaluate it:
        on a GPU each program computes its own tile, so a value that does not vary along a
        grid axis is computed once per tile of it (the scores under Out's head dim tiled over
        the grid; an RMSNorm's row statistic under f tiled), where XLA broadcasts it once."""
        vars_ = set(vars_)
        return _points(self.onf, vars_) * math.prod(n for v, n in self.grid.items() if v not in vars_)

    def _mask_share(self, e: D.Call) -> float:
        from moajax.masked import COMPARISONS, held

        if not self.bounds:
            return 1.0
        if e.op in COMPARISONS:
            hit = held(e, self.bounds)
        elif e.op == "logical_and":
            hit = any(held(c, self.bounds) for c in e.children)
        else:
            hit = e.op == "where" and held(e.children[0], self.bounds)
        return self.boundary if hit else 1.0

    def expr(self, e: D.Expr, extra=()):
        # a subexpression is evaluated over exactly its own free variables (the evaluator
        # broadcasts, never materialises, what it does not depend on)
        if self.seen.get(id(e)) is e:
            return
        self.seen[id(e)] = e  # kept alive: a factor built on the fly must not share a recycled id
        pts = self.points(e.free)
        if isinstance(e, D.Call):
            for c in e.children:
                self.expr(c, extra)
            if e.op in _TRANSCENDENTAL:
                self.trans += pts
                self.flops += pts if e.op == "silu" else 0
            else:
                self.flops += pts * self._mask_share(e)
        elif isinstance(e, (D.Convert, D.Tag)):
            self.expr(e.children[0], extra)
        elif isinstance(e, D.Red):
            sel = D.selection(e)
            if sel is not None:  # a table read at a computed index: one gather and a bounds test
                self.expr(sel[2], extra)
                self.flops += pts
                return
            self.reduction(e.monoid, e.var, e.body, extra)

    def reduction(self, monoid, v: Var, body: D.Expr, extra=()):
        hot = D.one_hot_write(v, body) if monoid == "add" and _on_xla(self.onf.target) else None
        if hot is not None:  # a table's gradient, scatter-added: X once, one add per element
            c, i, x = hot
            self.expr(x, extra)
            self.expr(i, extra)
            self.flops += self.points((set(x.free) | set(i.free) | {v}) - {c})
            return
        factors = D.product_factors(body) if monoid == "add" else [body]
        terms = D.distributed(body, factors, v) if len(factors) >= 2 else None
        if terms is not None:  # Σ_v over a sum of contractions is that many contractions (as evaluated)
            for t in terms[1]:
                self.reduction(monoid, v, t, extra)
            self.flops += self.points(set(body.free) - {v})  # adding them
            return
        pts = self.points(set(body.free) | {v})
        if len(factors) >= 2:
            for f in factors:
                self.expr(f, extra)
            self.flops += 2 * pts
            self.matmul += 2 * pts
        else:
            self.expr(body, extra)
            self.flops += pts


def _program_grid(onf: ONF, st) -> dict:
    """{grid variable: its tiles} of the GPU programs that evaluate stage ``st``: a memory
    stage's own kernel's (its results' grid variables, and the one it scatter-adds over), any
    other stage's the final kernel's (its outputs' and their scatter variables). None on XLA,
    which evaluates the grid vectorised: a value is broadcast, not recomputed, along an axis it
    does not vary over."""
    if _on_xla(onf.target):
        return {}

    def owned(stage):
        vs = {v for n in stage.defines for v in stage.result_vars(n)}
        return vs | set(onf.scatter_vars(stage))

    if st.place == "memory":
        vs = owned(st)
    else:
        vs = set().union(*[owned(onf.program.stage_of(name)) for _, name in onf.program.outputs])
    return {v: onf.axis_of(v).ntiles for v in vs if onf.axis_of(v).role == "grid" and onf.axis_of(v).ntiles > 1}


def _stage_flops(onf: ONF, st, seen: dict | None = None, walks=None) -> tuple[float, float, float]:
    c = _Counter(onf, seen, _unmasked(onf, st, walks or _walks(onf, None)), _program_grid(onf, st))
    if isinstance(st, Stage):
        c.expr(st.body, tuple(st.vars))
    else:
        v = st.var
        c.expr(st.logit)
        body_pts = c.points(set(st.max_vars) | {v} | set(st.logit.free))
        c.flops += 3 * body_pts  # running max, f − m
        c.trans += body_pts  # exp(f − m)
        ntiles = onf.axis_of(v).ntiles
        c.trans += ntiles * c.points(st.max_vars)  # α = exp(m_old − m_new) per tile
        for _, vs, w in st.sums:
            if w is None:
                c.flops += body_pts
            else:
                for f in D.product_factors(w):
                    c.expr(f)
                pts = c.points(set(st.max_vars) | {v} | set(w.free))
                c.flops += 2 * pts
                c.matmul += 2 * pts
            c.flops += 2 * ntiles * c.points(vs)  # acc·α + contribution
    return c.flops, c.matmul, c.trans


def _loop_groups(onf: ONF) -> dict:
    """stage name → (its kernel, the sequential variable v) of the loop it shares with other
    stages, grouped as the tile evaluator groups them (``tiles.stages.together``): in each
    kernel, the local stages whose top reduction walks v (``ONF.shared_walk``; none reading
    another), and with them the scatter-added stages written tile by tile over v — on XLA only
    where the programs walk their row tiles (the cpu_loop knob: ``lower_xla._one_pass``). The
    values their bodies share (attention's P and dP in dQ, dK and dV: 5 contractions, not 8)
    are computed once per tile; a stage alone in its loop shares nothing."""
    xla = _on_xla(onf.target)
    out: dict = {}
    for k, (_, stages) in enumerate(_kernel_stages(onf)):
        local = {n for st in stages if st.place != "memory" for n in st.defines}
        loops: dict = {}
        written: dict = {}
        for st in stages:
            if not isinstance(st, Stage) or st.place == "memory" or st.name in out:
                continue
            scatter = onf.scatter_var(st)
            if scatter is not None:
                walked = onf.written_over(st.vars)
                if walked is not None and (not xla or scatter.name in onf.knobs.cpu_loop):
                    written.setdefault(walked, []).append(st)
                continue
            v = onf.shared_walk(st)
            if v is not None:
                group = loops.setdefault(v, [])
                if not any(onf.program.apart(st, m, local) for m in group):
                    group.append(st)
        for v, sts in loops.items():  # written partials join a loop that walks v anyway
            sts = sts + written.get(v, [])
            if len(sts) > 1:
                out.update({st.name: (k, v) for st in sts})
    return out


def _unmasked(onf: ONF, st, walks: dict) -> tuple:
    """(the bounds true on the interior tiles of the stage's walk, the share of its visited
    tiles outside that interior); (∅, 1) where its walk has no ``Skip.interior``. ``walks``:
    ``masked.visited_fraction``'s options (``_walks``)."""
    from moajax.masked import masked_fraction, visited_fraction

    sk = _walk_skip(onf, st)
    if sk is None or not sk.interior or _masked_walk(onf, st, walks) is not None:
        # (a masked walk over the scatter axis takes its interior from that axis's bounds, not
        # from the written-over axis's counted here: the mask counted on every visited tile,
        # at most what it evaluates)
        return frozenset(), 1.0
    visited = visited_fraction(onf, sk, **walks)
    return frozenset(sk.bounds), (masked_fraction(onf, sk, **walks) / visited if visited else 1.0)


def _masked_walk(onf: ONF, st, walks: dict):
    """The scatter axis of stage ``st`` where XLA walks it tile by tile rather than as one
    program — its partials have masked tiles over it (``lower_xla._program_group``'s masked
    walk: a Preset's, the CPU's default loops that axis) — else None."""
    v = onf.scatter_var(st) if isinstance(st, Stage) else None
    if v is None or v.name not in walks["vectorised"]:
        return None
    return v if onf.axis_of(v).ntiles > 1 and onf.skip_of(st.name, v) is not None else None


def _stage_walks(onf: ONF, st, walks: dict) -> dict:
    """``walks`` for stage ``st``: a scatter axis XLA walks tile by tile (``_masked_walk``)
    counted per tile. Each tile of the written-over axis then walks the scatter axis's tiles
    its skip keeps: the same (row tile, scatter tile) pairs as the written-over axis's skip
    counted per scatter tile."""
    v = _masked_walk(onf, st, walks)
    return walks if v is None else {**walks, "vectorised": tuple(n for n in walks["vectorised"] if n != v.name)}


def _walks(onf: ONF, values) -> dict:
    """How the model counts a masked walk (``masked.visited_fraction``): the runtime scalars'
    ``values``, checked against the DNF's inputs, and on XLA the grid axes its ``cpu_loop``
    does not walk, whose programs run as one (``lower_xla``: their walk spans every row's
    tiles — the batch's longest sequence)."""
    vectorised = tuple(a.name for a in onf.axes if a.role == "grid" and a.name not in onf.knobs.cpu_loop) \
        if _on_xla(onf.target) else ()
    if values is None:
        return {"values": None, "vectorised": vectorised}
    if not isinstance(values, dict):
        raise TypeError(f"estimate: values must be a dict of input name → array, got {type(values).__name__}")
    inputs = {i.name: i for i in onf.dnf.inputs}
    out = {}
    for name, x in values.items():
        if name not in inputs:
            raise ValueError(f"estimate: values names {name!r}, which is not an input of the DNF "
                             f"(its inputs: {', '.join(inputs)})")
        a = np.asarray(x)
        if a.ndim == 0 and tuple(inputs[name].shape) == (1,):  # an unbatched call's length
            a = a.reshape(1)
        if a.shape != tuple(inputs[name].shape):
            raise ValueError(f"estimate: values[{name!r}] has shape {a.shape}; the input {name!r} has shape "
                             f"{tuple(inputs[name].shape)}")
        if a.dtype.kind not in "iu":
            raise TypeError(f"estimate: values[{name!r}] must be integers (runtime scalars a bound reads), "
                            f"got {a.dtype.name}")
        out[name] = a.astype(np.int64)  # (the bounds' arithmetic negates them: no unsigned wrap)
    return {"values": out, "vectorised": vectorised}


def _walk_skip(onf: ONF, st):
    """The masked tiles a stage's walk leaves out: its top reduction's, or for a scatter-added
    stage (its reduction runs over the programs' grid axis) its tile-by-tile writes over the
    sequential axis it walks."""
    if isinstance(st, Stage) and onf.scatter_var(st) is not None:
        walked = onf.written_over(st.vars)
        return None if walked is None else onf.skip_of(st.name, walked)
    return onf.skip_of(st.name)


def _kernel_stages(onf: ONF):
    """Kernels: one per memory stage (with the local stages it needs), and the final program."""
    memory = [st for st in onf.program.stages if st.place == "memory"]
    local = {n for st in onf.program.stages if st.place != "memory" for n in st.defines}

    def closure(roots):  # the local stages they need (a memory stage is another kernel's)
        need = onf.program.reads(roots, within=local)
        return [s for s in onf.program.stages if any(n in need for n in s.defines)]

    kernels = []
    for st in memory:
        roots = [x.stage for e in st.exprs() if e is not None for x in D.walk(e) if isinstance(x, D.Ref)]
        kernels.append((st, closure(roots) + [st]))
    outs = [s for _, s in onf.program.outputs]
    kernels.append((None, closure(outs)))
    return kernels


def _reads(onf: ONF, stages) -> list:
    out, seen = [], set()
    for st in stages:
        for e in st.exprs():
            if e is None:
                continue
            for x in D.walk(e):
                if isinstance(x, (D.Read, D.Ref)) and id(x) not in seen:
                    seen.add(id(x))
                    out.append(x)
    return out


def _tile(onf: ONF, v: Var) -> int:
    return onf.axis_of(v).block


def onchip_bytes(onf: ONF) -> int:
    """Shared memory one program needs, in the most demanding of the ONF's kernels (memory
    stages and split-K partials are kernels of their own, before the final one)."""
    return max(_kernel_onchip(onf, stages) for _, stages in _kernel_stages(onf))


def _kernel_onchip(onf: ONF, stages) -> int:
    """Shared memory one program of a kernel (its ``stages``) needs: an upper bound, calibrated on
    Triton's allocation (bench/results/smem_sweep.md; ≥ ptxas on sm_80, sm_86 and sm_90a in
    every row, re-checked by tests/test_cost.py) and checked for each default ONF by
    ``moajax gpu-report``.

    Input tiles loaded inside a sequential loop have ``num_stages`` pipeline buffers; tiles
    loaded once (the query rows) are staged once; the probabilities of an online softmax, fed
    to the second contraction, are staged once in the dot's operand dtype; other contractions
    stage their result tile for the dot's layout conversion. A kernel that scatter-adds (the
    fused backward) has a model of its own (``_scatter_onchip``)."""
    seq_vars = {a.name for a in onf.axes if a.role == "sequential"}
    if any(onf.scatter_var(st) is not None for st in stages):
        return _scatter_onchip(onf, stages, seq_vars)
    total = sum(size * item * (onf.knobs.num_stages if in_loop else 1)
                for size, item, in_loop in _loaded_tiles(onf, stages, seq_vars))
    staging = 0
    for st in stages:
        if isinstance(st, OnlineStage):
            p = math.prod(_tile(onf, v) for v in set(st.max_vars) | {st.var})
            total += p * (2 if onf.knobs.lowp_dots else _itemsize(st.logit.dtype))
            continue
        for x in contractions(st):
            staging = max(staging, math.prod(_tile(onf, v) for v in x.free) * _itemsize(x.dtype))
    return int(total + staging)


def _loaded_tiles(onf: ONF, stages, seq_vars):
    """(elements, itemsize, loaded inside a sequential loop) of each distinct input tile read."""
    seen = set()
    for r in _reads(onf, stages):
        if not isinstance(r, D.Read) or (r.array, r.index) in seen:
            continue
        seen.add((r.array, r.index))
        yield (math.prod(_tile(onf, v) for v in r.free), _itemsize(r.dtype),
               any(v.name in seq_vars for v in r.free))


def contractions(st):
    """The +.× reductions (Σ of a product) in a stage's expressions."""
    for e in st.exprs():
        if e is not None:
            for x in D.walk(e):
                if isinstance(x, D.Red) and x.monoid == "add" and isinstance(x.body, D.Call) and x.body.op == "mul":
                    yield x


def _scatter_onchip(onf: ONF, stages, seq_vars) -> int:
    """Shared memory of a kernel that scatter-adds partials (the fused backward), an upper bound
    calibrated on Triton's allocation over 144 tilings × {sm_80, sm_86, sm_90a} in 16, 32 and
    64 bits (bench/results/smem_sweep.md: the bound is ≥ ptxas everywhere, by 3 % at the closest):

    - a tile loaded once feeds contractions as left and as right operand (Q in Q·Kᵀ and dSᵀ·Q),
      so it is staged in both layouts: 2 copies;
    - a tile loaded in the loop has ``num_stages`` pipeline buffers, and one more with 16-bit
      operands (sm_90a's wgmma reads the second operand layout from shared memory too);
    - the computed rows × keys operand of a scattered contraction (P in Pᵀ·dO, dS in dSᵀ·Q) is
      staged twice in the dot's operand dtype.

    The partial result tiles themselves go from registers to the atomics: no shared memory."""
    total = 0
    for size, item, in_loop in _loaded_tiles(onf, stages, seq_vars):
        if in_loop:
            total += size * item * (onf.knobs.num_stages + (1 if item == 2 else 0))
        else:
            total += 2 * size * item
    seq_or_grid = {v for st in stages for v in st.index_vars if onf.axis_of(v).role != "whole"}
    staging = 0
    for st in stages:
        if onf.scatter_var(st) is None:
            continue
        for x in contractions(st):
            if x is st.accumulated:
                p = math.prod(_tile(onf, v) for v in {x.var} | (set(st.vars) & seq_or_grid))
                item = 2 if onf.knobs.lowp_dots else _itemsize(x.dtype)
                staging = max(staging, 2 * p * item)
    return int(total + staging)


def check_fits(onf: ONF, machine) -> ONF:
    """Raise ONFError if one program of ``onf`` needs more on-chip memory than ``machine``
    has (by ``onchip_bytes``, an upper bound); returns the ONF."""
    fp = onchip_bytes(onf)
    limit = machine.onchip_limit_bytes
    if limit and fp > limit:
        raise ONFError(
            f"{onf.dnf.name}: on-chip footprint {fp / 1024:.1f} KB per program exceeds the "
            f"{limit / 1024:.1f} KB of {machine.name} (smaller tiles, or recompute instead of store)"
        )
    return onf


def register_bytes(onf: ONF) -> int:
    """Register-resident values of one program: stage accumulators and the largest contraction
    result tile of the loop body (float32 or wider)."""
    _, stages = _kernel_stages(onf)[-1]
    seq_vars = {a.name for a in onf.axes if a.role == "sequential"}
    total = 0
    biggest = 0
    for st in stages:
        for name in st.defines:
            vs = st.result_vars(name)
            if any(v.name in seq_vars for v in vs):
                continue  # a stored row lives in memory/cache, not registers
            total += math.prod(_tile(onf, v) for v in vs) * _itemsize(st.dtype(name))
        for e in st.exprs():
            if e is None:
                continue
            for x in D.walk(e):
                if isinstance(x, D.Red):
                    out = set(x.free)
                    biggest = max(biggest, math.prod(_tile(onf, v) for v in out | ({x.var} if x.monoid != "add" else set())) * _itemsize(x.dtype))
        if isinstance(st, OnlineStage):
            p = math.prod(_tile(onf, v) for v in set(st.max_vars) | {st.var})
            biggest = max(biggest, 2 * p * _itemsize(st.logit.dtype))
    return int(total + biggest)


# a GPU's memory transaction: a 32-byte sector of a 128-byte line
SECTOR_BYTES = 32


def _layouts(onf: ONF, machine) -> dict:
    """Per input, the physical order of its axes (γ; on XLA, C operands in the program's order:
    ``tiles.operands.input_perms``); {} without a machine."""
    if machine is None:
        return {}
    from moajax.tiles.operands import input_perms

    return input_perms(onf, canonical=not machine.is_gpu)


def _transposed(spec, perms: dict) -> bool:
    """Is the input stored in another order of its axes of extent > 1 (a copy, not a reshape)?"""
    order = [ax for ax in perms.get(spec.name, range(len(spec.shape))) if spec.shape[ax] > 1]
    return order != sorted(order)


def _coalesced(onf: ONF, r, perms: dict, machine) -> float:
    """The share of each memory transaction a GPU tile read uses (γ): a tile whose innermost
    physical axis runs over fewer than a sector's elements (an F operand read by rows) fetches
    whole sectors for a part of each; 1 on a CPU, for stage refs and for runs of a sector or more."""
    if machine is None or not machine.is_gpu or not isinstance(r, D.Read) or not perms.get(r.array):
        return 1.0  # (a rank-0 input: one element, no axis to run along)
    ix = r.index[perms[r.array][-1]]
    vs = sorted(ix.free_vars(), key=lambda v: v.name)
    run = _tile(onf, vs[0]) if vs else 1
    return min(1.0, run * _itemsize(r.dtype) / SECTOR_BYTES)


def values_read(onf: ONF, values):
    """The runtime scalars among ``values`` that ``onf``'s DNF takes as inputs (a plan's kernels
    read some of a call's lengths each), for ``estimate``; None stays None."""
    if values is None:
        return None
    names = {i.name for i in onf.dnf.inputs}
    return {k: np.asarray(v) for k, v in values.items() if k in names}


def estimate(onf: ONF, machine=None, *, values=None) -> Cost:
    """Predict the cost of running ``onf`` (on ``machine``, for the roofline time).

    ``values``: {input name: integer array} — the runtime scalars a skip's bounds read, as a
    call would pass them (``query_seq_lengths``, ``key_value_seq_lengths``): the tiles a
    length leaves out are counted as skipped. Without them such a bound keeps every tile."""
    dnf = onf.dnf
    from moajax.masked import visited_fraction

    walks = _walks(onf, values)
    flops = matmul = trans = 0.0
    loops = _loop_groups(onf)
    shared: dict = {}  # loop → the subexpressions its stages have counted so far

    def share(st):  # the masked tiles its walk leaves out (``ONF.skips``)
        sk = _walk_skip(onf, st)
        return 1.0 if sk is None else visited_fraction(onf, sk, **_stage_walks(onf, st, walks))

    # a loop visits the union of its stages' tiles: at least the largest share
    loop_share: dict = {}
    for st in onf.program.stages:
        if st.name in loops:
            loop_share[loops[st.name]] = max(loop_share.get(loops[st.name], 0.0), share(st))
    for st in onf.program.stages:
        key = loops.get(st.name)
        f, m, t = _stage_flops(onf, st, None if key is None else shared.setdefault(key, {}), walks)
        s = share(st) if key is None else loop_share[key]
        flops, matmul, trans = flops + f * s, matmul + m * s, trans + t * s
    in_el = sum(math.prod(i.shape) for i in dnf.inputs)
    out_el = sum(math.prod(o.shape) for o in dnf.outputs)
    inter_el = 0
    scratch = 0
    for st in onf.program.stages:
        if st.place == "memory":
            for name in st.defines:
                n = math.prod(v.extent for v in st.result_vars(name))
                inter_el += n
                scratch += n * _itemsize(st.dtype(name))
    compulsory = sum(math.prod(i.shape) * _itemsize(i.dtype) for i in dnf.inputs)
    compulsory += sum(math.prod(o.shape) * _itemsize(o.dtype) for o in dnf.outputs)
    compulsory += 2 * scratch  # written once, read back once
    kernels = _kernel_stages(onf)
    streamed = 0.0
    perms = _layouts(onf, machine)
    llc = (machine.l2_cache_bytes if machine is not None and machine.is_gpu else
           (machine.llc_bytes if machine is not None else 0))
    # the programs that each stream their reads: on a GPU every grid tile; on a CPU, XLA
    # evaluates the grid vectorised, all tiles at once, except the axes the cpu_loop knob walks
    cpu = machine is not None and not machine.is_gpu
    for _, stages in kernels:
        grid = [a for a in onf.axes if a.role == "grid" and (not cpu or a.name in onf.knobs.cpu_loop)]
        for r in _reads(onf, stages):
            if isinstance(r, D.Ref) and onf.program.stage_of(r.stage).place != "memory":
                continue
            dt = r.dtype
            pts = _points(onf, r.free)
            reuse = 1
            for a in grid:
                if not any(v.name == a.name for v in r.free):
                    reuse *= a.ntiles
            # a re-read working set that stays in the last-level cache costs nothing extra
            working = pts * _itemsize(dt) / max(1, math.prod(a.ntiles for a in grid if any(v.name == a.name for v in r.free)))
            if reuse > 1 and llc and working * 2 <= llc:
                reuse = 1
            streamed += pts * _itemsize(dt) * reuse / _coalesced(onf, r, perms, machine)
    streamed += sum(math.prod(o.shape) * _itemsize(o.dtype) for o in dnf.outputs)
    if cpu:  # γ on XLA: an input stored in another axis order is one transposed copy up front
        streamed += sum(2 * math.prod(i.shape) * _itemsize(i.dtype) for i in dnf.inputs if _transposed(i, perms))
    streamed += scratch  # memory stages are written once (their reads are counted above)
    atomics = 0
    for st in onf.program.stages:
        v = onf.scatter_var(st)
        if v is not None:
            # every program owning a tile of v (and of the other grid variables its partial sums
            # over) adds its partial into each element: one atomic read-modify-write per element
            # and program (in place of the single final write)
            n = math.prod(onf.axis_of(w).ntiles for w in onf.scatter_vars(st)) * _points(onf, st.vars)
            atomics += n
            item = _itemsize(st.accumulated.dtype)
            streamed += 2 * n * item - math.prod(x.extent for x in st.vars) * _itemsize(st.dtype(st.name))
    launches = len(kernels)
    cost = Cost(
        flops=flops, matmul_flops=matmul, transcendentals=trans, input_elements=in_el,
        output_elements=out_el, intermediate_elements=inter_el, bytes_moved=streamed,
        bytes_compulsory=compulsory, scratch_bytes=scratch, onchip_bytes=onchip_bytes(onf),
        atomics=atomics, launches=launches,
    )
    if machine is None:
        return cost
    dtype = dnf.outputs[0].body.dtype
    acc = np.dtype(np.float32) if np.dtype(dtype).itemsize < 4 else np.dtype(dtype)
    t_mm = matmul / machine.peak(dtype if np.dtype(dtype).itemsize < 4 else acc, tensor=True)
    t_vec = (flops - matmul + 4 * trans) / machine.peak(acc)
    t_mem = streamed / machine.bandwidth
    t_launch = launches * machine.launch_overhead_us * 1e-6
    compute = t_mm + t_vec
    if machine.is_gpu and machine.multiprocessors:
        # fewer programs than multiprocessors leave the rest idle: the peak rates (and the
        # bandwidth, which one multiprocessor's loads cannot saturate) scale with the share busy
        programs = math.prod(a.ntiles for a in onf.axes if a.role == "grid")
        busy = min(1.0, programs / machine.multiprocessors)
        compute, t_mem = compute / busy, t_mem / busy
    return dataclasses.replace(cost, time_s=max(compute, t_mem) + t_launch,
                               bound="compute" if compute >= t_mem else "memory")
