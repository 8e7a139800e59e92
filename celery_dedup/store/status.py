"""A key's status record as typed values: what records pages, the admin and the command line show.

Redis keeps a record as a hash of strings (the fields are listed in
:mod:`.schema` and the concepts docs); :class:`Status` reads them once into aware datetimes,
integers and the parsed history, and keeps the raw strings in ``fields``.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..keys import split_member, step_key, task_from_namespace
from .schema import (
    ENDED_STATES,
    FIELD_DOC,
    FIELD_DOCS,
    GROUPS,
    IN_DOUBT,
    LEGACY_STEPS_RUN,
    STATE_HELP,
    STATES,
    STEP_FIELD_PREFIX,
    STEP_STATE_HELP,
    FieldDoc,
)

# The states and the field docs live in the schema; they are read from here too.
__all__ = [
    "ENDED_STATES",
    "EPOCH",
    "FIELD_DOC",
    "FIELD_DOCS",
    "GROUPS",
    "STATES",
    "STATE_HELP",
    "FieldDoc",
    "HistoryEntry",
    "Status",
    "StepStatus",
    "from_ms",
    "history_of",
    "is_history_field",
    "step_order",
    "steps_of",
    "to_ms",
]

EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)


def from_ms(value: str | int | None) -> datetime.datetime | None:
    """A record's millisecond timestamp (server clock) as an aware UTC datetime; None for missing, 0 or garbage."""
    try:
        ms = int(value or 0)
    except ValueError:
        return None
    return EPOCH + datetime.timedelta(milliseconds=ms) if ms > 0 else None


def to_ms(moment: datetime.datetime) -> int:
    """The inverse of :func:`from_ms`: milliseconds since the epoch."""
    return (moment - EPOCH) // datetime.timedelta(milliseconds=1)


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value else None
    except ValueError:
        return None


def _iso(moment: datetime.datetime | None) -> str | None:
    return moment.isoformat() if moment is not None else None


@dataclass(frozen=True)
class HistoryEntry:
    """One transition of a key, as the scripts wrote it: ``"<ms> <state> <task id> [note]"``."""

    #: When it happened (server clock); None if the entry holds no time.
    at: datetime.datetime | None
    state: str
    task_id: str
    #: Why, or who: ``"released by alice"``, ``"attempt 2"``, ``"lock expired"``; often "".
    note: str

    @classmethod
    def parse(cls, entry: str) -> HistoryEntry:
        """Read one stored entry; one that does not start with a time gets ``at`` None."""
        first, _, rest = entry.partition(" ")
        if first.isascii() and first.isdigit():
            moment = from_ms(first)
        else:
            moment, rest = None, entry
        state, task_id, note = [*rest.split(" ", 2), "", ""][:3]
        return cls(moment, state, task_id, note)

    @classmethod
    def parse_field(cls, value: str, queued_ms: int, run: str) -> HistoryEntry:
        """Read one ``h<n>`` field of a format 2 record: ``"<offset> <state> [<run> [note]]"``.

        ``<offset>`` is ms from the record's ``queued_at`` (``queued_ms``); a
        run of ``-`` (or none) is the record's own run, ``run``.
        """
        first, _, rest = value.partition(" ")
        try:
            offset = int(first) if first.isascii() else None
        except ValueError:
            offset = None
        if offset is None:
            moment, rest = None, value
        else:
            moment = from_ms(queued_ms + offset)
        state, task_id, note = [*rest.split(" ", 2), "", ""][:3]
        return cls(moment, state, run if task_id in ("", "-") else task_id, note)

    def text(self) -> str:
        """The entry as format 1 stores it: ``"<ms> <state> <task id> [note]"``."""
        head = f"{to_ms(self.at)} " if self.at is not None else ""
        return f"{head}{self.state} {self.task_id} {self.note}".rstrip(" ")

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: ``at`` in ISO 8601, ``at_ms`` as stored."""
        at_ms = to_ms(self.at) if self.at is not None else None
        return {"at": _iso(self.at), "at_ms": at_ms, "state": self.state, "task_id": self.task_id, "note": self.note}


#: A format 2 record's history fields: ``h<n>`` (one entry each) and ``hn`` (the next n).
_HISTORY_FIELD = re.compile(r"h(?:n|0|[1-9][0-9]*)")
_TIMES = ("queued_at", "started_at", "finished_at", "lock_lost_at", "first_at", "due_at", "pushed_at")


def is_history_field(name: str) -> bool:
    """Whether ``name`` is one of a format 2 record's history fields (``h<n>``, ``hn``), not a field of its own."""
    return _HISTORY_FIELD.fullmatch(name) is not None


