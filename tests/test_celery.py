"""locked_task: in-process behaviour, then a real prefork Celery worker on each broker.

The worker tests run once per broker, Redis and RabbitMQ: each time they start `celery worker
--pool=prefork --concurrency=4` as a subprocess (Redis as result backend, DB 5, a queue named
after the test run) on tests/support/worker_settings.py, so its four processes take locks in the
same test database as this process.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from celery import Celery, Task, shared_task
from celery import _state as celery_state
from celery.exceptions import Retry
from django.test import override_settings
from kombu.exceptions import OperationalError

from django_keel_lock import (
    AlreadyQueued,
    LockError,
    LockStoreUnavailable,
    LockUnavailable,
    get_lock_store,
    lock,
)
from django_keel_lock.conf import conf
from django_keel_lock.contrib import celery as contrib_celery
from django_keel_lock.contrib.celery import CLAIM_SUFFIX, current_lock, locked_task
from tests.conftest import require_reachable
from tests.support import ROOT
from tests.support import celery_tasks as tasks
from tests.support.celery_app import BROKERS, QUEUE, REDIS_URL, RUN_ID, STORE, app_for
from tests.support.hidden import check_needs_extra
from tests.support.workers import stop as _stop

# -- in-process: an eager app on the per-process memory store ------------------------------

eager = Celery(
    "keel-lock-eager", set_as_current=False, broker="memory://", backend="cache+memory://"
)
eager.conf.task_always_eager = True
calls: list[tuple[Any, ...]] = []


@eager.task(bind=True, max_retries=2)
@locked_task("job:{name}:{n}", store="memory", on_locked="retry")
def retrying(self: Task, name: str, n: int = 1) -> str:
    calls.append((name, n))
    return f"ran {name}"


@eager.task(bind=True)
@locked_task("job:{name}:{n}", store="memory", on_locked="skip", ttl="5m")
def skipping(self: Task, name: str, n: int = 1) -> dict[str, Any]:
    held = current_lock()
    assert held is not None
    return {"key": held.key, "fence": held.fence, "holder": held.holder, "ttl": held.ttl}


@eager.task(bind=True)
@locked_task("job:{name}:{n}", store="memory", on_locked="raise")
def raising(self: Task, name: str, n: int = 1) -> str:
    return "ran"


@eager.task
@locked_task(lambda name: f"job:{name}:1", store="memory", on_locked="skip")
def unbound(name: str) -> str:
    return f"ran {name}"


@eager.task(bind=True)
@locked_task("job:{self.name}", store="memory")
def by_task_name(self: Task) -> str:
    held = current_lock()
    assert held is not None
    return held.key


@eager.task(bind=True)
@locked_task(["acct:{target}", "acct:{source}"], store="memory", on_locked="skip")
def transfer(self: Task, source: int, target: int) -> dict[str, Any]:
    held = current_lock()
    assert held is not None
    return {"keys": list(held.keys), "fences": held.fences}


def test_a_list_of_templates_takes_every_key_for_the_run_or_skips(key: str) -> None:
    result = transfer.apply(args=(1, 2)).get()
    assert result["keys"] == ["acct:1", "acct:2"] and set(result["fences"]) == set(result["keys"])
    assert get_lock_store("memory").get("acct:1") is None
    with lock("acct:2", store="memory"):
        assert transfer.apply(args=(1, 2)).get() is None
    assert get_lock_store("memory").get("acct:1") is None  # all or nothing


def test_dedupe_with_a_list_of_templates_is_refused_naming_it() -> None:
    with pytest.raises(TypeError, match="dedupe= takes one key template"):
        locked_task(["a:{x}", "b:{x}"], dedupe="queued")


def test_key_is_formatted_from_the_task_arguments_and_the_lock_is_released() -> None:
    result = skipping.apply(args=("a",), kwargs={"n": 7}).get()
    assert result["key"] == "job:a:7"
    assert result["ttl"] == 300
    assert get_lock_store("memory").get("job:a:7") is None
    assert current_lock() is None


def test_key_template_can_use_the_bound_task_itself() -> None:
    assert by_task_name.apply().get() == f"job:{by_task_name.name}"


def test_unbound_task_with_a_callable_key() -> None:
    assert unbound.apply(args=("u",)).get() == "ran u"
    with lock("job:u:1", store="memory"):
        assert unbound.apply(args=("u",)).get() is None


def test_default_holder_names_the_task_and_its_id() -> None:
    result = skipping.apply(args=("h",), task_id="task-id-123").get()
    assert result["holder"].endswith(f" {skipping.name}[task-id-123]")
    assert result["holder"].split()[0].endswith(f":{os.getpid()}")


def test_skip_returns_none_and_logs_who_holds_it(caplog: pytest.LogCaptureFixture) -> None:
    with lock("job:s:1", store="memory", holder="someone-else"):
        with caplog.at_level(logging.INFO, logger="django_keel_lock.celery"):
            result = skipping.apply(args=("s",))
    assert result.state == "SUCCESS"
    assert result.get() is None
    (record,) = [r for r in caplog.records if r.name == "django_keel_lock.celery"]
    assert record.levelno == logging.INFO
    assert "job:s:1" in record.getMessage()
    assert "someone-else" in record.getMessage()


def test_raise_raises_lock_unavailable_naming_the_key() -> None:
    with lock("job:r:1", store="memory"):
        result = raising.apply(args=("r",))
    assert result.state == "FAILURE"
    assert isinstance(result.result, LockUnavailable)
    assert result.result.key == "job:r:1"
    assert raising.apply(args=("r",)).get() == "ran"


def test_retry_uses_the_holders_remaining_time_as_countdown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[dict[str, Any]] = []

    def fake_retry(self: Task, **options: Any) -> Retry:
        seen.append(options)
        return Retry("retry later")

    monkeypatch.setattr(Task, "retry", fake_retry)
    with lock("job:c:1", store="memory", ttl=2.5):
        result = retrying.apply(args=("c",))
    assert result.state == "RETRY"
    (options,) = seen
    assert options["countdown"] == 3  # 2.5 s left, rounded up
    assert isinstance(options["exc"], LockUnavailable)


def test_retry_gives_up_with_lock_unavailable_after_max_retries() -> None:
    calls.clear()
    with lock("job:m:1", store="memory", ttl=60):
        result = retrying.apply(args=("m",))
    assert result.state == "FAILURE"
    assert isinstance(result.result, LockUnavailable)
    assert calls == []
    assert retrying.apply(args=("m",)).get() == "ran m"
    assert calls == [("m", 1)]


def test_explicit_countdown_is_passed_to_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, Any]] = []

    @eager.task(bind=True, name="fixed_countdown")
    @locked_task("job:{name}", store="memory", on_locked="retry", countdown="1500ms")
    def fixed(self: Task, name: str) -> None:
        return None

    def fake_retry(self: Task, **options: Any) -> Retry:
        seen.append(options)
        return Retry("retry later")

    monkeypatch.setattr(Task, "retry", fake_retry)
    with lock("job:f", store="memory"):
        fixed.apply(args=("f",))
    assert seen[0]["countdown"] == 1.5


def test_celery_checks_call_arguments_against_the_task_signature() -> None:
    with pytest.raises(TypeError):
        skipping.apply_async(args=("a", 1, "too many"))


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"on_locked": "wait"}, "on_locked must be one of skip, raise, retry"),
        ({"ttl": -1}, "ttl must be > 0"),
        ({"timeout": "soon"}, "timeout could not be parsed"),
        ({"countdown": 5}, "countdown= only applies"),
        ({"max_hold": "1h"}, "pass auto_extend=True"),
        ({"auto_extend": True, "max_hold": -1}, "max_hold must be > 0"),
    ],
)
def test_bad_options_fail_when_the_task_is_defined(options: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        locked_task("k", **options)


lazy_app = Celery("keel-lock-order-lazy", set_as_current=False, broker="memory://")
finalized_app = Celery("keel-lock-order-finalized", set_as_current=False, broker="memory://")
finalized_app.finalize()
MISORDERED = "locked_task must be applied below @shared_task/@app.task, not above"


@pytest.mark.parametrize(
    "task_decorator",
    [
        shared_task(name="keel-lock-order.shared"),  # a Proxy
        # A PromiseProxy: the app is not finalized yet.
        lazy_app.task(bind=True, name="keel-lock-order.lazy"),
        finalized_app.task(bind=True, name="keel-lock-order.app"),  # a Task instance
    ],
    ids=["shared_task", "app.task-lazy", "app.task"],
)
def test_locked_task_above_the_task_decorator_is_a_type_error_naming_the_order(
    task_decorator: Callable[[Callable[..., str]], Any],
) -> None:
    with pytest.raises(TypeError, match=MISORDERED) as info:

        @locked_task("job:order", store="memory")
        @task_decorator
        def misordered(self: Task) -> str:
            return "ran"

    assert "put @locked_task(...) on the line after @shared_task(...)" in str(info.value)


def test_locked_task_above_a_lazy_task_leaves_it_lazy() -> None:
    def body() -> str:
        return "ran"

    task = lazy_app.task(body)
    with pytest.raises(TypeError, match=MISORDERED):
        locked_task("job:order", store="memory")(task)
    assert not task.__evaluated__()  # the check looked at the proxy, not through it


def test_auto_extend_keeps_the_lock_of_a_long_task_alive() -> None:

    @eager.task(bind=True, name="extended")
    @locked_task("job:extended", store="memory", ttl=0.3, auto_extend=True, max_hold=30)
    def extended(self: Task) -> bool:
        held = current_lock()
        assert held is not None
        time.sleep(1.0)  # more than three ttls: only the watchdog keeps it
        return not held.is_expired()

    assert extended.apply().get() is True
    assert get_lock_store("memory").get("job:extended") is None


def test_the_app_imports_and_sets_up_without_celery_installed(tmp_path: Path) -> None:
    """Celery is an optional extra: only contrib.celery may import it."""
    others = """
