"""What the stores' own system checks share: the id format, how a message names a store, the
check of SOCKET_TIMEOUT (the database and Redis stores both take it), and and how each store
class's `LockStore.check_servers` is run. The catalogue of ids is
django_keel_lock.checks' docstring, where these are registered from."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from django.core.checks import CheckMessage, Error
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from .base import LockStore
from .connections import socket_timeout_option

ID = "django_keel_lock.{}"


def where(alias: str) -> str:
    """How a message names the store `alias`: its entry in the settings."""
    return f"KEEL_LOCK_STORES[{alias!r}]"


def check_socket_timeout(alias: str, options: Mapping[str, Any]) -> list[CheckMessage]:
    """E010: OPTIONS SOCKET_TIMEOUT is not a positive duration."""
    hint = (
        "The longest one store call waits on the network: a duration such as 5, "
        '0.5 or "1500ms"; leave it out for the default 5 s.'
    )
    return option_error(ID.format("E010"), hint, socket_timeout_option, alias, options)


def option_error(
    check_id: str, hint: str, parse: Callable[[str, Mapping[str, Any]], object], *args: Any
) -> list[CheckMessage]:
    """The Error `check_id` (a whole id) saying why `parse(*args)`, a store's reading of one
    of its options, raised ImproperlyConfigured; nothing when it did not."""
    try:
        parse(*args)
    except ImproperlyConfigured as exc:
        return [Error(f"{exc}.", hint=hint, id=check_id)]
    return []


def check_servers(
    stores: Iterable[tuple[str, type[LockStore], Mapping[str, Any]]],
    databases: Sequence[str] | None,
    kind: str = "",
) -> list[CheckMessage]:
    """Each store class's `check_servers` once, with the aliases of `stores` (alias, class,
    OPTIONS) that are it or a subclass keeping its check_servers, in the order `stores` first
    names them; with `kind` (a dotted path), of the stores of that class only. Nothing when no
    database is asked for (Django's convention for checks tagged `database`)."""
    if not databases:
        return []
    try:
        only = import_string(kind) if kind else object
    except (ImportError, ImproperlyConfigured):  # RedisLockStore without redis-py: none is set
        return []
    found: dict[type[LockStore], tuple[type[LockStore], dict[str, Mapping[str, Any]]]] = {}
    for alias, backend, options in stores:
        if issubclass(backend, only):
            owner = next(each for each in backend.__mro__ if "check_servers" in vars(each))
            found.setdefault(owner, (backend, {}))[1][alias] = options
    messages: list[CheckMessage] = []
    for backend, each in found.values():
        messages.extend(backend.check_servers(each, databases=databases))
    return messages
