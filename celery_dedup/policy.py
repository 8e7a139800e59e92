"""A task's options, resolved against the app's settings and validated: its dedup policy and its limits.

DedupTask resolves them once per app (see ``DedupTask.dedup_policy``); the
guard, the limits and bulk publishing read them from there.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .exceptions import DedupConfigError
from .keys import KeyOption, KeySpec

if TYPE_CHECKING:
    import inspect

    from .modes import Mode


#: Every limit option, as a DedupTask attribute or a keyword of ``@app.task``.
LIMIT_OPTIONS = ("limit_key", "limit_concurrency", "limit_rate", "limit_group")

_PERIODS = {"s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_RATE = re.compile(r"\s*(\d+)\s*/\s*([smhd])\s*")
#: The most starts one rate allows per period: its window is a log of them.
MAX_RATE = 100_000
MAX_CONCURRENCY = 100_000
#: The most windows one limit takes (``limit_rate=["10/s", "500/h", "10000/d"]``).
MAX_WINDOWS = 8
#: What a rate must look like, for error messages.
RATE_FORMAT = f"'R/s', 'R/m', 'R/h' or 'R/d' with R from 1 to {MAX_RATE}"
RATES_FORMAT = f"{RATE_FORMAT}, or a non-empty list of at most {MAX_WINDOWS} of them"
CONCURRENCY_FORMAT = f"a whole number from 1 to {MAX_CONCURRENCY}"


@dataclass(frozen=True)
class Rate:
    """At most ``count`` starts in any window of ``period_ms``."""

    count: int
    period_ms: int

    def __str__(self) -> str:
        unit = {ms: name for name, ms in _PERIODS.items()}.get(self.period_ms)
        return f"{self.count}/{unit}" if unit else f"{self.count}/{self.period_ms}ms"


def rates_text(rates: tuple[Rate, ...]) -> str:
    """``rates`` as the store keeps them: ``"count/period_ms,count/period_ms"`` ("" for none)."""
    return ",".join(f"{rate.count}/{rate.period_ms}" for rate in rates)


def rates_from_text(text: str) -> tuple[Rate, ...]:
    """The inverse of :func:`rates_text`; entries that are not ``count/period_ms`` are left out."""
    found = []
    for part in text.split(","):
        count, _, period = part.partition("/")
        if count.isdigit() and period.isdigit() and int(count) > 0 and int(period) > 0:
            found.append(Rate(int(count), int(period)))
    return tuple(found)


@dataclass(frozen=True)
class LimitGroup:
    """A named limit group (setting ``dedup_limit_groups``), validated: its declared values."""

    name: str
    concurrency: int | None
    rates: tuple[Rate, ...]


@dataclass(frozen=True)
class LimitPolicy:
    """A task's limits, validated: the group's key, and at least one of concurrency and rate.

    A task naming a limit group (``limit_group``) carries the group's values
    and its name; its ``spec`` (``limit_key``) chooses the key inside the
    group, None: one quota for the whole group.
    """

    #: The group's key; None: the task's dedup key (a named group: the whole group).
    spec: KeySpec | None
    concurrency: int | None = None
    #: Every window a start needs room in; () : no rate limit.
    rates: tuple[Rate, ...] = ()
    #: The named group (``limit_group``); None: the task's own limits.
    group: str | None = None


def check_concurrency(value: Any) -> int:
    """A concurrency limit, 1 to ``MAX_CONCURRENCY``. Raises ValueError (the reason) otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CONCURRENCY:
        raise ValueError(f"must be {CONCURRENCY_FORMAT}")
    return value


def _one_rate(value: Any) -> Rate:
    match = _RATE.fullmatch(value) if isinstance(value, str) else None
    count = int(match.group(1)) if match else 0
    if match is None or not 1 <= count <= MAX_RATE:
        raise ValueError(f"must be {RATE_FORMAT}")
    return Rate(count, _PERIODS[match.group(2)])


def check_rates(value: Any) -> tuple[Rate, ...]:
    """One rate or a non-empty list of them, as windows. Raises ValueError (the reason) otherwise."""
    if isinstance(value, str):
        return (_one_rate(value),)
    if not isinstance(value, (list, tuple)) or not 1 <= len(value) <= MAX_WINDOWS:
        raise ValueError(f"must be {RATES_FORMAT}")
    rates = []
    for item in value:
        try:
            rates.append(_one_rate(item))
        except ValueError:
            raise ValueError(f"{item!r} in the list: each must be {RATE_FORMAT}") from None
    return tuple(rates)


def parse_rate(value: Any, *, task: str | None = None) -> Rate:
    """``"R/s"``, ``"R/m"``, ``"R/h"`` or ``"R/d"`` as a :class:`Rate`, R from 1 to ``MAX_RATE``.

    Raises:
        DedupConfigError: anything else.
    """
    try:
        return _one_rate(value)
    except ValueError as exc:
        raise DedupConfigError("limit_rate", value, str(exc), task=task) from None


def parse_rates(value: Any, *, task: str | None = None) -> tuple[Rate, ...]:
    """``limit_rate``: one rate (:func:`parse_rate`) or a non-empty list of them, each a window.

    Raises:
        DedupConfigError: anything else.
    """
    try:
        return check_rates(value)
    except ValueError as exc:
        raise DedupConfigError("limit_rate", value, str(exc), task=task) from None


#: What a group of ``dedup_limit_groups`` may declare.
GROUP_FIELDS = ("concurrency", "rate")


