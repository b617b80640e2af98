"""The documentation site builds strictly, with every public name in its API reference, the
teaching notebooks as pages and the porting page's coverage table; a broken link or a
missing docstring fails it."""

from __future__ import annotations

import dataclasses
import html
import json
import re
import types

import pytest
from mkdocs.exceptions import PluginError

import notebook_accel
from docs_site import REPO_ROOT, build_site, copy_of_site_sources


@pytest.mark.timeout(420)
def test_the_strict_build_succeeds(built_site):
    assert (built_site.site_dir / "index.html").is_file()
    assert "Aborted" not in built_site.output


@pytest.mark.timeout(420)
def test_every_public_name_is_in_the_api_reference(built_site):
    reference = "".join(
        path.read_text(encoding="utf-8")
        for path in (built_site.site_dir / "reference").glob("*/index.html")
    )
    # mkdocstrings gives each rendered name a heading with its path as id
    missing = [
        name for name in notebook_accel.__all__ if f'id="notebook_accel.{name}"' not in reference
    ]
    assert missing == []
    overview = built_site.page("reference")
    assert all(f"<code>{name}</code>" in overview for name in notebook_accel.__all__)


@pytest.mark.timeout(420)
def test_the_teaching_notebooks_are_rendered_pages(built_site):
    notebooks = sorted((REPO_ROOT / "notebooks").glob("*.ipynb"))
    assert len(notebooks) == 11
    for notebook in notebooks:
        page = html.unescape(built_site.page(f"notebooks/{notebook.stem}"))
        # nbconvert's cells, under the notebook's own heading
        assert re.search(r'class="jp-Cell jp-CodeCell', page), notebook.name
        cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
        first = next(cell for cell in cells if cell["cell_type"] == "markdown")
        heading = "".join(first["source"]).splitlines()[0].lstrip("# ").split("`")[0]
        assert heading in page, (notebook.name, heading)
        # not run: the notebooks keep no outputs, and the build adds none
        assert not re.search(r'class="[^"]*jp-OutputArea-output', page), notebook.name
    # rendered from notebooks/, not from copies in docs/
    assert not (REPO_ROOT / "docs" / "notebooks").exists()


@pytest.mark.timeout(420)
def test_the_porting_page_has_the_coverage_table(built_site, porting_coverage):
    import accelerate
    import accelerate.utils

    page = built_site.page("porting")
    assert "coverage-table" not in page
    total = len(porting_coverage.public_names(accelerate)) + len(
        porting_coverage.public_names(accelerate.utils)
    )
    count = re.search(r"(\d+) of (\d+) of Accelerate(&rsquo;|'|’)s public names", page)
    assert count is not None, "no count line on the porting page"
    assert int(count.group(2)) == total and 0 < int(count.group(1)) <= total
    rows = re.findall(r"<tr>\s*<td><code>(accelerate\.[\w.]+)</code></td>", page)
    assert len(rows) == total
    # an exported name links to its entry in the API reference
    accelerator_row = page.split("<code>accelerate.Accelerator</code>", 1)[1].split("</tr>")[0]
    assert "reference/accelerator/#notebook_accel.Accelerator" in accelerator_row


@pytest.mark.timeout(420)
def test_a_broken_link_fails_the_build(tmp_path):
    sources = copy_of_site_sources(tmp_path / "sources")
    index = sources / "docs" / "index.md"
    index.write_text(
        index.read_text(encoding="utf-8")
        + "\n\n[a page that is not there](no-such-page.md)"
        + "\n[an anchor that is not there](getting-started.md#no-such-anchor)\n",
        encoding="utf-8",
    )
    build = build_site(sources, tmp_path / "site")
    assert build.returncode != 0, build.output[-4000:]
    assert "no-such-page.md" in build.output, build.output[-4000:]
    assert "#no-such-anchor" in build.output, build.output[-4000:]


# ------------------------------------------------------------------ the hooks alone


def _module_without_docstrings() -> types.ModuleType:
    module = types.ModuleType("tiny_pkg")

    def documented_function():
        """Has one."""

    def bare_function():
        pass

    class Base:
        """Documented, but a method it passes on is not."""

        def inherited(self):
            pass

    class Widget(Base):
        """Documented, with members that are not."""

        def bare_method(self):
            pass

        def documented_method(self):
            """Has one."""

        @property
        def bare_property(self):
            return 1

        @classmethod
        def bare_classmethod(cls):
            pass

        @staticmethod
        def bare_staticmethod():
            pass

        def _private(self):
            pass

    class BareClass(ValueError):
        pass  # ValueError's docstring is not its own

    @dataclasses.dataclass
    class BareRecord:
        value: int = 0  # the dataclass writes a signature as its docstring

    for klass in (Base, Widget, BareClass, BareRecord):
        klass.__module__ = module.__name__
    exports = (documented_function, bare_function, Widget, BareClass, BareRecord)
    for obj in exports:
        setattr(module, obj.__name__, obj)
    module.__all__ = [obj.__name__ for obj in exports]
    return module


@pytest.mark.timeout(60)
def test_the_docstring_check_names_every_undocumented_public_name(api_reference):
    missing = api_reference.undocumented(_module_without_docstrings())
    assert sorted(missing) == sorted(
        [
            "bare_function",
            "Widget.bare_method",
            "Widget.bare_property",
            "Widget.bare_classmethod",
            "Widget.bare_staticmethod",
            "Widget.inherited",
            "BareClass",
            "BareRecord",
        ]
    )


@pytest.mark.timeout(60)
def test_the_docstring_check_fails_the_build_with_the_names(api_reference):
    with pytest.raises(PluginError, match=r"8 public names of tiny_pkg.*bare_function"):
        api_reference.check_docstrings(_module_without_docstrings())


@pytest.mark.timeout(60)
def test_the_porting_page_without_its_placeholder_fails_the_build(porting_coverage):
    page = types.SimpleNamespace(file=types.SimpleNamespace(src_uri="porting.md"))
    with pytest.raises(PluginError, match="coverage-table"):
        porting_coverage.on_page_markdown("# Porting\n", page=page, config=None, files=None)
    other = types.SimpleNamespace(file=types.SimpleNamespace(src_uri="index.md"))
    assert porting_coverage.on_page_markdown("# Home\n", page=other, config=None, files=None)


@pytest.mark.timeout(320)
def test_make_docs_builds_the_site(built_site):
    """The session's build is `make docs` itself (where make is installed)."""
    import shutil

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    site = built_site.site_dir
    assert (site / "index.html").exists() and (
        site / "guides" / "checkpoints" / "index.html"
    ).exists()
