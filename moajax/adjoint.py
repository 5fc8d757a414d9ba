"""Adjoints in the algebra: reverse-mode derivation on moa expressions, one rule per operation.

For Y = op(A, B, …) and a cotangent dY (ρ dY = ρY), each rule gives the cotangents of the
operands as new moa expressions, so a backward pass is an array expression like any kernel
and ψ-reduces to a DNF (only the inputs and the cotangents indexed):

    ψ-selection     p ψ A, k △ A, k ▽ A    dA = dY at its index, 0 elsewhere (⧺ with zeros:
                                           the scatter of a map that is not onto)
    index maps      Φ A, k Θ A, ⍉σ A, ρ' ρ̂ A     dA = Φ dY, (−k) Θ dY, ⍉σ⁻¹ dY, ρA ρ̂ dY
    catenation      A ⧺ B                  dA = a₀ △ dY,  dB = a₀ ▽ dY
    scalar maps     f(A, B)                dA = dY × ∂f/∂a (summed over the axes a scalar
                                           operand is extended along); where, max/min by selection
    cast            cast(A)                dA = cast(dY) to A's dtype where the cast narrows; a
                                           widening cast passes dY on as it is (below)
    reductions      +/ A                   dA = Ω-broadcast of dY along the reduced axis
                    ⌈/ A, ⌊/ A             dA = (A = Y) × dY ÷ #(A = Y)  (selection; ties share, as in JAX)
                    ×/ A                   dAᵢ = dY × ×/ over j ≠ i of Aⱼ
    inner product   A +.× B                dA = dY +.× ⍉B,  dB = ⍉A +.× dY  (reordered reads;
                                           more axes: nested sums); other op₁.op₂ through Ω
    outer product   A op.× B               through Ω: each element of A against all of B
    Ω               Ω f (A…)               dAᵢ = Ω (the adjoint of f in its cell i)(A…, dY),
                                           summed over the frame where Aᵢ has none
    label           name(ℓ, A)             dA = name(dℓ, dY)
    held constant   stop_gradient(A)       none (softmax and logsumexp: the softmax identity)

``vjp`` runs the rules over a DAG in reverse topological order, adding the cotangents of a
node used more than once. A cotangent is carried in the widest dtype that reached it (a
bfloat16 operand of a float32 expression gets a float32 cotangent: its rules read the operand
widened, exactly), so the paths into a 16-bit value are summed before they are rounded, once,
to the dtype of the array asked for. Rounded at each widening cast, a bfloat16 ALiBi table's
gradient was the difference of two bfloat16 sums (through a softmax row's numerator and
through its sum) that cancel: 1.2e-1 off float64 where its floor is 1.9e-3
(bench/results/table_grad_precision.md). An operation with no rule (an Ω body that captures an array instead
of taking it as an argument) raises ``AdjointError`` naming it. Integer and bool
values have no cotangent.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from moajax import moa


class AdjointError(ValueError):
    """An operation has no adjoint rule (names the operation)."""


def differentiable(dtype) -> bool:
    """Do values of ``dtype`` carry a cotangent? (floating types; not integers, not bool)"""
    return moa._is_float(dtype)


# ----------------------------------------------------------------------------- building blocks


def zeros(shape, dims, dtype) -> moa.Array:
    """An array of zeros, ρ = ``shape``: 0 under Ω over ι of each axis (no input is read)."""
    if not shape:
        return moa.Literal(0.0, dtype)
    inner = zeros(shape[1:], dims[1:], dtype)
    return moa.omega(lambda _: inner, 0)(moa.iota(shape[0], dims[0]))


def zeros_like(A: moa.Array) -> moa.Array:
    return zeros(A.shape, A.dims, A.dtype)


def joined(a, b) -> np.dtype:
    """The dtype two cotangents meet in: the wider of two floating dtypes (float32 for float16
    beside bfloat16, as JAX promotes them), so that neither is rounded."""
    a, b = np.dtype(a), np.dtype(b)
    if a == b:
        return a
    if a.itemsize == b.itemsize:  # (two 16-bit floats; no two wider floats share a size)
        return np.dtype(np.float32)
    return a if a.itemsize > b.itemsize else b


def widened(x: moa.Array, dtype) -> moa.Array:
    """A primal operand read beside a cotangent of ``dtype`` (a floating one widened, exactly):
    a constant as its own dtype holds it (bfloat16's 0.3 is 0.30078125, as the forward used it;
    widened from the Python number, a tie of maximum(x, 0.1) at x = bfloat16(0.1) was missed)."""
    if not differentiable(x.dtype) or x.dtype == dtype:
        return x
    if isinstance(x, moa.Literal):
        return moa.Literal(float(np.asarray(x.value, x.dtype)), dtype, weak=x.weak)
    return moa.cast(x, dtype)


def broadcast_lead(n: int, dim: str, Y: moa.Array) -> moa.Array:
    """Y repeated n times along a new leading axis: ⟨i p⟩ψ = ⟨p⟩ψ Y (Ω over ι n, Y shared)."""
    return moa.omega(lambda _, y: y, (0, Y.rank))(moa.iota(n, dim), Y)


def sum_lead(X: moa.Array, k: int) -> moa.Array:
    """+/ over the k leading axes."""
    for _ in range(k):
        X = moa.sum(X, 0)
    return X


def unbroadcast(g: moa.Array, arg: moa.Array) -> moa.Array:
    """A scalar operand extended over the whole result gets the sum of its cotangents."""
    return sum_lead(g, g.rank) if arg.rank == 0 and g.rank else g


def moveaxis(X: moa.Array, src: int, dst: int) -> moa.Array:
    axes = [a for a in range(X.rank) if a != src]
    axes.insert(dst, src)
    return moa.transpose(X, tuple(axes))


def contract_trailing(X: moa.Array, Y: moa.Array, n: int) -> moa.Array:
    """Σ_q X[a…, q] × Y[b…, q] over the n trailing axes q of both: ρ = (−n ▽ ρX) ⧺ (−n ▽ ρY).
    One axis is X +.× ⍉Y (a reordered read); more are nested sums under Ω."""
    if n == 0:
        return moa.outer(moa.mul, X, Y)
    if n == 1:
        return moa.dot(X, moveaxis(Y, Y.rank - 1, 0))
    x0, y0 = moveaxis(X, X.rank - n, 0), moveaxis(Y, Y.rank - n, 0)
    per = moa.omega(lambda x, y: contract_trailing(x, y, n - 1), (X.rank - 1, Y.rank - 1))(x0, y0)
    return moa.sum(per, 0)


def general_inner(node: moa.Inner, A: moa.Array, B: moa.Array) -> moa.Array:
    """A op₁.op₂ B as op₁/ over l of (Ω over l: ⟨p l⟩ψA op₂.× ⟨l q⟩ψB): the same array,
    built from operations that have adjoints."""
    terms = moa.omega(lambda a, b: moa.outer(node.op.name, a, b), (A.rank - 1, B.rank - 1))(moveaxis(A, A.rank - 1, 0), B)
    return moa.reduce(node.monoid.name, terms, 0)


def outer_as_omega(node: moa.Outer, A: moa.Array, B: moa.Array) -> moa.Array:
    """A op.× B as Ω⟨0, δB⟩(λa b. a op b)(A, B): every element of A against all of B."""
    return moa.omega(lambda a, b: moa._map(node.op, a, b), (0, B.rank))(A, B)


# ----------------------------------------------------------------------------- the rules


def _scalar_map(node: moa.Map, g, need):
    """∂f/∂operand × dY for each operand of a scalar-extended op."""
    op = node.op.name
    a = widened(node.args[0], g.dtype)
    b = widened(node.args[1], g.dtype) if len(node.args) > 1 else None
    y = widened(node, g.dtype)
    if op == "add":
        out = [g, g]
    elif op == "sub":
        out = [g, moa.neg(g)]
    elif op == "mul":
        out = [g * b, g * a]
    elif op == "div":
        out = [g / b, moa.neg(g) * y / b]
    elif op in ("maximum", "minimum"):
        wins = moa.gt if op == "maximum" else moa.lt
        half = g * 0.5  # a tie shares the cotangent, as lax.max's derivative does
        out = [moa.where(wins(a, b), g, moa.where(moa.eq(a, b), half, 0.0)),
               moa.where(wins(b, a), g, moa.where(moa.eq(a, b), half, 0.0))]
    elif op == "neg":
        out = [moa.neg(g)]
    elif op == "abs":
        out = [moa.where(moa.gt(a, 0.0), g, moa.where(moa.lt(a, 0.0), moa.neg(g), 0.0))]
    elif op == "exp":
        out = [g * y]
    elif op == "log":
        out = [g / a]
    elif op == "sqrt":
        out = [g / (y * 2.0)]
    elif op == "rsqrt":
        out = [g * (y / a) * -0.5]
    elif op == "tanh":
        out = [g * (1.0 - y * y)]
    elif op == "sigmoid":
        out = [g * (y * (1.0 - y))]
    elif op == "silu":
        s = moa.sigmoid(a)
        out = [g * (s * (1.0 + a * (1.0 - s)))]
    elif op == "where":
        c = node.args[0]
        out = [None, moa.where(c, g, 0.0), moa.where(c, 0.0, g)]
    else:  # comparisons and logic give bool: never reached with a cotangent
        raise AdjointError(f"no adjoint rule for the scalar op {op!r}")
    return [unbroadcast(d, x) if d is not None and n else None for d, x, n in zip(out, node.args, need)]


def products_but_one(A: moa.Array) -> moa.Array:
    """⟨i p⟩ψ = ×/ over j ≠ i of ⟨j p⟩ψ A (exact where A has zeros, unlike ×/A ÷ A): for each
    i, the product over j of (j = i ? 1 : A[j])."""
    n, dim = A.shape[0], A.dims[0]

    def but(i, a):
        rows = moa.omega(lambda j, row, ii: moa.where(moa.eq(j, ii), 1.0, row), (0, A.rank - 1, 0))
        return moa.reduce("mul", rows(moa.iota(n, dim), a, i), 0)

    return moa.omega(but, (0, A.rank))(moa.iota(n, dim), A)


def _psi_embed(index, shape, dims, dtype, g):
    """dY placed at the constant partial ``index`` of an array of ``shape``, zeros (of ``dtype``,
    the cotangent's) elsewhere."""
    if not index:
        return g
    rest = _psi_embed(index[1:], shape[1:], dims[1:], dtype, g)
    return _place(moa.reshape(rest, (1,) + rest.shape, dims=(dims[0],) + rest.dims), index[0], shape[0], dims, dtype)


def _place(block, start: int, n: int, dims, dtype):
    """``block`` at rows start … start+len−1 of an array with n rows along axis 0, zeros elsewhere."""
    out = block
    if start > 0:
        out = moa.catenate(zeros((start,) + block.shape[1:], dims, dtype), out)
    after = n - start - block.shape[0]
    if after > 0:
        out = moa.catenate(out, zeros((after,) + block.shape[1:], dims, dtype))
    return out


def _rule(node, g, need):
    """The cotangent of each operand of ``node`` (None where not needed), given dY = g."""
    A = node.children[0] if node.children else None
    if isinstance(node, moa.Name):
        label = f"d{node.label}"
        return [moa.name(label, g) if label.isidentifier() else g]
    if isinstance(node, moa.StopGradient):
        return [None]
    if isinstance(node, moa.Cast):
        return [moa.cast(g, joined(g.dtype, A.dtype))]
    if isinstance(node, moa.Transpose):
        return [moa.transpose(g, tuple(np.argsort(node.perm)))]
    if isinstance(node, moa.Reverse):
        return [moa.reverse(g)]
    if isinstance(node, moa.Rotate):
        return [moa.rotate(-node.shift, g)]
    if isinstance(node, moa.Reshape):
        return [moa.reshape(g, A.shape, dims=A.dims, gamma=node.gamma)]
    if isinstance(node, moa.Take):
        k, n = node.count, A.shape[0]
        return [_place(g, 0 if k >= 0 else n - abs(k), n, A.dims, g.dtype)]
    if isinstance(node, moa.Drop):
        k, n = node.count, A.shape[0]
        return [_place(g, k if k >= 0 else 0, n, A.dims, g.dtype)]
    if isinstance(node, moa.Psi):
        return [_psi_embed(node.index, A.shape, A.dims, g.dtype, g)]
    if isinstance(node, moa.Catenate):
        n = node.a.shape[0]
        return [moa.take(n, g) if need[0] else None, moa.drop(n, g) if need[1] else None]
    if isinstance(node, moa.Map):
        return _scalar_map(node, g, need)
    if isinstance(node, moa.Reduce):
        n, dim = A.shape[0], A.dims[0]
        if node.monoid.name == "add":
            return [broadcast_lead(n, dim, g)]
        if node.monoid.name in ("max", "min"):
            # the hit and its count are separate evaluations of A = Y (a DNF keeps no
            # intermediate), and two evaluations of a rounded A may differ by its rounding: the
            # maximum then equals no element and the gradient vanishes. So where A rounds, a
            # compiled kernel's forward saves A and this rule reads the saved values
            # (``kernel.label_selections``); the reference evaluates A once
            # (``reference.Evaluator.reduce_once``). Not clamped: clamping the count would hide a
            # miss as a wrong finite value. (A compiled tangent kernel reads the saved A too)
            hit = moa.eq(A, broadcast_lead(n, dim, node))  # (compared in A's own dtype)
            count = moa.sum(moa.cast(hit, g.dtype), 0)
            return [moa.where(hit, broadcast_lead(n, dim, g / count), 0.0)]
        if node.monoid.name == "mul":
            return [broadcast_lead(n, dim, g) * widened(products_but_one(A), g.dtype)]
        raise AdjointError(f"no adjoint rule for the reduction {moa._ops.OPS[node.monoid.op].symbol}/ ({node.monoid.name})")
    if isinstance(node, moa.Inner):
        if node.monoid.name == "add" and node.op.name == "mul":
            A, B = widened(A, g.dtype), widened(node.b, g.dtype)
            da = contract_trailing(g, B, B.rank - 1) if need[0] else None
            if need[1]:
                at = moveaxis(A, A.rank - 1, 0)  # [l, p…]
                gt = moa.transpose(g, tuple(range(A.rank - 1, g.rank)) + tuple(range(A.rank - 1)))  # [q…, p…]
                db = contract_trailing(at, gt, A.rank - 1)
            else:
                db = None
            return [da, db]
        return _through(general_inner, node, g, need)
    if isinstance(node, moa.Outer):
        return _through(outer_as_omega, node, g, need)
    if isinstance(node, moa.Omega):
        return _omega(node, g, need)
    raise AdjointError(f"no adjoint rule for {type(node).__name__}")


def _through(equivalent, node, g, need):
    """The cotangents of ``node``'s operands through ``equivalent(node, *operands)``, an
    expression of the same array: built over a fresh placeholder per operand (so that an
    operand used twice, as in A +.× A, gets each use's share), which is then put back."""
    holders = [moa.array(f"_operand{i}_{c.uid}", c.shape, c.dims, c.dtype) for i, c in enumerate(node.children)]
    grads = vjp([equivalent(node, *holders)], [g], holders, carried=True)
    back = dict(zip(holders, node.children))
    return [moa.substitute(d, back) if n and d is not None else None for d, n in zip(grads, need)]


def _omega(node: moa.Omega, g, need):
    """dAᵢ = Ω(λ cells, dy. the adjoint of the body in cell i)(A…, dY); an argument shared by
    every frame index (empty frame) gets the sum over the frame."""
    check_closed(node, AdjointError, "adjoint")
    k = len(node.args)
    nf = node.rank - node.body.rank
    out = []
    for i in range(k):
        if not need[i]:
            out.append(None)
            continue

        unreached: list = []

        def cell_adjoint(*xs, i=i):
            cells, dy = xs[:k], xs[k]
            body = moa.substitute(node.body, dict(zip(node.cells, cells)))
            (d,) = vjp([body], [dy], [cells[i]], carried=True)
            if d is None:
                unreached.append(i)
                return zeros_like(cells[i])
            return d

        d = moa.omega(cell_adjoint, tuple(node.ranks) + (node.body.rank,))(*node.args, g)
        if unreached:  # no cotangent flows to this argument (e.g. a held-constant max): none
            out.append(None)
            continue
        out.append(d if node.frame[i] else sum_lead(d, nf))
    return out


def check_closed(node: moa.Omega, error, rule: str) -> None:
    """An Ω body must take every array it reads as an argument: a captured one has no rule
    (its derivative would have to cross the Ω's frame); raise ``error`` naming it."""
    own = set(node.cells)
    for x in moa.nodes(node.body):
        if isinstance(x, moa.Input) or (isinstance(x, moa.Cell) and x not in own and not bound_inside(node, x)):
            raise error(
                f"no {rule} rule for an Ω body that captures {moa.moa_str(x, 40)} instead of taking it as an "
                "argument: pass it to Ω (with the cell rank of its whole shape)"
            )


def bound_inside(node: moa.Omega, cell: moa.Cell) -> bool:
    """Is ``cell`` bound by an Ω nested in ``node``'s body (not captured from outside)?"""
    return any(isinstance(x, moa.Omega) and cell in x.cells for x in moa.nodes(node.body))


# ----------------------------------------------------------------------------- the driver


def vjp(outputs: Sequence[moa.Array], cotangents: Sequence[moa.Array], wrt: Sequence[moa.Array], *,
        carried: bool = False) -> tuple:
    """The cotangents (moa expressions) of the nodes ``wrt`` for Σᵢ ⟨outputᵢ, cotangentᵢ⟩:
    one per node of ``wrt``, None where no output depends on it (or it is not differentiable);
    each in its node's dtype, rounded once from the dtype it was carried in (``carried``: left
    in that dtype, for a rule that goes on deriving through it)."""
    for o, c in zip(outputs, cotangents):
        if tuple(o.shape) != tuple(c.shape):
            raise ValueError(f"vjp: cotangent shape {list(c.shape)} does not match output shape {list(o.shape)}")
    order = moa.postorder(outputs)
    targets = {w.uid for w in wrt}
    reaches: dict = {}
    for x in order:  # operands first
        reaches[x.uid] = x.uid in targets or any(reaches[c.uid] for c in x.children)
    ct: dict = {}

    def add(node, d):
        if not differentiable(node.dtype):
            return
        prev = ct.get(node.uid)
        if prev is not None and prev.dtype != d.dtype:  # two paths meet in the wider dtype
            wide = joined(prev.dtype, d.dtype)
            prev, d = moa.cast(prev, wide), moa.cast(d, wide)
        ct[node.uid] = d if prev is None else moa.add(prev, d)

    for o, c in zip(outputs, cotangents):
        if reaches[o.uid]:  # (a seed narrower than its output is read in the output's dtype)
            add(o, c if not differentiable(c.dtype) or joined(c.dtype, o.dtype) == c.dtype
                else moa.cast(c, joined(c.dtype, o.dtype)))
    for x in reversed(order):  # users before operands
        g = ct.get(x.uid)
        if g is None or x.uid in targets and not x.children:
            continue
        need = [reaches[c.uid] and differentiable(c.dtype) for c in x.children]
        if not any(need):
            continue
        for c, d in zip(x.children, _rule(x, g, need)):
            if d is not None and reaches[c.uid]:
                add(c, d)
    found = (ct.get(w.uid) for w in wrt)
    if carried:
        return tuple(found)
    return tuple(d if d is None else moa.cast(d, w.dtype) for d, w in zip(found, wrt))


__all__ = ["AdjointError", "vjp", "zeros", "zeros_like", "differentiable", "contract_trailing", "broadcast_lead",
           "general_inner", "outer_as_omega", "products_but_one", "check_closed", "joined", "widened"]
