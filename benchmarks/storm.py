"""A storm of duplicate calls while workers are SIGKILLed: celery-dedup against celery-once and celery-singleton.

For each library in turn, on a flushed server and with the same Celery settings
(``benchmarks/storm_app.py``: Redis broker, ``task_acks_late``,
``task_reject_on_worker_lost``, a short visibility timeout, kombu's restore
sweep every second, prefork workers as ``celery worker`` subprocesses):

1. ``--producers`` processes call the library's task for every one of
   ``--keys`` keys, ``--sends`` times each, in their own shuffled order, all
   at once. Each call's answer is kept: accepted (published) or a duplicate.
2. ``--workers`` workers drain the queue (with ``--overlap`` they start
   before the producers and drain while they publish). The body logs its
   start and its end in Redis, with its task id and pid, and sleeps
   ``--body-ms``; every ``--slow-every``-th key sleeps past the visibility
   timeout instead, so kombu's restore sweep redelivers its message while it runs.
3. While they drain, ``--kills`` SIGKILLs: the first a prefork child running a
   body (its worker forks a new one), the second a whole worker (process
   group; a new worker is started in its place), alternating after that.
4. Once the queue and kombu's unacked hash stay empty (nothing left to
   redeliver), it waits celery-dedup's lock TTL and a reaper pass more, then
   counts the locks still held: ``stuck``.

Per accepted call (task id): run 0 times is ``lost``; each further run is a
``re-run after a kill`` if the run before it was the last one a killed process
started (its body was cut short, or it ended but was never acknowledged), else
a ``duplicate``. Runs of ids no producer was told were accepted are duplicates
too. ``stuck``: keys the library still holds when nothing is left to run.

Run it from the repository root::

    .venv/bin/python -m benchmarks.storm [--producers 4] [--keys 500] [--sends 4] [--kills 2]

It starts its own server, prints Markdown tables and writes
``benchmarks/results/storm.json``. About a minute and a half with the defaults.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import multiprocessing
import os
import random
import signal
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
from kombu.utils.uuid import uuid

from benchmarks import harness
from benchmarks.harness import WorkerProcess, children_of
from benchmarks.storm_app import (
    DEDUP_PREFIX,
    LIBRARIES,
    LOG,
    ONCE_PREFIX,
    QUEUE,
    SINGLETON_PREFIX,
    STARTED,
    TASK,
    StormSettings,
    build_app,
)
from celery_dedup.keys import KeySchema, member_for
from celery_dedup.store.status import history_of
from celery_dedup.testing import RedisServer

GO = "bench-storm:go"
READY = "bench-storm:ready"
#: Beyond the lock TTL, what a dead run's key may take to be freed: a reaper pass and a late restore sweep.
SLACK_S = 4.0
#: The broker must stay idle this long before the drain counts as over (the restore sweep runs every second).
QUIET_S = 2.0


# --- producers -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sent:
    """One call's answer: ``task_id`` is the id the caller was given (None: celery-once's AlreadyQueued)."""

    n: int
    accepted: bool
    task_id: str | None


def produce(url: str, library: str, settings_json: str, index: int, keys: int, sends: int, seed: int) -> list[Sent]:
    """One producer process: call the task ``sends`` times for every key, in a shuffled order, after the go."""
    app, task = build_app(url, library, StormSettings.from_json(settings_json), name=f"bench_storm_producer{index}")
    order = list(range(keys)) * sends
    random.Random(seed * 1000 + index).shuffle(order)
    client: redis.Redis = redis.Redis.from_url(url)
    already_queued: type[Exception] = LookupError  # never raised by the others
    if library == "celery-once":
        from celery_once import AlreadyQueued  # noqa: PLC0415 - optional: the bench extra

        already_queued = AlreadyQueued
    sent: list[Sent] = []
    with app.producer_or_acquire() as producer:
        producer.connection.ensure_connection()
        client.rpush(READY, index)
        if client.blpop([GO], timeout=120) is None:
            raise RuntimeError("no go signal")
        for n in order:
            if library == "celery-dedup":
                result = task.apply_async((n,), producer=producer)
                sent.append(Sent(n, not result.deduplicated, result.id))
            elif library == "celery-once":
                try:
                    result = task.apply_async((n,), producer=producer)
                except already_queued:
                    sent.append(Sent(n, False, None))
                else:
                    sent.append(Sent(n, True, result.id))
            else:
                # Singleton answers a duplicate with the holder's AsyncResult: accepted iff it kept our id.
                task_id = uuid()
                result = task.apply_async((n,), producer=producer, task_id=task_id)
                sent.append(Sent(n, result.id == task_id, result.id))
    client.close()
    app.close()
    return sent


def publish(url: str, library: str, settings: StormSettings, args: argparse.Namespace) -> tuple[list[Sent], float]:
    """Run the producer processes, started together; every call's answer and the wall time of the calls."""
    context = multiprocessing.get_context("spawn")
    client: redis.Redis = redis.Redis.from_url(url)
    with ProcessPoolExecutor(args.producers, mp_context=context) as pool:
        futures = [
            pool.submit(produce, url, library, settings.to_json(), i, args.keys, args.sends, args.seed)
            for i in range(args.producers)
        ]
        for _ in range(args.producers):
            if client.blpop([READY], timeout=120) is None:
                raise RuntimeError("a producer did not get ready")
        began = time.monotonic()
        client.rpush(GO, *range(args.producers))
        sent = [call for future in futures for call in future.result()]
        elapsed = time.monotonic() - began
    client.close()
    return sent, elapsed


