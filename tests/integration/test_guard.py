"""The execution guard on real workers: renewed locks, delivery decisions, endings, records, reaper.

Tasks live in tests/guard_app.py, which logs every body start/end and every
delivery (task_prerun/task_postrun) to Redis, so the same assertions read the
same evidence whether the worker runs in this process or in a subprocess.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar
from urllib.parse import urlparse

import pytest
import redis
from celery import Celery, Task, signals
from celery.result import AsyncResult
from kombu.utils.json import loads

import celery_dedup
from celery_dedup import DedupTask, ReapReport
from celery_dedup import runtime as dedup_runtime
from celery_dedup.keys import KeySchema, member_for, task_namespace
from celery_dedup.store.schema import STATES
from celery_dedup.store.scripts import load_script
from celery_dedup.worker import delivery, limits, processes
from celery_dedup.worker.lock import RENEW_FRACTION
from chaos.proxy import FaultProxy

from ..conftest import (
    AppFactory,
    Server,
    WorkerProcess,
    history,
    in_process_worker,
    new_app,
    queued_messages,
    wait_for,
)
from ..guard_app import MODES, deliveries_key, events_key, lost_key, register

SCHEMA = KeySchema("dedup")
LOCK_TTL = 1.0
TRANSIENT = {"queued", "started", "retry"}
T = TypeVar("T")


# --------------------------------------------------------------------------- helpers


def text(raw: Mapping[Any, Any]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in raw.items()}


def record_of(r: redis.Redis, member: str) -> dict[str, str] | None:
    return text(r.hgetall(SCHEMA.record(member))) or None


def history_of(r: redis.Redis, member: str) -> list[list[str]]:
    """The member's history entries, newest first, split into ``[ms, state, task id, note...]``."""
    return [entry.split(" ") for entry in history(r, member)]


def events(r: redis.Redis, task_name: str, key: str) -> list[dict[str, Any]]:
    return [json.loads(e) for e in r.lrange(events_key(task_name, key), 0, -1)]


def deliveries(r: redis.Redis, task_id: str) -> list[dict[str, Any]]:
    return [json.loads(e) for e in r.lrange(deliveries_key(task_id), 0, -1)]


def starts(evs: list[dict[str, Any]], task_id: str | None = None) -> list[dict[str, Any]]:
    return [e for e in evs if e["ev"] == "start" and (task_id is None or e["id"] == task_id)]


def assert_serial(evs: list[dict[str, Any]]) -> None:
    """No body started while another body of the same key was running (by order and by clock)."""
    running: dict[str, dict[str, Any]] = {}
    intervals: list[tuple[float, float, str]] = []
    for event in evs:
        if event["ev"] == "start":
            assert not running, f"{event['id']} started while {list(running)} ran: {evs}"
            running[event["id"]] = event
        else:
            begun = running.pop(event["id"])
            intervals.append((begun["t"], event["t"], event["id"]))
    intervals.sort()
    for (_, end, first), (start, _, second) in itertools.pairwise(intervals):
        assert end <= start, f"{first} ran until {end}, {second} started at {start}"


def raw_messages(r: redis.Redis, queue: str = "celery") -> dict[str, Any]:
    """The queue's raw messages by task id (bytes, as kombu stored them)."""
    return {loads(raw)["headers"]["id"]: raw for raw in r.lrange(queue, 0, -1)}


def settled(entries: list[dict[str, Any]]) -> bool:
    """Every delivery that began (task_prerun) has also ended (task_postrun)."""
    phases = [entry["phase"] for entry in entries]
    return bool(phases) and phases.count("prerun") == phases.count("postrun")


def pending_ids(r: redis.Redis) -> set[str]:
    """Ids of messages still queued or delivered but not acknowledged (kombu's unacked store)."""
    unacked = [loads(raw)[0] for raw in r.hvals("unacked")]
    return {m["headers"]["id"] for m in queued_messages(r) + unacked}


def server_ms(r: redis.Redis) -> int:
    seconds, micros = r.time()
    return int(seconds) * 1000 + int(micros) // 1000


def state_of(r: redis.Redis, member: str) -> str:
    return (record_of(r, member) or {}).get("state", "")


def is_held(r: redis.Redis, member: str) -> bool:
    return bool(r.sismember(SCHEMA.held, member))


def lock_exists(r: redis.Redis, member: str) -> bool:
    return bool(r.exists(SCHEMA.lock(member)))


@contextlib.contextmanager
def guard_worker(server: Server, concurrency: int = 4, pool: str = "prefork") -> Iterator[WorkerProcess]:
    """A ``celery -A tests.guard_app worker`` subprocess for the block."""
    worker = WorkerProcess(server.url, app="tests.guard_app", pool=pool, concurrency=concurrency)
    try:
        yield worker.wait_ready()
    finally:
        worker.stop(signal.SIGTERM)


def ghost_tasks(app: Celery) -> dict[str, Any]:
    """Per mode, a DedupTask only this (producer) app knows: workers of other apps see an unknown task."""
    ghosts = {}
    for mode in MODES:

        @app.task(base=DedupTask, name=f"guard.ghost.{mode}", dedup_key="job:{key}", dedup_mode=mode, shared=False)
        def ghost(key: str, action: str = "ok", seconds: float = 0.0) -> str:
            return key

        ghosts[mode] = ghost
    return ghosts


# --------------------------------------------------------------------------- 1. long runs keep their lock


LONG_RUN = 5.0


def copy_skipped_after_run(r: redis.Redis, task_name: str, run_id: str) -> bool:
    """The run's body ended, a delivery of its id arrived after that and was skipped, nothing is pending."""
    ends = [e["t"] for e in events(r, task_name, "a") if e["ev"] == "end" and e["id"] == run_id]
    seen = deliveries(r, run_id)
    if not ends or not seen or (seen[-1]["phase"], seen[-1]["state"]) != ("postrun", "IGNORED"):
        return False
    last_prerun = [d for d in seen if d["phase"] == "prerun"][-1]
    return last_prerun["t"] > ends[0] and not pending_ids(r)


