"""Tasks on a RabbitMQ broker, for tests/integration/test_rabbitmq.py; importable by worker subprocesses.

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
import time
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


def acked_key(task_name: str, n: int) -> str:
    """Set once a ``slow_ack`` run's body has ended: its ack is 30 s away from then."""
    return f"rabbitmq:ended:{task_name}:{n}"


class SlowAck(DedupTask):
    """acks_late, and ``after_return`` (after the guard recorded the ending, before the ack) takes 30 s."""

    acks_late = True

    def after_return(self, status: str, retval: Any, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        url = str(self.app.conf.result_backend)
        with _clients_lock:
            client = _clients.setdefault(url, redis.Redis.from_url(url))
        client.set(acked_key(self.name, args[0]), task_id)
        time.sleep(30)


def register(app: Celery, prefix: str = "rabbitmq") -> tuple[Any, Any, Any]:
    """Define ``<prefix>.plain(n)`` (a plain Celery task), ``<prefix>.keyed(n)`` (a DedupTask keyed ``n:{n}``)
    and ``<prefix>.slow_ack(n)`` (keyed too, see :class:`SlowAck`).

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

    @app.task(name=f"{prefix}.slow_ack", base=SlowAck, dedup_key="n:{n}", bind=True, shared=False)
    def slow_ack(self: Task[Any, Any], n: int) -> int:
        _record(self, n)
        return n

    return plain, keyed, slow_ack


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
