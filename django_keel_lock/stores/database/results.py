"""Idempotent results of a `DatabaseLockStore`: the `IdempotentResult` table, on the store's
database.

The write is one statement, INSERT ... SELECT from the key's lock row: a row is written only
while that row has the writer as its live owner (by the database's clock), and an existing
result is replaced only by one of a later fence. Reads, listings and deletes go through the
ORM. Expired rows are deleted every CLEAN_EVERY writes of a process, CLEAN_BATCH at a time.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from django.db import DatabaseError, connections
from django.db.models import QuerySet
from django.db.models.functions import Now

from ...exceptions import LockStoreUnavailable
from ...models import IdempotentResult
from ..results import ResultStore, StoredResult

CLEAN_EVERY = 100
CLEAN_BATCH = 1000
PAGE_SIZE = 500

_SQLITE_NOW = "strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now')"
_COLUMNS = "(key, fingerprint, fence, status, data, size, created_at, expires_at)"
# Per vendor: the fenced upsert, and the ttl as its parameter. The lock row's own expiry is
# read by the clock the lock store writes it with.
_SAVE: Mapping[str, str] = {
    "postgresql": f"""
        INSERT INTO django_keel_lock_result AS r {_COLUMNS}
        SELECT %s, %s, %s, %s, %s, %s, clock_timestamp(),
               clock_timestamp() + make_interval(secs => %s)
        FROM django_keel_lock_lock l
        WHERE l.key = %s AND l.owner = %s AND l.expires_at > clock_timestamp()
        FOR SHARE
        ON CONFLICT (key) DO UPDATE SET
            fingerprint = EXCLUDED.fingerprint, fence = EXCLUDED.fence,
            status = EXCLUDED.status, data = EXCLUDED.data, size = EXCLUDED.size,
            created_at = EXCLUDED.created_at, expires_at = EXCLUDED.expires_at
        WHERE r.fence < EXCLUDED.fence OR r.expires_at <= clock_timestamp()
    """,
    # Through Django's cursor, as the ORM writes: %s placeholders, %% for a percent sign.
    "sqlite": f"""
        INSERT INTO django_keel_lock_result AS r {_COLUMNS}
        SELECT %s, %s, %s, %s, %s, %s, {_SQLITE_NOW}, strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now', %s)
        FROM django_keel_lock_lock l
        WHERE l.key = %s AND l.owner = %s AND l.expires_at > {_SQLITE_NOW}
        ON CONFLICT (key) DO UPDATE SET
            fingerprint = excluded.fingerprint, fence = excluded.fence,
            status = excluded.status, data = excluded.data, size = excluded.size,
            created_at = excluded.created_at, expires_at = excluded.expires_at
        WHERE r.fence < excluded.fence OR r.expires_at <= {_SQLITE_NOW}
    """,
    # MariaDB applies the SET assignments left to right: the condition reads `fence` and
    # `expires_at`, so they come last.
    "mysql": """
        INSERT INTO django_keel_lock_result
            (`key`, fingerprint, fence, status, data, size, created_at, expires_at)
        SELECT %s, %s, %s, %s, %s, %s, UTC_TIMESTAMP(6),
               UTC_TIMESTAMP(6) + INTERVAL %s MICROSECOND
        FROM django_keel_lock_lock l
        WHERE l.`key` = %s AND l.owner = %s AND l.expires_at > UTC_TIMESTAMP(6)
        LOCK IN SHARE MODE
        ON DUPLICATE KEY UPDATE
            fingerprint = IF({newer}, VALUES(fingerprint), r.fingerprint),
            status = IF({newer}, VALUES(status), r.status),
            data = IF({newer}, VALUES(data), r.data),
            size = IF({newer}, VALUES(size), r.size),
            created_at = IF({newer}, VALUES(created_at), r.created_at),
            expires_at = IF({newer}, VALUES(expires_at), r.expires_at),
            fence = IF(r.fence < VALUES(fence), VALUES(fence), r.fence)
    """.replace("r.", "django_keel_lock_result.").replace(
        "{newer}",
        "(django_keel_lock_result.fence < VALUES(fence)"
        " OR django_keel_lock_result.expires_at <= UTC_TIMESTAMP(6))",
    ),
}

_FENCE_OF = "SELECT fence FROM django_keel_lock_result WHERE `key` = %s"


def _ttl_param(vendor: str, ttl: float) -> Any:
    if vendor == "sqlite":
        return f"+{ttl:.3f} seconds"  # a strftime modifier
    if vendor == "mysql":
        return round(ttl * 1_000_000)
    return ttl


class DatabaseResults(ResultStore):
    """Results in the `IdempotentResult` table of the DATABASES alias `database`."""

    def __init__(self, database: str, alias: str = "default") -> None:
        self.database = database
        self.alias = alias  # the lock store's, for messages
        self._writes = itertools.count(1)
        self._mutex = threading.Lock()

    def _unavailable(self, exc: Exception) -> LockStoreUnavailable:
        return LockStoreUnavailable(
            f"lock store {self.alias!r} (database {self.database!r}) cannot read or keep "
            f"idempotent results: {exc}"
        )

    def _rows(self) -> QuerySet[IdempotentResult]:
        return IdempotentResult.objects.using(self.database)

    def get(self, key: str) -> StoredResult | None:
        try:
            row = self._rows().filter(key=key, expires_at__gt=Now()).first()
        except DatabaseError as exc:
            raise self._unavailable(exc) from exc
        return None if row is None else _result(row)

    def save(self, key: str, owner: str, fence: int, result: StoredResult, ttl: float) -> bool:
        connection = connections[self.database]
        vendor = connection.vendor
        params = (
            key, result.fingerprint, fence, result.status, result.data, result.size,
            _ttl_param(vendor, ttl), key, owner,
        )  # fmt: skip
        try:
            with connection.cursor() as cursor:
                cursor.execute(_SAVE[vendor], params)
                kept: bool = cursor.rowcount > 0
                if vendor == "mysql" and cursor.rowcount == 1:
                    # Django connects with CLIENT_FOUND_ROWS: 1 is a row inserted, or one
                    # left as it was (2: updated). The fence tells: no one else writes ours.
                    cursor.execute(_FENCE_OF, (key,))
                    row = cursor.fetchone()
                    kept = row is not None and int(row[0]) == fence
        except DatabaseError as exc:
            raise self._unavailable(exc) from exc
        with self._mutex:
            clean = next(self._writes) % CLEAN_EVERY == 0
        if clean:
            self.prune(CLEAN_BATCH)
        return kept

    def forget(self, key: str) -> bool:
        try:
            deleted, _ = self._rows().filter(key=key).delete()
        except DatabaseError as exc:
            raise self._unavailable(exc) from exc
        return deleted > 0

    def iter_results(self, prefix: str = "") -> Iterator[StoredResult]:
        last = None
        while True:
            rows = self._rows().filter(key__startswith=prefix, expires_at__gt=Now())
            if last is not None:
                rows = rows.filter(key__gt=last)
            try:
                page = list(rows.order_by("key")[:PAGE_SIZE])
            except DatabaseError as exc:
                raise self._unavailable(exc) from exc
            yield from (_result(row) for row in page)
            if len(page) < PAGE_SIZE:
                return
            last = page[-1].key

    def prune(self, batch: int | None = None) -> int:
        """Delete expired rows (`batch`: at most that many); how many."""
        pruned = 0
        try:
            while True:
                keys = list(
                    self._rows()
                    .filter(expires_at__lte=Now())
                    .order_by()
                    .values_list("key", flat=True)[: batch or CLEAN_BATCH]
                )
                if not keys:
                    return pruned
                deleted, _ = self._rows().filter(key__in=keys, expires_at__lte=Now()).delete()
                pruned += deleted
                if batch is not None or len(keys) < CLEAN_BATCH:
                    return pruned
        except DatabaseError as exc:
            raise self._unavailable(exc) from exc


def _result(row: IdempotentResult) -> StoredResult:
    return StoredResult(
        key=row.key,
        fingerprint=row.fingerprint,
        fence=row.fence,
        status=row.status,
        data=bytes(row.data),
        created_at=row.created_at,
    )
