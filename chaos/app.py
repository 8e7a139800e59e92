"""The Celery app every chaos process builds: one keyed task per mode, short TTLs, a recorded body.

Configured from the environment, so ``celery -A chaos.app worker`` and the
producers build the same app:

- ``CHAOS_BROKER``: broker and dedup store URL (the process's fault proxy);
- ``CHAOS_STORE``: if set, the dedup store apart from the broker (another
  proxy, another database): the two-phase gate;
- ``CHAOS_RUN_DIR`` and ``CHAOS_ROLE``: where this process writes its history;
- ``CHAOS_CONF``: JSON object of further Celery settings (``task_acks_late``, ...).

Timings are short so that what the nemesis provokes happens inside a run:
locks expire within ``LOCK_TTL``, the broker re-delivers unacknowledged
messages after ``VISIBILITY_TIMEOUT``, the reaper passes every second.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import redis
from celery import Celery, signals
from celery.exceptions import Ignore, Reject, Retry

import celery_dedup
import celery_dedup.runtime
from celery_dedup import DedupTask, limits
from celery_dedup.keys import limit_group_member, member_for
from celery_dedup.policy import check_rates, rates_text

from .history import History, record_decisions

#: Execution lock TTL, seconds: a SIGSTOP longer than this makes a live body lose its lock.
LOCK_TTL = 3.0
#: How long until_executed, until_executing and while_executing keys are held at most, seconds.
TTL = 20.0
#: until_expired: the idempotency window after a call, seconds.
EXPIRED_TTL = 4.0
#: throttle: one run per window, seconds.
THROTTLE_WINDOW = 2.0
#: debounce: quiet time before the run, and the longest a burst postpones it, seconds.
DEBOUNCE_WINDOW = 0.4
DEBOUNCE_MAX_WAIT = 2.0
#: kombu re-delivers a message still unacknowledged this long after delivery, seconds.
VISIBILITY_TIMEOUT = 6
#: A task retrying itself comes back after this long, seconds.
RETRY_COUNTDOWN = 0.5
REAP_INTERVAL = 1.0
REAP_GRACE = 3.0
#: kombu's restore sweep every second, and a short mutex (see tests/integration/test_crash.py).
TRANSPORT_OPTIONS = {
    "visibility_timeout": VISIBILITY_TIMEOUT,
    "unacked_restore_interval": 1,
    "unacked_restore_throttle": 1,
    "unacked_mutex_expire": 5,
}


@dataclass(frozen=True)
class ModeSpec:
    """One keyed task of the workload: its mode, the options it is declared with, its limit group's N."""

    mode: str
    options: dict[str, Any]
    #: The task's name after ``chaos.``; default: the mode.
    label: str = ""
    #: ``limit_concurrency`` of its groups (see :func:`limit_group`); 0: no limit.
    limit: int = 0

    @property
    def name(self) -> str:
        return self.label or self.mode

    @property
    def quota(self) -> bool:
        """Whether the task draws on the named group :data:`QUOTA`."""
        return self.options.get("limit_group") == QUOTA

    @property
    def task_name(self) -> str:
        return f"chaos.{self.name}"

    @property
    def gated(self) -> bool:
        """Whether calls pass the enqueue gate (while_executing's do not)."""
        return self.mode != "while_executing"

    @property
    def parks(self) -> bool:
        """Whether a later call joins the pending run (debounce) rather than being a duplicate."""
        return self.mode == "debounce"

    @property
    def holds_after_success(self) -> bool:
        """Whether success keeps the key to the end of its window."""
        return self.mode in ("until_expired", "throttle")

    @property
    def releases_at_start(self) -> bool:
        """Whether the key is free again once the body starts."""
        return self.mode in ("until_executing", "debounce")

    @property
    def hold(self) -> float:
        """The longest a call holds its key without ending (countdown not included), seconds."""
        if self.mode == "throttle":
            return THROTTLE_WINDOW
        if self.mode == "debounce":
            return TTL + DEBOUNCE_MAX_WAIT
        return float(self.options.get("dedup_ttl", TTL))


