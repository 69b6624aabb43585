"""Multi-key locks on the database store (`LockStore.acquire_many`, `release_many`,
`extend_many`), called on the store itself: every key or none, in one call on PostgreSQL
(migration 0008's function) and one transaction on MariaDB and SQLite; exclusive against
single-key locks of the same keys; fences from the same source as single-key acquires."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
from django.core.management import call_command
from django.db import DatabaseError, connections, transaction

from django_keel_lock import LockStoreMisconfigured, LockStoreUnavailable, get_lock_store
from django_keel_lock.models import Lock
from django_keel_lock.stores import DatabaseLockStore

from .conftest import database_of, empty_database, needs_store, serving, store_params
from .support import ROOT
from .support.many_child import fenced_write
from .test_database_faults import behind_proxy, wait_until

#: How far a store's reckoning of time left may stray above the ttl: SQLite's julianday() is a
#: double of days, good to about 50 microseconds at today's dates.
CLOCK_GRAIN = 0.001


def owner() -> str:
    return uuid.uuid4().hex


def store_of(alias: str) -> DatabaseLockStore:
    store = get_lock_store(alias)
    assert isinstance(store, DatabaseLockStore)
    return store


def keys_of(key: str, count: int) -> tuple[str, ...]:
    return tuple(sorted(f"{key}:{i}" for i in range(count)))


@contextmanager
def another_store(alias: str) -> Iterator[DatabaseLockStore]:
    """A second store on the database of `alias`, under its own alias: its own connections,
    wake board and listener, so it hears the other's releases only as another process does."""
    store = DatabaseLockStore(
        f"{alias}-other-{uuid.uuid4().hex[:8]}", {"DATABASE": database_of(alias)}
    )
    with serving(store):
        yield store


def test_acquire_many_takes_every_key_with_fences_above_the_single_key_ones(
    db_alias: str, key: str
) -> None:
    store, keys = store_of(db_alias), keys_of(key, 3)
    assert store.atomic_many
    before = []
    for each in keys:
        single = owner()
        fence = store.acquire(each, single, "single", 30).fence
        assert fence is not None and store.release(each, single)
        before.append(fence)

    mine = owner()
    result = store.acquire_many(keys, mine, "many", 30)

    assert result.fences is not None and len(result.fences) == 3
    assert all(new > old for new, old in zip(result.fences, before, strict=True))
    assert result.fence == max(result.fences)
    for each, fence in zip(keys, result.fences, strict=True):
        info = store.get(each)
        assert info is not None and (info.owner, info.holder, info.fence) == (mine, "many", fence)
    # The same owner asking again renews them, with new fences (as a single-key retry does).
    again = store.acquire_many(keys, mine, "many", 30)
    assert again.fences is not None
    assert all(new > old for new, old in zip(again.fences, result.fences, strict=True))
    assert store.release_many(keys, mine)
    assert all(store.get(each) is None for each in keys)
    assert not store.release_many(keys, mine)


def test_a_key_held_by_a_single_key_lock_refuses_the_set_and_takes_none_of_it(
    db_alias: str, key: str
) -> None:
    store, (a, b, c) = store_of(db_alias), keys_of(key, 3)
    single = owner()
    assert store.acquire(b, single, "single", 30).acquired

    refused = store.acquire_many((a, b, c), owner(), "many", 30)

    assert refused.fence is None and refused.fences is None
    assert refused.blocked == (b,)
    assert refused.retry_in is not None and 0 < refused.retry_in <= 30 + CLOCK_GRAIN
    assert refused.held_as == "exclusive"
    assert store.get(a) is None and store.get(c) is None
    info = store.get(b)
    assert info is not None and info.owner == single
    # Every key held by others is named, and retry_in is the soonest of their expiries.
    assert store.acquire(c, single, "single", 5).acquired
    both = store.acquire_many((a, b, c), owner(), "many", 30)
    assert both.blocked == (b, c)
    assert both.retry_in is not None and 0 < both.retry_in <= 5 + CLOCK_GRAIN
    assert store.get(a) is None
    assert store.release_many((b, c), single)


