"""The execution guard: whether a delivery may run, the lock while it runs, how it ends.

Two round trips per execution: ``start`` (decide, take the lock, mark the
record started) and ``finish`` (record the ending, release the lock, drop or
keep the key), plus one renewal call per lock TTL fraction for long runs.

A delivery that may not run is acknowledged (``Ignore``: no result is stored
over the real run's), counted in the record's ``skipped`` field, and logged;
one that finds another delivery of the same run holding the lock is deferred
until that lock would have expired, so a copy is never lost to a worker that
died while holding it.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple, NoReturn

import redis
from celery.exceptions import Ignore, Reject, Retry
from kombu.utils.json import loads

from .. import decisions, runtime
from ..exceptions import UNREACHABLE, DedupError, DedupFollowerError, DedupStoreError, DedupUnavailableError
from ..header import DEFERS_OPTION, GateHeader
from ..keyed import KeyedTask
from ..keys import member_for, split_member
from ..payloads import call_payload, decode_payload, decode_result, result_payload
from ..store.store import BackendResult, DedupStore, Finished, StartDecision
from . import limits, processes, recovery, results
from .lock import ExecutionLock, renewer
from .processes import exit_watcher, owner_gone, token_pid

logger = logging.getLogger("celery_dedup")

SUCCEEDED, FAILED, RETRY, REVOKED = "succeeded", "failed", "retry", "revoked"
REJECTED, IGNORED, LOST, SKIPPED = "rejected", "ignored", "lost", "skipped"
QUEUED, REPLACED = "queued", "replaced"
_ERROR_LIMIT = 500


def _key(member: str) -> str:
    return split_member(member)[1]


def error_summary(exc: BaseException) -> str:
    """``Type: message`` of an exception, truncated for the status record."""
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= _ERROR_LIMIT else text[: _ERROR_LIMIT - 3] + "..."


def locate(task: KeyedTask, headers: Any, args: Any, kwargs: Any) -> tuple[str, DedupStore, bool] | None:
    """``(member, store, gated)`` of a delivery: from its ``dedup`` header, else from its arguments."""
    store = runtime.store_for(task.app)
    gate = GateHeader.decode(headers)
    if gate is not None:
        return gate.member, store.with_prefix(gate.prefix), True
    try:
        return member_for(task.name, task.dedup_policy.spec.business_key(args, kwargs)), store, False
    except DedupError:
        logger.exception("%s: cannot derive the key of this delivery; it runs unguarded", task.name)
        return None


def guarded_call(
    task: KeyedTask, args: tuple[Any, ...], kwargs: dict[str, Any], body: Callable[[Any, Any], Any]
) -> Any:
    """Run ``body(args, kwargs)`` for the current request under the guard.

    A debounced run (``dedup_debounce="latest"``) runs with the arguments
    its burst's newest call left in the record instead of its message's.
    """
    request = task.request
    task_id = request.id
    if task_id is None or request.called_directly:
        return body(args, kwargs)
    if not task.dedup_policy.mode.guards:
        return limits.limited_call(task, args, kwargs, body)
    located = locate(task, request.headers, request.args, request.kwargs)
    if located is None:
        return body(args, kwargs)
    member, store, gated = located
    policy = task.dedup_policy
    token = processes.claim()
    lock_ms = int(policy.lock_ttl * 1000)
    record_ms = runtime.config_for(task.app).record_ms
    try:
        lease, decision = admitted_start(task, store, member, gated, token, lock_ms, record_ms)
    except redis.RedisError as exc:
        return store_unreachable(task, store, member, exc, args, kwargs, body)
    if decision.code == StartDecision.FOLLOW:
        return follow(task, member, decision)
    if not decision.run:
        refuse(task, store, member, decision)
    keeper = renewer()
    lock = ExecutionLock(store, member, token, lock_ms, record_ms, now=keeper.clock())
    keeper.add(lock)
    _running[task_id] = lock

    def end(
        ending: Ending, value: Any = None, backend_result: BackendResult | None = None, deferred: bool = False
    ) -> None:
        if not deferred and ending.state == SUCCEEDED and results.defer(task, store, partial(end, ending, value)):
            return  # recorded with its result where the backend is the store's Redis: one round trip
        keeper.remove(lock)
        limits.leave(lease, ran=True)
        forget(task_id, lock)
        replacement = _replacements.pop(token, None)
        handed_over = replacement is not None and replacement.handed_over
        if handed_over and ending.state == REPLACED:
            processes.retire(token)
            return  # the replacement goes on with this run under its key: nothing ends here
        own = "" if handed_over else token  # handed over: the lock went with it, and the publish that followed failed
        finished = finish(
            task,
            store,
            member,
            task_id,
            ending.state,
            drop=ending.drop,
            token=own,
            role="run",
            error=ending.error,
            note=ending.note,
            record_ms=record_ms,
            payload=kept_payload(task, ending.state, args, kwargs),
            patience=max(policy.lock_ttl, 5.0),
            lock=lock if own else None,
            # A key held after success answers later calls with this run: keep its value for their followers.
            result=kept_result(task, value)[0] if ending.state == SUCCEEDED and policy.mode.holds_after_success else "",
            backend_result=backend_result,
        )
        processes.retire(token)  # it let go of its lock and slot (or left them to expire)
        if finished is not None and finished.wants_result:
            settle(task, store, member, task_id, value, record_ms)

    try:
        if decision.payload:
            latest, kwargs = decode_payload(task.app, decision.payload)
            args = tuple(latest)
            request.args, request.kwargs = latest, kwargs
        result = body(args, kwargs)
    except (SystemExit, KeyboardInterrupt):
        # The process is being torn down (hard time limit, terminate, shutdown):
        # the worker's main process reports how this run ended, releasing the lock.
        _forget(task_id, token, lock, lease)
        raise
    except BaseException as exc:
        end(ending_of(exc, token))
        raise
    end(Ending(SUCCEEDED, drop=not policy.mode.holds_after_success), result)
    return result


def admitted_start(
    task: KeyedTask, store: DedupStore, member: str, gated: bool, token: str, lock_ms: int, record_ms: int
) -> tuple[limits.SlotLease | None, StartDecision]:
    """The task's limits, then :func:`begin`: a run that must wait takes nothing else (``Ignore``, re-published).

    A delivery the guard then refuses gives its slot back at once. A
    delivery that takes nothing (it waits, is refused, or the store failed)
    retires its claimed ``token``.
    """
    try:
        lease = limits.admit(task, store, member, token)
        try:
            decision = begin(task, store, member, gated, token, lock_ms, record_ms)
        except redis.RedisError:
            limits.leave(lease, ran=False)
            raise
    except BaseException:
        processes.retire(token)
        raise
    if not decision.run:
        limits.leave(lease, ran=False)
        processes.retire(token)
    elif lease is not None:
        lease.running = True
    return lease, decision


def _forget(task_id: str, token: str, lock: ExecutionLock, lease: limits.SlotLease | None) -> None:
    """Stop renewing a delivery's lock and give back its slot, without recording an ending (someone else will).

    Its token is retired: whoever reports the ending may free its lock.
    """
    renewer().remove(lock)
    limits.leave(lease, ran=True)
    forget(task_id, lock)
    _replacements.pop(token, None)
    processes.retire(token)


class Ending(NamedTuple):
    """How a delivery's body ended, as its record says it."""

    state: str
    #: Free the key now (else it stays held to its deadline).
    drop: bool
    error: str = ""
    note: str = ""


