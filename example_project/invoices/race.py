"""One racer of `manage.py race`: a separate process that tries to charge every invoice.

Runs in a process started with the "spawn" method, so it sets Django up itself and shares
nothing with its siblings but the database and the lock store.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from typing import Any


def racer(
    index: int, invoice_ids: list[int], work: float, use_lock: bool, barrier: Any, results: Any
) -> None:
    import django

    django.setup()
    from django_keel_lock import lock

    from .billing import charge

    name = f"racer-{index} (pid {os.getpid()})"
    order = list(invoice_ids)
    random.shuffle(order)
    refused: Counter[int] = Counter()
    paid: Counter[int] = Counter()
    errors: list[str] = []

    def attempt(pk: int) -> None:
        if not use_lock:
            if charge(pk, charged_by=name, fence=None, work=work) is None:
                paid[pk] += 1
            return
        handle = lock(f"invoice:{pk}", ttl=10, holder=name)
        outcome = handle.run(lambda: charge(pk, charged_by=name, fence=handle.fence, work=work))
        if not outcome.acquired:
            refused[pk] += 1  # someone else is charging it right now
        elif outcome.value is None:
            paid[pk] += 1  # we got the lock after someone else had charged it

    started = finished = 0.0
    try:
        barrier.wait(timeout=60)  # every racer starts at the same moment
        started = time.time()
        for pk in order:
            try:
                attempt(pk)
            except Exception as exc:
                errors.append(f"{name} on invoice {pk}: {type(exc).__name__}: {exc}")
        finished = time.time()
    finally:
        results.put(
            {
                "racer": name,
                "refused": refused,
                "paid": paid,
                "errors": errors,
                "started": started,
                "finished": finished,
            }
        )
