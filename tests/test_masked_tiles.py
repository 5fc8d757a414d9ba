"""Masked tiles are skipped, not computed and masked (``rewrites.skip_masked``, ``moajax.masked``).

What is checked: the bounds the analysis finds in attention's masks (causal, local window,
lengths), and the guard a mask on data gets (the rows' statistics, ``RowGuard``); that
skipping changes no bit of any output or gradient (the online softmax and the Σ over skipped tiles add exact
identities), on XLA and on Pallas-interpret, including fully masked rows (the guard walks
every tile there: jax.nn's uniform average); that skipped tiles are never read (NaN planted in
them does not reach the result; without the skip it does — the test can fail); the tile spans
against brute-force enumeration; the cost model's share; the ONF's validation. The interior
tiles (``rewrites.unmask_interior``): exactly the tiles every point keeps (enumerated), walked
in loops that build no mask, held to the reference; the cost model counts the mask on the
boundary tiles only. (The 300-example
property test over random shapes, windows, lengths and groupings runs in these small tiles:
test_attention_variants.py.)

Tolerances: float64 rel ≤ 1e-12 against the independent reference (tests/references.py), as in
test_attention_variants.py; skip against no skip: bitwise (0.0) — the skipped terms are exact
zeros and leave every running maximum unchanged; the interior unmasked against the reference
only (a compiler may round a product differently in the last bit without the select).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import moajax
import references as R
from helpers import jnp_attention
from moajax import cost, machines, masked, runtime, schedule
from moajax import dnf as D
from moajax.kernels.attention import mha_kernel
from moajax.onf import ONFError, OnlineStage, RowGuard
from moajax.schedule import Preset

SDS = jax.ShapeDtypeStruct
TILES = {"t": 2, "s": 2}  # small tiles: several per axis at test sizes, so loops skip


def _dnf(B=2, T=64, S=64, N=4, K=2, H=8, qlen=False, kvlen=False, mask=False, **kw):
    specs = [SDS((B, T, N, H), np.float32), SDS((B, S, K, H), np.float32), SDS((B, S, K, H), np.float32)]
    specs += [SDS((B, 1, T, S), np.bool_)] if mask else []
    specs += [SDS((B,), np.int32)] * (int(qlen) + int(kvlen))
    kern = mha_kernel(None, "b n1 t s" if mask else None, K != N, qlen, kvlen)
    return kern, specs, kern.dnf(*specs, **kw)


def test_causal_window_and_length_bounds_are_found():
    _, _, d = _dnf(kvlen=True, is_causal=True, local_window_size=(8, 0))
    onf = schedule.derive(d, machines.load("h200"))
    online = next(s for s in onf.program.stages if isinstance(s, OnlineStage))
    sk = onf.skip_of(online.name)
    assert sk is not None and sk.var.name == "s"
    assert sorted(b.text() for b in sk.bounds) == sorted(
        ["−s + t ≥ 0", "s − t + 8 ≥ 0", "−s + ⟨b⟩ψkey_value_seq_lengths − 1 ≥ 0"])
    # ⌈ leaves out the fill only in a row keeping a key: every bound is kept, with a guard
    assert all(sk.kept) and sk.guard is not None and sk.guard.var.name == "s"
    assert "skip:" in onf.pretty() and "skip_masked" in onf.pretty()


def test_the_backward_skips_exactly_where_the_adjoint_masks_with_zero():
    kern, specs, _ = _dnf(K=4, qlen=True, kvlen=True, is_causal=True)
    adj, aspecs = kern.saved_adjoint(*specs, is_causal=True)
    plan = schedule.derive_plan(adj.dnf(*aspecs, is_causal=True), machines.load("h200"))
    by_out = {o.dnf.outputs[0].name: o for o in plan}
    dq = by_out["d_query"]
    causal = [sk for sk in dq.skips if sk.var.name == "s" and "−s + t ≥ 0" in [b.text() for b in sk.bounds]]
    assert causal and not any(k for sk in causal for k in sk.kept)  # `c ? … : 0`: no kept key needed
    dkv = [o for o in plan if o is not dq]
    kept = [sk for o in dkv for sk in o.skips if sk.var.name == "t"]
    assert kept and all("−s + t ≥ 0" in [x.text() for x in sk.bounds] for sk in kept)
    # dV's Σ_t P × dO needs exp(m₀ − max) = 0: kept, and rows past the query length are exempt
    # from the guard (their cotangent is 0), so padding does not switch the skip off
    dv = [sk for sk in kept if any(sk.kept)]
    assert dv and all(sk.guard is not None for sk in dv)
    assert any("query_seq_lengths" in c.text() for sk in dv for c in sk.guard.exempt)


def test_a_data_mask_gives_a_guard_on_the_rows_statistics():
    # a bool mask can mask a whole row: no closed-form guard. The rows' statistics decide
    # (``RowGuard``): the forward's own running max after its walk, the backward's saved max
    # read before it — where there was no kept bound at all (the forward walked every tile)
    _, _, d = _dnf(mask=True, is_causal=True)
    h200 = machines.load("h200")
    onf = schedule.derive(d, h200)
    online = next(s for s in onf.program.stages if isinstance(s, OnlineStage))
    sk = onf.skip_of(online.name)
    assert sk.kept == (True,) and isinstance(sk.guard, RowGuard) and sk.guard.stats == ()
    assert "running max, after the walk" in str(onf)
    kern, specs, _ = _dnf(mask=True, is_causal=True, qlen=True)
    adj, args = kern.saved_adjoint(*specs, is_causal=True)
    plan = schedule.derive_plan(adj.dnf(*args, is_causal=True), dataclasses.replace(h200, spill_check=False))
    guards = [sk.guard for o in plan for sk in o.skips if any(sk.kept)]
    assert guards and all(isinstance(g, RowGuard) and g.stats for g in guards)
    # the rows past a query length have no key and a 0 cotangent: exempt from the check
    assert all(len(g.exempt) == 1 and "length" in D.show(g.exempt[0]) for g in guards), guards
    # the cost model takes rows as keeping keys: it counts the skip as plain causal's
    fractions = []
    for mask in (True, False):
        o = schedule.derive(_dnf(B=1, T=1024, S=1024, mask=mask, is_causal=True)[2], h200)
        fractions.append(masked.visited_fraction(o, o.skip_of(online.name)))
    assert fractions[0] == fractions[1] < 0.6, fractions


def test_skip_false_and_stale_skips():
    _, _, d = _dnf(is_causal=True)
    h200 = machines.load("h200")
    assert schedule.derive(d, h200, Preset.of(skip=False)).skips == ()
    onf = schedule.derive(d, h200)
    assert onf.skips
    other = schedule.derive(_dnf(is_causal=True, local_window_size=(3, 3))[2], h200)
    stale = dataclasses.replace(other, skips=onf.skips)
    with pytest.raises(ONFError, match="skip"):
        stale.validate()
    with pytest.raises(TypeError, match="skip must be a bool"):
        Preset.of(skip="yes")


# ----------------------------------------------------------------------------- exactness

B, T, S, N, K, H = 2, 9, 11, 4, 2, 3


def _qkv(dtype=np.float64, T=T, S=S, K=K, seed=0):
    r = np.random.default_rng(seed)
    return [r.standard_normal(s).astype(dtype) for s in [(B, T, N, H), (B, S, K, H), (B, S, K, H), (B, T, N, H)]]


def _value_and_grads(impl, skip, q, k, v, g, unmask_interior=None, **kw):
    onf = Preset.of(tiles=TILES, skip=skip, unmask_interior=unmask_interior)

    def f(q, k, v):
        return moajax.dot_product_attention(q, k, v, implementation=impl, onf=onf, **kw)

    out, vjp = jax.vjp(f, q, k, v)
    return [out, *vjp(g)]


def _masks():
    r = np.random.default_rng(11)
    kept = r.random((B, 1, T, S)) < 0.5
    kept[..., 0] = True
    dropped = kept.copy()
    dropped[0, :, [2, 7]] = False  # two rows of batch element 0: no key at all
    past = kept.copy()
    past[0, :, 6:] = False  # the rows past batch element 0's query length (6)
    return {"kept": kept, "dropped": dropped, "past": past}


_MASKS = _masks()

CASES = {
    "causal": dict(is_causal=True),
    "window": dict(local_window_size=(2, 1)),
    "causal, kv lengths, one empty": dict(is_causal=True, key_value_seq_lengths=np.array([11, 0], np.int32)),
    # dK and dV's key tiles past a length walk no query where every query keeps a key
    "kv lengths": dict(key_value_seq_lengths=np.array([5, 11], np.int32)),
    "window, both lengths": dict(local_window_size=(3, 0), query_seq_lengths=np.array([6, 9], np.int32),
                                 key_value_seq_lengths=np.array([4, 11], np.int32)),
    # T > S with a window: the last rows keep no key (fully masked: jax.nn's average of V)
    "rows past every key": dict(local_window_size=(1, 0), T=14, S=6),
    # a mask on data beside causal: the rows' statistics guard the causal skip (``RowGuard``):
    # every row keeping a key (key 0), the forward's max and the backward's saved statistic
    # pass; rows a mask drops whole make their programs walk every tile (jax.nn's average)
    "causal, a mask keeping a key in every row": dict(is_causal=True, mask=_MASKS["kept"]),
    "causal, a mask dropping whole rows": dict(is_causal=True, mask=_MASKS["dropped"]),
    "causal, query lengths, a mask dropping the rows past them": dict(
        is_causal=True, mask=_MASKS["past"], query_seq_lengths=np.array([6, 9], np.int32)),
}


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
@pytest.mark.parametrize("case", list(CASES))
def test_skipping_changes_no_bit_and_matches_the_reference(case, impl):
    # skipping alone changes no bit; the interior tiles walked unmasked (the default) sum the
    # same terms in the same order, but the select gone, the compiler may round a product
    # differently in the last bit (seen: dQ, dK under Pallas interpret): both are
    # held to the float64 reference
    kw = dict(CASES[case])
    shape = dict(T=kw.pop("T", T), S=kw.pop("S", S))
    q, k, v, g = _qkv(**shape)
    got = _value_and_grads(impl, None, q, k, v, g, unmask_interior=False, **kw)
    full = _value_and_grads(impl, False, q, k, v, g, **kw)
    for a, b in zip(got, full):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    inner = _value_and_grads(impl, None, q, k, v, g, unmask_interior=True, **kw)
    ref = [R.mha_variants(q, k, v, **kw)] + list(R.mha_variants(q, k, v, dout=g, **kw)[:3])
    for run in (got, inner):
        for a, b in zip(run, ref):
            assert np.all(np.isfinite(a))
            assert float(np.max(np.abs(np.asarray(a) - b))) <= 1e-12 * max(float(np.max(np.abs(b))), 1.0)


def _poisoned(impl, keys, **kw):
    """(value and grads with NaN in K and V at ``keys`` of batch element 0, the same with 0
    there, the NaN run with every tile walked)."""
    q, k, v, g = _qkv(T=5)
    k, v = k.copy(), v.copy()
    k[0, keys], v[0, keys] = 0.0, 0.0
    # read back before k and v change in place: a CPU call may alias a NumPy argument and
    # run after it returns (seen: NaN in this run, where a row walks the poisoned keys)
    clean = [np.asarray(x) for x in _value_and_grads(impl, None, q, k, v, g, **kw)]
    k, v = k.copy(), v.copy()
    k[0, keys], v[0, keys] = np.nan, np.nan
    return (_value_and_grads(impl, None, q, k, v, g, **kw), clean,
            _value_and_grads(impl, False, q, k, v, g, **kw))


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_skipped_tiles_are_never_read(impl):
    # causal with 5 queries and 11 keys in tiles of 2: no program walks past key tile 2, so keys
    # 6 … 10 are never read — NaN there cannot reach the result. Walked and masked, 0 × NaN
    # poisons every row: the test can fail
    got, clean, walked = _poisoned(impl, slice(6, None), is_causal=True)
    for a, b in zip(got, clean):
        assert np.array_equal(np.asarray(a)[:, :6], np.asarray(b)[:, :6])
    assert not np.all(np.isfinite(walked[0]))


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_a_data_mask_keeps_the_causal_skip_where_every_row_keeps_a_key(impl):
    # a bool mask beside causal: the skip of keys 6 … 10 is kept (its guard reads the rows'
    # statistics, ``RowGuard``), so NaN there cannot reach the result. One row masked whole
    # (jax.nn averages V over every key) makes the programs holding it walk every tile, so
    # NaN reaches it: both ways the test can fail
    mask = np.random.default_rng(5).random((B, 1, 5, S)) < 0.5
    mask[..., 0] = True
    got, clean, walked = _poisoned(impl, slice(6, None), is_causal=True, mask=mask)
    for a, b in zip(got, clean):
        assert np.array_equal(np.asarray(a)[:, :6], np.asarray(b)[:, :6])
    assert not np.all(np.isfinite(walked[0]))
    mask[0, :, 3] = False
    got, clean, _ = _poisoned(impl, slice(6, None), is_causal=True, mask=mask)
    out = np.asarray(got[0])
    assert not np.all(np.isfinite(out[0, 3])) and np.all(np.isfinite(out[1]))
    q, k, v, _ = _qkv(T=5)
    k[0, 6:], v[0, 6:] = 0.0, 0.0  # as ``clean`` has them
    want = R.mha_variants(q, k, v, is_causal=True, mask=mask)
    assert float(np.max(np.abs(np.asarray(clean[0]) - want))) <= 1e-12 * float(np.max(np.abs(want)))


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_rows_masked_whole_in_tiles_of_one_key(impl):
    # the rows a mask on data drops whole take every tile's values with weight 1: in tiles of
    # one key the weights have no key axis, as the walk's (it crashed there: the A40 profile's
    # tiling of a windowed score_mod's −∞, found by a fuzz)
    q, k, v, g = _qkv()
    mask = _MASKS["dropped"]

    def run(skip):
        onf = Preset.of(tiles={"t": 2, "s": 1}, skip=skip)
        f = lambda q, k, v: moajax.dot_product_attention(q, k, v, implementation=impl, onf=onf,  # noqa: E731
                                                         is_causal=True, local_window_size=(3, 4), mask=mask)
        out, vjp = jax.vjp(f, q, k, v)
        return [np.asarray(x) for x in (out, *vjp(g))]

    got, full = run(None), run(False)
    for a, b in zip(got, full):
        assert np.array_equal(a, b)
    ref = R.mha_variants(q, k, v, is_causal=True, local_window_size=(3, 4), mask=mask)
    assert float(np.max(np.abs(got[0] - ref))) <= 1e-12 * float(np.max(np.abs(ref)))


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_jvp_skips_the_masked_tiles_and_takes_the_presets_skip(impl):
    # the tangent kernel skips the tiles causal masks (NaN planted there does not reach the
    # tangent), and takes the Preset's tiles and skip=False, as the backward does (it took only
    # the ring's settings and the knobs: skip=False did not reach jax.jvp — found by a fuzz)
    q, k, v, _ = _qkv(T=5)
    dq, dk, dv = (np.random.default_rng(9).standard_normal(x.shape) for x in (q, k, v))
    k, v = k.copy(), v.copy()
    k[0, 6:], v[0, 6:] = np.nan, np.nan

    def tangent(skip):
        f = lambda q, k, v: moajax.dot_product_attention(  # noqa: E731
            q, k, v, is_causal=True, implementation=impl, onf=Preset.of(tiles=TILES, skip=skip))
        return np.asarray(jax.jvp(f, (q, k, v), (dq, dk, dv))[1])

    assert np.all(np.isfinite(tangent(None)))
    assert not np.all(np.isfinite(tangent(False)))


@pytest.mark.parametrize("kv_heads", [K, N], ids=["gqa", "mha"])
def test_the_fused_backward_never_reads_skipped_key_tiles_on_xla(kv_heads):
    # on a CPU the fused plan's programs own key tiles and add dQ (FlashAttention-2's order):
    # its dQ partials over the key tiles past the causal span are skipped too (lower_xla walks
    # a scatter axis with masked tiles; vectorised, 0 × NaN reached every row of dQ with GQA)
    q, k, v, g = _qkv(T=5, K=kv_heads)
    onf = Preset.of(tiles=TILES, backward="fused")

    def run(k, v):
        f = lambda q, k, v: moajax.dot_product_attention(q, k, v, implementation="xla", onf=onf,  # noqa: E731
                                                         is_causal=True)
        out, vjp = jax.vjp(f, q, k, v)
        return [out, *vjp(g)]

    k, v = k.copy(), v.copy()
    k[0, 6:], v[0, 6:] = 0.0, 0.0
    clean = [np.asarray(x) for x in run(k, v)]  # read back before new arrays (``_poisoned``)
    k, v = k.copy(), v.copy()
    k[0, 6:], v[0, 6:] = np.nan, np.nan
    for a, b in zip(run(k, v), clean):
        assert np.array_equal(np.asarray(a)[:, :6], np.asarray(b)[:, :6])


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_keys_past_a_length_are_never_read_per_batch_element(impl):
    # Pallas: one program per batch element, so its length bounds its own walk. XLA runs the
    # grid vectorised, where a walk would span the batch's longest length: the batch axis a
    # bound reads a length at is looped instead (``schedule._loop_runtime_bounds``; until
    # 2026-12-06 this test ran on Pallas alone)
    kw = dict(is_causal=True, key_value_seq_lengths=np.array([2, 11], np.int32))
    got, clean, walked = _poisoned(impl, slice(2, None), **kw)
    for a, b in zip(got[:2], clean[:2]):  # the output and dQ
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert not np.all(np.isfinite(walked[0]))


@pytest.mark.parametrize("kvlen", [False, True])
def test_dq_programs_past_a_query_length_walk_no_tile(kvlen):
    """dQ = Σ_s dS × K: past a query length the cotangent's rows are 0 (jax.nn's), so dS is 0
    at every key — a plain 0, no kept key assumed. The skip records the row condition
    (``Skip.rows``): a program whose rows all fail it walks no tile; one with a row inside
    walks its keys. The saving forward's online pass records the rows past the length as
    dead: it writes its statistics (t < L) ? z : z̄, z̄ their closed form past the length
    (``identities.guard_statistics``), and leaves the rows out like the plain forward
    (test_forward_programs_past_a_query_length_walk_no_tile)."""
    from moajax import dnf as D

    Tn = Sn = 256
    kern, specs, d = _dnf(T=Tn, S=Sn, K=4, qlen=True, kvlen=kvlen)
    h200 = machines.load("h200")
    adj, aspecs = kern.saved_adjoint(*specs)
    (dq,) = [o for o in schedule.derive_plan(adj.dnf(*aspecs), h200) if o.dnf.outputs[0].name == "d_query"]
    (sk,) = [sk for sk in dq.skips if sk.var.name == "s"]
    assert [c.text() for c in sk.rows] == ["−t + ⟨b⟩ψquery_seq_lengths − 1 ≥ 0"] and not any(sk.kept)
    assert "rows: −t + ⟨b⟩ψquery_seq_lengths − 1 ≥ 0" in dq.pretty()
    saving = schedule.derive(kern.saving_forward(*specs).dnf(*specs), h200)
    assert [[c.text() for c in x.dead] for x in saving.skips] == [["−t + ⟨b⟩ψquery_seq_lengths − 1 ≥ 0"]]
    tile, ntiles = dq.axis_of(sk.var).tile, dq.axis_of(sk.var).ntiles
    rows = dq.axis_of(next(v for c in sk.rows for v, _ in c.terms if isinstance(v, type(sk.var)))).tile
    assert ntiles > 1 and rows < Tn
    for length in (0, rows, rows + 1, Tn):
        read = lambda r: np.array(length if "query" in D.show(r) else Sn)  # noqa: E731, B023
        for i in range(Tn // rows):
            box = {v: ((i * rows, (i + 1) * rows - 1) if v.name == "t" else (0, v.extent - 1))
                   for c in sk.bounds + sk.rows for v, _ in c.terms if isinstance(v, type(sk.var))}
            first, count = masked.tile_span(sk, tile, ntiles, box, read, np)
            assert int(count) == (0 if i * rows >= length else ntiles)


@pytest.mark.parametrize("causal", [False, True])
def test_forward_programs_past_a_query_length_walk_no_tile(causal):
    """The forward's out = (t < L) ? Σ_s P × V : 0 reads its online pass only where t < L: its
    values at rows past a query length are dead (``masked.dead_rows``), so a program whose rows
    all lie past it walks no key tile (``Skip.rows_dead``). Dead rows need keep no key, so they
    are exempt from the causal guard: a program holding rows on both sides of the length keeps
    its causal span (it walked every tile before 2026-12-06). So does the saving forward: its
    backward reads the row statistics only at rows within the length, and it saves them
    guarded there (``identities.guard_statistics``)."""
    from moajax import dnf as D

    Tn = Sn = 256
    kern, specs, d = _dnf(T=Tn, S=Sn, K=4, qlen=True, is_causal=causal)
    h200 = machines.load("h200")
    onf = schedule.derive(d, h200)
    online = next(s for s in onf.program.stages if isinstance(s, OnlineStage))
    sk = onf.skip_of(online.name)
    cond = "−t + ⟨b⟩ψquery_seq_lengths − 1 ≥ 0"
    assert [c.text() for c, dead in zip(sk.rows, sk.rows_dead) if dead] == [cond] and not any(sk.rows_kept)
    assert f"dead rows: {cond}" in onf.pretty()
    assert [c.text() for c in masked.dead_rows(onf, online)] == [cond]
    if causal:
        assert [c.text() for c in sk.guard.exempt] == [cond]
    saving = schedule.derive(kern.saving_forward(*specs, is_causal=causal).dnf(*specs, is_causal=causal), h200)
    (ssk,) = [x for x in saving.skips if any(x.rows_dead)]
    assert [c.text() for c in ssk.dead] == [cond] and (not causal or [c.text() for c in ssk.guard.exempt] == [cond])
    tile, ntiles = onf.axis_of(sk.var).tile, onf.axis_of(sk.var).ntiles
    rows = onf.axis_of(next(v for v in online.max_vars if v.name == "t")).tile
    assert ntiles > 1 and rows < Tn
    for length in (0, rows, rows + 1, Tn):
        read = lambda r: np.array(length if "query" in D.show(r) else Sn)  # noqa: E731, B023
        for i in range(Tn // rows):
            box = {v: ((i * rows, (i + 1) * rows - 1) if v.name == "t" else (0, v.extent - 1))
                   for c in sk.bounds + sk.rows + (sk.guard.conds + sk.guard.exempt if sk.guard else ())
                   for v, _ in c.terms if isinstance(v, type(sk.var))}
            ok = masked.guard_holds(sk.guard, box, read, np) if any(sk.kept) else True
            first, count = masked.tile_span(sk, tile, ntiles, box, read, np, ok)
            walked = ((i + 1) * rows - 1) // tile + 1 if causal else ntiles
            assert int(count) == (0 if i * rows >= length else walked), (length, i)


def test_a_data_masks_forward_leaves_its_dead_rows_unwalked_too():
    """With a bool mask the online pass's guard is its own running max (``RowGuard``): a row
    still at the fill after its walk kept no key and gets the sums of every tile. A row past
    the query length is exempt (nothing reads it), so a program wholly past it walks nothing
    at all rather than every tile again."""
    _, _, d = _dnf(T=256, S=256, K=4, qlen=True, mask=True, is_causal=True)
    onf = schedule.derive(d, machines.load("h200"))
    online = next(s for s in onf.program.stages if isinstance(s, OnlineStage))
    sk = onf.skip_of(online.name)
    assert isinstance(sk.guard, RowGuard) and not sk.guard.stats
    assert [D.show(a) for a in sk.guard.exempt] == ["(t < ⟨b⟩ψquery_seq_lengths)"]
    assert [c.text() for c, dead in zip(sk.rows, sk.rows_dead) if dead] == ["−t + ⟨b⟩ψquery_seq_lengths − 1 ≥ 0"]


def test_dead_rows_meet_as_conditions_however_written():
    """Two selects reading the online pass under t < 5 and under t ≤ 4 hold one condition:
    the rows where it fails are dead (the meet is over affine forms, not expression nodes), and
    the kernel's output with them left out matches every tile walked."""
    from moajax import moa
    from moajax.kernel import kernel
    from moajax.kernels.attention import attention_probs

    @kernel(example=dict(t=64, s=64, h=4, e=4), register=False)
    def two_ways(query: "t h", key: "s h", value: "s e"):
        out = moa.dot(attention_probs(query, key, scale=0.5, is_causal=False), value)
        it = moa.iota(query.shape[0], "t")
        a = moa.omega(lambda row, keep: moa.where(keep, row, 0.0), (1, 0))(out, moa.lt(it, 5))
        b = moa.omega(lambda row, keep: moa.where(keep, row, 0.0), (1, 0))(out, moa.le(it, 4))
        return a + b

    preset = Preset.of(tiles={"t": 4, "s": 8})
    onf = schedule.derive(two_ways.dnf(), machines.local(), preset)
    online = next(s for s in onf.program.stages if isinstance(s, OnlineStage))
    assert [c.text() for c in masked.dead_rows(onf, online)] == ["−t + 4 ≥ 0"]
    sk = onf.skip_of(online.name)
    assert [c.text() for c, dead in zip(sk.rows, sk.rows_dead) if dead] == ["−t + 4 ≥ 0"]
    r = np.random.default_rng(2)
    q, k, v = (r.standard_normal(s) for s in ((64, 4), (64, 4), (64, 4)))
    got = two_ways(q, k, v, implementation="xla", onf=preset)
    full = two_ways(q, k, v, implementation="xla", onf=Preset.of(tiles={"t": 4, "s": 8}, skip=False))
    assert np.array_equal(np.asarray(got), np.asarray(full)) and np.all(np.asarray(got)[5:] == 0)


