"""Celery and celery-dedup on a real RabbitMQ broker: a private node, started once per session.

The dedup store is the session's Redis server (``dedup_redis_url``): on this
broker the gate is the non-atomic one (see docs/guarantees.md). These tests
show that the broker set-ups the library must work with do work here: classic
and quorum queues, Celery's native delayed delivery, one message and one run
per key, a broker restart under a running worker.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import Connection
from kombu.transport.native_delayed_delivery import MAX_LEVEL, level_name

from celery_dedup.testing import assert_deduplicated, assert_published, assert_state
from tests.servers import RabbitMQNode

from .. import rabbitmq_app
from ..conftest import RabbitApps, Server, WorkerProcess, amqp_message_count, in_process_worker

QUEUE_TYPES = ("classic", "quorum")
#: Celery's settings for quorum queues with native delayed delivery (its RabbitMQ guide): the delay
#: levels are quorum queues too, and topic exchanges let them route a message back to its queue.
NATIVE_DELAYED_DELIVERY: dict[str, Any] = {
    "task_default_queue_type": "quorum",
    "task_default_exchange_type": "topic",
    "broker_native_delayed_delivery_queue_type": "quorum",
    "broker_transport_options": {"confirm_publish": True},
}
#: Seconds: 5 is 101 in binary, so the message waits 4 s in delay level 2, then 1 s in level 0.
COUNTDOWN = 5


@pytest.fixture(autouse=True)
def _collect_results_while_server_runs() -> Iterator[None]:
    # Connection errors logged around a broker restart keep results in reference cycles; collected
    # after the session's Redis server stops, each result's __del__ would retry unsubscribing from it.
    yield
    gc.collect()


def queue_types(rabbitmq: RabbitMQNode) -> dict[str, str]:
    """Every queue of the node and its type, as ``rabbitmqctl list_queues`` reports them."""
    listed = rabbitmq.run_ctl("-q", "--no-table-headers", "list_queues", "name", "type")
    return dict(line.split("\t") for line in listed.splitlines() if line.strip())


def delayed_message_count(url: str) -> int:
    """Messages waiting in the delay levels of Celery's native delayed delivery (``celery_delayed_0``...)."""
    with Connection(url) as connection:
        channel: Any = connection.default_channel
        levels = [channel.queue_declare(level_name(level), passive=True) for level in range(MAX_LEVEL + 1)]
        return int(sum(level.message_count for level in levels))


def runs(r: redis.Redis, task: Any, n: int) -> list[str]:
    """The task ids of every run of ``task(n)``, in order."""
    return [entry.decode().split()[0] for entry in r.lrange(rabbitmq_app.runs_key(task.name, n), 0, -1)]


@pytest.mark.parametrize("queue_type", QUEUE_TYPES)
def test_a_plain_task_runs(
    make_rabbit_app: RabbitApps, rabbitmq: RabbitMQNode, r: redis.Redis, queue_type: str
) -> None:
    app = make_rabbit_app(task_default_queue_type=queue_type)
    plain, _, _ = rabbitmq_app.register(app, prefix=f"rabbitmq.plain-{queue_type}")
    with in_process_worker(app):
        result = plain.delay(7)
        assert result.get(timeout=30) == 7
    assert queue_types(rabbitmq)[make_rabbit_app.queue] == queue_type
    assert runs(r, plain, 7) == [result.id]


def test_a_countdown_on_a_quorum_queue_waits_in_the_broker(
    make_rabbit_app: RabbitApps, rabbitmq: RabbitMQNode, r: redis.Redis
) -> None:
    app = make_rabbit_app(**NATIVE_DELAYED_DELIVERY)
    plain, _, _ = rabbitmq_app.register(app, prefix="rabbitmq.delayed")
    # The worker's start declares the delay levels and binds the task queue to them: before it, a
    # delayed message would have nowhere to go.
    with in_process_worker(app):
        result = plain.apply_async((5,), countdown=COUNTDOWN)
        # Confirmed by the broker, so it is routed: it waits in a delay level, neither in the task
        # queue nor held by the worker (which is what a countdown on a classic queue does).
        assert delayed_message_count(rabbitmq.url) == 1
        assert amqp_message_count(rabbitmq.url, make_rabbit_app.queue) == 0
        assert runs(r, plain, 5) == []
        assert result.get(timeout=COUNTDOWN + 30) == 5
    assert delayed_message_count(rabbitmq.url) == 0
    assert runs(r, plain, 5) == [result.id]
    assert queue_types(rabbitmq)[level_name(0)] == "quorum"


@pytest.mark.parametrize("queue_type", QUEUE_TYPES)
def test_two_calls_of_one_key_publish_one_message_and_run_once(
    make_rabbit_app: RabbitApps, rabbitmq: RabbitMQNode, r: redis.Redis, queue_type: str
) -> None:
    # Publisher confirms: a publish has reached its queue when apply_async returns, so counts are exact.
    app = make_rabbit_app(task_default_queue_type=queue_type, broker_transport_options={"confirm_publish": True})
    _, keyed, _ = rabbitmq_app.register(app, prefix=f"rabbitmq.dedup-{queue_type}")
    first = keyed.delay(42)
    again = keyed.delay(42)
    assert_published(first)
    assert_deduplicated(again, of=first)
    assert amqp_message_count(rabbitmq.url, make_rabbit_app.queue) == 1
    with in_process_worker(app):
        assert first.get(timeout=30) == 42
        assert_state(keyed.s(42), "succeeded", run=first, timeout=10)
    assert runs(r, keyed, 42) == [first.id]
    assert amqp_message_count(rabbitmq.url, make_rabbit_app.queue) == 0


@pytest.mark.slow
def test_a_worker_reconnects_after_the_broker_restarts(
    make_rabbit_app: RabbitApps, rabbitmq: RabbitMQNode, server: Server, r: redis.Redis
) -> None:
    app = make_rabbit_app()
    plain, _, _ = rabbitmq_app.register(app)  # the names the worker process's app has
    env = {"CELERY_DEDUP_TEST_STORE": server.url, "CELERY_DEDUP_TEST_QUEUE": make_rabbit_app.queue}
    worker = WorkerProcess(rabbitmq.url, app="tests.rabbitmq_app", concurrency=1, env=env).wait_ready()
    try:
        before = plain.delay(1)
        assert before.get(timeout=30) == 1
        rabbitmq.restart()
        after = plain.delay(2)  # the publisher's pooled connection died with the node: kombu reconnects it
        assert after.get(timeout=60) == 2
        assert worker.process.poll() is None, "the worker exited instead of reconnecting"
    finally:
        worker.stop()
    assert "Connection to broker lost" in "".join(worker.output)
    assert runs(r, plain, 1) == [before.id]
    assert runs(r, plain, 2) == [after.id]
