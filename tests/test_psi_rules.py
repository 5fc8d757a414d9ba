"""One test per ψ-reduction rule: the rule fires, the DNF has the expected index arithmetic,
and the value equals the NumPy evaluation of the un-reduced expression."""

import numpy as np
import pytest

from helpers import rel_err
from moajax import dnf as D
from moajax import moa, numpy_eval, reference
from moajax.ix import Ix, Var
from moajax.psi import psi_reduce


def check(expr, inputs, rule):
    dnf, der = psi_reduce(expr, "t")
    assert rule in der.rules_used(), der.pretty()
    got = np.asarray(reference.to_jax(dnf)(*[inputs[s.name] for s in dnf.inputs]))
    want = numpy_eval.evaluate(expr, inputs)
    if want.dtype == np.bool_:
        assert np.array_equal(got, want)
    else:
        assert rel_err(got, want) <= 1e-12
    return dnf


def arr(name, shape, dims=None):
    return moa.array(name, shape, dims, np.float64)


R = np.random.default_rng(1)


def data(*shapes):
    return [R.standard_normal(s) for s in shapes]


def only_read(dnf):
    rs = dnf.reads()
    assert len(rs) == 1
    return rs[0]


def test_rule_input():
    a = arr("a", (2, 3), "i j")
    d = check(a, {"a": data((2, 3))[0]}, "ψ-input")
    r = only_read(d)
    assert r.array == "a" and [i.as_var().name for i in r.index] == ["i", "j"]


def test_rule_transpose():
    a = arr("a", (2, 3, 4), "i j k")
    d = check(moa.transpose(a, (2, 0, 1)), {"a": data((2, 3, 4))[0]}, "ψ-transpose")
    # ⟨k i j⟩ψ ⍉A = ⟨i j k⟩ψ A: the read is A in its own order, no transposed copy
    r = only_read(d)
    assert [i.as_var().name for i in r.index] == ["i", "j", "k"]
    assert [v.name for v in d.output.vars] == ["k", "i", "j"]


@pytest.mark.parametrize("k", [2, -2])
def test_rule_take(k):
    a = arr("a", (5, 3), "i j")
    d = check(moa.take(k, a), {"a": data((5, 3))[0]}, "ψ-take")
    r = only_read(d)
    assert r.index[0] == Ix.of(Var("i", 2)) + (0 if k > 0 else 3)


@pytest.mark.parametrize("k", [2, -2])
def test_rule_drop(k):
    a = arr("a", (5, 3), "i j")
    d = check(moa.drop(k, a), {"a": data((5, 3))[0]}, "ψ-drop")
    r = only_read(d)
    assert r.index[0] == Ix.of(Var("i", 3)) + (2 if k > 0 else 0)


def test_rule_reverse():
    a = arr("a", (5,), "i")
    d = check(moa.reverse(a), {"a": data((5,))[0]}, "ψ-reverse")
    assert only_read(d).index[0] == 4 - Ix.of(Var("i", 5))


def test_rule_rotate():
    a = arr("a", (5, 2), "i j")
    d = check(moa.rotate(7, a), {"a": data((5, 2))[0]}, "ψ-rotate")
    assert "mod 5" in str(only_read(d).index[0])


def test_rule_reshape_roundtrip_collapses():
    a = arr("a", (3, 4), "i j")
    back = moa.reshape(moa.ravel(a), (3, 4), dims="i j")
    d = check(back, {"a": data((3, 4))[0]}, "ψ-reshape")
    # γ⁻¹(γ(p)) = p: the index arithmetic simplifies back to plain variables
    assert [i.as_var().name for i in only_read(d).index] == ["i", "j"]


@pytest.mark.parametrize("gamma", ["C", "F"])
def test_rule_reshape_gamma(gamma):
    a = arr("a", (2, 6), "i j")
    check(moa.reshape(a, (3, 4), gamma=gamma), {"a": data((2, 6))[0]}, "ψ-reshape")


def test_rule_catenate():
    a, b = arr("a", (2, 3)), arr("b", (4, 3))
    x, y = data((2, 3), (4, 3))
    d = check(moa.catenate(a, b), {"a": x, "b": y}, "ψ-catenate")
    assert d.arrays_read() == {"a", "b"}
    # a take that stays inside the first operand selects it statically
    d2 = check(moa.take(2, moa.catenate(a, b)), {"a": x, "b": y}, "ψ-catenate")
    assert d2.arrays_read() == {"a"}


