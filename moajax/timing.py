"""Wall-clock timing of jitted calls, the one way every benchmark script measures.

The machine this runs on is shared and noisy: a call is warmed up (compiled and run once or
more), then timed ``reps`` times, and the median is reported."""

from __future__ import annotations

import contextlib
import statistics
import time
from pathlib import Path


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
    """Wall times of several contenders, run in turn so that a change in the machine's speed
    hits them alike: name → the list of ``reps`` times, after ``warmups`` untimed runs of each.
    Each round starts one contender later (A B C, B C A, C A B, …): a run right after a
    contender that sweeps gigabytes (jax.nn's S × S scores) is measurably slower, and the
    rotation spreads that over all of them."""
    import jax

    for _ in range(warmups):
        for fn in fns.values():
            jax.block_until_ready(fn(*args))
    out = {name: [] for name in fns}
    names = list(fns)
    for i in range(reps):
        for name in names[i % len(names):] + names[:i % len(names)]:
            fn = fns[name]
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
            out[name].append(time.perf_counter() - t)
    return out


def compiled_contenders(fns: dict, args, *, reps: int, reference: str, pick) -> dict:
    """Compiled contenders (``jax.stages.Compiled``) run in turn (``alternating``): name →
    (times, temp MiB: the executable's temp allocation, max |pick(out) − pick(ref)| over
    max |pick(ref)|, ref the ``reference`` contender's result)."""
    import numpy as np

    want = np.asarray(pick(fns[reference](*args)), np.float64)
    diffs = {n: float(np.max(np.abs(np.asarray(pick(f(*args)), np.float64) - want)) / np.max(np.abs(want)))
             for n, f in fns.items()}
    times = alternating(fns, args, reps=reps)
    return {n: (times[n], f.memory_analysis().temp_size_in_bytes / 2**20, diffs[n]) for n, f in fns.items()}


@contextlib.contextmanager
def one_score_mod_kernel(masked: bool = False):
    """While tracing inside: a score_mod's tables known only as tracers get no run-time test
    (``ScalarFn.traced_tables``: a lax.cond between two kernels); its one kernel takes them
    finite, or with ``masked`` gives the masked fill (``trace.may_be_infinite`` taken True).
    What a benchmark times beside the default to show the test's cost."""
    from moajax import trace

    saved = trace.ScalarFn.traced_tables, trace.may_be_infinite
    trace.ScalarFn.traced_tables = property(lambda fn: [])
    if masked:
        trace.may_be_infinite = lambda closed: True
    try:
        yield
    finally:
        trace.ScalarFn.traced_tables, trace.may_be_infinite = saved


def machine_line() -> str:
    """The line every committed results file starts with: the machine (with its widest vector
    ISA, ``machines.vector_isa``), JAX, Python, the date."""
    import datetime
    import os
    import platform

    import jax

    from moajax.machines import cpu_model, vector_isa

    isa = vector_isa()
    return (f"Machine: {cpu_model()}{f' ({isa})' if isa else ''}, {os.cpu_count()} cores, {platform.system()} "
            f"{platform.machine()}; JAX {jax.__version__}, Python {platform.python_version()}; "
            f"date {datetime.date.today().isoformat()}.")



def table_lines(head: str, rows) -> list:
    """A markdown table: ``head`` ("| a | b |"), its rule, one line per row (cells by str)."""
    return [head, "|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|",
            *("| " + " | ".join(str(c) for c in r) + " |" for r in rows)]


def write_results(path, lines) -> str:
    """Write a results table (markdown lines) to ``path``, print it, return its text."""
    text = "\n".join(lines) + "\n"
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)
    print(text)
    return text
