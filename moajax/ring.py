"""Sequence parallelism: attention's key axis lifted over a mesh axis (ring attention).

MoA: over P devices the key index is lifted, s = ⟨r c⟩ (r < P the ring step, c < S/P), and

    Out = softmax(Q +.× ⍉K) +.× V = ⊕_r (O_r, m_r, l_r),   (O_r, m_r, l_r) = the attention of
    the local queries against the key block that visits at step r, with its row max and sum,

⊕ the softmax monoid (m = m₁ ⌈ m₂, l = l₁ e^{m₁−m} + l₂ e^{m₂−m}, O = (O₁ l₁ e^{m₁−m} + O₂ l₂
e^{m₂−m}) / l). Q stays; K and V travel around the ring by ``ppermute``; each block is the
moajax attention kernel's saving forward (``Kernel.with_row_statistics``). The backward runs
the ring again: each block's (dQ, dK, dV) is the kernel's derived adjoint reading the
*global* row max and sum and Out (``Kernel.adjoint(saved=True)``: P and Δ of the whole row,
restricted to the block), dQ accumulates in place, dK and dV travel with their block and
arrive home after P steps (summed in the accumulation dtype). Forward mode (``jax.jvp``) runs
a ring of tangents: each block's (Out, lse) and their tangents, merged by the monoid's
tangent (``tangent_local``). Memory per device is O(S/P): no [S, S] and no whole K or V.

Causal load balance ("zigzag"): with 2P chunks, device i holds chunks i and 2P−1−i, so every
ring step has the same work; a block is skipped where it is masked entirely (key chunk after
query chunk), computed with the causal mask on the diagonal, without a mask below it. The
reorder from the inputs' contiguous split is four ``ppermute``s per array (no all-gather).

Rounds (``Ring.rounds`` R): the travelling chunks' key index lifted once more, c = ⟨j c'⟩ —
R rounds of the ring, each carrying piece j (C/R keys) of every chunk, so each device holds
1/R of a block in flight (K, V; in the backward also dK and dV, which come home after each
round). The same bytes in R times the sends; the diagonal pair's causal mask is cut along
both axes (query piece q against key piece j: whole below, masked on, skipped above).
"""

from __future__ import annotations

import dataclasses
import functools
import math

from moajax import compat
from moajax import dnf as D
from moajax.schedule import RING_BALANCES as BALANCES  # (a Preset names them too)
from moajax.schedule import check_ring_rounds

_FULL, _DIAG, _SKIP = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Ring:
    """The mesh lifting of the key axis: ``axis_name`` of ``devices`` devices, the sequence in
    ``balance`` order ("zigzag": 2P chunks, device i holds i and 2P−1−i; "contiguous": P),
    the travelling chunks cut into ``rounds`` pieces (one round of the ring each)."""

    axis_name: str
    devices: int
    balance: str = "zigzag"
    rounds: int = 1

    def __post_init__(self):
        if self.balance not in BALANCES:
            raise ValueError(f"Ring: balance must be one of {BALANCES}, got {self.balance!r}")
        if not isinstance(self.devices, int) or self.devices < 1:
            raise ValueError(f"Ring: devices must be a positive int, got {self.devices!r}")
        check_ring_rounds(self.rounds, "Ring")

    @property
    def chunks(self) -> int:
        return 2 * self.devices if self.balance == "zigzag" else self.devices

    def owned(self, i) -> tuple:
        """The global chunk ids device ``i`` holds (``i`` may be traced)."""
        P = self.devices
        return (i, 2 * P - 1 - i) if self.balance == "zigzag" else (i,)

    def reorder_targets(self, d: int) -> tuple:
        """Where device d's two contiguous halves go in the zigzag reorder (``to_zigzag``)."""
        return tuple(next(t for pairs in _zigzag_pairs(self.devices, h) for s, t in pairs if s == d) for h in range(2))

    def __str__(self):
        rounds = f", {self.rounds} rounds" if self.rounds > 1 else ""
        return f"ring({self.axis_name} × {self.devices}, {self.balance}{rounds})"


def _kind(qc, kc, is_causal: bool):
    """full, diagonal (causal mask) or skipped, for query chunk qc against key chunk kc."""
    import jax.numpy as jnp

    if not is_causal:
        return jnp.int32(_FULL)
    return jnp.where(qc > kc, _FULL, jnp.where(qc == kc, _DIAG, _SKIP)).astype(jnp.int32)


def _split(x, n: int):
    C = x.shape[1] // n
    return [x[:, j * C:(j + 1) * C] for j in range(n)]


def _ring_step(ring: Ring):
    """Device i's neighbour: the block at device i moves to i + 1."""
    P = ring.devices
    return [(d, (d + 1) % P) for d in range(P)]


