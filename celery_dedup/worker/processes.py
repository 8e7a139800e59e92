"""Whether the process behind a lock token is gone, and acting once it is.

A lock token names the process that took it and what proves its death
(:func:`token`): ``host:pid:start:machine:random``, where ``start`` is the
process's start time (``/proc/<pid>/stat`` field 22, clock ticks since boot:
a reused pid has another) and ``machine`` a short hash of the kernel's boot id
and the pid namespace (two containers may share a host name but not a process
table; a reboot starts pids afresh). Only a process that shares both can
prove the owner dead (:func:`owner_gone`), and only positively: its pid names
no process (``kill`` finds none), a zombie, or another process (its start
time differs). Whatever the judge cannot see (another user's entry under
``/proc`` mounted ``hidepid``, an unreadable start time) is alive, and waits
for its lease.

Deliveries of one process (a threads or gevent pool) share its pid: the
process tells its own live tokens from ended ones by a registry filled before
any store sees a token (:func:`claim`) and emptied once its delivery let go
of everything (:func:`retire`), never by one that can lag (:func:`ended`).

A worker's main process reports endings its pool children never returned
from (a lost child, a hard time limit, ``revoke(terminate=True)``); it may
free such a child's lock only once the child has stopped running, so it asks
here whether it has, and waits for it where it has not yet. A delivery
refused by a lock whose owner is provably gone takes it over (the guard).
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

logger = logging.getLogger("celery_dedup")


#: Host names are cut to this many characters in a token: the status record keeps
#: tokens, and a record value over 64 bytes doubles the record's size.
HOST_CHARS = 20
_PROC = "/proc"


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as file:
            return file.read()
    except OSError:
        return None


def _machine() -> str:
    """8 hex digits naming this boot of this kernel and this pid namespace; "" where neither can be read.

    Also "" where ``/proc`` shows another pid namespace's table (a ``/proc``
    not remounted after ``unshare --pid``): its entries are not our pids.
    """
    boot_id = _read(f"{_PROC}/sys/kernel/random/boot_id")
    try:
        namespace = os.stat(f"{_PROC}/self/ns/pid")
        if os.readlink(f"{_PROC}/self") != str(os.getpid()):
            return ""
    except OSError:
        return ""
    if not boot_id:
        return ""
    seen = f"{boot_id.strip()}/{namespace.st_dev}:{namespace.st_ino}"
    return hashlib.blake2b(seen.encode(), digest_size=4).hexdigest()


def _stat(pid: int) -> list[str] | None:
    """Fields 3 onwards of ``/proc/<pid>/stat`` (after the command name); None if there is no such process."""
    text = _read(f"{_PROC}/{pid}/stat")
    return None if text is None else text.rpartition(")")[2].split()


def start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), None if it does not exist or cannot be read."""
    fields = _stat(pid)
    try:
        return int(fields[19]) if fields is not None else None
    except (IndexError, ValueError):
        return None


_identity: tuple[int, str, str] | None = None


def _own() -> tuple[str, str]:
    """``(pid:start, machine)`` of this process, read once per process (a fork reads again)."""
    global _identity  # noqa: PLW0603 - a per-process cache, invalidated by pid
    pid = os.getpid()
    if _identity is None or _identity[0] != pid:
        started = start_time(pid)
        _identity = (pid, f"{pid}:{started if started is not None else 0}", _machine())
    return _identity[1], _identity[2]


def token() -> str:
    """A new lock token for one delivery of this process: ``host:pid:start:machine:random``.

    At most 57 characters (short enough for a compact record). Where
    ``/proc`` cannot be read, ``start`` is 0 and ``machine`` empty: such a
    token proves nothing and is never taken over.
    """
    process, machine = _own()
    return f"{socket.gethostname()[:HOST_CHARS]}:{process}:{machine}:{secrets.token_hex(4)}"


class Owner(NamedTuple):
    """What a lock token says about the process that took it."""

    host: str
    pid: int
    start: int
    machine: str


def owner_of(token_: str) -> Owner | None:
    """The process a token names; None for a malformed token or one of the older ``host:pid:random`` form."""
    parts = token_.split(":")
    if len(parts) != 5 or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    return Owner(parts[0], int(parts[1]), int(parts[2]), parts[3])


def _here(owner: Owner | None) -> bool:
    """Whether ``owner`` is a process of this machine's process table (same boot, same pid namespace)."""
    return owner is not None and bool(owner.machine) and owner.machine == _own()[1]


