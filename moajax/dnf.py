"""The Denotational Normal Form: pull arrays whose index function reads only inputs.

A DNF output is a shape plus an index function ⟨p⟩ ↦ e(p), where e is a scalar expression
over index variables: reads ⟨ix…⟩ψ A of *input* arrays, literals, index values, scalar ops,
and reductions op_{v<n} e(v) that bind a variable. No intermediate array exists in the IR:
ψ-reduction (``moajax.psi``) has inlined every one of them.

Expressions are immutable and hash-consed: structurally equal expressions are the same
Python object, so equality is identity and memoisation is a dict lookup.
"""

from __future__ import annotations

import dataclasses
import re
import weakref
from typing import Callable, Iterator, Mapping

import numpy as np

from moajax import ops as _ops
from moajax.ix import Ix, Var

# ----------------------------------------------------------------------------- expression nodes

_TABLE: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def _lit_key(value):
    return (type(value).__name__, repr(value))


class Expr:
    """A scalar expression over index variables (immutable, hash-consed)."""

    # _canon: (α-normal form, its highest bound name) once ``canonical`` has computed it;
    # _bound: the variables reductions bind inside it, once ``bound_vars`` has
    __slots__ = ("dtype", "free", "children", "_canon", "_bound", "__weakref__")

    @classmethod
    def _get(cls, key, init: Callable[["Expr"], None]) -> "Expr":
        key = (cls,) + key
        obj = _TABLE.get(key)
        if obj is None:
            obj = object.__new__(cls)
            init(obj)
            _TABLE[key] = obj
        return obj

    def __repr__(self):
        return f"<{type(self).__name__} {show(self)}>"

    def __reduce__(self):  # pragma: no cover - expressions are not pickled
        raise TypeError("DNF expressions are not picklable")


def _indexed(cls, attr: str, name: str, index, dtype) -> Expr:
    """The hash-consed leaf ⟨index⟩ of ``name`` (stored as ``attr``): an input read or a stage ref."""
    index = tuple(Ix.of(i) for i in index)
    dtype = np.dtype(dtype)

    def init(o):
        setattr(o, attr, name)
        o.index, o.dtype, o.children = index, dtype, ()
        o.free = frozenset().union(*(i.free_vars() for i in index)) if index else frozenset()

    return cls._get((name, index, dtype), init)


class Read(Expr):
    """⟨ix…⟩ψ A: one element of the input array A."""

    __slots__ = ("array", "index")

    def __new__(cls, array: str, index, dtype):
        return _indexed(cls, "array", array, index, dtype)


class Lit(Expr):
    """A scalar constant."""

    __slots__ = ("value",)

    def __new__(cls, value, dtype):
        dtype = np.dtype(dtype)

        def init(o):
            o.value, o.dtype, o.children, o.free = value, dtype, (), frozenset()

        return cls._get((_lit_key(value), dtype), init)


class IndexValue(Expr):
    """The value of an index expression (⟨i⟩ψ ιn = i)."""

    __slots__ = ("ix",)

    def __new__(cls, ix, dtype=np.int32):
        ix = Ix.of(ix)
        dtype = np.dtype(dtype)

        def init(o):
            o.ix, o.dtype, o.children, o.free = ix, dtype, (), ix.free_vars()

        return cls._get((ix, dtype), init)


class Call(Expr):
    """f(e₁, …) for a scalar op f of ``moajax.ops``."""

    __slots__ = ("op",)

    def __new__(cls, op: str, args):
        args = tuple(args)
        sop = _ops.OPS[op]
        if len(args) != sop.arity:
            raise ValueError(f"{op} takes {sop.arity} arguments, got {len(args)}")

        def init(o):
            o.op, o.children = op, args
            o.dtype = _ops.result_dtype(sop, [a.dtype for a in args])
            o.free = frozenset().union(*(a.free for a in args))

        return cls._get((op, args), init)

    @property
    def args(self):
        return self.children


class Convert(Expr):
    """e converted to ``dtype``."""

    __slots__ = ()

    def __new__(cls, arg: Expr, dtype):
        dtype = np.dtype(dtype)
        if arg.dtype == dtype:
            return arg

        def init(o):
            o.dtype, o.children, o.free = dtype, (arg,), arg.free

        return cls._get((arg, dtype), init)

    @property
    def arg(self):
        return self.children[0]


