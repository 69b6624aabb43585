"""The etcd store's system checks (ids in django_keel_lock.checks' docstring), from the
settings alone: E013 (ENDPOINTS, KEY_PREFIX, the TLS files, USER without PASSWORD) and E010
(SOCKET_TIMEOUT)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from django.core.checks import CheckMessage, Error
from django.core.exceptions import ImproperlyConfigured

from ..checks import ID, check_socket_timeout, where
from .client import parse_endpoints

HINT = (
    "OPTIONS ENDPOINTS lists the client URLs of the etcd members, e.g. "
    "['http://10.0.0.1:2379', 'http://10.0.0.2:2379', 'http://10.0.0.3:2379']."
)


def check_config(alias: str, options: Mapping[str, Any]) -> list[CheckMessage]:
    """E013 for each mistake in the etcd store `alias`'s OPTIONS; E010 for SOCKET_TIMEOUT."""
    problems = [*_endpoint_problems(alias, options), *_other_problems(alias, options)]
    messages: list[CheckMessage] = [
        Error(f"{problem}.", hint=hint, id=ID.format("E013")) for problem, hint in problems
    ]
    messages.extend(check_socket_timeout(alias, options))
    return messages


def _endpoint_problems(alias: str, options: Mapping[str, Any]) -> list[tuple[str, str]]:
    if "ENDPOINTS" not in options:
        return [(f"{where(alias)} is an EtcdLockStore without OPTIONS ENDPOINTS", HINT)]
    try:
        parse_endpoints(alias, options["ENDPOINTS"])
    except ImproperlyConfigured as exc:
        return [(str(exc), HINT)]
    return []


def _other_problems(alias: str, options: Mapping[str, Any]) -> list[tuple[str, str]]:
    named = f"{where(alias)} OPTIONS"
    problems = []
    prefix = options.get("KEY_PREFIX", "")
    if not isinstance(prefix, str):
        problems.append((f"{named} KEY_PREFIX must be a str, got {prefix!r}", 'e.g. "keel-lock/".'))
    for name in ("CA_FILE", "CERT_FILE", "KEY_FILE"):
        path = options.get(name)
        if path is not None and not (isinstance(path, str) and os.path.isfile(path)):
            problems.append(
                (f"{named} {name} {path!r} is not a file", "Name a PEM file this process reads.")
            )
    problems.extend(_cleartext_problems(named, options))
    if options.get("KEY_FILE") is not None and options.get("CERT_FILE") is None:
        problems.append((f"{named} has KEY_FILE without CERT_FILE", "Set both, or neither."))
    if (options.get("USER") is None) != (options.get("PASSWORD") is None):
        problems.append(
            (f"{named} has one of USER and PASSWORD without the other", "Set both, or neither.")
        )
    return problems


def _cleartext_problems(named: str, options: Mapping[str, Any]) -> list[tuple[str, str]]:
    """TLS files with an http:// endpoint: its calls (and PASSWORD) would go unencrypted and
    unverified, silently, while the settings say TLS."""
    tls = [name for name in ("CA_FILE", "CERT_FILE", "KEY_FILE") if options.get(name)]
    endpoints = options.get("ENDPOINTS")
    if not tls or isinstance(endpoints, str) or not isinstance(endpoints, list | tuple):
        return []
    plain = [url for url in endpoints if isinstance(url, str) and url.strip().startswith("http:")]
    if not plain:
        return []
    return [
        (
            f"{named} has {' and '.join(tls)} but ENDPOINTS {plain!r} use http://, "
            "which sends calls unencrypted and verifies no certificate",
            "Write the members' URLs with https://, or leave the TLS files out.",
        )
    ]
