"""The windowed modes on a real server and real workers: debounce (parked runs) and throttle.

Task bodies log every execution (arguments, task id, start and end times) to
Redis, so the assertions read what actually ran, whichever thread ran it.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import signal
import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery import Celery
from celery.utils.saferepr import saferepr

from celery_dedup import DedupConfigError, DedupResult, DedupTask
from celery_dedup.keys import KeySchema, member_for
from celery_dedup.runtime import config_for, store_for
from celery_dedup.worker.bootsteps import DispatchStep

from ..conftest import (
    AppFactory,
    Server,
    WorkerProcess,
    history,
    in_process_worker,
    queued_messages,
    wait_for,
)
from ..windowed_app import register, runs_key

SCHEMA = KeySchema("dedup")
WINDOW = 0.3


# --------------------------------------------------------------------------- helpers


def server_ms(r: redis.Redis) -> int:
    seconds, micros = r.time()
    return int(seconds) * 1000 + int(micros) // 1000


def record_of(r: redis.Redis, member: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in r.hgetall(SCHEMA.record(member)).items()}


def history_of(r: redis.Redis, member: str) -> list[list[str]]:
    """``[state, task id, note]`` of each history entry, oldest first."""
    entries = [entry.split(" ", 3)[1:] for entry in reversed(history(r, member))]
    return [entry + [""] * (3 - len(entry)) for entry in entries]


def wait_state(r: redis.Redis, member: str, state: str, task_id: str | None = None, timeout: float = 10) -> None:
    def reached() -> bool:
        record = record_of(r, member)
        return record.get("state") == state and task_id in (None, record.get("task_id"))

    wait_for(reached, timeout, lambda: f"{member} in state {state} ({task_id}); record {record_of(r, member)}")


def wait_server_ms(r: redis.Redis, until_ms: int) -> None:
    """Sleep until the server clock (the one the scripts read) reaches ``until_ms``."""
    while (now := server_ms(r)) < until_ms:
        time.sleep((until_ms - now) / 1000 + 0.005)


def dispatchers(worker: Any) -> list[DispatchStep]:
    return [step for step in worker.steps if isinstance(step, DispatchStep)]


def unique(name: str) -> str:
    # Apps of earlier tests linger, and the publish hook looks tasks up by name in every one.
    return f"windowed.{uuid.uuid4().hex[:8]}.{name}"


class Runs:
    """Executions of a test's tasks, logged to Redis by the bodies."""

    def __init__(self, server: Server) -> None:
        self.client = server.client()
        self.key = f"test:runs:{uuid.uuid4().hex}"

    def log(self, task_id: str, args: list[Any], start: float) -> None:
        entry = {"id": task_id, "args": args, "start": start, "end": time.time()}
        self.client.rpush(self.key, json.dumps(entry))

    def all(self) -> list[dict[str, Any]]:
        return [json.loads(raw) for raw in self.client.lrange(self.key, 0, -1)]

    def close(self) -> None:
        self.client.close()


@pytest.fixture
def runs(server: Server) -> Iterator[Runs]:
    log = Runs(server)
    yield log
    log.close()


def windowed_task(app: Celery, runs: Runs, *, sleep: float = 0.0, fail_first: bool = False, **options: Any) -> Any:
    """A task keyed ``k:{k}`` that logs its executions; ``options`` are its dedup options."""
    attempts = itertools.count(1)

    @app.task(base=DedupTask, bind=True, shared=False, name=unique("work"), dedup_key="k:{k}", **options)
    def work(self: Any, k: int, v: Any = None) -> Any:
        start = time.time()
        time.sleep(sleep)
        runs.log(self.request.id, [k, v], start)
        if fail_first and next(attempts) == 1:
            raise ValueError(f"failing on purpose: {v!r}")
        return v

    return work


def debounced(app: Celery, runs: Runs, window: float = WINDOW, **options: Any) -> Any:
    return windowed_task(app, runs, dedup_mode="debounce", dedup_window=window, **options)


def member_of(task: Any, k: int) -> str:
    return member_for(task.name, task.dedup_business_key(k))


# --------------------------------------------------------------------------- configuration


