"""The Celery apps the Celery tests run a real worker for, one per broker (Redis and RabbitMQ),
with Redis as result backend; a queue named after the test run, so parallel runs never share
messages.

A worker started with `-A tests.support.celery_app` takes `app`, on the broker that
KEEL_CELERY_BROKER_URL names (Redis by default); the test process makes the app of each broker
with `app_for()`.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit, urlunsplit

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.support.worker_settings")

RUN_ID = os.environ.get("KEEL_TEST_RUN_ID") or str(os.getpid())
QUEUE = f"keel-lock-test-{RUN_ID}"
#: The lock store alias (tests/settings.py) both the tests and the worker use.
STORE = os.environ.get("KEEL_CELERY_TEST_STORE", "sqlite")

_redis = urlsplit(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
#: Results, and what the test tasks record (charges, runs): REDIS_URL's server, database 5,
#: whichever broker carries the messages.
REDIS_URL = urlunsplit((_redis.scheme, _redis.netloc, "/5", "", ""))
BROKERS = {
    "redis": REDIS_URL,
    "rabbitmq": os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//"),
}
BROKER_URL = os.environ.get("KEEL_CELERY_BROKER_URL") or BROKERS["redis"]


def _make(broker_url: str, set_as_current: bool) -> Celery:
    made = Celery(
        "keel_lock_tests", include=["tests.support.celery_tasks"], set_as_current=set_as_current
    )
    made.conf.update(
        broker_url=broker_url,
        result_backend=REDIS_URL,
        task_default_queue=QUEUE,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_expires=600,
        worker_prefetch_multiplier=1,  # a busy worker process must not sit on duplicates
        broker_connection_retry_on_startup=True,
    )
    return made


app = _make(BROKER_URL, set_as_current=True)


def app_for(broker_url: str) -> Celery:
    """The app that sends to `broker_url`: `app` itself when it is its broker, else one made
    without becoming the current app (the caller makes it current while its worker runs)."""
    return app if broker_url == BROKER_URL else _make(broker_url, set_as_current=False)