#: Limit groups per limited task: keys spread over this many groups, the hottest key's group the busiest.
LIMIT_GROUPS = 3


def limit_group(k: str, *_: Any, **__: Any) -> str:
    """The limit group of key ``k`` (``k7`` -> ``g1``): a few groups, each shared by several keys."""
    return f"g{int(k.lstrip('k') or 0) % LIMIT_GROUPS}"


#: The named limit group two tasks share (``chaos.quota_a``, ``chaos.quota_b``): a third-party quota, one per
#: tenant. Two windows: bursts (``many``) reach the per-second one, the hottest tenant the per-minute one.
QUOTA = "quota"
QUOTA_CONCURRENCY = 2
QUOTA_RATES = ("4/s", "30/m")
#: A body told to back off (``dedup_backoff``) does so once per run: its first delivery that gets this far.
BACKOFF_MARK = "chaos:backoff:{}"
#: Its group keys (tenants): the calls' keys spread over them, ``t0`` the hottest.
QUOTA_KEYS = ("t0", "t1", "t2")
LIMIT_GROUPS_SETTING = {QUOTA: {"concurrency": QUOTA_CONCURRENCY, "rate": list(QUOTA_RATES)}}


def quota_key(k: str, *_: Any, **__: Any) -> str:
    """The tenant of key ``k`` in the named group (``k4`` -> ``t1``)."""
    return QUOTA_KEYS[int(k.lstrip("k") or 0) % len(QUOTA_KEYS)]


MODES: tuple[ModeSpec, ...] = (
    ModeSpec("until_executed", {"dedup_ttl": TTL}),
    ModeSpec("until_executing", {"dedup_ttl": TTL}),
    ModeSpec("until_expired", {"dedup_ttl": EXPIRED_TTL}),
    ModeSpec("while_executing", {}),
    ModeSpec("debounce", {"dedup_ttl": TTL, "dedup_window": DEBOUNCE_WINDOW, "dedup_max_wait": DEBOUNCE_MAX_WAIT}),
    ModeSpec("throttle", {"dedup_window": THROTTLE_WINDOW}),
    # Limit groups of small N: different keys of one group may not run more than N bodies at once.
    ModeSpec(
        "until_executed",
        {"dedup_ttl": TTL, "limit_key": limit_group, "limit_concurrency": 1},
        label="limit1",
        limit=1,
    ),
    ModeSpec(
        "while_executing",
        {"limit_key": limit_group, "limit_concurrency": 2},
        label="limit2",
        limit=2,
    ),
    # Two tasks of one named group: a tenant's quota counts the bodies of both.
    ModeSpec("until_executed", {"dedup_ttl": TTL, "limit_group": QUOTA, "limit_key": quota_key}, label="quota_a"),
    ModeSpec("until_executing", {"dedup_ttl": TTL, "limit_group": QUOTA, "limit_key": quota_key}, label="quota_b"),
)
MODE_BY_TASK = {spec.task_name: spec for spec in MODES}


class ChaosFailure(Exception):
    """Raised by a body told to fail: a final failure of its run."""


def history_from_env() -> History | None:
    run_dir = os.environ.get("CHAOS_RUN_DIR")
    return History(run_dir, os.environ.get("CHAOS_ROLE", "process")) if run_dir else None


def work(task: DedupTask, seconds: float, on_lock_lost: Callable[[], object]) -> None:
    """Sleep ``seconds`` in small steps, calling ``on_lock_lost`` once if the run loses its lock meanwhile."""
    deadline = time.monotonic() + seconds
    seen = False
    while True:
        if not seen and task.dedup_lock_lost:
            seen = True
            on_lock_lost()
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, 0.05))


