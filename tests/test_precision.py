"""A GPU's float32 dots follow ``jax.default_matmul_precision``, as XLA's and jax.nn's do: TF32
under JAX's default, IEEE float32 under "highest" (``compat.default_dot_precision``,
``Knobs.dot_precision``). The config is read when a call is traced; what JAX traces after it —
the gradient's and tangent's kernels, the per-device kernels of a sharded call, the ring's
backward, a vmap's batched kernel across a jit — takes the call's precision, as the transpose
of a dot_general takes its primal's. On this CPU the dots are float32 either way: the tests
read the precision of the dot_generals in the Pallas kernels' jaxprs (interpret mode), or the
knob of the derived GPU ONFs."""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moajax
from helpers import rel_err, walk_eqns
from moajax import compat, machines, runtime, schedule
from moajax.kernels.attention import mha_dnf


def _kernel_precisions(jaxpr) -> dict:
    """{Pallas kernel name: the precisions of its dot_generals} in a jaxpr."""
    out: dict = {}
    for e, _ in walk_eqns(jaxpr.jaxpr):
        if e.primitive.name == "pallas_call":
            dots = {str(d.params["precision"]) for d, _ in walk_eqns(e.params["jaxpr"]) if d.primitive.name == "dot_general"}
            out.setdefault(str(e.params.get("name")), set()).update(dots)
    return out


def _draw(*shapes, seed=0):
    r = np.random.default_rng(seed)
    return [jnp.asarray(r.standard_normal(s), jnp.float32) for s in shapes]


@pytest.mark.parametrize("config, want", [
    (None, "tensorfloat32"), ("default", "tensorfloat32"), ("bfloat16", "tensorfloat32"), ("high", "tensorfloat32"),
    ("tensorfloat32", "tensorfloat32"), ("TF32_TF32_F32", "tensorfloat32"), ("BF16_BF16_F32", "tensorfloat32"),
    ("highest", "highest"), ("float32", "highest"), ("F32_F32_F32", "highest"), ("TF32_TF32_F32_X3", "highest"),
    ("BF16_BF16_F32_X6", "highest"), ("ANY_F8_ANY_F8_F32", "highest")])
def test_jaxs_matmul_precision_config_as_a_dot_precision(config, want):
    # JAX's default (None) is TF32 for a GPU's float32 dots, as XLA's; the multi-pass
    # algorithms are near float32 and are not rounded down to one TF32 pass
    with jax.default_matmul_precision(config):
        assert compat.default_dot_precision() == want


def test_a_gpus_float32_dots_follow_jax_default_matmul_precision():
    """jax.nn's float32 dots on a GPU take TF32 unless ``jax.default_matmul_precision`` says
    "highest" (XLA's default); a GPU ONF of a float32 kernel derived without a Preset's
    ``dot_precision`` follows the same switch (``Knobs.dot_precision``), each setting its own
    derivation (never the other's cached ONF). A Preset's choice wins over the config; 16-bit
    and float64 kernels, and a CPU's, keep the knob's default (their dots are 16-bit, float64,
    or XLA:CPU's float32 whatever it says)."""
    from moajax.schedule import Preset

    a100, cpu = machines.load("delta-a100"), machines.load("anvil-epyc-7543")
    with compat.enable_x64_context(True):
        dnfs = {dt: mha_dnf((1, 256, 2, 64), (1, 256, 2, 64), (1, 256, 2, 64), np.dtype(dt))
                for dt in ("float32", "bfloat16", "float64")}
    prec = lambda dt, m=a100, pre=None: schedule.derive(dnfs[dt], m, pre).knobs.dot_precision  # noqa: E731
    assert prec("float32") == "tensorfloat32"
    with jax.default_matmul_precision("highest"):
        assert prec("float32") == "highest"
        assert prec("float32", pre=Preset.of(dot_precision="tensorfloat32")) == "tensorfloat32"
    with jax.default_matmul_precision("float32"):
        assert prec("float32") == "highest"
    assert prec("float32") == "tensorfloat32"  # the default's derivation again, not the last one
    assert prec("float32", pre=Preset.of(dot_precision="highest")) == "highest"
    assert prec("bfloat16") == prec("float64") == prec("float32", cpu) == "highest"
    with jax.default_matmul_precision("highest"):  # the tilings are the same: only the dots change
        ieee = schedule.derive(dnfs["float32"], a100)
    tf32 = schedule.derive(dnfs["float32"], a100)
    assert tf32.axes == ieee.axes and dataclasses.replace(tf32.knobs, dot_precision="highest") == ieee.knobs


