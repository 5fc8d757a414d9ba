"""Calling a kernel runs compiled code (its ONF lowered for the platform), and jax.grad runs the
compiled adjoint kernel and jax.jvp the compiled tangent kernel: novel kernels written only with
the public DSL against independent float64 NumPy references, forward, gradient and tangent,
under jit and vmap, on XLA and Pallas-interpret.

Tolerance: float64, rel ≤ 1e-10 — the compiled loops and the references sum in different
orders (tiles, online rescaling), a few ulps per op over depth ≤ ~30."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moajax
import references as R
from helpers import jnp_attention, rel_err
from moajax import dnf as D
from moajax import moa
from moajax.ptx import triton_kernels
from moajax.schedule import Preset

F64 = 1e-10
IMPLS = ["xla", "pallas_interpret"]


# ----------------------------------------------------------------------------- kernels (public DSL only)


@moajax.kernel(example=dict(t=6, s=10, h=4, e=3), register=False)
def relu2_attention(query: "t h", key: "s h", value: "s e", bias: "t s", *, scale: float = 0.5):
    """(relu(scale · Q +.× ⍉K + bias))² +.× V: no softmax, a [t s] bias."""
    a = moa.maximum(moa.dot(query, moa.transpose(key)) * scale + bias, 0.0)
    return moa.dot(a * a, value)


@moajax.kernel(example=dict(n=5, d=8, f=6), register=False)
def norm_matmul(x: "n d", gain: "d", w: "d f", *, eps: float = 1e-5):
    """(x ÷ √(mean(x²) + ε) ⊙ gain) +.× W: a normalisation, then a matmul."""
    r = moa.sqrt(moa.mean(x * x, axis=-1) + eps)
    y = moa.omega(moa.mul, (1, 1))(moa.omega(moa.div, (1, 0))(x, r), gain)
    return moa.dot(y, w)


@moajax.kernel(example=dict(t=7, s=7, h=4, e=5), register=False)
def window_attention(query: "t h", key: "s h", value: "s e", *, window: int = 2):
    """softmax over the keys with |t − s| ≤ window (a banded mask from ι), then +.× V."""
    t, s = query.shape[0], key.shape[0]
    near = moa.logical_and(moa.outer(moa.le, moa.iota(t, "t"), moa.iota(s, "s") + window),
                           moa.outer(moa.ge, moa.iota(t, "t") + window, moa.iota(s, "s")))
    score = moa.where(near, moa.dot(query, moa.transpose(key)), -1e30)
    return moa.dot(moa.softmax(score, axis=-1), value)


@moajax.kernel(example=dict(n=9, d=4), register=False)
def index_pipeline(x: "n d", w: "d"):
    """2 Θ Φ (6 △ (1 ▽ x)) ⊙ w, then +/ over rows ⧺ the first row: index maps only."""
    y = moa.rotate(2, moa.reverse(moa.take(6, moa.drop(1, x))))
    z = moa.omega(moa.mul, (1, 1))(y, w)
    return moa.catenate(moa.reshape(moa.sum(z, 0), (1, 4)), moa.take(1, z))


# ----------------------------------------------------------------------------- independent references


def ref_relu2(q, k, v, b, scale=0.5):
    a = np.maximum(q @ k.T * scale + b, 0.0)
    return (a * a) @ v


def ref_norm_matmul(x, g, w, eps=1e-5):
    return (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g) @ w


def ref_window(q, k, v, window=2):
    t, s = np.arange(q.shape[0])[:, None], np.arange(k.shape[0])[None, :]
    sc = np.where(np.abs(t - s) <= window, q @ k.T, -np.inf)
    p = np.exp(sc - sc.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def ref_pipeline(x, w):
    y = np.roll(x[1:][:6][::-1], -2, axis=0) * w
    return np.concatenate([y.sum(0, keepdims=True), y[:1]])


def numeric_grad(f, args, g, i, step=1e-6):
    """Central differences of ⟨f(args), g⟩ in argument i (float64: error ~ step² + eps/step)."""
    x = args[i]
    out = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        d = np.zeros_like(x)
        d[idx] = step
        hi = [a if j != i else a + d for j, a in enumerate(args)]
        lo = [a if j != i else a - d for j, a in enumerate(args)]
        out[idx] = (np.sum(f(*hi) * g) - np.sum(f(*lo) * g)) / (2 * step)
    return out


CASES = [
    (relu2_attention, ref_relu2, [(6, 4), (10, 4), (10, 3), (6, 10)]),
    (norm_matmul, ref_norm_matmul, [(5, 8), (8,), (8, 6)]),
    (window_attention, ref_window, [(7, 4), (7, 4), (7, 5)]),
    (index_pipeline, ref_pipeline, [(9, 4), (4,)]),
]


def _args(shapes, seed):
    r = np.random.default_rng(seed)
    return [r.standard_normal(s) for s in shapes]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kern,ref,shapes", CASES, ids=[c[0].name for c in CASES])
def test_novel_kernels_forward_and_grad(kern, ref, shapes, impl):
    args = _args(shapes, 1)
    want = ref(*args)
    got = jax.jit(lambda *a: kern(*a, implementation=impl))(*args)
    assert rel_err(got, want) <= F64
    g = np.random.default_rng(2).standard_normal(want.shape)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(kern(*a, implementation=impl) * g),
                             argnums=tuple(range(len(args)))))(*args)
    for i, d in enumerate(grads):
        # finite differences of the reference: 1e-6 steps in float64 leave ~1e-9 of noise
        assert rel_err(d, numeric_grad(ref, args, g, i)) <= 1e-7, i
        # and exactly (to rounding) jax.grad of the DNF reference
        want_d = jax.grad(lambda *a: jnp.sum(kern.reference(*a) * g), argnums=i)(*args)
        assert rel_err(d, want_d) <= F64, i


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_over_a_batch_is_a_batched_kernel(impl):
    q, k, v, b = _args([(3, 6, 4), (10, 4), (10, 3), (3, 6, 10)], 3)
    f = jax.vmap(lambda q, b: relu2_attention(q, k, v, b, implementation=impl))
    got = f(q, b)
    for i in range(3):
        assert rel_err(got[i], ref_relu2(q[i], k, v, b[i])) <= F64
    jaxpr = str(jax.make_jaxpr(f)(q, b))
    assert "pjit" not in jaxpr or "while" in jaxpr or "pallas_call" in jaxpr  # one batched program
    gq = jax.vmap(jax.grad(lambda q, b: jnp.sum(relu2_attention(q, k, v, b, implementation=impl))))(q, b)
    for i in range(3):
        want = jax.grad(lambda q: jnp.sum(relu2_attention.reference(q, k, v, b[i])))(q[i])
        assert rel_err(gq[i], want) <= F64


def test_calls_run_the_onf_and_the_reference_stays_the_oracle():
    q, k, v, b = _args([(6, 4), (10, 4), (10, 3), (6, 10)], 4)
    onf = relu2_attention.onf(q, k, v, b, onf=Preset.of(tiles={"s": 4}, roles={"s": "sequential"}))
    assert onf.axis("s").role == "sequential" and onf.axis("s").tile == 4
    compiled = jax.make_jaxpr(lambda *a: relu2_attention(*a, onf=onf))(q, k, v, b)
    loops = ("while", "scan")  # a fori_loop over a static count traces as a scan
    assert any(w in str(compiled) for w in loops)  # the sequential axis is a loop over tiles
    assert not any(w in str(jax.make_jaxpr(relu2_attention.reference)(q, k, v, b)) for w in loops)
    assert rel_err(relu2_attention(q, k, v, b, onf=onf), ref_relu2(q, k, v, b)) <= F64
    with pytest.raises(TypeError, match="onf must be a moajax ONF or a Preset"):
        relu2_attention(q, k, v, b, onf="fast")
    with pytest.raises(ValueError, match="implementation must be"):
        relu2_attention(q, k, v, b, implementation="cuda")
    with pytest.raises(moajax.ONFError, match="derived for another DNF"):
        relu2_attention(q[:5], k, v, b[:5], onf=onf)


def test_bad_input_names_the_argument():
    q, k, v, b = _args([(6, 4), (10, 4), (10, 3), (6, 10)], 5)
    with pytest.raises(ValueError, match="argument 'bias' must have rank 2"):
        relu2_attention(q, k, v, b[0])
    with pytest.raises(ValueError, match="dimension 's' is 10 in argument 'key' but 9 in argument 'value'"):
        relu2_attention(q, k, v[:9], b)
    with pytest.raises(TypeError, match="unknown option"):
        relu2_attention(q, k, v, b, temperature=2.0)


def test_bool_inputs_get_a_float0_cotangent():
    @moajax.kernel(register=False)
    def masked_sum(x: "n d", keep: "n d"):
        return moa.sum(moa.where(keep, x * x, 0.0), 1)

    x = np.random.default_rng(6).standard_normal((4, 5))
    keep = x > 0
    y, pull = jax.vjp(masked_sum, x, keep)
    dx, dkeep = pull(np.ones(4))
    assert dkeep.dtype == jax.dtypes.float0 and dkeep.shape == keep.shape
    assert rel_err(dx, np.where(keep, 2 * x, 0.0)) <= F64
def test_value_and_grad_lowers_both_directions_to_pallas():
    # on CUDA the forward and the backward (the adjoint kernel) are Pallas kernels
    s = [jax.ShapeDtypeStruct(sh, jnp.float32) for sh in [(64, 32), (64, 32), (64, 16), (64, 64)]]
    f = jax.value_and_grad(lambda *a: jnp.sum(relu2_attention(*a)), argnums=(0, 1, 2, 3))
    names = [k.name for k in triton_kernels(f, *s)]
    assert any(n.startswith("moajax_relu2_attention") and "adjoint" not in n for n in names)
    assert any(n.startswith("moajax_relu2_attention_adjoint") for n in names)


def numeric_jvp(f, args, dots, step=1e-6):
    """Central differences of f along the tangents (float64: error ~ step² + eps/step)."""
    hi = [a + step * d for a, d in zip(args, dots)]
    lo = [a - step * d for a, d in zip(args, dots)]
    return (f(*hi) - f(*lo)) / (2 * step)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kern,ref,shapes", CASES, ids=[c[0].name for c in CASES])
def test_novel_kernels_jvp_runs_the_tangent_kernel(kern, ref, shapes, impl):
    args, dots = _args(shapes, 11), _args(shapes, 12)
    out, tan = jax.jit(lambda a, d: jax.jvp(lambda *x: kern(*x, implementation=impl), a, d))(args, dots)
    assert rel_err(out, ref(*args)) <= F64
    # finite differences of the independent reference: ~1e-9 of noise in float64
    assert rel_err(tan, numeric_jvp(ref, args, dots)) <= 1e-7
    assert rel_err(tan, jax.jvp(kern.reference, args, dots)[1]) <= F64


@pytest.mark.parametrize("impl", IMPLS)
def test_jvp_under_vmap_and_vmap_under_jvp(impl):
    q, k, v, b = _args([(3, 6, 4), (10, 4), (10, 3), (3, 6, 10)], 13)
    dq, db = _args([(3, 6, 4), (3, 6, 10)], 14)
    f = lambda q, b: relu2_attention(q, k, v, b, implementation=impl)  # noqa: E731
    per_row = jax.vmap(lambda q, b, dq, db: jax.jvp(f, (q, b), (dq, db))[1])(q, b, dq, db)
    whole = jax.jvp(jax.vmap(f), (q, b), (dq, db))[1]
    for i in range(3):
        want = numeric_jvp(lambda q, b: ref_relu2(q, k, v, b), [q[i], b[i]], [dq[i], db[i]])
        assert rel_err(per_row[i], want) <= 1e-7
        assert rel_err(whole[i], per_row[i]) <= F64


def test_jvp_lowers_to_the_tangent_kernel_in_pallas():
    # on CUDA, jax.jvp runs the tangent kernel (derived in the algebra) as a Pallas kernel
    s = [jax.ShapeDtypeStruct(sh, jnp.float32) for sh in [(64, 32), (64, 32), (64, 16), (64, 64)]]
    f = lambda *a: jax.jvp(relu2_attention, a, a)  # noqa: E731
    names = [k.name for k in triton_kernels(f, *s)]
    assert any(n.startswith("moajax_relu2_attention_tangent") for n in names), names


def test_jvp_gives_bool_inputs_and_outputs_float0_tangents():
    @moajax.kernel(register=False)
    def masked(x: "n d", keep: "n d"):
        return moa.sum(moa.where(keep, x * x, 0.0), 1), moa.gt(x, 0.0)

    x = np.random.default_rng(15).standard_normal((4, 5))
    dx = np.random.default_rng(16).standard_normal((4, 5))
    keep = x > 0
    (y, pos), (dy, dpos) = jax.jvp(masked, (x, keep), (dx, np.zeros(keep.shape, jax.dtypes.float0)))
    assert rel_err(dy, np.sum(np.where(keep, 2 * x * dx, 0.0), 1)) <= F64
    assert dpos.dtype == jax.dtypes.float0 and dpos.shape == pos.shape


@pytest.mark.parametrize("impl", IMPLS)
def test_second_derivatives_run_the_derived_kernels(impl):
    # with residuals="none" the backward and the tangent are kernels with derivatives of their own
    q, k, v, b = _args([(6, 4), (10, 4), (10, 3), (6, 10)], 17)
    f = lambda q: jnp.sum(jnp.sin(relu2_attention(q, k, v, b, implementation=impl, residuals="none")))  # noqa: E731
    fr = lambda q: jnp.sum(jnp.sin(relu2_attention.reference(q, k, v, b)))  # noqa: E731
    assert rel_err(jax.hessian(f)(q), jax.hessian(fr)(q)) <= F64
    gg = lambda f: jax.grad(lambda q: jnp.sum(jax.grad(f)(q) ** 2))  # noqa: E731
    assert rel_err(gg(f)(q), gg(fr)(q)) <= F64


@pytest.mark.parametrize("impl", IMPLS)
def test_second_derivatives_through_saved_residuals_run_the_saving_forwards_kernels(impl):
    # the saving forward is a kernel with its own tangent and adjoint (its statistics in their
    # rows' layout, as its DNF outputs them), so every order of derivative runs derived kernels
    q, k, v = _args([(7, 4), (7, 4), (7, 5)], 18)
    f = lambda q: jnp.sum(jnp.sin(window_attention(q, k, v, implementation=impl, residuals="save")))  # noqa: E731
    fr = lambda q: jnp.sum(jnp.sin(window_attention.reference(q, k, v)))  # noqa: E731
    assert rel_err(jax.hessian(f)(q), jax.hessian(fr)(q)) <= F64
    gg = lambda f: jax.grad(lambda q: jnp.sum(jax.grad(f)(q) ** 2))  # noqa: E731
    assert rel_err(gg(f)(q), gg(fr)(q)) <= F64


def test_derived_kernels_never_name_an_output_or_a_statistic_as_one_of_their_inputs():
    """The adjoint of attention's saved-residual adjoint reads d_out (a cotangent) and out (the
    saved output): out's cotangent is d2_out, not d_out — with d_out both an input and an output,
    a plan's later kernels read the output for the input (grad of grad through saved residuals
    came out wrong so); its saving forward's statistics are saved2_0, … beside its saved0, …"""
    from moajax.kernels.attention import attention

    q, k, v, g = _args([(6, 4), (8, 4), (8, 5), (6, 5)], 19)
    adj = attention._adjoint_for(attention._key((q, k, v), {}), {}, True)
    specs = (q, k, v, g, q[:, 0], q[:, 0], g)
    ins = {p.name for p in adj.params}
    assert {"d_out", "out", "saved0", "saved1"} <= ins
    adj2 = adj.adjoint(*specs)
    outs = [o.name for o in adj2.dnf(*specs, *_args([(6, 4), (8, 4), (8, 5)], 20)).outputs]
    assert not set(outs) & {p.name for p in adj2.params} and "d2_out" in outs and "d2_d_out" in outs
    saving = adj.with_row_statistics()
    names = [o.name for o in saving.dnf(*specs).outputs]
    assert names[:2] == ["saved2_0", "saved2_1"] and not set(names) & ins


