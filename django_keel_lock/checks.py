"""System checks for the django-keel-lock settings.

The settings checks read settings only: they never connect. The server checks follow Django's
convention for checks tagged `database`: they run only when a command asks for databases
(`check --database locks`, and `migrate`, which checks the database it migrates). The database
check (W003, W004, W006, W008) looks at the schema and the user's privileges of those databases,
taking no lock; the Sentinel check (W007, W009) then asks the master of each RedisLockStore
that goes through Sentinel for its settings, each wait at most the store's SOCKET_TIMEOUT or
2 s, whichever is shorter. The view keys check (E012) walks the URLconf, with Django's URL
checks. All are registered in `KeelLockConfig.ready()`.

Errors
  django_keel_lock.E001  KEEL_LOCK_STORES is not a dict, or an alias's config is not a dict with
                         a BACKEND.
  django_keel_lock.E002  A BACKEND cannot be imported or is not a LockStore.
  django_keel_lock.E003  An alias's OPTIONS is not a dict.
  django_keel_lock.E004  OPTIONS names options the backend does not know.
  django_keel_lock.E005  DatabaseLockStore OPTIONS DATABASE names no DATABASES alias.
  django_keel_lock.E006  DatabaseLockStore on a database it does not support (PostgreSQL,
                         MariaDB and SQLite only; MySQL has no sequences).
  django_keel_lock.E007  RedisLockStore without redis-py installed, or with CONNECTION and
                         without django-redis installed (pip install django-keel-lock[redis]).
  django_keel_lock.E008  RedisLockStore OPTIONS CONNECTION names no CACHES alias, or a cache
                         that is not a django-redis cache.
  django_keel_lock.E009  KEEL_LOCK_DEFAULT_TTL is not a positive duration.
  django_keel_lock.E010  A DatabaseLockStore's or RedisLockStore's OPTIONS SOCKET_TIMEOUT is not
                         a positive duration.
  django_keel_lock.E011  KEEL_LOCK_METRICS is not "prometheus", "otel", a list of them or None.
  django_keel_lock.E012  A @lock_view (or LockViewMixin) key template names a <name> that a URL
                         routed to the view does not capture: every request there fails
                         (a URL check: `check --tag urls`).

Warnings
  django_keel_lock.W001  MemoryLockStore is the "default" store while DEBUG is False: it does not
                         coordinate processes, so two workers can hold the same lock.
  django_keel_lock.W002  KEEL_LOCK_STORES has no "default" alias: lock() without store= fails.
  django_keel_lock.W003  A DatabaseLockStore's database has no lock table (not migrated there):
                         every lock on that store fails with LockStoreMisconfigured.
  django_keel_lock.W004  A DatabaseLockStore's database could not be inspected for W003
                         (unreachable, or a missing driver).
  django_keel_lock.W005  A RedisLockStore keeps its locks in the Redis database of a Django
                         cache (any but the store's own CONNECTION when nothing else names
                         it): that cache's clear() (FLUSHDB) deletes every lock.
  django_keel_lock.W006  A DatabaseLockStore's database has the lock table but not the permit
                         table (migration 0003): its semaphores and shared locks fail.
  django_keel_lock.W007  A RedisLockStore through Sentinel whose master has
                         min-replicas-to-write (or min-replicas-max-lag) 0: after a failover
                         that leaves it running, the old master grants locks a second time.
  django_keel_lock.W008  A DatabaseLockStore on MariaDB whose user lacks the PROCESS privilege:
                         the clean-up sees only that user's statements, so every process that
                         locks through the table must connect as that user.
  django_keel_lock.W009  A RedisLockStore's Sentinel master could not be asked for W007
                         (unreachable within the bound, or CONFIG refused).
  django_keel_lock.W010  A setting starting with KEEL_LOCK that django-keel-lock does not read (a
                         misspelling is otherwise ignored): named with the closest real one.
  django_keel_lock.W011  KEEL_LOCK_METRICS names a backend whose package is not installed: locks
                         work, those metrics are off (pip install django-keel-lock[prometheus]
                         or [otel]).
"""

from __future__ import annotations

import difflib
import importlib.util
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import import_module
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning
from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.urls import URLPattern, URLResolver, get_resolver
from django.utils.module_loading import import_string

