"""The dedup store on a real Redis Cluster: 3 masters, 3 replicas, started once per test run.

The broker is the session's single server (kombu has no cluster transport),
so calls take the two-phase gate; the keys live in the cluster's hash-tagged
shards. Threads race, a master is SIGKILLed mid-run and slots move while
calls run.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import redis
from celery import Celery

from celery_dedup import DedupStoreError, DedupTask, DedupUnavailableError, runtime
from celery_dedup.keys import CLUSTER_SHARDS, KeySchema, member_for
from celery_dedup.ops import checks
from celery_dedup.store.connection import masked_url
from tests.servers import RedisCluster

from ..conftest import AppFactory, in_process_worker, queued_messages, wait_for

SCHEMA = KeySchema("dedup", CLUSTER_SHARDS)


@pytest.fixture
def app(make_app: AppFactory, cluster: RedisCluster) -> Iterator[Celery]:
    yield make_app(
        dedup_redis_url=cluster.url,
        dedup_publish_lease=2,
        # A delivery that met the failover retries every 4 s (a third of it), three times: past the failover.
        dedup_lock_ttl=12,
        task_default_queue=f"cluster-{uuid.uuid4().hex[:8]}",
        task_ignore_result=True,
        broker_transport_options={"polling_interval": 0.05},
    )


def keyed(app: Celery, r: redis.Redis, name: str, **options: Any) -> Any:
    """A keyed task appending its run's id to ``runs:<name>:<n>`` on the broker's server."""

    @app.task(base=DedupTask, dedup_key="n:{n}", bind=True, shared=False, name=name, **options)
    def task(self: Any, n: int) -> int:
        r.rpush(f"runs:{name}:{n}", self.request.id)
        return n

    return task


def runs(r: redis.Redis, task: Any, n: int) -> list[str]:
    return [entry.decode() for entry in r.lrange(f"runs:{task.name}:{n}", 0, -1)]


def held(cluster: RedisCluster) -> set[str]:
    client = cluster.client()
    try:
        return {m.decode() for at in SCHEMA.shards_all() for m in client.smembers(at.held)}
    finally:
        client.close()


def still_held(app: Celery, task: Any, count: int) -> list[int]:
    """Keys ``n:0``... whose hold has not passed (as a call now would meet it)."""
    store = runtime.store_for(app)
    return [n for n in range(count) if store.holder(member_for(task.name, f"n:{n}")) is not None]


def unfinished(task: Any, count: int) -> list[int]:
    """Keys ``n:0``... whose run has not succeeded (yet)."""
    return [n for n in range(count) if getattr(task.dedup_status(n), "state", None) != "succeeded"]


def explain(app: Celery, task: Any, keys: list[int]) -> str:
    store = runtime.store_for(app)
    lines = [f"keys {keys}"]
    for n in keys[:4]:
        status = store.status(member_for(task.name, f"n:{n}"))
        if status is not None:
            history = [f"{e.state} {e.task_id} {e.note}" for e in status.history or ()]
            lines.append(f"n:{n} {status.state} {status.task_id} held_until={status.held_until} {history}")
    return "\n".join(lines)


def race(task: Any, keys: Sequence[int], threads: int) -> tuple[dict[int, set[str]], list[BaseException]]:
    """``threads`` threads each call every key once, in their own order; every id each key was answered with."""
    answers: dict[int, set[str]] = {n: set() for n in keys}
    errors: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(threads)

    def caller(seed: int) -> None:
        order = list(keys)
        random.Random(seed).shuffle(order)
        start.wait()
        for n in order:
            try:
                result = task.delay(n)
            except DedupUnavailableError as exc:
                with lock:
                    errors.append(exc)
                continue
            with lock:
                answers[n].add(result.id)

    pool = [threading.Thread(target=caller, args=(seed,)) for seed in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(180)
    return answers, errors


def test_a_cluster_url_gives_a_sharded_store_and_the_two_phase_gate(app: Celery) -> None:
    state = runtime.runtime_for(app)
    assert not state.atomic
    assert state.store.schema.shards == CLUSTER_SHARDS


def test_sixteen_threads_racing_over_two_hundred_keys_run_each_once_on_every_master(
    app: Celery, r: redis.Redis, cluster: RedisCluster
) -> None:
    task = keyed(app, r, "cluster.race")
    answers, errors = race(task, range(200), 16)

    assert not errors
    assert all(len(ids) == 1 for ids in answers.values()), "every caller of a key got one id"
    assert len(queued_messages(r, app.conf.task_default_queue)) == 200, "one message per key"
    per_master = Counter(
        cluster.node_of_key(SCHEMA.shard_of(member_for(task.name, f"n:{n}")).held).port for n in answers
    )
    assert len(per_master) == 3 and min(per_master.values()) >= 20, per_master
    with in_process_worker(app, pool="threads", concurrency=4):
        wait_for(lambda: not held(cluster), 60, lambda: f"{len(held(cluster))} keys still held")
    for n, ids in answers.items():
        assert runs(r, task, n) == list(ids), f"key {n}"

    listed: list[str] = []
    cursor = None
    while True:
        page = runtime.store_for(app).records(cursor=cursor, limit=9, state="succeeded")
        listed += [status.member for status in page.records]
        if page.cursor is None:
            break
        cursor = page.cursor
    assert sorted(listed) == sorted(member_for(task.name, f"n:{n}") for n in answers), "each record once"
    assert runtime.store_for(app).stats()[task.name]["accepted"] == 200


def test_the_reaper_covers_every_shard(app: Celery, r: redis.Redis, cluster: RedisCluster) -> None:
    """Holds that passed (a producer gone after holding, in every shard) are released by one pass."""
    store = runtime.store_for(app)
    members = [member_for("cluster.reaped", f"n:{n}") for n in range(64)]
    for member in members:
        assert store.gate(member, f"{member}~x", "nonce", hold_ms=1, grace_ms=60_000)
    assert {SCHEMA.shard_of(m).prefix for m in members} == {at.prefix for at in SCHEMA.shards_all()}
    time.sleep(0.05)
    report = runtime.reap(app)
    assert report.released == 64
    assert not held(cluster)


@pytest.mark.slow
def test_a_master_killed_mid_run_loses_no_key_and_runs_none_twice(
    app: Celery, r: redis.Redis, cluster: RedisCluster
) -> None:
    """SIGKILL a master while threads call and a worker runs: a replica takes over; after it, every key ran once."""
    # Held for a minute after success too: calls that come after a key's run ended are duplicates still.
    task = keyed(app, r, "cluster.failover", dedup_mode="until_expired", dedup_ttl=60)
    victim = cluster.master_ports()[0]
    outcome: dict[str, Any] = {}

    def calls() -> None:
        outcome["answers"], outcome["errors"] = race(task, range(100), 6)

    with in_process_worker(app, pool="threads", concurrency=4):
        caller = threading.Thread(target=calls)
        caller.start()
        time.sleep(0.3)
        cluster.kill_master(victim)
        new_master = cluster.wait_failover(victim)
        cluster.restart_node(victim)  # back as the new master's replica: decisions are replicated again
        caller.join(180)
        assert not caller.is_alive()
        assert new_master != victim
        # Keys whose calls all failed during the failover, or whose hold's reply was lost (its lease), are free
        # once the lease ends: every key is called again then.
        time.sleep(2.5)
        answers: dict[int, set[str]] = outcome["answers"]
        unanswered = [n for n, ids in answers.items() if not ids]
        _, errors = race(task, unanswered, 2)
        assert not errors, errors[:3]
        # until_expired keeps keys held after success: wait for every key's run to have ended instead.
        wait_for(lambda: not unfinished(task, 100), 90, lambda: explain(app, task, unfinished(task, 100)))
    executed = {n: runs(r, task, n) for n in range(100)}
    twice = [n for n, ids in executed.items() if len(ids) > 1]
    assert not twice, explain(app, task, twice)
    never = [n for n, ids in executed.items() if not ids]
    assert not never, explain(app, task, never)
    failed = outcome["errors"]
    assert all(isinstance(exc, DedupUnavailableError) for exc in failed)


@pytest.mark.slow
def test_slots_moved_while_calls_run_lose_nothing(app: Celery, r: redis.Redis, cluster: RedisCluster) -> None:
    """Every shard's slot moves to another master while 8 threads call: each key runs once, none stays held."""
    task = keyed(app, r, "cluster.reshard")
    outcome: dict[str, Any] = {}

    def calls() -> None:
        outcome["answers"], outcome["errors"] = race(task, range(300), 8)

    caller = threading.Thread(target=calls)
    caller.start()
    masters = cluster.master_ports()
    for at in SCHEMA.shards_all():
        slot = cluster.slot_of(at.held)
        source = cluster.master_port_for_slot(slot)
        target = masters[(masters.index(source) + 1) % len(masters)]
        cluster.migrate_slots([slot], target)
    caller.join(180)
    assert not caller.is_alive()
    time.sleep(2.5)  # the leases of calls whose reply was lost end
    answers: dict[int, set[str]] = outcome["answers"]
    with in_process_worker(app, pool="threads", concurrency=4):
        race(task, [n for n, ids in answers.items() if not ids], 1)  # keys whose every call failed
        wait_for(lambda: not still_held(app, task, 300), 60, lambda: f"held: {still_held(app, task, 300)}")
    for n in range(300):
        assert len(runs(r, task, n)) == 1, f"key {n}: {runs(r, task, n)}\n{explain(app, task, [n])}"
    assert all(len(ids) <= 1 for ids in answers.values()), "no key was answered with two runs"


