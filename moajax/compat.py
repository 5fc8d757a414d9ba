"""The differences between JAX versions moajax depends on, in one place.

Developed against JAX 0.10.2 (Python 3.11); GPU machines may carry JAX ≥ 0.11, where the
Pallas Triton backend is deprecated and CompilerParams moved. Everything version-specific
goes through here.
"""

from __future__ import annotations

import collections
import functools
import itertools
import re
from typing import Callable

import jax


@functools.lru_cache(maxsize=None)
def jax_version() -> tuple:
    parts = []
    for p in jax.__version__.split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def triton_compiler_params(plgpu, num_warps: int, num_stages: int):
    """Pallas' Triton-backend compiler params (selects Triton over Mosaic GPU).

    ``plgpu`` is ``jax.experimental.pallas.triton``, passed in by pallas_kernels (the only
    package that imports Pallas); the class was ``TritonCompilerParams`` before JAX 0.5."""
    cls = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")
    return cls(num_warps=num_warps, num_stages=num_stages)


def platform_dependent(*args, cpu, cuda, default=None, differentiable: bool = False):
    """Per-platform lowering inside one jitted function: ``cuda(*args)`` where it is lowered for
    CUDA, ``cpu(*args)`` elsewhere (and ``default``, where given, on other platforms than the
    CPU). ``lax.platform_dependent`` traces every branch at every call: on a CPU each call
    traced its Pallas GPU kernel too (a first call at a new shape traced and lowered 1.25–1.77×
    slower for it: bench/results/trace_cpu_epyc_avx2.md). Here only the CPU branch is traced at the call
    (it gives the output shapes); the others are traced when, and only when, a lowering for
    their platform asks (``jit(...).lower(lowering_platforms=("cuda",))`` offline included).
    Falls back to ``lax.platform_dependent`` where this JAX lacks the pieces, and takes it where
    JAX must differentiate through the choice (``differentiable``: the primitive has no
    derivative rules; JAX's is a cond on the platform's index, which has them): every branch
    is traced then."""
    from jax import lax

    prim = _platform_call_primitive()
    if prim is None or differentiable or default not in (None, cpu):
        return lax.platform_dependent(*args, cpu=cpu, cuda=cuda, default=default or cpu)
    closed, shapes = jax.make_jaxpr(cpu, return_shape=True)(*args)
    if closed.effects:  # the primitive declares none: a branch with effects (a callback) keeps JAX's own
        return lax.platform_dependent(*args, cpu=cpu, cuda=cuda, default=cpu)
    tree = jax.tree_util.tree_structure(shapes)
    outs = prim.bind(*args, cpu=closed, cuda=_Branch(cuda, tree))
    return jax.tree_util.tree_unflatten(tree, outs)


class _Branch:
    """A branch traced only when lowered: ``fn`` and the output structure it must give. Equal
    and hashed by identity (a primitive's parameter)."""

    __slots__ = ("fn", "tree")

    def __init__(self, fn, tree):
        self.fn, self.tree = fn, tree

    def flat(self, *args):
        out = self.fn(*args)
        leaves, tree = jax.tree_util.tree_flatten(out)
        if tree != self.tree:
            raise TypeError(f"platform_dependent: the branches give different structures ({tree} and {self.tree})")
        return leaves


