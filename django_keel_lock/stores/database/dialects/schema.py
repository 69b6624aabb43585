"""The names of the schema the migrations create, as every dialect's SQL spells them."""

from __future__ import annotations

TABLE = "django_keel_lock_lock"
PERMIT_TABLE = "django_keel_lock_permit"
WAITER_TABLE = "django_keel_lock_waiter"
SEQUENCE = "django_keel_lock_fence"
#: The owner a released row is left with (SQL): no owner's token, so no extend or release can
#: match a released row, however its clock reads compare with the release's.
RELEASED = "''"
