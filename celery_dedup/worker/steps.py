"""Steps inside a body: ``self.dedup_once(name, fn)`` calls ``fn`` once per run, across every delivery of it.

A keyed task's body (``base=DedupTask, bind=True``) names the side effects
that must not happen twice, each a *step*::

    receipt = self.dedup_once("charge-card", lambda key: provider.charge(amount, idempotency_key=key))

``fn`` is called with the step's idempotency key (:func:`~celery_dedup.keys.step_key`):
the same for every delivery, retry and redelivery of the run, so a provider
that honours idempotency keys is the last fence. A step that completed is
never executed again by a later delivery of the run: its return value is
stored (the task's serializer, at most ``dedup_step_result_limit`` bytes) and
returned instead. ``scope="key"`` keeps a step for the key's record, across
its runs.

Each step costs two round trips (``step_begin.lua``, ``step_end.lua``), a
step already done one; a body without steps none. While a step executes,
its lock (the step's entry: the delivery's token and a deadline on the
server's clock) is renewed with the execution lock by the process's renewer
(:class:`StepLease`, a :class:`~.lock.Renewable`). A delivery that finds
the step's lock run out (its executor died, or lost its lock, inside the
step) finds the step *in doubt*: ``on_doubt="retry"`` calls ``fn`` again
with the same key, ``"raise"`` raises :class:`~celery_dedup.exceptions.DedupStepInDoubt`.

The steps take part in every delivery as a :class:`~.delivery.Participant`
(:data:`STEPS`), which only lets go of what the delivery's steps held at its
end; a delivery's steps are kept in ``delivery.held[STEPS]``.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Hashable
from functools import partial
from typing import Any, ClassVar, NoReturn, TypeVar, cast

import redis

from .. import decisions, runtime
from ..config import check_on_doubt, check_step_name, check_step_scope
from ..exceptions import DedupConfigError, DedupLockLostError, DedupStepError, DedupStepInDoubt
from ..keyed import KeyedTask
from ..keys import step_key
from ..payloads import decode_step, step_payload
from ..store.commands import StepBeginCode
from ..store.schema import STEP_FIELD_PREFIX
from ..store.store import DedupStore, StepBegun, StepEnded, StepRef
from . import processes
from .delivery import Delivery, Report, error_summary, running
from .lock import RENEW_FRACTION, renewer

logger = logging.getLogger("celery_dedup")

T = TypeVar("T")

#: The longest a begin waits at once for another delivery's step lock to run out (seconds); it asks again then.
BUSY_WAIT = 1.0


class StepLease:
    """A delivery's steps, as the renewer keeps them: the lock of the step it executes, its run's and its key's
    steps."""

    gone: ClassVar[str] = "taken over or expired: another delivery may execute the run's steps"

    def __init__(
        self, store: DedupStore, member: str, run_id: str, token: str, ttl_ms: int, record_ms: int, *, now: float
    ) -> None:
        self.store = store
        self.member = member
        self.token = token
        self.ttl_ms = ttl_ms
        self.record_ms = record_ms
        self.ref: StepRef = store.step_ref(member, run_id, token)
        #: The field of the step it executes now (``s:<step>``, ``k:<step>``), "" between steps.
        self.field = ""
        self.lost = threading.Event()
        self.valid_until = now + ttl_ms / 1000
        self.renew_at = now + ttl_ms / 1000 * RENEW_FRACTION

    def __repr__(self) -> str:
        return f"<StepLease {self.member!r} token={self.token!r} step={self.field!r} lost={self.lost.is_set()}>"

    def batch(self) -> Hashable:
        return StepLease, id(self.store.client), self.ttl_ms, self.record_ms

    def renew(self, batch: list[StepLease]) -> list[StepLease]:
        leases = [(lease.ref, lease.field) for lease in batch]
        lost = {ref for ref, _ in self.store.renew_steps(leases, lock_ms=self.ttl_ms, record_ms=self.record_ms)}
        return [lease for lease in batch if lease.ref in lost]

    def lose(self, why: str) -> None:
        if not self.lost.is_set():
            self.lost.set()
            if self.field:
                logger.error("step lock lost for key %r step %r (%s)", self.member, self.field[2:], why)


class Steps:
    """The steps of one delivery: the names it used, and its lease once it began one."""

    def __init__(self, delivery: Delivery) -> None:
        self.delivery = delivery
        self.used: set[str] = set()
        self.lease: StepLease | None = None

    def _lease(self) -> StepLease:
        if self.lease is None:
            delivery = self.delivery
            assert delivery.member is not None
            keeper = renewer()
            self.lease = StepLease(
                delivery.store,
                delivery.member,
                delivery.run_id,
                delivery.token,
                delivery.lock_ms,
                delivery.record_ms,
                now=keeper.clock(),
            )
            keeper.add(self.lease)
        return self.lease

    def release(self) -> None:
        """Stop renewing (the delivery ended)."""
        if self.lease is not None:
            renewer().remove(self.lease)

    def once(self, name: str, fn: Callable[[str], T], scope: str, on_doubt: str) -> T:
        """Call ``fn`` with the step's idempotency key unless the step is done; its (stored) value either way."""
        delivery = self.delivery
        task, member = delivery.task, delivery.member
        assert member is not None
        if name in self.used:
            raise DedupStepError(
                task.name,
                name,
                "this delivery used the name for a step already: each step of a run needs a name of its own "
                "(a loop names each step, e.g. f'ship-{item_id}')",
            )
        self.used.add(name)
        key = step_key(member, delivery.run_id, name, scope=scope)
        field = STEP_FIELD_PREFIX[scope] + name
        lease = self._lease()
        try:
            begun = self._begin(field, name, key, on_doubt)
        except (SystemExit, KeyboardInterrupt):
            self._forgo(field, name, key)  # told to exit as its begin answered: its function was never called
            raise
        if begun.code == StepBeginCode.DONE:
            logger.debug("%s[%s] step %r done already: its stored value", task.name, delivery.run_id, name)
            return cast(T, self._decoded(name, begun.detail))
        if begun.code == StepBeginCode.IN_DOUBT:
            raise DedupStepInDoubt(task.name, delivery.key, delivery.run_id, name, key, int(begun.detail or 0))
        if begun.code == StepBeginCode.RUN_AGAIN:
            logger.warning(
                "%s[%s] step %r in doubt (attempt %s): called again with idempotency key %r",
                task.name,
                delivery.run_id,
                name,
                begun.detail,
                key,
            )
        lease.field = field
        try:
            value = fn(key)
        except (SystemExit, KeyboardInterrupt):
            lease.field = ""
            raise  # the process is going: the step stays running, in doubt once its lock runs out
        except BaseException as exc:
            lease.field = ""
            self._end(field, name, key, error=error_summary(exc))
            raise
        lease.field = ""
        payload = self._payload(field, name, key, value)
        ended = self._end(field, name, key, result=payload)
        if ended is None:
            raise DedupStepError(
                task.name, name, "its ending could not be recorded (the store is unreachable): it is in doubt now"
            )
        if not ended.recorded:
            self._lost(
                name,
                key,
                recorded=False,
                why="another delivery took the step over after this one's lock "
                "ran out; it executes the step itself, with the same idempotency key",
            )
        if not ended.lock_kept:
            self._lost(
                name,
                key,
                recorded=True,
                why="the step is recorded done, but another delivery holds the run's execution lock now",
            )
        return cast(T, self._decoded(name, payload))

    def _forgo(self, field: str, name: str, key: str) -> None:
        """The process exits before calling the step's function, maybe after the server began it: say it failed.

        One try, no waiting (the process is going). ``step_end.lua`` records it
        only while the step names this delivery, so a begin the server never
        ran changes nothing; otherwise the next delivery calls the step as one
        that failed, not as one in doubt.
        """
        delivery = self.delivery
        try:
            delivery.store.step_end(
                delivery.member or "",
                delivery.run_id,
                delivery.token,
                field,
                name,
                result="",
                error="interrupted before its function was called",
                lock_ms=delivery.lock_ms,
                record_ms=delivery.record_ms,
            )
        except Exception:  # the store is unreachable: the step is in doubt once its lock runs out
            logger.exception(
                "%s[%s] step %r (idempotency key %r): left in doubt", delivery.task.name, delivery.run_id, name, key
            )

    def _decoded(self, name: str, payload: str) -> Any:
        try:
            return decode_step(self.delivery.task.app, payload)
        except Exception as exc:  # a content type this app does not accept, say
            raise DedupStepError(self.delivery.task.name, name, f"its stored value cannot be read: {exc}") from exc

    def _payload(self, field: str, name: str, key: str, value: Any) -> str:
        """``value`` as stored; a value that cannot be kept fails the step (recorded so) and raises."""
        task = self.delivery.task
        limit = runtime.config_for(task.app).step_result_limit
        try:
            payload = step_payload(task.app, task.serializer, value)
        except Exception as exc:  # whatever the serializer refuses
            why = f"its return value cannot be serialized ({error_summary(exc)})"
            self._end(field, name, key, error=why)
            raise DedupStepError(task.name, name, why) from exc
        if len(payload) > limit:
            why = (
                f"its return value takes {len(payload)} bytes serialized, more than dedup_step_result_limit "
                f"({limit}): return what later deliveries need (an id), not the whole object"
            )
            self._end(field, name, key, error=why)
            raise DedupStepError(task.name, name, why)
        return payload

    def _lost(self, name: str, key: str, *, recorded: bool, why: str) -> NoReturn:
        delivery = self.delivery
        task = delivery.task
        decisions.log("lock_lost", task.name, delivery.key, delivery.run_id, f"step {name!r}: {why}")
        raise DedupLockLostError(task.name, delivery.key, delivery.run_id, name, key, recorded=recorded, why=why)

    def _begin(self, field: str, name: str, key: str, on_doubt: str) -> StepBegun:
        """``step_begin.lua``, waiting out another delivery's live step lock (taken at once from a dead owner)."""
        delivery = self.delivery
        assert delivery.member is not None
        store, member, run_id, token = delivery.store, delivery.member, delivery.run_id, delivery.token
        ms = {"lock_ms": delivery.lock_ms, "record_ms": delivery.record_ms}
        dead = ""
        while True:
            begin = partial(store.step_begin, member, run_id, token, field, name, on_doubt=on_doubt, dead=dead, **ms)
            begun = _patiently(delivery, begin)
            if begun is None:
                raise DedupStepError(delivery.task.name, name, "the dedup store is unreachable: the step did not begin")
            if begun.code == StepBeginCode.LOCK_LOST:
                self._lost(
                    name,
                    key,
                    recorded=False,
                    why="this delivery no longer holds the run's execution lock (paused past its TTL, or taken "
                    "over): another delivery may be executing the run",
                )
            if begun.code != StepBeginCode.BUSY:
                return begun
            if processes.ended(begun.holder):
                dead = begun.holder  # its process is gone: the step is in doubt now, not when its lock runs out
                continue
            wait = min(int(begun.detail) / 1000, BUSY_WAIT) + random.uniform(0.01, 0.1)
            logger.info(
                "%s[%s] step %r: another delivery (%s) holds its lock; asking again in %.1f s",
                delivery.task.name,
                delivery.run_id,
                name,
                begun.holder,
                wait,
            )
            time.sleep(wait)

    def _end(self, field: str, name: str, key: str, *, result: str = "", error: str = "") -> StepEnded | None:
        delivery = self.delivery
        assert delivery.member is not None
        ended = _patiently(
            delivery,
            lambda: delivery.store.step_end(
                delivery.member or "",
                delivery.run_id,
                delivery.token,
                field,
                name,
                result=result,
                error=error,
                lock_ms=delivery.lock_ms,
                record_ms=delivery.record_ms,
            ),
        )
        if ended is None:
            logger.error(
                "%s[%s] step %r (idempotency key %r): its ending could not be recorded; the next delivery finds "
                "it in doubt",
                delivery.task.name,
                delivery.run_id,
                name,
                key,
            )
        return ended


