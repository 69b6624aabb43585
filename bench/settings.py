"""Settings for the benchmarks: real databases (not test ones), created and migrated on start."""

from __future__ import annotations

import os
import tempfile

SECRET_KEY = "bench-only"
USE_TZ = True
INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth", "django_keel_lock"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
BENCH_DB = os.environ.get("KEEL_BENCH_DB", "keel_lock_bench")  # bench_table has its own
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


def sqlite_path(name: str) -> str:
    """The SQLite file of the bench database `name`."""
    return os.path.join(tempfile.gettempdir(), f"{name.replace('_', '-')}.sqlite3")


DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": sqlite_path(BENCH_DB),
    },
    "postgres": {
        "ENGINE": "django.db.backends.postgresql",
        "HOST": os.environ.get("PGHOST", "127.0.0.1"),
        "PORT": int(os.environ.get("PGPORT", "5432")),
        "USER": os.environ.get("PGUSER", "postgres"),
        "NAME": BENCH_DB,
    },
    "mariadb": {
        "ENGINE": "django.db.backends.mysql",
        "HOST": os.environ.get("MYSQL_HOST", "127.0.0.1"),
        "PORT": int(os.environ.get("MYSQL_PORT", "3306")),
        "USER": os.environ.get("MYSQL_USER", "root"),
        "NAME": BENCH_DB,
        "OPTIONS": {"charset": "utf8mb4"},
    },
}


def _db_store(database: str, **options: object) -> dict[str, object]:
    return {
        "BACKEND": "django_keel_lock.stores.DatabaseLockStore",
        "OPTIONS": {"DATABASE": database, **options},
    }


KEEL_LOCK_STORES = {
    "memory": {"BACKEND": "django_keel_lock.stores.MemoryLockStore"},
    "sqlite": _db_store("default"),
    "postgres": _db_store("postgres"),
    "postgres-fast": _db_store("postgres", DURABLE=False, TRANSACTION_POOLER=False),
    "mariadb": _db_store("mariadb"),
    "redis": {"BACKEND": "django_keel_lock.stores.RedisLockStore", "OPTIONS": {"URL": REDIS_URL}},
}
