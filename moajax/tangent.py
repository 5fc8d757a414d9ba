"""Tangents in the algebra: forward-mode derivation on moa expressions, one rule per operation.

For Y = op(A, B, …) and tangents Ȧ, Ḃ (ρȦ = ρA), each rule gives Ẏ as a moa expression,
linear in the tangents, so a forward-mode derivative is an array expression like any kernel
and ψ-reduces to a DNF (only the inputs and their tangents indexed):

    index maps      ψ, △, ▽, Φ, Θ, ⍉, ρ̂, ⧺      Ẏ = the same map of Ȧ (Ȧ ⧺ Ḃ)
    scalar maps     f(A, B)                    Ẏ = ∂f/∂a × Ȧ + ∂f/∂b × Ḃ; where, max/min by
                                               selection (ties share, as in JAX)
    cast            cast(A)                    Ẏ = cast(Ȧ)
    reductions      +/ A                       Ẏ = +/ Ȧ
                    ⌈/ A, ⌊/ A                 Ẏ = +/((A = Y) × Ȧ) ÷ #(A = Y)
                    ×/ A                       Ẏ = +/(Ȧᵢ × ×/ over j ≠ i of Aⱼ)
    inner product   A +.× B                    Ẏ = Ȧ +.× B + A +.× Ḃ (the same contraction);
                                               other op₁.op₂ through Ω
    outer product   A op.× B                   through Ω
    Ω               Ω f (A…)                   Ẏ = Ω (λ cells, tangents. the tangent of f)(A…, Ȧ…)
    label           name(ℓ, A)                 Ẏ = Ȧ
    held constant   stop_gradient(A)           Ẏ = 0

A zero tangent is ``None`` throughout, so a rule never builds a product with zeros. ``jvp``
runs the rules over a DAG in topological order. A tangent map is the transpose of the
adjoint (``moajax.adjoint``): ``runtime.differentiable`` pairs the two kernels, forward mode
running this one and reverse mode the adjoint.
"""

from __future__ import annotations

from typing import Sequence

from moajax import moa
from moajax.adjoint import (AdjointError, general_inner, outer_as_omega, products_but_one, check_closed,
                            broadcast_lead, differentiable, zeros_like)


class TangentError(AdjointError):
    """An operation has no tangent rule (names the operation)."""


# ----------------------------------------------------------------------------- building blocks


def broadcast_to(t: moa.Array, like: moa.Array) -> moa.Array:
    """A scalar tangent extended over ``like`` (a scalar operand of a scalar map): ρ = ρ like."""
    for n, dim in reversed(list(zip(like.shape, like.dims))[t.rank:]):
        t = broadcast_lead(n, dim, t)
    return t


def _sum(*terms):
    """The sum of the tangent terms that are not zero (None), or None."""
    out = None
    for t in terms:
        if t is not None:
            out = t if out is None else moa.add(out, t)
    return out


def _scale(t, f):
    """t × f, or None for a zero tangent."""
    return None if t is None else t * f


# ----------------------------------------------------------------------------- the rules


def _scalar_map(node: moa.Map, ts):
    op = node.op.name
    a = node.args[0]
    b = node.args[1] if len(node.args) > 1 else None
    y = node
    ta = ts[0]
    tb = ts[1] if len(ts) > 1 else None
    if op == "add":
        out = _sum(ta, tb)
    elif op == "sub":
        out = _sum(ta, None if tb is None else moa.neg(tb))
    elif op == "mul":
        out = _sum(_scale(ta, b), _scale(tb, a))
    elif op == "div":  # (ȧ − y ḃ) / b
        out = _sum(ta, None if tb is None else moa.neg(tb * y))
        out = None if out is None else out / b
    elif op in ("maximum", "minimum"):
        wins = moa.gt if op == "maximum" else moa.lt
        za, zb = (ta if ta is not None else 0.0), (tb if tb is not None else 0.0)
        tie = _sum(ta, tb)
        out = moa.where(wins(a, b), za, moa.where(moa.eq(a, b), 0.0 if tie is None else tie * 0.5, zb))
    elif op == "neg":
        out = moa.neg(ta)
    elif op == "abs":
        out = moa.where(moa.gt(a, 0.0), ta, moa.where(moa.lt(a, 0.0), moa.neg(ta), 0.0))
    elif op == "exp":
        out = ta * y
    elif op == "log":
        out = ta / a
    elif op == "sqrt":
        out = ta / (y * 2.0)
    elif op == "rsqrt":
        out = ta * (y / a) * -0.5
    elif op == "tanh":
        out = ta * (1.0 - y * y)
    elif op == "sigmoid":
        out = ta * (y * (1.0 - y))
    elif op == "silu":
        s = moa.sigmoid(a)
        out = ta * (s * (1.0 + a * (1.0 - s)))
    elif op == "where":
        tx, tz = ts[1], ts[2]
        out = moa.where(node.args[0], tx if tx is not None else 0.0, tz if tz is not None else 0.0)
    else:  # comparisons and logic give bool: never reached with a tangent
        raise TangentError(f"no tangent rule for the scalar op {op!r}")
    return out if out is None or out.rank == node.rank else broadcast_to(out, node)


