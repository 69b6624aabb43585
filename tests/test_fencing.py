"""fenced_update: a row refuses writes from a holder whose fence is older than the last writer's,
checked and written in one UPDATE; and the classic failure it exists for, a paused holder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from django.contrib.auth.models import Group
from django.db.models import F

from django_keel_lock import lock
from django_keel_lock.fencing import FencedModel, FenceField, fence_field_name, fenced_update
from tests.testapp.models import Document, Invoice

from .conftest import store_params
from .support import ROOT

DATABASE_OF = {"sqlite": "default", "postgres": "postgres", "mariadb": "mariadb"}
DATABASE_STORES = store_params(list(DATABASE_OF))


@pytest.mark.parametrize("alias", DATABASE_STORES)
def test_only_writers_with_a_fence_at_least_the_stored_one_land(alias: str) -> None:
    db = DATABASE_OF[alias]
    invoice = Invoice.objects.using(db).create()
    rows = Invoice.objects.using(db).filter(pk=invoice.pk)
    assert invoice.fence == 0
    assert fenced_update(rows, fence=5, status="charged") == 1
    assert fenced_update(rows, fence=5, writes=F("writes") + 1) == 1  # same holder again
    assert fenced_update(rows, fence=4, status="stale") == 0  # an older holder: refused
    assert fenced_update(rows, fence=9, writes=F("writes") + 1) == 1
    assert fenced_update(rows, fence=8, status="stale") == 0
    invoice.refresh_from_db()
    assert (invoice.status, invoice.writes, invoice.fence) == ("charged", 2, 9)


@pytest.mark.parametrize("alias", DATABASE_STORES)
def test_a_queryset_of_several_rows_updates_only_the_ones_not_written_by_newer_holders(
    alias: str,
) -> None:
    db = DATABASE_OF[alias]
    old, new = Invoice.objects.using(db).create(fence=3), Invoice.objects.using(db).create(fence=7)
    rows = Invoice.objects.using(db).filter(pk__in=[old.pk, new.pk])
    assert fenced_update(rows, fence=5, status="batch") == 1
    old.refresh_from_db()
    new.refresh_from_db()
    assert (old.status, old.fence) == ("batch", 5)
    assert (new.status, new.fence) == ("new", 7)


@pytest.mark.parametrize("alias", DATABASE_STORES)
def test_fences_from_real_locks_refuse_the_holder_that_was_taken_over(alias: str, key: str) -> None:
    db = DATABASE_OF[alias]
    invoice = Invoice.objects.using(db).create()
    rows = Invoice.objects.using(db).filter(pk=invoice.pk)
    stale = lock(key, store=alias, ttl=0.3)
    assert stale.acquire()
    time.sleep(0.45)
    with lock(key, store=alias, ttl=30) as fresh:
        assert fresh.fence is not None
        assert fenced_update(rows, fence=fresh.fence, status="fresh") == 1
    assert stale.fence is not None
    assert fenced_update(rows, fence=stale.fence, status="stale") == 0
    invoice.refresh_from_db()
    assert (invoice.status, invoice.fence) == ("fresh", fresh.fence)


def test_the_fence_field_is_found_by_type_whatever_its_name() -> None:
    assert fence_field_name(Invoice) == "fence"
    assert fence_field_name(Document) == "writer_fence"
    document = Document.objects.create()
    rows = Document.objects.filter(pk=document.pk)
    assert fenced_update(rows, fence=2, version=F("version") + 1) == 1
    assert fenced_update(rows, fence=1, field="writer_fence", body="stale") == 0
    document.refresh_from_db()
    assert (document.version, document.writer_fence, document.body) == (1, 2, "")
    assert issubclass(Invoice, FencedModel)
    field = Invoice._meta.get_field("fence")
    assert isinstance(field, FenceField) and field.default == 0 and not field.editable


def test_bad_arguments_say_what_is_wrong() -> None:
    rows = Invoice.objects.none()
    with pytest.raises(TypeError, match=r"fence must be an int.*is the lock held"):
        fenced_update(rows, fence=None, status="x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="fence must be an int"):
        fenced_update(rows, fence=True, status="x")
    with pytest.raises(TypeError, match="fence must be an int"):
        fenced_update(rows, fence="3", status="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fence must be >= 0"):
        fenced_update(rows, fence=-1, status="x")
    with pytest.raises(ValueError, match="fenced_update records the fence"):
        fenced_update(Document.objects.none(), fence=3, writer_fence=4)
    with pytest.raises(TypeError, match=r"auth\.Group has no FenceField"):
        fenced_update(Group.objects.none(), fence=3, name="x")
    with pytest.raises(TypeError, match=r"'version' of testapp\.Document is not a FenceField"):
        fenced_update(Document.objects.none(), fence=3, field="version", body="x")


# -- a holder paused past its ttl --------------------------------------------------------

PAUSED_HOLDER = """
import json, sys, time
from tests.support.child import setup_django
setup_django()
from django.db.models import F
from django_keel_lock import lock
from django_keel_lock.fencing import fenced_update
from tests.testapp.models import Invoice

store, db, key, pk = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
held = lock(key, store=store, ttl=1)
assert held.acquire()
print(json.dumps({"fence": held.fence}), flush=True)
time.sleep(0.5)  # the parent stops us in here, for longer than the ttl
rows = Invoice.objects.using(db).filter(pk=pk)
print(json.dumps({"rows": fenced_update(rows, fence=held.fence, status="stale",
                                        writes=F("writes") + 1)}), flush=True)
"""


@pytest.mark.parametrize("alias", DATABASE_STORES)
def test_a_holder_paused_past_its_ttl_has_its_write_refused_after_it_resumes(
    alias: str, key: str
) -> None:
    db = DATABASE_OF[alias]
    invoice = Invoice.objects.using(db).create()
    rows = Invoice.objects.using(db).filter(pk=invoice.pk)
    child = subprocess.Popen(
        [sys.executable, "-c", PAUSED_HOLDER, alias, db, key, str(invoice.pk)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        old_fence = json.loads(child.stdout.readline())["fence"]
        os.kill(child.pid, signal.SIGSTOP)  # a GC pause, a frozen VM: it knows nothing
        fresh = lock(key, store=alias, ttl=30)
        deadline = time.monotonic() + 10
        while not fresh.acquire():  # the paused holder's lock runs out
            assert time.monotonic() < deadline, "the paused holder's lock never expired"
            time.sleep(0.05)
        assert fresh.fence is not None and fresh.fence > old_fence
        assert fenced_update(rows, fence=fresh.fence, status="fresh", writes=F("writes") + 1) == 1
        os.kill(child.pid, signal.SIGCONT)
        resumed = json.loads(child.stdout.readline())
        assert child.wait(timeout=30) == 0
    finally:
        os.kill(child.pid, signal.SIGCONT) if child.poll() is None else None
        child.kill()
        child.wait()
    assert resumed == {"rows": 0}, "the stale holder's write landed"
    invoice.refresh_from_db()
    assert (invoice.status, invoice.writes, invoice.fence) == ("fresh", 1, fresh.fence)
    assert fresh.release()
