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
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import redis

from . import runtime
from .exceptions import DedupArgumentError, DedupLimitTimeout
from .keys import limit_group_member
from .policy import LimitGroup, LimitPolicy
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


def stats_name(group: str) -> str:
    """What the callers of ``group`` are counted as in the stats: ``limited``, ``waited_ms``, ``limit_evicted``."""
    return f"limits.acquire[{group}]"


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
        return self._lease is not None and self._lease.slot and self._lease.lost.is_set()


def _seconds(parameter: str, value: Any, *, least: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < least:
        raise DedupArgumentError(parameter, value, f"must be a number of seconds, at least {least:g}")
    return float(value)


def hold(
    app: Any, group: LimitGroup, key: str | None, *, timeout: float | None = None, lease: float | None = None
) -> AbstractContextManager[Holding]:
    """Hold a place in key ``key`` of the declared group ``group`` (see ``celery_dedup.limits.acquire``).

    Raises:
        DedupArgumentError: a bad ``timeout`` or ``lease`` (at once, not on entering).
    """
    wait_for = None if timeout is None else _seconds("timeout", timeout, least=0.0)
    lease_s = _seconds("lease", DEFAULT_LEASE if lease is None else lease, least=MIN_LEASE)
    return _held(app, group, key, wait_for, int(lease_s * 1000))


@contextmanager
def _held(app: Any, group: LimitGroup, key: str | None, wait_for: float | None, lease_ms: int) -> Iterator[Holding]:
    group_id = limit_group_member(group.name, key)
    policy = LimitPolicy(None, concurrency=group.concurrency, rates=group.rates, group=group.name)
    store = runtime.store_for(app)
    token = processes.claim()
    run_id = f"acquire~{secrets.token_hex(8)}"
    try:
        turn = partial(_turn, store, group_id, token, run_id, policy, lease_ms, wait_for, group.name, key)
        grant = _wait_turn(store, group_id, run_id, turn)
        keeper = renewer()
        held = SlotLease(store, group_id, token, run_id, lease_ms, grant, now=keeper.clock(), slot=grant.slot)
        if held.slot:  # a rate-only group counts starts: nothing to renew
            keeper.add(held)
        try:
            yield Holding(group.name, key, token, grant.granted_at, held)
        finally:
            keeper.remove(held)
            _give_back(store, held)
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
    counted = stats_name(group)
    while True:
        answer = ask(store, group_id, token, run_id, policy, lease_ms=lease_ms, task_name=counted)
        if isinstance(answer, Denial) and answer.holders:
            dead = [holder for holder in answer.holders if owner_gone(holder)]
            if dead:
                answer = ask(store, group_id, token, run_id, policy, lease_ms=lease_ms, task_name=counted, evict=dead)
        if isinstance(answer, Grant):
            return answer
        pause = answer.wait_ms / 1000
        if deadline is not None:
            left = deadline - clock()
            if left <= 0:
                raise DedupLimitTimeout(group, key, float(wait_for or 0.0))
            pause = min(pause, left)
        time.sleep(pause)  # looked up at each call: a gevent-patched process sleeps its greenlet only


def _give_back(store: DedupStore, held: SlotLease) -> None:
    """Give back the slot of ``held`` (its start stays counted); store errors are logged: its lease frees it."""
    try:
        what = give_back(store, held.member, held.token, ran=True)
    except redis.RedisError:
        logger.exception("could not give back slot %r of group %r; it expires with its lease", held.token, held.member)
        return
    if held.slot and what != "held":
        slot_lost(held, "its lease lapsed before the block ended: it went on beyond its group's limit")
