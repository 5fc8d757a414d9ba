"""ψ-reduction never changes meaning: DNF → JAX (float64) equals the NumPy evaluation of the
un-reduced expression on random expression DAGs (hypothesis, rel ≤ 1e-12)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from exprgen import expressions
from helpers import rel_err
from moajax import dnf as D
from moajax import numpy_eval, reference
from moajax.psi import psi_reduce

# float64 evaluation: both sides round at every op, in different orders (tensordot vs
# einsum, reduction trees); a few ulps per op of depth ≤ ~20 stays far below 1e-12.
TOL = 1e-12


@settings(max_examples=250)
@given(expressions(max_ops=7))
def test_dnf_equals_unreduced_numpy(case):
    expr, inputs, _ = case
    dnf, _ = psi_reduce(expr, "random")
    # no intermediate survives: every read is of a declared input
    assert dnf.arrays_read() <= set(inputs)
    fn = reference.to_jax(dnf)
    got = np.asarray(fn(*[inputs[s.name] for s in dnf.inputs]))
    want = numpy_eval.evaluate(expr, inputs)
    assert got.shape == expr.shape
    if want.dtype == np.bool_:
        assert np.array_equal(got, want)
    else:
        assert rel_err(got, want) <= TOL


@settings(max_examples=60)
@given(expressions(max_ops=4), st.integers(0, 3))
def test_dnf_is_deterministic_and_hash_consed(case, _):
    expr, _, _ = case
    d1, _ = psi_reduce(expr, "a")
    d2, _ = psi_reduce(expr, "b")
    # hash-consing: the same expression reduces to the identical IR object
    assert d1.output.body is d2.output.body
    assert all(isinstance(r, D.Read) for r in d1.reads())