# --- workers -------------------------------------------------------------------------------------


def start_worker(url: str, library: str, settings: StormSettings, name: str, concurrency: int) -> WorkerProcess:
    """``celery -A benchmarks.storm_app worker --pool prefork`` for one library."""
    env = {
        "CELERY_DEDUP_BENCH_BROKER": url,
        "CELERY_DEDUP_STORM_LIBRARY": library,
        "CELERY_DEDUP_STORM_SETTINGS": settings.to_json(),
    }
    return WorkerProcess("benchmarks.storm_app", env=env, concurrency=concurrency, name=name)


@dataclass
class Fleet:
    """The workers of one library's storm; every one started is stopped at the end."""

    url: str
    library: str
    settings: StormSettings
    concurrency: int
    workers: list[WorkerProcess] = field(default_factory=list)

    def start(self, count: int) -> list[WorkerProcess]:
        started = [
            start_worker(self.url, self.library, self.settings, f"storm{len(self.workers) + i}", self.concurrency)
            for i in range(count)
        ]
        self.workers += started
        for worker in started:
            worker.wait_ready()
        return started

    def live(self) -> list[WorkerProcess]:
        return [worker for worker in self.workers if worker.alive()]

    def stop_all(self) -> None:
        for worker in self.workers:
            worker.stop()

    def errors(self) -> list[str]:
        """Error lines the workers logged, but the kills' own reports (a lost child, WorkerLostError)."""
        expected = ("signal 9 (SIGKILL)", "WorkerLostError")
        return [f"{worker.name}: {line}" for worker in self.workers for line in worker.errors(*expected)]


@contextlib.contextmanager
def fleet_of(url: str, library: str, settings: StormSettings, concurrency: int) -> Iterator[Fleet]:
    fleet = Fleet(url, library, settings, concurrency)
    try:
        yield fleet
    finally:
        fleet.stop_all()


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def log_entries(client: redis.Redis, start: int) -> list[list[str]]:
    """The storm log from index ``start`` on, each entry split into its words."""
    return [text(entry).split() for entry in client.lrange(LOG, start, -1)]


def running_child(client: redis.Redis, fleet: Fleet) -> int | None:
    """A prefork child of a live worker that is inside a body right now (the newest such start)."""
    entries = log_entries(client, -200)
    finished = {(e[1], e[3]) for e in entries if e[0] == "F"}
    parents = {worker.pid for worker in fleet.live()}
    for kind, task_id, _, pid, ppid in reversed(entries):
        running = kind == "S" and (task_id, pid) not in finished and int(ppid) in parents
        if running and int(pid) in children_of(int(ppid)):
            return int(pid)
    return None


# --- one library's storm ---------------------------------------------------------------------------


@dataclass
class Kill:
    target: str  # "child" or "worker"
    at_started: int
    pids: list[int]


def broker_idle(client: redis.Redis) -> bool:
    with client.pipeline(transaction=True) as pipe:
        for key in (QUEUE, *(f"{QUEUE}\x06\x16{p}" for p in (3, 6, 9))):
            pipe.llen(key)
        pipe.hlen("unacked")
        return not any(pipe.execute())


