"""ONF rewrites: each a function ONF → ONF that keeps the DNF's meaning.

    hoist          loop-invariant reductions leave the loops that do not use them:
                   Σ_s (… ⌈_{s′} f(t,s′) …) → M[t] = ⌈_{s′} f(t,s′) once per row; invariant
                   factors leave a sum: Σ_s a·(b ÷ c) → (Σ_s a·b) ÷ c  when c does not use s;
                   every remaining top-level reduction becomes a stage (one pass each).
    fuse_online    M[v] = ⌈_r f  and  Xᵢ = Σ_r exp(f − M)·gᵢ  → one OnlineStage (running max,
                   rescaled sums) — any reduction of that form, not only attention's.
    fuse_sums      Σ_a (Σ_r f + Σ_r g) → Σ_a Σ_r (f + g): sibling sums inside a sum walk r once
                   (a table's gradient: the two terms of dS share their scores), also under one
                   guard: (p ? Σ_r f : 0) + (p ? Σ_r g : 0) → p ? Σ_r (f + g) : 0.
    long_sums_out  Σ_a Σ_r f → Σ_r Σ_a f, r long and a short: the sum a CPU walks in tiles is
                   the outer one (GQA's dK: the queries around the query heads of a kv head).
    row_walks_out  Σ_a Σ_b f → Σ_b Σ_a f, f reading a long statistic of b's rows and none of
                   a's: evaluated once per tile of b, not in every tile of a (a table's
                   gradient without saved statistics: the rows' max, ℓ and Δ).
    split_k        op_r e → op_{r₀} (op_{r₁} e[r ↦ r₀·c + r₁]): partials over r₀ in parallel,
                   then the monoid combine (for online stages: max, and Σ aₚ·e^{mₚ − m});
                   below op_{r₁}, Σ_v (p ? x : 0) → p ? Σ_v x : 0 (``conditions_out``).
    materialize    a labelled subexpression becomes a stage (kept on chip, or in memory):
                   the store-vs-recompute choice.
    place          a stage moves between chip and memory (its values unchanged): a row a walk
                   reads tile by tile, which a GPU program cannot index on chip, in memory.
    accumulate     an output X[v] = c · Σ_r g (c not using r) → X[v] = Σ_r c·g, added into
                   memory by every program that owns a tile of r ("atomic": scatter-add).
    skip_masked    op_w B → op_{w : c(w)} B  where B is the identity wherever the affine mask
                   condition c fails: a program walks only the tiles of w its rows keep
                   (causal, local windows, lengths; ``moajax.masked``).
    unmask_interior  op_{w : c(w)} B → op_{w ∈ boundary} B ⊕ op_{w ∈ interior} B[c ↦ true]: the
                   tiles where c holds at every point are walked without the mask (a causal
                   walk evaluates it on its diagonal tiles only).
    factor_out_of_dots  Σ_h (a·c)·b → (Σ_h a·b)·c: a 16-bit dot's operands stay as read.
    tile / lift / with_gamma / with_knobs   schedule-only changes (the program is untouched).

Every rewrite is checked in the tests by running the ONF against the DNF reference.
"""

from __future__ import annotations

import dataclasses

from moajax import dnf as D
from moajax.ix import Ix, Var
from moajax.onf import ONF, Axis, Knobs, OnlineStage, ONFError, Program, Stage, stage_vars

_MONOID_NAMES = {"add": "sum", "max": "max", "min": "min", "mul": "prod", "and": "all", "or": "any"}





def _taken(onf: ONF) -> set:
    out = set(onf.program.names()) | {o.name for o in onf.dnf.outputs} | {i.name for i in onf.dnf.inputs}
    return out


# ----------------------------------------------------------------------------- factoring


def factor_out_invariants(red: D.Red) -> D.Expr:
    """Σ_v (a·c ÷ d) = (Σ_v a)·c ÷ d  for factors c, d that do not use v (distributivity)."""
    if red.monoid != "add" or red.dtype.kind != "f":
        return red
    num, den = D.mul_div_factors(red.body)
    inv_n = [f for f in num if red.var not in f.free]
    inv_d = [f for f in den if red.var not in f.free]
    if not inv_n and not inv_d:
        return red
    var_n = [f for f in num if red.var in f.free]
    var_d = [f for f in den if red.var in f.free]
    if not var_n and not var_d:  # Σ_{v<n} c = n·c
        return D.quotient([D.Lit(red.var.extent, red.dtype)] + inv_n, inv_d, red.dtype)
    inner = D.Red("add", red.var, D.quotient(var_n, var_d, red.dtype))
    return D.quotient([inner] + inv_n, inv_d, red.dtype)


# ----------------------------------------------------------------------------- scalar sinking


def sink_invariant_factors(e: D.Expr, loop: Var) -> D.Expr:
    """(Σ_h a·b)·c → Σ_h (a·c)·b  when c and a do not use the loop variable: the product
    with c is then computed once per tile of a, outside the loop over ``loop``, instead of
    once per element of the (much larger) contraction result."""

    def fn(x):
        if not (isinstance(x, D.Call) and x.op == "mul"):
            return None
        for red, c in ((x.children[0], x.children[1]), (x.children[1], x.children[0])):
            inner = red.body if isinstance(red, D.Tag) else red
            if not isinstance(inner, D.Red) or inner.monoid != "add" or loop in c.free or inner.var in c.free:
                continue
            num, den = D.mul_div_factors(inner.body)
            if den or len(num) < 2:
                continue
            for i, f in enumerate(num):
                if loop not in f.free and c.free <= f.free | set():
                    num2 = num[:i] + [D.Call("mul", (f, c))] + num[i + 1:]
                    out = D.Red("add", inner.var, D.product(num2, inner.dtype))
                    return D.Tag(red.label, out) if isinstance(red, D.Tag) else out
        return None

    return D.transform(e, fn)


def factored(e: D.Expr) -> D.Expr:
    """Every +-reduction of e with its invariant factors out: Σ_h (a·c)·b = (Σ_h a·b)·c for c
    free of h (``factor_out_invariants``; a factor 1 dropped: a·1 = a exactly).

    ``hoist`` sinks each stage's invariant factors into its contractions for the stage's own
    walk (the scale onto q for dQ's Σ_s, onto k for dK's Σ_t; 1/ℓ into dO for dQ's dP only):
    once stages of different walks share one pass (a scatter-added output: the fused
    backward's dK = Σ_t … inside the programs' walk over s), their shared contractions —
    attention's score and dP — are then different nodes. Factored, they are one node
    (hash-consed), which a tile computes once (the tile memo is by node)."""

    def out(x):
        if not (isinstance(x, D.Red) and x.monoid == "add" and x.dtype.kind == "f"):
            return None
        y = factor_out_invariants(x)
        if y is x:
            return None
        num, den = D.mul_div_factors(y)
        ones = [f for f in num if isinstance(f, D.Lit) and f.value == 1]
        y = D.quotient([f for f in num if f not in ones] or ones[:1], den, y.dtype) if ones else y
        return y if y.dtype == x.dtype else None  # (factors reordered: a mixed-dtype body stays as it was)

    return D.transform(e, out)