class Red(Expr):
    """op_{v<n} e(v): the monoid reduction of e over the bound variable v (n = v.extent)."""

    __slots__ = ("monoid", "var")

    def __new__(cls, monoid: str, var: Var, body: Expr):
        mono = _ops.monoid(monoid).name

        def init(o):
            o.monoid, o.var, o.children = mono, var, (body,)
            o.dtype = body.dtype
            o.free = body.free - {var}

        return cls._get((mono, var, body), init)

    @property
    def body(self):
        return self.children[0]


class Tag(Expr):
    """A label on a subexpression (from ``moa.name``): transparent, kept for ONFs and printing."""

    __slots__ = ("label",)

    def __new__(cls, label: str, body: Expr):
        def init(o):
            o.label, o.children, o.dtype, o.free = label, (body,), body.dtype, body.free

        return cls._get((label, body), init)

    @property
    def body(self):
        return self.children[0]


class Ref(Expr):
    """⟨ix…⟩ of an ONF stage's result (never in a DNF: ONF programs introduce it)."""

    __slots__ = ("stage", "index")

    def __new__(cls, stage: str, index, dtype):
        return _indexed(cls, "stage", stage, index, dtype)


# ----------------------------------------------------------------------------- traversal


def walk(e: Expr) -> Iterator[Expr]:
    """Every distinct subexpression, children before parents."""
    seen: set[int] = set()
    stack = [(e, False)]
    while stack:
        node, done = stack.pop()
        if done:
            yield node
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        for c in reversed(node.children):
            if id(c) not in seen:
                stack.append((c, False))


def rebuild(e: Expr, children) -> Expr:
    """The node e with new children (same op, same attributes)."""
    children = tuple(children)
    if all(a is b for a, b in zip(children, e.children)):
        return e
    if isinstance(e, Call):
        return Call(e.op, children)
    if isinstance(e, Convert):
        return Convert(children[0], e.dtype)
    if isinstance(e, Red):
        return Red(e.monoid, e.var, children[0])
    if isinstance(e, Tag):
        return Tag(e.label, children[0])
    raise TypeError(f"{type(e).__name__} has no children")


def transform(e: Expr, fn: Callable[[Expr], Expr | None]) -> Expr:
    """Bottom-up rewrite: fn(node-with-rewritten-children) returns a replacement or None."""
    memo: dict[int, Expr] = {}

    def go(x):
        r = memo.get(id(x))
        if r is not None:
            return r
        y = rebuild(x, [go(c) for c in x.children]) if x.children else x
        z = fn(y)
        out = y if z is None else z
        memo[id(x)] = out
        return out

    return go(e)


def substitute(e: Expr, mapping: Mapping[Var, Ix]) -> Expr:
    """e with free variables replaced by index expressions (bound variables are respected)."""
    mapping = {k: Ix.of(v) for k, v in mapping.items()}
    memo: dict = {}

    def go(x, m):
        live = {k: v for k, v in m.items() if k in x.free}
        if not live:
            return x
        key = (id(x), tuple(sorted(live.items(), key=lambda kv: (kv[0].name, kv[0].extent))))
        r = memo.get(key)
        if r is not None:
            return r
        if isinstance(x, Read):
            out = Read(x.array, [i.substitute(live) for i in x.index], x.dtype)
        elif isinstance(x, Ref):
            out = Ref(x.stage, [i.substitute(live) for i in x.index], x.dtype)
        elif isinstance(x, IndexValue):
            out = IndexValue(x.ix.substitute(live), x.dtype)
        elif isinstance(x, Red):
            inner = {k: v for k, v in live.items() if k != x.var}
            if any(x.var in v.free_vars() for v in inner.values()):
                raise ValueError(f"substitution would capture the bound variable {x.var}")
            out = Red(x.monoid, x.var, go(x.body, inner))
        else:
            out = rebuild(x, [go(c, live) for c in x.children])
        memo[key] = out
        return out

    return go(e, mapping)


def product_factors(e: Expr) -> list[Expr]:
    """e = f₁ × f₂ × … (flattening nested products; a ÷ b is a × (1 ÷ b), so that a divisor
    over fewer variables — a per-row denominator inside Σ_t — stays its own small factor
    and the rest of the product remains a contraction)."""
    if isinstance(e, Call) and e.op == "mul":
        return product_factors(e.children[0]) + product_factors(e.children[1])
    if isinstance(e, Call) and e.op == "div" and e.dtype.kind == "f":
        num, den = e.children
        if not (den.free >= num.free):  # only when the divisor is the smaller factor
            return product_factors(num) + [Call("div", (Lit(1.0, den.dtype), den))]
    if isinstance(e, Tag):
        return product_factors(e.body)
    return [e]


