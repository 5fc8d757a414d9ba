"""The general GPU scheduler (``schedule.derive``) on kernels other than plain attention.

A small shared-memory budget makes the scheduler take, at sizes the Pallas interpreter runs
in seconds, the choices it takes at realistic sizes on a real GPU (``moajax gpu-report``):
rows × columns tiles of a matmul, 2-D rows × keys tiles of a [B N T S] bias, the last output
axis tiled over the grid, a nested reduction walked in a loop inside the main loop. Each
ONF then runs (interpret mode) against float64 references written in numpy."""

import dataclasses

import jax
import numpy as np
import pytest

import references as R
from helpers import rel_err
from moajax import compat, cost, machines, runtime, schedule
from moajax import rewrites as W
from moajax import dnf as D
from moajax.kernels import logsumexp, rmsnorm, rmsnorm_matmul, swiglu
from moajax.kernels.attention import mha_dnf

# float64 end to end through tiled loops: a few ulps times the depth of the sum trees
F64 = 1e-12

# 16 KiB of shared memory; one multiprocessor, so that no split-K hides the tiling choices
TINY_GPU = dataclasses.replace(machines.load("delta-a100"), name="tiny-gpu", shared_memory_per_block=16384,
                               multiprocessors=1)
S = jax.ShapeDtypeStruct
f64 = np.float64


def _lse(x):
    m = x.max(axis=-1, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))[:, 0]


CASES = {
    "swiglu": (lambda: swiglu.dnf(S((16, 256), f64), S((256, 64), f64), S((256, 64), f64), S((64, 256), f64)),
               R.swiglu),
    "rmsnorm_matmul": (lambda: rmsnorm_matmul.dnf(S((32, 256), f64), S((256,), f64), S((256, 64), f64)),
                       lambda x, w, W: R.rmsnorm(x, w) @ W),
    "logsumexp": (lambda: logsumexp.dnf(S((64, 512), f64)), _lse),
    "mha_bias": (lambda: mha_dnf((1, 64, 2, 16), (1, 64, 2, 16), (1, 64, 2, 16), f64, bias_shape=(1, 2, 64, 64),
                                 bias_dtype=f64),
                 lambda q, k, v, b: R.mha(q, k, v, bias=b)),
}


def _axes(onf):
    return {a.name: (a.tile, a.role) for a in onf.axes}


@pytest.mark.parametrize("name", list(CASES))
def test_general_gpu_onfs_run_and_match_float64(name):
    import pallas_kernels

    make, ref = CASES[name]
    with compat.enable_x64_context(True):
        dnf = make()
        onf = schedule.derive(dnf, TINY_GPU)
        ax = _axes(onf)
        if name == "swiglu":  # last axis d over the grid; Z·W_g's Σ_d walked inside the Σ_f loop
            assert ax["d"][1] == "grid" and 1 < ax["d"][0] < 256
            assert ax["f"][1] == "sequential" and ax["d_"][1] == "sequential"
        elif name == "rmsnorm_matmul":  # rows × columns tiles: one tl.dot per step, not one row
            assert ax["n"] == (ax["n"][0], "grid") and ax["n"][0] >= 16 and ax["f"][1] == "grid"
        elif name == "logsumexp":  # the only output axis is tiled over the grid, m walked
            assert ax["n"][1] == "grid" and ax["n"][0] < 64 and ax["m"][1] == "sequential"
        else:  # a [B N T S] bias no longer forces one query row per program
            assert ax["t"][0] >= 16 and ax["s"][1] == "sequential"
        xs = [np.random.default_rng(7).standard_normal(i.shape) for i in dnf.inputs]
        got = pallas_kernels.lower(onf, interpret=True)(*xs)
    assert rel_err(got, ref(*xs)) <= F64


@pytest.mark.parametrize("profile", ["delta-a100", "delta-a40", "h200"])
@pytest.mark.parametrize("dtype,d", [("float32", 4096), ("float32", 8192), ("bfloat16", 8192)])
def test_a_wide_row_held_whole_takes_fewer_rows_a_program(profile, dtype, d):
    """RMSNorm alone over Llama's widths holds each row whole (its Σ_d and the row it scales).
    At 16 rows a program, Triton's dot minimum, x's tile alone is 256 KB at d = 4096 in float32:
    no GPU ONF fitted any profile, and the CUDA lowering ran the CPU's XLA loops. Fewer rows a
    program fit (``schedule.GPU_NARROW_ROWS``; ptxas: no spill, ``moajax gpu-report``)."""
    m = machines.load(profile)
    dt = np.dtype(dtype)
    onf = schedule.derive(rmsnorm.dnf(S((4096, d), dt), S((d,), dt)), m)
    ax = _axes(onf)
    assert ax["d"] == (d, "whole") and ax["n"][1] == "grid" and ax["n"][0] < 16, ax
    assert cost.onchip_bytes(onf) <= m.onchip_limit_bytes


