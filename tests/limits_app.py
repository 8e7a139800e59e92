"""An importable Celery app for the limit tests (tests/integration/test_limits.py), run by prefork worker processes.

Configured from the environment, as tests/crash_app.py is:
``CELERY_DEDUP_TEST_BROKER`` (broker, result backend and dedup store) and
``CELERY_DEDUP_LIMITS_CONF`` (JSON object of further Celery settings).

Every body records, in Redis, when it started and ended on the server's
clock, so the test can check the limits from what the server saw.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery

import celery_dedup
from celery_dedup import DedupTask
from celery_dedup.worker import limits

#: LIST of JSON ``{"task", "key", "group", "id", "pid", "start", "end", "granted"}`` per body run.
RUNS = "test:limits:runs"
#: SET of keys whose next body hangs (until its worker is killed).
HANG = "test:limits:hang"
#: SET of keys whose body waits until the test takes its key out.
HOLD = "test:limits:hold"
#: How long a tenant job's body runs.
JOB_SECONDS = 0.5
#: How long a long body runs: several lock TTLs of the test that runs it.
LONG_SECONDS = 3.5
#: How long a hanging body sleeps: far longer than any test waits for it to be killed.
HANG_SECONDS = 60.0
#: The named limit groups of the app (setting ``dedup_limit_groups``): every app registering the tasks needs them.
GROUPS: dict[str, Any] = {
    "shared": {"concurrency": 2},
    "windows": {"rate": ["2/s", "3/m"]},
    "pausable": {"concurrency": 1},
    "endings": {"concurrency": 1},
}
#: LIST of ``<n>:<how>:<retries>`` per body of the ending task, pushed as it starts.
ENDING_STARTS = "test:limits:ending"
#: How a body of the ending task ends (see ``Tasks.ending``).
ENDINGS = ("succeed", "fail", "retry", "time_limit", "revoke")
#: Every dedup mode the mode test combines with a concurrency limit.
MODES = ("until_executed", "until_executing", "until_expired", "while_executing", "debounce", "throttle", "off")


def server_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


@dataclass(frozen=True)
class Tasks:
    job: DedupTask
    rated: DedupTask
    hanging: DedupTask
    by_mode: dict[str, DedupTask]
    long: DedupTask
    #: Two tasks drawing on group "shared" (2 at a time per tenant).
    shared: tuple[DedupTask, DedupTask]
    #: Two tasks drawing on group "windows" (2/s and 3/m, one quota for the group).
    windowed: tuple[DedupTask, DedupTask]
    #: A task drawing on group "pausable" (1 at a time), and one without limits.
    pausable: DedupTask
    free: DedupTask
    #: A task of group "endings" (1 at a time) whose body ends as told: one of ENDINGS
    #: (``time_limit`` and ``revoke`` hang until the worker kills them).
    ending: DedupTask


def register(app: Celery) -> Tasks:
    """Register the limit tests' tasks on ``app`` (fixed names, so every app agrees)."""
    client = redis.Redis.from_url(str(app.conf.broker_url))

    def record(task: DedupTask, key: str, group: str, start: int, *, seconds: float) -> None:
        if client.srem(HANG, key):
            time.sleep(HANG_SECONDS)
        while client.sismember(HOLD, key):
            time.sleep(0.02)
        time.sleep(seconds)
        grant = limits.current(task.request.id)
        entry = {
            "task": task.name.rsplit(".", 1)[-1],
            "key": key,
            "group": group,
            "id": task.request.id,
            "pid": os.getpid(),
            "start": start,
            "end": server_ms(client),
            "granted": grant.granted_at if grant is not None else None,
        }
        client.rpush(RUNS, json.dumps(entry))

    @app.task(
        name="tests.limits_app.job",
        base=DedupTask,
        bind=True,
        shared=False,
        dedup_key="job:{job_id}",
        limit_key="tenant:{tenant}",
        limit_concurrency=2,
    )
    def job(self: DedupTask, job_id: int, tenant: str) -> int:
        record(self, f"job:{job_id}", tenant, server_ms(client), seconds=JOB_SECONDS)
        return job_id

    @app.task(
        name="tests.limits_app.rated",
        base=DedupTask,
        bind=True,
        shared=False,
        dedup_key="call:{n}",
        limit_key="api",
        limit_rate="5/s",
    )
    def rated(self: DedupTask, n: int) -> int:
        record(self, f"call:{n}", "api", server_ms(client), seconds=0)
        return n

    @app.task(
        name="tests.limits_app.hanging",
        base=DedupTask,
        bind=True,
        shared=False,
        dedup_key="hang:{n}",
        limit_key="tenant:{tenant}",
        limit_concurrency=2,
    )
    def hanging(self: DedupTask, n: int, tenant: str) -> int:
        record(self, f"hang:{n}", tenant, server_ms(client), seconds=0.2)
        return n

    @app.task(
        name="tests.limits_app.long",
        base=DedupTask,
        bind=True,
        shared=False,
        dedup_key="long:{n}",
        limit_key="long",
        limit_concurrency=1,
    )
    def long(self: DedupTask, n: int) -> int:
        record(self, f"long:{n}", "long", server_ms(client), seconds=LONG_SECONDS)
        return n

    shared: list[DedupTask] = []
    windowed: list[DedupTask] = []
    for name in ("a", "b"):

        def shared_body(self: DedupTask, n: int, tenant: str) -> int:
            record(self, f"{self.name[-1]}:{n}", tenant, server_ms(client), seconds=JOB_SECONDS)
            return n

        def windowed_body(self: DedupTask, n: int) -> int:
            record(self, f"w{self.name[-1]}:{n}", "windows", server_ms(client), seconds=0)
            return n

        shared.append(
            app.task(
                name=f"tests.limits_app.shared_{name}",
                base=DedupTask,
                bind=True,
                shared=False,
                dedup_key="{tenant}:{n}",
                limit_group="shared",
                limit_key="{tenant}",
            )(shared_body)
        )
        windowed.append(
            app.task(
                name=f"tests.limits_app.windowed_{name}",
                base=DedupTask,
                bind=True,
                shared=False,
                dedup_key="n:{n}",
                limit_group="windows",
            )(windowed_body)
        )

    @app.task(
        name="tests.limits_app.pausable",
        base=DedupTask,
        bind=True,
        shared=False,
        dedup_key="p:{n}",
        limit_group="pausable",
    )
    def pausable(self: DedupTask, n: int) -> int:
        record(self, f"p:{n}", "pausable", server_ms(client), seconds=0.1)
        return n

    @app.task(name="tests.limits_app.free", base=DedupTask, bind=True, shared=False, dedup_key="free:{n}")
    def free(self: DedupTask, n: int) -> int:
        record(self, f"free:{n}", "free", server_ms(client), seconds=0)
        return n

    @app.task(
        name="tests.limits_app.ending",
        base=DedupTask,
        bind=True,
        shared=False,
        dedup_key="e:{n}",
        limit_group="endings",
    )
    def ending(self: DedupTask, n: int, how: str) -> int:
        client.rpush(ENDING_STARTS, f"{n}:{how}:{self.request.retries}")
        if how == "fail":
            raise ValueError(f"ending {n} fails")
        if how == "retry" and not self.request.retries:
            raise self.retry(countdown=0.2, max_retries=1)
        if how in ("time_limit", "revoke"):
            time.sleep(HANG_SECONDS)
        return n

    by_mode: dict[str, DedupTask] = {}
    for mode in MODES:
        options: dict[str, Any] = {"dedup_mode": mode}
        if mode in ("debounce", "throttle"):
            options["dedup_window"] = 0.2
        if mode == "while_executing":
            options["dedup_on_locked"] = "reschedule"

        def body(self: DedupTask, n: int, group: str) -> int:
            record(self, f"{self.dedup_policy.mode.name}:{n}", group, server_ms(client), seconds=0.2)
            return n

        by_mode[mode] = app.task(
            name=f"tests.limits_app.mode_{mode}",
            base=DedupTask,
            bind=True,
            shared=False,
            dedup_key="n:{n}",
            limit_key="group:{group}",
            limit_concurrency=1,
            **options,
        )(body)
    pairs = (shared[0], shared[1]), (windowed[0], windowed[1])
    return Tasks(job, rated, hanging, by_mode, long, *pairs, pausable, free, ending)


def build() -> Celery:
    """The app a worker process runs, from the environment (see the module docstring)."""
    broker = os.environ.get("CELERY_DEDUP_TEST_BROKER", "redis://127.0.0.1:6379/0")
    limits_app = Celery("limits_app", broker=broker, backend=broker, set_as_current=False)
    limits_app.conf.update(
        worker_hijack_root_logger=False, broker_connection_retry_on_startup=True, dedup_limit_groups=GROUPS
    )
    limits_app.conf.update(json.loads(os.environ.get("CELERY_DEDUP_LIMITS_CONF", "{}")))
    celery_dedup.install(limits_app)
    register(limits_app)
    return limits_app


app = build()
