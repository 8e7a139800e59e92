"""Bulk gated enqueue: many calls of one KeyedTask, each gated atomically, in pipelined round trips.

Fan-out code (notify 10,000 customers) is where duplicates are born. A loop
of ``apply_async`` pays one round trip and Celery's whole publish path per
call; here every message is built once, the way Celery builds it, and the
gate scripts run back to back in one pipeline per ``chunk`` calls. Each
script is as atomic as ``apply_async``'s, so a batch cut short by a
connection error can simply be sent again: what was accepted answers as a
duplicate.

The lean path covers the options fan-out uses (queue, exchange,
routing_key, priority, countdown, eta, serializer, time limits,
ignore_result, headers). Anything else (links, chains, chords, groups,
``expires``, compression), a non-Redis broker and eager mode take a loop of
``apply_async`` instead, with the same results. Celery's publish signals and
task-sent events are not sent by the lean path.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import redis
from celery.utils.nodenames import anon_nodename
from celery.utils.saferepr import saferepr
from kombu import serialization
from kombu.exceptions import OperationalError

from .. import runtime
from ..exceptions import (
    DedupArgumentError,
    DedupArgumentsMismatch,
    DedupStoreError,
    DedupUnavailableError,
    DuplicateTaskError,
    server_reply,
)
from ..header import HEADER, GateHeader
from ..keyed import KeyedTask
from ..keys import member_for, new_nonce, new_task_id, split_member
from ..store.store import DedupStore, GateCall
from ..transports.redis import GatedChannelMixin
from . import mismatch
from .delay import delay_seconds
from .result import DedupResult

#: kombu's delivery modes by name (``kombu.entity.DELIVERY_MODES``, untyped there).
DELIVERY_MODES = {"transient": 1, "persistent": 2}

#: Options the lean path builds messages for; any other option takes the loop.
LEAN_OPTIONS = frozenset(
    {
        "queue",
        "exchange",
        "routing_key",
        "priority",
        "countdown",
        "eta",
        "serializer",
        "time_limit",
        "soft_time_limit",
        "ignore_result",
        "headers",
        "delivery_mode",
    }
)

Call = tuple[Sequence[Any], Mapping[str, Any]]


def apply_async_many(task: KeyedTask, calls: Iterable[Call], *, chunk: int = 1000, **options: Any) -> list[DedupResult]:
    """Enqueue ``calls`` (``(args, kwargs)`` pairs) of ``task``; one result per call, in order.

    Every key is derived before anything is sent, so a bad call raises
    :class:`~celery_dedup.DedupKeyError` with nothing enqueued. A duplicate
    (held before, or earlier in the batch) gets the accepted run's result
    marked ``deduplicated``; ``dedup_on_duplicate="raise"`` does not apply.
    A duplicate whose arguments differ from its run's is logged and counted
    (``dedup_on_mismatch``); with ``"raise"``, the first of them is raised once
    the whole batch is through (sending it again is safe).

    Raises:
        DedupKeyError: a call's key cannot be derived.
        DedupArgumentError: ``chunk`` is not a whole number of at least 1.
        DedupUnavailableError: Redis failed mid-batch (``published=None``:
            earlier chunks went out; sending the batch again is safe).
        DedupArgumentsMismatch: with ``dedup_on_mismatch="raise"``, a call's arguments differ from those of the
            run it was answered with; every call of the batch was gated.
    """
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise DedupArgumentError("chunk", chunk, "apply_async_many() sends at least 1 call per round trip")
    normalised = [(tuple(args or ()), dict(kwargs or {})) for args, kwargs in calls]
    policy = task.dedup_policy
    keyed = [
        policy.spec.key_and_fingerprint(args, kwargs, fingerprint=policy.compares_arguments)
        for args, kwargs in normalised
    ]
    members = [member_for(task.name, key) for key, _ in keyed]
    app = task.app
    if not normalised:
        return []
    lean = (
        runtime.is_atomic(app)
        and not app.conf.task_always_eager
        and policy.mode.gates_enqueue
        and not app.conf.task_compression
        and set(options) <= LEAN_OPTIONS
    )
    if not lean:
        return _loop(task, normalised, options)
    with app.producer_or_acquire() as producer:
        channel = producer.channel
        if not isinstance(channel, GatedChannelMixin):
            return _loop(task, normalised, options)
        builder = _Builder(task, producer, options)
        chunks = (
            [
                builder.gate_call(channel, member, new_task_id(split_member(member)[1]), args, kwargs, fingerprint)
                for (args, kwargs), member, (_, fingerprint) in zip(
                    normalised[start : start + chunk],
                    members[start : start + chunk],
                    keyed[start : start + chunk],
                    strict=True,
                )
            ]
            for start in range(0, len(normalised), chunk)
        )
        try:
            outcomes = builder.store(channel).gate_many(chunks)
        except (redis.RedisError, OperationalError) as exc:
            key = f"{split_member(members[0])[1]} (first of a batch)"
            reply = server_reply(exc)
            if reply is not None:
                raise DedupStoreError(task.name, key, reply, published=None) from exc
            raise DedupUnavailableError(task.name, key, exc, published=None) from exc
    results = []
    mismatched: list[DedupArgumentsMismatch] = []
    for outcome, (key, fingerprint) in zip(outcomes, keyed, strict=True):
        result = task.AsyncResult(outcome.task_id)
        result.deduplicated = not outcome.accepted
        results.append(result)
        found = mismatch.check(task, key, fingerprint, outcome, options, raises=False)
        if found is not None:
            mismatched.append(found)
    _raise_first(task, mismatched)
    return results


def _loop(
    task: KeyedTask, calls: list[tuple[tuple[Any, ...], dict[str, Any]]], options: dict[str, Any]
) -> list[DedupResult]:
    """The calls the lean path cannot build: ``apply_async`` each, answering a duplicate instead of raising."""
    results = []
    mismatched: list[DedupArgumentsMismatch] = []
    for args, kwargs in calls:
        try:
            results.append(task.apply_async(args, kwargs, **options))
        except DedupArgumentsMismatch as error:  # raised, so logged and counted already: the rest go out first
            mismatched.append(error)
            results.append(task._marked(error.task_id))
        except DuplicateTaskError as duplicate:
            results.append(task._marked(duplicate.task_id))
    _raise_first(task, mismatched)
    return results


def _raise_first(task: KeyedTask, mismatched: list[DedupArgumentsMismatch]) -> None:
    """With ``dedup_on_mismatch="raise"``, raise the batch's first mismatch once every call went through the gate."""
    if mismatched and task.dedup_policy.on_mismatch == "raise":
        raise mismatched[0]


