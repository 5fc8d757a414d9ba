"""Every ONF rewrite keeps the DNF's meaning: run the rewritten ONF (XLA backend) against the
DNF → JAX reference on random inputs; check the structure each rewrite promises."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import rel_err, scalar_value
from moajax import dnf as D
from moajax import lower_xla, moa
from moajax import onf as O
from moajax import rewrites as W
from moajax.kernel import kernel
from moajax.kernels import attention, decode, rmsnorm, swiglu
from moajax.psi import psi_reduce

F64 = 1e-12  # float64: reassociation by the rewrites moves results by a few ulps


def run(onf, args):
    return np.asarray(lower_xla.lower(onf)(*args))


def ref(dnf, args):
    from moajax import reference

    return np.asarray(reference.to_jax(dnf)(*args))


@kernel(example=dict(i=5, k=7), dims={"x": "i k"}, register=False)
def lse(x):
    """logsumexp per row: ⌈/x + log Σ exp(x − ⌈/x)."""
    return moa.logsumexp(x, axis=-1)


@kernel(example=dict(i=5, k=7), dims={"x": "i k", "y": "k"}, register=False)
def pooled(x, y):
    """Σ_k exp(x − ⌈x)·tanh(y)·x ÷ Σ_k exp(x − ⌈x): a softmax-weighted pooling that is not attention."""
    w = moa.softmax(x, axis=-1)
    g = moa.omega(moa.mul, (1, 1))(x, moa.tanh(y))
    return moa.sum(w * g, axis=-1)


def rand_args(dnf, seed):
    r = np.random.default_rng(seed)
    return [r.standard_normal(i.shape) for i in dnf.inputs]


KERNELS = [
    (attention, dict(shapes=((6, 3), (9, 3), (9, 5)))),
    (decode, dict(shapes=((3,), (11, 3), (11, 4)))),
    (lse, dict(shapes=((5, 7),))),
    (pooled, dict(shapes=((5, 7), (7,)))),
]


@pytest.mark.parametrize("kern,spec", KERNELS, ids=lambda x: getattr(x, "name", ""))
def test_fuse_online_is_general(kern, spec):
    args = [np.random.default_rng(0).standard_normal(s) for s in spec["shapes"]]
    dnf = kern.dnf(*args)
    o = W.fuse_online(W.hoist(O.initial(dnf)))
    online = [s for s in o.program.stages if isinstance(s, O.OnlineStage)]
    assert len(online) == 1, o.pretty()
    assert rel_err(run(o, args), ref(dnf, args)) <= F64
    # the same with the reduction walked in tiles of 2 (and a tail)
    v = online[0].var.name
    assert rel_err(run(W.tile(o, v, 2, "sequential"), args), ref(dnf, args)) <= F64


def test_hoist_makes_row_statistics():
    dnf = attention.dnf((6, 3), (9, 3), (9, 5))
    o = W.hoist(O.initial(dnf))
    by = {s.name: s for s in o.program.stages}
    assert [v.name for v in by["max_s"].vars] == ["t"]  # once per row, not per (row, key)
    assert by["max_s"].reduction.monoid == "max"
    # the ÷ den left the sum over s: out = (Σ_s num·V) ÷ den
    out = by["out"].body
    assert isinstance(out, D.Call) and out.op == "div"


def test_hoist_reuses_row_statistics_inside_sums_over_rows():
    from moajax.kernels import attention_backward

    dnf = attention_backward.dnf((6, 3), (9, 3), (9, 5), (6, 5))
    o = W.hoist(O.initial(dnf))
    # dK = Σ_t (…P(t, s)…) reads the row max and denominator hoisted for dQ: they are not
    # recomputed for every (s, h) element of dK
    dk = next(s.body for s in o.program.stages if isinstance(s, O.Stage) and s.reduction is not None
              and s.reduction.var.name == "t" and {v.name for v in s.vars} == {"s", "h"})  # Σ_t of dK
    refs = {x.stage for x in D.walk(dk) if isinstance(x, D.Ref)}
    assert {"max_s", "sum_s"} <= refs, o.pretty()
    assert not any(isinstance(x, D.Red) and x.monoid == "max" for x in D.walk(dk))
    # but a reduction over loop variables that no stage computes yet stays inline (a new
    # stage over a loop variable would be a stored row)
    assert [s.name for s in o.program.stages].count("max_s") == 1


def test_sink_moves_the_scale_onto_the_query():
    dnf = attention.dnf((6, 3), (9, 3), (9, 5))
    o = W.fuse_online(W.hoist(O.initial(dnf)))
    logit = o.program.stages[0].logit
    inner = logit.body if isinstance(logit, D.Tag) else logit
    assert isinstance(inner, D.Red)
    muls = [x for x in D.walk(inner.body) if isinstance(x, D.Call) and x.op == "mul"]
    # the literal scale multiplies the query read (loop-invariant), inside the Σ_h
    assert any(isinstance(m.children[1], D.Lit) and isinstance(m.children[0], D.Read)
               and m.children[0].array == "query" for m in muls)


def test_factor_out_invariants_unit():
    i, k = O.Var("i", 3), O.Var("k", 4)
    a = D.Read("a", (k,), np.float64)
    c = D.Read("c", (i,), np.float64)
    red = D.Red("add", k, D.Call("div", (D.Call("mul", (a, c)), c)))
    out = W.factor_out_invariants(red)
    assert isinstance(out, D.Call) and out.op == "div"
    assert isinstance(out.children[0], D.Call)


@st.composite
def rewrite_plans(draw):
    kern, spec = draw(st.sampled_from(KERNELS + [(rmsnorm, dict(shapes=((5, 6), (6,)))),
                                                 (swiglu, dict(shapes=((4, 3), (3, 5), (3, 5), (5, 3))))]))
    plan = []
    if draw(st.booleans()):
        plan.append(("materialize", draw(st.sampled_from(["local", "memory"]))))
    if draw(st.booleans()):
        plan.append(("fuse", None))
    if draw(st.booleans()):
        plan.append(("split", draw(st.integers(2, 4))))
    plan.append(("tiles", draw(st.integers(1, 6)), draw(st.integers(1, 6))))
    if draw(st.booleans()):
        plan.append(("gamma", draw(st.integers(0, 3))))
    if draw(st.booleans()):
        plan.append(("place", draw(st.integers(0, 7))))
    return kern, spec, plan, draw(st.integers(0, 1000))


@settings(max_examples=40)
@given(rewrite_plans())
def test_random_rewrite_sequences_keep_meaning(case):
    kern, spec, plan, seed = case
    r = np.random.default_rng(seed)
    args = [r.standard_normal(s) for s in spec["shapes"]]
    dnf = kern.dnf(*args)
    o = O.initial(dnf)
    labels = sorted(o.store)
    for step in plan:
        if step[0] == "materialize" and labels:
            o = W.materialize(o, labels[seed % len(labels)], step[1])
    o = W.hoist(o)
    for step in plan:
        if step[0] == "fuse":
            try:
                o = W.fuse_online(o)
            except O.ONFError:
                pass
        elif step[0] == "split":
            loops = [s.var if isinstance(s, O.OnlineStage) else s.reduction.var for s in o.program.stages
                     if isinstance(s, O.OnlineStage) or (isinstance(s, O.Stage) and s.reduction is not None
                                                         and s.place == "local")]
            if loops and step[1] <= loops[0].extent:
                try:
                    o = W.split_k(o, loops[0].name, step[1])
                except O.ONFError as e:
                    assert "split before materializing" in str(e)  # the one refused combination
        elif step[0] == "tiles":
            names = {v.name: v for v in o.program.vars()}
            for s in o.program.stages:
                red = s.var if isinstance(s, O.OnlineStage) else (s.reduction.var if isinstance(s, O.Stage) and s.reduction else None)
                if red is not None and red.name in names and not any(a.name == red.name for a in o.axes):
                    o = W.tile(o, red.name, step[2], "sequential")
            out_v = dnf.outputs[0].vars
            if out_v:
                o = W.tile(o, out_v[0].name, step[1], "grid")
        elif step[0] == "gamma":
            name = dnf.inputs[step[1] % len(dnf.inputs)].name
            o = W.with_gamma(o, name, "F")
        elif step[0] == "place":
            outputs = {n for _, n in o.program.outputs}
            # into memory (what a GPU's schedule does with a row a walk reads: ``schedule``);
            # back on chip, split-K's partials would be reduced across programs (refused)
            plain = [s.name for s in o.program.stages if isinstance(s, O.Stage) and s.name not in outputs]
            if plain:
                o = W.place(o, plain[step[1] % len(plain)], "memory")
    o.validate()
    assert rel_err(run(o, args), ref(dnf, args)) <= F64, o.pretty()


def test_psi_reduce_of_defined_logsumexp_matches_numpy():
    x = moa.array("x", (3, 5), "i k", np.float64)
    d, _ = psi_reduce(moa.logsumexp(x, -1))
    v = np.random.default_rng(1).standard_normal((3, 5))
    want = np.log(np.sum(np.exp(v - v.max(-1, keepdims=True)), -1)) + v.max(-1)
    assert rel_err(ref(d, [v]), want) <= F64


# ----------------------------------------------------------------------------- sum_to_top

_EXT = {"r": 3, "a": 2, "b": 4}


@st.composite
def linear_terms(draw, depth: int = 0, scope: tuple = ()):
    """A scalar term over ``scope`` built of Σ (binding r, a or b, names that repeat and
    shadow), +, −, ×, ÷ by a literal, negation, ⌈, (v < 1 ? x : y) and reads of A[4, 4] at
    two variables of the scope: what ``sum_to_top`` rewrites and what it must refuse."""
    from moajax.ix import Ix, Var

    kinds = ["read", "lit"] + (["add", "add", "sub", "mul", "div", "neg", "max", "where"] + ["sum"] * 6 if depth < 4 else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "read" and scope:
        i, j = draw(st.sampled_from(scope)), draw(st.sampled_from(scope))
        return D.Read("a", [Ix.of(i), Ix.of(j)], np.float64)
    if kind in ("read", "lit"):
        return D.Lit(draw(st.sampled_from([0.5, 2.0, -1.5])), np.float64)
    sub = lambda: draw(linear_terms(depth + 1, scope))  # noqa: E731
    if kind in ("add", "sub", "mul"):
        return D.Call(kind, (sub(), sub()))
    if kind == "div":
        return D.Call("div", (sub(), D.Lit(draw(st.sampled_from([2.0, -4.0])), np.float64)))
    if kind == "neg":
        return D.Call("neg", (sub(),))
    if kind == "where":  # (v < 1 ? x : 0), or an else-branch that is not 0
        if not scope:
            return sub()
        cond = D.Call("lt", (D.IndexValue(Ix.of(draw(st.sampled_from(scope)))), D.Lit(1, np.int32)))
        return D.Call("where", (cond, sub(), D.Lit(draw(st.sampled_from([0.0, 0.0, 1.0])), np.float64)))
    name = draw(st.sampled_from(sorted(_EXT)))
    v = Var(name, _EXT[name])
    return D.Red("add" if kind == "sum" else "max", v, draw(linear_terms(depth + 1, scope + (v,))))


@settings(max_examples=300, deadline=None)
@given(linear_terms(), st.sampled_from(sorted(_EXT)))
def test_sum_to_top_keeps_the_meaning(term, name):
    """Σ_a (Σ_r f + Σ_r g) → Σ_r Σ_a (f + g), c·Σ_r f → Σ_r c·f: where the rewrite applies the
    term is one Σ over r at the top with the term's value (float64: the sums reassociate,
    a few ulps); where it refuses, some term does not sum over r once (it would be counted
    |r| times), a ⌈ or a divisor is in the way."""
    a = np.random.default_rng(1).standard_normal((4, 4))
    want = scalar_value(term, a, {})
    top = W.sum_to_top(term, name)
    if top is None:
        return
    assert isinstance(top, D.Red) and top.monoid == "add" and top.var.name == name
    assert top.free == term.free
    assert abs(scalar_value(top, a, {}) - want) <= F64 * max(1.0, abs(want))


def test_sum_to_top_refuses_what_it_would_change():
    from moajax.ix import Ix, Var

    r, s = Var("r", 3), Var("s", 3)
    f = D.Read("a", [Ix.of(r), Ix.of(s)], np.float64)
    g = D.Read("a", [Ix.of(s), Ix.of(s)], np.float64)
    sum_r = D.Red("add", r, f)
    assert W.sum_to_top(D.Call("add", (sum_r, g)), "r") is None  # g would be counted 3 times
    assert W.sum_to_top(D.Red("max", s, sum_r), "r") is None  # ⌈_s Σ_r ≠ Σ_r ⌈_s
    assert W.sum_to_top(D.Call("div", (g, sum_r)), "r") is None  # a sum in a divisor
    assert W.sum_to_top(D.Call("mul", (sum_r, sum_r)), "r") is None  # (Σ f)² ≠ Σ f²
    assert W.sum_to_top(D.Tag("x", sum_r), "r") is None  # the label names the sum itself
    top = W.sum_to_top(D.Red("add", s, D.Call("mul", (g, sum_r))), "r")
    assert top.var == r and top.body == D.Red("add", s, D.Call("mul", (g, f)))


def _table_gradient(fn, shape, consts) -> D.DNF:
    """The DNF of a score_mod array's gradient alone (``fn`` closes over ``consts``; q, k, v
    of ``shape``, causal, float64): the kernel ``jax.grad`` cuts from attention's adjoint."""
    import jax

    from moajax import schedule
    from moajax.api import _check_score_mod
    from moajax.kernels.attention import mha_kernel

    kern = mha_kernel(None, None, False, False, False, _check_score_mod(fn, np.dtype(np.float64)))
    specs = [jax.ShapeDtypeStruct(shape, np.float64)] * 3 + [jax.ShapeDtypeStruct(np.shape(c), c.dtype) for c in consts]
    dnf = kern.adjoint(*specs).dnf(*specs, jax.ShapeDtypeStruct(shape, np.float64), is_causal=True)
    (sub,) = schedule.split_outputs(dnf, [(dnf.outputs[-1].name,)])
    assert sub.outputs[0].name.startswith("d_score_mod_const")
    return sub


