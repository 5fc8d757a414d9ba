"""Offline PTX: the default ONFs of the configured GPUs compile with 0 spill bytes and fit
shared memory at head dims ≤ 128, for every dtype. Skips (with the reason) only where the
CUDA plugin or ptxas is truly unavailable."""

import numpy as np
import pytest

from moajax import compat, gpu_report, machines, schedule
from moajax.cost import onchip_bytes
from moajax.kernels.attention import mha_dnf

REASON = gpu_report.compiler_available() or (None if gpu_report.ptxas_path() else "ptxas not found")
needs_compiler = pytest.mark.skipif(REASON is not None, reason=f"offline GPU toolchain unavailable: {REASON}")

GPUS = [m for m in machines.available().values() if m.is_gpu]


@needs_compiler
@pytest.mark.parametrize("machine", GPUS, ids=lambda m: m.name)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("head_dim", [64, 72, 128])
def test_default_onf_compiles_without_spills(machine, dtype, head_dim):
    with compat.enable_x64_context(dtype == "float64"):
        dnf = mha_dnf((1, 1024, 8, head_dim), (1, 1024, 8, head_dim), (1, 1024, 8, head_dim), np.dtype(dtype))
        onf = schedule.derive(dnf, machine)
        r = gpu_report.onf_report(onf, machine.arch)
    assert r.spill_stores == 0 and r.spill_loads == 0, r
    assert r.smem_bytes <= machine.shared_memory_per_block, r
    assert 0 < r.registers <= 255
    assert r.atomics == 0  # the forward has no scatter: no atomics
    # the cost model's shared-memory estimate (used to reject ONFs) is conservative
    assert onchip_bytes(onf) >= r.smem_bytes, (onchip_bytes(onf), r.smem_bytes)


def test_atomic_count_parser():
    ptx = ("\tatom.global.add.f32 %f1, [%rd1], %f2;\n\t@%p1 red.global.add.f32 [%rd2], %f3;\n"
           "\tld.global.f32 %f4, [%rd3];\n"
           # Triton's inline asm: several instructions on one line
           "\tmov.u32 %r125, 0x0; @%p7 atom.global.gpu.acq_rel.add.f32 %r125, [ %rd59 + 0 ], %r126;\n"
           "\t// atom.global.add in a comment is not an instruction\n\tmov.u32 %red1, %r2;\n")
    assert gpu_report.count_atomics(ptx) == 3


@needs_compiler
@pytest.mark.parametrize("machine", GPUS, ids=lambda m: m.name)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_default_fused_backward_onf_compiles_with_atomics_and_no_spills(machine, dtype, head_dim):
    # the papers' fused forward+backward ONF as one kernel: a row-tile program writes its Out
    # and dQ tiles and scatter-adds (atom.global.add) its partial dK and dV
    import jax

    import pallas_kernels
    from moajax.kernels import attention_forward_backward

    args = [jax.ShapeDtypeStruct((1024, head_dim), np.dtype(dtype)) for _ in range(4)]
    onf = schedule.derive(attention_forward_backward.dnf(*args), machine)
    reports = [gpu_report.report(k, machine.arch) for k in gpu_report.triton_kernels(pallas_kernels.lower(onf), *args)]
    assert len(reports) == 1 and reports[0].atomics > 0, reports
    for r in reports:
        assert r.spill_stores == 0 and r.spill_loads == 0, r
        assert r.smem_bytes <= machine.shared_memory_per_block and onchip_bytes(onf) >= r.smem_bytes, r


@needs_compiler
def test_cli_gpu_report_smoke(capsys):
    from moajax.cli import main

    rc = main(["gpu-report", "--arch", "sm_86", "--head-dims", "64", "--dtypes", "bfloat16"])
    out = capsys.readouterr().out
    assert rc == 0 and "delta-a40" in out and "| yes |" in out


