"""MkDocs hook: the API reference pages, generated at build time from `notebook_accel.__all__`.

Every public name gets a `::: notebook_accel.Name` block (rendered by mkdocstrings) on the
page of the subpackage that defines it, so a new export shows up without editing any page.
Before that, the build fails when a public name, or a public method or property of a public
class, has no docstring: the reference would show an empty entry.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from types import ModuleType

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

PACKAGE = "notebook_accel"
REFERENCE = "reference"

# subpackage that defines a name -> (page title, what the page is for), in the nav's order;
# mkdocs.yml lists the same pages, and the strict build fails when the two differ.
GROUPS: dict[str, tuple[str, str]] = {
    "launch": ("Launching", "Run a function on every device from a notebook, and what it raises."),
    "live": ("Live workers", "Workers that stay up between cells."),
    "ui": ("Panel", "The widget panel that chooses devices and precision, and launches."),
    "accelerator": ("Accelerator", "Accelerate's `Accelerator`, its trackers and helpers."),
    "training": ("State and data", "Process state, gradient state, data loaders and seeds."),
    "config": ("Configuration", "Accelerate's kwargs handlers and plugins, and launch settings."),
    "checkpoint": ("Checkpoints", "Finding and loading what `save_state` and `save_model` wrote."),
    "big_modeling": ("Big models", "Empty skeletons, device maps, loading, offload and pipelines."),
    "reporting": ("Logging and progress", "Loggers and progress bars that know their process."),
    "platforms": ("Hardware", "What the machine has, and how the processes cooperate."),
}


# ------------------------------------------------------------------ the docstring check


def own_docstring(obj: object) -> str:
    """The docstring written for `obj` itself: not one Python fills in or inherits."""
    doc = getattr(obj, "__doc__", None)
    if not isinstance(doc, str):
        return ""
    if inspect.isclass(obj):
        # dataclasses write their signature; a class's docstring is otherwise its own, but
        # may equal a base's if copied over
        if dataclasses.is_dataclass(obj) and doc.startswith(f"{obj.__name__}("):
            return ""
        if any(doc == base.__doc__ for base in obj.__mro__[1:]):
            return ""
    elif not (inspect.isroutine(obj) or inspect.ismodule(obj)) and doc == type(obj).__doc__:
        return ""  # an instance: that is its class's docstring
    return doc.strip()


def _member_docstring(value: object) -> str | None:
    """The docstring of a class attribute that is a method or property; None for others."""
    if isinstance(value, (classmethod, staticmethod)):
        value = value.__func__
    elif isinstance(value, functools.cached_property):
        value = value.func
    elif isinstance(value, property):
        return (value.__doc__ or "").strip()
    if inspect.isfunction(value):
        return (value.__doc__ or "").strip()
    return None


def undocumented(module: ModuleType, names: list[str] | None = None) -> list[str]:
    """Public names of `module` without a docstring, and public methods and properties
    without one in the public classes its package defines (inherited ones included: the
    reference shows them too). `names` defaults to the module's `__all__`."""
    package = module.__name__.partition(".")[0]
    missing = []
    for name in module.__all__ if names is None else names:
        obj = getattr(module, name)
        if not own_docstring(obj):
            missing.append(name)
        if not inspect.isclass(obj) or not obj.__module__.startswith(package):
            continue
        seen: set[str] = set()
        for klass in obj.__mro__:
            if klass.__module__.partition(".")[0] != package:
                continue  # object, Exception, Enum...: not this project's to document
            for attribute, value in vars(klass).items():
                if attribute.startswith("_") or attribute in seen:
                    continue
                seen.add(attribute)  # the most derived definition is the one shown
                if _member_docstring(value) == "":
                    missing.append(f"{name}.{attribute}")
    return missing


# ------------------------------------------------------------------------ the pages


def _group(name: str, obj: object) -> str:
    module = getattr(obj, "__module__", None) or ""
    parts = module.split(".")
    if parts[0] != PACKAGE or len(parts) < 2 or parts[1] not in GROUPS:
        raise PluginError(
            f"{PACKAGE}.{name} is defined in {module or 'no module'}, which has no page in the "
            f"API reference: add its subpackage to GROUPS in docs/hooks/api_reference.py "
            f"and the page to the nav in mkdocs.yml"
        )
    return parts[1]


def _summary(obj: object) -> str:
    """The docstring's first paragraph, on one line, fit for a table cell."""
    paragraph = own_docstring(obj).split("\n\n")[0]
    return " ".join(paragraph.split()).replace("|", "\\|")


def reference_pages(module: ModuleType) -> dict[str, str]:
    """Markdown of each reference page, by its path under the docs directory."""
    grouped: dict[str, list[str]] = {group: [] for group in GROUPS}
    # In the order the package lists its exports (`__all__` is sorted), where it does:
    # a class comes with the functions beside it.
    listed = list(getattr(module, "_EXPORTS", ()))
    rank = {name: index for index, name in enumerate(listed)}
    for name in sorted(module.__all__, key=lambda name: rank.get(name, len(listed))):
        grouped[_group(name, getattr(module, name))].append(name)
    pages = {}
    rows = []
    for group, names in grouped.items():
        if not names:
            continue
        title, about = GROUPS[group]
        blocks = "\n\n".join(f"::: {PACKAGE}.{name}" for name in names)
        pages[f"{REFERENCE}/{group}.md"] = f"# {title}\n\n{about}\n\n{blocks}\n"
        rows += [
            f"| [`{name}`][{PACKAGE}.{name}] | [{title}]({group}.md) "
            f"| {_summary(getattr(module, name))} |"
            for name in names
        ]
    pages[f"{REFERENCE}/index.md"] = "\n".join(
        [
            "# API reference",
            "",
            f"Every public name of `{PACKAGE}` (`from {PACKAGE} import ...`), generated from "
            "the docstrings when the site is built.",
            "",
            "| Name | Page | What it is |",
            "| --- | --- | --- |",
            *rows,
            "",
        ]
    )
    return pages


def check_docstrings(module: ModuleType) -> None:
    """Fail the build, naming them, when public names of `module` have no docstring."""
    missing = undocumented(module)
    if missing:
        raise PluginError(
            f"{len(missing)} public names of {module.__name__} have no docstring, so the API "
            f"reference would show them empty: {', '.join(missing)}"
        )


def on_files(files: Files, config: MkDocsConfig) -> Files:
    module = importlib.import_module(PACKAGE)
    check_docstrings(module)
    for src_uri, content in reference_pages(module).items():
        files.append(File.generated(config, src_uri, content=content))
    return files