@functools.lru_cache(maxsize=None)
def _platform_call_primitive():
    """The primitive behind ``platform_dependent``: abstract evaluation from the CPU branch's
    jaxpr; lowered per platform (the CPU jaxpr by default, the CUDA branch traced for CUDA);
    batched by vmapping both branches; run eagerly by compiling it for this platform. It is
    never differentiated itself: moajax's compiled functions carry their derivatives
    (``runtime.differentiable``) around it. None where this JAX lacks a piece."""
    try:  # every piece looked up before anything is registered: a JAX without one falls back whole
        from jax import core as _core
        from jax.extend.core import Primitive
        from jax.interpreters import batching, mlir
        from jax._src import dispatch

        jaxpr_as_fun = getattr(_core, "jaxpr_as_fun", None)
        if jaxpr_as_fun is None:
            from jax._src.core import jaxpr_as_fun
        apply_primitive, lower_fun, register_lowering = dispatch.apply_primitive, mlir.lower_fun, mlir.register_lowering
        batchers = batching.primitive_batchers
    except (ImportError, AttributeError):
        return None
    prim = Primitive("moajax_platform_call")
    prim.multiple_results = True
    prim.def_impl(functools.partial(apply_primitive, prim))
    prim.def_abstract_eval(lambda *avals, cpu, cuda: cpu.out_avals)
    register_lowering(prim, lower_fun(lambda *a, cpu, cuda: jaxpr_as_fun(cpu)(*a), multiple_results=True))
    register_lowering(prim, lower_fun(lambda *a, cpu, cuda: cuda.flat(*a), multiple_results=True), platform="cuda")

    def batch(args, dims, *, cpu, cuda):
        axes = tuple(None if d is None or d is getattr(batching, "not_mapped", None) else d for d in dims)
        outs = platform_dependent(*args, cpu=jax.vmap(jaxpr_as_fun(cpu), axes), cuda=jax.vmap(cuda.flat, axes))
        return outs, [0] * len(outs)

    batchers[prim] = batch
    return prim


def trace_lower(fn, *args, platforms=("cuda",), device_kind: str = "NVIDIA A100"):
    """Lower a jitted function for other platforms than this machine's (e.g. CUDA on a CPU).
    JAX ≥ 0.11's Pallas Triton lowering asks the GPU it lowers for (its compute capability)
    and, with none in the process, refuses: there the lowering runs under an abstract mesh
    whose device is a GPU of ``device_kind`` (a name JAX knows, e.g. "NVIDIA H100")."""
    lower = lambda: jax.jit(fn).trace(*args).lower(lowering_platforms=tuple(platforms))  # noqa: E731
    if jax_version() < (0, 11) or "cuda" not in platforms or any(d.platform == "gpu" for d in jax.devices()):
        return lower()
    from jax._src import mesh as mesh_lib

    gpu = mesh_lib.AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=gpu)):
        return lower()


def mlir_ir():
    """jaxlib's MLIR Python bindings (``ir``: read the attributes of a lowered module); JAX
    has no public path to them."""
    from jax._src.lib.mlir import ir

    return ir


def triton_compiler():
    """jaxlib's Triton bindings (``compile``, ``has_compilation_handler``): Triton IR → PTX
    without a GPU. Raises ImportError where this jaxlib has none."""
    from jax._src.lib import triton

    return triton


def default_dot_precision() -> str:
    """What ``jax.default_matmul_precision`` (the ``jax_default_matmul_precision`` config) asks
    of a GPU's float32 dots, as ``Knobs.dot_precision``, the nearest a Triton dot carries (its
    input precision is IEEE float32 or TF32) without rounding below what was asked:
    "tensorfloat32" for JAX's default (None: XLA's float32 dots on an Ampere-or-later GPU take
    TF32), "default", "bfloat16", "high", "tensorfloat32" and the one-pass 16-bit and TF32
    algorithm presets; "highest" (IEEE float32) for "highest", "float32", the multi-pass presets
    (…_X3, _X6, _X9: near float32 accuracy) and anything else."""
    from jax import lax

    value = jax.config.jax_default_matmul_precision
    if value is None:
        return "tensorfloat32"
    try:
        return "highest" if lax.Precision(value) == lax.Precision.HIGHEST else "tensorfloat32"
    except (ValueError, KeyError, TypeError):
        pass
    name = str(getattr(value, "name", value)).upper()
    if name.endswith(("_X3", "_X6", "_X9")):
        return "highest"
    return "tensorfloat32" if name.startswith(("TF32_", "BF16_", "F16_")) else "highest"


def matmul_precision_config():
    """The ``jax_default_matmul_precision`` config as set (None: JAX's default), which a call's
    derivatives, traced after it, are traced under again (``at_matmul_precision``)."""
    return jax.config.jax_default_matmul_precision