@needs_compiler
@pytest.mark.parametrize("machine", GPUS, ids=lambda m: m.name)
def test_model_kernels_at_realistic_sizes_fit_without_spills(machine):
    """RMSNorm→matmul and SwiGLU at n=4096, d=1024, f=4096, log-sum-exp over 4096 × 32768,
    decode over a 32768-key cache, attention with a [B N T S] bias: the general scheduler tiles every axis (2-D rows × keys
    tiles, the last output axis over the grid, nested reductions walked), 0 spill bytes."""
    cases = [c for c in gpu_report.model_cases(("float32",)) if c[1] == machine]
    assert len(cases) == 5
    for label, m, onf in cases:
        assert not isinstance(onf, Exception), (label, onf)
        if label.startswith("decode"):  # one query: the cache walk is split over the grid
            assert any(a.role == "grid" and a.extent > 1 for a in onf.axes), (label, onf.axes)
        else:  # rows × columns tiles, not one row per program
            assert max(a.tile for a in onf.axes if a.role == "grid") >= 16, (label, onf.axes)
        for r in gpu_report.onf_reports(onf, machine.arch):
            assert r.spill_stores == 0 and r.spill_loads == 0, (label, r)
            assert r.smem_bytes <= machine.shared_memory_per_block, (label, r)
            assert onchip_bytes(onf) >= r.smem_bytes, (label, onchip_bytes(onf), r.smem_bytes)


@needs_compiler
@pytest.mark.parametrize("machine", GPUS, ids=lambda m: m.name)
def test_gqa_training_kernels_compile_without_spills(machine):
    """jax.grad of GQA attention on a GPU: the saving forward (one kernel) and the adjoint's
    dQ, dK, dV kernels — the group's query heads walked one at a time inside dK and dV, Δ
    recomputed from dO and O in place — compile with 0 spill bytes."""
    cases = [c for c in gpu_report.training_cases(("bfloat16",)) if c[1] == machine and "GQA" in c[0]]
    assert [c[0].split("bfloat16 H=64")[-1].strip() for c in cases] == ["", "d_query", "d_key", "d_value"]
    for label, m, onf in cases:
        assert not isinstance(onf, Exception), (label, onf)
        reports = gpu_report.onf_reports(onf, machine.arch)
        assert len(reports) == 1, (label, reports)
        assert reports[0].spill_stores == 0 and reports[0].spill_loads == 0, (label, reports[0])


@needs_compiler
@pytest.mark.parametrize("machine", GPUS, ids=lambda m: m.name)
def test_causal_training_kernels_with_skipped_tiles_compile_without_spills(machine):
    """jax.grad of causal attention on a GPU: each kernel's loop runs between bounds computed
    in the kernel from its program id (the masked tiles skipped). Lowering to Triton IR is not
    enough — jnp's integer floor division and a min over a stack of scalars lowered, but did
    not compile — so each is compiled to PTX: 0 spill bytes, and every walk has its skip."""
    cases = [c for c in gpu_report.training_cases(("float32",)) if c[1] == machine and "causal" in c[0]]
    assert [c[0].split("float32 H=64")[-1].strip() for c in cases] == ["", "d_query", "d_key_d_value"]
    for label, m, onf in cases:
        assert not isinstance(onf, Exception), (label, onf)
        assert onf.skips, label
        reports = gpu_report.onf_reports(onf, machine.arch)
        assert all(r.spill_stores == 0 and r.spill_loads == 0 for r in reports), (label, reports)


@needs_compiler
def test_decode_with_lengths_compiles_split_without_spills():
    """decode_attention on the H200: one query row per head against 32768 keys with lengths —
    split-K parts, each walking between bounds from its own part index and length — compiles
    to PTX with 0 spill bytes."""
    import jax

    from moajax.kernels.attention import mha_kernel

    S = jax.ShapeDtypeStruct
    specs = [S((4, 1, 8, 128), np.float16), S((4, 32768, 2, 128), np.float16), S((4, 32768, 2, 128), np.float16),
             S((4,), np.int32)]
    h200 = machines.load("h200")
    onf = schedule.derive(mha_kernel(None, None, True, False, True).dnf(*specs), h200)
    assert onf.skips and any(h.startswith("split_k") for h in onf.history)
    for r in gpu_report.onf_reports(onf, h200.arch):
        assert r.spill_stores == 0 and r.spill_loads == 0, r


