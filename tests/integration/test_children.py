"""A duplicate leaves no trace of a task that does not exist.

Celery records a published task in its parent's ``children`` and announces it
(``after_task_publish``, the ``task-sent`` event) around ``producer.publish``;
on the Redis broker only that publish tells whether the gate took the message.
A task that calls a keyed task twice must end with children naming the run
that exists, one publish announced, and every child resolvable.
"""

from __future__ import annotations

import base64
import contextlib
import json
import uuid
from collections.abc import Iterator
from typing import Any, cast

import pytest
import redis
from celery import Celery, signals
from celery.result import AsyncResult

import celery_dedup
from celery_dedup import DedupTask, runtime
from celery_dedup.keys import member_for

from ..conftest import AppFactory, Server, in_process_worker, wait_for


@contextlib.contextmanager
def publishes_of(task_name: str) -> Iterator[list[str]]:
    """Ids of the messages of ``task_name`` that ``after_task_publish`` announced."""
    seen: list[str] = []

    def record(sender: str | None = None, headers: dict[str, Any] | None = None, **_: Any) -> None:
        if sender == task_name and headers is not None:
            seen.append(str(headers["id"]))

    signals.after_task_publish.connect(record, weak=False)
    try:
        yield seen
    finally:
        signals.after_task_publish.disconnect(record)


@contextlib.contextmanager
def sent_events_of(client: redis.Redis, task_name: str) -> Iterator[list[str]]:
    """Task ids of the ``task-sent`` events for ``task_name`` published on the Redis broker meanwhile.

    Read when the block ends: kombu publishes events of the fanout ``celeryev``
    exchange with PUBLISH, which a subscriber buffers until it is read.
    """
    pubsub = client.pubsub()
    pubsub.psubscribe("*celeryev*")
    wait_for(lambda: pubsub.get_message(timeout=0.1), 5, "the events subscription")
    seen: list[str] = []
    try:
        yield seen
    finally:
        while (message := pubsub.get_message(timeout=0.2)) is not None:
            if message["type"] != "pmessage":
                continue
            envelope = json.loads(message["data"])
            body = envelope["body"]
            if envelope.get("properties", {}).get("body_encoding") == "base64":
                body = base64.b64decode(body)
            event = json.loads(body)
            if event.get("type") == "task-sent" and event.get("name") == task_name:
                seen.append(str(event["uuid"]))
        pubsub.close()


def stored_children(app: Celery, task_id: str) -> list[AsyncResult[Any]]:
    """The children stored with ``task_id``'s result (celery-types has them as tuples; Celery rebuilds results)."""
    return cast("list[AsyncResult[Any]]", AsyncResult(task_id, app=app).children or [])


def parent_and_child(app: Celery, decided_by: str) -> tuple[Any, Any]:
    """A plain parent task calling a keyed child twice with one key.

    ``decided_by="gate"`` makes the second call reach the broker's gate: the
    process's hint that the key is held is forgotten first, so no shortcut
    answers it before a message is built.
    """
    prefix = f"children.{uuid.uuid4().hex[:8]}"

    @app.task(base=DedupTask, dedup_key="order:{order_id}", shared=False, name=f"{prefix}.child")
    def child(order_id: int) -> int:
        return order_id * 10

    @app.task(bind=True, shared=False, name=f"{prefix}.parent")
    def parent(self: Any, order_id: int) -> list[Any]:
        first = child.delay(order_id)
        if decided_by == "gate":
            runtime.runtime_for(app).recent.forget(member_for(child.name, f"order:{order_id}"))
        second = child.delay(order_id)
        return [first.id, second.id, first.deduplicated, second.deduplicated]

    return parent, child


@pytest.mark.parametrize("decided_by", ["gate", "hint"])
def test_parent_children_name_only_the_run_that_exists(make_app: AppFactory, r: redis.Redis, decided_by: str) -> None:
    app = make_app(task_send_sent_event=True)
    parent, child = parent_and_child(app, decided_by)

    with publishes_of(child.name) as published, sent_events_of(r, child.name) as events, in_process_worker(app):
        called = parent.delay(4)
        first_id, second_id, first_dup, second_dup = called.get(timeout=10)
        assert (first_dup, second_dup) == (False, True)
        assert second_id == first_id, "the duplicate caller gets the accepted run"
        children = stored_children(app, called.id)
        assert [result.id for result in children] == [first_id], "the parent's children name a phantom"
        assert [result.get(timeout=10) for result in children] == [40]

    assert published == [first_id], "after_task_publish announced a message the gate refused"
    assert events == [first_id], "a task-sent event for a message the gate refused"


def test_parent_children_on_a_broker_without_atomic_gate(make_app: AppFactory, server: Server) -> None:
    """On a non-Redis broker the key is held before publishing: the accepted run is still the parent's child."""
    app = make_app(
        broker_url="memory://",
        dedup_redis_url=server.url,
        task_default_queue=f"children-{uuid.uuid4().hex[:8]}",
        broker_transport_options={"polling_interval": 0.05},
    )
    assert not runtime.runtime_for(app).atomic
    parent, child = parent_and_child(app, "gate")

    with publishes_of(child.name) as published, in_process_worker(app):
        called = parent.delay(5)
        first_id, second_id, _, second_dup = called.get(timeout=10)
        assert second_dup and second_id == first_id
        children = stored_children(app, called.id)
        assert [result.id for result in children] == [first_id]
        assert [result.get(timeout=10) for result in children] == [50]

    assert published == [first_id]


def test_duplicate_published_by_name_is_not_announced(make_app: AppFactory, r: redis.Redis) -> None:
    """``app.send_task`` by name: a duplicate returns its own id (as documented) but is not announced as sent."""
    app = make_app(task_send_sent_event=True)
    _, child = parent_and_child(app, "gate")

    with publishes_of(child.name) as published, sent_events_of(r, child.name) as events:
        first = app.send_task(child.name, (6,))
        second = app.send_task(child.name, (6,))
        outcome = celery_dedup.last_outcome()

    assert outcome is not None and (outcome.accepted, outcome.task_id) == (False, first.id)
    assert second.id != first.id
    assert published == [first.id]
    assert events == [first.id]
