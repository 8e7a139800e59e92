"""Celery signal wiring: publish hooks and the worker-side endings of keyed runs.

Celery's ``Signal.send`` swallows receiver exceptions, so nothing here can
stop a publish; receivers only add headers or record what happened.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import redis
from celery import signals

from . import runtime
from .gate import HEADER, GateHeader
from .keys import member_for, new_nonce
from .task import DedupTask

logger = logging.getLogger("celery_dedup")

SUCCEEDED, FAILED, REVOKED, STARTED, REJECTED = "succeeded", "failed", "revoked", "started", "rejected"


def _finish(task: DedupTask, headers: Any, task_id: str | None, state: str, *, drop: bool) -> None:
    gate = GateHeader.decode(headers)
    if gate is None or task_id is None:
        return
    store = runtime.store_for(task._get_app())
    try:
        owned = store.finish(
            gate.member, task_id, state, drop=drop, record_ms=int(runtime.config_for(task._get_app()).record_ttl * 1000)
        )
    except redis.RedisError:
        logger.exception("could not record %s for %s[%s] key %r", state, task.name, task_id, gate.member)
        return
    if not owned:
        logger.warning("%s[%s] ended (%s) but key %r belongs to another run", task.name, task_id, state, gate.member)


def _request_headers(task: Any) -> Any:
    request = getattr(task, "request", None)
    return getattr(request, "headers", None) if request is not None else None


def on_prerun(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
    if isinstance(sender, DedupTask) and sender.dedup_policy.mode.releases_on_start:
        _finish(sender, _request_headers(sender), task_id, STARTED, drop=True)


def on_success(sender: Any = None, **_: Any) -> None:
    if isinstance(sender, DedupTask):
        drop = not sender.dedup_policy.mode.holds_after_success
        _finish(sender, _request_headers(sender), sender.request.id, SUCCEEDED, drop=drop)


def on_failure(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
    if isinstance(sender, DedupTask):
        _finish(sender, _request_headers(sender), task_id, FAILED, drop=True)


def on_revoked(sender: Any = None, request: Any = None, **_: Any) -> None:
    # ``request`` is the worker's Request: its request_dict holds the message headers.
    if isinstance(sender, DedupTask) and request is not None:
        _finish(sender, getattr(request, "request_dict", None), request.id, REVOKED, drop=True)


def on_before_publish(app: Any, sender: str | None = None, headers: dict[str, Any] | None = None,
                      body: Any = None, **_: Any) -> None:
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
    for signal, receiver in (
        (signals.task_prerun, on_prerun),
        (signals.task_success, on_success),
        (signals.task_failure, on_failure),
        (signals.task_revoked, on_revoked),
    ):
        signal.connect(receiver, weak=False, dispatch_uid=f"celery_dedup.{receiver.__name__}")
