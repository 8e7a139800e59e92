"""The checker: does a run's merged history keep celery-dedup's promises?

It reads every process's events (see :mod:`chaos.history`) and ``final.json``,
the status records, their histories (``dedup:hist:<member>``, every
transition with the server's time), the held set and the locks as they were
after the quiet period. Each invariant below is checked over all of it; a
violation is printed with an excerpt of the history around it.

``crash``
    No worker process exits unless the run stopped or killed it, because of
    celery-dedup (its code in the traceback, or one of its exceptions). A
    crash inside Celery or kombu alone is reported as explained.
``overlap``
    No two bodies of one key run at the same time. Every mode takes the
    key's execution lock, so this holds for all of them, across runs and
    across copies of one run. The one allowed exception is a body that lost
    its lock because a fault stopped it from renewing (its worker was
    SIGSTOPped, its connections were cut or delayed, the server restarted, it
    was revoked): that overlap is *explained* if the library recorded the
    loss (``self.dedup_lock_lost``, the ``lock_lost`` decision, the
    record's history) and a fault can account for it; it is counted and
    printed, not a violation.
``again-after-end``
    A run whose body succeeded, or failed for good, never executes again
    (Celery's retry is not an ending; a body killed mid-run, or before its
    own process recorded the ending, may run again). A reject without
    requeue (``Task.retry`` that could not publish the retry) is an ending.
    A restart that wiped the server's data in between explains it, also one
    that began before the body's process settled the ending, if the server
    was still down then (the ending was written before the crash).
``unresolved-run``
    Every run a call was accepted into (and every run the server's history
    shows queued, e.g. from a producer killed mid-publish) executed, or has
    an ending recorded with a reason (status history, or a ``skipped`` or
    ``reaped`` decision), by the end of the quiet period. A run whose last
    body backed off (``dedup_backoff``) must run again or have an ending
    recorded after that body.
``unresolved-duplicate``
    Every id handed to a duplicate caller resolves the same way.
``stuck-key``
    After the quiet period, no key is held without a live run (a lock, or
    its message queued, unacknowledged or parked) past the longest hold any
    call could have asked for.
``double-accept``
    until_executed and until_executing: a key never accepts a second run
    while its first is alive (not ended, not dead, not past its hold; for
    until_executing, not yet started).
``window``
    throttle and until_expired: at most one run per window, unless the
    first run failed, was released or lost (which frees the window).
``debounce-args``
    A debounced run executes with the arguments of its burst's last call as
    the server ordered them: no call of the burst was sent after the one
    whose arguments ran had returned. A restart that wiped the server's data
    after such a call was sent and before the body started explains it: the
    arguments the call left in the record went with it.
``limit``
    Never more than N bodies of a limit group at once (``limit_concurrency=N``),
    across workers and within one process (threads, gevent). Explained: the
    library reported that the older body lost its slot (its renewer, or its
    ending giving back a lapsed slot), and a fault can have kept it from
    renewing the lease (a SIGSTOP, its connections cut or delayed, a server
    restart, a revoke).
``limit-window``
    The named group's bodies (two tasks sharing one group, a quota per group
    key) never start more often than any of the group key's windows allows:
    at most R starts in any period P, counted from the grants' server-clock
    starts (``granted_at``), under the values in force at each grant (the
    declared windows, or an override's). A grant while an override was
    being written or undone is judged by either. Explained: a wipe of the
    server's data within the window (the starts' log went with it).
    ``limit`` holds these bodies to the concurrency in force as they were
    granted, across the two tasks.
``limit-pause``
    No body of a paused group key starts while the pause is certainly in
    force: from after the operator's pause was written until before its
    resume (or its end), or within a body's back-off of the key (from after
    ``dedup_backoff`` returned until ``retry_after`` after it was asked,
    unless the library logged that it could not write the pause, or an
    operator paused or resumed the key in between). Explained: a wipe of
    the server's data since the pause was written.
``recovery``
    A run whose whole worker was SIGKILLed on this machine while its body ran
    (``task_acks_late``, its lock live, the store on the broker) is put back
    in its queue before its lock expires: a live worker's start-up or reaper
    pass proves the owner and the worker dead and restores the message, so
    the re-run does not wait for ``visibility_timeout``. Checked only when the
    visibility timeout itself cannot bring the message back first, another
    worker was ready throughout, no fault in between can have delayed it, and
    the run still owned its record (``until_executing`` and ``debounce`` pass
    the record to the next call of the key while the body runs; recovery
    finds runs by their records; where the key's kept history no longer
    reaches back to the body, a call accepted as another run of such a key
    after the body started shows the passing).
``step-once``
    A step (``dedup_once``) recorded done is never executed again by a later
    delivery of its run (a retry, a redelivery, a copy): its function is not
    called after the step was recorded done, and a delivery that skips it
    gets the value a completed call of it returned, in every mode: a later
    run of the key keeps its steps apart from the run's. Explained: a wipe of
    the server's data in between.
``step-doubt``
    Every step found in doubt is reported as such: a call of a step after an
    earlier call of it that did not end (its executor was killed, paused past
    its lock, or could not record the ending) is preceded by the library's
    report (the "in doubt ... called again" warning, or the key's history
    entry ``<step> in doubt, again``), never made with ``on_doubt="raise"``,
    and ``DedupStepInDoubt`` is raised only for a step that began and never
    completed. A call after one whose function raised (recorded ``failed``)
    needs no report. Explained as for ``step-once``.
``step-key``
    A step's idempotency key never changes within its run: every call of the
    step, in every delivery of the run, gets the same key.
``continuation``
    A chained call (``head | chaos.after``) whose run resolved (it succeeded,
    or replaced itself by a plain task that ran) goes on with its chain,
    whether the call was accepted or followed that run as a duplicate:
    ``chaos.after`` runs, with the run's result (the call a body of it ran;
    a replacement returns its body's). Explained: the server's data was wiped;
    the process that resolved the head died right after it (Celery sends the
    next step after the body, and a run that ended is not run again); the
    next step's message can have been lost in transit (a worker killed, the
    server restarted, a worker's connection cut) within 30 s of being sent.
"""

from __future__ import annotations

import bisect
import datetime
import json
import re
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

from celery_dedup.store import schema
from celery_dedup.store.schema import ENDED_STATES

from .app import LOCK_TTL, MODE_BY_TASK, MODES, REAP_INTERVAL, VISIBILITY_TIMEOUT, ModeSpec
from .history import SERVER_LOG, Event, read_events
from .quota import Config, Timeline, windows

INVARIANTS = (
    "crash",
    "overlap",
    "again-after-end",
    "unresolved-run",
    "unresolved-duplicate",
    "stuck-key",
    "double-accept",
    "window",
    "debounce-args",
    "continuation",
    "limit",
    "limit-window",
    "limit-pause",
    "recovery",
    "step-once",
    "step-doubt",
    "step-key",
    "transition",
)
#: The outcome of a body that backed off (``raise self.dedup_backoff(...)``): its run comes back.
BACKOFF = "Backoff"
#: States after which a run has ended (the store schema's), and those that count as its fate.
ENDED = frozenset(ENDED_STATES)
FATES = ENDED | {"lost"}
#: Body outcomes that do not end a run's work: a retry, a replacement under the same key (the run goes on;
#: one by a plain task ends the run, see REPLACED_BY_PLAIN), a reject that requeues the message (``Reject`` in a
#: history from before rejects told whether they requeue, but see REJECTED_BY_RETRY), a process exiting mid-body
#: (a terminate), no outcome.
NOT_FINAL = frozenset(
    {
        "retry",
        "Retry",
        "replaced",
        "requeued",
        "Reject",
        "Ignore",
        "SystemExit",
        "KeyboardInterrupt",
        "GreenletExit",
        "killed",
        "unknown",
        # a step found the delivery's lock lost: it stands down and ends nothing (the run goes on elsewhere)
        "DedupLockLostError",
        # dedup_backoff: the run was re-published to come back once its group key's pause ends
        BACKOFF,
    }
)
#: How a step's function can be cut off by its process going (a terminate, a shutdown, a killed greenlet):
#: the step was not recorded failed, it is in doubt.
INTERRUPTIONS = frozenset({"SystemExit", "KeyboardInterrupt", "GreenletExit"})
#: Step events the chaos body writes (see chaos.app.run_step).
STEP_EVENTS = frozenset({"step_enter", "step_call", "step_return", "step_exit"})
#: The outcome of a body that replaced itself by a plain task: its run ended ``replaced`` and freed its key.
REPLACED_BY_PLAIN = "replaced-by-plain"
#: The outcome of a body whose ``Task.retry`` could not publish the retry: Celery rejects the message without
#: requeue, and the run ended ``rejected``.
REJECTED_BY_RETRY = "rejected"
#: Decisions that settle a run that never executed.
SETTLING_DECISIONS = frozenset({"skipped", "reaped", "released"})
#: Kinds of explained cases, as the report titles them.
EXPLAINED = {
    "overlap": "explained overlaps (a body lost its lock to a fault, and the library reported it)",
    "wiped": "runs lost with the server's data (a restart without persistence)",
    "transit": "ungated runs whose message a fault can have lost before any record existed",
    "crash": "worker crashes outside celery-dedup (Celery or kombu; the worker was replaced)",
    "continuation": "chains whose next step a kill lost after their run succeeded",
    "limit": "limit groups over N after a fault kept a body from renewing its slot, or over a window or inside a "
    "pause a wipe of the server's data took",
    "transition": "transitions the schema does not allow, on a record a copy made again after a wipe took it while "
    "its run's body ran",
}
#: How soon after resolving a chain's head its process must die to explain a next step never sent, seconds.
SEND_WINDOW = 3.0
#: How soon after a chain's next step was sent a transit fault must come to explain it never running,
#: seconds: a worker fetches it behind at most a few bodies of the longest sleep (see chaos.workload).
TRANSIT_WINDOW = 30.0
#: The longest countdown or ETA a producer asks for, seconds (see chaos.workload).
MAX_DELAY = 3.0
#: Kills of a whole worker (main process and pool), by the ``why`` of their ``kill`` event.
WHOLE_WORKER_KILLS = frozenset({"kill-worker", "restart-worker"})
#: Kills (the runner's ``kill`` events, by why) that can take a message a worker fetched and recorded nowhere.
TRANSIT_KILLS = frozenset({"kill-worker", "restart-worker", "kill-child"})
#: How soon after its worker's SIGKILL a live run must be put back, seconds: before its lock (renewed every
#: third of its TTL) expires, a reaper pass of another worker (every REAP_INTERVAL) proves the owner dead.
RECOVERY_BOUND = LOCK_TTL + REAP_INTERVAL
#: The server history's note for a run whose record went to the next call of its key while it ran: format
#: 2's, and format 1's (``"still running; key passed to the next run"``, of a store a previous release wrote).
PASSED_ON = frozenset({"passed on", "key passed to the next run"})
#: Modes whose record passes to the next call of the key while a body runs (the key is freed as it starts).
PASSED_ON_AT_START = frozenset({"until_executing", "debounce"})
#: Faults that can keep a dead worker's run from being put back in time (they stop, cut or slow the
#: workers that would restore it, or change the run's record). Workers killed or stopped by a restart
#: meanwhile only do not count as the live worker that restores it.
RECOVERY_HINDRANCES = frozenset({"restart", "proxy", "slow-link", "stop-worker", "revoke", "operator"})
#: Slack for comparing host times with the server's millisecond timestamps.
MS = 0.002


