"""Measure the machine this runs on and write its profile (``moajax measure``).

Peak rates are measured, not quoted: for each of float64, float32 and bfloat16, the median
time (``moajax.timing.median_seconds``) of a jitted ``gemm_n``³ matmul (XLA's CPU GEMM),
counted as 2·n³ flops; float16 is not timed and gets bfloat16's rate. Bandwidth is the median
time of a jitted scale of a ``copy_mb`` MiB float32 array, counted as the bytes read plus the
bytes written. Topology is read, not timed (``machines.topology``), from the kernel: logical cores
(``os.cpu_count()``), NUMA domains (``/sys/devices/system/node``), the L2 and last-level cache
sizes of cpu0 (``/sys/devices/system/cpu/cpu0/cache``) and the CPU model (``/proc/cpuinfo``).

One schedule choice is timed, not derived: the CPU score tile (``Machine.cpu_score_tile_bytes``,
``tune_score_tile``): the attention forward at ``tune_seq`` under each of ``SCORE_TILE_BUDGETS``
beside the derived default, alternated; the profile pins the fastest only where it beats the
default by more than ``TUNE_MARGIN`` (else 0: derived).

The profile goes to ``machines.cache_dir() / "local.toml"``, where ``machines.local()`` finds
it; a profile is a property of one machine, so it is cached there and never committed.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from moajax.machines import Machine, topology

# Not measured: the cost model's per-kernel dispatch cost on a CPU, in microseconds.
CPU_LAUNCH_OVERHEAD_US = 2.0


# the CPU score-tile budgets ``tune_score_tile`` times, and how much faster than the derived
# default the best must be to be pinned (this shared 2-core host's alternated medians of one
# contender vary by a few per cent between rounds)
SCORE_TILE_BUDGETS = (1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20)
TUNE_MARGIN = 0.05


def tune_score_tile(machine: Machine, seq: int = 1024, budgets=SCORE_TILE_BUDGETS, reps: int = 5) -> tuple:
    """(the score-tile bytes to pin, 0 to keep the derived default; budget → median seconds, the
    default under key 0): ``moajax.dot_product_attention`` (B = 1, T = S = ``seq``, 8 heads of 64,
    float32, XLA) compiled under ``machine`` with each budget (``machines.using``) and as derived,
    the contenders alternated (``timing.alternating``)."""
    import statistics

    import jax
    import jax.numpy as jnp
    import numpy as np

    import moajax
    from moajax import machines
    from moajax.timing import alternating

    budgets = tuple(int(b) for b in budgets)
    if seq < 1 or reps < 1 or not budgets or min(budgets) < 1:
        raise ValueError(f"tune_score_tile: seq, reps and every budget must be positive, got seq={seq}, "
                         f"reps={reps}, budgets={list(budgets)}")
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, seq, 8, 64)), jnp.float32) for _ in range(3))
    fns = {}
    for b in (0,) + budgets:
        with machines.using(dataclasses.replace(machine, cpu_score_tile_bytes=b)):
            # a new function per budget, compiled inside the block (JAX caches traces by function)
            fns[b] = jax.jit(lambda q, k, v: moajax.dot_product_attention(q, k, v, implementation="xla")
                             ).lower(q, k, v).compile()
    times = {b: statistics.median(ts) for b, ts in alternating(fns, (q, k, v), reps=reps).items()}
    best = min(budgets, key=times.get)
    return (best if times[best] < (1 - TUNE_MARGIN) * times[0] else 0), times


def measure(gemm_n: int = 2048, copy_mb: int = 512, tune_seq: int = 1024) -> Machine:
    """Time this machine (see the module docstring) and return its profile, named "local";
    ``tune_seq`` 0 leaves the CPU score tile derived, untimed.

    float64 is switched on only around the float64 matmul (``enable_x64_context``), so the
    process's ``jax_enable_x64`` setting is left as it was."""
    if gemm_n < 1 or copy_mb < 1 or tune_seq < 0:
        raise ValueError(f"measure: gemm_n and copy_mb must be positive and tune_seq not negative, got "
                         f"gemm_n={gemm_n}, copy_mb={copy_mb}, tune_seq={tune_seq}")
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
    profile = Machine(
        name="local",
        kind="cpu",
        memory_bandwidth_gb_s=bandwidth,
        peak_tflops=peaks,
        description=f"{cpu_model}, {topo['cores']} cores (measured {today})",
        launch_overhead_us=CPU_LAUNCH_OVERHEAD_US,
        measured={"date": today, "gemm_n": gemm_n, "copy_mb": copy_mb},
        **topo,
    )
    if not tune_seq:
        return profile
    tile, times = tune_score_tile(profile, seq=tune_seq)
    said = ", ".join(("derived" if b == 0 else f"{b / 2**20:g} MiB") + f" {t * 1e3:.1f} ms" for b, t in times.items())
    return dataclasses.replace(profile, cpu_score_tile_bytes=tile, measured={
        **profile.measured, "tune_seq": tune_seq, "score_tile_ms": said})


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
        "# cpu_score_tile_bytes: the fastest CPU score tile of the attention forward (measured.score_tile_ms), "
        "pinned where it beat the derived one; 0 = derived.",
    ]
    for key in ("name", "description", "kind", "arch", "memory_bandwidth_gb_s", "cores", "numa_domains",
                "l2_cache_bytes", "llc_bytes", "launch_overhead_us", "cpu_score_tile_bytes"):
        lines.append(f"{key} = {_toml_value(getattr(machine, key))}")
    for table in ("peak_tflops", "measured"):
        lines += ["", f"[{table}]"] + [f"{k} = {_toml_value(v)}" for k, v in getattr(machine, table).items()]
    return "\n".join(lines) + "\n"
