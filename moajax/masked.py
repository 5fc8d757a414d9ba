"""Masked tiles: where a walked reduction's body is its monoid's identity, as affine bounds.

    op_w B  =  op_{w : c(w)} B      whenever B = id(op) wherever c fails.

A mask in the DNF is ``c ? x : y`` with c a conjunction of comparisons. A comparison that is
affine in the index variables and in runtime integer scalars (``⟨b⟩ψlengths``), with
coefficient ±1 on the walked variable w, is a bound on w: when B, with that comparison false,
reduces to the identity (Σ: 0; ⌈ and the online softmax: the mask fill), a program walks only
the tiles of w between the least lower and the greatest upper bound over its rows — causal,
local-window and length masks skip whole tiles instead of computing and masking them.
Of the tiles it walks, those on which every bound holds at every point (``interior_tiles``)
need no mask at all: c ? x : y is x there (``Skip.interior``). A comparison that does not read
w (coefficient 0: a query row inside its length, t < ⟨b⟩ψL) under which B is a plain 0 is a
row condition (``Skip.rows``): a program where it fails at every row walks no tile — dQ's
programs past a query length, whose cotangent rows are 0. So is a row condition under which
nothing reads the stage's values (``dead_rows``: c ? x : y reads x only where c holds) — the
forward's programs past a query length, whose output rows are 0 whatever their walk gives.

The mask fill m₀ (``large_negative``: −0.7·max, the max capped at float32's, jax.nn's) is not −∞: a row whose every key is
masked averages V over all keys. exp(m₀ − X), with X a row statistic (the row max or log-sum),
is 0 only for a row that keeps a key, and a ⌈ or online pass leaves out m₀ only then. A bound
that needs this is marked *kept*, and the skip carries a ``Guard`` — ∀ rows ∃ key: every
masking condition of the row holds — that each program checks from the same affine
conditions; where it fails, every tile is walked, and the fully masked row gets jax.nn's
result. (It takes every score a kept key has to exceed m₀ by more than exp's range, ≈ 104
in float32 and 745 in float64: true of any score above −2.4·10³⁸ + 745.) A mask on data (a
bool mask, a score_mod's −∞) has no affine guard; there the rows' statistics are the guard
(``RowGuard``): a row that keeps no key has statistic m₀, one that keeps a key one above
m₀/2 — the online pass checks its running max after walking the bounded tiles (a row still
at m₀ kept no key: every weight 1, its sums those of every tile); a Σ through exp(m₀ − X)
reads its rows' X before its walk.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from moajax import dnf as D
from moajax.ix import Var
from moajax.onf import (COMPARISONS, ONF, Affine, Guard, OnlineStage, RowGuard, Skip, Stage, comparison,  # noqa: F401
                        conjuncts, dead_row_conditions, dead_rows, linear)


ZERO, FILL, SHIFTED, TRUE, FALSE = "0", "m₀", "m₀ − X", "true", "false"


def _fill_of(dtype) -> float | None:
    """The mask fill m₀ of a float dtype (``kernels.common.large_negative``)."""
    dtype = np.dtype(dtype)
    if dtype.kind != "f":
        return None
    from moajax.kernels.common import large_negative

    return large_negative(dtype)


def held(c: D.Expr, holds) -> bool:
    """Is every conjunct of c an affine comparison among ``holds`` (true where they hold)?"""
    return all(comparison(a) in holds for a in conjuncts(c))


class _Under:
    """The value of expressions where one condition (``atom``) is false, as far as it is
    known: 0, the fill m₀, m₀ − X (X a row statistic), true or false (None: unknown) — each
    with the statistics X whose exp(m₀ − X) = 0 it assumed of a row keeping a key."""

    def __init__(self, atom: D.Expr):
        self.atom = atom
        self.memo: dict = {}

    def value(self, e: D.Expr):
        return self(e)[0]

    def __call__(self, e: D.Expr) -> tuple:
        hit = self.memo.get(id(e))
        if hit is not None and hit[0] is e:
            return hit[1]
        out = self._val(e)
        out = out if isinstance(out, tuple) else (out, frozenset())
        self.memo[id(e)] = (e, out)
        return out

    def _val(self, e):
        if e is self.atom:
            return FALSE
        if isinstance(e, D.Tag):
            return self(e.body)
        if isinstance(e, D.Lit):
            if np.dtype(e.dtype) == np.bool_:
                return TRUE if bool(e.value) else FALSE
            if float(e.value) == 0.0:
                return ZERO
            fill = _fill_of(e.dtype)
            return FILL if fill is not None and float(e.value) == fill else None
        if isinstance(e, D.Convert):  # m₀ widened or narrowed stays far below exp's range
            v, xs = self(e.arg)
            return (v, xs) if v == ZERO or (v == FILL and np.dtype(e.dtype).kind == "f") else None
        if isinstance(e, D.Red):
            v, xs = self(e.body)
            return (ZERO, xs) if e.monoid == "add" and v == ZERO else None
        if not isinstance(e, D.Call):
            return None
        op, args = e.op, e.children
        if op == "where":
            c, cx = self(args[0])
            if c == FALSE:
                v, xs = self(args[2])
                return v, xs | cx
            if c == TRUE:
                v, xs = self(args[1])
                return v, xs | cx
            (a, ax), (b, bx) = self(args[1]), self(args[2])
            return (a, ax | bx) if a is not None and a == b else None
        vals = [self(a) for a in args]
        vs = [v for v, _ in vals]

        def least(want):  # the cheapest argument with that value (fewest assumptions)
            hits = [xs for v, xs in vals if v == want]
            return (want, min(hits, key=len)) if hits else None

        if op == "logical_and":
            return least(FALSE) or ((TRUE, frozenset().union(*(x for _, x in vals))) if all(v == TRUE for v in vs) else None)
        if op == "logical_or":
            return least(TRUE) or ((FALSE, frozenset().union(*(x for _, x in vals))) if all(v == FALSE for v in vs) else None)
        if op == "logical_not":
            return ({TRUE: FALSE, FALSE: TRUE}[vs[0]], vals[0][1]) if vs[0] in (TRUE, FALSE) else None
        if op == "mul":
            return least(ZERO)
        if op in ("div", "neg"):
            return vals[0] if vs[0] == ZERO else None
        if op in ("add", "sub"):
            if vs == [ZERO, ZERO]:
                return ZERO, vals[0][1] | vals[1][1]
            if op == "sub" and vs[0] == FILL and vs[1] is None:
                return SHIFTED, vals[0][1] | {args[1]}
            return None
        if op == "maximum":
            return (FILL, vals[0][1] | vals[1][1]) if vs == [FILL, FILL] else None
        if op == "exp":
            return (ZERO, vals[0][1]) if vs[0] == SHIFTED else None
        return None


def _selects(exprs):
    """(c ? x : y, the value of the literal y, the mask fill m₀ of its dtype) for each select
    of these expressions whose y is a float literal."""
    for e in exprs:
        for x in D.walk(e):
            if isinstance(x, D.Call) and x.op == "where":
                y = x.children[2]
                while isinstance(y, (D.Tag, D.Convert)):
                    y = y.children[0]
                fill = _fill_of(y.dtype) if isinstance(y, D.Lit) else None
                if fill is not None:
                    yield x, float(y.value), fill


def _masking_atoms(exprs) -> list | None:
    """The conditions that mask a score to the fill: every conjunct of a ``c ? x : m₀``; None
    when one is not an affine comparison (a data mask: no closed-form guard)."""
    out: list = []
    for x, value, fill in _selects(exprs):
        # the mask fill, or −∞: a key past the end of a split part (``split_k``)
        if value in (fill, float("-inf")):
            for a in conjuncts(x.children[0]):
                if comparison(a) is None:
                    return None
                if a not in out:
                    out.append(a)
    return out


def _identity(monoid: str, val) -> bool:
    return val == ZERO if monoid == "add" else (monoid == "max" and val == FILL)


def derive_skip(onf: ONF, st, red: D.Red | None = None, over: Var | None = None) -> Skip | None:
    """The masked tiles of the variable stage ``st`` walks — or that its reduction ``red``
    (nested in it: GQA's Σ_t inside Σ_g) walks, or, with ``over``, of the variable ``over``
    of red's result (a scatter-added stage written tile by tile: the tiles where every
    partial is 0 are not added). None: no bound found."""
    if red is not None:
        if red.monoid not in ("add", "max") or (over is not None and red.monoid != "add"):
            return None
        w, of, body, monoid, exprs = over or red.var, red, red.body, red.monoid, (red.body,)
    elif isinstance(st, OnlineStage):
        w, of, body, monoid, exprs = st.var, st.logit, st.logit, "max", (st.logit,)
    elif isinstance(st, Stage) and st.reduction is not None and st.reduction.monoid in ("add", "max"):
        of = st.reduction
        w, body, monoid, exprs = of.var, of.body, of.monoid, (of.body,)
    else:
        return None
    cands = []
    for x in D.walk(body):
        if isinstance(x, D.Call) and x.op == "where":
            for a in conjuncts(x.children[0]):
                aff = comparison(a)
                if aff is not None and abs(aff.coeff(w)) in (0, 1) and a not in [c for c, _ in cands]:
                    cands.append((a, aff))
    bounds, kept, shifts, stats, conds, conds_kept = [], [], [], [], [], []
    for a, aff in cands:
        if aff in bounds or aff in conds:
            continue
        val, xs = _Under(a)(body)
        if not _identity(monoid, val):
            continue
        # ⌈ (and the online pass) leave out m₀ only in a row keeping a key; Σ through exp(m₀ − X)
        uses = monoid == "max" or bool(xs)
        if aff.coeff(w) == 0:  # a condition on the rows (``Skip.rows``)
            if monoid == "max":  # a row failing it scores only m₀: it keeps no key, and the guard fails
                continue
            conds.append(aff)
            conds_kept.append(uses)
        else:
            bounds.append(aff)
            kept.append(uses)
        if monoid == "max":
            shifts.append(set(of.free) if isinstance(of, D.Red) else set(st.max_vars))
        shifts += [set(x.free) for x in xs]  # the row variables of each statistic X
        stats += [x for x in sorted(xs, key=D.show) if x not in stats]
    # rows whose values nothing reads (``dead_rows``): left out like rows whose terms are all
    # the identity, and exempt from the guard (they need keep no key)
    dead_atoms = [a for a in (dead_row_conditions(onf, st) if red is None else ())
                  if comparison(a).coeff(w) == 0 and comparison(a) not in conds]
    dead = [comparison(a) for a in dead_atoms]
    if not bounds and (not (conds or dead) or onf.axis_of(w).role != "sequential"):
        return None  # (row conditions alone: only for a walk, which has tiles to leave out)
    # a row variable that a later stage reduces this one's results over is no row of the
    # softmax: split-K's part index s_o, whose parts the monoid combine joins. The kept key
    # is then sought over the whole walk (a part with no key contributes 0 to the combine)
    # — where the walk is over keys: a split of the walk over a statistic's own rows (dV's
    # Σ_t split into parts t = t_i + c·t_o, its statistic read at that t) keeps t_o a row
    combined = _combined_over(onf, st)
    if any(w in rows for rows in shifts):
        combined = set()
    shifts = [rows - combined for rows in shifts]
    needs = any(kept + conds_kept)
    guard = _guard(exprs, body, shifts, dead) if needs else None
    if guard is None and needs:  # no closed-form guard: the rows' statistics decide
        guard = _row_guard(st, red, monoid, body, stats, dead_atoms)
    if guard is None and needs:  # nor that: keep the exact bounds only
        bounds, kept = [b for b, k in zip(bounds, kept) if not k], [False] * sum(not k for k in kept)
        conds, conds_kept = [c for c, k in zip(conds, conds_kept) if not k], [False] * sum(not k for k in conds_kept)
        if not bounds and not conds and not dead:
            return None
    return Skip(st.name, w, tuple(bounds), tuple(kept), guard, of, rows=tuple(conds + dead),
                rows_kept=tuple(conds_kept) + (False,) * len(dead),
                rows_dead=(False,) * len(conds) + (True,) * len(dead) if dead else ())


def _fill(exprs) -> float | None:
    """The mask fill m₀ the selects of these expressions put in a masked score, or None."""
    return next((fill for _, value, fill in _selects(exprs) if value == fill), None)


def _row_guard(st, red, monoid: str, body: D.Expr, stats: list, dead=()) -> RowGuard | None:
    """The guard of a mask on data (a bool mask, a score_mod's −∞): each row's statistic says
    whether it keeps a key (``RowGuard``). An online pass checks its own running max after
    its walk; a Σ through exp(m₀ − X) reads each X at its rows before it. The rows a row
    condition zeroes whatever the skip (past a query length: their cotangent is 0) are exempt,
    as in ``_guard``; so are an online pass's dead rows (``dead``, comparisons: nothing reads
    them, so a program past a query length walks nothing at all, not every tile for rows
    still at the fill). None: no fill m₀ in the body, or no statistic to read."""
    fill = _fill([body])
    if fill is None:
        return None
    if isinstance(st, OnlineStage) and red is None:
        return RowGuard((), fill, tuple(dead))
    if monoid != "add" or not stats:
        return None
    rows = set().union(*(x.free for x in stats))
    exempt = []
    for x in D.walk(body):
        if isinstance(x, D.Call) and x.op == "where":
            for a in conjuncts(x.children[0]):
                aff = comparison(a)
                if (aff is not None and a not in exempt and aff.vars() <= rows
                        and _Under(a)(body) == (ZERO, frozenset())):
                    exempt.append(a)
    return RowGuard(tuple(stats), fill, tuple(exempt))


def _combined_over(onf: ONF, st) -> set:
    """The variables later stages reduce over while reading a result of ``st``."""
    out = set()
    names = set(st.defines)
    reads: dict = {}  # id → does the node read a result of st (children first: one pass)
    for other in onf.program.stages:
        for e in other.exprs():
            for x in D.walk(e) if e is not None else ():
                r = reads[id(x)] = ((isinstance(x, D.Ref) and x.stage in names)
                                    or any(reads[id(c)] for c in x.children))
                if r and isinstance(x, D.Red):
                    out.add(x.var)
    return out


def _joined_key(conds, keys):
    """Two key variables every condition uses as c·a + b with c = b's extent (split-K's part
    s_o and the index s_i inside it) as one key k = c·a + b: (k, the conditions over k), or
    None."""
    p, q = sorted(keys, key=lambda v: v.name)
    for a, b in ((p, q), (q, p)):
        if any(c.coeff(b) for c in conds) and all(c.coeff(a) == b.extent * c.coeff(b) for c in conds):
            k = Var(f"({b.extent}·{a.name} + {b.name})", a.extent * b.extent)
            return k, [Affine(tuple((t, v) for t, v in c.terms if t not in (a, b))
                              + (((k, c.coeff(b)),) if c.coeff(b) else ()), c.const) for c in conds]
    return None


def _guard(exprs, body, row_sets, dead=()) -> Guard | None:
    """∀ rows ∃ key: the masking conditions of the scores hold — the key variable being the
    one the masks use that no row statistic X is indexed by; rows failing a condition in
    ``dead`` (``dead_rows``) are exempt."""
    atoms = _masking_atoms(exprs)
    if not atoms:
        return None
    conds = [comparison(a) for a in atoms]
    used = {t for c in conds for t, _ in c.terms if isinstance(t, Var)}  # not a length's own index
    rows = set().union(*row_sets) if row_sets else set()
    keys = {v for v in used if isinstance(v, Var)} - rows
    if len(keys) == 2 and _joined_key(conds, keys) is not None:
        k, conds = _joined_key(conds, keys)
    elif len(keys) == 1:
        k = next(iter(keys))
    else:
        return None
    if any(abs(c.coeff(k)) > 1 for c in conds):
        return None
    # a row condition whose failure zeroes the body without any kept key (rows past a query
    # length, whose cotangent is 0) exempts those rows from the check
    conds_keep, exempt = [], []
    for a, c in zip(atoms, conds):
        if c in conds_keep or c in exempt:
            continue
        if c.coeff(k) == 0:
            if c in dead or _Under(a)(body) == (ZERO, frozenset()):
                exempt.append(c)
                continue
        conds_keep.append(c)
    return Guard(k, tuple(conds_keep), tuple(exempt))


def skips(onf: ONF) -> tuple:
    """The masked tiles of every stage's walk and of every reduction nested in a stage."""
    out = []
    for st in onf.program.stages:
        top = derive_skip(onf, st)
        if top is not None:
            out.append(top)
        outer = st.logit if isinstance(st, OnlineStage) else st.reduction
        if onf.scatter_var(st) is not None:  # written tile by tile over its sequential variables
            for v in st.vars:
                if onf.axis_of(v).role == "sequential":
                    sk = derive_skip(onf, st, st.accumulated, over=v)
                    if sk is not None:
                        out.append(sk)
        for e in st.exprs():
            for x in D.walk(e) if e is not None else ():
                if isinstance(x, D.Red) and x is not outer and all(sk.of is not x for sk in out):
                    sk = derive_skip(onf, st, x)
                    if sk is not None:
                        out.append(sk)
    return tuple(out)