def _on_both_backends(split, machine: str, args, want):
    """The split ONF on XLA, and in Pallas interpret mode where ``machine`` is a GPU's."""
    import pallas_kernels

    assert rel_err(run(split, args), want) <= F64
    if machine == "delta-a100":
        assert rel_err(np.asarray(pallas_kernels.lower(split, interpret=True)(*args)), want) <= F64


def test_split_k_of_a_nested_sum_on_both_backends():
    """A table's gradient Σ_n Σ_s Σ_t ((c = i(t, s)) ? dS : 0) split over t into grid parts
    (``split_k`` through ``sum_to_top``, as ``schedule._split_to_fill`` does on a GPU whose
    programs over c are too few): the XLA and Pallas-interpret kernels equal the reference
    (float64), the partials over t are a grid axis, each program binning its scores
    (``Backend.bin_sum``)."""
    import jax.numpy as jnp

    from moajax import machines, schedule

    table = jnp.asarray(np.linspace(-1.0, 1.0, 9))
    sub = _table_gradient(lambda s, b, h, qi, ki: s + table[jnp.clip(qi - ki, -4, 4) + 4], (1, 16, 2, 8), [table])
    args = rand_args(sub, 3)
    want = ref(sub, args)
    for machine in ("delta-epyc-7763", "delta-a100"):
        # one cut over t; and two, the heads then the keys (a cut of a split's partials, as
        # ``schedule._split_to_fill`` makes where the heads alone leave the GPU short)
        for cuts, tiles in (({"t": 2}, {"t": 4, "s": 8}), ({"n_kv": 2, "s": 2}, {"t": 4, "s": 4})):
            split = schedule.derive(sub, machines.load(machine), tiles=tiles, split=cuts)
            for v, parts in cuts.items():
                assert f"split_k({v}, {parts})" in split.history
                assert any(a.name == f"{v}_o" and a.role == "grid" for a in split.axes)
            _on_both_backends(split, machine, args, want)