def test_rule_psi():
    a = arr("a", (3, 4), "i j")
    d = check(moa.psi((2,), a), {"a": data((3, 4))[0]}, "ψ-psi")
    assert only_read(d).index[0] == Ix.of(2)


def test_rule_iota():
    d = check(moa.cast(moa.iota(5), np.float64) * 2.0, {}, "ψ-iota")
    assert any(isinstance(x, D.IndexValue) for x in D.walk(d.output.body))


def test_rule_map_scalar_extension():
    a = arr("a", (3,), "i")
    d = check(moa.exp(a) * 2.0 + a, {"a": data((3,))[0]}, "ψ-map")
    assert isinstance(d.output.body, D.Call)


def test_rule_cast():
    a = moa.array("a", (3,), "i", np.int32)
    check(moa.cast(a, np.float64), {"a": np.arange(3, dtype=np.int32)}, "ψ-cast")


def test_rule_outer():
    a, b = arr("a", (2,), "i"), arr("b", (3,), "j")
    d = check(moa.outer(moa.mul, a, b), dict(zip("ab", data((2,), (3,)))), "ψ-outer")
    assert {r.array: r.index[0].as_var().name for r in d.reads()} == {"a": "i", "b": "j"}


def test_rule_reduce_any_axis():
    a = arr("a", (2, 3, 4), "i j k")
    d = check(moa.reduce("max", a, axis=1), {"a": data((2, 3, 4))[0]}, "ψ-reduce")
    body = d.output.body
    assert isinstance(body, D.Red) and body.var.name == "j" and body.monoid == "max"


def test_rule_inner():
    a, b = arr("a", (2, 3), "i l"), arr("b", (3, 4), "l k")
    d = check(a @ b, dict(zip("ab", data((2, 3), (3, 4)))), "ψ-inner")
    body = d.output.body
    assert isinstance(body, D.Red) and body.monoid == "add" and body.var.extent == 3
    check(moa.inner("max", moa.add, a, b), dict(zip("ab", data((2, 3), (3, 4)))), "ψ-inner")


def test_rule_omega_and_cell():
    a, m = arr("a", (3, 4), "t s"), arr("m", (3,), "t")
    d = check(moa.omega(moa.sub, (1, 0))(a, m), dict(zip("am", data((3, 4), (3,)))), "ψ-omega")
    _, der = psi_reduce(moa.omega(moa.sub, (1, 0))(a, m))
    assert "ψ-cell" in der.rules_used()
    assert {r.array: tuple(i.as_var().name for i in r.index) for r in d.reads()} == {"a": ("t", "s"), "m": ("t",)}


def test_rule_cell_bound_to_an_enclosing_cell():
    # an inner Ω whose argument is a cell of the outer Ω: the inner cell's value depends on
    # the outer binding too, so two frame indices must not share one reduction (a memo bug
    # once gave ⟨b⟩ψg in both terms of ⍉Y + Y below)
    g = arr("g", (2,), "b")
    y = moa.omega(lambda _, dy: moa.omega(lambda _i, v: v, (0, 0))(moa.iota(2, "k"), dy), (1, 0))(arr("x", (2, 5), "b j"), g)
    d = check(y + moa.transpose(y), dict(zip("xg", data((2, 5), (2,)))), "ψ-cell")  # ⟨b k⟩ = g[b] + g[k]
    assert sorted(tuple(i.as_var().name for i in r.index) for r in d.reads()) == [("b",), ("k",)]


def test_rule_stop_gradient_is_transparent():
    a = arr("a", (3,), "i")
    d, _ = psi_reduce(moa.stop_gradient(a) * 2.0)
    e, _ = psi_reduce(a * 2.0)
    assert d.output.body is e.output.body


def test_rule_name():
    a = arr("a", (3,), "i")
    d = check(moa.name("row", a * 2.0), {"a": data((3,))[0]}, "ψ-name")
    assert isinstance(d.output.body, D.Tag) and d.output.body.label == "row"
    assert "row(i)" in d.pretty()


def test_derivation_prints_each_step():
    a = arr("a", (2, 3), "i j")
    _, der = psi_reduce(moa.transpose(a) * 2.0)
    text = der.pretty()
    assert "[ψ-map]" in text and "[ψ-transpose]" in text and "⟨j i⟩ψ" in text


