"""Lock metrics: names with few values, Prometheus (one process and multiprocess mode) and
OpenTelemetry, read through the real libraries; nothing secret in any of them."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
from django.conf import settings
from django.core.checks import WARNING, CheckMessage
from django.db import connections, transaction
from django.test import RequestFactory, override_settings
from opentelemetry import metrics as otel_metrics
from opentelemetry import trace
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor
from opentelemetry.instrumentation.mysqlclient import MySQLClientInstrumentor
from opentelemetry.instrumentation.psycopg import PsycopgInstrumentor
from opentelemetry.instrumentation.redis import RedisInstrumentor
from opentelemetry.instrumentation.sqlite3 import SQLite3Instrumentor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from django_keel_lock import (
    LockNotHeldError,
    LockStoreUnavailable,
    LockUnavailable,
    force_release,
    lock,
    lock_view,
    locked,
    metrics,
)
from django_keel_lock.checks import check_stores
from django_keel_lock.contrib.celery import locked_task
from django_keel_lock.instruments import prometheus
from django_keel_lock.metrics import Recorder
from django_keel_lock.options import lock_name
from django_keel_lock.registry import build_store
from django_keel_lock.stores import DatabaseLockStore, RedisLockStore

from .conftest import database_like, needs, needs_store, serving, store_params
from .support.redis_servers import REDIS_SERVER, redis_cluster

DOWN = {"BACKEND": "django_keel_lock.stores.RedisLockStore",
        "OPTIONS": {"URL": "redis://127.0.0.1:1/0"}}  # fmt: skip
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def word(length: int = 10) -> str:
    """Letters that are no hex digit: a name part `lock_name` keeps as it is."""
    return "".join(random.choices("ghijklmnopqrstuvwxyz", k=length))


# -- Prometheus helpers ---------------------------------------------------------------------
@pytest.fixture
def prom() -> Iterator[Callable[..., float]]:
    """Prometheus metrics on; a reader of one sample's value in the default REGISTRY (0 when
    it has none), through the real collector."""
    with override_settings(KEEL_LOCK_METRICS="prometheus"):

        def value(name: str, **labels: str) -> float:
            return REGISTRY.get_sample_value(name, labels) or 0.0

        yield value


def lock_labels(registry: Any = REGISTRY) -> set[str]:
    return {
        sample.labels["lock"]
        for family in registry.collect()
        if family.name.startswith("keel_lock")
        for sample in family.samples
        if "lock" in sample.labels
    }


# -- names ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("key", "name"),
    [
        ("invoice:42", "invoice:*"),
        ("report:2024-05-01", "report:*-*-*"),
        ("user:6f1c2b9e-1a2b-4c3d-9e8f-0123456789ab:sync", "user:*:sync"),
        ("upload:9f86d081884c7d659a2feaa0c55ad015", "upload:*"),
        ("nightly-report", "nightly-report"),
        ("cafe:face", "cafe:face"),  # short hex words are words
    ],
)
def test_a_key_without_a_name_is_shown_normalised(key: str, name: str) -> None:
    assert lock_name(key) == name
    assert lock(key, store="memory").name == name


def test_a_name_given_is_shown_as_given_and_checked() -> None:
    assert lock("invoice:42", store="memory", name="invoice").name == "invoice"
    with pytest.raises(ValueError, match="name must not contain control characters"):
        lock("invoice:42", store="memory", name="in\x1bvoice")
    with pytest.raises(TypeError, match="name must be a str"):
        lock("invoice:42", store="memory", name=42)  # type: ignore[arg-type]


def test_ten_thousand_keys_through_each_surface_make_a_handful_of_names(
    prom: Callable[..., float],
) -> None:
    prefix = word()
    before = lock_labels()

    @locked(f"{prefix}-locked:{{n}}", store="memory")
    def decorated(n: int) -> int:
        return n

    @locked(lambda n: f"{prefix}-callable:{n}", store="memory")
    def by_callable(n: int) -> int:
        return n

    @lock_view(f"{prefix}-view:<pk>", store="memory")
    def view(request: Any, pk: int) -> Any:
        from django.http import HttpResponse

        return HttpResponse("ok")

    @locked_task(f"{prefix}-task:{{n}}", store="memory")
    def task(n: int) -> int:
        return n

    factory = RequestFactory()
    for n in range(10_000):
        lock(f"{prefix}-direct:{n}:{os.urandom(8).hex()}", store="memory", name=prefix).run(
            lambda: None
        )
        lock(f"{prefix}-plain:{n}", store="memory").run(lambda: None)
        assert decorated(n) == n
        assert by_callable(n) == n
        assert view(factory.post(f"/x/{n}/"), pk=n).status_code == 200
        assert task(n) == n
    new = lock_labels() - before
    assert new == {
        prefix,
        f"{prefix}-plain:*",
        f"{prefix}-locked:{{n}}",
        f"{prefix}-callable:*",
        f"{prefix}-view:<pk>",
        f"{prefix}-task:{{n}}",
    }
    assert prom("keel_lock_acquire_total", store="memory", lock=prefix, outcome="acquired") == (
        10_000
    )


def test_the_task_integrations_name_every_lock_they_make_by_its_template(
    prom: Callable[..., float],
) -> None:
    """Django Tasks' run lock, claim and enqueue gate, and Celery's run lock and claim, for
    several keys: one name each, whatever the key (a name per key is a time series per key)."""
    if not settings.HAS_TASKS_DB:
        pytest.fail("django-tasks and django-tasks-db (the test extra) are not installed")
    from celery import Celery

    from tests.support import db_tasks

    prefix = word()
    eager = Celery(prefix, set_as_current=False, broker="memory://", backend="cache+memory://")
    eager.conf.task_always_eager = True

    @eager.task(bind=True, name=f"{prefix}.deduped")
    @locked_task(f"{prefix}-celery:{{name}}", store="memory", dedupe="until_done")
    def deduped(self: Any, name: str) -> str:
        return name

    queued, immediate = (db_tasks.named.using(backend=b) for b in ("dummy", "default"))
    for _ in range(5):
        name = word()
        assert deduped.delay(name).get() == name  # its claim, then its run lock
        assert queued.enqueue(name).id == queued.enqueue(name).id  # gate, claim; a duplicate
        assert immediate.enqueue(word()).return_value is not None  # gate, run lock
    template = "keel-metrics-task:{name}"
    shown = {name for name in lock_labels() if name.startswith((prefix, "keel-metrics-task"))}
    assert shown == {
        f"{prefix}-celery:{{name}}",
        f"{prefix}-celery:{{name}}:claim",
        template,
        f"{template}:claim",
        f"{template}:enqueue",
    }


# -- Prometheus: each metric ----------------------------------------------------------------
def test_acquire_outcomes_and_wait_seconds(prom: Callable[..., float], key: str) -> None:
    name = word()
    labels = {"store": "memory", "lock": name}
    holder = lock(key, store="memory", name=name)
    assert holder.acquire()
    assert not lock(key, store="memory", name=name).acquire()  # contended: did not wait
    assert not lock(key, store="memory", name=name, timeout=0.05).acquire()  # timeout
    holder.release()
    assert prom("keel_lock_acquire_total", **labels, outcome="acquired") == 1
    assert prom("keel_lock_acquire_total", **labels, outcome="contended") == 1
    assert prom("keel_lock_acquire_total", **labels, outcome="timeout") == 1
    assert prom("keel_lock_acquire_total", **labels, outcome="error") == 0
    assert prom("keel_lock_wait_seconds_count", **labels, outcome="timeout") == 1
    assert prom("keel_lock_wait_seconds_sum", **labels, outcome="timeout") >= 0.05
    assert prom("keel_lock_wait_seconds_bucket", **labels, outcome="timeout", le="0.01") == 0
    assert prom("keel_lock_wait_seconds_bucket", **labels, outcome="timeout", le="+Inf") == 1
    assert prom("keel_lock_held_seconds_count", **labels, end="released") == 1


def test_a_store_that_is_down_counts_an_error_not_contention(
    prom: Callable[..., float], key: str
) -> None:
    name = word()
    with override_settings(KEEL_LOCK_STORES={**settings.KEEL_LOCK_STORES, "down": DOWN}):
        errors = prom("keel_lock_store_errors_total", store="down", operation="acquire")
        with pytest.raises(LockStoreUnavailable):
            lock(key, store="down", name=name).acquire()
        assert prom("keel_lock_acquire_total", store="down", lock=name, outcome="error") == 1
        assert prom("keel_lock_acquire_total", store="down", lock=name, outcome="contended") == 0
        assert prom("keel_lock_store_errors_total", store="down", operation="acquire") == errors + 1


def test_held_gauge_goes_up_and_down(prom: Callable[..., float], key: str) -> None:
    name = word()
    labels = {"store": "memory", "lock": name}
    first, second = (lock(f"{key}:{n}", store="memory", name=name) for n in (1, 2))
    assert first.acquire()
    assert prom("keel_lock_held", **labels) == 1
    assert second.acquire()
    assert prom("keel_lock_held", **labels) == 2
    first.release()
    assert prom("keel_lock_held", **labels) == 1
    second.release()
    assert prom("keel_lock_held", **labels) == 0


def test_threads_count_apart_and_every_count_survives_its_thread(
    prom: Callable[..., float], key: str
) -> None:
    """Each thread counts into series of its own: none is lost to a race, none when its thread
    ends (the scrape folds it in), and a handle used by one thread after another counts in the
    thread that uses it."""
    name = word()
    labels = {"store": "memory", "lock": name}
    shared = lock(f"{key}:shared", store="memory", name=name)
    go = threading.Barrier(8)
    kept = []

    def work(n: int) -> None:
        go.wait()
        for i in range(2_000):
            handle = lock(f"{key}:{n}:{i % 7}", store="memory", name=name)
            assert handle.acquire()
            handle.release()
        kept.append(lock(f"{key}:{n}:kept", store="memory", name=name))
        assert kept[-1].acquire()  # still held when its thread has ended

    def cycle() -> None:
        assert shared.acquire()
        shared.release()

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    assert prom("keel_lock_acquire_total", **labels, outcome="acquired") >= 0  # a scrape meanwhile
    for thread in threads:
        thread.join()
    for _ in range(3):  # one handle, three threads in turn
        mover = threading.Thread(target=cycle)
        mover.start()
        mover.join()
    cycle()
    for _ in range(2):  # folding the ended threads' series changes nothing shown
        assert prom("keel_lock_acquire_total", **labels, outcome="acquired") == 16_012
        assert prom("keel_lock_wait_seconds_count", **labels, outcome="acquired") == 16_012
        assert prom("keel_lock_held_seconds_count", **labels, end="released") == 16_004
        assert prom("keel_lock_held", **labels) == 8
    for handle in kept:
        handle.release()
    assert prom("keel_lock_held", **labels) == 0


def test_held_seconds_by_how_the_hold_ended(prom: Callable[..., float], key: str) -> None:
    name = word()
    labels = {"store": "memory", "lock": name}
    released = lock(f"{key}:r", store="memory", name=name)
    with released:
        time.sleep(0.02)
    assert prom("keel_lock_held_seconds_count", **labels, end="released") == 1
    assert prom("keel_lock_held_seconds_sum", **labels, end="released") >= 0.02

    expired = lock(f"{key}:e", store="memory", name=name, ttl=0.05)
    assert expired.acquire()
    time.sleep(0.1)
    assert not expired.release()
    assert prom("keel_lock_held_seconds_count", **labels, end="expired") == 1
    assert prom("keel_lock_lost_total", **labels, reason="expired") == 1

    # Freed by force, then taken by another: the holder finds it gone within its ttl.
    forced_key = f"{name}:{word()}"  # the forcer names it by its key, normalised
    taken = lock(forced_key, store="memory", name=name, ttl=30)
    assert taken.acquire()
    assert force_release(forced_key, store="memory") is not None
    assert prom("keel_lock_held_seconds_count", store="memory", lock=forced_key, end="forced") == 1
    assert lock(forced_key, store="memory").acquire()
    assert prom("keel_lock_held", **labels) == 1  # the holder does not know yet
    assert not taken.release()
    assert prom("keel_lock_held_seconds_count", **labels, end="lost") == 1
    assert prom("keel_lock_lost_total", **labels, reason="gone") == 1
    assert prom("keel_lock_held", **labels) == 0


def wait_for(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_watchdog_renewals_and_the_loss_it_finds(prom: Callable[..., float], key: str) -> None:
    name = word()
    labels = {"store": "memory", "lock": name}
    held = lock(key, store="memory", name=name, ttl=0.3, auto_extend=True, on_lost="warn")
    assert held.acquire()
    wait_for(lambda: prom("keel_lock_renewals_total", **labels, outcome="extended") >= 2)
    force_release(key, store="memory")
    wait_for(lambda: prom("keel_lock_renewals_total", **labels, outcome="lost") == 1)
    assert prom("keel_lock_lost_total", **labels, reason="gone") == 1
    assert prom("keel_lock_held", **labels) == 0
    assert not held.release()
    assert prom("keel_lock_held_seconds_count", **labels, end="lost") == 1  # counted once


def test_a_collector_registry_of_your_own(prom: Callable[..., float], key: str) -> None:
    registry = CollectorRegistry()
    registry.register(prometheus.collector())
    name = word()
    lock(key, store="memory", name=name).run(lambda: None)
    labels = {"store": "memory", "lock": name, "outcome": "acquired"}
    assert registry.get_sample_value("keel_lock_acquire_total", labels) == 1


def test_override_settings_switches_metrics_off_and_on(key: str) -> None:
    name = word()
    sample = {"store": "memory", "lock": name, "outcome": "acquired"}
    with override_settings(KEEL_LOCK_METRICS=None):
        assert metrics.recorder is None
        lock(key, store="memory", name=name).run(lambda: None)
    with override_settings(KEEL_LOCK_METRICS=["prometheus"]):
        assert metrics.recorder is not None
        assert REGISTRY.get_sample_value("keel_lock_acquire_total", sample) is None
        lock(key, store="memory", name=name).run(lambda: None)
        assert REGISTRY.get_sample_value("keel_lock_acquire_total", sample) == 1


def test_with_metrics_off_neither_package_is_imported() -> None:
    code = textwrap.dedent(
        """
        import os, sys, django
        os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
        django.setup()
        from django_keel_lock import lock
        with lock("off:1", store="memory"):
            pass
        print(sorted(m for m in sys.modules if m.startswith(("prometheus", "opentelemetry"))))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stderr


