"""Publishing a keyed task when the database transaction commits (Django's ``transaction.on_commit``).

Celery (5.4 and later) gives tasks of a Django project ``delay_on_commit`` and
``apply_async_on_commit`` through its ``DjangoTask`` base class; a task
declared with ``base=DedupTask`` has another base, so DedupTask offers both
itself and they call this module. The gate runs at commit, when Django runs
the callback: a rolled-back transaction publishes nothing and holds no key.
Both return None, as Celery's do: nothing is decided before the commit.

Two differences from Celery's, both because the callback runs after the
commit, where no caller can act on an error any more and where an exception
also stops Django from running the transaction's later callbacks:

- the business key is derived when the call is made, so a call whose key
  cannot be derived raises inside the transaction;
- a duplicate is never raised at commit: under ``dedup_on_duplicate="raise"``
  it is answered as under ``return_existing`` (nothing published, counted in
  the key's record, logged).

Publish errors (the store unreachable, a follower limit) propagate from the
commit as Celery's own publish errors do.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from django.db import transaction

from ... import runtime
from ...exceptions import DuplicateTaskError
from ...keyed import KeyedTask

logger = logging.getLogger("celery_dedup")


def publish_on_commit(
    task: KeyedTask, args: Any, kwargs: Any, options: dict[str, Any], *, using: str | None = None
) -> None:
    """Gate and publish ``task.apply_async(args, kwargs, **options)`` once the transaction on ``using`` commits.

    Outside a transaction (autocommit) Django runs the callback at once.

    Raises:
        DedupKeyError: the key cannot be derived from these arguments.
        DedupConfigError: the task's options are invalid, or the app was never installed.
    """
    runtime.is_atomic(task.app)  # refuses an app that was never installed
    task.dedup_policy.spec.business_key(args, kwargs)
    transaction.on_commit(functools.partial(_publish, task, args, kwargs, options), using=using)


def _publish(task: KeyedTask, args: Any, kwargs: Any, options: dict[str, Any]) -> None:
    try:
        task.apply_async(args, kwargs, **options)
    except DuplicateTaskError as exc:
        logger.debug(
            "%s key %r: a duplicate of %s at commit, answered without raising (no caller to raise to)",
            exc.task,
            exc.key,
            exc.task_id,
        )
