from __future__ import annotations

from django.db import migrations, models

from django_keel_lock.migrations._operations import VendorSQL


def _one_line(sql: str) -> str:
    """`sql` on one line (see 0003_permits: `sqlmigrate` output is applied a line at a time)."""
    return " ".join(sql.split())


# A release on PostgreSQL where the database has the line (`PostgresDialect.release_line_sql`):
# the owner's lock is freed; where its `waiting` flag is raised, the lock is handed over to the
# first live waiter of the key's line that was handed nothing yet (the releaser's own place
# goes first), in the same transaction: its owner, the holder and ttl its place keeps, a new
# fence, and its place marked with that fence (so that `leave_queue` can tell a grant not
# taken up). While the connection the waiter's process listens on (its place's `listener`, a
# backend pid) is there, the grant is for the waiter's whole ttl and is carried on its grant
# channel ("fence:length of the owner:owner key"): the waiter holds the lock with no call.
# Otherwise it is for min(its ttl, what is left of its place), with a wake-up naming the key
# on its address channel, and its next attempt takes it up. A first place without a ttl
# (written before hand-offs) is only woken, as is a line that is empty (the key's channel).
# A release that frees the lock commits without waiting for the WAL flush; one that hands it
# over waits for it where p_durable (it is the waiter's acquire). p_fence: only the lock
# handed to p_owner at that fence (`leave_queue` passing a grant on).
# released: whether p_owner held the lock; handed_to, fence, carried: the grant, if any.
RELEASE = _one_line(
    """
CREATE OR REPLACE FUNCTION django_keel_lock_release(
    p_key text, p_owner text, p_fence bigint, p_durable boolean,
    OUT released boolean, OUT handed_to text, OUT fence bigint, OUT carried boolean)
LANGUAGE plpgsql AS $$
DECLARE
    v_waiting boolean;
    v_first record;
    v_now timestamptz;
    v_until timestamptz;
BEGIN
    released := false;
    carried := false;
    UPDATE django_keel_lock_lock AS l SET owner = '', expires_at = clock_timestamp()
    WHERE l.key = p_key AND l.owner = p_owner AND l.expires_at > clock_timestamp()
      AND (p_fence IS NULL OR l.fence = p_fence)
    RETURNING l.waiting INTO v_waiting;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    released := true;
    IF v_waiting IS NOT TRUE THEN
        PERFORM set_config('synchronous_commit', 'off', true);
        RETURN;
    END IF;
    DELETE FROM django_keel_lock_waiter AS w WHERE w.key = p_key AND w.owner = p_owner;
    SELECT w.id, w.owner, w.holder, w.ttl, w.expires_at, w.listener, w.address INTO v_first
    FROM django_keel_lock_waiter AS w
    WHERE w.key = p_key AND w.expires_at > clock_timestamp() AND w.fence IS NULL
    ORDER BY w.id LIMIT 1 FOR UPDATE;
    IF NOT FOUND OR v_first.ttl IS NULL THEN
        PERFORM pg_notify(COALESCE(
            (SELECT 'keel_lock_at_' || NULLIF(w.address, '') FROM django_keel_lock_waiter AS w
             WHERE w.key = p_key AND w.expires_at > clock_timestamp() ORDER BY w.id LIMIT 1),
            'keel_lock_' || md5(convert_to(p_key, 'UTF8'))), p_key);
        PERFORM set_config('synchronous_commit', 'off', true);
        RETURN;
    END IF;
    v_now := clock_timestamp();
    carried := v_first.address <> '' AND v_first.listener IS NOT NULL
        AND EXISTS (SELECT FROM pg_stat_get_activity(v_first.listener::integer));
    v_until := v_now + make_interval(secs => v_first.ttl);
    IF NOT carried THEN
        v_until := LEAST(v_until, v_first.expires_at);
    END IF;
    fence := nextval('django_keel_lock_fence');
    handed_to := v_first.owner;
    UPDATE django_keel_lock_lock AS l SET owner = v_first.owner, holder = v_first.holder,
        fence = django_keel_lock_release.fence, acquired_at = v_now, expires_at = v_until
    WHERE l.key = p_key;
    UPDATE django_keel_lock_waiter AS w SET fence = django_keel_lock_release.fence
    WHERE w.id = v_first.id;
    IF carried THEN
        PERFORM pg_notify('keel_lock_gr_' || v_first.address,
                          fence || ':' || length(v_first.owner) || ':' || v_first.owner || p_key);
    ELSE
        PERFORM pg_notify(COALESCE('keel_lock_at_' || NULLIF(v_first.address, ''),
                                   'keel_lock_' || md5(convert_to(p_key, 'UTF8'))), p_key);
    END IF;
    IF NOT p_durable THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
END $$
"""
)


class Migration(migrations.Migration):
    """What a release needs to hand a key's lock over to the first waiter in its line
    (PostgreSQL): the waiter's holder and ttl, the fence it was handed until it takes the
    grant up, its process's listener connection (a grant carried in the wake-up only while
    that is there), and the release function. Nullable columns: processes still running the
    code from before write places without them, which then get a wake-up as before, and no
    grant."""

    dependencies = [("django_keel_lock", "0008_acquire_many")]

    operations = [
        migrations.AddField(
            model_name="waiter",
            name="holder",
            field=models.CharField(max_length=255, null=True),
        ),
        migrations.AddField(model_name="waiter", name="ttl", field=models.FloatField(null=True)),
        migrations.AddField(
            model_name="waiter", name="fence", field=models.BigIntegerField(null=True)
        ),
        migrations.AddField(
            model_name="waiter", name="listener", field=models.BigIntegerField(null=True)
        ),
        VendorSQL(
            forwards={"postgresql": [RELEASE]},
            backwards={
                "postgresql": [
                    "DROP FUNCTION IF EXISTS django_keel_lock_release(text, text, bigint, boolean)"
                ]
            },
            description="The release that hands the lock over (PostgreSQL)",
        ),
    ]
