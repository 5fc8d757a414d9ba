"""ψ-reduction: push ψ through every operation until only input arrays are indexed.

Each rule below rewrites ⟨p⟩ψ (op …) one step, into ψ of the operands at new indices:

    ψ-transpose    ⟨p⟩ψ ⍉σA        → ⟨q⟩ψ A,  q[σⱼ] = pⱼ
    ψ-take         ⟨i p…⟩ψ k△A      → ⟨i p…⟩ψ A  (k ≥ 0),  ⟨i + s₀−|k|, p…⟩ψ A  (k < 0)
    ψ-drop         ⟨i p…⟩ψ k▽A      → ⟨i + k, p…⟩ψ A  (k ≥ 0),  ⟨i p…⟩ψ A  (k < 0)
    ψ-reverse      ⟨i p…⟩ψ ΦA       → ⟨s₀−1−i, p…⟩ψ A
    ψ-rotate       ⟨i p…⟩ψ kΘA      → ⟨(i+k) mod s₀, p…⟩ψ A
    ψ-reshape      ⟨p⟩ψ ρ'ρ̂ A      → ⟨γ⁻¹(γ(p; ρ'); ρA)⟩ψ A
    ψ-catenate     ⟨i p…⟩ψ A⧺B      → i < a₀ ? ⟨i p…⟩ψA : ⟨i−a₀, p…⟩ψB
    ψ-psi          ⟨p⟩ψ (c ψ A)     → ⟨c ⧺ p⟩ψ A
    ψ-iota         ⟨i⟩ψ ιn          → i
    ψ-map          ⟨p⟩ψ f(A, B)     → f(⟨p⟩ψA, ⟨p⟩ψB)     (a scalar operand takes ⟨⟩)
    ψ-cast         ⟨p⟩ψ cast(A)     → cast(⟨p⟩ψA)
    ψ-outer        ⟨p q⟩ψ A op.× B  → ⟨p⟩ψA op ⟨q⟩ψB
    ψ-reduce       ⟨p⟩ψ op/A        → op_{l<a₀} ⟨l p⟩ψ A
    ψ-inner        ⟨p q⟩ψ A op₁.op₂ B → op₁_{l} (⟨p l⟩ψA op₂ ⟨l q⟩ψB)
    ψ-reduce-one   op/ or op₁.op₂ over one item (a₀ = 1) → that item, at l = 0 (no loop)
    ψ-fuse-sums    Σ_{l<n} a + Σ_{m<n} b → Σ_{l<n} c·(a' + b')  (c: the factors a and b share)
    ψ-omega        ⟨f c⟩ψ Ω f(A…)   → ⟨c⟩ψ f(□…) with each cell □ᵢ bound to ⟨f⟩ψ Aᵢ
    ψ-cell         ⟨c⟩ψ □ᵢ          → ⟨f ⧺ c⟩ψ Aᵢ
    ψ-name         ⟨p⟩ψ name(ℓ, A)  → ℓ: ⟨p⟩ψA   (a transparent label)
    (unlogged)     ⟨p⟩ψ stop(A)     → ⟨p⟩ψA       (constant only for moajax.adjoint)

The driver records which rule fired on which subterm (``Derivation``); the result is a
``moajax.dnf.DNF`` in which no intermediate array survives.

Index variables are named after dims, and within one DNF a name denotes one extent (an ONF
tiles an axis by its variable's name): k△A, k▽A and A⧺B keep A's dim name at another
extent, so the output axes are named first, after their dims, and a reduction whose dim
name some variable already holds at another extent takes another (n<5 beside n<2 → n1<5).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from moajax import dnf as D
from moajax import moa
from moajax.ix import Ix, Var
from moajax.moa import moa_str


@dataclasses.dataclass(frozen=True)
class Step:
    """One rule application: ``before`` (⟨p⟩ψ subterm) rewritten to ``after``."""

    rule: str
    before: str
    after: str
    depth: int


@dataclasses.dataclass(frozen=True)
class Derivation:
    """The ψ-reduction of a kernel, step by step."""

    name: str
    steps: tuple

    def rules_used(self) -> set[str]:
        return {s.rule for s in self.steps}

    def pretty(self, max_steps: int | None = None) -> str:
        lines = [f"derivation of {self.name}: {len(self.steps)} rule applications"]
        for n, s in enumerate(self.steps[:max_steps] if max_steps else self.steps, 1):
            pad = "  " * min(s.depth, 12)
            lines.append(f"{n:4d} {pad}[{s.rule}] {s.before}  ⇒  {s.after}")
        if max_steps and len(self.steps) > max_steps:
            lines.append(f"     … {len(self.steps) - max_steps} more")
        return "\n".join(lines)

    __str__ = pretty


def _ix_str(p) -> str:
    parts = [str(i) for i in p]
    return "⟨" + " ".join(x if " " not in x else f"({x})" for x in parts) + "⟩"


def _psi_str(p, node) -> str:
    return f"{_ix_str(p)}ψ {moa_str(node, limit=90)}"


def gamma_offset(p, shape, gamma: str) -> Ix:
    """γ(p; ρ): the offset of index p in a ``gamma`` ("C" row-major, "F" column-major) layout."""
    axes = range(len(shape)) if gamma == "C" else reversed(range(len(shape)))
    off = Ix.of(0)
    for a in axes:
        off = off * shape[a] + p[a]
    return off


def gamma_index(off: Ix, shape, gamma: str) -> tuple:
    """γ⁻¹(off; ρ): the index whose ``gamma`` offset is ``off``."""
    out = [None] * len(shape)
    stride = 1
    axes = reversed(range(len(shape))) if gamma == "C" else range(len(shape))
    for a in axes:
        out[a] = off.floordiv(stride).mod(shape[a]) if shape[a] != 1 else Ix.of(0)
        stride *= shape[a]
    return tuple(out)


class Reducer:
    """ψ-reduces one expression DAG; memoises on (node, index, cell bindings)."""

    def __init__(self, record: bool = True):
        self.steps: list[Step] = []
        self.record = record
        self.memo: dict = {}
        self._cells: dict = {}
        # the extent of each variable name this DNF uses: an ONF looks its axes up by name,
        # so one name must denote one extent (n<2 and n<5 would be one axis to it)
        self.extent_of: dict[str, int] = {}
        self.rules: dict[type, Callable] = {
            moa.Input: self.r_input,
            moa.Literal: self.r_literal,
            moa.Iota: self.r_iota,
            moa.Cell: self.r_cell,
            moa.Psi: self.r_psi,
            moa.Take: self.r_take,
            moa.Drop: self.r_drop,
            moa.Reverse: self.r_reverse,
            moa.Rotate: self.r_rotate,
            moa.Transpose: self.r_transpose,
            moa.Reshape: self.r_reshape,
            moa.Cast: self.r_cast,
            moa.Reduce: self.r_reduce,
            moa.Name: self.r_name,
            moa.StopGradient: self.r_stop,
            moa.Catenate: self.r_catenate,
            moa.Map: self.r_map,
            moa.Outer: self.r_outer,
            moa.Inner: self.r_inner,
            moa.Omega: self.r_omega,
        }
        self.depth = 0

    # ---- driver
    def psi(self, p: tuple, node: moa.Array, env: dict) -> D.Expr:
        p = tuple(Ix.of(i) for i in p)
        if len(p) != node.rank:
            raise AssertionError(f"ψ needs a full index: {len(p)} for rank {node.rank}")
        key = (node.uid, p, self._env_key(node, env))
        hit = self.memo.get(key)
        if hit is not None:
            return hit
        rule = self.rules[type(node)]
        self.depth += 1
        try:
            out = rule(p, node, env)
        finally:
            self.depth -= 1
        self.memo[key] = out
        return out

    def _env_key(self, node, env):
        """The bindings a subterm's reduction depends on: of its free cells, and — since a cell
        may be bound to an array that is itself a cell of an enclosing Ω — of theirs, in turn."""
        out, seen = [], set()
        stack = list(self.free_cells(node))
        while stack:
            c = stack.pop()
            if c in seen or c not in env:
                continue
            seen.add(c)
            arg, pre = env[c]
            out.append((c.uid, arg.uid, pre))
            stack.extend(self.free_cells(arg))
        return tuple(sorted(out))

    def free_cells(self, node) -> frozenset:
        """The Ω cells a subterm refers to (only those bindings can change its reduction)."""
        return moa.free_cells(node, self._cells)

    def log(self, rule: str, p, node, after):
        """Record a rule application; ``after`` is a thunk: the printed term is made only when
        the reduction is recorded."""
        if self.record:
            self.steps.append(Step(rule, _psi_str(p, node), after(), self.depth))

    def fresh(self, base: str, extent: int, p, env) -> Var:
        """A bound variable named after its dimension, distinct from every name in scope and
        from every name the DNF gives another extent."""
        taken = {v.name for i in p for v in i.free_vars()}
        for _, pre in env.values():
            taken |= {v.name for i in pre for v in i.free_vars()}
        return self.claim(base or "l", extent, taken)

    def claim(self, base: str, extent: int, taken=frozenset()) -> Var:
        """``base``, else base1, base2, … — the first name not in ``taken`` and not given to a
        variable of another extent in this DNF; it is this extent's from now on."""
        name, n = base, 0
        while name in taken or self.clashes(name, extent):
            n += 1
            name = f"{base}{n}"
        self.extent_of[name] = extent
        return Var(name, extent)

    def clashes(self, name: str, extent: int) -> bool:
        """Does the DNF already name a variable of another extent ``name``?"""
        return self.extent_of.get(name, extent) != extent

    # ---- rules
    def r_input(self, p, node, env):
        self.log("ψ-input", p, node, lambda: f"{_ix_str(p)}ψ{node.name}")
        return D.Read(node.name, p, node.dtype)

    def r_literal(self, p, node, env):
        return D.Lit(node.value, node.dtype)

    def r_iota(self, p, node, env):
        self.log("ψ-iota", p, node, lambda: str(p[0]))
        return D.IndexValue(p[0], node.dtype)

    def r_cell(self, p, node, env):
        arg, pre = env[node]
        q = pre + p
        self.log("ψ-cell", p, node, lambda: _psi_str(q, arg))
        return self.psi(q, arg, env)

    def r_psi(self, p, node, env):
        q = tuple(Ix.of(c) for c in node.index) + p
        self.log("ψ-psi", p, node, lambda: _psi_str(q, node.arg))
        return self.psi(q, node.arg, env)

    def r_take(self, p, node, env):
        k, s0 = node.count, node.arg.shape[0]
        q = p if k >= 0 else (p[0] + (s0 - abs(k)),) + p[1:]
        self.log("ψ-take", p, node, lambda: _psi_str(q, node.arg))
        return self.psi(q, node.arg, env)

    def r_drop(self, p, node, env):
        k = node.count
        q = ((p[0] + k,) + p[1:]) if k >= 0 else p
        self.log("ψ-drop", p, node, lambda: _psi_str(q, node.arg))
        return self.psi(q, node.arg, env)

    def r_reverse(self, p, node, env):
        s0 = node.arg.shape[0]
        q = ((s0 - 1) - p[0],) + p[1:]
        self.log("ψ-reverse", p, node, lambda: _psi_str(q, node.arg))
        return self.psi(q, node.arg, env)

    def r_rotate(self, p, node, env):
        s0 = node.arg.shape[0]
        k = node.shift % s0 if s0 else 0
        q = ((p[0] + k).mod(s0),) + p[1:]
        self.log("ψ-rotate", p, node, lambda: _psi_str(q, node.arg))
        return self.psi(q, node.arg, env)

    def r_transpose(self, p, node, env):
        q = [None] * len(p)
        for j, s in enumerate(node.perm):
            q[s] = p[j]
        q = tuple(q)
        self.log("ψ-transpose", p, node, lambda: _psi_str(q, node.arg))
        return self.psi(q, node.arg, env)

    def r_reshape(self, p, node, env):
        off = gamma_offset(p, node.shape, node.gamma)
        q = gamma_index(off, node.arg.shape, node.gamma)
        self.log("ψ-reshape", p, node, lambda: _psi_str(q, node.arg))
        return self.psi(q, node.arg, env)

    def r_cast(self, p, node, env):
        self.log("ψ-cast", p, node, lambda: f"{node.dtype.name}({_psi_str(p, node.arg)})")
        return D.Convert(self.psi(p, node.arg, env), node.dtype)

    def r_name(self, p, node, env):
        self.log("ψ-name", p, node, lambda: f"{node.label}: {_psi_str(p, node.arg)}")
        return D.Tag(node.label, self.psi(p, node.arg, env))

    def r_stop(self, p, node, env):
        # ψ passes through: "held constant" is a fact about derivatives, not values
        return self.psi(p, node.arg, env)

    def r_reduce(self, p, node, env):
        n = node.arg.shape[0]
        v = self.fresh(node.arg.dims[0], n, p, env)
        sym = node.monoid.symbol
        self.log("ψ-reduce", p, node, lambda: f"{sym}_{{{v.name}<{n}}} {_psi_str((Ix.of(v),) + p, node.arg)}")
        if n == 0:
            return D.Lit(node.monoid.identity(node.dtype).item(), node.dtype)
        if n == 1:  # op/ of one item is that item
            self.log("ψ-reduce-one", p, node, lambda: _psi_str((Ix.of(0),) + p, node.arg))
            return self.psi((Ix.of(0),) + p, node.arg, env)
        body = self.psi((Ix.of(v),) + p, node.arg, env)
        return D.Red(node.monoid.name, v, body)

    def r_inner(self, p, node, env):
        ra = node.a.rank
        n = node.a.shape[-1]
        v = self.fresh(node.a.dims[-1], n, p, env)
        pa = p[: ra - 1] + (Ix.of(v),)
        pb = (Ix.of(v),) + p[ra - 1:]
        self.log(
            "ψ-inner", p, node,
            lambda: (f"{node.monoid.symbol}_{{{v.name}<{n}}} ({_psi_str(pa, node.a)}) {node.op.symbol} "
                     f"({_psi_str(pb, node.b)})"),
        )
        if n == 0:
            return D.Lit(node.monoid.identity(node.dtype).item(), node.dtype)
        if n == 1:  # a sum of one product is that product
            pa, pb = p[: ra - 1] + (Ix.of(0),), (Ix.of(0),) + p[ra - 1:]
            self.log("ψ-reduce-one", p, node,
                     lambda: f"({_psi_str(pa, node.a)}) {node.op.symbol} ({_psi_str(pb, node.b)})")
            return D.Call(node.op.name, (self.psi(pa, node.a, env), self.psi(pb, node.b, env)))
        body = D.Call(node.op.name, (self.psi(pa, node.a, env), self.psi(pb, node.b, env)))
        return D.Red(node.monoid.name, v, body)

    def r_catenate(self, p, node, env):
        na = node.a.shape[0]
        qb = (p[0] - na,) + p[1:]
        lo, hi = p[0].bounds()
        self.log("ψ-catenate", p, node, lambda: f"{p[0]} < {na} ? {_psi_str(p, node.a)} : {_psi_str(qb, node.b)}")
        if hi < na:
            return self.psi(p, node.a, env)
        if lo >= na:
            return self.psi(qb, node.b, env)
        cond = D.Call("lt", (D.IndexValue(p[0], np.int32), D.Lit(int(na), np.int32)))
        return D.Call("where", (cond, self.psi(p, node.a, env), self.psi(qb, node.b, env)))

    def r_map(self, p, node, env):
        parts = [_psi_str(p if a.rank else (), a) for a in node.args]
        self.log("ψ-map", p, node, lambda: f"{node.op.symbol}({', '.join(parts)})")
        args = tuple(self.psi(p if a.rank else (), a, env) for a in node.args)
        if node.op.name == "add":
            fused = fuse_sums(*args, clash=self.clashes)
            if fused is not None:
                self.extent_of[fused.var.name] = fused.var.extent
                self.log("ψ-fuse-sums", p, node, lambda: "+/(A + B) for (+/A) + (+/B)")
                return fused
        return D.Call(node.op.name, args)

    def r_outer(self, p, node, env):
        ra = node.a.rank
        pa, pb = p[:ra], p[ra:]
        self.log("ψ-outer", p, node, lambda: f"({_psi_str(pa, node.a)}) {node.op.symbol} ({_psi_str(pb, node.b)})")
        return D.Call(node.op.name, (self.psi(pa, node.a, env), self.psi(pb, node.b, env)))

    def r_omega(self, p, node, env):
        nf = len(node.shape) - node.body.rank
        pf, pc = p[:nf], p[nf:]
        env2 = dict(env)
        for cell, arg, fr in zip(node.cells, node.args, node.frame):
            env2[cell] = (arg, pf if fr else ())
        binds = ", ".join(
            f"□{c.position}={_psi_str(pf if fr else (), a)}" for c, a, fr in zip(node.cells, node.args, node.frame)
        )
        self.log("ψ-omega", p, node, lambda: f"{_psi_str(pc, node.body)} with {binds}")
        return self.psi(pc, node.body, env2)


