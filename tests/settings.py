"""Test settings: one Django database per real server, one lock store alias per store.

Servers come from env vars with the machine's defaults. A server that does not answer is left
out (its tests skip loudly) except under CI=true, where it stays and its tests fail.
"""

from __future__ import annotations

import os
import socket
import tempfile
from importlib.util import find_spec
from urllib.parse import urlsplit

CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}
RUN_ID = os.environ.get("KEEL_TEST_RUN_ID") or str(os.getpid())
os.environ.setdefault("KEEL_TEST_RUN_ID", RUN_ID)  # subprocesses reuse the same test databases

PG_HOST = os.environ.get("PGHOST", "127.0.0.1")
PG_PORT = int(os.environ.get("PGPORT", "5432"))
PG_USER = os.environ.get("PGUSER", "postgres")
MYSQL_HOST = os.environ.get("MYSQL_HOST", "127.0.0.1")
MYSQL_PORT = int(os.environ.get("MYSQL_PORT", "3306"))
MYSQL_USER = os.environ.get("MYSQL_USER", "root")
MYSQL_DATABASE = os.environ.get("MYSQL_DATABASE", "test")
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
# The caches' database: the next one after the locks' (a cache's clear() flushes its database,
# and check W005 warns of lock stores sharing one).
_redis = urlsplit(REDIS_URL)
REDIS_CACHE_URL = _redis._replace(path=f"/{(int(_redis.path.strip('/') or 0) + 1) % 16}").geturl()
# The name of this process's connections to REDIS_URL (CLIENT SETNAME), so a test counts its own
# connections in CLIENT LIST, never the server's: other programs may use the same Redis.
REDIS_CLIENT_NAME = f"keel-lock-test-{RUN_ID}-{os.getpid()}"


def reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


SERVERS = {
    "postgres": reachable(PG_HOST, PG_PORT),
    "mariadb": reachable(MYSQL_HOST, MYSQL_PORT),
    "redis": reachable(
        urlsplit(REDIS_URL).hostname or "127.0.0.1", urlsplit(REDIS_URL).port or 6379
    ),
}

SECRET_KEY = "tests-only-not-secret"
DEBUG = False
USE_TZ = True
ROOT_URLCONF = "tests.urls"
# tests.urls routes a @lock_view whose key names a kwarg its URL lacks, on purpose (the 500 it
# gives per request is tested): the check that reports it would stop every `check` run here.
SILENCED_SYSTEM_CHECKS = ["django_keel_lock.E012"]
ALLOWED_HOSTS = ["*"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
STATIC_URL = "/static/"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",  # the live server serves the admin's CSS (browser test)
    "django_keel_lock",
    "tests.testapp",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
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

_sqlite_path = os.path.join(tempfile.gettempdir(), f"keel-lock-test-{RUN_ID}.sqlite3")
DATABASES: dict[str, dict[str, object]] = {
    # A file, not :memory:, so several processes share it.
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": _sqlite_path + ".main",
        "TEST": {"NAME": _sqlite_path},
    },
}
if SERVERS["postgres"] or CI:
    DATABASES["postgres"] = {
        "ENGINE": "django.db.backends.postgresql",
        "HOST": PG_HOST,
        "PORT": PG_PORT,
        "USER": PG_USER,
        "NAME": "postgres",
        "TEST": {"NAME": f"test_keel_lock_{RUN_ID}"},
    }
if SERVERS["mariadb"] or CI:
    DATABASES["mariadb"] = {
        "ENGINE": "django.db.backends.mysql",
        "HOST": MYSQL_HOST,
        "PORT": MYSQL_PORT,
        "USER": MYSQL_USER,
        "PASSWORD": "",
        "NAME": MYSQL_DATABASE,
        "OPTIONS": {"charset": "utf8mb4"},
        "TEST": {"NAME": f"test_keel_lock_{RUN_ID}", "CHARSET": "utf8mb4"},
    }

KEEL_LOCK_STORES = {
    "default": {"BACKEND": "django_keel_lock.stores.DatabaseLockStore"},
    "memory": {"BACKEND": "django_keel_lock.stores.MemoryLockStore"},
    "sqlite": {
        "BACKEND": "django_keel_lock.stores.DatabaseLockStore",
        "OPTIONS": {"DATABASE": "default"},
    },
    "postgres": {
        "BACKEND": "django_keel_lock.stores.DatabaseLockStore",
        "OPTIONS": {"DATABASE": "postgres"},
    },
    "postgres-fast": {
        "BACKEND": "django_keel_lock.stores.DatabaseLockStore",
        "OPTIONS": {"DATABASE": "postgres", "DURABLE": False},
    },
    "mariadb": {
        "BACKEND": "django_keel_lock.stores.DatabaseLockStore",
        "OPTIONS": {"DATABASE": "mariadb"},
    },
    # Reuses the django-redis cache's client and pool (CACHES["locks"] below).
    "redis": {
        "BACKEND": "django_keel_lock.stores.RedisLockStore",
        "OPTIONS": {"CONNECTION": "locks"},
    },
    # Its own redis-py client from a URL, another prefix on the same server.
    "redis-url": {
        "BACKEND": "django_keel_lock.stores.RedisLockStore",
        "OPTIONS": {
            "URL": f"{REDIS_URL}{'&' if '?' in REDIS_URL else '?'}client_name={REDIS_CLIENT_NAME}",
            "KEY_PREFIX": f"keel-lock-test-{RUN_ID}:",
        },
    },
}

# Django Tasks (tests/test_tasks.py): Django 6's own, else the backport; the database backend's
# table lives on PostgreSQL (tests.support.tasks_router), where its worker runs.
_TASKS = "django.tasks" if find_spec("django.tasks") else "django_tasks"
HAS_TASKS = _TASKS == "django.tasks" or find_spec("django_tasks") is not None
HAS_TASKS_DB = HAS_TASKS and find_spec("django_tasks_db") is not None
TASKS: dict[str, dict[str, object]] = {
    "default": {"BACKEND": f"{_TASKS}.backends.immediate.ImmediateBackend"},
    # Keeps what is enqueued and never runs it: a queue nobody consumes.
    "dummy": {"BACKEND": f"{_TASKS}.backends.dummy.DummyBackend", "QUEUES": []},
}
if HAS_TASKS_DB:
    INSTALLED_APPS.append("django_tasks_db")
    TASKS["database"] = {"BACKEND": "django_tasks_db.DatabaseBackend", "QUEUES": []}
    DATABASE_ROUTERS = ["tests.support.tasks_router.TasksOnPostgres"]

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "loggers": {"django_keel_lock": {"level": "DEBUG"}},
}

_REDIS_CACHE_OPTIONS = {
    "CLIENT_CLASS": "django_redis.client.DefaultClient",
    "CONNECTION_POOL_KWARGS": {"client_name": REDIS_CLIENT_NAME},
}
CACHES = {
    "default": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": REDIS_CACHE_URL,
        "OPTIONS": _REDIS_CACHE_OPTIONS,
    },
    # Only the "redis" lock store's connection, on the locks' database.
    "locks": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": REDIS_URL,
        "OPTIONS": _REDIS_CACHE_OPTIONS,
    },
}
