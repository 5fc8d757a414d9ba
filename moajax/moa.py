"""The Mathematics of Arrays algebra: array expressions with MoA's shape rules.

An expression is a DAG of ``Array`` nodes with a concrete shape ρA, named dimensions and a
dtype. Nothing here computes: ``moajax.psi`` reduces an expression to its DNF, and
``moajax.numpy_eval`` evaluates the un-reduced expression in float64 as a test oracle.

Shape rules (ρ of each operation) follow Mullin's MoA; every violation raises
``MoAShapeError`` naming the operation and the shapes involved.

    ρ(k △ A) = ⟨|k|⟩ ⧺ 1▽ρA        ρ(k ▽ A) = ⟨s₀−|k|⟩ ⧺ 1▽ρA
    ρ(A op.× B) = ρA ⧺ ρB           ρ(A op₁.op₂ B) = (−1▽ρA) ⧺ (1▽ρB)
    ρ(op/ A) = 1▽ρA                 ρ(A ⧺ B) = ⟨a₀+b₀⟩ ⧺ 1▽ρA
    ρ(Ω⟨r…⟩ f (A…)) = frame ⧺ ρ f(cells)
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Sequence

import numpy as np

from moajax import ops as _ops


class MoAShapeError(ValueError):
    """A shape rule of the algebra is violated (names the operation and the shapes)."""


class MoATypeError(TypeError):
    """Operand dtypes do not fit an operation (names the operation and the dtypes)."""


# ----------------------------------------------------------------------------- nodes

_counter = itertools.count()


def _dtype(d) -> np.dtype:
    import jax.numpy as jnp  # jnp.dtype knows bfloat16 and friends

    return np.dtype(jnp.dtype(d))


class Array:
    """An array expression: ρ (``shape``), named ``dims`` and ``dtype``; a node of the DAG."""

    __slots__ = ("shape", "dims", "dtype", "uid")
    children: tuple = ()

    def __init__(self, shape, dims, dtype):
        self.shape = tuple(int(s) for s in shape)
        dims = tuple(dims)
        if len(dims) != len(self.shape):
            raise MoAShapeError(f"dims {dims} do not match shape {self.shape}")
        self.dims = dims
        self.dtype = _dtype(dtype)
        self.uid = next(_counter)

    # MoA names: ρA, δA, τA
    @property
    def rho(self) -> tuple[int, ...]:
        return self.shape

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self):
        return f"<moa {moa_str(self)} : ρ={list(self.shape)} {self.dtype.name}>"

    # scalar extension through Python operators
    def __add__(self, o):
        return add(self, o)

    def __radd__(self, o):
        return add(o, self)

    def __sub__(self, o):
        return sub(self, o)

    def __rsub__(self, o):
        return sub(o, self)

    def __mul__(self, o):
        return mul(self, o)

    def __rmul__(self, o):
        return mul(o, self)

    def __truediv__(self, o):
        return div(self, o)

    def __rtruediv__(self, o):
        return div(o, self)

    def __neg__(self):
        return neg(self)

    def __lt__(self, o):
        return lt(self, o)

    def __le__(self, o):
        return le(self, o)

    def __gt__(self, o):
        return gt(self, o)

    def __ge__(self, o):
        return ge(self, o)

    def __matmul__(self, o):
        return dot(self, o)

    def __getitem__(self, index):
        if not isinstance(index, tuple):
            index = (index,)
        return psi(index, self)

    __hash__ = object.__hash__


class Input(Array):
    """A named input array: the only thing a DNF may index."""

    __slots__ = ("name",)

    def __init__(self, name, shape, dims, dtype):
        super().__init__(shape, dims, dtype)
        self.name = name


class Literal(Array):
    """A scalar constant (ρ = ⟨⟩). ``weak``: a Python number that adopts its partner's dtype."""

    __slots__ = ("value", "weak")

    def __init__(self, value, dtype, weak=False):
        super().__init__((), (), dtype)
        self.value = value
        self.weak = weak


class Iota(Array):
    """ι n: ⟨i⟩ψ ι n = i, for 0 ≤ i < n."""

    __slots__ = ()


class Cell(Array):
    """A placeholder for the cells of one argument of Ω (bound during ψ-reduction)."""

    __slots__ = ("position",)


class Unary(Array):
    """An index-rewriting operation of one argument (transpose, take, …) or a label."""

    __slots__ = ("arg",)

    @property
    def children(self):
        return (self.arg,)


class Psi(Unary):
    """p ψ A for a constant partial index p: ρ = (δp) ▽ ρA."""

    __slots__ = ("index",)


class Take(Unary):
    """k △ A along axis 0 (k < 0 takes from the end)."""

    __slots__ = ("count",)


class Drop(Unary):
    """k ▽ A along axis 0 (k < 0 drops from the end)."""

    __slots__ = ("count",)


class Reverse(Unary):
    """Φ A along axis 0: ⟨i⟩ψ ΦA = ⟨s₀−1−i⟩ψ A."""

    __slots__ = ()


class Rotate(Unary):
    """k Θ A along axis 0: ⟨i⟩ψ (kΘA) = ⟨(i+k) mod s₀⟩ψ A."""

    __slots__ = ("shift",)


