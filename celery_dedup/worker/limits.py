"""Per-group concurrency and rate limits: at most N bodies of a group at once, at most R starts per period.

A task declares them with ``limit_key`` (the group, same syntax as
``dedup_key``; default: the dedup key), ``limit_concurrency`` and
``limit_rate`` (``"30/m"``). Every delivery of such a task asks its group
before it runs (``limit_acquire.lua``, on the server clock):

- a **slot** is a lease (token -> deadline) in the group's ZSET, renewed with
  the execution lock by the process's renewer, given back on every ending,
  and recovered from a dead holder by its expiry or, sooner, when the next
  acquire is told the holder's process is gone;
- the **rate** is a sliding log of the group's starts: at most R in any
  window of one period, never 2R across a boundary; a list of rates is
  several windows, and a start needs room in every one;
- a task naming a **named group** (``limit_group``, setting
  ``dedup_limit_groups``) draws on that group's quota per ``limit_key``,
  shared with every task naming it; the group's values may be overridden
  and the group paused at run time (:mod:`celery_dedup.limits`), read by
  the script at each admission (a pause refuses with reason ``paused``);
- a delivery that may not start now keeps its place in the group's waiting
  line (by first arrival) and is re-published to come back when, by the
  best guess, its turn comes (a countdown: no worker slot is held, nothing
  spins). It is the same run: not a retry, not a duplicate of itself. A
  free place waits for the runs ahead only while they are due back: a late
  line never keeps it from a run that is there.

The limits take part in a delivery as a :class:`~.delivery.Participant`
(:data:`LIMITS`): asked before the execution guard's own start decision, so
a run that may not start has taken nothing else (its key stays held, its
record ``queued``, annotated with why it waits), and told after its end. A
delivery's lease is kept on the delivery (``delivery.held[LIMITS]``).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, ClassVar

import redis

from .. import decisions
from ..exceptions import DedupError
from ..header import DEFERS_OPTION, GateHeader
from ..keys import WHOLE_GROUP, limit_group_member, limit_group_of, member_for, split_member
from ..store.limits import Denial, Grant, acquire, give_back, leave_line, note, release, renew_leases
from ..store.store import DedupStore
from . import processes
from .delivery import Delivery, Report, live, running
from .lock import renewer

if TYPE_CHECKING:
    from ..keyed import KeyedTask

logger = logging.getLogger("celery_dedup")


class SlotLease:
    """One delivery's place in its group (a slot, a start), renewed by the process's renewer with its lock."""

    gone: ClassVar[str] = "expired or evicted: the run goes on beyond its group's limit"

    def __init__(
        self,
        store: DedupStore,
        group: str,
        token: str,
        run_id: str,
        ttl_ms: int,
        grant: Grant,
        *,
        now: float,
        slot: bool = True,
    ) -> None:
        self.store = store
        #: Whether it holds a slot (a concurrency limit), not only a start in a rate window.
        self.slot = slot
        #: The group, named as the renewer names what it holds.
        self.member = group
        self.token = token
        self.run_id = run_id
        self.ttl_ms = ttl_ms
        self.grant = grant
        self.lost = threading.Event()
        self.valid_until = now + ttl_ms / 1000
        self.renew_at = now + ttl_ms / 3000

    def __repr__(self) -> str:
        return f"<SlotLease {self.member!r} token={self.token!r} lost={self.lost.is_set()}>"

    def batch(self) -> Hashable:
        return SlotLease, id(self.store.client), self.ttl_ms

    def renew(self, batch: list[SlotLease]) -> list[SlotLease]:
        return renew_leases(batch, lease_ms=self.ttl_ms)

    def lose(self, why: str) -> None:
        slot_lost(self, why)


def current(task_id: str | None) -> Grant | None:
    """The grant of run ``task_id`` executing in this process (None: no limits, or not running here).

    ``granted_at`` is the start its group's rate limit counts, on the server's clock.
    """
    if task_id is None:
        return None
    own = running(task_id)  # called from the body: the delivery this thread executes, exactly
    if own is not None:
        lease = own.held.get(LIMITS)
        return lease.grant if isinstance(lease, SlotLease) else None
    held = [(delivery, delivery.held.get(LIMITS)) for delivery in live(task_id)]
    leases = [(delivery, lease) for delivery, lease in held if isinstance(lease, SlotLease)]
    # Two deliveries of one run: a copy on its way to being refused holds a slot a moment, its body does not run.
    ran = [lease for delivery, lease in leases if delivery.running] or [lease for _, lease in leases]
    return ran[-1].grant if ran else None


def owner_gone(token: str) -> bool:
    """Whether the delivery that took slot ``token`` provably runs no more (:func:`.processes.ended`).

    A sibling delivery of this process is alive from before it asked for the
    slot until it gave the slot back; another machine's is never judged dead.
    """
    return processes.ended(token)


def group_of(task: KeyedTask, args: Any, kwargs: Any, member: str | None = None) -> str | None:
    """The limit group of a call of ``task`` (``member``: its dedup member, if known), None without limits.

    A task's own limits: ``<task>:<limit key>`` (default: the dedup member); a named group's
    (``limit_group``): :func:`~celery_dedup.keys.limit_group_member` of its ``limit_key``, or of the
    whole group without one.

    A group key that cannot be derived is logged, and the run is not limited.
    """
    limit = task.dedup_policy.limit
    if limit is None:
        return None
    try:
        if limit.group is not None:  # a named group: its key, or (no limit_key) its single quota
            key = None if limit.spec is None else limit.spec.business_key(args, kwargs)
            return limit_group_member(limit.group, key)
        if limit.spec is not None:
            return member_for(task.name, limit.spec.business_key(args, kwargs))
        return member or member_for(task.name, task.dedup_policy.spec.business_key(args, kwargs))
    except DedupError:
        logger.exception("%s: cannot derive the limit group of this delivery; it runs unlimited", task.name)
        return None


def admit(task: KeyedTask, store: DedupStore, member: str | None, token: str) -> SlotLease | Denial | None:
    """Take the current delivery's place in its group, or defer it until its turn (a :class:`Denial`).

    Returns the lease to renew and give back (None: the task has no limits).
    ``member``: the run's dedup member, whose record says that it waits.
    ``token``: the delivery's, claimed (:func:`~celery_dedup.worker.processes.claim`)
    until the lease is given back.
    """
    request = task.request
    if getattr(request, "is_eager", False):
        return None
    group = group_of(task, request.args, request.kwargs, member)
    limit = task.dedup_policy.limit
    if group is None or limit is None:
        return None
    lease_ms = int(task.dedup_policy.lock_ttl * 1000)
    run_id = str(request.id)
    if member is not None and _follower(store, member, run_id, request.headers):
        return None  # it resolves as the run it follows ended: it runs no body, so it takes no place
    answer = acquire(store, group, token, run_id, limit, lease_ms=lease_ms, task_name=task.name)
    if isinstance(answer, Denial) and answer.holders:
        dead = [holder for holder in answer.holders if owner_gone(holder)]
        if dead:
            answer = acquire(store, group, token, run_id, limit, lease_ms=lease_ms, task_name=task.name, evict=dead)
    if isinstance(answer, Denial):
        wait(task, store, member, answer)
        return answer
    grant = answer
    if member is not None and grant.waited_ms:
        try:
            note(store, member, run_id, "granted", str(grant.waited_ms))
        except redis.RedisError:
            logger.exception("%s[%s]: could not record its wait", task.name, run_id)
    keeper = renewer()
    lease = SlotLease(store, group, token, run_id, lease_ms, grant, now=keeper.clock(), slot=grant.slot)
    if lease.slot:  # a rate limit counts starts: it holds no place to renew
        keeper.add(lease)
    return lease


def _follower(store: DedupStore, member: str, run_id: str, headers: Any) -> bool:
    """Whether this delivery is a follower's (``gate.lua`` parked it): asked only of calls that could be one."""
    gate = GateHeader.decode(headers)
    if gate is None or not gate.follow:
        return False
    return store.with_prefix(gate.prefix).is_follower(member, run_id)


