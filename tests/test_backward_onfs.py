"""The seed's backward ONFs (REFERENCE.md §5) as plans of the derived adjoint's outputs, chosen
with ``Preset.of(backward=...)``: "atomic" (one kernel, dK and dV scatter-added), "split" (dV
in a kernel owning key tiles, dK still scatter-added) and "owner" (no atomics; the GPU
default). Each runs under ``jax.grad`` against the independent float64 reference, on XLA and
Pallas-interpret; the cost model counts their atomics and ptxas their atom instructions.

Tolerance: float64 rel ≤ 1e-12 (the loops and the reference sum ≤ 64 terms in other orders)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import pytest

import moajax
import references as R
from helpers import rel_err, scaled_err, score_mod_grads_f64, sub_jaxprs, walk_eqns
from hypothesis import given, settings
from hypothesis import strategies as st
from moajax import compat, cost, machines, ptx, rewrites, schedule
from moajax.kernels.attention import mha_kernel
from moajax.onf import ONFError
from moajax.schedule import Preset

F64 = 1e-12
REASON = ptx.toolchain_missing()
needs_compiler = pytest.mark.skipif(REASON is not None, reason=f"offline GPU toolchain unavailable: {REASON}")
A100 = machines.load("delta-a100")


def _args(K, seed):
    r = np.random.default_rng(seed)
    return [r.standard_normal(s) for s in [(2, 40, 4, 8), (2, 40, K, 8), (2, 40, K, 8), (2, 40, 4, 8)]]


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
@pytest.mark.parametrize("backward", ["atomic", "split", "owner"])
@pytest.mark.parametrize("K", [4, 2])
def test_each_backward_onf_gives_the_gradient(backward, K, impl):
    q, k, v, g = _args(K, 1)
    bias = np.random.default_rng(2).standard_normal((2, 4, 40, 40))
    pre = Preset.of(backward=backward)

    def loss(q, k, v, bias):
        return jnp.sum(moajax.dot_product_attention(q, k, v, bias, is_causal=True, onf=pre, implementation=impl) * g)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)
    for a, b in zip(grads, R.mha_backward(q, k, v, g, bias=bias, is_causal=True, return_dbias=True)):
        assert rel_err(a, b) <= F64


def _seed_adjoint_dnf():
    """The adjoint jax.grad runs at the seed's setting: float64, n = 2048, d = 64, one head."""
    specs = [jax.ShapeDtypeStruct((1, 2048, 1, 64), np.float64)] * 3
    with compat.enable_x64_context(True):
        adj, args = mha_kernel(None, None, False).saved_adjoint(*specs)
        return adj.dnf(*args)


def _plan(dnf, plan):
    p = schedule.derive_plan(dnf, A100, Preset.of(plan=plan))
    return p if isinstance(p, tuple) else (p,)


@pytest.mark.parametrize("backward", ["fused", (("d_query", "d_key"), ("d_value",)), "owner"], ids=["atomic", "split", "owner"])
@pytest.mark.parametrize("profile", ["delta-a100", "h200"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_gqa_plans_walk_the_queries_with_the_group_inside(backward, profile, dtype):
    """GQA's dK, dV = Σ_g Σ_t …: a plan's kernels own the queries or walk them in tiles,
    the query heads of a kv head taken one at a time around that walk; none holds the queries
    whole inside the group. Held whole, causal T = 200 (padded to 256) in bfloat16 took 836 KB
    per program, over the H200's 227 KB: derivation refused the atomic and split plans on the
    first H200 run (bench/results/gpu_check_h200.md); in float64, programs owning query tiles
    hold the group whole in each (354.5 KB), and programs owning key tiles are taken instead.
    Every kernel of each plan now fits."""
    machine = machines.load(profile)
    specs = [jax.ShapeDtypeStruct(s, dtype) for s in [(1, 200, 8, 64), (1, 333, 2, 64), (1, 333, 2, 64)]]
    with compat.enable_x64_context(True):
        adj, args = mha_kernel(None, None, True).saved_adjoint(*specs)
        dnf = adj.dnf(*args)
    plan = schedule.derive_plan(dnf, machine, Preset.of(plan=backward))
    for onf in plan if isinstance(plan, tuple) else (plan,):
        assert cost.onchip_bytes(onf) <= machine.onchip_limit_bytes, onf.pretty()
        assert all(a.role != "whole" for a in onf.axes if a.name == "t"), onf.pretty()  # walked or owned


@pytest.mark.parametrize("profile", ["delta-a100", "h200"])
def test_gqa_dk_dv_takes_the_tiles_of_plain_heads(profile):
    """The owner plan's dK/dV kernel at S = T = 4096, bfloat16: with 4 query heads per kv head
    it walks the group one head at a time and takes the same key and query tiles, warps and
    stages as without groups (the table's candidates for what stays held, not for the queries
    held whole: those gave 32 × 16). The tables', that is: a profile's own measured tilings
    (``Machine.gpu_tiles``: the H200's 64 × 64 with 4 warps for the plain heads' kernel) are
    left out here, and the walked schedule has none (``test_a_profiles_own_tilings_come_first``)."""
    import dataclasses

    machine = dataclasses.replace(machines.load(profile), spill_check=False, gpu_tiles={})
    tiles = {}
    for K, grouped in ((2, True), (8, False)):
        specs = [jax.ShapeDtypeStruct((1, 4096, 8, 64), jnp.bfloat16)] + [
            jax.ShapeDtypeStruct((1, 4096, K, 64), jnp.bfloat16)] * 2
        with compat.enable_x64_context(True):
            adj, args = mha_kernel(None, None, grouped).saved_adjoint(*specs)
            plan = schedule.derive_plan(adj.dnf(*args), machine, Preset.of(plan="owner"))
        (dkv,) = [o for o in plan if "d_key" in o.dnf.name]
        tiles[K] = ({a.name: (a.tile, a.role) for a in dkv.axes if a.name in ("s", "t")}, dkv.knobs)
        if grouped:
            assert dkv.axis("g").tile == 1 and dkv.axis("g").role == "sequential", dkv.pretty()
    assert tiles[2] == tiles[8]


@pytest.mark.parametrize("backward", ["atomic", "split", "owner"])
def test_gqa_plans_over_long_query_walks_give_the_gradient(backward):
    """The plans of the test above run (Pallas interpret, the default GPU profile's ONFs) and
    give the gradient: causal GQA, T = 200 (past the 128 a program holds whole), bfloat16.
    Tolerance 2e-2 relative to the largest entry: bfloat16 inputs, P and dS cast to bfloat16
    for the dots (``lowp_dots``), and bfloat16 outputs (the H200 measured 3–5e-3 on such
    cases: gpu_check_h200.md, section 2)."""
    r = np.random.default_rng(3)
    q, g = (jnp.asarray(r.standard_normal((1, 200, 4, 64)), jnp.bfloat16) for _ in range(2))
    k, v = (jnp.asarray(r.standard_normal((1, 333, 2, 64)), jnp.bfloat16) for _ in range(2))
    f = jax.jit(jax.grad(lambda a, b, c: jnp.sum((moajax.dot_product_attention(
        a, b, c, is_causal=True, onf=Preset.of(backward=backward), implementation="pallas_interpret") * g
    ).astype(jnp.float32)), argnums=(0, 1, 2)))
    want = R.mha_backward(*(np.asarray(x.astype(jnp.float64)) for x in (q, k, v, g)), is_causal=True)
    for got, w in zip(f(q, k, v), want):
        assert np.max(np.abs(np.asarray(got, np.float64) - w)) / np.max(np.abs(w)) <= 2e-2


def test_the_cost_model_counts_the_seeds_atomics():
    # paper II's fused kernel accumulates dK and dV atomically, the seed's fix dK only: 2.00×
    # (ncu at N = 2048: 1,073,741,824 vs 536,870,912 atomic instructions); owner has none
    dnf = _seed_adjoint_dnf()
    atomic = sum(cost.estimate(o).atomics for o in _plan(dnf, "fused"))
    split = sum(cost.estimate(o).atomics for o in _plan(dnf, (("d_query", "d_key"), ("d_value",))))
    owner = _plan(dnf, "owner")
    assert split > 0 and atomic == 2 * split
    assert len(owner) == 2 and sum(cost.estimate(o).atomics for o in owner) == 0
    # dQ owning query tiles; dK and dV together, owning key tiles
    assert [[o.name for o in p.dnf.outputs] for p in owner] == [["d_query"], ["d_key", "d_value"]]


def test_the_cost_model_counts_what_a_shared_loop_computes_once():
    # a tile computes what the stages of one loop share once (tiles.stages.together), so the
    # model counts it once (cost._loop_groups): in units of T·S·H multiply-adds, the atomic
    # kernel's 5 contractions (S, dP, dV, dK, dQ), split's dQ with dK (S, dP, dK, dQ) and dV
    # alone (S, dV), owner's dQ (S, dP, dQ) and dK with dV (S, dP, dV, dK). Counted per stage
    # they were 8 in every plan: the model could not tell the seed's fused kernel from owner
    dnf = _seed_adjoint_dnf()
    unit = 2 * 2048 * 2048 * 64

    import pallas_kernels

    def units(plan):  # (to 0.1: owner's dK/dV programs also form Δ = +/(dO × O) [t] for each query
        # tile they walk, once per key tile, a 2-factor sum the model counts per GPU program: 4.03)
        return [round(cost.estimate(o).matmul_flops / unit, 1) for o in _plan(dnf, plan)]

    def dots(plan):  # what the Pallas lowering computes per tile: the model must not drift from it
        out = []
        for o in _plan(dnf, plan):
            with compat.enable_x64_context(True):
                fn = pallas_kernels.lower(o, interpret=True)
                text = str(jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct(i.shape, i.dtype) for i in o.dnf.inputs]))
            out.append(float(text.count("dot_general")))
        return out

    for plan, want in (("fused", [5.0]), ((("d_query", "d_key"), ("d_value",)), [4.0, 2.0]), ("owner", [3.0, 4.0])):
        assert units(plan) == want == dots(plan)


