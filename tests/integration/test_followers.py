"""Duplicates with something to continue follow the accepted run: groups, chords, chains and callbacks resolve.

A duplicate call that carries its own id in a group or chord, callbacks
(``link``, ``link_error``) or a chain is parked as a *follower* of the run
that has its key. When that run ends, the follower's own message is
delivered and resolves as the run ended, without running the body: Celery
stores the run's result under the follower's id, applies its callbacks, goes
on with its chain and counts it in its chord.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
import redis
from celery import Celery, chain, chord, group
from celery.result import GroupResult

from celery_dedup import DedupTask, last_outcome, runtime
from celery_dedup.exceptions import DedupFollowerLimitError
from celery_dedup.keys import KeySchema, member_for
from celery_dedup.payloads import result_payload
from celery_dedup.worker.lock import new_token

from ..conftest import AppFactory, in_process_worker, queued_messages, wait_for

SCHEMA = KeySchema("dedup")


class Tasks:
    """Keyed tasks recording every body run in Redis, and plain callbacks recording their calls."""

    def __init__(self, app: Celery) -> None:
        client = redis.Redis.from_url(str(app.conf.broker_url))
        self.client = client
        prefix = f"follow.{uuid.uuid4().hex[:8]}"
        self.prefix = prefix

        @app.task(base=DedupTask, dedup_key="sync:{name}", bind=True, shared=False, name=f"{prefix}.sync")
        def sync(self: Any, name: str, seconds: float = 0.0, fail: bool = False) -> str:
            client.rpush(f"{prefix}:runs:{name}", str(self.request.id))
            time.sleep(seconds)
            if fail:
                raise RuntimeError(f"sync {name} failed")
            return f"synced {name}"

        @app.task(shared=False, name=f"{prefix}.collect")
        def collect(values: list[str]) -> list[str]:
            client.rpush(f"{prefix}:collected", repr(sorted(values)))
            return sorted(values)

        @app.task(shared=False, name=f"{prefix}.receipt")
        def receipt(value: str) -> str:
            client.rpush(f"{prefix}:receipts", value)
            return f"receipt for {value}"

        @app.task(shared=False, name=f"{prefix}.on_error")
        def on_error(request: Any, exc: BaseException, traceback: Any) -> None:
            client.rpush(f"{prefix}:errors", f"{request.id} {type(exc).__name__}: {exc}")

        self.sync, self.collect, self.receipt, self.on_error = sync, collect, receipt, on_error

    def runs(self, name: str) -> list[str]:
        return [raw.decode() for raw in self.client.lrange(f"{self.prefix}:runs:{name}", 0, -1)]

    def listed(self, what: str) -> list[str]:
        return [raw.decode() for raw in self.client.lrange(f"{self.prefix}:{what}", 0, -1)]


def test_a_group_with_a_duplicate_member_resolves_every_member(make_app: AppFactory, r: redis.Redis) -> None:
    app = make_app()
    tasks = Tasks(app)
    result = group(tasks.sync.s("A", 0.3), tasks.sync.s("A", 0.3), tasks.sync.s("B")).apply_async()
    assert isinstance(result, GroupResult)
    assert len(queued_messages(r)) == 2, "the duplicate member is parked, not queued"
    with in_process_worker(app, pool="threads", concurrency=2):
        assert result.get(timeout=20) == ["synced A", "synced A", "synced B"]
    assert len(tasks.runs("A")) == 1 and len(tasks.runs("B")) == 1
    follower = result.results[1]
    assert follower.id != result.results[0].id and follower.state == "SUCCESS"
    assert r.hlen(SCHEMA.followers(member_for(tasks.sync.name, "sync:A"))) == 0


def test_a_chord_with_duplicate_header_members_fires_its_body_once(make_app: AppFactory, r: redis.Redis) -> None:
    app = make_app()
    tasks = Tasks(app)
    header = [tasks.sync.s("A", 0.3), tasks.sync.s("A", 0.3), tasks.sync.s("B"), tasks.sync.s("A", 0.3)]
    result = chord(header, tasks.collect.s()).apply_async()
    with in_process_worker(app, pool="threads", concurrency=2):
        assert result.get(timeout=20) == ["synced A", "synced A", "synced A", "synced B"]
        time.sleep(0.5)
    assert len(tasks.runs("A")) == 1
    assert tasks.listed("collected") == [repr(["synced A", "synced A", "synced A", "synced B"])]


def test_a_chain_whose_first_task_is_a_duplicate_goes_on_once_the_run_ends(
    make_app: AppFactory, r: redis.Redis
) -> None:
    app = make_app()
    tasks = Tasks(app)
    first = tasks.sync.delay("order-42", 0.5)
    chained = chain(tasks.sync.s("order-42"), tasks.receipt.s()).apply_async()
    with in_process_worker(app, pool="threads", concurrency=2):
        assert chained.get(timeout=20) == "receipt for synced order-42"
        assert first.get(timeout=5) == "synced order-42"
    assert tasks.runs("order-42") == [first.id]
    assert tasks.listed("receipts") == ["synced order-42"]


def test_link_and_link_error_on_duplicates_run_once_with_the_runs_ending(make_app: AppFactory, r: redis.Redis) -> None:
    app = make_app()
    tasks = Tasks(app)
    ok = tasks.sync.delay("ok", 0.3)
    linked = tasks.sync.apply_async(("ok", 0.3), link=tasks.receipt.s())
    assert linked.deduplicated and linked.id == ok.id
    bad = tasks.sync.apply_async(("bad", 0.3, True))
    errored = tasks.sync.apply_async(("bad", 0.3, True), link_error=tasks.on_error.s())
    assert errored.deduplicated and errored.id == bad.id
    with in_process_worker(app, pool="threads", concurrency=2):
        wait_for(lambda: tasks.listed("receipts") and tasks.listed("errors"), 20, "the callbacks")
        time.sleep(0.5)
    assert tasks.listed("receipts") == ["synced ok"]
    [error] = tasks.listed("errors")
    assert "DedupFollowerError" in error and bad.id in error and "sync bad failed" in error
    assert tasks.runs("ok") == [ok.id] and tasks.runs("bad") == [bad.id]


def test_nested_canvas_resolves(make_app: AppFactory, r: redis.Redis) -> None:
    """A group inside a chord inside a chain, with duplicates at every level."""
    app = make_app()
    tasks = Tasks(app)
    inner = group(tasks.sync.si("A", 0.2), tasks.sync.si("A", 0.2))
    body = chord([inner, tasks.sync.si("A", 0.2), tasks.sync.si("B")], tasks.collect.s())
    flow = chain(tasks.sync.si("A", 0.2), body)
    result = flow.apply_async()
    with in_process_worker(app, pool="threads", concurrency=3):
        value = result.get(timeout=30)
    assert len(tasks.runs("A")) <= 2, "A runs once before the chord and at most once within it"
    assert value == ["synced A", "synced A", "synced A", "synced B"], "the inner group's members count one each"


def test_a_follower_of_a_lost_run_fails_naming_the_run(make_app: AppFactory, r: redis.Redis) -> None:
    """The accepted run's message is lost by the transport; the reaper marks it lost and the follower fails."""
    app = make_app(dedup_reap_interval=0.5, dedup_reap_grace=0.5)
    tasks = Tasks(app)
    lost = tasks.sync.delay("gone")
    assert r.rpop("celery") is not None  # a consumer's BRPOP, then its worker died before recording it
    follower = tasks.sync.apply_async(("gone",), link=tasks.receipt.s(), link_error=tasks.on_error.s())
    assert follower.deduplicated and follower.id == lost.id
    with in_process_worker(app, pool="threads", concurrency=2):
        wait_for(lambda: tasks.listed("errors"), 20, "the follower to fail")
    [error] = tasks.listed("errors")
    assert "DedupFollowerError" in error and lost.id in error and "lost" in error
    assert tasks.listed("receipts") == [] and tasks.runs("gone") == []


