"""How stages are ordered and computed inside a program, and values held over more than a tile.

A program computes its targets in program order (``run``); each computes the local stages it
reads on demand, in the scope that reads them (``TileEval.ref``): inside the loop over a
variable the stage is indexed by, once per tile; outside every loop that does not change its
variables' ranges, once (scopes: ``tiles.scope``). A plain stage is evaluated over the
scope's ranges (variables it has none for are taken whole); an online stage is carried
(``tiles.online``). A local stage over a sequential axis the scope has no range for is a
stored row: filled tile by tile into a buffer over the whole axis (``InMemory``), then read
back through windows — on backends that can index on-chip scratch (``Backend.stored_rows``).
"""

from __future__ import annotations

import dataclasses

from moajax.onf import OnlineStage, Stage
from moajax.reference import Named
from moajax.tiles import online
from moajax.tiles.ranges import Range, broadcast_to_vars, same_range


@dataclasses.dataclass(eq=False)
class Emit:
    """An output written tile by tile over a walked variable inside a shared loop (a
    scattered stage's partials): ``update(tile scope, carried)`` returns the new carried value
    — or writes to memory and returns None, when ``init`` is None. ``result``: the carried
    value after the loop."""

    update: object
    skip: object = None
    init: object = None
    result: object = None


@dataclasses.dataclass(frozen=True)
class InMemory:
    """A stage value held over more of an axis than one tile: a stage in main memory (over
    the padded extents of its variables) or a stored row (over a whole sequential axis).
    Reads take the window of the current ranges relative to ``base``."""

    value: Named
    base: dict = dataclasses.field(default_factory=dict)


def run(ev, roots) -> None:
    """Compute, in program order, the stages named ``roots`` that scope ``ev`` does not see
    yet (what they read is computed on demand). Sibling reductions over one sequential axis
    run in one loop first (``together``)."""
    defs = ev.state.defs
    together(ev, roots)
    for st in ev.onf.program.stages:
        todo = [n for n in st.defines if n in roots and n in defs and ev.stage_value(n, st.result_vars(n)) is None]
        if todo:
            compute(ev, st)


def _needed(ev, roots) -> list:
    """The local plain stages the stages ``roots`` read, directly or not, in program order."""
    need = ev.onf.program.reads(roots, within=ev.state.defs)
    return [st for st in ev.onf.program.stages if st.name in need]


def together(ev, roots, emits=None) -> None:
    """Compute in one loop the stages needed here that are each a reduction over the same
    sequential axis (no range here, more than one tile), not accumulated across programs and
    not yet computed: dK = Σ_t … and dV = Σ_t P × dO of a pass owning key tiles read P once
    per tile instead of once per reduction (FlashAttention-2's one pass over the queries).
    ``emits`` (v → [``Emit``]): outputs written tile by tile over v that join v's loop (the
    fused backward's scatter-added dK and dV beside dQ); those that joined a loop are removed
    from it, the rest are left for the caller."""
    onf = ev.onf
    groups: dict = {}
    for st in _needed(ev, roots):
        v = onf.shared_walk(st)
        if v is None or v in ev.ranges or ev.stage_value(st.name, st.result_vars(st.name)) is not None:
            continue
        if not ev.backend.stored_rows and any(onf.axis_of(w).role == "sequential" and w not in ev.ranges
                                              for w in st.vars):
            # written tile by tile over a sequential axis of its own (GQA's dK[b s n_kv h] where
            # a table's gradient walks n_kv): the caller's walk computes it one tile at a time;
            # here it would be computed over all of that axis (a query head g + 2·n_kv is then
            # no window)
            continue
        # one that reads another of the group (RMSNorm's Σ_d x·w ÷ rms after rms = Σ_d x²)
        # needs that one whole first: it stays a loop of its own
        group = groups.setdefault(v, [])
        if not any(onf.program.apart(st, m, ev.state.defs) for m in group):
            group.append(st)
    emits = emits if emits is not None else {}
    for v, sts in groups.items():
        mine = emits.pop(v, [])
        if len(sts) + len(mine) < 2:
            emits.setdefault(v, []).extend(mine)
            continue
        scope = ev.within({w for st in sts for w in st.vars})
        vals = scope.reduce_together([(st.body.monoid, v, st.body.body, st.body.free) for st in sts],
                                     [onf.skip_of(st.name) for st in sts], v, mine)
        for st, val in zip(sts, vals):
            ev.values[st.name] = val


def compute(ev, st) -> None:
    """Compute a stage's value(s) in scope ``ev`` and record them there."""
    if isinstance(st, OnlineStage):
        ev.values.update(online.carry(ev, st))
    else:
        ev.values[st.name] = value(ev, st)


def value(ev, st: Stage):
    """A plain stage's value: over the scope's ranges, or a stored row over a sequential axis."""
    import jax.numpy as jnp
    from jax import lax

    onf = ev.onf
    seq = [v for v in st.vars if onf.axis_of(v).role == "sequential" and v not in ev.ranges]
    if not seq:
        return ev.within(st.vars).eval(st.body)
    v = seq[0]
    a = onf.axis_of(v)
    if not ev.backend.stored_rows:
        from moajax.onf import ONFError

        raise ONFError(
            f"{onf.dnf.name}: stage {st.name!r} would be stored as a row over the sequential axis {v.name!r} on "
            "chip; this backend has no indexable on-chip scratch — recompute it (store 'recompute') or place it "
            "in memory"
        )
    row = Range(0, a.padded, v.extent)  # a row over every tile of v
    others = {w: ev.backend.whole(w) for w in st.vars if w not in ev.ranges and w != v}
    ranges = {**ev.ranges, **others, v: row}
    order = ev.ordered(w for w in st.vars if ranges[w].size != 1)
    buf = jnp.zeros(tuple(ranges[w].size for w in order), st.body.dtype)
    ax = order.index(v)
    ev.hoist([st.body], v)

    def step(i, buf):
        sub = ev.child({**others, v: Range(i * a.tile, a.tile, v.extent)})
        val = broadcast_to_vars(sub.eval(st.body), order, {**ranges, v: sub.ranges[v]})
        if a.tile == 1:  # a tile of one is a scalar index: the axis comes back as length 1
            val = jnp.expand_dims(val, ax)
        return lax.dynamic_update_slice_in_dim(buf, val.astype(buf.dtype), i * a.tile, ax)

    buf = ev.backend.fori_loop(a.ntiles, step, buf)
    return InMemory(Named(buf, order), {w: ranges[w] for w in order})


def window_array(ev, full: InMemory) -> Named:
    """The current ranges' window of an array held in memory: dynamic slices relative to its
    base (the XLA backend's ``window``; Pallas windows a ref instead)."""
    from jax import lax

    data, vars_ = full.value.data, list(full.value.vars)
    out_vars = []
    ax = 0
    for v in vars_:
        r = ev.ranges.get(v)
        b = full.base.get(v)
        if r is None or same_range(r, b) or (b is None and isinstance(r.start, int) and r.start == 0
                                             and r.size == data.shape[ax]):
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
