"""celery-dedup: duplicate Celery work made impossible to do twice.

Public API::

    import celery_dedup
    from celery_dedup import DedupTask, DuplicateTaskError

    celery_dedup.install(app)

    @app.task(base=DedupTask, dedup_key="order:{order_id}")
    def charge(order_id, amount): ...
"""

from __future__ import annotations

from typing import Any

from . import runtime, signals
from .exceptions import (
    DedupConfigError,
    DedupError,
    DedupKeyError,
    DedupRoutingError,
    DedupUnavailableError,
    DuplicateTaskError,
)
from .gate import Outcome, last_outcome
from .task import DedupResult, DedupTask

__version__ = "0.1.0"

__all__ = [
    "DedupConfigError",
    "DedupError",
    "DedupKeyError",
    "DedupResult",
    "DedupRoutingError",
    "DedupTask",
    "DedupUnavailableError",
    "DuplicateTaskError",
    "Outcome",
    "install",
    "last_outcome",
]


def install(app: Any) -> None:
    """Set ``app`` up for DedupTask: validate settings, gate the broker, connect hooks.

    Call once, after the app's configuration is loaded and before it connects
    to the broker. Raises :class:`DedupConfigError` for a bad setting.
    """
    runtime.install(app)
    signals.connect(app)
