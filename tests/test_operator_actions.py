"""Operator actions that change nothing must write nothing; the ones that act leave a trail."""

from __future__ import annotations

import pytest
import redis
from celery import Celery

from celery_dedup import operations, runtime
from celery_dedup.keys import KeySchema
from celery_dedup.store import ReleaseResult

from ._records import Records, keyed_tasks
from .conftest import AppFactory

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