def leave(lease: SlotLease | None, *, ran: bool) -> None:
    """Give back a lease (``ran``: its body ran); store errors are logged: its expiry frees it."""
    if lease is None:
        return
    renewer().remove(lease)
    try:
        held = give_back(lease.store, lease.member, lease.token, ran=ran)
    except redis.RedisError:
        logger.exception(
            "could not give back slot %r of group %r; it expires with its lease", lease.token, lease.member
        )
        return
    if ran and lease.slot and held != "held":
        # The body ended before the renewer learnt it: a pause or cut-off past the lease lets another body in.
        slot_lost(lease, "its lease lapsed before its body ended: the run went on beyond its group's limit")


def slot_lost(lease: SlotLease, why: str) -> None:
    """Report once that ``lease``'s slot was lost while its body ran: another body may have taken it."""
    if not lease.lost.is_set():
        lease.lost.set()
        logger.error("limit slot lost in group %r (%s)", lease.member, why)


def wait(task: KeyedTask, store: DedupStore, member: str | None, denial: Denial) -> None:
    """Re-publish the current run to come back when its turn should come, and note why.

    The re-publish is a deferred copy (:meth:`.delivery.Delivery.defer`): a
    copy of a run whose body started elsewhere (a redelivery) and whose
    record passed on to later runs pushes nothing; one whose run's key was
    freed as it started leaves it free.
    """
    request = task.request
    why = why_waiting(denial)
    countdown = denial.wait_ms / 1000 + random.uniform(0, 0.02)
    detail = f"{why}, {denial.position} ahead; again in {countdown:.2f}s"
    if member is not None:
        try:
            note(store, member, str(request.id), "wait", why)
        except redis.RedisError:
            logger.exception("%s[%s]: could not record that it waits", task.name, request.id)
    decisions.log("limited", task.name, split_member(denial.group)[1], request.id, detail)
    # A copy of a delivery that has not started, as the guard's deferral is: the gate pushes it
    # only while the key's record names its run, and does not hold a key the run freed as it started.
    task.signature_from_request(request, countdown=countdown).apply_async(**{DEFERS_OPTION: True})


