"""Idempotent results of a `DatabaseLockStore`: the `IdempotentResult` table, on the store's
database.

The write is one statement, INSERT ... SELECT from the key's lock row: a row is written only
while that row has the writer as its live owner (by the database's clock), and an existing
result is replaced only by one of a later fence. Reads and writes go through the lock store's
own connection, as its locks do: outside the caller's transaction, whose snapshot (REPEATABLE
READ) may be older than the result a waiting duplicate must find. Listings and deletes (the
command, the admin) go through the ORM. Every comparison with "now" is by the clock the lock
store writes with (UTC_TIMESTAMP on MySQL, not the session time zone's CURRENT_TIMESTAMP).
Expired rows are deleted every CLEAN_EVERY writes of a process, CLEAN_BATCH at a time.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError, connections
from django.db.models import DateTimeField, Func, QuerySet
from django.db.models.functions import Now

from ...exceptions import LockStoreUnavailable
from ...models import IdempotentResult
from ..results import Release, ResultStore, StoredResult

if TYPE_CHECKING:
    from .store import DatabaseLockStore

CLEAN_EVERY = 100
CLEAN_BATCH = 1000
PAGE_SIZE = 500

_SQLITE_NOW = "strftime('%Y-%m-%d %H:%M:%f', 'now')"
_COLUMNS = "(key, fingerprint, fence, status, data, size, created_at, expires_at)"
#: PostgreSQL: what an upsert of a result does with a row of the key already there: replaced
#: by a newer acquisition's (a greater fence), or when it has expired; else kept.
_PG_KEEP_NEWER = """ON CONFLICT (key) DO UPDATE SET
            fingerprint = EXCLUDED.fingerprint, fence = EXCLUDED.fence,
            status = EXCLUDED.status, data = EXCLUDED.data, size = EXCLUDED.size,
            created_at = EXCLUDED.created_at, expires_at = EXCLUDED.expires_at
        WHERE r.fence < EXCLUDED.fence OR r.expires_at <= clock_timestamp()"""
# Per vendor: the fenced upsert, and the ttl as its parameter. The lock row's own expiry is
# read by the clock the lock store writes it with. Run on the lock store's raw driver cursor:
# %s placeholders for psycopg and MySQLdb, ? for sqlite3.
_SAVE: Mapping[str, str] = {
    "postgresql": f"""
        INSERT INTO django_keel_lock_result AS r {_COLUMNS}
        SELECT %s, %s, %s, %s, %s, %s, clock_timestamp(),
               clock_timestamp() + make_interval(secs => %s)
        FROM django_keel_lock_lock l
        WHERE l.key = %s AND l.owner = %s AND l.expires_at > clock_timestamp()
        FOR SHARE
        {_PG_KEEP_NEWER}
    """,
    # On the lock store's own (raw sqlite3) cursor: ? placeholders.
    "sqlite": f"""
        INSERT INTO django_keel_lock_result AS r {_COLUMNS}
        SELECT ?, ?, ?, ?, ?, ?, {_SQLITE_NOW}, strftime('%Y-%m-%d %H:%M:%f', 'now', ?)
        FROM django_keel_lock_lock l
        WHERE l.key = ? AND l.owner = ? AND l.expires_at > {_SQLITE_NOW}
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

# PostgreSQL: a request's read of its key's result and its write of the response, each in the
# statement that releases the key's lock (`release_text`), so a request costs a round trip
# less. The write keeps the result only through the lock the release found its owner
# holding (INSERT ... SELECT FROM released), then as _SAVE does.
_PG_KEEP_RELEASING = f"""
    WITH released AS ({{release}}),
    kept AS (
        INSERT INTO django_keel_lock_result AS r {_COLUMNS}
        SELECT %s, %s, %s, %s, %s, %s, clock_timestamp(),
               clock_timestamp() + make_interval(secs => %s)
        FROM released
        {_PG_KEEP_NEWER}
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM released), (SELECT count(*) FROM kept)
"""
# The read releases the lock only when it finds a result: no row when there is none.
_PG_GET_RELEASING = """
    WITH found AS (
        SELECT fingerprint, fence, status, data FROM django_keel_lock_result
        WHERE key = %s AND expires_at > clock_timestamp()
    ),
    released AS ({release})
    SELECT (SELECT count(*) FROM released), fingerprint, fence, status, data FROM found
"""

_FENCE_OF = "SELECT fence FROM django_keel_lock_result WHERE `key` = %s"
# Per vendor: the live result of a key, by the lock store's clock.
_GET: Mapping[str, str] = {
    "postgresql": """
        SELECT fingerprint, fence, status, data FROM django_keel_lock_result
        WHERE key = %s AND expires_at > clock_timestamp()
    """,
    "sqlite": f"""
        SELECT fingerprint, fence, status, data FROM django_keel_lock_result
        WHERE key = ? AND expires_at > {_SQLITE_NOW}
    """,
    "mysql": """
        SELECT fingerprint, fence, status, data FROM django_keel_lock_result
        WHERE `key` = %s AND expires_at > UTC_TIMESTAMP(6)
    """,
}


