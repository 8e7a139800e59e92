"""Worker-side cost of a DedupTask against a plain Celery task, on a real Redis-compatible server.

What it measures, on real workers consuming a real queue (``benchmarks/worker_app.py``):

- **Round trips per execution**: every command the *worker* sends to Redis
  while it drains ``--rt-tasks`` pre-queued tasks, read with ``MONITOR``, split
  by what sent it: the broker (kombu: BRPOP, the unacked bookkeeping, the ack,
  and its periodic housekeeping), the result backend (Celery's Redis backend)
  and celery-dedup (the ``start``/``finish`` scripts and lock renewals). Cases:
  a plain and a keyed no-op task, and a plain and a keyed task whose body
  sleeps ``--sleep-ms`` (long enough for the renewer thread to act).
- **Throughput**: ``--tasks`` no-op tasks pre-queued, then drained; tasks/s
  for a plain task and a DedupTask, ``--repeats`` times each, alternating which
  goes first, and the ratio DedupTask/plain.
- **Throughput against body time**: the same drains for tasks whose body
  sleeps each of ``--body-ms`` (0, 1, 5 and 20 ms), for plain Celery,
  celery-dedup, celery-once and celery-singleton; fewer tasks per drain the
  longer the body. Shows where celery-dedup's fixed cost per task stops
  mattering (``benchmarks/chart.py`` draws it).

Both run on two workers: ``solo`` (in this process, with
``celery.contrib.testing.worker.start_worker``) and ``prefork`` (a
``celery -A benchmarks.worker_app worker`` subprocess, ``--concurrency``
children). Tasks are published untimed to a staging list no worker consumes;
one ``RENAME`` of that list onto the worker's queue hands the whole batch over
at once (it wakes the worker's blocked BRPOP). The batch is done when, in one
``MULTI``, the queue is empty, kombu's unacked hash is empty (``task_acks_late``:
the ack comes after the body and the result) and the worker is blocked in
BRPOP again.

Run it from the repository root::

    .venv/bin/python -m benchmarks.worker [--tasks 2000] [--repeats 7] [--body-ms 0,1,5,20] [--output FILE]

It starts its own server (``celery_dedup.testing.RedisServer``), prints
Markdown tables and writes ``benchmarks/results/worker.json``. Nothing here
asserts on time; the numbers are for reading.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from benchmarks import budget, harness
from benchmarks.harness import CommandLog, WorkerProcess, commandstats
from benchmarks.worker_app import PREFIX, QUEUE, build_app, peer_bases
from celery_dedup import runtime
from celery_dedup.keys import member_for, new_nonce, new_task_id
from celery_dedup.store.scripts import load_script
from celery_dedup.testing import RedisServer
from celery_dedup.worker.lock import new_token

STAGING = "bench-worker-staging"
UNACKED = "unacked"  # kombu's Redis transport default
CATEGORIES = ("broker", "result backend", "celery-dedup")
#: sha1 of each celery-dedup script as sent to Redis, to name EVALSHA calls.
DEDUP_SCRIPTS = {
    hashlib.sha1(load_script(name).encode()).hexdigest(): name for name in ("gate", "start", "finish", "renew", "reap")
}
POLL_S = 0.002


@dataclass(frozen=True)
class Case:
    """One kind of task run through a worker."""

    name: str
    task: str
    keyed: bool
    sleep_s: float = 0.0


@dataclass
class Bench:
    """The server, an admin client and the app that publishes (never the worker's)."""

    url: str
    admin: redis.Redis
    publisher: Celery
    next_order: int = 1
    #: Commands the admin client sent inside the current count window (for the INFO commandstats cross-check).
    admin_sent: Counter[str] = field(default_factory=Counter)

    def stage(self, case: Case, count: int, *, store_results: bool) -> None:
        """Publish ``count`` tasks of ``case`` to the staging list (untimed; gated as usual for keyed ones)."""
        task = self.publisher.tasks[case.task]
        options: dict[str, Any] = {"queue": STAGING, "ignore_result": not store_results}
        with self.publisher.producer_or_acquire() as producer:
            for _ in range(count):
                args: tuple[Any, ...] = (self.next_order, case.sleep_s) if case.sleep_s else (self.next_order,)
                self.next_order += 1
                result = task.apply_async(args, producer=producer, **options)
                if case.keyed and getattr(result, "deduplicated", True):
                    raise RuntimeError(f"{case.name}: a fresh key was treated as a duplicate")
        staged = int(self.admin.llen(STAGING))
        if staged != count:
            raise RuntimeError(f"{case.name}: staging holds {staged} messages, expected {count}")

    def release(self) -> None:
        """Hand the staged batch to the worker in one command."""
        self.admin.rename(STAGING, QUEUE)
        self.admin_sent["rename"] += 1

    def snapshot(self) -> tuple[int, int, int]:
        """``(queued, unacked, blocked clients)`` read atomically."""
        with self.admin.pipeline(transaction=True) as pipe:
            pipe.llen(QUEUE)
            pipe.hlen(UNACKED)
            pipe.info("clients")
            queued, unacked, clients = pipe.execute()
        self.admin_sent.update(("multi", "llen", "hlen", "info", "exec"))
        return int(queued), int(unacked), int(clients["blocked_clients"])

    def wait_idle(self, timeout: float) -> float:
        """Wait until every task handed over finished and the worker waits for more; returns when (perf_counter)."""
        deadline = time.perf_counter() + timeout
        while True:
            queued, unacked, blocked = self.snapshot()
            now = time.perf_counter()
            # The worker pops, then records the message as unacked, then BRPOPs again: blocked with both
            # empty means nothing is between those steps.
            if queued == 0 and unacked == 0 and blocked >= 1:
                return now
            if now > deadline:
                raise TimeoutError(f"worker still busy after {timeout}s: queued={queued} unacked={unacked}")
            time.sleep(POLL_S)

    def check_keyed(self, case: Case, count: int) -> None:
        """Every keyed task of the batch ran once and released its key."""
        succeeded = int(self.admin.zcard(f"{PREFIX}:idx:state:succeeded"))
        held = int(self.admin.scard(f"{PREFIX}:held"))
        if succeeded != count or held != 0:
            raise RuntimeError(f"{case.name}: {succeeded} records succeeded (expected {count}), {held} keys held")

    def check_results(self, case: Case, count: int) -> None:
        stored = sum(1 for _ in self.admin.scan_iter(match="celery-task-meta-*", count=1000))
        if stored != count:
            raise RuntimeError(f"{case.name}: {stored} results stored, expected {count}")

    def clear(self) -> None:
        """Delete every dedup key and result of earlier batches (the worker is idle)."""
        for pattern in (f"{PREFIX}:*", "celery-task-meta-*"):
            batch: list[bytes] = []
            for key in self.admin.scan_iter(match=pattern, count=1000):
                batch.append(key)
                if len(batch) >= 1000:
                    self.admin.delete(*batch)
                    batch.clear()
            if batch:
                self.admin.delete(*batch)


# --- workers -------------------------------------------------------------------------------------


@contextlib.contextmanager
def solo_worker(url: str) -> Iterator[None]:
    """A solo-pool worker in this process, on its own app (its connections are not the publisher's)."""
    app = build_app(url, "bench_solo")
    try:
        with start_worker(
            app, pool="solo", concurrency=1, perform_ping_check=False, shutdown_timeout=10.0, loglevel="WARNING"
        ):
            yield
    finally:
        app.close()


@contextlib.contextmanager
def prefork_worker(url: str, concurrency: int) -> Iterator[None]:
    """``celery -A benchmarks.worker_app worker --pool prefork`` in a subprocess."""
    with WorkerProcess(
        "benchmarks.worker_app", env={"CELERY_DEDUP_BENCH_BROKER": url}, concurrency=concurrency, name="bench-prefork"
    ):
        yield


# --- round trips ---------------------------------------------------------------------------------


def words(entry: dict[str, Any]) -> list[str]:
    return str(entry["command"]).split(" ")


def content_category(parts: Sequence[str]) -> str | None:
    """Who sent a command, judged by the keys it names; None when it names none (MULTI, PING, ...)."""
    name = parts[0].upper()
    if name in ("EVALSHA", "EVAL"):
        if len(parts) > 1 and parts[1] in DEDUP_SCRIPTS:
            return "celery-dedup"
        return "broker"  # kombu's binding scripts; celery-dedup always runs its scripts by sha
    if len(parts) < 2 or name in ("MULTI", "EXEC", "PING", "HELLO", "CLIENT", "SCRIPT", "ECHO", "INFO"):
        return None
    key = parts[1]
    if key.startswith(f"{PREFIX}:"):
        return "celery-dedup"
    if key.startswith("celery-task-meta-"):
        return "result backend"
    return "broker"


def label(parts: Sequence[str]) -> str:
    name = parts[0].upper()
    if name in ("EVALSHA", "EVAL"):
        script = DEDUP_SCRIPTS.get(parts[1], "kombu script") if len(parts) > 1 else "?"
        return f"EVALSHA {script}"
    if name in ("SCRIPT", "CLIENT", "CONFIG") and len(parts) > 1:
        return f"{name} {parts[1].upper()}"
    return name


@dataclass
class Tally:
    """What the worker sent in one count window, per category."""

    round_trips: Counter[str] = field(default_factory=Counter)
    commands: Counter[str] = field(default_factory=Counter)
    lua: Counter[str] = field(default_factory=Counter)
    detail: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    seen: Counter[str] = field(default_factory=Counter)  # every command MONITOR showed, for the cross-check


def tally(entries: Sequence[dict[str, Any]], admin_port: str) -> Tally:
    """Group the worker's commands into round trips and attribute each to broker, backend or celery-dedup.

    A command naming no key takes the category of its connection (each of the
    worker's connections belongs to one component: kombu, the result backend
    or celery-dedup's store). A MULTI...EXEC block is one round trip; so is an
    EVALSHA, whose Lua commands (MONITOR shows them right after it) are listed apart.
    """
    out = Tally()
    worker = [e for e in entries if e["client_type"] == "lua" or e["client_port"] != admin_port]
    port_votes: dict[str, Counter[str]] = defaultdict(Counter)
    for entry in worker:
        if entry["client_type"] != "lua":
            category = content_category(words(entry))
            if category is not None:
                port_votes[entry["client_port"]][category] += 1
    port_role = {port: votes.most_common(1)[0][0] for port, votes in port_votes.items()}
    open_blocks: dict[str, list[list[str]]] = {}
    script_category = "broker"
    for entry in worker:
        parts = words(entry)
        out.seen[parts[0].lower()] += 1
        if entry["client_type"] == "lua":
            out.lua[script_category] += 1
            continue
        port = entry["client_port"]
        category = content_category(parts) or port_role.get(port, "broker")
        name = parts[0].upper()
        out.commands[category] += 1
        if name in ("EVALSHA", "EVAL"):
            script_category = category
        if name == "MULTI":
            open_blocks[port] = [parts]
            continue
        if port in open_blocks:
            open_blocks[port].append(parts)
            if name == "EXEC":
                block = open_blocks.pop(port)
                inner = [p for p in block if p[0].upper() not in ("MULTI", "EXEC")]
                block_category = next(
                    (c for c in (content_category(p) for p in inner) if c), port_role.get(port, "broker")
                )
                out.round_trips[block_category] += 1
                out.detail[block_category]["MULTI " + " ".join(label(p) for p in inner) + " EXEC"] += 1
            continue
        out.round_trips[category] += 1
        out.detail[category][label(parts)] += 1
    return out


def count_round_trips(bench: Bench, case: Case, pool: str, count: int) -> dict[str, Any]:
    """Commands and round trips per execution of ``case`` on the running worker."""
    bench.clear()
    bench.stage(case, count, store_results=True)
    bench.wait_idle(30)
    admin_port = str(bench.admin.client_info()["addr"]).rsplit(":", 1)[1]
    # MONITOR first: its own connection set-up is then outside the INFO commandstats delta.
    log = CommandLog(bench.url)
    usec_before = server_usec(bench.admin)
    before = commandstats(bench.admin)
    bench.admin_sent = Counter({"info": 1})  # the first commandstats snapshot's own INFO lands in the delta
    started = time.perf_counter()
    bench.release()
    finished = bench.wait_idle(120 + count * case.sleep_s)
    entries = log.close(bench.admin)
    bench.admin_sent["echo"] += 1  # CommandLog's end marker
    after = commandstats(bench.admin)
    usec = server_usec(bench.admin) - usec_before
    if case.keyed:
        bench.check_keyed(case, count)
    bench.check_results(case, count)
    found = tally(entries, admin_port)
    delta = after - before
    delta.subtract(bench.admin_sent)
    delta = +delta
    # INFO commandstats names subcommands "client|setinfo"; MONITOR shows "CLIENT SETINFO".
    worker_stats: Counter[str] = Counter()
    for name, calls in delta.items():
        worker_stats[name.split("|", 1)[0]] += calls
    admin_seen = Counter(
        words(e)[0].lower() for e in entries if e["client_type"] != "lua" and e["client_port"] == admin_port
    )
    return {
        "pool": pool,
        "case": case.name,
        "task": case.task,
        "sleep_s": case.sleep_s,
        "executions": count,
        "window_s": finished - started,
        "round_trips_per_execution": {c: found.round_trips[c] / count for c in CATEGORIES},
        "round_trips_total_per_execution": sum(found.round_trips.values()) / count,
        "round_trip_detail_per_execution": {
            c: {k: v / count for k, v in sorted(found.detail[c].items())} for c in CATEGORIES
        },
        # Only the worker sends EVALSHA here: celery-dedup's scripts (and kombu's rare binding refresh).
        # Inflated by MONITOR, which slows every command; the throughput drains measure it without.
        "server_us_in_evalsha_per_execution_under_monitor": usec["evalsha"] / count,
        "commands_sent_per_execution": {c: found.commands[c] / count for c in CATEGORIES},
        "lua_commands_per_execution": {c: found.lua[c] / count for c in CATEGORIES},
        "commandstats_worker_per_execution": {k: v / count for k, v in sorted(worker_stats.items())},
        "commandstats_agrees": dict(worker_stats) == dict(found.seen),
        "admin_commands_seen": dict(admin_seen),
    }


def warm(bench: Bench, case: Case, count: int) -> None:
    bench.clear()
    bench.stage(case, count, store_results=True)
    bench.wait_idle(30)
    bench.release()
    bench.wait_idle(120 + count * case.sleep_s)


def server_usec(client: redis.Redis) -> Counter[str]:
    """Server time (µs) spent in each command so far, from INFO commandstats."""
    stats = client.info("commandstats")
    return Counter({name.removeprefix("cmdstat_"): int(value["usec"]) for name, value in stats.items()})


def time_guard_calls(bench: Bench, pairs: int) -> dict[str, float]:
    """Client-side µs of the guard's two calls (``start`` then ``finish``) on gated keys, from this process."""
    store = runtime.store_for(bench.publisher)
    task = bench.publisher.tasks[DEDUP.task]
    record_ms = 86_400_000
    start_us: list[float] = []
    finish_us: list[float] = []
    for i in range(pairs + 100):
        key = f"order:direct-{i}"
        member, task_id = member_for(task.name, key), new_task_id(key)
        store.gate(member, task_id, new_nonce(), hold_ms=3_600_000, grace_ms=record_ms)
        token = new_token()
        t0 = time.perf_counter_ns()
        harness.start_run(store, member, task_id, token, record_ms=record_ms)
        t1 = time.perf_counter_ns()
        store.finish(member, task_id, "succeeded", drop=True, record_ms=record_ms, token=token, role="run")
        t2 = time.perf_counter_ns()
        if i >= 100:  # the first calls warm the connection
            start_us.append((t1 - t0) / 1000)
            finish_us.append((t2 - t1) / 1000)
    bench.clear()
    return {
        "pairs": pairs,
        "start_median_us": statistics.median(start_us),
        "finish_median_us": statistics.median(finish_us),
        "pair_median_us": statistics.median(a + b for a, b in zip(start_us, finish_us, strict=True)),
    }


# --- throughput ----------------------------------------------------------------------------------


def drain(bench: Bench, case: Case, count: int, *, store_results: bool = False) -> tuple[float, float]:
    """Tasks/s for ``count`` pre-queued no-op tasks of ``case``, and server µs per task spent in EVALSHA."""
    bench.clear()
    bench.stage(case, count, store_results=store_results)
    bench.wait_idle(30)
    usec_before = server_usec(bench.admin)
    started = time.perf_counter()
    bench.release()
    finished = bench.wait_idle(300)
    lua_us = (server_usec(bench.admin) - usec_before)["evalsha"] / count
    if case.keyed:
        bench.check_keyed(case, count)
    return count / (finished - started), lua_us


# --- measuring -----------------------------------------------------------------------------------


PLAIN = Case("plain no-op", "bench.plain", keyed=False)
DEDUP = Case("dedup no-op", "bench.keyed", keyed=True)
#: The same no-op task keyed by each peer library installed (throughput only).
PEERS = [Case(f"{name.removeprefix('bench.')} no-op", name, keyed=False) for name, _, _ in peer_bases()]
PEER_LABELS = {"bench.once": "celery-once", "bench.singleton": "celery-singleton"}
#: The body-time sweep's libraries and their sleeping tasks (same signature): plain Celery, celery-dedup, the peers.
SWEEP_TASKS = {
    "plain": "bench.plain_sleep",
    "celery-dedup": "bench.keyed_sleep",
    **{PEER_LABELS.get(name, name): f"{name}_sleep" for name, _, _ in peer_bases()},
}
#: What a task costs the worker beside its body, for sizing a sweep drain (a no-op task takes about a millisecond).
SWEEP_OVERHEAD_S = 0.001
MIN_SWEEP_TASKS = 20


def rt_cases(sleep_ms: float) -> list[Case]:
    body = f"{sleep_ms:g} ms body"
    return [
        PLAIN,
        DEDUP,
        Case(f"plain, {body}", "bench.plain_sleep", keyed=False, sleep_s=sleep_ms / 1000),
        Case(f"dedup, {body}", "bench.keyed_sleep", keyed=True, sleep_s=sleep_ms / 1000),
    ]


def measure_pool(bench: Bench, pool: str, args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Warm up, count round trips, then time the drains, on one worker."""
    worker = solo_worker(bench.url) if pool == "solo" else prefork_worker(bench.url, args.concurrency)
    with worker:
        bench.wait_idle(30)
        # Warm-up: every worker process opens its connections (broker, backend, dedup store), loads the
        # scripts and starts its renewer thread outside the counts.
        for case in rt_cases(args.sleep_ms):
            warm(bench, case, args.warmup if not case.sleep_s else min(args.warmup, 20))
        trips = (
            [count_round_trips(bench, case, pool, args.rt_tasks) for case in rt_cases(args.sleep_ms)]
            if args.round_trips
            else []
        )
        print(f"{pool}: round trips counted", file=sys.stderr)
        cases = [PLAIN, DEDUP, *(PEERS if args.peers else [])]
        for case in cases[2:]:
            warm(bench, case, args.warmup)
        # rates[results][case name]: one tasks/s figure per repeat.
        rates: dict[str, dict[str, list[float]]] = {mode: {case.name: [] for case in cases} for mode in args.results}
        lua_us: list[float] = []
        for repeat in range(args.repeats):
            for mode in args.results:
                # Rotate which case goes first, so drift in machine load hits all alike.
                shift = repeat % len(cases)
                for case in cases[shift:] + cases[:shift]:
                    rate, lua = drain(bench, case, args.tasks, store_results=mode == "on")
                    rates[mode][case.name].append(rate)
                    if case.keyed and mode == "off":
                        lua_us.append(lua)
            print(f"{pool}: throughput repeat {repeat + 1}/{args.repeats} done", file=sys.stderr)
        bench.clear()
        sweep = body_sweep(bench, pool, args)
    first = rates[args.results[0]]
    plain, dedup = first[PLAIN.name], first[DEDUP.name]
    throughput = {
        "pool": pool,
        "concurrency": 1 if pool == "solo" else args.concurrency,
        "tasks": args.tasks,
        "repeats": args.repeats,
        "results": args.results[0],
        "plain_tasks_per_s": plain,
        "dedup_tasks_per_s": dedup,
        "plain_median": statistics.median(plain),
        "dedup_median": statistics.median(dedup),
        "ratio_of_medians": statistics.median(dedup) / statistics.median(plain),
        "pair_ratios": [d / p for d, p in zip(dedup, plain, strict=True)],
        # No MONITOR here (it slows every command, Lua's most): the scripts' own server time.
        "dedup_server_lua_us_per_task": lua_us,
        # Every case with and without a result backend: {results: {case: tasks/s per repeat}}.
        "by_results": rates,
        # Sleeping tasks at each --body-ms, every library in the same drains (None: no sweep asked for).
        "body_sweep": sweep,
    }
    return trips, throughput


def sweep_tasks(body_ms: float, drain_s: float, concurrency: int) -> int:
    """Tasks per sweep drain: about ``drain_s`` of wall time on ``concurrency`` processes, fewer for longer bodies."""
    return max(MIN_SWEEP_TASKS, round(drain_s * concurrency / (body_ms / 1000 + SWEEP_OVERHEAD_S)))


def sweep_case(library: str, body_ms: float) -> Case:
    return Case(
        f"{library}, {body_ms:g} ms body", SWEEP_TASKS[library], keyed=library == "celery-dedup", sleep_s=body_ms / 1000
    )


def body_sweep(bench: Bench, pool: str, args: argparse.Namespace) -> dict[str, Any] | None:
    """Throughput of every library's sleeping task at each ``--body-ms``, without a result backend.

    Per repeat and body time, each library drains its tasks once, the first
    rotating every repeat (as in the no-op drains); tasks per drain from
    :func:`sweep_tasks`.
    """
    if not args.body_ms:
        return None
    started = time.monotonic()
    concurrency = 1 if pool == "solo" else args.concurrency
    libraries = [name for name in SWEEP_TASKS if args.peers or name in ("plain", "celery-dedup")]
    for library in libraries:  # the peers' sleeping tasks have not run yet in this worker
        warm(bench, sweep_case(library, 0.0), args.warmup)
    rows: list[dict[str, Any]] = [
        {
            "body_ms": body_ms,
            "tasks": sweep_tasks(body_ms, args.body_drain_s, concurrency),
            "tasks_per_s": {library: [] for library in libraries},
        }
        for body_ms in args.body_ms
    ]
    for repeat in range(args.body_repeats):
        shift = repeat % len(libraries)
        for row in rows:
            for library in libraries[shift:] + libraries[:shift]:
                rate, _ = drain(bench, sweep_case(library, row["body_ms"]), row["tasks"])
                row["tasks_per_s"][library].append(rate)
        print(
            f"{pool}: body-time sweep repeat {repeat + 1}/{args.body_repeats} done "
            f"({time.monotonic() - started:.0f} s in)",
            file=sys.stderr,
        )
    bench.clear()
    return {
        "results": "off",
        "repeats": args.body_repeats,
        "drain_s": args.body_drain_s,
        "elapsed_s": round(time.monotonic() - started, 1),
        "rows": rows,
    }


# --- output --------------------------------------------------------------------------------------


def fmt_counts(counts: dict[str, float]) -> str:
    shown = [f"{name} {value:.2f}" for name, value in counts.items() if value >= 0.005]
    return ", ".join(shown) or "none"


def rt_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| pool | case | executions | broker | result backend | celery-dedup | total | celery-dedup round trips "
        "| commands inside celery-dedup Lua |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for row in rows:
        rt = row["round_trips_per_execution"]
        lines.append(
            f"| {row['pool']} | {row['case']} | {row['executions']} | {rt['broker']:.2f} | "
            f"{rt['result backend']:.2f} | {rt['celery-dedup']:.2f} | {row['round_trips_total_per_execution']:.2f} | "
            f"{fmt_counts(row['round_trip_detail_per_execution']['celery-dedup'])} | "
            f"{row['lua_commands_per_execution']['celery-dedup']:.1f} |"
        )
    return "\n".join(lines)


def added_table(rows: Sequence[dict[str, Any]]) -> str:
    """DedupTask minus plain, per pool and body: what celery-dedup adds per execution."""
    lines = [
        "| pool | body | added round trips | of which start + finish | of which renewals | broker change "
        "| result backend change |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    by_key = {(row["pool"], row["task"]): row for row in rows}
    for pool in dict.fromkeys(row["pool"] for row in rows):
        for plain_task, dedup_task, body in (
            ("bench.plain", "bench.keyed", "no-op"),
            ("bench.plain_sleep", "bench.keyed_sleep", f"{by_key[(pool, 'bench.keyed_sleep')]['sleep_s'] * 1000:g} ms"),
        ):
            plain, dedup = by_key[(pool, plain_task)], by_key[(pool, dedup_task)]
            detail = dedup["round_trip_detail_per_execution"]["celery-dedup"]
            start_finish = detail.get("EVALSHA start", 0.0) + detail.get("EVALSHA finish", 0.0)
            renewals = detail.get("EVALSHA renew", 0.0)
            p, d = plain["round_trips_per_execution"], dedup["round_trips_per_execution"]
            added = dedup["round_trips_total_per_execution"] - plain["round_trips_total_per_execution"]
            lines.append(
                f"| {pool} | {body} | {added:+.2f} | {start_finish:.2f} | {renewals:.2f} | "
                f"{d['broker'] - p['broker']:+.2f} | {d['result backend'] - p['result backend']:+.2f} |"
            )
    return "\n".join(lines)


def detail_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| pool | case | broker round trips | result backend round trips |", "|---|---|---|---|"]
    for row in rows:
        detail = row["round_trip_detail_per_execution"]
        lines.append(
            f"| {row['pool']} | {row['case']} | {fmt_counts(detail['broker'])} | "
            f"{fmt_counts(detail['result backend'])} |"
        )
    return "\n".join(lines)


def library_table(rows: Sequence[dict[str, Any]]) -> str:
    """Every case's tasks/s, with and without a result backend, against plain Celery in the same drains."""
    lines = [
        "| pool | result backend | task | tasks/s median | min\N{EN DASH}max | vs plain (medians) "
        "| per-repeat ratios median (min\N{EN DASH}max) |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    labels = {PLAIN.name: "plain Celery", DEDUP.name: "celery-dedup"}
    labels.update({case.name: PEER_LABELS.get(case.task, case.task) for case in PEERS})
    for row in rows:
        pool = row["pool"] if row["pool"] == "solo" else f"prefork ({row['concurrency']})"
        for mode, by_case in row["by_results"].items():
            plain = by_case[PLAIN.name]
            for name, rates in by_case.items():
                ratios = [r / p for r, p in zip(rates, plain, strict=True)]
                vs = "" if name == PLAIN.name else f"{statistics.median(rates) / statistics.median(plain):.2f}"
                spread = (
                    ""
                    if name == PLAIN.name
                    else f"{statistics.median(ratios):.2f} ({min(ratios):.2f}\N{EN DASH}{max(ratios):.2f})"
                )
                lines.append(
                    f"| {pool} | {'Redis' if mode == 'on' else 'none (ignore_result)'} | {labels.get(name, name)} | "
                    f"{statistics.median(rates):.0f} | {min(rates):.0f}\N{EN DASH}{max(rates):.0f} | {vs} | {spread} |"
                )
    return "\n".join(lines)


def sweep_table(rows: Sequence[dict[str, Any]]) -> str:
    """Per pool and body time: each library's tasks/s, its ratio to plain Celery's, and celery-dedup's added µs."""
    sweeps = [(row, row["body_sweep"]) for row in rows if row.get("body_sweep")]
    if not sweeps:
        return ""
    libraries = list(sweeps[0][1]["rows"][0]["tasks_per_s"])
    others = [name for name in libraries if name != "plain"]
    lines = [
        "| pool | body | tasks per drain | plain tasks/s | "
        + " | ".join(f"{name} tasks/s, vs plain (per-repeat min\N{EN DASH}max)" for name in others)
        + " | celery-dedup added µs/task |",
        "|---|---:|---:|---:|" + "---:|" * len(others) + "---:|",
    ]
    for row, sweep in sweeps:
        pool = row["pool"] if row["pool"] == "solo" else f"prefork ({row['concurrency']})"
        for body in sweep["rows"]:
            rates = body["tasks_per_s"]
            plain = statistics.median(rates["plain"])
            cells = []
            for name in others:
                ratios = [r / p for r, p in zip(rates[name], rates["plain"], strict=True)]
                median = statistics.median(rates[name])
                cells.append(f"{median:.0f}, {median / plain:.2f}x ({min(ratios):.2f}\N{EN DASH}{max(ratios):.2f})")
            added = 1e6 / statistics.median(rates["celery-dedup"]) - 1e6 / plain
            lines.append(
                f"| {pool} | {body['body_ms']:g} ms | {body['tasks']} | {plain:.0f} | {' | '.join(cells)} | "
                f"{added:.0f} |"
            )
    return "\n".join(lines)


def throughput_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| pool | case | tasks/s median | min\N{EN DASH}max | ratio dedup/plain (medians) "
        "| per-repeat pair ratios median (min\N{EN DASH}max) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        pool = row["pool"] if row["pool"] == "solo" else f"prefork ({row['concurrency']})"
        plain, dedup, pairs = row["plain_tasks_per_s"], row["dedup_tasks_per_s"], row["pair_ratios"]
        lines.append(
            f"| {pool} | plain | {row['plain_median']:.0f} | {min(plain):.0f}\N{EN DASH}{max(plain):.0f} | | |"
        )
        lines.append(
            f"| {pool} | DedupTask | {row['dedup_median']:.0f} | {min(dedup):.0f}\N{EN DASH}{max(dedup):.0f} | "
            f"{row['ratio_of_medians']:.2f} | {statistics.median(pairs):.2f} "
            f"({min(pairs):.2f}\N{EN DASH}{max(pairs):.2f}) |"
        )
    return "\n".join(lines)


def time_budget(run: Run) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    if not run.guard_calls:  # --budget-only
        return rows
    pair_us = run.guard_calls["pair_median_us"]
    # Solo only: one process runs everything serially there, so its added time per task can be set against
    # the guard's calls timed alone; prefork's time is spread over the consumer process and the children.
    for row in (r for r in run.throughput if r["pool"] == "solo"):
        lua = statistics.median(row["dedup_server_lua_us_per_task"])
        added = 1e6 / row["dedup_median"] - 1e6 / row["plain_median"]
        rows.append(
            {
                "pool": row["pool"],
                "concurrency": row["concurrency"],
                "added_us_per_task": added,
                "start_finish_alone_us": pair_us,
                "server_lua_us_per_execution": lua,
                "rest_us": added - pair_us,
            }
        )
    return rows


def budget_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| pool | added µs per task | start + finish timed alone µs | of which server Lua µs | rest µs |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['pool']} | {row['added_us_per_task']:.0f} | {row['start_finish_alone_us']:.0f} | "
            f"{row['server_lua_us_per_execution']:.0f} | {row['rest_us']:.0f} |"
        )
    return "\n".join(lines)


# --- main ----------------------------------------------------------------------------------------


def parse_args(script: harness.Script, argv: Sequence[str] | None) -> argparse.Namespace:
    script.option("--tasks", 2000, "tasks per throughput drain")
    script.option("--repeats", 7, "throughput drains per case and pool")
    script.option("--rt-tasks", 200, "executions per round-trip count")
    script.option("--sleep-ms", 20.0, "body of the sleeping cases, ms", minimum=0.001)
    script.option("--warmup", 200, "untimed tasks per case first")
    script.option("--guard-pairs", 1000, "start+finish pairs timed directly")
    script.option("--concurrency", 2, "prefork children")
    script.option("--pools", "solo,prefork", "comma-separated: solo, prefork", minimum=None)
    script.option("--results", "off,on", "throughput without (off) and/or with (on) a result backend", minimum=None)
    script.option(
        "--body-ms", "0,1,5,20", "body times of the throughput sweep, ms, comma-separated (empty: none)", minimum=None
    )
    script.option("--body-drain-s", 0.5, "wall time each sweep drain is sized for, s", minimum=0.01)
    script.option("--body-repeats", 3, "sweep drains per library, body time and pool")
    script.flag("--no-peers", "leave celery-once and celery-singleton out", dest="peers", action="store_false")
    script.flag("--no-round-trips", "skip the MONITOR round-trip counts", dest="round_trips", action="store_false")
    script.option("--budget", 1000, "plain and keyed deliveries each for the per-delivery budget (0: none)", minimum=0)
    script.flag("--budget-only", "only the per-delivery budget: no worker, no round trips, no throughput")
    args = script.parse(argv)
    args.results = [m.strip() for m in args.results.split(",") if m.strip()]
    if not args.results or any(m not in ("off", "on") for m in args.results):
        script.parser.error("--results takes off and/or on")
    try:
        args.body_ms = [float(ms) for ms in args.body_ms.split(",") if ms.strip()]
    except ValueError:
        script.parser.error("--body-ms takes comma-separated numbers of milliseconds")
    if any(ms < 0 for ms in args.body_ms):
        script.parser.error("--body-ms takes no negative body time")
    args.pools = [p.strip() for p in args.pools.split(",") if p.strip()]
    if not args.pools or any(p not in ("solo", "prefork") for p in args.pools):
        script.parser.error("--pools takes solo and/or prefork")
    return args


@dataclass
class Run:
    """Everything one run measured, for the tables and the JSON file."""

    server_binary: str
    server_version: str
    elapsed_s: float
    trips: list[dict[str, Any]]
    throughput: list[dict[str, Any]]
    guard_calls: dict[str, float]
    #: The per-delivery budget (``benchmarks/budget.py``), by result backend ("off", "on").
    delivery_budget: dict[str, budget.DeliveryRun] = field(default_factory=dict)


def measure(script: harness.Script, args: argparse.Namespace) -> Run:
    with RedisServer() as server:
        server_version = server.version()
        script.header(f"server: {server.binary} ({server_version})", peers=args.peers)
        publisher = build_app(server.url, "bench_publisher")
        args.lock_ttl_s = runtime.config_for(publisher).lock_ttl
        admin: redis.Redis = redis.Redis.from_url(server.url)
        bench = Bench(server.url, admin, publisher)
        trips: list[dict[str, Any]] = []
        throughput: list[dict[str, Any]] = []
        started = time.monotonic()
        delivery_budget: dict[str, budget.DeliveryRun] = {}
        try:
            for mode in args.results if args.budget else ():
                delivery_budget[mode] = budget.delivery_budget(server.url, args.budget, results_on=mode == "on")
                print(f"per-delivery budget, results {mode}: done", file=sys.stderr)
            if args.budget_only:
                return Run(server.binary, server_version, time.monotonic() - started, [], [], {}, delivery_budget)
            guard_calls = time_guard_calls(bench, args.guard_pairs)
            for pool in args.pools:
                pool_trips, pool_throughput = measure_pool(bench, pool, args)
                trips += pool_trips
                throughput.append(pool_throughput)
        finally:
            admin.close()
            publisher.close()
        elapsed = time.monotonic() - started
        return Run(server.binary, server_version, elapsed, trips, throughput, guard_calls, delivery_budget)


def print_report(args: argparse.Namespace, run: Run) -> None:
    if not args.budget_only:
        print_workers(args, run)
    for mode, measured in run.delivery_budget.items():
        print()
        print(
            f"Per-delivery budget, {'with the Redis result backend' if mode == 'on' else 'no result backend'}: "
            f"{args.budget} plain and {args.budget} keyed no-op messages run in this process as a solo worker "
            "runs them (Celery's request and tracer, the body, the ack; no consumer loop), interleaved in blocks"
        )
        print()
        print(budget.delivery_table(measured))
        print()
        print(
            "Wholes: median per message, nothing wrapped. Parts: a second pass with each part's function "
            "wrapped (time.perf_counter_ns, and the thread's CPU time: without the waits for the server or a "
            "core); a part is the median over deliveries of its calls' sum in one delivery, and includes the "
            "parts indented under it. With the result backend the ending is recorded by the result write, "
            "after the body: Delivery.end's second call."
        )


def print_workers(args: argparse.Namespace, run: Run) -> None:
    print()
    print(
        f"Redis round trips per task execution, sent by the worker (MONITOR over {args.rt_tasks} executions "
        "per case; results stored in the Redis result backend; task_acks_late)"
    )
    print()
    print(rt_table(run.trips))
    print()
    print("Added by DedupTask per execution (DedupTask row minus plain row, same pool and body)")
    print()
    print(added_table(run.trips))
    print()
    print("Broker and result backend round trips, per execution")
    print()
    print(detail_table(run.trips))
    print()
    print(
        "Method: each case's tasks are published first (untimed) to a list no worker reads, then one RENAME "
        "hands them to the idle worker; MONITOR records every command until the worker is idle again. The "
        "benchmark's own connection is left out. A round trip is one command, one MULTI...EXEC block or one "
        "EVALSHA (commands run inside Lua are counted apart). Broker rows include kombu's periodic "
        "housekeeping (binding refresh, restore of unacked messages, BRPOP timeouts), spread over the window."
    )
    disagree = [row for row in run.trips if not row["commandstats_agrees"]]
    for row in disagree:
        print(
            f"note: INFO commandstats disagrees with MONITOR for {row['pool']} / {row['case']}: "
            f"{row['commandstats_worker_per_execution']}"
        )
    if not disagree:
        print("INFO commandstats deltas over the same windows (minus the benchmark's own commands) agree with MONITOR.")
    print()
    print(
        f"No-op throughput: {args.tasks} tasks pre-queued then drained, {args.repeats} repeats per case, "
        f"plain and DedupTask alternating (ignore_result, task_acks_late); {run.elapsed_s:.0f} s in all"
    )
    print()
    print(throughput_table(run.throughput))
    print()
    print(
        "Every task, without a result backend (ignore_result) and with the Redis one; cases rotate which goes "
        "first each repeat"
    )
    print()
    print(library_table(run.throughput))
    sweep = sweep_table(run.throughput)
    if sweep:
        print()
        print(
            f"Throughput against body time: each library's task sleeping for its body, {args.body_repeats} drains "
            "per library, body time and pool, the first rotating each repeat (ignore_result, task_acks_late; "
            f"each drain sized for about {args.body_drain_s:g} s). Medians; the ratio is of the medians, the range "
            "that of the per-repeat ratios. Added µs: 1/median(celery-dedup tasks/s) - 1/median(plain tasks/s)."
        )
        print()
        print(sweep)
    print()
    print(
        "The worker, the server and this benchmark share the machine's cores (the solo worker shares this "
        "process); compare the two cases within one pool and run, not absolute numbers across machines."
    )
    added = time_budget(run)
    if added:
        print()
        print("Where DedupTask's added time per task goes (no-op task, solo worker)")
        print()
        print(budget_table(added))
        print()
        print(
            "added: 1/median(DedupTask tasks/s) - 1/median(plain tasks/s). start + finish: the guard's two calls "
            f"timed alone from this process (median of {args.guard_pairs} pairs, client side). Server Lua: INFO "
            "commandstats usec of EVALSHA per task over the DedupTask drains (median). The rest is worker time outside "
            "those two calls (the guard's Python, the lock and renewer bookkeeping)."
        )
    for note in renewal_notes(run.trips, args.lock_ttl_s):
        print()
        print(note)


def renewal_notes(trips: Sequence[dict[str, Any]], lock_ttl_s: float) -> list[str]:
    """Flag renewals a body that short should not need (one is due every third of the lock TTL)."""
    notes = []
    for row in trips:
        renewals = row["round_trip_detail_per_execution"]["celery-dedup"].get("EVALSHA renew", 0.0)
        due = int(row["sleep_s"] // (lock_ttl_s / 3))
        if renewals > due + 0.05:
            notes.append(
                f"note: {row['pool']} / {row['case']}: {renewals:.2f} lock renewals per execution, but with "
                f"dedup_lock_ttl {lock_ttl_s:g} s a renewal is due every {lock_ttl_s / 3:g} s, so a "
                f"{row['sleep_s'] * 1000:g} ms body should need {due}."
            )
    return notes


def main(argv: Sequence[str] | None = None) -> int:
    script = harness.Script("worker", __doc__)
    args = parse_args(script, argv)
    run = measure(script, args)
    print_report(args, run)
    script.save(
        args,
        {
            "server": {"binary": run.server_binary, "version": run.server_version},
            "worker": "task_acks_late=True, dedup_reap_interval=0",
            "dedup_lock_ttl_s": args.lock_ttl_s,
            "round_trips": run.trips,
            "throughput": run.throughput,
            "guard_calls": run.guard_calls,
            "time_budget": time_budget(run),
            "delivery_budget": {mode: budget.delivery_rows(measured) for mode, measured in run.delivery_budget.items()},
            "notes": renewal_notes(run.trips, args.lock_ttl_s),
        },
        peers=args.peers,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
