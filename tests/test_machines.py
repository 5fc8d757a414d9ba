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
    # the CPU score tile was timed (the quick run at S = 256) and what it pinned, if anything, is one it timed
    assert m.measured["tune_seq"] == 256 and "derived" in m.measured["score_tile_ms"]
    assert m.cpu_score_tile_bytes in (0,) + measure.SCORE_TILE_BUDGETS


def test_tuning_the_score_tile_pins_a_budget_only_where_it_beats_the_derived_one():
    """``measure.tune_score_tile`` times the derived default and each budget (here two, at a
    small size, one run each: the rule is checked on what it measured, not the machine's
    speed): it pins the fastest only where it beats the default by more than the margin."""
    import dataclasses

    base = dataclasses.replace(machines.GENERIC_CPU, cores=2, llc_bytes=8 << 20)
    tile, times = measure.tune_score_tile(base, seq=128, budgets=(1 << 20, 4 << 20), reps=1)
    assert set(times) == {0, 1 << 20, 4 << 20} and all(t > 0 for t in times.values())
    best = min((1 << 20, 4 << 20), key=times.get)
    if times[best] < (1 - measure.TUNE_MARGIN) * times[0]:
        assert tile == best
    else:
        assert tile == 0
    pinned = dataclasses.replace(base, cpu_score_tile_bytes=4 << 20, measured={"score_tile_ms": "derived 1.0 ms"})
    assert "cpu_score_tile_bytes = 4194304" in measure.to_toml(pinned)
    with pytest.raises(ValueError, match="tune_score_tile: seq, reps and every budget must be positive"):
        measure.tune_score_tile(base, seq=0)
    with pytest.raises(ValueError, match="tune_seq not negative"):
        measure.measure(tune_seq=-1)


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


def test_the_cpu_score_tile_budget():
    """A CPU score tile of at least 4 MiB (``schedule.CPU_SCORE_TILE_MIN``) whatever the cache:
    an 8 MiB last-level cache used to give 1 MiB and 128-row tiles, which made jit(grad)
    1.45× slower on such a host (bench/results/cpu_score_tile_epyc_avx2.md); above 32 MiB
    it is 1/8 of the cache, as before; a profile's ``cpu_score_tile_bytes`` overrides both."""
    import dataclasses

    from moajax import schedule
    from moajax.kernels.attention import mha_dnf

    vm = dataclasses.replace(machines.GENERIC_CPU, cores=2, llc_bytes=8 << 20)
    assert schedule._cpu_cache_budget(vm) == 4 << 20
    assert schedule._cpu_cache_budget(dataclasses.replace(vm, llc_bytes=64 << 20)) == 8 << 20
    assert schedule._cpu_cache_budget(dataclasses.replace(vm, cpu_score_tile_bytes=1 << 20)) == 1 << 20
    dnf = mha_dnf((1, 1024, 8, 64), (1, 1024, 8, 64), (1, 1024, 8, 64), np.float32)
    # [8 heads × t × 256 keys] float32: 512 rows in 4 MiB, 128 in 1 MiB
    assert schedule.derive(dnf, vm).axis("t").tile == 512
    assert schedule.derive(dnf, dataclasses.replace(vm, cpu_score_tile_bytes=1 << 20)).axis("t").tile == 128
    with pytest.raises(ValueError, match="cpu_score_tile_bytes must be a non-negative int"):
        dataclasses.replace(vm, cpu_score_tile_bytes=-1)


