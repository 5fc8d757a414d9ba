"""A scalar JAX function traced into the algebra: its jaxpr becomes moa operations.

    fn = ScalarFn.trace(score_mod, [np.float32, np.int32, np.int32, np.int32, np.int32], "score_mod")
    y = fn.apply([score, b, h, q_idx, kv_idx], consts)   # moa arrays, scalar-extended

A user function written with ``jax.numpy`` on scalars (FlexAttention's ``score_mod``) is traced
once by ``jax.make_jaxpr``; each equation becomes the moa operation of the same meaning,
applied elementwise by scalar extension to whatever arrays stand for its arguments (the
[t s] score, ι t and ι s, a head index), so the function is part of the kernel's array
expression: ψ-reduced into its DNF, lowered by both backends, differentiated by the adjoint
and tangent rules. A value the function closes over (a table of relative-position biases, the
slopes of ALiBi) is a constant of the jaxpr; it becomes an input of the kernel (``consts``),
so that its gradient flows. Reading such a table at a computed index (``table[i]``) is the
one-hot contraction +/ (ι n = i) × table.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moajax import moa

_UNARY = {"neg": moa.neg, "exp": moa.exp, "log": moa.log, "tanh": moa.tanh, "logistic": moa.sigmoid,
          "sqrt": moa.sqrt, "rsqrt": moa.rsqrt, "abs": moa.abs_, "not": moa.logical_not, "sign": moa.sign}
# lax.div of integers is C's quotient (jnp's // adds the floor's correction around it)
_BINARY = {"add": moa.add, "sub": moa.sub, "mul": moa.mul,
           "div": lambda a, b: (moa.quot if np.dtype(a.dtype).kind in "iu" else moa.div)(a, b),
           "rem": moa.rem, "max": moa.maximum,
           "min": moa.minimum, "lt": moa.lt, "le": moa.le, "gt": moa.gt, "ge": moa.ge, "eq": moa.eq,
           "ne": moa.ne, "and": moa.logical_and, "or": moa.logical_or}


class TraceError(TypeError):
    """A traced function uses something the algebra cannot express (names it)."""


@dataclasses.dataclass(frozen=True, eq=False)
class ScalarFn:
    """A traced scalar function: its closed jaxpr, hashed and compared by its text and the
    avals of its constants (the constants' values are arguments, not part of its identity)."""

    name: str
    jaxpr: object  # jax.extend.core.ClosedJaxpr
    text: str  # the jaxpr and its constants' avals
    infinite: bool = False  # ``may_be_infinite``: part of the key, so of the kernel's identity

    @property
    def key(self) -> str:
        return f"{self.text}|{self.infinite}"

    @staticmethod
    def trace(fn, dtypes, name: str) -> "ScalarFn":
        """Trace ``fn`` on scalars of ``dtypes``; it must return one scalar."""
        import jax

        try:
            closed = jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct((), np.dtype(d)) for d in dtypes])
        except TypeError as e:
            # a NumPy table indexed at a traced index (np.ndarray[q_idx]) asks the tracer for a value
            if isinstance(e, jax.errors.TracerArrayConversionError):
                raise TypeError(f"{name}: indexes a NumPy array at a traced index; a table it reads must be a jax "
                                f"array: jnp.asarray(table) (could not be traced on {len(dtypes)} scalars: {e})") from None
            raise TypeError(f"{name}: could not be traced on {len(dtypes)} scalars ({e})") from None
        outs = closed.out_avals
        if len(outs) != 1 or tuple(outs[0].shape) != ():
            raise ValueError(f"{name}: must return one scalar, got {[tuple(o.shape) for o in outs]}")
        consts = ", ".join(f"{np.dtype(c.dtype).name}{list(np.shape(c))}" for c in closed.consts)
        return ScalarFn(name, closed, f"{closed.jaxpr}|{consts}", may_be_infinite(closed))

    def as_infinite(self) -> "ScalarFn":
        """This function taken to give ±∞ (another key, so a kernel of its own)."""
        return dataclasses.replace(self, infinite=True)

    @property
    def traced_tables(self) -> list:
        """The indices of the float constants known only as tracers (a table closed over as a
        jit argument): ``may_be_infinite`` cannot see their values."""
        import jax
        import jax.numpy as jnp

        return [i for i, c in enumerate(self.jaxpr.consts)
                if isinstance(c, jax.core.Tracer) and jnp.issubdtype(c.dtype, jnp.inexact)]

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, ScalarFn) and self.key == other.key

    def __repr__(self):
        return f"<traced {self.name}: {len(self.jaxpr.jaxpr.eqns)} ops>"

    @property
    def out_dtype(self):
        return np.dtype(self.jaxpr.out_avals[0].dtype)

    @property
    def consts(self) -> list:
        """The closed-over values, in order: the arrays ``apply`` takes as ``consts``. A table of
        rank ≥ 2 (a bias per head and distance, document ids per batch element) comes
        flattened, in C order: the function reads it one element at a time, at the flat index
        of its indices (``_flat_index``), so every kernel sees 1-D tables."""
        import jax.numpy as jnp

        return [jnp.reshape(c, (-1,)) if np.ndim(c) >= 2 else c for c in self.jaxpr.consts]

    def apply(self, args, consts=()):
        """The function applied elementwise to moa arrays ``args`` (scalar-extended), its
        constants read from the moa arrays ``consts``."""
        jaxpr = self.jaxpr.jaxpr
        if len(consts) != len(jaxpr.constvars):
            raise ValueError(f"{self.name}: {len(jaxpr.constvars)} constants, got {len(consts)}")
        return _eval(self.name, jaxpr, list(consts), list(args))


