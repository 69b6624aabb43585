"""`make test` on a bare Debian machine: .ci/system-deps installs what Debian must provide (as
root, only what is missing) or stops first with one line naming it; the Makefile runs it before
the virtualenv and the [test] extra.

dpkg-query, id, find and apt-get are stand-ins on PATH: the real ones would change this machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .support import ROOT

SCRIPT = ROOT / ".ci" / "system-deps"
TEST_PACKAGES = [
    "libmariadb-dev",
    "pkg-config",
    "gcc",
    "libc6-dev",
    "faketime",
    "chromium",
    "pgbouncer",
    "etcd-server",
]

FAKES = {
    # Installed: the packages named in $FAKE_INSTALLED.
    "dpkg-query": """#!/bin/sh
for arg; do package="$arg"; done
case " $FAKE_INSTALLED " in
  *" $package "*) printf 'install ok installed' ;;
  *) echo "dpkg-query: no packages found matching $package" >&2; exit 1 ;;
esac
""",
    "id": '#!/bin/sh\necho "$FAKE_UID"\n',
    "find": "#!/bin/sh\nexit 0\n",  # package lists never fetched
    "apt-get": '#!/bin/sh\necho "apt-get $*" >> "$FAKE_LOG"\n',
    # Debian's own Python 3.11 (prefix /usr) for the -c the script runs.
    "debian-python": '#!/bin/sh\necho "3.11"\n',
}


def run(tmp_path: Path, *args: str, uid: int, installed: list[str]) -> tuple[int, str, list[str]]:
    """Run .ci/system-deps with the stand-ins: its exit status, stderr, apt-get calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in FAKES.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "apt.log"
    log.touch()
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "FAKE_INSTALLED": " ".join(installed),
        "FAKE_UID": str(uid),
        "FAKE_LOG": str(log),
    }
    proc = subprocess.run([str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stderr, log.read_text().splitlines()


def test_a_machine_with_every_package_installs_nothing_and_says_nothing(tmp_path: Path) -> None:
    status, stderr, apt = run(tmp_path, "test", sys.executable, uid=0, installed=TEST_PACKAGES)
    assert (status, stderr, apt) == (0, "", [])


def test_as_root_the_missing_packages_are_installed_after_one_update(tmp_path: Path) -> None:
    status, _, apt = run(
        tmp_path,
        "test",
        sys.executable,
        uid=0,
        installed=["gcc", "libc6-dev", "chromium", "pgbouncer", "etcd-server"],
    )
    assert status == 0
    assert apt[0] == "apt-get update -qq"
    assert len(apt) == 2
    assert apt[1].startswith("apt-get install -y -qq --no-install-recommends")
    assert apt[1].split()[-3:] == ["libmariadb-dev", "pkg-config", "faketime"]


def test_not_root_it_stops_first_with_one_line_naming_what_to_install(tmp_path: Path) -> None:
    status, stderr, apt = run(
        tmp_path,
        "test",
        sys.executable,
        uid=1000,
        installed=["gcc", "libc6-dev", "faketime", "pgbouncer", "etcd-server"],
    )
    assert status == 1
    assert apt == []
    assert len(stderr.splitlines()) == 1
    assert (
        "sudo apt-get install --no-install-recommends libmariadb-dev pkg-config chromium" in stderr
    )


def test_debians_own_python_needs_its_venv_and_dev_packages(tmp_path: Path) -> None:
    python = str(tmp_path / "bin" / "debian-python")
    status, stderr, _ = run(tmp_path, "test", python, uid=1000, installed=TEST_PACKAGES)
    assert status == 1
    assert "install --no-install-recommends python3.11-venv python3.11-dev " in stderr
    # A virtualenv alone (make demo) needs only venv, not the test suite's packages.
    status, stderr, _ = run(tmp_path, "venv", python, uid=1000, installed=[])
    assert status == 1
    assert "install --no-install-recommends python3.11-venv  (" in stderr


def make_dry_run(goal: str, tmp_path: Path) -> list[str]:
    proc = subprocess.run(
        ["make", "-n", goal, f"VENV={tmp_path / 'venv'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "MAKEFLAGS": ""},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


@pytest.mark.parametrize("goal", ["test", "lint"])
def test_make_checks_the_test_packages_before_the_virtualenv_and_the_install(
    goal: str, tmp_path: Path
) -> None:
    lines = make_dry_run(goal, tmp_path)
    first = next(i for i, line in enumerate(lines) if ".ci/system-deps" in line)
    assert ".ci/system-deps test " in lines[first]
    venv = next(i for i, line in enumerate(lines) if " -m venv " in line)
    install = next(i for i, line in enumerate(lines) if "pip install -q -e '.[test]'" in line)
    assert first < venv < install


def test_make_demo_checks_only_what_a_virtualenv_needs(tmp_path: Path) -> None:
    lines = make_dry_run("demo", tmp_path)
    deps = [line for line in lines if ".ci/system-deps" in line]
    assert len(deps) == 1 and ".ci/system-deps venv " in deps[0]
