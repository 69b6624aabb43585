"""`manage.py locks`: list / show / release / prune against real stores, exit codes, streaming."""

from __future__ import annotations

import io
import json
import sqlite3
import subprocess
import sys
import time
import tracemalloc
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import connections
from django.test import override_settings

from django_keel_lock import get_lock_store, lock, semaphore
from django_keel_lock.conf import conf
from django_keel_lock.management.commands.locks import list_lines
from django_keel_lock.stores.database import PAGE_SIZE
from tests.conftest import ALL_STORES, STORE_AVAILABILITY, needs_store, store_params
from tests.support import ROOT
from tests.support.holders import MANAGE, child_env, held_elsewhere, manage

DOWN_STORES = {"down": {"BACKEND": "django_keel_lock.stores.RedisLockStore",
                        "OPTIONS": {"URL": "redis://127.0.0.1:1/0"}}}  # fmt: skip


def run(*args: str) -> str:
    out = io.StringIO()
    call_command("locks", *args, stdout=out, stderr=io.StringIO())
    return out.getvalue()


def fails(*args: str) -> CommandError:
    with pytest.raises(CommandError) as info:
        run(*args)
    return info.value


# -- list -----------------------------------------------------------------------------------
@pytest.mark.parametrize("store_alias", ALL_STORES)
def test_list_shows_locks_held_by_another_process(store_alias: str, key: str) -> None:
    with held_elsewhere(store_alias, key, ttl=30) as held:
        table = run("list", "--store", store_alias, "--prefix", key).splitlines()
        lines = run("list", "--store", store_alias, "--prefix", key, "--json").splitlines()
    header = ["FENCE", "MODE", "EXPIRES", "IN", "ACQUIRED", "(UTC)", "HOLDER", "KEY"]
    assert table[0].split() == header
    assert len(table) == 3, table
    fence, mode, expires, day, clock, holder, listed_key = table[1].split()
    assert listed_key == key and int(fence) == held["fence"] and mode == "exclusive"
    assert 25 <= float(expires.rstrip("s")) <= 30
    acquired = datetime.fromisoformat(f"{day} {clock}").replace(tzinfo=UTC)
    assert abs((datetime.now(UTC) - acquired).total_seconds()) < 60
    assert holder.split(":")[1].isdigit()  # <hostname>:<pid> of the other process
    assert table[2] == f"1 holder in store {store_alias!r} with prefix {key!r}."
    assert len(lines) == 1
    row = json.loads(lines[0])
    assert row["key"] == key and row["fence"] == held["fence"]
    assert set(row) == {"key", "mode", "holder", "fence", "acquired_at", "expires_in"}
    assert 25 <= row["expires_in"] <= 30


def test_list_prefix_filters_and_orders(key: str) -> None:
    handles = [lock(f"{key}:{n}", store="memory") for n in (3, 1, 2)]
    other = lock(f"{key}-other", store="memory")
    for handle in [*handles, other]:
        assert handle.acquire()
    keys = [json.loads(line)["key"] for line in run("list", "--store", "memory", "--prefix",
                                                    f"{key}:", "--json").splitlines()]  # fmt: skip
    assert keys == [f"{key}:1", f"{key}:2", f"{key}:3"]
    table = run("list", "--store", "memory", "--prefix", f"{key}:")
    assert table.splitlines()[-1] == f"3 holders in store 'memory' with prefix '{key}:'."


def test_list_cuts_neither_the_key_nor_the_holder(key: str) -> None:
    long_key = key + ":" + "k" * 150
    handle = lock(long_key, store="memory", holder="h" * 200)
    assert handle.acquire()
    header, row, _ = run("list", "--store", "memory", "--prefix", key).splitlines()
    assert row.endswith(long_key)
    assert row.index(long_key) == header.index("KEY")
    assert f" {'h' * 200}  {long_key}" in row