def may_be_infinite(closed) -> bool:
    """Whether the traced function can give ±∞ from finite arguments: its code holds an
    infinite float literal (``-jnp.inf``: a mask written FlexAttention's way), a float constant
    with an infinite entry, or a float ``log`` or a division but by a nonzero literal (log 0,
    x ÷ 0). Conservative: any such occurrence counts, whether or not it reaches the result. A
    constant whose values are unknown while tracing (a jit argument closed over) counts as
    finite here (``traced_tables``: the caller looks at its values when it runs);
    overflow (exp of a large score) is not looked for."""
    import jax
    import jax.numpy as jnp

    def floating(x) -> bool:
        return jnp.issubdtype(x.dtype, jnp.inexact)

    def walk(jaxpr) -> bool:
        for eqn in jaxpr.eqns:
            for v in eqn.invars:
                if type(v).__name__ == "Literal" and floating(v.aval) and not np.all(np.isfinite(np.asarray(v.val, np.float64))):
                    return True
            if eqn.primitive.name in ("log", "div") and floating(eqn.outvars[0].aval):
                d = eqn.invars[-1]  # a division by a nonzero literal (s / 2.0) stays finite
                if not (eqn.primitive.name == "div" and type(d).__name__ == "Literal" and float(d.val) != 0):
                    return True
            for p in eqn.params.values():
                inner = getattr(p, "jaxpr", p)
                if hasattr(inner, "eqns") and walk(inner):
                    return True
        return False

    if any(floating(c) and not isinstance(c, jax.core.Tracer) and not np.all(np.isfinite(np.asarray(c, np.float64)))
           for c in closed.consts):
        return True
    return walk(closed.jaxpr)


def _literal(x):
    val = np.asarray(x.val)
    dt = np.dtype(x.aval.dtype)
    if val.shape != ():
        raise TraceError(f"an array literal of shape {list(val.shape)} (only scalars are inlined)")
    return moa.scalar(val.item(), dt)


def _eval(name, jaxpr, consts, args):
    env: dict = {}

    def read(v):
        if type(v).__name__ == "Literal":
            return _literal(v)
        return env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for eqn in jaxpr.eqns:
        prim = eqn.primitive.name
        xs = [read(v) for v in eqn.invars]
        try:
            out = _op(name, prim, eqn, xs)
        except moa.MoATypeError as e:  # (a remainder of floats: s % 1.0) named by the function
            raise TraceError(f"{name}: {prim} of {[np.dtype(x.dtype).name for x in xs]}: {e}") from None
        for v, o in zip(eqn.outvars, out if isinstance(out, (list, tuple)) else [out]):
            env[v] = o
    (res,) = [read(v) for v in jaxpr.outvars]
    return res


