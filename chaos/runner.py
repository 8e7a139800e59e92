"""One chaos run from start to verdict: ``python3 run-chaos [--minutes M] [--seed S] [--faults LIST]``.

1. Start the server, a fault proxy per client, the workers and the producers.
2. Let the nemesis inject faults for ``--minutes`` while the producers call.
3. Stop the producers, undo every lasting fault, and wait for a quiet period:
   nothing queued, unacknowledged, parked, locked or unended (at most
   ``--quiet`` seconds).
4. Snapshot what the server holds (``final.json``), stop the workers, and
   check the merged history (:mod:`chaos.checker`).

The last line is ``chaos: <ops> operations, <faults> faults, <violations>
violations, seed <S>``; the exit status is 0 only without violations.
``--check DIR`` checks a kept run again without running anything.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import redis

from celery_dedup.keys import KeySchema
from celery_dedup.store import schema
from celery_dedup.store.status import history_of, is_history_field

from . import app as chaos_app
from .checker import Report, check
from .cluster import POOLS, Cluster, DeathWatch
from .history import History, Tail
from .nemesis import FAULTS, MAX_SKEW, Nemesis
from .workload import KEYS_PER_MODE, MODE_WEIGHTS

ROOT = Path(__file__).resolve().parent.parent
#: Seconds between progress lines.
PROGRESS_EVERY = 5.0
#: The quiet period ends once the broker and the records stayed settled this long.
SETTLED_FOR = 3.0
QUEUES = ("celery", "celery\x06\x163", "celery\x06\x166", "celery\x06\x169")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="run-chaos", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=1.0, help="how long the nemesis runs (default 1)")
    parser.add_argument("--seed", type=int, default=None, help="seed of every schedule (default: drawn, and printed)")
    parser.add_argument(
        "--faults",
        default=",".join(FAULTS),
        help=f"comma-separated faults, or 'none' (default: all): {', '.join(FAULTS)}",
    )
    parser.add_argument("--workers", type=int, default=len(POOLS), help=f"worker processes (default {len(POOLS)})")
    parser.add_argument(
        "--pools",
        default=",".join(POOLS),
        help=f"comma-separated pools the workers run, in turn by slot (default: {','.join(POOLS)})",
    )
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--producers", type=int, default=3)
    parser.add_argument(
        "--keys",
        type=int,
        default=KEYS_PER_MODE,
        help=f"keys per mode (default {KEYS_PER_MODE}; fewer: more collisions)",
    )
    parser.add_argument(
        "--modes", default=",".join(MODE_WEIGHTS), help="comma-separated modes the producers call (default: all)"
    )
    parser.add_argument(
        "--store",
        choices=("broker", "apart"),
        default="broker",
        help="the dedup store: the broker itself (atomic gate, default) or another database behind a link of "
        "its own (two-phase gate; no debounce)",
    )
    parser.add_argument("--quiet", type=float, default=None, help="longest quiet period, seconds (default 45, +skew)")
    parser.add_argument("--keep", type=Path, default=None, help="write the run's history to DIR and keep it")
    parser.add_argument("--check", type=Path, default=None, metavar="DIR", help="only check the run kept in DIR")
    parser.add_argument(
        "--library",
        type=Path,
        default=None,
        metavar="DIR",
        help="run workers and producers on the celery_dedup package found in DIR (a patched copy)",
    )
    return parser.parse_args(argv)


def faults_from(text: str) -> tuple[str, ...]:
    chosen = tuple(name.strip() for name in text.split(",") if name.strip() and name.strip() != "none")
    unknown = sorted(set(chosen) - set(FAULTS))
    if unknown:
        raise SystemExit(f"run-chaos: unknown faults {', '.join(unknown)}; choose from {', '.join(FAULTS)}")
    return chosen


def pools_from(text: str) -> tuple[str, ...]:
    chosen = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = sorted(set(chosen) - set(POOLS))
    if unknown or not chosen:
        raise SystemExit(f"run-chaos: unknown pools {', '.join(unknown) or '(none)'}; choose from {', '.join(POOLS)}")
    return chosen


class Run:
    """The processes, the nemesis and the phases of one run (see the module docstring)."""

    def __init__(self, options: argparse.Namespace, run_dir: Path, seed: int) -> None:
        self.options = options
        self.run_dir = run_dir
        self.seed = seed
        self.faults = faults_from(options.faults)
        self.history = History(run_dir, "runner")
        path = [str(options.library.resolve())] if options.library else []
        self.cluster = Cluster(
            run_dir,
            os.pathsep.join([*path, str(ROOT)]),
            self.history,
            workers=options.workers,
            concurrency=options.concurrency,
            producers=options.producers,
            seed=seed,
            keys=options.keys,
            modes=options.modes,
            persistent="restart" in self.faults,
            pools=pools_from(options.pools),
            store_apart=options.store == "apart",
        )
        self.tail = Tail(run_dir, frozenset({"call", "body_start", "fault"}))

    def execute(self) -> None:
        cluster = self.cluster
        self.history.emit(
            "phase",
            name="started",
            seed=self.seed,
            faults=list(self.faults),
            minutes=self.options.minutes,
            store=self.options.store,
        )
        cluster.start()
        deaths = DeathWatch(self.history, lambda: cluster.worker_slots).start()
        client, store = cluster.server.client(), cluster.store_client()
        conf = {"dedup_redis_url": cluster.store_url} if cluster.store_apart else {}
        app = chaos_app.build(cluster.server.url, history=self.history, conf=conf)
        nemesis = Nemesis(cluster, app, self.history, self.seed, self.faults)
        thread = threading.Thread(target=nemesis.run, name="nemesis", daemon=True)
        self.history.emit("phase", name="nemesis")
        started = time.monotonic()
        thread.start()
        duration = self.options.minutes * 60
        while time.monotonic() - started < duration:
            time.sleep(min(PROGRESS_EVERY, max(duration - (time.monotonic() - started), 0.1)))
            self.progress(f"{time.monotonic() - started:.0f}s/{duration:.0f}s")
        nemesis.stop()
        thread.join()
        for slot in cluster.producer_slots:
            cluster.stop_process(slot, grace=10.0)
        self.history.emit("phase", name="producers_stopped")
        nemesis.heal()
        self.history.emit("phase", name="nemesis_end")
        self.quiet(client, store)
        self.history.emit("phase", name="quiet_end")
        (self.run_dir / "final.json").write_text(json.dumps(snapshot(client, store)))
        for slot in cluster.worker_slots:
            cluster.stop_process(slot, grace=15.0)
        deaths.stop()
        self.history.emit("phase", name="stopped")
        app.close()
        client.close()
        store.close()

    def revive(self) -> None:
        """Start a new worker in place of one that died on its own (a crash is recorded, and checked)."""
        for slot in self.cluster.crashed():
            print(f"chaos: {slot.name} died on its own (a crash, checked at the end); a new worker takes its place")
            self.cluster.start_worker(slot)

    def progress(self, when: str) -> None:
        self.revive()
        counts = self.tail.update()
        alive = sum(slot.alive for slot in self.cluster.worker_slots)
        print(
            f"chaos: {when}, {counts.get('call', 0)} calls, {counts.get('body_start', 0)} bodies, "
            f"{counts.get('fault', 0)} faults, workers {alive}/{len(self.cluster.worker_slots)}",
            flush=True,
        )

    def quiet(self, client: redis.Redis, store: redis.Redis) -> None:
        """Until nothing is queued, unacknowledged, parked, locked or unended for a while (bounded)."""
        longest = self.options.quiet
        if longest is None:
            longest = 45.0 + (MAX_SKEW if "skew" in self.faults else 0.0)
        deadline = time.monotonic() + longest
        settled_since: float | None = None
        last_print = time.monotonic()
        while time.monotonic() < deadline:
            try:
                busy = outstanding(client, store)
            except redis.RedisError:
                busy = {"unreachable": 1}
            if not any(busy.values()):
                settled_since = settled_since or time.monotonic()
                if time.monotonic() - settled_since >= SETTLED_FOR:
                    return
            else:
                settled_since = None
            if time.monotonic() - last_print >= PROGRESS_EVERY:
                last_print = time.monotonic()
                waiting = ", ".join(f"{name} {n}" for name, n in busy.items() if n)
                self.progress(f"quiet period, waiting for {waiting or 'a settled moment'}")
            time.sleep(0.25)
        self.history.emit("quiet_timeout", outstanding=outstanding(client, store))


def outstanding(client: redis.Redis, store: redis.Redis) -> dict[str, int]:
    """What still has to happen: messages (``client``: the broker), parked runs, live locks and unended records
    (``store``: the dedup store, the same database unless it is apart)."""
    counts = {
        "queued": sum(int(client.llen(queue)) for queue in QUEUES),
        "unacked": int(client.hlen("unacked")),
        "parked": int(store.zcard("dedup:due")),
        "locks": sum(1 for _ in store.scan_iter("dedup:lock:*", count=1000)),
    }
    for state in ("pending", "publishing", "queued", "started", "retry"):
        counts[f"records {state}"] = int(store.zcard(f"dedup:idx:state:{state}"))
    return counts


def _text(value: Any) -> str:
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else str(value)


def history_strings(record: dict[str, str], listed: list[str]) -> list[str]:
    """A member's history as the checker reads it, ``"<ms> <state> <task id> [note]"`` newest first, from
    either stored format: the ``hist:`` list as it is, or the record's ``h<n>`` fields merged with it."""
    if not any(is_history_field(name) for name in record):
        return listed
    return [entry.text() for entry in history_of(record, listed)]


