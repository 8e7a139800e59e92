"""The contract between a publisher and the gate: the message header and the outcome.

A gated message carries one header, ``dedup``, saying what to hold. The gate
runs inside the broker transport, whose return value Celery drops and whose
exceptions kombu may retry, so the gate reports what it did through a
:class:`Ticket` held in a context variable that ``apply_async`` opened before
publishing and reads afterwards.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from kombu import serialization
from kombu.utils.json import dumps, loads

HEADER = "dedup"
#: ``dedup`` header value of a keyed task published ungated (``fail_open``).
UNGATED = "ungated"


#: The ``apply_async`` option by which ``guard.defer`` marks its publish a deferred copy.
DEFERS_OPTION = "dedup_defers"


@dataclass(frozen=True)
class GateHeader:
    """What the gate holds for one message; travels in the message's ``dedup`` header.

    The message carries everything the gate and the worker need (prefix,
    TTLs), so a transport needs no access to the publishing app's settings.
    """

    prefix: str
    member: str
    nonce: str
    hold_ms: int
    grace_ms: int
    history: int = 10
    record_args: bool = True
    #: Debounce only: quiet time before the run is due, and the cap on postponing it.
    window_ms: int = 0
    max_wait_ms: int = 0
    #: Debounce only: a later call's arguments replace the pending ones.
    latest: bool = True
    #: This publish continues its run (``Task.retry``, a deferred copy, a
    #: replacement under the same key) rather than being a call of its own.
    continues: bool = False
    #: A deferred copy of a run (see ``guard.defer``): it continues its run and
    #: leaves the key as the run left it, free if freed as the run started.
    defers: bool = False
    #: The call carries something to continue or resolve (its id in a group
    #: or chord, callbacks, a chain): as a duplicate it becomes a follower of
    #: the accepted run, at most this many per run; 0 for any other call.
    follow: int = 0
    #: The two-phase gate held the key before publishing (a broker apart from
    #: the store): a gated transport publishes the message as it is.
    held: bool = False

    @property
    def debounce(self) -> bool:
        return self.window_ms > 0

    def encode(self) -> dict[str, Any]:
        encoded: dict[str, Any] = {
            "prefix": self.prefix,
            "member": self.member,
            "nonce": self.nonce,
            "hold_ms": self.hold_ms,
            "grace_ms": self.grace_ms,
            "history": self.history,
            "record_args": self.record_args,
        }
        if self.debounce:
            encoded["debounce"] = [self.window_ms, self.max_wait_ms, self.latest]
        if self.continues:
            encoded["continues"] = True
        if self.defers:
            encoded["defers"] = True
        if self.follow:
            encoded["follow"] = self.follow
        if self.held:
            encoded["held"] = True
        return encoded

    @classmethod
    def decode(cls, headers: Mapping[str, Any] | None) -> GateHeader | None:
        """The header of a message or request, or None when it carries none."""
        raw = (headers or {}).get(HEADER)
        if not isinstance(raw, Mapping) or "member" not in raw:
            return None
        last = _last_decoded
        if last[0] is raw:
            # One publish decodes its header at every layer it passes (task, sender, producer, transport).
            return last[1]
        gate = cls._decode(raw)
        globals()["_last_decoded"] = (raw, gate)  # a strong reference: its id cannot be reused meanwhile
        return gate

    @classmethod
    def _decode(cls, raw: Mapping[str, Any]) -> GateHeader:
        window_ms, max_wait_ms, latest = raw.get("debounce") or (0, 0, True)
        return cls(
            str(raw["prefix"]),
            str(raw["member"]),
            str(raw["nonce"]),
            int(raw["hold_ms"]),
            int(raw["grace_ms"]),
            int(raw.get("history", 10)),
            bool(raw.get("record_args", True)),
            int(window_ms),
            int(max_wait_ms),
            bool(latest),
            bool(raw.get("continues", False)),
            bool(raw.get("defers", False)),
            int(raw.get("follow", 0)),
            bool(raw.get("held", False)),
        )


#: The header mapping decoded last and what it decoded to. Headers are never changed in
#: place (a changed header is a new mapping: see ``GateHeader.encode``), so identity suffices.
_last_decoded: tuple[Mapping[str, Any] | None, GateHeader | None] = (None, None)


def message_payload(message: Mapping[str, Any]) -> str:
    """A published kombu message's body as a status record keeps it (debounce: the run's arguments)."""
    properties = message.get("properties") or {}
    return str(
        dumps(
            [
                message["body"],
                properties.get("body_encoding"),
                message.get("content-type"),
                message.get("content-encoding"),
            ]
        )
    )


def _encoded(value: Any, serializer: str) -> str:
    """``value`` serialized, as the JSON ``[base64 body, "base64", content type, content encoding]``."""
    content_type, content_encoding, data = serialization.dumps(value, serializer=serializer)
    raw = data if isinstance(data, bytes) else data.encode(content_encoding or "utf-8")
    return str(dumps([base64.b64encode(raw).decode("ascii"), "base64", content_type, content_encoding]))


def _decoded(payload: str, accept_content: Any) -> Any:
    """The value of a payload kept by :func:`_encoded` or :func:`message_payload`, if its type is accepted."""
    body, body_encoding, content_type, content_encoding = loads(payload)
    data = base64.b64decode(body) if body_encoding == "base64" else body
    accept = serialization.prepare_accept_content(accept_content)
    return serialization.loads(data, content_type, content_encoding, accept=accept)


def call_payload(app: Any, serializer: str | None, args: Any, kwargs: Any) -> str:
    """The payload of a call, serialized as its message body would be, to re-enqueue it later."""
    return _encoded([list(args or ()), dict(kwargs or {}), {}], serializer or app.conf.task_serializer)


def decode_payload(app: Any, payload: str) -> tuple[list[Any], dict[str, Any]]:
    """``(args, kwargs)`` of a payload kept by :func:`message_payload` or :func:`call_payload`.

    Only content types the app accepts (``accept_content``) are decoded.
    """
    decoded = _decoded(payload, app.conf.accept_content)
    if isinstance(decoded, Mapping):  # task message protocol 1
        return list(decoded.get("args") or ()), dict(decoded.get("kwargs") or {})
    return list(decoded[0]), dict(decoded[1])


def result_payload(app: Any, value: Any) -> str:
    """A run's return value serialized as its result would be (``result_serializer``), for its followers."""
    return _encoded(value, app.conf.result_serializer)


