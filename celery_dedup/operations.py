"""What an operator may do to dedup keys: inspect, release, purge, re-enqueue.

Each takes the Celery app whose keys it acts on, so the Django admin and a
command line share one implementation; they never write Redis themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import runtime
from .exceptions import DedupOperationError
from .store import ENDED_STATES, KeyDetail, PurgeReport, ReleaseResult


def detail(app: Any, member: str) -> KeyDetail:
    """Everything known about ``member``: record, history, hold, execution lock."""
    return runtime.store_for(app).detail(member)


def release(app: Any, member: str, *, force_token: str = "", by: str = "") -> ReleaseResult:
    """Free ``member``'s key; its unended run ends as ``released``.

    Refused while the key's execution lock is alive, unless ``force_token`` is
    that lock's current token (as shown to the operator): the lock is then
    deleted, and the history says it was forced, and by whom (``by``).
    """
    config = runtime.config_for(app)
    return runtime.store_for(app).release(member, record_ms=config.record_ms, force_token=force_token, by=by)


def purge(app: Any, *, states: Sequence[str] = ENDED_STATES, budget: int = 500, limit: int = 10_000) -> PurgeReport:
    """Delete records in ended ``states``, ``budget`` examined per Redis call, about ``limit`` at most.

    Records whose key is held or whose lock is alive are kept. Stops early
    when a call deletes nothing (only kept records were left in its budget).

    Raises:
        DedupOperationError: a state is not an ended one, or budget/limit is below 1.
    """
    unended = [s for s in states if s not in ENDED_STATES]
    if unended or not states:
        raise DedupOperationError("purge", ",".join(states), f"only ended states can be purged: {ENDED_STATES}")
    if budget < 1 or limit < 1:
        raise DedupOperationError("purge", f"budget={budget} limit={limit}", "both must be at least 1")
    store = runtime.store_for(app)
    purged = 0
    while True:
        report = store.purge(states, budget=min(budget, limit - purged))
        purged += report.purged
        if not report.more or report.purged == 0 or purged >= limit:
            return PurgeReport(purged, report.kept, report.more)
