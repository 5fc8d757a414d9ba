"""Machine profiles: every config parses; lookups; the local profile."""

import numpy as np
import pytest

from moajax import machines


def test_every_profile_loads():
    profs = machines.available()
    for name in ("delta-a100", "delta-a40", "h200", "delta-epyc-7763", "anvil-epyc-7543", "local"):
        assert name in profs, sorted(profs)
    a40 = profs["delta-a40"]
    assert a40.is_gpu and a40.onchip_limit_bytes == 101376 and a40.arch == "sm_86"
    assert profs["delta-epyc-7763"].numa_domains == 8 and profs["delta-epyc-7763"].cores == 128
    assert profs["anvil-epyc-7543"].numa_domains == 4


def test_peaks():
    a100 = machines.load("delta-a100")
    assert a100.peak(np.float64) == pytest.approx(9.7e12)
    assert a100.peak(np.float32, tensor=True) == pytest.approx(156e12)
    assert a100.peak("bfloat16", tensor=True) == pytest.approx(312e12)
    assert a100.bandwidth == pytest.approx(1555e9)


def test_unknown_profile():
    with pytest.raises(ValueError, match="no machine profile 'nope'"):
        machines.load("nope")


def test_local_and_device():
    m = machines.for_device()
    assert m.kind == "cpu" and m is machines.local()
    assert m.peak(np.float32) > 0


def test_median_seconds_warms_up_then_times_each_run():
    from moajax.timing import median_seconds

    calls = []

    def f(x):
        calls.append(x)
        return x

    t = median_seconds(f, 1.0, reps=3, warmups=2)
    assert len(calls) == 5 and 0.0 <= t < 1.0
