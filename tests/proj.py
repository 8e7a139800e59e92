"""An importable Celery app for tests that run publishers or workers in other processes.

Configured from the environment (``CELERY_DEDUP_TEST_BROKER``, and optionally
``CELERY_DEDUP_TEST_TRANSPORT_OPTIONS`` as JSON), so a spawned process builds
the same app. Tasks count their executions in Redis, where every process can
read them.
"""

from __future__ import annotations

import json
import os
import time

import redis
from celery import Celery

import celery_dedup
from celery_dedup import DedupTask

BROKER = os.environ.get("CELERY_DEDUP_TEST_BROKER", "redis://127.0.0.1:6379/0")

app = Celery("proj", broker=BROKER, backend=BROKER)
app.conf.update(
    broker_transport_options=json.loads(os.environ.get("CELERY_DEDUP_TEST_TRANSPORT_OPTIONS", "{}")),
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)
celery_dedup.install(app)

_counter = redis.Redis.from_url(BROKER)


def executions_key(key: str) -> str:
    return f"test:executions:{key}"


@app.task(base=DedupTask, dedup_key="order:{order_id}")
def charge(order_id: int, amount: int = 0) -> int:
    _counter.incr(executions_key(f"order:{order_id}"))
    return order_id


@app.task(base=DedupTask, dedup_key="order:{order_id}")
def slow_charge(order_id: int, seconds: float = 1.0) -> int:
    _counter.incr(executions_key(f"order:{order_id}"))
    time.sleep(seconds)
    return order_id
