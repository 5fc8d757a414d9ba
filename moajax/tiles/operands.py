"""How the inputs are laid out for tiles, on every backend: zero padding and physical axis order.

Each input is padded with zeros so that every tile window is in bounds (pad-and-mask tails:
a read of an input past the end of its axis is exactly 0, ``masking.zero_padded``; on the
Pallas backend before 0 too, where a window is shifted back, ``input_origins``), and
stored with its axes in a physical order: γ "F" reverses them (column-major); on the XLA
backend a "C" operand is stored in the program's canonical variable order, one transpose up
front instead of one per tile inside the loops.
"""

from __future__ import annotations

from moajax import dnf as D
from moajax.ix import Var
from moajax.onf import ONF
from moajax.tiles.ranges import var_order


def input_padding(onf: ONF, before: bool = False) -> dict:
    """Per input, per axis, (lo, top): the positions −lo … top − 1 that the tile windows read,
    lo = 0 unless ``before``.

    An affine index c + Σ aᵢ·vᵢ (every aᵢ ≥ 0) runs over c … c + Σ aᵢ·(whole size of vᵢ − 1)
    across all tiles: a shifted variable, or split-K's s_o·chunk + s_i, whose last tile runs
    past the end of the axis (an index with ⌊·/d⌋ or mod stays in bounds). ``before``
    (the Pallas layout): c < 0 too — v + c, the second part of a catenate, ⟨(n − 3) d⟩ψy,
    a take's shift — its windows start as early as c and end past the array by as much as
    a range of v overhangs it; the XLA backend pads such a window per read instead
    (``XlaBackend._overhang``), and ``before=False`` leaves these to it."""
    need = {i.name: [[0, s] for s in i.shape] for i in onf.dnf.inputs}
    for e in onf.program.exprs():
        for r in D.walk(e):
            if not isinstance(r, D.Read):
                continue
            for ax, ix in enumerate(r.index):
                if ix.is_const or any(not isinstance(a, Var) or c < 0 for a, c in ix.terms):
                    continue
                if ix.const < 0 and not before:
                    continue
                # a window shifted back is padded anyway: past the end as far as a range of
                # all of vᵢ reaches in a power-of-two block too (Triton's, ``Backend.whole``);
                # so is a whole axis in the Pallas layout, read in one such block (7 keys, an
                # axis no rewrite lifted, in a block of 8: a GPU load past the array, a
                # slice error in interpret mode)
                def reach(a):
                    ax = onf.axis_of(a)
                    return ax.whole_size(pow2=ix.const < 0 or (before and ax.role == "whole")) - 1

                top = ix.const + sum(c * reach(a) for a, c in ix.terms) + 1
                bound = need[r.array][ax]
                bound[0] = max(bound[0], -ix.const)  # every vᵢ = 0: the window's first position
                bound[1] = max(bound[1], top)
    return {name: [tuple(b) for b in axes] for name, axes in need.items()}


def input_origins(onf: ONF) -> dict:
    """Per input, per logical axis, the zeros padded before 0 on the Pallas backend (the
    largest negative shift its reads take): A[i] is stored at i + origin, so every read's
    index moves by it (``prepare_inputs(before=True)``)."""
    return {name: tuple(lo for lo, _ in axes) for name, axes in input_padding(onf, before=True).items()}


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


def prepare_inputs(onf: ONF, arrays, canonical: bool = False, before: bool = False) -> tuple[dict, dict]:
    """Pad each input to whole tiles (zeros) and store it in its physical axis order:
    (name → array, name → permutation of its logical axes). ``before``: zeros before 0 too,
    as far as a window shifted back reaches (``input_origins``: each axis then starts there)."""
    import jax.numpy as jnp

    need = input_padding(onf, before)
    perms = input_perms(onf, canonical)
    out = {}
    for spec, a in zip(onf.dnf.inputs, arrays):
        pads = [(lo, top - s) for (lo, top), s in zip(need[spec.name], a.shape)]
        if any(p != (0, 0) for p in pads):
            a = jnp.pad(a, pads)
        perm = perms[spec.name]
        if perm != tuple(range(a.ndim)):
            a = jnp.transpose(a, perm)  # e.g. column-major: the reversed axes, stored row-major
        out[spec.name] = a
    return out, perms