@dataclass
class Body:
    """One execution of a task body, from its start to its end or its process's death."""

    task_id: str
    member: str
    call: str
    pid: int
    role: str
    start: float
    end: float = float("inf")
    #: The body's own outcome, or ``killed`` / ``unknown`` when it did not record one.
    outcome: str = "unknown"
    lock_lost: bool = False
    #: The thread or greenlet that ran it (a threads or gevent pool runs several bodies in one process).
    tid: int = 0
    #: A limited task's group and its ``limit_concurrency`` (0: not limited).
    group: str = ""
    limit: int = 0
    #: A named group's body: the group, its group key, its declared windows and when it was granted (ms).
    quota: str = ""
    quota_key: str = ""
    rates: str = ""
    granted_at: int = 0


@dataclass
class Worker:
    """One worker process the run started: its slot, pool and way of acknowledging."""

    slot: str
    generation: int
    pool: str
    acks_late: bool
    #: The pid of its main process.
    process: int


@dataclass
class Call:
    """One producer call and what it returned."""

    call: str
    member: str
    mode: str
    way: str
    delay: float
    t0: float
    t: float
    outcome: str
    task_id: str
    #: Position in its producer's publish order (calls of one ``many`` batch share t0 and t).
    seq: int


@dataclass
class Entry:
    """One transition in a key's server-side history."""

    t: float
    state: str
    task_id: str
    note: str


@dataclass
class Violation:
    invariant: str
    member: str
    message: str
    t: float
    task_ids: tuple[str, ...] = ()
    excerpt: list[str] = field(default_factory=list)


@dataclass
class Explained:
    """A case that looked like a violation but is allowed, and why."""

    #: ``overlap`` (a body lost its lock to a fault) or ``wiped`` (a run lost with the server's data).
    kind: str
    member: str
    message: str


@dataclass
class Report:
    ops: int
    faults: int
    violations: list[Violation]
    explained: list[Explained]
    #: Invariant -> how many cases it examined.
    checked: Counter[str]
    fault_kinds: Counter[str]
    bodies: int
    seed: int | None

    def summary(self) -> str:
        seed = "?" if self.seed is None else str(self.seed)
        return f"chaos: {self.ops} operations, {self.faults} faults, {len(self.violations)} violations, seed {seed}"

    def render(self, *, explained_limit: int = 20) -> str:
        lines = []
        for violation in self.violations:
            lines.append(f"VIOLATION {violation.invariant} on {violation.member}: {violation.message}")
            lines += [f"    {line}" for line in violation.excerpt]
        for kind, title in EXPLAINED.items():
            items = [item for item in self.explained if item.kind == kind]
            if not items:
                continue
            lines.append(f"{len(items)} {title}:")
            lines += [f"    {item.member}: {item.message}" for item in items[:explained_limit]]
            if len(items) > explained_limit:
                lines.append(f"    ... and {len(items) - explained_limit} more")
        checked = ", ".join(f"{name} {self.checked[name]}" for name in INVARIANTS)
        lines.append(f"checked: {self.bodies} bodies; cases per invariant: {checked}")
        if self.fault_kinds:
            lines.append("faults: " + ", ".join(f"{kind} {n}" for kind, n in sorted(self.fault_kinds.items())))
        return "\n".join(lines)


