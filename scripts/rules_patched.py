"""Rules of the derivation patched out, for benchmarks that time a rule against the tree
before it in one process: each a context manager inside which the rule does nothing, what was
derived, traced or lowered forgotten on entry and on exit (a call compiled inside keeps its
kernels). Shared by ``bench_lengths.py``, ``bench_score_mod.py``, ``gpu_check.py`` and
``ptx_saving_lengths.py``; ``forget``
also by ``bench_carried_cotangents.py`` and ``precision_tf32_table_grad.py``.
"""

from __future__ import annotations

import contextlib


def forget():
    """What was derived, traced or lowered in this process, forgotten: the next call derives
    afresh under whichever rule is in force (a call compiled before keeps its kernels) — every
    kernel's derived kernels and compiled functions, the attention kernels, the schedules and
    lowerings, JAX's caches."""
    import gc

    import jax

    from moajax import runtime, schedule
    from moajax.kernel import Kernel
    from moajax.kernels.attention import _mha_kernel

    for k in gc.get_objects():
        if isinstance(k, Kernel):
            k._derived.clear()
            k._compiled.clear()
    jax.clear_caches()
    for cached in (_mha_kernel, runtime.schedules, runtime._schedules, runtime.lowered):
        cached.cache_clear()
    schedule._DERIVED.clear()


@contextlib.contextmanager
def patched(module, name: str, value):
    """Inside: ``module.name`` is ``value``, and what was derived is forgotten on entry and on
    exit (``forget``)."""
    rule = getattr(module, name)
    setattr(module, name, value)
    forget()
    try:
        yield
    finally:
        setattr(module, name, rule)
        forget()


def dead_rows_walked():
    """Inside: the rule that leaves out rows nothing reads (``masked.dead_row_conditions``, 2026-12-06)
    finds none, so programs past a query length walk every key tile, as before it."""
    import importlib

    return patched(importlib.import_module("moajax.masked"), "dead_row_conditions", lambda onf, st: ())


def statistics_unguarded():
    """Inside: the saving forward's row statistics read their pass at every row, as derived
    (``identities.guard_statistics`` leaves them be: the tree before 2026-12-07), so it walks
    the key tiles of its rows past a query length."""
    from moajax import identities

    return patched(identities, "guard_statistics", lambda forward, guards: (forward, []))


def guarded_sums_apart():
    """Inside: two sums each under one guard stay two walks (``rewrites._one_guard_over_sums``
    finds none: the tree before 2026-12-07), so a per-head table's gradient (ALiBi's slopes,
    each term of dS under the head's one-hot write) walks the scores twice."""
    from moajax import rewrites

    return patched(rewrites, "_one_guard_over_sums", lambda x: None)


def row_walks_inside():
    """Inside: nested walks keep the order the adjoint wrote (``rewrites.row_walks_out`` does
    nothing: the tree before 2026-12-07), so the row statistics ALiBi's slopes' gradient reads
    without saved ones are recomputed in every key tile."""
    from moajax import rewrites

    return patched(rewrites, "row_walks_out", lambda onf, longer_than: onf)
