"""Where the Python time of one keyed delivery and of one gated call goes, part by part, in one process.

Worker side (:func:`delivery_budget`, ``benchmarks/worker.py --budget``):
messages of ``benchmarks/worker_app.py``'s no-op tasks (``bench.plain`` and
``bench.keyed``, ``task_acks_late``), published as usual, are taken off the
queue one at a time and run as a solo worker runs each message it received:
Celery's request, its tracer (signals, the result if one is stored), the
body and the ack, without the consumer's event loop and its wait for the
next message. Plain and keyed messages alternate in blocks, so load on the
machine hits both alike.

Publish side (:func:`call_budget`, ``benchmarks/enqueue.py --budget``):
``apply_async`` of the same tasks, for a plain call, a keyed call of a new
key and a duplicate.

The parts are the functions that do them, timed by wrapping them for the
measurement only (:class:`Parts`): wall time (``time.perf_counter_ns``) and
this thread's CPU time (``time.thread_time_ns``: the Python and its system
calls, without the waits for the server or for a core). A part's time
includes the parts it calls, which the tables indent under it; a wrapped
call costs about a microsecond more (the CPU clock is a system call). The
worker side times every message whole in a first pass with nothing wrapped,
and the parts in a second. The server's own time in the scripts is read
from ``INFO commandstats``.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
from celery import Celery
from celery.app import task as celery_task
from celery.app.trace import build_tracer, trace_task_ret
from celery.concurrency.solo import TaskPool
from celery.worker.request import Request, create_request_cls  # type: ignore[attr-defined]
from kombu.transport import redis as kombu_redis

from benchmarks import harness
from celery_dedup import task as dedup_task
from celery_dedup.keys import KeySpec
from celery_dedup.publish import call as publish_call
from celery_dedup.store.scripts import Scripts
from celery_dedup.store.store import DedupStore
from celery_dedup.transports import redis as gated_redis
from celery_dedup.worker import delivery, lock, processes, recovery, results

#: ``(label, depth, owner, attribute)``: the worker-side parts, in the order the table lists them; an
#: owner None names a script by its command (``Scripts.run``, counted by the script it runs).
DELIVERY_PARTS: tuple[tuple[str, int, Any, str], ...] = (
    ("DedupTask.__call__: the guard and the body", 0, dedup_task, "guarded_call"),
    ("Delivery.of: locate the key (gate header)", 1, delivery.Delivery, "of"),
    ("Delivery.start", 1, delivery.Delivery, "start"),
    ("claim a token", 2, processes, "claim"),
    ("participants (limits)", 2, delivery.Delivery, "admit"),
    ("Delivery.ask: the start call's fields, the call", 2, delivery.Delivery, "ask"),
    ("recovery.main_token", 3, recovery, "main_token"),
    ("recovery.delivery", 3, recovery, "delivery"),
    ("DedupStore.start", 3, DedupStore, "start"),
    ("start script: redis-py and the server", 4, None, "start script"),
    ("ExecutionLock", 2, lock.ExecutionLock, "__init__"),
    ("Renewer.add", 2, lock.Renewer, "add"),
    ("Delivery.run", 1, delivery.Delivery, "run"),
    ("the body: Celery's Task.__call__ and run", 2, celery_task.Task, "__call__"),
    ("Delivery.end", 2, delivery.Delivery, "end"),
    ("results.defer: left to the result write?", 3, results, "defer"),
    ("Renewer.remove", 3, lock.Renewer, "remove"),
    ("record: the ending", 3, delivery, "record"),
    ("finish script: redis-py and the server", 4, None, "finish script"),
)

#: The publish-side parts, likewise.
CALL_PARTS: tuple[tuple[str, int, Any, str], ...] = (
    ("apply_gated", 0, dedup_task, "apply_gated"),
    ("business key (KeySpec.business_key)", 1, KeySpec, "business_key"),
    ("peek: a key seen held lately", 1, publish_call, "peek"),
    ("peek script: redis-py and the server", 2, None, "peek script"),
    ("dedup_gate_header", 1, dedup_task.DedupTask, "dedup_gate_header"),
    ("Celery's Task.apply_async (send)", 0, celery_task.Task, "apply_async"),
    ("transport basic_publish", 1, gated_redis.GatedChannelMixin, "basic_publish"),
    ("gate_call: finish the message, build the call", 2, gated_redis.GatedChannelMixin, "gate_call"),
    ("run_gate", 2, DedupStore, "run_gate"),
    ("gate script: redis-py and the server", 3, None, "gate script"),
    ("kombu's _put (plain: LPUSH)", 2, kombu_redis.Channel, "_put"),
)


class Parts:
    """Wall and CPU nanoseconds of each named part per unit (a message, a call), measured by wrapping functions.

    A unit is one :meth:`whole` call: what its parts took inside it is summed per part, so a part
    called twice in one unit (a delivery's ending, deferred to the result write) counts once, whole.
    CPU time is this thread's (``time.thread_time_ns``): the Python and the system calls of a part,
    without the time spent waiting for the server or for a core.
    """

    def __init__(self) -> None:
        #: Per part, one value per unit that called it.
        self.wall: dict[str, list[int]] = defaultdict(list)
        self.cpu: dict[str, list[int]] = defaultdict(list)
        #: Per part, how many times units called it.
        self.calls: Counter[str] = Counter()
        self._unit_wall: Counter[str] = Counter()
        self._unit_cpu: Counter[str] = Counter()
        self._undo: list[tuple[Any, str, Any]] = []

    def _timed(self, function: Callable[..., Any], label: Callable[..., str] | str) -> Callable[..., Any]:
        clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
        unit_wall, unit_cpu, calls = self._unit_wall, self._unit_cpu, self.calls

        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            began, cpu_began = clock(), cpu_clock()
            try:
                return function(*args, **kwargs)
            finally:
                took, cpu_took = clock() - began, cpu_clock() - cpu_began
                name = label if isinstance(label, str) else label(*args, **kwargs)
                unit_wall[name] += took
                unit_cpu[name] += cpu_took
                calls[name] += 1

        return timed

    def wrap(self, owner: Any, attribute: str, label: Callable[..., str] | str) -> None:
        raw = vars(owner)[attribute] if isinstance(owner, type) else getattr(owner, attribute)
        kind = type(raw) if isinstance(raw, classmethod | staticmethod) else None
        timed = self._timed(raw.__func__ if kind is not None else raw, label)
        setattr(owner, attribute, kind(timed) if kind is not None else timed)
        self._undo.append((owner, attribute, raw))

    def restore(self) -> None:
        for owner, attribute, raw in reversed(self._undo):
            setattr(owner, attribute, raw)
        self._undo.clear()

    @contextlib.contextmanager
    def wrapped(self, parts: Sequence[tuple[str, int, Any, str]]) -> Iterator[Parts]:
        """Wrap every part of ``parts``, and ``Scripts.run`` by the script it runs; unwrap them after."""
        try:
            for label, _, owner, attribute in parts:
                if owner is not None:
                    self.wrap(owner, attribute, label)
            self.wrap(Scripts, "run", lambda _scripts, _keys, command, **_: f"{type(command).__name__.lower()} script")
            yield self
        finally:
            self.restore()

    def whole(self, label: str, function: Callable[..., Any], *args: Any) -> Any:
        """``function(*args)`` as one unit, timed whole as ``label``."""
        self._unit_wall.clear()
        self._unit_cpu.clear()
        try:
            return self._timed(function, label)(*args)
        finally:
            for name, took in self._unit_wall.items():
                self.wall[name].append(took)
                self.cpu[name].append(self._unit_cpu[name])

    def clear(self) -> None:
        self.wall.clear()
        self.cpu.clear()
        self.calls.clear()


# --- the worker side -----------------------------------------------------------------------------


@dataclass
class Samples:
    """Wall and CPU ns per unit of each part (and of the wholes), as :class:`Parts` collects them."""

    wall: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    cpu: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    calls: Counter[str] = field(default_factory=Counter)

    def add(self, parts: Parts) -> None:
        for name, values in parts.wall.items():
            self.wall[name] += values
        for name, values in parts.cpu.items():
            self.cpu[name] += values
        self.calls.update(parts.calls)
        parts.clear()

    def per(self, name: str, units: int) -> tuple[float, float, float]:
        """``(calls, wall µs, CPU µs)`` per unit: a part's median unit, times the share of units that called it."""
        wall, cpu = self.wall.get(name, []), self.cpu.get(name, [])
        if not wall:
            return 0.0, 0.0, 0.0
        share = len(wall) / units
        return self.calls[name] / units, statistics.median(wall) / 1000 * share, statistics.median(cpu) / 1000 * share


@dataclass
class DeliveryRun:
    """What :func:`delivery_budget` measured: each plain and keyed message whole, the keyed one's parts."""

    results: bool
    deliveries: int
    #: Each message timed whole, nothing wrapped.
    samples: Samples = field(default_factory=Samples)
    #: The same, with the parts wrapped.
    wrapped: Samples = field(default_factory=Samples)
    #: Server µs in EVALSHA per keyed delivery, over the wrapped run.
    lua_us: float = 0.0


class _Runner:
    """Runs queued messages as a solo worker's pool does, one at a time (see the module's docstring)."""

    def __init__(self, app: Celery, queue: str, hostname: str) -> None:
        self.app = app
        self.queue = queue
        self.hostname = hostname
        self.pool = TaskPool(limit=1)
        self.pool.start()
        self.connection = app.connection_for_write()
        self.channel = self.connection.default_channel
        trace = functools.partial(trace_task_ret, app=app)
        self.requests: dict[str, type[Request]] = {}
        for name in ("bench.plain", "bench.keyed"):
            task = app.tasks[name]
            task.__trace__ = build_tracer(name, task, app.loader, hostname, app=app)
            self.requests[name] = create_request_cls(Request, task, self.pool, hostname, None, app=app, trace=trace)

    def close(self) -> None:
        self.connection.release()
        self.pool.stop()

    def run_one(self, parts: Parts) -> None:
        """Take the next message and run it, timed whole (from its fetch done to its ack sent) as its task's part."""
        message = self.channel.basic_get(self.queue, no_ack=False)  # type: ignore[attr-defined]
        if message is None:
            raise RuntimeError(f"{self.queue} is empty")
        name = message.headers["task"]
        request = parts.whole(name, self._run, message, name)
        if not request.acknowledged:
            raise RuntimeError(f"{name}[{request.id}] was not acknowledged")

    def _run(self, message: Any, name: str) -> Request:
        request = self.requests[name](
            message,
            on_ack=message.ack_log_error,
            on_reject=message.reject_log_error,
            app=self.app,
            hostname=self.hostname,
            eventer=None,
            task=self.app.tasks[name],
            connection_errors=(),
            body=message.body,
            headers=message.headers,
            decoded=False,
            utc=True,
        )
        request.execute_using_pool(self.pool)
        return request


def delivery_budget(url: str, deliveries: int, *, results_on: bool, block: int = 50) -> DeliveryRun:
    """Run plain and keyed no-op messages through Celery's request and tracer (see the module's docstring).

    Twice ``deliveries`` of each: first timed whole only, then with the parts wrapped.
    """
    from benchmarks.worker_app import QUEUE, build_app  # noqa: PLC0415 - the worker benchmark's app

    app = build_app(url, "bench_budget")
    admin: redis.Redis = redis.Redis.from_url(url)
    runner = _Runner(app, QUEUE, "budget@bench")
    run = DeliveryRun(results_on, deliveries)
    parts = Parts()
    tasks = [app.tasks["bench.plain"], app.tasks["bench.keyed"]]
    try:
        order = 1
        # Warm up: connections, scripts, the renewer thread.
        order, _ = _drain_blocks(admin, runner, parts, tasks, 100, order, results_on, block)
        parts.clear()
        order, _ = _drain_blocks(admin, runner, parts, tasks, deliveries, order, results_on, block, run.samples)
        with parts.wrapped(DELIVERY_PARTS):
            _, usec = _drain_blocks(admin, runner, parts, tasks, deliveries, order, results_on, block, run.wrapped)
        run.lua_us = usec / deliveries
    finally:
        runner.close()
        harness.clear(admin, "bench-dedup:*", "celery-task-meta-*")
        admin.delete(QUEUE, "unacked", "unacked_index")
        admin.close()
        app.close()
    return run


def _drain_blocks(
    admin: redis.Redis,
    runner: _Runner,
    parts: Parts,
    tasks: Sequence[Any],
    count: int,
    order: int,
    results_on: bool,
    block: int,
    samples: Samples | None = None,
) -> tuple[int, int]:
    """Queue and run ``count`` messages of each task, in blocks whose order alternates.

    Returns the next order id, and the server's µs in EVALSHA while the messages ran (the gate's own,
    as they were published, left out).
    """
    done = usec = 0
    while done < count:
        size = min(block, count - done)
        turn = tasks if (done // block) % 2 == 0 else tasks[::-1]
        order = _publish_blocks(runner.app, turn, size, order, results_on)
        before = _evalsha_usec(admin)
        for _ in range(len(turn) * size):
            runner.run_one(parts)
        usec += _evalsha_usec(admin) - before
        done += size
        if samples is not None:
            samples.add(parts)
        else:
            parts.clear()
    return order, usec


def _publish_blocks(app: Celery, tasks: Sequence[Any], size: int, order: int, results_on: bool) -> int:
    """Queue ``size`` messages of each task, in turn (untimed); returns the next order id."""
    with app.producer_or_acquire() as producer:
        for task in tasks:
            for _ in range(size):
                task.apply_async((order,), producer=producer, ignore_result=not results_on)
                order += 1
    return order


def _evalsha_usec(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("usec", 0))


def _indent(label: str, depth: int) -> str:
    return "\N{NO-BREAK SPACE}" * 4 * depth + label


def delivery_rows(run: DeliveryRun) -> list[dict[str, Any]]:
    """The table's rows: each part's calls, wall and CPU µs per keyed delivery."""
    count = run.deliveries

    def row(part: str, depth: int, calls: float | None, wall: float, cpu: float | None) -> dict[str, Any]:
        return {"part": part, "depth": depth, "calls": calls, "wall_us": wall, "cpu_us": cpu}

    _, plain_wall, plain_cpu = run.samples.per("bench.plain", count)
    _, keyed_wall, keyed_cpu = run.samples.per("bench.keyed", count)
    _, wrapped_wall, wrapped_cpu = run.wrapped.per("bench.keyed", count)
    rows = [
        row("a plain message: Celery's request, tracer, body and ack", 0, 1.0, plain_wall, plain_cpu),
        row("a keyed message, the same", 0, 1.0, keyed_wall, keyed_cpu),
        row("added by celery-dedup", 0, None, keyed_wall - plain_wall, keyed_cpu - plain_cpu),
        row("a keyed message with its parts timed (below)", 0, 1.0, wrapped_wall, wrapped_cpu),
    ]
    for label, depth, owner, attribute in DELIVERY_PARTS:
        rows.append(row(label, depth + 1, *run.wrapped.per(attribute if owner is None else label, count)))
    rows.append(row("server time in the start and finish scripts (INFO commandstats)", 0, None, run.lua_us, None))
    return rows


def delivery_table(run: DeliveryRun) -> str:
    """The keyed delivery's parts, µs per delivery (each part: its median over deliveries)."""
    return harness.table(
        ["part", "calls per delivery", "wall µs", "CPU µs"],
        [
            [_indent(row["part"], row["depth"]), row["calls"], row["wall_us"], row["cpu_us"]]
            for row in delivery_rows(run)
        ],
    )


# --- the publish side ----------------------------------------------------------------------------


@dataclass
class CallRun:
    """What :func:`call_budget` measured: per case, each call whole and its parts."""

    calls: int
    samples: dict[str, Samples] = field(default_factory=dict)


def call_budget(calls_per_case: int, cases: Sequence[tuple[str, Callable[[], object]]], *, block: int = 50) -> CallRun:
    """Time ``cases`` (name, call) whole and by part, ``calls_per_case`` calls each, interleaved in blocks."""
    run = CallRun(calls_per_case, {name: Samples() for name, _ in cases})
    parts = Parts()
    with parts.wrapped(CALL_PARTS):
        done = 0
        while done < calls_per_case:
            size = min(block, calls_per_case - done)
            for name, call in cases:
                for _ in range(size):
                    parts.whole("call", call)
                run.samples[name].add(parts)
            done += size
    return run


def call_rows(run: CallRun) -> list[dict[str, Any]]:
    names = list(run.samples)
    rows = [
        {
            "part": "apply_async, whole (its parts wrapped)",
            "depth": 0,
            **{n: run.samples[n].per("call", run.calls)[1:] for n in names},
        }
    ]
    for label, depth, owner, attribute in CALL_PARTS:
        key = attribute if owner is None else label
        rows.append({"part": label, "depth": depth + 1, **{n: run.samples[n].per(key, run.calls)[1:] for n in names}})
    return rows


def call_table(run: CallRun) -> str:
    """Each case's parts, wall (CPU) µs per call."""
    names = list(run.samples)
    return harness.table(
        ["part: wall µs (CPU µs) per call", *names],
        [
            [_indent(row["part"], row["depth"]), *(f"{row[n][0]:.1f} ({row[n][1]:.1f})" for n in names)]
            for row in call_rows(run)
        ],
    )
