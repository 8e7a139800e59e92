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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import redis
from celery.exceptions import Ignore, Reject, Retry

from . import decisions, runtime
from .exceptions import UNREACHABLE, DedupError, DedupStoreError, DedupUnavailableError
from .gate import GateHeader, call_payload, decode_payload
from .keys import member_for, split_member
from .lock import ExecutionLock, new_token, renewer
from .store import DedupStore, StartDecision

if TYPE_CHECKING:
    from .task import DedupTask

logger = logging.getLogger("celery_dedup")

SUCCEEDED, FAILED, RETRY, REVOKED = "succeeded", "failed", "retry", "revoked"
REJECTED, IGNORED, LOST, SKIPPED = "rejected", "ignored", "lost", "skipped"
_ERROR_LIMIT = 500


def _key(member: str) -> str:
    return split_member(member)[1]


def error_summary(exc: BaseException) -> str:
    """``Type: message`` of an exception, truncated for the status record."""
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= _ERROR_LIMIT else text[: _ERROR_LIMIT - 3] + "..."


def locate(task: DedupTask, headers: Any, args: Any, kwargs: Any) -> tuple[str, DedupStore, bool] | None:
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
    task: DedupTask, args: tuple[Any, ...], kwargs: dict[str, Any], body: Callable[[Any, Any], Any]
) -> Any:
    """Run ``body(args, kwargs)`` for the current request under the guard.

    A debounced run (``dedup_debounce="latest"``) runs with the arguments
    its burst's newest call left in the record instead of its message's.
    """
    request = task.request
    task_id = request.id
    if task_id is None or request.called_directly:
        return body(args, kwargs)
    located = locate(task, request.headers, request.args, request.kwargs)
    if located is None:
        return body(args, kwargs)
    member, store, gated = located
    policy = task.dedup_policy
    token = new_token()
    lock_ms = int(policy.lock_ttl * 1000)
    record_ms = runtime.config_for(task.app).record_ms
    try:
        decision = start(task, store, member, gated, token, lock_ms, record_ms)
    except redis.RedisError as exc:
        return store_unreachable(task, store, member, exc, args, kwargs, body)
    if not decision.run:
        refuse(task, store, member, decision)
    keeper = renewer()
    lock = ExecutionLock(store, member, token, lock_ms, record_ms, now=keeper.clock())
    keeper.add(lock)
    _running[task_id] = lock

    def end(state: str, *, drop: bool, error: str = "") -> None:
        keeper.remove(lock)
        _running.pop(task_id, None)
        payload = kept_payload(task, state, args, kwargs)
        finish(
            task,
            store,
            member,
            task_id,
            state,
            drop=drop,
            token=token,
            error=error,
            record_ms=record_ms,
            payload=payload,
        )

    try:
        if decision.payload:
            latest, kwargs = decode_payload(task.app, decision.payload)
            args = tuple(latest)
            request.args, request.kwargs = latest, kwargs
        result = body(args, kwargs)
    except (SystemExit, KeyboardInterrupt):
        # The process is being torn down (hard time limit, terminate, shutdown):
        # the worker's main process reports how this run ended, releasing the lock.
        keeper.remove(lock)
        _running.pop(task_id, None)
        raise
    except Retry:
        end(RETRY, drop=False)  # the retry was published under this run's key
        raise
    except Reject as exc:
        requeue = bool(getattr(exc, "requeue", False))
        end(RETRY if requeue else REJECTED, drop=not requeue)
        raise
    except Ignore:
        end(IGNORED, drop=True)
        raise
    except BaseException as exc:
        end(FAILED, drop=True, error=error_summary(exc))
        raise
    end(SUCCEEDED, drop=not policy.mode.holds_after_success)
    return result


def start(
    task: DedupTask, store: DedupStore, member: str, gated: bool, token: str, lock_ms: int, record_ms: int
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
        task_name=task.name,
        record_ms=record_ms,
        want_payload=policy.mode.parks and policy.debounce == "latest",
        on_locked=policy.on_locked,
    )


def store_unreachable(
    task: DedupTask,
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
    task: DedupTask, store: DedupStore, member: str, exc: redis.RedisError, args: Any, kwargs: Any
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
        token="",
        record_ms=record_ms,
        error=summary,
        payload=payload,
    )
    raise error from exc


#: The lock of each run executing in this process, by task id. Kept off the
#: request: Celery copies request attributes into a retry's headers.
_running: dict[str, ExecutionLock] = {}


def lock_lost(task_id: str | None) -> bool:
    """Whether the run ``task_id`` executing in this process has lost its lock."""
    lock = _running.get(task_id) if task_id is not None else None
    return lock is not None and lock.lost.is_set()


