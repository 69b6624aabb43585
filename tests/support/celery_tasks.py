"""Tasks the real Celery worker runs in tests/test_celery.py.

Charges go to a Redis list per invoice (the "payment provider" both the worker and the test can
read). Each charge is a non-atomic read-check-sleep-write, so without the lock two worker
processes charging the same invoice would both charge it.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Task, shared_task

from django_keel_lock.contrib.celery import current_lock, locked_task
from tests.support.celery_app import REDIS_URL, STORE

KEY = "invoice:{run}:{invoice_id}"


def provider() -> redis.Redis:
    return redis.Redis.from_url(REDIS_URL)


def charges_key(run: str, invoice_id: int) -> str:
    return f"keel-lock-test:{run}:charges:{invoice_id}"


def _charge(task: Task, run: str, invoice_id: int, work: float) -> dict[str, Any]:
    held = current_lock()
    fence = held.fence if held is not None else None
    result = {"pid": os.getpid(), "fence": fence, "retries": task.request.retries}
    client = provider()
    if client.llen(charges_key(run, invoice_id)):  # read, check ...
        return {**result, "charged": False}
    time.sleep(work)  # ... the payment provider takes its time ...
    client.rpush(charges_key(run, invoice_id), json.dumps(result))  # ... write
    return {**result, "charged": True}


@shared_task
def ping() -> int:
    return os.getpid()


@shared_task(bind=True)
@locked_task(KEY, ttl=30, on_locked="skip", store=STORE)
def charge_invoice(self: Task, run: str, invoice_id: int, work: float = 0.3) -> dict[str, Any]:
    return _charge(self, run, invoice_id, work)


@shared_task(bind=True)
def charge_invoice_unlocked(
    self: Task, run: str, invoice_id: int, work: float = 0.3
) -> dict[str, Any]:
    """The same charge without the lock: the control that shows the race is real."""
    return _charge(self, run, invoice_id, work)


@shared_task(bind=True)
@locked_task(KEY, ttl=30, on_locked="raise", store=STORE)
def charge_or_raise(self: Task, run: str, invoice_id: int) -> dict[str, Any]:
    return _charge(self, run, invoice_id, 0)


@shared_task(bind=True, max_retries=10)
@locked_task(KEY, ttl=30, on_locked="retry", store=STORE)
def charge_with_retry(self: Task, run: str, invoice_id: int) -> dict[str, Any]:
    return _charge(self, run, invoice_id, 0)


@shared_task(bind=True, max_retries=1)
@locked_task(KEY, ttl=30, on_locked="retry", countdown=0.2, store=STORE)
def charge_retry_once(self: Task, run: str, invoice_id: int) -> dict[str, Any]:
    return _charge(self, run, invoice_id, 0)


@shared_task(bind=True)
@locked_task(KEY, ttl=4, on_locked="skip", store=STORE)
def charge_slowly(self: Task, run: str, invoice_id: int, seconds: float) -> dict[str, Any]:
    """Holds the lock (ttl 4 s) for `seconds`: the test SIGKILLs the process meanwhile."""
    return _charge(self, run, invoice_id, seconds)


def inside_key(run: str) -> str:
    return f"keel-lock-test:{run}:inside"


@shared_task(bind=True)
@locked_task("export:{run}", ttl=30, limit=2, timeout=60, on_locked="raise", store=STORE)
def limited_export(self: Task, run: str, work: float = 0.2) -> dict[str, Any]:
    """At most 2 at once: counts itself in (INCR answers how many are inside, itself
    included) and out, around its work."""
    held = current_lock()
    client = provider()
    inside = client.incr(inside_key(run))
    try:
        time.sleep(work)
    finally:
        client.decr(inside_key(run))
    return {"pid": os.getpid(), "fence": held.fence if held else None, "inside": inside}


# -- dedupe: each run records itself, then waits until the test opens its gate ---------------
DEDUPE_KEY = "dedupe:{run}"


def runs_key(run: str) -> str:
    return f"keel-lock-test:{run}:runs"


def gate_key(run: str) -> str:
    return f"keel-lock-test:{run}:gate"


def _record_and_wait(task: Task, run: str) -> dict[str, Any]:
    client = provider()
    seen = {"pid": os.getpid(), "id": task.request.id}
    client.rpush(runs_key(run), json.dumps(seen))
    deadline = time.monotonic() + 60
    while not client.exists(gate_key(run)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return seen


@shared_task(bind=True, max_retries=500)
@locked_task(
    DEDUPE_KEY, ttl=30, on_locked="retry", countdown=0.2, dedupe="queued", store=STORE
)  # fmt: skip
def dedupe_queued(self: Task, run: str) -> dict[str, Any]:
    """One running and one queued: a duplicate of a running one waits by retrying."""
    return _record_and_wait(self, run)


@shared_task(bind=True)
@locked_task(DEDUPE_KEY, ttl=30, dedupe="queued", on_duplicate="raise", store=STORE)
def dedupe_or_raise(self: Task, run: str) -> dict[str, Any]:
    return _record_and_wait(self, run)


@shared_task(bind=True, max_retries=100)
@locked_task(
    DEDUPE_KEY, ttl=6, on_locked="retry", countdown=0.5, dedupe="until_done", store=STORE
)  # fmt: skip
def dedupe_until_done(self: Task, run: str) -> dict[str, Any]:
    """Its claim (dedupe_ttl = its ttl, 6 s from the start) lasts while it runs."""
    return _record_and_wait(self, run)


def balance_key(run: str, account: int) -> str:
    return f"keel-lock-test:{run}:balance:{account}"


@shared_task(bind=True)
@locked_task(["account:{run}:{source}", "account:{run}:{target}"], ttl=30, timeout=30,
             on_locked="raise", store=STORE)  # fmt: skip
def transfer(self: Task, run: str, source: int, target: int, amount: int) -> dict[str, Any]:
    """Move `amount` by a non-atomic read, sleep, write of both balances: two runs on one
    account at once would lose one's write."""
    held = current_lock()
    assert held is not None
    client = provider()
    balances = [int(client.get(balance_key(run, a)) or 0) for a in (source, target)]
    time.sleep(0.02)
    client.set(balance_key(run, source), balances[0] - amount)
    client.set(balance_key(run, target), balances[1] + amount)
    return {"pid": os.getpid(), "fences": held.fences}