def ending_of(exc: BaseException, token: str) -> Ending:
    """The ending of a body that raised ``exc``, run under lock ``token``."""
    if isinstance(exc, Retry):
        return Ending(RETRY, drop=False)  # the retry was published under this run's key
    if isinstance(exc, Reject):
        requeue = bool(getattr(exc, "requeue", False))
        return Ending(RETRY, drop=False) if requeue else Ending(REJECTED, drop=True)
    if isinstance(exc, Ignore):
        replacement = _replacements.get(token)
        if replacement is None:
            return Ending(IGNORED, drop=True)
        return Ending(REPLACED, drop=True, note=f"by {replacement.by}")
    return Ending(FAILED, drop=True, error=error_summary(exc))


@dataclass
class Replacement:
    """A running run that is replacing itself (``Task.replace``)."""

    member: str
    #: What replaces it, for the record's history.
    by: str
    #: The replacement goes on under this run's key and id: the run's lock was
    #: released and its record set back to queued before it was published.
    handed_over: bool = False


#: Deliveries of this process inside ``Task.replace``, by lock token. Not by
#: task id: a replacement under the same key carries the run's id, and may
#: start and end on another thread before the delivery it replaced unwinds.
_replacements: dict[str, Replacement] = {}


def replacing(task: KeyedTask, by: str) -> tuple[str, str] | None:
    """Note that the run executing ``task`` replaces itself with ``by`` (called from ``on_replace``).

    The run's record is marked before the replacement is published, so a
    worker that dies before the run's ending is recorded leaves its followers
    to the replacement (see ``replacing.lua``); unmarked (the store failed),
    such a death fails them as lost at once.
    Returns the run's ``(prefix, member)``, None if no run of this process is executing it.
    """
    task_id = task.request.id
    lock = _running.get(task_id) if task_id is not None else None
    if task_id is None or lock is None:
        return None
    _replacements[lock.token] = Replacement(lock.member, by)
    try:
        lock.store.replacing(lock.member, task_id, lock.token, by)
    except redis.RedisError:
        logger.exception("%s[%s]: could not mark the run as replacing itself", task.name, task_id)
    return lock.store.schema.prefix, lock.member


