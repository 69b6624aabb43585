"""The lock admin, through the test client, against real stores and locks held by other processes.

Every test is transactional: the SQLite store writes through its own connection, which a test
transaction holding SQLite's write lock would block.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
from django.conf import settings
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth.models import Permission, User
from django.contrib.contenttypes.models import ContentType
from django.test import Client, override_settings
from django.utils import timezone

from django_keel_lock import get_lock_store, lock, semaphore
from django_keel_lock.admin import LockAdmin, RemainingSeconds, format_remaining
from django_keel_lock.exceptions import LockStoreUnavailable
from django_keel_lock.models import Lock as LockRow
from django_keel_lock.signals import lock_force_released
from django_keel_lock.stores import LockInfo, MemoryLockStore

from .conftest import STORE_AVAILABILITY, needs_store, store_params
from .support import ROOT

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

CHANGELIST = "/admin/django_keel_lock/lock/"
STORES_PAGE = "/admin/django_keel_lock/lock/stores/"
STORES_ENTRY = "/admin/django_keel_lock/storelock/"  # the site index's entry for STORES_PAGE
RELEASE = "/admin/django_keel_lock/lock/stores/release/"

# Runs in a separate interpreter: acquire one key, report it, then hold it until killed.
HOLDER_SCRIPT = r"""
import json, os, sys, time
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
import django
from django.conf import settings
for config in settings.DATABASES.values():
    name = config.get("TEST", {}).get("NAME")
    if name:
        config["NAME"] = name
django.setup()
from django_keel_lock import lock
key, store, ttl = sys.argv[1], sys.argv[2], float(sys.argv[3])
handle = lock(key, store=store, ttl=ttl)
acquired = handle.acquire()
print(json.dumps({"acquired": acquired, "fence": handle.fence, "owner": handle.owner,
                  "holder": handle.holder, "pid": os.getpid()}), flush=True)
time.sleep(3600)
"""


@dataclass
class HeldElsewhere:
    key: str
    store: str
    fence: int
    owner: str
    holder: str
    process: subprocess.Popen[str]


@pytest.fixture
def hold_elsewhere() -> Iterator[Callable[..., HeldElsewhere]]:
    """Start processes that each acquire a key (long ttl) and sleep; killed at teardown, which
    leaves their locks behind like a crashed worker would."""
    processes: list[subprocess.Popen[str]] = []
    started: list[tuple[str, str]] = []

    def start(store: str, key: str | None = None, ttl: float = 300) -> HeldElsewhere:
        key = key or f"admin:{store}:{uuid.uuid4().hex[:10]}"
        env = {**os.environ, "KEEL_TEST_RUN_ID": settings.RUN_ID, "PYTHONPATH": str(ROOT)}
        process = subprocess.Popen(
            [sys.executable, "-c", HOLDER_SCRIPT, key, store, str(ttl)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        processes.append(process)
        started.append((store, key))
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], 60)
        line = process.stdout.readline() if ready else ""
        if not line:
            process.kill()
            _, err = process.communicate(timeout=10)
            pytest.fail(f"holder process for {key!r} in {store!r} said nothing: {err[-2000:]}")
        report = json.loads(line)
        assert report["acquired"], f"holder process could not acquire {key!r} in {store!r}"
        return HeldElsewhere(
            key, store, report["fence"], report["owner"], report["holder"], process
        )

    yield start
    for process, (store, key) in zip(processes, started, strict=True):
        process.kill()
        process.wait(timeout=10)
        try:  # what a killed holder leaves behind would outlive the run in Redis
            get_lock_store(store).force_release(key)
        except Exception:
            pass
        if process.stdout is not None:
            process.stdout.close()
        if process.stderr is not None:
            process.stderr.close()


@pytest.fixture
def superuser() -> User:
    return User.objects.create_superuser("root", "root@example.com", "pw")


@pytest.fixture
def admin_client(superuser: User) -> Client:
    client = Client()
    client.force_login(superuser)
    return client


def staff_client(*codenames: str) -> Client:
    user = User.objects.create_user(f"staff-{uuid.uuid4().hex[:8]}", password="pw", is_staff=True)
    user.user_permissions.add(
        *Permission.objects.filter(
            content_type__app_label="django_keel_lock", codename__in=codenames
        )
    )
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def viewer_client() -> Client:
    """Staff who may view locks but not force-release them."""
    return staff_client("view_lock")


@pytest.fixture
def released_signals() -> Iterator[list[dict[str, Any]]]:
    received: list[dict[str, Any]] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        received.append(kwargs)

    lock_force_released.connect(receiver, weak=False)
    yield received
    lock_force_released.disconnect(receiver)


def key_of(test: str) -> str:
    return f"admin:{test}:{uuid.uuid4().hex[:10]}"


def section(html: str, alias: str) -> str:
    """The HTML of one store's section on the all-stores page."""
    start = html.index(f'data-store="{alias}"')
    end = html.find('class="module keel-store"', start)
    return html[start : end if end != -1 else len(html)]


