"""Charging in the background: the same lock as the view, so a task and a request never both
charge one invoice. While it is held the task retries when the holder's lock would expire."""

from __future__ import annotations

from typing import Any

from celery import Task, shared_task

from django_keel_lock.contrib.celery import current_lock, locked_task

from . import billing


@shared_task(bind=True, max_retries=10)
@locked_task("invoice:{invoice_id}", ttl="1m", on_locked="retry")
def charge_invoice(self: Task, invoice_id: int, seconds: float = 0.0) -> dict[str, Any]:
    held = current_lock()
    assert held is not None  # locked_task holds it while the body runs
    done = billing.charge(invoice_id, charged_by=held.holder, fence=held.fence, work=seconds)
    return {"invoice": invoice_id, "charged": done is not None, "fence": held.fence}