@pytest.mark.parametrize("which", ["adjoint d_query", "tangent"])
def test_a_split_online_pass_is_combined_over_every_part(which):
    """The dQ of attention's adjoint without residuals (its online pass recomputes each row's
    max and sum) and attention's tangent, split over the keys (``split_k``): a later kernel's
    programs own key parts too (dQ's Σ_{s₀}) and read ⌈_{s₀} and Σ_{s₀} of the online partials
    in memory. Those combine every part, not the program's own: before, Pallas normalised each
    part by its own max and sum (dQ off by 1.7 here; a fuzz found it with a document mask and
    query lengths on the H200 profile). Pallas-interpret equals the reference (float64)."""
    import jax

    from moajax import machines, schedule
    from moajax.kernels.attention import mha_kernel

    specs = [jax.ShapeDtypeStruct((1, 12, 2, 4), np.float64)] * 3
    kern = mha_kernel(None, None, False)
    if which == "tangent":
        sub = kern.tangent(*specs).dnf(*specs, *specs, is_causal=False)
    else:
        dnf = kern.adjoint(*specs).dnf(*specs, jax.ShapeDtypeStruct((1, 12, 2, 4), np.float64), is_causal=False)
        sub = schedule.split_outputs(dnf)[0]
        assert sub.outputs[0].name == "d_query"
    args = rand_args(sub, 5)
    want = ref(sub, args)
    split = schedule.derive(sub, machines.load("delta-a100"), tiles={"s": 2, "t": 16}, split={"s": 3})
    assert "split_k(s, 3)" in split.history
    _on_both_backends(split, "delta-a100", args, want)


