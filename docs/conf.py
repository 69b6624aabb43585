"""Sphinx configuration for the django-keel-lock documentation site (MyST Markdown, furo)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import django
from django.conf import settings

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# autodoc imports the package, which needs configured settings (no server is contacted).
if not settings.configured:
    settings.configure(
        SECRET_KEY="docs-build-only",
        INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "django_keel_lock"],
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
        USE_TZ=True,
    )
    os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    django.setup()

import django_keel_lock  # noqa: E402

project = "django-keel-lock"
author = "django-keel-lock contributors"
copyright = "django-keel-lock contributors"
release = django_keel_lock.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.viewcode",
    "sphinx_copybutton",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"show-inheritance": True}
# Docstrings use single backticks for code, as in the source.
default_role = "code"


def _public_bases(app: object, name: str, obj: object, options: object, bases: list[type]) -> None:
    """Show only public bases: the stores' listening mixin and the parts `Lock` is made of
    (its methods are shown as its own) are not importable from a public module."""
    bases[:] = [b for b in bases if b.__name__ not in ("ListeningStore", "Holding", "KeyQueries")]


def setup(app: object) -> None:
    app.connect("autodoc-process-bases", _public_bases)  # type: ignore[attr-defined]


html_theme = "furo"
html_title = f"django-keel-lock {release}"
# Long lines of code wrap instead of being cut off at the content column's edge; every block
# has a copy button (sphinx_copybutton, which copies the block as written: no page has prompts).
html_static_path = ["_static"]
html_css_files = ["keel.css"]