def run_step(
    task: DedupTask, history: History | None, fields: dict[str, Any], name: str, seconds: float, on_doubt: str
) -> str:
    """``task.dedup_once(name, fn, on_doubt=on_doubt)``, whose ``fn`` sleeps ``seconds``; every part recorded.

    Events (with ``fields``, the step's ``name`` and ``on_doubt``): ``step_enter`` as it is asked for,
    ``step_call`` as ``fn`` is called (with the idempotency key it got), ``step_return`` as ``fn`` returns
    (its value: unique to the call), ``step_exit`` as ``dedup_once`` returns (``outcome="done"``, whether
    it called ``fn``, the value it returned) or raises (the exception's name, ``fn_error`` if ``fn`` raised
    it, ``recorded`` for a lost lock: whether the step was recorded done).
    """
    common = {**fields, "step": name, "on_doubt": on_doubt}
    emit = history.emit if history is not None else (lambda *args, **kwargs: {})
    called, fn_error = False, ""

    def fn(key: str) -> str:
        nonlocal called, fn_error
        called = True
        emit("step_call", key=key, **common)
        try:
            time.sleep(seconds)
        except BaseException as exc:
            fn_error = type(exc).__name__
            raise
        value = f"{fields['call']}/{name}/{os.getpid()}/{secrets.token_hex(4)}"
        emit("step_return", value=value, **common)
        return value

    emit("step_enter", **common)
    try:
        value = task.dedup_once(name, fn, on_doubt=on_doubt)
    except BaseException as exc:
        emit(
            "step_exit",
            outcome=type(exc).__name__,
            called=called,
            fn_error=fn_error,
            recorded=getattr(exc, "recorded", None),
            **common,
        )
        raise
    emit("step_exit", outcome="done", called=called, value=value, **common)
    return value


def conclude(task: DedupTask, outcome: str, member: str) -> None:
    """End the body as told: retry once, replace itself, fail for good, or (returning) succeed."""
    if outcome == "retry":
        raise task.retry(countdown=RETRY_COUNTDOWN, max_retries=1)
    if outcome == "replaced":
        request = task.request
        args = list(request.args or ())
        k, call = args[0], args[1]
        if len(args) > 5 and args[5] == "plain":  # by a plain task: the run ends as replaced
            raise task.replace(task.app.tasks["chaos.after"].si(call))
        raise task.replace(task.s(k, call, 0.05))  # under the same key: the same run goes on
    if outcome == "failed":
        raise ChaosFailure(f"{member} told to fail")


def outcome_of(exc: BaseException) -> str:
    """The outcome of a body that raised ``exc`` unasked: its class name, but a ``Reject`` tells whether it requeues.

    Without requeue (what ``Task.retry`` raises when it cannot publish the
    retry) the message is dropped and the run ended ``rejected``; with
    requeue it is delivered again and the run goes on (``requeued``).
    """
    if isinstance(exc, Reject):
        return "requeued" if getattr(exc, "requeue", False) else "rejected"
    return type(exc).__name__


def lock_lost_seen(history: History | None, fields: dict[str, Any]) -> Callable[[], object]:
    """What ``work`` calls once the body sees its lock lost: a ``lock_lost_seen`` event."""
    seen = False

    def report() -> None:
        nonlocal seen
        if history is not None and not seen:
            seen = True
            history.emit("lock_lost_seen", **fields)

    return report


def limit_fields(spec: ModeSpec | None, k: str, task_id: str | None) -> dict[str, Any]:
    """What a limited body's ``body_start`` says of its group: the group and its N; for the named group also its
    group key, its declared windows and the grant's start on the server's clock (``granted_at``, ms; 0: none)."""
    if spec is None:
        return {}
    if spec.quota:
        grant = limits.current(task_id)
        return {
            "group": limit_group_member(QUOTA, quota_key(k)),
            "limit": QUOTA_CONCURRENCY,
            "quota": QUOTA,
            "quota_key": quota_key(k),
            "rates": rates_text(check_rates(list(QUOTA_RATES))),
            "granted_at": grant.granted_at if grant is not None else 0,
        }
    return {"group": member_for(spec.task_name, limit_group(k)), "limit": spec.limit} if spec.limit else {}


def first_backoff(task: DedupTask, task_id: str) -> bool:
    """Whether run ``task_id`` has not backed off yet (marked now); False if the store cannot say."""
    try:
        client = celery_dedup.runtime.store_for(task.app).client
        return bool(client.set(BACKOFF_MARK.format(task_id), 1, nx=True, px=600_000))
    except redis.RedisError:
        return False


