"""Whether the process behind a lock token is gone, and acting once it is.

A lock token names the host and process that took it (``lock.new_token``).
A worker's main process reports endings its pool children never returned
from (a lost child, a hard time limit, ``revoke(terminate=True)``); it may
free such a child's lock only once the child has stopped running, so it asks
here whether it has, and waits for it where it has not yet.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger("celery_dedup")


def token_pid(token: str) -> int | None:
    """The pid in a token taken on this host, None for another host's (or a malformed) token."""
    host, _, rest = token.partition(":")
    pid_text = rest.partition(":")[0]
    if host != socket.gethostname() or not pid_text.isdigit():
        return None
    return int(pid_text)


def gone(pid: int) -> bool:
    """Whether process ``pid`` of this host has exited (a zombie has: it runs nothing)."""
    if not os.path.isdir("/proc"):  # no process table to read: only "exists" can be asked
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            fields = stat.read().rpartition(")")[2].split()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return fields[0] in ("Z", "X")


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
    _watcher = None  # the parent's thread does not exist in the child
    _watcher_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