def hand_over(task_id: str | None, member: str) -> bool:
    """Let a replacement publish continue run ``task_id`` under ``member``, if that run is replacing itself.

    The run's lock is released and its record set back to ``queued`` first,
    so the replacement's delivery starts at once instead of waiting for the
    lock; the key stays held. Returns whether the publish continues the run.
    """
    if task_id is None:
        return False
    lock = _running.get(task_id)
    replacement = _replacements.get(lock.token) if lock is not None else None
    if replacement is None or lock is None or replacement.member != member:
        return False
    if not replacement.handed_over:
        renewer().remove(lock)
        lock.store.finish(
            member,
            task_id,
            QUEUED,
            drop=False,
            record_ms=lock.record_ms,
            role="run",
            token=lock.token,
            note=f"replaced by {replacement.by}",
        )
        replacement.handed_over = True
    return True


def start(
    task: KeyedTask, store: DedupStore, member: str, gated: bool, token: str, lock_ms: int, record_ms: int
) -> StartDecision:
    """Ask the store whether this delivery may run; if so, it now holds the lock ``token``."""
    request = task.request
    policy = task.dedup_policy
    return store.start(
        member,
        str(request.id),
        token,
        lock_ms=lock_ms,
        gated=gated,
        key_mode=policy.mode.key_on_start,
        hostname=request.hostname or socket.gethostname(),
        pid=os.getpid(),
        retries=request.retries or 0,
        record_ms=record_ms,
        want_payload=policy.mode.parks and policy.debounce == "latest",
        on_locked=policy.on_locked,
        keep_payload=records_args(task),
        main=recovery.main_token(),
        delivery=recovery.delivery(task),
    )


def begin(
    task: KeyedTask, store: DedupStore, member: str, gated: bool, token: str, lock_ms: int, record_ms: int
) -> StartDecision:
    """:func:`start`, and if a lock whose owner is provably dead refused it, :func:`take_over`.

    The common path stays one round trip; only a refusal asks the process table.
    """
    decision = start(task, store, member, gated, token, lock_ms, record_ms)
    if decision.holder and owner_gone(decision.holder):
        return take_over(task, store, member, gated, token, lock_ms, record_ms, decision)
    return decision


