"""`manage.py race` (what `make demo` runs): N processes try to charge the same invoices at once.

Every charge is a non-atomic read-check-sleep-write (invoices/billing.py), so without a working
lock two racers would both charge an invoice. Exit status 0 when every invoice was charged
exactly once, 1 when not, 2 when the lock store cannot be reached.
"""

from __future__ import annotations

import multiprocessing
import queue
import time
from collections import Counter
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandParser
from django.db import connection

from django_keel_lock import LockStoreUnavailable, get_lock_store
from invoices.models import Invoice
from invoices.race import racer

CUSTOMER_PREFIX = "Race customer "


class Command(BaseCommand):
    help = "Race N processes to charge the same invoices through the lock; report the result."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--procs", type=int, default=8, help="racing processes (8)")
        parser.add_argument("--invoices", type=int, default=10, help="invoices to charge (10)")
        parser.add_argument(
            "--work", type=float, default=0.2, help="seconds one charge takes (0.2)"
        )
        parser.add_argument(
            "--no-lock",
            action="store_true",
            help="charge without the lock, to see the double charges it prevents",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        procs, count, work = options["procs"], options["invoices"], options["work"]
        use_lock = not options["no_lock"]
        if procs < 1 or count < 1 or work < 0:
            self.stderr.write("--procs and --invoices must be >= 1 and --work >= 0")
            raise SystemExit(2)

        call_command("migrate", verbosity=0)
        with connection.cursor() as cursor:  # readers never wait for writers; stays on the file
            cursor.execute("PRAGMA journal_mode=WAL")
        store = describe_store()
        try:
            get_lock_store().get("invoice:0")
        except LockStoreUnavailable as exc:
            self.stderr.write(f"The lock store ({store}) cannot be reached: {exc}")
            raise SystemExit(2) from exc

        Invoice.objects.filter(customer__startswith=CUSTOMER_PREFIX).delete()
        invoices = [
            Invoice.objects.create(
                customer=f"{CUSTOMER_PREFIX}{n}",
                amount=Decimal(100 + 10 * n).quantize(Decimal("0.01")),
            )
            for n in range(1, count + 1)
        ]
        ids = [invoice.pk for invoice in invoices]
        connection.close()  # the racers open their own

        mode = "through the lock" if use_lock else "WITHOUT the lock"
        self.stdout.write(
            f"{procs} processes race to charge {count} invoices {mode} "
            f"(lock store: {store}; each charge takes {work:g}s) ..."
        )
        started = time.monotonic()
        reports, crashed = run_racers(procs, ids, work, use_lock)
        elapsed = time.monotonic() - started
        ok = self.report(invoices, reports, crashed, procs, elapsed, use_lock)
        if not ok:
            raise SystemExit(1)

    def report(
        self,
        invoices: list[Invoice],
        reports: list[dict[str, Any]],
        crashed: list[str],
        procs: int,
        elapsed: float,
        use_lock: bool,
    ) -> bool:
        refused: Counter[int] = Counter()
        paid: Counter[int] = Counter()
        errors = list(crashed)
        for report in reports:
            refused.update(report["refused"])
            paid.update(report["paid"])
            errors.extend(report["errors"])

        rows = []
        wrong = []
        for invoice in Invoice.objects.filter(pk__in=[i.pk for i in invoices]).prefetch_related(
            "charges"
        ):
            charges = list(invoice.charges.all())
            by = shorten([c.charged_by for c in charges])
            fence = shorten(["-" if c.fence is None else str(c.fence) for c in charges])
            rows.append((invoice.number, str(len(charges)), by, str(refused[invoice.pk]), fence))
            if len(charges) != 1:
                wrong.append(f"{invoice.number} charged {len(charges)} times")

        header = ("INVOICE", "CHARGES", "CHARGED BY", "ATTEMPTS REFUSED", "FENCE")
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        self.stdout.write("")
        for row in [header, *rows]:
            cells = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
            self.stdout.write("  ".join(cells).rstrip())
        self.stdout.write("")
        attempts = len(invoices) * procs
        starts = [r["started"] for r in reports if r["started"]]
        ends = [r["finished"] for r in reports if r["finished"]]
        racing = max(ends) - min(starts) if starts and ends else elapsed
        self.stdout.write(
            f"{attempts} attempts in {racing:.1f}s (processes started in "
            f"{max(0.0, elapsed - racing):.1f}s): {sum(refused.values())} refused while "
            f"another process held the lock, {sum(paid.values())} found the invoice paid already."
        )
        for error in errors:
            self.stdout.write(self.style.ERROR(f"error: {error}"))
        if wrong or errors:
            problems = "; ".join(wrong) or "no invoice double-charged"
            hint = "" if use_lock else " (expected: --no-lock shows what the lock prevents)"
            self.stdout.write(
                self.style.ERROR(f"FAILED: {problems}; {len(errors)} error(s).{hint}")
            )
            return False
        self.stdout.write(
            self.style.SUCCESS(f"OK: all {len(invoices)} invoices charged exactly once.")
        )
        return True


def shorten(items: list[str], most: int = 3) -> str:
    """One table cell: the item alone, else the first few (without their pids) and a count."""
    if len(items) <= 1:
        return items[0] if items else "-"
    names = [item.split(" (pid")[0] for item in items]
    more = f", ... ({len(items)})" if len(items) > most else ""
    return ", ".join(names[:most]) + more


def describe_store() -> str:
    config = settings.KEEL_LOCK_STORES["default"]
    backend = config["BACKEND"].rsplit(".", 1)[-1]
    if backend == "RedisLockStore":
        return f"redis, {config['OPTIONS']['URL']}"
    return f"database, SQLite {settings.DATABASES['default']['NAME']}"


def run_racers(
    procs: int, ids: list[int], work: float, use_lock: bool
) -> tuple[list[dict[str, Any]], list[str]]:
    """Start the racers, wait for all of them; (their reports, what went wrong with any)."""
    context = multiprocessing.get_context("spawn")  # nothing shared but the database and store
    barrier = context.Barrier(procs)
    results = context.Queue()
    racers = [
        context.Process(target=racer, args=(n, ids, work, use_lock, barrier, results))
        for n in range(1, procs + 1)
    ]
    for process in racers:
        process.start()
    reports: list[dict[str, Any]] = []
    deadline = time.monotonic() + 120
    while len(reports) < procs and time.monotonic() < deadline:
        try:
            reports.append(results.get(timeout=0.5))
        except queue.Empty:
            if not any(process.is_alive() for process in racers) and results.empty():
                break
    crashed = []
    for process in racers:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join()
            crashed.append(f"racer pid {process.pid} did not finish and was killed")
        elif process.exitcode != 0:
            crashed.append(f"racer pid {process.pid} exited with status {process.exitcode}")
    return reports, crashed
