"""moajax.dot_product_attention: jax.nn's contract, both backends, every dtype, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moajax
import references as R
from helpers import rel_err
from moajax import cost, machines
from moajax.schedule import Preset

F64 = 1e-12  # float64 end to end
F32 = 2e-6  # float32 vs jax.nn: both float32, different summation orders
# 16-bit: the output is rounded to bf16 (2^-8 relative) / f16 (2^-11); the GPU default also
# feeds the probabilities to the second dot in 16 bits (FlashAttention's choice): 2 roundings.
LOWP = {np.dtype(jnp.bfloat16): 2 * 2.0**-8, np.dtype(np.float16): 2 * 2.0**-11}

r = np.random.default_rng(0)


def qkv(B=2, T=9, S=11, N=4, K=2, H=72, E=72, dtype=np.float32):
    q = r.standard_normal((B, T, N, H))
    k = r.standard_normal((B, S, K, H))
    v = r.standard_normal((B, S, K, E))
    return tuple(jnp.asarray(a, dtype) for a in (q, k, v))


@pytest.mark.parametrize("impl", [None, "pallas_interpret"])
def test_float32_matches_jax_nn(impl):
    q, k, v = qkv()
    got = moajax.dot_product_attention(q, k, v, implementation=impl)
    assert got.dtype == jnp.float32 and got.shape == (2, 9, 4, 72)
    assert rel_err(got, jax.nn.dot_product_attention(q, k, v)) <= F32


@pytest.mark.parametrize("impl", [None, "pallas_interpret"])
def test_float64_is_float64_accurate(impl):
    q, k, v = qkv(dtype=np.float64)
    got = moajax.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
    assert got.dtype == jnp.float64
    want = R.mha(*(np.asarray(a) for a in (q, k, v)), is_causal=True)
    assert rel_err(got, want) <= F64
    # jax.nn is not a float64 reference: it keeps logits in float32
    nn = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    assert rel_err(nn, want) > 1e-12


@pytest.mark.parametrize("impl", [None, "pallas_interpret"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float16])
def test_16_bit_accumulates_in_float32(impl, dtype):
    q, k, v = qkv(H=64, E=64, dtype=dtype)
    got = moajax.dot_product_attention(q, k, v, implementation=impl)
    assert got.dtype == dtype
    want = R.mha(*(np.asarray(a.astype(jnp.float32), np.float64) for a in (q, k, v)))
    assert rel_err(got.astype(jnp.float32), want) <= LOWP[np.dtype(dtype)]


@pytest.mark.parametrize("impl", [None, "pallas_interpret"])
def test_bias_mask_causal_gqa_uneven_lengths(impl):
    q, k, v = qkv(T=7, S=13, N=6, K=3, H=16, E=8, dtype=np.float64)
    bias = jnp.asarray(r.standard_normal((1, 6, 7, 13)))
    mask = jnp.asarray(r.random((2, 1, 7, 13)) > 0.4)
    got = moajax.dot_product_attention(q, k, v, bias, mask, is_causal=True, scale=0.3, implementation=impl)
    want = R.mha(*(np.asarray(a) for a in (q, k, v)), bias=np.asarray(bias), mask=np.asarray(mask), is_causal=True, scale=0.3)
    assert rel_err(got, want) <= F64


def test_fully_masked_rows_average_values_like_jax_nn():
    q, k, v = qkv(T=4, S=5, H=8, E=8)
    mask = jnp.zeros((2, 4, 4, 5), bool).at[:, :, :2].set(True)
    got = moajax.dot_product_attention(q, k, v, mask=mask)
    assert rel_err(got, jax.nn.dot_product_attention(q, k, v, mask=mask)) <= F32


def test_rank_3_inputs():
    q, k, v = qkv(B=1)
    got = moajax.dot_product_attention(q[0], k[0], v[0])
    assert got.shape == (9, 4, 72)
    assert rel_err(got, jax.nn.dot_product_attention(q[0], k[0], v[0])) <= F32


def test_jit_vmap_over_extra_leading_axes():
    q, k, v = qkv(B=2, T=5, S=6, N=2, K=1, H=8, E=8)
    stack = lambda a: jnp.stack([a, -a, 0.5 * a])
    f = jax.jit(jax.vmap(jax.vmap(moajax.dot_product_attention)))
    qq, kk, vv = (jnp.stack([stack(a), stack(a) * 2]) for a in (q, k, v))  # [2, 3, B, ...]
    got = f(qq, kk, vv)
    assert got.shape == (2, 3, 2, 5, 2, 8)
    want = jax.vmap(jax.vmap(jax.nn.dot_product_attention))(qq, kk, vv)
    assert rel_err(got, want) <= F32
    # the batch is a batch dimension of the loops, not a Python loop: one kernel call in the jaxpr
    jaxpr = str(jax.make_jaxpr(jax.vmap(moajax.dot_product_attention))(stack(q), stack(k), stack(v)))
    assert jaxpr.count("moajax_platform_call") == 1


def test_grad_through_the_cpu_path():
    q, k, v = qkv(B=1, T=5, S=6, N=2, K=2, H=4, E=3, dtype=np.float64)
    g = r.standard_normal((1, 5, 2, 3))
    loss = lambda q, k, v: jnp.sum(moajax.dot_product_attention(q, k, v, implementation="xla") * g)
    dq, dk, dv = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    rq, rk, rv = R.mha_backward(*(np.asarray(a) for a in (q, k, v)), g)
    for a, b in ((dq, rq), (dk, rk), (dv, rv)):
        assert rel_err(a, b) <= 1e-11


@pytest.mark.parametrize("impl", [None, "pallas_interpret"])
def test_grad_under_jit_with_gqa_mask_bias_and_causal(impl):
    # jax.grad of the platform dispatch inside jit: JAX differentiates every branch, and the
    # Pallas (CUDA) branch has no derivative rule of its own, so the cotangents must come from
    # the XLA lowering of the same ONF (this failed with an AssertionError inside Pallas before).
    # float64 end to end against the independent float64 backward: rel ≤ 1e-11 as above.
    q, k, v = qkv(B=2, T=7, S=9, N=4, K=2, H=8, E=8, dtype=np.float64)
    g = r.standard_normal((2, 7, 4, 8))
    mask = jnp.asarray(r.random((2, 1, 7, 9)) < 0.8)
    bias = jnp.asarray(r.standard_normal((1, 4, 7, 9)))

    def loss(q, k, v, bias):
        return jnp.sum(moajax.dot_product_attention(q, k, v, bias, mask, is_causal=True, implementation=impl) * g)

    dq, dk, dv, db = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)
    *want, dlogits = R.mha_backward(*(np.asarray(a) for a in (q, k, v)), g, bias=np.asarray(bias),
                                    mask=np.asarray(mask), is_causal=True, return_dbias=True)
    # the bias broadcasts over the batch: its gradient sums the logits' gradient over b
    want.append(dlogits.sum(axis=0, keepdims=True))
    for a, b in zip((dq, dk, dv, db), want):
        assert a.shape == b.shape and rel_err(a, b) <= 1e-11


def test_explicit_onf_and_presets():
    q, k, v = qkv(B=1, T=6, S=10, N=2, K=2, H=8, E=8, dtype=np.float64)
    want = R.mha(*(np.asarray(a) for a in (q, k, v)))
    onf = moajax.attention_onf(q, k, v, preset=Preset.of(carry="passes", tiles={"s": 4}, roles={"s": "sequential"}))
    assert onf.carry == {"max_s": "passes"}
    assert rel_err(moajax.dot_product_attention(q, k, v, onf=onf), want) <= F64
    p = Preset.of(carry="passes", store={"score": "onchip"}, target="cpu")
    assert rel_err(moajax.dot_product_attention(q, k, v, onf=p), want) <= F64
    other = moajax.attention_onf(q[:, :5], k, v)
    with pytest.raises(moajax.ONFError, match="derived for another DNF"):
        moajax.dot_product_attention(q, k, v, onf=other)


def test_attention_onf_takes_every_variant_and_gives_the_onf_the_call_runs():
    # lengths, a window, a score_mod closing over a table: the ONF inspected is the one the call
    # accepts (an ONF of another DNF is refused), and the cost model counts its skipped tiles
    # from the lengths' values
    q, k, v = qkv(B=2, T=12, S=12, N=2, K=2, H=8, E=8, dtype=np.float64)
    ql, kl = jnp.asarray([12, 5], jnp.int32), jnp.asarray([12, 7], jnp.int32)
    table = jnp.linspace(-1.0, 1.0, 25)
    mod = lambda s, b, h, i, j: s + table[jnp.clip(i - j + 12, 0, 24)]  # noqa: E731
    kw = dict(is_causal=True, query_seq_lengths=ql, key_value_seq_lengths=kl, local_window_size=(6, 0), score_mod=mod)
    onf = moajax.attention_onf(q, k, v, **kw, preset=Preset.of(tiles={"t": 4, "s": 4}))
    assert {i.name for i in onf.dnf.inputs} >= {"query_seq_lengths", "key_value_seq_lengths", "score_mod_const0"}
    got = moajax.dot_product_attention(q, k, v, **kw, onf=onf)
    assert rel_err(got, moajax.dot_product_attention(q, k, v, **kw)) <= F64  # (other tiles: another order of sums)
    with pytest.raises(moajax.ONFError, match="derived for another DNF"):
        moajax.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=ql, onf=onf)
    # under jit, where the table is an argument, the call picks at run time between the kernel
    # for a finite table and the one masking like ``mask``: the explicit ONF runs in the kernel
    # it was derived for, the default schedule in the other
    mk = lambda tab: lambda s, b, h, i, j: s + tab[jnp.clip(i - j + 12, 0, 24)]  # noqa: E731
    run = jax.jit(lambda q, k, v, tab: moajax.dot_product_attention(q, k, v, **{**kw, "score_mod": mk(tab)}, onf=onf))
    assert rel_err(run(q, k, v, table), got) <= F64
    holed = table.at[12].set(-jnp.inf)  # the diagonal masked: each row keeps its earlier keys, or none
    want = moajax.dot_product_attention(q, k, v, **{**kw, "score_mod": mk(holed)})
    assert np.array_equal(np.isfinite(np.asarray(want)), np.isfinite(np.asarray(run(q, k, v, holed))))
    assert rel_err(run(q, k, v, holed), want) <= F64
    # on a GPU profile, with several key tiles, the lengths' values leave tiles out of the count
    h200 = machines.load("h200")
    q5, k5, v5 = qkv(B=2, T=512, S=512, N=2, K=2, H=64, E=64, dtype=np.float32)
    l5 = jnp.asarray([512, 100], jnp.int32)
    gpu = moajax.attention_onf(q5, k5, v5, machine=h200, query_seq_lengths=l5, key_value_seq_lengths=l5)
    assert gpu.axis("s").ntiles > 1
    values = {"query_seq_lengths": np.asarray(l5), "key_value_seq_lengths": np.asarray(l5)}
    assert cost.estimate(gpu, h200, values=values).matmul_flops < 0.6 * cost.estimate(gpu, h200).matmul_flops
    # its checks name it
    with pytest.raises(ValueError, match="attention_onf: local_window_size must be ≥ 0"):
        moajax.attention_onf(q, k, v, local_window_size=(-1, 0))
    with pytest.raises(ValueError, match=r"attention_onf: query_seq_lengths must have shape \[2\]"):
        moajax.attention_onf(q, k, v, query_seq_lengths=jnp.asarray([1, 2, 3], jnp.int32))
    with pytest.raises(ValueError, match="attention_onf: key_value_seq_lengths must lie in 0 … 12"):
        moajax.attention_onf(q, k, v, key_value_seq_lengths=jnp.asarray([1, 13], jnp.int32))
    with pytest.raises(TypeError, match="attention_onf: score_mod must take 5 arguments"):
        moajax.attention_onf(q, k, v, score_mod=lambda s: s)


def test_traced_onfs_lists_the_kernels_a_program_runs():
    # what jax.grad runs is the saving forward and the adjoint (not the plain forward or the
    # tangent, which tracing touches and differentiation discards); a jit traced before (its
    # trace cached) reads the same; a GPU implementation's runs give the GPU's ONFs; vmap and
    # a model kernel's gradient too; each one costed
    q, k, v = qkv(B=2, T=32, S=32, N=2, K=2, H=8, E=8, dtype=np.float32)
    lengths = jnp.asarray([32, 9], jnp.int32)

    def loss(q, k, v, implementation=None):
        return jnp.sum(moajax.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=lengths,
                                                    implementation=implementation))

    def names(runs):
        return [tuple(o.dnf.name for o in r.onf) if isinstance(r.onf, tuple) else r.onf.dnf.name for r in runs]

    assert names(moajax.traced_onfs(loss, q, k, v)) == ["mha_qlen_mh"]
    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    step(q, k, v)  # (compiled: its traces cached)
    runs = moajax.traced_onfs(step, q, k, v)
    assert names(runs) == ["mha_qlen_mh_saving", "mha_qlen_mh_adjoint_saved"]
    assert names(moajax.traced_onfs(step, q, k, v)) == names(runs)
    assert all(r.onf is r.cpu and r.implementation is None for r in runs)
    gpu = moajax.traced_onfs(jax.grad(loss), q, k, v, implementation="pallas_interpret")
    assert [r.onf is r.gpu for r in gpu] == [True, True] and all(
        o.target != machines.local().name for r in gpu for o in (r.onf if isinstance(r.onf, tuple) else (r.onf,)))
    batched = moajax.traced_onfs(jax.vmap(loss), *(jnp.stack([x, x]) for x in (q, k, v)))
    assert len(batched) == 1 and batched[0].onf.dnf.name.startswith("mha_qlen_mh")
    x, w = jnp.ones((4, 16), jnp.float32), jnp.ones((16,), jnp.float32)
    norm = moajax.traced_onfs(jax.grad(lambda x, w: jnp.sum(moajax.rms_norm(x, w))), x, w)
    assert len(norm) == 2
    m = machines.local()
    for r in runs:
        for o in r.onf if isinstance(r.onf, tuple) else (r.onf,):
            names_in = {i.name for i in o.dnf.inputs}
            assert cost.estimate(o, m, values={"query_seq_lengths": lengths} if "query_seq_lengths" in names_in
                                 else None).flops > 0
    with pytest.raises(TypeError, match="traced_onfs: fun must be callable"):
        moajax.traced_onfs(3, q)
    # a kernel compiled again (a device's block at each compile of a sharded program) keeps its
    # index: the registry grows with kernels, not with compiles
    from moajax import runtime

    dnf = runs[0].cpu.dnf
    runtime.compiled_run(dnf)
    n = len(runtime._KERNEL_RUNS)
    runtime.compiled_run(dnf)
    assert len(runtime._KERNEL_RUNS) == n


def test_gpu_onf_for_a_cpu_machine_is_derived_from_a_gpu_profile():
    q, k, v = qkv(H=64, E=64, dtype=jnp.bfloat16)
    onf = moajax.attention_onf(q, k, v, machine="delta-a40")
    assert onf.target == "delta-a40" and onf.knobs.lowp_dots
    assert onf.axis("t").tile in (16, 32, 64, 128)
    assert cost.check_fits(onf.validate(), machines.load("delta-a40"))


@pytest.mark.parametrize("args,kw,exc,msg", [
    (lambda q, k, v: (q[0, 0], k, v), {}, ValueError, "query must have rank 4"),
    (lambda q, k, v: (q, k[0], v), {}, ValueError, "key and value must have the rank of query"),
    (lambda q, k, v: (q[:, :, :3], k, v), {}, ValueError, "query has 3 heads, not a multiple of the 2"),
    (lambda q, k, v: (q, k[..., :5], v), {}, ValueError, "key head dim 5 does not match query head dim 72"),
    (lambda q, k, v: (q, k[:, :3], v), {}, ValueError, "value shape .* does not match key shape"),
    (lambda q, k, v: (q, k.astype(jnp.bfloat16), v), {}, TypeError, "must share one dtype"),
    (lambda q, k, v: (q.astype(jnp.int32), k.astype(jnp.int32), v.astype(jnp.int32)), {}, TypeError, "query dtype must be one of"),
    (lambda q, k, v: (q[:1], k, v), {}, ValueError, "batch sizes differ"),
    (lambda q, k, v: (q, k, v), dict(mask=jnp.ones((2, 4, 9, 10), bool)), ValueError, "mask shape .* does not broadcast"),
    (lambda q, k, v: (q, k, v), dict(mask=jnp.ones((2, 4, 9, 11), jnp.float32)), TypeError, "mask must be a bool array"),
    (lambda q, k, v: (q, k, v), dict(bias=jnp.ones((3, 4, 9, 11))), ValueError, "bias shape .* does not broadcast"),
    (lambda q, k, v: (q, k, v), dict(bias=jnp.ones((1, 1, 1, 1, 1))), ValueError, "bias has rank 5"),
    (lambda q, k, v: (q, k, v), dict(scale=jnp.ones(2)), ValueError, r"scale must be a scalar, got shape \[2\]"),
    (lambda q, k, v: (q, k, v), dict(scale="a"), TypeError, "scale must be a real number, got str"),
    (lambda q, k, v: (q, k, v), dict(scale=True), TypeError, "scale must be a real number, got bool"),
    (lambda q, k, v: (q, k, v), dict(scale=float("nan")), ValueError, "scale must be finite"),
    (lambda q, k, v: (q, k, v), dict(is_causal=1), TypeError, "is_causal must be a static bool"),
    (lambda q, k, v: (q, k, v), dict(onf="fast"), TypeError, "onf must be a moajax ONF or a Preset"),
    (lambda q, k, v: (q, k, v), dict(implementation="cudnn"), ValueError, "implementation must be"),
    (lambda q, k, v: ("q", k, v), {}, TypeError, "query must be an array"),
    (lambda q, k, v: (q[..., :0], k[..., :0], v), {}, ValueError, r"zero-size dimension in query \[2, 9, 4, 0\]"),
])
def test_bad_arguments_name_the_argument(args, kw, exc, msg):
    q, k, v = qkv()
    with pytest.raises(exc, match=msg):
        moajax.dot_product_attention(*args(q, k, v), **kw)


def test_a_scale_known_only_when_the_call_runs():
    """scale as jax.nn takes it: a concrete array (1 / jnp.sqrt(d)) is a number, a traced one
    (a jit argument, 1 / jnp.sqrt(d) under jit, a learned temperature) scales the query by
    scale·√H beside the kernel's default 1/√H — float64 as the static scale, and its gradient
    the float64 reference's central difference (truncation O(eps²), rounding ≈ 1e-16/eps). It
    was refused ("scale must be a static Python number", a helper's review). Where a scale
    must be known while tracing (an ONF's DNF), a traced one is refused by name."""
    r = np.random.default_rng(4)
    q, k, v, g = (jnp.asarray(r.standard_normal(s)) for s in ((2, 7, 4, 8), (2, 9, 2, 8), (2, 9, 2, 8), (2, 7, 4, 8)))
    f = jax.jit(lambda q, k, v, s: moajax.dot_product_attention(q, k, v, scale=s, is_causal=True))
    want = R.mha_variants(q, k, v, scale=0.3, is_causal=True)
    assert rel_err(f(q, k, v, jnp.float64(0.3)), want) <= 1e-12
    assert rel_err(moajax.dot_product_attention(q, k, v, scale=1 / jnp.sqrt(64.0)), R.mha_variants(q, k, v, scale=0.125)) <= 1e-12
    inside = jax.jit(lambda q, k, v: moajax.dot_product_attention(q, k, v, scale=1 / jnp.sqrt(64.0)))
    assert rel_err(inside(q, k, v), R.mha_variants(q, k, v, scale=0.125)) <= 1e-12
    ds = jax.grad(lambda s: jnp.sum(f(q, k, v, s) * g))(0.3)
    loss = lambda s: np.sum(R.mha_variants(q, k, v, scale=s, is_causal=True) * np.asarray(g))  # noqa: E731
    eps = 1e-6
    assert abs(float(ds) - (loss(0.3 + eps) - loss(0.3 - eps)) / (2 * eps)) <= 1e-7 * abs(float(ds))
    with pytest.raises(TypeError, match="attention_onf: scale must be known while tracing"):
        jax.jit(lambda s: moajax.attention_onf(q, k, v, scale=s).dnf.name)(0.3)


def test_python_values_for_bias_mask_and_flags_as_jax_nn_takes_them():
    """A Python float bias, a mask of nested lists and a concrete jnp bool is_causal, as jax.nn
    takes them (each was refused: "must be an array", "must be a static bool"): the same
    result as the arrays they stand for, float64."""
    r = np.random.default_rng(8)
    q, k, v = (jnp.asarray(r.standard_normal((1, 3, 2, 4))) for _ in range(3))
    mask = [[True, False, True], [True, True, False], [False, True, True]]
    got = moajax.dot_product_attention(q, k, v, bias=0.5, mask=mask, is_causal=jnp.bool_(True))
    want = moajax.dot_product_attention(q, k, v, bias=jnp.full((3, 3), 0.5), mask=jnp.asarray(mask), is_causal=True)
    assert rel_err(got, want) <= 1e-12


def test_an_empty_batch_query_or_key_axis_gives_jax_nns_result():
    """B = 0, T = 0 or S = 0, as jax.nn takes them (they were refused): an empty Out, or zeros
    where there is no key; gradients of the same shapes, zeros; the residual empty, and
    refused over no keys (the log-sum-exp of no scores)."""
    q, k, v = qkv()
    for a, b, c in ((q[:0], k[:0], v[:0]), (q[:, :0], k, v), (q, k[:, :0], v[:, :0])):
        want = jax.nn.dot_product_attention(a, b, c)
        got = moajax.dot_product_attention(a, b, c)
        assert got.shape == want.shape and got.dtype == want.dtype and np.array_equal(got, want)
        grads = jax.grad(lambda *x: jnp.sum(moajax.dot_product_attention(*x)), argnums=(0, 1, 2))(a, b, c)
        assert all(g.shape == x.shape and not np.any(g) for g, x in zip(grads, (a, b, c)))
    out, lse = moajax.dot_product_attention(q[:, :0], k, v, return_residual=True)
    assert out.shape == (2, 0, 4, 72) and lse.shape == (2, 0, 4)
    with pytest.raises(ValueError, match="return_residual with no keys"):
        moajax.dot_product_attention(q, k[:, :0], v[:, :0], return_residual=True)


def test_attention_onf_and_preset_name_bad_arguments():
    """attention_onf checks its arguments as dot_product_attention does (it skipped them: a
    rank-2 query gave an IndexError, an int query a MoATypeError, a float mask passed); Preset.of
    refuses what no field takes (a bad knob passed, to fail as Knobs.__init__'s TypeError at the
    call; tiles="x" failed as "'str' object has no attribute 'items'")."""
    q, k, v = qkv()
    with pytest.raises(ValueError, match="attention_onf: query must have rank 4"):
        moajax.attention_onf(q[0, 0], k[0, 0], v[0, 0])
    with pytest.raises(TypeError, match="attention_onf: query dtype must be one of"):
        moajax.attention_onf(*(x.astype(jnp.int32) for x in (q, k, v)))
    with pytest.raises(TypeError, match="attention_onf: mask must be a bool array"):
        moajax.attention_onf(q, k, v, mask=jnp.ones((2, 4, 9, 11), jnp.float32))
    with pytest.raises(TypeError, match="attention_onf: preset must be a moajax.Preset"):
        moajax.attention_onf(q, k, v, preset="x")
    with pytest.raises(ValueError, match="attention_onf: scale must be finite"):
        moajax.attention_onf(q, k, v, scale=float("inf"))
    for field in ("tiles", "gamma", "store", "roles", "split"):
        with pytest.raises(TypeError, match=f"Preset: {field} must be a dict"):
            moajax.Preset.of(**{field: "x"})
    with pytest.raises(TypeError, match=r"Preset: unknown option\(s\) \['bogus'\]; the knobs are .*num_warps"):
        moajax.Preset.of(bogus=1)


def test_grad_runs_the_derived_adjoint_with_linear_temp_memory():
    # the gradient is the compiled adjoint kernel (moajax.adjoint), never autodiff of the
    # forward's loops (which keeps every score: temp ∝ S²). Quadrupling S must grow jit(grad)'s
    # temp memory about 4× (tiles of rows × 256 keys), far from the 16× of stored scores.
    def temp(S):
        q = jax.ShapeDtypeStruct((1, S, 2, 32), jnp.float32)
        loss = lambda q, k, v: moajax.dot_product_attention(q, k, v).sum()
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, q, q).compile().memory_analysis().temp_size_in_bytes

    small, large = temp(1024), temp(4096)
    assert large < 8 * small and large < 2 * 4096 * 4096 * 4 / 4


def test_mha_row_statistics_come_out_of_the_omega_levels():
    # the softmax's max and denominator live inside Ω bodies (per batch, kv head, group); they
    # are lifted out whole (moa.lift_from_omega) and match an independent float64 computation
    from moajax.kernels.attention import mha_kernel

    q, k, v = qkv(B=2, T=5, S=11, N=4, K=2, H=8, E=8, dtype=np.float64)
    kern = mha_kernel(None, None, True)
    _, stats = kern.row_statistics((kern.expression(q, k, v),))
    assert [x.shape for x in stats] == [(2, 2, 2, 5), (2, 2, 2, 5)]  # [b kv g t]
    # saved in the layout of the output rows that compute them, [b t n] (n = 2·kv + g): the
    # forward's one online pass gives Out, the max and the sum (moajax.identities.Layout)
    assert [lay.dims for lay in kern.with_row_statistics().layouts(q, k, v)] == [("b", "t", "n")] * 2
    saved_max, saved_den, out = kern.with_row_statistics().reference(q, k, v)
    s = np.einsum("btnh,bsnh->bnts", np.asarray(q), np.repeat(np.asarray(k), 2, axis=2)) / np.sqrt(8)
    m = s.max(-1)
    den = np.exp(s - m[..., None]).sum(-1)
    assert rel_err(np.asarray(saved_max), m.transpose(0, 2, 1)) <= F64
    assert rel_err(np.asarray(saved_den), den.transpose(0, 2, 1)) <= F64
    assert rel_err(out, R.mha(*(np.asarray(a) for a in (q, k, v)))) <= F64


def test_an_unbatched_query_takes_a_4d_bias_and_mask():
    """jax.nn's bias and mask are 4-D ("must be 4D", broadcast to [B, N, T, S]) whatever the
    query's rank: with an unbatched query [T, N, H] a [1, N, T, S] bias and mask are the batch
    of one (before, refused: "bias has rank 4 > 3"). The same as the batched call, float64;
    the bias' gradient keeps its shape."""
    q, k, v = qkv(B=1, T=6, S=10, N=4, K=2, H=8, E=8, dtype=np.float64)
    bias = jnp.asarray(r.standard_normal((1, 4, 6, 10)))
    mask = jnp.asarray(r.standard_normal((1, 4, 6, 10)) > -1.0)
    got = moajax.dot_product_attention(q[0], k[0], v[0], bias, mask)
    assert got.shape == (6, 4, 8)
    assert rel_err(got, moajax.dot_product_attention(q, k, v, bias, mask)[0]) <= F64
    g = jax.grad(lambda b: jnp.sum(moajax.dot_product_attention(q[0], k[0], v[0], b, mask) ** 2))(bias)
    want = jax.grad(lambda b: jnp.sum(moajax.dot_product_attention(q, k, v, b, mask) ** 2))(bias)
    assert g.shape == bias.shape and rel_err(g, want) <= F64