def _define(app: Celery, name: str = "shop.windowed", **options: Any) -> Any:
    @app.task(base=DedupTask, shared=False, name=name, dedup_key="k:{k}", **options)
    def windowed(k: int) -> int:
        return k

    return windowed


@pytest.mark.parametrize("mode", ["debounce", "throttle"])
def test_window_is_required_by_windowed_modes(make_app: AppFactory, mode: str) -> None:
    """Debounce and throttle without dedup_window fail at definition, naming task and option."""
    app = make_app()
    app.finalize()
    with pytest.raises(DedupConfigError) as info:
        _define(app, dedup_mode=mode)
    assert (info.value.task, info.value.setting) == ("shop.windowed", "dedup_window")
    assert "shop.windowed" in str(info.value) and "dedup_window" in str(info.value)


@pytest.mark.parametrize(
    ("options", "setting"),
    [
        pytest.param({"dedup_window": 1}, "dedup_window", id="window-on-until-executed"),
        pytest.param({"dedup_mode": "until_expired", "dedup_window": 1}, "dedup_window", id="window-on-until-expired"),
        pytest.param({"dedup_max_wait": 5}, "dedup_max_wait", id="max-wait-on-default-mode"),
        pytest.param({"dedup_debounce": "first"}, "dedup_debounce", id="debounce-on-default-mode"),
        pytest.param(
            {"dedup_mode": "throttle", "dedup_window": 1, "dedup_max_wait": 5}, "dedup_max_wait", id="max-wait-throttle"
        ),
        pytest.param(
            {"dedup_mode": "throttle", "dedup_window": 1, "dedup_debounce": "latest"},
            "dedup_debounce",
            id="debounce-on-throttle",
        ),
        pytest.param(
            {"dedup_mode": "debounce", "dedup_window": 2, "dedup_max_wait": 1}, "dedup_max_wait", id="max-wait-short"
        ),
        pytest.param(
            {"dedup_mode": "debounce", "dedup_window": 1, "dedup_debounce": "last"},
            "dedup_debounce",
            id="debounce-unknown",
        ),
        pytest.param({"dedup_mode": "debounce", "dedup_window": 0}, "dedup_window", id="window-zero"),
        pytest.param({"dedup_mode": "throttle", "dedup_window": "1"}, "dedup_window", id="window-str"),
        pytest.param({"dedup_mode": "throttle", "dedup_window": 1, "dedup_ttl": 5}, "dedup_ttl", id="ttl-throttle"),
    ],
)
def test_windowed_options_are_checked(make_app: AppFactory, options: dict[str, Any], setting: str) -> None:
    """Each window option applies only to its modes, with a valid value; errors name task and option."""
    app = make_app()
    app.finalize()
    with pytest.raises(DedupConfigError) as info:
        _define(app, **options)
    assert (info.value.task, info.value.setting) == ("shop.windowed", setting)
    assert setting in str(info.value)


def test_windowed_policies_resolve(make_app: AppFactory) -> None:
    """Debounce reschedules a run that meets a locked key unless told otherwise; max wait defaults to 10 windows."""
    app = make_app()
    app.finalize()
    plain = _define(app, dedup_mode="debounce", dedup_window=0.5).dedup_policy
    assert (plain.on_locked, plain.window, plain.max_wait, plain.debounce) == ("reschedule", 0.5, 5.0, "latest")

    told = _define(
        app,
        "shop.told",
        dedup_mode="debounce",
        dedup_window=1,
        dedup_max_wait=1,
        dedup_debounce="first",
        dedup_on_locked="skip",
    ).dedup_policy
    assert (told.on_locked, told.window, told.max_wait, told.debounce) == ("skip", 1.0, 1.0, "first")

    throttle = _define(app, "shop.throttle", dedup_mode="throttle", dedup_window=2).dedup_policy
    assert (throttle.on_locked, throttle.window, throttle.max_wait) == ("skip", 2.0, None)
    assert throttle.mode.holds_after_success


@pytest.mark.parametrize("value", [0, -1, "0.1", True, math.inf, None])
def test_dispatch_interval_is_validated(make_app: AppFactory, value: Any) -> None:
    with pytest.raises(DedupConfigError) as info:
        make_app(dedup_dispatch_interval=value)
    assert info.value.setting == "dedup_dispatch_interval"


