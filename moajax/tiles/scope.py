"""Scopes: where a value is computed, and computed once.

A program is a tree of scopes: the root holds the ranges of the variables the program owns
(its grid tile, whole axes); a loop body is a child scope that sets the range of its loop
variable (one tile) — or a scope that adds the ranges of variables taken whole. Ranges never
change once a scope exists: a new range is a new child.

Memoisation: a value is computed once per scope. A child defers to its parent for every
expression that uses none of the variables the child sets, so a loop-invariant value is
found outside the loop; and ``hoist`` computes such values in the parent *before* a loop is
traced (loop-invariant code motion). A value computed while tracing a loop body stays in
that body's scope: stored in an enclosing one it would leak out of the loop's trace.

Stage values follow the same rule (``stage_value``): a stage computed in a scope is seen by
its children that keep the ranges of the stage's variables; a value held in memory
(``stages.InMemory``, windowed by the reader) is seen everywhere.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Mapping

from moajax import dnf as D
from moajax.ix import Var
from moajax.onf import ONF
from moajax.tiles.ranges import Range


@dataclasses.dataclass
class ProgramState:
    """What every scope of one program shares: the ONF, the backend, the canonical axis
    order, the definitions of the stages this program computes (``defs``: name → stage),
    and the stage values it starts with (``values``: name → ``InMemory``, the stages in memory)."""

    onf: ONF
    backend: object
    defs: dict
    values: dict

    @property
    def rank(self) -> dict:
        return self.backend.rank


class Scope:
    """Ranges (read-only), a parent, and the memo of values computed here."""

    def __init__(self, state: ProgramState, ranges: Mapping, parent: "Scope | None" = None,
                 holds: frozenset = frozenset()):
        self.state = state
        self.parent = parent
        self.sets = frozenset(ranges) if parent is not None else frozenset()
        # affine conditions (``Affine`` ≥ 0) true at every point of this scope's ranges: the
        # bounds of a masked walk in its interior tiles (``skipping.walk``); they use the
        # variables this scope sets, so no value memoised outside depends on them. An enclosing
        # scope's hold on a variable this one sets anew is dropped: it was proven over the
        # other range (a walk over every key tile, nested in the interior of a walk over query
        # tiles that a program owning key tiles runs: the fused backward's row statistics)
        inherited = frozenset() if parent is None else frozenset(
            h for h in parent.holds if not (h.vars() & self.sets))
        self.holds: frozenset = holds | inherited
        full = dict(parent.ranges) if parent is not None else {}
        full.update(ranges)
        if parent is None:
            # whole axes have one range everywhere: define it once, at the root, so that any
            # subexpression over them can be evaluated (and hoisted) outside every loop
            for v in state.onf.program.vars():
                if state.onf.axis_of(v).role == "whole" and v not in full:
                    full[v] = state.backend.whole(v)
        self.ranges: Mapping[Var, Range] = types.MappingProxyType(full)
        self.memo: dict = {}
        self.values: dict = dict(state.values) if parent is None else {}  # stage name → value

    @property
    def onf(self) -> ONF:
        return self.state.onf

    @property
    def backend(self):
        return self.state.backend

    @property
    def rank(self) -> dict:
        return self.state.rank

    def child(self, ranges: Mapping, holds: frozenset = frozenset()) -> "Scope":
        """A scope inside this one with ``ranges`` set (a loop body: its variable's tile), where
        the conditions ``holds`` are known true besides the enclosing ones."""
        return type(self)(self.state, ranges, parent=self, holds=holds)

    def within(self, vars_) -> "Scope":
        """This scope, or a child that takes every variable of ``vars_`` without a range whole."""
        missing = {v: self.backend.whole(v) for v in vars_ if v not in self.ranges}
        return self.child(missing) if missing else self

    def range_of(self, v: Var) -> Range:
        r = self.ranges.get(v)
        if r is None:
            raise KeyError(f"index variable {v.name} has no range in this program")
        return r

    # ---- memoisation
    def depends(self, e: D.Expr) -> frozenset:
        """The variables whose ranges e's value depends on: its free ones, and those it
        reduces over (a reduction over a grid axis sums this program's tile of it)."""
        return D.mentioned_vars(e)

    def lookup(self, e: D.Expr):
        """A value of e computed here, or — if e depends on no variable this scope sets — in
        an enclosing scope (outside the loop)."""
        hit = self.memo.get(id(e))
        if hit is not None and hit[0] is e:
            return hit[1]
        if self.parent is not None and not (self.depends(e) & self.sets):
            return self.parent.lookup(e)
        return None

    def remember(self, e: D.Expr, value) -> None:
        # e is kept with its value: a node built during evaluation must not be collected and
        # its id reused by another node while the memo lives
        self.memo[id(e)] = (e, value)

    def stage_value(self, name: str, vars_):
        """The value of stage ``name`` (indexed by ``vars_``) visible here, or None."""
        from moajax.tiles.stages import InMemory

        blocked = False
        scope = self
        while scope is not None:
            val = scope.values.get(name)
            if val is not None and (not blocked or isinstance(val, InMemory)):
                return val
            if val is not None:
                return None  # computed over other ranges of its variables: recompute here
            blocked = blocked or bool(scope.sets & set(vars_))
            scope = scope.parent
        return None

    # ---- loop-invariant code motion
    def eval(self, e: D.Expr):  # pragma: no cover - interface (TileEval)
        raise NotImplementedError

    def hoist(self, exprs, v: Var) -> None:
        """Evaluate here, before a loop over v is traced, the largest subexpressions of
        ``exprs`` that do not use v and whose variables all have ranges here — looking into
        the definitions of the local stages they read over v as well (a row statistic a
        stage over v needs is computed once, outside the loop)."""
        done: set = set()
        defs = self.state.defs

        def go(e):
            if id(e) in done:
                return
            done.add(id(e))
            if v not in self.depends(e):
                if not isinstance(e, (D.Lit, D.IndexValue)) and all(x in self.ranges for x in e.free):
                    self.eval(e)
                    return
            if isinstance(e, D.Ref) and e.stage in defs:
                for x in defs[e.stage].exprs():
                    if x is not None:
                        go(x)
            for c in e.children:
                go(c)

        for e in exprs:
            if e is not None:
                go(e)
