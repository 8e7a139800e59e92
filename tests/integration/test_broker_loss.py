"""A worker whose broker restarts while it holds unacknowledged messages.

Celery closes the connection it lost, and each channel puts its
unacknowledged messages back on their queues as it closes. With the server
down, that first try fails; by the next, kombu's connection has let go of
its transport, and kombu reads the server's address from there: the worker
died (``Unrecoverable error: AttributeError: 'NoneType' object has no
attribute 'hostname'``), as chaos runs saw at every server restart. The
gated transport's channels keep their server's address.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import redis

from celery_dedup.testing import RedisServer
from celery_dedup.transports import redis as gated

from ..conftest import Server, WorkerProcess, new_app, wait_for


def executions_key(key: str) -> str:
    """Where ``tests.proj``'s tasks count their executions (not imported: its module-level tasks are shared, and
    every app finalized later in this process would bind them)."""
    return f"test:executions:{key}"


def test_a_worker_whose_broker_restarts_with_prefetched_messages_puts_them_back_and_lives_on(tmp_path: Path) -> None:
    """One body runs 2 s on a worker of one process, three more messages wait in its prefetch; the server restarts."""
    persist = ("--dir", str(tmp_path), "--appendonly", "yes", "--appendfsync", "always")
    first = RedisServer(extra=persist).start()
    port, url = first.port, first.url
    second: RedisServer | None = None
    worker = WorkerProcess(url, pool="prefork", concurrency=1).wait_ready()
    try:
        publisher = new_app(Server(url, first), "broker_loss")
        orders = [701, 702, 703, 704]
        for order in orders:
            publisher.send_task("tests.proj.slow_charge", (order, 2.0))
        publisher.close()
        client = redis.Redis.from_url(url)
        wait_for(lambda: client.get(executions_key("order:701")), 20, "the first body")
        # The other three fetched, unacknowledged (kombu's unacknowledged hash; the first was acknowledged as it began).
        wait_for(lambda: client.hlen("unacked") == 3, 10, lambda: f"{client.hlen('unacked')} of 3 prefetched")
        client.close()
        first.stop()
        time.sleep(1.0)
        second = RedisServer(port, extra=persist).start()
        client = redis.Redis.from_url(url)
        wait_for(
            lambda: all(client.get(executions_key(f"order:{n}")) for n in orders) or worker.process.poll() is not None,
            60,
            lambda: "every order run, or the worker gone:\n" + "".join(worker.output)[-4000:],
        )
        output = "".join(worker.output)
        assert worker.process.poll() is None, f"the worker died:\n{output[-3000:]}"
        assert "Restoring 3 unacknowledged message(s)" in output, output[-3000:]
        assert "put back 3 unacknowledged message(s) a lost connection had left behind" in output, output[-3000:]
        assert [int(client.get(executions_key(f"order:{n}")) or 0) for n in orders] == [1, 1, 1, 1]
        client.close()
    finally:
        worker.stop()
        first.stop()
        if second is not None:
            second.stop()


def test_a_message_another_worker_put_back_meanwhile_is_not_put_back_twice(tmp_path: Path) -> None:
    """Two messages fetched and not acknowledged; the server goes down as the connection closes; meanwhile (as a
    visibility restore of another worker would) one of them is put back by someone else. The next channel puts
    back only the other: each message is once on its queue."""
    persist = ("--dir", str(tmp_path), "--appendonly", "yes", "--appendfsync", "always")
    first = RedisServer(extra=persist).start()
    port, url = first.port, first.url
    second: RedisServer | None = None
    try:
        connection = gated.Connection(url)
        queue = connection.SimpleQueue("broker-loss")
        for n in (1, 2):
            queue.put({"n": n})
        fetched = [queue.get(timeout=5) for _ in range(2)]
        tags = [str(message.delivery_tag) for message in fetched]
        assert redis.Redis.from_url(url).hlen("unacked") == 2
        first.stop()
        connection.release()  # the restore fails: the server is down; the tags are kept
        second = RedisServer(port, extra=persist).start()
        client = redis.Redis.from_url(url)
        kept = client.hget("unacked", tags[0])
        assert kept is not None, "the server kept what was unacknowledged"
        message, _exchange, routing_key = json.loads(kept)
        with client.pipeline() as pipe:  # what kombu's restore_by_tag does, from another process
            pipe.hdel("unacked", tags[0])
            pipe.zrem("unacked_index", tags[0])
            pipe.rpush(routing_key, json.dumps(message))
            pipe.execute()
        again = gated.Connection(url)
        again.default_channel  # noqa: B018 - opening it puts back what the closed channel could not
        bodies = sorted(json.loads(raw)["body"] for raw in client.lrange("broker-loss", 0, -1))
        assert len(bodies) == 2 and len(set(bodies)) == 2, bodies
        assert client.hlen("unacked") == 0
        received = again.SimpleQueue("broker-loss")
        assert sorted(received.get(timeout=5).payload["n"] for _ in range(2)) == [1, 2]
        again.release()
        client.close()
    finally:
        first.stop()
        if second is not None:
            second.stop()