def test_the_reaper_leaves_followers_to_the_settle_right_after_their_runs_success(
    make_app: AppFactory, r: redis.Redis
) -> None:
    """Between recording a success and handing its value over, a follower parked long before is not failed as lost.

    The grace counts from the run's ending, not from when the follower was
    parked: any follower of a run slower than the grace was reaped in that gap.
    """
    app = make_app(dedup_reap_grace=0.5)
    tasks = Tasks(app)
    run = tasks.sync.delay("slow")
    assert tasks.sync.apply_async(("slow",), link=tasks.receipt.s()).deduplicated
    time.sleep(1.0)  # the run took longer than the grace
    store = runtime.store_for(app)
    member = member_for(tasks.sync.name, "sync:slow")
    # Its delivery starts and its body succeeds, as a worker records them.
    token = new_token()
    started = store.start(
        member,
        run.id,
        token,
        lock_ms=60_000,
        gated=True,
        key_mode="lock",
        hostname="worker-1",
        pid=4242,
        retries=0,
        record_ms=60_000,
    )
    assert started.run, started
    finished = store.finish(member, run.id, "succeeded", drop=True, record_ms=60_000, token=token, role="run")
    assert finished.wants_result

    runtime.reap(app)

    queued = [m["headers"]["id"] for m in queued_messages(r)]
    assert queued == [run.id], "the follower was released as lost before its run's value came"
    assert store.settle(member, run.id, result=result_payload(app, "synced slow"), record_ms=60_000) == 1
    with in_process_worker(app, pool="threads", concurrency=2):
        wait_for(lambda: tasks.listed("receipts"), 20, "the follower's callback")
    assert tasks.listed("receipts") == ["synced slow"]


def test_followers_beyond_the_bound_are_refused(make_app: AppFactory, r: redis.Redis) -> None:
    app = make_app(dedup_max_followers=2)
    tasks = Tasks(app)
    run = tasks.sync.delay("busy")
    for _ in range(2):
        assert tasks.sync.apply_async(("busy",), link=tasks.receipt.s()).deduplicated
    with pytest.raises(DedupFollowerLimitError) as info:
        tasks.sync.apply_async(("busy",), link=tasks.receipt.s())
    assert (info.value.run_id, info.value.limit) == (run.id, 2)
    plain = tasks.sync.delay("busy")
    assert plain.deduplicated and plain.id == run.id, "a call with nothing to continue is answered as before"
    assert r.hlen(SCHEMA.followers(member_for(tasks.sync.name, "sync:busy"))) == 2