def test_a_shared_loop_counts_the_tiles_its_mask_leaves_out():
    # a CPU's fused plan, causal: programs own key tiles and walk the query tiles, skipping
    # those above the diagonal; dQ's partials (its Σ_s runs over the programs' grid axis) are
    # written over the same walk, so its share is that walk's, like dK's and dV's
    from moajax.masked import visited_fraction

    specs = [jax.ShapeDtypeStruct((1, 4096, 8, 64), np.float32)] * 3
    adj, args = mha_kernel(None, None, False).saved_adjoint(*specs, is_causal=True)
    onf = schedule.derive(adj.dnf(*args, is_causal=True), machines.load("anvil-epyc-7543"),
                          Preset.of(tiles={"s": 512, "t": 256}, cpu_loop="s"))
    assert onf.accumulate == (("d_query", "atomic"),) and onf.knobs.cpu_loop == ("s",)
    shares = {visited_fraction(onf, sk) for sk in onf.skips if sk.var.name == "t"}
    assert shares == {0.5625}  # 512-row key tiles, 256-row query tiles: 1/2 + 1/16
    share = visited_fraction(onf, onf.skip_of("d_value"))
    assert cost.estimate(onf).matmul_flops / (2 * 4096 * 4096 * 8 * 64) == pytest.approx(5 * share, rel=1e-3)


def test_the_seeds_onf_gives_the_seeds_ncu_counts_exactly():
    # the seed's kernels gave each program one query row (t tiled by 1): the cost model's
    # atomics for that ONF at B = 2 are ncu's counts, 1,073,741,824 and 536,870,912
    specs = [jax.ShapeDtypeStruct((2, 2048, 1, 64), np.float64)] * 3
    with compat.enable_x64_context(True):
        adj, args = mha_kernel(None, None, False).saved_adjoint(*specs)
        dnf = adj.dnf(*args)
    counts = [sum(cost.estimate(o).atomics for o in _plan_tiles(dnf, plan, {"t": 1}))
              for plan in ("fused", (("d_query", "d_key"), ("d_value",)), "owner")]
    assert counts == [1_073_741_824, 536_870_912, 0]


def _plan_tiles(dnf, plan, tiles):
    p = schedule.derive_plan(dnf, A100, Preset.of(plan=plan, tiles=tiles))
    return p if isinstance(p, tuple) else (p,)


def test_the_gpu_default_backward_is_owner():
    p = schedule.derive_plan(_seed_adjoint_dnf(), A100)
    assert isinstance(p, tuple) and sum(cost.estimate(o).atomics for o in p) == 0


def test_owner_is_bitwise_repeatable():
    q, k, v, g = _args(2, 3)
    f = jax.jit(jax.grad(lambda q, k, v: jnp.sum(moajax.dot_product_attention(
        q, k, v, onf=Preset.of(backward="owner"), implementation="pallas_interpret") * g), argnums=(0, 1, 2)))
    first, second = f(q, k, v), f(q, k, v)
    for a, b in zip(first, second):
        assert np.array_equal(np.asarray(a), np.asarray(b))


@needs_compiler
def test_ptxas_counts_atom_instructions_of_each_plan():
    # a smaller seed setting (float32, n = 512) keeps the offline compile short
    specs = [jax.ShapeDtypeStruct((1, 512, 1, 64), np.float32)] * 3
    adj, args = mha_kernel(None, None, False).saved_adjoint(*specs)
    dnf = adj.dnf(*args)
    counts = {}
    for name, plan in [("atomic", "fused"), ("split", (("d_query", "d_key"), ("d_value",))), ("owner", "owner")]:
        counts[name] = sum(r.atomics for o in _plan(dnf, plan) for r in ptx.onf_reports(o, "sm_80"))
    assert counts["owner"] == 0 and counts["split"] > 0 and counts["atomic"] > counts["split"], counts


def test_bad_plans_are_named():
    with pytest.raises(ValueError, match="Preset: backward must be"):
        Preset.of(backward="fast")
    with pytest.raises(ValueError, match="Preset: plan must be"):
        Preset.of(plan=[[1, 2]])
    with pytest.raises(ONFError, match="must name each output once"):
        _plan(_seed_adjoint_dnf(), (("d_query",), ("d_value",)))


def test_owner_computes_p_once_per_tile_for_dk_and_dv():
    # the pass owning key tiles walks the queries once: S = Q Kᵀ, dP = dO Vᵀ, dV += Pᵀ dO,
    # dK += dSᵀ Q — one loop, four contractions, one exp (P shared by dK's and dV's Σ_t);
    # the pass owning query tiles: S, dP, dQ += dS K
    import pallas_kernels

    specs = [jax.ShapeDtypeStruct((1, 1024, 1, 64), np.float32)] * 3
    adj, args = mha_kernel(None, None, False).saved_adjoint(*specs)
    dq, dkv = schedule.derive_plan(adj.dnf(*args), A100, Preset.of(plan="owner"))
    assert [o.name for o in dkv.dnf.outputs] == ["d_key", "d_value"]
    for onf, dots in ((dkv, 4), (dq, 3)):
        fn = pallas_kernels.lower(onf, interpret=True)
        text = str(jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct(i.shape, i.dtype) for i in onf.dnf.inputs]))
        assert text.count("scan[") + text.count("while[") == 1, onf.dnf.name
        assert text.count("dot_general") == dots and text.count(" exp ") == 1, onf.dnf.name


@pytest.mark.parametrize("causal", [True, False])
def test_the_atomic_backward_walks_the_keys_once_with_p_once_per_tile(causal):
    # the seed's fused kernel: programs own query tiles and walk the keys once; each key tile
    # gives dQ's Σ_s term and the scatter-added dK and dV partials in one loop:
    # S = Q Kᵀ, dP = dO Vᵀ, dV += Pᵀ dO, dK += dSᵀ Q, dQ += dS K — five contractions, one exp.
    # Hoisting sinks each stage's invariant factors for its own walk (the scale onto q for dQ's
    # Σ_s, onto k for dK's Σ_t; 1/ℓ into dQ's dP only), which left dP and the score in two
    # forms each (six contractions, two exps); ``accumulate`` factors the invariant factors out
    # of the contractions of the stages that share the pass (``rewrites.factored``), so each is
    # one node and the tile computes it once. Causal, with the interior key tiles walked in a
    # loop of their own without the mask and the diagonal ones in another (``Skip.interior``,
    # asked for: not a GPU's default): two loops, each tile in one of them, each loop the same
    # five contractions and one exp.
    dots, exps = 5, 1
    import pallas_kernels

    specs = [jax.ShapeDtypeStruct((1, 1024, 1, 64), np.float32)] * 3
    adj, args = mha_kernel(None, None, False).saved_adjoint(*specs, is_causal=causal)
    onf = schedule.derive_plan(adj.dnf(*args, is_causal=causal), A100,
                               Preset.of(plan="fused", unmask_interior=True))
    assert not isinstance(onf, tuple) and onf.accumulate
    fn = pallas_kernels.lower(onf, interpret=True)
    text = str(jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct(i.shape, i.dtype) for i in onf.dnf.inputs]))
    loops = text.count("scan[") + text.count("while[")
    assert loops == (2 if causal else 1)
    assert text.count("dot_general") == dots * loops and text.count(" exp ") == exps * loops


def test_few_keys_against_many_queries_take_the_fused_one_walk_not_staged_scores():
    # 4096 queries against 256 keys (a ring's piece of K and V, at 8 devices and 16 rounds of
    # S = 32768; cross-attention): every key is one row tile, so the fused adjoint is one walk
    # over the query tiles (6 dots, 1 exp). Before, only a walked row axis kept the fused plan,
    # and owner's staged first kernel held QKᵀ and dO Vᵀ [t s] in memory — up to 4 × Q each
    # (bench/results/backward_plans_cpu.md: its temp and time beside the fused plan's)
    from moajax import lower_xla

    q, kv = jax.ShapeDtypeStruct((1, 4096, 8, 64), np.float32), jax.ShapeDtypeStruct((1, 256, 8, 64), np.float32)
    adj, args = mha_kernel(None, None, False).saved_adjoint(q, kv, kv)
    dnf = adj.dnf(*args)
    cpu = machines.load("anvil-epyc-7543")
    plan = schedule.derive_plan(dnf, cpu)
    assert not isinstance(plan, tuple) and plan.accumulate == (("d_query", "atomic"),)
    assert plan.axis("s").ntiles == 1 and plan.axis("t").role == "sequential" and not plan.knobs.cpu_loop
    staged = schedule.staged_parts(dnf, schedule.plan_groups(dnf, "owner", cpu))
    # (the owner plan's alternative: QKᵀ and dO Vᵀ staged as [t n s] arrays, 2 × 32 MiB)
    assert [o.shape for o in staged[0].outputs] == [(4096, 8, 256)] * 2 and len(staged) == 3
    text = str(jax.make_jaxpr(lower_xla.lower(plan))(*[jax.ShapeDtypeStruct(i.shape, i.dtype) for i in dnf.inputs]))
    assert text.count("dot_general") == 6 and text.count(" exp ") == 1


