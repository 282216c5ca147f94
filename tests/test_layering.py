"""The packages import each other only downwards, and no modules import each other in a loop.

The order is the picture in docs/architecture.md. Every `import` counts, including those inside
functions: a lazy import that hides a loop is still a loop.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megascale"

# Bottom to top. A package may import packages of lower layers only; packages of one layer are
# independent of each other.
LAYERS: list[set[str]] = [
    {"config"},
    {"layout"},
    {"model", "optim", "data"},
    {"diagnostics"},
    {"parallel", "plan"},
    {"checkpoint"},
    {"resilience", "interop"},
    {"train", "testing"},
]
TOP_LEVEL = {"cli"}  # megascale/cli.py dispatches to every command


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every megascale module `path` imports, at any depth of the file."""
    found = set()
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("megascale."))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from .x import y` inside `package`
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            if base.startswith("megascale"):
                found.update(f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base for a in node.names)
    return found


def _is_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (PACKAGE / rel).with_suffix(".py").exists() or (PACKAGE / rel / "__init__.py").exists()


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py")}


def _layer_of(module: str) -> int | None:
    top = module.split(".")[1] if module.count(".") else ""
    for i, layer in enumerate(LAYERS):
        if top in layer:
            return i
    return None


def test_every_package_has_a_layer():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert packages == set().union(*LAYERS), "add the new package to LAYERS and to docs/architecture.md"


def test_packages_import_only_downwards():
    wrong = []
    for module, imports in _graph().items():
        if module.split(".")[-1] in TOP_LEVEL and module.count(".") == 1:
            continue
        mine = _layer_of(module)
        for target in imports:
            theirs = _layer_of(target)
            same_package = target.split(".")[1] == module.split(".")[1]
            if not same_package and (theirs is None or mine is None or theirs >= mine):
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports against the layer order (docs/architecture.md):\n" + "\n".join(sorted(wrong))


def test_no_import_cycles_between_modules():
    graph = _graph()
    cycles = []
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "modules importing each other in a loop:\n" + "\n".join(cycles)
