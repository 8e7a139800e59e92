"""What the execution guard and bulk publishing know of a keyed task.

They sit below :class:`~celery_dedup.DedupTask`, which only delegates to
them, so they never import it: they take a :class:`KeyedTask`, the part of a
DedupTask they call, and its resolved :class:`TaskPolicy`.
"""

from __future__ import annotations

import datetime
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import celery
from celery.result import AsyncResult

from .keys import KeySpec

if TYPE_CHECKING:
    from .gate import GateHeader
    from .limits import LimitPolicy
    from .modes import Mode


@dataclass(frozen=True)
class TaskPolicy:
    """One task's options, resolved against the app's settings and validated."""

    spec: KeySpec
    mode: type[Mode]
    ttl: float
    on_duplicate: str
    lock_ttl: float
    on_locked: str
    #: Windowed modes only (debounce, throttle): seconds.
    window: float | None = None
    #: Debounce only: the longest a burst postpones its run, seconds.
    max_wait: float | None = None
    #: Debounce only: run with the ``latest`` call's arguments or the ``first``.
    debounce: str = "latest"
    #: Per-group concurrency and rate limits (``limit_*`` options); None: none.
    limit: LimitPolicy | None = None


#: Celery < 5.7 (celery#4925): an async result backend keeps one result object
#: per task id. A second object of the id (a duplicate's result, the accepted
#: call's being the first) is never told the run ended, and dropping it stops
#: the wait of the first one (a group's member, say). Celery 5.7 keeps every one.
_ONE_WAITER_PER_ID = tuple(celery.VERSION[:2]) < (5, 7)


class DedupResult(AsyncResult):  # type: ignore[type-arg]
    """An AsyncResult that also says whether the call returning it was a duplicate."""

    #: True when this call published nothing and is answered with the accepted run.
    deduplicated: bool = False

    if _ONE_WAITER_PER_ID:

        def then(self, callback: Any, on_error: Any = None, weak: bool = False) -> Any:
            self._follow_the_waiter()
            return super().then(callback, on_error, weak)

        def get(self, *args: Any, **kwargs: Any) -> Any:
            self._follow_the_waiter()
            return super().get(*args, **kwargs)

        def __del__(self) -> None:
            if self._waiter() is None:
                super().__del__()

        def _waiter(self) -> AsyncResult | None:  # type: ignore[type-arg]
            """The other result object the backend waits with for this id, if any."""
            for waiting in getattr(self.backend, "_pending_results", None) or ():
                other = waiting.get(self.id)
                if other is not None and other is not self:
                    return other  # type: ignore[no-any-return]
            return None

        def _follow_the_waiter(self) -> None:
            """Be resolved when the object the backend waits with is (the backend would not tell this one)."""
            other = self._waiter()
            if other is not None and self._cache is None:  # type: ignore[attr-defined]  # Celery's own state
                me = weakref.ref(self)  # the waiter must not keep this object alive

                def resolve(_: Any) -> None:
                    result = me()
                    if result is not None:
                        result._get_task_meta()  # type: ignore[attr-defined]  # fetches, caches, fires on_ready

                other.on_ready.then(resolve)


class KeyedTask(Protocol):
    """The part of a DedupTask the guard and bulk publishing call (Celery's Task, plus the dedup options)."""

    @property
    def name(self) -> str: ...

    @property
    def app(self) -> Any: ...

    @property
    def serializer(self) -> str: ...

    @property
    def ignore_result(self) -> bool: ...

    @property
    def request(self) -> Any: ...

    @property
    def dedup_policy(self) -> TaskPolicy: ...

    def dedup_gate_header(self, member: str, delay: float = 0.0, *, continues: bool = False) -> GateHeader: ...

    def AsyncResult(self, task_id: str, **kwargs: Any) -> DedupResult: ...

    def apply_async(self, args: Any = None, kwargs: Any = None, *rest: Any, **options: Any) -> DedupResult: ...

    def retry(self, *args: Any, **kwargs: Any) -> Any: ...

    def signature_from_request(self, request: Any = None, *rest: Any, **extra: Any) -> Any: ...

    def _marked(self, existing_id: str) -> DedupResult: ...


def delay_seconds(countdown: Any, eta: Any) -> float:
    """How far in the future a countdown or ETA puts the run (the key is held that much longer)."""
    if countdown:
        return max(float(countdown), 0.0)
    if eta is None:
        return 0.0
    if isinstance(eta, str):
        eta = datetime.datetime.fromisoformat(eta)
    now = datetime.datetime.now(eta.tzinfo or None)
    return max(float((eta - now).total_seconds()), 0.0)
