"""Debounce on a real server and worker: broker messages per burst, and latency after the last call.

Each round starts ``--keys`` bursts at once, one thread per key: ``--calls``
calls of a debounced no-op task spread over ``--spread`` seconds. Right after
a burst's last call returns, the thread reads the server clock (so the
latency is understated by up to one round trip); the task body reads it again
when it starts. Latency is the difference minus the window,
i.e. what the dispatcher and the worker add to the quiet time the user asked
for. Broker messages are the LPUSHes onto the task queue, counted from the
server's MONITOR feed (commands scripts run appear there too).

Run it from the repository root::

    .venv/bin/python benchmarks/debounce.py [--rounds 5] [--keys 10] [--calls 50] [--output FILE]

It starts its own server and an in-process solo worker, prints Markdown
tables and writes ``benchmarks/results/debounce.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import celery_dedup  # noqa: E402
from benchmarks.harness import save, versions  # noqa: E402
from celery_dedup import DedupTask  # noqa: E402
from celery_dedup.testing import RedisServer  # noqa: E402


def server_ms(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) / 1000


class PushCounter:
    """LPUSHes onto ``queue`` seen in MONITOR while it runs."""

    def __init__(self, url: str, queue: str) -> None:
        self.url = url
        self.queue = queue
        self.pushes = 0
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._listen, daemon=True)

    def _listen(self) -> None:
        with redis.Redis.from_url(self.url).monitor() as monitor:  # type: ignore[no-untyped-call]
            self.ready.set()
            for event in monitor.listen():
                command = str(event["command"])
                if command.startswith("ECHO") and "push-counter-stop" in command:
                    return
                if command.startswith(f"LPUSH {self.queue} "):
                    self.pushes += 1

    def __enter__(self) -> PushCounter:
        self.thread.start()
        self.ready.wait(5)
        return self

    def __exit__(self, *exc: object) -> None:
        redis.Redis.from_url(self.url).echo("push-counter-stop")
        self.thread.join(10)


def build_app(url: str, window: float, interval: float) -> tuple[Celery, Any, dict[str, float]]:
    app = Celery("bench_debounce", set_as_current=False)
    app.conf.update(
        broker_url=url,
        task_ignore_result=True,
        worker_hijack_root_logger=False,
        dedup_dispatch_interval=interval,
    )
    celery_dedup.install(app)
    client = redis.Redis.from_url(url)
    started: dict[str, float] = {}

    @app.task(
        base=DedupTask,
        name="bench.sync",
        shared=False,
        dedup_key="sku:{sku}",
        dedup_mode="debounce",
        dedup_window=window,
    )
    def sync(sku: str, seq: int) -> None:
        started[f"{sku}/{seq}"] = server_ms(client)

    return app, sync, started


def burst(task: Any, client: redis.Redis, sku: str, calls: int, spread: float, last_call: dict[str, Any]) -> None:
    begin = time.monotonic()
    for seq in range(calls):
        task.delay(sku, seq)
        if seq == calls - 1:
            last_call[sku] = (server_ms(client), seq)
            return
        pause = begin + (seq + 1) * spread / calls - time.monotonic()
        if pause > 0:
            time.sleep(pause)


def run_case(
    url: str, window: float, interval: float, rounds: int, keys: int, calls: int, spread: float
) -> dict[str, Any]:
    app, task, started = build_app(url, window, interval)
    client = redis.Redis.from_url(url)
    latencies: list[float] = []
    runs_per_burst: list[int] = []
    with (
        start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING"),
        PushCounter(url, "celery") as pushes,
    ):
        for round_ in range(rounds):
            last_call: dict[str, Any] = {}
            threads = [
                threading.Thread(target=burst, args=(task, client, f"r{round_}k{k}", calls, spread, last_call))
                for k in range(keys)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            deadline = time.monotonic() + window + 10
            while time.monotonic() < deadline:
                done = [key for key in started if key.startswith(f"r{round_}k")]
                if len({key.split("/")[0] for key in done}) == keys:
                    break
                time.sleep(0.02)
            time.sleep(window + 0.3)  # a wrong second run would show up here
            by_sku: dict[str, list[str]] = defaultdict(list)
            for key in started:
                if key.startswith(f"r{round_}k"):
                    by_sku[key.split("/")[0]].append(key)
            for sku, (last_ms, last_seq) in last_call.items():
                runs = by_sku.get(sku, [])
                runs_per_burst.append(len(runs))
                if f"{sku}/{last_seq}" in started:
                    latencies.append(started[f"{sku}/{last_seq}"] - last_ms - window * 1000)
    app.close()
    bursts = rounds * keys
    ordered = sorted(latencies)
    return {
        "window_s": window,
        "dispatch_interval_s": interval,
        "bursts": bursts,
        "calls_per_burst": calls,
        "messages_per_burst": pushes.pushes / bursts,
        "runs_per_burst": statistics.mean(runs_per_burst),
        "ran_latest_args": len(latencies) / bursts,
        "latency_ms_median": statistics.median(ordered),
        "latency_ms_p95": ordered[max(int(len(ordered) * 0.95) - 1, 0)],
        "latency_ms_max": ordered[-1],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--keys", type=int, default=10, help="bursts at once, one per key")
    parser.add_argument("--calls", type=int, default=50, help="calls per burst")
    parser.add_argument("--spread", type=float, default=0.5, help="seconds a burst's calls span")
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "debounce.json")
    args = parser.parse_args(argv)

    cases = []
    with RedisServer() as server:
        version = redis.Redis.from_url(server.url).info("server")
        print(f"server: {server.binary} ({version.get('valkey_version') or version.get('redis_version')})")
        for window, interval in ((0.2, 0.1), (0.5, 0.1), (0.5, 0.02)):
            redis.Redis.from_url(server.url).flushall()
            cases.append(run_case(server.url, window, interval, args.rounds, args.keys, args.calls, args.spread))

    print()
    print(f"{args.rounds * args.keys} bursts per row, {args.calls} calls each over {args.spread:g} s")
    print()
    print(
        "| window | dispatch interval | broker messages / burst | runs / burst | ran with last call's args "
        "| last call to run, median | p95 | beyond the window, median | p95 | max |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for case in cases:
        window_ms = case["window_s"] * 1000
        print(
            f"| {case['window_s']:g} s | {case['dispatch_interval_s']:g} s | {case['messages_per_burst']:.2f} "
            f"| {case['runs_per_burst']:.2f} | {case['ran_latest_args']:.0%} "
            f"| {window_ms + case['latency_ms_median']:.1f} ms | {window_ms + case['latency_ms_p95']:.1f} ms "
            f"| {case['latency_ms_median']:.1f} ms | {case['latency_ms_p95']:.1f} ms "
            f"| {case['latency_ms_max']:.1f} ms |"
        )
    save(args.output, {"versions": versions(), "cases": cases, "options": vars(args) | {"output": str(args.output)}})


if __name__ == "__main__":
    main()
