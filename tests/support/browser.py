"""Headless Chromium through Playwright, for the tests that look at a page as a person would.

The system Chromium (Debian's `chromium`) is used, never `playwright install`'s download.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]


def missing(*modules: str) -> str | None:
    """What keeps a browser test from running here (Chromium, Playwright or one of
    `modules`), or None."""
    if not CHROMIUM.exists():
        return f"{CHROMIUM} is missing: apt-get install chromium"
    for module in ("playwright.sync_api", *modules):
        try:
            importlib.import_module(module)
        except ImportError:
            return f"{module} is missing: pip install -e '.[test]'"
    return None


@contextmanager
def chromium_page() -> Iterator[Any]:
    """A Playwright page in a new headless Chromium, closed afterwards."""
    from playwright.sync_api import sync_playwright

    # Playwright's sync API runs an event loop in this thread, and Django refuses ORM calls
    # from a thread with a running loop; a test's own checks run after the browser closes.
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True
            )
            try:
                yield browser.new_page(viewport={"width": 1280, "height": 900})
            finally:
                browser.close()
    finally:
        os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
