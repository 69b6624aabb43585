"""Charging in the background: the same lock as the view, so a task and a request never both
charge one invoice. While another holds it the task retries every 2 s (up to 10 times); without
countdown= it would wait for the holder's lock to expire (up to the 1 minute ttl), which is
right when the holder may have crashed but slow when holders usually finish early.

dedupe="queued": pressing "Queue" again while the first charge still waits in the queue sends
nothing; the page then names the task already queued (one running and one queued at most)."""

from __future__ import annotations

from typing import Any

from celery import Task, shared_task

from django_keel_lock.contrib.celery import current_lock, locked_task

from . import billing


@shared_task(bind=True, max_retries=10)
@locked_task("invoice:{invoice_id}", ttl="1m", on_locked="retry", countdown=2, dedupe="queued")
def charge_invoice(self: Task, invoice_id: int, seconds: float = 0.0) -> dict[str, Any]:
    held = current_lock()
    assert held is not None  # locked_task holds it while the body runs
    done = billing.charge(invoice_id, charged_by=held.holder, fence=held.fence, work=seconds)
    return {"invoice": invoice_id, "charged": done is not None, "fence": held.fence}
