from __future__ import annotations

from importlib import import_module

from django.db import migrations, models

from django_keel_lock.migrations._operations import VendorSQL

_CLAIM = import_module("django_keel_lock.migrations.0010_listener_claim")
_GRANT = import_module("django_keel_lock.migrations.0009_waiter_grant")


def _changed(sql: str, *changes: tuple[str, str]) -> str:
    """`sql` (one line, see 0009) with each (old, new) made, each old found exactly once."""
    for old, new in changes:
        old, new = _GRANT._one_line(old), _GRANT._one_line(new)
        assert sql.count(old) == 1, old
        sql = sql.replace(old, new)
    return sql


# The release of 0010, but a durable one may hand the lock over without waiting for the WAL
# flush: a "capped" grant. Its waiter (whose listener holds the advisory lock 1801807213, its
# backend pid, beside 0010's: code that knows the grant below, in a durable store) believes
# it only for what was left, when the release began, of the releaser's own lease
# (`good_for`, seconds, at most its ttl; carried as "fence/milliseconds:..."), and confirms
# it at once with a durable extend. Should a crash lose the grant, the row says the
# releaser's holding, on disk, which lasts at least that long: nobody takes the lock before
# the waiter stops believing in it, and its confirming extend, finding the lock not its
# own, reports it lost. Only where the releaser's holding is itself on disk (not
# `unconfirmed`: handed over capped, or by a release of a store that is not durable), its
# lease has half the waiter's ttl left at least, and the fence is safe: it is drawn first,
# before the release writes anything, and counts only if every WAL record inserted by then
# is flushed (the sequence logs 32 draws ahead, in whichever transaction draws: a log
# record lost to a crash would give the fence again). Else the release waits for the flush
# as before, and always under synchronous replication (a standby, which a failover may
# promote, has the WAL later than this server's disk). `unconfirmed` keeps the fence of
# each grant made without the flush. Drawn
# before the row is locked, the fence may be no greater than the `last_fence` a refusal
# read meanwhile: its waiter then takes the grant up with a call, as a stale one.
RELEASE = _changed(
    _CLAIM.RELEASE,
    ("CREATE OR REPLACE FUNCTION", "CREATE FUNCTION"),
    ("OUT carried boolean)", "OUT carried boolean, OUT good_for float8)"),
    (
        "v_waiting boolean;",
        "v_waiting boolean; v_held bigint; v_unconfirmed bigint; v_left float8; "
        "v_draw bigint; v_flushed boolean; v_capped boolean;",
    ),
    (
        "BEGIN released := false;",
        """
        BEGIN
        v_draw := nextval('django_keel_lock_fence');
        v_flushed := p_durable AND current_setting('synchronous_standby_names') = ''
            AND pg_current_wal_flush_lsn() >= pg_current_wal_insert_lsn();
        released := false;
        """,
    ),
    (
        """
        UPDATE django_keel_lock_lock AS l SET owner = '', expires_at = clock_timestamp()
        WHERE l.key = p_key AND l.owner = p_owner AND l.expires_at > clock_timestamp()
          AND (p_fence IS NULL OR l.fence = p_fence)
        RETURNING l.waiting INTO v_waiting;
        """,
        """
        IF p_durable THEN
            UPDATE django_keel_lock_lock AS l SET owner = '', expires_at = clock_timestamp()
            FROM (SELECT o.expires_at FROM django_keel_lock_lock AS o WHERE o.key = p_key) AS o
            WHERE l.key = p_key AND l.owner = p_owner AND l.expires_at > clock_timestamp()
              AND (p_fence IS NULL OR l.fence = p_fence)
            RETURNING l.waiting, l.fence, l.unconfirmed,
                      EXTRACT(EPOCH FROM (o.expires_at - clock_timestamp()))::float8
            INTO v_waiting, v_held, v_unconfirmed, v_left;
        ELSE
            UPDATE django_keel_lock_lock AS l SET owner = '', expires_at = clock_timestamp()
            WHERE l.key = p_key AND l.owner = p_owner AND l.expires_at > clock_timestamp()
              AND (p_fence IS NULL OR l.fence = p_fence)
            RETURNING l.waiting INTO v_waiting;
        END IF;
        """,
    ),
    (
        "AND NOT pg_try_advisory_xact_lock_shared(1801807212, v_first.listener::integer);",
        """
        AND NOT pg_try_advisory_xact_lock_shared(1801807212, v_first.listener::integer);
        v_capped := v_flushed AND carried AND v_unconfirmed IS DISTINCT FROM v_held
            AND v_left >= v_first.ttl / 2
            AND NOT pg_try_advisory_xact_lock_shared(1801807213, v_first.listener::integer);
        """,
    ),
    (
        "fence := nextval('django_keel_lock_fence'); handed_to := v_first.owner;",
        """
        fence := v_draw;
        handed_to := v_first.owner;
        IF v_capped THEN
            good_for := LEAST(v_left, v_first.ttl);
        END IF;
        """,
    ),
    (
        "acquired_at = v_now, expires_at = v_until WHERE",
        """
        acquired_at = v_now, expires_at = v_until,
        unconfirmed = CASE WHEN v_capped OR NOT p_durable THEN django_keel_lock_release.fence END
        WHERE
        """,
    ),
    (
        "fence || ':' || length(v_first.owner)",
        "fence || COALESCE('/' || floor(good_for * 1000)::bigint, '') || ':' "
        "|| length(v_first.owner)",
    ),
    ("IF NOT p_durable THEN", "IF NOT p_durable OR v_capped THEN"),
)
_DROP = "DROP FUNCTION IF EXISTS django_keel_lock_release(text, text, bigint, boolean)"
# 0010's, made again on the way back (its OUT columns differ: it cannot replace this one).
_BACK = _CLAIM.RELEASE.replace("CREATE OR REPLACE FUNCTION", "CREATE FUNCTION", 1)
assert _BACK != _CLAIM.RELEASE


class Migration(migrations.Migration):
    """The PostgreSQL release that may hand the lock over without waiting for the WAL flush
    (a capped grant, confirmed by its waiter), and the lock's `unconfirmed` column it keeps."""

    dependencies = [("django_keel_lock", "0010_listener_claim")]

    operations = [
        migrations.AddField(
            model_name="lock", name="unconfirmed", field=models.BigIntegerField(null=True)
        ),
        VendorSQL(
            forwards={"postgresql": [_DROP, RELEASE]},
            backwards={"postgresql": [_DROP, _BACK]},
            description="The release that hands over with a capped grant (PostgreSQL)",
        ),
    ]