import importlib, pkgutil
for info in pkgutil.walk_packages(django_keel_lock.__path__, "django_keel_lock."):
    if info.name == "django_keel_lock.contrib.celery":
        continue
    try:
        importlib.import_module(info.name)
    except ImportError as exc:  # a module of another optional extra (redis)
        if "celery" in str(exc):
            raise
"""
    hidden = ("celery", "kombu", "billiard")
    check_needs_extra("django_keel_lock.contrib.celery", "celery", hidden, tmp_path, others)


# -- dedupe, in-process: a broker nobody consumes, so a sent task stays queued ---------------

parked_app = Celery("keel-lock-parked", set_as_current=False, broker="memory://")
DOWN_STORES = {"down": {"BACKEND": "django_keel_lock.stores.RedisLockStore",
                        "OPTIONS": {"URL": "redis://127.0.0.1:1/0"}}}  # fmt: skip


@parked_app.task(bind=True, name="keel-lock-parked.report")
@locked_task("report:{date}", store="memory", dedupe="queued", dedupe_ttl=60)
def parked_report(self: Task, date: str) -> str:
    return date


def test_already_queued_is_a_lock_error_exported_from_both_modules() -> None:
    assert contrib_celery.AlreadyQueued is AlreadyQueued
    assert issubclass(AlreadyQueued, LockError)


def test_a_duplicate_send_returns_the_queued_tasks_result_and_sends_nothing() -> None:
    with parked_app.connection_for_write() as connection:
        queue = connection.default_channel.queue_declare("celery", passive=False)
        before = queue.message_count
    first = parked_report.delay("d1")
    again = parked_report.apply_async(("d1",))
    other = parked_report.delay("d2")
    with parked_app.connection_for_write() as connection:
        after = connection.default_channel.queue_declare("celery", passive=False).message_count
    assert again.id == first.id
    assert other.id != first.id
    assert after - before == 2
    claim = get_lock_store("memory").get("report:d1" + CLAIM_SUFFIX)
    assert claim is not None
    assert claim.holder == f"{parked_report.name}[{first.id}]"
    assert 59 < claim.expires_in <= 60  # dedupe_ttl, not the default ttl
    first.revoke()  # frees the claim at once
    assert get_lock_store("memory").get("report:d1" + CLAIM_SUFFIX) is None
    assert parked_report.delay("d1").id != first.id


def test_with_limit_2_two_are_queued_and_a_third_send_returns_the_newest() -> None:
    @parked_app.task(bind=True, name="keel-lock-parked.limited")
    @locked_task("export:{day}", store="memory", limit=2, dedupe="queued")
    def export(self: Task, day: str) -> str:
        return day

    first, second = export.delay("l1"), export.delay("l1")
    assert first.id != second.id
    assert export.delay("l1").id == second.id
    assert len(get_lock_store("memory").holders("export:l1" + CLAIM_SUFFIX)) == 2
    second.revoke()  # frees its own permit of the claim, not the first's
    third = export.delay("l1")
    assert third.id not in (first.id, second.id)
    assert export.delay("l1").id in (first.id, third.id)


def test_arguments_are_checked_before_a_claim_is_taken() -> None:
    with pytest.raises(TypeError, match="too many positional arguments"):
        parked_report.apply_async(("d3", "extra"))
    assert get_lock_store("memory").get("report:d3" + CLAIM_SUFFIX) is None


def test_a_broker_outage_while_sending_releases_the_claim() -> None:
    down = Celery("keel-lock-broker-down", set_as_current=False, broker="redis://127.0.0.1:1/0")
    down.conf.update(broker_connection_retry=False, task_publish_retry=False)

    @down.task(bind=True, name="keel-lock-broker-down.report")
    @locked_task("report:{date}", store="memory", dedupe="until_done")
    def unsent(self: Task, date: str) -> str:
        return date

    with pytest.raises(OperationalError):
        unsent.delay("b1")
    assert get_lock_store("memory").get("report:b1" + CLAIM_SUFFIX) is None


@override_settings(KEEL_LOCK_STORES={**conf.STORES, **DOWN_STORES})
def test_a_lock_store_outage_raises_from_delay() -> None:
    @parked_app.task(bind=True, name="keel-lock-parked.store-down")
    @locked_task("report:{date}", store="down", dedupe="queued")
    def unreachable(self: Task, date: str) -> str:
        return date

    with pytest.raises(LockStoreUnavailable):
        unreachable.delay("s1")


def test_eager_apply_async_runs_and_gives_the_claim_back() -> None:
    @eager.task(bind=True, name="eager_deduped")
    @locked_task("job:{name}", store="memory", dedupe="until_done")
    def deduped(self: Task, name: str) -> str:
        assert get_lock_store("memory").get(f"job:{name}{CLAIM_SUFFIX}") is not None
        return f"ran {name}"

    assert deduped.delay("e").get() == "ran e"
    assert get_lock_store("memory").get("job:e" + CLAIM_SUFFIX) is None


def test_dedupe_on_an_unbound_task_refuses_to_run_naming_bind() -> None:
    @eager.task(name="eager_unbound_deduped")
    @locked_task(lambda name: f"job:{name}", store="memory", dedupe="queued")
    def unbound_deduped(name: str) -> str:
        return name

    result = unbound_deduped.apply(args=("u",))
    assert result.state == "FAILURE"
    assert isinstance(result.result, TypeError)
    assert "bind=True" in str(result.result)


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"dedupe": "always"}, 'dedupe must be None, "queued" or "until_done"'),
        ({"dedupe": "queued", "on_duplicate": "skip"}, 'on_duplicate must be "return" or'),
        ({"on_duplicate": "raise"}, "only apply with dedupe="),
        ({"dedupe_ttl": 5}, "only apply with dedupe="),
        ({"dedupe": "queued", "dedupe_ttl": -1}, "dedupe_ttl must be"),
    ],
)
def test_bad_dedupe_options_fail_when_the_task_is_defined(
    options: dict[str, Any], error: str
) -> None:
    with pytest.raises(ValueError, match=error):
        locked_task("k", **options)


# -- a real worker --------------------------------------------------------------------------


class Worker:
    """A running `celery worker` subprocess and the app that sends to its broker (the current
    app while the worker runs, so `task.delay()` goes there)."""

    def __init__(self, app: Celery, proc: subprocess.Popen[bytes], log: Path, name: str) -> None:
        self.app = app
        self.proc = proc
        self.log = log
        self.name = name

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def queue_length(self, queue: str) -> int:
        """How many messages wait in `queue` on this worker's broker."""
        with self.app.connection_for_write() as connection:
            try:
                declared = connection.default_channel.queue_declare(queue, passive=True)
            except connection.channel_errors:
                return 0  # never declared (or, on Redis, an empty list)
            return int(declared.message_count)

    def delete_queue(self, queue: str) -> None:
        """Delete `queue`, its binding and the exchange of its name from the broker."""
        with self.app.connection_for_write() as connection:
            # Declared first, as Celery declares it: a virtual transport (Redis) deletes only
            # the bindings its channel knows of.
            bound = self.app.amqp.queues[queue](connection.default_channel)
            bound.declare()
            bound.delete()
            bound.exchange.delete()


