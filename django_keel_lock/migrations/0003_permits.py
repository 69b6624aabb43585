from __future__ import annotations

from django.db import migrations, models

from django_keel_lock.migrations._operations import VendorSQL

LOCK = "django_keel_lock_lock"
PERMIT = "django_keel_lock_permit"
SEQUENCE = "django_keel_lock_fence"
MARKERS = "('*shared', '*semaphore')"  # stores.base.PERMIT_OWNERS


def _one_line(sql: str) -> str:
    """`sql` on one line: `sqlmigrate` prints each statement as it is given, and its output is
    applied a line at a time (tests/test_migrations.py), so no statement may span lines. The
    bodies below therefore hold no `--` comments; the comments here say what they do."""
    return " ".join(sql.split())


# PostgreSQL decides a permit operation on the server, in one call (one round trip). The rules
# are `stores.permits.plan_acquire`'s, step for step (GRANT, RENEW, TAKE, INTEND, REFUSE); keep
# the two alike. Each function first locks the key's lock row (creating it, free, if missing),
# so the operations of one key run one at a time and every fence is drawn while the row is
# held. A permit slot is live while the lock row is owned by a marker and unexpired and the
# slot's own expiry has not passed (a released slot expired when it was released). A grant
# rewrites the key's lowest slot that is not live, and adds slot max + 1 only when all are
# live (or when prune deleted the slot meanwhile: prune takes no lock row); a release expires
# its slot. Every write of a slot is then an update of a row whose indexed columns (id, key,
# slot) stay as they were: a HOT update, which leaves no index entry and no row that vacuum
# must clear before the page is reused. A refusal raises the row's `waiting` flag, and a
# release that finds it raised lowers it and NOTIFYs the key's channel (as release_sql does).
ACQUIRE = _one_line(
    f"""
CREATE OR REPLACE FUNCTION django_keel_lock_acquire_permit(
    p_key text, p_owner text, p_holder text, p_ttl float8, p_kind text, p_limit bigint,
    p_writer_wait float8, OUT granted bigint, OUT retry_in float8, OUT held_as text)
LANGUAGE plpgsql AS $$
DECLARE
    t timestamptz;
    until timestamptz;
    l {LOCK}%ROWTYPE;
    kind text;
    gated boolean;
    live bigint := 0;
    soonest timestamptz;
    mine bigint;
    free integer;
    top integer;
BEGIN
    SELECT * INTO l FROM {LOCK} WHERE key = p_key FOR UPDATE;
    IF NOT FOUND THEN
        INSERT INTO {LOCK} (key, owner, holder, fence, acquired_at, expires_at)
        VALUES (p_key, '', '', 0, clock_timestamp(), clock_timestamp())
        ON CONFLICT (key) DO NOTHING;
        SELECT * INTO l FROM {LOCK} WHERE key = p_key FOR UPDATE;
    END IF;
    t := clock_timestamp();
    until := t + make_interval(secs => p_ttl);
    soonest := l.expires_at;
    IF l.expires_at > t THEN
        kind := CASE l.owner WHEN '*shared' THEN 'shared' WHEN '*semaphore' THEN 'semaphore'
                ELSE 'exclusive' END;
    END IF;
    gated := kind IS NOT NULL AND kind <> 'exclusive';
    IF gated OR (kind IS NULL AND p_kind <> 'exclusive') THEN
        SELECT count(*) FILTER (WHERE gated AND expires_at > t),
               min(expires_at) FILTER (WHERE gated AND expires_at > t),
               max(fence) FILTER (WHERE gated AND owner = p_owner AND expires_at > t),
               min(slot) FILTER (WHERE NOT gated OR expires_at <= t), max(slot)
        INTO live, soonest, mine, free, top FROM {PERMIT} WHERE key = p_key;
        soonest := coalesce(soonest, l.expires_at);
    END IF;
    IF p_kind = 'exclusive' THEN
        IF kind IS NULL OR l.owner = p_owner THEN
            IF kind IS NOT NULL THEN
                UPDATE {LOCK} SET expires_at = until,
                    writer_until = CASE WHEN writer_owner = p_owner THEN NULL ELSE writer_until END,
                    writer_owner = CASE WHEN writer_owner = p_owner THEN NULL ELSE writer_owner END
                WHERE key = p_key;
                granted := l.fence;
                RETURN;
            END IF;
            UPDATE {LOCK} SET owner = p_owner, holder = p_holder, fence = nextval('{SEQUENCE}'),
                acquired_at = t, expires_at = until,
                waiting = l.waiting AND l.owner = p_owner,
                writer_until = CASE WHEN writer_owner = p_owner THEN NULL ELSE writer_until END,
                writer_owner = CASE WHEN writer_owner = p_owner THEN NULL ELSE writer_owner END
            WHERE key = p_key RETURNING fence INTO granted;
            RETURN;
        END IF;
        held_as := kind;
        retry_in := EXTRACT(EPOCH FROM (soonest - t));
        IF kind = 'shared' THEN
            IF l.writer_owner IS NULL OR l.writer_until <= t OR l.writer_owner = p_owner THEN
                UPDATE {LOCK} SET writer_owner = p_owner,
                    writer_until = t + make_interval(secs => p_writer_wait), waiting = true
                WHERE key = p_key;
                RETURN;
            END IF;
        END IF;
    ELSIF kind = 'exclusive' OR (kind IS NOT NULL AND kind <> p_kind) THEN
        held_as := kind;
        retry_in := EXTRACT(EPOCH FROM (soonest - t));
    ELSIF mine IS NOT NULL THEN
        UPDATE {PERMIT} SET expires_at = until
        WHERE key = p_key AND owner = p_owner AND expires_at > t;
        UPDATE {LOCK} SET expires_at = GREATEST(expires_at, until) WHERE key = p_key;
        granted := mine;
        RETURN;
    ELSIF p_kind = 'shared' AND l.writer_owner IS NOT NULL AND l.writer_until > t THEN
        held_as := 'exclusive';
        retry_in := EXTRACT(EPOCH FROM (l.writer_until - t));
    ELSIF p_kind = 'semaphore' AND live >= p_limit THEN
        held_as := 'semaphore';
        retry_in := EXTRACT(EPOCH FROM (soonest - t));
    ELSE
        granted := nextval('{SEQUENCE}');
        IF kind IS NULL THEN
            UPDATE {LOCK} SET owner = '*' || p_kind, holder = '', fence = granted,
                acquired_at = t, expires_at = until, waiting = false
            WHERE key = p_key;
        ELSE
            UPDATE {LOCK} SET fence = granted, expires_at = GREATEST(expires_at, until)
            WHERE key = p_key;
        END IF;
        IF free IS NOT NULL THEN
            UPDATE {PERMIT} SET owner = p_owner, holder = p_holder, fence = granted,
                acquired_at = t, expires_at = until
            WHERE key = p_key AND slot = free;
        END IF;
        IF free IS NULL OR NOT FOUND THEN
            INSERT INTO {PERMIT} (key, slot, owner, holder, fence, acquired_at, expires_at)
            VALUES (p_key, coalesce(free, top + 1, 0), p_owner, p_holder, granted, t, until);
        END IF;
        RETURN;
    END IF;
    IF l.waiting IS NOT TRUE THEN
        UPDATE {LOCK} SET waiting = true WHERE key = p_key;
    END IF;
END $$
"""
)

