"""A run's ending without waiting for it, or with its result in one round trip.

Where no result is stored and nothing between the body and the end of the
task's trace publishes anything (no callbacks, chain, group or chord), a
success is recorded without waiting: the finish script is written to the
store as the body returns, and its reply read when the trace ends
(``task_postrun``), before Celery acknowledges the message; the store works
on it while Celery finishes the trace. Any store call this thread makes
meanwhile reads that reply first (``store.scripts``).

Celery stores a task's result after its body returns; the guard records the
run's ending before that, so a caller who sees the result and calls again
finds the key released. When the result goes to Celery's Redis backend on the
store's own server and database, the guard leaves the ending to the result
write instead: the finish script records the ending and then writes and
publishes the result, in that order, in one script (one round trip, not two).

A deferred ending that no result write picks up (the result is not stored
after all, or the backend failed before writing it) is recorded when the
task's trace ends (``task_postrun``), as it would have been without deferral;
the run's lock is renewed until then.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from celery import signals
from celery.backends.base import DisabledBackend
from celery.backends.redis import RedisBackend

from ..store.scripts import read_sent
from ..store.store import BackendResult, DedupStore


class Ending(Protocol):
    """Records a deferred ending, with the backend's result write (None: no result is written).

    The result's ``written`` says whether it went out with it.
    """

    def __call__(self, backend_result: BackendResult | None, *, deferred: bool) -> None: ...


class _Deferred(threading.local):
    def __init__(self) -> None:
        #: Deferred endings of this thread, by task id.
        self.endings: dict[str, Ending] = {}


_deferred = _Deferred()


class ResultBackend(RedisBackend):
    """Celery's Redis result backend, writing a run's result in the script that records its deferred ending.

    Only apps given to ``install`` use it (:func:`use_for`); others keep Celery's own.
    """

    expires: Any  # Celery's result expiry in seconds (celery-types leaves it out)

    def _set(self, key: Any, value: Any, expires: Any = None) -> None:
        """Celery's write, recording a deferred ending in the same script when the key is its run's."""
        endings = _deferred.endings
        if endings:
            prefix = (
                bytes(self.task_keyprefix)
                if isinstance(self.task_keyprefix, bytes)
                else str(self.task_keyprefix).encode()
            )
            name = key if isinstance(key, bytes) else str(key).encode()
            task_id = name[len(prefix) :].decode() if name.startswith(prefix) else None
            ending = endings.pop(task_id, None) if task_id is not None else None
            if ending is not None:
                result = BackendResult(key, value, int((self.expires if expires is None else expires) or 0))
                ending(result, deferred=True)
                if result.written:
                    return
        super()._set(key, value, expires)  # type: ignore[misc]  # celery-types leaves it out


#: How a result backend setting names Celery's Redis backend (``redis+socket://`` is ``redis`` too).
REDIS_BACKEND_NAMES = ("redis", "rediss", "celery.backends.redis:RedisBackend", "celery.backends.redis.RedisBackend")


def use_for(app: Any) -> None:
    """Make ``app`` resolve Celery's Redis backend to :class:`ResultBackend`, through its loader's backend aliases.

    A name the app's loader maps already (``override_backends``) keeps its
    backend. The backend the app made before (it published before ``install``)
    is dropped, and Celery makes another at its next use.
    """
    loader = app.loader
    path = f"{ResultBackend.__module__}:{ResultBackend.__qualname__}"
    aliases = dict(loader.override_backends)
    for name in REDIS_BACKEND_NAMES:
        aliases.setdefault(name, path)
    loader.override_backends = aliases
    made = app._backend
    if made is not None and not isinstance(made, ResultBackend):
        app._backend_cache = None
        vars(app._local).pop("backend", None)


def joins_result_write(task: Any, store: DedupStore) -> bool:
    """Whether the current request's result goes to this store's server, written by :class:`ResultBackend`.

    Only for a result Celery will store (not eager, not ignored) and only when
    nothing is published before it (callbacks, a chain: their calls must see
    the key released), on a single server whose host, port, database and user
    are the store's.
    """
    request = task.request
    if request.is_eager or request.callbacks or request.chain:
        return False
    ignore = getattr(request, "ignore_result", None)
    if task.ignore_result if ignore is None else ignore:
        return False
    backend = task.backend
    if not isinstance(backend, ResultBackend):
        return False
    if store.schema.shards > 1 or store.wait_replicas:
        return False
    ours = store.client.connection_pool.connection_kwargs
    theirs = backend.client.connection_pool.connection_kwargs
    located = ours.get("host") is not None or ours.get("path") is not None
    # The same user too: the script writes the result with the store's permissions.
    return located and all(ours.get(k) == theirs.get(k) for k in ("host", "port", "path", "db", "username"))


def awaits_nothing(task: Any, store: DedupStore) -> bool:
    """Whether a success of the current request may be recorded without waiting for the store's reply.

    Only where nothing between the body and the end of the task's trace shows
    the ending to anyone else: no result is stored (ignored, or no backend),
    nothing is published (callbacks, a chain, a group or chord), not eager;
    and the store can send without waiting (a single server, no replicas to
    wait for). The reply is read when the trace ends (:func:`settle_unwritten`),
    before Celery acknowledges the message, or before this thread's next
    store call, whichever comes first.
    """
    request = task.request
    if request.is_eager or request.callbacks or request.chain or request.chord or request.group:
        return False
    if not store.sends:
        return False
    ignore = getattr(request, "ignore_result", None)
    return bool(task.ignore_result if ignore is None else ignore) or isinstance(task.backend, DisabledBackend)


def defer(task: Any, store: DedupStore, ending: Ending) -> bool:
    """Leave the current run's ending to its result write (or to the end of its trace), if that joins it.

    Returns whether it was deferred; the lock stays renewed meanwhile.
    """
    task_id = task.request.id
    if task_id is None or not joins_result_write(task, store):
        return False
    _deferred.endings[task_id] = ending
    return True


def settle_unwritten(task_id: str | None = None, **_: Any) -> None:
    """``task_postrun``: record a deferred ending no result write picked up, and read the replies of the
    endings this thread sent (:meth:`DedupStore.send_finish`). One receiver: it runs for every task."""
    ending = _deferred.endings.pop(task_id, None) if task_id is not None else None
    if ending is not None:
        ending(None, deferred=True)
    read_sent()


def connect() -> None:
    """Connect the receiver once (idempotent)."""
    signals.task_postrun.connect(settle_unwritten, weak=False, dispatch_uid="celery_dedup.results.settle_unwritten")
