"""A DNF run as compiled code: an ONF per platform, one platform dispatch, the backward tied in.

    cpu_onf, gpu_onf = schedules(dnf, onf, path)   # derived for this machine / the GPU, or given
    run = dispatch(cpu_onf, gpu_onf)               # XLA loops on CPU, a Pallas kernel on CUDA

Inside one jitted function only the target platform's branch is compiled
(``compat.platform_dependent``). ``differentiable`` ties a forward to its tangent and its backward
(``jax.custom_jvp`` around a ``linear_call``): JAX differentiates every branch of a platform
dispatch and has no derivative rule for a Pallas kernel over a grid, so the tangents and the
cotangents must come from kernels of our own (the compiled tangent and adjoint kernels).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading

import numpy as np

from moajax import compat, machines
from moajax.onf import ONF, ONFError
from moajax.schedule import Preset, derive, derive_plan, residual_choice

IMPLEMENTATIONS = (None, "xla", "pallas", "pallas_interpret", "triton", "triton_interpret")
# the GPU ONF's backends: Pallas (its Triton backend), or the ONF's Triton source launched by
# jax-triton (``pallas_kernels.triton_source``); "_interpret": run on the CPU by an interpreter
GPU_BACKENDS = ("pallas", "pallas_interpret", "triton", "triton_interpret")


def gpu_machine(path: str = "pallas"):
    """The profile of this process's GPU, else the default GPU profile (to lower for CUDA);
    ``path``: the GPU path its kernels run through (``gpu_path``), which its spill check
    compiles."""
    import jax

    m = next((machines.for_device(d) for d in jax.devices() if d.platform in ("gpu", "cuda")), None)
    m = m or machines.load(machines.GENERIC_GPU_NAME)
    return m if path == m.gpu_path else dataclasses.replace(m, gpu_path=path)


def gpu_path(implementation) -> str:
    """The GPU path an implementation runs the GPU ONF through: the ONF's Triton source for
    "triton" and "triton_interpret", else Pallas."""
    return "triton" if implementation in ("triton", "triton_interpret") else "pallas"


def check_onf_argument(onf, who: str) -> None:
    if onf is not None and not isinstance(onf, (ONF, Preset)):
        raise TypeError(f"{who}: onf must be a moajax ONF or a Preset, got {type(onf).__name__}")


def check_residuals(residuals, who: str):
    """``schedule.residual_choice``: the residual policy, checked (labels as a tuple)."""
    return residual_choice(residuals, who)


def residual_policy(residuals, onf, who: str) -> str:
    """The residual policy of a call: its ``residuals`` keyword, or the Preset's choice."""
    residuals = check_residuals(residuals, who)
    chosen = getattr(onf, "residuals", None) if isinstance(onf, Preset) else None
    if chosen is None:
        return residuals
    chosen = check_residuals(chosen, f"{who}: the onf Preset")
    if residuals not in ("auto", chosen):
        raise ValueError(f"{who}: residuals={residuals!r} contradicts the onf Preset's residuals={chosen!r}")
    return chosen


def check_scale(scale, who: str, traced_ok: bool = False):
    """An attention's softmax scale: None, or a finite number — Python's, NumPy's or a
    concrete 0-d array's — returned as a float; with ``traced_ok``, a real 0-d array known
    only when the call runs (a jit argument, ``1 / jnp.sqrt(d)`` under jit) is returned as it
    is (its value unchecked: a call applies it as a product, ``api.dot_product_attention``)."""
    if scale is None:
        return None
    import jax

    dtype = np.dtype(getattr(scale, "dtype", np.float64))
    if isinstance(scale, bool) or dtype == np.bool_ or dtype.kind not in "iuf" and dtype.name != "bfloat16":
        raise TypeError(f"{who}: scale must be a real number, got {type(scale).__name__}")
    if np.ndim(scale) != 0:
        raise ValueError(f"{who}: scale must be a scalar, got shape {list(np.shape(scale))}")
    if isinstance(scale, jax.core.Tracer):
        if traced_ok:
            return scale
        raise TypeError(f"{who}: scale must be known while tracing (a Python number or a concrete array), "
                        f"got a traced {dtype.name} value")
    if not isinstance(scale, (int, float, np.floating, np.integer, np.ndarray, jax.Array)):
        raise TypeError(f"{who}: scale must be a real number, got {type(scale).__name__}")
    value = float(scale)
    if not math.isfinite(value):
        raise ValueError(f"{who}: scale must be finite, got {value}")
    return value


