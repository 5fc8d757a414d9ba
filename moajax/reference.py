"""DNF → JAX: the reference semantics of any DNF, correct rather than fast.

Each subexpression e is evaluated once, as an array over exactly its free index variables
(named axes, broadcast by name), so a loop-invariant reduction such as the row max inside
a softmax costs one row, never one per element. A +-reduction of a product becomes one
``jnp.einsum`` (a dot_general), so the reference is exact in the DNF's dtypes and cheap
enough to be the oracle for every ONF. The result is a plain function of jax arrays:
``jax.jit``, ``jax.vmap``, ``jax.grad`` and ``jax.make_jaxpr`` all accept it.
"""

from __future__ import annotations

import math
import string
from typing import Callable

import numpy as np

from moajax import dnf as D
from moajax import ops as _ops
from moajax.ix import Ix, Var


class Named:
    """A jax array whose axes are index variables (``vars[i]`` ↔ axis i)."""

    __slots__ = ("data", "vars")

    def __init__(self, data, vars_):
        self.data, self.vars = data, tuple(vars_)


def align(parts: list[Named], rank=None):
    """Broadcast named arrays against each other: (datas, union of vars).

    The union is in first-seen order, or sorted by ``rank`` (a var → int map) when given.
    Axis sizes come from the data (a tile of a variable is as long as its range)."""
    import jax.numpy as jnp

    order: list[Var] = []
    for p in parts:
        for v in p.vars:
            if v not in order:
                order.append(v)
    if rank is not None:
        order.sort(key=lambda v: rank.get(v.name, 1 << 20))
    out = []
    for p in parts:
        if not p.vars:
            out.append(p.data)  # a scalar broadcasts as it is (and stays a literal in kernels)
            continue
        present = [v for v in order if v in p.vars]
        perm = [p.vars.index(v) for v in present]
        d = jnp.transpose(p.data, perm) if perm != list(range(len(perm))) else p.data
        if len(present) != len(order):
            shape, k = [], 0
            for v in order:
                if v in p.vars:
                    shape.append(d.shape[k])
                    k += 1
                else:
                    shape.append(1)
            d = jnp.reshape(d, shape)
        out.append(d)
    return out, tuple(order)


def index_array(ix: Ix) -> Named:
    """The values of an index expression over its free variables (int32)."""
    import jax.numpy as jnp

    vs = sorted(ix.free_vars())
    env = {}
    for i, v in enumerate(vs):
        shape = [1] * len(vs)
        shape[i] = v.extent
        env[v] = jnp.arange(v.extent, dtype=jnp.int32).reshape(shape)
    val = ix.evaluate(env)
    if not vs:
        return Named(jnp.asarray(val, jnp.int32), ())
    return Named(jnp.broadcast_to(jnp.asarray(val, jnp.int32), tuple(v.extent for v in vs)), vs)