# -- Prometheus multiprocess mode -----------------------------------------------------------
CHILD = """
import json, os, sys, django
os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
django.setup()
from django.test import override_settings
from django_keel_lock import lock
name, count = sys.argv[1], int(sys.argv[2])
with override_settings(KEEL_LOCK_METRICS="prometheus"):
    for n in range(count):
        lock(f"{name}:{n}", store="memory", name=name).run(lambda: None)
    kept = lock(f"{name}:kept", store="memory", name=name)
    assert kept.acquire()  # held as the process exits
    print(json.dumps({"pid": os.getpid()}), flush=True)
"""


def test_multiprocess_mode_sums_every_process(tmp_path: Any) -> None:
    name = word()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, name, str(count)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for count in (50, 60, 70)
    ]
    pids = []
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        pids.append(json.loads(out)["pid"])
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))
    labels = {"store": "memory", "lock": name}

    def value(metric: str, **more: str) -> float | None:
        return registry.get_sample_value(metric, {**labels, **more})

    assert value("keel_lock_acquire_total", outcome="acquired") == 50 + 60 + 70 + 3
    assert value("keel_lock_held_seconds_count", end="released") == 50 + 60 + 70
    assert value("keel_lock_wait_seconds_count", outcome="acquired") == 50 + 60 + 70 + 3
    assert value("keel_lock_held") == 3  # each kept one
    mark_process_dead(pids[0], str(tmp_path))  # what a gunicorn child_exit hook does
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))
    assert registry.get_sample_value("keel_lock_held", labels) == 2