class Transpose(Unary):
    """⍉σ A: ρ(⍉σA)[j] = ρA[σ[j]] and ⟨p⟩ψ ⍉σA = ⟨q⟩ψ A with q[σ[j]] = p[j] (NumPy's axes)."""

    __slots__ = ("perm",)


class Reshape(Unary):
    """ρ' ρ̂ A: the elements of A in γ order (row-major "C" or column-major "F") refilled."""

    __slots__ = ("gamma",)


class Cast(Unary):
    """A with every element converted to ``dtype``."""

    __slots__ = ()


class Reduce(Unary):
    """op/ A along axis 0 with a monoid: ρ = 1▽ρA."""

    __slots__ = ("monoid",)


class Name(Unary):
    """A label on a subexpression (transparent: ψ passes through it); ONFs refer to it."""

    __slots__ = ("label",)


class StopGradient(Unary):
    """A, held constant under differentiation: ψ passes through it, its adjoint is 0. The
    softmax identity: softmax and logsumexp do not depend on the row max they subtract."""

    __slots__ = ()


class Catenate(Array):
    """A ⧺ B along axis 0."""

    __slots__ = ("a", "b")

    @property
    def children(self):
        return (self.a, self.b)


class Map(Array):
    """Scalar extension of a scalar op: ⟨p⟩ψ f(A, B) = f(⟨p⟩ψA, ⟨p⟩ψB); scalars extend."""

    __slots__ = ("op", "args")

    @property
    def children(self):
        return self.args


class Outer(Array):
    """A op.× B: ⟨p ⧺ q⟩ψ (A op.× B) = (⟨p⟩ψA) op (⟨q⟩ψB)."""

    __slots__ = ("op", "a", "b")

    @property
    def children(self):
        return (self.a, self.b)


class Inner(Array):
    """A op₁.op₂ B: ⟨p ⧺ q⟩ψ = op₁-reduce over l of (⟨p l⟩ψA) op₂ (⟨l q⟩ψB)."""

    __slots__ = ("monoid", "op", "a", "b")

    @property
    def children(self):
        return (self.a, self.b)


class Omega(Array):
    """Ω⟨r…⟩ f: f applied to the rank-rᵢ cells of each argument, over the common frame."""

    __slots__ = ("body", "cells", "args", "frame", "ranks")

    @property
    def children(self):
        return self.args


# ----------------------------------------------------------------------------- the DAG


def nodes(expr: Array):
    """Every node reachable from ``expr`` (operands and Ω bodies), each once."""
    stack, seen = [expr], set()
    while stack:
        x = stack.pop()
        if x.uid in seen:
            continue
        seen.add(x.uid)
        yield x
        if isinstance(x, Omega):
            stack.append(x.body)
        stack.extend(x.children)


def rebuild(node: Array, children, body: Array | None = None) -> Array:
    """A copy of ``node`` (a fresh node: its own uid) over new operands (and, for Ω, a new body)."""
    new = object.__new__(type(node))
    for cls in type(node).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            if hasattr(node, slot):
                setattr(new, slot, getattr(node, slot))
    new.uid = next(_counter)
    children = tuple(children)
    if isinstance(node, Unary):
        (new.arg,) = children
    elif isinstance(node, (Catenate, Outer, Inner)):
        new.a, new.b = children
    elif isinstance(node, (Map, Omega)):
        new.args = children
    if isinstance(node, Omega) and body is not None:
        new.body = body
    return new


def substitute(expr: Array, mapping: dict) -> Array:
    """``expr`` with each node that is a key of ``mapping`` replaced by its value (by identity);
    subterms that contain none of them are shared, not copied (Ω bodies are rewritten too)."""
    by_uid = {k.uid: v for k, v in mapping.items()}
    memo: dict = {}

    def go(x):
        hit = memo.get(x.uid)
        if hit is not None:
            return hit
        if x.uid in by_uid:
            out = by_uid[x.uid]
        else:
            kids = tuple(go(c) for c in x.children)
            body = go(x.body) if isinstance(x, Omega) else None
            same = all(a is b for a, b in zip(kids, x.children)) and (body is None or body is x.body)
            out = x if same else rebuild(x, kids, body)
        memo[x.uid] = out
        return out

    return go(expr)


def postorder(outputs) -> list:
    """The nodes reachable from ``outputs`` through operands (not into Ω bodies), each once
    and after its operands."""
    out, seen = [], set()
    for root in outputs:
        stack = [(root, False)]
        while stack:
            x, done = stack.pop()
            if done:
                out.append(x)
                continue
            if x.uid in seen:
                continue
            seen.add(x.uid)
            stack.append((x, True))
            stack.extend((c, False) for c in reversed(x.children) if c.uid not in seen)
    return out


