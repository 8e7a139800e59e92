"""A storm of duplicate payment requests: M processes race K sends per order through ``charge_payment``.

Run through the ``storm`` management command; each sender is a fresh
(spawned) process that sets Django up itself, then waits at a barrier so all
of them publish at once. The senders count their sends in shared memory, for
a progress bar, and keep the ``celery_dedup`` logger quiet unless asked: a
storm is hundreds of duplicates, each worth an INFO line elsewhere.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.synchronize import Barrier
from typing import Any

from demo_project import without_project_dir


class StormError(RuntimeError):
    """A sender process failed or did not finish."""


#: record states of a run that is not over yet
IN_FLIGHT = frozenset({"queued", "started", "retry"})


@dataclass
class Tally:
    """What one sender process saw."""

    calls: int = 0
    accepted: int = 0
    deduplicated: int = 0
    task_ids: dict[int, set[str]] = field(default_factory=lambda: defaultdict(set))

    def add(self, other: Tally) -> None:
        self.calls += other.calls
        self.accepted += other.accepted
        self.deduplicated += other.deduplicated
        for order_id, ids in other.task_ids.items():
            self.task_ids[order_id] |= ids


def shares(sends: int, processes: int) -> list[int]:
    """How many sends per order each process makes, ``sends`` in all."""
    return [sends // processes + (i < sends % processes) for i in range(processes)]


def send(order_ids: Sequence[int], rounds: int, barrier: Barrier, results: Any, sent: Any, quiet: bool) -> None:
    """One sender process: ``rounds`` passes over every order, after all senders are ready."""
    sys.path[:] = without_project_dir(sys.path)  # before celery is imported here
    import django  # noqa: PLC0415 - a spawned process sets Django up before importing models

    django.setup()
    if quiet:
        logging.getLogger("celery_dedup").setLevel(logging.WARNING)
    from .tasks import charge_payment  # noqa: PLC0415

    tally = Tally()
    barrier.wait(timeout=60)
    for _ in range(rounds):
        for order_id in order_ids:
            result = charge_payment.delay(order_id)
            with sent.get_lock():
                sent.value += 1
            tally.calls += 1
            if result.deduplicated:
                tally.deduplicated += 1
            else:
                tally.accepted += 1
            tally.task_ids[order_id].add(result.id)
    results.put(Tally(tally.calls, tally.accepted, tally.deduplicated, dict(tally.task_ids)))


def race(
    order_ids: Sequence[int],
    sends: int,
    processes: int,
    timeout: float = 120.0,
    *,
    quiet: bool = True,
    progress: Callable[[int], None] | None = None,
) -> Tally:
    """Publish ``sends`` charge requests per order from ``processes`` processes at once; add up what they saw.

    ``progress`` is called with the number of sends so far, a few times a second.
    """
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(processes)
    results = context.Queue()
    sent = context.Value("q", 0)
    senders = [
        context.Process(target=send, args=(list(order_ids), rounds, barrier, results, sent, quiet), name=f"storm-{i}")
        for i, rounds in enumerate(shares(sends, processes))
    ]
    for process in senders:
        process.start()
    total = Tally()
    deadline = time.monotonic() + timeout

    def tick() -> None:
        if progress:
            progress(sent.value)

    try:
        for _ in senders:
            total.add(_next_result(results, senders, deadline, tick))
        tick()
    finally:
        for process in senders:
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join()
    return total


def _next_result(results: Any, senders: list[Any], deadline: float, tick: Callable[[], None]) -> Tally:
    """The next sender's tally; fails fast when a sender died without one, or time ran out."""
    while True:
        tick()
        try:
            tally: Tally = results.get(timeout=0.2)
        except queue.Empty:
            failed = [p.name for p in senders if p.exitcode not in (None, 0)]
            if failed:
                raise StormError(f"sender processes failed: {', '.join(failed)}") from None
            if time.monotonic() > deadline:
                raise StormError("the senders did not finish in time") from None
        else:
            return tally