@pytest.mark.slow
def test_long_run_keeps_its_lock_and_no_copy_runs_beside_it(
    server: Server, r: redis.Redis, make_app: AppFactory
) -> None:
    """A 5 s body under a 1 s lock (until_executed and while_executing, side by side in a prefork worker).

    Proves: sampled from outside, the lock key exists with the run's token for
    the whole body; a copy of the same message (same id) pushed while it runs
    is deferred and, after the run, skipped as done (delivered, never run); a
    different-id run of the while_executing key is refused; bodies never overlap.
    """
    app = make_app(dedup_lock_ttl=LOCK_TTL)
    tasks = register(app)
    modes = ("until_executed", "while_executing")
    long = {mode: tasks[f"guard.long.{mode}"] for mode in modes}
    runs = {mode: long[mode].delay("a", LONG_RUN) for mode in modes}
    raw = raw_messages(r)
    assert set(raw) == {run.id for run in runs.values()}
    members = {mode: member_for(long[mode].name, "long:a") for mode in modes}

    with guard_worker(server, concurrency=4):
        owners = {}
        for mode, member in members.items():
            wait_for(lambda m=member: state_of(r, m) == "started", 15, f"{mode} run to start")  # type: ignore[misc]
            record = record_of(r, member)
            assert record is not None and record["task_id"] == runs[mode].id
            owners[mode] = record["lock"]
        for mode in modes:
            r.lpush("celery", raw[runs[mode].id])  # the very message again: same id, same headers
        duplicate = long["until_executed"].delay("a", LONG_RUN)
        other = long["while_executing"].delay("a", LONG_RUN)  # no enqueue gate: a new run id

        samples: dict[str, list[tuple[float, bytes | None, int]]] = {mode: [] for mode in modes}
        ended: set[str] = set()
        deadline = time.monotonic() + 3 * LONG_RUN
        while len(ended) < len(modes) and time.monotonic() < deadline:
            with r.pipeline(transaction=True) as pipe:  # one snapshot: lock, its TTL, and whether the body ended
                for mode in modes:
                    pipe.get(SCHEMA.lock(members[mode]))
                    pipe.pttl(SCHEMA.lock(members[mode]))
                    pipe.lrange(events_key(long[mode].name, "a"), 0, -1)
                replies = pipe.execute()
            now = time.monotonic()
            for i, mode in enumerate(modes):
                token, pttl, evs = replies[3 * i : 3 * i + 3]
                if any(json.loads(e)["ev"] == "end" for e in evs):
                    ended.add(mode)
                elif mode not in ended:
                    samples[mode].append((now, token, int(pttl)))
            time.sleep(0.05)

        for run in runs.values():
            assert run.get(timeout=15) == "a"
        for mode in modes:
            wait_for(
                lambda m=mode: copy_skipped_after_run(r, long[m].name, runs[m].id),  # type: ignore[misc]
                15,
                f"{mode}: the deferred copy to be delivered after the run, and the queue to drain",
            )

    assert duplicate.deduplicated and duplicate.id == runs["until_executed"].id, "the key stays held while it runs"
    for mode in modes:
        run_id = runs[mode].id
        taken = samples[mode]
        assert len(taken) >= 40, f"{mode}: too few samples ({len(taken)}) to cover the run"
        assert taken[-1][0] - taken[0][0] >= 3 * LOCK_TTL, f"{mode}: samples must span several lock TTLs"
        assert {token for _, token, _ in taken} == {owners[mode].encode()}, f"{mode}: lock missing or changed hands"
        assert all(pttl > 0 for _, _, pttl in taken), f"{mode}: lock without a TTL or expired"

        evs = events(r, long[mode].name, "a")
        assert [e["id"] for e in starts(evs)] == [run_id], f"{mode}: exactly one execution, by the run itself"
        assert_serial(evs)
        end_t = next(e["t"] for e in evs if e["ev"] == "end")

        seen = deliveries(r, run_id)
        outcomes = [d["state"] for d in seen if d["phase"] == "postrun"]
        assert outcomes.count("SUCCESS") == 1
        ignored = outcomes.count("IGNORED")
        assert ignored >= 2, f"{mode}: the copy is refused while the run holds the lock, then skipped: {seen}"
        deferred = [d for d in seen if d["phase"] == "prerun" and d["eta"]]
        assert deferred, f"{mode}: the copy must come back (deferred), not be dropped"
        runner_pid = starts(evs)[0]["pid"]
        refused_meanwhile = [d for d in seen[1:] if d["phase"] == "prerun" and d["t"] < end_t]
        assert refused_meanwhile, f"{mode}: the copy must have been delivered while the run was going"
        assert all(d["pid"] != runner_pid for d in refused_meanwhile), "refused by other worker processes"
        last_prerun = [d for d in seen if d["phase"] == "prerun"][-1]
        assert last_prerun["eta"] and last_prerun["t"] > end_t, f"{mode}: the last copy arrives after the run"
        assert (seen[-1]["phase"], seen[-1]["state"]) == ("postrun", "IGNORED"), f"{mode}: ... and is skipped"

        record = record_of(r, members[mode])
        assert record is not None
        assert (record["state"], record["task_id"], record["attempts"]) == ("succeeded", run_id, "1")
        refused_other = 0
        if mode == "while_executing":
            other_seen = deliveries(r, other.id)
            assert [d["state"] for d in other_seen if d["phase"] == "postrun"] == ["IGNORED"]
            refused_other = 1
        assert int(record["skipped"]) == ignored + refused_other
        assert not lock_exists(r, members[mode])
        assert not is_held(r, members[mode])
    assert r.llen("celery") == 0


# --------------------------------------------------------------------------- 2. a stolen lock


def test_stolen_lock_is_noticed_recorded_and_left_to_the_thief(make_app: AppFactory, r: redis.Redis) -> None:
    """The test overwrites a running task's lock with its own token.

    Proves: the renewer notices within a renewal interval (the record's
    ``lock_lost_at``, set while the body still runs); the body sees
    ``self.dedup_lock_lost`` turns True; the run's
    ending does not release the thief's lock and is noted in the history.
    """
    app = make_app(dedup_lock_ttl=LOCK_TTL)
    long = register(app)["guard.long.until_executed"]
    member = member_for(long.name, "long:s")
    lock = SCHEMA.lock(member)
    with in_process_worker(app, pool="threads", concurrency=2):
        run = long.delay("s", 2.5)
        wait_for(lambda: (record_of(r, member) or {}).get("state") == "started", 10, "the run to start")
        time.sleep(0.5)  # a renewal or two first: the theft happens mid-run, not at start
        owner = r.get(lock)
        assert owner is not None and owner.decode() == (record_of(r, member) or {}).get("lock")
        with r.pipeline(transaction=True) as pipe:
            pipe.time()
            pipe.set(lock, "thief", px=30_000)
            (seconds, micros), _ = pipe.execute()
        stolen_at = int(seconds) * 1000 + int(micros) // 1000
        assert run.get(timeout=10) == "s"

    seen_raw = r.get(lost_key(long.name, "s"))
    assert seen_raw is not None, "the body never saw dedup_lock_lost become True"
    seen = json.loads(seen_raw)
    assert seen["headers_clean"] is True, "the guard must keep its state off the request (it leaks into retries)"
    assert seen["lock_lost_at"], "the renewer records lock_lost_at while the body runs"
    record = record_of(r, member)
    assert record is not None
    assert record["lock_lost_at"] == seen["lock_lost_at"], "recorded once, by the renewer"
    detected_after = int(record["lock_lost_at"]) - stolen_at
    interval_ms = LOCK_TTL * RENEW_FRACTION * 1000
    # One renewal interval, plus scheduling slack for a loaded machine (still well inside the TTL).
    assert 0 <= detected_after <= interval_ms + 300, f"loss noticed {detected_after} ms after the theft"
    assert r.get(lock) == b"thief", "the loser must not release (or overwrite) the thief's lock"
    assert r.pttl(lock) > 0
    assert record["state"] == "succeeded" and "lock" not in record
    newest = history_of(r, member)[0]
    assert newest[1:] == ["succeeded", run.id, "lock", "lost"]


# --------------------------------------------------------------------------- 3. modes x endings

PREFORK_ENDINGS = (
    "success",
    "failure",
    "retry",
    "revoke_before",
    "revoke_running",
    "reject",
    "unknown",
    "soft_limit",
    "hard_limit",
    "worker_lost",
)
INPROCESS_ENDINGS = ("success", "failure", "retry", "revoke_before", "reject", "unknown")
FINAL_STATE = {
    "success": "succeeded",
    "failure": "failed",
    "retry": "succeeded",
    "revoke_before": "revoked",
    "revoke_running": "revoked",
    "reject": "rejected",
    "unknown": "rejected",
    "soft_limit": "failed",
    "hard_limit": "failed",
    "worker_lost": "lost",
}
BODY_STARTS = {
    "success": 1,
    "failure": 2,
    "retry": 2,
    "revoke_before": 0,
    "revoke_running": 1,
    "reject": 1,
    "unknown": 0,
    "soft_limit": 1,
    "hard_limit": 1,
    "worker_lost": 1,
}
ETA_SECONDS = 1.5


