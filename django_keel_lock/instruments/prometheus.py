"""Prometheus metrics of locks (`KEEL_LOCK_METRICS = "prometheus"`, `prometheus_client`).

| metric | type | labels |
|---|---|---|
| keel_lock_acquire_total | counter | store, lock, outcome (metrics.ACQUIRE_OUTCOMES) |
| keel_lock_wait_seconds | histogram | store, lock, outcome |
| keel_lock_held_seconds | histogram | store, lock, end (metrics.ENDS) |
| keel_lock_lost_total | counter | store, lock, reason (metrics.LOST_REASONS) |
| keel_lock_store_errors_total | counter | store, operation |
| keel_lock_renewals_total | counter | store, lock, outcome (metrics.RENEWAL_OUTCOMES) |
| keel_lock_held | gauge | store, lock |

In one process the numbers are kept here, and `collector()` (registered in prometheus_client's
default REGISTRY) reads them at scrape time. Each thread counts into series of its own, so a
step of a lock takes no mutex at all (prometheus_client takes one per sample): a series is
written only by its thread, under the GIL, and read by the scrape, which folds the series of
threads that ended into one that stays. With PROMETHEUS_MULTIPROC_DIR set
(gunicorn workers, Celery prefork) each step writes prometheus_client's own metrics, whose
files `MultiProcessCollector` sums; the gauge counts the live processes' holds ("livesum").
"""

from __future__ import annotations

import os
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, TypeVar

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from ..exceptions import LockStoreUnavailable
from .base import ACQUIRE_OUTCOMES, ENDS, Recorder

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from ..core import Lock

__all__ = ["HELD_BUCKETS", "WAIT_BUCKETS", "collector", "recorder"]

#: keel_lock_wait_seconds buckets: a lock is usually free (under a millisecond) or waited for.
WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
#: keel_lock_held_seconds buckets: from a request's few milliseconds to a nightly job's hours.
HELD_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600, 14400)
_ACQUIRED, _ERROR = 0, 3  # the indexes in ACQUIRE_OUTCOMES
_OUTCOME = {name: index for index, name in enumerate(ACQUIRE_OUTCOMES)}
_END = {name: index for index, name in enumerate(ENDS)}
_FORCED = _END["forced"]

#: Each kind of metric: prometheus_client's metric class, and its family's.
_KINDS: dict[str, tuple[Any, Any]] = {
    "counter": (Counter, CounterMetricFamily),
    "histogram": (Histogram, HistogramMetricFamily),
    "gauge": (Gauge, GaugeMetricFamily),
}


class _Metric(NamedTuple):
    """One metric, defined once for both ways of showing it: prometheus_client's metric in
    multiprocess mode (`shared`) and the family a scrape of this process's numbers fills
    (`family`)."""

    name: str
    kind: Literal["counter", "histogram", "gauge"]
    help: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] = ()

    def shared(self) -> Any:
        """prometheus_client's metric for multiprocess mode, in no registry:
        `MultiProcessCollector` reads what it writes (a gauge sums the live processes')."""
        extra: dict[str, Any] = {}
        if self.kind == "histogram":
            extra["buckets"] = self.buckets
        elif self.kind == "gauge":
            extra["multiprocess_mode"] = "livesum"
        return _KINDS[self.kind][0](self.name, self.help, list(self.labels), registry=None, **extra)

    def family(self) -> Any:
        """An empty metric family, for a scrape to fill."""
        return _KINDS[self.kind][1](self.name, self.help, labels=list(self.labels))


class _Metrics(NamedTuple):
    """Every metric, in the order a scrape shows them."""

    acquire: _Metric
    wait: _Metric
    held_seconds: _Metric
    lost: _Metric
    store_errors: _Metric
    renewals: _Metric
    held: _Metric


_SERIES = ("store", "lock")
_METRICS = _Metrics(
    _Metric("keel_lock_acquire", "counter", "Lock acquires by outcome.", (*_SERIES, "outcome")),
    _Metric(
        "keel_lock_wait_seconds",
        "histogram",
        "Seconds an acquire took, by outcome.",
        (*_SERIES, "outcome"),
        WAIT_BUCKETS,
    ),
    _Metric(
        "keel_lock_held_seconds",
        "histogram",
        "Seconds a lock was held, by how the hold ended.",
        (*_SERIES, "end"),
        HELD_BUCKETS,
    ),
    _Metric("keel_lock_lost", "counter", "Locks lost while held, by reason.", (*_SERIES, "reason")),
    _Metric(
        "keel_lock_store_errors",
        "counter",
        "Store operations that failed (LockStoreUnavailable).",
        ("store", "operation"),
    ),
    _Metric(
        "keel_lock_renewals", "counter", "Watchdog extends, by outcome.", (*_SERIES, "outcome")
    ),
    _Metric("keel_lock_held", "gauge", "Locks held right now.", _SERIES),
)


