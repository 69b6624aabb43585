"""Every example in docs/*.md and README.md's Quick start works as a reader runs it, and the
built site renders.

Each page runs the way `.ci/docs_as_reader.py` follows it (read its docstring for the rules):
in a new `startproject` of its own, in a venv with the package built as a wheel from this
checkout and this interpreter's Django, with only the settings, files and commands the page
shows. A block may be skipped only with a marker on the line before it,
`<!-- not-runnable: why -->`, for commands of this repository's checkout or code that needs a
worker.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import django
import pytest

from .conftest import skip_or_fail
from .support import ROOT, browser
from .support.markdown import Block, blocks_of

DOCS = ROOT / "docs"
BUILD = DOCS / "_build" / "html"
PAGES = sorted(DOCS.rglob("*.md"))
PAGES = [p for p in PAGES if "_build" not in p.parts] + [ROOT / "README.md"]
#: Few blocks may be skipped: most examples must run.
MAX_SKIPPED = 12


def _load_reader() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_as_reader", ROOT / ".ci/docs_as_reader.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


reader = _load_reader()
READ = [(page, section) for page, section in reader.pages_to_read([])]


def example_blocks(path: Path) -> list[Block]:
    return [b for b in blocks_of(path) if b.language in {"python", "py", "sh"}]


@pytest.fixture(scope="module")
def new_projects(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, dict[str, str]]:
    """The reader's venv (this checkout as a wheel, this Python, this Django) and projects."""
    work = tmp_path_factory.mktemp("reader")
    wheels = work / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(ROOT)],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, f"building the wheel failed:\n{build.stdout}\n{build.stderr}"
    (wheel,) = wheels.glob("*.whl")
    try:
        python, env = reader.prepare(work, wheel, sys.executable, f"django=={django.__version__}")
    except reader.Failed as exc:
        raise AssertionError(str(exc)) from None
    return work, python, env


@pytest.mark.parametrize(("page", "section"), READ, ids=[str(p.relative_to(ROOT)) for p, _ in READ])
def test_every_example_on_the_page_works_in_a_new_project(
    page: Path, section: str | None, new_projects: tuple[Path, str, dict[str, str]]
) -> None:
    work, python, env = new_projects
    try:
        reader.read_page(work, page, section, python, env)
    except reader.Failed as exc:
        raise AssertionError(str(exc)) from None


def test_only_a_few_blocks_are_skipped_and_each_says_why() -> None:
    skipped = [b for p in PAGES for b in example_blocks(p) if b.skip_reason is not None]
    assert len(skipped) <= MAX_SKIPPED, [b.where for b in skipped]
    for block in skipped:
        assert len(block.skip_reason or "") >= 15, f"{block.where}: say why it cannot run"
    total = sum(len(example_blocks(p)) for p in PAGES)
    assert total - len(skipped) >= 40, "most examples must run"


def toctree_entries() -> set[str]:
    """Every page a `{toctree}` block of the docs names, as a path under docs/ without suffix."""
    entries = set()
    for page in PAGES:
        if not page.is_relative_to(DOCS):
            continue
        for block in blocks_of(page):
            if block.language == "{toctree}":
                for line in block.code.splitlines():
                    if line.strip() and not line.startswith(":"):
                        entry = (page.parent / line.strip()).relative_to(DOCS)
                        entries.add(entry.as_posix())
    return entries


def test_every_page_is_in_the_site() -> None:
    entries = toctree_entries()
    for page in PAGES:
        if page.is_relative_to(DOCS) and page.name != "index.md":
            name = page.relative_to(DOCS).with_suffix("").as_posix()
            assert name in entries, f"{name} is in no toctree"


# -- the reader can fail -------------------------------------------------------------------


