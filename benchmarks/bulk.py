"""Bulk gated enqueue against a loop of ``apply_async``, on a real Redis-compatible server.

Both enqueue the same ``--tasks`` keyed calls (``--duplicates`` of them repeat
an earlier key) of one DedupTask, through one producer, into an empty queue;
each message is gated atomically either way. Repeats alternate which goes
first. Reported: median and min-max seconds and calls/s, and the ratio.

Run it from the repository root::

    .venv/bin/python -m benchmarks.bulk [--tasks 10000] [--duplicates 0.1] [--repeats 5] [--output FILE]

It starts its own server, prints a Markdown table and writes
``benchmarks/results/bulk.json``.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import redis
from celery import Celery

import celery_dedup
from benchmarks import harness
from celery_dedup import DedupTask
from celery_dedup.testing import RedisServer

Call = tuple[tuple[Any, ...], dict[str, Any]]


def calls_for(tasks: int, duplicates: float, seed: int) -> list[Call]:
    unique = int(tasks * (1 - duplicates))
    rng = random.Random(seed)
    keys = list(range(unique)) + [rng.randrange(unique) for _ in range(tasks - unique)]
    rng.shuffle(keys)
    return [((key,), {"text": f"hello {key}"}) for key in keys]


def run(task: Any, client: redis.Redis, calls: list[Call], how: str) -> tuple[float, int]:
    client.flushdb()
    start = time.perf_counter()
    if how == "bulk":
        results = task.apply_async_many(calls)
    else:
        results = [task.apply_async(args, kwargs) for args, kwargs in calls]
    elapsed = time.perf_counter() - start
    unique = len({args[0] for args, _ in calls})
    assert sum(not result.deduplicated for result in results) == unique == client.llen("celery")
    return elapsed, unique


def main(argv: list[str] | None = None) -> None:
    script = harness.Script("bulk", __doc__)
    script.option("--tasks", 10_000, "calls per run")
    script.option("--duplicates", 0.1, "share of calls repeating a key", minimum=0)
    script.option("--repeats", 5, "runs of each")
    args = script.parse(argv)

    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        version = server.version()
        script.header(f"server: {server.binary} ({version})")
        app = Celery("bench_bulk", set_as_current=False)
        app.conf.update(broker_url=server.url, task_ignore_result=True)
        celery_dedup.install(app)

        @app.task(base=DedupTask, name="bench.notify", shared=False, dedup_key="customer:{customer_id}")
        def notify(customer_id: int, text: str) -> None:
            """Never runs here: only enqueued."""

        calls = calls_for(args.tasks, args.duplicates, seed=1)
        run(notify, client, calls[:200], "bulk")  # warm up both paths and load the scripts
        run(notify, client, calls[:200], "loop")
        times: dict[str, list[float]] = {"loop": [], "bulk": []}
        for repeat in range(args.repeats):
            for how in ("loop", "bulk") if repeat % 2 == 0 else ("bulk", "loop"):
                elapsed, unique = run(notify, client, calls, how)
                times[how].append(elapsed)
        app.close()

    rows = []
    for how, label in (("loop", "loop of `apply_async`"), ("bulk", "`apply_async_many`")):
        median = statistics.median(times[how])
        rows.append(
            {
                "case": label,
                "median_s": median,
                "min_s": min(times[how]),
                "max_s": max(times[how]),
                "calls_per_s": args.tasks / median,
                "us_per_call": median / args.tasks * 1e6,
            }
        )
    speedup = rows[0]["median_s"] / rows[1]["median_s"]
    print()
    dups = args.tasks - unique
    print(f"{args.tasks} calls of a DedupTask ({unique} keys, {dups} duplicates), {args.repeats} runs each")
    print()
    print(
        harness.table(
            ["case", "median s", "min s", "max s", "calls/s", "µs/call", "throughput vs loop"],
            [
                [
                    row["case"],
                    row["median_s"],
                    row["min_s"],
                    row["max_s"],
                    row["calls_per_s"],
                    row["us_per_call"],
                    f"{ratio:.2f}x",
                ]
                for row, ratio in zip(rows, (1.0, speedup), strict=True)
            ],
        )
    )
    script.save(args, {"server": str(version), "rows": rows, "speedup": speedup, "runs": times})


if __name__ == "__main__":
    main()
