"""A producer process: keyed calls of every mode on a few hundred hot keys, each recorded.

``python -m chaos.workload --index I --seed S`` calls the chaos tasks (see
:mod:`chaos.app`) until SIGTERM. The schedule (which task, key, arguments and
way of calling, and the pauses between calls) comes from
``random.Random(seed)`` alone; what each call returns of course depends on
the run. Every call is recorded twice: ``call_start`` before it publishes
(a producer killed mid-publish leaves only that) and ``call`` with the outcome.

``--skew SECONDS`` runs the producer on a clock that far off: the ETAs it
computes, Celery's countdown-to-ETA conversion and the library's own reading
of the client clock (the delay an ETA adds to a key's hold) all see the
skewed time, as on a host whose clock is off.
"""

from __future__ import annotations

import argparse
import datetime
import math
import random
import signal
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

from celery import Celery
from celery.result import AsyncResult

import celery_dedup
import celery_dedup.publish.delay
from celery_dedup import DedupTask

from . import app as chaos_app
from .app import MODES, ModeSpec
from .history import History

#: Keys per mode; calls pick them with Zipf-like weights, so a few keys are very hot.
KEYS_PER_MODE = 35
#: Ways a call goes out on the two-phase gate (a store apart from the broker): ``send_task`` by name is
#: published ungated there, and a chained duplicate cannot follow its run (both as the guarantees say).
TWO_PHASE_WAYS = ("delay", "countdown", "eta", "many")
#: How each call is published, with its weight.
WAYS = {"delay": 40, "countdown": 12, "eta": 8, "many": 10, "send_task": 12, "chain": 10}
#: How many steps (``dedup_once``) a body takes, with their weights; and how often a call's steps raise in doubt.
STEPS = (0, 1, 2)
STEP_WEIGHTS = (50, 30, 20)
RAISE_ON_DOUBT = 0.2
#: How often a named group's call backs off once, and for how long (seconds: short, so the run comes back).
BACKOFF = 0.12
BACKOFF_SECONDS = (1.0, 2.0)
#: Modes' weights (by task: ``limit1`` and ``limit2`` are limited tasks, ``quota_a`` and ``quota_b`` share a named
#: group): the gated modes dominate.
MODE_WEIGHTS = {
    "until_executed": 30,
    "until_executing": 12,
    "until_expired": 12,
    "while_executing": 14,
    "debounce": 16,
    "throttle": 14,
    "limit1": 10,
    "limit2": 10,
    "quota_a": 12,
    "quota_b": 12,
}


@dataclass(frozen=True)
class Call:
    """One call of a chaos task: its key, the body's instructions, and how it is published."""

    call_id: str
    mode: ModeSpec
    k: str
    sleep: float
    fail: bool
    retry: bool
    way: str
    delay: float = 0.0
    #: ``Task.replace`` instead of returning: ``"same"`` key (the run goes on), ``"plain"`` task (it ends), or "".
    replace: str = ""
    #: Steps (``dedup_once``) the body takes, and what a step found in doubt does (``on_doubt``).
    steps: int = 0
    on_doubt: str = "retry"
    #: A named group's body backs off once (``dedup_backoff``) for this many seconds; 0: it does not.
    backoff: float = 0.0

    @property
    def args(self) -> tuple[Any, ...]:
        args = (self.k, self.call_id, self.sleep, self.fail, self.retry, self.replace, self.steps, self.on_doubt)
        return (*args, self.backoff) if self.backoff else args