def _below_top(e: D.Expr, fn) -> D.Expr:
    """fn applied below a stage body's top reduction (its walk, or the grid it scatter-adds
    over), looking through a final dtype conversion."""
    if isinstance(e, D.Convert):
        return D.Convert(_below_top(e.arg, fn), e.dtype)
    return D.Red(e.monoid, e.var, fn(e.body)) if isinstance(e, D.Red) else fn(e)


def _kernel_walk(prog: Program, st: Stage) -> Var | None:
    """The pass a kernel runs ``st`` inside once its programs own tiles of its top reduction:
    the one variable of ``st`` that the program's other stages walk (None: none, or several)."""
    walks = {o.walks for o in prog.stages if o is not st and o.walks is not None and o.walks in st.vars}
    return walks.pop() if len(walks) == 1 else None


def _sink_stage(st):
    """Sink invariant factors into the contractions of a stage's pass (over ``st.walks``):
    the top reduction's body, or every expression of an online pass."""
    if st.walks is None:
        return st
    if st.reduction is not None:
        r = st.reduction
        return st.map_exprs(lambda b: D.Red(r.monoid, r.var, sink_invariant_factors(r.body, r.var)))
    return st.map_exprs(lambda e: sink_invariant_factors(e, st.walks))


# ----------------------------------------------------------------------------- hoist


# A reduction over at most this many elements with nothing reduced inside (Δ = +/(dO × O)
# over the head dim) is recomputed where it is read: a memory stage would cost a kernel and
# a round trip through memory, and fix an axis its kernel owns (see schedule._around_walks).
SHORT_REDUCTION = 128


def _short(e: D.Red) -> bool:
    # (a table read at a computed index is a gather, one load whatever its extent: ``dnf.selection``)
    return (e.var.extent <= SHORT_REDUCTION and not any(isinstance(x, D.Red) for x in D.walk(e.body))
            or D.selection(e) is not None)


def hoist(onf: ONF) -> ONF:
    """Hoist loop-invariant reductions into stages; factor invariants out of sums; make every
    top-level reduction its own stage (one pass over its variable each)."""
    taken = _taken(onf)
    order = onf.dnf.output_vars
    memo: dict = {}  # canonical reduction → stage name
    new_stages: list = []

    def stage_for(red: D.Red, place: str = "local") -> D.Expr:
        key = D.canonical(red)
        hit = memo.get(key)
        if hit is not None:
            return hit
        vs = stage_vars(red, order)
        name = D.fresh_name(f"{_MONOID_NAMES[red.monoid]}_{red.var.name}", taken)
        body = factor_out_invariants(red)
        if not isinstance(body, D.Red):
            body = top_level(body)  # Σ_v(a)·c: the inner sum gets its own stage first
        new_stages.append(Stage(name, vs, body, place))
        ref = D.Ref(name, vs, red.dtype)
        memo[key] = ref
        return ref

    seen: dict = {}  # (node, context, len(memo)) → result: bodies are DAGs, shared subterms recur

    def go(e: D.Expr, loops: tuple, own: frozenset, last) -> D.Expr:
        # own: the variables of the stage being built (``last``: the one a program holds whole)
        if not e.children:
            return e
        # the result depends on the node, its context and which reductions have stages: memo
        # only grows (a key is never rebound), so its size names its state
        key = (id(e), loops, own, last, len(memo))
        hit = seen.get(key)
        if hit is not None and hit[0] is e:
            return hit[1]
        out = _go(e, loops, own, last)
        seen[key] = (e, out)
        return out

    def _go(e: D.Expr, loops: tuple, own: frozenset, last) -> D.Expr:
        if isinstance(e, D.Red):
            # a statistic of the loop's rows that an output variable a program owns does not
            # index (the softmax backward's Δ[t] inside dK[s] = Σ_t …): once per row, in memory,
            # read by every program — not a pass over its variable per program. (Not over a
            # loop variable that shadows an output's: separate_walks renames that one.)
            if (loops and e.free & set(loops) and not e.free & set(loops) & set(order)
                    and any(v.extent > 1 for v in own - e.free - {last}) and not _short(e)):
                vs = stage_vars(e, order)
                first = len(new_stages)
                ref = stage_for(D.Red(e.monoid, e.var, go(e.body, (e.var,), frozenset(vs), vs[-1])), "memory")
                # the stages it reads (its row max) are read by the loop too: in memory as well
                new_stages[first:] = [dataclasses.replace(st, place="memory") for st in new_stages[first:]]
                return ref
            out = D.Red(e.monoid, e.var, go(e.body, loops + (e.var,), own, last))
            if loops and not (out.free & set(loops)):
                return stage_for(out)  # invariant in every enclosing loop: once per row
            if loops and D.canonical(out) in memo:
                # a row statistic an earlier stage already computes (the softmax max and
                # denominator inside dK = Σ_t …, hoisted for dQ): read it, never recompute it
                # per element. (A new stage over loop variables would be a stored row.)
                return memo[D.canonical(out)]
            return out
        return D.rebuild(e, [go(c, loops, own, last) for c in e.children])

    def top_level(e: D.Expr) -> D.Expr:
        # reductions not nested in another reduction become stages of their own
        if isinstance(e, D.Red):
            return stage_for(e)
        if not e.children:
            return e
        return D.rebuild(e, [top_level(c) for c in e.children])

    out_stages = []
    for s in onf.program.stages:
        if not isinstance(s, Stage):
            out_stages.append(s)
            continue
        body = go(s.body, (), frozenset(s.vars), s.vars[-1] if s.vars else None)
        body = D.unlabelled(body)  # a label is transparent: a labelled value saved as an output
        pre = body
        if isinstance(body, D.Red):
            body = factor_out_invariants(body)
        if isinstance(body, D.Red):
            # the stage itself is one reduction: keep it (its loop is the stage's pass); a later
            # stage that needs the same reduction (a row statistic a kernel also outputs, e.g. a
            # saved softmax max) reads this one
            out_stages.extend(new_stages)
            new_stages.clear()
            out_stages.append(Stage(s.name, s.vars, body, s.place))
            if tuple(s.vars) == stage_vars(pre, order):
                memo.setdefault(D.canonical(pre), D.Ref(s.name, s.vars, pre.dtype))
            continue
        body = top_level(body)
        out_stages.extend(new_stages)
        new_stages.clear()
        out_stages.append(Stage(s.name, s.vars, body, s.place))
    out_stages = _outputs_read_across(out_stages, {n for _, n in onf.program.outputs})
    prog = Program(tuple(_sink_stage(s) for s in out_stages), onf.program.outputs)
    return onf.replace(program=prog, note="hoist")


