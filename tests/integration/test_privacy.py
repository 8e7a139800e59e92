"""What Redis keeps about a call's arguments, read from the whole keyspace after real runs.

Each test calls a task with a distinctive marker string as an argument that
is not part of the business key, runs it on a real worker, and then reads
every key on the server (strings, hashes field by field, lists, sets, sorted
sets) for the marker. The result backend's ``celery-task-meta-*`` keys hold
what a task returned (never the marker here) and are left out.

With ``dedup_record_args=False`` no argument may outlive its run. With it
on, exactly the fields the docs name keep them.
"""

from __future__ import annotations

import base64
import binascii
import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

import celery_dedup
from celery_dedup import DedupTask
from celery_dedup.keys import KeySchema, member_for
from celery_dedup.runtime import store_for

from ..conftest import AppFactory, in_process_worker, wait_for

SCHEMA = KeySchema("dedup")
MARKER = "secret-4711"
WINDOW = 0.2


def _text(raw: Any) -> str:
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)


def keyspace(r: redis.Redis) -> Iterator[tuple[str, str, str]]:
    """Every value on the server as ``(key, where in it, text)``, result-backend results left out."""
    for raw_key in r.scan_iter(count=1000):
        key = _text(raw_key)
        if key.startswith("celery-task-meta-"):
            continue
        yield key, "(name)", key
        kind = _text(r.type(raw_key))
        if kind == "string":
            yield key, "", _text(r.get(raw_key))
        elif kind == "hash":
            for field, value in r.hgetall(raw_key).items():
                yield key, _text(field), _text(value)
        elif kind == "list":
            for i, item in enumerate(r.lrange(raw_key, 0, -1)):
                yield key, f"[{i}]", _text(item)
        elif kind == "set":
            for member in r.smembers(raw_key):
                yield key, "member", _text(member)
        elif kind == "zset":
            for entry in r.zrange(raw_key, 0, -1):
                yield key, "member", _text(entry)
        else:
            raise AssertionError(f"{key}: a {kind} key, which this reader cannot look into")


_BASE64 = re.compile(r"[A-Za-z0-9+/]{8,}={0,2}")


def contains(text: str, marker: str, depth: int = 2) -> bool:
    """Whether ``text`` holds ``marker``, plainly or inside base64 (message bodies and payloads are)."""
    if marker in text:
        return True
    for run in _BASE64.findall(text) if depth else ():
        try:
            decoded = base64.b64decode(run + "=" * (-len(run) % 4), validate=True)
        except binascii.Error:
            continue
        if contains(decoded.decode("utf-8", "replace"), marker, depth - 1):
            return True
    return False


def holding(r: redis.Redis, marker: str = MARKER) -> set[tuple[str, str]]:
    """``(key, where)`` of every value on the server that contains ``marker``."""
    return {(key, where) for key, where, text in keyspace(r) if contains(text, marker)}


def unique(name: str) -> str:
    # Apps of earlier tests linger, and the publish hook looks tasks up by name in every one.
    return f"privacy.{uuid.uuid4().hex[:8]}.{name}"


def define(app: Celery, seen: list[Any], *, fail: bool = False, **options: Any) -> Any:
    """A task keyed by ``sku`` alone; ``note`` (where the marker goes) is no part of the key."""

    @app.task(base=DedupTask, shared=False, name=unique("sync"), dedup_key="sku:{sku}", **options)
    def sync(sku: str, note: str) -> str:
        seen.append(note)
        if fail:
            raise RuntimeError("refused")  # says nothing about its arguments
        return "done"

    return sync


def test_the_search_finds_the_marker_base64_encoded_at_any_alignment(r: redis.Redis) -> None:
    for n, prefix in enumerate((b"", b"x", b"xy", b"xyz", b'[["a", "')):
        r.set(f"probe:{n}", base64.b64encode(prefix + MARKER.encode() + b'"], {}]'))
    r.set("probe:none", base64.b64encode(b"secret-4712"))
    assert holding(r) == {(f"probe:{n}", "") for n in range(5)}


def state(r: redis.Redis, member: str) -> str:
    return _text(r.hget(SCHEMA.record(member), "state") or b"")


