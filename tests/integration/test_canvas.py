"""Publishes that do not come straight from ``DedupTask.delay``: signatures, send_task, canvas, retries."""

from __future__ import annotations

import time
import uuid
from typing import Any, cast

import celery
import redis
from celery import Celery, chain, chord, group
from celery.result import AsyncResult, GroupResult

import celery_dedup
from celery_dedup import DedupResult, DedupTask
from celery_dedup.keys import KeySchema, member_for

from ..conftest import AppFactory, Server, in_process_worker, queued_messages

HELD = KeySchema("dedup").held


class Tasks:
    """Keyed tasks of one app, recording (task, task id, args) of every run in ``runs``."""

    def __init__(self, app: Celery) -> None:
        self.runs: list[tuple[str, str, tuple[Any, ...]]] = []
        runs = self.runs
        # Unique names: the send_task publish hook looks tasks up by name in every
        # installed app, and apps of earlier tests linger.
        prefix = f"canvas.{uuid.uuid4().hex[:8]}"

        @app.task(base=DedupTask, dedup_key="a:{x}", bind=True, shared=False, name=f"{prefix}.a")
        def a(self: Any, x: int) -> int:
            runs.append(("a", self.request.id, (x,)))
            return x * 10

        @app.task(base=DedupTask, dedup_key="b:{y}", bind=True, shared=False, name=f"{prefix}.b")
        def b(self: Any, y: int) -> int:
            runs.append(("b", self.request.id, (y,)))
            return y + 1

        @app.task(base=DedupTask, bind=True, shared=False, name=f"{prefix}.total")
        def total(self: Any, values: list[int]) -> int:
            runs.append(("total", self.request.id, (values,)))
            return sum(values)

        self.a, self.b, self.total = a, b, total

    def ran(self, name: str) -> list[str]:
        """Task ids of the runs of ``name``, in order."""
        return [task_id for task, task_id, _ in self.runs if task == name]


def _charge(order_id: int) -> int:
    return order_id


def message_ids(client: redis.Redis) -> list[str]:
    return [m["headers"]["id"] for m in queued_messages(client)]


def test_signature_calls_are_gated(make_app: AppFactory, r: redis.Redis) -> None:
    """``.s().apply_async()`` and ``.si().delay()`` go through the gate like ``.delay()``."""
    app = make_app()
    tasks = Tasks(app)

    first = tasks.a.s(1).apply_async()
    second = tasks.a.si(1).delay()
    third = tasks.a.s().apply_async((1,))

    assert isinstance(first, DedupResult) and isinstance(second, DedupResult) and isinstance(third, DedupResult)
    assert (first.deduplicated, second.deduplicated, third.deduplicated) == (False, True, True)
    assert second.id == third.id == first.id
    assert message_ids(r) == [first.id]
    with in_process_worker(app):
        assert second.get(timeout=10) == 10
    assert tasks.ran("a") == [first.id]
    assert r.scard(HELD) == 0


def test_last_outcome_follows_a_duplicate_answered_before_the_gate(make_app: AppFactory) -> None:
    """A duplicate of a key seen held lately is answered before any publish: still the latest outcome."""
    tasks = Tasks(make_app())

    first = tasks.a.delay(1)
    other = tasks.a.delay(2)
    again = tasks.a.delay(1)
    outcome = celery_dedup.last_outcome()

    assert again.deduplicated and other.id != first.id
    assert outcome is not None and (outcome.accepted, outcome.task_id) == (False, first.id)


def test_send_task_by_name_is_gated_by_the_publish_hook(make_app: AppFactory, r: redis.Redis) -> None:
    """``app.send_task`` never calls apply_async; the publish hook still lets only one message through."""
    app = make_app()
    tasks = Tasks(app)

    first = app.send_task(tasks.a.name, args=(3,))
    outcome = celery_dedup.last_outcome()
    assert outcome is not None and outcome.accepted and outcome.task_id == first.id
    second = app.send_task(tasks.a.name, kwargs={"x": 3})
    outcome = celery_dedup.last_outcome()

    assert outcome is not None
    assert (outcome.accepted, outcome.task_id) == (False, first.id)
    assert message_ids(r) == [first.id]
    assert second.id != first.id, "send_task cannot hand back the accepted id; last_outcome() does"
    record = tasks.a.dedup_status(3)
    assert record is not None and (record.task_id, record.duplicates) == (first.id, 1)
    with in_process_worker(app):
        assert AsyncResult(first.id, app=app).get(timeout=10) == 30
    assert tasks.ran("a") == [first.id]
    assert r.scard(HELD) == 0


