"""The backward and forward+backward kernels (papers II and IV) defined in the algebra:
against the independent float64 references, under jax.grad of the forward kernels, and run
through their ONFs — the papers' fused ONF (per-row programs, atomic scatter-add of the
weight-like gradients), the classical one (P stored), tiles with tails — on the XLA backend
and, with atomic_add, as Pallas kernels in interpret mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
import references as R
from helpers import rel_err
from moajax import lower_xla, machines, schedule
from moajax.kernels import (attention, attention_backward, attention_forward_backward, rmsnorm,
                            rmsnorm_forward_backward, swiglu, swiglu_forward_backward)
from moajax.onf import ONFError
from moajax.schedule import Preset

# float64 end to end: a few ulps per operation, sums of at most a few dozen terms.
F64 = 1e-12

rng = np.random.default_rng(7)


def randn(*shape):
    return rng.standard_normal(shape)


def attention_case(T=8, S=12, H=4, E=6):
    return randn(T, H), randn(S, H), randn(S, E), randn(T, E)


def rmsnorm_case(n=7, d=16):
    return randn(n, d), randn(d), randn(n, d)


def swiglu_case(n=7, d=6, f=12):
    return randn(n, d), randn(d, f) / 2, randn(d, f) / 2, randn(f, d) / 2, randn(n, d)


def want(kern, args, **opts):
    if kern is attention_backward:
        return R.attention_backward(*args, **opts)
    if kern is attention_forward_backward:
        return (R.attention(*args[:3], **opts),) + R.attention_backward(*args, **opts)
    if kern is rmsnorm_forward_backward:
        return (R.rmsnorm(*args[:2]),) + R.rmsnorm_backward(*args)
    return (R.swiglu(*args[:4]),) + R.swiglu_backward(*args)


CASES = [
    (attention_backward, attention_case(), {}),
    (attention_backward, attention_case(5, 5, 3, 3), {"is_causal": True}),
    (attention_backward, attention_case(9, 4, 72, 5), {"scale": 0.3}),
    (attention_forward_backward, attention_case(), {}),
    (attention_forward_backward, attention_case(6, 10, 8, 4), {"is_causal": True}),
    (rmsnorm_forward_backward, rmsnorm_case(), {}),
    (swiglu_forward_backward, swiglu_case(), {}),
]


@pytest.mark.parametrize("kern,args,opts", CASES, ids=lambda x: getattr(x, "name", ""))
def test_dnf_matches_float64_reference(kern, args, opts):
    got = kern(*args, **opts)
    assert len(got) == len(kern.dnf(*args, **opts).outputs)
    for g, w in zip(got, want(kern, args, **opts)):
        assert rel_err(g, w) <= F64


def test_backward_kernels_equal_jax_grad_of_the_forward_kernels():
    # two independent routes to the same numbers: the hand-derived array math of paper II/IV
    # and JAX's autodiff through the forward kernel's DNF → JAX reference
    q, k, v, g = attention_case()
    dq, dk, dv = attention_backward(q, k, v, g, is_causal=True)
    _, vjp = jax.vjp(lambda a, b, c: attention(a, b, c, is_causal=True), q, k, v)
    for ours, theirs in zip((dq, dk, dv), vjp(g)):
        assert rel_err(ours, theirs) <= F64
    x, w, gz = rmsnorm_case()
    _, vjp = jax.vjp(rmsnorm, x, w)
    for ours, theirs in zip(rmsnorm_forward_backward(x, w, gz)[1:], vjp(gz)):
        assert rel_err(ours, theirs) <= F64
    z, wg, wu, wd, gf = swiglu_case()
    _, vjp = jax.vjp(swiglu, z, wg, wu, wd)
    for ours, theirs in zip(swiglu_forward_backward(z, wg, wu, wd, gf)[1:], vjp(gf)):
        assert rel_err(ours, theirs) <= F64


def test_the_backward_dnf_has_no_n_by_n_array():
    # only inputs are indexed; P, dP and dS are index functions, not buffers
    dnf = attention_backward.dnf(*attention_case())
    assert sorted(o.name for o in dnf.outputs) == ["dk", "dq", "dv"]
    text = dnf.pretty()
    assert "dscore(t, s) =" in text and "delta(t) =" in text


def schedules(kern, args, opts):
    """(label, ONF) for the backward's schedules on this CPU."""
    cpu = machines.local()
    dnf = kern.dnf(*args, **opts)
    r = dnf.outputs[0].vars[0].name
    out = [
        ("papers fused: rows 1, atomic", schedule.derive(dnf, cpu, Preset.of(tiles={r: 1}))),
        ("rows 3 (tail), passes", schedule.derive(dnf, cpu, Preset.of(carry="passes", tiles={r: 3}))),
        ("default", schedule.derive(dnf, cpu)),
    ]
    loops = [a.name for a in out[-1][1].axes if a.name != r and a.role != "grid"]
    if "s" in loops:
        out.append(("keys sequential by 5 (tail)", schedule.derive(
            dnf, cpu, Preset.of(tiles={r: 4, "s": 5}, roles={"s": "sequential"}))))
        out.append(("classical: P in memory", schedule.derive(
            dnf, cpu, Preset.of(carry="passes", store={"probs": "memory"}, tiles={r: 2}))))
    return out


