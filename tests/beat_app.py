"""An importable Celery app for the periodic-task test (tests/integration/test_beat.py): a beat and a worker run it.

Configured from the environment (``CELERY_DEDUP_TEST_BROKER``), so ``celery
-A tests.beat_app beat`` and ``celery -A tests.beat_app worker`` build the
same app. Beat sends ``report`` every second; each run takes three seconds
and writes when it starts and ends to a Redis list the test reads.
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

import celery_dedup
from celery_dedup import DedupTask

BROKER = os.environ.get("CELERY_DEDUP_TEST_BROKER", "redis://127.0.0.1:6379/0")
#: RPUSHed by each run: ``"start <task id>"`` when its body starts, ``"end <task id>"`` when it returns.
EVENTS = "test:beat:events"
SCHEDULE_SECONDS = 1.0
RUN_SECONDS = 3.0

app = Celery("beat_app", broker=BROKER, backend=BROKER)
app.conf.update(
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    # Each worker process takes one message at a time and acknowledges it when
    # the run ends, so a message no process is running waits in the queue,
    # where the test counts it.
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    beat_schedule={"report": {"task": "tests.beat_app.report", "schedule": SCHEDULE_SECONDS}},
)
celery_dedup.install(app)

_events = redis.Redis.from_url(BROKER)


@app.task(base=DedupTask, dedup_key="sales-report", dedup_mode="until_executed", bind=True)
def report(self: DedupTask) -> None:
    """A periodic job that must not overlap itself: one key for every call, held until the run ends."""
    _events.rpush(EVENTS, f"start {self.request.id}")
    time.sleep(RUN_SECONDS)
    _events.rpush(EVENTS, f"end {self.request.id}")
