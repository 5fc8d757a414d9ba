"""Scalar operations and monoids: the one table every stage of moajax shares.

MoA scalar extension lifts a scalar function f to arrays: ⟨p⟩ψ f(A, B) = f(⟨p⟩ψA, ⟨p⟩ψB).
This module only describes the scalar functions — name, arity, printed symbol, dtype rule
and two independent implementations (NumPy for the float64 evaluator, jax.numpy for every
JAX lowering) — and the monoids (op, identity) that reductions are built from.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class ScalarOp:
    """A scalar function f: one row of the table.

    ``result`` is "same" (the operands' dtype), "bool" (comparisons, logic) or "float"
    (defined on floating types only). ``infix`` ops print between their operands.
    """

    name: str
    arity: int
    symbol: str
    result: str
    np_fn: Callable
    jnp_name: str
    infix: bool = False
    float_only: bool = False
    bool_only: bool = False
    int_only: bool = False

    def jnp_fn(self) -> Callable:
        return _jnp_impl(self.name)

    def show(self, args: list, style: str) -> str:
        """f applied to printed operands, in MoA notation (``style`` "moa": ``a + b``, ``exp a``,
        ``where(c, a, b)``) or in a DNF's (``"dnf"``: ``(a + b)``, ``exp(a)``, ``(c ? a : b)``)."""
        dnf = style == "dnf"
        if self.name == "where":
            return f"({args[0]} ? {args[1]} : {args[2]})" if dnf else f"where({', '.join(args)})"
        if self.infix:
            return f"({args[0]} {self.symbol} {args[1]})" if dnf else f"{args[0]} {self.symbol} {args[1]}"
        if dnf:
            return f"−{args[0]}" if self.name == "neg" else f"{self.symbol}({args[0]})"
        return f"{self.symbol} {args[0]}"


def _np_sigmoid(x):
    # 0.5·(1 + tanh(x/2)) is exact in the limit and never overflows, unlike 1/(1+e^{-x}).
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _np_rsqrt(x):
    return 1.0 / np.sqrt(x)


def _np_where(c, a, b):
    return np.where(c, a, b)


def _np_quot(a, b):
    # C's (and lax.div's) integer quotient: rounded toward zero, not floored as NumPy's //
    q = np.abs(a) // np.abs(b)
    return np.where((np.asarray(a) < 0) != (np.asarray(b) < 0), -q, q)


_TABLE = [
    # name, arity, symbol, result, numpy, infix, float_only, bool_only
    ("add", 2, "+", "same", np.add, True, False, False),
    ("sub", 2, "−", "same", np.subtract, True, False, False),
    ("mul", 2, "×", "same", np.multiply, True, False, False),
    ("div", 2, "÷", "same", np.divide, True, True, False),
    ("maximum", 2, "⌈", "same", np.maximum, True, False, False),
    ("minimum", 2, "⌊", "same", np.minimum, True, False, False),
    ("lt", 2, "<", "bool", np.less, True, False, False),
    ("le", 2, "≤", "bool", np.less_equal, True, False, False),
    ("gt", 2, ">", "bool", np.greater, True, False, False),
    ("ge", 2, "≥", "bool", np.greater_equal, True, False, False),
    ("eq", 2, "=", "bool", np.equal, True, False, False),
    ("ne", 2, "≠", "bool", np.not_equal, True, False, False),
    ("logical_and", 2, "∧", "bool", np.logical_and, True, False, True),
    ("logical_or", 2, "∨", "bool", np.logical_or, True, False, True),
    ("logical_not", 1, "¬", "bool", np.logical_not, False, False, True),
    ("neg", 1, "−", "same", np.negative, False, False, False),
    ("abs", 1, "|·|", "same", np.abs, False, False, False),
    ("exp", 1, "exp", "same", np.exp, False, True, False),
    ("log", 1, "log", "same", np.log, False, True, False),
    ("sqrt", 1, "√", "same", np.sqrt, False, True, False),
    ("rsqrt", 1, "rsqrt", "same", _np_rsqrt, False, True, False),
    ("tanh", 1, "tanh", "same", np.tanh, False, True, False),
    ("sigmoid", 1, "σ", "same", _np_sigmoid, False, True, False),
    ("silu", 1, "silu", "same", lambda x: x * _np_sigmoid(x), False, True, False),
    ("where", 3, "where", "same", _np_where, False, False, False),
]

OPS: dict[str, ScalarOp] = {
    name: ScalarOp(name, arity, symbol, result, fn, name, infix, float_only, bool_only)
    for (name, arity, symbol, result, fn, infix, float_only, bool_only) in _TABLE
}
# integer index arithmetic (a score_mod's h // G, q_idx % C: jnp's floor division and
# remainder are written with these, sign and a correction): C's quotient and remainder,
# rounded toward zero (lax.div, lax.rem)
OPS.update({
    "quot": ScalarOp("quot", 2, "quot", "same", _np_quot, "quot", infix=True, int_only=True),
    "rem": ScalarOp("rem", 2, "rem", "same", np.fmod, "rem", infix=True, int_only=True),
    "sign": ScalarOp("sign", 1, "sign", "same", np.sign, "sign"),
})


def _jnp_impl(name: str) -> Callable:
    import jax
    import jax.numpy as jnp
    from jax import lax

    table = {
        "add": jnp.add,
        "sub": jnp.subtract,
        "mul": jnp.multiply,
        "div": jnp.divide,
        "maximum": jnp.maximum,
        "minimum": jnp.minimum,
        "lt": jnp.less,
        "le": jnp.less_equal,
        "gt": jnp.greater,
        "ge": jnp.greater_equal,
        "eq": jnp.equal,
        "ne": jnp.not_equal,
        "logical_and": jnp.logical_and,
        "logical_or": jnp.logical_or,
        "logical_not": jnp.logical_not,
        "neg": jnp.negative,
        "abs": jnp.abs,
        "exp": jnp.exp,
        "log": jnp.log,
        "sqrt": jnp.sqrt,
        "rsqrt": lax.rsqrt,
        "tanh": jnp.tanh,
        "sigmoid": jax.nn.sigmoid,
        "silu": jax.nn.silu,
        "where": jnp.where,
        "quot": lax.div,
        "rem": lax.rem,
        "sign": lax.sign,
    }
    return table[name]


def result_dtype(op: ScalarOp, dtypes: list[np.dtype]) -> np.dtype:
    if op.result == "bool":
        return np.dtype(bool)
    if op.name == "where":
        return dtypes[1]
    return dtypes[0]


# ----------------------------------------------------------------------------- monoids


@dataclasses.dataclass(frozen=True)
class Monoid:
    """(op, identity): op is associative, identity ⊕ x = x. Reductions carry one."""

    name: str
    op: str  # a binary ScalarOp name
    symbol: str  # printed as  Σ / ⌈ / ⌊ / Π / ∧ / ∨

    def identity(self, dtype) -> np.generic:
        dtype = np.dtype(dtype)
        if self.name == "add":
            return dtype.type(0)
        if self.name == "mul":
            return dtype.type(1)
        if self.name == "and":
            return np.bool_(True)
        if self.name == "or":
            return np.bool_(False)
        if dtype.kind == "f" or dtype.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
            return dtype.type(-np.inf if self.name == "max" else np.inf)
        if dtype.kind in "iu":
            info = np.iinfo(dtype)
            return dtype.type(info.min if self.name == "max" else info.max)
        if dtype.kind == "b":
            return np.bool_(self.name == "min")
        raise TypeError(f"monoid {self.name}: no identity for dtype {dtype}")

    def np_reduce(self, x, axis):
        ufunc = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum,
                 "and": np.logical_and, "or": np.logical_or}[self.name]
        return ufunc.reduce(x, axis=axis, initial=self.identity(x.dtype))

    def jnp_reduce(self, x, axis):
        import jax.numpy as jnp

        fn = {"add": jnp.sum, "mul": jnp.prod, "max": jnp.max, "min": jnp.min,
              "and": jnp.all, "or": jnp.any}[self.name]
        if self.name in ("max", "min"):
            return fn(x, axis=axis, initial=self.identity(x.dtype))
        if self.name in ("add", "mul"):
            # in x's dtype: jnp.sum promotes an int32 to int64 under jax_enable_x64, so a walk's
            # int32 carry met an int64 tile sum (lax.scan refuses the carry's type change)
            return fn(x, axis=axis, dtype=x.dtype)
        return fn(x, axis=axis)


MONOIDS: dict[str, Monoid] = {
    "add": Monoid("add", "add", "Σ"),
    "mul": Monoid("mul", "mul", "Π"),
    "max": Monoid("max", "maximum", "⌈"),
    "min": Monoid("min", "minimum", "⌊"),
    "and": Monoid("and", "logical_and", "∧"),
    "or": Monoid("or", "logical_or", "∨"),
}

# The binary op a monoid is built on, and back: maximum ↔ max, …
MONOID_OF_OP = {m.op: m for m in MONOIDS.values()}


def monoid(name_or_op) -> Monoid:
    """Look a monoid up by its name ("add", "max") or by its binary op ("maximum")."""
    key = getattr(name_or_op, "name", name_or_op)
    if isinstance(key, str):
        if key in MONOIDS:
            return MONOIDS[key]
        if key in MONOID_OF_OP:
            return MONOID_OF_OP[key]
    raise ValueError(
        f"no monoid for {name_or_op!r}: reductions take one of {sorted(MONOIDS)} "
        f"or the binary ops {sorted(MONOID_OF_OP)}"
    )
