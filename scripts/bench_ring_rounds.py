#!/usr/bin/env python3
"""What the ring's rounds cost to compile and to run: jit(grad) of causal attention split
along the sequence over 8 host devices (``Preset.of(ring=balance, ring_rounds=R)``), for each
balance and R: the time to trace and lower it, to compile it (which traces each device's
program: the split is a custom partitioning, ``moajax.shard``), the temp memory per device,
and (``--time``, at the last sequence length) the median run time, the rounds alternated in
one process.

The devices are XLA's host "devices" sharing this machine's cores (see bench_sharding.py).
Each row names the code it ran (``git describe``): run it on two commits, one after the
other, and ``--append`` the second run's rows to compare them.

    python scripts/bench_ring_rounds.py [--S 512,8192] [--rounds 1,2,4,8] [--time] [--append] [--out FILE]
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parent.parent
OUT = flags.DEFINE_string("out", str(ROOT / "bench" / "results" / "ring_rounds_cpu.md"), "the results file")
SEQ = flags.DEFINE_list("S", ["512", "8192"], "sequence lengths (B = 1, 8 heads of 64, float32); the last is timed")
ROUNDS = flags.DEFINE_list("rounds", ["1", "2", "4", "8"], "ring rounds R")
TIME = flags.DEFINE_bool("time", False, "also time each zigzag jit(grad), alternated (median of --reps)")
REPS = flags.DEFINE_integer("reps", 3, "timed runs per contender")
APPEND = flags.DEFINE_bool("append", False, "append this run's rows to --out instead of writing a new file")


def _code() -> str:
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv):
    del argv
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import moajax
    from moajax.timing import alternating, machine_line, write_results

    n, seqs = 8, [int(x) for x in SEQ.value]
    mesh = Mesh(np.array(jax.devices()[:n]), ("seq",))
    r = np.random.default_rng(0)

    def grad_of(balance: str, rounds: int):
        onf = moajax.Preset.of(ring=balance, ring_rounds=rounds)
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(
            moajax.dot_product_attention(q, k, v, is_causal=True, onf=onf) ** 2), argnums=(0, 1, 2)))

    code, rows, compiled = _code(), [], {}
    for S in seqs:
        args = [jax.device_put(jnp.asarray(r.standard_normal((1, S, 8, 64)).astype(np.float32)),
                               NamedSharding(mesh, P(None, "seq"))) for _ in range(3)]
        for balance in ("zigzag", "contiguous"):
            for rounds in map(int, ROUNDS.value):
                if S // n // (2 if balance == "zigzag" else 1) % rounds:
                    continue  # the chunk does not cut into R pieces
                fn = grad_of(balance, rounds)
                t = time.perf_counter()
                lowered = fn.lower(*args)
                t_lower = time.perf_counter() - t
                t = time.perf_counter()
                exe = lowered.compile()
                t_compile = time.perf_counter() - t
                compiled[S, balance, rounds] = exe
                rows.append([code, S, balance, rounds, f"{t_lower:.1f}", f"{t_compile:.1f}",
                             f"{exe.memory_analysis().temp_size_in_bytes / 2**20:.1f}", ""])
    if TIME.value:
        S = seqs[-1]
        fns = {rounds: (lambda e=compiled[S, "zigzag", rounds]: e(*args)) for rounds in map(int, ROUNDS.value)
               if (S, "zigzag", rounds) in compiled}
        times = alternating(fns, (), reps=REPS.value)
        for row in rows:
            if row[1] == S and row[2] == "zigzag":
                row[-1] = f"{np.median(times[row[3]]) * 1e3:.0f}"
    body = [f"| {' | '.join(map(str, row))} |" for row in rows]
    head = [f"# The ring's rounds: compile and run time of jit(grad), {n} host devices", "",
            machine_line(), "",
            f"`python scripts/bench_ring_rounds.py --S {','.join(SEQ.value)} --rounds {','.join(ROUNDS.value)}"
            f"{f' --time --reps {REPS.value}' if TIME.value else ''}` — "
            "causal attention, "
            "B = 1, 8 heads of 64, float32, the sequence split over 8 XLA host devices sharing this machine's "
            "cores. Lower: trace and lower the jitted function; compile: XLA's compile, which traces each "
            "device's program (the split is a custom partitioning); temp: per device; run: median of the zigzag "
            "rounds at the last S, alternated in one process (empty: not timed). Code: the commit each row ran.", "",
            "| code | S | balance | R | lower s | compile s | temp MiB | run ms |",
            "|---|---:|---|---:|---:|---:|---:|---:|"]
    if APPEND.value and Path(OUT.value).exists():
        text = Path(OUT.value).read_text().rstrip("\n").split("\n")
        write_results(OUT.value, text + body)
    else:
        write_results(OUT.value, head + body)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    app.run(main)
