#!/usr/bin/env python3
"""Spill bytes of a score_mod table's gradient over shapes, offline (PTX through ptxas, no
GPU): ALiBi's per-head slopes, alone and inside documents masked FlexAttention's way (−∞ where
the document ids of q_idx and kv_idx differ), causal, T = S = 1024, float32 (TF32 dots), for
B ∈ {2, 4}, N ∈ {8, 16}, H ∈ {64, 128}, MHA and GQA over 2 kv heads, on every GPU profile,
each derived as a GPU derives it (its spill check on: the first table tiling that compiles
clean, else the one that spills least). Per configuration: the spill bytes of each kernel of
the adjoint's default plan (dQ, dK with dV, the slopes' gradient; a kernel more where the
documents' gather is staged). ``--dtype bfloat16``: q, k, v and the slopes in bfloat16.

The table appends a section for the code it runs on (its git commit), so two runs — one on an
older checkout through PYTHONPATH — compare the same rows.

    python scripts/ptx_table_grad_sweep.py --append   # bench/results/table_grad_spills_ptx.md
    python scripts/ptx_table_grad_sweep.py --append --kind "ALiBi, the masked fill's kernel"
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # appended: a PYTHONPATH naming another checkout is measured instead

OUT = flags.DEFINE_string("out", str(ROOT / "bench" / "results" / "table_grad_spills_ptx.md"), "the results file")
APPEND = flags.DEFINE_bool("append", False, "add a section to the file instead of replacing it")
LABEL = flags.DEFINE_string("label", "", "a word on the code measured (the commit is found from the moajax imported)")
KINDS = ("ALiBi", "ALiBi in documents", "ALiBi, the masked fill's kernel")
KIND = flags.DEFINE_multi_enum("kind", list(KINDS[:2]), KINDS,
                               "the score_mods: the third is the kernel a call with the slopes as a jit argument "
                               "compiles beside ALiBi's, for a table that holds ±∞ (the select of −∞, a mask on data)")
DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                          "q, k, v and the slopes' dtype (bfloat16: 16-bit dots, the slopes' gradient recomputing Δ)")
BATCH = flags.DEFINE_list("batch", ["2", "4"], "B values")
HEADS = flags.DEFINE_list("heads", ["8", "16"], "N values")
HEAD_DIM = flags.DEFINE_list("head_dim", ["64", "128"], "H values")


def main(argv):
    del argv
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np

    import moajax
    from moajax import gpu_report, ptx, schedule
    from moajax.api import _check_score_mod
    from moajax.kernels.attention import mha_kernel
    from moajax.timing import machine_line

    ptx.offline_or_exit()
    src = Path(moajax.__file__).resolve().parents[1]
    commit = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()

    dt = jnp.dtype(DTYPE.value)

    def adjoint(fn, b, n, k, h, masked_fill=False):
        specs = [jax.ShapeDtypeStruct((b, 1024, n, h), dt)]
        specs += [jax.ShapeDtypeStruct((b, 1024, k, h), dt)] * 2
        mod = _check_score_mod(fn, dt)
        mod = mod.as_infinite() if masked_fill else mod
        kern = mha_kernel(None, None, k != n, False, False, mod)
        consts = [jax.ShapeDtypeStruct(np.shape(c), np.asarray(c).dtype) for c in mod.consts]
        adj, args = kern.saved_adjoint(*specs, *consts, is_causal=True)
        return adj.dnf(*args, is_causal=True)

    doc = jnp.asarray(np.repeat(np.arange(4), (100, 400, 300, 224)), jnp.int32)
    gpus = gpu_report.gpus()
    lines = [f"## At {commit}{' plus uncommitted changes' if dirty else ''}{f' ({LABEL.value})' if LABEL.value else ''}"
             f"{', ' + DTYPE.value if DTYPE.value != 'float32' else ''}",
             "", f"{machine_line().rstrip('.')}; ptxas {ptx.ptxas_version()}; no GPU used.", "",
             "| B | N | kv heads | H | score_mod | " + " | ".join(m.name for m in gpus) + " |",
             "|---:|---:|---:|---:|---|" + "---|" * len(gpus)]
    spilled = 0
    for b, n, h, gqa, kind in itertools.product(map(int, BATCH.value), map(int, HEADS.value), map(int, HEAD_DIM.value),
                                                (False, True), [x for x in KINDS if x in KIND.value]):
        k = 2 if gqa else n
        slopes = jnp.asarray(2.0 ** -np.arange(1, n + 1), dt)

        def alibi(s, hh, qi, ki, slopes=slopes):
            return s + slopes[hh] * (ki - qi).astype(s.dtype)

        fn = ((lambda s, bi, hh, qi, ki: alibi(s, hh, qi, ki)) if kind != "ALiBi in documents" else
              (lambda s, bi, hh, qi, ki: jnp.where(doc[qi] == doc[ki], alibi(s, hh, qi, ki), -jnp.inf)))
        dnf = adjoint(fn, b, n, k, h, masked_fill=kind == KINDS[2])
        cells = []
        for m in gpus:
            try:
                plan = schedule.derive_plan(dnf, m)
                per = [sum(r.spill_stores + r.spill_loads for r in ptx.onf_reports(o, m.arch)) for o in plan]
                spilled += any(per)
                cells.append(" / ".join(str(x) for x in per))
            except Exception as e:  # noqa: BLE001 - a configuration that does not derive is a finding
                cells.append(f"{type(e).__name__}: {str(e)[:80]}")
        lines.append(f"| {b} | {n} | {k} | {h} | {kind} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    pairs = (len(lines) - 6) * len(gpus)
    lines += ["", f"{spilled} of {pairs} (configuration, profile) pairs have a kernel that spills.", ""]
    path = Path(OUT.value)
    head = ["# A score_mod table's gradient: spill bytes over shapes, offline PTX", "",
            "`python scripts/ptx_table_grad_sweep.py` — " + " ".join((__doc__ or "").split("\n\n")[0].split()), "",
            "Cells: spill store + load bytes per kernel of the adjoint's plan, in launch order (dQ, dK with dV, the "
            "slopes' gradient).", ""]
    old = path.read_text() if APPEND.value and path.exists() else "\n".join(head) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(old + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    app.run(main)