@functools.lru_cache(maxsize=64)
def _kernels(kern, shapes, dtype, scale: float, implementation):
    """(forward(causal), adjoint(causal)) of the attention kernel ``kern`` (jax.nn's layout)
    for one chunk pair: its saving forward (Out in the accumulation dtype, row max, row sum;
    the statistics in the rows' layout [b t n]) and its adjoint reading the saved statistics
    and Out. A 16-bit kernel's saving forward also saves Out before its rounding (what the
    papers' identities read back): the accumulation-dtype Out the ring merges and passes."""
    import jax

    qs = shapes[0]
    specs = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
    rows = qs[:3]  # [b t n]: the statistics' rows in the jax.nn layout

    def saved_shapes(opts):
        """The saved values' shapes: the statistics in their rows' layout [b t n] (a 16-bit
        kernel's unrounded Out in [b t n e]), axes of extent 1 dropped."""
        outs = [o for o in kern.with_row_statistics(()).dnf(*specs, **opts).outputs if o.name.startswith("saved")]
        full = [rows, rows, rows + (shapes[2][-1],)][:len(outs)]
        for o, shape in zip(outs, full):
            dims = tuple(d for d, n in zip(("b", "t", "n", "e"), shape) if n > 1)
            if tuple(o.dims) != dims and o.shape != shape:
                raise NotImplementedError(f"ring attention: the saved {o.name}'s layout {o.dims} is not the "
                                          f"rows' {list(dims)}")
        return [o.shape for o in outs]

    def forward(causal: bool):
        opts = dict(scale=scale, is_causal=causal)
        run = kern.with_row_statistics(()).compiled(*specs, implementation=implementation, **opts)

        def f(*a):
            res = run(*a)  # (Out, max, sum[, Out before rounding])
            out = res[3].reshape(res[0].shape) if len(res) > 3 else res[0]
            return out, res[1].reshape(rows), res[2].reshape(rows)
        return f

    def adjoint(causal: bool):
        opts = dict(scale=scale, is_causal=causal)
        adj = kern._adjoint_for(kern._key(specs, opts), opts, True)
        shape = saved_shapes(opts)
        # a block's adjoint is the ring's only where it reads Δ = +/(dO × Out) from the whole
        # row's Out passed in (identities.delta_from_output), not from its own keys: over a
        # block of one key the DNF has no Σ_s for the identity to match (ψ over one item is
        # that item), and its Δ would be that key's alone: wrong dQ and dK, silently
        dnf = adj.dnf(*kern._saved_args(specs, opts), **opts)  # (every statistic: the ring merges them all)
        outs = {i.name for i in dnf.inputs[len(dnf.inputs) - 1 - len(shape[2:]):]}  # Out (16-bit: and unrounded)
        # every output that Δ enters (dQ and dK; dV = Pᵀ +.× dO has none): the identity is
        # applied output by output (one finer than Out recomputes Δ: identities)
        with_delta = [o for o in dnf.outputs if o.name != f"d_{kern.params[2].name}"]
        if not all(any(isinstance(x, D.Read) and x.array in outs for x in D.walk(o.body)) for o in with_delta):
            raise ValueError(
                f"ring attention: the gradient of a ring block of {shapes[1][1]} key(s) cannot read the whole "
                f"row's output (Δ = +/(dO × Out) over one key is not a sum); give each piece of the ring at "
                f"least 2 keys (fewer rounds, a longer sequence, or fewer devices on the sequence axis)")

        def f(q, k, v, g, m, l, out):  # out: in the accumulation dtype
            unrounded = tuple(out.reshape(s) for s in shape[2:])  # (16-bit: saved2)
            return adj(q, k, v, g, m.reshape(shape[0]), l.reshape(shape[1]), *unrounded, out.astype(q.dtype),
                       implementation=implementation, residuals="none", **opts)
        return f

    return forward, adjoint


def _merge(state, part):
    """(m, l, acc) ⊕ (O, m', l'): the softmax monoid, acc = Σ O_r l_r e^{m_r − m}."""
    import jax.numpy as jnp

    m0, l0, a0 = state
    o, m1, l1 = part
    m = jnp.maximum(m0, m1)
    w0, w1 = jnp.exp(m0 - m), jnp.exp(m1 - m)
    return m, l0 * w0 + l1 * w1, a0 * w0[..., None] + o.astype(a0.dtype) * (l1 * w1)[..., None]


def _piece(x, j, c: int):
    """Piece j (traced) of c rows of a chunk: rows j·c … j·c + c − 1 (axis 1)."""
    from jax import lax

    return x if c == x.shape[1] else lax.dynamic_slice_in_dim(x, j * c, c, axis=1)


def _rows(xs, q, c: int):
    """Piece q (traced) of c rows of each array of ``xs`` (``_piece``)."""
    return type(xs)(_piece(x, q, c) for x in xs)


def _fold(ring: Ring, is_causal: bool, states, staying, travelling, blocks, merge):
    """The ring's walk, folding every block into every query chunk's state: at step r the
    ``travelling`` chunks (K, V[, their tangents]) of device i − r visit; each pair of a query
    chunk a and a visiting chunk b is merged, ``merge(state_a, full|diag(*staying[·][a],
    *travelling[·][b]))``, or skipped where it is masked entirely (``_kind``). P − 1 sends:
    the last block to visit is not passed on. With R = ``ring.rounds`` > 1 the chunks travel
    in R rounds, a piece of C/R rows each (s = ⟨j c⟩ lifted once more): 1/R of each block in
    flight. ``blocks(rows)`` → (full, diag) for ``rows`` query rows against one piece.
    Returns the states."""
    from jax import lax

    P, n, R = ring.devices, ring.chunks // ring.devices, ring.rounds
    i = lax.axis_index(ring.axis_name)
    mine = ring.owned(i)
    C = staying[0][0].shape[1]
    c = C // R
    full, diag = blocks(C)
    merged = lambda f: (lambda s, *x: merge(s, f(*x)))  # noqa: E731
    skip = lambda s, *x: s  # noqa: E731
    small = [merged(f) for f in blocks(c)] if R > 1 else None
    perm = _ring_step(ring)

    def one_round(j, states):
        if R == 1:
            diagonal = merged(diag)
        else:
            def diagonal(s, *x):  # the pair's causal mask cut along both axes: query piece q
                # sees key piece j whole where q > j, masked where q = j, not at all where q < j.
                # A loop, not R copies: the program (and its compile time) does not grow with R
                stay, trav = x[:len(staying)], x[len(staying):]

                def piece(q, s):
                    got = lax.switch(_sub_kind(q, j), [*small, skip], _rows(s, q, c), *_rows(stay, q, c), *trav)
                    return tuple(lax.dynamic_update_slice_in_dim(a, g, q * c, axis=1) for a, g in zip(s, got))
                return lax.fori_loop(0, R, piece, tuple(s))
        branches = [merged(full), diagonal, skip]

        def visit(r, states, trav):
            theirs = ring.owned((i - r) % P)
            new = []
            for a in range(n):
                st = states[a]
                for b in range(n):
                    st = lax.switch(_kind(mine[a], theirs[b], is_causal), branches, st, *(x[a] for x in staying),
                                    *(x[b] for x in trav))
                new.append(st)
            return new

        def step(r, carry):
            states, trav = carry
            return visit(r, states, trav), [[lax.ppermute(x, ring.axis_name, perm) for x in xs] for xs in trav]

        trav = [[_piece(x, j, c) for x in xs] for xs in travelling]
        states, trav = lax.fori_loop(0, P - 1, step, (states, trav))
        return visit(P - 1, states, trav)

    return one_round(0, states) if R == 1 else lax.fori_loop(0, R, one_round, states)


