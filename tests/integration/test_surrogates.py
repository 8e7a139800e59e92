"""Lone surrogates (JSON's ``"\\ud800"`` decodes to one) are published and recorded, as Celery does.

redis-py sends UTF-8, which cannot hold a lone surrogate: whatever
celery-dedup records of such a value keeps its escape instead.
"""

from __future__ import annotations

import redis
from celery import Celery

from celery_dedup import DedupTask
from celery_dedup.keys import KeySchema, member_for

from ..conftest import AppFactory, in_process_worker, queued_messages, wait_for

SCHEMA = KeySchema("dedup")
LONE = "abc\ud800"


def register(app: Celery) -> DedupTask:
    @app.task(base=DedupTask, name="surrogates.note", dedup_key="note:{key}", shared=False)
    def note(key: str, text: str = "") -> str:
        if text.startswith("fail"):
            raise RuntimeError(f"cannot take {text}")
        return "ok"

    return note


def test_a_lone_surrogate_in_the_arguments_is_published_and_deduplicated(make_app: AppFactory, r: redis.Redis) -> None:
    note = register(make_app())
    first = note.delay(LONE, "x\udfff")
    second = note.delay(LONE, "x\udfff")
    assert not first.deduplicated and second.deduplicated and second.id == first.id
    assert [m["headers"]["id"] for m in queued_messages(r)] == [first.id]
    member = member_for(note.name, note.dedup_business_key(LONE))
    args = r.hget(SCHEMA.record(member), "args")
    assert args is not None and b"\\udfff" in args and b"\\ud800" in args


def test_a_lone_surrogate_in_an_error_is_recorded(make_app: AppFactory, r: redis.Redis) -> None:
    app = make_app()
    note = register(app)
    member = member_for(note.name, note.dedup_business_key("k"))
    with in_process_worker(app):
        note.delay("k", "fail \udfff")
        wait_for(lambda: r.hget(SCHEMA.record(member), "state") == b"failed", 10, "the failure to be recorded")
    error = r.hget(SCHEMA.record(member), "error")
    assert error == b"RuntimeError: cannot take fail \\udfff"
    assert not r.sismember(SCHEMA.held, member) and not r.exists(SCHEMA.lock(member))
