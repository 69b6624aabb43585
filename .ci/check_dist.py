"""Check what `make dist` built: the sdist can run the test suite, the wheel is the package only.

Usage: python .ci/check_dist.py DIST_DIR
"""

from __future__ import annotations

import sys
import tarfile
import zipfile
from pathlib import Path

SDIST_NEEDS = [
    "LICENSE",
    "CHANGELOG.md",
    "README.md",
    "Makefile",
    "tox.ini",
    "setup.cfg",
    "pyproject.toml",
    "tests/conftest.py",
    "tests/settings.py",
    "tests/urls.py",
    "tests/testapp/models.py",
    "tests/support/redis_servers.py",
    "example_project/manage.py",
    "django_keel_lock/py.typed",
    "django_keel_lock/migrations/0001_initial.py",
]
WHEEL_NEEDS = [
    "django_keel_lock/__init__.py",
    "django_keel_lock/py.typed",
    "django_keel_lock/migrations/0001_initial.py",
    "django_keel_lock/templates/admin/django_keel_lock/lock/stores.html",
    "django_keel_lock/management/commands/locks.py",
]


def main(dist: Path) -> int:
    problems: list[str] = []
    (sdist,) = dist.glob("*.tar.gz")
    (wheel,) = dist.glob("*.whl")
    with tarfile.open(sdist) as tar:
        # Every member sits under "<name>-<version>/".
        names = {name.partition("/")[2] for name in tar.getnames()}
    problems += [f"{sdist.name} lacks {need}" for need in SDIST_NEEDS if need not in names]
    problems += [f"{sdist.name} carries {name}" for name in names if "__pycache__" in name]
    with zipfile.ZipFile(wheel) as whl:
        members = whl.namelist()
    problems += [f"{wheel.name} lacks {need}" for need in WHEEL_NEEDS if need not in members]
    problems += [
        f"{wheel.name} carries {name}, which is not the package"
        for name in members
        if not name.startswith("django_keel_lock/") and ".dist-info/" not in name
    ]
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print(f"{sdist.name}: {len(names)} files; {wheel.name}: {len(members)} files; as expected")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
