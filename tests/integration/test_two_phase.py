"""The two-phase gate: a store apart from the broker holds the key with a lease, then confirms the run.

On a Redis broker whose store is elsewhere (another database, another
server), messages are published once and never gated a second time by the
transport; a store that is the broker's server and database however spelled
is the atomic gate. A publisher that dies between holding and publishing
frees the key within ``dedup_publish_lease``, not the key's TTL.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from kombu.transport import redis as kombu_redis

import celery_dedup
from celery_dedup import DedupTask, DedupUnavailableError, runtime
from celery_dedup.keys import KeySchema, member_for
from celery_dedup.store.status import Status
from celery_dedup.testing import RedisServer, free_port

from ..conftest import AppFactory, Server, in_process_worker, queued_messages, wait_for

HELD = KeySchema("dedup").held
TASK = "twophase.charge"


def build(app: Celery, name: str = TASK, **options: Any) -> Any:
    """A keyed task that counts its executions (and when each ran) in the broker's database."""
    counter = redis.Redis.from_url(app.conf.broker_url)

    @app.task(base=DedupTask, dedup_key="order:{order_id}", bind=True, shared=False, name=name, **options)
    def charge(self: Any, order_id: int, seconds: float = 0.0) -> int:
        counter.rpush(f"runs:{order_id}", f"{self.request.id} {time.time()}")
        if seconds:
            time.sleep(seconds)
            counter.rpush(f"runs:{order_id}", f"{self.request.id} end {time.time()}")
        return order_id

    return charge


def runs(r: redis.Redis, order_id: int) -> list[str]:
    """Ids of the runs that executed the body for ``order_id``, in order."""
    return [entry.decode().split()[0] for entry in r.lrange(f"runs:{order_id}", 0, -1) if b" end " not in entry]


def history_text(status: Status | None) -> str:
    assert status is not None and status.history is not None
    return " | ".join(f"{entry.state} {entry.task_id} {entry.note}" for entry in status.history)


def store_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)


@pytest.fixture(scope="module")
def other_server() -> Iterator[RedisServer]:
    with RedisServer() as process:
        yield process


def separate_app(make_app: AppFactory, store_url: str, **conf: Any) -> Celery:
    conf.setdefault("task_default_queue", f"twophase-{uuid.uuid4().hex[:8]}")
    return make_app(dedup_redis_url=store_url, broker_transport_options={"polling_interval": 0.05}, **conf)


def another_database(server: Server) -> str:
    return server.url.rsplit("/", 1)[0] + "/1"


# -- Which gate a store gets ------------------------------------------------------------------------


@pytest.mark.parametrize("spelling", ["localhost", "no-database", "query"])
def test_a_store_that_is_the_broker_spelled_differently_gets_the_atomic_gate(
    make_app: AppFactory, server: Server, r: redis.Redis, spelling: str
) -> None:
    """``dedup_redis_url`` naming the broker's server and database another way: one message, one run."""
    port = server.url.rsplit(":", 1)[1].split("/")[0]
    url = {
        "localhost": f"redis://localhost:{port}/0",
        "no-database": f"redis://127.0.0.1:{port}",
        "query": f"redis://127.0.0.1:{port}/0?socket_timeout=5",
    }[spelling]
    app = separate_app(make_app, url)
    assert runtime.runtime_for(app).atomic, "the store is the broker's database: the gate is atomic"
    charge = build(app)

    first, second = charge.delay(1), charge.delay(1)

    assert (first.deduplicated, second.deduplicated, second.id) == (False, True, first.id)
    assert [m["headers"]["id"] for m in queued_messages(r, app.conf.task_default_queue)] == [first.id]
    with in_process_worker(app):
        assert first.get(timeout=10) == 1
    assert runs(r, 1) == [first.id]


@pytest.mark.parametrize("where", ["another-database", "another-server"])
def test_a_store_apart_from_a_redis_broker_publishes_each_message_once(
    make_app: AppFactory, server: Server, r: redis.Redis, other_server: RedisServer, where: str
) -> None:
    """The message is published once, gated by the store only: it runs, and the broker holds no key."""
    url = another_database(server) if where == "another-database" else other_server.url
    store = store_client(url)
    store.flushdb()
    app = separate_app(make_app, url)
    assert not runtime.runtime_for(app).atomic
    charge = build(app)
    member = member_for(charge.name, "order:2")

    first, second = charge.delay(2), charge.delay(2)

    assert (first.deduplicated, second.deduplicated, second.id) == (False, True, first.id)
    assert [m["headers"]["id"] for m in queued_messages(r, app.conf.task_default_queue)] == [first.id]
    assert r.keys("dedup*") == [], "the broker's database holds no dedup key: the transport did not gate again"
    assert store.smembers(HELD) == {member.encode()}
    assert getattr(charge.dedup_status(2), "state", None) == "queued"
    with in_process_worker(app):
        assert first.get(timeout=10) == 2
    assert runs(r, 2) == [first.id]
    assert store.scard(HELD) == 0
    assert r.keys("dedup*") == []
    assert getattr(charge.dedup_status(2), "state", None) == "succeeded"


