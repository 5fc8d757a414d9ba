"""Offline PTX: the default ONFs of the configured GPUs compile with 0 spill bytes and fit
shared memory at head dims ≤ 128, for every dtype. Skips (with the reason) only where the
CUDA plugin or ptxas is truly unavailable."""

import dataclasses
import re

import jax
import numpy as np
import pytest

from moajax import compat, cost, gpu_report, machines, ptx, schedule
from moajax.cost import onchip_bytes
from moajax.kernels.attention import mha_dnf
from moajax.onf import RowGuard

REASON = ptx.toolchain_missing()
needs_compiler = pytest.mark.skipif(REASON is not None, reason=f"offline GPU toolchain unavailable: {REASON}")

GPUS = [m for m in machines.available().values() if m.is_gpu]


@needs_compiler
@pytest.mark.parametrize("machine", GPUS, ids=lambda m: m.name)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float32 ieee", "float64"])
@pytest.mark.parametrize("head_dim", [64, 72, 128])
def test_default_onf_compiles_without_spills(machine, dtype, head_dim):
    # the tables' first fit, unchecked; float32 with TF32 dots (JAX's default matmul
    # precision) and with IEEE float32 ones (under "highest"), which share the table
    ieee = dtype.endswith(" ieee")
    dtype = dtype.split()[0]
    with compat.enable_x64_context(dtype == "float64"), jax.default_matmul_precision("highest" if ieee else None):
        dnf = mha_dnf((1, 1024, 8, head_dim), (1, 1024, 8, head_dim), (1, 1024, 8, head_dim), np.dtype(dtype))
        onf = schedule.derive(dnf, machine)
        r = ptx.onf_report(onf, machine.arch)
    assert onf.knobs.dot_precision == ("tensorfloat32" if dtype == "float32" and not ieee else "highest")
    assert r.spill_stores == 0 and r.spill_loads == 0, r
    assert r.smem_bytes <= machine.shared_memory_per_block, r
    assert 0 < r.registers <= 255
    assert r.atomics == 0  # the forward has no scatter: no atomics
    # the cost model's shared-memory estimate (used to reject ONFs) is conservative
    assert onchip_bytes(onf) >= r.smem_bytes, (onchip_bytes(onf), r.smem_bytes)


def test_atomic_count_parser():
    text = ("\tatom.global.add.f32 %f1, [%rd1], %f2;\n\t@%p1 red.global.add.f32 [%rd2], %f3;\n"
            "\tld.global.f32 %f4, [%rd3];\n"
            # Triton's inline asm: several instructions on one line
            "\tmov.u32 %r125, 0x0; @%p7 atom.global.gpu.acq_rel.add.f32 %r125, [ %rd59 + 0 ], %r126;\n"
            "\t// atom.global.add in a comment is not an instruction\n\tmov.u32 %red1, %r2;\n")
    assert ptx.count_atomics(text) == 3


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
    reports = [ptx.report(k, machine.arch) for k in ptx.triton_kernels(pallas_kernels.lower(onf), *args)]
    assert len(reports) == 1 and reports[0].atomics > 0, reports
    for r in reports:
        assert r.spill_stores == 0 and r.spill_loads == 0, r
        assert r.smem_bytes <= machine.shared_memory_per_block and onchip_bytes(onf) >= r.smem_bytes, r


@needs_compiler
def test_cli_gpu_report_smoke(capsys):
    """``moajax gpu-report`` end to end on one arch, over the cases ``--only`` picks (the
    forward, and the causal training kernels: a saving forward and a two-kernel adjoint): every
    kernel compiled clean, in both tables (Pallas, and beside it the Triton source where Triton
    is installed), and no other case in them. The families are compiled case by case in the
    tests above; the whole report is ``scripts``' and the committed ``gpu_report.md``'s."""
    from moajax.cli import main

    pattern = "^mha |^grad MHA causal (saving forward|adjoint)"
    rc = main(["gpu-report", "--arch", "sm_86", "--head-dims", "64", "--dtypes", "bfloat16", "--only", pattern])
    out = capsys.readouterr().out
    rows = [line.split(" | ")[2] for line in out.splitlines() if line.startswith("| delta-a40 | sm_86 | ")]
    assert rc == 0 and all(re.search(pattern, r) for r in rows), rows
    assert {"mha bfloat16 H=64", "grad MHA causal saving forward bfloat16 H=64",
            "grad MHA causal adjoint bfloat16 H=64 d_query"} <= set(rows), rows
    assert " kernels, 0 with spills" in out


@needs_compiler
@pytest.mark.parametrize("machine", GPUS, ids=lambda m: m.name)
def test_model_kernels_at_realistic_sizes_fit_without_spills(machine):
    """RMSNorm→matmul and SwiGLU at n=4096, d=1024, f=4096, log-sum-exp over 4096 × 32768,
    decode over a 32768-key cache, attention with a [B N T S] bias: the general scheduler tiles every axis (2-D rows × keys
    tiles, the last output axis over the grid, nested reductions walked), 0 spill bytes.
    RMSNorm alone at d = 4096 and 8192: its rows held whole, fewer than 16 a program."""
    cases = [c for c in gpu_report.model_cases(("float32",), targets=[machine])]
    assert len(cases) == 7
    for label, m, onf in cases:
        assert not isinstance(onf, Exception), (label, onf)
        if label.startswith("decode"):  # one query: the cache walk is split over the grid
            assert any(a.role == "grid" and a.extent > 1 for a in onf.axes), (label, onf.axes)
        elif label.startswith("rmsnorm "):  # a row is 16 or 32 KB: whole rows, a few a program
            assert onf.axis("d").role == "whole" and onf.axis("n").tile < 16, (label, onf.axes)
        else:  # rows × columns tiles, not one row per program
            assert max(a.tile for a in onf.axes if a.role == "grid") >= 16, (label, onf.axes)
        for r in ptx.onf_reports(onf, machine.arch):
            assert r.spill_stores == 0 and r.spill_loads == 0, (label, r)
            assert r.smem_bytes <= machine.shared_memory_per_block, (label, r)
            assert onchip_bytes(onf) >= r.smem_bytes, (label, onchip_bytes(onf), r.smem_bytes)


