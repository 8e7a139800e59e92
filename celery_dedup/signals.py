"""Celery wiring: the publish-by-name hook, and the endings that bypass ``DedupTask.__call__``.

Celery's ``Signal.send`` swallows receiver exceptions, so nothing here can
stop a publish; receivers only add headers or record what happened.
Success and body failures are settled in ``DedupTask.__call__``, before the
result is stored; these receivers cover revokes, lost workers and hard time
limits, where the body never returned.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import redis
from billiard.exceptions import WorkerLostError
from celery import signals
from celery.exceptions import Reject, TimeLimitExceeded
from kombu.utils.imports import symbol_by_name

from . import relay, runtime
from .guard import FAILED, LOST, REJECTED, REVOKED, settle_elsewhere
from .header import HEADER, GateHeader
from .keys import member_for
from .publish.delay import delay_seconds
from .publish.ticket import Ticket, open_ticket
from .task import DedupTask, carries_continuation

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
    headers = sender.request.headers if sender.request.id == task_id else None
    state = LOST if isinstance(exception, WorkerLostError) else FAILED
    stopping = isinstance(exception, TimeLimitExceeded)
    settle_elsewhere(sender, state, task_id, headers, args, kwargs, stopping=stopping)


def on_revoked(sender: Any = None, request: Any = None, terminated: bool = False, **_: Any) -> None:
    """A revoked run: before it started, or terminated (and still being stopped) while it ran.

    A revoke without ``terminate`` that reaches a copy of a run executing
    elsewhere leaves that run alone, as Celery does.
    """
    if isinstance(sender, DedupTask) and request is not None and request.id is not None:
        headers = getattr(request, "headers", None) or getattr(request, "request_dict", None)
        settle_elsewhere(sender, REVOKED, request.id, headers, request.args, request.kwargs, stopping=bool(terminated))


def on_unrunnable(
    sender: Any = None, message: Any = None, name: str | None = None, id: str | None = None, **_: Any
) -> None:
    """A gated message the worker cannot run (unknown task, rejected message): free its key."""
    headers = getattr(message, "headers", None)
    gate = GateHeader.decode(headers)
    app = getattr(sender, "app", None)  # the worker's consumer
    if gate is None or headers is None or app is None:
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


def _add_gate_header(app: Any, name: str, headers: dict[str, Any], body: Any) -> None:
    """Give a message published by name the ``dedup`` header its task would have added."""
    task = app.tasks.get(name)
    if not isinstance(task, DedupTask) or not task.dedup_policy.mode.gates_enqueue:
        return
    if not runtime.runtime_for(app).atomic:
        logger.warning("%s published by name on a non-Redis broker: not gated", name)
        return
    try:
        args, kwargs = body[0], body[1]
        business_key = task.dedup_policy.spec.business_key(args, kwargs)
    except Exception:
        logger.exception("could not derive the key of %s published by name: not gated", name)
        return
    delay = delay_seconds(None, headers.get("eta"))  # send_task(countdown=) arrives as an ETA
    embed = body[2] if len(body) > 2 and isinstance(body[2], dict) else {}
    follows = bool(headers.get("group")) or carries_continuation(embed.get("callbacks"), embed.get("errbacks"), embed)
    headers[HEADER] = task.dedup_gate_header(member_for(task.name, business_key), delay, follows=follows).encode()


class _Refused(BaseException):
    """Ends Celery's sender after the gate refused its message, before it announces the message as sent.

    A BaseException so that Celery's ``except Exception`` around a worker's
    callback publish does not log it as a failed publish; it never leaves
    :func:`gate_send_task`'s wrapper.
    """


class _GatedProducer:
    """The producer Celery's sender is handed for one gated message.

    Celery sends ``after_task_publish`` (and the ``task-sent`` event) once
    ``producer.publish`` returns, and the gate's answer exists only then. A
    message the gate refused (a duplicate) was never enqueued, so its publish
    raises :class:`_Refused` instead of returning. Every other publish (the
    ``task-sent`` event itself) and attribute is the real producer's.
    """

    def __init__(self, producer: Any, ticket: Ticket) -> None:
        self._producer = producer
        self._ticket = ticket

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)

    def publish(self, body: Any, **kwargs: Any) -> Any:
        ticket = self._ticket
        gate = GateHeader.decode(kwargs.get("headers"))
        if gate is None or gate.nonce != ticket.nonce:
            return self._producer.publish(body, **kwargs)
        sent = self._producer.publish(body, **kwargs)
        if ticket.outcome is not None and not ticket.outcome.accepted:
            raise _Refused()
        ticket.sent = True
        return sent


def gated_sender(app: Any, send: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap Celery's message sender ``send``: gate publishes by name, announce only messages the gate took.

    ``DedupTask.apply_async`` adds the header itself; ``send_task`` and canvas
    fallbacks bypass it. Celery's ``before_task_publish`` signal could add the
    header but does not say which app publishes, so the app's own message
    sender is wrapped instead. A duplicate the gate refused gets no
    ``after_task_publish`` signal and no ``task-sent`` event
    (``before_task_publish`` fired already: it precedes the gate).
    """

    def send_task_message(producer: Any, name: str, message: Any, **options: Any) -> Any:
        # apply_async passes its header as an option; Celery merges it over the message's.
        given = options.get("headers") or {}
        if HEADER not in message.headers and HEADER not in given:
            _add_gate_header(app, name, message.headers, message.body)
        gate = GateHeader.decode(given if HEADER in given else message.headers)
        if gate is None:  # not keyed, or published ungated (fail_open)
            return send(producer, name, message, **options)
        with open_ticket(gate.nonce) as ticket:
            try:
                return send(_GatedProducer(producer, ticket), name, message, **options)
            except _Refused:
                return None

    return send_task_message