@dataclass
class Cell:
    """One (mode, ending) run and what was observed after it, then after a new call of its key."""

    mode: str
    ending: str
    task: Any
    key: str
    #: Live only while the matrix runs: an AsyncResult outliving its app and server retries forever in __del__.
    result: AsyncResult[Any] | None = None
    task_id: str = ""
    member: str = ""
    record: dict[str, str] | None = None
    history: list[list[str]] = field(default_factory=list)
    held: bool = False
    held_until_ms: int = 0
    observed_ms: int = 0
    lock: bool = False
    starts: int = 0
    new_deduplicated: bool | None = None
    new_id: str = ""
    new_state: str = ""
    new_value: Any = None
    new_record_state: str = ""
    new_starts: int = 0


def launch(cell: Cell, work: Any) -> None:
    key = cell.key
    if cell.ending == "unknown":
        cell.result = cell.task.delay(key)
    elif cell.ending == "revoke_before":
        cell.result = work.apply_async((key, "ok"), countdown=ETA_SECONDS)
    elif cell.ending == "revoke_running":
        cell.result = work.delay(key, "sleep", 30.0)
    elif cell.ending == "soft_limit":
        cell.result = work.apply_async((key, "sleep", 30.0), soft_time_limit=0.5)
    elif cell.ending == "hard_limit":
        cell.result = work.apply_async((key, "sleep", 30.0), time_limit=1)
    else:
        action = {"success": "ok", "failure": "fail", "retry": "retry:1", "reject": "reject", "worker_lost": "die"}
        cell.result = work.delay(key, action[cell.ending])
    cell.task_id = cell.result.id
    cell.member = member_for(cell.task.name, cell.task.dedup_business_key(key))


def celery_done(cell: Cell, pending: set[str]) -> bool:
    """Celery is through with the run: its message is gone and (unless unknown) its result is stored."""
    assert cell.result is not None
    return cell.task_id not in pending and (cell.ending == "unknown" or cell.result.ready())


def keeps_key(cell: Cell) -> bool:
    """Whether the key stays held after the run: until_expired's window after a success."""
    return cell.mode == "until_expired" and FINAL_STATE[cell.ending] == "succeeded"


def dedup_done(r: redis.Redis, cell: Cell) -> bool:
    """The dedup state is final: no transient record state, no lock nor a record naming one, the key as kept.

    A stopped child's lock and key outlive its recorded ending until the
    worker sees the child gone.
    """
    record = record_of(r, cell.member) or {}
    return (
        record.get("state", "") not in TRANSIENT
        and "lock" not in record
        and not lock_exists(r, cell.member)
        and is_held(r, cell.member) == keeps_key(cell)
    )


#: How long the dedup state may lag behind Celery's (signal receivers run after the result is stored,
#: a stopped child's lock is freed once it has exited); a cell still not done then fails its checks.
SETTLE_GRACE = 10.0


def run_matrix(server: Server, pool: str, endings: tuple[str, ...]) -> dict[tuple[str, str], Cell]:
    """Every mode x ending at once on one worker (distinct keys), then a new call of every key."""
    r = server.client()
    r.flushall()
    if pool == "prefork":
        producer = new_app(server, "matrix-producer", dedup_lock_ttl=LOCK_TTL)
        worker_app = producer
        worker_cm: contextlib.AbstractContextManager[Any] = guard_worker(server, concurrency=6)
    else:
        worker_app = new_app(server, f"matrix-{pool}", dedup_lock_ttl=LOCK_TTL)
        producer = new_app(server, "matrix-ghosts")
        worker_cm = in_process_worker(worker_app, pool=pool, concurrency=4 if pool == "threads" else 1)
    tasks = register(worker_app)
    ghosts = ghost_tasks(producer)
    cells = {
        (mode, ending): Cell(mode, ending, ghosts[mode] if ending == "unknown" else tasks[f"guard.work.{mode}"], ending)
        for mode in MODES
        for ending in endings
    }
    try:
        with worker_cm:
            # A broadcast sent before the worker listens for them is lost, and the revokes below are broadcasts.
            wait_for(lambda: worker_app.control.ping(timeout=0.5, limit=1), 20, "the worker to answer a ping")
            end_runs(r, worker_app, tasks, list(cells.values()))
            for cell in cells.values():
                observe(r, cell)
            call_again(r, worker_app, list(cells.values()))
    finally:
        for cell in cells.values():
            cell.result = None
        for app in {producer, worker_app}:
            app.close()
        r.close()
    return cells


def end_runs(r: redis.Redis, app: Celery, tasks: dict[str, Any], cells: list[Cell]) -> None:
    """Start every cell's run, revoke where the ending says so, and wait until every run is over."""
    for cell in cells:
        launch(cell, tasks[f"guard.work.{cell.mode}"])
    app.control.revoke([c.task_id for c in cells if c.ending == "revoke_before"])
    running = [c for c in cells if c.ending == "revoke_running"]
    for cell in running:
        wait_for(lambda c=cell: starts(events(r, c.task.name, c.key)), 20, f"{cell.mode} to start")  # type: ignore[misc]
    app.control.revoke([c.task_id for c in running], terminate=True)

    deadline = time.monotonic() + 30
    waiting = list(cells)
    celery_done_at: dict[int, float] = {}
    while waiting and time.monotonic() < deadline:
        pending, now = pending_ids(r), time.monotonic()
        for cell in waiting:
            if id(cell) not in celery_done_at and celery_done(cell, pending):
                celery_done_at[id(cell)] = now
        waiting = [
            c
            for c in waiting
            if id(c) not in celery_done_at or not (dedup_done(r, c) or now - celery_done_at[id(c)] > SETTLE_GRACE)
        ]
        time.sleep(0.1)


def call_again(r: redis.Redis, app: Celery, cells: list[Cell]) -> None:
    """Call every cell's key again and wait for the accepted runs (unknown tasks never run)."""
    for cell in cells:
        again = cell.task.delay(cell.key, "ok")
        cell.new_deduplicated, cell.new_id = again.deduplicated, again.id
    for cell in cells:
        if cell.new_deduplicated or cell.ending == "unknown":
            continue
        result: AsyncResult[Any] = AsyncResult(cell.new_id, app=app)
        with contextlib.suppress(Exception):
            result.get(timeout=20, propagate=False)
        cell.new_state, cell.new_value = result.state, result.result
        cell.new_record_state = state_of(r, cell.member)
        cell.new_starts = len(starts(events(r, cell.task.name, cell.key), cell.new_id))


def observe(r: redis.Redis, cell: Cell) -> None:
    cell.record = record_of(r, cell.member)
    cell.history = history_of(r, cell.member)
    cell.held = is_held(r, cell.member)
    cell.held_until_ms = int((cell.record or {}).get("held_until", 0))
    cell.observed_ms = server_ms(r)
    cell.lock = lock_exists(r, cell.member)
    cell.starts = len(starts(events(r, cell.task.name, cell.key), cell.task_id))