@needs_compiler
@pytest.mark.parametrize("machine", GPUS, ids=lambda m: m.name)
def test_gqa_training_kernels_compile_without_spills(machine):
    """jax.grad of GQA attention on a GPU: the saving forward (one kernel) and the owner
    plan's dQ kernel and dK/dV kernel — programs owning key tiles, the group's query heads
    walked one at a time around the walk of the queries, Δ recomputed from dO and O in
    place — compile with 0 spill bytes. (Before the group's walk was taken one head at a
    time there, dK and dV held the queries whole, did not fit one kernel, and ran as two.)"""
    cases = gpu_report.training_cases(("bfloat16",), targets=[machine], only=lambda label: "GQA" in label)
    assert [c[0].split("bfloat16 H=64")[-1].strip() for c in cases] == ["", "d_query", "d_key_d_value"]
    for label, m, onf in cases:
        assert not isinstance(onf, Exception), (label, onf)
        reports = ptx.onf_reports(onf, machine.arch)
        assert len(reports) == 1, (label, reports)
        assert reports[0].spill_stores == 0 and reports[0].spill_loads == 0, (label, reports[0])


@needs_compiler
@pytest.mark.parametrize("machine", GPUS, ids=lambda m: m.name)
def test_forward_mode_kernels_compile_without_spills(machine):
    """jax.jvp on a GPU: the tangent kernel of attention and that of the attention kernel
    with a differentiable lse (each block of the ring's forward mode), plain and causal,
    float32 — derived with the spill check on, as on the GPU a process runs on — are one
    Pallas kernel each that compiles with 0 spill bytes (without the check, the table's
    tiling of the causal lse-live tangent spilled on sm_90a in an offline run)."""
    import dataclasses

    cases = gpu_report.tangent_cases(("float32",), targets=[dataclasses.replace(machine, spill_check=True)])
    assert [c[0] for c in cases] == [f"{w} tangent float32 H=64" for w in (
        "jvp MHA", "jvp MHA causal", "ring jvp block (lse live)", "ring jvp block (lse live) causal")]
    for label, m, onf in cases:
        assert not isinstance(onf, Exception), (label, onf)
        reports = ptx.onf_reports(onf, machine.arch)
        assert len(reports) == 1 and reports[0].kernel.endswith("_tangent"), (label, reports)
        assert reports[0].spill_stores == 0 and reports[0].spill_loads == 0, (label, reports[0])


@needs_compiler
@pytest.mark.parametrize("machine", GPUS, ids=lambda m: m.name)
def test_causal_training_kernels_with_skipped_tiles_compile_without_spills(machine):
    """jax.grad of causal attention on a GPU: each kernel's loop runs between bounds computed
    in the kernel from its program id (the masked tiles skipped). Lowering to Triton IR is not
    enough — jnp's integer floor division and a min over a stack of scalars lowered, but did
    not compile — so each is compiled to PTX: 0 spill bytes, and every walk has its skip."""
    plain = gpu_report.training_cases(("float32",), targets=[machine],
                                      only=lambda label: "causal" in label and "mask" not in label)
    assert [c[0].split("float32 H=64")[-1].strip() for c in plain] == ["", "d_query", "d_key_d_value"]
    # beside a bool mask (a mask on data) the forward's and dV's kept skips are guarded by the
    # rows' statistics: the forward's running max checked after its walk, and a walk of every
    # tile summing V for the rows that kept no key, where one did; dV's saved statistic read in
    # steps of 1024 rows. Derived as a GPU derives them, the spill check on: the saving
    # forward's first table tiling spills 4 B on sm_86 and sm_90a (80 registers)
    spill_checked = dataclasses.replace(machine, spill_check=True)
    masked = gpu_report.training_cases(("float32",), targets=[spill_checked], only=lambda label: "mask" in label)
    cases = plain + masked
    assert [c[0].split("float32 H=64")[-1].strip() for c in masked] == ["", "d_query", "d_key_d_value"]
    assert isinstance(masked[0][2].skips[0].guard, RowGuard) and masked[0][2].skips[0].kept == (True,)
    assert any(isinstance(sk.guard, RowGuard) and sk.guard.stats for sk in masked[2][2].skips)
    for label, m, onf in cases:
        assert not isinstance(onf, Exception), (label, onf)
        assert onf.skips, label
        reports = ptx.onf_reports(onf, machine.arch)
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
    for r in ptx.onf_reports(onf, h200.arch):
        assert r.spill_stores == 0 and r.spill_loads == 0, r


@needs_compiler
@pytest.mark.parametrize("config", ["highest", None])
def test_the_seeds_block_gradients_compile_without_spills(config):
    """jax.grad of rms_norm and gated_mlp at the seed's block (n = 1024, d = 64, d_ff = 256) on
    the A100: the weight gradients' split-K parts and the combine that sums them (and, until
    the cost model chose between staging and recomputing on a GPU, 2026-12-05, a staged first
    kernel; at this size it recomputes: a launch fewer. Its dZ, recomputing U, V and G_H,
    spills 2,112 B at the table's first tiling with IEEE float32 dots: the check takes the
    next, as a GPU's derivation does) — which held every part's [32 × 256] block at once and spilled 9.9 KB until it
    walked the parts one at a time (``Backend.walks_parts``). With IEEE float32 dots
    ("highest") and TF32 ones (JAX's default), as a GPU derives them, its spill check on (with
    TF32 the table's first tiling of dZ spills 28 B; the check takes the next)."""
    with jax.default_matmul_precision(config):
        targets = gpu_report.gpus(("sm_80",))
        cases = gpu_report.model_training_cases(("float32",), targets=targets, only=lambda label: "n=1024 d=64" in label)
    assert {c[0].split()[1] for c in cases} == {"rmsnorm", "swiglu"} and len(cases) >= 5
    for label, m, onf in cases:
        assert not isinstance(onf, Exception), (label, onf)
        for r in ptx.onf_reports(onf, m.arch):
            assert r.spill_stores == 0 and r.spill_loads == 0, (label, r)


@needs_compiler
def test_score_mod_table_reads_are_gathers_on_the_gpu():
    """A relative-position table read at a computed index (clip(q_idx − kv_idx)) is a gather
    load in the Pallas kernel, not a one-hot Σ over the table: the causal forward and the
    adjoint's dK-with-dV kernel (the owner plan's: P once per tile) compile for the A100 with
    0 spill bytes."""
    cases = gpu_report.score_mod_cases(("float32",), targets=[machines.load("delta-a100")],
                                       only=lambda label: "relpos" in label)
    wanted = [c for c in cases if c[0].endswith(("forward float32 H=64", "d_key_d_value"))]
    assert len(wanted) == 2, [c[0] for c in cases]
    for label, m, onf in wanted:
        for r in ptx.onf_reports(onf, m.arch):
            assert r.spill_stores == 0 and r.spill_loads == 0, (label, r)