# -- the changelist -----------------------------------------------------------------------------
def test_changelist_shows_lock_held_by_another_process_without_its_owner(
    admin_client: Client, hold_elsewhere: Callable[..., HeldElsewhere]
) -> None:
    held = hold_elsewhere("sqlite", ttl=300)

    response = admin_client.get(CHANGELIST, {"q": held.key})

    html = response.content.decode()
    assert response.status_code == 200
    assert held.key in html
    assert held.holder in html
    assert f'<td class="field-fence">{held.fence}</td>' in html
    assert '<td class="field-state_display">held</td>' in html
    assert "4m 5" in html or "5m 00s" in html  # ~300 s left by the database's clock
    assert held.owner not in html


def test_changelist_marks_a_released_lock_released_and_a_lapsed_one_expired(
    admin_client: Client,
) -> None:
    released = lock(key_of("released"), store="default", ttl=60)
    lapsed = lock(key_of("lapsed"), store="default", ttl=0.05)
    assert released.acquire() and lapsed.acquire()
    released.release()
    while lapsed.remaining_time():  # by the store's clock
        time.sleep(0.02)

    released_html = admin_client.get(CHANGELIST, {"q": released.key, "state": "all"})
    lapsed_html = admin_client.get(CHANGELIST, {"q": lapsed.key, "state": "all"})

    assert released.key in released_html.content.decode()
    assert '<td class="field-state_display">released</td>' in released_html.content.decode()
    assert '<td class="field-remaining_display">—</td>' in released_html.content.decode()
    assert lapsed.key in lapsed_html.content.decode()
    assert '<td class="field-state_display">expired</td>' in lapsed_html.content.decode()


def test_remaining_time_comes_from_the_database_clock_not_the_app_server(
    admin_client: Client,
) -> None:
    handle = lock(key_of("clock"), store="default", ttl=120)
    assert handle.acquire()
    a_day_later = timezone.now() + timedelta(days=1)

    with mock.patch("django.utils.timezone.now", return_value=a_day_later):
        html = admin_client.get(CHANGELIST, {"q": handle.key, "state": "held"}).content.decode()

    assert handle.key in html
    assert '<td class="field-state_display">held</td>' in html
    assert "1m 5" in html or "2m 00s" in html
    handle.release()


def test_changelist_shows_held_locks_by_default_and_released_expired_or_all_on_asking(
    admin_client: Client,
) -> None:
    prefix = key_of("filter")
    held = lock(f"{prefix}:held", store="default", ttl=60)
    gone = lock(f"{prefix}:gone", store="default", ttl=60)
    assert held.acquire() and gone.acquire()
    gone.release()

    pages = {
        state: admin_client.get(CHANGELIST, {"q": prefix, **({"state": state} if state else {})})
        for state in ("", "held", "released", "expired", "all")
    }
    shown = {
        state: {handle.key for handle in (held, gone) if handle.key in page.content.decode()}
        for state, page in pages.items()
    }
    bare = admin_client.get(CHANGELIST).content.decode()

    assert shown == {
        "": {held.key},
        "held": {held.key},
        "released": {gone.key},
        "expired": set(),
        "all": {held.key, gone.key},
    }
    assert 'href="?state=all"' in bare  # the way to every row
    assert "Show all" not in bare  # Django's link to the bare list, i.e. held again
    held.release()