@pytest.mark.parametrize(
    "code",
    [
        'from django_keel_lock import lock\nwith lock("x", tll=5):\n    pass\n',  # renamed argument
        'from django_keel_lock import lock\nwith lock("x") as l:\n    assert l.fence is None\n',
        '# settings.py\nKEEL_LOCK_STORES = {"default": {"BACKEND": '
        '"django_keel_lock.stores.DatabaseLockStore", "OPTIONS": {"DATABSE": "default"}}}\n',
        '# settings.py\nKEEL_LOCK_STORES = {"default": {"BACKEND": "no.such.Store"}}\n',
        "# invoices/models.py\nx = 1\n",  # an app the page never made
    ],
    ids=["renamed-argument", "wrong-claim", "renamed-store-option", "unknown-backend", "no-app"],
)
def test_a_broken_example_fails_the_test(
    code: str, tmp_path: Path, new_projects: tuple[Path, str, dict[str, str]]
) -> None:
    work, python, env = new_projects
    page = tmp_path / "broken.md"
    page.write_text(f"# Broken\n\n```python\n{code}```\n")
    with pytest.raises(reader.Failed, match=r"broken\.md"):
        reader.read_page(work, page, None, python, env)


def test_a_skip_marker_must_sit_on_the_line_before_the_block(tmp_path: Path) -> None:
    page = tmp_path / "marked.md"
    page.write_text(
        "<!-- not-runnable: needs a Redis server -->\n```python\nraise SystemExit\n```\n\n"
        "<!-- not-runnable: too far away -->\n\n```python\nx = 1\n```\n"
    )
    first, second = example_blocks(page)
    assert first.skip_reason == "needs a Redis server"
    assert second.skip_reason is None


# -- the built site in a browser -----------------------------------------------------------

STORES = ["memory", "SQLite", "PostgreSQL", "MariaDB", "Redis", "etcd"]


@pytest.fixture(scope="module")
def built_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    problem = browser.missing("sphinx", "furo", "myst_parser")
    if problem:
        skip_or_fail(f"DOCS BROWSER TEST CANNOT RUN HERE (it fails under CI=true): {problem}")
    out = tmp_path_factory.mktemp("html")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-q",
            "-b",
            "html",
            str(DOCS),
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 0, f"sphinx-build failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def test_the_built_site_shows_the_home_page_and_the_capability_matrix(
    built_site: Path, tmp_path: Path
) -> None:
    with browser.chromium_page() as page:
        page.goto((built_site / "index.html").as_uri())
        title = page.locator("h1").first.inner_text()
        nav = page.locator(".sidebar-tree").text_content() or ""
        page.goto((built_site / "capabilities.html").as_uri())
        table = page.locator("table#store-capability-matrix, section table").first
        headers = [h.strip() for h in table.locator("thead th").all_inner_texts()]
        rows = table.locator("tbody tr").count()
        cells = [
            len(r)
            for r in table.locator("tbody tr").evaluate_all(
                "rows => rows.map(r => Array.from(r.cells).map(c => c.innerText))"
            )
        ]
        visible = table.is_visible()
        page.screenshot(path=str(tmp_path / "capabilities.png"), full_page=True)

    assert title.startswith("django-keel-lock")
    for entry in ("Quick start", "Tutorial", "Store capability matrix", "Reference"):
        assert entry in nav, f"{entry!r} is not in the sidebar: {nav!r}"
    assert visible
    assert headers[1:] == STORES, headers
    assert rows >= 9 and set(cells) == {1 + len(STORES)}, cells


def test_the_api_reference_shows_the_public_api_and_not_the_internal_hooks(
    built_site: Path,
) -> None:
    html = (built_site / "reference" / "api.html").read_text(encoding="utf-8")
    public_names = ("Lock.acquire", "Lock.is_owned", "Lock.ais_owned", "on_lost", "restore_lock")
    public_names += ("semaphore", "Lock.holders", "LockStore.acquire_permit", "plan_acquire")
    for public in public_names:
        assert public in html, public
    for internal in (
        "Lock.from_spec",
        "Lock.confirmed_until",
        "Lock.renewed",
        "Lock.renewal_lost",
        "Lock.extend_op",
        "Lock.release_with",
        "LockStore.submit",
        "ensure_listener",
        "ListeningStore",
    ):
        assert internal not in html, f"{internal} is an internal hook, shown in the API reference"
