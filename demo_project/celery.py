"""The demo's Celery app, configured from Django settings (``CELERY_*``) and installed for DedupTask.

Worker: ``celery -A demo_project.celery worker`` (the launcher starts one).
"""

from __future__ import annotations

import os

from celery import Celery

import celery_dedup

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "demo_project.settings")

app = Celery("demo_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
celery_dedup.install(app)
app.autodiscover_tasks(["demo_project.shop"])
