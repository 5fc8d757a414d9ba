"""The architecture as a test: the module import graph (function-level imports included).

The pipeline's stages import one way (algebra → DNF → ONF → backends), so no module imports
one that imports it back; JAX's private modules are reached only through ``moajax.compat``;
Pallas is imported only in ``pallas_kernels``.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("moajax", "pallas_kernels")


def _modules() -> dict:
    """module name → source path, for every module of the two packages."""
    out = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


def _imports(path: Path, modules: dict) -> set:
    """Every module name ``path`` imports, anywhere in the file (absolute names)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            # ``from pkg import mod`` imports the submodule pkg.mod where there is one
            names |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules}
    return names


def _graph() -> dict:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        own = {m for m in _imports(path, modules) if m in modules and m != name}
        # a package's __init__ re-exports its submodules; that is not an edge back
        graph[name] = {m for m in own if not (m.startswith(name + ".") and path.name == "__init__.py")}
    return graph


def _cycles(graph: dict) -> list:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_is_read():
    g = _graph()
    assert "moajax.onf" in g["moajax.tiles.ranges"] and "moajax.onf" in g["moajax.cost"]
    assert "moajax.tiles.operands" in g["pallas_kernels.lower"] and "moajax.tiles.operands" in g["moajax.lower_xla"]


def test_no_module_imports_one_that_imports_it_back():
    assert _cycles(_graph()) == []


def test_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("name", sorted(_modules()))
def test_private_jax_and_pallas_stay_in_their_rooms(name):
    imports = _imports(_modules()[name], _modules())
    if name != "moajax.compat":
        assert not {m for m in imports if m.startswith("jax._src")}, f"{name} imports JAX internals; go through moajax.compat"
    if not name.startswith("pallas_kernels"):
        assert not {m for m in imports if m.startswith("jax.experimental.pallas")}, f"{name} imports Pallas"


def test_the_cost_model_needs_no_evaluator():
    g = _graph()
    assert not g["moajax.cost"] & {"moajax.reference", "moajax.tiles", "moajax.lower_xla"}
