"""MoA notation for un-reduced array expressions (the algebra's side; the DNF prints itself)."""

from __future__ import annotations

from moajax import moa
from moajax import ops as _ops


def _vec(xs) -> str:
    return "⟨" + " ".join(str(x) for x in xs) + "⟩"


def moa_str(A: "moa.Array", limit: int = 160) -> str:
    """A one-line MoA rendering of an expression; labelled subterms print as their label."""
    memo: dict[int, str] = {}

    def go(x, top=False) -> str:
        r = memo.get(x.uid)
        if r is not None:
            return r
        if isinstance(x, moa.Input):
            s = x.name
        elif isinstance(x, moa.Literal):
            s = repr(x.value) if isinstance(x.value, float) else str(x.value)
        elif isinstance(x, moa.Iota):
            s = f"ι{x.shape[0]}"
        elif isinstance(x, moa.Cell):
            s = "□" + "₀₁₂₃₄₅₆₇₈₉"[x.position % 10]
        elif isinstance(x, moa.Name):
            s = x.label if not top else go(x.arg)
        elif isinstance(x, moa.Psi):
            s = f"{_vec(x.index)}ψ {go(x.arg)}"
        elif isinstance(x, moa.Take):
            s = f"{x.count}△ {go(x.arg)}"
        elif isinstance(x, moa.Drop):
            s = f"{x.count}▽ {go(x.arg)}"
        elif isinstance(x, moa.Reverse):
            s = f"Φ {go(x.arg)}"
        elif isinstance(x, moa.Rotate):
            s = f"{x.shift}Θ {go(x.arg)}"
        elif isinstance(x, moa.Transpose):
            s = f"⍉{_vec(x.perm)} {go(x.arg)}"
        elif isinstance(x, moa.Reshape):
            s = f"{_vec(x.shape)}ρ̂{'' if x.gamma == 'C' else 'ᶠ'} {go(x.arg)}"
        elif isinstance(x, moa.Cast):
            s = f"{x.dtype.name}({go(x.arg)})"
        elif isinstance(x, moa.Reduce):
            s = f"{_ops.OPS[x.monoid.op].symbol}/ {go(x.arg)}"
        elif isinstance(x, moa.Catenate):
            s = f"{go(x.a)} ⧺ {go(x.b)}"
        elif isinstance(x, moa.Map):
            a = [go(c) for c in x.args]
            if x.op.name == "where":
                s = f"where({', '.join(a)})"
            elif x.op.infix:
                s = f"{a[0]} {x.op.symbol} {a[1]}"
            else:
                s = f"{x.op.symbol} {a[0]}"
        elif isinstance(x, moa.Outer):
            s = f"{go(x.a)} {x.op.symbol}.× {go(x.b)}"
        elif isinstance(x, moa.Inner):
            s = f"{go(x.a)} {_ops.OPS[x.monoid.op].symbol}.{x.op.symbol} {go(x.b)}"
        elif isinstance(x, moa.Omega):
            inner = go(x.body)
            s = f"Ω{_vec(x.ranks)}(λ{' '.join(go(c) for c in x.cells)}. {inner})({', '.join(go(a) for a in x.args)})"
        else:  # pragma: no cover
            raise TypeError(type(x))
        if not top and not isinstance(x, (moa.Input, moa.Literal, moa.Iota, moa.Cell, moa.Name)) and " " in s:
            s = f"({s})"
        memo[x.uid] = s
        return s

    out = go(A, top=True)
    if len(out) > limit:
        out = out[: limit - 1] + "…"
    return out