def test_a_narrow_row_tile_runs_and_matches_float64():
    # 16 KiB: x's rows of 512 float64 (4 KiB each) beside the weight fit two a program; seven
    # rows leave a tail tile of one
    import pallas_kernels

    with compat.enable_x64_context(True):
        dnf = rmsnorm.dnf(S((7, 512), f64), S((512,), f64))
        onf = schedule.derive(dnf, TINY_GPU)
        assert _axes(onf)["n"] == (2, "grid")
        xs = [np.random.default_rng(5).standard_normal(i.shape) for i in dnf.inputs]
        got = pallas_kernels.lower(onf, interpret=True)(*xs)
    assert rel_err(got, R.rmsnorm(*xs)) <= F64


def test_a_row_wider_than_a_program_holds_is_split_over_programs():
    """A row that one program cannot hold even alone (16 KiB: a row of 2048 float64 and the
    weight are 32 KiB; RMSNorm over d = 16384 in float32 on the A40, 128 KB): its last axis goes
    over the grid, widest tile first, and each program walks the row's Σ_d x² in tiles
    (``schedule.GPU_SPLIT_ROWS``; the output's d and the sum's apart: ``separate_walks``). No
    GPU ONF fitted before, and the CUDA lowering ran the CPU's XLA loops. Run in interpret mode
    against float64, 1e-12; the A40's ONF fits its shared memory."""
    import pallas_kernels

    with compat.enable_x64_context(True):
        dnf = rmsnorm.dnf(S((3, 2048), f64), S((2048,), f64))
        onf = schedule.derive(dnf, TINY_GPU)
        ax = _axes(onf)
        assert ax["d"][1] == "grid" and 16 <= ax["d"][0] < 2048 and ax["d_"][1] == "sequential", ax
        assert cost.onchip_bytes(onf) <= TINY_GPU.onchip_limit_bytes
        xs = [np.random.default_rng(6).standard_normal(i.shape) for i in dnf.inputs]
        got = pallas_kernels.lower(onf, interpret=True)(*xs)
    assert rel_err(got, R.rmsnorm(*xs)) <= F64
    a40 = machines.load("delta-a40")
    onf = schedule.derive(rmsnorm.dnf(S((4096, 16384), np.float32), S((16384,), np.float32)), a40)
    assert _axes(onf)["d"] == (8192, "grid") and cost.onchip_bytes(onf) <= a40.onchip_limit_bytes


def test_a_fused_adjoint_that_recomputes_gives_way_to_the_owner_plan():
    """RMSNorm's adjoint reading the saved r (dX = (g⊙w − x̂·corr ÷ D) ÷ r with corr = Σ_d
    g⊙w⊙x̂, dW = Σ_n g⊙x̂): one kernel adds dW without atomics only with programs owning columns
    of d, and each then walks every row's corr over all of d — the A100's fused ONF at n = 1024,
    d = 64, by the cost model 2.7× the owner plan's two kernels (dX owning rows, dW columns). A
    GPU's derive_plan took it for having no atomics; it takes the plan the model times faster
    now. The plan runs (interpret mode) against float64, 1e-12."""
    a100 = machines.load("delta-a100")
    with compat.enable_x64_context(True):
        specs = [S((1024, 64), f64), S((64,), f64)]
        adj, args = rmsnorm.saved_adjoint(*specs)
        dnf = adj.dnf(*args)
        fused = schedule.derive(dnf, a100)
        assert not any(fused.scatter_var(st) for st in fused.program.stages)
        plan = schedule.derive_plan(dnf, a100)
        assert isinstance(plan, tuple) and [o.dnf.name.rsplit("_", 2)[-2:] for o in plan] == [["d", "x"], ["d", "weight"]]
        assert cost.sequence(cost.estimate(o, a100) for o in plan).time_s < cost.estimate(fused, a100).time_s
        assert _axes(plan[0])["d"] == (64, "whole")  # dX's programs own whole rows
        rng = np.random.default_rng(7)
        x, w, g = rng.standard_normal((1024, 64)), rng.standard_normal(64), rng.standard_normal((1024, 64))
        r = np.sqrt(np.mean(x * x, axis=-1) + 1e-6)
        env = {"x": x, "weight": w, "d_out": g, "saved0": r, "out": R.rmsnorm(x, w)}
        assert [i.name for i in dnf.inputs] == list(env)
        dx, dw = runtime.lowered(plan, "pallas_interpret", ("d_x", "d_weight"))(*env.values())
    rx, rw = R.rmsnorm_backward(x, w, g)
    assert rel_err(dx, rx) <= F64 and rel_err(dw, rw) <= F64