def _sub_kind(q, j):
    """Query piece q against key piece j (traced) of the diagonal chunk pair: full below the
    diagonal, the causal mask on it, skipped above."""
    import jax.numpy as jnp

    return jnp.where(q > j, _FULL, jnp.where(q == j, _DIAG, _SKIP)).astype(jnp.int32)


def _pair_shapes(ring: Ring, rows: int, q, k, v) -> tuple:
    """The shapes of one block's (Q, K, V): ``rows`` queries against a piece of a key chunk
    (C/R keys: ``ring.rounds`` R)."""
    c = k.shape[1] // ring.rounds
    return (q.shape[:1] + (rows,) + q.shape[2:], k.shape[:1] + (c,) + k.shape[2:], v.shape[:1] + (c,) + v.shape[2:])


def forward_local(kern, ring: Ring, q, k, v, *, is_causal: bool, scale: float, implementation=None):
    """One device's share of the ring forward (inside a mesh context: ``shard_map`` or a
    partitioned kernel), its blocks in ``ring`` order: (Out, row max, row sum) of its queries,
    Out in the accumulation dtype (rounded to the inputs' by the caller)."""
    import jax.numpy as jnp

    n = ring.chunks // ring.devices
    qc, kc, vc = _split(q, n), _split(k, n), _split(v, n)
    acc_dt = jnp.promote_types(q.dtype, jnp.float32)
    B, C, N = qc[0].shape[:3]
    E = v.shape[-1]

    def blocks(rows):  # rows queries against one travelling piece
        fwd, _ = _kernels(kern, _pair_shapes(ring, rows, qc[0], kc[0], vc[0]), q.dtype, scale, implementation)
        return fwd(False), fwd(True)

    states = [(jnp.full((B, C, N), -jnp.inf, acc_dt), jnp.zeros((B, C, N), acc_dt),
               jnp.zeros((B, C, N, E), acc_dt)) for _ in range(n)]
    states = _fold(ring, is_causal, states, [qc], [kc, vc], blocks, _merge)
    out = jnp.concatenate([a / l[..., None] for _, l, a in states], axis=1)
    m = jnp.concatenate([s[0] for s in states], axis=1)
    l = jnp.concatenate([s[1] for s in states], axis=1)
    return out, m, l


@functools.lru_cache(maxsize=64)
def _tangent_blocks(shapes, dtype, scale: float, implementation):
    """block(causal): (lse, Out, lse̊, Out̊) of one chunk pair and their tangents — the
    forward-mode derivative of the attention kernel whose lse is differentiable
    (``mha_kernel(residual="live")``: its tangent kernel, derived by ``moajax.tangent``)."""
    import jax

    from moajax.kernels.attention import mha_kernel

    live = mha_kernel(None, None, shapes[1][2] != shapes[0][2], False, False, None, "live")
    specs = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
    rows = shapes[0][:3]

    def block(causal: bool):
        run = live.compiled(*specs, implementation=implementation, residuals="none", scale=scale, is_causal=causal)

        def f(*chunks):  # q, tq, k, v, tk, tv (the query's chunks stay, the rest travel: ``_fold``)
            q, tq, k, v, tk, tv = (x.astype(dtype) for x in chunks)
            (out, lse), (t_out, t_lse) = jax.jvp(run, (q, k, v), (tq, tk, tv))
            return lse.reshape(rows), out, t_lse.reshape(rows), t_out
        return f
    return block


def _merge_tangent(state, part):
    """(lse, O, lse̊, O̊) ⊕ (lse', O', lse̊', O̊'): the softmax monoid in log form,
    lse = log(e^{lse₁} + e^{lse₂}), O = Σ w_r O_r with w_r = e^{lse_r − lse}, and its tangent:
    lse̊ = Σ w_r lse̊_r, O̊ = Σ w_r (O̊_r + O_r (lse̊_r − lse̊)) (ẇ_r = w_r (lse̊_r − lse̊))."""
    import jax.numpy as jnp

    lse0, o0, dl0, do0 = state
    lse1, o1, dl1, do1 = part
    lse = jnp.logaddexp(lse0, lse1)
    w0, w1 = jnp.exp(lse0 - lse)[..., None], jnp.exp(lse1 - lse)[..., None]
    dl = w0[..., 0] * dl0 + w1[..., 0] * dl1
    do = w0 * (do0 + o0 * (dl0 - dl)[..., None]) + w1 * (do1 + o1 * (dl1 - dl)[..., None])
    return lse, w0 * o0 + w1 * o1, dl, do