@needs_compiler
def test_the_seeds_block_gradients_compile_without_spills():
    """jax.grad of rms_norm and gated_mlp at the seed's block (n = 1024, d = 64, d_ff = 256) on
    the A100: the staged first kernel, the weight gradients' split-K parts and the combine that
    sums them — which held every part's [32 × 256] block at once and spilled 9.9 KB until it
    walked the parts one at a time (``Backend.walks_parts``)."""
    a100 = machines.load("delta-a100")
    cases = [c for c in gpu_report.model_training_cases(("float32",)) if c[1] == a100 and "n=1024 d=64" in c[0]]
    assert {c[0].split()[1] for c in cases} == {"rmsnorm", "swiglu"} and len(cases) >= 6
    for label, m, onf in cases:
        assert not isinstance(onf, Exception), (label, onf)
        for r in gpu_report.onf_reports(onf, m.arch):
            assert r.spill_stores == 0 and r.spill_loads == 0, (label, r)


@needs_compiler
def test_score_mod_table_reads_are_gathers_on_the_gpu():
    """A relative-position table read at a computed index (clip(q_idx − kv_idx)) is a gather
    load in the Pallas kernel, not a one-hot Σ over the table: the causal forward and the
    adjoint's dK-with-dV kernel (the owner plan's: P once per tile) compile for the A100 with
    0 spill bytes."""
    a100 = machines.load("delta-a100")
    cases = [c for c in gpu_report.score_mod_cases(("float32",)) if c[1] == a100 and "relpos" in c[0]]
    wanted = [c for c in cases if c[0].endswith(("forward float32 H=64", "d_key_d_value"))]
    assert len(wanted) == 2, [c[0] for c in cases]
    for label, m, onf in wanted:
        for r in gpu_report.onf_reports(onf, m.arch):
            assert r.spill_stores == 0 and r.spill_loads == 0, (label, r)


@needs_compiler
@pytest.mark.parametrize("machine", GPUS, ids=lambda m: m.name)
def test_score_mod_table_gradients_fill_the_gpu_without_spills(machine):
    """The gradient of a score_mod's table (ALiBi's 8 slopes, a 33-entry relative-position
    table), whose programs own table entries and walk every score: split-K cuts its heads and
    then its keys (``schedule._split_to_fill``, two cuts) until the programs fill the machine,
    and the nested walks' [s × t] score tile is at most the attention tables' keys wide — every
    kernel of it (the partials and the combines) compiles with 0 spill bytes, where one cut
    over the heads left 8 (or 16) programs and the 64 × 64 tiles before spilled (820 B on
    sm_90a for ALiBi in gpu_report.md at 2ccdd62; bench/results/score_mod_tiles_gpu.md
    sweeps the tiles now)."""
    cases = [c for c in gpu_report.score_mod_cases(("float32",)) if c[1] == machine and "d_score_mod_const" in c[0]]
    assert {c[0].split()[1] for c in cases} == {"alibi", "relpos"}
    for label, m, onf in cases:
        assert not isinstance(onf, Exception), (label, onf)
        cuts = [h for h in onf.history if h.startswith("split_k(")]
        assert len(cuts) == 2, (label, onf.history)
        programs = int(np.prod([a.ntiles for a in onf.axes if a.role == "grid"]))
        assert programs >= m.multiprocessors, (label, programs)
        for r in gpu_report.onf_reports(onf, m.arch):
            assert r.spill_stores == 0 and r.spill_loads == 0, (label, r)
