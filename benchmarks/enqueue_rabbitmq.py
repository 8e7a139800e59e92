"""Enqueue cost on a RabbitMQ broker: a plain Celery task against a DedupTask, with and without publisher confirms.

What it measures: calls per second and the p50/p99 latency of ``apply_async``
on a private RabbitMQ node (``tests.servers.RabbitMQNode``), the dedup
store on a private Redis-compatible server (``dedup_redis_url``), for

- ``plain, no confirms``: an ordinary task, Celery's default publish;
- ``plain``: the same with publisher confirms (``confirm_publish``: each
  publish waits for the broker's ack);
- ``dedup new key``: a DedupTask keyed ``"order:{order_id}"``, with a key no
  call has used before, publisher confirms on (the two-phase gate turns
  them on);
- ``dedup duplicate``: the same DedupTask with a key already held (nothing is
  published);

each ``--calls`` calls from one thread and from several (``--threads``; the
calls are split between them, each thread publishes through a producer of its
own). Cases run one after the other in each repeat, the order rotating every
repeat; between cases the queue is checked to hold exactly one message per
publishing call, then purged. The Redis commands a call sends (each a round
trip, unless pipelined) and those run inside Lua are counted with ``MONITOR``
over ``--rt-calls`` separate, untimed calls of each case from one thread.

Run it from the repository root::

    .venv/bin/python -m benchmarks.enqueue_rabbitmq [--calls 2000] [--threads 1,4] [--repeats 3]

It needs RabbitMQ (Debian's ``rabbitmq-server``; ``run-tests`` installs it as
root) and says so, exiting 0, where it is missing. Prints a Markdown table and
writes ``benchmarks/results/enqueue_rabbitmq.json``. Nothing here asserts on
time; the numbers are for reading.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from celery import Celery
from kombu import Connection

import celery_dedup
from benchmarks import harness
from celery_dedup import DedupTask
from celery_dedup.testing import RedisServer
from tests.servers import RabbitMQNode, RabbitMQNotFound

QUEUE = "bench-enqueue-rabbitmq"
DUPLICATE_ORDER = 0  # new-key calls count up from 1, so they never meet the held key

#: A call through the given producer.
Call = Callable[[Any], None]


@dataclass
class Case:
    """One measured way of calling ``apply_async``; per thread count, one sample per repeat."""

    name: str
    confirms: bool
    call: Call
    publishes: bool
    samples: dict[int, list[Sample]] = field(default_factory=dict)


@dataclass
class Sample:
    """One run of a case: its calls per second and every call's latency in µs."""

    calls_per_s: float
    latencies_us: list[float]


def build_app(broker: str, store: str, *, confirms: bool, queue_type: str) -> Celery:
    app = Celery(f"bench_rabbitmq_{'confirms' if confirms else 'no_confirms'}", set_as_current=False)
    app.conf.update(
        broker_url=broker,
        dedup_redis_url=store,
        task_default_queue=QUEUE,
        task_default_queue_type=queue_type,
        task_ignore_result=True,
        broker_connection_retry_on_startup=False,
        broker_transport_options={"confirm_publish": confirms},
    )
    celery_dedup.install(app)
    return app