def test_a_call_follows_the_matmul_precision_it_is_traced_under():
    """The compiled call (``Kernel.compiled``, cached per shapes and options) is keyed by the
    precision config too: the same call traced under jax.default_matmul_precision("highest")
    runs IEEE float32 dots (Precision.HIGHEST in the Pallas kernel's jaxpr), under JAX's
    default TF32 ones (Precision.DEFAULT: Triton's tf32 on a GPU; float32 on this CPU, so the
    two agree here to float32 rounding)."""
    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.standard_normal((1, 64, 2, 16)), jnp.float32) for _ in range(3))

    def precisions():
        f = lambda a, b, c: moajax.dot_product_attention(a, b, c, implementation="pallas_interpret")  # noqa: E731
        jaxpr = jax.make_jaxpr(f)(q, k, v)
        return {str(e.params["precision"]) for e, _ in walk_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"}

    default = precisions()
    with jax.default_matmul_precision("highest"):
        highest = precisions()
        out_ieee = moajax.dot_product_attention(q, k, v, implementation="pallas_interpret")
    assert default and all("DEFAULT" in p for p in default), default
    assert highest and all("HIGHEST" in p for p in highest), highest
    out = moajax.dot_product_attention(q, k, v, implementation="pallas_interpret")
    assert rel_err(out, out_ieee) <= 1e-6  # float32 on this CPU either way


def _under(config):
    return jax.default_matmul_precision(config) if config else contextlib.nullcontext()


@pytest.mark.parametrize("config", [None, "highest"])
def test_a_gradient_takes_the_matmul_precision_of_its_forward(config):
    """jax.grad traces the backward after the forward, outside a ``with
    jax.default_matmul_precision(...)`` block the loss calls attention in: the saving forward
    and the backward kernels still take the precision of the call (as a dot_general's
    transpose takes its primal's), every dot of the Pallas kernels HIGHEST under "highest",
    DEFAULT (TF32 on a GPU) under JAX's default; through a jit boundary too."""
    q, k, v = _draw(*[(1, 64, 2, 16)] * 3, seed=1)

    def loss(a, b, c):
        with _under(config):
            out = moajax.dot_product_attention(a, b, c, implementation="pallas_interpret")
        return jnp.sum(out * out)

    want = "HIGHEST" if config == "highest" else "DEFAULT"
    for f in (loss, jax.jit(loss)):
        kernels = _kernel_precisions(jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(q, k, v))
        for part in ("saving", "d_query", "d_key"):  # (and at this size, a staged kernel of what dQ and dK share)
            assert any(n.endswith(part) or f"{part}_" in n for n in kernels), kernels
        assert all(dots and all(want in p for p in dots) for dots in kernels.values()), kernels


def test_a_vmap_across_a_jit_and_a_tangent_take_the_calls_precision():
    """The batched kernel of ``jax.vmap`` of a jitted function (its rule traced when the vmap
    is, outside the function's block) and the tangent kernel of ``jax.jvp`` take the
    precision the call was made under."""
    q, k, v = _draw(*[(2, 1, 64, 2, 16)] * 3, seed=2)

    def g(a, b, c):
        with jax.default_matmul_precision("highest"):
            return moajax.dot_product_attention(a, b, c, implementation="pallas_interpret")

    for f, args in ((jax.vmap(jax.jit(g)), (q, k, v)),
                    (lambda *a: jax.jvp(jax.jit(g), a[:3], a[3:]), (q[0], k[0], v[0], q[0], k[0], v[0]))):
        kernels = _kernel_precisions(jax.make_jaxpr(f)(*args))
        assert kernels and all(dots and all("HIGHEST" in p for p in dots) for dots in kernels.values()), kernels


def test_a_sharded_calls_device_kernels_take_its_precision(monkeypatch):
    """XLA's partitioner asks for each device's kernel when it compiles, outside the block
    the call was made in: the per-device ONFs (a batch split over 2 devices) are derived under
    the call's precision all the same."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from moajax import runtime

    seen = []
    schedules = runtime.schedules

    def spy(dnf, onf_key=None, path="pallas"):
        cpu, gpu = schedules(dnf, onf_key, path)
        seen.append((dnf.inputs[0].shape, [o.knobs.dot_precision for o in (gpu if isinstance(gpu, tuple) else (gpu,))]))
        return cpu, gpu

    monkeypatch.setattr(runtime, "schedules", spy)
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("data",)), PartitionSpec("data"))
    q, k, v = (jax.device_put(x, sharding) for x in _draw(*[(2, 32, 2, 16)] * 3, seed=3))

    def g(a, b, c):
        with jax.default_matmul_precision("highest"):
            return moajax.dot_product_attention(a, b, c, implementation="pallas_interpret")

    jax.jit(g).lower(q, k, v).compile()
    blocks = [knobs for shape, knobs in seen if shape[0] == 1]
    assert blocks and all(kn == ["highest"] for kn in blocks), seen


def test_the_rings_backward_takes_the_calls_precision():
    """Ring attention over 2 devices (``moajax.ring``), differentiated outside the block its
    call was made in: every kernel of its forward and backward has HIGHEST dots."""
    from jax.sharding import Mesh

    from moajax.ring import ring_attention

    mesh = Mesh(np.array(jax.devices()[:2]), ("seq",))
    q, k, v = _draw(*[(1, 64, 2, 16)] * 3, seed=4)

    def loss(a, b, c):
        with jax.default_matmul_precision("highest"):
            o = ring_attention(a, b, c, mesh=mesh, axis_name="seq", implementation="pallas_interpret")
        return jnp.sum(o ** 2)

    kernels = _kernel_precisions(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v))
    assert any("adjoint" in n for n in kernels), kernels
    assert all(dots and all("HIGHEST" in p for p in dots) for dots in kernels.values()), kernels


def test_xla_on_a_gpu_follows_the_matmul_precision_too(monkeypatch):
    """implementation="xla" in a process on a GPU runs the XLA ONF there: its float32 dots
    follow jax.default_matmul_precision as the GPU's own ONF's do (TF32 under JAX's default,
    as XLA's einsum in jax.nn); on a machine without a GPU its knob stays the default (XLA:CPU's
    float32 dots are float32 whatever it says)."""
    from moajax import runtime

    with compat.enable_x64_context(True):
        dnf = mha_dnf((1, 64, 2, 16), (1, 64, 2, 16), (1, 64, 2, 16), np.dtype("float32"))
    runtime.schedules.cache_clear()
    assert runtime.schedules(dnf)[0].knobs.dot_precision == "highest"  # no GPU here
    monkeypatch.setattr(runtime, "has_gpu", lambda: True)
    runtime.schedules.cache_clear()
    try:
        cpu, gpu = runtime.schedules(dnf)
        assert cpu.knobs.dot_precision == gpu.knobs.dot_precision == "tensorfloat32"
        with jax.default_matmul_precision("highest"):
            cpu, gpu = runtime.schedules(dnf)
        assert cpu.knobs.dot_precision == gpu.knobs.dot_precision == "highest"
        cpu, _ = runtime.schedules(dnf, schedule.Preset.of(dot_precision="highest"))  # a Preset's choice wins
        assert cpu.knobs.dot_precision == "highest"
    finally:
        runtime.schedules.cache_clear()


@pytest.mark.parametrize("kernel", ["swiglu", "rmsnorm"])
def test_a_16_bit_calls_float32_kernels_take_the_config_too(kernel):
    """A bfloat16 call's adjoint staging float32 intermediates (SwiGLU's dhidden, gate and up;
    RMSNorm's row sums) in a kernel of their own (the owner plan's ``staged_parts``; at this
    size the A100's default recomputes them instead, which the cost model times faster): its
    outputs are float32, so its dots follow the config (TF32 under JAX's default), as a float32
    call's. They contract only the call's bfloat16 inputs, which TF32 holds exactly (10 mantissa
    bits to bfloat16's 7), accumulated in float32 either way: nothing is lost to IEEE. The
    kernels with 16-bit outputs keep the knob's default (their dots are 16-bit:
    ``Knobs.lowp_dots``)."""
    from moajax.kernels.mlp import swiglu
    from moajax.kernels.norm import rmsnorm

    S = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)  # noqa: E731
    kern, specs = ((swiglu, [S(256, 64), S(64, 128), S(64, 128), S(128, 64)]) if kernel == "swiglu"
                   else (rmsnorm, [S(256, 64), S(64)]))
    dnf = kern.adjoint(*specs).dnf(*specs, S(256, 64))
    a100 = machines.load("delta-a100")
    for config, want in ((None, "tensorfloat32"), ("highest", "highest")):
        with _under(config):
            plan = [schedule.derive(d, a100) for d in schedule.staged_parts(dnf, schedule.plan_groups(dnf, "owner", a100))]
        f32 = [o for o in plan if all(x.dtype == np.float32 for x in o.dnf.outputs)]
        assert [o.dnf.name for o in f32] == [f"{kernel}_adjoint_shared"], [o.dnf.name for o in plan]
        assert f32[0].knobs.dot_precision == want
        assert {np.dtype(i.dtype) for i in f32[0].dnf.inputs} == {np.dtype(jnp.bfloat16)}
        assert all(o.knobs.dot_precision == "highest" and o.knobs.lowp_dots for o in plan if o not in f32)


def _alibi_case(monkeypatch, slopes_dtype):
    """bfloat16 GQA q [1 30 8 8], k, v [1 2 4 8], float32 loss weights w, ALiBi slopes (8) of
    ``slopes_dtype``; the H200's schedules for the Pallas paths (interpret mode)."""
    from moajax import machines, runtime

    h200 = machines.load("h200")
    monkeypatch.setattr(runtime, "gpu_machine", lambda path="pallas": h200)
    runtime.schedules.cache_clear()
    r = np.random.default_rng(1)
    q = jnp.asarray(r.normal(size=(1, 30, 8, 8)), jnp.bfloat16)
    k, v = (jnp.asarray(r.normal(size=(1, 2, 4, 8)), jnp.bfloat16) for _ in range(2))
    w = jnp.asarray(r.normal(size=(1, 30, 8, 8)), jnp.float32)
    return q, k, v, w, jnp.asarray(r.uniform(0.05, 0.5, size=8), slopes_dtype)


def test_a_bfloat16_gpu_forward_rounds_no_scaled_query_so_a_tables_gradient_holds(monkeypatch):
    """bfloat16 GQA with ALiBi slopes (float32, closed over) and query lengths, H = 8 (scale
    1/√8, not a power of two), S = 2: the slopes' gradient sums dS over rows whose two keys
    nearly cancel, so it shows any mismatch between the forward's row statistics and the
    probabilities the backward recomputes. The H200's 16-bit forward multiplied Q by the
    scale and rounded it to bfloat16 for its dot, while the slopes' float32 kernel recomputed
    the scores unrounded: 12 % off the float64 gradient (Pallas interpret), where XLA's float32
    path is 0.35 % off. The dots now take Q and K as read (``rewrites.factor_out_of_dots``).
    Bound 2e-2 of the largest entry: bfloat16 operands and Out (the XLA path's 3.5e-3)."""
    import moajax
    from moajax import runtime
    from moajax.schedule import Preset

    q, k, v, w, slopes = _alibi_case(monkeypatch, jnp.float32)
    lengths = jnp.asarray([17], jnp.int32)

    def loss(slopes, q, k, v, impl):
        mod = lambda s, b, h, i, j: s - slopes[h] * jnp.abs(i - j)  # noqa: E731
        o = moajax.dot_product_attention(q, k, v, score_mod=mod, query_seq_lengths=lengths, implementation=impl,
                                         onf=Preset.of(residuals="save"))
        return jnp.sum(o.astype(w.dtype) * w)

    try:
        want = jax.grad(loss)(*(x.astype(jnp.float64) for x in (slopes, q, k, v)), "xla")
        got = jax.jit(jax.grad(loss), static_argnums=4)(slopes, q, k, v, "pallas_interpret")
        assert float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))) <= 2e-2
    finally:
        runtime.schedules.cache_clear()


