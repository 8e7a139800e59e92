"""A duplicate whose arguments differ from those of the run it is answered with: warn, raise or ignore.

HTTP APIs refuse an idempotency key reused with other parameters (Stripe
answers such a request with an error; the IETF ``Idempotency-Key`` draft
asks servers to). A business key is such an idempotency key, and two calls
with different arguments that map to one key are two pieces of work of
which only the first is done. So each call of a task that compares
(``dedup_on_mismatch`` not ``ignore``, and not a debounce whose latest call's
arguments run) carries the fingerprint of its bound arguments
(:func:`celery_dedup.keys.arguments_fingerprint`) in its gate header. A new
run keeps it in its record (``args_fp``); the gate (and the peek) answers a
duplicate with the run's, counting a mismatch there (``mismatched``, in the
record and the stats) in the same script: no round trip of its own. What is
left to do here is the caller's side: a WARNING naming both fingerprints, or
:class:`~celery_dedup.DedupArgumentsMismatch`.

Calls that continue a run (retries, deferred copies, replacements) carry no
fingerprint: their arguments may change by design.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import decisions
from ..exceptions import DedupArgumentsMismatch
from ..keyed import KeyedTask
from ..store.store import Outcome


def check(
    task: KeyedTask, key: str, fingerprint: str, outcome: Outcome, options: Mapping[str, Any], *, raises: bool = True
) -> DedupArgumentsMismatch | None:
    """Warn of, or raise for, a call with ``fingerprint`` answered with a run whose arguments differ (``outcome``).

    Raises only with ``dedup_on_mismatch="raise"``, ``raises`` (not for a
    follower or a call that joined a burst: the gate parked or joined it
    already) and outside a worker's canvas dispatch (``parent_id`` in
    ``options``), where raising would fail the parent task, as
    ``dedup_on_duplicate="raise"`` does not raise there either. Otherwise
    the mismatch is logged as the decision ``mismatched``, at WARNING.
    Returns the error it would raise, for a caller that raises it later
    (bulk publishing), or None when the arguments do not differ.

    Raises:
        DedupArgumentsMismatch: the arguments differ, and the task says ``raise``.
    """
    if not outcome.mismatches(fingerprint):
        return None
    error = DedupArgumentsMismatch(task.name, key, outcome.task_id, fingerprint, outcome.fingerprint)
    strict = task.dedup_policy.on_mismatch == "raise" and raises and "parent_id" not in options
    decisions.log(
        "mismatched",
        task.name,
        key,
        outcome.task_id,
        f"this call's arguments (fingerprint {fingerprint}) differ from the run's ({outcome.fingerprint})"
        + ("; raised" if strict else ""),
    )
    if strict:
        raise error
    return error
