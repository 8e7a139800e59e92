"""A limit group's state in Redis: places taken and given back, slot leases renewed, groups read for operators.

The delivery side (who asks, when a run waits, what a lost slot means) is
``celery_dedup.worker.limits``; see there for how limits work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

from redis.crc import key_slot

from ..keys import (
    KeySchema,
    limit_group_member,
    limit_group_namespace,
    limit_group_of,
    limit_key_of,
    split_member,
    task_namespace,
)
from ..policy import LimitPolicy, Rate, rates_from_text, rates_text
from . import commands
from .commands import AcquireCode, GiveBackCode
from .schema import LIMIT_CONF_FIELDS
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
    #: Whether it took a slot (a concurrency limit, declared or overridden) to renew and give back.
    slot: bool = True


@dataclass(frozen=True)
class Denial:
    """A delivery may not start yet."""

    group: str
    #: When to come back, by the best guess (ms).
    wait_ms: int
    #: ``"concurrency"``, ``"rate"`` or ``"paused"``.
    reason: str
    #: Slots in use (concurrency, paused) or starts in the window it waits for (rate).
    in_use: int
    #: Runs ahead of it in the group's line.
    position: int
    #: Tokens of the slots' holders (concurrency), to find dead ones.
    holders: tuple[str, ...] = ()
    #: The effective limit that refused it: the concurrency (``"2"``), the window
    #: (``"30/60000"``: count/period ms), or when the pause ends (ms, server clock; ``"-1"``: until resumed).
    limit: str = ""

    @property
    def window(self) -> Rate | None:
        """The window that refused it (reason ``rate``), None otherwise."""
        found = rates_from_text(self.limit) if self.reason == "rate" else ()
        return found[0] if found else None


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
        at.limit_conf(split_member(group)[0]),
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
    """Ask ``group`` whether delivery ``token`` of run ``run_id`` may start now (``limit_acquire.lua``).

    ``policy`` gives the declared values; a named group's overrides and pauses in the store win over them.
    """
    command = commands.LimitAcquire(
        group=group,
        token=token,
        run=run_id,
        limit=policy.concurrency or 0,
        rates=rates_text(policy.rates),
        lease=lease_ms,
        ns=task_namespace(task_name),
        evict=tuple(evict),
    )
    reply = store.scripts.run(_group_keys(store, group), command, client=store.client)
    if AcquireCode(int(reply[0])) == AcquireCode.GRANTED:
        return Grant(group, int(reply[1]), int(reply[2]), slot=bool(int(reply[3])))
    holders = tuple(_text(token) for token in reply[6:])
    return Denial(group, int(reply[1]), _text(reply[2]), int(reply[3]), int(reply[4]), holders, _text(reply[5]))


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


def back_off(store: DedupStore, group: str, run_id: str, *, after_ms: int, lease_ms: int) -> int:
    """Pause ``group`` for ``after_ms`` and put run ``run_id`` first in its line (``limit_backoff.lua``).

    Returns when the pause ends (ms, server clock; -1: paused until resumed).
    """
    at = store.schema.shard_of(group)
    namespace, key = split_member(group)
    keys = [at.limit_conf(namespace), at.limit_waiting(group), at.limit_deadlines(group)]
    command = commands.LimitBackoff(key=key, run=run_id, after=after_ms, lease=lease_ms)
    return int(store.scripts.run(keys, command, client=store.client))


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
    """One limit group key, as an operator sees it: its effective values (overrides applied) and its usage."""

    #: The group id (``<namespace>:<key>``).
    group: str
    #: The task's (escaped) name; "" for a named group (see ``name``).
    task: str
    #: The group key (``*``: a named group's single quota).
    key: str
    concurrency: int | None
    #: Slots held now (unexpired leases).
    in_use: int
    #: Runs in the waiting line.
    waiting: int
    #: The first window (see ``rates``), None without a rate limit.
    rate: Rate | None
    #: Starts in the first window now.
    starts: int
    #: Mean body time (ms, exponentially weighted; 0: none ended yet).
    avg_ms: int
    #: When the group was last asked (ms, server clock).
    last_used: int
    #: The named group (``limit_group``); None: a task's own limits.
    name: str | None = None
    #: Every window, effective.
    rates: tuple[Rate, ...] = ()
    #: Starts in each of ``rates`` now.
    starts_per_window: tuple[int, ...] = ()
    #: While paused: when the pause ends (ms, server clock; -1: until resumed); None: not paused.
    paused_until: int | None = None


#: The conf fields :func:`effective` reads, for a group key ``k``: the group's, then the key's.
def conf_fields(key: str) -> list[str]:
    """``limit_conf`` fields that bear on group key ``key``: the group-wide ones, then the key's own."""
    return [*LIMIT_CONF_FIELDS, *(f"k:{key}:{field}" for field in LIMIT_CONF_FIELDS)]


def effective(
    values: Sequence[Any], declared_concurrency: int | None, declared_rates: tuple[Rate, ...], now: int
) -> tuple[int | None, tuple[Rate, ...], int | None]:
    """``(concurrency, rates, paused_until)`` in effect, from the :func:`conf_fields` values, as limit_acquire.lua.

    A key's value wins over the group's, the group's over the declared; either pause holds.
    """
    group_c, group_r, group_p, key_c, key_r, key_p = (None if v is None else _text(v) for v in values)
    concurrency_text = key_c if key_c is not None else group_c
    concurrency = int(concurrency_text) if concurrency_text else declared_concurrency
    rates_text_now = key_r if key_r is not None else group_r
    rates = rates_from_text(rates_text_now) if rates_text_now is not None else declared_rates
    pauses = [int(p) for p in (group_p, key_p) if p]
    paused: int | None = None
    if -1 in pauses:
        paused = -1
    elif any(p > now for p in pauses):
        paused = max(pauses)
    return concurrency or None, rates, paused


