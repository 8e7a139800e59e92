"""Enqueue cost of a DedupTask against a plain Celery task, on a real Redis-compatible server.

What it measures: the client-side wall time of one ``apply_async`` call, for

- ``plain``: an ordinary task (kombu's LPUSH);
- ``dedup new key``: a DedupTask keyed ``"order:{order_id}"`` with a key no call
  has used before (the gate holds the key and LPUSHes the message in one Lua script);
- ``dedup duplicate``: the same DedupTask with a key that is already held
  (the gate publishes nothing and returns the accepted task's id);

and the same pair for two peers, configured the way their READMEs say, on the
same server (``--no-peers`` leaves them out):

- ``celery-once new key`` / ``celery-once duplicate``: a ``QueueOnce`` task
  keyed on ``order_id`` (a redis-py ``Lock``: SET NX PX, then the LPUSH; a
  duplicate reads the lock's PTTL and raises ``AlreadyQueued``, its default
  answer, which the call catches);
- ``celery-singleton new key`` / ``celery-singleton duplicate``: a ``Singleton``
  task unique on ``order_id`` (SET NX EX holding the task id, then the LPUSH; a
  duplicate GETs the holder's id and returns its ``AsyncResult``).

All cases run on one app, over one producer connection (so
connection set-up is not measured), after a warm-up, interleaved round-robin in
small blocks (the starting case rotates each round) so machine noise hits every
case alike. Each repeat times ``--calls`` calls per case; the queue and the
keys the repeat made are deleted between repeats.

It also counts Redis round trips per call for each case with ``MONITOR``: every
command a client sends is one round trip (none of these paths pipeline: kombu's
``_put`` sends one LPUSH, redis-py's ``Script`` one EVALSHA), and commands run
inside Lua are listed apart. ``INFO commandstats`` deltas over the same calls
are recorded beside them as a cross-check.

Run it from the repository root::

    .venv/bin/python -m benchmarks.enqueue [--calls 5000] [--repeats 5] [--no-peers] [--output FILE]

It starts its own server (``celery_dedup.testing.RedisServer``), prints two
Markdown tables and writes ``benchmarks/results/enqueue.json``. Nothing here
asserts on time; the numbers are for reading.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
from celery import Celery

import celery_dedup
from benchmarks import budget, harness
from celery_dedup import DedupTask
from celery_dedup.keys import KeySchema
from celery_dedup.testing import RedisServer

QUEUE = "bench-enqueue"
PREFIX = "bench-dedup"
SINGLETON_PREFIX = "bench-singleton:"
ONCE_TASK = "bench.once"
ONCE_TIMEOUT = 3600  # seconds, celery-once's default: longer than any repeat
PEERS = ("celery-once", "celery-singleton")
DUPLICATE_ORDER = 0  # new-key calls count up from 1, so they never meet the held key

Call = Callable[[], None]


@dataclass
class Case:
    """One measured way of calling ``apply_async``; ``times_ns`` holds one list per repeat."""

    name: str
    call: Call
    publishes: bool
    times_ns: list[list[int]] = field(default_factory=list)


@dataclass
class Peers:
    """The peers' tasks (same signature as the others) and celery-once's duplicate answer."""

    once: Any
    singleton: Any
    already_queued: type[Exception]


@dataclass
class Bench:
    """The app, its tasks and the producer every call goes through."""

    app: Celery
    client: redis.Redis
    plain: Any
    keyed: Any
    producer: Any
    peers: Peers | None = None
    next_order: int = 1

    def call_plain(self) -> None:
        self.plain.apply_async((self._order(),), producer=self.producer)

    def call_new_key(self) -> None:
        self.keyed.apply_async((self._order(),), producer=self.producer)

    def call_duplicate(self) -> None:
        self.keyed.apply_async((DUPLICATE_ORDER,), producer=self.producer)

    def call_once_new_key(self) -> None:
        assert self.peers is not None
        self.peers.once.apply_async((self._order(),), producer=self.producer)

    def call_once_duplicate(self) -> None:
        assert self.peers is not None
        try:
            self.peers.once.apply_async((DUPLICATE_ORDER,), producer=self.producer)
        except self.peers.already_queued:
            return
        raise RuntimeError("celery-once accepted a duplicate")

    def call_singleton_new_key(self) -> None:
        assert self.peers is not None
        self.peers.singleton.apply_async((self._order(),), producer=self.producer)

    def call_singleton_duplicate(self) -> None:
        assert self.peers is not None
        self.peers.singleton.apply_async((DUPLICATE_ORDER,), producer=self.producer)

    def _order(self) -> int:
        order = self.next_order
        self.next_order += 1
        return order

    def hold_duplicate_key(self) -> None:
        """Make the duplicate case's key held (untimed); check the gate really treats it so."""
        first = self.keyed.apply_async((DUPLICATE_ORDER,), producer=self.producer)
        again = self.keyed.apply_async((DUPLICATE_ORDER,), producer=self.producer)
        if first.deduplicated or not again.deduplicated or again.id != first.id:
            raise RuntimeError(f"the duplicate key is not held as expected: {first.id!r} vs {again.id!r}")
        if self.peers is None:
            return
        self.peers.once.apply_async((DUPLICATE_ORDER,), producer=self.producer)
        self.call_once_duplicate()
        held = self.peers.singleton.apply_async((DUPLICATE_ORDER,), producer=self.producer)
        again = self.peers.singleton.apply_async((DUPLICATE_ORDER,), producer=self.producer, task_id="not-this-one")
        if again.id != held.id:
            raise RuntimeError(f"celery-singleton's duplicate key is not held: {held.id!r} vs {again.id!r}")

    def clear(self) -> None:
        """Delete the queue and every dedup key or peer lock this benchmark made."""
        schema = KeySchema(PREFIX)
        queues = [QUEUE, *(f"{QUEUE}\x06\x16{p}" for p in (3, 6, 9))]
        self.client.delete(*queues, schema.held)
        for pattern in (f"{PREFIX}:*", f"qo_{ONCE_TASK}_*", f"{SINGLETON_PREFIX}*"):
            batch: list[bytes] = []
            for key in self.client.scan_iter(match=pattern, count=1000):
                batch.append(key)
                if len(batch) >= 1000:
                    self.client.delete(*batch)
                    batch.clear()
            if batch:
                self.client.delete(*batch)

    def queued(self) -> int:
        return int(self.client.llen(QUEUE))


