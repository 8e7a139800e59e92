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
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, cast

import redis
from celery.exceptions import Ignore
from redis.crc import key_slot

from . import decisions, processes, runtime
from .exceptions import DedupConfigError, DedupError
from .gate import GateHeader
from .keys import KeyOption, KeySchema, KeySpec, member_for, split_member, task_namespace
from .store.store import DedupStore, _text

if TYPE_CHECKING:
    import inspect

    from .keyed import KeyedTask

logger = logging.getLogger("celery_dedup")

#: Every limit option, as a DedupTask attribute or a keyword of ``@app.task``.
LIMIT_OPTIONS = ("limit_key", "limit_concurrency", "limit_rate")

_PERIODS = {"s": 1000, "m": 60_000, "h": 3_600_000}
_RATE = re.compile(r"\s*(\d+)\s*/\s*([smh])\s*")
#: The most starts one rate allows per period: its window is a log of them.
MAX_RATE = 100_000
MAX_CONCURRENCY = 100_000


@dataclass(frozen=True)
class Rate:
    """At most ``count`` starts in any window of ``period_ms``."""

    count: int
    period_ms: int

    def __str__(self) -> str:
        unit = {ms: name for name, ms in _PERIODS.items()}[self.period_ms]
        return f"{self.count}/{unit}"


@dataclass(frozen=True)
class LimitPolicy:
    """A task's limits, validated: the group's key, and at least one of concurrency and rate."""

    #: The group's key; None: the task's dedup key.
    spec: KeySpec | None
    concurrency: int | None = None
    rate: Rate | None = None


def parse_rate(value: Any, *, task: str | None = None) -> Rate:
    """``"R/s"``, ``"R/m"`` or ``"R/h"`` as a :class:`Rate`, R from 1 to ``MAX_RATE``.

    Raises:
        DedupConfigError: anything else.
    """
    match = _RATE.fullmatch(value) if isinstance(value, str) else None
    count = int(match.group(1)) if match else 0
    if match is None or not 1 <= count <= MAX_RATE:
        raise DedupConfigError(
            "limit_rate", value, f"must be 'R/s', 'R/m' or 'R/h' with R from 1 to {MAX_RATE}", task=task
        )
    return Rate(count, _PERIODS[match.group(2)])


def resolve(
    task: str, key: KeyOption, concurrency: Any, rate: Any, signature: inspect.Signature, max_key_length: int
) -> LimitPolicy | None:
    """The task's :class:`LimitPolicy` from its options, or None when it sets no limit.

    Raises:
        DedupConfigError: a bad value, or a ``limit_key`` without a limit to apply.
    """
    if concurrency is None and rate is None:
        if key is not None:
            raise DedupConfigError("limit_key", key, "applies only with limit_concurrency or limit_rate", task=task)
        return None
    if concurrency is not None and (
        isinstance(concurrency, bool) or not isinstance(concurrency, int) or not 1 <= concurrency <= MAX_CONCURRENCY
    ):
        raise DedupConfigError(
            "limit_concurrency", concurrency, f"must be a whole number from 1 to {MAX_CONCURRENCY}", task=task
        )
    spec = None
    if key is not None:
        try:
            spec = KeySpec(task, key, signature, max_key_length)
        except DedupConfigError as exc:
            raise DedupConfigError("limit_key", key, exc.reason, task=task) from None
    return LimitPolicy(spec, concurrency, None if rate is None else parse_rate(rate, task=task))


# --- the store side -------------------------------------------------------------------------


@dataclass(frozen=True)
class Grant:
    """A delivery got through its group's limits."""

    #: The group (``<escaped task name>:<group key>``).
    group: str
    #: When, on the server's clock (ms): the start the rate limit counts.
    granted_at: int
    #: How long the run waited for it, from its first refusal (ms; 0: it did not wait).
    waited_ms: int


@dataclass(frozen=True)
class Denial:
    """A delivery may not start yet."""

    group: str
    #: When to come back, by the best guess (ms).
    wait_ms: int
    #: ``"concurrency"`` or ``"rate"``.
    reason: str
    #: Slots in use (concurrency) or starts in the window (rate).
    in_use: int
    #: Runs ahead of it in the group's line.
    position: int
    #: Tokens of the slots' holders (concurrency), to find dead ones.
    holders: tuple[str, ...] = ()


def _group_keys(store: DedupStore, group: str) -> list[str]:
    at = store.schema.shard_of(group)
    return [
        at.limit_slots(group),
        at.limit_starts(group),
        at.limit_waiting(group),
        at.limit_deadlines(group),
        at.limit_info(group),
        at.limit_groups,
        at.stats,
    ]


def acquire(
    store: DedupStore,
    group: str,
    token: str,
    run_id: str,
    policy: LimitPolicy,
    *,
    lease_ms: int,
    task_name: str,
    evict: Sequence[str] = (),
) -> Grant | Denial:
    """Ask ``group`` whether delivery ``token`` of run ``run_id`` may start now (``limit_acquire.lua``)."""
    rate = policy.rate
    args: list[Any] = [
        group,
        token,
        run_id,
        policy.concurrency or 0,
        rate.count if rate else 0,
        rate.period_ms if rate else 0,
        lease_ms,
        task_namespace(task_name),
        *evict,
    ]
    reply = store.scripts.limit_acquire(_group_keys(store, group), args, client=store.client)
    if int(reply[0]) == 1:
        return Grant(group, int(reply[1]), int(reply[2]))
    holders = tuple(_text(token) for token in reply[5:])
    return Denial(group, int(reply[1]), _text(reply[2]), int(reply[3]), int(reply[4]), holders)


