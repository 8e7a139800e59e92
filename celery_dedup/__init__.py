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

from . import runtime
from .exceptions import (
    DedupArgumentError,
    DedupArgumentsMismatch,
    DedupConfigError,
    DedupError,
    DedupKeyError,
    DedupLimitTimeout,
    DedupLockLostError,
    DedupRoutingError,
    DedupStepError,
    DedupStepInDoubt,
    DedupStoreError,
    DedupUnavailableError,
    DuplicateTaskError,
)
from .installer import install
from .publish.result import DedupResult
from .publish.ticket import last_outcome
from .runtime import reap, stats
from .store.status import HistoryEntry, Status, StepStatus
from .store.store import Outcome, Page, ReapReport, Record
from .task import DedupTask

__version__ = "0.1.0"

__all__ = [
    "DedupArgumentError",
    "DedupArgumentsMismatch",
    "DedupConfigError",
    "DedupError",
    "DedupKeyError",
    "DedupLimitTimeout",
    "DedupLockLostError",
    "DedupResult",
    "DedupRoutingError",
    "DedupStepError",
    "DedupStepInDoubt",
    "DedupStoreError",
    "DedupTask",
    "DedupUnavailableError",
    "DuplicateTaskError",
    "HistoryEntry",
    "Outcome",
    "Page",
    "ReapReport",
    "Record",
    "Status",
    "StepStatus",
    "install",
    "last_outcome",
    "reap",
    "records",
    "stats",
]


def records(
    app: Any,
    *,
    state: str | None = None,
    task: str | None = None,
    prefix: str | None = None,
    cursor: str | None = None,
    limit: int = 50,
) -> Page:
    """A page of status records (:class:`Status`, without history), newest update first.

    Pass ``page.cursor`` back for the next page; it is None on the last.

    Filters: ``state`` (one of ``celery_dedup.store.schema.STATES``: pending,
    publishing, queued, started, retry, succeeded, failed, revoked, rejected,
    ignored, lost, skipped, released, replaced), ``task`` (a task name) and ``prefix``
    (of the business key, e.g. ``"order:4"``; results then come in key order).
    A cursor past the end gives an empty last page.

    Raises:
        DedupArgumentError: ``limit`` is below 1, or ``cursor`` is not a
            page's cursor (a decimal number of ASCII digits; on a Redis
            Cluster store, one per shard, joined by dots).
    """
    store = runtime.store_for(app)
    return store.records(state=state, task=task, prefix=prefix, cursor=cursor, limit=limit)
