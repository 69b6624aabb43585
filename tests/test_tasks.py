"""locked_task for Django Tasks: in-process on the immediate and dummy backends, then a real
django-tasks-db worker on PostgreSQL.

The worker tests start `manage.py db_worker` (django-tasks-db) as a subprocess on
tests/support/tasks_worker_settings.py: it runs the tasks of tests/support/db_tasks.py from the
"database" task backend, whose table lives in the PostgreSQL test database (see
tests.support.tasks_router), and takes their locks in the same database's "postgres" store.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings

from tests.conftest import require_reachable

if not settings.HAS_TASKS_DB:
    _MISSING = "MISSING HERE (CI fails instead): django-tasks / django-tasks-db (the test extra)"
    if settings.CI:
        raise ImportError(_MISSING)
    pytest.skip(_MISSING, allow_module_level=True)

from django_keel_lock import AlreadyQueued, force_release, get_lock_store, lock
from django_keel_lock.contrib import tasks as contrib_tasks
from django_keel_lock.contrib.tasks import (
    CLAIM_SUFFIX,
    GATE_SUFFIX,
    RETRIES_KWARG,
    LockedTask,
    current_lock,
    locked_task,
)
from tests.support import ROOT
from tests.support import db_tasks as jobs
from tests.support.hidden import check_needs_extra
from tests.support.workers import Worker

try:
    from django.tasks import TaskContext, TaskResultStatus, task, task_backends
    from django.tasks.signals import task_enqueued
except ImportError:  # Django 5.2: the backport
    from django_tasks import TaskContext, TaskResultStatus, task, task_backends
    from django_tasks.signals import task_enqueued

from django_tasks_db.models import DBTaskResult

# -- in-process: the immediate backend (the default here) runs a task inside .enqueue() -------


@locked_task("djtasks-job:{name}:{n}", store="memory", ttl="5m")
@task
def immediate(name: str, n: int = 1) -> dict[str, Any]:
    held = current_lock()
    assert held is not None
    return {"key": held.key, "fence": held.fence, "holder": held.holder, "ttl": held.ttl}


@locked_task("djtasks-job:{name}:1", store="memory", on_locked="raise")
@task
def immediate_or_raise(name: str) -> str:
    return "ran"


@locked_task("djtasks-job:{name}:1", store="memory", on_locked="retry")
@task
def immediate_retry(name: str) -> str:
    return "ran"


@locked_task(lambda context, name: f"djtasks-job:{name}:1", store="memory")
@task(takes_context=True)
def with_context(context: TaskContext, name: str) -> str:
    return str(context.task_result.id)


@locked_task("djtasks-job:{name}", store="memory", dedupe="until_done")
@task
def immediate_deduped(name: str) -> str:
    return f"ran {name}"


@locked_task(["djtasks-acct:{target}", "djtasks-acct:{source}"], store="memory")
@task
def transfer(source: int, target: int) -> dict[str, Any]:
    held = current_lock()
    assert held is not None
    return {"keys": list(held.keys), "fences": held.fences}


def test_a_list_of_templates_takes_every_key_for_the_run_or_skips() -> None:
    ran = transfer.enqueue(1, 2).return_value
    assert ran["keys"] == ["djtasks-acct:1", "djtasks-acct:2"]
    assert set(ran["fences"]) == set(ran["keys"])
    assert get_lock_store("memory").get("djtasks-acct:1") is None
    with lock("djtasks-acct:1", store="memory"):
        result = transfer.enqueue(1, 2)
    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value is None
    assert get_lock_store("memory").get("djtasks-acct:2") is None  # all or nothing


def test_dedupe_with_a_list_of_templates_is_refused_naming_it() -> None:
    with pytest.raises(TypeError, match="dedupe= takes one key template"):
        locked_task(["a:{x}", "b:{x}"], dedupe="queued")


def test_key_is_formatted_from_the_enqueued_arguments_and_the_lock_is_released() -> None:
    result = immediate.enqueue("a", n=7)
    assert result.status == TaskResultStatus.SUCCESSFUL
    ran = result.return_value
    assert ran["key"] == "djtasks-job:a:7"
    assert ran["ttl"] == 300
    assert ran["holder"].endswith(f" {immediate.module_path}[{result.id}]")
    assert get_lock_store("memory").get("djtasks-job:a:7") is None
    assert current_lock() is None


def test_skip_returns_none_while_another_holds_the_lock(caplog: pytest.LogCaptureFixture) -> None:
    with lock("djtasks-job:s:1", store="memory", holder="someone-else"):
        with caplog.at_level("INFO", logger="django_keel_lock.tasks"):
            result = immediate.enqueue("s")
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value is None
    (line,) = [r.getMessage() for r in caplog.records if r.name == "django_keel_lock.tasks"]
    assert f"skipped {immediate.module_path}[{result.id}]" in line
    assert "someone-else" in line


def test_raise_fails_the_task_with_lock_unavailable() -> None:
    with lock("djtasks-job:r:1", store="memory"):
        result = immediate_or_raise.enqueue("r")
    assert result.status == TaskResultStatus.FAILED
    assert result.errors[0].exception_class_path.endswith(".LockUnavailable")
    assert "djtasks-job:r:1" in result.errors[0].traceback
    assert immediate_or_raise.enqueue("r").return_value == "ran"


def test_retry_on_a_backend_that_cannot_defer_fails_with_lock_unavailable() -> None:
    with lock("djtasks-job:c:1", store="memory"):
        result = immediate_retry.enqueue("c")
    assert result.status == TaskResultStatus.FAILED
    assert result.errors[0].exception_class_path.endswith(".LockUnavailable")


def test_a_task_that_takes_the_context_gets_it_and_others_do_not() -> None:
    result = with_context.enqueue("x")
    assert result.return_value == str(result.id)
    assert isinstance(with_context, LockedTask)
    with lock("djtasks-job:x:1", store="memory"):
        assert with_context.enqueue("x").return_value is None


def test_dedupe_on_the_immediate_backend_runs_each_enqueue_and_leaves_no_claim(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("DEBUG", logger="django_keel_lock.tasks"):
        first = immediate_deduped.enqueue("e")
    assert first.return_value == "ran e"
    assert "no claim yet" not in caplog.text  # run inside .enqueue(): not behind its own gate
    assert get_lock_store("memory").get("djtasks-job:e" + CLAIM_SUFFIX) is None
    assert get_lock_store("memory").get("djtasks-job:e" + GATE_SUFFIX) is None
    again = immediate_deduped.enqueue("e")  # the first has ended: nothing to fold into
    assert again.id != first.id
    assert again.return_value == "ran e"


MISORDERED = "locked_task must be applied above @task, not below"


def test_locked_task_below_task_is_a_type_error_naming_the_order() -> None:
    with pytest.raises(TypeError, match=MISORDERED) as info:

        @task
        @locked_task("djtasks-job:order", store="memory")
        def misordered() -> str:
            return "ran"

    assert "put @locked_task(...) on the line before @task" in str(info.value)


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"on_locked": "wait"}, "on_locked must be one of skip, raise, retry"),
        ({"ttl": -1}, "ttl must be > 0"),
        ({"countdown": 5}, "countdown= only applies"),
        ({"max_hold": "1h"}, "pass auto_extend=True"),
        ({"max_retries": -1}, "max_retries must be an int >= 0 or None"),
        ({"dedupe": "always"}, 'dedupe must be None, "queued" or "until_done"'),
        ({"on_duplicate": "raise"}, "only apply with dedupe="),
    ],
)
def test_bad_options_fail_when_the_task_is_defined(options: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        locked_task("k", **options)


# -- in-process dedupe: the dummy backend keeps what is enqueued and never runs it -------------


@locked_task("djtasks-report:{date}", store="memory", dedupe="queued", dedupe_ttl=60)
@task(backend="dummy")
def parked_report(date: str) -> str:
    return date


@locked_task("djtasks-export:{day}", store="memory", limit=2, dedupe="queued", on_duplicate="raise")
@task(backend="dummy")
def parked_export(day: str) -> str:
    return day


@pytest.fixture
def dummy() -> Iterator[Any]:
    backend = task_backends["dummy"]
    backend.clear()
    yield backend
    backend.clear()


def test_a_duplicate_enqueue_returns_the_queued_tasks_result_and_enqueues_nothing(
    dummy: Any,
) -> None:
    first = parked_report.enqueue("d1")
    again = parked_report.enqueue("d1")
    other = parked_report.enqueue("d2")
    assert again.id == first.id
    assert other.id != first.id
    assert len(dummy.results) == 2
    claim = get_lock_store("memory").get("djtasks-report:d1" + CLAIM_SUFFIX)
    assert claim is not None
    assert claim.holder == f"{parked_report.module_path}[{first.id}]"
    assert 59 < claim.expires_in <= 60  # dedupe_ttl, not the default ttl
    assert get_lock_store("memory").get("djtasks-report:d1" + GATE_SUFFIX) is None


def test_an_enqueue_whose_gate_expired_before_it_claimed_gives_the_claim_back(
    dummy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A run may have passed the gate and found no claim: a claim taken after could name a task
    that ran without it. (The gate is freed as its expiry would, while the enqueue queues.)"""

    def expire_the_gate(sender: Any, task_result: Any, **kwargs: Any) -> None:
        if task_result.args == ["g1"]:
            assert force_release("djtasks-report:g1" + GATE_SUFFIX, store="memory") is not None

    task_enqueued.connect(expire_the_gate, weak=False)
    try:
        with caplog.at_level("WARNING", logger="django_keel_lock.tasks"):
            first = parked_report.enqueue("g1")
    finally:
        task_enqueued.disconnect(expire_the_gate)
    assert get_lock_store("memory").get("djtasks-report:g1" + CLAIM_SUFFIX) is None
    assert "given back: the gate expired first" in caplog.text
    second = parked_report.enqueue("g1")
    assert second.id != first.id
    assert parked_report.enqueue("g1").id == second.id  # its claim holds


