"""PostgreSQL: one upsert per acquire; a release NOTIFYs the waiters of other processes."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from .base import INFO, ServerDialect, line_statements, permit_listing
from .schema import PERMIT_TABLE, RELEASED, SEQUENCE, TABLE, WAITER_TABLE

# A release NOTIFYs on its key's own channel: CHANNEL_PREFIX + md5(key), a valid identifier
# whatever the key, so a process LISTENs only to the keys it waits for. A release that finds
# a line of waiters NOTIFYs the first one's process instead, on ADDRESS_PREFIX + its wake
# address (hex), with the key as the payload.
CHANNEL_PREFIX = "keel_lock_"
ADDRESS_PREFIX = "keel_lock_at_"
# A release that hands the lock over at the waiter's whole ttl carries the grant (key, owner,
# fence) to that waiter's process on GRANT_PREFIX + its wake address (`read_grant`).
GRANT_PREFIX = "keel_lock_gr_"
#: The advisory lock (this number, its backend pid) a listener's connection holds from the
#: moment it LISTENs on: a release hands a waiter the grant at its whole ttl, carried on the
#: grant channel, only while the connection its place names holds it (migration 0010).
LISTENER_LOCK = 1801807212
#: Held beside it (this number, the backend pid) by the listener of a store that takes
#: capped grants (`read_grant`, migration 0011; `DatabaseLockStore.capped_grants`): a
#: durable release hands its waiters the lock without waiting for the WAL flush only then.
#: (A store that is not durable takes none: its confirming extend would not wait for the
#: flush either.)
CAPPED_LOCK = 1801807213
#: A listener's connection, once it LISTENs: its backend pid (asked, not libpq's: through a
#: session pooler that is the pooler's own number) and the locks taken (a durable store's).
LISTENER_SQL = (
    f"SELECT pg_backend_pid(), pg_advisory_lock({LISTENER_LOCK}, pg_backend_pid()), "
    f"pg_advisory_lock({CAPPED_LOCK}, pg_backend_pid())"
)
#: Its locks let go, before it stops listening (`PostgresListener` parks).
LISTENER_UNCLAIM_SQL = (
    f"SELECT pg_advisory_unlock({CAPPED_LOCK}, pg_backend_pid()), "
    f"pg_advisory_unlock({LISTENER_LOCK}, pg_backend_pid())"
)
#: The same for a store that is not durable: the listener's lock alone.
UNCAPPED_LISTENER_SQL = (
    f"SELECT pg_backend_pid(), pg_advisory_lock({LISTENER_LOCK}, pg_backend_pid())"
)
UNCAPPED_UNCLAIM_SQL = f"SELECT pg_advisory_unlock({LISTENER_LOCK}, pg_backend_pid())"
_KEY_CHANNEL = f"'{CHANNEL_PREFIX}' || md5(convert_to(l.key, 'UTF8'))"
# The channel of `l.key`'s first live waiter, or the key's own channel when the line is empty
# or its first has no address (it polls, and so may others: wake them all, as before lines).
# A place marked with a grant counts only while its waiter holds the lock (as in the take of
# the first: `_take_first_template`): a waiter that took a carried grant keeps its marked
# place until it releases, and a release by it (several keys, an idempotent result's) would
# otherwise wake its own process rather than the next in line.
_FIRST_CHANNEL = (
    f"COALESCE((SELECT '{ADDRESS_PREFIX}' || NULLIF(w.address, '') FROM {WAITER_TABLE} w "
    "WHERE w.key = l.key AND w.expires_at > clock_timestamp() "
    "AND (w.fence IS NULL OR w.owner = l.owner) ORDER BY w.id LIMIT 1), "
    f"{_KEY_CHANNEL})"
)


_REMAINING_TEMPLATE = "EXTRACT(EPOCH FROM ({column} - clock_timestamp()))::float8"


#: Appended to a write's RETURNING list (`{flush}`): its transaction, the statement's own,
#: commits without waiting for the WAL flush (`synchronous_commit` is read at the commit; set
#: local, it ends with the transaction, so nothing stays on the connection: a pooler's next
#: client of the server connection is not affected).
NO_FLUSH = ", set_config('synchronous_commit', 'off', true)"


def _acquire(free: str) -> str:
    """The acquire upsert that takes the row where `free` holds (see `acquire_sql`)."""
    return f"""
        INSERT INTO {TABLE} AS l (key, owner, holder, fence, acquired_at, expires_at)
        VALUES (%s, %s, %s, nextval('{SEQUENCE}'), clock_timestamp(),
                clock_timestamp() + make_interval(secs => %s))
        ON CONFLICT (key) DO UPDATE SET
            owner = CASE WHEN {free} THEN EXCLUDED.owner ELSE l.owner END,
            holder = CASE WHEN {free} THEN EXCLUDED.holder ELSE l.holder END,
            fence = CASE WHEN {free} THEN nextval('{SEQUENCE}') ELSE l.fence END,
            acquired_at = CASE WHEN {free} THEN EXCLUDED.acquired_at ELSE l.acquired_at END,
            expires_at = CASE WHEN {free} THEN EXCLUDED.expires_at ELSE l.expires_at END,
            waiting = CASE WHEN {free} THEN l.waiting AND l.owner = EXCLUDED.owner ELSE true END
        RETURNING CASE WHEN owner = %s THEN fence END,
                  CASE WHEN owner <> %s THEN {_REMAINING_TEMPLATE.format(column="expires_at")} END,
                  CASE WHEN left(owner, 1) = '*' THEN owner END{{flush}}
        """


# Taking again the lock of the key this thread's release freed last, with nobody waiting
# (`vendors.Postgres.retake`): its row is there, most likely still free, so a plain UPDATE of
# the free row (expired, or the owner's own: the upsert's `_free`) takes it, without the
# upsert's conflict check and its lock of the row (a WAL record of its own). The fence is
# drawn in the SET: should another transaction update the row first, the UPDATE rechecks the
# row's newest version and computes its SET again (a new fence), as the line's take does.
# No row (taken since, or deleted): the upsert runs, in the same call (`store.execute`'s
# `answered`: one SOCKET_TIMEOUT for both), and says who holds it.
_RETAKE = f"""
    UPDATE {TABLE} AS l SET owner = %s, holder = %s, fence = nextval('{SEQUENCE}'),
        acquired_at = clock_timestamp(),
        expires_at = clock_timestamp() + make_interval(secs => %s),
        waiting = l.waiting AND l.owner = %s
    WHERE l.key = %s AND (l.expires_at <= clock_timestamp() OR l.owner = %s)
    RETURNING l.fence{{flush}}
