"""The documentation's Python code blocks run, so the pages cannot drift from the code.

For each page under docs/, its ```python blocks run in order in one fresh interpreter,
as the cells of a notebook would: they are written to `page.py` in a temporary
directory, each block on the same line numbers as in the page (so a traceback points
at the page's line), and run with `python page.py`. A block preceded by the line

    <!-- not run: REASON -->

(it needs a GPU, a TPU, a cluster, a network, a Jupyter kernel's widgets, or it is a
fragment) is only compiled. IPython syntax (`%%on_workers`, `!cmd`) is turned into
Python the way IPython does it, and such a page runs under an IPython shell.
Shell blocks (bash, sh, console) are not run.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))

# A page's blocks together; the whole file stays within a few minutes on 2 cores.
PAGE_SECONDS = 150

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,})[ \t]*(?P<lang>[\w+-]*)")
NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(?P<reason>.*?)\s*-->\s*$")
IPYTHON_LINE = re.compile(r"^\s*(%|!)")
# Runs IPython's transformed code (get_ipython().run_cell_magic(...)) outside a kernel:
# one line, line 1 of the page (its title), so the blocks keep their line numbers.
SHELL_PRELUDE = (
    "from IPython import get_ipython; "
    "from IPython.core.interactiveshell import InteractiveShell; "
    "InteractiveShell.instance()"
)


@dataclass
class Block:
    page: Path
    line: int  # the first line of code (1-based), after the opening fence
    lang: str
    source: str
    lines: int  # how many lines the block takes in the page
    not_run: str | None  # the reason, for blocks that are only compiled

    @property
    def where(self) -> str:
        return f"{_shown(self.page)}:{self.line}"


def _shown(page: Path) -> str:
    try:
        return str(page.relative_to(ROOT))
    except ValueError:
        return page.name


def blocks(page: Path) -> list[Block]:
    """Every fenced code block of a page, with the `not run` marker before it, if any."""
    text = page.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    previous = ""  # the last non-blank line before the current one
    index = 0
    while index < len(text):
        opening = FENCE.match(text[index])
        if not opening:
            if text[index].strip():
                previous = text[index]
            index += 1
            continue
        indent, ticks = opening["indent"], opening["ticks"]
        end = index + 1
        while end < len(text) and not text[end].strip().startswith(ticks):
            end += 1
        if end == len(text):
            raise AssertionError(f"{_shown(page)}:{index + 1}: a code block is never closed")
        body = [
            line[len(indent) :] if line.startswith(indent) else line.lstrip()
            for line in text[index + 1 : end]
        ]
        marker = NOT_RUN.match(previous)
        found.append(
            Block(
                page=page,
                line=index + 2,
                lang=opening["lang"].lower(),
                source="\n".join(body) + "\n",
                lines=end - index - 1,
                not_run=marker["reason"] if marker else None,
            )
        )
        previous = text[end]
        index = end + 1
    return found


def python_blocks(page: Path) -> list[Block]:
    return [block for block in blocks(page) if block.lang in ("python", "py", "python3")]


def as_python(block: Block) -> str:
    """The block's code as Python: IPython's magics and shell escapes transformed."""
    if not any(IPYTHON_LINE.match(line) for line in block.source.splitlines()):
        return block.source
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager().transform_cell(block.source)


def compile_block(block: Block) -> None:
    try:
        compile(as_python(block), block.where, "exec")
    except SyntaxError as error:
        raise AssertionError(f"{block.where}: the block does not compile: {error}") from None


def script(page: Path) -> tuple[str, bool]:
    """page.py's text (each runnable block on its page lines) and whether any runs."""
    lines = [""] * (len(page.read_text(encoding="utf-8").splitlines()) + 1)
    runnable = [block for block in python_blocks(page) if block.not_run is None]
    needs_shell = False
    for block in runnable:
        code = as_python(block)
        needs_shell = needs_shell or code != block.source
        code_lines = code.rstrip("\n").splitlines()
        assert len(code_lines) <= block.lines, f"{block.where}: transformed code is too long"
        lines[block.line - 1 : block.line - 1 + len(code_lines)] = code_lines
    if needs_shell:
        lines[0] = SHELL_PRELUDE
    return "\n".join(lines).rstrip() + "\n", bool(runnable)