def _short_repr(value: Any, limit: int = 1024) -> str:
    """``repr`` as Celery's headers keep it; ``saferepr`` (bounded, slower) only for long values."""
    text = repr(value)
    return text if len(text) <= limit else saferepr(value, limit)


class _Builder:
    """Builds each call's message as Celery's ``send_task`` and kombu's ``Producer.publish`` would."""

    def __init__(self, task: KeyedTask, producer: Any, options: dict[str, Any]) -> None:
        app = task.app
        self.task = task
        self.app = app
        self.amqp = app.amqp
        self.options = options
        exec_options = {k: v for k, v in task._get_exec_options().items() if v is not None}  # type: ignore[attr-defined]
        self.base_options = {**exec_options, **options}
        self.route_per_call = bool(app.conf.task_routes)
        self.routed = None if self.route_per_call else self._route((), {})
        self.serializer = self.base_options.get("serializer") or app.conf.task_serializer
        self.delay = delay_seconds(options.get("countdown"), options.get("eta"))
        self.producer = producer
        self.declared: set[str] = set()
        parent = app.current_worker_task
        self.parent_id = parent.request.id if parent else None
        self.root_id = (parent.request.root_id or parent.request.id) if parent else None
        ignore_result = options.get("ignore_result")
        self.ignore_result = task.ignore_result if ignore_result is None else ignore_result
        self.default_delivery_mode = app.conf.task_default_delivery_mode
        self.origin = anon_nodename()
        self.reply_to = app.thread_oid
        self.gate_template: GateHeader | None = None

    def _route(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        routed = self.amqp.router.route(
            dict(self.base_options),
            self.task.name,
            args,
            kwargs,
            self.task,
        )
        return dict(routed)

    def gate_call(
        self,
        channel: GatedChannelMixin,
        member: str,
        run_id: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        fingerprint: str = "",
    ) -> GateCall:
        routed = self._route(args, kwargs) if self.route_per_call or self.routed is None else self.routed
        message = self.amqp.create_task_message(
            run_id,
            self.task.name,
            args,
            kwargs,
            countdown=routed.get("countdown"),
            eta=routed.get("eta"),
            reply_to=self.reply_to,
            time_limit=routed.get("time_limit"),
            soft_time_limit=routed.get("soft_time_limit"),
            root_id=self.root_id,
            parent_id=self.parent_id,
            ignore_result=self.ignore_result,
            origin=self.origin,
            argsrepr=_short_repr(args),
            kwargsrepr=_short_repr(kwargs),
        )
        headers, properties, body, _ = message
        headers.update(routed.get("headers") or {})
        if self.gate_template is None:
            self.gate_template = self.task.dedup_gate_header(member, self.delay)
        gate = replace(self.gate_template, member=member, nonce=new_nonce(), fingerprint=fingerprint)
        headers[HEADER] = gate.encode()
        queue = routed["queue"]
        exchange, routing_key = self._destination(queue, routed)
        if queue.name not in self.declared:
            self.producer.maybe_declare(queue)
            self.declared.add(queue.name)
        content_type, content_encoding, data = serialization.dumps(body, serializer=self.serializer)
        properties["delivery_mode"] = self._delivery_mode(queue, routed)
        kombu_message = channel.prepare_message(  # type: ignore[attr-defined]
            data, routed.get("priority"), content_type, content_encoding, headers, properties
        )
        return channel.gate_call(kombu_message, exchange, routing_key, gate)[1]

    def store(self, channel: GatedChannelMixin) -> DedupStore:
        config = runtime.config_for(self.app)
        return channel.dedup_store(config.key_prefix, config.history_length)

    @staticmethod
    def _destination(queue: Any, routed: Mapping[str, Any]) -> tuple[str, str]:
        """Exchange and routing key, as ``send_task_message`` picks them."""
        exchange, routing_key = routed.get("exchange"), routed.get("routing_key")
        exchange_type = getattr(queue.exchange, "type", "direct")
        if (not exchange or not routing_key) and exchange_type == "direct":
            return "", str(queue.name)
        name = getattr(exchange, "name", exchange) or queue.exchange.name
        return str(name), str(routing_key or queue.routing_key)

    def _delivery_mode(self, queue: Any, routed: Mapping[str, Any]) -> int:
        mode = routed.get("delivery_mode") or getattr(queue.exchange, "delivery_mode", None)
        mode = mode or self.default_delivery_mode
        if isinstance(mode, str):
            return DELIVERY_MODES.get(mode, DELIVERY_MODES["persistent"])
        return int(mode or DELIVERY_MODES["persistent"])