def lift_from_omega(outputs, keep: Callable[[Array, "Omega"], bool]) -> tuple:
    """``outputs`` with each subterm y of an Ω body for which ``keep(y, Ω)`` holds computed as
    an array of its own over the Ω's frame, Y = Ω(λ c. y)(A…), and read by the body through a
    further argument: Ω(λ c, y. body)(A…, Y). The same arrays (y is merely named once per
    frame index); Y is a node outside every Ω body, so a forward can output it and a backward
    read it. Inner Ω's are lifted first, so a statistic nested k levels deep comes out whole.
    A kept Name or StopGradient keeps its form on the outside (``name``/``stop_gradient`` of Y)."""
    memo: dict = {}

    def go(x):
        hit = memo.get(x.uid)
        if hit is not None:
            return hit
        kids = tuple(go(c) for c in x.children)
        if isinstance(x, Omega):
            out = _lift_omega(x, kids, go(x.body))
        else:
            same = all(a is b for a, b in zip(kids, x.children))
            out = x if same else rebuild(x, kids)
        memo[x.uid] = out
        return out

    def _lift_omega(node, args, body):
        k = len(node.cells)
        kept = [y for y in postorder([body]) if y is not body and keep(y, node) and free_cells(y) & set(node.cells)]
        same = all(a is b for a, b in zip(args, node.args)) and body is node.body
        if not kept:
            return node if same else rebuild(node, args, body)
        lifted: list = []  # (y, Y)

        def binding(cells):
            mapping = dict(zip(node.cells, cells[:k]))
            mapping.update({y: c for (y, _), c in zip(lifted, cells[k:])})
            return mapping

        for y in kept:  # each reads the ones lifted before it (a denominator reads its max)
            inner = y.arg if isinstance(y, (Name, StopGradient)) else y
            Y = omega(lambda *cells, inner=inner: substitute(inner, binding(cells)),
                      tuple(node.ranks) + tuple(z.rank for z, _ in lifted))(*args, *(Z for _, Z in lifted))
            cut = [a for c, a in zip(node.cells, args) if c is inner]
            if cut and (cut[0].shape, cut[0].dims, cut[0].dtype) == (Y.shape, Y.dims, Y.dtype):
                Y = cut[0]  # Ω(λ c. c)(A) over A's own frame is A: the node itself, which others read too
            if isinstance(y, Name):
                Y = name(y.label, Y)
            elif isinstance(y, StopGradient):
                Y = stop_gradient(Y)
            lifted.append((y, Y))
        return omega(lambda *cells: substitute(body, binding(cells)),
                     tuple(node.ranks) + tuple(y.rank for y, _ in lifted))(*args, *(Y for _, Y in lifted))

    return tuple(go(o) for o in outputs)


def free_cells(node: Array, cache: dict | None = None) -> frozenset:
    """The Ω cells a subterm refers to without binding them: only their bindings can make its
    value differ from one frame index to the next (``cache``: uid → result, reused)."""
    cache = {} if cache is None else cache
    hit = cache.get(node.uid)
    if hit is not None:
        return hit
    if isinstance(node, Cell):
        out = frozenset([node])
    elif isinstance(node, Omega):
        out = free_cells(node.body, cache) - set(node.cells)
        for a in node.args:
            out |= free_cells(a, cache)
    else:
        out = frozenset()
        for c in node.children:
            out |= free_cells(c, cache)
    cache[node.uid] = out
    return out


# ----------------------------------------------------------------------------- helpers


def _axis(axis: int, rank: int, opname: str, shape) -> int:
    if not isinstance(axis, (int, np.integer)):
        raise TypeError(f"{opname}: axis must be an int, got {type(axis).__name__}")
    a = axis + rank if axis < 0 else axis
    if not 0 <= a < rank:
        raise MoAShapeError(f"{opname}: axis {axis} is out of range for an array of shape {list(shape)}")
    return int(a)


def _along(axis, A, opname, build):
    """Apply a leading-axis operation along ``axis`` by Ω-lifting to cells of rank δA − axis."""
    a = _axis(axis, A.rank, opname, A.shape)
    if a == 0:
        return build(A)
    return omega(build, A.rank - a)(A)


def as_array(x, like: Array | None = None) -> Array:
    """Wrap a Python or NumPy scalar as a Literal; arrays pass through."""
    if isinstance(x, Array):
        return x
    if isinstance(x, (bool, np.bool_)):
        return Literal(bool(x), np.bool_, weak=False)
    if isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, np.ndarray):
        if isinstance(x, (np.integer, np.floating)):
            return Literal(x.item(), x.dtype, weak=False)
        if like is not None and like.dtype.kind in "fciu" and not (
            isinstance(x, float) and like.dtype.kind in "iu"
        ):
            return Literal(x, like.dtype, weak=True)
        return Literal(x, np.float32 if isinstance(x, float) else np.int32, weak=True)
    raise TypeError(
        f"expected a moajax.moa.Array or a Python scalar, got {type(x).__name__}; "
        "declare array inputs with moajax.moa.array(name, shape) or through @moajax.kernel"
    )


# ----------------------------------------------------------------------------- constructors


def array(name: str, shape: Sequence[int], dims: Sequence[str] | str | None = None, dtype=np.float32) -> Input:
    """Declare an input array ``name`` with ρ = ``shape`` and named dimensions ``dims``."""
    shape = tuple(shape)
    for s in shape:
        if not isinstance(s, (int, np.integer)) or s < 0:
            raise MoAShapeError(f"array {name!r}: shape {list(shape)} must hold non-negative ints")
    if dims is None:
        dims = tuple(f"{name}{i}" for i in range(len(shape)))
    elif isinstance(dims, str):
        dims = tuple(dims.split())
    if len(dims) != len(shape):
        raise MoAShapeError(f"array {name!r}: dims {list(dims)} do not match shape {list(shape)}")
    return Input(name, shape, dims, dtype)


