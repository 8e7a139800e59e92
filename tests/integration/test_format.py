"""The store's format key: marked on first use, format 1 warned of, a newer format refused; migrate's folding."""

from __future__ import annotations

import logging

import pytest
import redis

import celery_dedup
from celery_dedup import operations
from celery_dedup.exceptions import DedupStoreFormatError
from celery_dedup.ops.checks import run_checks
from celery_dedup.store import format as store_format
from celery_dedup.store.schema import FORMAT

from ..conftest import AppFactory


def test_a_new_store_is_marked_with_this_release_s_format(make_app: AppFactory, r: redis.Redis) -> None:
    app = make_app()
    celery_dedup.records(app)
    assert r.get("dedup:format") == str(FORMAT).encode()


def test_an_older_store_is_warned_of_once_naming_migrate(
    make_app: AppFactory, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    r.set("dedup:format", 1)
    app = make_app("shop")
    with caplog.at_level(logging.WARNING, logger="celery_dedup"):
        celery_dedup.records(app)
        celery_dedup.records(app)
    warned = [rec.getMessage() for rec in caplog.records if "format-1 structures" in rec.getMessage()]
    assert len(warned) == 1 and "celery -A shop dedup migrate" in warned[0], warned
    assert r.get("dedup:format") == b"1"  # only migrate moves it


def test_a_newer_store_is_refused_at_first_use_and_by_check(make_app: AppFactory, r: redis.Redis) -> None:
    r.set("dedup:format", FORMAT + 1)
    app = make_app()
    with pytest.raises(DedupStoreFormatError, match=f"format {FORMAT + 1}.*reads format {FORMAT}"):
        celery_dedup.records(app)
    with pytest.raises(DedupStoreFormatError):  # and again: never silently after the first refusal
        celery_dedup.records(app)
    findings = {f.check: f for f in run_checks(make_app("checked"))}
    assert findings["format"].level == "error" and "pip install --upgrade celery-dedup" in findings["format"].message
    with pytest.raises(DedupStoreFormatError):
        operations.migrate(app)


def test_migrate_folds_history_lists_into_their_records(make_app: AppFactory, r: redis.Redis) -> None:
    app = make_app()
    member = "t.charge:order:1"
    r.hset(f"dedup:rec:{member}", mapping={"state": "succeeded", "task_id": "run-2", "queued_at": "1000"})
    r.hset(f"dedup:rec:{member}", "updated_at", "1009")
    note = "lock not renewed " + "x" * 80
    old = ["1009 succeeded run-2", f"1005 lost run-2 {note}", "1003 started run-2", "1000 queued run-2", "990 ok run-1"]
    r.rpush(f"dedup:hist:{member}", *old)
    r.rpush("dedup:hist:t.charge:order:gone", "5 queued run-9")
    r.zadd("dedup:idx", {member: 1009})
    r.zadd("dedup:idx:task:t.charge", {member: 1009})
    dry = operations.migrate(app, dry_run=True)
    assert (dry.folded, dry.deleted, dry.indexes, dry.dry_run) == (1, 1, 2, True)
    assert r.exists(f"dedup:hist:{member}", "dedup:idx") == 2
    done = operations.migrate(app)
    assert (done.folded, done.deleted, done.indexes, done.format) == (1, 1, 2, FORMAT)
    record = {k.decode(): v.decode() for k, v in r.hgetall(f"dedup:rec:{member}").items()}
    entries = [record[f"h{n}"] for n in range(int(record["hn"]))]
    assert entries[:3] == ["-10 ok run-1", "0 queued", "3 started"]
    assert entries[3].startswith("5 lost - lock not renewed xx") and len(entries[3]) == store_format.ENTRY_BYTES
    assert entries[-1] == "9 succeeded" and "updated_at" not in record
    assert all(len(e.encode()) <= store_format.ENTRY_BYTES for e in entries)
    assert not list(r.scan_iter(match="dedup:hist:*")) and not r.exists("dedup:idx", "dedup:idx:task:t.charge")
    again = operations.migrate(app)
    assert (again.folded, again.deleted, again.indexes) == (0, 0, 0)


def test_an_entry_keeps_its_run_id_and_cuts_its_note() -> None:
    run = "order:42~" + "a" * 40
    assert store_format.entry(-123456, "succeeded", run, "a note " * 20) == f"-123456 succeeded {run}"
    assert store_format.entry(3, "started", "-") == "3 started"
    cut = store_format.entry(3, "lost", "-", "é" * 60)
    assert cut.startswith("3 lost - é") and len(cut.encode()) <= store_format.ENTRY_BYTES
