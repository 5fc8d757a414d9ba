"""Beyond one device (moajax.shard, moajax.ring): kernels split over a mesh of the eight host
CPU devices (tests/conftest.py) give the one-device results, the compiled programs move no
whole operand (no all-gather), and two processes through jax.distributed agree with one.

Tolerances: float64 1e-12 (the same arithmetic in another order: a few ulps per reduction
over ≤ 128 terms), float32 1e-5 (the same, in float32: the issue's bound)."""

import functools
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import moajax
from moajax import cost, shard
from moajax.kernels.attention import mha_kernel
from moajax.kernels.mlp import swiglu
from moajax.ring import Ring, ring_attention
from tests import references
from tests.helpers import rel_err, sub_jaxprs

ROOT = Path(__file__).resolve().parent.parent
TOL = {np.float64: 1e-12, np.float32: 1e-5}

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 host devices (tests/conftest.py sets them)")


def _mesh(shape, names):
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


def _put(x, mesh, *spec):
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))


def _hlo(fn, *args) -> str:
    return fn.lower(*args).compile().as_text()


def _spec(*shape, dtype=np.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def _attn_inputs(dtype, B=4, T=64, N=4, K=2, H=8, seed=0):
    r = np.random.default_rng(seed)
    return tuple(jnp.asarray(r.standard_normal(s).astype(dtype)) for s in ((B, T, N, H), (B, T, K, H), (B, T, K, H)))


# ----------------------------------------------------------------------------- the rule


def test_rule_attention_classes():
    """Batch and kv heads (GQA: a query head's major digit) are map classes; the head dim is
    contracted; a causal mask puts t and s in index arithmetic; without it t is a map class."""
    specs = [_spec(2, 16, 4, 8), _spec(2, 16, 2, 8), _spec(2, 16, 2, 8)]
    kern = mha_kernel(None, None, True, False, False, None)
    causal = shard.rule(kern.dnf(*specs, is_causal=True))
    kinds = dict(zip(causal.names, causal.kinds))
    assert kinds["b"] == kinds["n_kv"] == kinds["e"] == "map"
    assert "reduced" in kinds["h"] and "arithmetic" in kinds["t"] and "arithmetic" in kinds["s"]
    # query heads [4] = (kv head, group): the class spans 2 query heads per kv head
    q_heads = causal.inputs[0][2][2]
    assert causal.names[q_heads.cls] == "n_kv" and q_heads.minor == 2
    plain = dict(zip(*(lambda r: (r.names, r.kinds))(shard.rule(kern.dnf(*specs)))))
    assert plain["t"] == "map" and "reduced" in plain["s"]
    adjoint = shard.rule(kern.adjoint(*specs).dnf(*specs, specs[0]))
    assert dict(zip(adjoint.names, adjoint.kinds))["b"] == "map"


def test_rule_mlp_monoid_classes():
    """Tokens are a map class of the MLP and a monoid (+) class of its adjoint (the weight
    gradients sum over tokens: one psum); d_ff is a monoid class of both (tensor parallel)."""
    s = [_spec(8, 6), _spec(6, 12), _spec(6, 12), _spec(12, 6)]
    fwd, adj = shard.rule(swiglu.dnf(*s)), shard.rule(swiglu.adjoint(*s).dnf(*s, s[0]))
    assert dict(zip(fwd.names, fwd.kinds)) == {"n": "map", "d": "reduced inside the kernel", "f": "monoid"}
    kinds = dict(zip(adj.names, adj.kinds))
    assert kinds["n"] == "monoid" and kinds["f"] == "monoid"
    n = adj.names.index("n")
    assert {i for i, _ in adj.monoids[n]} == {1, 2, 3}  # dw_gate, dw_up, dw_down


# ----------------------------------------------------------------------------- batch × heads


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_attention_batch_heads_split(dtype):
    mesh = _mesh((2, 4), ("data", "model"))
    q, k, v = _attn_inputs(dtype, N=8, K=4)
    f = lambda q, k, v: moajax.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    loss = lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))  # noqa: E731
    ref, gref = f(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    args = [_put(x, mesh, "data", None, "model") for x in (q, k, v)]
    jf, jg = jax.jit(f), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    out = jf(*args)
    assert out.sharding.spec[:3] == ("data", None, "model")
    assert rel_err(out, ref) <= TOL[dtype]
    for a, b in zip(jg(*args), gref):
        assert rel_err(a, b) <= TOL[dtype]
    assert "all-gather" not in _hlo(jf, *args) and "all-gather" not in _hlo(jg, *args)


def test_mlp_and_norm_token_split_sum_weight_gradients():
    """Data parallel: tokens split, each device's weight gradients summed by one all-reduce."""
    mesh = _mesh((8,), ("data",))
    r = np.random.default_rng(1)
    x, wg, wu, wd, w = (jnp.asarray(r.standard_normal(s)) for s in ((64, 16), (16, 32), (16, 32), (32, 16), (16,)))

    def loss(x, wg, wu, wd, w):
        return jnp.sum(moajax.gated_mlp(moajax.rms_norm(x, w), wg, wu, wd) ** 2)

    ref = jax.grad(loss, argnums=range(5))(x, wg, wu, wd, w)
    g = jax.jit(jax.grad(loss, argnums=range(5)))
    args = (_put(x, mesh, "data"), wg, wu, wd, w)
    for a, b in zip(g(*args), ref):
        assert rel_err(a, b) <= 1e-12
    text = _hlo(g, *args)
    assert "all-gather" not in text and "all-reduce" in text


def _attention_f64(q, k, v, bias=None, causal=False):
    """softmax(q·kᵀ/√H + bias)·v in jnp, float64 (independent of moajax's kernels)."""
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    s = s if bias is None else s + bias
    if causal:
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v)


def _norm_mlp_f64(x, w, wg, wu, wd):
    h = w * x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    return (jax.nn.silu(h @ wg) * (h @ wu)) @ wd


EXPLICIT = {  # name: (mesh shape, moajax call, its float64 reference, argument shapes, PartitionSpecs)
    "causal_rows_split": ((8,), lambda q, k, v: moajax.dot_product_attention(q, k, v, is_causal=True),
                          functools.partial(_attention_f64, causal=True), [(2, 8, 4, 2)] * 3,
                          [P(None, "x"), P(), P()]),
    "batch_and_rows_split": ((2, 4), moajax.dot_product_attention, _attention_f64, [(2, 8, 4, 2)] * 3,
                             [P("x", "y"), P("x"), P("x")]),
    "causal_ring": ((8,), lambda q, k, v: moajax.dot_product_attention(q, k, v, is_causal=True),
                    functools.partial(_attention_f64, causal=True), [(2, 16, 4, 2)] * 3, [P(None, "x")] * 3),
    "norm_mlp_batch_split": ((8,), lambda x, w, wg, wu, wd: moajax.gated_mlp(moajax.rms_norm(x, w), wg, wu, wd),
                             _norm_mlp_f64, [(8, 6, 16), (16,), (16, 32), (16, 32), (32, 16)],
                             [P("x"), P(), P(), P(), P()]),
    "mlp_d_ff_split": ((8,), lambda x, w, wg, wu, wd: moajax.gated_mlp(moajax.rms_norm(x, w), wg, wu, wd),
                       _norm_mlp_f64, [(8, 6, 16), (16,), (16, 32), (16, 32), (32, 16)],
                       [P(), P(), P(None, "x"), P(None, "x"), P("x")]),
}


@pytest.mark.parametrize("case", list(EXPLICIT))
def test_a_mesh_of_explicit_axes(case):
    """Sharding in types (``jax.set_mesh`` over ``AxisType.Explicit`` axes), where jax.nn and jnp
    run: the kernel runs with the axes made automatic (``compat.auto_axes``), its outputs typed
    as its partitioning leaves them, and a split it gathers is resharded (``compat.reshard``:
    ``with_sharding_constraint`` only asserts there). Its lowering, traced on sharding-typed
    values, raised that a contraction over a split axis was ambiguous, and ``conform``'s
    constraint asserted (a fuzz). The forward and gradients against float64 jnp, 1e-12."""
    AxisType = getattr(jax.sharding, "AxisType", None)
    if AxisType is None or not hasattr(jax, "set_mesh") or not hasattr(jax.sharding, "auto_axes"):
        pytest.skip("this JAX has no Explicit mesh axes (sharding in types)")
    shape, f, ref, shapes, specs = EXPLICIT[case]
    names = ("x", "y")[:len(shape)]
    mesh = Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names,
                axis_types=(AxisType.Explicit,) * len(shape))
    r = np.random.default_rng(12)
    args = [jnp.asarray(r.standard_normal(s)) for s in shapes]
    loss = lambda fn: lambda *a: jnp.sum(jnp.sin(fn(*a)))  # noqa: E731
    argnums = tuple(range(len(args)))
    with jax.set_mesh(mesh):
        put = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
        out = jax.jit(f)(*put)
        grads = jax.jit(jax.grad(loss(f), argnums=argnums))(*put)
    assert rel_err(out, ref(*args)) <= 1e-12
    for a, b in zip(grads, jax.grad(loss(ref), argnums=argnums)(*args)):
        assert rel_err(a, b) <= 1e-12


@pytest.mark.parametrize("bias_shape", [(1, 4, 1, 8), (2, 1, 1, 8), (2, 4, 1, 8)])
def test_query_rows_split_beside_a_bias_broadcast_over_them(bias_shape):
    """q's rows split, k and v whole, a bias broadcast over the rows: dBias = Σ_b ((finite ?
    Σ_t … : 0) + …) is a sum over t behind a select that does not read t, so each device sums its
    rows and one all-reduce finishes (``shard._top_reduction`` reads through ``c ? op_v x :
    identity``). The backward gathered q, dO, Out and the statistics along t (announced; the
    fourth fuzz). With a bias [B, N, 1, S], dBias has no Σ_b around: its top is the sum of the
    two selects, which the rule read as no reduction at all (the fifth fuzz). No all-gather;
    float64 against jnp at 1e-12."""
    mesh = _mesh((4,), ("x",))
    r = np.random.default_rng(13)
    q, k, v = (jnp.asarray(r.standard_normal((2, 8, 4, 2))) for _ in range(3))
    bias = jnp.asarray(r.standard_normal(bias_shape))
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
    f = lambda q, k, v, b: moajax.dot_product_attention(q, k, v, bias=b)  # noqa: E731
    g = jax.jit(jax.grad(loss(f), argnums=range(4)))
    args = (_put(q, mesh, None, "x"), k, v, bias)
    for a, b in zip(g(*args), jax.grad(loss(_attention_f64), argnums=range(4))(q, k, v, bias)):
        assert rel_err(a, b) <= 1e-12
    text = _hlo(g, *args)
    assert "all-gather" not in text and "all-reduce" in text


