"""Tasks on a RabbitMQ broker, for tests/test_rabbitmq.py; importable by worker subprocesses.

``register(app)`` defines the tasks on any app: the test's own (from
conftest's ``make_rabbit_app``) and this module's ``app``, which
``celery -A tests.rabbitmq_app worker`` runs. That one is configured as
``make_rabbit_app`` configures its apps, from ``CELERY_DEDUP_TEST_BROKER``
(the node's ``amqp://`` URL), ``CELERY_DEDUP_TEST_STORE`` (the Redis server's
URL: result backend and dedup store) and ``CELERY_DEDUP_TEST_QUEUE``.

Every run appends ``<task id> <pid>`` to the Redis list ``runs_key(task, n)``,
where the test process reads it.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import redis
from celery import Celery, Task

import celery_dedup
from celery_dedup import DedupTask

_clients: dict[str, redis.Redis] = {}
_clients_lock = threading.Lock()


def runs_key(task_name: str, n: int) -> str:
    return f"rabbitmq:runs:{task_name}:{n}"


def _record(task: Task[Any, Any], n: int) -> None:
    url = str(task.app.conf.result_backend)
    with _clients_lock:
        client = _clients.setdefault(url, redis.Redis.from_url(url))
    client.rpush(runs_key(task.name, n), f"{task.request.id} {os.getpid()}")


def register(app: Celery, prefix: str = "rabbitmq") -> tuple[Any, Any]:
    """Define ``<prefix>.plain(n)`` (a plain Celery task) and ``<prefix>.keyed(n)`` (a DedupTask keyed ``n:{n}``).

    A prefix of its own per test keeps the names apart: celery-dedup's publish
    hook looks tasks up by name across the installed apps of earlier tests too.
    """

    @app.task(name=f"{prefix}.plain", bind=True, shared=False)
    def plain(self: Task[Any, Any], n: int) -> int:
        _record(self, n)
        return n

    @app.task(name=f"{prefix}.keyed", base=DedupTask, dedup_key="n:{n}", bind=True, shared=False)
    def keyed(self: Task[Any, Any], n: int) -> int:
        _record(self, n)
        return n

    return plain, keyed


_store = os.environ.get("CELERY_DEDUP_TEST_STORE", "redis://127.0.0.1:6379/0")
# Not the current app: test processes import this module for ``register``.
app = Celery("rabbitmq_app", set_as_current=False)
app.conf.update(
    broker_url=os.environ.get("CELERY_DEDUP_TEST_BROKER", "amqp://guest:guest@127.0.0.1:5672//"),
    result_backend=_store,
    dedup_redis_url=_store,
    task_default_queue=os.environ.get("CELERY_DEDUP_TEST_QUEUE", "celery"),
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)
celery_dedup.install(app)
register(app)