def test_the_forward_saves_row_statistics_the_backward_reads():
    from moajax.kernels.attention import attention
    from moajax.kernels.norm import rmsnorm

    q, k, v, g = _args([(8, 4), (12, 4), (12, 6), (8, 6)], 8)
    key = attention._key((q, k, v), {})
    assert attention._saving_pays(key, {})  # the cost model: the backward skips the softmax pass
    saved = attention._adjoint_for(key, {}, True).dnf(q, k, v, g, q[:, 0], q[:, 0], g)
    assert {"saved0", "saved1"} <= saved.arrays_read()  # the row max and the denominator
    assert "out" in saved.arrays_read()  # Δ = +/(dO × O) (moajax.identities)
    assert "⌈" not in saved.pretty()  # no max is recomputed
    fwd = attention.with_row_statistics().dnf(q, k, v)
    assert [o.name for o in fwd.outputs] == ["saved0", "saved1", "out"]
    loss = lambda res: (lambda q, k, v: jnp.sum(attention(q, k, v, residuals=res) * g))
    auto = jax.jit(jax.grad(loss("auto"), argnums=(0, 1, 2)))(q, k, v)
    none = jax.jit(jax.grad(loss("none"), argnums=(0, 1, 2)))(q, k, v)
    ref = jax.grad(lambda q, k, v: jnp.sum(attention.reference(q, k, v) * g), argnums=(0, 1, 2))(q, k, v)
    for a, b, r in zip(auto, none, ref):
        assert rel_err(a, r) <= F64 and rel_err(b, r) <= F64
    x, w = _args([(6, 8), (8,)], 9)
    gx = jax.grad(lambda x, w: jnp.sum(rmsnorm(x, w) * x), argnums=(0, 1))(x, w)
    rx = jax.grad(lambda x, w: jnp.sum(rmsnorm.reference(x, w) * x), argnums=(0, 1))(x, w)
    assert all(rel_err(a, b) <= F64 for a, b in zip(gx, rx))
    assert relu2_attention.row_statistics(tuple([relu2_attention.expression(q, k, v, _args([(8, 12)], 1)[0])]))[1] == []
    with pytest.raises(ValueError, match="residuals must be 'auto', 'save', 'none', 'recompute' or a tuple of labels"):
        attention(q, k, v, residuals="lse")


