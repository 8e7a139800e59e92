"""A key's status record as typed values: what records pages, the admin and the command line show.

Redis keeps a record as a hash of strings (the fields are listed in the
concepts docs); :class:`Status` reads them once into aware datetimes,
integers and the parsed history, and keeps the raw strings in ``fields``.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..keys import split_member, task_from_namespace

#: Every state a record can be in, and those in which its run has ended (as in ``lib.lua``).
STATES = (
    "pending",
    "publishing",
    "queued",
    "started",
    "retry",
    "succeeded",
    "failed",
    "revoked",
    "rejected",
    "ignored",
    "lost",
    "skipped",
    "released",
    "replaced",
)
ENDED_STATES = ("succeeded", "failed", "revoked", "rejected", "ignored", "skipped", "released", "replaced")

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

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: ``at`` in ISO 8601, ``at_ms`` as stored."""
        at_ms = to_ms(self.at) if self.at is not None else None
        return {"at": _iso(self.at), "at_ms": at_ms, "state": self.state, "task_id": self.task_id, "note": self.note}


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
    #: Newest first; None when not read (pages of :func:`celery_dedup.records` do not read histories).
    history: tuple[HistoryEntry, ...] | None
    #: The record as stored: field name to string.
    fields: dict[str, str]
    #: Limits: why the run waits for its group now ("" when it does not), and how long its last wait took (ms).
    limit_wait: str = ""
    waited_ms: int = 0

    @classmethod
    def from_record(cls, member: str, fields: Mapping[str, str], history: Sequence[str] | None = None) -> Status:
        """The status of ``member`` from its record's raw fields and (if read) its raw history entries."""
        namespace, key = split_member(member)
        raw = dict(fields)
        get = raw.get
        return cls(
            member=member,
            task=get("task") or task_from_namespace(namespace),
            key=key,
            state=get("state", ""),
            task_id=get("task_id", ""),
            queued_at=from_ms(get("queued_at")),
            started_at=from_ms(get("started_at")),
            finished_at=from_ms(get("finished_at")),
            updated_at=from_ms(get("updated_at")),
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
            history=None if history is None else tuple(HistoryEntry.parse(entry) for entry in history),
            fields=raw,
            limit_wait=get("limit_wait", ""),
            waited_ms=_int(get("waited_ms")) or 0,
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
class FieldDoc:
    """What one record field means, for people: the admin's help texts and the command line's groups."""

    name: str
    #: One of :data:`GROUPS`' names.
    group: str
    label: str
    help: str
    #: Whether the value is a millisecond timestamp.
    time: bool = False


#: How a record's fields are grouped for people, in order: ``(name, title)``. Internals are folded away.
GROUPS = (
    ("run", "Run"),
    ("timing", "Timing"),
    ("worker", "Worker and lock"),
    ("counters", "Counters"),
    ("internals", "Internals"),
)

#: Every field a record may hold, in the order shown (docs/concepts.md lists the main ones).
FIELD_DOCS = (
    FieldDoc(
        "state",
        "run",
        "State",
        "Where the run is. It has ended once succeeded, failed, revoked, rejected, "
        "ignored, skipped, released or replaced; lost means its worker died or its message vanished.",
    ),
    FieldDoc("task", "run", "Task", "The task's registered name."),
    FieldDoc(
        "task_id",
        "run",
        "Task id",
        "The run that owns the key: the Celery task id it was published with. A new run of the same key gets a new id.",
    ),
    FieldDoc("error", "run", "Error", "Type and message of the run's last failure, truncated."),
    FieldDoc("args", "run", "Arguments", "The call's positional arguments, as repr (kept with dedup_record_args)."),
    FieldDoc(
        "kwargs", "run", "Keyword arguments", "The call's keyword arguments, as repr (kept with dedup_record_args)."
    ),
    FieldDoc(
        "purged",
        "run",
        "Purged",
        "A purge cut this record down to a tombstone: only the run id, how it "
        "ended and its publish nonces remain, so a late copy of the run is still skipped.",
    ),
    FieldDoc("queued_at", "timing", "Queued", "When the gate accepted the run.", time=True),
    FieldDoc("started_at", "timing", "Started", "When a worker last started the task's body.", time=True),
    FieldDoc("finished_at", "timing", "Finished", "When the run ended.", time=True),
    FieldDoc("updated_at", "timing", "Last update", "When the record last changed state.", time=True),
    FieldDoc(
        "held_until",
        "timing",
        "Held until",
        "When the hold on the key runs out unless renewed; while the "
        "body runs, the execution lock's renewals extend it. Empty: the key is not held, so the next call "
        "starts a new run.",
        time=True,
    ),
    FieldDoc(
        "lock_lost_at",
        "timing",
        "Lock lost",
        "When the run lost its execution lock (not renewed in time, "
        "or deleted by a forced release): another delivery may have run the key since.",
        time=True,
    ),
    FieldDoc("first_at", "timing", "Burst began", "Debounce: when the burst's first call came.", time=True),
    FieldDoc(
        "due_at",
        "timing",
        "Due",
        "Debounce: when the run's message is pushed, unless more calls come first.",
        time=True,
    ),
    FieldDoc("pushed_at", "timing", "Pushed", "When the message was pushed onto its queue.", time=True),
    FieldDoc("worker", "worker", "Worker", "The host name of the worker that last started the body."),
    FieldDoc("pid", "worker", "Process id", "The process on that host that ran it."),
    FieldDoc(
        "main",
        "worker",
        "Worker process",
        "The token of the worker's main process that delivered the run: crash "
        "recovery puts the run's message back only once this very process is provably dead.",
    ),
    FieldDoc(
        "lock",
        "worker",
        "Lock owner",
        "The owner token (host:pid:start:machine:random) of the execution lock this run "
        "took; the lock itself, if alive, is shown with its time left.",
    ),
    FieldDoc(
        "attempts",
        "counters",
        "Attempts",
        "How often the body started: a retry or a redelivery after a crash starts it again.",
    ),
    FieldDoc("retries", "counters", "Retries", "Celery retries (Task.retry) of this run so far."),
    FieldDoc(
        "duplicates",
        "counters",
        "Duplicates suppressed",
        "Calls answered with this run's id instead of publishing again.",
    ),
    FieldDoc(
        "skipped",
        "counters",
        "Deliveries skipped",
        "Deliveries refused without running: copies of this run "
        "(a redelivery, a re-push) after it ended, or deliveries while another run held the lock.",
    ),
    FieldDoc("debounced", "counters", "Calls joined", "Debounce: later calls that joined this run's burst."),
    FieldDoc(
        "limit_wait",
        "timing",
        "Waiting for",
        "Limits: why the run waits (its group's slots in use or rate used); gone once it gets through.",
    ),
    FieldDoc(
        "waiting_since",
        "timing",
        "Waiting since",
        "Limits: when the run was first refused by its group's limits.",
        time=True,
    ),
    FieldDoc("waited_ms", "counters", "Waited (ms)", "Limits: how long the run waited for its group, in ms."),
    FieldDoc("limit_waits", "counters", "Times refused", "Limits: how often its group's limits sent the run back."),
    FieldDoc("queue", "internals", "Queue", "The broker queue the message went to; the reaper looks for it there."),
    FieldDoc(
        "tag",
        "internals",
        "Delivery tag",
        "The message's delivery tag, by which the reaper and crash recovery find it among the transport's "
        "unacknowledged messages.",
    ),
    FieldDoc(
        "unacked",
        "internals",
        "Unacked hash",
        "The transport's hash of unacknowledged messages the reaper and crash recovery look in.",
    ),
    FieldDoc(
        "nonce",
        "internals",
        "Nonce",
        "The last accepted publish's nonce: a publish retried after a lost "
        "reply is recognised by it and pushes nothing.",
    ),
    FieldDoc(
        "nonces", "internals", "Earlier nonces", "Earlier accepted publish nonces of the key, kept for the same reason."
    ),
    FieldDoc(
        "joined_nonce",
        "internals",
        "Joined nonce",
        "Debounce: the last call that joined the burst, so a retried publish of it joins once.",
    ),
    FieldDoc(
        "window_until",
        "internals",
        "Window until",
        "until_expired and throttle: the end of the key's "
        "window while the run executes; the key is held until then after the run ends.",
        time=True,
    ),
    FieldDoc(
        "replacing",
        "internals",
        "Replacing",
        "The run is replacing itself (Task.replace) with this: should it be declared lost before it "
        "ends replaced, its followers wait for the replacement's ending, until the record would expire.",
    ),
    FieldDoc(
        "missing_since",
        "internals",
        "Missing since",
        "When the reaper first found the queued message "
        "missing; missing again dedup_reap_grace later, the run is marked lost.",
        time=True,
    ),
    FieldDoc(
        "payload",
        "internals",
        "Payload",
        "The message body kept for a re-enqueue (a run that did not "
        "succeed, on a Redis broker with dedup_record_args on).",
    ),
    FieldDoc("message", "internals", "Parked message", "Debounce: the whole message, pushed when the run is due."),
)
FIELD_DOC = {doc.name: doc for doc in FIELD_DOCS}

#: What each state means, in one line, for people.
STATE_HELP = {
    "pending": "Debounce: waiting for its burst of calls to go quiet before its message is pushed.",
    "publishing": "Accepted, its message on the way to a broker apart from the store: the key is held for "
    "dedup_publish_lease until the broker has it (or the lease ends).",
    "queued": "Accepted: its message waits in the queue for a worker.",
    "started": "A worker is running the task's body.",
    "retry": "The body asked for a retry: the run starts again later and keeps the key.",
    "succeeded": "Ended: the body returned.",
    "failed": "Ended: the body raised, with no retry left.",
    "revoked": "Ended: revoked before or while it ran.",
    "rejected": "Ended: a worker rejected its message.",
    "ignored": "Ended: the body raised Ignore.",
    "lost": "Its worker died, or the transport lost its message: the key was freed, and a copy may still run it.",
    "skipped": "Ended without running: another run of its key held the execution lock.",
    "released": "Ended: an operator released its key.",
    "replaced": "Ended: the run replaced itself (Task.replace) with work under another key or task.",
}
