"""The Celery app ``benchmarks/worker.py`` runs workers on.

Importable by ``celery -A benchmarks.worker_app worker`` (the prefork case),
configured from ``CELERY_DEDUP_BENCH_BROKER`` so the spawned worker talks to
the benchmark's own server; the in-process (solo) case builds the same app
with :func:`build_app`. Two pairs of tasks with the same signatures, so plain
and keyed messages are the same size: ``bench.plain``/``bench.keyed`` do
nothing, ``bench.plain_sleep``/``bench.keyed_sleep`` sleep for ``seconds``.
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
    """An installed app on ``url`` (broker and result backend) with the four benchmark tasks."""
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

    return app


app = build_app(BROKER)


@signals.worker_ready.connect
def _announce_ready(sender: Any = None, **_: Any) -> None:
    # Only this module's app: an in-process benchmark worker on another app stays quiet.
    if getattr(sender, "app", None) is app:
        print(READY_MARKER, flush=True)