@pytest.mark.parametrize("profile", ["h200", "delta-a100", "delta-a40"])
def test_a_gpu_never_stages_attention_scores_beside_a_mask_or_bias(profile):
    # a [t s] mask or bias put the staged owner plan within its size budget (a multiple of the
    # largest interface array), so a GPU's gradient wrote QKᵀ and dO Vᵀ as [t n s] arrays to
    # memory (1 GiB at T = S = 4096, N = 8, float32) and read them back in two kernels. The
    # cost model times that plan 2.8× (mask) and 2.8× (bias) the plan that recomputes them on
    # the H200, and now chooses (``schedule._owner_plan``); the MLP's U, V, G_H at d = 1024,
    # 2·d flops an element, stay staged
    T, N = 4096, 4
    m = machines.load(profile)
    for kern, extra in [(mha_kernel(None, "t s", False), jax.ShapeDtypeStruct((T, T), np.bool_)),
                        (mha_kernel(None, "b n t s", False), jax.ShapeDtypeStruct((1, N, T, T), np.bool_)),
                        (mha_kernel("b n t s", None, False), jax.ShapeDtypeStruct((1, N, T, T), np.float32))]:
        x = jax.ShapeDtypeStruct((1, T, N, 64), np.float32)
        adj, args = kern.saved_adjoint(x, x, x, extra, is_causal=True)
        dnf = adj.dnf(*args, is_causal=True)
        plan = schedule.derive_plan(dnf, dataclasses.replace(m, spill_check=False))
        assert isinstance(plan, tuple) and len(plan) == 2, [o.dnf.name for o in plan]
        assert all(o.dnf.inputs == dnf.inputs for o in plan)  # nothing staged in memory
        staged = schedule.staged_parts(dnf, schedule.plan_groups(dnf, "owner", m))
        assert [o.shape for o in staged[0].outputs] == [(T, N, T)] * 2  # what it was
    from moajax.kernels.mlp import swiglu

    S = lambda *s: jax.ShapeDtypeStruct(s, np.float32)  # noqa: E731
    specs = [S(4096, 1024), S(1024, 4096), S(1024, 4096), S(4096, 1024)]
    dnf = swiglu.adjoint(*specs).dnf(*specs, S(4096, 1024))
    plan = schedule.derive_plan(dnf, dataclasses.replace(m, spill_check=False))
    assert plan[0].dnf.name.endswith("_shared") and len(plan) == 4


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("keys,s_tile", [(24, 8), (24, 24), (8, 8)], ids=["walked", "one-key-tile", "few-keys"])
def test_the_xla_one_pass_backward_matches_the_reference(causal, keys, s_tile, monkeypatch):
    # the fused plan on the CPU, its cpu_loop walking key tiles (FlashAttention-2's order: the
    # fewest outputs scatter-added): per key tile one walk over the query tiles computes dK's
    # and dV's Σ_t and adds the dQ partials (lower_xla._one_pass). Where every key is in one
    # tile (a cache that holds them, or few keys against many queries: a ring's piece of K, V)
    # the walk over key tiles is one step, no loop: the same one pass (it was vectorised,
    # computing dQ apart from dK and dV, each recomputing P)
    from moajax import lower_xla

    calls = []
    real = lower_xla._one_pass
    monkeypatch.setattr(lower_xla, "_one_pass", lambda *a: calls.append(1) or real(*a))
    with compat.enable_x64_context(True):
        q = jax.ShapeDtypeStruct((2, 24, 2, 4), np.float64)
        kv = jax.ShapeDtypeStruct((2, keys, 2, 4), np.float64)
        adj, args = mha_kernel(None, None, False).saved_adjoint(q, kv, kv, is_causal=causal)
        dnf = adj.dnf(*args, is_causal=causal)
        walked = s_tile < keys
        onf = schedule.derive(dnf, machines.local(), Preset.of(tiles={"t": 8, "s": s_tile}, cpu_loop="s" if walked else ()))
        assert onf.accumulate == (("d_query", "atomic"),) and onf.axis("t").role == "sequential"
        assert onf.knobs.cpu_loop == (("s",) if walked else ()) and (onf.axis("s").ntiles > 1) == walked
        r = np.random.default_rng(7)
        arrays = [r.standard_normal(a.shape) + (3.0 if n.startswith("saved1") else 0.0)
                  for a, n in zip(args, [i.name for i in dnf.inputs])]
        got = lower_xla.lower(onf)(*arrays)
        want = adj.reference(*arrays, is_causal=causal)
    assert calls, "the one-pass walk was not taken"
    for a, b in zip(got, want):
        assert rel_err(a, b) <= F64


@pytest.mark.parametrize("kv_heads,S", [(8, 8192), (8, 1024), (2, 8192)], ids=["mha", "mha-one-row-tile", "gqa"])
def test_a_cpu_keeps_the_fused_adjoint_where_it_adds_one_output_and_works_less(kv_heads, S):
    # on a CPU the fused ONF stays where it scatter-adds one output in a walk over its row
    # tiles and its kernel's distinct reductions (each computed once per tile) do less work
    # than the owner plan's: attention's adjoint owning key tiles and adding dQ takes the
    # score, dP, dV, dK and dQ once — 5 [t s] contractions against owner's 4 + 3 — and its XLA
    # lowering (one walk, lower_xla._one_pass) traces 6 dots and 1 exp against owner's 9 and 2
    # (dS's two terms, P × dP and P × Δ, are summed apart: one more contraction in each plan's
    # dQ, and in owner's dK). A row tile covering every key (anvil's 256 MiB cache at
    # S = 1024) is one program, its walk one step: the same one walk, the fused plan (until
    # 2026-12-03 it was lowered vectorised, sharing nothing, and owner ran). With
    # GQA, dQ reads the kv head ⌊n/G⌋ and dK the query heads (n_kv, g): no contraction is the
    # same node, so owner stays; on a GPU owner always
    from moajax import lower_xla

    q, kv = (jax.ShapeDtypeStruct((1, S, n, 64), np.float32) for n in (8, kv_heads))
    adj, args = mha_kernel(None, None, kv_heads != 8).saved_adjoint(q, kv, kv, is_causal=True)
    dnf = adj.dnf(*args, is_causal=True)
    cpu = machines.load("anvil-epyc-7543")
    owner = tuple(schedule.derive(d, cpu) for d in schedule.split_outputs(dnf, schedule.plan_groups(dnf, "owner", cpu)))
    fused = schedule.derive(dnf, cpu)
    plan = schedule.derive_plan(dnf, cpu)
    if kv_heads == 8:
        assert fused.accumulate == (("d_query", "atomic"),) and fused.axis("s").role == "grid"
        assert schedule.plan_work((fused,)) / schedule.plan_work(owner) == pytest.approx(5 / 7, rel=0.01)
    if kv_heads == 8:
        assert plan is fused and fused.axis("t").role == "sequential"
        # S = 1024: one row tile of every key, no loop over it; S = 8192: the row tiles walked
        walked = S == 8192
        assert fused.knobs.cpu_loop == (("s",) if walked else ()) and (fused.axis("s").ntiles > 1) == walked

        def counts(onfs):
            # each walk traced once: with the mask on every tile (the interior tiles' own loop,
            # ``Skip.interior``, traces a second copy of the same body)
            onfs = [rewrites.unmask_interior(o, False) for o in onfs]
            texts = [str(jax.make_jaxpr(lower_xla.lower(o))(*[jax.ShapeDtypeStruct(i.shape, i.dtype)
                                                              for i in o.dnf.inputs])) for o in onfs]
            return sum(t.count("dot_general") for t in texts), sum(t.count(" exp ") for t in texts)

        assert counts((fused,)) == (6, 1) and counts(owner) == (9, 2)
    else:
        assert isinstance(plan, tuple)
    assert isinstance(schedule.derive_plan(dnf, A100), tuple)


def _scaled_dot_operands(jaxpr, in_loop: bool = False) -> list:
    """The dot_general operands that are a product by a scalar (a literal or a 0-d value) in
    the innermost loop bodies of a jaxpr: each a pass of its own over its tile at every step
    (a scalar product feeding an elementwise op fuses into it, a dot's operand does not)."""
    out, nested = [], False
    for e in jaxpr.eqns:
        loop = e.primitive.name in ("while", "scan")
        nested |= loop
        for p in e.params.values():
            for inner in sub_jaxprs(p):
                out += _scaled_dot_operands(inner, in_loop or loop)
    if nested or not in_loop:
        return out
    scaled = {id(e.outvars[0]): e for e in jaxpr.eqns
              if e.primitive.name == "mul" and any(not getattr(x.aval, "shape", ()) for x in e.invars)}
    return out + [scaled[id(x)] for e in jaxpr.eqns if e.primitive.name == "dot_general"
                  for x in e.invars if id(x) in scaled]


@pytest.mark.parametrize("saved", ["forward", "adjoint"])
def test_the_xla_scale_stays_off_the_score_tiles_and_the_walked_operand(saved):
    # The scale c = H^-½. In the adjoint's dQ = Σ_s dS·K·c it multiplies dQ's [n t h] partial,
    # smaller than both operands (``Backend.scalars_on_smaller_result``), not the [n s t] dS:
    # that was a fourth elementwise pass over every tile pair's scores. In the forward's
    # S = Σ_h Q·K·c it stays on the Q tile, invariant in the walk over key tiles (XLA hoists
    # it), not on each step's K tile (folding it into the smaller operand did that). (c × QKᵀ
    # inside exp(c·QKᵀ − m) fuses into the exp's pass: not counted.)
    from moajax import lower_xla

    specs = [jax.ShapeDtypeStruct((1, 4096, 8, 64), np.float32)] * 3  # (the benchmarks' shape)
    kern, cpu = mha_kernel(None, None, False), machines.load("anvil-epyc-7543")
    if saved == "adjoint":
        adj, args = kern.saved_adjoint(*specs)
        plan = schedule.derive_plan(adj.dnf(*args), cpu)
        assert not isinstance(plan, tuple) and plan.accumulate == (("d_query", "atomic"),)
    else:
        plan = schedule.derive_plan(kern.with_row_statistics().dnf(*specs), cpu)
        assert plan.axis("s").role == "sequential" and plan.axis("t").tile != plan.axis("s").tile
    jaxpr = jax.make_jaxpr(lower_xla.lower(plan))(*[jax.ShapeDtypeStruct(i.shape, i.dtype) for i in plan.dnf.inputs])
    assert str(jaxpr).count("dot_general") == (6 if saved == "adjoint" else 2)  # (one walk: one loop body)
    scaled = [tuple(e.outvars[0].aval.shape) for e in _scaled_dot_operands(jaxpr.jaxpr)]
    assert scaled == ([] if saved == "adjoint" else [(8, plan.axis("t").tile, 64)])


def _kernel_dots_and_transposes(fn, *args) -> tuple[int, int]:
    """(dot_generals, transposes) in the bodies of the Pallas kernels ``fn`` traces to."""
    names = [e.primitive.name for e, within in walk_eqns(jax.make_jaxpr(fn)(*args).jaxpr) if "pallas_call" in within]
    return names.count("dot_general"), names.count("transpose")


