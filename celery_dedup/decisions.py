"""One log line per decision, on the ``celery_dedup`` logger, with the same fields everywhere.

Each line reads ``<decision>: <task>[<task id>] key '<business key>'`` and
carries the fields as ``extra`` (``dedup_decision``, ``dedup_task``,
``dedup_key``, ``dedup_task_id``) for structured log handlers. Levels are
chosen for operators: routine outcomes at DEBUG, refusals a user may ask
about ("why didn't my task run?") at INFO, what needs a look at WARNING, a
lost lock at ERROR.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("celery_dedup")

#: Every decision, in the order a task's life meets them (as tables show them).
DECISIONS = (
    "accepted",
    "deduplicated",
    "mismatched",
    "collapsed",
    "followed",
    "skipped",
    "deferred",
    "taken_over",
    "limited",
    "lock_lost",
    "released",
    "reaped",
    "fail_open",
)

LEVELS = {
    "accepted": logging.DEBUG,
    "collapsed": logging.DEBUG,
    "followed": logging.DEBUG,
    "deduplicated": logging.INFO,
    "mismatched": logging.WARNING,
    "skipped": logging.INFO,
    "deferred": logging.INFO,
    "taken_over": logging.WARNING,
    "limited": logging.INFO,
    "released": logging.WARNING,
    "reaped": logging.WARNING,
    "fail_open": logging.WARNING,
    "lock_lost": logging.ERROR,
}


def log(decision: str, task: str, key: str, task_id: str | None, detail: str = "") -> None:
    """Log one decision about one key; ``detail`` says why, in a few words."""
    level = LEVELS[decision]
    if not logger.isEnabledFor(level):
        return
    logger.log(
        level,
        "%s: %s[%s] key %r%s",
        decision,
        task,
        task_id or "-",
        key,
        f": {detail}" if detail else "",
        extra={"dedup_decision": decision, "dedup_task": task, "dedup_key": key, "dedup_task_id": task_id},
    )
