"""The app's migrations on real databases: what `sqlmigrate` prints is all they do, and the
router the README documents for a store on its own database."""

from __future__ import annotations

import io
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connections
from django.db.migrations.loader import MigrationLoader
from django.test import override_settings

from django_keel_lock import lock
from django_keel_lock.checks import check_store_tables
from django_keel_lock.models import Lock as LockRow

from .conftest import DATABASE_STORES, database_of, empty_database, store_params
from .support.markdown import ROOT, blocks_of

APP = "django_keel_lock"

# What the first migration does beyond creating the table, as `sqlmigrate` must print it.
VENDOR_PARTS = {
    "sqlite": ["CREATE INDEX IF NOT EXISTS django_keel_lock_lock_fence"],
    "postgresql": ["CREATE SEQUENCE IF NOT EXISTS django_keel_lock_fence;"],
    "mysql": [
        "CREATE SEQUENCE IF NOT EXISTS django_keel_lock_fence;",
        "MODIFY `key` VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin NOT NULL",
        "MODIFY holder VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL",
    ],
}

# What the permit migration does beyond its table and columns.
PERMIT_FUNCTIONS = [f"django_keel_lock_{op}_permit" for op in ("acquire", "release", "extend")]
PERMIT_PARTS = {
    "postgresql": [f"CREATE OR REPLACE FUNCTION {function}(" for function in PERMIT_FUNCTIONS],
    "mysql": [
        "ALTER TABLE django_keel_lock_permit MODIFY `key` VARCHAR(255) CHARACTER SET utf8mb4 "
        "COLLATE utf8mb4_nopad_bin NOT NULL",
    ],
}


def migration_names(database: str) -> list[str]:
    """Every migration of the app, in the order they apply."""
    graph = MigrationLoader(connections[database]).graph
    (leaf,) = graph.leaf_nodes(APP)
    return [name for app, name in graph.forwards_plan(leaf) if app == APP]


def sqlmigrate(database: str, name: str, *, backwards: bool = False) -> str:
    out = io.StringIO()
    call_command("sqlmigrate", APP, name, database=database, backwards=backwards, stdout=out)
    return out.getvalue()


def apply_by_hand(database: str, sql: str) -> None:
    """Run `sqlmigrate` output like a DBA would: each statement as printed (one per line)."""
    with connections[database].cursor() as cursor:
        for line in sql.splitlines():
            if line and not line.startswith("--") and line not in {"BEGIN;", "COMMIT;"}:
                cursor.execute(line.removesuffix(";"))


def schema(database: str) -> dict[str, Any]:
    """Everything of the app's in `database`: its tables' columns (with collations), indexes and
    constraints, and the sequences and functions on the server."""
    connection = connections[database]
    introspection = connection.introspection
    with connection.cursor() as cursor:
        tables = [name for name in introspection.table_names(cursor) if name.startswith(APP)]
        found: dict[str, Any] = {
            table: {
                "columns": [
                    (column.name, column.null_ok, column.collation)
                    for column in introspection.get_table_description(cursor, table)
                ],
                "constraints": introspection.get_constraints(cursor, table),
            }
            for table in tables
        }
        sequences: list[str] = []  # SQLite has none
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT sequence_name FROM information_schema.sequences "
                "WHERE sequence_schema = current_schema()"
            )
            sequences = [row[0] for row in cursor.fetchall()]
        elif connection.vendor == "mysql":
            cursor.execute(
                "SELECT table_name FROM information_schema.tables "
                "WHERE table_schema = DATABASE() AND table_type = 'SEQUENCE'"
            )
            sequences = [row[0] for row in cursor.fetchall()]
        found["sequences"] = sorted(sequences)
        functions: list[str] = []  # PostgreSQL's only
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT proname FROM pg_proc JOIN pg_namespace ON pg_namespace.oid = pronamespace "
                "WHERE nspname = current_schema() AND starts_with(proname, %s)",
                [APP],
            )
            functions = [row[0] for row in cursor.fetchall()]
        found["functions"] = sorted(functions)
    return found


@pytest.mark.parametrize("server", store_params(DATABASE_STORES))
def test_sqlmigrate_prints_every_operation_of_every_migration_both_ways(server: str) -> None:
    database = database_of(server)
    names = migration_names(database)
    forwards = {name: sqlmigrate(database, name) for name in names}
    backwards = {name: sqlmigrate(database, name, backwards=True) for name in names}

    assert names[:3] == ["0001_initial", "0002_lock_waiting", "0003_permits"]
    for name in names:
        assert "CANNOT BE WRITTEN AS SQL" not in forwards[name], name
        assert "CANNOT BE WRITTEN AS SQL" not in backwards[name], name
    for statement in VENDOR_PARTS[connections[database].vendor]:
        assert statement in forwards["0001_initial"]
    if connections[database].vendor != "sqlite":
        assert "DROP SEQUENCE IF EXISTS django_keel_lock_fence;" in backwards["0001_initial"]
    assert "waiting" in forwards["0002_lock_waiting"]
    for statement in PERMIT_PARTS.get(connections[database].vendor, []):
        assert statement in forwards["0003_permits"]
    if connections[database].vendor == "postgresql":
        for function in PERMIT_FUNCTIONS:
            assert f"DROP FUNCTION IF EXISTS {function}(" in backwards["0003_permits"]
        many = "django_keel_lock_acquire_many("
        assert f"CREATE OR REPLACE FUNCTION {many}" in forwards["0008_acquire_many"]
        assert f"DROP FUNCTION IF EXISTS {many}" in backwards["0008_acquire_many"]


