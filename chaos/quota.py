"""What a named limit group's key allowed at a moment: the declared values under the overrides and pauses in force.

The nemesis overrides and pauses the workload's named group (``override``
and ``pause`` faults) and bodies back off (``backoff`` events); each change
is recorded with the server-clock interval its write happened in
(``from_ms`` .. ``at_ms``), and its undoing likewise. A grant (its
``granted_at``, on the same clock) inside such an interval may have seen
either value: the checker judges it by every value it may have seen
(:func:`Timeline.configs`), and holds it to a pause only where the pause
was certainly in force (:func:`Timeline.pause_at`).

A wipe of the server's data takes every change written before it: from
then on a change may or may not be in force.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from .history import Event

#: Slack between the server's millisecond timestamps and the writes they bound, ms.
SLACK_MS = 2


def windows(text: str) -> tuple[tuple[int, int], ...]:
    """``"3/1000,5/60000"`` as ``((3, 1000), (5, 60000))`` (count, period ms); "" has none."""
    found = []
    for part in text.split(","):
        count, _, period = part.strip().partition("/")
        if count.isdigit() and period.isdigit():
            found.append((int(count), int(period)))
    return tuple(found)


@dataclass(frozen=True)
class Change:
    """An override or a pause of a named group (``key`` None: the whole group), or a body's back-off."""

    kind: str
    group: str
    key: str | None
    #: The write happened between these (ms, server clock).
    set_from: int
    set_by: int
    #: Its undoing (clear, resume) happened between these; None: never undone.
    undo_from: int | None = None
    undo_by: int | None = None
    #: An override's values (None: not overridden).
    concurrency: int | None = None
    rates: str | None = None
    #: A pause (or back-off) that ends by itself this long after it was written, ms; None: until resumed.
    lasts_ms: int | None = None
    #: A back-off: the run that backed off.
    task_id: str = ""

    def applies(self, group: str, key: str) -> bool:
        return self.group == group and self.key in (None, key)

    def state(self, at: int) -> bool | None:
        """Whether it was in force at ``at``: True, False, or None (it may or may not have been)."""
        if at < self.set_from - SLACK_MS:
            return False
        if self.undo_by is not None and at > self.undo_by + SLACK_MS:
            return False
        if self.lasts_ms is not None and at > self.set_by + self.lasts_ms + SLACK_MS:
            return False
        if at < self.set_by + SLACK_MS:
            return None
        if self.undo_from is not None and at > self.undo_from - SLACK_MS:
            return None
        if self.lasts_ms is not None and at > self.set_from + self.lasts_ms - SLACK_MS:
            return None
        return True

    @property
    def what(self) -> str:
        scope = "the whole group" if self.key is None else f"key {self.key}"
        if self.kind == "backoff":
            return f"run {self.task_id}'s back-off of {scope} for {self.lasts_ms} ms"
        if self.kind == "pause":
            how = "until resumed" if self.lasts_ms is None else f"for {self.lasts_ms} ms"
            return f"an operator's pause of {scope} {how}"
        return f"an override of {scope} (concurrency {self.concurrency}, rates {self.rates})"


@dataclass(frozen=True)
class Config:
    """The values a grant may have been admitted under."""

    concurrency: int | None
    rates: str