@pytest.mark.parametrize("profile", ["delta-a40", "delta-a100", "h200"])
def test_realistic_norm_and_mlp_gradients_take_the_owner_plan_on_a_gpu(profile):
    """At Llama's sizes the fused adjoints the model times slowest: RMSNorm's, reading the saved r,
    at n = d = 4096 in float32 (by the model 25 ms on the A40 against 0.7 for the owner plan),
    and SwiGLU's in bfloat16 at n = 4096, d = 1024, f = 4096 (28.6 ms on the H200, 64 programs
    owning tiles of d and walking n and f, against 0.45 for the owner plan, which stages U, V
    and G_H as the A40's did). RMSNorm's dX programs hold whole rows (``_rewalks_row``)."""
    m = machines.load(profile)
    f32, bf16 = np.float32, np.dtype("bfloat16")
    specs = [S((4096, 4096), f32), S((4096,), f32)]
    adj, args = rmsnorm.saved_adjoint(*specs)
    dnf = adj.dnf(*args)
    plan = schedule.derive_plan(dnf, m)
    assert isinstance(plan, tuple) and len(plan) == 2
    assert cost.sequence(cost.estimate(o, m) for o in plan).time_s * 10 < cost.estimate(schedule.derive(dnf, m), m).time_s
    assert _axes(plan[0])["d"] == (4096, "whole")
    sp = [S((4096, 1024), bf16), S((1024, 4096), bf16), S((1024, 4096), bf16), S((4096, 1024), bf16)]
    plan = schedule.derive_plan(swiglu.adjoint(*sp).dnf(*sp, S((4096, 1024), bf16)), m)
    assert isinstance(plan, tuple) and len(plan) == 4  # U, V, G_H staged; dZ; dW_g with dW_u; dW_d


def test_a_row_statistic_walked_beside_column_tiles_keeps_the_rows_whole():
    """RMSNorm's recomputing adjoint on the A40 at n = d = 4096 in float32: r is staged by a first
    kernel, and dX's program walks corr = Σ_d1 g⊙w⊙x over the row. With programs owning 128
    columns of d (the A40's choice before), each walked the whole row again: 32 reads of x and
    g a row, through L2, which the cost model does not charge. The rows are held whole now."""
    f32 = np.float32
    specs = [S((4096, 4096), f32), S((4096,), f32)]
    plan = schedule.derive_plan(rmsnorm.adjoint(*specs).dnf(*specs, S((4096, 4096), f32)), machines.load("delta-a40"))
    (dx,) = [o for o in plan if o.dnf.name.endswith("d_x")]
    assert _axes(dx)["d"] == (4096, "whole") and dx.axis("n").role == "grid", _axes(dx)


def test_a_wide_nested_reduction_is_walked_even_where_it_fits():
    # held whole, SwiGLU's Σ_d over d = 1024 fits the H200's shared memory but spills
    # registers (8800 B of spill stores under ptxas): the scheduler walks it
    dnf = swiglu.dnf(S((4096, 1024), np.float32), S((1024, 4096), np.float32), S((1024, 4096), np.float32),
                     S((4096, 1024), np.float32))
    onf = schedule.derive(dnf, machines.load("h200"))
    assert onf.axis("d_").role == "sequential" and onf.axis("d_").tile <= schedule.GPU_WHOLE_MAX


@pytest.mark.parametrize("profile", ["delta-a100", "h200"])
def test_a_tiled_output_axis_takes_the_candidates_of_its_tile(profile):
    """RMSNorm→matmul in bfloat16 at n = 4096, d = 1024, f = 4096: f, the last output axis, is
    tiled over the grid (128 columns), so a program holds 128 columns, not 4096, and the
    tables' candidates are those for 128: 128 rows × 128 columns, the d walk 64 wide — a GEMM's
    tile. The scheduler once looked the candidates up by f's whole extent and took the
    fallback for widths over 128: 32 × 128 tiles and a 16-wide walk (four times the reads per
    flop, and on sm_90a 32-row dots, which Hopper's wgmma does not take)."""
    bf16 = np.dtype("bfloat16")
    dnf = rmsnorm_matmul.dnf(S((4096, 1024), bf16), S((1024,), bf16), S((1024, 4096), bf16))
    ax = _axes(schedule.derive(dnf, machines.load(profile)))
    assert ax["n"] == (128, "grid") and ax["f"] == (128, "grid") and ax["d"] == (64, "sequential"), ax


def test_cpu_schedules_are_unchanged_by_the_gpu_row_rule():
    # on a CPU, a read that depends on t keeps t from being the row loop (XLA vectorises it)
    dnf = mha_dnf((1, 64, 2, 16), (1, 64, 2, 16), (1, 64, 2, 16), np.float32, bias_shape=(1, 2, 64, 64),
                  bias_dtype=np.float32)
    cpu = schedule.derive(dnf, machines.load("delta-epyc-7763"))
    assert not cpu.knobs.cpu_loop


def test_decode_splits_the_cache_walk_when_programs_are_too_few():
    """One query over a long cache is one program: split-K cuts the walk into parts (grid
    programs, partial max/sum/accumulator each), then the monoid combine; float64-exact."""
    import pallas_kernels
    from moajax.kernels import decode

    # eight multiprocessors and free launches: at this size the cost model's only term that
    # split-K changes much is the seven idle multiprocessors
    eight_sms = dataclasses.replace(TINY_GPU, multiprocessors=8, launch_overhead_us=0.0)
    with compat.enable_x64_context(True):
        dnf = decode.dnf(S((16,), f64), S((1024, 16), f64), S((1024, 8), f64))
        onf = schedule.derive(dnf, eight_sms)
        parts = onf.axis("s_o")
        assert parts.role == "grid" and 2 <= parts.extent <= 16
        assert onf.axis("s_i").role == "sequential"
        assert onf.axis("s_i").ntiles >= schedule.SPLIT_MIN_TILES
        xs = [np.random.default_rng(3).standard_normal(i.shape) for i in dnf.inputs]
        got = pallas_kernels.lower(onf, interpret=True)(*xs)
        # enough programs already (or a preset's own tiles): no split
        assert "s_o" not in _axes(schedule.derive(dnf, TINY_GPU))
        assert "s_o" not in _axes(schedule.derive(dnf, eight_sms, tiles={"s": 16}))
    assert rel_err(got, R.decode(*xs)) <= F64