@needs_compiler
@pytest.mark.parametrize("config", ["highest", None])
@pytest.mark.parametrize("machine", GPUS, ids=lambda m: m.name)
def test_score_mod_table_gradients_fill_the_gpu_without_spills(machine, config):
    """The gradient of a score_mod's table (ALiBi's 8 slopes, a 33-entry relative-position
    table), whose programs own table entries and walk every score: split-K cuts its heads and
    then its keys (``schedule._split_to_fill``, two cuts) until the programs fill the machine,
    and the nested walks' [s × t] score tile is at most the attention tables' keys wide — every
    kernel of it (the partials and the combines) compiles with 0 spill bytes, where one cut
    over the heads left 8 (or 16) programs and the 64 × 64 tiles before spilled (820 B on
    sm_90a for ALiBi in gpu_report.md at 2ccdd62; bench/results/score_mod_tiles_gpu.md
    sweeps the tiles now). With IEEE float32 dots ("highest") at the tables' first tilings;
    with TF32 ones (JAX's default) as a GPU derives them, its spill check on: there the
    relative-position table's first kernel on the A40 spills 8 B with 8 warps at the table's
    first two ranks, which clamp to one tiling, and compiles clean with the 4 warps of the
    third (the check stopped at the repeat before). ALiBi inside documents (a −∞ select beside
    the slopes) spilled 956–1,168 B on every profile at the check's least-spilling tiling, and
    7,956 B on the H200 at the table's first, before the partials' conditions left their sums
    (``rewrites.conditions_out``). It is checked as a GPU derives it under both precisions:
    with IEEE float32 dots the table's first tiling spills 772 B on the H200 (255 registers),
    and the check takes 16 × 16."""
    import dataclasses

    checked = dataclasses.replace(machine, spill_check=True)
    with jax.default_matmul_precision(config):
        target = machine if config else checked
        # the documents' adjoint derived as a GPU derives it (checked) under both precisions
        cases = gpu_report.score_mod_cases(("float32",), targets=[target], only=lambda label: "adjoint" in label and (
            target is checked or "alibi_document" not in label))
        if target is not checked:
            cases += gpu_report.score_mod_cases(("float32",), targets=[checked],
                                                only=lambda label: "adjoint" in label and "alibi_document" in label)
        cases = [c for c in cases if "d_score_mod_const" in c[0]]
    assert {c[0].split()[1] for c in cases} == {"alibi", "relpos", "alibi_document"}
    for label, m, onf in cases:
        assert not isinstance(onf, Exception), (label, onf)
        cuts = [h for h in onf.history if h.startswith("split_k(")]
        assert len(cuts) == 2, (label, onf.history)
        programs = int(np.prod([a.ntiles for a in onf.axes if a.role == "grid"]))
        assert programs >= m.multiprocessors, (label, programs)
        for r in ptx.onf_reports(onf, m.arch):
            assert r.spill_stores == 0 and r.spill_loads == 0, (label, r)


def _softcap_forward():
    """The causal forward of tanh soft-capping (B=1, T=S=1024, N=8, H=64, float32): on sm_80
    the table's first tiling (64 × 32, 8 warps, 3 stages) spills under ptxas 12.9 with IEEE
    float32 dots (the tests using it derive under jax.default_matmul_precision("highest"):
    with TF32 dots that tiling compiles clean)."""
    import jax
    import jax.numpy as jnp

    from moajax.api import _check_score_mod
    from moajax.kernels.attention import mha_kernel

    mod = _check_score_mod(lambda s, b, h, qi, ki: 30.0 * jnp.tanh(s / 30.0), np.dtype("float32"))
    kern = mha_kernel(None, None, False, False, False, mod)
    return kern.dnf(*[jax.ShapeDtypeStruct((1, 1024, 8, 64), np.float32)] * 3, is_causal=True)


def _tiling(onf) -> tuple:
    return (tuple((a.name, a.tile) for a in onf.axes if a.role in ("grid", "sequential") and a.tile > 1),
            onf.knobs.num_warps, onf.knobs.num_stages)


@needs_compiler
def test_the_spill_check_steps_down_the_table_where_ptxas_spills():
    """A GPU with its spill check on (the GPU a process runs on; gpu-report) keeps the first
    table tiling that fits shared memory and compiles without spilling: for the soft-capped
    forward on an A100 that is the next one down (the tanh tips ptxas over, where plain
    attention at the same tiling does not spill: test_default_onf_compiles_without_spills)."""
    import dataclasses

    a100 = machines.load("delta-a100")
    dnf = _softcap_forward()
    # with the mask evaluated on every tile (a GPU's default; pinned): the causal walk's
    # interior loop without it (Skip.interior) does not spill at the first tiling
    # (test_the_unmasked_interior_keeps_the_first_tiling_of_the_soft_capped_forward)
    whole = schedule.Preset.of(unmask_interior=False)
    with jax.default_matmul_precision("highest"):
        table = schedule.derive(dnf, a100, whole)
        checked = schedule.derive(dnf, dataclasses.replace(a100, spill_check=True), whole)
    assert ptx.spill_bytes(table, "sm_80") > 0  # a finding of ptxas 12.9: if it moves, so does this test
    assert ptx.spill_bytes(checked, "sm_80") == 0
    assert checked == schedule._derive(dnf, a100, whole, rank=1) != table
    assert checked.target == "delta-a100" and _tiling(checked)[1:] == (8, 2)


@needs_compiler
def test_the_unmasked_interior_keeps_the_first_tiling_of_the_soft_capped_forward():
    """With the causal forward's interior key tiles walked in a loop without the mask
    (``Skip.interior``; not a GPU's default until timed there), the soft-capped forward no
    longer spills at the table's first tiling — the spill check keeps that tiling."""
    import dataclasses

    a100 = machines.load("delta-a100")
    dnf = _softcap_forward()
    inner = schedule.Preset.of(unmask_interior=True)
    with jax.default_matmul_precision("highest"):
        table = schedule.derive(dnf, a100, inner)
        assert not any(sk.interior for sk in schedule.derive(dnf, a100).skips)  # a GPU's default
        assert schedule.derive(dnf, dataclasses.replace(a100, spill_check=True), inner) == table
    assert table.skips and all(sk.interior for sk in table.skips)
    assert ptx.spill_bytes(table, "sm_80") == 0