@pytest.mark.parametrize("backward", ["atomic", "split", "owner"])
def test_tile_layout_dots_give_the_gradient_with_no_tile_transposed(backward):
    """``Knobs.dot_layout="tile"`` (``Preset.of(dot_layout="tile")``; it reaches the gradient's
    kernels from the call's Preset): each 2-D tile dot is dot(a, b) or dot(b, a), whichever
    gives its result in the tile order, so the Pallas kernels transpose no tile (the default
    "operands" transposes dot results back: the dK/dV kernel's Q·Kᵀ scores) — and the
    gradient is the same, float64 rel ≤ 1e-12 against the independent reference. Causal,
    H = 16 and 80 positions: every dot is 2-D and ≥ 16 (a Triton dot)."""
    r = np.random.default_rng(5)
    q, k, v, g = (r.standard_normal((1, 80, 2, 16)) for _ in range(4))
    counts = {}
    with compat.enable_x64_context(True):
        for layout in ("operands", "tile"):
            pre = Preset.of(backward=backward, dot_layout=layout)

            def loss(q, k, v):
                return jnp.sum(moajax.dot_product_attention(q, k, v, is_causal=True, onf=pre,
                                                            implementation="pallas_interpret") * g)

            f = jax.grad(loss, argnums=(0, 1, 2))
            counts[layout] = _kernel_dots_and_transposes(f, q, k, v)
            if layout == "tile":
                for a, b in zip(jax.jit(f)(q, k, v), R.mha_backward(q, k, v, g, is_causal=True)):
                    assert rel_err(a, b) <= F64
    assert counts["tile"][0] == counts["operands"][0] >= 7, counts  # the same dots
    assert counts["tile"][1] == 0 < counts["operands"][1], counts


def test_tile_layout_dots_give_gqas_gradient_with_a_bias():
    """The same knob where GQA's group and a [B N T S] bias meet it (the bias tile, read
    query-major in a kernel owning key tiles, is still transposed): float64 rel ≤ 1e-12,
    dbias included. A layout the knob does not know is a named error."""
    r = np.random.default_rng(6)
    q, g = r.standard_normal((1, 80, 2, 16)), r.standard_normal((1, 80, 2, 16))
    k, v = r.standard_normal((1, 80, 1, 16)), r.standard_normal((1, 80, 1, 16))
    bias = r.standard_normal((1, 2, 80, 80))
    pre = Preset.of(backward="owner", dot_layout="tile")
    with compat.enable_x64_context(True):
        f = jax.jit(jax.grad(lambda q, k, v, bias: jnp.sum(moajax.dot_product_attention(
            q, k, v, bias, is_causal=True, onf=pre, implementation="pallas_interpret") * g), argnums=(0, 1, 2, 3)))
        for a, b in zip(f(q, k, v, bias), R.mha_backward(q, k, v, g, bias=bias, is_causal=True, return_dbias=True)):
            assert rel_err(a, b) <= F64
        with pytest.raises(ValueError, match="dot_layout must be one of"):
            schedule.derive(_seed_adjoint_dnf(), A100, Preset.of(dot_layout="rows"))


@pytest.mark.parametrize("backward", ["atomic", "split"])
def test_gqa_plans_holding_the_group_whole_contract_with_dots(backward):
    """GQA's atomic and split plans on the default GPU profile (float64, T = S = 128, 8 query
    heads over 2 kv heads, H = 16): programs own query tiles and hold the group's 4 heads
    whole, so the tiles are 3-D, [t h g]. Each contraction is a 2-D dot (Triton's tl.dot): the
    scores and dP with the group folded into the dot's rows (t·g), dQ likewise, and dK's and
    dV's partials Σ_t Σ_g as one dot over t·g (``Backend.joint_sums``). Before, Σ_g with t in
    both operands was a multiply-and-sum of 4-D [t s h g] products; the one multiply-and-sum
    left is Δ's row sum Σ_e dO·O (3-D). The gradient against the independent float64
    reference at rel ≤ 1e-12."""
    r = np.random.default_rng(5)
    q, g = (r.standard_normal((1, 128, 8, 16)) for _ in range(2))
    k, v = (r.standard_normal((1, 128, 2, 16)) for _ in range(2))

    def loss(a, b, c):
        return jnp.sum(moajax.dot_product_attention(a, b, c, is_causal=True, onf=Preset.of(backward=backward),
                                                    implementation="pallas_interpret") * g)

    f = jax.grad(loss, argnums=(0, 1, 2))
    eqns = [e for e, within in walk_eqns(jax.make_jaxpr(f)(q, k, v).jaxpr) if "pallas_call" in within]
    sums = [e.invars[0].aval.shape for e in eqns if e.primitive.name == "reduce_sum"]
    assert sum(e.primitive.name == "dot_general" for e in eqns) >= 10
    assert all(len(s) <= 3 for s in sums), sums
    for got, want in zip(jax.jit(f)(q, k, v), R.mha_backward(q, k, v, g, is_causal=True)):
        assert rel_err(got, want) <= F64


_FEW_KEYS = [((33, 16), None, 1), ((70, 37), None, 1), ((32, 32), "t s", 2)]


@pytest.mark.parametrize("profile", ["delta-a100", "delta-a40", "h200"])
@pytest.mark.parametrize("backward", ["fused", (("d_query", "d_key"), ("d_value",))], ids=["atomic", "split"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape,bias,B", _FEW_KEYS, ids=["33x16", "70x37", "bias-ts"])
def test_every_gpu_plan_is_one_the_triton_backend_takes(shape, bias, B, dtype, backward, profile):
    """The seed's plans, derived for each GPU, pass the Triton backend's check
    (``pallas_kernels.check``). Two derivations did not:
    - fewer keys than queries: the programs own key tiles and walk the queries (dQ added
      atomically), and Δ[t] = +/(dO × Out), hoisted once per program, was a row over the walked
      queries held on chip, which a GPU program cannot index; it is now a memory stage;
    - a bias [T S] over a batch of 2 on the A40, where the query- and key-owning tilings do not
      fit: the programs owned the batch and wrote dBias[t s] walking both t and s."""
    import pallas_kernels

    T, S = shape
    machine = machines.load(profile)
    specs = [jax.ShapeDtypeStruct(s, dtype) for s in [(B, T, 2, 8), (B, S, 2, 8), (B, S, 2, 8)]]
    if bias:
        specs.append(jax.ShapeDtypeStruct((T, S), dtype))
    with compat.enable_x64_context(True):
        adj, args = mha_kernel(bias, None, False).saved_adjoint(*specs)
        if isinstance(backward, tuple) and bias:
            backward = (backward[0] + ("d_bias",), backward[1])
        plan = schedule.derive_plan(adj.dnf(*args), machine, Preset.of(plan=backward))
    for onf in plan if isinstance(plan, tuple) else (plan,):
        pallas_kernels.check(onf)


@pytest.mark.parametrize("backward", ["atomic", "split"])
def test_plans_walking_the_queries_give_the_gradient(backward):
    """The first case above runs (Pallas interpret, the default GPU profile's ONFs: programs
    owning key tiles, Δ read from memory) and gives the float64 gradient at rel ≤ 1e-12."""
    r = np.random.default_rng(4)
    q, g = (r.standard_normal((1, 33, 2, 8)) for _ in range(2))
    k, v = (r.standard_normal((1, 16, 2, 8)) for _ in range(2))
    f = jax.jit(jax.grad(lambda a, b, c: jnp.sum(moajax.dot_product_attention(
        a, b, c, onf=Preset.of(backward=backward), implementation="pallas_interpret") * g), argnums=(0, 1, 2)))
    for got, want in zip(f(q, k, v), R.mha_backward(q, k, v, g)):
        assert rel_err(got, want) <= F64


@pytest.mark.parametrize("profile", ["delta-a100", "h200"])
def test_an_online_pass_read_across_the_query_walk_goes_to_memory(profile, monkeypatch):
    """The atomic plan recomputing the softmax (residuals="recompute") with a [T S] mask over a
    batch of 2 and 2 keys: its programs walk the queries, and the online pass (the row max and
    sum) is read across that walk. Like a plain stage it goes to memory (``rewrites.place``);
    before, the GPU derivation raised "'max_s' is not a plain stage". Float64 gradients
    (Pallas interpret, this profile's ONFs) against jax.grad of a jnp float64 composition,
    rel ≤ 1e-12."""
    from moajax import runtime

    machine = machines.load(profile)
    monkeypatch.setattr(runtime, "gpu_machine", lambda path="pallas": machine)
    runtime.schedules.cache_clear()
    r = np.random.default_rng(8)
    q, g = (r.standard_normal((2, 75, 1, 8)) for _ in range(2))
    k, v = (r.standard_normal((2, 2, 1, 8)) for _ in range(2))
    mask = r.random((75, 2)) < 0.8
    cap = lambda s, *_: 30 * jnp.tanh(s / 30)  # noqa: E731

    def ref(q, k, v):
        s = cap(jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(8))
        p = jax.nn.softmax(jnp.where(mask, s, -1e300), axis=-1)
        return jnp.sum(jnp.einsum("bnts,bsnh->btnh", p, v) * g)

    f = jax.jit(jax.grad(lambda a, b, c: jnp.sum(moajax.dot_product_attention(
        a, b, c, mask=mask, score_mod=cap, implementation="pallas_interpret",
        onf=Preset.of(backward="atomic", residuals="recompute")) * g), argnums=(0, 1, 2)))
    try:
        for got, want in zip(f(q, k, v), jax.grad(ref, argnums=(0, 1, 2))(q, k, v)):
            assert rel_err(got, want) <= F64
    finally:
        runtime.schedules.cache_clear()


def _on_profile(monkeypatch, profile):
    from moajax import runtime

    m = machines.load(profile)
    monkeypatch.setattr(runtime, "gpu_machine", lambda path="pallas": m)
    runtime.schedules.cache_clear()
    return m


@pytest.mark.parametrize("profile", ["h200", "delta-a40"])
def test_a_document_masks_gather_is_read_in_the_walk_not_staged(profile):
    """A document mask written FlexAttention's way reads doc[kv_idx], a table read at a
    computed index: a gather (``dnf.selection``), one load per key whatever the table's
    length. Hoisting took it for a row statistic and staged it in memory, a kernel of its own
    before the forward, the dQ and the dK/dV kernels (T = S = 1024 on a GPU profile); it is
    read inside the walk now (``rewrites._short``), so no kernel of the plan holds a memory
    stage but the slopes' gradient's split partials."""
    from moajax import gpu_report

    forward, adjoint, _ = gpu_report.score_mod_dnfs(gpu_report.score_mods()["alibi_document"], (1, 1024, 8, 64),
                                                    "float32")
    m = machines.load(profile)
    kernels = [schedule.derive_plan(forward, m)] + list(schedule.derive_plan(adjoint, m))
    assert len(kernels) == 4  # the forward, dQ, dK with dV, the slopes' gradient
    for onf in kernels[:3]:
        assert not [st.name for st in onf.program.stages if st.place == "memory"], onf


def test_jvp_where_the_gpu_schedule_splits_the_tangent_over_the_keys(monkeypatch):
    """``jax.jvp`` of attention with few query rows over many keys (B=1, T=16, S=4096, N=2,
    H=16) on the H200 profile: the default schedule splits the tangent kernel's keys (its 4
    programs would leave the GPU idle), and the kernel reading the online pass's partials
    combines every part. Until 2026-12-05 Pallas combined each program's own part only: here
    the tangent was off by 3.9 times its largest entry. Float32 inputs, Pallas interpret, against
    jax.jvp of a float64 jnp composition: rel ≤ 1e-5 (float32 sums over 4096 keys)."""
    from moajax import runtime, schedule
    from moajax.kernels.attention import mha_kernel

    m = _on_profile(monkeypatch, "h200")
    r = np.random.default_rng(9)
    q, tq = (r.standard_normal((1, 16, 2, 16)).astype(np.float32) for _ in range(2))
    k, v, tk, tv = (r.standard_normal((1, 4096, 2, 16)).astype(np.float32) for _ in range(4))
    specs = [jax.ShapeDtypeStruct(x.shape, np.float32) for x in (q, k, v)]
    kern = mha_kernel(None, None, False)
    onf = schedule.derive_plan(kern.tangent(*specs).dnf(*specs, *specs, is_causal=False), m)
    assert any(h.startswith("split_k(s,") for h in onf.history), onf.history

    def ref(q, k, v):
        p = jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q, k) / 4.0, axis=-1)
        return jnp.einsum("bnts,bsnh->btnh", p, v)

    try:
        _, got = jax.jvp(lambda a, b, c: moajax.dot_product_attention(a, b, c, implementation="pallas_interpret"),
                         (q, k, v), (tq, tk, tv))
        _, want = jax.jvp(ref, *[tuple(x.astype(np.float64) for x in xs) for xs in ((q, k, v), (tq, tk, tv))])
        assert rel_err(got, want) <= 1e-5
    finally:
        runtime.schedules.cache_clear()


