"""Bad input gets a clear error naming the argument; odd-but-valid input round-trips."""

from __future__ import annotations

import functools
import math
import os
from datetime import timedelta

import pytest
from django.core import signing
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from django_keel_lock import (
    InvalidLockToken,
    Lock,
    lock,
    lock_view,
    locked,
    restore_lock,
    semaphore,
)
from django_keel_lock.durations import to_seconds
from django_keel_lock.options import LockSpec
from django_keel_lock.testing import memory_lock_store
from django_keel_lock.tokens import TOKEN_SALT

from .conftest import ALL_STORES, store_params
from .support.forked import in_forked_child

quick = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("500ms", 0.5),
        ("30s", 30),
        ("5m", 300),
        ("1h", 3600),
        ("1h30m", 5400),
        (" 2 m ", 120),
        ("1.5s", 1.5),
        ("2", 2),
        ("1d", 86400),
        (timedelta(minutes=2), 120),
        (7, 7.0),
        (0.25, 0.25),
    ],
)
def test_durations_parse(text: object, seconds: float) -> None:
    assert to_seconds("ttl", text) == seconds


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (0, ValueError, "ttl must be > 0 seconds, got 0"),
        (-1, ValueError, "ttl must be > 0 seconds, got -1"),
        (math.nan, ValueError, "ttl must be a finite number"),
        (math.inf, ValueError, "ttl must be a finite number"),
        ("", ValueError, "ttl must not be an empty string"),
        ("5 minutes", ValueError, "ttl could not be parsed"),
        ("5x", ValueError, "ttl could not be parsed"),
        ("m5", ValueError, "ttl could not be parsed"),
        ("-5s", ValueError, "ttl could not be parsed"),
        (True, TypeError, "ttl must be seconds"),
        ([5], TypeError, "ttl must be seconds"),
        (timedelta(seconds=-1), ValueError, "ttl must be > 0"),
        (10**9, ValueError, "ttl must be at most 3.1536e\\+07 seconds"),
        ("400d", ValueError, "ttl must be at most"),
        (10**400, ValueError, "ttl must be a finite number"),
    ],
)
def test_bad_ttl_names_the_argument(value: object, error: type[Exception], message: str) -> None:
    with memory_lock_store(), pytest.raises(error, match=message.replace("(", r"\(")):
        lock("k", ttl=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("argument", ["timeout", "retry_delay"])
@pytest.mark.parametrize(
    "value", [-1, -0.001, math.nan, "soon", "-1s", 1e10, 10**400, timedelta(days=365 * 300)]
)
def test_bad_timeout_and_retry_delay_name_the_argument(argument: str, value: object) -> None:
    with memory_lock_store(), pytest.raises(ValueError, match=argument):
        lock("k", **{argument: value})  # type: ignore[arg-type]
    with memory_lock_store(), pytest.raises(ValueError, match=argument):
        lock("k").acquire(**{argument: value})  # type: ignore[arg-type]


def test_zero_timeout_means_do_not_wait() -> None:
    with memory_lock_store():
        assert lock("k", timeout=0, retry_delay=0).acquire()


@pytest.mark.parametrize(
    ("key", "error", "message"),
    [
        ("", ValueError, "key must be a non-empty string"),
        (None, TypeError, "key must be a str, got NoneType"),
        (42, TypeError, "key must be a str, got int"),
        (b"bytes", TypeError, "key must be a str, got bytes"),
        ("a\x00b", ValueError, "key must not contain control characters"),
        ("a\x1b[2Jb", ValueError, "key must not contain control characters, found '\\\\x1b'"),
        ("line\nbreak", ValueError, "key must not contain control characters"),
        ("bell\x07", ValueError, "key must not contain control characters"),
        ("c1\x9b", ValueError, "key must not contain control characters"),
        ("\ud800", ValueError, "key must be encodable as UTF-8"),
    ],
)
def test_bad_key_names_the_argument(key: object, error: type[Exception], message: str) -> None:
    with memory_lock_store(), pytest.raises(error, match=message):
        lock(key)  # type: ignore[arg-type]


@pytest.mark.parametrize("alias", store_params(["sqlite", "postgres", "mariadb"]))
def test_key_longer_than_the_store_allows_is_refused_up_front(alias: str) -> None:
    assert lock("k" * 255, store=alias).run(lambda: 1) == (True, 1)
    with pytest.raises(ValueError, match=f"key is 256 characters long; store '{alias}'"):
        lock("k" * 256, store=alias)


def test_bad_holder_and_store_arguments() -> None:
    with memory_lock_store():
        with pytest.raises(ValueError, match="holder must be encodable as UTF-8"):
            lock("k", holder="web-\ud800")
        with pytest.raises(TypeError, match="holder must be a str"):
            lock("k", holder=5)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="holder must be 1 to 255"):
            lock("k", holder="")
        with pytest.raises(ValueError, match="holder must not contain control characters"):
            lock("k", holder="web-3\nFAKE ROW")
        with pytest.raises(ValueError, match="holder must not contain control characters"):
            lock("k", holder="web-3\x1b[2J")
        with pytest.raises(TypeError, match="store must be an alias"):
            lock("k", store=None)  # type: ignore[arg-type]
    with pytest.raises(ImproperlyConfigured, match="store 'nowhere' is not in KEEL_LOCK_STORES"):
        lock("k", store="nowhere")


