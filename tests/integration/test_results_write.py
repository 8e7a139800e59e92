"""A success's ending goes out with its result when the result backend is the store's own Redis.

The finish script records the ending, then writes and publishes the result
(one round trip where there were two), so a caller who sees the result finds
the key released. Where no result is written after all, the ending is still
recorded when the task's trace ends.
"""

from __future__ import annotations

import threading
from typing import Any

import redis
from celery import Celery, signals
from kombu.utils.json import dumps

from celery_dedup import DedupTask
from celery_dedup.keys import KeySchema, member_for

from ..conftest import AppFactory, in_process_worker, wait_for

SCHEMA = KeySchema("dedup")


def register(app: Celery, **options: Any) -> Any:
    @app.task(base=DedupTask, name="results.charge", dedup_key="order:{order_id}", shared=False, **options)
    def charge(order_id: int) -> str:
        return f"charged {order_id}"

    return charge


def state(r: redis.Redis, order_id: int) -> str | None:
    raw = r.hget(SCHEMA.record(member_for("results.charge", f"order:{order_id}")), "state")
    return None if raw is None else raw.decode()


def held(r: redis.Redis, order_id: int) -> bool:
    return bool(r.sismember(SCHEMA.held, member_for("results.charge", f"order:{order_id}")))


class Monitor:
    """The server's MONITOR feed, collected in a thread."""

    def __init__(self, url: str) -> None:
        self.lines: list[str] = []
        self._client = redis.Redis.from_url(url)
        self._monitor = self._client.monitor().__enter__()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for entry in self._monitor.listen():
                self.lines.append(f"{entry['client_type']} {entry['command']}")
        except (redis.ConnectionError, ValueError, OSError):
            return

    def close(self) -> None:
        self._monitor.connection.disconnect()
        self._client.close()


def test_result_is_written_by_the_script_that_records_the_ending(make_app: AppFactory, r: redis.Redis) -> None:
    app = make_app()
    charge = register(app)
    with in_process_worker(app):
        monitor = Monitor(str(app.conf.broker_url))
        try:
            result = charge.delay(1)
            assert result.get(timeout=10) == "charged 1"
            assert state(r, 1) == "succeeded" and not held(r, 1)
            key = f"celery-task-meta-{result.id}"
            wait_for(lambda: any(key in line and "SETEX" in line for line in monitor.lines), 5, "the result write seen")
        finally:
            monitor.close()
    writes = [line for line in monitor.lines if key in line and ("SETEX" in line or "PUBLISH" in line)]
    assert writes and all(line.startswith("lua ") for line in writes), writes
    again = charge.delay(1)
    assert not again.deduplicated and again.id != result.id, "a caller who saw the result starts a new run"


def test_ending_is_recorded_where_no_result_is_written(make_app: AppFactory, r: redis.Redis) -> None:
    app = make_app()
    charge = register(app)

    @app.task(base=DedupTask, name="results.quiet", dedup_key="order:{order_id}", ignore_result=True, shared=False)
    def quiet(order_id: int) -> None:
        return None

    first = charge.delay(2)
    # A result already stored as a success is never overwritten: Celery skips the write altogether.
    r.set(f"celery-task-meta-{first.id}", dumps({"status": "SUCCESS", "result": "earlier", "task_id": first.id}))
    with in_process_worker(app):
        unstored = quiet.delay(3)
        wait_for(lambda: state(r, 2) == "succeeded", 10, "the run whose result was stored already ended")
        quiet_member = member_for("results.quiet", "order:3")
        wait_for(
            lambda: r.hget(SCHEMA.record(quiet_member), "state") == b"succeeded", 10, "the run without a result ended"
        )
    assert r.hget(SCHEMA.record(quiet_member), "task_id") == unstored.id.encode()
    assert not held(r, 2) and not r.sismember(SCHEMA.held, quiet_member)


def test_a_callback_of_the_run_is_published_with_its_key_released(make_app: AppFactory, r: redis.Redis) -> None:
    """With a callback, nothing waits for the result write: the ending is recorded before the callback is sent.

    Celery publishes callbacks before it stores the result. Were the ending left
    to the result write, a callback that calls the task again (a follow-up of
    the same order) would be answered with the run that just ended.
    """
    app = make_app()
    charge = register(app)
    member = member_for("results.charge", "order:4")
    seen: list[bool] = []

    @app.task(name="results.follow_up", shared=False)
    def follow_up(value: str) -> None:
        return None

    def on_publish(sender: str | None = None, **_: Any) -> None:
        if sender == follow_up.name:
            seen.append(bool(r.sismember(SCHEMA.held, member)))

    signals.before_task_publish.connect(on_publish, weak=False)
    try:
        with in_process_worker(app):
            assert charge.apply_async((4,), link=follow_up.s()).get(timeout=10) == "charged 4"
            wait_for(lambda: seen, 10, "the callback's publish")
    finally:
        signals.before_task_publish.disconnect(on_publish)
    assert seen == [False], "the key was still held when the callback went out"
    assert state(r, 4) == "succeeded"
