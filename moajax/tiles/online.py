"""How an online reduction is carried: one pass over r for  m = ⌈_r f  and  aᵢ = Σ_r exp(f − m)·gᵢ.

Each tile of r updates the carry (m, a…): m' = max(m, ⌈_tile f), α = exp(m − m'),
aᵢ' = aᵢ·α + Σ_tile exp(f − m')·gᵢ — the softmax monoid, so tiles combine in order. A row
that has seen only −∞ keeps a shift of 0 (no −∞ − −∞). Logits past the end of r are −∞,
so their weights exp(f − m) are exactly 0 and the weighted sums need no mask.
"""

from __future__ import annotations

import numpy as np

from moajax import dnf as D
from moajax.onf import OnlineStage
from moajax.reference import Named
from moajax.tiles import skipping
from moajax.tiles.contract import contract, operand
from moajax.tiles.masking import fill_past_end, valid, zero_padded
from moajax.tiles.ranges import broadcast_to_vars, same_range


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
            if w is None:
                ax = p.vars.index(v) if v in p.vars else None
                contrib = Named(jnp.sum(p.data, axis=ax), p.vars[:ax] + p.vars[ax + 1:]) if ax is not None else p
            else:
                wf = D.product_factors(w)
                # p is exactly 0 past the end of v (its logits were masked to −∞)
                contrib = contract(ctx, [p] + [operand(ctx, x) for x in wf], v, dtype,
                                   [True] + [zero_padded(x, v) for x in wf])
            new_accs.append(acc * broadcast_to_vars(Named(alpha, mvars), sv, ev.ranges)
                            + broadcast_to_vars(contrib, sv, ev.ranges))
        return m_new, tuple(new_accs)

    if axis.role == "sequential" and axis.ntiles > 1:
        ev.hoist(st.exprs(), v)

        m, accs = skipping.walk(ev, [ev.onf.skip_of(st.name)], v, lambda ctx, carried: step(ctx, *carried),
                                (m0, acc0), running_max=lambda carried: Named(carried[0], mvars))
    else:
        rng = ev.backend.whole(v)
        m, accs = step(ev if same_range(rng, ev.ranges.get(v)) else ev.child({v: rng}), m0, acc0)
    out = {st.max_name: Named(m, mvars)}
    for (name, _, _), acc, sv in zip(st.sums, accs, svars):
        out[name] = Named(acc, sv)
    return out