@needs_compiler
def test_the_spill_check_keeps_a_clean_tiling():
    """Where the table's first tiling compiles clean the check changes nothing."""
    import dataclasses

    a100 = dataclasses.replace(machines.load("delta-a100"), spill_check=True)
    dnf = mha_dnf((1, 1024, 8, 64), (1, 1024, 8, 64), (1, 1024, 8, 64), np.float32)
    assert schedule.derive(dnf, a100) == schedule.derive(dnf, machines.load("delta-a100"))


@pytest.mark.parametrize("preset", [dict(tiles={"t": 64, "s": 32}), dict(num_warps=8, num_stages=3)],
                         ids=["tiles", "knobs"])
def test_a_presets_tiles_or_knobs_are_not_spill_checked(monkeypatch, preset):
    """Tiles or knobs a Preset gives are the user's choice: each alone turns the check off."""
    import dataclasses

    monkeypatch.setattr(ptx, "spill_bytes", lambda *a: pytest.fail("a Preset's tiling was spill-checked"))
    monkeypatch.setattr(schedule, "_DERIVED", type(schedule._DERIVED)())
    a100 = dataclasses.replace(machines.load("delta-a100"), spill_check=True)
    dnf = mha_dnf((1, 1024, 8, 64), (1, 1024, 8, 64), (1, 1024, 8, 64), np.float32)
    assert schedule.derive(dnf, a100, **preset) == schedule.derive(dnf, machines.load("delta-a100"), **preset)


def test_a_presets_dot_precision_is_spill_checked(monkeypatch):
    """The dots' precision is arithmetic, not a tiling: a Preset giving only ``dot_precision``
    is spill-checked as the config's precision is (before, any knob turned the check off, so
    the two ways of asking for IEEE float32 could run different tilings)."""
    import dataclasses

    checked = []
    monkeypatch.setattr(ptx, "spill_bytes", lambda onf, arch, path: checked.append(onf) or 0)
    monkeypatch.setattr(schedule, "_DERIVED", type(schedule._DERIVED)())
    a100 = dataclasses.replace(machines.load("delta-a100"), spill_check=True)
    dnf = mha_dnf((1, 1024, 8, 64), (1, 1024, 8, 64), (1, 1024, 8, 64), np.float32)
    onf = schedule.derive(dnf, a100, dot_precision="highest")
    assert checked == [onf] and onf.knobs.dot_precision == "highest"


def test_where_every_tiling_spills_the_least_spilling_is_kept(monkeypatch):
    """No tiling of the table compiles clean (spill bytes given per tiling here): the check keeps
    the one that spills least, the first of equals, after trying each that fits once, up to
    its number of tries (the table's four, then the next structure's first: Out's e over the
    grid in tiles of 32 at 64 × 32)."""
    import dataclasses

    spills = {(64, 32): 16, (64, 16): 8, (32, 16): 24, (16, 16): 8}
    asked = []

    def fake(onf, arch, path):
        asked.append(onf)
        t = dict(_tiling(onf)[0])
        return spills[(t["t"], t["s"])]

    monkeypatch.setattr(ptx, "spill_bytes", fake)
    monkeypatch.setattr(schedule, "_DERIVED", type(schedule._DERIVED)())
    a100 = machines.load("delta-a100")
    dnf = mha_dnf((1, 1024, 8, 64), (1, 1024, 8, 64), (1, 1024, 8, 64), np.float32)
    got = schedule.derive(dnf, dataclasses.replace(a100, spill_check=True))
    assert len(asked) == schedule.SPILL_CHECK_TRIES == len(set(asked))  # each fitting tiling once
    assert asked[-1].axis("e").role == "grid" and asked[-1].axis("e").tile == 32
    # (64, 16): 8 B, before (16, 16); at the precision derive took from the config
    assert got == schedule._derive(dnf, a100, schedule.Preset(), 1, compat.default_dot_precision())


def test_two_ranks_that_clamp_to_one_tiling_do_not_end_the_check(monkeypatch):
    """Table entries can give one ONF (tiles capped by the extents: the score_mod table
    gradient's first kernel on the A40, ranks 0 and 1): the check skips the repeat and goes
    on to the next rank that differs, where before it stopped and kept the spilling one."""
    import dataclasses

    a100 = machines.load("delta-a100")
    dnf = mha_dnf((1, 1024, 8, 64), (1, 1024, 8, 64), (1, 1024, 8, 64), np.float32)
    spilling = schedule.derive(dnf, a100)
    clean = dataclasses.replace(spilling, knobs=dataclasses.replace(spilling.knobs, num_warps=4))
    by_rank = [spilling, spilling, clean]
    monkeypatch.setattr(schedule, "_derive", lambda d, m, p, rank=0, precision=None: by_rank[min(rank, 2)])
    monkeypatch.setattr(ptx, "spill_bytes", lambda onf, arch, path: 0 if onf == clean else 8)
    monkeypatch.setattr(schedule, "_DERIVED", type(schedule._DERIVED)())
    assert schedule.derive(dnf, dataclasses.replace(a100, spill_check=True)) == clean


@pytest.mark.parametrize("spilled, kept", [(104, "first"), (25000, "clean")])
def test_a_clean_fallback_many_times_slower_does_not_win_over_a_small_spill(monkeypatch, spilled, kept):
    """The A100's RMSNorm dW (recomputing r) at n = d = 4096 in float32: its first tiling cuts
    the rows over the grid (split-K) and spills 104 B (ptxas 12.9); the third, clean, lost the
    split and walked all 4096 rows' Σ_d x² in each of 64 programs, 34× slower by the cost
    model, and the check took it. A spill of at most ``SPILL_TOLERATED`` bytes now stands
    where the clean tiling is over ``SPILL_SLOWDOWN`` times slower; a large one (25 KB: the
    H200's 10× slow attention tilings) still gives way (spill bytes given per rank here)."""
    import dataclasses

    import jax

    a100 = machines.load("delta-a100")
    S = jax.ShapeDtypeStruct
    specs = [S((4096, 4096), np.float32), S((4096,), np.float32)]
    from moajax.kernels.norm import rmsnorm

    adj = rmsnorm.adjoint(*specs).dnf(*specs, S((4096, 4096), np.float32))
    (dnf,) = [o.dnf for o in schedule.derive_plan(adj, a100) if o.dnf.name.endswith("d_weight")]
    precision = compat.default_dot_precision()
    by_rank = [schedule._derive(dnf, a100, schedule.Preset(), r, precision) for r in range(3)]
    assert by_rank[0].axis("n_o").role == "grid" and by_rank[2].axis("n").role == "sequential"  # (the split lost)
    assert cost.estimate(by_rank[2], a100).time_s > schedule.SPILL_SLOWDOWN * cost.estimate(by_rank[0], a100).time_s
    monkeypatch.setattr(ptx, "spill_bytes", lambda onf, arch, path: 0 if onf == by_rank[2] else spilled)
    monkeypatch.setattr(schedule, "_DERIVED", type(schedule._DERIVED)())
    got = schedule.derive(dnf, dataclasses.replace(a100, spill_check=True))
    assert got == (by_rank[0] if kept == "first" else by_rank[2])


