"""The atomic gate on the Redis broker: one key, one message, one accepted id."""

from __future__ import annotations

import gc
import logging
from importlib.metadata import version
from typing import Any

import celery.exceptions
import pytest
import redis
from celery import Celery
from kombu import Exchange, Queue

from celery_dedup import DedupResult, DedupRoutingError, DedupTask, DuplicateTaskError, runtime
from celery_dedup.keys import KeySchema

from ..conftest import AppFactory, in_process_worker, queued_messages

HELD = KeySchema("dedup").held


def charge_task(app: Celery, **options: Any) -> Any:
    @app.task(base=DedupTask, dedup_key="order:{order_id}", shared=False, **options)
    def charge(order_id: int, amount: int = 0) -> int:
        return order_id * 10

    return charge


def test_duplicate_gets_accepted_id_and_no_second_message(make_app: AppFactory, r: redis.Redis) -> None:
    charge = charge_task(make_app())

    first = charge.delay(42, 10)
    second = charge.apply_async(kwargs={"amount": 10, "order_id": 42})
    other = charge.delay(43)

    assert first.id.startswith("order:42~")
    assert second.id == first.id
    assert (first.deduplicated, second.deduplicated, other.deduplicated) == (False, True, False)
    messages = queued_messages(r)
    assert sorted(m["headers"]["id"] for m in messages) == sorted([first.id, other.id])
    assert r.smembers(HELD) == {f"{charge.name}:order:42".encode(), f"{charge.name}:order:43".encode()}
    record = charge.dedup_status(42)
    assert record is not None
    assert record.task_id == first.id
    assert record.state == "queued"
    assert record.duplicates == 1


def test_new_run_after_finish_gets_its_own_id_and_result(make_app: AppFactory, r: redis.Redis) -> None:
    app = make_app()
    calls: list[int] = []

    @app.task(base=DedupTask, dedup_key="order:{order_id}", shared=False)
    def count(order_id: int) -> int:
        calls.append(order_id)
        return len(calls)

    with in_process_worker(app):
        first = count.delay(7)
        assert first.get(timeout=10) == 1
        second = count.delay(7)
        assert isinstance(second, DedupResult)
        assert not second.deduplicated
        assert second.id != first.id
        assert second.get(timeout=10) == 2
    assert calls == [7, 7]
    assert r.scard(HELD) == 0


def test_retrying_task_keeps_its_key_and_releases_after_final_failure(make_app: AppFactory, r: redis.Redis) -> None:
    app = make_app()
    attempts: dict[int, list[str]] = {}

    @app.task(base=DedupTask, dedup_key="job:{n}", bind=True, shared=False, max_retries=2)
    def flaky(self: Any, n: int, succeed_on: int) -> int:
        attempts.setdefault(n, []).append(self.request.id)
        if self.request.retries < succeed_on:
            raise self.retry(countdown=0)
        return self.request.retries

    with in_process_worker(app):
        ok = flaky.delay(1, 2)
        assert ok.get(timeout=15) == 2
        doomed = flaky.delay(2, 99)
        with pytest.raises(Exception, match=r"Can't retry"):
            doomed.get(timeout=15)
    assert attempts[1] == [ok.id] * 3, "both retries must be accepted as the same run"
    assert attempts[2] == [doomed.id] * 3
    assert r.scard(HELD) == 0, "success and final failure release the key"
    assert getattr(flaky.dedup_status(2, 99), "state", None) == "failed"
    assert getattr(flaky.dedup_status(1, 2), "state", None) == "succeeded"


@pytest.mark.parametrize("priority", [None, 0, 4, 9])
def test_message_lands_where_kombu_would_put_it(make_app: AppFactory, r: redis.Redis, priority: int | None) -> None:
    app = make_app()
    charge = charge_task(app)

    @app.task(shared=False)
    def plain(order_id: int) -> None: ...

    plain.apply_async((1,), priority=priority)  # type: ignore[arg-type]
    plain_keys = set(r.keys("celery*"))
    r.delete(*plain_keys)
    charge.apply_async((1,), priority=priority)
    assert set(r.keys("celery*")) == plain_keys


def test_global_keyprefix_is_honoured_end_to_end(make_app: AppFactory, r: redis.Redis) -> None:
    app = make_app(broker_transport_options={"global_keyprefix": "shop:"})
    charge = charge_task(app)
    first, second = charge.delay(5), charge.delay(5)
    assert second.id == first.id
    assert len(queued_messages(r, "shop:celery")) == 1
    assert r.llen("celery") == 0
    with in_process_worker(app):
        assert first.get(timeout=10) == 50


def test_raise_policy_carries_key_and_id(make_app: AppFactory) -> None:
    charge = charge_task(make_app(dedup_on_duplicate="raise"))
    first = charge.delay(1)
    with pytest.raises(DuplicateTaskError) as info:
        charge.delay(1)
    assert info.value.key == "order:1"
    assert info.value.task_id == first.id
    assert info.value.task == charge.name