def test_search_finds_locks_by_key(admin_client: Client) -> None:
    needle = key_of("needle")
    other = key_of("haystack")
    for name in (needle, other):
        handle = lock(name, store="default", ttl=60)
        assert handle.acquire()

    html = admin_client.get(CHANGELIST, {"q": needle.split(":")[-1]}).content.decode()

    assert needle in html and other not in html


OWNER_LOOKUPS = [
    "owner",
    "owner__exact",
    "owner__startswith",
    "owner__istartswith",
    "owner__contains",
    "owner__regex",
    "owner__gt",
    "owner__lte",
    "owner__in",
    "owner__isnull",
]


@pytest.mark.parametrize("lookup", OWNER_LOOKUPS)
def test_changelist_refuses_every_lookup_on_owner(viewer_client: Client, lookup: str) -> None:
    """A viewer who could filter on owner would read a token prefix by prefix (~280 requests)
    and then release or extend someone else's lock: the changelist refuses the filter (400,
    Django's answer to a lookup `lookup_allowed` refuses) instead of narrowing by it."""
    handle = lock(key_of("owner-oracle"), store="default", ttl=60)
    assert handle.acquire()
    owner = handle.owner
    assert owner is not None
    value = {"owner__isnull": "False", "owner__in": owner}.get(lookup, owner[:1])

    response = viewer_client.get(CHANGELIST, {"q": handle.key, lookup: value})

    assert response.status_code == 400
    assert owner not in response.content.decode()
    plain = viewer_client.get(CHANGELIST, {"q": handle.key})
    assert plain.status_code == 200 and handle.key in plain.content.decode()
    assert owner not in plain.content.decode()
    handle.release()


def test_changelist_cannot_be_ordered_by_owner(viewer_client: Client) -> None:
    """`?o=` orders by list_display columns only, and owner is none of them: every column
    index the changelist accepts orders by something else."""
    handle = lock(key_of("owner-order"), store="default", ttl=60)
    assert handle.acquire()
    columns = LockAdmin.list_display
    assert "owner" not in columns
    for index in range(len(columns) + 2):
        response = viewer_client.get(CHANGELIST, {"q": handle.key, "o": str(index)})
        assert response.status_code in (200, 302)
        assert handle.owner is not None and handle.owner not in response.content.decode()
    handle.release()


@needs_store("postgres")
def test_changelist_reads_the_database_of_the_store_not_the_routers_default(
    admin_client: Client,
) -> None:
    """No router sends the app elsewhere, so the router's choice is "default", which has a lock
    table too, but not these rows."""
    on_postgres = {
        "default": {
            "BACKEND": "django_keel_lock.stores.DatabaseLockStore",
            "OPTIONS": {"DATABASE": "postgres"},
        }
    }
    with override_settings(KEEL_LOCK_STORES=on_postgres):
        handle = lock(key_of("own-database"), store="default", ttl=120)
        assert handle.acquire()
        changelist = admin_client.get(CHANGELIST, {"q": handle.key}).content.decode()
        change = admin_client.get(f"{CHANGELIST}{handle.key}/change/")
        in_default = LockRow.objects.using("default").filter(key=handle.key).exists()
        handle.release()

    assert not in_default
    assert handle.key in changelist and handle.holder in changelist
    assert '<td class="field-state_display">held</td>' in changelist
    assert change.status_code == 200
    assert handle.holder in change.content.decode()
    assert "keel-force-release" in change.content.decode()


@pytest.mark.parametrize("database", store_params(["sqlite", "postgres", "mariadb"]))
def test_remaining_expression_agrees_with_the_store_on_every_database(database: str) -> None:
    store = get_lock_store(database)
    db = store.database  # type: ignore[attr-defined]
    handle = lock(key_of("expr"), store=database, ttl=120)
    assert handle.acquire()
    rows = LockRow.objects.using(db).annotate(left=RemainingSeconds("expires_at"))

    info = store.get(handle.key)
    left = rows.get(key=handle.key).left
    handle.release()
    after = rows.get(key=handle.key).left

    assert info is not None
    assert abs(left - info.expires_in) < 2
    assert 115 < left <= 120
    assert after <= 0


def test_format_remaining_is_for_people() -> None:
    assert format_remaining(0) == "expired"
    assert format_remaining(2.31) == "2.4s"
    assert format_remaining(42.2) == "43s"
    assert format_remaining(299.5) == "5m 00s"
    assert format_remaining(3725) == "1h 02m 05s"


