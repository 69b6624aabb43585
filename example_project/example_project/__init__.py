"""Celery is optional here as in the library: without it the site and `make demo` still work."""

from __future__ import annotations

try:
    from .celery import app as celery_app
except ImportError:  # celery not installed
    celery_app = None

__all__ = ["celery_app"]
