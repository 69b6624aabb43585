"""Run by tests/test_example_project.py inside the example project (its own settings, a
throw-away SQLite file): the view's 409, the page's lock list, the Celery task, the admin."""

from __future__ import annotations

import threading
import time

import django

django.setup()

from django.contrib.auth import get_user_model  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.test import Client  # noqa: E402
from invoices.models import Invoice  # noqa: E402
from invoices.tasks import charge_invoice  # noqa: E402

from django_keel_lock import get_lock_store, lock, semaphore  # noqa: E402


def main() -> None:
    call_command("migrate", verbosity=0)
    client = Client(HTTP_HOST="localhost")
    store = get_lock_store()

    # The view: while one charge runs, a second charge of the same invoice gets 409.
    invoice = Invoice.objects.create(customer="view", amount="10.00")
    url = f"/invoices/{invoice.pk}/charge/"
    first: dict[str, object] = {}
    slow = threading.Thread(
        target=lambda: first.setdefault(
            "response", Client(HTTP_HOST="localhost").post(url, {"seconds": "1.5"})
        )
    )
    slow.start()
    deadline = time.monotonic() + 10
    while store.get(f"invoice:{invoice.pk}") is None:
        assert time.monotonic() < deadline, "the first charge never took the lock"
        time.sleep(0.02)
    second = client.post(url, {"seconds": "0"})
    assert second.status_code == 409, second.status_code
    assert "Retry-After" in second
    page = client.get("/").content.decode()  # the page lists the lock held right now
    assert f"invoice:{invoice.pk}" in page and "POST invoices/" in page, page
    slow.join()
    assert first["response"].status_code == 302  # type: ignore[attr-defined]
    assert client.post(url, {"seconds": "0"}).status_code == 302  # paid already: no charge
    assert invoice.charges.count() == 1
    assert client.get(url).status_code == 405

    # The export: at most 2 at once, the view's permits shared with semaphore() on its key.
    assert client.get("/exports/invoices.csv").content.startswith(b"invoice,amount,paid\n")
    exports = [semaphore("exports", limit=2, ttl=60) for _ in range(2)]
    assert all(permit.acquire() for permit in exports)
    busy = client.get("/exports/invoices.csv")
    assert busy.status_code == 409 and b"all 2 permits" in busy.content, busy.content
    assert 55 <= int(busy["Retry-After"]) <= 60
    page = client.get("/").content.decode()  # each permit is listed with the locks
    assert page.count("<tr><td>exports</td>") == 2, page
    assert all(permit.release() for permit in exports)

    # The Celery task (eager here): charges under the lock and passes the fence on.
    paid = Invoice.objects.create(customer="task", amount="20.00")
    result = charge_invoice.delay(paid.pk).get()
    assert result["charged"] is True, result
    assert paid.charges.get().fence == result["fence"]
    busy = Invoice.objects.create(customer="busy", amount="30.00")
    with lock(f"invoice:{busy.pk}", ttl=60):
        refused = charge_invoice.apply(args=(busy.pk,))
    assert refused.state == "FAILURE", refused.state
    assert type(refused.result).__name__ == "LockUnavailable"
    assert busy.charges.count() == 0

    # The admin: invoices, and the locks admin when django_keel_lock provides one.
    admin = get_user_model().objects.create_superuser("root", "root@example.com", "pw")
    client.force_login(admin)
    for path in (
        "/admin/",
        "/admin/invoices/invoice/",
        f"/admin/invoices/invoice/{paid.pk}/change/",
    ):
        assert client.get(path).status_code == 200, path
    index = client.get("/admin/").content.decode()
    assert "/admin/django_keel_lock/" in index, "the lock admin is not on the admin index"
    assert client.get("/admin/django_keel_lock/lock/").status_code == 200
    print("ok")


if __name__ == "__main__":
    main()
