"""Fixtures for the documentation site's tests: one strict build of the site per pytest
run, its hook modules, and a page in headless Chromium."""

from __future__ import annotations

import functools
import os
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# the browser tests' harness: Debian's chromium under playwright
sys.path.insert(0, str(Path(__file__).parents[1] / "browser"))

import browser_harness  # noqa: E402
from docs_site import REPO_ROOT, Build, build_site, load_hook, make_docs  # noqa: E402

# The site's generator needs Python 3.11 or later, where the dev extra installs it; the
# code blocks are checked everywhere.
if sys.version_info < (3, 11):
    collect_ignore = ["test_site_build.py", "test_site_in_browser.py"]


@pytest.fixture(scope="session")
def built_site(tmp_path_factory) -> Build:
    """The site, built strictly from the repository by `make docs` (mkdocs directly where
    make is not installed); the build must succeed."""
    site = tmp_path_factory.mktemp("docs") / "site"
    build = make_docs(site) or build_site(REPO_ROOT, site)
    assert build.returncode == 0, f"the strict build failed:\n{build.output[-6000:]}"
    return build


@pytest.fixture(scope="session")
def api_reference() -> ModuleType:
    return load_hook("api_reference")


@pytest.fixture(scope="session")
def porting_coverage() -> ModuleType:
    return load_hook("porting_coverage")


# ---------------------------------------------------------------- in a real browser


@pytest.fixture
def browser_requirements():
    """Skip when playwright or chromium is missing, unless REQUIRE_BROWSER_TESTS=1 (CI sets
    it) turns that into a failure. JupyterLab is not needed here."""
    reason = None
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        reason = "playwright is not installed (pip install -e '.[dev]')"
    if reason is None and browser_harness.find_chromium() is None:
        reason = "chromium is not installed (apt-get install chromium)"
    if reason is not None:
        if os.environ.get("REQUIRE_BROWSER_TESTS") == "1":
            pytest.fail(f"REQUIRE_BROWSER_TESTS=1 but {reason}")
        pytest.skip(f"no browser test here: {reason}")


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        pass  # one line per request would bury the test's own output


@pytest.fixture
def site_url(built_site):
    """The built site served over HTTP on 127.0.0.1 (a port the OS picks), as a browser
    needs it: the search runs in a web worker, which a file:// page cannot start."""
    handler = functools.partial(_QuietHandler, directory=str(built_site.site_dir))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="docs-site", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.browser_test_failed = report.failed
    return report


@pytest.fixture
def browser_page(request, browser_requirements):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = browser_harness.launch_chromium(playwright)
        try:
            page = browser_harness.new_page(browser)
            yield page
            # What the browser showed when a test failed, for whoever reads the CI log.
            if getattr(request.node, "browser_test_failed", False):
                try:
                    browser_harness.screenshot(page, f"failed-{request.node.name}")
                except Exception as error:  # the page may be what broke
                    print(f"no failure screenshot: {error}")
        finally:
            browser.close()
