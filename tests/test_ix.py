"""Index arithmetic: simplification is exact (hypothesis over all variable values)."""

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from moajax.ix import Ix, Var


@st.composite
def index_exprs(draw, depth=3):
    vs = [Var("i", draw(st.integers(1, 5))), Var("j", draw(st.integers(1, 5)))]
    e = Ix.of(draw(st.integers(-5, 5)))
    for _ in range(draw(st.integers(1, depth + 2))):
        kind = draw(st.sampled_from(["add", "mul", "div", "mod", "sub"]))
        if kind in ("add", "sub"):
            t = Ix.of(draw(st.sampled_from(vs))) * draw(st.integers(-3, 3))
            e = e + t if kind == "add" else e - t
        elif kind == "mul":
            e = e * draw(st.integers(-3, 3))
        elif kind == "div":
            e = e.floordiv(draw(st.integers(1, 6)))
        else:
            e = e.mod(draw(st.integers(1, 6)))
    return e, vs


@settings(max_examples=300)
@given(index_exprs())
def test_bounds_contain_every_value(case):
    e, vs = case
    lo, hi = e.bounds()
    for vals in itertools.product(*(range(v.extent) for v in vs)):
        val = e.evaluate(dict(zip(vs, vals)))
        assert lo <= val <= hi


def test_floordiv_mod_identities():
    h, g, d = Var("h", 3), Var("g", 4), Var("d", 8)
    flat = (Ix.of(h) * 4 + g) * 8 + d
    assert flat.floordiv(8) == Ix.of(h) * 4 + g
    assert flat.mod(8) == Ix.of(d)
    assert flat.floordiv(32) == Ix.of(h)
    c = Var("c", 12)
    assert Ix.of(c).floordiv(4) * 4 + Ix.of(c).mod(4) == Ix.of(c)
    assert (Ix.of(d) + 8).mod(8) == Ix.of(d)


@settings(max_examples=300)
@given(index_exprs(), st.integers(1, 7))
def test_floordiv_and_mod_are_exact(case, k):
    e, vs = case
    for vals in itertools.product(*(range(v.extent) for v in vs)):
        env = dict(zip(vs, vals))
        x = e.evaluate(env)
        assert e.floordiv(k).evaluate(env) == x // k
        assert e.mod(k).evaluate(env) == x % k


def test_substitute_and_printing():
    i, j = Var("i", 4), Var("j", 3)
    e = Ix.of(i) * 2 + j - 1
    assert str(e) == "2·i + j − 1"
    assert e.substitute({i: Ix.of(j)}) == Ix.of(j) * 3 - 1
    assert Ix.of(i).as_var() == i and (Ix.of(i) + 2).as_shifted_var() == (i, 2)
