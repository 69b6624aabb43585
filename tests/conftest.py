"""Shared fixtures: every store alias that can run here, unique keys, real databases."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import pytest
from django.conf import settings
from django.db import connections
from django.test.utils import override_settings, setup_databases, teardown_databases

from django_keel_lock import Lock, get_lock_store, lock, set_lock_store
from django_keel_lock.registry import reset_stores
from django_keel_lock.stores import LockStore
from tests.settings import reachable

# What a user's conftest.py does to get the keel_lock_memory_store fixture.
pytest_plugins = ["django_keel_lock.testing"]


# alias -> reason it cannot run here (None: it runs)
def _store_availability() -> dict[str, str | None]:
    dbs = settings.DATABASES
    return {
        "memory": None,
        "sqlite": None,
        "postgres": None if "postgres" in dbs else "PostgreSQL is not reachable",
        "mariadb": None if "mariadb" in dbs else "MariaDB is not reachable",
        "redis": None if settings.SERVERS["redis"] or settings.CI else "Redis is not reachable",
    }


STORE_AVAILABILITY = _store_availability()
DATABASE_STORES = ["sqlite", "postgres", "mariadb"]
SERVER_DATABASES = ["postgres", "mariadb"]


def store_params(aliases: list[str]) -> list[Any]:
    params = []
    for alias in aliases:
        reason = STORE_AVAILABILITY.get(alias)
        marks = [pytest.mark.skip(reason=f"SERVER UNAVAILABLE: {reason}")] if reason else []
        params.append(pytest.param(alias, id=alias, marks=marks))
    return params


ALL_STORES = store_params(list(STORE_AVAILABILITY))


def needs_store(alias: str) -> pytest.MarkDecorator:
    """Skip loudly when `alias`'s server does not answer (never under CI: see tests.settings)."""
    reason = STORE_AVAILABILITY[alias]
    return pytest.mark.skipif(reason is not None, reason=f"SERVER UNAVAILABLE: {reason}")


def needs(present: bool, what: str) -> pytest.MarkDecorator:
    """Skip loudly when `what` is missing here; under CI=true the test runs, and fails."""
    return pytest.mark.skipif(
        not present and not settings.CI, reason=f"MISSING HERE (CI fails instead): {what}"
    )


def require_reachable(host: str, port: int, what: str) -> None:
    """Inside a test or fixture: skip loudly when the server does not answer, fail under CI."""
    if not reachable(host, port):
        skip_or_fail(f"SERVER UNAVAILABLE: {what} at {host}:{port} is not reachable")


def skip_or_fail(message: str) -> NoReturn:
    """Inside a test or fixture, for something this machine lacks: skip loudly here, fail
    under CI=true (where everything the suite needs is installed)."""
    if settings.CI:
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def django_db_setup(django_test_environment: Any, django_db_blocker: Any) -> Iterator[None]:
    """Create and migrate a test database on every configured server, whatever tests ask for:
    stores open their own connections to them."""
    with django_db_blocker.unblock():
        config = setup_databases(verbosity=0, interactive=False, aliases=set(connections))
    yield
    reset_stores()
    with django_db_blocker.unblock():
        teardown_databases(config, verbosity=0)
    # The SQLite test database's doorbells (stores.database.doorbells) go with it.
    shutil.rmtree(f"{settings.DATABASES['default']['TEST']['NAME']}.keel-bells", True)


@pytest.fixture(scope="session", autouse=True)
def _databases(django_db_setup: Any, django_db_blocker: Any) -> Iterator[None]:
    """Stores open their own connections, outside any test transaction: let them."""
    with django_db_blocker.unblock():
        yield


