"""Followers of a run that replaced itself: the replacement's ending resolves them.

``Task.replace`` gives the replacement the run's id, group, chord and
callbacks, so Celery resolves the replaced run with the replacement's result.
A run replaced by work under another key (or by a plain task) ends
``replaced`` and its followers stay parked (see ``finish.lua``). The message
that will carry the run's id (the replacement, or in a chain or chord the
signature that ends it) gets the ``dedup_relay`` header naming the run's key;
the ending of the task that carries it settles the followers: with its return
value, or failing them as it failed or was revoked. A replacement that
replaces itself again passes the header on (:func:`pass_on`), so a chain of
replacements settles them once, at its end. A replacement under the run's own
key goes on as the same run and carries no header for it.

The run's record is marked ``replacing`` before the replacement is published
(``replacing.lua``), so a worker that dies between that publish and the
``replaced`` ending leaves the followers to the replacement even though the
run is declared ``lost``; they fail as lost only once the record would have
expired without a relayed ending. The first ending settled for a run stands.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import redis
from billiard.exceptions import WorkerLostError
from celery import signals
from celery._state import get_current_worker_task
from celery.exceptions import Reject

from .. import runtime
from .delivery import FAILED, LOST, REVOKED, SUCCEEDED, error_summary, kept_result

logger = logging.getLogger("celery_dedup")

#: Message header: the keys whose replaced run (the message's task id) waits for this task's ending.
RELAY = "dedup_relay"

Entry = tuple[str, str]


def entries(headers: Any) -> list[Entry]:
    """``(prefix, member)`` of each run a message's or request's headers say its ending settles."""
    raw = headers.get(RELAY) if isinstance(headers, Mapping) else None
    if not isinstance(raw, list):
        return []
    return [(str(pair[0]), str(pair[1])) for pair in raw if isinstance(pair, list | tuple) and len(pair) == 2]


def of_request(request: Any) -> list[Entry]:
    """The relay entries of a task's request (a task's context or a worker's request)."""
    for source in (getattr(request, "headers", None), getattr(request, "request_dict", None)):
        found = entries(source)
        if found:
            return found
    return entries({RELAY: getattr(request, RELAY, None)})


def _add(options: dict[str, Any], found: Iterable[Entry]) -> None:
    headers = options.get("headers")
    if not isinstance(headers, dict):
        headers = options["headers"] = {}
    kept = headers.setdefault(RELAY, [])
    for prefix, member in found:
        if [prefix, member] not in kept:
            kept.append([prefix, member])


def mark(canvas: Any, task_id: str, found: list[Entry]) -> bool:
    """Give the signature of ``canvas`` that carries ``task_id`` (a chain's last, a chord's body) ``found``.

    Signatures are dicts, as are those a message embeds (its chain, its
    chord); both are walked. Returns whether one was found.
    """
    if not found or not isinstance(canvas, dict):
        return False
    kwargs = canvas.get("kwargs")
    kind = canvas.get("subtask_type")
    if kind in ("chain", "group") and isinstance(kwargs, dict):
        return any([mark(task, task_id, found) for task in kwargs.get("tasks") or ()])  # noqa: C419 - mark every one
    if kind == "chord" and isinstance(kwargs, dict):
        return mark(kwargs.get("body"), task_id, found) or mark(kwargs.get("header"), task_id, found)
    options = canvas.get("options")
    if isinstance(options, dict) and options.get("task_id") == task_id:
        _add(options, found)
        return True
    return False


def carry(request: Any, replacement: Any, own: Entry | None) -> None:
    """Mark a replacement, before it is published, with the runs its ending settles.

    ``own``: the replaced run's key, if a keyed run is replacing itself here;
    with it go the runs the replaced task was itself relaying for.
    """
    task_id = request.id
    found = of_request(request) + ([own] if own is not None else [])
    if task_id is not None and not request.is_eager:
        mark(replacement, task_id, found)


