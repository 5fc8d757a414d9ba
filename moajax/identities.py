"""The papers' identities: named, meaning-preserving rewrites of adjoint DNFs.

A derived adjoint recomputes what the forward already holds. Given the forward's DNF and the
values its backward receives (the forward's outputs, its saved row statistics), each rule
rewrites the adjoint's DNF to read them instead; the meaning (in exact arithmetic) is kept,
so the unrewritten adjoint's DNF → JAX reference stays the oracle.

    output-reuse
        where the forward's output is Y = c · Σ_s G (c not using s), a · Σ_s G = (a ÷ c) · Y
    Δ-from-output (paper II)
        Σ_s F(s) × (Σ_e dY[e] × W[s e])  =  Σ_e dY[e] × (Σ_s F(s) × W[s e])     (sums commute)
        and, where Y[e] = c · Σ_s G(s) × W[s e] and F = a · G:
                                         =  (a ÷ c) · Σ_e dY[e] × Y[e]
    For attention, the softmax's cotangent Δ = +/(P × dP), a pass over keys with two
    contractions per query row, becomes +/(dO × O): one pass over the head dim.
    guarded-statistic (the saving forward's DNF)
        z = c ? z : z̄       where z is a statistic and z̄ its closed form where c fails
    (attention's row max past a query length is the fill, its sum S): the statistic then reads
    its pass only where c holds, so the forward leaves out the rows where c fails (a query
    length's padding: ``onf.dead_rows``), as the forward without statistics does.

Only an output the forward computes at full precision is read back (an output cast to a
narrower dtype is rounded: reading it would change the value, so the rule does not apply).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, NamedTuple

from moajax import dnf as D
from moajax.ix import Ix, Var

DELTA_FROM_OUTPUT = "Δ-from-output"
OUTPUT_REUSE = "output-reuse"


@dataclasses.dataclass(frozen=True)
class Applied:
    """One application of an identity: ``before`` rewritten to ``after`` (shown as DNF)."""

    rule: str
    before: str
    after: str


def _read_in(e: D.Expr):
    """The input read e is, exactly: itself, or widened to a wider float (bfloat16 → float32)."""
    e = _bare(e)
    if isinstance(e, D.Convert) and e.dtype.kind == "f" and e.dtype.itemsize > _bare(e.arg).dtype.itemsize:
        e = _bare(e.arg)
    return e if isinstance(e, D.Read) else None


def _guards(e: D.Expr) -> tuple[list, D.Expr]:
    """e = (g₁ ? (g₂ ? X : 0) : 0) as ([g₁, g₂], X): the guards outside a value that is 0
    wherever one fails (a query row past its length: jax.nn's output and cotangent there)."""
    gs: list = []
    while True:
        b = _bare(e)
        if not (isinstance(b, D.Call) and b.op == "where" and isinstance(_bare(b.children[2]), D.Lit)
                and _bare(b.children[2]).value == 0):
            return gs, e
        gs.append(b.children[0])
        e = b.children[1]


def _guarded_read(e: D.Expr) -> tuple[list, D.Read | None]:
    """e as (guards, the input read inside them): ``_read_in`` under ``_guards``, either side of
    a widening (g ? float(dY) : 0 or float(g ? dY : 0))."""
    gs, inner = _guards(e)
    b = _bare(inner)
    if isinstance(b, D.Convert) and b.dtype.kind == "f" and b.dtype.itemsize > _bare(b.arg).dtype.itemsize:
        more, inner = _guards(b.arg)
        gs, inner = gs + more, (inner if not more else D.Convert(inner, b.dtype))
    return gs, _read_in(inner)


def _guards_hold(pattern: list, term: list, params, env: dict) -> bool:
    """Does each of Y's guards (``pattern``, over Y's variables ``params``, at the element σ
    ``env``) stand among the cotangent's (``term``)? Where one fails, Y is 0 and so is dY."""
    return all(any(D.match(p, t, params, env) is not None for t in term) for p in pattern)


class _Held(NamedTuple):
    """A forward output Y = (guards ? c · Σ_s G : 0) as the adjoint can read it back."""

    y: D.Output  # the value held (its float32 statistic before rounding, for a 16-bit output)
    y_in: str  # the adjoint input holding it
    form: tuple  # ``_form``: (s, c's num, c's den, G's num, G's den)
    vars: tuple  # the output's own variables (those its cotangent dY indexes)
    guards: list  # ``_guards``
    width: int  # the output's own itemsize (``delta_from_output``: a finer gradient recomputes)


def _bare(e: D.Expr) -> D.Expr:
    while isinstance(e, D.Tag):
        e = e.body
    return e


def factors(e: D.Expr) -> tuple[list, list]:
    """e = Π num ÷ Π den, a negation −x as the factors −1 and x."""
    num, den = D.mul_div_factors(e)
    out_n, out_d = [], list(den)
    for f in num:
        g = _bare(f)
        if isinstance(g, D.Call) and g.op == "neg" and g.dtype.kind == "f":
            n2, d2 = factors(g.children[0])
            out_n += [D.Lit(-1.0, g.dtype)] + n2
            out_d += d2
        else:
            out_n.append(f)
    return out_n, out_d


def _match_factors(pattern: list, term: list, params, env: dict, bound: dict) -> dict | None:
    """σ extending ``env`` with each pattern factor matching a distinct term factor (any order)."""
    if len(pattern) != len(term):
        return None
    if not pattern:
        return env
    for j, t in enumerate(term):
        found = D.match(pattern[0], t, params, env, bound)
        if found is not None:
            rest = _match_factors(pattern[1:], term[:j] + term[j + 1:], params, found, bound)
            if rest is not None:
                return rest
    return None


def _cancel(num: list, den: list) -> tuple[list, list]:
    """Π num ÷ Π den with the factors that appear on both sides removed (a · l ÷ (l · l) = a ÷ l)."""
    num, den = list(num), list(den)
    for f in list(num):
        if any(f is g for g in den):
            num.remove(f)
            den.pop(next(i for i, g in enumerate(den) if g is f))
    return num, den


def _held_read(name: str, out: D.Output, index, shapes: Mapping) -> D.Read:
    """⟨index⟩ψ name: the element of the forward's ``out`` at ``index`` (one Ix per out.vars)
    in the input ``name`` that holds it, whose shape (``shapes``; absent: out's own) may keep
    axes of extent 1 that out, derived for these shapes, has not: a device's block of a
    statistic saved as [t n] with one head a device is (T, 1), where the forward derived for
    the block's shapes drops n. Those axes are read at 0, as the adjoint reads them — read
    at out's rank, no identity matched, and the per-device adjoint summed Δ over its own keys."""
    index = tuple(index)
    shape = tuple(shapes.get(name, out.shape))
    at = D.squeezed_axes(shape, out.shape)
    if shape == tuple(out.shape) or at is None:  # (not the same elements: no identity will match)
        return D.Read(name, index, out.dtype)
    return D.Read(name, tuple(index[at[j]] if j in at else Ix.of(0) for j in range(len(shape))), out.dtype)


def read_statistics(e: D.Expr, statistics: list, shapes: Mapping = {}) -> D.Expr:
    """e with each occurrence of a statistic's body replaced by a read of the input that holds
    it. ``statistics``: (input name, forward Output) in the forward's order, so that a later
    statistic (a softmax's denominator) is matched with the earlier ones (its max) read;
    ``shapes``: the holding inputs' shapes, where they differ from the outputs' (``_held_read``)."""
    patterns: list = []

    def replace(x: D.Expr, pats) -> D.Expr:
        def fn(y):
            if not isinstance(_bare(y), (D.Red, D.Convert)):
                return None
            for name, out, pat in pats:
                env = D.match(pat, y, out.vars)
                if env is not None and set(env) == set(out.vars):
                    return _held_read(name, out, (env[v] for v in out.vars), shapes)
            return None

        return D.transform(x, fn)

    for name, out in statistics:
        patterns.append((name, out, replace(out.body, patterns)))
    return replace(e, patterns)


def _form(body: D.Expr):
    """Y = c · Σ_v G as (v, c's num, c's den, G's num, G's den): the one Σ among Y's factors,
    with the factors that do not use v (outside it or inside) as c; None if Y is not so."""
    num, den = factors(_bare(body))
    sums = [f for f in num if isinstance(_bare(f), D.Red) and _bare(f).monoid == "add" and f.dtype.kind == "f"]
    if len(sums) != 1 or any(isinstance(_bare(f), D.Red) for f in den):
        return None
    r = _bare(sums[0])
    v = r.var
    in_n, in_d = factors(r.body)
    outer = [f for f in num if f is not sums[0]]
    return (v, outer + [f for f in in_n if v not in f.free], den + [f for f in in_d if v not in f.free],
            [f for f in in_n if v in f.free], [f for f in in_d if v in f.free])


def delta_from_output(adjoint: D.DNF, forward: D.DNF, cotangent_of: Mapping[str, str],
                      value_of: Mapping[str, str], saved: Mapping[str, str], *,
                      rounded: bool = True) -> tuple[D.DNF, list]:
    """Apply output-reuse and Δ-from-output everywhere they match in ``adjoint``.

    output-reuse:   a · Σ_s G (the sum the forward's output Y = c · Σ_s G is made of, at any
                    element σ)  =  a · Y[σ] ÷ c[σ]
    Δ-from-output:  Σ_s F × (Σ_e dY × W)  =  Σ_e dY × (Σ_s F × W), then output-reuse; also
                    where Y = (g ? c · Σ_s G : 0) and dY is guarded by g too (query rows past
                    their length: both 0 where g fails, so the rows' Δ is 0 either way)

    ``cotangent_of``: adjoint input (d_out) → the forward output it is the cotangent of;
    ``value_of``: forward output → the adjoint input holding its value; ``saved``: forward
    output that is a saved statistic → the adjoint input holding it. ``rounded``: the
    forward's values carry its dots' rounding (a GPU's 16-bit dots: ``Kernel.gpu_dots_round``),
    so Δ read from them is good only to that rounding; a gradient finer than the output, or
    one that sums Δ over rows and keys (``_summed_over_rows_and_keys``), then recomputes it (on
    a CPU the forward's float32 dots round only their sums: False, and each gradient reads it).
    Returns the rewritten DNF and what was applied (each distinct rewrite once)."""
    outs = {o.name: o for o in forward.outputs}
    stats = [(saved[o.name], o) for o in forward.outputs if o.name in saved]
    shapes = {i.name: i.shape for i in adjoint.inputs}
    forms = {}  # forward output name → _Held
    for yname, y_in in value_of.items():
        y = own = outs[yname]
        if isinstance(_bare(y.body), D.Convert):
            # rounded to a narrower dtype: the value held differs, unless the forward saved
            # it before rounding (a statistic whose body is the cast's argument, over the
            # output's variables but those of extent 1)
            arg = _bare(_bare(y.body).arg)
            held = [o for o in forward.outputs if o.name in saved and _bare(o.body) is arg
                    and set(o.vars) <= set(y.vars)]
            if not held:
                continue
            y, y_in = held[0], saved[held[0].name]
        guards, body = _guards(read_statistics(y.body, [st for st in stats if st[1].name != y.name], shapes))
        form = _form(body)
        if form is not None:
            forms[yname] = _Held(y, y_in, form, own.vars, guards, own.dtype.itemsize)
    out_names = {v.name for o in adjoint.outputs for v in o.vars}
    applied: dict = {}

    def reuse(s, num, den, dtype, env0=None):
        """a · Σ_s G as a · Y[σ] ÷ c[σ] for the first output whose form matches (else None)."""
        a_n, a_d = [f for f in num if s not in f.free], [f for f in den if s not in f.free]
        g_n, g_d = [f for f in num if s in f.free], [f for f in den if s in f.free]
        for y, y_in, (sf, c_n, c_d, fg_n, fg_d), _, guards, _ in (usable.values() if env0 is None else [env0[0]]):
            if guards and env0 is None:  # (a · Σ_s G is a · Y ÷ c only where Y's guards hold)
                continue
            env = env0[1] if env0 is not None else {}
            env = _match_factors(fg_n, g_n, y.vars, env, {sf: Ix.of(s)})
            env = None if env is None else _match_factors(fg_d, g_d, y.vars, env, {sf: Ix.of(s)})
            if env is None or set(env) != set(y.vars):
                continue
            yread = _held_read(y_in, y, (env[v] for v in y.vars), shapes)
            at = lambda fs: [D.substitute(f, env) for f in fs]  # noqa: E731 - c at the element σ
            return D.quotient(*_cancel([yread] + a_n + at(c_d), a_d + at(c_n)), dtype)
        return None

    def rewrite(x: D.Expr):
        if not (isinstance(x, D.Red) and x.monoid == "add" and x.dtype.kind == "f"):
            return None
        s = x.var
        num, den = factors(x.body)
        out = reuse(s, num, den, x.dtype)
        if out is not None:
            pending.setdefault(x, Applied(OUTPUT_REUSE, D.show(x), D.show(out)))
            return out
        for i, c in enumerate(num):  # Δ-from-output: a contraction with a cotangent inside
            cu = _bare(c)
            if not (isinstance(cu, D.Red) and cu.monoid == "add"):
                continue
            e = cu.var
            cn, cd = factors(cu.body)
            reads = [(f, *_guarded_read(f)) for f in cn]
            dys = [(f, gs, r) for f, gs, r in reads if r is not None and r.array in of_cotangent]
            if cd or len(dys) != 1:
                continue
            (dy_f, dy_guards, dy), = dys
            rest = num[:i] + num[i + 1:]
            # (dY with its guards is what moves out of Σ_s: a guard reading s keeps it in)
            if s in dy_f.free or e not in dy.free or any(e in f.free for f in rest + den):
                continue
            y = of_cotangent[dy.array]
            w = [f for f in cn if f is not dy_f]
            # Σ_s F × W at the element of Y whose cotangent dY is (dY indexes Y's own variables)
            at_dy = {v: i for v, i in zip(y.vars, dy.index) if v in y.y.vars}
            if not _guards_hold(y.guards, dy_guards, y.y.vars, at_dy):
                continue
            inner = reuse(s, rest + w, den, x.dtype, (y, at_dy))
            if inner is None:
                continue
            n2, d2 = factors(inner)
            body = D.quotient([dy_f] + [f for f in n2 if e in f.free], [f for f in d2 if e in f.free], x.dtype)
            outer_n, outer_d = [f for f in n2 if e not in f.free], [f for f in d2 if e not in f.free]
            if e.name in out_names:  # the sum now stands on its own: named apart from the outputs' axes
                fresh = Var(D.fresh_name(f"{e.name}_", out_names | {v.name for v in D.bound_vars(body)}), e.extent)
                body, e = D.substitute(body, {e: Ix.of(fresh)}), fresh
            out = D.quotient([D.Red("add", e, body)] + outer_n, outer_d, x.dtype)
            pending.setdefault(x, Applied(DELTA_FROM_OUTPUT, D.show(x), D.show(out)))
            deltas.append(out)
            return out
        return None

    def rewritten(o: D.Output) -> D.Output:
        # where ``rounded``: a 16-bit output's value (held before rounding or not) carries its
        # kernel's 16-bit dots (a GPU rounds P to 16 bits for Σ_s P × V), so Δ = +/(dO × O) is
        # +/(P × dP) only to 2⁻⁹ of itself. A gradient in a finer dtype recomputes its sum
        # rather than inherit that (an ALiBi slopes' float32 gradient, whose rows' Σ_s dS should
        # cancel, was 5.1e-2 off float64 reading O, 1.1e-3 recomputing:
        # bench/results/table_grad_precision.md); so does one that sums Δ over rows and keys
        # alike, whatever its dtype (``_summed_over_rows_and_keys``)
        nonlocal usable, of_cotangent
        width = o.dtype.itemsize
        usable = {y: f for y, f in forms.items() if f.width >= width or not rounded}
        of_cotangent = {ct: usable[y] for ct, y in cotangent_of.items() if y in usable}
        if not usable:
            return o
        pending.clear()
        deltas.clear()
        body = D.transform(o.body, rewrite)
        if rounded and _summed_over_rows_and_keys(body, deltas):
            return o
        for x, a in pending.items():
            applied.setdefault(x, a)
        return dataclasses.replace(o, body=body)

    if not forms:
        return adjoint, []
    usable, of_cotangent = {}, {}
    pending: dict = {}  # this output's rewrites, kept only where the output keeps them
    deltas: list = []  # this output's Δs read from the output
    new = tuple(rewritten(o) for o in adjoint.outputs)
    if all(a.body is b.body for a, b in zip(new, adjoint.outputs)):
        return adjoint, []
    return D.DNF(adjoint.name, adjoint.inputs, new), list(applied.values())


GUARDED_STATISTIC = "guarded-statistic"


def _fold(e: D.Expr) -> D.Expr:
    """e with each reduction over a body that does not use its variable folded: ⌈_v k = k,
    ⌊_v k = k, Σ_v k = n · k (``rewrites.factor_out_invariants``; exact up to the sum's
    rounding); others kept."""
    from moajax.rewrites import factor_out_invariants

    def fn(x):
        if isinstance(x, D.Red) and x.var not in x.body.free:
            if x.monoid in ("max", "min"):
                return x.body
            out = factor_out_invariants(x)
            return None if out is x else out
        return None

    return D.transform(e, fn)


def _failing(e: D.Expr, cond) -> D.Expr:
    """e where the affine condition ``cond`` (``onf.Affine``) fails: each select whose
    condition has it as a conjunct takes its other branch, and a select whose branches are then
    one value is that value (a key length's (s < L) ? fill : fill is the fill, whatever s)."""
    from moajax.onf import comparison, conjuncts

    def fn(x):
        if isinstance(x, D.Call) and x.op == "where":
            if any(comparison(a) == cond for a in conjuncts(x.children[0])):
                return x.children[2]
            if x.children[1] is x.children[2]:
                return x.children[1]
        return None

    return D.transform(e, fn)


def statistic_guards(forward: D.DNF, saved) -> dict:
    """Per saved statistic z of ``forward`` (the outputs named in ``saved``): the row
    conditions c (affine conditions of the selects in z's body, over z's variables) where
    whose failure z folds to a closed form z̄ — every select on c takes its other branch and
    what is left reduces nothing but constants (``_fold``):

        z = c ? z : z̄

    Attention's row max past a query length is ⌈_s fill = fill and its sum Σ_s exp(fill −
    fill) = S, whatever the keys. As {name: ((c, z̄), …)}, c as a select holds it; only
    statistics with some, and not one already a select on c (a 16-bit Out before rounding)."""
    from moajax.onf import comparison, conjuncts

    found = {}
    for z in forward.outputs:
        if z.name not in saved:
            continue
        rows = set(z.vars)
        top = _bare(z.body)
        held = ({comparison(a) for a in conjuncts(top.children[0])}
                if isinstance(top, D.Call) and top.op == "where" else set())
        atoms: dict = {}
        for x in D.walk(z.body):
            if isinstance(x, D.Call) and x.op == "where":
                for a in conjuncts(x.children[0]):
                    c = comparison(a)
                    if c is not None and c not in held and c.vars() <= rows:
                        atoms.setdefault(c, a)
        guards = []
        for c in sorted(atoms, key=lambda c: c.text()):
            closed = _fold(_failing(z.body, c))
            if not D.reductions(closed):
                guards.append((atoms[c], closed))
        if guards:
            found[z.name] = tuple(guards)
    return found


def guard_statistics(forward: D.DNF, guards: Mapping[str, tuple]) -> tuple[D.DNF, list]:
    """The saving forward with each statistic z named in ``guards`` (``statistic_guards``)
    written c ? z : z̄: the same value (z̄ is z where c fails, folded), which reads the pass
    computing z only where c holds. What it buys: where every other read of that pass lies
    under c too (the output's rows past a query length are 0), nothing reads it where c fails,
    and the forward leaves those rows out (``onf.dead_rows``; a query length's padding walks
    no key tile), as the forward without statistics does. Returns the DNF and what was
    applied."""
    if not guards:
        return forward, []
    outs, applied = [], []
    for o in forward.outputs:
        for cond, closed in guards.get(o.name, ()):
            body = D.Call("where", (cond, o.body, closed))
            applied.append(Applied(GUARDED_STATISTIC, D.show(o.body), D.show(body)))
            o = dataclasses.replace(o, body=body)
        outs.append(o)
    return D.DNF(forward.name, forward.inputs, tuple(outs)), applied


def _summed_over_rows_and_keys(body: D.Expr, deltas: list) -> bool:
    """Does one of ``deltas`` (each a row's Δ, read from the output: its free variables are
    the row's) stand in ``body`` under a sum over one of its row's variables and under a sum
    over another variable (a key)?

    Σ_s dS = Σ_s P × (dP − Δ) is 0 in every row, so a gradient that sums dS × w over rows and
    keys (a score_mod table's: w = |i − j| for ALiBi's slopes) is the small difference of the
    rows' Σ_s P × w, and a Δ off by δ in a row adds δ × Σ_s P × w, which no cancellation takes
    away. A 16-bit forward's Δ = +/(dO × O) is off by 2⁻⁹ of itself (a GPU rounds P for
    Σ_s P × V): bfloat16 ALiBi slopes' gradient, summed in float32 and rounded once, was 1.6e-1
    off float64 reading it (an ad hoc run on the H200's schedule in interpret mode) and 2.7e-3
    recomputing, its floor 1.9e-3 (bench/results/table_grad_precision.md). dQ (a sum over keys only) and dK (over rows only)
    read it, as FlashAttention-2's backward does. A Δ not found again (a later rewrite took it
    apart): its sums unknown, so True."""
    sites = {id(x): x for x in deltas}
    seen, found = set(), set()
    stack = [(body, frozenset())]
    while stack:
        e, around = stack.pop()
        if (id(e), around) in seen:
            continue
        seen.add((id(e), around))
        x = sites.get(id(e))
        if x is not None:
            found.add(id(e))
            if any(v in x.free for v in around) and any(v not in x.free for v in around):
                return True
            continue
        inner = around | {e.var} if isinstance(e, D.Red) else around
        stack.extend((c, inner) for c in e.children)
    return len(found) < len(sites)


# ----------------------------------------------------------------------------- saved statistics


@dataclasses.dataclass(frozen=True)
class Layout:
    """A saved statistic held in the layout of the output rows that compute it: ``vars`` (the
    output's variables it ranges over, in the output's order), ``dims`` and ``shape``; ``body``
    the very subterm of the output (so that a program computes it once, for both); ``inverse``
    maps each of ``vars`` to an index over the statistic's own variables ``own``."""

    name: str
    own: tuple
    vars: tuple
    dims: tuple
    shape: tuple
    body: D.Expr
    inverse: tuple  # ((var, Ix over own), ...)


def _invert(env: dict, own: tuple, rows: list) -> dict | None:
    """Each row variable w as an index over ``own``, from σ: own → Ix(rows): w where some σ(u)
    is w, or G·u₁ + u₂ where σ(u₁) = ⌊w/G⌋ and σ(u₂) = w − G·⌊w/G⌋ (a GQA head split in kv head
    and group). None unless σ(inverse(u)) = u for every own u (or u of extent 1 at 0)."""
    inv: dict = {}
    for w in rows:
        direct = [u for u in own if env[u] == Ix.of(w)]
        if direct:
            inv[w] = Ix.of(direct[0])
            continue
        for u1 in own:
            a = env[u1]
            if not (a.const == 0 and len(a.terms) == 1 and a.terms[0][1] == 1):
                continue
            atom = a.terms[0][0]
            if type(atom).__name__ != "FloorDiv" or atom.arg != Ix.of(w):
                continue
            rem = Ix.of(w) - a * atom.d
            u2 = next((u for u in own if env[u] in (rem, Ix.of(w).mod(atom.d))), None)
            if u2 is not None:
                inv[w] = Ix.of(u1) * atom.d + Ix.of(u2)
                break
        if w not in inv:
            return None
    for u in own:
        back = env[u].substitute(inv)
        if back != Ix.of(u) and not (u.extent == 1 and back == Ix.of(0)):
            return None
    return inv


def statistic_layouts(forward: D.DNF, statistics) -> list:
    """For each statistic output of ``forward`` (names in ``statistics``), its ``Layout`` in
    the rows of the output that computes it — where that output's body holds the statistic
    at σ (``D.match``) and σ can be inverted — else None (it stays in its own layout)."""
    outs = [o for o in forward.outputs if o.name not in statistics]
    found = []
    for stat in (o for o in forward.outputs if o.name in statistics):
        layout = None
        for o in outs:
            for x in D.walk(o.body):
                if not isinstance(_bare(x), type(_bare(stat.body))) or x.dtype != stat.dtype:
                    continue
                env = D.match(stat.body, x, stat.vars)
                if env is None or set(env) != set(stat.vars):
                    continue
                rows = [v for v in o.vars if any(v in env[u].free_vars() for u in stat.vars)]
                inv = _invert(env, stat.vars, rows) if x.free <= set(rows) else None
                if inv is not None:
                    pos = [o.vars.index(v) for v in rows]
                    layout = Layout(stat.name, stat.vars, tuple(rows), tuple(o.dims[i] for i in pos),
                                    tuple(o.shape[i] for i in pos), x, tuple(inv.items()))
                    break
            if layout is not None:
                break
        found.append(layout)
    return found


def relayout_forward(forward: D.DNF, layouts) -> D.DNF:
    """The forward with each statistic output in its rows' layout (its body the output's own
    subterm: one program computes both, e.g. one online-softmax pass)."""
    by_name = {l.name: l for l in layouts if l is not None}
    outs = tuple(D.Output(o.name, by_name[o.name].shape, by_name[o.name].dims, by_name[o.name].vars,
                          by_name[o.name].body) if o.name in by_name else o for o in forward.outputs)
    return D.DNF(forward.name, forward.inputs, outs)


__all__ = ["Layout", "statistic_layouts", "relayout_forward", "Applied", "DELTA_FROM_OUTPUT", "OUTPUT_REUSE",
           "GUARDED_STATISTIC", "delta_from_output", "read_statistics", "factors", "statistic_guards",
           "guard_statistics"]