def check_cell(cell: Cell) -> None:
    """The mode's rules for the cell's ending, against what was observed."""
    mode, ending = cell.mode, cell.ending
    assert cell.starts == BODY_STARTS[ending], f"body started {cell.starts} times"
    assert not cell.lock, "an execution lock was left behind"
    kept = keeps_key(cell)
    assert cell.held == kept, f"key held afterwards: {cell.held}"
    if kept:
        assert cell.held_until_ms > cell.observed_ms, "until_expired keeps its enqueue deadline after success"

    never_recorded = mode == "while_executing" and BODY_STARTS[ending] == 0  # no gate, never started
    if never_recorded:
        assert cell.record is None, f"a record for a run that never started: {cell.record}"
    else:
        assert cell.record is not None, "no status record"
        assert cell.record["task_id"] == cell.task_id
        assert cell.record["state"] == FINAL_STATE[ending], f"history: {cell.history}"
        assert "lock" not in cell.record
        assert cell.history and cell.history[0][1:3] == [FINAL_STATE[ending], cell.task_id]
        endings_recorded = [entry[1] for entry in cell.history if entry[1] not in TRANSIENT]
        assert endings_recorded == [FINAL_STATE[ending]], f"the run must end once: {cell.history}"
        states = [entry[1] for entry in reversed(cell.history)]
        if mode != "while_executing":
            assert states[0] == "queued", states
        if ending in ("failure", "retry"):
            assert "retry" in states, states
        if ending == "failure":
            assert cell.record.get("error", "").startswith("RuntimeError: boom"), cell.record
        if ending == "soft_limit":
            assert cell.record.get("error", "").startswith("SoftTimeLimitExceeded"), cell.record
        if not kept:
            assert cell.record["held_until"] == "0", "a released key keeps no deadline"

    if kept:
        assert cell.new_deduplicated is True and cell.new_id == cell.task_id, "inside the window: a duplicate"
        return
    assert cell.new_deduplicated is False and cell.new_id != cell.task_id, "a new call after the ending is accepted"
    if ending == "unknown":
        return
    assert (cell.new_state, cell.new_value) == ("SUCCESS", cell.key), "the new run must run and succeed"
    assert cell.new_starts == 1
    assert cell.new_record_state == "succeeded"


@pytest.fixture(scope="module")
def prefork_matrix(server: Server) -> dict[tuple[str, str], Cell]:
    return run_matrix(server, "prefork", PREFORK_ENDINGS)


@pytest.fixture(scope="module", params=["solo", "threads"])
def inprocess_matrix(request: pytest.FixtureRequest, server: Server) -> dict[tuple[str, str], Cell]:
    return run_matrix(server, request.param, INPROCESS_ENDINGS)


@pytest.mark.slow
@pytest.mark.parametrize("ending", PREFORK_ENDINGS)
@pytest.mark.parametrize("mode", MODES)
def test_ending_on_prefork(prefork_matrix: dict[tuple[str, str], Cell], mode: str, ending: str) -> None:
    """Each mode x ending on a prefork worker: final record, key per mode, no lock left, next call accepted.

    Revokes (before the run: an ETA message revoked while the worker holds it;
    during: terminate=True), an unknown task name, soft and hard time limits
    and a child that SIGKILLs itself run side by side with the plain endings.
    """
    check_cell(prefork_matrix[(mode, ending)])


@pytest.mark.parametrize("ending", INPROCESS_ENDINGS)
@pytest.mark.parametrize("mode", MODES)
def test_ending_in_process(inprocess_matrix: dict[tuple[str, str], Cell], mode: str, ending: str) -> None:
    """The endings that need no process boundary, on the solo and threads pools."""
    check_cell(inprocess_matrix[(mode, ending)])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["until_executed", "while_executing"])
def test_child_lost_after_its_lock_expired_leaves_no_lock_in_the_record(
    server: Server, r: redis.Redis, make_app: AppFactory, mode: str
) -> None:
    """A pool child dies, and its worker's main process reports it only after the child's lock expired.

    The main process is stopped (SIGSTOP: busy, swapped out) while the child
    is SIGKILLed and its lock runs out. Proves: the late report records the
    run lost and frees its key, and the record names no lock any more; the
    next call of the key runs.
    """
    app = make_app(dedup_lock_ttl=LOCK_TTL)
    work = register(app)[f"guard.work.{mode}"]
    member = member_for(work.name, "job:late")
    with guard_worker(server, concurrency=1) as worker:
        run = work.delay("late", "sleep", 30.0)
        child = wait_for(lambda: starts(events(r, work.name, "late")), 15, "the run to start")[0]["pid"]
        os.kill(worker.process.pid, signal.SIGSTOP)
        try:
            os.kill(child, signal.SIGKILL)
            wait_for(lambda: not lock_exists(r, member), 10, "the dead child's lock to expire")
            assert state_of(r, member) == "started", "premise: the stopped main process has not reported the child"
        finally:
            os.kill(worker.process.pid, signal.SIGCONT)
        wait_for(lambda: state_of(r, member) == "lost", 15, lambda: f"the run recorded lost: {record_of(r, member)}")
        record = record_of(r, member)
        assert record is not None and record["task_id"] == run.id
        assert "lock" not in record, f"the record still names the dead child's expired lock: {record}"
        assert record["held_until"] == "0" and not is_held(r, member)
        again = work.delay("late", "ok")
        assert not again.deduplicated
        assert again.get(timeout=15) == "late"