def test_gradients_inside_shard_map_of_inputs_replicated_over_the_manual_axis():
    """Inside ``jax.shard_map`` (its varying-axes check on, JAX's default): q split over the
    manual axis, k and v replicated; the batch split, a bias replicated. Each device's dK, dV
    (dBias) is its part of the sum: the cotangent of an input invariant over the axis is summed
    over it (``compat.varying_like``). JAX refused the kernel's cotangent, varying where its
    input was not (a fuzz; jax.nn ran). Gradients and jvp against float64 jnp, 1e-12."""
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:
        pytest.skip("jax.shard_map (JAX ≥ 0.7) types varying manual axes; this JAX has none")
    r = np.random.default_rng(11)
    q, k, v = (jnp.asarray(r.standard_normal((2, 8, 4, 2))) for _ in range(3))
    bias = jnp.asarray(r.standard_normal((1, 4, 8, 8)))
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
    rows = shard_map(moajax.dot_product_attention, mesh=_mesh((4,), ("y",)), in_specs=(P(None, "y"), P(), P()),
                     out_specs=P(None, "y"))
    for a, b in zip(jax.jit(jax.grad(loss(rows), argnums=(0, 1, 2)))(q, k, v),
                    jax.grad(loss(_attention_f64), argnums=(0, 1, 2))(q, k, v)):
        assert rel_err(a, b) <= 1e-12
    tangent = jax.jit(lambda *a: jax.jvp(rows, a, (v, q, k))[1])(q, k, v)
    assert rel_err(tangent, jax.jvp(_attention_f64, (q, k, v), (v, q, k))[1]) <= 1e-12
    batch = shard_map(lambda q, k, v, b: moajax.dot_product_attention(q, k, v, bias=b), mesh=_mesh((2,), ("x",)),
                      in_specs=(P("x"), P("x"), P("x"), P()), out_specs=P("x"))
    for a, b in zip(jax.jit(jax.grad(loss(batch), argnums=range(4)))(q, k, v, bias),
                    jax.grad(loss(_attention_f64), argnums=range(4))(q, k, v, bias)):
        assert rel_err(a, b) <= 1e-12


@pytest.mark.parametrize("spec", [(None, "seq", None), ("data", "seq", None)], ids=["sequence", "batch_and_sequence"])
def test_mlp_and_norm_sequence_split_stays_split(spec):
    """Sequence parallel: x [B, T, D] split along T (and B): RMSNorm and the MLP run over x's
    leading axes (``Kernel.over_leading_axes``) on each device's block, the weight gradients
    summed by all-reduce, no all-gather, the output split as x. They flattened x to [B·T, D]
    rows before the kernel, and XLA, which keeps no split of T through that reshape, gathered
    x whole on every device (a fuzz, results right). Against a jnp float64 composition, 1e-12."""
    mesh = _mesh((2, 4), ("data", "seq"))
    r = np.random.default_rng(4)
    x, w, wg, wu, wd = (jnp.asarray(r.standard_normal(s)) for s in ((4, 8, 16), (16,), (16, 32), (16, 32), (32, 16)))

    def f(x, w, wg, wu, wd):
        return moajax.gated_mlp(moajax.rms_norm(x, w), wg, wu, wd)

    def loss(fn):
        return lambda *a: jnp.sum(jnp.sin(fn(*a)))

    args = (_put(x, mesh, *spec), w, wg, wu, wd)
    jf, jg = jax.jit(f), jax.jit(jax.grad(loss(f), argnums=range(5)))
    out = jf(*args)
    assert out.sharding.spec == P(*spec) and rel_err(out, _norm_mlp_f64(x, w, wg, wu, wd)) <= 1e-12
    for a, b in zip(jg(*args), jax.grad(loss(_norm_mlp_f64), argnums=range(5))(x, w, wg, wu, wd)):
        assert rel_err(a, b) <= 1e-12
    for text in (_hlo(jf, *args), _hlo(jg, *args)):
        assert "all-gather" not in text
    assert "all-reduce" in _hlo(jg, *args)


def test_grad_of_a_vmap_over_a_split_batch_sums_the_shared_weights_on_each_device():
    """jax.grad of jax.vmap over examples sharing the weights, the batch split over "data"
    and each example's tokens over "seq": the adjoint's weight cotangents, summed over the
    batch inside the kernel (``Kernel.batched(…, summed=…)``), are summed on each device's
    block and all-reduced; no all-gather, float64 against the jnp composition at 1e-12."""
    mesh = _mesh((2, 4), ("data", "seq"))
    r = np.random.default_rng(5)
    x, w, wg, wu, wd = (jnp.asarray(r.standard_normal(s)) for s in ((4, 8, 16), (16,), (16, 32), (16, 32), (32, 16)))

    def f(x, w, wg, wu, wd):
        return jax.vmap(lambda e: moajax.gated_mlp(moajax.rms_norm(e, w), wg, wu, wd))(x)

    def loss(fn):
        return lambda *a: jnp.sum(jnp.sin(fn(*a)))

    args = (_put(x, mesh, "data", "seq"), w, wg, wu, wd)
    jg = jax.jit(jax.grad(loss(f), argnums=range(5)))
    for a, b in zip(jg(*args), jax.grad(loss(_norm_mlp_f64), argnums=range(5))(x, w, wg, wu, wd)):
        assert rel_err(a, b) <= 1e-12
    text = _hlo(jg, *args)
    assert "all-gather" not in text and "all-reduce" in text


def test_mlp_tensor_parallel():
    """d_ff split (Megatron): w_gate, w_up by columns, w_down by rows; out and dx summed."""
    mesh = _mesh((4,), ("model",))
    r = np.random.default_rng(2)
    x, wg, wu, wd = (jnp.asarray(r.standard_normal(s)) for s in ((32, 16), (16, 64), (16, 64), (64, 16)))
    f = lambda *a: moajax.gated_mlp(*a)  # noqa: E731
    loss = lambda *a: jnp.sum(jnp.tanh(f(*a)))  # noqa: E731
    args = (x, _put(wg, mesh, None, "model"), _put(wu, mesh, None, "model"), _put(wd, mesh, "model"))
    assert rel_err(jax.jit(f)(*args), f(x, wg, wu, wd)) <= 1e-12
    for a, b in zip(jax.jit(jax.grad(loss, argnums=range(4)))(*args), jax.grad(loss, argnums=range(4))(x, wg, wu, wd)):
        assert rel_err(a, b) <= 1e-12
    assert "all-gather" not in _hlo(jax.jit(f), *args)


def _block(B=4, T=32, D=32, N=4, K=2, H=8, F=48, seed=3):
    r = np.random.default_rng(seed)
    a = lambda *s: jnp.asarray(r.standard_normal(s))  # noqa: E731
    p = dict(attn_norm=1 + 0.1 * a(D), wq=a(D, N, H) / D ** 0.5, wk=a(D, K, H) / D ** 0.5, wv=a(D, K, H) / D ** 0.5,
             wo=a(N, H, D) / (N * H) ** 0.5, mlp_norm=1 + 0.1 * a(D), w_gate=a(D, F) / D ** 0.5,
             w_up=a(D, F) / D ** 0.5, w_down=a(F, D) / F ** 0.5)
    return p, a(B, T, D)


def test_block_gradient_batch_and_heads_split():
    """The block's gradient with the batch over "data" and the attention heads over "model"
    (their projections split by heads) equals one device's; no all-gather anywhere."""
    mesh = _mesh((2, 4), ("data", "model"))
    p, x = _block(N=8, K=4)
    loss = lambda p, x: jnp.mean(moajax.transformer_block(p, x, is_causal=True) ** 2)  # noqa: E731
    ref = jax.grad(loss)(p, x)
    heads = {"wq": (None, "model"), "wk": (None, "model"), "wv": (None, "model"), "wo": ("model",)}
    ps = {n: _put(w, mesh, *heads.get(n, ())) for n, w in p.items()}
    xs = _put(x, mesh, "data")
    g = jax.jit(jax.grad(loss))
    got = g(ps, xs)
    for n in p:
        assert rel_err(got[n], ref[n]) <= 1e-12, n
    assert "all-gather" not in _hlo(g, ps, xs)


def test_block_batch_and_heads_split_on_a_mesh_of_explicit_axes():
    """The same split on a mesh of Explicit axes (sharding in types): the output projection's
    Σ over the split heads takes x's split (``compat.explicit_sharding``), where JAX raised a
    ShardingTypeError asking for it (a fuzz; jnp's own einsum raises it there). Forward and
    gradient equal one device's, 1e-12."""
    AxisType = getattr(jax.sharding, "AxisType", None)
    if AxisType is None or not hasattr(jax, "set_mesh") or not hasattr(jax.sharding, "auto_axes"):
        pytest.skip("this JAX has no Explicit mesh axes (sharding in types)")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    p, x = _block(N=8, K=4)
    f = lambda p, x: moajax.transformer_block(p, x, is_causal=True)  # noqa: E731
    loss = lambda p, x: jnp.mean(f(p, x) ** 2)  # noqa: E731
    heads = {"wq": (None, "model"), "wk": (None, "model"), "wv": (None, "model"), "wo": ("model",)}
    with jax.set_mesh(mesh):
        ps = {n: jax.device_put(w, NamedSharding(mesh, P(*heads.get(n, ())))) for n, w in p.items()}
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        out, got = jax.jit(f)(ps, xs), jax.jit(jax.grad(loss))(ps, xs)
    assert rel_err(out, f(p, x)) <= 1e-12
    ref = jax.grad(loss)(p, x)
    for n in p:
        assert rel_err(got[n], ref[n]) <= 1e-12, n


def test_block_forward_and_gradient_sequence_split():
    """The block with the sequence split over "seq" (and the batch over "data"): its attention
    runs the ring (collective-permutes), the norms and the MLP their rows; equal to one
    device's, no all-gather. (Each device holds one batch element here: with several, the
    rows [B·T, D] that the norm and the MLP take are not a block of the merged axis, and XLA
    regathers the activations along the sequence — correct, not free; see the README.)"""
    mesh = _mesh((2, 4), ("data", "seq"))
    p, x = _block(B=2, N=8, K=4, D=48)
    f = lambda p, x: moajax.transformer_block(p, x, is_causal=True)  # noqa: E731
    loss = lambda p, x: jnp.mean(f(p, x) ** 2)  # noqa: E731
    xs = _put(x, mesh, "data", "seq")
    assert rel_err(jax.jit(f)(p, xs), f(p, x)) <= 1e-12
    g = jax.jit(jax.grad(loss, argnums=(0, 1)))
    got, ref = g(p, xs), jax.grad(loss, argnums=(0, 1))(p, x)
    for n in p:
        assert rel_err(got[0][n], ref[0][n]) <= 1e-12, n
    assert rel_err(got[1], ref[1]) <= 1e-12
    text = _hlo(g, p, xs)
    assert "collective-permute" in text and "all-gather" not in text


# ----------------------------------------------------------------------------- the ring


@pytest.mark.parametrize("argnums", [(0,), (1, 2)])
def test_the_ring_gives_the_cotangents_a_grad_asks_for(argnums):
    """jax.grad of q alone, or of k and v: the adjoint kernel outputs those cotangents only
    (``Kernel.adjoint(wrt=…)``), and the ring still runs it (it walks dQ, dK and dV together
    and gives those asked), collective-permutes and no all-gather; float64, 1e-12."""
    mesh = _mesh((2, 4), ("data", "seq"))
    q, k, v = _attn_inputs(np.float64, K=2)
    loss = lambda q, k, v: jnp.sum(jnp.sin(moajax.dot_product_attention(q, k, v, is_causal=True)))  # noqa: E731
    args = [_put(x, mesh, "data", "seq") for x in (q, k, v)]
    jg = jax.jit(jax.grad(loss, argnums=argnums))
    for a, b in zip(jg(*args), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)[argnums[0]:]):
        assert rel_err(a, b) <= 1e-12
    text = _hlo(jg, *args)
    assert "collective-permute" in text and "all-gather" not in text


