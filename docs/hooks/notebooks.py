"""MkDocs hook: the teaching notebooks of `notebooks/` as pages under `notebooks/`.

They stay where they are, at the repository root; each is added to the build as a file
read from there, so they exist once in git. mkdocs-jupyter renders them without running them.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

NOTEBOOKS = "notebooks"


def notebook_dir(config: MkDocsConfig) -> Path:
    return root_dir(config) / NOTEBOOKS


def root_dir(config: MkDocsConfig) -> Path:
    return Path(config.config_file_path).resolve().parent


# Hooks run after plugins by default; this one runs first, so that mkdocs-jupyter's own
# on_files sees the notebooks and turns them into pages.
@event_priority(100)
def on_files(files: Files, config: MkDocsConfig) -> Files:
    found = sorted(notebook_dir(config).glob("*.ipynb"))
    if not found:
        raise PluginError(f"no notebooks in {notebook_dir(config)}: the site lists them")
    for path in found:
        # Read from the repository root rather than docs_dir, at the same path below it
        # (File.generated would do, but mkdocs-jupyter's wrapper loses its source path).
        files.append(
            File(
                f"{NOTEBOOKS}/{path.name}",
                src_dir=str(root_dir(config)),
                dest_dir=config.site_dir,
                use_directory_urls=config.use_directory_urls,
            )
        )
    return files
