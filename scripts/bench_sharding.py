#!/usr/bin/env python3
"""Beyond one device, measured on host CPU devices: time and per-device memory against the
device count, for attention split by batch × heads, the block split by batch, and ring
attention (the sequence split) up to S = 32768.

The devices are XLA's host "devices" (``--xla_force_host_platform_device_count``): they share
this machine's cores, so time shows what splitting costs (collectives, smaller blocks), not a
speed-up; per-device temp memory (the compiled program's own ``memory_analysis``) is what a
device of a real mesh would hold. Every contender runs in one process, alternated.

    python scripts/bench_sharding.py          # writes bench/results/sharding_cpu.md
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parent.parent
OUT = flags.DEFINE_string("out", str(ROOT / "bench" / "results" / "sharding_cpu.md"), "the results file")
DEVICES = flags.DEFINE_list("devices", ["1", "2", "4", "8"], "device counts")
REPS = flags.DEFINE_integer("reps", 3, "timed runs per contender")
RING_TIME_S = flags.DEFINE_integer("ring_time_s", 4096, "sequence length of the timed ring rows")
RING_MEMORY_S = flags.DEFINE_list("ring_memory_s", ["8192", "32768"], "sequence lengths of the ring memory rows")
CPU = flags.DEFINE_bool("cpu", True, "eight host CPU devices; --nocpu: this node's GPUs (scripts/delta/node.sbatch)")


def _mesh(n: int, names, shape):
    import jax
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


def _put(x, mesh, *spec):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    return x if mesh is None else jax.device_put(x, NamedSharding(mesh, P(*spec)))


def _compiled(fn, *args):
    """(temp bytes, all-gathers, collective-permutes, arguments + outputs + temp bytes, less the
    outputs that alias arguments) of the compiled program, per device."""
    c = fn.lower(*args).compile()
    text = c.as_text()
    m = c.memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    return m.temp_size_in_bytes, text.count("all-gather("), text.count("collective-permute("), total


MEMORY_FIRST = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
RING_TEMP = flags.DEFINE_string("ring_temp", None, "internal: S,devices — print the ring jit(grad)'s temp bytes")


def _temp_memory_first(S: int, n: int, balance: str = "zigzag", rounds: int = 1) -> int:
    """The ring jit(grad)'s temp memory under XLA CPU's memory-minimising schedule, compiled
    in a child process (the schedule is a process-wide XLA flag; a per-compile option does not
    reach it). Its default schedule, for concurrency, starts whatever only the inputs
    determine at once — the backward's reorder of Q, K and V among it — and holds those
    buffers through the forward."""
    import subprocess

    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + MEMORY_FIRST).strip())
    out = subprocess.run([sys.executable, __file__, f"--ring_temp={S},{n},{balance},{rounds}"], env=env, check=True,
                         capture_output=True, text=True).stdout
    return int(out.strip().splitlines()[-1])


def main(argv):
    del argv
    if CPU.value:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import jax.numpy as jnp
    import numpy as np

    import moajax
    from moajax import cost
    from moajax.ring import Ring
    from moajax.timing import alternating, machine_line, write_results

    counts = [int(d) for d in DEVICES.value if int(d) <= (8 if CPU.value else jax.device_count())]
    if jax.device_count() < max(counts):
        raise SystemExit(f"needs {max(counts)} devices, have {jax.device_count()}")
    r = np.random.default_rng(0)
    a = lambda *s: jnp.asarray(r.standard_normal(s).astype(np.float32))  # noqa: E731
    where = (f"{jax.device_count()} XLA host devices sharing this machine's {os.cpu_count()} cores: time shows the "
             "cost of splitting, not a speed-up" if CPU.value else f"{jax.device_count()} × {jax.devices()[0].device_kind}")
    lines = [f"# Beyond one device ({machine_line()})", "",
             f"`python scripts/bench_sharding.py` — {where}. Temp: the compiled program's temp memory per device. "
             "Median of the alternated runs; float32.", ""]

    loss = lambda q, k, v: jnp.sum(moajax.dot_product_attention(q, k, v, is_causal=True) ** 2)  # noqa: E731
    contiguous = moajax.Preset.of(ring="contiguous")
    loss_contiguous = lambda q, k, v: jnp.sum(  # noqa: E731
        moajax.dot_product_attention(q, k, v, is_causal=True, onf=contiguous) ** 2)

    def ring_case(S, n):  # the ring's inputs: B = 1, 8 heads of 64, the sequence split n ways
        q, k, v = a(1, S, 8, 64), a(1, S, 8, 64), a(1, S, 8, 64)
        mesh = None if n == 1 else _mesh(n, ("seq",), (n,))
        return [_put(x, mesh, None, "seq") for x in (q, k, v)]

    rgrad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    rgrad_contiguous = jax.jit(jax.grad(loss_contiguous, argnums=(0, 1, 2)))

    def rgrad_of(balance: str, rounds: int):  # jit(grad) under Preset.of(ring=balance, ring_rounds=rounds)
        onf = moajax.Preset.of(ring=balance, ring_rounds=rounds)
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(moajax.dot_product_attention(q, k, v, is_causal=True, onf=onf)
                                                        ** 2), argnums=(0, 1, 2)))

    if RING_TEMP.value:  # the child of _temp_memory_first
        S, n, balance, rounds = RING_TEMP.value.split(",")
        fn = rgrad_of(balance, int(rounds)) if int(rounds) > 1 else rgrad_contiguous if balance == "contiguous" else rgrad
        print(_compiled(fn, *ring_case(int(S), int(n)))[0])
        return

    # ---- attention split by batch × heads
    B, T, N, H = 8, 1024, 8, 64
    q, k, v = a(B, T, N, H), a(B, T, N, H), a(B, T, N, H)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    layouts = {1: None, 2: ((2, 1), ("data", "model")), 4: ((2, 2), ("data", "model")), 8: ((2, 4), ("data", "model"))}
    fns, info = {}, {}
    for n in counts:
        mesh = None if layouts[n] is None else _mesh(n, layouts[n][1], layouts[n][0])
        args = [_put(x, mesh, "data", None, "model") for x in (q, k, v)]
        info[n] = _compiled(grad, *args)
        fns[n] = (lambda args=args: grad(*args))
    times = alternating(fns, (), reps=REPS.value)
    base = np.median(times[counts[0]])
    lines += [f"## Attention jit(grad), split by batch × heads (B = {B}, T = {T}, N = {N}, H = {H}, causal)", "",
              "| devices | mesh (data × model) | median | vs 1 device | temp per device | all-gathers |",
              "|---:|---|---:|---:|---:|---:|"]
    for n in counts:
        mesh = "—" if layouts[n] is None else " × ".join(map(str, layouts[n][0]))
        t = np.median(times[n])
        lines.append(f"| {n} | {mesh} | {t * 1e3:.1f} ms | {base / t:.2f}× | {info[n][0] / 2**20:.1f} MiB | {info[n][1]} |")
    lines.append("")

    # ---- the block split by batch
    B, T, D, N, H, F = 8, 512, 512, 8, 64, 1408
    p = dict(attn_norm=jnp.ones(D), wq=a(D, N, H) / D ** 0.5, wk=a(D, N, H) / D ** 0.5, wv=a(D, N, H) / D ** 0.5,
             wo=a(N, H, D) / D ** 0.5, mlp_norm=jnp.ones(D), w_gate=a(D, F) / D ** 0.5, w_up=a(D, F) / D ** 0.5,
             w_down=a(F, D) / F ** 0.5)
    x = a(B, T, D)
    bgrad = jax.jit(jax.grad(lambda p, x: jnp.mean(moajax.transformer_block(p, x, is_causal=True) ** 2)))
    fns, info = {}, {}
    for n in counts:
        mesh = None if n == 1 else _mesh(n, ("data",), (n,))
        args = (p if mesh is None else {k_: _put(w, mesh) for k_, w in p.items()}, _put(x, mesh, "data"))
        info[n] = _compiled(bgrad, *args)
        fns[n] = (lambda args=args: bgrad(*args))
    times = alternating(fns, (), reps=REPS.value)
    base = np.median(times[counts[0]])
    lines += [f"## Block jit(grad), split by batch (B = {B}, T = {T}, D = {D}, {N} × {H} heads, F = {F})", "",
              "| devices | median | vs 1 device | temp per device | all-gathers |", "|---:|---:|---:|---:|---:|"]
    for n in counts:
        t = np.median(times[n])
        lines.append(f"| {n} | {t * 1e3:.1f} ms | {base / t:.2f}× | {info[n][0] / 2**20:.1f} MiB | {info[n][1]} |")
    lines.append("")

    # ---- ring attention: the sequence split
    N, H = 8, 64
    S = RING_TIME_S.value
    fns, info = {}, {}
    for n in counts:
        args = ring_case(S, n)
        info[n] = _compiled(rgrad, *args)
        fns[n] = (lambda args=args: rgrad(*args))
    times = alternating(fns, (), reps=REPS.value)
    base = np.median(times[counts[0]])
    block = N * H * 4  # bytes of one token's K (or V, dK, dV) row
    lines += [f"## Ring attention jit(grad), the sequence split (B = 1, N = {N}, H = {H}, causal, zigzag)", "",
              "Sent: `cost.ring_bytes` (forward + backward, `residuals_in_ring_order=False`: under jit the saving "
              "forward and the adjoint are two partitioned kernels, so the backward reorders Q, K, V and Out again) "
              "of the busiest device. 1 device ÷ this: the one-device temp over this temp (the ideal is the device "
              "count). Memory-first: the same program under XLA CPU's memory-minimising schedule (its default "
              "schedule, for concurrency, starts the backward's reorder of Q, K, V at the program's start). S/P "
              "alone: one device's temp for S/P tokens, no ring. + ring blocks: that plus the 8 blocks of S/P "
              "tokens a ring device adds in this design (K, V, dK and dV travelling, and each one's incoming "
              "copy) — an estimate, not a bound: the memory-first schedule reuses some of the S/P-alone buffers "
              "and comes in under it. All memory: arguments + outputs + temp per device (Q, K, V in, dQ, dK, dV "
              "out: 6 blocks of S/P tokens), and the one-device figure over it.", "",
              "| S | devices | median | vs 1 device | temp per device | 1 device ÷ this | memory-first | "
              "1 device ÷ this | S/P alone | + ring blocks | all memory per device | 1 device ÷ this | "
              "sent per device | collective-permutes | all-gathers |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def sent(S, n):
        if n == 1:
            return 0
        ring, blk = Ring("seq", n, "zigzag"), (1, S // n, N, H)
        return (cost.ring_bytes(ring, blk, blk, blk, 4, residuals_in_ring_order=False)
                + cost.ring_bytes(ring, blk, blk, blk, 4, backward=True, residuals_in_ring_order=False))

    def alone(S, n):  # one device, S/n tokens
        return _compiled(rgrad, *ring_case(S // n, 1))[0]

    def row(S, n, t, mem, first, base, base_first):
        a = alone(S, n)
        ring_floor = a + (8 * (S // n) * block if n > 1 else 0)
        return (f"| {S} | {n} | {t} | {mem[0] / 2**20:.1f} MiB | {base[0] / max(mem[0], 1):.2f} | "
                f"{first / 2**20:.1f} MiB | {base_first / max(first, 1):.2f} | {a / 2**20:.1f} MiB | "
                f"{ring_floor / 2**20:.1f} MiB | {mem[3] / 2**20:.1f} MiB | {base[3] / max(mem[3], 1):.2f} | "
                f"{sent(S, n) / 2**20:.1f} MiB | {mem[2]} | {mem[1]} |")

    first = {n: _temp_memory_first(S, n) for n in counts}
    for n in counts:
        t = np.median(times[n])
        lines.append(row(S, n, f"{t * 1e3:.0f} ms | {base / t:.2f}×", info[n], first[n], info[counts[0]],
                         first[counts[0]]))
    for S in map(int, RING_MEMORY_S.value):
        mem = {n: _compiled(rgrad, *ring_case(S, n)) for n in counts}
        first = {n: _temp_memory_first(S, n) for n in counts}
        for n in counts:
            lines.append(row(S, n, "(compiled only) |", mem[n], first[n], mem[counts[0]], first[counts[0]]))
    lines.append("")

    # the forward alone (an inference call): no saved statistics, no backward
    fwd = jax.jit(lambda q, k, v: moajax.dot_product_attention(q, k, v, is_causal=True))
    S = max(map(int, RING_MEMORY_S.value))
    lines += [f"### The forward alone (jit, no grad), S = {S}", "",
              "Temp per device and one device's over it; S/P alone: one device's forward temp for S/P tokens, no "
              "ring (the most a ring could reach, before it holds any travelling block); all memory: arguments + "
              "outputs + temp; sent: `cost.ring_bytes` of the forward (Q, K, V reordered in, Out back, K and V "
              "P − 1 hops).", "",
              "| devices | temp per device | 1 device ÷ this | S/P alone | 1 device ÷ S/P alone | "
              "all memory per device | 1 device ÷ this | sent per device | collective-permutes | all-gathers |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    one = _compiled(fwd, *ring_case(S, 1))
    for n in counts:
        m = _compiled(fwd, *ring_case(S, n))
        solo = _compiled(fwd, *ring_case(S // n, 1))[0]
        blk = (1, S // n, N, H)
        sent_f = 0 if n == 1 else cost.ring_bytes(Ring("seq", n, "zigzag"), blk, blk, blk, 4)
        lines.append(f"| {n} | {m[0] / 2**20:.1f} MiB | {one[0] / max(m[0], 1):.2f} | {solo / 2**20:.1f} MiB | "
                     f"{one[0] / max(solo, 1):.2f} | {m[3] / 2**20:.1f} MiB | {one[3] / max(m[3], 1):.2f} | "
                     f"{sent_f / 2**20:.1f} MiB | {m[2]} | {m[1]} |")
    lines.append("")

    # the same jit(grad) with the ring's contiguous balance (Preset.of(ring="contiguous")): no
    # reorder of the blocks, the causal work uneven across the devices
    n = max(counts)
    if n > 1:
        lines += [f"### The contiguous balance (`Preset.of(ring=\"contiguous\")`), {n} devices", "",
                  "Sent: `cost.ring_bytes` with the contiguous ring. The zigzag columns repeat the rows above.", "",
                  "| S | zigzag temp | contiguous temp | zigzag memory-first | contiguous memory-first | zigzag sent | "
                  "contiguous sent | zigzag collective-permutes | contiguous collective-permutes |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for S in [RING_TIME_S.value] + list(map(int, RING_MEMORY_S.value)):
            z, c = _compiled(rgrad, *ring_case(S, n)), _compiled(rgrad_contiguous, *ring_case(S, n))
            zf, cf = _temp_memory_first(S, n), _temp_memory_first(S, n, "contiguous")
            ring, blk = Ring("seq", n, "contiguous"), (1, S // n, N, H)
            c_sent = (cost.ring_bytes(ring, blk, blk, blk, 4, residuals_in_ring_order=False)
                      + cost.ring_bytes(ring, blk, blk, blk, 4, backward=True, residuals_in_ring_order=False))
            lines.append(f"| {S} | {z[0] / 2**20:.1f} MiB | {c[0] / 2**20:.1f} MiB | {zf / 2**20:.1f} MiB | "
                         f"{cf / 2**20:.1f} MiB | {sent(S, n) / 2**20:.1f} MiB | {c_sent / 2**20:.1f} MiB | {z[2]} | "
                         f"{c[2]} |")
        lines.append("")

        # the ring in rounds (``Preset.of(ring_rounds=R)``): 1/R of each travelling block in flight
        S = max(map(int, RING_MEMORY_S.value))
        one, one_first = _compiled(rgrad, *ring_case(S, 1)), _temp_memory_first(S, 1)
        lines += [f"### The ring in rounds (`Preset.of(ring=…, ring_rounds=R)`), S = {S}, {n} devices", "",
                  "Each K and V block (and dK, dV) travels in R pieces of C/R keys, C the chunk (zigzag: "
                  "S/2P, contiguous: S/P): the same bytes in R times the sends. 1 device ÷ this: the one-device "
                  "temp (memory-first: its memory-first temp) over this. Piece: the keys of one piece, down to h; "
                  "a piece is one key tile of the block's adjoint, whose fused plan walks the query tiles once "
                  "(`lower_xla._one_pass`).", "",
                  "| balance | R | piece (keys) | temp per device | 1 device ÷ this | memory-first | "
                  "1 device ÷ this | all memory per device | 1 device ÷ this | sent per device | "
                  "collective-permutes | all-gathers |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for balance, chunk in (("zigzag", S // (2 * n)), ("contiguous", S // n)):
            for rounds in (1, 2, 4, 8, 16, 32, 64):
                if chunk // rounds < H:
                    continue
                m = _compiled(rgrad_of(balance, rounds), *ring_case(S, n))
                first = _temp_memory_first(S, n, balance, rounds)
                ring, blk = Ring("seq", n, balance, rounds), (1, S // n, N, H)
                sent_r = (cost.ring_bytes(ring, blk, blk, blk, 4, residuals_in_ring_order=False)
                          + cost.ring_bytes(ring, blk, blk, blk, 4, backward=True, residuals_in_ring_order=False))
                lines.append(f"| {balance} | {rounds} | {chunk // rounds} | {m[0] / 2**20:.1f} MiB | "
                             f"{one[0] / m[0]:.2f} | {first / 2**20:.1f} MiB | {one_first / first:.2f} | "
                             f"{m[3] / 2**20:.1f} MiB | {one[3] / m[3]:.2f} | {sent_r / 2**20:.1f} MiB | {m[2]} | "
                             f"{m[1]} |")
        lines.append("")

        # what the rounds cost in time: the contiguous ring at S = 8192 (pieces of 1024 to 128 keys)
        S = 2 * RING_TIME_S.value
        args = ring_case(S, n)
        fns = {r: rgrad_of("contiguous", r) for r in (1, 2, 4, 8)}
        info = {r: _compiled(f, *args) for r, f in fns.items()}
        times = alternating({r: (lambda f=f: f(*args)) for r, f in fns.items()}, (), reps=REPS.value)
        lines += [f"### Time of the rounds: the contiguous ring's jit(grad), S = {S}, {n} devices", "",
                  "Median of the alternated runs (the devices share this machine's cores: the cost of more, "
                  "smaller blocks and sends, not of the network).", "",
                  "| R | piece (keys) | median | vs R = 1 | temp per device |", "|---:|---:|---:|---:|---:|"]
        base = np.median(times[1])
        for r in fns:
            t = np.median(times[r])
            lines.append(f"| {r} | {S // n // r} | {t * 1e3:.0f} ms | {base / t:.2f}× | {info[r][0] / 2**20:.1f} MiB |")
        lines.append("")
    write_results(OUT.value, lines)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    app.run(main)
