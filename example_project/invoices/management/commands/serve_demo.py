"""`manage.py serve_demo` (what `make serve` runs): migrate, seed, print the login, runserver."""

from __future__ import annotations

import os
from decimal import Decimal
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandParser
from django.db import connection

from invoices.models import Invoice

USERNAME = "admin"
DEFAULT_PASSWORD = "keel-lock-demo"


class Command(BaseCommand):
    help = "Run the example site with a seeded superuser and a few unpaid invoices."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("addrport", nargs="?", default=os.environ.get("ADDR", "127.0.0.1:8000"))

    def handle(self, *args: Any, **options: Any) -> None:
        call_command("migrate", verbosity=0)
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA journal_mode=WAL")
        password = os.environ.get("DEMO_PASSWORD", DEFAULT_PASSWORD)
        user, _ = get_user_model().objects.get_or_create(username=USERNAME)
        user.is_staff = user.is_superuser = True
        user.set_password(password)
        user.save()
        unpaid = Invoice.objects.filter(charges__isnull=True).count()
        for n in range(unpaid, 5):
            Invoice.objects.create(customer=f"Customer {n + 1}", amount=Decimal("49.90") + n)

        addrport = options["addrport"]
        host = addrport if ":" in addrport else f"127.0.0.1:{addrport}"
        self.stdout.write(
            self.style.SUCCESS(
                f"\n  Example site:  http://{host}/\n"
                f"  Admin:         http://{host}/admin/\n"
                f"  Log in as:     user {USERNAME!r}, password {password!r}\n"
            )
        )
        self.stdout.write(
            "  Celery worker (optional, for 'Queue'):\n"
            "    cd example_project && ../.venv/bin/celery -A example_project worker -l INFO\n"
        )
        call_command("runserver", addrport, use_reloader=False)