def check_flags(who: str, **flags) -> dict:
    """Each flag a bool known while tracing (a Python or NumPy bool, or a concrete 0-d bool
    array, as jax.nn takes is_causal): their values, else a named TypeError."""
    import jax

    out = {}
    for flag, given in flags.items():
        if isinstance(given, jax.Array) and not isinstance(given, jax.core.Tracer) and given.dtype == np.bool_ \
                and given.ndim == 0:
            given = bool(given)
        if not isinstance(given, (bool, np.bool_)):
            raise TypeError(f"{who}: {flag} must be a static bool, got {type(given).__name__}")
        out[flag] = bool(given)
    return out


def check_implementation(implementation, who: str) -> None:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{who}: implementation must be None, 'xla', 'pallas', 'pallas_interpret', 'triton' "
                         f"or 'triton_interpret', got {implementation!r}")


def onf_matches(onf: ONF, dnf) -> bool:
    """Was ``onf`` derived for ``dnf`` (the same inputs, and outputs of the same expressions)?"""
    return (len(onf.dnf.outputs) == len(dnf.outputs)
            and all(a.body is b.body for a, b in zip(onf.dnf.outputs, dnf.outputs))
            and onf.dnf.inputs == dnf.inputs)


def schedules(dnf, onf_key=None, path: str = "pallas") -> tuple:
    """(CPU ONF, GPU ONF) for a DNF: derived for this machine and the GPU, or from an explicit
    ONF (it runs on the kind of machine it names; the other kind gets its default) or Preset.
    ``path`` (``gpu_path``): the GPU path the GPU ONF runs through, whose compiler a GPU's
    spill check asks.
    Where no fused ONF fits a multi-output DNF, that side is a tuple of ONFs: the owner plan's
    kernels, else one per output (``schedule.derive_plan``)."""
    return _schedules(dnf, onf_key, path, repr(machines.local()), repr(gpu_machine(path)),
                      compat.default_dot_precision())


@functools.lru_cache(maxsize=512)
def _schedules(dnf, onf_key, path: str, local: str, gpu: str, precision: str) -> tuple:
    # keyed by this machine's profile too (``local``: its repr; a profile holds dicts), which
    # ``machines.using`` changes within a process, by the GPU profile (``gpu``: a profile set
    # in place of this process's GPU, as tests and offline reports set it), and by
    # jax.default_matmul_precision, which a GPU's float32 dots follow (``schedule.derive``)
    del local, gpu
    if isinstance(onf_key, ONF):
        if not onf_matches(onf_key, dnf):
            def said(d):  # what tells the two apart: the inputs, else the outputs
                if onf_key.dnf.inputs != dnf.inputs:
                    return f"inputs {[str(i) for i in d.inputs]}"
                return f"outputs {[o.name for o in d.outputs]}" + (
                    "" if [o.name for o in onf_key.dnf.outputs] != [o.name for o in dnf.outputs] else
                    " (the same names, other expressions: other options)")
            raise ONFError(f"{dnf.name}: the onf given was derived for another DNF ({onf_key.dnf.name}, "
                           f"{said(onf_key.dnf)}); these arguments give {said(dnf)}")
        onf_key.validate()
        try:  # a configured profile, or an unlisted GPU's (machines.generic_gpu)
            kind = machines.load(onf_key.target).kind
        except ValueError:
            kind = machines.local().kind
        if kind == "gpu":
            return derive(dnf, machines.local()), onf_key
        return onf_key, derive(dnf, gpu_machine(path))
    preset = onf_key if isinstance(onf_key, Preset) else Preset()
    cpu_preset = preset
    if precision != "highest" and "dot_precision" not in dict(preset.knobs) and has_gpu():
        # implementation="xla" on a GPU runs this ONF there: its float32 dots follow the
        # config too, as the GPU's own ONF's and XLA's (on a CPU the knob changes nothing)
        base = preset if preset.applies_to(machines.local()) else Preset()
        cpu_preset = dataclasses.replace(base, knobs=tuple(sorted(dict(base.knobs, dot_precision=precision).items())))
    cpu = derive_plan(dnf, machines.local(), cpu_preset)
    try:
        gpu = derive_plan(dnf, gpu_machine(path), preset)
    except ONFError as err:
        if has_gpu():
            raise
        gpu = err  # no GPU here: the CUDA branch is only ever lowered offline (see ``dispatch``)
    return cpu, gpu


