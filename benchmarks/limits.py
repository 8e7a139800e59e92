"""What a limit costs: a limited DedupTask against the same task without limits, on a real server and worker.

Worker cases, each a no-op task body:

- ``keyed``: a DedupTask (``until_executed``), no limits;
- ``concurrency``: the same with ``limit_key`` (one group) and a
  ``limit_concurrency`` no run reaches, so every run gets through at once:
  the cost of asking and giving back;
- ``concurrency+rate``: as above plus a ``limit_rate`` no run reaches;
- ``off``: ``dedup_mode="off"`` with the same concurrency limit (limits
  only, no dedup);
- ``group 1 window`` / ``group 2 windows``: a task naming a named group
  (``limit_group``, shared with a second task) of a concurrency no run
  reaches and one window, or two (a second and a day).

Admission cases, on the store alone (``--admissions`` each): one admission
of a named group's key, taken and given back (``limit_acquire.lua`` and
``limit_release.lua``, as a delivery does), with no limit (nothing to ask),
a concurrency only, a concurrency and one window, and a concurrency and two
windows: microseconds per admission and round trips per admission (from
``MONITOR``); and the same quota taken from code outside tasks,
``with celery_dedup.limits.acquire(app, group, key):``.

Measured:

- **enqueue**: ``apply_async`` per call, ``--calls`` distinct keys (limits are
  decided on the worker, so this should not move);
- **worker**: ``--tasks`` tasks pre-queued, then handed to an idle in-process
  solo worker at once (one ``RENAME`` of a staging list onto its queue), and
  drained; milliseconds per task, and the scripts the store ran per task
  (``EVALSHA`` calls from the server's command statistics).

``--repeats`` times each, alternating the order; medians are printed.

Run it from the repository root::

    .venv/bin/python -m benchmarks.limits [--tasks 2000] [--calls 2000] [--admissions 2000] [--repeats 5]
        [--output FILE]

It starts its own server, prints a Markdown table and writes
``benchmarks/results/limits.json``. Nothing here asserts on time.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

import celery_dedup
from benchmarks import harness
from celery_dedup import DedupTask, limits, runtime
from celery_dedup.keys import limit_group_member
from celery_dedup.policy import LimitPolicy, check_rates
from celery_dedup.store import limits as store_limits
from celery_dedup.testing import RedisServer

STAGE = "bench-stage"
#: Named groups no run fills: a concurrency, one window, two windows (what admissions and tasks draw on).
GROUPS: dict[str, dict[str, Any]] = {
    "bench-c": {"concurrency": 100_000},
    "bench-1w": {"concurrency": 100_000, "rate": "100000/s"},
    "bench-2w": {"concurrency": 100_000, "rate": ["100000/s", "100000/d"]},
}
CASES: dict[str, dict[str, Any]] = {
    "keyed": {},
    "concurrency": {"limit_key": "all", "limit_concurrency": 100_000},
    "concurrency+rate": {"limit_key": "all", "limit_concurrency": 100_000, "limit_rate": "100000/s"},
    "off": {"dedup_mode": "off", "limit_key": "all", "limit_concurrency": 100_000},
    "group 1 window": {"limit_group": "bench-1w", "limit_key": "{n}"},
    "group 2 windows": {"limit_group": "bench-2w", "limit_key": "{n}"},
}
#: Store-level admissions: the named group each draws on (None: no limit, nothing is asked).
ADMISSIONS: dict[str, str | None] = {
    "no limit": None,
    "concurrency": "bench-c",
    "concurrency + 1 window": "bench-1w",
    "concurrency + 2 windows": "bench-2w",
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
    app.conf.update(
        broker_url=url,
        task_ignore_result=True,
        worker_hijack_root_logger=False,
        dedup_reap_interval=0,
        dedup_limit_groups=GROUPS,
    )
    celery_dedup.install(app)
    tasks = {}
    for name, options in CASES.items():

        @app.task(base=DedupTask, name=f"bench.{name.replace(' ', '-')}", shared=False, dedup_key="n:{n}", **options)
        def body(n: int) -> None:
            done.hit()

        tasks[name] = body

    @app.task(base=DedupTask, name="bench.sharing", shared=False, dedup_key="s:{n}", limit_group="bench-2w")
    def sharing(n: int) -> None:  # the group's second task: a named group is shared, its cost is per admission
        done.hit()

    return app, tasks


class Admission:
    """One admission of a named group's key from the store, as a delivery takes and gives back its place."""

    def __init__(self, app: Celery, group: str | None) -> None:
        self.store = runtime.store_for(app)
        self.group = group
        self.member = limit_group_member(group, "acme") if group else ""
        declared = GROUPS.get(group or "", {})
        rates = check_rates(declared["rate"]) if "rate" in declared else ()
        self.policy = LimitPolicy(None, concurrency=declared.get("concurrency"), rates=rates, group=group)
        self.serial = 0

    def __call__(self) -> None:
        if self.group is None:
            return
        self.serial += 1
        token = f"bench:{self.serial}"
        answer = store_limits.acquire(
            self.store, self.member, token, token, self.policy, lease_ms=60_000, task_name="bench.admission"
        )
        if getattr(answer, "reason", None) is not None:  # a Denial: no admission was measured
            raise RuntimeError(f"admission refused: {answer}")
        store_limits.give_back(self.store, self.member, token, ran=True)


def web_acquire(app: Celery) -> Callable[[], None]:
    """``with limits.acquire(app, "bench-2w", key="acme"):``, a view's quota: a place taken and given back."""

    def call() -> None:
        with limits.acquire(app, "bench-2w", key="acme", timeout=5):
            pass

    return call


def admissions(url: str, app: Celery, calls: int, repeats: int) -> dict[str, dict[str, Any]]:
    """µs per admission (median of ``repeats`` medians) and round trips per admission, by case."""
    cases: dict[str, Any] = {name: Admission(app, group) for name, group in ADMISSIONS.items()}
    cases["limits.acquire() (2 windows)"] = web_acquire(app)
    rows: dict[str, dict[str, Any]] = {}
    for name, call in cases.items():
        for _ in range(min(calls, 50)):
            call()  # scripts loaded, connections open
        medians = [statistics.median(harness.timed(call, calls)) for _ in range(repeats)]
        counted = harness.count_commands(url, call, min(calls, 50))
        rows[name] = {
            "us_per_admission": statistics.median(medians),
            "round_trips": counted["round_trips_per_call"],
            "commands": harness.per_call(counted["client_commands_per_call"]),
            "lua_commands": sum(counted["lua_commands_per_call"].values()),
        }
    return rows


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
    script.option("--admissions", 2000, "store-level admissions per measurement")
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
        admitted = admissions(server.url, app, args.admissions, args.repeats)
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
    base_us = admitted["concurrency"]["us_per_admission"]
    print()
    print(f"store-level admissions of one group key: {args.admissions} per measurement, median of {args.repeats}")
    print()
    print(
        harness.table(
            ["admission", "µs per admission", "vs concurrency", "round trips", "commands sent", "commands in Lua"],
            [
                [
                    name,
                    row["us_per_admission"],
                    harness.ratio(row["us_per_admission"], base_us),
                    row["round_trips"],
                    row["commands"],
                    row["lua_commands"],
                ]
                for name, row in admitted.items()
            ],
        )
    )
    script.save(
        args,
        {
            "cases": rows,
            "admissions": admitted,
            "raw": {"enqueue_s": enqueue, "worker_ms": worker_ms, "scripts": scripts},
        },
    )


if __name__ == "__main__":
    main()