@settings(max_examples=300, deadline=None)
@given(linear_terms())
def test_conditions_out_keeps_the_meaning(term):
    """Σ_v (p ? x : 0) → p ? Σ_v x : 0 and (p ? x : 0) ± (p ? y : 0) → p ? x ± y : 0 for p not
    using v: the term's value (float64: the same sums, a few ulps where a ± regroups), and
    no Σ is left holding a condition it could give up."""
    a = np.random.default_rng(3).standard_normal((4, 4))
    out = W.conditions_out(term)
    assert out.free == term.free
    want = scalar_value(term, a, {})
    assert abs(scalar_value(out, a, {}) - want) <= F64 * max(1.0, abs(want))
    for x in D.walk(out):
        if isinstance(x, D.Red) and x.monoid == "add" and isinstance(x.body, D.Call) and x.body.op == "where":
            p, _, zero = x.body.children
            assert x.var in p.free or not (isinstance(zero, D.Lit) and zero.value == 0), x


def test_conditions_out_moves_a_repeated_condition_out_of_the_sum_it_builds():
    """⌈_a Σ_b (a < 1 ? (a < 1 ? A[a, a] : 0) : 0), the case hypothesis found: moving the outer
    condition out builds Σ_b (a < 1 ? A[a, a] : 0), which the walk had passed; it gives its
    condition up too (it kept it: the property above failed)."""
    from moajax.ix import Ix, Var

    a, b = Var("a", 2), Var("b", 4)
    p = D.Call("lt", (D.IndexValue(Ix.of(a)), D.Lit(1, np.int32)))
    zero = D.Lit(0.0, np.float64)
    x = D.Read("a", [Ix.of(a), Ix.of(a)], np.float64)
    term = D.Red("max", a, D.Red("add", b, D.Call("where", (p, D.Call("where", (p, x, zero)), zero))))
    out = W.conditions_out(term)
    arr = np.random.default_rng(3).standard_normal((4, 4))
    assert abs(scalar_value(out, arr, {}) - scalar_value(term, arr, {})) <= F64
    assert not any(isinstance(y, D.Red) and y.monoid == "add" and isinstance(y.body, D.Call) and y.body.op == "where"
                   for y in D.walk(out))