def test_with_limit_2_two_are_queued_and_a_third_raises_already_queued(dummy: Any) -> None:
    first, second = parked_export.enqueue("l1"), parked_export.enqueue("l1")
    assert first.id != second.id
    with pytest.raises(AlreadyQueued) as info:
        parked_export.enqueue("l1")
    assert info.value.task_id == second.id
    assert len(dummy.results) == 2


async def test_aenqueue_de_duplicates_too(dummy: Any) -> None:
    first = await parked_report.aenqueue("a1")
    assert (await parked_report.aenqueue("a1")).id == first.id


def test_already_queued_is_the_one_error_of_both_integrations() -> None:
    from django_keel_lock.contrib import celery as contrib_celery

    assert contrib_tasks.AlreadyQueued is contrib_celery.AlreadyQueued is AlreadyQueued


def test_the_app_imports_without_django_tasks_and_the_module_names_the_extra(
    tmp_path: Path,
) -> None:
    hidden = ("django.tasks", "django_tasks", "django_tasks_db")
    check_needs_extra("django_keel_lock.contrib.tasks", "tasks", hidden, tmp_path)


# -- a real worker ------------------------------------------------------------------------------


def _worker_env() -> dict[str, str]:
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.support.tasks_worker_settings",
        "PYTHONPATH": str(ROOT),
    }