# -- no add, no edit, no delete -----------------------------------------------------------------
def test_nobody_adds_edits_or_deletes_lock_rows(admin_client: Client) -> None:
    handle = lock(key_of("readonly"), store="default", ttl=60)
    assert handle.acquire()
    change_url = f"{CHANGELIST}{handle.key}/change/"

    assert admin_client.get(f"{CHANGELIST}add/").status_code == 403
    view = admin_client.get(change_url)
    html = view.content.decode()
    assert view.status_code == 200
    assert handle.holder in html
    assert 'name="_save"' not in html and 'name="holder"' not in html
    assert handle.owner is not None and handle.owner not in html
    assert admin_client.post(change_url, {"holder": "evil"}).status_code == 403
    assert admin_client.get(f"{CHANGELIST}{handle.key}/delete/").status_code == 403
    changelist = admin_client.get(CHANGELIST).content.decode()
    assert "delete_selected" not in changelist
    assert "Add lock" not in changelist
    handle.release()


def test_change_view_offers_force_release_only_with_the_permission(
    admin_client: Client, viewer_client: Client
) -> None:
    handle = lock(key_of("button"), store="default", ttl=60)
    assert handle.acquire()
    change_url = f"{CHANGELIST}{handle.key}/change/"

    assert "keel-force-release" in admin_client.get(change_url).content.decode()
    viewer = viewer_client.get(change_url)
    assert viewer.status_code == 200
    assert "keel-force-release" not in viewer.content.decode()
    handle.release()


# -- the all-stores page ------------------------------------------------------------------------
def test_all_stores_page_lists_locks_of_every_store(
    admin_client: Client, hold_elsewhere: Callable[..., HeldElsewhere]
) -> None:
    memory = lock(key_of("memory"), store="memory", ttl=60)
    assert memory.acquire()
    sqlite = hold_elsewhere("sqlite")
    servers = [a for a in ("postgres", "mariadb", "redis") if STORE_AVAILABILITY[a] is None]
    elsewhere = {alias: hold_elsewhere(alias) for alias in servers}

    response = admin_client.get(STORES_PAGE)

    html = response.content.decode()
    assert response.status_code == 200
    assert memory.key in section(html, "memory")
    assert sqlite.key in section(html, "sqlite")
    assert sqlite.holder in section(html, "sqlite")
    for alias, held in elsewhere.items():
        part = section(html, alias)
        assert held.key in part and held.holder in part and f">{held.fence}<" in part
        assert held.owner not in html
    assert sqlite.owner not in html
    assert "Force release" in html
    memory.release()


@needs_store("postgres")
def test_all_stores_page_lists_postgres_locks(
    admin_client: Client, hold_elsewhere: Callable[..., HeldElsewhere]
) -> None:
    held = hold_elsewhere("postgres")

    part = section(admin_client.get(STORES_PAGE).content.decode(), "postgres")

    assert held.key in part and held.holder in part


@needs_store("postgres")
def test_aliases_sharing_a_database_say_they_show_the_same_table(admin_client: Client) -> None:
    html = admin_client.get(STORES_PAGE).content.decode()

    assert "Same table as store &#x27;postgres&#x27;" in section(html, "postgres-fast")
    assert "Same table" not in section(html, "postgres")
    assert "Same table as store &#x27;default&#x27;" in section(html, "sqlite")


def test_all_stores_page_is_linked_from_site_index_app_index_and_changelist(
    admin_client: Client,
) -> None:
    changelist = admin_client.get(CHANGELIST).content.decode()
    entry = f'<a href="{STORES_ENTRY}">Locks in every store</a>'

    for index in ("/admin/", "/admin/django_keel_lock/"):
        assert entry in admin_client.get(index).content.decode(), index
    assert admin_client.get(STORES_ENTRY)["Location"] == STORES_PAGE
    assert f'href="{STORES_PAGE}"' in changelist


def test_all_stores_entry_is_for_whoever_may_view_locks_only(viewer_client: Client) -> None:
    nobody = staff_client()

    assert f'href="{STORES_ENTRY}"' in viewer_client.get("/admin/").content.decode()
    assert viewer_client.get(STORES_ENTRY)["Location"] == STORES_PAGE
    assert f'href="{STORES_ENTRY}"' not in nobody.get("/admin/").content.decode()
    assert nobody.get(STORES_ENTRY).status_code == 403


