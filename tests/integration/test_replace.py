"""``Task.replace`` runs as in plain Celery, and the status record says what happened.

A replacement under the same key keeps the run's id and key: it goes on as the
same run (the record shows it queued again, "replaced by ..."). A replacement
under another key, or by a plain task, ends the run as ``replaced``.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

import pytest
import redis
from celery import Celery, group
from celery.result import GroupResult

from celery_dedup import DedupTask, runtime
from celery_dedup.keys import KeySchema, member_for

from ..conftest import AppFactory, in_process_worker, queued_messages, wait_for
from ..conftest import history as stored_history

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
    return [entry.split(" ", 3)[1:] for entry in reversed(stored_history(r, member))]


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


def test_a_run_that_replaces_itself_after_losing_its_lock_reports_the_loss(
    make_app: AppFactory, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """The body's lock lapses (its worker paused past the lock's TTL) and a copy of the run takes the run over.

    The body resumes and replaces itself under its key before its renewer ran
    again: the hand-over finds the lock in the copy's hands. The two bodies
    ran at once, which a lost lock allows only if the library says so: the
    loss is logged (``lock_lost``) and ``dedup_lock_lost`` turns True. The
    copy's lock and record are left alone; here its worker dies, and the
    replacement runs the next step once its lock has expired.
    """
    caplog.set_level(logging.INFO, logger="celery_dedup")
    app = make_app(dedup_lock_ttl=30)  # renewed every 10 s: the body hands over long before its renewer looks
    client = redis.Redis.from_url(str(app.conf.broker_url))
    store = runtime.store_for(app)
    member = member_for("replace.lapse", "lapse:3")
    seen_lost: list[bool] = []

    @app.task(base=DedupTask, name="replace.lapse", dedup_key="lapse:{n}", bind=True, shared=False)
    def lapse(self: DedupTask, n: int, i: int) -> Any:
        client.rpush("lapse:steps", i)
        if i == 2:
            return f"walked {n}"
        client.delete(SCHEMA.lock(member))  # its lock expired while its worker was paused
        copy = store.start(  # meanwhile a copy of the run started on another worker (whose process dies)
            member, str(self.request.id), "copy", lock_ms=1000, gated=True,
            key_mode=self.dedup_policy.mode.key_on_start, hostname="elsewhere", pid=1, retries=0, record_ms=60_000,
        )  # fmt: skip
        assert copy.run
        try:
            raise self.replace(lapse.s(n, 2))
        finally:
            seen_lost.append(self.dedup_lock_lost)

    with in_process_worker(app, pool="threads", concurrency=2):
        run = lapse.delay(3, 1)
        assert run.get(timeout=20) == "walked 3"
        wait_for(lambda: r.hget(SCHEMA.record(member), "state") == b"succeeded", 10, "the run to be recorded")
    lost = [rec for rec in caplog.records if getattr(rec, "dedup_decision", "") == "lock_lost"]
    assert [getattr(rec, "dedup_task_id", None) for rec in lost] == [run.id], "the body that lost its lock must say so"
    assert seen_lost == [True]
    assert r.lrange("lapse:steps", 0, -1) == [b"1", b"2"], "the next step ran once"
    assert not r.sismember(SCHEMA.held, member) and not r.exists(SCHEMA.lock(member))


def test_a_copy_running_beside_its_original_in_one_process_keeps_its_own_delivery(
    make_app: AppFactory, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A threads pool runs the original and, after the original's lock lapsed, a copy of the same run.

    Each execution's calls (``dedup_lock_lost``, ``Task.replace``) must reach its own delivery, never the
    other one's because it has the same run id: the original, which lost its lock, reports the loss when it
    replaces itself; the copy, which holds the lock, has lost nothing, and its lock and ending are its own.
    """
    caplog.set_level(logging.INFO, logger="celery_dedup")
    app = make_app(dedup_lock_ttl=30)
    client = redis.Redis.from_url(str(app.conf.broker_url))
    member = member_for("replace.twin", "twin:4")
    seen: dict[str, bool] = {}

    @app.task(base=DedupTask, name="replace.twin", dedup_key="twin:{n}", bind=True, shared=False)
    def twin(self: DedupTask, n: int, i: int) -> Any:
        client.rpush("twin:steps", i)
        if i == 2:
            return f"walked {n}"
        if client.incr("twin:bodies") > 1:  # the copy, in the same process
            client.set("twin:copy-running", 1)
            wait_for(lambda: client.exists("twin:original-done"), 10, "the original to replace itself")
            seen["copy"] = self.dedup_lock_lost
            return "copy"
        client.delete(SCHEMA.lock(member))  # its lock lapsed (its worker was paused past the TTL)
        client.rpush("celery", client.get("twin:message") or b"")  # the transport delivers a copy
        wait_for(lambda: client.exists("twin:copy-running"), 10, "the copy to run beside it")
        try:
            raise self.replace(twin.s(n, 2))
        finally:
            seen["original"] = self.dedup_lock_lost
            client.set("twin:original-done", 1)

    run = twin.delay(4, 1)
    (raw,) = client.lrange("celery", 0, -1)
    client.set("twin:message", raw)
    with in_process_worker(app, pool="threads", concurrency=3):
        wait_for(lambda: seen.keys() == {"original", "copy"}, 20, "both bodies to end")
        # The copy held the run's lock, so its ending is the run's (the original's replacement, published as
        # the run going on, is skipped as a copy of an ended run).
        wait_for(lambda: r.hget(SCHEMA.record(member), "state") == b"succeeded", 20, "the copy's ending")
    assert seen == {"original": True, "copy": False}, seen
    lost = [rec for rec in caplog.records if getattr(rec, "dedup_decision", "") == "lock_lost"]
    assert [getattr(rec, "dedup_task_id", None) for rec in lost] == [run.id], "the original reports its loss once"
    assert not r.sismember(SCHEMA.held, member) and not r.exists(SCHEMA.lock(member))