def test_a_running_max_guard_exempts_only_dead_rows():
    """An online pass's own-max guard (``RowGuard``) exempts its dead rows from the walk of
    every tile; an exempt row that is not a dead row of the skip fails validation (its
    partial carry would be read)."""
    _, _, d = _dnf(T=256, S=256, K=4, qlen=True, mask=True, is_causal=True)
    onf = schedule.derive(d, machines.load("h200"))
    (sk,) = [x for x in onf.skips if isinstance(x.guard, RowGuard) and x.guard.exempt]
    with pytest.raises(ONFError, match="not its dead rows"):
        onf.replace(skips=(dataclasses.replace(sk, rows=(), rows_kept=(), rows_dead=()),)).validate()


DEAD_ROWS = {
    "query lengths": dict(query_seq_lengths=np.array([3, 9], np.int32)),
    "query lengths, one empty": dict(query_seq_lengths=np.array([0, 6], np.int32)),
    "causal, query lengths": dict(is_causal=True, query_seq_lengths=np.array([3, 8], np.int32)),
    "window, both lengths": dict(local_window_size=(3, 0), query_seq_lengths=np.array([6, 2], np.int32),
                                 key_value_seq_lengths=np.array([7, 11], np.int32)),
    "causal, query lengths, a mask dropping the rows past them": dict(
        is_causal=True, mask=_MASKS["past"], query_seq_lengths=np.array([6, 9], np.int32)),
}


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
@pytest.mark.parametrize("case", list(DEAD_ROWS))
def test_a_forward_leaving_out_dead_rows_changes_no_bit(case, impl):
    """The forward alone (no statistics saved: inference, and the forward of residuals "recompute")
    leaves out the programs past a query length (tiles of 2 rows: several lie past each length
    here): its output, and the gradient under residuals "recompute", bitwise those of every tile
    walked (the interior tiles masked in both: ``test_skipping_changes_no_bit…``) and within float64's 1e-12 of the reference, finite (the dead rows' 0 ÷ 0 never
    leaves the select that drops it)."""
    kw = dict(DEAD_ROWS[case])
    q, k, v, g = _qkv()
    runs = []
    for skip in (None, False):
        onf = Preset.of(tiles=TILES, skip=skip, unmask_interior=False, residuals="recompute")

        def f(q, k, v, onf=onf):
            return moajax.dot_product_attention(q, k, v, implementation=impl, onf=onf, **kw)

        out = f(q, k, v)
        runs.append([out, *jax.vjp(f, q, k, v)[1](g)])
    ref = [R.mha_variants(q, k, v, **kw)] + list(R.mha_variants(q, k, v, dout=g, **kw)[:3])
    for a, b, want in zip(*runs, ref):
        assert np.array_equal(np.asarray(a), np.asarray(b))
        assert np.all(np.isfinite(a))
        assert float(np.max(np.abs(np.asarray(a) - want))) <= 1e-12 * max(float(np.max(np.abs(want))), 1.0)


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
@pytest.mark.parametrize("case", list(DEAD_ROWS))
def test_a_saving_forward_leaving_out_dead_rows_changes_no_gradient_bit(case, impl):
    """The saving forward (what ``jax.grad`` runs under residuals "save") writes its row
    statistics as (t < L) ? z : z̄, z̄ their closed form past the length (the fill, and S:
    ``identities.guard_statistics``), so it too leaves out the programs past a query length
    (``test_a_saving_forward_saves_its_statistics_guarded``): the gradients are bitwise those
    of every tile walked, finite and within float64's 1e-12 of the reference; a second
    derivative too, within 1e-12 of jax's own of the softmax written in jnp (``helpers.jnp_attention``;
    until 2026-12-07 of moajax's under residuals "recompute", whose second-order kernels took a
    third of the test's time)."""
    kw = dict(DEAD_ROWS[case])
    q, k, v, g = _qkv()

    def second(f):  # Σ (∂/∂k ⟨f, g⟩)²: the saving forward's own derivatives run
        return jax.grad(lambda q, k, v: jnp.sum(jax.vjp(f, q, k, v)[1](g)[1] ** 2), argnums=(0, 1, 2))

    runs = []
    for skip in (None, False):
        onf = Preset.of(tiles=TILES, skip=skip, unmask_interior=False, residuals="save")

        def f(q, k, v, onf=onf):
            return moajax.dot_product_attention(q, k, v, implementation=impl, onf=onf, **kw)

        runs.append([*jax.vjp(f, q, k, v)[1](g), second(f)(q, k, v)])
    ref = list(R.mha_variants(q, k, v, dout=g, **kw)[:3])
    for a, b, want in zip(runs[0][:3], runs[1][:3], ref):
        assert np.array_equal(np.asarray(a), np.asarray(b))
        assert np.all(np.isfinite(a))
        assert float(np.max(np.abs(np.asarray(a) - want))) <= 1e-12 * max(float(np.max(np.abs(want))), 1.0)
    keep, rows = R.variant_keep(B, N, T, S, **{n: x for n, x in kw.items() if n != "is_causal"})
    keep = np.ones((B, N, T, S), bool) if keep is None else keep
    if kw.get("is_causal"):
        keep = keep & np.tril(np.ones((T, S), bool))
    plain = lambda q, k, v: jnp_attention(q, k, v, 0.0, keep, rows)  # noqa: E731
    for a, b, want in zip(runs[0][3], runs[1][3], second(plain)(q, k, v)):
        assert np.array_equal(np.asarray(a), np.asarray(b)) and np.all(np.isfinite(a))
        assert float(np.max(np.abs(np.asarray(a) - want))) <= 1e-12 * max(float(np.max(np.abs(want))), 1.0)


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_a_saving_forward_saves_its_statistics_guarded(impl):
    """The kernel ``jax.grad`` saves with: each row statistic is (t < L) ? z : z̄ in its DNF, z̄
    the closed form past the length (``identities.statistic_guards``: the max is the fill and
    the sum S, whatever the keys), its ONF leaves out the rows past the length (``Skip.dead``),
    and what it saves is what the statistics as derived give: exactly past the length (no
    walk there), to float64's 1e-12 within it."""
    from moajax import reference

    q, k, v, _ = _qkv()
    lengths = np.array([0, 6], np.int32)
    kern = mha_kernel(None, None, True, True, False)
    saving = kern.saving_forward(q, k, v, lengths, is_causal=True)
    guarded = [o for o in saving.dnf(q, k, v, lengths, is_causal=True).outputs if D.is_saved_statistic(o.name)]
    assert len(guarded) == 2 and all(D.show(o.body).startswith("((t < ⟨b⟩ψquery_seq_lengths) ? ") for o in guarded)
    assert "guarded-statistic" in str(saving.derivation(q, k, v, lengths, is_causal=True))
    onf = saving.onf(q, k, v, lengths, onf=Preset.of(tiles=TILES), implementation=impl, is_causal=True)
    assert [[c.text() for c in sk.dead] for sk in onf.skips if sk.dead] == [["−t + ⟨b⟩ψquery_seq_lengths − 1 ≥ 0"]]
    got = saving.compiled(q, k, v, lengths, onf=Preset.of(tiles=TILES), implementation=impl,
                          is_causal=True)(q, k, v, lengths)[1:]
    want = reference.to_jax(saving.dnf_before_identities(q, k, v, lengths, is_causal=True))(q, k, v, lengths)
    past = np.arange(T)[None, :] >= lengths[:, None]  # [b t]
    for z, w in zip(got, want):
        z, w = np.asarray(z).reshape(B, T, N), np.asarray(w).reshape(B, T, N)
        assert np.array_equal(z[past], w[past]) and np.allclose(z[~past], w[~past], rtol=1e-12, atol=0)


