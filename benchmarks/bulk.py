"""Bulk gated enqueue against a loop of ``apply_async``, on a real Redis-compatible server.

Both enqueue the same ``--tasks`` keyed calls (``--duplicates`` of them repeat
an earlier key) of one DedupTask, through one producer, into an empty queue;
each message is gated atomically either way. Repeats alternate which goes
first. Reported: median and min-max seconds and calls/s, and the ratio.

Run it from the repository root::

    .venv/bin/python benchmarks/bulk.py [--tasks 10000] [--duplicates 0.1] [--repeats 5] [--output FILE]

It starts its own server, prints a Markdown table and writes
``benchmarks/results/bulk.json``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import redis
from celery import Celery

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import celery_dedup  # noqa: E402
from benchmarks.harness import save, versions  # noqa: E402
from celery_dedup import DedupTask  # noqa: E402
from celery_dedup.testing import RedisServer  # noqa: E402

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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=10_000, help="calls per run (default 10000)")
    parser.add_argument("--duplicates", type=float, default=0.1, help="share of calls repeating a key (default 0.1)")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each (default 5)")
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "bulk.json")
    args = parser.parse_args(argv)

    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        info = client.info("server")
        version = info.get("valkey_version") or info.get("redis_version")
        print(f"server: {server.binary} ({version})")
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
    print("| case | median s | min-max s | calls/s | µs/call | throughput vs loop |")
    print("|---|---:|---:|---:|---:|---:|")
    for row, ratio in zip(rows, (1.0, speedup), strict=True):
        print(
            f"| {row['case']} | {row['median_s']:.3f} | {row['min_s']:.3f}-{row['max_s']:.3f} "
            f"| {row['calls_per_s']:,.0f} | {row['us_per_call']:.1f} | {ratio:.2f}x |"
        )
    save(
        args.output,
        {
            "versions": versions() | {"server": str(version)},
            "rows": rows,
            "speedup": speedup,
            "runs": times,
            "options": vars(args) | {"output": str(args.output)},
        },
    )


if __name__ == "__main__":
    main()