def test_dispatch_interval_is_read(make_app: AppFactory) -> None:
    assert config_for(make_app()).dispatch_interval == 0.1
    assert config_for(make_app(dedup_dispatch_interval=0.5)).dispatch_interval == 0.5


# --------------------------------------------------------------------------- non-Redis broker


def test_debounce_needs_the_redis_broker(make_app: AppFactory, server: Server, runs: Runs, r: redis.Redis) -> None:
    """On memory:// a debounced run cannot be parked: the task is refused at start-up (when the app binds it);
    one bound while the app was eager is refused by delay() once it is not, and writes nothing."""
    app = make_app(broker_url="memory://", dedup_redis_url=server.url, task_default_queue=unique("q"))
    work = debounced(app, runs)
    with pytest.raises(DedupConfigError) as info:
        app.finalize()
    assert info.value.task == work.name and info.value.setting == "dedup_mode"
    assert "memory:// is not Redis" in info.value.reason

    eager = make_app("eager", broker_url="memory://", dedup_redis_url=server.url, task_always_eager=True)
    work = debounced(eager, runs)
    eager.finalize()
    eager.conf.task_always_eager = False
    with pytest.raises(DedupConfigError) as info:
        work.delay(1, "a")
    assert info.value.task == work.name and info.value.setting == "dedup_mode"
    assert r.keys("dedup:*") == []


def test_a_worker_with_a_debounced_task_refuses_to_start_on_another_broker(
    make_app: AppFactory, server: Server, runs: Runs
) -> None:
    """The dispatcher step fails the worker's start-up, naming the debounced task, instead of parking nothing
    (a task bound while the app was eager got past its binding's check)."""
    app = make_app(broker_url="memory://", dedup_redis_url=server.url, task_always_eager=True)
    work = debounced(app, runs)
    app.finalize()
    app.conf.task_always_eager = False
    worker = SimpleNamespace(app=app)
    with pytest.raises(DedupConfigError, match=re.escape(work.name)):
        DispatchStep(worker).start(worker)


def test_debounce_runs_at_once_when_eager(make_app: AppFactory, server: Server, runs: Runs) -> None:
    """With task_always_eager every call runs inline, debounce or not: nothing is parked."""
    app = make_app(broker_url="memory://", dedup_redis_url=server.url, task_always_eager=True)
    work = debounced(app, runs, window=30)
    assert work.delay(1, "a").get(timeout=1) == "a"
    assert work.delay(1, "b").get(timeout=1) == "b"
    assert [run["args"] for run in runs.all()] == [[1, "a"], [1, "b"]]


# --------------------------------------------------------------------------- parked runs


def test_pending_record_collects_the_burst(make_app: AppFactory, runs: Runs, r: redis.Redis) -> None:
    """A burst is one pending record: calls join it, count, and leave the newest arguments; nothing is queued."""
    app = make_app()
    work = debounced(app, runs, window=30, dedup_max_wait=60)
    member = member_of(work, 1)

    first = work.delay(1, "a")
    record = record_of(r, member)
    assert not first.deduplicated
    assert (record["state"], record["task_id"], record.get("debounced", "0")) == ("pending", first.id, "0")
    assert int(record["due_at"]) - int(record["first_at"]) == 30_000
    assert r.zscore(SCHEMA.due, member) == int(record["due_at"])
    assert "message" in record and "payload" in record

    later = [work.delay(1, v) for v in ("b", "c")]
    later.append(work.delay(k=1, v="d"))
    assert all(isinstance(res, DedupResult) and res.deduplicated and res.id == first.id for res in later)
    record = record_of(r, member)
    assert (record["state"], record["task_id"], record["debounced"]) == ("pending", first.id, "3")
    assert record["kwargs"] == saferepr({"k": 1, "v": "d"})
    assert int(record["first_at"]) < int(record["due_at"]) <= int(record["first_at"]) + 60_000
    assert r.zscore(SCHEMA.due, member) == int(record["due_at"])

    assert store_for(app).dispatch().pushed == 0, "a run 30 s from due was pushed"
    assert queued_messages(r) == []
    assert record_of(r, member)["state"] == "pending"


