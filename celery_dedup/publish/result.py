"""DedupResult: the result a keyed call returns, saying whether the call was a duplicate."""

from __future__ import annotations

import weakref
from typing import Any

import celery
from celery.result import AsyncResult

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