@pytest.mark.parametrize("profile", ["h200", "delta-a40"])
def test_a_table_read_hoisted_out_of_a_renamed_walk(monkeypatch, profile):
    """GQA with residuals "recompute" and a score_mod reading a relative-position table and a
    document id at kv_idx: the default plan's dK kernel recomputes each row's max over the
    keys in a walk of its own (``separate_walks``: s → s_), which read the document id
    hoisted as a stage over s at s_ — refused by name on the default plan ("stage 'max_s'
    reads 'sum_c1_0' at ⟨s_⟩", found by a fuzz). The hoisted table read is a gather, read at
    s_ inline (``rewrites._gathers_read_inline``). Float64 gradients through Pallas-interpret
    against the reference with the table as a bias and the documents as a mask (q, k, v), and
    against XLA (the table)."""
    _on_profile(monkeypatch, profile)
    r = np.random.default_rng(3)
    B, T, S, K, G, H = 2, 26, 32, 3, 3, 4
    q, g = (r.standard_normal((B, T, K * G, H)) for _ in range(2))
    k, v = (r.standard_normal((B, S, K, H)) for _ in range(2))
    docs = np.sort(r.integers(0, 4, S))
    doc, table = jnp.asarray(docs, jnp.int32), jnp.asarray(r.standard_normal(7))

    def loss(impl):
        def f(q, k, v, table):
            mod = lambda s, b, h, i, j: jnp.where(doc[i] == doc[j], s + table[jnp.clip(i - j, -3, 3) + 3],  # noqa: E731
                                                  -jnp.inf)
            out = moajax.dot_product_attention(q, k, v, score_mod=mod, is_causal=True, implementation=impl,
                                               residuals="recompute")
            return jnp.sum(out * g)
        return f

    try:
        got = jax.grad(loss("pallas_interpret"), argnums=(0, 1, 2, 3))(q, k, v, table)
        t, s = np.arange(T)[:, None], np.arange(S)[None, :]
        bias = np.broadcast_to(np.asarray(table)[np.clip(t - s, -3, 3) + 3], (B, K * G, T, S))
        keep = np.broadcast_to(docs[:T, None] == docs[None, :], (B, K * G, T, S))
        want = R.mha_variants(q, k, v, bias=bias, mask=keep, is_causal=True, dout=g)
        for a, b in zip(got[:3], want[:3]):
            assert scaled_err(a, b) <= F64
        assert rel_err(got[3], jax.grad(loss("xla"), argnums=3)(q, k, v, table)) <= F64
    finally:
        from moajax import runtime

        runtime.schedules.cache_clear()


@pytest.mark.parametrize("B", [2, 3])
def test_a_table_gradient_with_sequence_lengths(monkeypatch, B):
    """A relative-position table's gradient with query (and key) lengths, causal, under the A40
    profile: its kernel walks t inside a sum over the batch, so the span of the t walk (the
    tiles the lengths and causal leave) was read at a batch index that no loop bound there —
    refused on the default plan ("query_seq_lengths: index b varies inside a tile"; found by a
    fuzz). The span now holds every batch element's tiles (``skipping._read``). Float64
    gradients through Pallas-interpret against the reference with the table as a bias (q, k,
    v), and against XLA (the table)."""
    _on_profile(monkeypatch, "delta-a40")
    r = np.random.default_rng(5)
    T, S, N, H = 34, 38, 2, 4
    q, g = (r.standard_normal((B, T, N, H)) for _ in range(2))
    k, v = (r.standard_normal((B, S, N, H)) for _ in range(2))
    table = jnp.asarray(r.standard_normal(7))
    lengths = dict(query_seq_lengths=np.array([23, 34, 5][:B], np.int32),
                   key_value_seq_lengths=np.array([38, 20, 31][:B], np.int32))

    def loss(impl):
        def f(q, k, v, table):
            mod = lambda s, b, h, i, j: s + table[jnp.clip(i - j, -3, 3) + 3]  # noqa: E731
            return jnp.sum(moajax.dot_product_attention(q, k, v, score_mod=mod, is_causal=True, implementation=impl,
                                                        **lengths) * g)
        return f

    try:
        got = jax.grad(loss("pallas_interpret"), argnums=(0, 1, 2, 3))(q, k, v, table)
        t, s = np.arange(T)[:, None], np.arange(S)[None, :]
        bias = np.broadcast_to(np.asarray(table)[np.clip(t - s, -3, 3) + 3], (B, N, T, S))
        want = R.mha_variants(q, k, v, bias=bias, is_causal=True, dout=g, **lengths)
        for a, b in zip(got[:3], want[:3]):
            assert scaled_err(a, b) <= F64
        assert rel_err(got[3], jax.grad(loss("xla"), argnums=3)(q, k, v, table)) <= F64
    finally:
        from moajax import runtime

        runtime.schedules.cache_clear()


def _alibi_grads(q, k, v, slopes, impl, onf=None):
    def loss(q, k, v, slopes):
        mod = lambda s, b, h, i, j: s - slopes[h] * jnp.abs(i - j)  # noqa: E731
        return jnp.sum(jnp.sin(moajax.dot_product_attention(q, k, v, score_mod=mod, implementation=impl, onf=onf)))
    return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, slopes)


def test_a_score_mod_arrays_gradient_sums_over_the_programs_batch_and_heads(monkeypatch):
    """ALiBi over 4 heads, B = 3, T = 7, S = 3, H = 16 on the A100 under the seed's split
    plan: the slopes' gradient Σ_t Σ_b Σ_n … joins dQ and dK, whose programs own query tiles
    and, beside them, each batch element and head; every program adds its partial over its
    own t tile, b and n (``ONF.scatter_vars``: t b n; the Σ over n_kv read where dQ reads n is
    renamed n, ``rewrites.accumulate``). Before, the programs held the batch and the heads
    whole: 328.2 KB of shared memory in float64 against 163.0, refused. Float64 gradients
    (Pallas interpret) against XLA's, rel ≤ 1e-12."""
    from moajax import runtime

    m = _on_profile(monkeypatch, "delta-a100")
    r = np.random.default_rng(9)
    q = r.standard_normal((3, 7, 4, 16))
    k, v = (r.standard_normal((3, 3, 4, 16)) for _ in range(2))
    slopes = jnp.linspace(0.1, 0.5, 4)
    try:
        got = _alibi_grads(q, k, v, slopes, "pallas_interpret", Preset.of(backward="split"))
        for a, b in zip(got, _alibi_grads(q, k, v, slopes, "xla")):
            assert rel_err(a, b) <= F64
        onf = _alibi_adjoint_plan((3, 7, 4, 16), (3, 3, 4, 16), slopes, m, "split")[0]
        st = onf.program.stage_of(dict(onf.program.outputs)["d_score_mod_const0"])
        assert [v.name for v in onf.scatter_vars(st)] == ["t", "b", "n"]
        assert {a.name: a.tile for a in onf.axes if a.role == "grid"} == {"t": 8, "b": 1, "n": 1}
        # every program (1 query tile × 3 × 4) adds its partial into each of the 4 slopes, and
        # its dK partial [3 × 4 keys (padded) × 16] into its own batch element's and head's dK
        assert cost.estimate(onf, m).atomics == 12 * 4 + 12 * 4 * 16
    finally:
        runtime.schedules.cache_clear()


def _alibi_adjoint_dnf(q_shape, kv_shape, slopes, dtype="float64", **kw):
    """ALiBi's saved adjoint, as ``jax.grad`` of the call derives it."""
    from moajax.api import _check_score_mod

    mod = _check_score_mod(lambda s, b, h, i, j: s - slopes[h] * jnp.abs(i - j), np.dtype(dtype))
    specs = [jax.ShapeDtypeStruct(q_shape, dtype)] + [jax.ShapeDtypeStruct(kv_shape, dtype)] * 2
    consts = [jax.ShapeDtypeStruct(np.shape(c), np.asarray(c).dtype) for c in mod.consts]
    with compat.enable_x64_context(True):
        adj, args = mha_kernel(None, None, False, False, False, mod).saved_adjoint(*specs, *consts, **kw)
        return adj.dnf(*args, **kw)


def _alibi_adjoint_plan(q_shape, kv_shape, slopes, machine, plan, dtype="float64", **kw) -> tuple:
    """The ONFs of the seed's ``plan`` (None: derived) for ALiBi's adjoint, as the call derives them."""
    from moajax.api import _backward_plan

    dnf = _alibi_adjoint_dnf(q_shape, kv_shape, slopes, dtype, **kw)
    groups = _backward_plan(Preset.of(backward=plan), False, (np.asarray(slopes),)).backward if plan else None
    with compat.enable_x64_context(True):
        onfs = schedule.derive_plan(dnf, machine, Preset.of(plan=groups) if plan else None)
    return onfs if isinstance(onfs, tuple) else (onfs,)