def test_the_check_goes_on_to_the_next_structure_when_one_is_spent(monkeypatch):
    """The H200's float32 SwiGLU dZ at n = 4096, d = 1024 fits shared memory with its 1024
    columns held whole at 16 × 16 only (the A100's does not, and takes 32 × 128 output tiles).
    Where that spills (given here: ptxas 12.9 has put it at 255 registers, 0 or 8 B), the next
    try is the next structure's first tiling, the d axis tiled over the grid; before, the ranks
    stepped within the first structure, repeated its one tiling and kept it."""
    import dataclasses

    import jax

    from moajax.kernels.mlp import swiglu

    def held_whole(onf):
        return any(a.name == "d" and a.role == "whole" for a in onf.axes)

    monkeypatch.setattr(ptx, "spill_bytes", lambda onf, arch, path: 8 if held_whole(onf) else 0)
    monkeypatch.setattr(schedule, "_DERIVED", type(schedule._DERIVED)())
    S = lambda *s: jax.ShapeDtypeStruct(s, np.dtype("float32"))  # noqa: E731
    n, d, f = 4096, 1024, 4096
    specs = [S(n, d), S(d, f), S(d, f), S(f, d)]
    dnf = next(o for o in schedule.derive_plan(swiglu.adjoint(*specs).dnf(*specs, S(n, d)), machines.load("h200"))
               if o.dnf.name.endswith("d_z")).dnf
    h200 = machines.load("h200")
    assert held_whole(schedule.derive(dnf, h200))  # the table's first fit
    got = schedule.derive(dnf, dataclasses.replace(h200, spill_check=True))
    assert not held_whole(got) and got.axis("d").role == "grid" and got.axis("d").tile == 128, got


def test_a_tiling_the_backend_refuses_is_passed_over_not_taken(monkeypatch, caplog):
    """A tiling whose lowering raises an ONFError (a block Triton cannot take) is the next
    rank's turn, not a failing toolchain: before, the check kept it, and warned that the
    profile's tilings were not checked."""
    import dataclasses

    from moajax.onf import ONFError

    a100 = machines.load("delta-a100")
    dnf = mha_dnf((1, 1024, 8, 64), (1, 1024, 8, 64), (1, 1024, 8, 64), np.float32)
    first = schedule.derive(dnf, a100)

    def refuse_first(onf, arch, path):
        if onf == first:
            raise ONFError("a block of 48 (test)")
        return 0

    monkeypatch.setattr(ptx, "spill_bytes", refuse_first)
    monkeypatch.setattr(schedule, "_DERIVED", type(schedule._DERIVED)())
    monkeypatch.setattr(schedule, "_SPILLS_WARNED", set())
    with caplog.at_level("WARNING", logger="moajax"):
        got = schedule.derive(dnf, dataclasses.replace(a100, spill_check=True))
    assert got != first and not caplog.records


def test_a_plan_compiles_only_the_kernels_it_keeps(monkeypatch):
    """The attention adjoint's fused candidate decides the plan (it scatter-adds: owner on a
    GPU) by its structure, which the check does not change: it is probed unchecked, and only the
    owner plan's two kernels are compiled (before, the discarded fused one was too)."""
    import dataclasses

    import jax

    from moajax.kernels.attention import mha_kernel

    asked = []
    monkeypatch.setattr(ptx, "spill_bytes", lambda onf, arch, path: asked.append(onf.dnf.name) or 0)
    monkeypatch.setattr(schedule, "_DERIVED", type(schedule._DERIVED)())
    specs = [jax.ShapeDtypeStruct((1, 1024, 8, 64), np.float32)] * 3
    adj, args = mha_kernel(None, None, False).saved_adjoint(*specs)
    dnf = adj.dnf(*args)
    a100 = machines.load("delta-a100")
    plan = schedule.derive_plan(dnf, dataclasses.replace(a100, spill_check=True))
    assert isinstance(plan, tuple) and sorted(asked) == sorted(o.dnf.name for o in plan)
    assert plan == schedule.derive_plan(dnf, a100)  # 0 spills given: the table's tilings


def test_the_table_ranks_are_its_fitting_tilings_in_order():
    """``rank`` k takes the (k+1)-th tiling that fits shared memory, in the scheduler's order of
    structures: for float32 H=64 attention on an A100, GPU_TILES' (64, 32, 8, 3), (64, 16, 8, 2),
    (32, 16, 8, 2), (16, 16, 4, 2) with Out's e whole; then the next structure's, e over the grid
    in tiles of 32 (the spill check's tries go on there once the first structure is spent), and
    the last that fits once every structure runs out."""
    a100 = machines.load("delta-a100")
    dnf = mha_dnf((1, 1024, 8, 64), (1, 1024, 8, 64), (1, 1024, 8, 64), np.float32)
    got = [schedule._derive(dnf, a100, schedule.Preset(), k, compat.default_dot_precision()) for k in range(6)]
    tiles = [(dict(_tiling(o)[0])["t"], dict(_tiling(o)[0])["s"], *_tiling(o)[1:]) for o in got]
    table = [tuple(c) for c in schedule.GPU_TILES[(4, 64)]]
    assert tiles == table + table[:2]
    assert [o.axis("e").role for o in got] == ["whole"] * 4 + ["grid"] * 2 and got[4].axis("e").tile == 32
    assert got[0] == schedule.derive(dnf, a100)
    last = schedule._derive(dnf, a100, schedule.Preset(), 1000, compat.default_dot_precision())
    assert last.axis("e").tile == 16 and (dict(_tiling(last)[0])["t"], dict(_tiling(last)[0])["s"]) == (16, 16)