def product(factors, dtype) -> Expr:
    """f₁ × f₂ × … (1 for no factors): the inverse of ``product_factors``."""
    if not factors:
        return Lit(1.0 if np.dtype(dtype).kind == "f" else 1, dtype)
    out = factors[0]
    for f in factors[1:]:
        out = Call("mul", (out, f))
    return out


def distributed(body: Expr, factors, v: Var):
    """(op, the terms) of Σ_v body distributed over a sum among its factors, where that sum
    holds every variable of the result: held whole it would be a [rows, v, columns] tile, its
    terms each split into a contraction's two operands. None: contract body as it is."""
    out = set(body.free) - {v}
    if len(out) < 2:
        return None
    for f in factors:
        if (isinstance(f, Call) and f.op in ("add", "sub") and set(f.free) - {v} == out
                and all(len(product_factors(t)) >= 2 for t in f.children)):
            rest = [g for g in factors if g is not f]
            return f.op, [product(rest + [t], body.dtype) for t in f.children]
    return None


def mul_div_factors(e: Expr) -> tuple[list, list]:
    """e = Π num ÷ Π den (through nested × and ÷; labels are looked through)."""
    if isinstance(e, Tag):
        return mul_div_factors(e.body)
    if isinstance(e, Call) and e.op == "mul":
        n1, d1 = mul_div_factors(e.children[0])
        n2, d2 = mul_div_factors(e.children[1])
        return n1 + n2, d1 + d2
    if isinstance(e, Call) and e.op == "div":
        n1, d1 = mul_div_factors(e.children[0])
        n2, d2 = mul_div_factors(e.children[1])
        return n1 + d2, d1 + n2
    return [e], []


def quotient(num: list, den: list, dtype) -> Expr:
    """Π num ÷ Π den (the inverse of ``mul_div_factors``)."""
    n = product(num, dtype)
    return n if not den else Call("div", (n, product(den, dtype)))


def selection(e: Expr):
    """Σ_j ((j = i) ? ⟨… j …⟩ψA : 0) = ⟨… i …⟩ψA where 0 ≤ i < n (else 0): the one-hot read a
    traced table lookup (``moajax.trace``: table[i] at a computed i) ψ-reduces to — a gather.
    (the read of A, the position of j in it, i) where A's other indices are constants; else
    None. The DNF keeps the one-hot form (its meaning); backends and the cost model read it
    as the gather it is."""
    if not (isinstance(e, Red) and e.monoid == "add"):
        return None
    b = e.body
    if not (isinstance(b, Call) and b.op == "where"):
        return None
    cond, val, zero = b.children
    if not (isinstance(zero, Lit) and zero.value == 0):
        return None
    while isinstance(val, Convert):
        val = val.children[0]
    if not (isinstance(val, Read) and isinstance(cond, Call) and cond.op == "eq"):
        return None
    j = e.var

    def is_j(x):
        return isinstance(x, IndexValue) and x.ix.as_var() == j

    a, c = cond.children
    i = c if is_j(a) else a if is_j(c) else None
    if i is None or j in i.free:
        return None
    pos = [p for p, ix in enumerate(val.index) if j in ix.free_vars()]
    if len(pos) != 1 or val.index[pos[0]].as_var() != j:
        return None
    if any(not ix.is_const for p, ix in enumerate(val.index) if p != pos[0]):
        return None
    return val, pos[0], i


def one_hot_write(v: Var, body: Expr):
    """Σ_v ((c = i) ? X : 0), c a variable that neither i nor X uses (nor v): the transpose of
    a table read at a computed index (``selection``'s adjoint, d table[c] = Σ dY where i = c)
    — X added into the bins i of the axis c indexes, a scatter-add (a histogram), not a Σ
    over [c, v, …] of a one-hot. (c, i, X), else None. The DNF keeps the one-hot form (its
    meaning); the XLA backend and the cost model read it as the scatter it is."""
    if not (isinstance(body, Call) and body.op == "where"):
        return None
    cond, val, zero = body.children
    if not (isinstance(zero, Lit) and zero.value == 0 and isinstance(cond, Call) and cond.op == "eq"):
        return None
    a, b = cond.children
    for x, i in ((a, b), (b, a)):
        c = x.ix.as_var() if isinstance(x, IndexValue) else None
        if c is not None and c != v and c not in i.free and c not in val.free:
            return c, i, val
    return None


