"""The non-atomic gate takes back its hold only for a publish that handed nothing over.

It holds the key, then publishes, and drops the key if publishing raised. In
eager mode (``task_always_eager``) publishing *is* running: the task executes
inside it, and ``task_eager_propagates`` (or a raising ``on_success``
handler) re-raises from there. On a broker, an error can arrive after the
broker took the message. Neither is a failed publish; only an error before
the run began or the message left may undo the hold.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import pytest
import redis
from celery import Celery, signals, states
from kombu.exceptions import EncodeError

from celery_dedup import DedupTask, runtime
from celery_dedup.keys import KeySchema, member_for

from ..conftest import AppFactory, Server

HELD = KeySchema("dedup").held


def failing_task(app: Celery, attempts: list[str]) -> Any:
    """A keyed task that records its run's id and raises ``ValueError(order_id)`` for odd ids."""

    @app.task(
        base=DedupTask, dedup_key="order:{order_id}", bind=True, shared=False, name=f"eager.{uuid.uuid4().hex[:8]}"
    )
    def charge(self: Any, order_id: int) -> int:
        attempts.append(self.request.id)
        if order_id % 2:
            raise ValueError(order_id)
        return order_id * 10

    return charge


def states_in_history(app: Celery, member: str) -> list[str]:
    """The states of ``member``'s history, oldest first."""
    return [entry.split()[1] for entry in reversed(runtime.store_for(app).history(member))]


def accepted(app: Celery, task_name: str) -> int:
    return runtime.stats(app).get(task_name, {}).get("accepted", 0)


@pytest.mark.parametrize("propagates", [False, True], ids=["kept", "propagated"])
def test_failed_eager_run_is_recorded_failed_whether_or_not_its_error_propagates(
    make_app: AppFactory, r: redis.Redis, propagates: bool
) -> None:
    """The run executed and failed: its record says so, its history stays, it still counts as accepted."""
    app = make_app(task_always_eager=True, task_eager_propagates=propagates)
    attempts: list[str] = []
    charge = failing_task(app, attempts)
    member = member_for(charge.name, "order:3")

    if propagates:
        with pytest.raises(ValueError, match="3"):
            charge.delay(3)
    else:
        assert isinstance(charge.delay(3).result, ValueError)

    [run_id] = attempts
    record = charge.dedup_status(3)
    assert record is not None, "the record of a run that executed was erased"
    assert (record.task_id, record.state) == (run_id, "failed")
    assert record.error == "ValueError: 3"
    assert states_in_history(app, member) == ["queued", "started", "failed"]
    assert accepted(app, charge.name) == 1
    assert not r.sismember(HELD, member), "a failed run releases its key, as on a worker"

    again = charge.apply_async((3,), throw=False)
    assert again.state == states.FAILURE
    assert attempts == [run_id, again.id]
    assert accepted(app, charge.name) == 2


class LoudOnSuccess(DedupTask):
    """A base whose ``on_success`` raises: Celery re-raises that in eager mode, after the run succeeded."""

    abstract = True

    def on_success(self, retval: Any, task_id: str, args: Any, kwargs: Any) -> None:
        raise RuntimeError("on_success handler broke")


def test_error_after_a_successful_eager_run_keeps_its_record(make_app: AppFactory, r: redis.Redis) -> None:
    """An error raised after the body returned (a broken on_success) does not turn the run into a failed publish."""
    app = make_app(task_always_eager=True)
    runs: list[str] = []

    @app.task(base=LoudOnSuccess, dedup_key="order:{order_id}", bind=True, shared=False, name="eager.loud")
    def settle(self: Any, order_id: int) -> int:
        runs.append(self.request.id)
        return order_id

    with pytest.raises(RuntimeError, match="on_success"):
        settle.delay(5)

    [run_id] = runs
    record = settle.dedup_status(5)
    assert record is not None and (record.task_id, record.state) == (run_id, "succeeded")
    assert states_in_history(app, member_for(settle.name, "order:5")) == ["queued", "started", "succeeded"]
    assert accepted(app, settle.name) == 1
    assert r.scard(HELD) == 0


