"""The two-phase gate against a Redis Cluster store, beside the same store on one server.

What it measures: the latency (p50/p99) and throughput of the gate's two
scripts for a new key (hold with a lease, then confirm: what ``apply_async``
does around the publish on a broker apart from the store), and of a
duplicate's hold, on

- ``single``: one Valkey server, one shard (the plain key names);
- ``cluster``: a local 3-master, 3-replica Valkey cluster, 16 shards, each
  decision answered once a replica has it (``dedup_cluster_wait_replicas=1``);
- ``cluster, no wait``: the same cluster without waiting for a replica;

from one thread and from ``--threads`` threads (each its own keys). The
cluster's nodes and the single server share this machine, so the cluster
costs what its protocol and the WAIT cost, not what more hardware would buy.

Run it from the repository root::

    .venv/bin/python -m benchmarks.cluster [--calls 2000] [--threads 8] [--repeats 3]

It prints a Markdown table and writes ``benchmarks/results/cluster.json``.
Nothing here asserts on time; the numbers are for reading.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, cast

import redis

from benchmarks import harness
from celery_dedup.keys import member_for, new_nonce, new_task_id
from celery_dedup.store.store import DedupStore
from celery_dedup.testing import RedisServer
from tests.servers import RedisCluster

HOLD_MS, GRACE_MS, LEASE_MS = 3_600_000, 86_400_000, 30_000


def new_key(store: DedupStore, member: str) -> None:
    """Hold ``member`` with a lease, then confirm it: the two Redis steps of a new key's two-phase call."""
    run, nonce = new_task_id(member), new_nonce()
    outcome = store.gate(member, run, nonce, hold_ms=HOLD_MS, grace_ms=GRACE_MS, lease_ms=LEASE_MS)
    assert outcome.accepted, outcome
    assert store.confirm(member, run, nonce, hold_ms=HOLD_MS, grace_ms=GRACE_MS).accepted


def duplicate(store: DedupStore, member: str) -> None:
    outcome = store.gate(member, new_task_id(member), new_nonce(), hold_ms=HOLD_MS, grace_ms=GRACE_MS)
    assert not outcome.accepted, outcome


def timed(store: DedupStore, case: str, calls: int, threads: int, tag: str) -> tuple[float, list[float]]:
    """``calls`` calls of ``case`` split over ``threads`` threads, each on its own keys."""
    per_thread = calls // threads
    members = [[member_for("bench", f"{tag}:{t}:{i}") for i in range(per_thread)] for t in range(threads)]
    if case == "duplicate":
        for row in members:
            for member in row:
                new_key(store, member)
    step = new_key if case == "new key" else duplicate
    return harness.threaded(lambda t, i: step(store, members[t][i]), per_thread * threads, threads)


def main(argv: Sequence[str] | None = None) -> int:
    script = harness.Script("cluster", __doc__)
    script.option("--calls", 2000, "calls per case, store and thread count")
    script.option("--threads", 8, "threads of the concurrent rows")
    script.option("--repeats", 3, "repeats; the median repeat is shown")
    args = script.parse(argv)
    rows: list[dict[str, Any]] = []
    with RedisServer() as single, RedisCluster() as cluster:
        script.header(f"server: {single.binary} ({single.version()}); cluster: 3 masters, 3 replicas")
        stores = {
            "single": DedupStore(redis.Redis.from_url(single.url), "dedup"),
            "cluster": DedupStore(cast(redis.Redis, cluster.client()), "dedup", wait_replicas=1),
            "cluster, no wait": DedupStore(cast(redis.Redis, cluster.client()), "dedup", wait_replicas=0),
        }
        for threads in (1, args.threads):
            for case in ("new key", "duplicate"):
                for name, store in stores.items():
                    runs = [
                        timed(store, case, args.calls, threads, f"{name}:{case}:{threads}:{n}")
                        for n in range(args.repeats)
                    ]
                    rate, latencies = harness.middle(runs, key=lambda run: run[0])
                    rows.append(
                        {
                            "store": name,
                            "case": case,
                            "threads": threads,
                            "calls_per_s": rate,
                            "p50_us": harness.percentile(latencies, 0.5),
                            "p99_us": harness.percentile(latencies, 0.99),
                            "shards": store.schema.shards,
                        }
                    )
                    harness.progress(f"{name} / {case} / {threads} threads done")

    def base(row: dict[str, Any]) -> float:
        return float(
            next(
                r["calls_per_s"]
                for r in rows
                if r["store"] == "single" and (r["case"], r["threads"]) == (row["case"], row["threads"])
            )
        )

    print()
    print(f"Two-phase gate steps, {args.calls} calls per row, median of {args.repeats} repeats:")
    print()
    print(
        harness.table(
            ["store", "case", "threads", "calls/s", "p50 µs", "p99 µs", "vs single"],
            [
                [
                    r["store"],
                    r["case"],
                    r["threads"],
                    r["calls_per_s"],
                    r["p50_us"],
                    r["p99_us"],
                    harness.ratio(r["calls_per_s"], base(r)),
                ]
                for r in rows
            ],
        )
    )
    script.save(args, {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