def _outputs_read_across(stages, outputs) -> list:
    """An output's stage that another stage reads across a variable it walks (U[n f], saved by
    the MLP's forward, inside F = Σ_f H × W_d) is placed in memory: written whole, as an
    output is, before the reader runs, which reads it back instead of recomputing it per tile."""
    out = []
    for st in stages:
        if isinstance(st, Stage) and st.name in outputs and st.place == "local":
            for reader in stages:
                if reader is st:
                    continue
                walked = {x.var for e in reader.exprs() if e is not None for x in D.walk(e) if isinstance(x, D.Red)}
                walked |= {reader.walks} - {None}
                refs = [x for e in reader.exprs() if e is not None for x in D.walk(e)
                        if isinstance(x, D.Ref) and x.stage == st.name]
                if any(walked & x.free for x in refs):
                    st = dataclasses.replace(st, place="memory")
                    break
        out.append(st)
    return out


# ----------------------------------------------------------------------------- online fusion


def _exp_minus(f: D.Expr, name: str):
    """If f is exp(g − M[…]) with M the stage ``name``, return g."""
    if isinstance(f, D.Call) and f.op == "exp":
        a = f.children[0]
        if isinstance(a, D.Call) and a.op == "sub" and isinstance(a.children[1], D.Ref) and a.children[1].stage == name:
            return a.children[0]
    return None


def fuse_online(onf: ONF) -> ONF:
    """M = ⌈_r f  with  Xᵢ = Σ_r exp(f − M)·gᵢ  → one pass carrying (running max, rescaled sums)."""
    stages = list(onf.program.stages)
    changed = False
    i = 0
    while i < len(stages):
        m = stages[i]
        red = m.reduction
        if red is None or red.monoid != "max" or m.place != "local":
            i += 1
            continue
        before = {n for s in stages[: i + 1] for n in s.defines}
        sums, drop = [], []
        for j in range(i + 1, len(stages)):
            x = stages[j]
            xr = x.reduction
            if xr is None or xr.monoid != "add" or x.place != "local" or not set(m.vars) <= set(x.vars):
                continue
            num, den = D.mul_div_factors(xr.body)
            hits = [k for k, f in enumerate(num) if _exp_minus(f, m.name) is not None]
            if len(hits) != 1:
                continue
            k = hits[0]
            g = _exp_minus(num[k], m.name)
            ren = {xr.var: Ix.of(red.var)} if xr.var != red.var else {}
            if (D.substitute(g, ren) if ren else g) is not red.body:
                continue
            rest_n = [D.substitute(f, ren) if ren else f for f in num[:k] + num[k + 1:]]
            rest_d = [D.substitute(f, ren) if ren else f for f in den]
            weight = None if not rest_n and not rest_d else D.quotient(rest_n, rest_d, xr.dtype)
            refs = {r.stage for r in D.walk(weight) if isinstance(r, D.Ref)} if weight is not None else set()
            if not refs <= before:
                continue  # the weight needs a stage computed later: cannot move it up
            sums.append((x.name, x.vars, weight))
            drop.append(j)
        if sums:
            fused = _sink_stage(OnlineStage(m.name, m.vars, red.var, red.body, tuple(sums)))
            stages[i] = fused
            for j in reversed(drop):
                del stages[j]
            changed = True
        i += 1
    if not changed:
        raise ONFError(f"{onf.dnf.name}: fuse_online found no ⌈_r f with Σ_r exp(f − ⌈f)·g to fuse")
    return onf.replace(program=Program(tuple(stages), onf.program.outputs), note="fuse_online")


# ----------------------------------------------------------------------------- split-K


def sum_to_top(e: D.Expr, var: str) -> D.Red | None:
    """Σ_a (Σ_r f + Σ_r g) → Σ_r Σ_a (f + g),  c · Σ_r f → Σ_r c · f,  (p ? Σ_r f : 0) →
    Σ_r (p ? f : 0)  (c, p not using r): sums over constant extents commute (Fubini) and
    distribute over +, − and the factors and conditions that do not use r, so e's sums
    over the variable named ``var`` become one Σ_r at its top. None where that is not e's
    meaning: a term without Σ_r (it would be counted |r| times), another monoid, a label or
    a conversion in the way (the label names, and the dtype sums, what lies under it)."""
    if isinstance(e, D.Red):
        if e.monoid != "add":
            return None
        if e.var.name == var:
            return e
        inner = sum_to_top(e.body, var)
        if inner is None:
            return None
        return D.Red("add", inner.var, D.Red("add", e.var, inner.body))
    if not isinstance(e, D.Call):
        return None
    if e.op in ("add", "sub"):
        x, y = (sum_to_top(a, var) for a in e.children)
        one = D.common_binder(x, y) if x is not None and y is not None else None
        if one is None or one[0].name != var:  # (renamed: r would have been captured)
            return None
        r, fx, fy = one
        return D.Red("add", r, D.Call(e.op, (fx, fy)))
    if e.op == "where":  # (p ? Σ_r f : 0) = Σ_r (p ? f : 0) where p does not use r
        p, x, zero = e.children
        inner = sum_to_top(x, var)
        if (inner is None or not (isinstance(zero, D.Lit) and zero.value == 0) or inner.var in p.free
                or any(v.var.name == var for v in D.reductions(p))):
            return None
        return D.Red("add", inner.var, D.Call("where", (p, inner.body, zero)))
    if e.op in ("mul", "div", "neg"):
        summed = [i for i, a in enumerate(e.children) if any(x.var.name == var for x in D.reductions(a))]
        if summed != [0] and not (e.op == "mul" and summed == [1]):
            return None  # (a sum in a divisor does not distribute)
        (i,) = summed
        inner = sum_to_top(e.children[i], var)
        if inner is None or any(inner.var in a.free for a in e.children if a is not e.children[i]):
            return None
        kids = list(e.children)
        kids[i] = inner.body
        return D.Red("add", inner.var, D.Call(e.op, tuple(kids)))
    return None


def conditions_out(e: D.Expr) -> D.Expr:
    """Σ_v (p ? x : 0) → p ? Σ_v x : 0  and  (p ? x : 0) ± (p ? y : 0) → p ? x ± y : 0, for p
    not using v: a condition leaves the sums that do not move it (``sum_to_top`` in reverse),
    so the sums' accumulators do not carry p's axes.

    Why: a split table gradient's partial, Σ_{s_i} Σ_b ((c = n) ? Σ_t … : 0 + …), carried a
    [s_i, c] accumulator through its walk over b, and Triton laid the walk's [t s] tiles out
    as that accumulator's broadcast: ptxas spilled 1,028–8,476 B a thread for ALiBi's slopes
    inside a −∞ document mask at B = 2 on every GPU profile, where this form has none
    (bench/results/table_grad_spills_ptx.md, before and after)."""
    def zero_select(x):
        return (isinstance(x, D.Call) and x.op == "where" and isinstance(x.children[2], D.Lit)
                and x.children[2].value == 0)

    def fn(x):
        if isinstance(x, D.Red) and x.monoid == "add" and zero_select(x.body) and x.var not in x.body.children[0].free:
            p, y, zero = x.body.children
            # the new Σ_v y is built after the walk passed it: it may hold a condition to give
            # up too (Σ_b (p ? (p ? x : 0) : 0), hypothesis found), so the rule runs on it again
            inner = D.Red("add", x.var, y)
            return D.Call("where", (p, fn(inner) or inner, zero))
        if isinstance(x, D.Call) and x.op in ("add", "sub") and all(zero_select(c) for c in x.children):
            (p, a, zero), (q, b, _) = (c.children for c in x.children)
            if p is q and a.dtype == b.dtype == x.dtype:
                return D.Call("where", (p, D.Call(x.op, (a, b)), zero))
        return None

    return D.transform(e, fn)


