"""One delivery of a keyed task: whether it may run, its body under the execution lock, how it ended.

A :class:`Delivery` is built once per execution with everything it knows
(task, request, member, store, token, lock) and goes through :meth:`~Delivery.start`
(decide, take the lock, mark the record started), :meth:`~Delivery.run` (the
body, its lock renewed) and :meth:`~Delivery.end` (record the ending, give
back the lock, drop or keep the key): two round trips per execution, plus one
renewal call per lock TTL fraction for long runs. Only the start is always
waited for: a success that nothing after the body depends on is sent
without waiting, and its reply read when the task's trace ends
(``results.awaits_nothing``).

A delivery that may not run is acknowledged (``Ignore``: no result is stored
over the real run's), counted in the record's ``skipped`` field, and logged;
one that finds another delivery of the same run holding the lock is deferred
until that lock would have expired, so a copy is never lost to a worker that
died while holding it.

What else takes part in a delivery (the limits, :mod:`.limits`) does so as a
:class:`Participant`: asked before the start, told after the end. This module
knows nothing of what a participant holds.
"""

from __future__ import annotations

import enum
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple, NoReturn, Protocol, cast

import redis
from celery.exceptions import Ignore, Reject, Retry
from kombu.utils.json import loads

from .. import decisions, runtime
from ..exceptions import (
    UNREACHABLE,
    DedupError,
    DedupFollowerError,
    DedupLockLostError,
    DedupStoreError,
    DedupUnavailableError,
)
from ..header import DEFERS_OPTION, GateHeader
from ..keyed import KeyedTask
from ..keys import member_for, split_member
from ..payloads import call_payload, decode_payload, decode_result, result_payload
from ..store.store import BackendResult, DedupStore, Finished, StartDecision
from . import processes, recovery, results
from .lock import ExecutionLock, renewer
from .processes import exit_watcher, owner_gone, token_pid

logger = logging.getLogger("celery_dedup")

SUCCEEDED, FAILED, RETRY, REVOKED = "succeeded", "failed", "retry", "revoked"
REJECTED, IGNORED, LOST, SKIPPED = "rejected", "ignored", "lost", "skipped"
QUEUED, REPLACED = "queued", "replaced"
_ERROR_LIMIT = 500

Body = Callable[[Any, Any], Any]


def _key(member: str) -> str:
    return split_member(member)[1]


def error_summary(exc: BaseException) -> str:
    """``Type: message`` of an exception, truncated for the status record."""
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= _ERROR_LIMIT else text[: _ERROR_LIMIT - 3] + "..."


def locate(task: KeyedTask, headers: Any, args: Any, kwargs: Any) -> tuple[str, DedupStore, bool] | None:
    """``(member, store, gated)`` of a delivery: from its ``dedup`` header, else from its arguments."""
    located = _locate(task, GateHeader.decode(headers), args, kwargs)
    return None if located is None else (located[0], located[1], located[2] is not None)


def _locate(
    task: KeyedTask, gate: GateHeader | None, args: Any, kwargs: Any
) -> tuple[str, DedupStore, GateHeader | None] | None:
    """:func:`locate` from a decoded ``gate``, which it returns in place of ``gated``."""
    store = runtime.store_for(task.app)
    if gate is not None:
        return gate.member, store.with_prefix(gate.prefix), gate
    try:
        return member_for(task.name, task.dedup_policy.spec.business_key(args, kwargs)), store, None
    except DedupError:
        logger.exception("%s: cannot derive the key of this delivery; it runs unguarded", task.name)
        return None


class Participant(Protocol):
    """Something that takes part in every delivery of a task (its limits): asked before, told after.

    What it takes for a delivery it keeps in ``delivery.held[participant]``.
    """

    def before_start(self, delivery: Delivery) -> bool:
        """Admit ``delivery`` (True), or have it wait (False: the participant re-published it for later).

        A delivery that waits takes nothing else. An exception ends the start:
        the participants admitted before are told (:meth:`after_end`, not ran).
        """
        ...

    def after_end(self, delivery: Delivery, *, ran: bool) -> None:
        """``delivery`` ended (``ran``: its body ran) or will not run: give back what it took. Never raises."""
        ...

    def after_report(self, report: Report) -> None:
        """An ending reported from outside the body (revoked, a lost worker, a hard time limit). Never raises."""
        ...