BROKER_LABELS = {"redis": "Redis", "rabbitmq": "RabbitMQ"}


def _require(url: str, what: str) -> None:
    parts = urlsplit(url)
    default_port = 5672 if parts.scheme.startswith("amqp") else 6379
    require_reachable(parts.hostname or "127.0.0.1", parts.port or default_port, what)


@pytest.fixture(scope="module", params=list(BROKERS))
def worker(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, django_db_setup: None
) -> Iterator[Worker]:
    broker: str = request.param
    _require(REDIS_URL, "Redis (Celery results)")
    _require(BROKERS[broker], f"{BROKER_LABELS[broker]} (Celery broker)")
    log = tmp_path_factory.mktemp(f"celery-{broker}") / "worker.log"
    name = f"keel-{RUN_ID}-{broker}@{socket.gethostname()}"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.support.worker_settings",
        "KEEL_TEST_RUN_ID": RUN_ID,
        "KEEL_CELERY_BROKER_URL": BROKERS[broker],
        "CELERY_SKIP_CHECKS": "1",
        "PYTHONPATH": str(ROOT),
    }
    command = [
        *(sys.executable, "-m", "celery", "-A", "tests.support.celery_app", "worker"),
        *("--pool=prefork", "--concurrency=4", "-Q", QUEUE, "--loglevel=INFO"),
        *("--without-gossip", "--without-mingle", "--without-heartbeat"),
        *("-n", name),
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    sender = app_for(BROKERS[broker])
    previous = celery_state.get_current_app()
    sender.set_current()  # the shared tasks of celery_tasks now send to this broker
    started = Worker(sender, proc, log, name)
    try:
        pending = [tasks.ping.delay() for _ in range(8)]
        deadline = time.monotonic() + 30
        for result in pending:
            while not result.ready():
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"the Celery worker did not start:\n{started.output()[-4000:]}")
                time.sleep(0.05)
        yield started
    finally:
        _stop(proc)
        previous.set_current()
        started.delete_queue(QUEUE)
        client = tasks.provider()
        for key in client.scan_iter(f"keel-lock-test:{RUN_ID}-*"):
            client.delete(key)
        print(f"--- celery worker log ({broker}, tail) ---\n{started.output()[-3000:]}")


