"""Check what `make dist` built: the sdist can run the test suite, the wheel is the package only,
and its long description (README.md, shown on the package index) links only to absolute URLs.

Usage: python .ci/check_dist.py DIST_DIR
"""

from __future__ import annotations

import email
import re
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
    ".ci/system-deps",
    "docs/conf.py",
    "docs/index.md",
    "docs/_static/keel.css",
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

#: The Project-URLs the index shows beside the description.
PROJECT_URLS = ("Documentation", "Changelog")
#: Markdown links and images `[text](target)`, reference definitions `[label]: target`, and
#: HTML `href=`/`src=` attributes: the targets.
LINK_TARGETS = re.compile(
    r"\]\(\s*<?([^)\s>]+)"
    r"|^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)"
    r"|\b(?:href|src)\s*=\s*[\"']([^\"']+)",
    re.MULTILINE,
)
ABSOLUTE = re.compile(r"^(?:https?://|mailto:)", re.IGNORECASE)


def relative_links(markdown: str) -> list[str]:
    """The link targets of `markdown` that are not absolute URLs: on a package index they lead
    nowhere (a `docs/x.md` there is not a page; an anchor is not on the index's page either)."""
    targets = [next(t for t in m.groups() if t) for m in LINK_TARGETS.finditer(markdown)]
    return [t for t in targets if not ABSOLUTE.match(t)]


def metadata_problems(wheel: str, metadata: str) -> list[str]:
    """What is wrong with the wheel's METADATA: relative links in the description, a missing
    Project-URL."""
    message = email.message_from_string(metadata)
    description = message.get_payload() or message.get("Description", "")
    assert isinstance(description, str)
    problems = [
        f"{wheel}: the long description links to {target!r}, which leads nowhere on a package "
        "index: link the docs site's page (an absolute https:// URL) instead"
        for target in relative_links(description)
    ]
    labels = {url.partition(",")[0].strip() for url in message.get_all("Project-URL", [])}
    problems += [
        f"{wheel}: no Project-URL {label!r}: add it to project_urls in setup.cfg"
        for label in PROJECT_URLS
        if label not in labels
    ]
    return problems


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
        (metadata,) = [name for name in members if name.endswith(".dist-info/METADATA")]
        problems += metadata_problems(wheel.name, whl.read(metadata).decode("utf-8"))
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
