"""What every benchmark shares, so that each script states only what it measures.

- :class:`Script`: a script's options (``--output`` and its sizes, each with
  its default and minimum), the header it prints and the JSON it writes
  (what ran, when, on which machine and versions, with which options).
- Numbers: :func:`percentile`, :func:`describe`, :func:`timed`,
  :func:`threaded`, :func:`middle`.
- Output: :func:`table` (Markdown), :func:`progress` (to stderr).
- Redis: :func:`clear` (delete keys by pattern), :func:`server_ms`,
  :class:`CommandLog` and :func:`count_commands` (what a call sends, from
  ``MONITOR``, checked against ``INFO commandstats``).
- Workers: :class:`WorkerProcess`, ``celery worker`` in its own process group.

Scripts run from the repository root as ``python benchmarks/<name>.py``;
importing this module makes ``benchmarks.*`` and ``celery_dedup`` importable
from there, as worker subprocesses need too. Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import redis
from redis.utils import HIREDIS_AVAILABLE

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: The line a worker app prints once its worker consumes (``worker_ready``).
READY_MARKER = "celery-dedup-bench-worker-ready"
PEERS = ("celery-once", "celery-singleton")


# --- a script's frame -----------------------------------------------------------------------------


class Script:
    """One benchmark's options, header and result file.

    ``name`` names the result (``benchmarks/results/<name>.json``); the first
    paragraph of ``doc`` is the ``--help`` description; ``packages`` are
    distributions whose versions it reports besides Celery's, kombu's,
    redis-py's and its own.
    """

    def __init__(self, name: str, doc: str | None, *, packages: Sequence[str] = ()) -> None:
        self.name = name
        self.packages = tuple(packages)
        self.parser = argparse.ArgumentParser(description=(doc or "").split("\n\n", 1)[0] or None)
        self.parser.add_argument(
            "--output", type=Path, default=RESULTS / f"{name}.json", help="JSON result file (default %(default)s)"
        )
        self._minimums: dict[str, float] = {}
        self.started = time.monotonic()
        self.load_before = os.getloadavg()[0]

    def option(self, flag: str, default: Any, help: str, *, minimum: float | None = 1, **kwargs: Any) -> None:
        """An option of type ``type(default)`` (unless ``type=`` is given), its default shown in ``--help``."""
        kwargs.setdefault("type", type(default))
        self.parser.add_argument(flag, default=default, help=f"{help} (default {default})", **kwargs)
        if minimum is not None and isinstance(default, int | float) and not isinstance(default, bool):
            self._minimums[flag] = minimum

    def flag(self, flag: str, help: str, **kwargs: Any) -> None:
        """An on/off option (``store_true`` unless ``action=`` is given)."""
        kwargs.setdefault("action", "store_true")
        self.parser.add_argument(flag, help=help, **kwargs)

    def parse(self, argv: Sequence[str] | None = None) -> argparse.Namespace:
        args = self.parser.parse_args(argv)
        for flag, minimum in self._minimums.items():
            if getattr(args, flag.lstrip("-").replace("-", "_")) < minimum:
                self.parser.error(f"{flag} must be at least {minimum:g}")
        return args

    def header(self, *lines: str, peers: bool = False) -> None:
        """Print what runs: ``lines`` (the server, say), the versions and the machine's load."""
        for line in lines:
            print(line)
        print(", ".join(f"{k} {v}" for k, v in versions(*self.packages, *(PEERS if peers else ())).items()))
        print(f"load average before: {self.load_before:.2f} (cpus: {os.cpu_count()})", flush=True)

    def save(self, args: argparse.Namespace, result: Mapping[str, Any], *, peers: bool = False) -> None:
        """Write ``result`` with what ran: the options, versions, machine and elapsed time."""
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "output"}
        save(
            args.output,
            {
                "benchmark": self.name,
                "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "versions": versions(*self.packages, *(PEERS if peers else ())),
                "machine": {
                    "platform": platform.platform(),
                    "cpus": os.cpu_count(),
                    "loadavg_1m_before": self.load_before,
                    "loadavg_1m_after": os.getloadavg()[0],
                },
                "settings": settings,
                "elapsed_s": round(time.monotonic() - self.started, 1),
                **result,
            },
        )