def history_of(fields: Mapping[str, str], listed: Sequence[str] = ()) -> tuple[HistoryEntry, ...]:
    """A record's history, newest first, from both formats.

    Format 2 keeps it in the record (``h<n>`` fields, the highest n newest);
    format 1 in the ``hist:`` list (``listed``, newest first). During a
    rolling deploy one record can have both: they are merged by time, an
    entry without a time after those with one.
    """
    queued_ms = _int(fields.get("queued_at")) or 0
    run = fields.get("task_id", "")
    numbered = sorted(
        ((int(name[1:]), value) for name, value in fields.items() if name != "hn" and is_history_field(name)),
        reverse=True,
    )
    entries = [HistoryEntry.parse_field(value, queued_ms, run) for _, value in numbered]
    entries += [HistoryEntry.parse(entry) for entry in listed]
    if numbered and listed:
        entries.sort(key=lambda entry: -to_ms(entry.at) if entry.at is not None else 0)  # stable: ties keep order
    return tuple(entries)


def _updated(fields: Mapping[str, str], history: Sequence[HistoryEntry]) -> datetime.datetime | None:
    """The record's last update: its ``updated_at`` (format 1), else its newest entry's time, else its latest time."""
    if fields.get("updated_at"):
        return from_ms(fields["updated_at"])
    for entry in history:
        if entry.at is not None:
            return entry.at
    times = [moment for moment in (from_ms(fields.get(name)) for name in _TIMES) if moment is not None]
    return max(times, default=None)