def tangent_local(ring: Ring, q, k, v, tq, tk, tv, *, is_causal: bool, scale: float, implementation=None):
    """One device's share of the ring's forward mode, its blocks in ``ring`` order: (Out, Out̊)
    of its queries in the accumulation dtype. K, V and their tangents travel the ring; each
    block's (Out, lse) and tangents (``_tangent_blocks``: in the accumulation dtype, so that a
    16-bit block's lse weighs the merge unrounded) are merged by ``_merge_tangent``. The
    chunks travel in the inputs' dtype and are widened where they are read (exact: the ring
    sends half the bytes for 16-bit inputs, the same values)."""
    import jax.numpy as jnp

    n = ring.chunks // ring.devices
    acc_dt = jnp.promote_types(q.dtype, jnp.float32)
    staying, travelling = [_split(x, n) for x in (q, tq)], [_split(x, n) for x in (k, v, tk, tv)]

    def blocks(rows):  # rows queries against one travelling piece
        block = _tangent_blocks(_pair_shapes(ring, rows, staying[0][0], *(x[0] for x in travelling[:2])), acc_dt,
                                scale, implementation)
        return block(False), block(True)

    B, C, N = staying[0][0].shape[:3]
    E = v.shape[-1]
    states = [(jnp.full((B, C, N), -jnp.inf, acc_dt), jnp.zeros((B, C, N, E), acc_dt), jnp.zeros((B, C, N), acc_dt),
               jnp.zeros((B, C, N, E), acc_dt)) for _ in range(n)]
    states = _fold(ring, is_causal, states, staying, travelling, blocks, _merge_tangent)
    return (jnp.concatenate([s[1] for s in states], axis=1), jnp.concatenate([s[3] for s in states], axis=1))


def backward_local(kern, ring: Ring, q, k, v, out, m, l, d_out, *, is_causal: bool, scale: float,
                   implementation=None):
    """One device's share of the ring backward, its blocks in ``ring`` order: (dQ, dK, dV) of
    its blocks, from the global row max ``m``, sum ``l`` and ``out`` (accumulation dtype) of
    its queries. The partials are summed in the accumulation dtype, and dK and dV travel in
    it: a 16-bit block's P partials are rounded once at the end, not at every step."""
    import jax.numpy as jnp
    from jax import lax

    P, n, R = ring.devices, ring.chunks // ring.devices, ring.rounds
    i = lax.axis_index(ring.axis_name)
    qc, kc, vc = _split(q, n), _split(k, n), _split(v, n)
    oc, gc, mc, lc = _split(out, n), _split(d_out, n), _split(m, n), _split(l, n)
    C = qc[0].shape[1]
    c = C // R

    mine = ring.owned(i)
    acc_dt = jnp.promote_types(q.dtype, jnp.float32)
    zero = lambda *x: (jnp.zeros_like(x[0]), jnp.zeros_like(x[1]), jnp.zeros_like(x[2]))  # noqa: E731
    as_tuple = lambda f: (lambda *x: tuple(f(*x)))  # noqa: E731

    def blocks(rows):  # rows queries against one travelling piece: (dQ, dK, dV) of the pair
        _, adj = _kernels(kern, _pair_shapes(ring, rows, qc[0], kc[0], vc[0]), q.dtype, scale, implementation)
        return [as_tuple(adj(False)), as_tuple(adj(True))]

    full, diag = blocks(C)
    small = blocks(c) if R > 1 else None
    perm = _ring_step(ring)
    send = lambda xs: [lax.ppermute(x, ring.axis_name, perm) for x in xs]  # noqa: E731

    def one_round(j, dq):
        """Piece j of each key chunk around the ring: dQ accumulates in place; the piece's
        dK and dV travel with it and arrive home after P sends."""
        if R == 1:
            diagonal = diag
        else:
            def diagonal(*x):  # the pair's causal mask cut along both axes (``_fold``), in a loop
                stay, trav = x[:1] + x[3:], x[1:3]

                def piece(qp, carry):
                    dq, dk, dv = carry
                    rows = _rows(stay, qp, c)
                    g = lax.switch(_sub_kind(qp, j), [*small, zero], rows[0], *trav, *rows[1:])
                    return (lax.dynamic_update_slice_in_dim(dq, g[0], qp * c, axis=1),
                            dk + g[1].astype(acc_dt), dv + g[2].astype(acc_dt))
                # dQ in the dtype the pieces' adjoints give it (the skipped piece's zeros: Q's)
                return lax.fori_loop(0, R, piece, (jnp.zeros(stay[0].shape, stay[0].dtype),
                                                   jnp.zeros(trav[0].shape, acc_dt), jnp.zeros(trav[1].shape, acc_dt)))
        branches = [full, diagonal, zero]

        def visit(r, dq, kp, vp, dk, dv):
            theirs = ring.owned((i - r) % P)
            dq, dk, dv = list(dq), list(dk), list(dv)
            for a in range(n):
                for b in range(n):
                    g = lax.switch(_kind(mine[a], theirs[b], is_causal), branches,
                                   qc[a], kp[b], vp[b], gc[a], mc[a], lc[a], oc[a])
                    dq[a], dk[b], dv[b] = (x + y.astype(acc_dt) for x, y in zip((dq[a], dk[b], dv[b]), g))
            return dq, dk, dv

        def step(r, carry):
            dq, kp, vp, dk, dv = carry
            dq, dk, dv = visit(r, dq, kp, vp, dk, dv)
            return dq, send(kp), send(vp), send(dk), send(dv)

        kp, vp = [_piece(x, j, c) for x in kc], [_piece(x, j, c) for x in vc]
        dk, dv = ([jnp.zeros(x.shape, acc_dt) for x in xs] for xs in (kp, vp))
        dq, kp, vp, dk, dv = lax.fori_loop(0, P - 1, step, (dq, kp, vp, dk, dv))
        dq, dk, dv = visit(P - 1, dq, kp, vp, dk, dv)
        return dq, send(dk), send(dv)  # the P-th send brings each piece's dK, dV home

    dq = [jnp.zeros(x.shape, acc_dt) for x in qc]
    if R == 1:
        dq, dk, dv = one_round(0, dq)
    else:
        def each_round(j, carry):
            dq, dk, dv = carry
            dq, dkp, dvp = one_round(j, dq)
            put = lambda home, got: [lax.dynamic_update_slice_in_dim(h, g, j * c, axis=1)  # noqa: E731
                                     for h, g in zip(home, got)]
            return dq, put(dk, dkp), put(dv, dvp)
        dk, dv = ([jnp.zeros(x.shape, acc_dt) for x in xs] for xs in (kc, vc))
        dq, dk, dv = lax.fori_loop(0, R, each_round, (dq, dk, dv))
    cat = lambda xs, x: jnp.concatenate(xs, axis=1).astype(x.dtype)  # noqa: E731
    return cat(dq, q), cat(dk, k), cat(dv, v)


