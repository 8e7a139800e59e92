"""One named group's quota drawn from outside tasks (``limits.acquire``) and backed off from a body (``dedup_backoff``).

Callers in threads and processes of their own hold places in the same group
key the tasks' deliveries do, through the same script and waiting line; what
they held is checked from the server's clock (never more than the group
allows at once), and what they leave behind from the group's keys.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
from celery import Celery

from celery_dedup import DedupLimitTimeout, DedupTask, limits
from celery_dedup.exceptions import DedupArgumentError, DedupConfigError
from celery_dedup.keys import KeySchema, limit_group_member, member_for
from celery_dedup.policy import LimitPolicy
from celery_dedup.runtime import store_for
from celery_dedup.store import limits as store_limits

from .. import limits_web_app
from ..conftest import ROOT, AppFactory, Server, WorkerProcess, wait_for
from .test_limits import most_at_once

SCHEMA = KeySchema("dedup")


@pytest.fixture
def app(make_app: AppFactory) -> Celery:
    return make_app("web", dedup_limit_groups=limits_web_app.GROUPS)


def group_id(name: str, key: str | None = "acme") -> str:
    return limit_group_member(name, key)


def holds(r: redis.Redis) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in r.lrange(limits_web_app.HOLDS, 0, -1)]


def limited(app: Celery) -> int:
    """Refusals counted, every namespace."""
    return sum(counts.get("limited", 0) for counts in store_for(app).stats().values())


#: Runs ``tests.limits_web_app`` as ``python -m`` does, in a process gevent patched first (threads are greenlets).
GEVENT = (
    "from gevent import monkey; monkey.patch_all(); import runpy, sys; sys.argv[0] = 'limits_web_app'; "
    "runpy.run_module('tests.limits_web_app', run_name='__main__')"
)


def caller(server: Server, *args: str, gevent: bool = False) -> subprocess.Popen[str]:
    """A process of its own drawing on the quota (``python -m tests.limits_web_app ...``)."""
    env = dict(os.environ, CELERY_DEDUP_TEST_BROKER=server.url, PYTHONPATH=str(ROOT))
    start = ["-c", GEVENT] if gevent else ["-m", "tests.limits_web_app"]
    return subprocess.Popen(
        [sys.executable, *start, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture
def callers() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait()
        if process.stdout is not None:
            process.stdout.close()


# --- acquire ---------------------------------------------------------------------------------


def test_callers_in_threads_and_processes_never_hold_more_than_the_group_allows(
    server: Server, r: redis.Redis, app: Celery, callers: list[subprocess.Popen[str]]
) -> None:
    """Two processes of four threads (one with gevent: four greenlets) and four threads here race for 3 slots."""
    callers += [caller(server, "race", "4", "3", "0.1", gevent=gevent) for gevent in (False, True)]

    def loop(n: int) -> None:
        for _ in range(3):
            limits_web_app.hold(app, r, f"here:{n}", 0.1)

    threads = [threading.Thread(target=loop, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for process in callers:
        output = process.communicate(timeout=60)[0]
        assert process.returncode == 0, output
    done = holds(r)
    assert len(done) == 36
    assert most_at_once(done) <= 3, sorted((e["start"], e["end"]) for e in done)
    assert most_at_once(done) == 3, "the group is not stricter than declared"
    group = group_id("partner")
    assert r.zcard(SCHEMA.limit_slots(group)) == 0
    assert r.zcard(SCHEMA.limit_waiting(group)) == 0


def test_a_caller_that_waits_past_its_timeout_raises_and_leaves_the_line(r: redis.Redis, app: Celery) -> None:
    group = group_id("single")
    with limits.acquire(app, "single", key="acme") as holding:
        assert (holding.group, holding.key) == ("single", "acme")
        assert r.zscore(SCHEMA.limit_slots(group), holding.token) is not None
        started = time.monotonic()
        with pytest.raises(DedupLimitTimeout) as info, limits.acquire(app, "single", key="acme", timeout=0.4):
            pytest.fail("a second place in a group of one")
        took = time.monotonic() - started
        assert 0.4 <= took < 1.5, took
        assert (info.value.group, info.value.key, info.value.timeout) == ("single", "acme", 0.4)
        assert r.zcard(SCHEMA.limit_waiting(group)) == 0, "it left the line"
        assert r.zcard(SCHEMA.limit_deadlines(group)) == 0
        assert limited(app) <= 4, "it slept the script's waits, it did not spin"
        with pytest.raises(DedupLimitTimeout), limits.acquire(app, "single", key="acme", timeout=0):
            pytest.fail("timeout 0 is one try")
        assert r.zcard(SCHEMA.limit_slots(group)) == 1
    assert r.zcard(SCHEMA.limit_slots(group)) == 0


def test_waiting_callers_are_served_in_arrival_order(r: redis.Redis, app: Celery) -> None:
    group = group_id("single")
    order: list[str] = []

    def wait_turn(name: str) -> None:
        with limits.acquire(app, "single", key="acme", timeout=20):
            order.append(name)
            time.sleep(0.05)

    with limits.acquire(app, "single", key="acme"):
        first = threading.Thread(target=wait_turn, args=("first",))
        first.start()
        wait_for(lambda: r.zcard(SCHEMA.limit_waiting(group)) == 1, 5, "the first in line")
        second = threading.Thread(target=wait_turn, args=("second",))
        second.start()
        wait_for(lambda: r.zcard(SCHEMA.limit_waiting(group)) == 2, 5, "the second in line")
        time.sleep(0.3)
    first.join(20)
    second.join(20)
    assert order == ["first", "second"]


def test_an_exception_inside_the_block_gives_the_slot_back(r: redis.Redis, app: Celery) -> None:
    with pytest.raises(RuntimeError, match="boom"), limits.acquire(app, "single", key="acme"):
        raise RuntimeError("boom")
    assert r.zcard(SCHEMA.limit_slots(group_id("single"))) == 0
    with limits.acquire(app, "single", key="acme", timeout=0):
        pass


def test_a_block_longer_than_its_lease_keeps_its_slot(r: redis.Redis, app: Celery) -> None:
    with limits.acquire(app, "single", key="acme", lease=1) as holding:
        time.sleep(2.5)
        with pytest.raises(DedupLimitTimeout), limits.acquire(app, "single", key="acme", timeout=0):
            pytest.fail("the slot was renewed")
        assert not holding.lost
    assert r.zcard(SCHEMA.limit_slots(group_id("single"))) == 0


@pytest.mark.parametrize(
    ("parameter", "value"), [("timeout", -1), ("timeout", "5"), ("lease", 0.5), ("lease", float("nan"))]
)
def test_bad_timeouts_and_leases_are_refused(app: Celery, parameter: str, value: Any) -> None:
    with pytest.raises(DedupArgumentError) as info, limits.acquire(app, "single", **{parameter: value}):
        pytest.fail("held with a bad value")
    assert info.value.parameter == parameter


def test_a_process_killed_inside_the_block_frees_its_slot_at_once_for_a_caller_of_its_host(
    server: Server, r: redis.Redis, app: Celery, callers: list[subprocess.Popen[str]]
) -> None:
    """Its lease is 60 s; a refused caller on the same host finds its process gone and evicts its slot."""
    callers.append(caller(server, "hang", "single", "60"))
    wait_for(lambda: r.hlen(limits_web_app.HELD) == 1, 30, "the process holds its place")
    callers[0].kill()
    callers[0].wait()
    started = time.monotonic()
    with limits.acquire(app, "single", key="acme", timeout=5):
        assert time.monotonic() - started < 2
    assert sum(counts.get("limit_evicted", 0) for counts in store_for(app).stats().values()) == 1


def test_a_process_stopped_inside_the_block_loses_its_slot_within_one_lease(
    server: Server, r: redis.Redis, app: Celery, callers: list[subprocess.Popen[str]]
) -> None:
    """A process that lives but stops renewing (SIGSTOP) cannot be proven dead: its 1 s lease frees the slot."""
    callers.append(caller(server, "hang", "single", "1"))
    wait_for(lambda: r.hlen(limits_web_app.HELD) == 1, 30, "the process holds its place")
    os.kill(callers[0].pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with limits.acquire(app, "single", key="acme", timeout=5):
            assert time.monotonic() - started < 2.5
    finally:
        os.kill(callers[0].pid, signal.SIGCONT)


# --- back-off in the store -------------------------------------------------------------------


def test_a_back_off_pauses_the_key_and_puts_the_run_first_in_line(r: redis.Redis, app: Celery) -> None:
    store = store_for(app)
    group = group_id("single")
    one = LimitPolicy(None, concurrency=1)
    assert isinstance(
        store_limits.acquire(store, group, "h:1:a", "run-1", one, lease_ms=60_000, task_name="t"), store_limits.Grant
    )
    for run in ("run-2", "run-3"):
        store_limits.acquire(store, group, f"h:1:{run}", run, one, lease_ms=60_000, task_name="t")
    now = limits_web_app.server_ms(r)
    until = store_limits.back_off(store, group, "run-1", after_ms=5000, lease_ms=60_000)
    assert now + 5000 <= until <= now + 5100
    conf = SCHEMA.limit_conf(group.partition(":")[0])
    assert int(r.hget(conf, "k:acme:paused_until") or 0) == until
    assert r.ttl(conf) == -1, "the conf hash keeps no TTL"
    assert [m.decode() for m in r.zrange(SCHEMA.limit_waiting(group), 0, -1)] == ["run-1", "run-2", "run-3"]
    assert until + 60_000 - 10 <= (r.zscore(SCHEMA.limit_deadlines(group), "run-1") or 0) <= until + 60_000
    # A shorter back-off never shortens the pause; a pause until resumed stays one.
    assert store_limits.back_off(store, group, "run-1", after_ms=100, lease_ms=60_000) == until
    assert [m.decode() for m in r.zrange(SCHEMA.limit_waiting(group), 0, -1)] == ["run-1", "run-2", "run-3"]
    r.hset(conf, "k:acme:paused_until", -1)
    assert store_limits.back_off(store, group, "run-3", after_ms=100, lease_ms=60_000) == -1
    assert [m.decode() for m in r.zrange(SCHEMA.limit_waiting(group), 0, -1)] == ["run-3", "run-1", "run-2"]


def test_a_pause_that_ended_leaves_no_field_in_the_groups_conf(r: redis.Redis, app: Celery) -> None:
    """Each key that ever backed off would otherwise keep a ``k:<key>:paused_until`` field for good."""
    store = store_for(app)
    conf = SCHEMA.limit_conf(group_id("single").partition(":")[0])
    one = LimitPolicy(None, concurrency=1)
    for tenant in ("acme", "globex"):
        store_limits.back_off(store, group_id("single", tenant), f"run-{tenant}", after_ms=100, lease_ms=60_000)
    limits.pause(app, "single", until=datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=0.1))
    assert {f.decode() for f in r.hkeys(conf)} >= {"paused_until", "k:acme:paused_until", "k:globex:paused_until"}
    time.sleep(0.3)
    grant = store_limits.acquire(
        store, group_id("single", "acme"), "h:1:a", "run-acme", one, lease_ms=60_000, task_name="t"
    )
    assert isinstance(grant, store_limits.Grant)
    assert {f.decode() for f in r.hkeys(conf)} == {"k:globex:paused_until"}, "acme's and the group's pause ended"


# --- with real workers -------------------------------------------------------------------------


@contextmanager
def worker(server: Server, pool: str, concurrency: int) -> Iterator[WorkerProcess]:
    process = WorkerProcess(server.url, app="tests.limits_web_app", pool=pool, concurrency=concurrency)
    try:
        yield process.wait_ready()
    except BaseException:
        print("".join(process.output))
        raise
    finally:
        process.stop()


@pytest.fixture
def tasks(app: Celery) -> limits_web_app.Tasks:
    return limits_web_app.register(app)


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_callers_and_task_bodies_of_one_group_key_never_exceed_its_concurrency(
    server: Server,
    r: redis.Redis,
    app: Celery,
    tasks: limits_web_app.Tasks,
    callers: list[subprocess.Popen[str]],
    pool: str,
) -> None:
    """Bodies of group ``partner`` key ``acme`` on a worker, a caller process and threads here: 3 at once at most."""
    with worker(server, pool, concurrency=6) as process:
        for n in range(18):
            tasks.partner.delay(n, "acme")
        callers.append(caller(server, "race", "3", "3", str(limits_web_app.BODY_SECONDS)))

        def loop(n: int) -> None:
            for _ in range(3):
                limits_web_app.hold(app, r, f"here:{n}", limits_web_app.BODY_SECONDS)

        threads = [threading.Thread(target=loop, args=(n,)) for n in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert callers[0].wait(60) == 0
        wait_for(lambda: r.llen(limits_web_app.HOLDS) >= 36, 60, lambda: f"{r.llen(limits_web_app.HOLDS)} of 36")
        output = "".join(process.output)
    done = holds(r)
    assert Counter(e["who"] for e in done if e["who"].startswith("task:")) == {f"task:{n}": 1 for n in range(18)}
    assert most_at_once(done) <= 3, (sorted((e["start"], e["end"], e["who"]) for e in done), output)
    group = group_id("partner")
    assert r.zcard(SCHEMA.limit_slots(group)) == 0


def test_a_task_without_a_limit_group_cannot_back_off(app: Celery, tasks: limits_web_app.Tasks) -> None:
    def plain(n: int) -> int:
        return n

    unlimited = app.task(name="tests.limits_web_app.plain", base=DedupTask, shared=False)(plain)
    for task in (tasks.inline, unlimited):
        with pytest.raises(DedupConfigError) as info:
            task.dedup_backoff(5)
        assert info.value.task == task.name and task.name in str(info.value)
    bad: Any
    for bad in (0, -1, float("inf"), "5", True):
        with pytest.raises(DedupArgumentError) as bad_info:
            tasks.single.dedup_backoff(bad)
        assert bad_info.value.parameter == "retry_after"


@pytest.mark.slow
@pytest.mark.parametrize(("pool", "mode"), [("prefork", "keyed"), ("threads", "off")])
def test_a_back_off_pauses_its_key_only_and_its_run_comes_back_first_costing_no_retry(
    server: Server, r: redis.Redis, tasks: limits_web_app.Tasks, pool: str, mode: str
) -> None:
    """Run A0 backs off for 2 s while A1 and A2 wait for its slot (group ``single``: one at a time per key).

    A's runs wait for the pause, B's do not; A0 runs once more, first of A, with no retry spent.
    """
    task = tasks.single if mode == "keyed" else tasks.single_off
    r.sadd(limits_web_app.BACKOFF, "A0")
    r.sadd(limits_web_app.HOLD, "A0")
    line = SCHEMA.limit_waiting(group_id("single", "A"))
    with worker(server, pool, concurrency=4) as process:
        first = task.delay(0, "A")
        wait_for(lambda: r.zcard(SCHEMA.limit_slots(group_id("single", "A"))) == 1, 30, "A0 holds the slot")
        for n in (1, 2):
            task.delay(n, "A")
            wait_for(lambda: r.zcard(line) == n, 30, f"A{n} waits in line")  # noqa: B023 - called at once
        r.delete(limits_web_app.HOLD)
        wait_for(lambda: r.llen(limits_web_app.BACKED_OFF) == 1, 30, "A0 backed off")
        (backed,) = [json.loads(raw) for raw in r.lrange(limits_web_app.BACKED_OFF, 0, -1)]
        for n in (0, 1):
            task.delay(n, "B")
        wait_for(lambda: r.llen(limits_web_app.HOLDS) >= 5, 30, lambda: f"{r.llen(limits_web_app.HOLDS)} of 5")
        output = "".join(process.output)
    done = {e["who"]: e for e in holds(r)}
    assert sorted(done) == ["A0", "A1", "A2", "B0", "B1"], output
    pause_ends = backed["start"] + 2000
    assert all(done[who]["start"] >= pause_ends for who in ("A0", "A1", "A2")), (backed, done)
    assert all(done[who]["end"] < pause_ends for who in ("B0", "B1")), ("B waited for A's pause", backed, done)
    assert done["A0"]["start"] < min(done["A1"]["start"], done["A2"]["start"]), "A0 first after the pause"
    assert backed["retries"] == 0 and done["A0"]["retries"] == 0, "no Celery retry spent"
    assert first.get(timeout=10) == "A0"
    if mode == "keyed":
        status = task.dedup_status(0, "A")
        assert status is not None and status.state == "succeeded" and status.retries == 0, status
        history = store_for(task.app).history(member_for(task.name, "call:A:0"))
        assert any("waiting: backed off for 2s: A paused" in entry for entry in history), history


@pytest.mark.slow
def test_a_run_that_backs_off_after_a_newer_call_took_its_key_leaves_the_work_to_that_run(
    server: Server, r: redis.Redis, tasks: limits_web_app.Tasks
) -> None:
    """``until_executing`` run A0 frees its key as it starts; a call made meanwhile is run B; then A0 backs off.

    A0's re-publish is answered by B, as its ``Task.retry`` would be: A0
    leaves the key's line and does not come back (a ``skipped`` decision
    says so), B runs once, after the pause, not kept waiting behind A0.
    """
    task = tasks.single_started
    r.sadd(limits_web_app.BACKOFF, "A0")
    r.sadd(limits_web_app.HOLD, "A0")
    line = SCHEMA.limit_waiting(group_id("single", "A"))
    with worker(server, "threads", concurrency=2) as process:
        first = task.delay(0, "A")
        wait_for(lambda: r.zcard(SCHEMA.limit_slots(group_id("single", "A"))) == 1, 30, "A0 holds the slot")
        newer = task.delay(0, "A")
        assert not newer.deduplicated and newer.id != first.id, "the key was free once A0 started"
        r.delete(limits_web_app.HOLD)
        wait_for(lambda: r.llen(limits_web_app.BACKED_OFF) == 1, 30, "A0 backed off")
        (backed,) = [json.loads(raw) for raw in r.lrange(limits_web_app.BACKED_OFF, 0, -1)]
        wait_for(lambda: r.llen(limits_web_app.HOLDS) == 1, 30, "run B ran")
        assert newer.get(timeout=10) == "A0"
        time.sleep(1.0)  # room for a copy of A0 that should not come
        output = "".join(process.output)
    (done,) = holds(r)
    assert done["id"] == newer.id and done["start"] >= backed["start"] + 2000, (backed, done)
    assert r.zscore(line, first.id) is None, "A0 left the line"
    assert f"skipped: {task.name}[{first.id}]" in output and f"after run {newer.id} took its key" in output, output
    assert first.state == "RETRY"


@pytest.mark.slow
def test_a_back_off_pauses_its_key_for_callers_too_with_places_free(
    server: Server, r: redis.Redis, app: Celery, tasks: limits_web_app.Tasks
) -> None:
    """Group ``partner`` has 3 slots: after a body of key ``acme`` backs off, 2 are free, yet no caller gets one."""
    r.sadd(limits_web_app.BACKOFF, "task:9")
    with worker(server, "prefork", concurrency=2):
        tasks.partner.delay(9, "acme")
        wait_for(lambda: r.llen(limits_web_app.BACKED_OFF) == 1, 30, "the body backed off")
        wait_for(lambda: r.zcard(SCHEMA.limit_slots(group_id("partner"))) == 0, 10, "its slot given back")
        with pytest.raises(DedupLimitTimeout), limits.acquire(app, "partner", key="acme", timeout=0.5):
            pytest.fail("a place in a paused key")
        with limits.acquire(app, "partner", key="other", timeout=0):
            pass  # another key of the group is not paused
        wait_for(lambda: r.llen(limits_web_app.HOLDS) == 1, 10, "the run came back")
        with limits.acquire(app, "partner", key="acme", timeout=0):
            pass
    assert [e["who"] for e in holds(r)] == ["task:9"]
