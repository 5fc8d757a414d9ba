"""A hypothesis generator of random MoA expression DAGs (ranks ≤ 4, every operation).

Values stay in the domain of every op (exp only after tanh, log/sqrt/rsqrt of 1+|x|,
division by 2+tanh) and comparisons only see *exact* operands (inputs and index
rearrangements of them), so both evaluators agree up to rounding.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from moajax import moa

MAX_RANK = 4
DIMS = "abcdefgh"


class Pool:
    def __init__(self):
        self.items: list[tuple[moa.Array, bool]] = []  # (array, exact)
        self.inputs: dict[str, np.ndarray] = {}

    def add(self, a, exact):
        if a.rank <= MAX_RANK and a.size <= 512:
            self.items.append((a, exact))
        return a


@st.composite
def expressions(draw, max_ops: int = 6):
    """(expression, {input name: float64 array}, names of the ops used)."""
    pool = Pool()
    used: list[str] = []
    n_inputs = draw(st.integers(1, 3))
    for i in range(n_inputs):
        rank = draw(st.integers(0, 3))
        shape = tuple(draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank)))
        name = f"x{i}"
        arr = moa.array(name, shape, tuple(f"{DIMS[j]}{i}" for j in range(rank)), np.float64)
        seed = draw(st.integers(0, 2**31 - 1))
        pool.inputs[name] = np.random.default_rng(seed).uniform(-2, 2, size=shape)
        pool.add(arr, True)
    n_ops = draw(st.integers(1, max_ops))
    last = pool.items[-1][0]
    for _ in range(n_ops):
        op = draw(st.sampled_from(OPS))
        res = op(draw, pool)
        if res is not None:
            used.append(op.__name__)
            last = res
    return last, pool.inputs, used


def pick(draw, pool, pred=lambda a, e: True):
    cands = [(a, e) for a, e in pool.items if pred(a, e)]
    if not cands:
        return None
    # favour the newest array, so that the final expression nests many operations
    if draw(st.booleans()):
        return cands[-1]
    return draw(st.sampled_from(cands))


# ---- index operations (keep exactness)

def op_transpose(draw, pool):
    c = pick(draw, pool, lambda a, e: a.rank >= 2)
    if c is None:
        return None
    a, e = c
    perm = draw(st.permutations(range(a.rank)))
    return pool.add(moa.transpose(a, perm), e)


def op_take(draw, pool):
    c = pick(draw, pool, lambda a, e: a.rank >= 1)
    if c is None:
        return None
    a, e = c
    axis = draw(st.integers(0, a.rank - 1))
    k = draw(st.integers(-a.shape[axis], a.shape[axis]).filter(lambda k: k != 0))
    return pool.add(moa.take(k, a, axis=axis), e)


def op_drop(draw, pool):
    c = pick(draw, pool, lambda a, e: a.rank >= 1 and max(a.shape) > 1)
    if c is None:
        return None
    a, e = c
    axis = draw(st.sampled_from([i for i, s in enumerate(a.shape) if s > 1]))
    k = draw(st.integers(-(a.shape[axis] - 1), a.shape[axis] - 1))
    return pool.add(moa.drop(k, a, axis=axis), e)


def op_reverse(draw, pool):
    c = pick(draw, pool, lambda a, e: a.rank >= 1)
    if c is None:
        return None
    a, e = c
    return pool.add(moa.reverse(a, axis=draw(st.integers(0, a.rank - 1))), e)


def op_rotate(draw, pool):
    c = pick(draw, pool, lambda a, e: a.rank >= 1)
    if c is None:
        return None
    a, e = c
    return pool.add(moa.rotate(draw(st.integers(-7, 7)), a, axis=draw(st.integers(0, a.rank - 1))), e)


def op_reshape(draw, pool):
    c = pick(draw, pool, lambda a, e: a.size >= 1)
    if c is None:
        return None
    a, e = c
    n = a.size
    # a random factorisation of τA
    shape, rest = [], n
    for _ in range(draw(st.integers(0, 3))):
        divs = [d for d in range(1, rest + 1) if rest % d == 0]
        d = draw(st.sampled_from(divs))
        shape.append(d)
        rest //= d
    shape.append(rest)
    gamma = draw(st.sampled_from(["C", "F"]))
    return pool.add(moa.reshape(a, shape, gamma=gamma), e)


def op_psi(draw, pool):
    c = pick(draw, pool, lambda a, e: a.rank >= 1)
    if c is None:
        return None
    a, e = c
    k = draw(st.integers(1, a.rank))
    idx = tuple(draw(st.integers(0, s - 1)) for s in a.shape[:k])
    return pool.add(moa.psi(idx, a), e)


def op_catenate(draw, pool):
    c = pick(draw, pool, lambda a, e: a.rank >= 1)
    if c is None:
        return None
    a, e = c
    axis = draw(st.integers(0, a.rank - 1))
    c2 = pick(draw, pool, lambda b, e2: b.rank == a.rank and all(
        b.shape[i] == a.shape[i] for i in range(a.rank) if i != axis))
    b, e2 = c2
    return pool.add(moa.catenate(a, b, axis=axis), e and e2)


def op_iota(draw, pool):
    n = draw(st.integers(1, 5))
    return pool.add(moa.cast(moa.iota(n, "i"), np.float64), True)


# ---- arithmetic

def op_unary(draw, pool):
    c = pick(draw, pool)
    a, _ = c
    f = draw(st.sampled_from(["neg", "abs", "tanh", "sigmoid", "silu", "exp", "log", "sqrt", "rsqrt"]))
    if f == "exp":
        out = moa.exp(moa.tanh(a))
    elif f in ("log", "sqrt", "rsqrt"):
        out = getattr(moa, f)(moa.abs_(a) + 1.0)
    elif f == "abs":
        out = moa.abs_(a)
    else:
        out = getattr(moa, f)(a)
    return pool.add(out, False)


def _same_shape_partner(draw, pool, a):
    c = pick(draw, pool, lambda b, e: b.shape == a.shape or b.rank == 0)
    return c


def op_binary(draw, pool):
    a, ea = pick(draw, pool)
    b, eb = _same_shape_partner(draw, pool, a)
    if draw(st.booleans()):
        a, b, ea, eb = b, a, eb, ea
    f = draw(st.sampled_from(["add", "sub", "mul", "div", "maximum", "minimum", "scalar"]))
    if f == "div":
        out = a / (moa.tanh(b) + 2.0)
    elif f == "scalar":
        out = a * draw(st.sampled_from([0.5, -3.0, 2.0])) + 1.0
    else:
        out = getattr(moa, f)(a, b)
    return pool.add(out, False)


def op_select(draw, pool):
    c = pick(draw, pool, lambda a, e: e)
    if c is None:
        return None
    a, _ = c
    c2 = pick(draw, pool, lambda b, e: e and (b.shape == a.shape or b.rank == 0))
    b, _ = c2  # a itself always qualifies
    cmp = draw(st.sampled_from(["lt", "le", "gt", "ge"]))
    cond = getattr(moa, cmp)(a, b)
    if draw(st.booleans()):
        cond = moa.logical_not(cond)
    x, _ = _same_shape_partner(draw, pool, a if a.rank else b)
    y, _ = _same_shape_partner(draw, pool, a if a.rank else b)
    if not (x.shape == cond.shape or x.rank == 0) or not (y.shape == cond.shape or y.rank == 0):
        return None
    return pool.add(moa.where(cond, x, y), False)


def op_outer(draw, pool):
    c = pick(draw, pool, lambda a, e: a.rank <= 2)
    if c is None:
        return None
    a, _ = c
    b, _ = pick(draw, pool, lambda b, e: b.rank + a.rank <= MAX_RANK)
    f = draw(st.sampled_from(["add", "mul", "maximum", "sub"]))
    return pool.add(moa.outer(getattr(moa, f), a, b), False)


def op_reduce(draw, pool):
    c = pick(draw, pool, lambda a, e: a.rank >= 1)
    if c is None:
        return None
    a, e = c
    m = draw(st.sampled_from(["add", "max", "min", "mul"]))
    if m == "mul":
        a = moa.tanh(a) * 0.5 + 1.0  # keep products of ≤ 4 terms tame
    return pool.add(moa.reduce(m, a, axis=draw(st.integers(0, a.rank - 1))), e and m in ("max", "min"))


def op_inner(draw, pool):
    c = pick(draw, pool, lambda a, e: a.rank >= 1)
    if c is None:
        return None
    a, _ = c
    c2 = pick(draw, pool, lambda b, e: b.rank >= 1 and b.shape[0] == a.shape[-1] and a.rank + b.rank - 2 <= MAX_RANK)
    if c2 is None:
        if a.rank > 3:
            return None
        b = moa.transpose(a)  # ⍉A always fits A's last axis
    else:
        b, _ = c2
    m, f = draw(st.sampled_from([("add", "mul"), ("max", "add"), ("min", "mul"), ("add", "maximum")]))
    return pool.add(moa.inner(m, getattr(moa, f), a, b), False)


def op_omega(draw, pool):
    c = pick(draw, pool, lambda a, e: a.rank >= 2)
    if c is None:
        return None
    a, _ = c
    ra = draw(st.integers(0, a.rank - 1))
    frame = a.shape[: a.rank - ra]
    # partner: shares the frame, or has an empty frame
    c2 = pick(draw, pool, lambda b, e: b.rank >= len(frame) and b.shape[: len(frame)] == frame)
    kind = draw(st.sampled_from(["sub", "mul", "reduce", "dot"]))
    if kind == "reduce":
        return pool.add(moa.omega(lambda x: moa.amax(x, 0) if x.rank else x, ra)(a), False)
    if c2 is None:
        return None
    b, _ = c2
    rb = b.rank - len(frame)
    if kind == "dot":
        def f(x, y):
            if x.rank >= 1 and y.rank >= 1 and x.shape[-1] == y.shape[0]:
                return moa.dot(x, y)
            return moa.sum(moa.outer(moa.mul, x, y), 0) if (x.rank + y.rank) >= 1 else x * y
        res = moa.omega(f, (ra, rb))(a, b)
        return pool.add(res, False) if res.rank <= MAX_RANK else None

    def g(x, y):
        if x.shape == y.shape or y.rank == 0 or x.rank == 0:
            return getattr(moa, kind)(x, y)
        return getattr(moa, kind)(x, moa.sum(moa.ravel(y), 0))
    return pool.add(moa.omega(g, (ra, rb))(a, b), False)


def op_name(draw, pool):
    a, e = pick(draw, pool)
    return pool.add(moa.name(draw(st.sampled_from(["u", "w", "score"])), a), e)


OPS = [op_name, 
    op_transpose, op_take, op_drop, op_reverse, op_rotate, op_reshape, op_psi, op_catenate, op_iota,
    op_unary, op_binary, op_select, op_outer, op_reduce, op_inner, op_omega,
]