def _rule(node, ts):
    """Ẏ for ``node`` given its operands' tangents ``ts`` (None: zero), or None."""
    if all(t is None for t in ts):
        return None
    A = node.children[0] if node.children else None
    ta = ts[0] if ts else None
    if isinstance(node, moa.Name):
        return ta
    if isinstance(node, moa.StopGradient):
        return None
    if isinstance(node, moa.Cast):
        return moa.cast(ta, node.dtype)
    if isinstance(node, moa.Transpose):
        return moa.transpose(ta, node.perm)
    if isinstance(node, moa.Reverse):
        return moa.reverse(ta)
    if isinstance(node, moa.Rotate):
        return moa.rotate(node.shift, ta)
    if isinstance(node, moa.Reshape):
        return moa.reshape(ta, node.shape, dims=node.dims, gamma=node.gamma)
    if isinstance(node, moa.Take):
        return moa.take(node.count, ta)
    if isinstance(node, moa.Drop):
        return moa.drop(node.count, ta)
    if isinstance(node, moa.Psi):
        return moa.psi(node.index, ta)
    if isinstance(node, moa.Catenate):
        return moa.catenate(ta if ta is not None else zeros_like(node.a), ts[1] if ts[1] is not None else zeros_like(node.b))
    if isinstance(node, moa.Map):
        return _scalar_map(node, ts)
    if isinstance(node, moa.Reduce):
        if node.monoid.name == "add":
            return moa.sum(ta, 0)
        if node.monoid.name in ("max", "min"):
            n, dim = A.shape[0], A.dims[0]
            hit = moa.eq(A, broadcast_lead(n, dim, node))
            count = moa.sum(moa.cast(hit, ta.dtype), 0)
            return moa.sum(moa.where(hit, ta, 0.0), 0) / count
        if node.monoid.name == "mul":
            return moa.sum(ta * products_but_one(A), 0)
        raise TangentError(f"no tangent rule for the reduction {moa._ops.OPS[node.monoid.op].symbol}/ ({node.monoid.name})")
    if isinstance(node, moa.Inner):
        if node.monoid.name == "add" and node.op.name == "mul":
            tb = ts[1]
            return _sum(None if ta is None else moa.inner("add", "mul", ta, node.b),
                        None if tb is None else moa.inner("add", "mul", node.a, tb))
        return _through(general_inner, node, ts)
    if isinstance(node, moa.Outer):
        return _through(outer_as_omega, node, ts)
    if isinstance(node, moa.Omega):
        return _omega(node, ts)
    raise TangentError(f"no tangent rule for {type(node).__name__}")


def _through(equivalent, node, ts):
    """Ẏ through ``equivalent(node, *operands)``, an expression of the same array, built over a
    fresh placeholder per operand (then put back)."""
    holders = [moa.array(f"_operand{i}_{c.uid}", c.shape, c.dims, c.dtype) for i, c in enumerate(node.children)]
    (t,) = jvp([equivalent(node, *holders)], holders, ts)
    return None if t is None else moa.substitute(t, dict(zip(holders, node.children)))


def _omega(node: moa.Omega, ts):
    """Ẏ = Ω(λ cells, tangent cells. the tangent of the body)(A…, Ȧ…): a tangent is passed
    with its argument's cell rank, only where it is not zero."""
    check_closed(node, TangentError, "tangent")
    moving = [i for i, t in enumerate(ts) if t is not None]
    k = len(node.args)
    zero: list = []

    def cell_tangent(*xs):
        cells, tcells = xs[:k], xs[k:]
        body = moa.substitute(node.body, dict(zip(node.cells, cells)))
        (t,) = jvp([body], [cells[i] for i in moving], tcells)
        if t is None:
            zero.append(True)
            return zeros_like(body)
        return t

    ranks = tuple(node.ranks) + tuple(node.ranks[i] for i in moving)
    out = moa.omega(cell_tangent, ranks)(*node.args, *[ts[i] for i in moving])
    return None if zero else out


# ----------------------------------------------------------------------------- the driver


def jvp(outputs: Sequence[moa.Array], wrt: Sequence[moa.Array], tangents: Sequence[moa.Array]) -> tuple:
    """The tangents (moa expressions) of ``outputs`` when the nodes ``wrt`` move along
    ``tangents`` (ρ each as its node; None: it stays): one per output, None where no output
    depends on a moving node (or the output is not differentiable)."""
    for w, t in zip(wrt, tangents):
        if t is not None and tuple(w.shape) != tuple(t.shape):
            raise ValueError(f"jvp: tangent shape {list(t.shape)} does not match its array's shape {list(w.shape)}")
    given = {w.uid: t for w, t in zip(wrt, tangents) if t is not None and differentiable(w.dtype)}
    dot: dict = {}
    for x in moa.postorder(outputs):  # operands first
        if x.uid in given:
            dot[x.uid] = given[x.uid]
        elif x.children and differentiable(x.dtype):
            dot[x.uid] = _rule(x, [dot.get(c.uid) if differentiable(c.dtype) else None for c in x.children])
    return tuple(dot.get(o.uid) if differentiable(o.dtype) else None for o in outputs)


__all__ = ["TangentError", "jvp", "broadcast_to"]
