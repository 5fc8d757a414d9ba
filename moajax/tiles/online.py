"""How an online reduction is carried: one pass over r for  m = ⌈_r f  and  aᵢ = Σ_r exp(f − m)·gᵢ.

Each tile of r updates the carry (m, a…): m' = max(m, ⌈_tile f), α = exp(m − m'),
aᵢ' = aᵢ·α + Σ_tile exp(f − m')·gᵢ — the softmax monoid, so tiles combine in order. A row
that has seen only −∞ keeps a shift of 0 (no −∞ − −∞). Logits past the end of r are −∞,
so their weights exp(f − m) are exactly 0 and the weighted sums need no mask.
"""

from __future__ import annotations

import numpy as np

from moajax import dnf as D
from moajax.onf import OnlineStage, RowGuard
from moajax.reference import Named
from moajax.tiles import skipping
from moajax.tiles.contract import contract, operand
from moajax.tiles.masking import fill_past_end, valid, zero_padded
from moajax.tiles.ranges import Range, broadcast_to_vars, same_range


def carry(ev, st: OnlineStage) -> dict:
    """The results of ``st`` (name → ``Named``) in scope ``ev``: a loop over the tiles of a
    sequential r, or one step over all of r."""
    import jax.numpy as jnp

    v = st.var
    axis = ev.onf.axis_of(v)
    dtype = st.logit.dtype
    ev = ev.within(x for _, vs, _ in st.sums for x in vs)
    mvars = ev.ordered(x for x in st.max_vars if ev.range_of(x).size != 1)
    svars = [ev.ordered(x for x in vs if ev.range_of(x).size != 1) for _, vs, _ in st.sums]
    m0 = jnp.full(tuple(ev.range_of(x).size for x in mvars), -jnp.inf, dtype)
    acc0 = tuple(jnp.zeros(tuple(ev.range_of(x).size for x in sv), dtype) for sv in svars)

    def step(ctx, m, accs):
        f = ctx.eval(st.logit)
        mask = valid(ctx, v)
        if mask is not None:
            f = fill_past_end(ev, f, mask, -jnp.inf)
        if v in f.vars:
            ax = f.vars.index(v)
            m_tile = Named(jnp.max(f.data, axis=ax), f.vars[:ax] + f.vars[ax + 1:])
        else:
            m_tile = f
        m_new = jnp.maximum(m, broadcast_to_vars(m_tile, mvars, ev.ranges))
        m_safe = jnp.where(m_new == -jnp.inf, np.zeros((), dtype), m_new)
        alpha = jnp.exp(m - m_safe)
        datas, vs = ev.align([f, Named(m_safe, mvars)])
        p = Named(jnp.exp(datas[0] - datas[1]), vs)
        new_accs = []
        for (_, _, w), acc, sv in zip(st.sums, accs, svars):
            contrib = weighted(ctx, p, w)
            new_accs.append(acc * broadcast_to_vars(Named(alpha, mvars), sv, ev.ranges)
                            + broadcast_to_vars(contrib, sv, ev.ranges))
        return m_new, tuple(new_accs)

    def weighted(ctx, p, w):  # one Σ's tile: Σ_tile p·g (w: g, None for 1)
        if w is None:
            ax = p.vars.index(v) if v in p.vars else None
            return Named(jnp.sum(p.data, axis=ax), p.vars[:ax] + p.vars[ax + 1:]) if ax is not None else p
        wf = D.product_factors(w)
        # p is exactly 0 past the end of v (its logits were masked to −∞)
        return contract(ctx, [p] + [operand(ctx, x) for x in wf], v, dtype, [True] + [zero_padded(x, v) for x in wf])

    if axis.role == "sequential" and axis.ntiles > 1:
        ev.hoist(st.exprs(), v)
        sk = ev.onf.skip_of(st.name)
        m, accs = skipping.walk(ev, [sk], v, lambda ctx, carried: step(ctx, *carried), (m0, acc0))
        if sk is not None and isinstance(sk.guard, RowGuard) and not sk.guard.stats and any(sk.kept):
            m, accs = _masked_whole(ev, st, sk.guard, Named(m, mvars), accs, svars, weighted)
    else:
        rng = ev.backend.whole(v)
        m, accs = step(ev if same_range(rng, ev.ranges.get(v)) else ev.child({v: rng}), m0, acc0)
    out = {st.max_name: Named(m, mvars)}
    for (name, _, _), acc, sv in zip(st.sums, accs, svars):
        out[name] = Named(acc, sv)
    return out


def _masked_whole(ev, st: OnlineStage, guard: RowGuard, m: Named, accs: tuple, svars: list, weighted) -> tuple:
    """The walk's carry (max, sums) with each row that kept no key in it — a mask on data,
    its skip guarded by the rows' own max (``onf.RowGuard``) — set to what walking every tile
    gives it: every score is the fill m₀, so max m₀ and every weight exp(m₀ − m₀) = 1, the
    sums Σ_v gᵢ over all of v, walked where a row of the program needs it, the tiles in order
    and each contracted as the walk contracts p = 1 (bit for bit no skip). (A row keeping a
    key has a max above m₀: every score a kept key has lies far above the fill, the skip's
    assumption; one that walked no tile has −∞.) A row the guard exempts (``exempt``: one
    whose values nothing reads, past a query length) keeps its carry."""
    import jax.numpy as jnp

    v = st.var
    fill = guard.fill
    axis = ev.onf.axis_of(v)
    dtype = m.data.dtype
    whole = Named(m.data <= np.asarray(fill, dtype), m.vars)
    for a in guard.exempt:
        datas, vs = ev.align([whole, ev.eval(a)])
        whole = Named(jnp.logical_and(datas[0], datas[1]), vs)
    whole = Named(broadcast_to_vars(whole, m.vars, ev.ranges), m.vars)  # (laid out as m)
    need = 1 - skipping.all_rows(ev, Named(jnp.logical_not(whole.data), m.vars))  # 1: a row kept no key
    pvars = ev.ordered(list(m.vars) + [v])

    def step(i, sums):
        ctx = ev.child({v: Range(i * axis.tile, axis.tile, v.extent)})
        pv = tuple(x for x in pvars if ctx.range_of(x).size != 1)  # (a tile of one key: no axis, as the walk's)
        p = Named(jnp.ones(tuple(ctx.range_of(x).size for x in pv), dtype), pv)
        inside = valid(ctx, v)
        if inside is not None:
            p = fill_past_end(ev, p, inside, np.zeros((), dtype))
        return tuple(acc + broadcast_to_vars(weighted(ctx, p, w), sv, ev.ranges)
                     for (_, _, w), acc, sv in zip(st.sums, sums, svars))

    # (the count as arithmetic: Pallas' Triton lowering of a select of constants met an i1
    # where it expected an i32, as ``skipping._Folding`` says)
    sums = ev.backend.fori_loop(need * np.int32(axis.ntiles), step, tuple(jnp.zeros_like(a) for a in accs), 0)
    out = []
    for acc, alt, sv in zip(accs, sums, svars):
        out.append(jnp.where(broadcast_to_vars(whole, sv, ev.ranges), alt, acc))
    return jnp.where(whole.data, np.asarray(fill, dtype), m.data), tuple(out)
