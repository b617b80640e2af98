"""Fixtures for tests that drive JupyterLab in a real browser (marker `browser`).

They skip when playwright, JupyterLab or chromium is missing, unless
REQUIRE_BROWSER_TESTS=1 (CI sets it) turns that into a failure.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from browser_harness import (  # noqa: E402
    launch_chromium,
    missing_browser_requirements,
    new_page,
    screenshot,
    start_lab_server,
    stop_lab_server,
)


@pytest.fixture
def browser_requirements():
    reason = missing_browser_requirements()
    if reason is None:
        return
    if os.environ.get("REQUIRE_BROWSER_TESTS") == "1":
        pytest.fail(f"REQUIRE_BROWSER_TESTS=1 but {reason}")
    pytest.skip(f"no browser test here: {reason}")


@pytest.fixture
def lab_server(browser_requirements, tmp_path):
    """A JupyterLab server for this test; notebooks go in `lab_server.root_dir`."""
    server = start_lab_server(tmp_path / "lab")
    try:
        yield server
    finally:
        stop_lab_server(server)


@pytest.fixture
def browser(browser_requirements):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        try:
            yield browser
        finally:
            browser.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.browser_test_failed = report.failed
    return report


@pytest.fixture
def page(request, browser):
    page = new_page(browser)
    try:
        yield page
    finally:
        # What the browser showed when a test failed, for whoever reads the CI log.
        if getattr(request.node, "browser_test_failed", False):
            try:
                screenshot(page, f"failed-{request.node.name}")
            except Exception as error:  # the page may be what broke
                print(f"no failure screenshot: {error}")
        page.close()