def fused_sums(e: D.Expr) -> D.Expr:
    """Σ_a (… Σ_r f ± Σ_r g …) → Σ_a (… Σ_r (f ± g) …): inside a reduction of e, two sibling
    sums over one axis become one (``sum_to_top`` of their sum), so what they share is
    computed once per walk — the two terms of a table's gradient, dS = P·dP/ℓ − P·Δ/ℓ — and
    terms the merge puts under one guard share it, (p ? f : 0) ± (p ? g : 0) = p ? (f ± g) : 0,
    so a one-hot write (``dnf.one_hot_write``) stays one. e's own top-level terms stay apart
    (``fuse_sums``: hoist made each its own pass on purpose). Two sums under one guard merge
    too, (p ? Σ_r f : 0) ± (p ? Σ_r g : 0) = p ? Σ_r (f ± g) : 0: a per-head table's two terms,
    each under the head's one-hot write (ALiBi's slopes, sl[h])."""
    def merge(x):
        if isinstance(x, D.Call) and x.op in ("add", "sub") and all(
                isinstance(c, D.Red) and c.monoid == "add" for c in x.children):
            a, b = x.children
            top = sum_to_top(x, a.var.name) if a.var.extent == b.var.extent else None
            if top is not None:  # their bodies' own sibling sums, now side by side, too
                return D.Red("add", top.var, D.transform(D.transform(top.body, merge), _one_guard))
        guarded = _one_guard_over_sums(x)
        if guarded is not None:  # only where the sums under the guard merge: else as it was
            p, body, zero = guarded.children
            inner = merge(body)
            if inner is not None:
                return D.Call("where", (p, inner, zero))
        return None

    def inside(x):  # (the hash-consed DNF gives x itself back where nothing merged)
        return D.Red(x.monoid, x.var, D.transform(x.body, merge)) if isinstance(x, D.Red) else None

    return D.transform(e, inside)


def _one_guard(x: D.Expr) -> D.Expr | None:
    """(p ? f : 0) ± (p ? g : 0) → p ? (f ± g) : 0, else None."""
    if isinstance(x, D.Call) and x.op in ("add", "sub"):
        a, b = x.children
        if all(isinstance(c, D.Call) and c.op == "where" and isinstance(c.children[2], D.Lit)
               and c.children[2].value == 0 for c in (a, b)) and a.children[0] is b.children[0]:
            return D.Call("where", (a.children[0], D.Call(x.op, (a.children[1], b.children[1])), a.children[2]))
    return None


def _one_guard_over_sums(x: D.Expr) -> D.Expr | None:
    """``_one_guard`` where ``fused_sums`` looks for sums to merge under it (since 2026-12-07:
    before, two sums each under the guard stayed two walks; ``scripts/rules_patched.py``)."""
    return _one_guard(x)


def _every_expression(onf: ONF, fn, note: str) -> ONF:
    """Every stage's expressions rewritten by ``fn`` (expression → expression), the rewrite
    noted where one changed; ``onf`` itself where none did."""
    changed = False

    def each(e):
        nonlocal changed
        out = None if e is None else fn(e)
        changed |= out is not e
        return out

    stages = tuple(st.map_exprs(each) for st in onf.program.stages)
    if not changed:
        return onf
    return onf.replace(program=Program(stages, onf.program.outputs), note=note)


def fuse_sums(onf: ONF) -> ONF:
    """Every stage's expressions with their sibling sums inside a sum fused (``fused_sums``)."""
    return _every_expression(onf, fused_sums, "fuse_sums")


def long_sums_outside(e: D.Expr, longer_than: int) -> D.Expr:
    """Σ_a Σ_r f → Σ_r Σ_a f  where r is longer than ``longer_than`` and a is not, and f holds
    no sum as long: sums over constant extents commute (Fubini), so the long sum is the outer
    one (bottom-up: Σ_a Σ_b Σ_r f → Σ_r Σ_a Σ_b f)."""
    def fn(x):
        if not (isinstance(x, D.Red) and x.monoid == "add" and x.var.extent <= longer_than):
            return None
        r = x.body
        if not (isinstance(r, D.Red) and r.monoid == "add" and r.var.extent > longer_than):
            return None
        if any(y.var.extent > longer_than for y in D.reductions(r.body)):
            return None
        return D.Red("add", r.var, D.Red("add", x.var, r.body))

    return D.transform(e, fn)


def long_sums_out(onf: ONF, longer_than: int) -> ONF:
    """Every stage's expressions with their long sums outside the short ones around them
    (``long_sums_outside``), so the one a CPU walks in tiles is the outer one. Why: GQA's
    dK = Σ_g Σ_t … (the query heads of a kv head around the queries) held Σ_t whole under
    the short Σ_g, its [s, t, g] scores in memory at once (1084 MiB of temp at S = 4096:
    bench/results/attention_grad_gqa_cpu.md); as Σ_t Σ_g the queries are walked, the group summed in each
    tile's contraction (``Backend.joint_sums``)."""
    return _every_expression(onf, lambda e: long_sums_outside(e, longer_than), "long_sums_out")


def row_walks_outside(e: D.Expr, statistics) -> D.Expr:
    """Σ_a Σ_b f → Σ_b Σ_a f  where f reads a statistic of b's rows and none of a's:
    ``statistics(f)`` gives the free variables of each long reduction f evaluates (inline, and
    in the stages it reads where they are recomputed), and one holds b and not a — a row max,
    ℓ or Δ of the queries t, each a walk of the keys, under Σ_s Σ_t — while none holds a and
    not b. Sums over constant extents commute (Fubini); walked inside Σ_a, such a statistic is
    recomputed for every tile of a, outside it once for each tile of b (``TileEval`` evaluates
    what a walk does not vary over before it)."""
    def fn(x):
        if not (isinstance(x, D.Red) and x.monoid == "add" and isinstance(x.body, D.Red) and x.body.monoid == "add"):
            return None
        a, b, f = x.var, x.body.var, x.body.body
        stats = statistics(f)
        if any(b in vs and a not in vs for vs in stats) and not any(a in vs and b not in vs for vs in stats):
            return D.Red("add", b, D.Red("add", a, f))
        return None

    return D.transform(e, fn)