def versions(*extra: str) -> dict[str, str]:
    """Python's version and those of the packages a benchmark exercises (and of ``extra`` ones)."""
    found = {"python": platform.python_version()}
    for dist in ("celery", "kombu", "redis", "celery-dedup", *extra):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = "not installed"
    found["parser"] = redis_parser()
    return found


def redis_parser() -> str:
    """What parses replies (and packs commands) in this process: hiredis, when redis-py can import it."""
    if HIREDIS_AVAILABLE:
        return f"hiredis {metadata.version('hiredis')}"
    return "redis-py's (no hiredis)"


def save(output: Path, result: Mapping[str, Any]) -> None:
    """Write ``result`` as JSON to ``output`` (creating its folder) and say where."""
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print()
    print(f"wrote {output}")


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- numbers --------------------------------------------------------------------------------------


def percentile(values: Iterable[float], share: float) -> float:
    """Nearest-rank percentile (``share`` in 0..1) of ``values``, in any order."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    index = max(0, min(len(ordered) - 1, round(share * len(ordered) + 0.5) - 1))
    return ordered[index]


@dataclass(frozen=True)
class Summary:
    count: int
    median: float
    p95: float
    p99: float
    mean: float
    low: float
    high: float

    def as_dict(self, unit: str = "") -> dict[str, float]:
        suffix = f"_{unit}" if unit else ""
        return {
            "count": self.count,
            f"median{suffix}": self.median,
            f"p95{suffix}": self.p95,
            f"p99{suffix}": self.p99,
            f"mean{suffix}": self.mean,
            f"min{suffix}": self.low,
            f"max{suffix}": self.high,
        }


def describe(values: Sequence[float]) -> Summary:
    return Summary(
        len(values),
        statistics.median(values),
        percentile(values, 0.95),
        percentile(values, 0.99),
        statistics.fmean(values),
        min(values),
        max(values),
    )


def timed(call: Callable[[], object], calls: int) -> list[float]:
    """Microseconds each of ``calls`` calls of ``call`` took (after a garbage collection)."""
    clock = time.perf_counter_ns
    took: list[float] = []
    gc.collect()
    for _ in range(calls):
        began = clock()
        call()
        took.append((clock() - began) / 1000)
    return took


def threaded(
    call: Callable[[Any, int], object],
    calls: int,
    threads: int,
    *,
    around: Callable[[int], AbstractContextManager[Any]] | None = None,
) -> tuple[float, list[float]]:
    """``call(state, i)`` ``calls`` times over ``threads`` threads: (calls per second, latencies in µs).

    ``state`` is the thread's index, or what ``around(thread)`` yields: a
    thread's own connection, say, opened before the clock starts. The threads
    start together; the first error any of them raises is raised here.
    """
    shares = [calls // threads + (1 if t < calls % threads else 0) for t in range(threads)]
    latencies: list[list[float]] = [[] for _ in range(threads)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(threads + 1)

    def work(thread: int) -> None:
        clock, sink = time.perf_counter_ns, latencies[thread]
        try:
            with around(thread) if around is not None else contextlib.nullcontext(thread) as state:
                barrier.wait()
                for i in range(shares[thread]):
                    began = clock()
                    call(state, i)
                    sink.append((clock() - began) / 1000)
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    workers = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(threads)]
    for worker in workers:
        worker.start()
    with contextlib.suppress(threading.BrokenBarrierError):
        barrier.wait()
    began = time.perf_counter()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - began
    if errors:
        raise errors[0]
    flat = [value for row in latencies for value in row]
    return len(flat) / elapsed, flat


def middle(runs: Sequence[Any], key: Callable[[Any], float]) -> Any:
    """The median run of ``runs`` by ``key`` (the upper one of an even count)."""
    return sorted(runs, key=key)[len(runs) // 2]


# --- output ---------------------------------------------------------------------------------------


def cell(value: object) -> str:
    """A table cell: thousands separators, fewer decimals the bigger a number is."""
    if isinstance(value, bool) or value is None:
        return {True: "yes", False: "no", None: "\N{EN DASH}"}[value]
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        magnitude = abs(value)
        if magnitude >= 100:
            return f"{value:,.0f}"
        if magnitude >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}" if magnitude >= 1 or value == 0 else f"{value:.2g}"
    return str(value)


def _numeric(value: object) -> bool:
    """Whether a cell reads as a number (a ratio such as ``1.05x`` does)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int | float) or (isinstance(value, str) and value.rstrip("x%").replace(".", "").isdigit())


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A Markdown table; a column whose first cell is a number (or a ratio) is right-aligned."""
    body = [list(row) for row in rows]
    first = body[0] if body else [""] * len(headers)
    align = ["---:" if _numeric(v) else "---" for v in first]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in body]
    return "\n".join(lines)


def ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base else "\N{EN DASH}"


# --- Redis ----------------------------------------------------------------------------------------


def clear(client: redis.Redis, *patterns: str) -> int:
    """Delete every key matching any of ``patterns`` (SCAN, in batches); how many went."""
    deleted = 0
    for pattern in patterns:
        batch: list[bytes] = []
        for key in client.scan_iter(match=pattern, count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                deleted += int(client.delete(*batch))
                batch.clear()
        if batch:
            deleted += int(client.delete(*batch))
    return deleted


def server_ms(client: redis.Redis) -> float:
    """The server's clock, in ms (what Lua scripts stamp records with)."""
    seconds, micros = client.time()
    return seconds * 1000 + micros / 1000


