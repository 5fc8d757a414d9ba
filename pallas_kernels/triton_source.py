"""ONF → Triton source: the Pallas kernel of an ONF written out as a readable ``@triton.jit``
function, for a GPU path that does not go through Pallas' Triton backend (jax-triton).

The kernel body is the one the Pallas backend traces from the ONF (``pallas_kernels.lower``:
the shared tile evaluator), so the three backends share their semantics; this module only
translates that body's jaxpr, equation by equation, into Triton Python: a ref read
``x[i, a:a+64, :]`` becomes pointer arithmetic and ``tl.load``, ``dot_general`` ``tl.dot`` in
IEEE precision, the fori loops ``for``/``while`` loops, and so on. Refs are whole arrays in
row-major order (the Pallas lowering pads operands to whole tiles), so no load needs a mask.

``kernels(onf)`` gives the generated kernels (``TritonKernel``: name, source, grid, ...);
``lower(onf, interpret=True)`` runs them under Triton's interpreter on the CPU.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from moajax.onf import ONF, ONFError

_TL = {"float16": "tl.float16", "bfloat16": "tl.bfloat16", "float32": "tl.float32", "float64": "tl.float64",
       "int32": "tl.int32", "int64": "tl.int64", "bool": "tl.int1", "uint32": "tl.uint32", "int8": "tl.int8"}
_BINARY = {"add": "({} + {})", "sub": "({} - {})", "mul": "({} * {})", "eq": "({} == {})", "ne": "({} != {})",
           "lt": "({} < {})", "le": "({} <= {})", "gt": "({} > {})", "ge": "({} >= {})", "and": "({} & {})",
           "or": "({} | {})", "xor": "({} ^ {})", "max": "tl.maximum({}, {})", "min": "tl.minimum({}, {})",
           "pow": "tl.extra.libdevice.pow({}, {})"}
_UNARY = {"exp": "tl.exp({})", "log": "tl.log({})", "sqrt": "tl.sqrt({})", "rsqrt": "tl.rsqrt({})",
          "neg": "(-{})", "abs": "tl.abs({})", "logistic": "tl.sigmoid({})", "exp2": "tl.exp2({})",
          "sin": "tl.sin({})", "cos": "tl.cos({})", "floor": "tl.floor({})", "ceil": "tl.ceil({})",
          "tanh": "(2.0 * tl.sigmoid(2.0 * {}) - 1.0)", "not": "(~{})"}
# Triton's block tensors need power-of-two extents (and at least 1 element per dimension)
MAX_BLOCK_ELEMENTS = 1 << 20


class TritonSourceError(ONFError):
    """An ONF whose kernel a Triton kernel cannot express (named: the primitive or the limit)."""


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    """One generated kernel: its name, Python source, launch grid, pointer arguments (the
    Pallas kernel's refs: inputs, then outputs), and Triton's launch options."""

    name: str
    source: str
    grid: tuple
    in_avals: tuple
    out_avals: tuple
    aliases: tuple  # (input index, output index): outputs that start as an input's values
    num_warps: int
    num_stages: int

    def jit_function(self):
        """The kernel as a ``triton.JITFunction`` (never the interpreter's wrapper): what
        ``triton.compile`` and jax-triton take. It reads its source through linecache."""
        import linecache

        import triton
        import triton.language as tl
        from triton.runtime.jit import JITFunction

        src = self.source.replace("@triton.jit\n", "")
        fname = f"<moajax triton {self.name} jit>"
        linecache.cache[fname] = (len(src), None, src.splitlines(True), fname)
        scope = {"triton": triton, "tl": tl}
        exec(compile(src, fname, "exec"), scope)
        return JITFunction(scope[self.name])

    def function(self):
        """The ``@triton.jit`` function, compiled from the source."""
        import triton
        import triton.language as tl

        scope = {"triton": triton, "tl": tl}
        exec(compile(self.source, f"<moajax triton {self.name}>", "exec"), scope)
        return scope[self.name]


_POINTER = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32", "float64": "*fp64", "int32": "*i32",
            "int64": "*i64", "bool": "*i1", "uint32": "*u32", "int8": "*i8"}
# the compute capabilities of the offline report's architectures
CAPABILITY = {"sm_80": 80, "sm_86": 86, "sm_90a": 90}


def compile_ptx(kernel: "TritonKernel", arch: str) -> tuple:
    """(PTX text, shared memory bytes) of a generated kernel compiled by Triton for ``arch``
    with no GPU present (``triton.compile`` with an explicit target)."""
    import triton
    from triton.backends.compiler import GPUTarget

    if arch not in CAPABILITY:
        raise ValueError(f"compile_ptx: arch must be one of {sorted(CAPABILITY)}, got {arch!r}")
    fn = kernel.jit_function()
    names = [f"in{i}_ptr" for i in range(len(kernel.in_avals))] + [f"out{i}_ptr" for i in range(len(kernel.out_avals))]
    sig = {n: _POINTER[np.dtype(a.dtype).name] for n, a in zip(names, kernel.in_avals + kernel.out_avals)}
    compiled = triton.compile(triton.compiler.ASTSource(fn=fn, signature=sig, constexprs={}),
                              target=GPUTarget("cuda", CAPABILITY[arch], 32),
                              options={"num_warps": kernel.num_warps, "num_stages": kernel.num_stages})
    return compiled.asm["ptx"], int(compiled.metadata.shared)


def ptxas(newest: bool = False) -> str | None:
    """The ptxas that Triton's wheel carries (its PTX versions match), or None; ``newest``:
    the newer one it carries where there are two (Triton emits a newer PTX for some targets)."""
    import os
    from pathlib import Path

    try:
        import triton
    except ImportError:
        return None
    base = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    names = ("ptxas-blackwell", "ptxas") if newest else ("ptxas",)
    for n in names:
        p = base / n
        if p.exists() and os.access(p, os.X_OK):
            return str(p)
    return None


def _dtype(aval) -> str:
    name = np.dtype(aval.dtype).name
    if name not in _TL:
        raise TritonSourceError(f"Triton source: dtype {name} has no Triton type")
    return _TL[name]


def _literal(value, aval) -> str:
    v = np.asarray(value).item()
    if isinstance(v, bool) or np.dtype(aval.dtype) == np.bool_:
        return "True" if v else "False"
    if isinstance(v, float):
        if math.isinf(v):
            return "float('inf')" if v > 0 else "float('-inf')"
        if math.isnan(v):
            return "float('nan')"
        return repr(v)
    return str(int(v))


class _Emitter:
    """Writes one kernel body: a name per jaxpr variable, a line per equation."""

    def __init__(self):
        self.lines: list = []
        self.names: dict = {}
        self.count = 0
        self.refs: dict = {}  # ref variable → (pointer name, shape)

    def fresh(self, base="v") -> str:
        self.count += 1
        return f"{base}{self.count}"

    def line(self, indent: int, text: str):
        self.lines.append("    " * indent + text)

    def read(self, atom, indent) -> str:
        from jax.extend import core

        if isinstance(atom, core.Literal):
            aval = atom.aval
            lit = _literal(atom.val, aval)
            if aval.shape:
                name = self.fresh("c")
                self.line(indent, f"{name} = tl.full({list(aval.shape)}, {lit}, {_dtype(aval)})")
                return name
            if np.dtype(aval.dtype).kind == "f" and np.dtype(aval.dtype) != np.float32:
                name = self.fresh("c")  # a scalar of a non-default float type: typed, not a Python float
                self.line(indent, f"{name} = tl.full([], {lit}, {_dtype(aval)})")
                return name
            return lit
        return self.names[atom]

    def bind(self, var, text: str, indent: int) -> str:
        from jax.extend import core

        if isinstance(var, core.DropVar):
            return ""
        if getattr(var.aval, "shape", ()):
            _check_block(tuple(var.aval.shape), "a value's")
        name = self.fresh()
        self.line(indent, f"{name} = {text}")
        self.names[var] = name
        return name

    # ---- a jaxpr
    def body(self, jaxpr, args, indent: int) -> list:
        """Emit ``jaxpr`` with its invars bound to ``args`` (names); its outputs' names."""
        ptrs = {name: (name, shape) for name, shape in self.refs.values()}
        for v, a in zip(jaxpr.invars, args):
            self.names[v] = a
            if isinstance(a, str) and a in ptrs:  # a ref passed into a loop or call body
                self.refs[v] = ptrs[a]
        for eqn in jaxpr.eqns:
            self.equation(eqn, indent)
        return [self.read(v, indent) for v in jaxpr.outvars]

    def equation(self, eqn, indent: int):
        p = eqn.primitive.name
        ins = eqn.invars
        out = eqn.outvars[0] if eqn.outvars else None
        aval = out.aval if out is not None else None
        rd = lambda a: self.read(a, indent)  # noqa: E731
        if p in ("jit", "pjit", "closed_call", "eval_jaxpr", "core_call"):  # (eval_jaxpr: closed_call after JAX 0.11.1)
            inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
            inner = getattr(inner, "jaxpr", inner)
            res = self.body(inner, [rd(a) for a in ins], indent)
            for v, r in zip(eqn.outvars, res):
                self.names[v] = r
        elif p in _BINARY:
            self.bind(out, _BINARY[p].format(rd(ins[0]), rd(ins[1])), indent)
        elif p == "div":
            a, b = rd(ins[0]), rd(ins[1])
            kind = np.dtype(aval.dtype).kind
            # lax.div on integers rounds toward zero: Triton's // on ints does (C semantics)
            self.bind(out, f"({a} // {b})" if kind in "iu" else f"({a} / {b})", indent)
        elif p == "rem":
            if np.dtype(aval.dtype).kind not in "iu":
                raise TritonSourceError("Triton source: rem of floats")
            self.bind(out, f"({rd(ins[0])} % {rd(ins[1])})", indent)
        elif p in _UNARY:
            self.bind(out, _UNARY[p].format(rd(ins[0])), indent)
        elif p == "sign":
            x = rd(ins[0])
            self.bind(out, f"tl.cast(tl.where({x} > 0, 1, tl.where({x} < 0, -1, 0)), {_dtype(aval)})", indent)
        elif p == "integer_pow":
            x, y = rd(ins[0]), eqn.params["y"]
            if y < 1:
                raise TritonSourceError(f"Triton source: integer_pow with exponent {y}")
            self.bind(out, "(" + " * ".join([x] * y) + ")", indent)
        elif p == "square":
            x = rd(ins[0])
            self.bind(out, f"({x} * {x})", indent)
        elif p == "select_n":
            if len(ins) != 3:
                raise TritonSourceError("Triton source: select_n of more than two cases")
            self.bind(out, f"tl.where({rd(ins[0])}, {rd(ins[2])}, {rd(ins[1])})", indent)
        elif p == "convert_element_type":
            x = rd(ins[0])
            self.bind(out, f"tl.cast({x}, {_dtype(aval)})" if not _is_literal(ins[0]) else
                      f"tl.full({list(aval.shape)}, {x}, {_dtype(aval)})", indent)
        elif p == "broadcast_in_dim":
            self.bind(out, self._broadcast(ins[0], rd(ins[0]), aval, eqn.params["broadcast_dimensions"]), indent)
        elif p == "reshape":
            src, x = ins[0].aval.shape, rd(ins[0])
            if not aval.shape:  # one element to a scalar (Triton reshapes blocks only)
                self.bind(out, f"tl.sum(tl.reshape({x}, [1]), axis=0)" if src else x, indent)
            elif not src:  # a scalar to a block of one element
                self.bind(out, f"(tl.full({list(aval.shape)}, 0, {_dtype(aval)}) + {x})", indent)
            else:
                self.bind(out, f"tl.reshape({x}, {list(aval.shape)})", indent)
        elif p == "transpose":
            perm = tuple(eqn.params["permutation"])
            self.bind(out, f"tl.permute({rd(ins[0])}, {list(perm)})" if perm != tuple(range(len(perm)))
                      else rd(ins[0]), indent)
        elif p == "iota":
            shape, dim = tuple(eqn.params["shape"]), eqn.params["dimension"]
            _check_block(shape, "iota")
            idx = ["None"] * len(shape)
            idx[dim] = ":"
            ar = f"tl.arange(0, {shape[dim]})[{', '.join(idx)}]" if len(shape) > 1 else f"tl.arange(0, {shape[0]})"
            self.bind(out, f"tl.cast(tl.broadcast_to({ar}, {list(shape)}), {_dtype(aval)})", indent)
        elif p in ("reduce_max", "reduce_min", "reduce_sum"):
            fn = {"reduce_max": "tl.max", "reduce_min": "tl.min", "reduce_sum": "tl.sum"}[p]
            x = rd(ins[0])
            for ax in sorted(eqn.params["axes"], reverse=True):
                x = f"{fn}({x}, axis={ax})"
            self.bind(out, x, indent)
        elif p == "dot_general":
            self.bind(out, self._dot(eqn, rd), indent)
        elif p == "program_id":
            self.bind(out, f"tl.program_id({eqn.params['axis']})", indent)
        elif p == "get":
            self.bind(out, f"tl.load({self._pointer(eqn, ins[0], ins[1:], indent)})", indent)
        elif p == "swap":
            ptr = self._pointer(eqn, ins[0], ins[2:], indent)
            from jax.extend import core

            if out is not None and not isinstance(out, core.DropVar):
                self.bind(out, f"tl.load({ptr})", indent)
            self.line(indent, f"tl.store({ptr}, {rd(ins[1])})")
        elif p == "atomic_rmw":
            self._atomic(eqn, indent)
        elif p == "scan":
            self._scan(eqn, indent)
        elif p == "while":
            self._while(eqn, indent)
        elif p == "cond":
            self._cond(eqn, indent)
        else:
            raise TritonSourceError(f"Triton source: no Triton form for the primitive {p!r}")

    # ---- shapes
    def _broadcast(self, atom, x: str, aval, dims) -> str:
        shape = list(aval.shape)
        _check_block(tuple(shape), "broadcast")
        src = atom.aval.shape
        if not src:
            if _is_literal(atom):
                return f"tl.full({shape}, {x}, {_dtype(aval)})"
            return f"tl.full({shape}, 0, {_dtype(aval)}) + {x}" if shape else x
        idx = ["None"] * len(shape)
        for d in dims:
            idx[d] = ":"
        expanded = f"{x}[{', '.join(idx)}]" if len(shape) != len(src) else x
        return f"tl.broadcast_to({expanded}, {shape})"

    def _dot(self, eqn, rd) -> str:
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        a, b = eqn.invars
        if lb or rb or len(a.aval.shape) != 2 or len(b.aval.shape) != 2:
            raise TritonSourceError("Triton source: dot_general beyond a 2-D matrix product")
        x = rd(a) if tuple(lc) == (1,) else f"tl.trans({rd(a)})"
        y = rd(b) if tuple(rc) == (0,) else f"tl.trans({rd(b)})"
        out = eqn.outvars[0].aval
        kind = np.dtype(a.aval.dtype)
        acc = "tl.float64" if kind == np.float64 else "tl.float32"
        from jax import lax

        exact = eqn.params.get("precision") in (None, lax.Precision.HIGHEST, (lax.Precision.HIGHEST,) * 2)
        mode = "ieee" if exact or kind != np.float32 else "tf32"  # (Knobs.dot_precision)
        text = f"tl.dot({x}, {y}, input_precision='{mode}', out_dtype={acc})"
        return text if _dtype(out) == acc else f"tl.cast({text}, {_dtype(out)})"

    def _named(self, transforms, indent):
        """The NDIndexer of a ref access (one transform), its dynamic parts as names."""
        import jax

        leaves, tree = jax.tree_util.tree_flatten(transforms)
        names = [self.read(a, indent) for a in leaves]
        self._array_names.update(n for n, a in zip(names, leaves) if getattr(a.aval, "shape", ()))
        transforms = jax.tree_util.tree_unflatten(tree, names)
        if len(transforms) != 1:
            raise TritonSourceError("Triton source: a ref access through several transforms")
        return transforms[0]

    def _indexers(self, eqn, idx_atoms, indent):
        import jax

        return self._named(jax.tree_util.tree_unflatten(eqn.params["tree"], list(idx_atoms)), indent)

    def _pointer(self, eqn, ref, idx_atoms, indent, nd=None) -> str:
        """The pointer block of ``ref[indexer]`` (row-major whole array, no mask needed)."""
        ptr, shape = self.refs[ref]
        nd = self._indexers(eqn, idx_atoms, indent) if nd is None else nd
        strides = [int(np.prod(shape[d + 1:])) for d in range(len(shape))]
        scalar, parts, arrays = [], [], []
        for d, ix in enumerate(nd.indices):
            if hasattr(ix, "size") and hasattr(ix, "start") and hasattr(ix, "stride"):  # a Slice
                _check_block((int(ix.size),), "a ref slice")
                parts.append((d, ix))
            elif isinstance(ix, str) and ix in self._array_names:
                arrays.append((d, ix))
            else:
                scalar.append(f"{ix} * {strides[d]}")
        if arrays and parts:
            raise TritonSourceError("Triton source: a gather mixed with slices")
        off = " + ".join(scalar) if scalar else "0"
        if arrays:
            for d, name in arrays:
                off += f" + {name} * {strides[d]}"
            name = self.fresh("p")
            self.line(indent, f"{name} = {ptr} + {off}")
            return name
        rank = len(parts)
        terms = []
        for k, (d, sl) in enumerate(parts):
            idx = ["None"] * rank
            idx[k] = ":"
            ar = f"tl.arange(0, {int(sl.size)})"
            step = int(sl.stride) if not isinstance(sl.stride, str) else sl.stride
            ar = f"({sl.start} + {ar} * {step})" if step != 1 else f"({sl.start} + {ar})"
            terms.append(f"{ar}{'[' + ', '.join(idx) + ']' if rank > 1 else ''} * {strides[d]}")
        name = self.fresh("p")
        self.line(indent, f"{name} = {ptr} + {off}" + ("".join(f" + {t}" for t in terms)))
        return name

    @property
    def _array_names(self):
        return self.__dict__.setdefault("_arrays", set())

    def _atomic(self, eqn, indent):
        typ = str(eqn.params.get("atomic_type", ""))
        if "add" not in typ.lower():
            raise TritonSourceError(f"Triton source: atomic {typ}")
        ref, transforms, val, mask = eqn.params["args_tree"].unflatten(eqn.invars)
        if mask is not None:
            raise TritonSourceError("Triton source: a masked atomic")
        ptr = self._pointer(eqn, ref, (), indent, nd=self._named(transforms, indent))
        self.line(indent, f"tl.atomic_add({ptr}, {self.read(val, indent)})")
        for v in eqn.outvars:
            self.names[v] = "0"

    def _carry_loop(self, inits, indent):
        """Loop-carried values: each in a variable of its own, assigned before the loop."""
        names = []
        for x in inits:
            n = self.fresh("k")
            self.line(indent, f"{n} = {x}")
            names.append(n)
        return names

    def _scan(self, eqn, indent):
        from moajax import compat

        prm = eqn.params
        body = prm["jaxpr"].jaxpr
        nc, nk = compat.scan_counts(prm)
        if len(eqn.invars) != nc + nk or len(eqn.outvars) != nk or prm.get("reverse"):
            raise TritonSourceError("Triton source: a scan with scanned inputs or outputs (only fori loops)")
        consts = [self.read(a, indent) for a in eqn.invars[:nc]]
        carry = self._carry_loop([self.read(a, indent) for a in eqn.invars[nc:]], indent)
        it = self.fresh("i")
        self.line(indent, f"for {it} in range(0, {prm['length']}):")
        res = self.body(body, consts + carry, indent + 1)
        for n, r in zip(carry, res):
            self.line(indent + 1, f"{n} = {r}")
        for v, n in zip(eqn.outvars, carry):
            self.names[v] = n

    @staticmethod
    def _counted(cj, bj, cn: int, bn: int):
        """A fori loop with traced bounds, ``while i < n: i += 1``: (position of i, of n among
        the carried values) — emitted as ``for i in range(i, n)``, which Triton keeps in
        registers (a general ``while`` it may not) — else None."""
        if len(cj.eqns) != 1 or cj.eqns[0].primitive.name != "lt" or cj.outvars[0] is not cj.eqns[0].outvars[0]:
            return None
        carry_c = cj.invars[cn:]
        a, b = cj.eqns[0].invars
        if a not in carry_c or b not in carry_c:
            return None
        i, n = carry_c.index(a), carry_c.index(b)
        carry_b = bj.invars[bn:]
        if bj.outvars[n] is not carry_b[n]:
            return None  # the bound changes
        inc = [e for e in bj.eqns if bj.outvars[i] in e.outvars]
        if len(inc) != 1 or inc[0].primitive.name != "add" or carry_b[i] not in inc[0].invars:
            return None
        other = [x for x in inc[0].invars if x is not carry_b[i]]
        if len(other) != 1 or not _is_literal(other[0]) or int(np.asarray(other[0].val)) != 1:
            return None
        return i, n

    def _while(self, eqn, indent):
        prm = eqn.params
        cj, bj = prm["cond_jaxpr"].jaxpr, prm["body_jaxpr"].jaxpr
        cn, bn = prm["cond_nconsts"], prm["body_nconsts"]
        cconsts = [self.read(a, indent) for a in eqn.invars[:cn]]
        bconsts = [self.read(a, indent) for a in eqn.invars[cn:cn + bn]]
        carry = self._carry_loop([self.read(a, indent) for a in eqn.invars[cn + bn:]], indent)
        counted = self._counted(cj, bj, cn, bn)
        if counted is not None:
            i, n = counted
            it = self.fresh("i")
            self.line(indent, f"for {it} in range({carry[i]}, {carry[n]}):")
            res = self.body(bj, bconsts + [it if k == i else c for k, c in enumerate(carry)], indent + 1)
            for k, (c, r) in enumerate(zip(carry, res)):
                if k not in (i, n):
                    self.line(indent + 1, f"{c} = {r}")
            self.line(indent, f"{carry[i]} = tl.maximum({carry[i]}, {carry[n]})")
            for v, c in zip(eqn.outvars, carry):
                self.names[v] = c
            return
        flag = self.fresh("go")
        self.line(indent, f"{flag} = {self.body(cj, cconsts + carry, indent)[0]}")
        self.line(indent, f"while {flag}:")
        res = self.body(bj, bconsts + carry, indent + 1)
        for n, r in zip(carry, res):
            self.line(indent + 1, f"{n} = {r}")
        self.line(indent + 1, f"{flag} = {self.body(cj, cconsts + carry, indent + 1)[0]}")
        for v, n in zip(eqn.outvars, carry):
            self.names[v] = n

    def _cond(self, eqn, indent):
        branches = eqn.params["branches"]
        if len(branches) != 2:
            raise TritonSourceError("Triton source: a cond of more than two branches")
        idx, *ops = eqn.invars
        args = [self.read(a, indent) for a in ops]
        outs = [self.fresh("b") for _ in eqn.outvars]
        self.line(indent, f"if {self.read(idx, indent)} == 0:")
        for k, br in enumerate(branches):
            if k == 1:
                self.line(indent, "else:")
            res = self.body(br.jaxpr, args, indent + 1)
            for n, r in zip(outs, res):
                self.line(indent + 1, f"{n} = {r}")
            if not outs:
                self.line(indent + 1, "pass")
        for v, n in zip(eqn.outvars, outs):
            self.names[v] = n


def _is_literal(atom) -> bool:
    from jax.extend import core

    return isinstance(atom, core.Literal)


def _check_block(shape, what: str):
    for n in shape:
        if n < 1 or n & (n - 1):
            raise TritonSourceError(f"Triton source: {what} of extent {n}, not a power of two (Triton's blocks)")
    if math.prod(shape) > MAX_BLOCK_ELEMENTS:
        err = TritonSourceError(f"Triton source: {what} block {list(shape)} of {math.prod(shape)} elements, over "
                                f"Triton's {MAX_BLOCK_ELEMENTS}")
        err.shape = tuple(shape)
        raise err


def _kernel_of(eqn, index: int) -> TritonKernel:
    """The Triton kernel of one ``pallas_call`` equation."""
    prm = eqn.params
    jaxpr = prm["jaxpr"]
    gm = prm["grid_mapping"]
    grid = tuple(int(g) for g in gm.grid)
    refs = jaxpr.invars
    n_in = len(eqn.invars)
    em = _Emitter()
    args = []
    for k, r in enumerate(refs):
        shape = tuple(int(s) for s in r.aval.inner_aval.shape) if hasattr(r.aval, "inner_aval") else tuple(r.aval.shape)
        name = f"in{k}_ptr" if k < n_in else f"out{k - n_in}_ptr"
        em.refs[r] = (name, shape)
        args.append(name)
    name = str(prm.get("name") or getattr(prm.get("name_and_src_info"), "name", f"kernel{index}"))
    name = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in name) or f"kernel{index}"
    em.body(jaxpr, [em.refs[r][0] for r in refs], 1)
    cp = prm.get("compiler_params")
    warps = getattr(cp, "num_warps", None) or 4
    stages = getattr(cp, "num_stages", None) or 2
    head = [f"# generated by moajax from the ONF's Pallas kernel {name}: grid {grid}",
            "@triton.jit", f"def {name}({', '.join(args)}):"]
    src = "\n".join(head + (em.lines or ["    pass"])) + "\n"
    aliases = tuple((int(i), int(o)) for i, o in (prm.get("input_output_aliases") or ()))
    return TritonKernel(name, src, grid, tuple(v.aval for v in eqn.invars), tuple(eqn.params["out_avals"])
                        if "out_avals" in prm else tuple(v.aval for v in eqn.outvars), aliases, int(warps), int(stages))


def traced(onf: ONF):
    """(the jaxpr of the ONF's Pallas lowering, its Triton kernels in launch order)."""
    import jax

    import pallas_kernels

    fn = pallas_kernels.lower(onf)
    closed = jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct(i.shape, i.dtype) for i in onf.dnf.inputs])
    kernels = []
    for eqn in closed.jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            try:
                kernels.append(_kernel_of(eqn, len(kernels)))
            except TritonSourceError as e:
                shape = getattr(e, "shape", None)
                if shape is None:
                    raise TritonSourceError(f"{onf.dnf.name}: {e}") from None
                # the ONF axes whose tiles make the block: what to shrink
                axes = [f"{a.name} ({a.role}, tile {a.whole_size(True) if a.role == 'whole' else a.tile})"
                        for a in onf.axes if (a.whole_size(True) if a.role == "whole" else a.tile) in shape
                        and (a.whole_size(True) if a.role == "whole" else a.tile) > 1]
                raise TritonSourceError(f"{onf.dnf.name}: {e}; its axes {', '.join(axes)}: smaller tiles") from None
    if not kernels:
        raise TritonSourceError(f"{onf.dnf.name}: its Pallas lowering launches no kernel")
    return closed, kernels


