"""Periodic tasks: a real ``celery beat`` sends a 3-second keyed task every second to a real worker.

The recipe in docs/recipes.md: ``dedup_mode="until_executed"`` holds the key
from the tick that queued a run until that run ends, so ticks meanwhile are
refused at the gate. Runs never overlap, the queue never holds more than one
message of the task (nothing piles up while runs or workers are slow), and
the first tick after a run ends starts the next.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

import celery_dedup
from celery_dedup import runtime
from celery_dedup.keys import member_for

from ..beat_app import EVENTS
from ..conftest import ROOT, AppFactory, Server, WorkerProcess, queued_messages, wait_for

pytestmark = pytest.mark.slow

TASK = "tests.beat_app.report"
MEMBER = member_for(TASK, "sales-report")
#: Runs to watch end: the one queued before any worker ran, and two the schedule started after it.
RUNS = 3


class BeatProcess:
    """``celery -A tests.beat_app beat`` in a subprocess, its log in ``log``."""

    def __init__(self, broker: str, directory: Path) -> None:
        self.log = directory / "beat.log"
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "celery",
                    "-A",
                    "tests.beat_app",
                    "beat",
                    "--schedule",
                    str(directory / "celerybeat-schedule"),
                    "--max-interval",
                    "1",
                    "--loglevel",
                    "INFO",
                ],
                cwd=ROOT,
                env=dict(os.environ, CELERY_DEDUP_TEST_BROKER=broker, PYTHONPATH=str(ROOT)),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def ticks(self) -> int:
        """How many times beat has sent the task (it logs each before sending, one after another)."""
        return self.output().count(f"Sending due task report ({TASK})")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


@pytest.fixture
def beat(server: Server, r: redis.Redis, tmp_path: Path) -> Iterator[BeatProcess]:
    process = BeatProcess(server.url, tmp_path)
    yield process
    process.stop()


def report_messages(r: redis.Redis) -> int:
    return sum(1 for message in queued_messages(r) if message["headers"]["task"] == TASK)


def events(r: redis.Redis) -> list[str]:
    return [raw.decode() for raw in r.lrange(EVENTS, 0, -1)]


def test_ticks_while_a_run_is_going_are_skipped_and_never_pile_up(
    server: Server, r: redis.Redis, make_app: AppFactory, beat: BeatProcess
) -> None:
    app = make_app()

    def decisions() -> dict[str, int]:
        return celery_dedup.stats(app).get(TASK, {})

    # No worker yet: the first tick queues a run, the ticks after it are refused.
    wait_for(lambda: beat.ticks() >= 3, 30, lambda: f"three beat ticks:\n{beat.output()}")
    assert report_messages(r) == 1, f"{report_messages(r)} messages queued by {beat.ticks()} ticks"
    refused_before = decisions().get("deduplicated", 0)
    assert refused_before >= 1

    # A worker with two processes: without the key, two runs could overlap.
    worker = WorkerProcess(server.url, app="tests.beat_app", pool="prefork", concurrency=2).wait_ready()
    queued_peak = 0

    def runs_ended() -> bool:
        nonlocal queued_peak
        queued_peak = max(queued_peak, report_messages(r))
        return sum(event.startswith("end ") for event in events(r)) >= RUNS

    try:
        wait_for(runs_ended, 60, lambda: f"{RUNS} runs ended: {events(r)}\n{''.join(worker.output)}")
    finally:
        beat.stop()
        worker.stop()

    assert queued_peak <= 1, f"{queued_peak} messages of the task queued at once"
    # Runs alternate start, end, start, end...: none began before the one before it ended.
    # (The last may have been cut short by the worker's stop.)
    seen = events(r)
    pairs = [seen[i : i + 2] for i in range(0, len(seen), 2)]
    for pair in pairs:
        run_id = pair[0].removeprefix("start ")
        assert pair[0] == f"start {run_id}" and pair[1:] in ([f"end {run_id}"], []), seen
    assert all(len(pair) == 2 for pair in pairs[:-1]), seen
    run_ids = [pair[0].removeprefix("start ") for pair in pairs]
    assert len(set(run_ids)) == len(run_ids) >= RUNS, seen
    # Ticks kept coming while the runs went on, and were refused.
    assert decisions()["deduplicated"] > refused_before
    status = runtime.store_for(app).status(MEMBER)
    assert status is not None and status.task_id.startswith("sales-report~")
