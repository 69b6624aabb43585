"""The example project as a newcomer meets it: `make demo`'s race on each store, and the site."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.conftest import require_reachable
from tests.settings import REDIS_URL

from .support import ROOT

EXAMPLE = ROOT / "example_project"


def run_example(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "example_project.settings",
        "EXAMPLE_DB": str(tmp_path / "example.sqlite3"),
        "KEEL_LOCK_STORE": "database",
        "PYTHONPATH": os.pathsep.join([str(EXAMPLE), str(ROOT)]),
        **env,
    }
    return subprocess.run(
        [sys.executable, *args],
        cwd=EXAMPLE,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )


def require_redis() -> None:
    parts = urlsplit(REDIS_URL)
    require_reachable(parts.hostname or "127.0.0.1", parts.port or 6379, "Redis")


@pytest.mark.parametrize("store", ["database", "redis"])
def test_demo_race_charges_every_invoice_exactly_once(tmp_path: Path, store: str) -> None:
    if store == "redis":
        require_redis()
    done = run_example(
        tmp_path,
        *("manage.py", "race", "--procs", "4", "--invoices", "4", "--work", "0.1"),
        KEEL_LOCK_STORE=store,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "OK: all 4 invoices charged exactly once.", done.stdout
    assert sum(line.startswith("INV-") for line in lines) == 4


def test_demo_race_reports_an_unreachable_store(tmp_path: Path) -> None:
    done = run_example(
        tmp_path,
        *("manage.py", "race", "--procs", "2", "--invoices", "1"),
        KEEL_LOCK_STORE="redis",
        REDIS_URL="redis://127.0.0.1:1/0",
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "cannot be reached" in done.stderr


def test_example_site_view_task_and_admin(tmp_path: Path) -> None:
    done = run_example(
        tmp_path,
        str(ROOT / "tests" / "support" / "example_checks.py"),
        CELERY_TASK_ALWAYS_EAGER="1",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("ok")