@pytest.mark.parametrize("profile", ["delta-a100", "h200"])
def test_the_saving_forward_saves_only_what_the_backward_reads(profile):
    """In bfloat16 RMSNorm's and SwiGLU's statistics include their float32 value before
    rounding, an [n d] float32 array twice the output's size, which their saved adjoints do not
    read. The saving forward leaves it out (``statistics_read``), and the adjoint takes no
    argument for it: no saved argument goes unread. Until 2026-12-06 "auto" refused to save
    there at all; now bfloat16 RMSNorm saves r alone where its flops pay, as float32 does (on the
    A100 and the H200 at n = d = 4096, its adjoint reading r runs as the owner plan), and
    bfloat16 SwiGLU has nothing to save that its backward reads."""
    from unittest import mock

    from moajax import machines
    from moajax.kernels.mlp import swiglu
    from moajax.kernels.norm import rmsnorm

    S = jax.ShapeDtypeStruct
    m = machines.load(profile)
    with mock.patch.object(machines, "local", lambda: m):
        for dt in (jnp.float32, jnp.bfloat16):
            specs = [S((4096, 4096), dt), S((4096,), dt)]
            adj, args = rmsnorm.saved_adjoint(*specs)
            dnf = adj.dnf(*args)
            saved = [i for i in dnf.inputs if i.name.startswith("saved")]
            assert [(i.shape, i.dtype) for i in saved] == [((4096,), np.dtype(np.float32))]
            assert {i.name for i in saved} <= dnf.arrays_read()
            fwd = rmsnorm.saving_forward(*specs).dnf(*specs)
            assert [(o.shape, o.dtype) for o in fwd.outputs] == [((4096,), np.dtype(np.float32)), ((4096, 4096), dt)]
            assert rmsnorm._saving_pays(rmsnorm._key(specs, {}), {})
        bf = jnp.bfloat16
        specs = [S((1024, 64), bf), S((64, 256), bf), S((64, 256), bf), S((256, 64), bf)]
        assert rmsnorm.statistics_read(rmsnorm._key(specs[:1] + [S((64,), bf)], {}), {}) == (("rounded", 0),)
        assert not swiglu._saving_pays(swiglu._key(specs, {}), {})
        assert [o.name for o in swiglu.saving_forward(*specs).dnf(*specs).outputs] == ["out"]


def test_saved_bfloat16_values_are_what_the_backward_reads():
    """residuals="save" in bfloat16: RMSNorm's pullback holds r (n float32), not its [n d]
    float32 value before rounding; SwiGLU's with ("gate",) holds U, not its [n d] float32
    output before rounding. The gradients equal the recomputing backward's, which reads
    nothing saved, bit for bit: the same kernels read the same values (r and U are rounded
    nowhere on the way)."""
    from moajax.kernels.mlp import swiglu
    from moajax.kernels.norm import rmsnorm

    bf = jnp.bfloat16
    x, w, g = (a.astype(bf) for a in _args([(16, 8), (8,), (16, 8)], 13))

    def held(kern, args, ct, **kw):
        _, pullback = jax.vjp(lambda *a: kern(*a, **kw), *args)
        leaves = jax.tree_util.tree_leaves(pullback)
        return sorted((np.shape(a), str(a.dtype)) for a in leaves), pullback(ct)

    leaves_save, d_save = held(rmsnorm, (x, w), g, residuals="save")
    leaves_none, d_none = held(rmsnorm, (x, w), g, residuals="none")
    added = list(leaves_save)
    for leaf in leaves_none:
        added.remove(leaf)
    assert added == [((16,), "float32"), ((16, 8), "bfloat16")]  # r, and the output (identities read it)
    for a, b in zip(d_save, d_none):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    z, wg, wu, wd = (a.astype(bf) for a in _args([(16, 8), (8, 12), (8, 12), (12, 8)], 14))
    leaves_gate, _ = held(swiglu, (z, wg, wu, wd), g, residuals=("gate",))
    leaves_none, _ = held(swiglu, (z, wg, wu, wd), g, residuals="none")
    added = list(leaves_gate)
    for leaf in leaves_none:
        added.remove(leaf)
    assert added == [((16, 8), "bfloat16"), ((16, 12), "float32")]  # the output, U


def test_a_saved_statistic_is_read_where_its_unlabelled_value_is():
    """d√u = du ÷ 2√u reads √u itself, the node inside RMSNorm's label "rms": with r saved, the
    adjoint read saved0 for r and recomputed √(Σ_d x²/D + ε) for the square root's derivative,
    a second walk of every row. A label is transparent for every saved statistic now: dX reads
    r and walks one sum. Its gradient with r saved against float64, 1e-12."""
    from moajax.kernels.norm import rmsnorm

    x, w, g = _args([(16, 8), (8,), (16, 8)], 10)
    adj, args = rmsnorm.saved_adjoint(x, w)
    text = adj.dnf(*args).pretty()
    assert "√" not in text and text.count("Σ") == 2, text  # Σ_d dO·w·x ÷ r for dX, Σ_n for dW
    got = jax.grad(lambda x, w: jnp.sum(rmsnorm(x, w, residuals="save") * g), argnums=(0, 1))(x, w)
    ref = jax.grad(lambda x, w: jnp.sum(rmsnorm.reference(x, w) * g), argnums=(0, 1))(x, w)
    assert all(rel_err(a, b) <= F64 for a, b in zip(got, ref))


def test_the_residual_policy_is_a_schedule_choice():
    """``Preset.of(residuals=…)`` (or the call's ``residuals``) picks what the forward saves:
    the pullback of "save" holds the row max, the sum and Out besides the inputs."""
    from moajax.kernels.attention import attention

    q, k, v, g = _args([(8, 4), (12, 4), (12, 6), (8, 6)], 12)

    def held(**kw):
        _, pullback = jax.vjp(lambda *a: attention(*a, **kw), q, k, v)
        return len(jax.tree_util.tree_leaves(pullback)), pullback(g)

    n_none, d_none = held(onf=Preset.of(residuals="none"))
    n_save, d_save = held(onf=Preset.of(residuals="save"))
    assert n_save == n_none + 3  # saved0 (max), saved1 (sum), Out
    assert held(residuals="save")[0] == n_save
    for a, b in zip(d_none, d_save):
        assert rel_err(a, b) <= F64
    with pytest.raises(ValueError, match="contradicts the onf Preset's residuals='none'"):
        attention(q, k, v, onf=Preset.of(residuals="none"), residuals="save")
    with pytest.raises(ValueError, match="Preset: residuals must be"):
        Preset.of(residuals="lse")