schedules.cache_clear = _schedules.cache_clear


def compute_capability(onf) -> int:
    """The compute capability of the ONF's target GPU profile (``sm_80`` → 80): what jax-triton
    compiles for where no GPU can be asked (a CUDA lowering made on a CPU-only machine)."""
    from moajax import machines

    arch = machines.load(onf.target).arch
    digits = "".join(ch for ch in arch.removeprefix("sm_") if ch.isdigit())
    if not arch.startswith("sm_") or not digits:
        raise ValueError(f"{onf.dnf.name}: the target {onf.target!r} is not a CUDA profile (arch {arch!r})")
    return int(digits)


def has_gpu() -> bool:
    """Does this process see a CUDA device?"""
    import jax

    return any(d.platform in ("gpu", "cuda") for d in jax.devices())


def runs_on_gpu(implementation) -> bool:
    """Does a call with this ``implementation`` run the GPU's ONF: a GPU backend (their
    interpret modes too), or the default on a process that sees a GPU?"""
    return implementation in GPU_BACKENDS or (implementation is None and has_gpu())


@functools.lru_cache(maxsize=512)
def lowered(onf, backend: str, order: tuple | None = None):
    """The ONF lowered for one backend: "xla", "pallas" or "pallas_interpret"; a tuple of ONFs
    (``schedule.derive_plan``) runs them one after another, their outputs returned in the
    ``order`` of the output names (default: as the parts give them). A part reads the
    inputs and what the parts before it wrote (``schedule.staged_parts``: values shared by
    later kernels), by name; the first part's inputs are the plan's."""
    if isinstance(onf, tuple):
        parts = [lowered(o, backend) for o in onf]
        inputs = [i.name for i in onf[0].dnf.inputs]
        read = {i.name for part in onf for i in part.dnf.inputs}
        names = [o.name for part in onf for o in part.dnf.outputs]
        order = order or tuple(n for n in names if n not in read)

        def run(*args):
            env = dict(zip(inputs, args))
            for o, f in zip(onf, parts):
                res = f(*(env[i.name] for i in o.dnf.inputs))
                env.update(zip([x.name for x in o.dnf.outputs], res if isinstance(res, tuple) else (res,)))
            return tuple(env[n] for n in order)

        return run
    if backend == "xla":
        from moajax import lower_xla

        return lower_xla.lower(onf)
    if backend in ("triton", "triton_interpret"):
        from pallas_kernels import triton_source

        return triton_source.lower(onf, interpret=backend == "triton_interpret",
                                   compute_capability=None if backend == "triton_interpret" or has_gpu()
                                   else compute_capability(onf))
    import pallas_kernels

    return pallas_kernels.lower(onf, interpret=backend == "pallas_interpret")


def run_dnf(dnf, onf_key=None):
    """The DNF a call runs: ``dnf.collapsed`` where two adjacent axes merge (a vmapped
    RMSNorm's batch and rows: one axis of rows, so a GPU's programs take the unbatched
    kernel's row tiles, not rows of one batch element; the inputs and outputs reshaped, which
    moves no byte), else ``dnf``. Not where ``onf_key`` is an ONF derived for ``dnf`` itself,
    or a Preset tiling by name a dimension the merge removes (the major of a pair: the merged
    axis keeps the minor's name, so a tile of the rows ``n`` tiles the merged rows)."""
    flat = _collapsed(dnf)
    if flat is None:
        return dnf
    merged = {major for major, _ in flat[1]}
    if isinstance(onf_key, ONF):
        return flat[0] if onf_key.dnf.inputs == flat[0].inputs else dnf
    if isinstance(onf_key, Preset) and merged & set(dict(onf_key.tiles)):
        return dnf
    return flat[0]


@functools.lru_cache(maxsize=512)
def _collapsed(dnf):
    from moajax import dnf as D

    return D.collapsed(dnf)


@dataclasses.dataclass(frozen=True)
class KernelRun:
    """One kernel a traced function runs: its ``cpu`` ONF (XLA's), its ``gpu`` ONF (the
    Pallas/Triton kernel's; a tuple of ONFs for a plan of several kernels; the ``ONFError``
    where none fits), the ``implementation`` the call asked for."""

    cpu: object
    gpu: object
    implementation: str | None

    @property
    def onf(self):
        """The ONF (or plan) this process runs: the GPU's under a GPU implementation or on a
        GPU, else the CPU's (``dispatch``)."""
        gpu = self.implementation in GPU_BACKENDS or (self.implementation is None and has_gpu())
        if gpu and isinstance(self.gpu, ONFError):
            raise self.gpu
        return self.gpu if gpu else self.cpu