class GatedAMQP:
    """Mixed into the app's AMQP class: its message sender is the gated one.

    Celery builds the sender, reading the publish settings
    (``task_publish_retry_policy``, ``task_default_routing_key``, ...), at
    the first publish; so does this, so settings changed after ``install``
    apply as they would without celery-dedup.
    """

    app: Any

    def _create_task_sender(self) -> Callable[..., Any]:
        return gated_sender(self.app, super()._create_task_sender())  # type: ignore[misc]


_GATED_CLASSES: dict[type, type] = {}


def _gated_class(base: type) -> type:
    if issubclass(base, GatedAMQP):
        return base
    if base not in _GATED_CLASSES:
        _GATED_CLASSES[base] = type(f"Gated{base.__name__}", (GatedAMQP, base), {"__module__": __name__})
    return _GATED_CLASSES[base]


def gate_send_task(app: Any) -> None:
    """Gate ``app.send_task`` by name, for this app's DedupTasks (idempotent).

    Through ``app.amqp_cls``, Celery's hook for its AMQP class. An AMQP object
    the app made already (it published before ``install``) is dropped, and
    Celery makes a gated one at its next use.
    """
    base = symbol_by_name(app.amqp_cls)
    if issubclass(base, GatedAMQP):
        return
    app.amqp_cls = _gated_class(base)
    app.__dict__.pop("amqp", None)


def connect(app: Any) -> None:
    """Gate ``app``'s publishes by name and connect every receiver once (idempotent)."""
    gate_send_task(app)
    signals.task_failure.connect(on_failure, weak=False, dispatch_uid="celery_dedup.on_failure")
    signals.task_revoked.connect(on_revoked, weak=False, dispatch_uid="celery_dedup.on_revoked")
    signals.task_unknown.connect(on_unrunnable, weak=False, dispatch_uid="celery_dedup.on_unknown")
    signals.task_rejected.connect(on_unrunnable, weak=False, dispatch_uid="celery_dedup.on_rejected")
    relay.connect()