def _table_adjoint_dnf(entries: int):
    """The saved adjoint's DNF of causal attention (B=1, T=S=1024, 8 heads of 64, float32)
    with a relative-position table of ``entries`` (odd): score + table[clip(q − k) + R/2]."""
    import jax.numpy as jnp

    from moajax.api import _check_score_mod
    from moajax.kernels.attention import mha_kernel

    half = entries // 2
    table = jnp.asarray(np.linspace(-1.0, 1.0, entries), jnp.float32)
    mod = _check_score_mod(lambda s, b, h, qi, ki: s + table[jnp.clip(qi - ki, -half, half) + half],
                           np.dtype(np.float32))
    kern = mha_kernel(None, None, False, False, False, mod)
    specs = [S((1, 1024, 8, 64), np.float32)] * 3 + [S((entries,), np.float32)]
    adj, args = kern.saved_adjoint(*specs, is_causal=True)
    return adj.dnf(*args, is_causal=True)


def test_a_table_gradient_is_split_over_its_heads_then_its_keys_to_fill_the_gpu():
    """A relative-position table's gradient Σ_n Σ_s Σ_t ((c = i(t, s)) ? dS : 0) on the A100
    (the gpu-report's case: T = S = 1024, 8 heads): programs over a few table entries each,
    walking every score, are too few; split-K cuts the stage's own walk, the heads, into 8
    grid parts first (never bringing up a nested Σ when the top one can be cut), and, the
    2 × 8 programs still short of the 108 multiprocessors, the outermost nested walk next —
    the keys around the queries — until the programs fill the machine. The nested walks'
    score tile is at most the attention table's keys wide (32 in float32 at H = 64). (Split
    ONFs of a table's gradient run against the reference on both backends in test_rewrites.)"""
    dnf = _table_adjoint_dnf(33)
    (sub,) = schedule.split_outputs(dnf, [(dnf.outputs[-1].name,)])
    a100 = machines.load("delta-a100")
    onf = schedule.derive(sub, a100)
    cuts = [h for h in onf.history if h.startswith("split_k(")]
    assert cuts[0] == "split_k(n_kv, 8)" and cuts[1].startswith("split_k(s, ") and len(cuts) == 2
    programs = int(np.prod([a.ntiles for a in onf.axes if a.role == "grid"]))
    assert a100.multiprocessors <= programs <= 2 * a100.multiprocessors  # 2 × 8 before the keys' cut
    assert onf.axis("s_i").tile <= 32 and onf.axis("t").tile <= 32


def test_the_table_adjoints_plan_is_owner_though_a_fused_schedule_fits():
    """The adjoint with a relative-position table on the A100: the fused schedule of all four
    outputs fits shared memory since its programs own the heads beside the query tiles and
    scatter-add the table's partials over both (``ONF.scatter_vars``: t n; before, holding the
    heads whole, none fitted). It scatter-adds, so a GPU's plan is still the owner plan — dK
    and dV in one kernel sharing P per tile, as without a score_mod — not a kernel per output
    (which recomputed P for dV), and no kernel of it scatter-adds."""
    dnf = _table_adjoint_dnf(33)
    a100 = machines.load("delta-a100")
    fused = schedule.derive(dnf, a100)
    table = fused.program.stage_of(dict(fused.program.outputs)["d_score_mod_const0"])
    assert [v.name for v in fused.scatter_vars(table)] == ["t", "n"]
    plan = schedule.derive_plan(dnf, a100)
    assert [o.dnf.name[len(dnf.name) + 1:] for o in plan] == ["d_query", "d_key_d_value", "d_score_mod_const0"]
    assert not any(o.scatter_var(st) is not None for o in plan for st in o.program.stages)


def test_where_the_owner_kernels_do_not_fit_either_the_plan_is_one_kernel_per_output():
    """The no-fit fallback's last step: on an A100 profile with 40 KB of shared memory per
    block, neither the fused adjoint of causal attention nor the owner plan's dK-with-dV
    kernel fits (48 KB holds the latter), so each output is its own kernel; each fits."""
    from moajax import cost
    from moajax.kernels.attention import mha_kernel

    kern = mha_kernel(None, None, False)
    specs = [S((1, 1024, 8, 64), np.float32)] * 3
    adj, args = kern.saved_adjoint(*specs, is_causal=True)
    dnf = adj.dnf(*args, is_causal=True)
    a100 = machines.load("delta-a100")
    for kb, want in ((48, ["d_query", "d_key_d_value"]), (40, ["d_query", "d_key", "d_value"])):
        small = dataclasses.replace(a100, shared_memory_per_block=kb * 1024)
        plan = schedule.derive_plan(dnf, small)
        assert [o.dnf.name[len(dnf.name) + 1:] for o in plan] == want, kb
        assert all(cost.onchip_bytes(o) <= small.onchip_limit_bytes for o in plan)


