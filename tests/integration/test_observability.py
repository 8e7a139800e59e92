"""Decision counters, decision log lines and the Prometheus collector, from a scripted scenario."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import redis
from celery import Celery
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import celery_dedup
from celery_dedup import DedupTask, operations, runtime
from celery_dedup.contrib.prometheus import DedupCollector
from celery_dedup.testing import RedisServer, free_port
from tests.conftest import AppFactory, in_process_worker, wait_for


def tasks(app: Celery, client: redis.Redis) -> tuple[Any, Any]:
    @app.task(base=DedupTask, name="obs.charge", shared=False, dedup_key="order:{order_id}")
    def charge(order_id: int) -> None:
        client.incr(f"ran:{order_id}")

    @app.task(
        base=DedupTask, name="obs.sync", shared=False, dedup_key="sku:{sku}", dedup_mode="debounce", dedup_window=0.2
    )
    def sync(sku: str, n: int) -> None:
        client.incr(f"synced:{sku}")

    return charge, sync


def test_counters_and_log_lines_match_the_decisions_made(
    make_app: AppFactory, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="celery_dedup")
    app = make_app(task_ignore_result=True, dedup_dispatch_interval=0.05)
    charge, sync = tasks(app, r)
    store = runtime.store_for(app)

    first = charge.delay(1)  # accepted
    charge.delay(1)  # deduplicated (answered by a peek)
    charge.delay(2)  # accepted
    copy = r.lrange("celery", -1, -1)[0]  # order 1's message, to deliver again after it ran
    for n in range(3):
        sync.delay("a", n)  # accepted, collapsed, collapsed
    with in_process_worker(app):
        wait_for(lambda: r.get("ran:1") and r.get("ran:2") and r.get("synced:a"), 10, "the runs")
        r.lpush("celery", copy)  # a redelivered copy of a finished run: skipped
        wait_for(lambda: store.stats().get("obs.charge", {}).get("skipped"), 10, "the copy's skip")
    assert r.get("ran:1") == b"1"

    held = charge.delay(3)  # accepted; an operator frees it
    assert operations.release(app, "obs.charge:order:3", by="ops").released
    started = store.start(
        "obs.charge:order:4", "order:4~run", "token", lock_ms=60_000, gated=False, key_mode="lock",
        hostname="h", pid=1, retries=0, record_ms=60_000,
    )  # fmt: skip
    assert started.run
    r.delete("dedup:lock:obs.charge:order:4")  # the lock expired under the run
    store.finish("obs.charge:order:4", "order:4~run", "succeeded", drop=True, record_ms=1000, token="token", role="run")
    store.start(
        "obs.charge:order:5", "order:5~run", "t5", lock_ms=60_000, gated=False, key_mode="lock",
        hostname="h", pid=1, retries=0, record_ms=60_000,
    )  # fmt: skip
    r.delete("dedup:lock:obs.charge:order:5")  # its worker died: the reaper marks it lost
    assert celery_dedup.reap(app).lost == 1

    assert celery_dedup.stats(app) == {
        "obs.charge": {
            "accepted": 3,
            "deduplicated": 1,
            "skipped": 1,
            "released": 1,
            "lock_lost": 1,
            "reaped": 1,
        },
        "obs.sync": {"accepted": 1, "collapsed": 2},
    }
    lines: list[Any] = [rec for rec in caplog.records if hasattr(rec, "dedup_decision")]
    logged = [(rec.dedup_decision, rec.dedup_task, rec.dedup_key) for rec in lines]
    assert ("accepted", "obs.charge", "order:1") in logged
    assert ("deduplicated", "obs.charge", "order:1") in logged
    assert ("collapsed", "obs.sync", "sku:a") in logged
    assert ("skipped", "obs.charge", "order:1") in logged
    assert ("released", "obs.charge", "order:3") in logged
    levels = {rec.dedup_decision: rec.levelname for rec in lines}
    assert levels == {
        "accepted": "DEBUG",
        "collapsed": "DEBUG",
        "deduplicated": "INFO",
        "skipped": "INFO",
        "released": "WARNING",
        "reaped": "WARNING",
    }, "the levels the README names"
    duplicate_ids = {rec.dedup_task_id for rec in lines if rec.dedup_decision == "deduplicated"}
    assert duplicate_ids == {first.id}, "a duplicate's line names the accepted run"
    released_ids = {rec.dedup_task_id for rec in lines if rec.dedup_decision == "released"}
    assert released_ids == {held.id}


def test_fail_open_is_counted_in_redis_once_it_answers(make_app: AppFactory, r: redis.Redis) -> None:
    """A separate dedup store that is down: counted in this process, then in Redis once it is up."""
    port = free_port()
    app = make_app(
        broker_url="memory://", dedup_redis_url=f"redis://127.0.0.1:{port}/0", dedup_on_redis_error="fail_open"
    )
    charge, _ = tasks(app, r)
    charge.delay(1)
    charge.delay(1)
    assert runtime.runtime_for(app).unflushed == {"obs.charge": 2}
    with pytest.raises(redis.RedisError):
        runtime.flush_counts(app)
    assert runtime.runtime_for(app).unflushed == {"obs.charge": 2}, "kept while Redis is down"
    with RedisServer(port) as store_server:
        assert celery_dedup.stats(app) == {"obs.charge": {"fail_open": 2}}
        assert redis.Redis.from_url(store_server.url).hget("dedup:stats", "obs.charge:fail_open") == b"2"
    assert runtime.runtime_for(app).unflushed == {}


def test_the_prometheus_collector_exposes_the_counters(make_app: AppFactory, r: redis.Redis) -> None:
    app = make_app(task_ignore_result=True)
    charge, _ = tasks(app, r)
    charge.delay(1)
    charge.delay(1)
    charge.delay(2)
    registry = CollectorRegistry()
    registry.register(DedupCollector(app))
    families = {family.name: family for family in text_string_to_metric_families(generate_latest(registry).decode())}
    assert [sample.value for sample in families["celery_dedup_up"].samples] == [1]
    samples = {
        (sample.labels["task"], sample.labels["decision"]): sample.value
        for sample in families["celery_dedup_decisions"].samples
        if sample.name == "celery_dedup_decisions_total"
    }
    assert samples == {("obs.charge", "accepted"): 2, ("obs.charge", "deduplicated"): 1}
