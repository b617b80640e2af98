"""MkDocs hook: the porting page's coverage table, generated from the code at build time.

`docs/porting.md` holds the line `<!-- coverage-table -->`; it becomes a table of every
public name of the installed Accelerate (`accelerate` and `accelerate.utils`) with where
`notebook_accel` exports it: at the top level, in `notebook_accel.utils`, or in the module
of Accelerate's path (`accelerate.state` -> `notebook_accel.state`). The numbers on the page
are then always those of the code, never a count someone forgot to update.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from types import ModuleType

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page

PAGE = "porting.md"
PLACEHOLDER = "<!-- coverage-table -->"
PACKAGE = "notebook_accel"


def public_names(module: ModuleType) -> list[str]:
    """A module's public names that are not submodules (`accelerate.utils.memory`...)."""
    if hasattr(module, "__all__"):
        return sorted(module.__all__)
    return sorted(
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and not inspect.ismodule(value)
    )


def _import(path: str) -> ModuleType | None:
    """The module at `path`, or None where there is no such module."""
    try:
        spec = importlib.util.find_spec(path)
    except ModuleNotFoundError:  # a parent on the path is a module, not a package
        return None
    return importlib.import_module(path) if spec is not None else None


def _accelerate() -> tuple[ModuleType, ModuleType]:
    try:
        import accelerate
        import accelerate.utils
    except ImportError as error:
        raise PluginError(
            f"the porting page's coverage table is made from Accelerate, which cannot be "
            f"imported here ({error}): install the dev extra, pip install -e '.[dev]'"
        ) from error
    return accelerate, accelerate.utils


def exported_at(name: str, accelerate_module: str | None) -> list[str]:
    """Where `notebook_accel` exports Accelerate's `name`, as import paths.

    `accelerate_module` is the module that defines it in Accelerate; the module of the same
    path under `notebook_accel` counts when its `__all__` lists the name.
    """
    candidates = [PACKAGE, f"{PACKAGE}.utils"]
    if accelerate_module and accelerate_module.startswith("accelerate."):
        candidates.append(PACKAGE + accelerate_module.removeprefix("accelerate"))
    found = []
    for path in dict.fromkeys(candidates):
        module = _import(path)
        if module is not None and name in getattr(module, "__all__", ()):
            found.append(f"{path}.{name}")
    return found


def _cell(path: str) -> str:
    # top-level names have a reference entry: link it (autorefs checks the link)
    if path.count(".") == 1:
        return f"[`{path}`][{path}]"
    return f"`{path}`"


def coverage_markdown() -> str:
    accelerate, accelerate_utils = _accelerate()
    rows = []
    counts = {}
    for namespace in (accelerate, accelerate_utils):
        names = public_names(namespace)
        exported = 0
        for name in names:
            defined_in = getattr(getattr(namespace, name), "__module__", None)
            where = exported_at(name, defined_in if isinstance(defined_in, str) else None)
            exported += bool(where)
            cells = ", ".join(_cell(path) for path in where) or "—"
            rows.append(f"| `{namespace.__name__}.{name}` | {'yes' if where else 'no'} | {cells} |")
        counts[namespace.__name__] = (exported, len(names))
    found = sum(exported for exported, _ in counts.values())
    total = sum(count for _, count in counts.values())
    parts = [
        f"{exported} of the {count} names of `{module}`"
        for module, (exported, count) in counts.items()
    ]
    return "\n".join(
        [
            f"**{found} of {total} of Accelerate's public names** are exported by "
            f"`{PACKAGE}` ({' and '.join(parts)}; Accelerate {accelerate.__version__}, "
            "counted when this site was built).",
            "",
            "| Accelerate | In notebook_accel | Where |",
            "| --- | --- | --- |",
            *rows,
        ]
    )


def on_files(files: Files, config: MkDocsConfig) -> Files:
    if files.get_file_from_path(PAGE) is None:
        raise PluginError(f"{PAGE} is missing from the docs: it holds the coverage table")
    _accelerate()  # fail before rendering anything when Accelerate is missing
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if markdown.count(PLACEHOLDER) != 1:
        raise PluginError(
            f"{PAGE} must hold the line {PLACEHOLDER} exactly once (it holds it "
            f"{markdown.count(PLACEHOLDER)} times): the coverage table replaces it"
        )
    return markdown.replace(PLACEHOLDER, coverage_markdown())
