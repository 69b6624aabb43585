"""The Redis store's system checks (ids in django_keel_lock.checks' docstring).

From the settings: E007 (a package missing), E008 (CONNECTION is no django-redis cache), W005
(a cache's clear() would flush the locks), E010 (SOCKET_TIMEOUT) and E014 (MIN_REPLICAS).
These need no redis-py: with it missing, `django_keel_lock.checks` asks `check_unimportable`.
Tagged `database`: W007 and W009, the settings of a Sentinel master, asked each within the
store's SOCKET_TIMEOUT or 2 s, whichever is shorter.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote, urlsplit

from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from ...conf import conf, is_store_config, store_options
from ...exceptions import LockStoreUnavailable
from ..checks import ID, check_socket_timeout, option_error, where

if TYPE_CHECKING:
    from .store import RedisLockStore

#: Where RedisLockStore is found: named without importing it, which fails without redis-py.
BACKENDS = frozenset(
    {"django_keel_lock.stores.RedisLockStore", "django_keel_lock.stores.redis.RedisLockStore"}
)
#: Django's own Redis cache and django-redis's: clear() is FLUSHDB on both.
REDIS_CACHES = ("django.core.cache.backends.redis.", "django_redis.")
#: Names of the same machine: a URL with one is the same server as a URL with another.
LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})
#: What makes a Sentinel master refuse writes once no replica is in sync: both must be above 0.
MIN_REPLICAS = ("min-replicas-to-write", "min-replicas-max-lag")


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_unimportable(
    alias: str, path: str, options: Mapping[str, Any], cannot: CheckMessage
) -> list[CheckMessage] | None:
    """For a BACKEND that cannot be imported (`cannot`: the E002 saying so): None when `path`
    is not RedisLockStore; else its checks, with E002 only when no package is missing (E007
    then says what to install)."""
    if path not in BACKENDS:
        return None
    messages = check_config(alias, options)
    return messages if _missing_packages(options) else [*messages, cannot]


def _missing_packages(options: Mapping[str, Any]) -> list[str]:
    """What RedisLockStore with these OPTIONS needs and is not installed."""
    missing = [m for m in ("redis",) if not installed(m)]
    if options.get("CONNECTION") is not None and not installed("django_redis"):
        missing.append("django_redis")
    return missing


#: KEY_PREFIX when OPTIONS do not say.
DEFAULT_PREFIX = "keel-lock:"


def server_options(alias: str, options: Mapping[str, Any]) -> tuple[str | None, str | None, str]:
    """(CONNECTION, URL, KEY_PREFIX ending in ":" unless empty) of a store's OPTIONS:
    exactly one of the first two; ImproperlyConfigured saying what is wrong otherwise."""
    connection, url = options.get("CONNECTION"), options.get("URL")
    named = f"{where(alias)} OPTIONS"
    if (connection is None) == (url is None):
        raise ImproperlyConfigured(
            f"{named} needs exactly one of CONNECTION (a django-redis CACHES alias) or URL "
            "(redis://host:port/db)"
        )
    if connection is not None and not isinstance(connection, str):
        raise ImproperlyConfigured(f"{named} CONNECTION must be a CACHES alias (str)")
    if url is not None and not isinstance(url, str):
        raise ImproperlyConfigured(f"{named} URL must be a str")
    if options.get("CLUSTER") and url is None:
        raise ImproperlyConfigured(f"{named} CLUSTER needs URL (a node of the cluster)")
    prefix = options.get("KEY_PREFIX", DEFAULT_PREFIX)
    if not isinstance(prefix, str) or "{" in prefix or "}" in prefix:
        # The prefix sits outside the hash tag; a brace in it would move the tag.
        raise ImproperlyConfigured(
            f"{named} KEY_PREFIX must be a str without braces, got {prefix!r}"
        )
    # Joined to the rest of the key by ":", as Django's cache joins its KEY_PREFIX: "locks"
    # and "locks:" name the same keys (locks:{invoice:42}).
    if prefix and not prefix.endswith(":"):
        prefix += ":"
    return connection, url, prefix


def min_replicas_option(alias: str, options: Mapping[str, Any]) -> int:
    """OPTIONS MIN_REPLICAS: how many replicas must acknowledge each acquire and extend
    (WAIT) before it counts; 0 (the default) waits for none. ImproperlyConfigured saying what
    is wrong otherwise."""
    value = options.get("MIN_REPLICAS", 0)
    named = f"{where(alias)} OPTIONS MIN_REPLICAS"
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ImproperlyConfigured(f"{named} must be a whole number >= 0, got {value!r}")
    if value and options.get("CLUSTER"):
        raise ImproperlyConfigured(
            f"{named} is {value} with CLUSTER: WAIT is not sent through a cluster's "
            "pipelines, so the store cannot ask a shard's replicas"
        )
    return value


def _check_min_replicas_option(alias: str, options: Mapping[str, Any]) -> list[CheckMessage]:
    """E014: MIN_REPLICAS is not a whole number >= 0, or is set with CLUSTER."""
    hint = (
        "The number of replicas that must acknowledge a lock before acquire returns it "
        "(Redis WAIT), e.g. 1; leave it out (0) to wait for none."
    )
    return option_error(ID.format("E014"), hint, min_replicas_option, alias, options)


def check_config(alias: str, options: Mapping[str, Any]) -> list[CheckMessage]:
    """E007, E008, W005, E010, E014 for the Redis store `alias`."""
    messages: list[CheckMessage] = []
    missing = _missing_packages(options)
    if missing:
        messages.append(
            Error(
                f"{where(alias)} is a RedisLockStore but {' and '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not installed.",
                hint="pip install 'django-keel-lock[redis]'",
                id=ID.format("E007"),
            )
        )
    connection = options.get("CONNECTION")
    if connection is not None:
        messages.extend(_check_connection(where(alias), connection))
    messages.extend(_check_database(where(alias), options))
    messages.extend(check_socket_timeout(alias, options))
    messages.extend(_check_min_replicas_option(alias, options))
    return messages


def _check_connection(where: str, connection: Any) -> list[CheckMessage]:
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


def _is_django_redis_cache(path: str) -> bool:
    if path.startswith("django_redis."):
        return True
    try:
        from django_redis.cache import RedisCache

        backend = import_string(path)
    except ImportError:
        return False
    return isinstance(backend, type) and issubclass(backend, RedisCache)


@dataclass(frozen=True)
class RedisDatabase:
    """One database of one Redis server, as a URL names it."""

    server: str  # "host:port" (any name of the loopback as "localhost"), or a socket's path
    db: int
    shown: str = field(compare=False)  # the server as the URL writes it

    def __str__(self) -> str:
        return f"database {self.db} of {self.shown}"


def redis_database(url: object) -> RedisDatabase | None:
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
    return redis_database(location[0])


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


def _check_database(where: str, options: Mapping[str, Any]) -> list[CheckMessage]:
    """W005: the store's locks are in a database a cache's clear() flushes."""
    caches = getattr(settings, "CACHES", {})
    if options.get("URL") is not None:
        database = redis_database(options["URL"])
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


def check_sentinel_master(
    alias: str, options: Mapping[str, Any], kind: type[RedisLockStore]
) -> list[CheckMessage]:
    """W007 or W009 for the store `alias` (a `kind`), if it goes through Sentinel."""
    from redis import ResponseError

    try:  # the store as the registry builds it, without the registry (which imports stores)
        store = import_string(conf.STORES[alias]["BACKEND"])(alias=alias, options=options)
    except Exception:  # a broken config is the settings checks' to report
        return []
    if not isinstance(store, kind):
        return []
    try:
        config = store.sentinel_master_config("min-replicas-*")
    except (LockStoreUnavailable, ResponseError) as exc:
        refused = isinstance(exc, ResponseError)
        return [
            Warning(
                f"{where(alias)} goes through Sentinel, but its master could not be asked for "
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
    return [] if config is None else _check_min_replicas(alias, config)


def _check_min_replicas(alias: str, config: Mapping[str, str]) -> list[CheckMessage]:
    if all(config.get(name, "0") != "0" for name in MIN_REPLICAS):
        return []
    settings_now = ", ".join(f"{name} {config.get(name, '0')}" for name in MIN_REPLICAS)
    return [
        Warning(
            f"{where(alias)} goes through Sentinel to a master with {settings_now}: after a "
            "failover that leaves the old master running, it grants locks to the clients still "
            "connected to it until Sentinel demotes it (about 10 s), so one lock can have "
            "two holders.",
            hint=f"Set {MIN_REPLICAS[0]} 1 and {MIN_REPLICAS[1]} 1 on every Redis server of "
            "the group (CONFIG SET, and in redis.conf): the old master then refuses at once.",
            id=ID.format("W007"),
        )
    ]