def _kernels_asked(monkeypatch) -> list:
    """The names of the kernels whose compiled functions are asked for from now on (a spy on
    ``Kernel.compiled``: a trace asks for each kernel it runs)."""
    from moajax.kernel import Kernel

    names, compiled = [], Kernel.compiled

    def spy(self, *a, **kw):
        names.append(self.name)
        return compiled(self, *a, **kw)

    monkeypatch.setattr(Kernel, "compiled", spy)
    return names


@pytest.mark.parametrize("impl", IMPLS)
def test_holding_nothing_reruns_the_saving_forward_where_its_flops_pay(impl, monkeypatch):
    """residuals "none" holds nothing between forward and backward: its pullback holds what
    "recompute"'s does (the inputs). Attention's backward then reruns the saving forward and
    runs the adjoint reading what it saved (FlashAttention's backward without a saved
    log-sum-exp), since the cost model counts fewer flops for the two than for the adjoint
    recomputing max, ℓ and Δ in its own kernels (``Kernel._rerun_pays``), which "recompute"
    runs. GQA, causal, query lengths, jitted: both against the float64 reference at 1e-10 (F64).
    On a CPU RMSNorm's recomputing adjoint counts fewer flops (it recomputes r from x alone), so
    "none" runs it there; whichever runs, "none" runs what ``_rerun_pays`` chose."""
    r = np.random.default_rng(21)
    q, g = (r.standard_normal((2, 12, 4, 8)) for _ in range(2))
    k, v = (r.standard_normal((2, 16, 2, 8)) for _ in range(2))
    lengths = np.array([12, 7], np.int32)
    want = R.mha_variants(q, k, v, is_causal=True, query_seq_lengths=lengths, dout=g)[:3]
    names = _kernels_asked(monkeypatch)
    leaves = {}
    for res in ("none", "recompute", "save"):
        def f(q, k, v, res=res):
            return moajax.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=lengths,
                                                implementation=impl, residuals=res)
        names.clear()
        got = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * g), argnums=(0, 1, 2)))(q, k, v)
        assert all(rel_err(a, b) <= F64 for a, b in zip(got, want)), res
        ran = set(names)
        if res != "save":
            assert any(n.endswith("_adjoint_saved") for n in ran) == (res == "none"), (res, ran)
            assert any(n.endswith("_saving") for n in ran) == (res == "none"), (res, ran)
            assert any(n.endswith("_adjoint") for n in ran) == (res == "recompute"), (res, ran)
        leaves[res] = len(jax.tree_util.tree_leaves(jax.vjp(f, q, k, v)[1]))
    assert leaves["none"] == leaves["recompute"] < leaves["save"], leaves
    # the interface ledger: under "none" the backward writes the statistics and reads them back
    from moajax.kernels.attention import attention

    qs, ks, vs = _args([(8, 4), (12, 4), (12, 6)], 12)
    rows = {res: [(r.phase, r.array, r.access) for r in attention.interface_ledger(qs, ks, vs, residuals=res)]
            for res in ("none", "recompute", "save")}
    assert [r for r in rows["none"] if r[0] == "forward"] == [r for r in rows["recompute"] if r[0] == "forward"]
    for row in (("backward", "saved0", "write"), ("backward", "saved1", "write"), ("backward", "saved0", "read")):
        assert row in rows["none"] and row not in rows["recompute"], rows
    assert ("forward", "saved0", "write") in rows["save"]

    from moajax.kernels.norm import rmsnorm

    x, w, gx = _args([(6, 8), (8,), (6, 8)], 22)
    pays = rmsnorm._rerun_pays(rmsnorm._key([x, w], {}), {}, impl)
    assert pays == (impl != "xla")  # (the GPU profile's recomputing plan counts 1.4× the CPU's flops here)
    names.clear()
    got = jax.grad(lambda x, w: jnp.sum(rmsnorm(x, w, residuals="none", implementation=impl) * gx),
                   argnums=(0, 1))(x, w)
    assert ("rmsnorm_adjoint" in names) != pays and any(n.endswith("_saving") for n in names) == pays, names
    ledger = {res: rmsnorm.interface_ledger(x, w, residuals=res, implementation=impl) for res in ("none", "recompute")}
    assert (ledger["none"] != ledger["recompute"]) == pays  # (the ledger of what this implementation runs)
    assert all(rel_err(a, b) <= F64 for a, b in zip(got, R.rmsnorm_backward(x, w, gx)))


def test_holding_nothing_reruns_the_saving_forward_under_vmap_and_differentiates_again(monkeypatch):
    """The rerun saving forward under ``jax.vmap``, one level and two (k and v shared by the
    outer batch: their cotangents summed over it in the kernel), is vmapped level by level
    as the adjoint is batched: each gradient against the float64 reference summed by hand,
    1e-10 (F64). A second derivative (Hessian-vector product) of "none" differentiates the
    rerun forward and the saved adjoint: against "recompute"'s and a jnp float64 composition."""
    r = np.random.default_rng(23)
    q, g = (r.standard_normal((3, 2, 1, 6, 2, 4)) for _ in range(2))  # [outer, inner, B, T, N, H]
    k, v = (r.standard_normal((2, 1, 9, 2, 4)) for _ in range(2))  # [inner, B, S, N, H]

    def attn(q, k, v):
        return moajax.dot_product_attention(q, k, v, is_causal=True, residuals="none")

    twice = jax.vmap(jax.vmap(attn), in_axes=(0, None, None))
    names = _kernels_asked(monkeypatch)
    got = jax.jit(jax.grad(lambda q, k, v: jnp.sum(twice(q, k, v) * g), argnums=(0, 1, 2)))(q, k, v)
    assert any("_saving" in n for n in names) and any("_adjoint_saved" in n for n in names), names
    dq = np.zeros_like(q)
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    for o in range(3):
        for i in range(2):
            a, b, c = R.mha_variants(q[o, i], k[i], v[i], is_causal=True, dout=g[o, i])[:3]
            dq[o, i] = a
            dk[i] += b
            dv[i] += c
    for a, b in zip(got, (dq, dk, dv)):
        assert rel_err(a, b) <= F64
    once = jax.vmap(attn, in_axes=(0, None, None))
    got = jax.grad(lambda q, k, v: jnp.sum(once(q, k, v) * g[:, 0]), argnums=(1,))(q[:, 0], k[0], v[0])[0]
    want = sum(R.mha_variants(q[o, 0], k[0], v[0], is_causal=True, dout=g[o, 0])[1] for o in range(3))
    assert rel_err(got, want) <= F64

    q1, k1, v1 = q[0, 0], k[0], v[0]

    def plain(q, k, v):
        return jnp_attention(q, k, v, 0.0, np.tril(np.ones((6, 9), bool)), None)

    def hvp(fn):
        return jax.jvp(jax.grad(lambda q: jnp.sum(jnp.sin(fn(q, k1, v1)))), (q1,), (v1[:, :6],))[1]

    want = hvp(plain)
    for res in ("none", "recompute"):
        got = hvp(lambda q, k, v: moajax.dot_product_attention(q, k, v, is_causal=True, residuals=res))
        assert rel_err(got, want) <= F64, res


def test_value_and_grad_of_a_softmax_kernel_lowers_the_saving_forward_to_pallas():
    from moajax.kernels.attention import attention

    s = [jax.ShapeDtypeStruct(sh, jnp.float32) for sh in [(64, 32), (128, 32), (128, 32)]]
    f = jax.value_and_grad(lambda *a: jnp.sum(attention(*a)), argnums=(0, 1, 2))
    names = [k.name for k in triton_kernels(f, *s)]
    assert any(n.startswith("moajax_attention_saving") for n in names), names
    assert any(n.startswith("moajax_attention_adjoint_saved") for n in names), names


