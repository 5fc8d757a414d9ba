"""Structural properties of the DNFs, asserted on the IR (never on printed text)."""

import numpy as np

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