# ----------------------------------------------------------------------------- evaluation


@dataclasses.dataclass(frozen=True)
class Extent:
    """A runtime scalar's least (``lo``) and greatest (``hi``) value over the rows of each
    program of a box (arrays over its grid tiles): what ``_extreme`` needs of it."""

    lo: object
    hi: object


def _extreme(aff: Affine, box, read_value, xp, upper: bool):
    """max (``upper``) or min of an affine form over a box of rows: each variable v in
    [lo, hi] (``box[v]``), each runtime scalar over its values (``read_value``)."""
    total = aff.const
    for t, c in aff.terms:
        if isinstance(t, Var):
            lo, hi = box[t]
            total = total + c * (hi if (c > 0) == upper else lo)
        else:
            # its values, or pieces of them (a tuple: windows that together cover them), or
            # their least and greatest over each program's rows already (``Extent``: the model's)
            vals = read_value(t)
            high = (c > 0) == upper
            if isinstance(vals, Extent):
                ext = vals.hi if high else vals.lo
            else:
                ext = functools.reduce(xp.maximum if high else xp.minimum,
                                       [(xp.max if high else xp.min)(p) for p in (vals if isinstance(vals, tuple) else (vals,))])
            total = total + c * ext
    return total


def guard_holds(guard: Guard, box, read_value, xp):
    """Does every row of ``box`` (rows the exempt conditions leave out excepted) keep a key?
    Each condition is affine, so the least over the box of u − l (a lower and an upper bound
    on the key) and of each row condition is at a corner: exact, no enumeration."""
    k = guard.var
    box = {v: r for v, r in box.items() if v != k}  # the key is what is searched for
    for c in guard.exempt:  # only the rows it keeps need a key
        vs = [t for t, _ in c.terms if isinstance(t, Var)]
        if len(vs) == 1:
            v = vs[0]
            cv = c.coeff(v)
            rest = _extreme(c.without(v), box, read_value, xp, upper=True)
            lo, hi = box[v]
            box[v] = (xp.maximum(lo, -rest), hi) if cv > 0 else (lo, xp.minimum(hi, rest)) if cv < 0 else (lo, hi)
    lowers = [c for c in guard.conds if c.coeff(k) > 0] + [Affine(((k, 1),), 0)]
    uppers = [c for c in guard.conds if c.coeff(k) < 0] + [Affine(((k, -1),), k.extent - 1)]
    ok = True
    for lo_c in lowers:
        for up_c in uppers:
            gap = lo_c.without(k) + up_c.without(k)  # u(row) − l(row)
            ok = xp.logical_and(ok, _extreme(gap, box, read_value, xp, upper=False) >= 0)
    for c in guard.conds:
        if c.coeff(k) == 0:
            ok = xp.logical_and(ok, _extreme(c, box, read_value, xp, upper=False) >= 0)
    empty = False
    for lo, hi in box.values():
        empty = xp.logical_or(empty, lo > hi)
    return xp.logical_or(ok, empty)


