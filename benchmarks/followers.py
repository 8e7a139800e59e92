"""What a follower costs: Redis memory, round trips, and how soon it resolves once its run ends.

A follower is a duplicate call that carries something to continue (a group or
chord member, callbacks, a chain): the gate parks its message as a follower of
the accepted run, and the run's ending releases it (see the guarantees doc).

What it measures, on a real server with a real worker:

- **memory**: ``--followers`` followers (``apply_async(link=...)``) parked on one
  run that no worker has taken yet: ``MEMORY USAGE`` of the key's followers
  hash, per follower, next to the size of the message each one parks;
- **round trips**: the scripts the server ran (``INFO commandstats``) for one
  follower publish (the ending of a run with followers costs one more, to
  hand over its return value: see ``settle.lua``);
- **resolution**: with a worker running, the time from the run's body
  returning to each follower's callback having run (median and max), for
  ``--followers`` followers.

Run it from the repository root::

    .venv/bin/python -m benchmarks.followers [--followers 200] [--output FILE]

It prints Markdown tables and writes ``benchmarks/results/followers.json``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

import celery_dedup
from benchmarks import harness
from celery_dedup import DedupTask
from celery_dedup.keys import KeySchema, member_for
from celery_dedup.testing import RedisServer

SCHEMA = KeySchema("dedup")


def build(url: str) -> tuple[Celery, Any, Any]:
    app = Celery("followers", broker=url, backend=url, set_as_current=False)
    app.conf.update(worker_hijack_root_logger=False, broker_connection_retry_on_startup=False)
    celery_dedup.install(app)
    client = redis.Redis.from_url(url)

    @app.task(base=DedupTask, name="bench.work", dedup_key="work:{n}", shared=False)
    def work(n: int, seconds: float = 0.0) -> int:
        time.sleep(seconds)
        client.set("bench:returned", time.time())
        return n

    @app.task(name="bench.callback", shared=False)
    def callback(value: int) -> None:
        client.rpush("bench:callbacks", time.time())

    return app, work, callback


def script_calls(client: redis.Redis) -> int:
    """Scripts the server ran (``EVALSHA``/``EVAL``): each is one round trip of the caller."""
    stats = client.info("commandstats")
    return sum(int(stats.get(name, {}).get("calls", 0)) for name in ("cmdstat_evalsha", "cmdstat_eval"))


def measure(followers: int) -> dict[str, Any]:
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        app, work, callback = build(server.url)
        run = work.delay(1, 0.5)
        work.apply_async((1, 0.5), link=callback.s())  # scripts loaded, caches warm
        before = script_calls(client)
        work.apply_async((1, 0.5), link=callback.s())
        per_publish = script_calls(client) - before
        for _ in range(followers - 2):
            work.apply_async((1, 0.5), link=callback.s())
        member = member_for(work.name, "work:1")
        hash_bytes = int(client.memory_usage(SCHEMA.followers(member), samples=0) or 0)
        queue_entry = len(client.lindex("celery", 0) or b"")
        with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False, loglevel="WARNING"):
            assert run.get(timeout=30) == 1
            deadline = time.monotonic() + 60
            while client.llen("bench:callbacks") < followers and time.monotonic() < deadline:
                time.sleep(0.02)
        returned = float(client.get("bench:returned") or 0)
        done = [float(t) - returned for t in client.lrange("bench:callbacks", 0, -1)]
        app.close()
    return {
        "followers": followers,
        "bytes_per_follower": hash_bytes / followers,
        "message_bytes": queue_entry,
        "scripts_per_follower_publish": per_publish,
        "resolved": len(done),
        "resolve_median_ms": statistics.median(done) * 1000 if done else None,
        "resolve_max_ms": max(done) * 1000 if done else None,
    }


def main() -> None:
    script = harness.Script("followers", __doc__)
    script.option("--followers", 200, "followers parked on one run")
    args = script.parse()
    result = measure(args.followers)
    print(
        harness.table(
            ["followers", "bytes / follower (parked)", "message bytes", "round trips / follower publish"],
            [
                [
                    result["followers"],
                    result["bytes_per_follower"],
                    result["message_bytes"],
                    result["scripts_per_follower_publish"],
                ]
            ],
        )
    )
    print()
    print(
        harness.table(
            ["followers resolved", "after the run returned: median ms", "max ms"],
            [[result["resolved"], result["resolve_median_ms"], result["resolve_max_ms"]]],
        )
    )
    script.save(args, result)


if __name__ == "__main__":
    main()
