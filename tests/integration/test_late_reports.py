"""Endings reported from outside the body never free what another delivery still holds.

A worker's main process and Celery's signals report endings late: after the
guard settled the run (``task_failure`` follows ``Task.on_failure``), or while
the pool child that runs the body is still being stopped (``revoke`` with
``terminate=True``, a hard time limit). Each test reproduces a report that
used to free a lock or a key under a body that was still running.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import pytest
import redis
from celery import Celery, signals

from celery_dedup import DedupTask
from celery_dedup.keys import KeySchema, member_for
from celery_dedup.store.scripts import load_script
from chaos.proxy import FaultProxy

from ..conftest import AppFactory, Server, WorkerProcess, in_process_worker, new_app, wait_for
from ..guard_app import LINGER, events_key, register

SCHEMA = KeySchema("dedup")


def events(r: redis.Redis, key: str) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in r.lrange(key, 0, -1)]


def overlaps(evs: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Pairs of runs whose bodies were running at the same time (by event order)."""
    running: set[str] = set()
    found = []
    for event in evs:
        if event["ev"] == "start":
            found += [(other, event["id"]) for other in running]
            running.add(event["id"])
        elif event["ev"] == "end":
            running.discard(event["id"])
    return found


def record(r: redis.Redis, member: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in r.hgetall(SCHEMA.record(member)).items()}


# --------------------------------------------------------------------------- a late task_failure


