from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    """A nullable column without a default: every database adds it without rewriting the
    table, and processes still running the code from before it go on inserting rows."""

    dependencies = [("django_keel_lock", "0001_initial")]

    operations = [
        migrations.AddField(
            model_name="lock",
            name="waiting",
            field=models.BooleanField(null=True, default=None),
        ),
    ]