def take_over(
    task: KeyedTask,
    store: DedupStore,
    member: str,
    gated: bool,
    token: str,
    lock_ms: int,
    record_ms: int,
    refused: StartDecision,
) -> StartDecision:
    """Take over the lock that refused this delivery, whose owner is provably dead, and start again.

    The refusal is uncounted; the takeover is counted (``taken_over``) and the
    dead run's record says ``lost ... taken over from <token>``. If the lock
    changed meanwhile (released, or another delivery's now), the refusal stands.
    """
    locked = refused.code == StartDecision.LOCKED or task.dedup_policy.on_locked == "reschedule"
    if not store.take_over(member, refused.holder, refused="deferred" if locked else "skipped"):
        return refused
    decisions.log(
        "taken_over", task.name, _key(member), task.request.id, f"from {refused.holder}, whose process is gone"
    )
    return start(task, store, member, gated, token, lock_ms, record_ms)


def records_args(task: KeyedTask) -> bool:
    """Whether the current delivery's arguments may be kept: its publisher (gate header) and this app allow it."""
    gate = GateHeader.decode(task.request.headers)
    return runtime.config_for(task.app).record_args and (gate is None or gate.record_args)


def store_unreachable(
    task: KeyedTask,
    store: DedupStore,
    member: str,
    exc: redis.RedisError,
    args: Any,
    kwargs: Any,
    body: Callable[[Any, Any], Any],
) -> Any:
    """The store failed when a delivery starts: if unreachable, ``dedup_on_redis_error`` decides.

    ``fail_open`` runs the body unguarded (logged, counted); ``fail_closed``
    retries the delivery later instead of running it without a lock. A store
    that answered with an error is no outage: see :func:`store_refused`.
    """
    if not isinstance(exc, UNREACHABLE):
        store_refused(task, store, member, exc, args, kwargs)
    app = task.app
    if runtime.config_for(app).on_redis_error == "fail_open":
        runtime.count_fail_open(app, task.name)
        decisions.log(
            "fail_open", task.name, _key(member), task.request.id, f"dedup store unreachable, ran unguarded ({exc})"
        )
        return body(args, kwargs)
    unavailable = DedupUnavailableError(task.name, member, exc, published=False)
    raise task.retry(exc=unavailable, countdown=max(task.dedup_policy.lock_ttl / 3, 1.0))


def store_refused(
    task: KeyedTask, store: DedupStore, member: str, exc: redis.RedisError, args: Any, kwargs: Any
) -> NoReturn:
    """The store answered a delivery's start with an error reply (OOM, NOPERM, WRONGTYPE...): fail it.

    Whatever ``dedup_on_redis_error`` says: the server is up, so the body does
    not run unguarded, and a retry would be published through the same store.
    The failure is recorded if the store takes that (with the call, for a
    re-enqueue once the server is fixed); the message is acknowledged.
    """
    request = task.request
    error = DedupStoreError(task.name, _key(member), exc)
    logger.error("%s[%s]: not run: %s", task.name, request.id, error)
    record_ms = runtime.config_for(task.app).record_ms
    payload = kept_payload(task, FAILED, args, kwargs)
    summary = error_summary(error)
    finish(
        task,
        store,
        member,
        str(request.id),
        FAILED,
        drop=True,
        role="report",
        record_ms=record_ms,
        error=summary,
        payload=payload,
    )
    raise error from exc


#: The lock of each run executing in this process, by task id. Kept off the
#: request: Celery copies request attributes into a retry's headers.
_running: dict[str, ExecutionLock] = {}


def forget(task_id: str, lock: ExecutionLock) -> None:
    """Drop ``lock`` from the running runs, unless a later delivery of the same run (a replacement) took its place."""
    if _running.get(task_id) is lock:
        del _running[task_id]


def lock_lost(task_id: str | None) -> bool:
    """Whether the run ``task_id`` executing in this process has lost its lock."""
    lock = _running.get(task_id) if task_id is not None else None
    return lock is not None and lock.lost.is_set()


def refuse(task: KeyedTask, store: DedupStore, member: str, decision: StartDecision) -> None:
    """Acknowledge a delivery that may not run (raises Ignore), deferring it where it might be needed."""
    request = task.request
    code = decision.code
    key = _key(member)
    if code == StartDecision.DONE:
        decisions.log("skipped", task.name, key, request.id, f"a delivery of a run that already {decision.detail}")
    elif code == StartDecision.SUPERSEDED:
        decisions.log("skipped", task.name, key, request.id, f"the key belongs to run {decision.detail} now")
    elif code == StartDecision.LOCKED or task.dedup_policy.on_locked == "reschedule":
        defer(task, key, int(decision.detail))
    else:
        decisions.log("skipped", task.name, key, request.id, "another run holds the execution lock")
        record_ms = runtime.config_for(task.app).record_ms
        finish(task, store, member, str(request.id), SKIPPED, drop=True, role="report", record_ms=record_ms)
    raise Ignore()


