from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    """What a release needs to hand a key's lock over to the first waiter in its line
    (PostgreSQL): the waiter's holder and ttl, the fence it was handed until it takes the
    grant up, and its process's listener connection (a grant carried in the wake-up only
    while that is there). Nullable columns: processes still running the code from before
    write places without them, which then get a wake-up as before, and no grant."""

    dependencies = [("django_keel_lock", "0008_acquire_many")]

    operations = [
        migrations.AddField(
            model_name="waiter",
            name="holder",
            field=models.CharField(max_length=255, null=True),
        ),
        migrations.AddField(model_name="waiter", name="ttl", field=models.FloatField(null=True)),
        migrations.AddField(
            model_name="waiter", name="fence", field=models.BigIntegerField(null=True)
        ),
        migrations.AddField(
            model_name="waiter", name="listener", field=models.BigIntegerField(null=True)
        ),
    ]
