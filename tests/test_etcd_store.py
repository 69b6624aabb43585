"""The etcd store beyond the contract suite: processes excluding each other, the key layout,
what it refuses (semaphores, shared locks), and its settings checks (E013, E010)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test.utils import override_settings

from django_keel_lock import get_lock_store, lock, semaphore
from django_keel_lock.checks import check_stores
from django_keel_lock.stores import EtcdLockStore
from tests.support import ROOT

BACKEND = "django_keel_lock.stores.EtcdLockStore"


def test_processes_take_turns_and_every_fence_is_new(
    etcd_alias: str, key: str, tmp_path: Any
) -> None:
    """Three processes add one to a file under the lock, 15 times each: a lost update means
    two holders at once. Every acquisition's fence is distinct and each process's increase."""
    counter = tmp_path / "counter"
    counter.write_text("0")
    endpoints = ",".join(get_lock_store(etcd_alias).options["ENDPOINTS"])
    children = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.support.etcd",
                "count",
                "--endpoints",
                endpoints,
                "--key",
                key,
                "--iterations",
                "15",
                "--counter",
                str(counter),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        for _ in range(3)
    ]
    fences: list[int] = []
    for child in children:
        out, _ = child.communicate(timeout=90)
        assert child.returncode == 0
        mine = json.loads(out.strip().splitlines()[-1])["fences"]
        assert mine == sorted(mine)
        fences.extend(mine)
    assert counter.read_text() == "45"
    assert len(set(fences)) == 45


def test_semaphores_and_shared_locks_are_refused_naming_the_store(etcd_alias: str) -> None:
    with pytest.raises(ValueError, match="EtcdLockStore"):
        semaphore("etcd-sem", limit=2, store=etcd_alias).acquire()
    with pytest.raises(ValueError, match="EtcdLockStore"):
        lock("etcd-shared", shared=True, store=etcd_alias).acquire()


def test_a_lock_is_two_keys_under_the_prefix_and_the_fence_is_the_write_revision(
    etcd_alias: str, key: str
) -> None:
    store = get_lock_store(etcd_alias)
    assert isinstance(store, EtcdLockStore)
    with lock(key, store=etcd_alias, ttl=30) as held:
        reply = store.client.call("/v3/kv/range", {"key": _b64(f"keel-lock/lock/{key}")})
        (found,) = reply["kvs"]
        assert int(found["create_revision"]) == held.fence
        assert int(found["lease"]) != 0  # bound to a lease: etcd deletes it at its ttl
    reply = store.client.call("/v3/kv/range", {"key": _b64(f"keel-lock/info/{key}")})
    assert "kvs" not in reply  # released: both keys went


def _b64(text: str) -> str:
    import base64

    return base64.b64encode(text.encode()).decode()


# -- settings -------------------------------------------------------------------------------
def _messages(options: dict[str, Any]) -> list[tuple[str, str]]:
    return [(m.id or "", m.msg) for m in EtcdLockStore.check_config("locks", options)]


@pytest.mark.parametrize(
    ("endpoints", "says"),
    [
        ("http://127.0.0.1:2379", "must be a list of URLs"),
        ([], "is empty"),
        ([2379], "each must be a URL"),
        (["127.0.0.1:2379"], "scheme must be http or https"),
        (["http://127.0.0.1"], "names no port"),
        (["http://:2379"], "names no host"),
        (["http://u:p@127.0.0.1:2379"], "credentials go in OPTIONS USER and PASSWORD"),
        (["http://127.0.0.1:2379/v3"], "without a path"),
        (["http://127.0.0.1:99999"], "names no port"),
        (["http://127.0.0.1:2379", "http://127.0.0.1:2379/"], "names a member twice"),
    ],
)
def test_each_bad_endpoints_setting_is_a_check_error_saying_what_is_wrong(
    endpoints: object, says: str
) -> None:
    ((check_id, message),) = _messages({"ENDPOINTS": endpoints})
    assert check_id == "django_keel_lock.E013"
    assert "KEEL_LOCK_STORES['locks'] OPTIONS ENDPOINTS" in message and says in message
    with pytest.raises(ImproperlyConfigured, match=says):  # and building the store refuses
        EtcdLockStore("locks", {"ENDPOINTS": endpoints})


def test_other_bad_options_are_check_errors_and_good_ones_pass(tmp_path: Any) -> None:
    assert _messages({"ENDPOINTS": ["http://10.0.0.1:2379", "https://[::1]:2379"]}) == []
    assert [i for i, _ in _messages({})] == ["django_keel_lock.E013"]
    found = _messages(
        {
            "ENDPOINTS": ["https://10.0.0.1:2379"],
            "KEY_PREFIX": 7,
            "CA_FILE": str(tmp_path / "missing.pem"),
            "KEY_FILE": str(tmp_path),
            "USER": "root",
            "SOCKET_TIMEOUT": -1,
        }
    )
    ids = [check_id for check_id, _ in found]
    assert ids == ["django_keel_lock.E013"] * 5 + ["django_keel_lock.E010"]
    text = " ".join(message for _, message in found)
    for says in ("KEY_PREFIX must be a str", "CA_FILE", "is not a file", "KEY_FILE without"):
        assert says in text
    assert "one of USER and PASSWORD" in text and "SOCKET_TIMEOUT" in text


def test_manage_py_check_reports_the_etcd_store_settings() -> None:
    stores = {
        "default": {"BACKEND": "django_keel_lock.stores.MemoryLockStore"},
        "etcd": {"BACKEND": BACKEND, "OPTIONS": {"ENDPOINTS": ["etcd:2379"]}},
    }
    with override_settings(KEEL_LOCK_STORES=stores):
        found = [m for m in check_stores() if m.id == "django_keel_lock.E013"]
    assert len(found) == 1 and "'etcd:2379' is not a member's client URL" in found[0].msg


# -- manage.py locks and the admin ------------------------------------------------------------
def test_manage_py_locks_lists_shows_and_releases_an_etcd_lock(etcd_alias: str, key: str) -> None:
    held = lock(key, store=etcd_alias, ttl=30, holder="web-7:1")
    assert held.acquire()
    table = _run_locks("list", "--store", etcd_alias, "--prefix", key).splitlines()
    fence, mode, expires, *_, holder, listed = table[1].split()
    assert (int(fence), mode, holder, listed) == (held.fence, "exclusive", "web-7:1", key)
    assert 28 <= float(expires.rstrip("s")) <= 30
    assert key in _run_locks("show", key, "--store", etcd_alias)
    _run_locks("release", key, "--store", etcd_alias, "--yes")
    assert not held.is_locked() and held.release() is False


@pytest.mark.django_db
def test_the_admin_lists_etcd_locks_with_the_store_note(
    etcd_alias: str, key: str, admin_client: Any
) -> None:
    with lock(key, store=etcd_alias, ttl=30, holder="web-8:2") as held:
        html = admin_client.get("/admin/django_keel_lock/lock/stores/").content.decode()
        part = html[html.index(f'data-store="{etcd_alias}"') :]
        assert key in part and "web-8:2" in part and f">{held.fence}<" in part
        assert "Locks in etcd" in part  # EtcdLockStore.admin_note
        assert held.owner is not None and held.owner not in html


def _run_locks(*args: str) -> str:
    import io

    from django.core.management import call_command

    out = io.StringIO()
    call_command("locks", *args, stdout=out, stderr=io.StringIO())
    return out.getvalue()


# -- leader election ----------------------------------------------------------------------------
def test_an_election_on_etcd_hands_leadership_on_with_a_greater_term(
    etcd_alias: str, key: str
) -> None:
    import threading

    from django_keel_lock import election

    leader = election(key, ttl=5, store=etcd_alias, holder="one:1")
    other = election(key, ttl=5, store=etcd_alias, holder="two:2")
    term = leader.campaign()
    found = other.current()
    assert found is not None and (found.holder, found.term) == ("one:1", term)
    terms: list[int] = []
    waiting = threading.Thread(target=lambda: terms.append(other.campaign(timeout=10)))
    waiting.start()
    time.sleep(0.3)
    assert not terms
    started = time.monotonic()
    assert leader.resign()
    waiting.join(10)
    assert terms and terms[0] > term and other.is_leader()
    assert time.monotonic() - started < 2  # woken by the watch, not by the ttl
    assert other.resign()


# -- idempotent results -------------------------------------------------------------------------
def test_run_once_on_etcd_runs_once_and_answers_the_duplicate_with_the_kept_result(
    etcd_alias: str, key: str
) -> None:
    from django_keel_lock import run_once

    calls: list[int] = []

    def charge() -> dict[str, int]:
        calls.append(1)
        return {"charged": 42}

    assert run_once(key, charge, store=etcd_alias, ttl=60) == (True, {"charged": 42})
    assert run_once(key, charge, store=etcd_alias, ttl=60) == (False, {"charged": 42})
    assert calls == [1]


def test_etcd_results_are_fenced_listed_forgotten_and_expire(etcd_alias: str, key: str) -> None:
    from django_keel_lock.idempotency.storage import result_store_for
    from django_keel_lock.stores.results import StoredResult

    store, results = get_lock_store(etcd_alias), result_store_for(etcd_alias)
    answer = StoredResult(key, "fp", 0, 200, b"\x00ok")
    old = store.acquire(key, "owner-a", "a", 30).fence
    assert old is not None
    assert results.save(key, "owner-a", old, answer, 60)
    assert not results.save(key, "owner-a", old, answer, 60)  # never over the same fence
    assert store.force_release(key) is not None
    new = store.acquire(key, "owner-b", "b", 30).fence
    assert new is not None and new > old
    assert not results.save(key, "owner-a", old, answer, 60)  # a holder that lost its lock
    assert results.save(key, "owner-b", new, answer, 1)
    kept = results.get(key)
    assert kept is not None and (kept.fence, kept.status, kept.data) == (new, 200, b"\x00ok")
    assert [each.key for each in results.iter_results(key)] == [key]
    time.sleep(1 + store.expiry_slack)  # its lease (1 s) runs out
    assert results.get(key) is None
    assert results.save(key, "owner-b", new, answer, 60) and results.forget(key)
    assert results.get(key) is None and not results.forget(key)
    assert store.release(key, "owner-b")
