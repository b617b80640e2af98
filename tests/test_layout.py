"""The package's layout stays as docs/architecture.md draws it: no import cycle between
modules, the packages import one way, and the root holds the public face only.

Every import statement counts, wherever it is: at the top, inside a function, or
under `if TYPE_CHECKING` (an import moved into a function to dodge a cycle is still
a cycle, and editors follow the type-checking ones).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "notebook_accel"

# What each package may import (besides itself). docs/architecture.md draws it.
MAY_IMPORT: dict[str, set[str]] = {
    "internals": set(),
    "config": set(),
    "platforms": {"config", "internals"},
    "reporting": {"config"},
    "training": {"config", "platforms", "reporting", "internals"},
    "checkpoint": {"config", "training"},
    "accelerator": {"config", "platforms", "reporting", "training", "checkpoint", "big_modeling"},
    "big_modeling": {"training", "platforms", "internals"},
    "views": {"reporting"},
    "launch": {"config", "platforms", "reporting", "training", "views"},
    "live": {"config", "platforms", "reporting", "training", "views", "launch", "internals"},
    "ui": {"config", "platforms", "reporting", "launch", "views"},
}
# The root: the public names, imported lazily, the command line, the demo, and the
# public module paths (Accelerate's, which ported code imports, and two helper
# modules of ours), each a lazy re-export.
PUBLIC_FACE = {
    *("__init__", "_lazy", "utils", "cli", "demo"),
    *("logging", "local_sgd", "tracking", "state", "hooks", "data_loader"),
    *("text", "footprint"),
}
# Root modules every layer may use: they import only the standard library.
ROOT_UTILITIES = {"notebook_accel._lazy"}


def module_names() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports, by any import statement in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            # `from package import module` imports that module; `from module import name`,
            # the module
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(edges):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def package_of(module: str) -> str | None:
    """The package a module belongs to, or None for the root's own modules."""
    parts = module.split(".")
    if len(parts) == 2 and (PACKAGE / parts[1] / "__init__.py").exists():
        return parts[1]
    return parts[1] if len(parts) > 2 else None


def test_no_module_imports_itself_back_through_others():
    assert find_cycle(graph()) is None, " -> ".join(find_cycle(graph()) or [])


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_packages_import_only_the_layers_below_them():
    wrong = []
    for module, targets in graph().items():
        source = package_of(module)
        if source is None:  # the public face may import anything, lazily
            continue
        for target in targets:
            destination = package_of(target)
            if destination is None and target in ROOT_UTILITIES:
                continue
            if destination is None and target != "notebook_accel":
                wrong.append(f"{module} imports the root's {target}")
            elif target == "notebook_accel":
                wrong.append(f"{module} imports the package root (the public face)")
            elif destination != source and destination not in MAY_IMPORT[source]:
                wrong.append(f"{module} ({source}) imports {target} ({destination})")
    assert wrong == []


def test_every_package_is_in_the_layers_and_says_what_it_holds():
    packages = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    assert packages == set(MAY_IMPORT)
    for package in packages:
        doc = ast.get_docstring(ast.parse((PACKAGE / package / "__init__.py").read_text()))
        assert doc and "May import:" in doc, package


def test_the_root_holds_the_public_face_only():
    assert {path.stem for path in PACKAGE.glob("*.py")} == PUBLIC_FACE


def runtime_imports_of_init(path: Path, package: str) -> list[str]:
    """The package's modules an `__init__.py` imports when it runs: its top-level import
    statements, less those under `if TYPE_CHECKING:` (functions run later)."""
    found = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for inner in ast.walk(node):
            if isinstance(inner, ast.ImportFrom) and inner.level:
                found.append("." * inner.level + (inner.module or ""))
            elif isinstance(inner, ast.ImportFrom) and inner.module:
                found.append(inner.module)
            elif isinstance(inner, ast.Import):
                found += [alias.name for alias in inner.names]
            if isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                break
    return [name for name in found if name.startswith(".") or name.startswith(package + ".")]


def test_no_package_imports_its_own_modules_when_it_is_imported():
    """A package whose `__init__` imports its own modules can deadlock against a thread
    that imports one of them first (python/cpython#83065; tests/test_import_race.py
    races it): packages re-export lazily (notebook_accel/_lazy.py)."""
    wrong = []
    for name, path in module_names().items():
        if path.name == "__init__.py":
            wrong += [f"{name} imports {target}" for target in runtime_imports_of_init(path, name)]
    assert wrong == []


def test_the_init_import_finder_sees_what_runs_and_not_what_waits(tmp_path: Path):
    path = tmp_path / "__init__.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "from pkg.a import b\n"
        "import other\n"
        "if TYPE_CHECKING:\n    from pkg.c import d\n"
        "def later():\n    from pkg.e import f\n"
    )
    assert runtime_imports_of_init(path, "pkg") == ["pkg.a"]