def test_empty_reduction_is_the_identity():
    a = arr("a", (0, 3), "i j")
    d, _ = psi_reduce(moa.reduce("add", a))
    assert isinstance(d.output.body, D.Lit) and d.output.body.value == 0.0


def test_reduction_over_one_item_is_that_item():
    a, b = arr("a", (1, 3), "g j"), arr("b", (4, 1), "i g")
    d = check(moa.sum(a, 0) * 2.0, dict(a=data((1, 3))[0]), "ψ-reduce-one")
    assert not D.reductions(d.output.body) and only_read(d).index[0] == Ix.of(0)
    x = dict(a=data((1, 3))[0], b=data((4, 1))[0])
    d2 = check(moa.dot(b, a), x, "ψ-reduce-one")
    assert not D.reductions(d2.output.body)  # Σ_{g<1} of one product is that product


def test_rule_fuse_sums_and_factor_the_shared_product():
    # +/(c × a) + +/(c × b) along one axis of one extent: one pass, c factored out of both
    a, b, c = arr("a", (5, 3), "i j"), arr("b", (5, 3), "i j"), arr("c", (5, 3), "i j")
    x = dict(zip("abc", data((5, 3), (5, 3), (5, 3))))
    d = check(moa.sum(c * a, 0) + moa.sum(c * b, 0), x, "ψ-fuse-sums")
    (red,) = D.reductions(d.output.body)
    assert isinstance(red.body, D.Call) and red.body.op == "mul"  # c × (a + b)
    # sums over different extents, or of a non-float, stay two sums
    e = arr("e", (4, 3), "k j")
    d2, der = psi_reduce(moa.sum(a, 0) + moa.sum(e, 0))
    assert "ψ-fuse-sums" not in der.rules_used() and len(D.reductions(d2.output.body)) == 2


# ----------------------------------------------------------------------------- one name, one extent


def _same_name_kernels():
    """Kernels where an axis keeps a dim name at another extent (k△, ⧺ keep A's name): with the
    data and the float64 NumPy result of each."""
    import moajax

    def sm(v, ax):
        e = np.exp(v - v.max(ax, keepdims=True))
        return e / e.sum(ax, keepdims=True)

    @moajax.kernel(register=False)
    def softmax_cat(x: "a0", y: "b0"):  # softmax(softmax(x) ⧺ y): a0<6 beside a0<3
        return moa.softmax(moa.catenate(moa.softmax(x, 0), y, 0), 0)

    @moajax.kernel(register=False)
    def take_softmax(x: "a c"):  # 2△ along c of softmax(x): c<2 beside c<5
        return moa.take(2, moa.softmax(x, 1), 1)

    @moajax.kernel(register=False)
    def cat_centered(x: "a c"):  # x ⧺ (x − +/x) along c: c<10 beside c<5
        return moa.catenate(x, moa.omega(moa.sub, (1, 0))(x, moa.sum(x, 1)), 1)

    r = np.random.default_rng(7019)
    x1, y1, x2 = r.uniform(-2, 2, 3), r.uniform(-2, 2, 3), r.uniform(-2, 2, (3, 5))
    return [(softmax_cat, (x1, y1), sm(np.concatenate([sm(x1, 0), y1]), 0)),
            (take_softmax, (x2,), sm(x2, 1)[:, :2]),
            (cat_centered, (x2,), np.concatenate([x2, x2 - x2.sum(1, keepdims=True)], 1))]


def _dnf_vars(dnf):
    """The output and reduction variables of a one-output DNF."""
    return set(dnf.output.vars) | {x.var for x in D.walk(dnf.output.body) if isinstance(x, D.Red)}


def _same_name_report() -> dict:
    """Per kernel of ``_same_name_kernels``: its DNF's variables, and the relative error of its
    compiled CPU result on the default schedule and under a Preset tiling each variable of
    extent > 1 by 1 and by 2, and all of them by 2 (run here and in a subprocess)."""
    import jax

    from moajax.schedule import Preset

    jax.config.update("jax_enable_x64", True)
    out = {}
    for k, args, want in _same_name_kernels():
        vs = _dnf_vars(k.dnf(*args))
        names = sorted({v.name for v in vs if v.extent > 1})
        presets = [None] + [Preset.of(tiles={n: t}) for n in names for t in (1, 2)] + [Preset.of(tiles={n: 2 for n in names})]
        out[k.__name__] = {"vars": sorted((v.name, v.extent) for v in vs),
                           "errors": [rel_err(k(*args, onf=p), want) for p in presets]}
    return out