from .conf import (
    METRIC_BACKENDS,
    SETTING_NAMES,
    UnknownStoreOptions,
    conf,
    is_store_config,
    store_options,
    validate_store_options,
)
from .durations import to_seconds
from .exceptions import LockStoreUnavailable
from .registry import NotALockStore, build_store, import_backend
from .stores.base import LockStore
from .stores.connections import socket_timeout_option
from .stores.database import DatabaseLockStore
from .stores.database.dialects import DIALECTS
from .stores.database.dialects.base import PERMIT_TABLE
from .stores.database.dialects.base import TABLE as LOCK_TABLE
from .views import LockViewMixin, parse_key_template

ID = "django_keel_lock.{}"
#: Where RedisLockStore is found: named without importing it, which fails without redis-py.
REDIS_BACKENDS = {
    "django_keel_lock.stores.RedisLockStore",
    "django_keel_lock.stores.redis.RedisLockStore",
}
SUPPORTED_VENDORS = frozenset(DIALECTS)  # the database store supports what it has dialects for


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_stores(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """Every mistake in KEEL_LOCK_STORES / KEEL_LOCK_DEFAULT_TTL that can be seen offline."""
    messages: list[CheckMessage] = []
    messages.extend(_check_setting_names())
    messages.extend(_check_default_ttl())
    messages.extend(_check_metrics())
    stores = conf.raw_stores()
    if not isinstance(stores, dict):
        return [
            *messages,
            Error(
                f"KEEL_LOCK_STORES must be a dict of alias -> store config, "
                f"got {type(stores).__name__}.",
                hint='e.g. {"default": {"BACKEND": "django_keel_lock.stores.DatabaseLockStore"}}',
                id=ID.format("E001"),
            ),
        ]
    if "default" not in stores:
        messages.append(
            Warning(
                'KEEL_LOCK_STORES has no "default" alias, so lock() and the decorators fail '
                "unless every call passes store=.",
                hint='Add a "default" alias.',
                id=ID.format("W002"),
            )
        )
    for alias, config in stores.items():
        messages.extend(_check_alias(alias, config))
    return messages


def _check_setting_names() -> list[CheckMessage]:
    """W010: a KEEL_LOCK* setting we do not read (a typo: KEEL_LOCK_STORE) is ignored, and the
    default it meant to change silently used."""
    messages: list[CheckMessage] = []
    for name in sorted(n for n in dir(settings) if n.startswith("KEEL_LOCK")):
        if name in SETTING_NAMES:
            continue
        close = difflib.get_close_matches(name, SETTING_NAMES, n=1, cutoff=0.8)
        meant = f": did you mean {close[0]}?" if close else "."
        messages.append(
            Warning(
                f"{name} is not a django-keel-lock setting, so it is ignored{meant}",
                hint=f"The settings are {', '.join(SETTING_NAMES)}.",
                id=ID.format("W010"),
            )
        )
    return messages


def _check_metrics() -> list[CheckMessage]:
    """E011: KEEL_LOCK_METRICS is malformed. W011: a backend it names cannot be imported; the
    app then runs with that backend off (see metrics.load), so starting it is not refused."""
    try:
        names = conf.METRICS
    except ImproperlyConfigured as exc:
        return [
            Error(
                f"{exc}.",
                hint='e.g. KEEL_LOCK_METRICS = "prometheus" or ["prometheus", "otel"]',
                id=ID.format("E011"),
            )
        ]
    messages: list[CheckMessage] = []
    for name in names:
        module = METRIC_BACKENDS[name]
        try:
            import_module(module)
        except ImportError as exc:
            messages.append(
                Warning(
                    f"KEEL_LOCK_METRICS names {name!r} but {module} cannot be imported "
                    f"({exc}): locks work, and their metrics for {name!r} are off.",
                    hint=f"pip install 'django-keel-lock[{name}]', or take {name!r} out of "
                    "KEEL_LOCK_METRICS.",
                    id=ID.format("W011"),
                )
            )
    return messages


def _check_default_ttl() -> list[CheckMessage]:
    try:
        to_seconds("KEEL_LOCK_DEFAULT_TTL", conf.raw_default_ttl())
    except (TypeError, ValueError) as exc:
        return [
            Error(
                f"{exc}.",
                hint='Use seconds (30), a timedelta or a duration string ("30s", "5m").',
                id=ID.format("E009"),
            )
        ]
    return []


def _where(alias: str) -> str:
    return f"KEEL_LOCK_STORES[{alias!r}]"


def _check_alias(alias: str, config: object) -> list[CheckMessage]:
    """The checks every entry gets, then those of each of our stores its BACKEND is."""
    where = _where(alias)
    if not is_store_config(config):
        return [
            Error(
                f"{where} must be a dict with a BACKEND (a dotted path), got {config!r:.80}.",
                hint='e.g. {"BACKEND": "django_keel_lock.stores.DatabaseLockStore"}',
                id=ID.format("E001"),
            )
        ]
    messages: list[CheckMessage] = []
    options = store_options(config)
    if options is None:
        messages.append(
            Error(
                f"{where} OPTIONS must be a dict, got {type(config['OPTIONS']).__name__}.",
                id=ID.format("E003"),
            )
        )
        options = {}
    path: str = config["BACKEND"]
    try:
        backend = import_backend(path)
    except (ImportError, ImproperlyConfigured) as exc:  # a store missing its driver says so
        return [*messages, *_check_unimportable(alias, path, options, exc)]
    except NotALockStore:
        return [
            *messages,
            Error(f"{where} BACKEND {path!r} is not a LockStore subclass.", id=ID.format("E002")),
        ]
    messages.extend(_check_option_names(alias, backend, options))
    for check in _backend_checks(backend):
        messages.extend(check(alias, options))
    return messages


def _check_unimportable(
    alias: str, path: str, options: Mapping[str, Any], exc: Exception
) -> list[CheckMessage]:
    """E002 for a BACKEND that cannot be imported; for RedisLockStore, its own checks, and E002
    only when no package is missing (E007 then says what to install)."""
    cannot = Error(
        f"{_where(alias)} BACKEND {path!r} cannot be imported: {exc}",
        hint="Use django_keel_lock.stores.DatabaseLockStore, RedisLockStore, "
        "MemoryLockStore or your own LockStore subclass.",
        id=ID.format("E002"),
    )
    if path not in REDIS_BACKENDS:
        return [cannot]
    messages = _check_redis(alias, options)
    return messages if _missing_redis_packages(options) else [*messages, cannot]


def _check_option_names(
    alias: str, backend: type[LockStore], options: Mapping[str, Any]
) -> list[CheckMessage]:
    try:
        validate_store_options(alias, backend, options)
    except UnknownStoreOptions as exc:
        return [
            Error(
                f"{_where(alias)} OPTIONS has unknown option(s) {', '.join(exc.names)} for "
                f"{backend.__name__}.",
                hint=f"Known options: {exc.known}.",
                id=ID.format("E004"),
            )
        ]
    return []


#: The checks of one store's OPTIONS: (alias, OPTIONS) -> messages. The signature of the
#: `check_config(alias, options)` classmethod these can become on the store classes.
BackendCheck = Callable[[str, Mapping[str, Any]], list[CheckMessage]]


def _backend_checks(backend: type[LockStore]) -> Iterator[BackendCheck]:
    """The checks of each of our stores that `backend` is or subclasses."""
    ours: list[tuple[str, BackendCheck]] = [
        ("redis.RedisLockStore", _check_redis),
        ("database.DatabaseLockStore", _check_database),
        ("memory.MemoryLockStore", _check_memory),
    ]
    for store, check in ours:
        if _is_store(backend, store):
            yield check


def _is_store(backend: type[LockStore], store: str) -> bool:
    """Whether `backend` is or subclasses `django_keel_lock.stores.<store>` ("module.Class").

    Only a loaded module is looked in: a class can subclass a store only once that store's
    module is loaded, so this never imports a store (or its driver) a project does not use.
    """
    module, name = store.split(".")
    cls = getattr(sys.modules.get(f"django_keel_lock.stores.{module}"), name, None)
    return isinstance(cls, type) and issubclass(backend, cls)


def _check_memory(alias: str, options: Mapping[str, Any]) -> list[CheckMessage]:
    if alias != "default" or settings.DEBUG:
        return []
    return [
        Warning(
            'MemoryLockStore is the "default" lock store while DEBUG is False: it only '
            "coordinates threads of one process, so two workers can hold the same lock.",
            hint="Use DatabaseLockStore or RedisLockStore in production.",
            id=ID.format("W001"),
        )
    ]


def _check_database(alias: str, options: Mapping[str, Any]) -> list[CheckMessage]:
    return [*_check_socket_timeout(alias, options), *_check_database_alias(alias, options)]


def _check_socket_timeout(alias: str, options: Mapping[str, Any]) -> list[CheckMessage]:
    try:
        socket_timeout_option(alias, options)
    except ImproperlyConfigured as exc:
        return [
            Error(
                f"{exc}.",
                hint="The longest one store call waits on the network: a duration such as 5, "
                '0.5 or "1500ms"; leave it out for the default 5 s.',
                id=ID.format("E010"),
            )
        ]
    return []


def _check_database_alias(alias: str, options: Mapping[str, Any]) -> list[CheckMessage]:
    where = _where(alias)
    database = DatabaseLockStore.database_option(options)
    if database not in settings.DATABASES:
        known = ", ".join(sorted(settings.DATABASES)) or "none"
        return [
            Error(
                f"{where} OPTIONS DATABASE {database!r} is not in DATABASES.",
                hint=f"Databases configured: {known}.",
                id=ID.format("E005"),
            )
        ]
    engine = str(settings.DATABASES[database].get("ENGINE", ""))
    try:
        # The backend class says its vendor; nothing is instantiated or connected.
        vendor = import_module(f"{engine}.base").DatabaseWrapper.vendor
    except Exception:  # a broken ENGINE is Django's own error to report
        return []
    if vendor not in SUPPORTED_VENDORS:
        return [
            Error(
                f"{where} uses database {database!r} ({engine}), which DatabaseLockStore does "
                "not support.",
                hint=(
                    "Use a PostgreSQL, MariaDB or SQLite database (MySQL has no sequences for "
                    "fences), or RedisLockStore."
                ),
                id=ID.format("E006"),
            )
        ]
    return []


def _missing_redis_packages(options: Mapping[str, Any]) -> list[str]:
    """What RedisLockStore with these OPTIONS needs and is not installed."""
    missing = [m for m in ("redis",) if not installed(m)]
    if options.get("CONNECTION") is not None and not installed("django_redis"):
        missing.append("django_redis")
    return missing


def _check_redis(alias: str, options: Mapping[str, Any]) -> list[CheckMessage]:
    where = _where(alias)
    messages: list[CheckMessage] = []
    missing = _missing_redis_packages(options)
    if missing:
        messages.append(
            Error(
                f"{where} is a RedisLockStore but {' and '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not installed.",
                hint="pip install 'django-keel-lock[redis]'",
                id=ID.format("E007"),
            )
        )
    connection = options.get("CONNECTION")
    if connection is not None:
        messages.extend(_check_redis_connection(where, connection))
    messages.extend(_check_redis_database(where, options))
    messages.extend(_check_socket_timeout(alias, options))
    return messages


def _check_redis_connection(where: str, connection: Any) -> list[CheckMessage]:
    caches = getattr(settings, "CACHES", {})
    if connection not in caches:
        known = ", ".join(sorted(caches)) or "none"
        return [
            Error(
                f"{where} OPTIONS CONNECTION {connection!r} is not a CACHES alias.",
                hint=f"Name a django-redis cache (CACHES has: {known}) or use URL instead.",
                id=ID.format("E008"),
            )
        ]
    cache_backend = str(caches[connection].get("BACKEND", ""))
    if _is_django_redis_cache(cache_backend):
        return []
    return [
        Error(
            f"{where} OPTIONS CONNECTION {connection!r} is a {cache_backend} cache, not a "
            "django-redis one.",
            hint='Point it at a cache with BACKEND "django_redis.cache.RedisCache", or use '
            "URL instead.",
            id=ID.format("E008"),
        )
    ]


@dataclass(frozen=True)
class RedisDatabase:
    """One database of one Redis server, as a URL names it."""

    server: str  # "host:port" (any name of the loopback as "localhost"), or a socket's path
    db: int
    shown: str = field(compare=False)  # the server as the URL writes it

    def __str__(self) -> str:
        return f"database {self.db} of {self.shown}"


#: Django's own Redis cache and django-redis's: clear() is FLUSHDB on both.
REDIS_CACHES = ("django.core.cache.backends.redis.", "django_redis.")
#: Names of the same machine: a URL with one is the same server as a URL with another.
LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})


