"""When a key is held (modes) and what a duplicate caller gets (conflict policies).

Each mode is a small class answering the same questions; the worker-side
hooks and the gate ask them instead of branching on mode names.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import ClassVar

#: Task options every mode honours: which mode, and the key that names the unit of work
#: (with ``off``: the default limit group).
_ANY = frozenset({"dedup_mode", "dedup_key"})
#: Options of the enqueue gate: how long a key is held, what a duplicate caller gets, and what one
#: whose arguments differ from the accepted run's does.
_GATE = frozenset({"dedup_ttl", "dedup_on_duplicate", "dedup_on_mismatch"})
#: Options of the execution guard (the lock, and a delivery that finds it taken).
_GUARD = frozenset({"dedup_lock_ttl", "dedup_on_locked"})


class Mode:
    """Base mode: the key is taken at enqueue and dropped at the final ending."""

    name: ClassVar[str]
    #: Whether ``apply_async`` runs the enqueue gate at all.
    gates_enqueue: ClassVar[bool] = True
    #: Keep the key after success until its TTL runs out (an idempotency window).
    holds_after_success: ClassVar[bool] = False
    #: What happens to the key when the body starts (see ``start.lua``): ``lock``
    #: keeps it as long as the execution lock lives, so a crashed run frees it
    #: within one lock TTL; ``release`` drops it; ``window`` keeps the enqueue
    #: deadline if that is later.
    key_on_start: ClassVar[str] = "lock"
    #: Whether the mode is timed by ``dedup_window`` (and refuses a task without one).
    windowed: ClassVar[bool] = False
    #: Whether a new run's message is parked until its burst goes quiet (see ``dispatch.lua``).
    parks: ClassVar[bool] = False
    #: ``dedup_on_locked`` for tasks of this mode that do not set it (None: the app's setting).
    on_locked: ClassVar[str | None] = None
    #: Whether deliveries pass the execution guard (lock, status record).
    guards: ClassVar[bool] = True
    #: The task options this mode honours; a task of this mode setting any other is refused
    #: (the one statement of which option applies to which mode: code, docs and tests follow it).
    options: ClassVar[frozenset[str]] = _ANY | _GATE | _GUARD


class UntilExecuted(Mode):
    """Held from enqueue until success or final failure (the default)."""

    name = "until_executed"


class UntilExecuting(Mode):
    """Held from enqueue until the body starts; a new call may queue while it runs."""

    name = "until_executing"
    key_on_start = "release"


class UntilExpired(Mode):
    """Held for the whole TTL, even after success: calls inside it are duplicates."""

    name = "until_expired"
    holds_after_success = True
    key_on_start = "window"


class WhileExecuting(Mode):
    """No enqueue gate; only concurrent execution is prevented."""

    name = "while_executing"
    gates_enqueue = False
    options = _ANY | _GUARD


class Debounce(Mode):
    """Calls inside ``dedup_window`` of each other collapse into one run, due once they stop.

    The first call of a burst is parked, not queued; later calls push its due
    time back (never past ``dedup_max_wait`` after the first) and, with
    ``dedup_debounce="latest"``, replace the arguments it will run with. The
    key is released when the run starts, so a call during the run opens the
    next burst, and that run waits for this one's lock (``reschedule``).
    """

    name = "debounce"
    key_on_start = "release"
    windowed = True
    parks = True
    on_locked = "reschedule"
    options = _ANY | _GATE | _GUARD | {"dedup_window", "dedup_max_wait", "dedup_debounce"}


class Throttle(Mode):
    """The first call of a ``dedup_window`` runs; later calls in it get that run."""

    name = "throttle"
    holds_after_success = True
    key_on_start = "window"
    windowed = True
    #: The window is the hold: no ``dedup_ttl``.
    options = _ANY | {"dedup_on_duplicate", "dedup_on_mismatch", "dedup_window"} | _GUARD


class Off(Mode):
    """No deduplication at all: no gate, no lock, no record; only the task's limits (``limit_*``) apply."""

    name = "off"
    gates_enqueue = False
    guards = False
    #: With limits, the lock TTL is the lease of the run's slot in its group.
    options = _ANY | {"dedup_lock_ttl"}


MODES: MappingProxyType[str, type[Mode]] = MappingProxyType(
    {mode.name: mode for mode in (UntilExecuted, UntilExecuting, UntilExpired, WhileExecuting, Debounce, Throttle, Off)}
)

#: Which arguments a debounced run executes with: the newest call's or the first's.
DEBOUNCE = frozenset({"latest", "first"})

#: What a duplicate caller gets.
#: ``return_existing``: an AsyncResult of the accepted task, marked deduplicated.
#: ``raise``: DuplicateTaskError carrying the key and the accepted id.
#: ``drop``: a marked AsyncResult, and an INFO log line saying the call was dropped.
ON_DUPLICATE = frozenset({"return_existing", "raise", "drop"})

#: What a duplicate call whose arguments differ from the accepted run's does (its fingerprint differs).
#: ``warn``: a WARNING naming both fingerprints, counted (``mismatched``) in the key's record and the stats;
#: ``raise``: counted as well, and DedupArgumentsMismatch (a DuplicateTaskError) instead of the answer;
#: ``ignore``: nothing is compared.
ON_MISMATCH = frozenset({"warn", "raise", "ignore"})

#: What a run does when another run of its key holds the execution lock.
#: ``skip``: acknowledge and record it as skipped; ``reschedule``: publish it
#: again to arrive when that lock would have expired.
ON_LOCKED = frozenset({"skip", "reschedule"})

#: What a step (``dedup_once``) whose earlier executor died inside it does.
#: ``retry``: call its function again, with the same idempotency key;
#: ``raise``: raise DedupStepInDoubt and leave the step marked for an operator.
ON_DOUBT = frozenset({"retry", "raise"})

#: How long a step is remembered (``dedup_once``): ``run``: for its run (every delivery,
#: retry and redelivery of it); ``key``: for the key's record, across its runs.
STEP_SCOPES = frozenset({"run", "key"})

#: What a publish does when the dedup store cannot be reached.
ON_REDIS_ERROR = frozenset({"fail_closed", "fail_open"})