def decode_result(app: Any, payload: str) -> Any:
    """The return value kept by :func:`result_payload` (``result_accept_content``, else ``accept_content``)."""
    return _decoded(payload, app.conf.result_accept_content or app.conf.accept_content)


@dataclass(frozen=True)
class Outcome:
    """What the gate decided: ``task_id`` is the accepted run's id either way."""

    accepted: bool
    task_id: str
    #: Not accepted, but joined the accepted run's burst (debounce): its
    #: arguments may be the ones that run.
    collapsed: bool = False
    #: Not accepted, but parked as a follower of the accepted run: its own
    #: message is delivered once that run ends, and resolves as it ended.
    followed: bool = False
    #: Not accepted, and not parked: the run has ``dedup_max_followers`` already.
    refused: bool = False


class Ticket:
    """One publish's slot for the gate's outcome."""

    __slots__ = ("nonce", "outcome", "sent")

    def __init__(self, nonce: str) -> None:
        self.nonce = nonce
        self.outcome: Outcome | None = None
        #: The broker took the message (and the gate, if any, accepted it): an
        #: error raised after that is no failed publish.
        self.sent = False


_ticket: ContextVar[Ticket | None] = ContextVar("celery_dedup_ticket", default=None)
_last: ContextVar[Outcome | None] = ContextVar("celery_dedup_last_outcome", default=None)


@contextlib.contextmanager
def open_ticket(nonce: str) -> Iterator[Ticket]:
    """Open a slot for the outcome of the publish carrying ``nonce`` (the open one, if it is that publish's)."""
    current = _ticket.get()
    if current is not None and current.nonce == nonce:
        yield current
        return
    ticket = Ticket(nonce)
    token = _ticket.set(ticket)
    try:
        yield ticket
    finally:
        _ticket.reset(token)


def report(nonce: str, outcome: Outcome) -> None:
    """Called by the gate: hand the outcome to the publisher waiting for it."""
    ticket = _ticket.get()
    if ticket is not None and ticket.nonce == nonce:
        ticket.outcome = outcome
    _last.set(outcome)


def last_outcome() -> Outcome | None:
    """The gate's outcome for the latest gated publish in this context.

    For callers that publish without ``DedupTask.apply_async`` (``app.send_task``
    by name): ``Outcome.task_id`` is the id of the run the key belongs to.
    """
    return _last.get()