# -- OpenTelemetry --------------------------------------------------------------------------
_spans = InMemorySpanExporter()
_reader = InMemoryMetricReader()
_sdk_set_up = threading.Lock()


def set_up_sdk() -> None:
    """The real SDK with in-memory exporters, once per process (OTel allows no more)."""
    with _sdk_set_up:
        if not isinstance(trace.get_tracer_provider(), TracerProvider):
            provider = TracerProvider()
            provider.add_span_processor(SimpleSpanProcessor(_spans))
            trace.set_tracer_provider(provider)
            otel_metrics.set_meter_provider(MeterProvider(metric_readers=[_reader]))
    _spans.clear()


@pytest.fixture
def otel() -> Iterator[InMemorySpanExporter]:
    """The SDK set up, and KEEL_LOCK_METRICS = "otel"."""
    set_up_sdk()
    with override_settings(KEEL_LOCK_METRICS="otel"):
        yield _spans


def named(spans: tuple[ReadableSpan, ...], name: str) -> ReadableSpan:
    (found,) = [span for span in spans if span.name == name]
    return found


def test_an_acquire_span_under_the_callers_span_with_events(
    otel: InMemorySpanExporter, key: str
) -> None:
    tracer = trace.get_tracer("tests")
    name = word()
    with tracer.start_as_current_span("request"):
        with lock(key, store="memory", name=name, ttl=12) as held:
            fence = held.fence
    spans = otel.get_finished_spans()
    parent, acquire = named(spans, "request"), named(spans, f"lock.acquire {name}")
    assert acquire.parent is not None and acquire.parent.span_id == parent.context.span_id
    assert acquire.kind is SpanKind.INTERNAL
    assert acquire.attributes == {
        "keel.lock.store": "memory",
        "keel.lock.name": name,
        "keel.lock.ttl": 12.0,
        "keel.lock.timeout": 0.0,
        "keel.lock.outcome": "acquired",
        "keel.lock.attempts": 1,
        "keel.lock.fence": fence,
    }
    assert acquire.status.status_code is StatusCode.UNSET
    assert [event.name for event in parent.events] == ["lock.acquired", "lock.released"]
    assert parent.events[0].attributes["keel.lock.fence"] == fence  # type: ignore[index]
    assert "error.type" not in (parent.attributes or {})


