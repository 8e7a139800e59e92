"""The non-atomic gate (non-Redis broker, separate dedup server, eager mode) and the Redis-error policies."""

from __future__ import annotations

import gc
import logging
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery, signals
from kombu.exceptions import ConnectionError as BrokerConnectionError
from kombu.exceptions import OperationalError
from kombu.transport import memory

from celery_dedup import DedupResult, DedupTask, DedupUnavailableError, runtime
from celery_dedup.header import GateHeader
from celery_dedup.keys import KeySchema, member_for
from celery_dedup.testing import free_port

from ..conftest import AppFactory, Server, in_process_worker, queued_messages, wait_for

HELD = KeySchema("dedup").held
# Publishing to a dead broker must give up quickly instead of retrying for seconds.
FAST_GIVE_UP = {"max_retries": 1, "interval_start": 0, "interval_step": 0.01, "interval_max": 0.01}


@pytest.fixture(autouse=True)
def _collect_results_while_server_runs() -> Iterator[None]:
    # Logged connection errors keep their frames, and so pending results, in
    # reference cycles; collected after the session server stops, each result's
    # __del__ would fail to unsubscribe from it.
    yield
    gc.collect()


class BrokerRefused(Exception):
    """What the patched memory broker raises: not a connection error, so kombu does not retry it."""


def keyed_task(app: Celery, name: str | None = None, **options: Any) -> Any:
    """A keyed task recording the id of every run.

    Its name is unique unless given: the send_task publish hook looks tasks up
    by name across every installed app, and apps of earlier tests linger.
    """
    calls: list[str] = []
    name = name or f"fallback.{uuid.uuid4().hex[:8]}.charge"

    @app.task(base=DedupTask, dedup_key="order:{order_id}", bind=True, shared=False, name=name, **options)
    def task(self: Any, order_id: int, amount: int = 0) -> int:
        calls.append(self.request.id)
        return order_id * 10

    task.calls = calls
    return task


def memory_app(make_app: AppFactory, server: Server, **conf: Any) -> Celery:
    """An app on the in-process memory broker, keeping dedup state on the test server.

    The memory broker's queues are process-global, so each app gets its own queue.
    """
    return make_app(
        broker_url="memory://",
        dedup_redis_url=server.url,
        task_default_queue=f"fallback-{uuid.uuid4().hex[:8]}",
        broker_transport_options={"polling_interval": 0.05},
        **conf,
    )


def memory_queue_size(app: Celery) -> int:
    with app.connection_for_read() as conn:
        channel: Any = conn.default_channel
        declared = channel.queue_declare(app.conf.task_default_queue)
        return int(declared.message_count)


def drain_memory_queue(app: Celery) -> list[dict[str, Any]]:
    """Take every message off the app's memory queue; return their headers."""
    headers = []
    with app.connection_for_read() as conn:
        channel: Any = conn.default_channel
        while (message := channel.basic_get(app.conf.task_default_queue, no_ack=True)) is not None:
            headers.append(dict(message.headers))
    return headers


def test_memory_broker_duplicate_is_suppressed_and_key_released_after_run(
    make_app: AppFactory, server: Server, r: redis.Redis
) -> None:
    """On a non-Redis broker the hold-then-publish gate still lets one message through per key."""
    app = memory_app(make_app, server)
    assert not runtime.runtime_for(app).atomic
    charge = keyed_task(app)
    member = member_for(charge.name, "order:42")

    first = charge.delay(42, 10)
    second = charge.delay(order_id=42)

    assert isinstance(first, DedupResult) and isinstance(second, DedupResult)
    assert (first.deduplicated, second.deduplicated) == (False, True)
    assert second.id == first.id
    assert memory_queue_size(app) == 1
    assert r.smembers(HELD) == {member.encode()}
    record = charge.dedup_status(42)
    assert record is not None
    assert (record.task_id, record.state, record.duplicates) == (first.id, "queued", 1)

    with in_process_worker(app):
        assert first.get(timeout=10) == 420
    assert charge.calls == [first.id]
    assert r.scard(HELD) == 0
    assert getattr(charge.dedup_status(42), "state", None) == "succeeded"
    third = charge.delay(42)
    assert not third.deduplicated and third.id != first.id


