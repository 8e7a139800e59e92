"""The history of a chaos run: every process appends its own events, the checker merges them.

Each process writes JSON lines to ``<run dir>/<role>-<pid>.jsonl``, one
``write`` per event on a file opened with ``O_APPEND`` and no buffer, so an
event is on disk the moment :meth:`History.emit` returns and a SIGKILL loses
only what had not happened yet. A forked child (a prefork pool process)
starts a file of its own.

Time: every event carries ``t``, the host's ``time.time()``. All processes and
the server run on one host, so this is one clock, and the server's ``TIME``
(which stamps the status records' history entries) reads the same clock:
events and server-side entries share one axis. (The server's clock itself is
not used for events: it cannot be read while the nemesis restarts the
server, and each read would cross the fault proxy.)

Event kinds (field ``ev``) and who writes them:

- ``call_start`` / ``call``: a producer's call, before publishing and with its
  outcome (``accepted``, ``duplicate``, ``collapsed``, ``error``) and the id it
  was handed;
- ``body_start`` / ``lock_lost_seen`` / ``body_end``: a task body, with its task
  id, member, the ``call`` whose arguments it runs, pid and thread (``tid``:
  a threads or gevent pool runs several bodies in one process), and for a
  limited task its limit ``group`` and that group's ``limit``;
- ``step_enter`` / ``step_call`` / ``step_return`` / ``step_exit``: a step
  (``dedup_once``) of a body: asked for, its function called (with the
  idempotency key it got), returned (its value), and how ``dedup_once`` ended;
- ``decision`` / ``lock_lost_log`` / ``slot_lost_log`` / ``finish_failed`` /
  ``step_doubt_log``: the library's log lines on ``celery_dedup`` (decisions,
  the renewer's lost locks and limit slots, endings it could not record, a
  step found in doubt and called again);
- ``backoff`` / ``backoff_failed``: a named group's body backed off
  (``dedup_backoff``: when it was asked, for how long, its group key), and
  the library's log that it could not write the back-off's pause;
- ``recovered``: the library put a dead worker's run back in its queue;
- ``received`` / ``revoked`` / ``settled``: a worker's ``task_received``
  signal (its consumer took the message), ``task_revoked`` (a terminated
  body ends here) and ``task_postrun`` (in the body's process and thread,
  ``tid``: the guard has recorded how that delivery ended);
- ``fault`` / ``op`` / ``phase``: the nemesis's faults, operator actions, and the
  run's phases (written by the runner).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Event = dict[str, Any]

#: The server's log in a run's folder: the scripts report their transitions there (the checker reads them).
SERVER_LOG = "server.log"


class History:
    """This process's append-only event file in ``run_dir`` (one per pid, reopened after fork)."""

    def __init__(self, run_dir: Path | str, role: str) -> None:
        self.run_dir = Path(run_dir)
        self.role = role
        self._fd: int | None = None
        self._pid = 0
        self._lock = threading.Lock()

    def _file(self) -> int:
        pid = os.getpid()
        if self._fd is None or self._pid != pid:
            # A forked child shares the parent's descriptor: it gets a file of its own.
            path = self.run_dir / f"{self.role}-{pid}.jsonl"
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._pid = pid
        return self._fd

    def emit(self, ev: str, **fields: Any) -> Event:
        """Append one event now; returns it."""
        event: Event = {"t": time.time(), "ev": ev, "pid": os.getpid(), "role": self.role, **fields}
        line = (json.dumps(event, default=str, separators=(",", ":")) + "\n").encode()
        with self._lock:
            os.write(self._file(), line)
        return event


class DecisionRecorder(logging.Handler):
    """Turns the library's log lines into events: decisions, and the renewer's lost locks."""

    def __init__(self, history: History) -> None:
        super().__init__(logging.INFO)
        self.history = history

    def emit(self, record: logging.LogRecord) -> None:
        decision = getattr(record, "dedup_decision", None)
        try:
            if decision is not None:
                self.history.emit(
                    "decision",
                    decision=decision,
                    task=getattr(record, "dedup_task", None),
                    key=getattr(record, "dedup_key", None),
                    task_id=getattr(record, "dedup_task_id", None),
                    message=record.getMessage(),
                )
            elif record.levelno >= logging.ERROR and "execution lock lost" in record.msg:
                self.history.emit("lock_lost_log", message=record.getMessage())
            elif record.levelno >= logging.ERROR and str(record.msg).startswith("limit slot lost"):
                group = record.args[0] if isinstance(record.args, tuple) and record.args else None
                self.history.emit("slot_lost_log", group=group, message=record.getMessage())
            elif str(record.msg).startswith("recovered:"):
                task_id = record.args[1] if isinstance(record.args, tuple) and len(record.args) > 1 else None
                self.history.emit("recovered", task_id=task_id, message=record.getMessage())
            elif "in doubt (attempt" in str(record.msg) and isinstance(record.args, tuple) and len(record.args) > 4:
                # "%s[%s] step %r in doubt (attempt %s): called again with idempotency key %r"
                _, task_id, step, _, key = record.args[:5]
                self.history.emit("step_doubt_log", task_id=task_id, step=step, key=key, message=record.getMessage())
            elif record.levelno >= logging.ERROR and "could not pause group" in str(record.msg):
                task_id = record.args[1] if isinstance(record.args, tuple) and len(record.args) > 1 else None
                self.history.emit("backoff_failed", task_id=task_id, message=record.getMessage())
            elif record.levelno >= logging.ERROR and str(record.msg).startswith("could not record"):
                task_id = record.args[2] if isinstance(record.args, tuple) and len(record.args) > 2 else None
                self.history.emit("finish_failed", task_id=task_id, message=record.getMessage())
        except OSError:
            self.handleError(record)


def record_decisions(history: History) -> None:
    """Send the ``celery_dedup`` logger's INFO and louder lines to ``history`` as well."""
    logger = logging.getLogger("celery_dedup")
    logger.setLevel(logging.INFO)
    if not any(isinstance(handler, DecisionRecorder) for handler in logger.handlers):
        logger.addHandler(DecisionRecorder(history))


def read_events(run_dir: Path | str) -> list[Event]:
    """Every process's events, merged in time order (a torn last line of a killed writer is skipped)."""
    events: list[Event] = []
    for path in sorted(Path(run_dir).glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    events.sort(key=lambda event: float(event["t"]))
    return events


@dataclass
class Tail:
    """Counts events of some kinds across a run directory as it grows (for the progress line)."""

    run_dir: Path
    kinds: frozenset[str]
    counts: dict[str, int] = field(default_factory=dict)
    _offsets: dict[Path, int] = field(default_factory=dict)

    def update(self) -> dict[str, int]:
        for path in self.run_dir.glob("*.jsonl"):
            offset = self._offsets.get(path, 0)
            with path.open("rb") as handle:
                handle.seek(offset)
                chunk = handle.read()
            complete = chunk.rfind(b"\n") + 1
            self._offsets[path] = offset + complete
            for line in chunk[:complete].splitlines():
                kind = _kind(line)
                if kind in self.kinds:
                    self.counts[kind] = self.counts.get(kind, 0) + 1
        return self.counts


def _kind(line: bytes) -> str:
    start = line.find(b'"ev":"')
    if start < 0:
        return ""
    start += 6
    return line[start : line.find(b'"', start)].decode()


def iter_kind(events: list[Event], *kinds: str) -> Iterator[Event]:
    """The events of the given kinds, in order."""
    wanted = set(kinds)
    return (event for event in events if event["ev"] in wanted)
