"""A device mesh as one more level of dimension lifting: which axes of a kernel may be split
over devices, and the kernel run per device under ``jax.sharding``.

MoA: lifting an index i of extent n over p devices is i = ⟨d l⟩ with d < p, l < n/p; the
DNF is unchanged, only its arrays are partitioned. An axis class may be lifted over a mesh
axis with no communication inside the kernel when

- it is a *map* class: every output has one axis in the class and its index only ψ-selects
  (⟨… i …⟩ψ A, or the major digit of a mixed-radix index: ⌊i/G⌋, g + G·i — grouped-query
  heads), never enters arithmetic (ι i, causal masks, windows) and binds no reduction; or
- it is a *monoid* class: the outputs without it are op_i e at their top (op = +, ⌈, ⌊), so
  every device reduces its own block and one collective (psum, pmax, pmin) finishes —
  data-parallel weight gradients.

Anything else (a contracted head dim, a softmax's key axis, a causal query axis) is not
honoured by a plain split: the key axis of attention is lifted by a ring instead
(``moajax.ring``). ``rule`` derives the classes from a DNF; ``partitioned`` wraps a kernel's
compiled function in ``jax.experimental.custom_partitioning`` so that under ``jax.jit`` with
sharded inputs each device runs the kernel on its own block (no all-gather of a map axis),
and an input split along an axis the kernel cannot honour is gathered along it, as XLA's
partitioner gathers for jax.nn (logged once, naming the axis and the splits that would run
without the gather).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from moajax import compat
from moajax import dnf as D
from moajax import ops as _ops
from moajax.ix import FloorDiv, Ix, Var

_COLLECTIVE = {"add": "psum", "max": "pmax", "min": "pmin"}


@dataclasses.dataclass(frozen=True)
class Axis:
    """One axis of an array in the kernel's interface: the class of its major digit (None: an
    axis no split can honour) and how many of its elements one index of the class spans."""

    cls: int | None
    minor: int = 1
    why: str = ""


@dataclasses.dataclass(frozen=True)
class Rule:
    """The mesh-lifting rule of a kernel: per interface array (inputs, then outputs) its axes;
    per class its name, extent (the major digit's), kind ("map", "monoid" or the reason it is
    neither) and, for a monoid class, the monoid of each output that reduces over it."""

    kernel: str
    inputs: tuple  # ((name, dims, (Axis, ...)), ...)
    outputs: tuple
    names: tuple  # per class: the dim name users see
    extents: tuple
    kinds: tuple
    monoids: tuple  # per class: ((output index, monoid), ...)
    unread: frozenset = frozenset()  # inputs the DNF never reads (any split of them is kept)

    def shardable(self, c: int) -> bool:
        return self.kinds[c] in ("map", "monoid")

    def __str__(self):
        lines = [f"mesh rule of {self.kernel}:"]
        for c, (n, e, k) in enumerate(zip(self.names, self.extents, self.kinds)):
            lines.append(f"  {n} ({e}): {k}")
        return "\n".join(lines)


class _Classes:
    """Union-find over index variables (by name and extent: the same Var in every output)."""

    def __init__(self):
        self.parent: dict = {}

    def find(self, v):
        self.parent.setdefault(v, v)
        while self.parent[v] != v:
            self.parent[v] = self.parent[self.parent[v]]
            v = self.parent[v]
        return v

    def union(self, a, b):
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            # keep the larger extent's name as the representative (n over n_kv)
            if (ra.extent, ra.name) < (rb.extent, rb.name):
                ra, rb = rb, ra
            self.parent[rb] = ra


def _major(ix: Ix):
    """The index's major digit and the variables below it: v (v), ⌊v/G⌋ (v), g + G·v with
    every other term below G (v; g minor) — else None."""
    if ix.const != 0 or not ix.terms:
        return None
    if len(ix.terms) == 1:
        atom, c = ix.terms[0]
        if c != 1:
            return None
        if isinstance(atom, Var):
            return atom, ()
        if isinstance(atom, FloorDiv) and atom.arg.as_var() is not None:
            return atom.arg.as_var(), ()
        return None
    atom, c = max(ix.terms, key=lambda t: t[1])
    if not isinstance(atom, Var):
        return None
    rest = Ix(0, tuple(t for t in ix.terms if t[0] is not atom))
    lo, hi = rest.bounds()
    if lo < 0 or hi >= c or any(not isinstance(a, Var) for a, _ in rest.terms):
        return None
    return atom, tuple(a for a, _ in rest.terms)


# the scalar ops through which a monoid's reductions at the top stay at the top: op_v a ∘ op_v b
# = op_v (a ∘ b) for ∘ the monoid's own op (and − for +), so a device reducing its block of v
# in each term and one collective finish the whole
_THROUGH = {"add": ("add", "sub"), "max": ("max",), "min": ("min",)}


def _is_identity(e: D.Expr, monoid: str) -> bool:
    """Whether e is the literal identity of the monoid (0 for a sum, −∞ for a max)."""
    if not isinstance(e, D.Lit):
        return False
    try:
        return bool(np.asarray(e.value, e.dtype) == _ops.monoid(monoid).identity(e.dtype))
    except (TypeError, ValueError):
        return False


def _top_reduction(body: D.Expr):
    """The monoid reductions at the top of an output's body (through labels and conversions
    around it): (op, the reductions' nodes, the variables every term reduces at its top) or
    None. op's a monoid's, commutative: op_b op_n e = op_n op_b e, and Σ_n a + Σ_n b = Σ_n (a +
    b), so each such variable can be split over devices, each device reducing its block, one
    collective finishing — a bias shared by the heads has dBias = Σ_b (Σ_n … + Σ_n …), and a
    head split (tensor parallel) gathered the heads when only the outermost sum counted."""
    body = _strip(body)
    if not isinstance(body, D.Red):
        # sums (or maxima) of reductions at the top: dBias over [B, N, 1, S] is
        # (finite ? Σ_t … : 0) + (finite ? Σ_t … : 0), its only reduction over t (the fifth fuzz)
        for monoid in _THROUGH:
            top = _top_of(body, monoid)
            if top[0]:
                return (monoid,) + top
        return None
    return (body.monoid,) + _top_of(body, body.monoid)


def _top_of(body: D.Expr, monoid: str) -> tuple:
    """(the monoid's reductions at the top of body, the variables every term reduces there)."""

    def tops(e):
        e = D.unlabelled(e)
        if isinstance(e, D.Red) and e.monoid == monoid:
            nodes, vs = tops(e.body)
            return [e] + nodes, vs | {e.var}
        if isinstance(e, D.Call) and e.op in _THROUGH.get(monoid, ()):
            parts = [tops(c) for c in e.children]
            return [n for p, _ in parts for n in p], frozenset.intersection(*(frozenset(v) for _, v in parts))
        if isinstance(e, D.Call) and e.op == "where":
            # (c ? op_v x : identity) = op_v (c ? x : identity) where c does not read v: a bias
            # broadcast over the queries has dBias = Σ_b ((finite ? Σ_t … : 0) + …), and a split
            # of the queries gathered them for the whole backward (a fuzz)
            c, a, b = e.children
            for red, other in ((a, b), (b, a)):
                if _is_identity(other, monoid):
                    nodes, vs = tops(red)
                    return nodes, frozenset(vs) - c.free
        return [], frozenset()

    nodes, vs = tops(body)
    return tuple(nodes), frozenset(vs)


def rule(dnf) -> Rule:
    """The mesh-lifting rule of a DNF (see the module docstring)."""
    uf = _Classes()
    banned: dict = {}  # var → why no split can honour it
    for o in dnf.outputs:
        for v in o.vars:
            uf.find(v)
    positions: dict = {}  # (input, axis) → set of major vars, or None
    for r in dnf.reads():
        for j, ix in enumerate(r.index):
            m = _major(ix)
            key = (r.array, j)
            if m is None:
                for v in ix.free_vars():
                    banned.setdefault(v, f"indexed by {ix} in {r.array}")
                positions[key] = None
                continue
            v, minors = m
            for g in minors:
                banned.setdefault(g, f"a minor digit of {ix} in {r.array}")
            if positions.get(key, ()) is not None:
                positions.setdefault(key, set()).add(v)
    tops = {}
    for i, o in enumerate(dnf.outputs):
        top = _top_reduction(o.body)
        tops[i] = top
        for e in D.walk(o.body):
            if isinstance(e, D.IndexValue):
                for v in e.ix.free_vars():
                    banned.setdefault(v, "in index arithmetic (ι, a mask or a window)")
            elif isinstance(e, D.Red):
                uf.find(e.var)
                if top is None or e.var not in top[2] or not any(e is t for t in top[1]):
                    banned.setdefault(e.var, "reduced inside the kernel")
    for key, vs in positions.items():
        if vs:
            vs = list(vs)
            for v in vs[1:]:
                uf.union(vs[0], v)
    # classes
    reps: list = []
    index: dict = {}

    def cls(v):
        r = uf.find(v)
        if r not in index:
            index[r] = len(reps)
            reps.append(r)
        return index[r]

    def axes_of(name, shape, dims, per_axis):
        out = []
        for j, (n, d) in enumerate(zip(shape, dims)):
            v = per_axis(j)
            if v is None:
                out.append(Axis(None, 1, f"{d} is read by an index no split can honour"))
                continue
            c = cls(v)
            out.append(Axis(c, n))  # minor fixed below, once every extent is known
        return (name, tuple(dims), tuple(out))

    inputs = []
    for spec in dnf.inputs:
        def major(j, spec=spec):
            vs = positions.get((spec.name, j))
            return next(iter(vs)) if vs else None
        inputs.append(axes_of(spec.name, spec.shape, spec.dims, major))
    outputs = [axes_of(o.name, o.shape, o.dims, lambda j, o=o: o.vars[j]) for o in dnf.outputs]
    # each class's extent: the smallest of its axes (the major digit); an axis spans the rest
    extents = [min([ax.minor for _, _, axs in inputs + outputs for ax in axs if ax.cls == c] or [r.extent])
               for c, r in enumerate(reps)]
    kinds, monoids = [], []
    members: dict = {}
    for v in list(uf.parent):
        members.setdefault(cls(v), []).append(v)
    for c, r in enumerate(reps):
        why = next((banned[v] for v in members.get(c, []) if v in banned), None)
        reducers = []
        for i, o in enumerate(dnf.outputs):
            has = any(ax.cls == c for ax in outputs[i][2])
            if has:
                continue
            top = tops[i]
            if top is None or all(cls(v) != c for v in top[2]) or top[0] not in _COLLECTIVE:
                why = why or f"output {o.name} neither has it nor ends in a monoid reduction over it"
            else:
                reducers.append((i, top[0]))
        kinds.append(why if why else ("monoid" if reducers else "map"))
        monoids.append(tuple(reducers))
    fix = lambda arrs: tuple((n, d, tuple(Axis(ax.cls, 1 if ax.cls is None else ax.minor // extents[ax.cls], ax.why)
                                          for ax in axs)) for n, d, axs in arrs)
    names = []
    for c, r in enumerate(reps):
        dim = next((d[j] for _, d, axs in outputs + inputs for j, ax in enumerate(axs)
                    if ax.cls == c and ax.minor == extents[c]), r.name)
        names.append(dim)
    unread = frozenset(i.name for i in dnf.inputs) - dnf.arrays_read()
    return Rule(dnf.name, fix(inputs), fix(outputs), tuple(names), tuple(extents), tuple(kinds), tuple(monoids),
                unread)


def _strip(body):
    """An output's body without the labels and conversions around it."""
    while isinstance(body, (D.Tag, D.Convert)):
        body = body.children[0]
    return body


# ----------------------------------------------------------------------------- partitioning


def _mesh_size(mesh, axes) -> int:
    return int(np.prod([mesh.shape[a] for a in axes])) if axes else 1


def _spec_axes(entry) -> tuple:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def assignment(r: Rule, mesh, arg_specs, who: str, plain=None) -> tuple[dict, list]:
    """(class → mesh axes, the splits gathered): read off the inputs' partition specs, in
    order. A split the kernel cannot honour — along an axis no class of which a split runs
    without communication (a contracted head dim, a softmax's key axis, a causal query axis),
    by a mesh size the class's extent does not divide, over other mesh axes than an earlier
    input splits the class by, or by a mesh axis an earlier class took — is not assigned: the
    input is gathered along it (XLA's partitioner inserts the all-gather, as it does for
    jax.nn), and the second list says why: (input, axis, its dim, over what, the reason).
    ``plain`` (or None): a function giving the rule of the kernel's DNF before its identities
    (``_exact_at_one``)."""
    out: dict = {}
    gathered: list = []
    for name, j, dim, ax, m in _split_axes(r, arg_specs):
        where = (name, j, dim, f"mesh axis {'×'.join(m)}")
        if ax.cls is None or not r.shardable(ax.cls):
            why = ax.why if ax.cls is None else f"{r.names[ax.cls]} is {r.kinds[ax.cls]}"
            gathered.append(where + (f"this kernel cannot honour it: {why}",))
            continue
        size = _mesh_size(mesh, m)
        taken = [a for c, ms in out.items() if c != ax.cls for a in ms]
        if r.extents[ax.cls] % size:
            gathered.append(where + (f"its {size} devices do not divide {r.names[ax.cls]}'s extent "
                                     f"{r.extents[ax.cls]}",))
        elif (r.kinds[ax.cls] == "monoid" and r.extents[ax.cls] // size < 2 <= r.extents[ax.cls]
              and not _exact_at_one(r, ax.cls, plain)):
            # a block of one element of a class the outputs sum over, which only an identity
            # made a monoid: the per-device kernel's derivation drops its sum of one term, and
            # with it the identity (attention's Δ = +/(dO × Out) for dQ = Σ_s dS K): dQ and
            # dK were wrong with one key a device. A check of the block's own rule
            # (``_block_disagrees``) cannot see a class of one element
            gathered.append(where + (f"its {size} devices would hold one element each of {r.names[ax.cls]}, "
                                     "which the outputs sum over",))
        elif out.get(ax.cls, m) != m:
            gathered.append(where + (f"an earlier input splits {r.names[ax.cls]} over {'×'.join(out[ax.cls])}",))
        elif set(m) & set(taken):
            gathered.append(where + ("the mesh axis splits another axis of the kernel already",))
        else:
            out[ax.cls] = m
    return out, gathered


def _exact_at_one(r: Rule, c: int, plain) -> bool:
    """Is class ``c`` a monoid (or a map) in ``plain()``, the rule of the kernel's DNF before
    the papers' identities (``moajax.identities``), too? Then no rewrite that matches a sum
    over it makes it one, and a device's kernel derived for a block of one of its elements
    is the whole kernel's restricted (a bias's gradient Σ_b with one sequence a device);
    else (or no ``plain``) it is not known to be."""
    if plain is None:
        return False
    p = plain()
    # (an input only an identity reads, Out, has no class there)
    axes = [pa for (name, _, axs), (_, _, paxs) in zip(r.inputs + r.outputs, p.inputs + p.outputs)
            if name not in p.unread for ax, pa in zip(axs, paxs) if ax.cls == c]
    return bool(axes) and all(pa.cls is not None and p.shardable(pa.cls) for pa in axes)


def _split_axes(r: Rule, arg_specs):
    """(input, axis, its dim, its Axis, mesh axes) of every split axis of the inputs the DNF
    reads, in order."""
    for (name, dims, axs), spec in zip(r.inputs, arg_specs):
        if name in r.unread:
            continue
        for j, (ax, entry) in enumerate(zip(axs, tuple(spec) + (None,) * (len(axs) - len(tuple(spec))))):
            if _spec_axes(entry):
                yield name, j, dims[j], ax, _spec_axes(entry)


_GATHER_LOGGED: set = set()


def _log_gathered(r: Rule, gathered, who: str) -> None:
    """One warning per kernel and set of gathered splits: a gather moves each such input whole
    to every device (the call runs, as jax.nn's does; a split the kernel honours moves nothing)."""
    if not gathered or (who, tuple(gathered)) in _GATHER_LOGGED:
        return
    _GATHER_LOGGED.add((who, tuple(gathered)))
    import logging

    by_reason: dict = {}
    for name, axis, dim, over, why in gathered:
        by_reason.setdefault((over, why), []).append(name if axis is None else f"{name} axis {axis} ({dim})")
    logging.getLogger("moajax").warning(
        "moajax: %s gathers what it cannot run split (an all-gather, as XLA's partitioner does for jax.nn): %s. "
        "Splits it runs as they are: its axes %s", who,
        "; ".join(f"{', '.join(names)} over {over}: {why}" for (over, why), names in by_reason.items()),
        _shardable_dims(r))


def visible(arrays) -> tuple | None:
    """(mesh, partition specs) of the arrays where their split is known while tracing (a
    concrete jax.Array, or an explicit-axes mesh); None when none is split."""
    import jax
    from jax.sharding import NamedSharding

    mesh, specs = None, []
    for x in arrays:
        try:
            sh = x.sharding if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) else \
                jax.typeof(x).sharding
        except (AttributeError, TypeError):
            sh = None
        spec = tuple(getattr(sh, "spec", ()) or ())
        if isinstance(sh, NamedSharding) and any(spec):
            mesh = sh.mesh
        specs.append(spec)
    return None if mesh is None else (mesh, specs)


def conform(dnf, arrays, who: str, lift=None, plain_dnf=None) -> tuple:
    """``arrays``, each gathered where it is split in a way the kernel cannot honour, when the
    split is visible while tracing (concrete arrays, an explicit-axes mesh); a ValueError now
    for a split a Preset's ring was asked for and cannot take. Gathering here, before the
    kernel's partitioning, is what lets XLA run a split of a class by more devices than its
    extent (GQA's 8 query heads over 8 devices, 2 kv heads): Shardy would split the class over
    a part of the mesh axis, which JAX's partitioning callback cannot name. Under ``jax.jit``
    with automatic axes the split is known only when XLA partitions, and ``partitioned`` asks
    for the same gathers there. ``lift`` and ``plain_dnf``: as there."""
    seen = visible(arrays)
    if seen is None:
        return tuple(arrays)
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    r = rule(dnf)
    mesh, specs = seen
    gathered = _splits(r, specs, lift, mesh, who, [tuple(a.shape) for a in arrays], _memo(plain_dnf))[1]
    _log_gathered(r, gathered, who)
    drop: dict = {}
    for name, axis, _, _, _ in gathered:
        drop.setdefault(name, set()).add(axis)
    out = []
    for (name, _, _), x, spec in zip(r.inputs, arrays, specs):
        if name in drop:
            spec = tuple(None if j in drop[name] else e for j, e in enumerate(spec))
            sharding = NamedSharding(mesh, P(*spec))
            x = compat.reshard(x, sharding) if isinstance(x, jax.core.Tracer) else jax.device_put(x, sharding)
        out.append(x)
    return tuple(out)


def explicit_out_specs(dnf, arrays, who: str, lift=None, plain_dnf=None):
    """On a mesh of Explicit axes (sharding in types), the PartitionSpec of each output as the
    kernel's partitioning leaves it (the classes of its axes as the inputs split them: run
    ``conform`` first); None where no input is split over an Explicit axis. The kernel then
    runs under ``compat.auto_axes``: its lowering is traced before XLA partitions it, and a
    contraction over a split class is ambiguous in a sharding-typed trace."""
    seen = visible(arrays)
    if seen is None or not compat.has_explicit_axes(seen[0]):
        return None
    r = rule(dnf)
    mesh, specs = seen
    assign, _, lifted = _splits(r, specs, lift, mesh, who, [tuple(a.shape) for a in arrays], _memo(plain_dnf))
    if lifted is not None:
        assign.update({c: (lifted,) for c in lift.classes(r)})
    return tuple(_pspec(axs, assign) for _, _, axs in r.outputs)


def _splits(r: Rule, specs, lift, mesh, who: str, shapes, plain=None, refuse: bool = True) -> tuple:
    """(class → mesh axes, the splits gathered, the ring's mesh axis or None): the ring where
    it takes the sequence's split and no other class is split over its mesh axis (a batch
    split over the ring's axis gave a PartitionSpec naming it twice), else the plain
    split's ``assignment`` of every input's split — which also wins over the default ring
    where it runs every split as it is. ``refuse``: as for ``_lifted_axis``."""
    lifted_specs, lifted = _lifted_axis(r, specs, lift, mesh, who, shapes, refuse)
    if lifted is not None and getattr(lift, "balance", None) is None:
        whole, gathered = assignment(r, mesh, specs, who, plain)
        if not gathered:
            # no communication inside the kernel (the query's rows split, the keys whole: a
            # map class forward, dK and dV one psum backward), where the ring permuted the
            # keys around and gathered its outputs back to the callers' layout (a fuzz)
            return whole, [], None
    assign, gathered = assignment(r, mesh, lifted_specs, who, plain)
    if lifted is not None and any(lifted in m for m in assign.values()):
        lifted = None
        assign, gathered = assignment(r, mesh, specs, who, plain)
    return assign, gathered, lifted


def _shardable_dims(r: Rule) -> list:
    return sorted({r.names[c] for c in range(len(r.names)) if r.shardable(c)})


def _pspec(axs, assign):
    from jax.sharding import PartitionSpec as P

    parts = []
    for ax in axs:
        m = assign.get(ax.cls) if ax.cls is not None else None
        parts.append(None if not m else (m[0] if len(m) == 1 else tuple(m)))
    return P(*parts)


def sdy_rule(r: Rule, in_shapes, out_shapes):
    """The Shardy sharding rule: one factor per class (its major digit), a minor factor per
    axis that spans more, the classes no split honours marked need-replication."""
    sizes: dict = {}
    repl: list = []
    k = [0]

    def fresh(size):
        k[0] += 1
        n = f"m{k[0]}"
        sizes[n] = int(size)
        repl.append(n)
        return n

    def dim(ax, extent):
        if ax.cls is None:
            return fresh(extent)
        f = f"c{ax.cls}"
        if not r.shardable(ax.cls) and f not in repl:
            repl.append(f)
        if ax.minor == 1:
            return f
        sizes[f] = int(r.extents[ax.cls])  # Shardy takes sizes only of a compound dim's factors
        return f"({f} {fresh(ax.minor)})"

    def arr(shape, axs):
        return " ".join(dim(ax, n) for ax, n in zip(axs, shape)) if axs else ""

    text = ", ".join(arr(s, axs) for s, (_, _, axs) in zip(in_shapes, r.inputs)) + " -> " + ", ".join(
        arr(s, axs) for s, (_, _, axs) in zip(out_shapes, r.outputs))
    import re

    whole = set(re.sub(r"\([^)]*\)", " ", text).replace(",", " ").split()) - {"->"}
    sizes = {f: n for f, n in sizes.items() if f not in whole}  # Shardy infers a whole dim's size
    # Shardy's reduction factors appear in no result; a class that some outputs keep and others
    # reduce is a plain factor (``partition`` finishes the reducing outputs)
    kept = {ax.cls for _, _, axs in r.outputs for ax in axs}
    red = tuple(f"c{c}" for c in range(len(r.names)) if r.kinds[c] == "monoid" and c not in kept)
    return text, sizes, tuple(repl), red


def _lifted_axis(r: Rule, specs, lift, mesh, who: str, shapes, refuse: bool = True):
    """(the specs without the sequence split, the mesh axis the lift's classes are lifted over)
    where its ring takes the split: one mesh axis of more than one device (XLA's partitioner
    does not lift a mesh axis of one), the same for queries, keys and values, dividing the
    sequence evenly and into the ring's chunks (``lift.check_split``; ``shapes``: the inputs'
    global shapes). Else (the specs, None): ``assignment`` gathers the sequence — but a ring
    a Preset asked for (its ``ring``) that cannot take the split raises the ValueError where
    the split is seen while tracing (``refuse``); where only XLA's partitioner sees it (jit
    with automatic axes), a ValueError there reached the caller as XLA's INTERNAL error, so
    the sequence is gathered with a RuntimeWarning that says why the Preset's ring was not run."""
    if lift is None:
        return specs, None
    seq = lift.classes(r)
    found, rest = set(), []
    for (name, dims, axs), spec in zip(r.inputs, specs):
        spec = list(tuple(spec) + (None,) * (len(axs) - len(tuple(spec))))
        for j, ax in enumerate(axs):
            if ax.cls in seq and spec[j] is not None and name not in r.unread:
                found.add(_spec_axes(spec[j]))
                spec[j] = None
        rest.append(tuple(spec))
    if not found:
        return specs, None
    try:
        if len(found) > 1 or len(next(iter(found))) != 1:
            raise ValueError(f"{who}: the sequence is split over {sorted(found)}; the ring takes one mesh axis, the "
                             "same for queries, keys and values")
        lifted = next(iter(found))[0]
        devices = int(mesh.shape[lifted])
        if devices == 1:
            return rest, None
        for c in seq:
            if r.extents[c] % devices:
                raise ValueError(f"{who}: the sequence ({r.names[c]}, {r.extents[c]}) is split over mesh axis "
                                 f"{lifted!r} of {devices} devices, which does not divide it")
        lift.check_split(lifted, devices, shapes)
    except ValueError as e:
        if getattr(lift, "balance", None) is not None:  # the user's own ring: refused, not replaced
            if refuse:
                raise
            import warnings

            warnings.warn(f"{e} — the Preset's ring ({lift.balance!r}, {lift.rounds} round(s)) cannot take this split, "
                          "seen only as XLA partitions the jitted call: the sequence is gathered instead",
                          RuntimeWarning, stacklevel=2)
        return specs, None
    return rest, lifted


def _block_disagrees(r: Rule, assign: dict, local: Rule, local_shapes: dict, own_shapes: dict) -> dict:
    """{class: why} for each split class of ``assign`` that the rule of the kernel derived for
    a device's block (``local``) does not run split as the whole kernel's rule (``r``) does.
    ``local_shapes``: the blocks' shapes by array name; ``own_shapes``: the shapes the block's
    kernel gives them, which may drop axes of extent 1 (a statistic's layout). The per-device kernel is derived afresh
    for its block's shapes, and its derivation may differ where an axis has extent 1 (ψ
    reads it at 0, an identity may not match): an adjoint that reads Δ from Out as a whole
    but sums it over its own keys as a block summed it over one device's keys — dQ and dK
    wrong, silently. A class whose block holds one element has nothing to compare."""
    axes = {name: axs for name, _, axs in local.inputs + local.outputs}
    out: dict = {}
    for name, _, axs in r.inputs + r.outputs:
        if name in r.unread or name not in axes:
            continue
        at = D.squeezed_axes(local_shapes[name], own_shapes[name])
        for j, ax in enumerate(axs):
            if ax.cls is None or ax.cls not in assign or ax.cls in out or at is None:
                continue
            if local_shapes[name][j] // ax.minor < 2:
                continue
            lax = axes[name][at[j]]
            kind = lax.why if lax.cls is None else local.kinds[lax.cls]
            if kind != r.kinds[ax.cls]:
                out[ax.cls] = f"the kernel derived for a device's block has it {kind}, the whole kernel {r.kinds[ax.cls]}"
    return out


def _memo(dnf_of):
    """The rule of ``dnf_of()``, derived once, when first asked (None for no ``dnf_of``)."""
    if dnf_of is None:
        return None
    return functools.cache(lambda: rule(dnf_of()))


class UnderOmega:
    """A kernel's mesh lifting carried through Ω over a leading batch axis (``Kernel.batched``,
    what ``jax.vmap`` runs): Ω(f)(A)[i] = f(A[i]), so the cell's lifted axis j is the batched
    array's axis j + 1, and each device runs the cell's lifted program under ``jax.vmap`` (its
    collectives batched alike: the ring's permutes carry every batch element's block at once).
    An output the batch shares the argument of (``summed``) is summed over the batch on the
    device, after the lifted program. Without it a vmap around the sequence-split attention
    gathered the whole sequence (a fuzz, 2026-12-06)."""

    def __init__(self, lift, primal, in_batched: tuple, summed: tuple):
        self.lift, self.primal, self.in_batched, self.summed = lift, primal, tuple(in_batched), tuple(summed)

    def for_dnf(self, dnf, options, onf=None):
        """The lift of the batched kernel's DNF ``dnf``: its cell's, moved one axis in; or None."""
        import jax

        if tuple(i.name for i in dnf.inputs) != tuple(p.name for p in self.primal.params):
            # a kernel derived from the batched one (its adjoint, under a second derivative) is
            # no cell under Ω: its arguments are others (a fuzz: they were zipped with these flags)
            return None
        cells = [jax.ShapeDtypeStruct(i.shape[1:] if b else i.shape, i.dtype)
                 for i, b in zip(dnf.inputs, self.in_batched)]
        cell = self.primal._build(cells, options)[2]
        lifted = self.lift.for_dnf(cell, options, onf)
        return None if lifted is None else _LiftedUnderOmega(lifted, cell, self.in_batched, self.summed)


class _LiftedUnderOmega:
    def __init__(self, lifted, cell, in_batched: tuple, summed: tuple):
        self.lifted, self.cell, self.in_batched, self.summed = lifted, cell, in_batched, frozenset(summed)
        # (a Preset's ring: ``_lifted_axis`` refuses a split it cannot take rather than gather)
        self.balance, self.rounds = getattr(lifted, "balance", None), getattr(lifted, "rounds", 1)

    def classes(self, r: Rule) -> frozenset:
        """The batched rule's classes of the axes the cell's lift lifts (one axis further in
        on a batched argument)."""
        cell = rule(self.cell)
        lifted = self.lifted.classes(cell)
        out = set()
        for (_, _, axs), (_, _, big), b in zip(cell.inputs, r.inputs, self.in_batched):
            out |= {big[j + b].cls for j, ax in enumerate(axs) if ax.cls in lifted}
        return frozenset(out) - {None}

    def _cells(self, shapes) -> list:
        return [tuple(s)[1:] if b else tuple(s) for s, b in zip(shapes, self.in_batched)]

    def check_split(self, axis_name: str, devices: int, shapes) -> None:
        self.lifted.check_split(axis_name, devices, self._cells(shapes))

    def per_device(self, axis_name: str, devices: int, local_in, local_out):
        import jax

        cell_out = [tuple(s) if j in self.summed else tuple(s)[1:] for j, s in enumerate(local_out)]
        one = self.lifted.per_device(axis_name, devices, self._cells(local_in), cell_out)
        # the cell's lift may need some arguments batched together (``batched_together``: the
        # ring's block adjoint reads the whole row's Out only so); those are broadcast over it
        flags = getattr(self.lifted, "batched_together", lambda f: f)(self.in_batched)
        size = next(s[0] for s, b in zip(local_in, self.in_batched) if b)

        def batched(*xs):
            xs = [jax.numpy.broadcast_to(x, (size,) + x.shape) if f and not b else x
                  for x, f, b in zip(xs, flags, self.in_batched)]
            outs = jax.vmap(one, in_axes=tuple(0 if f else None for f in flags))(*xs)
            many = isinstance(outs, tuple)
            outs = tuple(o.sum(0) if j in self.summed else o for j, o in enumerate(outs if many else (outs,)))
            return outs if many else outs[0]
        return batched


def partitioned(run, dnf, relower, who: str, lift=None, precision=None, local_dnf=None, plain_dnf=None):
    """``run`` (the kernel's compiled function of its inputs) partitioned over a device mesh:
    under ``jax.jit`` with sharded inputs, each device runs ``relower(local input specs)`` on
    its block, and an output missing a monoid class that is split is finished by its
    collective. ``lift`` (or None): a kernel's own lifting of classes no plain split honours
    (``classes(rule)``, ``per_device(mesh axis, devices, local input shapes, local output
    shapes)``: attention's sequence, the ring). On one device (or inside ``shard_map``) it
    is ``run`` itself. ``precision``: the matmul precision config of the call (None: JAX's
    default), under which the per-device kernels are derived and traced — XLA's partitioner
    asks for them when it compiles, outside the block the call was made in. ``local_dnf``
    (local input specs → the DNF of a device's block): where given, a split whose per-device
    kernel would not run it as the whole kernel's rule says (``_block_disagrees``) is gathered.
    ``plain_dnf`` (→ the whole DNF before the identities): where given, a monoid class split
    to one element a device runs split if it is a monoid there too (``_exact_at_one``)."""

    import jax
    from jax.experimental.custom_partitioning import custom_partitioning

    r = rule(dnf)
    in_shapes = [i.shape for i in dnf.inputs]
    out_shapes = [o.shape for o in dnf.outputs]
    n_out = len(dnf.outputs)

    seq = lift.classes(r) if lift is not None else frozenset()
    plain = _memo(plain_dnf)

    def plan(mesh, arg_shapes):
        specs = [compat.partition_spec(getattr(a, "sharding", None), mesh, len(a.shape)) for a in arg_shapes]
        # a split no PartitionSpec names (over part of a mesh axis): that input gathered whole
        unnamed = [(name, None, None, "a part of a mesh axis", "no PartitionSpec names the split")
                   for (name, _, _), spec in zip(r.inputs, specs) if spec is None]
        specs = [tuple(spec or ()) for spec in specs]
        assign, gathered, lifted = _splits(r, specs, lift, mesh, who, [tuple(a.shape) for a in arg_shapes], plain,
                                           refuse=False)
        gathered = unnamed + gathered
        if lifted is not None:
            assign.update({c: (lifted,) for c in seq})
        args, outs = shardings(mesh, assign)
        while lifted is None and local_dnf is not None and assign:
            local = {name: sh.shard_shape(s) for (name, _, _), sh, s in zip(r.inputs, args, in_shapes)}
            local.update({name: sh.shard_shape(s) for (name, _, _), sh, s in zip(r.outputs, outs, out_shapes)})
            block = local_dnf(tuple(jax.ShapeDtypeStruct(local[name], a.dtype)
                                    for (name, _, _), a in zip(r.inputs, arg_shapes)))
            own = {a.name: a.shape for a in block.inputs + block.outputs}
            wrong = _block_disagrees(r, assign, rule(block), local, own)
            if not wrong:
                break
            gathered += [(name, j, dim, f"mesh axis {'×'.join(m)}", wrong[ax.cls])
                         for name, j, dim, ax, m in _split_axes(r, specs) if ax.cls in wrong]
            assign = {c: m for c, m in assign.items() if c not in wrong}
            args, outs = shardings(mesh, assign)
        _log_gathered(r, gathered, who)
        return assign, args, outs, lifted

    def shardings(mesh, assign):
        """(the inputs', the outputs' NamedShardings) of a class → mesh axes assignment."""
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        # an input the kernel never reads (its axes have no class) is split as the arrays it
        # shares a dim with: its block's shape is one the per-device kernel is derived for
        # (kept as it came, an unread Out split along a gathered sequence gave the kernel 4 of
        # its rows beside the query's 16)
        read = [(dims, _pspec(axs, assign)) for name, dims, axs in r.inputs + r.outputs if name not in r.unread]
        by_dim = {d: entry for dims, spec in read for d, entry in zip(dims, tuple(spec)) if entry is not None}
        args = tuple(NamedSharding(mesh, P(*(by_dim.get(d) for d in dims)) if name in r.unread else _pspec(axs, assign))
                     for name, dims, axs in r.inputs)
        outs = tuple(NamedSharding(mesh, _pspec(axs, assign)) for _, _, axs in r.outputs)
        return args, outs

    def infer(mesh, arg_shapes, result_shape):
        outs = plan(mesh, arg_shapes)[2]
        return outs if n_out > 1 else outs[0]

    @functools.partial(compat.at_matmul_precision, value=precision)
    def partition(mesh, arg_shapes, result_shape):
        assign, args, outs, lifted = plan(mesh, arg_shapes)
        local = [jax.ShapeDtypeStruct(sh.shard_shape(s), a.dtype) for s, sh, a in zip(in_shapes, args, arg_shapes)]
        local_out = [sh.shard_shape(s) for s, sh in zip(out_shapes, outs)]
        if lifted is not None:
            inner = lift.per_device(lifted, int(mesh.shape[lifted]), [x.shape for x in local], local_out)
        else:
            inner = relower(tuple(local))
        finish = []  # (output index, collective, mesh axes)
        for c, m in assign.items():
            # the ring's classes are finished by the ring; split plainly (no ring: T ≠ S, a
            # sequence over two mesh axes) they are monoid classes like any — their psum was
            # skipped all the same, and dK, dV (or dQ) came back as one device's part, silently
            for i, monoid in (r.monoids[c] if lifted is None or c not in seq else ()):
                finish.append((i, _COLLECTIVE[monoid], m))

        @functools.partial(compat.at_matmul_precision, value=precision)
        @compat.without_context_mesh
        def lower_fn(*xs):
            res = inner(*xs)
            res = list(res) if n_out > 1 else [res]
            # a block's kernel drops axes of extent 1 from a statistic's layout: the same elements
            res = [x.reshape(shape) if x.shape != shape else x for x, shape in zip(res, local_out)]
            for i, coll, m in finish:
                res[i] = getattr(jax.lax, coll)(res[i], m if len(m) > 1 else m[0])
            return tuple(res) if n_out > 1 else res[0]

        return mesh, lower_fn, (outs if n_out > 1 else outs[0]), args

    text, sizes, repl, red = sdy_rule(r, in_shapes, out_shapes)
    def call(*args):  # positional only: custom_partitioning binds the signature
        return run(*args)

    f = custom_partitioning(call)
    # the shardings decoded here (compat.partition_spec), not by JAX, whose decoding raises
    # on a split over part of a mesh axis before ``partition`` could gather it
    f.def_partition(partition=partition, infer_sharding_from_operands=infer,
                    decode_shardings=not compat.decodes_shardings(),
                    sharding_rule=text, need_replication_factors=tuple(repl), reduction_factors=red, **sizes)
    # custom_partitioning has no batching rule: under jax.vmap the kernel's own code is batched
    # (a kernel's compiled function catches vmap earlier, ``Kernel._batchable``; this is for
    # the rest, e.g. a saving forward)
    from jax import custom_batching

    g = custom_batching.custom_vmap(f)

    @g.def_vmap
    def batched(axis_size, in_batched, *args):
        out = jax.vmap(call, in_axes=tuple(0 if b else None for b in in_batched), axis_size=axis_size)(*args)
        return out, (True,) * n_out if n_out > 1 else True

    return g


__all__ = ["Rule", "rule", "partitioned", "assignment", "conform", "visible", "UnderOmega"]