def row_walks_out(onf: ONF, longer_than: int) -> ONF:
    """Every stage's expressions with their row statistics' walks outside (``row_walks_outside``):
    a statistic is a reduction over more than ``longer_than`` items, not a table read at a
    computed index (``dnf.selection``: a gather), or an online pass. Why: ALiBi's slopes'
    gradient without saved statistics (residuals "none") is Σ_s Σ_t over every score with the
    rows' max, ℓ and Δ read inside, each a walk of all the keys; under Σ_s they were
    recomputed in every key tile (that kernel alone took 395 ms where the cost model counts
    25: ad hoc, T = S = 1024, 8 heads), and jit(grad) runs 1.13–2.02× faster with the rule
    (bench/results/alibi_grad_cpu.md)."""
    stages = {n: st for st in onf.program.stages for n in st.defines}

    def statistics(f, seen=frozenset()) -> list:
        out = []
        for y in D.walk(f):
            if isinstance(y, D.Red):
                if y.var.extent > longer_than and D.selection(y) is None:
                    out.append(y.free)
            elif isinstance(y, D.Ref) and y.stage in stages and y.stage not in seen:
                st = stages[y.stage]
                if not isinstance(st, Stage):  # an online pass: a statistic over its walk
                    out.append(y.free)
                elif st.place != "memory":  # recomputed where it is read
                    out += statistics(_at(st, y), seen | {y.stage})
        return out

    return _every_expression(onf, lambda e: row_walks_outside(e, statistics), "row_walks_out")


