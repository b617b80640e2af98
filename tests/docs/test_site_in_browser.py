"""The built documentation site in headless Chromium: its pages show, and its search finds
the guide that answers a question."""

from __future__ import annotations

import pytest

from browser_harness import UI_TIMEOUT, screenshot

pytestmark = pytest.mark.browser

# Bounds each navigation and wait below (milliseconds).
WAIT_MS = UI_TIMEOUT * 1000


def heading(page) -> str:
    # without the permalink sign that follows it
    return page.locator("article h1").first.inner_text().rstrip("¶").strip()


def open_page(page, url: str) -> None:
    # The DOM is enough: nothing the pages need is loaded from elsewhere.
    response = page.goto(url, wait_until="domcontentloaded", timeout=WAIT_MS)
    assert response is not None and response.ok, url
    page.locator("article h1").first.wait_for(timeout=WAIT_MS)


@pytest.mark.timeout(480)
def test_the_home_page_and_a_guide_show(browser_page, site_url):
    page = browser_page
    open_page(page, site_url)
    assert "notebook_accel" in page.title()
    assert heading(page)
    screenshot(page, "docs-home")

    open_page(page, site_url + "guides/checkpoints/")
    title = heading(page)
    assert title and title in page.title(), (title, page.title())
    assert "notebook_accel" in page.title()
    screenshot(page, "docs-guide-checkpoints")


@pytest.mark.timeout(480)
def test_the_search_finds_the_checkpoints_guide(browser_page, site_url):
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page = browser_page
    open_page(page, site_url)
    search = page.locator("input.md-search__input")
    search.click(timeout=WAIT_MS)
    # typed as a person would, so Material's worker gets each key
    search.press_sequentially("resume", delay=50, timeout=WAIT_MS)
    results = page.locator(".md-search-result__list .md-search-result__item")
    results.first.wait_for(timeout=WAIT_MS)
    guide = page.locator('.md-search-result__list a[href*="guides/checkpoints/"]')
    try:
        guide.first.wait_for(timeout=WAIT_MS)
    except PlaywrightTimeout as error:
        hrefs = [
            link.get_attribute("href") for link in page.locator(".md-search-result__list a").all()
        ]
        raise AssertionError(f"no result links to the checkpoints guide: {hrefs}") from error
    assert results.count() >= 1
    screenshot(page, "docs-search-resume")