def commandstats(client: redis.Redis) -> Counter[str]:
    stats = client.info("commandstats")
    return Counter({name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()})


class CommandLog:
    """Every command the server runs while open, read with ``MONITOR`` on a thread.

    ``close`` sends a marker ``ECHO`` and reads up to it, so the log is complete.
    """

    def __init__(self, url: str) -> None:
        self._client: redis.Redis = redis.Redis.from_url(url)
        self._monitor = self._client.monitor()  # type: ignore[no-untyped-call]
        self._monitor.__enter__()
        self.entries: list[dict[str, Any]] = []
        self.complete = False
        self._marker = f"bench-marker-{os.getpid()}-{time.monotonic_ns()}"
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


def count_commands(url: str, call: Callable[[], object], calls: int) -> dict[str, Any]:
    """What ``calls`` calls of ``call`` send to the server, per call: commands from clients (round
    trips) and commands run inside Lua, from ``MONITOR``, checked against ``INFO commandstats``."""
    admin: redis.Redis = redis.Redis.from_url(url)
    admin_port = str(admin.client_info()["addr"]).rsplit(":", 1)[1]
    # MONITOR first: its own connection set-up is then outside the delta.
    log = CommandLog(url)
    before = commandstats(admin)
    for _ in range(calls):
        call()
    entries = log.close(admin)
    after = commandstats(admin)
    delta = after - before
    delta.subtract({"info": 1, "echo": 1})  # the admin client's own snapshot and marker
    delta = +delta
    sent: Counter[str] = Counter()
    in_lua: Counter[str] = Counter()
    for entry in entries:
        if entry["client_type"] != "lua" and entry["client_port"] == admin_port:
            continue
        name = entry["command"].split(" ", 1)[0].lower()
        (in_lua if entry["client_type"] == "lua" else sent)[name] += 1
    admin.close()
    return {
        "calls": calls,
        "round_trips_per_call": sum(sent.values()) / calls,
        "client_commands_per_call": {k: v / calls for k, v in sorted(sent.items())},
        "lua_commands_per_call": {k: v / calls for k, v in sorted(in_lua.items())},
        "commandstats_per_call": {k: v / calls for k, v in sorted(delta.items())},
        "commandstats_agrees": dict(delta) == dict(sent + in_lua),
        "entries": entries,
    }


