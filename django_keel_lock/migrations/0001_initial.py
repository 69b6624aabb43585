from __future__ import annotations

from django.db import migrations, models

from django_keel_lock.migrations._operations import VendorSQL

SEQUENCE = "django_keel_lock_fence"


class Migration(migrations.Migration):
    initial = True
    dependencies = []  # type: ignore[var-annotated]

    operations = [
        migrations.CreateModel(
            name="Lock",
            fields=[
                ("key", models.CharField(max_length=255, primary_key=True, serialize=False)),
                ("owner", models.CharField(max_length=64)),
                ("holder", models.CharField(max_length=255)),
                ("fence", models.BigIntegerField()),
                ("acquired_at", models.DateTimeField()),
                ("expires_at", models.DateTimeField()),
            ],
            options={
                "verbose_name": "lock",
                "verbose_name_plural": "locks",
                "db_table": "django_keel_lock_lock",
                "ordering": ("key",),
                "default_permissions": ("view",),
                "permissions": (("force_release_lock", "Can force-release a lock held by anyone"),),
            },
        ),
        # What the database store needs beyond the table, per database. PostgreSQL and MariaDB
        # hand out fences from one sequence (strictly increasing for every key, and nothing to
        # lose when rows are pruned). SQLite serialises writers, so it takes MAX(fence) + 1 and
        # needs an index for that. MariaDB compares keys byte for byte. Plain SQL through the
        # schema editor, so `sqlmigrate` prints all of it.
        VendorSQL(
            forwards={
                "postgresql": [f"CREATE SEQUENCE IF NOT EXISTS {SEQUENCE}"],
                "mysql": [
                    f"CREATE SEQUENCE IF NOT EXISTS {SEQUENCE}",
                    "ALTER TABLE django_keel_lock_lock MODIFY `key` VARCHAR(255) "
                    "CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin NOT NULL, "
                    "MODIFY holder VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin "
                    "NOT NULL",
                ],
                "sqlite": [
                    "CREATE INDEX IF NOT EXISTS django_keel_lock_lock_fence "
                    "ON django_keel_lock_lock (fence)"
                ],
            },
            # The collations and SQLite's index go with the table, which unapplying the
            # CreateModel above drops next.
            backwards={
                "postgresql": [f"DROP SEQUENCE IF EXISTS {SEQUENCE}"],
                "mysql": [f"DROP SEQUENCE IF EXISTS {SEQUENCE}"],
            },
            description="Fence sequence (PostgreSQL, MariaDB), byte-wise key and holder "
            "collations (MariaDB), fence index (SQLite)",
        ),
    ]