@pytest.fixture
def run() -> str:
    """A namespace for this test's invoices (keys and the provider's charge lists)."""
    return f"{RUN_ID}-{uuid.uuid4().hex[:8]}"


def charges(run: str, invoice_id: int) -> list[dict[str, Any]]:
    raw = tasks.provider().lrange(tasks.charges_key(run, invoice_id), 0, -1)
    return [json.loads(item) for item in raw]


def result_of(result: Any, timeout: float = 30) -> Any:
    return result.get(timeout=timeout, propagate=False)


def test_50_duplicate_charges_for_5_invoices_charge_each_exactly_once(
    worker: Worker, run: str
) -> None:
    jobs = [(invoice, n) for invoice in range(1, 6) for n in range(10)]
    random.Random(5).shuffle(jobs)
    started = time.monotonic()
    sent = [tasks.charge_invoice.delay(run, invoice, 0.3) for invoice, _ in jobs]
    results = [result_of(result, 60) for result in sent]
    assert all(result is None or isinstance(result, dict) for result in results), results

    for invoice in range(1, 6):
        assert len(charges(run, invoice)) == 1, f"invoice {invoice}: {charges(run, invoice)}"
    charged = [r for r in results if r and r["charged"]]
    skipped = [r for r in results if r is None]
    already = [r for r in results if r and not r["charged"]]
    assert len(charged) == 5
    assert len({r["fence"] for r in charged}) == 5
    assert len(skipped) + len(already) == 45
    assert skipped, "no duplicate ever met a held lock: the race did not happen"
    worked = {r["pid"] for r in results if r}
    assert len(worked) > 1, "only one worker process ran tasks"
    assert time.monotonic() - started < 45


