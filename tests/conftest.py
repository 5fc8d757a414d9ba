"""Test configuration: float64 available everywhere (float64 references), eight host CPU
devices (a mesh to split over), XLA's backend at -O0 (compiling is most of the suite's time), hypothesis profiles, and a hermetic machine profile: an empty cache directory and no $MOAJAX_MACHINE, so a
developer's measured profile (``moajax measure``) never changes what the tests see and
``machines.local()`` is the generic CPU profile."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# the generated Triton source (pallas_kernels/triton_source.py) runs under Triton's interpreter
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
# eight host devices, for the mesh tests (tests/test_sharding.py); one-device code runs on the first
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# LLVM at -O0 behind XLA's CPU backend: the suite compiles thousands of small programs and runs
# each once or twice, so compiling is most of its time; -O0 took 11 % off a sample of it on 2 cores
# (bench/results/test_suite_cpu_epyc_avx2.md).
# What the tests check is the HLO moajax emits and its values: the same HLO passes run, and
# float64 results move by an FMA's rounding at most (~1e-16: the tolerances hold 1e-12).
# Timings belong to scripts/ (default flags); a developer can set the level in XLA_FLAGS.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"


def _xla_accepts(flag: str) -> bool:
    """Does this jaxlib's XLA take ``flag``? XLA aborts the process on an unknown flag in
    XLA_FLAGS, and a newer jaxlib (a GPU machine's) may have dropped one. Asked of a child
    process, since the flag's name can outlive the flag in the shared library (jaxlib 0.11.2
    still holds "xla_cpu_use_fusion_emitters" and aborts on it). The answer is kept in the
    environment, which pytest-xdist's workers inherit, so they do not ask again."""
    import subprocess
    import sys

    known = os.environ.get("MOAJAX_TEST_XLA_ACCEPTS", "")
    if known:
        return known == "1"
    env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
    try:
        ok = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                            capture_output=True, timeout=300).returncode == 0
    except subprocess.TimeoutExpired:  # no answer: leave the flag out
        ok = False
    os.environ["MOAJAX_TEST_XLA_ACCEPTS"] = "1" if ok else "0"
    return ok


# XLA:CPU's elemental emitters instead of its MLIR fusion emitters: the same HLO passes and
# fusions, emitted to LLVM IR directly. XLA's compile time fell by about a third on a sample
# and an alternated subset of the suite ran 7 % faster (bench/results/test_suite_cpu_epyc_avx2.md). What the tests
# check is unchanged: the HLO moajax emits, and values within their tolerances (the whole suite
# passes either way). Only this conftest sets it; a developer's XLA_FLAGS can override it.
if "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"] and _xla_accepts("--xla_cpu_use_fusion_emitters=false"):
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
os.environ["MOAJAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="moajax-test-cache-")
atexit.register(shutil.rmtree, os.environ["MOAJAX_CACHE_DIR"], ignore_errors=True)
os.environ.pop("MOAJAX_MACHINE", None)

import gc  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

jax.config.update("jax_enable_x64", True)

settings.register_profile(
    "default",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("ci", parent=settings.get_profile("default"), derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def _rss_mib() -> int:
    """This process's resident memory (Linux; 0 elsewhere, where nothing is released)."""
    try:
        with open("/proc/self/status") as f:
            return int(f.read().split("VmRSS:")[1].split()[0]) // 1024
    except (OSError, IndexError, ValueError):
        return 0


_released_at = [_rss_mib()]
RELEASE_AFTER_MIB = 1024


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After a module that grew this worker's memory by over ``RELEASE_AFTER_MIB`` since the
    last release, drop JAX's compiled programs (``jax.clear_caches``). A worker otherwise keeps
    every program the suite compiles, over 5 GB each of two workers by the end of a run
    (bench/results/test_suite_cpu_epyc_avx2.md), where a CI machine may have less; LLVM
    failing to allocate has aborted fuzz processes here, and one clean run lost a worker to
    an abort inside XLA's compile (no message: the cause not shown). Past the threshold, not
    after every module: a module reuses the kernels of the ones before it, which a release
    compiles again."""
    yield
    if _rss_mib() - _released_at[0] > RELEASE_AFTER_MIB:
        jax.clear_caches()
        gc.collect()
        _released_at[0] = _rss_mib()
