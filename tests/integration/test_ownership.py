"""Only the owner acts on what it owns, checked script by script on the real server.

Each script that touches a lock or a record is driven directly (as the guard,
a report or the renewer would drive it) into the states where it used to act
on something another run or delivery owned.
"""

from __future__ import annotations

import time

import pytest
import redis

from celery_dedup.keys import KeySchema
from celery_dedup.store.store import DedupStore, StartDecision

SCHEMA = KeySchema("dedup")
MEMBER = "own.task:k"
DAY_MS = 86_400_000


@pytest.fixture
def store(r: redis.Redis) -> DedupStore:
    return DedupStore(r, "dedup")


def decide(
    store: DedupStore, task_id: str, token: str, *, key_mode: str = "lock", lock_ms: int = 60_000, gated: bool = True
) -> StartDecision:
    """What start.lua decides for a delivery of ``task_id`` taking the lock with ``token``."""
    return store.start(
        MEMBER,
        task_id,
        token,
        lock_ms=lock_ms,
        gated=gated,
        key_mode=key_mode,
        hostname="elsewhere",
        pid=1,
        retries=0,
        record_ms=DAY_MS,
    )


def start(
    store: DedupStore, task_id: str, token: str, *, key_mode: str = "lock", lock_ms: int = 60_000, gated: bool = True
) -> None:
    decision = decide(store, task_id, token, key_mode=key_mode, lock_ms=lock_ms, gated=gated)
    assert decision.run, decision


def test_renewing_a_runs_lock_leaves_the_next_runs_record_alone(store: DedupStore, r: redis.Redis) -> None:
    """until_executing: run A releases the key when it starts and run B is accepted with a
    short hold. A's renewals keep A's lock alive; they must not stretch B's hold.
    """
    store.gate(MEMBER, "A", "n-a", hold_ms=60_000, grace_ms=DAY_MS)
    start(store, "A", "elsewhere:1:a", key_mode="release")
    outcome = store.gate(MEMBER, "B", "n-b", hold_ms=500, grace_ms=DAY_MS)
    assert outcome.accepted and outcome.task_id == "B"
    held_until = r.hget(SCHEMA.record(MEMBER), "held_until")

    lost = store.renew([store.lock_ref(MEMBER, "elsewhere:1:a")], lock_ms=60_000, record_ms=DAY_MS)

    assert lost == [], "A still holds its lock"
    assert r.hget(SCHEMA.record(MEMBER), "held_until") == held_until, "A's renewal stretched B's hold"


def test_a_report_without_the_token_leaves_a_live_delivery_alone(store: DedupStore, r: redis.Redis) -> None:
    """A report of a run whose lock a live delivery holds (a copy revoked elsewhere) changes nothing."""
    store.gate(MEMBER, "A", "n-a", hold_ms=60_000, grace_ms=DAY_MS)
    start(store, "A", "elsewhere:1:a")

    owned, *_ = store.finish(MEMBER, "A", "revoked", drop=True, record_ms=DAY_MS, role="report")

    assert owned
    assert r.get(SCHEMA.lock(MEMBER)) == b"elsewhere:1:a"
    assert r.hget(SCHEMA.record(MEMBER), "state") == b"started"
    assert r.sismember(SCHEMA.held, MEMBER)


def test_a_stopping_report_records_the_ending_and_keeps_lock_and_key(store: DedupStore, r: redis.Redis) -> None:
    """``stop``: the ending is recorded at once; the lock and key stay with the delivery until
    it finishes itself, and then its own finish frees them without rewriting the ending.
    """
    store.gate(MEMBER, "A", "n-a", hold_ms=60_000, grace_ms=DAY_MS)
    start(store, "A", "elsewhere:1:a")

    store.finish(MEMBER, "A", "revoked", drop=True, record_ms=DAY_MS, role="stop")

    assert r.hget(SCHEMA.record(MEMBER), "state") == b"revoked"
    assert r.get(SCHEMA.lock(MEMBER)) == b"elsewhere:1:a"
    assert r.sismember(SCHEMA.held, MEMBER)

    owned, kept, _ = store.finish(
        MEMBER, "A", "failed", drop=True, record_ms=DAY_MS, role="run", token="elsewhere:1:a", error="late"
    )

    assert (owned, kept) == (True, True)
    assert r.hget(SCHEMA.record(MEMBER), "state") == b"revoked", "a run ends once"
    assert not r.exists(SCHEMA.lock(MEMBER))
    assert not r.sismember(SCHEMA.held, MEMBER)


