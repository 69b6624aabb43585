"""The Celery app the Celery tests run a real worker for: Redis as broker and result backend,
on its own database number and a queue named after the test run, so parallel runs never share
messages."""

from __future__ import annotations

import os
from urllib.parse import urlsplit, urlunsplit

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.support.worker_settings")

RUN_ID = os.environ.get("KEEL_TEST_RUN_ID") or str(os.getpid())
QUEUE = f"keel-lock-test-{RUN_ID}"
#: The lock store alias (tests/settings.py) both the tests and the worker use.
STORE = os.environ.get("KEEL_CELERY_TEST_STORE", "sqlite")


def _broker_url() -> str:
    explicit = os.environ.get("KEEL_CELERY_BROKER_URL")
    if explicit:
        return explicit
    parts = urlsplit(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    return urlunsplit((parts.scheme, parts.netloc, "/5", "", ""))


BROKER_URL = _broker_url()

app = Celery("keel_lock_tests", include=["tests.support.celery_tasks"])
app.conf.update(
    broker_url=BROKER_URL,
    result_backend=BROKER_URL,
    task_default_queue=QUEUE,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    result_expires=600,
    worker_prefetch_multiplier=1,  # a busy worker process must not sit on duplicates
    broker_connection_retry_on_startup=True,
)