@pytest.mark.parametrize("server", store_params(DATABASE_STORES))
def test_sqlmigrate_output_applied_by_hand_builds_and_removes_what_migrate_does(
    server: str,
) -> None:
    based_on = database_of(server)
    vendor = connections[based_on].vendor
    with (
        empty_database(based_on, "by-migrate") as migrated,
        empty_database(based_on, "by-hand") as by_hand,
    ):
        names = migration_names(migrated)
        call_command("migrate", APP, database=migrated, verbosity=0)
        for name in names:
            apply_by_hand(by_hand, sqlmigrate(by_hand, name))
        built, built_by_hand = schema(migrated), schema(by_hand)
        call_command("migrate", APP, "zero", database=migrated, verbosity=0)
        for name in reversed(names):
            apply_by_hand(by_hand, sqlmigrate(by_hand, name, backwards=True))
        removed, removed_by_hand = schema(migrated), schema(by_hand)

    assert built_by_hand == built
    assert removed_by_hand == removed == {"sequences": [], "functions": []}
    # What the vendor SQL adds really is there (so the comparison above covers it).
    table = built["django_keel_lock_lock"]
    if vendor == "sqlite":
        assert "django_keel_lock_lock_fence" in table["constraints"]
    else:
        assert built["sequences"] == ["django_keel_lock_fence"]
    if vendor == "postgresql":
        assert built["functions"] == sorted(
            [*PERMIT_FUNCTIONS, "django_keel_lock_acquire_many", "django_keel_lock_release"]
        )
    if vendor == "mysql":
        for name in ("django_keel_lock_lock", "django_keel_lock_permit"):
            collations = {column: collation for column, _, collation in built[name]["columns"]}
            assert collations["key"] == "utf8mb4_nopad_bin", name
            assert collations["holder"] == "utf8mb4_bin", name
        waiter = {
            column: collation
            for column, _, collation in built["django_keel_lock_waiter"]["columns"]
        }
        assert waiter["key"] == "utf8mb4_nopad_bin"
        result = {
            column: collation
            for column, _, collation in built["django_keel_lock_result"]["columns"]
        }
        assert result["key"] == "utf8mb4_nopad_bin"


def readme_router() -> Any:
    """The `LockRouter` class exactly as docs/stores.md shows it (its one block defining it)."""
    blocks = blocks_of(ROOT / "docs" / "stores.md")
    (block,) = [b for b in blocks if b.language == "python" and "class LockRouter" in b.code]
    namespace: dict[str, Any] = {}
    exec(compile(block.code, block.where, "exec"), namespace)
    return namespace["LockRouter"]()


def test_the_documented_router_puts_the_lock_table_in_its_database_only() -> None:
    on_locks = {
        "default": {
            "BACKEND": "django_keel_lock.stores.DatabaseLockStore",
            "OPTIONS": {"DATABASE": "locks"},
        }
    }
    with (
        empty_database("default", "locks"),
        empty_database("default", "elsewhere"),
        override_settings(DATABASE_ROUTERS=[readme_router()], KEEL_LOCK_STORES=on_locks),
    ):
        # Every app, on both databases, as a deploy's plain `migrate --database X` does.
        call_command("migrate", database="locks", verbosity=0)
        call_command("migrate", database="elsewhere", verbosity=0)
        in_locks = set(connections["locks"].introspection.table_names())
        in_elsewhere = set(connections["elsewhere"].introspection.table_names())
        problems = check_store_tables(databases=["locks"])
        handle = lock("migrations:router", ttl=60)
        acquired = handle.acquire()
        row = LockRow.objects.get(key=handle.key)  # the ORM reads it where the store wrote it
        handle.release()

    ours = {
        "django_keel_lock_lock",
        "django_keel_lock_permit",
        "django_keel_lock_waiter",
        "django_keel_lock_result",
    }
    assert in_locks - {"django_migrations"} == ours
    assert not ours & in_elsewhere
    assert "auth_user" in in_elsewhere
    assert problems == []
    assert acquired and row.holder == handle.holder and row._state.db == "locks"
