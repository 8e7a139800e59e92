"""Worker bootsteps: the background services a worker runs for celery-dedup.

Both run in the worker's main process only. The reaper cleans up after
crashes on the worker's timer, and puts back the messages of runs whose
worker died on this machine (at start-up too, see ``recovery``); the
dispatcher pushes debounced runs when they are due, on a thread of its own
because how long it sleeps depends on when the next run is due.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import redis
from celery import bootsteps
from kombu.exceptions import OperationalError

from .. import runtime
from ..exceptions import DedupConfigError, store_failure
from ..task import DedupTask
from . import recovery

logger = logging.getLogger("celery_dedup")


class ReaperStep(bootsteps.StartStopStep):
    """Runs the reaper on the worker's timer every ``dedup_reap_interval`` seconds (0: never).

    Built in the worker's main process before its pool forks, it takes the
    token of this incarnation of the worker, which every delivery records.
    At start-up, and after every reaper pass, it puts back the messages of
    started runs whose worker died on this machine (killed whole): see
    :mod:`celery_dedup.worker.recovery`. The start-up pass runs even with the
    reaper off.
    """

    requires = ("celery.worker.components:Timer",)

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self.tref: Any = None
        self.recovery: Any = None
        recovery.incarnate()

    def start(self, worker: Any) -> None:
        # The store's format, before this worker takes a message: a newer one stops it here.
        runtime.store_for(worker.app).check_format(worker.app.main)
        self.recovery = worker.timer.call_after(0.0, self.recover, (worker.app,), priority=10)
        interval = runtime.config_for(worker.app).reap_interval
        if interval > 0:
            self.tref = worker.timer.call_repeatedly(interval, self.reap, (worker.app,), priority=10)

    def stop(self, worker: Any) -> None:
        for entry in (self.tref, self.recovery):
            if entry is not None:
                entry.cancel()
        self.tref = self.recovery = None

    def terminate(self, worker: Any) -> None:
        # A terminating worker calls this, not stop; the base class's version
        # only stops services kept in ``obj``.
        self.stop(worker)

    def reap(self, app: Any) -> None:
        try:
            report = runtime.reap(app)
            runtime.flush_counts(app)
        except redis.RedisError as exc:
            logger.warning("reaper pass failed: %s", store_failure(exc))
            return
        self.recover(app)
        if any((report.released, report.lost, report.stale, report.vanished)):
            logger.info(
                "reaper: %d expired holds released, %d dead runs and %d lost messages marked lost, "
                "%d stale index entries",
                report.released,
                report.lost,
                report.vanished,
                report.stale,
            )

    def recover(self, app: Any) -> None:
        try:
            restored = recovery.recover(app, runtime.store_for(app))
        except (redis.RedisError, OperationalError, OSError) as exc:
            logger.warning("recovery pass failed: %s", exc)
            return
        if restored:
            logger.info("recovery: %d messages of runs whose process died put back in their queues", restored)


class DispatchStep(bootsteps.StartStopStep):
    """Pushes parked debounced runs once due; started only if the app has a debounced task.

    Every worker may run one: the dispatch script pushes each run once,
    whichever worker calls it first. It sleeps until the next run is due, at
    most ``dedup_dispatch_interval`` seconds (a new burst may begin meanwhile).
    """

    #: Runs pushed per script call.
    BATCH = 100
    # Start after the pool has forked its children: a child forked while this
    # thread held the import lock (its first script call imports lazily) would
    # wait for that lock forever.
    requires = ("celery.worker.components:Pool",)

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self.thread: threading.Thread | None = None
        self.stopped = threading.Event()

    def start(self, worker: Any) -> None:
        app = worker.app
        debounced = [
            task.name for task in app.tasks.values() if isinstance(task, DedupTask) and task.dedup_policy.mode.parks
        ]
        if not debounced:
            return
        runtime.is_atomic(app)  # refuses an app never installed
        why = runtime.not_atomic_reason(app)
        if why is not None:
            raise DedupConfigError(
                "dedup_mode",
                "debounce",
                f"needs its keys in the Redis broker's database, but {why} (debounced tasks: "
                f"{', '.join(sorted(debounced))})",
            )
        self.stopped.clear()
        self.thread = threading.Thread(target=self.run, args=(app,), name="celery-dedup-dispatch", daemon=True)
        self.thread.start()

    def stop(self, worker: Any) -> None:
        self.stopped.set()
        if self.thread is not None:
            self.thread.join(timeout=5)
            self.thread = None

    def terminate(self, worker: Any) -> None:
        self.stop(worker)

    def run(self, app: Any) -> None:
        store = runtime.store_for(app)
        interval = runtime.config_for(app).dispatch_interval
        reachable = True
        while not self.stopped.is_set():
            try:
                dispatched = store.dispatch(limit=self.BATCH)
            except redis.RedisError as exc:
                if reachable:
                    logger.warning("dispatcher failed: %s", store_failure(exc))
                reachable = False
                self.stopped.wait(max(interval, 1.0))
                continue
            if not reachable:
                logger.info("dispatcher works again")
                reachable = True
            if dispatched.pushed:
                logger.debug("dispatcher pushed %d debounced runs", dispatched.pushed)
            if dispatched.pushed == self.BATCH:
                continue
            wait = interval if dispatched.next_due is None else min(dispatched.next_due, interval)
            self.stopped.wait(wait)
