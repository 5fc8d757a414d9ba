"""On this CPU-only machine, every Pallas kernel lowers for CUDA and emits a Triton kernel;
inside one jitted function the CPU lowering runs XLA and the CUDA lowering runs Pallas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moajax
import pallas_kernels
from moajax import compat, machines, schedule
from moajax import rewrites as W
from moajax.ptx import triton_kernels
from moajax.kernels import attention, block, decode, mha, rmsnorm, swiglu
from moajax.kernels.attention import mha_dnf

A100 = machines.load("delta-a100")


def structs(dnf):
    return [jax.ShapeDtypeStruct(i.shape, i.dtype) for i in dnf.inputs]


@pytest.mark.parametrize("kern", [attention, decode, rmsnorm, swiglu, mha, block], ids=lambda k: k.name)
def test_seed_kernels_lower_to_triton(kern):
    dnf = kern.dnf()
    onf = schedule.derive(dnf, A100)
    fn = pallas_kernels.lower(onf)
    ks = triton_kernels(fn, *structs(dnf))
    # one kernel for the outputs, one before it per stage placed in memory (the block's K and
    # V projections: computed once, read by every query-row program)
    memory = [st for st in onf.program.stages if st.place == "memory"]
    assert len(ks) == 1 + len(memory) and all(k.name.startswith("moajax_") for k in ks)
    assert ks[0].ir[:4] == b"ML\xefR"  # MLIR bytecode


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("variant", ["plain", "causal", "bias_mask", "split_k", "passes"])
def test_attention_variants_lower_to_triton(dtype, variant):
    with compat.enable_x64_context(dtype == "float64"):
        dt = np.dtype(dtype)
        kw = {}
        if variant == "causal":
            kw = dict(is_causal=True)
        if variant == "bias_mask":
            kw = dict(bias_shape=(1, 4, 100, 130), bias_dtype=dt, mask_shape=(2, 1, 100, 130))
        dnf = mha_dnf((2, 100, 4, 72), (2, 130, 2, 72), (2, 130, 2, 72), dt, **kw)
        preset = schedule.Preset.of(carry="passes") if variant == "passes" else None
        onf = schedule.derive(dnf, A100, preset)
        n_kernels = 1
        if variant == "split_k":
            onf = W.split_k(onf, "s", 3)
            n_kernels = 2  # the partials, then the combine
        ks = triton_kernels(pallas_kernels.lower(onf), *structs(dnf))
        assert len(ks) == n_kernels
        assert all(k.num_warps == onf.knobs.num_warps and k.num_stages == onf.knobs.num_stages for k in ks)


def test_one_call_lowers_per_platform():
    q = jax.ShapeDtypeStruct((1, 128, 4, 64), jnp.float32)
    f = jax.jit(moajax.dot_product_attention)
    cuda = compat.trace_lower(f, q, q, q).as_text()  # (on JAX ≥ 0.11, for an abstract GPU)
    cpu = f.trace(q, q, q).lower(lowering_platforms=("cpu",)).as_text()
    assert "__gpu$xla.gpu.triton" in cuda
    assert "__gpu$xla.gpu.triton" not in cpu and "stablehlo.dot_general" in cpu


def test_rms_norm_over_a_wide_row_lowers_to_a_triton_kernel():
    # d = 4096 in float32 (Llama's width): no GPU ONF fitted before, and the CUDA lowering
    # carried the CPU's XLA loops with a RuntimeWarning saying so
    import warnings

    x, w = jax.ShapeDtypeStruct((64, 4096), jnp.float32), jax.ShapeDtypeStruct((4096,), jnp.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        ks = triton_kernels(lambda x, w: moajax.rms_norm(x, w), x, w)
    assert [k.name.startswith("moajax_rmsnorm") for k in ks] == [True]


def test_vmap_adds_a_grid_axis_on_cuda():
    f = lambda a, b, c: moajax.dot_product_attention(a, b, c, implementation="pallas")
    q1 = jax.ShapeDtypeStruct((1, 64, 2, 32), jnp.float32)
    (k1,) = triton_kernels(f, q1, q1, q1)
    q3 = jax.ShapeDtypeStruct((3, 1, 64, 2, 32), jnp.float32)
    (k3,) = triton_kernels(jax.vmap(f), q3, q3, q3)
    # the batched kernel (the definition under Ω over the vmap axis): its programs are the
    # unbatched kernel's, once per batch index — a grid axis, not a loop
    assert np.prod(k3.grid) == 3 * np.prod(k1.grid)


def test_value_and_grad_lowers_for_cuda():
    # jit(value_and_grad) of the one user call, lowered for CUDA on this CPU-only machine: the
    # value comes from a Pallas forward kernel, the cotangents from the Pallas kernels of the
    # adjoint derived in the algebra (dQ, dK with its row statistic Δ placed in memory, dV) —
    # never from autodiff of the forward's loops
    q = jnp.ones((2, 64, 4, 64), jnp.bfloat16)
    f = jax.value_and_grad(
        lambda q, k, v: moajax.dot_product_attention(q, k, v, is_causal=True).astype(jnp.float32).sum(),
        argnums=(0, 1, 2))
    names = [k.name for k in triton_kernels(f, q, q, q)]
    assert names[0].startswith("moajax_mha") and "_adjoint" not in names[0]
    assert any("_adjoint" in n for n in names)  # the backward: Pallas kernels of the adjoint


def test_holding_nothing_lowers_the_rerun_saving_forward_for_cuda():
    # residuals "none": jax.grad's backward reruns the saving forward (one Pallas kernel) and
    # runs the two kernels of the adjoint reading what it saved; "recompute"'s backward is the
    # five kernels of the adjoint recomputing Δ, the max and the sum itself
    q = jnp.ones((2, 64, 4, 64), jnp.bfloat16)

    def kernels(residuals):
        f = jax.grad(lambda q, k, v: moajax.dot_product_attention(
            q, k, v, is_causal=True, residuals=residuals).astype(jnp.float32).sum(), argnums=(0, 1, 2))
        return [k.name for k in triton_kernels(f, q, q, q)]

    none, recompute = kernels("none"), kernels("recompute")
    assert none[0].endswith("_saving") and all("_adjoint_saved" in n for n in none[1:]) and len(none) == 3, none
    assert all("_adjoint" in n and "_saved" not in n for n in recompute) and len(recompute) == 5, recompute


@pytest.mark.parametrize("kv_heads", [4, 2])  # multi-head, and GQA
def test_the_saving_forward_is_one_online_pass_and_one_pallas_kernel(kv_heads):
    # its statistics are saved in the layout of Out's rows (moajax.identities.Layout), so the
    # one online-softmax pass that computes Out also gives the max and the sum the backward
    # reads, and the forward of jax.grad is one Pallas kernel, like the plain forward
    from moajax import machines, schedule
    from moajax.kernels.attention import mha_kernel
    from moajax.onf import OnlineStage

    kern = mha_kernel(None, None, kv_heads != 4)
    specs = [jax.ShapeDtypeStruct((2, 64, 4, 32), jnp.bfloat16)] + [
        jax.ShapeDtypeStruct((2, 64, kv_heads, 32), jnp.bfloat16)] * 2
    saving = kern.with_row_statistics()
    dnf = saving.dnf(*specs)
    onf = schedule.derive(dnf, machines.load("delta-a100"))
    online = [st for st in onf.program.stages if isinstance(st, OnlineStage)]
    assert len(online) == 1 and {"saved0", "saved1"} <= set(online[0].defines)
    (k,) = triton_kernels(saving.compiled(*specs, implementation="pallas"), *specs)
    assert k.name.startswith("moajax_mha")


def test_the_dispatch_traces_the_cuda_branch_only_for_a_cuda_lowering():
    """compat.platform_dependent: the CPU branch runs (jitted, eager, vmapped: the batch rule
    vmaps both branches) without the CUDA branch ever being traced; a lowering for CUDA traces
    it and carries its value (×3 where the CPU branch has ×2)."""
    traced = []

    def cpu(x, y):
        return x * 2.0 + y, jnp.sum(x)

    def cuda(x, y):
        traced.append(x.shape)
        return x * 3.0 + y, jnp.sum(x)

    call = lambda x, y: compat.platform_dependent(x, y, cpu=cpu, cuda=cuda)  # noqa: E731
    x, y = jnp.arange(6.0).reshape(2, 3), jnp.ones(3)
    for out in (jax.jit(call)(x, y), call(x, y)):
        np.testing.assert_array_equal(out[0], x * 2.0 + y)
        assert float(out[1]) == 15.0
    batched = jax.vmap(call, in_axes=(0, None))(jnp.stack([x, -x]), y)
    np.testing.assert_array_equal(batched[0][1], -x * 2.0 + y)
    np.testing.assert_array_equal(batched[1], [15.0, -15.0])
    assert traced == []
    for fn, args, shape in ((call, (x, y), (2, 3)), (jax.vmap(call, in_axes=(0, None)), (jnp.stack([x, -x]), y), (2, 3))):
        text = compat.trace_lower(fn, *args).as_text()
        assert traced[-1] == shape and "3.000000e+00" in text and "2.000000e+00" not in text


def test_a_branch_with_effects_keeps_jaxs_platform_dependent():
    """The dispatch primitive declares no effects: a CPU branch with one (a callback) goes
    through lax.platform_dependent, and its callback still runs."""
    seen = []

    def cpu(x):
        jax.debug.callback(lambda v: seen.append(float(v[0])), x)
        return x * 2.0

    out = jax.jit(lambda x: compat.platform_dependent(x, cpu=cpu, cuda=lambda x: x * 3.0))(jnp.ones(3))
    jax.effects_barrier()
    np.testing.assert_array_equal(out, [2.0, 2.0, 2.0])
    assert seen == [1.0]
    assert "platform_index" in str(jax.make_jaxpr(lambda x: compat.platform_dependent(x, cpu=cpu, cuda=lambda x: x))(jnp.ones(3)))


@pytest.mark.parametrize("profile,vmapped,dtype", [("h200", False, "float32"), ("delta-a100", True, "bfloat16")],
                         ids=["h200-lengths", "a100-vmap-bf16"])
def test_causal_gradients_whose_tile_spans_fold_to_constants_lower_for_cuda(monkeypatch, profile, vmapped, dtype):
    """jit(grad) of causal attention, with query and key lengths under the H200 profile, and
    vmapped over a batch in bfloat16 under the A100's: the skipping spans of the adjoint's dQ
    kernel hold bounds that read no program id or length, and Pallas' Triton lowering of those
    folded-constant comparisons raised AssertionError ('i1', 'i32'). They are folded in NumPy
    now (``tiles.skipping``): every kernel lowers to Triton."""
    import dataclasses

    from moajax import runtime

    m = dataclasses.replace(machines.load(profile), spill_check=False)
    monkeypatch.setattr(runtime, "gpu_machine", lambda path="pallas": m)
    runtime.schedules.cache_clear()
    try:
        S = jax.ShapeDtypeStruct
        dt = jnp.dtype(dtype)
        if vmapped:
            f = jax.vmap(lambda q, k, v: moajax.dot_product_attention(q[None], k[None], v[None], is_causal=True)[0])
            args = (S((2, 256, 4, 32), dt), S((2, 256, 2, 32), dt), S((2, 256, 2, 32), dt))
        else:
            f = lambda q, k, v, ql, kl: moajax.dot_product_attention(  # noqa: E731
                q, k, v, is_causal=True, query_seq_lengths=ql, key_value_seq_lengths=kl)
            args = (S((2, 256, 4, 32), dt), S((2, 256, 2, 32), dt), S((2, 256, 2, 32), dt),
                    S((2,), jnp.int32), S((2,), jnp.int32))
        loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32))  # noqa: E731
        names = [k.name for k in triton_kernels(jax.grad(loss, argnums=(0, 1, 2)), *args)]
        assert any("adjoint_saved" in n and n.endswith("d_query") for n in names), names
    finally:
        runtime.schedules.cache_clear()


def test_score_mod_index_arithmetic_lowers_for_cuda(monkeypatch):
    """jit(grad) of GQA attention whose score_mod reads a slope per kv-head group, c[h // 2],
    and adds (i − j) % 3 (jnp's floor division and remainder: lax.div, lax.rem and sign in the
    kernels' index arithmetic) under the H200 profile: every kernel lowers to Triton, the
    slopes' gradient among them. A sign written as where(x > 0, 1, 0) − … failed there with
    AssertionError ('i1', 'i32'); lax.sign lowers."""
    import dataclasses

    from moajax import runtime

    m = dataclasses.replace(machines.load("h200"), spill_check=False)
    monkeypatch.setattr(runtime, "gpu_machine", lambda path="pallas": m)
    runtime.schedules.cache_clear()
    S = jax.ShapeDtypeStruct
    args = (S((1, 256, 4, 64), jnp.bfloat16), S((1, 256, 2, 64), jnp.bfloat16), S((1, 256, 2, 64), jnp.bfloat16),
            S((2,), jnp.float32))

    def loss(q, k, v, c):
        mod = lambda s, b, h, i, j: s + c[h // 2] * (j - i) + 0.1 * ((i - j) % 3)  # noqa: E731
        return jnp.sum(moajax.dot_product_attention(q, k, v, score_mod=mod).astype(jnp.float32))

    try:
        names = [k.name for k in triton_kernels(jax.grad(loss, argnums=(0, 1, 2, 3)), *args)]
        assert any(n.endswith("d_score_mod_const0") for n in names), names
    finally:
        runtime.schedules.cache_clear()


def test_minus_infinity_masks_lower_for_cuda(monkeypatch):
    """jit(grad) of attention masked by −∞ FlexAttention's way — a document mask, a score_mod
    comparing a closed-over int table at q_idx and kv_idx — causal, under the H200 profile:
    every kernel lowers to Triton with the select that maps −∞ to jax.nn's fill (an infinite
    constant and a test against it in the kernels), the adjoint's dQ among them."""
    import dataclasses

    from moajax import runtime

    m = dataclasses.replace(machines.load("h200"), spill_check=False)
    monkeypatch.setattr(runtime, "gpu_machine", lambda path="pallas": m)
    runtime.schedules.cache_clear()
    S = jax.ShapeDtypeStruct
    qkv = (S((1, 256, 4, 64), jnp.bfloat16), S((1, 256, 4, 64), jnp.bfloat16), S((1, 256, 4, 64), jnp.bfloat16))

    def documents(q, k, v, doc):
        mod = lambda s, b, h, i, j: jnp.where(doc[i] == doc[j], s, -jnp.inf)  # noqa: E731
        return jnp.sum(moajax.dot_product_attention(q, k, v, score_mod=mod, is_causal=True).astype(jnp.float32))

    try:
        names = [k.name for k in triton_kernels(jax.grad(documents, argnums=(0, 1, 2)), *qkv, S((256,), jnp.int32))]
        assert any("adjoint_saved" in n and "d_query" in n for n in names), names
    finally:
        runtime.schedules.cache_clear()


def test_a_table_gradient_with_lengths_over_three_batch_elements_lowers_for_cuda(monkeypatch):
    """jit(grad) of causal attention with a relative-position table and query lengths, B = 3,
    float64, under the A40 profile: the table gradient's kernel walks t inside its sum over the
    batch, and the span of that walk reads every batch element's length — in two windows of
    2 ([0, 2) and [1, 3): Triton's blocks are powers of two; one window of 3 raised "requires
    that all operations have array arguments and results whose size is a power of 2")."""
    import dataclasses

    from moajax import runtime

    m = dataclasses.replace(machines.load("delta-a40"), spill_check=False)
    monkeypatch.setattr(runtime, "gpu_machine", lambda path="pallas": m)
    S = jax.ShapeDtypeStruct
    with compat.enable_x64_context(True):
        f64 = jnp.dtype("float64")
        args = (S((3, 34, 2, 4), f64), S((3, 38, 2, 4), f64), S((3, 38, 2, 4), f64), S((7,), f64),
                S((3,), jnp.int32))

        def loss(q, k, v, table, ql):
            mod = lambda s, b, h, i, j: s + table[jnp.clip(i - j, -3, 3) + 3]  # noqa: E731
            return jnp.sum(moajax.dot_product_attention(q, k, v, score_mod=mod, is_causal=True, query_seq_lengths=ql))

        names = [k.name for k in triton_kernels(jax.grad(loss, argnums=(0, 1, 2, 3)), *args)]
    assert any(n.endswith("d_score_mod_const0") for n in names), names
