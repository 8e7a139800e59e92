"""The contract between a publisher and the gate: the message header and the outcome.

A gated message carries one header, ``dedup``, saying what to hold. The gate
runs inside the broker transport, whose return value Celery drops and whose
exceptions kombu may retry, so the gate reports what it did through a
:class:`Ticket` held in a context variable that ``apply_async`` opened before
publishing and reads afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

HEADER = "dedup"
#: ``dedup`` header value of a keyed task published ungated (``fail_open``).
UNGATED = "ungated"


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

    def encode(self) -> dict[str, Any]:
        return {
            "prefix": self.prefix,
            "member": self.member,
            "nonce": self.nonce,
            "hold_ms": self.hold_ms,
            "grace_ms": self.grace_ms,
            "history": self.history,
            "record_args": self.record_args,
        }

    @classmethod
    def decode(cls, headers: Mapping[str, Any] | None) -> GateHeader | None:
        """The header of a message or request, or None when it carries none."""
        raw = (headers or {}).get(HEADER)
        if not isinstance(raw, Mapping) or "member" not in raw:
            return None
        return cls(
            str(raw["prefix"]),
            str(raw["member"]),
            str(raw["nonce"]),
            int(raw["hold_ms"]),
            int(raw["grace_ms"]),
            int(raw.get("history", 10)),
            bool(raw.get("record_args", True)),
        )


@dataclass(frozen=True)
class Outcome:
    """What the gate decided: ``task_id`` is the accepted run's id either way."""

    accepted: bool
    task_id: str


class Ticket:
    """One publish's slot for the gate's outcome."""

    __slots__ = ("nonce", "outcome")

    def __init__(self, nonce: str) -> None:
        self.nonce = nonce
        self.outcome: Outcome | None = None


_ticket: ContextVar[Ticket | None] = ContextVar("celery_dedup_ticket", default=None)
_last: ContextVar[Outcome | None] = ContextVar("celery_dedup_last_outcome", default=None)


@contextlib.contextmanager
def open_ticket(nonce: str) -> Iterator[Ticket]:
    """Open a slot for the outcome of the publish carrying ``nonce``."""
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
