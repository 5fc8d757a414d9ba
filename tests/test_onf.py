"""The ONF as a value: printing, immutability, the carry/store views, and every ONFError."""

import dataclasses

import numpy as np
import pytest

from moajax import dnf as D
from moajax import cost, machines, schedule
from moajax import onf as O
from moajax import rewrites as W
from moajax.ix import Ix, Var
from moajax.kernels import attention
from moajax.kernels.attention import mha_dnf
from moajax.onf import ONFError
from moajax.schedule import Preset


@pytest.fixture
def dnf():
    return attention.dnf((8, 4), (12, 4), (12, 6))


def test_initial_hoist_online_print(dnf):
    o = O.initial(dnf)
    assert len(o.program.stages) == 1 and o.carry == {}
    h = W.hoist(o)
    assert h.carry == {"max_s": "passes"}
    names = [s.name for s in h.program.stages]
    assert names[0] == "max_s" and names[-1] == "out"
    f = W.fuse_online(h)
    assert f.carry == {"max_s": "online"}
    assert isinstance(f.program.stages[0], O.OnlineStage)
    text = f.pretty()
    assert "online over s<12" in text and "rewrites: hoist → fuse_online" in text
    assert "score(t, s) = Σ_{h<4}" in text


def test_onf_is_immutable_and_hashable(dnf):
    o = W.hoist(O.initial(dnf))
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.target = "x"
    assert hash(o) == hash(o)
    o2 = W.tile(o, "s", 4, "sequential")
    assert o.axes == () and o2.axis("s").tile == 4


def test_store_view(dnf):
    o = W.hoist(O.initial(dnf))
    assert o.store == {"den": "recompute", "num": "recompute", "probs": "recompute", "score": "recompute"}
    assert W.materialize(o, "score", "local").store["score"] == "onchip"
    assert W.materialize(o, "score", "memory").store["score"] == "memory"


def test_axis_lifting_numbers():
    a = O.Axis("t", 10, 4, "grid")
    assert a.ntiles == 3 and a.padded == 12 and a.has_tail
    assert "⟨3 × 4⟩" in a.text()


@pytest.mark.parametrize("axis,whole,pow2,block", [
    (O.Axis("t", 10, 4, "grid"), 12, 16, 4),             # every tile of a lifted axis: ⌈10/4⌉·4
    (O.Axis("s", 10, 4, "sequential"), 12, 16, 4),
    (O.Axis("t", 10, 1, "grid"), 10, 16, 1),             # tile 1 (batch-like): its extent
    (O.Axis("h", 72, 128, "whole"), 128, 128, 128),      # a whole axis padded up to its tile
    (O.Axis("h", 64, 64, "whole"), 64, 64, 64),
    (O.Axis("e", 6, 1, "whole"), 6, 8, 6),               # whole: never below the extent
    (O.Axis("t", 96, 32, "grid"), 96, 128, 32),          # 3 tiles: whole tiles, pow2 rounds up
])
def test_whole_size_is_the_one_rule(axis, whole, pow2, block):
    assert axis.whole_size() == whole and axis.whole_size(pow2=True) == pow2 and axis.block == block
    assert axis.whole_size() >= axis.extent and axis.whole_size() % axis.block == 0 or axis.role == "whole"


def test_history_tells_every_rewrite(dnf):
    o = W.fuse_online(W.hoist(O.initial(dnf)))
    o = W.with_knobs(W.with_gamma(W.tile(o, "s", 4, "sequential"), "key", "F"), num_warps=8)
    assert o.history == ("hoist", "fuse_online", "tile(s, 4, sequential)", "with_gamma(key, F)", "with_knobs(num_warps=8)")
    assert "rewrites: hoist → fuse_online → tile(s, 4, sequential) → with_gamma(key, F) → with_knobs(num_warps=8)" in o.pretty()
    d = schedule.derive(dnf, machines.load("delta-a100"), Preset.of(tiles={"t": 16}, gamma={"key": "F"}))
    # the schedule's own choices are rewrites too: the lifting, the knobs it picked, and the
    # float32 dots' precision it took from jax.default_matmul_precision (JAX's default: TF32)
    assert d.history == ("hoist", "fuse_online", "lift(t grid 8)", "with_knobs(lowp_dots=False, num_stages=3, num_warps=8)",
                         "tile(t, 16, grid)", "with_gamma(key, F)", "with_knobs(dot_precision=tensorfloat32)")