def at_matmul_precision(fn, value):
    """``fn`` called under ``jax.default_matmul_precision(value)`` (a value of
    ``matmul_precision_config``, None included): what a kernel's call hands on to
    the code JAX traces later — its backward, tangent and saving forward (jax.grad traces them
    after the forward, outside a ``with`` block the forward was called in), the per-device
    kernels of a sharded call (XLA's partitioner asks for them at compile time) and the batched
    kernel of a vmap across a jit boundary — so that they take the call's precision, as the
    transpose of a dot_general takes its primal's."""

    @functools.wraps(fn)
    def at_precision(*args, **kwargs):
        with jax.default_matmul_precision(value):
            return fn(*args, **kwargs)

    return at_precision


def enable_x64_context(enabled: bool = True):
    """A context manager that switches float64 on (or off) for a block."""
    try:
        return jax.enable_x64(enabled)  # JAX ≥ 0.8
    except AttributeError:  # pragma: no cover - older JAX
        from jax.experimental import enable_x64, disable_x64

        return enable_x64() if enabled else disable_x64()


def decodes_shardings() -> bool:
    """Whether ``partition_spec`` can decode a partitioner's HLO sharding on this JAX (else
    the kernels let JAX decode them, as before: a split over part of a mesh axis fails)."""
    try:
        from jax._src import sharding as jsharding
        from jax._src import sharding_impls
    except ImportError:  # pragma: no cover - a JAX that moved them
        return False
    return hasattr(sharding_impls, "parse_flatten_op_sharding") and hasattr(jsharding, "IndivisibleError")


def partition_spec(sharding, mesh, ndim: int):
    """The PartitionSpec, in ``mesh``'s axes, of a sharding XLA's partitioner hands a custom
    partitioning that decodes its own (``decode_shardings=False``: JAX passes the HLO sharding
    as a GSPMDSharding); None where no PartitionSpec names it — Shardy splits a dim over a
    part of a mesh axis (GQA's 2 kv heads over 2 of 8 devices), where JAX's own decoding
    raised an IndivisibleError before the partitioning callback ran. JAX has no public
    decoder (``sharding_impls.parse_flatten_op_sharding``)."""
    from jax.sharding import NamedSharding, PartitionSpec

    if sharding is None:
        return PartitionSpec()
    if isinstance(sharding, NamedSharding):
        return sharding.spec
    from jax._src import sharding as jsharding
    from jax._src import sharding_impls

    try:
        spec = sharding_impls.parse_flatten_op_sharding(sharding._to_xla_hlo_sharding(ndim), mesh)[0]
    except (jsharding.IndivisibleError, ValueError, KeyError, StopIteration):
        return None
    return PartitionSpec(*spec, *((None,) * (ndim - len(spec))))


# the batched transposes offered by linear_calls (``linear_call``), by the token their callee's
# name carries: a vmap may batch the call long after it was bound (the jvp of a jitted call is
# a jaxpr, batched when the vmap around it is), so the rule finds the offer from the call's
# own parameters. Bounded: an offer holds no traced value, and old ones are dropped
_BATCHED_TRANSPOSES: "collections.OrderedDict[int, Callable]" = collections.OrderedDict()
_OFFER = "moajax_batched_transpose_"
_OFFERS = itertools.count()


def linear_call(fun, fun_transpose, residual_args, linear_args, batched_transpose=None):
    """``jax.custom_derivatives.linear_call`` (a linear function with its own transpose), with
    what JAX 0.10 lacks: a ``vmap`` rule (the batched call is a ``linear_call`` of the
    vmapped function and of its vmapped transpose) and a derivative in the residuals (JAX's
    rule asserts that they do not move; a second derivative moves them).

    ``batched_transpose(res_batched, lin_batched)``, given which residual and linear leaves a
    ``vmap`` batches, may give the transpose of the batched call: ``(res, cts) -> one
    cotangent per linear leaf``, the residuals with the batch axis first where batched, the
    cotangents batched; a linear operand the batch shares gets the sum over the batch (the
    transpose of its broadcast) — computed inside, not as a batch of cotangents then summed.
    It may decline (None): then the batch of transposes runs, summed after. It must hold
    no traced value (it outlives the trace)."""
    from jax.custom_derivatives import linear_call as call

    _register_linear_call_rules()
    if batched_transpose is None:
        return call(fun, fun_transpose, residual_args, linear_args)
    token = next(_OFFERS)
    _BATCHED_TRANSPOSES[token] = batched_transpose
    while len(_BATCHED_TRANSPOSES) > 4096:
        _BATCHED_TRANSPOSES.popitem(last=False)

    def offered(res, lin):
        return fun(res, lin)

    offered.__name__ = f"{_OFFER}{token}"  # the callee jaxpr's debug info names it
    return call(offered, fun_transpose, residual_args, linear_args)