class Bench:
    """The two apps (publisher confirms on and off), their tasks, and the order ids new keys take."""

    def __init__(self, broker: str, store: str, queue_type: str) -> None:
        self.broker = broker
        self.confirming = build_app(broker, store, confirms=True, queue_type=queue_type)
        self.unconfirmed = build_app(broker, store, confirms=False, queue_type=queue_type)
        self.orders = itertools.count(1)  # next() on it is atomic under the GIL: threads share it

        # Same signature and argument everywhere: the messages differ only in the task name.
        @self.unconfirmed.task(name="bench.plain_unconfirmed", shared=False)
        def plain_unconfirmed(order_id: int) -> None:
            return None

        @self.confirming.task(name="bench.plain", shared=False)
        def plain(order_id: int) -> None:
            return None

        @self.confirming.task(name="bench.keyed", base=DedupTask, dedup_key="order:{order_id}", shared=False)
        def keyed(order_id: int) -> None:
            return None

        self.plain_unconfirmed, self.plain, self.keyed = plain_unconfirmed, plain, keyed

    def cases(self) -> list[Case]:
        return [
            Case("plain, no confirms", False, self.call_plain_unconfirmed, publishes=True),
            Case("plain", True, self.call_plain, publishes=True),
            Case("dedup new key", True, self.call_new_key, publishes=True),
            Case("dedup duplicate", True, self.call_duplicate, publishes=False),
        ]

    def app_of(self, case: Case) -> Celery:
        return self.confirming if case.confirms else self.unconfirmed

    def call_plain_unconfirmed(self, producer: Any) -> None:
        self.plain_unconfirmed.apply_async((next(self.orders),), producer=producer)

    def call_plain(self, producer: Any) -> None:
        self.plain.apply_async((next(self.orders),), producer=producer)

    def call_new_key(self, producer: Any) -> None:
        if self.keyed.apply_async((next(self.orders),), producer=producer).deduplicated:
            raise RuntimeError("a new key was answered as a duplicate")

    def call_duplicate(self, producer: Any) -> None:
        if not self.keyed.apply_async((DUPLICATE_ORDER,), producer=producer).deduplicated:
            raise RuntimeError("a call with the held key published")

    def hold_duplicate_key(self) -> None:
        """Make the duplicate case's key held (its message is purged with the queue; the key stays)."""
        first = self.keyed.apply_async((DUPLICATE_ORDER,))
        again = self.keyed.apply_async((DUPLICATE_ORDER,))
        if first.deduplicated or not again.deduplicated or again.id != first.id:
            raise RuntimeError(f"the duplicate key is not held as expected: {first.id!r} vs {again.id!r}")

    def queued(self) -> int:
        with Connection(self.broker) as connection:
            channel: Any = connection.default_channel
            return int(channel.queue_declare(QUEUE, passive=True).message_count)

    def purge(self, expected: int) -> None:
        """Check the queue holds ``expected`` messages (waiting for unconfirmed ones to land), then empty it."""
        deadline = time.monotonic() + 30
        while (queued := self.queued()) != expected:
            if queued > expected or time.monotonic() > deadline:
                raise RuntimeError(f"queue holds {queued} messages, expected {expected}: a case misbehaved")
            time.sleep(0.05)
        with Connection(self.broker) as connection:
            channel: Any = connection.default_channel
            channel.queue_purge(QUEUE)

    def close(self) -> None:
        self.confirming.close()
        self.unconfirmed.close()


@contextlib.contextmanager
def connected_producer(app: Celery) -> Iterator[Any]:
    """A producer of ``app`` with its connection open, for one thread."""
    with app.producer_or_acquire() as producer:
        producer.connection.ensure_connection()
        yield producer


def run_case(bench: Bench, case: Case, calls: int, threads: int) -> Sample:
    gc.collect()
    app = bench.app_of(case)
    rate, latencies = harness.threaded(
        lambda producer, _: case.call(producer), calls, threads, around=lambda _: connected_producer(app)
    )
    bench.purge(calls if case.publishes else 0)
    return Sample(rate, latencies)


def count_round_trips(bench: Bench, case: Case, calls: int, url: str) -> dict[str, Any]:
    """Redis commands per call of ``case`` from one thread: sent by the client, and run inside Lua."""
    with bench.app_of(case).producer_or_acquire() as producer:
        counted = harness.count_commands(url, lambda: case.call(producer), calls)
    bench.purge(calls if case.publishes else 0)
    return {
        "commands_sent_per_call": counted["round_trips_per_call"],
        "lua_commands_per_call": sum(counted["lua_commands_per_call"].values()),
        "client_commands_per_call": counted["client_commands_per_call"],
        "commands_inside_lua_per_call": counted["lua_commands_per_call"],
    }