def replacing_builds(app: Celery) -> Any:
    """``replace.build`` keyed ``build:{doc}``, which replaces itself as ``how`` says; the tasks it may replace it with.

    ``how``: "plain" (a plain task), "keyed" (a task under another key),
    "twice" (a plain task that replaces itself in turn), "chain" (a chain of
    two plain tasks), "group" (a group, which Celery makes a chord), "fails"
    (a plain task that raises).
    """
    client = redis.Redis.from_url(str(app.conf.broker_url))

    @app.task(base=DedupTask, name="replace.build", dedup_key="build:{doc}", bind=True, shared=False)
    def build(self: DedupTask, doc: int, how: str) -> Any:
        client.incr(f"replace:built:{doc}")
        time.sleep(0.3)
        replacement = {
            "plain": render.s(doc),
            "keyed": publish.s(doc),
            "twice": relayed.s(doc),
            "chain": render.s(doc) | shout.s(),
            "group": group(render.s(doc), render.s(doc + 100)),
            "fails": broken.s(doc),
        }[how]
        raise self.replace(replacement)

    @app.task(name="replace.render", shared=False)
    def render(doc: int) -> str:
        client.incr(f"replace:rendered:{doc}")
        return f"rendered {doc}"

    @app.task(base=DedupTask, name="replace.publish", dedup_key="publish:{doc}", shared=False)
    def publish(doc: int) -> str:
        client.incr(f"replace:rendered:{doc}")
        return f"published {doc}"

    @app.task(name="replace.relayed", bind=True, shared=False)
    def relayed(self: Any, doc: int) -> Any:
        raise self.replace(render.s(doc))

    @app.task(name="replace.shout", shared=False)
    def shout(text: str) -> str:
        return text.upper()

    @app.task(name="replace.broken", shared=False)
    def broken(doc: int) -> str:
        client.incr(f"replace:rendered:{doc}")
        raise RuntimeError(f"cannot render {doc}")

    return build


@pytest.mark.parametrize(
    ("how", "value"),
    [
        ("plain", "rendered 1"),
        ("keyed", "published 1"),
        ("twice", "rendered 1"),
        ("chain", "RENDERED 1"),
        ("group", ["rendered 1", "rendered 101"]),
    ],
)
def test_a_duplicate_group_member_of_a_run_that_replaced_itself_gets_the_replacements_result(
    make_app: AppFactory, r: redis.Redis, how: str, value: Any
) -> None:
    """As Celery resolves the replaced member with its replacement's result, so the duplicate member.

    Regression: the duplicate followed the run, which ended ``replaced``, and failed with DedupFollowerError.
    """
    app = make_app()
    build = replacing_builds(app)
    result = group(build.s(1, how), build.s(1, how)).apply_async()
    with in_process_worker(app, pool="threads", concurrency=2):
        assert result.get(timeout=20) == [value, value]
    gc.collect()  # the results a replacement made in the worker unsubscribe while the server is up
    assert r.get("replace:built:1") == b"1" and r.get("replace:rendered:1") == b"1", "the work ran once"
    member = member_for("replace.build", "build:1")
    assert r.hget(SCHEMA.record(member), "state") == b"replaced"
    assert r.hlen(SCHEMA.followers(member)) == 0