class Evaluator:
    """Evaluates DNF expressions over whole index ranges, given the input arrays."""

    def __init__(self, arrays: dict, precision=None):
        from jax import lax

        self.arrays = arrays
        self.memo: dict[int, tuple] = {}
        self.reductions: dict[tuple, list] = {}  # (monoid, extent, dtype) → [(Red, its value)]
        self.precision = lax.Precision.HIGHEST if precision is None else precision

    def __call__(self, e: D.Expr) -> Named:
        hit = self.memo.get(id(e))
        if hit is not None and hit[0] is e:
            return hit[1]
        out = self._eval(e)
        # keep e with its value: a node built during evaluation (a reciprocal factor) must
        # not be collected and its id reused by another node while the memo lives
        self.memo[id(e)] = (e, out)
        return out

    def _eval(self, e):
        import jax.numpy as jnp

        if isinstance(e, D.Read):
            return self.read(e)
        if isinstance(e, D.Lit):
            return Named(jnp.asarray(e.value, dtype=e.dtype), ())
        if isinstance(e, D.IndexValue):
            n = index_array(e.ix)
            return Named(n.data.astype(e.dtype), n.vars)
        if isinstance(e, D.Tag):
            return self(e.body)
        if isinstance(e, D.Convert):
            x = self(e.arg)
            return Named(x.data.astype(e.dtype), x.vars)
        if isinstance(e, D.Call):
            parts = [self(c) for c in e.children]
            datas, vs = align(parts)
            return Named(_ops.OPS[e.op].jnp_fn()(*datas), vs)
        if isinstance(e, D.Red):
            return self.reduce_once(e)
        raise TypeError(f"the reference evaluator cannot evaluate {type(e).__name__}")

    def read(self, e: D.Read) -> Named:
        import jax.numpy as jnp

        a = self.arrays[e.array]
        simple = True
        seen: list[Var] = []
        for ax, i in enumerate(e.index):
            if i.is_const:
                continue
            sv = i.as_shifted_var()
            if sv is None or sv[0] in seen:
                simple = False
                break
            v, c = sv
            if c < 0 or c + v.extent > a.shape[ax]:
                simple = False
                break
            seen.append(v)
        if simple:
            # static slices and a transpose: no gather
            idx, vs = [], []
            for ax, i in enumerate(e.index):
                if i.is_const:
                    idx.append(int(np.clip(i.const, 0, a.shape[ax] - 1)))
                else:
                    v, c = i.as_shifted_var()
                    idx.append(slice(c, c + v.extent))
                    vs.append(v)
            return Named(a[tuple(idx)], vs)
        # general case: a gather with broadcast index arrays, clipped (a branch of a select
        # may index outside the array; its value is never used)
        parts = [index_array(i) for i in e.index]
        datas, vs = align(parts)
        full = tuple(v.extent for v in vs)
        idx = tuple(jnp.clip(jnp.broadcast_to(d, full), 0, a.shape[ax] - 1) for ax, d in enumerate(datas))
        return Named(a[idx], vs)

    def reduce_once(self, e: D.Red) -> Named:
        """e's value, computed once for all the reductions it is an instance of: where
        e ≡ r[σ] for an r evaluated before (its free variables renamed, or fixed: ⟨0⟩ of a
        row sum computed for every row), e's array is read from r's. A DNF recomputes a
        value wherever it is used (no intermediate survives), and two evaluations of one sum
        in different contexts (two einsums) may round differently; a selection compares them
        — ⌈/'s adjoint (A = ⌈/A) sees A and A's maximum — so they must be one value, as they
        are in the DNF's meaning (hypothesis found three cases). ``prime`` evaluates the
        most general reductions first."""
        bucket = self.reductions.setdefault((e.monoid, e.var.extent, e.dtype), [])
        for r, value in bucket:
            hit = _instance(value, r, e)
            if hit is not None:
                return hit
        value = self.reduce(e)
        bucket.append((e, value))
        return value

    def prime(self, outputs) -> None:
        """Evaluate the reductions of ``outputs`` most general first (most free variables),
        so that each instance of another is read from it (``reduce_once``)."""
        reds = {id(x): x for o in outputs for x in D.walk(o.body) if isinstance(x, D.Red)}
        for r in sorted(reds.values(), key=lambda x: -math.prod(v.extent for v in x.free)):
            self(r)

    def reduce(self, e: D.Red) -> Named:
        import jax.numpy as jnp

        v = e.var
        mono = _ops.MONOIDS[e.monoid]
        if e.monoid == "add":
            factors = D.product_factors(e.body)
            if len(factors) >= 2:
                return self.contract(factors, v)
        body = self(e.body)
        if v not in body.vars:
            body = Named(jnp.broadcast_to(body.data[None], (v.extent,) + body.data.shape), (v,) + body.vars)
        ax = body.vars.index(v)
        return Named(mono.jnp_reduce(body.data, axis=ax), body.vars[:ax] + body.vars[ax + 1:])

    def contract(self, factors, v: Var) -> Named:
        """Σ_v f₁ × f₂ × … as one einsum (a dot_general for two factors)."""
        import jax.numpy as jnp

        parts = [self(f) for f in factors]
        allv: list[Var] = []
        for p in parts:
            for x in p.vars:
                if x not in allv:
                    allv.append(x)
        if v not in allv:
            allv.append(v)
        letters = {x: string.ascii_letters[i] for i, x in enumerate(allv)}
        out_vars = [x for x in allv if x != v]
        operands, subs = [], []
        for p in parts:
            operands.append(p.data)
            subs.append("".join(letters[x] for x in p.vars))
        if not any(v in p.vars for p in parts):
            # Σ over an axis no factor depends on: n copies of the product
            prod = jnp.einsum(",".join(subs) + "->" + "".join(letters[x] for x in out_vars), *operands,
                              precision=self.precision)
            return Named(prod * jnp.asarray(v.extent, prod.dtype), out_vars)
        spec = ",".join(subs) + "->" + "".join(letters[x] for x in out_vars)
        return Named(jnp.einsum(spec, *operands, precision=self.precision), out_vars)

    def output(self, o: D.Output):
        import jax.numpy as jnp

        x = self(o.body)
        present = [v for v in o.vars if v in x.vars]
        extra = [v for v in x.vars if v not in o.vars]
        if extra:
            raise AssertionError(f"output {o.name} depends on unbound variables {extra}")
        d = jnp.transpose(x.data, [x.vars.index(v) for v in present]) if present else x.data
        shape = [v.extent if v in present else 1 for v in o.vars]
        d = jnp.reshape(d, shape)
        return jnp.broadcast_to(d, tuple(v.extent for v in o.vars)).astype(o.dtype)