def test_a_limit_past_2_63_is_refused_where_each_surface_is_declared() -> None:
    # Before any store is asked: PostgreSQL alone could not keep one, and said so naming
    # the key and the holder.
    too_large = 2**63
    declarations = [
        lambda: semaphore("k", limit=too_large, store="memory"),
        lambda: Lock("k", limit=too_large, store="memory"),
        lambda: locked("k", limit=too_large, store="memory"),
        lambda: lock_view("<pk>", limit=too_large, store="memory"),
    ]
    for declare in declarations:
        with pytest.raises(ValueError, match=r"^limit must be at most 2\*\*63 - 1 \(9223372"):
            declare()
    assert LockSpec.parse(limit=too_large - 1).mode.limit == too_large - 1


def test_bad_settings_are_named() -> None:
    with (
        override_settings(KEEL_LOCK_DEFAULT_TTL=-3),
        pytest.raises(ValueError, match="KEEL_LOCK_DEFAULT_TTL must be > 0"),
    ):
        lock("k", store="memory")
    with override_settings(KEEL_LOCK_STORES={"default": {"BACKEND": "no.such.Store"}}):
        with pytest.raises(ImproperlyConfigured, match="cannot be imported"):
            lock("k")
    with override_settings(KEEL_LOCK_STORES={"default": {"BACKEND": "builtins.dict"}}):
        with pytest.raises(ImproperlyConfigured, match="is not a LockStore"):
            lock("k")
    with override_settings(KEEL_LOCK_STORES=["default"]):
        with pytest.raises(ImproperlyConfigured, match="must be a dict"):
            lock("k")


def test_default_ttl_setting_and_override_settings_rebuild_stores() -> None:
    with override_settings(KEEL_LOCK_DEFAULT_TTL="2m"):
        assert lock("k", store="memory").ttl == 120.0
    assert lock("k", store="memory").ttl == 30.0
    stores = {"default": {"BACKEND": "django_keel_lock.stores.MemoryLockStore"}}
    with override_settings(KEEL_LOCK_STORES=stores):
        held = lock("override-k")
        assert type(held.store).__name__ == "MemoryLockStore"
        assert held.acquire()
    assert type(lock("override-k").store).__name__ == "DatabaseLockStore"


# -- property tests ----------------------------------------------------------------------
keys = st.text(alphabet=st.characters(blacklist_categories=("Cc",)), min_size=1, max_size=200)


@quick
@given(key=keys)
def test_any_valid_key_round_trips_in_memory(key: str) -> None:
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        with memory_lock_store(), pytest.raises(ValueError, match="key"):
            lock(key)
        return
    with memory_lock_store():
        handle = lock(key)
        assert handle.acquire()
        info = handle.info()
        assert info is not None and info.key == key
        assert not lock(key).acquire()
        assert handle.release()


utf8_keys = st.text(
    alphabet=st.characters(blacklist_categories=("Cs", "Cc")),
    min_size=1,
    max_size=120,
)


