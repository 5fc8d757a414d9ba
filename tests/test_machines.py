"""Machine profiles: every config parses; lookups; how the local profile is chosen
($MOAJAX_MACHINE, the measured profile in the cache, the generic CPU); ``moajax measure``."""

import logging
import os

import numpy as np
import pytest

from moajax import machines, measure
from moajax.cli import main


@pytest.fixture
def fresh_local(monkeypatch, tmp_path):
    """An empty cache directory, no $MOAJAX_MACHINE, and ``local()`` re-read before and after."""
    monkeypatch.setenv("MOAJAX_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MOAJAX_MACHINE", raising=False)
    machines.local.cache_clear()
    yield tmp_path
    machines.local.cache_clear()


def test_every_profile_loads():
    profs = machines.available()
    for name in ("delta-a100", "delta-a40", "h200", "delta-epyc-7763", "anvil-epyc-7543"):
        assert name in profs, sorted(profs)
    assert "local" not in profs  # a machine's measured profile is cached on it, never committed
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
    # the suite is hermetic (conftest.py): no measured profile, so the generic CPU with this topology
    m = machines.for_device()
    assert m.kind == "cpu" and m is machines.local()
    assert m.name == machines.GENERIC_CPU.name and m.cores == (os.cpu_count() or 1)
    assert m.peak(np.float32) > 0 and m.bandwidth > 0


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("MOAJAX_CACHE_DIR", str(tmp_path / "c"))
    assert machines.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("MOAJAX_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert machines.cache_dir() == tmp_path / "xdg" / "moajax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert machines.cache_dir() == tmp_path / "home" / ".cache" / "moajax"


def test_unmeasured_machine_gets_generic_profile_with_sysfs_topology_and_one_notice(fresh_local, caplog):
    with caplog.at_level(logging.WARNING, logger="moajax"):
        m = machines.local()
        assert machines.local() is m
    assert m.name == machines.GENERIC_CPU.name and m.kind == "cpu"
    assert m.peak_tflops == machines.GENERIC_CPU.peak_tflops
    topo = machines.topology()
    assert m.cores == (os.cpu_count() or 1) == topo["cores"]
    assert (m.numa_domains, m.l2_cache_bytes, m.llc_bytes, m.arch) == (
        topo["numa_domains"], topo["l2_cache_bytes"], topo["llc_bytes"], topo["arch"])
    assert m.description.startswith("unmeasured CPU (")
    notices = [r for r in caplog.records if r.name == "moajax"]
    assert len(notices) == 1, notices
    msg = notices[0].getMessage()
    assert "generic" in msg and "moajax measure" in msg and str(fresh_local / "local.toml") in msg
    assert "\n" not in msg


def test_measured_profile_in_cache_is_local(fresh_local):
    m = machines.Machine(
        "cached-box", "cpu", 12.5, {"float64": 0.25, "float32": 0.5, "bfloat16": 0.4, "float16": 0.4},
        description="Test CPU, 4 cores (measured 2026-01-02)", arch="x86_64", cores=4, numa_domains=2,
        l2_cache_bytes=2**20, llc_bytes=2**25, launch_overhead_us=2.0,
        measured={"date": "2026-01-02", "gemm_n": 2048, "copy_mb": 512},
    )
    (fresh_local / "local.toml").write_text(measure.to_toml(m))
    assert machines.local() == m
    assert "cached-box" not in machines.available()  # only local() reads the cache


def test_machine_env_selects_a_profile(fresh_local, monkeypatch):
    monkeypatch.setenv("MOAJAX_MACHINE", "delta-epyc-7763")
    assert machines.local() is machines.load("delta-epyc-7763")
    machines.local.cache_clear()
    monkeypatch.setenv("MOAJAX_MACHINE", "nope")
    with pytest.raises(ValueError, match="MOAJAX_MACHINE='nope'.*delta-epyc-7763"):
        machines.local()


def test_measure_command_writes_a_profile(tmp_path, capsys):
    out = tmp_path / "sub" / "m.toml"
    assert main(["measure", "--quick", "--out", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    m = machines._from_toml(out)
    assert m.kind == "cpu" and m.name == "local" and m.measured["gemm_n"] == 512
    assert all(m.peak_tflops[dt] > 0 for dt in ("float64", "float32", "bfloat16", "float16"))
    assert m.memory_bandwidth_gb_s > 0 and m.cores == (os.cpu_count() or 1)


def test_median_seconds_warms_up_then_times_each_run():
    from moajax.timing import median_seconds

    calls = []

    def f(x):
        calls.append(x)
        return x

    t = median_seconds(f, 1.0, reps=3, warmups=2)
    assert len(calls) == 5 and 0.0 <= t < 1.0


def test_a_virtual_machines_host_l3_is_capped_at_a_cores_share(monkeypatch):
    """A cloud VM's sysfs (2 vCPUs, this suite's machine on 2026-12-02) says its L3 is 491,520 KiB,
    shared by cpus 0-1. Taken whole, the CPU budget held a whole 4096-token sequence per score
    tile: no row loop, so jit(grad) of attention ran the owner plan with no masked tile
    skipped. At most 16 MiB a core, it derives what a 32 MiB L3 gives: the fused adjoint, 512
    key rows per program, walked (``cpu_loop``)."""
    import dataclasses

    import jax

    from moajax import schedule
    from moajax.kernels.attention import mha_kernel

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(machines, "_usable_cores", lambda: 2)
    monkeypatch.setattr(machines, "_sysfs_cache_bytes", lambda level: {2: 2 << 20, 3: 491520 << 10}[level])
    topo = machines.topology()
    assert topo["llc_bytes"] == 2 * machines.LLC_PER_CORE_MAX == 32 << 20
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # a container of 2 cores on a 64-core host
    assert machines.topology()["llc_bytes"] == 32 << 20
    monkeypatch.setattr(machines, "_sysfs_cache_bytes", lambda level: {2: 2 << 20, 3: 24 << 20}[level])
    assert machines.topology()["llc_bytes"] == 24 << 20  # a real share is kept

    specs = [jax.ShapeDtypeStruct((1, 4096, 8, 64), np.float32)] * 3
    adj, args = mha_kernel(None, None, False).saved_adjoint(*specs)
    vm = dataclasses.replace(machines.GENERIC_CPU, cores=2, llc_bytes=topo["llc_bytes"])
    plan = schedule.derive_plan(adj.dnf(*args), vm)
    assert not isinstance(plan, tuple), "the fused adjoint: one kernel"
    assert plan.axis("s").tile == 512 and plan.knobs.cpu_loop == ("s",)
    whole = schedule.derive_plan(adj.dnf(*args), dataclasses.replace(vm, llc_bytes=491520 << 10))
    # what it was: every key in one row tile ([8 4096 256] score tiles, 8× the capped budget's),
    # so no causal tile is ever all masked (now the fused adjoint's one walk, then owner)
    assert not isinstance(whole, tuple) and whole.axis("s").ntiles == 1 and not whole.knobs.cpu_loop


def test_an_unlisted_gpu_gets_its_own_arch_and_shared_memory(caplog):
    """A CUDA device no profile names (an L40S: compute capability 8.9, 99 KB of shared memory
    a block, 142 multiprocessors) is not given the A100's 163 KB, which its tilings would not
    fit: its own arch and limit, spill-checked; ``load`` rebuilds it from its name (an ONF's
    target). An unknown capability keeps the default profile, with a warning."""
    import logging

    from moajax import schedule
    from moajax.kernels.attention import mha_dnf

    class L40S:
        platform, device_kind, compute_capability, core_count = "gpu", "NVIDIA L40S", "8.9", 142

    m = machines.for_device(L40S())
    assert (m.name, m.arch, m.shared_memory_per_block, m.multiprocessors) == ("generic-gpu-sm_89", "sm_89", 101376, 142)
    assert m.spill_check and m.is_gpu
    assert machines.load("generic-gpu-sm_89").shared_memory_per_block == 101376
    onf = schedule.derive(mha_dnf((1, 1024, 8, 64), (1, 1024, 8, 64), (1, 1024, 8, 64), np.float32),
                          machines.load("generic-gpu-sm_89"))
    a40 = schedule.derive(mha_dnf((1, 1024, 8, 64), (1, 1024, 8, 64), (1, 1024, 8, 64), np.float32),
                          machines.load("delta-a40"))
    assert [(a.name, a.tile) for a in onf.axes] == [(a.name, a.tile) for a in a40.axes]  # the A40's fit

    class Future:
        platform, device_kind, compute_capability = "gpu", "NVIDIA Future", "13.0"

    with caplog.at_level(logging.WARNING, logger="moajax"):
        f = machines.for_device(Future())
    assert f.name == machines.GENERIC_GPU_NAME and f.spill_check
    assert any("has no profile" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="compute capability"):
        machines.generic_gpu("7.5")
