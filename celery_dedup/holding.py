"""A named limit group's quota from code outside tasks: a view, a script (``celery_dedup.limits.acquire``).

``with acquire(app, "partner-api", key="acme", timeout=5) as holding:`` takes
a place in group key ``acme`` of the named group ``partner-api``: a slot
(its concurrency) and a start in every window of its rates, through the
same script, the same waiting line and the same slots the group's task
deliveries use (``limit_acquire.lua``, see :mod:`celery_dedup.worker.limits`):

- **Fair**: a caller that must wait takes a place in the group key's line by
  its first arrival, with a run id of its own, and keeps it while it asks
  again when told to (the script's wait, never less than 50 ms: nothing
  spins). Tasks and callers are served in one arrival order.
- **Bounded**: ``timeout`` seconds (None: no bound) after it first asked,
  a caller still refused leaves the line and raises
  :class:`~celery_dedup.DedupLimitTimeout`; it holds nothing.
- **Given back**: on leaving the ``with`` block, normally or by an exception,
  the slot is given back (the start stays in its windows: the call was made).
- **Leased**: a slot is a lease of ``lease`` seconds (default
  :data:`DEFAULT_LEASE`), renewed every third of it by the process's
  renewer thread (the one that renews the workers' locks). A process that
  dies inside the block stops renewing it: its slot frees when the lease
  runs out, or sooner when a delivery or caller on the same host is
  refused and finds the holder's process gone (its token names the
  process, :func:`~celery_dedup.worker.processes.claim`), and evicts it.

Safe from threads and greenlets: each call keeps its own token, place and
lease; the store's client and the renewer are shared.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import redis

from . import runtime
from .exceptions import DedupArgumentError, DedupLimitTimeout
from .keys import member_for
from .policy import LimitPolicy, parse_rate
from .store.limits import Denial, Grant, give_back, leave_line
from .store.limits import acquire as ask
from .store.store import DedupStore
from .worker import processes
from .worker.limits import SlotLease, owner_gone, slot_lost
from .worker.lock import renewer

logger = logging.getLogger("celery_dedup")

#: Seconds a slot taken by :func:`acquire` lives unrenewed: the longest a dead process's slot stays taken
#: (unless evicted sooner). Renewed every third of it, so a block shorter than that costs no renewal.
DEFAULT_LEASE = 10.0
#: The shortest lease accepted (the execution lock's minimum TTL).
MIN_LEASE = 1.0
#: The clock waits are measured on; tests may replace it.
clock: Callable[[], float] = time.monotonic


@dataclass
class Holding:
    """A place held in a limit group key by :func:`acquire`, until its ``with`` block ends."""

    #: The named group.
    group: str
    #: The group key (None: the group's single quota).
    key: str | None
    #: The holder's token (names this process: see :func:`~celery_dedup.worker.processes.token`).
    token: str
    #: When it got through, on the server's clock (ms): the start its windows count.
    granted_at: int
    _lease: SlotLease | None = field(default=None, repr=False)

    @property
    def lost(self) -> bool:
        """Whether its slot was taken back (its lease lapsed unrenewed, or it was evicted) while held."""
        return self._lease is not None and self._lease.lost.is_set()


def _group(app: Any, name: str, key: str | None) -> tuple[str, LimitPolicy]:
    """The group id and limits of group key ``key`` of the named group ``name``."""
    declared = (app.conf.get("dedup_limit_groups") or {}).get(name)
    if not isinstance(declared, dict):
        raise DedupArgumentError("group", name, "no such limit group in dedup_limit_groups")
    rates = declared.get("rate")
    rate = parse_rate(rates if isinstance(rates, str) else rates[0]) if rates else None
    return member_for(f"~{name}", "*" if key is None else key), LimitPolicy(
        None, concurrency=declared.get("concurrency"), rate=rate
    )


def _seconds(parameter: str, value: Any, *, least: float, none: bool) -> float | None:
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < least:
        raise DedupArgumentError(parameter, value, f"must be a number of seconds, at least {least:g}")
    return float(value)


@contextmanager
def acquire(
    app: Any, group: str, key: str | None = None, *, timeout: float | None = None, lease: float | None = None
) -> Iterator[Holding]:
    """Hold a place in group key ``key`` of the named limit group ``group`` for the ``with`` block.

    Waits its turn (in the line the group's tasks wait in) for at most
    ``timeout`` seconds (None: as long as it takes; 0: one try). ``lease``:
    seconds its slot outlives this process (default :data:`DEFAULT_LEASE`).

    Raises:
        DedupLimitTimeout: no place within ``timeout``; the caller left the line.
        DedupArgumentError: an unknown group, or a bad ``timeout`` or ``lease``.

    Example:
        >>> with celery_dedup.limits.acquire(app, "partner-api", key="acme", timeout=5):
        ...     partner.post(order)
    """
    wait_for = _seconds("timeout", timeout, least=0.0, none=True)
    lease_s = _seconds("lease", DEFAULT_LEASE if lease is None else lease, least=MIN_LEASE, none=False)
    assert lease_s is not None
    group_id, policy = _group(app, group, key)
    store = runtime.store_for(app)
    lease_ms = int(lease_s * 1000)
    token = processes.claim()
    run_id = f"acquire~{secrets.token_hex(8)}"
    try:
        grant = _wait_turn(
            store,
            group_id,
            run_id,
            partial(_turn, store, group_id, token, run_id, policy, lease_ms, wait_for, group, key),
        )
        keeper = renewer()
        held = SlotLease(store, group_id, token, run_id, lease_ms, grant, now=keeper.clock())
        if policy.concurrency is not None:
            keeper.add(held)
        try:
            yield Holding(group, key, token, grant.granted_at, held if policy.concurrency is not None else None)
        finally:
            keeper.remove(held)
            _give_back(store, held, policy)
    finally:
        processes.retire(token)


def _wait_turn(store: DedupStore, group_id: str, run_id: str, turn: Callable[[], Grant]) -> Grant:
    """``turn()``; a caller it raises for (a timeout, an interrupt, the store) leaves the line."""
    try:
        return turn()
    except BaseException:
        try:
            leave_line(store, group_id, run_id)
        except redis.RedisError:
            logger.exception("could not leave the line of group %r; the place expires", group_id)
        raise


def _turn(
    store: DedupStore,
    group_id: str,
    token: str,
    run_id: str,
    policy: LimitPolicy,
    lease_ms: int,
    wait_for: float | None,
    group: str,
    key: str | None,
) -> Grant:
    """Ask until granted, sleeping each refusal's wait, until ``wait_for`` seconds passed."""
    deadline = None if wait_for is None else clock() + wait_for
    while True:
        answer = ask(store, group_id, token, run_id, policy, lease_ms=lease_ms, task_name=group)
        if isinstance(answer, Denial) and answer.holders:
            dead = [holder for holder in answer.holders if owner_gone(holder)]
            if dead:
                answer = ask(store, group_id, token, run_id, policy, lease_ms=lease_ms, task_name=group, evict=dead)
        if isinstance(answer, Grant):
            return answer
        pause = answer.wait_ms / 1000
        if deadline is not None:
            left = deadline - clock()
            if left <= 0:
                raise DedupLimitTimeout(group, key, float(wait_for or 0.0))
            pause = min(pause, left)
        time.sleep(pause)  # looked up at each call: a gevent-patched process sleeps its greenlet only


def _give_back(store: DedupStore, held: SlotLease, policy: LimitPolicy) -> None:
    """Give back the slot of ``held`` (its start stays counted); store errors are logged: its lease frees it."""
    try:
        what = give_back(store, held.member, held.token, ran=True)
    except redis.RedisError:
        logger.exception("could not give back slot %r of group %r; it expires with its lease", held.token, held.member)
        return
    if policy.concurrency is not None and what != "held":
        slot_lost(held, "its lease lapsed before the block ended: it went on beyond its group's limit")
