"""The packages load each other only downwards, and no modules load each other in a loop.

The order is the picture in docs/architecture.md: the packages' LAYERS, and inside a package of
SUBLAYERS (resilience: one subpackage per process) its subpackages'. Every way code is loaded counts, at any depth
of a file: `import` statements (a lazy import that hides a loop is still a loop), module names
given as strings (`importlib.import_module("megascale...")`, `__import__`, lazy export tables
such as `_EXPORTS` in an `__init__.py`), and `python -m megascale...` commands a module starts
(`-m megascale.cli train` is the module of the `train` subcommand). A module name computed at
run time (`f"megascale.{x}"`, a non-literal `import_module` argument) cannot be checked, so it is
allowed only in the modules `DYNAMIC` names. The few sanctioned loads against the order are in
`ALLOWED`, each with its reason; an entry nobody needs any more fails too.
"""

from __future__ import annotations

import ast
import functools
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "megascale"

# Bottom to top. A package may load packages of lower layers only; packages of one layer are
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
TOP_LEVEL = "megascale.cli"  # dispatches to every command
# Inside these packages the subpackages are layered the same way, bottom to top, and the package
# holds no module outside them. resilience: one subpackage per process, over what they share.
# The driver starts executors (local mode), an executor starts ranks and self-checks: processes
# started are above the processes that start them only as `-m` commands, never imports.
SUBLAYERS: dict[str, list[set[str]]] = {
    "resilience": [{"common"}, {"rank", "selfcheck"}, {"executor"}, {"driver"}],
}

# (loading module, loaded module) -> why this load against the layer order is sanctioned
ALLOWED: dict[tuple[str, str], str] = {
    (
        "megascale.resilience.executor.ranks",
        "megascale.train.cli",
    ): "an executor's warm standby ranks are forks of `megascale train --standby-server`: the rank is "
    "the top of the stack, started across a process boundary; resilience imports nothing of train",
}
# module -> why it may load a module whose name is computed at run time
DYNAMIC: dict[str, str] = {
    "megascale.cli": "imports the module of the subcommand asked for, from its SUBCOMMANDS table",
    "megascale.data": "resolves a name of its lazy _EXPORTS table (whose entries are checked here)",
}

MODULE = re.compile(r"megascale(?:\.\w+)+")
COMMAND = re.compile(r"-m\s+(megascale(?:\.\w+)+)(?:\s+([\w-]+))?")
PREFIX = re.compile(r"megascale(?:\.\w+)*\.")  # the constant start of a computed name
LOADERS = {"import_module", "__import__", "run_module", "find_spec"}