def test_drop_policy_logs_and_marks(make_app: AppFactory, caplog: pytest.LogCaptureFixture) -> None:
    charge = charge_task(make_app(), dedup_on_duplicate="drop")
    first = charge.delay(1)
    with caplog.at_level(logging.INFO, logger="celery_dedup"):
        dropped = charge.delay(1)
    assert dropped.deduplicated and dropped.id == first.id
    assert any("order:1" in rec.getMessage() and first.id in rec.getMessage() for rec in caplog.records)


def test_routing_to_several_queues_is_refused_and_writes_nothing(make_app: AppFactory, r: redis.Redis) -> None:
    exchange = Exchange("orders", type="direct")
    app = make_app(task_queues=[Queue("a", exchange, routing_key="charge"), Queue("b", exchange, routing_key="charge")])
    charge = charge_task(app)
    with app.connection_for_write() as conn:
        for queue in app.conf.task_queues:
            queue.bind(conn.default_channel).declare()
    with pytest.raises(DedupRoutingError, match="2 queues"):
        charge.apply_async((1,), exchange="orders", routing_key="charge")
    assert r.scard(HELD) == 0
    assert r.llen("a") == r.llen("b") == 0


def test_producer_batch_is_refused(make_app: AppFactory, r: redis.Redis) -> None:
    app = make_app()
    charge = charge_task(app)
    with app.producer_or_acquire() as producer:
        if not hasattr(producer, "batch"):
            pytest.skip(f"kombu {version('kombu')} has no Producer.batch (it came with kombu 5.7)")
    with app.producer_or_acquire() as producer, pytest.raises(DedupRoutingError, match="batch"), producer.batch():
        charge.apply_async((1,), producer=producer)
    assert r.scard(HELD) == 0
    assert queued_messages(r) == []


# --- a duplicate this process has seen is answered before a message is built ----------------------


def _script_calls(client: redis.Redis) -> tuple[int, int]:
    """(SISMEMBER, SADD) calls so far: the peek script asks the first, the gate the second."""
    stats = client.info("commandstats")
    return (
        int(stats.get("cmdstat_sismember", {}).get("calls", 0)),
        int(stats.get("cmdstat_sadd", {}).get("calls", 0)),
    )


def test_a_known_duplicate_is_answered_by_a_peek(make_app: AppFactory, r: redis.Redis) -> None:
    app = make_app(task_ignore_result=True)
    charge = charge_task(app)
    first = charge.delay(1)
    before = _script_calls(r)
    second = charge.delay(1)
    after = _script_calls(r)
    assert (second.id, second.deduplicated) == (first.id, True)
    assert (after[0] - before[0], after[1] - before[1]) == (1, 0), "a peek, and no gate script"
    assert len(queued_messages(r)) == 1
    assert r.hget(f"dedup:rec:{charge.name}:order:1", "duplicates") == b"1"


def test_a_key_freed_since_it_was_seen_is_gated_again(make_app: AppFactory, r: redis.Redis) -> None:
    app = make_app(task_ignore_result=True)
    charge = charge_task(app)
    first = charge.delay(1)
    # Revoked before it ran, as a worker reports it: the key is freed.
    assert runtime.store_for(app).finish(
        f"{charge.name}:order:1", first.id, "revoked", drop=True, record_ms=1000, role="report"
    )[0]
    again = charge.delay(1)
    assert not again.deduplicated and again.id != first.id
    assert len(queued_messages(r)) == 2


def test_a_peeked_duplicate_follows_the_conflict_policy(make_app: AppFactory, r: redis.Redis) -> None:
    app = make_app(task_ignore_result=True)
    charge = charge_task(app, dedup_on_duplicate="raise")
    first = charge.delay(1)
    with pytest.raises(DuplicateTaskError) as raised:
        charge.delay(1)
    assert raised.value.task_id == first.id


def test_a_duplicates_result_and_the_accepted_ones_each_resolve(make_app: AppFactory) -> None:
    """Two result objects of one run (the accepted call's and a duplicate's) both see it end.

    The first one waits already (its ``get`` timed out while the message was
    queued) when the duplicate's result is asked, and the duplicate's result is
    dropped before the first one is asked again.
    """
    app = make_app()
    charge = charge_task(app)
    first = charge.delay(5)
    with pytest.raises(celery.exceptions.TimeoutError):
        first.get(timeout=0.2)
    second = charge.delay(5)
    assert second.deduplicated and second.id == first.id
    third = charge.delay(5)
    with in_process_worker(app):
        assert second.get(timeout=10) == 50
        del third
        gc.collect()
        assert first.get(timeout=10) == 50
    del first, second
    gc.collect()  # while the server runs: a result that goes unsubscribes from it
