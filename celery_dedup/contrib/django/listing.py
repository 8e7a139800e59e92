"""What the record list shows: its filters from the query string, one page, and links to the next.

Paging follows the store's cursor, never an offset count: "next" carries the
page's cursor, and a short trail of earlier cursors makes "previous" work.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

from celery_dedup.store.status import Status
from celery_dedup.store.store import Page

PAGE_SIZE = 100
#: Earlier cursors kept for "previous"; older pages are reached from the first.
TRAIL_LENGTH = 50
STATE, TASK, SEARCH, CURSOR, TRAIL = "state", "task", "q", "cursor", "trail"


_CURSOR = re.compile(r"[0-9]+(?:\.[0-9]+)*|[0-9]+~[A-Za-z0-9_-]+")


def _is_number(text: str) -> bool:
    """A page's cursor: a key search's ASCII digits (``"²".isdigit()`` and ``"٣".isdigit()`` are true
    too), one group per shard joined by dots on a Redis Cluster store; a listing's ``<ms>~<base64url>``.
    The store refuses one of the right shape that no page gave."""
    return text == "" or _CURSOR.fullmatch(text) is not None


@dataclass(frozen=True)
class Query:
    """The list's filters and position, as read from (and written back to) the query string."""

    state: str = ""
    task: str = ""
    search: str = ""
    cursor: str = ""
    trail: tuple[str, ...] = ()

    @classmethod
    def parse(cls, params: Mapping[str, str]) -> Query:
        """Read the filters; a cursor or trail that is not a page's cursor means the first page.

        A number past the end of the index is an empty last page (the store's rule).
        """
        cursor = params.get(CURSOR, "")
        trail = tuple(params.get(TRAIL, "").split(",")) if params.get(TRAIL) else ()
        if not _is_number(cursor) or not all(_is_number(c) for c in trail):
            cursor, trail = "", ()
        return cls(
            state=params.get(STATE, "").strip(),
            task=params.get(TASK, "").strip(),
            search=params.get(SEARCH, "").strip(),
            cursor=cursor,
            trail=trail[-TRAIL_LENGTH:],
        )

    @property
    def filtered(self) -> bool:
        return bool(self.state or self.task or self.search)

    def url(self, **changes: Any) -> str:
        """The query string of this list with ``changes``; filters reset the position."""
        values = {STATE: self.state, TASK: self.task, SEARCH: self.search, CURSOR: self.cursor}
        values[TRAIL] = ",".join(self.trail)
        if set(changes) & {STATE, TASK, SEARCH}:
            values[CURSOR] = values[TRAIL] = ""
        values.update(changes)
        return "?" + urlencode({k: v for k, v in values.items() if v})

    def next_url(self, cursor: str) -> str:
        trail = (*self.trail, self.cursor or "0")[-TRAIL_LENGTH:]
        return self.url(**{CURSOR: cursor, TRAIL: ",".join(trail)})

    def previous_url(self) -> str | None:
        if not self.cursor:
            return None
        if not self.trail:
            return self.url(**{CURSOR: "", TRAIL: ""})
        earlier = self.trail[-1]
        return self.url(**{CURSOR: "" if earlier == "0" else earlier, TRAIL: ",".join(self.trail[:-1])})

    def first_url(self) -> str | None:
        return self.url(**{CURSOR: "", TRAIL: ""}) if self.cursor else None


@dataclass(frozen=True)
class Row:
    """One record as a line of the list: its status and its page's URL."""

    status: Status
    url: str

    @property
    def member(self) -> str:
        return self.status.member

    @property
    def counters(self) -> str:
        """The counters that are not zero, in words: ``"2 attempts · 1 retry · 3 duplicates"``."""
        status = self.status
        counts = [
            (status.attempts, "attempt", "attempts"),
            (status.retries, "retry", "retries"),
            (status.duplicates, "duplicate", "duplicates"),
            (status.skipped, "skipped delivery", "skipped deliveries"),
            (status.debounced, "call joined", "calls joined"),
        ]
        return " · ".join(f"{n} {one if n == 1 else many}" for n, one, many in counts if n) or "-"


@dataclass(frozen=True)
class Choice:
    """One link of a filter in the sidebar."""

    label: str
    url: str
    selected: bool
    count: int | None = None


@dataclass
class Listing:
    """Everything the list template needs besides the admin's own context."""

    query: Query
    page: Page
    rows: list[Row] = field(default_factory=list)
    state_choices: list[Choice] = field(default_factory=list)
    task_choices: list[Choice] = field(default_factory=list)

    @classmethod
    def build(
        cls,
        query: Query,
        page: Page,
        *,
        states: Mapping[str, int],
        tasks: Mapping[str, int],
        link: Callable[[str], str],
    ) -> Listing:
        """The page's rows (``link(member)`` is a record's page) and the filters with their counts."""
        listing = cls(query, page, [Row(status, link(status.member)) for status in page.records])
        listing.state_choices = _choices(query, STATE, query.state, states)
        task_counts = dict(tasks)
        if query.task and query.task not in task_counts:
            task_counts[query.task] = -1  # a task not registered here, named in the URL: keep it selectable
        listing.task_choices = _choices(query, TASK, query.task, task_counts)
        return listing

    @property
    def next_url(self) -> str | None:
        return self.query.next_url(self.page.cursor) if self.page.cursor else None

    @property
    def previous_url(self) -> str | None:
        return self.query.previous_url()

    @property
    def first_url(self) -> str | None:
        return self.query.first_url()


def _choices(query: Query, name: str, selected: str, counts: Mapping[str, int]) -> list[Choice]:
    choices = [Choice("All", query.url(**{name: ""}), not selected)]
    for value, count in counts.items():
        choices.append(Choice(value, query.url(**{name: value}), value == selected, count if count >= 0 else None))
    return choices


def task_names(tasks: Mapping[str, Any], base: type) -> list[str]:
    """The names of the app's registered tasks that are ``base`` (DedupTask) subclasses, sorted."""
    return sorted(name for name, task in tasks.items() if isinstance(task, base))
