from __future__ import annotations

from django.db import migrations


class Migration(migrations.Migration):
    """The admin's entry for the page of every store's locks (`models.StoreLock`): a proxy of
    `Lock`, so no SQL and no permissions of its own."""

    dependencies = [("django_keel_lock", "0005_waiter")]

    operations = [
        migrations.CreateModel(
            name="StoreLock",
            fields=[],
            options={
                "verbose_name": "lock in every store",
                "verbose_name_plural": "locks in every store",
                "proxy": True,
                "default_permissions": (),
                "indexes": [],
                "constraints": [],
            },
            bases=("django_keel_lock.lock",),
        ),
    ]
