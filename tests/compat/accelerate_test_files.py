"""Run test files of Accelerate's source repository both ways: as they are, and ported.

The tools accelerate_big_model_tests.py and accelerate_unit_tests.py share this: find
the files in a checkout, rewrite their `from accelerate... import X` lines (the one-line
port a user makes), run each set with pytest in a fresh interpreter, and print the
counts under each library and every test whose outcome differs.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Iterable
from pathlib import Path

# (accelerate module, imported name) -> the notebook_accel module to import it from, or None
Resolver = Callable[[str, str], "str | None"]


def find_test_files(paths: Iterable[str], names: Iterable[str]) -> list[Path]:
    """The test files named, or the files `names` in an Accelerate checkout (or its tests/)."""
    names = list(names)
    found: list[Path] = []
    for given in map(Path, paths):
        if given.is_file():
            found.append(given)
            continue
        folder = given / "tests" if (given / "tests").is_dir() else given
        files = [folder / name for name in names if (folder / name).is_file()]
        if not files:
            raise SystemExit(
                f"{given} holds none of {', '.join(names)}: pass an Accelerate source "
                "checkout, its tests/ folder, or the test files"
            )
        found += files
    return found


def _is_accelerate_import(node: ast.ImportFrom) -> bool:
    module = node.module or ""
    if node.level or not (module == "accelerate" or module.startswith("accelerate.")):
        return False
    return not module.startswith("accelerate.test_utils")  # the test fixtures stay


def port(source: str, resolve: Resolver) -> tuple[str, list[str], list[str]]:
    """`source` with each accelerate import that `resolve` places pointed at notebook_accel;
    returns (new source, names ported, accelerate names kept). Line numbers stay."""
    lines = source.splitlines()
    ported: list[str] = []
    kept: list[str] = []
    nodes = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)]
    for node in sorted(nodes, key=lambda n: n.lineno, reverse=True):
        if not _is_accelerate_import(node):
            continue
        ours: dict[str, list[ast.alias]] = {}
        theirs: list[ast.alias] = []
        for alias in node.names:
            target = resolve(node.module, alias.name)
            if target is None:
                theirs.append(alias)
                kept.append(f"{node.module}.{alias.name}")
            else:
                ours.setdefault(target, []).append(alias)
                ported.append(f"{node.module}.{alias.name}")
        if not ours:
            continue
        statements = [ast.ImportFrom(module=m, names=a, level=0) for m, a in ours.items()]
        if theirs:
            statements.append(ast.ImportFrom(module=node.module, names=theirs, level=0))
        indent = " " * node.col_offset
        first, last = node.lineno - 1, node.end_lineno
        # One line, then blank ones: every other line keeps its number.
        replaced = [indent + "; ".join(ast.unparse(s) for s in statements)]
        replaced += [""] * (last - first - 1)
        lines[first:last] = replaced
    return "\n".join(lines) + "\n", sorted(ported), sorted(kept)


def run_pytest(folder: Path, files: list[str], hide_gpus: bool, timeout: int) -> dict[str, str]:
    """pytest over `files` (or node ids in them) in `folder`, in a fresh interpreter:
    test id -> outcome."""
    report = folder / "report.xml"
    env = dict(os.environ)
    if hide_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    command = [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider"]
    command += ["-p", "no:randomly", f"--junitxml={report}", "-o", "junit_family=xunit2"]
    command += ["-o", f"timeout={timeout}", "--rootdir", str(folder)]
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True)
    if not report.exists():
        raise SystemExit(f"pytest did not run:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    outcomes: dict[str, str] = {}
    for case in ElementTree.parse(report).iter("testcase"):
        name = f"{case.get('classname', '')}.{case.get('name')}"
        verdict = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                text = (child.get("message") or "").strip().splitlines()
                verdict = f"{child.tag}: {text[0][:200] if text else ''}"
            elif child.tag == "skipped":
                verdict = "skipped"
        outcomes[name] = verdict
    return outcomes


def run_both_ways(
    files: list[Path],
    resolve: Resolver,
    hide_gpus: bool,
    conftest: str = "",
    timeout: int = 300,
    select: str = "",
) -> dict[str, dict[str, str]]:
    """library -> {test id -> outcome}: each file as it is, then ported by `resolve`.

    `conftest` is written beside the ported files: the fixture code that does for
    notebook_accel what Accelerate's own test case classes do for Accelerate. `select`
    runs one class (or test) of each file: "TestParallelismConfig".
    """
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for library in ("accelerate", "notebook_accel"):
            folder = Path(tmp, library)
            folder.mkdir()
            for path in files:
                source = path.read_text()
                if library == "notebook_accel":
                    source, ported, kept = port(source, resolve)
                    print(f"{path.name}: {len(ported)} names from notebook_accel; from accelerate:")
                    print("    " + (", ".join(kept) or "(none)"))
                    if conftest:
                        (folder / "conftest.py").write_text(conftest)
                (folder / path.name).write_text(source)
            targets = [f"{p.name}::{select}" if select else p.name for p in files]
            results[library] = run_pytest(folder, targets, hide_gpus, timeout)
    return results


def print_comparison(results: dict[str, dict[str, str]]) -> None:
    """The counts under each library, then each test whose outcome differs."""
    theirs, mine = results["accelerate"], results["notebook_accel"]
    print()
    for library, outcomes in results.items():
        counts: dict[str, int] = {}
        for verdict in outcomes.values():
            kind = verdict.split(":")[0]
            counts[kind] = counts.get(kind, 0) + 1
        summary = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))
        print(f"{library:>15}: {summary} (of {len(outcomes)})")
    both = [n for n, v in theirs.items() if v == "passed" and mine.get(n) == "passed"]
    passing = [n for n, v in theirs.items() if v == "passed"]
    print(f"\nof the {len(passing)} that pass under accelerate, {len(both)} pass here")
    differ = sorted(
        name for name in theirs.keys() | mine.keys() if theirs.get(name) != mine.get(name)
    )
    print(f"\n{len(differ)} differ")
    for name in differ:
        print(f"  {name}")
        print(f"    accelerate:     {theirs.get(name)}")
        print(f"    notebook_accel: {mine.get(name)}")
    failing = sorted(
        n for n, v in theirs.items() if v not in ("passed", "skipped") and n not in differ
    )
    if failing:
        print(f"\nfailing under both (not counted as a difference): {len(failing)}")
        for name in failing:
            print(f"  {name}: {theirs[name]}")
