"""Measure the machine this runs on and write its profile (``moajax measure``).

Peak rates are measured, not quoted: for each of float64, float32 and bfloat16, the median
time (``moajax.timing.median_seconds``) of a jitted ``gemm_n``³ matmul (XLA's CPU GEMM),
counted as 2·n³ flops; float16 is not timed and gets bfloat16's rate. Bandwidth is the median
time of a jitted scale of a ``copy_mb`` MiB float32 array, counted as the bytes read plus the
bytes written. Topology is read, not timed (``machines.topology``), from the kernel: logical cores
(``os.cpu_count()``), NUMA domains (``/sys/devices/system/node``), the L2 and last-level cache
sizes of cpu0 (``/sys/devices/system/cpu/cpu0/cache``) and the CPU model (``/proc/cpuinfo``).

The profile goes to ``machines.cache_dir() / "local.toml"``, where ``machines.local()`` finds
it; a profile is a property of one machine, so it is cached there and never committed.
"""

from __future__ import annotations

import datetime
import json
from moajax.machines import Machine, topology

# Not measured: the cost model's per-kernel dispatch cost on a CPU, in microseconds.
CPU_LAUNCH_OVERHEAD_US = 2.0


def measure(gemm_n: int = 2048, copy_mb: int = 512) -> Machine:
    """Time this machine (see the module docstring) and return its profile, named "local".

    float64 is switched on only around the float64 matmul (``enable_x64_context``), so the
    process's ``jax_enable_x64`` setting is left as it was."""
    if gemm_n < 1 or copy_mb < 1:
        raise ValueError(f"measure: gemm_n and copy_mb must be positive, got gemm_n={gemm_n}, copy_mb={copy_mb}")
    import jax
    import jax.numpy as jnp
    import numpy as np

    from moajax.compat import enable_x64_context
    from moajax.timing import median_seconds

    rng = np.random.default_rng(0)

    def gemm_tflops(dtype) -> float:
        a = jnp.asarray(rng.standard_normal((gemm_n, gemm_n)), dtype=dtype)
        b = jnp.asarray(rng.standard_normal((gemm_n, gemm_n)), dtype=dtype)
        t = median_seconds(jax.jit(jnp.dot), a, b, reps=7)
        return round(2 * gemm_n**3 / t / 1e12, 4)

    with enable_x64_context():
        peaks = {"float64": gemm_tflops(jnp.float64)}
    peaks["float32"] = gemm_tflops(jnp.float32)
    peaks["bfloat16"] = gemm_tflops(jnp.bfloat16)
    peaks["float16"] = peaks["bfloat16"]

    n = copy_mb * 1024 * 1024 // 4
    x = jnp.asarray(rng.standard_normal(n), jnp.float32)
    t = median_seconds(jax.jit(lambda x: x * 1.0001), x, reps=7)
    bandwidth = round(2 * 4 * n / t / 1e9, 2)

    topo = topology()
    cpu_model = topo.pop("cpu_model")
    today = datetime.date.today().isoformat()
    return Machine(
        name="local",
        kind="cpu",
        memory_bandwidth_gb_s=bandwidth,
        peak_tflops=peaks,
        description=f"{cpu_model}, {topo['cores']} cores (measured {today})",
        launch_overhead_us=CPU_LAUNCH_OVERHEAD_US,
        measured={"date": today, "gemm_n": gemm_n, "copy_mb": copy_mb},
        **topo,
    )


def _toml_value(v) -> str:
    # JSON strings, ints and floats are valid TOML
    return json.dumps(v)


def to_toml(machine: Machine) -> str:
    """The profile file for a measured CPU ``machine`` (the keys ``machines`` reads back), with
    a header comment naming the date and how the rates were measured."""
    meas = machine.measured
    lines = [
        f"# Measured by `moajax measure` on {meas.get('date', 'an unknown date')} "
        f"({machine.arch}, {machine.cores} cores).",
        f"# Peak rates: median of a jitted {meas.get('gemm_n', '?')}^3 XLA matmul; "
        f"bandwidth: a {meas.get('copy_mb', '?')} MiB scale (read + write).",
    ]
    for key in ("name", "description", "kind", "arch", "memory_bandwidth_gb_s", "cores", "numa_domains",
                "l2_cache_bytes", "llc_bytes", "launch_overhead_us"):
        lines.append(f"{key} = {_toml_value(getattr(machine, key))}")
    for table in ("peak_tflops", "measured"):
        lines += ["", f"[{table}]"] + [f"{k} = {_toml_value(v)}" for k, v in getattr(machine, table).items()]
    return "\n".join(lines) + "\n"