def test_pending_record_shows_the_latest_positional_args(make_app: AppFactory, runs: Runs, r: redis.Redis) -> None:
    work = debounced(make_app(), runs, window=30)
    work.delay(1, "a")
    work.delay(1, "b")
    assert record_of(r, member_of(work, 1))["args"] == saferepr((1, "b"))


def test_due_time_moves_back_but_never_past_max_wait(make_app: AppFactory, runs: Runs, r: redis.Redis) -> None:
    """Each call pushes the due time to now + window, capped at first call + max wait."""
    window, max_wait = 0.4, 1.0
    work = debounced(make_app(), runs, window=window, dedup_max_wait=max_wait)
    member = member_of(work, 1)
    work.delay(1, 0)
    first_at = int(record_of(r, member)["first_at"])
    dues = [int(record_of(r, member)["due_at"])]
    for v in range(1, 8):
        time.sleep(0.2)
        before = server_ms(r)
        assert work.delay(1, v).deduplicated
        after = server_ms(r)
        due = int(record_of(r, member)["due_at"])
        assert min(before + 400, first_at + 1000) <= due <= min(after + 400, first_at + 1000)
        dues.append(due)
    assert dues == sorted(dues) and dues[1] > dues[0]
    assert dues[-1] == first_at + 1000, "the last calls came after max wait: the due time must be capped"
    record = record_of(r, member)
    assert (record["state"], record["debounced"]) == ("pending", "7")
    assert queued_messages(r) == []


@pytest.mark.parametrize(("how", "expected"), [("latest", "c"), ("first", "a")])
def test_run_executes_once_with_the_chosen_arguments(
    make_app: AppFactory, runs: Runs, r: redis.Redis, how: str, expected: str
) -> None:
    """One run per burst, with the newest call's arguments (``latest``) or the first call's (``first``)."""
    app = make_app()
    work = debounced(app, runs, dedup_debounce=how)
    member = member_of(work, 1)
    results = [work.delay(1, v="a"), work.delay(1, v="b"), work.delay(1, v="c")]
    assert [res.deduplicated for res in results] == [False, True, True]
    with in_process_worker(app):
        assert results[0].get(timeout=10) == expected
        wait_state(r, member, "succeeded", results[0].id)
    assert [(run["id"], run["args"]) for run in runs.all()] == [(results[0].id, [1, expected])]
    assert queued_messages(r) == []


def test_parked_run_waits_for_a_worker_and_runs_once(make_app: AppFactory, runs: Runs, r: redis.Redis) -> None:
    """Nothing pushes a due run while no worker runs; the first worker to start does, once."""
    app = make_app()
    work = debounced(app, runs)
    member = member_of(work, 7)
    first = work.delay(7, "a")
    work.delay(7, "b")
    wait_server_ms(r, int(record_of(r, member)["due_at"]) + 300)
    assert record_of(r, member)["state"] == "pending"
    assert queued_messages(r) == []

    with in_process_worker(app):
        assert first.get(timeout=10) == "b"
        wait_state(r, member, "succeeded", first.id)
    assert [(run["id"], run["args"]) for run in runs.all()] == [(first.id, [7, "b"])]
    assert r.zcard(SCHEMA.due) == 0


@pytest.mark.slow
def test_worker_process_dispatches_parked_bursts_with_their_latest_arguments(
    make_app: AppFactory, server: Server, r: redis.Redis
) -> None:
    """A ``celery worker`` (prefork) started after the bursts pushes each once; children run the newest arguments."""
    work = register(make_app())
    bursts = {k: [work.apply_async((k, f"{k}-{n}")) for n in range(4)] for k in (1, 2)}
    for results in bursts.values():
        assert [res.deduplicated for res in results] == [False, True, True, True]
        assert len({res.id for res in results}) == 1
    members = {k: member_for(work.name, work.dedup_business_key(k)) for k in bursts}
    wait_server_ms(r, max(int(record_of(r, m)["due_at"]) for m in members.values()) + 300)
    assert {record_of(r, m)["state"] for m in members.values()} == {"pending"}

    worker = WorkerProcess(server.url, app="tests.windowed_app", concurrency=2)
    try:
        worker.wait_ready()
        for k, member in members.items():
            wait_state(r, member, "succeeded", bursts[k][0].id, timeout=20)
    finally:
        worker.stop(signal.SIGTERM)
    for k, results in bursts.items():
        logged = [json.loads(raw) for raw in r.lrange(runs_key(k), 0, -1)]
        assert [(run["id"], run["args"]) for run in logged] == [(results[0].id, [k, f"{k}-3"])]
    assert queued_messages(r) == [] and r.zcard(SCHEMA.due) == 0


