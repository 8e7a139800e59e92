"""The reaper over indexes larger than its budget: every record is reached in a bounded number of passes.

Each pass examines at most ``budget`` entries per step. These tests build
backlogs and churn the indexes between passes, and count the passes until
the records that need clean-up are cleaned up. Runs are started the way a
worker starts them (the store's start script) and a worker "dies" by never
finishing; a message "lost by the transport" is popped off its queue the way
kombu's consumer pops it, and never recorded as unacknowledged.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
import redis
from celery import Celery

import celery_dedup
from celery_dedup import DedupTask
from celery_dedup import runtime as dedup_runtime
from celery_dedup.exceptions import DedupArgumentError
from celery_dedup.keys import KeySchema, member_for
from celery_dedup.store.schema import STATES
from celery_dedup.store.store import DedupStore

from ..conftest import AppFactory, wait_for

SCHEMA = KeySchema("dedup")
#: How long a message must stay missing before the reaper judges it lost (seconds).
GRACE = 0.05
ALIVE_MS = 120_000


def server_ms(r: redis.Redis) -> int:
    seconds, micros = r.time()
    return int(seconds) * 1000 + int(micros) // 1000


def next_ms(r: redis.Redis) -> None:
    """Wait for the server clock's next millisecond: records written after score after those written before."""
    now = server_ms(r)
    while server_ms(r) <= now:
        time.sleep(0.001)


def state_of(r: redis.Redis, member: str) -> str:
    return (r.hget(SCHEMA.record(member), "state") or b"").decode()


def define(app: Celery) -> Any:
    @app.task(base=DedupTask, name="reaper.work", dedup_key="job:{n}", shared=False)
    def work(n: str) -> None: ...

    return work


def member_of(task: Any, n: str) -> str:
    return member_for(task.name, task.dedup_business_key(n))


def run_id(n: str) -> str:
    return f"job:{n}~run"


def start(store: DedupStore, task: Any, n: str, *, lock_ms: int) -> str:
    """Start a run of ``job:n`` (id ``run_id(n)``) as a worker's delivery guard does; it never finishes by itself."""
    member = member_of(task, n)
    decision = store.start(
        member,
        run_id(n),
        f"host:1:0000:{n}",
        lock_ms=lock_ms,
        gated=False,
        key_mode="lock",
        hostname="host",
        pid=1,
        retries=0,
        record_ms=86_400_000,
    )
    assert decision.run
    return member


class Passes:
    """Reaper passes, each at least a grace after the previous one on the server clock."""

    def __init__(self, app: Celery, r: redis.Redis, budget: int) -> None:
        self.app, self.r, self.budget = app, r, budget
        self.count = 0
        self.last_ms = 0
        #: member -> the pass that marked its run lost.
        self.reaped: dict[str, int] = {}

    def run(self) -> celery_dedup.ReapReport:
        while server_ms(self.r) < self.last_ms + GRACE * 1000:
            time.sleep(GRACE / 5)
        self.last_ms = server_ms(self.r)
        report = celery_dedup.reap(self.app, budget=self.budget)
        self.count += 1
        for member, _, _ in report.runs:
            self.reaped.setdefault(member, self.count)
        return report


def test_reaper_reaches_runs_behind_a_backlog_larger_than_its_budget(make_app: AppFactory, r: redis.Redis) -> None:
    """500 healthy queued and 500 healthy started runs are older than three records that need clean-up.

    With a budget of 50 entries per step: a started run whose lock expired is
    marked lost within ceil(S/50) passes (S: started runs); a queued run whose
    message the transport lost is first seen missing within ceil(Q/50) passes
    (Q: queued runs) and judged lost at the first pass a grace later; a state
    index entry whose record expired is removed within ceil(I/50) passes (I:
    all state index entries). None of the healthy runs is touched.
    """
    budget, backlog = 50, 500
    app = make_app(dedup_reap_grace=GRACE, task_ignore_result=True)
    work = define(app)
    store = dedup_runtime.store_for(app)
    # Older queued runs, really in their queue: no worker consumes "backlog".
    queued = [member_of(work, f"queued-{n}") for n in range(backlog)]
    for n in range(backlog):
        assert not work.apply_async((f"queued-{n}",), queue="backlog").deduplicated
    # Older started runs whose workers are alive (their locks are held).
    started = [start(store, work, f"started-{n}", lock_ms=ALIVE_MS) for n in range(backlog)]
    next_ms(r)
    # A run whose message a consumer popped (BRPOP) and died before recording it as unacknowledged.
    gone = work.delay("gone")
    popped = r.rpop("celery")
    assert isinstance(popped, bytes) and gone.id.encode() in popped
    gone_member = member_of(work, "gone")
    # A started run whose worker died: its lock expires.
    dead_member = start(store, work, "dead", lock_ms=200)
    # A record that expired while still indexed.
    stale_member = start(store, work, "stale", lock_ms=ALIVE_MS)
    owned, *_ = store.finish(
        stale_member, run_id("stale"), "succeeded", drop=True, record_ms=200, token="host:1:0000:stale", role="run"
    )
    assert owned
    wait_for(
        lambda: not r.exists(SCHEMA.lock(dead_member), SCHEMA.record(stale_member)),
        5,
        "the dead run's lock and the finished record to expire",
    )
    assert r.zscore(SCHEMA.state_index("succeeded"), stale_member) is not None
    started_size = int(r.zcard(SCHEMA.state_index("started")))
    queued_size = int(r.zcard(SCHEMA.state_index("queued")))
    index_size = sum(int(r.zcard(SCHEMA.state_index(state))) for state in STATES)
    assert (started_size, queued_size, index_size) == (backlog + 1, backlog + 1, 2 * backlog + 3)

    passes = Passes(app, r, budget)
    bound = math.ceil(index_size / budget)
    while passes.count < bound:
        passes.run()

    assert passes.reaped.get(dead_member, bound + 1) <= math.ceil(started_size / budget), passes.reaped
    assert passes.reaped.get(gone_member, bound + 1) <= math.ceil(queued_size / budget) + 1, passes.reaped
    assert set(passes.reaped) == {dead_member, gone_member}, "no healthy run was reaped"
    assert state_of(r, dead_member) == state_of(r, gone_member) == "lost"
    assert r.zscore(SCHEMA.state_index("succeeded"), stale_member) is None, (
        f"the stale entry is still indexed after {bound} passes"
    )
    assert {state_of(r, m) for m in queued} == {"queued"} and {state_of(r, m) for m in started} == {"started"}
    assert not work.delay("gone").deduplicated and not work.delay("dead").deduplicated, "both keys are free"


