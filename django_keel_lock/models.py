"""The table behind DatabaseLockStore. Rows are written only by the store's own SQL."""

from __future__ import annotations

from django.db import models

from .options import MAX_HOLDER_LENGTH


class Lock(models.Model):
    """One key's lock. A released or expired row stays until the next acquirer takes it over
    or the store's clean-up deletes it (see `DatabaseLockStore._sweep`; `locks prune` deletes
    them all at once); `expires_at` is always set by the database's own clock."""

    key = models.CharField(max_length=255, primary_key=True)
    owner = models.CharField(max_length=64)
    holder = models.CharField(max_length=MAX_HOLDER_LENGTH)
    fence = models.BigIntegerField()
    acquired_at = models.DateTimeField()
    expires_at = models.DateTimeField()
    #: PostgreSQL and MariaDB: someone failed to take this lock since its holder took it, so
    #: releasing it must wake someone: the first in the key's line (`Waiter`), or else the
    #: key's listeners (a lock nobody waits for is released without either); NULL means no.
    #: A waiting acquire takes a free row at its first attempt only while it is down. Unused
    #: on SQLite. Nullable, so adding the column is instant and a process still running a
    #: release without it can go on inserting rows.
    waiting = models.BooleanField(null=True, default=None)
    #: A writer waiting for the shared permits that hold this key, and until when: no new
    #: shared permit is given meanwhile. Nullable, without a default, as `waiting` is.
    writer_owner = models.CharField(max_length=64, null=True)  # noqa: DJ001 (NULL: none waits)
    writer_until = models.DateTimeField(null=True)
    #: PostgreSQL: the fence of a holding that a release handed over without waiting for the
    #: WAL flush (its waiter believes it only as long as the releaser's lease ran, until a
    #: durable extend confirms it: that extend sets this back to NULL). A release whose own
    #: holding is still unconfirmed hands over with the flush waited for. Nullable, as
    #: `waiting` is.
    unconfirmed = models.BigIntegerField(null=True)

    class Meta:
        db_table = "django_keel_lock_lock"
        verbose_name = "lock"
        verbose_name_plural = "locks"
        ordering = ("key",)
        default_permissions = ("view",)
        permissions = (("force_release_lock", "Can force-release a lock held by anyone"),)

    def __str__(self) -> str:
        return self.key


class Permit(models.Model):
    """One permit slot of a key held by permits (a shared lock's reader, a semaphore's holder).

    While any lives, the key's `Lock` row is owned by the kind's marker (see
    `stores.base.PERMIT_OWNERS`) with the latest permit's fence and the latest expiry of them
    all, so exclusive acquirers see the key as held. A key's slots are numbered 0, 1, 2, …; a
    slot is live while that gate is and the slot's own `expires_at` has not passed. A grant
    takes the lowest slot that is not live and rewrites it in place, adding one only when all
    are live; a release expires its slot (owner RELEASED) rather than deleting it. So a busy
    key keeps as many rows as it once had permits at a time, each updated in place, which on
    PostgreSQL is a HOT update (no index holds a column it writes): deleting and inserting a
    row per permit would leave dead rows and index entries that slow every later permit of the
    key until vacuum. The store's clean-up deletes the expired slots of keys whose lock row it
    deleted, and `locks prune` all expired slots; they are added back as needed.
    """

    id = models.BigAutoField(primary_key=True)
    key = models.CharField(max_length=255)
    slot = models.IntegerField()
    # Not indexed: a grant or release rewrites it, and an index on it would take every such
    # update off PostgreSQL's HOT path. Lookups by owner scan the key's few slots.
    owner = models.CharField(max_length=64)
    holder = models.CharField(max_length=MAX_HOLDER_LENGTH)
    fence = models.BigIntegerField()
    acquired_at = models.DateTimeField()
    expires_at = models.DateTimeField()

    class Meta:
        db_table = "django_keel_lock_permit"
        verbose_name = "permit"
        verbose_name_plural = "permits"
        ordering = ("key", "expires_at")
        default_permissions = ("view",)
        constraints = (
            models.UniqueConstraint(fields=("key", "slot"), name="django_keel_lock_permit_slot"),
        )

    def __str__(self) -> str:
        return f"{self.key} ({self.holder})"


class Waiter(models.Model):
    """One caller's place in the line of waiters for a key's exclusive lock (PostgreSQL and
    MariaDB: see `LockStore.acquire_queued`). The order of `id` is the order of arrival; a
    place lasts until `expires_at` (QUEUE_LEASE after its waiter's last attempt, by the
    database's clock), and `address` is where a release wakes that waiter's process ("": it
    polls). A waiter leaves when it takes the lock or gives up; the store's clean-up deletes
    the places of those that died.

    `holder` and `ttl` are what a release that hands the lock over to this waiter writes for
    it (PostgreSQL), and `fence` the fence it was handed, while it has not taken the grant up
    (NULL: none; all NULL in places written before hand-offs, which get a wake-up only).
    `listener` is the server's id of the connection its process listens on (PostgreSQL: the
    backend's pid), as of its last attempt: a release carries a grant (at its whole ttl) in
    the wake-up only while that connection is there."""

    id = models.BigAutoField(primary_key=True)
    key = models.CharField(max_length=255)
    owner = models.CharField(max_length=64)
    address = models.CharField(max_length=64, blank=True)
    expires_at = models.DateTimeField()
    holder = models.CharField(max_length=MAX_HOLDER_LENGTH, null=True)  # noqa: DJ001
    ttl = models.FloatField(null=True)
    fence = models.BigIntegerField(null=True)
    listener = models.BigIntegerField(null=True)

    class Meta:
        db_table = "django_keel_lock_waiter"
        # The line of a key, in order, is one index range; a waiter has one place per key.
        indexes = (models.Index(fields=("key", "id"), name="django_keel_lock_waiter_line"),)
        constraints = (
            models.UniqueConstraint(fields=("key", "owner"), name="django_keel_lock_waiter_owner"),
        )
        ordering = ("key", "id")
        verbose_name = "waiter"
        verbose_name_plural = "waiters"
        default_permissions = ()

    def __str__(self) -> str:
        return self.key


class StoreLock(Lock):
    """No rows of its own: the admin's entry for the page of every store's held locks (Redis
    included), so the site index and the app's list link it (`admin.StoreLockAdmin`)."""

    class Meta:
        proxy = True
        verbose_name = "lock in every store"
        verbose_name_plural = "locks in every store"
        default_permissions = ()


class IdempotentResult(models.Model):
    """What an idempotent request answered (or a `run_once` function returned), kept under its
    key until `expires_at` for the retries (`django_keel_lock.idempotency`). Rows are written
    only by `stores.database.results` (a fenced INSERT ... SELECT on the key's lock row); the
    expired ones are deleted as it writes, and by `locks results --prune`."""

    key = models.CharField(max_length=255, primary_key=True)
    #: sha256 of the request's method, path and body digest ("" for a function's result).
    fingerprint = models.CharField(max_length=64)
    fence = models.BigIntegerField()
    #: The response's HTTP status; 0 for a function's JSON result.
    status = models.IntegerField()
    data = models.BinaryField()
    size = models.IntegerField()
    created_at = models.DateTimeField()
    expires_at = models.DateTimeField(db_index=True)

    class Meta:
        db_table = "django_keel_lock_result"
        verbose_name = "idempotent result"
        verbose_name_plural = "idempotent results"
        ordering = ("key",)
        default_permissions = ("view", "delete")

    def __str__(self) -> str:
        return self.key
