"""A task's options, resolved against the app's settings and validated: its dedup policy and its limits.

DedupTask resolves them once per app (see ``DedupTask.dedup_policy``); the
guard, the limits and bulk publishing read them from there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .exceptions import DedupConfigError
from .keys import KeyOption, KeySpec

if TYPE_CHECKING:
    import inspect

    from .modes import Mode


#: Every limit option, as a DedupTask attribute or a keyword of ``@app.task``.
LIMIT_OPTIONS = ("limit_key", "limit_concurrency", "limit_rate")

_PERIODS = {"s": 1000, "m": 60_000, "h": 3_600_000}
_RATE = re.compile(r"\s*(\d+)\s*/\s*([smh])\s*")
#: The most starts one rate allows per period: its window is a log of them.
MAX_RATE = 100_000
MAX_CONCURRENCY = 100_000


@dataclass(frozen=True)
class Rate:
    """At most ``count`` starts in any window of ``period_ms``."""

    count: int
    period_ms: int

    def __str__(self) -> str:
        unit = {ms: name for name, ms in _PERIODS.items()}[self.period_ms]
        return f"{self.count}/{unit}"


@dataclass(frozen=True)
class LimitPolicy:
    """A task's limits, validated: the group's key, and at least one of concurrency and rate."""

    #: The group's key; None: the task's dedup key.
    spec: KeySpec | None
    concurrency: int | None = None
    rate: Rate | None = None


def parse_rate(value: Any, *, task: str | None = None) -> Rate:
    """``"R/s"``, ``"R/m"`` or ``"R/h"`` as a :class:`Rate`, R from 1 to ``MAX_RATE``.

    Raises:
        DedupConfigError: anything else.
    """
    match = _RATE.fullmatch(value) if isinstance(value, str) else None
    count = int(match.group(1)) if match else 0
    if match is None or not 1 <= count <= MAX_RATE:
        raise DedupConfigError(
            "limit_rate", value, f"must be 'R/s', 'R/m' or 'R/h' with R from 1 to {MAX_RATE}", task=task
        )
    return Rate(count, _PERIODS[match.group(2)])


def resolve(
    task: str, key: KeyOption, concurrency: Any, rate: Any, signature: inspect.Signature, max_key_length: int
) -> LimitPolicy | None:
    """The task's :class:`LimitPolicy` from its options, or None when it sets no limit.

    Raises:
        DedupConfigError: a bad value, or a ``limit_key`` without a limit to apply.
    """
    if concurrency is None and rate is None:
        if key is not None:
            raise DedupConfigError("limit_key", key, "applies only with limit_concurrency or limit_rate", task=task)
        return None
    if concurrency is not None and (
        isinstance(concurrency, bool) or not isinstance(concurrency, int) or not 1 <= concurrency <= MAX_CONCURRENCY
    ):
        raise DedupConfigError(
            "limit_concurrency", concurrency, f"must be a whole number from 1 to {MAX_CONCURRENCY}", task=task
        )
    spec = None
    if key is not None:
        try:
            spec = KeySpec(task, key, signature, max_key_length)
        except DedupConfigError as exc:
            raise DedupConfigError("limit_key", key, exc.reason, task=task) from None
    return LimitPolicy(spec, concurrency, None if rate is None else parse_rate(rate, task=task))


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