class Report(NamedTuple):
    """An ending reported for a run whose body never returned it (see :func:`settle_elsewhere`)."""

    task: KeyedTask
    store: DedupStore
    #: The run's member ("": a task without a key, limits only).
    member: str
    args: Any
    kwargs: Any
    run_id: str
    #: The token whose lock and slots may be given back (its process is gone); "": none.
    token: str


def participants_of(task: KeyedTask) -> tuple[Participant, ...]:
    """What takes part in the deliveries of ``task`` (``DedupTask.worker_participants``)."""
    return cast("tuple[Participant, ...]", tuple(getattr(task, "worker_participants", ())))


class Ending(NamedTuple):
    """How a delivery's body ended, as its record says it."""

    state: str
    #: Free the key now (else it stays held to its deadline).
    drop: bool
    error: str = ""
    note: str = ""


@dataclass
class Replacement:
    """A running run that is replacing itself (``Task.replace``)."""

    member: str
    #: What replaces it, for the record's history.
    by: str
    #: The replacement goes on under this run's key and id: the run's lock was
    #: released and its record set back to queued before it was published.
    handed_over: bool = False


class Verdict(enum.Enum):
    """What :meth:`Delivery.start` decided (a delivery that may not run raises ``Ignore`` instead)."""

    #: The body runs under the lock, which the delivery now holds.
    RUN = "run"
    #: A follower: it resolves as the run it follows ended, without running the body.
    FOLLOW = "follow"
    #: The store is unreachable and ``dedup_on_redis_error="fail_open"``: the body runs unguarded.
    UNGUARDED = "unguarded"


#: The deliveries of this process, by token: from the claim of their token (before any store call
#: can reveal it) until they let go of their lock and slots. The one registry of per-delivery state.
_live: dict[str, Delivery] = {}


def live(run_id: str) -> list[Delivery]:
    """The deliveries of run ``run_id`` in this process, oldest first."""
    return [delivery for delivery in list(_live.values()) if delivery.run_id == run_id]


class _Executing(threading.local):
    """The delivery whose body this thread (or greenlet: the pools patch ``threading.local``) executes."""

    delivery: Delivery | None = None


_executing = _Executing()


def running(run_id: str | None) -> Delivery | None:
    """The delivery whose body this thread or greenlet is executing, if it runs run ``run_id``.

    Found through the thread of execution, never by run id alone: two deliveries of one run in one process
    (a copy and the original, in a threads or gevent pool) each see their own. (Not through the task's
    request: a ``__call__`` between DedupTask's and the body, Celery's own for one, runs the body under a
    copy of the request the delivery saw.)
    """
    found = _executing.delivery
    if found is not None and found.running and run_id is not None and found.run_id == run_id:
        return found
    return None


