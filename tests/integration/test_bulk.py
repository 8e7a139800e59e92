"""Bulk gated enqueue (``DedupTask.apply_async_many``) on a real server and worker."""

from __future__ import annotations

import multiprocessing
import random
import time
from collections import Counter
from typing import Any

import pytest
import redis
from celery import Celery

from celery_dedup import DedupKeyError, DedupTask, DedupUnavailableError
from chaos.proxy import FaultProxy
from tests.conftest import AppFactory, Server, in_process_worker, new_app, queued_messages, wait_for


def keyed(app: Celery, client: redis.Redis | None = None, **options: Any) -> Any:
    @app.task(base=DedupTask, name="bulk.notify", shared=False, dedup_key="customer:{customer_id}", **options)
    def notify(customer_id: int, text: str = "") -> None:
        if client is not None:
            client.rpush(f"ran:{customer_id}", text)

    return notify


def test_results_come_in_order_and_duplicates_are_marked(make_app: AppFactory, r: redis.Redis) -> None:
    app = make_app(task_ignore_result=True)
    notify = keyed(app)
    held = notify.delay(7)  # held before the batch
    calls = [((i,), {"text": f"t{i}"}) for i in range(100)] + [((i,), {"text": "again"}) for i in range(0, 100, 10)]
    results = notify.apply_async_many(calls)
    assert len(results) == len(calls)
    first_ids: dict[int, str] = {}
    for (args, _), result in zip(calls, results, strict=True):
        first_ids.setdefault(args[0], result.id)
        assert result.id == first_ids[args[0]], "every call of a key learns the same run"
    assert results[7].id == held.id and results[7].deduplicated
    assert [result.deduplicated for result in results[:100]] == [i == 7 for i in range(100)]
    assert all(result.deduplicated for result in results[100:])
    messages = queued_messages(r)
    assert len(messages) == 100, "one message per key: 99 from the batch, 1 from delay()"
    assert Counter(m["headers"]["id"] for m in messages) == Counter(first_ids[i] for i in range(100))


def test_messages_are_the_ones_apply_async_builds(make_app: AppFactory, r: redis.Redis) -> None:
    """Same headers, properties and body as Celery's own publish, apart from ids and the gate's nonce."""
    app = make_app(task_ignore_result=True)
    notify = keyed(app)
    notify.apply_async((1,), {"text": "x"}, priority=5, countdown=30)
    notify.apply_async_many([((2,), {"text": "x"})], priority=5, countdown=30)
    plain, bulk = sorted(queued_messages(r), key=lambda m: m["headers"]["argsrepr"])
    varying = {"id", "root_id", "argsrepr", "eta"}
    assert {k: v for k, v in plain["headers"].items() if k not in varying | {"dedup"}} == {
        k: v for k, v in bulk["headers"].items() if k not in varying | {"dedup"}
    }
    assert set(plain["headers"]["dedup"]) == set(bulk["headers"]["dedup"])
    assert set(plain["properties"]) == set(bulk["properties"])
    for name in ("priority", "delivery_mode", "body_encoding", "delivery_info", "reply_to"):
        assert plain["properties"][name] == bulk["properties"][name], name
    for name in ("content-type", "content-encoding"):
        assert plain[name] == bulk[name]
    buckets = [key for key in r.keys("celery*") if r.type(key) == b"list"]
    assert len(buckets) == 1 and r.llen(buckets[0]) == 2, "both went to the same priority bucket"


def test_a_real_worker_runs_each_key_once_with_its_arguments(make_app: AppFactory, r: redis.Redis) -> None:
    app = make_app(task_ignore_result=True)
    notify = keyed(app, r)
    calls = [((i,), {"text": f"first {i}"}) for i in range(200)] + [((i,), {"text": "dup"}) for i in range(20)]
    notify.apply_async_many(calls, chunk=64)
    with in_process_worker(app):
        wait_for(lambda: sum(r.llen(f"ran:{i}") for i in range(200)) >= 200, 20, "the batch ran")
        time.sleep(0.3)
    assert [r.lrange(f"ran:{i}", 0, -1) for i in range(200)] == [[f"first {i}".encode()] for i in range(200)]