def build_app(url: str, *, result_backend: bool = False) -> Celery:
    app = Celery("bench_enqueue", set_as_current=False)
    app.conf.update(
        broker_url=url,
        # With the Redis result backend on the same server, every task stores its result (Celery's default).
        result_backend=url if result_backend else None,
        task_default_queue=QUEUE,
        task_ignore_result=not result_backend,
        broker_connection_retry_on_startup=False,
        dedup_key_prefix=PREFIX,
        # The peers' documented settings, on the same server (harmless without them).
        ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": url, "default_timeout": ONCE_TIMEOUT}},
        singleton_backend_url=url,
        singleton_key_prefix=SINGLETON_PREFIX,
    )
    celery_dedup.install(app)
    return app


def make_tasks(app: Celery) -> tuple[Any, Any]:
    ignore_result = bool(app.conf.task_ignore_result)

    # Same signature and argument for both, so the messages are the same size.
    @app.task(name="bench.plain", ignore_result=ignore_result, shared=False)
    def plain(order_id: int) -> None:
        return None

    @app.task(
        name="bench.keyed", base=DedupTask, dedup_key="order:{order_id}", ignore_result=ignore_result, shared=False
    )
    def keyed(order_id: int) -> None:
        return None

    return plain, keyed


def make_peer_tasks(app: Celery) -> Peers:
    """The peers' tasks, keyed on ``order_id`` like ``bench.keyed`` (imported here: ``--no-peers`` needs neither)."""
    from celery_once import AlreadyQueued, QueueOnce  # noqa: PLC0415 - optional: the bench extra
    from celery_singleton import Singleton  # noqa: PLC0415 - optional: the bench extra

    ignore_result = bool(app.conf.task_ignore_result)

    @app.task(name=ONCE_TASK, base=QueueOnce, once={"keys": ["order_id"]}, ignore_result=ignore_result, shared=False)
    def once(order_id: int) -> None:
        return None

    @app.task(name="bench.singleton", base=Singleton, unique_on=["order_id"], ignore_result=ignore_result, shared=False)
    def singleton(order_id: int) -> None:
        return None

    return Peers(once, singleton, AlreadyQueued)


def rotated(cases: Sequence[Case], start: int) -> list[Case]:
    start %= len(cases)
    return [*cases[start:], *cases[:start]]


