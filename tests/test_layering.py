"""The import graph of kdtree_jax and pallas_kernels, read from the source with `ast` (every import statement, those
inside functions included): no cycles, the kernels import nothing from kdtree_jax, no runtime module imports the
training code, and a function-level import only where an optional dependency needs it (docs/DESIGN.md, Modules)."""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("kdtree_jax", "pallas_kernels")
TRAIN = "kdtree_jax.train"
# third-party packages outside the runtime dependencies: imported where they are used, so the rest loads without them
OPTIONAL = {"matplotlib", "optax", "tokenizers", "torch", "transformers", "triton"}


def _modules() -> dict[str, str]:
    """Dotted module name -> file, for every .py of the two packages (a package is its __init__.py)."""
    out = {}
    for pkg in PACKAGES:
        for dirpath, _, names in os.walk(os.path.join(ROOT, pkg)):
            for name in names:
                if name.endswith(".py"):
                    parts = os.path.relpath(os.path.join(dirpath, name), ROOT)[:-3].split(os.sep)
                    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = os.path.join(dirpath, name)
    return out


MODULES = _modules()


def _imports(module: str) -> list[tuple[str, int, bool]]:
    """(imported name, line, at module level) for every import in `module`; `from a import b` yields a.b."""
    path = MODULES[module]
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    top = {id(node) for node in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package up
                pkg = module if path.endswith("__init__.py") else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    pkg = pkg.rpartition(".")[0]
                base = f"{pkg}.{base}" if base else pkg
            names = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out.extend((name, node.lineno, id(node) in top) for name in names)
    return out


def _resolve(name: str) -> str | None:
    """The project module an imported name lives in (`kdtree_jax.model.moe.route` -> `kdtree_jax.model.moe`), else None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {project module it imports: line of the first such import}. A submodule's implicit import of its
    parent package is not an edge (Python binds a partly initialised parent without running it again)."""
    graph = {}
    for module in MODULES:
        edges = graph.setdefault(module, {})
        for name, line, _ in _imports(module):
            dep = _resolve(name)
            if dep is not None and dep != module:
                edges.setdefault(dep, line)
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str]:
    """One import cycle as [a, b, ..., a], or [] when the graph has none."""
    state: dict[str, int] = {}  # 1 on the DFS stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def _where(module: str, dep: str, graph) -> str:
    return f"{os.path.relpath(MODULES[module], ROOT)}:{graph[module][dep]} imports {dep}"


def test_graph_covers_both_packages():
    graph = import_graph()
    assert {"kdtree_jax.model.target", "kdtree_jax.train", "pallas_kernels.verify_attn"} <= graph.keys()
    assert "kdtree_jax.model.layers" in graph["kdtree_jax.model.mla"]  # an edge the reader must see


def test_no_import_cycles():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert not cycle, "import cycle: " + " -> ".join(cycle) + "; " + "; ".join(
        _where(a, b, graph) for a, b in zip(cycle, cycle[1:]))


def test_find_cycle_reports_one():
    assert find_cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 1}, "b": {}, "c": {"a": 1, "b": 1}}) == []


def test_kernels_import_nothing_from_kdtree_jax():
    graph = import_graph()
    bad = [_where(m, d, graph) for m in graph if m.startswith("pallas_kernels") for d in graph[m]
           if d.split(".")[0] == "kdtree_jax"]
    assert not bad, bad


def test_runtime_modules_do_not_import_the_training_code():
    graph = import_graph()
    bad = [_where(m, d, graph) for m in graph if not (m == TRAIN or m.startswith(TRAIN + "."))
           for d in graph[m] if d == TRAIN or d.startswith(TRAIN + ".")]
    assert not bad, bad


def test_function_level_imports_only_for_optional_dependencies():
    bad = [f"{os.path.relpath(MODULES[m], ROOT)}:{line} imports {name}"
           for m in MODULES for name, line, top in _imports(m) if not top and name.split(".")[0] not in OPTIONAL]
    assert not bad, "import these at the top of the module: " + "; ".join(sorted(bad))


# The parts of kdtree_jax, lowest first: a part imports only from parts below it (docs/DESIGN.md, Modules). The
# `python -m` entry points and the shared CLI flags sit at the top level, above every part.
PARTS = ("parallel", "model", "checkpoint", "constrain", "decode", "oracles", "serving", "server", "train")


def _part(module: str) -> str | None:
    """`kdtree_jax.model.mla` -> "model"; None for pallas_kernels and the top-level modules."""
    parts = module.split(".")
    if parts[0] != "kdtree_jax" or len(parts) < 2 or parts[1] not in PARTS:
        return None
    return parts[1]


def test_every_kdtree_jax_module_belongs_to_a_part_or_is_an_entry_point():
    top = {m for m in MODULES if m.startswith("kdtree_jax.") and _part(m) is None}
    assert top == {"kdtree_jax.cli", "kdtree_jax.convert", "kdtree_jax.generate", "kdtree_jax.serve"}, top


def test_parts_import_only_downward():
    graph = import_graph()
    rank = {p: i for i, p in enumerate(PARTS)}
    bad = [_where(m, d, graph) for m in graph for d in graph[m]
           if _part(m) and _part(d) and rank[_part(d)] > rank[_part(m)]]
    bad += [_where(m, d, graph) for m in graph for d in graph[m]
            if _part(m) and d.startswith("kdtree_jax") and d != "kdtree_jax" and _part(d) is None]
    assert not bad, "a part imports from a part above it: " + "; ".join(sorted(bad))