def test_a_statistic_past_a_length_keeps_its_value_whatever_the_scores_there():
    """A kernel whose scores past a row's length are not the fill but 0 + 1000 (softmax does
    not see the shift): its statistics there are the max 1000 and the sum S, which P =
    exp(1000 − 1000) ÷ S reads finite in dV's P × (t < L ? dO : 0) — the closed form, not a
    stand-in (a review found 1 there: P = exp(999) = ∞ in float64, and ∞ × 0 = NaN; in float32
    from an offset of 100). The gradients under "save"
    are those of "recompute" to float64's 1e-12, finite, and the saving forward leaves out the
    rows past the length."""
    from moajax import moa
    from moajax.kernel import kernel

    @kernel(example=dict(b=2, t=4, s=5, e=3), register=False)
    def offset_attention(x: "b t s", v: "b s e", lengths: "b"):
        def cell(x, v, n):
            rows = moa.lt(moa.iota(x.shape[0], x.dims[0]), n)
            score = moa.omega(lambda row, c: moa.where(c, row, 0.0), (1, 0))(x, rows) + 1000.0
            out = moa.softmax(score, axis=-1) @ v
            return moa.omega(lambda row, c: moa.where(c, row, 0.0), (1, 0))(out, rows)
        return moa.omega(cell, (2, 2, 0))(x, v, lengths)

    r = np.random.default_rng(0)
    x, v, g = (r.standard_normal(s) for s in ((2, 8, 6), (2, 6, 3), (2, 8, 3)))
    lengths = np.array([3, 8], np.int32)
    tiles = Preset.of(tiles={"t": 2, "s": 2})
    onf = offset_attention.saving_forward(x, v, lengths).onf(x, v, lengths, onf=tiles, implementation="xla")
    assert any(sk.dead for sk in onf.skips)
    for impl in ("xla", "pallas_interpret"):
        grads = {}
        for residuals in ("save", "recompute"):
            def loss(x, v, residuals=residuals):
                return jnp.sum(offset_attention(x, v, lengths, residuals=residuals, implementation=impl,
                                                onf=tiles) * g)
            grads[residuals] = jax.grad(loss, argnums=(0, 1))(x, v)
        for a, want in zip(grads["save"], grads["recompute"]):
            assert np.all(np.isfinite(a))
            assert float(np.max(np.abs(np.asarray(a) - want))) <= 1e-12 * max(float(np.max(np.abs(want))), 1.0)