def _under_vmap(case):
    """(function, arrays, their splits) of the ring-under-vmap cases: V = 2 examples of
    [1, 64, N, 8], the sequence over "seq" (a vmap's batch over "data" in one)."""
    r = np.random.default_rng(7)
    q, k, v = (jnp.asarray(r.standard_normal(s)) for s in ((2, 1, 64, 4, 8), (2, 1, 64, 2, 8), (2, 1, 64, 2, 8)))
    att = functools.partial(moajax.dot_product_attention, is_causal=True)
    seq = P(None, None, "seq")
    if case == "keys shared":  # the kv cotangents summed over the batch (``summed``)
        f = jax.grad(lambda q, k, v: jnp.sum(jnp.sin(jax.vmap(att, in_axes=(0, None, None))(q, k, v))), argnums=(0, 1, 2))
        return f, (q, k[0], v[0]), (seq, P(None, "seq"), P(None, "seq"))
    if case == "batch over data":
        f = jax.grad(lambda q, k, v: jnp.sum(jnp.sin(jax.vmap(att)(q, k, v))), argnums=(0, 1, 2))
        return f, (q, k, v), (P("data", None, "seq"),) * 3
    if case == "vmap of vmap":  # the outer batch shares k and v, the inner batches them
        f = jax.grad(lambda q, k, v: jnp.sum(jnp.sin(jax.vmap(lambda q: jax.vmap(att)(q, k, v))(q))), argnums=(0, 1, 2))
        return f, (jnp.stack([q, 2 * q, -q]), k, v), (P(None, None, None, "seq"), seq, seq)
    if case == "cotangent alone":  # (jax.jacrev's batch: q, k, v and Out shared by it)
        g = jnp.stack([jnp.sin(q[0]), jnp.cos(q[0]), q[0]])

        def f(q, k, v):
            return jax.vmap(jax.vjp(att, q, k, v)[1])(g)
        return f, (q[0], k[0], v[0]), (P(None, "seq"),) * 3
    f = lambda q, k, v: jax.jvp(jax.vmap(att), (q, k, v), (v[..., :1, :].repeat(4, -2), k, q[..., :2, :]))[1]  # noqa: E731
    return f, (q, k, v), (seq,) * 3


@pytest.mark.parametrize("case", ["keys shared", "batch over data", "vmap of vmap", "jvp", "cotangent alone"])
def test_the_ring_runs_under_vmap(case):
    """jax.vmap around the sequence-split attention runs the ring (``shard.UnderOmega``: the
    lift of the batched kernel is the cell's, one axis further in, run under vmap on each
    device), where it gathered the whole sequence (a fuzz, 2026-12-06): forward, gradient
    with a shared operand's cotangent summed over the batch, a batch split over "data", a
    vmap of a vmap, forward mode, and the cotangent batched alone (jax.jacrev's), whose block
    adjoint read its own keys' Δ until the ring's query, statistics and Out were batched with
    it (``batched_together``; a second fuzz: dQ and dK 28–43 % off). Float64 against the unsplit
    call, 1e-12; collective-permutes, no all-gather."""
    mesh = _mesh((2, 4), ("data", "seq"))
    f, xs, specs = _under_vmap(case)
    args = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(xs, specs)]
    jf = jax.jit(f)
    for a, b in zip(jax.tree.leaves(jf(*args)), jax.tree.leaves(f(*xs))):
        assert rel_err(a, b) <= 1e-12, case
    text = _hlo(jf, *args)
    assert "collective-permute" in text and "all-gather" not in text, case


def test_a_second_derivative_of_a_vmap_over_the_sequence_split_is_right():
    """grad of grad, and jvp of grad, of a vmap around the sequence-split attention: the
    second-order kernels, derived from the batched adjoint, are no cell under Ω and gather
    (``UnderOmega.for_dnf``), where their arguments were zipped with the batched kernel's
    flags and XLA's partitioner raised (a fuzz). Float64 against the unsplit call, 1e-12."""
    mesh = _mesh((2, 4), ("data", "seq"))
    r = np.random.default_rng(8)
    q, k, v = (jnp.asarray(r.standard_normal(s)) for s in ((2, 1, 16, 2, 4), (2, 1, 16, 1, 4), (2, 1, 16, 1, 4)))
    att = moajax.dot_product_attention
    g = lambda q, k, v: jax.grad(lambda q: jnp.sum(jnp.sin(jax.vmap(att)(q, k, v))))(q)  # noqa: E731
    second = {"grad of grad": lambda q, k, v: jax.grad(lambda q: jnp.sum(g(q, k, v) ** 2))(q),
              "jvp of grad": lambda q, k, v: jax.jvp(lambda q: g(q, k, v), (q,), (jnp.cos(q),))[1]}
    args = [jax.device_put(x, NamedSharding(mesh, P(None, None, "seq"))) for x in (q, k, v)]
    for name, f in second.items():
        assert rel_err(jax.jit(f)(*args), f(q, k, v)) <= 1e-12, name


@pytest.mark.parametrize("dtype,causal,heads", [(np.float64, True, 2), (np.float64, False, 4),
                                                (np.float32, True, 4)])
def test_sequence_split_runs_the_ring_under_jit(dtype, causal, heads):
    """q, k, v split along the sequence: dot_product_attention under jit lifts the key axis
    over the mesh (the ring), forward and gradient (saving; holding nothing, the saving forward
    rerun in the backward; recomputing in the backward's kernels), with collective-permutes and
    no all-gather."""
    mesh = _mesh((2, 4), ("data", "seq"))
    q, k, v = _attn_inputs(dtype, K=heads)
    for residuals in ("save", "none", "recompute"):
        f = lambda q, k, v: moajax.dot_product_attention(q, k, v, is_causal=causal, residuals=residuals)  # noqa: E731
        loss = lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))  # noqa: E731
        args = [_put(x, mesh, "data", "seq") for x in (q, k, v)]
        jf, jg = jax.jit(f), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        assert rel_err(jf(*args), f(q, k, v)) <= TOL[dtype]
        for a, b in zip(jg(*args), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)):
            assert rel_err(a, b) <= TOL[dtype]
        text = _hlo(jg, *args)
        assert "collective-permute" in text and "all-gather" not in text


def test_the_rings_balance_under_jit_is_a_preset_choice():
    """The sequence split's ring order is schedule data: ``Preset.of(ring="contiguous")``
    keeps the inputs' own split (no reorder), "zigzag" (the causal default) reorders each
    kernel's blocks there and back. Both give the one-device forward and gradient (float64);
    the contiguous program moves fewer blocks (no reorder's collective-permutes), neither
    all-gathers. A balance not in ``ring.BALANCES`` is refused, naming the argument."""
    mesh = _mesh((8,), ("seq",))
    q, k, v = _attn_inputs(np.float64, B=1, T=64)
    args = [_put(x, mesh, None, "seq") for x in (q, k, v)]
    want_loss = lambda q, k, v: jnp.sum(jnp.sin(moajax.dot_product_attention(q, k, v, is_causal=True)))  # noqa: E731
    want = jax.grad(want_loss, argnums=(0, 1, 2))(q, k, v)
    permutes = {}
    for ring in ("zigzag", "contiguous"):
        onf = moajax.Preset.of(ring=ring)
        f = lambda q, k, v: moajax.dot_product_attention(q, k, v, is_causal=True, onf=onf)  # noqa: E731
        assert rel_err(jax.jit(f)(*args), f(q, k, v)) <= TOL[np.float64]
        g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v))), argnums=(0, 1, 2)))
        for a, b in zip(g(*args), want):
            assert rel_err(a, b) <= TOL[np.float64]
        text = _hlo(g, *args)
        assert "all-gather" not in text
        permutes[ring] = text.count("collective-permute(")
    assert 0 < permutes["contiguous"] < permutes["zigzag"]
    with pytest.raises(ValueError, match="ring must be one of"):
        moajax.Preset.of(ring="striped")


@pytest.mark.parametrize("T,causal,balance", [(8, True, "zigzag"), (4, False, "contiguous"),
                                              (8, False, "contiguous"), (16, True, "zigzag")])
def test_a_presets_ring_that_cannot_take_a_split_seen_only_by_xla_gathers_with_a_warning(T, causal, balance):
    """Under jax.jit with automatic axes a split is seen only as XLA partitions the call; a
    Preset's ring (2 rounds here) that cannot take it — too few queries for its chunks, or
    blocks of one key in the gradient — raised its ValueError there, which reached the caller
    as XLA's INTERNAL error (the forward or the gradient, each of these four). Now the
    sequence is gathered with a RuntimeWarning naming the Preset's ring, and the results are
    one device's (float64, 1e-12). Seen while tracing, the ValueError still refuses it."""
    mesh = _mesh((4,), ("seq",))
    q, k, v = _attn_inputs(np.float64, B=1, T=T, N=2, K=2, H=4, seed=T)
    args = [_put(x, mesh, None, "seq") for x in (q, k, v)]
    onf = moajax.Preset.of(ring=balance, ring_rounds=2)
    f = lambda q, k, v: moajax.dot_product_attention(q, k, v, is_causal=causal, onf=onf)  # noqa: E731
    loss = lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))  # noqa: E731
    one = lambda q, k, v: moajax.dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
    with pytest.warns(RuntimeWarning, match="the Preset's ring"):
        out = jax.jit(f)(*args)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
    assert rel_err(out, one(q, k, v)) <= TOL[np.float64]
    want = jax.grad(lambda q, k, v: jnp.sum(jnp.sin(one(q, k, v))), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(grads, want):
        assert rel_err(a, b) <= TOL[np.float64]


@pytest.mark.parametrize("balance,causal", [("zigzag", True), ("contiguous", True), ("contiguous", False)])
def test_the_ring_in_rounds(balance, causal):
    """``rounds=R``: each K and V block (and in the backward dK and dV) travels in R pieces,
    the diagonal pair's causal mask cut along both axes (query piece q against key piece j:
    whole below, masked on, skipped above the diagonal). Forward, gradient and forward mode
    equal the one-device ones in float64 for R = 2 and 4 (pieces of 2 keys under zigzag), and
    the compiled program holds as many conditionals for either (the pieces are a loop);
    the bytes sent are ``cost.ring_bytes``'s, which R does not change (the same blocks in
    smaller sends). A rounds count that does not cut the chunks evenly is refused."""
    mesh = _mesh((4,), ("seq",))
    q, k, v = _attn_inputs(np.float64, B=1, T=64)
    dots = _attn_inputs(np.float64, B=1, T=64, seed=1)
    one = lambda q, k, v: moajax.dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
    loss = lambda f: (lambda *a: jnp.sum(jnp.sin(f(*a))))  # noqa: E731
    want = (one(q, k, v), jax.grad(loss(one), argnums=(0, 1, 2))(q, k, v), jax.jvp(one, (q, k, v), dots)[1])
    local = lambda x: (x.shape[0], x.shape[1] // 4) + x.shape[2:]  # noqa: E731
    shapes = (local(q), local(k), local(v))
    branches = {}
    for rounds in (2, 4):
        f = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, axis_name="seq", is_causal=causal,  # noqa: E731
                                           balance=balance, rounds=rounds)
        # jitted: eager, each of the ring's many small steps compiles on its own (minutes)
        assert rel_err(jax.jit(f)(q, k, v), want[0]) <= TOL[np.float64]
        branches[rounds] = _hlo(jax.jit(f), q, k, v).count(" conditional(")
        for a, b in zip(jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(q, k, v), want[1]):
            assert rel_err(a, b) <= TOL[np.float64]
        assert rel_err(jax.jit(lambda *a: jax.jvp(f, a, dots)[1])(q, k, v), want[2]) <= TOL[np.float64]
        both = jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2)))(q, k, v).jaxpr
        ring = Ring("seq", 4, balance, rounds)
        assert str(ring).endswith(f"{rounds} rounds)")
        assert max(_ppermute_bytes(both, d) for d in range(4)) == (
            cost.ring_bytes(ring, *shapes, 8) + cost.ring_bytes(ring, *shapes, 8, backward=True))
    # the diagonal pair's pieces are a loop: the program does not grow with R (it held R copies)
    assert branches[2] == branches[4] and (branches[2] > 0) == causal  # (no mask: no pieces to choose)
    with pytest.raises(ValueError, match="pieces each"):
        ring_attention(q, k, v, mesh=mesh, axis_name="seq", is_causal=causal, balance=balance, rounds=3)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="rounds must be a positive int"):
            ring_attention(q, k, v, mesh=mesh, axis_name="seq", rounds=bad)
        with pytest.raises(ValueError, match="rounds must be a positive int"):
            Ring("seq", 4, balance, bad)
        with pytest.raises(ValueError, match="ring_rounds must be a positive int"):
            moajax.Preset.of(ring_rounds=bad)


