"""How the gate reports its outcome to the publisher that is waiting for it.

The gate runs inside the broker transport, whose return value Celery drops
and whose exceptions kombu may retry, so the gate reports what it did through
a :class:`Ticket` held in a context variable that ``apply_async`` opened
before publishing and reads afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

from ..store.store import Outcome


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
