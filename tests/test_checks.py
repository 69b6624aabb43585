"""System checks for KEEL_LOCK_STORES and KEEL_LOCK_DEFAULT_TTL: one test per id. The settings
checks need no server; the server checks look at real databases, empty ones included, and at
Redis masters behind a Sentinel the tests start."""

from __future__ import annotations

import io
import os
import re
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from django.core.checks import CheckMessage
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import override_settings

from django_keel_lock import LockStoreMisconfigured, checks, lock, semaphore
from django_keel_lock.checks import check_sentinel_masters, check_store_tables, check_stores
from django_keel_lock.stores.database.checks import has_process

from .conftest import (
    DATABASE_STORES,
    database_like,
    database_of,
    empty_database,
    interrupted_after,
    needs,
    needs_store,
    serving,
    store_params,
)
from .support.redis_servers import REDIS_SERVER, FaultyProxy, redis_sentinel, via_sentinel

DB = "django_keel_lock.stores.DatabaseLockStore"
MEMORY = "django_keel_lock.stores.MemoryLockStore"
REDIS = "django_keel_lock.stores.RedisLockStore"


def ids(**settings: Any) -> list[str]:
    return [message.id or "" for message in messages(**settings)]


def messages(**settings: Any) -> list[CheckMessage]:
    """The settings checks' messages with `settings`; KEEL_LOCK_STORES, unless given, only a
    database store (the test settings' Redis stores share a database: W005)."""
    settings.setdefault("KEEL_LOCK_STORES", stores())
    with override_settings(**settings):
        return check_stores()


def stores(**aliases: Any) -> dict[str, Any]:
    return {"default": {"BACKEND": DB}, **aliases}


def test_the_test_settings_are_clean_but_for_the_redis_database_shared_on_purpose() -> None:
    # "redis-url" keeps its locks in the database of CACHES["locks"] (the "redis" store's
    # connection), so that stores on a URL and on a CONNECTION see the same keys
    # (tests/test_redis_store.py); nothing here clears that cache.
    (shared,) = check_stores()
    assert shared.id == "django_keel_lock.W005"
    assert shared.msg.startswith("KEEL_LOCK_STORES['redis-url'] keeps its locks in Redis")
    assert "which CACHES['locks'] uses too" in shared.msg


def test_no_keel_lock_stores_setting_is_clean() -> None:
    with override_settings():
        from django.conf import settings

        del settings.KEEL_LOCK_STORES
        assert check_stores() == []


@pytest.mark.parametrize(
    "value",
    [["default"], {"default": "django_keel_lock.stores.DatabaseLockStore"}, {"default": {}},
     {"default": {"BACKEND": 3}}],
    ids=["list", "str-config", "no-backend", "backend-not-str"],
)  # fmt: skip
def test_e001_malformed_stores(value: Any) -> None:
    assert ids(KEEL_LOCK_STORES=value) == ["django_keel_lock.E001"]


@pytest.mark.parametrize(
    "backend",
    ["nowhere.Store", "django_keel_lock.stores.NoSuchStore", "django_keel_lock.conf.conf"],
)
def test_e002_unknown_backend(backend: str) -> None:
    found = messages(KEEL_LOCK_STORES=stores(x={"BACKEND": backend}))
    assert [m.id for m in found] == ["django_keel_lock.E002"]
    assert "KEEL_LOCK_STORES['x']" in found[0].msg and backend in found[0].msg


def test_e003_options_not_a_dict() -> None:
    assert ids(KEEL_LOCK_STORES=stores(x={"BACKEND": DB, "OPTIONS": ["DATABASE"]})) == [
        "django_keel_lock.E003"
    ]


def test_e004_unknown_option_names_the_known_ones() -> None:
    found = messages(KEEL_LOCK_STORES=stores(x={"BACKEND": DB, "OPTIONS": {"DATABSE": "x"}}))
    assert [m.id for m in found] == ["django_keel_lock.E004"]
    assert "DATABSE" in found[0].msg and "DATABASE, DURABLE" in (found[0].hint or "")


