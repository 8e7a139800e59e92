"""Contract 2: a key is held iff its message was enqueued, whatever breaks mid-publish.

Faults are real: a TCP proxy cuts the publisher's broker connection around the
gate's EVALSHA (before the server runs it, or after it ran but before the
reply arrives), and publisher processes are SIGKILLed in the middle of their
calls. After each fault the whole dedup state in Redis (held set, status
records, queue contents) is checked against the invariant.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import pytest
import redis
from celery import Celery

import celery_dedup
from celery_dedup import DedupTask, DedupUnavailableError
from celery_dedup.header import GateHeader
from celery_dedup.keys import KeySchema
from celery_dedup.store.scripts import load_script
from chaos.proxy import FaultProxy, Point

from ..conftest import AppFactory, Server, queued_messages

SCHEMA = KeySchema("dedup")
PROJ_CHARGE = "tests.proj.charge"


def assert_held_iff_enqueued(
    r: redis.Redis, *, prefix: str = "dedup", queue: str = "celery", all_gated: bool = True
) -> dict[str, str]:
    """Check "a key is held iff its message was enqueued" over everything in Redis.

    Every held member has a record and exactly one queued message, whose id is
    the record's task id; every gated queued message's member is held by that
    message's id; no record says "queued" for a key that is not held. Returns
    ``{member: task id}`` of the held keys.
    """
    schema = KeySchema(prefix)
    held = {m.decode() for m in r.smembers(schema.held)}
    queued: dict[str, list[str]] = {}
    problems: list[str] = []
    for message in queued_messages(r, queue):
        headers = message["headers"]
        gate = GateHeader.decode(headers)
        if gate is None:
            if all_gated:
                problems.append(f"message {headers.get('id')} was enqueued without a dedup header")
            continue
        queued.setdefault(gate.member, []).append(headers["id"])

    owners: dict[str, str] = {}
    for member in sorted(held):
        task_id = r.hget(schema.record(member), "task_id")
        if task_id is None:
            problems.append(f"held {member!r} has no record (orphan key)")
            continue
        owners[member] = task_id.decode()
        ids = queued.get(member, [])
        if ids != [owners[member]]:
            problems.append(f"held {member!r} (owner {owners[member]}) has queued messages {ids}")
    for member, ids in sorted(queued.items()):
        if member not in held:
            problems.append(f"queued {ids} for {member!r}, which is not held")
        elif len(ids) > 1:
            problems.append(f"{member!r} has {len(ids)} queued messages {ids}")
    record_prefix = schema.record("")
    for key in r.scan_iter(match=f"{prefix}:rec:*", count=1000):
        member = key.decode()[len(record_prefix) :]
        if member not in held and r.hget(key, "state") == b"queued":
            problems.append(f"record of {member!r} says queued but the key is not held")
    assert not problems, "invariant broken:\n" + "\n".join(problems)
    return owners


def charge_task(app: Celery, **options: Any) -> Any:
    @app.task(base=DedupTask, dedup_key="order:{order_id}", shared=False, **options)
    def charge(order_id: int, amount: int = 0) -> int:
        return order_id

    return charge


def gate_reply(raw: bytes) -> tuple[int, str]:
    """Decode the gate's RESP reply ``*2 :<code> $<n> <task id>`` as the proxy swallowed it."""
    lines = raw.split(b"\r\n")
    assert lines[0] == b"*2" and lines[1][:1] == b":" and lines[2][:1] == b"$", raw
    return int(lines[1][1:]), lines[3].decode()


@pytest.fixture
def proxy(server: Server, r: redis.Redis) -> Iterator[FaultProxy]:
    """A fault-injecting proxy in front of the test server."""
    # Load the scripts first, so the EVALSHA a fault hits is the gate running,
    # not a NOSCRIPT answer that redis-py would follow with SCRIPT LOAD.
    for name in ("gate", "finish"):
        r.execute_command("SCRIPT", "LOAD", load_script(name))
    port = urlparse(server.url).port
    assert port is not None
    with FaultProxy(port) as fault_proxy:
        yield fault_proxy


# -- a. the connection breaks in the middle of a publish ------------------------------------------------------------


@pytest.mark.parametrize("point", ["before", "after"])
def test_publish_retry_after_a_cut_enqueues_once(
    make_app: AppFactory, server: Server, r: redis.Redis, proxy: FaultProxy, point: Point
) -> None:
    """kombu's publish retry re-runs the gate with the same nonce: one message, the caller gets its id.

    ``after`` is the dangerous case: the server enqueued the message but the
    publisher never heard, so its retry must be answered "already accepted"
    instead of pushing a second copy.
    """
    app = make_app(broker_url=proxy.url, result_backend=server.url)
    charge = charge_task(app)
    proxy.arm(point)

    result = charge.delay(1)

    assert [(i.point, i.command) for i in proxy.incidents] == [(point, b"EVALSHA")]
    if point == "after":
        assert gate_reply(proxy.incidents[0].swallowed) == (1, result.id)
    owners = assert_held_iff_enqueued(r)
    assert owners == {f"{charge.name}:order:1": result.id}
    assert [m["headers"]["id"] for m in queued_messages(r)] == [result.id]
    assert not result.deduplicated


