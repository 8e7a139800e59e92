"""Renewable execution locks: an owner token, a TTL, one renewer thread per process.

A running keyed task holds its key's lock. The process's :class:`Renewer`
extends every lock it holds in one Redis call at a fraction of the shortest
TTL. A lock is *lost* when renewal finds it expired or taken over, or cannot
reach Redis before the lock's TTL would have run out; the task sees that
through ``lock.lost`` (a :class:`Flag`; tasks ask ``self.dedup_lock_lost``).

The renewer keeps alive whatever is :class:`Renewable`: execution locks, and
the limit slots' leases of ``limits``, which it renews with the locks but
knows only through that protocol.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Hashable, Sequence
from typing import ClassVar, Protocol, TypeVar

import redis

from ..exceptions import store_failure
from ..store.store import DedupStore, LockRef
from . import processes

logger = logging.getLogger("celery_dedup")

#: Renew when this fraction of the TTL has passed since the last renewal.
RENEW_FRACTION = 1 / 3


_R = TypeVar("_R", bound="Renewable")


class Renewable(Protocol):
    """What the renewer keeps alive: an :class:`ExecutionLock`, a limit slot's lease (``limits.SlotLease``).

    Those of one :meth:`batch` are renewed together, in one call of
    :meth:`renew` on any of them.
    """

    ttl_ms: int
    #: Local (monotonic) time until which it is surely still held.
    valid_until: float
    #: When the renewer should extend it next.
    renew_at: float
    #: Why one that a renewal no longer finds is lost.
    gone: ClassVar[str]

    def batch(self) -> Hashable:
        """What it is renewed with: those of its kind on its server, with its TTLs."""
        ...

    def renew(self: _R, batch: list[_R]) -> Collection[_R]:
        """Extend ``batch`` (this one among them) in one call; returns those no longer held."""
        ...

    def lose(self, why: str) -> None:
        """Mark it lost for ``why``, and say so once."""
        ...


def new_token() -> str:
    """A token unique to one delivery: the process that runs it, what proves its death, and a random part.

    See :func:`celery_dedup.worker.processes.token`. Short on purpose: the record
    keeps it, and a record value over the server's ``hash-max-listpack-value``
    (64 bytes) makes the whole record twice as big.
    """
    return processes.token()


class Flag:
    """Set once, read from any thread: how a lock's owner learns that it was lost.

    ``threading.Event``'s ``set`` and ``is_set`` without its ``wait``, which
    nobody needs here: an Event builds a Condition and its lock, for every
    delivery.
    """

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


class ExecutionLock:
    """One delivery's hold on a key's execution."""

    gone: ClassVar[str] = "taken over or expired"

    def __init__(self, store: DedupStore, member: str, token: str, ttl_ms: int, record_ms: int, *, now: float) -> None:
        self.store = store
        self.member = member
        self.token = token
        self.ttl_ms = ttl_ms
        self.record_ms = record_ms
        self.ref: LockRef = store.lock_ref(member, token)
        self.lost = Flag()
        #: Local (monotonic) time until which the lock is surely still ours.
        self.valid_until = now + ttl_ms / 1000
        #: When the renewer should extend it next.
        self.renew_at = now + ttl_ms / 1000 * RENEW_FRACTION

    def __repr__(self) -> str:
        return f"<ExecutionLock {self.member!r} token={self.token!r} lost={self.lost.is_set()}>"

    def batch(self) -> Hashable:
        return ExecutionLock, id(self.store.client), self.ttl_ms, self.record_ms

    def renew(self, batch: list[ExecutionLock]) -> list[ExecutionLock]:
        lost = set(self.store.renew([lock.ref for lock in batch], lock_ms=self.ttl_ms, record_ms=self.record_ms))
        return [lock for lock in batch if lock.ref in lost]

    def lose(self, why: str) -> None:
        if not self.lost.is_set():
            self.lost.set()
            logger.error("execution lock lost for key %r (%s): another delivery may run it now", self.member, why)


class Renewer:
    """Keeps every lock of this process alive; one daemon thread, started on first use.

    ``clock`` is the seam tests use to control time.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._locks: set[Renewable] = set()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        #: When the thread wakes next at the latest (clock time), and how long it sleeps when idle: the
        #: shortest renewal interval seen, so a lock added to an idle renewer is due no sooner than that.
        self._wake_at = 0.0
        self._idle_wait = 60.0

    def add(self, lock: Renewable) -> None:
        with self._cond:
            self._locks.add(lock)
            self._idle_wait = min(self._idle_wait, lock.ttl_ms / 1000 * RENEW_FRACTION)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="celery-dedup-renewer", daemon=True)
                self._thread.start()
            elif lock.renew_at < self._wake_at:
                # Waking the thread costs a switch per task: only when this lock is due before it wakes anyway.
                self._cond.notify()

    def remove(self, lock: Renewable) -> None:
        with self._cond:
            self._locks.discard(lock)

    def held(self) -> list[ExecutionLock]:
        with self._cond:
            return [lock for lock in self._locks if isinstance(lock, ExecutionLock)]

    def _run(self) -> None:
        while True:
            with self._cond:
                now = self.clock()
                due = [lock for lock in self._locks if lock.renew_at <= now]
                if not due:
                    # A new lock only wakes us to recompute the wait: it is not due yet.
                    next_due = min((lock.renew_at for lock in self._locks), default=now + self._idle_wait)
                    self._wake_at = next_due
                    self._cond.wait(max(next_due - now, 0.01))
                    self._wake_at = 0.0  # awake: a lock added now is seen before the next wait
                    continue
            self.renew(due)

    def renew(self, locks: list[Renewable]) -> None:
        """Renew ``locks`` (and limit slot leases) now, one call per :meth:`~Renewable.batch`."""
        batches: dict[Hashable, list[Renewable]] = defaultdict(list)
        for lock in locks:
            batches[lock.batch()].append(lock)
        for batch in batches.values():
            started = self.clock()
            try:
                lost = set(batch[0].renew(batch))
            except redis.RedisError as exc:
                self._unreachable(batch, exc)
                continue
            for lock in batch:
                if lock in lost:
                    self._lose(lock, lock.gone)
                else:
                    lock.valid_until = started + lock.ttl_ms / 1000
                    lock.renew_at = started + lock.ttl_ms / 1000 * RENEW_FRACTION

    def _unreachable(self, group: Sequence[Renewable], exc: Exception) -> None:
        now = self.clock()
        for lock in group:
            if now >= lock.valid_until:
                self._lose(lock, f"not renewed within the lock TTL: {store_failure(exc)}")
            else:
                lock.renew_at = now + min(0.5, (lock.valid_until - now) / 2)  # retry soon, before it expires
                logger.warning("could not renew %r, retrying: %s", lock, exc)

    def _lose(self, lock: Renewable, why: str) -> None:
        lock.lose(why)
        self.remove(lock)


_renewer: Renewer | None = None
_renewer_lock = threading.Lock()


def renewer() -> Renewer:
    """This process's renewer."""
    global _renewer  # noqa: PLW0603 - one renewer per process is the point
    found = _renewer
    if found is not None:  # made already: no lock to take
        return found
    with _renewer_lock:
        if _renewer is None:
            _renewer = Renewer()
        return _renewer


def _forget_after_fork() -> None:
    global _renewer  # noqa: PLW0603
    _renewer = None  # the parent's thread does not exist in the child


os.register_at_fork(after_in_child=_forget_after_fork)