def _redis_database(url: object) -> RedisDatabase | None:
    """The database `url` names (read as redis-py reads it: ?db= first, then the path, else 0),
    or None for what is not a Redis URL."""
    if not isinstance(url, str):
        return None
    parts = urlsplit(url.strip())
    query = parse_qs(parts.query)
    if parts.scheme == "unix":
        server = shown = parts.path
        path_db = ""
    elif parts.scheme in ("redis", "rediss"):
        try:
            port = parts.port or 6379
        except ValueError:
            return None
        host = (parts.hostname or "localhost").lower()
        server = f"{'localhost' if host in LOOPBACK else host}:{port}"
        shown = f"{parts.hostname or 'localhost'}:{port}"
        path_db = unquote(parts.path).replace("/", "")
    else:
        return None
    for db in (*query.get("db", ()), path_db):
        if db:
            try:
                return RedisDatabase(server, int(db), shown)
            except ValueError:
                return None
    return RedisDatabase(server, 0, shown)


def _cache_database(config: object) -> RedisDatabase | None:
    """The database a Redis cache writes to (and clear() flushes): its LOCATION's first URL,
    as both Redis cache backends take it."""
    if not isinstance(config, Mapping):
        return None
    location = config.get("LOCATION")
    if isinstance(location, str):
        location = re.split("[;,]", location)
    if not isinstance(location, (list, tuple)) or not location:
        return None
    return _redis_database(location[0])


