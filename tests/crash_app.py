"""An importable Celery app for the crash tests (tests/test_crash.py): workers it runs get killed.

Configured from the environment, so a spawned ``celery -A tests.crash_app
worker`` builds the same app as the test:

- ``CELERY_DEDUP_TEST_BROKER``: broker, result backend and dedup store URL;
- ``CELERY_DEDUP_TEST_TRANSPORT_OPTIONS``: JSON ``broker_transport_options``
  (``visibility_timeout`` and kombu's restore sweep settings);
- ``CELERY_DEDUP_CRASH_CONF``: JSON object of further Celery settings
  (``task_acks_late``, ``task_reject_on_worker_lost``, ``dedup_lock_ttl``,
  ``dedup_reap_interval``, ``worker_prefetch_multiplier``, ...).

The tasks record what they did in Redis, where the test can read it after the
process that ran them is gone. The test process registers the same tasks on
its own app with :func:`register`.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery, Task

import celery_dedup
from celery_dedup import DedupTask

#: How long a run told to hang sleeps: far longer than any test waits for it to be killed.
HANG_SECONDS = 60.0
#: The storm task's body time: short, so a drain is mostly dedup and broker work.
STORM_SECONDS = 0.003


def executions_key(key: str) -> str:
    """INCRed by every execution of the body for business key ``key``."""
    return f"test:executions:{key}"


def runs_key(key: str) -> str:
    """LIST of ``"<task id> <pid>"``, one entry per execution of ``key``'s body."""
    return f"test:runs:{key}"


def pid_key(key: str) -> str:
    """The pid of the process that last started ``key``'s body."""
    return f"test:pid:{key}"


def hang_key(key: str) -> str:
    """Set by the test to N: the next N executions of ``key`` hang (until killed)."""
    return f"test:hang:{key}"


#: INCRed by every storm execution: the test's progress meter for timing kills.
STORM_TOTAL = "test:storm:executions"


@dataclass(frozen=True)
class Tasks:
    """The crash tests' tasks, as registered on one app."""

    plain_tick: Task[Any, Any]
    tick: DedupTask
    hang: DedupTask
    storm: DedupTask
    #: Replaces itself with ``render``, a plain task that hangs like ``hang`` when told to.
    build: DedupTask
    #: ``hang`` in mode ``while_executing``: no enqueue gate, only the execution lock.
    hang_while: DedupTask


def register(app: Celery) -> Tasks:
    """Register the crash tests' tasks on ``app`` (names are fixed, so every app agrees)."""
    counter = redis.Redis.from_url(str(app.conf.broker_url))

    def record_execution(key: str, task_id: str | None) -> None:
        pid = os.getpid()
        with counter.pipeline(transaction=False) as pipe:
            pipe.incr(executions_key(key))
            pipe.rpush(runs_key(key), f"{task_id} {pid}")
            pipe.set(pid_key(key), pid)
            pipe.execute()

    @app.task(name="tests.crash_app.plain_tick", bind=True, shared=False)
    def plain_tick(self: Task[Any, Any], n: int) -> int:
        record_execution(f"plain:{n}", self.request.id)
        return n

    @app.task(name="tests.crash_app.tick", base=DedupTask, bind=True, shared=False, dedup_key="tick:{n}")
    def tick(self: DedupTask, n: int) -> int:
        record_execution(f"tick:{n}", self.request.id)
        return n

    @app.task(name="tests.crash_app.hang", base=DedupTask, bind=True, shared=False, dedup_key="hang:{n}")
    def hang(self: DedupTask, n: int) -> int:
        key = f"hang:{n}"
        record_execution(key, self.request.id)
        if counter.decr(hang_key(key)) >= 0:
            time.sleep(HANG_SECONDS)
        return n

    @app.task(
        name="tests.crash_app.storm",
        base=DedupTask,
        bind=True,
        shared=False,
        ignore_result=True,
        dedup_key="storm:{n}",
    )
    def storm(self: DedupTask, n: int) -> int:
        key = f"storm:{n}"
        with counter.pipeline(transaction=False) as pipe:
            pipe.incr(executions_key(key))
            pipe.incr(STORM_TOTAL)
            pipe.execute()
        time.sleep(STORM_SECONDS)
        return n

    @app.task(name="tests.crash_app.build", base=DedupTask, bind=True, shared=False, dedup_key="build:{n}")
    def build(self: DedupTask, n: int) -> Any:
        raise self.replace(render.s(n))

    @app.task(name="tests.crash_app.render", bind=True, shared=False)
    def render(self: Task[Any, Any], n: int) -> str:
        key = f"render:{n}"
        record_execution(key, self.request.id)
        if counter.decr(hang_key(key)) >= 0:
            time.sleep(HANG_SECONDS)
        return f"rendered {n}"

    @app.task(
        name="tests.crash_app.hang_while",
        base=DedupTask,
        bind=True,
        shared=False,
        dedup_key="hang_while:{n}",
        dedup_mode="while_executing",
    )
    def hang_while(self: DedupTask, n: int) -> int:
        key = f"hang_while:{n}"
        record_execution(key, self.request.id)
        if counter.decr(hang_key(key)) >= 0:
            time.sleep(HANG_SECONDS)
        return n

    return Tasks(plain_tick, tick, hang, storm, build, hang_while)


def build() -> Celery:
    """The app a worker process runs, from the environment (see the module docstring)."""
    broker = os.environ.get("CELERY_DEDUP_TEST_BROKER", "redis://127.0.0.1:6379/0")
    crash_app = Celery("crash_app", broker=broker, backend=broker, set_as_current=False)
    crash_app.conf.update(
        broker_transport_options=json.loads(os.environ.get("CELERY_DEDUP_TEST_TRANSPORT_OPTIONS", "{}")),
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
    )
    crash_app.conf.update(json.loads(os.environ.get("CELERY_DEDUP_CRASH_CONF", "{}")))
    celery_dedup.install(crash_app)
    register(crash_app)
    return crash_app


app = build()