def run_repeat(bench: Bench, cases: Sequence[Case], calls: int, block: int) -> None:
    """Time ``calls`` calls of every case, round-robin in blocks of ``block``."""
    bench.clear()
    bench.hold_duplicate_key()
    baseline = bench.queued()
    per_case: dict[str, list[int]] = {case.name: [] for case in cases}
    clock = time.perf_counter_ns
    gc.collect()
    done, round_no = 0, 0
    while done < calls:
        size = min(block, calls - done)
        for case in rotated(cases, round_no):
            call, sink = case.call, per_case[case.name]
            for _ in range(size):
                start = clock()
                call()
                sink.append(clock() - start)
        done += size
        round_no += 1
    expected = baseline + calls * sum(case.publishes for case in cases)
    if bench.queued() != expected:
        raise RuntimeError(f"queue holds {bench.queued()} messages, expected {expected}: a case misbehaved")
    for case in cases:
        case.times_ns.append(per_case[case.name])


def summarize(cases: Sequence[Case]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for case in cases:
        pooled = [t / 1000 for repeat in case.times_ns for t in repeat]
        repeat_medians = [statistics.median(t / 1000 for t in repeat) for repeat in case.times_ns]
        repeat_p95 = [harness.percentile((t / 1000 for t in repeat), 0.95) for repeat in case.times_ns]
        rows.append(
            {
                "case": case.name,
                "calls_per_repeat": len(case.times_ns[0]),
                "repeats": len(case.times_ns),
                "median_us": statistics.median(pooled),
                "p95_us": harness.percentile(pooled, 0.95),
                "mean_us": statistics.fmean(pooled),
                "repeat_medians_us": repeat_medians,
                "repeat_p95_us": repeat_p95,
            }
        )
    base = next(row["median_us"] for row in rows if row["case"] == "plain")
    for row in rows:
        row["ratio_to_plain"] = row["median_us"] / base
    return rows


def count_round_trips(url: str, case: Case, calls: int) -> dict[str, Any]:
    """Commands per call of ``case``: sent by clients (round trips) and run inside Lua."""
    counted = harness.count_commands(url, case.call, calls)
    del counted["entries"]
    return {"case": case.name, **counted}


# --- output --------------------------------------------------------------------------------------


def timing_table(rows: Sequence[dict[str, Any]]) -> str:
    return harness.table(
        ["case", "median µs/call", "p95 µs/call", "per-repeat medians min µs", "max µs", "ratio to plain (median)"],
        [
            [
                r["case"],
                r["median_us"],
                r["p95_us"],
                min(r["repeat_medians_us"]),
                max(r["repeat_medians_us"]),
                f"{r['ratio_to_plain']:.2f}x",
            ]
            for r in rows
        ],
    )


def round_trip_table(rows: Sequence[dict[str, Any]]) -> str:
    return harness.table(
        ["case", "round trips/call", "commands sent per call", "commands inside Lua per call"],
        [
            [
                r["case"],
                r["round_trips_per_call"],
                harness.per_call(r["client_commands_per_call"]),
                harness.per_call(r["lua_commands_per_call"]),
            ]
            for r in rows
        ],
    )


# --- main ----------------------------------------------------------------------------------------


def parse_args(script: harness.Script, argv: Sequence[str] | None) -> argparse.Namespace:
    script.option("--calls", 5000, "timed calls per case per repeat")
    script.option("--repeats", 5, "repeats")
    script.option("--block", 50, "calls per case before switching case")
    script.option("--warmup", 500, "untimed calls per case first", minimum=0)
    script.option("--rt-calls", 200, "calls per case for round trips")
    script.option("--budget", 2000, "calls per celery-dedup case for the per-call budget (0: none)", minimum=0)
    script.flag(
        "--no-peers", "leave out the celery-once and celery-singleton cases", dest="peers", action="store_false"
    )
    script.option(
        "--result-backend",
        "both",
        "without one (off), with Redis's on the same server (on), or both in turn",
        choices=("off", "on", "both"),
        minimum=None,
    )
    return script.parse(argv)


@dataclass
class Run:
    """Everything one run measured, for the tables and the JSON file."""

    result_backend: bool
    elapsed_s: float
    rows: list[dict[str, Any]]
    trips: list[dict[str, Any]]
    #: Where the time of a plain, a new-key and a duplicate call goes (``benchmarks/budget.py``).
    budget: budget.CallRun | None = None


def measure(args: argparse.Namespace, server: RedisServer, result_backend: bool) -> Run:
    """Time the cases on ``server``, count their commands, and clean up."""
    app = build_app(server.url, result_backend=result_backend)
    plain, keyed = make_tasks(app)
    peers = make_peer_tasks(app) if args.peers else None
    client: redis.Redis = redis.Redis.from_url(server.url)
    try:
        with app.producer_or_acquire() as producer:
            bench = Bench(app, client, plain, keyed, producer, peers)
            cases = [
                Case("plain", bench.call_plain, publishes=True),
                Case("dedup new key", bench.call_new_key, publishes=True),
                Case("dedup duplicate", bench.call_duplicate, publishes=False),
            ]
            if peers is not None:
                cases += [
                    Case("celery-once new key", bench.call_once_new_key, publishes=True),
                    Case("celery-once duplicate", bench.call_once_duplicate, publishes=False),
                    Case("celery-singleton new key", bench.call_singleton_new_key, publishes=True),
                    Case("celery-singleton duplicate", bench.call_singleton_duplicate, publishes=False),
                ]
            if args.warmup:
                run_repeat(bench, cases, args.warmup, args.block)
                for case in cases:
                    case.times_ns.clear()
            started = time.monotonic()
            for repeat in range(args.repeats):
                run_repeat(bench, cases, args.calls, args.block)
                harness.progress(f"repeat {repeat + 1}/{args.repeats} done")
            elapsed = time.monotonic() - started
            bench.clear()
            bench.hold_duplicate_key()
            trips = [count_round_trips(server.url, case, args.rt_calls) for case in cases]
            call_budget = None
            if args.budget:
                bench.clear()
                bench.hold_duplicate_key()
                call_budget = budget.call_budget(args.budget, [(case.name, case.call) for case in cases[:3]])
            bench.clear()
    finally:
        # kombu's queue bindings, made by the producer's declare.
        bindings = list(client.scan_iter(match=f"_kombu.binding.{QUEUE}*"))
        if bindings:
            client.delete(*bindings)
        client.close()
        app.close()
    return Run(result_backend, elapsed, summarize(cases), trips, call_budget)


def print_report(args: argparse.Namespace, run: Run) -> None:
    print()
    print(
        f"apply_async: {args.calls} calls x {args.repeats} repeats per case, blocks of {args.block}, "
        f"{run.elapsed_s:.1f} s; "
        f"{'Redis result backend' if run.result_backend else 'no result backend (ignore_result)'}"
    )
    print()
    print(timing_table(run.rows))
    print()
    print(f"Redis commands per call (MONITOR over {args.rt_calls} calls per case)")
    print()
    print(round_trip_table(run.trips))
    print()
    for row in run.trips:
        if not row["commandstats_agrees"]:
            print(f"note: INFO commandstats disagrees with MONITOR for {row['case']}: {row['commandstats_per_call']}")
    if all(row["commandstats_agrees"] for row in run.trips):
        print("INFO commandstats deltas over the same calls agree with MONITOR.")
    if run.budget is not None:
        print()
        print(f"Where a call's time goes: wall µs (this thread's CPU µs) per call, {args.budget} calls per case")
        print()
        print(budget.call_table(run.budget))
        print()
        print(
            "Each part's function is wrapped (time.perf_counter_ns and time.thread_time_ns); a part is the median "
            "over calls of its time in one call, and includes the parts indented under it. CPU time leaves out "
            "the waits for the server (or for a core)."
        )


def main(argv: Sequence[str] | None = None) -> int:
    script = harness.Script("enqueue", __doc__)
    args = parse_args(script, argv)
    backends = {"off": [False], "on": [True], "both": [False, True]}[args.result_backend]
    with RedisServer() as server:
        script.header(f"server: {server.binary} ({server.version()})", peers=args.peers)
        runs = [measure(args, server, backend) for backend in backends]
        version = server.version()
    for run in runs:
        print_report(args, run)
    script.save(
        args,
        {
            "server": {"binary": server.binary, "version": version},
            "celery_once_duplicate": "raises AlreadyQueued (its default, not graceful), caught by the caller",
            "timing": [{**row, "result_backend": run.result_backend} for run in runs for row in run.rows],
            "round_trips": [{**row, "result_backend": run.result_backend} for run in runs for row in run.trips],
            "call_budget": [
                {"result_backend": run.result_backend, "rows": budget.call_rows(run.budget)}
                for run in runs
                if run.budget is not None
            ],
        },
        peers=args.peers,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
