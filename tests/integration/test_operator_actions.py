"""Operator actions that change nothing must write nothing; the ones that act leave a trail."""

from __future__ import annotations

import pytest
import redis
from celery import Celery

from celery_dedup import operations, runtime
from celery_dedup.keys import KeySchema
from celery_dedup.store.store import ReleaseResult

from .._records import Records, keyed_tasks
from ..conftest import AppFactory

SCHEMA = KeySchema("dedup")


@pytest.fixture
def app(make_app: AppFactory) -> Celery:
    return make_app()


@pytest.fixture
def records(app: Celery) -> Records:
    return Records(app, keyed_tasks(app)[0])


def released_count(app: Celery) -> int:
    return runtime.store_for(app).stats().get("shop.charge", {}).get("released", 0)


@pytest.mark.parametrize("state", ["succeeded", "failed", "lost"])
def test_release_of_a_key_nothing_holds_writes_nothing(
    app: Celery, records: Records, r: redis.Redis, state: str
) -> None:
    if state == "lost":
        run = records.started(1)
        r.delete(SCHEMA.lock(run.member))  # its worker died
        assert runtime.store_for(app).reap(record_ms=60_000).lost == 1
    else:
        run = records.ended(1, state)
    store = runtime.store_for(app)
    assert not store.is_held(run.member) and store.lock_holder(run.member) is None
    before = (store.record(run.member), store.history(run.member))

    result = operations.release(app, run.member, by="alice")

    assert result == ReleaseResult(ReleaseResult.NOTHING, state)
    assert not result.released
    assert (store.record(run.member), store.history(run.member)) == before
    assert released_count(app) == 0


def test_release_of_a_held_key_still_releases(app: Celery, records: Records) -> None:
    run = records.queued(2)
    assert operations.release(app, run.member, by="alice").released
    assert released_count(app) == 1


def test_a_requeued_run_names_who_asked_and_the_run_it_repeats(app: Celery, records: Records) -> None:
    failed = records.ended(3, "failed")
    store = runtime.store_for(app)

    result = operations.requeue(app, failed.member, by="alice")

    assert not result.deduplicated
    history = [entry.split(" ", 3) for entry in store.history(failed.member)]
    assert history[0][1:] == ["queued", result.task_id, f"re-enqueued by alice from {failed.task_id}"]
    assert [entry[1] for entry in history] == ["queued", "failed", "started", "queued"], "one entry, annotated"


def test_a_note_for_a_run_the_record_no_longer_names_is_not_written(app: Celery, records: Records) -> None:
    earlier = records.ended(4, "failed")
    later = records.queued(4)  # the key's next run
    store = runtime.store_for(app)
    before = store.history(later.member)

    assert not store.annotate(later.member, earlier.task_id, "re-enqueued by alice from x")
    assert store.history(later.member) == before
    assert store.annotate(later.member, later.task_id, "first")
    assert store.annotate(later.member, later.task_id, "second")
    assert store.history(later.member)[0].split(" ", 3)[1:] == ["queued", later.task_id, "first; second"]


def test_a_note_whose_entry_is_gone_gets_its_own(app: Celery, records: Records) -> None:
    run = records.queued(5)
    store = runtime.store_for(app)
    record = store.schema.record(run.member)
    pushed_out = [name for name in store.record(run.member) or {} if name[:1] == "h" and name[1:].isdigit()]
    assert pushed_out == ["h0"], "the publish wrote one entry"
    store.client.hdel(record, *pushed_out)

    assert store.annotate(run.member, run.task_id, "re-enqueued by alice from x")

    (entry,) = store.history(run.member)
    assert entry.split(" ", 3)[1:] == ["queued", run.task_id, "re-enqueued by alice from x"]
    assert store.client.hget(record, "h1") is not None, "it lives in the record, and expires with it"
    assert store.client.hget(record, "hn") == b"2"