def test_history_of_a_debounced_run(make_app: AppFactory, runs: Runs, r: redis.Redis) -> None:
    """pending (first call) -> queued, noting how many calls the run answers -> started -> succeeded."""
    app = make_app()
    work = debounced(app, runs)
    member = member_of(work, 3)
    first = work.delay(3, "a")
    work.delay(3, "b")
    work.delay(3, "c")
    with in_process_worker(app):
        first.get(timeout=10)
        wait_state(r, member, "succeeded", first.id)
    assert history_of(r, member) == [
        ["pending", first.id, ""],
        ["queued", first.id, "3 calls"],
        ["started", first.id, ""],
        ["succeeded", first.id, ""],
    ]


def test_failed_debounced_run_frees_its_key(make_app: AppFactory, runs: Runs, r: redis.Redis) -> None:
    """A failure ends the run (failed) and drops the key: the next call opens a new burst, which runs."""
    app = make_app()
    work = debounced(app, runs, fail_first=True)
    member = member_of(work, 5)
    with in_process_worker(app):
        first = work.delay(5, "a")
        wait_state(r, member, "failed", first.id)
        assert not r.sismember(SCHEMA.held, member)
        assert "failing on purpose" in record_of(r, member)["error"]

        second = work.delay(5, "b")
        assert not second.deduplicated and second.id != first.id
        assert second.get(timeout=10) == "b"
        wait_state(r, member, "succeeded", second.id)
    assert [(run["id"], run["args"]) for run in runs.all()] == [(first.id, [5, "a"]), (second.id, [5, "b"])]


@pytest.mark.slow
def test_call_during_a_run_opens_a_burst_that_runs_after_it(make_app: AppFactory, runs: Runs, r: redis.Redis) -> None:
    """The key is released at start; the next burst's run meets the lock, is rescheduled, and runs afterwards."""
    app = make_app()
    work = debounced(app, runs, sleep=1.0, dedup_lock_ttl=1.0)
    member = member_of(work, 9)
    with in_process_worker(app, pool="threads", concurrency=2):
        first = work.delay(9, "a")
        wait_state(r, member, "started", first.id)
        second = work.delay(9, "b")
        assert not second.deduplicated and second.id != first.id
        assert second.get(timeout=20) == "b"
        wait_state(r, member, "succeeded", second.id)
        assert first.get(timeout=1) == "a"
    done = runs.all()
    assert [(run["id"], run["args"]) for run in done] == [(first.id, [9, "a"]), (second.id, [9, "b"])]
    assert done[0]["end"] <= done[1]["start"], f"runs overlapped: {done}"
    second_history = [entry for entry in history_of(r, member) if entry[1] == second.id]
    assert [entry[0] for entry in second_history] == ["pending", "queued", "started", "succeeded"]


def test_a_retry_of_a_started_run_never_joins_the_next_burst(make_app: AppFactory, runs: Runs, r: redis.Redis) -> None:
    """Run A retries after a new call opened the next burst B: A's retry is answered as a duplicate of B.

    It must not join B's burst: a retry re-publishes A's arguments, and joining
    would hand B, which belongs to a later call, arguments from before it.
    """
    # B's delivery may find A still holding its lock (a loaded machine): its deferral waits out the lock's TTL.
    app = make_app(dedup_lock_ttl=2)
    go = f"test:go:{uuid.uuid4().hex}"

    @app.task(
        base=DedupTask,
        bind=True,
        shared=False,
        name=unique("retrying"),
        dedup_key="k:{k}",
        dedup_mode="debounce",
        dedup_window=0.2,
    )
    def work(self: Any, k: int, v: Any = None) -> Any:
        runs.log(self.request.id, [k, v], time.time())
        if v == "a" and self.request.retries == 0 and r.incr(f"{go}:calls") == 1:
            wait_for(lambda: r.lpop(go), 10, "the test to let the first run go on")
            raise self.retry(countdown=0.1)
        return v

    member = member_of(work, 3)
    with in_process_worker(app, pool="threads", concurrency=2):
        first = work.delay(3, "a")
        wait_state(r, member, "started", first.id)
        second = work.delay(3, "b")
        assert not second.deduplicated and second.id != first.id
        r.rpush(go, "1")
        assert second.get(timeout=20) == "b"
        wait_state(r, member, "succeeded", second.id)
    assert [(run["id"], run["args"]) for run in runs.all()] == [(first.id, [3, "a"]), (second.id, [3, "b"])]
    record = record_of(r, member)
    assert record.get("debounced", "0") == "0", f"the retry joined the burst: {record}"
    assert record["duplicates"] == "1", f"the retry was not answered as a duplicate: {record}"
    assert first.state == "RETRY"