def _in_order(ring: Ring, f, *xs):
    """f on the arrays in ring order (zigzag: reordered there and the results back)."""
    if ring.balance != "zigzag":
        return f(*xs)
    res = f(*(to_zigzag(x, ring) for x in xs))
    return tuple(from_zigzag(r, ring) for r in res) if isinstance(res, tuple) else from_zigzag(res, ring)


# what a second derivative through the ring is told: the ring's backward and tangent are
# walks of their own (collectives, the softmax monoid's merges), not kernels with derived
# derivatives
SECOND_ORDER = ("the ring runs first derivatives only (jax.grad, jax.jvp, jax.linearize); for a second one, "
                "call dot_product_attention on inputs not split along the sequence")


def _local_attention(kern, ring: Ring, is_causal: bool, scale: float, implementation, residual: bool = False):
    """The per-device ring attention (inside ``shard_map``), differentiable as a kernel is
    (``runtime.differentiable``): ``jax.grad`` runs the ring backward, ``jax.jvp`` the ring of
    tangents (``tangent_local``). With ``residual``, (Out, lse = m + log l): the rows'
    log-sum-exp, held constant (no cotangent, a zero tangent)."""
    import jax.numpy as jnp

    from moajax import runtime

    kw = dict(is_causal=is_causal, scale=scale, implementation=implementation)
    n_out = 2 if residual else 1

    def result(q, out, m, l):
        out = out.astype(q.dtype)
        return (out, (m + jnp.log(l)).astype(q.dtype)) if residual else (out,)

    def run(q, k, v):
        got = result(q, *forward_local(kern, ring, q, k, v, **kw))
        return got if residual else got[0]

    def saving(q, k, v):  # the outputs, then what the backward reads: Out (accumulation dtype), m, l
        out, m, l = forward_local(kern, ring, q, k, v, **kw)
        return result(q, out, m, l) + (out, m, l)

    def backward(args, saved, outs, cts, wrt):  # (the ring's walk gives dQ, dK and dV together)
        return list(backward_local(kern, ring, *args, *saved, cts[0], **kw))

    def tangent(args, dots):
        t_out = tangent_local(ring, *args, *dots, **kw)[1].astype(args[0].dtype)
        return (t_out, jnp.zeros(args[0].shape[:3], args[0].dtype)) if residual else (t_out,)

    # the backward, tangent and saving forward, traced after this call (jax.grad), take its
    # matmul precision config, as ``Kernel.compiled``'s do
    at = functools.partial(compat.at_matmul_precision, value=compat.matmul_precision_config())
    return runtime.differentiable(run, at(backward), n_out, lambda: at(saving), at(tangent), (True,) * 3,
                                  (True,) * n_out, name="ring_attention", second_order=SECOND_ORDER)


