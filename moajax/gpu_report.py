"""The offline GPU report's matrix: every configured GPU × kernel × dtype × size, each case
(label, machine, default ONF) for ``moajax gpu-report`` to compile (``moajax.ptx``).

By default the ONFs are derived for each GPU profile with its spill check on (``gpus``): what
a GPU with the CUDA toolchain derives and runs (``schedule.derive``: the first table tiling that
fits and that ptxas compiles without spilling). ``targets``: other profiles (those of
``machines.load``, unchecked: the tables' own tilings).
"""

from __future__ import annotations


def gpus(archs=()) -> list:
    """The configured GPU profiles (those of ``archs`` if given), each with its spill check on
    (``Machine.spill_check``)."""
    import dataclasses

    from moajax import machines

    return [dataclasses.replace(m, spill_check=True) for m in machines.available().values()
            if m.is_gpu and (not archs or m.arch in archs)]


def _targets(targets) -> list:
    return gpus() if targets is None else targets


def wanted(only, label: str) -> bool:
    """Does the predicate ``only`` (None: every case) keep the case labelled ``label``?"""
    return only is None or bool(only(label))


def _cases(label: str, dnf_for, head_dims, dtypes, size=lambda h: f"H={h}", targets=None, only=None) -> list:
    """(label, machine, default ONF — or the ONFError saying why none fits) for every
    configured GPU × dtype × head dim (or other size: ``size`` names it in the label); where
    ``only`` (a predicate on the label) says no, no row and nothing derived."""
    import numpy as np

    from moajax import schedule
    from moajax.onf import ONFError

    out = []
    for m in _targets(targets):
        for dt in dtypes:
            for h in head_dims:
                name = f"{label} {dt} {size(h)}"
                if not wanted(only, name):
                    continue
                try:
                    onf = schedule.derive(dnf_for(np.dtype(dt), h), m)
                except ONFError as e:  # no default fits this GPU: a finding, reported as such
                    onf = e
                out.append((name, m, onf))
    return out


def default_cases(head_dims=(64, 72, 128), dtypes=("float16", "bfloat16", "float32", "float64"), targets=None,
                  only=None):
    """The attention forward (jax.nn layout, B=1, T=S=1024, N=8). ``only``: a predicate on a
    case's label (before its kernels' names); the cases it refuses are neither built nor
    derived — so for every family here."""
    from moajax.kernels.attention import mha_dnf

    return _cases("mha", lambda dt, h: mha_dnf((1, 1024, 8, h), (1, 1024, 8, h), (1, 1024, 8, h), dt),
                  head_dims, dtypes, targets=targets, only=only)


def backward_cases(head_dims=(64, 128), dtypes=("bfloat16", "float32", "float64"), targets=None, only=None):
    """The fused forward+backward (one head, T=S=1024): its default ONF scatter-adds dK, dV."""
    import jax

    from moajax.kernels import attention_forward_backward

    return _cases("fwd+bwd", lambda dt, h: attention_forward_backward.dnf(
        *[jax.ShapeDtypeStruct((1024, h), dt) for _ in range(4)]), head_dims, dtypes, targets=targets, only=only)


def model_cases(dtypes=("bfloat16", "float32"), targets=None, only=None):
    """Kernels other than plain attention at realistic sizes: RMSNorm fused into a matmul and
    the SwiGLU MLP at n=4096, d=1024, f=4096; RMSNorm alone over Llama's widths (d = 4096 and
    8192: rows held whole, fewer than 16 a program); a row log-sum-exp over 4096 × 32768; decode of one
    query over a 32768-key cache (split-K: one program would walk it all); attention
    (jax.nn layout, B=1, T=S=1024, N=8, H=64) with a full [B N T S] bias, whose rows × keys
    tiles read 2-D blocks of the bias."""
    import jax

    from moajax.kernels import decode, logsumexp, rmsnorm, rmsnorm_matmul, swiglu
    from moajax.kernels.attention import mha_dnf

    S = jax.ShapeDtypeStruct
    n, d, f = 4096, 1024, 4096
    mlp = "n=4096 d=1024 f=4096"
    return (
        _cases("rmsnorm→matmul", lambda dt, _: rmsnorm_matmul.dnf(S((n, d), dt), S((d,), dt), S((d, f), dt)),
               (mlp,), dtypes, size=str, targets=targets, only=only)
        + _cases("rmsnorm", lambda dt, d: rmsnorm.dnf(S((n, d), dt), S((d,), dt)), (4096, 8192), dtypes,
                 size=lambda d: f"n={n} d={d}", targets=targets, only=only)
        + _cases("swiglu", lambda dt, _: swiglu.dnf(S((n, d), dt), S((d, f), dt), S((d, f), dt), S((f, d), dt)),
                 (mlp,), dtypes, size=str, targets=targets, only=only)
        + _cases("logsumexp", lambda dt, _: logsumexp.dnf(S((4096, 32768), dt)), ("4096×32768",), dtypes,
                 size=str, targets=targets, only=only)
        + _cases("decode", lambda dt, _: decode.dnf(S((128,), dt), S((32768, 128), dt), S((32768, 128), dt)),
                 ("s=32768 H=128",), dtypes, size=str, targets=targets, only=only)
        + _cases("mha+bias[B N T S]", lambda dt, h: mha_dnf((1, 1024, 8, h), (1, 1024, 8, h), (1, 1024, 8, h), dt,
                                                            bias_shape=(1, 8, 1024, 1024), bias_dtype=dt),
                 (64,), dtypes, targets=targets, only=only)
    )