class _Histogram:
    """One histogram's buckets (not cumulative) and sum."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: +Inf
        self.total = 0.0

    @property
    def count(self) -> int:
        return sum(self.counts)

    def buckets(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        return out


class _Series:
    """One lock name's numbers in one store, counted by one thread. Only histograms: an
    acquire counter is its wait histogram's count, and the held gauge is the acquisitions less
    the holds that ended, so each step of a lock updates one histogram."""

    __slots__ = ("held_for", "labels", "lost", "renewals", "thread", "waits")

    def __init__(self, store: str, lock: str, thread: threading.Thread | None) -> None:
        self.labels = (store, lock)
        self.thread = thread  # the only writer; None: the scrape's fold of ended threads
        self.waits = [_Histogram(_METRICS.wait.buckets) for _ in ACQUIRE_OUTCOMES]
        self.held_for = [_Histogram(_METRICS.held_seconds.buckets) for _ in ENDS]
        self.lost: dict[str, int] = {}
        self.renewals: dict[str, int] = {}

    def observe(self, histogram: _Histogram, value: float) -> None:
        histogram.counts[bisect_left(histogram.bounds, value)] += 1
        histogram.total += value

    def held(self) -> int:
        ended = sum(histogram.count for end, histogram in zip(ENDS, self.held_for, strict=True)
                    if end != "forced")  # fmt: skip
        return self.waits[_ACQUIRED].count - ended

    def add(self, other: _Series) -> None:
        """Take in the numbers of `other`, whose thread ended."""
        for mine, theirs in zip(
            (*self.waits, *self.held_for), (*other.waits, *other.held_for), strict=True
        ):
            mine.counts = [a + b for a, b in zip(mine.counts, theirs.counts, strict=True)]
            mine.total += theirs.total
        for table, more in ((self.lost, other.lost), (self.renewals, other.renewals)):
            for key, count in more.items():
                table[key] = table.get(key, 0) + count


class _SharedSeries:
    """One lock name's numbers in one store, written to prometheus_client's metrics (its
    multiprocess files). The children are looked up once: `labels()` costs a microsecond."""

    def __init__(self, metrics: _SharedMetrics, store: str, lock: str) -> None:
        self.metrics, self.labels = metrics, (store, lock)
        self.acquires = [metrics.acquire.labels(store, lock, each) for each in ACQUIRE_OUTCOMES]
        self.waits = [metrics.wait.labels(store, lock, each) for each in ACQUIRE_OUTCOMES]
        self.held_for = [metrics.held_seconds.labels(store, lock, each) for each in ENDS]
        self.held = metrics.held.labels(store, lock)

    def count(self, outcome: int, waited: float, held: int) -> None:
        self.acquires[outcome].inc()
        self.waits[outcome].observe(waited)
        if held:
            self.held.inc(held)

    def end(self, end: int, seconds: float, reason: str | None, held: int) -> None:
        self.held_for[end].observe(seconds)
        if held:
            self.held.inc(held)
        if reason is not None:
            self.metrics.lost.labels(*self.labels, reason).inc()

    def renewal(self, outcome: str) -> None:
        self.metrics.renewals.labels(*self.labels, outcome).inc()


S = TypeVar("S")


def _one_of(
    table: dict[tuple[str, str], S],
    mutex: threading.Lock,
    store: str,
    lock: str,
    make: Callable[[], S],
) -> S:
    """The series of (store, lock) in `table`, made by `make()` the first time."""
    with mutex:
        found = table.get((store, lock))
        if found is None:
            found = table[store, lock] = make()
        return found


class _SharedMetrics:
    """prometheus_client's metrics for multiprocess mode (`_Metric.shared`)."""

    acquire: Counter
    wait: Histogram
    held_seconds: Histogram
    lost: Counter
    store_errors: Counter
    renewals: Counter
    held: Gauge

    def __init__(self) -> None:
        (
            self.acquire,
            self.wait,
            self.held_seconds,
            self.lost,
            self.store_errors,
            self.renewals,
            self.held,
        ) = (metric.shared() for metric in _METRICS)
        self.series: dict[tuple[str, str], _SharedSeries] = {}
        self.mutex = threading.Lock()

    def get(self, store: str, lock: str) -> _SharedSeries:
        make = lambda: _SharedSeries(self, store, lock)  # noqa: E731
        return _one_of(self.series, self.mutex, store, lock, make)


