"""What an operator may do to dedup keys: inspect, release, purge, re-enqueue (public API).

Each takes the Celery app whose keys it acts on, so the Django admin, the
command line and a user's scripts share one implementation; they never write
Redis themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from . import decisions, runtime
from .exceptions import DedupArgumentError, DedupOperationError
from .keys import split_member, task_from_namespace
from .payloads import decode_payload
from .store import format as store_format
from .store.format import MigrateReport
from .store.status import ENDED_STATES
from .store.store import KeyDetail, PurgeReport, ReleaseResult
from .task import DedupTask

__all__ = [
    "REQUEUE_STATES",
    "KeyDetail",
    "MigrateReport",
    "PurgeReport",
    "ReleaseResult",
    "RequeueResult",
    "can_requeue",
    "detail",
    "migrate",
    "purge",
    "release",
    "requeue",
]

#: States of a run that may be re-enqueued: it ended (or died) without success.
REQUEUE_STATES = ("failed", "revoked", "rejected", "lost", "released")


@dataclass(frozen=True)
class RequeueResult:
    """The run a re-enqueue led to."""

    task_id: str
    #: True when the key was held by another run: nothing was published, and
    #: ``task_id`` is that run's.
    deduplicated: bool


def detail(app: Any, member: str) -> KeyDetail:
    """Everything known about ``member``: record, history, hold, execution lock."""
    return runtime.store_for(app).detail(member)


def release(app: Any, member: str, *, force_token: str = "", by: str = "") -> ReleaseResult:
    """Free ``member``'s key; its unended run ends as ``released``.

    Refused while the key's execution lock is alive, unless ``force_token`` is
    that lock's current token (as shown to the operator): the lock is then
    deleted, and the history says it was forced, and by whom (``by``). A key
    that is not held and has no live lock is left alone: the result is
    ``NOTHING`` with the record's state, and nothing is written or counted.
    """
    config = runtime.config_for(app)
    store = runtime.store_for(app)
    result = store.release(member, record_ms=config.record_ms, force_token=force_token, by=by)
    if result.released:
        namespace, key = split_member(member)
        how = "forced: a live execution lock was deleted" if result.forced else "key freed"
        task_id = (store.record(member) or {}).get("task_id")
        decisions.log("released", task_from_namespace(namespace), key, task_id, f"{how}, by {by or 'an operator'}")
    return result


def purge(app: Any, *, states: Sequence[str] = ENDED_STATES, budget: int = 500, limit: int = 10_000) -> PurgeReport:
    """Delete records in ended ``states``, ``budget`` examined per Redis call, about ``limit`` at most.

    Records whose key is held or whose lock is alive are kept. Stops early
    when a call deletes nothing (only kept records were left in its budget).

    Raises:
        DedupOperationError: a state is not an ended one.
        DedupArgumentError: budget or limit is below 1.
    """
    unended = [s for s in states if s not in ENDED_STATES]
    if unended or not states:
        raise DedupOperationError("purge", ",".join(states), f"only ended states can be purged: {ENDED_STATES}")
    if budget < 1 or limit < 1:
        raise DedupArgumentError("budget" if budget < 1 else "limit", min(budget, limit), "must be at least 1")
    store = runtime.store_for(app)
    purged = 0
    while True:
        report = store.purge(states, budget=min(budget, limit - purged))
        purged += report.purged
        if not report.more or report.purged == 0 or purged >= limit:
            return PurgeReport(purged, report.kept, report.more)


def can_requeue(record: dict[str, str] | None) -> bool:
    """Whether ``record`` keeps a payload and its run ended without success."""
    return bool(record and record.get("payload") and record.get("state") in REQUEUE_STATES)


def requeue(app: Any, member: str, *, by: str = "") -> RequeueResult:
    """Publish a fresh, gated run of ``member``'s task with the arguments its record kept.

    The new run's first history entry then says ``re-enqueued by <by> from
    <the earlier run's task id>`` (``by`` defaults to "an operator"). The note
    is a second small script after the publish: it is written only while the
    record still names the new run, so a run that already ended and was
    followed by another keeps a history without it.

    Raises:
        DedupOperationError: no record, no payload (arguments are kept on a
            Redis broker while ``dedup_record_args`` is on), the run has not
            ended without success, the task is not registered in ``app``, or
            the payload cannot be decoded.
    """
    record = runtime.store_for(app).record(member)
    if record is None:
        raise DedupOperationError("requeue", member, "there is no status record")
    state = record.get("state", "")
    if state not in REQUEUE_STATES:
        only = f"{', '.join(REQUEUE_STATES[:-1])} or {REQUEUE_STATES[-1]}"
        raise DedupOperationError("requeue", member, f"the run's state is {state}; only {only} runs can be re-enqueued")
    payload = record.get("payload")
    if not payload:
        raise DedupOperationError(
            "requeue", member, "the record keeps no payload (kept on a Redis broker with dedup_record_args on)"
        )
    name = record.get("task") or task_from_namespace(split_member(member)[0])  # format 2 derives it
    task = app.tasks.get(name)
    if not isinstance(task, DedupTask):
        raise DedupOperationError("requeue", member, f"task {name!r} is no DedupTask of this app")
    try:
        args, kwargs = decode_payload(app, payload)
    except Exception as exc:  # kombu's decoders raise many kinds (ContentDisallowed, ValueError, ...)
        raise DedupOperationError("requeue", member, f"cannot decode its payload: {exc}") from exc
    result = task.apply_async(tuple(args), kwargs)
    if not result.deduplicated:
        note = f"re-enqueued by {by or 'an operator'} from {record.get('task_id', '?')}"
        runtime.store_for(app).annotate(member, result.id, note)
    return RequeueResult(result.id, result.deduplicated)


def migrate(app: Any, *, dry_run: bool = False) -> MigrateReport:
    """Move the store's format-1 leftovers to this release's format, then mark the store with it.

    Run once every producer and worker runs this release (a previous release
    still running writes them again: run it again then). Each format-1
    history list is folded into its record's history fields (deleted where
    the record is gone), format 1's indexes are deleted, and the store's
    ``format`` key is set. Idempotent, a SCAN (never KEYS), safe while this
    release's workers run. ``dry_run``: count what it would do, change nothing.

    Raises:
        DedupStoreFormatError: the store is in a newer format than this release's.
    """
    return store_format.migrate(runtime.store_for(app), dry_run=dry_run)