class Delivery:
    """One execution of a task's message in this process, from its start decision to its recorded ending."""

    def __init__(
        self,
        task: KeyedTask,
        args: Any,
        kwargs: Any,
        body: Body,
        *,
        member: str | None,
        store: DedupStore,
        gated: bool,
        participants: Sequence[Participant] = (),
        gate: GateHeader | None = None,
    ) -> None:
        self.task = task
        self.request = request = task.request
        self.run_id = str(request.id)
        self.args = args
        self.kwargs = kwargs
        self.body = body
        #: The run's member; None for a task without a key (``dedup_mode="off"``: limits only).
        self.member = member
        self.store = store
        self.gated = gated
        #: The message's gate header, decoded (None: a delivery not gated, or not asked).
        self.gate = gate
        self.participants = tuple(participants)
        self.policy = policy = task.dedup_policy
        self.lock_ms = int(policy.lock_ttl * 1000)
        self.config = config = runtime.config_for(task.app)
        self.record_ms = config.record_ms
        #: Claimed (:func:`~.processes.claim`) by :meth:`start`.
        self.token = ""
        self.decision: StartDecision | None = None
        self.lock: ExecutionLock | None = None
        #: Whether its body runs (from the lock taken to the ending recorded).
        self.running = False
        self.replacement: Replacement | None = None
        #: What each participant took for this delivery, by participant (see :class:`Participant`).
        self.held: dict[object, Any] = {}
        self._admitted: list[Participant] = []

    def __repr__(self) -> str:
        return f"<Delivery {self.task.name}[{self.run_id}] {self.member!r} token={self.token!r}>"

    @classmethod
    def of(cls, task: KeyedTask, args: Any, kwargs: Any, body: Body) -> Delivery | None:
        """The delivery of ``task``'s current request; None if its key cannot be derived (it runs unguarded)."""
        request = task.request
        located = _locate(task, GateHeader.decode(request.headers), request.args, request.kwargs)
        if located is None:
            return None
        member, store, gate = located
        return cls(
            task,
            args,
            kwargs,
            body,
            member=member,
            store=store,
            gated=gate is not None,
            participants=participants_of(task),
            gate=gate,
        )

    @property
    def key(self) -> str:
        return _key(self.member) if self.member else ""

    # -- the token and the participants ----------------------------------------------------------

    def claim(self) -> None:
        """Claim this delivery's token, registered before any store call can reveal it."""
        self.token = processes.claim()
        _live[self.token] = self

    def retire(self) -> None:
        """It let go of its lock and slots (or left them to expire): its token has ended."""
        _live.pop(self.token, None)
        processes.retire(self.token)

    def admit(self) -> bool:
        """Ask every participant, in order; False if one has it wait (those admitted before give back)."""
        for participant in self.participants:
            try:
                admitted = participant.before_start(self)
            except BaseException:
                self.leave(ran=False)
                raise
            if not admitted:
                self.leave(ran=False)
                return False
            self._admitted.append(participant)
        return True

    def leave(self, *, ran: bool) -> None:
        """Tell the participants that admitted it that it ended (``ran``) or will not run; once."""
        admitted, self._admitted = self._admitted, []
        for participant in reversed(admitted):
            participant.after_end(self, ran=ran)

    # -- start ---------------------------------------------------------------------------------

    def __call__(self) -> Any:
        """Start, then run the body (or resolve as a follower): what the task's call returns."""
        verdict = self.start()
        if verdict is Verdict.FOLLOW:
            return self.follow()
        if verdict is Verdict.UNGUARDED:
            return self.body(self.args, self.kwargs)
        return self.run()

    def start(self) -> Verdict:
        """Decide whether this delivery runs: run (it holds the lock), follow, or run unguarded (fail-open).

        Raises ``Ignore`` for one that may not run (skipped, deferred, waiting
        for its limits); a store that answered with an error fails it.
        """
        assert self.member is not None, "a delivery without a key has no start decision"
        self.claim()
        try:
            decision = self._admitted_start()
        except redis.RedisError as exc:
            return self.store_unreachable(exc)
        self.decision = decision
        if decision.code == StartDecision.FOLLOW:
            return Verdict.FOLLOW
        if not decision.run:
            self.refuse(decision)
        keeper = renewer()
        self.lock = ExecutionLock(self.store, self.member, self.token, self.lock_ms, self.record_ms, now=keeper.clock())
        keeper.add(self.lock)
        self.running = True
        return Verdict.RUN

    def _admitted_start(self) -> StartDecision:
        """The participants, then :meth:`begin`: a run that must wait takes nothing else (``Ignore``, re-published).

        A delivery the guard then refuses gives back what participants gave it
        at once. A delivery that takes nothing (it waits, is refused, or the
        store failed) retires its token.
        """
        try:
            admitted = self.admit()
        except BaseException:
            self.retire()
            raise
        if not admitted:
            self.retire()
            raise Ignore()
        try:
            decision = self.begin()
        except BaseException:
            self.leave(ran=False)
            self.retire()
            raise
        if not decision.run:
            self.leave(ran=False)
            self.retire()
        return decision

    def ask(self) -> StartDecision:
        """Ask the store whether this delivery may run; if so, it now holds the lock ``token``."""
        request = self.request
        policy = self.policy
        gate = self.gate
        assert self.member is not None
        return self.store.start(
            self.member,
            self.run_id,
            self.token,
            lock_ms=self.lock_ms,
            gated=self.gated,
            key_mode=policy.mode.key_on_start,
            hostname=request.hostname or socket.gethostname(),
            pid=os.getpid(),
            retries=request.retries or 0,
            record_ms=self.record_ms,
            want_payload=policy.mode.parks and policy.debounce == "latest",
            on_locked=policy.on_locked,
            # Its publisher (gate header) and this app both allow the arguments to be kept.
            keep_payload=self.config.record_args and (gate is None or gate.record_args),
            main=recovery.main_token(),
            delivery=recovery.delivery(self.task),
        )

    def begin(self) -> StartDecision:
        """:meth:`ask`, and if a lock whose owner is provably dead refused it, :meth:`take_over`.

        The common path stays one round trip; only a refusal asks the process table.
        """
        decision = self.ask()
        if decision.holder and owner_gone(decision.holder):
            return self.take_over(decision)
        return decision

    def take_over(self, refused: StartDecision) -> StartDecision:
        """Take over the lock that refused this delivery, whose owner is provably dead, and start again.

        The refusal is uncounted; the takeover is counted (``taken_over``) and the
        dead run's record says ``lost ... taken over from <token>``. If the lock
        changed meanwhile (released, or another delivery's now), the refusal stands.
        """
        assert self.member is not None
        locked = refused.code == StartDecision.LOCKED or self.policy.on_locked == "reschedule"
        if not self.store.take_over(self.member, refused.holder, refused="deferred" if locked else "skipped"):
            return refused
        decisions.log(
            "taken_over", self.task.name, self.key, self.request.id, f"from {refused.holder}, whose process is gone"
        )
        return self.ask()

    def refuse(self, decision: StartDecision) -> NoReturn:
        """Acknowledge a delivery that may not run (raises Ignore), deferring it where it might be needed."""
        assert self.member is not None
        task, request, code, key = self.task, self.request, decision.code, self.key
        if code == StartDecision.DONE:
            decisions.log("skipped", task.name, key, request.id, f"a delivery of a run that already {decision.detail}")
        elif code == StartDecision.SUPERSEDED:
            decisions.log("skipped", task.name, key, request.id, f"the key belongs to run {decision.detail} now")
        elif code == StartDecision.LOCKED or self.policy.on_locked == "reschedule":
            self.defer(int(decision.detail))
        else:
            decisions.log("skipped", task.name, key, request.id, "another run holds the execution lock")
            record(
                task, self.store, self.member, self.run_id, SKIPPED, drop=True, role="report", record_ms=self.record_ms
            )
        raise Ignore()

    def defer(self, lock_pttl_ms: int) -> None:
        """Re-publish this run to arrive once the lock that blocks it would have expired.

        If the holder is alive it will have finished (the copy is then skipped as
        done); if it died, the copy runs. ``retries`` is unchanged: this is not a
        retry of the run.
        """
        task, request = self.task, self.request
        countdown = max(lock_pttl_ms, 0) / 1000 + random.uniform(0.2, 1.0)
        decisions.log(
            "deferred", task.name, self.key, request.id, f"execution lock held elsewhere; again in {countdown:.1f}s"
        )
        task.signature_from_request(request, countdown=countdown).apply_async(**{DEFERS_OPTION: True})

    def store_unreachable(self, exc: redis.RedisError) -> Verdict:
        """The store failed when this delivery starts: if unreachable, ``dedup_on_redis_error`` decides.

        ``fail_open`` runs the body unguarded (logged, counted); ``fail_closed``
        retries the delivery later instead of running it without a lock. A store
        that answered with an error is no outage: see :meth:`store_refused`.
        """
        if not isinstance(exc, UNREACHABLE):
            self.store_refused(exc)
        task = self.task
        app = task.app
        if runtime.config_for(app).on_redis_error == "fail_open":
            runtime.count_fail_open(app, task.name)
            decisions.log(
                "fail_open", task.name, self.key, self.request.id, f"dedup store unreachable, ran unguarded ({exc})"
            )
            return Verdict.UNGUARDED
        unavailable = DedupUnavailableError(task.name, str(self.member), exc, published=False)
        raise task.retry(exc=unavailable, countdown=max(self.policy.lock_ttl / 3, 1.0))

    def store_refused(self, exc: redis.RedisError) -> NoReturn:
        """The store answered this delivery's start with an error reply (OOM, NOPERM, WRONGTYPE...): fail it.

        Whatever ``dedup_on_redis_error`` says: the server is up, so the body does
        not run unguarded, and a retry would be published through the same store.
        The failure is recorded if the store takes that (with the call, for a
        re-enqueue once the server is fixed); the message is acknowledged.
        """
        assert self.member is not None
        task = self.task
        error = DedupStoreError(task.name, self.key, exc)
        logger.error("%s[%s]: not run: %s", task.name, self.request.id, error)
        record(
            task,
            self.store,
            self.member,
            self.run_id,
            FAILED,
            drop=True,
            role="report",
            record_ms=self.record_ms,
            error=error_summary(error),
            payload=kept_payload(task, FAILED, self.args, self.kwargs),
        )
        raise error from exc

    def follow(self) -> Any:
        """A follower's delivery: resolve as the run it followed ended, without running the body.

        Its return value is that run's (so Celery stores it under the follower's
        id, applies its callbacks, goes on with its chain and counts it in its
        chord); a run that did not succeed fails it with :class:`DedupFollowerError`.
        """
        assert self.decision is not None
        task, decision = self.task, self.decision
        run_id = decision.detail
        outcome = loads(decision.payload) if decision.payload else {}
        state = str(outcome.get("state") or "")
        decisions.log(
            "followed", task.name, self.key, self.request.id, f"resolved as run {run_id} ended: {state or '?'}"
        )
        if state == SUCCEEDED and outcome.get("result"):
            return decode_result(task.app, str(outcome["result"]))
        reason = str(outcome.get("error") or "") or ("" if state else "its ending was not recorded")
        raise DedupFollowerError(task.name, self.key, run_id, state or "lost", reason)

    # -- run -----------------------------------------------------------------------------------

    def run(self) -> Any:
        """Run the body under the lock (renewed meanwhile), and record how it ended.

        A debounced run (``dedup_debounce="latest"``) runs with the arguments
        its burst's newest call left in the record instead of its message's.
        """
        try:
            if self.decision is not None and self.decision.payload:
                latest, self.kwargs = decode_payload(self.task.app, self.decision.payload)
                self.args = tuple(latest)
                self.request.args, self.request.kwargs = latest, self.kwargs
            outer, _executing.delivery = _executing.delivery, self
            try:
                value = self.body(self.args, self.kwargs)
            finally:
                _executing.delivery = outer
        except (SystemExit, KeyboardInterrupt):
            # The process is being torn down (hard time limit, terminate, shutdown):
            # the worker's main process reports how this run ended, releasing the lock.
            self.abandon()
            raise
        except DedupLockLostError as exc:
            # A step (worker/steps.py) found this delivery's lock lost: it stands down and ends nothing.
            # Another delivery runs the run (or will), or the reaper marks it lost; no result is stored
            # over theirs.
            self.abandon()
            raise Ignore() from exc
        except BaseException as exc:
            self.end(self.ending_of(exc))
            raise
        self.end(Ending(SUCCEEDED, drop=not self.policy.mode.holds_after_success), value)
        return value

    def ending_of(self, exc: BaseException) -> Ending:
        """The ending of a body that raised ``exc``."""
        if isinstance(exc, Retry):
            return Ending(RETRY, drop=False)  # the retry was published under this run's key
        if isinstance(exc, Reject):
            requeue = bool(getattr(exc, "requeue", False))
            return Ending(RETRY, drop=False) if requeue else Ending(REJECTED, drop=True)
        if isinstance(exc, Ignore):
            if self.replacement is None:
                return Ending(IGNORED, drop=True)
            return Ending(REPLACED, drop=True, note=f"by {self.replacement.by}")
        return Ending(FAILED, drop=True, error=error_summary(exc))

    # -- replacing itself (Task.replace) ----------------------------------------------------------

    def replacing(self, by: str) -> tuple[str, str]:
        """Note that this run replaces itself with ``by``; returns its ``(prefix, member)`` (see :func:`replacing`)."""
        assert self.member is not None
        self.replacement = Replacement(self.member, by)
        try:
            self.store.replacing(self.member, self.run_id, self.token, by)
        except redis.RedisError:
            logger.exception("%s[%s]: could not mark the run as replacing itself", self.task.name, self.run_id)
        return self.store.schema.prefix, self.member

    def hand_over(self, member: str) -> bool:
        """Let a replacement publish under ``member`` continue this run (see :func:`hand_over`)."""
        replacement, lock = self.replacement, self.lock
        if replacement is None or lock is None or replacement.member != member:
            return False
        if not replacement.handed_over:
            renewer().remove(lock)
            finished = self.store.finish(
                member,
                self.run_id,
                QUEUED,
                drop=False,
                record_ms=self.record_ms,
                role="run",
                token=self.token,
                note=f"replaced by {replacement.by}",
            )
            replacement.handed_over = True
            if not finished.lock_kept:
                # Its lock lapsed before the renewer saw it (a paused worker): another delivery may
                # have run the key beside this body. The replacement goes on as the run all the same.
                lock.lost.set()
                decisions.log(
                    "lock_lost",
                    self.task.name,
                    self.key,
                    self.run_id,
                    f"replaced by {replacement.by} after losing its execution lock",
                )
        return True

    # -- end -----------------------------------------------------------------------------------

    def end(
        self, ending: Ending, value: Any = None, backend_result: BackendResult | None = None, deferred: bool = False
    ) -> None:
        """Record how the body ended, give back the lock and what participants gave it, settle followers."""
        task, store, member, lock = self.task, self.store, self.member, self.lock
        assert member is not None and lock is not None
        if not deferred and ending.state == SUCCEEDED and results.defer(task, store, partial(self.end, ending, value)):
            return  # recorded with its result where the backend is the store's Redis: one round trip
        renewer().remove(lock)
        self.leave(ran=True)
        self.running = False
        replacement = self.replacement
        handed_over = replacement is not None and replacement.handed_over
        if handed_over and ending.state == REPLACED:
            self.retire()
            return  # the replacement goes on with this run under its key: nothing ends here
        # Handed over: the lock went with it, and the publish that followed failed.
        own = "" if handed_over else self.token
        holds = ending.state == SUCCEEDED and self.policy.mode.holds_after_success
        fields: dict[str, Any] = {
            "drop": ending.drop,
            "token": own,
            "role": "run",
            "error": ending.error,
            "note": ending.note,
            "record_ms": self.record_ms,
            "payload": kept_payload(task, ending.state, self.args, self.kwargs),
            # A key held after success answers later calls with this run: keep its value for their followers.
            "result": kept_result(task, value)[0] if holds else "",
        }
        again = partial(
            record,
            task,
            store,
            member,
            self.run_id,
            ending.state,
            patience=max(self.policy.lock_ttl, 5.0),
            lock=lock if own else None,
            **fields,
        )
        if backend_result is None and ending.state == SUCCEEDED and results.awaits_nothing(task, store):
            # Nothing can show this ending before the trace ends, where its reply is read (the ack comes after).
            store.send_finish(partial(self.recorded, again, value), member, self.run_id, ending.state, **fields)
            return
        self.after_recorded(again(backend_result=backend_result), value)

    def recorded(self, again: Callable[[], Finished | None], value: Any, reply: Finished | redis.RedisError) -> None:
        """The reply to this delivery's sent ending (:meth:`DedupStore.send_finish`); never raises.

        A connection that failed before the reply came may have lost the ending:
        it is recorded again (:func:`record`, which is safe after all).
        """
        try:
            if isinstance(reply, redis.ConnectionError | redis.TimeoutError):
                finished = again()
            elif isinstance(reply, redis.RedisError):
                logger.error(
                    "could not record succeeded for %s[%s] key %r; it expires by its TTL: %s",
                    self.task.name,
                    self.run_id,
                    self.member,
                    reply,
                )
                finished = None
            else:
                finished = noted(self.task, str(self.member), self.run_id, SUCCEEDED, reply)
            self.after_recorded(finished, value)
        except Exception:
            logger.exception("%s[%s]: could not end the run of key %r", self.task.name, self.run_id, self.member)

    def after_recorded(self, finished: Finished | None, value: Any) -> None:
        """The ending is recorded (``finished``; None: it could not be): the token ends, followers get ``value``."""
        self.retire()  # it let go of its lock and slots (or left them to expire)
        if finished is not None and finished.wants_result:
            self.settle(value)

    def abandon(self) -> None:
        """Stop renewing the lock and give back the slots, without recording an ending (someone else will).

        Its token is retired: whoever reports the ending may free its lock.
        """
        if self.lock is not None:
            renewer().remove(self.lock)
        self.leave(ran=True)
        self.running = False
        self.retire()

    def settle(self, value: Any) -> None:
        """Give the followers of a run that succeeded its return value, and release them."""
        assert self.member is not None
        payload, unkept = kept_result(self.task, value)
        try:
            self.store.settle(self.member, self.run_id, result=payload, unkept=unkept, record_ms=self.record_ms)
        except redis.RedisError:  # the reaper releases them a grace later, as lost
            logger.exception(
                "could not settle the followers of %s[%s] key %r", self.task.name, self.run_id, self.member
            )