def test_split_k_moves_a_per_head_condition_out_of_the_partials_sums():
    """ALiBi's slopes inside documents masked by −∞ (B = 2): the slopes' gradient,
    Σ_b Σ_n ((c = n) ? Σ_s Σ_t … : 0), split over the heads and then the keys. ``sum_to_top``
    moves (c = n) inside to reach Σ_s; below the partial's top it moves out again
    (``conditions_out``), so the walk over b carries no [s, c] accumulator (the layout ptxas
    spilled 1 KB a thread for: tests/test_gpu_report.py). XLA and Pallas-interpret equal the
    reference (float64)."""
    import jax.numpy as jnp

    from moajax import machines, schedule

    slopes = jnp.asarray(2.0 ** -np.arange(1, 3))
    doc = jnp.asarray([0] * 5 + [1] * 11, jnp.int32)
    sub = _table_gradient(lambda s, b, h, qi, ki: jnp.where(doc[qi] == doc[ki], s + slopes[h] * (ki - qi), -jnp.inf),
                          (2, 16, 2, 8), [doc, slopes])
    args = rand_args(sub, 4)
    args[3] = np.asarray(doc)
    want = ref(sub, args)
    for machine in ("delta-epyc-7763", "delta-a100"):
        split = schedule.derive(sub, machines.load(machine), tiles={"t": 4, "s": 4}, split={"n_kv": 2, "s": 2})
        (part,) = [st for st in split.program.stages if st.name.endswith("_part_part")]
        below = part.body.body  # under the partial's own Σ_{s_i}: the condition, then the sums
        assert isinstance(below, D.Call) and below.op == "where", below
        assert not any(isinstance(x, D.Call) and x.op == "where" and "c1_0" in {v.name for v in x.children[0].free}
                       for x in D.walk(below.children[1])), "a sum below still selects the head's bin"
        _on_both_backends(split, machine, args, want)