def _offered(callee):
    """The batched transpose a linear_call's callee was offered with, or None."""
    # (a JAX whose ClosedJaxpr and Jaxpr are one type may drop the ``.jaxpr`` accessor)
    src = getattr(getattr(getattr(callee, "jaxpr", callee), "debug_info", None), "func_src_info", None) or ""
    m = re.match(rf"{_OFFER}(\d+)\b", src)
    return _BATCHED_TRANSPOSES.get(int(m.group(1))) if m else None


@functools.lru_cache(maxsize=None)
def _register_linear_call_rules() -> None:
    from jax._src.custom_derivatives import linear_call_p
    from jax._src.interpreters import ad, batching

    if linear_call_p not in batching.fancy_primitive_batchers:
        batching.fancy_primitive_batchers[linear_call_p] = _linear_call_batched
    jax_rule = ad.primitive_jvps[linear_call_p]

    def jvp(primals, tangents, *, callee, transpose_thunk, num_callee_consts, num_res):
        """d(L(r)·x) = L(r)·dx + (∂ᵣ L(r)·x)·dr: JAX's rule where dr = 0, else its second term
        is the JVP of the function in its residuals (a kernel's tangent kernel, derived)."""
        k = num_callee_consts + num_res
        if all(type(t) is ad.Zero for t in tangents[:k]):
            return jax_rule(primals, tangents, callee=callee, transpose_thunk=transpose_thunk,
                            num_callee_consts=num_callee_consts, num_res=num_res)
        from jax.extend.core import jaxpr_as_fun

        params = dict(callee=callee, transpose_thunk=transpose_thunk, num_callee_consts=num_callee_consts,
                      num_res=num_res)
        fixed, lin = list(primals[:k]), list(primals[k:])
        out = linear_call_p.bind(*fixed, *lin, **params)
        f = jaxpr_as_fun(callee)
        # only the residuals that move are JVP operands: a zero made concrete would enter the
        # callee's own derivative as a tangent that is not linear
        moving = [i for i in range(k) if type(tangents[i]) is not ad.Zero]

        def of_moving(*xs):
            fx = list(fixed)
            for i, x in zip(moving, xs):
                fx[i] = x
            return tuple(f(*fx, *lin))

        moved = jax.jvp(of_moving, tuple(fixed[i] for i in moving), tuple(tangents[i] for i in moving))[1]
        if any(type(t) is not ad.Zero for t in tangents[k:]):
            dots = [ad.instantiate_zeros(t) for t in tangents[k:]]
            along = linear_call_p.bind(*fixed, *dots, **params)
            moved = [a + b for a, b in zip(along, moved)]
        return out, list(moved)

    ad.primitive_jvps[linear_call_p] = jvp