def test_a_skip_leaving_out_rows_the_program_reads_is_refused():
    """``Skip.rows_dead`` is a fact of the program around the stage: the saving forward's
    statistics as derived, unguarded (``identities.guard_statistics``), are outputs read at
    every row, so the plain forward's skip moved onto it fails validation rather than leave
    its rows past the length unwalked."""
    Tn = Sn = 256
    kern, specs, d = _dnf(T=Tn, S=Sn, K=4, qlen=True)
    h200 = machines.load("h200")
    onf = schedule.derive(d, h200)
    saving = schedule.derive(kern.saving_forward(*specs).dnf_before_identities(*specs), h200)
    (sk,) = [x for x in onf.skips if any(x.rows_dead)]
    online = next(s for s in saving.program.stages if isinstance(s, OnlineStage))
    moved = dataclasses.replace(sk, stage=online.name, of=online.logit)
    with pytest.raises(ONFError, match="which the program reads"):
        saving.replace(skips=(moved,)).validate()
    with pytest.raises(ONFError, match="dead rows amiss"):
        onf.replace(skips=(dataclasses.replace(sk, rows_dead=(True, True)),)).validate()


def test_dkv_programs_past_a_key_length_walk_no_tile_where_every_query_keeps_a_key():
    """dK and dV over key tiles past a key length: dK's Σ_t dS × Q is a plain 0 there, dV's
    Σ_t P × dO is 0 only in rows that keep a key (P = exp(m₀ − lse)): a kept row condition
    (``Skip.rows_kept``), used where the guard holds — every query keeps some key (a key
    length of 0 fails it: jax.nn's average over V gives every key a share of dV)."""

    Tn = Sn = 256
    kern, specs, _ = _dnf(T=Tn, S=Sn, K=4, kvlen=True)
    adj, aspecs = kern.saved_adjoint(*specs)
    (dkv,) = [o for o in schedule.derive_plan(adj.dnf(*aspecs), machines.load("h200"))
              if o.dnf.outputs[0].name == "d_key"]
    skips = [sk for sk in dkv.skips if sk.var.name == "t"]
    assert sorted(sk.rows_kept for sk in skips) == [(False,), (True,)]
    assert all([c.text() for c in sk.rows] == ["−s + ⟨b⟩ψkey_value_seq_lengths − 1 ≥ 0"] for sk in skips)
    s_axis = dkv.axis_of(next(v for c in skips[0].rows for v, _ in c.terms if isinstance(v, type(skips[0].var))))
    assert s_axis.ntiles > 1
    tile, ntiles = dkv.axis_of(skips[0].var).tile, dkv.axis_of(skips[0].var).ntiles
    for length in (0, s_axis.tile, s_axis.tile + 1, Sn):
        read = lambda r: np.array(length)  # noqa: E731, B023
        for j in range(s_axis.ntiles):
            spans = []
            for sk in skips:  # the program's key tile j; the walked queries whole
                conds = sk.bounds + sk.rows + ((sk.guard.conds + sk.guard.exempt) if sk.guard is not None else ())
                box = {v: ((j * s_axis.tile, (j + 1) * s_axis.tile - 1) if v.name == "s" else (0, v.extent - 1))
                       for c in conds for v, _ in c.terms if isinstance(v, type(sk.var))}
                ok = masked.guard_holds(sk.guard, box, read, np) if any(sk.rows_kept) else True
                spans.append(int(masked.tile_span(sk, tile, ntiles, box, read, np, ok)[1]))
            past = j * s_axis.tile >= length
            assert spans == [0 if past and (length > 0 or not k) else ntiles
                             for k in (any(sk.rows_kept) for sk in skips)]


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_a_static_row_condition_beside_a_static_bound(impl):
    """A score_mod masking i ≥ 5 and j ≥ 7 with −∞: dQ's walk over s gets the bound s ≤ 6 and
    the row condition t ≤ 4, over other variables. The cost model's share of masked tiles
    built its box from the bounds' variables alone and raised KeyError on t (found by review,
    2026-12-06); the gradients are those of no skip, bit for bit."""
    q, k, v, g = _qkv()

    def mod(s, b, h, i, j):
        return jax.numpy.where((i < 5) & (j < 7), s, -jax.numpy.inf)

    def run(skip):
        def f(q, k, v):
            return moajax.dot_product_attention(q, k, v, score_mod=mod, implementation=impl,
                                                onf=Preset.of(tiles=TILES, skip=skip))
        out, vjp = jax.vjp(f, q, k, v)
        return [np.asarray(x) for x in [out, *vjp(g)]]

    for a, b in zip(run(None), run(False)):
        assert np.array_equal(a, b) and np.all(np.isfinite(a))


