"""Debounce and throttle under real load: producer processes, a real worker, the server's clock.

Which call reached Redis last, and when, is read from the server's MONITOR
feed (commands in execution order, stamped by the server), independently of
anything celery-dedup records. Executions are read from what the task bodies
wrote (tests/debounce_app.py).
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_dedup import runtime
from tests import debounce_app
from tests.conftest import Server, WorkerProcess, wait_for
from tests.debounce_app import MAX_WAIT, THROTTLE_WINDOW, WINDOW, runs_key

pytestmark = pytest.mark.slow

_STOP = "monitor-stop"
_SEQ = re.compile(r"'(\d+-\d+)'")


class GateCalls:
    """Server timestamps of the gate calls that carried each call's ``seq``, from MONITOR.

    A producer's first EVALSHA fails with NOSCRIPT and is followed by an EVAL:
    the later timestamp of a ``seq`` is the one that ran.
    """

    def __init__(self, server: Server) -> None:
        self.server = server
        self.seen: dict[str, float] = {}
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._listen, daemon=True)

    def _listen(self) -> None:
        client = self.server.client()
        with client.monitor() as monitor:
            self.ready.set()
            for event in monitor.listen():
                command = str(event["command"])
                if command.startswith("ECHO") and _STOP in command:
                    return
                if command.startswith(("EVALSHA", "EVAL ")):
                    found = _SEQ.search(command)
                    if found:
                        self.seen[found.group(1)] = float(event["time"])

    @property
    def calls(self) -> list[tuple[float, str]]:
        return sorted((at, seq) for seq, at in self.seen.items())

    def __enter__(self) -> GateCalls:
        self.thread.start()
        self.ready.wait(5)
        time.sleep(0.1)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.client().echo(_STOP)
        self.thread.join(10)


def _produce(
    broker: str, task: str, key: str, proc: int, calls: int, spacing: float, ready: Any, skew: float = 0.0
) -> None:
    """One producer process: ``calls`` calls of ``task``, ``spacing`` seconds apart, once every producer is ready."""
    assert broker == debounce_app.app.conf.broker_url, "the parent sets the broker before spawning"
    task_obj = getattr(debounce_app, task)
    # Every call must reach the gate script, where MONITOR sees its arguments:
    # no answering a known duplicate with a peek.
    runtime.runtime_for(debounce_app.app).recent.size = 0
    pool: Any = debounce_app.app.pool  # kombu's ConnectionPool (typed as a producer pool)
    with pool.acquire(block=True) as connection:  # connected before the race, not in it
        connection.ensure_connection()
    # All start together, however long each took to import Celery: on a loaded machine a fixed start time
    # let one producer's calls come a window after the others', a second burst the test did not mean.
    ready.wait(timeout=60)
    begin = time.monotonic()
    if skew:
        real = time.time
        time.time = lambda: real() + skew
    for i in range(calls):
        task_obj.delay(key, f"{proc}-{i}")
        pause = begin + (i + 1) * spacing - time.monotonic()
        if pause > 0:
            time.sleep(pause)


def _race(server: Server, task: str, key: str, *, procs: int, calls: int, spacing: float, skews: list[float]) -> None:
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Barrier(procs)
    children = [
        ctx.Process(
            target=_produce,
            args=(server.url, task, key, p, calls, spacing, ready, skews[p % len(skews)]),
        )
        for p in range(procs)
    ]
    for child in children:
        child.start()
    for child in children:
        child.join(60)
        assert child.exitcode == 0, f"producer exited with {child.exitcode}"


def runs(client: redis.Redis, task: str) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in client.lrange(runs_key(task), 0, -1)]


@pytest.fixture
def worker(server: Server, r: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> Iterator[WorkerProcess]:
    """A prefork worker of tests/debounce_app.py; that module (here and in spawned producers) uses the test server."""
    monkeypatch.setenv("CELERY_DEDUP_TEST_BROKER", server.url)
    debounce_app.use(server.url)
    process = WorkerProcess(server.url, app="tests.debounce_app", pool="prefork", concurrency=2).wait_ready()
    yield process
    process.stop()


def server_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def _check_burst(client: redis.Redis, calls: list[tuple[float, str]], task: str, *, executions: int = 1) -> None:
    """The burst ran once, with the arguments of the call that reached Redis last, a window after it."""
    last_at, last_seq = max(calls)
    done = wait_for(lambda: runs(client, task), WINDOW + 5, f"{task} never ran")
    time.sleep(WINDOW + 1.0)  # room for a wrong second run to show up
    done = runs(client, task)
    assert len(done) == executions, done
    run = done[-1]
    assert run["seq"] == last_seq, f"ran with {run['seq']}, but {last_seq} reached Redis last"
    delay_ms = run["started_ms"] - last_at * 1000
    assert WINDOW * 1000 - 1 <= delay_ms <= (WINDOW + 1.0) * 1000, f"started {delay_ms:.0f} ms after the last call"


def test_eight_producers_collapse_into_one_run_with_the_last_arguments(
    server: Server, r: redis.Redis, worker: WorkerProcess
) -> None:
    with GateCalls(server) as gate:
        _race(server, "sync", "burst", procs=8, calls=63, spacing=1.0 / 63, skews=[0.0])
    calls = gate.calls
    assert len(calls) == 8 * 63, "every call reached the gate"
    assert max(calls)[0] - min(calls)[0] >= 0.8, "the burst spans about a second"
    _check_burst(r, calls, "tests.debounce_app.sync")
    messages = int(r.hget("dedup:rec:tests.debounce_app.sync:sku:burst", "debounced") or 0) + 1
    assert messages == len(calls), "every call joined the one run"


def test_producers_with_skewed_clocks_change_nothing(server: Server, r: redis.Redis, worker: WorkerProcess) -> None:
    """Producers whose clocks are ten minutes fast and slow: the server's clock alone decides."""
    with GateCalls(server) as gate:
        _race(server, "sync", "skewed", procs=4, calls=20, spacing=0.03, skews=[600.0, -600.0])
    _check_burst(r, gate.calls, "tests.debounce_app.sync")

    day_calls = []
    with GateCalls(server) as gate:
        _race(server, "report", "skewed-day", procs=4, calls=10, spacing=0.05, skews=[600.0, -600.0])
    day_calls = gate.calls
    assert max(day_calls)[0] - min(day_calls)[0] < THROTTLE_WINDOW
    wait_for(lambda: runs(r, "tests.debounce_app.report"), 10, "the throttled task never ran")
    time.sleep(0.5)
    assert len(runs(r, "tests.debounce_app.report")) == 1, "one window, one run, whatever the producers' clocks"