@pytest.fixture(autouse=True)
def _no_clean_up_round_midway() -> None:
    """Each test starts a full SWEEP_EVERY away from its database stores' next clean-up round
    (this thread's), so a test of a few operations never runs into one: a round's statements
    would show in counts of round trips, and take rows that `prune` is expected to find.
    tests/test_database_cleanup.py runs rounds on purpose."""
    from django_keel_lock.stores import DatabaseLockStore
    from django_keel_lock.stores.database import store as database_store

    for alias in DATABASE_STORES:
        if STORE_AVAILABILITY[alias] is None:
            store = get_lock_store(alias)
            if isinstance(store, DatabaseLockStore):
                store._sweeps.countdown = database_store.SWEEP_EVERY


# -- a third party's store through the contract suite (docs/writing-a-store.md) -----------
#: The alias KEEL_LOCK_CONTRACT_STORE="package.module.StoreClass" (with its OPTIONS as a JSON
#: object in KEEL_LOCK_CONTRACT_OPTIONS) adds to the stores tests/test_contract.py runs on.
THIRD_PARTY = "third-party"


def third_party_store_config() -> dict[str, Any] | None:
    """The KEEL_LOCK_STORES entry the environment asks for, or None when it asks for none."""
    backend = os.environ.get("KEEL_LOCK_CONTRACT_STORE", "").strip()
    if not backend:
        return None
    raw = os.environ.get("KEEL_LOCK_CONTRACT_OPTIONS", "").strip() or "{}"
    try:
        options = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise pytest.UsageError(
            f"KEEL_LOCK_CONTRACT_OPTIONS is not JSON ({exc}): {raw!r}"
        ) from None
    if not isinstance(options, dict):
        raise pytest.UsageError(
            f"KEEL_LOCK_CONTRACT_OPTIONS must be a JSON object (the store's OPTIONS), got {raw!r}"
        )
    return {"BACKEND": backend, "OPTIONS": options}


THIRD_PARTY_STORE = third_party_store_config()
#: The alias of the etcd store in the contract suite: a 3-member cluster of the run's own.
ETCD = "etcd"
#: The contract suite's stores: every built-in one that runs here, and the third party's.
CONTRACT_STORES = (
    ALL_STORES
    + [pytest.param(ETCD, id=ETCD)]
    + ([pytest.param(THIRD_PARTY, id=THIRD_PARTY)] if THIRD_PARTY_STORE else [])
)


@pytest.fixture(scope="session")
def etcd_alias(_databases: None) -> Iterator[str]:
    """KEEL_LOCK_STORES["etcd"] on a 3-member etcd cluster started for the run (when the first
    test asks for it); etcd missing skips, or fails under CI."""
    from tests.support.etcd import etcd_cluster, etcd_installed

    if not etcd_installed():
        skip_or_fail("SERVER UNAVAILABLE: etcd (Debian's etcd-server) is not installed")
    backend = "django_keel_lock.stores.EtcdLockStore"
    with etcd_cluster() as cluster:
        config = {"BACKEND": backend, "OPTIONS": {"ENDPOINTS": cluster.endpoints}}
        with override_settings(KEEL_LOCK_STORES={**settings.KEEL_LOCK_STORES, ETCD: config}):
            yield ETCD
            get_lock_store(ETCD).close()


@pytest.fixture(scope="session", autouse=True)
def _third_party_store(_databases: None) -> Iterator[None]:
    """KEEL_LOCK_STORES["third-party"] for the whole run, when the environment names one."""
    if THIRD_PARTY_STORE is None:
        yield
        return
    with override_settings(
        KEEL_LOCK_STORES={**settings.KEEL_LOCK_STORES, THIRD_PARTY: THIRD_PARTY_STORE}
    ):
        yield


@pytest.fixture
def key(request: pytest.FixtureRequest) -> str:
    """A key no other test (or earlier run) uses, so rows left in a database never collide."""
    return f"test:{request.node.name[:60]}:{uuid.uuid4().hex[:12]}"


@pytest.fixture(params=ALL_STORES)
def store_alias(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=store_params(DATABASE_STORES))
def db_alias(request: pytest.FixtureRequest) -> str:
    """Each database store's alias in turn."""
    return str(request.param)