def _worker_command(*options: str) -> list[str]:
    return [
        *(sys.executable, "-m", "django", "db_worker", "--backend", jobs.BACKEND),
        *("--interval", "0.05", "--no-startup-delay", "--no-reload", "-v", "2", *options),
    ]


def wait_until(check: Callable[[], bool], seconds: float, what: str, worker: Worker) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert worker.proc.poll() is None, f"the worker died:\n{worker.output()[-4000:]}"
        assert time.monotonic() < deadline, (
            f"waited {seconds}s for {what}:\n{worker.output()[-3000:]}"
        )
        time.sleep(0.05)


def finished(result: Any, worker: Worker, seconds: float = 30) -> Any:
    """`result` once the worker finished it (refreshed from the database)."""

    def done() -> bool:
        result.refresh()
        return bool(result.is_finished)

    wait_until(done, seconds, f"task {result.id} to finish", worker)
    return result


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory, django_db_setup: None) -> Iterator[Worker]:
    require_reachable(settings.PG_HOST, settings.PG_PORT, "PostgreSQL (the tasks' database)")
    log = tmp_path_factory.mktemp("db_worker") / "worker.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            _worker_command(), cwd=ROOT, env=_worker_env(), stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    started = Worker(proc, log)
    try:
        pong = finished(jobs.ping.enqueue(), started, 60)
        assert pong.return_value == proc.pid
        yield started
    finally:
        started.stop()
        print(f"--- db_worker log (tail) ---\n{started.output()[-3000:]}")