def _with_axes(o, *axes):
    return o.replace(axes=tuple(axes))


@pytest.mark.parametrize("axes,msg", [
    ((O.Axis("zz", 3, 1, "grid"),), "unknown axis 'zz'"),
    ((O.Axis("t", 8, 2, "grid"), O.Axis("t", 8, 2, "grid")), "listed twice"),
    ((O.Axis("t", 9, 2, "grid"),), "extent 9, the DNF says 8"),
    ((O.Axis("t", 8, 2, "diagonal"),), "role 'diagonal'"),
    ((O.Axis("t", 8, 3, "grid", "crop"),), "tail policy 'crop'"),
    ((O.Axis("t", 8, 0, "grid"),), "tile 0"),
    ((O.Axis("t", 8, 3, "grid", "refuse"),), "tile 3 does not divide extent 8 of axis 't'"),
    ((O.Axis("s", 12, 4, "grid"),), "axis 's' is carried online in 'max_s' but is a grid axis"),
])
def test_axis_errors(dnf, axes, msg):
    o = W.fuse_online(W.hoist(O.initial(dnf)))
    with pytest.raises(ONFError, match=msg):
        _with_axes(o, *axes).validate()


def test_grid_axis_reduced_in_a_program(dnf):
    o = W.hoist(O.initial(dnf))
    with pytest.raises(ONFError, match="reduced in stage 'max_s' but is a grid axis"):
        _with_axes(o, O.Axis("s", 12, 4, "grid")).validate()
    # split-K makes it legal: the reduced values are partials in memory
    assert W.split_k(W.fuse_online(o), "s", 3).validate()


def test_gamma_and_knob_errors(dnf):
    o = W.hoist(O.initial(dnf))
    with pytest.raises(ONFError, match="γ names unknown operand 'nope'"):
        W.with_gamma(o, "nope", "F").validate()
    with pytest.raises(ONFError, match="γ of 'key' is 'X'"):
        W.with_gamma(o, "key", "X").validate()
    with pytest.raises(ONFError, match="num_warps 3"):
        W.with_knobs(o, num_warps=3).validate()
    with pytest.raises(ONFError, match="num_stages 0"):
        W.with_knobs(o, num_stages=0).validate()
    with pytest.raises(ONFError, match="cpu_loop axis 't' is not a grid axis"):
        W.with_knobs(o, cpu_loop=("t",)).validate()


def test_footprint_over_shared_memory():
    d = mha_dnf((1, 512, 1, 128), (1, 512, 1, 128), (1, 512, 1, 128), np.dtype(np.float32))
    a40 = machines.load("delta-a40")
    o = schedule.derive(d, a40)
    big = W.with_knobs(W.tile(W.tile(o, "t", 256), "s", 256), num_stages=4)
    with pytest.raises(ONFError, match=r"on-chip footprint .* KB per program exceeds the 99.0 KB of delta-a40"):
        cost.check_fits(big.validate(), a40)