@pytest.mark.parametrize("kern,args,opts", CASES, ids=lambda x: getattr(x, "name", ""))
def test_onfs_on_xla_equal_the_reference(kern, args, opts):
    expect = want(kern, args, **opts)
    for label, onf in schedules(kern, args, opts):
        got = lower_xla.lower(onf)(*args)
        for g, w in zip(got, expect):
            assert rel_err(g, w) <= F64, f"{label}\n{onf.pretty()}"


def test_papers_fused_onf_accumulates_dk_and_dv_atomically():
    args = attention_case()
    onf = schedule.derive(attention_forward_backward.dnf(*args), machines.local(), Preset.of(tiles={"t": 1}))
    assert dict(onf.accumulate) == {"dk": "atomic", "dv": "atomic"}
    assert onf.axis("t").role == "grid" and onf.axis("t").tile == 1
    assert "accumulate: dk atomic, dv atomic" in onf.pretty()
    assert "rewrites: hoist → fuse_online → accumulate(dk, atomic)" in onf.pretty()
    # dQ and Out are owned by their row's program: nothing of theirs crosses programs
    assert onf.accumulation("dq") is None and onf.accumulation("out") is None


def test_float32_backward_on_xla():
    args = [a.astype(np.float32) for a in attention_case()]
    onf = schedule.derive(attention_backward.dnf(*args), machines.local())
    got = lower_xla.lower(onf)(*args)
    # float32: ~16 ulps of 1.2e-7 over sums of 12 keys and 8 rows
    for g, w in zip(got, R.attention_backward(*args)):
        assert g.dtype == jnp.float32
        assert rel_err(g, w) <= 2e-6


@pytest.mark.parametrize("kern,args,opts", CASES[:1] + CASES[3:5] + CASES[5:], ids=lambda x: getattr(x, "name", ""))
def test_pallas_interpret_scatter_adds_like_xla(kern, args, opts):
    # the Pallas kernels add each row tile's partial dK, dV (dw, dW) with atomic_add into a
    # zeroed output; interpret mode runs them serially and must equal the XLA path
    a100 = machines.load("delta-a100")
    dnf = kern.dnf(*args, **opts)
    r = dnf.outputs[0].vars[0].name
    presets = [Preset.of(tiles={r: 2})]
    if "s" in {v.name for o in dnf.outputs for v in o.vars}:
        presets.append(Preset.of(tiles={r: 4, "s": 4}, roles={"s": "sequential"}))  # dK, dV walked in key tiles
    expect = want(kern, args, **opts)
    for p in presets:
        onf = schedule.derive(dnf, a100, p)
        assert onf.accumulate
        got = pallas_kernels.lower(onf, interpret=True)(*args)
        xla = lower_xla.lower(onf)(*args)
        for g, x, w in zip(got, xla, expect):
            assert rel_err(g, w) <= F64, onf.pretty()
            assert rel_err(g, x) <= F64


def test_pallas_refuses_two_sequential_axes_in_one_scatter():
    args = swiglu_case(8, 6, 12)
    onf = schedule.derive(swiglu_forward_backward.dnf(*args), machines.load("delta-a100"),
                          Preset.of(tiles={"n": 2, "d": 4, "f": 4}, roles={"d": "sequential", "f": "sequential"}))
    with pytest.raises(ONFError, match="walks at most one of its own axes"):
        pallas_kernels.lower(onf, interpret=True)


