"""Structural properties of the DNFs, asserted on the IR (never on printed text)."""

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from exprgen import expressions
from helpers import inputs_of, scalar_value
from moajax import dnf as D
from moajax.kernels import attention, block, decode, rmsnorm, swiglu


def leaves(e):
    return [x for x in D.walk(e) if not x.children]


def test_attention_dnf_reads_only_q_k_v_directly():
    d = attention.dnf((8, 4), (12, 4), (12, 6))
    out = d.output
    assert [v.name for v in out.vars] == ["t", "e"]
    # only inputs are indexed: the IR has no node for an intermediate array at all
    assert d.arrays_read() == {"query", "key", "value"}
    assert not any(isinstance(x, D.Ref) for x in D.walk(out.body))
    for leaf in leaves(out.body):
        assert isinstance(leaf, (D.Read, D.Lit, D.IndexValue))
    for r in d.reads():
        # every read is direct: one plain index variable per axis, in the array's own axis order
        vars_ = [i.as_var() for i in r.index]
        assert all(v is not None for v in vars_), r
        assert len(set(vars_)) == len(vars_)
        spec = d.input(r.array)
        assert [v.extent for v in vars_] == list(spec.shape)
    # K is read as ⟨s h⟩ψK (keys × head dim): no transposed K
    key_reads = [r for r in d.reads() if r.array == "key"]
    for r in key_reads:
        s, h = (i.as_var() for i in r.index)
        assert s.extent == 12 and h.extent == 4
    # the score is a scalar expression (a labelled sum over h), not an array read
    scores = [x for x in D.walk(out.body) if isinstance(x, D.Tag) and x.label == "score"]
    assert scores and all(isinstance(D.canonical(x.body), D.Call) for x in scores)
    # the softmax is reductions (max, sum) whose bodies index Q and K: no temporaries
    monoids = {x.monoid for x in D.walk(out.body) if isinstance(x, D.Red)}
    assert monoids == {"add", "max"}


def test_decode_dnf_reads_cache_directly():
    d = decode.dnf((4,), (16, 4), (16, 6))
    assert d.arrays_read() == {"query", "key", "value"}
    assert [v.name for v in d.output.vars] == ["e"]


def test_every_kernel_dnf_reads_only_inputs():
    for k in (attention, decode, rmsnorm, swiglu, block):
        d = k.dnf()
        assert d.arrays_read() <= {i.name for i in d.inputs}
        for o in d.outputs:
            for leaf in leaves(o.body):
                assert isinstance(leaf, (D.Read, D.Lit, D.IndexValue))


def test_hash_consing_shares_invariant_reductions():
    # the row max inside the numerator and the denominator is one IR node, per row
    d = attention.dnf((8, 4), (12, 4), (12, 6))
    maxes = {x for x in D.walk(d.output.body) if isinstance(x, D.Red) and x.monoid == "max"}
    assert len(maxes) == 1
    (m,) = maxes
    assert {v.name for v in m.free} == {"t"}


def test_canonical_is_alpha_invariant():
    from moajax.ix import Ix, Var

    i, j = Var("i", 3), Var("j", 3)
    body = lambda v: D.Call("mul", (D.Read("a", [Ix.of(v)], np.float64), D.Lit(2.0, np.float64)))
    r1 = D.Red("add", i, body(i))
    r2 = D.Red("add", j, body(j))
    assert r1 is not r2 and D.canonical(r1) is D.canonical(r2)



EXTENT = 3