@needs_store("redis")
def test_list_aligns_redis_fences_and_shows_a_celery_task_id_in_full(key: str) -> None:
    task_id = str(uuid.uuid4())  # what a locked_task's holder ends with: 36 characters
    holders = [f"worker-1:4242 tasks.charge[{task_id}]", "web-3:17"]
    handles = [lock(f"{key}:{n}", store="redis", holder=h) for n, h in enumerate(holders)]
    for handle in handles:
        assert handle.acquire()
    try:
        header, *rows, _ = run("list", "--store", "redis", "--prefix", key).splitlines()
    finally:
        for handle in handles:
            handle.release()
    assert len(rows) == 2
    fences = [handle.fence for handle in handles]
    assert all(len(str(fence)) == 16 for fence in fences), fences  # the server's clock in µs
    fence_end = header.index("FENCE") + len("FENCE")
    for row, holder, fence in zip(rows, holders, fences, strict=True):
        assert row.index(str(fence)) + 16 == fence_end  # right-aligned under FENCE
        assert row[header.index("HOLDER") :].startswith(holder)  # the task id whole
        assert row.index(f"{key}:") == header.index("KEY")
        # Text starts where its header does, a number ends where its header does.
        for title in ("MODE", "ACQUIRED (UTC)", "HOLDER"):
            start = header.index(title)
            assert row[start - 2 : start] == "  " and row[start] != " ", (title, row)
        end = header.index("EXPIRES IN") + len("EXPIRES IN")
        assert row[end - 1] == "s" and row[end : end + 2] == "  ", row


# -- streaming ------------------------------------------------------------------------------
def _insert_sql(vendor: str, prefix: str, count: int) -> str:
    if vendor == "postgresql":
        return (
            "INSERT INTO django_keel_lock_lock (key, owner, holder, fence, acquired_at, "
            f"expires_at) SELECT '{prefix}' || lpad(g::text, 6, '0'), md5(g::text), "
            "'bulk:1', nextval('django_keel_lock_fence'), clock_timestamp(), "
            f"clock_timestamp() + interval '1 hour' FROM generate_series(1, {count}) g"
        )
    return (
        f"WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < {count}) "
        "INSERT INTO django_keel_lock_lock (key, owner, holder, fence, acquired_at, expires_at) "
        f"SELECT '{prefix}' || substr('000000' || n, -6), hex(randomblob(16)), 'bulk:1', "
        "(SELECT COALESCE(MAX(fence), 0) FROM django_keel_lock_lock) + n, "
        "strftime('%Y-%m-%d %H:%M:%f', 'now'), "
        "strftime('%Y-%m-%d %H:%M:%f', 'now', '+3600 seconds') FROM g"
    )


def _sql(database: str, sql: str, params: tuple[Any, ...] = ()) -> None:
    """Run one statement on a connection of its own, committed at once (like another server)."""
    conn = connections.create_connection(database)
    try:
        with conn.cursor() as cursor:
            cursor.execute(sql, params)
    finally:
        conn.close()


MANY = 20_000


@pytest.fixture(params=store_params(["sqlite", "postgres"]))
def many_locks(request: pytest.FixtureRequest, key: str) -> Iterator[tuple[str, str, str]]:
    """(store alias, database alias, prefix) with MANY locks held under prefix."""
    alias = str(request.param)
    database = get_lock_store(alias).database  # type: ignore[attr-defined]
    prefix = f"{key}:"
    _sql(database, _insert_sql(connections[database].vendor, prefix, MANY))
    try:
        yield alias, database, prefix
    finally:
        _sql(database, "DELETE FROM django_keel_lock_lock WHERE key LIKE %s", (prefix + "%",))


def test_list_streams_page_by_page(many_locks: tuple[str, str, str]) -> None:
    alias, database, prefix = many_locks
    lines = list_lines(get_lock_store(alias), prefix)
    assert next(lines).split()[0] == "FENCE"
    assert next(lines).endswith(f"{prefix}000001")
    # The rows are gone now: a listing that had read them all up front would still print them;
    # a streaming one prints what is left of the page it holds, then stops.
    _sql(database, "DELETE FROM django_keel_lock_lock WHERE key LIKE %s", (prefix + "%",))
    rest = list(lines)
    assert len(rest) < PAGE_SIZE + 1
    assert rest[-1] == f"{len(rest)} holders in store {alias!r} with prefix {prefix!r}."


class _Sink(io.TextIOBase):
    """A stdout that counts lines and keeps only the last (so it holds no output itself)."""

    def __init__(self) -> None:
        self.lines = 0
        self.last = ""

    def write(self, text: str) -> int:
        self.lines += text.count("\n")
        self.last = text or self.last
        return len(text)


@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_list_memory_stays_bounded(many_locks: tuple[str, str, str], as_json: bool) -> None:
    alias, _, prefix = many_locks
    sink = _Sink()
    args = ["list", "--store", alias, "--prefix", prefix] + (["--json"] if as_json else [])
    tracemalloc.start()
    try:
        call_command("locks", *args, stdout=sink)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sink.lines == MANY + (0 if as_json else 2)
    if not as_json:
        assert sink.last.startswith(f"{MANY} holders")
    # All rows at once would be ~10 MB of LockInfo and strings; a page is a few hundred KB.
    assert peak < 3_000_000, f"peak {peak / 1e6:.1f} MB"