def test_send_task_is_gated_by_the_publishing_app_not_another_with_the_same_task(
    make_app: AppFactory, server: Server, r: redis.Redis
) -> None:
    """Other installed apps registering the same task name must not decide how this app's send_task is gated.

    The others are on a non-Redis broker and one of them is current, as a second
    app in a Django process might be; the publishing app's broker is Redis, so
    its publishes must be gated. Several rounds of fresh apps, so a lookup that
    picks among the apps by chance cannot pass by luck.
    """
    previous = cast(Any, celery.current_app)._get_current_object()  # the app behind the proxy
    for round_ in range(4):
        shop = make_app("shop")
        others = [make_app(f"other{i}", broker_url="memory://", dedup_redis_url=server.url) for i in range(3)]
        name = f"canvas.{uuid.uuid4().hex[:8]}.charge"
        for app in (shop, *others):
            app.task(base=DedupTask, dedup_key="order:{order_id}", shared=False, name=name)(_charge)
        others[0].set_current()
        try:
            first = shop.send_task(name, (round_,))
            shop.send_task(name, (round_,))
        finally:
            previous.set_current()
        assert message_ids(r) == [first.id], f"round {round_}: the second send_task was not gated"
        r.delete("celery")


def test_send_task_with_a_countdown_holds_the_key_until_it_is_due(make_app: AppFactory, r: redis.Redis) -> None:
    """A keyed task published by name with a countdown longer than its TTL keeps its key until it can run.

    The key is held for dedup_ttl past the message's due time, as with apply_async.
    """
    app = make_app()

    @app.task(base=DedupTask, dedup_key="order:{order_id}", dedup_ttl=1, shared=False, name="canvas.due")
    def due(order_id: int) -> None: ...

    app.send_task("canvas.due", (1,), countdown=5)
    record = due.dedup_status(1)
    assert record is not None
    held_for_ms = int(record.fields["held_until"]) - int(record.fields["queued_at"])
    assert 5500 <= held_for_ms <= 6500, held_for_ms
    time.sleep(1.5)  # past dedup_ttl from now, but not past the due time
    again = app.send_task("canvas.due", (1,), countdown=5)
    assert len(message_ids(r)) == 1, f"the key expired before its message was due ({again.id})"


def test_chain_of_keyed_tasks_runs_and_releases_both_keys(make_app: AppFactory, r: redis.Redis) -> None:
    """A chain's first link is gated at the caller, the next one on the worker; both run once and settle."""
    app = make_app()
    tasks = Tasks(app)

    with in_process_worker(app):
        result = chain(tasks.a.s(1), tasks.b.s()).apply_async()
        assert result.get(timeout=10) == 11
    assert [(name, args) for name, _, args in tasks.runs] == [("a", (1,)), ("b", (10,))]
    assert r.scard(HELD) == 0
    assert getattr(tasks.a.dedup_status(1), "state", None) == "succeeded"
    assert getattr(tasks.b.dedup_status(10), "state", None) == "succeeded"


def test_group_with_a_duplicate_member_publishes_once_per_key(make_app: AppFactory, r: redis.Redis) -> None:
    """group(a(1), a(1), a(2)): two messages, each key run once; the duplicate member follows a(1)'s run."""
    app = make_app()
    tasks = Tasks(app)

    result = group(tasks.a.s(1), tasks.a.s(1), tasks.a.s(2)).apply_async()

    assert isinstance(result, GroupResult)
    ids = message_ids(r)
    assert len(ids) == 2
    accepted = {m["headers"]["id"]: m["headers"]["argsrepr"] for m in queued_messages(r)}
    assert sorted(accepted.values()) == ["(1,)", "(2,)"]
    with in_process_worker(app):
        assert result.get(timeout=10) == [10, 10, 20]
    assert sorted(tasks.ran("a")) == sorted(ids)


