"""Both backends against the DNF reference, for every kind of ONF: passes and online,
γ C and F, several tile sizes, tails, stored rows, memory stages, split-K; and the Pallas
kernels (interpret mode) against the XLA path on the same ONF."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pallas_kernels
import references as R
from helpers import rel_err
from moajax import lower_xla, machines, schedule
from moajax import onf as O
from moajax import rewrites as W
from moajax.kernels import attention, block, decode, mha, rmsnorm, swiglu
from moajax.kernels.attention import mha_dnf

F64 = 1e-12  # float64 end to end (a few ulps per op)
F32 = 2e-6  # float32: ~16 ulps of 1.2e-7 for sums over ≤ 64 keys in a different order

B, T, S, N, K, H, E = 1, 10, 13, 4, 2, 8, 4  # GQA: 2 query heads per kv head; tails everywhere


def inputs(dtype, seed=0):
    r = np.random.default_rng(seed)
    q = r.standard_normal((B, T, N, H)).astype(dtype)
    k = r.standard_normal((B, S, K, H)).astype(dtype)
    v = r.standard_normal((B, S, K, E)).astype(dtype)
    return q, k, v


def onf_variants(dnf):
    """(label, ONF, pallas-able) for a matrix of schedules."""
    base = W.hoist(O.initial(dnf))
    online = W.fuse_online(base)
    out = []
    for carry, prog in (("online", online), ("passes", base)):
        for bt, bs in ((16, 16), (4, 8), (8, 4), (2, 1)):
            o = W.tile(W.tile(W.tile(W.tile(prog, "t", bt, "grid"), "s", bs, "sequential"), "b", 1, "grid"), "n", 1, "grid")
            o = W.tile(W.tile(o, "h", 8, "whole"), "e", 4, "whole")
            out.append((f"{carry} t{bt} s{bs}", o, True))
            out.append((f"{carry} t{bt} s{bs} γF", W.with_gamma(W.with_gamma(o, "key", "F"), "query", "F"), True))
        out.append((f"{carry} cpu_loop", W.with_knobs(W.tile(prog, "t", 4, "grid"), cpu_loop=("t",)), False))
    def heads(o):  # batch and heads one per program: the GQA head ⌊n/2⌋ is then a scalar
        return W.tile(W.tile(W.tile(W.tile(o, "b", 1, "grid"), "n", 1, "grid"), "h", 8), "e", 4)

    stored = W.tile(W.materialize(base, "score", "local"), "s", 4, "sequential")
    out.append(("passes stored score row", stored, False))
    mem = W.tile(W.tile(W.materialize(base, "score", "memory"), "t", 4, "grid"), "s", 8, "sequential")
    out.append(("passes score in memory", heads(mem), True))
    split = W.tile(W.split_k(W.tile(online, "s", 4, "sequential"), "s", 3), "t", 8, "grid")
    out.append(("online split-K 3", heads(split), True))
    return out


DNF64 = mha_dnf((B, T, N, H), (B, S, K, H), (B, S, K, E), np.dtype(np.float64))
VARIANTS = onf_variants(DNF64)


@pytest.mark.parametrize("label,onf,pallas_ok", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_xla_float64_equals_reference(label, onf, pallas_ok):
    q, k, v = inputs(np.float64)
    want = R.mha(q, k, v)
    assert rel_err(lower_xla.lower(onf)(q, k, v), want) <= F64


def test_xla_float32():
    q, k, v = inputs(np.float32)
    want = R.mha(q, k, v)
    dnf32 = mha_dnf((B, T, N, H), (B, S, K, H), (B, S, K, E), np.dtype(np.float32))
    for label, onf, _ in onf_variants(dnf32):
        got = lower_xla.lower(onf)(q, k, v)
        assert got.dtype == jnp.float32
        assert rel_err(got, want) <= F32, label


PALLAS = [v for v in VARIANTS if v[2]][::2] + [v for v in VARIANTS if v[2] and ("split" in v[0] or "memory" in v[0] or "γF" in v[0])][:3]


@pytest.mark.parametrize("label,onf,pallas_ok", PALLAS, ids=[v[0] for v in PALLAS])
def test_pallas_interpret_equals_xla(label, onf, pallas_ok):
    q, k, v = inputs(np.float64, seed=3)
    xla = lower_xla.lower(onf)(q, k, v)
    pal = pallas_kernels.lower(onf, interpret=True)(q, k, v)
    assert rel_err(pal, xla) <= F64
    assert rel_err(pal, R.mha(q, k, v)) <= F64


@pytest.mark.parametrize("kern", [attention, decode, rmsnorm, swiglu, mha, block], ids=lambda k: k.name)
def test_seed_kernels_default_gpu_onf_in_interpret_mode(kern):
    d0 = kern.dnf()
    r = np.random.default_rng(7)
    args = [r.standard_normal(i.shape) * 0.5 for i in d0.inputs]
    dnf = kern.dnf(*args)
    want = np.asarray(kern(*args))
    onf = schedule.derive(dnf, machines.load("delta-a100"))
    assert rel_err(pallas_kernels.lower(onf, interpret=True)(*args), want) <= F64
    cpu = schedule.derive(dnf, machines.local())
    assert rel_err(lower_xla.lower(cpu)(*args), want) <= F64


@st.composite
def problems(draw):
    kv = draw(st.integers(1, 2))
    n = kv * draw(st.integers(1, 2))
    shape = dict(B=draw(st.integers(1, 2)), T=draw(st.integers(1, 12)), S=draw(st.integers(1, 12)), N=n, K=kv,
                 H=draw(st.integers(1, 9)), E=draw(st.integers(1, 6)))
    extras = dict(is_causal=draw(st.booleans()), bias=draw(st.booleans()), mask=draw(st.booleans()))
    tiles = dict(t=draw(st.integers(1, 12)), s=draw(st.integers(1, 12)))
    carry = draw(st.sampled_from(["online", "passes"]))
    gamma = draw(st.sampled_from([{}, {"key": "F"}, {"query": "F", "value": "F"}]))
    return shape, extras, tiles, carry, gamma, draw(st.integers(0, 10_000))


@settings(max_examples=30)
@given(problems())
def test_random_shapes_masks_and_schedules(case):
    shape, extras, tiles, carry, gamma, seed = case
    r = np.random.default_rng(seed)
    b, t, s, n, kv, h, e = (shape[x] for x in "BTSNKHE")
    q, k, v = r.standard_normal((b, t, n, h)), r.standard_normal((b, s, kv, h)), r.standard_normal((b, s, kv, e))
    bias = r.standard_normal((1, n, t, s)) if extras["bias"] else None
    mask = (r.random((b, 1, t, s)) > 0.3) if extras["mask"] else None
    dnf = mha_dnf(q.shape, k.shape, v.shape, np.dtype(np.float64), None if bias is None else bias.shape,
                  None if bias is None else bias.dtype, None if mask is None else mask.shape, None, extras["is_causal"])
    onf = schedule.derive(dnf, machines.local(), schedule.Preset.of(
        carry=carry, tiles={"t": min(tiles["t"], t), "s": min(tiles["s"], s)}, roles={"s": "sequential"}, gamma=gamma))
    args = [a for a in (q, k, v, bias, mask) if a is not None]
    got = lower_xla.lower(onf)(*args)
    want = R.mha(q, k, v, bias=bias, mask=mask, is_causal=extras["is_causal"])
    assert rel_err(got, want) <= F64, onf.pretty()


def test_vmap_of_the_lowered_kernels_adds_batch_loops_not_python_loops():
    q, k, v = inputs(np.float64)
    onf = VARIANTS[0][1]
    stack = lambda a: np.stack([a, a * 0.5, -a])
    f = lower_xla.lower(onf)
    got = jax.vmap(f)(stack(q), stack(k), stack(v))
    for i in range(3):
        assert rel_err(got[i], R.mha(stack(q)[i], stack(k)[i], stack(v)[i])) <= F64
    jaxpr = jax.make_jaxpr(jax.vmap(pallas_kernels.lower(onf, interpret=True)))(stack(q), stack(k), stack(v))
    # one pallas_call, batched by JAX (a grid axis), not three
    assert str(jaxpr).count("pallas_call") == 1


@pytest.mark.parametrize("causal", [False, True], ids=["static", "skipping"])
def test_kernel_loops_count_in_int32_under_x64(causal):
    """A walk's counter is an int32 whatever ``jax_enable_x64`` says (``Backend.fori_loop``):
    lax.fori_loop over static bounds scans with a Python-int counter, an int64 under x64, which
    Pallas' Triton lowering makes the loop's induction variable (sm_90a spilled 8 B in the
    H200's float32 SwiGLU dZ under x64 for it, none without). No loop carries an int64, or
    computes one each step: in the static walks, nor in the traced spans of the skipping ones
    (causal; their bounds, computed once per program before the loop, may be int64)."""
    from helpers import walk_eqns
    from moajax import compat

    with compat.enable_x64_context(True):
        dnf = mha_dnf((1, 256, 2, 64), (1, 256, 2, 64), (1, 256, 2, 64), np.float32, is_causal=causal)
        onf = schedule.derive(dnf, machines.load("h200"))
        fn = pallas_kernels.lower(onf, interpret=True)
        args = [jax.ShapeDtypeStruct(i.shape, i.dtype) for i in dnf.inputs]
        jaxpr = jax.make_jaxpr(fn)(*args)
    kernels = [e for e, _ in walk_eqns(jaxpr.jaxpr) if e.primitive.name == "pallas_call"]
    loops = [q for k in kernels for q, _ in walk_eqns(k.params["jaxpr"]) if q.primitive.name in ("scan", "while")]
    # the loops' carries, and every value computed inside a loop body, per step
    inner = [q for loop in loops for key in ("jaxpr", "body_jaxpr") if key in loop.params
             for q, _ in walk_eqns(getattr(loop.params[key], "jaxpr", loop.params[key]))]
    wide = {(q.primitive.name, str(v.aval)) for q in loops + inner for v in q.outvars
            if getattr(v.aval, "dtype", None) == np.int64}
    assert kernels and loops and not wide, wide


# ----------------------------------------------------------------------------- shifted windows


def _catenate_kernels():
    import moajax
    from moajax import moa

    @moajax.kernel(register=False)
    def rows(x: "n d", y: "m d"):
        return moa.catenate(x, y, axis=0)

    @moajax.kernel(register=False)
    def cols(x: "d n", y: "d m"):
        return moa.catenate(x, y, axis=1)

    return rows, cols


CATENATE = _catenate_kernels()


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 9), st.integers(1, 9), st.integers(1, 3), st.sampled_from([0, 1]),
       st.sampled_from([None, 1, 2, 4, 8]), st.sampled_from(["grid", "cpu_loop", "sequential"]))
def test_catenate_of_two_inputs_reads_the_second_through_a_shifted_window(nx, ny, d, axis, tile, walk):
    """x ++ y along an axis: ⟨… n …⟩ψ(x ++ y) = (n < nx) ? ⟨… n …⟩ψx : ⟨… (n − nx) …⟩ψy,
    y read at the shifted index n − nx over every tile of n, a window that starts before 0
    (and ends past y's last row where x is the longer part, or n's tiles overhang).

    The XLA backend reads it exactly: numpy.concatenate bit for bit on the default CPU path,
    and under n in small tiles — vectorised over the grid (static starts), walked by
    ``cpu_loop`` or as a sequential axis (traced starts). The overhang is no error and
    leaves every kept element where it is: a clamped window start would shift the whole
    tile, the rows n ≥ nx included."""
    r = np.random.default_rng(nx * 100 + ny * 10 + d)
    x, y = r.standard_normal((nx, d)), r.standard_normal((ny, d))
    kern = CATENATE[axis]
    if axis:
        x, y = x.T.copy(), y.T.copy()
    want = np.concatenate([x, y], axis=axis)
    if tile is None:
        assert np.array_equal(np.asarray(kern(x, y)), want)  # the kernel's own CPU schedule
        return
    dnf = kern.dnf(x, y)
    roles = {"n": "sequential"} if walk == "sequential" else {}
    knobs = {"cpu_loop": ("n",)} if walk == "cpu_loop" else {}
    onf = schedule.derive(dnf, machines.local(), schedule.Preset.of(tiles={"n": tile}, roles=roles, **knobs))
    assert np.array_equal(np.asarray(lower_xla.lower(onf)(x, y)), want), onf.pretty()


@pytest.mark.parametrize("tile", [2, 4])
def test_catenate_of_two_inputs_under_a_row_tiling_through_the_kernel(tile):
    """x ++ y along rows, x ρ⟨5 2⟩, y ρ⟨6 2⟩ (the second read at n − 5), through the kernel's
    compiled CPU path with a ``Preset`` of row tiles: numpy.concatenate exactly (a window of
    the whole of n's 12 padded rows at −5 once asked for more rows than y has)."""
    import moajax

    x = np.arange(10.0).reshape(5, 2)
    y = 100 + np.arange(12.0).reshape(6, 2)
    got = CATENATE[0](x, y, onf=moajax.Preset.of(tiles={"n": tile}))
    assert np.array_equal(np.asarray(got), np.concatenate([x, y]))


def _shift_kernels():
    import moajax
    from moajax import moa

    @moajax.kernel(register=False)
    def selfshift(x: "n d"):
        return moa.omega(lambda c: moa.catenate(moa.take(1, c), c, 0), 1)(x)

    @moajax.kernel(register=False)
    def lag(x: "n d"):
        return moa.catenate(moa.take(2, x, 1), moa.drop(-2, x, 1), 1)

    @moajax.kernel(register=False)
    def total(x: "n d", y: "m d"):
        return moa.sum(moa.catenate(x, y, axis=0), 0)

    return selfshift, lag, total


SHIFTS = _shift_kernels()


def _out_axis(kern, args, axis: int) -> str:
    """The name of the output's index variable at ``axis`` (the catenated one: its name is the
    DNF's, not the signature's), for a Preset to tile it — an unknown name tiles nothing."""
    return kern.dnf(*args).outputs[0].vars[axis].name


def _shift_case(case: str):
    """(kernel, arrays, numpy's result, the shifted output axis or None) of one case of
    ``test_pallas_reads_a_window_shifted_back_exactly``."""
    r = np.random.default_rng(len(case))
    sizes = {"rows 5 6": (5, 6), "rows 1 7": (1, 7), "cols 1 6": (1, 6), "cols 1 1": (1, 1),
             "cols 2 3": (2, 3), "cols 3 5": (3, 5)}
    if case in sizes:
        nx, ny = sizes[case]
        x, y = r.standard_normal((nx, 2)), r.standard_normal((ny, 2))
        if case.startswith("cols"):
            x, y = x.T.copy(), y.T.copy()
        axis = int(case.startswith("cols"))
        return CATENATE[axis], (x, y), np.concatenate([x, y], axis), axis
    selfshift, lag, total = SHIFTS
    if case == "total":
        x, y = r.standard_normal((5, 3)), r.standard_normal((6, 3))
        return total, (x, y), np.concatenate([x, y]).sum(0), None
    x = r.standard_normal((3, 5))
    if case == "selfshift":
        return selfshift, (x,), np.concatenate([x[:, :1], x], 1), 1
    return lag, (x,), np.concatenate([x[:, :2], x[:, :-2]], 1), None


@pytest.mark.parametrize("case,tile", [(c, t) for c in ("rows 5 6", "rows 1 7", "cols 1 6", "cols 1 1", "cols 2 3",
                                                       "cols 3 5", "selfshift") for t in (None, 1, 2, 4)]
                         + [("lag", None), ("total", None)])
def test_pallas_reads_a_window_shifted_back_exactly(case, tile):
    """A read at v + c, c < 0, through the Pallas kernels (interpret mode): x ++ y along rows
    or columns, ⟨… n …⟩ψ(x ++ y) = (n < nx) ? ⟨… n …⟩ψx : ⟨… (n − nx) …⟩ψy; a column
    shifted by take, Ω⟨1⟩(1△c ++ c) (x read at d − 1) and 2△x ++ ¯2▽x (at d − 2); and
    +/(x ++ y) over the rows, whose power-of-two block reads y past its last row.

    numpy's result exactly (the Σ to float64 rounding), under the default GPU schedule and
    the shifted axis in tiles of 1, 2, 4: the window of y starts before 0 and ends past y,
    where a pl.ds start was clamped (every element of the tile shifted, the kept ones too)
    or refused ("Out of bound slice"), and on a GPU loaded out of bounds. The input is
    stored with zeros around it instead (``operands.input_padding(before=True)``)."""
    from moajax.schedule import Preset

    kern, args, want, axis = _shift_case(case)
    preset = None if tile is None else Preset.of(tiles={_out_axis(kern, args, axis): tile})
    got = np.asarray(kern(*args, onf=preset, implementation="pallas_interpret"))
    if case == "total":
        assert rel_err(got, want) <= F64
    else:
        assert got.dtype == np.float64 and np.array_equal(got, want), (got, want)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 9), st.integers(1, 9), st.integers(1, 3), st.sampled_from([0, 1]),
       st.sampled_from([None, 1, 2, 4, 8]), st.sampled_from(["grid", "sequential"]))