def scalar(value, dtype=None) -> Literal:
    """A scalar constant with an explicit dtype (default: float32 for floats, int32 for ints)."""
    if dtype is None:
        dtype = np.bool_ if isinstance(value, bool) else (np.float32 if isinstance(value, float) else np.int32)
    return Literal(value, dtype)


def iota(n: int, dim: str = "i", dtype=np.int32) -> Iota:
    """ι n = ⟨0 1 … n−1⟩."""
    if not isinstance(n, (int, np.integer)) or n < 0:
        raise MoAShapeError(f"iota: n must be a non-negative int, got {n!r}")
    return Iota((int(n),), (dim,), dtype)


def psi(index: Sequence[int], A: Array) -> Array:
    """p ψ A for a constant (partial) index p: ρ = (δp) ▽ ρA; ⟨⟩ψA = A."""
    A = as_array(A)
    index = tuple(index)
    if len(index) > A.rank:
        raise MoAShapeError(f"psi: index {list(index)} is longer than the rank of shape {list(A.shape)}")
    for i, (p, s) in enumerate(zip(index, A.shape)):
        if not isinstance(p, (int, np.integer)):
            raise TypeError(f"psi: index entries must be ints, got {type(p).__name__} at position {i}")
        if not 0 <= p < s:
            raise MoAShapeError(f"psi: index {list(index)} is out of bounds for shape {list(A.shape)}")
    if not index:
        return A
    node = Psi(A.shape[len(index):], A.dims[len(index):], A.dtype)
    node.arg, node.index = A, tuple(int(p) for p in index)
    return node


def _take_drop(kind, k, A, axis):
    A = as_array(A)
    if isinstance(k, (tuple, list)):
        # a vector k takes along the leading δk axes: ⟨k₀ k₁⟩△A = k₀△ Ω⟨δA−1⟩(k₁△) A
        if len(k) > A.rank:
            raise MoAShapeError(f"{kind}: count vector {list(k)} is longer than the rank of shape {list(A.shape)}")
        out = A
        for ax, kk in enumerate(k):
            out = _take_drop(kind, kk, out, ax)
        return out
    if not isinstance(k, (int, np.integer)):
        raise TypeError(f"{kind}: count must be an int or a tuple of ints, got {type(k).__name__}")
    if A.rank == 0:
        raise MoAShapeError(f"{kind}: needs an array of rank ≥ 1, got shape {list(A.shape)}")

    def build(C):
        s0 = C.shape[0]
        if abs(k) > s0:
            raise MoAShapeError(f"{kind}: |{k}| exceeds the axis length in shape {list(C.shape)}")
        n = abs(k) if kind == "take" else s0 - abs(k)
        cls = Take if kind == "take" else Drop
        node = cls((n,) + C.shape[1:], C.dims, C.dtype)
        node.arg, node.count = C, int(k)
        return node

    return _along(axis, A, kind, build)


def take(k, A: Array, axis: int = 0) -> Array:
    """k △ A: the first k items along ``axis`` (the last |k| when k < 0)."""
    return _take_drop("take", k, A, axis)


def drop(k, A: Array, axis: int = 0) -> Array:
    """k ▽ A: all but the first k items along ``axis`` (all but the last |k| when k < 0)."""
    return _take_drop("drop", k, A, axis)


def reverse(A: Array, axis: int = 0) -> Array:
    """Φ A along ``axis``: ⟨i⟩ψ ΦA = ⟨s−1−i⟩ψ A."""
    A = as_array(A)
    if A.rank == 0:
        raise MoAShapeError(f"reverse: needs an array of rank ≥ 1, got shape {list(A.shape)}")

    def build(C):
        node = Reverse(C.shape, C.dims, C.dtype)
        node.arg = C
        return node

    return _along(axis, A, "reverse", build)


def rotate(k: int, A: Array, axis: int = 0) -> Array:
    """k Θ A along ``axis``: ⟨i⟩ψ (kΘA) = ⟨(i+k) mod s⟩ψ A (NumPy: roll by −k)."""
    A = as_array(A)
    if not isinstance(k, (int, np.integer)):
        raise TypeError(f"rotate: shift must be an int, got {type(k).__name__}")
    if A.rank == 0:
        raise MoAShapeError(f"rotate: needs an array of rank ≥ 1, got shape {list(A.shape)}")

    def build(C):
        node = Rotate(C.shape, C.dims, C.dtype)
        node.arg, node.shift = C, int(k)
        return node

    return _along(axis, A, "rotate", build)