def refuse(task: DedupTask, store: DedupStore, member: str, decision: StartDecision) -> None:
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
        finish(task, store, member, str(request.id), SKIPPED, drop=True, token="", record_ms=record_ms)
    raise Ignore()


def defer(task: DedupTask, key: str, lock_pttl_ms: int) -> None:
    """Re-publish this run to arrive once the lock that blocks it would have expired.

    If the holder is alive it will have finished (the copy is then skipped as
    done); if it died, the copy runs. ``retries`` is unchanged: this is not a
    retry of the run.
    """
    request = task.request
    countdown = max(lock_pttl_ms, 0) / 1000 + random.uniform(0.2, 1.0)
    decisions.log("deferred", task.name, key, request.id, f"execution lock held elsewhere; again in {countdown:.1f}s")
    task.signature_from_request(request, countdown=countdown).apply_async()


#: Endings after which an operator may want to run the call again (see operations.requeue).
_REQUEUABLE = frozenset({FAILED, REJECTED, REVOKED, LOST})


def kept_payload(task: DedupTask, state: str, args: Any, kwargs: Any) -> str:
    """The call's payload for a record ending in ``state``, if arguments are recorded at all."""
    if state not in _REQUEUABLE or not runtime.config_for(task.app).record_args:
        return ""
    try:
        return call_payload(task.app, task.serializer, args, kwargs)
    except Exception:  # an argument the serializer refuses must not hide how the run ended
        logger.exception("%s: could not keep the arguments of a run that ended %s", task.name, state)
        return ""


def finish(
    task: DedupTask,
    store: DedupStore,
    member: str,
    task_id: str,
    state: str,
    *,
    drop: bool,
    token: str,
    record_ms: int,
    error: str = "",
    payload: str = "",
) -> bool:
    """Record a run's ending; store errors are logged (the key then expires by its TTL)."""
    try:
        owned, lock_kept = store.finish(
            member, task_id, state, drop=drop, record_ms=record_ms, token=token, error=error, payload=payload
        )
    except redis.RedisError:
        logger.exception(
            "could not record %s for %s[%s] key %r; it expires by its TTL", state, task.name, task_id, member
        )
        return False
    if not lock_kept:
        decisions.log("lock_lost", task.name, _key(member), task_id, f"ended {state} after losing its execution lock")
    if not owned:
        logger.info("%s[%s] ended (%s) but key %r belongs to another run", task.name, task_id, state, member)
    return owned


def settle_elsewhere(
    task: DedupTask, state: str, task_id: str, headers: Any, args: Any, kwargs: Any, *, worker_gone: bool
) -> bool:
    """Record an ending the body never returned from (revoked, lost worker, hard time limit).

    With ``worker_gone`` the run's lock is released too, but only if the
    process that took it is gone: a report can arrive after another delivery
    of the same run (a redelivered copy) took the lock, and that copy's lock
    and record are its own.
    """
    located = locate(task, headers, args, kwargs)
    if located is None:
        return False
    member, store, _ = located
    record_ms = runtime.config_for(task.app).record_ms
    token = ""
    if worker_gone:
        try:
            record = store.record(member) or {}
        except redis.RedisError:
            logger.exception("could not read the record of %s[%s] key %r", task.name, task_id, member)
            return False
        holder = record.get("lock", "")
        if record.get("task_id") == task_id and holder and held_elsewhere(holder):
            logger.info(
                "%s[%s] key %r: %s reported, but a live delivery holds the lock; left to it",
                task.name,
                task_id,
                member,
                state,
            )
            return False
        token = holder
    payload = kept_payload(task, state, args, kwargs)
    return finish(task, store, member, task_id, state, drop=True, token=token, record_ms=record_ms, payload=payload)


def held_elsewhere(token: str) -> bool:
    """Whether lock ``token`` belongs to a live delivery other than this worker's own.

    The token names the host and process that took it (``lock.new_token``).
    A process of this worker (itself, or a pool child it is tearing down for a
    time limit or a terminate) does not count, nor does a dead or zombie one;
    another host's process is assumed alive (its lock expires if not).
    """
    host, _, rest = token.partition(":")
    pid_text = rest.partition(":")[0]
    if host != socket.gethostname() or not pid_text.isdigit():
        return True
    pid = int(pid_text)
    if pid == os.getpid():
        return False
    if not os.path.isdir("/proc"):  # no process table to read: only "exists" can be asked
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True  # cannot tell a child being torn down: its lock expires within one TTL
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            fields = stat.read().rpartition(")")[2].split()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    state, parent = fields[0], int(fields[1])
    return state != "Z" and parent != os.getpid()