def test_pallas_catenate_of_two_inputs_reads_the_second_through_a_shifted_window(nx, ny, d, axis, tile, walk):
    """x ++ y along an axis on the Pallas kernels (interpret mode), as
    ``test_catenate_of_two_inputs_reads_the_second_through_a_shifted_window`` on XLA:
    ⟨… n …⟩ψ(x ++ y) = (n < nx) ? ⟨… n …⟩ψx : ⟨… (n − nx) …⟩ψy, y read at n − nx.

    numpy.concatenate bit for bit under the default GPU schedule and n in power-of-two tiles
    over the grid (a program's start from its id) or walked as a sequential axis (traced
    starts): every in-range position of y read exactly, its overhang 0 and dropped."""
    from moajax.schedule import Preset

    r = np.random.default_rng(nx * 100 + ny * 10 + d)
    x, y = r.standard_normal((nx, d)), r.standard_normal((ny, d))
    if axis:
        x, y = x.T.copy(), y.T.copy()
    want = np.concatenate([x, y], axis=axis)
    n = _out_axis(CATENATE[axis], (x, y), axis)
    roles = {n: "sequential"} if walk == "sequential" else {}
    preset = None if tile is None else Preset.of(tiles={n: tile}, roles=roles)
    got = CATENATE[axis](x, y, onf=preset, implementation="pallas_interpret")
    assert np.array_equal(np.asarray(got), want)