def drain_with_kills(client: redis.Redis, fleet: Fleet, args: argparse.Namespace, kill_at: list[int]) -> list[Kill]:
    """Wait for the drain, killing as due; returns when nothing is queued or unacked for QUIET_S (or on timeout)."""
    kills: list[Kill] = []
    deadline = time.monotonic() + args.timeout
    idle_since: float | None = None
    while time.monotonic() < deadline:
        started = int(client.get(STARTED) or 0)
        if len(kills) < len(kill_at) and started >= kill_at[len(kills)]:
            target = "child" if len(kills) % 2 == 0 else "worker"
            if target == "child":
                pid = running_child(client, fleet)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    kills.append(Kill("child", started, [pid]))
            else:
                victim = fleet.live()[0]
                kills.append(Kill("worker", started, victim.kill()))
                fleet.start(1)
            time.sleep(0.01)
            continue
        if len(kills) == len(kill_at) and broker_idle(client):
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since >= QUIET_S:
                return kills
        else:
            idle_since = None
        time.sleep(0.01)
    print(f"warning: not drained within {args.timeout:.0f} s", file=sys.stderr)
    return kills


def held_locks(client: redis.Redis, library: str) -> dict[str, Any]:
    """The library's keys still held, and the longest time they stay held (seconds; -1: no expiry)."""
    if library == "celery-dedup":
        held = sorted(text(m) for m in client.smembers(KeySchema(DEDUP_PREFIX).held))
        ttls = [client.pttl(KeySchema(DEDUP_PREFIX).lock(m)) for m in held]
        deadlines = [client.hget(KeySchema(DEDUP_PREFIX).record(m), "held_until") for m in held]
        now_ms = int(client.time()[0]) * 1000
        remaining = [int(d or 0) - now_ms for d in deadlines]
        return {
            "held": len(held),
            "examples": held[:5],
            "lock_pttl_ms": ttls[:5],
            "max_held_s": max(remaining, default=0) / 1000,
        }
    pattern = f"{ONCE_PREFIX}*" if library == "celery-once" else f"{SINGLETON_PREFIX}*"
    keys = sorted(text(k) for k in client.scan_iter(match=pattern, count=1000))
    ttls = [int(client.pttl(k)) for k in keys]
    longest = -1.0 if any(t < 0 for t in ttls) else max(ttls, default=0) / 1000
    return {"held": len(keys), "examples": keys[:5], "max_held_s": longest}


def classify(log: list[list[str]], sent: list[Sent], kills: list[Kill]) -> dict[str, Any]:
    """Executions per accepted call: lost, re-runs after a kill, duplicates (see the module docstring)."""
    accepted = {call.task_id for call in sent if call.accepted}
    killed_parents = {kill.pids[0] for kill in kills if kill.target == "worker"}
    # A worker's children as the log saw them, too: one forked just before the kill may have escaped /proc.
    killed_pids = {pid for kill in kills for pid in kill.pids} | {
        int(e[3]) for e in log if e[0] == "S" and int(e[4]) in killed_parents
    }
    starts = [(i, e[1], int(e[2]), int(e[3])) for i, e in enumerate(log) if e[0] == "S"]
    finished = {(e[1], int(e[3])): i for i, e in enumerate(log) if e[0] == "F"}
    last_start_of: dict[int, int] = {}
    for i, _, _, pid in starts:
        last_start_of[pid] = i
    killed_runs = {last_start_of[pid] for pid in killed_pids if pid in last_start_of}
    runs: dict[str, list[int]] = defaultdict(list)
    keys_of: dict[str, int] = {}
    for i, task_id, n, _ in starts:
        runs[task_id].append(i)
        keys_of[task_id] = n
    reruns = duplicates = 0
    duplicate_keys: set[int] = set()
    for task_id, indexes in runs.items():
        if task_id not in accepted:
            duplicates += len(indexes)
            duplicate_keys.add(keys_of[task_id])
            continue
        for before, _ in itertools.pairwise(indexes):
            if before in killed_runs:
                reruns += 1
            else:
                duplicates += 1
                duplicate_keys.add(keys_of[task_id])
    per_key = Counter(n for _, _, n, _ in starts)
    # An execution that started while another of its key was still in its body (and went on to finish it).
    ends_of_key: dict[int, list[int]] = defaultdict(list)
    overlapping = 0
    for i, task_id, n, pid in starts:
        overlapping += any(end > i for end in ends_of_key[n])
        ends_of_key[n].append(finished.get((task_id, pid), -1))
    lost_ids = {task_id for task_id in accepted if task_id not in runs}
    unfinished = sum(1 for _, task_id, _, pid in starts if (task_id, pid) not in finished)
    return {
        "calls": len(sent),
        "accepted": len(accepted),
        "executions": len(starts),
        "duplicates": duplicates,
        "duplicate_keys": len(duplicate_keys),
        "reruns_after_kill": reruns,
        "lost": len(lost_ids),
        "lost_keys": sorted({call.n for call in sent if call.task_id in lost_ids})[:20],
        "keys_run_more_than_once": sum(1 for count in per_key.values() if count > 1),
        "keys_never_run": len({call.n for call in sent} - set(per_key)),
        "executions_unfinished": unfinished,
        "executions_overlapping": overlapping,
        "unaccepted_ids_run": len([t for t in runs if t not in accepted]),
    }