def test_a_set_held_refuses_a_single_key_lock_of_any_of_its_keys(db_alias: str, key: str) -> None:
    store, keys = store_of(db_alias), keys_of(key, 2)
    mine = owner()
    assert store.acquire_many(keys, mine, "many", 30).acquired
    for each in keys:
        assert not store.acquire(each, owner(), "single", 30).acquired
    assert store.release_many(keys, mine)
    assert store.acquire(keys[1], owner(), "single", 30).acquired


def test_expired_keys_are_taken_over_and_extend_many_then_leaves_the_new_holder_alone(
    db_alias: str, key: str
) -> None:
    store, (a, b) = store_of(db_alias), keys_of(key, 2)
    first = owner()
    taken = store.acquire_many((a, b), first, "first", 0.3)
    assert taken.fences is not None
    assert store.extend_many((a, b), first, 0.3)
    time.sleep(0.4)
    second = owner()
    assert store.acquire(b, second, "second", 5).acquired

    assert not store.extend_many((a, b), first, 30), (store.get(a), store.get(b))
    info = store.get(b)
    assert info is not None and info.owner == second and info.expires_in <= 5, (info, second)
    assert not store.release_many((a, b), first)
    assert store.get(b) is not None

    # A set whose keys expired is taken over, with greater fences.
    assert store.release(b, second)
    third = owner()
    over = store.acquire_many((a, b), third, "third", 30)
    assert over.fences is not None
    assert all(new > old for new, old in zip(over.fences, taken.fences, strict=True))
    assert store.release_many((a, b), third)


def test_extend_many_of_a_held_set_makes_every_key_live_longer(db_alias: str, key: str) -> None:
    store, keys = store_of(db_alias), keys_of(key, 3)
    mine = owner()
    assert store.acquire_many(keys, mine, "many", 2).acquired
    assert store.extend_many(keys, mine, 60)
    for each in keys:
        info = store.get(each)
        assert info is not None and info.expires_in > 30
    assert store.release_many(keys, mine)


def test_threads_taking_overlapping_sets_never_hold_a_key_twice(db_alias: str, key: str) -> None:
    store, keys = store_of(db_alias), keys_of(key, 5)
    with tempfile.TemporaryDirectory() as directory:
        files = [Path(directory, str(i)) for i in range(len(keys))]
        for path in files:
            path.write_text("0 0")
        taken = [0] * len(keys)
        violations: list[str] = []

        def work(seed: int) -> None:
            chooser = random.Random(seed)
            for _ in range(25):
                chosen = sorted(chooser.sample(range(len(keys)), chooser.randint(2, 4)))
                names, mine = tuple(keys[i] for i in chosen), owner()
                result = store.acquire_many(names, mine, "thread", 30)
                if result.fences is None:
                    assert result.blocked and set(result.blocked) <= set(names)
                    continue
                for index, fence in zip(chosen, result.fences, strict=True):
                    if not fenced_write(files[index], fence):
                        violations.append(keys[index])
                    taken[index] += 1
                assert store.release_many(names, mine)

        with ThreadPoolExecutor(6) as pool:
            list(pool.map(work, range(6)))
        counts = [int(path.read_text().split()[1]) for path in files]

    assert not violations
    assert counts == taken and sum(taken) > 0


