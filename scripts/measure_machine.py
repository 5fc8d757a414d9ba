#!/usr/bin/env python3
"""Measure this machine and write its profile (configs/local.toml by default).

Peak rates are measured, not quoted: the median GF/s of a large jitted matmul per dtype
(XLA's CPU GEMM) and the bandwidth of a large copy (bytes read + written). Topology comes
from the kernel (sysfs). Run it on each machine you benchmark on.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
from pathlib import Path


def _sysfs_int(path, default=0):
    try:
        return int(Path(path).read_text().strip())
    except Exception:
        return default


def _cache_bytes(level: int) -> int:
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for idx in sorted(base.glob("index*")) if base.exists() else []:
        try:
            if int((idx / "level").read_text()) == level and (idx / "type").read_text().strip() in ("Unified", "Data"):
                s = (idx / "size").read_text().strip()
                mult = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(s[-1], 1)
                return int(s[:-1] if s[-1] in "KMG" else s) * mult
        except Exception:
            continue
    return 0


def _timed(fn, *args, reps=7):
    from moajax.timing import median_seconds

    return median_seconds(fn, *args, reps=reps)


def measure(gemm_n: int = 2048, copy_mb: int = 512):
    import jax
    import jax.numpy as jnp
    import numpy as np

    jax.config.update("jax_enable_x64", True)
    rng = np.random.default_rng(0)
    peaks = {}
    for dt in ("float64", "float32", "bfloat16"):
        a = jnp.asarray(rng.standard_normal((gemm_n, gemm_n)), dtype=dt)
        b = jnp.asarray(rng.standard_normal((gemm_n, gemm_n)), dtype=dt)
        t = _timed(jax.jit(jnp.dot), a, b)
        peaks[dt] = round(2 * gemm_n**3 / t / 1e12, 4)
    n = copy_mb * 1024 * 1024 // 4
    x = jnp.asarray(rng.standard_normal(n), jnp.float32)
    t = _timed(jax.jit(lambda x: x * 1.0001), x)
    bw = round(2 * 4 * n / t / 1e9, 2)
    return peaks, bw


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "configs" / "local.toml"))
    ap.add_argument("--name", default="local")
    args = ap.parse_args()
    peaks, bw = measure()
    cores = os.cpu_count() or 1
    numa = len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) or 1
    cpu_model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except Exception:
        pass
    today = datetime.date.today().isoformat()
    text = f"""# Measured by scripts/measure_machine.py on {today} ({cpu_model}, {cores} cores).
# Peak rates: median of a jitted {2048}^3 XLA matmul; bandwidth: a 512 MiB scale (read + write).
name = "{args.name}"
description = "{cpu_model}, {cores} cores (measured {today})"
kind = "cpu"
arch = "{platform.machine()}"
memory_bandwidth_gb_s = {bw}
cores = {cores}
numa_domains = {numa}
l2_cache_bytes = {_cache_bytes(2)}
llc_bytes = {_cache_bytes(3)}
launch_overhead_us = 2.0

[peak_tflops]
float64 = {peaks['float64']}
float32 = {peaks['float32']}
bfloat16 = {peaks['bfloat16']}
float16 = {peaks['bfloat16']}

[measured]
date = "{today}"
gemm_n = 2048
"""
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