#: The store's key names (the chaos apps' prefix, one server).
SCHEMA = KeySchema("dedup")


def steps_of(client: redis.Redis, member: str, run: str | None) -> dict[str, str]:
    """The key's steps (``k:<step>``) and those of the record's run (``s:<step>``), as stored."""
    found = {_text(k): _text(v) for k, v in client.hgetall(SCHEMA.steps(member)).items()}
    if run is not None:
        found.update({_text(k): _text(v) for k, v in client.hgetall(SCHEMA.run_steps(member, run)).items()})
    return found


def snapshot(client: redis.Redis, store: redis.Redis | None = None) -> dict[str, Any]:
    """Everything the checker reads from the server at the end: records, histories, holds, locks (``store``),
    messages (``client``)."""
    broker, client = client, store or client
    seconds, micros = client.time()
    members: set[str] = set()
    for pattern, prefix in (
        ("dedup:rec:*", "dedup:rec:"),
        ("dedup:hist:*", "dedup:hist:"),
        ("dedup:lock:*", "dedup:lock:"),
    ):
        members |= {_text(key)[len(prefix) :] for key in client.scan_iter(pattern, count=1000)}
    held = {_text(member) for member in client.smembers("dedup:held")}
    members |= held
    info: dict[str, Any] = {}
    for member in sorted(members):
        record = {_text(k): _text(v) for k, v in client.hgetall(f"dedup:rec:{member}").items()}
        lock = client.get(f"dedup:lock:{member}")
        info[member] = {
            "record": record,
            "history": history_strings(
                record, [_text(entry) for entry in client.lrange(f"dedup:hist:{member}", 0, -1)]
            ),
            "held": member in held,
            "lock": None if lock is None else _text(lock),
            "lock_pttl": int(client.pttl(f"dedup:lock:{member}")),
            "steps": steps_of(client, member, record.get("task_id")),
        }
    queued_ids = []
    raw_messages = [raw for queue in QUEUES for raw in broker.lrange(queue, 0, -1)]
    raw_messages += [json.loads(raw)[0] for raw in broker.hvals("unacked")]
    for raw in raw_messages:
        message = json.loads(raw) if isinstance(raw, (bytes, str)) else raw
        queued_ids.append((message.get("headers") or {}).get("id"))
    return {
        "server_ms": int(seconds) * 1000 + int(micros) // 1000,
        "t": time.time(),
        "members": info,
        "queued_ids": queued_ids,
        "due_members": [_text(member) for member in client.zrange("dedup:due", 0, -1)],
    }


