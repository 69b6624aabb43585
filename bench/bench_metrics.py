"""What metrics cost: memory-store acquire+release cycles/s with KEEL_LOCK_METRICS off,
"prometheus" and "otel" (the OpenTelemetry SDK: a batch span processor into an in-memory
exporter, an in-memory metric reader), side by side in one run, through one reused handle
and through `@locked`.

    .venv/bin/python -m bench.bench_metrics [--seconds 6]
"""

from __future__ import annotations

import argparse
import os
import uuid
from collections.abc import Callable
from typing import Any

from .common import interleaved_rates, print_table, setup_django

SETTINGS: dict[str, Any] = {"off": None, "prometheus": "prometheus", "otel": "otel"}
#: Cycles per call of a timed function: switching the recorder costs a little itself.
BATCH = 20


def _otel_sdk() -> None:
    """A real SDK set-up, as an application would have (in memory: no network in the way)."""
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    metrics.set_meter_provider(MeterProvider(metric_readers=[InMemoryMetricReader()]))
    _exporters.append(exporter)


_exporters: list[Any] = []


def _recorders() -> dict[str, Any]:
    """Each setting's recorder, built as override_settings would build it."""
    from django.test import override_settings

    from django_keel_lock import metrics

    built = {}
    for name, value in SETTINGS.items():
        with override_settings(KEEL_LOCK_METRICS=value):
            built[name] = metrics.recorder
    return built


def _timed(recorder: Any, cycle: Callable[[], None]) -> Callable[[], None]:
    from django_keel_lock import metrics

    def run() -> None:
        metrics.recorder = recorder
        for _ in range(BATCH):
            cycle()
        for exporter in _exporters:  # spans would pile up in memory
            exporter.clear()

    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="per figure, in slices")
    args = parser.parse_args(argv)
    setup_django()
    _otel_sdk()
    from django_keel_lock import lock, locked

    recorders = _recorders()
    held = lock(f"bench:metrics:{uuid.uuid4().hex}", store="memory", ttl=30, name="bench")

    def reused() -> None:
        held.acquire()
        held.release()

    @locked("bench:metrics:{n}", store="memory", ttl=30)
    def decorated(n: int) -> None:
        pass

    cycles: dict[str, Callable[[], None]] = {
        "reused handle": reused,
        "@locked": lambda: decorated(1),
    }
    print(f"{os.cpu_count()} CPUs; memory store, about {args.seconds:g}s per figure")
    rows: list[list[object]] = []
    for label, cycle in cycles.items():
        rates = interleaved_rates(
            {name: _timed(recorder, cycle) for name, recorder in recorders.items()}, args.seconds
        )
        off = rates["off"] * BATCH
        row: list[object] = [label]
        for name in SETTINGS:
            per_second = rates[name] * BATCH
            row += [per_second, 1e6 / per_second, f"{off / per_second:.2f}"]
        rows.append(row)
    headers = ["cycle"]
    for name in SETTINGS:
        headers += [f"{name} cycles/s", f"{name} us", f"{name} x off"]
    print_table(headers, rows)


if __name__ == "__main__":
    main()