def _patiently(delivery: Delivery, call: Callable[[], T]) -> T | None:
    """``call()``, tried again while the store cannot be reached, for up to the lock's TTL; None if it never answers.

    The execution lock is renewed meanwhile (by the renewer): a store back within its TTL loses nothing.
    """
    deadline = time.monotonic() + delivery.policy.lock_ttl
    wait = 0.05
    while True:
        try:
            return call()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            if time.monotonic() + wait > deadline:
                logger.exception("%s[%s]: dedup store unreachable for a step", delivery.task.name, delivery.run_id)
                return None
            logger.warning("%s[%s]: a step's call again: %s", delivery.task.name, delivery.run_id, exc)
            time.sleep(wait)
            wait = min(wait * 2, 1.0)


class StepsParticipant:
    """The steps as a participant in every delivery of a task (see :class:`~.delivery.Participant`)."""

    def __repr__(self) -> str:
        return "<steps>"

    def before_start(self, delivery: Delivery) -> bool:
        return True  # nothing is taken before the body asks for a step

    def after_end(self, delivery: Delivery, *, ran: bool) -> None:
        steps = delivery.held.pop(self, None)
        if isinstance(steps, Steps):
            steps.release()

    def after_report(self, report: Report) -> None:
        """Nothing: a step's lock lives in its executor's process, and runs out with it."""