def model_training_cases(dtypes=("bfloat16", "float32"), targets=None, only=None):
    """What ``jax.grad`` of ``rms_norm`` and ``gated_mlp`` runs on a GPU at the seed's block
    (n = 1024 tokens, d = 64, d_ff = 256) and at realistic sizes (RMSNorm at n = d = 4096, its
    adjoint recomputing r and reading it saved, which the residual policy "auto" picks on a
    GPU there; ``gated_mlp`` at n = 4096, d = 1024, d_ff = 4096, whose owner plan stages U, V,
    G_H): each kernel of the adjoint's plan its own row (the staged first kernel, the weight
    gradients' split-K parts and their combine). ``only`` as for ``default_cases``."""
    import jax
    import numpy as np

    from moajax.kernels.mlp import swiglu
    from moajax.kernels.norm import rmsnorm

    out = []
    for dt in dtypes:
        S = lambda *s: jax.ShapeDtypeStruct(s, np.dtype(dt))  # noqa: E731
        cases = [("rmsnorm", rmsnorm, (1024, 64, None)), ("rmsnorm", rmsnorm, (4096, 4096, None)),
                 ("swiglu", swiglu, (1024, 64, 256)),
                 ("swiglu", swiglu, (4096, 1024, 4096))]
        for name, kern, (n, d, f) in cases:
            specs = [S(n, d), S(d)] if f is None else [S(n, d), S(d, f), S(d, f), S(f, d)]
            dnfs = [("adjoint", _once(lambda kern=kern, specs=specs, n=n, d=d, S=S:
                                      kern.adjoint(*specs).dnf(*specs, S(n, d))))]
            if name == "rmsnorm" and n == 4096:
                dnfs.append(("adjoint reading r", _once(lambda kern=kern, specs=specs: _saved_adjoint_dnf(kern, specs))))
            for what, dnf in dnfs:
                for m in _targets(targets):
                    out += _plan_rows(f"grad {name} {what} {dt} n={n} d={d}" + (f" f={f}" if f else ""), dnf, m,
                                      only)
    return out


def _once(build):
    """``build`` called at most once, when first asked: a case's DNF is built only where a row
    of it is wanted (``only``)."""
    import functools

    return functools.cache(build)


def _saved_adjoint_dnf(kern, specs, **kw):
    """The DNF of ``kern``'s adjoint that reads the saved statistics and outputs (what
    ``jax.grad`` runs where saving pays), for the primals ``specs``."""
    adj, args = kern.saved_adjoint(*specs, **kw)
    return adj.dnf(*args, **kw)


def _plan_rows(label: str, dnf_for, machine, only=None) -> list:
    """(label, machine, ONF) per kernel of the default plan for ``machine`` of the DNF that
    ``dnf_for()`` builds (each named by its outputs), or one row with the ONFError saying why no
    plan fits; no row, and nothing built or derived, where ``only`` (a predicate on ``label``)
    says no."""
    from moajax import schedule
    from moajax.onf import ONFError

    if not wanted(only, label):
        return []
    dnf = dnf_for()
    try:
        plan = schedule.derive_plan(dnf, machine)
    except ONFError as e:
        return [(label, machine, e)]
    return [(f"{label} {onf.dnf.name[len(dnf.name) + 1:] if isinstance(plan, tuple) else ''}".rstrip(), machine, onf)
            for onf in (plan if isinstance(plan, tuple) else (plan,))]