class Timeline:
    """Every change of the workload's named groups over a run, and the wipes of the server's data."""

    def __init__(self, changes: list[Change], wipes: Iterable[float]) -> None:
        self.changes = changes
        #: When wipes began, ms.
        self.wipes = sorted(int(t * 1000) for t in wipes)

    @classmethod
    def of(cls, events: list[Event], wipes: Iterable[float], failed_backoffs: set[str]) -> Timeline:
        """From the nemesis's ``fault`` / ``fault_end`` events and the bodies' ``backoff`` events."""
        changes: list[Change] = []
        open_changes: dict[tuple[str, str, str | None], int] = {}
        for event in events:
            kind = event.get("kind")
            if event["ev"] == "fault" and kind in ("override", "pause"):
                key = event.get("key")
                until = event.get("until")
                open_changes[(str(kind), str(event["group"]), key)] = len(changes)
                changes.append(
                    Change(
                        str(kind),
                        str(event["group"]),
                        key,
                        int(event["from_ms"]),
                        int(event["at_ms"]),
                        concurrency=event.get("concurrency"),
                        rates=event.get("rates"),
                        lasts_ms=None if until is None else round(float(until) * 1000),
                    )
                )
            elif event["ev"] == "fault_end" and kind in ("override", "pause"):
                index = open_changes.pop((str(kind), str(event["group"]), event.get("key")), None)
                if index is not None:
                    old = changes[index]
                    changes[index] = Change(
                        old.kind,
                        old.group,
                        old.key,
                        old.set_from,
                        old.set_by,
                        int(event["from_ms"]),
                        int(event["at_ms"]),
                        old.concurrency,
                        old.rates,
                        old.lasts_ms,
                    )
            elif event["ev"] == "backoff" and str(event.get("task_id")) not in failed_backoffs:
                changes.append(
                    Change(
                        "backoff",
                        str(event["quota"]),
                        str(event["quota_key"]),
                        int(float(event["asked"]) * 1000),
                        int(float(event["t"]) * 1000) + 1,
                        lasts_ms=round(float(event["retry_after"]) * 1000),
                        task_id=str(event["task_id"]),
                    )
                )
        return cls(changes, wipes)

    def wiped_between(self, start: int, end: int) -> bool:
        return any(start - SLACK_MS <= wipe <= end + SLACK_MS for wipe in self.wipes)

    def _state(self, change: Change, at: int) -> bool | None:
        state = change.state(at)
        if state is not False and self.wiped_between(change.set_from, at):
            return None  # the wipe took it
        if state is True and change.kind == "backoff" and self._rewritten(change, at):
            return None
        return state

    def _rewritten(self, backoff: Change, at: int) -> bool:
        """Whether an operator's pause or resume of the back-off's key rewrote its pause before ``at``."""
        for change in self.changes:
            if change.kind != "pause" or change.group != backoff.group or change.key != backoff.key:
                continue
            writes = [(change.set_from, change.set_by)]
            if change.undo_from is not None and change.undo_by is not None:
                writes.append((change.undo_from, change.undo_by))
            if any(begin <= at and end >= backoff.set_from for begin, end in writes):
                return True
        return False

    def configs(self, group: str, key: str, declared: Config, at: int) -> list[Config]:
        """Every set of values a grant of ``group``'s ``key`` at ``at`` may have been admitted under."""
        relevant = [
            (change, self._state(change, at))
            for change in self.changes
            if change.kind == "override" and change.applies(group, key)
        ]
        certain = [change for change, state in relevant if state is True]
        unsure = [change for change, state in relevant if state is None][:8]
        found: list[Config] = []
        for chosen in itertools.product((False, True), repeat=len(unsure)):
            active = certain + [change for change, pick in zip(unsure, chosen, strict=True) if pick]
            active.sort(key=lambda change: (change.key is not None, change.set_from))  # the key's own win
            concurrency, rates = declared.concurrency, declared.rates
            for change in active:
                concurrency = change.concurrency if change.concurrency is not None else concurrency
                rates = change.rates if change.rates is not None else rates
            config = Config(concurrency, rates)
            if config not in found:
                found.append(config)
        return found

    def pause_at(self, group: str, key: str, at: int) -> Change | None:
        """A pause (or back-off) of ``group``'s ``key`` certainly in force at ``at``, None if none."""
        for change in self.changes:
            if change.kind in ("pause", "backoff") and change.applies(group, key) and self._state(change, at):
                return change
        return None

    def pause_wiped(self, group: str, key: str, at: int) -> Change | None:
        """A pause of ``group``'s ``key`` that would have been in force at ``at`` but for a wipe since it was set."""
        for change in self.changes:
            if (
                change.kind in ("pause", "backoff")
                and change.applies(group, key)
                and change.state(at) is True
                and self.wiped_between(change.set_from, at)
            ):
                return change
        return None