def test_a_variable_name_denotes_one_extent_in_a_dnf():
    """k△A, k▽A and A⧺B keep A's dim name n at another extent; ψ-reduction names the output
    axes after their dims first, and a reduction over n at another extent n1 (n<2 beside n<5
    would be one axis to an ONF, which tiles by name). The value is unchanged (NumPy)."""
    x = arr("x", (3, 5), "a c")
    row = lambda A: moa.omega(moa.sub, (1, 0))(A, moa.sum(A, 1))  # noqa: E731  (x − +/x per row)
    v = data((3, 5))[0]
    for expr in (moa.take(2, moa.softmax(x, 1), 1), moa.catenate(x, row(x), 1), moa.drop(1, row(x), 1)):
        d = check(expr, {"x": v}, "ψ-reduce")
        vs = _dnf_vars(d)
        assert len({v.name for v in vs}) == len(vs), sorted(vs)  # one name, one extent
        assert [u.name for u in d.output.vars] == ["a", "c"]     # the output keeps its dims' names
        assert Var("c1", 5) in vs


def test_kernels_with_a_dim_name_at_two_extents_compile_exactly():
    """softmax(softmax(x) ⧺ y), 2△ softmax(x) along c and x ⧺ (x − +/x) along c, whose axes
    hold one dim name at two extents, compile on the default CPU schedule and under Presets
    tiling each variable (by 1, 2, all by 2) to NumPy's float64 result (rel ≤ 1e-12).

    Before: an ONF looked both variables up as one axis ("an axis is listed twice", or one
    took the other's tile: wrong values silently)."""
    for name, got in _same_name_report().items():
        assert max(got["errors"]) <= 1e-12, (name, got)


def test_same_name_kernels_do_not_depend_on_the_hash_seed():
    """The same, in a subprocess under PYTHONHASHSEED=4 (where the default schedule used to
    fail: the ONF picked one of the two variables from a set): the same variables, the same
    exact values."""
    import json
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import sys, json; sys.path.insert(0, {here!r}); import test_psi_rules as t; "
            "print('REPORT' + json.dumps(t._same_name_report()))")
    env = dict(os.environ, PYTHONHASHSEED="4", JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    line = next((s for s in p.stdout.splitlines() if s.startswith("REPORT")), None)
    assert line is not None, p.stderr[-3000:]
    there = json.loads(line[len("REPORT"):])
    here_ = _same_name_report()
    for name, got in there.items():
        assert max(got["errors"]) <= 1e-12, (name, got)
        assert [tuple(v) for v in got["vars"]] == here_[name]["vars"], name


@pytest.mark.parametrize("case", ["catenate", "take"])
def test_grad_of_a_kernel_whose_output_keeps_an_input_dim_name(case):
    """∂/∂x, ∂/∂y of +/ (2 × (x ⧺ y)) and of +/ exp(2△x): the output keeps x's dim n at another
    extent; its cotangent is an argument of the adjoint kernel, whose arguments match dims by
    name, so it takes another name there (was: "dimension 'n' is 4 in argument 'x' but 7 in
    argument 'd_out'"). jax.grad of the jnp equivalent to rel ≤ 1e-12, with and without
    saved residuals."""
    import jax
    import jax.numpy as jnp

    import moajax

    if case == "catenate":
        @moajax.kernel(register=False)
        def k(x: "n", y: "m"):
            return moa.catenate(x, y, 0) * 2.0

        f = lambda x, y: jnp.concatenate([x, y]) * 2.0  # noqa: E731
        args = (np.linspace(-1, 1, 4), np.linspace(0, 1, 3))
    else:
        @moajax.kernel(register=False)
        def k(x: "n"):
            return moa.exp(moa.take(2, x, 0))

        f = lambda x: jnp.exp(x[:2])  # noqa: E731
        args = (np.linspace(-1, 1, 4),)
    wrt = tuple(range(len(args)))
    want = jax.grad(lambda *a: f(*a).sum(), wrt)(*args)
    for res in ("none", "save"):
        got = jax.grad(lambda *a: k(*a, residuals=res).sum(), wrt)(*args)
        for g, w in zip(got, want):
            assert rel_err(g, w) <= 1e-12, (res, g, w)
