"""The database router of the test settings: django-tasks-db's table on PostgreSQL, where the
real worker of tests/test_tasks.py runs; every other app as without a router."""

from __future__ import annotations

from typing import Any

from django.conf import settings

APP = "django_tasks_db"


def _database() -> str:
    return "postgres" if "postgres" in settings.DATABASES else "default"


class TasksOnPostgres:
    def db_for_read(self, model: type[Any], **hints: Any) -> str | None:
        return _database() if model._meta.app_label == APP else None

    def db_for_write(self, model: type[Any], **hints: Any) -> str | None:
        return _database() if model._meta.app_label == APP else None

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool | None:
        return db == _database() if app_label == APP else None