def test_swiglus_adjoint_at_a_realistic_size_runs_the_staged_owner_plan_on_a_gpu():
    """SwiGLU's adjoint at n = 4096, d = 1024, f = 4096 on the A100: no fused schedule of its
    four outputs fits; the owner plan's staged first kernel computes U, V and G_H [n f] once
    (``staged_parts``) and dZ, dW_g with dW_u, and dW_d read them — not four kernels each
    recomputing them."""
    from moajax.kernels.mlp import swiglu
    from moajax.onf import ONFError

    n, d, f = 4096, 1024, 4096
    specs = [S((n, d), np.float32), S((d, f), np.float32), S((d, f), np.float32), S((f, d), np.float32)]
    dnf = swiglu.adjoint(*specs).dnf(*specs, S((n, d), np.float32))
    a100 = machines.load("delta-a100")
    with pytest.raises(ONFError, match="on-chip footprint"):
        schedule.derive(dnf, a100)
    plan = schedule.derive_plan(dnf, a100)
    assert [o.dnf.name[len(dnf.name):] for o in plan] == ["_shared", "_d_z", "_d_w_gate_d_w_up", "_d_w_down"]
    staged = {o.name for o in plan[0].dnf.outputs}
    assert len(staged) == 3 and all(staged <= {i.name for i in o.dnf.inputs} for o in plan[1:3])


def test_nesting_and_nested_walks():
    """``_nesting``: how many reductions enclose the outermost Σ over v (a shared subtree
    reached at several depths counts at its shallowest); ``_nested_walks``: the wide walks
    one inside another (Σ_s Σ_t), not a lone one."""
    from moajax.ix import Var
    from moajax.onf import initial

    t, s, h = Var("t", 8), Var("s", 8), Var("h", 4)
    inner = D.Red("add", h, D.Read("x", (t, s, h), np.dtype(np.float64)))
    deep = D.Red("add", t, D.Red("add", s, inner))
    assert schedule._nesting(deep, h) == 2 and schedule._nesting(deep, s) == 1 and schedule._nesting(deep, t) == 0
    shared = D.Call("add", (inner, D.Red("add", t, D.Red("add", s, inner))))  # inner at depths 0 and 2
    assert schedule._nesting(shared, h) == 0
    assert schedule._nesting(deep, Var("z", 3)) == 1 << 20
    dnf = D.DNF("nest", (D.InputSpec("x", (8, 8, 4), ("t", "s", "h"), np.dtype(np.float64)),),
                (D.Output("y", (), (), (), deep),))
    onf = initial(dnf)
    assert schedule._nested_walks(onf, [t, s]) == {t, s}
    assert schedule._nested_walks(onf, [t]) == set()
    assert schedule._nested_walks(onf, [t, h]) == {t, h}


def test_a_table_gradient_on_the_cpu_is_its_own_tiled_kernel():
    """On the CPU the adjoint with a relative-position table runs the owner plan — dQ, dK with
    dV, the table's gradient — not one program walking every output (``accumulate`` finds the
    queries' Σ under the table's Σ_n through ``sum_to_top``); the table's kernel walks s and t
    in tiles (not [t, s] whole: O(T·S) memory) with dS's two terms in one walk (fuse_sums)."""
    dnf = _table_adjoint_dnf(9)
    plan = schedule.derive_plan(dnf, machines.load("delta-epyc-7763"))
    names = [o.dnf.name[len(dnf.name) + 1:] for o in plan]
    assert names == ["d_query", "d_key_d_value", "d_score_mod_const0"]
    table_onf = plan[-1]
    assert "fuse_sums" in table_onf.history
    # its statistics are saved, and the table's read at clip(t − s) is a gather, not a statistic
    # of the rows: the walks keep their order (``rewrites.row_walks_out``)
    assert "row_walks_out" not in table_onf.history
    assert table_onf.axis("s").role == table_onf.axis("t").role == "sequential"
    assert table_onf.axis("s").tile < 1024 and table_onf.axis("t").tile < 1024
    (body,) = table_onf.program.exprs()
    assert sum(isinstance(x, D.Red) and x.var.name == "s" for x in D.walk(body)) == 1


