"""System checks for the django-keel-lock settings.

The settings checks read settings only: they never connect. The database check (W003, W004)
follows Django's convention for checks tagged `database`: it runs only for the databases a
command asks for (`check --database locks`, and `migrate`, which checks the database it
migrates), and it looks at the schema only, taking no lock.

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

Warnings
  django_keel_lock.W001  MemoryLockStore is the "default" store while DEBUG is False: it does not
                         coordinate processes, so two workers can hold the same lock.
  django_keel_lock.W002  KEEL_LOCK_STORES has no "default" alias: lock() without store= fails.
  django_keel_lock.W003  A DatabaseLockStore's database has no lock table (not migrated there):
                         every lock on that store fails with LockStoreUnavailable.
  django_keel_lock.W004  A DatabaseLockStore's database could not be inspected for W003
                         (unreachable, or a missing driver).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from importlib import import_module
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.utils.module_loading import import_string

from .durations import to_seconds
from .stores.base import LockStore
from .stores.database.dialects import DIALECTS

ID = "django_keel_lock.{}"
MEMORY_BACKENDS = {
    "django_keel_lock.stores.MemoryLockStore",
    "django_keel_lock.stores.memory.MemoryLockStore",
}
DATABASE_BACKENDS = {
    "django_keel_lock.stores.DatabaseLockStore",
    "django_keel_lock.stores.database.DatabaseLockStore",
}
REDIS_BACKENDS = {
    "django_keel_lock.stores.RedisLockStore",
    "django_keel_lock.stores.redis.RedisLockStore",
}
SUPPORTED_VENDORS = frozenset(DIALECTS)  # the database store supports what it has dialects for
LOCK_TABLE = "django_keel_lock_lock"  # models.Lock's db_table (models are not imported here)


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _is(backend: type[LockStore] | None, path: str, known_paths: set[str], name: str) -> bool:
    """Whether `path`/`backend` is one of our stores (or a subclass of it), without importing
    a store module that may need a driver."""
    if path in known_paths:
        return True
    return backend is not None and any(cls.__name__ == name for cls in backend.__mro__)


@register()
def check_stores(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """Every mistake in KEEL_LOCK_STORES / KEEL_LOCK_DEFAULT_TTL that can be seen offline."""
    messages: list[CheckMessage] = []
    messages.extend(_check_default_ttl())
    stores = _stores_setting()
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


def _stores_setting() -> object:
    stores = getattr(settings, "KEEL_LOCK_STORES", None)
    if stores is None:
        # The built-in default: DatabaseLockStore on the "default" database.
        return {"default": {"BACKEND": "django_keel_lock.stores.DatabaseLockStore"}}
    return stores


def _check_default_ttl() -> list[CheckMessage]:
    value = getattr(settings, "KEEL_LOCK_DEFAULT_TTL", 30)
    try:
        to_seconds("KEEL_LOCK_DEFAULT_TTL", value)
    except (TypeError, ValueError) as exc:
        return [
            Error(
                f"{exc}.",
                hint='Use seconds (30), a timedelta or a duration string ("30s", "5m").',
                id=ID.format("E009"),
            )
        ]
    return []


def _check_alias(alias: str, config: object) -> list[CheckMessage]:
    where = f"KEEL_LOCK_STORES[{alias!r}]"
    if not isinstance(config, dict) or not isinstance(config.get("BACKEND"), str):
        return [
            Error(
                f"{where} must be a dict with a BACKEND (a dotted path), got {config!r:.80}.",
                hint='e.g. {"BACKEND": "django_keel_lock.stores.DatabaseLockStore"}',
                id=ID.format("E001"),
            )
        ]
    path: str = config["BACKEND"]
    options = config.get("OPTIONS") or {}
    messages: list[CheckMessage] = []
    if not isinstance(options, dict):
        messages.append(
            Error(
                f"{where} OPTIONS must be a dict, got {type(options).__name__}.",
                id=ID.format("E003"),
            )
        )
        options = {}

    redis_path = path in REDIS_BACKENDS
    if redis_path:
        messages.extend(_check_redis(where, options))
    backend: type[LockStore] | None = None
    try:
        imported = import_string(path)
    except (ImportError, ImproperlyConfigured) as exc:  # a store missing its driver says so
        missing_driver = redis_path and any(m.id == ID.format("E007") for m in messages)
        if not missing_driver:
            messages.append(
                Error(
                    f"{where} BACKEND {path!r} cannot be imported: {exc}",
                    hint="Use django_keel_lock.stores.DatabaseLockStore, RedisLockStore, "
                    "MemoryLockStore or your own LockStore subclass.",
                    id=ID.format("E002"),
                )
            )
        return messages
    if not (isinstance(imported, type) and issubclass(imported, LockStore)):
        messages.append(
            Error(
                f"{where} BACKEND {path!r} is not a LockStore subclass.",
                id=ID.format("E002"),
            )
        )
        return messages
    backend = imported

    unknown = sorted(str(name) for name in set(options) - backend.option_names)
    if unknown:
        known = ", ".join(sorted(backend.option_names)) or "none"
        messages.append(
            Error(
                f"{where} OPTIONS has unknown option(s) {', '.join(unknown)} for "
                f"{backend.__name__}.",
                hint=f"Known options: {known}.",
                id=ID.format("E004"),
            )
        )
    if not redis_path and _is(backend, path, REDIS_BACKENDS, "RedisLockStore"):
        messages.extend(_check_redis(where, options))
    if _is(backend, path, DATABASE_BACKENDS, "DatabaseLockStore"):
        messages.extend(_check_database(where, options))
    if (
        alias == "default"
        and not settings.DEBUG
        and _is(backend, path, MEMORY_BACKENDS, "MemoryLockStore")
    ):
        messages.append(
            Warning(
                'MemoryLockStore is the "default" lock store while DEBUG is False: it only '
                "coordinates threads of one process, so two workers can hold the same lock.",
                hint="Use DatabaseLockStore or RedisLockStore in production.",
                id=ID.format("W001"),
            )
        )
    return messages


def _check_database(where: str, options: dict[str, Any]) -> list[CheckMessage]:
    database = options.get("DATABASE", "default")
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


def _check_redis(where: str, options: dict[str, Any]) -> list[CheckMessage]:
    messages: list[CheckMessage] = []
    connection = options.get("CONNECTION")
    missing = [m for m in ("redis",) if not installed(m)]
    if connection is not None and not installed("django_redis"):
        missing.append("django_redis")
    if missing:
        messages.append(
            Error(
                f"{where} is a RedisLockStore but {' and '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not installed.",
                hint="pip install 'django-keel-lock[redis]'",
                id=ID.format("E007"),
            )
        )
    if connection is None:
        return messages
    caches = getattr(settings, "CACHES", {})
    if connection not in caches:
        known = ", ".join(sorted(caches)) or "none"
        messages.append(
            Error(
                f"{where} OPTIONS CONNECTION {connection!r} is not a CACHES alias.",
                hint=f"Name a django-redis cache (CACHES has: {known}) or use URL instead.",
                id=ID.format("E008"),
            )
        )
        return messages
    cache_backend = str(caches[connection].get("BACKEND", ""))
    if not _is_django_redis_cache(cache_backend):
        messages.append(
            Error(
                f"{where} OPTIONS CONNECTION {connection!r} is a {cache_backend} cache, not a "
                "django-redis one.",
                hint='Point it at a cache with BACKEND "django_redis.cache.RedisCache", or use '
                "URL instead.",
                id=ID.format("E008"),
            )
        )
    return messages


def _is_django_redis_cache(path: str) -> bool:
    if path.startswith("django_redis."):
        return True
    try:
        from django_redis.cache import RedisCache

        backend = import_string(path)
    except ImportError:
        return False
    return isinstance(backend, type) and issubclass(backend, RedisCache)


@register(Tags.database)
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
        if LOCK_TABLE not in tables:
            messages.append(
                Warning(
                    f"{stores} locks in table {LOCK_TABLE} of database {database!r}, "
                    "which does not have that table: every lock taken there fails with "
                    "LockStoreUnavailable.",
                    hint=f"Run: python manage.py migrate django_keel_lock --database {database}",
                    id=ID.format("W003"),
                )
            )
    return messages


def _database_stores() -> dict[str, list[str]]:
    """Database alias -> the KEEL_LOCK_STORES aliases of the database stores on it. Configs
    that check_stores reports as broken are left to it."""
    stores = _stores_setting()
    if not isinstance(stores, dict):
        return {}
    found: dict[str, list[str]] = {}
    for alias, config in stores.items():
        if not isinstance(config, dict) or not isinstance(config.get("BACKEND"), str):
            continue
        path: str = config["BACKEND"]
        options = config.get("OPTIONS") or {}
        if not isinstance(options, dict):
            continue
        backend: type[LockStore] | None = None
        if path not in DATABASE_BACKENDS:
            try:
                imported = import_string(path)
            except (ImportError, ImproperlyConfigured):
                continue
            if not (isinstance(imported, type) and issubclass(imported, LockStore)):
                continue
            backend = imported
        if not _is(backend, path, DATABASE_BACKENDS, "DatabaseLockStore"):
            continue
        database = options.get("DATABASE", "default")
        if database in connections.settings:
            found.setdefault(database, []).append(str(alias))
    return found
