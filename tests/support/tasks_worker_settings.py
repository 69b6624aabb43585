"""Settings for the django-tasks-db workers tests/test_tasks.py starts: those of the Celery
workers (the test databases), and the package's log on the worker's output, where the tests
read what it skipped and retried (db_worker sets up only its own loggers)."""

from __future__ import annotations

from tests.support.worker_settings import *  # noqa: F403

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {
        "django_keel_lock": {"level": "INFO", "handlers": ["console"]},
        # A run that waits for its enqueue to claim says so at DEBUG.
        "django_keel_lock.tasks": {"level": "DEBUG"},
    },
}