def test_e005_database_store_on_an_unknown_database() -> None:
    found = messages(KEEL_LOCK_STORES=stores(x={"BACKEND": DB, "OPTIONS": {"DATABASE": "nope"}}))
    assert [m.id for m in found] == ["django_keel_lock.E005"]
    assert "'nope'" in found[0].msg and "default" in (found[0].hint or "")


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")
def test_e006_database_store_on_an_unsupported_database() -> None:
    from django.conf import settings

    databases = {**settings.DATABASES, "other": {"ENGINE": "django.db.backends.dummy"}}
    found = ids(
        DATABASES=databases,
        KEEL_LOCK_STORES=stores(x={"BACKEND": DB, "OPTIONS": {"DATABASE": "other"}}),
    )
    assert found == ["django_keel_lock.E006"]


def test_e007_redis_store_without_its_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    # As if neither package were installed (None in sys.modules makes imports fail).
    monkeypatch.setitem(sys.modules, "redis", None)
    monkeypatch.setitem(sys.modules, "django_redis", None)
    found = messages(
        KEEL_LOCK_STORES=stores(r={"BACKEND": REDIS, "OPTIONS": {"CONNECTION": "default"}}),
        CACHES={"default": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": "x"}},
    )
    assert [m.id for m in found] == ["django_keel_lock.E007"]
    assert "redis and django_redis are not installed" in found[0].msg
    url_only = messages(KEEL_LOCK_STORES=stores(r={"BACKEND": REDIS, "OPTIONS": {"URL": "x"}}))
    assert [m.id for m in url_only] == ["django_keel_lock.E007"]
    assert "redis is not installed" in url_only[0].msg


def test_e008_redis_connection_must_be_a_django_redis_cache() -> None:
    missing = messages(
        KEEL_LOCK_STORES=stores(r={"BACKEND": REDIS, "OPTIONS": {"CONNECTION": "nowhere"}})
    )
    assert [m.id for m in missing] == ["django_keel_lock.E008"]
    assert "'nowhere' is not a CACHES alias" in missing[0].msg
    wrong = messages(
        KEEL_LOCK_STORES=stores(r={"BACKEND": REDIS, "OPTIONS": {"CONNECTION": "local"}}),
        CACHES={"local": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}},
    )
    assert [m.id for m in wrong] == ["django_keel_lock.E008"]
    assert "not a django-redis one" in wrong[0].msg


@pytest.mark.parametrize("ttl", [-1, 0, "soon", None, True])
def test_e009_bad_default_ttl(ttl: Any) -> None:
    assert ids(KEEL_LOCK_DEFAULT_TTL=ttl) == ["django_keel_lock.E009"]


@pytest.mark.parametrize("ttl", [5, 0.5, "2m"])
def test_good_default_ttl(ttl: Any) -> None:
    assert ids(KEEL_LOCK_DEFAULT_TTL=ttl) == []


def test_w001_memory_store_as_default_in_production() -> None:
    memory_default = {"default": {"BACKEND": MEMORY}}
    assert ids(KEEL_LOCK_STORES=memory_default, DEBUG=False) == ["django_keel_lock.W001"]
    assert ids(KEEL_LOCK_STORES=memory_default, DEBUG=True) == []
    assert ids(KEEL_LOCK_STORES=stores(m={"BACKEND": MEMORY}), DEBUG=False) == []


def test_w002_no_default_alias() -> None:
    assert ids(KEEL_LOCK_STORES={"main": {"BACKEND": DB}}) == ["django_keel_lock.W002"]