# -- Phase one: the lease ---------------------------------------------------------------------------


def _freeze_after_hold(broker: str, store: str, lease: float, held: Any) -> None:
    """Child process: hold order 3's key, then stop before publishing (until killed)."""
    app = Celery("twophase-child", broker=broker, backend=broker, set_as_current=False)
    app.conf.update(dedup_redis_url=store, dedup_publish_lease=lease, broker_connection_retry_on_startup=False)
    celery_dedup.install(app)
    charge = build(app)

    def frozen(self: Any, *args: Any, **kwargs: Any) -> None:
        held.set()
        time.sleep(60)

    kombu_redis.Channel._put = frozen  # type: ignore[method-assign]
    charge.delay(3)


def test_a_publisher_killed_between_hold_and_publish_frees_the_key_within_the_lease(
    make_app: AppFactory, server: Server, r: redis.Redis
) -> None:
    """SIGKILL at that point: the key is ``publishing`` until its lease ends, then the next call runs once."""
    url = another_database(server)
    store = store_client(url)
    store.flushdb()
    held = multiprocessing.get_context("spawn").Event()
    child = multiprocessing.get_context("spawn").Process(
        target=_freeze_after_hold, args=(server.url, url, 2.0, held), daemon=True
    )
    child.start()
    try:
        assert held.wait(60), "the publisher never reached its publish"
        app = separate_app(make_app, url, task_default_queue="celery")
        charge = build(app)
        status = charge.dedup_status(3)
        assert status is not None and status.state == "publishing"
        os.kill(child.pid or 0, signal.SIGKILL)
        child.join(10)
    finally:
        if child.is_alive():
            child.kill()
    assert child.exitcode == -signal.SIGKILL
    assert queued_messages(r) == [], "the child died before publishing"

    during = charge.delay(3)
    assert during.deduplicated, "within the lease the key is the dead publisher's"
    later = wait_for(lambda: (c := charge.delay(3)) and not c.deduplicated and c, 10, "the key freed by its lease")
    assert [m["headers"]["id"] for m in queued_messages(r)] == [later.id]
    with in_process_worker(app):
        assert later.get(timeout=10) == 3
    assert runs(r, 3) == [later.id]
    history = history_text(charge.dedup_status(3))
    assert during.id in history and "lost" in history, history


class _BrokerSaid(Exception):
    """A publish the broker refused (no connection error): nothing was sent."""