@settings(max_examples=300, deadline=None)
@given(linear_terms())
def test_fused_sums_keep_the_meaning(term):
    """Sibling sums over one axis inside a sum become one, guards they share merge: the term's
    value (float64, reassociated: a few ulps)."""
    a = np.random.default_rng(2).standard_normal((4, 4))
    fused = W.fused_sums(term)
    assert fused.free == term.free
    want = scalar_value(term, a, {})
    assert abs(scalar_value(fused, a, {}) - want) <= F64 * max(1.0, abs(want))


@settings(max_examples=300, deadline=None)
@given(linear_terms(), st.sampled_from([1, 2, 3]))
def test_long_sums_outside_keep_the_meaning(term, longer_than):
    """Σ_a Σ_r f → Σ_r Σ_a f (r longer than the bound, a not, f holding no long sum): the
    term's value (float64, reassociated: a few ulps), and no long sum left right under a
    short one whose body holds no other long sum."""
    a = np.random.default_rng(3).standard_normal((4, 4))
    out = W.long_sums_outside(term, longer_than)
    assert out.free == term.free
    want = scalar_value(term, a, {})
    assert abs(scalar_value(out, a, {}) - want) <= F64 * max(1.0, abs(want))
    for x in D.walk(out):
        if isinstance(x, D.Red) and x.monoid == "add" and x.var.extent <= longer_than:
            r = x.body
            assert not (isinstance(r, D.Red) and r.monoid == "add" and r.var.extent > longer_than
                        and not any(y.var.extent > longer_than for y in D.reductions(r.body))), D.show(out)


@settings(max_examples=300, deadline=None)
@given(linear_terms(), st.sampled_from([1, 2, 3]))
def test_row_walks_outside_keep_the_meaning(term, longer_than):
    """Σ_a Σ_b f → Σ_b Σ_a f where f holds a reduction longer than the bound over b's rows and
    none over a's (``row_walks_outside``, the statistics here f's own reductions): the term's
    value (float64, reassociated: a few ulps)."""
    a = np.random.default_rng(4).standard_normal((4, 4))
    out = W.row_walks_outside(term, lambda f: [r.free for r in D.reductions(f) if r.var.extent > longer_than])
    assert out.free == term.free
    want = scalar_value(term, a, {})
    assert abs(scalar_value(out, a, {}) - want) <= F64 * max(1.0, abs(want))