def per_call(counts: Mapping[str, float]) -> str:
    """``{"evalsha": 1.0, "lpush": 1.0}`` as ``EVALSHA 1, LPUSH 1``."""
    return ", ".join(f"{name.upper()} {value:g}" for name, value in counts.items()) or "none"


def start_run(
    store: Any,
    member: str,
    task_id: str,
    token: str,
    *,
    record_ms: int = 86_400_000,
    lock_ms: int = 60_000,
    hostname: str = "bench@host",
    pid: int | None = None,
    key_mode: str = "lock",
) -> None:
    """What the guard sends when a delivery of a gated key starts; raises if the store refuses it.

    ``key_mode``: the task's mode's ``key_on_start`` ("window" for throttle and until_expired).
    """
    decision = store.start(
        member,
        task_id,
        token,
        lock_ms=lock_ms,
        gated=True,
        key_mode=key_mode,
        hostname=hostname,
        pid=os.getpid() if pid is None else pid,
        retries=0,
        record_ms=record_ms,
    )
    if not decision.run:
        raise RuntimeError(f"start refused {member!r}: {decision}")


# --- workers --------------------------------------------------------------------------------------


def children_of(pid: int) -> list[int]:
    """Live child pids of ``pid``, from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[1]) == pid:
            found.append(int(entry))
    return found


class WorkerProcess:
    """``celery -A <app> worker`` in its own process group; the app prints :data:`READY_MARKER` when ready.

    ``env`` is added to this process's environment (a worker app reads its
    broker and settings from there). Use as a context manager, or call
    :meth:`wait_ready` and :meth:`stop`.
    """

    def __init__(
        self,
        app: str,
        *,
        env: Mapping[str, str],
        pool: str = "prefork",
        concurrency: int = 1,
        name: str = "bench",
        loglevel: str = "WARNING",
    ) -> None:
        full_env = dict(os.environ, **env)
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), full_env.get("PYTHONPATH")]))
        command = [
            *(sys.executable, "-m", "celery", "-A", app, "worker"),
            *("--pool", pool, "--concurrency", str(concurrency), "--loglevel", loglevel),
            *("--hostname", f"{name}@%h", "--without-gossip", "--without-mingle", "--without-heartbeat"),
        ]
        self.name = name
        self.output: list[str] = []
        self.process = subprocess.Popen(
            command, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_ready(self, timeout: float = 60.0) -> WorkerProcess:
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            line = self.process.stdout.readline().decode(errors="replace")
            self.output.append(line)
            if READY_MARKER in line:
                break
            if (not line and self.process.poll() is not None) or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"worker {self.name} did not start:\n" + "".join(self.output))
        threading.Thread(target=self._drain, daemon=True).start()  # a chatty worker never blocks on a full pipe
        return self

    def _drain(self) -> None:
        assert self.process.stdout is not None
        for raw in iter(self.process.stdout.readline, b""):
            self.output.append(raw.decode(errors="replace"))

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> list[int]:
        """SIGKILL the whole worker (its process group); the pids that died."""
        pids = [self.pid, *children_of(self.pid)]
        os.killpg(self.pid, signal.SIGKILL)
        self.process.wait()
        return pids

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.pid, signal.SIGKILL)
                self.process.wait()

    def errors(self, *expected: str) -> list[str]:
        """Lines the worker logged as errors, but those holding any of ``expected``."""
        return [
            line
            for line in self.output
            if ("ERROR" in line or "CRITICAL" in line) and not any(text in line for text in expected)
        ]

    def __enter__(self) -> WorkerProcess:
        return self.wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        errors = self.errors()
        if errors:
            progress(f"worker {self.name} logged errors:\n" + "".join(errors[:20]))