def summarize(
    cases: Sequence[Case], thread_counts: Sequence[int], trips: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for threads in thread_counts:
        for case in cases:
            samples = case.samples[threads]
            rates = [s.calls_per_s for s in samples]
            pooled = [t for s in samples for t in s.latencies_us]
            rows.append(
                {
                    "case": case.name,
                    "publisher_confirms": case.confirms,
                    "threads": threads,
                    "calls_per_repeat": len(samples[0].latencies_us),
                    "repeats": len(samples),
                    "calls_per_s": statistics.median(rates),
                    "repeat_calls_per_s": rates,
                    "p50_us": harness.percentile(pooled, 0.50),
                    "p99_us": harness.percentile(pooled, 0.99),
                    **trips[case.name],
                }
            )
        base = next(r["calls_per_s"] for r in rows if r["threads"] == threads and r["case"] == "plain")
        for row in rows:
            if row["threads"] == threads:
                row["ratio_to_plain"] = row["calls_per_s"] / base
    return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
    return harness.table(
        [
            "case",
            "publisher confirms",
            "threads",
            "calls/s (median)",
            "per-repeat min",
            "max",
            "p50 µs",
            "p99 µs",
            "calls/s vs plain with confirms",
            "Redis commands sent/call",
            "Redis commands inside Lua/call",
        ],
        [
            [
                row["case"],
                "on" if row["publisher_confirms"] else "off",
                row["threads"],
                row["calls_per_s"],
                min(row["repeat_calls_per_s"]),
                max(row["repeat_calls_per_s"]),
                row["p50_us"],
                row["p99_us"],
                f"{row['ratio_to_plain']:.2f}x",
                row["commands_sent_per_call"],
                row["lua_commands_per_call"],
            ]
            for row in rows
        ],
    )


def parse_args(script: harness.Script, argv: Sequence[str] | None) -> argparse.Namespace:
    script.option("--calls", 2000, "calls per case, thread count, repeat")
    script.option("--threads", "1,4", "thread counts, comma-separated", minimum=None)
    script.option("--repeats", 3, "repeats")
    script.option("--warmup", 200, "untimed calls per case and thread count first", minimum=0)
    script.option("--rt-calls", 100, "calls per case for command counts")
    script.option("--queue-type", "classic", "the task queue's type", choices=("classic", "quorum"))
    args = script.parse(argv)
    try:
        args.threads = [int(n) for n in args.threads.split(",") if n.strip()]
    except ValueError:
        script.parser.error("--threads takes comma-separated integers")
    if not args.threads or min(args.threads) < 1:
        script.parser.error("--threads needs thread counts of at least 1")
    if args.calls < max(args.threads):
        script.parser.error("--calls must be at least the largest thread count")
    return args


@dataclass
class Run:
    """Everything one run measured, for the table and the JSON file."""

    broker_version: str
    node_start_s: float
    store_version: str
    elapsed_s: float
    rows: list[dict[str, Any]]


def measure(script: harness.Script, args: argparse.Namespace, node: RabbitMQNode) -> Run:
    """Start the node and a Redis server, time the cases, and stop both."""
    with RedisServer() as store, node:
        assert node.started_in is not None
        broker_version = node.version()
        script.header(
            f"broker: {broker_version}, a private node started in {node.started_in:.1f} s",
            f"dedup store: {store.binary} ({store.version()})",
        )
        bench = Bench(node.url, store.url, args.queue_type)
        try:
            cases = bench.cases()
            bench.hold_duplicate_key()
            bench.purge(1)
            for threads in args.threads:
                for case in cases:
                    if args.warmup:
                        run_case(bench, case, max(args.warmup, threads), threads)
            started = time.monotonic()
            for repeat in range(args.repeats):
                for threads in args.threads:
                    for case in cases[repeat % len(cases) :] + cases[: repeat % len(cases)]:
                        case.samples.setdefault(threads, []).append(run_case(bench, case, args.calls, threads))
                harness.progress(f"repeat {repeat + 1}/{args.repeats} done")
            elapsed = time.monotonic() - started
            trips = {case.name: count_round_trips(bench, case, args.rt_calls, store.url) for case in cases}
        finally:
            bench.close()
        return Run(
            broker_version,
            node.started_in,
            store.version(),
            elapsed,
            summarize(cases, args.threads, trips),
        )


def print_report(args: argparse.Namespace, run: Run) -> None:
    print()
    print(
        f"apply_async on RabbitMQ ({args.queue_type} queue): {args.calls} calls per case and thread count x "
        f"{args.repeats} repeats, {run.elapsed_s:.1f} s"
    )
    print()
    print(table(run.rows))
    print()
    print(
        f"Redis commands per call from MONITOR over {args.rt_calls} more calls per case from one thread: each one "
        "sent is a round trip unless pipelined. A duplicate publishes nothing."
    )


def main(argv: Sequence[str] | None = None) -> int:
    script = harness.Script("enqueue_rabbitmq", __doc__, packages=("amqp",))
    args = parse_args(script, argv)
    try:
        node = RabbitMQNode()
    except RabbitMQNotFound as exc:
        print(f"skipped: {exc}; run-tests installs it when run as root")
        return 0
    run = measure(script, args, node)
    print_report(args, run)
    script.save(
        args,
        {
            "broker": {"version": run.broker_version, "node_start_s": run.node_start_s, "queue_type": args.queue_type},
            "store": {"version": run.store_version},
            "timing": run.rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
