from __future__ import annotations

from typing import Any

from django.db import migrations, models

SEQUENCE = "django_keel_lock_fence"


def create_vendor_parts(apps: Any, schema_editor: Any) -> None:
    """What the database store needs beyond the table, per database.

    PostgreSQL and MariaDB hand out fences from one sequence (strictly increasing for every
    key, and nothing to lose when rows are pruned). SQLite serialises writers, so it takes
    MAX(fence) + 1 and needs an index for that. MariaDB compares keys byte for byte.
    """
    connection = schema_editor.connection
    quote = connection.ops.quote_name
    if connection.vendor == "postgresql":
        schema_editor.execute(f"CREATE SEQUENCE IF NOT EXISTS {SEQUENCE}")
    elif connection.vendor == "mysql":
        schema_editor.execute(f"CREATE SEQUENCE IF NOT EXISTS {SEQUENCE}")
        schema_editor.execute(
            f"ALTER TABLE django_keel_lock_lock MODIFY {quote('key')} VARCHAR(255) "
            "CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin NOT NULL, "
            "MODIFY holder VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL"
        )
    elif connection.vendor == "sqlite":
        schema_editor.execute(
            "CREATE INDEX IF NOT EXISTS django_keel_lock_lock_fence "
            "ON django_keel_lock_lock (fence)"
        )


def drop_vendor_parts(apps: Any, schema_editor: Any) -> None:
    connection = schema_editor.connection
    if connection.vendor in {"postgresql", "mysql"}:
        schema_editor.execute(f"DROP SEQUENCE IF EXISTS {SEQUENCE}")


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
        migrations.RunPython(create_vendor_parts, drop_vendor_parts, atomic=False),
    ]