def defer(task: KeyedTask, key: str, lock_pttl_ms: int) -> None:
    """Re-publish this run to arrive once the lock that blocks it would have expired.

    If the holder is alive it will have finished (the copy is then skipped as
    done); if it died, the copy runs. ``retries`` is unchanged: this is not a
    retry of the run.
    """
    request = task.request
    countdown = max(lock_pttl_ms, 0) / 1000 + random.uniform(0.2, 1.0)
    decisions.log("deferred", task.name, key, request.id, f"execution lock held elsewhere; again in {countdown:.1f}s")
    task.signature_from_request(request, countdown=countdown).apply_async(**{DEFERS_OPTION: True})


#: Endings after which an operator may want to run the call again (see operations.requeue).
_REQUEUABLE = frozenset({FAILED, REJECTED, REVOKED, LOST})


def kept_payload(task: KeyedTask, state: str, args: Any, kwargs: Any) -> str:
    """The call's payload for a record ending in ``state``, if arguments are recorded at all."""
    if state not in _REQUEUABLE or not runtime.config_for(task.app).record_args:
        return ""
    try:
        return call_payload(task.app, task.serializer, args, kwargs)
    except Exception:  # an argument the serializer refuses must not hide how the run ended
        logger.exception("%s: could not keep the arguments of a run that ended %s", task.name, state)
        return ""


def finish(
    task: KeyedTask,
    store: DedupStore,
    member: str,
    task_id: str,
    state: str,
    *,
    drop: bool,
    role: str,
    record_ms: int,
    token: str = "",
    error: str = "",
    payload: str = "",
    note: str = "",
    patience: float = 0.0,
    lock: ExecutionLock | None = None,
    result: str = "",
    backend_result: BackendResult | None = None,
) -> Finished | None:
    """Record a run's ending (``role`` as for :meth:`DedupStore.finish`); store errors are logged.

    Returns what the store did, or None when it could not be recorded. A
    store that cannot be reached (a restart, a dropped connection) is tried
    again for up to ``patience`` seconds, renewing ``lock`` meanwhile: an
    ending that is not recorded leaves the run ``started``, and a later copy
    of it would run it again. A key whose ending could not be recorded expires
    by its TTL.
    """
    deadline = time.monotonic() + patience
    wait = 0.05
    while True:
        try:
            finished = store.finish(
                member,
                task_id,
                state,
                drop=drop,
                record_ms=record_ms,
                role=role,
                token=token,
                error=error,
                payload=payload,
                note=note,
                result=result,
                backend_result=backend_result,
            )
            break
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            if time.monotonic() + wait > deadline:
                logger.exception(
                    "could not record %s for %s[%s] key %r; it expires by its TTL", state, task.name, task_id, member
                )
                return None
            logger.warning("recording %s for %s[%s] again: %s", state, task.name, task_id, exc)
            if lock is not None:
                renewer().add(lock)  # keep it ours while the store is away
            time.sleep(wait)
            wait = min(wait * 2, 1.0)
            if lock is not None:
                renewer().remove(lock)
        except redis.RedisError:
            logger.exception(
                "could not record %s for %s[%s] key %r; it expires by its TTL", state, task.name, task_id, member
            )
            return None
    if not finished.lock_kept:
        decisions.log("lock_lost", task.name, _key(member), task_id, f"ended {state} after losing its execution lock")
    if not finished.owned:
        logger.info("%s[%s] ended (%s) but key %r belongs to another run", task.name, task_id, state, member)
    return finished


def kept_result(task: KeyedTask, value: Any) -> tuple[str, str]:
    """``(payload, "")`` of a run's return value for its followers, or ``("", why)`` if it cannot be kept."""
    try:
        return result_payload(task.app, value), ""
    except Exception as exc:  # whatever the serializer refuses: the followers learn why
        return "", f"its return value could not be kept for its followers ({error_summary(exc)})"


