"""Operator actions on real records: release (owner-safe), purge (bounded), inspect."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from celery import Celery

from celery_dedup import operations, runtime
from celery_dedup.exceptions import DedupArgumentError, DedupOperationError
from celery_dedup.keys import KeySchema
from celery_dedup.store.status import STATES
from celery_dedup.store.store import PurgeReport, ReleaseResult, StartDecision

from .._records import Records, keyed_tasks
from ..conftest import AppFactory, queued_messages

SCHEMA = KeySchema("dedup")


@pytest.fixture
def app(make_app: AppFactory) -> Celery:
    return make_app()


@pytest.fixture
def records(app: Celery) -> Records:
    charge, _ = keyed_tasks(app)
    return Records(app, charge)


def history(app: Celery, member: str) -> list[list[str]]:
    return [entry.split(" ", 3) for entry in runtime.store_for(app).history(member)]


def test_release_queued_key_ends_its_run_and_frees_the_key(app: Celery, records: Records, r: redis.Redis) -> None:
    run = records.queued(1)

    result = operations.release(app, run.member, by="alice")

    assert result == ReleaseResult(ReleaseResult.RELEASED, "released", was_held=True, forced=False)
    record = runtime.store_for(app).record(run.member)
    assert record is not None
    assert (record["state"], record["held_until"]) == ("released", "0")
    assert "finished_at" in record
    assert not r.sismember(SCHEMA.held, run.member)
    assert history(app, run.member)[0][1:] == ["released", run.task_id, "released by alice"]
    assert r.zscore(SCHEMA.state_index("released"), run.member) is not None
    assert r.zscore(SCHEMA.state_index("queued"), run.member) is None
    # The queued message of the released run is skipped when a worker takes it...
    decision = runtime.store_for(app).start(
        run.member,
        run.task_id,
        "late-token",
        lock_ms=1000,
        gated=True,
        key_mode="lock",
        hostname="h",
        pid=1,
        retries=0,
        record_ms=1000,
    )
    assert decision == StartDecision(StartDecision.DONE, "released")
    # ... and the key is free for a new run.
    again = records.task.delay(1)
    assert not again.deduplicated and again.id != run.task_id


def test_release_refuses_a_live_lock_unless_forced_with_its_token(
    app: Celery, records: Records, r: redis.Redis
) -> None:
    run = records.started(2)

    refused = operations.release(app, run.member, by="alice")
    assert refused.code == ReleaseResult.REFUSED_LOCKED and not refused.released
    assert 0 < int(refused.detail) <= 60_000
    stale = operations.release(app, run.member, force_token="someone-else:1:00", by="alice")
    assert stale == ReleaseResult(ReleaseResult.REFUSED_LOCK_CHANGED, run.token)
    assert r.get(SCHEMA.lock(run.member)) == run.token.encode()
    assert runtime.store_for(app).record(run.member)["state"] == "started"  # type: ignore[index]
    assert r.sismember(SCHEMA.held, run.member)

    forced = operations.release(app, run.member, force_token=run.token, by="alice")

    assert forced == ReleaseResult(ReleaseResult.RELEASED, "released", was_held=True, forced=True)
    assert not r.exists(SCHEMA.lock(run.member))
    assert not r.sismember(SCHEMA.held, run.member)
    record = runtime.store_for(app).record(run.member)
    assert record is not None
    assert record["state"] == "released" and "lock_lost_at" in record
    state, task_id, note = history(app, run.member)[0][1:]
    assert (state, task_id) == ("released", run.task_id)
    # Who released it comes first; the entry is cut to 64 bytes, in the lock token.
    assert note.startswith("forced release by alice, lock ")
    assert run.token.startswith(note.removeprefix("forced release by alice, lock ")[:10])
    assert all(len(value) <= 64 for name, value in record.items() if name.startswith("h") and name[1:].isdigit())
    # The run that was executing learns it lost its lock, and its ending does not rewrite the release.
    store = runtime.store_for(app)
    assert store.renew([store.lock_ref(run.member, run.token)], lock_ms=1000, record_ms=1000)
    assert store.finish(run.member, run.task_id, "succeeded", drop=True, record_ms=1000, token=run.token, role="run")[
        :2
    ] == (True, False)
    assert store.record(run.member)["state"] == "released"  # type: ignore[index]


def test_release_of_an_ended_run_keeps_its_state_and_frees_the_window(
    app: Celery, records: Records, r: redis.Redis
) -> None:
    run = records.ended(3, "succeeded", keep_key=True)
    assert r.sismember(SCHEMA.held, run.member)

    result = operations.release(app, run.member)

    assert result == ReleaseResult(ReleaseResult.RELEASED, "succeeded", was_held=True, forced=False)
    record = runtime.store_for(app).record(run.member)
    assert record is not None and (record["state"], record["held_until"]) == ("succeeded", "0")
    assert history(app, run.member)[0][1:] == ["succeeded", run.task_id, "released"]
    assert not records.task.delay(3).deduplicated


def test_release_of_an_unknown_key_does_nothing(app: Celery) -> None:
    assert operations.release(app, "shop.charge:order:404") == ReleaseResult(ReleaseResult.NOTHING, "")


def test_release_of_a_held_key_without_record_drops_the_hold(app: Celery, r: redis.Redis) -> None:
    member = "shop.charge:order:5"
    store = runtime.store_for(app)
    # A hold whose record is gone (a new record has no expiry: deleted by hand) stays held until the reaper runs.
    assert store.gate(member, "order:5~run", "nonce", hold_ms=50, grace_ms=1).accepted
    r.delete(SCHEMA.record(member))
    assert r.sismember(SCHEMA.held, member)

    assert operations.release(app, member) == ReleaseResult(ReleaseResult.RELEASED, "", True, False)
    assert not r.sismember(SCHEMA.held, member)


def index_entries(r: redis.Redis, member: str) -> list[str]:
    found = [key for key in (SCHEMA.state_index(s) for s in STATES) if r.zscore(key, member) is not None]
    namespace, key = member.split(":", 1)
    return found + ([SCHEMA.name_index] if r.zscore(SCHEMA.name_index, f"{key}\0{namespace}") is not None else [])


def test_purge_deletes_ended_records_and_keeps_live_ones(app: Celery, records: Records, r: redis.Redis) -> None:
    queued = records.queued(10)
    started = records.started(11)
    window = records.ended(12, "succeeded", keep_key=True)
    ended = [
        records.ended(13, "succeeded"),
        records.ended(14, "failed", error="boom"),
        records.ended(15, "revoked"),
    ]
    released = records.queued(16)
    operations.release(app, released.member)
    ended.append(released)

    report = operations.purge(app)

    assert report == PurgeReport(purged=4, kept=1, more=False)
    store = runtime.store_for(app)
    for run in ended:
        tombstone = store.record(run.member)
        assert tombstone is not None, "purge keeps what a late copy of the run is judged by"
        assert set(tombstone) <= {"task_id", "state", "purged", "nonce", "nonces"}, tombstone
        assert tombstone["task_id"] == run.task_id and tombstone["purged"] == "1"
        assert 0 < r.pttl(SCHEMA.record(run.member)) <= 86_400_000, "as long as the record would have lived"
        assert store.history(run.member) == []
        assert index_entries(r, run.member) == [], run
    for run in (queued, started, window):
        assert store.record(run.member) is not None
        assert store.history(run.member)
    listed = {record.member for record in store.records(limit=100).records}
    assert listed == {queued.member, started.member, window.member}
    assert {record.member for record in store.records(prefix="order:1", limit=100).records} == listed


def test_purge_of_one_state_only(app: Celery, records: Records) -> None:
    failed = records.ended(20, "failed")
    succeeded = records.ended(21, "succeeded")

    assert operations.purge(app, states=["failed"]) == PurgeReport(1, 0, False)

    store = runtime.store_for(app)
    assert (store.record(failed.member) or {}).get("purged") == "1"
    assert "purged" not in (store.record(succeeded.member) or {})


def test_purge_is_bounded_per_call_and_steps_over_kept_records(app: Celery, records: Records) -> None:
    kept = [records.ended(n, "succeeded", keep_key=True) for n in range(3)]
    for n in range(3, 28):
        records.ended(n, "succeeded")
    store = runtime.store_for(app)

    first = store.purge(budget=10)
    assert first.purged + first.kept == 10 and first.more

    rest = operations.purge(app, budget=10)
    assert first.purged + rest.purged == 25 and rest.kept == 3 and not rest.more
    assert {record.member for record in store.records(limit=100).records} == {run.member for run in kept}


def test_purge_stops_at_its_limit(app: Celery, records: Records) -> None:
    for n in range(12):
        records.ended(n, "failed")

    report = operations.purge(app, budget=5, limit=7)

    assert report.purged == 7 and report.more
    assert len(runtime.store_for(app).records(limit=100).records) == 5


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"states": ["queued"]}, "only ended states"),
        ({"states": []}, "only ended states"),
        ({"budget": 0}, "at least 1"),
    ],
)
def test_purge_refuses_bad_arguments(app: Celery, kwargs: dict[str, Any], reason: str) -> None:
    with pytest.raises((DedupOperationError, DedupArgumentError), match=reason):
        operations.purge(app, **kwargs)


def test_requeue_publishes_a_new_run_with_the_recorded_arguments(app: Celery, records: Records, r: redis.Redis) -> None:
    failed = records.ended(40, "failed", error="boom")
    r.delete("celery")  # the first run's message, which a worker would have taken

    result = operations.requeue(app, failed.member)

    assert not result.deduplicated and result.task_id != failed.task_id
    assert result.task_id.startswith("order:40~")
    record = runtime.store_for(app).record(failed.member)
    assert record is not None and (record["state"], record["task_id"]) == ("queued", result.task_id)
    [message] = queued_messages(r)
    assert message["headers"]["id"] == result.task_id
    assert message["headers"]["argsrepr"] == "(40,)"


def test_requeue_of_a_key_still_held_is_deduplicated(app: Celery, records: Records) -> None:
    failed = records.ended(41, "failed", keep_key=True)  # until_expired keeps a failed key for its window

    assert operations.requeue(app, failed.member) == operations.RequeueResult(failed.task_id, deduplicated=True)


def test_requeue_refuses_what_it_cannot_do(app: Celery, records: Records, make_app: AppFactory) -> None:
    queued = records.queued(42)
    only = "only failed, revoked, rejected, lost or released runs can be re-enqueued"
    with pytest.raises(DedupOperationError, match=f"the run's state is queued; {only}"):
        operations.requeue(app, queued.member)
    with pytest.raises(DedupOperationError, match="no status record"):
        operations.requeue(app, "shop.charge:order:none")
    failed = records.ended(43, "failed")
    with pytest.raises(DedupOperationError, match="no DedupTask of this app"):
        operations.requeue(make_app("other"), failed.member)

    bare = make_app("bare", dedup_record_args=False)
    unrecorded = Records(bare, keyed_tasks(bare)[0]).ended(44, "failed")
    assert not operations.can_requeue(runtime.store_for(bare).record(unrecorded.member))
    with pytest.raises(DedupOperationError, match="keeps no payload"):
        operations.requeue(bare, unrecorded.member)


def test_detail_reads_record_history_hold_and_lock(app: Celery, records: Records) -> None:
    run = records.started(30, lock_ms=30_000)

    detail = operations.detail(app, run.member)

    assert detail.record is not None and detail.record["task_id"] == run.task_id
    assert [entry.split(" ")[1] for entry in detail.history] == ["started", "queued"]
    assert detail.held
    assert detail.lock_token == run.token
    assert 0 < detail.lock_ttl_ms <= 30_000
    missing = operations.detail(app, "shop.charge:order:nope")
    assert (missing.record, missing.history, missing.held, missing.lock_token, missing.lock_ttl_ms) == (
        None,
        [],
        False,
        None,
        0,
    )