def test_a_duplicate_group_member_of_a_run_whose_replacement_failed_fails_with_its_error(
    make_app: AppFactory, r: redis.Redis
) -> None:
    app = make_app()
    build = replacing_builds(app)
    result = group(build.s(2, "fails"), build.s(2, "fails")).apply_async()
    assert isinstance(result, GroupResult)
    with in_process_worker(app, pool="threads", concurrency=2):
        result.join(timeout=20, propagate=False)
    first, follower = result.results
    assert isinstance(first.result, RuntimeError)
    error = str(follower.result)
    assert follower.state == "FAILURE" and "DedupFollowerError" in repr(follower.result), error
    assert "failed" in error and "cannot render 2" in error and first.id in error
    assert r.get("replace:rendered:2") == b"1"


def test_followers_of_a_replaced_run_are_left_parked_by_the_reaper_until_the_replacement_ends(
    make_app: AppFactory, r: redis.Redis
) -> None:
    """The reaper releases followers of ended runs a grace later; a replaced run's wait for their replacement."""
    app = make_app(dedup_reap_interval=0.2, dedup_reap_grace=0.2)
    client = redis.Redis.from_url(str(app.conf.broker_url))

    @app.task(base=DedupTask, name="replace.slow_build", dedup_key="build:{doc}", bind=True, shared=False)
    def build(self: DedupTask, doc: int) -> Any:
        raise self.replace(slow.s(doc))

    @app.task(name="replace.slow_render", shared=False)
    def slow(doc: int) -> str:
        time.sleep(2.0)  # many reaper passes
        client.incr(f"replace:rendered:{doc}")
        return f"rendered {doc}"

    result = group(build.s(3), build.s(3)).apply_async()
    with in_process_worker(app, pool="threads", concurrency=2):
        assert result.get(timeout=20) == ["rendered 3", "rendered 3"]
    assert r.get("replace:rendered:3") == b"1"


def test_a_duplicate_group_member_of_a_run_replaced_under_its_own_key_gets_the_runs_result(
    make_app: AppFactory, r: redis.Redis
) -> None:
    """Under the same key the run goes on: its follower resolves with its last step, once."""
    app = make_app()
    tasks = register(app)
    result = group(tasks["step"].s(5, 1), tasks["step"].s(5, 1)).apply_async()
    with in_process_worker(app, pool="threads", concurrency=2):
        assert result.get(timeout=20) == ["walked 5", "walked 5"]
    assert r.llen("replace:steps:5") == STEPS


def test_a_follower_parked_after_the_replacement_ended_gets_its_result(make_app: AppFactory, r: redis.Redis) -> None:
    """The replacement ends before the run it replaced has unwound (its record still says started, its key held):
    a duplicate that comes then follows the run, and resolves with the replacement's result all the same.
    """
    app = make_app()
    client = redis.Redis.from_url(str(app.conf.broker_url))
    member = member_for("replace.unwinding", "build:6")
    came: dict[str, Any] = {}

    class SlowToUnwind(DedupTask):
        def on_replace(self, sig: Any) -> Any:
            try:
                return super().on_replace(sig)
            finally:
                wait_for(lambda: client.exists("replace:rendered:6"), 10, "the replacement to return")
                time.sleep(0.3)  # its ending has been relayed
                assert r.hget(SCHEMA.record(member), "state") == b"started"
                came["late"] = build.apply_async((6,), link=receipt.s())

    @app.task(base=SlowToUnwind, name="replace.unwinding", dedup_key="build:{doc}", bind=True, shared=False)
    def build(self: DedupTask, doc: int) -> Any:
        raise self.replace(render.s(doc))

    @app.task(name="replace.render_once", shared=False)
    def render(doc: int) -> str:
        client.incr(f"replace:rendered:{doc}")
        return f"rendered {doc}"

    @app.task(name="replace.receipt", shared=False)
    def receipt(value: str) -> None:
        client.rpush("replace:receipts", value)

    run = build.delay(6)
    with in_process_worker(app, pool="threads", concurrency=2):
        assert run.get(timeout=20) == "rendered 6"
        wait_for(lambda: client.llen("replace:receipts"), 20, "the late follower's callback")
    assert came["late"].deduplicated and came["late"].id == run.id
    assert client.lrange("replace:receipts", 0, -1) == [b"rendered 6"]
    assert r.get("replace:rendered:6") == b"1"
    assert r.hget(SCHEMA.record(member), "state") == b"replaced"


def test_a_follower_of_a_run_whose_replacement_was_revoked_fails_as_revoked(
    make_app: AppFactory, r: redis.Redis
) -> None:
    app = make_app()
    client = redis.Redis.from_url(str(app.conf.broker_url))

    @app.task(base=DedupTask, name="replace.deferring", dedup_key="build:{doc}", bind=True, shared=False)
    def build(self: DedupTask, doc: int) -> Any:
        raise self.replace(render.s(doc).set(countdown=1.5))

    @app.task(name="replace.render_later", shared=False)
    def render(doc: int) -> str:
        client.incr(f"replace:rendered:{doc}")
        return f"rendered {doc}"

    result = group(build.s(7), build.s(7)).apply_async()
    assert isinstance(result, GroupResult)
    member = member_for("replace.deferring", "build:7")
    with in_process_worker(app, pool="threads", concurrency=2):
        wait_for(lambda: r.hget(SCHEMA.record(member), "state") == b"replaced", 10, "the run to be replaced")
        first, follower = result.results
        first.revoke()
        result.join(timeout=20, propagate=False)
    assert first.state == "REVOKED"
    assert follower.state == "FAILURE" and "revoked" in str(follower.result), follower.result
    assert r.get("replace:rendered:7") is None


