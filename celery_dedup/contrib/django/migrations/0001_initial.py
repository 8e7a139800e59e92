"""The unmanaged Record model: no table, only the admin entry and its permissions."""

from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    dependencies = []  # noqa: RUF012

    operations = [  # noqa: RUF012
        migrations.CreateModel(
            name="Record",
            fields=[
                ("id", models.AutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
            ],
            options={
                "verbose_name": "status record",
                "verbose_name_plural": "status records",
                "managed": False,
                "default_permissions": ("view", "change"),
            },
        ),
    ]
