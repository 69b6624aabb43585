"""A handle made with options seen before takes what they lead to (its store, its ttl, its
holder) as it is now: after a setting changed, a store was set on the alias, or the process
forked."""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings
from django.utils.functional import lazy

from django_keel_lock import lock
from django_keel_lock.options import LockSpec
from django_keel_lock.stores import MemoryLockStore
from django_keel_lock.testing import memory_lock_store

from .support.forked import in_forked_child
from .test_database_faults import wait_until

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


def test_a_spec_gone_and_its_id_reused_lends_its_handles_nothing() -> None:
    """A handle starts from what was found for its spec by the spec's id (and from the last
    spec's, kept apart): once a spec is collected a new one may get its id, and its handles
    take its own ttl, holder and store, not the gone spec's. (Specs made with
    `dataclasses.replace`, as a task's claim makes its own, are not kept by `LockSpec.of`.)"""
    base = LockSpec.parse(store="memory")
    seen: set[int] = set()
    reused = 0
    with memory_lock_store("elsewhere") as elsewhere:
        for round_ in range(600):
            alias = "elsewhere" if round_ % 2 else "memory"
            spec = dataclasses.replace(base, store=alias, ttl=round_ + 1.0, holder=f"h{round_}")
            reused += id(spec) in seen
            seen.add(id(spec))
            handle = spec.lock("k")
            made = (handle.ttl, handle.holder, handle.store_alias)
            assert made == (round_ + 1.0, f"h{round_}", alias)
            assert (handle.store is elsewhere) == (alias == "elsewhere")
            del spec, handle
    assert reused, "no spec's id came round again: the test proved nothing"


def test_owners_drawn_by_many_threads_at_once_are_all_different() -> None:
    """Owner tokens are drawn ahead in batches shared by the threads of a process: two
    threads never take the same one, and each is 128 random bits (32 hex digits)."""
    owners: list[str] = []
    start = threading.Barrier(4)

    def take(thread: int) -> None:
        start.wait()
        for round_ in range(500):
            with lock(f"owners:{thread}:{round_}", store="memory") as held:
                owners.append(str(held.owner))

    threads = [threading.Thread(target=take, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(owners) == 2000
    assert len(set(owners)) == 2000
    assert all(len(owner) == 32 and int(owner, 16) >= 0 for owner in owners)


def test_a_plain_string_option_gets_its_own_spec_whatever_was_asked_before() -> None:
    """`LockSpec.of` compares options with the last plain ones it found a spec for: what it
    keeps is what the spec was made of, never a caller's value merely equal to a string (a
    lazy translation, whose value follows the active language), which by the next call may
    equal another string."""
    current = ["day-shift"]
    shift = lazy(lambda: current[0], str)()  # as gettext_lazy("day shift") across languages
    assert lock("k", store="memory", holder="day-shift").holder == "day-shift"
    assert lock("k", store="memory").holder != "day-shift"
    with contextlib.suppress(TypeError):  # no str: refused, or taken as the one it equals
        lock("k", store="memory", holder=shift)
    current[0] = "night-shift"
    assert lock("k", store="memory", holder="night-shift").holder == "night-shift"


@pytest.mark.timeout(120)
def test_a_forked_child_acquires_a_handle_the_parent_is_acquiring_with_an_owner_of_its_own() -> (
    None
):
    """A process forks while one of its threads acquires a handle: the child has no acquire
    under way and may use the handle, but not with the owner the parent's acquire asks with:
    a store both share would grant that one owner to the two processes."""
    with memory_lock_store("memory"):
        holder = lock("k", store="memory", ttl=30)
        assert holder.acquire()
        handle = lock("k", store="memory", ttl=30)
        waiting = threading.Thread(target=handle.acquire, kwargs={"timeout": 20})
        waiting.start()
        assert wait_until(lambda: handle._acquiring is not None, 10)

        def child_owner() -> str:
            holder.release()  # in the child's copy of the store
            assert handle.acquire()
            return str(handle.owner)

        theirs, _ = in_forked_child(child_owner)
        assert holder.release()
        waiting.join(20)
        assert handle.held and handle.release()
        assert len(theirs) == 32 and theirs != handle.owner
