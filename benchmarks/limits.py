"""What a limit costs: a limited DedupTask against the same task without limits, on a real server and worker.

Cases, each a no-op task body:

- ``keyed``: a DedupTask (``until_executed``), no limits;
- ``concurrency``: the same with ``limit_key`` (one group) and a
  ``limit_concurrency`` no run reaches, so every run gets through at once:
  the cost of asking and giving back;
- ``concurrency+rate``: as above plus a ``limit_rate`` no run reaches;
- ``off``: ``dedup_mode="off"`` with the same concurrency limit (limits
  only, no dedup).

Measured:

- **enqueue**: ``apply_async`` per call, ``--calls`` distinct keys (limits are
  decided on the worker, so this should not move);
- **worker**: ``--tasks`` tasks pre-queued, then handed to an idle in-process
  solo worker at once (one ``RENAME`` of a staging list onto its queue), and
  drained; milliseconds per task, and the scripts the store ran per task
  (``EVALSHA`` calls from the server's command statistics).

``--repeats`` times each, alternating the order; medians are printed.

Run it from the repository root::

    .venv/bin/python -m benchmarks.limits [--tasks 2000] [--calls 2000] [--repeats 5] [--output FILE]

It starts its own server, prints a Markdown table and writes
``benchmarks/results/limits.json``. Nothing here asserts on time.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

import celery_dedup
from benchmarks import harness
from celery_dedup import DedupTask
from celery_dedup.testing import RedisServer

STAGE = "bench-stage"
CASES: dict[str, dict[str, Any]] = {
    "keyed": {},
    "concurrency": {"limit_key": "all", "limit_concurrency": 100_000},
    "concurrency+rate": {"limit_key": "all", "limit_concurrency": 100_000, "limit_rate": "100000/s"},
    "off": {"dedup_mode": "off", "limit_key": "all", "limit_concurrency": 100_000},
}


class Done:
    """Counts bodies run in this process; wakes the waiter at the target."""

    def __init__(self) -> None:
        self.count = 0
        self.target = 0
        self.event = threading.Event()

    def expect(self, target: int) -> None:
        self.count, self.target = 0, target
        self.event.clear()

    def hit(self) -> None:
        self.count += 1
        if self.count >= self.target:
            self.event.set()


def build_app(url: str, done: Done) -> tuple[Celery, dict[str, Any]]:
    app = Celery("bench_limits", set_as_current=False)
    app.conf.update(broker_url=url, task_ignore_result=True, worker_hijack_root_logger=False, dedup_reap_interval=0)
    celery_dedup.install(app)
    tasks = {}
    for name, options in CASES.items():

        @app.task(base=DedupTask, name=f"bench.{name}", shared=False, dedup_key="n:{n}", **options)
        def body(n: int) -> None:
            done.hit()

        tasks[name] = body
    return app, tasks


def evalsha_calls(client: redis.Redis) -> int:
    return harness.commandstats(client)["evalsha"]


def enqueue_case(client: redis.Redis, task: Any, calls: int, start: int) -> float:
    """Seconds per apply_async of ``calls`` new keys (staged, so no worker takes them)."""
    began = time.perf_counter()
    for n in range(start, start + calls):
        task.apply_async((n,), queue=STAGE)
    elapsed = time.perf_counter() - began
    client.delete(STAGE)
    return elapsed / calls


def worker_case(client: redis.Redis, task: Any, done: Done, tasks: int, start: int) -> tuple[float, float]:
    """(ms per task, scripts per task) to drain ``tasks`` staged tasks with the idle worker."""
    for n in range(start, start + tasks):
        task.apply_async((n,), queue=STAGE)
    done.expect(tasks)
    before = evalsha_calls(client)
    began = time.perf_counter()
    client.rename(STAGE, "celery")
    if not done.event.wait(300):
        raise RuntimeError(f"only {done.count} of {tasks} ran")
    elapsed = time.perf_counter() - began
    time.sleep(0.05)  # the last finish script
    scripts = evalsha_calls(client) - before
    return elapsed * 1000 / tasks, scripts / tasks


def main(argv: list[str] | None = None) -> None:
    script = harness.Script("limits", __doc__)
    script.option("--tasks", 2000, "tasks drained per worker measurement")
    script.option("--calls", 2000, "apply_async calls per enqueue measurement")
    script.option("--repeats", 5, "measurements per case")
    args = script.parse(argv)

    done = Done()
    enqueue: dict[str, list[float]] = {name: [] for name in CASES}
    worker_ms: dict[str, list[float]] = {name: [] for name in CASES}
    scripts: dict[str, list[float]] = {name: [] for name in CASES}
    with RedisServer() as server:
        script.header(f"server: {server.binary} ({server.version()})")
        client = redis.Redis.from_url(server.url)
        app, tasks = build_app(server.url, done)
        with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING"):
            serial = 0
            names = list(CASES)
            for repeat in range(args.repeats):
                order = names if repeat % 2 == 0 else names[::-1]
                for name in order:
                    enqueue[name].append(enqueue_case(client, tasks[name], args.calls, serial))
                    serial += args.calls
                    per_task, per_task_scripts = worker_case(client, tasks[name], done, args.tasks, serial)
                    serial += args.tasks
                    worker_ms[name].append(per_task)
                    scripts[name].append(per_task_scripts)
        app.close()

    rows = {
        name: {
            "enqueue_us_median": statistics.median(enqueue[name]) * 1e6,
            "worker_ms_per_task_median": statistics.median(worker_ms[name]),
            "scripts_per_task": statistics.median(scripts[name]),
        }
        for name in CASES
    }
    base = rows["keyed"]["worker_ms_per_task_median"]
    print()
    print(f"{args.tasks} tasks per drain, {args.calls} calls per enqueue, median of {args.repeats}")
    print()
    print(
        harness.table(
            ["case", "enqueue per call µs", "worker per task ms", "vs keyed", "store scripts per task"],
            [
                [
                    name,
                    row["enqueue_us_median"],
                    row["worker_ms_per_task_median"],
                    harness.ratio(row["worker_ms_per_task_median"], base),
                    row["scripts_per_task"],
                ]
                for name, row in rows.items()
            ],
        )
    )
    script.save(args, {"cases": rows, "raw": {"enqueue_s": enqueue, "worker_ms": worker_ms, "scripts": scripts}})


if __name__ == "__main__":
    main()
