"""Tasks the real django-tasks-db worker runs in tests/test_tasks.py, on the "database" task
backend (its table on PostgreSQL) with their locks in the "postgres" store."""

from __future__ import annotations

import os
from typing import Any

from django_keel_lock.contrib.tasks import current_lock, locked_task

try:
    from django.tasks import task
except ImportError:  # Django 5.2: the backport
    from django_tasks import task

BACKEND = "database"
STORE = "postgres"
KEY = "tasks:{run}"


def _ran() -> dict[str, Any]:
    held = current_lock()
    return {"pid": os.getpid(), "fence": held.fence if held is not None else None}


@task(backend=BACKEND)
def ping() -> int:
    return os.getpid()


@locked_task(KEY, ttl=30, on_locked="skip", store=STORE)
@task(backend=BACKEND)
def skipping(run: str) -> dict[str, Any]:
    return _ran()


@locked_task(KEY, ttl=30, on_locked="raise", store=STORE)
@task(backend=BACKEND)
def raising(run: str) -> dict[str, Any]:
    return _ran()


@locked_task(KEY, ttl=30, on_locked="retry", max_retries=10, store=STORE)
@task(backend=BACKEND)
def retrying(run: str) -> dict[str, Any]:
    return _ran()


@locked_task(KEY, ttl=30, on_locked="retry", countdown=0.5, max_retries=100, dedupe="queued",
             store=STORE)  # fmt: skip
@task(backend=BACKEND)
def deduped(run: str) -> dict[str, Any]:
    return _ran()


@locked_task(KEY, ttl=30, dedupe="queued", on_duplicate="raise", store=STORE)
@task(backend=BACKEND)
def deduped_or_raise(run: str) -> dict[str, Any]:
    return _ran()


@locked_task(KEY, ttl=30, dedupe="until_done", on_duplicate="raise", store=STORE)
@task(backend=BACKEND)
def until_done_or_raise(run: str) -> dict[str, Any]:
    return _ran()


#: Named in metrics by its template (tests/test_metrics.py), whatever its key: the run lock,
#: the claim and the gate. Run it on the "default" (immediate) or "dummy" backend.
@locked_task("keel-metrics-task:{name}", store="memory", dedupe="until_done")
@task(backend=BACKEND)
def named(name: str) -> str:
    return name
