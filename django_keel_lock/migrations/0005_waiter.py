from __future__ import annotations

from django.db import migrations, models

from django_keel_lock.migrations._operations import VendorSQL

WAITER = "django_keel_lock_waiter"


class Migration(migrations.Migration):
    """The line of waiters for each key's exclusive lock (`models.Waiter`): a new table, so
    processes still running the code from before it go on as they did (outside the line)."""

    dependencies = [("django_keel_lock", "0004_permit_row_kept")]

    operations = [
        migrations.CreateModel(
            name="Waiter",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("key", models.CharField(max_length=255)),
                ("owner", models.CharField(max_length=64)),
                ("address", models.CharField(blank=True, max_length=64)),
                ("expires_at", models.DateTimeField()),
            ],
            options={
                "verbose_name": "waiter",
                "verbose_name_plural": "waiters",
                "db_table": WAITER,
                "ordering": ("key", "id"),
                "default_permissions": (),
                "constraints": [
                    models.UniqueConstraint(
                        fields=("key", "owner"), name="django_keel_lock_waiter_owner"
                    )
                ],
                "indexes": [
                    models.Index(fields=["key", "id"], name="django_keel_lock_waiter_line")
                ],
            },
        ),
        # MariaDB compares the waiters' keys byte for byte, as the lock table's (0001).
        VendorSQL(
            forwards={
                "mysql": [
                    f"ALTER TABLE {WAITER} MODIFY `key` VARCHAR(255) "
                    "CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin NOT NULL",
                ],
            },
            description="Byte-wise key collation of the waiter table (MariaDB)",
        ),
    ]
