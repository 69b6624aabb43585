from __future__ import annotations

from importlib import import_module

from django.db import migrations

from django_keel_lock.migrations._operations import VendorSQL

LOCK = "django_keel_lock_lock"
_permits = import_module("django_keel_lock.migrations.0003_permits")

# The permit function of 0003 locks its key's row, inserting a free one when it finds none.
# Once it has inserted (or found another's insert), the row may already be free again and
# deleted by the store's automatic clean-up before the second read: the function would then
# go on without a row, and a permit granted so would be no permit at all. It now reads until
# it holds the row; a row it holds is not deleted. (Every other function reads the row once,
# and a key without a row has no permit to release or extend.)
READ_ONCE = (
    f"SELECT * INTO l FROM {LOCK} WHERE key = p_key FOR UPDATE; IF NOT FOUND THEN "
    f"INSERT INTO {LOCK} (key, owner, holder, fence, acquired_at, expires_at) "
    "VALUES (p_key, '', '', 0, clock_timestamp(), clock_timestamp()) "
    "ON CONFLICT (key) DO NOTHING; "
    f"SELECT * INTO l FROM {LOCK} WHERE key = p_key FOR UPDATE; END IF;"
)
READ_UNTIL_HELD = (
    f"LOOP SELECT * INTO l FROM {LOCK} WHERE key = p_key FOR UPDATE; EXIT WHEN FOUND; "
    f"INSERT INTO {LOCK} (key, owner, holder, fence, acquired_at, expires_at) "
    "VALUES (p_key, '', '', 0, clock_timestamp(), clock_timestamp()) "
    "ON CONFLICT (key) DO NOTHING; END LOOP;"
)
assert READ_ONCE in _permits.ACQUIRE, "0003's acquire function no longer reads as expected"
ACQUIRE = _permits.ACQUIRE.replace(READ_ONCE, READ_UNTIL_HELD)


class Migration(migrations.Migration):
    """The PostgreSQL permit function holds its key's row whatever deletes rows meanwhile."""

    dependencies = [("django_keel_lock", "0003_permits")]

    operations = [
        VendorSQL(
            forwards={"postgresql": [ACQUIRE]},
            backwards={"postgresql": [_permits.ACQUIRE]},
            description="The permit acquire function reads its key's row until it holds it "
            "(PostgreSQL)",
        ),
    ]