@pytest.fixture
def run() -> str:
    """This test's own key namespace (the tasks' first argument)."""
    return uuid.uuid4().hex[:12]


def results_of(task: Any, run: str) -> list[Any]:
    """Every TaskResult of `task` enqueued with `run`, oldest first."""
    rows = DBTaskResult.objects.filter(task_path=task.module_path).order_by("enqueued_at")
    return [row.task_result for row in rows if row.args_kwargs["args"][:1] == [run]]


def ran_of(task: Any, run: str) -> list[Any]:
    """The TaskResults of `task` with `run` whose body ran (they return a dict; a refused
    run returns None)."""
    return [
        r
        for r in results_of(task, run)
        if r.status == TaskResultStatus.SUCCESSFUL and r.return_value is not None
    ]


def test_worker_skip_returns_none_and_logs_while_this_process_holds_the_lock(
    worker: Worker, run: str
) -> None:
    with lock(f"tasks:{run}", store=jobs.STORE, holder="the-test-process"):
        result = finished(jobs.skipping.enqueue(run), worker)
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value is None
    wait_until(lambda: "the-test-process" in worker.output(), 5, "the skip's log line", worker)
    line = next(line for line in worker.output().splitlines() if "the-test-process" in line)
    assert f"skipped {jobs.skipping.module_path}[{result.id}]" in line
    ran = finished(jobs.skipping.enqueue(run), worker)
    assert ran.return_value["pid"] == worker.proc.pid


def test_worker_raise_fails_the_task_with_lock_unavailable(worker: Worker, run: str) -> None:
    with lock(f"tasks:{run}", store=jobs.STORE):
        result = finished(jobs.raising.enqueue(run), worker)
    assert result.status == TaskResultStatus.FAILED
    assert result.errors[0].exception_class_path.endswith(".LockUnavailable")
    assert f"tasks:{run}" in result.errors[0].traceback
    assert finished(jobs.raising.enqueue(run), worker).status == TaskResultStatus.SUCCESSFUL


def test_worker_retry_enqueues_again_and_runs_once_the_holder_lets_go(
    worker: Worker, run: str
) -> None:
    held = lock(f"tasks:{run}", store=jobs.STORE, ttl=2)
    assert held.acquire()  # never released: it expires after 2 s
    first = finished(jobs.retrying.enqueue(run), worker)
    assert first.status == TaskResultStatus.SUCCESSFUL
    assert first.return_value is None  # it handed the work to its retry
    wait_until(lambda: bool(ran_of(jobs.retrying, run)), 30, "a retry to run", worker)
    retries = results_of(jobs.retrying, run)[1:]
    done = ran_of(jobs.retrying, run)
    assert len(done) == 1, retries
    (ran,) = done
    assert ran.return_value["fence"] > held.fence
    assert ran.kwargs[RETRIES_KWARG] >= 1
    assert ran.task.run_after is not None
    assert ran.started_at >= ran.task.run_after  # deferred by the holder's remaining time
    assert f"retrying {jobs.retrying.module_path}[{first.id}] as {retries[0].id}" in (
        worker.output()
    )


def park(task: Any, run: str) -> tuple[Any, str]:
    """`task` enqueued with `run` on a queue of its own that the worker does not consume."""
    queue = f"parked-{run}"
    return task.using(queue_name=queue).enqueue(run), queue