# every compiled run's kernel, by the index its name scope carries (``KERNEL_SCOPE``): what a
# traced program's operations say they run (``api.traced_onfs``). One index per kernel (the
# schedules are cached, so a kernel compiled again — a device's block, at each compile of a
# sharded program — finds its index), taken under a lock (threads tracing at once)
_KERNEL_RUNS: list = []
_KERNEL_INDEX: dict = {}
_KERNEL_LOCK = threading.Lock()
KERNEL_SCOPE = "moajax_kernel_"


def _kernel_index(cpu, gpu, implementation) -> int:
    # by identity: the list holds every registered ONF, so no id is reused
    key = (id(cpu), id(gpu), implementation)
    with _KERNEL_LOCK:
        if key not in _KERNEL_INDEX:
            _KERNEL_INDEX[key] = len(_KERNEL_RUNS)
            _KERNEL_RUNS.append(KernelRun(cpu, gpu, implementation))
        return _KERNEL_INDEX[key]


def kernel_run(index: int) -> KernelRun:
    """The kernel whose operations carry the name scope ``KERNEL_SCOPE`` + ``index``."""
    return _KERNEL_RUNS[index]


def compiled_run(dnf, onf_key=None, implementation=None, order: tuple | None = None):
    """``dispatch`` of the ``schedules`` of the DNF a call runs (``run_dnf``), as a function of
    ``dnf``'s own inputs returning its own outputs; its operations traced under a name scope
    that says which kernel they are (``kernel_run``: no effect on the compiled code)."""
    import jax

    flat = run_dnf(dnf, onf_key)
    cpu, gpu = schedules(flat, onf_key, gpu_path(implementation))
    dispatched = dispatch(cpu, gpu, implementation, order)
    scope = f"{KERNEL_SCOPE}{_kernel_index(cpu, gpu, implementation)}"

    def run(*args):
        with jax.named_scope(scope):
            return dispatched(*args)

    if flat is dnf:
        return run

    def call(*args):
        import jax.numpy as jnp

        out = run(*(jnp.reshape(a, i.shape) for a, i in zip(args, flat.inputs)))
        outs = tuple(jnp.reshape(y, o.shape) for y, o in zip(out if isinstance(out, tuple) else (out,), dnf.outputs))
        return outs if isinstance(out, tuple) else outs[0]

    return call


def dispatch(cpu_onf: ONF, gpu_onf: ONF, implementation=None, order: tuple | None = None):
    """One JAX function running ``cpu_onf`` through XLA on a CPU and ``gpu_onf`` through Pallas
    on CUDA (``implementation`` None), or one backend everywhere ("xla", "pallas",
    "pallas_interpret": the Pallas kernel run on the CPU); ``order``: the DNF's output names
    (the order a plan of several ONFs returns its outputs in)."""
    from moajax import compat

    if implementation == "xla":
        return lowered(cpu_onf, "xla", order)
    if isinstance(gpu_onf, ONFError) and implementation in GPU_BACKENDS:
        raise gpu_onf
    if implementation in GPU_BACKENDS:
        return lowered(gpu_onf, implementation, order)
    xla = lowered(cpu_onf, "xla", order)
    if isinstance(gpu_onf, ONFError):
        # no GPU ONF fits, on a machine without a GPU (``schedules``): a CPU call must not fail
        # for it, and a CUDA lowering made here (offline) carries the XLA loops, saying so
        import warnings

        warnings.warn(f"{gpu_onf} — lowered for CUDA, this kernel runs as XLA loops, not Pallas (where a "
                      "Preset meant for the CPU alone chose this, give it target='cpu': the GPU schedule is then "
                      "derived)",
                      RuntimeWarning, stacklevel=3)
        return functools.partial(compat.platform_dependent, cpu=xla, cuda=xla, default=xla)
    try:
        cuda = lowered(gpu_onf, "pallas", order)
    except ONFError as err:
        if has_gpu():
            raise
        # a GPU ONF the Pallas lowering refuses, on a machine without a GPU: as one that does
        # not fit, a CPU call must not fail for it (the CUDA branch carries the XLA loops)
        return dispatch(cpu_onf, err, implementation, order)
    return functools.partial(compat.platform_dependent, cpu=xla, cuda=cuda, default=xla)