def test_check_inspects_every_master_and_masks_the_password(app: Celery, cluster: RedisCluster) -> None:
    clocks = [finding for finding in checks.run_checks(app) if finding.check == "clock"]
    assert sorted(finding.message.split(":")[1] for finding in clocks) == sorted(map(str, cluster.master_ports()))
    assert all(finding.level == "ok" for finding in clocks)
    secret = cluster.url.replace("redis+cluster://", "redis+cluster://dedup:s3cret@")
    assert masked_url(secret) == cluster.url.replace("redis+cluster://", "redis+cluster://dedup:**@")


def test_renewals_of_locks_in_every_shard_go_out_one_slot_at_a_time(app: Celery) -> None:
    """A worker renews all its locks together: on a cluster, one call per slot (a script's keys share one)."""
    store = runtime.store_for(app)
    members = [member_for("cluster.renewed", f"n:{n}") for n in range(48)]
    refs = []
    for n, member in enumerate(members):
        decision = store.start(
            member, f"run-{n}", f"token-{n}", lock_ms=5_000, gated=False, key_mode="lock", hostname="h", pid=1,
            retries=0, record_ms=60_000,
        )  # fmt: skip
        assert decision.code == decision.RUN
        refs.append(store.lock_ref(member, f"token-{n}"))
    assert len({ref.lock_key.split("}")[0] for ref in refs}) == CLUSTER_SHARDS
    assert store.renew(refs, lock_ms=60_000, record_ms=60_000) == []
    assert all(60_000 - 1_000 < store.client.pttl(ref.lock_key) <= 60_000 for ref in refs)
    lost = store.renew([*refs[:3], store.lock_ref(members[3], "not-the-token")], lock_ms=60_000, record_ms=60_000)
    assert [ref.token for ref in lost] == ["not-the-token"]


