"""Celery wiring on the worker: the endings that bypass ``DedupTask.__call__``.

Celery's ``Signal.send`` swallows receiver exceptions; receivers only record
what happened. Success and body failures are settled in
``DedupTask.__call__``, before the result is stored; these receivers cover
revokes, lost workers and hard time limits, where the body never returned.
``install`` connects them; every app's tasks reach them, and they act only
for apps it set up.
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from billiard.exceptions import WorkerLostError
from celery import signals
from celery.exceptions import Reject, TimeLimitExceeded

from .. import runtime
from ..header import GateHeader
from ..task import DedupTask
from . import relay, results
from .delivery import FAILED, LOST, REJECTED, REVOKED, settle_elsewhere

logger = logging.getLogger("celery_dedup")


def on_failure(
    sender: Any = None,
    task_id: str | None = None,
    exception: BaseException | None = None,
    args: Any = None,
    kwargs: Any = None,
    **_: Any,
) -> None:
    """Failures reported outside the body: a lost worker process, a hard time limit.

    Failures the body raised were settled by the guard already; a run that has
    ended is never rewritten, so repeating it here changes nothing. A
    ``Reject`` is the guard's to record (Celery reports it as a failure too).
    A hard time limit is reported while the pool child is still being killed.
    """
    if not isinstance(sender, DedupTask) or task_id is None or isinstance(exception, Reject):
        return
    if not runtime.is_installed(sender.app):
        return
    headers = sender.request.headers if sender.request.id == task_id else None
    state = LOST if isinstance(exception, WorkerLostError) else FAILED
    stopping = isinstance(exception, TimeLimitExceeded)
    settle_elsewhere(sender, state, task_id, headers, args, kwargs, stopping=stopping)


def on_revoked(sender: Any = None, request: Any = None, terminated: bool = False, **_: Any) -> None:
    """A revoked run: before it started, or terminated (and still being stopped) while it ran.

    A revoke without ``terminate`` that reaches a copy of a run executing
    elsewhere leaves that run alone, as Celery does.
    """
    if (
        isinstance(sender, DedupTask)
        and request is not None
        and request.id is not None
        and runtime.is_installed(sender.app)
    ):
        headers = getattr(request, "headers", None) or getattr(request, "request_dict", None)
        settle_elsewhere(sender, REVOKED, request.id, headers, request.args, request.kwargs, stopping=bool(terminated))


def on_unrunnable(
    sender: Any = None, message: Any = None, name: str | None = None, id: str | None = None, **_: Any
) -> None:
    """A gated message the worker cannot run (unknown task, rejected message): free its key."""
    headers = getattr(message, "headers", None)
    gate = GateHeader.decode(headers)
    app = getattr(sender, "app", None)  # the worker's consumer
    if gate is None or headers is None or app is None or not runtime.is_installed(app):
        return
    task_id = id or headers.get("id")
    store = runtime.store_for(app).with_prefix(gate.prefix)
    record_ms = runtime.config_for(app).record_ms
    try:
        store.finish(gate.member, str(task_id), REJECTED, drop=True, record_ms=record_ms, role="report")
    except redis.RedisError:
        logger.exception("could not free the key %r of unrunnable message %s", gate.member, task_id)
    else:
        logger.warning(
            "message %s (%s) cannot run here: key %r released", task_id, name or headers.get("task"), gate.member
        )


def connect() -> None:
    """Connect every receiver once (idempotent); each acts only for apps given to ``install``."""
    signals.task_failure.connect(on_failure, weak=False, dispatch_uid="celery_dedup.on_failure")
    signals.task_revoked.connect(on_revoked, weak=False, dispatch_uid="celery_dedup.on_revoked")
    signals.task_unknown.connect(on_unrunnable, weak=False, dispatch_uid="celery_dedup.on_unknown")
    signals.task_rejected.connect(on_unrunnable, weak=False, dispatch_uid="celery_dedup.on_rejected")
    relay.connect()
    results.connect()