def common_binder(a: Expr, b: Expr, clash: Callable[[str, int], bool] | None = None):
    """(v, x, y) with a = Σ_{v<n} x and b = Σ_{v<n} y: two float +-reductions of one extent
    under one binder — a's, unless b would capture it (v free in b, or bound inside b's
    body), then a fresh name (one ``clash(name, n)`` does not refuse: a name the enclosing DNF
    gives another extent). None where a and b are not two such sums."""
    if not (isinstance(a, Red) and isinstance(b, Red) and a.monoid == b.monoid == "add"
            and a.var.extent == b.var.extent and a.dtype == b.dtype and a.dtype.kind == "f"):
        return None
    v = a.var
    if v == b.var:
        return v, a.body, b.body
    names = {x.var.name for e in (a, b) for x in walk(e) if isinstance(x, Red)}
    names |= {u.name for e in (a, b) for u in e.free}
    if v in b.free or any(x.var == v for x in walk(b.body) if isinstance(x, Red)):  # capture
        base, k = v.name, 1
        while f"{base}{k}" in names or (clash is not None and clash(f"{base}{k}", v.extent)):
            k += 1
        v = Var(f"{base}{k}", v.extent)
    x = substitute(a.body, {a.var: Ix.of(v)}) if v != a.var else a.body
    return v, x, substitute(b.body, {b.var: Ix.of(v)})


def reads(e: Expr) -> list[Read]:
    """The distinct input reads of e."""
    return [x for x in walk(e) if isinstance(x, Read)]


def reductions(e: Expr) -> list[Red]:
    return [x for x in walk(e) if isinstance(x, Red)]


def _kept(e: Expr, slot: str, make: Callable[[Expr], object]):
    """The attribute ``slot`` of e, made by ``make(x)`` for e and every node below it that has
    none yet, children before parents — iteratively (DNF bodies nest deeper than Python's
    stack allows) and never below a node that has it: a property of a node computed once,
    from its children's."""
    stack = [(e, False)]
    while stack:
        x, ready = stack.pop()
        if getattr(x, slot, None) is not None:
            continue
        if not ready:
            stack.append((x, True))
            stack.extend((c, False) for c in x.children if getattr(c, slot, None) is None)
            continue
        setattr(x, slot, make(x))
    return getattr(e, slot)


def _bound_of(x: Expr) -> frozenset:
    got = frozenset().union(*(c._bound for c in x.children))
    return got | {x.var} if isinstance(x, Red) else got


def bound_vars(e: Expr) -> set[Var]:
    """The variables reductions inside e bind (kept on each node: bodies are shared DAGs)."""
    return set(_kept(e, "_bound", _bound_of))


def mentioned_vars(e: Expr) -> frozenset:
    """Every index variable e mentions: free in it or bound inside it."""
    return e.free | _kept(e, "_bound", _bound_of)


def _canon_of(x: Expr) -> tuple:
    """(x's α-normal form, the highest β it binds), from its children's."""
    if isinstance(x, Red):
        body, top = x.body._canon
        j = top + 1
        while Var(f"β{j}", x.var.extent) in body.free - {x.var}:
            j += 1
        v = Var(f"β{j}", x.var.extent)
        return Red(x.monoid, v, substitute(body, {x.var: Ix.of(v)}) if v != x.var else body), j
    if x.children:
        kids = [c._canon for c in x.children]
        return rebuild(x, [k[0] for k in kids]), max(k[1] for k in kids)
    return x, -1


def canonical(e: Expr) -> Expr:
    """e with its bound variables renamed by binder height (α-normal form).

    op_{v<n} b ↦ op_{βⱼ<n} b′[v := βⱼ], b′ the normal form of b and j one more than the
    highest β that b′ binds (higher while βⱼ is free in b′, so nothing is captured). Two
    expressions that differ only in the names of their bound variables have the same
    canonical form (where no free variable is named β…); ONF rewrites use it to recognise
    repeated work. The name of a binder depends on what it encloses, not on what encloses
    it, so the form is compositional: it is computed once per node and kept on the node.
    """
    return _kept(e, "_canon", _canon_of)[0]


def fresh_name(base: str, taken: set) -> str:
    """``base``, else ``base2``, ``base3``, … — the first not in ``taken`` (added to it)."""
    name, n = base, 1
    while name in taken:
        n += 1
        name = f"{base}{n}"
    taken.add(name)
    return name


def untagged(e: Expr) -> Expr:
    """e without its labels (``Tag`` is transparent: the same value)."""
    return transform(e, lambda x: x.body if isinstance(x, Tag) else None)