def training_cases(dtypes=("bfloat16", "float32"), targets=None, only=None):
    """What ``jax.grad`` of ``dot_product_attention`` runs on a GPU (jax.nn layout, B=1,
    T=S=1024, N=8, H=64; multi-head K=8, GQA K=2, and causal multi-head, whose loops skip the
    masked tiles: their bounds are computed in the kernel; and causal multi-head beside a bool
    [t s] mask, a mask on data, whose skips the rows' statistics guard, ``onf.RowGuard``): the
    saving forward (Out with its row max and sum) and the derived adjoint's plan (one fused
    ONF, or one per output), each ONF its own row. ``only`` as for ``default_cases``."""
    import jax
    import numpy as np

    from moajax.kernels.attention import mha_kernel

    out = []
    for kv, causal, mask in ((8, False, False), (2, False, False), (8, True, False), (8, True, True)):
        kern = mha_kernel(None, "t s" if mask else None, kv != 8)
        for dt in dtypes:
            S = [jax.ShapeDtypeStruct((1, 1024, n, 64), np.dtype(dt)) for n in (8, kv, kv)]
            S += [jax.ShapeDtypeStruct((1024, 1024), np.bool_)] if mask else []
            parts = [("saving forward", _once(lambda kern=kern, S=S, causal=causal:
                                              kern.saving_forward(*S, is_causal=causal).dnf(*S, is_causal=causal))),
                     ("adjoint", _once(lambda kern=kern, S=S, causal=causal:
                                       _saved_adjoint_dnf(kern, S, is_causal=causal)))]
            name = f"{'GQA K=2' if kv != 8 else 'MHA'}{' causal' if causal else ''}{' mask' if mask else ''}"
            for m in _targets(targets):
                for what, dnf in parts:
                    out += _plan_rows(f"grad {name} {what} {dt} H=64", dnf, m, only)
    return out


def tangent_cases(dtypes=("bfloat16", "float32"), targets=None, only=None):
    """What ``jax.jvp`` runs on a GPU (jax.nn layout, B=1, T=S=1024, N=8, H=64, plain and
    causal): the tangent kernel of ``dot_product_attention`` (derived in the algebra,
    ``Kernel.tangent``), and that of the attention kernel with a differentiable lse
    (``mha_kernel(residual="live")``), which each block of the ring's forward mode runs
    (``moajax.ring``), each ONF its own row."""
    import jax

    from moajax.kernels.attention import mha_kernel

    def tangent_dnf(kern, causal):
        def dnf_for(dt, h):
            S = [jax.ShapeDtypeStruct((1, 1024, 8, h), dt)] * 3
            return kern.tangent(*S, is_causal=causal).dnf(*S, *S, is_causal=causal)
        return dnf_for

    out = []
    for what, residual in (("jvp MHA", False), ("ring jvp block (lse live)", "live")):
        kern = mha_kernel(None, None, False, False, False, None, residual)
        for causal in (False, True):
            for dt in dtypes:  # (dtype by dtype: each dtype's rows over the GPUs together)
                out += _cases(f"{what}{' causal' if causal else ''} tangent", tangent_dnf(kern, causal), (64,), (dt,),
                              targets=targets, only=only)
    return out


def score_mods() -> dict:
    """The report's score_mods by name: tanh soft-capping (arithmetic on the score), ALiBi (a
    per-head slope: a table read at the head index, 8 slopes), relative position (a 33-entry
    table read at a computed index, clip(q_idx − kv_idx) — a gather in the kernel), and ALiBi
    inside documents, masked FlexAttention's way (−∞ where the document ids of q_idx and
    kv_idx differ: the kernel's −∞ select, a mask on data, beside a learned table)."""
    import jax.numpy as jnp
    import numpy as np

    slopes = jnp.asarray(2.0 ** -np.arange(1, 9), jnp.float32)
    table = jnp.asarray(np.linspace(-1.0, 1.0, 33), jnp.float32)
    doc = jnp.asarray(np.repeat(np.arange(4), (100, 400, 300, 224)), jnp.int32)

    def alibi(s, h, qi, ki):
        return s + slopes[h] * (ki - qi).astype(s.dtype)

    return {"softcap": lambda s, b, h, qi, ki: 30.0 * jnp.tanh(s / 30.0),
            "alibi": lambda s, b, h, qi, ki: alibi(s, h, qi, ki),
            "relpos": lambda s, b, h, qi, ki: s + table[jnp.clip(qi - ki, -16, 16) + 16],
            "alibi_document": lambda s, b, h, qi, ki: jnp.where(doc[qi] == doc[ki], alibi(s, h, qi, ki), -jnp.inf)}