def test_transfers_under_a_list_of_templates_lose_no_write_and_never_deadlock(
    worker: Worker, run: str
) -> None:
    """Both directions between two accounts at once (ABBA) across 4 worker processes."""
    sent = [
        tasks.transfer.delay(run, *((1, 2) if n % 2 else (2, 1)), amount=n) for n in range(1, 21)
    ]
    results = [result_of(result, 90) for result in sent]
    client = tasks.provider()
    balances = [int(client.get(tasks.balance_key(run, a)) or 0) for a in (1, 2)]
    moved = sum(n if n % 2 else -n for n in range(1, 21))
    assert balances == [-moved, moved]  # every transfer's two writes, none lost
    assert all(set(r["fences"]) == {f"account:{run}:1", f"account:{run}:2"} for r in results)
    assert len({r["pid"] for r in results}) > 1, "only one worker process ran transfers"


def test_without_the_lock_the_same_duplicates_double_charge(worker: Worker, run: str) -> None:
    """The control: the charge really is racy, so the test above would catch a broken lock."""
    sent = [tasks.charge_invoice_unlocked.delay(run, 1, 1.0) for _ in range(4)]
    for result in sent:
        result_of(result)
    assert len(charges(run, 1)) > 1


def test_skip_returns_none_and_logs_while_another_process_holds_the_lock(
    worker: Worker, run: str
) -> None:
    with lock(f"invoice:{run}:1", store=STORE, holder="the-test-process"):
        result = tasks.charge_invoice.delay(run, 1)
        assert result_of(result) is None
        assert result.state == "SUCCESS"
    assert charges(run, 1) == []
    deadline = time.monotonic() + 5
    while "the-test-process" not in worker.output() and time.monotonic() < deadline:
        time.sleep(0.1)
    line = next(line for line in worker.output().splitlines() if "the-test-process" in line)
    assert f"skipped {tasks.charge_invoice.name}[{result.id}]" in line
    assert f"invoice:{run}:1" in line


