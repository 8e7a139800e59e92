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
import datetime
import gc
import os
import platform
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from celery import Celery

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as ``python benchmarks/<name>.py``: make ``benchmarks.*`` importable

import celery_dedup  # noqa: E402
from benchmarks.harness import save, versions  # noqa: E402
from celery_dedup import DedupTask  # noqa: E402
from celery_dedup.keys import KeySchema  # noqa: E402
from celery_dedup.testing import RedisServer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = ROOT / "benchmarks" / "results" / "enqueue.json"
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


def build_app(url: str) -> Celery:
    app = Celery("bench_enqueue", set_as_current=False)
    app.conf.update(
        broker_url=url,
        task_default_queue=QUEUE,
        task_ignore_result=True,
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
    # Same signature and argument for both, so the messages are the same size.
    @app.task(name="bench.plain", ignore_result=True, shared=False)
    def plain(order_id: int) -> None:
        return None

    @app.task(name="bench.keyed", base=DedupTask, dedup_key="order:{order_id}", ignore_result=True, shared=False)
    def keyed(order_id: int) -> None:
        return None

    return plain, keyed


def make_peer_tasks(app: Celery) -> Peers:
    """The peers' tasks, keyed on ``order_id`` like ``bench.keyed`` (imported here: ``--no-peers`` needs neither)."""
    from celery_once import AlreadyQueued, QueueOnce  # noqa: PLC0415 - optional: the bench extra
    from celery_singleton import Singleton  # noqa: PLC0415 - optional: the bench extra

    @app.task(name=ONCE_TASK, base=QueueOnce, once={"keys": ["order_id"]}, ignore_result=True, shared=False)
    def once(order_id: int) -> None:
        return None

    @app.task(name="bench.singleton", base=Singleton, unique_on=["order_id"], ignore_result=True, shared=False)
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


def percentile(sorted_values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    index = max(0, min(len(sorted_values) - 1, round(fraction * len(sorted_values) + 0.5) - 1))
    return sorted_values[index]


def summarize(cases: Sequence[Case]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for case in cases:
        pooled = sorted(t / 1000 for repeat in case.times_ns for t in repeat)
        repeat_medians = [statistics.median(t / 1000 for t in repeat) for repeat in case.times_ns]
        repeat_p95 = [percentile(sorted(t / 1000 for t in repeat), 0.95) for repeat in case.times_ns]
        rows.append(
            {
                "case": case.name,
                "calls_per_repeat": len(case.times_ns[0]),
                "repeats": len(case.times_ns),
                "median_us": statistics.median(pooled),
                "p95_us": percentile(pooled, 0.95),
                "mean_us": statistics.fmean(pooled),
                "repeat_medians_us": repeat_medians,
                "repeat_p95_us": repeat_p95,
            }
        )
    base = next(row["median_us"] for row in rows if row["case"] == "plain")
    for row in rows:
        row["ratio_to_plain"] = row["median_us"] / base
    return rows


# --- round trips ---------------------------------------------------------------------------------


class CommandLog:
    """Every command the server runs while open, read with MONITOR on a thread.

    ``close`` sends a marker ECHO and reads up to it, so the log is complete.
    """

    def __init__(self, url: str) -> None:
        self._client: redis.Redis = redis.Redis.from_url(url)
        self._monitor = self._client.monitor()  # type: ignore[no-untyped-call]
        self._monitor.__enter__()
        self.entries: list[dict[str, Any]] = []
        self.complete = False
        self._marker = f"bench-enqueue-marker-{os.getpid()}-{time.monotonic_ns()}"
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while True:
            entry = self._monitor.next_command()
            if entry is None:
                continue
            if entry["command"] == f"ECHO {self._marker}":
                self.complete = True
                return
            self.entries.append(entry)

    def close(self, admin: redis.Redis) -> list[dict[str, Any]]:
        admin.echo(self._marker)
        self._thread.join(30)
        if not self.complete:
            raise RuntimeError("MONITOR did not deliver the end marker: the command counts would be partial")
        self._monitor.__exit__(None, None, None)
        self._client.close()
        return self.entries


def commandstats(client: redis.Redis) -> Counter[str]:
    stats = client.info("commandstats")
    return Counter({name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()})


def count_round_trips(url: str, case: Case, calls: int) -> dict[str, Any]:
    """Commands per call of ``case``: sent by clients (round trips) and run inside Lua."""
    admin: redis.Redis = redis.Redis.from_url(url)
    admin_port = str(admin.client_info()["addr"]).rsplit(":", 1)[1]
    # MONITOR first: its own connection set-up (HELLO, CLIENT SETINFO, MONITOR) is then outside the delta.
    log = CommandLog(url)
    before = commandstats(admin)
    for _ in range(calls):
        case.call()
    entries = log.close(admin)
    after = commandstats(admin)
    # The admin client's own INFO (the first snapshot) and ECHO (the marker) land in the delta.
    delta = after - before
    delta.subtract({"info": 1, "echo": 1})
    delta = +delta
    client_cmds: Counter[str] = Counter()
    lua_cmds: Counter[str] = Counter()
    for entry in entries:
        if entry["client_type"] != "lua" and entry["client_port"] == admin_port:
            continue
        name = entry["command"].split(" ", 1)[0].lower()
        (lua_cmds if entry["client_type"] == "lua" else client_cmds)[name] += 1
    seen = client_cmds + lua_cmds
    admin.close()
    return {
        "case": case.name,
        "calls": calls,
        "round_trips_per_call": sum(client_cmds.values()) / calls,
        "client_commands_per_call": {k: v / calls for k, v in sorted(client_cmds.items())},
        "lua_commands_per_call": {k: v / calls for k, v in sorted(lua_cmds.items())},
        "commandstats_per_call": {k: v / calls for k, v in sorted(delta.items())},
        "commandstats_agrees": dict(delta) == dict(seen),
    }


# --- output --------------------------------------------------------------------------------------


def per_call(counts: dict[str, float]) -> str:
    if not counts:
        return "none"
    return ", ".join(f"{name.upper()} {value:g}" for name, value in counts.items())


def timing_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| case | median µs/call | p95 µs/call | per-repeat medians min\N{EN DASH}max µs | ratio to plain (median) |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        medians = row["repeat_medians_us"]
        lines.append(
            f"| {row['case']} | {row['median_us']:.1f} | {row['p95_us']:.1f} | "
            f"{min(medians):.1f}\N{EN DASH}{max(medians):.1f} | {row['ratio_to_plain']:.2f}x |"
        )
    return "\n".join(lines)


def round_trip_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| case | round trips/call | commands sent per call | commands inside Lua per call |",
        "|---|---:|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['case']} | {row['round_trips_per_call']:g} | {per_call(row['client_commands_per_call'])} | "
            f"{per_call(row['lua_commands_per_call'])} |"
        )
    return "\n".join(lines)


# --- main ----------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0] if __doc__ else None)
    parser.add_argument("--calls", type=int, default=5000, help="timed calls per case per repeat (default 5000)")
    parser.add_argument("--repeats", type=int, default=5, help="repeats (default 5)")
    parser.add_argument("--block", type=int, default=50, help="calls per case before switching case (default 50)")
    parser.add_argument("--warmup", type=int, default=500, help="untimed calls per case first (default 500)")
    parser.add_argument("--rt-calls", type=int, default=200, help="calls per case for round trips (default 200)")
    parser.add_argument(
        "--no-peers", dest="peers", action="store_false", help="leave out the celery-once and celery-singleton cases"
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON result file")
    args = parser.parse_args(argv)
    for name in ("calls", "repeats", "block", "rt_calls"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


@dataclass
class Run:
    """Everything one run measured, for the tables and the JSON file."""

    server_binary: str
    server_version: str
    load_before: float
    load_after: float
    elapsed_s: float
    rows: list[dict[str, Any]]
    trips: list[dict[str, Any]]


def measure(args: argparse.Namespace) -> Run:
    """Start a server, time the cases, count their commands, and clean up."""
    with RedisServer() as server:
        server_version = server.version()
        print(f"server: {server.binary} ({server_version})")
        print(", ".join(f"{k} {v}" for k, v in versions(*peer_dists(args)).items()))
        load_before = os.getloadavg()[0]
        print(f"load average before: {load_before:.2f} (cpus: {os.cpu_count()})", flush=True)
        app = build_app(server.url)
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
                    print(f"repeat {repeat + 1}/{args.repeats} done", file=sys.stderr)
                elapsed = time.monotonic() - started
                load_after = os.getloadavg()[0]
                bench.clear()
                bench.hold_duplicate_key()
                trips = [count_round_trips(server.url, case, args.rt_calls) for case in cases]
                bench.clear()
        finally:
            # kombu's queue bindings, made by the producer's declare.
            bindings = list(client.scan_iter(match=f"_kombu.binding.{QUEUE}*"))
            if bindings:
                client.delete(*bindings)
            client.close()
            app.close()
        return Run(server.binary, server_version, load_before, load_after, elapsed, summarize(cases), trips)


def peer_dists(args: argparse.Namespace) -> tuple[str, ...]:
    return PEERS if args.peers else ()


def print_report(args: argparse.Namespace, run: Run) -> None:
    print()
    print(
        f"apply_async: {args.calls} calls x {args.repeats} repeats per case, blocks of {args.block}, "
        f"{run.elapsed_s:.1f} s, load average after {run.load_after:.2f}"
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


def write_result(args: argparse.Namespace, run: Run) -> None:
    result = {
        "benchmark": "enqueue",
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "server": {"binary": run.server_binary, "version": run.server_version},
        "versions": versions(*peer_dists(args)),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "loadavg_1m_before": run.load_before,
            "loadavg_1m_after": run.load_after,
        },
        "settings": {
            "calls": args.calls,
            "repeats": args.repeats,
            "block": args.block,
            "warmup": args.warmup,
            "rt_calls": args.rt_calls,
            "peers": args.peers,
            "celery_once_duplicate": "raises AlreadyQueued (its default, not graceful), caught by the caller",
        },
        "elapsed_s": run.elapsed_s,
        "timing": run.rows,
        "round_trips": run.trips,
    }
    save(args.output, result)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    run = measure(args)
    print_report(args, run)
    write_result(args, run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