@dataclass(frozen=True)
class Load:
    source: str  # the loading module
    target: str  # the loaded module ("?" when computed at run time)
    how: str  # "import", "string" (in this process), "process" (`-m` command), "dynamic"
    line: int

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} ({self.how}, line {self.line})"


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(root: Path, name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (root / rel).with_suffix(".py").exists() or (root / rel / "__init__.py").exists()


def subcommands(root: Path) -> dict[str, str]:
    """`megascale NAME` -> the module it runs, read from cli.py's SUBCOMMANDS table."""
    for node in ast.walk(ast.parse((root / "cli.py").read_text())):
        if isinstance(node, ast.AnnAssign | ast.Assign) and isinstance(node.value, ast.Dict):
            names = [
                t.id
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                if isinstance(t, ast.Name)
            ]
            if names == ["SUBCOMMANDS"]:
                return {
                    k.value: v.elts[0].value
                    for k, v in zip(node.value.keys, node.value.values, strict=True)
                    if isinstance(k, ast.Constant) and isinstance(v, ast.Tuple)
                }
    return {}


def _longest_module(root: Path, dotted: str) -> str | None:
    parts = dotted.split(".")
    for end in range(len(parts), 1, -1):
        if is_module(root, ".".join(parts[:end])):
            return ".".join(parts[:end])
    return None


def _call_name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


class _Loads(ast.NodeVisitor):
    """Every load of a megascale module in one file (parents are visited before their children,
    so an argv or a logger call marks its strings before they are read as module names)."""

    def __init__(self, root: Path, path: Path, commands: dict[str, str]) -> None:
        self.root, self.commands = root, commands
        self.module = module_name(root, path)
        self.package = self.module if path.name == "__init__.py" else self.module.rpartition(".")[0]
        self.found: list[Load] = []
        self.skip: set[int] = set()  # string constants already accounted for, or not loads

    def add(self, target: str, how: str, node: ast.AST) -> None:
        self.found.append(Load(self.module, target, how, getattr(node, "lineno", 0)))

    def command(self, name: str, sub: str | None, node: ast.AST) -> None:
        if name == TOP_LEVEL and sub in self.commands:
            name = self.commands[sub]
        if (target := _longest_module(self.root, name)) is not None:
            self.add(target, "process", node)

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.name.startswith("megascale."):
                self.add(a.name, "import", node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:  # relative: `from .x import y` inside the package
            parts = self.package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
        if base.startswith("megascale"):
            for a in node.names:
                name = f"{base}.{a.name}"
                self.add(name if is_module(self.root, name) else base, "import", node)

    def visit_Call(self, node: ast.Call) -> None:
        first = node.args[0] if node.args else None
        if _call_name(node) == "getLogger" and isinstance(first, ast.Constant):
            self.skip.add(id(first))  # a logger's name, not a module
        elif _call_name(node) in LOADERS and first is not None and not isinstance(first, ast.Constant):
            self.add("?", "dynamic", node)
        self.generic_visit(node)

    def visit_List(self, node: ast.List | ast.Tuple) -> None:
        """An argv: [python, "-m", "megascale.x", "sub", ...]."""
        items = [e.value if isinstance(e, ast.Constant) and isinstance(e.value, str) else None for e in node.elts]
        for i, item in enumerate(items):
            if item and i and items[i - 1] == "-m" and MODULE.fullmatch(item):
                self.command(item, items[i + 1] if i + 1 < len(items) else None, node)
                self.skip.add(id(node.elts[i]))
        self.generic_visit(node)

    visit_Tuple = visit_List

    def visit_Constant(self, node: ast.Constant) -> None:
        if not isinstance(node.value, str) or id(node) in self.skip:
            return
        name = node.value.split(":")[0]
        target = _longest_module(self.root, name) if MODULE.fullmatch(name) else None
        if target is not None and target != self.module and not self.module.startswith(target + "."):
            self.add(target, "string", node)  # a module's own packages are loaded before it anyway
        elif PREFIX.fullmatch(node.value):
            self.add("?", "dynamic", node)
        for match in COMMAND.finditer(node.value):
            self.command(match.group(1), match.group(2), node)


def loads_of(root: Path, path: Path, commands: dict[str, str]) -> list[Load]:
    """Every load of a megascale module in the file at `path`."""
    visitor = _Loads(root, path, commands)
    visitor.visit(ast.parse(path.read_text(), str(path)))
    return visitor.found


def all_loads(root: Path = PACKAGE) -> list[Load]:
    commands = subcommands(root)
    return [load for p in sorted(root.rglob("*.py")) for load in loads_of(root, p, commands)]


@functools.cache
def tree_loads() -> tuple[Load, ...]:
    return tuple(all_loads())


def _layer_of(module: str) -> int | None:
    top = module.split(".")[1] if module.count(".") else ""
    for i, layer in enumerate(LAYERS):
        if top in layer:
            return i
    return None


def _sublayer_of(module: str) -> int | None:
    """The layer of `module`'s subpackage inside a package of SUBLAYERS (None: no layer)."""
    parts = module.split(".")
    for i, layer in enumerate(SUBLAYERS.get(parts[1], []) if len(parts) > 2 else []):
        if parts[2] in layer:
            return i
    return None


def against_the_order(loads: list[Load]) -> list[Load]:
    """Loads of a package of the same or a higher layer (or of no layer), and inside a package of
    SUBLAYERS loads of a sibling subpackage of the same or a higher layer, less the sanctioned ones."""
    wrong = []
    for load in loads:
        if load.source == TOP_LEVEL or load.how == "dynamic" or (load.source, load.target) in ALLOWED:
            continue
        source, target = load.source.split("."), load.target.split(".")
        if source[:2] != target[:2]:
            mine, theirs = _layer_of(load.source), _layer_of(load.target)
        elif source[1:2] and source[1] in SUBLAYERS and len(target) > 2 and source[:3] != target[:3]:
            mine, theirs = _sublayer_of(load.source), _sublayer_of(load.target)
        else:
            continue  # inside one package (or one subpackage of a layered one)
        if theirs is None or mine is None or theirs >= mine:
            wrong.append(load)
    return wrong


def unsanctioned_dynamic(loads: list[Load]) -> list[Load]:
    return [load for load in loads if load.how == "dynamic" and load.source not in DYNAMIC]


def cycles(loads: list[Load]) -> list[str]:
    """Loops among in-process loads (a `-m` command runs in another process: no loop)."""
    graph: dict[str, set[str]] = {}
    for load in loads:
        graph.setdefault(load.source, set())
        if load.how in ("import", "string"):
            graph[load.source].add(load.target)
    found: list[str] = []
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                found.append(" -> ".join(path[path.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def problems(root: Path = PACKAGE) -> list[str]:
    loads = all_loads(root)
    return (
        [f"against the layer order: {x}" for x in against_the_order(loads)]
        + [f"computed module name outside DYNAMIC: {x}" for x in unsanctioned_dynamic(loads)]
        + [f"loop: {c}" for c in cycles(loads)]
    )


def test_every_package_has_a_layer():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert packages == set().union(*LAYERS), "add the new package to LAYERS and to docs/architecture.md"
    for package, layers in SUBLAYERS.items():
        inside = {p.name for p in (PACKAGE / package).iterdir() if p.name != "__pycache__"}
        subpackages = {p for p in inside if (PACKAGE / package / p / "__init__.py").exists()}
        assert subpackages == set().union(*layers), f"add the new subpackage to SUBLAYERS[{package!r}]"
        assert inside - subpackages == {"__init__.py"}, f"modules of {package}/ belong in one of its subpackages"


def test_the_architecture_page_names_every_package_and_subpackage():
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    names = set().union(*LAYERS) | {sub for layers in SUBLAYERS.values() for sub in set().union(*layers)}
    missing = sorted(name for name in names if f"{name}/" not in text)
    assert not missing, f"docs/architecture.md does not show {missing}"


def test_packages_load_only_downwards():
    wrong = against_the_order(list(tree_loads()))
    assert not wrong, "loads against the layer order (docs/architecture.md):\n" + "\n".join(map(str, wrong))


def test_computed_module_names_only_where_sanctioned():
    wrong = unsanctioned_dynamic(list(tree_loads()))
    assert not wrong, "module names computed at run time (name them literally):\n" + "\n".join(map(str, wrong))


def test_no_load_cycles_between_modules():
    found = cycles(list(tree_loads()))
    assert not found, "modules loading each other in a loop:\n" + "\n".join(found)


def test_every_sanctioned_place_is_still_used():
    loads = tree_loads()
    pairs = {(x.source, x.target) for x in loads}
    dynamic = {x.source for x in loads if x.how == "dynamic"}
    assert set(ALLOWED) <= pairs, f"ALLOWED entries nothing needs: {sorted(set(ALLOWED) - pairs)}"
    assert set(DYNAMIC) <= dynamic, f"DYNAMIC entries nothing needs: {sorted(set(DYNAMIC) - dynamic)}"


def test_the_loads_that_are_there_are_seen():
    """The checker sees the tree's real string and command loads (so a bypass would be seen too)."""
    seen = {(x.source, x.target, x.how) for x in tree_loads()}
    assert ("megascale.data", "megascale.data.loader", "string") in seen  # the _EXPORTS table
    assert ("megascale.cli", "megascale.train.cli", "string") in seen  # SUBCOMMANDS
    assert ("megascale.resilience.executor.ranks", "megascale.train.cli", "process") in seen  # -m megascale.cli train
    assert ("megascale.checkpoint.stage2", "megascale.checkpoint.writer", "process") in seen


# Each way around the rule, planted in a copy of the package: (file, text appended or (old, new)).
IMPORTLIB = "\nimport importlib\n"
BYPASSES = {
    "plain import": ("layout/grid.py", "\n\ndef _f():\n    from megascale.train import trainer\n"),
    "import_module": ("layout/grid.py", IMPORTLIB + '_T = importlib.import_module("megascale.train.trainer")\n'),
    "__import__": ("layout/grid.py", '\n_T = __import__("megascale.train.trainer")\n'),
    "computed name": ("layout/grid.py", IMPORTLIB + '_T = importlib.import_module(f"megascale.{DIMS[0]}")\n'),
    "computed name, concatenated": ("layout/grid.py", IMPORTLIB + '_T = importlib.import_module("megascale." + "x")\n'),
    "lazy export table": ("data/__init__.py", ("_EXPORTS = {", '_EXPORTS = {"Trainer": "megascale.train.trainer", ')),
    "-m megascale.cli train, elsewhere": (
        "resilience/rank/faults.py",
        '\nARGV = ("python", "-m", "megascale.cli", "train", "--standby-server")\n',
    ),
    "-m in a shell line": ("checkpoint/writer.py", '\nCMD = "python -m megascale.cli launch --nodes 2"\n'),
    "module:attr string": ("model/flops.py", '\nENTRY = "megascale.parallel.engine:build_runner"\n'),
    "executor imports the driver": (
        "resilience/executor/ranks.py",
        "\n\ndef _f():\n    from megascale.resilience.driver import state\n",
    ),
    "rank imports its executor": ("resilience/rank/faults.py", "\nfrom megascale.resilience.executor import ranks\n"),
    "common imports a process": ("resilience/common/api.py", '\nENTRY = "megascale.resilience.driver.cli"\n'),
    "string import loop": ("config/fields.py", IMPORTLIB + '_L = importlib.import_module("megascale.config.loader")\n'),
}


@pytest.mark.slow  # each plants a bypass in a copy of the package and runs the whole rule
@pytest.mark.parametrize("name", sorted(BYPASSES))
def test_each_bypass_fails_the_rule(tmp_path: Path, name: str):
    root = tmp_path / "megascale"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__"))
    file, change = BYPASSES[name]
    path = root / file
    text = path.read_text()
    path.write_text(text.replace(*change, 1) if isinstance(change, tuple) else text + change)
    assert path.read_text() != text
    found = problems(root)
    assert found, f"{name} planted in {file} went unseen"
    assert all(module_name(root, path) in line for line in found), found
