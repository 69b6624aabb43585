"""Settings of the example project. The lock store comes from the environment:

    KEEL_LOCK_STORE=database   (default) the Lock table in this project's SQLite file: no server
    KEEL_LOCK_STORE=redis      Redis at REDIS_URL (default redis://127.0.0.1:6379/0)

Invoices always live in SQLite (db.sqlite3 here, or EXAMPLE_DB); only the locks move.
"""

from __future__ import annotations

import os
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-project-only-not-secret")
DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "[::1]"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_keel_lock",
    "invoices",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]
ROOT_URLCONF = "example_project.urls"
WSGI_APPLICATION = "example_project.wsgi.application"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("EXAMPLE_DB", str(BASE_DIR / "db.sqlite3")),
        # Several processes write this file at once (the race, runserver, a Celery worker):
        # wait for SQLite's write lock instead of failing with "database is locked".
        "OPTIONS": {"timeout": 20},
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"
STATIC_URL = "static/"

# -- locks ---------------------------------------------------------------------------------
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
LOCK_STORE = os.environ.get("KEEL_LOCK_STORE", "database").strip().lower()
if LOCK_STORE == "database":
    KEEL_LOCK_STORES = {
        "default": {
            "BACKEND": "django_keel_lock.stores.DatabaseLockStore",
            "OPTIONS": {"DATABASE": "default"},
        }
    }
elif LOCK_STORE == "redis":
    KEEL_LOCK_STORES = {
        "default": {
            "BACKEND": "django_keel_lock.stores.RedisLockStore",
            "OPTIONS": {"URL": REDIS_URL},
        }
    }
else:
    raise ImproperlyConfigured(f"KEEL_LOCK_STORE must be 'database' or 'redis', got {LOCK_STORE!r}")
KEEL_LOCK_DEFAULT_TTL = 30

# -- Celery (optional: `pip install 'django-keel-lock[celery]'`) ----------------------------
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", REDIS_URL)
CELERY_RESULT_BACKEND = os.environ.get("CELERY_RESULT_BACKEND", REDIS_URL)
CELERY_TASK_ALWAYS_EAGER = os.environ.get("CELERY_TASK_ALWAYS_EAGER", "") == "1"
CELERY_BROKER_CONNECTION_TIMEOUT = 2
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"django_keel_lock": {"handlers": ["console"], "level": "INFO"}},
}