@pytest.mark.parametrize("kern", ["attention", "relu2"])
def test_scatter_outputs_walked_by_rows_then_tiles_on_xla(kern):
    # dK, dV scatter-added over row tiles that the cpu_loop knob walks, over key tiles of their
    # own: per row tile the statistics (softmax: Δ) are computed once, then each key tile adds
    from moajax import lower_xla, machines, reference, schedule
    from moajax.kernels.attention import attention

    k = attention if kern == "attention" else relu2_attention
    shapes = [(8, 4), (12, 4), (12, 6)] if kern == "attention" else [(8, 4), (12, 4), (12, 6), (8, 12)]
    args = _args(shapes, 10)
    adj = k.adjoint(*args)
    args = args + _args([(8, 6)], 11)
    dnf = adj.dnf(*args)
    onf = schedule.derive(dnf, machines.local(), Preset.of(tiles={"t": 2, "s": 4}, roles={"s": "sequential"},
                                                           cpu_loop=("t",)))
    assert dict(onf.accumulate) == {"d_key": "atomic", "d_value": "atomic"} and onf.knobs.cpu_loop == ("t",)
    for a, b in zip(lower_xla.lower(onf)(*args), reference.to_jax(dnf)(*args)):
        assert rel_err(a, b) <= F64


def test_a_gpu_onf_that_does_not_fit_does_not_break_cpu_calls(monkeypatch):
    """On a machine without a GPU, the GPU ONF is derived only for offline CUDA lowering: if
    none fits the GPU profile, CPU calls still run (XLA), the Pallas implementations raise the
    ONFError, and a CUDA lowering warns that it carries the XLA loops."""
    import dataclasses

    from moajax import machines, runtime

    if runtime.has_gpu():
        pytest.skip("this process has a GPU: a GPU ONF that does not fit is an error there, not a fallback")
    tiny = dataclasses.replace(machines.load("delta-a100"), shared_memory_per_block=64)
    monkeypatch.setattr(runtime, "gpu_machine", lambda path="pallas": tiny)
    runtime.schedules.cache_clear()
    try:
        q, k, v, b = _args([(5, 4), (7, 4), (7, 3), (5, 7)], 11)
        with pytest.warns(RuntimeWarning, match="runs as XLA loops"):
            got = relu2_attention(q, k, v, b)
        assert rel_err(got, ref_relu2(q, k, v, b)) <= F64
        with pytest.raises(moajax.ONFError, match="on-chip footprint"):
            relu2_attention(q, k, v, b, implementation="pallas_interpret")
        with pytest.raises(moajax.ONFError, match="on-chip footprint"):
            relu2_attention.onf(q, k, v, b, implementation="pallas")
    finally:
        runtime.schedules.cache_clear()


def test_a_gpu_onf_the_pallas_lowering_refuses_does_not_break_cpu_calls(monkeypatch):
    """As one that does not fit: on a machine without a GPU, a GPU ONF whose Pallas lowering
    raises an ONFError (a tile Triton cannot take) leaves a CPU call to XLA, with the warning;
    before, the call failed."""
    from moajax import runtime

    if runtime.has_gpu():
        pytest.skip("this process has a GPU: a GPU ONF Pallas refuses is an error there, not a fallback")
    real = runtime.lowered

    def refuse(onf, implementation, order=None):
        if implementation != "xla":
            raise moajax.ONFError(f"{onf.dnf.name}: a tile of 100 (test)")
        return real(onf, implementation, order)

    monkeypatch.setattr(runtime, "lowered", refuse)
    q, k, v, b = _args([(6, 4), (9, 4), (9, 3), (6, 9)], 12)  # shapes no other test compiles (the call caches)
    with pytest.warns(RuntimeWarning, match="a tile of 100 .test. — lowered for CUDA, this kernel runs as XLA"):
        got = relu2_attention(q, k, v, b)
    assert rel_err(got, ref_relu2(q, k, v, b)) <= F64


def test_a_presets_tile_of_an_axis_nothing_walks_is_moot():
    """A Preset's tiles {t: 16, s: 32} for attention, T = 40, S = 100, reach the adjoint's kernels
    too: in the one computing what dQ and dK share, s is held whole and walked by nothing, so
    its tile is moot (the derived 128, a power of two), where before it became a "whole" axis of
    tile 32 holding 100, which the Pallas lowering refused, and jax.grad on this CPU failed."""
    from pallas_kernels.lower import check as pallas_check
    from moajax import machines, schedule
    from moajax.kernels.attention import mha_kernel

    r = np.random.default_rng(3)
    q, k, v = (r.standard_normal(s) for s in [(1, 40, 2, 16), (1, 100, 2, 16), (1, 100, 2, 16)])
    preset = Preset.of(tiles={"t": 16, "s": 32})
    specs = [jax.ShapeDtypeStruct(np.shape(a), np.float64) for a in (q, k, v)]
    adj, args = mha_kernel(None, None, False).saved_adjoint(*specs)
    dnf, a100 = adj.dnf(*args), machines.load("delta-a100")
    # the owner plan that stages what dQ and dK share (the A100's default plan recomputes them
    # since 2026-12-05, as the cost model chooses: ``schedule._owner_plan``)
    plan = [schedule.derive(d, a100, preset) for d in schedule.staged_parts(dnf, schedule.plan_groups(dnf, "owner", a100, preset))]
    for o in plan:
        pallas_check(o)  # each is a tiling the Triton backend takes
    shared = next(o for o in plan if o.dnf.name.endswith("_shared"))
    assert shared.axis("s").role == "whole" and shared.axis("s").tile == 128
    g = r.standard_normal((1, 40, 2, 16))
    got = jax.grad(lambda q: jnp.sum(moajax.dot_product_attention(q, k, v, onf=preset) * g))(q)
    assert rel_err(got, R.mha_variants(q, k, v, dout=g)[0]) <= F64


@moajax.kernel(example=dict(a=2, b=3, c=4), register=False)
def last_rows_max(x: "a b c", w: "c"):
    """⌈/ over the last two rows of each x_a +.× w: a selection of rounded values, in Ω."""
    rows = moa.omega(lambda r: moa.take(-2, r), (1,))(moa.dot(x, w))
    return moa.omega(lambda r: moa.amax(r), (1,))(rows)


@moajax.kernel(example=dict(n=5, d=3, f=4), register=False)
def column_max(x: "n d", w: "d f"):
    """⌈/ over the rows of tanh(x +.× W): a selection outside any Ω."""
    return moa.amax(moa.tanh(moa.dot(x, w)), 0)


@moajax.kernel(example=dict(n=3, k=4, m=2), register=False)
def max_plus_of_products(x: "n k", y: "k m", w: "m m"):
    """x ⌈.+ (y +.× W): a max-plus product whose second operand rounds."""
    return moa.inner("max", "add", x, moa.dot(y, w))


def ref_max_plus_grad(x, y, w, g):
    z = y @ w
    terms = x[:, :, None] + z[None, :, :]  # [n k m]
    best = terms.argmax(1)
    dx, dz = np.zeros_like(x), np.zeros_like(z)
    for i in range(x.shape[0]):
        for j in range(z.shape[1]):
            dx[i, best[i, j]] += g[i, j]
            dz[best[i, j], j] += g[i, j]
    return dx, dz @ w.T, y.T @ dz


def ref_last_rows_max_grad(x, w, g):
    """Independent: the gradient goes to the one maximal row (ties have measure zero here)."""
    m = np.einsum("abc,c->ab", x, w)[:, 1:]
    best = 1 + m.argmax(1)
    dx, dw = np.zeros_like(x), np.zeros_like(w)
    for a, b in enumerate(best):
        dx[a, b] = g[a] * w
        dw += g[a] * x[a, b]
    return dx, dw


def ref_column_max_grad(x, w, g):
    y = np.tanh(x @ w)
    best = y.argmax(0)
    dx, dw = np.zeros_like(x), np.zeros_like(w)
    for f, n in enumerate(best):
        s = g[f] * (1 - y[n, f] ** 2)
        dx[n] += s * w[:, f]
        dw[:, f] += s * x[n]
    return dx, dw


# the case hypothesis found (test_adjoint): an eager jax.grad of the XLA kernel gave zeros, the
# maximum computed in one fusion equalling no row computed in another
X_FOUND = np.array([[[0.54784675, -0.92085314, -1.8361059, -1.93388946], [1.25308096, 1.65102231, 0.4265431, 0.91798624],
                     [0.17449997, 1.7402897, 1.26341422, -1.989046]],
                    [[1.42961711, -1.8656577, 0.91862179, -1.29737752], [1.45271569, 0.16584488, -0.80115244, -0.30925112],
                     [-1.88672132, -1.50286689, 0.68249766, 0.58875805]]])