def guarded_call(task: KeyedTask, args: tuple[Any, ...], kwargs: dict[str, Any], body: Body) -> Any:
    """Run ``body(args, kwargs)`` for the current request as a :class:`Delivery` (``DedupTask.__call__``)."""
    request = task.request
    if request.id is None or request.called_directly:
        return body(args, kwargs)
    if not task.dedup_policy.mode.guards:
        return limited_call(task, args, kwargs, body)
    delivery = Delivery.of(task, args, kwargs, body)
    return body(args, kwargs) if delivery is None else delivery()


def limited_call(task: KeyedTask, args: tuple[Any, ...], kwargs: dict[str, Any], body: Body) -> Any:
    """Run ``body`` with the task's participants only (``dedup_mode="off"``: no key, no lock, no record)."""
    delivery = Delivery(
        task,
        args,
        kwargs,
        body,
        member=None,
        store=runtime.store_for(task.app),
        gated=False,
        participants=participants_of(task),
    )
    delivery.claim()
    try:
        if not delivery.admit():
            raise Ignore()
        delivery.running = True
        try:
            return body(args, kwargs)
        finally:
            delivery.running = False
            delivery.leave(ran=True)
    finally:
        delivery.retire()


def replacing(task: KeyedTask, by: str) -> tuple[str, str] | None:
    """Note that the run executing ``task`` replaces itself with ``by`` (called from ``on_replace``).

    The run's record is marked before the replacement is published, so a
    worker that dies before the run's ending is recorded leaves its followers
    to the replacement (see ``replacing.lua``); unmarked (the store failed),
    such a death fails them as lost at once.
    Returns the run's ``(prefix, member)``, None if no run of this process is executing it.
    """
    delivery = running(task.request.id)
    return None if delivery is None else delivery.replacing(by)