def test_program_errors(dnf):
    o = W.hoist(O.initial(dnf))
    st = list(o.program.stages)
    # a stage that reads another before it is computed
    swapped = O.Program((st[1], st[0]) + tuple(st[2:]), o.program.outputs)
    with pytest.raises(ONFError, match="reads 'max_s' before it is computed"):
        o.replace(program=swapped).validate()
    # duplicate names
    dup = O.Program((st[0], st[0]) + tuple(st[1:]), o.program.outputs)
    with pytest.raises(ONFError, match="defined twice"):
        o.replace(program=dup).validate()
    # outputs must match the DNF
    with pytest.raises(ONFError, match="the program computes outputs"):
        o.replace(program=O.Program(o.program.stages, ())).validate()
    # a Ref at an index other than the stage's own
    t = Var("t", 8)
    ref = D.Ref("max_s", (Ix.of(t) + 1,), np.float32)
    odd = O.Stage("odd", (t,), ref)
    prog = O.Program(o.program.stages[:1] + (odd,) + o.program.stages[1:], o.program.outputs)
    with pytest.raises(ONFError, match="only its own index"):
        o.replace(program=prog).validate()
    with pytest.raises(ONFError, match="place 'gpu'"):
        o.replace(program=O.Program((dataclasses.replace(st[0], place="gpu"),) + tuple(st[1:]), o.program.outputs)).validate()


def test_rewrite_errors(dnf):
    o = W.hoist(O.initial(dnf))
    with pytest.raises(ONFError, match="no subexpression is labelled 'nope'"):
        W.materialize(o, "nope")
    with pytest.raises(ONFError, match="place must be 'local' or 'memory'"):
        W.materialize(o, "score", "gpu")
    with pytest.raises(ONFError, match="split_k needs parts ≥ 2"):
        W.split_k(o, "s", 1)
    with pytest.raises(ONFError, match="placed 'local' or 'memory', got 'gpu'"):
        W.place(o, "max_s", "gpu")
    with pytest.raises(ONFError, match="'nope' names no stage"):
        W.place(o, "nope", "memory")
    with pytest.raises(ONFError, match="'out' is an output"):
        W.place(o, "out", "memory")
    assert W.place(o, "max_s", "memory").program.stage_of("max_s").place == "memory"
    assert W.place(o, "max_s", "memory").history[-1] == "place(max_s, memory)"
    with pytest.raises(ONFError, match="no stage reduces over 'zz'"):
        W.split_k(o, "zz", 2)
    with pytest.raises(ONFError, match="exceeds its extent 12"):
        W.split_k(o, "s", 13)
    with pytest.raises(ONFError, match="unknown axis 'zz'"):
        W.tile(o, "zz", 2)
    plain = W.hoist(O.initial(attention.dnf((4, 2), (4, 2), (4, 2))))
    no_softmax = W.hoist(O.initial(D.DNF("sum", plain.dnf.inputs, (plain.dnf.outputs[0].__class__(
        "out", (4,), ("t",), (Var("t", 4),), D.Red("add", Var("h", 2), D.Read("query", (Var("t", 4), Var("h", 2)), np.float32))),))))
    with pytest.raises(ONFError, match="fuse_online found no"):
        W.fuse_online(no_softmax)


def test_pallas_refuses_what_triton_cannot_do(dnf):
    import pallas_kernels

    o = W.fuse_online(W.hoist(O.initial(dnf)))
    with pytest.raises(ONFError, match="power-of-two tiles"):
        pallas_kernels.check(W.tile(o, "t", 3, "grid"))
    row = W.tile(W.materialize(W.hoist(O.initial(dnf)), "score", "local"), "s", 4, "sequential")
    with pytest.raises(ONFError, match="stores a row over the sequential axis"):
        pallas_kernels.check(row)


