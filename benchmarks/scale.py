"""Does a keyed task's cost grow with the number of keys in flight? At 10k, 100k and 1M held keys.

The store is filled through the real gate script, pipelined (``DedupStore.gate_many``,
1,000 calls per chunk): every key is held, queued with its record, history and
index entries, and its (small) message is on a queue, as ``apply_async`` leaves
it. At each size, on the same server, ``--rounds`` rounds of (the table keeps
each figure's median over the rounds; one round more comes first and is not
kept, as the server is still rehashing its tables right after a fill):

- **gate**: ``--calls`` ``apply_async`` calls of new keys, then as many of
  held keys this process never called (duplicates), each timed alone: p50 and
  p99 µs;
- **admin**: the Django admin's record list (first page, ``?state=queued``
  and a key-prefix search), rendered ``--renders`` times each: median ms;
- **reaper**: ``--passes`` passes of ``DedupStore.reap`` with the default
  budget (500 entries per step): median ms per pass;
- **worker**: the guard's two calls (``start``, then ``finish`` as a success)
  on ``--calls`` of the queued keys, timed as a pair: p50 and p99 µs.

Run it from the repository root::

    .venv/bin/python -m benchmarks.scale [--sizes 10000,100000,1000000] [--calls 1000] [--rounds 3]

``--quick`` means ``--sizes 10000,100000``. It starts its own server, prints a
Markdown table with each figure's growth from the smallest size to the largest,
and writes ``benchmarks/results/scale.json``. The 1M fill takes a minute or two
and about 1.5 GB of server memory. Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import redis

from benchmarks import harness
from benchmarks.admin import LIST, TASKS, build_app, configure_django, render
from celery_dedup import runtime
from celery_dedup.keys import member_for, new_nonce, new_task_id
from celery_dedup.store.store import GateCall
from celery_dedup.testing import RedisServer
from celery_dedup.worker.lock import new_token

QUEUE = "bench-scale"
HOLD_MS = 86_400_000
RECORD_MS = 86_400_000


def timed(calls: Sequence[Callable[[], Any]]) -> list[float]:
    """µs of each call, one at a time (each call its own arguments)."""
    calls_left = iter(calls)

    def each() -> None:
        next(calls_left)()

    return harness.timed(each, len(calls))


class Scale:
    """The server, the app and the keys filled so far (``order:<n>`` of ``shop.charge``, n from 0)."""

    def __init__(self, url: str) -> None:
        self.app = build_app(url)
        self.task = self.app.tasks[TASKS[0]]
        self.store = runtime.store_for(self.app)
        self.admin = redis.Redis.from_url(url)
        self.filled = 0
        self.fresh = 10**9  # keys of the timed new-key calls, far from the filled ones

    def _calls(self, start: int, stop: int, chunk: int = 1000) -> Iterator[list[GateCall]]:
        for low in range(start, stop, chunk):
            calls = []
            for n in range(low, min(stop, low + chunk)):
                key = f"order:{n:08d}"
                member, task_id = member_for(self.task.name, key), new_task_id(key)
                message = json.dumps(
                    {"headers": {"id": task_id, "task": self.task.name}, "properties": {"delivery_tag": task_id}}
                )
                calls.append(
                    self.store.gate_call(
                        member,
                        task_id,
                        new_nonce(),
                        hold_ms=HOLD_MS,
                        grace_ms=RECORD_MS,
                        argsrepr=f"({n},)",
                        kwargsrepr="{}",
                        queue=QUEUE,
                        message=message,
                        delivery_tag=task_id,
                        unacked_key="unacked",
                    )
                )
            yield calls

    def fill(self, size: int) -> float:
        """Gate keys until ``size`` are held; returns the seconds it took."""
        began = time.monotonic()
        outcomes = self.store.gate_many(self._calls(self.filled, size))
        if not all(outcome.accepted for outcome in outcomes):
            raise RuntimeError("a fill key was not accepted")
        self.filled = size
        return time.monotonic() - began

    def held(self) -> int:
        return int(self.admin.scard(self.store.schema.held))

    def gate(self, calls: int, first_held: int, warmup: int = 200) -> dict[str, list[float]]:
        """``apply_async`` of new keys, then of held ones, over one producer (as enqueue.py times it).

        The held keys, from ``first_held`` on, were never called by this process: each duplicate
        goes to the gate (a key this process saw held is answered by a cheaper read).
        """
        with self.app.producer_or_acquire() as producer:
            new_keys, held_keys = [], []
            for _ in range(warmup + calls):
                self.fresh += 1
                order = self.fresh
                new_keys.append(lambda order=order: self.task.apply_async((order,), producer=producer))
            for n in range(first_held, first_held + warmup + calls):
                held_keys.append(lambda n=n: self.task.apply_async((f"{n:08d}",), producer=producer))
            new, duplicate = timed(new_keys)[warmup:], timed(held_keys)[warmup:]
            probe = self.task.apply_async((f"{first_held:08d}",), producer=producer)
        if not getattr(probe, "deduplicated", False):
            raise RuntimeError("a filled key was not held")
        return {"new": new, "duplicate": duplicate}

    def worker(self, calls: int, stop: int) -> list[float]:
        """start + finish of the ``calls`` filled keys before ``stop`` (they end, as a worker would end them)."""
        pairs = []
        for n in range(stop - calls, stop):
            key = f"order:{n:08d}"
            member = member_for(self.task.name, key)
            task_id = self.store.record(member)["task_id"]  # type: ignore[index]
            token = new_token()

            def pair(member: str = member, task_id: str = task_id, token: str = token) -> None:
                harness.start_run(self.store, member, task_id, token, record_ms=RECORD_MS)
                self.store.finish(member, task_id, "succeeded", drop=True, record_ms=RECORD_MS, token=token, role="run")

            pairs.append(pair)
        return timed(pairs)

    def reaper(self, passes: int) -> list[float]:
        return [us / 1000 for us in harness.timed(lambda: self.store.reap(record_ms=RECORD_MS), passes)]


def page_ms(client: Any, url: str, renders: int) -> float:
    """Median ms of ``renders`` renders of the admin page at ``url``."""
    return statistics.median(us / 1000 for us in harness.timed(lambda: render(client, url), renders))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    with RedisServer() as server:
        scale = Scale(server.url)
        client = configure_django(scale.app)
        pages = {"first page": LIST, "state=queued": f"{LIST}?state=queued", "key prefix": f"{LIST}?q=order:0000012"}
        for url in pages.values():
            render(client, url)  # warm: templates, connections, scripts
        for size in args.sizes:
            first_held = scale.filled
            fill_s = scale.fill(size)
            info = scale.admin.info("memory")
            rounds: list[dict[str, float]] = []
            for round_ in range(args.rounds + 1):
                # Each round takes its own held keys: the duplicates' from the start of this size's fill,
                # the guard's from its end. Round 0 is not kept: right after a fill the server is still
                # rehashing its grown tables, and the first rounds at 1M keys ran up to 5x slower.
                gate = scale.gate(args.calls, first_held + round_ * (args.calls + 200))
                admin_ms = {name: page_ms(client, url, args.renders) for name, url in pages.items()}
                reaper = scale.reaper(args.passes)
                worker = scale.worker(args.calls, size - round_ * args.calls)
                rounds.append(
                    {
                        "round": round_,
                        "gate_new_p50_us": statistics.median(gate["new"]),
                        "gate_new_p99_us": harness.percentile(gate["new"], 0.99),
                        "gate_duplicate_p50_us": statistics.median(gate["duplicate"]),
                        "gate_duplicate_p99_us": harness.percentile(gate["duplicate"], 0.99),
                        "worker_pair_p50_us": statistics.median(worker),
                        "worker_pair_p99_us": harness.percentile(worker, 0.99),
                        "reaper_pass_median_ms": statistics.median(reaper),
                        **{f"admin_{name.replace(' ', '_').replace('=', '_')}_ms": ms for name, ms in admin_ms.items()},
                    }
                )
            row = {
                "size": size,
                "held": scale.held(),
                "fill_s": fill_s,
                "used_memory": int(info["used_memory"]),
                # The median of the rounds' figures: one round's can catch a burst of machine load.
                **{
                    metric: statistics.median(r[metric] for r in rounds[1:])
                    for metric in rounds[0]
                    if metric != "round"
                },
                "rounds": rounds,  # the first is the warm-up, not in the medians
            }
            rows.append(row)
            harness.progress(f"size {size}: filled in {fill_s:.1f} s")
        scale.app.close()
    return {"rows": rows}


METRICS = (
    ("gate, new key p50 / p99 µs", "gate_new_p50_us", "gate_new_p99_us"),
    ("gate, duplicate p50 / p99 µs", "gate_duplicate_p50_us", "gate_duplicate_p99_us"),
    ("worker start + finish p50 / p99 µs", "worker_pair_p50_us", "worker_pair_p99_us"),
    ("reaper pass, median ms", "reaper_pass_median_ms", None),
    ("admin first page, median ms", "admin_first_page_ms", None),
    ("admin ?state=queued, median ms", "admin_state_queued_ms", None),
    ("admin key-prefix search, median ms", "admin_key_prefix_ms", None),
)


def table(rows: Sequence[dict[str, Any]]) -> str:
    body = []
    for label, first, second in METRICS:
        cells: list[object] = [
            f"{harness.cell(row[first])} / {harness.cell(row[second])}" if second else row[first] for row in rows
        ]
        growth = harness.ratio(rows[-1][first], rows[0][first])
        if second:
            growth += f" / {harness.ratio(rows[-1][second], rows[0][second])}"
        body.append([label, *cells, growth])
    body.append(["server used_memory, MiB", *(row["used_memory"] / 2**20 for row in rows), ""])
    return harness.table(["", *(f"{row['size']:,} keys" for row in rows), "largest / smallest"], body)


def parse_args(argv: Sequence[str] | None) -> tuple[harness.Script, argparse.Namespace]:
    script = harness.Script("scale", __doc__, packages=("django",))
    script.parser.add_argument(
        "--sizes", default="10000,100000,1000000", help="keys in flight, increasing (default 10k,100k,1M)"
    )
    script.flag("--quick", "--sizes 10000,100000")
    script.option("--calls", 1000, "timed gate calls and guard pairs per round")
    script.option("--rounds", 3, "measurement rounds per size, medians kept")
    script.option("--passes", 5, "reaper passes per round")
    script.option("--renders", 10, "renders per admin page per round")
    args = script.parse(argv)
    args.sizes = [10_000, 100_000] if args.quick else [int(s) for s in args.sizes.split(",") if s.strip()]
    smallest_step = min(b - a for a, b in zip([0, *args.sizes], args.sizes, strict=False))
    if args.sizes != sorted(args.sizes) or smallest_step <= (args.rounds + 1) * (2 * args.calls + 200):
        script.parser.error("--sizes must be increasing, each step above (--rounds + 1) x (2 x --calls + 200) keys")
    return script, args


def main(argv: Sequence[str] | None = None) -> int:
    script, args = parse_args(argv)
    script.header(f"sizes: {', '.join(f'{size:,}' for size in args.sizes)} keys in flight")
    result = measure(args)
    print()
    print(
        f"Cost at each number of keys in flight (per size, the median of {args.rounds} rounds of {args.calls} gate "
        f"calls and guard pairs, {args.passes} reaper passes and {args.renders} renders per page)"
    )
    print()
    print(table(result["rows"]))
    script.save(args, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