@pytest.fixture(params=store_params(SERVER_DATABASES))
def server_alias(request: pytest.FixtureRequest) -> str:
    """Each database store's alias whose database is a server (not SQLite) in turn."""
    return str(request.param)


@pytest.fixture
def store(store_alias: str) -> LockStore:
    return get_lock_store(store_alias)


@pytest.fixture
def make_lock(store_alias: str, key: str) -> Callable[..., Lock]:
    def make(name: str | None = None, **kwargs: Any) -> Lock:
        kwargs.setdefault("store", store_alias)
        return lock(name or key, **kwargs)

    return make


def database_of(store_alias: str) -> str:
    """The DATABASES alias of the database store `store_alias`."""
    return str(get_lock_store(store_alias).database)  # type: ignore[attr-defined]


@contextmanager
def serving(store: LockStore) -> Iterator[str]:
    """`store` as the lock store of its own alias while the block runs (yields the alias);
    then the alias is unset and the store closed."""
    set_lock_store(store, store.alias)
    try:
        yield store.alias
    finally:
        set_lock_store(None, store.alias)
        store.close()


@contextmanager
def database_like(based_on: str, name: str, **changes: Any) -> Iterator[str]:
    """The Django database alias `name`, a copy of `based_on` with `changes` (OPTIONS, PORT)
    while the block runs; then it is forgotten, with the connection the handler kept for it."""
    connections.settings[name] = {**connections.settings[based_on], **changes}
    try:
        yield name
    finally:
        connections[name].close()
        del connections[name]  # the handler caches the wrapper, settings and all
        del connections.settings[name]


@contextmanager
def empty_database(based_on: str, name: str) -> Iterator[str]:
    """The alias `name` for a new, empty database on `based_on`'s server (nothing migrated),
    while the block runs; then the database is dropped. Close stores opened on it first."""
    vendor = connections[based_on].vendor
    if vendor == "sqlite":
        with tempfile.TemporaryDirectory() as directory:
            with database_like(based_on, name, NAME=os.path.join(directory, "empty.sqlite3")):
                yield name
        return
    database = f"{connections[based_on].settings_dict['NAME']}_{uuid.uuid4().hex[:8]}"
    quoted = connections[based_on].ops.quote_name(database)
    # The charset the test databases get (utf8mb4 on MariaDB), whatever the server's default.
    suffix = connections[based_on].creation.sql_table_creation_suffix()
    with connections[based_on].cursor() as cursor:
        cursor.execute(f"CREATE DATABASE {quoted} {suffix}")
    try:
        with database_like(based_on, name, NAME=database):
            yield name
    finally:
        with connections[based_on].cursor() as cursor:
            cursor.execute(f"DROP DATABASE {quoted}")


@pytest.fixture
def postgres_notifications() -> Iterator[Callable[[str], Callable[[], int]]]:
    """LISTEN on a key's release channel from a connection of our own; a counter of NOTIFYs."""
    import psycopg

    from django_keel_lock.stores.database.dialects.postgresql import notify_channel

    settings = connections["postgres"].settings_dict
    raw = psycopg.connect(
        host=settings["HOST"],
        port=settings["PORT"],
        user=settings["USER"],
        dbname=settings["NAME"],
        autocommit=True,
    )

    def listen(key: str) -> Callable[[], int]:
        raw.execute(f"LISTEN {notify_channel(key)}")

        def count() -> int:
            return len(list(raw.notifies(timeout=0.3)))

        return count

    yield listen
    raw.close()


class TimeLimit(BaseException):
    """What `interrupted_after` raises: like a task's time limit, not an Exception."""


@contextmanager
def interrupted_after(seconds: float) -> Iterator[None]:
    """Raise TimeLimit in the main thread after `seconds`, wherever it is then (a signal)."""

    def interrupt(signum: int, frame: object) -> None:
        raise TimeLimit

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
