"""The ``dedup`` header of a gated message: written by publishers, read by the gate and by the worker.

Publishers add it (``apply_async``, bulk publishing, a publish by name); the
gate in the broker transport holds the key it names, and the worker's guard
and limits read it back from the delivery.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

HEADER = "dedup"
#: ``dedup`` header value of a keyed task published ungated (``fail_open``).
UNGATED = "ungated"


#: The ``apply_async`` option by which ``Delivery.defer`` marks its publish a deferred copy.
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
    #: A deferred copy of a run (see ``Delivery.defer``): it continues its run and
    #: leaves the key as the run left it, free if freed as the run started.
    defers: bool = False
    #: The call carries something to continue or resolve (its id in a group
    #: or chord, callbacks, a chain): as a duplicate it becomes a follower of
    #: the accepted run, at most this many per run; 0 for any other call.
    follow: int = 0
    #: The two-phase gate held the key before publishing (a broker apart from
    #: the store): a gated transport publishes the message as it is.
    held: bool = False
    #: The call's arguments fingerprint (``keys.arguments_fingerprint``): a new run keeps it, a duplicate
    #: is compared with it (``dedup_on_mismatch``); "" for a call that is not compared.
    fingerprint: str = ""

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
        if self.fingerprint:
            encoded["fp"] = self.fingerprint
        if self.debounce or self.latest:  # what decoding it gives back is this very header
            globals()["_last_decoded"] = (encoded, self)
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
            str(raw.get("fp", "")),
        )


#: The header mapping decoded (or encoded) last and what it decodes to. Headers are never changed
#: in place (a changed header is a new mapping: see ``GateHeader.encode``), so identity suffices.
_last_decoded: tuple[Mapping[str, Any] | None, GateHeader | None] = (None, None)
