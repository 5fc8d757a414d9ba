"""``moajax.rms_norm`` and ``moajax.gated_mlp``: the RMSNorm and SwiGLU DSL kernels as JAX
functions over x [..., D], forward and gradients against the independent float64 references
(tests/references.py), on XLA and Pallas-interpret; jit, vmap, leading axes; bad input.

Tolerances: float64 rel ≤ 1e-12 forward and ≤ 1e-11 for gradients (sums of ≤ 24 terms in
another order than the reference: a few ulps); float32 rel ≤ 1e-5 (rounding of 6e-8 per op
over a row of ≤ 24 terms, two chained contractions for the MLP)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moajax
import references as R
from helpers import rel_err, walk_eqns

IMPLS = ["xla", "pallas_interpret"]
D, F = 12, 20


def _norm_args(dtype=np.float64, lead=(2, 3), seed=0):
    r = np.random.default_rng(seed)
    return (r.standard_normal(lead + (D,)).astype(dtype), (1 + 0.1 * r.standard_normal(D)).astype(dtype),
            r.standard_normal(lead + (D,)).astype(dtype))


def _mlp_args(dtype=np.float64, lead=(2, 3), seed=0):
    r = np.random.default_rng(seed)
    s = 1 / np.sqrt(D)
    return (r.standard_normal(lead + (D,)).astype(dtype), (s * r.standard_normal((D, F))).astype(dtype),
            (s * r.standard_normal((D, F))).astype(dtype), (s * r.standard_normal((F, D))).astype(dtype),
            r.standard_normal(lead + (D,)).astype(dtype))


def _flat(a):
    return np.reshape(a, (-1, np.shape(a)[-1]))


@pytest.mark.parametrize("impl", IMPLS)
def test_rms_norm_float64_forward_and_gradients(impl):
    x, w, g = _norm_args()
    f = lambda x, w: moajax.rms_norm(x, w, eps=1e-5, implementation=impl)  # noqa: E731
    got = jax.jit(f)(x, w)
    assert got.shape == x.shape
    assert rel_err(_flat(got), R.rmsnorm(_flat(x), w, eps=1e-5)) <= 1e-12
    dx, dw = jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w) * g), (0, 1)))(x, w)
    rdx, rdw = R.rmsnorm_backward(_flat(x), w, _flat(g), eps=1e-5)
    assert rel_err(_flat(dx), rdx) <= 1e-11 and rel_err(dw, rdw) <= 1e-11


@pytest.mark.parametrize("impl", IMPLS)
def test_gated_mlp_float64_forward_and_gradients(impl):
    x, wg, wu, wd, g = _mlp_args()
    f = lambda *a: moajax.gated_mlp(*a, implementation=impl)  # noqa: E731
    got = jax.jit(f)(x, wg, wu, wd)
    assert got.shape == x.shape
    assert rel_err(_flat(got), R.swiglu(_flat(x), wg, wu, wd)) <= 1e-12
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * g), (0, 1, 2, 3)))(x, wg, wu, wd)
    want = R.swiglu_backward(_flat(x), wg, wu, wd, _flat(g))
    for a, b in zip((_flat(grads[0]),) + tuple(grads[1:]), want):
        assert rel_err(a, b) <= 1e-11


@pytest.mark.parametrize("residuals", ["none", ("gate",)])
def test_gated_mlp_bfloat16_gradients_interpreted(residuals):
    """bfloat16 at tiles of 16 and more (T, D, F = 9, 25, 31: the weight gradients' dots are
    tl.dot-sized), interpreted on the CPU: the kernels' 16-bit × 16-bit → float32 dots once
    failed there ("Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32", a
    helper's fuzz). Against the float64 reference on the same rounded inputs, at 2⁻⁶: each
    stored bfloat16 value (U, V, G_H and the result) rounds at 2⁻⁹ relative, and a gradient
    chains four of them (a few ulps of bfloat16)."""
    r = np.random.default_rng(3)
    T_, D_, F_ = 9, 25, 31
    x, wg, wu, wd, g = (r.standard_normal(s) * c for s, c in (
        ((T_, D_), 1.0), ((D_, F_), D_ ** -0.5), ((D_, F_), D_ ** -0.5), ((F_, D_), F_ ** -0.5), ((T_, D_), 1.0)))
    x, wg, wu, wd, g = (jnp.asarray(a, jnp.bfloat16) for a in (x, wg, wu, wd, g))
    f = lambda *a: moajax.gated_mlp(*a, implementation="pallas_interpret", residuals=residuals)  # noqa: E731
    grads = jax.jit(jax.grad(lambda *a: jnp.sum((f(*a) * g).astype(jnp.float32)), (0, 1, 2, 3)))(x, wg, wu, wd)
    f64 = [np.asarray(a, np.float64) for a in (x, wg, wu, wd, g)]
    for a, b in zip(grads, R.swiglu_backward(*f64)):
        assert rel_err(np.asarray(a, np.float64), b) <= 2.0 ** -6


def test_float32_and_one_row():
    x, w, _ = _norm_args(np.float32, lead=())
    assert rel_err(moajax.rms_norm(x, w), R.rmsnorm(x[None], w)[0]) <= 1e-5
    x, wg, wu, wd, _ = _mlp_args(np.float32, lead=(5,))
    assert rel_err(moajax.gated_mlp(x, wg, wu, wd), R.swiglu(x, wg, wu, wd)) <= 1e-5


def test_vmap_over_a_leading_axis():
    x, w, _ = _norm_args(lead=(4, 3))
    out = jax.vmap(lambda r: moajax.rms_norm(r, w))(x)
    assert rel_err(_flat(out), R.rmsnorm(_flat(x), w)) <= 1e-12
    x, wg, wu, wd, _ = _mlp_args(lead=(4, 3))
    out = jax.vmap(lambda r: moajax.gated_mlp(r, wg, wu, wd))(x)
    assert rel_err(_flat(out), R.swiglu(_flat(x), wg, wu, wd)) <= 1e-12


def test_bad_input_is_named():
    x, w, _ = _norm_args()
    with pytest.raises(ValueError, match="rms_norm: weight has shape"):
        moajax.rms_norm(x, w[:-1])
    with pytest.raises(ValueError, match="rmsnorm: dimension 'd' of argument 'x' is 0"):  # (was an ONFError on tiles)
        moajax.rms_norm(x[..., :0], w[:0])
    with pytest.raises(TypeError, match="rms_norm: weight has dtype float32, x has float64"):
        moajax.rms_norm(x, w.astype(np.float32))
    with pytest.raises(TypeError, match="rms_norm: x must be a floating array"):
        moajax.rms_norm(x.astype(np.int32), w)
    with pytest.raises(ValueError, match="rms_norm: eps must be a positive"):
        moajax.rms_norm(x, w, eps=0.0)
    with pytest.raises(TypeError, match="rms_norm: eps must be a number"):
        moajax.rms_norm(x, w, eps="small")
    xm, wg, wu, wd, _ = _mlp_args()
    with pytest.raises(ValueError, match="gated_mlp: w_down has shape"):
        moajax.gated_mlp(xm, wg, wu, wd.T)
    with pytest.raises(ValueError, match=r"gated_mlp: zero-size dimension: x's last axis D = 0"):  # (named 'z')
        moajax.gated_mlp(xm[..., :0], wg[:0], wu[:0], wd[:, :0])
    with pytest.raises(ValueError, match="residuals names the label 'nope'"):  # at the call, not first under grad
        moajax.gated_mlp(xm, wg, wu, wd, residuals=("nope",))
    with pytest.raises(ValueError, match="gated_mlp: w_gate has shape"):
        moajax.gated_mlp(xm, wg.T, wu, wd)
    with pytest.raises(TypeError, match="gated_mlp: w_up has dtype float32"):
        moajax.gated_mlp(xm, wg, wu.astype(np.float32), wd)
    with pytest.raises(TypeError, match="gated_mlp: w_gate must be an array"):
        moajax.gated_mlp(xm, [[1.0]], wu, wd)


def test_the_mlp_backward_contracts_every_term():
    # dZ = Σ_f GH × (silu(U) × W_u + … × W_g): the sum holds both n and d, so it is distributed
    # — two contractions — instead of an [n, f, d] tile summed over f (2 GiB at n=4096, d=512)
    import re

    from moajax import machines, runtime, schedule
    from moajax.kernels.mlp import swiglu

    n, d, f = 512, 64, 384
    specs = [jax.ShapeDtypeStruct(s, np.float32) for s in [(n, d), (d, f), (d, f), (f, d), (n, d)]]
    plan = schedule.derive_plan(swiglu.adjoint(*specs[:4]).dnf(*specs), machines.load("anvil-epyc-7543"))
    for onf in plan if isinstance(plan, tuple) else (plan,):
        args = [jax.ShapeDtypeStruct(i.shape, i.dtype) for i in onf.dnf.inputs]  # (and what a first kernel wrote)
        text = str(jax.make_jaxpr(runtime.lowered(onf, "xla"))(*args))
        sizes = [int(np.prod([int(x) for x in m.split(",")])) for m in re.findall(r"f32\[([0-9,]+)\]", text)]
        assert max(sizes) <= n * f, (onf.dnf.name, max(sizes))


def test_weight_gradients_run_without_atomics_on_every_gpu():
    # dW_g, dW_u, dW_d and the norm's dw are Σ over the tokens: the default plan gives each a
    # kernel whose programs own the weight's tiles (the cost model counts no atomic)
    from moajax import cost, machines, schedule
    from moajax.kernels.mlp import swiglu
    from moajax.kernels.norm import rmsnorm

    n, d, f = 4096, 1024, 4096
    S = lambda *s: jax.ShapeDtypeStruct(s, np.float32)  # noqa: E731
    cases = [(swiglu, [S(n, d), S(d, f), S(d, f), S(f, d)], S(n, d)), (rmsnorm, [S(n, d), S(d)], S(n, d))]
    for m in (m for m in machines.available().values() if m.is_gpu):
        for kern, specs, ct in cases:
            plan = schedule.derive_plan(kern.adjoint(*specs).dnf(*specs, ct), m)
            plan = plan if isinstance(plan, tuple) else (plan,)
            atomics = sum(cost.estimate(o).atomics for o in plan)
            # (on the A40 the kernel owning dx's rows, 16 a program, did not fit while it also
            # computed the RMS, 134 KB for 99 KB of shared memory at d = 1024, and the plan fell
            # back to dw scatter-added; then the RMS was computed once, first. Since the rows
            # may be fewer than 16 a program, schedule.GPU_NARROW_ROWS, it takes 8 and
            # recomputes the RMS in both kernels, as the A100 and H200 do, which the cost
            # model times faster: a launch fewer)
            assert atomics == 0 and not any(o.accumulate for o in plan), (m.name, kern.name)
            if kern is rmsnorm and m.name == "delta-a40":
                assert [o.dnf.name for o in plan] == ["rmsnorm_adjoint_d_x", "rmsnorm_adjoint_d_weight"], plan
                assert plan[0].axis("n").tile == 8, plan[0].axes


MLP_POLICIES = ["none", ("gate",), ("gate", "up")]  # recompute all; paper IV's keep U; keep U and V


@pytest.mark.parametrize("residuals", MLP_POLICIES, ids=["none", "keep_U", "keep_U_V"])
@pytest.mark.parametrize("impl", IMPLS)
def test_gated_mlp_residual_policies_give_the_same_gradients(impl, residuals):
    # what the forward saves changes where values come from, never what is computed: float64
    # gradients at the same tolerance as the default, through the labels saved and read back
    x, wg, wu, wd, g = _mlp_args(lead=(6,))
    f = lambda *a: moajax.gated_mlp(*a, implementation=impl, residuals=residuals)  # noqa: E731
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * g), (0, 1, 2, 3)))(x, wg, wu, wd)
    for a, b in zip(grads, R.swiglu_backward(x, wg, wu, wd, g)):
        assert rel_err(a, b) <= 1e-11
    # the same choice made as an ONF preset
    pre = moajax.Preset.of(residuals=residuals)
    grads = jax.grad(lambda *a: jnp.sum(moajax.gated_mlp(*a, onf=pre, implementation=impl) * g), (0, 1, 2, 3))(
        x, wg, wu, wd)
    for a, b in zip(grads, R.swiglu_backward(x, wg, wu, wd, g)):
        assert rel_err(a, b) <= 1e-11


@pytest.mark.parametrize("residuals", ["save", ("gate", "up")], ids=["statistics", "keep_U_V"])
def test_second_derivatives_through_what_the_forward_saves(residuals):
    # grad of ½|∇|²: the saving forward's own adjoint and tangent kernels (RMSNorm's RMS; the
    # MLP's labelled U and V) against JAX's derivatives of the same math in jnp, float64
    x, w, _ = _norm_args(lead=(5,))
    xm, wg, wu, wd, g = _mlp_args(lead=(5,))

    def gg(f, n):
        inner = jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a)) * g), tuple(range(n)))
        return jax.jit(jax.grad(lambda *a: sum(jnp.sum(d * d) for d in inner(*a)) / 2, tuple(range(n))))

    norm = lambda x, w: x * w / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)  # noqa: E731
    mlp = lambda x, a, b, c: (jax.nn.silu(x @ a) * (x @ b)) @ c  # noqa: E731
    cases = [(lambda *a: moajax.rms_norm(*a, residuals="save"), norm, (x, w))] if residuals == "save" else []
    cases.append((lambda *a: moajax.gated_mlp(*a, residuals=residuals), mlp, (xm, wg, wu, wd)))
    for ours, theirs, args in cases:
        for a, b in zip(gg(ours, len(args))(*args), gg(theirs, len(args))(*args)):
            assert rel_err(a, b) <= 1e-11


def test_mlp_residual_policies_trade_memory_for_contractions():
    # per policy, the cost model's plans: the forward computes U, V and F once (3 GEMM units of
    # 2·n·d·f flops), saving U or V as it goes; the backward reads what was saved instead of
    # recomputing it — one contraction less per saved value — and, in every policy, computes
    # what its kernels share (U, V, G_H) once, in a first kernel (``schedule.staged_parts``)
    from moajax import cost, machines, schedule
    from moajax.kernels.mlp import swiglu

    n, d, f = 1024, 128, 384
    S = [jax.ShapeDtypeStruct(s, np.float32) for s in [(n, d), (d, f), (d, f), (f, d)]]
    unit = 2 * n * d * f
    m = machines.load("anvil-epyc-7543")

    def matmul_units(dnf):
        plan = schedule.derive_plan(dnf, m)
        return sum(cost.estimate(o).matmul_flops for o in (plan if isinstance(plan, tuple) else (plan,))) / unit

    backward = []
    for labels in ((), ("gate",), ("gate", "up")):
        forward = swiglu.saving_forward(*S, labels=labels).dnf(*S)
        assert matmul_units(forward) == pytest.approx(3.0)
        adj, args = swiglu.saved_adjoint(*S, labels=labels) if labels else (swiglu.adjoint(*S), S + [S[0]])
        backward.append(matmul_units(adj.dnf(*args)))
    # U, V, G_H (3, less what was saved); dZ = G_U +.× ⍉W_g + G_V +.× ⍉W_u (2); dW_g, dW_u, dW_d (3).
    # Before staged_parts each weight-gradient kernel recomputed U, V and G_H: 15 units
    assert backward == pytest.approx([8.0, 7.0, 6.0])
    plan = schedule.derive_plan(swiglu.adjoint(*S).dnf(*S, S[0]), m)
    assert sorted(o.name for o in plan[0].dnf.outputs) == ["dhidden", "gate", "up"]
    assert all({"dhidden", "gate", "up"} <= p.dnf.arrays_read() | {"gate", "up"} for p in plan[1:2])
    # attention's backward kernels share Δ = +/(dO × O) only: too little work to stage
    from moajax.kernels.attention import mha_kernel

    A = [jax.ShapeDtypeStruct((1, 256, 2, 32), np.float32)] * 3
    adj, args = mha_kernel(None, None, False).saved_adjoint(*A)
    for machine in (m, machines.load("delta-a100")):
        plan = schedule.derive_plan(adj.dnf(*args), machine)  # (one fused ONF on a CPU)
        assert not any(o.dnf.name.endswith("_shared") for o in (plan if isinstance(plan, tuple) else (plan,)))


def test_the_cost_model_reproduces_paper_iv_mlp_count():
    # M_ffn = 2nd + 4n·d_ff (REFERENCE §4) is the ledger of the ONF that stores U and V (each
    # written once, read once), counting token-proportional arrays, Z and dZ charged to the
    # neighbouring RMSNorm; the paper's own keep-U ONF counts 2nd + 2n·d_ff, recompute-all 2nd
    from moajax import cost
    from moajax.kernels.mlp import swiglu

    n, d, f = 2 * 256, 64, 256  # the seed's block: B = 2, N = 256, D = 64, D_ff = 256
    S = [jax.ShapeDtypeStruct(s, np.float64) for s in [(n, d), (d, f), (d, f), (f, d)]]
    want = {"none": 2 * n * d, ("gate",): 2 * n * d + 2 * n * f, ("gate", "up"): 2 * n * d + 4 * n * f}
    for residuals, elements in want.items():
        rows = swiglu.interface_ledger(*S, residuals=residuals)
        assert cost.ledger_elements(rows, per="n", charged_elsewhere=("z", "d_z")) == elements
    rows = swiglu.interface_ledger(*S, residuals=("gate", "up"))
    saved = [(r.phase, r.access) for r in rows if r.dims == ("n", "f")]
    assert sorted(saved) == [("backward", "read")] * 2 + [("forward", "write")] * 2


def test_residual_labels_are_checked():
    x, wg, wu, wd, _ = _mlp_args(lead=(4,))
    with pytest.raises(ValueError, match="does not define; its labels are"):
        jax.grad(lambda x: jnp.sum(moajax.gated_mlp(x, wg, wu, wd, residuals=("gates",))))(x)
    with pytest.raises(ValueError, match="non-empty tuple of label names"):
        moajax.gated_mlp(x, wg, wu, wd, residuals=())
    with pytest.raises(ValueError, match="non-empty tuple of label names"):
        moajax.Preset.of(residuals=("gate", 3))
    with pytest.raises(ValueError, match="contradicts the onf Preset"):
        moajax.gated_mlp(x, wg, wu, wd, residuals="none", onf=moajax.Preset.of(residuals=("gate",)))


def test_leading_axes_run_the_rows_kernels_tiles():
    """A rows kernel under jax.vmap runs as the batched kernel collapsed back to rows
    (``runtime.run_dnf``): its GPU ONF is the [B·T, D] kernel's, so decode's T = 1 takes the
    rows' dot tiles, not programs of one row a batch element. The ONF a call reports is the
    one it runs, and taken back as ``onf`` it runs again."""
    from moajax.kernels.mlp import swiglu
    from moajax.kernels.norm import rmsnorm

    S = lambda *s: jax.ShapeDtypeStruct(s, np.float32)  # noqa: E731
    B, T, D, F = 64, 1, 256, 512
    for kern, ws in ((swiglu, [S(D, F), S(D, F), S(F, D)]), (rmsnorm, [S(D)])):
        batched = kern.batched((True,) + (False,) * len(ws))
        got = batched.onf(S(B, T, D), *ws, implementation="pallas")
        want = kern.onf(S(B * T, D), *ws, implementation="pallas")
        assert [(a.extent, a.tile, a.role) for a in got.axes] == [(a.extent, a.tile, a.role) for a in want.axes]
    x, w, _ = _norm_args(lead=(3, 5))
    k = rmsnorm.batched((True, False))
    onf = k.onf(x, w)
    assert onf.dnf.inputs[0].shape == (15, x.shape[-1])
    assert rel_err(k(x, w, onf=onf), R.rmsnorm(_flat(x), w).reshape(x.shape)) <= 1e-12


def test_leading_axes_are_the_kernels_own_and_the_weights_gradients_one_sum():
    """x [B, T, D] runs the rows kernel's definition over the leading axes
    (``Kernel.over_leading_axes``), which ψ-reduces to the rows kernel (checked per shapes):
    the weights' gradients are one sum over B and T inside the kernel — no [B, D, F] value
    anywhere in jit(grad) (under jax.vmap of the rows kernel, one gradient a batch element) —
    and a definition that is not polymorphic in its rank is refused, named."""
    x, wg, wu, wd, _ = _mlp_args(lead=(4, 3))
    loss = lambda x, wg, wu, wd: jnp.sum(jnp.sin(moajax.gated_mlp(x, wg, wu, wd)))  # noqa: E731
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(1, 2, 3)))(x, wg, wu, wd).jaxpr
    shapes = {tuple(v.aval.shape) for e, _ in walk_eqns(jaxpr) for v in e.outvars}
    assert (4,) + wg.shape not in shapes and (4,) + wd.shape not in shapes
    from moajax import moa
    from moajax.kernel import kernel

    @kernel(example=dict(n=4, d=3), register=False)
    def column_sums(x: "n d"):  # Σ over the first axis: over a leading axis, not the rows'
        return moa.sum(x, axis=0)

    S = lambda *s: jax.ShapeDtypeStruct(s, np.float64)  # noqa: E731
    with pytest.raises(ValueError, match="column_sums.*leading axes"):
        column_sums.over_leading_axes(1).dnf(S(4, 3, D))


@pytest.mark.parametrize("impl", IMPLS)
def test_grad_of_a_vmap_with_shared_weights_sums_inside_the_kernel(impl):
    """jax.grad of a jax.vmap over examples that share the weights (the Equinox way): each
    shared weight's cotangent is the sum over the batch, computed inside the adjoint kernel
    (``runtime.differentiable``'s batched transpose: the adjoint under Ω with the weights'
    cotangents summed, which collapses to the rows kernel) — no [B, D, F] value a batch
    element, as there was before (a transpose per element, summed after). The gradients are
    the rows kernel's on [B·T, D]; vmap of grad still gives one gradient per example."""
    x, wg, wu, wd, _ = _mlp_args(lead=(4, 3))
    xn, w, _ = _norm_args(lead=(4, 3))
    mlp = lambda x, *ws: moajax.gated_mlp(x, *ws, implementation=impl)  # noqa: E731
    norm = lambda x, w: moajax.rms_norm(x, w, implementation=impl)  # noqa: E731
    for f, x, ws in ((mlp, x, (wg, wu, wd)), (norm, xn, (w,))):
        argnums = tuple(range(1, 1 + len(ws)))
        per_example = jax.vmap(lambda r, *ws: f(r, *ws), in_axes=(0,) + (None,) * len(ws))
        loss = lambda x, *ws: jnp.sum(jnp.sin(per_example(x, *ws)))  # noqa: E731
        rows = lambda x, *ws: jnp.sum(jnp.sin(f(x.reshape(-1, x.shape[-1]), *ws)))  # noqa: E731
        want = jax.grad(rows, argnums=argnums)(x, *ws)
        for grad in (jax.grad(loss, argnums=argnums), jax.jit(jax.grad(loss, argnums=argnums))):
            for a, b in zip(grad(x, *ws), want):
                assert rel_err(a, b) <= 1e-12
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=argnums))(x, *ws).jaxpr
        shapes = {tuple(v.aval.shape) for e, _ in walk_eqns(jaxpr) for v in e.outvars}
        assert not any((x.shape[0],) + wt.shape in shapes for wt in ws)
        one = jax.vmap(jax.grad(lambda r, *ws: jnp.sum(jnp.sin(f(r, *ws))), argnums=argnums),
                       in_axes=(0,) + (None,) * len(ws))(x, *ws)
        assert all(g.shape == (x.shape[0],) + wt.shape for g, wt in zip(one, ws))
        for a, b in zip(one, want):
            assert rel_err(a.sum(0), b) <= 1e-12