def test_row_walks_outside_bring_the_walk_whose_rows_hold_a_statistic_outside():
    """Σ_s Σ_t (A[t s] − ⌈_{s'} A[t s']): the row max of t, a walk of its own, is recomputed for
    every s under Σ_s; the sums swap so that Σ_t is outside. Not where a's rows hold one too,
    nor for a statistic shorter than the bound."""
    from moajax.ix import Ix, Var

    s, t, s2 = Var("s", 4), Var("t", 4), Var("s2", 4)
    x = D.Read("a", [Ix.of(t), Ix.of(s)], np.float64)
    row_max = D.Red("max", s2, D.Read("a", [Ix.of(t), Ix.of(s2)], np.float64))
    col_max = D.Red("max", s2, D.Read("a", [Ix.of(s2), Ix.of(s)], np.float64))

    def stats(f):
        return [r.free for r in D.reductions(f) if r.var.extent > 2]

    f = D.Call("sub", (x, row_max))
    assert W.row_walks_outside(D.Red("add", s, D.Red("add", t, f)), stats) == D.Red("add", t, D.Red("add", s, f))
    both = D.Red("add", s, D.Red("add", t, D.Call("sub", (f, col_max))))
    assert W.row_walks_outside(both, stats) is both
    kept = D.Red("add", s, D.Red("add", t, f))
    assert W.row_walks_outside(kept, lambda f: [r.free for r in D.reductions(f) if r.var.extent > 4]) is kept


def test_fused_sums_share_the_walk_and_keep_a_one_hot_write():
    """Σ_n (Σ_s ((c = i) ? f : 0) + Σ_s ((c = i) ? g : 0)) → Σ_n Σ_s ((c = i) ? (f + g) : 0):
    one walk, still a one-hot write (binned, not a one-hot Σ); a stage's own top-level terms
    Σ_s f + Σ_s g stay two."""
    from moajax.ix import Ix, Var

    n, s, c = Var("n", 2), Var("s", 3), Var("c", 4)
    f = D.Read("a", [Ix.of(n), Ix.of(s)], np.float64)
    g = D.Call("mul", (f, f))
    hit = D.Call("eq", (D.IndexValue(Ix.of(c)), D.IndexValue(Ix.of(s))))
    zero = D.Lit(0.0, np.float64)
    two = D.Call("add", (D.Red("add", s, D.Call("where", (hit, f, zero))), D.Red("add", s, D.Call("where", (hit, g, zero)))))
    fused = W.fused_sums(D.Red("add", n, two))
    assert fused == D.Red("add", n, D.Red("add", s, D.Call("where", (hit, D.Call("add", (f, g)), zero))))
    assert D.one_hot_write(s, fused.body.body) is not None
    assert W.fused_sums(two) is two


def test_fused_sums_merge_two_sums_under_one_guard():
    """Σ_n ((p ? Σ_s f : 0) + (p ? Σ_s g : 0)) → Σ_n (p ? Σ_s (f + g) : 0), p = (c = n): a
    per-head table's gradient (ALiBi's slopes), each term of dS under the head's one-hot write,
    walks the scores once (two walks before 2026-12-07). Same value (float64; the guard here
    c < n, which the test's interpreter knows); a guard over sums that do not merge (other
    extents) stays as it was."""
    from moajax.ix import Ix, Var

    n, s, c, r = Var("n", 2), Var("s", 4), Var("c", 2), Var("r", 3)
    f = D.Read("a", [Ix.of(n), Ix.of(s)], np.float64)
    g = D.Call("mul", (f, f))
    hit = D.Call("lt", (D.IndexValue(Ix.of(c)), D.IndexValue(Ix.of(n))))
    zero = D.Lit(0.0, np.float64)

    def guarded(body):
        return D.Call("where", (hit, body, zero))

    two = D.Call("add", (guarded(D.Red("add", s, f)), guarded(D.Red("add", s, g))))
    fused = W.fused_sums(D.Red("add", n, two))
    assert fused == D.Red("add", n, guarded(D.Red("add", s, D.Call("add", (f, g))))), D.show(fused)
    a = np.random.default_rng(5).standard_normal((4, 4))
    for cv in range(2):
        want = scalar_value(D.Red("add", n, two), a, {c: cv})
        assert abs(scalar_value(fused, a, {c: cv}) - want) <= F64 * max(1.0, abs(want))
    h = D.Read("a", [Ix.of(n), Ix.of(r)], np.float64)
    apart = D.Red("add", n, D.Call("add", (guarded(D.Red("add", s, f)), guarded(D.Red("add", r, h)))))
    assert W.fused_sums(apart) is apart


