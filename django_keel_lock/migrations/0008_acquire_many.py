from __future__ import annotations

from django.db import migrations

from django_keel_lock.migrations._operations import VendorSQL

LOCK = "django_keel_lock_lock"
SEQUENCE = "django_keel_lock_fence"
FREE = "(l.expires_at <= EXCLUDED.acquired_at OR l.owner = EXCLUDED.owner)"


def _one_line(sql: str) -> str:
    """`sql` on one line (see 0003_permits: `sqlmigrate` output is applied a line at a time)."""
    return " ".join(sql.split())


# A multi-key lock on PostgreSQL: every key or none, in one call (one round trip; see
# `LockStore.acquire_many`). p_keys are distinct; their rows are locked in p_keys' order (the
# store sorts them), so two calls never wait for each other in a circle. The keys are taken
# by one upsert, each row exactly as the single-key acquire upsert takes it (the same free
# test, the same fence source, drawn the same way), inside a block: when any key is held by
# another owner the block rolls back (a subtransaction: no key of the set was taken), and the
# `waiting` flag of each key that refused is raised again in key order, so its release
# NOTIFYs this waiter as it does a refused single-key acquire. fences: each key's, in p_keys'
# order (NULL when refused); blocked: the positions (1-based) in p_keys of the keys held by
# others; retry_in: seconds until the soonest of their holders' expiry (0 when one of them
# was freed meanwhile); held_as: the permit marker of the first of them, if permits hold it.
# A deadlock (a clean-up's delete that locks rows in its own order) is a refusal to retry at
# once, not an error. The function keeps nothing on the session: fine behind a transaction
# pooler.
ACQUIRE_MANY = _one_line(
    f"""
CREATE OR REPLACE FUNCTION django_keel_lock_acquire_many(
    p_keys text[], p_owner text, p_holder text, p_ttl float8,
    OUT fences bigint[], OUT retry_in float8, OUT held_as text, OUT blocked integer[])
LANGUAGE plpgsql AS $$
DECLARE
    i integer;
    seconds_left float8;
    marker text;
    freed boolean := false;
BEGIN
    BEGIN
        WITH took AS (
            INSERT INTO {LOCK} AS l (key, owner, holder, fence, acquired_at, expires_at)
            SELECT u.new_key, p_owner, p_holder, nextval('{SEQUENCE}'), clock_timestamp(),
                   clock_timestamp() + make_interval(secs => p_ttl)
            FROM unnest(p_keys) WITH ORDINALITY AS u(new_key, n) ORDER BY u.n
            ON CONFLICT (key) DO UPDATE SET
                owner = CASE WHEN {FREE} THEN EXCLUDED.owner ELSE l.owner END,
                holder = CASE WHEN {FREE} THEN EXCLUDED.holder ELSE l.holder END,
                fence = CASE WHEN {FREE} THEN nextval('{SEQUENCE}') ELSE l.fence END,
                acquired_at = CASE WHEN {FREE} THEN EXCLUDED.acquired_at ELSE l.acquired_at END,
                expires_at = CASE WHEN {FREE} THEN EXCLUDED.expires_at ELSE l.expires_at END,
                waiting = CASE WHEN {FREE} THEN l.waiting AND l.owner = EXCLUDED.owner
                          ELSE true END
            RETURNING array_position(p_keys, l.key) AS at, l.owner AS took_owner,
                      l.fence AS took_fence
        )
        SELECT array_agg(took_fence ORDER BY at),
               array_agg(at ORDER BY at) FILTER (WHERE took_owner <> p_owner)
        INTO fences, blocked FROM took;
        IF blocked IS NULL THEN
            RETURN;
        END IF;
        RAISE SQLSTATE 'KL001';
    EXCEPTION WHEN SQLSTATE 'KL001' THEN
        fences := NULL;
    END;
    FOREACH i IN ARRAY blocked LOOP
        UPDATE {LOCK} SET waiting = true
        WHERE key = p_keys[i] AND owner <> p_owner AND expires_at > clock_timestamp()
        RETURNING EXTRACT(EPOCH FROM (expires_at - clock_timestamp()))::float8,
                  CASE WHEN left(owner, 1) = '*' THEN owner END
        INTO seconds_left, marker;
        IF FOUND THEN
            retry_in := LEAST(retry_in, seconds_left);
            IF held_as IS NULL AND i = blocked[1] THEN
                held_as := marker;
            END IF;
        ELSE
            freed := true;
        END IF;
    END LOOP;
    IF freed THEN
        retry_in := 0;
    END IF;
EXCEPTION WHEN deadlock_detected THEN
    fences := NULL;
    retry_in := 0;
    held_as := NULL;
    blocked := ARRAY(SELECT generate_series(1, cardinality(p_keys)));
END $$
"""
)


class Migration(migrations.Migration):
    """Multi-key locks in one call on PostgreSQL (`LockStore.acquire_many`)."""

    dependencies = [("django_keel_lock", "0007_idempotent_result")]

    operations = [
        VendorSQL(
            forwards={"postgresql": [ACQUIRE_MANY]},
            backwards={
                "postgresql": [
                    "DROP FUNCTION IF EXISTS django_keel_lock_acquire_many"
                    "(text[], text, text, float8)"
                ]
            },
            description="The multi-key acquire function (PostgreSQL)",
        ),
    ]