def test_a_raising_timeout_is_an_error_and_a_handled_skip_is_not(
    otel: InMemorySpanExporter, key: str
) -> None:
    name = word()
    holder = lock(key, store="memory", name=name)
    assert holder.acquire()

    @locked(key, store="memory", on_locked="skip")
    def skipped() -> None:
        pass

    assert skipped() is None
    with pytest.raises(LockUnavailable):
        with lock(key, store="memory", name=name, timeout=0.02):
            pass
    assert not lock(key, store="memory", name=name).acquire()  # acquire() just says False
    holder.release()
    skip, raised, plain = [
        span for span in otel.get_finished_spans() if span.name.startswith("lock.acquire")
    ][1:]
    assert skip.attributes["keel.lock.outcome"] == "contended"  # type: ignore[index]
    assert "error.type" not in skip.attributes  # type: ignore[operator]
    assert skip.status.status_code is StatusCode.UNSET
    assert raised.attributes["keel.lock.outcome"] == "timeout"  # type: ignore[index]
    assert raised.attributes["error.type"] == "LockUnavailable"  # type: ignore[index]
    assert raised.attributes["keel.lock.attempts"] >= 1  # type: ignore[index,operator]
    assert raised.status.status_code is StatusCode.ERROR
    assert "error.type" not in plain.attributes  # type: ignore[operator]