def test_grad_of_a_vmap_of_a_vmap_sums_the_shared_weights_over_both_batches():
    """A vmap of a vmap, the MLP's weights shared at both levels: each level's batch is summed
    inside the adjoint kernel (the batched call offers the next level its own batched
    transpose); until the fuzz of 2026-12-06 the outer level ran a transpose per element, one
    [B₂, D, F] weight gradient summed after. Float64 against the rows kernel, 1e-12."""
    x, wg, wu, wd, _ = _mlp_args(lead=(2, 3, 4))
    inner = jax.vmap(moajax.gated_mlp, in_axes=(0, None, None, None))
    loss = lambda x, *ws: jnp.sum(jnp.sin(jax.vmap(inner, in_axes=(0, None, None, None))(x, *ws)))  # noqa: E731
    rows = lambda x, *ws: jnp.sum(jnp.sin(moajax.gated_mlp(x.reshape(-1, x.shape[-1]), *ws)))  # noqa: E731
    want = jax.grad(rows, argnums=(1, 2, 3))(x, wg, wu, wd)
    for a, b in zip(jax.jit(jax.grad(loss, argnums=(1, 2, 3)))(x, wg, wu, wd), want):
        assert rel_err(a, b) <= 1e-12
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(1, 2, 3)))(x, wg, wu, wd).jaxpr
    shapes = {tuple(v.aval.shape) for e, _ in walk_eqns(jaxpr) for v in e.outvars}
    assert not any(lead + w.shape in shapes for lead in ((2,), (3,), (2, 3)) for w in (wg, wd))