def _linear_call_batched(axis_data, args, dims, *, callee, transpose_thunk, num_callee_consts, num_res):
    """vmap of ``linear_call_p``: every linear operand gets the batch axis in front (a linear
    operand shared by the batch is broadcast, so that the transpose's outputs are batched
    too); constants and residuals keep theirs."""
    import jax.numpy as jnp
    from jax.custom_derivatives import linear_call as call
    from jax.extend.core import jaxpr_as_fun

    from jax._src.custom_derivatives import linear_call_p

    if all(d is None for d in dims):  # JAX calls a rule even when nothing is batched
        out = linear_call_p.bind(*args, callee=callee, transpose_thunk=transpose_thunk,
                                 num_callee_consts=num_callee_consts, num_res=num_res)
        return out, [None] * len(out)
    k = num_callee_consts + num_res
    offered = _offered(callee)
    plan = offered and offered(tuple(d is not None for d in dims[num_callee_consts:k]),
                               tuple(d is not None for d in dims[k:]))
    forward = jaxpr_as_fun(callee)
    if plan is not None:  # the call's own batched transpose: shared linear operands stay unbatched
        fixed = [x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(args[:k], dims[:k])]
        lin = [x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(args[k:], dims[k:])]
        fixed_axes = [None if d is None else 0 for d in dims[:k]]
        lin_axes = [None if d is None else 0 for d in dims[k:]]

        def fun_batched(fx, ln):
            return jax.vmap(lambda f, l: forward(*f, *l), in_axes=(fixed_axes, lin_axes))(fx, ln)

        def transpose_batched(fx, cts):
            return plan(list(fx[num_callee_consts:]), list(cts))

        # a vmap around this one batches the batched call again: the plan offers that level
        nested = getattr(plan, "batched", None)
        again = None if nested is None else (lambda rb, lb: nested(rb[num_callee_consts:], lb))
        out = linear_call(fun_batched, transpose_batched, fixed, lin, batched_transpose=again)
        return out, [0] * len(out)
    fixed, fixed_dims = list(args[:k]), list(dims[:k])
    lin = [jnp.broadcast_to(x, (axis_data.size,) + tuple(x.shape)) if d is None else jnp.moveaxis(x, d, 0)
           for x, d in zip(args[k:], dims[k:])]

    def fun(fx, ln):
        return jax.vmap(lambda f, l: forward(*f, *l), in_axes=(fixed_dims, 0))(fx, ln)

    def fun_transpose(fx, cts):
        t_jaxpr, t_consts = transpose_thunk()
        transposed = jaxpr_as_fun(t_jaxpr)
        return jax.vmap(lambda r, c: transposed(*t_consts, *r, *c),
                        in_axes=(fixed_dims[num_callee_consts:], 0))(fx[num_callee_consts:], cts)

    out = call(fun, fun_transpose, fixed, lin)
    return out, [0] * len(out)