def test_raise_fails_the_task_with_lock_unavailable(worker: Worker, run: str) -> None:
    with lock(f"invoice:{run}:1", store=STORE):
        result = tasks.charge_or_raise.delay(run, 1)
        result_of(result)
    assert result.state == "FAILURE"
    assert type(result.result).__name__ == "LockUnavailable"
    # Once, and with its key: the result backend remakes it from its args (JSON).
    assert str(result.result).startswith(f"{tasks.charge_or_raise.name}: lock ")
    assert str(result.result).count(f"invoice:{run}:1") == 1
    assert result.result.key == f"invoice:{run}:1"
    assert charges(run, 1) == []
    assert result_of(tasks.charge_or_raise.delay(run, 1))["charged"] is True


def test_retry_runs_the_task_once_the_holder_lets_go(worker: Worker, run: str) -> None:
    held = lock(f"invoice:{run}:1", store=STORE, ttl=2)
    assert held.acquire()  # never released: it expires after 2 s
    started = time.monotonic()
    result = tasks.charge_with_retry.delay(run, 1)
    states = set()
    while not result.ready() and time.monotonic() - started < 30:
        states.add(result.state)
        time.sleep(0.05)
    outcome = result_of(result)
    assert "RETRY" in states
    assert outcome["charged"] is True
    assert outcome["retries"] >= 1
    assert outcome["fence"] > held.fence
    assert time.monotonic() - started >= 1.5  # countdown = the holder's 2 s, rounded up


def test_retry_gives_up_after_max_retries_with_lock_unavailable(worker: Worker, run: str) -> None:
    with lock(f"invoice:{run}:1", store=STORE, ttl=30):
        result = tasks.charge_retry_once.delay(run, 1)
        result_of(result)
    assert result.state == "FAILURE"
    assert type(result.result).__name__ == "LockUnavailable"
    assert charges(run, 1) == []
    assert f"retrying {tasks.charge_retry_once.name}[{result.id}]" in worker.output()