def test_a_lost_lock_is_an_event_and_an_error_on_the_callers_span(
    otel: InMemorySpanExporter, key: str
) -> None:
    tracer = trace.get_tracer("tests")
    with pytest.raises(LockNotHeldError):
        with tracer.start_as_current_span("job"):
            with lock(key, store="memory", name="lost", ttl=0.05):
                time.sleep(0.1)
    job = named(otel.get_finished_spans(), "job")
    assert [event.name for event in job.events][:2] == ["lock.acquired", "lock.lost"]
    assert job.events[1].attributes["keel.lock.reason"] == "expired"  # type: ignore[index]
    assert job.attributes["error.type"] == "LockNotHeldError"  # type: ignore[index]


def test_a_store_failure_is_an_error_on_the_acquire_span(
    otel: InMemorySpanExporter, key: str
) -> None:
    with override_settings(KEEL_LOCK_STORES={**settings.KEEL_LOCK_STORES, "down": DOWN}):
        with pytest.raises(LockStoreUnavailable):
            lock(key, store="down", name="down").acquire()
    span = named(otel.get_finished_spans(), "lock.acquire down")
    assert span.attributes["error.type"] == "LockStoreUnavailable"  # type: ignore[index]
    assert span.attributes["keel.lock.outcome"] == "error"  # type: ignore[index]
    assert span.status.status_code is StatusCode.ERROR


def otel_points() -> dict[str, list[Any]]:
    data = _reader.get_metrics_data()
    found: dict[str, list[Any]] = {}
    for resource in data.resource_metrics if data else []:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                found.setdefault(metric.name, []).extend(metric.data.data_points)
    return found


