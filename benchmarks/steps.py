"""What a step costs: ``self.dedup_once`` inside a keyed task's body, in round trips and microseconds.

Cases, each a call of a keyed task (``until_executed``) run eagerly
(``task_always_eager``: the gate, the guard's start and ending, and the
steps, all on the one server, without a broker hop in the way), a new
business key per call:

- ``no steps``: the body returns at once (the baseline);
- ``1 step``: the body executes one step (``step_begin`` and ``step_end``);
- ``10 steps``: ten steps;
- ``again, no steps``: every call a new run of one key whose earlier run
  ended (the gate takes the key over first), no steps: the baseline of
- ``again, 1 step done``: the same, the body reaching a step done already (a
  step of the key, ``scope="key"``, done by the key's first call): what a
  redelivered run pays for a step it skips.

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
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery

import celery_dedup
from benchmarks import harness
from celery_dedup import DedupTask
from celery_dedup.keys import KeySchema, member_for
from celery_dedup.testing import RedisServer


@dataclass(frozen=True)
class Case:
    #: Steps a call reaches.
    steps: int
    #: The case its cost per step is measured against.
    baseline: str
    #: The business key of every call (None: a new one per call); its earlier run ended.
    key: int | None = None
    scope: str = "run"


CASES: dict[str, Case] = {
    "no steps": Case(0, "no steps"),
    "1 step": Case(1, "no steps"),
    "10 steps": Case(10, "no steps"),
    # Every call a new run of one key, whose earlier run ended: the gate takes the key over first.
    "again, no steps": Case(0, "again, no steps", key=-4),
    "again, 1 step done": Case(1, "again, no steps", key=-1, scope="key"),
}


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


def caller(task: Any, case: Case, serial: Callable[[], int]) -> Callable[[], object]:
    if case.key is not None:
        fixed = (case.key, case.steps, case.scope)
        task.apply_async(fixed)  # the key has an ended run (and a step of the key's done) from here on
        return lambda: task.apply_async(fixed)
    return lambda: task.apply_async((serial(), case.steps, case.scope))


def footprint(url: str, task: Any) -> dict[str, int | None]:
    """``MEMORY USAGE`` (bytes) of a finished run's record without steps, and with two steps and its steps hash."""
    client = redis.Redis.from_url(url)
    schema = KeySchema("dedup")
    task.apply_async((-2, 0, "run"))
    run = task.apply_async((-3, 2, "run"))
    plain, stepped = member_for(task.name, "n:-2"), member_for(task.name, "n:-3")
    found = {
        "record_without_steps": client.memory_usage(schema.record(plain)),
        "record_with_2_steps": client.memory_usage(schema.record(stepped)),
        "steps_hash_2_steps": client.memory_usage(schema.run_steps(stepped, run.id)),
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
    took: dict[str, list[float]] = {name: [] for name in CASES}
    commands: dict[str, dict[str, Any]] = {}
    with RedisServer() as server:
        script.header(f"server: {server.binary} ({server.version()})")
        app, tasks = build_app(server.url)
        calls = {name: caller(tasks["task"], case, lambda: next(counter)) for name, case in CASES.items()}
        for call in calls.values():  # warm: scripts loaded, connections open
            harness.timed(call, 50)
        for repeat in range(args.repeats):
            order = list(CASES) if repeat % 2 == 0 else list(CASES)[::-1]
            for name in order:
                took[name].append(statistics.median(harness.timed(calls[name], args.calls)))
                harness.progress(f"repeat {repeat + 1}: {name} {took[name][-1]:.0f} µs")
        for name, call in calls.items():
            counted = harness.count_commands(server.url, call, args.rt_calls)
            counted.pop("entries")
            commands[name] = counted
        memory = footprint(server.url, tasks["task"])
        app.close()

    rows = {}
    for name, case in CASES.items():
        median = statistics.median(took[name])
        trips = commands[name]["round_trips_per_call"]
        base, base_trips = statistics.median(took[case.baseline]), commands[case.baseline]["round_trips_per_call"]
        rows[name] = {
            "us_per_call_median": median,
            "us_per_step": (median - base) / case.steps if case.steps else 0.0,
            "round_trips_per_call": trips,
            "round_trips_per_step": (trips - base_trips) / case.steps if case.steps else 0.0,
            "lua_commands_per_call": commands[name]["lua_commands_per_call"],
        }
    print()
    print(f"{args.calls} calls per case, median of {args.repeats}; eager calls, one server")
    print()
    print(
        harness.table(
            ["case", "per call µs", "per step µs", "round trips per call", "per step", "commands in Lua per call"],
            [
                [
                    name,
                    row["us_per_call_median"],
                    row["us_per_step"] if CASES[name].steps else "-",
                    row["round_trips_per_call"],
                    row["round_trips_per_step"] if CASES[name].steps else "-",
                    harness.per_call(row["lua_commands_per_call"]),
                ]
                for name, row in rows.items()
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