def test_sigkill_of_the_worker_process_holding_a_lock_frees_it_at_ttl(
    worker: Worker, run: str
) -> None:
    store = get_lock_store(STORE)
    key = f"invoice:{run}:1"
    doomed = tasks.charge_slowly.delay(run, 1, 60)  # ttl 4 s, would hold it for a minute
    deadline = time.monotonic() + 15
    while (info := store.get(key)) is None:
        assert time.monotonic() < deadline, worker.output()[-3000:]
        time.sleep(0.02)
    read_at = time.monotonic()
    pid = int(info.holder.split()[0].rsplit(":", 1)[1])
    assert pid not in (os.getpid(), worker.proc.pid)  # a pool process of the worker
    os.kill(pid, signal.SIGKILL)

    later = tasks.charge_with_retry.delay(run, 1)
    assert store.get(key) is not None, "the lock vanished before its ttl"
    while store.get(key) is not None:
        assert time.monotonic() - read_at < info.expires_in + 3, "the lock outlived its ttl"
        time.sleep(0.05)
    freed_after = time.monotonic() - read_at
    assert freed_after >= info.expires_in - 0.5

    outcome = result_of(later)
    assert outcome["charged"] is True
    assert outcome["retries"] >= 1
    assert outcome["fence"] > info.fence
    assert outcome["pid"] != pid
    assert len(charges(run, 1)) == 1
    result_of(doomed, 15)
    assert doomed.state == "FAILURE"  # WorkerLostError: the process died mid-task


def test_limit_2_runs_at_most_2_of_20_queued_tasks_at_once_across_4_workers(
    worker: Worker, run: str
) -> None:
    sent = [tasks.limited_export.delay(run, 0.2) for _ in range(20)]
    results = [result_of(result, 90) for result in sent]
    assert all(isinstance(r, dict) for r in results), results
    peak = max(r["inside"] for r in results)
    assert peak == 2, f"{peak} ran at once: " + str(sorted(r["inside"] for r in results))
    assert len({r["fence"] for r in results}) == 20  # a permit each, each its own fence
    assert len({r["pid"] for r in results}) > 2, "fewer than 3 worker processes ran them"
    assert int(tasks.provider().get(tasks.inside_key(run)) or 0) == 0


# -- dedupe with the real worker -------------------------------------------------------------


def runs(run: str) -> list[dict[str, Any]]:
    return [json.loads(item) for item in tasks.provider().lrange(tasks.runs_key(run), 0, -1)]


def open_gate(run: str) -> None:
    tasks.provider().set(tasks.gate_key(run), 1)