#: ``limit_release.lua``'s replies: nothing held; a live slot or a start; a slot whose lease had lapsed.
RELEASED = {0: "none", 1: "held", 2: "lapsed"}


def give_back(store: DedupStore, group: str, token: str, *, ran: bool) -> str:
    """Give back what ``token`` took in ``group`` (``limit_release.lua``); ``ran``: the body ran.

    Returns what it held (:data:`RELEASED`): ``none`` for a delivery that took
    a slot means its lease lapsed and was taken back, or it was evicted.
    """
    at = store.schema.shard_of(group)
    keys = [at.limit_slots(group), at.limit_starts(group), at.limit_info(group)]
    return RELEASED[int(store.scripts.limit_release(keys, [token, "1" if ran else "0"], client=store.client))]


def release(store: DedupStore, group: str, token: str, *, ran: bool) -> bool:
    """Give back what ``token`` took in ``group``; whether it held anything."""
    return give_back(store, group, token, ran=ran) != "none"


def note(store: DedupStore, member: str, task_id: str, what: str, detail: str) -> None:
    """Write ``what`` (``wait`` / ``granted``) into run ``task_id``'s status record (``limit_note.lua``)."""
    at = store.schema.shard_of(member)
    keys = [at.record(member), at.history(member)]
    store.scripts.limit_note(keys, [task_id, what, detail, store.history_length], client=store.client)


class SlotLease:
    """One delivery's place in its group (a slot, a start), renewed by the process's renewer with its lock."""

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


def renew_leases(leases: Sequence[SlotLease], *, lease_ms: int) -> list[SlotLease]:
    """Extend ``leases`` (one store) in one call per cluster slot; returns the ones no longer held."""
    if not leases:
        return []
    store = leases[0].store
    by_slot: dict[int, list[SlotLease]] = {}
    for lease in leases:
        slots = store.schema.shard_of(lease.member).limit_slots(lease.member)
        by_slot.setdefault(key_slot(slots.encode("utf-8", "surrogatepass")), []).append(lease)
    lost: list[SlotLease] = []
    for group in by_slot.values():
        keys: list[str] = []
        for lease in group:
            at = store.schema.shard_of(lease.member)
            keys += [at.limit_slots(lease.member), at.limit_info(lease.member)]
        reply = store.scripts.limit_renew(keys, [lease_ms, *(lease.token for lease in group)], client=store.client)
        lost += [group[int(i) - 1] for i in reply]
    return lost


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
    """Whether the delivery that took slot ``token`` provably runs no more (:func:`~celery_dedup.processes.ended`).

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
    ``token``: the delivery's, claimed (:func:`~celery_dedup.processes.claim`)
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
    from .lock import renewer  # noqa: PLC0415 - lock imports this module

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
    at = store.with_prefix(gate.prefix).schema.shard_of(member)
    return bool(store.client.hexists(at.followers(member), run_id))


def leave(lease: SlotLease | None, *, ran: bool) -> None:
    """Give back a lease (``ran``: its body ran); store errors are logged: its expiry frees it."""
    if lease is None:
        return
    from .lock import renewer  # noqa: PLC0415 - lock imports this module

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
    at = store.schema.shard_of(group)
    try:
        with store.client.pipeline(transaction=False) as pipe:
            pipe.zrem(at.limit_waiting(group), run_id)
            pipe.zrem(at.limit_deadlines(group), run_id)
            pipe.execute()
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


# --- reading groups (CLI, admin) ------------------------------------------------------------


@dataclass(frozen=True)
class GroupState:
    """One limit group, as an operator sees it."""

    group: str
    task: str
    key: str
    concurrency: int | None
    #: Slots held now (unexpired leases).
    in_use: int
    #: Runs in the waiting line.
    waiting: int
    rate: Rate | None
    #: Starts in the current rate window.
    starts: int
    #: Mean body time (ms, exponentially weighted; 0: none ended yet).
    avg_ms: int
    #: When the group was last asked (ms, server clock).
    last_used: int


def groups(store: DedupStore, *, limit: int = 100) -> list[GroupState]:
    """The groups asked within the last day, most recently used first (at most ``limit``)."""
    found: list[tuple[int, str, KeySchema]] = []
    for at in store.schema.shards_all():
        entries = cast(list[tuple[Any, float]], store.client.zrevrange(at.limit_groups, 0, limit - 1, withscores=True))
        found += [(int(score), _text(name), at) for name, score in entries]
    found.sort(key=lambda item: -item[0])
    found = found[:limit]
    seconds, micros = store.client.time()
    now = int(seconds) * 1000 + int(micros) // 1000
    with store.client.pipeline(transaction=False) as pipe:
        for _, group, at in found:
            pipe.zcount(at.limit_slots(group), f"({now}", "+inf")
            pipe.zcard(at.limit_waiting(group))
            pipe.hmget(at.limit_info(group), "concurrency", "rate", "period_ms", "avg_ms")
            pipe.zrangebyscore(at.limit_starts(group), "-inf", "+inf", withscores=True)
        replies = pipe.execute()
    states = []
    for i, (last, group, _) in enumerate(found):
        in_use, waiting, info, starts = replies[4 * i : 4 * i + 4]
        concurrency, count, period, avg = (int(_text(v)) if v is not None else 0 for v in info)
        rate = Rate(count, period) if count and period in _PERIODS.values() else None
        recent = sum(1 for _, at_ms in starts if rate is not None and at_ms > now - rate.period_ms)
        namespace, key = split_member(group)
        states.append(
            GroupState(group, namespace, key, concurrency or None, int(in_use), int(waiting), rate, recent, avg, last)
        )
    return states