# -- show -----------------------------------------------------------------------------------
@pytest.mark.parametrize("store_alias", ALL_STORES)
def test_show_one_lock_without_its_owner_token(store_alias: str, key: str) -> None:
    with held_elsewhere(store_alias, key, ttl=30) as held:
        owner = get_lock_store(store_alias).get(key).owner  # type: ignore[union-attr]
        text = run("show", key, "--store", store_alias)
        data = json.loads(run("show", key, "--store", store_alias, "--json"))
        listed = run("list", "--store", store_alias, "--prefix", key)
        listed += run("list", "--store", store_alias, "--prefix", key, "--json")
    fields = dict(line.split(":", 1) for line in text.splitlines())
    assert fields["key"].strip() == key
    assert fields["store"].strip() == store_alias
    assert int(fields["fence"]) == held["fence"]
    assert data["key"] == key and data["store"] == store_alias and data["fence"] == held["fence"]
    assert "owner" not in fields and "owner" not in data
    for output in (text, json.dumps(data), listed):
        assert owner not in output
    error = fails("show", key, "--store", store_alias)
    assert error.returncode == 1
    assert "not held" in str(error)


def test_show_owner_prints_the_owner_token_when_asked(key: str) -> None:
    handle = lock(key, store="memory")
    assert handle.acquire()
    text = run("show", key, "--store", "memory", "--show-owner")
    data = json.loads(run("show", key, "--store", "memory", "--json", "--show-owner"))
    fields = {name: value.strip() for name, value in (line.split(":", 1) for line in
                                                       text.splitlines())}  # fmt: skip
    assert fields["owner"] == handle.owner
    assert data["owner"] == handle.owner
    assert handle.release()


# -- release --------------------------------------------------------------------------------
@pytest.mark.parametrize("store_alias", ALL_STORES)
def test_release_yes_frees_a_lock_held_by_another_process(store_alias: str, key: str) -> None:
    with held_elsewhere(store_alias, key, ttl=30) as held:
        out = run("release", key, "--store", store_alias, "--yes")
        assert f"Released {key!r}" in out and f"fence {held['fence']}" in out
        assert not lock(key, store=store_alias).is_locked()
        taker = lock(key, store=store_alias)
        assert taker.acquire()
        assert taker.release()
    error = fails("release", key, "--store", store_alias, "--yes")
    assert error.returncode == 1


