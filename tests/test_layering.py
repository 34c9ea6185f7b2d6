"""Imports go downward only, in the order docs/architecture.md gives.

Every `import` of a kvserve module, at any depth of a file (functions
included), is checked against the layer order; imports under
`if TYPE_CHECKING:` do not run and are not counted.
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
    {"native"},
    {"config", "request"},
    {"sampling_params"},
    {"errors"},
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}

# (importing file, imported top-level package): config builds these configs in
# EngineConfig.create from the user's knobs (and EngineConfig's kernel switches
# default to `native.config.KernelConfig.from_env`).
ALLOWED_UPWARD = {
    ("config.py", "model"), ("config.py", "kv_cache"), ("config.py", "spec_decode"), ("config.py", "native"),
}


def _top_level(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "kvserve" and len(parts) > 1 else ("__init__" if module == "kvserve" else None)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Modules imported by the statements that can run (TYPE_CHECKING blocks skipped)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from (m for child in node.orelse for m in _imports(ast.Module([child], [])))
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "kvserve":  # `from kvserve import x`: x's own module when it is one
                yield from (f"kvserve.{alias.name}" if alias.name in RANK else "kvserve" for alias in node.names)
            else:
                yield node.module
        yield from _imports(node)


def upward_imports() -> list[str]:
    found = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        relative = path.relative_to(PACKAGE_DIR)
        own = relative.parts[0].removesuffix(".py")
        for module in _imports(ast.parse(path.read_text(), str(path))):
            target = _top_level(module)
            if target is None or target == own or target not in RANK:
                continue
            upward = RANK[target] < RANK[own] or (RANK[target] == RANK[own] and RANK[own] > 0)
            if upward and (str(relative), target) not in ALLOWED_UPWARD:
                found.append(f"{relative} imports {module} ({own} may not import {target})")
    return found


def test_every_package_has_a_layer():
    packages = {p.name.removesuffix(".py") for p in PACKAGE_DIR.iterdir()
                if (p.suffix == ".py" or (p / "__init__.py").exists())}
    assert packages <= set(RANK), f"packages missing from the layer order: {sorted(packages - set(RANK))}"


def test_imports_go_downward_only():
    assert upward_imports() == []


def test_the_walker_sees_an_upward_import(tmp_path):
    """The check itself: a scheduler module importing the model is reported."""
    fake_root = tmp_path / "kvserve"
    (fake_root / "scheduler").mkdir(parents=True)
    (fake_root / "scheduler" / "bad.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from kvserve.engine.core import EngineCore\n"
        "def f():\n    from kvserve.model.sampler import Sampler\n")
    globals()["PACKAGE_DIR"] = fake_root
    try:
        assert upward_imports() == [
            "scheduler/bad.py imports kvserve.model.sampler (scheduler may not import model)"]
    finally:
        globals()["PACKAGE_DIR"] = Path(kvserve.__file__).parent