def hand_over(task_id: str | None, member: str) -> bool:
    """Let a replacement publish continue run ``task_id`` under ``member``, if that run is replacing itself.

    The run's lock is released and its record set back to ``queued`` first,
    so the replacement's delivery starts at once instead of waiting for the
    lock; the key stays held. A run whose lock lapsed before it was handed over
    says so, as any body ending without its lock does (``lock_lost``).
    Returns whether the publish continues the run.
    """
    delivery = running(task_id)
    return delivery is not None and delivery.hand_over(member)


def lock_lost(task_id: str | None) -> bool:
    """Whether the delivery of run ``task_id`` whose body this thread executes has lost its lock."""
    delivery = running(task_id)
    return delivery is not None and delivery.lock is not None and delivery.lock.lost.is_set()


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


def kept_result(task: KeyedTask, value: Any) -> tuple[str, str]:
    """``(payload, "")`` of a run's return value for its followers, or ``("", why)`` if it cannot be kept."""
    try:
        return result_payload(task.app, value), ""
    except Exception as exc:  # whatever the serializer refuses: the followers learn why
        return "", f"its return value could not be kept for its followers ({error_summary(exc)})"


def record(
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
    return noted(task, member, task_id, state, finished)


def noted(task: KeyedTask, member: str, task_id: str, state: str, finished: Finished) -> Finished:
    """``finished``, after saying what it says went wrong: a lost lock, a key that passed to another run."""
    if not finished.lock_kept:
        decisions.log("lock_lost", task.name, _key(member), task_id, f"ended {state} after losing its execution lock")
    if not finished.owned:
        logger.info("%s[%s] ended (%s) but key %r belongs to another run", task.name, task_id, state, member)
    return finished


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
    The task's participants are told (:meth:`Participant.after_report`).
    """
    participants = participants_of(task)

    def report(store: DedupStore, member: str, token: str) -> None:
        for participant in participants:
            participant.after_report(Report(task, store, member, args, kwargs, task_id, token))

    if not task.dedup_policy.mode.guards:  # no lock, no record: only what participants hold
        report(runtime.store_for(task.app), "", "")
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
    role = "stop" if stopping else "report"
    finished = record(
        task, store, member, task_id, state, drop=True, role=role, token=token, record_ms=record_ms, payload=payload
    )
    report(store, member, token)
    owned = finished is not None and finished.owned
    pid = token_pid(holder) if holder is not None and not token else None
    if stopping and owned and holder is not None and pid is not None:
        live_token = holder

        def release() -> None:
            record(task, store, member, task_id, state, drop=True, role="report", token=live_token, record_ms=record_ms)
            report(store, member, live_token)

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