def transpose(A: Array, perm: Sequence[int] | None = None) -> Array:
    """⍉σ A (σ defaults to reversing the axes, MoA's ⍉)."""
    A = as_array(A)
    if perm is None:
        perm = tuple(reversed(range(A.rank)))
    perm = tuple(int(p) for p in perm)
    if sorted(perm) != list(range(A.rank)):
        raise MoAShapeError(f"transpose: {list(perm)} is not a permutation of the axes of shape {list(A.shape)}")
    if perm == tuple(range(A.rank)):
        return A
    node = Transpose(tuple(A.shape[p] for p in perm), tuple(A.dims[p] for p in perm), A.dtype)
    node.arg, node.perm = A, perm
    return node


def reshape(A: Array, shape: Sequence[int], dims: Sequence[str] | str | None = None, gamma: str = "C") -> Array:
    """Refill ``shape`` with the elements of A taken in γ order ("C" row-major, "F" column-major)."""
    A = as_array(A)
    shape = tuple(int(s) for s in shape)
    if gamma not in ("C", "F"):
        raise ValueError(f"reshape: gamma must be 'C' (row-major) or 'F' (column-major), got {gamma!r}")
    if any(s < 0 for s in shape) or math.prod(shape) != A.size:
        raise MoAShapeError(
            f"reshape: cannot refill shape {list(shape)} (τ={math.prod(shape)}) from shape {list(A.shape)} (τ={A.size})"
        )
    if dims is None:
        if len(shape) == 1:
            dims = ("".join(A.dims) if A.rank else "r",)
        else:
            dims = tuple(f"r{i}" for i in range(len(shape)))
    elif isinstance(dims, str):
        dims = tuple(dims.split())
    if len(dims) != len(shape):
        raise MoAShapeError(f"reshape: dims {list(dims)} do not match shape {list(shape)}")
    if shape == A.shape and tuple(dims) == A.dims:
        return A
    node = Reshape(shape, dims, A.dtype)
    node.arg, node.gamma = A, gamma
    return node


def ravel(A: Array, gamma: str = "C") -> Array:
    """The elements of A as a vector, in γ order."""
    return reshape(A, (as_array(A).size,), gamma=gamma)


def catenate(A: Array, B: Array, axis: int = 0) -> Array:
    """A ⧺ B along ``axis``: the items of A followed by the items of B."""
    A, B = as_array(A), as_array(B)
    if A.rank == 0 or B.rank == 0 or A.rank != B.rank:
        raise MoAShapeError(f"catenate: shapes {list(A.shape)} and {list(B.shape)} need equal rank ≥ 1")
    ax = _axis(axis, A.rank, "catenate", A.shape)
    if A.shape[:ax] + A.shape[ax + 1:] != B.shape[:ax] + B.shape[ax + 1:]:
        raise MoAShapeError(
            f"catenate: shapes {list(A.shape)} and {list(B.shape)} differ off axis {axis}"
        )
    if A.dtype != B.dtype:
        raise MoATypeError(f"catenate: dtypes {A.dtype.name} and {B.dtype.name} differ; cast one first")

    def build(a, b):
        node = Catenate((a.shape[0] + b.shape[0],) + a.shape[1:], a.dims, a.dtype)
        node.a, node.b = a, b
        return node

    if ax == 0:
        return build(A, B)
    return omega(build, (A.rank - ax, B.rank - ax))(A, B)


def name(label: str, A: Array) -> Array:
    """Label a subexpression; the DNF keeps the label and ONFs refer to it (store/recompute)."""
    A = as_array(A)
    if not isinstance(label, str) or not label.isidentifier():
        raise ValueError(f"name: label must be an identifier, got {label!r}")
    node = Name(A.shape, A.dims, A.dtype)
    node.arg, node.label = A, label
    return node


def stop_gradient(A: Array) -> Array:
    """A, held constant by ``moajax.adjoint`` (its cotangent is not propagated)."""
    A = as_array(A)
    if isinstance(A, (Literal, Iota, StopGradient)):
        return A
    node = StopGradient(A.shape, A.dims, A.dtype)
    node.arg = A
    return node


def cast(A: Array, dtype) -> Array:
    """A with elements converted to ``dtype``."""
    A = as_array(A)
    dtype = _dtype(dtype)
    if A.dtype == dtype:
        return A
    if isinstance(A, Literal):
        return Literal(A.value, dtype)
    node = Cast(A.shape, A.dims, dtype)
    node.arg = A
    return node


# ----------------------------------------------------------------------------- scalar extension