class SequenceLift:
    """The plain attention kernel's sequence split over a mesh axis, under ``jax.jit`` with
    sharded inputs: its forward, saving forward, adjoints and tangent each run their ring
    (``moajax.shard.partitioned`` calls ``for_dnf`` for each kernel's DNF)."""

    def __init__(self, kern, local=None):
        self.kern = kern
        self.local = kern if local is None else local

    def for_dnf(self, dnf, options, onf=None):
        """The lift of one of the kernel's DNFs (its forward, saving forward, adjoints or
        tangent), or None; ``onf``: the call's ONF or Preset (a Preset's ``ring`` names the balance)."""
        ins = tuple(i.name for i in dnf.inputs)
        outs = tuple(o.name for o in dnf.outputs)
        if ins[:3] != ("query", "key", "value"):
            return None
        # the ring runs scale and is_causal only: a window (an option of the same kernel, whose
        # lift a plain call set) is refused by the plain split's check, never run without it
        if {k for k, v in options.items() if v is not None} - {"scale", "is_causal"}:
            return None
        # nor T ≠ S (a ring pairs query and key chunks of one length): the plain split's check
        # names it, where the ring's blocks failed inside the partitioner
        if dnf.inputs[0].shape[1] != dnf.inputs[1].shape[1]:
            return None
        # the kernel with the rows' log-sum-exp as a second output (return_residual): its
        # adjoints take lse's cotangent (held constant: unread) and read lse as an output
        res = ("lse",) if outs[-1:] in (("lse",), ("t_lse",)) or "d_lse" in ins else ()
        cts = ("d_out",) + tuple(f"d_{o}" for o in res)
        if ins == ("query", "key", "value", "t_query", "t_key", "t_value") and outs == ("t_out",) + tuple(
                f"t_{o}" for o in res):  # the tangent kernel (jax.jvp): lse's tangent is 0
            return _Lifted(self.local, "tangent", dict(options), onf, bool(res))
        # the saved: row max, row sum[, a 16-bit kernel's Out before rounding]
        saved = tuple(n for n in outs + ins if n.startswith("saved"))
        if saved not in ((), ("saved0", "saved1"), ("saved0", "saved1", "saved2")):
            return None
        # an adjoint gives the cotangents a jax.grad asks for (argnums), in order: the ring's
        # walk computes all three, and the kernel's outputs are those
        grads = ("d_query", "d_key", "d_value")
        picked = (tuple(grads.index(o) for o in outs)
                  if outs and set(outs) <= set(grads) and list(outs) == sorted(outs, key=grads.index) else None)
        if ins == ins[:3] and outs == saved + ("out",) + res:
            role = "saving" if saved else "forward"
        elif ins[3:] == cts and picked is not None:
            role = "adjoint"
        elif ins[3:] == cts + saved + ("out",) + res and saved and picked is not None:
            role = "adjoint_saved"
        else:
            return None
        return _Lifted(self.local, role, dict(options), onf, bool(res), picked)