@pytest.mark.parametrize("server", store_params(DATABASE_STORES))
def test_w003_store_database_without_the_lock_table_until_the_hinted_migrate(server: str) -> None:
    on_locks = stores(locks={"BACKEND": DB, "OPTIONS": {"DATABASE": "locks"}})
    with (
        empty_database(database_of(server), "locks"),
        override_settings(KEEL_LOCK_STORES=on_locks),
    ):
        with pytest.raises(LockStoreMisconfigured):  # what the warning is about
            lock("checks:w003", store="locks").acquire()
        found = check_store_tables(databases=["locks"])
        unasked = check_store_tables()  # plain `manage.py check`: no database is touched
        other_database = check_store_tables(databases=["default"])
        command_output = io.StringIO()
        call_command("check", databases=["locks"], stdout=io.StringIO(), stderr=command_output)
        hint = found[0].hint or ""
        # The hint, run as written and with its checks, as manage.py runs it: the warning shows
        # and does not stop it (an error would).
        migrate_output = io.StringIO()
        command = hint.removeprefix("Run: python manage.py ").split()
        call_command(*command, skip_checks=False, stdout=io.StringIO(), stderr=migrate_output)
        after = check_store_tables(databases=["locks"])
        handle = lock("checks:w003", store="locks")
        acquired = handle.acquire() and handle.release()

    assert [m.id for m in found] == ["django_keel_lock.W003"]
    assert found[0].msg.startswith("Lock store 'locks' keeps locks in table django_keel_lock_lock")
    assert "database 'locks'" in found[0].msg
    assert "LockStoreMisconfigured" in found[0].msg
    assert hint == "Run: python manage.py migrate django_keel_lock --database locks"
    assert unasked == [] and other_database == []
    assert "django_keel_lock.W003" in command_output.getvalue()
    assert "django_keel_lock.W003" in migrate_output.getvalue()
    assert after == [] and acquired


def test_w003_names_every_store_sharing_the_database_once() -> None:
    two = stores(a={"BACKEND": DB, "OPTIONS": {"DATABASE": "locks"}},
                 b={"BACKEND": DB, "OPTIONS": {"DATABASE": "locks"}})  # fmt: skip
    with empty_database("default", "locks"), override_settings(KEEL_LOCK_STORES=two):
        found = check_store_tables(databases=["default", "locks"])

    assert [m.id for m in found] == ["django_keel_lock.W003"]
    assert "Lock stores 'a', 'b' keep locks" in found[0].msg


@needs_store("postgres")
def test_w004_unreachable_store_database_is_reported_not_raised() -> None:
    down = stores(locks={"BACKEND": DB, "OPTIONS": {"DATABASE": "locks"}})
    # Nothing listens on port 1: the connection is refused at once.
    with database_like("postgres", "locks", PORT=1), override_settings(KEEL_LOCK_STORES=down):
        found = check_store_tables(databases=["locks"])

    assert [m.id for m in found] == ["django_keel_lock.W004"]
    assert "database 'locks', which could not be inspected" in found[0].msg
    assert "OperationalError" in found[0].msg


REDIS_CACHE = "django_redis.cache.RedisCache"


def test_w005_redis_store_through_the_default_cache_shares_its_database() -> None:
    found = messages(
        KEEL_LOCK_STORES=stores(r={"BACKEND": REDIS, "OPTIONS": {"CONNECTION": "default"}}),
        CACHES={"default": {"BACKEND": REDIS_CACHE, "LOCATION": "redis://127.0.0.1:6379/0"}},
    )
    assert [m.id for m in found] == ["django_keel_lock.W005"]
    assert "KEEL_LOCK_STORES['r']" in found[0].msg and "CACHES['default']" in found[0].msg
    assert "database 0 of 127.0.0.1:6379" in found[0].msg and "clear()" in found[0].msg
    assert "database of its own" in (found[0].hint or "")


@pytest.mark.parametrize(
    "location",
    ["redis://127.0.0.1:6379/0", "redis://localhost:6379", "redis://127.0.0.1/0?db=0",
     ["redis://127.0.0.1:6379/0", "redis://replica:6379/0"], "redis://127.0.0.1:6379/0,x"],
    ids=["equal", "localhost-no-db", "default-port-db-query", "list", "comma-separated"],
)  # fmt: skip
def test_w005_redis_store_url_on_a_cache_location(location: Any) -> None:
    on_cache = stores(r={"BACKEND": REDIS, "OPTIONS": {"URL": "redis://127.0.0.1:6379/0"}})
    caches = {"default": {"BACKEND": REDIS_CACHE, "LOCATION": location}}
    assert ids(KEEL_LOCK_STORES=on_cache, CACHES=caches) == ["django_keel_lock.W005"]
    django_own = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache",
                              "LOCATION": location}}  # fmt: skip
    assert ids(KEEL_LOCK_STORES=on_cache, CACHES=django_own) == ["django_keel_lock.W005"]