def test_otel_metrics(otel: InMemorySpanExporter, key: str) -> None:
    name = word()
    lock(key, store="memory", name=name).run(lambda: None)
    expired = lock(f"{key}:e", store="memory", name=name, ttl=0.05, on_lost="warn")
    with expired:
        time.sleep(0.1)
    points = otel_points()

    def mine(metric: str) -> list[Any]:
        return [p for p in points[metric] if p.attributes["keel.lock.name"] == name]

    (acquired,) = mine("keel.lock.acquire.duration")
    assert acquired.count == 2 and acquired.attributes["keel.lock.outcome"] == "acquired"
    ends = {p.attributes["keel.lock.end"]: p.count for p in mine("keel.lock.hold.duration")}
    assert ends == {"released": 1, "expired": 1}
    (lost,) = mine("keel.lock.lost")
    assert lost.value == 1 and lost.attributes["keel.lock.reason"] == "expired"


# -- the drivers' own instrumentation, under the acquire span --------------------------------
# Each store with the official instrumentation of its driver, turned on as an application does
# (process-wide). A connection opened meanwhile stays traced after uninstrument(), so each test
# opens its store's connections inside the block and closes them there (`serving`).
INSTRUMENTORS: dict[str, type[BaseInstrumentor]] = {
    "sqlite": SQLite3Instrumentor,
    "postgres": PsycopgInstrumentor,
    "mariadb": MySQLClientInstrumentor,
    "redis": RedisInstrumentor,
}


@contextmanager
def instrumented(driver: str) -> Iterator[None]:
    """The official instrumentation of `driver`'s client library on while the block runs."""
    instrumentor = INSTRUMENTORS[driver]()
    instrumentor.instrument()
    try:
        assert instrumentor.is_instrumented_by_opentelemetry, "its dependency check refused"
        yield
    finally:
        instrumentor.uninstrument()


def client_spans(spans: tuple[ReadableSpan, ...]) -> list[ReadableSpan]:
    return [span for span in spans if span.kind is SpanKind.CLIENT]


def statement(span: ReadableSpan) -> str:
    """The statement or command a CLIENT span shows (old and new attribute names)."""
    attributes = span.attributes or {}
    return str(attributes.get("db.statement", attributes.get("db.query.text", "")))


def under(acquire: ReadableSpan, spans: tuple[ReadableSpan, ...]) -> list[str]:
    """The statements of the CLIENT spans whose parent is `acquire`."""
    return [
        statement(span)
        for span in client_spans(spans)
        if span.parent is not None and span.parent.span_id == acquire.context.span_id
    ]


def acquire_once(alias: str, key: str, name: str, *, asynchronous: bool) -> None:
    """Acquire and release `key` under a span of its own, sync or async."""
    if asynchronous:

        async def cycle() -> None:
            async with lock(key, store=alias, name=name):
                pass

        asyncio.run(cycle())
    else:
        with lock(key, store=alias, name=name):
            pass


def assert_no_key_in(spans: tuple[ReadableSpan, ...], key: str) -> None:
    """The instrumentations' defaults show statements with placeholders, not our values."""
    for span in client_spans(spans):
        assert all(key not in str(value) for value in (span.attributes or {}).values()), span


@contextmanager
def database_store(alias: str) -> Iterator[str]:
    """A new store for database store `alias` (postgres: on the cursor path, prepared
    statements off as for pgbouncer), serving under an alias of its own."""
    if alias != "postgres":
        with serving(build_store(alias)) as serving_alias:
            yield serving_alias
        return
    options = {**(settings.DATABASES["postgres"].get("OPTIONS") or {}), "prepare_threshold": None}
    with database_like("postgres", f"unprepared-{word()}", OPTIONS=options) as database:
        with serving(DatabaseLockStore(f"{database}-store", {"DATABASE": database})) as served:
            yield served


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("alias", store_params(["sqlite", "mariadb", "postgres"]))
def test_database_statements_nest_under_the_acquire_span(
    otel: InMemorySpanExporter, key: str, alias: str, asynchronous: bool
) -> None:
    """A database store's statements go through the driver's cursor (PostgreSQL: with
    prepare_threshold None), so its instrumentation shows them under the acquire span; an
    async acquire's too, on the store's worker thread."""
    name = word()
    with instrumented(alias), database_store(alias) as served:
        acquire_once(served, key, name, asynchronous=False)  # the connection's own set-up
        otel.clear()
        acquire_once(served, key, name, asynchronous=asynchronous)
    spans = otel.get_finished_spans()
    nested = under(named(spans, f"lock.acquire {name}"), spans)
    # The acquire's statement: the upsert, or (PostgreSQL, the key this thread freed last) the
    # retake's UPDATE.
    assert any(
        "INSERT INTO django_keel_lock_lock" in sql or "UPDATE django_keel_lock_lock" in sql
        for sql in nested
    ), nested
    # The release comes after the acquire span: under the caller's span, here none.
    assert len(client_spans(spans)) > len(nested)
    assert_no_key_in(spans, key)