W_FOUND = np.array([1.9899416, -0.36159171, -1.61313991, -1.52819693])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("residuals", ["auto", "none"])
def test_a_selection_reads_its_operand_saved_so_its_gradient_finds_the_maximum(impl, residuals):
    """⌈/A's adjoint compares A with ⌈/A; recomputed in two fusions, they may round apart and
    the gradient vanish. The forward saves A (any residual policy) and the backward compares
    the saved values, eager or jitted alike."""
    cases = [(last_rows_max, ref_last_rows_max_grad, [X_FOUND, W_FOUND]),
             (column_max, ref_column_max_grad, _args([(5, 3), (3, 4)], 12)),
             (max_plus_of_products, ref_max_plus_grad, _args([(3, 4), (4, 2), (2, 2)], 13))]
    for kern, ref, args in cases:
        outs = kern._build([jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args], {})[1]
        stats = kern.row_statistics((outs,))[1]
        assert [s.label for s in stats] == ["selection_operand"]
        g = np.random.default_rng(1).standard_normal(outs.shape)
        loss = lambda *xs: jnp.sum(kern(*xs, implementation=impl, residuals=residuals) * g)
        want = ref(*args, g)
        argnums = tuple(range(len(args)))
        for grad in (jax.grad(loss, argnums=argnums), jax.jit(jax.grad(loss, argnums=argnums))):
            for a, b in zip(grad(*args), want):
                assert rel_err(a, b) <= F64


@pytest.mark.parametrize("impl", IMPLS)
def test_a_selections_tangent_reads_the_saved_operand_as_its_adjoint_does(impl):
    """jax.jvp through ⌈/A compares the saved A too (its tangent kernel takes the saving
    forward's operand), so that the tangent and the backward are each other's transpose:
    both pick the maximum of the one saved A. Eager and jitted, against the independent
    gradients (⟨J v, g⟩ = ⟨v, Jᵀ g⟩ at 1e-10)."""
    cases = [(last_rows_max, ref_last_rows_max_grad, [X_FOUND, W_FOUND]),
             (column_max, ref_column_max_grad, _args([(5, 3), (3, 4)], 12))]
    for kern, ref, args in cases:
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
        tk = kern._tangent_for(kern._key(specs, {}), {}, True)
        assert any(p.name.startswith("saved") for p in tk.params)
        out = kern._build(specs, {})[1]
        g = np.random.default_rng(1).standard_normal(out.shape)
        dots = _args([a.shape for a in args], 14)
        want = sum(np.sum(d * w) for d, w in zip(dots, ref(*args, g)))
        f = lambda *xs: kern(*xs, implementation=impl)  # noqa: E731
        for jvp in (jax.jvp, jax.jit(jax.jvp, static_argnums=0)):
            assert abs(float(np.sum(jvp(f, tuple(args), tuple(dots))[1] * g)) - want) <= F64 * max(1.0, abs(want))


@moajax.kernel(example=dict(b=2, n=5, d=3, f=4), register=False)
def column_max_each(x: "b n d", w: "d f"):
    """⌈/ over the rows of each tanh(x_b +.× W), in Ω: the operand is a cell of the Ω."""
    return moa.omega(lambda y: moa.amax(y, 0), (2,))(moa.tanh(moa.dot(x, w)))


def test_a_selections_backward_reads_its_saved_operand_where_the_derivative_does():
    """The saved operand A = tanh(x +.× W) of ⌈/A is also what tanh's derivative reads,
    1 − A²: the backward reads it saved there too (a label is transparent), never
    recomputing x +.× W — dW reads no W and dX no x. Where A is an Ω's cell, its lift over
    the Ω's frame is A itself (Ω(λ c. c)(A) = A), so the same holds. Until 2026-12-06 both
    recomputed x +.× W (a third matmul in the backward). Float64 gradients, 1e-10."""
    r = np.random.default_rng(25)
    for kern, shapes in ((column_max, [(5, 3), (3, 4)]), (column_max_each, [(2, 5, 3), (3, 4)])):
        x, w = (r.standard_normal(s) for s in shapes)
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, w)]
        adj, args = kern.saved_adjoint(*specs)
        dnf = adj.dnf(*args)
        reads = {o.name: {e.array for e in D.walk(o.body) if isinstance(e, D.Read)} for o in dnf.outputs}
        assert "w" not in reads["d_w"] and "x" not in reads["d_x"], reads
        g = r.standard_normal(kern._build(specs, {})[1].shape)
        got = jax.grad(lambda x, w: jnp.sum(kern(x, w) * g), argnums=(0, 1))(x, w)
        want = (ref_column_max_grad(x, w, g) if x.ndim == 2 else
                [np.stack(p) for p in zip(*(ref_column_max_grad(x[b], w, g[b]) for b in range(2)))])
        assert rel_err(got[0], want[0]) <= F64
        assert rel_err(got[1], want[1] if x.ndim == 2 else want[1].sum(0)) <= F64


def test_a_held_constant_or_exact_selection_saves_no_operand():
    """softmax's max is held constant (no derivative flows through it), and the max of an
    index map of the inputs is the same bits wherever it is recomputed: neither is saved."""
    from moajax.kernels.attention import attention

    q, k, v = _args([(8, 4), (12, 4), (12, 6)], 8)
    outs = attention._build([jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (q, k, v)], {})[1]
    assert not any(getattr(s, "label", "").startswith("selection") for s in attention.row_statistics((outs,))[1])
    exact = moajax.kernel(lambda x: moa.amax(moa.reverse(x), 0), example=dict(n=3, d=2), dims={"x": "n d"},
                          register=False)
    x = _args([(3, 2)], 3)[0]
    assert exact.row_statistics((exact.expression(x),))[1] == []
    assert not exact._selected_saved(exact._key((x,), {}), {})


def test_vmap_of_grad_of_a_softmax_kernel_reads_its_saved_statistics():
    """vmap over heads of jax.grad: the batched kernel's saving forward and its adjoint, which
    views each saved statistic (held in its rows' layout) in its own layout inside the Ω cell."""
    from moajax.kernels.attention import attention

    q, k, v, g = _args([(3, 6, 4), (3, 9, 4), (3, 9, 5), (3, 6, 5)], 13)
    loss = lambda q, k, v, g: jnp.sum(attention(q, k, v, residuals="save") * g)  # noqa: E731
    got = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(q, k, v, g)
    for i in range(3):
        want = R.attention_backward(q[i], k[i], v[i], g[i])
        for a, b in zip(got, want):
            assert rel_err(a[i], b) <= F64


@moajax.kernel(register=False)
def _int_row_sums(x: "n d"):
    return moa.cast(moa.sum(moa.cast(x * 3.0, np.int32), 1), np.float64)


@pytest.mark.parametrize("preset", [None, Preset.of(tiles={"d": 2}, roles={"d": "sequential"}),
                                    Preset.of(tiles={"n": 1}, cpu_loop=("n",))], ids=["default", "walked", "rows"])
def test_an_int32_sum_walked_in_tiles_stays_int32_under_x64(preset):
    """+/ of an int32 array walked over tiles of d: each tile's sum and the walk's carry are
    int32 (under jax_enable_x64 jnp.sum promoted the tile sum to int64 and lax.scan refused the
    carry's change of type). Exact against numpy's int32 sums."""
    from moajax import compat

    x = np.random.default_rng(0).uniform(-2, 2, (3, 6))
    want = (x * 3).astype(np.int32).sum(1, dtype=np.int32).astype(np.float64)
    with compat.enable_x64_context(True):
        assert np.array_equal(_int_row_sums(x, onf=preset), want)


@moajax.kernel(register=False)
def _min_of_rotated(x: "n d"):
    return moa.amin(moa.tanh(moa.amin(moa.rotate(5, x, 0), 0)), 0)


def test_the_gradient_of_a_rank_0_output_reading_a_rank_0_stage():
    """⌊/ tanh ⌊/ (5 ⌽ x): a rank-0 output. Its gradient's GPU schedule (derived on a CPU too,
    for the CUDA branch) costed a rank-0 read's coalescing on an empty axis order and raised an
    IndexError; against jax.grad of the jnp form, float64."""
    x = np.random.default_rng(1).uniform(-2, 2, (7, 3))
    want = jax.grad(lambda x: jnp.min(jnp.tanh(jnp.min(jnp.roll(x, -5, 0), 0))))(x)
    assert rel_err(jax.grad(_min_of_rotated)(x), want) <= F64