def test_the_presets_ring_reaches_every_kernel_under_jit():
    """Under jit the sequence split's saving forward, adjoint and tangent are kernels of their
    own; a Preset's ring (balance and rounds) reaches each. With ``ring="contiguous"`` every
    collective-permute of jit(grad) and of jit(jvp) is the ring's step — none reorders to
    zigzag (the adjoint and the tangent once took the causal default, zigzag, whatever the
    Preset said). Results: the one-device ones (float64). ``ring_rounds`` cuts what is in
    flight: jit(grad)'s temp memory per device falls with 4 rounds (compiled at S = 8192 over
    8 devices, pieces of 256 keys) by at least the travelling blocks' three quarters."""
    import re

    mesh = _mesh((8,), ("seq",))
    q, k, v = _attn_inputs(np.float64, B=1, T=64)
    args = [_put(x, mesh, None, "seq") for x in (q, k, v)]
    onf = moajax.Preset.of(ring="contiguous", ring_rounds=2)
    f = lambda q, k, v, onf=onf: moajax.dot_product_attention(q, k, v, is_causal=True, onf=onf)  # noqa: E731
    loss = lambda q, k, v, onf=onf: jnp.sum(jnp.sin(f(q, k, v, onf)))  # noqa: E731
    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    for a, b in zip(g(*args), jax.grad(loss, argnums=(0, 1, 2))(q, k, v, None)):
        assert rel_err(a, b) <= TOL[np.float64]
    t = jax.jit(lambda *a: jax.jvp(f, a, a)[1])
    assert rel_err(t(*args), jax.jvp(lambda *a: f(*a, None), (q, k, v), (q, k, v))[1]) <= TOL[np.float64]
    step = "{" + ",".join(f"{{{d},{(d + 1) % 8}}}" for d in range(8)) + "}"
    for fn in (g, t):
        pairs = re.findall(r"collective-permute\([^\n]*source_target_pairs=(\{\{[0-9,{}]*\}\})", _hlo(fn, *args))
        assert pairs and set(pairs) == {step}

    big = [_put(jnp.zeros((1, 8192, 4, 32), np.float32), mesh, None, "seq") for _ in range(3)]
    temp = {}
    for rounds in (1, 4):
        onf = moajax.Preset.of(ring="contiguous", ring_rounds=rounds)
        fn = jax.jit(jax.grad(lambda q, k, v, onf=onf: jnp.sum(f(q, k, v, onf) ** 2), argnums=(0, 1, 2)))
        temp[rounds] = fn.lower(*big).compile().memory_analysis().temp_size_in_bytes
    # K, V, dK and dV blocks travel (1024 keys × 4 heads × 32 × 4 B each): 4 rounds hold a
    # quarter of them, so the temp falls by at least the other three quarters. (How much else
    # a device holds, and so the ratio, is the plan's, which follows the machine profile's
    # caches: 11.5 → 8.0 MB under the generic profile on a 2-core EPYC, 20.3 → 8.0 under Delta's)
    in_flight = 4 * 1024 * 4 * 32 * 4
    assert temp[1] - temp[4] >= 3 * in_flight / 4


@pytest.mark.parametrize("balance", ["zigzag", "contiguous"])
def test_ring_attention_with_batch_and_head_axes(balance):
    mesh = _mesh((2, 2, 2), ("data", "model", "seq"))
    q, k, v = _attn_inputs(np.float64, B=2, T=32, N=4, K=2)
    kw = dict(mesh=mesh, axis_name="seq", is_causal=True, balance=balance, batch_axis="data", head_axis="model")
    f = lambda q, k, v: ring_attention(q, k, v, **kw)  # noqa: E731
    ref = lambda q, k, v: moajax.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    assert rel_err(jax.jit(f)(q, k, v), ref(q, k, v)) <= 1e-12
    loss = lambda fn: (lambda q, k, v: jnp.sum(fn(q, k, v) ** 3))  # noqa: E731
    for a, b in zip(jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(q, k, v),
                    jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)):
        assert rel_err(a, b) <= 1e-12


@pytest.mark.parametrize("causal", [True, False])
def test_the_sequence_split_returns_the_residual(causal):
    """return_residual under the ring: lse = m + log l of the combined (max, sum), each device
    its rows' — under jit (the lifted kernel with lse), of concrete arrays (ring_attention),
    and with batch and head axes; the gradient holds lse constant (float64)."""
    q, k, v = _attn_inputs(np.float64, B=2, T=32, N=4, K=2)
    kw = dict(is_causal=causal, return_residual=True)
    want_out, want_lse = moajax.dot_product_attention(q, k, v, **kw)
    f = lambda q, k, v: moajax.dot_product_attention(q, k, v, **kw)  # noqa: E731
    mesh = _mesh((2, 4), ("data", "seq"))
    args = [_put(x, mesh, "data", "seq") for x in (q, k, v)]
    loss = lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)[0])) + jnp.sum(f(q, k, v)[1] ** 2)  # noqa: E731
    want_grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    jg = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    for got in (jax.jit(f)(*args), f(*args),
                ring_attention(q, k, v, mesh=_mesh((2, 2, 2), ("data", "model", "seq")), axis_name="seq",
                               batch_axis="data", head_axis="model", is_causal=causal, return_residual=True)):
        assert rel_err(got[0], want_out) <= 1e-12 and rel_err(got[1], want_lse) <= 1e-12
        assert got[1].shape == (2, 32, 4) and got[1].dtype == np.float64
    for a, b in zip(jg(*args), want_grads):
        assert rel_err(a, b) <= 1e-12
    text = _hlo(jg, *args)
    assert "collective-permute" in text and "all-gather" not in text


def test_the_ring_takes_16_bit_inputs():
    """bfloat16 through the ring, under jit (the lifted kernels) and as ring_attention: the
    16-bit kernel's saving forward also saves Out before rounding, which the ring merges and
    its adjoints read; each device sums its dQ, dK and dV partials in float32 (dK and dV
    travel in it) and rounds once. Against float64 (``references``) on the same bfloat16
    inputs: the forward within one bfloat16 rounding of Out (8 significant bits: unit
    roundoff 2⁻⁸), the gradients within bfloat16's epsilon 2⁻⁷ of the largest — they pass
    four roundings (Out, dOut, each block's partial, the sum) that do not all reach their
    worst at one element; whatever the device count (summed in bfloat16, as the ring once
    did, 8 devices exceed it)."""
    f = lambda q, k, v: moajax.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    loss = lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) ** 2)  # noqa: E731
    jg = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    # batch split too; one batch element (the saved values' layouts drop its axis); 8 devices
    for B, mesh, spec in ((2, _mesh((2, 4), ("data", "seq")), ("data", "seq")), (1, _mesh((4,), ("seq",)), (None, "seq")),
                          (1, _mesh((8,), ("seq",)), (None, "seq"))):
        q, k, v = (x.astype(jnp.bfloat16) for x in _attn_inputs(np.float32, B=B, T=32, N=4, K=2))
        want = references.mha(q, k, v, is_causal=True)
        want_grads = references.mha_backward(q, k, v, 2 * want, is_causal=True)
        args = [_put(x, mesh, *spec) for x in (q, k, v)]
        assert rel_err(jax.jit(f)(*args).astype(np.float32), want) <= 2.0**-8
        for a, b in zip(jg(*args), want_grads):
            assert a.dtype == jnp.bfloat16 and rel_err(a.astype(np.float32), b) <= 2.0**-7
        assert "all-gather" not in _hlo(jg, *args)
    out, lse = ring_attention(q, k, v, mesh=_mesh((4,), ("seq",)), axis_name="seq", return_residual=True)
    want_out, want_lse = moajax.dot_product_attention(q, k, v, return_residual=True)
    assert lse.dtype == jnp.bfloat16 and rel_err(lse.astype(np.float32), want_lse.astype(np.float32)) <= 2.0**-8
    assert rel_err(out.astype(np.float32), want_out.astype(np.float32)) <= 2.0**-8


def _softmax_attention(q, k, v, causal):
    """softmax(Q Kᵀ / √H [causal]) V written out in jax.numpy, GQA by repeating the kv heads:
    an oracle for derivatives (float64) that shares no code with moajax."""
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    if causal:
        s = jnp.where(np.tril(np.ones(s.shape[-2:], bool)), s, -jnp.inf)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v)


def test_the_ring_runs_forward_mode_in_16_bits():
    """bfloat16 jvp through the ring (as ring_attention, and the sequence split under jit): K,
    V and their tangents travel in bfloat16 and are widened where a block reads them, the
    blocks and merges run in float32, and Out̊ is rounded once. Against float64 jvp of the
    same bfloat16 values (``_softmax_attention``): within one bfloat16 rounding, 2⁻⁸ (its
    unit roundoff; float32's part is ~1e-6). Blocks run in bfloat16 instead exceed it on 8
    devices."""
    q, k, v = (x.astype(jnp.bfloat16) for x in _attn_inputs(np.float32, B=1, T=32, N=4, K=2))
    r = np.random.default_rng(6)
    dots = tuple(jnp.asarray(r.standard_normal(x.shape)).astype(jnp.bfloat16) for x in (q, k, v))
    wide = lambda xs: tuple(jnp.asarray(x, np.float64) for x in xs)  # noqa: E731
    want = jax.jvp(lambda *a: _softmax_attention(*a, True), wide((q, k, v)), wide(dots))[1]
    f = lambda q, k, v: moajax.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    for n in (4, 8):
        mesh = _mesh((n,), ("seq",))
        ring = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, axis_name="seq", is_causal=True)  # noqa: E731
        put = lambda xs: tuple(_put(x, mesh, None, "seq") for x in xs)  # noqa: E731
        jvp = jax.jit(lambda xs, ts: jax.jvp(f, xs, ts))
        for got in (jax.jit(lambda xs, ts: jax.jvp(ring, xs, ts))((q, k, v), dots)[1], jvp(put((q, k, v)), put(dots))[1]):
            assert got.dtype == jnp.bfloat16 and rel_err(got.astype(np.float64), want) <= 2.0**-8


