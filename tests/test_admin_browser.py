"""The lock admin in a real browser: headless Chromium driven by Playwright, on a live server.

A person signs in, opens the all-stores page from the app's list, sees a lock another process
holds, force-releases it through the confirmation page and sees it gone; the store agrees. And
at 1,400 px, on whichever Django runs, every page's columns fit and its breadcrumbs look like
Django's own; the screenshots are left in /tmp/keel-admin-*-django<version>-1400.png to look at.

Needs the Debian `chromium` package and the `playwright` Python package (never `playwright
install`: the system Chromium is used). Missing either skips loudly here and fails under CI.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import django
import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import User
from django.utils import timezone

from django_keel_lock import get_lock_store, lock
from django_keel_lock.models import Lock as LockRow

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
    page.wait_for_selector(".app-django_keel_lock")
    page.screenshot(path=str(SCREENSHOT.with_name("keel-admin-index.png")), full_page=True)
    page.click("#content-main .app-django_keel_lock >> text=Locks in every store")

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


# -- the pages' layout at 1,400 px, on whichever Django runs ------------------------------------
WIDTH = 1400
SHOTS = Path("/tmp")
DJANGO = f"django{django.VERSION[0]}.{django.VERSION[1]}"  # in each screenshot's name
# What a Celery worker's lock carries: the worker, its pid and the task id (36 characters).
CELERY_HOLDER = "celery@worker-7.prod.example.com:48213 task 3f1c9a7e-5b2d-4e8a-9c61-0d7f2b8e4a15"

# Where each page's boxes must fit, and the element whose breadcrumbs are compared.
BREADCRUMBS = "nav[aria-label='Breadcrumbs'] > .breadcrumbs"

BOX_SCRIPT = """(selector) => [...document.querySelectorAll(selector)]
    .map((e) => ({text: e.innerText.slice(0, 40), right: e.getBoundingClientRect().right}))"""

STYLE_SCRIPT = """(selector) => {
    const e = document.querySelector(selector);
    if (!e) return null;
    const s = getComputedStyle(e);
    return {tag: e.tagName, background: s.backgroundColor, color: s.color,
            padding: s.padding, height: Math.round(e.getBoundingClientRect().height)};
}"""


def fill_the_lock_table() -> list[str]:
    """The table of a site that has run for a while: 4 locks held (one by a Celery task), 27
    rows left behind: 14 released, 13 expired. The held keys."""
    held = []
    for n, holder in enumerate([CELERY_HOLDER, "web-3:1234", "web-4:5678", "cron-1:99"]):
        handle = lock(f"invoice:2026-{n:06d}:charge", store="default", ttl=600, holder=holder)
        assert handle.acquire()
        held.append(handle.key)
    past = timezone.now() - timedelta(hours=1)
    LockRow.objects.using("default").bulk_create(
        LockRow(
            key=f"report:2026-11-{n:02d}:{'released' if n % 2 else 'expired'}",
            owner="" if n % 2 else uuid.uuid4().hex,  # a release leaves no owner
            holder=CELERY_HOLDER,
            fence=1_000 + n,
            acquired_at=past,
            expires_at=past,
        )
        for n in range(1, 28)
    )
    return held


def shoot(page: Any, name: str) -> None:
    """A full-page screenshot, to look at: /tmp/keel-admin-<name>-django<version>-1400.png."""
    page.screenshot(path=str(SHOTS / f"keel-admin-{name}-{DJANGO}-{WIDTH}.png"), full_page=True)


def boxes_past(page: Any, selector: str) -> list[dict[str, Any]]:
    """The elements of `selector` whose box reaches past the viewport's right edge."""
    return [box for box in page.evaluate(BOX_SCRIPT, selector) if box["right"] > WIDTH]


def assert_fits(page: Any, *selectors: str) -> None:
    assert page.evaluate("document.documentElement.scrollWidth") <= WIDTH
    for selector in selectors:
        assert page.locator(selector).count() > 0, selector
        assert boxes_past(page, selector) == [], selector


def test_admin_pages_fit_1400_px_and_style_breadcrumbs_as_the_running_django(
    live_server: Any, browser_page: Any
) -> None:
    User.objects.create_superuser("ops", "ops@example.com", "s3cret-pass")
    held = fill_the_lock_table()
    redis = None
    if STORE_AVAILABILITY["redis"] is None:
        redis = lock("export:nightly:celery", store="redis", ttl=600, holder=CELERY_HOLDER)
        assert redis.acquire()
    page = browser_page
    page.set_viewport_size({"width": WIDTH, "height": 900})
    page.goto(f"{live_server.url}/admin/login/?next=/admin/")
    page.fill("#id_username", "ops")
    page.fill("#id_password", "s3cret-pass")
    page.click("input[type=submit]")
    page.wait_for_selector("#content-main")
    shoot(page, "site-index")
    page.goto(f"{live_server.url}/admin/auth/user/")  # Django's own page, for its breadcrumbs
    django_breadcrumbs = page.evaluate(STYLE_SCRIPT, BREADCRUMBS)
    assert django_breadcrumbs is not None
    if django.VERSION >= (6, 1):
        assert django_breadcrumbs["tag"] == "OL"

    try:
        # The site index links the page of every store's locks, in the app's own list.
        page.goto(f"{live_server.url}/admin/")
        page.click("#content-main .app-django_keel_lock >> text=Locks in every store")
        page.wait_for_selector(".keel-store")
        assert_fits(page, ".keel-store th", ".keel-store td", "#content-main")
        if redis is not None:
            row = page.locator(f'.keel-store[data-store="redis"] tr[data-key="{redis.key}"]')
            assert CELERY_HOLDER in row.inner_text()  # whole, wrapped if need be
            assert str(redis.fence) in row.inner_text() and len(str(redis.fence)) >= 16
        assert page.evaluate(STYLE_SCRIPT, BREADCRUMBS) == django_breadcrumbs
        shoot(page, "stores")

        # The changelist: held locks by default, every row a click away; each state is true.
        page.click(f'{BREADCRUMBS} a[href="/admin/django_keel_lock/lock/"]')
        page.wait_for_selector("#result_list")
        rows = page.locator("#result_list tbody tr")
        assert sorted(rows.locator("th.field-key").all_inner_texts()) == held
        assert set(rows.locator("td.field-state_display").all_inner_texts()) == {"held"}
        assert CELERY_HOLDER in page.inner_text("#result_list")
        assert_fits(page, "#result_list th", "#result_list td", "#changelist-filter")
        assert page.evaluate(STYLE_SCRIPT, BREADCRUMBS) == django_breadcrumbs
        shoot(page, "changelist")

        page.click('#changelist-filter a[href="?state=all"]')
        page.wait_for_url("**/?state=all")
        states = rows.locator("td.field-state_display").all_inner_texts()
        assert sorted(set(states)) == ["expired", "held", "released"]
        assert (states.count("held"), states.count("released")) == (4, 14)
        assert_fits(page, "#result_list th", "#result_list td", "#changelist-filter")
        shoot(page, "changelist-all")

        # The confirmation page of a force release.
        page.goto(f"{live_server.url}/admin/django_keel_lock/lock/stores/release/"
                  f"?store=default&key={held[0]}")  # fmt: skip
        page.wait_for_selector("text=Yes, force release")
        assert_fits(page, "#content-main td", "#content-main th")
        assert page.evaluate(STYLE_SCRIPT, BREADCRUMBS) == django_breadcrumbs
        shoot(page, "confirm")
    finally:
        if redis is not None:
            redis.release()