def squeezed_axes(shape, own) -> dict | None:
    """{axis of ``shape``: its axis in ``own``} for the axes of extent > 1, where ``own`` is
    ``shape`` without (some of) its axes of extent 1 — the same elements, as a kernel derived
    for a device's block lays out a statistic whose axes of extent 1 ψ-reduction drops; None
    where it is not."""
    big = [j for j, n in enumerate(shape) if n != 1]
    kept = [j for j, n in enumerate(own) if n != 1]
    if [shape[j] for j in big] != [own[j] for j in kept]:
        return None
    return dict(zip(big, kept))


def unlabelled(e: Expr) -> Expr:
    """e without the labels around it (its subexpressions keep theirs): the node it names."""
    while isinstance(e, Tag):
        e = e.body
    return e


def match(pattern: Expr, term: Expr, params, env: dict | None = None, bound: dict | None = None) -> dict | None:
    """σ with pattern[σ] ≡ term (labels ignored, bound variables matched up to α-renaming),
    where σ maps the variables ``params`` of the pattern to index expressions; None if there
    is none. First-order: a parameter is matched where the pattern indexes by it plus known
    terms (⟨t⟩ψ A against ⟨⌊n/G⌋⟩ψ A binds t ↦ ⌊n/G⌋; then ⟨g + G·t⟩ψ B against ⟨n⟩ψ B binds
    g ↦ n − G·⌊n/G⌋); other indices must agree after σ.
    ``env`` is a σ to extend; ``bound`` maps pattern variables bound outside ``pattern`` to
    the term's."""
    params = frozenset(params)
    env = dict(env or {})

    deferred: list = []

    def unit(i: Ix, keep=frozenset()) -> Ix:  # a variable of extent 1 is 0 (ψ writes either)
        return i.substitute({v: Ix.of(0) for v in i.free_vars() if v.extent == 1 and v not in keep})

    def ix(p: Ix, t: Ix, bound: dict) -> bool:
        p = unit(p.substitute({**bound, **env}), params - set(env))
        t = unit(t)
        open_ = [v for v in p.free_vars() if v in params and v not in env]
        if len(open_) == 1:  # p = v + r with r known: v ↦ t − r (g + n_kv ↦ n binds g ↦ n − n_kv)
            v = open_[0]
            r = p - Ix.of(v)
            if v not in r.free_vars():
                env[v] = t - r
                return True
        if len(open_) > 1:  # solved once other reads have bound all but one
            deferred.append((p, t, bound))
            return True
        return not open_ and p == t

    def go(p: Expr, t: Expr, bound: dict) -> bool:
        while isinstance(p, Tag):
            p = p.body
        while isinstance(t, Tag):
            t = t.body
        if type(p) is not type(t) or p.dtype != t.dtype:
            return False
        if isinstance(p, Lit):
            return p is t
        if isinstance(p, (Read, Ref)):
            name_p, name_t = (p.array, t.array) if isinstance(p, Read) else (p.stage, t.stage)
            return (name_p == name_t and len(p.index) == len(t.index)
                    and all(ix(a, b, bound) for a, b in zip(p.index, t.index)))
        if isinstance(p, IndexValue):
            return ix(p.ix, t.ix, bound)
        if isinstance(p, Call) and p.op != t.op:
            return False
        if isinstance(p, Red):
            if p.monoid != t.monoid or p.var.extent != t.var.extent:
                return False
            return go(p.body, t.body, {**bound, p.var: Ix.of(t.var)})
        return len(p.children) == len(t.children) and all(go(a, b, bound) for a, b in zip(p.children, t.children))

    if not go(pattern, term, dict(bound or {})):
        return None
    while deferred:
        pending, deferred[:] = list(deferred), []
        if not all(ix(p, t, b) for p, t, b in pending):
            return None
        if len(deferred) == len(pending):  # no progress: two unknowns in one index
            return None
    for v in params:  # a parameter of extent 1 the term never indexes by is 0
        if v.extent == 1 and v not in env:
            env[v] = Ix.of(0)
    return env


def rebind(e: Expr, old: Var, new: Var) -> Expr:
    """e with every reduction over ``old`` α-renamed to reduce over ``new`` (free occurrences
    of ``old`` outside such reductions are left alone)."""
    memo: dict = {}

    def go(x):
        hit = memo.get(id(x))
        if hit is not None and hit[0] is x:
            return hit[1]
        if isinstance(x, Red) and x.var == old:
            out = Red(x.monoid, new, go(substitute(x.body, {old: Ix.of(new)})))
        elif x.children:
            out = rebuild(x, [go(c) for c in x.children])
        else:
            out = x
        memo[id(x)] = (x, out)
        return out

    return go(e)