@pytest.mark.parametrize("causal,residual", [(True, False), (False, True)])
def test_the_ring_runs_forward_mode(causal, residual):
    """jax.jvp through the sequence split: under jit the tangent kernel is lifted too, and
    ``ring_attention`` is differentiable in forward mode. Each block's (Out, lse) and their
    tangents come from the attention kernel with a differentiable lse (its tangent kernel,
    derived); the ring merges them by the softmax monoid's tangent. float64 against one
    device's jvp, rel ≤ 1e-12; lse's tangent is 0 (held constant); also jax.linearize."""
    q, k, v = _attn_inputs(np.float64, B=2, T=32, N=4, K=2)
    r = np.random.default_rng(5)
    dots = tuple(jnp.asarray(r.standard_normal(x.shape)) for x in (q, k, v))
    f = lambda q, k, v: moajax.dot_product_attention(q, k, v, is_causal=causal, return_residual=residual)  # noqa: E731
    want = jax.tree.leaves(jax.jvp(f, (q, k, v), dots))
    mesh = _mesh((2, 4), ("data", "seq"))
    put = lambda xs: tuple(_put(x, mesh, "data", "seq") for x in xs)  # noqa: E731
    ring = lambda q, k, v: ring_attention(q, k, v, mesh=_mesh((2, 2, 2), ("data", "model", "seq")),  # noqa: E731
                                          axis_name="seq", batch_axis="data", head_axis="model", is_causal=causal,
                                          return_residual=residual)
    jvp = jax.jit(lambda xs, ts, fn: jax.jvp(fn, xs, ts), static_argnums=2)
    # (jitted: eager, each of the ring's small steps compiles on its own; the forward runs eager elsewhere)
    for got in (jvp(put((q, k, v)), put(dots), f), jvp((q, k, v), dots, ring)):
        for a, b in zip(jax.tree.leaves(got), want):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert (rel_err(a, b) <= 1e-12) if np.any(b) else not np.any(a)
    out, lin = jax.linearize(jax.jit(f), *put((q, k, v)))
    assert rel_err(jax.tree.leaves(lin(*put(dots)))[0], want[len(want) // 2]) <= 1e-12


def test_a_second_derivative_through_the_ring_is_refused_with_what_to_do():
    """The ring runs first derivatives; a Hessian-vector product through ``ring_attention``
    raises naming it and pointing to what gives one: ``dot_product_attention`` on unsplit
    inputs, whose second derivative (float64; saving residuals or not) matches that of a
    softmax written out in jax.numpy (``_softmax_attention``) at 1e-12. (Not jax.nn's: it keeps
    its logits in float32, test_api.py.)"""
    q, k, v = _attn_inputs(np.float64, B=1, T=16, N=2, K=2)
    mesh = _mesh((4,), ("seq",))
    ring = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, axis_name="seq", is_causal=True)  # noqa: E731
    hvp = lambda f: jax.jvp(jax.grad(lambda q: jnp.sum(jnp.sin(f(q, k, v)))), (q,), (v,))[1]  # noqa: E731
    with pytest.raises(NotImplementedError, match="ring_attention: a second derivative .* first derivatives only.*"
                                                  "dot_product_attention on inputs not split along the sequence"):
        hvp(ring)
    for residuals in ("save", "recompute"):
        got = hvp(lambda q, k, v: moajax.dot_product_attention(q, k, v, is_causal=True, residuals=residuals))
        assert rel_err(got, hvp(lambda q, k, v: _softmax_attention(q, k, v, True))) <= 1e-12


def test_the_ring_takes_a_value_head_dim_of_one():
    """E = 1: the row statistics have Out's size, and are saved all the same (the ring reads
    them); forward and gradient against one device (float64)."""
    q, k, _ = _attn_inputs(np.float64, B=1, T=32, N=2, K=2)
    v = jnp.asarray(np.random.default_rng(2).standard_normal((1, 32, 2, 1)))
    f = lambda q, k, v: moajax.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    loss = lambda fn: (lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v))))  # noqa: E731
    mesh = _mesh((4,), ("seq",))
    ring = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, axis_name="seq", is_causal=True)  # noqa: E731
    want = jax.grad(loss(f), argnums=(0, 1, 2))(q, k, v)
    args = [_put(x, mesh, None, "seq") for x in (q, k, v)]
    assert rel_err(jax.jit(f)(*args), f(q, k, v)) <= 1e-12 and rel_err(ring(q, k, v), f(q, k, v)) <= 1e-12
    for got in (jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(*args),
                jax.jit(jax.grad(loss(ring), argnums=(0, 1, 2)))(q, k, v)):
        for a, b in zip(got, want):
            assert rel_err(a, b) <= 1e-12


def test_sequence_split_of_concrete_arrays_picks_the_ring():
    mesh = _mesh((8,), ("seq",))
    q, k, v = _attn_inputs(np.float64, B=1, T=128)
    out = moajax.dot_product_attention(*(_put(x, mesh, None, "seq") for x in (q, k, v)), is_causal=True)
    assert out.sharding.spec[1] == "seq"
    assert rel_err(out, moajax.dot_product_attention(q, k, v, is_causal=True)) <= 1e-12


def _ppermute_bytes(jaxpr, device: int) -> int:
    """Bytes ``device`` sends to another device, read off a jaxpr's ppermutes: a scan's body
    counted ``length`` times, a cond's costliest branch."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "ppermute" and any(s == device and t != device for s, t in eqn.params["perm"]):
            total += sum(int(np.prod(x.aval.shape)) * x.aval.dtype.itemsize for x in eqn.invars)
        for name, value in eqn.params.items():
            inner = [_ppermute_bytes(j, device) for j in sub_jaxprs(value)]
            if not inner:
                continue
            if eqn.primitive.name == "cond":
                total += max(inner)
            else:
                total += sum(inner) * (eqn.params["length"] if eqn.primitive.name == "scan" else 1)
    return total


@pytest.mark.parametrize("balance,dtype", [("zigzag", np.float32), ("contiguous", np.float32),
                                           ("zigzag", jnp.bfloat16)])
def test_ring_bytes_is_what_the_program_sends(balance, dtype):
    """cost.ring_bytes against the ppermutes of the traced program (forward, forward +
    backward, and forward + the ring of tangents), for the busiest device; bfloat16: dK and dV
    travel in float32, K, V and their tangents in bfloat16."""
    mesh = _mesh((4,), ("seq",))
    q, k, v = (x.astype(dtype) for x in _attn_inputs(np.float32, B=1, T=64))
    size = np.dtype(dtype).itemsize
    f = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, axis_name="seq", is_causal=True, balance=balance)  # noqa: E731
    ring = Ring("seq", 4, balance)
    local = lambda x: (x.shape[0], x.shape[1] // 4) + x.shape[2:]  # noqa: E731
    shapes = (local(q), local(k), local(v))
    fwd = jax.make_jaxpr(f)(q, k, v).jaxpr
    both = jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2)))(q, k, v).jaxpr
    sent_fwd = max(_ppermute_bytes(fwd, d) for d in range(4))
    sent_both = max(_ppermute_bytes(both, d) for d in range(4))
    assert sent_fwd == cost.ring_bytes(ring, *shapes, size)
    # grad's program runs the forward once and the backward once
    assert sent_both == cost.ring_bytes(ring, *shapes, size) + cost.ring_bytes(ring, *shapes, size, backward=True)
    # jvp's program runs the saving forward once and the ring of tangents once
    tan = jax.make_jaxpr(lambda *a: jax.jvp(f, a, a))(q, k, v).jaxpr
    sent_tan = max(_ppermute_bytes(tan, d) for d in range(4))
    assert sent_tan == cost.ring_bytes(ring, *shapes, size) + cost.ring_bytes(ring, *shapes, size, tangent=True)
    with pytest.raises(ValueError, match="ask for one"):
        cost.ring_bytes(ring, *shapes, size, backward=True, tangent=True)


def test_ring_bytes_of_the_sequence_split_under_jit():
    """Under jit the sequence split's saving forward and adjoint are two partitioned kernels
    (``ring.SequenceLift``) whose interface is the inputs' contiguous split, so the backward
    reorders Q, K, V and Out again, and the tangent kernel Q, K and V:
    cost.ring_bytes(residuals_in_ring_order=False) against the ppermutes of the per-device
    programs."""
    from jax.sharding import PartitionSpec as P

    from moajax import compat
    from moajax.kernels.attention import mha_kernel
    from moajax.ring import _Lifted

    devices, T, N, H = 4, 64, 4, 8
    mesh = _mesh((devices,), ("seq",))
    kern = mha_kernel(None, None, False, False, False, None)
    blk, stats = (1, T // devices, N, H), (T // devices, N)
    opts = dict(is_causal=True)
    saving = _Lifted(kern, "saving", opts).per_device("seq", devices, [blk] * 3, [stats, stats, blk])
    adjoint = _Lifted(kern, "adjoint_saved", opts).per_device("seq", devices, [blk] * 4 + [stats, stats, blk],
                                                              [blk] * 3)
    x, s = P(None, "seq"), P("seq")
    fwd = compat.shard_map(saving, mesh=mesh, in_specs=(x,) * 3, out_specs=(s, s, x))
    bwd = compat.shard_map(adjoint, mesh=mesh, in_specs=(x,) * 4 + (s, s, x), out_specs=(x,) * 3)
    a = jax.ShapeDtypeStruct((1, T, N, H), np.float32)
    st = jax.ShapeDtypeStruct((T, N), np.float32)
    sent_fwd = max(_ppermute_bytes(jax.make_jaxpr(fwd)(a, a, a).jaxpr, d) for d in range(devices))
    sent_bwd = max(_ppermute_bytes(jax.make_jaxpr(bwd)(a, a, a, a, st, st, a).jaxpr, d) for d in range(devices))
    forward = _Lifted(kern, "forward", opts).per_device("seq", devices, [blk] * 3, [blk])
    plain = compat.shard_map(forward, mesh=mesh, in_specs=(x,) * 3, out_specs=x)
    sent_plain = max(_ppermute_bytes(jax.make_jaxpr(plain)(a, a, a).jaxpr, d) for d in range(devices))
    tangent = _Lifted(kern, "tangent", opts).per_device("seq", devices, [blk] * 6, [blk])
    tan = compat.shard_map(tangent, mesh=mesh, in_specs=(x,) * 6, out_specs=x)
    sent_tan = max(_ppermute_bytes(jax.make_jaxpr(tan)(*[a] * 6).jaxpr, d) for d in range(devices))
    ring = Ring("seq", devices, "zigzag")
    assert sent_fwd == cost.ring_bytes(ring, blk, blk, blk, 4, residuals_in_ring_order=False)
    assert sent_plain == cost.ring_bytes(ring, blk, blk, blk, 4)  # the forward alone: no statistics back
    assert sent_bwd == cost.ring_bytes(ring, blk, blk, blk, 4, backward=True, residuals_in_ring_order=False)
    assert sent_bwd > cost.ring_bytes(ring, blk, blk, blk, 4, backward=True)
    assert sent_tan == cost.ring_bytes(ring, blk, blk, blk, 4, tangent=True, residuals_in_ring_order=False)
    assert sent_tan > cost.ring_bytes(ring, blk, blk, blk, 4, tangent=True)


def test_the_sequence_lift_reaches_kernels_derived_before_it():
    """A kernel's saving forward and adjoints are cached on it; the ring's lift, set on the
    primal when a sequence split first meets it, must reach those derived before (the suite
    once evicted mha's cached kernel, rebuilt it, derived its saving forward outside a mesh,
    and the sequence split then raised 'cannot honour')."""
    from moajax import ring
    from moajax.kernel import Kernel
    from moajax.kernels.attention import mha

    fresh = Kernel(mha.fn, example=mha.example, name="mha_fresh")
    specs = [jax.ShapeDtypeStruct((1, 8, 2, 4), np.float32)] * 3
    saving, adjoint = fresh.with_row_statistics(()), fresh.adjoint(*specs)
    assert saving.mesh_lift is None and adjoint.mesh_lift is None
    ring.sequence_lift(fresh)
    assert fresh.mesh_lift is not None
    assert saving.mesh_lift is fresh.mesh_lift and adjoint.mesh_lift is fresh.mesh_lift
    assert fresh.tangent(*specs).mesh_lift is fresh.mesh_lift


# ----------------------------------------------------------------------------- errors


def _gathers_logged(monkeypatch, caplog):
    """A fresh log of shard's gather warnings (each is logged once a process)."""
    import logging

    monkeypatch.setattr(shard, "_GATHER_LOGGED", set())
    caplog.set_level(logging.WARNING, logger="moajax")
    return lambda: " ".join(r.getMessage() for r in caplog.records if "gathers" in r.getMessage())


