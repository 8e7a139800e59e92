"""The gate on a ``sentinel://`` broker: the Sentinel transport variant, against a real master and Sentinel."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_dedup import DedupResult, DedupTask, runtime
from celery_dedup.keys import KeySchema, member_for
from celery_dedup.testing import RedisServer
from celery_dedup.transports.redis import SentinelChannel, SentinelTransport

from ..conftest import AppFactory, in_process_worker, queued_messages

HELD = KeySchema("dedup").held
MASTER_NAME = "mymaster"


class Topology:
    """A master and one Sentinel watching it."""

    def __init__(self, master: RedisServer, sentinel: RedisServer) -> None:
        self.master = master
        self.sentinel = sentinel
        self.master_client = redis.Redis(port=master.port)

    @property
    def broker_url(self) -> str:
        return f"sentinel://127.0.0.1:{self.sentinel.port}"


def _wait_until_sentinel_knows(sentinel: RedisServer, master: RedisServer, timeout: float = 15.0) -> None:
    client = redis.Redis(port=sentinel.port)
    deadline = time.monotonic() + timeout
    state: Any = None
    try:
        while time.monotonic() < deadline:
            state = client.sentinel_master(MASTER_NAME)
            assert isinstance(state, dict)
            healthy = not any(state.get(flag) for flag in ("is_sdown", "is_odown", "is_disconnected"))
            if state.get("is_master") and healthy and int(state.get("port", 0)) == master.port:
                return
            time.sleep(0.05)
    finally:
        client.close()
    raise TimeoutError(f"sentinel on {sentinel.port} does not see master {master.port} as up: {state}")


@pytest.fixture(scope="module")
def topology() -> Iterator[Topology]:
    with RedisServer() as master, RedisServer(sentinel_for=(MASTER_NAME, "127.0.0.1", master.port)) as sentinel:
        _wait_until_sentinel_knows(sentinel, master)
        topo = Topology(master, sentinel)
        yield topo
        topo.master_client.close()


@pytest.fixture
def sentinel_app(make_app: AppFactory, topology: Topology) -> Celery:
    topology.master_client.flushall()
    return make_app(
        broker_url=topology.broker_url,
        result_backend=topology.master.url,
        broker_transport_options={"master_name": MASTER_NAME},
    )


def test_install_chooses_the_gated_sentinel_transport(sentinel_app: Celery) -> None:
    """A sentinel:// broker gets the Sentinel variant of the gated transport, and the gate is atomic."""
    assert runtime.runtime_for(sentinel_app).atomic
    with sentinel_app.connection_for_write() as conn:
        assert isinstance(conn.transport, SentinelTransport)
        assert isinstance(conn.default_channel, SentinelChannel)


def test_duplicate_is_suppressed_on_the_master_and_runs_once(sentinel_app: Celery, topology: Topology) -> None:
    """Through Sentinel: one message on the master for two calls, one run, and the key released after."""
    runs: list[str] = []

    @sentinel_app.task(base=DedupTask, dedup_key="order:{order_id}", bind=True, shared=False)
    def charge(self: Any, order_id: int) -> int:
        runs.append(self.request.id)
        return order_id * 10

    master = topology.master_client
    first = charge.delay(42)
    second = charge.delay(42)

    assert isinstance(first, DedupResult) and isinstance(second, DedupResult)
    assert (first.deduplicated, second.deduplicated) == (False, True)
    assert second.id == first.id
    assert [m["headers"]["id"] for m in queued_messages(master)] == [first.id]
    assert master.smembers(HELD) == {member_for(charge.name, "order:42").encode()}
    assert getattr(charge.dedup_status(42), "task_id", None) == first.id

    with in_process_worker(sentinel_app):
        assert first.get(timeout=15) == 420
    assert runs == [first.id]
    assert master.scard(HELD) == 0
    assert getattr(charge.dedup_status(42), "state", None) == "succeeded"
    assert queued_messages(master) == []