class SlowToFail(DedupTask):
    """Its ``on_failure`` takes 2.5 s: Celery sends ``task_failure`` only after it."""

    abstract = True

    def on_failure(self, exc: BaseException, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        time.sleep(2.5)


FAILURE_REPORTED = "late:failure-reported"


def fragile_task(app: Celery) -> Any:
    client = redis.Redis.from_url(str(app.conf.broker_url))

    @app.task(
        base=SlowToFail,
        name="late.fragile",
        dedup_key="k:{key}",
        dedup_mode="until_executing",
        bind=True,
        shared=False,
    )
    def fragile(self: DedupTask, key: str, action: str, seconds: float = 0.0) -> str:
        client.rpush(f"late:events:{key}", json.dumps({"ev": "start", "id": self.request.id}))
        time.sleep(seconds)
        client.rpush(f"late:events:{key}", json.dumps({"ev": "end", "id": self.request.id}))
        if action == "fail":
            raise RuntimeError("boom")
        return key

    return fragile


@pytest.fixture
def failure_reports(r: redis.Redis) -> Iterator[None]:
    """Mark in Redis when a ``task_failure`` receiver connected after celery-dedup's has run."""

    def reported(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
        r.rpush(FAILURE_REPORTED, str(task_id))

    signals.task_failure.connect(reported, weak=False, dispatch_uid="tests.late.reported")
    try:
        yield
    finally:
        signals.task_failure.disconnect(dispatch_uid="tests.late.reported")


def test_a_late_failure_report_leaves_the_next_runs_lock_alone(
    make_app: AppFactory, r: redis.Redis, failure_reports: None
) -> None:
    """Run A fails and the guard frees the key; run B starts; then A's ``task_failure``
    arrives. B's lock must survive it, so a third run C cannot execute beside B.
    """
    app = make_app(dedup_lock_ttl=5)
    fragile = fragile_task(app)
    member = member_for(fragile.name, "k:x")
    with in_process_worker(app, pool="threads", concurrency=4):
        first = fragile.delay("x", "fail")
        wait_for(lambda: record(r, member).get("state") == "failed", 10, "run A to fail")
        second = fragile.delay("x", "sleep", 6.0)
        assert not second.deduplicated
        wait_for(lambda: record(r, member).get("state") == "started", 10, "run B to start")
        token = record(r, member)["lock"]
        wait_for(lambda: r.lrange(FAILURE_REPORTED, 0, -1) == [first.id.encode()], 10, "A's task_failure")
        assert r.get(SCHEMA.lock(member)) == token.encode(), "A's late report deleted B's lock"
        third = fragile.delay("x", "ok")  # until_executing: B released the key when it started
        assert not third.deduplicated
        assert second.get(timeout=20) == "x"
        wait_for(lambda: record(r, member).get("task_id") == third.id, 10, "C to be delivered")
        wait_for(lambda: record(r, member).get("state") not in ("queued", "started"), 10, "C to be refused")
    evs = events(r, "late:events:x")
    assert overlaps(evs) == [], evs
    assert record(r, member)["state"] == "skipped", "C found B's lock and was skipped"


# --------------------------------------------------------------------------- revoke(terminate=True)


@pytest.fixture
def long_locks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker subprocesses of tests.guard_app take 30 s locks: a key freed early is not a lock expiry."""
    monkeypatch.setenv("GUARD_LOCK_TTL", "30")


def guard_worker(server: Server) -> WorkerProcess:
    return WorkerProcess(server.url, app="tests.guard_app", concurrency=3).wait_ready()


@pytest.mark.slow
def test_terminate_with_sigusr1_keeps_the_key_until_the_body_stops(
    server: Server, r: redis.Redis, long_locks: None
) -> None:
    """``revoke(terminate=True, signal="SIGUSR1")`` raises SoftTimeLimitExceeded in the body,
    which cleans up for 3 s more. The key stays held (a new call is a duplicate) until
    the body has stopped; then it is freed at once, and the record says revoked.
    """
    app = new_app(server, "producer", dedup_lock_ttl=30)
    work = register(app)["guard.work.until_executed"]
    member = member_for(work.name, "job:t")
    worker = guard_worker(server)
    try:
        run = work.delay("t", "linger", 60.0)
        wait_for(lambda: events(r, events_key(work.name, "t")), 20, "the run to start")
        app.control.revoke(run.id, terminate=True, signal="SIGUSR1")
        wait_for(lambda: any(e["ev"] == "soft" for e in events(r, events_key(work.name, "t"))), 10, "the signal")
        again = work.delay("t", "ok")
        assert again.deduplicated and again.id == run.id, "the key was freed while the body still ran"
        assert r.exists(SCHEMA.lock(member)), "the lock was freed while the body still ran"
        wait_for(lambda: record(r, member).get("state") == "revoked", 5, "the revoke to be recorded")
        assert r.sismember(SCHEMA.held, member)
        wait_for(lambda: not r.sismember(SCHEMA.held, member), LINGER + 5, "the key to be freed after the body")
        assert not r.exists(SCHEMA.lock(member))
        assert record(r, member)["state"] == "revoked"
        after = work.delay("t", "ok")
        assert not after.deduplicated
        assert after.get(timeout=20) == "t"
    finally:
        worker.stop()
        app.close()
    evs = events(r, events_key(work.name, "t"))
    assert [e["ev"] for e in evs] == ["start", "soft", "end", "start", "end"], evs
    assert overlaps(evs) == []


@pytest.mark.slow
@pytest.mark.parametrize("how", ["terminate", "hard_limit"])
def test_a_stopped_child_frees_its_key_when_it_exits_not_when_its_lock_expires(
    server: Server, r: redis.Redis, long_locks: None, how: str
) -> None:
    """A child stopped by ``revoke(terminate=True)`` (SIGTERM) or a hard time limit dies
    with a 30 s lock: the worker frees the key once the child has exited.
    """
    app = new_app(server, "producer", dedup_lock_ttl=30)
    work = register(app)["guard.work.until_executed"]
    member = member_for(work.name, "job:h")
    worker = guard_worker(server)
    try:
        if how == "terminate":
            run = work.delay("h", "sleep", 60.0)
            wait_for(lambda: events(r, events_key(work.name, "h")), 20, "the run to start")
            pid = events(r, events_key(work.name, "h"))[0]["pid"]
            app.control.revoke(run.id, terminate=True)
        else:
            run = work.apply_async(("h", "sleep", 60.0), time_limit=2)
            wait_for(lambda: events(r, events_key(work.name, "h")), 20, "the run to start")
            pid = events(r, events_key(work.name, "h"))[0]["pid"]
        wait_for(lambda: not r.sismember(SCHEMA.held, member), 10, "the key to be freed (the lock lives 30 s)")
        assert not _alive(pid), "the key was freed before the child exited"
        assert not r.exists(SCHEMA.lock(member))
        assert record(r, member)["state"] == ("revoked" if how == "terminate" else "failed")
    finally:
        worker.stop()
        app.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        return stat.read().rpartition(")")[2].split()[0] not in ("Z", "X")


# --------------------------------------------------------------------------- an ending the store could not take at once


def test_an_ending_is_recorded_when_the_store_comes_back(make_app: AppFactory, server: Server, r: redis.Redis) -> None:
    """The connection breaks just as the guard records a success (a server restart, a reset):
    the guard tries again, so the run is not left ``started`` for a later copy to run again.
    """
    port = urlparse(server.url).port
    assert port is not None
    for name in ("finish", "start", "renew"):
        r.execute_command("SCRIPT", "LOAD", load_script(name))
    with FaultProxy(port) as proxy:
        app = make_app("flaky", broker_url=proxy.url, result_backend=server.url, dedup_lock_ttl=30)
        client = redis.Redis.from_url(server.url)

        @app.task(base=DedupTask, name="late.recorded", dedup_key="k:{key}", bind=True, shared=False)
        def recorded(self: DedupTask, key: str) -> str:
            proxy.arm("before")  # the next script this worker runs is the guard's finish: cut it
            client.rpush("late:recorded", str(self.request.id))
            return key

        member = member_for(recorded.name, "k:r")
        with in_process_worker(app):
            run = recorded.delay("r")
            assert run.get(timeout=20) == "r"
            wait_for(
                lambda: record(r, member).get("state") == "succeeded", 15, lambda: f"the ending: {record(r, member)}"
            )
    assert [i.point for i in proxy.incidents] == ["before"], "the finish was cut once"
    assert not r.sismember(SCHEMA.held, member) and not r.exists(SCHEMA.lock(member))