def test_a_report_for_an_ended_run_touches_nothing_of_the_next_run(store: DedupStore, r: redis.Redis) -> None:
    """A ended and B started; A's late report (even naming B's token, as the old code did) changes nothing."""
    store.gate(MEMBER, "A", "n-a", hold_ms=60_000, grace_ms=DAY_MS)
    start(store, "A", "elsewhere:1:a")
    store.finish(MEMBER, "A", "failed", drop=True, record_ms=DAY_MS, role="run", token="elsewhere:1:a")
    store.gate(MEMBER, "B", "n-b", hold_ms=60_000, grace_ms=DAY_MS)
    start(store, "B", "elsewhere:1:b")

    owned, *_ = store.finish(MEMBER, "A", "failed", drop=True, record_ms=DAY_MS, role="report")

    assert not owned
    assert r.get(SCHEMA.lock(MEMBER)) == b"elsewhere:1:b"
    assert r.hget(SCHEMA.record(MEMBER), "task_id") == b"B"
    assert r.sismember(SCHEMA.held, MEMBER)


def test_a_run_that_ends_after_its_record_passed_on_is_remembered(store: DedupStore, r: redis.Redis) -> None:
    """while_executing: A's lock expired (a paused worker) and B took the record; A then finishes.
    The record must remember that A ended, so a copy of A (its redelivery) is not run again.
    """
    start(store, "A", "elsewhere:1:a", lock_ms=100, gated=False)
    time.sleep(0.2)
    start(store, "B", "elsewhere:1:b", gated=False)
    store.finish(MEMBER, "B", "succeeded", drop=True, record_ms=DAY_MS, role="run", token="elsewhere:1:b")

    owned, kept, _ = store.finish(
        MEMBER, "A", "succeeded", drop=True, record_ms=DAY_MS, role="run", token="elsewhere:1:a"
    )

    assert (owned, kept) == (False, False)
    decision = decide(store, "A", "elsewhere:2:a", gated=False)
    assert (decision.code, decision.detail) == (decision.DONE, "ended")
    assert r.hget(SCHEMA.record(MEMBER), "task_id") == b"B"


def _run_to_end(store: DedupStore, *task_ids: str) -> None:
    """Ungated runs of MEMBER, one after the other, each starting and succeeding."""
    for task_id in task_ids:
        token = f"elsewhere:1:{task_id}"
        start(store, task_id, token, gated=False)
        store.finish(MEMBER, task_id, "succeeded", drop=True, record_ms=DAY_MS, role="run", token=token)


def test_a_copy_of_an_ungated_run_is_skipped_however_many_runs_ended_since(store: DedupStore, r: redis.Redis) -> None:
    """while_executing on a busy key: fifty runs end after A before A's copy arrives (the chaos
    run saw a deferred copy come back after its run had fallen out of the record's memory).
    """
    _run_to_end(store, "A", *(f"R{n}" for n in range(50)))

    decision = decide(store, "A", "elsewhere:2:a", gated=False)

    assert (decision.code, decision.detail) == (decision.DONE, "ended")
    assert r.hget(SCHEMA.record(MEMBER), "task_id") == b"R49"
    assert 0 < r.pttl(SCHEMA.ended(MEMBER)) <= DAY_MS


def test_a_continuation_of_a_run_that_ended_long_ago_pushes_nothing(store: DedupStore, r: redis.Redis) -> None:
    """A deferred copy re-published by A (a continuation) after fifty more runs of its key ended."""
    _run_to_end(store, "A", *(f"R{n}" for n in range(50)))

    outcome = store.gate(MEMBER, "A", "n-late", hold_ms=60_000, grace_ms=DAY_MS, continues=True)

    assert outcome.task_id == "A", outcome
    assert r.hget(SCHEMA.record(MEMBER), "task_id") == b"R49", "the late continuation took the key as a new run"
    assert r.llen("celery") == 0


def test_the_memory_of_ended_runs_is_bounded(store: DedupStore, r: redis.Redis) -> None:
    """Every run of a key that churns without end: the overflow keeps at most ENDED_KEPT of them."""
    _run_to_end(store, *(f"R{n}" for n in range(1100)))
    assert r.zcard(SCHEMA.ended(MEMBER)) == 1000


