"""Settings, read on every access (so override_settings just works), and the store registry."""

from __future__ import annotations

import threading
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.dispatch import receiver
from django.utils.module_loading import import_string

from .durations import to_seconds
from .stores.base import LockStore

DEFAULT_STORES: dict[str, dict[str, Any]] = {
    "default": {"BACKEND": "django_keel_lock.stores.DatabaseLockStore"},
}
DEFAULT_TTL = 30.0


class Settings:
    """`KEEL_LOCK_*` settings with their defaults, looked up each time they are read."""

    @property
    def STORES(self) -> dict[str, dict[str, Any]]:
        value = getattr(settings, "KEEL_LOCK_STORES", None)
        if value is None:
            return DEFAULT_STORES
        if not isinstance(value, dict):
            raise ImproperlyConfigured(
                f"KEEL_LOCK_STORES must be a dict of alias -> store config, "
                f"got {type(value).__name__}"
            )
        return value

    @property
    def DEFAULT_TTL(self) -> float:
        return to_seconds("KEEL_LOCK_DEFAULT_TTL", getattr(settings, "KEEL_LOCK_DEFAULT_TTL", 30))


conf = Settings()

_mutex = threading.Lock()
_built: dict[str, LockStore] = {}
_overrides: dict[str, LockStore] = {}


def build_store(alias: str) -> LockStore:
    """Construct the store configured for `alias` (not cached)."""
    stores = conf.STORES
    if alias not in stores:
        known = ", ".join(repr(a) for a in stores) or "none"
        raise ImproperlyConfigured(
            f"store {alias!r} is not in KEEL_LOCK_STORES (configured aliases: {known})"
        )
    config = stores[alias]
    if not isinstance(config, dict) or "BACKEND" not in config:
        raise ImproperlyConfigured(f"KEEL_LOCK_STORES[{alias!r}] must be a dict with a BACKEND")
    try:
        backend = import_string(config["BACKEND"])
    except ImportError as exc:
        raise ImproperlyConfigured(
            f"KEEL_LOCK_STORES[{alias!r}] BACKEND {config['BACKEND']!r} cannot be imported: {exc}"
        ) from exc
    if not (isinstance(backend, type) and issubclass(backend, LockStore)):
        raise ImproperlyConfigured(
            f"KEEL_LOCK_STORES[{alias!r}] BACKEND {config['BACKEND']!r} is not a LockStore"
        )
    options = config.get("OPTIONS") or {}
    if not isinstance(options, dict):
        raise ImproperlyConfigured(f"KEEL_LOCK_STORES[{alias!r}] OPTIONS must be a dict")
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


def set_lock_store(store: LockStore | None, alias: str = "default") -> None:
    """Use `store` for `alias` (whatever the settings say); None goes back to the settings."""
    if store is not None and not isinstance(store, LockStore):
        raise TypeError(f"store must be a LockStore, got {type(store).__name__}")
    with _mutex:
        if store is None:
            _overrides.pop(alias, None)
        else:
            _overrides[alias] = store


def reset_stores() -> None:
    """Close and forget every store built from settings (set_lock_store overrides stay)."""
    with _mutex:
        built = list(_built.values())
        _built.clear()
    for store in built:
        store.close()


@receiver(setting_changed)
def _on_setting_changed(setting: str, **kwargs: Any) -> None:
    if setting in {"KEEL_LOCK_STORES", "DATABASES", "CACHES"}:
        reset_stores()