def test_presets_and_derive():
    d = mha_dnf((1, 64, 2, 16), (1, 48, 2, 16), (1, 48, 2, 16), np.dtype(np.float32))
    cpu = machines.local()
    o = schedule.derive(d, cpu, Preset.of(carry="passes", tiles={"s": 16}, roles={"s": "sequential"}, gamma={"key": "F"}))
    assert o.carry == {"max_s": "passes"} and o.axis("s").tile == 16 and o.gamma_of("key") == "F"
    gpu_only = Preset.of(tiles={"t": 32}, target="gpu")
    assert schedule.derive(d, cpu, gpu_only).axis("t").tile != 32 or d.outputs[0].shape[1] == 32
    for name in ("classical", "online", "papers-three-pass", "ring-memory"):
        p = Preset.load(f"{O.__file__.rsplit('/moajax/', 1)[0]}/configs/presets/{name}.toml")
        assert cost.check_fits(schedule.derive(d, cpu, p).validate(), cpu)
    with pytest.raises(ONFError, match="carry must be 'online' or 'passes'"):
        schedule.derive(d, cpu, Preset.of(carry="sometimes"))
    with pytest.raises(ONFError, match="store policy for 'score' is 'disk'"):
        schedule.derive(d, cpu, Preset.of(store={"score": "disk"}))
    with pytest.raises(ValueError, match="target must be"):
        Preset.of(target="tpu")


def test_accumulate_errors():
    from moajax.kernels import attention_backward

    bwd = attention_backward.dnf((8, 4), (12, 4), (12, 6), (8, 6))
    o = schedule.derive(bwd, machines.local())
    assert dict(o.accumulate) == {"dk": "atomic", "dv": "atomic"}
    # without the accumulation, dK's sum over the rows would cross programs
    with pytest.raises(ONFError, match="axis 't' is reduced in stage 'dk' but is a grid axis"):
        o.replace(accumulate=(("dv", "atomic"),)).validate()
    with pytest.raises(ONFError, match="accumulation 'sometimes' of 'dk'"):
        o.replace(accumulate=(("dk", "sometimes"),)).validate()
    with pytest.raises(ONFError, match="accumulate names unknown stage 'zz'"):
        o.replace(accumulate=(("zz", "atomic"),)).validate()
    # the summed variable must be a grid axis: a sequential one never crosses programs
    seq = W.tile(W.tile(o, "t", 4, "sequential"), "s", 12, "whole")
    with pytest.raises(ONFError, match="not a \\+-reduction over a grid axis"):
        seq.validate()
    # dQ is not a sum over the rows, and a local stage cannot take partials from programs
    with pytest.raises(ONFError, match="not a \\+-reduction over a grid axis"):
        o.replace(accumulate=o.accumulate + (("dq", "atomic"),)).validate()
    local = next(s.name for s in o.program.stages if isinstance(s, O.Stage) and s.place == "local"
                 and s.name not in ("dq", "dk", "dv"))
    with pytest.raises(ONFError, match=f"{local!r} accumulates atomically, so it must live in memory"):
        o.replace(accumulate=o.accumulate + ((local, "atomic"),)).validate()
    with pytest.raises(ONFError, match="accumulate: unknown output 'zz'"):
        W.accumulate(o, "zz")
    fwd = W.fuse_online(W.hoist(O.initial(attention.dnf((8, 4), (12, 4), (12, 6)))))
    with pytest.raises(ONFError, match="output 'out' is not c · Σ_r g"):
        W.accumulate(fwd, "out")


def test_a_row_across_a_walk_is_found_by_any_result_of_an_online_pass(dnf):
    """An online pass over s holds its max and sums per query row t; a stage that sums over t
    reads a row of it across a walk of t, whether it reads the max or only a sum (Σ_t ℓ[t]
    here). Only reads of the max were counted: a reader of the sums alone left the pass on
    chip, which the Triton backend cannot index (``pallas_kernels.check`` asks the same)."""
    o = W.fuse_online(W.hoist(O.initial(dnf)))
    online = next(s for s in o.program.stages if isinstance(s, O.OnlineStage))
    t = online.max_vars[0]
    total = O.Stage("total", (), D.Red("add", t, D.Ref("sum_s", (t,), np.dtype(np.float32))))
    o = o.replace(program=O.Program(o.program.stages + (total,), o.program.outputs))
    assert o.rows_across_walks() == ()  # t held whole: no walk
    walked = W.tile(o, "t", 4, "sequential")
    assert walked.rows_across_walks() == ((online.name, ("t",)),)
    assert W.place(walked, online.name, "memory").rows_across_walks() == ()