def test_a_replacement_from_a_copy_that_lost_its_lock_leaves_a_later_calls_arguments(
    store: DedupStore, r: redis.Redis
) -> None:
    """Two bodies of one debounced run (the first lost its lock, a second copy took over) both replace themselves.

    The first replacement holds the key again, so a call joins the run and
    leaves its arguments, the newest. The second copy's replacement comes from
    the arguments both bodies started with: it does not put them back over the
    call's, which the run goes on with.
    """
    run, debounce = "own.task:k~d", (200, 2000, True)

    def publish(task_id: str, nonce: str, payload: str, *, continues: bool) -> None:
        call = store.gate_call(
            MEMBER,
            task_id,
            nonce,
            hold_ms=60_000,
            grace_ms=DAY_MS,
            queue="celery",
            message=nonce,
            payload=payload,
            debounce=debounce,
            continues=continues,
        )
        store.run_gate(call)

    publish(run, "a", "A", continues=False)
    r.zadd(SCHEMA.due, {MEMBER: 0})  # due now
    assert store.dispatch().pushed == 1
    start(store, run, "elsewhere:1:first", key_mode="release")
    r.delete(SCHEMA.lock(MEMBER))  # the first body's lock expires: a second copy of the run takes over
    start(store, run, "elsewhere:1:second", key_mode="release")
    publish(run, "r1", "A again", continues=True)  # the first copy replaces itself: the key is held again
    publish("own.task:k~b", "b", "B", continues=False)  # a call joins the run
    assert r.hget(SCHEMA.record(MEMBER), "payload") == b"B"
    publish(run, "r2", "A again", continues=True)  # the second copy replaces itself, from A too
    r.delete(SCHEMA.lock(MEMBER))  # (the second copy's ending gives its lock back)
    decision = store.start(
        MEMBER,
        run,
        "elsewhere:1:third",
        lock_ms=60_000,
        gated=True,
        key_mode="release",
        hostname="elsewhere",
        pid=1,
        retries=0,
        record_ms=DAY_MS,
        want_payload=True,
    )
    assert decision.run and decision.payload == "B", decision


def _deferred_copy(store: DedupStore, task_id: str, nonce: str) -> tuple[bool, str]:
    """A deferred copy of run ``task_id`` through the gate with its message (a limit or lock refusal's re-publish)."""
    call = store.gate_call(
        MEMBER,
        task_id,
        nonce,
        hold_ms=60_000,
        grace_ms=DAY_MS,
        queue="celery",
        message=f"copy of {task_id}",
        continues=True,
        defers=True,
    )
    outcome = store.run_gate(call)
    return outcome.accepted, outcome.task_id


@pytest.mark.parametrize("b_is", ["queued", "skipped", "started", "succeeded"])
def test_a_deferred_copy_of_a_run_the_key_passed_from_pushes_nothing(
    store: DedupStore, r: redis.Redis, b_is: str
) -> None:
    """until_executing: A started (its key freed), B was accepted since; a copy of A is deferred.

    The copy continues a run that started, and whose record passed on to B:
    there is nothing left to run. Whether B waits, was refused by A's lock,
    runs (A's lock lapsed) or has ended, the gate pushes nothing and leaves
    B's record and hold as they were; it neither makes a new record for A (a
    `queued` record A's finish would then end) nor answers or counts the
    copy as a duplicate of B.
    """
    store.gate(MEMBER, "A", "n-a", hold_ms=60_000, grace_ms=DAY_MS)
    start(store, "A", "elsewhere:1:a", key_mode="release")
    store.gate(MEMBER, "B", "n-b", hold_ms=60_000, grace_ms=DAY_MS)
    if b_is == "skipped":  # B's delivery refused by A's lock, as the guard records it
        assert decide(store, "B", "elsewhere:1:b", key_mode="release").code == StartDecision.LOCKED_BY_OTHER_RUN
        store.finish(MEMBER, "B", "skipped", drop=True, record_ms=DAY_MS, role="report")
    elif b_is != "queued":
        r.delete(SCHEMA.lock(MEMBER))  # A's lock lapsed while its body ran
        start(store, "B", "elsewhere:1:b", key_mode="release")
    if b_is == "succeeded":
        store.finish(MEMBER, "B", "succeeded", drop=True, record_ms=DAY_MS, role="run", token="elsewhere:1:b")
    before = r.hgetall(SCHEMA.record(MEMBER))
    held = r.sismember(SCHEMA.held, MEMBER)

    assert _deferred_copy(store, "A", "n-copy") == (True, "A"), "the copy was answered as another run's"

    assert r.hgetall(SCHEMA.record(MEMBER)) == before, "the copy changed the record of the key's current run"
    assert r.sismember(SCHEMA.held, MEMBER) == held
    assert r.llen("celery") == 0, "the copy of a run that started elsewhere was pushed"


def test_a_deferred_copy_of_a_run_that_never_started_is_pushed_and_holds_its_key(
    store: DedupStore, r: redis.Redis
) -> None:
    """The other side: the record still names A, queued (a run refused by its limits): its copy goes out again."""
    store.gate(MEMBER, "A", "n-a", hold_ms=60_000, grace_ms=DAY_MS)
    r.srem(SCHEMA.held, MEMBER)  # whatever freed it, the continuation of a run that has not started holds it

    assert _deferred_copy(store, "A", "n-copy") == (True, "A")

    assert r.lrange("celery", 0, -1) == [b"copy of A"]
    assert r.hget(SCHEMA.record(MEMBER), "state") == b"queued"
    assert r.sismember(SCHEMA.held, MEMBER)