def token_pid(token_: str) -> int | None:
    """The pid in a token taken in this process table, None for another machine's (or a malformed) token."""
    owner = owner_of(token_)
    return owner.pid if owner is not None and _here(owner) else None


def owner_gone(token_: str) -> bool:
    """Whether the process that took lock ``token_`` is provably dead.

    True only for a token of this machine (same boot id and pid namespace)
    whose pid names no process (:func:`gone`: none at all, or a zombie) or
    another process now (its start time differs: the pid was reused).
    Another machine's, a malformed token, or a process that exists but whose
    start time cannot be read (``/proc`` hidden from this user) gives False:
    its lock expires unless renewed.
    """
    owner = owner_of(token_)
    if owner is None or not _here(owner):
        return False
    if gone(owner.pid):
        return True
    started = start_time(owner.pid)
    return started is not None and started != owner.start


#: This process's delivery tokens that may hold a lock or a slot: see :func:`claim`.
_claimed: set[str] = set()


def claim() -> str:
    """A new token (:func:`token`) for a delivery of this process, alive to :func:`ended` until :func:`retire`.

    Claimed before any store sees it, so a sibling thread or greenlet that
    finds it holding a lock or a slot a moment later never takes it for ended.
    """
    new = token()
    _claimed.add(new)
    return new


def retire(token_: str) -> None:
    """The delivery of ``token_`` let go of its lock and slot (or gave up on them): it has ended."""
    _claimed.discard(token_)


def ended(token_: str) -> bool:
    """Whether the delivery that took ``token_`` runs no more.

    A token of this very process (same pid, start time and machine) has ended
    once it is no longer claimed (:func:`claim`, :func:`retire`); any other
    is judged by :func:`owner_gone`.
    """
    owner = owner_of(token_)
    if owner is not None and _here(owner) and f"{owner.pid}:{owner.start}" == _own()[0]:
        return token_ not in _claimed
    return owner_gone(token_)


def gone(pid: int) -> bool:
    """Whether process ``pid`` of this process table has provably exited: no such pid, or a zombie (it runs nothing).

    ``kill(pid, 0)`` finding none proves it; a process it finds (or may not
    signal: another user's) is alive unless its entry says zombie, and one
    whose entry cannot be read (``/proc`` mounted ``hidepid``) stays alive.
    """
    if pid <= 0:  # 0 and negative pids name process groups
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    fields = _stat(pid)
    return fields is not None and bool(fields) and fields[0] in ("Z", "X")


@dataclass
class _Watch:
    pid: int
    until: float
    then: Callable[[], None]


class ExitWatcher:
    """Calls a function once a process of this host has exited; one daemon thread, started on first use.

    A watch is given up at its deadline (the process then still runs: its lock
    lives only while it renews it, so nothing is left to free).
    """

    POLL = 0.05

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._watches: list[_Watch] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def when_gone(self, pid: int, then: Callable[[], None], *, within: float) -> None:
        """Call ``then()`` once ``pid`` has exited, if that happens within ``within`` seconds."""
        with self._cond:
            self._watches.append(_Watch(pid, self.clock() + within, then))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="celery-dedup-exits", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._watches:
                    self._cond.wait()
                now = self.clock()
                exited: list[_Watch] = []
                waiting: list[_Watch] = []
                for watch in self._watches:
                    (exited if gone(watch.pid) else waiting).append(watch)
                self._watches = [watch for watch in waiting if watch.until > now]
            for watch in exited:
                try:
                    watch.then()
                except Exception:  # one failed follow-up must not stop the others
                    logger.exception("celery-dedup: acting on the exit of process %d failed", watch.pid)
            time.sleep(self.POLL)


_watcher: ExitWatcher | None = None
_watcher_lock = threading.Lock()


def exit_watcher() -> ExitWatcher:
    """This process's exit watcher."""
    global _watcher  # noqa: PLW0603 - one watcher thread per process
    with _watcher_lock:
        if _watcher is None:
            _watcher = ExitWatcher()
        return _watcher


def _forget_after_fork() -> None:
    global _watcher, _watcher_lock  # noqa: PLW0603
    _claimed.clear()  # the parent's deliveries: their tokens name the parent
    _watcher = None  # the parent's thread does not exist in the child
    _watcher_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
