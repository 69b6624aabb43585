"""A third party runs the contract suite against its own store (docs/writing-a-store.md):
KEEL_LOCK_CONTRACT_STORE names the class, KEEL_LOCK_CONTRACT_OPTIONS its OPTIONS, and
tests/test_contract.py gains the alias "third-party". Each run here is the documented command,
in a child pytest with test databases of its own (another KEEL_TEST_RUN_ID).
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import uuid
from typing import Any

import pytest
from django.conf import settings
from django.core.checks import WARNING, Tags, run_checks
from django.core.management import call_command
from django.test import Client, override_settings

from django_keel_lock import lock

from .support import ROOT

STORES = "tests.support.third_party_store"


def run_contract(
    store: str, options: str | None = None, *extra: str
) -> tuple[int, dict[str, int], str]:
    """The documented command against `store`: its exit code, the counts of its summary line
    ("passed", "failed", "error", ...) and its output."""
    env = {
        **os.environ,
        "KEEL_LOCK_CONTRACT_STORE": store,
        "KEEL_TEST_RUN_ID": f"{settings.RUN_ID}-tp{uuid.uuid4().hex[:6]}",
    }
    env.pop("KEEL_LOCK_CONTRACT_OPTIONS", None)
    if options is not None:
        env["KEEL_LOCK_CONTRACT_OPTIONS"] = options
    command = [sys.executable, "-m", "pytest", "tests/test_contract.py", "-k", "third-party"]
    proc = subprocess.run(
        [*command, "-q", *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    output = proc.stdout + proc.stderr
    summary = [
        line for line in proc.stdout.splitlines() if re.search(r"\d+ \w+.* in [\d.]+s", line)
    ]
    assert summary, f"no summary line:\n{output}"
    counts = {word.rstrip("s"): int(n) for n, word in re.findall(r"(\d+) (\w+)", summary[-1])}
    return proc.returncode, counts, output


def test_the_contract_suite_passes_a_correct_third_party_store() -> None:
    code, counts, output = run_contract(f"{STORES}.DictLockStore", '{"MAX_KEY_LENGTH": 200}')
    assert code == 0, output
    # Every contract test ran once, on the third party's store only.
    contract = (ROOT / "tests" / "test_contract.py").read_text()
    assert counts.get("passed") == len(re.findall(r"^def test_", contract, re.M)) > 0, output
    assert not counts.get("failed") and not counts.get("error"), output


def test_the_contract_suite_fails_a_store_whose_release_ignores_the_owner() -> None:
    code, counts, output = run_contract(f"{STORES}.ReleasesForAnyone")
    assert code == 1, output
    assert counts.get("failed", 0) >= 1, output
    assert (
        "FAILED tests/test_contract.py::"
        "test_release_after_takeover_returns_false_and_keeps_new_holder[third-party]" in output
    ), output


def test_a_misspelled_store_option_fails_the_run_and_is_named() -> None:
    code, counts, output = run_contract(f"{STORES}.DictLockStore", '{"MAX_KEY_LENGHT": 200}', "-x")
    assert code == 1, output
    assert counts.get("passed", 0) == 0, output
    assert "unknown option(s) MAX_KEY_LENGHT for DictLockStore" in output, output


CHECKED = f"{STORES}.CheckedDictLockStore"
CHECKED_STORES = {
    "default": {"BACKEND": "django_keel_lock.stores.MemoryLockStore"},
    "dict": {"BACKEND": CHECKED},
    "eu": {"BACKEND": CHECKED, "OPTIONS": {"REGION": "eu"}},
}


def own_messages(**kwargs: Any) -> list[tuple[str, int, str]]:
    """The messages of the third-party store's own checks among run_checks(**kwargs)'."""
    found = run_checks(**kwargs)
    return [(m.id or "", m.level, m.msg) for m in found if (m.id or "").startswith("dict_store.")]


@override_settings(KEEL_LOCK_STORES=CHECKED_STORES)
def test_a_third_party_stores_own_check_shows_in_manage_py_check() -> None:
    output = io.StringIO()
    call_command("check", stdout=output, stderr=output)

    assert own_messages() == [
        (
            "dict_store.W001",
            WARNING,
            "KEEL_LOCK_STORES['dict'] names no REGION.",
        )
    ]
    assert "dict_store.W001" in output.getvalue() and "Set OPTIONS REGION." in output.getvalue()


@override_settings(KEEL_LOCK_STORES=CHECKED_STORES)
def test_a_third_party_stores_server_check_runs_once_for_all_its_aliases_with_database() -> None:
    asked = own_messages(databases=["default"], tags=[Tags.database])

    assert asked == [
        ("dict_store.W002", WARNING, "Dict stores 'dict', 'eu' have no server to ask.")
    ]
    # `manage.py check` asks for no database: no server checks.
    assert [id for id, _, _ in own_messages()] == ["dict_store.W001"]


@pytest.mark.django_db
@override_settings(KEEL_LOCK_STORES=CHECKED_STORES)
def test_the_admin_lists_a_third_party_stores_locks_with_its_note(
    django_user_model: Any,
) -> None:
    client = Client()
    client.force_login(django_user_model.objects.create_superuser("root", "r@example.com", "pw"))
    with lock("third-party:admin", store="eu", ttl=60) as held:
        html = client.get("/admin/django_keel_lock/lock/stores/").content.decode()
    part = html[html.index('data-store="eu"') :]
    assert "Locks of a dict in this web server process." in part
    assert held.key in part and f">{held.fence}<" in part
