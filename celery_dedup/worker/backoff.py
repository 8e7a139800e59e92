"""A body backs off (``raise self.dedup_backoff(retry_after=30)``, on an HTTP 429): its group key pauses, it comes back.

:func:`backoff` (``DedupTask.dedup_backoff``) does, from inside the body of
a task of a named limit group (``limit_group``), what Celery's
``Task.retry`` does for a retry, without costing one:

- the run's group key is **paused** for ``retry_after`` seconds
  (``limit_backoff.lua``: the key's ``paused_until``, which only ever
  grows): no run of that key starts meanwhile, on any worker, nor any
  caller of ``limits.acquire``; other keys of the group go on;
- the run goes **first in the key's waiting line**, so it is the first of
  the key to start once the pause ends (runs of the key that were waiting
  keep their order behind it);
- the run is **re-published** (same task id, ``request.retries`` unchanged:
  not a Celery retry, ``max_retries`` is not touched) with a countdown of
  ``retry_after``, as a run waiting for its limits is; a run that freed its
  key as it started (``until_executing``, ``debounce``) and whose key a
  newer call took since is answered by that run, as its ``Task.retry``
  would be: it leaves the line and does not come back (a ``skipped``
  decision says so), the newer run does the key's work;
- it returns a :class:`Backoff`, a ``celery.exceptions.Retry``, for the body
  to raise: the delivery then ends as a retry does (the key stays held, the
  record says ``retry``, the result backend ``RETRY``). Its slot is given
  back then; its start stays in the group's windows (the call was made: a
  429 counts against the quota too).

Call it only to raise it: like ``Task.retry``, it has re-published the run
by the time it returns. Eager and direct calls apply no limits: there it
pauses nothing, re-publishes nothing and only returns the exception.
"""

from __future__ import annotations

import logging
import math
import random
from typing import TYPE_CHECKING, Any, cast

import redis
from celery.exceptions import Retry

from .. import decisions, runtime
from ..exceptions import DedupArgumentError, DedupConfigError
from ..keys import split_member
from ..store.limits import back_off, leave_line, note
from ..store.store import DedupStore
from .delivery import live, running
from .limits import group_of

if TYPE_CHECKING:
    from ..keyed import KeyedTask

logger = logging.getLogger("celery_dedup")


class Backoff(Retry):
    """What a body raises to back off (``DedupTask.dedup_backoff``): ends the delivery as a retry would."""


def _seconds(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise DedupArgumentError("retry_after", value, "must be a number of seconds above 0")
    return float(value)


def _delivery_store(task: KeyedTask, run_id: str) -> tuple[DedupStore, str | None]:
    """The store the running delivery of ``run_id`` takes its places in, and its member (None: no key)."""
    delivery = running(run_id) or next((d for d in reversed(live(run_id)) if d.running), None)
    if delivery is None:
        return runtime.store_for(task.app), None
    return delivery.store, delivery.member


def backoff(task: KeyedTask, retry_after: Any) -> Backoff:
    """Pause the current run's group key for ``retry_after`` seconds, put the run first in line, re-publish it.

    Raises:
        DedupArgumentError: ``retry_after`` is not a number of seconds above 0.
        DedupConfigError: the task has no limit group (``limit_group``).
    """
    seconds = _seconds(retry_after)
    limit = task.dedup_policy.limit
    if limit is None or limit.group is None:
        raise DedupConfigError(
            "limit_group",
            None,
            "dedup_backoff pauses the run's limit group key: the task names no limit_group"
            + ("" if limit is None else " (a task's own limits cannot be paused)"),
            task=task.name,
        )
    exc = Backoff(
        f"backing off: its limit group key paused for {seconds:g}s", when=cast(Any, seconds)
    )  # a Real in the stubs
    request = task.request
    if request.called_directly or getattr(request, "is_eager", False) or request.id is None:
        return exc
    run_id = str(request.id)
    group = group_of(task, request.args, request.kwargs)
    store, member = _delivery_store(task, run_id)
    key = split_member(group)[1] if group is not None else "?"
    if group is not None:
        try:
            back_off(
                store,
                group,
                run_id,
                after_ms=math.ceil(seconds * 1000),
                lease_ms=int(task.dedup_policy.lock_ttl * 1000),
            )
        except redis.RedisError:  # the run still comes back; only the pause is missing
            logger.exception(
                "%s[%s]: could not pause group %r; the run comes back all the same", task.name, run_id, group
            )
    why = f"backed off for {seconds:g}s: {key} paused"
    if member is not None:
        try:
            note(store, member, run_id, "wait", why)
        except redis.RedisError:
            logger.exception("%s[%s]: could not record that it backs off", task.name, run_id)
    decisions.log("limited", task.name, key, run_id, f"{why}; again in {seconds:g}s")
    # Back a moment after the pause ends (the server's clock), not a refusal before it.
    again = task.signature_from_request(request, countdown=seconds + random.uniform(0.02, 0.05)).apply_async()
    if getattr(again, "deduplicated", False) and again.id != run_id:
        _superseded(task, store, group, run_id, str(again.id), key)
    return exc


def _superseded(task: KeyedTask, store: DedupStore, group: str | None, run_id: str, newer: str, key: str) -> None:
    """The re-publish was answered by a newer run of the run's business key: that run does the key's work.

    A run that freed its key as it started (``until_executing``,
    ``debounce``) does not take it back from a call accepted since, as its
    ``Task.retry`` would not: it gives up its place in line, so the newer
    run is not kept waiting behind a run that never comes back. The pause
    stays: it is the group key's.
    """
    if group is not None:
        try:
            leave_line(store, group, run_id)
        except redis.RedisError:  # its place lapses with its deadline
            logger.exception("%s[%s]: could not leave the line of group %r", task.name, run_id, group)
    decisions.log(
        "skipped", task.name, key, run_id, f"backed off after run {newer} took its key: that run does its work"
    )