def group_label(group: str) -> str:
    """A group id as people read it: a task's group key, or ``<name>`` / ``<name>:<key>`` for a named group."""
    namespace, key = split_member(group)
    name = limit_group_of(namespace)
    if name is None:
        return key
    return name if key == WHOLE_GROUP else f"{name}:{key}"


def why_waiting(denial: Denial) -> str:
    """Why a run was refused, in a line (its record's ``limit_wait``, its history, the decision log).

    ``concurrency 2/2 in use for tenant:acme``, ``rate 10000/10000/d used for partner-api:acme``
    (the window it waits for longest), ``paused for partner-api:acme until resumed``.
    """
    label = group_label(denial.group)
    if denial.reason == "paused":
        until = int(denial.limit or -1)
        if until == -1:
            return f"paused for {label} until resumed"
        return f"paused for {label} until {time.strftime('%H:%M:%S', time.gmtime(until / 1000))} UTC"
    if denial.reason == "rate":
        return f"rate {denial.in_use}/{denial.window or denial.limit} used for {label}"
    return f"concurrency {denial.in_use}/{denial.limit} in use for {label}"


def reported_ending(
    task: KeyedTask, store: DedupStore, member: str, args: Any, kwargs: Any, run_id: str, token: str
) -> None:
    """An ending reported from outside the body (revoked, a lost worker): the run leaves its group.

    It gives up its place in the waiting line (a revoked run waiting its turn
    must not hold one back), and ``token``'s slot (its process is gone; "":
    none to give back).
    """
    group = group_of(task, args, kwargs, member)
    if group is None:
        return
    try:
        leave_line(store, group, run_id)
        if token:
            release(store, group, token, ran=True)
    except redis.RedisError:
        logger.exception("could not take run %s out of group %r; its lease and place expire", run_id, group)


class Limits:
    """The limits as a participant in every delivery of a task (see :class:`~.delivery.Participant`)."""

    def __repr__(self) -> str:
        return "<limits>"

    def before_start(self, delivery: Delivery) -> bool:
        """Its place in its group (kept in ``delivery.held``), or False: re-published to come back at its turn."""
        answer = admit(delivery.task, delivery.store, delivery.member, delivery.token)
        if isinstance(answer, Denial):
            return False
        if answer is not None:
            delivery.held[self] = answer
        return True

    def after_end(self, delivery: Delivery, *, ran: bool) -> None:
        leave(delivery.held.pop(self, None), ran=ran)

    def after_report(self, report: Report) -> None:
        reported_ending(
            report.task, report.store, report.member, report.args, report.kwargs, report.run_id, report.token
        )


#: The participant every DedupTask's deliveries have (``DedupTask.worker_participants``).
LIMITS = Limits()