def test_a_scatter_chain_is_the_leading_sums_over_grid_axes():
    """Σ_t Σ_b Σ_n g: ``rewrites.accumulate`` over (t, b, n) brings each sum up below the one
    before (Fubini, linearity), the Σ over n_kv renamed n only where asked; the ONF's chain
    is the leading sums over grid axes, and only those may reduce across programs."""
    from moajax import onf as O

    slopes = jnp.linspace(0.1, 0.5, 4)
    dnf = _alibi_adjoint_dnf((2, 16, 4, 16), (2, 16, 4, 16), slopes)
    o = rewrites.hoist(O.initial(dnf))
    name = "d_score_mod_const0"
    with pytest.raises(ONFError, match="is not Σ_t Σ_b Σ_n g"):  # the table's heads are n_kv
        rewrites.accumulate(o, name, over=("t", "b", "n"))
    with pytest.raises(ONFError, match="cannot sum over 'n' in place of 'zz'"):
        rewrites.accumulate(o, name, over=("t", "b", "n"), rebind={"zz": "n"})
    chained = rewrites.accumulate(o, name, over=("t", "b", "n"), rebind={"n_kv": "n"})
    top = chained.program.stage_of(dict(chained.program.outputs)[name]).accumulated
    assert [top.var.name, top.body.var.name, top.body.body.var.name] == ["t", "b", "n"]
    fused = _alibi_adjoint_plan((2, 16, 4, 16), (2, 16, 4, 16), slopes, machines.load("delta-a100"), "atomic")[0]
    st = fused.program.stage_of(dict(fused.program.outputs)[name])
    chain = fused.scatter_chain(st)
    assert [x.var.name for x in chain] == ["t", "b", "n"] and all(a.body is b for a, b in zip(chain, chain[1:]))
    # b walked in sequence instead: the chain stops at t, and nothing else may sum over a grid axis
    assert [v.name for v in rewrites.tile(fused, "b", 1, "sequential").scatter_vars(st)] == ["t"]
    with pytest.raises(ONFError, match="axis '[bn]' is reduced in stage 'd_score_mod_const0' but is a grid axis"):
        fused.replace(program=O.Program(tuple(
            O.Stage(x.name, x.vars, x.body.body, x.place) if x is st else x for x in fused.program.stages),
            fused.program.outputs), accumulate=tuple((k, v) for k, v in fused.accumulate if k != st.name)).validate()


def test_a_score_mod_arrays_own_gradient_kernel_fills_the_gpu_over_a_batch():
    """The default (owner) plan's kernel of ALiBi's slopes' gradient, causal, B = 2, T = S =
    1024, N = 8, H = 64 in float32 on the H200: split-K cuts it until its programs fill the
    machine. The batch of 2 around the heads came first and could at most double the programs
    (the cost model's gain 1.96×, under the 2× a cut must pay), and that ended the search: the
    gradient ran as one program walking all 2 × 8 × 1024 × 1024 scores. Slopes in float64 read
    Δ from Out too (float32 dots, not rounded to 16 bits: ``Kernel.gpu_dots_round``). After a
    bfloat16 forward the slopes' gradient sums P × dP over the keys for Δ itself
    (``identities``), splits over the queries' tiles instead, and fills it too."""
    h200 = machines.load("h200")
    for dtype, slopes, split in (("float32", jnp.float32, "split_k(s, 32)"), ("float32", jnp.float64, "split_k(s, 32)"),
                                 ("bfloat16", jnp.float32, "split_k(t, 32)")):
        (onf,) = [o for o in _alibi_adjoint_plan((2, 1024, 8, 64), (2, 1024, 8, 64),
                                                 jnp.linspace(0.1, 0.5, 8, dtype=slopes), h200, None, dtype,
                                                 is_causal=True) if "const" in o.dnf.name]
        assert [h for h in onf.history if h.startswith("split_k(")] == ["split_k(n_kv, 8)", split]
        assert int(np.prod([a.ntiles for a in onf.axes if a.role == "grid"])) >= h200.multiprocessors


def test_a_named_plan_that_does_not_fit_says_it_is_the_presets(monkeypatch):
    """ALiBi over 4 heads, B = 2, T = S = 16, H = 128 on the A40 in float64 under the seed's split
    plan: its first kernel (dQ, dK and the slopes' gradient) needs 132.9 KB of shared memory
    against 99.0. A plan the Preset names is not swapped for another: the ONFError says it is
    the Preset's, and without it the plan is derived (float64 gradients against XLA's, Pallas
    interpret, rel ≤ 1e-12)."""
    from moajax import runtime

    _on_profile(monkeypatch, "delta-a40")
    r = np.random.default_rng(9)
    q, k, v = (r.standard_normal((2, 16, 4, 128)) for _ in range(3))
    slopes = jnp.linspace(0.1, 0.5, 4)
    try:
        with pytest.raises(ONFError, match=r"132.9 KB .* exceeds the 99.0 KB .* the Preset names for delta-a40; "
                                           "without it the plan is derived"):
            _alibi_grads(q, k, v, slopes, "pallas_interpret", Preset.of(backward="split"))
        for got, want in zip(_alibi_grads(q, k, v, slopes, "pallas_interpret"), _alibi_grads(q, k, v, slopes, "xla")):
            assert rel_err(got, want) <= F64
    finally:
        runtime.schedules.cache_clear()


@pytest.mark.parametrize("profile", ["h200", "delta-a100", "delta-a40"])
def test_the_seeds_plans_take_a_score_mod_array_at_model_shapes(profile, monkeypatch):
    """B = 2, T = S = 256, N = 8, H = 64 in float32 with ALiBi's slopes and a relative-position
    table: "atomic" and "split" derive on each GPU profile (before, their programs held the
    batch and the 8 heads whole: 1546 KB on the H200), and the CUDA lowering of jit(grad) holds
    the array's gradient in dQ and dK's kernel (one launch: "atomic", all of the adjoint)."""
    import dataclasses

    from moajax import runtime
    from moajax.ptx import triton_kernels

    m = dataclasses.replace(machines.load(profile), spill_check=False)
    monkeypatch.setattr(runtime, "gpu_machine", lambda path="pallas": m)
    S = jax.ShapeDtypeStruct
    args = (S((2, 256, 8, 64), jnp.float32),) * 3 + (S((8,), jnp.float32),)
    mods = {"alibi": lambda c: (lambda s, b, h, i, j: s - c[h] * jnp.abs(i - j)),
            "relpos": lambda c: (lambda s, b, h, i, j: s + c[jnp.clip(i - j, -4, 3) + 4])}
    want = {"atomic": ["adjoint_saved"], "split": ["adjoint_saved_d_query_d_key_d_score_mod_const0",
                                                    "adjoint_saved_d_value"]}
    try:
        for name, mod in mods.items():
            for plan, kernels in want.items():
                runtime.schedules.cache_clear()

                def loss(q, k, v, c, mod=mod, plan=plan):
                    return jnp.sum(moajax.dot_product_attention(q, k, v, score_mod=mod(c), onf=Preset.of(backward=plan)))

                names = [k.name for k in triton_kernels(jax.grad(loss, argnums=(0, 1, 2, 3)), *args)]
                # twice: the table is a jit argument, so the call holds the kernels that take it
                # finite and those with the masked fill, picked when it runs (``traced_tables``)
                assert sorted(n.removeprefix("moajax_mha_score_mod_mh_") for n in names if "adjoint" in n) == sorted(
                    kernels * 2), names
    finally:
        runtime.schedules.cache_clear()


def test_a_whole_axis_is_padded_to_the_block_pallas_reads(monkeypatch):
    """A per-head temperature s·(1 + 0.1·c[b + 2h]) over 7 keys, residuals "recompute" on the A100: the
    forward's keys are an axis no rewrite lifted, read whole in a block of 8, and the input
    was padded to 7 only (an out-of-bounds load on a GPU; in interpret mode a TypeError from
    lax.dynamic_slice). Float64 gradients against XLA's, rel ≤ 1e-12."""
    from moajax import runtime

    _on_profile(monkeypatch, "delta-a100")
    r = np.random.default_rng(1)
    q, g = (r.standard_normal((1, 6, 2, 8)) for _ in range(2))
    k, v = (r.standard_normal((1, 7, 2, 8)) for _ in range(2))
    table = jnp.asarray(r.standard_normal(8))

    def grads(impl, onf=None):
        def loss(q, k, v, c):
            mod = lambda s, b, h, i, j: s * (1 + 0.1 * c[b + 2 * h])  # noqa: E731
            return jnp.sum(g * moajax.dot_product_attention(q, k, v, score_mod=mod, implementation=impl, onf=onf))
        return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, table)

    try:
        for got, want in zip(grads("pallas_interpret", Preset.of(backward="atomic", residuals="recompute")), grads("xla")):
            assert rel_err(got, want) <= F64
    finally:
        runtime.schedules.cache_clear()


def test_gqa_dk_written_over_a_walked_kv_head_is_computed_tile_by_tile(monkeypatch):
    """Causal GQA (4 query heads over 2 kv heads) with a bias and a relative-position table, B =
    2, under the A100's atomic plan: programs own key tiles and walk the kv heads n_kv (the
    table's gradient sums over them), so dK[b s n_kv h] is written one kv head at a time. Its
    loop shared with dV computed it over both kv heads at once, where the query head g + 2·n_kv
    is no window: an ONFError while tracing. Float64 gradients against XLA's, rel ≤ 1e-12."""
    from moajax import runtime

    _on_profile(monkeypatch, "delta-a100")
    r = np.random.default_rng(5)
    q, g = (r.standard_normal((2, 39, 4, 16)) for _ in range(2))
    k, v = (r.standard_normal((2, 23, 2, 16)) for _ in range(2))
    bias = r.standard_normal((1, 4, 39, 23))
    table = jnp.asarray(r.standard_normal(8))

    def grads(impl, onf=None):
        def loss(q, k, v, bias, c):
            mod = lambda s, b, h, i, j: s + c[jnp.clip(i - j, -3, 4) + 3]  # noqa: E731
            return jnp.sum(g * moajax.dot_product_attention(q, k, v, bias, score_mod=mod, is_causal=True,
                                                            implementation=impl, onf=onf))
        return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, bias, table)

    try:
        for got, want in zip(grads("pallas_interpret", Preset.of(backward="atomic")), grads("xla")):
            assert rel_err(got, want) <= F64
    finally:
        runtime.schedules.cache_clear()


