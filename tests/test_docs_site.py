"""The documentation as a reader gets it: `pip install -e '.[docs,redis,celery]'` (what `make docs`
and Read the Docs install) is enough to build it, its code blocks are whole and have a copy
button, the home page does not repeat the sidebar, the benchmarks page is current tables, and
the package's long description (README.md) links only to absolute URLs.
"""

from __future__ import annotations

import configparser
import importlib.metadata
import os
import re
import runpy
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from .conftest import skip_or_fail
from .support import ROOT, browser

DOCS = ROOT / "docs"
CHECK_DIST: dict[str, Any] = runpy.run_path(str(ROOT / ".ci" / "check_dist.py"))
#: The extras `make docs` and .readthedocs.yaml install.
DOCS_EXTRAS = {"docs", "redis", "celery"}
#: What every virtualenv has, whatever its requirements say (the build tools' own hooks).
VENV_BASE = {"pip", "setuptools"}
#: Where furo's content column ends at a 1,400 px window: code must fit inside it.
VIEWPORT = {"width": 1400, "height": 1000}


#: Runs sphinx-build with the modules of the distributions KEEL_DOCS_BLOCKED names failing to
#: import, as in a virtualenv that does not have them.
BUILD_WITHOUT = """
import os, sys
blocked = set(os.environ["KEEL_DOCS_BLOCKED"].split(","))
class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (not installed)", name=name)
sys.meta_path.insert(0, NotInstalled())
from sphinx.cmd.build import main
sys.exit(main(sys.argv[1:]))
"""