@pytest.mark.parametrize("residuals", ["save", "recompute"])
def test_a_bfloat16_tables_gradient_is_summed_in_float32_and_rounded_once(residuals, monkeypatch):
    """bfloat16 ALiBi slopes (the case above, with and without query lengths): the slopes'
    gradient Σ over rows and keys of dS × |i − j| is the difference of two sums that nearly
    cancel (through each row's numerator and through its sum). It is now carried in float32
    and rounded to bfloat16 once (``adjoint``: a cotangent keeps the widest dtype that
    reached it); a GPU kernel's multiply-and-sum takes its float32 factor unrounded (no tensor
    core takes it); after a GPU's forward the gradient recomputes Δ (``identities``). Before:
    the two sums each rounded to bfloat16 apart, 1.2e-1 to 4.9e-1 off float64 under "save",
    and 3.5e-2 to 1.2e-1 on the Pallas schedule under "none" (now "recompute")
    (bench/results/table_grad_precision.md). Bound 2e-2 of the largest entry, as above."""
    import moajax
    from moajax import runtime
    from moajax.schedule import Preset

    q, k, v, w, slopes = _alibi_case(monkeypatch, jnp.bfloat16)

    def loss(slopes, q, k, v, impl, lengths):
        mod = lambda s, b, h, i, j: s - slopes[h] * jnp.abs(i - j)  # noqa: E731
        o = moajax.dot_product_attention(q, k, v, score_mod=mod, query_seq_lengths=lengths, implementation=impl,
                                         onf=Preset.of(residuals=residuals))
        return jnp.sum(o.astype(w.dtype) * w)

    try:
        for lengths in (None, jnp.asarray([17], jnp.int32)):
            want = jax.grad(loss)(*(x.astype(jnp.float64) for x in (slopes, q, k, v)), "xla", lengths)
            for impl in ("pallas_interpret", "xla"):
                got = jax.jit(jax.grad(loss), static_argnums=4)(slopes, q, k, v, impl, lengths)
                assert got.dtype == jnp.bfloat16
                err = float(jnp.max(jnp.abs(got.astype(jnp.float64) - want)) / jnp.max(jnp.abs(want)))
                assert err <= 2e-2, (impl, lengths, err)
    finally:
        runtime.schedules.cache_clear()