def report(result: Report, run_dir: Path, kept: bool) -> int:
    print(result.render())
    if result.violations and not kept:
        print(f"history kept in {run_dir} (check it again with: run-chaos --check {run_dir})")
    print(result.summary(), flush=True)
    return 0 if not result.violations else 1


def main(argv: list[str] | None = None) -> int:
    options = parse(argv)
    if options.check is not None:
        return report(check(options.check), options.check, kept=True)
    seed = options.seed if options.seed is not None else random.SystemRandom().randrange(1_000_000)
    # Before any script loads, here and in every worker and producer: the scripts report each transition to
    # the server's log, and the checker holds them against the schema's table.
    os.environ[schema.CHECK_VARIABLE] = "1"
    kept = options.keep is not None
    if kept:
        run_dir = options.keep.resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        if any(run_dir.glob("*.jsonl")):
            raise SystemExit(f"run-chaos: {run_dir} already holds a run's history")
    else:
        run_dir = Path(tempfile.mkdtemp(prefix="celery-dedup-chaos-"))
    print(f"chaos: seed {seed}, faults {options.faults}, {options.minutes:g} min, history in {run_dir}", flush=True)
    if options.store == "apart" and "debounce" in options.modes.split(","):
        options.modes = ",".join(mode for mode in options.modes.split(",") if mode != "debounce")
        print("chaos: no debounce with the store apart (it needs the atomic gate)", flush=True)
    run = Run(options, run_dir, seed)
    try:
        run.execute()
    finally:
        run.cluster.stop()
    result = check(run_dir, seed)
    status = report(result, run_dir, kept)
    if not kept and status == 0:
        shutil.rmtree(run_dir, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