@pytest.mark.parametrize("impl", IMPLS)
def test_a_vmap_over_an_empty_batch_gives_empty_outputs_and_zero_gradients(impl):
    """jax.vmap over B = 0 examples: empty outputs, the shared weights' gradients 0 (a sum over
    nothing), as jax.vmap of the jnp math gives; it raised the batched kernel's ValueError
    (a zero extent), found by the fuzz of 2026-12-06."""
    _, wg, wu, wd, _ = _mlp_args()
    _, w, _ = _norm_args()
    x0 = np.zeros((0, 2, D))
    mlp = jax.vmap(lambda x, *ws: moajax.gated_mlp(x, *ws, implementation=impl), in_axes=(0, None, None, None))
    norm = jax.vmap(lambda x, w: moajax.rms_norm(x, w, implementation=impl), in_axes=(0, None))
    for f, ws in ((mlp, (wg, wu, wd)), (norm, (w,))):
        assert f(x0, *ws).shape == x0.shape
        argnums = tuple(range(1 + len(ws)))
        for grad in (jax.grad(lambda *a: jnp.sum(f(*a)), argnums=argnums),
                     jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)), argnums=argnums))):
            got = grad(x0, *ws)
            assert [g.shape for g in got] == [a.shape for a in (x0,) + ws]
            assert all(not np.any(np.asarray(g)) for g in got)
        assert jax.jvp(f, (x0, *ws), (x0, *ws))[1].shape == x0.shape
    q = np.zeros((0, 1, 4, 2, 4))
    assert jax.vmap(moajax.dot_product_attention)(q, q, q).shape == q.shape


def test_a_preset_tiling_the_rows_tiles_the_merged_rows():
    """Over leading axes the runtime runs the rows kernel (``runtime.run_dnf``); the merged
    axis keeps the rows' name, so ``Preset.of(tiles={"n": 2})`` tiles [B·T] rows by 2 (it
    skipped the merge before, and ran the kernel over [B, T] with its own schedule)."""
    from moajax.kernels.norm import rmsnorm
    from moajax.schedule import Preset

    x, w, _ = _norm_args(lead=(3, 5))
    preset = Preset.of(tiles={"n": 2})
    onf = rmsnorm.over_leading_axes(1).onf(x, w, onf=preset)
    assert onf.dnf.inputs[0].shape == (15, D) and onf.axis("n").tile == 2
    assert rel_err(moajax.rms_norm(x, w, onf=preset), R.rmsnorm(_flat(x), w).reshape(x.shape)) <= 1e-12