# ----------------------------------------------------------------------------- the DNF value


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """An input array of the kernel: name, ρ, dims, dtype."""

    name: str
    shape: tuple
    dims: tuple
    dtype: np.dtype

    def __str__(self):
        return f"{self.name} ρ⟨{' '.join(map(str, self.shape))}⟩ {self.dtype.name}"


# The row statistics a saving forward outputs first (``Kernel.with_row_statistics``) are named
# saved0, saved1, … (saved2_0, … where those names are taken): float32 whatever its operands.
SAVED = "saved"
SAVED_STATISTIC = re.compile(SAVED + r"(\d+_)?\d+")


def is_saved_statistic(name: str) -> bool:
    return SAVED_STATISTIC.fullmatch(name) is not None


@dataclasses.dataclass(frozen=True)
class Output:
    """A pull array: ρ = ``shape`` and ⟨vars⟩ ↦ ``body``."""

    name: str
    shape: tuple
    dims: tuple
    vars: tuple  # one Var per axis
    body: Expr

    @property
    def dtype(self):
        return self.body.dtype


@dataclasses.dataclass(frozen=True)
class DNF:
    """A kernel in Denotational Normal Form: inputs and pull-array outputs."""

    name: str
    inputs: tuple
    outputs: tuple

    def input(self, name: str) -> InputSpec:
        for i in self.inputs:
            if i.name == name:
                return i
        raise KeyError(name)

    @property
    def output(self) -> Output:
        if len(self.outputs) != 1:
            raise ValueError(f"{self.name} has {len(self.outputs)} outputs; use .outputs")
        return self.outputs[0]

    @property
    def output_vars(self) -> tuple:
        """Every output's index variables, in first-seen order over the outputs (the order
        of the programs' own axes: rows before columns)."""
        out: list = []
        for o in self.outputs:
            out += [v for v in o.vars if v not in out]
        return tuple(out)

    def reads(self) -> list[Read]:
        out, seen = [], set()
        for o in self.outputs:
            for r in reads(o.body):
                if id(r) not in seen:
                    seen.add(id(r))
                    out.append(r)
        return out

    def arrays_read(self) -> set[str]:
        return {r.array for r in self.reads()}

    def pretty(self) -> str:
        lines = [f"DNF {self.name}"]
        lines.append("  inputs:  " + ", ".join(str(i) for i in self.inputs))
        ctx = ShowContext()
        for o in self.outputs:
            idx = " ".join(v.name for v in o.vars)
            lines.append(f"  output:  {o.name} ρ⟨{' '.join(map(str, o.shape))}⟩ {o.dtype.name}")
            lines.append(f"    ⟨{idx}⟩ψ {o.name} = {show(o.body, ctx)}")
        return "\n".join(lines + ctx.where())

    __str__ = pretty


def collapsed(dnf: "DNF"):
    """Two adjacent axes as one: ⟨… i j …⟩ψA = ⟨… i·J + j …⟩ψA′, A′ = A with ρ⟨… I J …⟩ as
    ⟨… I·J …⟩ (row-major: the same bytes, a free reshape) — where every read, reduction and
    output takes i and j together, in that order (a reduction: op_i op_j or op_j op_i, one
    directly inside the other: a monoid commutes), and nothing else reads them (no index arithmetic, no index value). A vmapped RMSNorm's batch
    and rows are one axis of rows again. Applied while a pair is found.

    Returns (DNF′, pairs) with ``pairs`` the merged dims in order, or None where no pair merges."""
    merged: list = []
    while True:
        step = _collapse_once(dnf)
        if step is None:
            return (dnf, tuple(merged)) if merged else None
        dnf, pair = step
        merged.append(pair)