def dedup_lost_records(client: redis.Redis, keys: Sequence[int]) -> dict[int, list[str]]:
    """celery-dedup only: the history (oldest first) of every key whose history says a run was lost."""
    schema = KeySchema(DEDUP_PREFIX)
    with client.pipeline(transaction=False) as pipe:
        for n in keys:
            pipe.hgetall(schema.record(member_for(TASK, f"storm:{n}")))
        records = pipe.execute()
    histories = [
        [entry.text() for entry in history_of({text(k): text(v) for k, v in record.items()})] for record in records
    ]
    return {
        n: list(reversed(history))
        for n, history in zip(keys, histories, strict=True)
        if any(entry.split()[1] == "lost" for entry in history)
    }


def storm(url: str, library: str, settings: StormSettings, args: argparse.Namespace) -> dict[str, Any]:
    """One library's storm on a flushed server: publish, drain with kills, count."""
    client: redis.Redis = redis.Redis.from_url(url)
    client.flushall()
    began = time.monotonic()
    rng = random.Random(args.seed)
    kill_at = sorted(int(rng.uniform(0.15, 0.65) * args.keys) for _ in range(args.kills))
    with fleet_of(url, library, settings, args.concurrency) as fleet:
        if args.overlap:
            fleet.start(args.workers)
        sent, publish_s = publish(url, library, settings, args)
        accepted = sum(call.accepted for call in sent)
        print(f"{library}: {len(sent)} calls, {accepted} accepted in {publish_s:.1f} s", file=sys.stderr)
        if not args.overlap:
            fleet.start(args.workers)
        kills = drain_with_kills(client, fleet, args, kill_at)
        drained_s = time.monotonic() - began
        time.sleep(settings.lock_ttl + SLACK_S)
        stuck = held_locks(client, library)
        leftover = {"queued": int(client.llen(QUEUE)), "unacked": int(client.hlen("unacked"))}
        errors = fleet.errors()
    log = log_entries(client, 0)
    result = classify(log, sent, kills)
    result.update(
        library=library,
        stuck=stuck["held"],
        stuck_detail=stuck,
        leftover=leftover,
        kills=[asdict(kill) for kill in kills],
        publish_s=publish_s,
        drained_s=drained_s,
        worker_errors=errors[:20],
    )
    if library == "celery-dedup":
        lost_histories = dedup_lost_records(client, sorted({call.n for call in sent}))
        result["keys_with_lost_in_history"] = len(lost_histories)
        ran = {e[1] for e in log if e[0] == "S"}
        # The reaper judged a queued run's message lost, yet that message ran: it was in flight, not lost.
        result["judged_lost_but_ran"] = sorted(
            n
            for n, history in lost_histories.items()
            if any("message lost by the transport" in entry and entry.split()[2] in ran for entry in history)
        )
        result["lost_histories"] = {
            str(n): {"history": history, "log": [" ".join(e) for e in log if e[2] == str(n)]}
            for n, history in list(lost_histories.items())[:20]
        }
    client.close()
    print(
        f"{library}: {result['executions']} executions, {result['duplicates']} duplicates, "
        f"{result['reruns_after_kill']} re-runs after kills, {result['lost']} lost, {result['stuck']} stuck",
        file=sys.stderr,
    )
    return result


# --- output --------------------------------------------------------------------------------------


def table(rows: Sequence[dict[str, Any]]) -> str:
    return harness.table(
        ["library", "calls", "accepted", "executions", "duplicates executed", "re-runs after kills", "lost", "stuck"],
        [
            [
                r["library"],
                r["calls"],
                r["accepted"],
                r["executions"],
                r["duplicates"],
                r["reruns_after_kill"],
                r["lost"],
                r["stuck"],
            ]
            for r in rows
        ],
    )


def kill_table(rows: Sequence[dict[str, Any]]) -> str:
    def held(row: dict[str, Any]) -> str:
        longest = row["stuck_detail"]["max_held_s"]
        return "-" if not row["stuck"] else ("no expiry" if longest < 0 else f"{longest:.0f} s")

    return harness.table(
        ["library", "kills (target at executions started)", "stuck held for up to", "publish + drain s"],
        [
            [
                r["library"],
                ", ".join(f"{k['target']} at {k['at_started']}" for k in r["kills"]) or "none",
                held(r),
                r["drained_s"],
            ]
            for r in rows
        ],
    )