@pytest.mark.parametrize(
    "url", ["redis://127.0.0.1:6379/1", "redis://127.0.0.1:6380/0", "redis://other:6379/0"]
)
def test_w005_not_for_a_redis_store_on_a_database_of_its_own(url: str) -> None:
    caches = {
        "default": {"BACKEND": REDIS_CACHE, "LOCATION": "redis://127.0.0.1:6379/0"},
        "locks": {"BACKEND": REDIS_CACHE, "LOCATION": url},
    }
    by_url = ids(
        KEEL_LOCK_STORES=stores(by_url={"BACKEND": REDIS, "OPTIONS": {"URL": url}}),
        CACHES={"default": caches["default"]},
    )
    # The cache that is only its lock store's connection: nothing caches there.
    by_cache = ids(
        KEEL_LOCK_STORES=stores(by_cache={"BACKEND": REDIS, "OPTIONS": {"CONNECTION": "locks"}}),
        CACHES=caches,
    )
    assert by_url == [] and by_cache == []


def test_w005_redis_store_url_on_the_database_of_another_stores_connection_cache() -> None:
    url = "redis://127.0.0.1:6379/1"
    caches = {
        "default": {"BACKEND": REDIS_CACHE, "LOCATION": "redis://127.0.0.1:6379/0"},
        "locks": {"BACKEND": REDIS_CACHE, "LOCATION": url},
    }
    found = messages(
        KEEL_LOCK_STORES=stores(
            by_url={"BACKEND": REDIS, "OPTIONS": {"URL": url}},
            by_cache={"BACKEND": REDIS, "OPTIONS": {"CONNECTION": "locks"}},
        ),
        CACHES=caches,
    )
    # caches["locks"].clear() (or a loop over caches.all()) flushes by_url's locks: by_url
    # does not go through that cache, so nothing tells its owner the database is shared.
    assert [m.id for m in found] == ["django_keel_lock.W005"]
    assert found[0].msg.startswith("KEEL_LOCK_STORES['by_url'] keeps its locks in Redis")
    assert "CACHES['locks']" in found[0].msg


def test_w005_cache_clear_on_a_shared_database_frees_every_lock(key: str) -> None:
    """What W005 warns of, on a Redis of the test's own (FLUSHDB would wipe a shared one)."""
    from django.core.cache import caches

    from django_keel_lock.stores import RedisLockStore

    from .support.redis_servers import redis_server

    with redis_server() as server:
        shared = {"default": {"BACKEND": REDIS_CACHE, "LOCATION": server.url}}
        on_it = {"default": {"BACKEND": REDIS, "OPTIONS": {"URL": server.url}}}
        with override_settings(CACHES=shared, KEEL_LOCK_STORES=on_it):
            warned = [m.id for m in check_stores()]
            with serving(RedisLockStore("shared", {"URL": server.url})) as alias:
                held = lock(key, ttl=30, store=alias)
                assert held.acquire()
                caches["default"].clear()
                taken_by_another = lock(key, store=alias).acquire()
                released = held.release()
    assert warned == ["django_keel_lock.W005"]
    # The lock was free for another while its holder still thought it held it; the holder
    # learns it only at release.
    assert taken_by_another and released is False


def test_checks_do_not_connect_to_servers() -> None:
    # Nothing listens on port 1: a check that connected would fail or hang here.
    started = time.monotonic()
    found = ids(
        KEEL_LOCK_STORES=stores(r={"BACKEND": REDIS, "OPTIONS": {"URL": "redis://127.0.0.1:1/0"}})
    )
    assert found == []
    assert time.monotonic() - started < 1


def test_manage_py_check_reports_the_ids() -> None:
    with override_settings(KEEL_LOCK_STORES={"default": {"BACKEND": "nowhere.Store"}}):
        with pytest.raises(SystemCheckError, match=r"django_keel_lock\.E002"):
            call_command("check")


def test_every_id_is_documented_in_the_module_docstring() -> None:
    # The generic checks are in checks.py, each store's with the store.
    package = Path(checks.__file__).parent
    source = "".join(path.read_text() for path in sorted(package.rglob("*.py")))
    used = set(re.findall(r'ID\.format\("([EW]\d{3})"\)', source))
    documented = set(re.findall(r"django_keel_lock\.([EW]\d{3})", checks.__doc__ or ""))
    assert used == documented
    assert {"E001", "E009", "W001", "W002"} <= used