def test_a_split_head_dim_is_gathered_and_named(monkeypatch, caplog):
    """A split the kernel cannot honour (the contracted head dim) is gathered, as XLA gathers
    for jax.nn: the compiled program all-gathers the inputs, the result is one device's, and
    one warning names the axis and why. Before 2026-12-05 it raised, under jit as XLA's
    INTERNAL error from its partitioner."""
    logged = _gathers_logged(monkeypatch, caplog)
    mesh = _mesh((4,), ("model",))
    q, k, v = _attn_inputs(np.float32)
    split = [_put(x, mesh, None, None, None, "model") for x in (q, k, v)]
    want = moajax.dot_product_attention(q, k, v)
    assert rel_err(moajax.dot_product_attention(*split), want) <= TOL[np.float32]
    assert re.search(r"query axis 3 \(h\).*over mesh axis model: .*h is reduced inside the kernel", logged())
    run = jax.jit(moajax.dot_product_attention)
    assert rel_err(run(*split), want) <= TOL[np.float32]
    assert "all-gather" in _hlo(run, *split)


def test_a_window_under_a_sequence_split_is_gathered_not_dropped():
    """The windowed call shares the plain kernel (the window is an option), whose ring lift a
    plain call set first: under jit with the sequence split, the ring (which has no window)
    must not run it — it once did, silently, 2.3 off; then the split's check refused it; now
    the sequence is gathered and the window kept."""
    mesh = _mesh((4,), ("seq",))
    q, k, v = _attn_inputs(np.float64, B=1, T=32, N=2, K=2)
    args = [_put(x, mesh, None, "seq") for x in (q, k, v)]
    plain = jax.jit(lambda q, k, v: moajax.dot_product_attention(q, k, v, is_causal=True))
    assert rel_err(plain(*args), moajax.dot_product_attention(q, k, v, is_causal=True)) <= 1e-12
    window = lambda q, k, v: moajax.dot_product_attention(q, k, v, local_window_size=(3, 0))  # noqa: E731
    want = window(q, k, v)  # one device (the variants' own tests check it against a reference)
    assert rel_err(jax.jit(window)(*args), want) <= 1e-12
    assert rel_err(window(*args), want) <= 1e-12


def test_splits_jax_nn_takes_run_gathered_as_one_device(monkeypatch, caplog):
    """Inputs split as a drop-in's caller may split them, which no kernel split honours: the
    sequence beside a mask, a bias, lengths or a score_mod, eager, under jit, in the gradient
    and under vmap; GQA's 8 query heads over 8 devices with 2 kv heads. Each as on one device
    (float64, 1e-12); before 2026-12-05 eager raised, and jit and vmap failed inside XLA's
    partitioner with an INTERNAL error (a helper's review)."""
    logged = _gathers_logged(monkeypatch, caplog)
    mesh = _mesh((4,), ("seq",))
    r = np.random.default_rng(11)
    q, k, v = _attn_inputs(np.float64, B=2, T=16, N=4, K=2, seed=11)
    args = [_put(x, mesh, None, "seq") for x in (q, k, v)]
    mask = jnp.asarray(r.random((2, 1, 16, 16)) > 0.3)
    bias = jnp.asarray(r.standard_normal((1, 4, 16, 16)))
    table = jnp.asarray(r.standard_normal(31))
    variants = {
        "mask": dict(mask=mask, is_causal=True),
        "bias": dict(bias=bias),
        "lengths": dict(query_seq_lengths=jnp.asarray([16, 9]), key_value_seq_lengths=jnp.asarray([5, 16])),
        "score_mod": dict(score_mod=lambda s, b, h, i, j: s + table[i - j + 15]),
    }
    for name, kw in variants.items():
        f = lambda q, k, v, kw=kw: moajax.dot_product_attention(q, k, v, **kw)  # noqa: E731
        loss = lambda q, k, v, f=f: jnp.sum(jnp.sin(f(q, k, v)))  # noqa: E731
        want, wgrad = f(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
        assert rel_err(f(*args), want) <= 1e-12, name
        assert rel_err(jax.jit(f)(*args), want) <= 1e-12, name
        for a, b in zip(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args), wgrad):
            assert rel_err(a, b) <= 1e-12, name
    assert re.search(r"key axis 1 \(s\).*over mesh axis seq: .*s is ", logged())
    # a vmap over the batch of [T, N, H] calls, the sequence split (no ring under vmap)
    vm = jax.vmap(moajax.dot_product_attention)
    assert rel_err(vm(*args), moajax.dot_product_attention(q, k, v)) <= 1e-12
    assert rel_err(jax.jit(vm)(*args), moajax.dot_product_attention(q, k, v)) <= 1e-12
    # 8 query heads split 8 ways, but they share 2 kv heads: the class (kv head) has extent 2
    mesh8 = _mesh((8,), ("heads",))
    qh, kh, vh = _attn_inputs(np.float64, N=8, K=2)
    split = _put(qh, mesh8, None, None, "heads")
    want = moajax.dot_product_attention(qh, kh, vh)
    assert rel_err(moajax.dot_product_attention(split, kh, vh), want) <= 1e-12
    assert "its 8 devices do not divide n_kv's extent 2" in logged()
    # under jit too, where Shardy splits the kv-head class over 2 of the 8 devices, a split no
    # PartitionSpec names (JAX's own decoding raised IndivisibleError inside XLA's partitioner)
    assert rel_err(jax.jit(moajax.dot_product_attention)(split, kh, vh), want) <= 1e-12


def test_one_key_a_device_and_uneven_splits_under_jit():
    """Found by a helper's fuzz of the gather (float64, against one device, 1e-12):
    - a mask split along S with one key a device: the adjoint's key class is a monoid class
      (dQ = Σ_s …), and the per-device kernel, derived over one key, dropped that sum and with
      it Δ read from the whole row's Out — jit(grad) gave dQ and dK 0.6–1.3 off, silently. A
      monoid class is now split only where each device holds 2 elements or more;
    - the ring's gradient over blocks of one key (4 keys over 4 devices; causal over 2, zigzag's
      chunks of one): an INTERNAL error inside XLA's partitioner; now gathered;
    - uneven splits under jit (2 batch elements, 2 kv heads, over 4 devices): INTERNAL errors
      from JAX's decoding of the partitioner's shardings before compat.partition_spec."""
    loss = lambda f: (lambda *a: jnp.sum(jnp.sin(f(*a))))  # noqa: E731
    r = np.random.default_rng(12)
    for S in (4, 8):
        mesh = _mesh((S,), ("x",))
        q, k, v = (jnp.asarray(r.standard_normal((1, S, 1, 2))) for _ in range(3))
        m = jnp.asarray(r.random((1, 1, S, S)) < 0.7)
        f = loss(lambda q, k, v, m: moajax.dot_product_attention(q, k, v, mask=m))
        want = jax.grad(f, argnums=(0, 1, 2))(q, k, v, m)
        for a, b in zip(jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, k, v, _put(m, mesh, None, None, None, "x")), want):
            assert rel_err(a, b) <= 1e-12
    for devices, causal in ((4, False), (2, True)):
        mesh = _mesh((devices,), ("x",))
        q, k, v = (jnp.asarray(r.standard_normal((1, 4, 1, 2))) for _ in range(3))
        f = loss(lambda q, k, v: moajax.dot_product_attention(q, k, v, is_causal=causal))
        want = jax.grad(f, argnums=(0, 1, 2))(q, k, v)
        got = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(*(_put(x, mesh, None, "x") for x in (q, k, v)))
        for a, b in zip(got, want):
            assert rel_err(a, b) <= 1e-12
    mesh = _mesh((4,), ("x",))
    c = lambda x, *spec: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))  # noqa: E731
    x, w = jnp.asarray(r.standard_normal((2, 8, 16))), jnp.asarray(1 + 0.1 * r.standard_normal(16))
    assert rel_err(jax.jit(lambda x, w: moajax.rms_norm(c(x, "x"), w))(x, w), moajax.rms_norm(x, w)) <= 1e-12
    q, k = jnp.asarray(r.standard_normal((1, 4, 4, 2))), jnp.asarray(r.standard_normal((1, 4, 2, 2)))
    got = jax.jit(lambda q, k: moajax.dot_product_attention(q, c(k, None, None, "x"), c(k, None, None, "x")))(q, k)
    assert rel_err(got, moajax.dot_product_attention(q, k, k)) <= 1e-12