@pytest.mark.parametrize("alias", ALL_STORES)
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(suffix=utf8_keys)
def test_unicode_keys_round_trip_and_stay_distinct_in_every_store(alias: str, suffix: str) -> None:
    key = f"hyp:{suffix}"
    handle = lock(key, store=alias)
    assert handle.acquire()
    try:
        info = handle.info()
        assert info is not None and info.key == key and info.owner == handle.owner
        # A key differing only in case or trailing space is a different lock.
        for variant in {key.upper(), key.lower(), key + " "} - {key}:
            other = lock(variant, store=alias)
            assert other.acquire(), (key, variant)
            assert other.release()
    finally:
        assert handle.release()


@quick
@given(ttl=st.floats(allow_nan=True, allow_infinity=True))
def test_any_float_ttl_is_accepted_or_named(ttl: float) -> None:
    with memory_lock_store():
        if math.isfinite(ttl) and 0.001 <= ttl <= 365 * 86400:
            assert lock("k", ttl=ttl).ttl == ttl
        else:
            with pytest.raises(ValueError, match="ttl"):
                lock("k", ttl=ttl)


@quick
@given(text=st.text(max_size=30))
def test_any_ttl_string_parses_or_is_named(text: str) -> None:
    with memory_lock_store():
        try:
            handle = lock("k", ttl=text)
        except ValueError as exc:
            assert "ttl" in str(exc)
        else:
            assert handle.ttl > 0 and math.isfinite(handle.ttl)


@quick
@given(token=st.text(max_size=300))
def test_garbage_tokens_are_invalid(token: str) -> None:
    with pytest.raises(InvalidLockToken):
        restore_lock(token)


@functools.cache
def _token() -> str:
    with memory_lock_store():
        handle = lock("tok", store="default")
        assert handle.acquire()
        return handle.serialize()


@quick
@given(data=st.data())
def test_tampered_or_truncated_tokens_are_invalid(data: st.DataObject) -> None:
    token = _token()
    position = data.draw(st.integers(0, len(token) - 1))
    replacement = data.draw(st.characters(min_codepoint=33, max_codepoint=126))
    tampered = token[:position] + replacement + token[position + 1 :]
    truncated = token[: data.draw(st.integers(0, len(token) - 1))]
    for bad in {tampered, truncated} - {token}:
        with pytest.raises(InvalidLockToken, match=r"not valid|must be|decoded|does not describe"):
            restore_lock(bad)


def test_token_signed_with_another_secret_or_not_a_lock_is_invalid() -> None:
    token = _token()
    with (
        override_settings(SECRET_KEY="another-secret"),
        pytest.raises(InvalidLockToken, match="another SECRET_KEY"),
    ):
        restore_lock(token)
    not_a_lock = signing.dumps({"k": "x"}, salt=TOKEN_SALT)
    with pytest.raises(InvalidLockToken, match="does not describe a lock"):
        restore_lock(not_a_lock)
    with pytest.raises(InvalidLockToken, match="must be a str"):
        restore_lock(None)  # type: ignore[arg-type]
    assert issubclass(InvalidLockToken, ValueError)


def test_derived_holders_escape_control_characters() -> None:
    with memory_lock_store():
        spec = LockSpec.parse(store="memory")
        handle = spec.lock("k", label="GET \x1b[2J\nspoofed")
    assert "\x1b" not in handle.holder and "\n" not in handle.holder
    assert handle.holder.endswith("GET \\x1b[2J\\nspoofed")


def test_a_forked_child_names_itself_in_the_default_holder() -> None:
    parent = lock("k", store="memory").holder
    assert parent.endswith(f":{os.getpid()}")
    child, pid = in_forked_child(lambda: lock("k", store="memory").holder)
    assert child == parent.rsplit(":", 1)[0] + f":{pid}"


@pytest.mark.parametrize("ttl", [1e-300, 0.0009, "0.5ms"])
def test_ttl_below_a_millisecond_is_refused(ttl: object) -> None:
    with memory_lock_store(), pytest.raises(ValueError, match=r"ttl must be at least 0\.001"):
        lock("k", ttl=ttl)  # type: ignore[arg-type]