@moajax.kernel(register=False)
def _larger(x: "n", y: "m"):
    return moa.where(moa.gt(x, y), x, y)


def test_a_forward_presets_tiles_reach_each_adjoint_kernel_as_they_apply():
    """x > y ? x : y with x "n", y "m": under Preset.of(tiles={"n": 1}) the forward runs, and
    its gradient's kernel of dy, whose program runs over m alone, takes the tile of n as moot
    (before: "unknown axis 'n'"); a name in no input stays an error. Float64 against jnp."""
    r = np.random.default_rng(2)
    x, y = r.standard_normal(5), r.standard_normal(5)
    p = Preset.of(tiles={"n": 1})
    got = jax.grad(lambda x, y: jnp.sum(_larger(x, y, onf=p) ** 2), (0, 1))(x, y)
    want = jax.grad(lambda x, y: jnp.sum(jnp.where(x > y, x, y) ** 2), (0, 1))(x, y)
    for a, b in zip(got, want):
        assert rel_err(a, b) <= F64
    with pytest.raises(moajax.ONFError, match="unknown axis 'zz'"):
        _larger(x, y, onf=Preset.of(tiles={"zz": 1}))


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
@pytest.mark.parametrize("in_axes", [0, (0, None, None), ((0, 1), (0, 1), (0, 1))], ids=["all", "query", "nested"])
def test_a_vmapped_adjoint_reads_delta_from_the_output(in_axes, impl):
    """jax.vmap of jax.grad of causal GQA: the batched adjoint kernel matches the papers'
    identities against its forward under the same Ω, so Δ = +/(dO × Out) is read from the
    saved output, as without vmap. Before, the batched kernel had no identities: Δ was
    recomputed as a sum over the keys (a second walk of every score), and a GPU's plan gave one
    program per key. Float64 gradients against the reference, slice by slice, rel ≤ 1e-12."""
    from moajax.kernels.attention import mha_kernel

    r = np.random.default_rng(21)
    nested = isinstance(in_axes, tuple) and isinstance(in_axes[0], tuple)
    lead = (2, 3) if nested else (3,)
    q, g = (r.standard_normal(lead + (1, 12, 4, 8)) for _ in range(2))
    shared = in_axes == (0, None, None)
    k, v = (r.standard_normal(((1, 16, 2, 8) if shared else lead + (1, 16, 2, 8))) for _ in range(2))

    def grads(q, k, v, g):
        return jax.grad(lambda q, k, v: jnp.sum(moajax.dot_product_attention(
            q, k, v, is_causal=True, implementation=impl) * g), argnums=(0, 1, 2))(q, k, v)

    if nested:
        run = jax.jit(jax.vmap(jax.vmap(grads)))
    else:
        run = jax.jit(jax.vmap(grads, in_axes=in_axes + (0,) if shared else 0))
    got = run(q, k, v, g)
    for idx in np.ndindex(*lead):
        kk, vv = (k, v) if shared else (k[idx], v[idx])
        want = R.mha_backward(q[idx], kk, vv, g[idx], is_causal=True)
        for a, b in zip(got, want):  # (each call's dK and dV, also where the keys are shared)
            assert rel_err(a[idx], b) <= F64
    # the batched adjoint's DNF reads Out, and walks the keys once per output that sums them
    specs = [jax.ShapeDtypeStruct(s, np.float64) for s in [(1, 12, 4, 8), (1, 16, 2, 8), (1, 16, 2, 8)]]
    adj, args = mha_kernel(None, None, True).saved_adjoint(*specs, is_causal=True)
    bargs = [jax.ShapeDtypeStruct((3,) + tuple(a.shape), a.dtype) for a in args]
    dnf = adj.batched((True,) * len(args)).dnf(*bargs, is_causal=True)
    reads = {x.array for o in dnf.outputs for x in D.walk(o.body) if isinstance(x, D.Read)}
    assert "out" in reads
    dq = dnf.outputs[0].body
    assert sum(isinstance(x, D.Red) and x.var.extent == 16 for x in D.walk(dq)) == 1, D.show(dq)


@pytest.mark.parametrize("impl", IMPLS)
def test_grad_of_a_vmap_over_queries_sharing_the_keys_sums_dk_dv_inside_the_kernel(impl):
    """jax.grad of causal GQA under jax.vmap over query batches that share K and V: dK and
    dV are each one sum over the batch inside the adjoint kernel (its cotangents summed
    under Ω: ``Kernel.batched(…, summed=…)``), never a [B, S, K, H] value a batch element;
    float64 against the reference summed over the batch, rel ≤ 1e-12."""
    r = np.random.default_rng(22)
    q, g = (r.standard_normal((3, 1, 12, 4, 8)) for _ in range(2))
    k, v = (r.standard_normal((1, 16, 2, 8)) for _ in range(2))
    attend = jax.vmap(lambda q, k, v: moajax.dot_product_attention(q, k, v, is_causal=True, implementation=impl),
                      in_axes=(0, None, None))
    loss = lambda q, k, v: jnp.sum(attend(q, k, v) * g)  # noqa: E731
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    want = [R.mha_backward(q[i], k, v, g[i], is_causal=True) for i in range(3)]
    assert rel_err(got[0], np.stack([w[0] for w in want])) <= F64
    for j in (1, 2):
        assert rel_err(got[j], sum(w[j] for w in want)) <= F64
    from helpers import walk_eqns

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(1, 2)))(q, k, v).jaxpr
    assert (3,) + k.shape not in {tuple(x.aval.shape) for e, _ in walk_eqns(jaxpr) for x in e.outvars}


@pytest.mark.parametrize("impl", IMPLS)
def test_grad_of_a_vmap_sums_a_shared_operand_in_one_contraction_over_batch_and_rows(impl):
    """Σ_b Σ_n x·g, the shared W's gradient of a selection kernel under jax.vmap (its column
    max is per example, so the batch does not merge into the rows), and Σ_b Σ_s dS·K·c, the
    dQ of causal attention whose query the batch shares: each one contraction over both
    sums (``Backend.joint_sums``), never a [B, …] value a batch element then summed (the fuzz
    of 2026-12-06: a [B, D, F] dW, a [B, T, N, H] dQ). Float64 against independent gradients
    summed over the batch, 1e-10."""
    from helpers import walk_eqns

    r = np.random.default_rng(23)
    x, w, g = r.standard_normal((3, 5, 7)), r.standard_normal((7, 4)), r.standard_normal((3, 4))
    loss = lambda w, x: jnp.sum(jax.vmap(lambda e: column_max(e, w, implementation=impl))(x) * g)  # noqa: E731
    got = jax.jit(jax.grad(loss))(w, x)
    assert rel_err(got, sum(ref_column_max_grad(x[b], w, g[b])[1] for b in range(3))) <= F64
    jaxpr = jax.make_jaxpr(jax.grad(loss))(w, x).jaxpr
    assert (3,) + w.shape not in {tuple(v.aval.shape) for e, _ in walk_eqns(jaxpr) for v in e.outvars}

    q = r.standard_normal((1, 12, 2, 8))
    # distinct sizes (16 keys, value width 6), so that no other value has a per-example dQ's shape
    k, v, go = r.standard_normal((3, 1, 16, 2, 8)), r.standard_normal((3, 1, 16, 2, 6)), r.standard_normal((3, 1, 12, 2, 6))
    attend = jax.vmap(lambda q, k, v: moajax.dot_product_attention(q, k, v, is_causal=True, implementation=impl),
                      in_axes=(None, 0, 0))
    loss = lambda q, k, v: jnp.sum(attend(q, k, v) * go)  # noqa: E731
    got = jax.jit(jax.grad(loss))(q, k, v)
    assert rel_err(got, sum(R.mha_backward(q, k[b], v[b], go[b], is_causal=True)[0] for b in range(3))) <= F64
    jaxpr = jax.make_jaxpr(jax.grad(loss))(q, k, v).jaxpr
    shapes = {tuple(x.aval.shape) for e, _ in walk_eqns(jaxpr) for x in e.outvars}
    assert not shapes & {(3,) + q.shape, (3, 12, 2, 8), (2, 3, 12, 8)}