def store_now(vendor: str) -> Func:
    """The ORM's "now" by the clock the lock store writes expiries with (the admin's too)."""
    if vendor == "mysql":
        return Func(template="UTC_TIMESTAMP(6)", output_field=DateTimeField())
    return Now()


def _ttl_param(vendor: str, ttl: float) -> Any:
    if vendor == "sqlite":
        return f"+{ttl:.3f} seconds"  # a strftime modifier
    if vendor == "mysql":
        return round(ttl * 1_000_000)
    return ttl


class DatabaseResults(ResultStore):
    """Results in the `IdempotentResult` table of the database of `store`."""

    def __init__(self, store: DatabaseLockStore) -> None:
        self.store = store
        self.database = store.database
        self.alias = store.alias  # for messages
        self._writes = itertools.count(1)
        self._mutex = threading.Lock()

    def _unavailable(self, exc: Exception) -> LockStoreUnavailable:
        return LockStoreUnavailable(
            f"lock store {self.alias!r} (database {self.database!r}) cannot read or keep "
            f"idempotent results: {exc}"
        )

    def _rows(self) -> QuerySet[IdempotentResult]:
        return IdempotentResult.objects.using(self.database)

    @property
    def _vendor(self) -> str:
        return str(connections[self.database].vendor)

    def get(self, key: str) -> StoredResult | None:
        rows, _ = self.store.execute([(_GET[self._vendor], (key,))], key=key)
        if not rows:
            return None
        fingerprint, fence, status, data = rows[0]
        return StoredResult(key, str(fingerprint), int(fence), int(status), bytes(data))

    def save(self, key: str, owner: str, fence: int, result: StoredResult, ttl: float) -> bool:
        vendor = self._vendor
        params = (
            key, result.fingerprint, fence, result.status, result.data, result.size,
            _ttl_param(vendor, ttl), key, owner,
        )  # fmt: skip
        # Not sent twice: a retry after a lost reply would find its own row and say "not kept".
        _, count = self.store.execute([(_SAVE[vendor], params)], idempotent=False, key=key)
        kept = count > 0
        if vendor == "mysql" and count == 1:
            # Django connects with CLIENT_FOUND_ROWS: 1 is a row inserted, or one left as it
            # was (2: updated). The fence tells: no one else writes ours.
            rows, _ = self.store.execute([(_FENCE_OF, (key,))], key=key)
            kept = bool(rows) and int(rows[0][0]) == fence
        self._count_write()
        return kept

    def _count_write(self) -> None:
        """One more result written: every CLEAN_EVERY, expired ones are deleted."""
        with self._mutex:
            clean = next(self._writes) % CLEAN_EVERY == 0
        if clean:
            self.prune(CLEAN_BATCH)

    def save_releasing(
        self, key: str, owner: str, fence: int, result: StoredResult, ttl: float, release: Release
    ) -> tuple[bool, bool]:
        if self._vendor != "postgresql":
            return super().save_releasing(key, owner, fence, result, ttl, release)
        params = (
            key, owner, key, result.fingerprint, fence, result.status, result.data, result.size,
            ttl,
        )  # fmt: skip

        def statement(line: bool) -> tuple[str, Any]:
            text = self.store.dialect.release_text(line, keeps=True)  # type: ignore[attr-defined]
            return _PG_KEEP_RELEASING.format(release=text), params

        (released, kept), *_ = self.store.release_by(key, owner, statement)
        self._count_write()
        return int(kept) > 0, int(released) > 0

    def get_releasing(
        self, key: str, owner: str, release: Release
    ) -> tuple[StoredResult | None, bool | None]:
        if self._vendor != "postgresql":
            return super().get_releasing(key, owner, release)

        def statement(line: bool) -> tuple[str, Any]:
            text = self.store.dialect.release_text(  # type: ignore[attr-defined]
                line, when="EXISTS (SELECT 1 FROM found)"
            )
            return _PG_GET_RELEASING.format(release=text), (key, key, owner)

        rows = self.store.release_by(key, owner, statement)
        if not rows:
            return None, None
        released, fingerprint, fence, status, data = rows[0]
        found = StoredResult(key, str(fingerprint), int(fence), int(status), bytes(data))
        return found, int(released) > 0

    def forget(self, key: str) -> bool:
        try:
            deleted, _ = self._rows().filter(key=key).delete()
        except DatabaseError as exc:
            raise self._unavailable(exc) from exc
        return deleted > 0

    def iter_results(self, prefix: str = "") -> Iterator[StoredResult]:
        last = None
        while True:
            live = self._rows().filter(expires_at__gt=store_now(self._vendor))
            rows = live.filter(key__startswith=prefix)
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
                    .filter(expires_at__lte=store_now(self._vendor))
                    .order_by()
                    .values_list("key", flat=True)[: batch or CLEAN_BATCH]
                )
                if not keys:
                    return pruned
                expired = self._rows().filter(key__in=keys, expires_at__lte=store_now(self._vendor))
                deleted, _ = expired.delete()
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