def test_all_stores_page_caps_rows_per_store_and_pages_on(
    admin_client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(LockAdmin, "store_page_size", 3)
    prefix = key_of("cap")
    handles = [lock(f"{prefix}:{n}", store="memory", ttl=60) for n in range(5)]
    for handle in handles:
        assert handle.acquire()

    first = section(admin_client.get(STORES_PAGE, {"prefix": prefix}).content.decode(), "memory")
    second = admin_client.get(STORES_PAGE, {"prefix": prefix, "store": "memory", "start": "3"})
    rest = second.content.decode()

    assert first.count('class="keel-lock"') == 3
    assert "More are held" in first and "start=3" in first
    assert rest.count('class="keel-lock"') == 2
    assert 'data-store="sqlite"' not in rest
    shown = {h.key for h in handles if f'data-key="{h.key}"' in first + rest}
    assert shown == {h.key for h in handles}
    for handle in handles:
        handle.release()


class UnreachableStore(MemoryLockStore):
    """A store whose server refuses connections: listing it fails like a real one would."""

    def iter_locks(self, prefix: str = "") -> Iterator[LockInfo]:
        try:
            socket.create_connection(("127.0.0.1", 1), timeout=1).close()
        except OSError as exc:
            raise LockStoreUnavailable(f"lock store {self.alias!r} cannot connect: {exc}") from exc
        yield from super().iter_locks(prefix)


def test_unreachable_or_broken_store_shows_an_error_not_a_500(admin_client: Client) -> None:
    stores = {
        **settings.KEEL_LOCK_STORES,
        "down": {"BACKEND": "tests.test_admin.UnreachableStore"},
        "typo": {"BACKEND": "django_keel_lock.stores.NoSuchStore"},
    }
    with override_settings(KEEL_LOCK_STORES=stores):
        handle = lock(key_of("alive"), store="memory", ttl=60)
        assert handle.acquire()
        response = admin_client.get(STORES_PAGE)
        html = response.content.decode()
        handle.release()

    assert response.status_code == 200
    assert "LockStoreUnavailable" in section(html, "down")
    assert "cannot connect" in section(html, "down")
    assert "ImproperlyConfigured" in section(html, "typo")
    assert handle.key in section(html, "memory")


def test_all_stores_page_needs_view_permission() -> None:
    nobody = staff_client()

    assert nobody.get(STORES_PAGE).status_code == 403
    assert Client().get(STORES_PAGE).status_code == 302  # to the login page


# -- force release ------------------------------------------------------------------------------
def test_force_release_needs_the_permission(
    viewer_client: Client, hold_elsewhere: Callable[..., HeldElsewhere]
) -> None:
    held = hold_elsewhere("sqlite")

    stores_html = viewer_client.get(STORES_PAGE).content.decode()
    changelist = viewer_client.get(CHANGELIST, {"q": held.key}).content.decode()
    confirm = viewer_client.get(RELEASE, {"store": "sqlite", "key": held.key})
    post = viewer_client.post(
        RELEASE, {"store": "sqlite", "key": held.key, "fence": held.fence, "post": "yes"}
    )
    action = viewer_client.post(
        CHANGELIST,
        {
            "action": "force_release_selected",
            "_selected_action": [held.key],
            "post": "yes",
            "fences": json.dumps({held.key: held.fence}),
        },
    )

    assert held.key in stores_html and "Force release" not in stores_html
    assert "force_release_selected" not in changelist
    assert confirm.status_code == 403 and post.status_code == 403
    assert action.status_code in (200, 302)
    info = get_lock_store("sqlite").get(held.key)
    assert info is not None and info.fence == held.fence
    assert not LogEntry.objects.filter(object_repr=held.key).exists()


def test_force_release_action_confirms_then_frees_and_logs(
    admin_client: Client,
    hold_elsewhere: Callable[..., HeldElsewhere],
    released_signals: list[dict[str, Any]],
    caplog: pytest.LogCaptureFixture,
    superuser: User,
) -> None:
    held = hold_elsewhere("sqlite")
    expired = lock(key_of("expired"), store="default", ttl=60)
    assert expired.acquire()
    expired.release()
    selected = [held.key, expired.key]
    every_row = f"{CHANGELIST}?state=all"  # the list they were selected from

    confirm = admin_client.post(
        every_row, {"action": "force_release_selected", "_selected_action": selected}
    )
    page = confirm.content.decode()
    assert confirm.status_code == 200
    assert "Yes, force release" in page and held.holder in page
    assert expired.key in page  # listed as "not held, left alone"
    assert f'href="{every_row}" class="button cancel-link"' in page  # back to that list
    assert get_lock_store("sqlite").get(held.key) is not None  # nothing released yet
    assert held.owner not in page

    with caplog.at_level(logging.WARNING, logger="django_keel_lock"):
        done = admin_client.post(
            every_row,
            {
                "action": "force_release_selected",
                "_selected_action": selected,
                "post": "yes",
                "fences": json.dumps({held.key: held.fence}),
            },
            follow=True,
        )

    assert done.status_code == 200
    assert "Force-released 1 lock" in done.content.decode()
    assert get_lock_store("sqlite").get(held.key) is None
    entry = LogEntry.objects.get(object_repr=held.key)
    assert entry.user_id == superuser.pk
    assert entry.action_flag == CHANGE
    assert entry.content_type == ContentType.objects.get_for_model(LockRow)
    assert entry.object_id == held.key
    assert "'default'" in entry.change_message
    assert held.holder in entry.change_message and str(held.fence) in entry.change_message
    assert not LogEntry.objects.filter(object_repr=expired.key).exists()
    assert [(s["key"], s["store"], s["info"].fence, s["user"]) for s in released_signals] == [
        (held.key, "default", held.fence, superuser)
    ]
    assert any(
        r.levelno == logging.WARNING
        and held.key in r.getMessage()
        and "force-released" in r.getMessage()
        for r in caplog.records
    )


@pytest.mark.parametrize("alias", store_params(["postgres", "memory", "mariadb", "redis"]))
def test_force_release_button_frees_a_lock_of_any_store(
    alias: str,
    admin_client: Client,
    hold_elsewhere: Callable[..., HeldElsewhere],
    released_signals: list[dict[str, Any]],
) -> None:
    if alias == "memory":  # per process: hold it in this one
        handle = lock(key_of("memory"), store="memory", ttl=60)
        assert handle.acquire()
        key, fence, holder = handle.key, handle.fence, handle.holder
    else:
        held = hold_elsewhere(alias)
        key, fence, holder = held.key, held.fence, held.holder
    stores_html = admin_client.get(STORES_PAGE).content.decode()
    assert key in section(stores_html, alias)

    confirm = admin_client.get(RELEASE, {"store": alias, "key": key})
    assert confirm.status_code == 200
    assert "Yes, force release" in confirm.content.decode()
    assert get_lock_store(alias).get(key) is not None

    done = admin_client.post(
        RELEASE, {"store": alias, "key": key, "fence": fence, "post": "yes"}, follow=True
    )

    html = done.content.decode()
    assert done.redirect_chain[-1][0] == STORES_PAGE
    assert f"Force-released &#x27;{key}&#x27; in store &#x27;{alias}&#x27;" in html
    assert f'data-key="{key}"' not in html
    assert get_lock_store(alias).get(key) is None
    entry = LogEntry.objects.get(object_repr=key)
    assert entry.object_id is None  # not a row of the changelist's database
    assert f"store '{alias}'" in entry.change_message and holder in entry.change_message
    assert [(s["key"], s["store"]) for s in released_signals] == [(key, alias)]


def test_force_release_leaves_a_lock_taken_again_since_confirmation(
    admin_client: Client,
) -> None:
    first = lock(key_of("retaken"), store="memory", ttl=60)
    assert first.acquire()
    confirmed_fence = first.fence
    first.release()
    second = lock(first.key, store="memory", ttl=60)
    assert second.acquire()

    done = admin_client.post(
        RELEASE,
        {"store": "memory", "key": first.key, "fence": confirmed_fence, "post": "yes"},
        follow=True,
    )

    assert "taken again since you confirmed" in done.content.decode()
    info = get_lock_store("memory").get(first.key)
    assert info is not None and info.fence == second.fence
    assert not LogEntry.objects.filter(object_repr=first.key).exists()
    second.release()


def test_staff_with_only_the_force_release_permission_can_release(
    hold_elsewhere: Callable[..., HeldElsewhere],
) -> None:
    client = staff_client("view_lock", "force_release_lock")
    held = hold_elsewhere("sqlite")

    response = client.post(
        RELEASE, {"store": "sqlite", "key": held.key, "fence": held.fence, "post": "yes"}
    )

    assert response.status_code == 302
    assert get_lock_store("sqlite").get(held.key) is None
    assert LogEntry.objects.filter(object_repr=held.key).count() == 1


def test_force_release_requires_csrf_token(superuser: User) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(superuser)
    handle = lock(key_of("csrf"), store="memory", ttl=60)
    assert handle.acquire()

    response = client.post(
        RELEASE, {"store": "memory", "key": handle.key, "fence": handle.fence, "post": "yes"}
    )

    assert response.status_code == 403
    assert get_lock_store("memory").get(handle.key) is not None
    handle.release()


def test_force_release_of_unknown_store_or_free_key_is_a_message(admin_client: Client) -> None:
    unknown = admin_client.get(RELEASE, {"store": "nope", "key": "k"}, follow=True)
    free = admin_client.get(RELEASE, {"store": "memory", "key": key_of("free")}, follow=True)
    offsite = admin_client.get(
        RELEASE, {"store": "nope", "key": "k", "next": "https://evil.example/"}
    )

    assert "There is no lock store &#x27;nope&#x27;" in unknown.content.decode()
    assert "is not held in store" in free.content.decode()
    assert offsite["Location"] == STORES_PAGE


# -- semaphores and shared locks ----------------------------------------------------------
def test_all_stores_page_lists_each_permit_and_releases_one_by_its_fence(
    admin_client: Client,
) -> None:
    key = key_of("permits")
    permits = [semaphore(key, limit=3, store="memory", ttl=60) for _ in range(3)]
    assert all(p.acquire() for p in permits)
    html = section(admin_client.get(STORES_PAGE).content.decode(), "memory")
    assert html.count(f'data-key="{key}"') == 3 and html.count("<td>semaphore</td>") >= 3
    target = permits[1]
    url = f"fence={target.fence}&amp;one=1"
    assert url in html  # each row's button releases that permit only

    confirm = admin_client.get(RELEASE, {"store": "memory", "key": key, "fence": target.fence,
                                         "one": "1"}).content.decode()  # fmt: skip
    assert confirm.count("<td>semaphore</td>") == 1 and f"<td>{target.fence}</td>" in confirm
    done = admin_client.post(
        RELEASE,
        {"store": "memory", "key": key, "fence": target.fence, "one": "1", "post": "yes"},
        follow=True,
    )
    assert f"fence {target.fence}" in done.content.decode()
    assert not target.is_owned()
    assert permits[0].is_owned() and permits[2].is_owned()
    assert LogEntry.objects.filter(object_repr=key).count() == 1


def test_releasing_a_key_frees_every_holder_confirmed_and_not_one_that_came_after(
    admin_client: Client,
) -> None:
    key = key_of("readers")
    readers = [lock(key, shared=True, store="memory", ttl=60) for _ in range(2)]
    assert all(r.acquire() for r in readers)
    confirm = admin_client.get(RELEASE, {"store": "memory", "key": key}).content.decode()
    assert confirm.count("<td>shared</td>") == 2
    confirmed = max(r.fence for r in readers)  # type: ignore[type-var]
    late = lock(key, shared=True, store="memory", ttl=60)
    assert late.acquire()  # while the person was reading the page
    admin_client.post(RELEASE, {"store": "memory", "key": key, "fence": confirmed, "post": "yes"})
    assert not readers[0].is_owned() and not readers[1].is_owned()
    assert late.is_owned() and late.release()


# -- a confirmation that does not say what it confirmed ------------------------------------------
@pytest.mark.parametrize(
    "form",
    [{}, {"fence": "garbage"}, {"fence": ""}, {"fence": "garbage", "one": "1"}],
    ids=["fence-missing", "fence-garbage", "fence-empty", "one-garbage"],
)
def test_force_release_post_without_a_fence_releases_nothing_and_sends_back_to_confirm(
    admin_client: Client, form: dict[str, str]
) -> None:
    key = key_of("nofence")
    readers = [lock(key, shared=True, store="memory", ttl=60) for _ in range(2)]
    assert all(r.acquire() for r in readers)
    confirm = admin_client.get(RELEASE, {"store": "memory", "key": key}).content.decode()
    assert confirm.count("<td>shared</td>") == 2
    late = lock(key, shared=True, store="memory", ttl=60)
    assert late.acquire()  # came after the page was shown

    done = admin_client.post(RELEASE, {"store": "memory", "key": key, "post": "yes", **form})

    assert done.status_code == 302
    assert done["Location"].startswith(f"{RELEASE}?")  # the confirmation page, shown again
    again = admin_client.get(done["Location"]).content.decode()
    assert "Nothing was released" in again and "not a number" in again
    assert again.count("<td>shared</td>") == 3  # every holder now, the late one included
    assert all(handle.is_owned() for handle in (*readers, late))
    assert not LogEntry.objects.filter(object_repr=key).exists()
    for handle in (*readers, late):
        handle.release()


@pytest.mark.parametrize("fences", [None, "garbage", "[1, 2]"], ids=["missing", "garbage", "list"])
def test_force_release_action_without_readable_fences_releases_nothing(
    admin_client: Client, fences: str | None
) -> None:
    handle = lock(key_of("action-nofence"), store="default", ttl=60)
    assert handle.acquire()
    form = {"action": "force_release_selected", "_selected_action": [handle.key], "post": "yes"}

    done = admin_client.post(
        CHANGELIST, {**form, **({} if fences is None else {"fences": fences})}, follow=True
    )

    assert "Nothing was released" in done.content.decode()
    assert handle.is_owned()
    assert not LogEntry.objects.filter(object_repr=handle.key).exists()
    handle.release()


# -- keys held together (a multi-key lock) ---------------------------------------------------
def _take_together(alias: str, keys: tuple[str, ...]) -> str:
    owner = uuid.uuid4().hex
    assert get_lock_store(alias).acquire_many(tuple(sorted(keys)), owner, "web-5:42", 60).acquired
    return owner


@pytest.mark.parametrize("alias", store_params(["memory", "redis"]))
def test_all_stores_page_shows_keys_held_together_as_one_holder(
    alias: str, admin_client: Client
) -> None:
    key = key_of("together")
    owner = _take_together(alias, (f"{key}:a", f"{key}:b"))
    html = section(admin_client.get(STORES_PAGE, {"prefix": key}).content.decode(), alias)
    get_lock_store(alias).release_many((f"{key}:a", f"{key}:b"), owner)
    row_a = html[html.index(f'data-key="{key}:a"') : html.index(f'data-key="{key}:b"')]
    assert f"held together with {key}:b" in row_a
    assert f"held together with {key}:a" in html[html.index(f'data-key="{key}:b"') :]
    assert owner not in html


@pytest.mark.parametrize("alias", store_params(["memory", "postgres"]))
def test_force_release_of_one_key_frees_every_key_held_with_it(
    alias: str, admin_client: Client, released_signals: list[dict[str, Any]]
) -> None:
    key = key_of("together")
    keys = (f"{key}:a", f"{key}:b", f"{key}:c")
    _take_together(alias, keys)
    fence = get_lock_store(alias).get(f"{key}:b").fence  # type: ignore[union-attr]

    confirm = admin_client.get(RELEASE, {"store": alias, "key": f"{key}:b"}).content.decode()
    assert f"held together with {key}:a + {key}:c" in confirm
    assert "released too" in confirm
    done = admin_client.post(
        RELEASE, {"store": alias, "key": f"{key}:b", "fence": fence, "post": "yes"}, follow=True
    )

    html = done.content.decode()
    assert f"with &#x27;{key}:a&#x27;, &#x27;{key}:c&#x27;" in html
    assert all(get_lock_store(alias).get(each) is None for each in keys)
    assert sorted(s["key"] for s in released_signals) == list(keys)
    assert sorted(LogEntry.objects.filter(object_repr__startswith=key).values_list(
        "object_repr", flat=True)) == list(keys)  # fmt: skip