def test_bursts_separated_by_more_than_the_window_run_twice(
    server: Server, r: redis.Redis, worker: WorkerProcess
) -> None:
    task = "tests.debounce_app.sync"
    with GateCalls(server) as first:
        _race(server, "sync", "twice", procs=2, calls=10, spacing=0.02, skews=[0.0])
    _check_burst(r, first.calls, task)
    with GateCalls(server) as second:
        _race(server, "sync", "twice", procs=2, calls=10, spacing=0.02, skews=[0.0])
    assert min(second.calls)[0] - max(first.calls)[0] > WINDOW
    _check_burst(r, second.calls, task, executions=2)


def test_steady_calls_still_run_within_max_wait(server: Server, r: redis.Redis, worker: WorkerProcess) -> None:
    """A call every 100 ms for 5 s never goes quiet; max_wait makes runs happen anyway."""
    called: list[tuple[float, str]] = []
    begin = time.monotonic()
    for i in range(50):
        sent_at = time.time()
        result = debounce_app.sync_capped.delay("steady", f"0-{i}")
        called.append((sent_at, result.id))
        time.sleep(max(begin + (i + 1) * 0.1 - time.monotonic(), 0))
    task = "tests.debounce_app.sync_capped"
    covered = {run_id for _, run_id in called}
    wait_for(lambda: len(runs(r, task)) >= len(covered), MAX_WAIT + 5, lambda: f"runs: {runs(r, task)}")
    time.sleep(WINDOW + 0.5)
    done = runs(r, task)
    assert sorted(run["id"] for run in done) == sorted(covered), "each accepted run executed exactly once"
    assert len(done) >= 3, "5 s of steady calls with max_wait 2 s make at least three runs"
    for run in done:
        first_call = min(sent for sent, run_id in called if run_id == run["id"])
        waited = run["started_ms"] / 1000 - first_call
        assert waited <= MAX_WAIT + 1.0, f"run {run['id']} started {waited:.2f}s after the first call it covers"
    assert done[-1]["seq"] == "0-49", "the last run has the last call's arguments"


def test_throttle_runs_once_per_window(server: Server, r: redis.Redis, worker: WorkerProcess) -> None:
    """1,000 calls over 2.5 s, window 1 s: the first call of each window runs, and nothing else."""
    with GateCalls(server) as gate:
        _race(server, "report", "busy-day", procs=4, calls=250, spacing=2.5 / 250, skews=[0.0])
    calls = sorted(gate.calls)
    assert len(calls) == 1000
    task = "tests.debounce_app.report"
    wait_for(lambda: len(runs(r, task)) >= 3, 10, lambda: f"runs: {runs(r, task)}")
    time.sleep(1.0)
    done = sorted(runs(r, task), key=lambda run: run["queued_at"])
    # Each run's window opens at its accepted call (server clock, recorded at
    # the gate); 3 windows cover 2.5 s, a 4th only if the calls spilled past 3 s.
    assert len(done) in (3, 4), done
    opened = [run["queued_at"] for run in done]
    window_ms = THROTTLE_WINDOW * 1000
    assert all(later - earlier >= window_ms for earlier, later in itertools.pairwise(opened))
    assert abs(opened[0] - calls[0][0] * 1000) < 5, "the first call opened the first window"
    for at, seq in calls:
        at_ms = at * 1000
        current = max((o for o in opened if o <= at_ms + 1), default=None)
        assert current is not None and at_ms < current + window_ms + 2, f"call {seq} at {at_ms:.0f} found no window"
    expected = 4 if calls[-1][0] * 1000 >= opened[0] + 3 * window_ms else 3
    assert len(done) == expected, f"calls span {calls[-1][0] - calls[0][0]:.2f}s: expected {expected} runs"


def test_a_hundred_keys_debounce_independently(server: Server, r: redis.Redis, worker: WorkerProcess) -> None:
    # Each key's three calls back to back: its burst stays inside the window however slowly a loaded
    # machine publishes, while the hundred keys' windows overlap one another.
    for key in range(100):
        for round_ in range(3):
            debounce_app.sync.delay(f"k{key}", f"{round_}-{key}")
    task = "tests.debounce_app.sync"

    def missing() -> str:
        ran = {run["sku"] for run in runs(r, task)}
        left = [f"k{key}" for key in range(100) if f"k{key}" not in ran]
        member = f"{task}:sku:{left[0]}" if left else ""
        record = r.hgetall(f"dedup:rec:{member}")  # its history included
        return f"{100 - len(left)} of 100 ran; {left[:5]}: {record}"

    wait_for(lambda: len(runs(r, task)) >= 100, 15, missing)
    time.sleep(WINDOW + 0.5)
    done = runs(r, task)
    assert len(done) == 100
    assert {run["sku"]: run["seq"] for run in done} == {f"k{key}": f"2-{key}" for key in range(100)}