def test_sqlite_statements_inside_the_callers_transaction_nest_too(
    otel: InMemorySpanExporter, key: str
) -> None:
    """Inside atomic() the lock statements run on the caller's own connection, traced when
    it was opened under the instrumentation, as an application's is."""
    name = word()
    connections["default"].close()
    try:
        with instrumented("sqlite"), transaction.atomic():
            with lock(key, store="sqlite", name=name):
                pass
    finally:
        connections["default"].close()  # traced: not for the tests after this one
    spans = otel.get_finished_spans()
    nested = under(named(spans, f"lock.acquire {name}"), spans)
    assert any("INSERT INTO django_keel_lock_lock" in sql for sql in nested), nested


@pytest.mark.parametrize("durable", [True, False], ids=["durable", "fast"])
@needs_store("postgres")
def test_postgres_hot_statements_bypass_psycopg_so_only_connection_set_up_nests(
    otel: InMemorySpanExporter, key: str, durable: bool
) -> None:
    """On PostgreSQL with psycopg 3, acquire, release and extend run through libpq itself
    (stores.database.libpq), which psycopg's instrumentation does not see: only the set-up
    statements of a thread's new connection show, under the acquire that opened it."""
    name = word()
    store = DatabaseLockStore(f"pg-{word()}", {"DATABASE": "postgres", "DURABLE": durable})
    with instrumented("postgres"), serving(store) as served:
        acquire_once(served, key, name, asynchronous=False)
        first = otel.get_finished_spans()
        otel.clear()
        acquire_once(served, key, name, asynchronous=False)
        later = otel.get_finished_spans()
    set_up = under(named(first, f"lock.acquire {name}"), first)
    assert any("SET SESSION CHARACTERISTICS" in sql for sql in set_up), set_up  # seen...
    # (with the look for the line's table, a set-up statement too), but no lock statement
    assert not any("django_keel_lock_lock" in statement(span) for span in client_spans(first))
    assert client_spans(later) == []  # ...and nothing once the connection is set up


@needs_store("redis")
def test_redis_sync_scripts_bypass_the_client_so_no_span_shows(
    otel: InMemorySpanExporter, key: str
) -> None:
    """Sync calls on a plain (or Sentinel) server run the scripts on the thread's own
    connection, not through redis-py's client, which the instrumentation wraps."""
    name = word()
    with instrumented("redis"), serving(build_store("redis-url")) as served:
        acquire_once(served, key, name, asynchronous=False)
        spans = otel.get_finished_spans()
        assert named(spans, f"lock.acquire {name}").kind is SpanKind.INTERNAL
        assert client_spans(spans) == []
        client = redis.Redis.from_url(settings.REDIS_URL)
        try:
            client.ping()  # the instrumentation is on: redis-py's client is traced
        finally:
            client.close()
    assert [span.name for span in client_spans(otel.get_finished_spans())] == ["PING"]


@needs_store("redis")
def test_redis_async_scripts_nest_under_the_acquire_span(
    otel: InMemorySpanExporter, key: str
) -> None:
    name = word()
    with instrumented("redis"), serving(build_store("redis-url")) as served:
        acquire_once(served, key, name, asynchronous=True)  # the scripts loaded, if need be
        otel.clear()
        acquire_once(served, key, name, asynchronous=True)
    spans = otel.get_finished_spans()
    assert [sql.split()[0] for sql in under(named(spans, f"lock.acquire {name}"), spans)] == [
        "EVALSHA"
    ]
    assert_no_key_in(spans, key)


@needs(os.path.exists(REDIS_SERVER), "the redis-server binary")
def test_redis_cluster_scripts_nest_under_the_acquire_span(
    otel: InMemorySpanExporter, key: str
) -> None:
    """A cluster's scripts go through redis-py's RedisCluster client, sync and async."""
    name = word()
    with redis_cluster(3) as nodes, instrumented("redis"):
        store = RedisLockStore(f"cluster-{word()}", {"URL": nodes[0].url, "CLUSTER": True})
        with serving(store) as served:
            acquire_once(served, key, name, asynchronous=False)  # loads the scripts
            for asynchronous in (False, True):
                otel.clear()
                acquire_once(served, key, name, asynchronous=asynchronous)
                spans = otel.get_finished_spans()
                nested = under(named(spans, f"lock.acquire {name}"), spans)
                assert [sql.split()[0] for sql in nested] == ["EVALSHA"], (asynchronous, nested)