class _Local(threading.local):
    """Each thread's own series, by (store, lock). The dict's identity tells a handle's cached
    series apart from another thread's (a thread id can be reused; this dict, cached, cannot)."""

    def __init__(self) -> None:
        self.series: dict[tuple[str, str], _Series] = {}


class _Numbers(Collector):
    """Every series of this process, as Prometheus metric families at each scrape."""

    def __init__(self) -> None:
        #: Per (store, lock): the series of each thread that counted it, the first being the
        #: fold of the threads that ended.
        self.series: dict[tuple[str, str], list[_Series]] = {}
        self.store_errors: dict[tuple[str, str], int] = {}
        self.mutex = threading.Lock()
        self.local = _Local()

    def get(self, store: str, lock: str) -> _Series:
        """The calling thread's series of (store, lock)."""
        mine = self.local.series
        found = mine.get((store, lock))
        if found is None:
            found = mine[store, lock] = _Series(store, lock, threading.current_thread())
            with self.mutex:
                self.series.setdefault((store, lock), [_Series(store, lock, None)]).append(found)
        return found

    def store_error(self, store: str, operation: str) -> None:
        with self.mutex:
            self.store_errors[store, operation] = self.store_errors.get((store, operation), 0) + 1

    def _gather(self) -> list[_Series]:
        """One series per (store, lock): the sum of its threads' at this moment. The series of
        threads that ended are folded into the first for good (nothing writes them now)."""
        gathered = []
        with self.mutex:
            for (store, lock), every in self.series.items():
                folded = every[0]
                live = [folded]
                for one in every[1:]:
                    if one.thread is not None and one.thread.is_alive():
                        live.append(one)
                    else:
                        folded.add(one)
                every[:] = live
                total = _Series(store, lock, None)
                for one in live:
                    total.add(one)
                gathered.append(total)
        return gathered

    def collect(self) -> Iterator[Metric]:
        families = [metric.family() for metric in _METRICS]
        acquire, wait, held_seconds, lost, errors, renewals, held = families
        with self.mutex:
            for (store, operation), count in self.store_errors.items():
                errors.add_metric([store, operation], count)
        for one in self._gather():
            labels = list(one.labels)
            for name, histogram in zip(ACQUIRE_OUTCOMES, one.waits, strict=True):
                count = histogram.count
                acquire.add_metric([*labels, name], count)
                if count:
                    wait.add_metric([*labels, name], histogram.buckets(), histogram.total)
            for name, histogram in zip(ENDS, one.held_for, strict=True):
                if histogram.count:
                    held_seconds.add_metric([*labels, name], histogram.buckets(), histogram.total)
            for reason, count in one.lost.items():
                lost.add_metric([*labels, reason], count)
            for outcome, count in one.renewals.items():
                renewals.add_metric([*labels, outcome], count)
            held.add_metric(labels, one.held())
        yield from families


_numbers = _Numbers()
_shared: _SharedMetrics | None = None
_registered = False
_mutex = threading.Lock()


def collector() -> Collector:
    """The collector of this process's lock metrics (already in prometheus_client's REGISTRY
    once metrics are on, outside multiprocess mode): register it in a registry of your own."""
    return _numbers


def recorder() -> Recorder:
    """The recorder for this process: multiprocess mode when PROMETHEUS_MULTIPROC_DIR is set."""
    global _shared, _registered
    with _mutex:
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            if _shared is None:
                _shared = _SharedMetrics()
            return SharedRecorder(_shared)
        if not _registered:
            REGISTRY.register(_numbers)
            _registered = True
        return LocalRecorder()