def test_memory_broker_message_carries_the_dedup_header(make_app: AppFactory, server: Server) -> None:
    """The one queued message is the accepted run's, with the header the worker settles by."""
    app = memory_app(make_app, server)
    charge = keyed_task(app)
    first = charge.delay(7)
    charge.delay(7)
    headers = drain_memory_queue(app)
    assert [h["id"] for h in headers] == [first.id]
    gate = GateHeader.decode(headers[0])
    assert gate is not None and gate.member == member_for(charge.name, "order:7")


def _fail_put(monkeypatch: pytest.MonkeyPatch, exc: BaseException, times: int) -> list[str]:
    """Make the memory broker's ``_put`` raise ``exc`` for the next ``times`` calls."""
    original: Callable[..., Any] = memory.Channel._put
    failures: list[str] = []

    def put(self: memory.Channel, queue: str, message: Any, **kwargs: Any) -> Any:
        if len(failures) < times:
            failures.append(queue)
            raise exc
        return original(self, queue, message, **kwargs)

    monkeypatch.setattr(memory.Channel, "_put", put)
    return failures


def test_memory_broker_publish_refused_drops_the_key(
    make_app: AppFactory, server: Server, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A publish the broker refused leaves no key, no record, and no message behind."""
    app = memory_app(make_app, server)
    charge = keyed_task(app)
    failures = _fail_put(monkeypatch, BrokerRefused("refused"), 1)

    with pytest.raises(BrokerRefused):
        charge.delay(5)

    assert failures, "the broker was never asked to publish"
    assert r.scard(HELD) == 0
    assert charge.dedup_status(5) is None
    assert set(r.keys("dedup:*")) <= {b"dedup:stats", b"dedup:format"}, "nothing but the counters, the format"
    assert int(r.hget("dedup:stats", f"{charge.name}:accepted") or 0) == 0, "the acceptance was undone"
    monkeypatch.undo()
    assert memory_queue_size(app) == 0
    again = charge.delay(5)
    assert not again.deduplicated
    assert memory_queue_size(app) == 1
    assert getattr(charge.dedup_status(5), "task_id", None) == again.id


def test_memory_broker_down_for_good_keeps_the_key_for_the_publish_lease_only(
    make_app: AppFactory, server: Server, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kombu's retries end in a connection error: whether the broker took the message is unknown.

    The key stays ``publishing`` (a message that did arrive runs once) until
    the lease ends; then the next call is accepted.
    """
    app = memory_app(make_app, server, dedup_publish_lease=1)
    charge = keyed_task(app)
    _fail_put(monkeypatch, BrokerConnectionError("broker gone"), 100)

    with pytest.raises(OperationalError):
        charge.delay(5)

    status = charge.dedup_status(5)
    assert status is not None and status.state == "publishing"
    assert charge.delay(5).deduplicated, "within the lease the key is the failed publish's"
    monkeypatch.undo()
    later = wait_for(lambda: (c := charge.delay(5)) and not c.deduplicated and c, 10, "the lease to end")
    assert [h["id"] for h in drain_memory_queue(app)] == [later.id]


def test_memory_broker_publish_retried_by_kombu_keeps_one_key_and_one_message(
    make_app: AppFactory, server: Server, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transient broker error that kombu's retry recovers from: the key stays held for the one message."""
    app = memory_app(make_app, server)
    charge = keyed_task(app)
    failures = _fail_put(monkeypatch, BrokerConnectionError("blip"), 1)

    first = charge.delay(6)

    assert len(failures) == 1
    assert not first.deduplicated
    assert [h["id"] for h in drain_memory_queue(app)] == [first.id]
    assert r.smembers(HELD) == {member_for(charge.name, "order:6").encode()}
    assert getattr(charge.dedup_status(6), "task_id", None) == first.id


def dead_dedup_app(make_app: AppFactory, policy: str) -> Celery:
    """Broker on the test server, dedup store on a port nothing listens on: the non-atomic path."""
    return make_app(dedup_redis_url=f"redis://127.0.0.1:{free_port()}/0", dedup_on_redis_error=policy)


def test_non_atomic_fail_closed_raises_and_publishes_nothing(make_app: AppFactory, r: redis.Redis) -> None:
    """fail_closed with the dedup store down: a typed error naming task and key, and no message."""
    app = dead_dedup_app(make_app, "fail_closed")
    assert not runtime.runtime_for(app).atomic
    charge = keyed_task(app)

    with pytest.raises(DedupUnavailableError) as info:
        charge.delay(9)

    assert info.value.task == charge.name
    assert info.value.key == "order:9"
    assert isinstance(info.value.cause, redis.ConnectionError)
    assert info.value.published is False
    assert charge.name in str(info.value) and "order:9" in str(info.value)
    assert queued_messages(r) == []
    assert runtime.runtime_for(app).fail_open[charge.name] == 0


def test_non_atomic_fail_open_publishes_ungated_logs_and_counts(
    make_app: AppFactory, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """fail_open with the dedup store down: each call is published without a gate header, logged, counted per task."""
    app = dead_dedup_app(make_app, "fail_open")
    charge = keyed_task(app)
    refund = keyed_task(app)

    with caplog.at_level(logging.WARNING, logger="celery_dedup"):
        first = charge.delay(9)
        second = charge.delay(9)
        other = refund.delay(9)

    messages = queued_messages(r)
    assert sorted(m["headers"]["id"] for m in messages) == sorted([first.id, second.id, other.id])
    assert all(GateHeader.decode(m["headers"]) is None for m in messages), "published without a gate header"
    assert first.id != second.id, "ungated calls are separate runs"
    assert not first.deduplicated and not second.deduplicated
    counts = runtime.runtime_for(app).fail_open
    assert (counts[charge.name], counts[refund.name]) == (2, 1)
    warnings = [rec for rec in caplog.records if rec.levelno == logging.WARNING and "fail_open" in rec.getMessage()]
    assert len(warnings) == 3
    assert first.id in warnings[0].getMessage() and "order:9" in warnings[0].getMessage()
    assert set(r.keys("dedup:*")) <= {b"dedup:stats", b"dedup:format"}, "nothing but the counters, the format"
    assert int(r.hget("dedup:stats", f"{charge.name}:accepted") or 0) == 0, "the acceptance was undone"


def test_ungated_run_finishes_without_touching_the_dedup_store(make_app: AppFactory, r: redis.Redis) -> None:
    """A message published under fail_open runs normally on a worker even though its store is still down."""
    app = dead_dedup_app(make_app, "fail_open")
    charge = keyed_task(app)
    result = charge.delay(3)
    with in_process_worker(app):
        assert result.get(timeout=10) == 30
    assert charge.calls == [result.id]


def dead_broker_app(make_app: AppFactory, policy: str) -> Celery:
    """Broker (and so the dedup store) on a port nothing listens on: the atomic path."""
    dead = f"redis://127.0.0.1:{free_port()}/0"
    return make_app(
        broker_url=dead,
        dedup_on_redis_error=policy,
        task_publish_retry_policy=FAST_GIVE_UP,
        broker_connection_timeout=1,
    )


@pytest.mark.parametrize("policy", ["fail_closed", "fail_open"])
def test_atomic_path_broker_down_raises_unavailable_under_either_policy(
    make_app: AppFactory, caplog: pytest.LogCaptureFixture, policy: str
) -> None:
    """On the Redis broker the store is the broker: a dead server gives DedupUnavailableError, never an ungated retry.

    fail_open governs only a separate store; re-publishing here could enqueue a
    run whose gated publish did reach the server.
    """
    app = dead_broker_app(make_app, policy)
    assert runtime.runtime_for(app).atomic
    charge = keyed_task(app)
    published: list[dict[str, Any]] = []

    def record(sender: str | None = None, headers: dict[str, Any] | None = None, **_: Any) -> None:
        if sender == charge.name and headers is not None:
            published.append(dict(headers))

    # Connected after install, so it sees the headers as the library's own hook left them.
    signals.before_task_publish.connect(record, weak=False)
    try:
        with caplog.at_level(logging.WARNING, logger="celery_dedup"), pytest.raises(DedupUnavailableError) as info:
            charge.delay(11)
    finally:
        signals.before_task_publish.disconnect(record)

    assert (info.value.task, info.value.key) == (charge.name, "order:11")
    assert isinstance(info.value.cause, OperationalError)
    assert info.value.published is not True
    assert len(published) == 1, "one gated publish attempt, no ungated re-publish"
    assert GateHeader.decode(published[0]) is not None
    assert runtime.runtime_for(app).fail_open[charge.name] == 0
    assert not [rec for rec in caplog.records if "fail_open" in rec.getMessage()]


def test_eager_calls_run_inline_and_release_the_key(make_app: AppFactory, r: redis.Redis) -> None:
    """task_always_eager: each call runs inline; the key is released when it returns, so a later call runs again."""
    app = make_app(task_always_eager=True)
    charge = keyed_task(app)
    member = member_for(charge.name, "order:8")

    first = charge.delay(8)
    assert first.get(timeout=1) == 80
    assert charge.calls == [first.id]
    assert r.scard(HELD) == 0
    assert getattr(charge.dedup_status(8), "state", None) == "succeeded"

    second = charge.delay(8)
    assert second.get(timeout=1) == 80
    assert charge.calls == [first.id, second.id]
    assert second.id != first.id
    assert not r.sismember(HELD, member)
    assert queued_messages(r) == []


def test_eager_result_says_it_was_not_a_duplicate(make_app: AppFactory) -> None:
    """An accepted eager call returns a result with ``deduplicated=False``, like every other accepted call."""
    charge = keyed_task(make_app(task_always_eager=True))
    result = charge.delay(8)
    assert charge.calls == [result.id]
    assert getattr(result, "deduplicated", None) is False, f"{type(result).__name__} has no 'deduplicated' flag"


def test_eager_failure_releases_the_key(make_app: AppFactory, r: redis.Redis) -> None:
    """An eager run that raises records the failure and frees the key for the next call."""
    app = make_app(task_always_eager=True)
    attempts: list[str] = []

    @app.task(base=DedupTask, dedup_key="order:{order_id}", bind=True, shared=False)
    def broken(self: Any, order_id: int) -> None:
        attempts.append(self.request.id)
        raise ValueError(order_id)

    first = broken.delay(2)
    assert isinstance(first.result, ValueError)
    assert r.scard(HELD) == 0
    assert getattr(broken.dedup_status(2), "state", None) == "failed"
    second = broken.delay(2)
    assert attempts == [first.id, second.id]


def test_eager_call_is_a_duplicate_of_a_queued_run(make_app: AppFactory, r: redis.Redis) -> None:
    """An eager call whose key a queued (non-eager) run holds does not run; it gets the queued run's id."""
    queued_app = make_app("q")
    eager_app = make_app("e", task_always_eager=True)
    name = f"fallback.{uuid.uuid4().hex[:8]}.charge"
    queued = keyed_task(queued_app, name).delay(4)
    eager = keyed_task(eager_app, name)

    duplicate = eager.delay(4)

    assert eager.calls == []
    assert duplicate.id == queued.id
    assert getattr(duplicate, "deduplicated", None) is True
    assert getattr(eager.dedup_status(4), "task_id", None) == queued.id
    assert [m["headers"]["id"] for m in queued_messages(r)] == [queued.id]
