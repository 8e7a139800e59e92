"""Celery signal wiring: the publish hook, and the endings that bypass ``DedupTask.__call__``.

Celery's ``Signal.send`` swallows receiver exceptions, so nothing here can
stop a publish; receivers only add headers or record what happened.
Success and body failures are settled in ``DedupTask.__call__``, before the
result is stored; these receivers cover revokes, lost workers and hard time
limits, where the body never returned.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from celery import signals

from . import runtime
from .gate import HEADER, GateHeader
from .keys import member_for, new_nonce
from .task import FAILED, REVOKED, DedupTask

logger = logging.getLogger("celery_dedup")


def on_failure(sender: Any = None, task_id: str | None = None, args: Any = None, kwargs: Any = None, **_: Any) -> None:
    if not isinstance(sender, DedupTask) or getattr(sender.request, "dedup_settled", False):
        return
    headers = sender.request.headers if sender.request.id == task_id else None
    sender.dedup_settle(FAILED, drop=True, task_id=task_id, headers=headers, args=args, kwargs=kwargs)


def on_revoked(sender: Any = None, request: Any = None, **_: Any) -> None:
    # ``request`` is the worker's Request: its request_dict holds the message headers.
    if isinstance(sender, DedupTask) and request is not None:
        sender.dedup_settle(
            REVOKED,
            drop=True,
            task_id=request.id,
            headers=request.request_dict,
            args=request.args,
            kwargs=request.kwargs,
        )


def on_before_publish(
    app: Any, sender: str | None = None, headers: dict[str, Any] | None = None, body: Any = None, **_: Any
) -> None:
    """Gate ``app.send_task`` by name: add the ``dedup`` header the transport acts on.

    ``DedupTask.apply_async`` has added it already; only publishes that bypass
    it (``send_task``, canvas fallbacks) need it here. Only tasks registered in
    the publishing app can be keyed.
    """
    if headers is None or HEADER in headers or sender is None:
        return
    task = app.tasks.get(sender)
    if not isinstance(task, DedupTask) or not task.dedup_policy.mode.gates_enqueue:
        return
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
    ).encode()


def connect(app: Any) -> None:
    """Connect every receiver once (idempotent); the publish hook once per app."""
    signals.before_task_publish.connect(
        functools.partial(on_before_publish, app), weak=False, dispatch_uid=f"celery_dedup.publish.{id(app)}"
    )
    signals.task_failure.connect(on_failure, weak=False, dispatch_uid="celery_dedup.on_failure")
    signals.task_revoked.connect(on_revoked, weak=False, dispatch_uid="celery_dedup.on_revoked")
