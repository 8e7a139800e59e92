"""The typed status object that records, the admin and the command line share, on records the real scripts make."""

from __future__ import annotations

import base64
import datetime

import pytest
from celery import Celery

import celery_dedup
from celery_dedup import DedupArgumentError, DedupError, Status, operations, runtime
from celery_dedup.store.status import HistoryEntry

from .._records import Records, keyed_tasks
from ..conftest import AppFactory

UTC = datetime.timezone.utc


@pytest.fixture
def app(make_app: AppFactory) -> Celery:
    return make_app()


@pytest.fixture
def records(app: Celery) -> Records:
    return Records(app, keyed_tasks(app)[0])


def test_a_page_holds_typed_statuses(app: Celery, records: Records) -> None:
    run = records.queued(1)
    assert records.task.delay(1).deduplicated

    (found,) = celery_dedup.records(app).records

    assert isinstance(found, Status)
    assert (found.member, found.key, found.task, found.state, found.task_id) == (
        run.member,
        "order:1",
        "shop.charge",
        "queued",
        run.task_id,
    )
    assert (found.duplicates, found.attempts, found.retries, found.skipped) == (1, 0, 0, 0)
    assert found.queued_at is not None and found.queued_at.tzinfo is not None
    assert found.updated_at is not None and found.updated_at.utcoffset() == datetime.timedelta(0)
    assert found.held_until is not None and found.held_until > found.queued_at
    assert found.started_at is None and found.finished_at is None
    assert not found.ended and not found.purged
    # A page reads no format 1 history list, but a format 2 record holds its history: it comes with it.
    assert found.history is not None and [(e.state, e.task_id) for e in found.history] == [("queued", run.task_id)]
    assert found.fields["duplicates"] == "1", "the raw strings stay available"


def test_an_ended_run_has_its_times_worker_and_error(app: Celery, records: Records) -> None:
    run = records.ended(2, "failed", error="ValueError: 2")

    status = runtime.store_for(app).status(run.member)

    assert status is not None and status.ended
    assert (status.state, status.worker, status.pid, status.attempts, status.error) == (
        "failed",
        "worker-1",
        4242,
        1,
        "ValueError: 2",
    )
    assert status.held_until is None, "held_until 0 means not held"
    assert status.queued_at and status.started_at and status.finished_at
    assert status.queued_at <= status.started_at <= status.finished_at
    assert status.history is not None
    assert [(entry.state, entry.task_id) for entry in status.history] == [
        ("failed", run.task_id),
        ("started", run.task_id),
        ("queued", run.task_id),
    ]
    assert all(entry.at is not None and entry.at.tzinfo is not None for entry in status.history)
    assert runtime.store_for(app).status("shop.charge:order:nope") is None


def test_detail_carries_the_status_with_its_history(app: Celery, records: Records) -> None:
    run = records.started(3)

    found = operations.detail(app, run.member)

    assert found.status is not None
    assert (found.status.state, found.status.lock, found.status.worker) == ("started", run.token, "worker-1")
    assert found.status.history is not None and [e.state for e in found.status.history] == ["started", "queued"]
    assert operations.detail(app, "shop.charge:order:nope").status is None


def test_a_purged_record_is_a_tombstone(app: Celery, records: Records) -> None:
    run = records.ended(4, "succeeded")
    operations.purge(app, states=["succeeded"])
    raw = runtime.store_for(app).record(run.member)
    assert raw is not None and set(raw) <= {"task_id", "state", "purged", "nonce", "nonces"}

    status = runtime.store_for(app).status(run.member)

    assert status is not None and status.purged and status.ended
    assert (status.task, status.key, status.state) == ("shop.charge", "order:4", "succeeded")
    assert status.task_id == run.task_id
    assert (status.duplicates, status.attempts, status.queued_at, status.worker, status.pid) == (0, 0, None, "", None)
    assert status.history == ()


def test_replaced_is_an_ended_state_and_odd_values_do_not_crash() -> None:
    status = Status.from_record(
        "a%3Ab:k",
        {"state": "replaced", "duplicates": "x", "queued_at": "soon", "held_until": "0", "pid": ""},
        ["1700000000123 replaced a:k~1 by b", "garbage"],
    )
    assert status.ended and status.task == "a:b" and status.key == "k"
    assert (status.duplicates, status.queued_at, status.held_until, status.pid) == (0, None, None, None)
    assert status.history == (
        HistoryEntry(datetime.datetime(2023, 11, 14, 22, 13, 20, 123000, tzinfo=UTC), "replaced", "a:k~1", "by b"),
        HistoryEntry(None, "garbage", "", ""),
    )


def test_as_dict_is_json_ready() -> None:
    fields = {"state": "queued", "task": "t", "queued_at": "1700000000123", "attempts": "2"}
    status = Status.from_record("t:k", fields, ["1700000000123 queued x"])
    document = status.as_dict()
    assert document["queued_at"] == "2023-11-14T22:13:20.123000+00:00"
    assert document["attempts"] == 2 and document["started_at"] is None
    (entry,) = document["history"]
    assert entry == {"at": document["queued_at"], "at_ms": 1700000000123, "state": "queued", "task_id": "x", "note": ""}
    assert document["fields"]["attempts"] == "2"


@pytest.mark.parametrize(
    ("arguments", "parameter"),
    [
        ({"limit": 0}, "limit"),
        ({"limit": -5}, "limit"),
        ({"cursor": "-1"}, "cursor"),
        ({"cursor": "²"}, "cursor"),
        ({"cursor": "1.5"}, "cursor"),
        ({"cursor": "next"}, "cursor"),
        ({"cursor": " 3"}, "cursor"),
        ({"cursor": "3"}, "cursor"),
        ({"cursor": "17~"}, "cursor"),
        ({"cursor": "17~dDpr="}, "cursor"),
        ({"cursor": "17~d"}, "cursor"),
    ],
)
def test_records_refuses_a_bad_limit_or_cursor_naming_it(
    app: Celery, records: Records, arguments: dict[str, object], parameter: str
) -> None:
    records.queued(1)
    with pytest.raises(DedupArgumentError) as caught:
        celery_dedup.records(app, **arguments)  # type: ignore[arg-type]
    assert isinstance(caught.value, DedupError) and isinstance(caught.value, ValueError)
    assert caught.value.parameter == parameter and caught.value.value == arguments[parameter]
    assert f"{parameter}=" in str(caught.value)


def test_a_cursor_past_the_end_is_the_last_page(app: Celery, records: Records) -> None:
    for order in range(3):
        records.queued(order)
    for cursor in ("3", "99999999999999999999999"):  # a key search's cursor counts entries
        page = celery_dedup.records(app, prefix="order:", cursor=cursor)
        assert (page.records, page.cursor, page.total) == ([], None, 3)
    # The listing's names a place in its order: one older than every record is past the end.
    page = celery_dedup.records(app, cursor="1~" + base64.urlsafe_b64encode(b"t:k").decode().rstrip("="))
    assert (page.records, page.cursor, page.total) == ([], None, 3)
    assert len(celery_dedup.records(app, cursor="0").records) == 3


def test_following_the_cursor_ends(app: Celery, records: Records) -> None:
    for order in range(5):
        records.queued(order)
    seen, cursor, pages = [], None, 0
    while True:
        page = celery_dedup.records(app, cursor=cursor, limit=2)
        seen += [status.member for status in page.records]
        pages += 1
        cursor = page.cursor
        if cursor is None:
            break
    assert pages == 3 and len(set(seen)) == 5
