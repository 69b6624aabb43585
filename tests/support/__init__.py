"""Helpers the tests share: servers, proxies, child processes, the Celery app and settings."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout
