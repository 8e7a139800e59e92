"""Celery signal wiring: the publish hook, and the endings that bypass ``DedupTask.__call__``.

Celery's ``Signal.send`` swallows receiver exceptions, so nothing here can
stop a publish; receivers only add headers or record what happened.
Success and body failures are settled in ``DedupTask.__call__``, before the
result is stored; these receivers cover revokes, lost workers and hard time
limits, where the body never returned.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import celery
import redis
from billiard.exceptions import WorkerLostError
from celery import signals

from . import runtime
from .gate import HEADER, GateHeader
from .guard import FAILED, LOST, REJECTED, REVOKED, settle_elsewhere
from .keys import member_for, new_nonce
from .task import DedupTask

logger = logging.getLogger("celery_dedup")


def on_failure(
    sender: Any = None,
    task_id: str | None = None,
    exception: BaseException | None = None,
    args: Any = None,
    kwargs: Any = None,
    **_: Any,
) -> None:
    """Failures raised outside the body: the worker process died, or a hard time limit killed it."""
    if not isinstance(sender, DedupTask) or getattr(sender.request, "dedup_settled", False) or task_id is None:
        return
    headers = sender.request.headers if sender.request.id == task_id else None
    state = LOST if isinstance(exception, WorkerLostError) else FAILED
    settle_elsewhere(sender, state, task_id, headers, args, kwargs, worker_gone=True)


def on_revoked(sender: Any = None, request: Any = None, terminated: bool = False, **_: Any) -> None:
    # ``request`` is the worker's Request: its request_dict holds the message headers.
    if isinstance(sender, DedupTask) and request is not None:
        settle_elsewhere(
            sender,
            REVOKED,
            request.id,
            request.request_dict,
            request.args,
            request.kwargs,
            worker_gone=bool(terminated),
        )


def on_unrunnable(
    sender: Any = None, message: Any = None, name: str | None = None, id: str | None = None, **_: Any
) -> None:
    """A gated message the worker cannot run (unknown task, rejected message): free its key."""
    headers = getattr(message, "headers", None)
    gate = GateHeader.decode(headers)
    if gate is None or headers is None:
        return
    app = next(iter(_installed), None)
    if app is None:
        return
    task_id = id or headers.get("id")
    store = runtime.store_for(app).with_prefix(gate.prefix)
    record_ms = int(runtime.config_for(app).record_ttl * 1000)
    try:
        store.finish(gate.member, str(task_id), REJECTED, drop=True, record_ms=record_ms)
    except redis.RedisError:
        logger.exception("could not free the key %r of unrunnable message %s", gate.member, task_id)
    else:
        logger.warning(
            "message %s (%s) cannot run here: key %r released", task_id, name or headers.get("task"), gate.member
        )


_installed: weakref.WeakSet[Any] = weakref.WeakSet()


def _publishing_task(name: str) -> DedupTask | None:
    """The DedupTask ``name`` in the publishing app.

    The signal does not say which app publishes: the current app is asked
    first, then every installed app (ambiguous only if several installed apps
    register the same task name with different options).
    """
    current = celery.current_app
    for app in (current, *(a for a in list(_installed) if a is not current)):
        if app in _installed:
            task = app.tasks.get(name)
            if isinstance(task, DedupTask):
                return task
    return None


def on_before_publish(
    sender: str | None = None, headers: dict[str, Any] | None = None, body: Any = None, **_: Any
) -> None:
    """Gate ``app.send_task`` by name: add the ``dedup`` header the transport acts on.

    ``DedupTask.apply_async`` has added it already; only publishes that bypass
    it (``send_task``, canvas fallbacks) need it here. Only tasks registered in
    an installed app can be keyed.
    """
    if headers is None or HEADER in headers or sender is None:
        return
    task = _publishing_task(sender)
    if task is None or not task.dedup_policy.mode.gates_enqueue:
        return
    app = task.app
    if not runtime.runtime_for(app).atomic:
        logger.warning("%s published by name on a non-Redis broker: not gated", sender)
        return
    try:
        args, kwargs = body[0], body[1]
        business_key = task.dedup_policy.spec.business_key(args, kwargs)
    except Exception:
        logger.exception("could not derive the key of %s published by name: not gated", sender)
        return
    config = runtime.config_for(app)
    headers[HEADER] = GateHeader(
        prefix=config.key_prefix,
        member=member_for(task.name, business_key),
        nonce=new_nonce(),
        hold_ms=int(task.dedup_policy.ttl * 1000),
        grace_ms=int(config.record_ttl * 1000),
        history=config.history_length,
        record_args=config.record_args,
    ).encode()


def connect(app: Any) -> None:
    """Register ``app`` for the publish hook and connect every receiver once (idempotent)."""
    _installed.add(app)
    signals.before_task_publish.connect(on_before_publish, weak=False, dispatch_uid="celery_dedup.on_before_publish")
    signals.task_failure.connect(on_failure, weak=False, dispatch_uid="celery_dedup.on_failure")
    signals.task_revoked.connect(on_revoked, weak=False, dispatch_uid="celery_dedup.on_revoked")
    signals.task_unknown.connect(on_unrunnable, weak=False, dispatch_uid="celery_dedup.on_unknown")
    signals.task_rejected.connect(on_unrunnable, weak=False, dispatch_uid="celery_dedup.on_rejected")
