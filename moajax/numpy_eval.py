"""A plain NumPy evaluator of the *un-reduced* expression: the oracle ψ-reduction is tested against.

It walks the algebra's DAG operation by operation, materialising every intermediate array —
exactly what ψ-reduction removes — with NumPy's own routines (transpose, concatenate,
tensordot, ufunc.reduce). Floating arrays are evaluated in float64 (``promote=True``), so
a DNF evaluated in float64 must agree with it to rounding (rel ≤ 1e-12).
It shares no evaluation code with ``moajax.psi`` or ``moajax.reference`` (only the algebra's own DAG helpers).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from moajax import moa


def _float64(dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype.kind == "f" or dtype.name == "bfloat16" or dtype.name.startswith("float8"):
        return np.dtype(np.float64)
    return dtype


def evaluate(expr: moa.Array, inputs: Mapping[str, np.ndarray], promote: bool = True) -> np.ndarray:
    """The value of ``expr`` with each Input bound to ``inputs[name]``."""
    ev = _Evaluator(inputs, promote)
    return ev.eval(expr, {})


class _Evaluator:
    def __init__(self, inputs, promote):
        self.promote = promote
        self.inputs = {}
        for k, v in inputs.items():
            a = np.asarray(v)
            self.inputs[k] = a.astype(_float64(a.dtype)) if promote else a
        self.memo: dict = {}
        self._cells: dict = {}

    def dt(self, dtype):
        return _float64(dtype) if self.promote else np.dtype(dtype)

    def eval(self, x: moa.Array, env: dict) -> np.ndarray:
        # a subterm that uses no Ω cell has one value everywhere: memoise it globally
        if env and self._uses_cells(x):
            key = (x.uid, tuple(sorted((c.uid, id(v)) for c, v in env.items())))
        else:
            key = x.uid
        hit = self.memo.get(key)
        if hit is not None:
            return hit
        out = np.asarray(self._eval(x, env))
        if out.shape != x.shape:
            raise AssertionError(f"evaluator shape {out.shape} != ρ {x.shape} for {type(x).__name__}")
        self.memo[key] = out
        return out

    def _uses_cells(self, x) -> bool:
        return bool(moa.free_cells(x, self._cells))

    def _eval(self, x, env):
        if isinstance(x, moa.Input):
            a = self.inputs[x.name]
            if a.shape != x.shape:
                raise ValueError(f"input {x.name!r} has shape {a.shape}, expected {x.shape}")
            return a
        if isinstance(x, moa.Literal):
            return np.array(x.value, dtype=self.dt(x.dtype))
        if isinstance(x, moa.Iota):
            return np.arange(x.shape[0], dtype=x.dtype)
        if isinstance(x, moa.Cell):
            return env[x]
        if isinstance(x, (moa.Name, moa.StopGradient)):
            return self.eval(x.arg, env)
        if isinstance(x, moa.Psi):
            return self.eval(x.arg, env)[tuple(x.index)]
        if isinstance(x, moa.Take):
            a = self.eval(x.arg, env)
            return a[: x.count] if x.count >= 0 else a[a.shape[0] + x.count:]
        if isinstance(x, moa.Drop):
            a = self.eval(x.arg, env)
            return a[x.count:] if x.count >= 0 else a[: a.shape[0] + x.count]
        if isinstance(x, moa.Reverse):
            return self.eval(x.arg, env)[::-1]
        if isinstance(x, moa.Rotate):
            return np.roll(self.eval(x.arg, env), -x.shift, axis=0)
        if isinstance(x, moa.Transpose):
            return np.transpose(self.eval(x.arg, env), x.perm)
        if isinstance(x, moa.Reshape):
            return np.reshape(self.eval(x.arg, env), x.shape, order=x.gamma)
        if isinstance(x, moa.Cast):
            return self.eval(x.arg, env).astype(self.dt(x.dtype))
        if isinstance(x, moa.Catenate):
            return np.concatenate([self.eval(x.a, env), self.eval(x.b, env)], axis=0)
        if isinstance(x, moa.Map):
            args = [self.eval(a, env) for a in x.args]
            with np.errstate(all="ignore"):
                return np.asarray(x.op.np_fn(*args)).astype(self.dt(x.dtype), copy=False)
        if isinstance(x, moa.Outer):
            a, b = self.eval(x.a, env), self.eval(x.b, env)
            a = a.reshape(a.shape + (1,) * b.ndim)
            with np.errstate(all="ignore"):
                return np.asarray(x.op.np_fn(a, b)).astype(self.dt(x.dtype), copy=False)
        if isinstance(x, moa.Reduce):
            a = self.eval(x.arg, env)
            return x.monoid.np_reduce(a, axis=0)
        if isinstance(x, moa.Inner):
            a, b = self.eval(x.a, env), self.eval(x.b, env)
            if x.monoid.name == "add" and x.op.name == "mul" and a.dtype.kind == "f":
                return np.tensordot(a, b, axes=([a.ndim - 1], [0]))
            # general op1.op2: materialise the outer-op array over the shared axis, then reduce it
            a2 = np.moveaxis(a, -1, 0).reshape((a.shape[-1],) + a.shape[:-1] + (1,) * (b.ndim - 1))
            b2 = b.reshape((b.shape[0],) + (1,) * (a.ndim - 1) + b.shape[1:])
            with np.errstate(all="ignore"):
                c = np.asarray(x.op.np_fn(a2, b2)).astype(self.dt(x.dtype), copy=False)
            return x.monoid.np_reduce(c, axis=0)
        if isinstance(x, moa.Omega):
            return self._omega(x, env)
        raise TypeError(f"cannot evaluate {type(x).__name__}")

    def _omega(self, x, env):
        args = [self.eval(a, env) for a in x.args]
        nf = len(x.shape) - x.body.rank
        frame = x.shape[:nf]
        out = np.empty(x.shape, dtype=self.dt(x.dtype))
        for idx in np.ndindex(*frame):
            env2 = dict(env)
            for cell, a, fr in zip(x.cells, args, x.frame):
                env2[cell] = a[idx] if fr else a
            out[idx] = self.eval(x.body, env2)
            # a frame cell's values are distinct per index: drop them from the memo
            for k in [k for k in self.memo if isinstance(k, tuple) and any(c.uid in dict(k[1]) for c in x.cells)]:
                del self.memo[k]
        return out
