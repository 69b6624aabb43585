"""Charging an invoice: the work every surface (view, Celery task, race) protects with a lock."""

from __future__ import annotations

import time

from .models import Charge, Invoice


class StaleFence(Exception):
    """The lock this charge was made under had already been taken over by a newer holder."""


def charge(
    invoice_id: int, *, charged_by: str, fence: int | None, work: float = 0.0
) -> Charge | None:
    """Charge the invoice unless it is paid already (then None).

    Deliberately written like most billing code: read, check, call the provider (`work` seconds),
    write. Nothing here is atomic, so two callers at once would both charge: only the lock on
    "invoice:<pk>" keeps that from happening. `fence` (the lock's) lets the write refuse a
    holder whose lock expired mid-call and was taken over (StaleFence); None skips that check.
    """
    invoice = Invoice.objects.get(pk=invoice_id)
    if invoice.charges.exists():
        return None
    time.sleep(work)  # the payment provider takes its time
    if fence is not None:
        newer = Invoice.objects.filter(pk=invoice_id, last_fence__lt=fence).update(last_fence=fence)
        if not newer:
            raise StaleFence(f"{invoice}: fence {fence} is older than the last charge's")
    return Charge.objects.create(
        invoice=invoice, amount=invoice.amount, charged_by=charged_by, fence=fence
    )
