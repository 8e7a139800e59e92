"""What the record page shows: every field (times made readable) and the key's history."""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from celery_dedup.status import from_ms

#: Fields holding a millisecond timestamp.
TIME_FIELDS = frozenset(
    {
        "queued_at",
        "started_at",
        "finished_at",
        "updated_at",
        "held_until",
        "lock_lost_at",
        "pushed_at",
        "due_at",
        "first_at",
    }
)
#: Fields shown first, in this order; the rest follow by name.
FIRST = (
    "state",
    "task",
    "task_id",
    "held_until",
    "queued_at",
    "started_at",
    "finished_at",
    "updated_at",
    "worker",
    "pid",
    "attempts",
    "retries",
    "duplicates",
    "skipped",
    "lock",
    "lock_lost_at",
    "error",
    "args",
    "kwargs",
)


@dataclass(frozen=True)
class Field:
    name: str
    value: str
    #: The value as a time, for timestamp fields that are set.
    time: datetime.datetime | None = None


@dataclass(frozen=True)
class HistoryEntry:
    time: datetime.datetime | None
    state: str
    task_id: str
    note: str


def fields_of(record: Mapping[str, str]) -> list[Field]:
    """Every field of ``record``, the usual ones first."""
    names = [name for name in FIRST if name in record]
    names += sorted(name for name in record if name not in FIRST)
    return [Field(name, record[name], from_ms(record[name]) if name in TIME_FIELDS else None) for name in names]


def history_of(entries: Sequence[str]) -> list[HistoryEntry]:
    """Parse ``"<ms> <state> <task id> [note]"`` entries, newest first as stored."""
    parsed = []
    for entry in entries:
        ms, state, task_id, note = [*entry.split(" ", 3), "", "", ""][:4]
        parsed.append(HistoryEntry(from_ms(ms), state, task_id, note))
    return parsed