def run_page(page: Path, directory: Path, timeout: float = PAGE_SECONDS) -> str:
    """Compile every Python block of `page`, run the runnable ones in one interpreter in
    `directory`; return what it printed. Raises AssertionError naming what failed."""
    for block in python_blocks(page):
        compile_block(block)
    source, any_runnable = script(page)
    if not any_runnable:
        return ""
    (directory / "page.py").write_text(source, encoding="utf-8")
    environment = dict(os.environ, IPYTHONDIR=str(directory / ".ipython"), MPLBACKEND="Agg")
    process = subprocess.Popen(
        [sys.executable, "page.py"],
        cwd=directory,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise AssertionError(
            f"{_shown(page)}: its code blocks ran past {timeout:.0f} s:\n{output[-6000:]}"
        ) from None
    if process.returncode != 0:
        raise AssertionError(
            f"{_shown(page)}: its code blocks failed (exit code {process.returncode}; the "
            f"traceback's page.py lines are the page's lines):\n{output[-6000:]}"
        )
    return output


def test_there_are_pages():
    assert PAGES, "no pages under docs/"


@pytest.mark.timeout(PAGE_SECONDS + 30)
@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(DOCS)) for page in PAGES])
def test_page_code_blocks_run(page: Path, tmp_path: Path):
    run_page(page, tmp_path)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(DOCS)) for page in PAGES])
def test_not_run_markers_name_a_reason_and_a_python_block(page: Path):
    lines = page.read_text(encoding="utf-8").splitlines()
    marked = {block.line for block in python_blocks(page) if block.not_run is not None}
    for number, line in enumerate(lines, start=1):
        if "not run" in line and line.strip().startswith("<!--"):
            match = NOT_RUN.match(line)
            assert match and match["reason"], f"{_shown(page)}:{number}: a marker needs a reason"
            following = next(
                (n for n in range(number + 1, len(lines) + 1) if lines[n - 1].strip()), None
            )
            assert following is not None and following + 1 in marked, (
                f"{_shown(page)}:{number}: the marker is not followed by a ```python block"
            )


@pytest.mark.timeout(30)
def test_the_readme_quickstart_is_the_documentations():
    """README.md is not a page of the site: its code must be a page's, which runs here."""
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    readme = python_blocks(ROOT / "README.md")
    assert readme, "README.md shows no Python code"
    for block in readme:
        assert block.source.strip() in index, f"{block.where} is not in docs/index.md"


def _page(tmp_path: Path, text: str) -> Path:
    page = tmp_path / "page.md"
    page.write_text(text, encoding="utf-8")
    (tmp_path / "run").mkdir()
    return page


@pytest.mark.timeout(60)
def test_a_block_that_raises_fails_the_check(tmp_path: Path):
    page = _page(
        tmp_path,
        "# A page\n\n```python\nvalue = 1\n```\n\nText.\n\n"
        '```python\nassert value == 2, "the docs drifted"\n```\n',
    )
    with pytest.raises(AssertionError, match="the docs drifted") as failure:
        run_page(page, tmp_path / "run")
    assert 'page.py", line 10' in str(failure.value)  # the page's own line


@pytest.mark.timeout(30)
def test_a_not_run_block_is_compiled_not_run(tmp_path: Path):
    page = _page(
        tmp_path,
        "# A page\n\n<!-- not run: needs a GPU -->\n```python\nraise SystemExit(3)\n```\n\n"
        "```python\nprint('ran')\n```\n",
    )
    assert run_page(page, tmp_path / "run") == "ran\n"
    page.write_text("<!-- not run: a fragment -->\n```python\ndef (:\n```\n", encoding="utf-8")
    with pytest.raises(AssertionError, match="page.md:3: the block does not compile"):
        run_page(page, tmp_path / "run")


@pytest.mark.timeout(60)
def test_cell_magics_and_functions_from_the_page_reach_the_workers(tmp_path: Path):
    page = _page(
        tmp_path,
        "# A page\n\n```python\nfrom notebook_accel import start_workers\n\n"
        'workers = start_workers(2, backend="cpu")\n```\n\n'
        "```python\n%%on_workers\nvalue = 20\n```\n\n"
        "```python\ndef read(extra):\n    return value + extra\n\n\n"
        "assert workers.run(read, 1, return_all=True) == [21, 21]\nworkers.close()\n```\n",
    )
    run_page(page, tmp_path / "run")