def test_release_asks_first(key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    holder = lock(key, store="memory", holder="worker-7:99")
    assert holder.acquire()
    monkeypatch.setattr("sys.stdin", io.StringIO("n\n"))
    error = fails("release", key, "--store", "memory")
    assert error.returncode == 1 and "Not released" in str(error)
    assert holder.info() is not None
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # no terminal, no answer: not released
    assert fails("release", key, "--store", "memory").returncode == 1
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n"))
    assert "Released" in run("release", key, "--store", "memory")
    assert holder.info() is None
    assert holder.release() is False  # the holder finds out it lost the lock


# -- prune ----------------------------------------------------------------------------------
REDIS_STORES = [alias for alias in STORE_AVAILABILITY if alias.startswith("redis")]


@pytest.mark.parametrize(
    "store_alias", store_params([a for a in STORE_AVAILABILITY if a not in REDIS_STORES])
)
def test_prune_deletes_expired_entries_and_says_how_many(store_alias: str, key: str) -> None:
    store = get_lock_store(store_alias)
    store.prune()
    for n in range(3):
        assert lock(f"{key}:{n}", store=store_alias, ttl=0.2).acquire()
    keeper = lock(f"{key}:live", store=store_alias, ttl=60)
    assert keeper.acquire()
    time.sleep(0.4)
    out = run("prune", "--store", store_alias)
    count = int(out.split()[1])
    # SQLite keeps the row with the highest fence (it is the fence counter).
    assert count >= 2
    assert out == f"Pruned {count} expired locks from store {store_alias!r}.\n"
    assert store.prune() == 0
    assert keeper.is_locked()
    assert keeper.release()


@pytest.mark.parametrize("store_alias", store_params(REDIS_STORES))
def test_prune_on_redis_says_the_store_expires_locks_itself(store_alias: str, key: str) -> None:
    assert lock(f"{key}:short", store=store_alias, ttl=0.2).acquire()
    keeper = lock(f"{key}:live", store=store_alias, ttl=60)
    assert keeper.acquire()
    time.sleep(0.4)
    out = run("prune", "--store", store_alias)
    assert out == (
        f"Store {store_alias!r} (RedisLockStore) deletes expired locks by itself: "
        "nothing to prune.\n"
    )
    assert get_lock_store(store_alias).get(f"{key}:short") is None
    assert keeper.is_locked()
    assert keeper.release()


# -- errors and exit codes ------------------------------------------------------------------
@pytest.mark.parametrize(
    "args", [["list"], ["show", "k"], ["release", "k", "--yes"], ["prune"]], ids=str
)
def test_unknown_alias_is_exit_code_2(args: list[str]) -> None:
    error = fails(*args, "--store", "nope")
    assert error.returncode == 2
    assert "unknown store alias 'nope'" in str(error) and "memory" in str(error)


@override_settings(KEEL_LOCK_STORES={**conf.STORES, **DOWN_STORES})
# Not prune: the "down" store is Redis, which prunes nothing and so never calls the server.
@pytest.mark.parametrize("args", [["list"], ["show", "k"], ["release", "k", "--yes"]], ids=str)
def test_store_outage_is_exit_code_3(args: list[str]) -> None:
    error = fails(*args, "--store", "down")
    assert error.returncode == 3
    assert "store 'down' is unavailable" in str(error)


@override_settings(KEEL_LOCK_STORES={**conf.STORES, **DOWN_STORES})
@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_list_on_a_store_that_is_down_prints_nothing_before_failing(as_json: bool) -> None:
    out = io.StringIO()
    with pytest.raises(CommandError) as info:
        call_command("locks", "list", "--store", "down", *(["--json"] if as_json else []),
                     stdout=out, stderr=io.StringIO())  # fmt: skip
    assert info.value.returncode == 3
    assert out.getvalue() == ""  # not a table header that reads as "no locks"


def test_bad_key_is_a_usage_error(key: str) -> None:
    error = fails("show", "x" * 300, "--store", "sqlite")
    assert error.returncode == 2 and "at most 255" in str(error)


@needs_store("postgres")
def test_exit_codes_from_the_command_line(key: str) -> None:
    with held_elsewhere("postgres", key, ttl=30):
        shown = manage("locks", "show", key, "--store", "postgres")
        assert shown.returncode == 0 and key in shown.stdout
        declined = manage("locks", "release", key, "--store", "postgres", input="n\n")
        assert declined.returncode == 1 and "Not released" in declined.stderr
        assert lock(key, store="postgres").is_locked()
        released = manage("locks", "release", key, "--store", "postgres", input="y\n")
        assert released.returncode == 0, released.stderr
        assert not lock(key, store="postgres").is_locked()
    again = manage("locks", "release", key, "--store", "postgres", "--yes")
    assert again.returncode == 1 and "not held" in again.stderr
    unknown = manage("locks", "list", "--store", "nope")
    assert unknown.returncode == 2 and "unknown store alias" in unknown.stderr
    usage = manage("locks", "frobnicate")
    assert usage.returncode == 2


@pytest.mark.parametrize("store_alias", store_params(["sqlite", "postgres", "mariadb", "redis"]))
def test_list_prefix_of_bytes_that_are_not_utf8_is_a_usage_error_naming_it(
    store_alias: str,
) -> None:
    # As a shell passes `--prefix $'\xff'`: Python keeps the byte as a surrogate, no store can
    # encode it.
    argv = [sys.executable, "-c", MANAGE, "locks", "list", "--store", store_alias, "--prefix"]
    done = subprocess.run([*argv, b"inv\xff"], cwd=ROOT, env=child_env(), capture_output=True,
                          timeout=60)  # fmt: skip
    stderr = done.stderr.decode()
    assert done.returncode == 2, stderr
    assert "Traceback" not in stderr
    assert "bad --prefix 'inv\\udcff': no lock key starts with it" in stderr
    assert "encodable as UTF-8" in stderr
    assert done.stdout == b""


@pytest.mark.parametrize("store_alias", ALL_STORES)
def test_list_prefix_with_a_nul_is_a_usage_error_naming_it(store_alias: str) -> None:
    error = fails("list", "--store", store_alias, "--prefix", "invoice:\x00")
    assert error.returncode == 2
    assert str(error).startswith("bad --prefix 'invoice:\\x00': no lock key starts with it")
    assert "control characters" in str(error)


def test_django_common_options_are_taken_after_the_action(key: str) -> None:
    listed = manage("locks", "list", "--store", "memory", "--settings", "tests.settings",
                    "--traceback", "-v", "2", "--no-color")  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[-1] == "0 holders in store 'memory'."
    # --traceback after the action does what it does before it: the error's traceback.
    failed = manage("locks", "show", key, "--store", "nope", "--traceback")
    assert failed.returncode != 0 and "Traceback" in failed.stderr
    assert "unknown store alias 'nope'" in failed.stderr


def test_release_after_confirming_leaves_a_holder_that_took_over_meanwhile(
    key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = lock(key, store="memory", ttl=30)
    assert first.acquire()
    second = lock(key, store="memory", ttl=30)

    def answer_after_a_takeover(question: str) -> str:
        assert f"fence {first.fence}" in question
        assert first.release() and second.acquire()  # someone else took it while we asked
        return "y"

    monkeypatch.setattr("builtins.input", answer_after_a_takeover)
    error = fails("release", key, "--store", "memory")
    assert error.returncode == 1 and "taken again" in str(error)
    assert second.info() is not None and second.info().owner == second.owner  # type: ignore[union-attr]
    assert second.release()


@override_settings(KEEL_LOCK_STORES={**conf.STORES, "broken": {"BACKEND": "no.such.Backend"}})
def test_a_broken_alias_does_not_break_commands_on_the_others(key: str) -> None:
    assert lock(key, store="memory").acquire()
    assert key in run("list", "--store", "memory")
    error = fails("list", "--store", "broken")
    assert error.returncode == 2 and "cannot be imported" in str(error)


def test_list_and_show_escape_control_characters_written_by_another_client(key: str) -> None:
    # A row written straight into the table (an older version, another tool): ESC [ 2 J
    # would clear the operator's terminal, the newline would forge a second row.
    evil_key, evil_holder = f"{key}:\x1b[2J", "web-1:1\nFAKE  ROW"
    path = connections["default"].settings_dict["NAME"]
    with sqlite3.connect(path) as raw:
        raw.execute(
            "INSERT INTO django_keel_lock_lock (key, owner, holder, fence, acquired_at, "
            "expires_at) VALUES (?, 'x', ?, 1, datetime('now'), datetime('now', '+60 seconds'))",
            (evil_key, evil_holder),
        )
    try:
        listed = run("list", "--store", "sqlite", "--prefix", key)
        assert "\x1b" not in listed and "\\x1b[2J" in listed
        assert "FAKE" in listed and len(listed.splitlines()) == 3  # header, one row, summary
        assert "web-1:1\\nFAKE" in listed
    finally:
        with sqlite3.connect(path) as raw:
            raw.execute("DELETE FROM django_keel_lock_lock WHERE key = ?", (evil_key,))


# -- semaphores and shared locks ----------------------------------------------------------
@pytest.mark.parametrize("store_alias", ALL_STORES)
def test_list_and_show_give_each_permit_with_its_mode(store_alias: str, key: str) -> None:
    permits = [semaphore(key, limit=3, ttl=ttl, store=store_alias) for ttl in (30, 20)]
    assert all(p.acquire() for p in permits)
    table = run("list", "--store", store_alias, "--prefix", key).splitlines()
    listed = sorted((int(row.split()[0]), row.split()[1]) for row in table[1:3])
    assert listed == sorted((p.fence, "semaphore") for p in permits)  # type: ignore[misc]
    assert table[3] == f"2 holders in store {store_alias!r} with prefix {key!r}."
    shown = run("show", key, "--store", store_alias)
    assert shown.count("mode:       semaphore") == 2
    assert [line.split()[1] for line in shown.splitlines() if line.startswith("fence:")] == [
        str(permits[1].fence),  # soonest expiry first
        str(permits[0].fence),
    ]
    data = json.loads(run("show", key, "--store", store_alias, "--json"))
    assert data["fence"] == permits[1].fence and data["mode"] == "semaphore"
    assert [h["fence"] for h in data["holders"]] == [permits[1].fence, permits[0].fence]
    assert "owner" not in data and all("owner" not in h for h in data["holders"])


@pytest.mark.parametrize("store_alias", ALL_STORES)
def test_release_fence_frees_one_permit_and_release_yes_frees_every_holder(
    store_alias: str, key: str
) -> None:
    readers = [lock(key, shared=True, store=store_alias, ttl=30) for _ in range(3)]
    assert all(r.acquire() for r in readers)
    out = run("release", key, "--store", store_alias, "--fence", str(readers[1].fence), "--yes")
    assert f"fence {readers[1].fence}" in out and "shared" in out
    assert not readers[1].is_owned() and readers[0].is_owned() and readers[2].is_owned()
    error = fails("release", key, "--store", store_alias, "--fence", str(readers[1].fence))
    assert error.returncode == 1 and f"no holder with fence {readers[1].fence}" in str(error)
    out = run("release", key, "--store", store_alias, "--yes")
    assert out.count("Released") == 2
    assert readers[0].holders() == []


# -- several keys held together (a multi-key lock) ------------------------------------------
def _take_together(store_alias: str, keys: tuple[str, ...], holder: str = "web-3:77") -> str:
    """Take `keys` for one owner at once, as a multi-key lock does; its owner."""
    owner = uuid.uuid4().hex
    store = get_lock_store(store_alias)
    assert store.acquire_many(tuple(sorted(keys)), owner, holder, 30).acquired
    return owner


@pytest.mark.parametrize("store_alias", ALL_STORES)
def test_list_shows_keys_held_together_as_one_holder(store_alias: str, key: str) -> None:
    owner = _take_together(store_alias, (f"{key}:b", f"{key}:a"))
    alone = lock(f"{key}:c", store=store_alias)
    assert alone.acquire()
    try:
        lines = run("list", "--store", store_alias, "--prefix", key).splitlines()
    finally:
        get_lock_store(store_alias).release_many((f"{key}:a", f"{key}:b"), owner)
        alone.release()
    assert [line.split()[-1] for line in lines[1:4]] == [f"{key}:a", f"{key}:b", f"{key}:c"]
    assert lines[4] == f"Held together by web-3:77: {key}:a + {key}:b"
    assert lines[5] == (
        f"2 holders in store {store_alias!r} with prefix {key!r} (1 of them holds several keys)."
    )
    assert owner not in "\n".join(lines)


@pytest.mark.parametrize("store_alias", store_params(["memory", "postgres", "redis"]))
def test_show_names_the_keys_held_with_it(store_alias: str, key: str) -> None:
    owner = _take_together(store_alias, (f"{key}:a", f"{key}:b", f"{key}:c"))
    try:
        text = run("show", f"{key}:b", "--store", store_alias)
        data = json.loads(run("show", f"{key}:b", "--store", store_alias, "--json"))
    finally:
        get_lock_store(store_alias).release_many((f"{key}:a", f"{key}:b", f"{key}:c"), owner)
    fields = {name: value.strip() for name, value in (line.split(":", 1) for line in
                                                       text.splitlines())}  # fmt: skip
    assert fields["with"] == f"{key}:a + {key}:c"
    assert data["with"] == [f"{key}:a", f"{key}:c"]
    assert data["holders"][0]["with"] == [f"{key}:a", f"{key}:c"]
    assert owner not in text and owner not in json.dumps(data)


def test_show_of_a_single_key_lock_names_no_other_key(key: str) -> None:
    handle = lock(key, store="memory")
    assert handle.acquire()
    data = json.loads(run("show", key, "--store", "memory", "--json"))
    assert "with" not in data and "with" not in run("show", key, "--store", "memory")
    assert handle.release()


@pytest.mark.parametrize("store_alias", store_params(["memory", "sqlite", "redis"]))
def test_release_of_one_key_frees_every_key_of_its_holder(store_alias: str, key: str) -> None:
    keys = (f"{key}:a", f"{key}:b")
    _take_together(store_alias, keys)
    out = run("release", f"{key}:a", "--store", store_alias, "--yes")
    assert f"Released {key + ':a'!r}" in out and f"Released {key + ':b'!r}" in out
    assert "held together" in out
    for each in keys:
        assert not lock(each, store=store_alias).is_locked()


def test_release_asks_about_every_key_of_the_holder(
    key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    owner = _take_together("memory", (f"{key}:a", f"{key}:b"))
    asked: list[str] = []
    monkeypatch.setattr("builtins.input", lambda question: asked.append(question) or "n")
    error = fails("release", f"{key}:b", "--store", "memory")
    assert error.returncode == 1
    assert f"with {key}:a" in asked[0] and "released too" in asked[0]
    assert lock(f"{key}:a", store="memory").is_locked()
    get_lock_store("memory").release_many((f"{key}:a", f"{key}:b"), owner)