def _collapse_once(dnf: "DNF"):
    exprs = [o.body for o in dnf.outputs]
    nodes = [x for e in exprs for x in walk(e)]
    reads = [x for x in nodes if isinstance(x, Read)]
    shapes = {i.name: i.shape for i in dnf.inputs}

    def plain(ix):
        return ix.as_var()

    def closure(start):
        """The (input, axis) pairs and the (i, j) variable pairs that must merge together, or None."""
        todo, axes, pairs = [start], set(), set()
        while todo:
            name, k = todo.pop()
            if (name, k) in axes:
                continue
            axes.add((name, k))
            for r in reads:
                if r.array != name:
                    continue
                a, b = plain(r.index[k]), plain(r.index[k + 1])
                if a is None or b is None or a == b or (a.extent, b.extent) != shapes[name][k:k + 2]:
                    return None
                pairs.add((a, b))
            for a, b in list(pairs):  # every other read of a or b: the same pair, adjacent
                for r in reads:
                    for k2, ix in enumerate(r.index):
                        v = plain(ix)
                        if v == a:
                            if k2 + 1 >= len(r.index) or plain(r.index[k2 + 1]) != b:
                                return None
                            if (r.array, k2) not in axes:
                                todo.append((r.array, k2))
                        elif v == b and (k2 == 0 or plain(r.index[k2 - 1]) != a):
                            return None
                        elif v is None and ix.free_vars() & {a, b}:
                            return None
        return axes, pairs

    def legal(pairs) -> bool:
        vs = {v for p in pairs for v in p}
        inner_of = dict(pairs)
        outer_of = {b: a for a, b in pairs}
        partner = {**inner_of, **outer_of}
        for x in nodes:
            if isinstance(x, (IndexValue, Ref)) and x.free & vs:
                return False
            if isinstance(x, Red) and x.var in partner:
                # op_i op_j, or op_j op_i (a monoid commutes), directly one inside the other
                body, other = x.body, partner[x.var]
                if not ((isinstance(body, Red) and body.var == other and body.monoid == x.monoid)
                        or any(isinstance(y, Red) and y.var == other and y.body is x for y in nodes)):
                    return False
        for o in dnf.outputs:
            for k, v in enumerate(o.vars):
                if v in inner_of and (k + 1 >= len(o.vars) or o.vars[k + 1] != inner_of[v]):
                    return False
                if v in outer_of and (k == 0 or o.vars[k - 1] != outer_of[v]):
                    return False
        return True

    for inp in dnf.inputs:
        for k in range(len(inp.shape) - 1):
            found = closure((inp.name, k))
            if found is None or not legal(found[1]):
                continue
            axes, pairs = found
            gone = {v for p in pairs for v in p}  # (their names are free again: n, not n2)
            taken = {v.name for x in nodes for v in x.free - gone}
            taken |= {x.var.name for x in nodes if isinstance(x, Red) and x.var not in gone}
            taken |= {v.name for o in dnf.outputs for v in o.vars if v not in gone}
            new = {}
            for a, b in sorted(pairs, key=lambda p: (p[0].name, p[1].name)):
                name = fresh_name(b.name, taken)
                taken.add(name)
                new[a] = Var(name, a.extent * b.extent)
            outer_of = {b: a for a, b in pairs}
            pair_of = dict(pairs)

            def merged_index(index):
                out = []
                for ix in index:
                    v = plain(ix)
                    if v in outer_of:
                        continue
                    out.append(Ix.of(new[v]) if v in new else ix)
                return out

            def fn(x):
                if isinstance(x, Read) and x.free & set(new):
                    return Read(x.array, merged_index(x.index), x.dtype)
                if isinstance(x, Red) and isinstance(x.body, Red):
                    a = x.var if x.var in new else outer_of.get(x.var)
                    if a is not None and {x.var, x.body.var} == {a, pair_of[a]}:  # op_i op_j (op_j op_i)
                        return Red(x.monoid, new[a], x.body.body)
                return None

            def dims_of(shape, dims, ks):
                shape, dims = list(shape), list(dims)
                for k2 in sorted(ks, reverse=True):
                    shape[k2:k2 + 2] = [shape[k2] * shape[k2 + 1]]
                    dims[k2:k2 + 2] = [dims[k2 + 1]]
                return tuple(shape), tuple(dims)

            inputs = tuple(dataclasses.replace(i, **dict(zip(("shape", "dims"), dims_of(
                i.shape, i.dims, [k2 for n2, k2 in axes if n2 == i.name])))) for i in dnf.inputs)
            outputs = []
            for o in dnf.outputs:
                ks = [k2 for k2, v in enumerate(o.vars) if v in new]
                shape, dims = dims_of(o.shape, o.dims, ks)
                outputs.append(Output(o.name, shape, dims, tuple(new.get(v, v) for v in o.vars if v not in outer_of),
                                      transform(o.body, fn)))
            pair = (inp.dims[k], inp.dims[k + 1])
            return DNF(dnf.name, inputs, tuple(outputs)), pair
    return None


# ----------------------------------------------------------------------------- printing


def _fmt_lit(v) -> str:
    if isinstance(v, float):
        if v == float("inf"):
            return "∞"
        if v == float("-inf"):
            return "−∞"
        return repr(v)
    return str(v)


def _fmt_index(index) -> str:
    parts = [str(i) for i in index]
    return "⟨" + " ".join(p if " " not in p else f"({p})" for p in parts) + "⟩"