@pytest.mark.parametrize("failure", [ptx.ToolMissing("ptxas not found (test)"),
                                     RuntimeError("ptxas failed for sm_80: Unsupported .version 8.8 (test)")],
                         ids=["missing", "failing"])
def test_without_a_working_toolchain_the_table_stands_with_one_warning(monkeypatch, caplog, failure):
    """Missing or failing (an older ptxas than the PTX, an unknown arch), the check never stops a
    kernel: the table's tiling, one warning per profile."""
    import dataclasses

    def missing(*a):
        raise failure

    monkeypatch.setattr(ptx, "spill_bytes", missing)
    monkeypatch.setattr(schedule, "_DERIVED", type(schedule._DERIVED)())
    monkeypatch.setattr(schedule, "_SPILLS_WARNED", set())
    a100 = machines.load("delta-a100")
    checked = dataclasses.replace(a100, spill_check=True)
    dnfs = [mha_dnf((1, n, 8, 64), (1, n, 8, 64), (1, n, 8, 64), np.float32) for n in (256, 512)]
    with caplog.at_level("WARNING", logger="moajax"):
        got = [schedule.derive(d, checked) for d in dnfs]
    assert [_tiling(o) for o in got] == [_tiling(schedule.derive(d, a100)) for d in dnfs]
    assert sum("not spill-checked" in r.message for r in caplog.records) == 1


def test_a_gpu_a_process_runs_on_checks_its_tilings():
    """``machines.for_device`` of a CUDA device: its profile, spill check on (profiles loaded
    by name, targets of an offline lowering, leave it off)."""

    class FakeDevice:
        platform = "gpu"
        device_kind = "NVIDIA A100-SXM4-40GB"

    m = machines.for_device(FakeDevice())
    assert m.name == "delta-a100" and m.spill_check
    assert not machines.load("delta-a100").spill_check


@needs_compiler
def test_inside_jit_the_gpu_branch_is_spill_checked(monkeypatch):
    """What a process on a GPU derives for the CUDA branch of a jitted call goes through the
    check (the lowering it compiles is made inside the outer trace): soft-capping at T = 256
    on an A100 profile, the mask evaluated on every tile, spills 16 B at the table's first
    tiling and runs the next one."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    import moajax
    from moajax import runtime

    seen = []
    checked = ptx.spill_bytes
    monkeypatch.setattr(ptx, "spill_bytes", lambda onf, arch, path: seen.append(checked(onf, arch, path)) or seen[-1])
    monkeypatch.setattr(runtime, "gpu_machine",
                        lambda path="pallas": dataclasses.replace(machines.load("delta-a100"), spill_check=True))
    monkeypatch.setattr(schedule, "_DERIVED", type(schedule._DERIVED)())
    runtime.schedules.cache_clear()
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 256, 4, 64)), jnp.float32)
    softcap = lambda s, b, h, qi, ki: 30.0 * jnp.tanh(s / 30.0)  # noqa: E731
    # the mask on every tile (a GPU's default; pinned): with the interior unmasked the first
    # tiling fits
    whole = schedule.Preset.of(unmask_interior=False)
    with jax.default_matmul_precision("highest"):  # (the IEEE float32 dots' finding: _softcap_forward)
        out = jax.jit(lambda q: moajax.dot_product_attention(q, q, q, is_causal=True, score_mod=softcap,
                                                             onf=whole))(q)
    runtime.schedules.cache_clear()
    assert out.shape == q.shape and bool(jnp.isfinite(out).all())
    assert seen[0] > 0 and seen[-1] == 0, seen


@needs_compiler
def test_an_unlisted_gpus_tilings_compile_for_its_own_arch():
    """An unlisted sm_89 GPU (``machines.generic_gpu``): the attention forward derived with its
    spill check compiles for sm_89 within its 99 KB of shared memory, without spilling."""
    import dataclasses

    m = dataclasses.replace(machines.load("generic-gpu-sm_89"), spill_check=True)
    onf = schedule.derive(mha_dnf((1, 1024, 8, 64), (1, 1024, 8, 64), (1, 1024, 8, 64), np.float32), m)
    (r,) = ptx.onf_reports(onf, "sm_89")
    assert r.spill_stores == r.spill_loads == 0 and 0 < r.smem_bytes <= m.shared_memory_per_block == 101376


@pytest.mark.parametrize("machine", GPUS, ids=lambda m: m.name)
def test_a_16_bit_saving_forward_contracts_in_16_bits(machine):
    """The forward jax.grad runs (it saves the row statistics) outputs float32 statistics
    first, then the bfloat16 Out: its tiling and its dots go by its narrowest output, as the
    plain forward's do. Read from the first output, its dots ran as float32 FMA on a 32 × 32
    tiling: about 5.9 ms of bfloat16 jit(grad)'s 7.1 at S = 4096 on the H200 (inferred), where the plain
    forward took 0.26 (bench/results/gpu_backward_sweep_h200.md). On the GPU the dots' PTX
    holds the tensor-core instructions (mma; wgmma on sm_90a), not only FMAs."""
    import re

    import jax
    import jax.numpy as jnp

    import pallas_kernels
    from moajax.kernels.attention import mha_kernel

    specs = [jax.ShapeDtypeStruct((1, 4096, 8, 64), jnp.bfloat16)] * 3
    with compat.enable_x64_context(True):
        kern = mha_kernel(None, None, False)
        saving, plain = kern.with_row_statistics(()).dnf(*specs), kern.dnf(*specs)
    assert np.dtype(saving.outputs[0].dtype) == np.float32 and np.dtype(saving.outputs[-1].dtype) == jnp.bfloat16
    onf = schedule.derive(saving, machine)
    assert onf.knobs.lowp_dots and schedule.derive(plain, machine).knobs.lowp_dots
    if REASON is None:
        (k,) = ptx.triton_kernels(pallas_kernels.lower(onf), *[jax.ShapeDtypeStruct(i.shape, i.dtype)
                                                                for i in onf.dnf.inputs])
        asm, _ = ptx.compile_ptx(k, machine.arch)
        assert re.search(r"\bw?gmma\.|\bmma\.sync", asm), (machine.name, "no tensor-core instruction")


def test_the_tensorfloat32_knob_puts_float32_dots_on_tensor_cores():
    """``Preset.of(dot_precision=...)`` (``Knobs.dot_precision``): "tensorfloat32" puts the
    float32 forward's dots on TF32 tensor-core instructions in its PTX, "highest" keeps IEEE
    float32 FMAs (the H200 measured those at 6–11 TFLOP/s against XLA's TF32 dots:
    gpu_check_h200.md). A value it does not know is a named error."""
    import re

    import jax
    import jax.numpy as jnp

    import pallas_kernels
    from moajax.kernels.attention import mha_kernel
    from moajax.schedule import Preset

    specs = [jax.ShapeDtypeStruct((1, 1024, 8, 64), jnp.float32)] * 3
    with compat.enable_x64_context(True):
        dnf = mha_kernel(None, None, False).dnf(*specs)
    a100 = machines.load("delta-a100")
    onfs = {p: schedule.derive(dnf, a100, Preset.of(dot_precision=p)) for p in ("highest", "tensorfloat32")}
    assert "tensorfloat32 dots" in onfs["tensorfloat32"].pretty() and "dots" not in onfs["highest"].knobs.text()
    with pytest.raises(ValueError, match="dot_precision"):
        schedule.derive(dnf, a100, Preset.of(dot_precision="tf32"))
    if REASON is None:
        for p, onf in onfs.items():
            (k,) = ptx.triton_kernels(pallas_kernels.lower(onf), *[jax.ShapeDtypeStruct(i.shape, i.dtype)
                                                                    for i in onf.dnf.inputs])
            asm, _ = ptx.compile_ptx(k, "sm_80")
            assert bool(re.search(r"mma\.sync[^;]*tf32", asm)) == (p == "tensorfloat32"), p


def _gradient_reports(arch, profile, dtype, **knobs):
    """ptxas' reports of the kernels of jax.grad of attention (B = 1, S = T = 1024, N = 8,
    H = 64) on ``profile``, the call's Preset holding ``knobs``, by kernel name."""
    import jax
    import jax.numpy as jnp

    import moajax
    from moajax.schedule import Preset

    pre = Preset.of(backward="owner", **knobs)
    spec = jax.ShapeDtypeStruct((1, 1024, 8, 64), dtype)
    f = jax.grad(lambda a, b, c: jnp.sum(moajax.dot_product_attention(a, b, c, onf=pre).astype(jnp.float32)),
                 argnums=(0, 1, 2))
    with machines.using(machines.load(profile)):
        kernels = ptx.triton_kernels(f, spec, spec, spec)
    return {k.name.removeprefix("moajax_mha_mh"): (k, ptx.report(k, arch)) for k in kernels}


