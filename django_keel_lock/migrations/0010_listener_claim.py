from __future__ import annotations

from importlib import import_module

from django.db import migrations

from django_keel_lock.migrations._operations import VendorSQL

_GRANT = import_module("django_keel_lock.migrations.0009_waiter_grant")

# Whether the waiter's listener connection is there, as 0009's release asked it: a snapshot
# of every backend's status (pg_stat_get_activity copies them all, activity text included),
# the dearest step of a release that hands over.
_SNAPSHOT = "EXISTS (SELECT FROM pg_stat_get_activity(v_first.listener::integer))"
# As this one asks it: the listener's connection holds the advisory lock (1801807212, its
# backend pid) for as long as it listens (`PostgresDialect.listener_sql`), so a shared try
# of it fails exactly while that connection is there (one lookup in the lock table; taken,
# it ends with the release's transaction). A backend that reuses the pid holds no such lock:
# no grant is carried to an address nobody listens on. A listener of code from before this
# migration takes no such lock: its waiters get the short grant and a wake-up, as a waiter
# whose listener is away, and take it up with a call.
_CLAIM = "NOT pg_try_advisory_xact_lock_shared(1801807212, v_first.listener::integer)"

assert _GRANT.RELEASE.count(_SNAPSHOT) == 1
RELEASE = _GRANT.RELEASE.replace(_SNAPSHOT, _CLAIM)


class Migration(migrations.Migration):
    """The PostgreSQL release that hands over asks whether the waiter's process listens by
    its listener's advisory lock, not by a snapshot of every backend."""

    dependencies = [("django_keel_lock", "0009_waiter_grant")]

    operations = [
        VendorSQL(
            forwards={"postgresql": [RELEASE]},
            backwards={"postgresql": [_GRANT.RELEASE]},
            description="The release that hands over asks the listener's advisory lock",
        ),
    ]