def _map(op: _ops.ScalarOp, *xs) -> Array:
    arrays = [x for x in xs if isinstance(x, Array)]
    like = next((a for a in arrays if not (isinstance(a, Literal) and a.weak)), arrays[0] if arrays else None)
    if op.name == "where" and len(xs) == 3:
        like_v = next((a for a in xs[1:] if isinstance(a, Array) and not (isinstance(a, Literal) and a.weak)), None)
        args = (as_array(xs[0]),) + tuple(as_array(x, like_v) for x in xs[1:])
    else:
        args = tuple(as_array(x, like) for x in xs)
    if len(args) != op.arity:
        raise TypeError(f"{op.name}: takes {op.arity} operands, got {len(args)}")
    # shapes: equal, or scalar (ρ = ⟨⟩) extended
    shapes = [a.shape for a in args if a.rank > 0]
    if any(s != shapes[0] for s in shapes[1:]):
        raise MoAShapeError(
            f"{op.name}: shapes {[list(a.shape) for a in args]} do not agree "
            "(scalar extension needs equal shapes or a scalar; use omega for cells)"
        )
    # dtypes
    value_args = args[1:] if op.name == "where" else args
    strong = [a.dtype for a in value_args if not (isinstance(a, Literal) and a.weak)]
    dts = strong or [value_args[0].dtype]
    if any(d != dts[0] for d in dts):
        raise MoATypeError(f"{op.name}: operand dtypes {[d.name for d in dts]} differ; cast first")
    for a in value_args:
        if isinstance(a, Literal) and a.weak and np.dtype(dts[0]).kind in "iub" and isinstance(a.value, float):
            raise MoATypeError(f"{op.name}: the float {a.value!r} cannot extend an array of dtype {dts[0].name}")
    value_args = tuple(
        Literal(a.value, dts[0], weak=True) if isinstance(a, Literal) and a.weak and a.dtype != dts[0] else a
        for a in value_args
    )
    args = ((args[0],) + value_args) if op.name == "where" else value_args
    if op.name == "where" and args[0].dtype != np.bool_:
        raise MoATypeError(f"where: condition must be bool, got {args[0].dtype.name}")
    dt = dts[0]
    if op.float_only and not _is_float(dt):
        raise MoATypeError(f"{op.name}: needs a floating dtype, got {dt.name}; cast first")
    if op.bool_only and dt != np.bool_:
        raise MoATypeError(f"{op.name}: needs bool operands, got {dt.name}")
    if op.int_only and np.dtype(dt).kind not in "iu":
        raise MoATypeError(f"{op.name}: needs integer operands, got {dt.name}")
    out_dtype = _ops.result_dtype(op, [a.dtype for a in args])
    big = next((a for a in args if a.rank > 0), args[0])
    node = Map(big.shape, big.dims, out_dtype)
    node.op, node.args = op, args
    return node


def _is_float(dt) -> bool:
    dt = np.dtype(dt)
    return dt.kind == "f" or dt.name in ("bfloat16",) or dt.name.startswith("float8")


class _OpFn:
    """A scalar op usable as a function on arrays (scalar extension) and as an argument of
    ``outer``, ``inner`` and ``reduce``."""

    def __init__(self, name):
        self.op = _ops.OPS[name]
        self.name = name
        self.__doc__ = f"Scalar extension of {self.op.symbol} ({name})."

    def __call__(self, *xs):
        return _map(self.op, *xs)

    def __repr__(self):
        return f"moa.{self.name}"


add, sub, mul, div = _OpFn("add"), _OpFn("sub"), _OpFn("mul"), _OpFn("div")
maximum, minimum = _OpFn("maximum"), _OpFn("minimum")
lt, le, gt, ge, eq, ne = (_OpFn(n) for n in ("lt", "le", "gt", "ge", "eq", "ne"))
logical_and, logical_or, logical_not = _OpFn("logical_and"), _OpFn("logical_or"), _OpFn("logical_not")
neg, abs_, exp, log, sqrt, rsqrt = (_OpFn(n) for n in ("neg", "abs", "exp", "log", "sqrt", "rsqrt"))
tanh, sigmoid, silu = _OpFn("tanh"), _OpFn("sigmoid"), _OpFn("silu")
where = _OpFn("where")
quot, rem, sign = _OpFn("quot"), _OpFn("rem"), _OpFn("sign")


def _opname(op) -> str:
    n = getattr(op, "name", op)
    if isinstance(n, str) and n in _ops.OPS:
        return n
    raise ValueError(f"unknown scalar op {op!r}; use one of moajax.moa.{{add, mul, maximum, …}}")


# ----------------------------------------------------------------------------- products, reductions


def outer(op, A: Array, B: Array) -> Array:
    """A op.× B: ρ = ρA ⧺ ρB."""
    A, B = as_array(A), as_array(B)
    o = _ops.OPS[_opname(op)]
    if o.arity != 2:
        raise ValueError(f"outer: {o.name} is not a binary op")
    probe = _map(o, Literal(0, A.dtype), Literal(0, B.dtype))  # dtype rules of the op
    node = Outer(A.shape + B.shape, A.dims + B.dims, probe.dtype)
    node.op, node.a, node.b = o, A, B
    return node


def _reduce0(m, A):
    if A.rank == 0:
        raise MoAShapeError(f"reduce: needs an array of rank ≥ 1, got shape {list(A.shape)}")
    mono = _ops.monoid(m)
    if mono.name in ("and", "or") and A.dtype != np.bool_:
        raise MoATypeError(f"reduce {mono.name}: needs bool elements, got {A.dtype.name}")
    node = Reduce(A.shape[1:], A.dims[1:], A.dtype)
    node.arg, node.monoid = A, mono
    return node


def reduce(m, A: Array, axis: int = 0) -> Array:
    """op/ A along ``axis`` with the monoid of ``m`` ("add", "max", …): ρ = ρA without that axis."""
    A = as_array(A)
    _ops.monoid(m)  # validate early
    if A.rank == 0:
        raise MoAShapeError(f"reduce: needs an array of rank ≥ 1, got shape {list(A.shape)}")
    return _along(axis, A, "reduce", lambda C: _reduce0(m, C))