def test_splits_a_second_fuzz_found_wrong_or_failing():
    """A second fuzz of the gather (float64 against one device, 1e-12), each wrong or failing
    before: (A) a query split over two mesh axes at once, ("data", "seq"), where no ring runs:
    the adjoint's query-row class, summed over for dK and dV, is a class the ring would lift,
    and its psum was skipped as if the ring had run — dK and dV came back one device's part,
    0.6-1.1 off, silently; (B) keys split over one axis and 2 kv heads over 2 devices of the
    other (one head a device): dQ and dK 0.2-0.9 off, silently — gathered at first, the
    cause found since (``test_a_blocks_adjoint_reads_delta_from_out``) and the split run; (C) keys split
    along the sequence and values along the batch over one mesh axis: the ring's axis named
    twice in a PartitionSpec (DuplicateSpecError inside XLA) — the ring yields to the batch."""
    loss = lambda f: (lambda *a: jnp.sum(jnp.sin(f(*a))))  # noqa: E731
    f = loss(lambda q, k, v: moajax.dot_product_attention(q, k, v))
    grad = jax.grad(f, argnums=(0, 1, 2))
    r = np.random.default_rng(13)
    mesh = _mesh((2, 2), ("data", "seq"))
    q, k, v = (jnp.asarray(r.standard_normal((1, 8, 1, 2))) for _ in range(3))
    for got in (jax.jit(grad)(*(_put(x, mesh, None, ("data", "seq")) for x in (q, k, v))),
                jax.jit(grad)(_put(q, mesh, None, ("data", "seq")), k, v)):
        for a, b in zip(got, grad(q, k, v)):
            assert rel_err(a, b) <= 1e-12
    for T, B in ((1, 1), (2, 1), (1, 2)):
        q = jnp.asarray(r.standard_normal((B, T, 2, 2)))
        k, v = (jnp.asarray(r.standard_normal((B, 4, 2, 2))) for _ in range(2))
        spec = ("data", "seq") if B == 2 else (None, "seq", "data")
        for a, b in zip(jax.jit(grad)(q, _put(k, mesh, *spec), _put(v, mesh, *spec)), grad(q, k, v)):
            assert rel_err(a, b) <= 1e-12
    mesh = _mesh((2,), ("x",))
    q, k, v = (jnp.asarray(r.standard_normal((2, 4, 1, 2))) for _ in range(3))
    want = moajax.dot_product_attention(q, k, v)
    assert rel_err(moajax.dot_product_attention(q, _put(k, mesh, None, "x"), _put(v, mesh, "x")), want) <= 1e-12
    assert rel_err(jax.jit(moajax.dot_product_attention)(q, _put(k, mesh, None, "x"), _put(v, mesh, "x")), want) <= 1e-12


def _one_head_a_device_adjoint():
    """The saved adjoint of plain attention, B=1, T=2, S=4, N=2 (f64): (its DNF's rule, its
    class of the keys and of the heads, the kernel and its call's options, the shapes of a
    device's block with the keys over 2 devices and one head a device)."""
    opts = dict(scale=None, is_causal=False)
    kern = mha_kernel(None, None, False)
    adj, specs = kern.saved_adjoint(*(_spec(*s, dtype=np.float64) for s in ((1, 2, 2, 2), (1, 4, 2, 2), (1, 4, 2, 2))),
                                    **opts)
    r = shard.rule(adj.dnf(*specs, **opts))
    block = [_spec(*s, dtype=np.float64) for s in ((1, 2, 1, 2),) + ((1, 2, 1, 2),) * 3 + ((2, 1),) * 2 + ((1, 2, 1, 2),)]
    return r, r.names.index("s"), r.names.index("n"), kern, adj, opts, block


def test_a_blocks_adjoint_reads_delta_from_out():
    """The cause of the second fuzz's (B): each device's kernel is derived afresh for its
    block's shapes. With one head a device, the block of a row statistic saved as [t n] is
    (T, 1), while the forward derived for the block drops n (extent 1): matched at the
    forward's rank, Δ-from-output did not apply, and the block's adjoint summed Δ = Σ_s P dP
    over its own keys, the split key class a monoid for the whole kernel — dQ and dK wrong.
    Now a saved value is matched at the shape of the input that holds it: the block's
    adjoint reads Out, and its rule agrees with the whole kernel's."""
    r, s, n, _, adj, opts, block = _one_head_a_device_adjoint()
    assert r.kinds[s] == "monoid" and r.kinds[n] == "map"
    d = adj.dnf(*block, **opts)
    assert "out" in d.arrays_read()
    shapes = {i.name: i.shape for i in d.inputs} | {o.name: o.shape for o in d.outputs}
    assert shard._block_disagrees(r, {s: ("seq",), n: ("data",)}, shard.rule(d), shapes, shapes) == {}


def test_a_split_the_blocks_kernel_would_not_run_is_gathered(monkeypatch, caplog):
    """The net under the cause: before a split runs, the rule of the kernel derived for a
    device's block must agree with the whole kernel's. (1) The adjoint that recomputes Δ
    (no saved values), derived for a block, sums over the keys inside: disagrees. (2) With
    Δ-from-output matched at the forward's rank again (the bug put back), jit(grad) of the
    second fuzz's (B) gathers the keys (logged, naming the block) and is right, float64 at
    1e-12 against one device; it was 0.2-1.8 off."""
    from moajax import dnf as D
    from moajax import identities

    r, s, n, kern, _, opts, block = _one_head_a_device_adjoint()
    plain = kern.adjoint(*(_spec(*x.shape, dtype=np.float64) for x in block[:3]), **opts).dnf(*block[:4], **opts)
    shapes = {i.name: i.shape for i in plain.inputs} | {o.name: o.shape for o in plain.outputs}
    wrong = shard._block_disagrees(r, {s: ("seq",), n: ("data",)}, shard.rule(plain), shapes, shapes)
    assert list(wrong) == [s] and "reduced inside the kernel" in wrong[s]

    logged = _gathers_logged(monkeypatch, caplog)
    monkeypatch.setattr(identities, "_held_read", lambda name, out, index, shapes: D.Read(name, tuple(index), out.dtype))
    f = lambda q, k, v: jnp.sum(jnp.sin(moajax.dot_product_attention(q, k, v)))  # noqa: E731
    grad = jax.grad(f, argnums=(0, 1, 2))
    rng = np.random.default_rng(17)
    # shapes of this test's own (the kernels cache what they derive): T=3, H=3
    q = jnp.asarray(rng.standard_normal((1, 3, 2, 3)))
    k, v = (jnp.asarray(rng.standard_normal((1, 4, 2, 3))) for _ in range(2))
    mesh = _mesh((2, 2), ("data", "seq"))
    got = jax.jit(grad)(q, _put(k, mesh, None, "seq", "data"), _put(v, mesh, None, "seq", "data"))
    for a, b in zip(got, grad(q, k, v)):
        assert rel_err(a, b) <= 1e-12
    assert re.search(r"adjoint\S* gathers .*key axis 1 \(s\).*the kernel derived for a device's block has it "
                     r"reduced inside the kernel, the whole kernel monoid", logged())


def test_heads_split_beside_a_bias_or_table_the_heads_share():
    """Tensor parallel (the heads split) with a bias or a score_mod table the heads share: its
    gradient is Σ_b (Σ_n … + Σ_n …), a sum of sums at the top, and a monoid in every split
    variable of them (each device sums its block of each, one all-reduce). Only the outermost
    Σ counted before: the heads were gathered for the whole backward, every device computing
    every head. Also the batch and the heads over a 2-D mesh. No all-gather; float64 at 1e-12."""
    rng = np.random.default_rng(29)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 6, 8, 2))) for _ in range(3))
    bias = jnp.asarray(rng.standard_normal((1, 1, 6, 6)))
    tab = jnp.asarray(rng.standard_normal(11))

    def with_bias(q, k, v, b):
        return jnp.sum(jnp.sin(moajax.dot_product_attention(q, k, v, bias=b)))

    def with_table(q, k, v, t):
        att = moajax.dot_product_attention(q, k, v, score_mod=lambda sc, b, h, i, j: sc + t[i - j + 5])
        return jnp.sum(jnp.sin(att))

    for mesh, spec in ((_mesh((4,), ("model",)), (None, None, "model")),
                       (_mesh((2, 4), ("data", "model")), ("data", None, "model"))):
        for f, extra in ((with_bias, bias), (with_table, tab)):
            grad = jax.grad(f, argnums=(0, 1, 2, 3))
            args = [_put(x, mesh, *spec) for x in (q, k, v)] + [extra]
            run = jax.jit(grad)
            for a, b in zip(run(*args), grad(q, k, v, extra)):
                assert rel_err(a, b) <= 1e-12
            hlo = _hlo(run, *args)
            assert "all-gather" not in hlo and "all-reduce" in hlo, (f.__name__, spec)


def test_the_query_rows_split_and_the_keys_whole_run_without_the_ring():
    """(A third fuzz.) The query's rows split, the keys and values whole, not causal: every
    split runs as it is (the rows a map class forward; dK and dV one psum backward), with no
    communication inside the kernel. The default ring took it before: it permuted the keys
    around and gathered its outputs back to the layout of the callers' arrays. Float64 at 1e-12."""
    mesh = _mesh((2,), ("x",))
    rng = np.random.default_rng(31)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 4, 2, 2))) for _ in range(3))
    f = lambda q, k, v: jnp.sum(jnp.sin(moajax.dot_product_attention(q, k, v)))  # noqa: E731
    grad = jax.grad(f, argnums=(0, 1, 2))
    run, args = jax.jit(grad), (_put(q, mesh, None, "x"), k, v)
    for a, b in zip(run(*args), grad(q, k, v)):
        assert rel_err(a, b) <= 1e-12
    hlo = _hlo(run, *args)
    assert "all-gather" not in hlo and "collective-permute" not in hlo and "all-reduce" in hlo


def test_one_batch_element_a_device_beside_a_head_split():
    """(A third fuzz.) The batch split one element a device over one mesh axis, the heads over
    the other: the kernels derived for a block give a statistic without its axes of extent 1
    ([t n] for [b t n]), and the block check read the block's axes at the whole's rank — an
    IndexError inside XLA's partitioner under jit(grad). Float64 at 1e-12 against one device."""
    f = lambda q, k, v: jnp.sum(jnp.sin(moajax.dot_product_attention(q, k, v)))  # noqa: E731
    grad = jax.grad(f, argnums=(0, 1, 2))
    rng = np.random.default_rng(23)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 2, 4, 2))) for _ in range(3))
    mesh = _mesh((2, 2), ("x", "y"))
    for a, b in zip(jax.jit(grad)(*(_put(x, mesh, "x", None, "y") for x in (q, k, v))), grad(q, k, v)):
        assert rel_err(a, b) <= 1e-12


def test_one_sequence_a_device_runs_a_shared_bias_gradient_split():
    """Data parallel with one sequence a device: the gradient of a bias shared by the batch
    sums over b, a monoid class of one element a device. A class that only an identity made a
    monoid is gathered there (one key a device: the block's derivation drops the identity);
    b is a monoid before the identities too, so the split runs: no all-gather, one all-reduce
    for d_bias (the whole backward was gathered on every device before), float64 at 1e-12."""
    f = lambda q, k, v, b: jnp.sum(jnp.sin(moajax.dot_product_attention(q, k, v, bias=b)))  # noqa: E731
    grad = jax.grad(f, argnums=(0, 1, 2, 3))
    rng = np.random.default_rng(5)
    q, k, v = (jnp.asarray(rng.standard_normal((8, 4, 1, 2))) for _ in range(3))
    bias = jnp.asarray(rng.standard_normal((1, 1, 4, 4)))
    mesh = _mesh((8,), ("data",))
    args = [_put(x, mesh, "data") for x in (q, k, v)] + [bias]
    run = jax.jit(grad)
    for a, b in zip(run(*args), grad(q, k, v, bias)):
        assert rel_err(a, b) <= 1e-12
    hlo = _hlo(run, *args)
    assert "all-gather" not in hlo and "all-reduce" in hlo