def notes(rows: Sequence[dict[str, Any]]) -> list[str]:
    found = []
    for row in rows:
        if row["leftover"]["queued"] or row["leftover"]["unacked"]:
            found.append(f"{row['library']}: not drained: {row['leftover']}")
        if row["executions_overlapping"]:
            found.append(
                f"{row['library']}: {row['executions_overlapping']} executions started while another of the same "
                "key was still running"
            )
        if row["lost"]:
            found.append(f"{row['library']}: accepted calls never run, keys {row['lost_keys']}")
        if "keys_with_lost_in_history" in row:
            found.append(
                f"{row['library']}: {row['keys_with_lost_in_history']} keys' status history says a run was lost "
                f"(the reaper's view; re-runs after kills counted here: {row['reruns_after_kill']})"
            )
        if row.get("judged_lost_but_ran"):
            found.append(
                f"{row['library']}: keys {row['judged_lost_but_ran']} were released as 'message lost by the "
                "transport' by the reaper, but their message ran afterwards (it was being fetched or restored)"
            )
        if row["worker_errors"]:
            found.append(f"{row['library']}: workers logged errors beyond the kills': {row['worker_errors'][:3]}")
    return found


# --- main ----------------------------------------------------------------------------------------


def parse_args(script: harness.Script, argv: Sequence[str] | None) -> argparse.Namespace:
    script.option("--producers", 4, "producer processes")
    script.option("--keys", 500, "business keys")
    script.option("--sends", 4, "calls per key per producer")
    script.option("--workers", 2, "worker processes")
    script.option("--concurrency", 2, "prefork children per worker")
    script.option("--kills", 2, "SIGKILLs: child, worker, child, ...", minimum=0)
    script.option("--body-ms", 40.0, "task body sleep, ms", minimum=0.001)
    script.option("--slow-every", 100, "every Nth key runs slow, 0: none", minimum=0)
    script.option("--slow-ms", None, "slow body, ms; none: visibility timeout + 2 s", type=float, minimum=None)
    script.option("--visibility-timeout", 4.0, "seconds", minimum=0.001)
    script.flag("--overlap", "start the workers before the producers")
    script.option("--lock-ttl", 2.0, "celery-dedup's execution lock TTL", minimum=0.001)
    script.option("--hold-ttl", 3600, "queued key hold TTL, all libraries")
    script.option("--libraries", ",".join(LIBRARIES), "comma-separated", minimum=None)
    script.option("--timeout", 90.0, "seconds a drain may take")
    script.option("--seed", 1, "shuffle and kill-point seed", minimum=None)
    args = script.parse(argv)
    if args.slow_ms is None:
        args.slow_ms = (args.visibility_timeout + 2) * 1000
    args.libraries = [name.strip() for name in args.libraries.split(",") if name.strip()]
    if not args.libraries or any(name not in LIBRARIES for name in args.libraries):
        script.parser.error(f"--libraries takes {', '.join(LIBRARIES)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    script = harness.Script("storm", __doc__)
    args = parse_args(script, argv)
    settings = StormSettings(
        body_s=args.body_ms / 1000,
        slow_every=args.slow_every,
        slow_s=args.slow_ms / 1000,
        visibility_timeout=args.visibility_timeout,
        lock_ttl=args.lock_ttl,
        hold_ttl=args.hold_ttl,
    )
    with RedisServer() as server:
        server_version = server.version()
        script.header(f"server: {server.binary} ({server_version})", peers=True)
        started = time.monotonic()
        rows = [storm(server.url, library, settings, args) for library in args.libraries]
        elapsed = time.monotonic() - started
    print()
    print(
        f"storm: {args.producers} producers x {args.keys} keys x {args.sends} sends, {args.workers} workers "
        f"x {args.concurrency} children, {args.kills} kills, body {args.body_ms:g} ms (every "
        f"{args.slow_every}th key {args.slow_ms / 1000:g} s), visibility timeout {args.visibility_timeout:g} s, "
        f"{'workers draining while producers publish' if args.overlap else 'published, then drained'}; "
        f"{elapsed:.0f} s"
    )
    print()
    print(table(rows))
    print()
    print(kill_table(rows))
    for note in notes(rows):
        print(f"note: {note}")
    script.save(
        args,
        {
            "server": {"binary": server.binary, "version": server_version},
            "storm_settings": {
                **asdict(settings),
                "task_acks_late": True,
                "task_reject_on_worker_lost": True,
                "celery_once_duplicate": "raises AlreadyQueued (its default), caught: not accepted",
            },
            "libraries": rows,
        },
        peers=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