# How release and extend begin: lock the key's row; return 0 unless permits hold it.
HELD_BY_PERMITS = f"""
    SELECT * INTO l FROM {LOCK} WHERE key = p_key FOR UPDATE;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    t := clock_timestamp();
    IF l.owner NOT IN {MARKERS} OR l.expires_at <= t THEN
        RETURN 0;
    END IF;
"""

# 1 if `p_owner`'s live permit was released (its slot expired, owner '' as the lock table's
# RELEASED); the last one frees the lock row as release_sql does.
RELEASE = _one_line(
    f"""
CREATE OR REPLACE FUNCTION django_keel_lock_release_permit(p_key text, p_owner text)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    t timestamptz;
    l {LOCK}%ROWTYPE;
    later timestamptz;
BEGIN
    {HELD_BY_PERMITS}
    UPDATE {PERMIT} SET owner = '', expires_at = t
    WHERE key = p_key AND owner = p_owner AND expires_at > t;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    SELECT max(expires_at) INTO later FROM {PERMIT} WHERE key = p_key AND expires_at > t;
    IF later IS NULL THEN
        UPDATE {LOCK} SET owner = '', expires_at = t, waiting = false WHERE key = p_key;
    ELSE
        UPDATE {LOCK} SET expires_at = later, waiting = false WHERE key = p_key;
    END IF;
    IF l.waiting THEN
        PERFORM pg_notify('keel_lock_' || md5(convert_to(p_key, 'UTF8')), '');
    END IF;
    RETURN 1;
END $$
"""
)

