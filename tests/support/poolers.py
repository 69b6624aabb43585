"""Database stores behind poolers, for tests/test_database_pooler*.py: a PgBouncer of the
session's own in transaction mode (a pool of 2 server connections, so clients really share
them) and Django's own pool (psycopg_pool), each a DATABASES alias on the test PostgreSQL
database and a KEEL_LOCK_STORES alias of the same name.

- "pgbouncer": the store through PgBouncer, its listener on the direct "postgres" alias
  (OPTIONS LISTEN_DATABASE);
- "pgbouncer-polling": the same without LISTEN_DATABASE (its waiters poll);
- "django-pool": DATABASES OPTIONS "pool": {"min_size": 1, "max_size": 4}.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest
from django.conf import settings
from django.db import connections
from django.test.utils import override_settings

from django_keel_lock.registry import reset_stores
from tests.conftest import skip_or_fail

from .pgbouncer import PGBOUNCER, PgBouncer, pgbouncer

POOLED_STORES = ["pgbouncer", "django-pool"]
DJANGO_POOL = {"min_size": 1, "max_size": 4}


def store_config(database: str, **options: Any) -> dict[str, Any]:
    return {
        "BACKEND": "django_keel_lock.stores.DatabaseLockStore",
        "OPTIONS": {"DATABASE": database, **options},
    }


@contextmanager
def pooled_stores() -> Iterator[PgBouncer]:
    """The aliases above while the block runs (their PgBouncer yielded); then they are gone,
    their stores closed and the PgBouncer stopped."""
    direct = connections.settings["postgres"]
    with ExitStack() as stack:
        bouncer = stack.enter_context(pgbouncer(direct, pool_size=2))
        added = {
            "pgbouncer": bouncer.settings(direct),
            "django-pool": {
                **direct,
                "OPTIONS": {**direct.get("OPTIONS", {}), "pool": DJANGO_POOL},
            },
        }
        for alias, entry in added.items():
            connections.settings[alias] = entry
        stores = {
            **settings.KEEL_LOCK_STORES,
            "pgbouncer": store_config("pgbouncer", LISTEN_DATABASE="postgres"),
            "pgbouncer-polling": store_config("pgbouncer"),
            "django-pool": store_config("django-pool"),
        }
        stack.enter_context(override_settings(KEEL_LOCK_STORES=stores))
        try:
            yield bouncer
        finally:
            reset_stores()
            for alias in added:
                connections[alias].close()
                if alias == "django-pool":
                    connections[alias].close_pool()
                del connections[alias]
                del connections.settings[alias]


@pytest.fixture(scope="module")
def pooled(_databases: None) -> Iterator[PgBouncer]:
    """`pooled_stores()` for a test module (imported there: `from tests.support.poolers import
    pooled`)."""
    if "postgres" not in connections.settings:
        skip_or_fail("SERVER UNAVAILABLE: PostgreSQL is not reachable")
    if not shutil.which("pgbouncer") and not os.path.exists(PGBOUNCER):
        skip_or_fail("pgbouncer is not installed (apt-get install pgbouncer)")
    with pooled_stores() as bouncer:
        yield bouncer
