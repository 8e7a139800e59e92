"""One gated call of a keyed task, the caller's side: peek, gate (atomic or two-phase), publish, answer.

``DedupTask.apply_async`` delegates here once it knows a call is gated. On a
Redis broker the gate runs inside the publish (the transport's ``_put``, see
:mod:`celery_dedup.transports.redis`), and the outcome comes back through the
publish's ticket; with a broker apart from the store the gate has two phases
(hold with a publish lease, publish, confirm). A call the gate did not accept
gets the accepted run: as a duplicate (``dedup_on_duplicate``), a follower or
a join of a debounced burst.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any, cast

import redis
from amqp import exceptions as amqp_exceptions
from celery.utils.saferepr import saferepr
from kombu.exceptions import OperationalError

from .. import decisions, runtime
from ..exceptions import (
    STORE_ERRORS,
    UNREACHABLE,
    DedupFollowerLimitError,
    DedupStoreError,
    DedupUnavailableError,
    DuplicateTaskError,
    server_reply,
    unreachable,
)
from ..header import DEFERS_OPTION, HEADER, UNGATED, GateHeader
from ..keyed import KeyedTask
from ..keys import member_for, new_task_id, split_member
from ..policy import TaskPolicy
from ..store.store import DedupStore, Outcome
from ..worker import relay
from ..worker.delivery import hand_over
from . import mismatch
from .delay import delay_seconds
from .result import DedupResult
from .ticket import open_ticket, report

logger = logging.getLogger("celery_dedup")

#: Publish failures whose outcome :func:`after_lost_reply` finds out (an error reply is told apart there).
_RECOVERABLE: tuple[type[Exception], ...] = (*UNREACHABLE, redis.ResponseError)
_Publish = Callable[[dict[str, Any]], DedupResult]
#: Celery's own publish of the call as run ``run_id`` with ``headers`` (``Task.apply_async``).
Send = Callable[[str, dict[str, Any]], Any]
#: A publish the broker refused: it has no message (py-amqp's negative confirm and channel errors).
_REFUSED: tuple[type[BaseException], ...] = (amqp_exceptions.MessageNacked, amqp_exceptions.ChannelError)

#: Options by which Celery hands a call something to resolve or continue.
_CONTINUATIONS = ("chain", "group_id", "chord")


def carries_continuation(link: Any, link_error: Any, options: Mapping[str, Any]) -> bool:
    """Whether a call carries something to resolve or continue: callbacks, its id in a group or chord, a chain.

    Such a call, as a duplicate, becomes a follower of the accepted run, so
    what it carries runs once that run ends (see the concepts doc).
    """
    return bool(link or link_error or any(options.get(name) for name in _CONTINUATIONS))


def apply_gated(
    task: KeyedTask,
    args: Any,
    kwargs: Any,
    task_id: str | None,
    link: Any,
    link_error: Any,
    options: dict[str, Any],
    send: Send,
    *,
    atomic: bool,
) -> DedupResult:
    """Publish a gated call of ``task`` unless its business key is held (see ``DedupTask.apply_async``).

    ``options`` are the call's; those meant for the gate are taken out of it
    before ``send`` publishes with the rest.
    """
    policy = task.dedup_policy
    app = task.app
    # Celery would add the run to the calling task's children before the
    # gate's answer is known: done below, only for a run this call published.
    parent = bool(options.pop("add_to_parent", True))
    headers = dict(options.pop("headers", None) or {})
    defers = bool(options.pop(DEFERS_OPTION, False))
    previous = GateHeader.decode(headers)
    # Task.retry and deferred copies re-publish the run under its id: it
    # keeps its key, even if the arguments changed.
    continues = previous is not None and task_id is not None
    fingerprint = ""
    if previous is None or task_id is None:
        key, fingerprint = policy.spec.key_and_fingerprint(args, kwargs, fingerprint=policy.compares_arguments)
        member = member_for(task.name, key)
    else:
        member = previous.member
    continues = continues or goes_on(task, task_id, member, headers)
    fingerprint = "" if continues else fingerprint  # a run's own publishes may change its arguments
    business_key = split_member(member)[1]
    # A replacement carrying a replaced run's followers has them to resolve (see relay.py).
    follows = carries_continuation(link, link_error, options) or bool(relay.entries(headers))
    fresh = task_id is None and previous is None and not follows and not policy.mode.parks
    known = peek(task, member, fingerprint) if fresh else None
    if known is not None:
        report("", known)  # answered before any gate: no publish of its own to report it
        return answer(task, known, business_key, "", options, follows=False, fingerprint=fingerprint)
    run_id = task_id or new_task_id(business_key)
    delay = delay_seconds(options.get("countdown"), options.get("eta"))
    gate = task.dedup_gate_header(
        member, delay, continues=continues, defers=defers and continues, follows=follows, fingerprint=fingerprint
    )
    headers[HEADER] = gate.encode()

    def publish(hdrs: dict[str, Any]) -> DedupResult:
        result = send(run_id, hdrs)
        if not isinstance(result, DedupResult):  # an EagerResult (task_always_eager)
            setattr(result, "deduplicated", False)  # noqa: B010 - not declared on EagerResult
        return cast(DedupResult, result)  # otherwise Celery built it with task.AsyncResult

    if atomic:
        try:
            with open_ticket(gate.nonce) as ticket:
                result: DedupResult = publish(headers)
        except _RECOVERABLE as exc:
            return after_lost_reply(task, exc, gate, business_key, run_id)
        if ticket.outcome is None:
            logger.warning("%s[%s] was published without passing the gate (another transport?)", task.name, run_id)
        outcome = ticket.outcome or Outcome(True, run_id)
    else:
        reached, answered = two_phase(task, gate, run_id, args, kwargs, headers, publish)
        if reached is None:  # the store was unreachable, and dedup_on_redis_error answered
            return add_to_parent(task, answered, parent)
        outcome, result = reached, answered
        report(gate.nonce, outcome)  # no transport reports it: the gate ran before the publish
    if not outcome.collapsed:
        runtime.runtime_for(app).recent.saw(member, gate.hold_ms / 1000)
    if not outcome.accepted:
        return answer(task, outcome, business_key, run_id, options, follows=follows, fingerprint=fingerprint)
    decisions.log("accepted", task.name, business_key, run_id)
    return add_to_parent(task, result, parent)


def goes_on(task: KeyedTask, task_id: str | None, member: str, headers: dict[str, Any]) -> bool:
    """Whether this publish is ``Task.replace`` under the run's own key: the replacement goes on as the run.

    The run's own ending then settles its followers: its key leaves the replacement's relay.
    """
    if not hand_over(task_id, member):
        return False
    relay.drop(headers, member)
    return True


def two_phase(
    task: KeyedTask, gate: GateHeader, run_id: str, args: Any, kwargs: Any, headers: dict[str, Any], publish: _Publish
) -> tuple[Outcome | None, DedupResult]:
    """The gate for a broker apart from the store: hold with a lease, publish, confirm.

    Returns the outcome and the published run's result (for a duplicate,
    the result of nothing: only the outcome counts); outcome None when the
    store was unreachable and ``dedup_on_redis_error`` answered instead.
    """
    app = task.app
    config = runtime.config_for(app)
    eager = app.conf.task_always_eager
    try:
        store = runtime.store_for(app)  # a cluster's client connects as it is made
        outcome = store.gate(
            gate.member,
            run_id,
            gate.nonce,
            hold_ms=gate.hold_ms,
            grace_ms=gate.grace_ms,
            argsrepr=saferepr(args) if config.record_args and args else "",
            kwargsrepr=saferepr(kwargs) if config.record_args and kwargs else "",
            continues=gate.continues,
            defers=gate.defers,
            # Eager calls run inside their publish: nothing can be lost between.
            lease_ms=0 if eager else int(config.publish_lease * 1000),
            fingerprint=gate.fingerprint,
        )
    except STORE_ERRORS as exc:
        key = split_member(gate.member)[1]
        if gate.continues and unreachable(exc):
            # A retry of a run accepted before (a worker that could not reach the store, say):
            # its delivery is guarded as any, so it goes on without the hold being stretched.
            logger.warning("%s[%s]: dedup store unreachable; the run goes on unconfirmed (%s)", task.name, run_id, exc)
            headers[HEADER] = dataclasses.replace(gate, held=True).encode()
            return None, publish(headers)
        return None, store_unreachable(task, exc, key, run_id, headers, publish)
    if not outcome.accepted:
        return outcome, task.AsyncResult(outcome.task_id)
    headers[HEADER] = dataclasses.replace(gate, held=True).encode()
    result = publish_or_unclaim(task, store, gate, run_id, headers, publish)
    return (outcome if eager else confirm(task, store, gate, run_id)), result


def answer(
    task: KeyedTask,
    outcome: Outcome,
    key: str,
    run_id: str,
    options: dict[str, Any],
    *,
    follows: bool,
    fingerprint: str = "",
) -> DedupResult:
    """What a call the gate did not accept gets: the accepted run, as a duplicate, a follower or a join.

    ``fingerprint``: the call's arguments fingerprint; one that differs from
    the run's warns or raises (``dedup_on_mismatch``, see :mod:`.mismatch`).
    """
    mismatch.check(task, key, fingerprint, outcome, options, raises=not (outcome.followed or outcome.collapsed))
    if outcome.refused:
        limit = runtime.config_for(task.app).max_followers
        raise DedupFollowerLimitError(task.name, key, outcome.task_id, limit)
    if outcome.followed:
        decisions.log("followed", task.name, key, run_id, f"resolves as run {outcome.task_id} ends")
        return task._marked(outcome.task_id)
    if outcome.collapsed:
        decisions.log("collapsed", task.name, key, outcome.task_id, "joined the burst of its run")
        return task._marked(outcome.task_id)
    return on_duplicate(task, task.dedup_policy, key, outcome.task_id, options, follows=follows)


def peek(task: KeyedTask, member: str, fingerprint: str = "") -> Outcome | None:
    """A duplicate's outcome (the accepted run) if ``member`` is held, asked before any message is built.

    Asked only for keys this process saw held lately (a hint, never
    trusted: the server answers); a key freed since costs this one extra
    round trip. ``fingerprint`` is compared as the gate would.
    """
    recent = runtime.runtime_for(task.app).recent
    if not recent.hint(member):
        return None
    try:
        known = runtime.store_for(task.app).peek(member, fingerprint)
    except STORE_ERRORS:
        return None  # the gate decides, with its own error handling
    if known is None:
        recent.forget(member)
    return known


def publish_or_unclaim(
    task: KeyedTask, store: DedupStore, gate: GateHeader, run_id: str, headers: dict[str, Any], publish: _Publish
) -> DedupResult:
    """Second step of the two-phase gate: publish, and drop the key if nothing was published.

    An error raised after the broker took the message (a failed
    ``task-sent`` event), or after the run began (eager mode, where
    publishing runs the task and ``task_eager_propagates`` re-raises its
    error), is no failed publish: the key and record stay with the run,
    whose ending the guard records. A connection that broke mid-publish
    may have delivered the message: the key keeps its publish lease, so
    that message, if it arrives, runs once. A crash between holding and
    publishing leaves the key held until the lease ends.
    """
    member = gate.member
    with open_ticket(gate.nonce) as ticket:
        try:
            return publish(headers)
        except BaseException as exc:
            if ticket.sent:
                logger.warning(
                    "%s[%s] was published, but publishing raised afterwards; key %r stays with the run",
                    task.name,
                    run_id,
                    member,
                )
                if not task.app.conf.task_always_eager:
                    confirm(task, store, gate, run_id)
                raise
            if outcome_unknown(task, exc):
                logger.warning(
                    "%s[%s]: the publish failed where the broker may have taken the message (%r); key %r "
                    "stays held until its publish lease ends",
                    task.name,
                    run_id,
                    exc,
                    member,
                )
                raise
            try:
                store.unclaim(member, run_id)  # only while the run has not begun (see finish.lua)
            except STORE_ERRORS:
                logger.exception("could not drop key %r after a failed publish; its lease frees it", member)
            raise


def outcome_unknown(task: KeyedTask, exc: BaseException) -> bool:
    """Whether a failed publish may have reached the broker: the connection broke or timed out.

    Not when the broker said no (a negative publisher confirm, a channel
    error), however kombu wrapped that after its retries.
    """
    chain: list[BaseException] = []
    cause: BaseException | None = exc
    while cause is not None and cause not in chain:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    if any(isinstance(error, _REFUSED) for error in chain):
        return False
    broken: tuple[type[BaseException], ...] = (OSError, OperationalError)
    with contextlib.suppress(Exception):
        broken += tuple(task.app.connection_for_write().connection_errors)
    return isinstance(exc, broken)


def confirm(task: KeyedTask, store: DedupStore, gate: GateHeader, run_id: str) -> Outcome:
    """Third step of the two-phase gate: the broker has the message, so the key gets its full hold.

    A run a worker began (or ended) before its confirm keeps its caller,
    even if a newer run has its key since. Only if the lease ended and
    another call took the key before this run began does that call's run
    stand for this one (the guard skips this run's message).
    """
    try:
        confirmed = store.confirm(gate.member, run_id, gate.nonce, hold_ms=gate.hold_ms, grace_ms=gate.grace_ms)
    except STORE_ERRORS:
        logger.exception(
            "%s[%s] was published, but its key %r could not be confirmed: it stays held until its publish lease ends",
            task.name,
            run_id,
            gate.member,
        )
        return Outcome(True, run_id)
    if confirmed.accepted or not confirmed.task_id:
        return Outcome(True, run_id)
    logger.warning(
        "%s[%s] was published after its publish lease ended; key %r belongs to run %s now, which stands for it",
        task.name,
        run_id,
        gate.member,
        confirmed.task_id,
    )
    return confirmed


def add_to_parent(task: KeyedTask, result: DedupResult, add_to_parent: bool) -> DedupResult:
    """Add a run this call published to the calling task's children, as Celery's ``send_task`` does.

    Never a duplicate's: its id was not published, and the accepted run
    belongs to whichever call published it (naming it here could even make
    a task its own child). Eager runs are not added, as in Celery.
    """
    app = task.app
    parent = app.current_worker_task if add_to_parent else None
    if parent is not None and not app.conf.task_always_eager:
        parent.add_trail(result)
    return result


def after_lost_reply(task: KeyedTask, exc: Exception, gate: GateHeader, key: str, run_id: str) -> DedupResult:
    """The gated publish failed on the Redis broker: find out whether the gate ran.

    A connection can break after the script ran but before its reply
    arrived. The record then carries this publish's nonce, and the caller
    gets the accepted run. The broker is the store here, so there is no
    ungated fallback (``dedup_on_redis_error`` governs a separate store).
    """
    reply = server_reply(exc)
    if reply is not None:  # not lost: the broker answered with an error (OOM, NOPERM...)
        raise DedupStoreError(task.name, key, reply) from exc
    store = runtime.store_for(task.app).with_prefix(gate.prefix)
    try:
        record = store.record(gate.member)
    except redis.RedisError:
        raise DedupUnavailableError(task.name, key, exc, published=None) from exc
    if record is not None and gate.nonce in (record.get("nonce"), *record.get("nonces", "").split()):
        logger.info("%s key %r: publish reply lost, but the gate accepted %s", task.name, key, run_id)
        report(gate.nonce, Outcome(True, run_id))
        return task.AsyncResult(run_id)
    if record is not None and gate.nonce == record.get("joined_nonce"):
        logger.info("%s key %r: publish reply lost; the call joined %s", task.name, key, record["task_id"])
        report(gate.nonce, Outcome(False, record["task_id"], collapsed=True))
        return task._marked(record["task_id"])
    raise DedupUnavailableError(task.name, key, exc, published=False) from exc


def store_unreachable(
    task: KeyedTask, exc: Exception, key: str, run_id: str, headers: dict[str, Any], publish: _Publish
) -> DedupResult:
    """The separate dedup store is unreachable: ``dedup_on_redis_error`` decides.

    A store that answered with an error reply is not unreachable: that is a
    DedupStoreError under either policy, and nothing is published.
    """
    if not unreachable(exc):
        raise DedupStoreError(task.name, key, exc) from exc
    app = task.app
    if runtime.config_for(app).on_redis_error == "fail_closed":
        raise DedupUnavailableError(task.name, key, exc, published=False) from exc
    runtime.count_fail_open(app, task.name)
    decisions.log("fail_open", task.name, key, run_id, f"dedup store unreachable, published ungated ({exc})")
    headers[HEADER] = UNGATED  # not a gate header, and tells the publish hook to leave it alone
    return publish(headers)


def on_duplicate(
    task: KeyedTask, policy: TaskPolicy, key: str, existing_id: str, options: dict[str, Any], *, follows: bool = False
) -> DedupResult:
    # Canvas dispatch on a worker (chain/link callbacks) passes parent_id;
    # raising there would fail the parent task, so it gets the result instead.
    if policy.on_duplicate == "raise" and "parent_id" not in options:
        decisions.log("deduplicated", task.name, key, existing_id, "already accepted (raise)")
        raise DuplicateTaskError(task.name, key, existing_id)
    if follows:
        logger.warning(
            "duplicate %s key %r carries something to continue (a group or chord member, callbacks, a "
            "chain) but cannot follow run %s (no Redis broker, or dedup_max_followers=0): it will not run",
            task.name,
            key,
            existing_id,
        )
    decisions.log("deduplicated", task.name, key, existing_id, f"already accepted ({policy.on_duplicate})")
    return task._marked(existing_id)
