"""``@moajax.kernel``: a Python function written in ``moajax.moa`` becomes a kernel.

    @kernel(example=dict(t=8, s=12, h=4, e=6))
    def attention(query: "t h", key: "s h", value: "s e", *, scale=None):
        ...

Each positional parameter's annotation names its dimensions; keyword-only parameters are
static (hashable) options. The kernel is traced once per (shapes, dtypes, options) into an
array expression and ψ-reduced to a DNF (cached). Calling it runs compiled code: the DNF's
ONF for this machine lowered to XLA on a CPU, to Pallas on CUDA (``moajax.runtime``), with
``jax.grad`` running the compiled adjoint kernel (``Kernel.adjoint``) and ``jax.jvp`` the
compiled tangent kernel (``Kernel.tangent``), both derived in the algebra.
``k.reference(...)`` runs the DNF → JAX reference instead; ``k.onf(...)`` is the ONF that runs.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
from typing import Callable

import numpy as np

from moajax import compat
from moajax import dnf as D
from moajax import identities as _identities
from moajax import moa
from moajax import psi as _psi
from moajax import reference as _reference
from moajax import shard

REGISTRY: dict[str, "Kernel"] = {}
RESERVED = ("onf", "implementation", "residuals")  # keywords of a call, not kernel options


@dataclasses.dataclass(frozen=True)
class Param:
    name: str
    dims: tuple


def _spec_of(x):
    """(shape, dtype) of an array, a jax.ShapeDtypeStruct or a bare shape tuple (float32)."""
    if isinstance(x, tuple) and all(isinstance(s, (int, np.integer)) for s in x):
        return tuple(int(s) for s in x), np.dtype(np.float32)
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return tuple(int(s) for s in x.shape), moa._dtype(x.dtype)
    raise TypeError(f"expected an array, a jax.ShapeDtypeStruct or a shape tuple, got {type(x).__name__}")


def _recorded(name, inputs, outs, names, applied=()) -> "_psi.Derivation":
    """The derivation of a kernel's DNF, rule by rule, and the identities applied after it:
    recorded only when asked for (``Kernel.derivation``) — the rules' printed terms cost
    more than the reduction, which runs unrecorded when the kernel is built."""
    der = _psi.reduce_to_dnf(name, inputs, outs, names)[1]
    return _psi.Derivation(der.name, der.steps + tuple(_psi.Step(a.rule, a.before, a.after, 0) for a in applied))


def _fresh_prefix(first: str, stem: str, suffixes, taken) -> str:
    """``first`` (d_, t_, saved), else stem2_, stem3_, …: the first prefix that, put before each
    of ``suffixes``, names nothing in ``taken`` — so a derived kernel's names never shadow its
    inputs (the adjoint of an adjoint reads d_out and out: out's cotangent cannot be d_out)."""
    taken = set(taken)
    return next(pre for pre in itertools.chain([first], (f"{stem}{i}_" for i in itertools.count(2)))
                if not {f"{pre}{s}" for s in suffixes} & taken)


def _saved_names(params, names, n: int) -> tuple:
    """The names of a saving forward's ``n`` statistics (saved0, …), beside its parameters and
    its primal outputs ``names``."""
    pre = _fresh_prefix(D.SAVED, D.SAVED, range(n), {p.name for p in params} | set(names))
    return tuple(f"{pre}{i}" for i in range(n))


# nodes whose value is read, not computed: recomputed anywhere, they are the same bits
_EXACT_NODES = (moa.Input, moa.Literal, moa.Iota, moa.Cell, moa.Psi, moa.Take, moa.Drop, moa.Reverse, moa.Rotate,
                moa.Transpose, moa.Reshape, moa.Cast, moa.Name, moa.StopGradient, moa.Catenate, moa.Omega)
_EXACT_MAPS = ("maximum", "minimum", "neg", "abs", "where")  # exactly rounded whatever the context
SELECTED = "selection_operand"  # the label of a selection's operand, which a backward reads saved


def _unread_suffix(unread) -> str:
    """A derived kernel's name's mark of the statistics left out (``_without_rounded0``):
    kernels that save other statistics are other kernels, of other names."""
    if not unread:
        return ""
    return "_without" + "".join("_" + "".join(c if c.isalnum() else "_" for c in "".join(map(str, i)))
                                for i in unread)


def _statistic_ids(outputs, stats) -> list:
    """Per statistic (``Kernel.row_statistics``), what it is, whatever the shapes: an output's
    value before rounding ("rounded", i), a labelled value (label, k: its k-th of that label),
    another held-constant reduction ("held", k). Not its position in the list: a device's block
    of a sharded call can have fewer statistics (one larger than the block's output is none)."""
    rounded = {id(o.arg): i for i, o in enumerate(outputs) if isinstance(o, moa.Cast)}
    seen: dict = {}
    out = []
    for x in stats:
        if id(x) in rounded:
            out.append(("rounded", rounded[id(x)]))
            continue
        kind = x.label if isinstance(x, moa.Name) else "held"
        seen[kind] = seen.get(kind, -1) + 1
        out.append((kind, seen[kind]))
    return out


def _dims_owner(params, shapes):
    """``own(names, shape)``: the dims of a derived kernel's further argument, each renamed
    (n2, n3, …) where an input already names it at another extent — a kernel matches dims by
    name across its arguments, but an output may keep an input's dim name at another extent
    (x ⧺ y, k△x keep x's n)."""
    extent_of = {d: s for p, shape in zip(params, shapes) for d, s in zip(p.dims, shape)}

    def own(names_, shape):
        out = []
        for d, s in zip(names_, shape):
            name, k = d, 1
            while extent_of.setdefault(name, s) != s:
                k += 1
                name = f"{d}{k}"
            out.append(name)
        return tuple(out)

    return own


def _selection(x) -> bool:
    return isinstance(x, moa.Reduce) and x.monoid.name in ("max", "min")


def _exact(x, inexact_cells=frozenset()) -> bool:
    """Is every evaluation of ``x`` the same value, bit for bit (index operations, selections
    and sign changes of the inputs: nothing rounds)? A cell of an Ω is as exact as the
    argument it is cut from (``inexact_cells``: the uids of those that are not)."""
    return all(isinstance(y, _EXACT_NODES) and y.uid not in inexact_cells or _selection(y)
               or (isinstance(y, moa.Map) and y.op.name in _EXACT_MAPS) for y in moa.nodes(x))


def _is_selected(x) -> bool:
    return isinstance(x, moa.Name) and (x.label == SELECTED or (
        x.label.startswith(SELECTED) and x.label[len(SELECTED):].isdigit()))


def label_selections(outputs) -> tuple:
    """``outputs`` with the operand A of each selection the derivative flows through — ⌈/A or
    ⌊/A, not held constant (``moa.stop_gradient``) — labelled ``selection_operand…`` where A
    rounds (of A ⌈.op B, the rounded ones of A and B).
    ⌈/A's adjoint compares A with ⌈/A (``moajax.adjoint``); a DNF recomputes A in each, and
    two evaluations of one sum in different fusions may round differently, so the maximum
    would equal no element and the gradient would vanish (a jitted and an eager backward of
    one kernel disagreed: test_adjoint). Saved once by the forward and read by the backward,
    A is one value (``row_statistics``)."""
    operands, stack, seen, inexact = [], list(outputs), set(), set()
    while stack:
        x = stack.pop()
        if x.uid in seen or isinstance(x, moa.StopGradient):
            continue
        seen.add(x.uid)
        if _selection(x) and not isinstance(x.arg, moa.Name) and not _exact(x.arg, inexact):
            operands.append(x.arg)
        if isinstance(x, moa.Inner) and x.monoid.name in ("max", "min"):
            # A ⌈.op B selects among the a op b: one correctly rounded op over saved operands
            # is the same bits wherever it is recomputed (no product to fuse into an FMA)
            operands += [y for y in (x.a, x.b) if not isinstance(y, moa.Name) and not _exact(y, inexact)]
        stack.extend(x.children)
        if isinstance(x, moa.Omega):  # its body after its arguments: their cells' exactness first
            inexact.update(c.uid for c, a in zip(x.cells, x.args) if not _exact(a, inexact))
            stack.insert(0, x.body)
    taken = {y.label for o in outputs for y in moa.nodes(o) if isinstance(y, moa.Name)}
    unique = list({a.uid: a for a in operands}.values())
    if not unique:
        return tuple(outputs)
    mapping = {a: moa.name(D.fresh_name(SELECTED, taken), a) for a in unique}
    return tuple(moa.substitute(o, mapping) for o in outputs)


class Kernel:
    """A kernel defined in the algebra. ``dnf()``, ``derivation()``, ``expression()``, call."""

    def __init__(self, fn: Callable, example: dict | None = None, name: str | None = None,
                 outputs: tuple | None = None, dims: dict | None = None, identities: Callable | None = None):
        self.fn = fn
        # identities(dnf, specs, options, batches=()) -> (dnf', applied): rewrites of the
        # ψ-reduced DNF that keep its meaning (``moajax.identities``; an adjoint reading what its
        # forward saved); ``batches``: the in_batched flags of each ``batched`` around the
        # kernel, innermost first (a vmap's batched kernel passes its own on)
        self._identities = identities
        self.name = name or fn.__name__
        self.example = dict(example or {})
        self.output_names = outputs
        sig = inspect.signature(fn)
        self.params: list[Param] = []
        self.options: dict = {}
        for p in sig.parameters.values():
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                ann = (dims or {}).get(p.name, p.annotation)
                if isinstance(ann, str) and len(ann) >= 2 and ann[0] == ann[-1] and ann[0] in "'\"":
                    ann = ast.literal_eval(ann)  # from __future__ import annotations quotes it
                if not isinstance(ann, str):
                    raise TypeError(
                        f"kernel {self.name}: parameter {p.name!r} needs a dims annotation such as \"t h\""
                    )
                self.params.append(Param(p.name, tuple(ann.split())))
            elif p.kind == p.KEYWORD_ONLY:
                if p.name in RESERVED:
                    raise TypeError(f"kernel {self.name}: option name {p.name!r} is reserved for calls {RESERVED}")
                self.options[p.name] = p.default
            else:
                raise TypeError(f"kernel {self.name}: *args/**kwargs are not supported")
        functools.update_wrapper(self, fn)
        self._cache: dict = {}
        self._compiled: dict = {}
        self._derived: dict = {}  # kernels derived from this one: adjoints, batched, saving
        # how an axis that no plain split over devices honours is lifted over a mesh axis all
        # the same (``moajax.shard.partitioned``; attention's sequence: ``moajax.ring``); None:
        # none. A derived kernel (the saving forward, an adjoint, the tangent) reads its primal's
        self._mesh_lift = None
        self._lift_from = None
        self._batch_of = None  # a batched kernel's (primal, in_batched, summed): ``batched``
        self._rows_of = None  # (rows kernel, count) of a kernel over leading axes
        self._wrt = None  # an adjoint's: the args whose cotangents are its outputs (``adjoint``)

    @property
    def mesh_lift(self):
        """The mesh lifting of this kernel: its own, or — for a kernel derived from another —
        the primal's at the time of the call (set on the primal after the derived kernel was
        cached, it still reaches it)."""
        if self._batch_of is not None:  # under Ω: the primal's, one axis further in
            primal, flags, summed = self._batch_of
            lift = primal.mesh_lift
            return None if lift is None else shard.UnderOmega(lift, primal, flags, summed)
        return self._mesh_lift if self._lift_from is None else self._lift_from.mesh_lift

    @mesh_lift.setter
    def mesh_lift(self, lift):
        self._mesh_lift = lift

    # ---- tracing
    def _sign(self, fn, extra: tuple, name: str, doc: str) -> None:
        """Give a derived kernel's definition ``fn`` this kernel's array parameters, then the
        ``extra`` ones, then its options (keyword-only): the signature ``Kernel`` reads."""
        params = [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                  for p in [p.name for p in self.params] + list(extra)]
        params += [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=v) for k, v in self.options.items()]
        fn.__signature__ = inspect.Signature(params)
        fn.__name__, fn.__doc__ = name, doc

    # (shapes, dtypes) per argument, options → the output names, where they depend on the
    # shapes: a batched kernel's are its cell's (``batched``)
    _names_at = None

    def _names_for(self, outs) -> tuple:
        """The output names: the declared ones, else out (one output) or out0, out1, …"""
        return self.output_names or (("out",) if len(outs) == 1 else tuple(f"out{i}" for i in range(len(outs))))

    def cell_names(self, key) -> tuple | None:
        """The output names of the kernel at ``key`` (``_key``: shapes and dtypes, options) where
        they are not declared but matter (a saving forward's statistics), else None."""
        return self._names_at(key) if self._names_at is not None else None

    def define(self, *arrays: moa.Array, **options) -> moa.Array:
        """Apply the definition to algebra arrays (to compose kernels inside other kernels)."""
        return self.fn(*arrays, **options)

    def _check_options(self, options):
        unknown = set(options) - set(self.options)
        if unknown:
            raise TypeError(f"{self.name}: unknown option(s) {sorted(unknown)}; options are {sorted(self.options)}")
        for k, v in options.items():
            try:
                hash(v)
            except TypeError:
                raise TypeError(f"{self.name}: option {k!r} must be hashable (a static value), got {type(v).__name__}")

    def _key(self, specs, options):
        self._check_options(options)
        if len(specs) != len(self.params):
            raise TypeError(f"{self.name}: expected {len(self.params)} arrays ({', '.join(p.name for p in self.params)}), got {len(specs)}")
        shapes = []
        sizes: dict = {}
        for p, x in zip(self.params, specs):
            shape, dtype = _spec_of(x)
            if len(shape) != len(p.dims):
                raise ValueError(
                    f"{self.name}: argument {p.name!r} must have rank {len(p.dims)} ({' '.join(p.dims)}), got shape {shape}"
                )
            for d, s in zip(p.dims, shape):
                if s == 0:  # (ψ over an empty axis has no tile to lift: name it here, not in the scheduler)
                    raise ValueError(f"{self.name}: dimension {d!r} of argument {p.name!r} is 0 (shape {shape}); "
                                     f"every dimension must be at least 1")
                prev = sizes.setdefault(d, (s, p.name))
                if prev[0] != s:
                    raise ValueError(
                        f"{self.name}: dimension {d!r} is {prev[0]} in argument {prev[1]!r} but {s} in argument {p.name!r}"
                    )
            shapes.append((shape, dtype))
        return tuple(shapes), tuple(sorted(options.items()))

    def _build(self, specs, options):
        key = self._key(specs, options)
        hit = self._cache.get(key)
        if hit is None:
            inputs = tuple(
                moa.array(p.name, shape, p.dims, dtype) for p, (shape, dtype) in zip(self.params, key[0])
            )
            expr = self.fn(*inputs, **options)
            outs = expr if isinstance(expr, tuple) else (expr,)
            for o in outs:
                if not isinstance(o, moa.Array):
                    raise TypeError(f"{self.name}: the definition must return moa arrays, got {type(o).__name__}")
            names = self.cell_names(key) or self._names_for(outs)
            dnf, _ = _psi.reduce_to_dnf(self.name, inputs, outs, names, record=False)
            if self._rows_of is not None:
                self._check_rows(dnf, key)
            applied = ()
            if self._identities is not None:
                self._cache[("before identities", key)] = dnf
                dnf, applied = self._identities(dnf, specs, options)

            hit = (inputs, expr, dnf, functools.partial(_recorded, self.name, inputs, outs, names, applied),
                   _reference.to_jax(dnf))
            self._cache[key] = hit
        return hit

    def _check_rows(self, dnf, key) -> None:
        """A kernel over leading axes (``over_leading_axes``) must ψ-reduce to its rows kernel:
        merged, its DNF is the rows kernel's at [rows, …] (the same bodies)."""
        import jax

        rows, count = self._rows_of
        (shape, dt), *rest = key[0]
        others = [jax.ShapeDtypeStruct(s, d) for s, d in rest]
        if any(s == 1 for s in shape[:count + 1]):
            # an axis of extent 1 is no variable of the DNF (a device's block of a split batch):
            # the definition is checked where each is 2, the same expression
            wider = tuple(max(s, 2) for s in shape[:count + 1]) + tuple(shape[count + 1:])
            self.dnf(jax.ShapeDtypeStruct(wider, dt), *others, **dict(key[1]))
            return
        flat = jax.ShapeDtypeStruct((int(np.prod(shape[:count + 1])),) + tuple(shape[count + 1:]), dt)
        want = rows.dnf(flat, *others, **dict(key[1]))
        got = D.collapsed(dnf)
        if got is None or [o.body for o in got[0].outputs] != [o.body for o in want.outputs]:
            raise ValueError(f"{self.name}: its definition over {count} more leading axes does not reduce to the "
                             "kernel on rows (not polymorphic in its rank): call it on rows")

    def dnf_before_identities(self, *specs, **options):
        """The DNF for these argument shapes before the papers' identities rewrite it
        (``moajax.identities``; the same DNF for a kernel that has none): what ψ-reduction
        alone derives, whatever the extents."""
        specs = specs or self.example_specs()
        dnf = self._build(specs, options)[2]
        return self._cache.get(("before identities", self._key(specs, options)), dnf)

    def expression(self, *specs, **options) -> moa.Array:
        """The un-reduced array expression for these argument shapes."""
        return self._build(specs or self.example_specs(), options)[1]

    def dnf(self, *specs, **options):
        """The DNF for these argument shapes (``example_specs()`` when none are given)."""
        return self._build(specs or self.example_specs(), options)[2]

    def derivation(self, *specs, **options):
        """The ψ-reduction, rule by rule."""
        return self._build(specs or self.example_specs(), options)[3]()

    def reference(self, *arrays, **options):
        """Run the DNF → JAX reference (the test oracle: correct rather than fast)."""
        return self._build(arrays, options)[4](*arrays)

    def example_specs(self, dtype=np.float32):
        """Argument specs from the ``example`` dimension sizes (for the CLI and docs)."""
        missing = {d for p in self.params for d in p.dims} - set(self.example)
        if missing:
            raise ValueError(f"{self.name}: no example size for dimension(s) {sorted(missing)}")
        import jax

        return tuple(jax.ShapeDtypeStruct(tuple(self.example[d] for d in p.dims), dtype) for p in self.params)

    def __call__(self, *arrays, onf=None, implementation=None, residuals="auto", **options):
        """Run the kernel compiled (see the module docstring); differentiable by ``jax.grad``.

        ``onf``: an ONF derived for exactly these shapes, or a ``Preset`` applied on top of the
        default schedule; ``implementation``: None (XLA on CPU, Pallas on CUDA), "xla",
        "pallas" or "pallas_interpret" (the Pallas kernel run on the CPU); ``residuals``: what
        the forward saves for the backward ("auto" or "none", see ``compiled``)."""
        fn = self.compiled(*arrays, onf=onf, implementation=implementation, residuals=residuals, **options)
        dnf = self._build(arrays, options)[2]
        lift = self.mesh_lift.for_dnf(dnf, options, onf) if self.mesh_lift else None
        plain = functools.partial(self.dnf_before_identities, *arrays, **options)
        arrays = shard.conform(dnf, arrays, self.name, lift, plain)
        explicit = shard.explicit_out_specs(dnf, arrays, self.name, lift, plain)
        if explicit is not None:  # sharding in types: the kernel partitioned as under automatic axes
            return compat.auto_axes(fn, explicit if len(explicit) > 1 else explicit[0])(*arrays)
        return fn(*arrays)

    def onf(self, *arrays, onf=None, implementation=None, **options):
        """The ONF a call with these arguments runs (on this process's default platform)."""
        from moajax import runtime

        runtime.check_onf_argument(onf, self.name)
        runtime.check_implementation(implementation, self.name)
        dnf = self._build(arrays, options)[2]
        cpu, gpu = runtime.schedules(runtime.run_dnf(dnf, onf), onf, runtime.gpu_path(implementation))
        if runtime.runs_on_gpu(implementation):
            if isinstance(gpu, Exception):  # no GPU ONF fits (``runtime.schedules``)
                raise gpu
            return gpu
        return cpu

    def compiled(self, *specs, onf=None, implementation=None, residuals="auto", **options) -> Callable:
        """The compiled function of the arrays for these shapes and options (cached), with its
        derivatives (``runtime.differentiable``): ``jax.jvp`` runs the compiled tangent kernel
        (``tangent``), ``jax.grad`` the compiled adjoint kernel (``adjoint``).

        ``residuals`` (or a ``Preset``'s ``residuals``): "save" saves the forward's row
        statistics (``row_statistics``: a labelled or held-constant reduction with fewer axes
        than an output it serves and no more elements, e.g. a softmax's max and denominator) and its outputs
        for the backward to read (the papers' identities read them: ``moajax.identities``) —
        those it reads (``statistics_read``);
        "auto" does so where the cost model counts fewer flops for forward and backward
        together; "none" saves only the inputs, and the backward reruns the saving forward and
        then the adjoint reading what it saved where that counts fewer flops than the adjoint
        recomputing the statistics in its own kernels (``_rerun_pays``; attention's does), else
        runs the latter; "recompute" saves only the inputs and always runs the latter; a tuple
        of labels (``moa.name``) saves those values too, whatever their size (paper IV's MLP keeps U:
        ``("gate",)``), and the backward reads them instead of recomputing."""
        from moajax import adjoint as _adjoint
        from moajax import machines, runtime
        from moajax.onf import ONF
        from moajax.schedule import Preset

        runtime.check_onf_argument(onf, self.name)
        runtime.check_implementation(implementation, self.name)
        residuals = runtime.residual_policy(residuals, onf, self.name)
        # the profiles too: ``machines.using`` changes what a call derives within a process, and
        # so does a GPU profile set in place of this process's (``runtime.gpu_machine``; before
        # it was keyed, a second profile in one process ran the first one's GPU ONFs); and
        # jax.default_matmul_precision, which a GPU's float32 dots follow (``schedule.derive``)
        key = (self._key(specs, options), onf, implementation, residuals, repr(machines.local()),
               repr(runtime.gpu_machine()), compat.matmul_precision_config())
        hit = self._compiled.get(key)
        if hit is not None:
            return hit
        dnf = self._build(specs, options)[2]
        # what JAX traces after this call takes the matmul precision the call was made under
        # (``compat.at_matmul_precision``): the derivatives' kernels, as the transpose of a
        # lax.dot_general takes its primal's (jax.grad traces the backward after the forward,
        # outside a ``with jax.default_matmul_precision`` block the forward may have been
        # called in), the per-device kernels of a sharded call and a vmap's batched kernel
        precision = key[-1]
        at = functools.partial(compat.at_matmul_precision, value=precision)
        run = self._batchable(self._partitioned(dnf, onf, implementation, options, precision), len(dnf.outputs),
                              options, onf, implementation, precision)
        floats = [_adjoint.differentiable(dt) for _, dt in key[0][0]]
        out_specs = [(o.shape, o.dtype) for o in dnf.outputs]
        chosen: list = []  # (the saving forward or None, the statistics it leaves out), once decided
        reruns: dict = {}  # the args whose cotangents a backward gives → does "none" rerun the forward
        labels = residuals if isinstance(residuals, tuple) else ()
        if labels:  # named at the call, not first when differentiated (the saving forward is built then)
            import jax

            outs = self._build([jax.ShapeDtypeStruct(s, d) for s, d in key[0][0]], options)[1]
            self.row_statistics(outs if isinstance(outs, tuple) else (outs,), labels)
        # what of a Preset the adjoint's kernels take: ``backward`` (how its outputs are cut into
        # kernels: its plan), the tiles (named by dimension), the knobs (a TF32 or tile-layout
        # choice is the whole call's, its gradient's dots too), ``skip``, ``unmask_interior`` and
        # the ring's balance and rounds under a sequence split; the tangent kernel takes all that
        # but the plan (until 2026-12-05 only the ring's and the knobs: ``skip=False`` and the
        # tiles did not reach jax.jvp — found by a fuzz)
        backward_preset = (Preset.of(plan=onf.backward, target=onf.target, skip=onf.skip, tiles=dict(onf.tiles),
                                     unmask_interior=onf.unmask_interior, ring=onf.ring, ring_rounds=onf.ring_rounds,
                                     **dict(onf.knobs))
                           if isinstance(onf, Preset) and (onf.backward is not None or onf.skip is not None
                                                           or onf.unmask_interior is not None or onf.knobs
                                                           or onf.tiles or onf.ring or onf.ring_rounds) else None)
        tangent_preset = (Preset.of(target=onf.target, skip=onf.skip, tiles=dict(onf.tiles),
                                    unmask_interior=onf.unmask_interior, ring=onf.ring, ring_rounds=onf.ring_rounds,
                                    **dict(onf.knobs))
                          if isinstance(onf, Preset) and (onf.skip is not None or onf.unmask_interior is not None
                                                          or onf.knobs or onf.tiles or onf.ring or onf.ring_rounds)
                          else None)

        def saving_compiled():
            """(``saving_forward``'s compiled function: the forward that also outputs the
            statistics the backward reads, those it leaves out: ``statistics_read``)"""
            unread = self.statistics_read(key[0], options, labels)
            return self.with_row_statistics(labels, unread).compiled(
                *specs, onf=onf if not isinstance(onf, ONF) else None, implementation=implementation,
                **options), unread

        @at
        def saving():
            """The forward that also saves the row statistics, or None — decided (and its
            adjoint derived) only when the call is first differentiated."""
            if not chosen:
                # a selection's operand is always saved, whatever the policy: its backward must
                # compare the one value (``label_selections``)
                pays = (residuals == "save" or labels or self._selected_saved(key[0], options)
                        or (residuals == "auto" and self._saving_pays(key[0], options, implementation)))
                chosen.append(saving_compiled() if pays else (None, None))
            return chosen[0][0] and at(chosen[0][0])

        def rerun(levels, args, wrt):
            """(saved, outs, unread) of the saving forward run again on the primals, inside the
            backward — where nothing was saved (``residuals="none"``) and the cost model counts fewer
            flops for that forward and the adjoint reading what it saves than for the adjoint
            that recomputes the statistics in its own kernels (``_rerun_pays``; FlashAttention's
            backward without a saved log-sum-exp); else None. Under ``jax.vmap`` the forward is
            vmapped level by level (innermost first, as ``levels``: the outermost batch is each
            array's first axis), so the saved values and outputs have every batch axis."""
            if residuals != "none":
                return None
            if wrt not in reruns:  # (decided once per set of cotangents asked, as ``chosen``)
                reruns[wrt] = self._rerun_pays(key[0], options, implementation,
                                               tuple(self.params[i].name for i in wrt))
            if not reruns[wrt]:
                return None
            import jax

            fn, unread = saving_compiled()
            for flags in levels:
                fn = jax.vmap(fn, in_axes=tuple(0 if f else None for f in flags))
            both = tuple(fn(*args))
            return both[len(out_specs):], both[:len(out_specs)], unread

        @at
        def backward_batched(levels, args, saved, outs, cts, wrt):
            """The adjoint kernel run on the primals, cotangents, saved values and outputs, giving
            the cotangents of the args ``wrt`` only (the others: zeros, never computed — grad of
            the weights derives no dX); under ``jax.vmap`` (``levels``: per vmap, innermost
            first, which args it batches) the adjoint under Ω over each batch, where an arg a
            batch shares gets its cotangent summed over that batch inside the kernel
            (``batched(…, summed=…)``; dnf.collapsed then merges the batch into the rows it
            already sums: a vmapped MLP's weight gradient is the rows kernel's)."""
            import jax

            ct_batched = [ct.dtype != jax.dtypes.float0 for ct in cts]
            cts = [np.zeros(shape, dt) if ct.dtype == jax.dtypes.float0 else ct
                   for ct, (shape, dt) in zip(cts, out_specs)]
            wrt = tuple(i for i in sorted(wrt) if floats[i])
            again = rerun(levels, args, wrt) if outs is None else None
            if again is not None:
                saved, outs, unread = again
            else:
                unread = chosen[0][1] if outs is not None else None
            held = (labels or True) if outs is not None else False
            arrays = [*args, *cts, *saved, *(outs or ())]

            def kernel_of(rounded: bool):
                """(the adjoint kernel to run, the args whose cotangents it gives, its Preset)"""
                adj = self._adjoint_for(key[0], options, held, wrt=tuple(self.params[i].name for i in wrt),
                                        unread=unread, rounded=rounded)
                full = self._adjoint_for(key[0], options, held, unread=unread, rounded=rounded)
                plan = getattr(backward_preset, "plan", None)
                if isinstance(plan, tuple) and sorted(n for g in plan for n in g) != sorted(full.output_names):
                    # no partition of the cotangents: the whole adjoint refuses it, named, whichever
                    # argnums asked (a fuzz: the smaller adjoint took some)
                    bk, args_of, preset = full, tuple(i for i, f in enumerate(floats) if f), backward_preset
                else:
                    bk, args_of, preset = adj, wrt, _plan_of_some(backward_preset, full, adj)
                for batched in levels:
                    flags = (*map(bool, batched), *ct_batched, *(True,) * (len(saved) + len(outs or ())))
                    bk = bk.batched(flags, summed=tuple(j for j, i in enumerate(args_of) if not batched[i]))
                return bk, args_of, preset

            def run(bk, preset, *arrays):
                if not levels:
                    out = bk(*arrays, implementation=implementation, residuals="none", onf=preset, **options)
                else:
                    out = bk.compiled(*arrays, onf=preset, implementation=implementation, residuals="none",
                                      **options)(*arrays)
                return out if isinstance(out, tuple) else (out,)

            # the backward reads what its forward saved, and a GPU's forward may round its dots
            # (``adjoint``'s ``rounded``): each platform runs the adjoint for its forward, one
            # kernel where the two derive the same DNF (all but a gradient that Δ read from a
            # rounded Out would spoil: a score_mod table's)
            xk, given, xp = kernel_of(False)
            rk, _, rp = kernel_of(True) if held is not False and self.gpu_dots_round(key[0], options) else (xk, given, xp)
            if rk is xk or all(a.body is b.body for a, b in zip(rk.dnf(*arrays, **options).outputs,
                                                                 xk.dnf(*arrays, **options).outputs)):
                grads = run(xk, xp, *arrays)
            elif implementation in runtime.GPU_BACKENDS:  # (their interpret modes round as a GPU)
                grads = run(rk, rp, *arrays)
            else:  # JAX's own choice, which JAX differentiates (grad of grad, a jvp of the grad)
                grads = compat.platform_dependent(*arrays, cpu=functools.partial(run, xk, xp),
                                                  cuda=functools.partial(run, rk, rp), differentiable=True)
            grads = dict(zip(given, grads))
            return [grads[i] if i in grads else runtime.zero_cotangent(a) for i, a in enumerate(args)]

        def backward(args, saved, outs, cts, wrt):
            return backward_batched((), args, saved, outs, cts, wrt)

        @at
        def tangent(args, dots, saved=()):
            # where the forward saved selections' operands, the tangent compares them as the
            # backward does (the two stay each other's transpose: ``label_selections``)
            unread = chosen[0][1] if saved else None
            picked = self._selected_saved(key[0], options, labels, unread) if saved else []
            tk = self._tangent_for(key[0], options, (labels or True) if picked else False, unread if picked else None)
            out = tk(*args, *dots, *[saved[i] for i in picked], implementation=implementation, residuals="none",
                     onf=tangent_preset, **options)
            return out if isinstance(out, tuple) else (out,)

        fn = runtime.differentiable(run, backward, len(dnf.outputs), saving, tangent, floats,
                                    [_adjoint.differentiable(dt) for _, dt in out_specs], name=self.name,
                                    backward_batched=backward_batched, tangent_reads_saved=True)
        self._compiled[key] = fn
        return fn

    def _partitioned(self, dnf, onf, implementation, options, precision=None):
        """The DNF's compiled function, split over a device mesh when its inputs are: each
        device runs the kernel derived for its own block (``moajax.shard``), under the call's
        matmul precision config (``precision``; XLA's partitioner asks at compile time)."""
        from moajax import runtime

        names = tuple(o.name for o in dnf.outputs)
        lift = self.mesh_lift.for_dnf(dnf, options, onf) if self.mesh_lift is not None else None
        return shard.partitioned(runtime.compiled_run(dnf, onf, implementation, names), dnf,
                                 compat.at_matmul_precision(functools.partial(
                                     self._local_run, options=options, onf=onf, implementation=implementation,
                                     names=names), precision), self.name, lift, precision=precision,
                                 local_dnf=lambda specs: self.dnf(*specs, **options),
                                 plain_dnf=lambda: self.dnf_before_identities(*dnf.inputs, **options))

    def _local_run(self, specs, *, options, onf, implementation, names):
        """The kernel's compiled function for one device's block of the arrays (``specs``): its
        DNF and schedule derived for those shapes (a ``Preset`` applies as it does globally)."""
        from moajax import runtime
        from moajax.onf import ONF

        dnf = self._build(specs, options)[2]
        if isinstance(onf, ONF) and tuple(i.shape for i in onf.dnf.inputs) != tuple(i.shape for i in dnf.inputs):
            raise ValueError(f"{self.name}: the onf argument is an ONF derived for the whole arrays; split over "
                             "devices, each block has other shapes: pass a moajax.schedule.Preset instead")
        return runtime.compiled_run(dnf, onf, implementation, names)

    # ---- residuals
    @staticmethod
    def _is_statistic(x) -> bool:
        return (isinstance(x, (moa.Name, moa.StopGradient)) and moa._is_float(x.dtype)
                and any(isinstance(y, (moa.Reduce, moa.Inner)) for y in moa.nodes(x.arg)))

    def row_statistics(self, outputs, labels: tuple = (), unread: tuple | None = None) -> tuple:
        """(outputs', statistics): the values a backward may read saved from the forward
        instead of recomputing — the labelled (``moa.name``) or held-constant
        (``moa.stop_gradient``) subexpressions that contain a reduction and have fewer axes
        and no more elements than an output they serve (one whose expression holds them; as
        many where the reduced axes have extent 1, e.g. a value head dim of 1), such as a
        softmax's max and denominator or an RMS, in a fixed order; then each output cast to a narrower dtype, before the cast; then the
        values labelled by ``labels`` (a residual policy's choice, any size), in that order. One
        inside an Ω body (of lower rank than the body's cell) is first lifted out over the Ω's frame
        (``moa.lift_from_omega``): ``outputs'`` are the same arrays with the statistics as
        nodes of their own, which the backward differentiates. ``unread``: the statistics left
        out, by what they are (``_statistic_ids``), those the backward does not read
        (``statistics_read``)."""
        # a statistic reduces an axis away: fewer axes than the cell (or output) it serves, so
        # that a [t s] score is never one, whatever the sizes (T × S < T × E when S < E)
        outputs = label_selections(outputs)
        before = {x.uid for x in moa.postorder(outputs)}
        outputs = moa.lift_from_omega(
            outputs, lambda y, node: (self._is_statistic(y) and y.rank < node.body.rank and y.size <= node.body.size)
            or _is_selected(y))
        # no larger than an output it serves, not than every output: attention's log-sum-exp
        # output (jax.nn's return_residual) has the rows' size, and its max and sum still serve Out
        served = [(o, {y.uid for y in moa.postorder((o,))}) for o in outputs]
        stats = [x for x in moa.postorder(outputs) if self._is_statistic(x) and any(
            x.uid in held and x.size <= o.size and (x.rank < o.rank or x.uid not in before)  # (lifted: its cell's)
            for o, held in served)]
        # an output rounded to a narrower dtype (bfloat16 attention accumulates in float32): its
        # value before rounding, which the papers' identities read back (Δ = +/(dO × O) with O
        # as computed; reading the rounded O would change Δ by the rounding)
        stats += [o.arg for o in outputs if isinstance(o, moa.Cast) and moa._is_float(o.arg.dtype)
                  and np.dtype(o.dtype).itemsize < np.dtype(o.arg.dtype).itemsize and o.arg not in stats]
        named = {}
        for x in moa.postorder(outputs):
            if isinstance(x, moa.Name) and moa._is_float(x.dtype):
                named.setdefault(x.label, x)
        # then the selections' operands, whatever their size (``label_selections``)
        stats += [x for x in named.values() if _is_selected(x) and x not in stats]
        for label in labels:
            if label not in named:
                raise ValueError(f"{self.name}: residuals names the label {label!r}, which this kernel does not "
                                 f"define; its labels are {sorted(named)}")
            if named[label] not in stats:
                stats.append(named[label])
        if unread:
            stats = [x for x, i in zip(stats, _statistic_ids(outputs, stats)) if i not in unread]
        return outputs, stats

    def with_row_statistics(self, labels: tuple = (), unread: tuple | None = None) -> "Kernel":
        """This kernel with its row statistics (and the values labelled ``labels``) as further
        outputs (``saved0``, ``saved1``, …), placed first so that its other outputs read them
        (``rewrites.hoist``); ``unread``: those left out (``row_statistics``). What ``jax.grad``
        runs, the statistics its backward reads: ``saving_forward``."""
        labels = tuple(labels)
        unread = tuple(sorted(unread)) if unread else None
        hit = self._derived.get(("with_row_statistics", labels, unread))
        if hit is not None:
            return hit
        primal = self

        def forward(*arrays, **opts):
            outs = primal.fn(*arrays, **opts)
            outs, stats = primal.row_statistics(outs if isinstance(outs, tuple) else (outs,), labels, unread)
            return tuple(stats) + outs

        forward.__signature__ = inspect.signature(self.fn)
        forward.__name__ = f"{self.name}_saving" + "".join(f"_{lb}" for lb in labels) + _unread_suffix(unread)
        hit = self._derived[("with_row_statistics", labels, unread)] = _SavingKernel(forward, primal)
        hit._lift_from = self
        return hit

    def _saving_pays(self, shape_key, options, implementation=None) -> bool:
        """Do the forward that also outputs the row statistics and the backward that reads
        them cost fewer flops together (cost model, the default ONFs of the machine the call
        runs on: this process's GPU for a GPU implementation or a GPU's default, else this
        machine) than the plain forward and the backward that recomputes them? Each backward
        is the one that machine runs (``adjoint``'s ``rounded``: a GPU's for its 16-bit dots;
        on a CPU every gradient reads Out). Flops, not the cost model's time: on this CPU
        (ad hoc, 2026-12-07, jit(grad) of both policies alternated) the modeled time would
        recompute at T = S = 256 with ALiBi slopes (9.1 against 8.0 ms, the saved adjoint's
        kernels memory-bound by their byte counts) where saving ran in 0.63–0.71× the time;
        the time was right only at T = S = 16 in bfloat16 (saving 1.08–1.31× slower, at
        0.2 ms a call)."""
        f = self._policy_flops(shape_key, options, implementation)
        return f is not None and f["saving"] + f["saved_adjoint"] < f["plain"] + f["recomputing_adjoint"]

    def _rerun_pays(self, shape_key, options, implementation=None, wrt=None) -> bool:
        """Where nothing is saved (``residuals="none"``): do the saving forward, run again in
        the backward, and the adjoint reading what it saved cost fewer flops together than the
        adjoint that recomputes the statistics in its own kernels (cost model, as
        ``_saving_pays``; ``wrt``: the params whose cotangents are asked, by name)? Attention's
        does: the forward's two contractions per tile give Out, max and ℓ, and Δ = +/(dO × Out)
        is then a row sum, where the recomputing adjoint walks the keys once for max and ℓ and
        once more, with two contractions, for Δ = +/(P × dP). RMSNorm's does not on a CPU, whose
        plan computes r once in a kernel of its own for dX and dW, and does on a GPU profile,
        whose dW kernel recomputes r in every program (each owns a tile of d: 75.6 of the
        plan's 121.8 Mflop at 4096 × 1024 on the H200's, ad hoc)."""
        f = self._policy_flops(shape_key, options, implementation, wrt)
        return f is not None and f["saving"] + f["saved_adjoint"] < f["recomputing_adjoint"]

    def _policy_flops(self, shape_key, options, implementation=None, wrt=None) -> dict | None:
        """The cost model's flops (``_saving_pays``) of the plain forward ("plain"), the forward
        that also outputs the statistics the backward reads ("saving"), the adjoint reading
        them ("saved_adjoint") and the one recomputing them ("recomputing_adjoint"), each
        adjoint giving the cotangents of ``wrt`` (param names; None: all); None where nothing
        would be saved (no statistic read, and no identity reads an output). (Each plan's
        derivation is cached: ``schedule.derive_plan``.)"""
        from moajax import cost, machines, runtime, schedule

        import jax

        gpu = runtime.runs_on_gpu(implementation)
        machine = runtime.gpu_machine(runtime.gpu_path(implementation)) if gpu else machines.local()
        # (XLA on a GPU runs the GPU's backward too: ``compiled``'s per-platform choice)
        rounded = self.gpu_dots_round(shape_key, options) if gpu or runtime.has_gpu() else False
        unread = self.statistics_read(shape_key, options)
        with_saved = self._adjoint_for(shape_key, options, True, wrt=wrt, unread=unread, rounded=rounded)

        def flops(k, extra):
            specs = [jax.ShapeDtypeStruct(s, d) for s, d in shape_key[0]] + extra
            plan = schedule.derive_plan(k.dnf(*specs, **options), machine)
            return sum(cost.estimate(o).flops for o in (plan if isinstance(plan, tuple) else (plan,)))

        outs = self._build([jax.ShapeDtypeStruct(s, d) for s, d in shape_key[0]], options)[1]
        outs = outs if isinstance(outs, tuple) else (outs,)
        cts = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs]
        primal_specs = [jax.ShapeDtypeStruct(s, d) for s, d in shape_key[0]]
        # (only the statistics the backward reads: ``statistics_read``; in bfloat16 RMSNorm's and
        # SwiGLU's float32 value before rounding, an [n d] array that neither adjoint reads,
        # would be written and held for nothing, which flops do not see)
        saved = self._saved_specs(primal_specs, options, unread=unread)
        reads = {r.array for r in with_saved.dnf(*primal_specs, *cts, *saved, *cts, **options).reads()}
        if not saved and not reads & {p.name for p in with_saved.params[len(self.params) + len(cts):]}:
            return None  # nothing to save
        return {"plain": flops(self, []), "saving": flops(self.with_row_statistics((), unread), []),
                "saved_adjoint": flops(with_saved, cts + saved + cts),
                "recomputing_adjoint": flops(self._adjoint_for(shape_key, options, False, wrt=wrt, rounded=rounded),
                                             cts)}

    def statistics_read(self, shape_key, options, labels: tuple = ()) -> tuple | None:
        """The statistics the saving forward may save (``row_statistics``) that the backward
        reading saved values does not read (its adjoint's DNF, every cotangent asked), by what
        they are (``_statistic_ids``), sorted; None where it reads all. A selection's operand is
        kept whatever (its tangent compares it too: ``label_selections``). What is not read is
        left out of the saving forward and of the
        adjoint's arguments: written and held until the backward, it would cost memory and
        bandwidth for nothing (in bfloat16, RMSNorm's and SwiGLU's float32 outputs before
        rounding, [n d] arrays twice their outputs' size)."""
        import jax

        labels = tuple(labels)
        key = ("statistics_read", shape_key, tuple(sorted(options.items())), labels)
        if key in self._derived:
            return self._derived[key]
        specs = [jax.ShapeDtypeStruct(s, d) for s, d in shape_key[0]]
        outs = self._build(specs, options)[1]
        outs = outs if isinstance(outs, tuple) else (outs,)
        lifted, stats = self.row_statistics(outs, labels)
        unread = None
        if stats:
            # what either backward reads: the one after a CPU's forward and the one after a
            # GPU's (``adjoint``'s ``rounded``) take the same saved values
            args = self._saved_args(specs, options, labels)
            reads = set()
            for rounded in {self.gpu_dots_round(shape_key, options), False}:
                adj = self._adjoint_for(shape_key, options, labels or True, rounded=rounded)
                reads |= {r.array for r in adj.dnf(*args, **options).reads()}
            first = len(self.params) + len(outs)  # (after the primals and the cotangents)
            unread = tuple(sorted(i for i, p, x in zip(_statistic_ids(lifted, stats), adj.params[first:], stats)
                                  if p.name not in reads and not _is_selected(x))) or None
        self._derived[key] = unread
        return unread

    def saving_forward(self, *specs, labels: tuple = (), **options) -> "Kernel":
        """The forward ``jax.grad`` runs where it saves: the primal's outputs after the
        statistics its backward reads (``with_row_statistics``, ``statistics_read``)."""
        labels = tuple(labels)
        return self.with_row_statistics(labels, self.statistics_read(self._key(specs, options), options, labels))

    def saved_adjoint(self, *specs, labels: tuple = (), rounded: bool | None = None, **options) -> tuple:
        """(the adjoint ``jax.grad`` runs where the forward saves its statistics (and the values
        labelled ``labels``) and outputs, the specs of its arguments: primals, cotangents,
        saved values, outputs). The saved values are those it reads (``statistics_read``), as
        ``saving_forward`` writes them. ``rounded`` (``adjoint``): None, the one a GPU runs;
        False, a CPU's (they differ only where a GPU's forward rounds its dots to 16 bits and a
        gradient sums Δ over rows and keys)."""
        labels = tuple(labels)
        key = self._key(specs, options)
        unread = self.statistics_read(key, options, labels)
        return (self._adjoint_for(key, options, labels or True, unread=unread, rounded=rounded),
                self._saved_args(specs, options, labels, unread))

    def _saved_args(self, specs, options, labels: tuple = (), unread: tuple | None = None) -> list:
        """The specs of a saved adjoint's arguments: primals, cotangents, the saved values
        (``row_statistics``: ``labels``, ``unread``), outputs."""
        import jax

        outs = self._build(specs, options)[1]
        cts = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in (outs if isinstance(outs, tuple) else (outs,))]
        return list(specs) + cts + self._saved_specs(specs, options, labels, unread) + cts

    def interface_ledger(self, *specs, residuals="none", implementation=None, **options) -> list:
        """``cost.interface_ledger`` of this kernel's forward and the backward ``jax.grad`` runs
        under the residual policy ``residuals`` ("none", "recompute", "save" or a tuple of
        labels): the arrays each reads and writes, the saved ones written by the forward and
        read back; under "none" where the backward reruns the saving forward
        (``_rerun_pays``, for the machine ``implementation`` runs on, as a call's), that
        forward's reads and writes are the backward's."""
        from moajax import cost, runtime

        residuals = runtime.check_residuals(residuals, f"{self.name}.interface_ledger")
        if residuals == "auto":
            raise ValueError(f"{self.name}.interface_ledger: residuals must be chosen ('none', 'recompute', "
                             "'save' or labels)")
        forward = self.dnf(*specs, **options)
        runtime.check_implementation(implementation, f"{self.name}.interface_ledger")
        if residuals == "none" and self._rerun_pays(self._key(specs, options), options, implementation):
            adj, args = self.saved_adjoint(*specs, **options)
            return cost.interface_ledger(forward, self.saving_forward(*specs, **options).dnf(*specs, **options),
                                         adj.dnf(*args, **options))
        if residuals in ("none", "recompute"):
            import jax

            outs = self._build(specs, options)[1]
            cts = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in (outs if isinstance(outs, tuple) else (outs,))]
            adj, args = self._adjoint_for(self._key(specs, options), options, False), list(specs) + cts
        else:
            labels = residuals if isinstance(residuals, tuple) else ()
            adj, args = self.saved_adjoint(*specs, labels=labels, **options)
            forward = self.saving_forward(*specs, labels=labels, **options).dnf(*specs, **options)
        return cost.interface_ledger(forward, adj.dnf(*args, **options))

    def _saved_specs(self, specs, options, labels: tuple = (), unread: tuple | None = None) -> list:
        """The specs of the saved statistics, each in its layout (``with_row_statistics``)."""
        import jax

        outs = self._build(specs, options)[1]
        stats = self.row_statistics(outs if isinstance(outs, tuple) else (outs,), labels, unread)[1]
        layouts = self.with_row_statistics(labels, unread).layouts(*specs, **options)
        return [jax.ShapeDtypeStruct(x.shape if lay is None else lay.shape, x.dtype) for x, lay in zip(stats, layouts)]

    def _batchable(self, run, n_outputs: int, options, onf, implementation, precision=None):
        """``run`` under ``jax.vmap`` becomes the batched kernel's own compiled code: the
        definition under Ω over the batch axis (``batched``), scheduled with the batch as an
        axis of its own (a grid axis on a GPU; on a CPU the row tiles shrink to keep the
        batch's working set in cache) — never a loop over the batch in Python."""
        from jax import custom_batching

        from moajax.schedule import Preset

        f = custom_batching.custom_vmap(run)

        @f.def_vmap
        @functools.partial(compat.at_matmul_precision, value=precision)  # (a vmap across a jit is traced later)
        def rule(axis_size, in_batched, *args):
            if not any(in_batched):  # only values the kernel does not read vary (a tangent)
                out = run(*args)
                return out, (False,) * n_outputs if n_outputs > 1 else False
            if axis_size == 0:  # an empty batch: nothing to run (a kernel refuses a zero extent)
                import jax
                import jax.numpy as jnp

                cells = [jax.ShapeDtypeStruct(a.shape[1:] if b else a.shape, a.dtype) for a, b in zip(args, in_batched)]
                shapes = jax.eval_shape(run, *cells)
                outs = tuple(jnp.zeros((0,) + o.shape, o.dtype) for o in (shapes if n_outputs > 1 else (shapes,)))
                return (outs, (True,) * n_outputs) if n_outputs > 1 else (outs[0], True)
            bk = self.batched(tuple(bool(b) for b in in_batched))
            out = bk.compiled(*args, onf=onf if isinstance(onf, Preset) else None, implementation=implementation,
                              **options)(*args)
            return out, (True,) * n_outputs if n_outputs > 1 else True

        return f

    def over_leading_axes(self, count: int) -> "Kernel":
        """This kernel's definition with ``count`` more leading axes on its first argument
        (``l0 l1 …`` before its own), the same array expression at a higher rank: RMSNorm and
        the MLP on x [B, T, D] rather than on rows [B·T, D]. Each derivation is checked to be
        the kernel on rows (``dnf.collapsed`` of its DNF is the rows kernel's DNF at the merged
        shape, the same hash-consed bodies), so a definition that is not polymorphic in its
        rank is refused, named, never run. A split of any leading axis over devices stays a
        split (XLA keeps none through the reshape to rows), the weights' gradients are sums
        over every leading axis inside the kernel (under ``jax.vmap`` of the rows kernel they
        are one a batch element), and the runtime runs it as rows (``runtime.run_dnf``)."""
        key = ("over leading axes", int(count))
        hit = self._derived.get(key)
        if hit is not None:
            return hit
        if count < 1 or not self.params:
            raise ValueError(f"{self.name}.over_leading_axes: needs count ≥ 1 and an array argument, got {count}")
        taken = {d for p in self.params for d in p.dims}
        lead = tuple(d for d in (f"l{i}" for i in range(count + len(taken))) if d not in taken)[:count]
        first = self.params[0]
        dims = {p.name: " ".join(p.dims) for p in self.params}
        dims[first.name] = " ".join(lead + first.dims)
        k = Kernel(self.fn, example={**self.example, **{d: 2 for d in lead}}, name=self.name,
                   outputs=self.output_names, dims=dims, identities=self._identities)
        k._rows_of = (self, count)
        k._lift_from = self
        self._derived[key] = k
        return k

    def batched(self, in_batched: tuple, summed: tuple = ()) -> "Kernel":
        """The kernel with a leading batch axis on the arguments flagged in ``in_batched``:
        its definition under Ω over that axis (an argument without it is shared by every
        batch index). What ``jax.vmap`` of a call runs. The outputs numbered in ``summed`` are
        summed over the batch, +/ Ω(…): an adjoint's cotangent of an argument the batch
        shares (the transpose of its broadcast), which ``jax.grad`` of a vmap takes."""
        key = ("batched", tuple(in_batched), tuple(summed))
        hit = self._derived.get(key)
        if hit is not None:
            return hit
        if len(in_batched) != len(self.params) or not any(in_batched):
            raise ValueError(f"{self.name}.batched: needs one flag per argument, at least one True; got {in_batched}")
        summed = frozenset(summed)
        taken = {d for p in self.params for d in p.dims}
        dim = next(f"vmap{i}" for i in range(len(taken) + 1) if f"vmap{i}" not in taken)
        primal = self

        def batched_fn(*arrays, **opts):
            ranks = tuple(a.rank - 1 if b else a.rank for a, b in zip(arrays, in_batched))
            if primal.output_names is not None:
                n = len(primal.output_names)
            else:  # trace the definition once on cell-shaped placeholders to count its outputs
                probe = primal.fn(*[moa.array(f"_cell{i}", a.shape[1:] if b else a.shape, a.dims[1:] if b else a.dims,
                                              a.dtype) for i, (a, b) in enumerate(zip(arrays, in_batched))], **opts)
                n = len(probe) if isinstance(probe, tuple) else 1

            def one(i):
                def cell(*cells):
                    out = primal.fn(*cells, **opts)
                    return out[i] if isinstance(out, tuple) else out
                out = moa.omega(cell, ranks)(*arrays)
                return moa.sum(out, 0) if i in summed else out

            outs = tuple(one(i) for i in range(n))
            return outs if n > 1 else outs[0]

        self._sign(batched_fn, (), f"{self.name}_vmap", f"{self.name} under Ω over a leading batch axis {dim}.")
        dims = {p.name: " ".join(((dim,) if b else ()) + p.dims) for p, b in zip(self.params, in_batched)}
        example = {**self.example, dim: 2}
        # the papers' identities hold under Ω as they do per cell: an adjoint's are matched
        # against its forward batched alike (without them a vmapped attention adjoint
        # recomputed Δ as a sum over the keys instead of +/(dO × Out))
        ids = self._identities
        hook = None if ids is None else (
            lambda dnf, specs, opts, batches=(): ids(dnf, specs, opts, (tuple(in_batched),) + tuple(batches)))
        hit = self._derived[key] = Kernel(batched_fn, example=example, name=f"{self.name}_vmap",
                                           outputs=self.output_names, dims=dims, identities=hook)
        hit._batch_of = (self, tuple(bool(b) for b in in_batched), tuple(sorted(summed)))
        if self.output_names is None:
            # the cell's names (a saving forward's statistics are named as such: the GPU tile
            # tables go by the width of the other outputs, and the identities match by name)
            def names_at(key, flags=tuple(in_batched)):
                import jax

                cells = [jax.ShapeDtypeStruct(shape[1:] if b else shape, dt) for (shape, dt), b in zip(key[0], flags)]
                return primal.cell_names(primal._key(cells, dict(key[1])))
            hit._names_at = names_at
        return hit

    def _adjoint_for(self, shape_key, options, saved: bool | tuple = False, wrt=None,
                     unread: tuple | None = None, rounded: bool | None = None) -> "Kernel":
        """The adjoint kernel (cached per shapes and options) that ``compiled`` runs backward
        (``saved``, ``wrt``, ``unread``, ``rounded``: as for ``adjoint``)."""
        import jax

        rounded = self.gpu_dots_round(shape_key, options) if rounded is None else bool(rounded)
        key = (shape_key, tuple(sorted(options.items())), saved, wrt, unread, rounded)
        hit = self._derived.get(key)
        if hit is None:
            specs = [jax.ShapeDtypeStruct(shape, dt) for shape, dt in shape_key[0]]
            hit = self._derived[key] = self.adjoint(*specs, wrt=wrt, saved=saved, unread=unread, rounded=rounded,
                                                    **options)
        return hit

    def gpu_dots_round(self, shape_key, options) -> bool:
        """Do a GPU's dots round what this kernel's forward computes, for these shapes and
        dtypes (``_key``), so that Δ read from its Out would spoil a gradient (``identities``)?
        Where every floating output is 16-bit: its dots then take 16-bit operands
        (``schedule._lowp_dots``: P rounded to 2⁻⁹ for P +.× V). Not counted: TF32's float32
        dots (P to 2⁻¹¹, JAX's default on a GPU), left to read Out — recomputing Δ there, a
        relative-position table's fused adjoint (its four outputs, the "atomic" plan's
        kernel; causal, T = S = 1024, 8 heads of 64) needed 338.8 KB of shared memory on the
        A100 (163 KB; an ad hoc derivation), where reading Out fits; and reading it costs a
        table's gradient little: with TF32 emulated (operands truncated, or rounded, on the
        H200's schedule in interpret mode) it was 7.6e-4 to 1.9e-3 off float64 (3.6e-4 to
        1.1e-3 rounded) against 5.9e-4 to 2.0e-3 (2.5e-4 to 3.3e-4) recomputing, dq, dk and
        dv of the same runs up to 3.4e-3 (9.6e-4) (bench/results/table_grad_precision_tf32.md)."""
        import jax
        import jax.numpy as jnp  # (NumPy's issubdtype does not count bfloat16 as floating)

        outs = self._build([jax.ShapeDtypeStruct(s, d) for s, d in shape_key[0]], options)[2].outputs
        sizes = [np.dtype(o.dtype).itemsize for o in outs if jnp.issubdtype(o.dtype, jnp.floating)]
        return bool(sizes) and all(n == 2 for n in sizes)

    def adjoint(self, *specs, wrt=None, saved: bool | tuple = False, unread: tuple | None = None,
                rounded: bool | None = None, **options) -> "Kernel":
        """The backward of this kernel as a ``Kernel`` (``moajax.adjoint``: derived in the algebra).

        Its inputs are the primals, then one cotangent per output (``d_<output>``, ρ and dims
        of the output); its outputs are the cotangents ``d_<input>`` of the differentiable
        inputs (``wrt``: names; default every floating input), each in its input's dtype.
        It ψ-reduces to a DNF like any kernel. ``specs`` (default: ``example_specs()``) and
        ``options`` are only used to learn the outputs' dims and dtypes. With ``saved``, it
        also takes the forward's row statistics (``row_statistics``: ``saved0``, …) and reads
        them where it would recompute them (the derivative still flows through them); ``saved``
        a tuple of labels: the values so labelled too (``row_statistics``); ``unread``: the
        statistics left out (``row_statistics``; the saving forward's: ``statistics_read``);
        ``rounded``: the forward it reads ran with rounded dots (a GPU's 16-bit dots), so the
        gradients that such a Δ = +/(dO × O) would spoil recompute it
        (``identities.delta_from_output``); False: an XLA forward on a CPU, every gradient
        reads it; None: as a GPU's dots would for these dtypes (``gpu_dots_round``).
        ``compiled`` runs each where its forward ran."""
        from moajax import adjoint as _adjoint

        key = self._key(specs or self.example_specs(), options)
        rounded = self.gpu_dots_round(key, options) if rounded is None else bool(rounded)
        inputs, expr = self._build(specs or self.example_specs(), options)[:2]
        outs = expr if isinstance(expr, tuple) else (expr,)
        names = self._names_for(outs)
        floats = [p.name for p, (_, dt) in zip(self.params, key[0]) if _adjoint.differentiable(dt)]
        wrt = tuple(floats if wrt is None else wrt)
        for w in wrt:
            if w not in floats:
                raise ValueError(f"{self.name}.adjoint: wrt names {w!r}, which is not a floating input; "
                                 f"floating inputs are {floats}")
        primal, n = self, len(self.params)
        params = {p.name for p in self.params}
        ct_names = tuple(f"{_fresh_prefix('d_', 'd', names, params)}{o}" for o in names)
        labels = tuple(saved) if isinstance(saved, tuple) else ()
        unread = unread if saved else None
        stats = self.row_statistics(outs, labels, unread)[1] if saved else []
        saved_names = tuple(f"{_fresh_prefix('saved', 'saved', range(len(stats)), params | set(ct_names))}{i}"
                            for i in range(len(stats)))
        layouts = (self.with_row_statistics(labels, unread).layouts(*(specs or self.example_specs()), **options)
                   if saved else [])
        taken = {p.name for p in self.params} | set(ct_names) | set(saved_names)
        # with ``saved``, the forward's outputs too: the derivative holds them for free, and the
        # papers' identities (``moajax.identities``) read them where the adjoint would recompute
        value_names = tuple(o if o not in taken else f"{o}_value" for o in names) if saved else ()

        def backward(*arrays, **opts):
            outputs = primal.fn(*arrays[:n], **opts)
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            if saved_names:  # the statistics as nodes of their own (lifted out of Ω bodies)
                outputs, stats = primal.row_statistics(outputs, labels, unread)
            by_name = dict(zip([p.name for p in primal.params], arrays[:n]))
            cts = arrays[n:n + len(ct_names)]
            grads = _adjoint.vjp(outputs, cts, [by_name[w] for w in wrt])
            grads = tuple(_adjoint.zeros_like(by_name[w]) if d is None else d for w, d in zip(wrt, grads))
            if saved_names:  # read the saved values where the backward uses the statistics' values
                # (one saved in its rows' layout is viewed in its own: reshapes and a transpose;
                # the layout of these shapes — a device's block has other shapes than the whole)
                held = arrays[n + len(ct_names):n + len(ct_names) + len(stats)]
                lays = primal.with_row_statistics(labels, unread).layouts(*arrays[:n], **opts)
                values = {x: a if lay is None else _in_own_layout(a, lay, x) for x, a, lay in zip(stats, held, lays)}
                # a label is transparent: the labelled value itself, where the derivative reads it
                # unlabelled, is the saved one too (tanh's rule reads y = tanh(a) itself: a column
                # max of tanh(x +.× W) saves its operand, and its backward recomputed x +.× W; the
                # square root's reads √u inside RMSNorm's "rms", whose saved adjoint recomputed
                # Σ_d x² for it until 2026-12-06)
                values.update({x.arg: v for x, v in list(values.items())
                               if isinstance(x, moa.Name) and x.arg not in values})
                grads = tuple(moa.substitute(d, values) for d in grads)
            # a cotangent has its input's dims (the output variables of the adjoint's DNF)
            return tuple(d if d.dims == by_name[w].dims else moa.reshape(d, d.shape, dims=by_name[w].dims)
                         for w, d in zip(wrt, grads))

        stat_names = _saved_names(primal.params, names, len(saved_names))

        def identities(dnf, specs, opts, batches=()):
            """Δ-from-output and kin: the adjoint reads the forward's outputs and statistics.
            ``batches``: the flags of each ``batched`` around this adjoint, innermost first (a
            vmap's adjoint matches the forward under the same Ω, whose outputs are then
            batched too; where a vmap batches only the cotangents, the saved values are not
            the batched forward's, and nothing is matched)."""
            fwd = primal.with_row_statistics(labels, unread)
            for flags in batches:
                held = flags[len(flags) - len(saved_names) - len(value_names):]
                if not any(flags[:n]) or not all(held):
                    return dnf, []
                fwd = fwd.batched(flags[:n])
            # (the forward as derived, its statistics unguarded: the identities find their
            # bodies inside the outputs', which ``guard_statistics`` wraps in a select)
            forward = fwd.dnf_before_identities(*specs[:n], **opts)
            return _identities.delta_from_output(
                dnf, forward, cotangent_of=dict(zip(ct_names, names)), value_of=dict(zip(names, value_names)),
                saved=dict(zip(stat_names, saved_names)), rounded=rounded)

        self._sign(backward, ct_names + saved_names + value_names, f"{self.name}_adjoint",
                   f"The adjoint of {self.name}, derived by moajax.adjoint.")
        # a dim of a cotangent, saved value or statistic that an input names at another extent
        # is another axis of the adjoint's arguments, so it takes another name
        own = _dims_owner(self.params, [shape for shape, _ in key[0]])
        out_dims = [own(o.dims, o.shape) for o in outs]
        dims = {p.name: " ".join(p.dims) for p in self.params}
        dims.update({c: " ".join(od) for c, od in zip(ct_names, out_dims)})
        dims.update({c: " ".join(own(x.dims, x.shape) if lay is None else own(lay.dims, lay.shape))
                     for c, x, lay in zip(saved_names, stats, layouts)})
        dims.update({c: " ".join(od) for c, od in zip(value_names, out_dims)})
        example = dict(self.example)
        for o, od in zip(outs, out_dims):
            example.update({d: s for d, s in zip(od, o.shape) if d not in example})
        adj = Kernel(backward, example=example, name=f"{self.name}_adjoint" + ("_saved" if saved else "")
                     + "".join(f"_{lb}" for lb in labels) + _unread_suffix(unread),
                     outputs=tuple(f"{_fresh_prefix('d_', 'd', wrt, dims)}{w}" for w in wrt), dims=dims,
                     identities=identities if saved else None)
        adj._lift_from = self
        adj._wrt = wrt  # the args whose cotangents are its outputs, in order
        return adj

    def _tangent_for(self, shape_key, options, saved: bool | tuple = False, unread: tuple | None = None) -> "Kernel":
        """The tangent kernel (cached per shapes and options) that ``compiled`` runs forward
        (``saved``, ``unread``: as for ``tangent``)."""
        import jax

        key = ("tangent", shape_key, tuple(sorted(options.items())), saved, unread)
        hit = self._derived.get(key)
        if hit is None:
            specs = [jax.ShapeDtypeStruct(shape, dt) for shape, dt in shape_key[0]]
            hit = self._derived[key] = self.tangent(*specs, saved=saved, unread=unread, **options)
        return hit

    def _selected_saved(self, shape_key, options, labels: tuple = (), unread: tuple | None = None) -> list:
        """The positions, among what the saving forward saves (``row_statistics``, ``unread``),
        of the selections' operands (``label_selections``)."""
        import jax

        outs = self._build([jax.ShapeDtypeStruct(s, d) for s, d in shape_key[0]], options)[1]
        stats = self.row_statistics(outs if isinstance(outs, tuple) else (outs,), labels, unread)[1]
        return [i for i, x in enumerate(stats) if _is_selected(x)]

    def tangent(self, *specs, saved: bool | tuple = False, unread: tuple | None = None, **options) -> "Kernel":
        """The forward-mode derivative of this kernel as a ``Kernel`` (``moajax.tangent``:
        derived in the algebra): Ẏ = ∂Y/∂X · Ẋ, linear in the tangents.

        Its inputs are the primals, then one tangent ``t_<input>`` per floating input (ρ,
        dims and dtype of the input); its outputs are the tangents ``t_<output>`` of the
        floating outputs. It ψ-reduces to a DNF like any kernel; ``specs`` (default:
        ``example_specs()``) and ``options`` are only used to learn the dtypes. With
        ``saved`` (True, or the labels the forward saves), it also takes the selections'
        operands the saving forward saved (``label_selections``: ``saved0``, …) and compares
        them, as the adjoint does — so that the two stay each other's transpose; ``unread``: the
        statistics that forward leaves out (``row_statistics``)."""
        from moajax import adjoint as _adjoint
        from moajax import tangent as _tangent

        specs = specs or self.example_specs()
        key = self._key(specs, options)
        outs = self._build(specs, options)[1]
        outs = outs if isinstance(outs, tuple) else (outs,)
        names = self._names_for(outs)
        moving = [p for p, (_, dt) in zip(self.params, key[0]) if _adjoint.differentiable(dt)]
        floats_out = [(o, nm) for o, nm in zip(outs, names) if _adjoint.differentiable(o.dtype)]
        if not moving or not floats_out:
            raise ValueError(f"{self.name}.tangent: no floating input or no floating output to differentiate")
        primal, n = self, len(self.params)
        taken = {p.name for p in self.params}
        # t_x, or t2_x … where a tangent of a tangent kernel would reuse a name
        prefix = _fresh_prefix("t_", "t", [p.name for p in moving], taken)
        t_names = tuple(f"{prefix}{p.name}" for p in moving)
        labels = tuple(saved) if isinstance(saved, tuple) else ()
        unread = unread if saved else None
        stats = self.row_statistics(outs, labels, unread)[1] if saved else []
        picked = [i for i, x in enumerate(stats) if _is_selected(x)]
        layouts = self.with_row_statistics(labels, unread).layouts(*specs, **options) if picked else []
        saved_names = tuple(f"{_fresh_prefix('saved', 'saved', range(len(picked)), taken | set(t_names))}{i}"
                            for i in range(len(picked)))

        def forward(*arrays, **opts):
            outputs = primal.fn(*arrays[:n], **opts)
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            if saved_names:  # the selections' operands as nodes of their own, read saved below
                outputs, held = primal.row_statistics(outputs, labels, unread)
            by_name = dict(zip([p.name for p in primal.params], arrays[:n]))
            dots = _tangent.jvp(outputs, [by_name[p.name] for p in moving], arrays[n:n + len(t_names)])
            dots = [(d if d is not None else _adjoint.zeros_like(o), o) for d, o in zip(dots, outputs)
                    if _adjoint.differentiable(o.dtype)]
            if saved_names:
                lays = primal.with_row_statistics(labels, unread).layouts(*arrays[:n], **opts)
                values = {held[i]: a if lays[i] is None else _in_own_layout(a, lays[i], held[i])
                          for i, a in zip(picked, arrays[n + len(t_names):])}
                dots = [(moa.substitute(d, values), o) for d, o in dots]
            # a tangent has its output's dims (the output variables of the tangent's DNF)
            return tuple(d if d.dims == o.dims else moa.reshape(d, d.shape, dims=o.dims) for d, o in dots)

        self._sign(forward, t_names + saved_names, f"{self.name}_tangent",
                   f"The tangent (forward-mode derivative) of {self.name}, derived by moajax.tangent.")
        dims = {p.name: " ".join(p.dims) for p in self.params}
        dims.update({t: " ".join(p.dims) for t, p in zip(t_names, moving)})
        own = _dims_owner(self.params, [shape for shape, _ in key[0]])
        dims.update({c: " ".join(own(stats[i].dims, stats[i].shape) if layouts[i] is None
                                 else own(layouts[i].dims, layouts[i].shape))
                     for c, i in zip(saved_names, picked)})
        tk = Kernel(forward, example=self.example, name=f"{self.name}_tangent" + ("_saved" if saved_names else ""),
                    outputs=tuple(f"{prefix}{nm}" for _, nm in floats_out), dims=dims)
        tk._lift_from = self  # (the ring's forward mode: ``moajax.ring.SequenceLift``)
        return tk

    def __repr__(self):
        sig = ", ".join(f"{p.name}[{' '.join(p.dims)}]" for p in self.params)
        return f"<moajax kernel {self.name}({sig})>"


