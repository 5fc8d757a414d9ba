"""What the precision scripts share: the H200's Pallas schedules run in interpret mode on the
CPU, against float64 references (``precision_table_grad.py``, ``precision_tf32_table_grad.py``)."""

from __future__ import annotations

import os


def relative_errors(got, want) -> list:
    """max |a − b| over max |b| per pair (b float64)."""
    import jax.numpy as jnp

    return [float(jnp.max(jnp.abs(a.astype(jnp.float64) - b)) / jnp.max(jnp.abs(b))) for a, b in zip(got, want)]


def on_the_h200s_schedule():
    """float64 on (the references), JAX on the CPU, and the H200's Pallas schedules for
    implementation="pallas_interpret" (run in interpret mode)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_enable_x64", True)
    from moajax import machines, runtime

    h200 = machines.load("h200")
    runtime.gpu_machine = lambda path="pallas": h200
    runtime.schedules.cache_clear()