def test_ring_arguments_and_a_presets_ring_that_cannot_take_the_split():
    mesh = _mesh((8,), ("seq",))
    q, k, v = _attn_inputs(np.float32, B=1, T=64)
    with pytest.raises(ValueError, match="chunks"):
        ring_attention(*_attn_inputs(np.float32, B=1, T=24), mesh=mesh, axis_name="seq", is_causal=True)
    with pytest.raises(ValueError, match="axis_name"):
        ring_attention(q, k, v, mesh=mesh, axis_name="sp")
    with pytest.raises(ValueError, match="query length"):
        ring_attention(q, k[:, :32], v[:, :32], mesh=mesh, axis_name="seq")
    with pytest.raises(ValueError, match="balance"):
        Ring("seq", 8, "striped")
    # (a helper's review: an AttributeError, an all-NaN output, float()'s own ValueError, and
    # the saving kernel's name where ring_attention's belongs)
    with pytest.raises(TypeError, match="ring_attention: mesh must be a jax.sharding.Mesh, got NoneType"):
        ring_attention(q, k, v, mesh=None, axis_name="seq")
    with pytest.raises(ValueError, match="ring_attention: scale must be finite, got nan"):
        ring_attention(q, k, v, mesh=mesh, axis_name="seq", scale=float("nan"))
    with pytest.raises(TypeError, match="ring_attention: scale must be a real number, got str"):
        ring_attention(q, k, v, mesh=mesh, axis_name="seq", scale="a")
    with pytest.raises(ValueError, match="ring_attention: implementation must be"):
        ring_attention(q, k, v, mesh=mesh, axis_name="seq", implementation="bogus")
    with pytest.raises(ValueError, match="ring_attention: zero-size dimension"):
        ring_attention(q[:, :0], k[:, :0], v[:, :0], mesh=mesh, axis_name="seq")


# ----------------------------------------------------------------------------- processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_match_one(tmp_path):
    """scripts/distributed_step.py in two processes (2 CPU devices each, gloo collectives):
    attention split by batch and heads, by sequence (the ring), and a block SGD step with
    the batch split, gathered — against the same computation in this process."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import distributed_step

    port, out = _free_port(), tmp_path / "r.npz"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    cmd = [sys.executable, str(ROOT / "scripts" / "distributed_step.py"), "--num_processes", "2",
           "--coordinator", f"localhost:{port}"]
    procs = [subprocess.Popen(cmd + ["--process_id", str(i)] + (["--out", str(out)] if i == 0 else []), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    got = np.load(out)
    attn, params, x = distributed_step.problem(np.float64)
    ref = distributed_step.compute(attn, params, x)
    assert set(got.files) == set(ref)
    for name, value in ref.items():
        assert rel_err(got[name], value) <= 1e-12, name


@pytest.mark.parametrize("balance,T", [("contiguous", 4), ("zigzag", 8)], ids=["contiguous", "zigzag"])
def test_a_ring_block_of_one_key_refuses_its_gradient(balance, T):
    """A block's adjoint is the ring's only where it reads Δ = +/(dO × Out) from the whole row's
    Out (identities.delta_from_output); over a block of one key the DNF has no Σ_s to match, and
    its Δ was that key's alone: dQ and dK 0.5 off, silently. It is refused, naming the pieces;
    the forward (which merges the blocks' statistics) stays right, and two keys a block work."""
    mesh = _mesh((4,), ("seq",))
    r = np.random.default_rng(5)
    q, k, v = (jnp.asarray(r.standard_normal((1, T, 2, 4))) for _ in range(3))
    f = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, axis_name="seq", is_causal=True, balance=balance)  # noqa: E731
    assert rel_err(f(q, k, v), moajax.dot_product_attention(q, k, v, is_causal=True)) <= TOL[np.float64]
    with pytest.raises(ValueError, match="ring block of 1 key.* at least 2 keys"):
        jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2))(q, k, v)
    q2, k2, v2 = (jnp.concatenate([x, x], axis=1) for x in (q, k, v))  # two keys a block
    got = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2)))(q2, k2, v2)
    want = jax.grad(lambda *a: jnp.sum(jnp.sin(moajax.dot_product_attention(*a, is_causal=True))),
                    argnums=(0, 1, 2))(q2, k2, v2)
    for a, b in zip(got, want):
        assert rel_err(a, b) <= TOL[np.float64]


def test_a_sequence_split_with_other_lengths_or_a_preset_is_the_rings_choice():
    """A sequence split the ring cannot take — T ≠ S (a ring pairs query and key chunks of one
    length), T = 12 over 4 devices causal (zigzag's 8 chunks) — is gathered, eager and under
    jit, as one device computes it; a Preset's ring balance and rounds are the ring's, eager as
    under jit, and a ring the Preset names that cannot take the split is refused while tracing
    (named, not wrapped by XLA's partitioner). Before 2026-12-05 the default refused both
    splits too (under jit, inside XLA's partitioner)."""
    mesh = _mesh((4,), ("s",))
    split = NamedSharding(mesh, P(None, "s"))
    r = np.random.default_rng(6)
    q = jax.device_put(jnp.asarray(r.standard_normal((1, 8, 2, 4))), split)
    k, v = (jax.device_put(jnp.asarray(r.standard_normal((1, 16, 2, 4))), split) for _ in range(2))
    want = moajax.dot_product_attention(*(np.asarray(x) for x in (q, k, v)))
    assert rel_err(jax.jit(moajax.dot_product_attention)(q, k, v), want) <= TOL[np.float64]
    q, k, v = (jax.device_put(jnp.asarray(r.standard_normal((1, 12, 2, 4))), split) for _ in range(3))
    contiguous = moajax.Preset.of(ring="contiguous")
    want = moajax.dot_product_attention(*(np.asarray(x) for x in (q, k, v)), is_causal=True)
    assert rel_err(moajax.dot_product_attention(q, k, v, is_causal=True, onf=contiguous), want) <= TOL[np.float64]
    causal = lambda q, k, v: moajax.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    assert rel_err(causal(q, k, v), want) <= TOL[np.float64]
    assert rel_err(jax.jit(causal)(q, k, v), want) <= TOL[np.float64]
    with pytest.raises(ValueError, match="each device's 3 queries do not split into the 2 chunks"):
        moajax.dot_product_attention(q, k, v, is_causal=True, onf=moajax.Preset.of(ring="zigzag"))


def test_an_uneven_sequence_split_is_gathered():
    """T = 5 split over 2 devices under jit: no even split of the sequence (the ring's, or a
    plain split of the query rows), so it is gathered — where it was first JAX's
    IndivisibleError from the ring's blocks, then moajax's ValueError inside XLA's partitioner."""
    mesh = _mesh((2,), ("x",))
    r = np.random.default_rng(7)
    q, k, v = (jnp.asarray(r.standard_normal((1, 5, 2, 4))) for _ in range(3))
    sh = NamedSharding(mesh, P(None, "x"))

    def f(q, k, v):
        q, k, v = (jax.lax.with_sharding_constraint(a, sh) for a in (q, k, v))
        return moajax.dot_product_attention(q, k, v)

    assert rel_err(jax.jit(f)(q, k, v), moajax.dot_product_attention(q, k, v)) <= TOL[np.float64]


@pytest.mark.parametrize("specs", [(("seq",), (), ()), ((), ("seq",), ("seq",)), (("seq",), ("seq",), ())],
                         ids=["query", "key-value", "query-key"])
def test_eager_and_jit_take_a_partial_sequence_split_alike(specs):
    """A sequence split on some of query, key and value: under jit XLA's partitioner runs the
    ring and moves the others' blocks to its split; eager, where moajax once read the split
    itself, it refused them ("must be split alike"). One path now, with one answer (float64,
    rel ≤ 1e-12: the ring's blocks merge the same sums in another order), gradients included."""
    mesh = _mesh((4,), ("seq",))
    q, k, v = _attn_inputs(np.float64, B=1, T=32, N=2, K=2)
    args = [_put(x, mesh, None, *sp) for x, sp in zip((q, k, v), specs)]
    f = lambda q, k, v: moajax.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    loss = lambda f: (lambda *a: jnp.sum(jnp.sin(f(*a))))  # noqa: E731
    want = f(q, k, v)
    wgrad = jax.grad(loss(f), argnums=(0, 1, 2))(q, k, v)
    for run in (f, jax.jit(f)):
        assert rel_err(run(*args), want) <= 1e-12
    for grads in (jax.grad(loss(f), argnums=(0, 1, 2))(*args), jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(*args)):
        for a, b in zip(grads, wgrad):
            assert rel_err(a, b) <= 1e-12


def test_a_sequence_split_over_one_device_is_no_ring_eager_or_jit():
    """A mesh axis of one device splits nothing: eager (which sees the split while tracing) runs
    no ring, as XLA's partitioner under jit does not. Since eager calls took the jit path, the
    ring's own check ran on it and refused causal T = 33 (zigzag: 2 chunks a device)."""
    q, k, v = _attn_inputs(np.float64, B=2, T=33, N=2, K=2)
    want = moajax.dot_product_attention(q, k, v, is_causal=True)
    f = lambda q, k, v: moajax.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    for mesh, spec in ((_mesh((1,), ("seq",)), (None, "seq")), (_mesh((2, 1), ("data", "seq")), ("data", "seq"))):
        args = [_put(x, mesh, *spec) for x in (q, k, v)]
        for run in (f, jax.jit(f)):
            assert rel_err(run(*args), want) <= 1e-12


@moajax.kernel(example=dict(a=8, b=4, c=4, k=3), register=False)
def _normalised_sum(x: "a b c", y: "a k"):
    """Σ_a x ÷ r_a, r_a = √(Σ_k y² + ε): a statistic r [a] larger than a device's block of the
    output [b c] when b is split (a statistic has no more elements than an output it serves)."""
    from moajax import moa
    from moajax.kernels.common import accumulation_dtype

    acc = accumulation_dtype(x.dtype)
    xa, ya = moa.cast(x, acc), moa.cast(y, acc)
    r = moa.name("r", moa.sqrt(moa.sum(ya * ya, axis=-1) + 1e-6))
    return moa.cast(moa.sum(moa.omega(moa.div, (2, 0))(xa, r), axis=0), x.dtype)


def test_a_device_block_with_fewer_statistics_leaves_out_the_same_unread_ones():
    """In bfloat16 the saving forward leaves out the output's float32 value before rounding,
    which the adjoint does not read (``Kernel.statistics_read``). A device's block of b finds
    only that statistic (r, 8 elements, is larger than its [1 4] output): the left-out one is
    named by what it is, not by its place in the whole arrays' list — by place, the gradient of
    the split call raised inside the partitioner (found by a review, 2026-12-06). Split and
    saving, it equals the unsplit recomputing gradient bit for bit."""
    r = np.random.default_rng(0)
    x = jnp.asarray(r.standard_normal((8, 4, 4)), jnp.bfloat16)
    y = jnp.asarray(r.standard_normal((8, 3)), jnp.bfloat16)
    xs = jax.device_put(x, NamedSharding(_mesh((4,), ("x",)), P(None, "x")))

    def grad(res):
        return jax.jit(jax.grad(lambda x, y: jnp.sum(jnp.sin(_normalised_sum(x, y, residuals=res).astype(jnp.float32)))))

    want = np.asarray(grad("recompute")(x, y), np.float32)
    assert np.array_equal(np.asarray(grad("save")(xs, y), np.float32), want)
    assert np.array_equal(np.asarray(grad("save")(x, y), np.float32), want)
