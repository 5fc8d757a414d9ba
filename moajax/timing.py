"""Wall-clock timing of jitted calls, the one way every benchmark script measures.

The machine this runs on is shared and noisy: a call is warmed up (compiled and run once or
more), then timed ``reps`` times, and the median is reported."""

from __future__ import annotations

import statistics
import time


def median_seconds(fn, *args, reps: int, warmups: int = 1) -> float:
    """Median wall time of ``fn(*args)`` over ``reps`` runs after ``warmups`` untimed ones
    (each run waits for its results: ``jax.block_until_ready``)."""
    import jax

    for _ in range(warmups):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)