# -- nothing secret anywhere ----------------------------------------------------------------
def test_no_owner_key_or_holder_in_any_sample_or_span(key: str) -> None:
    secret_key = f"invoice:{random.randrange(10**8, 10**9)}"  # unnamed, it shows as invoice:*
    holder = f"web-{word(12)}:1"
    set_up_sdk()
    with override_settings(KEEL_LOCK_METRICS=["prometheus", "otel"]):
        owners = []
        with trace.get_tracer("tests").start_as_current_span("caller"):
            held = lock(secret_key, store="memory", holder=holder, name="invoice")
            with held:
                owners.append(held.owner)
            short = lock(secret_key, store="memory", holder=holder, ttl=0.05, on_lost="warn")
            with short:  # unnamed: its key normalised, and lost
                owners.append(short.owner)
                time.sleep(0.1)
            assert lock(secret_key, store="memory", holder=holder, timeout=0.01).acquire()
    texts: list[str] = []
    for family in REGISTRY.collect():
        for sample in family.samples:
            texts += [*sample.labels.values(), sample.name]
    for span in _spans.get_finished_spans():
        texts += [span.name, *map(str, (span.attributes or {}).values())]
        for event in span.events:
            texts += [event.name, *map(str, (event.attributes or {}).values())]
    for points in otel_points().values():
        for point in points:
            texts += map(str, point.attributes.values())
    assert texts
    for secret in [secret_key, holder, *owners]:
        assert secret is not None
        assert not [text for text in texts if secret in text], secret


# -- the system check -----------------------------------------------------------------------
def e011(**settings: Any) -> list[CheckMessage]:
    with override_settings(**settings):
        return [m for m in check_stores() if m.id == "django_keel_lock.E011"]


def w011(**settings: Any) -> list[CheckMessage]:
    with override_settings(**settings):
        return [m for m in check_stores() if m.id == "django_keel_lock.W011"]


@pytest.mark.parametrize(
    ("setting", "module"),
    [("prometheus", "prometheus_client"), (["prometheus", "otel"], "opentelemetry.trace")],
)
def test_w011_metrics_on_without_their_package_warns_and_does_not_stop_the_app(
    monkeypatch: pytest.MonkeyPatch, setting: Any, module: str
) -> None:
    assert w011(KEEL_LOCK_METRICS=setting) == []
    # A None entry makes `import module` raise ImportError, as a missing package does.
    monkeypatch.setitem(sys.modules, module, None)
    (message,) = w011(KEEL_LOCK_METRICS=setting)
    assert e011(KEEL_LOCK_METRICS=setting) == []
    # A warning: migrate and runserver still start (an error stops them).
    assert message.level == WARNING and not message.is_serious()
    assert module in message.msg and "locks work" in message.msg
    assert "pip install 'django-keel-lock[" in (message.hint or "")
    with override_settings(KEEL_LOCK_METRICS=setting):
        # The app still runs: that backend is off, the others on.
        on = metrics.recorder
        assert on is None if setting == "prometheus" else isinstance(on, Recorder)


@pytest.mark.parametrize("value", ["statsd", ["prometheus", "datadog"], 3])
def test_e011_malformed_setting(value: Any) -> None:
    (message,) = e011(KEEL_LOCK_METRICS=value)
    assert "KEEL_LOCK_METRICS must be" in message.msg
    with override_settings(KEEL_LOCK_METRICS=value):
        assert metrics.recorder is None


def test_the_grafana_dashboard_queries_metrics_that_exist() -> None:
    import re

    with open(os.path.join(ROOT, "docs", "grafana", "keel-lock-dashboard.json")) as file:
        dashboard = json.load(file)
    families = {family.name: family.type for family in prometheus.collector().collect()}
    suffixes = {"counter": ["_total"], "gauge": [""], "histogram": ["_bucket", "_count", "_sum"]}
    exported = {name + end for name, kind in families.items() for end in suffixes[kind]}
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    queried = {name for expr in exprs for name in re.findall(r"keel_lock_[a-z_]+", expr)}
    assert len(families) == 7 and queried and queried <= exported, queried - exported