def test_a_call_inside_using_runs_that_profiles_onf():
    """``machines.using(profile)``: ``local()`` is that profile inside the block (nested blocks
    too), and a call made there derives for it — not the ONF an earlier call outside cached
    (the kernel's compiled functions and ``runtime.schedules`` are keyed by the profile). Its
    result is the same up to float32 summation order: rel ≤ 1e-5 against the float64
    reference (sums of ≤ 256 float32 terms in either tiling)."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    import moajax
    import references as R
    from helpers import rel_err
    from moajax.kernels.attention import mha_kernel

    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.standard_normal((1, 256, 2, 16)), jnp.float32) for _ in range(3))
    base = dataclasses.replace(machines.GENERIC_CPU, cores=2, llc_bytes=8 << 20)
    small = dataclasses.replace(base, cpu_score_tile_bytes=2 * 128 * 256 * 4)  # 2 heads × 128 rows × 256 keys
    kern = mha_kernel(None, None, False)
    tiles, hlo = {}, {}

    def attn(a, b, c):
        return moajax.dot_product_attention(a, b, c, implementation="xla")

    with machines.using(base):
        assert machines.local() is base
        tiles["base"] = kern.onf(q, k, v, implementation="xla").axis("t").tile
        out = attn(q, k, v)
        # a new function each time: JAX caches a jitted function's trace by the function
        hlo["base"] = jax.jit(lambda *a: attn(*a)).lower(q, k, v).as_text()
        with machines.using(small):
            assert machines.local() is small
            tiles["small"] = kern.onf(q, k, v, implementation="xla").axis("t").tile
            out_small = attn(q, k, v)
            hlo["small"] = jax.jit(lambda *a: attn(*a)).lower(q, k, v).as_text()
            grads = jax.grad(lambda a: jnp.sum(moajax.dot_product_attention(a, k, v, implementation="xla")))(q)
        assert machines.local() is base
    assert machines.local() is not base and machines.local() is not small
    assert (tiles["base"], tiles["small"]) == (256, 128)
    # the program run is the profile's: [2 heads, 128 rows, 256 keys] score tiles only in the small one's
    assert "2x128x256" not in hlo["base"] and "2x128x256" in hlo["small"]
    want = R.mha(*(np.asarray(x, np.float64) for x in (q, k, v)))
    assert rel_err(out, want) <= 1e-5 and rel_err(out_small, want) <= 1e-5
    assert np.all(np.isfinite(np.asarray(grads)))
    with pytest.raises(TypeError, match="using: machine must be a Machine or a profile name"):
        with machines.using(3):
            pass


def test_a_profiles_own_tilings_are_read_and_checked():
    """``gpu_tiles`` (a profile's own measured tilings, ``Machine.tilings``): the H200's
    bfloat16 dK/dV tiling from its sweep; a malformed key or tiling names the profile."""
    import dataclasses

    h200 = machines.load("h200")
    assert h200.tilings("scatter", 2, 64) == [(64, 64, 4, 2)]
    assert h200.tilings("scatter_walk", 2, 64) == [] and machines.load("delta-a100").gpu_tiles == {}
    assert machines.generic_gpu("9.0", 132).gpu_tiles == {}  # measured on another GPU than an unlisted one
    for bad in ({"scatter 2": [[64, 64, 4, 2]]}, {"warp 2 64": [[64, 64, 4, 2]]}, {"scatter 2 32": [[64, 64, 4, 2]]},
                {"scatter 3 64": [[64, 64, 4, 2]]}, {"scatter  2 64": [[64, 64, 4, 2]]},
                {"scatter 2 64": [[64, 64, 4]]}, {"scatter 2 64": [[64, 64, 0, 2]]}, {"scatter 2 64": []},
                {"scatter 2 64": [[48, 64, 4, 2]]}, {"scatter 2 64": [[True, 64, 4, 2]]},
                {"scatter 2 64": [[64, 64, 4, 0]]}):
        with pytest.raises(ValueError, match="'h200'.*gpu_tiles"):
            dataclasses.replace(h200, gpu_tiles=bad)


def test_a_gpu_profile_set_in_process_runs_its_own_onf(monkeypatch):
    """A GPU profile set in place of this process's (``runtime.gpu_machine``, as tests and the
    offline reports set it) derives and runs that profile's ONF, with no cache to clear: the
    derived schedules and the kernel's compiled functions are keyed by it. Before, a second
    profile in one process reused the first one's (bfloat16, H = 128: the H200 tiles the
    queries by 128, the A40 by 64), so a test looping over profiles tested the first only."""
    import re

    import jax
    import jax.numpy as jnp

    import moajax
    from moajax import runtime
    from moajax.kernels.attention import mha_kernel

    spec = jax.ShapeDtypeStruct((1, 1024, 2, 128), jnp.bfloat16)
    kern = mha_kernel(None, None, False)
    seen = {}
    for name in ("h200", "delta-a40", "h200"):
        m = machines.load(name)
        monkeypatch.setattr(runtime, "gpu_machine", lambda path="pallas", m=m: m)
        onf = kern.onf(spec, spec, spec, implementation="pallas_interpret")
        text = str(jax.make_jaxpr(lambda *a: moajax.dot_product_attention(*a, implementation="pallas_interpret"))(
            spec, spec, spec))
        seen.setdefault(name, []).append((onf.axis("t").tile, re.findall(r"grid=\([^)]*\)", text)))
    assert seen["h200"][0] == seen["h200"][1]
    assert seen["h200"][0][0] == 128 and seen["delta-a40"][0][0] == 64
    assert seen["h200"][0][1] != seen["delta-a40"][0][1]
