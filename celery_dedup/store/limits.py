"""A limit group's state in Redis: places taken and given back, slot leases renewed, groups read for operators.

The delivery side (who asks, when a run waits, what a lost slot means) is
``celery_dedup.worker.limits``; see there for how limits work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

from redis.crc import key_slot

from ..keys import KeySchema, split_member, task_namespace
from ..policy import _PERIODS, LimitPolicy, Rate
from . import commands
from .commands import AcquireCode, GiveBackCode
from .store import DedupStore, _text


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
    rate = policy.rates[0] if policy.rates else None
    command = commands.LimitAcquire(
        group=group,
        token=token,
        run=run_id,
        limit=policy.concurrency or 0,
        rate=rate.count if rate else 0,
        period=rate.period_ms if rate else 0,
        lease=lease_ms,
        ns=task_namespace(task_name),
        evict=tuple(evict),
    )
    reply = store.scripts.run(_group_keys(store, group), command, client=store.client)
    if AcquireCode(int(reply[0])) == AcquireCode.GRANTED:
        return Grant(group, int(reply[1]), int(reply[2]))
    holders = tuple(_text(token) for token in reply[5:])
    return Denial(group, int(reply[1]), _text(reply[2]), int(reply[3]), int(reply[4]), holders)


#: ``limit_release.lua``'s replies: nothing held; a live slot or a start; a slot whose lease had lapsed.
RELEASED = {GiveBackCode.NONE: "none", GiveBackCode.HELD: "held", GiveBackCode.LAPSED: "lapsed"}


def give_back(store: DedupStore, group: str, token: str, *, ran: bool) -> str:
    """Give back what ``token`` took in ``group`` (``limit_release.lua``); ``ran``: the body ran.

    Returns what it held (:data:`RELEASED`): ``none`` for a delivery that took
    a slot means its lease lapsed and was taken back, or it was evicted.
    """
    at = store.schema.shard_of(group)
    keys = [at.limit_slots(group), at.limit_starts(group), at.limit_info(group)]
    reply = store.scripts.run(keys, commands.LimitRelease(token=token, ran="1" if ran else "0"), client=store.client)
    return RELEASED[GiveBackCode(int(reply))]


def release(store: DedupStore, group: str, token: str, *, ran: bool) -> bool:
    """Give back what ``token`` took in ``group``; whether it held anything."""
    return give_back(store, group, token, ran=ran) != "none"


def note(store: DedupStore, member: str, task_id: str, what: str, detail: str) -> None:
    """Write ``what`` (``wait`` / ``granted``) into run ``task_id``'s status record (``limit_note.lua``)."""
    at = store.schema.shard_of(member)
    keys = [at.record(member)]
    command = commands.LimitNote(task_id=task_id, what=what, detail=detail, history_len=store.history_length)
    store.scripts.run(keys, command, client=store.client)


def leave_line(store: DedupStore, group: str, run_id: str) -> None:
    """Take run ``run_id`` out of ``group``'s waiting line."""
    at = store.schema.shard_of(group)
    with store.client.pipeline(transaction=False) as pipe:
        pipe.zrem(at.limit_waiting(group), run_id)
        pipe.zrem(at.limit_deadlines(group), run_id)
        pipe.execute()


class Lease(Protocol):
    """A delivery's place in a group (``SlotLease``), as renewing it needs it."""

    store: DedupStore
    #: The group.
    member: str
    token: str


_Lease = TypeVar("_Lease", bound=Lease)


def renew_leases(leases: Sequence[_Lease], *, lease_ms: int) -> list[_Lease]:
    """Extend ``leases`` (one store) in one call per cluster slot; returns the ones no longer held."""
    if not leases:
        return []
    store = leases[0].store
    by_slot: dict[int, list[_Lease]] = {}
    for lease in leases:
        slots = store.schema.shard_of(lease.member).limit_slots(lease.member)
        by_slot.setdefault(key_slot(slots.encode("utf-8", "surrogatepass")), []).append(lease)
    lost: list[_Lease] = []
    for group in by_slot.values():
        keys: list[str] = []
        for lease in group:
            at = store.schema.shard_of(lease.member)
            keys += [at.limit_slots(lease.member), at.limit_info(lease.member)]
        command = commands.LimitRenew(lease=lease_ms, tokens=tuple(lease.token for lease in group))
        reply = store.scripts.run(keys, command, client=store.client)
        lost += [group[int(i) - 1] for i in reply]
    return lost


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