def _plan_of_some(preset, full: "Kernel", some: "Kernel"):
    """``preset`` with its ``plan``, a partition of ``full``'s outputs (an adjoint's cotangents:
    the "split" backward), kept to ``some``'s: the adjoint of the args a ``jax.grad`` asks
    for (``argnums``) has only theirs (the plan a partition of ``full``'s outputs: checked
    before, where ``full`` refuses another, named)."""
    import dataclasses

    plan = getattr(preset, "plan", None)
    if not isinstance(plan, tuple) or full.output_names == some.output_names:
        return preset
    # by the arg each cotangent is of (its name's ``d_`` prefix is chosen per kernel)
    of_arg = dict(zip(full.output_names, full._wrt))
    renamed = {w: n for n, w in zip(some.output_names, some._wrt)}
    groups = tuple(g for g in (tuple(renamed[of_arg[n]] for n in g if of_arg[n] in renamed) for g in plan) if g)
    return dataclasses.replace(preset, plan=groups)


def _layout_order(layout) -> list:
    """The statistic's own variables in the order of its rows' layout: each row axis kept, or
    split where the layout joined two own axes (GQA's head n = G·kv + g into kv, g), row-major;
    then the own axes of extent 1, which the rows leave out."""
    inverse = dict(layout.inverse)
    parts: list = []
    for w in layout.vars:
        ix = inverse[w]
        if ix.as_var() is not None:
            parts.append(ix.as_var())
        else:  # G·u₁ + u₂: row-major, the w axis is (u₁, u₂)
            parts += [u for u, _ in sorted(ix.terms, key=lambda t: -t[1])]
    return parts + [u for u in layout.own if u not in parts]