def _op(name, prim, eqn, xs):
    if prim in _UNARY:
        return _UNARY[prim](xs[0])
    if prim in _BINARY:
        return _BINARY[prim](xs[0], xs[1])
    if prim == "integer_pow":
        y = eqn.params["y"]
        if y < 1:
            raise TraceError(f"{name}: integer_pow with exponent {y} (only positive powers)")
        out = xs[0]
        for _ in range(y - 1):
            out = out * xs[0]
        return out
    if prim == "square":
        return xs[0] * xs[0]
    if prim == "select_n":  # select_n(p, x₀, x₁): x₁ where p else x₀
        if len(xs) != 3:
            raise TraceError(f"{name}: select_n with {len(xs) - 1} cases (only two)")
        pred = xs[0] if xs[0].dtype == np.bool_ else moa.ne(xs[0], 0)
        return moa.where(pred, xs[2], xs[1])
    if prim == "convert_element_type":
        return moa.cast(xs[0], eqn.params["new_dtype"])
    if prim in ("pjit", "jit", "closed_call", "eval_jaxpr", "custom_jvp_call", "custom_vjp_call"):  # (eval_jaxpr: JAX > 0.11.1)
        inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr") or eqn.params.get("fun_jaxpr")
        inner = getattr(inner, "jaxpr", inner)
        consts = list(getattr(eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr"), "consts", []))
        if consts:
            raise TraceError(f"{name}: a nested call with constants of its own")
        return _eval(name, inner, [], xs)
    if prim == "dynamic_slice":  # table[i] of a closed-over table: (one-hot) +/ (ι n = i) × table
        table, index = xs[0], xs[1:]
        shape = tuple(eqn.invars[0].aval.shape)
        if eqn.params["slice_sizes"] != (1,) * len(shape) or table.rank != 1 or table.shape[0] != int(np.prod(shape)):
            raise TraceError(f"{name}: reads more than one element of a table of shape {list(shape)}; read one "
                             "element at a time: table[h, k], not a row, table[h][k] (a dynamic_slice of "
                             f"{list(eqn.params['slice_sizes'])})")
        return _one_hot_read(table, index[0] if len(shape) == 1 else _flat_index(index, shape))
    if prim == "slice":  # table[2] (or table[h, 0] at a constant index): ⟨flat⟩ψ table, as one element
        shape = tuple(eqn.invars[0].aval.shape)
        start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
        if any(b - a != 1 for a, b in zip(start, limit)) or xs[0].rank != 1 or xs[0].shape[0] != int(np.prod(shape)):
            raise TraceError(f"{name}: reads more than one element of a table of shape {list(shape)}; read one "
                             f"element at a time (a slice {list(start)} … {list(limit)})")
        flat = int(np.ravel_multi_index(tuple(start), shape))
        return moa.reshape(moa.psi((flat,), xs[0]), (1,) * len(shape), dims=tuple(f"one{d}" for d in range(len(shape))))
    if prim == "squeeze":  # of a table read's trailing axis of 1
        return _squeeze_table_read(name, xs[0])
    raise TraceError(f"{name}: the operation {prim!r} has no counterpart in the algebra")


def _flat_index(index, shape) -> moa.Array:
    """The C-order flat index of (i₀, …, i_{r−1}) in an array of ``shape``, each clamped to
    0 ⌈ i_d ⌊ n_d − 1 as dynamic_slice clamps its starts: a read past an end of one axis is
    that axis' end entry, never another row's."""
    flat = None
    for d, (i, n) in enumerate(zip(index, shape)):
        term = moa.minimum(moa.maximum(i, 0), n - 1) * int(np.prod(shape[d + 1:], dtype=np.int64))
        flat = term if flat is None else flat + term
    return flat


def _one_hot_read(table: moa.Array, index: moa.Array) -> moa.Array:
    """table[index] for every element of ``index`` (any shape): Σ_j (ι n = i) × table[j],
    i = 0 ⌈ index ⌊ n − 1 (dynamic_slice clamps its start: jnp's table[i] wraps a negative i
    once, then clamps, so a read past either end is the end entry, never 0), with a trailing
    axis of 1 (dynamic_slice's), removed by the squeeze that follows."""
    import jax.numpy as jnp  # (NumPy's issubdtype does not count bfloat16 as inexact)

    n = table.shape[0]

    def one(ix, tab):
        hit = moa.eq(moa.iota(n, table.dims[0]), moa.minimum(moa.maximum(ix, 0), n - 1))
        zero = 0.0 if jnp.issubdtype(table.dtype, jnp.inexact) else 0  # the table's own zero: an int table's is 0
        return moa.reshape(moa.sum(moa.where(hit, tab, zero), 0), (1,), dims=("one",))

    return moa.omega(one, (0, 1))(index, table)


def _squeeze_table_read(name, x: moa.Array) -> moa.Array:
    if x.rank and all(n == 1 for n in x.shape):  # one element read at a constant index: a scalar
        return moa.psi((0,) * x.rank, x)
    if not x.rank or x.shape[-1] != 1:
        raise TraceError(f"{name}: squeeze of shape {list(x.shape)}")
    return moa.omega(lambda c: moa.psi((0,), c), 1)(x) if x.rank > 1 else moa.psi((0,), x)


__all__ = ["ScalarFn", "TraceError", "may_be_infinite"]