def test_a_follower_of_a_finished_run_in_its_window_resolves_at_once(make_app: AppFactory, r: redis.Redis) -> None:
    """until_expired keeps the key after success: a follower in the window gets the run's result."""
    app = make_app()
    client = redis.Redis.from_url(str(app.conf.broker_url))

    @app.task(base=DedupTask, dedup_key="w:{n}", dedup_mode="until_expired", dedup_ttl=30, shared=False)
    def windowed(n: int) -> int:
        client.incr("follow:windowed")
        return n * 2

    tasks = Tasks(app)
    with in_process_worker(app, pool="threads", concurrency=2):
        first = windowed.delay(4)
        assert first.get(timeout=20) == 8
        member = member_for(windowed.name, "w:4")
        wait_for(lambda: r.hget(SCHEMA.record(member), "state") == b"succeeded", 10, "the run to be recorded")
        later = windowed.apply_async((4,), link=tasks.receipt.s())
        assert later.deduplicated and later.id == first.id
        wait_for(lambda: tasks.listed("receipts"), 20, "the follower's callback")
    assert tasks.listed("receipts") == ["8"]
    assert client.get("follow:windowed") == b"1"


def test_a_call_with_a_callback_joins_a_burst_and_later_calls_still_join(make_app: AppFactory, r: redis.Redis) -> None:
    """debounce: a call with ``link=`` joins the burst and follows its run, and says both; a later
    call from the same process still reaches the gate and joins, so the run takes the newest arguments.
    """
    app = make_app()
    client = redis.Redis.from_url(str(app.conf.broker_url))
    name = f"follow.{uuid.uuid4().hex[:8]}.debounced"

    @app.task(base=DedupTask, dedup_key="d:{n}", dedup_mode="debounce", dedup_window=1.0, shared=False, name=name)
    def debounced(n: int, v: str) -> str:
        client.rpush(f"{name}:ran", v)
        return v

    tasks = Tasks(app)
    first = debounced.delay(1, "a")
    joined = debounced.apply_async((1, "b"), link=tasks.receipt.s())
    outcome = last_outcome()
    assert outcome is not None and (outcome.followed, outcome.collapsed) == (True, True), outcome
    last = debounced.delay(1, "c")
    assert joined.id == first.id == last.id
    with in_process_worker(app, pool="threads", concurrency=2):
        assert first.get(timeout=20) == "c"
        wait_for(lambda: tasks.listed("receipts"), 20, "the joined call's callback")
    assert [raw.decode() for raw in client.lrange(f"{name}:ran", 0, -1)] == ["c"]
    assert tasks.listed("receipts") == ["c"]


def test_followers_of_a_run_still_executing_after_its_key_passed_on_wait_for_its_ending(
    make_app: AppFactory, r: redis.Redis
) -> None:
    """A throttle run starts after its window ran out; a new call takes the key while it executes.

    The reaper releases the followers of a run whose record passed to another
    run: its worker died before settling them. Not while that run still
    executes (its lock held by a delivery the record does not name): its
    ending settles them, with its value. Found by a chaos run: a chain parked
    on such a run failed as lost while the run was succeeding.
    """
    app = make_app(dedup_reap_grace=0.2)
    tasks = Tasks(app)

    @app.task(base=DedupTask, dedup_key="t:{n}", dedup_mode="throttle", dedup_window=0.3, shared=False)
    def throttled(n: int) -> str:
        return f"throttled {n}"

    run = throttled.delay(1)
    assert throttled.apply_async((1,), link=tasks.receipt.s()).deduplicated, "the call with a callback follows"
    time.sleep(0.5)  # the window runs out before any worker fetched the run
    runtime.reap(app)
    store = runtime.store_for(app)
    member = member_for(throttled.name, "t:1")
    token = new_token()
    started = store.start(
        member,
        run.id,
        token,
        lock_ms=60_000,
        gated=True,
        key_mode="window",
        hostname="worker-1",
        pid=4242,
        retries=0,
        record_ms=60_000,
    )
    assert started.run, started
    later = throttled.delay(1)
    assert not later.deduplicated, "premise: after its window, a new call is a new run"
    time.sleep(0.3)  # the follower was parked longer than the grace

    runtime.reap(app)

    queued = sorted(m["headers"]["id"] for m in queued_messages(r))
    assert queued == sorted([run.id, later.id]), "the follower was released while its run still executed"
    finished = store.finish(member, run.id, "succeeded", drop=False, record_ms=60_000, token=token, role="run")
    assert finished.wants_result
    assert store.settle(member, run.id, result=result_payload(app, "throttled 1"), record_ms=60_000) == 1
    with in_process_worker(app, pool="threads", concurrency=2):
        wait_for(lambda: tasks.listed("receipts"), 20, "the follower's callback")
    assert tasks.listed("receipts") == ["throttled 1"]