@pytest.mark.parametrize("server", store_params(DATABASE_STORES))
def test_w006_a_database_migrated_to_0002_only_has_no_semaphores_until_0003(server: str) -> None:
    locks = stores(locks={"BACKEND": DB, "OPTIONS": {"DATABASE": "locks"}})
    with (
        empty_database(database_of(server), "locks"),
        override_settings(KEEL_LOCK_STORES=locks),
    ):
        call_command("migrate", "django_keel_lock", "0002", database="locks", verbosity=0)
        found = check_store_tables(databases=["locks"])
        assert lock("checks:w006", store="locks").run(lambda: "exclusive") == (True, "exclusive")
        with pytest.raises(LockStoreMisconfigured, match="migrate django_keel_lock"):
            semaphore("checks:w006:permits", limit=2, store="locks").acquire()
        call_command("migrate", "django_keel_lock", database="locks", verbosity=0)
        after = check_store_tables(databases=["locks"])
        permits = semaphore("checks:w006:permits", limit=2, store="locks")
        acquired = permits.acquire() and permits.release()

    assert [m.id for m in found] == ["django_keel_lock.W006"]
    assert "django_keel_lock_permit" in found[0].msg and "exclusive locks work" in found[0].msg
    assert found[0].hint == "Run: python manage.py migrate django_keel_lock --database locks"
    assert after == [] and acquired


def _sentinel_ids(found: list[CheckMessage]) -> list[str]:
    return [m.id or "" for m in found]


@needs(os.path.exists(REDIS_SERVER), "the redis-server binary")
def test_w007_sentinel_master_without_min_replicas_until_set() -> None:
    with redis_sentinel("keelcheck") as setup, via_sentinel(setup.sentinel.port, "keelcheck"):
        found = check_sentinel_masters(databases=["default"])
        unasked = check_sentinel_masters()  # plain `manage.py check`: no server is asked
        command_output = io.StringIO()
        call_command("check", databases=["default"], stdout=io.StringIO(), stderr=command_output)
        # On the master this test started; one of the two alone still leaves it off.
        setup.master.cli("config", "set", "min-replicas-to-write", "1")
        setup.master.cli("config", "set", "min-replicas-max-lag", "0")
        half = check_sentinel_masters(databases=["default"])
        setup.master.cli("config", "set", "min-replicas-max-lag", "1")
        after = check_sentinel_masters(databases=["default"])

    assert _sentinel_ids(found) == ["django_keel_lock.W007"]
    assert "KEEL_LOCK_STORES['via-sentinel'] goes through Sentinel" in found[0].msg
    assert "min-replicas-to-write 0, min-replicas-max-lag 10" in found[0].msg
    assert "two holders" in found[0].msg
    assert "min-replicas-to-write 1 and min-replicas-max-lag 1 on every" in (found[0].hint or "")
    assert unasked == []
    assert "django_keel_lock.W007" in command_output.getvalue()
    assert _sentinel_ids(half) == ["django_keel_lock.W007"]
    assert "min-replicas-max-lag 0" in half[0].msg
    assert after == []


def test_w007_not_for_redis_stores_without_sentinel() -> None:
    # The test settings' stores: a django-redis cache's client and a URL, on plain servers; and
    # a URL where nothing listens (port 1), which a check that connected would report.
    down = {"down": {"BACKEND": REDIS, "OPTIONS": {"URL": "redis://127.0.0.1:1/0"}}}
    from django.conf import settings

    with override_settings(KEEL_LOCK_STORES={**settings.KEEL_LOCK_STORES, **down}):
        started = time.monotonic()
        found = check_sentinel_masters(databases=["default"])
        took = time.monotonic() - started
    assert found == []
    assert took < 1


@needs(os.path.exists(REDIS_SERVER), "the redis-server binary")
def test_w009_sentinel_master_refusing_config_is_reported_not_raised() -> None:
    with redis_sentinel("keelacl") as setup, via_sentinel(setup.sentinel.port, "keelacl"):
        setup.master.cli("acl", "setuser", "default", "-config")
        found = check_sentinel_masters(databases=["default"])
        setup.master.cli("acl", "setuser", "default", "+config")
        allowed = check_sentinel_masters(databases=["default"])

    assert _sentinel_ids(found) == ["django_keel_lock.W009"]
    assert "could not be asked for min-replicas-to-write" in found[0].msg
    assert "NoPermissionError" in found[0].msg
    assert "CONFIG is renamed or not allowed" in (found[0].hint or "")
    assert _sentinel_ids(allowed) == ["django_keel_lock.W007"]


