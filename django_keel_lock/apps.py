from __future__ import annotations

from django.apps import AppConfig
from django.core.checks import Tags, register


class KeelLockConfig(AppConfig):
    name = "django_keel_lock"
    label = "django_keel_lock"
    verbose_name = "Keel locks"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks, metrics

        register(checks.check_stores)
        register(checks.check_view_keys, Tags.urls)
        metrics.load()
        register(checks.check_store_servers, Tags.database)
