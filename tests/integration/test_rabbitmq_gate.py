"""The two-phase gate on a real RabbitMQ node, with the dedup store on the session's Redis server.

Hold (a lease), publish with publisher confirms, confirm: each test attacks
one step, with real threads, a real SIGKILL, a broker that refuses, a
connection cut after the send, a broker stopped mid-call, and real workers.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from amqp.exceptions import MessageNacked
from celery import Celery
from kombu import Queue
from kombu.exceptions import OperationalError
from kombu.messaging import Producer

import celery_dedup
from celery_dedup import DedupTask, runtime
from celery_dedup.keys import KeySchema
from celery_dedup.store.status import Status
from tests.servers import RabbitMQNode

from .. import rabbitmq_app
from ..conftest import RabbitApps, Server, WorkerProcess, amqp_message_count, in_process_worker, wait_for

HELD = KeySchema("dedup").held
#: Celery's quorum-queue set-up with native delayed delivery (see test_rabbitmq.py).
QUORUM_DELAYED: dict[str, Any] = {
    "task_default_queue_type": "quorum",
    "task_default_exchange_type": "topic",
    "broker_native_delayed_delivery_queue_type": "quorum",
}


@pytest.fixture(autouse=True)
def _collect_results_while_server_runs() -> Iterator[None]:
    yield
    gc.collect()


def keyed(app: Celery, name: str, **options: Any) -> Any:
    """A keyed task appending ``<task id>`` to ``runs:<name>:<n>`` in Redis at each execution."""
    counter = redis.Redis.from_url(str(app.conf.result_backend))

    @app.task(base=DedupTask, dedup_key="n:{n}", bind=True, shared=False, name=name, **options)
    def task(self: Any, n: int, seconds: float = 0.0) -> int:
        counter.rpush(f"runs:{name}:{n}", self.request.id)
        time.sleep(seconds)
        return n

    return task


def runs(r: redis.Redis, task: Any, n: int) -> list[str]:
    return [entry.decode() for entry in r.lrange(f"runs:{task.name}:{n}", 0, -1)]


def history_text(status: Status | None) -> str:
    assert status is not None and status.history is not None
    return " | ".join(f"{entry.state} {entry.task_id} {entry.note}" for entry in status.history)


def test_rabbitmq_gets_the_two_phase_gate_and_publisher_confirms(make_rabbit_app: RabbitApps) -> None:
    app = make_rabbit_app()
    assert not runtime.runtime_for(app).atomic
    assert app.conf.broker_transport_options["confirm_publish"] is True


def test_sixteen_threads_racing_over_a_hundred_keys_publish_one_message_and_run_once_per_key(
    make_rabbit_app: RabbitApps, rabbitmq: RabbitMQNode, r: redis.Redis
) -> None:
    """16 threads each call each of 100 keys 5 times, in their own random order: 8,000 racing calls."""
    app = make_rabbit_app(task_ignore_result=True)
    task = keyed(app, "rabbit.race")
    answers: dict[int, set[str]] = {n: set() for n in range(100)}
    accepted: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(16)
    errors: list[BaseException] = []

    def caller(seed: int) -> None:
        calls = [n for n in range(100) for _ in range(5)]
        random.Random(seed).shuffle(calls)
        try:
            start.wait()
            for n in calls:
                result = task.delay(n)
                with lock:
                    answers[n].add(result.id)
                    if not result.deduplicated:
                        accepted.append(result.id)
        except BaseException as exc:  # reported below, with the thread's traceback
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(seed,)) for seed in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors[:3]
    assert all(len(ids) == 1 for ids in answers.values()), {n: ids for n, ids in answers.items() if len(ids) != 1}
    assert len(accepted) == 100, "one accepted call per key"
    assert amqp_message_count(rabbitmq.url, make_rabbit_app.queue) == 100, "one message per key"
    with in_process_worker(app, pool="threads", concurrency=4):
        wait_for(lambda: r.scard(HELD) == 0, 60, lambda: f"{r.scard(HELD)} keys still held")
    for n, ids in answers.items():
        assert runs(r, task, n) == sorted(ids), f"key {n}"


def _freeze_between_hold_and_publish(broker: str, store: str, queue: str, held: Any) -> None:
    """Child process: hold key n:3 of ``rabbit.killed``, then stop before the publish, until killed."""
    app = Celery("rabbit-child", broker=broker, backend=store, set_as_current=False)
    app.conf.update(dedup_redis_url=store, dedup_publish_lease=2, task_default_queue=queue)
    celery_dedup.install(app)
    task = keyed(app, "rabbit.killed")

    def frozen(self: Any, *args: Any, **kwargs: Any) -> None:
        held.set()
        time.sleep(60)

    Producer._publish = frozen  # type: ignore[method-assign]
    task.delay(3)


def test_a_producer_killed_between_hold_and_publish_frees_the_key_within_the_lease(
    make_rabbit_app: RabbitApps, rabbitmq: RabbitMQNode, server: Server, r: redis.Redis
) -> None:
    ctx = multiprocessing.get_context("spawn")
    held = ctx.Event()
    child = ctx.Process(
        target=_freeze_between_hold_and_publish,
        args=(rabbitmq.url, server.url, make_rabbit_app.queue, held),
        daemon=True,
    )
    child.start()
    try:
        assert held.wait(60), "the producer never reached its publish"
        app = make_rabbit_app()
        task = keyed(app, "rabbit.killed")
        status = task.dedup_status(3)
        assert status is not None and status.state == "publishing"
        os.kill(child.pid or 0, signal.SIGKILL)
        child.join(10)
    finally:
        if child.is_alive():
            child.kill()
    assert child.exitcode == -signal.SIGKILL
    dead_run = status.task_id

    assert task.delay(3).id == dead_run, "within the lease the key is the dead producer's"
    later = wait_for(lambda: (c := task.delay(3)) and not c.deduplicated and c, 10, "the lease to end")
    assert amqp_message_count(rabbitmq.url, make_rabbit_app.queue) == 1
    with in_process_worker(app):
        assert later.get(timeout=30) == 3
    assert runs(r, task, 3) == [later.id]
    assert f"lost {dead_run}" in history_text(task.dedup_status(3))


def test_a_publish_the_broker_nacks_frees_the_key_at_once(
    make_rabbit_app: RabbitApps, rabbitmq: RabbitMQNode, r: redis.Redis
) -> None:
    """A queue that refuses new messages (max length 0, reject-publish): the confirm is a nack."""
    full = Queue(make_rabbit_app.queue, queue_arguments={"x-max-length": 0, "x-overflow": "reject-publish"})
    app = make_rabbit_app(task_queues=[full])
    task = keyed(app, "rabbit.nacked")

    for _ in range(2):  # the second call is no duplicate of the refused one: it is gated, and refused, again
        with pytest.raises(Exception) as raised:
            task.delay(4)
        assert any(isinstance(error, MessageNacked) for error in causes(raised.value)), raised.value
        assert task.dedup_status(4) is None and r.scard(HELD) == 0, "no key, no record"


def causes(exc: BaseException) -> list[BaseException]:
    found: list[BaseException] = []
    cause: BaseException | None = exc
    while cause is not None and cause not in found:
        found.append(cause)
        cause = cause.__cause__ or cause.__context__
    return found


def test_a_publish_cut_after_the_send_keeps_the_lease_and_its_message_runs_once(
    make_rabbit_app: RabbitApps, rabbitmq: RabbitMQNode, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker has the message but the publisher saw its connection break: the outcome is unknown."""
    app = make_rabbit_app(task_publish_retry=False)
    task = keyed(app, "rabbit.cut")
    original = Producer._publish

    def sent_then_cut(self: Any, *args: Any, **kwargs: Any) -> Any:
        original(self, *args, **kwargs)
        raise ConnectionResetError("connection reset after the send")

    monkeypatch.setattr(Producer, "_publish", sent_then_cut)
    with pytest.raises(Exception, match="connection reset after the send"):
        task.delay(5)
    monkeypatch.undo()

    status = task.dedup_status(5)
    assert status is not None and status.state == "publishing"
    assert task.delay(5).id == status.task_id, "a call within the lease is its duplicate"
    assert amqp_message_count(rabbitmq.url, make_rabbit_app.queue) == 1
    with in_process_worker(app):
        wait_for(lambda: getattr(task.dedup_status(5), "state", None) == "succeeded", 30, "the run to end")
    assert runs(r, task, 5) == [status.task_id]