def _div(x, d: int, xp):
    """x // d for x ≥ 0."""
    if xp is np or isinstance(x, (int, np.integer, np.ndarray)):
        return np.asarray(x) // d if isinstance(x, np.ndarray) else x // d
    from jax import lax

    return lax.div(x, xp.asarray(d, x.dtype))


def tile_span(skip: Skip, tile: int, ntiles: int, box, read_value, xp, guard_ok=True):
    """(first tile, number of tiles) of ``skip.var`` a program with rows ``box`` walks: from
    the least lower bound to the greatest upper bound over its rows (kept bounds only where
    ``guard_ok``), clipped to the axis; none where a row condition (``Skip.rows``) fails at
    every row of the box (a kept one: where ``guard_ok``)."""
    w = skip.var
    lo, hi = 0, w.extent - 1
    for b, kept in zip(skip.bounds, skip.kept):
        cw = b.coeff(w)
        ext = _extreme(b.without(w), box, read_value, xp, upper=True)
        val = -ext if cw > 0 else ext  # w ≥ −rest  or  w ≤ rest, at its loosest over the rows
        if cw > 0:
            new = xp.maximum(lo, val)
        else:
            new = xp.minimum(hi, val)
        if kept:
            new = xp.where(guard_ok, new, lo if cw > 0 else hi)
        if cw > 0:
            lo = new
        else:
            hi = new
    lo = xp.clip(lo, 0, w.extent - 1)
    empty = hi < lo  # no w kept (hi may be negative: a part wholly past a length)
    for c, kept in zip(skip.rows, skip.rows_kept):  # fails at every row: the identity at every w
        fails = _extreme(c, box, read_value, xp, upper=True) < 0
        empty = xp.logical_or(empty, xp.logical_and(fails, guard_ok) if kept else fails)
    hi = xp.clip(hi, 0, w.extent - 1)
    # both ≥ 0 here: a truncating division is the floor (Triton lowers jnp's floor_divide of
    # integers wrongly: a bool subtracted from an i32)
    first = _div(lo, tile, xp)
    last = _div(hi, tile, xp)
    count = xp.where(empty, 0, last - first + 1)
    return first, xp.clip(count, 0, ntiles)