def test_bfloat16_backward_accumulates_in_float32():
    args = [jnp.asarray(a, jnp.bfloat16) for a in attention_case()]
    onf = schedule.derive(attention_forward_backward.dnf(*args), machines.local(), Preset.of(tiles={"t": 2}))
    # the 16-bit outputs are float32 sums converted once: the partials add up in float32
    assert dict(onf.accumulate) == {"dk": "atomic", "dv": "atomic"}
    assert "dk[s, h] = bfloat16(Σ_{t<8}" in onf.pretty()
    got = lower_xla.lower(onf)(*args)
    ref64 = [np.asarray(a.astype(jnp.float32), np.float64) for a in args]
    expect = (R.attention(*ref64[:3]),) + R.attention_backward(*ref64)
    for g, w in zip(got, expect):
        assert g.dtype == jnp.bfloat16
        # one bfloat16 rounding of each output (2^-8 relative) dominates the float32 sums
        assert rel_err(g.astype(jnp.float32), w) <= 2 ** -8


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=20, deadline=None)
@given(T=st.integers(1, 10), S=st.integers(1, 10), H=st.integers(1, 6), E=st.integers(1, 5),
       bt=st.integers(1, 6), bs=st.integers(1, 6), causal=st.booleans(), carry=st.sampled_from(["online", "passes"]),
       seed=st.integers(0, 1000))
def test_random_backward_schedules(T, S, H, E, bt, bs, causal, carry, seed):
    # random shapes, row/key tiles with tails, causal or not: the scatter-add ONF on XLA
    r = np.random.default_rng(seed)
    args = r.standard_normal((T, H)), r.standard_normal((S, H)), r.standard_normal((S, E)), r.standard_normal((T, E))
    dnf = attention_forward_backward.dnf(*args, is_causal=causal)
    onf = schedule.derive(dnf, machines.local(), Preset.of(
        carry=carry, tiles={"t": min(bt, T), "s": min(bs, S)}, roles={"s": "sequential"}))
    expect = want(attention_forward_backward, args, is_causal=causal)
    for g, w in zip(lower_xla.lower(onf)(*args), expect):
        # a gradient can cancel to exactly 0 (a row with one visible key has dS = P·(dP − Δ)
        # = 0): its rounding residue is relative to the O(1) summands (standard-normal
        # inputs), so the error is measured against max(|w|, 1)
        err = float(np.max(np.abs(np.asarray(g) - w), initial=0.0)) / max(float(np.max(np.abs(w), initial=0.0)), 1.0)
        assert err <= F64, onf.pretty()


def test_atomic_memory_stage_on_both_backends():
    # a stage in main memory may be scatter-added too (a partial result another kernel reads)
    from moajax import dnf as D
    from moajax import onf as O

    args = rmsnorm_case(9, 16)
    onf = schedule.derive(rmsnorm_forward_backward.dnf(*args), machines.load("delta-a100"), Preset.of(tiles={"n": 4}))
    dw = onf.program.stage_of("dweight")
    summed = O.Stage("dw_sum", dw.vars, dw.body, "memory")
    read = O.Stage("dweight", dw.vars, D.Call("mul", (D.Ref("dw_sum", dw.vars, dw.body.dtype), D.Lit(1.0, dw.body.dtype))))
    stages = tuple(x for s in onf.program.stages for x in ((summed, read) if s is dw else (s,)))
    mem = onf.replace(program=O.Program(stages, onf.program.outputs), accumulate=(("dw_sum", "atomic"),)).validate()
    expect = want(rmsnorm_forward_backward, args)
    # the Pallas lowering adds into dw_sum with an atomic read-modify-write
    assert "atomic_rmw" in str(jax.make_jaxpr(pallas_kernels.lower(mem, interpret=True))(*args))
    for got in (lower_xla.lower(mem)(*args), pallas_kernels.lower(mem, interpret=True)(*args)):
        for g, w in zip(got, expect):
            assert rel_err(g, w) <= F64


def test_the_row_variable_is_found_whatever_the_output_order():
    # dweight[d] first: d is summed by the RMS, so the rows n (summed only by dweight, which
    # is then scatter-added) own the programs
    from moajax.kernel import kernel

    @kernel(example=dict(n=8, d=16), outputs=("dweight", "z", "dx"), register=False)
    def reordered(x: "n d", weight: "d", g: "n d"):
        z, dx, dw = rmsnorm_forward_backward.define(x, weight, g)
        return dw, z, dx

    args = rmsnorm_case(8, 16)
    onf = schedule.derive(reordered.dnf(*args), machines.local())
    assert onf.axis("n").role == "grid" and dict(onf.accumulate) == {"dweight": "atomic"}
    z, dx, dw = want(rmsnorm_forward_backward, args)
    for g, w in zip(lower_xla.lower(onf)(*args), (dw, z, dx)):
        assert rel_err(g, w) <= F64
