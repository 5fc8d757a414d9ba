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
import math
from typing import Iterable

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


@dataclasses.dataclass(frozen=True)
class Stage:
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

    def exprs(self) -> tuple:
        return (self.body,)

    def result_vars(self, name: str) -> tuple:
        return self.vars

    @property
    def index_vars(self) -> tuple:
        """Every variable a result of this stage is indexed by."""
        return tuple(self.vars)

    def dtype(self, name: str):
        return self.body.dtype

    def text(self, ctx=None) -> str:
        idx = ", ".join(v.name for v in self.vars)
        where = "" if self.place == "local" else "   ⟨memory⟩"
        return f"{self.name}[{idx}] = {D.show(self.body, ctx)}{where}"


@dataclasses.dataclass(frozen=True)
class OnlineStage:
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
    def reduction(self):
        return None

    def exprs(self) -> tuple:
        return (self.logit,) + tuple(s[2] for s in self.sums)

    @property
    def index_vars(self) -> tuple:
        """Every variable a result of this stage is indexed by (the max's, then the sums')."""
        vs = list(self.max_vars)
        for _, svs, _ in self.sums:
            vs += [v for v in svs if v not in vs]
        return tuple(vs)

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

    def exprs(self) -> Iterable[D.Expr]:
        for s in self.stages:
            yield from (e for e in s.exprs() if e is not None)

    def vars(self) -> set[Var]:
        out: set[Var] = set()
        for s in self.stages:
            if isinstance(s, Stage):
                out |= set(s.vars)
            else:
                out |= set(s.max_vars) | {s.var}
                for _, vs, _ in s.sums:
                    out |= set(vs)
            for e in s.exprs():
                if e is None:
                    continue
                for x in D.walk(e):
                    out |= set(x.free)
                    if isinstance(x, D.Red):
                        out.add(x.var)
        return out


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

    def text(self) -> str:
        if self.role == "whole" and self.tile == self.extent:
            return f"{self.name}<{self.extent} whole"
        tail = f", tail {self.tail}" if self.has_tail else ""
        return f"{self.name}<{self.extent} {self.role} ⟨{self.ntiles} × {self.tile}⟩{tail}"


@dataclasses.dataclass(frozen=True)
class Knobs:
    """Backend knobs. GPU (Triton): num_warps, num_stages. CPU (XLA): ``cpu_loop`` grid axes
    walked by an outer sequential loop (the rest of the grid is vectorised), and
    ``lowp_dots``: contract a float32 factor with a 16-bit operand in 16 bits (float32 sums)."""

    num_warps: int = 4
    num_stages: int = 2
    cpu_loop: tuple = ()
    lowp_dots: bool = False

    def text(self) -> str:
        parts = [f"num_warps {self.num_warps}", f"num_stages {self.num_stages}"]
        if self.cpu_loop:
            parts.append(f"cpu_loop {' '.join(self.cpu_loop)}")
        if self.lowp_dots:
            parts.append("lowp_dots")
        return ", ".join(parts)


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

    # ---- lookups
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

    def gamma_of(self, name: str) -> str:
        return dict(self.gamma).get(name, "C")

    def accumulation(self, stage: str) -> str | None:
        """How programs combine their partials of ``stage`` ("atomic"), or None (one owner)."""
        return dict(self.accumulate).get(stage)

    def scatter_var(self, stage) -> Var | None:
        """The grid variable an atomically accumulated stage's top reduction runs over."""
        if self.accumulation(stage.name) is None or not isinstance(stage, Stage) or stage.accumulated is None:
            return None
        v = stage.accumulated.var
        return v if self.axis_of(v).role == "grid" else None

    @property
    def grid(self) -> tuple:
        return tuple(a.name for a in self.axes if a.role == "grid")

    @property
    def sequential(self) -> tuple:
        return tuple(a.name for a in self.axes if a.role == "sequential")

    @property
    def carry(self) -> dict:
        """How each softmax-style reduction is carried: "online" (fused, one pass) or "passes"."""
        out = {}
        for s in self.program.stages:
            if isinstance(s, OnlineStage):
                out[s.max_name] = "online"
            elif isinstance(s, Stage) and s.reduction is not None and s.reduction.monoid == "max":
                out[s.name] = "passes"
        return out

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
    def validate(self, machine=None) -> "ONF":
        """Raise ONFError on anything a backend could not run as written; returns self."""
        names = [a.name for a in self.axes]
        if len(set(names)) != len(names):
            raise ONFError(f"{self.dnf.name}: an axis is listed twice in {names}")
        prog_vars = {v.name: v for v in self.program.vars()}
        for a in self.axes:
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
        if machine is not None:
            from moajax import cost

            fp = cost.onchip_bytes(self)
            limit = machine.onchip_limit_bytes
            if limit and fp > limit:
                raise ONFError(
                    f"{self.dnf.name}: on-chip footprint {fp / 1024:.1f} KB per program exceeds the "
                    f"{limit / 1024:.1f} KB of {machine.name} (smaller tiles, or recompute instead of store)"
                )
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
            if not (isinstance(st, Stage) and st.name == name):
                raise ONFError(f"{self.dnf.name}: {name!r} is not a plain stage; only a stage's top reduction accumulates")
            if st.place != "memory" and name not in outputs:
                raise ONFError(f"{self.dnf.name}: {name!r} accumulates {how}ally, so it must live in memory (an output or a memory stage)")
            red = st.accumulated
            if red is None or red.monoid != "add" or self.axis_of(red.var).role != "grid":
                raise ONFError(
                    f"{self.dnf.name}: {name!r} accumulates {how}ally, but its top level is not a +-reduction "
                    "over a grid axis (nothing crosses programs)"
                )

    def _validate_program(self):
        self._validate_accumulate()
        seen: set[str] = set()
        for s in self.program.stages:
            if s.place not in PLACES:
                raise ONFError(f"{self.dnf.name}: stage {s.name!r} has place {s.place!r}; places are {PLACES}")
            scatter = s.accumulated if isinstance(s, Stage) and self.scatter_var(s) is not None else None
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
                            and x is not scatter):
                        raise ONFError(
                            f"{self.dnf.name}: axis {x.var.name!r} is reduced in stage {s.name!r} but is a grid axis; "
                            "a program cannot reduce across programs (make it sequential or whole)"
                        )
            if isinstance(s, OnlineStage) and self.axis_of(s.var).role == "grid":
                raise ONFError(f"{self.dnf.name}: axis {s.var.name!r} is carried online in {s.name!r} but is a grid axis")
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
