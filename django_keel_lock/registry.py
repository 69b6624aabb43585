"""The per-alias store registry: one store per KEEL_LOCK_STORES alias, built on first use.

A store set with `set_lock_store` wins over the settings until it is cleared. Stores built from
settings are closed and forgotten when a setting they depend on changes (`override_settings`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.dispatch import receiver
from django.utils.module_loading import import_string

from .conf import conf, is_store_config, store_options
from .stores.base import LockStore

_mutex = threading.Lock()
_built: dict[str, LockStore] = {}
_overrides: dict[str, LockStore] = {}
#: Called with no arguments whenever the store of an alias may change (`on_stores_changed`).
_listeners: list[Callable[[], None]] = []


class NotALockStore(TypeError):
    """A BACKEND dotted path that names something other than a LockStore subclass."""


def import_backend(path: str) -> type[LockStore]:
    """The LockStore subclass at dotted `path`.

    Raises ImportError when it cannot be imported (a store whose driver is missing raises
    ImproperlyConfigured saying which), NotALockStore when it is something else.
    """
    backend = import_string(path)
    if not (isinstance(backend, type) and issubclass(backend, LockStore)):
        raise NotALockStore(f"{path!r} is not a LockStore subclass")
    return backend


def configured_stores() -> Iterator[tuple[str, type[LockStore], dict[str, Any]]]:
    """(alias, store class, OPTIONS) of each KEEL_LOCK_STORES entry that can be built, in
    settings order: the broken ones are left to the system checks to report."""
    stores = conf.raw_stores()
    for alias, config in stores.items() if isinstance(stores, dict) else ():
        if not is_store_config(config) or (options := store_options(config)) is None:
            continue
        try:
            backend = import_backend(config["BACKEND"])
        except (ImportError, ImproperlyConfigured, NotALockStore):
            continue
        yield str(alias), backend, options


def build_store(alias: str) -> LockStore:
    """Construct the store configured for `alias` (not cached)."""
    stores = conf.STORES
    if alias not in stores:
        known = ", ".join(repr(a) for a in stores) or "none"
        raise ImproperlyConfigured(
            f"store {alias!r} is not in KEEL_LOCK_STORES (configured aliases: {known})"
        )
    config: object = stores[alias]
    where = f"KEEL_LOCK_STORES[{alias!r}]"
    if not is_store_config(config):
        raise ImproperlyConfigured(f"{where} must be a dict with a BACKEND")
    path = config["BACKEND"]
    try:
        backend = import_backend(path)
    except ImportError as exc:
        raise ImproperlyConfigured(f"{where} BACKEND {path!r} cannot be imported: {exc}") from exc
    except NotALockStore:
        raise ImproperlyConfigured(f"{where} BACKEND {path!r} is not a LockStore") from None
    options = store_options(config)
    if options is None:
        raise ImproperlyConfigured(f"{where} OPTIONS must be a dict")
    return backend(alias=alias, options=options)


def get_lock_store(alias: str = "default") -> LockStore:
    """The store for `alias`: one set with `set_lock_store`, else built once from settings."""
    store = _overrides.get(alias) or _built.get(alias)
    if store is not None:
        return store
    with _mutex:
        store = _overrides.get(alias) or _built.get(alias)
        if store is None:
            store = _built[alias] = build_store(alias)
        return store


def on_stores_changed(listener: Callable[[], None]) -> None:
    """Call `listener()` whenever the store of an alias may change (`set_lock_store`,
    `reset_stores`): whoever keeps stores by alias forgets them then."""
    _listeners.append(listener)


def _changed() -> None:
    for listener in _listeners:
        listener()


def set_lock_store(store: LockStore | None, alias: str = "default") -> None:
    """Use `store` for `alias` (whatever the settings say); None goes back to the settings."""
    if store is not None and not isinstance(store, LockStore):
        raise TypeError(f"store must be a LockStore, got {type(store).__name__}")
    with _mutex:
        if store is None:
            _overrides.pop(alias, None)
        else:
            _overrides[alias] = store
    _changed()


def lock_store_override(alias: str = "default") -> LockStore | None:
    """The store `set_lock_store` put on `alias`, or None when the alias follows the settings:
    what to pass back to `set_lock_store` to restore it."""
    return _overrides.get(alias)


def reset_stores() -> None:
    """Close and forget every store built from settings (set_lock_store overrides stay)."""
    with _mutex:
        built = list(_built.values())
        _built.clear()
    _changed()
    for store in built:
        store.close()


@receiver(setting_changed)
def _on_setting_changed(setting: str, **kwargs: Any) -> None:
    if setting in {"KEEL_LOCK_STORES", "DATABASES", "CACHES"}:
        reset_stores()