def test_a_message_confirmed_past_its_lease_and_a_newer_call_run_one_at_a_time(
    make_rabbit_app: RabbitApps, rabbitmq: RabbitMQNode, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lease 3 s, the first publish confirmed after 4 s: a newer call takes the key; one execution, both recorded."""
    app = make_rabbit_app(dedup_publish_lease=3)
    task = keyed(app, "rabbit.slow")
    original = Producer._publish
    slow = threading.local()

    def slow_confirm(self: Any, *args: Any, **kwargs: Any) -> Any:
        sent = original(self, *args, **kwargs)
        if getattr(slow, "on", False):
            time.sleep(4)
        return sent

    monkeypatch.setattr(Producer, "_publish", slow_confirm)
    results: list[Any] = []

    def first_call() -> None:
        slow.on = True
        results.append(task.delay(7))

    caller = threading.Thread(target=first_call)
    caller.start()
    wait_for(lambda: getattr(task.dedup_status(7), "state", None) == "publishing", 5, "the first hold")
    first_id = task.dedup_status(7).task_id
    newer = wait_for(lambda: (c := task.delay(7)) and not c.deduplicated and c, 10, "the lease to end")
    caller.join(10)
    monkeypatch.undo()

    assert [(res.id, res.deduplicated) for res in results] == [(newer.id, True)], (
        "the first caller learns the newer run"
    )
    assert amqp_message_count(rabbitmq.url, make_rabbit_app.queue) == 2, "both messages reached the broker"
    with in_process_worker(app):
        assert newer.get(timeout=30) == 7
        wait_for(lambda: amqp_message_count(rabbitmq.url, make_rabbit_app.queue) == 0, 30, "both delivered")
        time.sleep(0.5)
    assert runs(r, task, 7) == [newer.id], "the late message was skipped: its key belongs to the newer run"
    history = history_text(task.dedup_status(7))
    assert first_id in history and newer.id in history, history


def test_a_countdown_on_a_quorum_queue_holds_the_key_until_the_run_ends(
    make_rabbit_app: RabbitApps, rabbitmq: RabbitMQNode, r: redis.Redis
) -> None:
    """Native delayed delivery: the message waits in the broker, the key is held over the delay and the run."""
    app = make_rabbit_app(**QUORUM_DELAYED)
    task = keyed(app, "rabbit.later", dedup_ttl=2)
    with in_process_worker(app):
        first = task.apply_async((9,), countdown=5)
        status = task.dedup_status(9)
        assert status is not None and status.state == "queued" and status.held_until is not None
        assert status.queued_at is not None
        assert (status.held_until - status.queued_at).total_seconds() >= 5 + 2 - 0.1, "the hold covers the delay"
        time.sleep(3)  # past dedup_ttl alone, within the delay
        assert task.delay(9).id == first.id, "a call during the delay is a duplicate"
        assert first.get(timeout=30) == 9
        wait_for(lambda: r.scard(HELD) == 0, 10, "the key freed once the run ended")
    assert runs(r, task, 9) == [first.id]


def test_a_broker_stopped_during_a_call_gives_the_documented_outcome(
    make_rabbit_app: RabbitApps, rabbitmq: RabbitMQNode, r: redis.Redis
) -> None:
    """The publish fails on a broker that is down: the key keeps its lease; once the broker is back, it runs once."""
    app = make_rabbit_app(dedup_publish_lease=2)
    task = keyed(app, "rabbit.down")
    rabbitmq.run_ctl("stop_app")
    try:
        with pytest.raises(OperationalError, match="Connection refused"):
            task.delay(11)
        status = task.dedup_status(11)
        assert status is not None and status.state == "publishing", "the outcome is unknown: the lease holds the key"
    finally:
        rabbitmq.run_ctl("start_app")
    later = wait_for(lambda: (c := task.delay(11)) and not c.deduplicated and c, 30, "the lease to end")
    with in_process_worker(app):
        assert later.get(timeout=30) == 11
    assert runs(r, task, 11) == [later.id]


def test_a_redelivery_after_a_worker_died_before_its_ack_runs_the_body_once(
    make_rabbit_app: RabbitApps, rabbitmq: RabbitMQNode, server: Server, r: redis.Redis
) -> None:
    """acks_late, the worker killed after the body ended and before the ack: RabbitMQ redelivers, the guard skips."""
    app = make_rabbit_app()
    _, _, slow_ack = rabbitmq_app.register(app)  # the names the worker process's app has
    env = {"CELERY_DEDUP_TEST_STORE": server.url, "CELERY_DEDUP_TEST_QUEUE": make_rabbit_app.queue}
    first = WorkerProcess(rabbitmq.url, app="tests.rabbitmq_app", concurrency=1, env=env).wait_ready()
    try:
        result = slow_ack.delay(12)
        wait_for(lambda: r.exists(rabbitmq_app.acked_key(slow_ack.name, 12)), 30, "the body to end")
        assert getattr(slow_ack.dedup_status(12), "state", None) == "succeeded"
        first.stop(signal.SIGKILL)
    finally:
        first.stop(signal.SIGKILL)
    second = WorkerProcess(rabbitmq.url, app="tests.rabbitmq_app", concurrency=1, env=env).wait_ready()
    try:
        wait_for(lambda: amqp_message_count(rabbitmq.url, make_rabbit_app.queue) == 0, 30, "the redelivery taken")
        wait_for(lambda: (getattr(slow_ack.dedup_status(12), "skipped", 0) or 0) >= 1, 30, "the copy skipped")
    finally:
        second.stop()
    assert [entry.decode().split()[0] for entry in r.lrange(rabbitmq_app.runs_key(slow_ack.name, 12), 0, -1)] == [
        result.id
    ]
