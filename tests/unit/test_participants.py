"""The worker's small protocols, as pure logic: a delivery's participants, and what the renewer renews.

No server: the deliveries here never ask the store (their participants
decide first), and the renewables are plain objects that keep their own books.
"""

from __future__ import annotations

import ast
import threading
from collections.abc import Hashable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import redis
from celery import Celery

from celery_dedup import DedupTask
from celery_dedup.worker import delivery as delivery_module
from celery_dedup.worker.delivery import Delivery, Report, live, running
from celery_dedup.worker.limits import LIMITS
from celery_dedup.worker.lock import Renewer
from celery_dedup.worker.steps import STEPS

WORKER = Path(__file__).resolve().parents[2] / "celery_dedup" / "worker"


class Recorder:
    """A participant that admits (or has the delivery wait, or fails) and writes down what it was told."""

    def __init__(self, name: str, log: list[str], *, admits: bool = True, fails: bool = False) -> None:
        self.name, self.log, self.admits, self.fails = name, log, admits, fails

    def before_start(self, delivery: Delivery) -> bool:
        self.log.append(f"{self.name}.before")
        assert delivery.token in delivery_module._live, "asked after the token is registered"
        if self.fails:
            raise RuntimeError(self.name)
        if self.admits:
            delivery.held[self] = f"{self.name}'s"
        return self.admits

    def after_end(self, delivery: Delivery, *, ran: bool) -> None:
        self.log.append(f"{self.name}.after(ran={ran}, held={delivery.held.pop(self, None)})")

    def after_report(self, report: Report) -> None:
        self.log.append(f"{self.name}.report({report.run_id})")


@pytest.fixture
def task() -> Iterator[Any]:
    app = Celery("participants", broker="redis://127.0.0.1:1/0", set_as_current=False)

    @app.task(base=DedupTask, name="unit.job", dedup_key="job:{n}", shared=False)
    def job(n: int) -> int:
        return n

    job.push_request(id="run-1", args=[1], kwargs={}, headers=None, is_eager=False)
    yield job
    job.pop_request()


def make(task: Any, *participants: Recorder) -> Delivery:
    store: Any = None  # never reached: these deliveries go no further than their participants
    delivery = Delivery(task, (1,), {}, lambda a, k: None, member="unit.job:job:1", store=store, gated=False)
    delivery.participants = participants
    return delivery


def test_participants_are_asked_in_order_and_told_in_reverse(task: Any) -> None:
    log: list[str] = []
    delivery = make(task, Recorder("a", log), Recorder("b", log))
    delivery.claim()
    try:
        assert delivery.admit()
        assert log == ["a.before", "b.before"]
        assert delivery.held == {delivery.participants[0]: "a's", delivery.participants[1]: "b's"}
        delivery.leave(ran=True)
        delivery.leave(ran=True)  # told once
        assert log[2:] == ["b.after(ran=True, held=b's)", "a.after(ran=True, held=a's)"]
        assert delivery.held == {}
    finally:
        delivery.retire()


def test_a_participant_that_has_it_wait_leaves_it_holding_nothing(task: Any) -> None:
    log: list[str] = []
    delivery = make(task, Recorder("a", log), Recorder("b", log, admits=False), Recorder("c", log))
    delivery.claim()
    try:
        assert not delivery.admit()
        assert log == ["a.before", "b.before", "a.after(ran=False, held=a's)"], "c is not asked, a gives back"
        assert delivery.held == {}
    finally:
        delivery.retire()


def test_a_participant_that_fails_leaves_it_holding_nothing(task: Any) -> None:
    log: list[str] = []
    delivery = make(task, Recorder("a", log), Recorder("b", log, fails=True))
    delivery.claim()
    try:
        with pytest.raises(RuntimeError):
            delivery.admit()
        assert log == ["a.before", "b.before", "a.after(ran=False, held=a's)"]
    finally:
        delivery.retire()


def test_a_start_that_waits_takes_nothing_and_retires_its_token(task: Any) -> None:
    from celery.exceptions import Ignore  # noqa: PLC0415

    log: list[str] = []
    delivery = make(task, Recorder("a", log), Recorder("b", log, admits=False))
    with pytest.raises(Ignore):
        delivery.start()
    assert delivery.token and delivery.token not in delivery_module._live
    assert log == ["a.before", "b.before", "a.after(ran=False, held=a's)"]
    assert delivery.lock is None and not delivery.running