#: The participant every DedupTask's deliveries have (``DedupTask.worker_participants``).
STEPS = StepsParticipant()


def once(task: KeyedTask, name: str, fn: Callable[[str], T], *, scope: str = "run", on_doubt: str = "retry") -> T:
    """``DedupTask.dedup_once``: call ``fn(idempotency_key)`` once for this run (``scope="key"``: this key).

    Raises:
        DedupStepError: not called from a keyed task's body under its lock, a bad or reused name, a bad
            ``scope`` or ``on_doubt``, or a return value that cannot be kept.
        DedupStepInDoubt: ``on_doubt="raise"`` and the step's earlier executor died inside it.
        DedupLockLostError: this delivery lost its execution lock: another may execute the run now.
    """
    try:
        check_step_name("name", name, task=task.name)
        check_step_scope("scope", scope, task=task.name)
        check_on_doubt("on_doubt", on_doubt, task=task.name)
    except DedupConfigError as exc:
        raise DedupStepError(task.name, str(name), f"{exc.setting}={exc.value!r} {exc.reason}") from exc
    delivery = running(task.request.id)
    if delivery is None or delivery.member is None or delivery.lock is None:
        raise DedupStepError(
            task.name,
            name,
            "dedup_once runs only inside the body of a keyed task's delivery (base=DedupTask, bind=True, a mode "
            "other than off), on a worker or eagerly, under its execution lock; not when the task is called as a "
            "function, nor where the store was unreachable and the body ran unguarded",
        )
    if STEPS not in delivery.participants:
        raise DedupStepError(task.name, name, "the task's worker_participants leave out the steps (STEPS)")
    steps = delivery.held.get(STEPS)
    if not isinstance(steps, Steps):
        steps = delivery.held[STEPS] = Steps(delivery)
    return steps.once(name, fn, scope, on_doubt)