@pytest.mark.parametrize("impl", IMPLS)
def test_grad_of_some_args_derives_only_their_cotangents(impl):
    """jax.grad of the weight alone (argnums): the adjoint kernel outputs dW only
    (``Kernel.adjoint(wrt=…)``; the others' tangents were symbolic zeros), no dX = G·Wᵀ
    computed and dropped (the backward of a kernel is one opaque call XLA cannot prune);
    under jax.vmap too. Attention's "split" backward, a partition of all three cotangents,
    is kept to those asked. Float64 against independent gradients, 1e-10."""
    from helpers import walk_eqns

    r = np.random.default_rng(24)
    x, w, g = r.standard_normal((5, 7)), r.standard_normal((7, 4)), r.standard_normal(4)
    loss = lambda w, x: jnp.sum(column_max(x, w, implementation=impl) * g)  # noqa: E731
    assert rel_err(jax.jit(jax.grad(loss))(w, x), ref_column_max_grad(x, w, g)[1]) <= F64
    jaxpr = jax.make_jaxpr(jax.grad(loss))(w, x).jaxpr
    dots = {tuple(v.aval.shape) for e, _ in walk_eqns(jaxpr) if e.primitive.name == "dot_general" for v in e.outvars}
    assert not {x.shape, x.shape[::-1]} & dots  # (x itself is transposed for dW's contraction)
    xs, gs = r.standard_normal((3, 5, 7)), r.standard_normal((3, 4))
    per = jax.vmap(lambda x, g, w: jax.grad(lambda w: jnp.sum(column_max(x, w, implementation=impl) * g))(w),
                   in_axes=(0, 0, None))(xs, gs, w)
    assert rel_err(per, np.stack([ref_column_max_grad(xs[b], w, gs[b])[1] for b in range(3)])) <= F64

    q, do = r.standard_normal((1, 12, 4, 8)), r.standard_normal((1, 12, 4, 8))
    k, v = r.standard_normal((1, 16, 2, 8)), r.standard_normal((1, 16, 2, 8))
    want = R.mha_backward(q, k, v, do, is_causal=True)
    for plan in (None, "split", "owner"):
        onf = None if plan is None else Preset.of(backward=plan)
        att = lambda q, k, v: jnp.sum(moajax.dot_product_attention(  # noqa: E731
            q, k, v, is_causal=True, onf=onf, implementation=impl) * do)
        for argnums in ((0,), (1, 2), (2,)):
            got = jax.jit(jax.grad(att, argnums=argnums))(q, k, v)
            for a, i in zip(got, argnums):
                assert rel_err(a, want[i]) <= F64, (plan, argnums, i)
    # a plan that is no partition of the three cotangents is refused whichever are asked (a fuzz
    # found it taken where argnums asked only those it named), naming all three
    for bad in ((("d_query", "d_key"),), (("d_query",), ("d_query", "d_key", "d_value")), (("d_q",), ("d_key", "d_value"))):
        att = lambda q, k, v, bad=bad: jnp.sum(moajax.dot_product_attention(  # noqa: E731
            q, k, v, onf=Preset.of(backward=bad), implementation=impl) * do)
        for argnums in ((0,), (0, 1), (2,)):
            with pytest.raises(ValueError, match="d_query.*d_key.*d_value"):
                jax.grad(att, argnums=argnums)(q, k, v)


def test_a_vmapped_saving_forward_names_its_statistics_and_keeps_its_gpu_tiling():
    """The saving forward under vmap (and vmap of vmap) names its outputs saved0, … and out, as
    unbatched: by name the GPU tile tables leave the float32 statistics out of the operand
    width, so a bfloat16 forward keeps bfloat16 dots (lowp_dots) and the H200's tiles. Named
    out0, … the batched kernel took float32 TF32 dots on 32 × 32 tiles, the slow choice
    ``schedule._operand_width`` documents (5.9 of 7.1 ms at S = 4096 on the H200). The outer
    vmap shares the keys: K depends on neither its batch of 3 nor the queries, and programs
    owned the batch, one query each (t tile 1), in this kernel and the plain forward alike."""
    import dataclasses

    from moajax import machines, schedule
    from moajax.kernels.attention import mha_kernel

    h200 = dataclasses.replace(machines.load("h200"), spill_check=False)
    specs = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in [(1, 256, 8, 64), (1, 256, 2, 64), (1, 256, 2, 64)]]
    saving = mha_kernel(None, None, True).with_row_statistics(())
    once = saving.batched((True, True, True))
    twice = once.batched((True, False, True))
    b1 = [jax.ShapeDtypeStruct((2,) + tuple(a.shape), a.dtype) for a in specs]
    b2 = [jax.ShapeDtypeStruct((3,) + tuple(a.shape), a.dtype) if f else a for a, f in zip(b1, (True, False, True))]
    onfs = []
    for kern, args in ((saving, specs), (once, b1), (twice, b2)):
        dnf = kern.dnf(*args, is_causal=True)
        assert [o.name for o in dnf.outputs] == ["saved0", "saved1", "saved2", "out"]
        onfs.append(schedule.derive(dnf, h200))
    plain = mha_kernel(None, None, True)
    onfs.append(schedule.derive(plain.batched((True, False, False)).dnf(
        *[jax.ShapeDtypeStruct((3,) + tuple(specs[0].shape), jnp.bfloat16)] + specs[1:], is_causal=True), h200))
    for o in onfs:
        assert o.knobs.lowp_dots, o.pretty()
        assert o.axis("t").tile >= 16 and o.axis("s").tile == onfs[0].axis("s").tile, o.pretty()
    assert onfs[1].knobs == onfs[2].knobs == onfs[0].knobs and onfs[2].axis("t").tile == onfs[0].axis("t").tile


@pytest.mark.parametrize("implementation", ["xla", "pallas_interpret", None])
def test_residuals_auto_prices_the_backward_the_call_runs(implementation, monkeypatch):
    """residuals "auto" (``Kernel._saving_pays``) counts the flops of the ONFs of the machine
    the call runs on — this process's GPU profile for a GPU implementation, else this machine
    (no GPU here: None is the CPU's) — and of the backward that machine runs: a GPU's for
    its 16-bit dots (``gpu_dots_round``), on a CPU the one reading Out (rounded False). A
    bfloat16 ALiBi table is where the two backwards differ (test_precision.py)."""
    import jax.numpy as jnp

    from moajax import machines, runtime, schedule
    from moajax.api import _check_score_mod
    from moajax.kernels.attention import mha_kernel

    h200 = machines.load("h200")
    monkeypatch.setattr(runtime, "gpu_machine", lambda path="pallas": h200)
    slopes = jnp.asarray([0.25, 0.5], jnp.bfloat16)
    mod = _check_score_mod(lambda s, b, h, i, j: s - slopes[h] * jnp.abs(i - j), jnp.bfloat16)
    kern = mha_kernel(None, None, False, False, False, mod)
    specs = [jax.ShapeDtypeStruct((1, 32, 2, 16), jnp.bfloat16)] * 3 + [jax.ShapeDtypeStruct((2,), jnp.bfloat16)]
    key = kern._key(specs, {})
    assert kern.gpu_dots_round(key, {})  # (a GPU's forward rounds: the two backwards differ)
    seen = {"machines": set(), "rounded": set()}
    derive_plan, adjoint_for = schedule.derive_plan, type(kern)._adjoint_for

    def spy_plan(dnf, machine, preset=None):
        seen["machines"].add(machine.name)
        return derive_plan(dnf, machine, preset)

    def spy_adjoint(self, *a, rounded=None, **kw):
        if a[2] is False:  # the recomputing backward's (``statistics_read`` derives both kinds reading saved values)
            seen["rounded"].add(rounded)
        return adjoint_for(self, *a, rounded=rounded, **kw)

    monkeypatch.setattr(schedule, "derive_plan", spy_plan)
    monkeypatch.setattr(type(kern), "_adjoint_for", spy_adjoint)
    kern._saving_pays(key, {}, implementation)
    gpu = implementation == "pallas_interpret"
    assert seen["machines"] == ({h200.name} if gpu else {machines.local().name})
    assert seen["rounded"] == {gpu}
