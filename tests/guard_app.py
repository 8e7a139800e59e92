"""Tasks for tests/integration/test_guard.py, importable by worker subprocesses.

``register(app)`` defines the tasks on any app: the in-process test apps and
this module's own ``app``, which ``celery -A tests.guard_app worker`` runs
(configured from ``CELERY_DEDUP_TEST_BROKER`` like tests/proj.py, lock TTL
from ``GUARD_LOCK_TTL`` (1 s), reaper interval from ``GUARD_REAP_INTERVAL``).

Everything a task does is written to Redis, where the test process reads it:

- ``guard:events:<task>:<key>``: one JSON entry per body start and end
  (task id, pid, wall time), in the order they happened;
- ``guard:deliveries:<task id>``: one JSON entry per delivery before and after
  ``__call__`` (task_prerun / task_postrun), so refusals (IGNORED) show too;
- ``guard:lost:<task>:<key>``: what a long task saw when it noticed that its
  execution lock was lost.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any

import redis
from celery import Celery, Task, signals
from celery.exceptions import Reject, SoftTimeLimitExceeded

import celery_dedup
from celery_dedup import DedupTask, DedupUnavailableError
from celery_dedup.keys import member_for

MODES = ("until_executed", "until_executing", "until_expired", "while_executing")
#: How long a ``linger`` run cleans up after its soft time limit.
LINGER = 3.0

_clients: dict[str, redis.Redis] = {}
_clients_lock = threading.Lock()


def client_for(app: Celery) -> redis.Redis:
    """A client of the app's broker server (one per URL and process)."""
    url = str(app.conf.broker_url)
    with _clients_lock:
        if url not in _clients:
            _clients[url] = redis.Redis.from_url(url)
        return _clients[url]


def events_key(task_name: str, key: str) -> str:
    return f"guard:events:{task_name}:{key}"


def deliveries_key(task_id: str) -> str:
    return f"guard:deliveries:{task_id}"


def lost_key(task_name: str, key: str) -> str:
    return f"guard:lost:{task_name}:{key}"


class GuardTask(DedupTask):
    """A DedupTask whose deliveries the signal receivers below log."""

    abstract = True
    guard_tracked = True


def _event(task: Task[Any, Any], key: str, kind: str) -> None:
    entry = {"ev": kind, "id": task.request.id, "pid": os.getpid(), "t": time.time(), "retries": task.request.retries}
    client_for(task.app).rpush(events_key(task.name, key), json.dumps(entry))


def _work_task(app: Celery, mode: str) -> Task[Any, Any]:
    @app.task(
        base=GuardTask, name=f"guard.work.{mode}", dedup_key="job:{key}", dedup_mode=mode, bind=True, shared=False
    )
    def work(self: GuardTask, key: str, action: str = "ok", seconds: float = 0.0) -> str:
        """One ending per ``action``: ok, fail, retry:N, reject, sleep, linger, die, dedup_error.

        ``linger`` sleeps ``seconds``, but on a soft time limit (or a terminate
        with SIGUSR1) logs a ``soft`` event and cleans up for LINGER seconds more.
        """
        _event(self, key, "start")
        if action == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if action in ("sleep", "linger"):
            deadline = time.monotonic() + seconds
            try:
                while time.monotonic() < deadline:
                    time.sleep(0.05)
            except SoftTimeLimitExceeded:
                if action != "linger":
                    raise
                _event(self, key, "soft")
                time.sleep(LINGER)
        _event(self, key, "end")
        if action == "fail":
            raise self.retry(exc=RuntimeError(f"boom {key}"), countdown=0, max_retries=1)
        if action.startswith("retry:"):
            wanted = int(action.partition(":")[2])
            if self.request.retries < wanted:
                raise self.retry(countdown=0, max_retries=wanted)
        if action == "reject":
            raise Reject("rejected by the test", requeue=False)
        if action == "dedup_error":  # as Task.retry raises it when its publish fails; pickled to the main process
            unavailable = DedupUnavailableError(self.name, key, redis.ConnectionError("gone"), published=False)
            raise Reject(unavailable, requeue=False)
        return key

    return work


def _long_task(app: Celery, mode: str) -> Task[Any, Any]:
    @app.task(
        base=GuardTask, name=f"guard.long.{mode}", dedup_key="long:{key}", dedup_mode=mode, bind=True, shared=False
    )
    def long(self: GuardTask, key: str, seconds: float) -> str:
        """Runs ``seconds``, polling ``dedup_lock_lost`` and reporting the first time it is True."""
        _event(self, key, "start")
        client = client_for(self.app)
        member = member_for(self.name, self.dedup_business_key(key, seconds))
        deadline = time.monotonic() + seconds
        reported = False
        while time.monotonic() < deadline:
            if self.dedup_lock_lost and not reported:
                reported = True
                record = celery_dedup.runtime.store_for(self.app).record(member) or {}
                seen = {
                    "t": time.time(),
                    "headers_clean": "dedup_lock_lost" not in (self.request.headers or {}),
                    "lock_lost_at": record.get("lock_lost_at", ""),
                }
                client.set(lost_key(self.name, key), json.dumps(seen))
            time.sleep(0.02)
        _event(self, key, "end")
        return key

    return long


def register(app: Celery) -> dict[str, Any]:
    """Define every guard task on ``app``; returns them by name (typed Any: DedupTask adds methods)."""
    tasks: list[Task[Any, Any]] = []
    for mode in MODES:
        tasks += [_work_task(app, mode), _long_task(app, mode)]

    @app.task(
        base=GuardTask,
        name="guard.serial",
        dedup_key="serial:{key}",
        dedup_mode="while_executing",
        dedup_on_locked="reschedule",
        bind=True,
        shared=False,
    )
    def serial(self: GuardTask, key: str, seconds: float) -> str:
        """A while_executing task whose runs wait for each other (reschedule)."""
        _event(self, key, "start")
        time.sleep(seconds)
        _event(self, key, "end")
        return self.request.id or ""

    tasks.append(serial)
    return {task.name: task for task in tasks}


def _delivery(sender: Any, task_id: str | None, phase: str, state: str = "") -> None:
    if not getattr(sender, "guard_tracked", False) or task_id is None:
        return
    request = sender.request
    entry = {"phase": phase, "state": state, "pid": os.getpid(), "t": time.time(), "eta": request.eta}
    client_for(sender.app).rpush(deliveries_key(task_id), json.dumps(entry, default=str))


def _on_prerun(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
    _delivery(sender, task_id, "prerun")


def _on_postrun(sender: Any = None, task_id: str | None = None, state: str | None = None, **_: Any) -> None:
    _delivery(sender, task_id, "postrun", state or "")


signals.task_prerun.connect(_on_prerun, weak=False, dispatch_uid="tests.guard_app.prerun")
signals.task_postrun.connect(_on_postrun, weak=False, dispatch_uid="tests.guard_app.postrun")

BROKER = os.environ.get("CELERY_DEDUP_TEST_BROKER", "redis://127.0.0.1:6379/0")

app = Celery("guard_app", broker=BROKER, backend=BROKER, set_as_current=False)
app.conf.update(
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    dedup_lock_ttl=float(os.environ.get("GUARD_LOCK_TTL", "1")),
    dedup_reap_interval=float(os.environ.get("GUARD_REAP_INTERVAL", "0")),
)
celery_dedup.install(app)
register(app)
