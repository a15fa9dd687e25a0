"""moetrain's modules import each other without a circle and only downwards through the layers
(the runtime never imports a tool), and stay within the size rule.

The graph is read from the source (ast), not by importing: every `import` and `from ... import`
of a moetrain module, in function bodies too (a lazy import that closes a circle still ties two
modules into one), but not under `if TYPE_CHECKING:`. `from package import name` is an edge to
the submodule when `name` is one, else to the package's `__init__`."""

from __future__ import annotations

import ast
from pathlib import Path

import moetrain

ROOT = Path(moetrain.__file__).parent
MAX_LINES = 500


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]  # fmt: skip
    type_checking = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for stmt in block.body
        for node in ast.walk(stmt)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_checking:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                      for alias in node.names}  # fmt: skip
    return {name for name in found if name in modules}


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(paths)
    return {name: imports_of(path, modules) - {name} for name, path in paths.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    assert circles(import_graph()) == []


def test_the_check_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_no_module_over_500_lines():
    long = {module_name(p): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}  # fmt: skip
    assert long == {}


# The layers, lowest first: a module imports only modules of its own layer or lower ones. The
# training runtime (everything below `moetrain.tools`) never imports a tool.
LAYERS = [
    (
        "moetrain.config",
        "moetrain.kernels",
        "moetrain.dist_compat",
        "moetrain.faults",
        "moetrain.optional_packages",
    ),
    ("moetrain.nn", "moetrain.data"),
    ("moetrain.moe",),
    ("moetrain.model",),
    ("moetrain.optim",),
    ("moetrain.parallel",),
    ("moetrain.checkpoint",),
    ("moetrain.train",),
    ("moetrain.tools",),
    ("moetrain.cli", "moetrain.__main__", "moetrain"),
]


def layer_of(module: str) -> int:
    """The index in LAYERS of a module's longest matching prefix."""
    matches = [
        (len(prefix), i)
        for i, prefixes in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    assert matches, f"{module} belongs to no layer: add it to LAYERS"
    return max(matches)[1]


def upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a lower layer to a higher one (within a layer, the circle test rules)."""
    return [
        f"{module} -> {other}"
        for module, imported in sorted(graph.items())
        for other in sorted(imported)
        if layer_of(other) > layer_of(module)
    ]


def test_no_arrow_from_a_lower_layer_to_a_higher_one():
    assert upward_arrows(import_graph()) == []


def test_the_check_finds_an_upward_arrow():
    graph = {
        "moetrain.nn.norm": {"moetrain.kernels.topk"},
        "moetrain.optim.sharded": {"moetrain.parallel.comm"},
        "moetrain.train.fits": {"moetrain.tools.plan.memory"},
        "moetrain.data.tasks": {"moetrain.nn.norm", "moetrain.config.presets"},
    }
    assert upward_arrows(graph) == [
        "moetrain.optim.sharded -> moetrain.parallel.comm",
        "moetrain.train.fits -> moetrain.tools.plan.memory",
    ]