class History:
    """The merged history of one run, indexed for the invariants."""

    def __init__(self, events: list[Event], final: dict[str, Any]) -> None:
        self.events = events
        self.final = final
        self.t0: float = events[0]["t"] if events else 0.0
        self.phases: dict[str, float] = {e["name"]: e["t"] for e in events if e["ev"] == "phase"}
        #: The store apart from the broker: the two-phase gate (no debounce, no followers, no recovery).
        self.two_phase = any(e["ev"] == "phase" and e.get("store") == "apart" for e in events)
        self.end: float = self.phases.get("stopped", events[-1]["t"] if events else 0.0)
        self.faults = [e for e in events if e["ev"] == "fault"]
        #: SIGKILLs of workers and pool children, when they happened (a restart-worker's, seconds after its fault).
        self.worker_kills = [e for e in events if e["ev"] == "kill" and e.get("why") in TRANSIT_KILLS]
        self.wipes = [e["t"] for e in self.faults if e["kind"] == "restart" and e.get("wipe")]
        #: When the server's log says each key's run started (``start: ... -> started``), server time.
        self.server_starts: dict[str, list[float]] = {}
        #: Each wipe's crash and the earliest the server can have been back: it stays down ``seconds``.
        self.wipe_downs = [
            (e["t"], e["t"] + float(e.get("seconds", 0.0)))
            for e in self.faults
            if e["kind"] == "restart" and e.get("wipe")
        ]
        self.deaths: dict[int, list[float]] = defaultdict(list)
        #: Task ids a revoke terminated with SIGKILL: when (the pool kills the body then, or on its ack).
        self.sigkilled: dict[str, float] = {}
        for event in events:
            if event["ev"] in ("kill", "exit", "crash"):
                for pid in event["pids"]:
                    self.deaths[int(pid)].append(event["t"])
            elif event["ev"] == "revoked" and event.get("terminated") and _is_sigkill(event.get("signum")):
                self.sigkilled.setdefault(event["task_id"], event["t"])
        self.bodies = self._bodies()
        self._mark_plain_replacements(events)
        self._mark_retries_rejected(events)
        self._mark_failed_replacements(events)
        self.bodies_by_task: dict[str, list[Body]] = defaultdict(list)
        for body in self.bodies:
            self.bodies_by_task[body.task_id].append(body)
        self.calls = self._calls()
        self.server_history = {
            member: [_entry(raw) for raw in reversed(info.get("history", []))]
            for member, info in final.get("members", {}).items()
        }
        self.decisions: dict[str, list[Event]] = defaultdict(list)
        for event in events:
            if event["ev"] == "decision" and event.get("task_id"):
                self.decisions[event["task_id"]].append(event)
        self.lock_lost_seen = {(e["pid"], e["task_id"]) for e in events if e["ev"] == "lock_lost_seen"}
        self.revoked: dict[str, float] = {}
        #: Deliveries whose ``task_postrun`` ran, by task id: (time, pid, thread or 0 if unrecorded, state).
        self.settled: dict[str, list[tuple[float, int, int, str]]] = defaultdict(list)
        self.finish_failed: set[str] = set()
        for event in events:
            if event["ev"] == "revoked":
                self.revoked.setdefault(event["task_id"], event["t"])
            elif event["ev"] == "settled":
                settled = (event["t"], int(event["pid"]), int(event.get("tid") or 0), str(event.get("state")))
                self.settled[event["task_id"]].append(settled)
            elif event["ev"] == "finish_failed":
                self.finish_failed.add(str(event.get("task_id")))
        self._index_steps(events)
        self.renewer_losses = [e for e in events if e["ev"] == "lock_lost_log"]
        self.slot_losses = [e for e in events if e["ev"] == "slot_lost_log"]
        self._index_chains(events)
        self._index_workers(events)
        failed = {str(e.get("task_id")) for e in events if e["ev"] == "backoff_failed"}
        self.quota = Timeline.of(events, self.wipes, failed)

    def _index_steps(self, events: list[Event]) -> None:
        #: The step events of each step of a run, by (task id, step name), in time order.
        self.steps: dict[tuple[str, str], list[Event]] = defaultdict(list)
        #: The library's "step in doubt ... called again" warnings, by (task id, step name).
        self.doubt_reports: dict[tuple[str, str], list[Event]] = defaultdict(list)
        for event in events:
            if event["ev"] in STEP_EVENTS:
                self.steps[(event["task_id"], event["step"])].append(event)
            elif event["ev"] == "step_doubt_log":
                self.doubt_reports[(str(event.get("task_id")), str(event.get("step")))].append(event)

    def _index_workers(self, events: list[Event]) -> None:
        #: Worker processes by role (``worker-0.3``); a history from before pools were recorded is prefork.
        self.workers: dict[str, Worker] = {}
        for event in events:
            if event["ev"] == "spawn" and str(event.get("slot", "")).startswith("worker-"):
                slot, generation = str(event["slot"]), int(event["generation"])
                late = event.get("acks_late")
                self.workers[f"{slot}.{generation}"] = Worker(
                    slot,
                    generation,
                    str(event.get("pool") or "prefork"),
                    int(slot.rpartition("-")[2]) % 2 == 0 if late is None else bool(late),
                    int(event.get("process") or 0),
                )
        #: When each worker process said it was ready (``worker_ready``), by its pid.
        self.ready: dict[int, float] = {}
        #: Signs that a run's message came back to a worker: (time, pid, what), by task id.
        self.put_back: dict[str, list[tuple[float, int, str]]] = defaultdict(list)
        for event in events:
            if event["ev"] == "worker_ready":
                self.ready.setdefault(int(event["pid"]), event["t"])
            elif event["ev"] in ("recovered", "received") and event.get("task_id"):
                what = "recovered by a worker" if event["ev"] == "recovered" else "taken by a worker"
                self.put_back[str(event["task_id"])].append((event["t"], int(event["pid"]), what))

    def _index_chains(self, events: list[Event]) -> None:
        #: Chained calls whose next step ran, with the result it got (None in a history from before results).
        self.continued: dict[str, str | None] = {}
        #: When each chained call's next step ran.
        self.continued_at: dict[str, float] = {}
        for event in events:
            if event["ev"] == "continued":
                self.continued.setdefault(event["call"], event.get("result"))
                self.continued_at.setdefault(event["call"], event["t"])
        #: Results replacements returned (a body that replaced itself by a plain task): when, in which process.
        self.replacements: dict[str, tuple[float, int]] = {}
        for event in events:
            if event["ev"] == "replacement_ran":
                self.replacements.setdefault(str(event.get("result")), (event["t"], int(event["pid"])))
        self.continuation_sent: dict[str, float] = {}
        for event in events:
            if event["ev"] == "continuation_sent":
                self.continuation_sent.setdefault(event["call"], event["t"])
        #: A chained duplicate's own head id (its follower), by call.
        self.own_heads: dict[str, str] = {e["call"]: e["own"] for e in events if e["ev"] == "call" and e.get("own")}

    # --- building --------------------------------------------------------------------------

    def _bodies(self) -> list[Body]:
        open_bodies: dict[tuple[int, int], Body] = {}
        bodies: list[Body] = []
        for event in self.events:
            if event["ev"] == "body_start":
                pid, tid = event["pid"], int(event.get("tid") or 0)
                previous = open_bodies.pop((pid, tid), None)
                if previous is not None:  # the thread moved on: the previous body ended unrecorded
                    previous.end = min(self._death(pid, previous.start), event["t"])
                    previous.outcome = "unknown"
                body = Body(event["task_id"], event["member"], event["call"], pid, event["role"], event["t"])
                body.tid, body.group, body.limit = tid, str(event.get("group") or ""), int(event.get("limit") or 0)
                if event.get("quota"):
                    body.quota, body.quota_key = str(event["quota"]), str(event.get("quota_key") or "")
                    body.rates, body.granted_at = str(event.get("rates") or ""), int(event.get("granted_at") or 0)
                open_bodies[(pid, tid)] = body
                bodies.append(body)
            elif event["ev"] == "body_end":
                ending = open_bodies.pop((event["pid"], int(event.get("tid") or 0)), None)
                if ending is not None and ending.task_id == event["task_id"]:
                    ending.end = event["t"]
                    ending.outcome = event["outcome"]
                    ending.lock_lost = bool(event.get("lock_lost"))
        for (pid, _), body in open_bodies.items():
            death = self._death(pid, body.start)
            revoked = self.sigkilled.get(body.task_id, death)
            body.end = min(death, revoked) if revoked >= body.start else death
            body.outcome = "killed" if body.end < self.end else "unknown"
        return bodies

    def alive_at(self, pid: int, t: float) -> bool:
        """Whether process ``pid`` was still alive at ``t`` (no death recorded before it)."""
        return not any(death <= t for death in self.deaths.get(pid, []))

    def died_within(self, pid: int, after: float, seconds: float) -> bool:
        return self._death(pid, after) <= after + seconds

    def _mark_plain_replacements(self, events: list[Event]) -> None:
        """A body that replaced itself by a plain task ended its run (``replaced``, the key freed);
        one replaced under the same key handed the run on."""
        plain = {e["call"] for e in events if e["ev"] == "call_start" and e.get("replace") == "plain"}
        for body in self.bodies:
            if body.outcome == "replaced" and body.call in plain:
                body.outcome = REPLACED_BY_PLAIN

    def _mark_failed_replacements(self, events: list[Event]) -> None:
        """A body records ``replaced`` before ``Task.replace`` publishes; when that publish fails, the task
        raises and its own process settles it ``FAILURE``: the run ended failed, nothing replaced it."""
        failures = {
            (e["task_id"], int(e["pid"]), int(e.get("tid") or 0), e["t"])
            for e in events
            if e["ev"] == "settled" and e.get("state") == "FAILURE"
        }
        for body in self.bodies:
            if body.outcome in ("replaced", REPLACED_BY_PLAIN) and any(
                task_id == body.task_id and pid == body.pid and tid in (0, body.tid) and t >= body.end
                for task_id, pid, tid, t in failures
            ):
                body.outcome = "failed"

    def _mark_retries_rejected(self, events: list[Event]) -> None:
        """In a history from before rejects told whether they requeue, a ``Reject`` from a body told to retry
        came from ``Task.retry`` failing to publish the retry: without requeue, an ending (nothing else in the
        workload rejects)."""
        retrying = {e["call"] for e in events if e["ev"] in ("call_start", "call") and e.get("retry")}
        for body in self.bodies:
            if body.outcome == "Reject" and body.call in retrying:
                body.outcome = REJECTED_BY_RETRY

    def _death(self, pid: int, after: float) -> float:
        return min((t for t in self.deaths.get(pid, []) if t >= after), default=self.end)

    def _calls(self) -> list[Call]:
        started: dict[str, Event] = {}
        calls: list[Call] = []
        for index, event in enumerate(self.events):
            if event["ev"] == "call_start":
                started[event["call"]] = event
            elif event["ev"] == "call":
                begin = started.get(event["call"], event)
                calls.append(
                    Call(
                        event["call"],
                        event["member"],
                        event.get("mode", ""),
                        event.get("way", ""),
                        float(event.get("delay") or 0.0),
                        begin["t"],
                        event["t"],
                        event["outcome"],
                        event.get("id", ""),
                        index,
                    )
                )
        return calls

    # --- questions -------------------------------------------------------------------------

    def wiped_between(self, start: float, end: float) -> bool:
        return any(start <= t <= end for t in self.wipes)

    def wiped_after_recording(self, recorded_by: float, end: float) -> bool:
        """Whether a wipe before ``end`` took something recorded at or before ``recorded_by``.

        ``recorded_by`` is a bound (a ``settled`` event comes after the
        ending it follows was written): a wipe that began before it took the
        write too if the server was still down then, as nothing could have
        been written on the server that came back.
        """
        return any(crash <= end and recorded_by <= back for crash, back in self.wipe_downs)

    def entries(self, member: str, task_id: str | None = None) -> list[Entry]:
        entries = self.server_history.get(member, [])
        return [e for e in entries if task_id is None or e.task_id == task_id]

    def lock_loss(self, body: Body) -> str | None:
        """How the library reported that ``body`` lost its lock, or None."""
        if body.lock_lost or (body.pid, body.task_id) in self.lock_lost_seen:
            return "the body saw self.dedup_lock_lost"
        for event in self.decisions.get(body.task_id, []):
            if event["decision"] == "lock_lost" and event["t"] >= body.start:
                return f"lock_lost decision at {self.rel(event['t'])}"
        for event in self.renewer_losses:
            if event["pid"] == body.pid and event["t"] >= body.start and repr(body.member) in event["message"]:
                return f"renewer reported the loss at {self.rel(event['t'])}"
        for entry in self.entries(body.member, body.task_id):
            if entry.t >= body.start - MS and ("lock lost" in entry.note or "forced" in entry.note):
                return f"history: {entry.state} {entry.note!r} at {self.rel(entry.t)}"
        record = self.final.get("members", {}).get(body.member, {}).get("record") or {}
        lost_at = int(record.get("lock_lost_at") or 0) / 1000
        if record.get("task_id") == body.task_id and lost_at >= body.start - MS:
            return f"the record's lock_lost_at {self.rel(lost_at)}"
        return None

    def slot_loss(self, body: Body, until: float) -> str | None:
        """How ``body`` lost its limit slot to a fault before ``until``: the library reported it, and a fault can
        have kept the lease from being renewed; else None."""
        reported = next(
            (
                e
                for e in self.slot_losses
                if e["pid"] == body.pid and e["t"] >= body.start and e.get("group") == body.group
            ),
            None,
        )
        cause = self.loss_cause(body, until) if reported is not None else None
        return None if cause is None or reported is None else f"slot lost at {self.rel(reported['t'])}; {cause}"

    def loss_cause(self, body: Body, until: float) -> str | None:
        """A fault that can have kept ``body`` from renewing its lock between its start and ``until``."""
        slot = body.role.rsplit(".", 1)[0]
        for event in self.events:
            if event["ev"] != "fault" or not body.start - LOCK_TTL <= event["t"] <= until:
                continue
            kind = event["kind"]
            if kind == "stop-worker" and body.pid in event.get("pids", []):
                return f"its worker was SIGSTOPped at {self.rel(event['t'])}"
            if kind == "proxy" and event.get("target") in (slot, "all"):
                return f"proxy {event.get('action')} on its connections at {self.rel(event['t'])}"
            if kind == "restart":
                return f"server restart at {self.rel(event['t'])}"
            if kind == "revoke" and event.get("task_id") == body.task_id:
                return f"revoked at {self.rel(event['t'])}"
            if kind == "operator" and event.get("forced") and event.get("member") == body.member:
                return f"an operator forced a release at {self.rel(event['t'])}"
        return None

    def recorded_end(self, body: Body) -> float | None:
        """When the library recorded how ``body``'s run ended, or None if it never did.

        A body can return and its process die before the guard records the
        ending: the run has not ended then, and runs again (acks_late). The
        evidence, in order: the key's server history; the ``task_postrun`` of
        the body's own process and thread, which runs there after the guard
        recorded the ending (another delivery's says nothing of this body, and
        a deferred or skipped copy settles ``IGNORED``); in a history that
        records them, no such ``task_postrun`` means it was never recorded;
        else the body's own end, unless its process died within a second of
        it or the library said it could not record it.
        """
        entries = self.entries(body.member)
        for entry in entries:
            if entry.task_id == body.task_id and entry.state in ENDED and entry.t >= body.start - MS:
                return entry.t
        own = [
            t
            for t, pid, tid, state in self.settled.get(body.task_id, [])
            if pid == body.pid
            and tid in (0, body.tid)
            and t >= body.end
            and (state != "IGNORED" or body.outcome == REPLACED_BY_PLAIN)
        ]
        if own:
            return min(own)
        if self.settled:
            return None  # its process never settled it: still recording the ending when it died, or stuck
        if entries and entries[0].t <= body.start:
            return None  # the history covers this body and records no ending
        if body.task_id in self.finish_failed or self._death(body.pid, body.end) <= body.end + 1.0:
            return None
        return body.end

    def transit_loss(self, member: str, since: float) -> str | None:
        """Why an ungated (while_executing) run may have vanished unrecorded after ``since``, or None.

        Such a run has no status record before its body starts, so a message
        the transport loses (a worker's fetch whose reply was cut, a worker
        killed holding it) leaves no trace the library could keep.
        """
        if MODE_BY_TASK.get(member.split(":", 1)[0], MODES[0]).gated and not self.two_phase:
            return None  # on the atomic gate the reaper records a lost message; apart, the key waits for its TTL
        fault = self.transit_fault(since)
        if fault is None:
            return None
        return f"its message can have been lost in transit ({fault['kind']} at {self.rel(fault['t'])})"

    def transit_fault(self, since: float, until: float = float("inf")) -> Event | None:
        """The first fault between ``since`` and ``until`` that can lose a message a worker fetched.

        kombu pops a message before it records it as unacknowledged: a worker
        killed in between, or a fetch whose reply a restart or a proxy cut,
        loses it (plain Celery too).
        """
        for event in self.faults:
            if not since <= event["t"] <= until:
                continue
            kind, target = event["kind"], str(event.get("target") or event.get("slot") or "")
            if kind in ("kill-worker", "restart-worker", "kill-child", "restart") or (
                kind == "proxy" and (target == "all" or target.startswith("worker"))
            ):
                return event
        # A fault that began before ``since`` and killed a worker after it (restart-worker stops the old
        # worker only once the new one is ready, and kills it a stop timeout later).
        for event in self.worker_kills:
            if since <= event["t"] <= until:
                return {**event, "kind": event["why"]}
        return None

    def started_at(self, body: Body) -> float:
        """When the server let ``body`` start: its ``started`` history entry, else the server log's start of its
        key just before its event (a busy key's kept history no longer reaches back), else a little before it."""
        entries = [e.t for e in self.entries(body.member, body.task_id) if e.state == "started" and e.t <= body.start]
        logged = [t for t in self.server_starts.get(body.member, ()) if body.start - START_SLACK <= t <= body.start]
        return max(entries or logged, default=body.start - 0.05)

    def fate(self, task_id: str, member: str) -> str | None:
        """How run ``task_id`` ended up: it executed, or an ending was recorded; None if neither."""
        if self.bodies_by_task.get(task_id):
            return "executed"
        for entry in self.entries(member, task_id):
            if entry.state in FATES:
                return f"recorded {entry.state}"
        for event in self.decisions.get(task_id, []):
            if event["decision"] in SETTLING_DECISIONS:
                return f"{event['decision']}: {event['message']}"
        if task_id in self.revoked:
            return "revoked by a worker"
        return None

    def rel(self, t: float) -> str:
        return f"+{t - self.t0:.3f}s"

    def step_done_at(self, task_id: str, step: str, member: str) -> float | None:
        """When step ``step`` of run ``task_id`` was first recorded done, or None.

        The evidence: a ``dedup_once`` that returned (the step is done in the store
        by then), one that raised ``DedupLockLostError`` after recording it, or the
        key's history entry ``<step> done``.
        """
        times = [
            e["t"]
            for e in self.steps.get((task_id, step), [])
            if e["ev"] == "step_exit"
            and (e["outcome"] == "done" or (e["outcome"] == "DedupLockLostError" and e.get("recorded")))
        ]
        times += [e.t for e in self.entries(member, task_id) if e.state == "step" and e.note == f"{step} done"]
        return min(times, default=None)

    def steps_forgotten(self, start: float, end: float) -> str | None:
        """Why the store may have forgotten a run's steps between ``start`` and ``end``, or None.

        Only a wipe: each run keeps its steps apart, so a later run of the key (whatever its mode) drops none.
        """
        if self.wiped_after_recording(start, end):
            return "the server's data was wiped"
        return None

    def doubt_reported(self, call: Event, since: float) -> bool:
        """Whether the library reported the step of ``call`` in doubt before it was called (after ``since``)."""
        key = (call["task_id"], call["step"])
        if any(e["pid"] == call["pid"] and since <= e["t"] <= call["t"] + MS for e in self.doubt_reports.get(key, [])):
            return True
        note = f"{call['step']} in doubt, again"
        return any(
            e.state == "step" and e.note == note and since - MS <= e.t <= call["t"] + MS
            for e in self.entries(call["member"], call["task_id"])
        )

    # --- excerpts --------------------------------------------------------------------------

    def excerpt(self, member: str, task_ids: Iterable[str], start: float, end: float, limit: int = 16) -> list[str]:
        """The events and server history entries about ``member`` or ``task_ids`` around [start, end]."""
        ids = set(task_ids)
        lines: list[tuple[float, str]] = []
        for event in self.events:
            if not start - 1.0 <= event["t"] <= end + 1.0:
                continue
            related = event.get("member") == member or event.get("task_id") in ids or event.get("id") in ids
            if related or event["ev"] in ("fault", "kill"):
                lines.append((event["t"], _describe(event)))
        for entry in self.entries(member):
            if start - 1.0 <= entry.t <= end + 1.0 or entry.task_id in ids:
                lines.append((entry.t, f"server       {entry.state} {entry.task_id} {entry.note}".rstrip()))
        lines.sort(key=lambda item: item[0])
        if len(lines) > limit:
            lines = [*lines[: limit // 2], (0.0, "..."), *lines[-limit // 2 :]]
        return [text if text == "..." else f"{self.rel(t):>10} {text}" for t, text in lines]


def library_involved(crash: Event) -> bool:
    """Whether a worker's crash involves celery-dedup: its code in the traceback, or one of its exceptions."""
    text = f"{crash.get('log', '')}\n{crash.get('trace', '')}"
    return "celery_dedup" in text or "Dedup" in text


def _is_sigkill(signum: Any) -> bool:
    return str(signum) in ("9", "SIGKILL", "Signals.SIGKILL")


def passed_on(note: str) -> bool:
    """Whether a history note says the run's record went to the next call of its key (one of its "; " parts)."""
    return any(part.strip() in PASSED_ON for part in note.split(";"))


def over_window(starts: list[int], at: int, rates: str) -> tuple[int, int, int] | None:
    """The longest of ``rates``'s windows a start at ``at`` breaks: ``(count, period ms, starts in it)``; None: none.

    ``starts``: every start of the group key (ms, sorted). A window of P counts the starts in (at - P, at], as
    the script's ``ZCOUNT`` does.
    """
    broken = [
        (count, period, seen)
        for count, period in windows(rates)
        for seen in [bisect.bisect_right(starts, at) - bisect.bisect_right(starts, at - period)]
        if seen > count
    ]
    return max(broken, key=lambda item: item[1]) if broken else None


def _entry(raw: str) -> Entry:
    parts = raw.split(" ", 3)
    return Entry(int(parts[0]) / 1000, parts[1], parts[2] if len(parts) > 2 else "", parts[3] if len(parts) > 3 else "")


def _describe(event: Event) -> str:
    keys = (
        *("kind", "action", "decision", "task_id", "call", "step", "outcome", "id", "member", "pids", "pid", "key"),
        *("value", "message"),
    )
    shown = []
    for key in keys:
        value = event.get(key)
        if value in (None, "") or (key == "pid"):
            continue
        if key == "message":
            value = str(value)[:120]
        shown.append(f"{key}={value}")
    return f"{event['role']:<13} {event['ev']:<14} " + " ".join(shown) + f" (pid {event['pid']})"


# --- the invariants ------------------------------------------------------------------------


class Checker:
    """Runs every invariant over one :class:`History`."""

    def __init__(self, history: History) -> None:
        self.h = history
        self.violations: list[Violation] = []
        self.explained: list[Explained] = []
        self.checked: Counter[str] = Counter()

    def violation(
        self, invariant: str, member: str, message: str, *, t: float, ids: tuple[str, ...], until: float = 0.0
    ) -> None:
        excerpt = self.h.excerpt(member, ids, t, max(until, t))
        self.violations.append(Violation(invariant, member, message, t, ids, excerpt))

    def run(self) -> None:
        self.crashes()
        self.overlap()
        self.again_after_end()
        self.unresolved()
        self.stuck_keys()
        self.double_accept()
        self.windows()
        self.debounce_args()
        self.continuations()
        self.limits()
        self.recovery()
        self.steps()

    def crashes(self) -> None:
        workers = {e["slot"] for e in self.h.events if e["ev"] == "spawn" and e["slot"].startswith("worker")}
        self.checked["crash"] += len(workers)
        for event in self.h.events:
            if event["ev"] != "crash":
                continue
            message = f"{event['slot']} exited on its own (status {event.get('status')}): {event.get('log') or '?'}"
            if library_involved(event):
                self.violation("crash", event["slot"], message, t=event["t"], ids=())
            else:
                self.explained.append(
                    Explained("crash", event["slot"], f"{message} (no celery_dedup in its traceback)")
                )

    # --- bodies ----------------------------------------------------------------------------

    def overlap(self) -> None:
        by_member: dict[str, list[Body]] = defaultdict(list)
        for body in self.h.bodies:
            by_member[body.member].append(body)
        for member, bodies in by_member.items():
            bodies.sort(key=lambda body: body.start)
            self.checked["overlap"] += len(bodies)
            for i, first in enumerate(bodies):
                for second in bodies[i + 1 :]:
                    if second.start >= first.end:
                        break
                    self._judge_overlap(member, first, second)

    def _judge_overlap(self, member: str, first: Body, second: Body) -> None:
        h = self.h
        what = (
            f"{first.task_id} (pid {first.pid}, {h.rel(first.start)}..{h.rel(first.end)}, {first.outcome}) "
            f"and {second.task_id} (pid {second.pid}, from {h.rel(second.start)}) ran at once"
        )
        ids, until = (first.task_id, second.task_id), min(first.end, h.end)
        loss = h.lock_loss(first)
        if loss is None:
            message = f"{what}; the first never reported losing its lock"
            self.violation("overlap", member, message, t=second.start, ids=ids, until=until)
            return
        cause = h.loss_cause(first, second.start)
        if cause is None:
            message = f"{what}; the first lost its lock ({loss}) but no fault can account for it: a live lock was taken"
            self.violation("overlap", member, message, t=second.start, ids=ids, until=until)
            return
        self.explained.append(Explained("overlap", member, f"{what}: {loss}; {cause}"))

    def again_after_end(self) -> None:
        for task_id, unordered in self.h.bodies_by_task.items():
            bodies = sorted(unordered, key=lambda body: body.start)
            for i, ended in enumerate(bodies):
                if ended.outcome in NOT_FINAL:
                    continue
                self.checked["again-after-end"] += 1
                at = self.h.recorded_end(ended)
                if at is None:
                    continue  # the ending was never recorded: the run had not ended
                later = next(
                    (b for b in bodies[i + 1 :] if b.start >= at and not self.h.wiped_after_recording(at, b.start)),
                    None,
                )
                if later is not None:
                    message = (
                        f"run {task_id} {ended.outcome} at {self.h.rel(ended.end)} (pid {ended.pid}, recorded "
                        f"{self.h.rel(at)}) and executed again at {self.h.rel(later.start)} (pid {later.pid})"
                    )
                    self.violation(
                        "again-after-end", ended.member, message, t=ended.start, ids=(task_id,), until=later.start
                    )
                    break

    # --- runs ------------------------------------------------------------------------------

    def unresolved(self) -> None:
        accepted: dict[str, tuple[str, float]] = {}
        handed: dict[str, tuple[str, float]] = {}
        for call in self.h.calls:
            if call.task_id:
                target = accepted if call.outcome == "accepted" else handed
                target.setdefault(call.task_id, (call.member, call.t))
        for member, entries in self.h.server_history.items():
            for entry in entries:
                if entry.state in ("queued", "pending"):
                    accepted.setdefault(entry.task_id, (member, entry.t))
        for invariant, runs in (("unresolved-run", accepted), ("unresolved-duplicate", handed)):
            what = "accepted" if invariant == "unresolved-run" else "handed to a duplicate caller"
            for task_id, (member, t) in runs.items():
                self.checked[invariant] += 1
                if self.h.fate(task_id, member) is not None:
                    continue
                if self.h.wiped_between(t - 1.0, self.h.end):
                    self.explained.append(Explained("wiped", member, f"run {task_id} vanished with the server's data"))
                    continue
                cause = self.h.transit_loss(member, t)
                if cause is not None:
                    self.explained.append(Explained("transit", member, f"run {task_id}: {cause}"))
                    continue
                record = self.h.final.get("members", {}).get(member, {}).get("record") or {}
                now = f"the record is {record.get('state')} for {record.get('task_id')}" if record else "no record"
                message = f"run {task_id} ({what} at {self.h.rel(t)}) never executed and no ending was recorded ({now})"
                self.violation(invariant, member, message, t=t, ids=(task_id,))
        self.backed_off()

    def backed_off(self) -> None:
        """A run whose last body backed off comes back: it runs again, or an ending is recorded after it."""
        h = self.h
        for task_id, bodies in h.bodies_by_task.items():
            last = max(bodies, key=lambda body: body.start)
            if last.outcome != BACKOFF:
                continue
            self.checked["unresolved-run"] += 1
            if any(e.state in FATES and e.t >= last.end - MS for e in h.entries(last.member, task_id)):
                continue
            # A skip logged while the body ran is its back-off's: a newer run had taken its key (and does its work).
            if any(e["decision"] in SETTLING_DECISIONS and e["t"] >= last.start for e in h.decisions.get(task_id, [])):
                continue
            if task_id in h.revoked:
                continue
            if h.wiped_between(last.end, h.end):
                self.explained.append(
                    Explained(
                        "wiped",
                        last.member,
                        f"run {task_id} backed off, then its message vanished with the server's data",
                    )
                )
                continue
            message = f"run {task_id} backed off at {h.rel(last.end)} and never came back, nor was an ending recorded"
            self.violation("unresolved-run", last.member, message, t=last.end, ids=(task_id,))

    def stuck_keys(self) -> None:
        final = self.h.final
        if not final:
            return
        server_now = final["server_ms"] / 1000
        stopped = self.h.phases.get("producers_stopped", self.h.end)
        longest = max(spec.hold for spec in MODE_BY_TASK.values()) + MAX_DELAY + LOCK_TTL
        live = set(final.get("queued_ids", [])) | set(final.get("due_members", []))
        for member, info in final.get("members", {}).items():
            if not info.get("held"):
                continue
            self.checked["stuck-key"] += 1
            record = info.get("record") or {}
            held_until = int(record.get("held_until") or 0) / 1000
            if not record or held_until <= server_now:
                continue  # a stale member: the gate takes it over, the reaper removes it
            if info.get("lock") or record.get("task_id") in live or member in live:
                continue
            if held_until > stopped + longest:
                message = (
                    f"held until {self.h.rel(held_until)} by {record.get('task_id')} ({record.get('state')}) "
                    f"with no live run, past the longest hold ({longest:.0f}s after the producers stopped)"
                )
                self.violation("stuck-key", member, message, t=server_now, ids=(record.get("task_id", ""),))

    # --- keys: one run at a time, one per window --------------------------------------------

    def _accepted_pairs(self, modes: set[str]) -> Iterable[tuple[Call, Call, ModeSpec]]:
        """Consecutive accepted runs of each key of these modes, where the second surely came second."""
        by_member: dict[str, list[Call]] = defaultdict(list)
        for call in self.h.calls:
            if call.outcome == "accepted" and call.mode in modes and call.task_id:
                by_member[call.member].append(call)
        for calls in by_member.values():
            calls.sort(key=lambda call: call.t0)
            runs: list[Call] = []
            for call in calls:
                if not runs or runs[-1].task_id != call.task_id:
                    runs.append(call)
            for first, second in pairwise(runs):
                if second.t0 >= first.t:  # else they raced: either could have reached the server first
                    yield first, second, MODE_BY_TASK[f"chaos.{first.mode}"]

    def double_accept(self) -> None:
        for first, second, spec in self._accepted_pairs({"until_executed", "until_executing"}):
            self.checked["double-accept"] += 1
            if freed(self.h, first, spec, second.t) is None:
                message = (
                    f"run {second.task_id} accepted at {self.h.rel(second.t)} while run {first.task_id} "
                    f"(accepted at {self.h.rel(first.t)}) still held the key"
                )
                self.violation("double-accept", first.member, message, t=second.t, ids=(first.task_id, second.task_id))

    def windows(self) -> None:
        for first, second, spec in self._accepted_pairs({"throttle", "until_expired"}):
            self.checked["window"] += 1
            if second.t >= first.t0 + spec.hold + first.delay or freed(self.h, first, spec, second.t) is not None:
                continue
            message = (
                f"run {second.task_id} accepted at {self.h.rel(second.t)} inside the window of run "
                f"{first.task_id} (accepted at {self.h.rel(first.t0)}, window {spec.hold + first.delay:.1f}s)"
            )
            self.violation("window", first.member, message, t=second.t, ids=(first.task_id, second.task_id))

    def debounce_args(self) -> None:
        bursts: dict[str, list[Call]] = defaultdict(list)
        for call in self.h.calls:
            if call.mode == "debounce" and call.task_id and call.outcome in ("accepted", "collapsed"):
                bursts[call.task_id].append(call)
        known_calls = {call.call for call in self.h.calls}
        for task_id, bodies in self.h.bodies_by_task.items():
            burst = bursts.get(task_id)
            for body in bodies if burst else ():
                self.checked["debounce-args"] += 1
                ran = next((call for call in burst or () if call.call == body.call), None)
                if ran is None:
                    requeued = any(call.way == "requeue" for call in burst or ())
                    if requeued or body.call not in known_calls:
                        continue  # a re-enqueued run's kept arguments; a call whose producer died mid-publish
                    message = f"run {task_id} executed with call {body.call}, which is not in its burst"
                    self.violation("debounce-args", body.member, message, t=body.start, ids=(task_id,))
                    continue
                # Calls the server surely ran after the one that ran, and before this body's start.lua.
                started = self.h.started_at(body)
                later = [c for c in burst or () if c.t0 > ran.t or (c.t0 == ran.t0 and c.seq > ran.seq)]
                later = [c for c in later if c.t < started - MS]
                # A wipe after a call was sent took the arguments it left in the record: the message ran with its own.
                kept = [c for c in later if not self.h.wiped_between(c.t0, started)]
                if later and not kept:
                    message = (
                        f"run {task_id} executed with call {ran.call}: the server's data was wiped after call "
                        f"{later[-1].call} of its burst was sent ({self.h.rel(later[-1].t0)}) and before it started"
                    )
                    self.explained.append(Explained("wiped", body.member, message))
                elif kept:
                    message = (
                        f"run {task_id} executed with call {ran.call} (returned {self.h.rel(ran.t)}), but call "
                        f"{kept[-1].call} of its burst was sent after that, at {self.h.rel(kept[-1].t0)}"
                    )
                    self.violation("debounce-args", body.member, message, t=body.start, ids=(task_id,))

    def continuations(self) -> None:
        for call in self.h.calls:
            if call.way != "chain" or not call.task_id or call.outcome not in ("accepted", "duplicate", "collapsed"):
                continue
            if self.h.two_phase and call.outcome != "accepted":
                continue  # with the store apart a duplicate is answered as such: it follows nothing
            resolved = self._succeeded(call)
            if resolved is None:
                continue  # the run did not succeed: its chain stops there
            self.checked["continuation"] += 1
            if call.call in self.h.continued:
                self._judge_result(call)
                continue
            if self.h.wiped_between(call.t0 - 1.0, self.h.end):
                wiped = f"chain {call.call}: the server's data was wiped"
                self.explained.append(Explained("wiped", call.member, wiped))
                continue
            sent = self.h.continuation_sent.get(call.call)
            at, pid = resolved
            cause = None
            if sent is None and pid is not None and self.h.died_within(pid, at, SEND_WINDOW):
                cause = f"pid {pid} resolved its head at {self.h.rel(at)} and was killed before sending the next step"
            elif sent is not None:
                fault = self.h.transit_fault(sent, sent + TRANSIT_WINDOW)
                if fault is not None:
                    cause = f"the next step, sent at {self.h.rel(sent)}, can have gone with {fault['kind']} at "
                    cause += self.h.rel(fault["t"])
            if cause is not None:
                self.explained.append(Explained("continuation", call.member, f"chain {call.call}: {cause}"))
                continue
            state = "sent at " + self.h.rel(sent) if sent is not None else "never sent"
            message = (
                f"chain {call.call} ({call.outcome} as run {call.task_id} at {self.h.rel(call.t)}): the run resolved "
                f"at {self.h.rel(at)} (it succeeded, or its replacement ran), and the next step never ran ({state})"
            )
            self.violation("continuation", call.member, message, t=call.t, ids=(call.task_id,), until=at)

    # --- limit groups ------------------------------------------------------------------------

    def limits(self) -> None:
        """Never more than N bodies of a limit group at once (N: the concurrency in force as the newest started)."""
        by_group: dict[str, list[Body]] = defaultdict(list)
        for body in self.h.bodies:
            if body.limit or body.quota:
                by_group[body.group].append(body)
        for group, bodies in by_group.items():
            bodies.sort(key=lambda body: body.start)
            self.checked["limit"] += len(bodies)
            running: list[Body] = []
            for body in bodies:
                running = [other for other in running if other.end > body.start]
                running.append(body)
                limit = self._concurrency(body)
                if limit is not None and len(running) > limit:
                    self._judge_limit(group, body, running[:-1], limit)
        self.limit_windows(by_group)
        self.limit_pauses()

    def _configs(self, body: Body) -> list[Config]:
        declared = Config(body.limit or None, body.rates)
        return self.h.quota.configs(body.quota, body.quota_key, declared, body.granted_at)

    def _concurrency(self, body: Body) -> int | None:
        """The most bodies ``body``'s group allowed as it was granted (None: no concurrency limit)."""
        if not body.quota or not body.granted_at:
            return body.limit or None
        values = [config.concurrency for config in self._configs(body)]
        return None if None in values else max(value for value in values if value is not None)

    def limit_windows(self, by_group: dict[str, list[Body]]) -> None:
        """A named group's key never starts more bodies in a window than the window allows."""
        h = self.h
        for group, bodies in by_group.items():
            granted = sorted((body for body in bodies if body.quota and body.granted_at), key=lambda b: b.granted_at)
            starts = [body.granted_at for body in granted]
            reported_until = 0
            for body in granted:
                self.checked["limit-window"] += 1
                at = body.granted_at
                broken = [over_window(starts, at, config.rates) for config in self._configs(body)]
                if not broken or None in broken or at <= reported_until:
                    continue  # some values it may have been granted under allowed it (or it is reported)
                count, period, seen = max((item for item in broken if item is not None), key=lambda item: item[0])
                what = f"{seen} starts within {period} ms where window {count}/{period} allows {count}"
                if h.quota.wiped_between(at - period, at):
                    self.explained.append(Explained("limit", group, f"{what}: the server's data was wiped"))
                    continue
                reported_until = at + period
                within = [b for b in granted if at - period < b.granted_at <= at]
                ids = tuple(b.task_id for b in within[-8:])
                message = f"{what}, the last granted at {h.rel(at / 1000)}: {', '.join(ids)}"
                excerpt = self._group_excerpt(group, ids, within[0].start, body.start)
                self.violations.append(Violation("limit-window", group, message, body.start, ids, excerpt))

    def limit_pauses(self) -> None:
        """No body of a named group's key is granted while the key (or the group) is certainly paused."""
        h = self.h
        for body in h.bodies:
            if not body.quota or not body.granted_at:
                continue
            self.checked["limit-pause"] += 1
            pause = h.quota.pause_at(body.quota, body.quota_key, body.granted_at)
            what = f"{body.task_id} granted at {h.rel(body.granted_at / 1000)}"
            if pause is None:
                wiped = h.quota.pause_wiped(body.quota, body.quota_key, body.granted_at)
                if wiped is not None:
                    message = f"{what} in {wiped.what}: the server's data was wiped"
                    self.explained.append(Explained("limit", body.group, message))
                continue
            since = h.rel(pause.set_by / 1000)
            message = f"{what}, while {pause.what} (written by {since}) paused it"
            excerpt = self._group_excerpt(body.group, (body.task_id, pause.task_id), pause.set_from / 1000, body.start)
            self.violations.append(Violation("limit-pause", body.group, message, body.start, (body.task_id,), excerpt))

    def _judge_limit(self, group: str, newest: Body, others: list[Body], limit: int) -> None:
        h = self.h
        what = (
            ", ".join(f"{b.task_id} (pid {b.pid}, {h.rel(b.start)}..{h.rel(b.end)}, {b.outcome})" for b in others)
            + f" and {newest.task_id} (pid {newest.pid}, from {h.rel(newest.start)})"
        )
        causes = [(b, h.slot_loss(b, newest.start)) for b in others]
        explained = [(b, cause) for b, cause in causes if cause is not None]
        if len(others) + 1 - len(explained) <= limit:
            reasons = "; ".join(f"{b.task_id}: {cause}" for b, cause in explained)
            self.explained.append(Explained("limit", group, f"{len(others) + 1} bodies at once ({what}): {reasons}"))
            return
        message = f"{len(others) + 1} bodies of a group of limit {limit} ran at once: {what}"
        ids = tuple(b.task_id for b in [*others, newest])
        until = min(*(b.end for b in others), h.end)
        self.violations.append(
            Violation("limit", group, message, newest.start, ids, self._group_excerpt(group, ids, newest.start, until))
        )

    def _group_excerpt(self, group: str, ids: tuple[str, ...], start: float, end: float, limit: int = 16) -> list[str]:
        """The bodies of ``group``, the events of runs ``ids`` and the faults around [start, end]."""
        lines = [
            f"{self.h.rel(e['t']):>10} {_describe(e)}"
            for e in self.h.events
            if start - 1.0 <= e["t"] <= end + 1.0
            and (e.get("group") == group or e.get("task_id") in ids or e["ev"] in ("fault", "kill"))
        ]
        return lines if len(lines) <= limit else [*lines[: limit // 2], "...", *lines[-limit // 2 :]]

    # --- crash recovery on this machine -------------------------------------------------------

    def recovery(self) -> None:
        """A run killed with its whole worker (acks_late, lock live) is put back before its lock expires."""
        h = self.h
        for event in h.events:
            if event["ev"] != "kill" or event.get("why") not in WHOLE_WORKER_KILLS:
                continue
            killed_at, pids = event["t"], {int(pid) for pid in event["pids"]}
            for body in h.bodies:
                if body.pid in pids and body.outcome == "killed" and abs(body.end - killed_at) < 1e-6:
                    self._judge_recovery(body, killed_at, pids)

    def _judge_recovery(self, body: Body, killed_at: float, pids: set[int]) -> None:
        h = self.h
        worker = h.workers.get(body.role)
        if h.two_phase or worker is None or not worker.acks_late:  # recovery needs the store on the broker
            return  # acknowledged at its start: nothing to put back, the run is recorded lost
        deadline = killed_at + RECOVERY_BOUND
        delivered = max(
            (t for t, pid, _ in h.put_back.get(body.task_id, []) if pid in pids and t <= body.start), default=body.start
        )
        if delivered + VISIBILITY_TIMEOUT < deadline:
            return  # the visibility timeout can bring it back first, and then there is nothing to restore
        if h.lock_loss(body) or h.loss_cause(body, deadline) or self._recovery_hindrance(body, killed_at, deadline):
            return
        if any(passed_on(e.note) for e in h.entries(body.member, body.task_id) if e.t <= deadline):
            return  # its record went to the next run of its key: recovery finds runs by their records
        if self._passed_on_by_a_call(body, deadline):
            return
        stopping = {
            int(pid)
            for e in h.faults
            if e["kind"] == "restart-worker" and killed_at - 30.0 <= e["t"] <= deadline
            for pid in e.get("pids", [])
        }
        if not any(
            t < killed_at and h.alive_at(pid, deadline)
            for pid, t in h.ready.items()
            if pid not in pids and pid not in stopping
        ):
            return  # no other worker was ready throughout: the next one's start-up pass restores it
        self.checked["recovery"] += 1
        signs = [(t, what) for t, pid, what in h.put_back.get(body.task_id, []) if t >= killed_at and pid not in pids]
        signs += [(b.start, "executed again") for b in h.bodies_by_task.get(body.task_id, []) if b.start >= killed_at]
        signs += [
            (e.t, f"history: {e.state} {e.note}")
            for e in h.entries(body.member, body.task_id)
            if e.t >= killed_at and (e.state == "started" or "taken over" in e.note)
        ]
        first = min(signs, default=None)
        if first is not None and first[0] <= deadline:
            return
        later = f"the first sign of it came at {h.rel(first[0])} ({first[1]})" if first else "it never came back"
        message = (
            f"run {body.task_id} died with its worker {worker.slot}.{worker.generation} ({worker.pool}, acks_late; "
            f"SIGKILL at {h.rel(killed_at)}, body from {h.rel(body.start)}, its lock live) and was not put back "
            f"within {RECOVERY_BOUND:.0f}s, before its lock expired: {later}"
        )
        self.violation("recovery", body.member, message, t=killed_at, ids=(body.task_id,), until=deadline)

    def _passed_on_by_a_call(self, body: Body, deadline: float) -> bool:
        """Whether a call passed ``body``'s record on, where the key's kept history no longer reaches back to it.

        A busy key's history keeps its last entries only. A call accepted as another run after the body
        started, in a mode that frees the key as a body starts, passed the record on then.
        """
        h = self.h
        kept = h.entries(body.member)
        if kept and kept[0].t <= body.start:
            return False  # the history covers the body: its own entries say whether the record passed on
        return any(
            call.member == body.member
            and call.mode in PASSED_ON_AT_START
            and call.outcome == "accepted"
            and call.task_id not in ("", body.task_id)
            and body.start <= call.t0
            and call.t <= deadline
            for call in h.calls
        )

    def _recovery_hindrance(self, body: Body, start: float, end: float) -> Event | None:
        """A fault between ``start`` and ``end`` that can have kept ``body``'s run from being put back."""
        for event in self.h.faults:
            if not start < event["t"] <= end or event["kind"] not in RECOVERY_HINDRANCES:
                continue
            if event["kind"] == "revoke" and event.get("task_id") != body.task_id:
                continue
            if event["kind"] == "operator" and event.get("member") not in (None, body.member):
                continue
            return event
        return None

    # --- steps (dedup_once) ------------------------------------------------------------------

    def steps(self) -> None:
        """Each step of each run: done is done, a doubt is reported, the key stays."""
        for (task_id, step), events in self.h.steps.items():
            member = events[0]["member"]
            calls = [e for e in events if e["ev"] == "step_call"]
            done_at = self.h.step_done_at(task_id, step, member)
            self._step_key(task_id, step, member, calls)
            self._step_once(task_id, step, member, events, calls, done_at)
            self._step_doubt(task_id, step, member, events, calls, done_at)

    def _step_key(self, task_id: str, step: str, member: str, calls: list[Event]) -> None:
        if not calls:
            return
        self.checked["step-key"] += 1
        keys = sorted({str(call["key"]) for call in calls})
        if len(keys) > 1:
            where = ", ".join(f"{call['key']!r} (pid {call['pid']}, {self.h.rel(call['t'])})" for call in calls)
            message = f"step {step} of run {task_id} was called with {len(keys)} idempotency keys: {where}"
            self.violation("step-key", member, message, t=calls[0]["t"], ids=(task_id,), until=calls[-1]["t"])

    def _step_once(
        self, task_id: str, step: str, member: str, events: list[Event], calls: list[Event], done_at: float | None
    ) -> None:
        h = self.h
        for call in calls:
            self.checked["step-once"] += 1
            if done_at is None or call["t"] <= done_at:
                continue
            what = (
                f"step {step} of run {task_id} was recorded done at {h.rel(done_at)} and executed again at "
                f"{h.rel(call['t'])} (pid {call['pid']})"
            )
            why = h.steps_forgotten(done_at, call["t"])
            if why is not None:
                self.explained.append(Explained("wiped", member, f"{what}: {why}"))
                continue
            self.violation("step-once", member, what, t=done_at, ids=(task_id,), until=call["t"])
        for skip in (e for e in events if e["ev"] == "step_exit" and e["outcome"] == "done" and not e.get("called")):
            self.checked["step-once"] += 1
            returned = {e.get("value") for e in events if e["ev"] == "step_return" and e["t"] <= skip["t"]}
            if skip.get("value") in returned:
                continue
            message = (
                f"a delivery of run {task_id} (pid {skip['pid']}) skipped step {step} at {h.rel(skip['t'])} as done "
                f"and got {skip.get('value')!r}, which no completed call of it returned "
                f"(calls returned {sorted(map(str, returned))})"
            )
            self.violation("step-once", member, message, t=skip["t"], ids=(task_id,))

    def _step_doubt(
        self, task_id: str, step: str, member: str, events: list[Event], calls: list[Event], done_at: float | None
    ) -> None:
        h = self.h
        for earlier, call in pairwise(calls):
            if done_at is not None and done_at < call["t"]:
                continue  # a call after the step was done: step-once's
            self.checked["step-doubt"] += 1
            ending = next(
                (
                    e
                    for e in events
                    if e["ev"] == "step_exit"
                    and e["pid"] == earlier["pid"]
                    and e.get("tid", 0) == earlier.get("tid", 0)
                    and e["t"] >= earlier["t"]
                ),
                None,
            )
            error = str(ending.get("fn_error") or "") if ending is not None else ""
            if error and error not in INTERRUPTIONS:
                continue  # its function raised: the step was recorded failed, and is tried again
            what = (
                f"step {step} of run {task_id} was called again at {h.rel(call['t'])} (pid {call['pid']}) after a call "
                f"at {h.rel(earlier['t'])} (pid {earlier['pid']}) that did not end"
            )
            why = h.steps_forgotten(earlier["t"], call["t"])
            if why is not None:
                self.explained.append(Explained("wiped", member, f"{what}: {why}"))
                continue
            if call.get("on_doubt") == "raise":
                message = f"{what}, with on_doubt='raise': it had to raise DedupStepInDoubt"
                self.violation("step-doubt", member, message, t=earlier["t"], ids=(task_id,), until=call["t"])
            elif not h.doubt_reported(call, earlier["t"]):
                message = f"{what}, and nothing reported it in doubt"
                self.violation("step-doubt", member, message, t=earlier["t"], ids=(task_id,), until=call["t"])
        for raised in (e for e in events if e["ev"] == "step_exit" and e["outcome"] == "DedupStepInDoubt"):
            self.checked["step-doubt"] += 1
            began = any(call["t"] < raised["t"] for call in calls)
            if began and (done_at is None or done_at > raised["t"]):
                continue
            state = f"was done at {h.rel(done_at)}" if done_at is not None and began else "never began"
            message = (
                f"a delivery of run {task_id} (pid {raised['pid']}) raised DedupStepInDoubt for step {step} at "
                f"{h.rel(raised['t'])}, which {state}"
            )
            self.violation("step-doubt", member, message, t=raised["t"], ids=(task_id,))

    def _judge_result(self, call: Call) -> None:
        """A chain goes on with its run's result (or its replacement's): the call whose arguments a body of it ran."""
        result = self.h.continued.get(call.call)
        ran = {body.call for body in self.h.bodies_by_task.get(call.task_id, [])}
        if result is None or result in ran:
            return
        if self.h.wiped_between(call.t0 - 1.0, self.h.continued_at[call.call]):
            # Its parked entry and its run's outcome went with the data: its redelivery is a call of its own again.
            wiped = f"chain {call.call} went on with {result!r}: the server's data was wiped before"
            self.explained.append(Explained("wiped", call.member, wiped))
            return
        message = (
            f"chain {call.call} ({call.outcome} as run {call.task_id} at {self.h.rel(call.t)}) went on with "
            f"{result!r}, which is not the result of its run or of its replacement (its bodies ran {sorted(ran)})"
        )
        self.violation("continuation", call.member, message, t=call.t, ids=(call.task_id,))

    def _first_ending(self, call: Call) -> str | None:
        """The first ending the server recorded for the run ``call`` followed, or None.

        Not for a run that replaced itself: a loss around its replacement's publish
        waits for the replacement.
        """
        if any(body.outcome.startswith("replaced") for body in self.h.bodies_by_task.get(call.task_id, [])):
            return None
        endings = sorted((e.t, e.state) for e in self.h.entries(call.member, call.task_id) if e.state in FATES)
        return endings[0][1] if endings else None

    def _replaced(self, task_id: str) -> tuple[float, int] | None:
        """When and where the plain task that ended run ``task_id`` (``replaced``) returned its result, or None."""
        for body in self.h.bodies_by_task.get(task_id, []):
            if body.outcome == REPLACED_BY_PLAIN and body.call in self.h.replacements:
                return self.h.replacements[body.call]
        return None

    def _succeeded(self, call: Call) -> tuple[float, int | None] | None:
        """When (and in which process) the chained call's head resolved with its result, or None.

        A run resolves with its result when it succeeds, or when it replaced
        itself by a plain task that then ran: that task's result is the run's.
        """
        task_id = call.task_id
        replaced = self._replaced(task_id)
        if call.outcome == "accepted":
            for body in self.h.bodies_by_task.get(task_id, []):
                if body.outcome == "succeeded" and self.h.recorded_end(body) is not None:
                    return body.end, body.pid
            return replaced
        succeeded = any(e.task_id == task_id and e.state == "succeeded" for e in self.h.entries(call.member)) or any(
            b.outcome == "succeeded" and self.h.recorded_end(b) is not None
            for b in self.h.bodies_by_task.get(task_id, [])
        )
        if not succeeded and replaced is None:
            return None
        if replaced is None and self._first_ending(call) not in (None, "succeeded"):
            return None  # its followers got the first ending settled for it (a run declared lost that finished after)
        own = self.h.own_heads.get(call.call, "")
        for event in self.h.decisions.get(own, []):
            if event["decision"] == "followed":
                return event["t"], int(event["pid"])
        return self.h.end, None


def freed(h: History, first: Call, spec: ModeSpec, before: float) -> str | None:
    """Why run ``first`` no longer held its key at ``before``, or None.

    throttle and until_expired keep the key after success (to the end of the
    window); the other gated modes drop it at the run's ending, until_executing
    and debounce already when the body starts; any mode drops it when the run
    fails, dies or is released.
    """
    if first.t0 + spec.hold + first.delay < before:
        return "its hold ran out"
    if h.wiped_between(first.t0, before):
        return "the server's data was wiped"
    return (
        _freed_by_server(h, first, spec, before)
        or _freed_by_bodies(h, first, spec, before)
        or _freed_by_events(h, first, before)
    )


def _freed_by_server(h: History, first: Call, spec: ModeSpec, before: float) -> str | None:
    for entry in h.entries(first.member, first.task_id):
        if entry.t > before + MS:
            continue
        if entry.state in FATES and not (spec.holds_after_success and entry.state == "succeeded"):
            return f"it ended {entry.state}"
        if spec.releases_at_start and entry.state == "started":
            return "it started"
    return None


def _freed_by_bodies(h: History, first: Call, spec: ModeSpec, before: float) -> str | None:
    for body in h.bodies_by_task.get(first.task_id, []):
        if spec.releases_at_start and h.started_at(body) <= before:
            return "it started"  # the key went as the server let it start, a little before its event
        if body.start <= before and not spec.holds_after_success and h.lock_loss(body) and h.loss_cause(body, before):
            return "its body lost its lock to a fault"
        if body.end > before:
            continue
        ending = body.outcome not in NOT_FINAL and not (spec.holds_after_success and body.outcome == "succeeded")
        if ending or body.outcome == "killed":
            return f"its body ended {body.outcome}"
    return None


def _freed_by_events(h: History, first: Call, before: float) -> str | None:
    for event in h.decisions.get(first.task_id, []):
        if event["t"] <= before and event["decision"] in SETTLING_DECISIONS:
            return str(event["decision"])
    if h.revoked.get(first.task_id, before + 1) <= before:
        return "a worker revoked it"
    for event in h.faults:
        if (
            event["kind"] == "operator"
            and event.get("action") == "release"
            and event.get("member") == first.member
            and first.t0 <= event["t"] <= before
        ):
            return "an operator released it"
    return None


def check(run_dir: Path | str, seed: int | None = None) -> Report:
    """Check the run kept in ``run_dir``."""
    run_dir = Path(run_dir)
    events = read_events(run_dir)
    final_path = run_dir / "final.json"
    final = json.loads(final_path.read_text()) if final_path.exists() else {}
    history = History(events, final)
    history.server_starts = server_starts(run_dir)
    checker = Checker(history)
    checker.run()
    if seed is None:
        seed = next((e.get("seed") for e in events if e["ev"] == "phase" and e["name"] == "started"), None)
    ops = sum(1 for e in events if e["ev"] == "call")
    kinds = Counter(e["kind"] for e in history.faults)
    transitions(run_dir, checker)
    checker.violations.sort(key=lambda v: v.t)
    return Report(
        ops=ops,
        faults=len(history.faults),
        violations=checker.violations,
        explained=checker.explained,
        checked=checker.checked,
        fault_kinds=kinds,
        bodies=len(history.bodies),
        seed=seed,
    )


#: A transition the server logged, with the server's time: ``<pid>:M 27 Nov 2026 13:22:41.907 # <mark> ...``.
_TRANSITION_LINE = re.compile(
    r"^\d+:\w (\d{1,2} \w{3} \d{4} \d\d:\d\d:\d\d\.\d{3}) # "
    + re.escape(schema.REPORT_MARK)
    + r" (\S+) (\S+) (\S+) (.*)$",
    re.M,
)
#: How long before a body's own event its start can have been decided, seconds (a loaded machine).
START_SLACK = 2.0
#: How soon after a body's end its ending's transition is logged, seconds (a sent ending, written again after a
#: lost reply within the lock's TTL).
ENDING_SLACK = LOCK_TTL + 2.0


def transitions(run_dir: Path, checker: Checker) -> None:
    """Every transition the scripts reported in the server's log must be one the store's schema allows.

    Explained: one on a record a copy of a run made again after a wipe took it while the run's body ran, logged
    as that body ended (its ending then finds the record the copy made, ``queued``).
    """
    log = run_dir / SERVER_LOG
    if not log.exists():
        return
    text = log.read_text(errors="replace")
    reports = schema.reported(text)
    checker.checked["transition"] += len(reports)
    unexpected = {(r.script, r.old, r.new): r for r in schema.unexpected(reports)}
    unexplained: dict[tuple[str, str, str], str] = {}
    timed: set[tuple[str, str, str]] = set()
    for stamp, script, old, new, member in _TRANSITION_LINE.findall(text):
        if (script, old, new) not in unexpected:
            continue
        timed.add((script, old, new))
        at = _server_time(stamp)
        body = _wiped_under(checker.h, member, at)
        if body is None:
            unexplained.setdefault((script, old, new), member)
            continue
        checker.explained.append(
            Explained(
                "transition",
                member,
                f"{script} moved its record {old} -> {new} at {checker.h.rel(at)}: a wipe took the record of run "
                f"{body.task_id} while its body ran ({checker.h.rel(body.start)}..{checker.h.rel(body.end)}), and a "
                "copy of the run made it again",
            )
        )
    for key, report in unexpected.items():
        if key not in timed:  # logged in a form without a time: judged as reported
            unexplained[key] = report.member
    for (script, old, new), member in unexplained.items():
        checker.violations.append(
            Violation(
                "transition",
                member,
                f"{script} moved a record {old} -> {new}, which the schema's table does not allow",
                0.0,
            )
        )


def server_starts(run_dir: Path) -> dict[str, list[float]]:
    """Each key's starts (``start`` moving its record to ``started``) in the server's log, server time."""
    log = run_dir / SERVER_LOG
    starts: dict[str, list[float]] = defaultdict(list)
    if log.exists():
        for stamp, script, _, new, member in _TRANSITION_LINE.findall(log.read_text(errors="replace")):
            if script == "start" and new == "started":
                starts[member].append(_server_time(stamp))
    return starts


def _server_time(stamp: str) -> float:
    return datetime.datetime.strptime(stamp, "%d %b %Y %H:%M:%S.%f").replace(tzinfo=datetime.timezone.utc).timestamp()


def _wiped_under(h: History, member: str, at: float) -> Body | None:
    """A body of ``member`` that a wipe of the server's data ran under, and that ended just before ``at``."""
    for body in h.bodies:
        if body.member != member or not body.end <= at + MS or at - body.end > ENDING_SLACK:
            continue
        if any(body.start <= crash and back <= body.end for crash, back in h.wipe_downs):
            return body
    return None