def test_a_replacement_that_is_itself_a_duplicate_resolves_the_run_and_its_follower_with_the_held_run(
    make_app: AppFactory, r: redis.Redis
) -> None:
    """The replacement's key is held by another run: the replacement follows that run instead of being dropped."""
    app = make_app()
    client = redis.Redis.from_url(str(app.conf.broker_url))

    @app.task(base=DedupTask, name="replace.late_build", dedup_key="build:{doc}", bind=True, shared=False)
    def build(self: DedupTask, doc: int) -> Any:
        raise self.replace(publish.s(doc))

    @app.task(base=DedupTask, name="replace.held_publish", dedup_key="publish:{doc}", shared=False)
    def publish(doc: int) -> str:
        time.sleep(1.0)
        client.incr(f"replace:published:{doc}")
        return f"published {doc}"

    @app.task(name="replace.late_receipt", shared=False)
    def receipt(value: str) -> None:
        client.rpush("replace:late_receipts", value)

    held = publish.delay(8)
    run = build.delay(8)
    follower = build.apply_async((8,), link=receipt.s())
    assert follower.deduplicated and follower.id == run.id
    with in_process_worker(app, pool="threads", concurrency=2):
        assert held.get(timeout=20) == "published 8"
        assert run.get(timeout=20) == "published 8"
        wait_for(lambda: client.llen("replace:late_receipts"), 20, "the follower's callback")
    assert client.lrange("replace:late_receipts", 0, -1) == [b"published 8"]
    assert r.get("replace:published:8") == b"1"


def test_a_debounced_run_replaced_under_its_own_key_runs_with_the_replacements_arguments(
    make_app: AppFactory, r: redis.Redis
) -> None:
    """The burst's arguments ran once: the replacement goes on with its own, and the run ends.

    A debounced run executes with the newest payload its record keeps; the
    replacement's publish must leave its own there, or each step runs the
    first one's arguments again and replaces itself forever.
    """
    app = make_app()
    client = redis.Redis.from_url(str(app.conf.broker_url))

    @app.task(
        base=DedupTask,
        name="replace.settle",
        dedup_key="settle:{n}",
        dedup_mode="debounce",
        dedup_window=0.2,
        bind=True,
        shared=False,
    )
    def settle(self: DedupTask, n: int, i: int) -> Any:
        client.rpush(f"replace:settled:{n}", i)
        if i < STEPS:
            return self.replace(settle.s(n, i + 1))
        return f"settled {n} at step {i}"

    member = member_for("replace.settle", "settle:4")
    with in_process_worker(app, pool="threads", concurrency=2):
        run = settle.delay(4, 1)
        wait_for(
            lambda: r.hget(SCHEMA.record(member), "state") == b"succeeded",
            10,
            lambda: f"the run to end; steps so far: {client.lrange('replace:settled:4', 0, 20)}",
        )
        assert run.get(timeout=10) == f"settled 4 at step {STEPS}"
    assert client.lrange("replace:settled:4", 0, -1) == [str(i).encode() for i in range(1, STEPS + 1)]
    assert not r.sismember(SCHEMA.held, member) and not r.exists(SCHEMA.lock(member))


def test_a_debounced_run_retried_with_new_arguments_runs_with_them(make_app: AppFactory, r: redis.Redis) -> None:
    """``Task.retry(args=...)`` of a debounced run: the retry runs the arguments it was given."""
    app = make_app()
    client = redis.Redis.from_url(str(app.conf.broker_url))

    @app.task(
        base=DedupTask,
        name="replace.debounced_retry",
        dedup_key="retry:{n}",
        dedup_mode="debounce",
        dedup_window=0.2,
        bind=True,
        shared=False,
    )
    def again(self: DedupTask, n: int, i: int) -> Any:
        client.rpush(f"replace:retried:{n}", i)
        if i == 1:
            raise self.retry(args=(n, 2), countdown=0.1, max_retries=3)
        return i

    with in_process_worker(app, pool="threads", concurrency=2):
        run = again.delay(5, 1)
        try:
            outcome: Any = run.get(timeout=10)
        except Exception as exc:  # what it raised is the finding
            outcome = exc
    assert client.lrange("replace:retried:5", 0, -1) == [b"1", b"2"]
    assert outcome == 2