def fuse_sums(a: D.Expr, b: D.Expr, clash=None) -> D.Expr | None:
    """Σ_{v<n} x + Σ_{w<n} y = Σ_{v<n} (x + y[w:=v]): two sums over one extent become one pass
    (what an adjoint adds up from the paths through a lifted statistic and around it). None
    where a and b are not two float +-reductions of one extent. ``clash(name, extent)``: is a
    new binder's name taken at another extent (``D.common_binder``)."""
    one = D.common_binder(a, b, clash)
    if one is None:
        return None
    v, x, y = one
    return D.Red("add", v, _factored_add(x, y))


def _factored_add(x: D.Expr, y: D.Expr) -> D.Expr:
    """c·x' + c·y' = c·(x' + y') for the factors c the two products share (one product, so a
    contraction stays one contraction: dSᵀQ, not dS₁ᵀQ + dS₂ᵀQ)."""
    fx, rest_y = D.product_factors(x), D.product_factors(y)
    common, rest_x = [], []
    for f in fx:
        hit = next((i for i, g in enumerate(rest_y) if g is f), None)
        if hit is None:
            rest_x.append(f)
        else:
            common.append(rest_y.pop(hit))
    if not common:
        return D.Call("add", (x, y))
    dt = x.dtype
    return D.Call("mul", (D.product(common, dt), D.Call("add", (D.product(rest_x, dt), D.product(rest_y, dt)))))