def test_the_registry_keeps_two_deliveries_of_one_run_apart(task: Any) -> None:
    first, second = make(task), make(task)
    for delivery in (first, second):
        delivery.claim()
    try:
        assert first.token != second.token
        assert live("run-1") == [first, second]
    finally:
        first.retire()
        second.retire()
    assert live("run-1") == []


def test_each_thread_finds_the_delivery_whose_body_it_executes(task: Any) -> None:
    """A copy and the original of one run in one process (a threads or gevent pool): each body's calls
    (``dedup_lock_lost``, ``Task.replace``) reach its own delivery, whichever started last."""
    first, second = make(task), make(task)
    first.running = second.running = True
    seen: dict[str, tuple[Delivery | None, Delivery | None]] = {}
    both = threading.Barrier(2)

    def execute(name: str, delivery: Delivery) -> None:
        delivery_module._executing.delivery = delivery  # what Delivery.run sets around the body
        both.wait(timeout=5)
        seen[name] = (running("run-1"), running("run-2"))

    threads = [threading.Thread(target=execute, args=(name, d)) for name, d in (("first", first), ("second", second))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=5)
    assert seen == {"first": (first, None), "second": (second, None)}
    assert running("run-1") is None, "this thread executes no body"


def test_every_dedup_task_has_its_limits_and_its_steps_as_participants(task: Any) -> None:
    assert delivery_module.participants_of(task) == (LIMITS, STEPS)
    assert make(task).participants == ()


# --------------------------------------------------------------------------- renewal


class Item:
    """A renewable that a fake server holds while ``held`` says so."""

    gone: ClassVar[str] = "gone"

    def __init__(self, server: Server, name: str, ttl_ms: int = 3000, kind: str = "lock") -> None:
        self.server, self.name, self.ttl_ms, self.kind = server, name, ttl_ms, kind
        self.valid_until = ttl_ms / 1000
        self.renew_at = ttl_ms / 3000
        self.lost: list[str] = []

    def __repr__(self) -> str:
        return f"<Item {self.name}>"

    def batch(self) -> Hashable:
        return self.kind, self.ttl_ms

    def renew(self, batch: list[Item]) -> list[Item]:
        self.server.calls.append(sorted(item.name for item in batch))
        if self.server.down:
            raise redis.ConnectionError("down")
        return [item for item in batch if item.name not in self.server.held]

    def lose(self, why: str) -> None:
        self.lost.append(why)


class Server:
    def __init__(self, *held: str) -> None:
        self.held = set(held)
        self.calls: list[list[str]] = []
        self.down = False


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_renewer_renews_each_kind_in_one_call_and_loses_what_is_gone() -> None:
    server, clock = Server("a", "b", "s"), Clock()
    keeper = Renewer(clock)
    a, b, gone = Item(server, "a"), Item(server, "b"), Item(server, "x")
    slot = Item(server, "s", kind="slot")
    clock.now = 1.0
    keeper.renew([a, b, gone, slot])
    assert sorted(server.calls) == [["a", "b", "x"], ["s"]], "one call per batch"
    assert gone.lost == ["gone"] and not a.lost and not slot.lost
    assert (a.valid_until, a.renew_at) == (4.0, 2.0), "extended from when the call began"


def test_an_unreachable_server_is_retried_until_the_ttl_runs_out() -> None:
    server, clock = Server("a"), Clock()
    keeper = Renewer(clock)
    item = Item(server, "a")
    server.down = True
    clock.now = 2.0
    keeper.renew([item])
    assert not item.lost, "still valid: retried soon"
    assert 2.0 < item.renew_at < item.valid_until
    clock.now = 3.0
    keeper.renew([item])
    assert item.lost and item.lost[0].startswith("not renewed within the lock TTL")


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module.lstrip("."))
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_the_renewer_and_the_delivery_know_no_limits() -> None:
    assert "limits" not in imports(WORKER / "lock.py"), "the renewer renews through the Renewable protocol"
    assert "limits" not in imports(WORKER / "delivery.py"), "limits take part as a participant"
    assert not {"delivery", "limits"} & imports(WORKER / "lock.py")
