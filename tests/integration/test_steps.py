"""Steps inside a body (``dedup_once``) on real workers, with real kills, pauses and redelivery.

Workers are ``celery -A tests.steps_app worker`` subprocesses (prefork, acks_late). The tasks
charge an order in two steps through a fake provider that writes down every call with the
idempotency key it got (tests/steps_app.py). Every assertion reads what the tasks and the
library left in Redis: the provider's calls, the status record, its history and the steps.
Eager mode and an in-process worker cover the rest of the semantics.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import redis
from celery import Celery

from celery_dedup import DedupError, DedupLockLostError, DedupStepError, DedupStepInDoubt, DedupTask, runtime
from celery_dedup.keys import KeySchema, member_for
from celery_dedup.store.commands import StepBeginCode
from celery_dedup.store.scripts import load_script
from celery_dedup.store.status import StepStatus
from celery_dedup.store.store import DedupStore
from celery_dedup.worker.steps import Steps
from chaos.proxy import FaultProxy

from .. import steps_app
from ..conftest import AppFactory, Server, WorkerProcess, in_process_worker, wait_for
from .test_crash import RESTORE_EVERY_SECOND, WORKERS_SWEEP_EVERY_SECOND, Sweeper, parent_of, wait_idle

SCHEMA = KeySchema("dedup")
#: Execution lock TTL of every worker here (seconds): a dead or paused delivery's locks run out within it.
LOCK_TTL = 2
#: What a run may take beyond the lock TTL: a redelivery (the visibility timeout, a sweep) and a start-up.
SLACK = 12.0


def conf(**more: Any) -> dict[str, Any]:
    # A longer history than the default: every entry of a run killed and run again stays in it.
    return {
        "task_acks_late": True,
        "dedup_lock_ttl": LOCK_TTL,
        "dedup_reap_interval": 1,
        "dedup_history_length": 20,
        **more,
    }


class Fleet:
    """The worker processes of one test (on tests.steps_app); whatever is still alive is killed at teardown."""

    def __init__(self, broker: str, monkeypatch: pytest.MonkeyPatch, log_dir: Path) -> None:
        self.broker, self.monkeypatch, self.log_dir = broker, monkeypatch, log_dir
        self.workers: list[WorkerProcess] = []
        self.sweeper: Sweeper | None = None

    def start(self, *, settings: dict[str, Any], transport: dict[str, Any], concurrency: int = 1) -> WorkerProcess:
        self.monkeypatch.setenv("CELERY_DEDUP_CRASH_CONF", json.dumps(settings))
        worker = WorkerProcess(
            self.broker,
            app="tests.steps_app",
            concurrency=concurrency,
            transport_options=transport,
            extra=("--hostname", f"steps{len(self.workers)}@%h"),
        )
        self.workers.append(worker)
        worker.wait_ready(timeout=60)
        if "unacked_restore_interval" in transport and not WORKERS_SWEEP_EVERY_SECOND and self.sweeper is None:
            self.sweeper = Sweeper(self.broker, transport)
        return worker

    def logs(self) -> str:
        tails = []
        for worker in self.workers:
            path = self.log_dir / f"worker-{worker.process.pid}.log"
            path.write_text("".join(worker.output))
            tails.append(f"--- worker {worker.process.pid} (whole log: {path})\n" + "".join(worker.output[-40:]))
        return "\n".join(tails)

    def stop_all(self) -> None:
        if self.sweeper is not None:
            self.sweeper.stop()
        for worker in self.workers:
            worker.stop(signal.SIGKILL)


@pytest.fixture
def fleet(server: Server, r: redis.Redis, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Fleet]:
    workers = Fleet(server.url, monkeypatch, tmp_path)
    yield workers
    workers.stop_all()


@pytest.fixture
def tasks(make_app: AppFactory) -> steps_app.Tasks:
    """The steps tasks on a publisher app of this process (same names as the workers')."""
    return steps_app.register(make_app("steps_publisher"))


def member(task: str, n: int) -> str:
    return member_for(f"tests.steps_app.{task}", f"order:{n}")


def record(r: redis.Redis, member_: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in r.hgetall(SCHEMA.record(member_)).items()}


def steps(app: Celery, member_: str) -> dict[str, StepStatus]:
    return {step.name: step for step in runtime.store_for(app).steps(member_)}


def step_notes(app: Celery, member_: str) -> list[str]:
    """The notes of the record's step entries, oldest first."""
    status = runtime.store_for(app).status(member_)
    assert status is not None
    return [entry.note for entry in reversed(status.history or ()) if entry.state == "step"]


def of(calls: list[steps_app.Call], what: str) -> list[steps_app.Call]:
    return [call for call in calls if call.what == what]


def started(r: redis.Redis, where: str, n: int) -> int:
    """The pid of the process that got ``where`` for order ``n``."""
    return int(wait_for(lambda: r.get(steps_app.pid_key(where, n)) or b"", 20, f"order {n} got {where}"))


#: A child killed mid-task: its main process requeues the message (task_reject_on_worker_lost).
REQUEUED = conf(task_reject_on_worker_lost=True)
#: The visibility timeout there: longer than the main process takes to requeue, as in test_crash.
CHILD_KILL_TRANSPORT = {"visibility_timeout": 8, **RESTORE_EVERY_SECOND}


@pytest.mark.slow
def test_a_step_done_before_a_sigkill_is_skipped_by_the_redelivered_run_and_its_value_returned(
    fleet: Fleet, tasks: steps_app.Tasks, r: redis.Redis
) -> None:
    """The child is SIGKILLed after the charge step completed; the message is redelivered (acks_late).

    Proves: the redelivered run does not charge again (one provider call), it gets the stored
    receipt and finishes with it; the run succeeded and the charge step was begun once.
    """
    fleet.start(settings=REQUEUED, transport=CHILD_KILL_TRANSPORT, concurrency=2)
    r.set(steps_app.hang_key("after-charge", 1), 1)
    run = tasks.charge.apply_async((1,))
    os.kill(started(r, "after-charge", 1), signal.SIGKILL)
    try:
        wait_for(lambda: record(r, member("charge", 1)).get("state") == "succeeded", LOCK_TTL + SLACK, "re-ran")
        calls = steps_app.calls(r, 1)
        (charged,) = of(calls, "charge")
        assert len(of(calls, "mail")) == 1
        assert int(r.get(steps_app.bodies_key(1)) or 0) == 2, "premise: the body ran again"
        assert run.get(timeout=10) == {"receipt": charged.receipt, "mail": of(calls, "mail")[0].receipt}
        found = steps(tasks.charge.app, member("charge", 1))
        assert (found["charge"].state, found["charge"].attempts) == ("done", 1)
        assert found["charge"].key == charged.key
        assert step_notes(tasks.charge.app, member("charge", 1)) == [
            "charge started",
            "charge done",
            "send-receipt started",
            "send-receipt done",
        ]
    except AssertionError:
        print(fleet.logs())
        raise


@pytest.mark.slow
def test_a_sigkill_inside_a_step_leaves_it_in_doubt_and_the_next_delivery_calls_again_with_the_same_key(
    fleet: Fleet, tasks: steps_app.Tasks, r: redis.Redis
) -> None:
    """The child is SIGKILLed inside the charge step (the provider was called); the message is redelivered.

    Proves: the next delivery finds the step in doubt and calls the provider again with the same
    idempotency key (which lets a real provider answer with the first charge), once; the history says so.
    """
    fleet.start(settings=REQUEUED, transport=CHILD_KILL_TRANSPORT, concurrency=2)
    r.set(steps_app.hang_key("in-charge", 2), 1)
    run = tasks.charge.apply_async((2,))
    os.kill(started(r, "in-charge", 2), signal.SIGKILL)
    try:
        wait_for(lambda: record(r, member("charge", 2)).get("state") == "succeeded", LOCK_TTL + SLACK, "re-ran")
        first, second = of(steps_app.calls(r, 2), "charge")
        assert first.key == second.key
        assert first.key.startswith("tests.steps_app.charge:order:2:~") and first.key.endswith(":charge")
        assert first.pid != second.pid
        assert run.get(timeout=10)["receipt"] == second.receipt
        found = steps(tasks.charge.app, member("charge", 2))
        assert (found["charge"].state, found["charge"].attempts) == ("done", 2)
        assert step_notes(tasks.charge.app, member("charge", 2))[:3] == [
            "charge started",
            "charge in doubt, again",
            "charge done",
        ]
    except AssertionError:
        print(fleet.logs())
        raise


@pytest.mark.slow
def test_a_sigkill_inside_a_step_with_on_doubt_raise_fails_the_run_naming_the_step_and_its_key(
    fleet: Fleet, tasks: steps_app.Tasks, r: redis.Redis
) -> None:
    """As above, with ``on_doubt="raise"``: the provider is not called again; the run fails with
    DedupStepInDoubt, which names the run, the step and its key; the step stays marked ``doubt``."""
    fleet.start(settings=REQUEUED, transport=CHILD_KILL_TRANSPORT, concurrency=2)
    r.set(steps_app.hang_key("in-charge", 3), 1)
    run = tasks.charge_or_raise.apply_async((3,))
    os.kill(started(r, "in-charge", 3), signal.SIGKILL)
    target = member("charge_or_raise", 3)
    try:
        wait_for(lambda: record(r, target).get("state") == "failed", LOCK_TTL + SLACK, "the copy failed")
        (charged,) = of(steps_app.calls(r, 3), "charge")
        error = record(r, target)["error"]
        assert error.startswith("DedupStepInDoubt: ")
        assert run.id in error and "'charge'" in error and charged.key in error
        found = steps(tasks.charge.app, target)
        assert found["charge"].state == "doubt"
        assert "send-receipt" not in found
        assert step_notes(tasks.charge.app, target) == ["charge started", "charge in doubt"]
    except AssertionError:
        print(fleet.logs())
        raise


@pytest.mark.slow
def test_a_paused_executor_and_its_redelivered_copy_record_a_step_once_and_the_paused_one_stands_down(
    fleet: Fleet, tasks: steps_app.Tasks, r: redis.Redis
) -> None:
    """Delivery A is paused (SIGSTOP) inside the charge step past the lock TTL; the message is
    re-pushed and a copy B runs on another worker; B finds the step in doubt, charges again and
    finishes the run; then A resumes and its charge returns.

    Proves: both charges carried the same idempotency key (the fence a provider uses); the step was
    recorded once, by B; A reports its lost lock and stands down without ending the run or charging
    anything more; the run succeeded with B's receipt.
    """
    settings = conf(worker_prefetch_multiplier=1)
    transport = {"visibility_timeout": 2, **RESTORE_EVERY_SECOND}
    target = member("charge", 4)
    r.set(steps_app.hold_key("in-charge", 4), 1)
    run = tasks.charge.apply_async((4,))
    first_worker = fleet.start(settings=settings, transport=transport)
    paused = started(r, "in-charge", 4)
    os.kill(paused, signal.SIGSTOP)
    r.delete(steps_app.hold_key("in-charge", 4))  # A sees it only once it resumes
    try:
        second_worker = fleet.start(settings=settings, transport=transport)
        wait_for(lambda: record(r, target).get("state") == "succeeded", LOCK_TTL + SLACK * 2, "the copy finished")
        first, second = of(steps_app.calls(r, 4), "charge")
        assert first.pid == paused
        assert parent_of(second.pid) == second_worker.process.pid, "premise: the copy ran on the second worker"
        assert first.key == second.key
        os.kill(paused, signal.SIGCONT)
        wait_for(
            lambda: any("lock_lost" in line and "'charge'" in line for line in list(first_worker.output)),
            15,
            "the paused delivery reported its lost lock",
        )
        wait_idle(r, timeout=LOCK_TTL + SLACK)
        calls = steps_app.calls(r, 4)
        assert len(of(calls, "charge")) == 2 and len(of(calls, "mail")) == 1, calls
        notes = step_notes(tasks.charge.app, target)
        assert notes.count("charge done") == 1, notes
        found = steps(tasks.charge.app, target)
        assert (found["charge"].state, found["charge"].attempts) == ("done", 2)
        final = record(r, target)
        assert final["state"] == "succeeded"
        assert run.get(timeout=10)["receipt"] == second.receipt
    except AssertionError:
        print(fleet.logs())
        raise
    finally:
        if parent_of(paused):
            os.kill(paused, signal.SIGCONT)


@pytest.mark.slow
def test_a_copy_of_a_run_finds_its_done_steps_after_a_later_run_of_its_key_took_steps(
    fleet: Fleet, tasks: steps_app.Tasks, make_app: AppFactory, r: redis.Redis
) -> None:
    """``until_executing``: run A charges, then its whole worker is SIGKILLed; its message stays
    unacknowledged until the visibility timeout. A freed its key as it started, so run B of the same
    key is accepted; once A's lock ran out a second worker runs B, which charges and finishes; then
    A's message comes back and a copy of A runs. A was published while the store was unreachable
    (``fail_open``: no gate header), so its copy is not refused as superseded once B owns the record.

    Proves: the copy of A finds A's charge done (a later run's steps do not drop it) and does not
    charge again: one charge per run, each with its own run's key, and A's copy returns A's receipt.
    """
    settings = conf(worker_prefetch_multiplier=1)
    transport = {"visibility_timeout": 10, **RESTORE_EVERY_SECOND}
    task = tasks.charge_until_executing
    down = make_app("steps_store_down", dedup_redis_url="redis://127.0.0.1:9", dedup_on_redis_error="fail_open")
    publisher = steps_app.register(down).charge_until_executing
    r.set(steps_app.hang_key("after-charge", 16), 1)
    run_a = publisher.apply_async((16,))
    first_worker = fleet.start(settings=settings, transport=transport)
    hung = started(r, "after-charge", 16)
    first_worker.stop(signal.SIGKILL)
    try:
        run_b = task.apply_async((16,))
        assert run_b.id != run_a.id, "premise: B is a run of its own"
        time.sleep(LOCK_TTL + 0.5)  # A's execution lock runs out
        fleet.start(settings=settings, transport=transport)
        done_b = run_b.get(timeout=LOCK_TTL + SLACK)
        assert int(r.get(steps_app.bodies_key(16)) or 0) == 2, "premise: B ran before A's copy"
        done_a = task.AsyncResult(run_a.id).get(timeout=10 + SLACK)
        assert int(r.get(steps_app.bodies_key(16)) or 0) == 3, "premise: A's copy ran its body again"
        charges = of(steps_app.calls(r, 16), "charge")
        keys = [charge.key for charge in charges]
        assert len(charges) == 2 and len(set(keys)) == 2, f"A's charge was made again: {keys}"
        assert charges[0].pid == hung and run_a.id.removeprefix("order:16") in charges[0].key
        assert (done_a["receipt"], done_b["receipt"]) == (charges[0].receipt, charges[1].receipt)
        assert len(of(steps_app.calls(r, 16), "mail")) == 2
    except Exception:
        print(record(r, member("charge_until_executing", 16)), steps_app.calls(r, 16))
        print(fleet.logs())
        raise


def test_the_steps_of_a_run_stay_while_later_runs_of_its_key_take_steps(make_app: AppFactory, r: redis.Redis) -> None:
    """At the store: run A does step s; runs B and C of the key (any mode that lets them run while A can still
    be delivered: while_executing, until_executing, debounce) do s under their own locks; then a copy of A,
    holding the lock again, finds its s done with its value, and B's and C's stay theirs."""
    app = make_app("steps_runs")
    store = runtime.store_for(app)
    target = member_for("steps.runs", "order:17")

    def step(run: str, token: str, value: str) -> str:
        r.set(SCHEMA.lock(target), token)
        begun = store.step_begin(target, run, token, "s:s", "s", on_doubt="raise", lock_ms=10_000, record_ms=60_000)
        if begun.code == StepBeginCode.DONE:
            return begun.detail
        assert begun.code == StepBeginCode.RUN, begun
        assert store.step_end(target, run, token, "s:s", "s", result=value, lock_ms=10_000, record_ms=60_000).recorded
        return value

    assert [step("A", "a1", "va"), step("B", "b1", "vb"), step("C:x", "c1", "vc")] == ["va", "vb", "vc"]
    assert [step("A", "a2", "?"), step("B", "b2", "?"), step("C:x", "c2", "?")] == ["va", "vb", "vc"]


def test_steps_of_a_run_kept_by_the_earlier_layout_are_found_by_that_run(make_app: AppFactory, r: redis.Redis) -> None:
    """A key's steps hash written before runs had their own (a ``run`` field naming the run of its ``s:`` fields):
    that run's next step finds its done steps there and moves them into the run's hash; the key's stay."""
    app = make_app("steps_legacy")
    store = runtime.store_for(app)
    target = member_for("steps.legacy", "order:18")
    done = json.dumps({"state": "done", "attempts": 1, "started_at": 1, "finished_at": 2, "result": '"va"'})
    r.hset(SCHEMA.steps(target), mapping={"run": "A", "s:s": done, "k:mail": done})
    r.pexpire(SCHEMA.steps(target), 60_000)
    assert [step.name for step in store.steps(target)] == ["s", "mail"], "read as the run's before any step"
    r.set(SCHEMA.lock(target), "a2")
    begun = store.step_begin(target, "A", "a2", "s:s", "s", on_doubt="raise", lock_ms=10_000, record_ms=60_000)
    assert (begun.code, begun.detail) == (StepBeginCode.DONE, '"va"')
    assert r.hkeys(SCHEMA.steps(target)) == [b"k:mail"]
    assert r.hkeys(SCHEMA.run_steps(target, "A")) == [b"s:s"] and r.pttl(SCHEMA.run_steps(target, "A")) > 50_000
    begun = store.step_begin(target, "B", "a2", "s:s", "s", on_doubt="raise", lock_ms=10_000, record_ms=60_000)
    assert begun.code == StepBeginCode.RUN, "another run's step is its own"


def test_a_retry_after_a_step_skips_it(make_app: AppFactory, r: redis.Redis) -> None:
    """The body retries (Task.retry) after its charge step: the retry's delivery does not charge again."""
    app = make_app("steps_retry")
    tasks = steps_app.register(app)
    with in_process_worker(app):
        run = tasks.charge_then_retry.apply_async((5,))
        result = run.get(timeout=20)
    calls = steps_app.calls(r, 5)
    (charged,) = of(calls, "charge")
    assert result == {"receipt": charged.receipt, "mail": of(calls, "mail")[0].receipt}
    assert int(r.get(steps_app.bodies_key(5)) or 0) == 2
    found = steps(app, member("charge_then_retry", 5))
    assert (found["charge"].attempts, found["send-receipt"].attempts) == (1, 1)


# --- eager mode: the same semantics, and the errors ----------------------------------------------------


def eager_task(app: Celery, body: Any, **options: Any) -> Any:
    name = f"steps.{uuid.uuid4().hex[:8]}"
    return app.task(base=DedupTask, bind=True, shared=False, name=name, dedup_key="order:{n}", **options)(body)


def test_eager_runs_steps_with_the_same_semantics(make_app: AppFactory, r: redis.Redis) -> None:
    """Eagerly: each step is called once with its key, its value is stored and returned as stored."""
    app = make_app(task_always_eager=True, task_eager_propagates=True)
    seen: list[str] = []

    def provider(key: str) -> tuple[str, int]:
        seen.append(key)
        return ("receipt", len(seen))

    def charge(self: DedupTask, n: int) -> Any:
        receipt = self.dedup_once("charge", provider)
        return [receipt, self.dedup_once("mail", provider)]

    task = eager_task(app, charge)
    result = task.delay(7)
    assert result.get() == [["receipt", 1], ["receipt", 2]], "the values as stored (JSON: a tuple comes back a list)"
    prefix = f"{task.name}:order:7:{result.id.removeprefix('order:7')}"
    assert seen == [f"{prefix}:charge", f"{prefix}:mail"]
    found = steps(app, member_for(task.name, "order:7"))
    assert [(s.name, s.state, s.attempts, s.key) for s in found.values()] == [
        ("charge", "done", 1, seen[0]),
        ("mail", "done", 1, seen[1]),
    ]


def test_a_step_of_the_key_runs_once_across_runs(make_app: AppFactory, r: redis.Redis) -> None:
    app = make_app(task_always_eager=True, task_eager_propagates=True)
    seen: list[str] = []

    def mail(key: str) -> int:
        seen.append(key)
        return len(seen)

    def welcome(self: DedupTask, n: int) -> Any:
        return self.dedup_once("welcome-mail", mail, scope="key")

    task = eager_task(app, welcome)
    first, second = task.delay(8), task.delay(8)
    assert first.id != second.id, "premise: two runs of the key"
    assert (first.get(), second.get()) == (1, 1)
    assert seen == [f"{task.name}:order:8:key:welcome-mail"]


def test_a_step_that_raised_is_called_again_by_the_next_run(make_app: AppFactory, r: redis.Redis) -> None:
    """A failed step is recorded failed (not done): a later delivery calls it again."""
    app = make_app(task_always_eager=True, task_eager_propagates=True)
    calls: list[str] = []

    def flaky(self: DedupTask, n: int) -> Any:
        def call(key: str) -> str:
            calls.append(key)
            if len(calls) == 1:
                raise ConnectionError("provider down")
            return "ok"

        return self.dedup_once("flaky", call, scope="key")

    task = eager_task(app, flaky)
    with pytest.raises(ConnectionError):
        task.delay(9)
    found = steps(app, member_for(task.name, "order:9"))
    assert (found["flaky"].state, found["flaky"].error) == ("failed", "ConnectionError: provider down")
    assert task.delay(9).get() == "ok"
    assert len(calls) == 2 and calls[0] == calls[1]


def test_misuse_is_refused_with_a_clear_error(make_app: AppFactory, r: redis.Redis) -> None:
    app = make_app(task_always_eager=True, task_eager_propagates=True, dedup_step_result_limit=100)

    def twice(self: DedupTask, n: int) -> Any:
        self.dedup_once("charge", lambda key: 1)
        return self.dedup_once("charge", lambda key: 2)

    def bad_name(self: DedupTask, n: int) -> Any:
        return self.dedup_once("charge card", lambda key: 1)

    def too_big(self: DedupTask, n: int) -> Any:
        return self.dedup_once("report", lambda key: "x" * 1000)

    def plain(self: DedupTask, n: int) -> Any:
        return self.dedup_once("charge", lambda key: 1)

    with pytest.raises(DedupStepError, match="used the name for a step already"):
        eager_task(app, twice).delay(10)
    with pytest.raises(DedupStepError, match="1 to 64 of"):
        eager_task(app, bad_name).delay(11)
    big = eager_task(app, too_big)
    with pytest.raises(DedupStepError, match="more than dedup_step_result_limit"):
        big.delay(12)
    assert steps(app, member_for(big.name, "order:12"))["report"].state == "failed"
    with pytest.raises(DedupStepError, match="only inside the body"):
        eager_task(app, plain)(13)  # called as a function: no delivery
    assert issubclass(DedupStepInDoubt, DedupError) and issubclass(DedupLockLostError, DedupError)


def test_a_step_whose_begin_lost_its_reply_is_begun_again_by_its_own_delivery_not_in_doubt(
    make_app: AppFactory, server: Server, r: redis.Redis
) -> None:
    """The server began the step but the connection was cut before its reply came back (what a chaos run's
    proxy did); the delivery asks again with its own token. That step lock is its own and its function was
    never called: it begins the step at once (attempt 1, no doubt), rather than waiting out its own lock as
    another delivery's and then finding the step in doubt, which with ``on_doubt="raise"`` failed the run."""
    r.execute_command("SCRIPT", "LOAD", load_script("step_begin"))  # the cut EVALSHA runs the script
    port = urlparse(server.url).port
    assert port is not None
    with FaultProxy(port) as proxy:
        app = make_app(
            broker_url=proxy.url, task_always_eager=True, task_eager_propagates=True, dedup_lock_ttl=LOCK_TTL
        )
        calls: list[str] = []

        def provider(key: str) -> str:
            calls.append(key)
            return "receipt"

        def charge(self: DedupTask, n: int) -> Any:
            proxy.arm("after")  # the next script this delivery runs: the step's begin
            return self.dedup_once("charge", provider, on_doubt="raise")

        task = eager_task(app, charge)
        started = time.monotonic()
        assert task.delay(15).get() == "receipt"
        took = time.monotonic() - started
        assert [(incident.point, incident.command) for incident in proxy.incidents] == [("after", b"EVALSHA")]
        assert len(calls) == 1
        found = steps(app, member_for(task.name, "order:15"))
        assert (found["charge"].state, found["charge"].attempts) == ("done", 1)
        assert step_notes(app, member_for(task.name, "order:15")) == ["charge started", "charge done"]
        assert took < LOCK_TTL, f"waited {took:.1f} s for its own step lock"


def test_a_purge_deletes_the_steps_of_the_runs_it_cuts_down_and_keeps_the_keys(
    make_app: AppFactory, r: redis.Redis
) -> None:
    app = make_app(task_always_eager=True, task_eager_propagates=True)

    def both(self: DedupTask, n: int) -> Any:
        return [self.dedup_once("charge", lambda key: 1), self.dedup_once("mail", lambda key: 2, scope="key")]

    task = eager_task(app, both)
    run = task.delay(19)
    assert run.get() == [1, 2]
    target = member_for(task.name, "order:19")
    assert r.exists(SCHEMA.run_steps(target, run.id), SCHEMA.steps(target)) == 2
    assert runtime.store_for(app).purge().purged == 1
    assert not r.exists(SCHEMA.run_steps(target, run.id))
    assert [step.name for step in steps(app, target).values()] == ["mail"]


def test_a_run_without_steps_writes_no_steps(make_app: AppFactory, r: redis.Redis) -> None:
    app = make_app(task_always_eager=True)

    def plain(self: DedupTask, n: int) -> int:
        return n

    task = eager_task(app, plain)
    assert task.delay(14).get() == 14
    assert not r.keys("dedup:steps:*")


@pytest.mark.parametrize("where", ["as its begin answers", "before its function is called"])
def test_a_delivery_told_to_exit_before_calling_a_step_leaves_it_failed_not_in_doubt(
    make_app: AppFactory, r: redis.Redis, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A warm shutdown raises SystemExit wherever the body is: after the server granted the step's begin, before
    the function was called, the step is recorded failed (the function never ran), so the next delivery calls it
    as a step that failed, not one in doubt (which, with on_doubt="raise", would fail the run for nothing)."""
    app = make_app(task_always_eager=True, task_eager_propagates=True)
    calls: list[str] = []
    exiting = [True]

    def call(key: str) -> str:
        calls.append(key)
        return "ok"

    def charge(self: DedupTask, n: int) -> Any:
        return self.dedup_once("charge", call, scope="key", on_doubt="raise")

    if where == "as its begin answers":
        begin = DedupStore.step_begin

        def step_begin(self: DedupStore, *args: Any, **kwargs: Any) -> Any:
            answer = begin(self, *args, **kwargs)
            if exiting.pop() if exiting else False:
                raise SystemExit(0)  # the signal handler's exit, as the reply was read
            return answer

        monkeypatch.setattr(DedupStore, "step_begin", step_begin)
    else:
        begin_step = Steps._begin

        def begun(self: Steps, *args: Any, **kwargs: Any) -> Any:
            answer = begin_step(self, *args, **kwargs)
            if exiting.pop() if exiting else False:
                raise SystemExit(0)  # the same exit, as the body goes on to call the function
            return answer

        monkeypatch.setattr(Steps, "_begin", begun)
    task = eager_task(app, charge)
    with pytest.raises(SystemExit):
        task.delay(12)
    found = steps(app, member_for(task.name, "order:12"))
    assert (found["charge"].state, found["charge"].error) == ("failed", "interrupted before its function was called")
    assert calls == []  # failed, a later delivery calls it (test_a_step_that_raised_is_called_again_by_the_next_run)