def without_context_mesh(fn):
    """``fn`` run with no context mesh: JAX >= 0.11 calls a custom_partitioning's partition
    callback (and traces its lower_fn) under the caller's ``jax.set_mesh`` mesh, Explicit axes
    included, where the per-device code then lowers sharding constraints (a ``Sharding`` custom
    call XLA's CPU backend cannot run) and typed collectives. JAX 0.10 ran it with none."""
    @functools.wraps(fn)
    def bare(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
            return fn(*args, **kwargs)

    return bare


def has_explicit_axes(mesh) -> bool:
    """Whether some axis of ``mesh`` is Explicit (sharding in types: ``jax.set_mesh`` with
    ``AxisType.Explicit``), where a split is part of every traced value's type."""
    return any(str(t).endswith("Explicit") for t in (getattr(mesh, "axis_types", None) or ()))


def explicit_sharding(x):
    """The sharding in ``x``'s type where its mesh has Explicit axes (sharding in types), else
    None: what a contraction over a split axis is told its result takes (JAX asks for it
    there, ``out_sharding``, rather than choose)."""
    try:
        sharding = jax.typeof(x).sharding
    except Exception:  # noqa: BLE001 - a JAX without jax.typeof, or a value it cannot type
        return None
    mesh = getattr(sharding, "mesh", None)
    return sharding if mesh is not None and has_explicit_axes(mesh) else None


def reshard(x, sharding):
    """``x`` traced with ``sharding``: ``jax.sharding.reshard`` on a mesh of Explicit axes (where
    ``with_sharding_constraint`` only asserts), ``with_sharding_constraint`` otherwise."""
    if has_explicit_axes(sharding.mesh) and hasattr(jax.sharding, "reshard"):
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def auto_axes(fn, out_sharding):
    """``fn`` run with the mesh's Explicit axes made automatic (``jax.sharding.auto_axes``), its
    outputs given ``out_sharding``: code whose own partitioning XLA decides (a kernel's
    ``custom_partitioning``) inside a program of sharding in types."""
    return jax.sharding.auto_axes(fn, out_sharding=out_sharding)


def varying_axes(x) -> frozenset:
    """The manual mesh axes ``x`` varies over inside ``shard_map`` (JAX's varying-manual-axes
    type, ``{V:y}``); empty outside one, or where this JAX types no such thing."""
    try:
        aval = jax.typeof(x)
    except Exception:  # noqa: BLE001 - a JAX without jax.typeof, or a value it cannot type
        return frozenset()
    # JAX 0.10 keeps it in the aval's manual-axes type (``mat.varying``); JAX 0.6–0.9 as ``vma``
    mat = getattr(aval, "mat", None)
    return frozenset(getattr(mat, "varying", None) or getattr(aval, "vma", None) or ())


def varying_like(ct, like):
    """``ct`` over the manual axes ``like`` varies over, no more, no fewer: summed (``psum``)
    over those it varies over and ``like`` does not — the transpose of the implicit ``pvary``
    that met an invariant input with a varying one in the forward (attention's K, replicated,
    beside Q split over the manual axis: each device's dK is its part of the sum) — and cast
    to varying over those ``like`` varies over and it does not."""
    have, want = varying_axes(ct), varying_axes(like)
    if have - want:
        ct = jax.lax.psum(ct, tuple(sorted(have - want)))
    if want - have:
        axes = tuple(sorted(want - have))
        ct = jax.lax.pcast(ct, axes, to="varying") if hasattr(jax.lax, "pcast") else jax.lax.pvary(ct, axes)
    return ct


def shard_map(f, *, mesh, in_specs, out_specs, check: bool = False):
    """``jax.shard_map`` (JAX ≥ 0.7; ``jax.experimental.shard_map`` before, where the last
    argument was ``check_rep``)."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check)
    from jax.experimental.shard_map import shard_map as old  # pragma: no cover - older JAX

    return old(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check)


# ----------------------------------------------------------------------------- Triton


class _HostArray:
    """A NumPy array as a pointer argument of Triton's interpreter, which expects torch tensors
    (``data_ptr``, ``dtype``, storages to copy to and from a device): host memory already."""

    def __init__(self, array):
        self.array = array
        self.dtype = array.dtype

    def data_ptr(self) -> int:
        return self.array.ctypes.data


@functools.lru_cache(maxsize=None)
def _interpreter_accepts_numpy() -> None:
    """Let Triton's interpreter launch on ``_HostArray`` arguments: its host-copy steps (written
    for torch tensors on a device) pass them through."""
    from triton.runtime import interpreter

    init, restore = interpreter.GridExecutor._init_args_hst, interpreter.GridExecutor._restore_args_dev

    def init_args(self, args, kwargs):
        if any(isinstance(a, _HostArray) for a in args):
            return list(args), dict(kwargs)
        return init(self, args, kwargs)

    def restore_args(self, args_dev, args_hst, kwargs, kwargs_hst):
        if any(isinstance(a, _HostArray) for a in args_dev):
            return None
        return restore(self, args_dev, args_hst, kwargs, kwargs_hst)

    interpreter.GridExecutor._init_args_hst = init_args
    interpreter.GridExecutor._restore_args_dev = restore_args


@functools.lru_cache(maxsize=None)
def _interpreter_computes_bfloat16() -> None:
    """Let Triton's interpreter compute with bfloat16 the way a GPU does: it stores bfloat16 as
    its uint16 bits and, by design, does no arithmetic on them (triton-lang/triton#11584: a
    ``tl.dot`` of two bfloat16 tiles multiplied the bit patterns, values near 1e9). Here a
    bfloat16 dot takes its operands widened to float32 (exact: bfloat16 ⊂ float32; the GPU's
    mma multiplies exactly and accumulates in float32 too), and elementwise bfloat16 arithmetic
    is done in float32 and rounded to nearest-even bfloat16 (for + − × ÷ √ float32's 24 bits make
    that equal to one bfloat16 rounding)."""
    import ml_dtypes
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    def widen(h):
        return interpreter.TensorHandle(
            (np.asarray(h.data).astype(np.uint32) << 16).view(np.float32), tl.float32)

    def narrow(data):
        return np.asarray(data, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)

    def is_bf16(h):
        return h.dtype.scalar == tl.bfloat16

    builder = interpreter.InterpreterBuilder
    dot, binary, unary = builder.create_dot, builder.binary_op, builder.unary_op

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = (widen(h) if is_bf16(h) else h for h in (a, b))
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def binary_op(self, lhs, rhs, op):
        if not (is_bf16(lhs) or is_bf16(rhs)):
            return binary(self, lhs, rhs, op)
        out = binary(self, *(widen(h) if is_bf16(h) else h for h in (lhs, rhs)), op)
        if out.data.dtype != np.float32:  # a comparison
            return out
        return interpreter.TensorHandle(narrow(out.data), tl.bfloat16)

    def unary_op(self, arg, op):
        if not is_bf16(arg):
            return unary(self, arg, op)
        return interpreter.TensorHandle(narrow(op(widen(arg).data)), tl.bfloat16)

    cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        # to or from bfloat16 by value, through float32, rounded to nearest-even: the
        # interpreter cast an int to bfloat16 as its uint16 bits (ALiBi's distance ki − qi: a
        # NaN for a negative one) and truncated float32 to bfloat16
        to_bf16 = dst_type.scalar == tl.bfloat16
        if not (is_bf16(src) or to_bf16) or (is_bf16(src) and to_bf16):
            return cast(self, src, dst_type)
        value = widen(src).data if is_bf16(src) else np.asarray(src.data).astype(np.float32)
        if to_bf16:
            return interpreter.TensorHandle(narrow(value), tl.bfloat16)
        return cast(self, interpreter.TensorHandle(value, tl.float32), dst_type)

    # the create_* methods call self.binary_op / self.unary_op / self.cast_impl: patching these
    # covers them
    builder.create_dot, builder.binary_op, builder.unary_op = create_dot, binary_op, unary_op
    builder.cast_impl = cast_impl


def triton_interpret_call(kernel):
    """A generated Triton kernel (``pallas_kernels.triton_source.TritonKernel``) as a JAX
    function run by Triton's interpreter on the host (``jax.pure_callback``): NumPy semantics,
    float64 included. ``TRITON_INTERPRET=1`` must be set before triton is first imported."""
    import os

    import numpy as np

    if os.environ.get("TRITON_INTERPRET") != "1":
        os.environ["TRITON_INTERPRET"] = "1"
    _interpreter_accepts_numpy()
    _interpreter_computes_bfloat16()
    fn = kernel.function()
    aliased = dict((o, i) for i, o in kernel.aliases)

    def host(*inputs):
        ins = [np.ascontiguousarray(np.asarray(x)) for x in inputs]
        outs = [np.array(ins[aliased[k]], copy=True) if k in aliased else np.zeros(a.shape, a.dtype)
                for k, a in enumerate(kernel.out_avals)]
        fn[kernel.grid](*[_HostArray(x) for x in ins + outs])
        return tuple(outs)

    def call(*inputs):
        shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in kernel.out_avals)
        return list(jax.pure_callback(host, shapes, *inputs))

    return call


def jax_triton_call(kernel, compute_capability: int | None = None):
    """A generated Triton kernel launched through ``jax_triton.triton_call`` (CUDA).

    jax-triton compiles when it lowers and asks device 0 for its compute capability; given
    ``compute_capability`` (from the machine profile: ``Machine.arch``), it asks nothing, so a
    machine with no GPU lowers for CUDA too."""
    import jax_triton

    fn = kernel.jit_function()

    def call(*inputs):
        shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in kernel.out_avals]
        outs = jax_triton.triton_call(*inputs, kernel=fn, out_shape=shapes, grid=kernel.grid,
                                      num_warps=kernel.num_warps, num_stages=kernel.num_stages,
                                      input_output_aliases=dict(kernel.aliases),
                                      compute_capability=compute_capability)
        return list(outs) if isinstance(outs, (list, tuple)) else [outs]

    return call


def scan_counts(params) -> tuple:
    """(consts, carry) operand counts of a ``scan`` equation: JAX < 0.11 keeps them as the
    ``num_consts`` / ``num_carry`` parameters; JAX >= 0.11 as the FlatTree ``ft_in``
    (consts, carry, xs)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def bind_params(eqn) -> dict:
    """The parameters to ``bind`` a jaxpr equation's primitive with (JAX ≥ 0.7 returns a dict;
    before, a (subfuns, params) pair — no primitive moajax re-binds this way has subfuns)."""
    res = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(res, tuple):  # pragma: no cover - older JAX
        subfuns, res = res
        if subfuns:
            raise NotImplementedError(f"re-binding {eqn.primitive.name} with sub-functions")
    return res
