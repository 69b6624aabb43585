"""A handle made with options seen before takes what they lead to (its store, its ttl, its
holder) as it is now: after a setting changed, a store was set on the alias, or the process
forked."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from django_keel_lock import lock
from django_keel_lock.options import LockSpec
from django_keel_lock.stores import MemoryLockStore
from django_keel_lock.testing import memory_lock_store

from .support.forked import in_forked_child

MEMORY = {"BACKEND": "django_keel_lock.stores.MemoryLockStore"}


class Plain(MemoryLockStore):
    """A store of exclusive locks only."""

    supports_modes = False


def test_a_handle_takes_the_default_ttl_as_the_settings_say_now() -> None:
    before = lock("k", store="memory").ttl
    with override_settings(KEEL_LOCK_DEFAULT_TTL=7):
        assert lock("k", store="memory").ttl == 7.0
        assert LockSpec.parse(store="memory").lock("k").ttl == 7.0
    assert lock("k", store="memory").ttl == before


def test_a_handle_takes_the_store_set_on_its_alias_now() -> None:
    built = lock("k", store="memory").store
    with memory_lock_store("memory") as store:
        assert lock("k", store="memory").store is store
        with lock("k", store="memory"):
            assert store.get("k") is not None
    assert lock("k", store="memory").store is built


def test_a_handle_takes_the_stores_setting_as_it_is_now() -> None:
    stores = {**settings.KEEL_LOCK_STORES, "elsewhere": MEMORY}
    with override_settings(KEEL_LOCK_STORES=stores):
        first = lock("k", store="elsewhere").store
    with override_settings(KEEL_LOCK_STORES=stores):
        assert lock("k", store="elsewhere").store is not first  # built again
    with pytest.raises(ImproperlyConfigured, match="'elsewhere' is not in KEEL_LOCK_STORES"):
        lock("k", store="elsewhere")


def test_a_store_without_modes_refuses_a_shared_handle_each_time() -> None:
    stores = {**settings.KEEL_LOCK_STORES, "plain": {"BACKEND": "tests.test_handle_setup.Plain"}}
    with override_settings(KEEL_LOCK_STORES=stores):
        for _ in range(2):
            with pytest.raises(ValueError, match="shared=True needs a store with semaphores"):
                lock("k", store="plain", shared=True)


def test_a_forked_child_draws_owners_of_its_own() -> None:
    with memory_lock_store("memory"):
        with lock("k", store="memory") as held:
            assert held.owner is not None

        def child_owner() -> str:
            with lock("k", store="memory") as child:
                return str(child.owner)

        theirs, _ = in_forked_child(child_owner)
        with lock("k", store="memory") as parent:
            assert len(theirs) == 32 and theirs != parent.owner


def test_a_spec_is_of_the_options_as_they_are_now_not_as_last_seen() -> None:
    """`LockSpec.of` keeps the options it found a spec for last: the same dict changed since
    (a caller that reuses one) gets the spec of what it says now."""
    options: dict[str, object] = {"store": "memory", "name": "before"}
    assert LockSpec.of("test", options).name == "before"
    options["name"] = "after"
    assert LockSpec.of("test", options).name == "after"
    assert lock("k", store="memory", name="before").name == "before"
    assert lock("k", store="memory").name == "k"
