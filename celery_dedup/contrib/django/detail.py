"""What a record's page shows: its fields grouped for people, each with what it means, and its history."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

from celery_dedup.store.status import FIELD_DOC, GROUPS, Status, from_ms, is_history_field, to_ms


@dataclass(frozen=True)
class Row:
    """One field as shown: its label and help, and its value typed (a time, a count, or text)."""

    name: str
    label: str
    help: str
    value: str | int | None
    #: The value as a time, for timestamp fields (None when unset: not held, not yet, ...).
    time: datetime.datetime | None = None
    is_time: bool = False


@dataclass(frozen=True)
class Group:
    """A titled group of rows; ``folded`` ones (the internals) are shown closed."""

    name: str
    title: str
    rows: list[Row] = field(default_factory=list)

    @property
    def folded(self) -> bool:
        return self.name == "internals"


#: Shown above the groups, with the hold and the lock, so left out of them.
SUMMARY = ("state", "task")
#: Shown where the record holds no such field: the last update (derived, never stored in format 2) and the
#: counters every run has (format 2 does not write a counter while it is 0).
UNSTORED = ("updated_at", "attempts", "retries", "duplicates")


def groups_of(status: Status) -> list[Group]:
    """The fields ``status``'s record holds, in :data:`~celery_dedup.store.status.GROUPS`; unknown fields are internals.

    The page's summary shows state and task, so the groups leave them out; empty groups are left out.
    The fields of :data:`UNSTORED` are shown from ``status`` where the record holds none (not for a tombstone).
    """
    groups = {name: Group(name, title) for name, title in GROUPS}
    for name, raw in status.fields.items():
        if name in SUMMARY or is_history_field(name):  # the history has its own table
            continue
        doc = FIELD_DOC.get(name)
        if doc is None:
            groups["internals"].rows.append(Row(name, name, "Not a field this version of celery-dedup writes.", raw))
            continue
        value: str | int | None = getattr(status, name, raw)
        if isinstance(value, bool):
            value = "yes" if value else "no"
        elif isinstance(value, datetime.datetime) or value is None:
            value = raw
        row = Row(name, doc.label, doc.help, value, from_ms(raw) if doc.time else None, doc.time)
        groups[doc.group].rows.append(row)
    for name in () if status.purged else UNSTORED:
        derived = getattr(status, name)
        if name in status.fields or derived is None:
            continue
        doc = FIELD_DOC[name]
        if isinstance(derived, datetime.datetime):
            groups[doc.group].rows.append(Row(name, doc.label, doc.help, str(to_ms(derived)), derived, doc.time))
        else:
            groups[doc.group].rows.append(Row(name, doc.label, doc.help, derived))
    order = {doc.name: i for i, doc in enumerate(FIELD_DOC.values())}
    for group in groups.values():
        group.rows.sort(key=lambda row: order.get(row.name, len(order)))
    return [group for group in groups.values() if group.rows]
