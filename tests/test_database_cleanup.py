"""The database store deletes free rows as part of its normal work: the table stays small, and
fences still strictly increase per key, even for an acquire in flight while rows go."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from django_keel_lock.models import Lock as LockRow
from django_keel_lock.models import Permit
from django_keel_lock.stores import DatabaseLockStore
from django_keel_lock.stores.base import SHARED, semaphore_mode
from django_keel_lock.stores.database import store as store_module

from .conftest import database_of, needs_store
from .support.threads import call_in_thread

EVERY = 20  # acquires and releases of a thread between two clean-up rounds, here
BATCH = 50  # rows a round deletes at most, here (more than a round can leave: 2 * EVERY)
# Free rows a thread can leave: those freed since the mark of the round before last.
BOUND = 3 * EVERY


@pytest.fixture
def sweeping(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], DatabaseLockStore]]:
    """A store of its own on the database of the store `alias`, sweeping every EVERY
    operations of a thread, BATCH rows at a time."""
    monkeypatch.setattr(store_module, "SWEEP_EVERY", EVERY)
    monkeypatch.setattr(store_module, "SWEEP_BATCH", BATCH)
    stores: list[DatabaseLockStore] = []

    def make(alias: str) -> DatabaseLockStore:
        store = DatabaseLockStore(f"{alias}-sweeping", {"DATABASE": database_of(alias)})
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def owner() -> str:
    return uuid.uuid4().hex


def lock_rows(alias: str, prefix: str) -> int:
    return LockRow.objects.using(database_of(alias)).filter(key__startswith=prefix).count()


def has_row(alias: str, key: str) -> bool:
    return LockRow.objects.using(database_of(alias)).filter(key=key).exists()


def permit_rows(alias: str, prefix: str) -> int:
    return Permit.objects.using(database_of(alias)).filter(key__startswith=prefix).count()


def cycles(store: DatabaseLockStore, prefix: str, count: int) -> None:
    """Lock and release `count` distinct keys under `prefix`."""
    for n in range(count):
        me = owner()
        assert store.acquire(f"{prefix}{n}", me, "cycle", 30).acquired
        assert store.release(f"{prefix}{n}", me)


def test_distinct_keys_locked_and_released_leave_a_bounded_table(
    db_alias: str, key: str, sweeping: Callable[[str], DatabaseLockStore]
) -> None:
    store = sweeping(db_alias)
    held = [(f"{key}:held:{n}", owner()) for n in range(5)]
    for name, me in held:
        assert store.acquire(name, me, "held", 60).acquired
    most = 0
    for chunk in range(30):  # 3,000 keys, counting the rows every 100
        cycles(store, f"{key}:{chunk}:", 100)
        most = max(most, lock_rows(db_alias, key))
    assert most <= len(held) + BOUND, f"{most} rows for {len(held)} held locks"
    for name, me in held:  # nothing held went
        info = store.get(name)
        assert info is not None and info.owner == me
        assert store.release(name, me)


def test_a_key_swept_away_gets_a_higher_fence_next_time(
    db_alias: str, key: str, sweeping: Callable[[str], DatabaseLockStore]
) -> None:
    store = sweeping(db_alias)
    for _ in range(3):
        me = owner()
        first = store.acquire(key, me, "first", 30).fence
        assert first is not None and store.release(key, me)
        cycles(store, f"{key}:other:", 3 * EVERY)  # rounds enough to delete it
        assert not has_row(db_alias, key)  # (on SQLite, the others' fences are higher)
        again = store.acquire(key, me, "again", 30).fence
        assert again is not None and again > first
        assert store.release(key, me)


@needs_store("sqlite")
def test_sqlite_sweep_keeps_the_row_of_the_highest_fence(
    key: str, sweeping: Callable[[str], DatabaseLockStore]
) -> None:
    # SQLite's next fence is MAX(fence) + 1: were the highest row deleted, it would go back.
    store = sweeping("sqlite")
    cycles(store, f"{key}:", 3 * EVERY)
    me = owner()
    last = store.acquire(key, me, "last", 30).fence
    assert last is not None and store.release(key, me)
    for _ in range(5):
        store._sweep(store._sweeps)
    assert lock_rows("sqlite", f"{key}:") == 0
    assert has_row("sqlite", key)
    again = store.acquire(key, me, "again", 30).fence
    assert again is not None and again > last
    assert store.release(key, me)


def test_held_locks_and_live_permits_survive_any_amount_of_clean_up(
    db_alias: str, key: str, sweeping: Callable[[str], DatabaseLockStore]
) -> None:
    store = sweeping(db_alias)
    exclusive, reader, sem = owner(), owner(), [owner(), owner()]
    fence = store.acquire(f"{key}:x", exclusive, "x", 60).fence
    assert store.acquire_permit(f"{key}:r", reader, "r", 60, SHARED).acquired
    for me in sem:
        assert store.acquire_permit(f"{key}:s", me, "s", 60, semaphore_mode(3)).acquired
    # Expired ones around them, which go.
    for n in range(10):
        assert store.acquire_permit(f"{key}:gone:{n}", owner(), "g", 0.05, semaphore_mode(2))
    time.sleep(0.1)
    for n in range(20):
        cycles(store, f"{key}:c{n}:", EVERY)
        store._sweep(store._sweeps)
    assert permit_rows(db_alias, f"{key}:gone:") == 0
    assert lock_rows(db_alias, f"{key}:gone:") == 0
    info = store.get(f"{key}:x")
    assert info is not None and info.owner == exclusive and info.fence == fence
    assert [i.owner for i in store.holders(f"{key}:r")] == [reader]
    assert sorted(i.owner for i in store.holders(f"{key}:s")) == sorted(sem)
    assert permit_rows(db_alias, f"{key}:r") == 1 and permit_rows(db_alias, f"{key}:s") == 2
    assert store.extend(f"{key}:x", exclusive, 60)
    assert store.release(f"{key}:x", exclusive)
    assert store.release_permit(f"{key}:r", reader)
    for me in sem:
        assert store.release_permit(f"{key}:s", me)


def test_released_permits_are_swept_and_a_key_then_gets_a_higher_fence(
    db_alias: str, key: str, sweeping: Callable[[str], DatabaseLockStore]
) -> None:
    store = sweeping(db_alias)
    fences = []
    for n in range(3 * EVERY):
        me = owner()
        result = store.acquire_permit(f"{key}:{n % 7}", me, "p", 30, semaphore_mode(2))
        assert result.fence is not None and store.release_permit(f"{key}:{n % 7}", me)
        fences.append((n % 7, result.fence))
    cycles(store, f"{key}:other:", 3 * EVERY)
    assert permit_rows(db_alias, key) == 0
    for slot in range(7):
        last = max(fence for n, fence in fences if n == slot)
        again = store.acquire_permit(f"{key}:{slot}", "me", "p", 30, semaphore_mode(2)).fence
        assert again is not None and again > last
        assert store.release_permit(f"{key}:{slot}", "me")


# -- the race the mark guards against ------------------------------------------------------
# An acquire draws the fence it would insert before it looks for its key's row. A trigger of
# the test's own holds the acquire right there (it runs after the INSERT's values, before the
# key's row is looked for), while the key is locked and released with a higher fence and
# clean-up rounds run: were the row deleted, the acquire would go on to insert its lower fence.
STALL = {
    "postgresql": (
        "CREATE FUNCTION keel_lock_test_stall() RETURNS trigger LANGUAGE plpgsql AS $$ "
        "BEGIN IF NEW.owner = 'stalled' THEN PERFORM pg_advisory_lock(4242); "
        "PERFORM pg_advisory_unlock(4242); END IF; RETURN NEW; END $$",
        "CREATE TRIGGER keel_lock_test_stall BEFORE INSERT ON django_keel_lock_lock "
        "FOR EACH ROW EXECUTE FUNCTION keel_lock_test_stall()",
    ),
    "mysql": (
        "CREATE TRIGGER keel_lock_test_stall BEFORE INSERT ON django_keel_lock_lock "
        "FOR EACH ROW BEGIN IF NEW.owner = 'stalled' THEN "
        "DO GET_LOCK('keel_lock_test_stall', 30); DO RELEASE_LOCK('keel_lock_test_stall'); "
        "END IF; END",
    ),
}
UNSTALL = {
    "postgresql": (
        "DROP TRIGGER IF EXISTS keel_lock_test_stall ON django_keel_lock_lock",
        "DROP FUNCTION IF EXISTS keel_lock_test_stall()",
    ),
    "mysql": ("DROP TRIGGER IF EXISTS keel_lock_test_stall",),
}
HOLD = {
    "postgresql": ("SELECT pg_advisory_lock(4242)", "SELECT pg_advisory_unlock(4242)"),
    "mysql": (
        "SELECT GET_LOCK('keel_lock_test_stall', 10)",
        "SELECT RELEASE_LOCK('keel_lock_test_stall')",
    ),
}
WAITING = {
    "postgresql": "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'advisory'",
    "mysql": "SELECT count(*) FROM information_schema.PROCESSLIST "
    "WHERE STATE = 'User lock' AND DB = DATABASE()",
}


@contextmanager
def stalled_inserts(store: DatabaseLockStore) -> Iterator[Callable[[], int]]:
    """While the block runs, an insert of a lock row owned by 'stalled' waits after its values
    (its fence) are drawn, until the block ends; yields a count of the inserts waiting."""
    control = store._new_wrapper()
    vendor = control.vendor
    hold, let_go = HOLD[vendor]
    try:
        with control.connection.cursor() as cursor:
            for sql in UNSTALL[vendor] + STALL[vendor]:
                cursor.execute(sql)
            cursor.execute(hold)

            def waiting() -> int:
                cursor.execute(WAITING[vendor])
                return int(cursor.fetchone()[0])

            try:
                yield waiting
            finally:
                cursor.execute(let_go)
    finally:
        with control.connection.cursor() as cursor:
            for sql in UNSTALL[vendor]:
                cursor.execute(sql)
        control.close()


def test_clean_up_never_deletes_the_row_of_an_acquire_in_flight_so_fences_increase(
    server_alias: str, key: str, sweeping: Callable[[str], DatabaseLockStore]
) -> None:
    store = sweeping(server_alias)
    other = sweeping(server_alias)  # the acquire in flight: a process of its own
    with stalled_inserts(store) as waiting:
        thread, outcome = call_in_thread(
            other, lambda: other.acquire(key, "stalled", "in flight", 30)
        )
        deadline = time.monotonic() + 10
        while not waiting() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert waiting() == 1, "the acquire never reached the trigger"
        # Its fence is drawn; the key has no row yet. Someone locks and releases the key with
        # a higher fence, and clean-up rounds go on meanwhile.
        me = owner()
        higher = store.acquire(key, me, "meanwhile", 30).fence
        assert higher is not None and store.release(key, me)
        for n in range(10):
            cycles(store, f"{key}:other:{n}:", EVERY)
            store._sweep(store._sweeps)
        # The rounds wait for the acquire in flight: nothing freed after their mark goes.
        assert has_row(server_alias, key)
        assert lock_rows(server_alias, f"{key}:other:") == 10 * EVERY
        assert outcome == []
    thread.join(10)
    assert len(outcome) == 1 and not isinstance(outcome[0], Exception), outcome
    # The acquire found the row: refused (it read "now" before the release), or took it with a
    # fence drawn then. Deleted, it would have inserted the lower fence it drew first.
    fence = outcome[0].fence
    assert fence is None or fence > higher, (fence, higher)
    again = other.acquire(key, "stalled", "again", 30).fence
    assert again is not None and again > higher
    assert other.release(key, "stalled")
    for n in range(3):  # and then the rounds go on deleting
        cycles(store, f"{key}:after:{n}:", EVERY)
        store._sweep(store._sweeps)
    assert lock_rows(server_alias, f"{key}:other:") == 0


@needs_store("mariadb")
def test_mariadb_clean_up_is_not_held_off_by_a_napping_listener(
    key: str, sweeping: Callable[[str], DatabaseLockStore]
) -> None:
    """A waiting process's listener naps in a GET_LOCK wait of seconds on the same database:
    it writes nothing, so the rounds must not wait for it to end."""
    store = sweeping("mariadb")
    holder = owner()
    assert store.acquire(f"{key}:held", holder, "held", 60).acquired
    with store.watch(f"{key}:held"):  # this process's listener subscribes, then naps
        deadline = time.monotonic() + 10
        while not store.listener_ready():
            assert time.monotonic() < deadline, "the listener never got ready"
            time.sleep(0.05)
        time.sleep(0.5)  # well into its nap
        cycles(store, f"{key}:c:", 600)
        assert lock_rows("mariadb", f"{key}:c:") <= BOUND
    assert store.release(f"{key}:held", holder)