def test_group_duplicate_member_resolves_with_the_accepted_runs_result(make_app: AppFactory, r: redis.Redis) -> None:
    """Celery fixes each member's id before publishing and waits for exactly those ids: the duplicate
    member keeps its own id, which resolves as the accepted run ends (it follows it)."""
    app = make_app()
    tasks = Tasks(app)
    result = group(tasks.a.s(1), tasks.a.s(1)).apply_async()
    assert isinstance(result, GroupResult)
    first, duplicate = result.results
    with in_process_worker(app):
        assert (first.get(timeout=10), duplicate.get(timeout=10)) == (10, 10)
    assert tasks.ran("a") == [first.id]


def test_chord_over_distinct_keys_completes(make_app: AppFactory, r: redis.Redis) -> None:
    """A chord whose header members and body are keyed tasks runs every part once and frees every key."""
    app = make_app()
    tasks = Tasks(app)

    with in_process_worker(app):
        result = chord([tasks.a.s(1), tasks.a.s(2), tasks.a.s(3)], tasks.total.s()).apply_async()
        assert result.get(timeout=15) == 60
    assert sorted(args for name, _, args in tasks.runs if name == "a") == [(1,), (2,), (3,)]
    assert [args for name, _, args in tasks.runs if name == "total"] == [([10, 20, 30],)]
    assert r.scard(HELD) == 0


def test_chord_with_a_duplicate_header_member_still_fires_its_body(make_app: AppFactory, r: redis.Redis) -> None:
    """chord([a(1), a(1), a(2)], total): the duplicate member follows a(1)'s run and counts; the body fires once."""
    app = make_app()
    tasks = Tasks(app)

    # Dispatched before the worker starts, so the second a(1) meets the first still queued.
    result = chord([tasks.a.s(1), tasks.a.s(1), tasks.a.s(2)], tasks.total.s()).apply_async()
    assert len(message_ids(r)) == 2, "the duplicate member is parked as a follower, not queued"
    with in_process_worker(app):
        assert result.get(timeout=10) == 40
    assert r.scard(HELD) == 0


def test_worker_side_chain_dispatch_of_a_duplicate_does_not_fail_the_parent(
    make_app: AppFactory, r: redis.Redis
) -> None:
    """With on_duplicate="raise", a chain link whose key is already held is answered, not raised, on the worker.

    Raising there would turn the parent task, which did succeed, into a failure.
    """
    app = make_app(dedup_on_duplicate="raise")
    tasks = Tasks(app)
    # Far in the future: the worker holds this message unrun while the chain needs its key.
    pending = tasks.b.apply_async((10,), countdown=300)

    with in_process_worker(app):
        result = chain(tasks.a.s(1), tasks.b.s()).apply_async()
        parent = result.parent
        assert isinstance(parent, AsyncResult)
        assert parent.get(timeout=10) == 10
        assert parent.state == "SUCCESS"
        record = tasks.b.dedup_status(10)
        assert tasks.ran("b") == []
    assert tasks.ran("a") == [parent.id]
    assert record is not None
    assert (record.task_id, record.duplicates) == (pending.id, 1)
    assert r.sismember(HELD, member_for(tasks.b.name, "b:10"))
    assert result.id not in message_ids(r), "the chained link must not be enqueued beside the pending run"


def test_retry_with_changed_args_keeps_the_original_key(make_app: AppFactory, r: redis.Redis) -> None:
    """``self.retry(args=...)`` re-publishes under the key of the first call, not one derived from the new args."""
    app = make_app()
    seen: list[tuple[int, str, set[Any]]] = []

    @app.task(base=DedupTask, dedup_key="job:{n}", bind=True, shared=False, max_retries=1)
    def renumber(self: Any, n: int) -> int:
        seen.append((n, self.request.id, set(r.smembers(HELD))))
        if self.request.retries == 0:
            raise self.retry(args=(n + 100,), countdown=0)
        return n

    original = member_for(renumber.name, "job:1").encode()
    with in_process_worker(app):
        result = renumber.delay(1)
        assert result.get(timeout=10) == 101
    assert [(n, task_id) for n, task_id, _ in seen] == [(1, result.id), (101, result.id)]
    assert seen[1][2] == {original}, "while the retry runs, only the original key is held"
    record = renumber.dedup_status(1)
    assert record is not None and (record.task_id, record.state) == (result.id, "succeeded")
    assert renumber.dedup_status(101) is None
    assert r.scard(HELD) == 0