def _first_order_only(run, name: str, hint: str):
    """``run`` (a forward that also saves residuals) with a derivative that says it has none:
    its saved values have no tangent kernel of their own."""
    import jax

    g = jax.custom_jvp(run)

    def refuse(args, dots):
        raise NotImplementedError(
            f"{name}: a second derivative (jvp or grad of a derivative) of a call whose forward saves "
            f"residuals for its backward is not built; {hint}")

    g.defjvp(refuse)
    return g


def any_over_batch(flags):
    """∨/ flags, and under ``jax.vmap`` ∨/ over the whole batch too, unbatched: a
    ``lax.cond`` on it runs one branch (on a batched predicate it runs both, a select), under
    ``vmap(jit(…))`` as well, where the predicate is traced inside the jit unbatched and
    batched afterwards. The branch it picks must hold for every element where any needs it.
    ``flags``: booleans (held constant: a custom_vmap has no derivative rule)."""
    import jax
    import jax.numpy as jnp
    from jax import custom_batching

    @custom_batching.custom_vmap
    def any_of(x):
        return jnp.any(x)

    @any_of.def_vmap
    def _(axis_size, in_batched, x):
        return any_of(x), False

    return any_of(jax.lax.stop_gradient(flags))


def zero_cotangent(x):
    """The cotangent of a non-differentiable input: float0 zeros for ints and bools, as JAX gives."""
    import jax

    return np.zeros(np.shape(x), dtype=jax.dtypes.float0)