def test_alibi_slopes_gradient_on_the_cpu_walks_the_scores_once():
    """ALiBi's slopes' gradient Σ_n ((c = n) ? Σ_s Σ_t dS·|t − s| : 0), dS's two terms each under
    the head's one-hot write: on a CPU one walk of the scores (``fuse_sums`` through the guard),
    where two walks recomputed every score tile twice (alibi_grad_cpu.md: jit(grad) 1.02–1.21×
    faster); a GPU keeps them apart (fuse_sums is a CPU default: fuse_sums_gpu.md)."""
    import jax.numpy as jnp

    from moajax.api import _check_score_mod
    from moajax.kernels.attention import mha_kernel

    slopes = jnp.asarray(2.0 ** -np.arange(1, 9), jnp.float32)
    mod = _check_score_mod(lambda s, b, h, qi, ki: s - slopes[h] * jnp.abs(qi - ki), np.dtype(np.float32))
    kern = mha_kernel(None, None, False, False, False, mod)
    specs = [S((1, 1024, 8, 64), np.float32)] * 3 + [S((8,), np.float32)]
    adj, args = kern.saved_adjoint(*specs)
    dnf = adj.dnf(*args)
    plan = schedule.derive_plan(dnf, machines.load("delta-epyc-7763"))
    slopes_onf = plan[-1]
    assert slopes_onf.dnf.name.endswith("d_score_mod_const0") and "fuse_sums" in slopes_onf.history, slopes_onf
    (body,) = slopes_onf.program.exprs()
    assert sum(isinstance(x, D.Red) and x.var.name == "s" for x in D.walk(body)) == 1, slopes_onf
    gpu = schedule.derive_plan(dnf, machines.load("delta-a100"))
    assert all("fuse_sums" not in o.history for o in (gpu if isinstance(gpu, tuple) else (gpu,)))


def test_gqa_dk_dv_on_the_cpu_walks_the_queries_with_the_group_inside():
    """GQA's dK = Σ_g Σ_t … (the query heads of a kv head around the queries): on a CPU the long
    Σ_t goes outside the short Σ_g (``rewrites.long_sums_out``) and is walked in tiles, as
    MHA's; held whole under Σ_g it materialised [s, t, g] scores (1084 MiB of temp at S = 4096:
    attention_grad_gqa_cpu.md). Float64 gradients against the reference, 1e-10. A GPU keeps Σ_g Σ_t
    (its programs run the group element by element around the walk)."""
    import jax.numpy as jnp

    import moajax
    from moajax.kernels.attention import mha_kernel

    specs = [S(sh, np.float32) for sh in [(1, 1024, 8, 64), (1, 1024, 2, 64), (1, 1024, 2, 64)]]
    adj, args = mha_kernel(None, None, True).saved_adjoint(*specs)
    dkv = next(o for o in adj.onf(*args) if o.dnf.name.endswith("d_key_d_value"))
    assert "long_sums_out" in dkv.history and dkv.axis("t").role == "sequential" and dkv.axis("t").tile < 1024
    for body in dkv.program.exprs():
        top = body
        while isinstance(top, D.Tag):
            top = top.body
        assert isinstance(top, D.Red) and top.var.name == "t", D.show(body)
    gpu = schedule.derive_plan(adj.dnf(*args), machines.load("delta-a100"))
    assert not any("long_sums_out" in o.history for o in (gpu if isinstance(gpu, tuple) else (gpu,)))
    r = np.random.default_rng(5)
    q, g = r.standard_normal((1, 300, 4, 8)), r.standard_normal((1, 300, 4, 8))  # 300 queries: Σ_t walked
    k, v = r.standard_normal((1, 40, 2, 8)), r.standard_normal((1, 40, 2, 8))
    for causal in (False, True):
        loss = lambda q, k, v: jnp.sum(moajax.dot_product_attention(q, k, v, is_causal=causal) * g)  # noqa: E731
        got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
        for a, b in zip(got, R.mha_backward(q, k, v, g, is_causal=causal)):
            assert rel_err(a, b) <= 1e-10


@pytest.mark.parametrize("machine", ["delta-a100", "local"])
def test_a_saving_forward_owns_query_rows_not_the_batch(machine):
    # the saving forward (Out with its row max and sum: outputs over different variables) is
    # scheduled by the scatter rule; its programs own tiles of t, which K and V do not depend on,
    # not of the batch b that every read depends on (B=2 made b the owner, one query per program)
    from moajax.kernels.attention import mha_kernel

    m = machines.load(machine) if machine != "local" else machines.local()
    q, k = S((2, 256, 4, 64), np.float32), S((2, 256, 2, 64), np.float32)
    for lengths in [(False, False), (True, True)]:
        kern = mha_kernel(None, None, True, *lengths)
        extra = [S((2,), np.int32) for flag in lengths if flag]
        plan = schedule.derive_plan(kern.with_row_statistics().dnf(q, k, k, *extra), m)
        onf = plan[0] if isinstance(plan, tuple) else plan
        assert onf.axis("t").tile > 1 and onf.axis("b").tile == 1, onf