# --------------------------------------------------------------------------- throttle and windows


def throttled(app: Celery, runs: Runs, window: float, **options: Any) -> Any:
    return windowed_task(app, runs, dedup_mode="throttle", dedup_window=window, **options)


def test_throttle_holds_the_key_to_the_window_end_not_the_lock_ttl(
    make_app: AppFactory, runs: Runs, r: redis.Redis
) -> None:
    app = make_app()
    window = 1.0
    work = throttled(app, runs, window, dedup_lock_ttl=60)
    member = member_of(work, 1)
    with in_process_worker(app):
        first = work.delay(1, "a")
        assert first.get(timeout=10) == "a"
        wait_state(r, member, "succeeded", first.id)
        record = record_of(r, member)
        window_end = int(record["queued_at"]) + 1000
        assert int(record["held_until"]) == window_end, (record, history_of(r, member))
        if server_ms(r) < window_end - 100:
            inside = work.delay(1, "b")
            assert inside.deduplicated and inside.id == first.id

        wait_server_ms(r, window_end + 200)
        after = work.delay(1, "c")
        assert not after.deduplicated and after.id != first.id
        assert after.get(timeout=10) == "c"
    assert [run["args"] for run in runs.all()] == [[1, "a"], [1, "c"]]


def test_throttle_duplicate_inside_the_window(make_app: AppFactory, runs: Runs, r: redis.Redis) -> None:
    """Inside the window (before or after the run) a call is a duplicate answered with the run."""
    app = make_app()
    work = throttled(app, runs, 30, dedup_lock_ttl=60)
    member = member_of(work, 2)
    first = work.delay(2, "a")
    assert work.delay(2, "b").id == first.id
    with in_process_worker(app):
        first.get(timeout=10)
        wait_state(r, member, "succeeded", first.id)
    again = work.delay(2, "c")
    assert again.deduplicated and again.id == first.id
    assert r.sismember(SCHEMA.held, member)
    assert [run["args"] for run in runs.all()] == [[2, "a"]]


def test_failed_throttled_run_frees_the_key(make_app: AppFactory, runs: Runs, r: redis.Redis) -> None:
    app = make_app()
    work = windowed_task(app, runs, fail_first=True, dedup_mode="throttle", dedup_window=30)
    member = member_of(work, 4)
    with in_process_worker(app):
        first = work.delay(4, "a")
        wait_state(r, member, "failed", first.id)
        assert not r.sismember(SCHEMA.held, member)
        second = work.delay(4, "b")
        assert not second.deduplicated and second.id != first.id
        assert second.get(timeout=10) == "b"
    assert [run["args"] for run in runs.all()] == [[4, "a"], [4, "b"]]


def test_until_expired_window_shorter_than_the_lock_ttl_ends_on_time(
    make_app: AppFactory, runs: Runs, r: redis.Redis
) -> None:
    """Regression: after success the key was held for the 60 s lock TTL instead of the 1 s dedup_ttl."""
    app = make_app()
    work = windowed_task(app, runs, dedup_mode="until_expired", dedup_ttl=1)
    member = member_of(work, 6)
    with in_process_worker(app):
        first = work.delay(6, "a")
        first.get(timeout=10)
        wait_state(r, member, "succeeded", first.id)
        queued_at = int(record_of(r, member)["queued_at"])
        assert int(record_of(r, member)["held_until"]) == queued_at + 1000
        wait_server_ms(r, queued_at + 1300)
        second = work.delay(6, "b")
        assert not second.deduplicated and second.id != first.id
        assert second.get(timeout=10) == "b"
    assert [run["args"] for run in runs.all()] == [[6, "a"], [6, "b"]]