def test_tf32_operands_are_cut_as_a_tensor_core_takes_them():
    """``lower._tf32``: TF32 keeps float32's exponent and 10 of its 23 mantissa bits —
    "truncated" drops the other 13 (a tensor core given float32 registers), "rounded" rounds
    to nearest with ties away from zero (PTX's cvt.rna.tf32.f32), carrying into the exponent."""
    import importlib

    tf32 = importlib.import_module("pallas_kernels.lower")._tf32
    u = 2.0 ** -10  # TF32's ulp at 1
    x = np.asarray([1 + u / 2, 1 + u / 2 + 2 ** -20, -(1 + 0.75 * u), 2 - 2 ** -23, 3.0, 1 + u / 4], np.float32)
    cut = {how: np.asarray(tf32(jnp.asarray(x), how)) for how in ("truncated", "rounded")}
    np.testing.assert_array_equal(cut["truncated"], np.asarray([1, 1, -1, 2 - u, 3, 1], np.float32))
    np.testing.assert_array_equal(cut["rounded"], np.asarray([1 + u, 1 + u, -(1 + u), 2, 3, 1], np.float32))
    with pytest.raises(ValueError, match="interpret_tf32"):
        tf32(jnp.asarray(x), "nearest")


@moajax.kernel(example=dict(n=32, d=32, f=32), register=False)
def _matmul(x: "n d", w: "d f"):
    """x +.× W: one tl.dot of two 32 × 32 tiles."""
    from moajax import moa

    return moa.dot(x, w)


