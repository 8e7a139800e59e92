"""A run is accepted once: replays of its publish or its message never run it again.

Each test here reproduces a way an adversarial review made one run execute
twice: a publish whose reply was lost and that kombu retried after the run had
finished; a caller who passes the same ``task_id`` twice; an operator who
purges finished records while a deferred copy of one of them is on its way.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import pytest
import redis
from celery import Celery
from kombu.utils.json import dumps, loads

from celery_dedup import DedupTask, operations
from celery_dedup.keys import KeySchema, member_for
from celery_dedup.store.schema import STATES
from celery_dedup.store.scripts import load_script
from celery_dedup.store.store import DedupStore
from chaos.proxy import FaultProxy

from ..conftest import AppFactory, Server, in_process_worker, queued_messages, wait_for

SCHEMA = KeySchema("dedup")


def runs_key(name: str) -> str:
    return f"identity:runs:{name}"


def register(app: Celery, **options: Any) -> Any:
    """``charge(order_id, seconds)``: appends its task id to a list in Redis, sleeps, returns the id."""
    client = redis.Redis.from_url(str(app.conf.broker_url))

    @app.task(base=DedupTask, name="identity.charge", dedup_key="order:{order_id}", bind=True, shared=False, **options)
    def charge(self: DedupTask, order_id: int, seconds: float = 0.0) -> str:
        client.rpush(runs_key(str(order_id)), str(self.request.id))
        time.sleep(seconds)
        return str(self.request.id)

    return charge


def executions(r: redis.Redis, order_id: int) -> list[str]:
    return [raw.decode() for raw in r.lrange(runs_key(str(order_id)), 0, -1)]


@pytest.fixture
def proxy(server: Server, r: redis.Redis) -> Iterator[FaultProxy]:
    for name in ("gate", "finish", "start"):
        r.execute_command("SCRIPT", "LOAD", load_script(name))
    port = urlparse(server.url).port
    assert port is not None
    with FaultProxy(port) as fault_proxy:
        yield fault_proxy


def test_a_publish_retried_after_its_run_finished_pushes_nothing(
    make_app: AppFactory, server: Server, r: redis.Redis, proxy: FaultProxy
) -> None:
    """The gate accepts run A but its reply is held back; A runs and succeeds, run B takes
    the key and succeeds too; then the connection breaks and kombu retries A's publish.

    The retry carries A's publish nonce: the gate must recognise it although the
    record now names B, and push nothing. A executes once.
    """
    publisher = make_app("publisher", broker_url=proxy.url, result_backend=server.url)
    worker_app = make_app("worker")
    charge_via_proxy, charge = register(publisher), register(worker_app)
    proxy.arm("after", hold=True)
    outcome: dict[str, Any] = {}

    def publish() -> None:
        try:
            outcome["result"] = charge_via_proxy.delay(1)
        except Exception as exc:  # reported below
            outcome["error"] = exc

    thread = threading.Thread(target=publish)
    thread.start()
    try:
        assert proxy.fired.wait(20), "the gate never ran"
        with in_process_worker(worker_app, pool="threads", concurrency=2):
            wait_for(lambda: len(executions(r, 1)) == 1, 20, "run A to execute")
            member = member_for(charge.name, "order:1")
            wait_for(lambda: r.hget(SCHEMA.record(member), "state") == b"succeeded", 10, "run A to succeed")
            run_a = executions(r, 1)[0]
            second = charge.delay(1)
            assert not second.deduplicated and second.id != run_a, "the key is free after A succeeded"
            assert second.get(timeout=20) == second.id
            proxy.release()  # the held reply is cut now: kombu retries A's publish
            thread.join(20)
            assert not thread.is_alive()
            time.sleep(1.0)  # a re-pushed A would be fetched and run by now
            assert executions(r, 1) == [run_a, second.id], "A's retried publish must not run A again"
    finally:
        proxy.release()
        thread.join(20)
    assert "error" not in outcome, outcome
    assert outcome["result"].id == run_a
    assert queued_messages(r) == []


def test_a_caller_supplied_task_id_is_accepted_once(make_app: AppFactory, r: redis.Redis) -> None:
    """Two calls with the same ``task_id``: one message, the second call is the duplicate."""
    charge = register(make_app())
    first = charge.apply_async((2,), task_id="order-2-charge")
    second = charge.apply_async((2,), task_id="order-2-charge")
    assert (first.id, first.deduplicated) == ("order-2-charge", False)
    assert (second.id, second.deduplicated) == ("order-2-charge", True)
    assert [m["headers"]["id"] for m in queued_messages(r)] == ["order-2-charge"]
    member = member_for(charge.name, "order:2")
    assert r.hget(SCHEMA.record(member), "duplicates") == b"1"


def test_a_caller_supplied_task_id_of_a_finished_run_does_not_run_it_again(
    make_app: AppFactory, r: redis.Redis
) -> None:
    """Reusing the id of a run that already succeeded answers with that run; nothing is queued."""
    app = make_app()
    charge = register(app)
    with in_process_worker(app):
        first = charge.apply_async((3,), task_id="order-3-charge")
        assert first.get(timeout=20) == "order-3-charge"
        member = member_for(charge.name, "order:3")
        wait_for(lambda: r.hget(SCHEMA.record(member), "state") == b"succeeded", 10, "the run to succeed")
        again = charge.apply_async((3,), task_id="order-3-charge")
        assert again.deduplicated and again.id == "order-3-charge"
        time.sleep(0.5)
    assert executions(r, 3) == ["order-3-charge"]
    assert queued_messages(r) == []


def test_a_deferred_copy_of_a_finished_run_is_skipped_after_an_operator_purge(
    make_app: AppFactory, r: redis.Redis
) -> None:
    """A copy of a running message is deferred; the run succeeds; an operator purges
    succeeded records; then the deferred copy arrives. It must be skipped, not run.
    """
    app = make_app(dedup_lock_ttl=3, task_acks_late=True)
    charge = register(app)
    member = member_for(charge.name, "order:4")
    with in_process_worker(app, pool="threads", concurrency=2):
        run = charge.delay(4, 1.0)
        wait_for(lambda: r.hget(SCHEMA.record(member), "state") == b"started", 10, "the run to start")
        raw = r.hvals("unacked")[0]  # the message the worker holds: push the very same copy again
        message, _, _ = loads(raw)
        assert message["headers"]["id"] == run.id
        r.lpush("celery", dumps(message))
        wait_for(lambda: int(r.hget(SCHEMA.record(member), "skipped") or 0) >= 1, 10, "the copy to be deferred")
        assert run.get(timeout=20) == run.id
        wait_for(lambda: r.hget(SCHEMA.record(member), "state") == b"succeeded", 10, "the run to be recorded")
        report = operations.purge(app, states=("succeeded",))
        assert report.purged == 1
        assert not any(r.zcard(SCHEMA.state_index(s)) for s in STATES), "a purged record leaves the listings"
        # The deferred copy arrives once the lock it found would have expired (about 3-4 s).
        wait_for(
            lambda: not queued_messages(r) and not r.hlen("unacked") and not r.zcard("unacked_index"),
            20,
            "the deferred copy to be delivered",
        )
        time.sleep(0.5)
    assert executions(r, 4) == [run.id], "the deferred copy ran the finished run again"


def test_a_copy_of_an_ended_ungated_run_is_skipped_after_another_run_took_the_record(
    make_app: AppFactory, r: redis.Redis
) -> None:
    """while_executing has no gate, so its record passes to whichever run starts next. A copy
    of a run that ended (a redelivery, a manual re-push) must still be skipped, not run again.
    """
    app = make_app()
    client = redis.Redis.from_url(str(app.conf.broker_url))

    @app.task(
        base=DedupTask,
        name="identity.exclusive",
        dedup_key="x:{n}",
        dedup_mode="while_executing",
        bind=True,
        shared=False,
    )
    def exclusive(self: DedupTask, n: int) -> str:
        client.rpush(runs_key(f"x{n}"), str(self.request.id))
        return str(self.request.id)

    first = exclusive.delay(1)
    copy = r.lindex("celery", 0)
    assert copy is not None
    with in_process_worker(app):
        assert first.get(timeout=20) == first.id
        second = exclusive.delay(1)
        assert second.get(timeout=20) == second.id
        member = member_for(exclusive.name, "x:1")
        assert r.hget(SCHEMA.record(member), "task_id") == second.id.encode()
        r.lpush("celery", copy)
        wait_for(lambda: int(r.hget(SCHEMA.record(member), "skipped") or 0) == 1, 10, "the copy to be skipped")
    assert [raw.decode() for raw in r.lrange(runs_key("x1"), 0, -1)] == [first.id, second.id]


def test_a_run_whose_hold_expired_before_it_ran_is_recorded_when_another_run_takes_its_key(
    r: redis.Redis,
) -> None:
    """Its record is replaced by the next run's: the key's history says what became of it."""
    store = DedupStore(r, "dedup")
    member = "identity.task:k"
    store.gate(member, "A", "n-a", hold_ms=50, grace_ms=60_000)
    time.sleep(0.1)
    outcome = store.gate(member, "B", "n-b", hold_ms=60_000, grace_ms=60_000)
    assert outcome.accepted and outcome.task_id == "B"
    newest_first = [entry.split(" ", 1)[1] for entry in store.history(member)]
    assert newest_first == ["queued B", "lost A expired; taken over", "queued A"]
    assert not r.exists(f"{SCHEMA.prefix}:hist:{member}"), "the history lives in the record (format 2)"