def score_mod_dnfs(fn, shape, dtype, is_causal: bool = True) -> tuple:
    """(forward DNF, the saved adjoint's DNF, the arrays ``fn`` closes over as
    ShapeDtypeStructs) of ``dot_product_attention`` with the score_mod ``fn`` (jax.nn layout,
    q, k and v of ``shape``), as ``jax.grad`` of the call derives them."""
    import jax
    import numpy as np

    from moajax.api import _check_score_mod
    from moajax.kernels.attention import mha_kernel

    S = [jax.ShapeDtypeStruct(shape, np.dtype(dtype))] * 3
    mod = _check_score_mod(fn, np.dtype(dtype))
    kern = mha_kernel(None, None, False, False, False, mod)
    consts = [jax.ShapeDtypeStruct(np.shape(c), np.asarray(c).dtype) for c in mod.consts]
    return (kern.dnf(*S, *consts, is_causal=is_causal), _saved_adjoint_dnf(kern, [*S, *consts], is_causal=is_causal),
            tuple(consts))


def score_mod_cases(dtypes=("float32",), targets=None, only=None):
    """``dot_product_attention`` with a ``score_mod`` (``score_mods``; jax.nn layout, B=1 —
    B=2 for the documents, whose table gradient then walks the batch: the loop whose
    accumulator ``rewrites.conditions_out`` keeps small —, T=S=1024, N=8, H=64, causal), its
    forward and the derived adjoint's plan. ``only`` as for ``default_cases``."""
    out = []
    for dt in dtypes:
        for name, fn in score_mods().items():
            b = 2 if name == "alibi_document" else 1
            dnfs = _once(lambda fn=fn, b=b, dt=dt: score_mod_dnfs(fn, (b, 1024, 8, 64), dt))
            for m in _targets(targets):
                for i, what in enumerate(("forward", "adjoint")):
                    label = f"score_mod {name} causal {what} {dt} H=64{' B=2' if b != 1 else ''}"
                    out += _plan_rows(label, lambda i=i, dnfs=dnfs: dnfs()[i], m, only)
    return out


def sweep_onf(kernel: str, dtype: str, h: int, rows: int, keys: int, warps: int, stages: int):
    """One row of the shared-memory calibration sweep (scripts/sweep_smem.py): the attention
    ``"forward"`` (jax.nn layout, B=1, T=S=1024, N=8) or the fused ``"fwd+bwd"`` (one head,
    T=S=1024) with the given tiling, scheduled for a GPU without a shared-memory limit so that
    tilings over every real limit are compiled too. ``dtype`` "float32" has IEEE float32 dots
    (the committed table's, whatever the matmul precision config), "float32 tf32" TF32 ones."""
    import dataclasses

    import jax
    import numpy as np

    from moajax import machines, schedule
    from moajax.kernels import attention_forward_backward
    from moajax.kernels.attention import mha_dnf
    from moajax.schedule import Preset

    precision = "tensorfloat32" if dtype.endswith(" tf32") else "highest"
    dtype = dtype.split()[0]
    if kernel == "forward":
        dnf = mha_dnf((1, 1024, 8, h), (1, 1024, 8, h), (1, 1024, 8, h), np.dtype(dtype))
    elif kernel == "fwd+bwd":
        dnf = attention_forward_backward.dnf(*[jax.ShapeDtypeStruct((1024, h), dtype) for _ in range(4)])
    else:
        raise ValueError(f"sweep_onf: kernel must be 'forward' or 'fwd+bwd', got {kernel!r}")
    unbounded = dataclasses.replace(machines.load("h200"), shared_memory_per_block=1 << 30)
    return schedule.derive(dnf, unbounded, Preset.of(tiles={"t": rows, "s": keys}, num_warps=warps,
                                                     num_stages=stages, dot_precision=precision))