class _Counting(Recorder):
    """What the two ways of counting share: which outcome and which wait a refusal, a store
    failure or a renewal counts (`_waited`, `_renewed` say where)."""

    traces = False

    def _kept(self, handle: Lock, kept: Any) -> Any:
        raise NotImplementedError

    def _waited(self, kept: Any, outcome: int, seconds: float) -> None:
        raise NotImplementedError

    def _renewed(self, kept: Any, outcome: str) -> None:
        raise NotImplementedError

    def refused(
        self, handle: Lock, started: Any, outcome: str, attempts: int, raises: bool, kept: Any
    ) -> Any:
        kept = self._kept(handle, kept)
        self._waited(kept, _OUTCOME[outcome], time.monotonic() - started)
        return kept

    def failed(
        self, handle: Lock, started: Any, error: BaseException, attempts: int, kept: Any
    ) -> Any:
        if isinstance(error, LockStoreUnavailable):
            kept = self._kept(handle, kept)
            self._waited(kept, _ERROR, time.monotonic() - started)
            self.store_error(handle, "acquire")
        return kept

    def renewal(self, handle: Lock, kept: Any, outcome: str) -> None:
        self._renewed(self._kept(handle, kept), outcome)
        if outcome == "error":
            self.store_error(handle, "extend")


class LocalRecorder(_Counting):
    """Counts each step of every lock into this process's series (`collector()` shows them).

    Its `kept` on a handle is (itself, the thread's series dict, the series of the handle's
    store and name): a step in the same thread finds the series without a lookup."""

    def _kept(self, handle: Lock, kept: Any) -> Any:
        """`kept` if it is this recorder's and this thread's, else a new one for them."""
        mine = _numbers.local.series
        if kept is not None and kept[0] is self and kept[1] is mine:
            return kept
        return self, mine, _numbers.get(handle.store_alias, handle.name)

    # `_kept` and `_Series.observe` written out in the two steps of every cycle.
    def acquired(self, handle: Lock, started: Any, attempts: int, kept: Any) -> Any:
        if kept is None or kept[0] is not self or kept[1] is not _numbers.local.series:
            kept = self._kept(handle, None)
        waited = time.monotonic() - started
        histogram = kept[2].waits[_ACQUIRED]
        histogram.counts[bisect_left(WAIT_BUCKETS, waited)] += 1
        histogram.total += waited
        return kept

    def ended(self, handle: Lock, kept: Any, end: str, seconds: float, reason: str | None) -> None:
        if kept is None or kept[0] is not self or kept[1] is not _numbers.local.series:
            kept = self._kept(handle, None)  # another thread's (the watchdog's): not ours
        series: _Series = kept[2]
        histogram = series.held_for[_END[end]]
        histogram.counts[bisect_left(HELD_BUCKETS, seconds)] += 1
        histogram.total += seconds
        if reason is not None:
            series.lost[reason] = series.lost.get(reason, 0) + 1

    def _waited(self, kept: Any, outcome: int, seconds: float) -> None:
        series: _Series = kept[2]
        series.observe(series.waits[outcome], seconds)

    def _renewed(self, kept: Any, outcome: str) -> None:
        renewals = kept[2].renewals
        renewals[outcome] = renewals.get(outcome, 0) + 1

    def store_error(self, handle: Lock, operation: str) -> None:
        _numbers.store_error(handle.store_alias, operation)

    def forced(self, store: str, name: str, seconds: float | None) -> None:
        if seconds is not None:
            series = _numbers.get(store, name)
            series.observe(series.held_for[_FORCED], seconds)


class SharedRecorder(_Counting):
    """Writes each step of every lock to prometheus_client's metrics (multiprocess mode).

    Its `kept` on a handle is (itself, the series of the handle's store and name)."""

    def __init__(self, shared: _SharedMetrics) -> None:
        self.shared = shared

    def _kept(self, handle: Lock, kept: Any) -> Any:
        if kept is not None and kept[0] is self:
            return kept
        return self, self.shared.get(handle.store_alias, handle.name)

    def acquired(self, handle: Lock, started: Any, attempts: int, kept: Any) -> Any:
        kept = self._kept(handle, kept)
        kept[1].count(_ACQUIRED, time.monotonic() - started, 1)
        return kept

    def _waited(self, kept: Any, outcome: int, seconds: float) -> None:
        kept[1].count(outcome, seconds, 0)

    def ended(self, handle: Lock, kept: Any, end: str, seconds: float, reason: str | None) -> None:
        self._kept(handle, kept)[1].end(_END[end], seconds, reason, -1)

    def _renewed(self, kept: Any, outcome: str) -> None:
        kept[1].renewal(outcome)

    def store_error(self, handle: Lock, operation: str) -> None:
        self.shared.store_errors.labels(handle.store_alias, operation).inc()

    def forced(self, store: str, name: str, seconds: float | None) -> None:
        if seconds is not None:
            self.shared.get(store, name).end(_FORCED, seconds, None, 0)