def test_a_stage_inlined_where_an_axis_of_extent_one_is_indexed_by_zero():
    """st[n d] = Σ_f a[n f]·u[n d] with d < 1, read at ⟨n 0⟩, is Σ_f a[n f]·u[n 0]: ψ over an
    axis of extent 1 is its one item, so ``Ix`` writes its index as the constant 0 — an index
    like any (``accumulate`` inlines the sum a 16-bit output's convert wraps, and crashed on
    it). Read at its own ⟨n d⟩ the body comes back as it is, still reading u at its own index."""
    from moajax.ix import Ix, Var

    n, d, f = Var("n", 5), Var("d", 1), Var("f", 4)
    u = D.Ref("u", [Ix.of(n), Ix.of(d)], np.float32)
    body = D.Red("add", f, D.Call("mul", (D.Read("a", [Ix.of(n), Ix.of(f)], np.float32), u)))
    st = O.Stage("st", (n, d), body)
    assert W._at(st, D.Ref("st", [Ix.of(n), Ix.of(d)], np.float32)) is body
    at0 = W._at(st, D.Ref("st", [Ix.of(n), Ix.of(0)], np.float32))
    assert at0 == D.substitute(body, {d: Ix.of(0)})
    assert [str(i) for i in next(x for x in D.walk(at0) if isinstance(x, D.Ref)).index] == ["n", "0"]


# (x [n D], W_g, W_u [D F], W_d [F D]); (q [B N H], K, V [B S 1 H]); (q [B 1 N H], K, V [B S 1 H])
EXTENT_ONE_GRADS = {
    "gated_mlp-D1": ("gated_mlp", ((5, 1), (1, 4), (1, 4), (4, 1))),
    "gated_mlp-F1": ("gated_mlp", ((5, 4), (4, 1), (4, 1), (1, 4))),
    "decode-mqa": ("decode_attention", ((2, 2, 8), (2, 8, 1, 8), (2, 8, 1, 8))),
    "attention-mqa-T1": ("dot_product_attention", ((2, 1, 2, 8), (2, 8, 1, 8), (2, 8, 1, 8))),
}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", sorted(EXTENT_ONE_GRADS))
def test_16_bit_gradient_summing_into_an_axis_of_extent_one(case, dtype):
    """∂/∂args Σ float32(f(args)) in a 16-bit dtype equals the float32 gradient of the same f
    at the same (16-bit) values, where a gradient sums into an axis of extent 1: the SwiGLU
    MLP's D or F of 1, MQA's one kv head (decode, and attention over one query row). The
    16-bit output is c · Σ_r g under a convert, so ``accumulate`` inlines the sum's stage at
    an index ψ wrote as the constant 0 (``_at``); this crashed the scheduler."""
    import jax
    import jax.numpy as jnp

    import moajax

    name, shapes = EXTENT_ONE_GRADS[case]
    fn = getattr(moajax, name)
    dt = jnp.dtype(dtype)
    r = np.random.default_rng(0)
    low = [jnp.asarray(r.standard_normal(s), dt) for s in shapes]
    wrt = tuple(range(len(low)))
    got = jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), wrt)(*low)
    want = jax.grad(lambda *a: fn(*a).sum(), wrt)(*(a.astype(jnp.float32) for a in low))
    # The inputs are the same numbers, so the difference is the 16-bit roundings inside: the
    # gradient's own and the few 16-bit values the backward reads (the sums add up in float32),
    # each ≤ u = 2^-8 (bfloat16) or 2^-11 (float16) of the largest |∂|; 4u bounds them (seen:
    # ≤ 0.7u in bfloat16, ≤ 0.9u in float16)
    u = 2.0 ** -(jnp.finfo(dt).nmant + 1)
    for g, w in zip(got, want):
        assert g.dtype == dt and g.shape == w.shape
        assert rel_err(g, w) <= 4 * u