def back_off(task: DedupTask, history: History | None, k: str, seconds: float, fields: dict[str, Any]) -> None:
    """``raise self.dedup_backoff(retry_after=seconds)``, as a body told 429 by its partner does; recorded as
    ``backoff`` with when it was asked (``asked``; the event's ``t`` is after the pause was written)."""
    asked = time.time()
    exc = task.dedup_backoff(retry_after=seconds)
    if history is not None:
        key = quota_key(k)
        group = limit_group_member(QUOTA, key)
        history.emit("backoff", asked=asked, retry_after=seconds, quota=QUOTA, quota_key=key, group=group, **fields)
    raise exc


def make_body(history: History | None) -> Callable[..., str]:
    """The body every chaos task runs: record its start, sleep (watching the lock) with its steps in between (each
    a ``dedup_once`` whose function sleeps too), fail, retry or replace itself, record its end."""

    def body(
        self: DedupTask,
        k: str,
        call: str,
        sleep: float = 0.0,
        fail: bool = False,
        retry: bool = False,
        replace: str = "",
        steps: int = 0,
        on_doubt: str = "retry",
        backoff: float = 0.0,
    ) -> str:
        request = self.request
        business_key = self.dedup_business_key(k, call, sleep, fail, retry, replace, steps, on_doubt, backoff)
        member = member_for(self.name, business_key)
        fields = {"task_id": request.id, "member": member, "call": call, "tid": threading.get_ident()}
        spec = MODE_BY_TASK.get(self.name)
        if history is not None:
            group = limit_fields(spec, k, request.id)
            history.emit("body_start", retries=request.retries or 0, worker=request.hostname, **group, **fields)
        outcome = "succeeded"
        ended = False
        try:
            seen = lock_lost_seen(history, fields)
            share = sleep / (steps + 1)  # each step gets a share: half in the body before it, half in its call
            for step in range(1, steps + 1):
                work(self, share / 2, seen)
                run_step(self, history, fields, f"s{step}", share / 2, on_doubt)
            work(self, share, seen)
            if backoff and first_backoff(self, str(request.id)):
                outcome = "Backoff"
                back_off(self, history, k, backoff, fields)
            if retry and not request.retries:
                outcome = "retry"
            elif replace:
                outcome = "replaced"
                if history is not None:  # the body is done: its replacement may start before replace() returns
                    history.emit("body_end", outcome=outcome, lock_lost=bool(self.dedup_lock_lost), **fields)
                ended = True
            elif fail:
                outcome = "failed"
            conclude(self, outcome, member)
        except BaseException as exc:
            expected = {"retry": Retry, "Backoff": Retry, "failed": ChaosFailure, "replaced": Ignore}.get(outcome)
            if expected is None or not isinstance(exc, expected):  # a terminate, a soft time limit, a failed retry
                outcome = outcome_of(exc)
            raise
        finally:
            if history is not None and not ended:
                history.emit("body_end", outcome=outcome, lock_lost=bool(self.dedup_lock_lost), **fields)
        return call

    return body


def register(app: Celery, history: History | None) -> dict[str, DedupTask]:
    """Register one chaos task per mode on ``app`` (no debounce with a store apart: it needs the atomic gate)."""
    tasks: dict[str, DedupTask] = {}
    two_phase = bool(app.conf.get("dedup_redis_url"))
    for spec in MODES:
        if two_phase and spec.parks:
            continue
        decorate: Callable[[Callable[..., str]], Any] = app.task(
            name=spec.task_name,
            base=DedupTask,
            bind=True,
            shared=False,
            dedup_key="{k}",
            dedup_mode=spec.mode,
            **spec.options,
        )
        tasks[spec.name] = cast(DedupTask, decorate(make_body(history)))
    return tasks