def differentiable(run, backward, n_outputs: int, saving=None, tangent=None, floats=(), float_outputs=(),
                   name: str = "kernel", second_order: str | None = None, backward_batched=None,
                   tangent_reads_saved: bool = False):
    """``run`` with its derivatives: ``tangent(args, dots) -> the tangents of the floating
    outputs`` (forward mode: ``jax.jvp``) and ``backward(args, saved, outs, cotangents) -> one
    cotangent per arg`` (reverse mode: ``jax.grad``), each the other's transpose; ``backward``
    takes ``wrt`` too, the args whose cotangents are asked for (the others' tangents were
    symbolic zeros: ``jax.grad(…, argnums=…)`` of weights, not data), and may give anything
    in the others' places (a kernel's adjoint derives only the asked ones).

    ``floats``/``float_outputs`` flag the floating args/outputs: the others get float0 tangents
    and cotangents, as in JAX. The two are tied by ``jax.custom_jvp`` around a ``linear_call``
    of the tangent whose transpose is the backward, so reverse mode never transposes the
    tangent's loops: it runs the backward. The residuals are the primal inputs and, where
    ``saving()`` (asked when the function is first differentiated) gives a forward computing
    the outputs and then the values the backward reads instead of recomputing them, those
    saved values (``saved``; else empty) and the outputs themselves (``outs``; else None),
    which the papers' identities read. A second derivative runs the derivatives of the
    tangent and the backward, and where values are saved, those of the saving forward (a
    kernel's: ``Kernel.with_row_statistics``); ``second_order``, a hint, says that the saving
    forward has none (a hand-written walk: the ring's), and a second derivative through it
    raises NotImplementedError with the hint.

    ``backward_batched(levels, args, saved, outs, cotangents, wrt)``: the backward of the call
    under ``jax.vmap`` (``levels``: per vmap, innermost first, which args have its batch axis —
    the outermost first in the arrays; the saved values, outputs and floating cotangents have
    every one), where an arg a batch shares gets one cotangent, the sum over that batch,
    computed inside its kernel: ``jax.grad`` of a
    ``vmap`` over examples with shared weights (the Equinox way) then holds no cotangent a
    batch element (a [B, D, F] weight gradient before its sum). ``tangent_reads_saved``: the
    tangent is ``tangent(args, dots, saved)`` and reads the saved values too."""
    import jax

    from moajax import compat

    @jax.custom_jvp
    def f(*args):
        return run(*args)

    def f_jvp(args, dots):
        from jax.custom_derivatives import SymbolicZero

        run_saving = saving() if saving is not None else None
        if run_saving is None:
            outs = f(*args)  # through ``f``, so that a second derivative runs this rule again
            res = (tuple(args), (), None)
        else:
            if second_order is not None:
                run_saving = _first_order_only(run_saving, name, second_order)
            both = run_saving(*args)
            outs = both[:n_outputs] if n_outputs > 1 else both[0]
            res = (tuple(args), tuple(both[n_outputs:]), tuple(both[:n_outputs]))
        tup = tuple(outs) if n_outputs > 1 else (outs,)
        # the linear operands: the tangents that move (a symbolic zero is no operand, so that
        # reverse mode, which transposes the call, finds every operand linear)
        moving = [i for i, (d, fl) in enumerate(zip(dots, floats)) if fl and not isinstance(d, SymbolicZero)]
        if moving and any(float_outputs):
            still = [i for i, fl in enumerate(floats) if fl and i not in moving]

            def forward(res, ds):
                full = dict(zip(moving, ds))
                full.update({i: jax.numpy.zeros(np.shape(res[0][i]), res[0][i].dtype) for i in still})
                ordered = [full[i] for i in sorted(full)]
                return tuple(tangent(res[0], ordered, res[1]) if tangent_reads_saved else tangent(res[0], ordered))

            def transpose(res, cts):
                args, saved, outs = res
                it = iter(cts)
                full = [next(it) if fl else zero_cotangent(o) for o, fl in zip(tup, float_outputs)]
                grads = backward(args, saved, outs, full, tuple(moving))
                # inside shard_map, each cotangent as varying as its input: an input replicated
                # over a manual axis beside one split over it gets the sum of every device's part
                # (``compat.varying_like``; its kernel's output varied, and JAX refused it)
                return [compat.varying_like(grads[i], args[i]) for i in moving]

            # what the offer keeps is static (it outlives this trace): counts and shapes
            n_args, n_saved, has_outs = len(res[0]), len(res[1]), res[2] is not None
            out_shapes = [np.shape(o) for o in tup]

            def offer(levels):
                """The batched call's transpose (``compat.linear_call``), or None where the batch
                is not the kernel's batch: the args' (some), the saved values' and outputs' (all).
                ``levels``: the args' flags of the vmaps already inside, innermost first (a vmap of
                a vmap batches the batched call again: its plan offers the next level)."""
                def batched_transpose(res_batched, lin_batched):
                    flags = tuple(res_batched[:n_args])
                    if (backward_batched is None or not any(flags) or not all(res_batched[n_args:])
                            or any(lin_batched[j] != flags[i] for j, i in enumerate(moving))):
                        return None
                    lv = levels + (flags,)

                    def plan(leaves, cts):
                        args, saved = leaves[:n_args], leaves[n_args:n_args + n_saved]
                        if any(f and np.size(a) == 0 for a, f in zip(args, flags)):
                            # an empty batch: each cotangent 0 (a shared arg's: a sum over nothing)
                            return [jax.numpy.zeros_like(args[i]) for i in moving]
                        outs = leaves[n_args + n_saved:] if has_outs else None
                        it = iter(cts)
                        full = [next(it) if fl else np.zeros(shape, jax.dtypes.float0)
                                for shape, fl in zip(out_shapes, float_outputs)]
                        grads = backward_batched(lv, args, saved, outs, full, tuple(moving))
                        return [compat.varying_like(grads[i], args[i]) for i in moving]

                    plan.batched = offer(lv)
                    return plan

                return batched_transpose

            flowing = iter(compat.linear_call(forward, transpose, res, [dots[i] for i in moving],
                                              batched_transpose=offer(())))
        else:  # nothing moves, or nothing can: zero tangents
            flowing = iter(jax.numpy.zeros_like(o) for o in tup)
        out_dots = tuple(next(flowing) if fl else zero_cotangent(o) for o, fl in zip(tup, float_outputs))
        return outs, (out_dots if n_outputs > 1 else out_dots[0])

    f.defjvp(f_jvp, symbolic_zeros=True)
    # jitted, so that a call outside ``jax.jit`` (eager, or eager ``jax.grad``) compiles the
    # kernel once: the custom rules' eager implementations run their jaxprs one operation
    # at a time, each compiled on its own; under ``jax.jit`` this is an inlined call
    return jax.jit(f)


__all__ = ["schedules", "lowered", "dispatch", "differentiable", "KernelRun", "kernel_run", "gpu_machine", "gpu_path", "has_gpu", "zero_cotangent"]
