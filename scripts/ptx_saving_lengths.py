#!/usr/bin/env python3
"""The saving forward with query lengths on the GPU, offline (PTX through ptxas, no GPU): what
``jax.grad`` of attention with ``query_seq_lengths`` runs first, its row statistics written
(t < L) ? z : z̄, z̄ their closed form past the length (``identities.guard_statistics``,
2026-12-07), so that its programs past a query length walk no key tile, against the same
forward with the statistics as derived (the rule patched out: before it) — the default ONF of each profile (its spill check on,
as ``moajax gpu-report`` derives it): whether it records the dead rows, its tiles, and
ptxas' registers, spills and shared memory. B = 2, T = S = 1024, N = 8, H = 64; MHA and GQA
(2 kv heads), float32 and bfloat16, causal or not. Untimed.

    python scripts/ptx_saving_lengths.py      # bench/results/saving_lengths_ptx.md
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = flags.DEFINE_string("out", str(ROOT / "bench" / "results" / "saving_lengths_ptx.md"), "the results file")


def main(argv):
    del argv
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp

    from moajax import ptx, schedule
    from moajax.gpu_report import gpus
    from moajax.timing import table_lines, write_results

    from moajax.kernels.attention import mha_kernel

    from rules_patched import statistics_unguarded

    ptx.offline_or_exit()
    B, T, N, H = 2, 1024, 8, 64
    rows, worst = [], 0
    for kv in (N, 2):
        for dt in (jnp.float32, jnp.bfloat16):
            for causal in (False, True):
                q = jax.ShapeDtypeStruct((B, T, N, H), dt)
                k = jax.ShapeDtypeStruct((B, T, kv, H), dt)
                lengths = jax.ShapeDtypeStruct((B,), jnp.int32)
                for m in gpus():
                    cells = []
                    for guarded in (True, False):
                        with contextlib.nullcontext() if guarded else statistics_unguarded():
                            fw = mha_kernel(None, None, kv != N, True, False).saving_forward(
                                q, k, k, lengths, is_causal=causal)
                            onf = schedule.derive(fw.dnf(q, k, k, lengths, is_causal=causal), m)
                            rep = ptx.onf_report(onf, m.arch)
                        tiles = " × ".join(str(onf.axis(a).tile) for a in ("t", "s"))
                        cells += ["yes" if any(sk.dead for sk in onf.skips) else "no", tiles,
                                  onf.knobs.num_warps, rep.registers, rep.spill_stores + rep.spill_loads, rep.smem_bytes]
                    worst = max(worst, cells[4], cells[10])
                    rows.append(("MHA" if kv == N else "GQA (2 kv heads)", jnp.dtype(dt).name,
                                 "yes" if causal else "no", m.name, *cells))
    head = ("| heads | dtype | causal | machine | guarded: dead rows | tiles t × s | warps | registers | spill B | smem B "
            "| unguarded: dead rows | tiles t × s | warps | registers | spill B | smem B |")
    lines = [
        "# The saving forward with query lengths on the GPU, offline (PTX, ptxas; no GPU)",
        "",
        f"Date {datetime.date.today().isoformat()}; JAX {jax.__version__}; ptxas {ptx.ptxas_version()}. "
        "`python scripts/ptx_saving_lengths.py`: what `jax.grad` of attention with `query_seq_lengths` runs "
        f"first (B = {B}, T = S = {T}, N = {N}, H = {H}), the default ONF of each profile with its spill check "
        "on (as `moajax gpu-report`). 'guarded': its row statistics written (t < L) ? z : z̄, z̄ their "
        "closed form past the length (the fill, and S; `identities.guard_statistics`, 2026-12-07), so its "
        "programs past a query length walk no key tile ('dead rows': the ONF records them, `Skip.dead`); "
        "'unguarded': the rule patched out, the statistics as derived (before it). Spill B: stores and loads. Untimed: no GPU in this session.",
        "",
        *table_lines(head, rows),
        "",
        f"Largest spill over both forms: {worst} B.",
    ]
    write_results(OUT.value, lines)


if __name__ == "__main__":
    app.run(main)
