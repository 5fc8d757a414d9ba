"""The Operational Normal Form: how a DNF runs on one machine, as an immutable value.

An ONF pairs a DNF (what is computed, fixed) with a schedule (how):

* a **program** — the DNF's index functions arranged as ordered stages. A ``Stage`` is
  ``name[vars] = body``; a body whose top is a reduction op_{r<n} is walked over r. An
  ``OnlineStage`` carries ⌈_r f and Σ_r exp(f − ⌈f)·gᵢ in one pass (running max, rescaling).
  Later stages read earlier ones through ``Ref``. Rewrites (``moajax.rewrites``) change the
  program and always keep the DNF's meaning.
* **axes** — the dimension lifting of each index variable: tile size, tail policy (pad and
  mask, or refuse) and role: ``grid`` (parallel programs over tiles), ``sequential`` (a loop
  over tiles inside a program) or ``whole`` (one tile).
* **γ** per input operand ("C" row-major, "F" column-major), **knobs** for the backends
  (num_warps, num_stages, CPU loop mapping), and the target machine profile.
* **accumulate** — who owns an output whose top reduction runs over a grid axis: with
  "atomic", every program adds its partial sum into the output in memory (scatter-add; the
  papers' fused backward accumulates dK and dV this way). Without it a program must own
  every element it writes, so a reduction may not cross programs.

``ONF.validate`` raises ``ONFError`` naming the problem; ``pretty()`` prints the schedule.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Iterable

import numpy as np

from moajax import dnf as D
from moajax.ix import Var


class ONFError(ValueError):
    """An ONF that cannot be run as written (names the problem)."""


ROLES = ("grid", "sequential", "whole")
ACCUMULATE = ("atomic",)
TAILS = ("pad", "refuse")
GAMMAS = ("C", "F")
PLACES = ("local", "memory")


# ----------------------------------------------------------------------------- program


class StageBase:
    """What every stage of a program answers, whatever its form (``Stage``, ``OnlineStage``).

    ``defines`` the names it computes (``result_vars``, ``dtype`` per name); ``exprs`` its
    expressions; ``walks`` the variable its pass runs over (None: no pass); ``carry`` how a
    softmax-style reduction is carried ("online", "passes", or None); ``accumulated`` the top
    +-reduction programs may scatter-add (None: not one); ``map_exprs`` the same stage with
    every expression rewritten; ``all_vars`` every index variable it mentions."""

    name: str
    place: str

    @property
    def defines(self) -> tuple:  # pragma: no cover - interface
        raise NotImplementedError

    def exprs(self) -> tuple:  # pragma: no cover - interface
        raise NotImplementedError

    def result_vars(self, name: str) -> tuple:  # pragma: no cover - interface
        raise NotImplementedError

    def dtype(self, name: str):  # pragma: no cover - interface
        raise NotImplementedError

    def map_exprs(self, fn) -> "StageBase":  # pragma: no cover - interface
        raise NotImplementedError

    @property
    def walks(self) -> Var | None:  # pragma: no cover - interface
        raise NotImplementedError

    @property
    def carry(self) -> str | None:  # pragma: no cover - interface
        raise NotImplementedError

    @property
    def reduction(self) -> D.Red | None:
        return None

    @property
    def accumulated(self) -> D.Red | None:
        return None

    @property
    def index_vars(self) -> tuple:
        """Every variable a result of this stage is indexed by (first result's first)."""
        vs: list = []
        for n in self.defines:
            vs += [v for v in self.result_vars(n) if v not in vs]
        return tuple(vs)

    def all_vars(self) -> set:
        """Every index variable the stage mentions: its results', and its expressions' free
        and reduced variables."""
        out = set(self.index_vars)
        if self.walks is not None:
            out.add(self.walks)
        for e in self.exprs():
            if e is not None:
                out |= D.mentioned_vars(e)  # every node's free variables are e's or bound in it
        return out


@dataclasses.dataclass(frozen=True)
class Stage(StageBase):
    """``name[vars] = body``; where the body's top is a reduction, the stage walks its variable.

    ``place``: "local" (lives inside each program, over the program's tile: registers,
    shared memory or cache) or "memory" (materialised in main memory by its own kernel).
    """

    name: str
    vars: tuple
    body: D.Expr
    place: str = "local"

    @property
    def defines(self) -> tuple:
        return (self.name,)

    @property
    def reduction(self) -> D.Red | None:
        return self.body if isinstance(self.body, D.Red) else None

    @property
    def accumulated(self) -> D.Red | None:
        """The top reduction of the stage, looking through a final dtype conversion (a 16-bit
        output whose partials add up in float32)."""
        b = self.body.arg if isinstance(self.body, D.Convert) else self.body
        return b if isinstance(b, D.Red) else None

    @property
    def walks(self) -> Var | None:
        return self.reduction.var if self.reduction is not None else None

    @property
    def carry(self) -> str | None:
        return "passes" if self.reduction is not None and self.reduction.monoid == "max" else None

    def exprs(self) -> tuple:
        return (self.body,)

    def map_exprs(self, fn) -> "Stage":
        return dataclasses.replace(self, body=fn(self.body))

    def result_vars(self, name: str) -> tuple:
        return self.vars

    def dtype(self, name: str):
        return self.body.dtype

    def text(self, ctx=None) -> str:
        idx = ", ".join(v.name for v in self.vars)
        where = "" if self.place == "local" else "   ⟨memory⟩"
        return f"{self.name}[{idx}] = {D.show(self.body, ctx)}{where}"


@dataclasses.dataclass(frozen=True)
class OnlineStage(StageBase):
    """One pass over r for  m[vₘ] = ⌈_r f  and  aᵢ[vᵢ] = Σ_r exp(f − m)·gᵢ.

    The carried state (m, a…) forms a monoid: (m₁,a₁)⊕(m₂,a₂) = (m, a₁e^{m₁−m} + a₂e^{m₂−m})
    with m = max(m₁, m₂), so tiles of r combine in any order (split-K included).
    """

    max_name: str
    max_vars: tuple
    var: Var
    logit: D.Expr
    sums: tuple  # ((name, vars, weight Expr), ...)
    place: str = "local"

    @property
    def name(self) -> str:
        return self.max_name

    @property
    def defines(self) -> tuple:
        return (self.max_name,) + tuple(s[0] for s in self.sums)

    @property
    def walks(self) -> Var:
        return self.var

    @property
    def carry(self) -> str:
        return "online"

    def exprs(self) -> tuple:
        return (self.logit,) + tuple(s[2] for s in self.sums)

    def map_exprs(self, fn) -> "OnlineStage":
        return dataclasses.replace(self, logit=fn(self.logit),
                                   sums=tuple((n, vs, None if w is None else fn(w)) for n, vs, w in self.sums))

    def result_vars(self, name: str) -> tuple:
        if name == self.max_name:
            return self.max_vars
        for n, vs, _ in self.sums:
            if n == name:
                return vs
        raise KeyError(name)

    def dtype(self, name: str):
        if name == self.max_name:
            return self.logit.dtype
        for n, _, w in self.sums:
            if n == name:
                return self.logit.dtype if w is None else w.dtype
        raise KeyError(name)

    def text(self, ctx=None) -> str:
        r = f"{self.var.name}<{self.var.extent}"
        mv = ", ".join(v.name for v in self.max_vars)
        f = D.show(self.logit, ctx)
        lines = [f"online over {r}:  {self.max_name}[{mv}] = ⌈_{{{r}}} {f}"]
        for n, vs, w in self.sums:
            g = "1" if w is None else D.show(w, ctx)
            lines.append(f"      {n}[{', '.join(v.name for v in vs)}] = Σ_{{{r}}} exp({f} − {self.max_name}) × {g}")
        return "\n    ".join(lines)


@dataclasses.dataclass(frozen=True)
class Program:
    """Ordered stages; ``outputs`` names the stage holding each DNF output."""

    stages: tuple
    outputs: tuple  # ((output name, stage name), ...)

    def stage_of(self, name: str):
        for s in self.stages:
            if name in s.defines:
                return s
        raise KeyError(name)

    def names(self) -> list[str]:
        return [n for s in self.stages for n in s.defines]

    def reads(self, names, within=None) -> set:
        """The names of the stages ``names`` read, directly or not, ``names`` among them (those
        defined here; with ``within``, only through the names it holds)."""
        defs = {n: s for s in self.stages for n in s.defines}
        keep = defs if within is None else {n: s for n, s in defs.items() if n in within}
        seen, todo = set(), [n for n in names if n in keep]
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            for e in keep[n].exprs():
                if e is not None:
                    todo += [x.stage for x in D.walk(e) if isinstance(x, D.Ref) and x.stage in keep]
        return seen

    def apart(self, a, b, within=None) -> bool:
        """Must stages ``a`` and ``b`` run in loops of their own: does one read the other
        (through the stages ``within``)?"""
        return b.name in self.reads([a.name], within) - {a.name} or a.name in self.reads([b.name], within) - {b.name}

    def exprs(self) -> Iterable[D.Expr]:
        for s in self.stages:
            yield from (e for e in s.exprs() if e is not None)

    def vars(self) -> set[Var]:
        out: set[Var] = set()
        for s in self.stages:
            out |= s.all_vars()
        return out

    def walked(self) -> list:
        """The variables the stages walk (top-level reductions and online passes), in order."""
        out = []
        for s in self.stages:
            if s.walks is not None and s.walks not in out:
                out.append(s.walks)
        return out

    def dot_batches(self) -> set:
        """The batch variables of the program's contractions: u such that some Σ_v a × b (two
        factors reading v) has u free in both a and b, and none has it in one factor only —
        attention's head n in S[t n s] = Σ_h Q[t n h] × K[s n h]. A dot takes them as its
        batch; laid out after its rows they cost a transpose of every result (on a CPU:
        ``Knobs.cpu_batches``). A layout hint: sums of three or more factors reading v, and an
        online pass's sums, are not looked at."""
        both: set = set()
        one: set = set()
        for e in self.exprs():
            for x in D.walk(e):
                if isinstance(x, D.Red) and x.monoid == "add":
                    sides = [f.free - {x.var} for f in D.product_factors(D.unlabelled(x.body)) if x.var in f.free]
                    if len(sides) == 2:
                        both |= sides[0] & sides[1]
                        one |= sides[0] ^ sides[1]
        return both - one

    def batch_walks(self) -> set:
        """The walks Σ_b that are a batch of a longer sum inside: Σ_b Σ_s f where every input
        f reads along s it reads along b too — each b its own contraction over s (a vmap's
        summed batch around attention's keys: dQ = Σ_b Σ_s dS[b t s] × K[b s h], where K
        is read along both and Q along neither). Laid out as the batch it is, not a walk."""
        out = set()
        for st in self.stages:
            v = st.walks
            if v is None:
                continue
            for e in st.exprs():
                if e is None:
                    continue
                reads = [x for x in D.walk(e) if isinstance(x, D.Read)]
                for x in D.walk(e):
                    if isinstance(x, D.Red) and x.var != v and x.var.extent > v.extent:
                        along = [r for r in reads if x.var in r.free]
                        if along and all(v in r.free for r in along):
                            out.add(v)
        return out


# ----------------------------------------------------------------------------- masked tiles


def _term_key(t) -> tuple:
    return (0, t.name, "") if isinstance(t, Var) else (1, t.array, str(t.index))


@dataclasses.dataclass(frozen=True)
class Affine:
    """Σ cᵢ·xᵢ + k ≥ 0 over integers: each xᵢ an index variable or a runtime integer scalar
    (a ``Read``, e.g. a batch element's sequence length ⟨b⟩ψlengths)."""

    terms: tuple  # ((Var | D.Read, int), ...)
    const: int

    def coeff(self, x) -> int:
        return sum(c for t, c in self.terms if t == x)

    def without(self, x) -> "Affine":
        return Affine(tuple((t, c) for t, c in self.terms if t != x), self.const)

    def __add__(self, other: "Affine") -> "Affine":
        acc: dict = {}
        for t, c in self.terms + other.terms:
            acc[t] = acc.get(t, 0) + c
        keep = sorted(((t, c) for t, c in acc.items() if c), key=lambda tc: _term_key(tc[0]))
        return Affine(tuple(keep), self.const + other.const)

    def vars(self) -> set:
        out = set()
        for t, _ in self.terms:
            out |= {t} if isinstance(t, Var) else set(t.free)
        return out

    def text(self) -> str:
        parts = []
        for t, c in self.terms:
            name = t.name if isinstance(t, Var) else D.show(t)
            parts.append(("+ " if c > 0 else "− ") + (name if abs(c) == 1 else f"{abs(c)}·{name}"))
        if self.const or not parts:
            parts.append(("+ " if self.const >= 0 else "− ") + str(abs(self.const)))
        s = " ".join(parts)
        return (s[2:] if s.startswith("+ ") else "−" + s[2:]) + " ≥ 0"


_CMP = {"lt": (1, -1, -1), "le": (1, -1, 0), "gt": (-1, 1, -1), "ge": (-1, 1, 0)}  # y·a + x·b + k ≥ 0
COMPARISONS = tuple(_CMP)


def linear(e: D.Expr) -> Affine | None:
    """e as Σ cᵢ·xᵢ + k (index variables, runtime integer scalars), or None."""
    while isinstance(e, (D.Tag, D.Convert)):
        if isinstance(e, D.Convert) and np.dtype(e.dtype).kind not in "iu":
            return None
        e = e.children[0]
    if isinstance(e, D.IndexValue):
        terms = []
        for atom, c in e.ix.terms:
            if not isinstance(atom, Var):
                return None  # ⌊·/d⌋, mod: not affine
            terms.append((atom, int(c)))
        return Affine(tuple(terms), int(e.ix.const))
    if isinstance(e, D.Lit) and np.dtype(e.dtype).kind in "iu":
        return Affine((), int(e.value))
    if isinstance(e, D.Read) and np.dtype(e.dtype).kind in "iu":
        return Affine(((e, 1),), 0)
    if isinstance(e, D.Call) and e.op in ("add", "sub"):
        a, b = (linear(c) for c in e.children)
        if a is None or b is None:
            return None
        if e.op == "sub":
            b = Affine(tuple((t, -c) for t, c in b.terms), -b.const)
        return a + b
    return None


def comparison(c: D.Expr) -> Affine | None:
    """An affine comparison x ⋈ y as one condition ≥ 0 (integers: x < y is y − x − 1 ≥ 0)."""
    if not (isinstance(c, D.Call) and c.op in _CMP):
        return None
    x, y = (linear(a) for a in c.children)
    if x is None or y is None:
        return None
    sy, sx, k = _CMP[c.op]
    scale = lambda a, s: Affine(tuple((t, s * v) for t, v in a.terms), s * a.const)  # noqa: E731
    return scale(y, sy) + scale(x, sx) + Affine((), k)  # (sums are kept in one term order)


def conjuncts(c: D.Expr) -> list:
    """The conditions a conjunction c₁ ∧ c₂ ∧ … is made of."""
    if isinstance(c, D.Call) and c.op == "logical_and":
        return [x for a in c.children for x in conjuncts(a)]
    return [c]


@dataclasses.dataclass(frozen=True)
class Guard:
    """∀ rows ∃ ``var``: every condition holds — each row keeps a key. ``exempt`` conditions
    name rows whose contributions are 0 whatever the skip (they are left out of the check)."""

    var: Var
    conds: tuple  # Affine, each with coefficient 0 or ±1 on var
    exempt: tuple = ()

    def text(self) -> str:
        keep = " ∧ ".join(c.text() for c in self.conds)
        out = f"every row keeps some {self.var.name}: {keep}"
        return out + (f" (exempt rows: ¬({' ∧ '.join(c.text() for c in self.exempt)}))" if self.exempt else "")


@dataclasses.dataclass(frozen=True)
class RowGuard:
    """∀ rows: X > m₀/2 for each statistic X — each row keeps a key, read from the statistics
    its softmax computed (the row max or log-sum-exp; m₀ the mask fill ``fill``): the guard of a
    mask on data (a bool ``mask``, a score_mod's −∞), which no affine condition decides. A row
    with no key kept has X = m₀ (its every score is m₀); where X > m₀/2, exp(m₀ − X) = 0 exactly;
    a row that keeps a key whose every score lies below m₀/2 fails the check, and walks every
    tile — never a wrong answer. ``stats`` empty: the online pass's own running max, checked
    after its walk of the bounded tiles; a row still at m₀ there kept no key, and takes what
    walking every tile gives it: max m₀, every weight 1 (``tiles.online``). ``exempt``:
    comparisons whose failure makes a row's every term 0, skip or not (rows past a query
    length), or leaves a row that nothing reads (an online pass's dead rows, ``dead_rows``):
    those rows pass."""

    stats: tuple  # D.Expr, each read at rows
    fill: float
    exempt: tuple = ()  # D.Expr, comparisons over rows

    @property
    def threshold(self) -> float:
        return self.fill / 2

    def text(self) -> str:
        xs = ", ".join(D.show(x) for x in self.stats) if self.stats else "the running max, after the walk"
        out = f"every row keeps a key: {xs} > m₀/2"
        return out + (f" (exempt rows: ¬({' ∧ '.join(D.show(c) for c in self.exempt)}))" if self.exempt else "")


@dataclasses.dataclass(frozen=True)
class Skip:
    """The tiles of the walked variable ``var`` that a reduction ``of`` in stage ``stage`` (its
    top one, one nested in it, or an online pass's logit) leaves out: outside every
    ``bounds`` condition (coefficient ±1 on var) its body is the monoid's identity, so a program
    walks only the tiles between the least lower and the greatest upper bound over its rows.
    A bound marked in ``kept`` is exact only for rows that keep a key (exp(m₀ − max) = 0 for
    the mask fill m₀); it is used where ``guard`` holds for the program's rows, else every tile
    is walked (a ``RowGuard``, over a mask on data: the rows' statistics decide). ``of`` is
    the expression the skip was derived for (the stage's reduction or online logit): a
    rewrite that changes it invalidates the skip (``ONF.validate``).
    ``interior`` (``rewrites.unmask_interior``): the tiles where every bound holds over the
    whole tile and all the program's rows are walked in a loop of their own that takes the
    bounds as true — c ? x : y is x there, no comparison and no select per element; only the
    boundary tiles (a causal walk's diagonal ones) evaluate the mask.
    ``rows``: conditions on the rows alone (coefficient 0 on var: a query row inside its
    length, t < ⟨b⟩ψL) outside which the body is the identity at every w: a program where one
    fails at every row walks no tile — dQ's programs past a query length, whose cotangent rows
    are 0. One marked in ``rows_kept`` is exact only for rows that keep a key, as a kept bound:
    it empties the walk only where ``guard`` holds (dV's key tiles past a key length walk no
    query where every query keeps a key: exp(m₀ − lse) = 0 there). One marked in ``rows_dead``
    holds for another reason: what the stage computes is read nowhere at the rows failing it
    (``dead_rows``: the forward's rows past a query length, out = (t < L) ? … : 0), a
    fact of the program around the stage, which ``ONF.validate`` derives again."""

    stage: str
    var: Var
    bounds: tuple  # Affine
    kept: tuple  # bool per bound
    guard: Guard | RowGuard | None
    of: D.Expr
    interior: bool = False
    rows: tuple = ()  # Affine, coefficient 0 on var
    rows_kept: tuple = ()  # bool per row condition
    rows_dead: tuple = ()  # bool per row condition (empty: none dead)

    @property
    def dead(self) -> tuple:
        """The row conditions marked in ``rows_dead``."""
        return tuple(c for c, d in zip(self.rows, self.rows_dead) if d)

    def text(self) -> str:
        b = ", ".join([a.text() + (" ⁽ᵏ⁾" if k else "") for a, k in zip(self.bounds, self.kept)]
                      + [f"{'dead rows' if a in self.dead else 'rows'}: {a.text()}" + (" ⁽ᵏ⁾" if k else "")
                         for a, k in zip(self.rows, self.rows_kept)])
        g = f"; ⁽ᵏ⁾ where {self.guard.text()}" if any(self.kept + self.rows_kept) else ""
        i = "; interior tiles unmasked" if self.interior else ""
        return f"{self.stage} over {self.var.name}: {b}{g}{i}"


# ----------------------------------------------------------------------------- schedule


@dataclasses.dataclass(frozen=True)
class Axis:
    """The lifting of one index variable: extent s split into ⟨⌈s/tile⌉, tile⟩."""

    name: str
    extent: int
    tile: int
    role: str = "whole"
    tail: str = "pad"

    @property
    def ntiles(self) -> int:
        return max(1, -(-self.extent // self.tile))

    @property
    def padded(self) -> int:
        return self.ntiles * self.tile

    @property
    def has_tail(self) -> bool:
        return self.extent % self.tile != 0

    def whole_size(self, pow2: bool = False) -> int:
        """The length of a range covering the whole axis at once: every tile of a lifted axis
        (⌈s/tile⌉·tile), or a ``whole`` axis in its one tile (which may exceed s: padded);
        ``pow2`` rounds it up to a power of two (Triton's block shapes)."""
        n = self.padded if self.role != "whole" else max(self.tile, self.extent)
        return next_pow2(n) if pow2 else n

    @property
    def block(self) -> int:
        """The length one program (or one loop step) sees of the axis: a tile, or all of a
        ``whole`` axis."""
        return self.whole_size() if self.role == "whole" else self.tile

    def text(self) -> str:
        if self.role == "whole" and self.tile == self.extent:
            return f"{self.name}<{self.extent} whole"
        tail = f", tail {self.tail}" if self.has_tail else ""
        return f"{self.name}<{self.extent} {self.role} ⟨{self.ntiles} × {self.tile}⟩{tail}"


@dataclasses.dataclass(frozen=True)
class Knobs:
    """Backend knobs. GPU (Triton): num_warps, num_stages. CPU (XLA): ``cpu_loop`` grid axes
    walked by an outer sequential loop (the rest of the grid is vectorised), and
    ``lowp_dots``: contract a float32 factor with a 16-bit operand in 16 bits (float32 sums).
    ``dot_precision``: "highest" (float32 dots in IEEE float32, the knob's default) or
    "tensorfloat32" (float32 dot operands rounded to TF32 on a GPU's tensor cores; relative
    errors near 1e-3 instead of 1e-6; the CPU's XLA dots stay float32). A GPU ONF of a float32
    kernel derived without a Preset's choice takes it from ``jax.default_matmul_precision``,
    as XLA's float32 dots do (``compat.default_dot_precision``): TF32 under JAX's default,
    IEEE under "highest".
    ``dot_layout`` (a GPU's 2-D tile dots; XLA's einsum gives its result in tile order either
    way): "operands" (the default) — Σ_v a·b is dot(a, b) as the DNF writes the factors, the
    result transposed into the program's tile order after (on Triton a layout conversion of
    the accumulator); "tile" — dot(a, b) or dot(b, a), whichever gives the result in tile
    order, its rows the axis the program owns. Attention's dK/dV kernel computes its scores
    as Q·Kᵀ under "operands": 32-row dots where it walks 32 queries, below the 64 rows of
    Hopper's wgmma, so ptxas gets Ampere's mma.sync for them; "tile" gives K·Qᵀ, 64 rows.
    Not the default until a GPU times it: offline, ptxas' registers move both ways with it
    (bench/results/gpu_backward_sweep_ptx_sm_90a.md).
    ``cpu_batches`` (CPU, XLA): walks held whole that are a batch of the sums inside
    (``Program.batch_walks``: a vmap's summed batch around attention's keys), and axes held
    whole that are the dots' batch (``Program.dot_batches``: the heads of attention's Δ
    kernel), laid out with the batch-like grid axes, before the rows (``tiles.ranges.var_order``). ``cpu_vectorised``
    (CPU, XLA): the program walks nothing in tiles, one vectorised computation, so a grid axis
    that is an output's last stays last, with the whole axes (``ONF.axis_order``). Either takes
    effect only while it holds: a later rewrite (split_k, a tile that walks) leaves it unused."""

    num_warps: int = 4
    num_stages: int = 2
    cpu_loop: tuple = ()
    lowp_dots: bool = False
    dot_precision: str = "highest"
    dot_layout: str = "operands"
    cpu_batches: tuple = ()
    cpu_vectorised: bool = False

    def __post_init__(self):
        if self.dot_precision not in DOT_PRECISIONS:
            raise ValueError(f"Knobs: dot_precision must be one of {DOT_PRECISIONS}, got {self.dot_precision!r}")
        if self.dot_layout not in DOT_LAYOUTS:
            raise ValueError(f"Knobs: dot_layout must be one of {DOT_LAYOUTS}, got {self.dot_layout!r}")

    def text(self) -> str:
        parts = [f"num_warps {self.num_warps}", f"num_stages {self.num_stages}"]
        if self.cpu_loop:
            parts.append(f"cpu_loop {' '.join(self.cpu_loop)}")
        if self.cpu_batches:
            parts.append(f"cpu_batches {' '.join(self.cpu_batches)}")
        if self.cpu_vectorised:
            parts.append("cpu_vectorised")
        if self.lowp_dots:
            parts.append("lowp_dots")
        if self.dot_precision != "highest":
            parts.append(f"{self.dot_precision} dots")
        if self.dot_layout != "operands":
            parts.append(f"dots in {self.dot_layout} layout")
        return ", ".join(parts)


DOT_PRECISIONS = ("highest", "tensorfloat32")
DOT_LAYOUTS = ("operands", "tile")


@dataclasses.dataclass(frozen=True)
class ONF:
    """A DNF with its schedule for one machine. Immutable; rewrites return new ONFs."""

    dnf: D.DNF
    program: Program
    axes: tuple  # Axis per index variable that is tiled or placed
    gamma: tuple = ()  # ((input name, "C"|"F"), ...)
    knobs: Knobs = Knobs()
    target: str = "generic"
    history: tuple = ()
    accumulate: tuple = ()  # ((stage name, "atomic"), ...)
    skips: tuple = ()  # Skip per stage whose masked tiles are left out (``rewrites.skip_masked``)

    # ---- lookups
    def axis_order(self, vectorised: bool | None = None) -> dict:
        """The canonical order of tile arrays' axes (name → position; ``tiles.ranges.var_order``):
        batch-like grid axes (tile 1) first, then the tiled grid axes, then sequential, then
        whole ones, each group in output-variable order (then by name). The walks the knob
        ``cpu_batches`` names (a batch walk held whole: ``Program.batch_walks``, a vmap's summed
        batch around the keys; a dot's batch held whole: ``Program.dot_batches``) go with the
        batch-like axes: a batch dimension of the dots
        inside, they come before their rows (laid out after them, a vmapped attention's dQ
        transposed its [t, n, b, s] scores twice and ran at 0.72× the same call on broadcast
        queries). Under the knob ``cpu_vectorised`` (``vectorised``: as if set) — a CPU program
        walking nothing in tiles, one vectorised computation — a grid axis that is an output's
        last stays with the whole axes, in the outputs' order: RMSNorm's fused dX and dW as
        [n, d], where the programs' d first transposed x, dO and dX, the minor axis of each
        (bench/results/cpu_order_cpu.md). Other grid axes keep their place (attention's
        adjoint owning key rows, its scores laid out [t, s], ran 0.87× as fast as with [s, t])."""
        names = [v.name for v in self.dnf.output_vars]
        for v in sorted(self.program.vars(), key=lambda v: v.name):
            if v.name not in names:
                names.append(v.name)
        # (knobs a later rewrite left stale take no effect: split_k's partials walk no batch, a
        # tile made sequential walks)
        batches = {v.name for v in self.program.batch_walks() | self.program.dot_batches()
                   if v.name in self.knobs.cpu_batches
                   and self.axis_of(v).role == "whole"} if self.knobs.cpu_batches else set()
        flat = (self.knobs.cpu_vectorised if vectorised is None else vectorised) and not any(
            a.role == "sequential" for a in self.axes)
        minor = {o.vars[-1].name for o in self.dnf.outputs if o.vars} if flat else set()

        def key(n):
            a = next((x for x in self.axes if x.name == n), None)
            role = a.role if a is not None else "whole"
            group = {"grid": 0 if (a is not None and a.tile == 1) else 1, "sequential": 2, "whole": 3}[role]
            if n in batches:
                group = 0
            elif group == 1 and n in minor:
                group = 3
            return (group, names.index(n))

        return {n: i for i, n in enumerate(sorted(names, key=key))}

    def axis(self, name: str) -> Axis:
        for a in self.axes:
            if a.name == name:
                return a
        raise KeyError(name)

    def axis_of(self, v: Var) -> Axis:
        """The lifting of v (a variable not listed runs whole)."""
        for a in self.axes:
            if a.name == v.name:
                return a
        return Axis(v.name, v.extent, max(v.extent, 1), "whole", "pad")

    def skip_of(self, stage: str, var: Var | None = None) -> Skip | None:
        """The masked tiles the walk of ``stage`` (its top reduction or online pass) leaves
        out — or, with ``var``, its tile-by-tile writes over ``var`` (a scatter-added stage).
        None: it walks every tile."""
        st = self.program.stage_of(stage)
        top = st.logit if isinstance(st, OnlineStage) else (st.accumulated if var is not None else st.reduction)
        for sk in self.skips:
            walk = var if var is not None else (top.var if isinstance(top, D.Red) else sk.var)
            if sk.stage == st.name and top is not None and sk.of is top and sk.var == walk:
                return sk
        return None

    def gamma_of(self, name: str) -> str:
        return dict(self.gamma).get(name, "C")

    def written_over(self, vars_) -> Var | None:
        """The axis a program writes a result indexed by ``vars_`` over, tile by tile: the
        first sequential one (a scatter-added stage's partials), else None (written whole)."""
        return next((v for v in vars_ if self.axis_of(v).role == "sequential"), None)

    def shared_walk(self, st) -> Var | None:
        """The sequential variable a local stage's top reduction walks in more than one tile,
        where the stage can share that loop with its siblings (``tiles.stages.together``: a
        tile computes what their bodies share once), else None: an online pass, a stage in
        memory, or one whose programs add their partials (those join as written outputs)."""
        red = st.reduction if isinstance(st, Stage) else None
        if red is None or st.place == "memory" or self.accumulation(st.name) is not None:
            return None
        a = self.axis_of(red.var)
        return red.var if a.role == "sequential" and a.ntiles > 1 else None

    def written_walking(self) -> tuple:
        """The stages written to memory (outputs, memory stages) while their programs walk
        more than one of their own axes in sequence, each with those axes. A GPU program walks
        at most one: its tiles of a result are written from one loop."""
        outputs = {sname for _, sname in self.program.outputs}
        found = []
        for st in self.program.stages:
            seq = [v.name for v in st.index_vars if self.axis_of(v).role == "sequential"]
            if (st.name in outputs or st.place == "memory") and len(seq) > 1:
                found.append((st.name, tuple(seq)))
        return tuple(found)

    def rows_across_walks(self) -> tuple:
        """The local stages that hold a row across a walk: indexed by a sequential variable
        that a stage reading them reduces over (in any reduction of its body, or its pass), so
        that each tile of the walk reads its own part of a row computed before it. A stage
        written tile by tile (an output, a memory stage) is not one. XLA holds such a row as an
        array; a GPU program has no indexable on-chip scratch for it (``rewrites.place``: in
        memory)."""
        outputs = {sname for _, sname in self.program.outputs}
        seq = {a.name for a in self.axes if a.role == "sequential"}
        found = []
        for st in self.program.stages:
            over = {v for v in st.index_vars if v.name in seq}
            if st.place != "local" or set(st.defines) & outputs or not over:
                continue
            for reader in self.program.stages:
                walked = {x.var for e in reader.exprs() if e is not None for x in D.walk(e) if isinstance(x, D.Red)}
                walked |= {reader.walks} - {None}
                # (an online pass is read by any of its results: its max, or a sum)
                reads = any(isinstance(x, D.Ref) and x.stage in st.defines
                            for e in reader.exprs() if e is not None for x in D.walk(e))
                if reads and over & walked:
                    found.append((st.name, tuple(sorted(v.name for v in over & walked))))
                    break
        return tuple(found)

    def accumulation(self, stage: str) -> str | None:
        """How programs combine their partials of ``stage`` ("atomic"), or None (one owner)."""
        return dict(self.accumulate).get(stage)

    def scatter_var(self, stage) -> Var | None:
        """The grid variable an atomically accumulated stage's top reduction runs over."""
        if self.accumulation(stage.name) is None or stage.accumulated is None:
            return None
        v = stage.accumulated.var
        return v if self.axis_of(v).role == "grid" else None

    def scatter_chain(self, stage) -> tuple:
        """Σ_r Σ_b … g, the leading +-reductions of a scatter-added stage over grid variables
        (r = ``scatter_var`` first): each program adds its partial over its own tiles of them
        all (a table's gradient, summed over the batch and heads that own programs beside the
        query tiles); () for a stage that does not scatter."""
        if self.scatter_var(stage) is None:
            return ()
        chain, red = [stage.accumulated], stage.accumulated.body
        while (isinstance(red, D.Red) and red.monoid == "add" and self.axis_of(red.var).role == "grid"
               and all(red.var != x.var for x in chain)):
            chain.append(red)
            red = red.body
        return tuple(chain)

    def scatter_vars(self, stage) -> tuple:
        """The grid variables of ``scatter_chain``: the programs' tiles a partial is summed over."""
        return tuple(x.var for x in self.scatter_chain(stage))

    def rows_walked_once(self, r: Var) -> bool:
        """Do the programs' rows r run in one walk on a CPU: r walked tile by tile (the cpu_loop
        knob), or held in one tile (one program owns every row)? XLA then computes the outputs
        the programs own and those they scatter-add over r in one walk of each row tile,
        sharing its values (``lower_xla._one_pass``)."""
        return r.name in self.knobs.cpu_loop or self.axis_of(r).ntiles == 1

    @property
    def grid(self) -> tuple:
        return tuple(a.name for a in self.axes if a.role == "grid")

    @property
    def sequential(self) -> tuple:
        return tuple(a.name for a in self.axes if a.role == "sequential")

    @property
    def carry(self) -> dict:
        """How each softmax-style reduction is carried: "online" (fused, one pass) or "passes"."""
        return {s.name: s.carry for s in self.program.stages if s.carry is not None}

    @property
    def store(self) -> dict:
        """Per labelled DNF subexpression: "recompute", "onchip" (a local stage) or "memory"."""
        labels = set()
        for o in self.dnf.outputs:
            labels |= {x.label for x in D.walk(o.body) if isinstance(x, D.Tag)}
        out = {lab: "recompute" for lab in sorted(labels)}
        for s in self.program.stages:
            if isinstance(s, Stage) and s.name in out:
                out[s.name] = "onchip" if s.place == "local" else "memory"
        return out

    def replace(self, *, note: str | None = None, **changes) -> "ONF":
        new = dataclasses.replace(self, **changes)
        if note:
            new = dataclasses.replace(new, history=self.history + (note,))
        return new

    # ---- printing
    def pretty(self) -> str:
        lines = [f"ONF {self.dnf.name} for {self.target}"]
        if self.history:
            lines.append(f"  rewrites: {' → '.join(self.history)}")
        lines.append("  γ:      " + ", ".join(f"{i.name} {self.gamma_of(i.name)}" for i in self.dnf.inputs))
        lines.append("  axes:   " + " | ".join(a.text() for a in self.axes))
        lines.append(f"  carry:  {', '.join(f'{k} {v}' for k, v in self.carry.items()) or '—'}")
        st = self.store
        lines.append(f"  store:  {', '.join(f'{k} {v}' for k, v in st.items()) or '—'}")
        if self.accumulate:
            lines.append("  accumulate: " + ", ".join(f"{k} {v}" for k, v in self.accumulate))
        for sk in self.skips:
            lines.append(f"  skip:   {sk.text()}")
        lines.append(f"  knobs:  {self.knobs.text()}")
        lines.append("  program:")
        ctx = D.ShowContext()
        for s in self.program.stages:
            lines.append(f"    {s.text(ctx)}")
        for oname, sname in self.program.outputs:
            if oname != sname:
                lines.append(f"    {oname} = {sname}")
        return "\n".join(lines + ctx.where())

    __str__ = pretty

    # ---- validation
    def validate(self) -> "ONF":
        """Raise ONFError on anything a backend could not run as written; returns self.
        (Whether it fits a machine's on-chip memory is the cost model's question:
        ``moajax.cost.check_fits``.)"""
        names = [a.name for a in self.axes]
        if len(set(names)) != len(names):
            raise ONFError(f"{self.dnf.name}: an axis is listed twice in {names}")
        prog_vars, extents = {}, {}
        for v in sorted(self.program.vars()):
            prog_vars.setdefault(v.name, v)
            extents.setdefault(v.name, []).append(v.extent)
        for a in self.axes:
            # an axis is looked up by its variable's name (``axis_of``): variables of two extents
            # under a listed name would share its tiling — wrong values if let through (ψ-reduction
            # names them apart: ``psi.Reducer.claim``); one not listed runs whole, as each is
            if len(extents.get(a.name, ())) > 1:
                raise ONFError(f"{self.dnf.name}: axis {a.name!r} names index variables of extents "
                               f"{extents[a.name]}; a name must denote one axis")
            if a.name not in prog_vars:
                raise ONFError(f"{self.dnf.name}: unknown axis {a.name!r}; the program's index variables are {sorted(prog_vars)}")
            if prog_vars[a.name].extent != a.extent:
                raise ONFError(f"{self.dnf.name}: axis {a.name!r} has extent {a.extent}, the DNF says {prog_vars[a.name].extent}")
            if a.role not in ROLES:
                raise ONFError(f"{self.dnf.name}: axis {a.name!r} has role {a.role!r}; roles are {ROLES}")
            if a.tail not in TAILS:
                raise ONFError(f"{self.dnf.name}: axis {a.name!r} has tail policy {a.tail!r}; policies are {TAILS}")
            if not isinstance(a.tile, int) or a.tile < 1:
                raise ONFError(f"{self.dnf.name}: axis {a.name!r} has tile {a.tile!r}; a tile is a positive int")
            if a.has_tail and a.tail == "refuse":
                raise ONFError(
                    f"{self.dnf.name}: tile {a.tile} does not divide extent {a.extent} of axis {a.name!r} "
                    "and its tail policy is 'refuse' (use tail='pad' to pad and mask)"
                )
        inputs = {i.name for i in self.dnf.inputs}
        for name, g in self.gamma:
            if name not in inputs:
                raise ONFError(f"{self.dnf.name}: γ names unknown operand {name!r}; operands are {sorted(inputs)}")
            if g not in GAMMAS:
                raise ONFError(f"{self.dnf.name}: γ of {name!r} is {g!r}; layouts are 'C' (row-major) and 'F' (column-major)")
        if self.knobs.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ONFError(f"{self.dnf.name}: num_warps {self.knobs.num_warps} is not a power of two ≤ 32")
        if self.knobs.num_stages < 1:
            raise ONFError(f"{self.dnf.name}: num_stages {self.knobs.num_stages} must be ≥ 1")
        for n in self.knobs.cpu_loop:
            if n not in names or self.axis(n).role != "grid":
                raise ONFError(f"{self.dnf.name}: cpu_loop axis {n!r} is not a grid axis")
        self._validate_program()
        return self

    def _cross_program(self, red: D.Red) -> bool:
        """Does every value this reduction reads along its (grid) variable come from a stage in
        memory (e.g. split-K partials)? Only then may it reduce over a grid axis."""
        ok = True
        for x in D.walk(red.body):
            if isinstance(x, (D.Read, D.Ref)) and red.var in x.free:
                ok = ok and isinstance(x, D.Ref) and self.program.stage_of(x.stage).place == "memory"
        return ok

    def _validate_accumulate(self):
        outputs = {sname for _, sname in self.program.outputs}
        for name, how in self.accumulate:
            if how not in ACCUMULATE:
                raise ONFError(f"{self.dnf.name}: accumulation {how!r} of {name!r}; accumulations are {ACCUMULATE}")
            try:
                st = self.program.stage_of(name)
            except KeyError:
                raise ONFError(f"{self.dnf.name}: accumulate names unknown stage {name!r}") from None
            if not (isinstance(st, Stage) and st.name == name):  # one result, one body
                raise ONFError(f"{self.dnf.name}: {name!r} is not a plain stage; only a stage's top reduction accumulates")
            if st.place != "memory" and name not in outputs:
                raise ONFError(f"{self.dnf.name}: {name!r} accumulates {how}ally, so it must live in memory (an output or a memory stage)")
            red = st.accumulated
            if red is None or red.monoid != "add" or self.axis_of(red.var).role != "grid":
                raise ONFError(
                    f"{self.dnf.name}: {name!r} accumulates {how}ally, but its top level is not a +-reduction "
                    "over a grid axis (nothing crosses programs)"
                )

    def _validate_skips(self):
        for sk in self.skips:
            try:
                st = self.program.stage_of(sk.stage)
            except KeyError:
                raise ONFError(f"{self.dnf.name}: a skip names unknown stage {sk.stage!r}") from None
            # a reduction's skip holds wherever that reduction is (it is a fact of its body);
            # an online pass's is a fact of the whole logit
            if isinstance(sk.of, D.Red):
                walked = sk.of.var == sk.var or (sk.of is st.accumulated and sk.var in st.result_vars(st.name))
                ok = walked and any(x is sk.of for e in st.exprs() if e is not None for x in D.walk(e))
            else:
                ok = isinstance(st, OnlineStage) and st.var == sk.var and st.logit is sk.of
            if not ok:
                raise ONFError(
                    f"{self.dnf.name}: the skip of {sk.stage!r} was derived for another expression than the stage "
                    "now holds (a rewrite changed it after skip_masked): derive the skip again")
            if len(sk.kept) != len(sk.bounds) or any(abs(b.coeff(sk.var)) != 1 for b in sk.bounds):
                raise ONFError(f"{self.dnf.name}: the skip of {sk.stage!r} has a bound that does not bound {sk.var.name}")
            if any(c.coeff(sk.var) != 0 for c in sk.rows) or len(sk.rows_kept) != len(sk.rows):
                raise ONFError(f"{self.dnf.name}: the skip of {sk.stage!r} has a row condition that reads {sk.var.name}")
            if sk.rows_dead and (len(sk.rows_dead) != len(sk.rows)
                                 or any(d and k for d, k in zip(sk.rows_dead, sk.rows_kept))):
                raise ONFError(f"{self.dnf.name}: the skip of {sk.stage!r} marks its dead rows amiss")
            if (isinstance(sk.guard, RowGuard) and not sk.guard.stats and sk.guard.exempt
                    and not {comparison(a) for a in sk.guard.exempt} <= set(sk.dead)):
                raise ONFError(f"{self.dnf.name}: the skip of {sk.stage!r} exempts rows from its running max's "
                               "check that are not its dead rows: derive the skip again")
            if sk.dead:
                live = [c for c in sk.dead if c not in dead_rows(self, st)]
                if live:
                    raise ONFError(f"{self.dnf.name}: the skip of {sk.stage!r} leaves out the rows where "
                                   f"{live[0].text()} fails, which the program reads: derive the skip again")
            if any(sk.kept + sk.rows_kept) and sk.guard is None:
                raise ONFError(f"{self.dnf.name}: the skip of {sk.stage!r} relies on kept keys but has no guard")
            if isinstance(sk.guard, RowGuard) and not sk.guard.stats and not (isinstance(st, OnlineStage)
                                                                              and st.logit is sk.of):
                raise ONFError(f"{self.dnf.name}: the skip of {sk.stage!r} checks a running max after its walk, "
                               "which only an online pass carries")

    def _validate_program(self):
        self._validate_accumulate()
        self._validate_skips()
        seen: set[str] = set()
        for s in self.program.stages:
            if s.place not in PLACES:
                raise ONFError(f"{self.dnf.name}: stage {s.name!r} has place {s.place!r}; places are {PLACES}")
            scatter = {id(x) for x in self.scatter_chain(s)}
            for e in s.exprs():
                if e is None:
                    continue
                for x in D.walk(e):
                    if isinstance(x, D.Ref):
                        if x.stage not in seen:
                            raise ONFError(f"{self.dnf.name}: stage {s.name!r} reads {x.stage!r} before it is computed")
                        want = self.program.stage_of(x.stage).result_vars(x.stage)
                        got = tuple(i.as_var() for i in x.index)
                        if got != tuple(want):
                            raise ONFError(
                                f"{self.dnf.name}: stage {s.name!r} reads {x.stage!r} at "
                                f"⟨{' '.join(map(str, x.index))}⟩; only its own index ⟨{' '.join(v.name for v in want)}⟩ is supported"
                            )
                    if (isinstance(x, D.Red) and self.axis_of(x.var).role == "grid" and not self._cross_program(x)
                            and id(x) not in scatter):
                        raise ONFError(
                            f"{self.dnf.name}: axis {x.var.name!r} is reduced in stage {s.name!r} but is a grid axis; "
                            "a program cannot reduce across programs (make it sequential or whole)"
                        )
            if s.carry == "online" and self.axis_of(s.walks).role == "grid":
                raise ONFError(f"{self.dnf.name}: axis {s.walks.name!r} is carried online in {s.name!r} but is a grid axis")
            for n in s.defines:
                if n in seen:
                    raise ONFError(f"{self.dnf.name}: stage name {n!r} is defined twice")
                seen.add(n)
        outs = {o.name for o in self.dnf.outputs}
        mapped = {o for o, _ in self.program.outputs}
        if outs != mapped:
            raise ONFError(f"{self.dnf.name}: the program computes outputs {sorted(mapped)}, the DNF has {sorted(outs)}")
        for o, sname in self.program.outputs:
            if sname not in seen:
                raise ONFError(f"{self.dnf.name}: output {o!r} maps to unknown stage {sname!r}")


def guarded_reads(e: D.Expr, hit, atoms: dict | None = None) -> list | None:
    """(x, the row conditions around it) for each leaf x of e that ``hit(x)`` picks (True),
    the conditions a set of affine ones (``Affine``):

        c ? x : y  reads x only where c holds

    so a read inside x is guarded by the conjuncts of c (those ``comparison`` sees as affine;
    t < 5 and t ≤ 4 are one). None where ``hit(x)`` is None for a picked leaf (a read at
    another index than its rows). ``atoms``: each condition's first comparison, as a select
    holds it (``D.Expr``), is recorded there. Each (subexpression, conditions) is walked
    once: the hash-consed DNF shares subexpressions."""
    out: list = []
    seen: set = set()
    stack = [(e, frozenset())]
    while stack:
        x, conds = stack.pop()
        if (id(x), conds) in seen:
            continue
        seen.add((id(x), conds))
        picked = hit(x)
        if picked is None:
            return None
        if picked:
            out.append((x, conds))
            continue
        if isinstance(x, D.Call) and x.op == "where":
            taken = set()
            for a in conjuncts(x.children[0]):
                c = comparison(a)
                if c is not None:
                    taken.add(c)
                    if atoms is not None:
                        atoms.setdefault(c, a)
            stack += [(x.children[0], conds), (x.children[1], conds | taken), (x.children[2], conds)]
            continue
        stack += [(c, conds) for c in x.children]
    return out


def dead_rows(onf: ONF, st) -> tuple:
    """``dead_row_conditions`` as affine conditions (``Affine``), each once."""
    return tuple(sorted({comparison(a) for a in dead_row_conditions(onf, st)}, key=lambda c: c.text()))


def dead_row_conditions(onf: ONF, st) -> tuple:
    """The row conditions c (affine comparisons, over variables of the rows of stage ``st``)
    at whose failing rows nothing reads what ``st`` computes:

        c ? x : y  reads x only where c holds

    so a value every read of which lies in such an x — or in a stage whose own values are dead
    there — is dead where c fails: the forward's online pass at rows past a query length
    (out = (t < ⟨b⟩ψL) ? sum_s3 ÷ sum_s : 0). A read at other than the reader's own index
    (a shift, a gather) or a stage that holds an output (the caller reads it; a saving
    forward's statistics) leaves none. Conditions meet as affine forms (t < 5 and t ≤ 4 are
    one); each is returned as a select holds it (a comparison, ``D.Expr``), in a fixed order."""
    prog = onf.program
    held = {stage for _, stage in prog.outputs}
    defs = {n: s for s in prog.stages for n in s.defines}
    memo: dict = {}
    atoms: dict = {}  # Affine → the first comparison found for it

    def meet(a, b):  # (None: read nowhere, dead under any condition)
        return b if a is None else a if b is None else a & b

    def own_rows(name):  # a read of ``name``'s values at its own rows; None at another index
        return lambda x: (None if tuple(ix.as_var() for ix in x.index) != tuple(defs[name].result_vars(name))
                          else True) if isinstance(x, D.Ref) and x.stage == name else False

    def dead(name):
        if name in memo:
            return memo[name]
        memo[name] = frozenset()  # (read by itself through a cycle: none)
        if defs[name].name in held or name in held:
            return memo[name]
        found = None
        for other in prog.stages:
            if other is defs[name]:
                continue  # (an online pass's sums read its own max)
            for e in other.exprs():
                reads = guarded_reads(e, own_rows(name), atoms) if e is not None else []
                if reads is None:
                    return memo[name]
                # a read in a stage whose values are all dead where c fails is dead there too
                later = functools.reduce(meet, (dead(n) for n in other.defines)) if reads else None
                for _, conds in reads:
                    found = meet(found, conds | (later or frozenset()))
        rows = set(defs[name].result_vars(name))
        memo[name] = None if found is None else frozenset(c for c in found if c.vars() <= rows)
        return memo[name]

    out = functools.reduce(meet, (dead(n) for n in st.defines))
    return tuple(atoms[c] for c in sorted(out or (), key=lambda c: c.text()))


def stage_vars(e: D.Expr, prefer: Iterable[Var] = ()) -> tuple:
    """The free variables of e, in ``prefer`` order first, then sorted by name."""
    prefer = list(prefer)
    free = set(e.free)
    first = [v for v in prefer if v in free]
    rest = sorted(free - set(first), key=lambda v: (v.name, v.extent))
    return tuple(first + rest)


def initial(dnf: D.DNF, target: str = "generic") -> ONF:
    """The unscheduled ONF: one stage per output holding the DNF body; every axis whole."""
    stages = tuple(Stage(o.name, o.vars, o.body) for o in dnf.outputs)
    prog = Program(stages, tuple((o.name, o.name) for o in dnf.outputs))
    return ONF(dnf, prog, axes=(), target=target)


def next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))
