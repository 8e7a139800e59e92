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

import time
from pathlib import Path

import redis

from celery_dedup.testing import RedisServer

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