@pytest.mark.parametrize("alias", store_params(["sqlite", "postgres", "mariadb"]))
def test_processes_taking_overlapping_sets_never_hold_a_key_twice(alias: str, key: str) -> None:
    keys = keys_of(key, 4)
    with tempfile.TemporaryDirectory() as directory:
        for i in range(len(keys)):
            Path(directory, str(i)).write_text("0 0")
        argv = ["--store", alias, "--keys", ",".join(keys), "--dir", directory, "--rounds", "30"]
        children = [
            subprocess.Popen(
                [sys.executable, "-m", "tests.support.many_child", *argv, "--seed", str(seed)],
                cwd=ROOT,
                env=dict(os.environ),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for seed in range(3)
        ]
        reports = []
        for child in children:
            out, err = child.communicate(timeout=120)
            assert child.returncode == 0, err
            reports.append(json.loads(out.strip().splitlines()[-1]))
        counts = [int(Path(directory, str(i)).read_text().split()[1]) for i in range(len(keys))]

    assert [report["violations"] for report in reports] == [0, 0, 0]
    taken = [sum(report["taken"][i] for report in reports) for i in range(len(keys))]
    assert counts == taken and sum(taken) > 0


@pytest.mark.parametrize("alias", store_params(["postgres", "mariadb"]))
def test_release_many_wakes_a_waiter_of_another_key_of_the_set_in_another_process(
    alias: str, key: str
) -> None:
    store, (a, b) = store_of(alias), keys_of(key, 2)
    holder = owner()
    with another_store(alias) as other:
        assert other.acquire_many((a, b), holder, "other", 30).acquired
        with store.watch(b) as waiter:
            assert wait_until(store.listener_ready, 10)
            refused = store.acquire_many((a, b), owner(), "waiter", 30)
            assert refused.blocked == (a, b)
            waiter.poll()
            assert other.release_many((a, b), holder)
            assert waiter.wait(10)
    assert store.acquire_many((a, b), owner(), "waiter", 30).acquired


@needs_store("postgres")
def test_each_multi_key_operation_is_one_round_trip_on_postgres(key: str) -> None:
    keys = keys_of(key, 10)
    with behind_proxy("postgres") as (store, proxy):
        mine, other = owner(), owner()
        # The first calls of a connection prepare their statements (a round trip each, once).
        assert store.acquire_many(keys, mine, "warm", 30).acquired
        assert not store.acquire_many(keys, other, "warm", 30).acquired
        assert store.extend_many(keys, mine, 30) and store.release_many(keys, mine)
        counts = []
        for call in (
            lambda: store.acquire_many(keys, mine, "many", 30).acquired,
            lambda: not store.acquire_many(keys, other, "refused", 30).acquired,
            lambda: store.extend_many(keys, mine, 30),
            lambda: store.release_many(keys, mine),
        ):
            before = proxy.trips
            assert call()
            counts.append(proxy.trips - before)

    assert counts == [1, 1, 1, 1]


@needs_store("postgres")
@pytest.mark.parametrize("count", [2, 10])
def test_release_and_extend_of_several_keys_run_their_generic_plan_on_postgres(
    key: str, count: int
) -> None:
    """A prepared statement is planned anew at every call while its generic plan looks
    dearer than a plan for the values, as over an array parameter's unnest at a few keys
    (the planner guesses ten rows): the statements of several keys take one parameter a
    key, in a VALUES list, and run their generic plan past the planner's five trial runs."""
    store, keys, mine = store_of("postgres"), keys_of(key, count), owner()
    values = ", ".join(f"({n}, ${n}::text)" for n in range(1, count + 1))
    for _ in range(8):
        assert store.acquire_many(keys, mine, "plans", 30).acquired
        assert store.extend_many(keys, mine, 30) and store.release_many(keys, mine)
    rows, _ = store.execute(
        [
            (
                "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements "
                "WHERE statement LIKE %s",
                (f"%(VALUES {values}) AS u%",),
            )
        ]
    )
    assert len(rows) >= 2  # the release and the extend of `count` keys
    assert all(generic > 0 and custom <= 5 for _, generic, custom in rows), rows


@pytest.mark.parametrize("alias", store_params(["postgres", "mariadb"]))
def test_an_outage_mid_call_raises_unavailable_and_leaves_no_key_held(alias: str, key: str) -> None:
    keys, mine = keys_of(key, 3), owner()
    with behind_proxy(alias, SOCKET_TIMEOUT=1) as (store, proxy):
        assert store.acquire(keys[0], owner(), "warm", 0.01).acquired  # connected
        proxy.mode = "stall"
        try:
            with pytest.raises(LockStoreUnavailable):
                store.acquire_many(keys, mine, "many", 30)
        finally:
            proxy.drop_connections()
            proxy.mode = "pass"
        assert all(store.get(each) is None for each in keys)
        # Its request ran but its reply was lost: the same owner's release gives it all back.
        proxy.mode = "drop_replies"
        try:
            with pytest.raises(LockStoreUnavailable):
                store.acquire_many(keys, mine, "many", 30)
        finally:
            proxy.mode = "pass"
        store.release_many(keys, mine)
        assert all(store.get(each) is None for each in keys)


def test_keys_with_quotes_commas_braces_and_accents_are_each_their_own_key(
    db_alias: str, key: str
) -> None:
    store = store_of(db_alias)
    keys = tuple(sorted(f"{key}:{odd}" for odd in ('a"b', "a\\b", "a,b", "{a}", "é", "a b")))
    mine = owner()
    taken = store.acquire_many(keys, mine, "odd", 30)
    assert taken.fences is not None and len(taken.fences) == len(keys)
    assert [store.get(each).owner for each in keys] == [mine] * len(keys)  # type: ignore[union-attr]
    assert store.acquire_many(keys, owner(), "other", 30).blocked == keys
    assert store.extend_many(keys, mine, 30) and store.release_many(keys, mine)
    assert all(store.get(each) is None for each in keys)


#: (vendor) -> a statement that counts the row locks waited for in the database now.
LOCK_WAITS = {
    "postgresql": "SELECT count(*) FROM pg_locks WHERE NOT granted",
    "mysql": "SELECT COUNT(*) FROM information_schema.INNODB_TRX WHERE trx_state = 'LOCK WAIT'",
}


@pytest.mark.parametrize("alias", store_params(["postgres", "mariadb"]))
def test_a_deadlock_with_another_transaction_is_a_refusal_or_a_take_never_an_error(
    alias: str, key: str
) -> None:
    """Another transaction holds b's row and then asks for a's, which the set holds while it
    waits for b: the server ends the deadlock by failing one of the two. The set's acquire
    then takes its keys (the other one failed) or is refused, to retry at once."""
    store, (a, b) = store_of(alias), keys_of(key, 2)
    for each in (a, b):  # both rows exist, so each update below locks one
        single = owner()
        assert store.acquire(each, single, "single", 30).acquired and store.release(each, single)
    database = database_of(alias)
    rows = Lock.objects.using(database)
    with ThreadPoolExecutor(1) as pool:
        try:
            with transaction.atomic(using=database):
                rows.filter(key=b).update(holder="other")
                outcome = pool.submit(store.acquire_many, (a, b), owner(), "many", 30)
                with connections[database].cursor() as cursor:

                    def waiting() -> bool:
                        time.sleep(0.2)  # MariaDB refreshes INNODB_TRX only when not read lately
                        cursor.execute(LOCK_WAITS[connections[database].vendor])
                        return bool(cursor.fetchone()[0])

                    assert wait_until(waiting, 10)
                rows.filter(key=a).update(holder="other")
        except DatabaseError:
            pass  # the other transaction was the one failed
        result = outcome.result(timeout=30)
    assert result.acquired or (result.retry_in == 0 and set(result.blocked) == {a, b})


@needs_store("postgres")
def test_a_postgres_database_migrated_before_0008_says_to_run_migrate(key: str) -> None:
    with empty_database(database_of("postgres"), "before-0008") as database:
        call_command("migrate", "django_keel_lock", "0007", database=database, verbosity=0)
        store = DatabaseLockStore("before-0008", {"DATABASE": database})
        try:
            assert store.acquire(key, owner(), "single", 30).acquired
            with pytest.raises(LockStoreMisconfigured) as raised:
                store.acquire_many(keys_of(key, 2), owner(), "many", 30)
        finally:
            store.close()
    message = str(raised.value)
    assert "django_keel_lock_acquire_many" in message
    assert message.endswith("run: python manage.py migrate django_keel_lock --database before-0008")


def test_a_set_taken_inside_the_callers_transaction_on_sqlite_joins_it(key: str) -> None:
    """On SQLite lock statements join the caller's open transaction (the file's one writer):
    a set taken there is taken with it, and released with it too."""
    store, keys = store_of("sqlite"), keys_of(key, 2)
    mine = owner()
    with transaction.atomic(using=database_of("sqlite")):
        Lock.objects.using(database_of("sqlite")).filter(key="nothing").update(holder="")
        assert store.acquire_many(keys, mine, "inside", 30).acquired
        assert not store.acquire_many(keys, owner(), "other", 30).acquired
        assert store.release_many(keys, mine)
    assert all(store.get(each) is None for each in keys)
