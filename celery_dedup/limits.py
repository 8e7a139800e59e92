"""Limit groups for user code (public API): the running delivery's grant, every group's state, and run-time control.

The limits themselves run in the worker (:mod:`celery_dedup.worker.limits`)
and their state lives in the store (:mod:`celery_dedup.store.limits`); this
module is what a task body, a script, a view, the CLI and the admin import.

A named group (setting ``dedup_limit_groups``) can be changed at run time,
stored in Redis and effective at the next admission of any worker:

- :func:`override` a group's concurrency and/or windows for one key (a
  customer tier) or for the whole group; :func:`clear_override` goes back to
  the declared values. A key's override wins over the group's, the group's
  over the declared values. A value not given keeps what it was.
- :func:`pause` a key or the whole group, until a time or until
  :func:`resume`: no new start while paused; waiting runs keep their place
  (as countdown messages: no worker slot is held) and look again every few
  seconds, so after a resume they start in arrival order.
- :func:`describe` every declared group with its overrides and pauses.

A key is the group key as the group's tasks render their ``limit_key``
(``"acme"`` for ``limit_key="{tenant}"`` and ``tenant="acme"``; as
:func:`groups` and ``celery dedup limits`` show it); ``key=None`` is the
whole group.
"""

from __future__ import annotations

import datetime
import logging
import math
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from .config import MAX_SECONDS
from .exceptions import DedupArgumentError
from .holding import Holding, hold
from .policy import (
    LimitGroup,
    LimitPolicy,
    Rate,
    check_concurrency,
    check_rates,
    parse_rate,
    rates_from_text,
    rates_text,
)
from .runtime import config_for, store_for
from .store import limits as store_limits
from .store.limits import Grant, GroupState, groups
from .worker.limits import current

__all__ = [
    "ALL_KEYS",
    "Grant",
    "GroupInfo",
    "GroupState",
    "Holding",
    "KeyConf",
    "LimitPolicy",
    "Override",
    "Rate",
    "acquire",
    "clear_override",
    "current",
    "describe",
    "groups",
    "override",
    "parse_rate",
    "pause",
    "resume",
]

logger = logging.getLogger("celery_dedup")

#: ``paused_until`` of a pause that lasts until resumed.
UNTIL_RESUMED = -1


#: How the admin and the CLI name a group-wide value or pause (never a key, which is text).
ALL_KEYS = "(all keys)"


@dataclass(frozen=True)
class Override:
    """Values set at run time over a group's declared ones (None: that value is not overridden)."""

    concurrency: int | None
    rates: tuple[Rate, ...] | None

    def __str__(self) -> str:
        """``concurrency 1, rate 10/s, 10000/d``: the values it sets, as the admin and the CLI show them."""
        parts = [] if self.concurrency is None else [f"concurrency {self.concurrency}"]
        if self.rates:
            parts.append("rate " + ", ".join(str(rate) for rate in self.rates))
        return ", ".join(parts)


@dataclass(frozen=True)
class KeyConf:
    """One key of a named group, as set at run time."""

    override: Override | None
    #: When its pause ends (ms, server clock; -1: until resumed); None: not paused.
    paused_until: int | None


@dataclass(frozen=True)
class GroupInfo:
    """A declared named group: its declared values, and what is set at run time for it and its keys."""

    name: str
    concurrency: int | None
    rates: tuple[Rate, ...]
    #: The group-wide override, None: none.
    override: Override | None
    #: The group-wide pause: when it ends (ms, server clock; -1: until resumed); None: not paused.
    paused_until: int | None
    #: Keys with an override or a pause in effect, by key.
    keys: dict[str, KeyConf]


def _declared(app: Any, group: Any) -> LimitGroup:
    declared = config_for(app).limit_groups
    found = declared.get(group) if isinstance(group, str) else None
    if found is None:
        known = ", ".join(repr(name) for name in sorted(declared)) or "none"
        raise DedupArgumentError("group", group, f"is no limit group of dedup_limit_groups (declared: {known})")
    return found


def _key(group: str, key: Any) -> str | None:
    if key is not None and (not isinstance(key, str) or not key):
        raise DedupArgumentError(
            "key", key, f"limit group {group!r}: must be a group key (a non-empty string), or None for the whole group"
        )
    return key


def _where(group: str, key: str | None) -> str:
    return f"limit group {group!r}" + ("" if key is None else f" key {key!r}")


def acquire(
    app: Any, group: str, key: str | None = None, *, timeout: float | None = None, lease: float | None = None
) -> AbstractContextManager[Holding]:
    """Hold a place in key ``key`` of named group ``group`` (None: the whole group) for a ``with`` block.

    A slot and a start in every window, taken in the line the group's tasks
    wait in, in arrival order, waiting at most ``timeout`` seconds (None: as
    long as it takes; 0: one try). The slot is given back when the block
    ends (by an exception too); it is a lease of ``lease`` seconds (default
    10) renewed while held, so a process killed inside the block frees it
    within one lease, or at once for a caller or worker of its host. See
    :mod:`celery_dedup.holding`.

    Raises:
        DedupLimitTimeout: no place within ``timeout``; the caller left the line, it holds nothing.
        DedupArgumentError: an unknown group, a bad key, ``timeout`` or ``lease``.

    Example:
        >>> with limits.acquire(app, "partner-api", key="acme", timeout=5) as holding:
        ...     partner.post(order)
    """
    return hold(app, _declared(app, group), _key(group, key), timeout=timeout, lease=lease)