def inner(m, op, A: Array, B: Array) -> Array:
    """A op₁.op₂ B: ⟨p q⟩ψ = op₁/ over l of ⟨p l⟩ψA op₂ ⟨l q⟩ψB; ρ = (−1▽ρA) ⧺ (1▽ρB)."""
    A, B = as_array(A), as_array(B)
    mono = _ops.monoid(m)
    o = _ops.OPS[_opname(op)]
    if A.rank == 0 or B.rank == 0:
        raise MoAShapeError(f"inner: needs arrays of rank ≥ 1, got shapes {list(A.shape)} and {list(B.shape)}")
    if A.shape[-1] != B.shape[0]:
        raise MoAShapeError(
            f"inner: the last axis of shape {list(A.shape)} does not match the first axis of shape {list(B.shape)}"
        )
    probe = _map(o, Literal(0, A.dtype), Literal(0, B.dtype))
    node = Inner(A.shape[:-1] + B.shape[1:], A.dims[:-1] + B.dims[1:], probe.dtype)
    node.monoid, node.op, node.a, node.b = mono, o, A, B
    return node


def dot(A: Array, B: Array) -> Array:
    """A +.× B (the matrix product, for any ranks)."""
    return inner("add", "mul", A, B)


def omega(fn: Callable[..., Array], ranks) -> Callable[..., Array]:
    """Ω⟨r…⟩ fn: apply fn to the rank-rᵢ cells of each argument over their common frame.

    The frame of an argument is ρA without its last rᵢ axes (a negative rᵢ counts cell
    axes from the front: −1 leaves a frame of one axis). Non-empty frames must be equal;
    an argument with an empty frame is the same for every frame index.
    """

    def apply(*args):
        args = tuple(as_array(a) for a in args)
        rs = (ranks,) * len(args) if isinstance(ranks, (int, np.integer)) else tuple(ranks)
        if len(rs) != len(args):
            raise ValueError(f"omega: {len(rs)} ranks for {len(args)} arguments")
        cell_ranks = []
        for a, r in zip(args, rs):
            r = int(r)
            cr = max(0, a.rank + r) if r < 0 else min(r, a.rank)
            cell_ranks.append(cr)
        frames = [a.shape[: a.rank - cr] for a, cr in zip(args, cell_ranks)]
        nonempty = [f for f in frames if f]
        if any(f != nonempty[0] for f in nonempty[1:]):
            raise MoAShapeError(
                f"omega: frames {[list(f) for f in frames]} of shapes {[list(a.shape) for a in args]} "
                f"with cell ranks {cell_ranks} do not agree"
            )
        frame = nonempty[0] if nonempty else ()
        if not frame:
            return fn(*args)
        src = next(a for a, f in zip(args, frames) if f)
        frame_dims = src.dims[: len(frame)]
        cells = tuple(
            Cell(a.shape[a.rank - cr:], a.dims[a.rank - cr:], a.dtype) for a, cr in zip(args, cell_ranks)
        )
        for i, c in enumerate(cells):
            c.position = i
        body = as_array(fn(*cells))
        node = Omega(frame + body.shape, frame_dims + body.dims, body.dtype)
        node.body, node.cells, node.args = body, cells, args
        node.frame = tuple(len(f) for f in frames)  # frame rank per argument (0 or len(frame))
        node.ranks = tuple(cell_ranks)
        return node

    return apply


# ----------------------------------------------------------------------------- defined operations
# Everything below is a definition in the algebra, not a primitive: ψ-reduction sees only the
# primitives above.


def sum(A: Array, axis: int = 0) -> Array:  # noqa: A001 - MoA's +/
    """+/ A along ``axis``."""
    return reduce("add", A, axis)


def amax(A: Array, axis: int = 0) -> Array:
    """⌈/ A along ``axis``."""
    return reduce("max", A, axis)


def amin(A: Array, axis: int = 0) -> Array:
    """⌊/ A along ``axis``."""
    return reduce("min", A, axis)


def mean(A: Array, axis: int = 0) -> Array:
    """(+/ A) ÷ n along ``axis``."""
    A = as_array(A)
    n = A.shape[_axis(axis, A.rank, "mean", A.shape)]
    return sum(A, axis) / float(n)


def square(A: Array) -> Array:
    return A * A


def softmax(A: Array, axis: int = -1) -> Array:
    """exp(A − ⌈/A) ÷ +/exp(A − ⌈/A) along ``axis`` (stable: the max is subtracted per row)."""
    A = as_array(A)
    a = _axis(axis, A.rank, "softmax", A.shape)
    if a != A.rank - 1:
        perm = tuple(i for i in range(A.rank) if i != a) + (a,)
        inv = tuple(np.argsort(perm))
        return transpose(softmax(transpose(A, perm), -1), inv)
    m, e, den = _softmax_parts(A)
    return name("probs", omega(div, (1, 0))(e, den))


def _softmax_parts(A: Array) -> tuple:
    """(⌈/A, exp(A − ⌈/A), +/exp(A − ⌈/A)) along the last axis, labelled as ``softmax`` reads them."""
    m = stop_gradient(amax(A, -1))  # the result is the same for any shift: no cotangent
    e = name("num", exp(omega(sub, (1, 0))(A, m)))
    return m, e, name("den", sum(e, -1))