@pytest.mark.parametrize("policy", ["fail_closed", "fail_open"])
def test_a_refusal_of_the_cluster_client_reaches_the_caller_as_a_store_error(
    make_app: AppFactory, r: redis.Redis, cluster: RedisCluster, policy: str
) -> None:
    """Keys of one script in several slots (as a prefix with a brace made them; install refuses one now): redis-py's
    cluster client refuses the script before sending it, with an error that is no RedisError. The caller gets a
    DedupStoreError naming that refusal and the task, under either policy (the store answered), and nothing is
    published."""
    queue = f"cluster-{uuid.uuid4().hex[:8]}"
    app = make_app(dedup_redis_url=cluster.url, dedup_on_redis_error=policy, task_default_queue=queue)
    task = keyed(app, r, "cluster.refused")
    state = runtime.runtime_for(app)
    state._store = runtime.store_for(app).with_prefix("}dedup")  # "{}dedup:07}:held": an empty hash tag
    with pytest.raises(DedupStoreError) as info:
        task.delay(1)
    assert info.value.task == task.name and info.value.key == "n:1"
    assert "slot" in info.value.reply and info.value.reply in str(info.value)
    assert info.value.published is False
    assert queued_messages(r, queue) == []


@pytest.mark.parametrize("policy", ["fail_closed", "fail_open"])
def test_a_cluster_no_node_of_which_answers_is_unreachable_under_its_policy(
    make_app: AppFactory, r: redis.Redis, policy: str
) -> None:
    """redis-py's cluster client connects as it is made, and reports that no seed answered as an error that is no
    RedisError: still an unreachable store, which dedup_on_redis_error decides about."""
    queue = f"cluster-{uuid.uuid4().hex[:8]}"
    app = make_app(
        dedup_redis_url="redis+cluster://127.0.0.1:1",
        dedup_redis_options={"socket_connect_timeout": 0.5},
        dedup_on_redis_error=policy,
        task_default_queue=queue,
    )
    task = keyed(app, r, "cluster.unreachable")
    if policy == "fail_closed":
        with pytest.raises(DedupUnavailableError) as info:
            task.delay(1)
        assert info.value.published is False
        assert queued_messages(r, queue) == []
    else:
        result = task.delay(1)
        assert [message["headers"]["id"] for message in queued_messages(r, queue)] == [result.id]