def settle(task: KeyedTask, store: DedupStore, member: str, run_id: str, value: Any, record_ms: int) -> None:
    """Give the followers of a run that succeeded its return value, and release them."""
    payload, unkept = kept_result(task, value)
    try:
        store.settle(member, run_id, result=payload, unkept=unkept, record_ms=record_ms)
    except redis.RedisError:  # the reaper releases them a grace later, as lost
        logger.exception("could not settle the followers of %s[%s] key %r", task.name, run_id, member)


def follow(task: KeyedTask, member: str, decision: StartDecision) -> Any:
    """A follower's delivery: resolve as the run it followed ended, without running the body.

    Its return value is that run's (so Celery stores it under the follower's
    id, applies its callbacks, goes on with its chain and counts it in its
    chord); a run that did not succeed fails it with :class:`DedupFollowerError`.
    """
    run_id = decision.detail
    outcome = loads(decision.payload) if decision.payload else {}
    state = str(outcome.get("state") or "")
    key = _key(member)
    decisions.log("followed", task.name, key, task.request.id, f"resolved as run {run_id} ended: {state or '?'}")
    if state == SUCCEEDED and outcome.get("result"):
        return decode_result(task.app, str(outcome["result"]))
    reason = str(outcome.get("error") or "") or ("" if state else "its ending was not recorded")
    raise DedupFollowerError(task.name, key, run_id, state or "lost", reason)


def settle_elsewhere(
    task: KeyedTask, state: str, task_id: str, headers: Any, args: Any, kwargs: Any, *, stopping: bool
) -> bool:
    """Record an ending the body never returned from (revoked, a lost worker, a hard time limit).

    Reported by the worker's main process, or by a signal after the body
    settled its run already: then nothing changes (a run ends once). The
    run's lock is released only where its process is gone; with ``stopping``
    (a terminate, a hard time limit) the ending is recorded at once and the
    lock and key are freed as soon as the process that holds them exits, or
    by its own guard if it lives on (``SIGUSR1`` raises in the body and lets
    it clean up). Another delivery's or another run's lock is never touched.
    """
    if not task.dedup_policy.mode.guards:  # no lock, no record: only its place in its limit group
        limits.reported_ending(task, runtime.store_for(task.app), "", args, kwargs, task_id, "")
        return False
    located = locate(task, headers, args, kwargs)
    if located is None:
        return False
    member, store, _ = located
    record_ms = runtime.config_for(task.app).record_ms
    try:
        holder = store.lock_holder(member)
    except redis.RedisError:
        logger.exception("could not read the lock of %s[%s] key %r", task.name, task_id, member)
        return False
    token = holder if holder is not None and delivery_gone(holder) else ""
    payload = kept_payload(task, state, args, kwargs)
    finished = finish(
        task,
        store,
        member,
        task_id,
        state,
        drop=True,
        role="stop" if stopping else "report",
        token=token,
        record_ms=record_ms,
        payload=payload,
    )
    limits.reported_ending(task, store, member, args, kwargs, task_id, token)
    owned = finished is not None and finished.owned
    pid = token_pid(holder) if holder is not None and not token else None
    if stopping and owned and holder is not None and pid is not None:
        live = holder

        def release() -> None:
            finish(task, store, member, task_id, state, drop=True, role="report", token=live, record_ms=record_ms)
            limits.reported_ending(task, store, member, args, kwargs, task_id, live)

        exit_watcher().when_gone(pid, release, within=task.dedup_policy.lock_ttl)
    return owned


def delivery_gone(token: str) -> bool:
    """Whether the delivery that took lock ``token`` cannot be running any more.

    True only for a token of this process table whose process is provably
    dead (:func:`~celery_dedup.worker.processes.owner_gone`), or of this process
    and no longer claimed by its delivery (:func:`~celery_dedup.worker.processes.ended`:
    a sibling thread's lock is alive from before it was taken). Another
    machine's delivery is assumed alive: its lock expires unless renewed.
    """
    return processes.ended(token)
