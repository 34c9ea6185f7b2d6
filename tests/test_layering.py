"""Imports go downward only, in the order docs/architecture.md gives, and no modules
import each other in a circle.

Every `import` of a kvserve module, at any depth of a file (functions included), is
checked: against the layer order (no file may import a package above its own, nor
below the top layer one of its own layer; there are no exceptions), and for circles
between modules, inside a package or across packages, lazy imports included. Imports
under `if TYPE_CHECKING:` do not run and are not counted.
"""
from __future__ import annotations

import ast
from pathlib import Path

import kvserve

PACKAGE_DIR = Path(kvserve.__file__).parent

# Top first. Below the top layer, a package imports no other package of its own layer.
LAYERS = [
    {"cli", "server", "bench", "planner", "testing", "__init__", "__main__"},
    {"engine"},
    {"worker"},
    {"model", "scheduler"},
    {"sample"},
    {"messages", "spec_decode"},
    {"kv_cache"},
    {"config", "request"},
    {"native"},
    {"sampling_params"},
    {"errors", "paths"},
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def _top_level(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "kvserve" and len(parts) > 1 else ("__init__" if module == "kvserve" else None)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_statements(tree: ast.AST):
    """The import statements that can run (TYPE_CHECKING blocks skipped), at any depth."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from (m for child in node.orelse for m in _import_statements(ast.Module([child], [])))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _import_statements(node)


def _imports(tree: ast.AST):
    """Modules imported: `from a import b` counts as a.b where b is a module of its own."""
    for node in _import_statements(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif node.module and node.level == 0:
            submodules = [f"{node.module}.{alias.name}" for alias in node.names
                          if _module_path(f"{node.module}.{alias.name}") is not None]
            if node.module != "kvserve" or len(submodules) < len(node.names):  # `from kvserve import LLM`
                yield node.module
            yield from submodules


def _module_path(module: str) -> Path | None:
    """The file of a kvserve module, or None when it is not one."""
    parts = module.split(".")
    if parts[0] != "kvserve":
        return None
    base = PACKAGE_DIR.joinpath(*parts[1:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """kvserve module -> the kvserve modules it imports."""
    graph = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        name = _module_name(path)
        imported = {m for m in _imports(ast.parse(path.read_text(), str(path))) if _module_path(m) is not None}
        graph[name] = imported - {name, "kvserve"}
    return graph


def upward_imports() -> list[str]:
    found = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        relative = path.relative_to(PACKAGE_DIR)
        own = relative.parts[0].removesuffix(".py")
        for module in _imports(ast.parse(path.read_text(), str(path))):
            target = _top_level(module)
            if target is None or target == own or target not in RANK:
                continue
            if RANK[target] < RANK[own] or (RANK[target] == RANK[own] and RANK[own] > 0):
                found.append(f"{relative} imports {module} ({own} may not import {target})")
    return sorted(set(found))


def import_circles() -> list[list[str]]:
    """Every set of modules that import each other, directly or through others (Tarjan's
    strongly connected components of more than one module), each sorted."""
    graph = _import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(circles)


def test_every_package_has_a_layer():
    packages = {p.name.removesuffix(".py") for p in PACKAGE_DIR.iterdir()
                if (p.suffix == ".py" or (p / "__init__.py").exists())}
    assert packages <= set(RANK), f"packages missing from the layer order: {sorted(packages - set(RANK))}"


def test_imports_go_downward_only():
    assert upward_imports() == []


def test_no_import_circles():
    assert import_circles() == []


def _fake_package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "kvserve"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def _with_package_dir(root: Path, check):
    globals()["PACKAGE_DIR"] = root
    try:
        return check()
    finally:
        globals()["PACKAGE_DIR"] = Path(kvserve.__file__).parent


def test_the_walker_sees_an_upward_import(tmp_path):
    """The check itself: a scheduler module importing the model is reported, whichever file
    of the scheduler it is in and however deep in a function."""
    root = _fake_package(tmp_path, {"scheduler/bad.py": (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from kvserve.engine.core import EngineCore\n"
        "def f():\n    from kvserve.worker.model_runner import ModelRunner\n"
        "def g():\n    from kvserve.model import decoder\n")})
    assert _with_package_dir(root, upward_imports) == [
        "scheduler/bad.py imports kvserve.model (scheduler may not import model)",
        "scheduler/bad.py imports kvserve.worker.model_runner (scheduler may not import worker)"]


def test_the_walker_sees_a_circle_inside_a_package(tmp_path):
    """Two worker modules that import each other, one of them lazily and as `from package
    import module`, are a circle; a TYPE_CHECKING import back is not."""
    root = _fake_package(tmp_path, {
        "worker/__init__.py": "",
        "worker/a.py": "from kvserve.worker.b import B\n",
        "worker/b.py": "def f():\n    from kvserve.worker import a\n",
        "worker/c.py": "from kvserve.worker.a import A\n",
        "worker/d.py": ("from typing import TYPE_CHECKING\n"
                        "if TYPE_CHECKING:\n    from kvserve.worker.c import C\n"),
    })
    assert _with_package_dir(root, import_circles) == [["kvserve.worker.a", "kvserve.worker.b"]]