@needs(os.path.exists(REDIS_SERVER), "the redis-server binary")
@pytest.mark.parametrize("frozen", ["sentinel", "master"])
def test_w009_frozen_server_is_reported_within_the_socket_timeout(frozen: str) -> None:
    proxy = FaultyProxy(0)  # in front of the sentinel, or of the master the sentinel names
    try:
        announced = proxy.port if frozen == "master" else None
        with redis_sentinel(f"keelfrozen{frozen}", monitor_port=announced) as setup:
            proxy.target_port = setup.master.port if frozen == "master" else setup.sentinel.port
            sentinel_port = setup.sentinel.port if frozen == "master" else proxy.port
            options = {"SOCKET_TIMEOUT": 0.5}
            with via_sentinel(sentinel_port, f"keelfrozen{frozen}", store_options=options):
                reachable = check_sentinel_masters(databases=["default"])
                proxy.mode = "stall"
                started = time.monotonic()
                with interrupted_after(5):  # a check that waited on the socket would hang
                    found = check_sentinel_masters(databases=["default"])
                took = time.monotonic() - started
    finally:
        proxy.close()

    assert _sentinel_ids(reachable) == ["django_keel_lock.W007"]
    assert _sentinel_ids(found) == ["django_keel_lock.W009"]
    assert "could not be asked" in found[0].msg and "reachable" in (found[0].hint or "")
    assert took < 1.5  # one connect and one reply, each at most 0.5 s


@needs_store("mariadb")
def test_w008_mariadb_user_without_process_until_it_is_the_root_user() -> None:
    from django.db import connections

    root = connections["mariadb"]
    user = f"keel_check_{uuid.uuid4().hex[:8]}"
    name = root.settings_dict["NAME"]
    on_locks = stores(locks={"BACKEND": DB, "OPTIONS": {"DATABASE": "locks"}})
    with root.cursor() as cursor:
        cursor.execute(f"CREATE USER '{user}'@'%' IDENTIFIED BY ''")
    try:
        with root.cursor() as cursor:
            cursor.execute(f"GRANT ALL PRIVILEGES ON `{name}`.* TO '{user}'@'%'")
        with (
            database_like("mariadb", "locks", USER=user, PASSWORD=""),
            override_settings(KEEL_LOCK_STORES=on_locks),
        ):
            found = check_store_tables(databases=["locks"])
            with root.cursor() as cursor:
                cursor.execute(f"GRANT PROCESS ON *.* TO '{user}'@'%'")
            connections["locks"].close()
            granted = check_store_tables(databases=["locks"])
        on_root = stores(locks={"BACKEND": DB, "OPTIONS": {"DATABASE": "mariadb"}})
        with override_settings(KEEL_LOCK_STORES=on_root):
            as_root = check_store_tables(databases=["mariadb"])
    finally:
        with root.cursor() as cursor:
            cursor.execute(f"DROP USER '{user}'@'%'")

    assert [m.id for m in found] == ["django_keel_lock.W008"]
    assert f"Lock store 'locks' keeps locks in database 'locks' as user {user}@%" in found[0].msg
    assert "PROCESS" in found[0].msg
    assert "connect as the same user" in (found[0].hint or "")
    assert granted == [] and as_root == []


def test_w008_reads_process_from_show_grants() -> None:
    assert has_process(["GRANT ALL PRIVILEGES ON *.* TO `root`@`localhost`"])
    assert has_process(["GRANT USAGE ON *.* TO `u`@`%`",
                                "GRANT SELECT, PROCESS ON *.* TO `u`@`%`"])  # fmt: skip
    assert not has_process(["GRANT USAGE ON *.* TO `u`@`%`",
                                    "GRANT ALL PRIVILEGES ON `test`.* TO `u`@`%`",
                                    "GRANT `process_role` TO `u`@`%`"])  # fmt: skip