class _Lifted:
    def __init__(self, kern, role: str, options: dict, onf=None, residual: bool = False, picked=None):
        # a Preset's ``ring`` names the balance, its ``ring_rounds`` the rounds
        self.kern, self.role, self.options = kern, role, options
        self.picked = (0, 1, 2) if picked is None else picked  # an adjoint's: which of (dQ, dK, dV) it outputs
        self.balance, self.rounds = getattr(onf, "ring", None), getattr(onf, "ring_rounds", None) or 1
        self.residual = residual

    def classes(self, rule) -> frozenset:
        """The classes of the queries' and the keys' sequence axes (axis 1 of query and key)."""
        return frozenset(rule.inputs[i][2][1].cls for i in (0, 1)) - {None}

    def _ring(self, axis_name: str, devices: int) -> "Ring":
        # each kernel (forward, saving forward, adjoint) reorders its own blocks from the
        # inputs' contiguous split and back, so each may take either balance
        causal = bool(self.options.get("is_causal", False))
        return Ring(axis_name, devices, self.balance or ("zigzag" if causal else "contiguous"), self.rounds)

    def check_split(self, axis_name: str, devices: int, shapes) -> None:
        """Raise the ValueError of a split this ring cannot take (``shapes``: the inputs' global
        shapes, query first): each device's queries divide into its chunks and their pieces.
        ``moajax.shard.conform`` asks it while tracing, where the split is visible, so that the
        error is named there and not wrapped by XLA's partitioner."""
        ring = self._ring(axis_name, devices)
        T = shapes[0][1] // devices
        if T % (ring.chunks // devices * ring.rounds):
            raise ValueError(f"dot_product_attention: each device's {T} queries do not split into the "
                             f"{ring.chunks // devices} chunks of {ring}, {ring.rounds} pieces each")
        if self.role in ("adjoint", "adjoint_saved") and shapes[1][1] // (ring.chunks * ring.rounds) < 2:
            # a block's adjoint reads Δ from the whole row's Out only over 2 keys or more
            # (``_local_attention``'s refusal, here before the partitioner asks for it)
            raise ValueError(f"dot_product_attention: the gradient of a ring block of "
                             f"{shapes[1][1] // (ring.chunks * ring.rounds)} key(s) cannot read the whole row's output")

    def per_device(self, axis_name: str, devices: int, local_in, local_out):
        import jax.numpy as jnp

        causal = bool(self.options.get("is_causal", False))
        # the query's and the key's global shapes (a statistic's block may have dropped axes)
        self.check_split(axis_name, devices, [(s[0], s[1] * devices) + tuple(s[2:]) for s in local_in[:2]])
        ring = self._ring(axis_name, devices)
        scale = self.options.get("scale")
        scale = 1.0 / math.sqrt(local_in[0][-1]) if scale is None else float(scale)
        kw = dict(is_causal=causal, scale=scale)
        kern, rows = self.kern, tuple(local_in[0][:3])
        fwd = lambda q, k, v: forward_local(kern, ring, q, k, v, **kw)  # noqa: E731
        # the kernel's (Out[, lse]): lse = m + log l in its declared layout and dtype
        results = lambda q, out, m, l: (out.astype(q.dtype),) + (  # noqa: E731
            ((m + jnp.log(l)).reshape(local_out[-1]).astype(q.dtype),) if self.residual else ())

        if self.role == "tangent":
            def tangent(q, k, v, tq, tk, tv):
                body = lambda *xs: tangent_local(ring, *xs, **kw)[1]  # noqa: E731
                t_out = _in_order(ring, body, q, k, v, tq, tk, tv).astype(q.dtype)
                return (t_out, jnp.zeros(local_out[-1], q.dtype)) if self.residual else t_out
            return tangent
        if self.role == "forward":
            def forward(q, k, v):
                # only what the kernel returns goes back to the contiguous split: Out[, lse]
                def body(q, k, v):
                    out, m, l = fwd(q, k, v)
                    return (out, m + jnp.log(l)) if self.residual else out
                got = _in_order(ring, body, q, k, v)
                if not self.residual:
                    return got.astype(q.dtype)
                return got[0].astype(q.dtype), got[1].reshape(local_out[-1]).astype(q.dtype)
            return forward
        if self.role == "saving":
            def saving(q, k, v):
                out, m, l = _in_order(ring, fwd, q, k, v)
                unrounded = (out.reshape(local_out[2]),) if len(local_out) - self.residual > 3 else ()  # (16-bit)
                return (m.reshape(local_out[0]), l.reshape(local_out[1])) + unrounded + results(q, out, m, l)
            return saving
        if self.role == "adjoint_saved":
            def adjoint_saved(q, k, v, g, *rest):  # (lse's cotangent and lse: held constant, unread)
                m, l, out = rest[self.residual:self.residual + 3]  # (16-bit: saved2, Out unrounded)
                body = lambda q, k, v, g, m, l, o: backward_local(kern, ring, q, k, v, o, m, l, g, **kw)  # noqa: E731
                return self._picked(_in_order(ring, body, q, k, v, g, m.reshape(rows), l.reshape(rows),
                                              out.reshape(rows + (local_in[2][-1],))))
            return adjoint_saved

        def adjoint(q, k, v, g, *_):
            def body(q, k, v, g):
                out, m, l = fwd(q, k, v)
                return backward_local(kern, ring, q, k, v, out, m, l, g, **kw)
            return self._picked(_in_order(ring, body, q, k, v, g))
        return adjoint

    def batched_together(self, flags) -> tuple:
        """Under Ω (``shard.UnderOmega``), which arguments the batch must carry: an adjoint's
        query, cotangents, saved statistics and Out all, where any of the last is batched. A
        block adjoint batched over its cotangent alone (``jax.jacrev``) is derived with Δ =
        +/(dO × Out) summed over its own keys — the identity that reads the whole row's Out
        matches only with them batched alike — and gave wrong dQ and dK, silently (a fuzz)."""
        flags = tuple(bool(f) for f in flags)
        if self.role in ("adjoint", "adjoint_saved") and any(flags[3:]):
            return (True,) + flags[1:3] + (True,) * (len(flags) - 3)
        return flags

    def _picked(self, grads):
        """The cotangents the adjoint kernel outputs, of the ring's (dQ, dK, dV)."""
        got = tuple(grads[i] for i in self.picked)
        return got if len(got) > 1 else got[0]


def sequence_lift(kern, local=None):
    """``kern`` (a plain attention kernel: no bias, mask, lengths or score_mod) with its
    sequence lifted by the ring where it is split over devices; ``local``: the kernel each
    device runs on its chunk pairs (the plain one where ``kern`` also outputs lse, which the
    ring takes from its combined max and sum)."""
    if kern.mesh_lift is None:
        kern.mesh_lift = SequenceLift(kern, local)
    return kern


def _zigzag_pairs(P: int, h: int):
    """(source, target) device pairs moving half h of the contiguous split into the zigzag
    slots: slot 0 of device i is chunk i, slot 1 chunk 2P−1−i (chunk c lives at device c//2).
    Returned as (into slot 0, into slot 1)."""
    slot0 = [(d, 2 * d + h) for d in range(P) if 2 * d + h < P]
    slot1 = [(d, 2 * P - 1 - 2 * d - h) for d in range(P) if 2 * d + h >= P]
    return slot0, slot1


def _half_permutation(P: int, h: int):
    """Half h of every device's contiguous block, each to the device whose zigzag slot holds
    it: a permutation of the devices (chunks 2d + h share h's parity, and chunk c and 2P−1−c,
    the two chunks of one device, have opposite parities), so one ``ppermute`` moves it."""
    return [pair for pairs in _zigzag_pairs(P, h) for pair in pairs]


def to_zigzag(x, ring: Ring):
    """A device's contiguous block (chunks 2i, 2i+1) → its zigzag block (chunks i, 2P−1−i).

    Device i receives one chunk of each parity: chunk i (slot 0) has i's parity, so slot 0
    comes from half i mod 2 and slot 1 from the other; two ``ppermute``s, each buffer the
    size of half a block, and a select."""
    import jax.numpy as jnp
    from jax import lax

    halves = _split(x, 2)
    got = [lax.ppermute(halves[h], ring.axis_name, _half_permutation(ring.devices, h)) for h in range(2)]
    even = lax.axis_index(ring.axis_name) % 2 == 0
    return jnp.concatenate([lax.select(even, got[0], got[1]), lax.select(even, got[1], got[0])], axis=1)


def from_zigzag(x, ring: Ring):
    """The inverse of ``to_zigzag``: the slot of parity h goes home as half h."""
    import jax.numpy as jnp
    from jax import lax

    slots = _split(x, 2)
    even = lax.axis_index(ring.axis_name) % 2 == 0
    parity = [lax.select(even, slots[0], slots[1]), lax.select(even, slots[1], slots[0])]
    return jnp.concatenate([lax.ppermute(parity[h], ring.axis_name, [(t, s) for s, t in
                                                                      _half_permutation(ring.devices, h)])
                            for h in range(2)], axis=1)


def ring_attention(query, key, value, *, mesh, axis_name: str, is_causal: bool = False, scale=None,
                   balance: str | None = None, batch_axis=None, head_axis=None, implementation=None,
                   return_residual: bool = False, rounds: int = 1):
    """softmax(scale · Q +.× ⍉K [causal]) +.× V with the sequence split over ``axis_name`` of
    ``mesh`` — jax.nn.dot_product_attention's layout ([B, T, N, H], key and value [B, S, K, H],
    GQA when K < N), T = S.

    Each device holds S/P of the queries, keys and values (the inputs' sequence axis split
    contiguously, as ``NamedSharding(mesh, P(batch_axis, axis_name, head_axis))`` splits it);
    K and V blocks travel the ring (``Ring``), the partial (max, sum, Out) of each block are
    combined by the softmax monoid, and the gradient runs the ring backward with the derived
    adjoint kernels. ``balance``: "zigzag" (the default when causal: every step the same
    work) or "contiguous"; ``batch_axis`` and ``head_axis``: mesh axes that also split the
    batch and the heads (each device then holds its heads' blocks). Differentiable by
    ``jax.grad`` (the ring backward) and ``jax.jvp`` (the ring of tangents); jit-compatible;
    the compiled program moves K/V by collective-permute only.
    ``return_residual``: also the rows' log-sum-exp [B, T, N] from the combined (max, sum),
    held constant under differentiation (as ``dot_product_attention``'s). ``rounds``: the
    ring runs that many rounds, each carrying 1/rounds of every K and V block (and, in the
    backward, of dK and dV): less memory in flight per device, the same bytes in more sends.
    """
    import jax
    from jax.sharding import PartitionSpec as P

    from moajax import compat

    who = "ring_attention"
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{who}: {name} must be an array, got {type(x).__name__}")
    if not (query.dtype == key.dtype == value.dtype) or not jax.numpy.issubdtype(query.dtype, jax.numpy.floating):
        raise TypeError(f"{who}: query, key and value must share one floating dtype; got {query.dtype}, "
                        f"{key.dtype}, {value.dtype}")
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        raise ValueError(f"{who}: query, key and value must have rank 4 [B, T, N, H]; got "
                         f"{query.shape}, {key.shape}, {value.shape}")
    B, T, N, H = query.shape
    S, K = key.shape[1], key.shape[2]
    if key.shape[0] != B or value.shape[:3] != key.shape[:3] or key.shape[3] != H:
        raise ValueError(f"{who}: key {key.shape} and value {value.shape} do not match query {query.shape}")
    if S != T:
        raise ValueError(f"{who}: the ring splits one sequence: query length {T} must equal key length {S}")
    if N % K:
        raise ValueError(f"{who}: query has {N} heads, not a multiple of the {K} key/value heads")
    from jax.sharding import Mesh

    from moajax import runtime

    flags = runtime.check_flags(who, is_causal=is_causal, return_residual=return_residual)
    is_causal, return_residual = flags["is_causal"], flags["return_residual"]

    if not isinstance(mesh, Mesh):
        raise TypeError(f"{who}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if min(B, T, N, H, K, value.shape[3]) == 0:
        raise ValueError(f"{who}: zero-size dimension in query {query.shape}, key {key.shape} or value {value.shape}")
    scale = runtime.check_scale(scale, who)
    runtime.check_implementation(implementation, who)
    if axis_name not in mesh.shape:
        raise ValueError(f"{who}: axis_name {axis_name!r} is not an axis of the mesh {dict(mesh.shape)}")
    for name, ax in (("batch_axis", batch_axis), ("head_axis", head_axis)):
        if ax is not None and (ax not in mesh.shape or ax == axis_name):
            raise ValueError(f"{who}: {name} {ax!r} must be another axis of the mesh {dict(mesh.shape)}")
    if batch_axis is not None and B % mesh.shape[batch_axis]:
        raise ValueError(f"{who}: batch {B} is not divisible by mesh axis {batch_axis!r} ({mesh.shape[batch_axis]})")
    if head_axis is not None and K % mesh.shape[head_axis]:
        raise ValueError(f"{who}: the {K} key/value heads are not divisible by mesh axis {head_axis!r} "
                         f"({mesh.shape[head_axis]})")
    balance = balance or ("zigzag" if is_causal else "contiguous")
    ring = Ring(axis_name, int(mesh.shape[axis_name]), balance, check_ring_rounds(rounds, who))
    if S % (ring.chunks * ring.rounds):
        raise ValueError(f"{who}: sequence length {S} is not divisible into the {ring.chunks} chunks of {ring}"
                         + (f", {ring.rounds} pieces each" if ring.rounds > 1 else ""))
    scale = 1.0 / math.sqrt(H) if scale is None else float(scale)
    from moajax.kernels.attention import mha_kernel

    attend = _local_attention(mha_kernel(None, None, K != N, False, False, None), ring, bool(is_causal), scale,
                              implementation, bool(return_residual))

    def per_device(q, k, v):
        # the differentiable reorder outside the ring's differentiable call: its transpose
        # reorders the gradients
        return _in_order(ring, attend, q, k, v)

    spec = P(batch_axis, axis_name, head_axis, None)
    out_specs = (spec, P(batch_axis, axis_name, head_axis)) if return_residual else spec
    return compat.shard_map(per_device, mesh=mesh, in_specs=(spec, spec, spec), out_specs=out_specs)(query, key, value)


__all__ = ["Ring", "ring_attention", "sequence_lift", "forward_local", "backward_local", "to_zigzag", "from_zigzag",
           "BALANCES"]
