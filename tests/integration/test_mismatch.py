"""A duplicate whose arguments differ from the accepted run's (``dedup_on_mismatch``), on a real server.

The gate keeps each new run's arguments fingerprint and answers a duplicate
with it; the caller warns, raises or (``ignore``) compares nothing. Checked
where the gate runs: inside the Redis broker's publish, two-phase on a store
apart from the broker, in bulk, and in the peek that answers a key this
process saw held lately; with a real worker for what runs (a retry that
changes its arguments, a window after success).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import redis
from celery import Celery

from celery_dedup import DedupArgumentsMismatch, DedupTask, DuplicateTaskError, runtime
from celery_dedup.keys import KeySchema, arguments_fingerprint, member_for
from celery_dedup.store.store import DedupStore

from ..conftest import AppFactory, Server, in_process_worker, queued_messages, wait_for

TASK = "mismatch.charge"
SCHEMA = KeySchema("dedup")


def charge_task(app: Celery, name: str = TASK, **options: Any) -> Any:
    @app.task(base=DedupTask, dedup_key="order:{order_id}", shared=False, name=name, **options)
    def charge(order_id: int, amount: int = 0) -> int:
        return order_id

    return charge


def gate_only(app: Celery) -> Celery:
    """Every call of ``app`` reaches the gate script: no peek answers a key this process saw held."""
    runtime.runtime_for(app).recent.size = 0
    return app


def record(client: redis.Redis, key: str, task: str = TASK, prefix: str = "dedup") -> dict[str, str]:
    raw = client.hgetall(KeySchema(prefix).record(member_for(task, key)))
    return {k.decode(): v.decode() for k, v in raw.items()}


def mismatched(app: Celery, task: str = TASK) -> int:
    return runtime.stats(app).get(task, {}).get("mismatched", 0)


def fp(order_id: int, amount: int = 0) -> str:
    return arguments_fingerprint({"order_id": order_id, "amount": amount})


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        rec.getMessage()
        for rec in caplog.records
        if rec.levelno == logging.WARNING and getattr(rec, "dedup_decision", None) == "mismatched"
    ]


def _peeks(client: redis.Redis) -> int:
    """SISMEMBER calls so far: only the peek script asks it."""
    return int(client.info("commandstats").get("cmdstat_sismember", {}).get("calls", 0))


# --- the gate inside the Redis broker's publish ----------------------------------------------------


def test_warn_answers_with_the_run_and_logs_both_fingerprints(
    make_app: AppFactory, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    charge = charge_task(gate_only(make_app(task_ignore_result=True)))
    first = charge.delay(1, 10)
    assert record(r, "order:1")["args_fp"] == fp(1, 10)
    before = _peeks(r)
    with caplog.at_level(logging.WARNING, logger="celery_dedup"):
        same = charge.delay(1, amount=10)
        other = charge.delay(1, 15)
    assert _peeks(r) == before, "the gate answered, not a peek"
    assert (same.id, same.deduplicated) == (first.id, True)
    assert (other.id, other.deduplicated) == (first.id, True), "warn: the caller still gets the run"
    assert len(queued_messages(r)) == 1
    (line,) = warnings(caplog)
    assert "order:1" in line and first.id in line and fp(1, 15) in line and fp(1, 10) in line
    fields = record(r, "order:1")
    assert (fields["duplicates"], fields["mismatched"], fields["args_fp"]) == ("2", "1", fp(1, 10))
    assert mismatched(charge.app) == 1
    status = charge.dedup_status(1)
    assert status is not None and (status.mismatched, status.args_fp) == (1, fp(1, 10))


def test_defaults_applied_the_same_call_spelled_otherwise_is_no_mismatch(make_app: AppFactory, r: redis.Redis) -> None:
    charge = charge_task(gate_only(make_app(task_ignore_result=True)), dedup_on_mismatch="raise")
    first = charge.delay(2)
    for again in (charge.delay(2, 0), charge.delay(order_id=2, amount=0), charge.apply_async(kwargs={"order_id": 2})):
        assert (again.id, again.deduplicated) == (first.id, True)
    assert "mismatched" not in record(r, "order:2")
    assert mismatched(charge.app) == 0


def test_raise_raises_a_duplicate_task_error_naming_key_and_both_fingerprints(
    make_app: AppFactory, r: redis.Redis
) -> None:
    charge = charge_task(gate_only(make_app(task_ignore_result=True)), dedup_on_mismatch="raise")
    first = charge.delay(3, 10)
    with pytest.raises(DedupArgumentsMismatch) as raised:
        charge.delay(3, 99)
    error = raised.value
    assert isinstance(error, DuplicateTaskError)
    assert (error.task, error.key, error.task_id) == (TASK, "order:3", first.id)
    assert (error.fingerprint, error.accepted_fingerprint) == (fp(3, 99), fp(3, 10))
    assert fp(3, 99) in str(error) and fp(3, 10) in str(error) and "order:3" in str(error)
    assert len(queued_messages(r)) == 1, "nothing published for it"
    assert record(r, "order:3")["mismatched"] == "1" and mismatched(charge.app) == 1


def test_mismatch_raise_wins_over_return_existing_and_warn_leaves_duplicate_raise(
    make_app: AppFactory, caplog: pytest.LogCaptureFixture
) -> None:
    app = gate_only(make_app(task_ignore_result=True))
    strict = charge_task(app, "mismatch.strict", dedup_on_mismatch="raise", dedup_on_duplicate="return_existing")
    loud = charge_task(app, "mismatch.loud", dedup_on_duplicate="raise")
    strict.delay(4, 1)
    loud.delay(4, 1)
    with pytest.raises(DedupArgumentsMismatch):
        strict.delay(4, 2)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="celery_dedup"), pytest.raises(DuplicateTaskError) as raised:
        loud.delay(4, 2)
    assert type(raised.value) is DuplicateTaskError, "dedup_on_duplicate raises; the mismatch is warned of"
    assert len(warnings(caplog)) == 1


def test_ignore_stores_no_fingerprint_and_counts_nothing(
    make_app: AppFactory, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    charge = charge_task(gate_only(make_app(task_ignore_result=True, dedup_on_mismatch="raise")))
    lax = charge_task(charge.app, "mismatch.lax", dedup_on_mismatch="ignore")
    lax.delay(5, 1)
    with caplog.at_level(logging.WARNING, logger="celery_dedup"):
        assert lax.delay(5, 2).deduplicated
    assert "args_fp" not in record(r, "order:5", "mismatch.lax")
    assert "mismatched" not in record(r, "order:5", "mismatch.lax")
    assert mismatched(charge.app, "mismatch.lax") == 0 and not warnings(caplog)
    assert "fp" not in queued_messages(r)[0]["headers"]["dedup"], "the message carries no fingerprint"


def test_the_setting_is_the_default_of_the_option(make_app: AppFactory) -> None:
    app = make_app(dedup_on_mismatch="raise")
    assert charge_task(app).dedup_policy.on_mismatch == "raise"
    assert charge_task(app, "mismatch.own", dedup_on_mismatch="warn").dedup_policy.on_mismatch == "warn"


def test_a_publish_by_name_is_counted_and_warned_of(
    make_app: AppFactory, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    charge = charge_task(gate_only(make_app(task_ignore_result=True)), dedup_on_mismatch="raise")
    charge.delay(6, 1)
    with caplog.at_level(logging.WARNING, logger="celery_dedup"):
        charge.app.send_task(TASK, (6, 2))  # by name: never raises for a duplicate
    assert len(warnings(caplog)) == 1
    assert record(r, "order:6")["mismatched"] == "1"
    assert len(queued_messages(r)) == 1


# --- the peek, for a key this process saw held lately ----------------------------------------------


@pytest.mark.parametrize("policy", ["warn", "raise"])
def test_a_peeked_duplicate_is_compared_as_the_gate_compares(make_app: AppFactory, r: redis.Redis, policy: str) -> None:
    charge = charge_task(make_app(task_ignore_result=True), dedup_on_mismatch=policy)
    first = charge.delay(7, 1)
    assert runtime.runtime_for(charge.app).recent.hint(member_for(TASK, "order:7")), "seen held: peeked"
    before = _peeks(r)
    assert charge.delay(7, 1).deduplicated
    if policy == "raise":
        with pytest.raises(DedupArgumentsMismatch) as raised:
            charge.delay(7, 2)
        assert (raised.value.task_id, raised.value.accepted_fingerprint) == (first.id, fp(7, 1))
    else:
        assert charge.delay(7, 2).id == first.id
    assert _peeks(r) == before + 2, "both answered by the peek"
    fields = record(r, "order:7")
    assert (fields["duplicates"], fields["mismatched"]) == ("2", "1")
    assert mismatched(charge.app) == 1


# --- the two-phase gate, on a store apart from the broker ------------------------------------------


def another_database(server: Server) -> str:
    return server.url.rsplit("/", 1)[0] + "/1"


@pytest.mark.parametrize("policy", ["warn", "raise"])
def test_the_two_phase_gate_compares_too(
    make_app: AppFactory, server: Server, r: redis.Redis, policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    store_url = another_database(server)
    app = gate_only(make_app(task_ignore_result=True, dedup_redis_url=store_url))
    assert not runtime.is_atomic(app)
    charge = charge_task(app, dedup_on_mismatch=policy)
    first = charge.delay(8, 1)
    store = redis.Redis.from_url(store_url)
    try:
        assert record(store, "order:8")["args_fp"] == fp(8, 1)
        with caplog.at_level(logging.WARNING, logger="celery_dedup"):
            if policy == "raise":
                with pytest.raises(DedupArgumentsMismatch) as raised:
                    charge.delay(8, 2)
                assert raised.value.fingerprint == fp(8, 2)
            else:
                assert charge.delay(8, 2).id == first.id
        assert len(warnings(caplog)) == 1
        assert record(store, "order:8")["mismatched"] == "1"
        assert mismatched(app) == 1
        assert len(queued_messages(r)) == 1, "one message on the broker"
    finally:
        store.flushdb()
        store.close()


# --- bulk -----------------------------------------------------------------------------------------


def test_bulk_warns_of_a_mismatch_within_the_batch_and_with_a_held_key(
    make_app: AppFactory, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    charge = charge_task(gate_only(make_app(task_ignore_result=True)))
    held = charge.delay(9, 1)
    with caplog.at_level(logging.WARNING, logger="celery_dedup"):
        results = charge.apply_async_many([((9,), {"amount": 2}), ((10,), {"amount": 1}), ((10,), {"amount": 3})])
    assert [result.deduplicated for result in results] == [True, False, True]
    assert results[0].id == held.id and results[2].id == results[1].id
    assert len(warnings(caplog)) == 2
    assert (record(r, "order:9")["mismatched"], record(r, "order:10")["mismatched"]) == ("1", "1")
    assert record(r, "order:10")["args_fp"] == fp(10, 1)
    assert mismatched(charge.app) == 2


@pytest.mark.parametrize("lean", [True, False], ids=["pipelined", "loop"])
def test_bulk_with_raise_gates_the_whole_batch_then_raises_the_first_mismatch(
    make_app: AppFactory, r: redis.Redis, lean: bool
) -> None:
    charge = charge_task(gate_only(make_app(task_ignore_result=True)), dedup_on_mismatch="raise")
    options = {} if lean else {"expires": 600}  # an option the pipelined path does not build: a loop of apply_async
    calls = [((11,), {"amount": 1}), ((11,), {"amount": 2}), ((12,), {"amount": 1}), ((12,), {"amount": 5})]
    with pytest.raises(DedupArgumentsMismatch) as raised:
        charge.apply_async_many(calls, **options)
    assert (raised.value.key, raised.value.fingerprint) == ("order:11", fp(11, 2))
    assert sorted(m["headers"]["argsrepr"] for m in queued_messages(r)) == ["(11,)", "(12,)"], "every key went out"
    assert mismatched(charge.app) == 2
    again = charge.apply_async_many([((11,), {"amount": 1}), ((12,), {"amount": 1})], **options)
    assert all(result.deduplicated for result in again), "sending the matching calls again is safe"


# --- debounce -------------------------------------------------------------------------------------


def debounced(app: Celery, name: str, how: str, **options: Any) -> Any:
    @app.task(
        base=DedupTask,
        name=name,
        shared=False,
        dedup_key="sku:{sku}",
        dedup_mode="debounce",
        dedup_window=30,
        dedup_debounce=how,
        **options,
    )
    def sync(sku: str, source: str) -> None: ...

    return sync


def test_debounce_latest_compares_nothing_and_first_warns_of_a_join(
    make_app: AppFactory, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    app = gate_only(make_app(task_ignore_result=True))
    latest = debounced(app, "mismatch.latest", "latest", dedup_on_mismatch="raise")
    first = debounced(app, "mismatch.first", "first", dedup_on_mismatch="raise")
    with caplog.at_level(logging.WARNING, logger="celery_dedup"):
        a = latest.delay("x", "one")
        assert latest.delay("x", "two").id == a.id
        b = first.delay("x", "one")
        joined = first.delay("x", "two")  # a join is never raised: it has joined the burst already
    assert joined.id == b.id and joined.deduplicated
    assert "args_fp" not in record(r, "sku:x", "mismatch.latest")
    assert "mismatched" not in record(r, "sku:x", "mismatch.latest")
    assert record(r, "sku:x", "mismatch.first")["mismatched"] == "1"
    assert len(warnings(caplog)) == 1


# --- with a worker: what a run does -----------------------------------------------------------------


def test_a_retry_with_other_arguments_is_no_mismatch(make_app: AppFactory, r: redis.Redis) -> None:
    app = make_app(task_ignore_result=True)
    runs = f"runs:{TASK}"

    @app.task(
        base=DedupTask, bind=True, name=TASK, shared=False, dedup_key="order:{order_id}", dedup_on_mismatch="raise"
    )
    def charge(self: Any, order_id: int, amount: int = 0) -> None:
        r.rpush(runs, f"{amount} {record(r, 'order:13').get('args_fp')}")
        if amount < 3:
            raise self.retry(args=(order_id, amount + 1), countdown=0)

    with in_process_worker(app):
        result = charge.delay(13, 1)
        wait_for(lambda: record(r, "order:13").get("state") == "succeeded", 20, lambda: str(record(r, "order:13")))
    accepted = fp(13, 1)
    assert [x.decode() for x in r.lrange(runs, 0, -1)] == [f"1 {accepted}", f"2 {accepted}", f"3 {accepted}"], (
        "the retries ran with their own arguments; the record kept the accepted call's fingerprint"
    )
    fields = record(r, "order:13")
    assert fields["task_id"] == result.id
    assert "mismatched" not in fields and mismatched(app) == 0
    assert "args_fp" not in fields, "a run that ended and freed its key keeps no fingerprint"


def test_a_key_held_after_success_compares_with_the_run_that_ended(
    make_app: AppFactory, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    app = gate_only(make_app(task_ignore_result=True))
    charge = charge_task(app, dedup_mode="until_expired", dedup_ttl=600)
    with in_process_worker(app):
        first = charge.delay(14, 1)
        wait_for(lambda: record(r, "order:14").get("state") == "succeeded", 20, lambda: str(record(r, "order:14")))
    with caplog.at_level(logging.WARNING, logger="celery_dedup"):
        assert charge.delay(14, 1).id == first.id
        late = charge.delay(14, 2)
    assert (late.id, late.deduplicated) == (first.id, True)
    assert len(warnings(caplog)) == 1
    assert record(r, "order:14")["mismatched"] == "1"


def test_a_new_run_of_the_key_starts_its_own_fingerprint(make_app: AppFactory, r: redis.Redis) -> None:
    """Once the key is free, another call is a run of its own: nothing to compare, its fingerprint replaces the old."""
    app = gate_only(make_app(task_ignore_result=True))
    charge = charge_task(app, dedup_on_mismatch="raise")
    first = charge.delay(15, 1)
    charge.delay(15, 1)
    # Revoked before it ran, as a worker reports it: the key is freed.
    member = member_for(TASK, "order:15")
    assert DedupStore(r, "dedup").finish(member, first.id, "revoked", drop=True, record_ms=60_000, role="report")[0]
    second = charge.delay(15, 2)
    assert not second.deduplicated and second.id != first.id
    fields = record(r, "order:15")
    assert (fields["args_fp"], fields.get("mismatched"), fields.get("duplicates")) == (fp(15, 2), None, None)
