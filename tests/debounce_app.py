"""An importable Celery app with debounced and throttled tasks, for tests across processes.

The broker comes from ``CELERY_DEDUP_TEST_BROKER`` (as in tests/proj.py).
Every execution appends one JSON line to ``runs:<task>`` in Redis: the
arguments it ran with, its task id, and the server time it started.
"""

from __future__ import annotations

import json
import os
from typing import Any

import redis
from celery import Celery

import celery_dedup
from celery_dedup import DedupTask

BROKER = os.environ.get("CELERY_DEDUP_TEST_BROKER", "redis://127.0.0.1:6379/0")
WINDOW = 0.5
MAX_WAIT = 2.0
THROTTLE_WINDOW = 1.0

app = Celery("debounce_app", broker=BROKER)
app.conf.update(
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    task_ignore_result=True,
    dedup_dispatch_interval=0.05,
)
celery_dedup.install(app)

_clients: dict[str, redis.Redis] = {}


def use(broker: str) -> None:
    """Point this process's app at ``broker`` (spawned processes read the environment)."""
    app.conf.update(broker_url=broker)


def client() -> redis.Redis:
    url = str(app.conf.broker_url)
    if url not in _clients:
        _clients[url] = redis.Redis.from_url(url)
    return _clients[url]


def runs_key(task: str) -> str:
    return f"runs:{task}"


def record_run(task: Any, **arguments: Any) -> None:
    seconds, micros = client().time()
    entry = {"id": task.request.id, "started_ms": seconds * 1000 + micros // 1000, **arguments}
    status = task.dedup_status(**arguments)
    entry["queued_at"] = int(status.fields["queued_at"]) if status else None
    client().rpush(runs_key(task.name), json.dumps(entry))


# shared=False: Celery would otherwise register these tasks in every app
# finalized later in the same process (other tests' apps included).
@app.task(bind=True, base=DedupTask, shared=False, dedup_key="sku:{sku}", dedup_mode="debounce", dedup_window=WINDOW)
def sync(self: DedupTask, sku: str, seq: str) -> None:
    record_run(self, sku=sku, seq=seq)


@app.task(
    bind=True,
    base=DedupTask,
    shared=False,
    dedup_key="sku:{sku}",
    dedup_mode="debounce",
    dedup_window=WINDOW,
    dedup_max_wait=MAX_WAIT,
)
def sync_capped(self: DedupTask, sku: str, seq: str) -> None:
    record_run(self, sku=sku, seq=seq)


@app.task(
    bind=True, base=DedupTask, shared=False, dedup_key="day:{day}", dedup_mode="throttle", dedup_window=THROTTLE_WINDOW
)
def report(self: DedupTask, day: str, seq: str) -> None:
    record_run(self, day=day, seq=seq)