@dataclass
class Schedule:
    """The producer's operations, drawn from one seeded generator."""

    seed: int
    prefix: str
    keys: int = KEYS_PER_MODE
    modes: tuple[str, ...] = tuple(MODE_WEIGHTS)
    ways: tuple[str, ...] = tuple(WAYS)
    rng: random.Random = field(init=False)
    #: Draws the steps of each call, apart from ``rng``: a seed's calls, keys and pauses stay what they were.
    step_rng: random.Random = field(init=False)
    #: Draws the back-offs of the named group's calls, apart from the others likewise.
    backoff_rng: random.Random = field(init=False)
    count: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.step_rng = random.Random(f"steps:{self.seed}")
        self.backoff_rng = random.Random(f"backoff:{self.seed}")

    def _backoff(self, mode: ModeSpec) -> float:
        if not mode.quota or self.backoff_rng.random() >= BACKOFF:
            return 0.0
        return round(self.backoff_rng.uniform(*BACKOFF_SECONDS), 2)

    def _key(self) -> str:
        weights = [1 / (i + 1) for i in range(self.keys)]
        return f"k{self.rng.choices(range(self.keys), weights)[0]}"

    def _sleep(self) -> float:
        roll = self.rng.random()
        if roll < 0.75:
            return round(self.rng.uniform(0.01, 0.2), 3)
        if roll < 0.97:
            return round(self.rng.uniform(0.2, 1.0), 3)
        return round(self.rng.uniform(4.0, 7.0), 3)  # renewed several times; outlives the visibility timeout

    def call(self, mode: ModeSpec, way: str) -> Call:
        self.count += 1
        roll = self.rng.random()
        delay = round(self.rng.uniform(0.2, 3.0), 3) if way in ("countdown", "eta") else 0.0
        return Call(
            call_id=f"{self.prefix}-{self.count}",
            mode=mode,
            k=self._key(),
            sleep=self._sleep(),
            fail=roll < 0.08,
            retry=0.08 <= roll < 0.16,
            way=way,
            delay=delay,
            replace="same" if 0.16 <= roll < 0.19 else "plain" if 0.19 <= roll < 0.2 else "",
            steps=self.step_rng.choices(STEPS, STEP_WEIGHTS)[0],
            on_doubt="raise" if self.step_rng.random() < RAISE_ON_DOUBT else "retry",
            backoff=self._backoff(mode),
        )

    def __iter__(self) -> Iterator[tuple[list[Call], float]]:
        """Batches of calls (one, or several for ``many``) and the pause after each."""
        modes = {spec.name: spec for spec in MODES}
        names = [name for name in MODE_WEIGHTS if name in self.modes]
        ways = [way for way in WAYS if way in self.ways]
        while True:
            mode = modes[self.rng.choices(names, [MODE_WEIGHTS[name] for name in names])[0]]
            way = self.rng.choices(ways, [WAYS[name] for name in ways])[0]
            size = self.rng.randint(2, 6) if way == "many" else 1
            batch = [self.call(mode, way) for _ in range(size)]
            yield batch, round(self.rng.uniform(0.05, 0.5), 3)


class SkewedDatetime(datetime.datetime):
    """``datetime.datetime`` whose ``now()`` is off by ``skew`` seconds."""

    skew = 0.0

    @classmethod
    def now(cls, tz: datetime.tzinfo | None = None) -> SkewedDatetime:
        real = datetime.datetime.now(tz) + datetime.timedelta(seconds=cls.skew)
        return cls.fromtimestamp(real.timestamp(), tz)


def skew_clock(app: Celery, seconds: float) -> None:
    """Run this process's publishing on a clock ``seconds`` off (see the module docstring).

    Where the library reads the client clock (``publish.delay.delay_seconds``) and where
    Celery turns a countdown into an ETA (``app.now``). Checked after
    patching: if the library reads the clock somewhere else one day, this
    says so instead of silently testing nothing.
    """
    SkewedDatetime.skew = seconds
    skewed = types.ModuleType("datetime")
    skewed.__dict__.update(vars(datetime), datetime=SkewedDatetime)
    vars(celery_dedup.publish.delay)["datetime"] = skewed  # the module the library reads the client clock from
    real_now = app.now
    app.now = lambda: real_now() + datetime.timedelta(seconds=seconds)  # type: ignore[method-assign]
    eta = app.now() + datetime.timedelta(seconds=5)
    seen = celery_dedup.publish.delay.delay_seconds(None, eta)
    if not math.isclose(seen, 5.0, abs_tol=0.5):
        raise RuntimeError(f"skew_clock: the library computed a delay of {seen:.1f}s for a 5s ETA; update chaos")


