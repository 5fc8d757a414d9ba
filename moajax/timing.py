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


def alternating(fns: dict, args, *, reps: int, warmups: int = 1) -> dict:
    """Wall times of several contenders, run in turn (A, B, C, A, B, C, …) so that a change in
    the machine's speed hits them alike: name → the list of ``reps`` times, after ``warmups``
    untimed runs of each."""
    import jax

    for _ in range(warmups):
        for fn in fns.values():
            jax.block_until_ready(fn(*args))
    out = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
            out[name].append(time.perf_counter() - t)
    return out