def _connections_only() -> set[object]:
    """The caches that are only a lock store's connection: named by a store's CONNECTION and
    by nothing of Django's, so nothing caches there (and nothing clears them)."""
    stores = conf.raw_stores()
    configs = stores.values() if isinstance(stores, dict) else ()
    options = [store_options(config) for config in configs if is_store_config(config)]
    return {each.get("CONNECTION") for each in options if each is not None} - {
        "default",
        getattr(settings, "SESSION_CACHE_ALIAS", "default"),
        getattr(settings, "CACHE_MIDDLEWARE_ALIAS", "default"),
    }


def _redis_caches() -> dict[str, RedisDatabase]:
    """The database each Redis cache writes to (and its clear() flushes), by alias."""
    caches = getattr(settings, "CACHES", {})
    if not isinstance(caches, Mapping):
        return {}
    found: dict[str, RedisDatabase] = {}
    for alias, config in caches.items():
        if not isinstance(config, Mapping):
            continue
        if not str(config.get("BACKEND", "")).startswith(REDIS_CACHES):
            continue
        database = _cache_database(config)
        if database is not None:
            found[str(alias)] = database
    return found


def _check_redis_database(where: str, options: Mapping[str, Any]) -> list[CheckMessage]:
    """W005: the store's locks are in a database a cache's clear() flushes."""
    caches = getattr(settings, "CACHES", {})
    if options.get("URL") is not None:
        database = _redis_database(options["URL"])
    elif isinstance(caches, Mapping):
        database = _cache_database(caches.get(options.get("CONNECTION")))
    else:
        return []
    if database is None:
        return []
    # The store's own connection, if nothing else uses it, is its to clear; any other cache on
    # its database (another store's connection too: it is a Django cache all the same) is not.
    own = {options.get("CONNECTION")} & _connections_only()
    shared = [
        alias for alias, other in _redis_caches().items() if other == database and alias not in own
    ]
    if not shared:
        return []
    named = ", ".join(f"CACHES[{alias!r}]" for alias in shared)
    return [
        Warning(
            f"{where} keeps its locks in Redis {database}, which {named} uses too: the "
            "cache's clear() (FLUSHDB) deletes every lock, and a holder learns it only when "
            "it releases.",
            hint="Give the lock store a Redis database of its own: a URL with another "
            "database number (redis://host:6379/1), or CONNECTION naming a cache on such a "
            "database that nothing else uses.",
            id=ID.format("W005"),
        )
    ]