def drop(headers: dict[str, Any], member: str) -> None:
    """Take ``member`` out of a message's relay: its replacement goes on as the same run, which settles its own."""
    if RELAY in headers:
        headers[RELAY] = [[prefix, other] for prefix, other in entries(headers) if other != member]


def pass_on(headers: Any = None, body: Any = None, **_: Any) -> None:
    """``before_task_publish``: a task relaying for a run that publishes what carries the run's id passes it on.

    So when a plain replacement replaces itself in turn, the new replacement's
    message (or the signature in its chain or chord that carries the id) gets
    the header, which Celery's ``Task.replace`` does not copy.
    """
    current = get_current_worker_task()
    request = getattr(current, "request", None)
    task_id = getattr(request, "id", None)
    if task_id is None or not isinstance(headers, dict) or not runtime.is_installed(getattr(current, "app", None)):
        return
    found = of_request(request)
    if not found:
        return
    if headers.get("id") == task_id:
        _add(headers, found)
    embed = body[2] if isinstance(body, list | tuple) and len(body) > 2 and isinstance(body[2], dict) else {}
    for signature in embed.get("chain") or ():
        mark(signature, task_id, found)
    mark(embed.get("chord"), task_id, found)


def settle(task: Any, found: list[Entry], run_id: str, state: str, *, result: str = "", error: str = "") -> None:
    """Settle the followers of run ``run_id`` under each of ``found`` with how its replacement ended."""
    app = task.app
    store = runtime.store_for(app)
    record_ms = runtime.config_for(app).record_ms
    for prefix, member in found:
        try:
            store.with_prefix(prefix).settle(
                member, run_id, result=result, unkept=error, record_ms=record_ms, state=state
            )
        except redis.RedisError:  # they stay parked until their record expires
            logger.exception("could not settle the followers of replaced run %s key %r", run_id, member)


def on_success(sender: Any = None, result: Any = None, **_: Any) -> None:
    """``task_success``: a replacement returned; its followers' runs get its value."""
    request = getattr(sender, "request", None)
    if request is None or request.id is None or not runtime.is_installed(sender.app):
        return
    found = of_request(request)
    if not found:
        return
    payload, unkept = kept_result(sender, result)
    settle(sender, found, request.id, SUCCEEDED, result=payload, error=unkept)


def on_failure(
    sender: Any = None, task_id: str | None = None, exception: BaseException | None = None, **_: Any
) -> None:
    """``task_failure``: a replacement failed in its body, or its worker process was lost (reported by the main
    process); a requeued one reports nothing, and a ``Reject`` is not an ending."""
    request = getattr(sender, "request", None)
    if task_id is None or isinstance(exception, Reject) or request is None or request.id != task_id:
        return
    if not runtime.is_installed(sender.app):
        return
    found = of_request(request)
    if not found:
        return
    state = LOST if isinstance(exception, WorkerLostError) else FAILED
    error = error_summary(exception) if exception is not None else ""
    settle(sender, found, task_id, state, error=f"its replacement ended {state}: {error}")


def on_revoked(sender: Any = None, request: Any = None, **_: Any) -> None:
    """``task_revoked``: a replacement was revoked (before it ran, or terminated)."""
    if sender is None or request is None or request.id is None or not runtime.is_installed(sender.app):
        return
    found = of_request(request)
    if not found:
        return
    settle(sender, found, request.id, REVOKED, error="its replacement was revoked")


def connect() -> None:
    """Connect the receivers once (idempotent); each acts only for apps given to ``install``."""
    signals.before_task_publish.connect(pass_on, weak=False, dispatch_uid="celery_dedup.relay.pass_on")
    signals.task_success.connect(on_success, weak=False, dispatch_uid="celery_dedup.relay.success")
    signals.task_failure.connect(on_failure, weak=False, dispatch_uid="celery_dedup.relay.failure")
    signals.task_revoked.connect(on_revoked, weak=False, dispatch_uid="celery_dedup.relay.revoked")