def kernels(onf: ONF) -> list:
    """The generated Triton kernels of an ONF (one per Pallas kernel it launches)."""
    return traced(onf)[1]


def lower(onf: ONF, *, interpret: bool = True, compute_capability: int | None = None):
    """The ONF as a JAX function whose kernels are the generated Triton source: under Triton's
    interpreter on the CPU (``interpret``; a host callback), else through jax-triton
    (``compute_capability``: the target's, where no GPU can be asked)."""
    from moajax import compat

    closed, ks = traced(onf)
    launchers = iter([])

    def launch(k: TritonKernel):
        if interpret:
            return compat.triton_interpret_call(k)
        return compat.jax_triton_call(k, compute_capability)

    def run(*args):
        nonlocal launchers
        launchers = iter(ks)
        return _eval(closed.jaxpr, closed.consts, args, lambda eqn, vals: launch(next(launchers))(*vals))

    return run


def _eval(jaxpr, consts, args, on_pallas):
    """Evaluate a jaxpr, each ``pallas_call`` replaced by ``on_pallas(eqn, inputs)``."""
    from jax.extend import core

    from moajax import compat

    env = {}

    def read(v):
        return v.val if isinstance(v, core.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for eqn in jaxpr.eqns:
        vals = [read(v) for v in eqn.invars]
        if eqn.primitive.name == "pallas_call":
            outs = on_pallas(eqn, vals)
        else:
            outs = eqn.primitive.bind(*vals, **compat.bind_params(eqn))
        outs = outs if eqn.primitive.multiple_results or isinstance(outs, (list, tuple)) else [outs]
        for v, o in zip(eqn.outvars, outs):
            env[v] = o
    res = [read(v) for v in jaxpr.outvars]
    return tuple(res) if len(res) != 1 else res[0]


__all__ = ["TritonKernel", "TritonSourceError", "kernels", "lower", "traced", "compile_ptx", "ptxas"]