def _appearance_order(e: Expr) -> list[Var]:
    """The free variables of e in the order a reader meets them (first read first)."""
    order: list[Var] = []

    def visit(x):
        if isinstance(x, (Read, Ref)):
            for i in x.index:
                for a, _ in i.terms:
                    vs = [a] if isinstance(a, Var) else sorted(a.arg.free_vars())
                    for v in vs:
                        if v in e.free and v not in order:
                            order.append(v)
        elif isinstance(x, IndexValue):
            for v in sorted(x.ix.free_vars()):
                if v in e.free and v not in order:
                    order.append(v)
        for c in x.children:
            visit(c)

    visit(e)
    return order


_BINDERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _binder_names(e: Expr) -> frozenset:
    hit = _BINDERS.get(e)
    if hit is None:
        hit = _BINDERS[e] = frozenset(x.var.name for x in walk(e) if isinstance(x, Red))
    return hit


_SHOWN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # node → show(node)


class ShowContext:
    """Shared state while printing several expressions: one definition per tagged subterm."""

    def __init__(self):
        self.names: dict = {}  # (label, α-canonical body) -> printed label
        self.defs: list[str] = []

    def where(self) -> list[str]:
        """The ``where`` block listing the collected definitions (empty if there are none)."""
        return ["  where"] + [f"    {d}" for d in self.defs] if self.defs else []


def show(e: Expr, ctx: ShowContext | None = None) -> str:
    """MoA-style text of e. Tagged subexpressions print as ``label(vars)``; their definitions
    (one per α-equivalence class) are collected in ``ctx.defs``."""
    if ctx is None:  # a pure function of e alone: printed once per node
        hit = _SHOWN.get(e)
        if hit is None:
            hit = _SHOWN[e] = show(e, ShowContext())
        return hit
    memo: dict = {}  # (id, scope) → (node, text); the node is kept alive so its id stays unique

    def tag_name(x: Tag) -> tuple[str, list[Var]]:
        params = _appearance_order(x.body)
        canon = canonical(substitute(x.body, {v: Ix.of(Var(f"π{i}", v.extent)) for i, v in enumerate(params)}))
        key = (x.label, canon)
        label = ctx.names.get(key)
        if label is None:
            n = sum(1 for k in ctx.names if k[0] == x.label)
            label = x.label if n == 0 else f"{x.label}{n + 1}"
            ctx.names[key] = label
            args = ", ".join(v.name for v in params)
            ctx.defs.append(f"{label}({args}) = {go(x.body)}")
        return label, params

    def go(x: Expr, scope: frozenset = frozenset()) -> str:
        # a reduction whose variable shadows an enclosing one prints primed (display only)
        key = (id(x), scope if _binder_names(x) else frozenset())
        r = memo.get(key)
        if r is not None and r[0] is x:
            return r[1]
        if isinstance(x, Read):
            s = f"{_fmt_index(x.index)}ψ{x.array}"
        elif isinstance(x, Ref):
            s = f"{x.stage}[{', '.join(str(i) for i in x.index)}]"
        elif isinstance(x, Lit):
            s = _fmt_lit(x.value)
        elif isinstance(x, IndexValue):
            s = str(x.ix) if x.ix.as_var() is not None or x.ix.is_const else f"({x.ix})"
        elif isinstance(x, Call):
            s = _ops.OPS[x.op].show([go(c, scope) for c in x.children], "dnf")
        elif isinstance(x, Convert):
            s = f"{x.dtype.name}({go(x.arg, scope)})"
        elif isinstance(x, Red):
            sym = _ops.MONOIDS[x.monoid].symbol
            if x.var.name in scope:
                shown = x.var.name + "′"
                while shown in scope:
                    shown += "′"
                body_expr = substitute(x.body, {x.var: Ix.of(Var(shown, x.var.extent))})
                v = Var(shown, x.var.extent)
            else:
                body_expr, v = x.body, x.var
            body = go(body_expr, scope | {v.name})
            if not (body.startswith("(") and body.endswith(")")):
                body = f"({body})"
            s = f"{sym}_{{{v.name}<{v.extent}}}{body}"
        elif isinstance(x, Tag):
            label, params = tag_name(x)
            s = f"{label}({', '.join(v.name for v in params)})"
        else:  # pragma: no cover
            raise TypeError(type(x))
        memo[key] = (x, s)
        return s

    return go(e)


def show_with_defs(e: Expr) -> str:
    ctx = ShowContext()
    head = show(e, ctx)
    if not ctx.defs:
        return head
    return head + "\n  where " + "\n        ".join(ctx.defs)