@needs_compiler
def test_tile_layout_dots_put_the_dk_dv_kernels_scores_on_wgmma():
    """The H200's bfloat16 gradient, sm_90a: under the default ``Knobs.dot_layout``
    ("operands") the dK/dV kernel, walking 32 queries a step, computes its scores and dP as
    Q·Kᵀ and dO·Vᵀ, 32-row dots that Hopper's wgmma (64 rows at least) cannot take, and ptxas
    gives them Ampere's mma.sync; under "tile" they are K·Qᵀ and V·dOᵀ, 64 key rows, and
    every dot of the gradient is a wgmma. The knob reaches the gradient's kernels from the
    call's Preset."""
    reports = {layout: _gradient_reports("sm_90a", "h200", "bfloat16", dot_layout=layout)
               for layout in ("operands", "tile")}
    assert set(reports["tile"]) == {"_saving", "_adjoint_saved_d_query", "_adjoint_saved_d_key_d_value"}
    dkv = {layout: r["_adjoint_saved_d_key_d_value"][1] for layout, r in reports.items()}
    assert dkv["operands"].mma_sync > 0 and dkv["operands"].wgmma > 0, dkv
    for name, (_, r) in reports["tile"].items():
        assert r.mma_sync == 0 < r.wgmma and r.spill_stores == 0, (name, r)


@needs_compiler
def test_the_gradients_kernels_take_the_calls_dot_precision():
    """The float32 gradient's three kernels (the saving forward, dQ, dK/dV) on sm_80: their
    dots are TF32 tensor-core instructions under JAX's default matmul precision (as XLA's
    float32 dots on that GPU) and IEEE float32 FMAs under jax.default_matmul_precision
    ("highest"); a Preset's ``dot_precision`` wins over the config in all three. (Before,
    the backward kernels took the Preset's plan and tiles but not its knobs: their dots
    stayed IEEE float32.)"""
    import contextlib
    import re

    import jax

    for config, knobs, tf32 in ((None, {}, True), ("highest", {}, False),
                                ("highest", {"dot_precision": "tensorfloat32"}, True)):
        with jax.default_matmul_precision(config) if config else contextlib.nullcontext():
            kernels = _gradient_reports("sm_80", "delta-a100", "float32", **knobs)
        assert len(kernels) == 3
        for name, (k, _) in kernels.items():
            asm, _ = ptx.compile_ptx(k, "sm_80")
            assert bool(re.search(r"mma\.sync[^;]*tf32", asm)) == tf32, (name, config, knobs)


def test_mma_count_parser():
    text = ("\twgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, p, 1, 1, 0, 1;\n"
            "\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1}, {%r1}, {%r2}, {%f2};\n"
            "\twgmma.fence.sync.aligned;\n\twgmma.commit_group.sync.aligned;\n"
            "\t// mma.sync in a comment is not an instruction\n")
    assert ptx.count_mma(text) == (1, 1)


@needs_compiler
def test_a_16_bit_matmul_on_hopper_is_all_wgmma():
    """RMSNorm→matmul in bfloat16 at n = 4096, d = 1024, f = 4096 on the H200 (sm_90a): its
    128 × 128 tiles give 128-row dots, and every tensor-core instruction is a wgmma, with no
    spills (with 32 × 128 tiles it was 4 mma.sync and no wgmma)."""
    import jax

    from moajax.kernels import rmsnorm_matmul

    bf16 = np.dtype("bfloat16")
    h200 = machines.load("h200")
    dnf = rmsnorm_matmul.dnf(*(jax.ShapeDtypeStruct(s, bf16) for s in ((4096, 1024), (1024,), (1024, 4096))))
    (r,) = ptx.onf_reports(schedule.derive(dnf, h200), h200.arch)
    assert r.wgmma > 0 and r.mma_sync == 0 and r.spill_stores == 0 and r.smem_bytes <= h200.shared_memory_per_block, r