def _instance(value: Named, r: D.Red, e: D.Red) -> Named | None:
    """e's value read from r's, where e ≡ r[σ] for a substitution σ of r's free variables
    (a renaming, or any index expressions: ⟨0⟩ of a row computed over every row), else None."""
    import jax.numpy as jnp

    sigma = D.match(r, e, r.free)
    # r's array holds v's range only: an index of e beyond it (⟨1⟩ where r's v has extent 1,
    # as a catenation's second half reads; hypothesis found it) is another value, not in r's
    if sigma is None or any(not (0 <= i.bounds()[0] and i.bounds()[1] < v.extent) for v, i in sigma.items()):
        return None
    plain = {v: i.as_var() for v, i in sigma.items()}
    if all(u is not None and u.extent == v.extent for v, u in plain.items()) and len(set(plain.values())) == len(plain):
        return Named(value.data, [plain[v] for v in value.vars])  # a renaming: the same array
    parts = [index_array(sigma[v]) for v in value.vars]
    datas, vs = align(parts)
    full = tuple(v.extent for v in vs)
    idx = tuple(jnp.clip(jnp.broadcast_to(d, full), 0, value.data.shape[k] - 1) for k, d in enumerate(datas))
    return Named(value.data[idx] if idx else value.data, vs)


def to_jax(dnf: D.DNF) -> Callable:
    """The DNF as a jitted JAX function of its inputs (in ``dnf.inputs`` order).

    Returns one array for a single-output DNF, else a tuple.
    """

    def fn(*arrays):
        import jax.numpy as jnp

        if len(arrays) != len(dnf.inputs):
            raise TypeError(f"{dnf.name}: expected {len(dnf.inputs)} arrays, got {len(arrays)}")
        env = {}
        for spec, a in zip(dnf.inputs, arrays):
            a = jnp.asarray(a)
            if tuple(a.shape) != tuple(spec.shape):
                raise ValueError(f"{dnf.name}: input {spec.name!r} has shape {a.shape}, expected {spec.shape}")
            env[spec.name] = a
        ev = Evaluator(env)
        ev.prime(dnf.outputs)
        outs = tuple(ev.output(o) for o in dnf.outputs)
        return outs[0] if len(outs) == 1 else outs

    fn.__name__ = f"{dnf.name}_reference"
    import jax

    # jitted: one XLA compile per call signature, where eager evaluation compiles every
    # operation of the DNF on its own (the oracle of the property tests: hundreds of DNFs)
    return jax.jit(fn)
