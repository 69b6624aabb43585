"""Django settings of a chaos run's processes, from the run's JSON config (KEEL_CHAOS_CONFIG):
the store under test as the "default" alias, the fenced resource on the "default" database."""

from __future__ import annotations

import json
import os

CONFIG = json.loads(os.environ["KEEL_CHAOS_CONFIG"])
SECRET_KEY = "chaos-only"
USE_TZ = True
INSTALLED_APPS = ["django.contrib.contenttypes", "django_keel_lock", "bench.chaos"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DATABASES = CONFIG["databases"]
KEEL_LOCK_STORES = {"default": CONFIG["store"]}
CACHES = CONFIG.get("caches") or {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}
}
LOGGING = {"version": 1, "disable_existing_loggers": False, "root": {"level": "ERROR"}}
