"""The package layout holds: folders import only downward along the data flow, no import cycle (function-level
imports included), at most 8 modules in the package root, no test fixtures in production code."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "mgmt" / "hypafilter"
# The flow, top of the stack last: a module may import from its own folder and from any folder before it.
LAYERS = ("root", "ir", "iptables", "analysis", "optimize", "netfilter", "hw", "targets", "ops", "tools", "cli")
ROOT_MODULES_MAX = 8


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(path: Path, mods: dict[str, Path]) -> set[str]:
    """Every hypafilter module a file imports, at any depth of the file (functions included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "hypafilter":
            assert node.level == 0, f"{path}: relative import"
            for name in [node.module] + [f"{node.module}.{a.name}" for a in node.names]:
                if name in mods:
                    found.add(name)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in mods}
    return found


def _layer(mod: str) -> str:
    parts = mod.split(".")
    if parts[-1] == "__main__":  # `python -m hypafilter` is the command line
        return "cli"
    return "root" if len(parts) <= 2 and (len(parts) == 1 or parts[1] not in LAYERS) else parts[1]


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {m: _imports(p, mods) - {m} for m, p in mods.items()}
    for m, targets in graph.items():  # importing a.b.c runs a/__init__ and a/b/__init__ too
        for t in list(targets):
            parts = t.split(".")
            for i in range(2, len(parts)):
                parent = ".".join(parts[:i])
                if parent in mods and not m.startswith(parent + ".") and parent != m:
                    targets.add(parent)
    return graph


def test_imports_only_go_down_the_flow():
    upward = []
    for m, targets in _graph().items():
        for t in targets:
            if LAYERS.index(_layer(t)) > LAYERS.index(_layer(m)):
                upward.append(f"{m} -> {t}")
    assert not upward, "imports against the flow:\n" + "\n".join(sorted(upward))


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(t) :] + [t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_package_root_is_small():
    root = sorted(p.name for p in PKG.glob("*.py"))
    assert len(root) <= ROOT_MODULES_MAX, root


def test_every_layer_folder_is_a_package_with_a_docstring():
    for layer in LAYERS[1:]:
        init = PKG / layer / "__init__.py"
        assert init.is_file(), init
        assert ast.get_docstring(ast.parse(init.read_text())), f"{init} says nothing about what the folder is"


def test_no_fixtures_or_inert_markers_in_production_code():
    for p in PKG.rglob("*.py"):
        text = p.read_text()
        assert "noqa: PLC0415" not in text, f"{p}: inert noqa marker (PLC is not selected)"
        tree = ast.parse(text)
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert not names & {"make_rule", "make_policy", "listing1"}, f"{p}: test fixtures belong in tests/"
