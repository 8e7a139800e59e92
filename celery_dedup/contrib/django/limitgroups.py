"""What the admin's Limit groups page shows and does: named groups and the keys in use, and the operator's changes.

The page reads :func:`celery_dedup.limits.describe` (named groups: declared
values, overrides, pauses) and :func:`celery_dedup.limits.groups` (every group
key used in the last day: slots, waiting runs, starts per window); its POST
actions call ``override``, ``clear_override``, ``pause`` and ``resume``.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass

import redis
from celery import Celery
from django.utils import timezone

from celery_dedup import limits
from celery_dedup.limits import ALL_KEYS, GroupInfo, GroupState, Override


def override_text(override: Override | None) -> str:
    """``concurrency 1, rate 10/s``; empty for none."""
    return "" if override is None else str(override)


def paused_text(until: int | None, now_ms: int) -> str:
    """``until resumed``, ``until <local time>``; empty when not paused (or the pause has passed)."""
    if until is None or (until != -1 and until <= now_ms):
        return ""
    if until == -1:
        return "until resumed"
    moment = timezone.localtime(datetime.datetime.fromtimestamp(until / 1000, tz=datetime.timezone.utc))
    return f"until {moment:%Y-%m-%d %H:%M:%S %Z}"


@dataclass(frozen=True)
class ConfRow:
    """A named group's values as they stand: the group's own (``key`` None) or one key's."""

    group: str
    key: str | None
    #: The declared values (the group's row only).
    declared: str
    override: str
    paused: str

    @property
    def scope(self) -> str:
        return ALL_KEYS if self.key is None else self.key


@dataclass(frozen=True)
class KeyRow:
    """A group key used in the last day, as an operator sees it."""

    #: The named group, or "" for a task's own group.
    name: str
    task: str
    key: str
    slots: str
    waiting: int
    windows: str
    paused: str
    override: str
    avg_ms: int


def conf_rows(named: Sequence[GroupInfo], now_ms: int) -> list[ConfRow]:
    """A row per named group, then one per key of it with an override or a pause."""
    rows = []
    for info in named:
        declared = override_text(Override(info.concurrency, tuple(info.rates) or None))
        rows.append(
            ConfRow(info.name, None, declared, override_text(info.override), paused_text(info.paused_until, now_ms))
        )
        for key, conf in sorted(info.keys.items()):
            row = ConfRow(info.name, key, "", override_text(conf.override), paused_text(conf.paused_until, now_ms))
            if row.override or row.paused:
                rows.append(row)
    return rows


def key_rows(used: Sequence[GroupState], named: Sequence[GroupInfo], now_ms: int) -> list[KeyRow]:
    """A row per group key in use: slots in use / N, waiting, starts per window / R, pause, override."""
    confs = {info.name: info.keys for info in named}
    rows = []
    for state in used:
        conf = confs.get(state.name or "", {}).get(state.key) if state.name else None
        paused = paused_text(state.paused_until, now_ms)
        windows = zip(state.starts_per_window, state.rates, strict=False)
        rows.append(
            KeyRow(
                name=state.name or "",
                task=state.task,
                key=state.key,
                slots="-" if state.concurrency is None else f"{state.in_use} / {state.concurrency}",
                waiting=state.waiting,
                windows=", ".join(f"{starts} / {rate}" for starts, rate in windows) or "-",
                paused=paused,
                override=override_text(conf.override) if conf is not None else "",
                avg_ms=state.avg_ms,
            )
        )
    return rows


def server_ms(client: redis.Redis) -> int:
    """The store's clock (ms), which pauses are on."""
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def scope_text(group: str, key: str | None) -> str:
    return f"limit group {group}" + ("" if key is None else f" key {key}")


def apply(
    app: Celery,
    action: str,
    group: str,
    key: str | None,
    *,
    concurrency: int | None = None,
    rates: Sequence[str] = (),
    until: datetime.datetime | datetime.timedelta | None = None,
    by: str,
) -> tuple[bool, str]:
    """Do ``action`` (``set``, ``clear``, ``pause``, ``resume``): (whether it changed anything, what it did).

    Raises:
        DedupArgumentError: a value the group cannot take, an unknown group.
    """
    scope = scope_text(group, key)
    if action == "set":
        limits.override(app, group, key, concurrency=concurrency, rate=list(rates) or None, by=by)
        values = ", ".join(
            [
                *([] if concurrency is None else [f"concurrency {concurrency}"]),
                *([f"rate {', '.join(rates)}"] if rates else []),
            ]
        )
        return True, f"Set the override of {scope}: {values}."
    if action == "clear":
        if limits.clear_override(app, group, key, by=by):
            return True, f"Cleared the override of {scope}."
        return False, f"Nothing to clear: {scope} has no override."
    if action == "pause":
        limits.pause(app, group, key, until=until, by=by)
        if until is None:
            return True, f"Paused {scope} until resumed."
        end = until if isinstance(until, datetime.datetime) else timezone.now() + until
        return True, f"Paused {scope} until {timezone.localtime(end):%Y-%m-%d %H:%M:%S %Z}."
    if limits.resume(app, group, key, by=by):
        return True, f"Resumed {scope}."
    return False, f"Nothing to resume: {scope} is not paused."