def split_k(onf: ONF, var: str, parts: int) -> ONF:
    """Split every top-level reduction over ``var`` into ``parts`` partials reduced in parallel
    (a grid axis, partials in memory) followed by the monoid combine. A stage whose Σ over
    ``var`` lies inside other sums (a table's gradient: Σ_n (Σ_s Σ_t … + Σ_s Σ_t …)) has it
    brought to the top first (``sum_to_top``)."""
    stages = []
    for st in onf.program.stages:
        if isinstance(st, Stage) and st.walks is not None and st.walks.name != var:
            top = sum_to_top(st.body, var)
            if top is not None:
                st = Stage(st.name, st.vars, top, st.place)
        stages.append(st)
    onf = onf.replace(program=Program(tuple(stages), onf.program.outputs))
    if not isinstance(parts, int) or parts < 2:
        raise ONFError(f"{onf.dnf.name}: split_k needs parts ≥ 2, got {parts!r}")
    taken = _taken(onf)
    stages: list = []
    found = None
    outer = inner = None
    for s in onf.program.stages:
        r = s.walks
        if r is None or r.name != var:
            stages.append(s)
            continue
        if parts > r.extent:
            raise ONFError(f"{onf.dnf.name}: split_k of {var!r} into {parts} parts exceeds its extent {r.extent}")
        for e in s.exprs():
            for x in D.walk(e) if e is not None else ():
                if isinstance(x, D.Ref) and r in x.free:
                    raise ONFError(
                        f"{onf.dnf.name}: split_k of {var!r}: stage {s.name!r} reads the stored stage {x.stage!r} "
                        f"along {var!r}; split before materializing it, or recompute it"
                    )
        found = r
        chunk = -(-r.extent // parts)
        outer = Var(f"{var}_o", parts)
        inner = Var(f"{var}_i", chunk)
        idx = Ix.of(outer) * chunk + inner
        ren = {r: idx}
        ragged = parts * chunk != r.extent
        valid = D.Call("lt", (D.IndexValue(idx), D.Lit(r.extent, "int32"))) if ragged else None

        def guard(e, fill):
            e = D.substitute(e, ren)
            return D.Call("where", (valid, e, D.Lit(fill, e.dtype))) if ragged else e

        if isinstance(s, OnlineStage):
            mp = D.fresh_name(f"{s.max_name}_part", taken)
            sums_p = []
            for n, vs, w in s.sums:
                sums_p.append((D.fresh_name(f"{n}_part", taken), vs + (outer,), None if w is None else guard(w, 0.0)))
            stages.append(OnlineStage(mp, s.max_vars + (outer,), inner, guard(s.logit, float("-inf")),
                                      tuple(sums_p), place="memory"))
            mref = D.Ref(mp, s.max_vars + (outer,), s.logit.dtype)
            stages.append(Stage(s.max_name, s.max_vars, D.Red("max", outer, mref)))
            mnew = D.Ref(s.max_name, s.max_vars, s.logit.dtype)
            for (n, vs, _), (pn, pvs, _) in zip(s.sums, sums_p):
                part = D.Ref(pn, pvs, s.logit.dtype)
                scale = D.Call("exp", (D.Call("sub", (mref, mnew)),))
                stages.append(Stage(n, vs, D.Red("add", outer, D.Call("mul", (part, scale)))))
        else:
            red = s.reduction
            pn = D.fresh_name(f"{s.name}_part", taken)
            from moajax import ops as _ops

            ident = _ops.MONOIDS[red.monoid].identity(red.dtype).item()
            body = guard(red.body, ident)
            # the conditions ``sum_to_top`` moved inside to reach Σ_r move back out of the sums
            # below it: a per-head table's gradient, (c = n) ? Σ_b Σ_t … : 0, added into one bin
            # once per tile, not selected into every bin at every step of the walks
            body = conditions_out(body) if red.monoid == "add" else body
            stages.append(Stage(pn, s.vars + (outer,), D.Red(red.monoid, inner, body), place="memory"))
            stages.append(Stage(s.name, s.vars, D.Red(red.monoid, outer, D.Ref(pn, s.vars + (outer,), red.dtype)), s.place))
    if found is None:
        raise ONFError(f"{onf.dnf.name}: split_k: no stage reduces over {var!r}")
    old = {a.name: a for a in onf.axes}
    # the axis of var is replaced by its parts, and a variable with no axis is taken whole: a
    # stage also indexed by var would lose var's grid tiles, its programs each writing all
    # of var (the rows of a plan's other outputs: dQ's t beside dK's Σ_t, which a preset's
    # split cuts in every kernel of the plan)
    if var in old and old[var].role == "grid":
        for s in stages:
            if found in s.index_vars or any(e is not None and found in e.free for e in s.exprs()):
                raise ONFError(f"{onf.dnf.name}: split_k of {var!r}: stage {s.name!r} is indexed by {var!r}, a grid "
                               f"axis, so it cannot be split into parts (a plan's preset splits every kernel: "
                               f"derive the kernel to split with a preset of its own)")
    base = old.get(var, Axis(var, found.extent, found.extent, "whole"))
    axes = [a for a in onf.axes if a.name != var]
    axes.append(Axis(outer.name, parts, 1, "grid"))
    from moajax.onf import next_pow2

    # keep a power-of-two tile a power of two (Triton): one padded tile if the chunk is smaller
    t_in = min(base.tile, next_pow2(inner.extent) if base.tile & (base.tile - 1) == 0 else inner.extent)
    axes.append(Axis(inner.name, inner.extent, t_in, "sequential" if base.role != "whole" else "whole", base.tail))
    prog = Program(tuple(stages), onf.program.outputs)
    return onf.replace(program=prog, axes=tuple(axes), note=f"split_k({var}, {parts})")


# ----------------------------------------------------------------------------- store vs recompute


def materialize(onf: ONF, label: str, place: str = "local") -> ONF:
    """Compute the subexpression labelled ``label`` once, as a stage (``place`` "local": kept
    on chip over the program's tile, e.g. the papers' O(n) score row; "memory": in main memory)."""
    if place not in ("local", "memory"):
        raise ONFError(f"{onf.dnf.name}: materialize place must be 'local' or 'memory', got {place!r}")
    found: dict = {}  # canonical (params renamed) → (stage name, params)
    order = onf.dnf.output_vars
    taken = _taken(onf)
    created: list = []

    def key_of(tag: D.Tag):
        params = stage_vars(tag.body, order)
        canon = D.canonical(D.substitute(tag.body, {v: Ix.of(Var(f"π{i}", v.extent)) for i, v in enumerate(params)}))
        return canon, params

    def rewrite(e: D.Expr) -> D.Expr:
        def fn(x):
            if isinstance(x, D.Tag) and x.label == label:
                canon, params = key_of(x)
                hit = found.get(canon)
                if hit is None:
                    name = D.fresh_name(label, taken)
                    found[canon] = (name, params)
                    created.append(Stage(name, params, x.body, place))
                    return D.Ref(name, params, x.dtype)
                name, p0 = hit
                # the same definition at other variables: a renamed read of the stage
                return D.Ref(name, tuple(params), x.dtype) if len(params) == len(p0) else None
            return None

        return D.transform(e, fn)

    stages: list = []
    for s in onf.program.stages:
        new = s.map_exprs(rewrite)
        stages.extend(created)
        created.clear()
        stages.append(new)
    if not found:
        raise ONFError(f"{onf.dnf.name}: no subexpression is labelled {label!r}; labels are {sorted(onf.store)}")
    return onf.replace(program=Program(tuple(stages), onf.program.outputs), note=f"materialize({label}, {place})")


def place(onf: ONF, stage: str, where: str) -> ONF:
    """Keep the stage ``stage`` (a plain stage, or an online pass by its max's name) ``where``:
    "local" (on chip, in each program) or "memory" (written to main memory by a kernel of its
    own, read by the programs after it). Its values, and so the ONF's meaning, do not change:
    only where they live."""
    if where not in ("local", "memory"):
        raise ONFError(f"{onf.dnf.name}: a stage is placed 'local' or 'memory', got {where!r}")
    try:
        st = onf.program.stage_of(stage)
    except KeyError:
        st = None
    if not isinstance(st, (Stage, OnlineStage)) or st.name != stage:
        raise ONFError(f"{onf.dnf.name}: {stage!r} names no stage; stages are {[s.name for s in onf.program.stages]}")
    if set(st.defines) & {n for _, n in onf.program.outputs}:
        raise ONFError(f"{onf.dnf.name}: {stage!r} is an output; outputs are written to memory already")
    stages = tuple(dataclasses.replace(s, place=where) if s is st else s for s in onf.program.stages)
    return onf.replace(program=Program(stages, onf.program.outputs), note=f"place({stage}, {where})")


# ----------------------------------------------------------------------------- accumulation


def _at(st: Stage, ref: D.Ref) -> D.Expr:
    """The body of ``st`` read at ``ref``'s index (a stage inlined at one use): st read at
    ⟨i…⟩ is st.body with st.vars := i…, for any index expressions i, not only variables — ψ
    over an axis of extent 1 is its one item, and index arithmetic writes that index as the
    constant 0 (``Ix``). A variable read at itself is left alone: v := v changes nothing, but
    re-simplified it would fold each extent-1 v to 0 in the body's reads of other stages,
    which then no longer read those stages at their own index (``ONF.validate``)."""
    return D.substitute(st.body, {a: b for a, b in zip(st.vars, ref.index) if b.as_var() != a})


def _drop_unused(stages: list, keep: set) -> list:
    """Stages nothing reads any more (and that are not outputs), removed."""
    while True:
        read = {x.stage for o in stages for e in o.exprs() if e is not None for x in D.walk(e) if isinstance(x, D.Ref)}
        dead = [o for o in stages if isinstance(o, Stage) and o.name not in read and o.name not in keep]
        if not dead:
            return stages
        stages = [o for o in stages if o not in dead]


def accumulate(onf: ONF, output: str, how: str = "atomic", over: str | tuple | None = None,
               rebind: dict | None = None) -> ONF:
    """Let the programs that own tiles of r add their partials of ``output`` = c · Σ_r g into
    memory (``how`` = "atomic"). Factors c that do not use r move back inside the sum
    (distributivity: Σ_r c·g = c · Σ_r g), so each partial is final up to the addition; a
    16-bit output's partials add up in the accumulation dtype. ``over``: r's name, where
    the output's Σ_r may lie inside other sums (``sum_to_top`` brings it up); or names
    (r, b, …): Σ_r Σ_b … g, each sum brought up below the one before, so that programs owning
    tiles of them all add partials (a table's gradient beside the batch and heads that own
    programs); a reduction of g over those variables alone is then a statistic of each
    program's rows, a local stage of its own (``_chain_statistics``). ``rebind`` {w: b}: a
    summed variable renamed to the one it stands for (α: Σ_{n_kv} f = Σ_n f[n_kv := n], n
    used nowhere in f) before it is brought up. An ONFError where Σ_r cannot come to the top."""
    outs = dict(onf.program.outputs)
    if output not in outs:
        raise ONFError(f"{onf.dnf.name}: accumulate: unknown output {output!r}; outputs are {sorted(outs)}")
    st = onf.program.stage_of(outs[output])
    if not isinstance(st, Stage):
        raise ONFError(f"{onf.dnf.name}: accumulate: output {output!r} is computed by an online stage")

    def local(ref):
        o = onf.program.stage_of(ref.stage) if isinstance(ref, D.Ref) else None
        return o if isinstance(o, Stage) and o.place == "local" else None

    body = st.body
    out_dtype = body.dtype
    if isinstance(body, D.Convert):
        body = body.arg
    while local(body) is not None and local(body).reduction is None:
        body = _at(local(body), body)  # c · Σ split over local stages by hoist: inline them
    over = (over,) if isinstance(over, str) else tuple(over or ())
    if not (isinstance(body, D.Red) and body.monoid == "add"):
        num, den = D.mul_div_factors(body)
        sums = [f for f in num if local(f) is not None and local(f).reduction is not None
                and local(f).reduction.monoid == "add"]
        if len(sums) == 1:
            red = _at(local(sums[0]), sums[0])
            rest = [f for f in num if f is not sums[0]]
            if any(red.var in f.free for f in rest + den):
                raise ONFError(f"{onf.dnf.name}: accumulate: a factor of {output!r} uses the summed variable {red.var.name!r}")
            body = D.Red("add", red.var, D.quotient([red.body] + rest, den, body.dtype))
        elif over:
            # (c = 0) ? a : 0 + (c = 0) ? b : 0 (one head's slope), a and b sums over r that
            # hoist made stages: read inlined, then Σ_r brought up (Fubini, linearity)
            def inline(x):
                st = local(x)
                return _at(st, x) if st is not None and any(r.var.name == over[0] for r in D.reductions(st.body)) else None
            body = sum_to_top(D.transform(body, inline), over[0]) or body
        if not (isinstance(body, D.Red) and body.monoid == "add"):
            raise ONFError(f"{onf.dnf.name}: accumulate: output {output!r} is not c · Σ_r g (one sum times factors)")
    if over and body.var.name != over[0]:
        # Σ_n Σ_s Σ_r … (a table's gradient; a 16-bit one's sum is a stage of its own under the
        # conversion, inlined above): Σ_r on top. Where it cannot come up, no program owning
        # tiles of r holds a partial: an error, never the top sum's variable in r's place
        top = sum_to_top(body, over[0])
        if top is None:
            raise ONFError(f"{onf.dnf.name}: accumulate: output {output!r} is not Σ_{over[0]} g "
                           f"(a term without Σ_{over[0]}, or one under another reduction or a division)")
        body = top
    if len(over) > 1:
        body = _chained(onf, output, body, over[1:], rebind or {}, over[:1])
    rows: list = []
    if over:
        body = _chain_statistics(onf, body, len(over), rows)
    stages = [x for o in onf.program.stages
              for x in (rows + [Stage(st.name, st.vars, D.Convert(body, out_dtype), st.place)] if o is st else [o])]
    walk = _kernel_walk(onf.program, st)
    if walk is not None and walk != body.var:
        # the stages of the pass this output now joins, and the output itself: their shared
        # contractions one node each (``factored``)
        stages = [o if not (o.name == st.name or o.walks == walk) else
                  o.map_exprs(lambda e: _below_top(e, factored)) if isinstance(o, Stage) else o.map_exprs(factored)
                  for o in stages]
    stages = _drop_unused(stages, {sname for _, sname in onf.program.outputs})
    acc = dict(onf.accumulate)
    acc[st.name] = how
    return onf.replace(program=Program(tuple(stages), onf.program.outputs), accumulate=tuple(sorted(acc.items())),
                       note=f"accumulate({output}, {how})")


def _chain_statistics(onf: ONF, red: D.Red, depth: int, rows: list) -> D.Red:
    """Σ_r Σ_b … g (the ``depth`` leading sums, over what the programs will own) with a
    reduction x of g over those variables alone, inside another sum of g: x is a statistic of
    each program's own rows (Δ[b t n] = Σ_{s'} P × dP inside Σ_s, a table's gradient after a
    16-bit forward), made a local stage of its own (appended to ``rows``), computed once per
    program in a walk of its own instead of held whole inside every step of g's sum. As
    ``hoist`` does for a stage's own variables; these become the programs' once they own the
    chain's tiles. A short reduction stays where it is read (``_short``). A local stage of
    the program with the same variables and body (one an earlier output's accumulate made:
    each of two tables' gradients recomputes the same Δ) is read, not made again."""
    chain = [red]
    for _ in range(depth - 1):
        chain.append(chain[-1].body)
    owned = {x.var for x in chain}
    taken = _taken(onf)
    made: dict = {}  # canonical reduction → the stage's read
    seen: dict = {}  # (node, nested, binders on the way) → result: bodies are DAGs
    have = {(tuple(st.vars), D.canonical(st.body)): D.Ref(st.name, st.vars, st.body.dtype)
            for st in onf.program.stages if isinstance(st, Stage) and st.place == "local"}

    def staged(e: D.Red) -> D.Expr:
        key = D.canonical(e)
        if key not in made:
            f = factor_out_invariants(e)
            if isinstance(f, D.Red):
                vs = stage_vars(f, onf.dnf.output_vars)
                new = _sink_stage(Stage(D.fresh_name(f"{_MONOID_NAMES[f.monoid]}_{f.var.name}", taken), vs, f, "local"))
                old = have.get((tuple(vs), D.canonical(new.body)))
                if old is None:
                    rows.append(new)
                    old = have[(tuple(vs), D.canonical(new.body))] = D.Ref(new.name, vs, f.dtype)
                made[key] = old
            else:  # (Σ_v a)·c ÷ d: the sum a stage (its walk), the factors read with it
                made[key] = top(f)
        return made[key]

    def top(e: D.Expr) -> D.Expr:
        if isinstance(e, D.Red):
            return staged(e)
        return D.rebuild(e, [top(c) for c in e.children]) if e.children else e

    def go(e: D.Expr, nested: bool, bound: frozenset) -> D.Expr:
        # (``bound``: variables a sum of g binds on the way down; one that shadows a chain
        # variable is not the programs' own, so a reduction reading it is not their statistic)
        if not e.children:
            return e
        hit = seen.get((id(e), nested, bound))
        if hit is not None and hit[0] is e:
            return hit[1]
        if isinstance(e, D.Red):
            if nested and e.free and e.free <= owned - bound and not _short(e):
                out = staged(e)
            else:
                out = D.Red(e.monoid, e.var, go(e.body, True, bound | {e.var}))
        else:
            out = D.rebuild(e, [go(c, nested, bound) for c in e.children])
        seen[(id(e), nested, bound)] = (e, out)
        return out

    body = go(chain[-1].body, False, frozenset())
    for x in reversed(chain):
        body = D.Red(x.monoid, x.var, body)
    return body


def _chained(onf: ONF, output: str, red: D.Red, names, rebind: dict, done=()) -> D.Red:
    """Σ_r f → Σ_r Σ_b … g: each of ``names`` brought up below the sum before it (Fubini and
    linearity, ``sum_to_top``), a summed variable ``rebind`` names renamed first."""
    if not names:
        return red
    body, name = red.body, names[0]
    for old, new in rebind.items():
        if new != name:
            continue
        olds = {x.var for x in D.walk(body) if isinstance(x, D.Red) and x.var.name == old}
        news = {x.var for x in D.walk(body) if isinstance(x, D.Red) and x.var.name == name}
        if len(olds) != 1 or news or any(v.name == name for v in body.free):
            raise ONFError(f"{onf.dnf.name}: accumulate: {output!r} cannot sum over {name!r} in place of {old!r}")
        (w,) = olds
        body = D.rebind(body, w, Var(name, w.extent))
    inner = sum_to_top(body, name)
    if inner is None:
        raise ONFError(f"{onf.dnf.name}: accumulate: {output!r} is not {' '.join(f'Σ_{n}' for n in done + (name,))} g "
                       f"(a term without Σ_{name}, or one under another reduction or a division)")
    return D.Red("add", red.var, _chained(onf, output, inner, names[1:], rebind, done + (name,)))


def factor_out_of_dots(onf: ONF) -> ONF:
    """Σ_h (a·c)·b → (Σ_h a·b)·c in every contraction below each stage's top reduction (its
    walk or scatter, whose form ``accumulate`` and the skips read; ``factored``): what ``hoist``
    sank into an operand (the scale onto Q, 1/ℓ onto dO) multiplies the contraction's result
    instead.
    A GPU kernel whose dots take 16-bit operands (``Knobs.lowp_dots``) would round the sunk
    product to 16 bits: bfloat16 q·(1/√8) perturbs every score by up to 2⁻⁹ of itself, and the
    float32 kernels of the same backward (a score_mod table's gradient) recompute the scores
    unrounded — their probabilities then miss the forward's row sums."""
    stages = tuple(o.map_exprs(lambda e: _below_top(e, factored)) if isinstance(o, Stage) else o.map_exprs(factored)
                   for o in onf.program.stages)
    out = onf.replace(program=Program(stages, onf.program.outputs), note="factor_out_of_dots")
    # a sum over one element whose body does not use it (split_k's inner part of 1, Σ_{n_kv_i<1}
    # of a bfloat16 table's gradient split 8 ways over 8 heads) is its body once factored: its
    # axis, named by no variable now, goes with it (a loop of one)
    named = {v.name for v in out.program.vars()}
    gone = {a.name for a in out.axes if a.name not in named and a.extent == 1}
    return out.replace(axes=tuple(a for a in out.axes if a.name not in gone)) if gone else out


# ----------------------------------------------------------------------------- separate walks


def separate_walks(onf: ONF, names) -> ONF:
    """α-rename every reduction over a variable named in ``names`` (axes the programs own) to
    a fresh variable — except the top reduction a scatter-added stage accumulates over the
    grid. A program owns one tile of r; a statistic over all of r (a softmax max whose
    variable shadows the output's r) walks an axis of its own."""
    names = set(names)
    taken = {v.name for v in onf.program.vars()}
    fresh: dict = {}

    def new_var(v: Var) -> Var:
        if v not in fresh:
            fresh[v] = Var(D.fresh_name(f"{v.name}_", taken), v.extent)
        return fresh[v]

    def rename(e: D.Expr) -> D.Expr:
        for v in {x.var for x in D.walk(e) if isinstance(x, D.Red) and x.var.name in names}:
            e = D.rebind(e, v, new_var(v))
        return e

    stages = []
    for st in onf.program.stages:
        if isinstance(st, OnlineStage) and st.var.name in names:
            v = new_var(st.var)
            st = dataclasses.replace(st, var=v, logit=D.substitute(st.logit, {st.var: Ix.of(v)}),
                                     sums=tuple((n, vs, None if w is None else D.substitute(w, {st.var: Ix.of(v)}))
                                                for n, vs, w in st.sums))
        acc = st.accumulated if onf.accumulation(st.name) is not None else None
        if acc is None or acc.var.name not in names:
            st = st.map_exprs(rename)
        else:  # the accumulated sum itself stays over the grid; what it sums is renamed
            top = D.Red(acc.monoid, acc.var, rename(acc.body))
            st = st.map_exprs(lambda b: D.Convert(top, b.dtype) if isinstance(b, D.Convert) else top)
        stages.append(st)
    if not fresh:
        return onf
    stages = _gathers_read_inline(stages)
    shown = ", ".join(f"{a.name}→{b.name}" for a, b in fresh.items())
    return onf.replace(program=Program(tuple(stages), onf.program.outputs), note=f"separate_walks({shown})")


def _gathers_read_inline(stages: list) -> list:
    """⟨i′⟩ of a stage X[i] = Σ_j ((j = f(i)) ? ⟨j⟩ψA : 0), a table read hoisted out of a loop
    (``dnf.selection``: a gather), is that gather at i′: a walk renamed by ``separate_walks``
    reads X at its own variable (GQA's dK recomputing the row max over s_ with a score_mod
    reading a table at kv_idx, residuals "none"), and a stage is read only at its own index. A
    stage that is not a gather stays read there, which ``ONF.validate`` refuses by name."""
    gathers = {st.name: st for st in stages if isinstance(st, Stage) and D.selection(st.body) is not None}
    if not gathers:
        return stages

    def inline(x: D.Expr):
        g = gathers.get(x.stage) if isinstance(x, D.Ref) else None
        if g is None or tuple(i.as_var() for i in x.index) == tuple(g.vars):
            return None
        return D.substitute(g.body, dict(zip(g.vars, x.index)))

    return [st.map_exprs(lambda e: D.transform(e, inline)) for st in stages]


# ----------------------------------------------------------------------------- schedule-only changes


def tile(onf: ONF, name: str, tile: int, role: str | None = None, tail: str = "pad") -> ONF:
    """Lift axis ``name`` into ⟨⌈n/tile⌉, tile⟩ with the given role and tail policy."""
    vars_ = {v.name: v for v in onf.program.vars()}
    if name not in vars_:
        raise ONFError(f"{onf.dnf.name}: unknown axis {name!r}; the program's index variables are {sorted(vars_)}")
    old = {a.name: a for a in onf.axes}
    role = role or (old[name].role if name in old else "whole")
    axes = [a for a in onf.axes if a.name != name] + [Axis(name, vars_[name].extent, int(tile), role, tail)]
    return onf.replace(axes=tuple(axes), note=f"tile({name}, {int(tile)}, {role}" + (f", {tail})" if tail != "pad" else ")"))


def with_gamma(onf: ONF, name: str, gamma: str) -> ONF:
    """Store input ``name`` in layout γ ("C" row-major, "F" column-major)."""
    g = dict(onf.gamma)
    g[name] = gamma
    return onf.replace(gamma=tuple(sorted(g.items())), note=f"with_gamma({name}, {gamma})")


def lift(onf: ONF, axes) -> ONF:
    """Lift every axis at once (a schedule's tiling): ``axes`` replace the ONF's."""
    shown = ", ".join(f"{a.name} {a.role} {a.tile}" for a in axes if a.role != "whole")
    return onf.replace(axes=tuple(axes), note=f"lift({shown})")


def with_knobs(onf: ONF, **kw) -> ONF:
    """Set backend knobs (``Knobs`` fields)."""
    shown = ", ".join(f"{k}={' '.join(v) if isinstance(v, tuple) else v}" for k, v in sorted(kw.items()))
    return onf.replace(knobs=dataclasses.replace(onf.knobs, **kw), note=f"with_knobs({shown})")


def skip_masked(onf: ONF) -> ONF:
    """Record, per stage walking a variable, the tiles its mask conditions leave out
    (``moajax.masked.derive_skip``); the stages are unchanged, the backends walk fewer tiles."""
    from moajax import masked

    found = masked.skips(onf)
    if not found and not onf.skips:
        return onf
    return onf.replace(skips=found, note=f"skip_masked({', '.join(sk.stage for sk in found) or '—'})")


def unmask_interior(onf: ONF, on: bool = True) -> ONF:
    """Walk the interior tiles of every skip (``Skip.interior``: every bound true over the
    whole tile) in a loop of their own that takes the mask as true; ``on=False`` undoes it.
    The monoid sums the same terms in the same order; the select gone, a compiler may round a
    product differently in the last bit (``tests/test_masked_tiles.py``)."""
    if all(sk.interior == on for sk in onf.skips):
        return onf
    skips = tuple(dataclasses.replace(sk, interior=on) for sk in onf.skips)
    return onf.replace(skips=skips, note=f"unmask_interior({'on' if on else 'off'})")


def retarget(onf: ONF, target: str) -> ONF:
    return onf.replace(target=target)


__all__ = ["hoist", "fuse_online", "split_k", "materialize", "accumulate", "tile", "lift", "with_gamma", "with_knobs",
           "retarget", "skip_masked", "unmask_interior", "factor_out_invariants", "Knobs"]