def wait_until(check: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"waited {seconds}s for {what}"
        time.sleep(0.02)


class Parked:
    """A queue of this test's own that the worker consumes only once `consume()` is called:
    what is sent there stays queued until then."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.name = f"{QUEUE}-parked-{uuid.uuid4().hex[:8]}"

    def consume(self) -> None:
        replies = self.worker.app.control.add_consumer(
            self.name, destination=[self.worker.name], reply=True, timeout=10
        )
        assert replies, f"worker {self.worker.name} did not answer add_consumer"

    def length(self) -> int:
        return self.worker.queue_length(self.name)


@pytest.fixture
def parked(worker: Worker) -> Iterator[Parked]:
    queue = Parked(worker)
    yield queue
    worker.app.control.cancel_consumer(
        queue.name, destination=[worker.name], reply=True, timeout=10
    )
    worker.delete_queue(queue.name)


def claim_of(run: str) -> Any:
    return get_lock_store(STORE).get(tasks.DEDUPE_KEY.format(run=run) + CLAIM_SUFFIX)


def test_50_sends_while_the_first_is_queued_run_once_and_all_get_its_id(
    worker: Worker, run: str, parked: Parked
) -> None:
    open_gate(run)  # runs do not wait
    first = tasks.dedupe_queued.apply_async((run,), queue=parked.name)
    rest = [tasks.dedupe_queued.delay(run) for _ in range(49)]
    assert {result.id for result in rest} == {first.id}
    assert all(result.duplicate for result in rest) and not first.duplicate
    assert parked.length() == 1
    assert worker.queue_length(QUEUE) == 0
    parked.consume()
    assert result_of(first)["id"] == first.id
    assert [r["id"] for r in runs(run)] == [first.id]
    # Its claim ended as it started: the next send is a task of its own.
    again = tasks.dedupe_queued.delay(run)
    assert again.id != first.id
    assert result_of(again)["id"] == again.id
    assert claim_of(run) is None


def test_on_duplicate_raise_raises_already_queued_with_the_queued_tasks_id(
    worker: Worker, run: str, parked: Parked
) -> None:
    open_gate(run)
    first = tasks.dedupe_or_raise.apply_async((run,), queue=parked.name)
    errors = []
    for _ in range(49):
        with pytest.raises(AlreadyQueued) as info:
            tasks.dedupe_or_raise.delay(run)
        errors.append(info.value)
    assert {error.task_id for error in errors} == {first.id}
    assert parked.length() == 1
    parked.consume()
    result_of(first)
    assert [r["id"] for r in runs(run)] == [first.id]


def test_queued_10_sends_while_one_runs_make_exactly_one_more_run(worker: Worker, run: str) -> None:
    first = tasks.dedupe_queued.delay(run)
    wait_until(lambda: len(runs(run)) == 1, 30, "the first run to start")
    later = [tasks.dedupe_queued.delay(run) for _ in range(10)]
    (second_id,) = {result.id for result in later}
    assert second_id != first.id
    second = later[0]
    # It waits for the run lock by retrying, and stays the queued one across its retries.
    wait_until(lambda: second.state == "RETRY", 30, "the second to retry")
    assert {tasks.dedupe_queued.delay(run).id for _ in range(5)} == {second_id}
    open_gate(run)
    assert result_of(first)["id"] == first.id
    assert result_of(second)["id"] == second_id
    assert [r["id"] for r in runs(run)] == [first.id, second_id]
    assert claim_of(run) is None


def test_until_done_sigkill_keeps_the_claim_until_dedupe_ttl_then_a_send_queues_anew(
    worker: Worker, run: str
) -> None:
    doomed = tasks.dedupe_until_done.delay(run)
    wait_until(lambda: len(runs(run)) == 1, 30, "the run to start")
    assert tasks.dedupe_until_done.delay(run).id == doomed.id  # running: still the one
    pid = runs(run)[0]["pid"]
    assert pid not in (os.getpid(), worker.proc.pid)
    info = claim_of(run)
    assert info is not None
    os.kill(pid, signal.SIGKILL)
    read_at = time.monotonic()
    assert tasks.dedupe_until_done.delay(run).id == doomed.id  # until its ttl
    wait_until(lambda: claim_of(run) is None, info.expires_in + 3, "the claim to expire")
    assert time.monotonic() - read_at >= info.expires_in - 0.5
    open_gate(run)
    fresh = tasks.dedupe_until_done.delay(run)
    assert fresh.id != doomed.id
    assert result_of(fresh)["id"] == fresh.id
    assert claim_of(run) is None  # given back when it ended


def test_revoke_of_a_queued_task_frees_its_claim(worker: Worker, run: str, parked: Parked) -> None:
    first = tasks.dedupe_queued.apply_async((run,), queue=parked.name)
    assert tasks.dedupe_queued.delay(run).id == first.id
    first.revoke()  # the result .delay() returned: at once
    second = tasks.dedupe_queued.apply_async((run,), queue=parked.name)
    assert second.id != first.id
    # Any other result's revoke(): when the worker discards the message (task_revoked).
    worker.app.AsyncResult(second.id).revoke()
    assert tasks.dedupe_queued.delay(run).id == second.id
    parked.consume()
    # Well before the claim's own ttl (30 s): the worker freed it.
    wait_until(lambda: claim_of(run) is None, 10, "the worker to discard the revoked message")
    open_gate(run)
    third = tasks.dedupe_queued.delay(run)
    assert third.id not in (first.id, second.id)
    assert result_of(third)["id"] == third.id
    assert [r["id"] for r in runs(run)] == [third.id]
