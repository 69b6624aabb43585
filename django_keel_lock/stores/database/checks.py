"""The database store's system checks (ids in django_keel_lock.checks' docstring).

From the settings: E010 (SOCKET_TIMEOUT), E005 (DATABASE names no database) and E006 (a vendor
without a dialect). Tagged `database`, on the databases the command asks for, taking no lock:
W003 and W006 (a table missing: not migrated there), W004 (it could not be inspected), and each
vendor's own (`vendors.Vendor.check_database`): W008 (MariaDB: a user without PROCESS); W012
(PostgreSQL behind a transaction pooler with no LISTEN_DATABASE: waiters poll).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from importlib import import_module
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning
from django.db import connections

from ..checks import ID, check_socket_timeout, where
from . import pooler
from .dialects import DIALECTS
from .dialects.schema import PERMIT_TABLE
from .dialects.schema import TABLE as LOCK_TABLE

#: A grant of global privileges, as SHOW GRANTS writes it: the privileges, then ON *.*.
GLOBAL_GRANT = re.compile(r"GRANT (?P<privileges>.+?) ON \*\.\* TO ", re.IGNORECASE)


def check_config(alias: str, database: Any, options: Mapping[str, Any]) -> list[CheckMessage]:
    """E010, E005, E006 for the store `alias` on the DATABASES alias `database`."""
    return [
        *check_socket_timeout(alias, options),
        *_check_database(alias, database),
        *_check_listen_database(alias, options.get("LISTEN_DATABASE")),
    ]


def _check_listen_database(alias: str, listen: Any) -> list[CheckMessage]:
    if listen is None or listen in settings.DATABASES:
        return []
    return [_no_such_database(alias, "LISTEN_DATABASE", listen)]


def _no_such_database(alias: str, option: str, value: Any) -> Error:
    """E005: OPTIONS `option` names no DATABASES alias."""
    known = ", ".join(sorted(settings.DATABASES)) or "none"
    return Error(
        f"{where(alias)} OPTIONS {option} {value!r} is not in DATABASES.",
        hint=f"Databases configured: {known}.",
        id=ID.format("E005"),
    )


def _check_database(alias: str, database: Any) -> list[CheckMessage]:
    if database not in settings.DATABASES:
        return [_no_such_database(alias, "DATABASE", database)]
    engine = str(settings.DATABASES[database].get("ENGINE", ""))
    try:
        # The backend class says its vendor; nothing is instantiated or connected.
        vendor = import_module(f"{engine}.base").DatabaseWrapper.vendor
    except Exception:  # a broken ENGINE is Django's own error to report
        return []
    if vendor in DIALECTS:  # the store supports exactly what it has dialects for
        return []
    return [
        Error(
            f"{where(alias)} uses database {database!r} ({engine}), which DatabaseLockStore "
            "does not support.",
            hint=(
                "Use a PostgreSQL, MariaDB or SQLite database (MySQL has no sequences for "
                "fences), or RedisLockStore."
            ),
            id=ID.format("E006"),
        )
    ]


#: A vendor's own checks of a database (`database`, the phrase naming the stores there).
VendorChecks = Callable[[str, str], list[CheckMessage]]


def check_tables(
    stores: Mapping[str, Any], databases: Sequence[str], vendor_checks: VendorChecks
) -> list[CheckMessage]:
    """W003, W004, W006 and `vendor_checks` (MariaDB: W008) for `stores` (alias -> its
    DATABASES alias) on `databases`.

    Warnings, not errors, although every lock on such a store fails: `migrate` runs the
    database checks of the database it migrates before migrating, and an error would stop the
    very command that creates the table.
    """
    on: dict[str, list[str]] = {}
    for alias, database in stores.items():
        if database in connections.settings and database in databases:
            on.setdefault(database, []).append(str(alias))
    messages: list[CheckMessage] = []
    for database, aliases in on.items():
        named = ", ".join(repr(alias) for alias in aliases)
        keep = f"Lock stores {named} keep" if len(aliases) > 1 else f"Lock store {named} keeps"
        messages.extend(_check_tables(database, keep, vendor_checks))
    return messages


def _check_tables(database: str, stores: str, vendor_checks: VendorChecks) -> list[CheckMessage]:
    try:
        tables = connections[database].introspection.table_names()
    except Exception as exc:  # unreachable server, missing driver: a check never crashes
        return [
            Warning(
                f"{stores} locks in database {database!r}, which could not be "
                f"inspected for the {LOCK_TABLE} table: {type(exc).__name__}: {exc}",
                hint=f"Check that database {database!r} is reachable with the "
                "DATABASES settings, then run this check again.",
                id=ID.format("W004"),
            )
        ]
    messages: list[CheckMessage] = []
    migrate = f"Run: python manage.py migrate django_keel_lock --database {database}"
    if LOCK_TABLE not in tables:
        messages.append(
            Warning(
                f"{stores} locks in table {LOCK_TABLE} of database {database!r}, "
                "which does not have that table: every lock taken there fails with "
                "LockStoreMisconfigured.",
                hint=migrate,
                id=ID.format("W003"),
            )
        )
    elif PERMIT_TABLE not in tables:
        messages.append(
            Warning(
                f"{stores} locks in database {database!r}, which has no {PERMIT_TABLE} "
                "table (migration 0003 is not applied there): every semaphore and shared "
                "lock taken there fails with LockStoreMisconfigured; exclusive locks work.",
                hint=migrate,
                id=ID.format("W006"),
            )
        )
    return [*messages, *vendor_checks(database, stores)]


def check_poolers(
    stores: Mapping[str, Mapping[str, Any]], databases: Sequence[str]
) -> list[CheckMessage]:
    """W012 for `stores` (alias -> OPTIONS) on PostgreSQL `databases`: a store behind a
    transaction pooler (declared, or found by `pooler.seen` on Django's connection) with no
    LISTEN_DATABASE, whose waiters therefore poll."""
    messages: list[CheckMessage] = []
    for alias, options in stores.items():
        database = options.get("DATABASE", "default")
        if database not in databases or database not in connections.settings:
            continue
        if options.get("LISTEN_DATABASE") or options.get("TRANSACTION_POOLER") is False:
            continue
        connection = connections[database]
        if connection.vendor != "postgresql":
            continue
        why = "declared so (OPTIONS TRANSACTION_POOLER: True)"
        if options.get("TRANSACTION_POOLER") is None:
            try:
                connection.ensure_connection()
                seen = pooler.seen(connection.connection)
            except Exception:  # unreachable: W004's to report
                continue
            if not seen.pooled:
                continue
            why = f"the server sees the connection from {seen.server}, not {seen.ours}"
        messages.append(_poller(str(alias), database, why))
    return messages


def _poller(alias: str, database: str, why: str) -> Warning:
    return Warning(
        f"Lock store {alias!r} keeps locks in database {database!r}, which is reached through "
        f"a transaction pooler ({why}): the store LISTENs for releases on no connection "
        "there, so its waiters poll (each notices a release up to its retry_delay late).",
        hint=(
            "Add a DATABASES alias for the same database that reaches PostgreSQL directly "
            f'(or through session pooling), with "TEST": {{"MIRROR": "{database}"}}, and '
            "name it in OPTIONS LISTEN_DATABASE. If this is no transaction pooler (session "
            "pooling, a plain proxy), set OPTIONS TRANSACTION_POOLER: False."
        ),
        id=ID.format("W012"),
    )


def has_process(grants: Sequence[str]) -> bool:
    """Whether SHOW GRANTS' lines give the PROCESS privilege (ALL PRIVILEGES includes it)."""
    for grant in grants:
        found = GLOBAL_GRANT.match(grant)
        if found is None:
            continue
        privileges = {each.strip().upper() for each in found["privileges"].split(",")}
        if privileges & {"PROCESS", "ALL PRIVILEGES", "ALL"}:
            return True
    return False


def check_process_privilege(database: str, stores: str) -> list[CheckMessage]:
    """W008 (MariaDB's check): the clean-up reads information_schema.PROCESSLIST for the
    statements of other connections in flight, and without PROCESS it sees only its own
    user's."""
    connection = connections[database]
    try:
        with connection.cursor() as cursor:
            # Without FOR: the current user's grants and those of its enabled roles.
            cursor.execute("SHOW GRANTS")
            grants = [str(row[0]) for row in cursor.fetchall()]
            cursor.execute("SELECT CURRENT_USER()")
            (user,) = cursor.fetchone()
    except Exception:  # the table check just reached it; a failure now is W004's to report
        return []
    if has_process(grants):
        return []
    return [
        Warning(
            f"{stores} locks in database {database!r} as user {user}, which lacks the PROCESS "
            "privilege: the clean-up then sees only that user's statements in flight, and "
            "may delete a row while another user's acquire of that key draws its fence, so "
            "fences could go backwards.",
            hint="Grant PROCESS (GRANT PROCESS ON *.* TO ...), or make every process that "
            "locks through this table connect as the same user.",
            id=ID.format("W008"),
        )
    ]