def interior_tiles(bounds, w: Var, tile: int, box, read_value, xp):
    """[first, end) of the tiles of w on which every bound (an ``Affine`` ≥ 0, coefficient ±1
    on w) holds at every point of the tile and of the rows ``box``: w ≥ −rest needs the tile's
    first w to clear the largest −rest over the rows, w ≤ rest its last w (the tile's padding
    included) to stay under the least rest. There c ? x : y is x (``Skip.interior``)."""
    lo, hi = 0, None  # the least and the greatest w every bound admits, for every row
    for b in bounds:
        cw = b.coeff(w)
        rest = _extreme(b.without(w), box, read_value, xp, upper=False)
        if cw > 0:
            lo = xp.maximum(lo, -rest)
        else:
            hi = rest if hi is None else xp.minimum(hi, rest)
    # both ≥ 0 after the clip: truncating division is the floor (see ``tile_span``)
    first = _div(xp.clip(lo, 0, w.extent) + (tile - 1), tile, xp)
    ntiles = -(-w.extent // tile)
    end = ntiles if hi is None else _div(xp.clip(hi + 1, 0, ntiles * tile), tile, xp)
    return first, xp.maximum(end, first)


def _known(a: Affine, values) -> bool:
    """Can the model evaluate the affine form ``a``: each term an index variable, or a runtime
    scalar read from arrays whose ``values`` it was given (sequence lengths)."""
    return all(isinstance(t, Var) or (values is not None and all(r.array in values for r in D.walk(t) if isinstance(r, D.Read)))
               for t, _ in a.terms)


def _form_vars(forms) -> set:
    """The index variables affine forms name, those a runtime scalar is read at included."""
    out: set = set()
    for a in forms:
        for t, _ in a.terms:
            out |= {t} if isinstance(t, Var) else set(t.free)
    return out


def _reader(values, box):
    """``read_value`` for the model: a runtime scalar's ``Extent`` over each program's rows of
    ``box`` (the scalar evaluated from ``values`` by the reference evaluator, then its least
    and greatest over each program's [lo, hi] of every variable it is read at); None without
    ``values``."""
    if values is None:
        return None
    import jax.numpy as jnp

    from moajax.reference import Evaluator

    ev = Evaluator({k: jnp.asarray(v) for k, v in values.items()})
    shape = np.broadcast_shapes(*(np.shape(x) for pair in box.values() for x in pair))

    def read(t):
        named = ev(t)
        data = np.asarray(named.data)
        ranges = [tuple(np.broadcast_to(np.asarray(x), shape) for x in box[v]) for v in named.vars]
        lo, hi = np.empty(shape, data.dtype), np.empty(shape, data.dtype)
        for p in np.ndindex(shape):
            piece = data[tuple(slice(int(a[p]), min(int(b[p]), v.extent - 1) + 1)
                               for (a, b), v in zip(ranges, named.vars))]
            lo[p], hi[p] = piece.min(), piece.max()
        return Extent(lo, hi)

    return read


def masked_fraction(onf: ONF, skip: Skip, *, values=None, vectorised=()) -> float:
    """The share of (program, tile) pairs of ``skip.var`` whose tiles evaluate the mask: every
    visited one, or — ``skip.interior`` — only those outside the interior (``interior_tiles``;
    ``values`` and ``vectorised`` as ``visited_fraction``'s: bounds that read a runtime scalar
    not given are left out, the model taking them as keeping all)."""
    visited = visited_fraction(onf, skip, values=values, vectorised=vectorised)
    w = skip.var
    axis = onf.axis_of(w)
    static = [b for b in skip.bounds if _known(b, values)]
    if not skip.interior or visited == 0.0 or axis.role != "sequential" or axis.ntiles <= 1 or not static:
        return visited
    rows = tuple(c for c in skip.rows if _known(c, values))
    # one set of variables for both boxes: their arrays span the same grid tiles
    vars_ = _form_vars(static + list(rows)) - {w}
    inner = _grid_box(onf, vars_, vectorised, padded=True)
    first, end = interior_tiles(static, w, axis.tile, inner, _reader(values, inner), np)
    sk = dataclasses.replace(skip, bounds=tuple(static), kept=(False,) * len(static), guard=None, rows=rows,
                             rows_kept=(False,) * len(rows))
    # the interior lies inside the visited span of the exact bounds (the guard only widens it)
    outer = _grid_box(onf, vars_ | {w}, vectorised)
    vfirst, vcount = tile_span(sk, axis.tile, axis.ntiles, outer, _reader(values, outer), np)
    inside = np.clip(np.minimum(end, vfirst + vcount) - np.maximum(first, vfirst), 0, None)
    return max(0.0, visited - float(np.mean(inside)) / axis.ntiles)


def _grid_box(onf: ONF, vars_, vectorised=(), padded=False) -> dict:
    """[lo, hi] of each variable over every program at once (arrays over the grid tiles of
    the grid variables among them, ``meshgrid`` order by name), the rest over all of it —
    a grid variable named in ``vectorised`` too (XLA's programs along it run at once, so
    their walks are one, over every row); ``padded``: a grid tile's padding past the extent
    counted in."""
    grid = sorted((v for v in vars_ if onf.axis_of(v).role == "grid" and v.name not in vectorised),
                  key=lambda v: v.name)
    mesh = np.meshgrid(*[np.arange(onf.axis_of(v).ntiles) for v in grid], indexing="ij") if grid else []
    box = {}
    for v in vars_:
        axis = onf.axis_of(v)
        if v in grid:
            i = mesh[grid.index(v)]
            t = axis.tile
            box[v] = (i * t, (i + 1) * t - 1 if padded else np.minimum((i + 1) * t, v.extent) - 1)
        elif padded and axis.role == "grid":  # one program over every tile, their padding too
            box[v] = (0, axis.padded - 1)
        else:
            box[v] = (0, v.extent - 1)
    return box


def visited_fraction(onf: ONF, skip: Skip, *, values=None, vectorised=()) -> float:
    """The share of (program, tile) pairs of ``skip.var`` its loops visit, over every program
    (the grid tiles of the row variables its bounds name). ``values``: {input name: array} of
    the runtime scalars bounds read (sequence lengths, as a call passes them); a bound or
    guard condition that reads one not given is taken as keeping everything. ``vectorised``:
    the grid axes whose programs walk as one (XLA's, outside its ``cpu_loop``): each walks the
    tiles any of them needs."""
    w = skip.var
    axis = onf.axis_of(w)
    if axis.role != "sequential" or axis.ntiles <= 1:
        return 1.0
    known = lambda a: _known(a, values)  # noqa: E731
    keep = [(b, k) for b, k in zip(skip.bounds, skip.kept) if known(b)]
    rows = [(c, k) for c, k in zip(skip.rows, skip.rows_kept) if known(c)]
    if not keep and not rows:
        return 1.0
    guard = skip.guard
    if isinstance(guard, RowGuard):  # the model takes rows as keeping keys (the statistics are data)
        guard = None
        keep, rows = [(b, False) for b, _ in keep], [(c, False) for c, _ in rows]
    elif guard is not None:
        guard = Guard(guard.var, tuple(c for c in guard.conds if known(c)), tuple(c for c in guard.exempt if known(c)))
    sk = Skip(skip.stage, w, tuple(b for b, _ in keep), tuple(k for _, k in keep), guard, skip.of,
              rows=tuple(c for c, _ in rows), rows_kept=tuple(k for _, k in rows))
    vars_ = _form_vars(sk.bounds + sk.rows + ((guard.conds + guard.exempt) if guard is not None else ()))
    box = _grid_box(onf, vars_, vectorised)
    read = _reader(values, box)
    ok = guard_holds(guard, box, read, np) if any(sk.kept + sk.rows_kept) else True
    _, count = tile_span(sk, axis.tile, axis.ntiles, box, read, np, ok)
    return float(np.mean(count)) / axis.ntiles


__all__ = ["derive_skip", "dead_rows", "visited_fraction", "masked_fraction", "interior_tiles", "Extent", "skips", "guard_holds", "tile_span",
           "linear", "comparison", "conjuncts", "held", "COMPARISONS"]
