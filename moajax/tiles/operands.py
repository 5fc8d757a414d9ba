"""How the inputs are laid out for tiles, on every backend: zero padding and physical axis order.

Each input is padded with zeros so that every tile window is in bounds (pad-and-mask tails:
a read of an input past the end of its axis is exactly 0, ``masking.zero_padded``), and
stored with its axes in a physical order: γ "F" reverses them (column-major); on the XLA
backend a "C" operand is stored in the program's canonical variable order, one transpose up
front instead of one per tile inside the loops.
"""

from __future__ import annotations

from moajax import dnf as D
from moajax.ix import Var
from moajax.onf import ONF
from moajax.tiles.ranges import var_order


def input_padding(onf: ONF) -> dict:
    """Per input, the size each axis must have so that every tile window is in bounds."""
    need = {i.name: list(i.shape) for i in onf.dnf.inputs}
    for e in onf.program.exprs():
        for r in D.walk(e):
            if not isinstance(r, D.Read):
                continue
            for ax, ix in enumerate(r.index):
                # an affine index c + Σ aᵢ·vᵢ (aᵢ ≥ 0) reaches c + Σ aᵢ·(whole size of vᵢ − 1) in
                # the last tiles: a shifted variable, or split-K's s_o·chunk + s_i, whose last
                # tile runs past the end of the axis (an index with ⌊·/d⌋ or mod stays in bounds)
                if ix.is_const or any(not isinstance(a, Var) or c < 0 for a, c in ix.terms) or ix.const < 0:
                    continue
                top = ix.const + sum(c * (onf.axis_of(a).whole_size() - 1) for a, c in ix.terms) + 1
                need[r.array][ax] = max(need[r.array][ax], top)
    return need


def input_perms(onf: ONF, canonical: bool) -> dict:
    """Per input, the physical order of its logical axes (γ "F": reversed; ``canonical``: a
    "C" operand in the order its first read's variables have in the program)."""
    rank = var_order(onf)
    first_read = {}
    for e in onf.program.exprs():
        for r in D.walk(e):
            if isinstance(r, D.Read) and r.array not in first_read:
                first_read[r.array] = r
    perms = {}
    for spec in onf.dnf.inputs:
        n = len(spec.shape)
        if onf.gamma_of(spec.name) == "F" and n > 1:
            perms[spec.name] = tuple(reversed(range(n)))
            continue
        r = first_read.get(spec.name)
        if not canonical or r is None:
            perms[spec.name] = tuple(range(n))
            continue

        def key(ax, r=r):
            vs = sorted(r.index[ax].free_vars(), key=lambda v: rank.get(v.name, 1 << 20))
            return (rank.get(vs[0].name, 1 << 20) if vs else -1, ax)

        perms[spec.name] = tuple(sorted(range(n), key=key))
    return perms


def prepare_inputs(onf: ONF, arrays, canonical: bool = False) -> tuple[dict, dict]:
    """Pad each input to whole tiles (zeros) and store it in its physical axis order:
    (name → array, name → permutation of its logical axes)."""
    import jax.numpy as jnp

    need = input_padding(onf)
    perms = input_perms(onf, canonical)
    out = {}
    for spec, a in zip(onf.dnf.inputs, arrays):
        pads = [(0, n - s) for n, s in zip(need[spec.name], a.shape)]
        if any(p[1] for p in pads):
            a = jnp.pad(a, pads)
        perm = perms[spec.name]
        if perm != tuple(range(a.ndim)):
            a = jnp.transpose(a, perm)  # e.g. column-major: the reversed axes, stored row-major
        out[spec.name] = a
    return out, perms
