#!/usr/bin/env python3
"""Several processes, one program: sharded attention and a transformer-block gradient step
across every device of every process, through ``jax.distributed``.

Each process builds the same global arrays (a fixed seed), the mesh spans all processes'
devices (data × model), and moajax's kernels run per device (``moajax.shard``): attention
with batch and heads split, attention with the sequence split (the ring, ``moajax.ring``),
and one SGD step of the block with the batch split. Process 0 gathers the results and
writes them (``--out``, .npz) for comparison with one process.

    # two processes on this machine (CPU collectives through gloo):
    python scripts/distributed_step.py --process_id 0 --num_processes 2 --coordinator localhost:12355 &
    python scripts/distributed_step.py --process_id 1 --num_processes 2 --coordinator localhost:12355
    # under SLURM (scripts/delta/*.sbatch): srun python scripts/distributed_step.py
    #   (jax.distributed.initialize() reads the cluster from SLURM's environment)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parent.parent
COORDINATOR = flags.DEFINE_string("coordinator", None, "host:port of process 0 (None: auto-detect, e.g. SLURM)")
NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "how many processes (None: auto-detect)")
PROCESS_ID = flags.DEFINE_integer("process_id", None, "this process' index (None: auto-detect)")
HOST_DEVICES = flags.DEFINE_integer("host_devices", 2, "CPU devices per process (only with --cpu)")
CPU = flags.DEFINE_bool("cpu", True, "run on the CPU (gloo collectives); --nocpu on GPU nodes")
X64 = flags.DEFINE_bool("x64", True, "float64 (the comparison is then exact to ~1e-13)")
OUT = flags.DEFINE_string("out", None, "process 0 writes the gathered results here (.npz)")
COMPARE = flags.DEFINE_string("compare", None, "no processes: compare this .npz with one process' results and exit")


def problem(dtype):
    """The global inputs, the same in every process: attention q, k, v and a block."""
    import numpy as np

    rng = np.random.default_rng(0)
    B, T, N, K, H, D, F = 4, 64, 4, 2, 8, 32, 48
    a = lambda *s: rng.standard_normal(s).astype(dtype)  # noqa: E731
    attn = dict(q=a(B, T, N, H), k=a(B, T, K, H), v=a(B, T, K, H))
    params = dict(attn_norm=1 + 0.1 * a(D), wq=a(D, N, H) / D ** 0.5, wk=a(D, K, H) / D ** 0.5,
                  wv=a(D, K, H) / D ** 0.5, wo=a(N, H, D) / (N * H) ** 0.5, mlp_norm=1 + 0.1 * a(D),
                  w_gate=a(D, F) / D ** 0.5, w_up=a(D, F) / D ** 0.5, w_down=a(F, D) / F ** 0.5)
    return attn, params, a(B, T, D)


def compute(attn, params, x, shard=None):
    """Attention (causal, GQA), its gradient, and one SGD step of the block: the values
    compared. ``shard(array, spec)`` places an input (None: one device)."""
    import jax
    import jax.numpy as jnp

    import moajax

    place = shard or (lambda arr, spec: jnp.asarray(arr))
    q, k, v = (place(attn[n], ("data", None, "model")) for n in "qkv")
    loss = lambda q, k, v: jnp.sum(jnp.sin(moajax.dot_product_attention(q, k, v, is_causal=True)))  # noqa: E731
    out = jax.jit(lambda q, k, v: moajax.dot_product_attention(q, k, v, is_causal=True))(q, k, v)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    qs, ks, vs = (place(attn[n], (None, "data")) for n in "qkv")  # the sequence split: the ring
    ring_out = jax.jit(lambda q, k, v: moajax.dot_product_attention(q, k, v, is_causal=True))(qs, ks, vs) \
        if shard is not None else out
    p = {n: place(w, ()) for n, w in params.items()}
    xs = place(x, ("data",))

    def block_loss(p, x):
        return jnp.mean(moajax.transformer_block(p, x, is_causal=True) ** 2)

    @jax.jit
    def sgd(p, x):
        value, g = jax.value_and_grad(block_loss)(p, x)
        return value, jax.tree.map(lambda w, d: w - 0.1 * d, p, g)

    value, new = sgd(p, xs)
    res = dict(out=out, dq=grads[0], dk=grads[1], dv=grads[2], ring_out=ring_out, block_loss=value)
    res.update({f"new_{n}": w for n, w in new.items()})
    return res


def compare(path: str) -> int:
    """Check a gathered .npz against this one process (float64 1e-12, float32 1e-5)."""
    import jax
    import numpy as np

    got = np.load(path)
    x64 = got["out"].dtype == np.float64
    jax.config.update("jax_enable_x64", x64)
    ref = compute(*problem(np.float64 if x64 else np.float32))
    tol, worst = (1e-12 if x64 else 1e-5), 0.0
    for name, value in ref.items():
        e = np.asarray(value, np.float64)
        err = float(np.max(np.abs(got[name] - e)) / max(float(np.max(np.abs(e))), 1e-300))
        worst = max(worst, err)
        print(f"{name:16s} rel err {err:.2e}")
    print(f"worst {worst:.2e} (tolerance {tol:.0e}): {'ok' if worst <= tol else 'FAILED'}")
    return 0 if worst <= tol else 1


def main(argv):
    del argv
    if COMPARE.value:
        sys.path.insert(0, str(ROOT))
        raise SystemExit(compare(COMPARE.value))
    if CPU.value:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={HOST_DEVICES.value}")
    import jax

    if CPU.value:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_enable_x64", X64.value)
    kw = {k: f.value for k, f in (("coordinator_address", COORDINATOR), ("num_processes", NUM_PROCESSES),
                                  ("process_id", PROCESS_ID)) if f.value is not None}
    jax.distributed.initialize(**kw)
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    sys.path.insert(0, str(ROOT))
    n = jax.device_count()
    mesh = Mesh(np.array(jax.devices()).reshape(n // 2, 2) if n % 2 == 0 else np.array(jax.devices())[:, None],
                ("data", "model"))

    def shard(arr, spec):
        sh = NamedSharding(mesh, P(*spec))
        return jax.make_array_from_callback(arr.shape, sh, lambda idx: arr[idx])

    attn, params, x = problem(np.float64 if X64.value else np.float32)
    res = compute(attn, params, x, shard)
    gathered = {k: np.asarray(multihost_utils.process_allgather(v, tiled=True)) for k, v in res.items()}
    print(f"process {jax.process_index()} of {jax.process_count()}: {n} devices, mesh {dict(mesh.shape)}, "
          f"block loss {float(gathered['block_loss']):.12g}", flush=True)
    if OUT.value and jax.process_index() == 0:
        np.savez(OUT.value, **gathered)
    jax.distributed.shutdown()


if __name__ == "__main__":
    app.run(main)
