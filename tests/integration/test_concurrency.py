"""Contract 1: many publishers racing on the same keys enqueue each key exactly once.

Publishers are separate interpreters (multiprocessing "spawn"), each with many
threads, all released by one barrier; the broker, the dedup state and the
worker are real.
"""

from __future__ import annotations

import base64
import json
import multiprocessing
import os
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis

from celery_dedup import DedupResult
from celery_dedup.header import GateHeader
from celery_dedup.keys import KeySchema, split_member

from ..conftest import Server, WorkerProcess, queued_messages

PROCESSES = 4
THREADS = 16
ORDERS = range(1000, 1200)
CALLERS = PROCESSES * THREADS
SCHEMA = KeySchema("dedup")


@dataclass
class PublisherReport:
    """What one publisher process's callers saw."""

    #: order id -> every task id its callers in this process were handed
    ids: dict[int, set[str]] = field(default_factory=dict)
    #: order id -> how many of this process's calls were answered as duplicates
    deduplicated: Counter[int] = field(default_factory=Counter)
    calls: int = 0
    errors: list[str] = field(default_factory=list)


def publisher(broker: str, barrier: Any, out: Any, seed: int) -> None:
    """Child process: THREADS threads each call ``charge.delay`` once per order, in their own order."""
    os.environ["CELERY_DEDUP_TEST_BROKER"] = broker
    from tests import proj  # noqa: PLC0415 - must follow the environment variable

    report = PublisherReport()
    lock = threading.Lock()

    def caller(index: int) -> None:
        orders = list(ORDERS)
        random.Random(seed * 1000 + index).shuffle(orders)
        seen: list[tuple[int, str, bool]] = []
        try:
            barrier.wait(60)
            for order_id in orders:
                result = proj.charge.delay(order_id)
                assert isinstance(result, DedupResult)
                seen.append((order_id, result.id, result.deduplicated))
        except Exception as exc:
            with lock:
                report.errors.append(f"thread {index}: {type(exc).__name__}: {exc}")
        with lock:
            for order_id, task_id, deduplicated in seen:
                report.ids.setdefault(order_id, set()).add(task_id)
                report.deduplicated[order_id] += deduplicated
                report.calls += 1

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    out.put(report)


def order_of(message: dict[str, Any]) -> int:
    """The order id a queued charge message was published with (from its body, not its key)."""
    args, _kwargs, _embed = json.loads(base64.b64decode(message["body"]))
    return int(args[0])


def wait_until_drained(r: redis.Redis, worker: WorkerProcess, timeout: float = 60.0) -> None:
    """Until the queue, kombu's unacked store and the held set are all empty."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = r.llen("celery") + r.hlen("unacked") + r.scard(SCHEMA.held)
        if busy == 0:
            return
        if worker.process.poll() is not None:
            raise RuntimeError("worker died:\n" + "".join(worker.output))
        time.sleep(0.1)
    raise TimeoutError(
        f"not drained: queue={r.llen('celery')} unacked={r.hlen('unacked')} held={r.scard(SCHEMA.held)}\n"
        + "".join(worker.output[-40:])
    )


@pytest.mark.slow
@pytest.mark.xdist_group("cpu")  # publisher processes of many threads each: not beside the other CPU-bound tests
def test_racing_publishers_enqueue_each_key_once_and_it_runs_once(server: Server, r: redis.Redis) -> None:
    """4 processes x 16 threads call charge(order) for the same 200 orders at once.

    Proves: one message per order reaches the broker, every one of the 64
    callers of an order is handed that message's id, exactly one call per
    order is not a duplicate; a real worker then runs each order once and
    every key is released.
    """
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(CALLERS)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=publisher, args=(server.url, barrier, out, seed), daemon=True) for seed in range(PROCESSES)
    ]
    for proc in procs:
        proc.start()
    try:
        reports: list[PublisherReport] = [out.get(timeout=120) for _ in procs]
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    assert [proc.exitcode for proc in procs] == [0] * PROCESSES
    assert [e for rep in reports for e in rep.errors] == []
    assert sum(rep.calls for rep in reports) == CALLERS * len(ORDERS)

    messages = queued_messages(r)
    assert len(messages) == len(ORDERS)
    ids = [m["headers"]["id"] for m in messages]
    gates = [GateHeader.decode(m["headers"]) for m in messages]
    members = [g.member for g in gates if g is not None]
    assert len(set(ids)) == len(ORDERS)
    assert len(set(members)) == len(ORDERS)
    queued_id = {order_of(m): m["headers"]["id"] for m in messages}
    assert set(queued_id) == set(ORDERS)
    for message, member in zip(messages, members, strict=True):
        assert split_member(member)[1] == f"order:{order_of(message)}", "the key must be the message's own order"

    for order_id in ORDERS:
        handed = set().union(*(rep.ids.get(order_id, set()) for rep in reports))
        assert handed == {queued_id[order_id]}, f"order {order_id}: callers got {handed}"
        deduplicated = sum(rep.deduplicated[order_id] for rep in reports)
        assert deduplicated == CALLERS - 1, f"order {order_id}: {CALLERS - deduplicated} calls were not duplicates"
    not_deduplicated = sum(rep.calls - sum(rep.deduplicated.values()) for rep in reports)
    assert not_deduplicated == len(ORDERS)

    worker = WorkerProcess(server.url, pool="prefork", concurrency=2).wait_ready()
    try:
        wait_until_drained(r, worker)
    finally:
        worker.stop(signal.SIGTERM)
    executions = {order_id: int(r.get(f"test:executions:order:{order_id}") or 0) for order_id in ORDERS}
    assert executions == dict.fromkeys(ORDERS, 1)
    assert r.smembers(SCHEMA.held) == set()
    assert queued_messages(r) == []
    for order_id in ORDERS:
        record = r.hgetall(SCHEMA.record(f"tests.proj.charge:order:{order_id}"))
        assert record[b"task_id"].decode() == queued_id[order_id]
        assert record[b"state"] == b"succeeded"
