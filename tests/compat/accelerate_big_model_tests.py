"""Run Accelerate's own big-model tests against notebook_accel.big_modeling, by hand.

Accelerate keeps `tests/test_big_modeling.py` and `tests/test_modeling_utils.py` in its
source repository (not in its wheel), so this is a tool to run with a copy of them, not
part of the suite:

    python tests/compat/accelerate_big_model_tests.py ACCELERATE_CHECKOUT
    python tests/compat/accelerate_big_model_tests.py test_big_modeling.py test_modeling_utils.py

Each file is run twice with pytest, each time in a fresh interpreter: as it is (under
Accelerate), and with every name it imports from `accelerate...` that
`notebook_accel.big_modeling` provides imported from there instead (the one-line port a
user makes); nothing else changes, and the line numbers stay the same. Names we do not
provide (Accelerate's test decorators, `torch_device`) keep coming from Accelerate.
It prints the counts under each library and every test whose outcome differs.

The tests see the machine's accelerators; `--cpu` hides the GPUs from both runs. The
test files need `parameterized` (a dev dependency) and transformers.
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

TEST_FILES = ("test_big_modeling.py", "test_modeling_utils.py")
OURS = "notebook_accel.big_modeling"


def find_test_files(paths: list[str]) -> list[Path]:
    """The test files named, or those two files in an Accelerate checkout (or its tests/)."""
    found: list[Path] = []
    for given in map(Path, paths):
        if given.is_file():
            found.append(given)
            continue
        folder = given / "tests" if (given / "tests").is_dir() else given
        files = [folder / name for name in TEST_FILES if (folder / name).is_file()]
        if not files:
            raise SystemExit(
                f"{given} holds neither {' nor '.join(TEST_FILES)}: pass an Accelerate source "
                "checkout, its tests/ folder, or the test files"
            )
        found += files
    return found


def our_names() -> set[str]:
    import importlib

    return set(importlib.import_module(OURS).__all__)


def _is_accelerate_import(node: ast.ImportFrom) -> bool:
    module = node.module or ""
    if node.level or not (module == "accelerate" or module.startswith("accelerate.")):
        return False
    return not module.startswith("accelerate.test_utils")  # the test fixtures stay


def port(source: str, ours: set[str]) -> tuple[str, list[str], list[str]]:
    """`source` with its accelerate imports of our names pointed at notebook_accel;
    returns (new source, names ported, accelerate names kept)."""
    lines = source.splitlines()
    ported: list[str] = []
    kept: list[str] = []
    nodes = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)]
    for node in sorted(nodes, key=lambda n: n.lineno, reverse=True):
        if not _is_accelerate_import(node):
            continue
        mine = [alias for alias in node.names if alias.name in ours]
        theirs = [alias for alias in node.names if alias.name not in ours]
        ported += [f"{node.module}.{a.name}" for a in mine]
        kept += [f"{node.module}.{a.name}" for a in theirs]
        if not mine:
            continue
        statements = [ast.ImportFrom(module=OURS, names=mine, level=0)]
        if theirs:
            statements.append(ast.ImportFrom(module=node.module, names=theirs, level=0))
        indent = " " * node.col_offset
        first, last = node.lineno - 1, node.end_lineno
        # One line, then blank ones: every other line keeps its number.
        replaced = [indent + "; ".join(ast.unparse(s) for s in statements)]
        replaced += [""] * (last - first - 1)
        lines[first:last] = replaced
    return "\n".join(lines) + "\n", sorted(ported), sorted(kept)


def run_pytest(folder: Path, files: list[str], hide_gpus: bool) -> dict[str, str]:
    """pytest over `files` in `folder`, in a fresh interpreter: test id -> outcome."""
    report = folder / "report.xml"
    env = dict(os.environ)
    if hide_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    command = [
        sys.executable,
        "-m",
        "pytest",
        *files,
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={report}",
        "-o",
        "junit_family=xunit2",
    ]
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True)
    if not report.exists():
        raise SystemExit(f"pytest did not run:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    outcomes: dict[str, str] = {}
    for case in ElementTree.parse(report).iter("testcase"):
        name = f"{case.get('classname', '').rpartition('.')[2]}.{case.get('name')}"
        verdict = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                text = (child.get("message") or "").strip().splitlines()
                verdict = f"{child.tag}: {text[0][:200] if text else ''}"
            elif child.tag == "skipped":
                verdict = "skipped"
        outcomes[name] = verdict
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="an Accelerate checkout, or the test files")
    parser.add_argument("--cpu", action="store_true", help="hide GPUs from both runs")
    options = parser.parse_args()
    files = find_test_files(options.paths)
    ours = our_names()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for library in ("accelerate", "notebook_accel"):
            folder = Path(tmp, library)
            folder.mkdir()
            for path in files:
                source = path.read_text()
                if library == "notebook_accel":
                    source, ported, kept = port(source, ours)
                    print(f"{path.name}: {len(ported)} names from {OURS}; still from accelerate:")
                    print("    " + (", ".join(kept) or "(none)"))
                (folder / path.name).write_text(source)
            results[library] = run_pytest(folder, [p.name for p in files], options.cpu)
    theirs, mine = results["accelerate"], results["notebook_accel"]
    print()
    for library, outcomes in results.items():
        counts = {}
        for verdict in outcomes.values():
            kind = verdict.split(":")[0]
            counts[kind] = counts.get(kind, 0) + 1
        summary = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))
        print(f"{library:>15}: {summary} (of {len(outcomes)})")
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


if __name__ == "__main__":
    main()