def check_group(setting: str, name: Any, value: Any) -> LimitGroup:
    """One group of ``dedup_limit_groups``: ``{"concurrency": N, "rate": "R/u" or [...]}``, at least one.

    Raises:
        DedupConfigError: naming the setting, the group and the bad value.
    """
    if not isinstance(name, str) or not name or not name.isprintable():
        raise DedupConfigError(setting, name, "a limit group's name must be a non-empty printable string")
    if not isinstance(value, Mapping):
        raise DedupConfigError(setting, value, f"limit group {name!r} must be a dict with 'concurrency' and/or 'rate'")
    unknown = sorted(str(field) for field in value if field not in GROUP_FIELDS)
    if unknown or not any(value.get(field) is not None for field in GROUP_FIELDS):
        what = f"has unknown fields {unknown}" if unknown else "sets no limit"
        raise DedupConfigError(setting, value, f"limit group {name!r} {what}: give 'concurrency' and/or 'rate'")
    concurrency, rates = value.get("concurrency"), value.get("rate")
    try:
        checked = None if concurrency is None else check_concurrency(concurrency)
    except ValueError as exc:
        raise DedupConfigError(setting, concurrency, f"limit group {name!r}: concurrency {exc}") from None
    try:
        windows = () if rates is None else check_rates(rates)
    except ValueError as exc:
        raise DedupConfigError(setting, rates, f"limit group {name!r}: rate {exc}") from None
    return LimitGroup(name, checked, windows)


def resolve(
    task: str,
    key: KeyOption,
    concurrency: Any,
    rate: Any,
    signature: inspect.Signature,
    max_key_length: int,
    group: Any = None,
    groups: Mapping[str, LimitGroup] | None = None,
) -> LimitPolicy | None:
    """The task's :class:`LimitPolicy` from its options, or None when it sets no limit.

    ``group``: its ``limit_group``, one of ``groups`` (the app's ``dedup_limit_groups``).

    Raises:
        DedupConfigError: a bad value, a ``limit_key`` without a limit to apply, an unknown
            group, or an inline limit that disagrees with the task's group.
    """
    if group is not None:
        return _resolve_group(task, key, concurrency, rate, signature, max_key_length, group, groups or {})
    if concurrency is None and rate is None:
        if key is not None:
            raise DedupConfigError(
                "limit_key", key, "applies only with limit_concurrency, limit_rate or limit_group", task=task
            )
        return None
    if concurrency is not None:
        try:
            check_concurrency(concurrency)
        except ValueError as exc:
            raise DedupConfigError("limit_concurrency", concurrency, str(exc), task=task) from None
    rates = () if rate is None else parse_rates(rate, task=task)
    return LimitPolicy(_key_spec(task, key, signature, max_key_length), concurrency, rates)


def _key_spec(task: str, key: KeyOption, signature: inspect.Signature, max_key_length: int) -> KeySpec | None:
    if key is None:
        return None
    try:
        return KeySpec(task, key, signature, max_key_length)
    except DedupConfigError as exc:
        raise DedupConfigError("limit_key", key, exc.reason, task=task) from None


def _resolve_group(
    task: str,
    key: KeyOption,
    concurrency: Any,
    rate: Any,
    signature: inspect.Signature,
    max_key_length: int,
    group: Any,
    groups: Mapping[str, LimitGroup],
) -> LimitPolicy:
    """A task drawing on named group ``group``: its values are the group's; inline ones must agree."""
    declared = groups.get(group) if isinstance(group, str) else None
    if declared is None:
        known = ", ".join(repr(name) for name in sorted(groups)) or "none"
        raise DedupConfigError(
            "limit_group", group, f"is no limit group of dedup_limit_groups (declared: {known})", task=task
        )
    if concurrency is not None:
        try:
            check_concurrency(concurrency)
        except ValueError as exc:
            reason = f"{exc} (and agree with limit group {group!r})"
            raise DedupConfigError("limit_concurrency", concurrency, reason, task=task) from None
        if concurrency != declared.concurrency:
            raise DedupConfigError(
                "limit_concurrency",
                concurrency,
                f"disagrees with limit group {group!r} (concurrency {declared.concurrency}): "
                "leave it out, the group's values apply",
                task=task,
            )
    try:
        rates = None if rate is None else check_rates(rate)
    except ValueError as exc:
        reason = f"{exc} (and agree with limit group {group!r})"
        raise DedupConfigError("limit_rate", rate, reason, task=task) from None
    if rates is not None and set(rates) != set(declared.rates):
        shown = [str(r) for r in declared.rates] or None
        raise DedupConfigError(
            "limit_rate",
            rate,
            f"disagrees with limit group {group!r} (rate {shown}): leave it out, the group's values apply",
            task=task,
        )
    return LimitPolicy(_key_spec(task, key, signature, max_key_length), declared.concurrency, declared.rates, group)


@dataclass(frozen=True)
class TaskPolicy:
    """One task's options, resolved against the app's settings and validated."""

    spec: KeySpec
    mode: type[Mode]
    ttl: float
    on_duplicate: str
    lock_ttl: float
    on_locked: str
    #: Windowed modes only (debounce, throttle): seconds.
    window: float | None = None
    #: Debounce only: the longest a burst postpones its run, seconds.
    max_wait: float | None = None
    #: Debounce only: run with the ``latest`` call's arguments or the ``first``.
    debounce: str = "latest"
    #: Per-group concurrency and rate limits (``limit_*`` options); None: none.
    limit: LimitPolicy | None = None
    #: A duplicate whose arguments differ from the accepted run's: ``warn``, ``raise`` or ``ignore``.
    on_mismatch: str = "warn"

    @property
    def compares_arguments(self) -> bool:
        """Whether the task's calls carry an arguments fingerprint for the gate to compare.

        Not with ``ignore``, and not for a debounce whose ``latest`` call's
        arguments run: there differing arguments are the point.
        """
        return self.on_mismatch != "ignore" and not (self.mode.parks and self.debounce == "latest")
