"""An importable Celery app for the crash tests (tests/integration/test_crash.py): workers it runs get killed.

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
import signal
import time
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery, Task, signals

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


def stall_key(key: str, when: str) -> str:
    """Set by the test to N: the next N publishes of ``key``'s replacement stall their process (until killed).

    ``when`` is ``"before"`` (Celery's ``before_task_publish``: nothing is
    published yet) or ``"after"`` (``after_task_publish``: the replacement is
    on the broker, and ``Task.replace`` has yet to return).
    """
    return f"test:stall:{when}:{key}"


def stalled_key(key: str) -> str:
    """The pid of the process stalled publishing ``key``'s replacement (see :func:`stall_key`)."""
    return f"test:stalled:{key}"


def hold_key(key: str) -> str:
    """While set, ``key``'s body waits before it returns (the test deletes it to let the body end)."""
    return f"test:hold:{key}"


def kill_after_body_key(key: str) -> str:
    """Set by the test to N: the next N successes of ``key`` SIGKILL their process after the body (``task_success``)."""
    return f"test:kill_after_body:{key}"


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
    #: Replaces itself with itself under the same key (``again=False``), which hangs like ``hang`` when told to.
    redo: DedupTask
    #: ``hang`` in mode ``while_executing``: no enqueue gate, only the execution lock.
    hang_while: DedupTask
    #: ``tick`` that stores no result: its ending is sent as the body returns, its reply read later.
    quiet: DedupTask


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

    def wait_while_held(key: str) -> None:
        deadline = time.monotonic() + HANG_SECONDS
        while counter.exists(hold_key(key)) and time.monotonic() < deadline:
            time.sleep(0.05)

    @app.task(name="tests.crash_app.hang", base=DedupTask, bind=True, shared=False, dedup_key="hang:{n}")
    def hang(self: DedupTask, n: int) -> int:
        key = f"hang:{n}"
        record_execution(key, self.request.id)
        if counter.decr(hang_key(key)) >= 0:
            time.sleep(HANG_SECONDS)
        wait_while_held(key)
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
        wait_while_held(key)
        return f"rendered {n}"

    @app.task(name="tests.crash_app.redo", base=DedupTask, bind=True, shared=False, dedup_key="redo:{n}")
    def redo(self: DedupTask, n: int, again: bool = True) -> Any:
        if again:
            raise self.replace(redo.s(n, again=False))
        key = f"redo:{n}"
        record_execution(key, self.request.id)
        if counter.decr(hang_key(key)) >= 0:
            time.sleep(HANG_SECONDS)
        return f"redone {n}"

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

    @app.task(
        name="tests.crash_app.quiet", base=DedupTask, bind=True, shared=False, ignore_result=True, dedup_key="quiet:{n}"
    )
    def quiet(self: DedupTask, n: int) -> int:
        record_execution(f"quiet:{n}", self.request.id)
        return n

    return Tasks(plain_tick, tick, hang, storm, build, redo, hang_while, quiet)


def kill_after_bodies(app: Celery) -> None:
    """In a worker: a process whose body of ``quiet`` succeeded kills itself when the test says (see
    :func:`kill_after_body_key`): after the ending was sent, before its reply is read."""
    client = redis.Redis.from_url(str(app.conf.broker_url))

    def kill(sender: Any = None, result: Any = None, **_: Any) -> None:
        named = getattr(sender, "name", None) == "tests.crash_app.quiet"
        if named and client.decr(kill_after_body_key(f"quiet:{result}")) >= 0:
            os.kill(os.getpid(), signal.SIGKILL)

    signals.task_success.connect(kill, weak=False, dispatch_uid="tests.crash_app.kill_after_body")


def stall_publishes(app: Celery) -> None:
    """In a worker: a process publishing ``render``'s message stalls where the test says (see :func:`stall_key`).

    ``build`` publishes it inside ``Task.replace``, so the stall holds the
    replaced run between Celery's publish signals and its ending.
    """
    client = redis.Redis.from_url(str(app.conf.broker_url))

    def stall(when: str, body: Any) -> None:
        key = f"render:{body[0][0]}" if isinstance(body, list | tuple) and body and body[0] else ""
        if key and client.decr(stall_key(key, when)) >= 0:
            client.set(stalled_key(key), os.getpid())
            time.sleep(HANG_SECONDS)

    def before(sender: Any = None, body: Any = None, **_: Any) -> None:
        if sender == "tests.crash_app.render":
            stall("before", body)

    def after(sender: Any = None, body: Any = None, **_: Any) -> None:
        if sender == "tests.crash_app.render":
            stall("after", body)

    signals.before_task_publish.connect(before, weak=False, dispatch_uid="tests.crash_app.stall_before")
    signals.after_task_publish.connect(after, weak=False, dispatch_uid="tests.crash_app.stall_after")


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
    stall_publishes(crash_app)
    kill_after_bodies(crash_app)
    return crash_app


app = build()