def drain(queue: str) -> None:
    """Run what waits in `queue` with a worker of its own (`--batch`: then it exits)."""
    done = subprocess.run(
        _worker_command("--queue-name", queue, "--batch"),
        cwd=ROOT, env=_worker_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def claim_of(run: str) -> Any:
    return get_lock_store(jobs.STORE).get(jobs.KEY.format(run=run) + CLAIM_SUFFIX)


def test_50_enqueues_while_the_first_is_queued_run_once_and_all_get_its_id(
    worker: Worker, run: str
) -> None:
    first, queue = park(jobs.deduped, run)
    rest = [jobs.deduped.enqueue(run) for _ in range(49)]
    assert {result.id for result in rest} == {first.id}
    assert [r.id for r in results_of(jobs.deduped, run)] == [first.id]  # nothing else queued
    drain(queue)
    first.refresh()
    assert first.status == TaskResultStatus.SUCCESSFUL
    assert first.return_value["fence"] is not None
    assert len(first.worker_ids) == 1
    # Its claim ended as it started: the next enqueue is a task of its own.
    assert claim_of(run) is None
    again = finished(jobs.deduped.enqueue(run), worker)
    assert again.id != first.id
    assert again.status == TaskResultStatus.SUCCESSFUL
    assert len(results_of(jobs.deduped, run)) == 2


def test_on_duplicate_raise_raises_already_queued_49_times_with_the_queued_tasks_id(
    worker: Worker, run: str
) -> None:
    first, queue = park(jobs.deduped_or_raise, run)
    errors = []
    for _ in range(49):
        with pytest.raises(AlreadyQueued) as info:
            jobs.deduped_or_raise.enqueue(run)
        errors.append(info.value)
    assert len(errors) == 49
    assert {error.task_id for error in errors} == {str(first.id)}
    assert [r.id for r in results_of(jobs.deduped_or_raise, run)] == [first.id]
    drain(queue)
    first.refresh()
    assert first.status == TaskResultStatus.SUCCESSFUL


def test_a_retry_stays_the_queued_one_then_runs_once_the_holder_lets_go(
    worker: Worker, run: str
) -> None:
    held = lock(f"tasks:{run}", store=jobs.STORE, ttl=60)
    assert held.acquire()
    first = finished(jobs.deduped.enqueue(run), worker)
    assert first.return_value is None  # refused: it retries every 0.5 s
    latest = results_of(jobs.deduped, run)[-1]
    assert latest.id != first.id
    # A duplicate gets the retry that waits now, not a task of its own.
    assert jobs.deduped.enqueue(run).id in {r.id for r in results_of(jobs.deduped, run)[1:]}
    pending = [r for r in results_of(jobs.deduped, run) if not r.is_finished]
    assert len(pending) == 1, results_of(jobs.deduped, run)
    held.release()
    wait_until(lambda: bool(ran_of(jobs.deduped, run)), 30, "the retry to run", worker)
    assert len(ran_of(jobs.deduped, run)) == 1
    wait_until(lambda: claim_of(run) is None, 10, "the claim to be given back", worker)


@pytest.mark.parametrize("deduped", [jobs.deduped_or_raise, jobs.until_done_or_raise],
                         ids=["queued", "until_done"])  # fmt: skip
def test_a_task_the_worker_takes_before_enqueue_returns_leaves_no_claim_behind(
    worker: Worker, run: str, deduped: Any
) -> None:
    """The worker takes the task between the backend's insert and the end of `.enqueue()`
    (`task_enqueued`, sent after the insert, holds the enqueue until the worker has run the
    task or waits for the enqueue to end). The next enqueue is a task of its own that runs, not
    a duplicate of one that ended."""
    waits = f"{deduped.module_path}[{{id}}]: no claim yet"

    def hold_the_enqueue(sender: Any, task_result: Any, **kwargs: Any) -> None:
        if task_result.args[:1] != [run]:
            return
        waiting = waits.format(id=task_result.id)
        wait_until(
            lambda: task_result.refresh() or task_result.is_finished or waiting in (
                worker.output()
            ),
            30, "the worker to run the task or wait for the enqueue", worker,
        )  # fmt: skip

    task_enqueued.connect(hold_the_enqueue, weak=False)
    try:
        first = deduped.enqueue(run)
    finally:
        task_enqueued.disconnect(hold_the_enqueue)
    assert finished(first, worker).return_value["pid"] == worker.proc.pid
    assert claim_of(run) is None, "a claim naming a task that ended"
    again = finished(deduped.enqueue(run), worker)
    assert again.id != first.id
    assert again.return_value["pid"] == worker.proc.pid
