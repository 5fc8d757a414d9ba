"""Evaluate ONF programs over tiles: the kernel body both backends emit.

Inside one program every index variable has a ``Range``: a start (a Python int, or a traced
scalar such as program id × tile or loop counter × tile) and a static size. Expressions are
evaluated to ``Named`` arrays over exactly the variables they use (a variable whose range has
size 1 is a scalar, never an axis), so a loop-invariant subexpression is computed once,
outside the loops that do not use it. A +-reduction of a product is a contraction (one
dot_general); a reduction over a ``sequential`` axis is a loop over its tiles carrying the
monoid's accumulator; tiles past the end of a padded axis contribute the monoid's identity.

One module per concern:

==============  =====================================================================
``ranges``      a variable's values in one program; the canonical axis order of tiles
``scope``       a program's (or loop body's) ranges, memoisation, loop-invariant hoisting
``evaluate``    ``TileEval``: expressions and reductions over the scope's ranges
``masking``     tails: which positions are past the end, and what stands there instead
``contract``    Σ of a product as one dot_general: the factors split into two operands
``online``      how an online (running-max) reduction is carried over tiles
``stages``      how stages are ordered and computed; values held over more than a tile
``operands``    how the inputs are laid out for tiles: zero padding, physical axis order
``backend``     what a backend supplies: reads, contractions, loops
==============  =====================================================================
"""

from moajax.tiles.backend import Backend
from moajax.tiles.evaluate import TileEval
from moajax.tiles.operands import prepare_inputs
from moajax.tiles.ranges import Range, broadcast_to_vars, var_order
from moajax.tiles.scope import ProgramState
from moajax.tiles.stages import InMemory

__all__ = ["Backend", "TileEval", "ProgramState", "Range", "InMemory", "broadcast_to_vars", "var_order",
           "prepare_inputs"]