def test_records_leaving_the_index_behind_the_cursor_do_not_make_it_skip_one(
    make_app: AppFactory, r: redis.Redis
) -> None:
    """Runs the cursor has passed end between two passes; the next pass goes on from where it stopped.

    A cursor that counted ranks would move past as many unseen entries as
    left before it. A dead run right after the first pass's entries is
    reaped by the second pass.
    """
    budget = 10
    app = make_app()
    work = define(app)
    store = dedup_runtime.store_for(app)
    ending = [f"first-{n}" for n in range(budget)] + [f"between-{n}" for n in range(budget // 2)]
    for n in ending:
        start(store, work, n, lock_ms=ALIVE_MS)
    next_ms(r)
    dead_member = start(store, work, "dead", lock_ms=200)
    next_ms(r)
    later = [start(store, work, f"later-{n}", lock_ms=ALIVE_MS) for n in range(3 * budget)]
    wait_for(lambda: not r.exists(SCHEMA.lock(dead_member)), 5, "the dead run's lock to expire")
    passes = Passes(app, r, budget)
    # The first pass reads the oldest `budget` started runs, and the dead one is not among them.
    assert passes.run().lost == 0
    for n in ending:  # the first pass read the first `budget` of these
        store.finish(
            member_of(work, n),
            run_id(n),
            "succeeded",
            drop=True,
            record_ms=60_000,
            token=f"host:1:0000:{n}",
            role="run",
        )
    assert passes.run().lost == 1
    assert passes.reaped == {dead_member: 2}
    assert {state_of(r, m) for m in later} == {"started"}


def test_a_passed_record_is_looked_at_again_while_new_records_come_faster_than_the_budget(
    make_app: AppFactory, r: redis.Redis
) -> None:
    """A run's lock expires after the cursor passed it, while more runs start per pass than a pass reads.

    A cursor that wrapped only on reaching the end would chase the newest
    entries forever. Each walk (a cycle) covers the entries present when it
    began, so the walk ends and the next one reaches the run: within the
    rest of the first walk plus the run's place in the next.
    """
    budget = 10
    app = make_app()
    work = define(app)
    store = dedup_runtime.store_for(app)
    before = [start(store, work, f"before-{n}", lock_ms=ALIVE_MS) for n in range(budget // 2)]
    next_ms(r)
    dying_member = start(store, work, "dying", lock_ms=1500)
    next_ms(r)
    after = [start(store, work, f"after-{n}", lock_ms=ALIVE_MS) for n in range(3 * budget)]
    first_walk = int(r.zcard(SCHEMA.state_index("started")))
    passes = Passes(app, r, budget)
    assert passes.run().lost == 0, "the dying run is alive when the first pass reads it"
    wait_for(lambda: not r.exists(SCHEMA.lock(dying_member)), 5, "the dying run's lock to expire")
    arrivals = 0
    bound = math.ceil(first_walk / budget) + 1  # the first walk's passes, then one pass of the next
    while dying_member not in passes.reaped and passes.count < bound + 5:
        for _ in range(budget + 5):
            start(store, work, f"new-{arrivals}", lock_ms=ALIVE_MS)
            arrivals += 1
        passes.run()
    assert passes.reaped.get(dying_member, bound + 1) <= bound, (passes.count, passes.reaped)
    assert {state_of(r, m) for m in before + after} == {"started"}


@pytest.mark.parametrize("budget", [1, 3])
def test_a_budget_of_one_or_three_still_reaches_every_dead_run(
    make_app: AppFactory, r: redis.Redis, budget: int
) -> None:
    """Dead and live runs started in the same milliseconds; with a budget of 1 or 3 entries per step.

    Proves: one walk of ceil(S/budget) passes marks every dead run lost (the
    ones the pass itself removes from the index do not make the walk skip or
    repeat), leaves the live ones, and the next pass finds nothing.
    """
    app = make_app()
    work = define(app)
    store = dedup_runtime.store_for(app)
    dead = [start(store, work, f"dead-{n}", lock_ms=200) for n in range(4)]
    alive = [start(store, work, f"alive-{n}", lock_ms=ALIVE_MS) for n in range(4)]
    wait_for(lambda: not any(r.exists(SCHEMA.lock(m)) for m in dead), 5, "the dead runs' locks to expire")
    passes = Passes(app, r, budget)
    size = int(r.zcard(SCHEMA.state_index("started")))
    while passes.count < math.ceil(size / budget):
        passes.run()
    assert set(passes.reaped) == set(dead)
    assert {state_of(r, m) for m in alive} == {"started"}
    report = passes.run()
    assert (report.lost, report.vanished, report.stale) == (0, 0, 0)


def test_a_budget_below_one_is_refused(make_app: AppFactory, r: redis.Redis) -> None:
    with pytest.raises(DedupArgumentError, match="budget=0"):
        celery_dedup.reap(make_app(), budget=0)