def test_gpu_tables_and_16_bit_dots_go_by_the_kernels_own_floating_outputs():
    """A GPU ONF's tile table and ``lowp_dots`` go by the kernel's floating outputs, less a
    saving forward's statistics (``dnf.is_saved_statistic``): a bool output beside a float32
    one derives (its 1-byte width is no table's); a float32 output beside a bfloat16 one keeps
    float32 dots (16-bit dots would round the float32 output's operands: 3.0e-7 → 2.1e-3 on
    SwiGLU's F, found in review)."""
    import jax.numpy as jnp

    import moajax
    from moajax import compat, machines, moa
    from moajax.dnf import is_saved_statistic
    from moajax.kernels import swiglu_forward_backward

    @moajax.kernel(example=dict(n=64, d=32), register=False)
    def square_sum_and_sign(x: "n d"):
        return moa.sum(x * x, axis=-1), x > 0

    h200 = machines.load("h200")
    onf = schedule.derive_plan(square_sum_and_sign.dnf(jax.ShapeDtypeStruct((64, 32), jnp.float32)), h200)
    assert not onf.knobs.lowp_dots
    specs = [jax.ShapeDtypeStruct(s, t) for s, t in (((64, 32), jnp.float32), ((32, 48), jnp.float32),
                                                     ((32, 48), jnp.float32), ((48, 32), jnp.bfloat16),
                                                     ((64, 32), jnp.float32))]
    with compat.enable_x64_context(True):
        mixed = swiglu_forward_backward.dnf(*specs)
    assert [str(o.dtype) for o in mixed.outputs][-1] == "bfloat16"
    assert not schedule.derive(mixed, h200).knobs.lowp_dots
    assert [is_saved_statistic(n) for n in ("saved0", "saved12", "saved2_0", "saved", "out", "saved_x")] == [
        True, True, True, False, False, False]


def test_a_vmaps_summed_batch_around_the_keys_is_laid_out_as_a_batch():
    """jax.grad of causal attention over the query a vmap shares: dQ = Σ_b Σ_s dS[b t s] ×
    K[b s h], the summed batch walked around the keys (``Program.batch_walks``: K is read
    along b and s, the query along neither). On a CPU the queries are still its row tiles
    (the reads along s share them) and b is laid out with the batch-like axes, before t
    (``tiles.ranges.var_order``): laid out after them, its [t, n, b, s] scores were
    transposed twice and the call ran at 0.72× the same call on broadcast queries
    (vmap_grad_cpu.md). The forward's Σ_s over short keys around a wider Σ_h is no batch: the
    query is read along h, not s."""
    from moajax.kernels.attention import mha_kernel
    from moajax.tiles import var_order

    kern = mha_kernel(None, None, False)
    one = S((1, 128, 4, 64), np.float32)
    _, args = kern.saved_adjoint(one, one, one, is_causal=True)
    adj = kern.adjoint(one, one, one, wrt=("query",), saved=True, is_causal=True)
    flags = (False,) + (True,) * (len(args) - 1)
    batched = [S((8,) + tuple(a.shape), a.dtype) if f else a for a, f in zip(args, flags)]
    (onf,) = [adj.batched(flags, summed=(0,)).onf(*batched, is_causal=True)]
    (b,) = onf.program.batch_walks()
    assert onf.knobs.cpu_batches == (b.name,)
    assert b.extent == 8 and onf.axis("t").role == "grid" and onf.axis("t").tile == 128, onf
    order = var_order(onf)
    assert order[b.name] < order["t"] < order["s"], order
    # a layout hint: where it holds no longer (a rewrite, a name that is no batch walk), unused
    stale = W.with_knobs(onf, cpu_batches=()).axis_order()
    assert W.with_knobs(onf, cpu_batches=("t", "s")).axis_order() == stale
    gpu = schedule.derive(adj.batched(flags, summed=(0,)).dnf(*batched, is_causal=True), machines.load("delta-a100"))
    assert all(not o.knobs.cpu_batches for o in (gpu if isinstance(gpu, tuple) else (gpu,)))
    short = S((1, 16, 2, 64), np.float32)
    fwd = kern.onf(short, short, short)
    assert not fwd.program.batch_walks(), fwd


def test_a_dots_batch_axis_held_whole_is_laid_out_before_the_rows():
    """The Δ kernel of attention's backward that recomputes it (residuals "recompute"): Δ[t n] from
    S = Σ_h Q[t n h] × K[s n h] and dP = Σ_e dO[t n e] × V[s n e], the heads n held whole, t
    one grid tile, s walked. n is the dots' batch (``Program.dot_batches``: read by both
    factors of each, t and s by one), so on a CPU it is laid out first (``cpu_batches``):
    after [t, s] every score tile was transposed from the dot's [n, s, t], and jit(grad) at
    T = S = 1024 ran 1.44–1.53× slower (cpu_dot_batches_cpu.md). Where the batch is first anyway
    (RMSNorm's Σ_d x[n d]²) no knob is set; a GPU's schedule never sets it."""
    from moajax.kernels.attention import mha_kernel
    from moajax.kernels.norm import rmsnorm as norm
    from moajax.tiles import var_order

    kern = mha_kernel(None, None, False)
    x = S((1, 1024, 4, 32), np.float32)
    adj = kern._adjoint_for(kern._key([x] * 3, {}), {}, False, rounded=False)
    dnf = adj.dnf(x, x, x, x)
    plan = schedule.derive_plan(dnf, machines.load("anvil-epyc-7543"))
    (delta,) = [o for o in plan if o.knobs.cpu_batches]
    assert delta.knobs.cpu_batches == ("n",) and {v.name for v in delta.program.dot_batches()} == {"n"}, delta
    assert delta.axis("t").role == "grid" and delta.axis("n").role == "whole", delta
    assert delta.axis("s").role == "sequential", delta
    order = var_order(delta)
    assert order["n"] < order["t"] < order["s"], order
    old = var_order(W.with_knobs(delta, cpu_batches=()))
    assert old["t"] < old["s"] < old["n"], (old, delta)  # (what it was)
    # the other kernels own n in grid tiles of one: batch-like already
    assert all(o.axis("n").role == "grid" and o.axis("n").tile == 1 for o in plan if o is not delta)
    r = S((64, 512), np.float32)
    sq = [o for o in schedule.derive_plan(norm.adjoint(r, S((512,), np.float32)).dnf(r, S((512,), np.float32), r),
                                          machines.load("anvil-epyc-7543"))]
    assert any({v.name for v in o.program.dot_batches()} == {"n"} for o in sq)
    assert not any(o.knobs.cpu_batches for o in sq)
    gpu = schedule.derive_plan(dnf, machines.load("delta-a100"))
    assert all(not o.knobs.cpu_batches for o in (gpu if isinstance(gpu, tuple) else (gpu,)))


