"""Crash recovery: how soon a SIGKILLed keyed task re-runs once its worker is back, per library.

For celery-dedup, celery-once (``QueueOnce``) and celery-singleton
(``Singleton``), on a flushed server and with the same Celery settings
(``task_acks_late``, ``task_reject_on_worker_lost``, a ``visibility_timeout``
of ``--visibility-timeout`` s with kombu's restore sweep every second), two
scenarios, each ``--repeats`` times:

- ``child``: SIGKILL the prefork child running the task; 2 s later
  (``--restart-after``) stop the worker (warm shutdown) and start a new one;
- ``worker``: SIGKILL the whole worker (its process group); 2 s later start
  a new one on the same host, under the same node name.

It prints, per library and scenario, the seconds from the new worker being
ready to the re-run's start (negative: the old worker re-ran it before the
restart), the seconds from the kill, and whether a new call of the same key
made during the outage was answered as a duplicate. Each library keeps its own
lock settings (celery-dedup's lock TTL is its default 60 s, so a re-run that
comes sooner was not an expiry). The task body logs its start time to Redis;
the benchmark reads that, so no worker log is parsed.

Run it from the repository root (it starts its own server)::

    .venv/bin/python benchmarks/recovery.py [--repeats 3] [--libraries celery-dedup]

The same module is the workers' app: ``celery -A benchmarks.recovery worker``
with ``CELERY_DEDUP_RECOVERY_LIBRARY`` set.
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as ``python benchmarks/recovery.py``: make ``benchmarks.*`` importable

import redis  # noqa: E402
from celery import Celery, Task, signals  # noqa: E402

import celery_dedup  # noqa: E402
from benchmarks.harness import READY_MARKER, Script, WorkerProcess, progress, table  # noqa: E402
from celery_dedup import DedupTask  # noqa: E402

BROKER = os.environ.get("CELERY_DEDUP_BENCH_BROKER", "redis://127.0.0.1:6379/0")
LIBRARY = os.environ.get("CELERY_DEDUP_RECOVERY_LIBRARY")
VISIBILITY = float(os.environ.get("CELERY_DEDUP_RECOVERY_VISIBILITY", "10"))
LIBRARIES = ("celery-dedup", "celery-once", "celery-singleton")
SCENARIOS = ("child", "worker")
TASK = "bench.recover"
QUEUE = "bench-recovery"
#: RPUSHed by every execution as its body starts: ``"<task id> <pid> <unix time>"``.
LOG = "bench-recovery:log"
#: Set to 1 before the first call: that execution hangs until killed, later ones return at once.
HANG = "bench-recovery:hang"


def build_app(url: str, library: str, visibility_timeout: float) -> tuple[Celery, Task[Any, Any]]:
    """An app on ``url`` with ``library``'s task ``bench.recover(n)``, keyed on ``n``."""
    app = Celery("bench_recovery", broker=url, set_as_current=False)
    conf: dict[str, Any] = {}
    base: type[Task[Any, Any]] = Task
    options: dict[str, Any] = {}
    if library == "celery-dedup":
        base, options = DedupTask, {"dedup_key": "recover:{n}"}
    elif library == "celery-once":
        from celery_once import QueueOnce  # noqa: PLC0415 - optional: the bench extra

        conf = {"ONCE": {"backend": "celery_once.backends.Redis", "settings": {"url": url}}}
        base, options = QueueOnce, {"once": {"keys": ["n"]}}
    elif library == "celery-singleton":
        from celery_singleton import Singleton  # noqa: PLC0415 - optional: the bench extra

        conf = {"singleton_backend_url": url}
        base, options = Singleton, {"unique_on": ["n"]}
    else:
        raise ValueError(f"unknown library {library!r}: expected one of {', '.join(LIBRARIES)}")
    app.conf.update(
        task_default_queue=QUEUE,
        task_ignore_result=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        broker_transport_options={
            "visibility_timeout": visibility_timeout,
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
            "unacked_mutex_expire": 5,
        },
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        **conf,
    )
    if library == "celery-dedup":
        celery_dedup.install(app)
    log = redis.Redis.from_url(url)

    @app.task(name=TASK, base=base, bind=True, shared=False, **options)
    def recover(self: Task[Any, Any], n: int) -> int:
        log.rpush(LOG, f"{self.request.id} {os.getpid()} {time.time():.6f}")
        if log.decr(HANG) >= 0:
            time.sleep(3600)
        return n

    return app, recover


app = build_app(BROKER, LIBRARY, VISIBILITY)[0] if LIBRARY else None


@signals.worker_ready.connect
def _announce_ready(sender: Any = None, **_: Any) -> None:
    if app is not None and getattr(sender, "app", None) is app:
        print(READY_MARKER, flush=True)


# --- the benchmark --------------------------------------------------------------------------------


def as_text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def starts(client: redis.Redis) -> list[tuple[str, int, float]]:
    return [
        (task_id, int(pid), float(at))
        for task_id, pid, at in (as_text(entry).split() for entry in client.lrange(LOG, 0, -1))
    ]


def duplicate(task: Task[Any, Any], first_id: str) -> bool:
    """Call the key again: was the call answered as a duplicate of the killed run?"""
    try:
        result = task.apply_async((1,))
    except Exception as exc:  # celery-once raises AlreadyQueued
        if type(exc).__name__ == "AlreadyQueued":
            return True
        raise
    return bool(getattr(result, "deduplicated", False)) or result.id == first_id


