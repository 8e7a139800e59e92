"""A success nothing else waits for is sent as the body returns, and its reply read before the message is acked.

Where no result is stored and nothing is published after the body (no
callbacks, chain, group or chord), the worker writes the run's ending to the
store without waiting, and reads the reply when the task's trace ends,
before Celery acknowledges the message. These tests try to break what that
must keep: the ending is recorded before the ack, even when the connection
is cut before or after the server ran it; a store call the same thread makes
after the body waits for it; the run's followers still get its value.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import pytest
import redis
from celery import Celery, signals

from celery_dedup import DedupTask
from celery_dedup.keys import KeySchema, member_for
from chaos.proxy import FaultProxy

from ..conftest import AppFactory, Server, in_process_worker, wait_for
from .test_results_write import Monitor

SCHEMA = KeySchema("dedup")
NAME = "sent.quiet"


@pytest.fixture
def proxy(server: Server, r: redis.Redis) -> Iterator[FaultProxy]:
    """A fault proxy in front of the test server: the store's way there (the broker goes direct)."""
    port = urlparse(server.url).port
    assert port is not None
    with FaultProxy(port) as fault_proxy:
        yield fault_proxy


def quiet_app(make_app: AppFactory, proxy: FaultProxy | None, fault: Any = None) -> tuple[Celery, Any]:
    """An acks_late app whose store is behind ``proxy`` (None: the broker's), and its keyed task that stores no result.

    ``fault(proxy)`` runs inside the body, after the start decision and before the ending.
    """
    store = {} if proxy is None else {"dedup_redis_url": proxy.url}
    app = make_app("sent", task_acks_late=True, dedup_lock_ttl=30, **store)

    @app.task(base=DedupTask, name=NAME, dedup_key="order:{order_id}", ignore_result=True, shared=False)
    def quiet(order_id: int) -> int:
        if fault is not None:
            fault(proxy)
        return order_id

    return app, quiet


def record(r: redis.Redis, order_id: int) -> dict[str, str]:
    raw = r.hgetall(SCHEMA.record(member_for(NAME, f"order:{order_id}")))
    return {k.decode(): v.decode() for k, v in raw.items()}


def held(r: redis.Redis, order_id: int) -> bool:
    return bool(r.sismember(SCHEMA.held, member_for(NAME, f"order:{order_id}")))


def recorded_before_acked(lines: list[str], order_id: int) -> tuple[int, int]:
    """Where in the MONITOR feed the run's success was written, and where its message was acknowledged."""
    record_key = SCHEMA.record(member_for(NAME, f"order:{order_id}"))
    writes = (i for i, line in enumerate(lines) if line.startswith("lua HSET") and record_key in line)
    written = next((i for i in writes if "succeeded" in lines[i]), -1)
    # kombu acknowledges by taking the delivery tag out of its unacked hash (and index), from the client side.
    acked = next((i for i, line in enumerate(lines) if not line.startswith("lua ") and "HDEL unacked " in line), -1)
    return written, acked


def run_once(app: Celery, task: Any, r: redis.Redis, order_id: int) -> list[str]:
    """Run one call of ``task`` on a solo worker; the MONITOR feed of it."""
    monitor = Monitor(str(app.conf.broker_url))
    try:
        with in_process_worker(app):
            task.delay(order_id)
            wait_for(lambda: record(r, order_id).get("state") == "succeeded", 15, "the run's success is recorded")
            wait_for(lambda: r.hlen("unacked") == 0, 10, "the message is acknowledged")
        return list(monitor.lines)
    finally:
        monitor.close()


def test_the_success_is_recorded_before_the_message_is_acknowledged(
    make_app: AppFactory, proxy: FaultProxy, r: redis.Redis
) -> None:
    app, quiet = quiet_app(make_app, proxy)
    lines = run_once(app, quiet, r, 1)
    written, acked = recorded_before_acked(lines, 1)
    assert written >= 0 and acked >= 0, lines
    assert written < acked, "the message was acknowledged before its run's ending was recorded"
    assert not held(r, 1)


@pytest.mark.parametrize("point", ["before", "after"])
def test_an_ending_cut_off_on_its_way_is_recorded_again_before_the_ack(
    point: str, make_app: AppFactory, proxy: FaultProxy, r: redis.Redis
) -> None:
    """The connection carrying the sent ending is cut before the server got it, or before its reply came back.

    Either way the worker cannot know whether it was recorded: it records it
    again (safe after all) before Celery acknowledges the message.
    """
    app, quiet = quiet_app(make_app, proxy, lambda p: p.arm(point))
    lines = run_once(app, quiet, r, 2)
    assert [(incident.point, incident.command) for incident in proxy.incidents] == [(point, b"EVALSHA")]
    written, acked = recorded_before_acked(lines, 2)
    assert 0 <= written < acked, lines
    final = record(r, 2)
    assert final["state"] == "succeeded"
    assert not held(r, 2)
    assert not r.exists(SCHEMA.lock(member_for(NAME, "order:2")))


def test_a_call_the_same_thread_makes_after_the_body_waits_for_the_ending(
    make_app: AppFactory, proxy: FaultProxy, r: redis.Redis
) -> None:
    """A ``task_success`` receiver calls the same key again: a new run, though the ending is slow to arrive.

    The store's connection holds every command 0.3 s; the receiver's call goes
    through the broker's, which is not held: it is accepted only because the
    thread reads the ending's reply before it calls.
    """
    app, quiet = quiet_app(make_app, proxy, lambda p: p.delay_requests(0.3))
    answers: list[bool] = []

    def again(sender: Any = None, result: Any = None, **_: Any) -> None:
        if getattr(sender, "name", None) == NAME and not answers:
            answers.append(bool(quiet.delay(result).deduplicated))

    signals.task_success.connect(again, weak=False)
    try:
        with in_process_worker(app):
            first = quiet.delay(3)
            wait_for(lambda: answers, 15, "the success receiver's call")
            proxy.delay_requests(0)
            assert answers == [False], "the call after the body found the key still held"
            wait_for(
                lambda: record(r, 3).get("state") == "succeeded" and record(r, 3).get("task_id") != first.id,
                15,
                "the second run ends",
            )
    finally:
        signals.task_success.disconnect(again)
    assert answers == [False], "the call after the body found the key still held"


def test_the_followers_of_a_sent_success_get_its_value(make_app: AppFactory, r: redis.Redis) -> None:
    """A call with a callback, made while the run is queued, follows it (a Redis broker parks it)."""
    app, quiet = quiet_app(make_app, None)
    seen = "test:sent:callback"

    @app.task(name="sent.callback", shared=False)
    def callback(value: int) -> None:
        r.rpush(seen, value)

    first = quiet.delay(4)
    follower = quiet.apply_async((4,), link=callback.s())
    assert follower.deduplicated and follower.id == first.id, "the second call follows the first run"
    with in_process_worker(app):
        wait_for(lambda: r.llen(seen) == 1, 15, "the follower's callback ran with the run's value")
    assert r.lrange(seen, 0, -1) == [b"4"]