def output_vars(dims, shape, reducer: "Reducer | None" = None) -> tuple:
    """One index variable per output axis, named after its dimension (made distinct, and — with
    ``reducer`` — distinct from every name its DNF gives another extent)."""
    red = reducer if reducer is not None else Reducer(record=False)
    out, taken = [], set()
    for d, s in zip(dims, shape):
        v = red.claim(d, int(s), taken)
        taken.add(v.name)
        out.append(v)
    return tuple(out)


def reduce_to_dnf(name: str, inputs, outputs, output_names=None, record: bool = True):
    """ψ-reduce the expressions ``outputs`` over ``inputs`` (moa.Input nodes) to a DNF.

    Returns (DNF, Derivation).
    """
    if isinstance(outputs, moa.Array):
        outputs = (outputs,)
    outputs = tuple(moa.as_array(o) for o in outputs)
    if output_names is None:
        output_names = ("out",) if len(outputs) == 1 else tuple(f"out{i}" for i in range(len(outputs)))
    red = Reducer(record=record)
    # every output axis is named before any reduction: an output's dims keep its names (those a
    # Preset tiles), a reduction over another extent of one of them takes another (n1, …)
    all_vars = [output_vars(expr.dims, expr.shape, red) for expr in outputs]
    outs = []
    for oname, expr, vars_ in zip(output_names, outputs, all_vars):
        body = red.psi(tuple(Ix.of(v) for v in vars_), expr, {})
        outs.append(D.Output(oname, expr.shape, expr.dims, vars_, body))
    specs = tuple(D.InputSpec(i.name, i.shape, i.dims, i.dtype) for i in inputs)
    known = {s.name for s in specs}
    for o in outs:
        for r in D.reads(o.body):
            if r.array not in known:
                raise ValueError(f"{name}: the expression reads {r.array!r}, which is not a declared input")
    return D.DNF(name, specs, tuple(outs)), Derivation(name, tuple(red.steps))


def psi_reduce(expr: "moa.Array", name: str = "expr", record: bool = True):
    """ψ-reduce a single expression; its inputs are found by walking the DAG."""
    inputs = {}
    for x in moa.nodes(expr):
        if isinstance(x, moa.Input):
            prev = inputs.setdefault(x.name, x)
            if prev is not x and (prev.shape, prev.dtype) != (x.shape, x.dtype):
                raise ValueError(f"{name}: two different inputs are both named {x.name!r}")
    return reduce_to_dnf(name, tuple(inputs[k] for k in sorted(inputs)), expr, record=record)