def test_a_publish_refused_by_the_broker_frees_the_key_at_once(
    make_app: AppFactory, server: Server, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = another_database(server)
    store_client(url).flushdb()
    app = separate_app(make_app, url)
    charge = build(app)

    def refuse(self: Any, queue: str, message: Any, **kwargs: Any) -> None:
        raise _BrokerSaid("no")

    monkeypatch.setattr(kombu_redis.Channel, "_put", refuse)
    with pytest.raises(_BrokerSaid):
        charge.delay(4)
    monkeypatch.undo()

    assert charge.dedup_status(4) is None and store_client(url).scard(HELD) == 0
    again = charge.delay(4)
    assert not again.deduplicated
    with in_process_worker(app):
        assert again.get(timeout=10) == 4
    assert runs(r, 4) == [again.id]


def test_a_publish_that_failed_after_the_broker_took_it_runs_once(
    make_app: AppFactory, server: Server, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection breaks after the message went out: the outcome is unknown, so the key keeps its lease.

    The delivery of that run is accepted although it was never confirmed, and
    a call within the lease is its duplicate: the body runs once.
    """
    url = another_database(server)
    store_client(url).flushdb()
    app = separate_app(make_app, url, dedup_publish_lease=30, task_publish_retry=False)
    charge = build(app)
    original = kombu_redis.Channel._put

    def sent_then_cut(self: Any, queue: str, message: Any, **kwargs: Any) -> None:
        original(self, queue, message, **kwargs)
        raise redis.ConnectionError("connection reset after the write")

    monkeypatch.setattr(kombu_redis.Channel, "_put", sent_then_cut)
    with pytest.raises(Exception) as raised:
        charge.delay(5)
    monkeypatch.undo()
    assert "connection reset" in str(raised.value)

    status = charge.dedup_status(5)
    assert status is not None and status.state == "publishing", "unknown outcome: the key keeps its lease"
    sent = [m["headers"]["id"] for m in queued_messages(r, app.conf.task_default_queue)]
    assert len(sent) == 1 and sent[0] == status.task_id
    assert charge.delay(5).id == sent[0]
    with in_process_worker(app):
        wait_for(lambda: getattr(charge.dedup_status(5), "state", None) == "succeeded", 10, "the run ended")
    assert runs(r, 5) == sent


def test_a_delivery_before_its_confirm_runs_and_the_late_confirm_changes_nothing(
    make_app: AppFactory, server: Server, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker starts the run while its publisher still waits for the broker's confirm."""
    url = another_database(server)
    store_client(url).flushdb()
    app = separate_app(make_app, url)
    charge = build(app)
    original = kombu_redis.Channel._put
    ran = threading.Event()

    def slow_confirm(self: Any, queue: str, message: Any, **kwargs: Any) -> None:
        original(self, queue, message, **kwargs)
        ran.wait(20)

    results: list[Any] = []
    with in_process_worker(app):
        monkeypatch.setattr(kombu_redis.Channel, "_put", slow_confirm)
        caller = threading.Thread(target=lambda: results.append(charge.delay(6)))
        caller.start()
        wait_for(lambda: getattr(charge.dedup_status(6), "state", None) == "succeeded", 10, "the run ended")
        ran.set()
        caller.join(10)
        monkeypatch.undo()
    assert len(results) == 1 and not results[0].deduplicated
    assert runs(r, 6) == [results[0].id]
    status = charge.dedup_status(6)
    assert status is not None and status.state == "succeeded", "the late confirm did not move the record back"


class _LateConfirm:
    """One call, made on its own thread, whose message goes out at once but whose confirm waits for :meth:`confirm`.

    Only that call's publish waits (after the broker has its message, before
    the store hears of it); every other publish (a newer call, a worker's
    retry) goes through. ``results`` and ``raised`` say what the call got.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, call: Any) -> None:
        self.results: list[Any] = []
        self.raised: list[BaseException] = []
        self._go = threading.Event()
        original = kombu_redis.Channel._put
        late = threading.local()

        def put(channel: Any, queue: str, message: Any, **kwargs: Any) -> None:
            original(channel, queue, message, **kwargs)
            if getattr(late, "on", False):
                late.on = False
                self._go.wait(20)

        def run() -> None:
            late.on = True
            try:
                self.results.append(call())
            except Exception as exc:  # what the caller is told is what the test reads
                self.raised.append(exc)

        monkeypatch.setattr(kombu_redis.Channel, "_put", put)
        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def confirm(self) -> None:
        """Let the confirm go to the store now, and wait for the call to return."""
        self._go.set()
        self._thread.join(10)
        assert not self._thread.is_alive(), "the call never returned"


def answers(late: _LateConfirm) -> list[tuple[str, bool]]:
    """What the late-confirmed call was told: its result's id and whether it was a duplicate, or the error."""
    return [(res.id, res.deduplicated) for res in late.results] + [(repr(exc), True) for exc in late.raised]


@pytest.mark.parametrize("policy", ["return_existing", "raise"])
@pytest.mark.parametrize("retried", [False, True], ids=["ran", "retried"])
def test_a_confirm_after_its_run_ended_and_a_newer_call_answers_its_own_run(
    make_app: AppFactory, server: Server, r: redis.Redis, monkeypatch: pytest.MonkeyPatch, policy: str, retried: bool
) -> None:
    """The run executes (retried once, or not) and succeeds before its confirm; a newer call takes the key.

    The late confirm changes nothing: the first caller's message was
    published and ran, so it gets its own run, neither the newer one nor
    DuplicateTaskError. Only a message that reached the broker after its
    lease ended stands for the newer run.
    """
    url = another_database(server)
    store_client(url).flushdb()
    app = separate_app(make_app, url, dedup_on_duplicate=policy)

    @app.task(base=DedupTask, dedup_key="order:{order_id}", bind=True, shared=False, name=TASK)
    def charge(self: Any, order_id: int) -> int:
        r.rpush(f"runs:{order_id}", f"{self.request.id} {time.time()}")
        if retried and not self.request.retries:
            raise self.retry(countdown=0)
        return order_id

    with in_process_worker(app):
        first = _LateConfirm(monkeypatch, lambda: charge.delay(11))
        wait_for(lambda: getattr(charge.dedup_status(11), "state", None) == "succeeded", 10, "the first run ended")
        first_id = charge.dedup_status(11).task_id
        newer = charge.delay(11)
        assert not newer.deduplicated and newer.id != first_id, "the key was free: a newer run"
        first.confirm()
        assert newer.get(timeout=10) == 11
        assert answers(first) == [(first_id, False)], "the first caller is told its own run"
        assert first.results[0].get(timeout=10) == 11
    monkeypatch.undo()
    assert runs(r, 11) == [first_id] * (2 if retried else 1) + [newer.id] * (2 if retried else 1)
    status = charge.dedup_status(11)
    assert status is not None and (status.task_id, status.state) == (newer.id, "succeeded")


def test_a_confirm_after_its_run_started_and_a_newer_call_answers_its_own_run(
    make_app: AppFactory, server: Server, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """until_executing: the run starts before its confirm, releasing the key, and a newer call takes it.

    The run is executing, not ended, when its confirm comes: the first
    caller still gets its own run.
    """
    url = another_database(server)
    store_client(url).flushdb()
    app = separate_app(make_app, url, dedup_on_duplicate="raise")
    running, finish = threading.Event(), threading.Event()

    @app.task(
        base=DedupTask, dedup_key="order:{order_id}", bind=True, shared=False, name=TASK, dedup_mode="until_executing"
    )
    def charge(self: Any, order_id: int) -> int:
        r.rpush(f"runs:{order_id}", f"{self.request.id} {time.time()}")
        running.set()
        finish.wait(20)
        return order_id

    with in_process_worker(app):
        try:
            first = _LateConfirm(monkeypatch, lambda: charge.delay(12))
            assert running.wait(10), "the first run never started"
            first_id = charge.dedup_status(12).task_id
            newer = charge.delay(12)
            assert not newer.deduplicated and newer.id != first_id, "the key was released at start: a newer run"
            first.confirm()
        finally:
            finish.set()
        assert answers(first) == [(first_id, False)], "the first caller is told its own run"
        assert first.results[0].get(timeout=10) == 12
    monkeypatch.undo()
    assert runs(r, 12)[0] == first_id


def test_a_late_message_skipped_before_its_confirm_still_stands_for_the_newer_run(
    make_app: AppFactory, server: Server, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lease 1 s: a newer call takes the key, the first message goes out late and is skipped, then it confirms.

    Its delivery was refused (superseded), not run: the first caller is
    told the newer run, which did the work.
    """
    url = another_database(server)
    store_client(url).flushdb()
    app = separate_app(make_app, url, dedup_publish_lease=1)
    charge = build(app)
    original = kombu_redis.Channel._put
    late = threading.local()
    taken, skipped = threading.Event(), threading.Event()

    def slow(self: Any, queue: str, message: Any, **kwargs: Any) -> None:
        if getattr(late, "on", False):
            taken.wait(20)
        original(self, queue, message, **kwargs)
        if getattr(late, "on", False):
            skipped.wait(20)

    results: list[Any] = []

    def first_call() -> None:
        late.on = True
        results.append(charge.delay(13))

    monkeypatch.setattr(kombu_redis.Channel, "_put", slow)
    caller = threading.Thread(target=first_call, daemon=True)
    caller.start()
    wait_for(lambda: getattr(charge.dedup_status(13), "state", None) == "publishing", 5, "the first hold")
    first_id = charge.dedup_status(13).task_id
    newer = wait_for(lambda: (c := charge.delay(13)) and not c.deduplicated and c, 5, "the lease to pass")
    with in_process_worker(app):
        assert newer.get(timeout=10) == 13
        taken.set()
        wait_for(lambda: getattr(charge.dedup_status(13), "skipped", 0) == 1, 10, "the late message skipped")
        skipped.set()
        caller.join(10)
    monkeypatch.undo()

    assert [(res.id, res.deduplicated) for res in results] == [(newer.id, True)], "told the newer run"
    assert runs(r, 13) == [newer.id], "the late message of the first hold was skipped"
    assert first_id in history_text(charge.dedup_status(13))


def test_a_message_published_past_its_lease_and_a_newer_call_run_one_at_a_time(
    make_app: AppFactory, server: Server, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lease 1 s, the first publish stuck until a newer call took the key over; the late message is skipped.

    The first caller learns the run that has the key; both runs are in the
    record's history, and the body runs once.
    """
    url = another_database(server)
    store_client(url).flushdb()
    app = separate_app(make_app, url, dedup_publish_lease=1)
    charge = build(app)
    original = kombu_redis.Channel._put
    stuck = threading.local()
    taken_over = threading.Event()

    def slow(self: Any, queue: str, message: Any, **kwargs: Any) -> None:
        if getattr(stuck, "on", False):
            taken_over.wait(20)
        original(self, queue, message, **kwargs)

    monkeypatch.setattr(kombu_redis.Channel, "_put", slow)
    results: list[Any] = []

    def first_call() -> None:
        stuck.on = True
        results.append(charge.delay(7))

    caller = threading.Thread(target=first_call)
    caller.start()
    wait_for(lambda: getattr(charge.dedup_status(7), "state", None) == "publishing", 15, "the first hold")
    first_id = charge.dedup_status(7).task_id
    newer = wait_for(lambda: (c := charge.delay(7)) and not c.deduplicated and c, 15, "the lease to pass")
    taken_over.set()
    caller.join(10)
    monkeypatch.undo()

    assert len(results) == 1
    assert (results[0].id, results[0].deduplicated) == (newer.id, True), "the first caller learns the newer run"
    sent = [m["headers"]["id"] for m in queued_messages(r, app.conf.task_default_queue)]
    assert sorted(sent) == sorted([first_id, newer.id]), "both messages were published"
    with in_process_worker(app):
        assert newer.get(timeout=10) == 7
        wait_for(lambda: len(queued_messages(r, app.conf.task_default_queue)) == 0, 10, "both delivered")
        time.sleep(0.5)
    assert runs(r, 7) == [newer.id], "the late message of the first hold was skipped"
    history = history_text(charge.dedup_status(7))
    assert first_id in history and newer.id in history, history


def test_the_reaper_declares_an_unconfirmed_run_lost_and_a_late_confirm_revives_it(
    make_app: AppFactory, server: Server, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lease 1 s, publish stuck 2 s: the reaper marks the run lost; its confirm then gives it back its hold."""
    url = another_database(server)
    store = store_client(url)
    store.flushdb()
    app = separate_app(make_app, url, dedup_publish_lease=1)
    charge = build(app)
    original = kombu_redis.Channel._put
    reaped = threading.Event()

    def stuck(self: Any, queue: str, message: Any, **kwargs: Any) -> None:
        reaped.wait(10)
        original(self, queue, message, **kwargs)

    monkeypatch.setattr(kombu_redis.Channel, "_put", stuck)
    results: list[Any] = []
    caller = threading.Thread(target=lambda: results.append(charge.delay(8)))
    caller.start()
    wait_for(lambda: getattr(charge.dedup_status(8), "state", None) == "publishing", 5, "the hold")
    run_id = charge.dedup_status(8).task_id
    report = wait_for(lambda: (rep := runtime.reap(app)).lost and rep, 5, "the lease to end")
    assert [(task_id, why) for _, task_id, why in report.runs] == [
        (run_id, "its publisher never confirmed the publish within its lease")
    ]
    assert getattr(charge.dedup_status(8), "state", None) == "lost" and store.scard(HELD) == 0
    reaped.set()
    caller.join(10)
    monkeypatch.undo()

    assert [(res.id, res.deduplicated) for res in results] == [(run_id, False)]
    status = charge.dedup_status(8)
    assert status is not None and (status.state, status.held_until is not None) == ("queued", True)
    assert charge.delay(8).id == run_id, "the key is the run's again"
    with in_process_worker(app):
        assert results[0].get(timeout=10) == 8
    assert runs(r, 8) == [run_id]


def test_a_run_reaped_unconfirmed_then_taken_over_is_answered_with_the_newer_run(
    make_app: AppFactory, server: Server, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lease 1 s, publish stuck: the reaper marks the run lost, a newer call takes the key, then the confirm comes.

    Lost before it began, the run is not revived by its confirm once the key
    is another run's: the first caller is told the newer run, and its late
    message is skipped.
    """
    url = another_database(server)
    store_client(url).flushdb()
    app = separate_app(make_app, url, dedup_publish_lease=1)
    charge = build(app)
    original = kombu_redis.Channel._put
    late = threading.local()
    taken = threading.Event()

    def stuck(self: Any, queue: str, message: Any, **kwargs: Any) -> None:
        if getattr(late, "on", False):
            taken.wait(10)
        original(self, queue, message, **kwargs)

    results: list[Any] = []

    def first_call() -> None:
        late.on = True
        results.append(charge.delay(14))

    monkeypatch.setattr(kombu_redis.Channel, "_put", stuck)
    caller = threading.Thread(target=first_call, daemon=True)
    caller.start()
    wait_for(lambda: getattr(charge.dedup_status(14), "state", None) == "publishing", 5, "the hold")
    first_id = charge.dedup_status(14).task_id
    wait_for(lambda: runtime.reap(app).lost, 5, "the lease to end")
    newer = charge.delay(14)
    assert not newer.deduplicated
    taken.set()
    caller.join(10)
    monkeypatch.undo()

    assert [(res.id, res.deduplicated) for res in results] == [(newer.id, True)], "told the newer run"
    with in_process_worker(app):
        assert newer.get(timeout=10) == 14
        wait_for(lambda: len(queued_messages(r, app.conf.task_default_queue)) == 0, 10, "both delivered")
        wait_for(lambda: getattr(charge.dedup_status(14), "skipped", 0) == 1, 10, "the late message skipped")
    assert runs(r, 14) == [newer.id]
    assert first_id in history_text(charge.dedup_status(14))


def test_a_run_that_starts_before_its_confirm_keeps_its_window(
    make_app: AppFactory, server: Server, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """until_expired, lease 1 s: the delivery proves the message is out, so the key keeps its 30 s window."""
    url = another_database(server)
    store_client(url).flushdb()
    app = separate_app(make_app, url, dedup_publish_lease=1)
    charge = build(app, dedup_mode="until_expired", dedup_ttl=30)
    original = kombu_redis.Channel._put
    ran = threading.Event()

    def never_confirmed(self: Any, queue: str, message: Any, **kwargs: Any) -> None:
        original(self, queue, message, **kwargs)
        ran.wait(20)
        raise redis.ConnectionError("connection reset before the confirm")

    raised: list[BaseException] = []

    def call() -> None:
        try:
            charge.delay(9)
        except Exception as exc:  # the cut publish raises, as it should: read below
            raised.append(exc)

    with in_process_worker(app):
        monkeypatch.setattr(kombu_redis.Channel, "_put", never_confirmed)
        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        wait_for(lambda: getattr(charge.dedup_status(9), "state", None) == "succeeded", 10, "the run ended")
        ran.set()
        caller.join(10)
        monkeypatch.undo()
    assert [str(exc) for exc in raised] == ["connection reset before the confirm"]
    time.sleep(1.5)  # past the lease
    run = runs(r, 9)
    assert len(run) == 1
    assert charge.delay(9).id == run[0], "within its window the key is still the run's"


def test_a_retry_publishes_while_the_store_is_unreachable(make_app: AppFactory, r: redis.Redis) -> None:
    """A continuation of an accepted run (Task.retry from a worker that cannot reach the store) still goes out.

    Its delivery is guarded like any other; refusing it would leave the run's key held with no message.
    A new call in the same outage is refused (fail_closed): it could be a duplicate.
    """
    app = separate_app(make_app, f"redis://127.0.0.1:{free_port()}/0")
    charge = build(app)
    header = charge.dedup_gate_header(member_for(charge.name, "order:10")).encode()

    retried = charge.apply_async((10,), task_id="order:10~run", headers={"dedup": header})

    assert retried.id == "order:10~run"
    [message] = queued_messages(r, app.conf.task_default_queue)
    assert message["headers"]["id"] == "order:10~run" and message["headers"]["dedup"]["held"] is True
    with pytest.raises(DedupUnavailableError):
        charge.delay(10)


def test_last_outcome_names_each_publish_through_the_store_apart(make_app: AppFactory, server: Server) -> None:
    """With the two-phase gate too, ``last_outcome()`` is the outcome of the latest publish, not a stale one."""
    charge = build(separate_app(make_app, another_database(server)))

    first = charge.delay(1)
    accepted = celery_dedup.last_outcome()
    second = charge.delay(2)
    other = celery_dedup.last_outcome()
    again = charge.delay(2)
    duplicate = celery_dedup.last_outcome()

    assert accepted is not None and (accepted.accepted, accepted.task_id) == (True, first.id)
    assert other is not None and (other.accepted, other.task_id) == (True, second.id)
    assert duplicate is not None and (duplicate.accepted, duplicate.task_id) == (False, second.id)
    assert again.deduplicated