def wait_for(condition: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    return None


def scenario(url: str, library: str, kind: str, args: Any) -> dict[str, Any]:
    """One kill and restart; seconds from the new worker's ready and from the kill to the re-run's start."""
    client = redis.Redis.from_url(url)
    client.flushall()
    client.set(HANG, 1)
    _, task = build_app(url, library, args.visibility_timeout)
    env = {
        "CELERY_DEDUP_BENCH_BROKER": url,
        "CELERY_DEDUP_RECOVERY_LIBRARY": library,
        "CELERY_DEDUP_RECOVERY_VISIBILITY": str(args.visibility_timeout),
    }
    workers = [WorkerProcess("benchmarks.recovery", env=env, concurrency=2, name="recovery").wait_ready()]
    try:
        first = task.apply_async((1,))
        started = wait_for(lambda: starts(client), 30)
        if not started:
            raise RuntimeError(f"{library}: the task never started:\n" + "".join(workers[0].output[-30:]))
        child = started[0][1]
        killed = time.time()
        if kind == "child":
            os.kill(child, signal.SIGKILL)
        else:
            workers[0].kill()
        time.sleep(args.restart_after / 2)
        probed = time.time()
        answered_duplicate = duplicate(task, first.id)
        time.sleep(max(killed + args.restart_after - time.time(), 0))
        if kind == "child":
            workers[0].stop()
        workers.append(WorkerProcess("benchmarks.recovery", env=env, concurrency=2, name="recovery").wait_ready())
        ready = time.time()
        rerun = wait_for(lambda: [s for s in starts(client)[1:] if s[0] == first.id], args.wait)
    finally:
        for worker in workers:
            worker.stop()
    at = rerun[0][2] if rerun else None
    return {
        "library": library,
        "scenario": kind,
        "from_restart_s": None if at is None else round(at - ready, 3),
        "from_kill_s": None if at is None else round(at - killed, 3),
        "restart_after_kill_s": round(ready - killed, 3),
        # None: the re-run had started before the call, so it did not fall in an outage.
        "duplicate_during_outage": None if at is not None and at < probed else answered_duplicate,
    }


def summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    def spread(field: str) -> dict[str, float] | None:
        values = [run[field] for run in runs if run[field] is not None]
        if len(values) < len(runs):
            return None
        return {"median": round(statistics.median(values), 3), "min": min(values), "max": max(values)}

    probes = [run["duplicate_during_outage"] for run in runs if run["duplicate_during_outage"] is not None]
    return {
        "library": runs[0]["library"],
        "scenario": runs[0]["scenario"],
        "from_restart_s": spread("from_restart_s"),
        "from_kill_s": spread("from_kill_s"),
        "outage_calls": len(probes),
        "outage_calls_duplicate": sum(probes),
        "runs": list(runs),
    }


def seconds(value: dict[str, float] | None) -> str:
    if value is None:
        return "-"
    if len({value["min"], value["max"]}) == 1:
        return f"{value['median']:.2f}"
    return f"{value['median']:.2f} ({value['min']:.2f} to {value['max']:.2f})"


def main(argv: Sequence[str] | None = None) -> int:
    from celery_dedup.testing import RedisServer  # noqa: PLC0415 - the benchmark's own server

    script = Script("recovery", __doc__)
    script.option("--repeats", 1, "kills per library and scenario")
    script.option("--restart-after", 2.0, "seconds from the kill to the restart", minimum=0.5)
    script.option("--visibility-timeout", 10.0, "kombu's visibility_timeout, seconds", minimum=1)
    script.option("--wait", 90.0, "seconds to wait for a re-run after the restart", minimum=1)
    script.option("--libraries", ",".join(LIBRARIES), "comma-separated", minimum=None, type=str)
    args = script.parse(argv)
    libraries = [name.strip() for name in args.libraries.split(",") if name.strip()]
    if not libraries or any(name not in LIBRARIES for name in libraries):
        script.parser.error(f"--libraries takes {', '.join(LIBRARIES)}")
    with RedisServer() as server:
        script.header(f"server: {server.binary} ({server.version()})", peers=True)
        rows = []
        for library in libraries:
            for kind in SCENARIOS:
                runs = []
                for repeat in range(args.repeats):
                    progress(f"{library} {kind} {repeat + 1}/{args.repeats}")
                    runs.append(scenario(server.url, library, kind, args))
                rows.append(summary(runs))
    print()
    print(
        f"recovery: re-run of a SIGKILLed acks_late task (task_reject_on_worker_lost on), restart "
        f"{args.restart_after:g} s after the kill, visibility_timeout {args.visibility_timeout:g} s; "
        f"median (min to max) of {args.repeats}; negative: re-run by the old worker before the restart; "
        f"'-': no re-run within {args.wait:g} s of the restart. A new call of the key is made "
        f"{args.restart_after / 2:g} s after the kill; it counts only if the re-run had not started yet."
    )
    print()
    print(
        table(
            ("library", "scenario", "re-run after restart (s)", "re-run after kill (s)", "new calls = duplicate"),
            [
                (
                    row["library"],
                    row["scenario"],
                    seconds(row["from_restart_s"]),
                    seconds(row["from_kill_s"]),
                    f"{row['outage_calls_duplicate']} of {row['outage_calls']}",
                )
                for row in rows
            ],
        )
    )
    script.save(args, {"scenarios": rows}, peers=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
