"""The demo's Celery app, configured from Django settings (``CELERY_*``) and installed for DedupTask.

Worker: ``celery -A demo_project.celery worker`` (the launcher starts one).
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery
from celery.signals import worker_init

import celery_dedup
from celery_dedup import runtime

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "demo_project.settings")

app = Celery("demo_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
celery_dedup.install(app)
app.autodiscover_tasks(["demo_project.shop"])


@worker_init.connect
def open_dedup_store(**kwargs: Any) -> None:
    """Build the dedup store before the pool forks.

    Otherwise the debounce dispatcher thread may be building it, holding the
    runtime's lock, at the moment a pool process is forked: that process
    inherits the lock held and hangs on its first task.
    """
    runtime.store_for(app)