def test_one_heads_slope_gradient_is_scatter_added_under_the_fused_plan(monkeypatch):
    """One head (N = 1), ALiBi, the A100's atomic plan: the slope's gradient is (c = 0) ? a : 0 +
    (c = 0) ? b : 0 of two sums over the queries that hoist made stages; they are read inlined
    so that Σ_t comes to the top (``rewrites.accumulate``). Before, no output variable could
    own the programs. Float64 gradients against XLA's, rel ≤ 1e-12."""
    from moajax import runtime

    _on_profile(monkeypatch, "delta-a100")
    r = np.random.default_rng(2)
    q = r.standard_normal((1, 20, 1, 16))
    k, v = (r.standard_normal((1, 12, 1, 16)) for _ in range(2))
    slopes = jnp.asarray([0.3])
    try:
        for got, want in zip(_alibi_grads(q, k, v, slopes, "pallas_interpret", Preset.of(backward="atomic")),
                             _alibi_grads(q, k, v, slopes, "xla")):
            assert rel_err(got, want) <= F64
    finally:
        runtime.schedules.cache_clear()


_PROFILES = {p: machines.load(p) for p in ("h200", "delta-a100", "delta-a40")}
_MODS = {"alibi": lambda c: (lambda s, b, h, i, j: s - c[h] * jnp.abs(i - j)),
         "relpos": lambda c: (lambda s, b, h, i, j: s + c[jnp.clip(i - j, -3, 4) + 3]),
         "temperature": lambda c: (lambda s, b, h, i, j: s * (1 + 0.1 * c[b + 2 * h]))}  # b + 2h < 12


@settings(max_examples=12, deadline=None)
@given(profile=st.sampled_from(sorted(_PROFILES)), plan=st.sampled_from(["atomic", "split"]),
       mod=st.sampled_from(sorted(_MODS)), B=st.integers(1, 3), K=st.sampled_from([1, 2]), G=st.sampled_from([1, 2]),
       T_=st.integers(2, 24), S_=st.integers(2, 24), causal=st.booleans(), seed=st.integers(0, 2**16))
def test_the_seeds_plans_with_a_score_mod_array_match_xla(profile, plan, mod, B, K, G, T_, S_, causal, seed):
    """Random shapes, GQA groupings and score_mod arrays (a slope per head, a relative-position
    table, a temperature per batch element and head) under the seed's named plans on each GPU
    profile, Pallas interpret: float64 gradients of q, k, v and the array against XLA's, at
    1e-12 of their scale (``scaled_err``: a gradient that cancels to 0, as the table's where
    every row keeps one key, leaves the rounding of its O(1) terms). A plan that does not fit a
    profile is refused by name (the test then checks only that)."""
    from moajax import runtime

    r = np.random.default_rng(seed)
    q, g = (r.standard_normal((B, T_, K * G, 8)) for _ in range(2))
    k, v = (r.standard_normal((B, S_, K, 8)) for _ in range(2))
    c = jnp.asarray(r.standard_normal(12))

    def grads(impl, onf=None):
        def loss(q, k, v, c):
            return jnp.sum(g * moajax.dot_product_attention(q, k, v, score_mod=_MODS[mod](c), is_causal=causal,
                                                            implementation=impl, onf=onf))
        return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, c)

    saved = runtime.gpu_machine
    runtime.gpu_machine = lambda path="pallas": _PROFILES[profile]
    runtime.schedules.cache_clear()
    try:
        try:
            got = grads("pallas_interpret", Preset.of(backward=plan))
        except ONFError as e:
            assert "the Preset names" in str(e), e
            return
        for a, b in zip(got, grads("xla")):
            assert scaled_err(a, b) <= F64
    finally:
        runtime.gpu_machine = saved
        runtime.schedules.cache_clear()


@pytest.mark.parametrize("profile", ["h200", "delta-a100", "delta-a40"])
def test_a_bfloat16_tables_gradient_derives_its_own_kernel(profile):
    """ALiBi slopes in bfloat16 beside bfloat16 q, k, v (B = 2, T = S = 256, N = 8, H = 64): the
    slopes' gradient recomputes Δ after the 16-bit forward, in a kernel of its own that
    split-K cuts over the 8 heads 8 ways. Its 16-bit dots then take the factors out of them
    (``rewrites.factor_out_of_dots``), and the sum over the split's inner part of 1 went with
    them, leaving an axis no variable named: on the A100 and A40 no ONF validated, and
    lowered for CUDA the gradient ran as XLA loops."""
    import dataclasses

    m = dataclasses.replace(machines.load(profile), spill_check=False)
    onfs = _alibi_adjoint_plan((2, 256, 8, 64), (2, 256, 8, 64), jnp.linspace(0.1, 0.5, 8, dtype=jnp.bfloat16), m,
                               None, "bfloat16")
    (table,) = [o for o in onfs if o.dnf.name.endswith("d_score_mod_const0")]
    assert {a.name for a in table.axes} <= {v.name for v in table.program.vars()}
    assert "s1" in {v.name for v in table.program.vars()}  # (Δ summed over the keys)


def test_a_bfloat16_tables_gradient_lowers_for_cuda_as_pallas_kernels(monkeypatch):
    """jit(grad) of bfloat16 attention with bfloat16 ALiBi slopes (B = 2, T = S = 256, N = 8,
    H = 64) lowered for CUDA offline: the backward is chosen per platform (the GPU's recomputes
    Δ for the slopes' gradient, ``Kernel.gpu_dots_round``) under JAX's platform_dependent, and
    the CUDA lowering holds the GPU's kernels — dQ, dK with dV, the slopes' gradient, each
    twice (the table is a jit argument: the kernels that take it finite and those with the
    masked fill) — not XLA loops."""
    from moajax import runtime
    from moajax.ptx import triton_kernels

    m = dataclasses.replace(machines.load("h200"), spill_check=False)
    monkeypatch.setattr(runtime, "gpu_machine", lambda path="pallas": m)
    runtime.schedules.cache_clear()
    S = jax.ShapeDtypeStruct
    args = (S((2, 256, 8, 64), jnp.bfloat16),) * 3 + (S((8,), jnp.bfloat16),)

    def loss(q, k, v, c):
        mod = lambda s, b, h, i, j: s - c[h] * jnp.abs(i - j)  # noqa: E731
        return jnp.sum(moajax.dot_product_attention(q, k, v, score_mod=mod).astype(jnp.float32))

    try:
        names = [k.name.removeprefix("moajax_mha_score_mod_mh_") for k in
                 triton_kernels(jax.grad(loss, argnums=(0, 1, 2, 3)), *args) if "adjoint" in k.name]
    finally:
        runtime.schedules.cache_clear()
    assert sorted(set(names)) == ["adjoint_saved_d_key_d_value", "adjoint_saved_d_query",
                                  "adjoint_saved_d_score_mod_const0"], names


@pytest.mark.parametrize("profile", ["h200", "delta-a100", "delta-a40"])
def test_a_bfloat16_arrays_gradient_joins_the_seeds_fused_plans(profile):
    """bfloat16 ALiBi slopes beside bfloat16 q, k, v (B = 2, T = S = 1024, N = 8, H = 64) under
    "atomic" and "split" fit every GPU profile. The slopes' gradient is bfloat16(Σ_b Σ_{n_kv}
    …), a sum hoist makes a stage of its own under the conversion: ``rewrites.accumulate``
    inlines it and brings Σ_t to the top, so the programs own query tiles beside each b and
    n and add their partials (scatter t b n). Δ, which the gradient recomputes after the
    16-bit forward (Σ_{s1} P × dP over every key, inside Σ_s), is then a statistic of each
    program's own rows: a local stage [b t n] walking the keys in tiles before the main walk
    (``rewrites._chain_statistics``). Before, Σ_t stayed below Σ_b and the scatter fell to
    the batch (304.6 KB at T = 256, ad hoc), and with Σ_t on top the keys of Δ were held
    whole inside the walk (545.8 KB here, ad hoc): both plans were refused on all three."""
    m = dataclasses.replace(machines.load(profile), spill_check=False)
    slopes = jnp.linspace(0.1, 0.5, 8, dtype=jnp.bfloat16)
    for plan in ("atomic", "split"):
        onfs = _alibi_adjoint_plan((2, 1024, 8, 64), (2, 1024, 8, 64), slopes, m, plan, "bfloat16")
        (fused,) = [o for o in onfs if "d_score_mod_const0" in dict(o.program.outputs)]
        assert {"d_query", "d_key"} <= set(dict(fused.program.outputs))
        st = fused.program.stage_of(dict(fused.program.outputs)["d_score_mod_const0"])
        assert [v.name for v in fused.scatter_vars(st)] == ["t", "b", "n"]
        assert cost.onchip_bytes(fused) <= m.onchip_limit_bytes
        (delta,) = [x for x in fused.program.stages if x.walks is not None and x.walks.name == "s1"]
        assert [v.name for v in delta.vars] == ["b", "t", "n"] and delta.place == "local"
        assert fused.axis("s1").role == "sequential" and fused.axis("s1").tile < 1024


def test_accumulate_over_a_sum_that_cannot_come_up_is_an_error():
    """``accumulate(…, over=r)`` makes the programs owning tiles of r add partials Σ_r: where
    the output's Σ_r cannot be brought to its top (Σ_h lies inside the scores' exp), it is an
    ONFError, float64 or bfloat16. Before, it went on with the top sum's variable (b) in r's
    place; and for the bfloat16 slopes, whose sum is a stage under the conversion, Σ_t was
    never brought up, so (t, b, n) was refused."""
    from moajax import onf as O

    for dtype in ("float64", "bfloat16"):
        slopes = jnp.linspace(0.1, 0.5, 4, dtype=dtype)
        o = rewrites.hoist(O.initial(_alibi_adjoint_dnf((2, 16, 4, 16), (2, 16, 4, 16), slopes, dtype)))
        with pytest.raises(ONFError, match="is not Σ_h g"):
            rewrites.accumulate(o, "d_score_mod_const0", over="h")
        chained = rewrites.accumulate(o, "d_score_mod_const0", over=("t", "b", "n"), rebind={"n_kv": "n"})
        top = chained.program.stage_of(dict(chained.program.outputs)["d_score_mod_const0"]).accumulated
        assert [top.var.name, top.body.var.name, top.body.body.var.name] == ["t", "b", "n"]


