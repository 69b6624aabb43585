"""The `KEEL_LOCK_*` settings, read on every access so `override_settings` just works.

The defaults are defined here once; the system checks (checks.py) read the same values. What a
valid `KEEL_LOCK_STORES` entry is is decided here too, for the registry that builds stores, the
checks that report on them and the stores that check their own OPTIONS.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeGuard

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from .durations import to_seconds

if TYPE_CHECKING:
    from .stores.base import LockStore

#: KEEL_LOCK_STORES when it is unset (or None): a DatabaseLockStore on the "default" database.
DEFAULT_STORES: dict[str, dict[str, Any]] = {
    "default": {"BACKEND": "django_keel_lock.stores.DatabaseLockStore"},
}
#: KEEL_LOCK_DEFAULT_TTL when it is unset: the ttl of a lock that names none.
DEFAULT_TTL = 30.0
#: Every setting django-keel-lock reads; check W010 names any other KEEL_LOCK* setting.
SETTING_NAMES = (
    "KEEL_LOCK_STORES",
    "KEEL_LOCK_DEFAULT_TTL",
    "KEEL_LOCK_METRICS",
    # Read by idempotency.IdempotencyMiddleware, where its options are checked.
    "KEEL_LOCK_IDEMPOTENT_PATHS",
)
#: What KEEL_LOCK_METRICS may name, and the module each needs (from the extra of its name:
#: django-keel-lock[prometheus] installs prometheus_client, [otel] opentelemetry-api).
METRIC_BACKENDS: dict[str, str] = {
    "prometheus": "prometheus_client",
    "otel": "opentelemetry.trace",
}


class Settings:
    """`KEEL_LOCK_*` settings with their defaults, looked up each time they are read."""

    @property
    def STORES(self) -> dict[str, dict[str, Any]]:
        value = self.raw_stores()
        if not isinstance(value, dict):
            raise ImproperlyConfigured(
                f"KEEL_LOCK_STORES must be a dict of alias -> store config, "
                f"got {type(value).__name__}"
            )
        return value

    @property
    def DEFAULT_TTL(self) -> float:
        return to_seconds("KEEL_LOCK_DEFAULT_TTL", self.raw_default_ttl())

    @property
    def METRICS(self) -> tuple[str, ...]:
        """KEEL_LOCK_METRICS as the backends it names, () when off (unset, None, "" or [])."""
        value = self.raw_metrics()
        names = (value,) if isinstance(value, str) else value
        if not value:
            return ()
        if not isinstance(names, (list, tuple)) or not all(
            name in METRIC_BACKENDS for name in names
        ):
            raise ImproperlyConfigured(
                f'KEEL_LOCK_METRICS must be "prometheus", "otel", a list of them or None, '
                f"got {value!r}"
            )
        return tuple(dict.fromkeys(names))

    @staticmethod
    def raw_metrics() -> object:
        """KEEL_LOCK_METRICS as set, not validated (the system checks report what is wrong)."""
        return getattr(settings, "KEEL_LOCK_METRICS", None)

    @staticmethod
    def raw_stores() -> object:
        """KEEL_LOCK_STORES as set, not validated (the system checks report what is wrong)."""
        value = getattr(settings, "KEEL_LOCK_STORES", None)
        return DEFAULT_STORES if value is None else value

    @staticmethod
    def raw_default_ttl() -> object:
        """KEEL_LOCK_DEFAULT_TTL as set, not validated (None is a mistake, not the default)."""
        return getattr(settings, "KEEL_LOCK_DEFAULT_TTL", DEFAULT_TTL)


conf = Settings()


def is_store_config(config: object) -> TypeGuard[dict[str, Any]]:
    """Whether a KEEL_LOCK_STORES entry has the shape of one: a dict with a BACKEND dotted path."""
    return isinstance(config, dict) and isinstance(config.get("BACKEND"), str)


def store_options(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """An entry's OPTIONS ({} when it has none), or None when they are not a dict."""
    options = config.get("OPTIONS") or {}
    return options if isinstance(options, dict) else None


class UnknownStoreOptions(ImproperlyConfigured):
    """A store's OPTIONS name options the store does not know."""

    def __init__(self, alias: str, store: type[LockStore], names: list[str]) -> None:
        self.names = names
        self.known = ", ".join(sorted(store.option_names)) or "none"
        super().__init__(
            f"KEEL_LOCK_STORES[{alias!r}] OPTIONS has unknown option(s) {', '.join(names)} "
            f"for {store.__name__} (known: {self.known})"
        )


def validate_store_options(alias: str, store: type[LockStore], options: Mapping[str, Any]) -> None:
    """Raise UnknownStoreOptions when `options` name any that `store.option_names` lacks."""
    names = sorted(str(name) for name in set(options) - store.option_names)
    if names:
        raise UnknownStoreOptions(alias, store, names)