"""


class PostgresDialect(ServerDialect):
    vendor = "postgresql"
    remaining_template = _REMAINING_TEMPLATE
    _remaining = remaining_template.format(column="expires_at")
    # One upsert whose DO UPDATE branch always writes the row it locked: it either takes it (free:
    # expired, or already ours) or raises its `waiting` flag. Only a release that finds the flag
    # raised NOTIFYs, so a lock nobody waits for is released without one (NOTIFY serialises
    # every notifying commit in the cluster). The flag is lowered when another owner takes the
    # row; the waiters that then still wait were woken by the release before, fail again and
    # raise it again. NULL (rows written before the column existed) counts as lowered.
    # "Now" is read once, as EXCLUDED.acquired_at, so every CASE agrees on whether the row was
    # free (a later clock read could disagree). The owner column then tells what happened: ours
    # (the new fence) or someone else's (seconds left on their lock).
    # No CTE, no second statement: the plan is as cheap as a plain UPDATE's. A refusal also
    # says whether permits hold the key (their marker owner, see PERMIT_OWNERS).
    _free = "(l.expires_at <= EXCLUDED.acquired_at OR l.owner = EXCLUDED.owner)"
    _acquire_template = _acquire(_free)
    # A waiter in the line (`LockStore.acquire_queued`): its first attempt is this upsert, which
    # takes a free row only while nobody waits for it; any other refusal goes on to the line's
    # transaction (`database.line`).
    _free_queued = (
        "(l.owner = EXCLUDED.owner OR (l.expires_at <= EXCLUDED.acquired_at "
        "AND l.waiting IS NOT TRUE))"
    )
    _acquire_queued_template = _acquire(_free_queued)
    # Release marks the row expired (and ownerless: see RELEASED) rather than deleting it, so
    # the next acquirer goes through the UPDATE branch and draws its fence after it holds the
    # row lock. The channel is md5 of the key's UTF-8 bytes, as `notify_channel` computes it
    # for LISTEN: md5(key) would hash the bytes of the database's encoding (LATIN1: another
    # channel for any non-ASCII key). Inside an idempotent result's statement (`release_text`)
    # where the database has the line's table, the first live waiter of the key's line is
    # NOTIFYed instead, if it has one (`_FIRST_CHANNEL`): a scalar subquery that CASE
    # evaluates only with the flag raised, so a release nobody waits for stays one plain
    # UPDATE (a plain release there is `release_line_sql`, which hands over). The subquery
    # reads the line as of the statement's start: a waiter that joined while the release
    # waited for the row is not in it, but then it listens to the key's channel already.
    _release = f"""
        UPDATE {TABLE} AS l SET owner = {RELEASED}, expires_at = clock_timestamp()
        WHERE key = %s AND owner = %s AND expires_at > clock_timestamp(){{when}}
        RETURNING CASE WHEN waiting IS TRUE THEN pg_notify({{channel}}, l.key) END{{flush}}
    """
    _release_template = _release.format(channel=_KEY_CHANNEL, flush="{flush}", when="{when}")
    # Inside another statement's WITH (idempotent results, `release_text`), where a second
    # data-modifying CTE cannot nest: the release wakes the first of the line, no hand-off.
    _release_waking_template = _release.format(
        channel=_FIRST_CHANNEL, flush="{flush}", when="{when}"
    )
    # Direct hand-off (`release_line_sql`): one call of migration 0009's function, which
    # frees the lock where nobody waits (one UPDATE, no flush waited for) and otherwise hands
    # it over to the first live waiter in line, carrying the grant at the waiter's whole ttl
    # to its process while that listens, else for min(its ttl, what is left of its place)
    # with a wake-up (see the migration). Parameters: key, owner (and, `pass_on_sql`, the
    # fence the lock was handed to owner at). Row: released, handed to, its fence, carried.
    _hand_off = (
        "SELECT released, handed_to, fence, carried{good_for} "
        "FROM django_keel_lock_release(%s, %s, {fence}, {durable})"
    )
    # A plain release where the database has the line: a lock nobody waits for (its flag
    # down) is freed by the WITH's own UPDATE, and the statement returns no row; only where
    # that UPDATE found nothing to free (someone waits, or the lock is not the owner's) is
    # the function called, in the same statement, to hand over or to say the lock is gone.
    # A release nobody waits for then costs a plain UPDATE, not a function call (whose
    # executor starts and whose own UPDATE costs as much again). Parameters: key, owner,
    # key, owner. The function's UPDATE reads the row afresh (a new snapshot for each
    # statement of a volatile function), so a flag raised while the WITH's UPDATE waited for
    # the row, which that UPDATE rechecks and skips, leads to the hand-off.
    _release_or_hand_off = f"""
        WITH freed AS (
            UPDATE {TABLE} AS l SET owner = {RELEASED}, expires_at = clock_timestamp()
            WHERE l.key = %s AND l.owner = %s AND l.expires_at > clock_timestamp()
              AND l.waiting IS NOT TRUE
            RETURNING 1{{flush}}
        )
        SELECT released, handed_to, fence, carried{{good_for}}
        FROM django_keel_lock_release(%s, %s, NULL, {{durable}})
        WHERE NOT EXISTS (SELECT FROM freed)
    """
    # A waiter in the line takes the lock in one statement (the line's transaction is for
    # joining and keeping a place): the lock a release handed it (its owner already: the
    # grant taken up, its fence kept, live `ttl` from now on), or the free lock when it is
    # first in the line, as the release that woke it expects (the UPDATE draws its fence
    # once it holds the row). Its place goes with the take. The line is read as of the
    # statement's start: a take it lets through is still one of a free row, by its owner
    # condition; but a waiter that joined while the take waited for the row is not in it, so
    # the flag stays raised whoever is left (lowered by the next take through the line's
    # transaction, which reads the line after the row's lock): lowered here, that waiter's
    # turn would be lost to plain takes. A place marked with a grant whose waiter no longer
    # owns the lock (it took the grant with no call, then released it by a statement that
    # left its place: an idempotent result's or a multi-key release) is not first.
    _GRANTED = "(l.owner = %(owner)s AND l.expires_at > clock_timestamp())"
    _take_first_template = f"""
        WITH took AS (
            UPDATE {TABLE} AS l SET owner = %(owner)s, holder = %(holder)s,
                fence = CASE WHEN {_GRANTED} THEN l.fence ELSE nextval('{SEQUENCE}') END,
                acquired_at = CASE WHEN {_GRANTED} THEN l.acquired_at
                                   ELSE clock_timestamp() END,
                expires_at = clock_timestamp() + make_interval(secs => %(ttl)s),
                waiting = TRUE{{confirm}}
            WHERE l.key = %(key)s AND ({_GRANTED}
                OR (l.expires_at <= clock_timestamp()
                    AND (SELECT w.owner FROM {WAITER_TABLE} w WHERE w.key = l.key
                         AND w.expires_at > clock_timestamp()
                         AND (w.fence IS NULL OR w.owner = l.owner)
                         ORDER BY w.id LIMIT 1) = %(owner)s))
            RETURNING l.fence
        ), gone AS (
            DELETE FROM {WAITER_TABLE} w WHERE w.key = %(key)s AND w.owner = %(owner)s
              AND EXISTS (SELECT FROM took)
        )
        SELECT fence{{flush}} FROM took
    """
    # (key, owner) -> (the fence it was handed, NULL if none,): `owner` leaves key's line.
    leave_returning_sql = (
        f"DELETE FROM {WAITER_TABLE} WHERE key = %s AND owner = %s RETURNING fence"
    )
    # Taking one's place out of the line wakes the next if the lock is free (`leave_queue`).
    wake_first_sql = (
        f"SELECT pg_notify({_FIRST_CHANNEL}, l.key) FROM {TABLE} l "
        "WHERE l.key = %s AND l.expires_at <= clock_timestamp() "
        f"AND EXISTS (SELECT FROM {WAITER_TABLE} w WHERE w.key = %s "
        "AND w.expires_at > clock_timestamp())"
    )
    # A durable extend (`{confirm}`) also confirms a capped grant (migration 0011): the
    # holding is then on disk, and its release may hand over without the flush in turn.
    _extend_template = f"""
        UPDATE {TABLE}
        SET expires_at = GREATEST(expires_at,
                                  clock_timestamp() + make_interval(secs => %s)){{confirm}}
        WHERE key = %s AND owner = %s AND expires_at > clock_timestamp()
        RETURNING 1{{flush}}
    """
    get_sql = (
        f"SELECT {INFO.format(remaining=_remaining)} FROM {TABLE} "
        "WHERE key = %s AND expires_at > clock_timestamp()"
    )
    page_sql = (
        f"SELECT {INFO.format(remaining=_remaining)} FROM {TABLE} "
        "WHERE key > %s AND left(key, %s) = %s AND expires_at > clock_timestamp() "
        "ORDER BY key LIMIT %s"
    )
    prune_sql = (
        f"DELETE FROM {TABLE} WHERE key IN "
        f"(SELECT key FROM {TABLE} WHERE expires_at <= clock_timestamp() LIMIT %s)"
    )
    # The delete rechecks each row: an acquire may have taken it since it was read. Writers
    # of the table hold ROW EXCLUSIVE from before they draw a fence until they commit;
    # pg_locks lists the fast-path locks too.
    sweep_select = (
        f"SELECT key FROM {TABLE} WHERE fence <= %s AND expires_at <= clock_timestamp() LIMIT %s"
    )
    sweep_delete = (
        f"DELETE FROM {TABLE} WHERE fence <= %s AND key {{names}} "
        "AND expires_at <= clock_timestamp()"
    )
    _orphan = (
        "expires_at <= clock_timestamp() "
        f"AND NOT EXISTS (SELECT FROM {TABLE} l WHERE l.key = p.key)"
    )
    sweep_permits_select = f"SELECT id FROM {PERMIT_TABLE} p WHERE {_orphan} LIMIT %s"
    sweep_permits_delete = f"DELETE FROM {PERMIT_TABLE} p WHERE id {{names}} AND {_orphan}"
    sweep_mark_sql = f"SELECT nextval('{SEQUENCE}')"
    sweep_busy_sql = (
        "SELECT DISTINCT virtualtransaction FROM pg_locks "
        f"WHERE relation = '{TABLE}'::regclass AND mode = 'RowExclusiveLock' "
        "AND pid <> pg_backend_pid()"
    )
    # SHARE ROW EXCLUSIVE conflicts with the ROW EXCLUSIVE lock every acquire holds from before
    # it draws its fence until it commits, and with another prune's.
    prune_guard = (
        "BEGIN",
        "SET LOCAL lock_timeout = '1s'",
        f"LOCK TABLE {TABLE} IN SHARE ROW EXCLUSIVE MODE",
    )
    prune_unguard = ("COMMIT",)

    # Several keys (`LockStore.acquire_many`): an acquire is one call of the function of
    # migration 0008 (the keys as one text[] parameter). A release or an extend is one
    # statement that locks the owner's rows in the order of the keys (as the acquire does:
    # no two of them wait for each other in a circle), then writes them as the single-key
    # statement does; a release NOTIFYs each key's waiters, or the first of its line.
    _acquire_many_template = (
        "SELECT fences, retry_in, held_as, blocked{flush} "
        "FROM django_keel_lock_acquire_many(%s::text[], %s, %s, %s::float8)"
    )
    # The keys come as one parameter each, in a VALUES list: its row count is in the text,
    # so the planner's generic plan costs what a plan for the values does and is kept after
    # its five trial runs. (Over an array parameter's unnest, the generic plan guessed ten
    # rows and so looked dearer at a few keys: every call was planned anew, which was most
    # of the time of a release of two keys.)
    _owned_rows = f"""
        WITH mine AS (
            SELECT l.key FROM (VALUES {{keys}}) AS u(n, k)
            JOIN {TABLE} l ON l.key = u.k
            WHERE l.owner = %s AND l.expires_at > clock_timestamp()
            ORDER BY u.n FOR UPDATE OF l
        )
    """
    _release_many = f"""{_owned_rows}
        UPDATE {TABLE} AS l SET owner = {RELEASED}, expires_at = clock_timestamp()
        FROM mine WHERE l.key = mine.key
        RETURNING l.key, CASE WHEN l.waiting IS TRUE THEN pg_notify({{channel}}, l.key) END
                  {{flush}}
    """
    _release_many_template = _release_many.format(
        channel=_KEY_CHANNEL, flush="{flush}", keys="{keys}"
    )
    _release_many_line_template = _release_many.format(
        channel=_FIRST_CHANNEL, flush="{flush}", keys="{keys}"
    )
    _extend_many_template = f"""{_owned_rows}
        UPDATE {TABLE} AS l
        SET expires_at = GREATEST(l.expires_at, clock_timestamp() + make_interval(secs => %s))
        FROM mine WHERE l.key = mine.key
        RETURNING 1{{flush}}
    """

    # Permits: each operation is one call of a function migration 0003 creates (one round
    # trip; its rules are `stores.permits.plan_acquire`'s), which NOTIFYs as a release does.
    _acquire_permit_template = (
        "SELECT granted, retry_in, held_as{flush} "
        "FROM django_keel_lock_acquire_permit(%s, %s, %s, %s, %s, %s, %s)"
    )
    _release_permit_template = "SELECT django_keel_lock_release_permit(%s, %s){flush}"
    _extend_permit_template = "SELECT django_keel_lock_extend_permit(%s, %s, %s){flush}"
    # Prune tests the expiry on the row it deletes too: a grant may have filled the slot
    # since the subquery read it, and a row it waits for is rechecked only against the
    # conditions on the table it deletes from.
    permit_listing = permit_listing(
        p="%s",
        key="key",
        now="clock_timestamp()",
        remaining=remaining_template,
        prune=f"DELETE FROM {PERMIT_TABLE} WHERE id IN (SELECT id FROM {PERMIT_TABLE} "
        "WHERE expires_at <= clock_timestamp() LIMIT %s) AND expires_at <= clock_timestamp()",
    )

    # The table as migration 0009 leaves it (its last column): a database migrated only to
    # 0005-0008 keeps no line for this code, which writes the hand-off's columns.
    line_table_sql = (
        f"SELECT EXISTS (SELECT FROM pg_attribute WHERE attrelid = to_regclass('{WAITER_TABLE}') "
        "AND attname = 'listener' AND NOT attisdropped)"
    )
    #: Whether the release function returns `good_for`, as migration 0011 leaves it (with
    #: the lock table's `unconfirmed`): it then hands capped grants.
    capped_table_sql = (
        "SELECT EXISTS (SELECT FROM pg_proc WHERE proname = 'django_keel_lock_release' "
        "AND 'good_for' = ANY(proargnames))"
    )
    # The sequence's last value, whoever drew it (CACHE 1: every value drawn is counted;
    # 0 before the first). The function needs what nextval needs (USAGE), not SELECT.
    line_last_fence_sql = f"SELECT COALESCE(pg_sequence_last_value('{SEQUENCE}'), 0)"
    line = line_statements(
        p="%s",
        key="key",
        now="clock_timestamp()",
        until="clock_timestamp() + make_interval(secs => %s)",
        remaining=remaining_template,
        next_fence=f"nextval('{SEQUENCE}')",
        keep_existing="ON CONFLICT (key) DO NOTHING",
        prune=f"DELETE FROM {WAITER_TABLE} WHERE id IN (SELECT id FROM {WAITER_TABLE} "
        "WHERE expires_at <= clock_timestamp() LIMIT %s) AND expires_at <= clock_timestamp()",
    )

    def __init__(self, *, durable: bool = True, own_session: bool = False) -> None:
        # A release that frees the lock never waits for the flush (NO_FLUSH), durable or not:
        # one lost to a crash leaves its lock held, by nobody, until its ttl (a delay, never a
        # second holder), and any later commit that waits for its flush (the next acquire)
        # flushes it first. So a durable cycle waits for one flush, the acquire's (one that
        # hands the lock over is an acquire: below). Not `durable` (DURABLE: False):
        # acquires and extends do not wait either. Behind a transaction pooler each statement
        # says it for its own transaction, so nothing is set on a session; on a session of
        # the store's `own_session` (no such pooler), DURABLE: False says it once, on the
        # session (`session_sql`), and no statement evaluates a set_config of its own.
        self.durable, self.own_session = durable, own_session
        hot = "" if durable or own_session else NO_FLUSH
        released = "" if own_session and not durable else NO_FLUSH
        self.acquire_sql = (self._acquire_template.format(flush=hot),)
        self.acquire_queued_sql = (self._acquire_queued_template.format(flush=hot),)
        self.retake_sql = _RETAKE.format(flush=hot)
        self.release_sql = self._release_template.format(flush=released, when="")
        # A release that hands the lock over waits for its flush as an acquire does, where
        # acquires do (DURABLE): lost to a crash, it would leave the waiter holding a lock
        # the database forgot, which another could then take. The function decides.
        self._hot, self._released = hot, released
        self._release_function(capped=True)
        self.acquire_permit_sql = self._acquire_permit_template.format(flush=hot)
        self.acquire_many_sql = self._acquire_many_template.format(flush=hot)
        self._release_many_sql = self._release_many_template.format(flush=released, keys="{keys}")
        self._release_many_line_sql = self._release_many_line_template.format(
            flush=released, keys="{keys}"
        )
        self._extend_many_sql = self._extend_many_template.format(flush=hot, keys="{keys}")
        self._of_count: dict[tuple[str, int], str] = {}
        self.release_permit_sql = self._release_permit_template.format(flush=released)
        self.extend_permit_sql = self._extend_permit_template.format(flush=hot)

    def _release_function(self, capped: bool) -> None:
        """The statements that call the release function, and the extend, as the database
        has them: `capped` once migration 0011 made the function return `good_for` and the
        lock table keep `unconfirmed` (a durable extend clears it), else as before it."""
        flag, good_for = "true" if self.durable else "false", ", good_for" if capped else ""
        self.release_line_sql = self._release_or_hand_off.format(
            flush=self._released, durable=flag, good_for=good_for
        )
        # The function alone, for a key whose last release here handed over (`vendors.
        # Postgres.release`): most likely someone waits again, and the WITH's UPDATE (which
        # then frees nothing) would only delay the hand-off. Parameters: key, owner.
        self.hand_off_sql = self._hand_off.format(fence="NULL", durable=flag, good_for=good_for)
        self.pass_on_sql = self._hand_off.format(
            fence="%s::bigint", durable=flag, good_for=good_for
        )
        # A durable take (a grant taken up with a call) or extend confirms a capped grant.
        confirm = ", unconfirmed = NULL" if capped and self.durable else ""
        self.extend_sql = self._extend_template.format(flush=self._hot, confirm=confirm)
        self.take_first_sql = self._take_first_template.format(flush=self._hot, confirm=confirm)

    def before_capped_grants(self) -> None:
        """The statements for a database not migrated to 0011 yet (`capped_table_sql`): a
        process started before the migration keeps them, as it keeps its lines (see
        `ServerVendor.line_table`); its releases then never cap a grant, and its waiters
        get capped grants only from processes started after it, which they confirm."""
        self._release_function(capped=False)

    def release_many_sql(self, count: int, line: bool) -> str:
        """The release of `count` keys (`line`: waking the first of each key's line); its
        parameters are the keys, then the owner."""
        template = self._release_many_line_sql if line else self._release_many_sql
        return self._for_count(template, count)

    def extend_many_sql(self, count: int) -> str:
        """The extend of `count` keys; its parameters are the keys, the owner, the ttl."""
        return self._for_count(self._extend_many_sql, count)

    def _for_count(self, template: str, count: int) -> str:
        """`template` with a VALUES row for each of `count` keys (built once a count)."""
        sql = self._of_count.get((template, count))
        if sql is None:
            rows = ", ".join(f"({n}, %s::text)" for n in range(1, count + 1))
            sql = self._of_count[template, count] = template.format(keys=rows)
        return sql

    def release_text(self, line: bool, when: str = "", keeps: bool = False) -> str:
        """The release's UPDATE (`line`: waking the first of the key's line, who then takes
        the free lock itself: a hand-off needs a WITH of its own), for a statement of
        idempotent results to put in a WITH: only `when` (an SQL condition) holds too; one
        that `keeps` a result waits for its flush as an acquire does, where a plain release
        does not (a result lost to a crash would let a retry run again)."""
        template = self._release_waking_template if line else self._release_template
        return template.format(
            flush=self._hot if keeps else self._released, when=f" AND {when}" if when else ""
        )

    def sweep_names(self, delete: str, names: Sequence[Any]) -> tuple[str, Sequence[Any]]:
        # One array parameter: one statement text whatever the count, prepared once.
        return delete.format(names="= ANY(%s)"), (list(names),)

    def acquire_params(self, key: str, owner: str, holder: str, ttl: float) -> list[Sequence[Any]]:
        return [(key, owner, holder, ttl, owner, owner)]

    def connection_options(
        self, options: dict[str, Any], wrapper: Any, socket_timeout: float
    ) -> None:
        self.limit_connect_timeout(options, socket_timeout)  # libpq waits at least 2 s
        if is_psycopg3(wrapper):
            # Server-side binding lets psycopg prepare our statements once per connection, so
            # the server stops re-planning them; a user's own choice (pgbouncer) wins.
            options.setdefault("server_side_binding", True)
            options.setdefault("prepare_threshold", 2)

    def session_sql(self, durable: bool) -> Sequence[str]:
        # Our statements rely on READ COMMITTED (an upsert locks and rereads the row's latest
        # version). Autocommit statements run at the session default, which a server or role
        # may set to SERIALIZABLE: contention would then fail. (Not behind a transaction
        # pooler, where a session is not ours: see `vendors.Postgres`.)
        isolation = "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL READ COMMITTED"
        if self.own_session and not self.durable:
            return (isolation, "SET synchronous_commit = off")
        return (isolation,)


def is_psycopg3(wrapper: Any) -> bool:
    return bool(getattr(wrapper.Database, "__name__", "") == "psycopg")


def address_channel(address: str) -> str:
    """The channel a release NOTIFYs the first waiter of a line on, when it waits in the
    process whose wake address is `address`."""
    return ADDRESS_PREFIX + address


def grant_channel(address: str) -> str:
    """The channel a release that hands a lock over to a waiter of the process whose wake
    address is `address` carries the grant on (see `read_grant`)."""
    return GRANT_PREFIX + address


def read_grant(payload: str) -> tuple[str, str, int, float | None]:
    """(key, owner, fence, good for) of a grant carried on a `grant_channel`: its payload
    is the fence, the owner's length, the owner and the key ("7:3:abckey"); a capped grant's
    fence is followed by the milliseconds it is good for ("7/2500:3:abckey", migration
    0011: see `WakeBoard.grant`)."""
    fence, length, rest = payload.split(":", 2)
    size = int(length)
    fence, _, good_for = fence.partition("/")
    return rest[size:], rest[:size], int(fence), int(good_for) / 1000 if good_for else None


def notify_channel(key: str) -> str:
    """The channel a release of `key` is NOTIFYed on: md5 of its UTF-8 bytes, as the release
    statement computes it on the server, whatever the database's encoding."""
    return CHANNEL_PREFIX + hashlib.md5(key.encode("utf-8")).hexdigest()