def softmax_lse(A: Array, axis: int = -1) -> Array:
    """⌈/A + log den along ``axis``, den the softmax's own denominator: ``logsumexp`` built of
    the very nodes ``softmax`` is, so that a kernel computing both sums each row once
    (attention's Out and its log-sum-exp, jax.nn's ``return_residual``)."""
    A = as_array(A)
    a = _axis(axis, A.rank, "softmax_lse", A.shape)
    if a != A.rank - 1:
        perm = tuple(i for i in range(A.rank) if i != a) + (a,)
        return softmax_lse(transpose(A, perm), -1)
    m, _, den = _softmax_parts(A)
    return m + log(den)


def logsumexp(A: Array, axis: int = -1) -> Array:
    """⌈/A + log +/exp(A − ⌈/A) along ``axis``."""
    A = as_array(A)
    a = _axis(axis, A.rank, "logsumexp", A.shape)
    if a != A.rank - 1:
        perm = tuple(i for i in range(A.rank) if i != a) + (a,)
        return logsumexp(transpose(A, perm), -1)
    m = stop_gradient(amax(A, -1))  # the result is the same for any shift: no cotangent
    return m + log(sum(exp(omega(sub, (1, 0))(A, m)), -1))


__all__ = [
    "lift_from_omega", "postorder",
    "Array", "MoAShapeError", "MoATypeError", "array", "scalar", "iota", "psi", "take", "drop",
    "reverse", "rotate", "transpose", "reshape", "ravel", "catenate", "name", "cast", "add", "sub",
    "mul", "div", "maximum", "minimum", "lt", "le", "gt", "ge", "eq", "ne", "logical_and",
    "logical_or", "logical_not", "neg", "abs_", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid",
    "silu", "where", "outer", "reduce", "inner", "dot", "omega", "sum", "amax", "amin", "mean",
    "square", "softmax", "softmax_lse", "logsumexp", "stop_gradient",
]


# ----------------------------------------------------------------------------- notation


def _vec(xs) -> str:
    return "⟨" + " ".join(str(x) for x in xs) + "⟩"


def moa_str(A: "Array", limit: int = 160) -> str:
    """A one-line MoA rendering of an expression; labelled subterms print as their label."""
    memo: dict[int, str] = {}

    def go(x, top=False) -> str:
        r = memo.get(x.uid)
        if r is not None:
            return r
        if isinstance(x, Input):
            s = x.name
        elif isinstance(x, Literal):
            s = repr(x.value) if isinstance(x.value, float) else str(x.value)
        elif isinstance(x, Iota):
            s = f"ι{x.shape[0]}"
        elif isinstance(x, Cell):
            s = "□" + "₀₁₂₃₄₅₆₇₈₉"[x.position % 10]
        elif isinstance(x, Name):
            s = x.label if not top else go(x.arg)
        elif isinstance(x, StopGradient):
            s = go(x.arg, top)
        elif isinstance(x, Psi):
            s = f"{_vec(x.index)}ψ {go(x.arg)}"
        elif isinstance(x, Take):
            s = f"{x.count}△ {go(x.arg)}"
        elif isinstance(x, Drop):
            s = f"{x.count}▽ {go(x.arg)}"
        elif isinstance(x, Reverse):
            s = f"Φ {go(x.arg)}"
        elif isinstance(x, Rotate):
            s = f"{x.shift}Θ {go(x.arg)}"
        elif isinstance(x, Transpose):
            s = f"⍉{_vec(x.perm)} {go(x.arg)}"
        elif isinstance(x, Reshape):
            s = f"{_vec(x.shape)}ρ̂{'' if x.gamma == 'C' else 'ᶠ'} {go(x.arg)}"
        elif isinstance(x, Cast):
            s = f"{x.dtype.name}({go(x.arg)})"
        elif isinstance(x, Reduce):
            s = f"{_ops.OPS[x.monoid.op].symbol}/ {go(x.arg)}"
        elif isinstance(x, Catenate):
            s = f"{go(x.a)} ⧺ {go(x.b)}"
        elif isinstance(x, Map):
            s = x.op.show([go(c) for c in x.args], "moa")
        elif isinstance(x, Outer):
            s = f"{go(x.a)} {x.op.symbol}.× {go(x.b)}"
        elif isinstance(x, Inner):
            s = f"{go(x.a)} {_ops.OPS[x.monoid.op].symbol}.{x.op.symbol} {go(x.b)}"
        elif isinstance(x, Omega):
            inner = go(x.body)
            s = f"Ω{_vec(x.ranks)}(λ{' '.join(go(c) for c in x.cells)}. {inner})({', '.join(go(a) for a in x.args)})"
        else:  # pragma: no cover
            raise TypeError(type(x))
        if not top and not isinstance(x, (Input, Literal, Iota, Cell, Name)) and " " in s:
            s = f"({s})"
        memo[x.uid] = s
        return s

    out = go(A, top=True)
    if len(out) > limit:
        out = out[: limit - 1] + "…"
    return out
