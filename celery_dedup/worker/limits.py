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
  window of one period, never 2R across a boundary;
- a delivery that may not start now keeps its place in the group's waiting
  line (by first arrival) and is re-published to come back when, by the
  best guess, its turn comes (a countdown: no worker slot is held, nothing
  spins). It is the same run: not a retry, not a duplicate of itself. A
  free place waits for the runs ahead only while they are due back: a late
  line never keeps it from a run that is there.

The decision is taken before the execution guard's own: a run that may not
start has taken nothing else (its key stays held, its record ``queued``,
annotated with why it waits).
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

import redis
from celery.exceptions import Ignore

from .. import decisions, runtime
from ..exceptions import DedupError
from ..header import GateHeader
from ..keys import member_for, split_member
from ..policy import LimitPolicy
from ..store.limits import Denial, Grant, acquire, give_back, leave_line, note, release, renew_leases
from ..store.store import DedupStore
from . import processes
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
        #: Set once the guard let its delivery start: of two deliveries of one run here, the one whose body runs.
        self.running = False
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


#: The leases this process holds, by delivery (token): two deliveries of one run may both hold one a moment.
_held: dict[str, SlotLease] = {}


def current(task_id: str | None) -> Grant | None:
    """The grant of run ``task_id`` executing in this process (None: no limits, or not running here).

    ``granted_at`` is the start its group's rate limit counts, on the server's clock.
    """
    if task_id is None:
        return None
    leases = [lease for lease in list(_held.values()) if lease.run_id == task_id]
    if len(leases) > 1:  # a copy of the run on its way to being refused: its body does not run
        leases = [lease for lease in leases if lease.running] or leases
    return leases[0].grant if leases else None


def owner_gone(token: str) -> bool:
    """Whether the delivery that took slot ``token`` provably runs no more (:func:`.processes.ended`).

    A sibling delivery of this process is alive from before it asked for the
    slot until it gave the slot back; another machine's is never judged dead.
    """
    return processes.ended(token)


def group_of(task: KeyedTask, args: Any, kwargs: Any, member: str | None = None) -> str | None:
    """The limit group of a call of ``task`` (``member``: its dedup member, if known), None without limits.

    A group key that cannot be derived is logged, and the run is not limited.
    """
    limit = task.dedup_policy.limit
    if limit is None:
        return None
    try:
        if limit.spec is not None:
            return member_for(task.name, limit.spec.business_key(args, kwargs))
        return member or member_for(task.name, task.dedup_policy.spec.business_key(args, kwargs))
    except DedupError:
        logger.exception("%s: cannot derive the limit group of this delivery; it runs unlimited", task.name)
        return None


def admit(task: KeyedTask, store: DedupStore, member: str | None, token: str) -> SlotLease | None:
    """Take the current delivery's place in its group, or defer it (raises ``Ignore``) until its turn.

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
        wait(task, store, member, answer, limit)
    grant = answer
    if member is not None and grant.waited_ms:
        try:
            note(store, member, run_id, "granted", str(grant.waited_ms))
        except redis.RedisError:
            logger.exception("%s[%s]: could not record its wait", task.name, run_id)
    keeper = renewer()
    lease = SlotLease(
        store, group, token, run_id, lease_ms, grant, now=keeper.clock(), slot=limit.concurrency is not None
    )
    _held[token] = lease
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
    _held.pop(lease.token, None)
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


def wait(task: KeyedTask, store: DedupStore, member: str | None, denial: Denial, limit: LimitPolicy) -> NoReturn:
    """Re-publish the current run to come back when its turn should come, note why, and raise ``Ignore``."""
    request = task.request
    key = split_member(denial.group)[1]
    if denial.reason == "rate" and limit.rate is not None:
        why = f"rate {denial.in_use}/{limit.rate} used for {key}"
    else:
        why = f"concurrency {denial.in_use}/{limit.concurrency} in use for {key}"
    countdown = denial.wait_ms / 1000 + random.uniform(0, 0.02)
    detail = f"{why}, {denial.position} ahead; again in {countdown:.2f}s"
    if member is not None:
        try:
            note(store, member, str(request.id), "wait", why)
        except redis.RedisError:
            logger.exception("%s[%s]: could not record that it waits", task.name, request.id)
    decisions.log("limited", task.name, key, request.id, detail)
    task.signature_from_request(request, countdown=countdown).apply_async()
    raise Ignore()


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


def limited_call(task: KeyedTask, args: tuple[Any, ...], kwargs: dict[str, Any], body: Any) -> Any:
    """Run ``body`` under the task's limits only (``dedup_mode="off"``: no key, no lock, no record)."""
    token = processes.claim()
    try:
        lease = admit(task, runtime.store_for(task.app), None, token)
        try:
            return body(args, kwargs)
        finally:
            leave(lease, ran=True)
    finally:
        processes.retire(token)