class Producer:
    """Runs a schedule against the chaos tasks, recording each call."""

    def __init__(self, app: Celery, history: History, schedule: Schedule) -> None:
        self.app = app
        self.history = history
        self.schedule = schedule
        self.tasks = {
            spec.name: cast(DedupTask, app.tasks[spec.task_name]) for spec in MODES if spec.task_name in app.tasks
        }
        self.stopping = False
        #: A chained duplicate's own head id: it follows the run, and resolves under this id.
        self.own_head = ""

    def run(self) -> None:
        for batch, pause in self.schedule:
            if self.stopping:
                return
            self.publish(batch)
            time.sleep(pause)

    def publish(self, batch: list[Call]) -> None:
        first = batch[0]
        task = self.tasks[first.mode.name]
        for call in batch:
            self.history.emit("call_start", **self._fields(call, task))
        try:
            ids = self._send(task, batch)
        except Exception as exc:  # every failure is an outcome to record
            for call in batch:
                self.history.emit(
                    "call",
                    outcome="error",
                    error=f"{type(exc).__name__}: {exc}"[:300],
                    published=getattr(exc, "published", None),
                    **self._fields(call, task),
                )
            return
        own, self.own_head = self.own_head, ""
        for call, (outcome, task_id) in zip(batch, ids, strict=True):
            extra = {"own": own} if own else {}
            self.history.emit("call", outcome=outcome, id=task_id, **extra, **self._fields(call, task))

    def _fields(self, call: Call, task: DedupTask) -> dict[str, Any]:
        return {
            "call": call.call_id,
            "task": task.name,
            "mode": call.mode.mode,
            "member": celery_dedup.keys.member_for(task.name, call.k),
            "way": call.way,
            "delay": call.delay,
            "sleep": call.sleep,
            "fail": call.fail,
            "retry": call.retry,
            "replace": call.replace,
            "steps": call.steps,
            "on_doubt": call.on_doubt,
            "backoff": call.backoff,
        }

    def _send(self, task: DedupTask, batch: list[Call]) -> list[tuple[str, str]]:
        """Publish the batch; ``(outcome, task id)`` per call."""
        first = batch[0]
        collapsed = "collapsed" if first.mode.parks else "duplicate"
        if first.way == "many":
            results = task.apply_async_many([(call.args, {}) for call in batch])
            return [(collapsed if r.deduplicated else "accepted", r.id) for r in results]
        if first.way == "send_task":
            sent = self.app.send_task(task.name, args=first.args)
            outcome = celery_dedup.last_outcome()
            if outcome is None or not first.mode.gated or outcome.task_id == sent.id:
                return [("accepted", sent.id)]
            return [(collapsed if outcome.collapsed else "duplicate", outcome.task_id)]
        if first.way == "chain":
            tail = (task.s(*first.args) | self.app.tasks["chaos.after"].s(first.call_id)).apply_async()
            head = str(cast("AsyncResult[Any]", tail.parent).id)
            outcome = celery_dedup.last_outcome()
            if outcome is None or not first.mode.gated or outcome.task_id == head:
                return [("accepted", head)]
            self.own_head = head
            return [(collapsed if outcome.collapsed else "duplicate", outcome.task_id)]
        options: dict[str, Any] = {}
        if first.way == "countdown":
            options["countdown"] = first.delay
        elif first.way == "eta":
            options["eta"] = self.app.now() + datetime.timedelta(seconds=first.delay)
        result = task.apply_async(first.args, **options)
        return [(collapsed if result.deduplicated else "accepted", result.id)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--generation", type=int, default=0)
    parser.add_argument("--skew", type=float, default=0.0)
    parser.add_argument("--keys", type=int, default=KEYS_PER_MODE)
    parser.add_argument("--modes", default=",".join(MODE_WEIGHTS))
    options = parser.parse_args(argv)
    history = chaos_app.history_from_env()
    if history is None:
        raise SystemExit("CHAOS_RUN_DIR is not set")
    app = chaos_app.app
    if options.skew:
        skew_clock(app, options.skew)
    prefix = f"p{options.index}.{options.generation}"
    ways = TWO_PHASE_WAYS if app.conf.get("dedup_redis_url") else tuple(WAYS)
    schedule = Schedule(options.seed, prefix, options.keys, tuple(options.modes.split(",")), ways)
    producer = Producer(app, history, schedule)

    def stop(*_: Any) -> None:
        producer.stopping = True

    signal.signal(signal.SIGTERM, stop)
    history.emit("producer_start", index=options.index, seed=options.seed, skew=options.skew)
    producer.run()
    history.emit("producer_stop", index=options.index, calls=producer.schedule.count)


if __name__ == "__main__":
    main()