def setup_cfg_requirements(extras: set[str]) -> list[Requirement]:
    """What setup.cfg says `pip install -e '.[extras]'` installs (not the installed metadata,
    which is as old as the last install)."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    lines = config["options"]["install_requires"].splitlines()
    for extra in extras:
        lines += config["options.extras_require"][extra].splitlines()
    return [Requirement(line) for line in lines if line.strip()]


def requirement_closure(requirements: list[Requirement]) -> set[str]:
    """The distributions `requirements` need, themselves included, recursively, as far as they
    are installed here."""
    seen: set[str] = set()
    todo = [(req.name, set(req.extras)) for req in requirements]
    while todo:
        dist_name, dist_extras = todo.pop()
        key = f"{canonicalize_name(dist_name)}{sorted(dist_extras)}"
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = importlib.metadata.distribution(dist_name).requires or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            wanted = req.marker is None or any(
                req.marker.evaluate({"extra": extra}) for extra in dist_extras | {""}
            )
            if wanted:
                todo.append((req.name, set(req.extras)))
    return {key.partition("[")[0] for key in seen}


def not_in_the_docs_extras() -> set[str]:
    """The top-level modules that only distributions outside `.[docs,redis,celery]` provide."""
    allowed = requirement_closure(setup_cfg_requirements(DOCS_EXTRAS)) | VENV_BASE
    allowed.add("django-keel-lock")
    return {
        module
        for module, dists in importlib.metadata.packages_distributions().items()
        if module not in sys.stdlib_module_names
        and not {canonicalize_name(d) for d in dists} & allowed
    }


@pytest.fixture(scope="module")
def built_docs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site built with warnings as errors by what `.[docs,redis,celery]` installs alone:
    every other installed distribution's modules fail to import, as in a new virtualenv."""
    problem = browser.missing("sphinx", "furo", "myst_parser")
    if problem:
        skip_or_fail(f"DOCS SITE TEST CANNOT RUN HERE (it fails under CI=true): {problem}")
    out = tmp_path_factory.mktemp("html")
    sphinx_args = ["-W", "--keep-going", "-q", "-b", "html", str(DOCS), str(out)]
    proc = subprocess.run(
        [sys.executable, "-c", BUILD_WITHOUT, *sphinx_args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
        env={**os.environ, "KEEL_DOCS_BLOCKED": ",".join(sorted(not_in_the_docs_extras()))},
    )
    assert proc.returncode == 0, (
        "sphinx-build with only `pip install -e '.[docs,redis,celery]'` failed (does the docs "
        f"extra lack a module the build needs?):\n{proc.stdout}\n{proc.stderr}"
    )
    return out


def test_the_docs_build_with_only_the_docs_extras_installed(built_docs: Path) -> None:
    assert (built_docs / "reference" / "api.html").exists()


@pytest.fixture(scope="module")
def page(built_docs: Path) -> Iterator[Any]:
    with browser.chromium_page() as page:
        page.set_viewport_size(VIEWPORT)
        yield page


def test_every_code_block_fits_its_column_and_has_a_copy_button(
    built_docs: Path, page: Any, tmp_path: Path
) -> None:
    site = built_docs
    cut_off: dict[str, int] = {}
    without_button: dict[str, int] = {}
    for html in sorted(site.rglob("*.html")):
        name = html.relative_to(site).as_posix()
        if name.startswith(("_modules/", "_sources/", "genindex", "search", "py-modindex")):
            continue
        page.goto(html.as_uri())
        blocks = page.locator("div.highlight")
        # A block cut off: its lines run past the box the reader sees (behind a scrollbar).
        overflowing = page.evaluate(
            "() => Array.from(document.querySelectorAll('div.highlight pre'))"
            ".filter(pre => pre.scrollWidth > pre.clientWidth + 1).length"
        )
        if overflowing:
            cut_off[name] = overflowing
        buttons = page.locator("div.highlight button.copybtn").count()
        if buttons != blocks.count():
            without_button[name] = blocks.count() - buttons
    assert not cut_off, f"code blocks cut off at {VIEWPORT['width']} px (page: blocks): {cut_off}"
    assert not without_button, f"code blocks without a copy button (page: blocks): {without_button}"
    page.goto((site / "quickstart.html").as_uri())
    page.locator("div.highlight").first.hover()
    # The button fades in (a CSS transition): wait for it, generously.
    shown = page.wait_for_function(
        "() => getComputedStyle(document.querySelector('div.highlight button.copybtn'))"
        ".opacity > 0.9",
        timeout=10_000,
    )
    page.screenshot(path=str(tmp_path / "quickstart.png"))
    assert shown, "the copy button does not show on hover"


def test_the_home_page_starts_the_reader_without_repeating_the_sidebar(
    built_docs: Path, page: Any
) -> None:
    page.goto((built_docs / "index.html").as_uri())
    inline_tree_links = page.locator("article .toctree-wrapper a").count()
    assert inline_tree_links == 0, "the home page shows the table of contents the sidebar shows"
    start_here = page.locator("article section#start-here").inner_text()
    sidebar = page.locator(".sidebar-tree").inner_text()
    for first_steps in ("Quick start", "Tutorial", "Concepts"):
        assert first_steps in start_here
        assert first_steps in sidebar
    assert "Benchmarks" in sidebar and "Changelog" in sidebar


def test_the_benchmarks_page_is_current_tables_with_how_to_reproduce(
    built_docs: Path, page: Any
) -> None:
    page.goto((built_docs / "benchmarks.html").as_uri())
    text = page.locator("article").inner_text()
    sections = page.locator("article section section").evaluate_all(
        "sections => sections.filter(s => s.querySelector(':scope > h2'))"
        ".map(s => [s.querySelector(':scope > h2').innerText, s.querySelectorAll('table').length])"
    )
    assert "make bench" in text and "python -m bench.bench_db" in text
    assert "2 CPU cores" in text
    assert not re.search(r"\bissues? \d", text, re.IGNORECASE), "internal issue numbers"
    tables = {title: count for title, count in sections if "reproduce" not in title}
    assert len(tables) >= 7 and set(tables.values()) == {1}, tables


def test_the_long_description_links_only_to_absolute_urls() -> None:
    relative = CHECK_DIST["relative_links"](ROOT.joinpath("README.md").read_text("utf-8"))
    assert relative == [], f"README.md links that lead nowhere on a package index: {relative}"
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    urls = dict(
        line.split(" = ", 1) for line in config["metadata"]["project_urls"].strip().splitlines()
    )
    assert set(urls) >= {"Documentation", "Changelog"}
    assert all(url.startswith("https://") for url in urls.values()), urls


def test_check_dist_names_a_relative_link_and_a_missing_project_url() -> None:
    metadata = (
        "Metadata-Version: 2.1\nName: django-keel-lock\n"
        "Project-URL: Changelog, https://example.org/changelog.html\n\n"
        "See [the guide](docs/guide.md), [the site](https://example.org/) and [ref][r].\n\n"
        '[r]: CHANGELOG.md\n<img src="docs/logo.png">\n'
    )
    problems = CHECK_DIST["metadata_problems"]("x.whl", metadata)
    assert [p.split("'")[1] for p in problems if "links to" in p] == [
        "docs/guide.md",
        "CHANGELOG.md",
        "docs/logo.png",
    ]
    assert any("no Project-URL 'Documentation'" in p for p in problems)
    assert not any("'Changelog'" in p for p in problems)