@needs_compiler
def test_a_profiles_own_tilings_come_first():
    """The H200 profile's measured tiling (``Machine.gpu_tiles`` "scatter 2 64": its sweep ran
    the bfloat16 dK/dV kernel at S = 4096 in 0.600 ms at 64 × 64 with 4 warps, 0.920 at the
    table's 64 × 32 with 8): its owner plan's dK/dV kernel takes it, causal or not, and on
    sm_90a every dot is a wgmma with no spills (the table's tiling: mma.sync beside wgmma).
    GQA's walked schedule has no entry of its own (at 64 × 64 with 4 warps its causal kernel
    spills 2.5 KB) and keeps the table's; the A100 keeps the table's."""
    import dataclasses

    import jax

    from moajax.kernels.attention import mha_kernel

    def dkv(profile, kv, causal, own=True):
        machine = machines.load(profile)
        machine = machine if own else dataclasses.replace(machine, gpu_tiles={})
        specs = [jax.ShapeDtypeStruct((1, 4096, 8, 64), np.dtype("bfloat16"))] + [
            jax.ShapeDtypeStruct((1, 4096, kv, 64), np.dtype("bfloat16"))] * 2
        with compat.enable_x64_context(True):
            adj, args = mha_kernel(None, None, kv != 8).saved_adjoint(*specs, is_causal=causal)
            (onf,) = [o for o in schedule.derive_plan(adj.dnf(*args, is_causal=causal), machine) if "d_key" in o.dnf.name]
        return onf

    def tiling(o):
        return ({a.name: a.tile for a in o.axes if a.name in ("s", "t")}, o.knobs.num_warps, o.knobs.num_stages)

    for causal in (False, True):
        own, table = dkv("h200", 8, causal), dkv("h200", 8, causal, own=False)
        assert tiling(own) == ({"s": 64, "t": 64}, 4, 2) and tiling(table) == ({"s": 64, "t": 32}, 8, 2)
        (r,) = ptx.onf_reports(own, "sm_90a")
        assert r.wgmma > 0 and r.mma_sync == 0 and r.spill_stores == 0, r
    (t,) = ptx.onf_reports(table, "sm_90a")
    assert t.mma_sync > 0, t
    assert tiling(dkv("h200", 2, True)) == tiling(dkv("h200", 2, True, own=False))
    assert tiling(dkv("delta-a100", 8, False)) == ({"s": 64, "t": 32}, 8, 2)


@needs_compiler
def test_causal_gqas_dk_dv_on_the_a100_compiles_clean_at_the_tables_first():
    """Causal GQA's dK/dV kernel in bfloat16 at S = 4096 (8 query heads over 2 kv heads) on the
    A100, derived as a GPU derives it, compiles with 0 spills at the scatter table's first,
    64 × 32 with 8 warps. Until 2026-12-05 ptxas spilled there and at 32 × 32 with 4 warps,
    and the check stepped down to 32 × 32 with 8 warps (before 2026-12-04 the table's next was
    16 × 16; bench/results/gqa_plans_ptx.md): the scale and 1/ℓ were multiplied into its 16-bit
    dot operands, which now take Q, K, dO and V as read (``rewrites.factor_out_of_dots``)."""
    import dataclasses

    from moajax.kernels.attention import mha_kernel

    a100 = dataclasses.replace(machines.load("delta-a100"), spill_check=True)
    specs = [jax.ShapeDtypeStruct((1, 4096, n, 64), np.dtype("bfloat16")) for n in (8, 2, 2)]
    with compat.enable_x64_context(True):
        adj, args = mha_kernel(None, None, True).saved_adjoint(*specs, is_causal=True)
        (onf,) = [o for o in schedule.derive_plan(adj.dnf(*args, is_causal=True), a100) if "d_key" in o.dnf.name]
    assert ({a.name: a.tile for a in onf.axes if a.name in ("s", "t")}, onf.knobs.num_warps) == ({"s": 64, "t": 32}, 8)
    (r,) = ptx.onf_reports(onf, "sm_80")
    assert r.spill_stores == 0 and r.spill_loads == 0, r


@needs_compiler
def test_a_kernel_without_dots_steps_to_fewer_rows_where_16_spill():
    """RMSNorm in bfloat16 at d = 4096 on sm_80: 16 rows a program fit shared memory (139 KB)
    and spill (ptxas 12.9: 808 B); it was the only tiling that fitted, so it stayed. A kernel
    without dots loses nothing to fewer rows: the spill check's next try is 8 rows, clean."""
    from moajax.kernels import rmsnorm

    bf16 = np.dtype("bfloat16")
    S = jax.ShapeDtypeStruct
    dnf = rmsnorm.dnf(S((4096, 4096), bf16), S((4096,), bf16))
    a100 = machines.load("delta-a100")
    first = schedule.derive(dnf, dataclasses.replace(a100, spill_check=False))
    assert first.axis("n").tile == 16 and ptx.spill_bytes(first, "sm_80") > 0
    checked = schedule.derive(dnf, dataclasses.replace(a100, spill_check=True))
    assert checked.axis("n").tile == 8 and ptx.spill_bytes(checked, "sm_80") == 0


def test_a_case_only_refuses_is_neither_built_nor_derived(monkeypatch):
    """``only`` picks cases by label before their DNFs are built: a test or a report asking for
    some rows derives (and, with the spill check on, compiles) nothing else."""
    built, derived = [], []
    real_derive = schedule.derive_plan
    monkeypatch.setattr(schedule, "derive_plan", lambda dnf, m: derived.append(dnf.name) or real_derive(dnf, m))
    real_dnfs = gpu_report.score_mod_dnfs
    monkeypatch.setattr(gpu_report, "score_mod_dnfs", lambda *a, **k: built.append(a[0]) or real_dnfs(*a, **k))
    h200 = machines.load("h200")
    assert gpu_report.score_mod_cases(("float32",), targets=[h200], only=lambda label: False) == []
    assert gpu_report.training_cases(("float32",), targets=[h200], only=lambda label: False) == []
    assert gpu_report.model_training_cases(("float32",), targets=[h200], only=lambda label: False) == []
    assert built == [] and derived == []
    rows = gpu_report.score_mod_cases(("float32",), targets=[h200], only=lambda label: "softcap causal forward" in label)
    assert [r[0] for r in rows] == ["score_mod softcap causal forward float32 H=64"] and len(built) == len(derived) == 1
