"""A debounced task for tests/integration/test_modes_windowed.py, importable by worker subprocesses.

``register(app)`` defines it on any app: an in-process test app, or this
module's own ``app``, which ``celery -A tests.windowed_app worker`` runs
(configured from ``CELERY_DEDUP_TEST_BROKER`` like tests/proj.py). Every
execution is logged to Redis as JSON under ``runs_key(key)``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery

import celery_dedup
from celery_dedup import DedupTask

NAME = "windowed.debounced"
WINDOW = 0.3


def runs_key(key: int) -> str:
    return f"windowed:runs:{key}"


def register(app: Celery) -> DedupTask:
    client = redis.Redis.from_url(str(app.conf.broker_url))

    @app.task(
        base=DedupTask,
        name=NAME,
        bind=True,
        shared=False,
        dedup_key="k:{k}",
        dedup_mode="debounce",
        dedup_window=WINDOW,
    )
    def debounced(self: DedupTask, k: int, v: Any = None) -> Any:
        entry = {"id": self.request.id, "args": [k, v], "pid": os.getpid(), "t": time.time()}
        client.rpush(runs_key(k), json.dumps(entry))
        return v

    return debounced


app = Celery("windowed", broker=os.environ.get("CELERY_DEDUP_TEST_BROKER", "redis://127.0.0.1:6379/0"))
app.conf.update(worker_hijack_root_logger=False, broker_connection_retry_on_startup=True)
celery_dedup.install(app)
register(app)
