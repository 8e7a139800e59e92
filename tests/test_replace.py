"""``Task.replace`` runs as in plain Celery, and the status record says what happened.

A replacement under the same key keeps the run's id and key: it goes on as the
same run (the record shows it queued again, "replaced by ..."). A replacement
under another key, or by a plain task, ends the run as ``replaced``.
"""

from __future__ import annotations

import time
from typing import Any

import redis
from celery import Celery

from celery_dedup import DedupTask
from celery_dedup.keys import KeySchema, member_for

from .conftest import AppFactory, in_process_worker, queued_messages, wait_for

SCHEMA = KeySchema("dedup")
STEPS = 3


def register(app: Celery) -> dict[str, Any]:
    client = redis.Redis.from_url(str(app.conf.broker_url))

    @app.task(base=DedupTask, name="replace.step", dedup_key="walk:{n}", bind=True, shared=False)
    def step(self: DedupTask, n: int, i: int, seconds: float = 0.0) -> Any:
        client.rpush(f"replace:steps:{n}", f"{i} {self.request.id}")
        time.sleep(seconds)
        if i < STEPS:
            return self.replace(step.s(n, i + 1, seconds))
        return f"walked {n}"

    @app.task(base=DedupTask, name="replace.hand_off", dedup_key="hand:{n}", bind=True, shared=False)
    def hand_off(self: DedupTask, n: int) -> Any:
        return self.replace(finish.s(n))

    @app.task(base=DedupTask, name="replace.finish", dedup_key="finish:{n}", shared=False)
    def finish(n: int) -> str:
        client.incr(f"replace:finished:{n}")
        return f"finished {n}"

    return {"step": step, "hand_off": hand_off, "finish": finish}


def history(r: redis.Redis, member: str) -> list[list[str]]:
    return [entry.decode().split(" ", 3)[1:] for entry in reversed(r.lrange(SCHEMA.history(member), 0, -1))]


def test_a_replacement_under_the_same_key_goes_on_as_the_same_run(make_app: AppFactory, r: redis.Redis) -> None:
    app = make_app()
    tasks = register(app)
    member = member_for("replace.step", "walk:1")
    with in_process_worker(app, pool="threads", concurrency=2):
        run = tasks["step"].delay(1, 1)
        assert run.get(timeout=20) == "walked 1"
        wait_for(lambda: r.hget(SCHEMA.record(member), "state") == b"succeeded", 10, "the run to be recorded")
    steps = [raw.decode().split() for raw in r.lrange("replace:steps:1", 0, -1)]
    assert steps == [[str(i), run.id] for i in range(1, STEPS + 1)], "each step ran once, under the run's id"
    assert not r.sismember(SCHEMA.held, member) and not r.exists(SCHEMA.lock(member))
    states = [entry[:2] for entry in history(r, member)]
    assert states == [["queued", run.id]] + [["started", run.id], ["queued", run.id]] * (STEPS - 1) + [
        ["started", run.id],
        ["succeeded", run.id],
    ]
    notes = [entry[2] for entry in history(r, member) if entry[0] == "queued" and len(entry) > 2]
    assert notes == ["replaced by replace.step"] * (STEPS - 1)


def test_a_duplicate_call_during_a_replacement_is_answered_with_the_run(make_app: AppFactory, r: redis.Redis) -> None:
    """The key stays held from the first step to the last: a call meanwhile is a duplicate."""
    app = make_app()
    tasks = register(app)
    first = tasks["step"].delay(2, 1, 1.0)
    with in_process_worker(app, pool="threads", concurrency=2):
        member = member_for("replace.step", "walk:2")
        wait_for(lambda: r.hget(SCHEMA.record(member), "attempts") == b"2", 10, "the replacement to start")
        again = tasks["step"].delay(2, 1, 1.0)
        assert again.deduplicated and again.id == first.id
        assert first.get(timeout=20) == "walked 2"


def test_a_replacement_under_another_key_ends_the_run_as_replaced(make_app: AppFactory, r: redis.Redis) -> None:
    app = make_app()
    tasks = register(app)
    with in_process_worker(app, pool="threads", concurrency=2):
        run = tasks["hand_off"].delay(7)
        assert run.get(timeout=20) == "finished 7"
        origin, target = member_for("replace.hand_off", "hand:7"), member_for("replace.finish", "finish:7")
        wait_for(lambda: r.hget(SCHEMA.record(target), "state") == b"succeeded", 10, "the replacement to end")
    assert r.get("replace:finished:7") == b"1"
    assert r.hget(SCHEMA.record(origin), "state") == b"replaced"
    assert history(r, origin)[-1] == ["replaced", run.id, "by replace.finish"]
    assert r.hget(SCHEMA.record(target), "task_id") == run.id.encode(), "the replacement inherits the id"
    assert not r.sismember(SCHEMA.held, origin) and not r.sismember(SCHEMA.held, target)
    assert queued_messages(r) == []


def test_a_replacement_that_ends_before_its_predecessor_unwinds_still_settles_the_run(
    make_app: AppFactory, r: redis.Redis
) -> None:
    """The last step finishes on another thread while the step it replaced is still unwinding.

    Both deliveries carry the run's id: the ending of one must not take the
    other's lock or hand-over for its own (the record would stay ``started``,
    its lock held, with the result already sent).
    """
    app = make_app()
    client = redis.Redis.from_url(str(app.conf.broker_url))

    class SlowToUnwind(DedupTask):
        def on_replace(self, sig: Any) -> Any:
            try:
                return super().on_replace(sig)  # publishes the replacement, then raises Ignore
            finally:
                wait_for(lambda: client.exists("replace:done:9"), 10, "the replacement to return")
                time.sleep(0.3)  # its guard has ended it: only now does this step unwind

    @app.task(base=SlowToUnwind, name="replace.slow", dedup_key="walk:{n}", bind=True, shared=False)
    def slow(self: DedupTask, n: int, i: int) -> Any:
        client.rpush(f"replace:steps:{n}", f"{i} {self.request.id}")
        if i < 2:
            return self.replace(slow.s(n, i + 1))
        client.set(f"replace:done:{n}", 1)
        return f"walked {n}"

    member = member_for("replace.slow", "walk:9")
    with in_process_worker(app, pool="threads", concurrency=2):
        run = slow.delay(9, 1)
        assert run.get(timeout=20) == "walked 9"
        wait_for(lambda: r.hget(SCHEMA.record(member), "state") == b"succeeded", 10, "the run to be recorded")
    assert not r.sismember(SCHEMA.held, member) and not r.exists(SCHEMA.lock(member))


def test_a_duplicate_group_member_of_a_run_that_replaced_itself_gets_the_replacements_result(
    make_app: AppFactory, r: redis.Redis
) -> None:
    from celery import group

    app = make_app()
    client = redis.Redis.from_url(str(app.conf.broker_url))

    @app.task(base=DedupTask, name="replace.build", dedup_key="build:{doc}", bind=True, shared=False)
    def build(self: DedupTask, doc: int) -> Any:
        time.sleep(0.3)
        raise self.replace(render.s(doc))

    @app.task(name="replace.render", shared=False)
    def render(doc: int) -> str:
        client.incr(f"replace:rendered:{doc}")
        return f"rendered {doc}"

    result = group(build.s(1), build.s(1)).apply_async()
    with in_process_worker(app, pool="threads", concurrency=2):
        assert result.get(timeout=20) == ["rendered 1", "rendered 1"]