def groups(store: DedupStore, *, limit: int = 100) -> list[GroupState]:
    """The group keys asked within the last day, most recently used first (at most ``limit``).

    Their values are the effective ones now: the declared (as the last acquire saw them)
    under the overrides in the store.
    """
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
            namespace, key = split_member(group)
            pipe.zcount(at.limit_slots(group), f"({now}", "+inf")
            pipe.zcard(at.limit_waiting(group))
            pipe.hmget(at.limit_info(group), "avg_ms", "d_concurrency", "d_rates", "rate", "period_ms")
            pipe.hmget(at.limit_conf(namespace), conf_fields(key))
        replies = pipe.execute()
    values = []
    for i, (last, group, at) in enumerate(found):
        in_use, waiting, info, conf = replies[4 * i : 4 * i + 4]
        avg, declared_c, declared_r, old_rate, old_period = (None if v is None else _text(v) for v in info)
        if declared_r is not None:
            declared_rates = rates_from_text(declared_r)
        else:  # written by an older acquire: one window
            declared_rates = rates_from_text(f"{old_rate}/{old_period}") if old_rate and old_period else ()
        concurrency, rates, paused = effective(conf, int(declared_c or 0) or None, declared_rates, now)
        values.append((last, group, at, int(in_use), int(waiting), int(avg or 0), concurrency, rates, paused))
    with store.client.pipeline(transaction=False) as pipe:
        for entry in values:
            for rate in entry[7]:
                pipe.zcount(entry[2].limit_starts(entry[1]), f"({now - rate.period_ms}", "+inf")
        counts = iter(pipe.execute())
    states = []
    for last, group, _, in_use, waiting, mean_ms, concurrency, rates, paused in values:
        per_window = tuple(int(next(counts)) for _ in rates)
        namespace, key = split_member(group)
        name = limit_group_of(namespace)
        states.append(
            GroupState(
                group,
                "" if name is not None else namespace,
                key,
                concurrency,
                in_use,
                waiting,
                rates[0] if rates else None,
                per_window[0] if per_window else 0,
                mean_ms,
                last,
                name,
                rates,
                per_window,
                paused,
            )
        )
    return states


# --- a named group's run-time values (its ``limit_conf`` copies) -------------------------------


def server_ms(store: DedupStore) -> int:
    """Now on the store's clock (ms): what every deadline of the limits is on."""
    seconds, micros = store.client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def _conf_field(name: str, key: str | None, field: str) -> str:
    """A ``limit_conf`` field: the group's ``field``, or ``k:<key>:<field>`` (as limit_acquire.lua reads it)."""
    if key is None:
        return field
    return f"k:{split_member(limit_group_member(name, key))[1]}:{field}"


def _conf_copies(store: DedupStore, name: str, key: str | None) -> list[str]:
    """The conf copies a value of ``name`` (``key`` None: group-wide) is written to: every shard's, or its key's."""
    namespace = limit_group_namespace(name)
    if key is None:
        return [at.limit_conf(namespace) for at in store.schema.shards_all()]
    return [store.schema.shard_of(limit_group_member(name, key)).limit_conf(namespace)]


def set_conf(store: DedupStore, name: str, key: str | None, values: dict[str, str | int]) -> None:
    """Write ``values`` (``LIMIT_CONF_FIELDS`` names) for named group ``name``, or one ``key`` of it."""
    mapping = {_conf_field(name, key, field): value for field, value in values.items()}
    with store.client.pipeline(transaction=False) as pipe:
        for copy in _conf_copies(store, name, key):
            pipe.hset(copy, mapping=cast(Any, mapping))
        pipe.execute()


def clear_conf(store: DedupStore, name: str, key: str | None, fields: Sequence[str]) -> bool:
    """Remove ``fields`` for named group ``name`` (or one ``key``); whether any was set."""
    names = [_conf_field(name, key, field) for field in fields]
    with store.client.pipeline(transaction=False) as pipe:
        for copy in _conf_copies(store, name, key):
            pipe.hdel(copy, *names)
        return any(int(removed) for removed in pipe.execute())


def read_conf(store: DedupStore, name: str) -> tuple[dict[str, str], dict[str, dict[str, str]], int]:
    """Named group ``name``'s conf: ``(group-wide fields, {key: its fields}, now on the server clock)``.

    Group-wide fields are read from the first shard's copy (every copy has them); a key's
    fields from the copy of its shard. Keys are given as :func:`override` takes them.
    """
    namespace = limit_group_namespace(name)
    with store.client.pipeline(transaction=False) as pipe:
        for at in store.schema.shards_all():
            pipe.hgetall(at.limit_conf(namespace))
        pipe.time()
        *copies, (seconds, micros) = pipe.execute()
    group: dict[str, str] = {}
    keys: dict[str, dict[str, str]] = {}
    for n, copy in enumerate(copies):
        for raw_field, raw_value in copy.items():
            field, value = _text(raw_field), _text(raw_value)
            if not field.startswith("k:"):
                if n == 0:
                    group[field] = value
                continue
            part, _, kind = field[2:].rpartition(":")
            keys.setdefault(limit_key_of(part), {})[kind] = value
    return group, keys, int(seconds) * 1000 + int(micros) // 1000
