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

    .venv/bin/python benchmarks/cluster.py [--calls 2000] [--threads 8] [--repeats 3]

It prints a Markdown table and writes ``benchmarks/results/cluster.json``.
Nothing here asserts on time; the numbers are for reading.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import save, versions  # noqa: E402
from celery_dedup.keys import member_for, new_nonce, new_task_id  # noqa: E402
from celery_dedup.store import DedupStore  # noqa: E402
from celery_dedup.testing import RedisCluster, RedisServer  # noqa: E402

DEFAULT_OUTPUT = ROOT / "benchmarks" / "results" / "cluster.json"
HOLD_MS, GRACE_MS, LEASE_MS = 3_600_000, 86_400_000, 30_000


def new_key(store: DedupStore, member: str) -> None:
    """Hold ``member`` with a lease, then confirm it: the two Redis steps of a new key's two-phase call."""
    run, nonce = new_task_id(member), new_nonce()
    outcome = store.gate(member, run, nonce, hold_ms=HOLD_MS, grace_ms=GRACE_MS, task_name="bench", lease_ms=LEASE_MS)
    assert outcome.accepted, outcome
    assert store.confirm(member, run, nonce, hold_ms=HOLD_MS, grace_ms=GRACE_MS).accepted


def duplicate(store: DedupStore, member: str) -> None:
    outcome = store.gate(
        member, new_task_id(member), new_nonce(), hold_ms=HOLD_MS, grace_ms=GRACE_MS, task_name="bench"
    )
    assert not outcome.accepted, outcome


def timed(store: DedupStore, case: str, calls: int, threads: int, tag: str) -> tuple[float, list[float]]:
    """``calls`` calls split over ``threads`` threads; returns (calls per second, per-call latencies in µs)."""
    per_thread = calls // threads
    latencies: list[list[float]] = [[] for _ in range(threads)]
    members = [[member_for("bench", f"{tag}:{t}:{i}") for i in range(per_thread)] for t in range(threads)]
    if case == "duplicate":
        for row in members:
            for member in row:
                new_key(store, member)
    step = new_key if case == "new key" else duplicate
    start = threading.Barrier(threads + 1)

    def work(t: int) -> None:
        start.wait()
        for member in members[t]:
            began = time.perf_counter()
            step(store, member)
            latencies[t].append((time.perf_counter() - began) * 1e6)

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for thread in pool:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in pool:
        thread.join()
    elapsed = time.perf_counter() - began
    flat = [value for row in latencies for value in row]
    return len(flat) / elapsed, flat


def percentile(values: Sequence[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0] if __doc__ else None)
    parser.add_argument("--calls", type=int, default=2000, help="calls per case, store and thread count (default 2000)")
    parser.add_argument("--threads", type=int, default=8, help="threads of the concurrent rows (default 8)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats; the median repeat is shown (default 3)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON result file")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rows: list[dict[str, Any]] = []
    with RedisServer() as single, RedisCluster() as cluster:
        stores = {
            "single": DedupStore(redis.Redis.from_url(single.url), "dedup"),
            "cluster": DedupStore(cast(redis.Redis, cluster.client()), "dedup", wait_replicas=1),
            "cluster, no wait": DedupStore(cast(redis.Redis, cluster.client()), "dedup", wait_replicas=0),
        }
        for threads in (1, args.threads):
            for case in ("new key", "duplicate"):
                for name, store in stores.items():
                    repeats = [
                        timed(store, case, args.calls, threads, f"{name}:{case}:{threads}:{n}")
                        for n in range(args.repeats)
                    ]
                    repeats.sort(key=lambda item: item[0])
                    rate, latencies = repeats[len(repeats) // 2]
                    rows.append(
                        {
                            "store": name,
                            "case": case,
                            "threads": threads,
                            "calls_per_s": rate,
                            "p50_us": statistics.median(latencies),
                            "p99_us": percentile(latencies, 0.99),
                            "shards": store.schema.shards,
                        }
                    )
                    print(f"{name} / {case} / {threads} threads done", file=sys.stderr)
    print()
    print(f"Two-phase gate steps, {args.calls} calls per row, median of {args.repeats} repeats:")
    print()
    print("| store | case | threads | calls/s | p50 µs | p99 µs | vs single |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for row in rows:
        base = next(
            r for r in rows if r["store"] == "single" and (r["case"], r["threads"]) == (row["case"], row["threads"])
        )
        print(
            f"| {row['store']} | {row['case']} | {row['threads']} | {row['calls_per_s']:,.0f} | "
            f"{row['p50_us']:,.0f} | {row['p99_us']:,.0f} | {row['calls_per_s'] / base['calls_per_s']:.2f}x |"
        )
    save(args.output, {"versions": versions(), "calls": args.calls, "repeats": args.repeats, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