def override(
    app: Any,
    group: str,
    key: str | None = None,
    *,
    concurrency: int | None = None,
    rate: str | list[str] | tuple[str, ...] | None = None,
    by: str = "",
) -> None:
    """Override named group ``group``'s concurrency and/or windows for ``key`` (None: the whole group).

    Effective at the next admission of every worker; a value not given keeps
    what it was (the declared one, or an earlier override). ``rate``: one rate
    (``"100/m"``) or a list of windows; units s, m, h, d. ``by``: who did it,
    for the log.

    Raises:
        DedupArgumentError: an unknown group, a bad key, neither value given, or a bad value
            (naming the group and the value).
    """
    _declared(app, group)
    key = _key(group, key)
    if concurrency is None and rate is None:
        raise DedupArgumentError("concurrency", None, f"{_where(group, key)}: give concurrency, rate or both")
    values: dict[str, str | int] = {}
    if concurrency is not None:
        try:
            values["concurrency"] = check_concurrency(concurrency)
        except ValueError as exc:
            raise DedupArgumentError("concurrency", concurrency, f"{_where(group, key)}: {exc}") from None
    if rate is not None:
        try:
            values["rates"] = rates_text(check_rates(rate))
        except ValueError as exc:
            raise DedupArgumentError("rate", rate, f"{_where(group, key)}: {exc}") from None
    store_limits.set_conf(store_for(app), group, key, values)
    logger.info("%s: override %s%s", _where(group, key), values, _by(by))


def clear_override(app: Any, group: str, key: str | None = None, *, by: str = "") -> bool:
    """Go back to ``group``'s declared values for ``key`` (None: the group-wide override); whether one was set.

    A key's override cleared, the group-wide override (if any) applies to it.
    """
    _declared(app, group)
    key = _key(group, key)
    cleared = store_limits.clear_conf(store_for(app), group, key, ("concurrency", "rates"))
    logger.info("%s: override cleared%s%s", _where(group, key), "" if cleared else " (none set)", _by(by))
    return cleared


def _by(by: str) -> str:
    return f" by {by}" if by else ""


def _until_ms(app: Any, group: str, key: str | None, until: Any) -> int:
    """``until`` as ms on the server clock (-1 for None): a datetime, a timedelta or seconds from now."""
    if until is None:
        return UNTIL_RESUMED
    store = store_for(app)
    if isinstance(until, datetime.datetime):
        aware = until if until.tzinfo is not None else until.replace(tzinfo=datetime.timezone.utc)
        at = int(aware.timestamp() * 1000)
        if at <= store_limits.server_ms(store):
            raise DedupArgumentError("until", until, f"{_where(group, key)}: is not in the future")
        return at
    if isinstance(until, datetime.timedelta):
        seconds = until.total_seconds()
    elif isinstance(until, (int, float)) and not isinstance(until, bool):
        seconds = float(until)
    else:
        raise DedupArgumentError(
            "until", until, f"{_where(group, key)}: must be a datetime, a timedelta, seconds from now, or None"
        )
    if not math.isfinite(seconds) or not 0.001 <= seconds <= MAX_SECONDS:
        raise DedupArgumentError("until", until, f"{_where(group, key)}: must be from 0.001 to {MAX_SECONDS:g} s away")
    return store_limits.server_ms(store) + math.ceil(seconds * 1000)


def pause(app: Any, group: str, key: str | None = None, *, until: Any = None, by: str = "") -> None:
    """Pause named group ``group`` (or its ``key``): no new start until ``until``, or until :func:`resume`.

    ``until``: a datetime (aware, or naive UTC), a timedelta or seconds from
    now (a float); None: until resumed. A pause replaces an earlier one of the
    same group or key. Runs already running go on; waiting runs keep their
    place, hold no worker slot, and look again at most every 5 seconds.

    Raises:
        DedupArgumentError: an unknown group, a bad key, or an ``until`` that is not ahead.
    """
    _declared(app, group)
    key = _key(group, key)
    at = _until_ms(app, group, key, until)
    store_limits.set_conf(store_for(app), group, key, {"paused_until": at})
    logger.info("%s: paused %s%s", _where(group, key), "until resumed" if at == -1 else f"until {at} ms", _by(by))


def resume(app: Any, group: str, key: str | None = None, *, by: str = "") -> bool:
    """End ``group``'s (or ``key``'s) pause; whether one was set. Waiting runs start in arrival order.

    Only that pause ends: a key stays paused while its group is, and the other way round.
    """
    _declared(app, group)
    key = _key(group, key)
    resumed = store_limits.clear_conf(store_for(app), group, key, ("paused_until",))
    logger.info("%s: resumed%s%s", _where(group, key), "" if resumed else " (was not paused)", _by(by))
    return resumed


def _override_of(fields: dict[str, str]) -> Override | None:
    concurrency, rates = fields.get("concurrency"), fields.get("rates")
    if concurrency is None and rates is None:
        return None
    return Override(
        int(concurrency) if concurrency and concurrency.isdigit() else None,
        None if rates is None else rates_from_text(rates),
    )


def _paused_of(fields: dict[str, str], now: int) -> int | None:
    text = fields.get("paused_until", "")
    try:
        until = int(text)
    except ValueError:
        return None
    return until if until == UNTIL_RESUMED or until > now else None


def describe(app: Any) -> list[GroupInfo]:
    """Every declared named group (in declaration order), with its overrides and the pauses in effect."""
    store = store_for(app)
    infos = []
    for name, declared in config_for(app).limit_groups.items():
        group, keys, now = store_limits.read_conf(store, name)
        conf = {key: KeyConf(_override_of(fields), _paused_of(fields, now)) for key, fields in sorted(keys.items())}
        infos.append(
            GroupInfo(
                name,
                declared.concurrency,
                declared.rates,
                _override_of(group),
                _paused_of(group, now),
                {key: c for key, c in conf.items() if c.override is not None or c.paused_until is not None},
            )
        )
    return infos
