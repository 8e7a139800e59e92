"""The Django app: label ``celery_dedup``, shown as "Celery dedup" in the admin."""

from __future__ import annotations

from django.apps import AppConfig


class CeleryDedupConfig(AppConfig):
    name = "celery_dedup.contrib.django"
    label = "celery_dedup"
    verbose_name = "Celery dedup"
    default_auto_field = "django.db.models.AutoField"