def test_a_cpu_program_walking_nothing_keeps_the_outputs_axis_order():
    """RMSNorm's fused adjoint on a CPU: programs own d (dX[n d] and dW[d], no atomics), one
    tile of it, and walk nothing in tiles; XLA vectorises the whole program, so its arrays keep
    the outputs' order [n, d] (the knob ``cpu_vectorised``, ``ONF.axis_order``), where the grid's
    d first made every array [d, n]: x, dO and dX transposed, a 3.7–5.0× slower gradient
    (cpu_order_cpu.md). A program that walks in tiles keeps the groups' order; the knob beside
    a walk takes no effect; a GPU's schedule never sets it."""
    from moajax.kernels.norm import rmsnorm as kern

    specs = (S((256, 4096), np.float32), S((4096,), np.float32))
    adj, args = kern.saved_adjoint(*specs)
    onf = adj.onf(*args)
    onf = onf if not isinstance(onf, tuple) else next(o for o in onf if any(x.name == "d_x" for x in o.dnf.outputs))
    assert onf.knobs.cpu_vectorised and not any(a.role == "sequential" for a in onf.axes), onf
    order = onf.axis_order()
    assert order["n"] < order["d"], order
    assert onf.axis_order(vectorised=False)["d"] < onf.axis_order(vectorised=False)["n"]
    walked = schedule.derive(mha_dnf((1, 1024, 2, 16), (1, 1024, 2, 16), (1, 1024, 2, 16), np.float32),
                             machines.load("delta-epyc-7763"))
    assert any(a.role == "sequential" for a in walked.axes) and not walked.knobs.cpu_vectorised
    assert W.with_knobs(walked, cpu_vectorised=True).axis_order() == walked.axis_order()  # (beside a walk: unused)
    gpu = schedule.derive_plan(adj.dnf(*args), machines.load("delta-a100"))
    assert all(not o.knobs.cpu_vectorised for o in (gpu if isinstance(gpu, tuple) else (gpu,)))
    # attention's adjoint at 128 keys owns them whole, walking nothing: its grid's s is no
    # output's last axis, so it keeps its place ([s, t] scores; [t, s] was 0.87× as fast)
    from moajax.kernels.attention import mha_kernel

    one = S((1, 128, 8, 64), np.float32)
    att, att_args = mha_kernel(None, None, False).saved_adjoint(one, one, one, is_causal=True)
    for o in (lambda x: x if isinstance(x, tuple) else (x,))(att.onf(*att_args, is_causal=True)):
        assert not o.knobs.cpu_vectorised, o


def test_a_cpu_walk_of_a_map_is_held_whole_and_a_contraction_is_not():
    """On a CPU a walk whose sum is a map over one read's points (RMSNorm's dX: Σ_d1 dO[n d1]
    × w[d1] × x[n d1]) is held whole — XLA fuses it into one reduce; walked, each step slices
    every operand — in the scatter schedules too (its saving forward walked Σ_d x²). A sum of a
    product of reads over different axes is a contraction (the MLP's dZ = Σ_f …[n f] × W[d f]):
    held whole, its [n, f] factor was materialised — the block's gradient at 266.3 MiB of temp
    where 215.2 (model_cpu.md) — so it stays walked."""
    from moajax.kernels.mlp import swiglu
    from moajax.kernels.norm import rmsnorm as kern

    x, w = S((4096, 512), np.float32), S((512,), np.float32)
    saving = kern.with_row_statistics(()).onf(x, w)
    assert saving.axis_of(next(v for v in saving.program.vars() if v.name == "d")).role == "whole", saving
    dx = next(o for o in (lambda a: a if isinstance(a, tuple) else (a,))(kern.adjoint(x, w).onf(x, w, x))
              if any(out.name == "d_x" for out in o.dnf.outputs))
    assert all(a.role != "sequential" for a in dx.axes), dx
    z, wg, wd = S((4096, 512), np.float32), S((512, 1408), np.float32), S((1408, 512), np.float32)
    onfs = swiglu.adjoint(z, wg, wg, wd).onf(z, wg, wg, wd, z)
    dz = next(o for o in (onfs if isinstance(onfs, tuple) else (onfs,)) if any(out.name == "d_z" for out in o.dnf.outputs))
    assert dz.axis("f").role == "sequential", dz