@pytest.mark.parametrize(
    ("point", "retry", "cuts"),
    [
        ("before", False, 1),
        ("after", False, 1),
        # kombu's Redis transport retries a publish once after reconnecting
        # (it lacks ``recoverable_connection_errors``), so a second cut exhausts it.
        ("before", True, 2),
        ("after", True, 2),
    ],
)
def test_failed_publish_leaves_state_consistent_and_tells_the_truth(
    make_app: AppFactory, server: Server, r: redis.Redis, proxy: FaultProxy, point: Point, retry: bool, cuts: int
) -> None:
    """Publish without retry, or with retries exhausted: nothing is half-done, and the caller learns the outcome.

    ``before``: the gate never ran; the caller gets DedupUnavailableError saying
    nothing was published, and the next call enqueues normally.
    ``after``: the gate ran but its reply was lost; the record carries this
    publish's nonce, so the caller gets the accepted run (once, even though a
    retry ran the gate again), and the next call is its duplicate.
    """
    app = make_app(broker_url=proxy.url, result_backend=server.url)
    charge = charge_task(app)
    member = f"{charge.name}:order:1"
    proxy.arm(point, times=cuts)

    if point == "before":
        with pytest.raises(DedupUnavailableError) as info:
            charge.apply_async((1,), retry=retry)
        assert info.value.published is False
        assert "nothing was published" in str(info.value)
        assert assert_held_iff_enqueued(r) == {}
        assert queued_messages(r) == []
    else:
        result = charge.apply_async((1,), retry=retry)
        replies = [gate_reply(i.swallowed) for i in proxy.incidents]
        # Accepted (1) first; the retry carrying the same nonce was "already accepted" (2).
        assert replies == [(1, result.id)] + [(2, result.id)] * (cuts - 1)
        assert not result.deduplicated
        assert assert_held_iff_enqueued(r) == {member: result.id}
    assert [i.point for i in proxy.incidents] == [point] * cuts

    again = charge.delay(1)
    assert again.deduplicated is (point == "after")
    assert assert_held_iff_enqueued(r) == {member: again.id}
    assert [m["headers"]["id"] for m in queued_messages(r)] == [again.id]


def test_last_outcome_names_the_run_a_lost_reply_was_resolved_to(
    make_app: AppFactory, server: Server, r: redis.Redis, proxy: FaultProxy
) -> None:
    """A publish whose gate reply was lost, resolved by reading the record, is the latest outcome.

    ``last_outcome()`` must not still name the previous publish (another key's
    run): a caller of ``send_task`` or a chain would take this call for a
    duplicate of that run.
    """
    charge = charge_task(make_app(broker_url=proxy.url, result_backend=server.url))
    before = charge.delay(1)
    proxy.arm("after")

    result = charge.apply_async((2,), retry=False)

    assert [i.point for i in proxy.incidents] == ["after"]
    outcome = celery_dedup.last_outcome()
    assert outcome is not None
    assert (outcome.accepted, outcome.task_id) == (True, result.id), f"still the outcome of {before.id}"


def test_outcome_unknown_is_said_when_the_server_stays_unreachable(
    make_app: AppFactory, server: Server, r: redis.Redis, proxy: FaultProxy
) -> None:
    """Reply lost and the follow-up read of the record fails too: the error must not say "nothing".

    A caller told "nothing was published" may publish the work again by
    other means, while the accepted run is already queued.
    """
    charge = charge_task(make_app(broker_url=proxy.url, result_backend=server.url))
    proxy.arm("after")
    proxy.arm("before", commands=frozenset({b"HGETALL"}))

    with pytest.raises(DedupUnavailableError) as info:
        charge.apply_async((1,), retry=False)

    assert info.value.published is None
    assert "nothing was published" not in str(info.value)
    assert len(queued_messages(r)) == 1, "the gate ran: the run is queued"
    assert_held_iff_enqueued(r)


@pytest.mark.parametrize("policy", ["fail_closed", "fail_open"])
def test_lost_reply_never_enqueues_the_run_twice(
    make_app: AppFactory, server: Server, r: redis.Redis, proxy: FaultProxy, policy: str
) -> None:
    """Whatever ``dedup_on_redis_error`` says, a run the gate enqueued is not put on the queue again.

    On the Redis broker the store is the broker: there is no ungated fallback
    that could add a second copy for a worker to execute twice.
    """
    charge = charge_task(make_app(broker_url=proxy.url, result_backend=server.url, dedup_on_redis_error=policy))
    proxy.arm("after")

    result = charge.apply_async((1,), retry=False)

    code, accepted = gate_reply(proxy.incidents[0].swallowed)
    assert (code, result.id) == (1, accepted)
    assert [m["headers"]["id"] for m in queued_messages(r)] == [accepted]
    assert assert_held_iff_enqueued(r) == {f"{charge.name}:order:1": accepted}