def test_a_cpu_loops_the_batch_a_length_bound_reads():
    """On a CPU the grid is vectorised but for the ``cpu_loop`` axes: a walk bounded by
    ⟨b⟩ψlengths then spans the batch's longest length. The batch axis joins the loop where a
    skip's bound reads a length at it and the walk has tiles to leave out; not without lengths,
    not where the walk is one tile, not in a kernel that scatter-adds (the adjoint's dQ over
    its key-tile programs: slower looped), not against a preset's own ``cpu_loop``."""
    cpu = machines.load("anvil-epyc-7543")
    _, _, d = _dnf(T=1024, S=1024, kvlen=True)
    assert "b" in schedule.derive(d, cpu).knobs.cpu_loop
    seen = set()
    for K in (4, 2):  # the fused adjoint (dQ scatter-added), GQA's owner plan (nothing scattered)
        kern, specs, _ = _dnf(T=1024, S=1024, K=K, kvlen=True)
        adj, args = kern.saved_adjoint(*specs)
        plan = schedule.derive_plan(adj.dnf(*args), cpu)
        for onf in plan if isinstance(plan, tuple) else (plan,):
            scatters = any(onf.scatter_var(st) is not None for st in onf.program.stages)
            if any(sk.bounds for sk in onf.skips):  # (a row condition alone loops nothing)
                seen.add(scatters)
                assert ("b" in onf.knobs.cpu_loop) == (not scatters)
    assert seen == {True, False}
    assert "b" not in schedule.derive(_dnf(T=1024, S=1024)[2], cpu).knobs.cpu_loop
    assert "b" not in schedule.derive(_dnf(kvlen=True)[2], cpu).knobs.cpu_loop  # S = 64: one tile of s
    assert schedule.derive(d, cpu, Preset.of(cpu_loop=("t",))).knobs.cpu_loop == ("t",)


# ----------------------------------------------------------------------------- spans


def _brute_span(keep, rows, tile, n):
    """The tiles holding a kept (row, key) for some row of ``rows``: enumeration."""
    need = [j for j in range(n) if any(keep(t, s) for t in rows for s in range(j * tile, (j + 1) * tile))]
    return (need[0], need[-1] - need[0] + 1) if need else None


@pytest.mark.parametrize("window,causal,length", [((3, 0), True, None), ((2, 5), False, 13), (None, True, 7),
                                                  ((0, 0), False, None)])