def test_error_before_an_eager_run_begins_undoes_the_hold(make_app: AppFactory, r: redis.Redis) -> None:
    """Arguments the serializer refuses fail before anything runs: no key, no record, nothing counted."""
    app = make_app(task_always_eager=True, task_eager_propagates=True)
    runs: list[str] = []

    @app.task(base=DedupTask, dedup_key="order:{order_id}", shared=False, name="eager.unserialisable")
    def ship(order_id: int, parcel: Any = None) -> None:
        runs.append(str(order_id))

    with pytest.raises(EncodeError):
        ship.delay(6, object())

    assert runs == []
    assert ship.dedup_status(6) is None
    assert r.scard(HELD) == 0
    assert accepted(app, ship.name) == 0
    ship.delay(6)
    assert runs == ["6"]


@pytest.mark.parametrize("propagates", [False, True], ids=["kept", "propagated"])
def test_apply_async_many_in_eager_mode_records_each_run(
    make_app: AppFactory, r: redis.Redis, propagates: bool
) -> None:
    """The bulk call falls back to a loop in eager mode: each run is recorded as it ended.

    With propagation the first failing run's error ends the batch there, as a
    loop of ``delay`` would; the runs before it and the failed one are recorded.
    """
    app = make_app(task_always_eager=True, task_eager_propagates=propagates)
    attempts: list[str] = []
    charge = failing_task(app, attempts)
    calls: list[tuple[tuple[int, ...], dict[str, Any]]] = [((2,), {}), ((3,), {}), ((4,), {})]

    if propagates:
        with pytest.raises(ValueError, match="3"):
            charge.apply_async_many(calls)
        expected = {2: "succeeded", 3: "failed", 4: None}
    else:
        results = charge.apply_async_many(calls)
        assert [result.state for result in results] == [states.SUCCESS, states.FAILURE, states.SUCCESS]
        assert [result.deduplicated for result in results] == [False, False, False]
        expected = {2: "succeeded", 3: "failed", 4: "succeeded"}

    found = {order_id: getattr(charge.dedup_status(order_id), "state", None) for order_id in expected}
    assert found == expected
    assert states_in_history(app, member_for(charge.name, "order:3")) == ["queued", "started", "failed"]
    assert accepted(app, charge.name) == len(attempts) == sum(state is not None for state in expected.values())
    assert r.scard(HELD) == 0


class Interrupted(BaseException):
    """An interrupt arriving in the publisher just after the broker took the message."""


def test_error_after_the_broker_took_the_message_keeps_the_key(
    make_app: AppFactory, server: Server, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """On a non-Redis broker, an error raised once the message is enqueued leaves key, record and message together.

    Celery sends ``after_task_publish`` after ``producer.publish`` returned; a
    receiver raising a BaseException (Celery's signal only swallows Exception)
    interrupts the publisher there, as a KeyboardInterrupt would.
    """
    app = make_app(
        broker_url="memory://",
        dedup_redis_url=server.url,
        task_default_queue=f"handed-{uuid.uuid4().hex[:8]}",
    )
    assert not runtime.runtime_for(app).atomic
    attempts: list[str] = []
    charge = failing_task(app, attempts)

    def interrupt(sender: str | None = None, **_: Any) -> None:
        if sender == charge.name:
            raise Interrupted()

    signals.after_task_publish.connect(interrupt, weak=False)
    try:
        with caplog.at_level(logging.WARNING, logger="celery_dedup"), pytest.raises(Interrupted):
            charge.delay(8)
    finally:
        signals.after_task_publish.disconnect(interrupt)

    with app.connection_for_read() as conn:
        channel: Any = conn.default_channel
        message = channel.basic_get(app.conf.task_default_queue, no_ack=True)
    assert message is not None, "the message was enqueued"
    record = charge.dedup_status(8)
    assert record is not None, "the record of an enqueued message was erased"
    assert (record.task_id, record.state) == (message.headers["id"], "queued")
    assert r.sismember(HELD, member_for(charge.name, "order:8")), "the key of an enqueued message was dropped"
    assert accepted(app, charge.name) == 1
    assert any("publishing raised afterwards" in rec.getMessage() for rec in caplog.records)
    assert charge.delay(8).deduplicated, "a second call would enqueue the work again"
