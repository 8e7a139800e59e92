"""Publishes by name (``app.send_task``, canvas fallbacks): the app's message sender adds the gate's header.

Only messages the gate took are announced: a duplicate it refused gets no
``after_task_publish`` signal and no ``task-sent`` event.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kombu.utils.imports import symbol_by_name

from .. import runtime
from ..header import HEADER, GateHeader
from ..keys import member_for, split_member
from ..task import DedupTask
from ..transports import redis as gated_redis
from . import mismatch
from .call import carries_continuation
from .delay import delay_seconds
from .ticket import Ticket, open_ticket

logger = logging.getLogger("celery_dedup")


def _add_gate_header(app: Any, name: str, headers: dict[str, Any], body: Any) -> None:
    """Give a message published by name the ``dedup`` header its task would have added."""
    task = app.tasks.get(name)
    if not isinstance(task, DedupTask) or not task.dedup_policy.mode.gates_enqueue:
        return
    if not runtime.runtime_for(app).atomic:
        logger.warning("%s published by name on a non-Redis broker: not gated", name)
        return
    policy = task.dedup_policy
    try:
        args, kwargs = body[0], body[1]
        business_key, fingerprint = policy.spec.key_and_fingerprint(args, kwargs, fingerprint=policy.compares_arguments)
    except Exception:
        logger.exception("could not derive the key of %s published by name: not gated", name)
        return
    delay = delay_seconds(None, headers.get("eta"))  # send_task(countdown=) arrives as an ETA
    embed = body[2] if len(body) > 2 and isinstance(body[2], dict) else {}
    follows = bool(headers.get("group")) or carries_continuation(embed.get("callbacks"), embed.get("errbacks"), embed)
    member = member_for(task.name, business_key)
    headers[HEADER] = task.dedup_gate_header(member, delay, follows=follows, fingerprint=fingerprint).encode()


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
        by_name = HEADER not in message.headers and HEADER not in given
        if by_name:
            _add_gate_header(app, name, message.headers, message.body)
        gate = GateHeader.decode(given if HEADER in given else message.headers)
        if gate is None:  # not keyed, or published ungated (fail_open)
            return send(producer, name, message, **options)
        with open_ticket(gate.nonce) as ticket:
            try:
                return send(_GatedProducer(producer, ticket), name, message, **options)
            except _Refused:
                task, outcome = app.tasks.get(name), ticket.outcome
                # apply_async answers its own calls; a publish by name only warns.
                if by_name and isinstance(task, DedupTask) and outcome is not None:
                    mismatch.check(task, split_member(gate.member)[1], gate.fingerprint, outcome, {}, raises=False)
                return None

    return send_task_message


class GatedAMQP:
    """Mixed into the app's AMQP class: its message sender is the gated one, its connections use the gated transports.

    Celery builds the sender, reading the publish settings
    (``task_publish_retry_policy``, ``task_default_routing_key``, ...), at
    the first publish; so does this, so settings changed after ``install``
    apply as they would without celery-dedup. Celery makes every broker
    connection of the app with the class's ``Connection``.
    """

    app: Any
    Connection = gated_redis.Connection

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
    """Gate ``app.send_task`` by name, for this app's DedupTasks, and its broker connections (idempotent).

    Through ``app.amqp_cls``, Celery's hook for its AMQP class. An AMQP object
    the app made already (it published before ``install``) is dropped, and
    Celery makes a gated one at its next use.
    """
    base = symbol_by_name(app.amqp_cls)
    if issubclass(base, GatedAMQP):
        return
    app.amqp_cls = _gated_class(base)
    app.__dict__.pop("amqp", None)
