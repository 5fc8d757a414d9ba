"""Shared test helpers (tests/ is on pytest's pythonpath)."""

import numpy as np


def rel_err(actual, expected) -> float:
    """max |a − e| / max |e|: the relative error of an array against its reference."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"shape {a.shape} != {e.shape}"
    if not e.size:
        return 0.0
    assert np.all(np.isfinite(a)), "non-finite values in the result"
    scale = max(float(np.max(np.abs(e))), 1e-300)
    return float(np.max(np.abs(a - e))) / scale


def rng(seed=0):
    return np.random.default_rng(seed)


def inputs_of(expr):
    """The moa inputs an expression reads, by name."""
    from moajax import moa

    found = {x.name: x for x in moa.nodes(expr) if isinstance(x, moa.Input)}
    return [found[k] for k in sorted(found)]
