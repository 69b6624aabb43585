"""The lock admin in a real browser: headless Chromium driven by Playwright, on a live server.

A person signs in, opens the all-stores page from the app index, sees a lock another process
holds, force-releases it through the confirmation page and sees it gone; the store agrees.

Needs the Debian `chromium` package and the `playwright` Python package (never `playwright
install`: the system Chromium is used). Missing either skips loudly here and fails under CI.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import User

from django_keel_lock import get_lock_store

from .conftest import STORE_AVAILABILITY, skip_or_fail
from .support import browser
from .test_admin import HeldElsewhere, hold_elsewhere  # noqa: F401  (fixture)

SCREENSHOT = Path("/tmp/keel-admin.png")

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")


@pytest.fixture
def browser_page() -> Iterator[Any]:
    problem = browser.missing()
    if problem:
        skip_or_fail(f"BROWSER TEST CANNOT RUN HERE (it fails under CI=true): {problem}")
    with browser.chromium_page() as page:
        page.set_default_timeout(20_000)
        yield page


def test_force_release_a_lock_held_by_another_process_in_the_browser(
    live_server: Any,
    browser_page: Any,
    hold_elsewhere: Callable[..., HeldElsewhere],  # noqa: F811
) -> None:
    User.objects.create_superuser("ops", "ops@example.com", "s3cret-pass")
    alias = "postgres" if STORE_AVAILABILITY["postgres"] is None else "sqlite"
    held = hold_elsewhere(alias, key="invoice:4242:charge", ttl=600)
    other = hold_elsewhere(alias, key="report:2026-11-29", ttl=600)
    row_lock = hold_elsewhere("sqlite", key="export:nightly", ttl=90)
    page = browser_page

    page.goto(f"{live_server.url}/admin/login/?next=/admin/django_keel_lock/")
    page.fill("#id_username", "ops")
    page.fill("#id_password", "s3cret-pass")
    page.click("input[type=submit]")
    page.wait_for_selector("#keel-lock-stores-module")
    page.screenshot(path=str(SCREENSHOT.with_name("keel-admin-index.png")), full_page=True)
    page.click("#keel-lock-stores-module >> text=Locks in every store")

    store = page.locator(f'.keel-store[data-store="{alias}"]')
    row = store.locator(f'tr.keel-lock[data-key="{held.key}"]')
    row.wait_for()
    row_text = row.inner_text()
    assert held.holder in row_text and str(held.fence) in row_text
    assert re.search(r"\d+m \d\ds", row_text), row_text  # ~10 minutes left
    assert held.owner not in page.content()
    page.screenshot(path=str(SCREENSHOT), full_page=True)

    row.locator("a.keel-force-release").click()
    page.wait_for_selector("text=Yes, force release")
    assert held.key in page.inner_text("#content-main")
    page.screenshot(path=str(SCREENSHOT.with_name("keel-admin-confirm.png")), full_page=True)
    page.click("input[value='Yes, force release']")

    page.wait_for_selector(".messagelist .success")
    message = page.inner_text(".messagelist")
    assert f"Force-released '{held.key}' in store '{alias}'" in message
    assert store.locator(f'tr.keel-lock[data-key="{held.key}"]').count() == 0
    assert store.locator(f'tr.keel-lock[data-key="{other.key}"]').count() == 1
    page.screenshot(path=str(SCREENSHOT.with_name("keel-admin-after.png")), full_page=True)

    # The changelist of the database table: held by the database's clock, owner never shown.
    page.click('.breadcrumbs a[href="/admin/django_keel_lock/lock/"]')
    changelist_row = page.locator("#result_list tr", has_text=row_lock.key)
    assert "held" in changelist_row.inner_text()
    assert re.search(r"1m \d\ds|\d\ds", changelist_row.inner_text())
    assert row_lock.owner not in page.content()
    page.screenshot(path=str(SCREENSHOT.with_name("keel-admin-changelist.png")), full_page=True)

    assert get_lock_store(alias).get(held.key) is None
    still = get_lock_store(alias).get(other.key)
    assert still is not None and still.fence == other.fence
    assert held.process.poll() is None  # the holder runs on, unaware: only the store changed
    entry = LogEntry.objects.get(object_repr=held.key)
    assert f"store '{alias}'" in entry.change_message and held.holder in entry.change_message