# -- b. publisher processes killed mid-call --------------------------------------------------------------------------


def publish_once_then_wait(broker: str, order_id: int) -> None:
    """Child process: one ``charge.delay`` (which the test freezes and kills), then idle."""
    os.environ["CELERY_DEDUP_TEST_BROKER"] = broker
    from tests import proj  # noqa: PLC0415 - must follow the environment variable

    proj.charge.delay(order_id)
    time.sleep(60)


@pytest.mark.parametrize("point", ["before", "after"])
def test_publisher_killed_between_sending_the_gate_and_its_reply(
    make_app: AppFactory, server: Server, r: redis.Redis, proxy: FaultProxy, point: Point
) -> None:
    """SIGKILL a publisher frozen just before its EVALSHA reaches the server, or just after it ran.

    Either nothing exists, or the key and its message both do, and a later
    caller is handed the run the dead publisher never heard about.
    """
    proxy.arm(point, hold=True)
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=publish_once_then_wait, args=(proxy.url, 7), daemon=True)
    proc.start()
    try:
        assert proxy.fired.wait(60), "the publisher never reached the gate"
        proc.kill()  # SIGKILL
        proc.join(10)
    finally:
        proxy.release()
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == -signal.SIGKILL

    owners = assert_held_iff_enqueued(r)
    member = f"{PROJ_CHARGE}:order:7"
    if point == "before":
        assert owners == {}
    else:
        code, accepted = gate_reply(proxy.incidents[0].swallowed)
        assert code == 1
        assert owners == {member: accepted}

    # A caller that survives (same task name, so the same key) sees a consistent state.
    charge = charge_task(make_app(), name=PROJ_CHARGE)
    later = charge.delay(7)
    assert later.deduplicated is (point == "after")
    assert assert_held_iff_enqueued(r) == {member: later.id}


def publish_forever(broker: str, seed: int, ready: Any, calls: Any, in_call: Any) -> None:
    """Child process: call ``charge.delay`` in a loop over hot (repeated) and fresh keys until killed."""
    os.environ["CELERY_DEDUP_TEST_BROKER"] = broker
    from tests import proj  # noqa: PLC0415 - must follow the environment variable

    rng = random.Random(seed)
    ready.set()
    deadline = time.monotonic() + 60  # never outlive a test run that lost track of us
    fresh = 0
    while time.monotonic() < deadline:
        if rng.random() < 0.5:
            order_id = rng.randrange(25)
        else:
            fresh += 1
            order_id = 1_000_000 * (seed + 1) + fresh
        in_call.value = 1
        proj.charge.delay(order_id)
        in_call.value = 0
        calls.value += 1


@pytest.mark.slow
def test_publishers_killed_at_random_moments_leave_no_orphans(server: Server, r: redis.Redis) -> None:
    """Rounds of publisher processes SIGKILLed at random points of their calls.

    Proves: whatever instant a publisher dies at, every held key has exactly
    its one message queued and every queued message's key is held by it.
    """
    ctx = multiprocessing.get_context("spawn")
    seed = random.randrange(2**32)
    print(f"kill timing seed: {seed}")  # shown with a failure, to replay the same kill moments
    rng = random.Random(seed)
    per_round, max_rounds, budget = 3, 6, 10.0
    started = time.monotonic()
    kills = mid_call = total_calls = rounds = 0
    while rounds < max_rounds and (rounds < 2 or time.monotonic() - started < budget):
        rounds += 1
        workers = []
        for index in range(per_round):
            ready, calls, in_call = ctx.Event(), ctx.Value("i", 0, lock=False), ctx.Value("i", 0, lock=False)
            proc = ctx.Process(
                target=publish_forever,
                args=(server.url, rounds * 100 + index, ready, calls, in_call),
                daemon=True,
            )
            proc.start()
            workers.append((proc, ready, calls, in_call))
        try:
            for _proc, ready, _calls, _in_call in workers:
                assert ready.wait(60), "a publisher did not start"
            for proc, _ready, calls, in_call in workers:
                time.sleep(rng.uniform(0.05, 0.4))
                mid_call += in_call.value
                proc.kill()  # SIGKILL
                kills += 1
                proc.join(10)
                total_calls += calls.value
                assert proc.exitcode == -signal.SIGKILL
        finally:
            for proc, *_ in workers:
                if proc.is_alive():
                    proc.kill()
                    proc.join(10)

    owners = assert_held_iff_enqueued(r)
    assert total_calls > 0 and owners, "the publishers must have published something before dying"
    assert mid_call > 0, f"none of the {kills} kills landed inside a call"
    # Every accepted run is accounted for by exactly one message (checked above); a
    # record outside the held set would be a key released by nobody.
    records = {k.decode()[len(SCHEMA.record("")) :] for k in r.scan_iter(match="dedup:rec:*")}
    assert records == set(owners)