def register_after(app: Celery, history: History | None) -> Any:
    """``chaos.after``: the plain task a chained call continues with; it records that it ran, and with what.

    In a chain (``head | chaos.after.s(call)``) it gets the result of the run
    its call was accepted into or followed: the ``call`` whose arguments that
    run's body ran, which the body returns (``continued``). Alone
    (``chaos.after.si(call)``) it is what a body replaced itself with: the
    replacement returns that body's call, as the run's result (``replacement_ran``).
    """

    @app.task(name="chaos.after", shared=False)
    def after(result: str, call: str = "") -> str:
        if history is not None:
            if call:
                history.emit("continued", call=call, result=result)
            else:
                history.emit("replacement_ran", result=result)
        return result

    return after


def record_worker_signals(history: History) -> None:
    """Record every message a worker took, revoke it acts on, run the guard settled, chain continuation sent.

    ``received``: a worker's consumer took the message (prefetched; the body
    may start later), from Celery's ``task_received``.

    ``revoked``: a terminated body ends there. Connected before
    ``celery_dedup.install``, so this receiver runs before the library's: the
    event is written after the pool killed the body and before its lock can
    be released. ``settled``: ``task_postrun`` runs after ``DedupTask.__call__``
    returned, in the process and thread that ran the body, so the guard has
    recorded how that delivery's run ended by then.
    """

    def on_postrun(task_id: str | None = None, state: str | None = None, **_: Any) -> None:
        history.emit("settled", task_id=task_id, state=state, tid=threading.get_ident())

    def on_revoked(
        sender: Any = None, request: Any = None, terminated: bool = False, signum: Any = None, **_: Any
    ) -> None:
        if request is not None:
            history.emit(
                "revoked",
                task_id=request.id,
                terminated=bool(terminated),
                signum=str(signum),
                worker_pid=getattr(request, "worker_pid", None),
            )

    def on_published(sender: Any = None, body: Any = None, **_: Any) -> None:
        if sender == "chaos.after" and isinstance(body, (list, tuple)) and body and len(body[0]) > 1:
            history.emit("continuation_sent", call=str(body[0][1]))

    def on_received(sender: Any = None, request: Any = None, **_: Any) -> None:
        if request is not None:
            history.emit("received", task_id=request.id)

    def on_ready(sender: Any = None, **_: Any) -> None:
        history.emit("worker_ready", node=getattr(sender, "hostname", None))

    signals.worker_ready.connect(on_ready, weak=False, dispatch_uid="chaos.on_ready")
    signals.task_received.connect(on_received, weak=False, dispatch_uid="chaos.on_received")
    signals.after_task_publish.connect(on_published, weak=False, dispatch_uid="chaos.on_published")
    signals.task_revoked.connect(on_revoked, weak=False, dispatch_uid="chaos.on_revoked")
    signals.task_postrun.connect(on_postrun, weak=False, dispatch_uid="chaos.on_postrun")


def build(broker: str | None = None, *, history: History | None = None, conf: dict[str, Any] | None = None) -> Celery:
    """The chaos app; each argument defaults to the environment (see the module docstring)."""
    broker = broker or os.environ.get("CHAOS_BROKER", "redis://127.0.0.1:6379/0")
    chaos_app = Celery("chaos", broker=broker, set_as_current=False)
    chaos_app.conf.update(
        broker_transport_options=TRANSPORT_OPTIONS,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        task_ignore_result=True,
        task_publish_retry_policy={"max_retries": 3, "interval_start": 0, "interval_step": 0.2},
        dedup_lock_ttl=LOCK_TTL,
        dedup_reap_interval=REAP_INTERVAL,
        dedup_reap_grace=REAP_GRACE,
        dedup_history_length=1000,
        dedup_default_ttl=TTL,
        dedup_limit_groups=LIMIT_GROUPS_SETTING,
    )
    chaos_app.conf.update(conf if conf is not None else json.loads(os.environ.get("CHAOS_CONF", "{}")))
    if conf is None and os.environ.get("CHAOS_STORE"):
        chaos_app.conf.dedup_redis_url = os.environ["CHAOS_STORE"]
    if history is None:
        history = history_from_env()
    if history is not None:
        record_worker_signals(history)
        record_decisions(history)
    celery_dedup.install(chaos_app)
    register(chaos_app, history)
    register_after(chaos_app, history)
    return chaos_app


#: The app of a worker or producer process (``celery -A chaos.app worker``).
app = build()