def test_a_debounced_run_keeps_no_argument_once_it_started_with_record_args_off(
    make_app: AppFactory, r: redis.Redis
) -> None:
    """A burst of two calls, the newest one's arguments run; after success nothing in Redis holds either.

    Before the worker starts, the marker is in the parked message and the
    payload (proving the search finds it). After the run: not in the record,
    its history, the indexes, the held set, the stats, the queue or kombu's
    unacknowledged messages.
    """
    app = make_app(dedup_record_args=False, dedup_dispatch_interval=0.05)
    seen: list[Any] = []
    sync = define(app, seen, dedup_mode="debounce", dedup_window=WINDOW)
    member = member_for(sync.name, "sku:a")
    first = sync.delay("a", f"{MARKER}-first")
    assert sync.delay("a", f"{MARKER}-latest").deduplicated
    record = SCHEMA.record(member)
    assert holding(r) == {(record, "message"), (record, "payload")}, "the parked run keeps what it will run with"
    assert not r.hexists(record, "args") and not r.hexists(record, "kwargs")

    with in_process_worker(app):
        assert first.get(timeout=10) == "done"
        wait_for(lambda: state(r, member) == "succeeded", 5, "the record to say succeeded")
    assert seen == [f"{MARKER}-latest"]
    assert holding(r) == set(), "argument data outlived the run"
    assert r.exists(SCHEMA.stats) and int(r.hget(SCHEMA.record(member), "hn") or 0) > 0, (
        "the history (in the record) and the stats were searched"
    )


def test_a_failed_run_keeps_no_argument_with_record_args_off(make_app: AppFactory, r: redis.Redis) -> None:
    """An until_executed run that fails: no payload is kept for re-enqueueing, and no repr."""
    app = make_app(dedup_record_args=False)
    seen: list[Any] = []
    sync = define(app, seen, fail=True)
    member = member_for(sync.name, "sku:b")
    result = sync.delay("b", MARKER)
    with in_process_worker(app):
        with pytest.raises(RuntimeError):
            result.get(timeout=10)
        wait_for(lambda: state(r, member) == "failed", 5, "the record to say failed")
    assert seen == [MARKER]
    assert holding(r) == set(), "argument data outlived the run"
    assert r.exists(SCHEMA.stats) and int(r.hget(SCHEMA.record(member), "hn") or 0) > 0, (
        "the history (in the record) and the stats were searched"
    )


def test_with_record_args_on_exactly_the_documented_fields_keep_arguments(make_app: AppFactory, r: redis.Redis) -> None:
    """With the default setting: a succeeded debounced run keeps its newest call's reprs and payload; a
    failed run its reprs and the payload to re-enqueue it; nothing else holds an argument.
    """
    app = make_app(dedup_dispatch_interval=0.05)
    seen: list[Any] = []
    debounced = define(app, seen, dedup_mode="debounce", dedup_window=WINDOW)
    failing = define(app, seen, fail=True)
    debounced_member = member_for(debounced.name, "sku:c")
    failing_member = member_for(failing.name, "sku:d")
    first = debounced.delay("c", f"{MARKER}-first")
    debounced.delay("c", f"{MARKER}-latest")
    failed = failing.delay("d", MARKER)
    with in_process_worker(app):
        assert first.get(timeout=10) == "done"
        with pytest.raises(RuntimeError):
            failed.get(timeout=10)
        wait_for(
            lambda: (state(r, debounced_member), state(r, failing_member)) == ("succeeded", "failed"),
            5,
            "both records to say how their runs ended",
        )
    debounced_record, failing_record = SCHEMA.record(debounced_member), SCHEMA.record(failing_member)
    assert holding(r) == {
        (debounced_record, "args"),
        (debounced_record, "payload"),
        (failing_record, "args"),
        (failing_record, "payload"),
    }
    assert holding(r, f"{MARKER}-first") == set(), "only the newest call's arguments are kept"


def test_a_debounced_run_whose_message_the_transport_lost_keeps_no_argument_with_record_args_off(
    make_app: AppFactory, r: redis.Redis
) -> None:
    """The run's message is pushed when due, then popped by a consumer that dies before recording it.

    It never runs, so it never takes its payload: the reaper, marking it
    lost, deletes that payload too.
    """
    grace = 0.05
    app = make_app(dedup_record_args=False, dedup_reap_grace=grace)
    sync = define(app, [], dedup_mode="debounce", dedup_window=WINDOW)
    member = member_for(sync.name, "sku:e")
    sync.delay("e", MARKER)
    wait_for(lambda: store_for(app).dispatch().pushed, 5, "the run to be due and pushed")
    assert isinstance(r.rpop("celery"), bytes), "a consumer took the message, and died"
    wait_for(lambda: (celery_dedup.reap(app), state(r, member))[1] == "lost", 5, "the reaper to judge it lost")
    assert holding(r) == set(), "argument data outlived the run"