@pytest.mark.slow
def test_stopped_child_seen_gone_only_after_its_lock_expired_frees_record_and_key(
    server: Server, r: redis.Redis, make_app: AppFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A terminated run's child exits, and its worker acts on the exit only after the child's lock expired.

    ``revoke(terminate=True)`` records the run revoked and leaves its lock and
    key to the child until it exits; here the child is stopped (the revoke's
    signal is SIGSTOP), then SIGKILLed while the worker's main process is
    stopped, and resumed only once the lock has expired. Proves: the worker
    still frees the key, and the record names no lock any more; the next call
    of the key runs.
    """
    monkeypatch.setenv("GUARD_LOCK_TTL", "5")  # the worker waits for the child's exit as long as the lock lives
    app = make_app(dedup_lock_ttl=5)
    work = register(app)["guard.work.until_executed"]
    member = member_for(work.name, "job:gone")
    with guard_worker(server, concurrency=1) as worker:
        run = work.delay("gone", "sleep", 60.0)
        child = wait_for(lambda: starts(events(r, work.name, "gone")), 15, "the run to start")[0]["pid"]
        app.control.revoke(run.id, terminate=True, signal="SIGSTOP")
        wait_for(lambda: state_of(r, member) == "revoked", 10, lambda: f"the revoke recorded: {record_of(r, member)}")
        os.kill(worker.process.pid, signal.SIGSTOP)
        try:
            assert lock_exists(r, member) and is_held(r, member), "premise: lock and key wait for the child"
            os.kill(child, signal.SIGKILL)
            wait_for(lambda: not lock_exists(r, member), 10, "the dead child's lock to expire")
        finally:
            os.kill(worker.process.pid, signal.SIGCONT)
        wait_for(
            lambda: not is_held(r, member) and "lock" not in (record_of(r, member) or {}),
            10,
            lambda: f"the key freed and the lock gone from the record: {record_of(r, member)}",
        )
        record = record_of(r, member)
        assert record is not None and (record["task_id"], record["state"]) == (run.id, "revoked")
        assert record["held_until"] == "0"
        again = work.delay("gone", "ok")
        assert not again.deduplicated
        assert again.get(timeout=15) == "gone"


# --------------------------------------------------------------------------- 4. delivery guard


class _Around(Task):
    """A base with a ``__call__`` of its own, after DedupTask's in a task's MRO: it must wrap the body."""

    abstract = True
    around: ClassVar[list[Any]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        type(self).around.append(self.request.id)
        return super().__call__(*args, **kwargs)


class _AroundDedupTask(DedupTask, _Around):
    abstract = True


def test_the_body_runs_under_the_delivery_s_request_and_any_call_after_dedup_task_s(
    make_app: AppFactory, r: redis.Redis
) -> None:
    """A delivered run's body sees its own request (id, gate header, delivery); a ``__call__`` between
    DedupTask's and Celery's (a base the task mixes in) still runs around it, with that request."""
    app = make_app()
    seen: list[tuple[str, Any, bool, bool]] = []

    def body(self: Any, order_id: int) -> int:
        request = self.request
        seen.append((self.name, request.id, "dedup" in (request.headers or {}), bool(request.delivery_info)))
        return order_id

    plain_based = app.task(base=DedupTask, bind=True, shared=False, name="guard.body.plain", dedup_key="o:{order_id}")(
        body
    )
    around_based = app.task(
        base=_AroundDedupTask, bind=True, shared=False, name="guard.body.around", dedup_key="o:{order_id}"
    )(body)
    _Around.around.clear()
    with in_process_worker(app):
        first, second = plain_based.delay(1), around_based.delay(2)
        assert (first.get(timeout=10), second.get(timeout=10)) == (1, 2)
    assert seen == [(plain_based.name, first.id, True, True), (around_based.name, second.id, True, True)]
    assert _Around.around == [second.id], "the mixed-in __call__ ran around the body of its own task only"


def test_copies_of_finished_and_superseded_runs_are_skipped(make_app: AppFactory, r: redis.Redis) -> None:
    """Re-pushed copies of a run's message, after it succeeded and after a newer run took the key.

    Proves: each copy is acknowledged and skipped (counted in the record's
    ``skipped``), never run; the finished run's record and result stay; the
    queue drains.
    """
    app = make_app(dedup_lock_ttl=LOCK_TTL)
    work = register(app)["guard.work.until_executed"]
    member = member_for(work.name, "job:k")
    first = work.delay("k", "ok")
    copy = raw_messages(r)[first.id]
    with in_process_worker(app, pool="threads", concurrency=2):
        assert first.get(timeout=10) == "k"
        r.rpush("celery", copy)
        wait_for(lambda: len(deliveries(r, first.id)) == 4 and not pending_ids(r), 10, "the copy to be handled")
        done = record_of(r, member)
        assert done is not None
        assert (done["state"], done["task_id"], done["skipped"]) == ("succeeded", first.id, "1")
        assert len(starts(events(r, work.name, "k"))) == 1
        assert AsyncResult(first.id, app=app).get(timeout=1) == "k", "the skip stores nothing over the result"

        newer = work.delay("k", "sleep", 1.0)
        assert not newer.deduplicated and newer.id != first.id
        wait_for(lambda: (record_of(r, member) or {}).get("state") == "started", 10, "the newer run to start")
        r.rpush("celery", copy)  # the old run's copy arrives while the key belongs to the newer run
        assert newer.get(timeout=10) == "k"
        wait_for(lambda: len(deliveries(r, first.id)) == 6 and not pending_ids(r), 10, "the second copy")

    outcomes = [d["state"] for d in deliveries(r, first.id) if d["phase"] == "postrun"]
    assert outcomes == ["SUCCESS", "IGNORED", "IGNORED"]
    record = record_of(r, member)
    assert record is not None
    assert (record["state"], record["task_id"], record["skipped"]) == ("succeeded", newer.id, "1")
    assert [e["id"] for e in starts(events(r, work.name, "k"))] == [first.id, newer.id]
    assert not is_held(r, member) and not lock_exists(r, member)
    assert r.llen("celery") == 0


@pytest.mark.parametrize("action", ["reject", "fail"])
def test_copy_of_a_run_that_ended_without_success_is_skipped(make_app: AppFactory, r: redis.Redis, action: str) -> None:
    """A re-pushed copy of a run that was rejected (or failed) is skipped, not run again.

    Every ended state counts as done, not only success: a rejected run's copy
    (a visibility-timeout redelivery) must not execute the body the task refused.
    """
    app = make_app(dedup_lock_ttl=LOCK_TTL)
    work = register(app)["guard.work.until_executed"]
    member = member_for(work.name, f"job:{action}")
    run = work.delay(action, action)
    copy = raw_messages(r)[run.id]
    ended = {"reject": "rejected", "fail": "failed"}[action]
    with in_process_worker(app, pool="threads", concurrency=2):
        wait_for(
            lambda: (
                (record_of(r, member) or {}).get("state") == ended
                and not pending_ids(r)
                and settled(deliveries(r, run.id))
            ),
            10,
            lambda: f"the end: {record_of(r, member)} {deliveries(r, run.id)} {pending_ids(r)}",
        )
        seen, ran = len(deliveries(r, run.id)), len(starts(events(r, work.name, action)))
        r.rpush("celery", copy)
        wait_for(lambda: len(deliveries(r, run.id)) == seen + 2 and not pending_ids(r), 10, "the copy")
    record = record_of(r, member)
    assert record is not None
    assert (record["state"], record["skipped"]) == (ended, "1")
    assert len(starts(events(r, work.name, action))) == ran, "the copy ran the body again"
    assert not is_held(r, member) and not lock_exists(r, member)


def test_a_copy_of_a_run_whose_record_vanished_while_it_ran_is_skipped_after_its_success(
    make_app: AppFactory, r: redis.Redis
) -> None:
    """The run's record, lock and key vanish while its body runs (a server that lost its data, an operator's
    purge); the body succeeds; then a copy of its message, fetched before the loss, is delivered.

    Proves: the success is remembered though no record was left to write it
    to, so the copy is skipped, not run a second time; the key stays free.
    """
    app = make_app(dedup_lock_ttl=LOCK_TTL)
    work = register(app)["guard.work.until_executed"]
    member = member_for(work.name, "job:gone")
    run = work.delay("gone", "sleep", 1.0)
    copy = raw_messages(r)[run.id]
    with in_process_worker(app, pool="threads", concurrency=2):
        wait_for(lambda: (record_of(r, member) or {}).get("state") == "started", 10, "the run to start")
        r.delete(SCHEMA.record(member), SCHEMA.lock(member))  # the history lives in the record
        r.srem(SCHEMA.held, member)
        assert run.get(timeout=10) == "gone"
        wait_for(lambda: settled(deliveries(r, run.id)) and not pending_ids(r), 10, "the run's ending")
        seen = len(deliveries(r, run.id))
        r.rpush("celery", copy)
        wait_for(lambda: len(deliveries(r, run.id)) == seen + 2 and not pending_ids(r), 10, "the copy")
    assert [e["id"] for e in starts(events(r, work.name, "gone"))] == [run.id], "the copy ran the body again"
    assert not is_held(r, member) and not lock_exists(r, member)


def test_a_deferred_copy_of_a_run_that_freed_its_key_leaves_it_free(make_app: AppFactory, r: redis.Redis) -> None:
    """until_executing frees the key as the body starts; then a copy of the running run's message arrives,
    is refused by the run's own lock and deferred (re-published to come back later).

    Proves: the deferral does not hold the key again, so a call made while
    the body still runs is a run of its own that executes after it (its
    delivery waits for the lock: ``reschedule``), not a duplicate of a run
    that began before the call was made.
    """
    app = make_app(dedup_lock_ttl=LOCK_TTL)
    ran = f"test:ran:{uuid.uuid4().hex}"

    @app.task(
        base=DedupTask,
        bind=True,
        shared=False,
        name="guard.again",
        dedup_key="again:{k}",
        dedup_mode="until_executing",
        dedup_on_locked="reschedule",
    )
    def again(self: Any, k: str, seconds: float) -> str:
        r.rpush(ran, str(self.request.id))
        time.sleep(seconds)
        return k

    member = member_for(again.name, "again:k")
    first = again.delay("k", 2.0)
    copy = raw_messages(r)[first.id]
    with in_process_worker(app, pool="threads", concurrency=2):
        wait_for(lambda: (record_of(r, member) or {}).get("state") == "started", 10, "the run to start")
        r.rpush("celery", copy)
        # The deferral's publish passed the gate once the record remembers two publishes.
        wait_for(lambda: (record_of(r, member) or {}).get("nonces"), 10, "the copy to be deferred")
        assert not is_held(r, member), "the deferral holds the key again"
        second = again.delay("k", 0.0)
        assert not second.deduplicated, f"a call while the body runs was answered as a duplicate of {second.id}"
        assert second.get(timeout=15) == "k"
        assert first.get(timeout=15) == "k"
    assert [entry.decode() for entry in r.lrange(ran, 0, -1)] == [first.id, second.id]


def test_a_retry_of_a_run_that_freed_its_key_holds_it_again(make_app: AppFactory, r: redis.Redis) -> None:
    """The other side of the deferral rule: until_executing freed the key as the body started, and the body
    calls ``self.retry()``. Proves: the retry holds the key again, so a call during its countdown is a
    duplicate of the retrying run (only a deferred copy leaves the key free)."""
    app = make_app(dedup_lock_ttl=LOCK_TTL)
    ran = f"test:ran:{uuid.uuid4().hex}"

    @app.task(
        base=DedupTask,
        bind=True,
        shared=False,
        name="guard.retrying",
        dedup_key="again:{k}",
        dedup_mode="until_executing",
    )
    def retrying(self: Any, k: str) -> str:
        r.rpush(ran, str(self.request.id))
        if not self.request.retries:
            raise self.retry(countdown=1.5)
        return k

    member = member_for(retrying.name, "again:k")
    first = retrying.delay("k")
    with in_process_worker(app, pool="threads", concurrency=2):
        wait_for(lambda: (record_of(r, member) or {}).get("state") == "retry", 10, "the run to retry")
        assert is_held(r, member), "the retry left the key free"
        second = retrying.delay("k")
        assert second.deduplicated and second.id == first.id, "a call during the retry's countdown ran on its own"
        assert first.get(timeout=15) == "k"
    assert [entry.decode() for entry in r.lrange(ran, 0, -1)] == [first.id, first.id]


def test_copy_refused_just_before_the_run_finishes_is_not_run_again(make_app: AppFactory, r: redis.Redis) -> None:
    """A copy refused while the run holds the lock, whose deferral is published just after the run succeeded.

    A ``before_task_publish`` receiver holds the deferral back until the
    record says succeeded (the interleaving a slow publish or a busy worker
    produces). Proves: the gate recognises a deferral of a run that has ended
    and enqueues nothing; the body ran once and the key is not held again.
    """
    app = make_app(dedup_lock_ttl=LOCK_TTL)
    work = register(app)["guard.work.until_executed"]
    member = member_for(work.name, "job:race")
    run = work.delay("race", "sleep", 1.0)
    copy = raw_messages(r)[run.id]
    held_back = threading.Event()

    def hold_deferral(sender: Any = None, headers: Any = None, properties: Any = None, **_: Any) -> None:
        if headers and headers.get("id") == run.id and headers.get("eta"):
            held_back.set()
            wait_for(lambda: (record_of(r, member) or {}).get("state") == "succeeded", 10, "the run to succeed")

    signals.before_task_publish.connect(hold_deferral, weak=False)
    try:
        with in_process_worker(app, pool="threads", concurrency=2):
            wait_for(lambda: (record_of(r, member) or {}).get("state") == "started", 10, "the run to start")
            r.rpush("celery", copy)
            assert run.get(timeout=10) == "race"
            wait_for(held_back.is_set, 5, "the copy to be deferred")
            # original and refused copy: a prerun and a postrun each
            wait_for(lambda: len(deliveries(r, run.id)) >= 4 and not pending_ids(r), 10, "the refused copy")
            time.sleep(1.0)  # room for a wrongly enqueued deferral to be delivered
    finally:
        signals.before_task_publish.disconnect(hold_deferral)
    assert len(deliveries(r, run.id)) == 4, "a deferral of an ended run must enqueue nothing"
    assert [e["id"] for e in starts(events(r, work.name, "race"))] == [run.id], "the copy ran the body again"
    record = record_of(r, member)
    assert record is not None and record["state"] == "succeeded"
    assert not r.sismember(SCHEMA.held, member), "an ended run must not hold its key again"


def test_reschedule_runs_the_second_run_after_the_first(make_app: AppFactory, r: redis.Redis) -> None:
    """while_executing with dedup_on_locked="reschedule": a second run of the key while the first runs.

    Proves: the run that finds the lock held is deferred (a later delivery
    with an ETA) and runs once the first has finished: two executions, serial.
    """
    app = make_app(dedup_lock_ttl=LOCK_TTL)
    serial = register(app)["guard.serial"]
    with in_process_worker(app, pool="threads", concurrency=2):
        first = serial.delay("x", 1.5)
        wait_for(lambda: starts(events(r, serial.name, "x")), 10, "the first run to start")
        second = serial.delay("x", 1.5)  # while the first holds the lock
        assert first.id != second.id
        assert (first.get(timeout=15), second.get(timeout=15)) == (first.id, second.id)
    evs = events(r, serial.name, "x")
    assert [e["id"] for e in starts(evs)] == [first.id, second.id]
    assert_serial(evs)
    seen = deliveries(r, second.id)
    outcomes = [d["state"] for d in seen if d["phase"] == "postrun"]
    assert outcomes[0] == "IGNORED" and outcomes[-1] == "SUCCESS", seen
    assert all(d["eta"] for d in seen[2:] if d["phase"] == "prerun"), "re-deliveries are deferred (ETA)"
    assert not lock_exists(r, member_for(serial.name, "serial:x"))


# --------------------------------------------------------------------------- 5. records and history


@dataclass
class RecordSet:
    """300 records: alpha red:000-149 (000-059 succeeded, the rest queued), alpha blue:000-099, beta red:000-049."""

    app: Celery
    alpha: Any
    beta: Any

    def members(self, task: Any, color: str, numbers: range) -> set[str]:
        return {member_for(task.name, f"{color}:{n:03d}") for n in numbers}

    @property
    def everything(self) -> set[str]:
        return (
            self.members(self.alpha, "red", range(150))
            | self.members(self.alpha, "blue", range(100))
            | self.members(self.beta, "red", range(50))
        )

    @property
    def succeeded(self) -> set[str]:
        return self.members(self.alpha, "red", range(60))

    def one_page(self, **filters: Any) -> list[celery_dedup.Record]:
        """Every match on one page (the limit exceeds the record count)."""
        page = celery_dedup.records(self.app, limit=500, **filters)
        assert page.cursor is None
        return page.records

    def all_pages(self, limit: int, **filters: Any) -> list[celery_dedup.Record]:
        found: list[celery_dedup.Record] = []
        cursor: str | None = None
        for _ in range(1000):
            page = celery_dedup.records(self.app, cursor=cursor, limit=limit, **filters)
            assert len(page.records) <= limit
            found += page.records
            cursor = page.cursor
            if cursor is None:
                return found
        raise AssertionError("pagination never ended")


@pytest.fixture
def record_set(make_app: AppFactory, r: redis.Redis) -> RecordSet:
    app = make_app()

    @app.task(base=DedupTask, name="guard.rec.alpha", dedup_key="{color}:{n}", shared=False)
    def alpha(color: str, n: str) -> None: ...

    @app.task(base=DedupTask, name="guard.rec.beta", dedup_key="{color}:{n}", shared=False)
    def beta(color: str, n: str) -> None: ...

    done = [alpha.delay("red", f"{n:03d}") for n in range(60)]
    with in_process_worker(app):
        for result in done:
            result.get(timeout=20)
    for n in range(60, 150):
        alpha.delay("red", f"{n:03d}")
    for n in range(100):
        alpha.delay("blue", f"{n:03d}")
    for n in range(50):
        beta.delay("red", f"{n:03d}")
    return RecordSet(app, alpha, beta)


def test_records_filters_select_exactly_the_matching_records(record_set: RecordSet) -> None:
    """celery_dedup.records with state, task and key-prefix filters, alone and combined (one page each).

    Proves: each filter returns exactly the matching records; a prefix search
    matches only keys with that prefix, in key order; unfiltered is newest first.
    """
    rs = record_set
    everything = rs.one_page()
    assert {rec.member for rec in everything} == rs.everything and len(everything) == 300
    updated = [rec.updated_at for rec in everything if rec.updated_at is not None]
    assert len(updated) == len(everything), "every record's last update is known (format 2 derives it)"
    assert updated == sorted(updated, reverse=True), "newest first"

    succeeded = rs.one_page(state="succeeded")
    assert {rec.member for rec in succeeded} == rs.succeeded and len(succeeded) == 60
    assert all(rec.state == "succeeded" for rec in succeeded)
    queued = rs.one_page(state="queued")
    assert {rec.member for rec in queued} == rs.everything - rs.succeeded and len(queued) == 240

    only_beta = rs.one_page(task=rs.beta.name)
    assert {rec.member for rec in only_beta} == rs.members(rs.beta, "red", range(50)) and len(only_beta) == 50

    prefixed = rs.one_page(prefix="red:04")
    expected = rs.members(rs.alpha, "red", range(40, 50)) | rs.members(rs.beta, "red", range(40, 50))
    assert {rec.member for rec in prefixed} == expected and len(prefixed) == 20
    keys = [rec.key for rec in prefixed]
    assert keys == sorted(keys) and all(k.startswith("red:04") for k in keys)
    assert {rec.member for rec in rs.one_page(prefix="blue:")} == rs.members(rs.alpha, "blue", range(100))
    assert rs.one_page(prefix="red:04x") == []
    assert rs.one_page(prefix="red:1") == rs.one_page(prefix="red:1", task=rs.alpha.name)

    combined = rs.one_page(prefix="red:0", task=rs.alpha.name, state="succeeded")
    assert {rec.member for rec in combined} == rs.succeeded


@pytest.mark.parametrize(
    ("limit", "filters"),
    [
        (37, {}),
        (25, {"state": "succeeded"}),
        (50, {"state": "queued"}),
        (20, {"task": "guard.rec.beta"}),
        (7, {"prefix": "red:04"}),
    ],
    ids=["all", "state-succeeded", "state-queued", "task", "prefix"],
)
def test_records_pagination_yields_every_record_once(
    record_set: RecordSet, limit: int, filters: dict[str, str]
) -> None:
    """Cursor pagination over the same 300 records, with and without filters.

    Proves: following the cursor, every matching record appears on exactly one
    page (the union of the pages equals the one-page answer), in the same order.
    """
    whole = [rec.member for rec in record_set.one_page(**filters)]
    paged = [rec.member for rec in record_set.all_pages(limit, **filters)]
    assert len(paged) == len(set(paged)), "a record appeared on two pages"
    missing = set(whole) - set(paged)
    assert not missing, f"{len(missing)} of {len(whole)} records are on no page"
    assert paged == whole, "pages must continue where the previous one stopped"


def test_history_keeps_the_runs_transitions_capped(make_app: AppFactory, r: redis.Redis) -> None:
    """dedup_history_length=5: a run retried twice (7 transitions) and a plain run (3).

    Proves: the history lists a run's transitions newest first (queued,
    started, retry, started, ... succeeded), each naming the run, capped at
    the setting.
    """
    app = make_app(dedup_history_length=5, dedup_lock_ttl=LOCK_TTL)
    work = register(app)["guard.work.until_executed"]
    retried, plain = work.delay("h", "retry:2"), work.delay("p", "ok")
    with in_process_worker(app):
        assert retried.get(timeout=15) == "h"
        assert plain.get(timeout=15) == "p"

    full = ["succeeded", "started", "retry", "started", "retry", "started", "queued"]
    capped = history_of(r, member_for(work.name, "job:h"))
    assert [entry[1] for entry in capped] == full[:5]
    assert {entry[2] for entry in capped} == {retried.id}
    assert [entry[3:] for entry in capped if entry[1] == "started"] == [["attempt", "3"], ["attempt", "2"]]
    stamps = [int(entry[0]) for entry in capped]
    assert stamps == sorted(stamps, reverse=True)
    short = history_of(r, member_for(work.name, "job:p"))
    assert [entry[1] for entry in short] == ["succeeded", "started", "queued"]
    assert {entry[2] for entry in short} == {plain.id}


# --------------------------------------------------------------------------- 6. reaper


def dead_run(app: Celery, task: Any, key: str, task_id: str, *, lock_ms: int) -> str:
    """Start ``task_id`` the way a worker does, then never finish it (the worker "died")."""
    store = dedup_runtime.store_for(app)
    member = member_for(task.name, task.dedup_business_key(key))
    decision = store.start(
        member,
        task_id,
        f"deadhost:1:0000:{task_id}",
        lock_ms=lock_ms,
        gated=True,
        key_mode="lock",
        hostname="deadhost",
        pid=1,
        retries=0,
        record_ms=86_400_000,
    )
    assert decision.run
    return member


def test_reap_releases_expired_holds_marks_dead_runs_lost_and_drops_stale_index_entries(
    make_app: AppFactory, r: redis.Redis
) -> None:
    """One reap pass over: an expired hold (H), a started run whose lock expired (L), an expired record (S).

    Proves: H leaves the held set; L is marked lost and its key released (a
    new call is accepted); S's index entries are removed; the report counts
    each, and a second pass finds nothing.
    """
    app = make_app(dedup_lock_ttl=LOCK_TTL)
    work = register(app)["guard.work.until_executed"]

    @app.task(base=DedupTask, name="guard.brief", dedup_key="brief:{n}", dedup_ttl=0.3, shared=False)
    def brief(n: int) -> None: ...

    store = dedup_runtime.store_for(app)
    hold = brief.delay(1)
    hold_member = member_for(brief.name, "brief:1")
    lost_member = dead_run(app, work, "dead", work.delay("dead").id, lock_ms=300)
    short = work.delay("short")
    short_member = dead_run(app, work, "short", short.id, lock_ms=60_000)
    owned, *_ = store.finish(
        short_member, short.id, "succeeded", drop=True, record_ms=300, token=f"deadhost:1:0000:{short.id}", role="run"
    )
    assert owned
    assert is_held(r, hold_member) and is_held(r, lost_member)
    wait_for(
        lambda: (
            not lock_exists(r, lost_member)
            and not r.exists(SCHEMA.record(short_member))
            and int((record_of(r, hold_member) or {}).get("held_until", 0)) < server_ms(r)
        ),
        5,
        "the lock, the record and the hold to expire",
    )
    assert r.zscore(SCHEMA.state_index("succeeded"), short_member) is not None, "the expired record is still indexed"

    report = celery_dedup.reap(app)

    dead_id = (record_of(r, lost_member) or {})["task_id"]
    assert report == ReapReport(
        released=2, lost=1, stale=1, runs=((lost_member, dead_id, "its worker died: lock expired while started"),)
    ), "released: H and L's holds; lost: L; stale: S"
    assert not is_held(r, hold_member)
    assert (record_of(r, hold_member) or {}).get("task_id") == hold.id
    lost = record_of(r, lost_member)
    assert lost is not None and lost["state"] == "lost" and "lock" not in lost and lost["held_until"] == "0"
    assert not is_held(r, lost_member)
    assert history_of(r, lost_member)[0][1:] == ["lost", lost["task_id"], "reaped:", "lock", "expired"]
    namespace = task_namespace(work.name)
    for state in STATES:
        assert r.zscore(SCHEMA.state_index(state), short_member) is None, state
    assert r.zscore(SCHEMA.name_index, f"job:short\0{namespace}") is None
    assert celery_dedup.reap(app) == ReapReport(0, 0, 0)
    assert not work.delay("dead").deduplicated, "the dead run's key is free for a new call"


def test_worker_reaper_step_reaps_without_being_asked(make_app: AppFactory, r: redis.Redis) -> None:
    """A worker with dedup_reap_interval=0.2 and no manual reap call.

    Proves: the worker's reaper bootstep marks a dead run lost and releases
    its key and an expired hold by itself.
    """
    app = make_app(dedup_lock_ttl=LOCK_TTL, dedup_reap_interval=0.2)
    work = register(app)["guard.work.until_executed"]
    store = dedup_runtime.store_for(app)
    # Held keys without messages, so the worker has nothing to consume: only its reaper touches them.
    lost_member = member_for(work.name, "job:dead")
    hold_member = member_for(work.name, "job:hold")
    for member, task_id, hold_ms in ((lost_member, "job:dead~run", 60_000), (hold_member, "job:hold~run", 200)):
        outcome = store.gate(member, task_id, "nonce", hold_ms=hold_ms, grace_ms=60_000)
        assert outcome.accepted
    dead_run(app, work, "dead", "job:dead~run", lock_ms=300)
    wait_for(lambda: not lock_exists(r, lost_member), 5, "the dead run's lock to expire")
    assert is_held(r, lost_member) and is_held(r, hold_member)
    with in_process_worker(app):
        wait_for(
            lambda: (
                (record_of(r, lost_member) or {}).get("state") == "lost"
                and not is_held(r, lost_member)
                and not is_held(r, hold_member)
            ),
            10,
            "the worker's reaper",
        )
    assert history_of(r, lost_member)[0][1:3] == ["lost", "job:dead~run"]


def test_reaper_judges_a_message_lost_only_if_it_stays_missing(make_app: AppFactory, r: redis.Redis) -> None:
    """A message a live consumer fetched but has not recorded as unacked yet is not lost.

    kombu's consumer BRPOPs a message, then writes it to the unacked hash; a
    reaper pass in between sees it nowhere. It is judged lost only when it is
    still missing a grace later.
    """
    grace = 0.3
    app = make_app(dedup_reap_grace=grace, task_ignore_result=True)
    work = register(app)["guard.work.until_executed"]
    in_flight = work.delay("in-flight")
    gone = work.delay("gone")
    time.sleep(grace + 0.1)  # both waited in the queue longer than the grace
    raws = [r.rpop("celery"), r.rpop("celery")]  # what a consumer's BRPOP takes
    fetched = {loads(raw)["headers"]["id"]: loads(raw) for raw in raws if isinstance(raw, bytes)}
    assert set(fetched) == {in_flight.id, gone.id}

    assert celery_dedup.reap(app).vanished == 0, "missing at one look is not lost"
    tag = fetched[in_flight.id]["properties"]["delivery_tag"]
    r.hset("unacked", tag, json.dumps([fetched[in_flight.id], "", "celery"]))  # the consumer records it
    time.sleep(grace + 0.1)
    report = celery_dedup.reap(app)
    assert report.vanished == 1
    assert [run[1] for run in report.runs] == [gone.id]
    assert (record_of(r, member_for(work.name, "job:in-flight")) or {}).get("state") == "queued"
    assert (record_of(r, member_for(work.name, "job:gone")) or {}).get("state") == "lost"
    assert work.delay("in-flight").deduplicated, "the fetched run keeps its key"


def test_a_lock_a_sibling_thread_just_took_is_not_judged_ended(
    make_app: AppFactory, server: Server, r: redis.Redis
) -> None:
    """Threads pool: a delivery's lock is in the store before its thread hears back, and until then in no registry
    of its own.

    A sibling of the same process that reports an ending of the same run in
    that moment (``settle_elsewhere``, say for a revoked copy) judges the
    lock's token, which names this very process: it must find it alive and
    leave the lock. The proxy holds the start script's reply to freeze the
    moment.
    """
    port = urlparse(server.url).port
    assert port is not None
    r.execute_command("SCRIPT", "LOAD", load_script("start"))  # the held EVALSHA is the start, not a NOSCRIPT
    with FaultProxy(port) as proxy:
        app = make_app(broker_url=proxy.url, result_backend=server.url, dedup_reap_interval=0)

        @app.task(base=DedupTask, name="shop.sibling", dedup_key="order:{order_id}", shared=False)
        def charge(order_id: int) -> int:
            return order_id

        member = member_for(charge.name, "order:1")
        proxy.arm("after", hold=True)
        thread = threading.Thread(target=charge.apply, args=((1,),), kwargs={"task_id": "run-1"}, daemon=True)
        thread.start()
        assert proxy.fired.wait(10), "the delivery's start reached the server"
        holder = r.get(SCHEMA.lock(member))
        assert holder is not None
        token = holder.decode()
        assert processes.token_pid(token) == os.getpid(), "premise: the sibling's lock, taken in this process"
        assert not delivery.delivery_gone(token)
        assert not limits.owner_gone(token)
        delivery.settle_elsewhere(charge, "revoked", "run-1", None, [1], {}, stopping=False)
        assert r.get(SCHEMA.lock(member)) == holder, "the running delivery keeps its lock"
        proxy.release()
        thread.join(30)
    assert not thread.is_alive()
