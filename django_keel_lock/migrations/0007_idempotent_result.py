from __future__ import annotations

from django.db import migrations, models

from ._operations import VendorSQL


class Migration(migrations.Migration):
    """The table of idempotent results (`models.IdempotentResult`). On MariaDB its key is
    compared byte for byte, as the lock table's is: "abc" and "ABC" are two keys."""

    dependencies = [("django_keel_lock", "0006_store_lock")]

    operations = [
        migrations.CreateModel(
            name="IdempotentResult",
            fields=[
                ("key", models.CharField(max_length=255, primary_key=True, serialize=False)),
                ("fingerprint", models.CharField(max_length=64)),
                ("fence", models.BigIntegerField()),
                ("status", models.IntegerField()),
                ("data", models.BinaryField()),
                ("size", models.IntegerField()),
                ("created_at", models.DateTimeField()),
                ("expires_at", models.DateTimeField(db_index=True)),
            ],
            options={
                "verbose_name": "idempotent result",
                "verbose_name_plural": "idempotent results",
                "db_table": "django_keel_lock_result",
                "ordering": ("key",),
                "default_permissions": ("view", "delete"),
            },
        ),
        VendorSQL(
            forwards={
                "mysql": [
                    "ALTER TABLE django_keel_lock_result MODIFY `key` VARCHAR(255) "
                    "CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin NOT NULL"
                ]
            },
            description="MariaDB: the result key compared byte for byte",
        ),
    ]
