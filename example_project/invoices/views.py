"""The invoice list (with the locks held right now) and the two ways to charge."""

from __future__ import annotations

import itertools
import os

from django.conf import settings
from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from django_keel_lock import LockStoreUnavailable, get_lock_store, lock_view

from . import billing
from .models import Invoice

MAX_LOCKS_SHOWN = 200


def _seconds(request: HttpRequest) -> float:
    """How long the "payment provider" takes, from the form (0 to 30 s)."""
    try:
        return min(max(float(request.POST.get("seconds", "0")), 0.0), 30.0)
    except ValueError:
        return 0.0


def index(request: HttpRequest) -> HttpResponse:
    invoices = Invoice.objects.prefetch_related("charges").order_by("-pk")  # newest first
    store = get_lock_store()
    try:
        # Through the store's protocol, never its server: the same view for every store.
        held = list(itertools.islice(store.iter_locks(), MAX_LOCKS_SHOWN))
        store_error = None
    except LockStoreUnavailable as exc:
        held, store_error = [], str(exc)
    return render(
        request,
        "invoices/index.html",
        {
            "invoices": invoices,
            "locks": held,
            "store": settings.LOCK_STORE,
            "store_error": store_error,
            "refresh": request.GET.get("refresh", ""),
        },
    )


@require_POST
@lock_view("invoice:<pk>", ttl="1m")  # a second charge of the same invoice meanwhile: 409
def charge(request: HttpRequest, pk: int) -> HttpResponse:
    invoice = get_object_or_404(Invoice, pk=pk)
    done = billing.charge(
        invoice.pk,
        charged_by=f"web pid {os.getpid()}",
        fence=request.keel_lock.fence,  # type: ignore[attr-defined]  # set by lock_view
        work=_seconds(request),
    )
    if done is None:
        messages.info(request, f"{invoice} was paid already: not charged again.")
    else:
        messages.success(request, f"{invoice} charged {done.amount}.")
    return redirect("index")


@lock_view("exports", limit=2, ttl="5m")  # at most 2 exports at once; a third: 409
def export(request: HttpRequest) -> HttpResponse:
    """Every invoice as CSV: heavy enough that the site lets only two run at once."""
    rows = ["invoice,amount,paid"]
    rows += [f"{i.pk},{i.amount},{i.charges.exists()}" for i in Invoice.objects.order_by("pk")]
    return HttpResponse("\n".join(rows) + "\n", content_type="text/csv")


@require_POST
def charge_later(request: HttpRequest, pk: int) -> HttpResponse:
    invoice = get_object_or_404(Invoice, pk=pk)
    try:
        from .tasks import charge_invoice
    except ImportError:
        messages.error(request, "Celery is not installed: pip install 'django-keel-lock[celery]'.")
        return redirect("index")
    try:
        result = charge_invoice.apply_async((invoice.pk, _seconds(request)), retry=False)
    except Exception as exc:  # the broker is down: say so instead of a 500
        messages.error(request, f"Could not queue the task ({type(exc).__name__}: {exc}).")
    else:
        if getattr(result, "duplicate", False):  # a ClaimedResult of dedupe=
            messages.info(
                request,
                f"A charge of {invoice} is queued already (task {result.id}): not sent again "
                '(dedupe="queued").',
            )
            return redirect("index")
        messages.success(
            request,
            f"Queued charge of {invoice} as task {result.id}; a Celery worker runs it "
            f"(cd example_project && ../.venv/bin/celery -A example_project worker -l INFO).",
        )
    return redirect("index")
