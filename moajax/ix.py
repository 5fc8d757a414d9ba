"""Index arithmetic: the affine (plus ⌊·/d⌋ and mod d) expressions ψ-reduction produces.

An index expression is c + Σ aᵢ·xᵢ where each atom xᵢ is an index variable (with its
extent), ⌊e/d⌋ or e mod d. Every index variable ranges over [0, extent), so each
expression has exact integer bounds, and the rules

    ⌊(q·d + r)/d⌋ = q + ⌊r/d⌋,     (q·d + r) mod d = r mod d,     d·⌊e/d⌋ + e mod d = e

together with the bounds collapse the index arithmetic of reshapes, rotates and GQA head
selection back to plain variables wherever that is exact.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Union


@dataclasses.dataclass(frozen=True, order=True)
class Var:
    """An index variable ranging over [0, extent)."""

    name: str
    extent: int

    def __str__(self):
        return self.name


@dataclasses.dataclass(frozen=True)
class FloorDiv:
    arg: "Ix"
    d: int

    def __str__(self):
        inner = str(self.arg) if self.arg.as_var() is not None else f"({self.arg})"
        return f"⌊{inner}/{self.d}⌋"


@dataclasses.dataclass(frozen=True)
class Mod:
    arg: "Ix"
    d: int

    def __str__(self):
        inner = str(self.arg) if self.arg.as_var() is not None else f"({self.arg})"
        return f"({inner} mod {self.d})"


Atom = Union[Var, FloorDiv, Mod]


def _atom_key(a: Atom):
    if isinstance(a, Var):
        return (0, a.name, a.extent)
    return (1 if isinstance(a, FloorDiv) else 2, str(a.arg), a.d)


def _atom_bounds(a: Atom) -> tuple[int, int]:
    if isinstance(a, Var):
        return 0, a.extent - 1
    lo, hi = a.arg.bounds()
    if isinstance(a, FloorDiv):
        return lo // a.d, hi // a.d
    if lo >= 0 and hi < a.d:
        return lo, hi
    return 0, a.d - 1


@dataclasses.dataclass(frozen=True)
class Ix:
    """c + Σ coeff·atom, kept in a canonical form (sorted atoms, no zero coefficients)."""

    const: int = 0
    terms: tuple = ()

    # ---- construction
    @staticmethod
    def of(x) -> "Ix":
        if isinstance(x, Ix):
            return x
        if isinstance(x, Var):
            return Ix(0, ((x, 1),))
        if isinstance(x, (FloorDiv, Mod)):
            return Ix(0, ((x, 1),))
        if isinstance(x, int) or hasattr(x, "__index__"):
            return Ix(int(x), ())
        raise TypeError(f"not an index expression: {x!r}")

    @staticmethod
    def _make(const: int, terms: dict) -> "Ix":
        terms, extra = _fold_div_mod(dict(terms))
        # a variable of extent 1 is 0 wherever it appears in a sum (a reshape's flat index over
        # a unit batch axis: b + g + 4·kv with b < 1 is g + 4·kv)
        items = tuple(sorted(((a, c) for a, c in terms.items()
                              if c != 0 and not (isinstance(a, Var) and a.extent == 1)), key=lambda ac: _atom_key(ac[0])))
        return Ix(int(const + extra), items)

    # ---- arithmetic
    def __add__(self, other) -> "Ix":
        other = Ix.of(other)
        terms = dict(self.terms)
        for a, c in other.terms:
            terms[a] = terms.get(a, 0) + c
        return Ix._make(self.const + other.const, terms)

    __radd__ = __add__

    def __neg__(self) -> "Ix":
        return Ix._make(-self.const, {a: -c for a, c in self.terms})

    def __sub__(self, other) -> "Ix":
        return self + (-Ix.of(other))

    def __rsub__(self, other) -> "Ix":
        return Ix.of(other) - self

    def __mul__(self, k: int) -> "Ix":
        k = int(k)
        return Ix._make(self.const * k, {a: c * k for a, c in self.terms})

    __rmul__ = __mul__

    def _split(self, d: int):
        """self = q·d + r with q's coefficients exact and 0 ≤ r.const < d."""
        q_terms, r_terms = {}, {}
        for a, c in self.terms:
            if c % d == 0:
                q_terms[a] = c // d
            else:
                r_terms[a] = c
        qc, rc = divmod(self.const, d)
        return Ix._make(qc, q_terms), Ix._make(rc, r_terms)

    def floordiv(self, d: int) -> "Ix":
        d = int(d)
        if d <= 0:
            raise ValueError(f"floordiv by {d}")
        if d == 1:
            return self
        q, r = self._split(d)
        lo, hi = r.bounds()
        if lo // d == hi // d:
            return q + (lo // d)
        c = self._exact_factor(d)
        if c is not None:
            # ⌊e/(c·b)⌋ = ⌊⌊e/c⌋/b⌋, and ⌊e/c⌋ is exact
            return self.floordiv(c).floordiv(d // c)
        return q + Ix(0, ((FloorDiv(r, d), 1),))

    def _exact_factor(self, d: int):
        """A divisor c of d (1 < c < d) such that ⌊e/c⌋ needs no ⌊·⌋ atom."""
        for _, coeff in self.terms:
            c = abs(coeff)
            if 1 < c < d and d % c == 0:
                _, r = self._split(c)
                lo, hi = r.bounds()
                if lo // c == hi // c:
                    return c
        return None

    def mod(self, d: int) -> "Ix":
        d = int(d)
        if d <= 0:
            raise ValueError(f"mod by {d}")
        if d == 1:
            return Ix(0, ())
        _, r = self._split(d)
        lo, hi = r.bounds()
        if lo // d == hi // d:
            return r - (lo // d) * d
        c = self._exact_factor(d)
        if c is not None:
            # e mod (c·b) = c·(⌊e/c⌋ mod b) + e mod c
            return self.floordiv(c).mod(d // c) * c + self.mod(c)
        return Ix(0, ((Mod(r, d), 1),))

    # ---- queries
    def bounds(self) -> tuple[int, int]:
        lo = hi = self.const
        for a, c in self.terms:
            alo, ahi = _atom_bounds(a)
            if c >= 0:
                lo, hi = lo + c * alo, hi + c * ahi
            else:
                lo, hi = lo + c * ahi, hi + c * alo
        return lo, hi

    @property
    def is_const(self) -> bool:
        return not self.terms

    def as_var(self) -> Var | None:
        """The variable v if self is exactly v."""
        if self.const == 0 and len(self.terms) == 1:
            a, c = self.terms[0]
            if c == 1 and isinstance(a, Var):
                return a
        return None

    def window_var(self, is_scalar):
        """For v + (an expression in variables that ``is_scalar`` accepts), v: the index runs
        over a contiguous window of v. None if every variable is scalar; False if the index is
        not such a window (v scaled, or inside ⌊·/d⌋ or mod d, or two moving variables)."""
        moving = [v for v in self.free_vars() if not is_scalar(v)]
        if not moving:
            return None
        if len(moving) != 1:
            return False
        v = moving[0]
        for a, c in self.terms:
            if isinstance(a, Var) and a == v:
                if c != 1:
                    return False
            elif v in (a.arg.free_vars() if not isinstance(a, Var) else {a}):
                return False
        return v

    def as_shifted_var(self) -> tuple[Var, int] | None:
        """(v, c) if self is exactly v + c."""
        if len(self.terms) == 1:
            a, c = self.terms[0]
            if c == 1 and isinstance(a, Var):
                return a, self.const
        return None

    def free_vars(self) -> frozenset:
        out = set()
        for a, _ in self.terms:
            if isinstance(a, Var):
                out.add(a)
            else:
                out |= a.arg.free_vars()
        return frozenset(out)

    def substitute(self, mapping: Mapping[Var, "Ix"]) -> "Ix":
        """Replace variables by index expressions (and re-simplify)."""
        if not mapping or not (self.free_vars() & set(mapping)):
            return self
        out = Ix(self.const, ())
        for a, c in self.terms:
            if isinstance(a, Var):
                out = out + Ix.of(mapping.get(a, a)) * c
            elif isinstance(a, FloorDiv):
                out = out + a.arg.substitute(mapping).floordiv(a.d) * c
            else:
                out = out + a.arg.substitute(mapping).mod(a.d) * c
        return out

    def evaluate(self, env: Mapping[Var, object], xp=None):
        """The value of the expression with each variable bound to a number or an array."""
        total = self.const
        for a, c in self.terms:
            if isinstance(a, Var):
                v = env[a]
            elif isinstance(a, FloorDiv):
                v = a.arg.evaluate(env, xp) // a.d
            else:
                v = a.arg.evaluate(env, xp) % a.d
            total = total + (v * c if c != 1 else v)
        return total

    def __str__(self):
        parts = []
        for a, c in self.terms:
            s = str(a)
            if c == 1:
                parts.append(("+", s))
            elif c == -1:
                parts.append(("−", s))
            elif c < 0:
                parts.append(("−", f"{-c}·{s}"))
            else:
                parts.append(("+", f"{c}·{s}"))
        if self.const or not parts:
            parts.append(("+" if self.const >= 0 else "−", str(abs(self.const))))
        out = ""
        for i, (sign, s) in enumerate(parts):
            if i == 0:
                out = s if sign == "+" else f"−{s}"
            else:
                out += f" {sign} {s}"
        return out


def _fold_div_mod(terms: dict) -> tuple[dict, int]:
    """d·⌊e/d⌋ + (e mod d) → e wherever both atoms appear with matching coefficients.

    Returns the new terms and the constant they release (k·e.const).
    """
    const = 0
    changed = True
    while changed:
        changed = False
        for a, c in list(terms.items()):
            if isinstance(a, FloorDiv) and c % a.d == 0:
                k = c // a.d
                m = Mod(a.arg, a.d)
                if k != 0 and terms.get(m, 0) == k:
                    del terms[a], terms[m]
                    for b, cb in a.arg.terms:
                        terms[b] = terms.get(b, 0) + cb * k
                    const += a.arg.const * k
                    changed = True
                    break
    return terms, const


def ix(x) -> Ix:
    """Coerce a Var, an int or an Ix to an Ix."""
    return Ix.of(x)