@dataclass(frozen=True)
class Status:
    """One key's status record: which run owns the key, how far it got, and what happened to it.

    Times are aware UTC datetimes from the Redis server's clock (None when
    unset; ``held_until`` is None when the key is not held); counters are
    ints (0 when unset). A *tombstone*, what a purge leaves of an ended
    record (``purged``), keeps only ``task_id`` and ``state``; everything
    else is empty. ``fields`` keeps the record's raw strings, every field
    included (also those without an attribute here, such as the nonces).

    Example::

        status = charge.dedup_status(42)
        if status and status.state == "failed":
            print(status.task_id, status.error, status.finished_at)
    """

    #: ``"<escaped task name>:<business key>"``, the record's name in Redis.
    member: str
    #: The task name (from the record, or from the member for a tombstone).
    task: str
    #: The business key.
    key: str
    #: One of ``STATES``; "" only for a record no script finished writing.
    state: str
    #: The run that owns the key (the Celery task id of its current publish).
    task_id: str
    queued_at: datetime.datetime | None
    started_at: datetime.datetime | None
    finished_at: datetime.datetime | None
    updated_at: datetime.datetime | None
    #: When the hold on the key ends; None when it is not held (or is a throttle window already over).
    held_until: datetime.datetime | None
    #: When the run lost its execution lock, if it did.
    lock_lost_at: datetime.datetime | None
    #: Debounce: when the first call of the burst came, and when its run is due.
    first_at: datetime.datetime | None
    due_at: datetime.datetime | None
    #: When the message was pushed onto ``queue``.
    pushed_at: datetime.datetime | None
    #: The worker host name and process id of the last delivery that started the body.
    worker: str
    pid: int | None
    #: The execution lock's owner token the record names ("" when no delivery holds it).
    lock: str
    #: Starts of the body, Celery retries, duplicate calls answered, deliveries refused, debounced calls joined.
    attempts: int
    retries: int
    duplicates: int
    skipped: int
    debounced: int
    #: ``"Type: message"`` of the last failure, truncated.
    error: str
    #: Argument reprs (only with ``dedup_record_args``).
    args: str
    kwargs: str
    #: The broker queue the message went to.
    queue: str
    #: True for a purge's tombstone.
    purged: bool
    #: Newest first; None when not read (pages of :func:`celery_dedup.records` do not read format 1 histories).
    history: tuple[HistoryEntry, ...] | None
    #: The record as stored: field name to string.
    fields: dict[str, str]
    #: Limits: why the run waits for its group now ("" when it does not), and how long its last wait took (ms).
    limit_wait: str = ""
    waited_ms: int = 0
    #: Duplicate calls whose arguments differed from the run's (``dedup_on_mismatch``), and the run's arguments
    #: fingerprint ("" when it has none).
    mismatched: int = 0
    args_fp: str = ""

    @classmethod
    def from_record(cls, member: str, fields: Mapping[str, str], history: Sequence[str] | None = None) -> Status:
        """The status of ``member`` from its record's raw fields and (if read) its ``hist:`` list's entries.

        Reads both formats: format 2's history fields are read whether or not
        ``history`` is given; ``history`` stays None only when neither holds any.
        """
        namespace, key = split_member(member)
        raw = dict(fields)
        get = raw.get
        entries = history_of(raw, history or ())
        return cls(
            member=member,
            task=get("task") or task_from_namespace(namespace),
            key=key,
            state=get("state", ""),
            task_id=get("task_id", ""),
            queued_at=from_ms(get("queued_at")),
            started_at=from_ms(get("started_at")),
            finished_at=from_ms(get("finished_at")),
            updated_at=_updated(raw, entries),
            held_until=from_ms(get("held_until")),
            lock_lost_at=from_ms(get("lock_lost_at")),
            first_at=from_ms(get("first_at")),
            due_at=from_ms(get("due_at")),
            pushed_at=from_ms(get("pushed_at")),
            worker=get("worker", ""),
            pid=_int(get("pid")),
            lock=get("lock", ""),
            attempts=_int(get("attempts")) or 0,
            retries=_int(get("retries")) or 0,
            duplicates=_int(get("duplicates")) or 0,
            skipped=_int(get("skipped")) or 0,
            debounced=_int(get("debounced")) or 0,
            error=get("error", ""),
            args=get("args", ""),
            kwargs=get("kwargs", ""),
            queue=get("queue", ""),
            purged=get("purged") == "1",
            history=None if history is None and not entries else entries,
            fields=raw,
            limit_wait=get("limit_wait", ""),
            waited_ms=_int(get("waited_ms")) or 0,
            mismatched=_int(get("mismatched")) or 0,
            args_fp=get("args_fp", ""),
        )

    @property
    def ended(self) -> bool:
        """Whether the run has ended (``ENDED_STATES``): no delivery of it runs any more."""
        return self.state in ENDED_STATES

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: times in ISO 8601, the history (or None), and the raw ``fields``."""
        document: dict[str, Any] = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, datetime.datetime):
                value = _iso(value)
            document[name] = value
        document["history"] = None if self.history is None else [entry.as_dict() for entry in self.history]
        document["fields"] = dict(self.fields)
        document["ended"] = self.ended
        return document


@dataclass(frozen=True)
class StepStatus:
    """One step the store keeps for a key (``dedup_once``), as of the server's clock when it was read."""

    name: str
    #: ``"run"`` (a step of ``run_id``) or ``"key"`` (a step of the key, across its runs).
    scope: str
    #: The run whose step it is ("" for a step of the key).
    run_id: str
    #: ``running``, ``in doubt`` (running, but its lock ran out), ``done``, ``failed`` or ``doubt``.
    state: str
    #: The idempotency key its function is called with.
    key: str
    attempts: int
    started_at: datetime.datetime | None
    finished_at: datetime.datetime | None
    #: While running: when its lock runs out unless renewed.
    until: datetime.datetime | None
    #: While running: the owner token of the delivery executing it.
    token: str
    error: str
    #: The size of its stored return value, bytes as stored (0 when none).
    result_size: int

    @property
    def help(self) -> str:
        """What its state means, for people."""
        return STEP_STATE_HELP.get(self.state, "")

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: times in ISO 8601."""
        document: dict[str, Any] = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            document[name] = _iso(value) if isinstance(value, datetime.datetime) else value
        return document


def step_order(step: StepStatus) -> tuple[bool, datetime.datetime, str]:
    """How steps are listed: the run's, then the key's, each in the order begun."""
    return step.scope != "run", step.started_at or EPOCH, step.name


def steps_of(member: str, fields: Mapping[str, str], now_ms: int, *, run: str | None = None) -> tuple[StepStatus, ...]:
    """The steps of a steps hash's ``fields`` (the run's, then the key's, each in the order begun).

    ``run``: the run whose ``run_steps`` hash ``fields`` is; None for the key's ``steps`` hash, where a
    ``run`` field (written before runs had hashes of their own) names the run of its ``s:<step>`` fields.
    ``now_ms``: the server's clock, by which a running step whose lock ran out is ``in doubt``.
    An entry that cannot be read is shown as its raw text in ``error``.
    """
    if run is None:
        run = fields.get(LEGACY_STEPS_RUN, "")
    found = []
    for field, value in fields.items():
        scope = next((s for s, prefix in STEP_FIELD_PREFIX.items() if field.startswith(prefix)), None)
        if scope is None:
            continue
        name = field[len(STEP_FIELD_PREFIX[scope]) :]
        try:
            entry = json.loads(value)
        except ValueError:
            entry = None
        if not isinstance(entry, dict):
            entry = {"state": "?", "error": value}
        state = str(entry.get("state", "?"))
        until = _int(str(entry.get("until") or ""))
        if state == "running" and until is not None and until <= now_ms:
            state = IN_DOUBT
        run_id = run if scope == "run" else ""
        found.append(
            StepStatus(
                name=name,
                scope=scope,
                run_id=run_id,
                state=state,
                key=step_key(member, run_id, name, scope=scope),
                attempts=_int(str(entry.get("attempts") or "")) or 0,
                started_at=from_ms(_int(str(entry.get("started_at") or ""))),
                finished_at=from_ms(_int(str(entry.get("finished_at") or ""))),
                until=from_ms(until) if state in ("running", IN_DOUBT) else None,
                token=str(entry.get("token") or ""),
                error=str(entry.get("error") or ""),
                result_size=len(str(entry.get("result") or "")),
            )
        )
    found.sort(key=step_order)
    return tuple(found)
