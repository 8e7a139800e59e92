"""What a step costs: ``self.dedup_once`` inside a keyed task's body, in round trips and microseconds.

Cases, each a call of a keyed task (``until_executed``) run eagerly
(``task_always_eager``: the gate, the guard's start and ending, and the
steps, all on the one server, without a broker hop in the way), a new
business key per call:

- ``no steps``: the body returns at once (the baseline);
- ``1 step``: the body executes one step (``step_begin`` and ``step_end``);
- ``10 steps``: ten steps;
- ``1 step done``: the body reaches a step done already (a step of the key,
  ``scope="key"``, done by the first call of that key): what a redelivered
  run pays for a step it skips.

Measured: microseconds per call (median over ``--calls`` calls, ``--repeats``
times, cases interleaved), the cost of one step against the baseline, and
what a call sends to the server (round trips, and the commands the scripts
run, from ``MONITOR``); and what a finished run with two steps keeps in
memory (its record, with the steps' history entries, and its steps hash)
against one without.

Run it from the repository root::

    .venv/bin/python -m benchmarks.steps [--calls 2000] [--repeats 5] [--rt-calls 50] [--output FILE]

It starts its own server, prints a Markdown table and writes
``benchmarks/results/steps.json``. Nothing here asserts on time.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery

import celery_dedup
from benchmarks import harness
from celery_dedup import DedupTask
from celery_dedup.keys import KeySchema, member_for
from celery_dedup.testing import RedisServer

#: case -> the steps a call reaches.
CASES: dict[str, int] = {"no steps": 0, "1 step": 1, "10 steps": 10, "1 step done": 1}


def build_app(url: str) -> tuple[Celery, dict[str, Any]]:
    app = Celery("bench_steps", set_as_current=False)
    app.conf.update(
        broker_url=url,
        task_always_eager=True,
        task_eager_propagates=True,
        task_ignore_result=True,
        dedup_reap_interval=0,
    )
    celery_dedup.install(app)

    @app.task(base=DedupTask, bind=True, name="bench.steps", shared=False, dedup_key="n:{n}")
    def body(self: DedupTask, n: int, steps: int, scope: str) -> None:
        for i in range(steps):
            self.dedup_once(f"step-{i}", lambda key: key, scope=scope)

    return app, {"task": body}


def caller(task: Any, case: str, serial: Callable[[], int]) -> Callable[[], object]:
    if case == "1 step done":
        task.apply_async((-1, 1, "key"))  # the key's step is done from here on
        return lambda: task.apply_async((-1, 1, "key"))
    steps = CASES[case]
    return lambda: task.apply_async((serial(), steps, "run"))


def footprint(url: str, task: Any) -> dict[str, int | None]:
    """``MEMORY USAGE`` (bytes) of a finished run's record without steps, and with two steps and their hash."""
    client = redis.Redis.from_url(url)
    schema = KeySchema("dedup")
    task.apply_async((-2, 0, "run"))
    task.apply_async((-3, 2, "run"))
    plain, stepped = member_for(task.name, "n:-2"), member_for(task.name, "n:-3")
    found = {
        "record_without_steps": client.memory_usage(schema.record(plain)),
        "record_with_2_steps": client.memory_usage(schema.record(stepped)),
        "steps_hash_2_steps": client.memory_usage(schema.steps(stepped)),
    }
    client.close()
    return found


def main(argv: list[str] | None = None) -> None:
    script = harness.Script("steps", __doc__)
    script.option("--calls", 2000, "timed calls per case and repeat")
    script.option("--repeats", 5, "measurements per case")
    script.option("--rt-calls", 50, "calls per case for the command count")
    args = script.parse(argv)

    counter = itertools.count()
    took: dict[str, list[float]] = {case: [] for case in CASES}
    commands: dict[str, dict[str, Any]] = {}
    with RedisServer() as server:
        script.header(f"server: {server.binary} ({server.version()})")
        app, tasks = build_app(server.url)
        calls = {case: caller(tasks["task"], case, lambda: next(counter)) for case in CASES}
        for call in calls.values():  # warm: scripts loaded, connections open
            harness.timed(call, 50)
        for repeat in range(args.repeats):
            order = list(CASES) if repeat % 2 == 0 else list(CASES)[::-1]
            for case in order:
                took[case].append(statistics.median(harness.timed(calls[case], args.calls)))
                harness.progress(f"repeat {repeat + 1}: {case} {took[case][-1]:.0f} µs")
        for case, call in calls.items():
            counted = harness.count_commands(server.url, call, args.rt_calls)
            counted.pop("entries")
            commands[case] = counted
        memory = footprint(server.url, tasks["task"])
        app.close()

    base = statistics.median(took["no steps"])
    base_trips = commands["no steps"]["round_trips_per_call"]
    rows = {}
    for case, steps in CASES.items():
        median = statistics.median(took[case])
        trips = commands[case]["round_trips_per_call"]
        rows[case] = {
            "us_per_call_median": median,
            "us_per_step": (median - base) / steps if steps else 0.0,
            "round_trips_per_call": trips,
            "round_trips_per_step": (trips - base_trips) / steps if steps else 0.0,
            "lua_commands_per_call": commands[case]["lua_commands_per_call"],
        }
    print()
    print(f"{args.calls} calls per case, median of {args.repeats}; eager calls, one server")
    print()
    print(
        harness.table(
            ["case", "per call µs", "per step µs", "round trips per call", "per step", "commands in Lua per call"],
            [
                [
                    case,
                    row["us_per_call_median"],
                    row["us_per_step"] if CASES[case] else "-",
                    row["round_trips_per_call"],
                    row["round_trips_per_step"] if CASES[case] else "-",
                    harness.per_call(row["lua_commands_per_call"]),
                ]
                for case, row in rows.items()
            ],
        )
    )
    print()
    print(
        "memory (MEMORY USAGE, bytes): a finished run's record without steps "
        f"{memory['record_without_steps']}, with two steps {memory['record_with_2_steps']} "
        f"(their history entries), and their steps hash {memory['steps_hash_2_steps']}"
    )
    script.save(args, {"cases": rows, "memory": memory, "raw": {"us_per_call": took}, "commands": commands})


if __name__ == "__main__":
    main()
