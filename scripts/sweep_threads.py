#!/usr/bin/env python3
"""The seed's second result as an experiment: topology. Decode on Delta ran 535× slower at 128
threads than at 64 for n = 1024 (95× at 32768), and the best thread count depended on n.

Times the attention forward and one decode step against XLA's CPU thread count (1 … 2× the
cores: oversubscription) and the number of processes sharing the machine (each with that many
threads; throughput = processes × work ÷ time), at several n, every size in one process after
a warm-up. XLA reads its thread count when it starts, so each setting is a child process.
It prints, per kernel and n, the best setting, and writes the recommendation and the NUMA
domains (from ``lscpu``) into this machine's measured profile (``moajax measure`` writes it).

    python scripts/sweep_threads.py                       # bench/results/threads_cpu.md
    python scripts/sweep_threads.py --max_threads=128 --processes=1,2,4   # a Delta node
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parent.parent
OUT = flags.DEFINE_string("out", str(ROOT / "bench" / "results" / "threads_cpu.md"), "the results file")
MAX_THREADS = flags.DEFINE_integer("max_threads", 0, "the most threads per process (0: 2× the cores)")
PROCESSES = flags.DEFINE_list("processes", ["1", "2"], "process counts to run side by side")
ATTENTION_N = flags.DEFINE_list("attention_n", ["256", "1024", "4096"], "attention sequence lengths")
DECODE_N = flags.DEFINE_list("decode_n", ["1024", "32768", "1048576"], "decode cache lengths")
REPS = flags.DEFINE_integer("reps", 5, "timed runs per size (median)")
CHILD = flags.DEFINE_bool("child", False, "internal: time every size in this process and print JSON")
UPDATE_PROFILE = flags.DEFINE_bool("update_profile", True, "write the recommendation into the measured profile")


def _child():
    """Time each kernel and size in this process (threads fixed by XLA_FLAGS) and print JSON."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import moajax
    from moajax.timing import median_seconds

    r = np.random.default_rng(0)
    out = {}
    attn = jax.jit(lambda q, k, v: moajax.dot_product_attention(q, k, v))
    for n in map(int, ATTENTION_N.value):
        q, k, v = (jnp.asarray(r.standard_normal((2, n, 1, 64)), jnp.float32) for _ in range(3))
        out[f"attention {n}"] = median_seconds(attn, q, k, v, reps=REPS.value)
    dec = jax.jit(lambda q, k, v: moajax.decode_attention(q, k, v))
    for n in map(int, DECODE_N.value):
        q = jnp.asarray(r.standard_normal((1, 1, 64)), jnp.float32)
        k, v = (jnp.asarray(r.standard_normal((1, n, 1, 64)), jnp.float32) for _ in range(2))
        out[f"decode {n}"] = median_seconds(dec, q, k, v, reps=REPS.value)
    print("RESULT " + json.dumps(out))


def _numa_from_lscpu() -> int | None:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    for line in text.splitlines():
        if line.startswith("NUMA node(s):"):
            return int(line.split(":")[1])
    return None


def _run(threads: int, processes: int) -> dict:
    """``processes`` children side by side, each with ``threads`` XLA threads: each one's times."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_cpu_multi_thread_eigen={'true' if threads > 1 else 'false'} "
                         f"intra_op_parallelism_threads={threads}")
    args = [sys.executable, __file__, "--child", f"--attention_n={','.join(ATTENTION_N.value)}",
            f"--decode_n={','.join(DECODE_N.value)}", f"--reps={REPS.value}"]
    procs = [subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for _ in range(processes)]
    results = []
    for p in procs:
        out, _ = p.communicate()
        line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise RuntimeError(f"sweep_threads: a child ({threads} threads) gave no result")
        results.append(json.loads(line[len("RESULT "):]))
    return {key: [r[key] for r in results] for key in results[0]}


def main(argv):
    del argv
    if CHILD.value:
        _child()
        return
    from moajax import machines
    from moajax.timing import machine_line, write_results

    cores = os.cpu_count() or 1
    top = MAX_THREADS.value or 2 * cores
    threads = sorted({t for t in (1, 2, 4, 8, 16, 32, 64, 128, cores, top) if t <= top})
    settings = [(t, int(p)) for p in PROCESSES.value for t in threads]
    table = {}
    for t, p in settings:
        print(f"sweep_threads: {t} threads × {p} process(es)", flush=True)
        table[(t, p)] = _run(t, p)
    keys = list(table[settings[0]])
    numa = _numa_from_lscpu()
    lines = ["# Topology: time against XLA's CPU thread count and processes side by side", "", machine_line(),
             f"Cores: {cores}; NUMA domains (lscpu): {numa if numa is not None else 'unknown'}. Run: "
             "`python scripts/sweep_threads.py` — each setting a fresh process (XLA fixes its threads at start), "
             f"every size in it after a warm-up, median of {REPS.value}; with P processes side by side the time is "
             "their slowest, and the throughput P × work ÷ that time. Attention: B = 2, one head, d = 64, float32; "
             "decode: one head, d = 64, float32.", "",
             "| kernel n | " + " | ".join(f"{t}×{p}" for t, p in settings) + " | best throughput | slowest ÷ best time |",
             "|---|" + "---:|" * len(settings) + "---|---:|"]
    best = {}
    for key in keys:
        times = {s: max(table[s][key]) for s in settings}
        rate = {s: s[1] / times[s] for s in settings}
        top_s = max(settings, key=lambda s: rate[s])
        best[key] = top_s
        one = min(times[s] for s in settings if s[1] == 1)
        worst = max(times[s] for s in settings if s[1] == 1)
        lines.append(f"| {key} | " + " | ".join(f"{1e3 * times[s]:.3g}" for s in settings)
                     + f" | {top_s[0]} threads × {top_s[1]} | {worst / one:.2f}× |")
    lines += ["", "Times in ms (threads × processes). Best throughput: the setting that does the most work per "
              "second; slowest ÷ best time: one process, the worst thread count against the best.", ""]
    by_kernel: dict = {}
    for key, (t, p) in best.items():
        by_kernel.setdefault(key.split()[0], []).append(f"n = {key.split()[1]}: {t} threads × {p}")
    lines += [f"- {k}: " + "; ".join(v) for k, v in by_kernel.items()]
    write_results(OUT.value, lines + [""])
    if UPDATE_PROFILE.value:
        path = machines.cache_dir() / "local.toml"
        if path.is_file():
            text = path.read_text()
            rec = "\n".join(f'"{k}" = "{t}x{p}"' for k, (t, p) in best.items())
            head = text.split("\n[threads_recommended]")[0].rstrip("\n")
            path.write_text(head + f"\n\n[threads_recommended]\n# from scripts/sweep_threads.py: threads x processes "
                                   f"with the best throughput; NUMA domains (lscpu) {numa}\n{rec}\n")
            print(f"sweep_threads: wrote the recommendation into {path}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    app.run(main)