@pytest.mark.parametrize("how", ["truncated", "rounded"])
def test_interpret_mode_can_take_a_gpus_tf32_operands(how, monkeypatch):
    """With ``PallasBackend.interpret_tf32`` set, interpret mode's float32 dots under TF32 take
    their operands cut as a GPU's tensor cores do: x +.× W then equals the float64 product of
    the cut operands (to float32's sums over 32 terms, 1e-6) and is TF32's 2⁻¹¹ or so off the
    exact one; under "highest" (IEEE float32 dots) or unset, nothing is cut."""
    import importlib

    lower = importlib.import_module("pallas_kernels.lower")  # (the module: its function's name shadows it)
    x, w = _draw((32, 32), (32, 32), seed=3)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    cut = np.asarray(lower._tf32(x, how), np.float64) @ np.asarray(lower._tf32(w, how), np.float64)

    def run():  # (read when a kernel is traced: what earlier calls traced is forgotten)
        jax.clear_caches()
        runtime.lowered.cache_clear()
        return _matmul(x, w, implementation="pallas_interpret")

    assert rel_err(run(), exact) <= 1e-6  # unset: whole operands
    monkeypatch.setattr(lower.PallasBackend, "interpret_tf32", how)
    got = run()
    assert rel_err(got, cut) <= 1e-6
    assert rel_err(got, exact) >= 1e-5  # (TF32's cut: up to 2⁻¹⁰ of an operand truncated, 2⁻¹¹ rounded)
    with jax.default_matmul_precision("highest"):
        assert rel_err(run(), exact) <= 1e-6
    monkeypatch.undo()
    run()  # (nothing traced with the cut left behind)
