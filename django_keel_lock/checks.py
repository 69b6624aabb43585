"""System checks for the django-keel-lock settings.

The settings checks read settings only: they never connect. Those every KEEL_LOCK_STORES entry
gets are here; then each store class checks its own OPTIONS (`LockStore.check_config`: the
memory store's in stores/memory.py, the database and Redis stores' in their packages' `checks`
modules). The server checks (`LockStore.check_servers`, once per store class for all its
aliases) are tagged `database`: as Django's are, they run only when a command asks for databases
(`check --database locks`, and `migrate`, which checks the database it migrates). The view keys
check (E012) walks the URLconf, with Django's URL checks. All are registered in
`KeelLockConfig.ready()`.

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
  django_keel_lock.E010  A DatabaseLockStore's, RedisLockStore's or EtcdLockStore's OPTIONS
                         SOCKET_TIMEOUT is not a positive duration.
  django_keel_lock.E011  KEEL_LOCK_METRICS is not "prometheus", "otel", a list of them or None.
  django_keel_lock.E012  A @lock_view (or LockViewMixin) key template names a <name> that a URL
                         routed to the view does not capture: every request there fails
                         (a URL check: `check --tag urls`).
  django_keel_lock.E013  EtcdLockStore OPTIONS are wrong: ENDPOINTS missing, empty or with a
                         URL that is not http(s)://host:port, KEY_PREFIX not a str, a TLS
                         file missing, KEY_FILE without CERT_FILE, USER without PASSWORD.
  django_keel_lock.E014  RedisLockStore OPTIONS MIN_REPLICAS is not a whole number >= 0, or is
                         set with CLUSTER.

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
  django_keel_lock.W012  A DatabaseLockStore on PostgreSQL behind a transaction pooler (declared
                         in OPTIONS TRANSACTION_POOLER, or found: the server sees another client
                         address than ours) with no OPTIONS LISTEN_DATABASE: its waiters poll.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from importlib import import_module
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning
from django.core.exceptions import ImproperlyConfigured
from django.urls import URLPattern, URLResolver, get_resolver

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
from .registry import NotALockStore, configured_stores, import_backend
from .stores.base import LockStore
from .stores.checks import ID, check_servers, where
from .views import LockViewMixin, parse_key_template

#: Modules with the checks of one of our stores whose class cannot be imported without its
#: driver: `check_unimportable(alias, path, options, cannot)` -> None for another BACKEND,
#: else what to report in place of `cannot` (E002).
UNIMPORTABLE_CHECKS = ("django_keel_lock.stores.redis.checks",)


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


def _check_alias(alias: str, config: object) -> list[CheckMessage]:
    """The checks every entry gets, then those of the store class its BACKEND is."""
    if not is_store_config(config):
        return [
            Error(
                f"{where(alias)} must be a dict with a BACKEND (a dotted path), "
                f"got {config!r:.80}.",
                hint='e.g. {"BACKEND": "django_keel_lock.stores.DatabaseLockStore"}',
                id=ID.format("E001"),
            )
        ]
    messages: list[CheckMessage] = []
    options = store_options(config)
    if options is None:
        messages.append(
            Error(
                f"{where(alias)} OPTIONS must be a dict, got {type(config['OPTIONS']).__name__}.",
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
            Error(
                f"{where(alias)} BACKEND {path!r} is not a LockStore subclass.",
                id=ID.format("E002"),
            ),
        ]
    messages.extend(_check_option_names(alias, backend, options))
    messages.extend(backend.check_config(alias, options))
    return messages


def _check_unimportable(
    alias: str, path: str, options: Mapping[str, Any], exc: Exception
) -> list[CheckMessage]:
    """E002 for a BACKEND that cannot be imported, or what the checks of one of our stores
    that needs a driver report in its place (UNIMPORTABLE_CHECKS)."""
    cannot = Error(
        f"{where(alias)} BACKEND {path!r} cannot be imported: {exc}",
        hint="Use django_keel_lock.stores.DatabaseLockStore, RedisLockStore, "
        "MemoryLockStore or your own LockStore subclass.",
        id=ID.format("E002"),
    )
    for module in UNIMPORTABLE_CHECKS:
        found = import_module(module).check_unimportable(alias, path, options, cannot)
        if found is not None:
            return list(found)
    return [cannot]


def _check_option_names(
    alias: str, backend: type[LockStore], options: Mapping[str, Any]
) -> list[CheckMessage]:
    try:
        validate_store_options(alias, backend, options)
    except UnknownStoreOptions as exc:
        return [
            Error(
                f"{where(alias)} OPTIONS has unknown option(s) {', '.join(exc.names)} for "
                f"{backend.__name__}.",
                hint=f"Known options: {exc.known}.",
                id=ID.format("E004"),
            )
        ]
    return []


def check_store_servers(
    app_configs: Sequence[Any] | None = None,
    databases: Sequence[str] | None = None,
    *,
    kind: str = "",
    **kwargs: Any,
) -> list[CheckMessage]:
    """The server checks of the configured stores (`LockStore.check_servers`), when the
    command asks for databases; with `kind` (a dotted path), of the stores of that class only."""
    return check_servers(configured_stores(), databases, kind)


#: The database stores' server checks alone (W003, W004, W006, W008), and the Redis stores'
#: (W007, W009), by the names they had before the stores carried their checks.
check_store_tables = partial(check_store_servers, kind="django_keel_lock.stores.DatabaseLockStore")
check_sentinel_masters = partial(check_store_servers, kind="django_keel_lock.stores.RedisLockStore")


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


def _view_key(callback: Any) -> str | list[str] | tuple[str, ...] | None:
    """The key template a view locks (`@lock_view` on the function, or on a class-based
    view's dispatch through method_decorator, or a LockViewMixin's lock_key)."""
    view_class = getattr(callback, "view_class", None)
    for each in (callback, getattr(view_class, "dispatch", None)):
        key = getattr(each, "lock_view_key", None)
        if isinstance(key, str | list | tuple):
            return key
    if not (isinstance(view_class, type) and issubclass(view_class, LockViewMixin)):
        return None
    # A class that overrides get_lock_key makes its key itself: nothing to compare.
    if view_class.get_lock_key is not LockViewMixin.get_lock_key:
        return None
    key = view_class.lock_key
    return key if isinstance(key, str | list | tuple) else None


def _check_route(entry: URLPattern, kwargs: frozenset[str], route: str) -> list[CheckMessage]:
    template = _view_key(entry.callback)
    if template is None:
        return []
    templates = [template] if isinstance(template, str) else template
    names = [text for each in templates for is_name, text in parse_key_template(each) if is_name]
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
