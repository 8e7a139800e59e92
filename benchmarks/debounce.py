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

    .venv/bin/python -m benchmarks.debounce [--rounds 5] [--keys 10] [--calls 50] [--output FILE]

It starts its own server and an in-process solo worker, prints Markdown
tables and writes ``benchmarks/results/debounce.json``.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import defaultdict
from typing import Any

import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

import celery_dedup
from benchmarks import harness
from benchmarks.harness import server_ms
from celery_dedup import DedupTask
from celery_dedup.testing import RedisServer


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
        "latency_ms_p95": harness.percentile(ordered, 0.95),
        "latency_ms_max": ordered[-1],
    }


def main(argv: list[str] | None = None) -> None:
    script = harness.Script("debounce", __doc__)
    script.option("--rounds", 5, "rounds of bursts per row")
    script.option("--keys", 10, "bursts at once, one per key")
    script.option("--calls", 50, "calls per burst")
    script.option("--spread", 0.5, "seconds a burst's calls span", minimum=0)
    args = script.parse(argv)

    cases = []
    with RedisServer() as server:
        script.header(f"server: {server.binary} ({server.version()})")
        for window, interval in ((0.2, 0.1), (0.5, 0.1), (0.5, 0.02)):
            redis.Redis.from_url(server.url).flushall()
            cases.append(run_case(server.url, window, interval, args.rounds, args.keys, args.calls, args.spread))

    print()
    print(f"{args.rounds * args.keys} bursts per row, {args.calls} calls each over {args.spread:g} s")
    print()
    print(
        harness.table(
            [
                "window s",
                "dispatch interval s",
                "broker messages / burst",
                "runs / burst",
                "ran with last call's args",
                "last call to run, median ms",
                "p95 ms",
                "beyond the window, median ms",
                "p95 ms",
                "max ms",
            ],
            [
                [
                    case["window_s"],
                    case["dispatch_interval_s"],
                    case["messages_per_burst"],
                    case["runs_per_burst"],
                    f"{case['ran_latest_args']:.0%}",
                    case["window_s"] * 1000 + case["latency_ms_median"],
                    case["window_s"] * 1000 + case["latency_ms_p95"],
                    case["latency_ms_median"],
                    case["latency_ms_p95"],
                    case["latency_ms_max"],
                ]
                for case in cases
            ],
        )
    )
    script.save(args, {"cases": cases})


if __name__ == "__main__":
    main()