@st.composite
def nested_terms(draw, depth: int = 0, scope: tuple = ()):
    """A scalar DNF term over the variables in ``scope``: reads of A[3, 3] at two of them,
    literals, +, ×, exp and max, and reductions (Σ, ⌈) binding a new variable — nested ones
    reading the variables of the reductions around them (what α-renaming must not capture)."""
    from moajax.ix import Ix, Var

    kinds = ["read", "lit"] + (["call", "call", "red", "red"] if depth < 4 else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "read" and scope:
        i, j = draw(st.sampled_from(scope)), draw(st.sampled_from(scope))
        return D.Read("a", [Ix.of(i), Ix.of(j)], np.float64)
    if kind in ("read", "lit"):
        return D.Lit(draw(st.sampled_from([0.5, 1.0, 2.0])), np.float64)
    if kind == "call":
        op = draw(st.sampled_from(["add", "mul", "maximum"]))
        return D.Call(op, (draw(nested_terms(depth + 1, scope)), draw(nested_terms(depth + 1, scope))))
    v = Var(draw(st.sampled_from(["i", "j", "k"])) + str(depth), EXTENT)  # may repeat an outer name
    body = draw(nested_terms(depth + 1, scope + (v,)))
    return D.Red(draw(st.sampled_from(["add", "max"])), v, D.Call("exp", (D.Call("mul", (body, D.Lit(0.1, np.float64))),)))


@settings(max_examples=200, deadline=None)
@given(nested_terms(), st.sampled_from(["′", "_x"]))
def test_canonical_forms_of_nested_reductions(term, suffix):
    """Nested reductions: canonical(e) is one term for e and any renaming of its bound
    variables, it is its own canonical form, and it has e's value (float64, the same
    operations in the same order: equal to the bit)."""
    other = _renamed(term, suffix)
    canon = D.canonical(term)
    assert D.canonical(other) is canon and D.canonical(canon) is canon
    assert canon.free == term.free == frozenset()
    a = np.random.default_rng(0).standard_normal((EXTENT, EXTENT))
    assert scalar_value(canon, a, {}) == scalar_value(term, a, {})


def _renamed(e, suffix: str):
    """e with every bound variable renamed (v ↦ v + suffix): α-equivalent, a different term."""
    from moajax.ix import Ix, Var

    def fn(x):
        if isinstance(x, D.Red):
            v = Var(x.var.name + suffix, x.var.extent)
            return D.Red(x.monoid, v, D.substitute(x.body, {x.var: Ix.of(v)}))
        return None

    return D.transform(e, fn)


@settings(max_examples=25, deadline=None)
@given(expressions(max_ops=6), st.sampled_from(["′", "_x"]))
def test_canonical_forms_are_alpha_invariant_and_keep_the_meaning(case, suffix):
    """canonical(e) is one term for e and any renaming of e's bound variables, and it is e's
    value (the reference evaluates both to the same array: float64, the same operations)."""
    from moajax import reference
    from moajax.psi import reduce_to_dnf

    expr, values, _ = case
    inputs = inputs_of(expr)
    dnf, _ = reduce_to_dnf("e", inputs, expr, record=False)
    (out,) = dnf.outputs
    other = _renamed(out.body, suffix)
    if any(isinstance(x, D.Red) for x in D.walk(out.body)):
        assert other is not out.body
    canon = D.canonical(out.body)
    assert D.canonical(other) is canon and D.canonical(canon) is canon
    renamed = D.DNF("e", dnf.inputs, (dataclasses.replace(out, body=canon),))
    args = [values[x.name] for x in inputs]
    assert np.array_equal(np.asarray(reference.to_jax(renamed)(*args)), np.asarray(reference.to_jax(dnf)(*args)))


def _spec(*shape):
    import jax

    return jax.ShapeDtypeStruct(shape, np.float32)


def test_collapsed_merges_a_vmapped_batch_into_the_rows():
    """⟨b n d⟩ψx = ⟨b·N + n, d⟩ψx′: RMSNorm under Ω over a batch axis, and its derived adjoint
    (dw = Σ_b Σ_n …), collapse to the unbatched kernel's DNF at [B·N, D] — the same hash-consed
    bodies — with the merged axis named after the rows."""
    bk = rmsnorm.batched((True, False))
    flat, pairs = D.collapsed(bk.dnf(_spec(4, 8, 16), _spec(16)))
    assert pairs == (("vmap0", "n"),)
    want = rmsnorm.dnf(_spec(32, 16), _spec(16))
    assert flat.inputs == want.inputs and [o.body for o in flat.outputs] == [o.body for o in want.outputs]
    adj, = [bk.adjoint(_spec(4, 8, 16), _spec(16)).dnf(_spec(4, 8, 16), _spec(16), _spec(4, 8, 16))]
    flat_adj, _ = D.collapsed(adj)
    want_adj = rmsnorm.adjoint(_spec(32, 16), _spec(16)).dnf(_spec(32, 16), _spec(16), _spec(32, 16))
    assert [o.body for o in flat_adj.outputs] == [o.body for o in want_adj.outputs]
    assert [o.shape for o in flat_adj.outputs] == [(32, 16), (16,)]


def test_collapsed_leaves_axes_read_apart_or_in_arithmetic():
    # attention: the batch sits beside t in q but beside s in k; a causal mask reads t in
    # index arithmetic; decode's cache axis is reduced alone — nothing merges
    from moajax.kernels.attention import mha_kernel

    q = _spec(2, 8, 2, 4)
    assert D.collapsed(mha_kernel(None, None, False).dnf(q, q, q)) is None
    assert D.collapsed(mha_kernel(None, None, False).dnf(q, q, q, is_causal=True)) is None
    assert D.collapsed(rmsnorm.dnf(_spec(8, 16), _spec(16))) is None
