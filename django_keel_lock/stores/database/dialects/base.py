"""What a database dialect provides; one module per vendor fills it in."""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

TABLE = "django_keel_lock_lock"
SEQUENCE = "django_keel_lock_fence"
#: The owner a released row is left with (SQL): no owner's token, so no extend or release can
#: match a released row, however its clock reads compare with the release's.
RELEASED = "''"


class Dialect:
    """The SQL one database speaks. Placeholders are the driver's own (%s, or ? for SQLite)."""

    vendor = ""
    acquire_sql: Sequence[str] = ()  # run in order; the last one's first row is (fence, retry_in)
    release_sql = ""  # expires the row and sets its owner to RELEASED
    extend_sql = ""
    get_sql = ""
    page_sql = ""
    prune_sql = ""  # deletes at most %s expired rows
    # Run before and after each prune batch: they hold off every acquire in flight (see
    # DatabaseLockStore.prune), and give up after a second rather than stall acquires longer.
    prune_guard: Sequence[str] = ()
    prune_unguard: Sequence[str] = ()

    #: Seconds until `{column}` (a timestamp) passes, by the database's clock; the admin's
    #: changelist uses it too, so the two never disagree about whether a lock is held.
    remaining_template = ""
    #: Whether releases reach other processes' waiters through the store's listener
    #: (PostgreSQL's LISTEN/NOTIFY); without it they poll.
    pushes_releases = False

    def remaining(self, column: str) -> str:
        return self.remaining_template.format(column=column)

    def connection_options(
        self, options: dict[str, Any], wrapper: Any, socket_timeout: float
    ) -> None:
        """Adjust the OPTIONS of the store's own connections to `wrapper`'s database; the
        store's SOCKET_TIMEOUT also bounds connecting."""

    @staticmethod
    def limit_connect_timeout(options: dict[str, Any], seconds: float) -> None:
        """`connect_timeout` (whole seconds, as PostgreSQL's and MariaDB's drivers take it) to
        `seconds` rounded up, or the project's own if that is shorter."""
        limit = max(1, math.ceil(seconds))
        theirs = options.get("connect_timeout")
        try:
            if theirs is not None and 0 < int(theirs) < limit:
                limit = int(theirs)
        except (TypeError, ValueError):
            pass  # not a number: the driver will say so
        options["connect_timeout"] = limit

    def session_sql(self, durable: bool) -> Sequence[str]:
        """Statements run once on each new connection of the store."""
        return ()

    def callers_transaction(self, database: str) -> Any:
        """The calling thread's own driver connection to `database` when lock statements must
        run on it, inside its open transaction, instead of on the store's connection (which
        would wait behind that transaction); None to use the store's connection."""
        return None

    def acquire_params(self, key: str, owner: str, holder: str, ttl: float) -> list[Sequence[Any]]:
        raise NotImplementedError

    def extend_params(self, key: str, owner: str, ttl: float) -> Sequence[Any]:
        return (ttl, key, owner)

    def datetime(self, value: Any) -> datetime | None:
        if value is None:
            return None
        if isinstance(value, str):
            value = datetime.fromisoformat(value)
        if isinstance(value, datetime) and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value  # type: ignore[no-any-return]


# Columns every reading query returns, in this order.
INFO = "key, owner, holder, fence, acquired_at, {remaining}"