def test_tile_spans_cover_exactly_the_kept_tiles(window, causal, length):
    Tn = Sn = 24
    kern, specs, d = _dnf(T=Tn, S=Sn, kvlen=length is not None, is_causal=causal, local_window_size=window)
    onf = schedule.derive(d, machines.load("h200"), Preset.of(tiles={"t": 4, "s": 4}))
    online = next(s for s in onf.program.stages if isinstance(s, OnlineStage))
    sk = onf.skip_of(online.name)

    def keep(t, s):
        ok = (not causal or s <= t) and (length is None or s < length)
        return ok and (window is None or t - window[0] <= s <= t + window[1])

    read = lambda r: np.array(length)  # noqa: E731 - the length of this batch element
    for i in range(Tn // 4):
        box = {v: ((i * 4, i * 4 + 3) if v.name == "t" else (0, v.extent - 1))
               for b in sk.bounds + sk.guard.conds for v, _ in b.terms if not hasattr(v, "array")}
        ok = masked.guard_holds(sk.guard, box, read, np)
        first, count = masked.tile_span(sk, 4, Sn // 4, box, read, np, ok)
        want = _brute_span(keep, range(i * 4, i * 4 + 4), 4, Sn // 4)
        every_row_keeps = all(any(keep(t, s) for s in range(Sn)) for t in range(i * 4, i * 4 + 4))
        assert bool(ok) == every_row_keeps
        if every_row_keeps:
            assert (int(first), int(count)) == want
        else:  # a row keeping no key: walk every tile (jax.nn averages V over all keys)
            assert (int(first), int(count)) == (0, Sn // 4)


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
@pytest.mark.parametrize("case", ["causal", "causal, kv lengths, one empty", "rows past every key"])
def test_a_walk_split_over_the_statistics_rows_still_skips(case, impl):
    # split-K of dV = Σ_t P × dO (programs too few for the GPU: t = t_i + c·t_o, the parts
    # added after) reads the row statistics at that t, so t_o is a row of theirs. It was taken
    # for a key (as in the forward's split over the keys, whose parts the softmax monoid
    # joins): no guard was found and every masked tile was walked. Fully masked rows (an empty
    # length; rows past every key) still need the guard: there P is uniform, not 0
    kw = dict(CASES[case])
    shape = dict(T=kw.pop("T", 16), S=kw.pop("S", 16))  # whole 16-row blocks for Pallas' dots
    q, k, v, g = _qkv(**shape)
    lengths = [kw.pop("key_value_seq_lengths")] if "key_value_seq_lengths" in kw else []
    kern = mha_kernel(None, None, True, False, bool(lengths))
    out, m, l = kern.with_row_statistics()(q, k, v, *lengths, implementation="xla", **kw)
    specs = [SDS(np.shape(x), np.asarray(x).dtype) for x in (q, k, v, *lengths)]
    adj, aspecs = kern.saved_adjoint(*specs, **kw)
    dnf = adj.dnf(*aspecs, **kw)
    (dv_dnf,) = [d for d in schedule.split_outputs(dnf) if d.outputs[0].name == "d_value"]
    machine = machines.load("delta-a100") if impl == "pallas_interpret" else machines.local()
    arrays = [q, k, v, *lengths, g, np.asarray(m), np.asarray(l), np.asarray(out)]
    got = {}
    for skip in (None, False):
        onf = schedule.derive(dv_dnf, machine, Preset.of(tiles={"t": 4, "s": 4}, split={"t": 2}, skip=skip))
        assert any(a.name == "t_o" for a in onf.axes)
        if skip is None:
            (sk,) = onf.skips
            assert sk.var.name == "t_i" and any(sk.kept) and sk.guard is not None
            assert masked.visited_fraction(onf, sk) < 1
        got[skip] = np.asarray(runtime.lowered(onf, "pallas_interpret" if impl == "pallas_interpret" else "xla")(*arrays))
    assert np.array_equal(got[None], got[False])
    want = R.mha_variants(q, k, v, dout=g, **kw, **({"key_value_seq_lengths": lengths[0]} if lengths else {}))[2]
    assert float(np.max(np.abs(got[None] - want))) <= 1e-12 * max(float(np.max(np.abs(want))), 1.0)


def test_split_k_refuses_an_axis_another_stage_runs_over():
    # the (dQ, dK) kernel of this plan has t as its rows: splitting t (a preset's split applies
    # to every kernel of a plan) left dQ's stages (Δ = Σ_e dO·O first) with no axis for t, so
    # t was taken whole in every part's program: each computed all of dQ (wasted work), and at
    # uneven sizes the Pallas lowering read past the padded inputs (a crash deep in JAX)
    kern, specs, _ = _dnf(is_causal=True)
    adj, aspecs = kern.saved_adjoint(*specs, is_causal=True)
    dnf = adj.dnf(*aspecs, is_causal=True)
    with pytest.raises(ONFError, match="split_k of 't': stage 'sum_e_' is indexed by 't', a grid axis"):
        schedule.derive_plan(dnf, machines.load("delta-a100"),
                             Preset.of(plan=(("d_query", "d_key"), ("d_value",)), split={"t": 2}))


def test_the_cost_model_counts_the_skipped_tiles():
    h200 = machines.load("h200")
    full = schedule.derive(_dnf(B=1, T=8192, S=8192, N=8, K=8, H=64)[2], h200)
    causal = schedule.derive(_dnf(B=1, T=8192, S=8192, N=8, K=8, H=64, is_causal=True)[2], h200)
    sk = causal.skips[0]
    # brute force: program i (rows i·bt … i·bt + bt − 1) walks key tiles 0 … ⌊(i·bt + bt − 1)/bs⌋
    bt, bs = causal.axis("t").tile, causal.axis("s").tile
    n = 8192 // bs
    share = np.mean([((i * bt + bt - 1) // bs + 1) / n for i in range(8192 // bt)])
    assert masked.visited_fraction(causal, sk) == pytest.approx(share, abs=1e-12)
    ratio = cost.estimate(causal, h200).flops / cost.estimate(full, h200).flops
    assert 0.49 < ratio < 0.52


def test_an_empty_span_visits_no_tile():
    # s ≤ t − 100 with rows t < 64: no key of any row — zero tiles (a part wholly past a
    # length); the upper bound is negative before it is clipped
    from moajax.ix import Var
    from moajax.onf import Affine, Skip

    s, t = Var("s", 256), Var("t", 64)
    sk = Skip("x", s, (Affine(((s, -1), (t, 1)), -100),), (False,), None, None)
    first, count = masked.tile_span(sk, 32, 8, {t: (0, 63)}, None, np)
    assert int(count) == 0
    first, count = masked.tile_span(sk, 32, 8, {t: (0, 163 - 1)}, None, np)  # rows up to 161
    assert (int(first), int(count)) == (0, 2)  # s ≤ 61: tiles 0 and 1


# ----------------------------------------------------------------------------- interior tiles


@pytest.mark.parametrize("window,causal,length", [((3, 0), True, None), ((2, 5), False, 13), (None, True, 7),
                                                  ((0, 0), False, None), ((9, 9), False, None)])
def test_interior_tiles_are_exactly_those_every_point_keeps(window, causal, length):
    # Skip.interior: a tile of keys is walked unmasked iff every (row, key) of the program's
    # rows and the tile — its padding past the extent included — keeps the key (enumerated)
    Tn, Sn, tile = 24, 22, 4  # S not a multiple of the tile: the last key tile is padded
    kern, specs, d = _dnf(T=Tn, S=Sn, kvlen=length is not None, is_causal=causal, local_window_size=window)
    onf = schedule.derive(d, machines.load("h200"),
                          Preset.of(tiles={"t": tile, "s": tile}, unmask_interior=True))
    sk = onf.skip_of(next(s for s in onf.program.stages if isinstance(s, OnlineStage)).name)
    assert sk.interior and "interior tiles unmasked" in sk.text()
    s_var = sk.var

    def keep(t, s):  # the bounds alone (a key past S is kept by them: ``valid`` masks it)
        ok = (not causal or s <= t) and (length is None or s < length)
        return ok and (window is None or t - window[0] <= s <= t + window[1])

    read = lambda r: np.array(length)  # noqa: E731
    ntiles = -(-Sn // tile)
    for i in range(Tn // tile):
        rows = range(i * tile, i * tile + tile)
        box = {v: ((rows[0], rows[-1]) if v.name == "t" else (0, v.extent - 1))
               for b in sk.bounds for v, _ in b.terms if not hasattr(v, "array")}
        first, end = masked.interior_tiles(sk.bounds, s_var, tile, box, read, np)
        want = [j for j in range(ntiles) if all(keep(t, s) for t in rows for s in range(j * tile, (j + 1) * tile))]
        got = list(range(int(first), int(end)))
        assert got == want or (not want and not got), (i, got, want)


def _while_bodies(jaxpr):
    """The bodies of the walks: while loops (traced bounds) and scans (bounds the span folds to
    constants, as on XLA, whose vectorised grid reads no program id: ``tiles.skipping``)."""
    from helpers import sub_jaxprs

    for e in jaxpr.eqns:
        if e.primitive.name == "while":
            yield e.params["body_jaxpr"].jaxpr
        elif e.primitive.name == "scan":
            yield e.params["jaxpr"].jaxpr
        for j in sub_jaxprs(list(e.params.values())):
            yield from _while_bodies(j)


def _prims(jaxpr) -> set:
    from helpers import walk_eqns

    return {e.primitive.name for e, _ in walk_eqns(jaxpr)}


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_the_interior_tiles_of_a_causal_walk_evaluate_no_mask(impl):
    # every walk of jax.grad of causal attention (forward, dK/dV, dQ) runs its interior tiles
    # in a loop that builds no mask; with unmask_interior=False every loop that computes
    # probabilities masks them on each tile — the count of mask-free loops can fail
    q = jax.ShapeDtypeStruct((1, 64, 2, 8), np.float32)

    def loops(on):
        onf = Preset.of(tiles={"t": 8, "s": 8}, unmask_interior=on)
        f = lambda q, k, v: moajax.dot_product_attention(q, k, v, is_causal=True, implementation=impl,  # noqa: E731
                                                         onf=onf).sum()
        jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(q, q, q).jaxpr
        # a walk over key or query tiles computes the probabilities (exp); its mask is built
        # from the tile's index values (iota) and compared (t ≥ s: ge) — the loop bounds
        # themselves are compared with lt
        bodies = [b for b in _while_bodies(jaxpr) if "exp" in _prims(b)]
        return [not (_prims(b) & {"iota", "le", "gt", "ge"}) for b in bodies]

    on, off = loops(True), loops(False)
    assert off and not any(off)
    assert sum(on) >= 3  # the forward's online pass, and both walks of the owner backward


def test_the_cost_model_counts_the_mask_on_the_boundary_tiles_only():
    h200 = machines.load("h200")
    d = _dnf(B=1, T=8192, S=8192, N=8, K=8, H=64, is_causal=True)[2]
    on = schedule.derive(d, h200, Preset.of(unmask_interior=True))
    off = schedule.derive(d, h200)  # a GPU's default: the mask on every visited tile
    assert not any(sk.interior for sk in off.skips)
    sk = on.skips[0]
    bt, bs = on.axis("t").tile, on.axis("s").tile
    n = 8192 // bs
    # brute force: program i's key tiles j·bs … j·bs + bs − 1 are masked unless j·bs + bs − 1 ≤ i·bt
    boundary = np.mean([sum(1 for j in range((i * bt + bt - 1) // bs + 1) if j * bs + bs - 1 > i * bt) / n
                        for i in range(8192 // bt)])
    assert masked.masked_fraction(on, sk) == pytest.approx(boundary, abs=1e-12)
    assert masked.masked_fraction(off, off.skips[0]) == masked.visited_fraction(off, off.skips[0])
    a, b = cost.estimate(on, h200), cost.estimate(off, h200)
    assert a.matmul_flops == b.matmul_flops and a.transcendentals == b.transcendentals
    assert a.flops < b.flops


def test_the_interior_split_is_a_cpus_default_not_a_gpus():
    d = _dnf(is_causal=True)[2]
    assert all(sk.interior for sk in schedule.derive(d, machines.load("anvil-epyc-7543")).skips)
    assert not any(sk.interior for sk in schedule.derive(d, machines.load("h200")).skips)


def test_unmask_interior_must_be_a_bool():
    with pytest.raises(TypeError, match="unmask_interior"):
        Preset.of(unmask_interior="yes")


def _walked_by_brute_force(T, S, bt, bs, ql, kl, causal):
    """The share of (program, key tile) pairs the forward's programs (a batch element and a
    tile of bt query rows each) walk, counted row by row: none where every row lies past its
    query length; every tile where a row inside it keeps no key (jax.nn's fully masked row:
    the guard fails); else the tiles up to the last key any of its rows keeps."""
    n = -(-S // bs)
    counts = []
    for b in range(len(ql)):
        for i in range(-(-T // bt)):
            rows = range(i * bt, min(i * bt + bt, T))
            live = [r for r in rows if r < ql[b]]
            if not live:
                counts.append(0)
                continue
            last = {r: min(kl[b] - 1, r) if causal else kl[b] - 1 for r in rows}
            if any(last[r] < 0 for r in live):
                counts.append(n)
                continue
            counts.append(max(last.values()) // bs + 1)
    return float(np.mean(counts)) / n


@pytest.mark.parametrize("causal", [False, True])
def test_the_cost_model_counts_the_tiles_given_lengths_leave_out(causal):
    # the runtime lengths as a call passes them: rows past a query length walk nothing, keys
    # past a key length are skipped, a row with no key walks everything (B = 4: a full
    # sequence, half of one, 3 query rows, no keys)
    T = S = 1024
    d = _dnf(B=4, T=T, S=S, N=2, K=2, H=64, qlen=True, kvlen=True, is_causal=causal)[2]
    h200 = machines.load("h200")
    onf = schedule.derive(d, h200)
    sk = next(sk for sk in onf.skips if sk.var.name == "s")
    ql, kl = np.array([T, T // 2, 3, T], np.int32), np.array([S, S // 2 + 5, S, 0], np.int32)
    values = {"query_seq_lengths": ql, "key_value_seq_lengths": kl}
    want = _walked_by_brute_force(T, S, onf.axis("t").tile, onf.axis("s").tile, ql, kl, causal)
    assert want < (0.6 if causal else 0.8)
    assert masked.visited_fraction(onf, sk, values=values) == pytest.approx(want, abs=1e-12)
    # without the values a length keeps every tile, as before (a causal bound still counts)
    assert masked.visited_fraction(onf, sk) == pytest.approx(
        _walked_by_brute_force(T, S, onf.axis("t").tile, onf.axis("s").tile, [T] * 4, [S] * 4, causal), abs=1e-12)
    given, unknown = cost.estimate(onf, h200, values=values), cost.estimate(onf, h200)
    assert given.matmul_flops == pytest.approx(unknown.matmul_flops * want / masked.visited_fraction(onf, sk), rel=1e-12)
    assert given.time_s < unknown.time_s


def test_the_cost_model_counts_a_vectorised_batch_as_its_longest_sequence():
    # XLA runs the programs of a grid axis outside its cpu_loop as one, so their walk spans the
    # tiles of the batch's longest sequence (``lower_xla``): the CPU's adjoint, which scatter-
    # adds dQ, does not loop its batch; its forward does (``schedule._loop_runtime_bounds``)
    T = 1024
    kern, specs, d = _dnf(B=2, T=T, S=T, N=2, K=2, H=64, qlen=True, kvlen=True)
    cpu = machines.load("anvil-epyc-7543")
    halves = {"query_seq_lengths": np.array([T, T // 2], np.int32), "key_value_seq_lengths": np.array([T, T // 2], np.int32)}
    full = {k: np.array([T, T], np.int32) for k in halves}
    fwd = schedule.derive(d, cpu)
    assert "b" in fwd.knobs.cpu_loop
    assert cost.estimate(fwd, cpu, values=halves).matmul_flops < 0.8 * cost.estimate(fwd, cpu, values=full).matmul_flops
    adj, aspecs = kern.saved_adjoint(*specs)
    onf = schedule.derive_plan(adj.dnf(*aspecs), cpu)
    assert isinstance(onf, moajax.ONF), "the CPU's fused adjoint (one kernel)"
    assert any(onf.scatter_var(st) is not None for st in onf.program.stages) and "b" not in onf.knobs.cpu_loop
    assert any(isinstance(t, D.Read) for sk in onf.skips for b in sk.bounds + sk.rows for t, _ in b.terms)
    a, b = cost.estimate(onf, cpu, values=halves), cost.estimate(onf, cpu, values=full)
    # the same tiles walked; their masks evaluated on more of them (the interior, where every
    # bound holds for every row at once, ends at the shorter sequence's length)
    assert a.matmul_flops == b.matmul_flops and a.transcendentals == b.transcendentals and a.flops > b.flops
    # on a GPU each program owns its batch element: the same lengths leave out tiles
    h200 = machines.load("h200")
    plan = schedule.derive_plan(adj.dnf(*aspecs), h200)
    assert (cost.sequence(cost.estimate(o, h200, values=halves) for o in plan).matmul_flops
            < 0.8 * cost.sequence(cost.estimate(o, h200, values=full) for o in plan).matmul_flops)


def test_the_cost_models_values_are_checked():
    d = _dnf(T=512, S=512, qlen=True)[2]
    onf = schedule.derive(d, machines.load("h200"))
    assert onf.axis("s").ntiles > 1
    with pytest.raises(ValueError, match="'q_lengths', which is not an input of the DNF"):
        cost.estimate(onf, values={"q_lengths": np.array([1, 2], np.int32)})
    with pytest.raises(ValueError, match=r"values\['query_seq_lengths'\] has shape \(3,\)"):
        cost.estimate(onf, values={"query_seq_lengths": np.array([1, 2, 3], np.int32)})
    with pytest.raises(TypeError, match="must be integers"):
        cost.estimate(onf, values={"query_seq_lengths": np.array([1.0, 2.0])})
    with pytest.raises(TypeError, match="values must be a dict"):
        cost.estimate(onf, values=[1, 2])
    # any integer dtype (the bounds negate them: an unsigned one wrapped), and an unbatched
    # call's scalar length for a batch of one
    kv = schedule.derive(_dnf(T=512, S=512, kvlen=True)[2], machines.load("h200"))
    signed = cost.estimate(kv, values={"key_value_seq_lengths": np.array([512, 3], np.int32)})
    assert cost.estimate(kv, values={"key_value_seq_lengths": np.array([512, 3], np.uint32)}) == signed
    assert signed.flops < cost.estimate(kv).flops
    one = schedule.derive(_dnf(B=1, T=512, S=512, qlen=True)[2], machines.load("h200"))
    assert (cost.estimate(one, values={"query_seq_lengths": np.uint8(3)})
            == cost.estimate(one, values={"query_seq_lengths": np.array([3], np.int64)}))


def _recorded_walks(monkeypatch):
    """Wrap ``skipping.walk``: each walk a lowered program runs reports (walked variable, the
    stages of its skips, tiles walked, interior tiles among them) when it runs."""
    from moajax.tiles import skipping

    rec, walk = [], skipping.walk

    def recording(ev, skips, v, step, init):
        first, count = skipping.span(ev, skips, v)
        stages = tuple(sk.stage for sk in skips or () if sk is not None)
        inner = [sk for sk in skips or () if sk is not None and sk.interior]
        if inner and ev.onf.axis_of(v).ntiles > 1:
            bounds = [b for sk in inner for b in sk.bounds]
            box = skipping._box(ev, {t for b in bounds for t, _ in b.terms if isinstance(t, skipping.Var)}, v,
                                padded=True)
            ifirst, iend = masked.interior_tiles(bounds, v, ev.onf.axis_of(v).tile, box, skipping._read(ev),
                                                 skipping._fold)
            lo = jnp.clip(ifirst, first, first + count)
            inside = jnp.clip(iend, lo, first + count) - lo
        else:
            inside = jnp.zeros((), jnp.int32)
        jax.debug.callback(lambda c, i: rec.append((v.name, stages, int(c), int(i))), count, inside)
        return walk(ev, skips, v, step, init)

    monkeypatch.setattr(skipping, "walk", recording)
    return rec


@pytest.mark.parametrize("causal", [False, True])
def test_the_cost_model_counts_what_the_xla_lowering_walks(causal, monkeypatch):
    # the tiles each walk of the lowered XLA program visits (and evaluates the mask on),
    # recorded as it runs, against the model's share for the stage (``cost._walk_skip``,
    # ``cost._stage_walks``): the forward with its batch looped, with its rows looped and the
    # batch vectorised, and the fused adjoint with its key tiles looped and not (then its dQ
    # partials walk the key tiles of each query tile, skipping the masked ones)
    from moajax import lower_xla

    rec = _recorded_walks(monkeypatch)
    T = 512
    values = {"query_seq_lengths": np.array([T, 100], np.int32), "key_value_seq_lengths": np.array([T, 300], np.int32)}
    kern, specs, d = _dnf(B=2, T=T, S=T, N=1, K=1, H=16, qlen=True, kvlen=True, is_causal=causal)
    adj, aspecs = kern.saved_adjoint(*specs, is_causal=causal)
    ad = adj.dnf(*aspecs, is_causal=causal)
    cpu = machines.load("anvil-epyc-7543")
    tiles = {"t": 128, "s": 128}
    onfs = [schedule.derive(d, cpu, Preset.of(tiles=tiles)), schedule.derive(d, cpu, Preset.of(tiles=tiles, cpu_loop="t")),
            schedule.derive_plan(ad, cpu, Preset.of(tiles=tiles, plan="fused", cpu_loop="s")),
            schedule.derive_plan(ad, cpu, Preset.of(tiles=tiles, plan="fused"))]
    assert [o.knobs.cpu_loop for o in onfs] == [("b",), ("t",), ("s",), ()]
    r = np.random.default_rng(0)
    compared = 0
    for o in onfs:
        rec.clear()
        args = [values[i.name] if i.name in values else r.standard_normal(i.shape).astype(i.dtype) for i in o.dnf.inputs]
        jax.block_until_ready(lower_xla.lower(o)(*args))
        walks = cost._walks(o, {k: v for k, v in values.items() if k in {i.name for i in o.dnf.inputs}})
        groups: dict = {}
        for name, stages, count, inside in rec:
            groups.setdefault((name, stages), []).append((count, inside))
        for (name, stages), runs in groups.items():
            n = o.axis(name).ntiles
            walked = sum(c for c, _ in runs) / (len(runs) * n)
            evaluated = sum(c - i for c, i in runs) / (len(runs) * n)
            st = o.program.stage_of(stages[0])
            sk = cost._walk_skip(o, st)
            w = cost._stage_walks(o, st, walks)
            visited = masked.visited_fraction(o, sk, **w)
            assert visited == pytest.approx(walked, abs=1e-12), (o.knobs.cpu_loop, name, stages)
            model = visited * cost._unmasked(o, st, walks)[1]  # the share evaluating the mask
            if cost._masked_walk(o, st, walks) is None:
                assert model == pytest.approx(evaluated, abs=1e-12), (o.knobs.cpu_loop, name)
            else:  # (counted on every visited tile there: an upper bound)
                assert name == o.scatter_var(st).name and model == visited >= evaluated, (o.knobs.cpu_loop, name)
            compared += 1
    assert compared >= 4


def test_the_cost_model_counts_a_vectorised_tiles_padding_as_the_lowering_does(monkeypatch):
    # uneven tiles (1000 rows in tiles of 128, XLA running them as one program): the interior
    # test takes the last tile's padding rows in, t up to 1023, so a window reaching every key
    # from the real rows (right = 1000) still leaves the last key tiles masked for row 1023
    from moajax import lower_xla

    rec = _recorded_walks(monkeypatch)
    d = _dnf(B=1, T=1000, S=1000, N=1, K=1, H=16, local_window_size=(1000, 1000))[2]
    o = schedule.derive(d, machines.load("anvil-epyc-7543"), Preset.of(tiles={"t": 128, "s": 200}))
    assert o.knobs.cpu_loop == () and o.axis("t").role == "grid" and o.axis("t").ntiles > 1
    r = np.random.default_rng(0)
    jax.block_until_ready(lower_xla.lower(o)(*[r.standard_normal(i.shape).astype(i.dtype) for i in o.dnf.inputs]))
    ((name, _, count, inside),) = rec
    sk = o.skips[0]
    walks = cost._walks(o, None)
    n = o.axis(name).ntiles
    assert masked.visited_fraction(o, sk, **walks) == count / n
    assert 0 < (count - inside) / n == pytest.approx(masked.masked_fraction(o, sk, **walks), abs=1e-12)


def _tiles_walked_from_the_kept_keys(keep, ql, bt, bs):
    """The share of (program, key tile) pairs the forward's programs walk, from the keys each
    row keeps (``keep`` [B, T, S], jax.nn's masks without the query length): a program whose
    rows all lie past their query length walks none; one with a row inside its length that
    keeps no key walks every tile (jax.nn's average over V); else the tiles from the first key
    any of its rows keeps to the last."""
    B, T, S = keep.shape
    n = -(-S // bs)
    counts = []
    for b in range(B):
        for i in range(-(-T // bt)):
            rows = range(i * bt, min(i * bt + bt, T))
            if all(r >= ql[b] for r in rows):
                counts.append(0)
            elif any(not keep[b, r].any() for r in rows if r < ql[b]):
                counts.append(n)
            else:
                keys = np.flatnonzero(keep[b, rows[0]:rows[-1] + 1].any(axis=0))
                counts.append(keys[-1] // bs - keys[0] // bs + 1)
    return float(np.mean(counts)) / n


@settings(max_examples=100, deadline=None)
@given(T=st.integers(1, 300), S=st.integers(1, 300), B=st.integers(1, 3), bt=st.sampled_from([16, 32, 64]),
       bs=st.sampled_from([16, 32, 64]), causal=st.booleans(),
       window=st.sampled_from([None, (0, 0), (5, 0), (40, 7), (100, 100)]), seed=st.integers(0, 2**16))
def test_the_cost_models_count_with_random_lengths_is_the_kept_keys_span(T, S, B, bt, bs, causal, window, seed):
    # random sizes, tiles, lengths, windows and causality: the model's share of walked tiles,
    # given the lengths, against the span of the keys each program's rows keep (jax.nn's masks:
    # ``references.variant_keep``)
    r = np.random.default_rng(seed)
    ql, kl = r.integers(0, T + 1, B).astype(np.int32), r.integers(0, S + 1, B).astype(np.int32)
    d = _dnf(B=B, T=T, S=S, N=1, K=1, H=16, qlen=True, kvlen=True, is_causal=causal, local_window_size=window)[2]
    onf = schedule.derive(d, machines.load("h200"), Preset.of(tiles={"t": bt, "s": bs}))
    sk = next((sk for sk in onf.skips if sk.var.name == "s"), None)
    keys = next((a for a in onf.axes if a.name == "s"), None)
    if keys is None or keys.role != "sequential" or keys.ntiles == 1:
        # held whole (one tile), the keys are not walked: nothing to leave out
        assert sk is None or masked.visited_fraction(onf, sk, values={"query_seq_lengths": ql}) == 1.0
        return
    keep, _ = R.variant_keep(B, 1, T, S, local_window_size=window, key_value_seq_lengths=kl)
    keep = np.ones((B, T, S), bool) if keep is None else keep[:, 0]
    if causal:
        keep = keep & np.tril(np.ones((T, S), bool))
    values = {"query_seq_lengths": ql, "key_value_seq_lengths": kl}
    want = _tiles_walked_from_the_kept_keys(keep, ql, onf.axis("t").tile, onf.axis("s").tile)
    assert masked.visited_fraction(onf, sk, values=values) == pytest.approx(want, abs=1e-12)
