"""The Celery app ``benchmarks/worker.py`` runs workers on.

Importable by ``celery -A benchmarks.worker_app worker`` (the prefork case),
configured from ``CELERY_DEDUP_BENCH_BROKER`` so the spawned worker talks to
the benchmark's own server; the in-process (solo) case builds the same app
with :func:`build_app`. Two pairs of tasks with the same signatures, so plain
and keyed messages are the same size: ``bench.plain``/``bench.keyed`` do
nothing, ``bench.plain_sleep``/``bench.keyed_sleep`` sleep for ``seconds``;
``bench.once`` and ``bench.singleton`` do nothing, keyed by celery-once and
celery-singleton (when installed) for the throughput comparison, and
``bench.once_sleep``/``bench.singleton_sleep`` sleep for ``seconds`` like
``bench.keyed_sleep``, for the body-time sweep.
No task touches Redis itself: every command the worker sends is Celery's,
kombu's or celery-dedup's.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery, signals

import celery_dedup
from benchmarks.harness import READY_MARKER
from celery_dedup import DedupTask

BROKER = os.environ.get("CELERY_DEDUP_BENCH_BROKER", "redis://127.0.0.1:6379/0")
QUEUE = "bench-worker"
PREFIX = "bench-dedup"


def build_app(url: str, name: str = "bench_worker") -> Celery:
    """An installed app on ``url`` (broker and result backend) with the benchmark tasks."""
    app = Celery(name, broker=url, backend=url, set_as_current=False)
    app.conf.update(
        task_default_queue=QUEUE,
        # The benchmark knows every task finished when the queue and kombu's
        # unacked hash are both empty; acks_late moves the ack after the body,
        # it does not change what the ack sends.
        task_acks_late=True,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        dedup_key_prefix=PREFIX,
        # The reaper runs per worker per interval, not per task: off, so it cannot land in a count.
        dedup_reap_interval=0,
        # celery-once and celery-singleton, for the throughput comparison (their own keys, same server).
        ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": url, "default_timeout": 3600}},
        singleton_backend_url=url,
        singleton_key_prefix="bench-singleton:",
    )
    celery_dedup.install(app)

    @app.task(name="bench.plain", shared=False)
    def plain(order_id: int) -> None:
        return None

    @app.task(name="bench.keyed", base=DedupTask, dedup_key="order:{order_id}", shared=False)
    def keyed(order_id: int) -> None:
        return None

    @app.task(name="bench.plain_sleep", shared=False)
    def plain_sleep(order_id: int, seconds: float = 0.0) -> None:
        time.sleep(seconds)

    @app.task(name="bench.keyed_sleep", base=DedupTask, dedup_key="order:{order_id}", shared=False)
    def keyed_sleep(order_id: int, seconds: float = 0.0) -> None:
        time.sleep(seconds)

    for task_name, base, options in peer_bases():

        @app.task(name=task_name, base=base, shared=False, **options)
        def peer(order_id: int) -> None:
            return None

        @app.task(name=f"{task_name}_sleep", base=base, shared=False, **options)
        def peer_sleep(order_id: int, seconds: float = 0.0) -> None:
            time.sleep(seconds)

    return app


def peer_bases() -> list[tuple[str, type[Any], dict[str, Any]]]:
    """``(task name, base, options)`` of the no-op task keyed on ``order_id`` by each peer library installed.

    Each also has a sleeping variant, named ``<task name>_sleep``.
    """
    peers: list[tuple[str, type[Any], dict[str, Any]]] = []
    try:
        from celery_once import QueueOnce  # noqa: PLC0415 - optional: the bench extra
    except ImportError:
        pass
    else:
        peers.append(("bench.once", QueueOnce, {"once": {"keys": ["order_id"]}}))
    try:
        from celery_singleton import Singleton  # noqa: PLC0415 - optional: the bench extra
    except ImportError:
        pass
    else:
        peers.append(("bench.singleton", Singleton, {"unique_on": ["order_id"]}))
    return peers


app = build_app(BROKER)


@signals.worker_ready.connect
def _announce_ready(sender: Any = None, **_: Any) -> None:
    # Only this module's app: an in-process benchmark worker on another app stays quiet.
    if getattr(sender, "app", None) is app:
        print(READY_MARKER, flush=True)