def test_stopped_in_process_worker_stops_dispatching(make_app: AppFactory, runs: Runs, r: redis.Redis) -> None:
    """The test worker shuts down by terminating: its dispatcher must stop too, or it pushes later runs."""
    app = make_app()
    work = debounced(app, runs)
    member = member_of(work, 8)
    with in_process_worker(app) as started:
        pass
    assert [step.thread for step in dispatchers(started)] == [None]
    work.delay(8, "a")
    wait_server_ms(r, int(record_of(r, member)["due_at"]) + 300)
    assert record_of(r, member)["state"] == "pending", "a stopped worker's dispatcher pushed the run"


# --------------------------------------------------------------------------- outcomes kept for followers

#: Runs of one key in the outcome tests: more than a busy key's history of a day would hold.
MANY_RUNS = 30


@pytest.mark.parametrize(
    "options",
    [{"dedup_mode": "throttle", "dedup_window": 0.1}, {"dedup_mode": "until_expired", "dedup_ttl": 0.1}],
    ids=["throttle", "until_expired"],
)
def test_a_key_held_after_success_keeps_only_its_current_runs_outcome(
    make_app: AppFactory, runs: Runs, r: redis.Redis, options: dict[str, Any]
) -> None:
    """Each run keeps its return value for the followers of its window; earlier runs' values go.

    Regression: every run's value stayed in the key's outcomes hash, whose expiry each run re-armed.
    """
    app = make_app()
    work = windowed_task(app, runs, **options)
    member = member_of(work, 7)
    with in_process_worker(app):
        for i in range(MANY_RUNS):
            run = work.delay(7, f"value {i}")
            assert not run.deduplicated, f"run {i} found the key still held"
            assert run.get(timeout=10) == f"value {i}"
            wait_state(r, member, "succeeded", run.id)
            wait_server_ms(r, int(record_of(r, member)["held_until"]) + 20)
    assert len(runs.all()) == MANY_RUNS
    kept = {k.decode(): json.loads(v) for k, v in r.hgetall(SCHEMA.outcomes(member)).items()}
    assert list(kept) == [run.id], f"{len(kept)} outcomes kept after {MANY_RUNS} runs"
    assert kept[run.id]["state"] == "succeeded"


def test_a_follower_still_on_its_way_gets_its_own_runs_outcome_after_later_runs(
    make_app: AppFactory, runs: Runs, r: redis.Redis
) -> None:
    """Outcomes a released follower has yet to read are kept; a follower in a later window gets that window's run.

    Each follower's message waits in a queue no worker reads until the key has run again.
    """
    app = make_app()
    work = windowed_task(app, runs, dedup_mode="throttle", dedup_window=0.3)
    client = redis.Redis.from_url(str(app.conf.broker_url))
    receipts = f"windowed:receipts:{uuid.uuid4().hex}"

    @app.task(shared=False, name=unique("receipt"))
    def receipt(value: str) -> None:
        client.rpush(receipts, value)

    member = member_of(work, 8)
    followers = []
    with in_process_worker(app):
        for i in range(3):
            run = work.delay(8, f"run {i}")
            assert not run.deduplicated and run.get(timeout=10) == f"run {i}"
            wait_state(r, member, "succeeded", run.id)
            follower = work.apply_async((8, "never run"), link=receipt.s(), queue="later")
            assert follower.deduplicated and follower.id == run.id
            followers.append(follower)
            wait_server_ms(r, int(record_of(r, member)["held_until"]) + 20)
    assert r.hlen(SCHEMA.outcomes(member)) == 3, "each follower on its way keeps its run's outcome"
    with in_process_worker(app, queues=["later", "celery"]):
        wait_for(lambda: client.llen(receipts) == 3, 20, "the followers' callbacks")
    assert sorted(raw.decode() for raw in client.lrange(receipts, 0, -1)) == ["run 0", "run 1", "run 2"]
    assert [run["args"][1] for run in runs.all()] == ["run 0", "run 1", "run 2"]
    client.close()