@pytest.mark.parametrize("plan", ["atomic", "split"])
def test_a_bfloat16_tables_gradient_scatter_added_over_queries_batch_and_heads(monkeypatch, plan):
    """A bfloat16 relative-position table beside bfloat16 q, k, v (B = 2, T = S = 32, N = 2,
    H = 16, causal) under the seed's fused plans, on the H200's schedule with 16 KB of shared
    memory, so that only programs owning a query tile, a batch element and a head fit (scatter
    t b n, 13.3 KB; ad hoc). Before, the table's Σ_t stayed below Σ_b (a stage under the
    conversion), and the least the plan needed was 20.6 KB (ad hoc): refused. Δ, recomputed
    after the 16-bit forward, is a local stage walking the keys in tiles of its own. Pallas
    interpret against a plain-jnp float64 gradient of the same (bfloat16-valued) inputs,
    every gradient within 2⁻⁷ of its largest entry: twice bfloat16's unit roundoff 2⁻⁸, which
    each output and P for its dot with V are rounded to (measured 2.7e-3 to 2.9e-3 here, ad
    hoc; XLA's bfloat16 kernels 2.2e-3 to 2.9e-3)."""
    from moajax import runtime

    m = dataclasses.replace(machines.load("h200"), spill_check=False, shared_memory_per_block=16 * 1024)
    monkeypatch.setattr(runtime, "gpu_machine", lambda path="pallas": m)
    r = np.random.default_rng(21)
    q, k, v, g = (jnp.asarray(r.standard_normal((2, 32, 2, 16)), jnp.bfloat16) for _ in range(4))
    table = jnp.asarray(r.standard_normal(8), jnp.bfloat16)

    def grad(impl):
        def loss(q, k, v, c):
            mod = lambda s, b, h, i, j: s + c[jnp.clip(i - j, -3, 4) + 3]  # noqa: E731
            out = moajax.dot_product_attention(q, k, v, score_mod=mod, is_causal=True, implementation=impl,
                                               onf=Preset.of(backward=plan))
            return jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))

    runtime.schedules.cache_clear()
    try:
        got = grad("pallas_interpret")(q, k, v, table)
        # the kernels that ran: the table's gradient beside dQ and dK, added over t, b and n
        # (twice: the table is a jit argument, so the call holds the kernels that take it
        # finite and those with the masked fill, ``traced_tables``)
        fused = [o for run in moajax.traced_onfs(grad("pallas_interpret"), q, k, v, table)
                    for o in (run.onf if isinstance(run.onf, tuple) else (run.onf,))
                    if "d_score_mod_const0" in dict(o.program.outputs)]
    finally:
        runtime.schedules.cache_clear()
    assert len(fused) == 2
    for o in fused:
        st = o.program.stage_of(dict(o.program.outputs)["d_score_mod_const0"])
        assert [v.name for v in o.scatter_vars(st)] == ["t", "b", "n"] and "d_query" in dict(o.program.outputs)
    want = score_mod_grads_f64(q, k, v, table, g, _MODS["relpos"], True)
    assert all(scaled_err(a, b, floor=0.0) <= BF16_GRAD for a, b in zip(got, want))


# every gradient within 2⁻⁷ of its largest entry (``scaled_err`` with no floor): twice
# bfloat16's unit roundoff 2⁻⁸, to which the kernels round P for its dot with V, Out, and
# each gradient
BF16_GRAD = 2.0**-7


def test_a_row_guard_reads_a_walked_axis_tile_by_tile_where_its_block_would_overrun(monkeypatch):
    """GQA (4 query heads over 2 kv heads), causal, bfloat16 ALiBi slopes, the owner plan on the
    A40's schedule with 16 KB of shared memory: the slopes' gradient kernel walks the 20
    queries in tiles of 1 (the input padded to 20), and its causal skip checks that every
    row keeps a key by the saved max over all of them. That check read them in one
    power-of-two block of 32: a slice error in interpret mode, a load past the array on a GPU
    (found by an ad hoc fuzz of the seed's plans in bfloat16). It now steps through the
    queries' tiles (``skipping.rows_keep_keys``). Against plain jnp in float64, 2⁻⁷."""
    from moajax import runtime

    m = dataclasses.replace(machines.load("delta-a40"), spill_check=False, shared_memory_per_block=16 * 1024)
    monkeypatch.setattr(runtime, "gpu_machine", lambda path="pallas": m)
    r = np.random.default_rng(39)
    q, g = (jnp.asarray(r.standard_normal((1, 20, 4, 8)), jnp.bfloat16) for _ in range(2))
    k, v = (jnp.asarray(r.standard_normal((1, 22, 2, 8)), jnp.bfloat16) for _ in range(2))
    c = jnp.asarray(r.standard_normal(12), jnp.bfloat16)

    def loss(q, k, v, c):
        out = moajax.dot_product_attention(q, k, v, score_mod=_MODS["alibi"](c), is_causal=True,
                                           implementation="pallas_interpret", onf=Preset.of(backward="owner"))
        return jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32))

    runtime.schedules.cache_clear()
    try:
        got = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, c)
    finally:
        runtime.schedules.cache_clear()
    want = score_mod_grads_f64(q, k, v, c, g, _MODS["alibi"], True)
    assert all(scaled_err(a, b, floor=0.0) <= BF16_GRAD for a, b in zip(got, want))


@settings(max_examples=6, deadline=None)
@given(profile=st.sampled_from(sorted(_PROFILES)), plan=st.sampled_from(["atomic", "split", "owner"]),
       mod=st.sampled_from(sorted(_MODS)), table=st.sampled_from(["float32", "bfloat16"]),
       smem=st.sampled_from([None, 16]), B=st.integers(1, 2), K=st.sampled_from([1, 2]), G=st.sampled_from([1, 2]),
       T_=st.integers(2, 24), S_=st.integers(2, 24), causal=st.booleans(), seed=st.integers(0, 2**16))
def test_the_seeds_plans_with_a_score_mod_array_in_bfloat16(profile, plan, mod, table, smem, B, K, G, T_, S_, causal,
                                                            seed):
    """The float64 property test above never reaches what a GPU does after a 16-bit forward:
    the array's gradient recomputes Δ from P and dP (``identities``), and under "atomic" and
    "split" that Δ is a stage of the programs' own rows (``rewrites._chain_statistics``). So
    here in bfloat16: random shapes, groupings, arrays (float32 or bfloat16) and plans, each
    GPU profile with its own shared memory or 16 KB (which makes the fused plans' programs
    own a query tile, a batch element and a head), Pallas interpret, against plain jnp in
    float64 at 2⁻⁷ of each gradient's largest entry (``BF16_GRAD``; an ad hoc run of
    60 such examples: at most 3.6e-3). Before 2026-12-07 the fused plans were refused here
    (held Δ's keys whole); a plan that does not fit is refused by name."""
    from moajax import runtime

    if causal:
        S_ = max(S_, T_)  # (every query row keeps a key: jax.nn's fully masked rows are tested elsewhere)
    r = np.random.default_rng(seed)
    q, g = (jnp.asarray(r.standard_normal((B, T_, K * G, 8)), jnp.bfloat16) for _ in range(2))
    k, v = (jnp.asarray(r.standard_normal((B, S_, K, 8)), jnp.bfloat16) for _ in range(2))
    c = jnp.asarray(r.standard_normal(12), table)
    m = _PROFILES[profile] if smem is None else dataclasses.replace(_PROFILES[profile],
                                                                    shared_memory_per_block=smem * 1024)

    def loss(q, k, v, c):
        out = moajax.dot_product_attention(q, k, v, score_mod=_MODS[mod](c), is_causal=causal,
                                           implementation="pallas_interpret", onf=Preset.of(backward=plan))
        return jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32))

    saved = runtime.gpu_machine
    runtime.gpu_machine = lambda path="pallas": m
    runtime.schedules.cache_clear()
    try:
        try:
            got = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, c)
        except ONFError as e:
            assert "the Preset names" in str(e), e
            return
    finally:
        runtime.gpu_machine = saved
        runtime.schedules.cache_clear()
    want = score_mod_grads_f64(q, k, v, c, g, _MODS[mod], causal)
    assert all(scaled_err(a, b, floor=0.0) <= BF16_GRAD for a, b in zip(got, want))


def test_two_arrays_gradients_share_one_recomputed_delta():
    """A score_mod closing over two bfloat16 arrays (a relative-position table and ALiBi
    slopes; B = 2, T = S = 1024, N = 8, H = 64, causal) under "atomic" on the H200: each
    array's gradient recomputes Δ after the 16-bit forward, the same Δ, and each output's
    ``accumulate`` made it a stage: two stages walking every key for P and dP (a review's
    find). The second now reads the first's (``rewrites._chain_statistics``)."""
    from moajax import gpu_report
    from moajax.api import _backward_plan

    table = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.bfloat16)
    slopes = jnp.linspace(0.1, 0.5, 8, dtype=jnp.bfloat16)

    def mod(s, b, h, i, j):
        return s + table[jnp.clip(i - j, -3, 4) + 3] - slopes[h] * jnp.abs(i - j).astype(s.dtype)

    _, dnf, consts = gpu_report.score_mod_dnfs(mod, (2, 1024, 8, 64), "bfloat16")
    groups = _backward_plan(Preset.of(backward="atomic"), False, consts).backward
    m = dataclasses.replace(machines.load("h200"), spill_check=False)
    onfs = schedule.derive_plan(dnf, m, Preset.of(plan=groups))
    (fused,) = [o for o in (onfs if isinstance(onfs, tuple) else (onfs,))
                if {"d_score_mod_const0", "d_score_mod_const1"} <= set(dict(o.program.outputs))]
    deltas = [x for x in fused.program.stages if x.walks is not None and x.walks.name.startswith("s1")]
    assert len(deltas) == 1 and [v.name for v in deltas[0].vars] == ["b", "t", "n"]
    for name in ("d_score_mod_const0", "d_score_mod_const1"):
        st = fused.program.stage_of(dict(fused.program.outputs)[name])
        assert [v.name for v in fused.scatter_vars(st)] == ["t", "b", "n"]