def test_a_bad_call_raises_before_anything_is_sent(make_app: AppFactory, r: redis.Redis) -> None:
    app = make_app(task_ignore_result=True)
    notify = keyed(app)
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = [((i,), {}) for i in range(10)]
    calls[6] = ((), {"text": "no customer"})
    with pytest.raises(DedupKeyError) as raised:
        notify.apply_async_many(calls)
    assert "bulk.notify" in str(raised.value) and "customer_id" in str(raised.value)
    assert queued_messages(r) == [] and r.scard("dedup:held") == 0


def test_options_the_lean_path_does_not_build_take_the_loop(make_app: AppFactory, r: redis.Redis) -> None:
    """``expires`` (not built by the lean path) goes through apply_async; a duplicate still never raises."""
    app = make_app(task_ignore_result=True)
    notify = keyed(app, dedup_on_duplicate="raise")
    results = notify.apply_async_many([((1,), {}), ((2,), {}), ((1,), {})], expires=600)
    assert [result.deduplicated for result in results] == [False, False, True]
    assert results[2].id == results[0].id
    assert all(m["headers"]["expires"] for m in queued_messages(r))


def test_another_broker_takes_the_loop(server: Server, make_app: AppFactory, r: redis.Redis) -> None:
    app = make_app(broker_url="memory://", dedup_redis_url=server.url, task_ignore_result=True)
    notify = keyed(app)
    results = notify.apply_async_many([((1,), {}), ((1,), {}), ((2,), {})])
    assert [result.deduplicated for result in results] == [False, True, False]
    assert r.scard("dedup:held") == 2


def _bulk_producer(url: str, keys: list[int], out: Any) -> None:
    app = new_app(Server(url, None), "racer", task_ignore_result=True)
    notify = keyed(app)
    results = notify.apply_async_many([((key,), {}) for key in keys], chunk=100)
    out.put({key: result.id for key, result in zip(keys, results, strict=True)})


@pytest.mark.slow
def test_racing_batches_enqueue_each_key_once(server: Server, r: redis.Redis) -> None:
    """Four processes bulk-enqueue the same 500 keys in different orders, at once."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    orders = [random.Random(seed).sample(range(500), 500) for seed in range(4)]
    producers = [ctx.Process(target=_bulk_producer, args=(server.url, keys, out)) for keys in orders]
    for producer in producers:
        producer.start()
    seen = [out.get(timeout=60) for _ in producers]
    for producer in producers:
        producer.join(30)
    messages = queued_messages(r)
    assert len(messages) == 500
    accepted = {m["headers"]["dedup"]["member"]: m["headers"]["id"] for m in messages}
    for ids in seen:
        assert all(ids[key] == accepted[f"bulk.notify:customer:{key}"] for key in range(500))


def test_a_batch_cut_short_can_be_sent_again(server: Server, r: redis.Redis) -> None:
    """The connection breaks after the first gate call ran: an error, and re-sending is safe."""
    port = int(server.url.rsplit(":", 1)[1].split("/")[0])
    with FaultProxy(port) as proxy:
        app = new_app(Server(proxy.url, None), task_ignore_result=True)
        try:
            notify = keyed(app)
            calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = [((i,), {}) for i in range(300)]
            proxy.arm("after")
            with pytest.raises(DedupUnavailableError) as raised:
                notify.apply_async_many(calls, chunk=50)  # several chunks: the cut lands mid-batch
            assert raised.value.published is None
            # A chunk sent before the cut may still be running on the server: count once it is through.
            before, settled_at = len(queued_messages(r)), time.monotonic()
            while time.monotonic() - settled_at < 0.5:
                time.sleep(0.05)
                now = len(queued_messages(r))
                if now != before:
                    before, settled_at = now, time.monotonic()
            assert before >= 1, "the first call ran before the cut"
            results = notify.apply_async_many(calls)
        finally:
            app.close()
    messages = queued_messages(r)
    assert len(messages) == 300, "every key once, none twice"
    assert sum(result.deduplicated for result in results) == before, "what went out first answers as duplicates"
    assert {m["headers"]["id"] for m in messages} == {result.id for result in results}