# 1 if `p_owner`'s live permit now lives at least `p_ttl` more seconds (and the lock with it).
EXTEND = _one_line(
    f"""
CREATE OR REPLACE FUNCTION django_keel_lock_extend_permit(p_key text, p_owner text, p_ttl float8)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    t timestamptz;
    until timestamptz;
    l {LOCK}%ROWTYPE;
BEGIN
    {HELD_BY_PERMITS}
    until := t + make_interval(secs => p_ttl);
    UPDATE {PERMIT} SET expires_at = GREATEST(expires_at, until)
    WHERE key = p_key AND owner = p_owner AND expires_at > t;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    UPDATE {LOCK} SET expires_at = GREATEST(expires_at, until) WHERE key = p_key;
    RETURN 1;
END $$
"""
)


class Migration(migrations.Migration):
    """Semaphores and shared locks: a table of permits, and the writer waiting for readers.

    Additive only: nullable columns without a default (instant on every database; processes
    still running the code from before go on inserting lock rows) and a new table.
    """

    dependencies = [("django_keel_lock", "0002_lock_waiting")]

    operations = [
        migrations.AddField(
            model_name="lock",
            name="writer_owner",
            field=models.CharField(max_length=64, null=True),
        ),
        migrations.AddField(
            model_name="lock",
            name="writer_until",
            field=models.DateTimeField(null=True),
        ),
        migrations.CreateModel(
            name="Permit",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("key", models.CharField(max_length=255)),
                ("slot", models.IntegerField()),
                ("owner", models.CharField(max_length=64)),
                ("holder", models.CharField(max_length=255)),
                ("fence", models.BigIntegerField()),
                ("acquired_at", models.DateTimeField()),
                ("expires_at", models.DateTimeField()),
            ],
            options={
                "verbose_name": "permit",
                "verbose_name_plural": "permits",
                "db_table": PERMIT,
                "ordering": ("key", "expires_at"),
                "default_permissions": ("view",),
                "constraints": [
                    models.UniqueConstraint(
                        fields=("key", "slot"), name="django_keel_lock_permit_slot"
                    )
                ],
            },
        ),
        # MariaDB compares the permits' keys byte for byte, as the lock table's (0001); the
        # PostgreSQL functions above, and room left on each page of the permit table for the
        # new versions of its slots (a HOT update needs room on the row's own page). Plain SQL
        # through the schema editor, so `sqlmigrate` prints all of it.
        VendorSQL(
            forwards={
                "postgresql": [
                    f"ALTER TABLE {PERMIT} SET (fillfactor = 50)",
                    ACQUIRE,
                    RELEASE,
                    EXTEND,
                ],
                "mysql": [
                    f"ALTER TABLE {PERMIT} MODIFY `key` VARCHAR(255) "
                    "CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin NOT NULL, "
                    "MODIFY holder VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin "
                    "NOT NULL",
                ],
            },
            # The collations go with the table, which unapplying the CreateModel above drops.
            backwards={
                "postgresql": [
                    "DROP FUNCTION IF EXISTS django_keel_lock_acquire_permit"
                    "(text, text, text, float8, text, bigint, float8)",
                    "DROP FUNCTION IF EXISTS django_keel_lock_release_permit(text, text)",
                    "DROP FUNCTION IF EXISTS django_keel_lock_extend_permit(text, text, float8)",
                ],
            },
            description="Permit functions and the permit table's fillfactor (PostgreSQL), "
            "byte-wise key and holder collations of the permit table (MariaDB)",
        ),
    ]
