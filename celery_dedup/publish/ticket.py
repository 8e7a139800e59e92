"""How the gate reports its outcome to the publisher that is waiting for it.

The gate runs inside the broker transport, whose return value Celery drops
and whose exceptions kombu may retry, so the gate reports what it did through
a :class:`Ticket` held in a context variable that ``apply_async`` opened
before publishing and reads afterwards.
"""

from __future__ import annotations

from contextvars import ContextVar, Token

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


class open_ticket:  # used as a function: ``with open_ticket(nonce) as ticket``
    """Open a slot for the outcome of the publish carrying ``nonce`` (the open one, if it is that publish's).

    A class rather than a generator: every gated publish opens one, some twice.
    """

    __slots__ = ("_reset", "nonce")

    def __init__(self, nonce: str) -> None:
        self.nonce = nonce
        self._reset: Token[Ticket | None] | None = None

    def __enter__(self) -> Ticket:
        current = _ticket.get()
        if current is not None and current.nonce == self.nonce:
            return current
        ticket = Ticket(self.nonce)
        self._reset = _ticket.set(ticket)
        return ticket

    def __exit__(self, *_: object) -> None:
        if self._reset is not None:
            _ticket.reset(self._reset)
            self._reset = None


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