def _is_django_redis_cache(path: str) -> bool:
    if path.startswith("django_redis."):
        return True
    try:
        from django_redis.cache import RedisCache

        backend = import_string(path)
    except ImportError:
        return False
    return isinstance(backend, type) and issubclass(backend, RedisCache)


def check_store_tables(
    app_configs: Sequence[Any] | None = None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    """Each database store's table exists, on the databases the command asked to check.

    Warnings, not errors, although every lock on such a store fails: `migrate` runs the
    database checks of the database it migrates before migrating, and an error would stop the
    very command that creates the table.
    """
    if not databases:
        return []
    messages: list[CheckMessage] = []
    for database, aliases in _database_stores().items():
        if database not in databases:
            continue
        named = ", ".join(repr(alias) for alias in aliases)
        stores = f"Lock stores {named} keep" if len(aliases) > 1 else f"Lock store {named} keeps"
        try:
            tables = connections[database].introspection.table_names()
        except Exception as exc:  # unreachable server, missing driver: a check never crashes
            messages.append(
                Warning(
                    f"{stores} locks in database {database!r}, which could not be "
                    f"inspected for the {LOCK_TABLE} table: {type(exc).__name__}: {exc}",
                    hint=f"Check that database {database!r} is reachable with the "
                    "DATABASES settings, then run this check again.",
                    id=ID.format("W004"),
                )
            )
            continue
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
        messages.extend(_check_process_privilege(database, stores))
    return messages


def check_view_keys(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """E012: a `@lock_view` (or LockViewMixin) key template names a <name> that a URL routed
    to the view does not capture: every request there would fail."""
    try:
        patterns = get_resolver().url_patterns
    except Exception:  # a broken URLconf is Django's own URL checks' to report
        return []
    return list(_check_routes(patterns, frozenset(), ""))


def _check_routes(patterns: Any, above: frozenset[str], prefix: str) -> Iterator[CheckMessage]:
    """E012 for each route under `patterns`, whose includes captured the kwargs `above`."""
    for entry in patterns:
        route = prefix + str(entry.pattern)
        captured = above | set(entry.pattern.regex.groupindex)
        if isinstance(entry, URLResolver):
            yield from _check_routes(
                entry.url_patterns, captured | set(entry.default_kwargs), route
            )
        elif isinstance(entry, URLPattern):
            yield from _check_route(entry, captured | set(entry.default_args), route)


def _view_key(callback: Any) -> str | None:
    """The key template a view locks (`@lock_view` on the function, or on a class-based
    view's dispatch through method_decorator, or a LockViewMixin's lock_key)."""
    view_class = getattr(callback, "view_class", None)
    for each in (callback, getattr(view_class, "dispatch", None)):
        key = getattr(each, "lock_view_key", None)
        if isinstance(key, str):
            return key
    if not (isinstance(view_class, type) and issubclass(view_class, LockViewMixin)):
        return None
    # A class that overrides get_lock_key makes its key itself: nothing to compare.
    if view_class.get_lock_key is not LockViewMixin.get_lock_key:
        return None
    key = view_class.lock_key
    return key if isinstance(key, str) else None


def _check_route(entry: URLPattern, kwargs: frozenset[str], route: str) -> list[CheckMessage]:
    template = _view_key(entry.callback)
    if template is None:
        return []
    names = [text for is_name, text in parse_key_template(template) if is_name]
    missing = [name for name in names if name not in kwargs]
    if not missing:
        return []
    view = entry.lookup_str
    known = ", ".join(f"<{name}>" for name in sorted(kwargs)) or "none"
    close = difflib.get_close_matches(missing[0], kwargs, n=1)
    meant = f"<{close[0]}>" if close else "a kwarg the route captures"
    return [
        Error(
            f"{view} locks key {template!r}, but URL {route!r} has no kwarg "
            f"{', '.join(f'<{name}>' for name in missing)} (its kwargs: {known}): every "
            "request there fails.",
            hint=f"Write {meant} in the key template, or capture <{missing[0]}> in the route.",
            id=ID.format("E012"),
        )
    ]


#: A grant of global privileges, as SHOW GRANTS writes it: the privileges, then ON *.*.
GLOBAL_GRANT = re.compile(r"GRANT (?P<privileges>.+?) ON \*\.\* TO ", re.IGNORECASE)


def _has_process(grants: Sequence[str]) -> bool:
    """Whether SHOW GRANTS' lines give the PROCESS privilege (ALL PRIVILEGES includes it)."""
    for grant in grants:
        found = GLOBAL_GRANT.match(grant)
        if found is None:
            continue
        privileges = {each.strip().upper() for each in found["privileges"].split(",")}
        if privileges & {"PROCESS", "ALL PRIVILEGES", "ALL"}:
            return True
    return False


def _check_process_privilege(database: str, stores: str) -> list[CheckMessage]:
    """W008: on MariaDB, the clean-up reads information_schema.PROCESSLIST for the statements
    of other connections in flight, and without PROCESS it sees only its own user's."""
    connection = connections[database]
    if connection.vendor != "mysql":
        return []
    try:
        with connection.cursor() as cursor:
            # Without FOR: the current user's grants and those of its enabled roles.
            cursor.execute("SHOW GRANTS")
            grants = [str(row[0]) for row in cursor.fetchall()]
            cursor.execute("SELECT CURRENT_USER()")
            (user,) = cursor.fetchone()
    except Exception:  # the table check just reached it; a failure now is W004's to report
        return []
    if _has_process(grants):
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


#: What makes a Sentinel master refuse writes once no replica is in sync: both must be above 0.
MIN_REPLICAS = ("min-replicas-to-write", "min-replicas-max-lag")


def check_sentinel_masters(
    app_configs: Sequence[Any] | None = None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    """Each RedisLockStore through Sentinel has a master that refuses writes without a
    replica in sync, asked when the command asks for databases (as the database check)."""
    if not databases:
        return []
    messages: list[CheckMessage] = []
    for alias in _stores_of("redis.RedisLockStore"):
        messages.extend(_check_sentinel_master(alias))
    return messages


def _check_sentinel_master(alias: str) -> list[CheckMessage]:
    """W007 or W009 for the store `alias`, if it goes through Sentinel."""
    from redis import ResponseError

    from .stores.redis import RedisLockStore

    try:
        store = build_store(alias)
    except Exception:  # a broken config is the settings checks' to report
        return []
    if not isinstance(store, RedisLockStore):
        return []
    where = _where(alias)
    try:
        config = store.sentinel_master_config("min-replicas-*")
    except (LockStoreUnavailable, ResponseError) as exc:
        refused = isinstance(exc, ResponseError)
        return [
            Warning(
                f"{where} goes through Sentinel, but its master could not be asked for "
                f"{MIN_REPLICAS[0]}: {type(exc).__name__}: {exc}",
                hint="CONFIG is renamed or not allowed for this user: check the setting on "
                "every server of the group yourself."
                if refused
                else "Check that the sentinels and the master are reachable with the store's "
                "settings, then run this check again.",
                id=ID.format("W009"),
            )
        ]
    finally:
        store.close()
    if config is None:
        return []
    off = [name for name in MIN_REPLICAS if config.get(name, "0") == "0"]
    if not off:
        return []
    settings_now = ", ".join(f"{name} {config.get(name, '0')}" for name in MIN_REPLICAS)
    return [
        Warning(
            f"{where} goes through Sentinel to a master with {settings_now}: after a failover "
            "that leaves the old master running, it grants locks to the clients still "
            "connected to it until Sentinel demotes it (about 10 s), so one lock can have "
            "two holders.",
            hint=f"Set {MIN_REPLICAS[0]} 1 and {MIN_REPLICAS[1]} 1 on every Redis server of "
            "the group (CONFIG SET, and in redis.conf): the old master then refuses at once.",
            id=ID.format("W007"),
        )
    ]


def _stores_of(store: str) -> list[str]:
    """The KEEL_LOCK_STORES aliases whose BACKEND is or subclasses one of our stores
    ("module.Class"). Configs that check_stores reports as broken are left to it."""
    stores = conf.raw_stores()
    if not isinstance(stores, dict):
        return []
    found: list[str] = []
    for alias, config in stores.items():
        if not is_store_config(config):
            continue
        try:
            backend = import_backend(config["BACKEND"])
        except (ImportError, ImproperlyConfigured, NotALockStore):
            continue
        if _is_store(backend, store):
            found.append(str(alias))
    return found


def _database_stores() -> dict[str, list[str]]:
    """Database alias -> the KEEL_LOCK_STORES aliases of the database stores on it. Configs
    that check_stores reports as broken are left to it."""
    stores = conf.raw_stores()
    if not isinstance(stores, dict):
        return {}
    found: dict[str, list[str]] = {}
    for alias, config in stores.items():
        database = _database_of(config)
        if database in connections.settings:
            found.setdefault(database, []).append(str(alias))
    return found


def _database_of(config: object) -> Any:
    """The DATABASES alias of a DatabaseLockStore entry; None for other or broken entries."""
    if not is_store_config(config):
        return None
    options = store_options(config)
    if options is None:
        return None
    try:
        backend = import_backend(config["BACKEND"])
    except (ImportError, ImproperlyConfigured, NotALockStore):
        return None
    if not issubclass(backend, DatabaseLockStore):
        return None
    return DatabaseLockStore.database_option(options)
