"""Status records made the way real runs make them: the gate, then the guard's start and finish scripts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from celery import Celery

from celery_dedup import DedupTask, runtime
from celery_dedup.keys import member_for
from celery_dedup.worker.delivery import kept_payload
from celery_dedup.worker.lock import new_token


@dataclass(frozen=True)
class Run:
    """One accepted run of a key: its member, task id and (once started) lock token."""

    member: str
    task_id: str
    token: str = ""


def keyed_tasks(app: Celery) -> tuple[Any, Any]:
    """Two DedupTasks keyed by order id: ``shop.charge`` and ``shop.refund``."""

    @app.task(name="shop.charge", base=DedupTask, dedup_key="order:{order_id}", shared=False)
    def charge(order_id: int, amount: int = 0) -> int:
        return order_id

    @app.task(name="shop.refund", base=DedupTask, dedup_key="order:{order_id}", shared=False)
    def refund(order_id: int) -> int:
        return order_id

    return charge, refund


class Records:
    """Makes records of ``task`` in any state through the real scripts."""

    def __init__(self, app: Celery, task: Any) -> None:
        self.task = task
        self.store = runtime.store_for(app)
        self.record_ms = runtime.config_for(app).record_ms

    def queued(self, order_id: int) -> Run:
        """Published through the gate (the message waits in the queue)."""
        result = self.task.delay(order_id)
        assert not result.deduplicated
        return Run(member_for(self.task.name, self.task.dedup_business_key(order_id)), result.id)

    def started(
        self, order_id: int, *, lock_ms: int = 60_000, key_mode: str = "lock", hostname: str = "worker-1"
    ) -> Run:
        """Queued, then started as the worker ``hostname`` starts it: its execution lock is alive for ``lock_ms``.

        ``key_mode="window"`` keeps the key held for the whole TTL, as until_expired does.
        """
        run = self.queued(order_id)
        token = new_token()
        decision = self.store.start(
            run.member,
            run.task_id,
            token,
            lock_ms=lock_ms,
            gated=True,
            key_mode=key_mode,
            hostname=hostname,
            pid=4242,
            retries=0,
            record_ms=self.record_ms,
        )
        assert decision.run, decision
        return Run(run.member, run.task_id, token)

    def ended(
        self, order_id: int, state: str, *, keep_key: bool = False, error: str = "", hostname: str = "worker-1"
    ) -> Run:
        """Started by ``hostname``, finished in ``state``; ``keep_key`` keeps the key held (an idempotency window)."""
        run = self.started(order_id, key_mode="window" if keep_key else "lock", hostname=hostname)
        # As the worker's guard does: the call's arguments are kept for a run that did not succeed.
        payload = kept_payload(self.task, state, (order_id,), {})
        owned, kept, _ = self.store.finish(
            run.member,
            run.task_id,
            state,
            drop=not keep_key,
            record_ms=self.record_ms,
            token=run.token,
            role="run",
            error=error,
            payload=payload,
        )
        assert owned and kept
        return run