def _in_own_layout(a: moa.Array, layout, x: moa.Array) -> moa.Array:
    """A statistic saved in the layout of its output's rows (``a``, ``identities.Layout``) viewed
    in the statistic's own (ρ x): index maps only (reshape, ⍉; ``_layout_order``), so the
    ψ-reduced backward reads ``a`` directly."""
    order = _layout_order(layout)
    y = moa.reshape(a, tuple(u.extent for u in order), dims=tuple(u.name for u in order))
    y = moa.transpose(y, tuple(order.index(u) for u in layout.own))
    return y if y.dims == x.dims else moa.reshape(y, x.shape, dims=x.dims)


def _in_rows_layout(x: moa.Array, layout) -> moa.Array:
    """``_in_own_layout``'s inverse: a statistic x in its own layout put in its output's rows'."""
    order = _layout_order(layout)
    y = moa.reshape(x, tuple(u.extent for u in layout.own), dims=tuple(u.name for u in layout.own))
    y = moa.transpose(y, tuple(layout.own.index(u) for u in order))
    return moa.reshape(y, layout.shape, dims=layout.dims)


class _SavingKernel(Kernel):
    """A kernel's forward that also outputs its row statistics (``Kernel.with_row_statistics``),
    each in the layout of the output rows that compute it (``identities.statistic_layouts``).

    ``natural`` defines the statistics in their own layouts; the DNF is ψ-reduced from it and
    then relaid (one program computes a statistic and its rows). ``fn`` — what its derivatives
    are derived from — is the same definition with each relaid statistic put in its rows'
    layout by index maps (``_in_rows_layout``), so that its tangent and adjoint kernels meet
    the DNF's outputs: a second derivative through saved residuals runs them.

    Its DNF then writes a statistic z as c ? z : z̄ where z̄ is its closed form where a row
    condition c fails (``identities.guard_statistics``: the row max past a query length is the
    fill, whatever the keys): the same values, the rows past a query length left out of its
    walk as they are from the plain forward's."""

    def __init__(self, natural, primal: Kernel):
        super().__init__(natural, example=primal.example, name=natural.__name__,
                         outputs=None, dims={p.name: " ".join(p.dims) for p in primal.params})
        self._primal = primal
        self._natural = natural

        def forward(*arrays, **opts):
            outs = natural(*arrays, **opts)
            lays = self.layouts(*arrays, **opts)
            return tuple(o if lay is None else _in_rows_layout(o, lay) for o, lay in zip(outs, lays)) + outs[len(lays):]

        forward.__signature__ = inspect.signature(natural)
        forward.__name__ = natural.__name__
        self.fn = forward

    def cell_names(self, key) -> tuple:
        import jax

        specs = [jax.ShapeDtypeStruct(shape, dt) for shape, dt in key[0]]
        return tuple(o.name for o in self._build(specs, dict(key[1]))[2].outputs)

    def _primal_names(self, specs, options) -> tuple:
        outs = self._primal._build(specs, options)[1]
        return self._primal._names_for(outs if isinstance(outs, tuple) else (outs,))

    def _build(self, specs, options):
        key = self._key(specs, options)
        hit = self._cache.get(key)
        if hit is None:
            inputs = tuple(moa.array(p.name, shape, p.dims, dtype) for p, (shape, dtype) in zip(self.params, key[0]))
            expr = self._natural(*inputs, **options)
            primal_names = self._primal_names(specs, options)
            n_saved = len(expr) - len(primal_names)
            names = _saved_names(self.params, primal_names, n_saved) + primal_names
            dnf, _ = _psi.reduce_to_dnf(self.name, inputs, expr, names, record=False)
            # each statistic in the layout of the output rows that compute it: one program
            # computes both (attention: the one online-softmax pass gives Out, its max and sum)
            layouts = _identities.statistic_layouts(dnf, names[:n_saved])
            dnf = _identities.relayout_forward(dnf, layouts)
            # then each with its closed form where a row condition fails (the same values); the
            # adjoint's identities match the statistics as derived (``dnf_before_identities``)
            self._cache[("before identities", key)] = dnf
            dnf, applied = _identities.guard_statistics(dnf, _identities.statistic_guards(dnf, names[:n_saved]))
            relaid = tuple(o if lay is None else _in_rows_layout(o, lay) for o, lay in zip(expr, layouts))
            hit = (inputs, relaid + tuple(expr[n_saved:]), dnf,
                   functools.partial(_recorded, self.name, inputs, expr, names, tuple(applied)),
                   _reference.to_jax(dnf), layouts)
            self._cache[key] = hit
        return hit

    def layouts(self, *specs, **options) -> list:
        """Per saved statistic, its ``identities.Layout`` (None: saved in its own layout)."""
        return self._build(specs, options)[5]

    def compiled(self, *specs, onf=None, implementation=None, residuals="none", **options):
        """The forward with its row statistics: saved first, then the primal outputs — returned
        primal outputs first (what ``runtime.differentiable`` expects). A kernel like any
        other: its derivatives are its own tangent and adjoint kernels."""
        from moajax.schedule import Preset

        dnf = self._build(specs, options)[2]
        n_saved = len(dnf.outputs) - len(self._primal_names(specs, options))
        # the primal's Preset says what the primal saves; this forward's own derivatives recompute
        if isinstance(onf, Preset) and onf.residuals is not None:
            onf = dataclasses.replace(onf, residuals=None)
        run = super().compiled(*specs, onf=onf, implementation=implementation, residuals="none", **options)

        def both(*args):
            res = run(*args)
            res = res if isinstance(res, tuple) else (res,)
            return tuple(res[n_saved:]) + tuple(res[:n_saved])

        return both


def kernel(fn: Callable | None = None, *, example: dict | None = None, name: str | None = None,
           outputs: tuple | None = None, dims: dict | None = None, register: bool = True):
    """Decorator: define a kernel from a function written with ``moajax.moa`` operations.

    Each array parameter names its dimensions, either in its annotation (``q: "t h"``) or
    in ``dims={"q": "t h"}`` (for code that type checkers read). ``example`` gives a size per
    dimension (used by ``moajax derive``); ``outputs`` names the outputs."""

    def wrap(f):
        k = Kernel(f, example=example, name=name, outputs=outputs, dims=dims)
        if register:
            REGISTRY[k.name] = k
        return k

    return wrap(fn) if fn is not None else wrap
