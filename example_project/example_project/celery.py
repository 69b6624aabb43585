"""The example's Celery app. Start a worker next to `make serve`:

cd example_project && ../.venv/bin/celery -A example_project worker -l INFO
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.settings")

app = Celery("example_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
