"""Redis memory per in-flight key and per status record, on a real Redis-compatible server.

What it measures: ``--keys`` keyed tasks with unique keys are enqueued through
the real gate (``DedupTask.apply_async`` on an installed app: the transport's
Lua script holds the key, writes the record, indexes and history, and LPUSHes
the message Celery built). Then every key runs through the worker-side guard
calls a real execution makes (``DedupStore.start``, then ``DedupStore.finish``
with ``succeeded``), without a worker, so the three states can be measured on
all keys at once:

- **queued**: after the gate (the queue list holds every message);
- **running**: after ``start`` (execution lock taken, record says started);
- **finished**: after ``finish`` (key released, record kept for ``dedup_record_ttl``).

Each state is measured two ways: ``INFO memory`` ``used_memory`` deltas over
all keys (everything: the keyspace's own tables and expiry entries too), and
``MEMORY USAGE ... SAMPLES 0`` per structure: the shared sets (held set,
indexes, queue) whole, divided by the key count, and the per-key hashes,
lists and locks on ``--sample`` random keys (mean). What ``MEMORY USAGE`` does
not see (the keyspace's hash table slots, the expiry entries) is the
difference, shown as its own row.

A smaller table repeats the per-key record measurements with other worker
host names and argument sizes, because a record's encoding (compact listpack
or a real hash table) flips on its longest value.

A last table runs one key ``--runs`` times under ``throttle`` and under
``until_expired`` (a short window, waited out between runs), each run through
the gate, ``start`` and ``finish`` with the return value those modes keep for
the followers of their window, and gives the key's bytes (every structure of
its member) and its kept outcomes after some of those runs: a key that keeps
running must not grow with its runs. (What still grows, up to 1000 entries,
is the key's memory of its ended runs pushed out of its record, so a late copy
of an old run is still recognised: shown apart.)

Run it from the repository root::

    .venv/bin/python -m benchmarks.memory [--keys 100000] [--sample 1000] [--runs 100] [--output FILE]

It starts its own server (``celery_dedup.testing.RedisServer``), prints
Markdown tables and writes ``benchmarks/results/memory.json``. Library code
is not changed; the notes it prints say what dominates and what could shrink it.
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
from celery import Celery

import celery_dedup
from benchmarks import harness
from celery_dedup import DedupTask, runtime
from celery_dedup.keys import KeySchema, member_for, task_namespace
from celery_dedup.payloads import result_payload
from celery_dedup.store.status import is_history_field
from celery_dedup.store.store import DedupStore
from celery_dedup.testing import RedisServer
from celery_dedup.worker.lock import new_token
from celery_dedup.worker.processes import HOST_CHARS, owner_of

QUEUE = "bench-memory"
TASK = "shop.orders.charge"
FIRST_ORDER = 10_000_000  # eight-digit order ids, as a shop's would be
#: A Docker container's default host name (12 hex chars) and a prefork child's pid inside it.
DEFAULT_HOST = "3f9c2a71d0be"
DEFAULT_PID = 27
#: A Kubernetes pod name: deployment, replica-set hash, pod suffix.
POD_HOST = "celery-worker-7d9f8b6c5d-x2x4q"
OWNER_FIELDS = ("task_id", "nonce", "held_until")
#: Per-key structures MEMORY USAGE sees (owner_fields is part of record).
ATTRIBUTED = ("held", "record", "history", "idx", "idx_state", "idx_task", "idx_name", "lock")
STATES = ("queued", "running", "finished")
LOCK_MS = 60_000
TARGET_IN_FLIGHT = 200  # bytes, stated by the issue


@dataclass
class Variant:
    """One way of running keys through the gate and the guard."""

    name: str
    prefix: str
    hostname: str
    note: str = ""
    record_args: bool = True


@dataclass
class Keys:
    """The keys one variant enqueued: members and the task ids the gate accepted."""

    members: list[str] = field(default_factory=list)
    task_ids: list[str] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)


def build_app(url: str, variant: Variant) -> tuple[Celery, Any]:
    app = Celery(f"bench_memory_{variant.prefix}", set_as_current=False)
    app.conf.update(
        broker_url=url,
        task_default_queue=QUEUE,
        task_ignore_result=True,
        broker_connection_retry_on_startup=False,
        dedup_key_prefix=variant.prefix,
        dedup_record_args=variant.record_args,
    )
    celery_dedup.install(app)

    @app.task(name=TASK, base=DedupTask, dedup_key="order:{order_id}", ignore_result=True, shared=False)
    def charge(order_id: int, amount: int = 0, note: str = "") -> None:
        return None

    return app, charge


def token_for(hostname: str) -> str:
    """A lock token as ``celery_dedup.worker.lock.new_token`` makes it, for pid ``DEFAULT_PID`` on host ``hostname``."""
    real = new_token()  # this process's start time and machine: the other parts' real lengths
    owner = owner_of(real)
    if owner is None:
        raise RuntimeError(f"new_token's format changed ({real!r}); update token_for")
    return f"{hostname[:HOST_CHARS]}:{DEFAULT_PID}:{owner.start}:{owner.machine}:{secrets.token_hex(4)}"


def enqueue(app: Celery, task: Any, count: int, *, note: str, rng: random.Random) -> Keys:
    """``count`` gated publishes with unique keys, through the real ``apply_async``."""
    keys = Keys()
    with app.producer_or_acquire() as producer:
        for i in range(count):
            order_id = FIRST_ORDER + i
            kwargs = {"note": note} if note else {}
            result = task.apply_async((order_id, rng.randrange(100, 100_000)), kwargs, producer=producer)
            if result.deduplicated:
                raise RuntimeError(f"order {order_id}: a fresh key was treated as a duplicate")
            keys.members.append(member_for(TASK, f"order:{order_id}"))
            keys.task_ids.append(result.id)
    return keys


def start_all(store: DedupStore, keys: Keys, hostname: str) -> None:
    """What the guard sends when each delivery starts (one ``start`` per key)."""
    for member, task_id in zip(keys.members, keys.task_ids, strict=True):
        token = token_for(hostname)
        harness.start_run(
            store,
            member,
            task_id,
            token,
            lock_ms=LOCK_MS,
            hostname=f"celery@{hostname}",
            pid=DEFAULT_PID,
        )
        keys.tokens.append(token)


def finish_all(store: DedupStore, keys: Keys) -> None:
    """What the guard sends when each delivery succeeds (one ``finish`` per key)."""
    for member, task_id, token in zip(keys.members, keys.task_ids, keys.tokens, strict=True):
        owned, lock_kept, _ = store.finish(
            member, task_id, "succeeded", drop=True, record_ms=86_400_000, token=token, role="run"
        )
        if not (owned and lock_kept):
            raise RuntimeError(f"{member}: finish found owned={owned} lock_kept={lock_kept}")


# --- measuring -----------------------------------------------------------------------------------


def used_memory(client: redis.Redis) -> int:
    """``used_memory`` once no lazy free is pending (Valkey frees deleted keys on a background thread)."""
    for _ in range(500):
        info = client.info("memory")
        if int(info.get("lazyfree_pending_objects", 0)) == 0:
            return int(info["used_memory"])
        time.sleep(0.01)
    raise TimeoutError("lazy free still pending after 5 s")


def _is_entry(field: bytes | str) -> bool:
    """Whether a record field is one of format 2's history entries (``h<n>``; not the counter ``hn``)."""
    name = field.decode() if isinstance(field, bytes) else field
    return is_history_field(name) and name != "hn"


def usage(client: redis.Redis, key: str) -> int:
    """``MEMORY USAGE key SAMPLES 0`` (every element counted); 0 for a missing key."""
    return int(client.memory_usage(key, samples=0) or 0)


def sample_usage(client: redis.Redis, keys: Sequence[str]) -> tuple[float, Counter[str]]:
    """Mean ``MEMORY USAGE`` over ``keys`` (missing keys count 0) and their encodings."""
    with client.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.memory_usage(key, samples=0)
            pipe.object("encoding", key)
        replies = pipe.execute()
    sizes = [int(size or 0) for size in replies[0::2]]
    encodings = Counter(str(enc.decode() if isinstance(enc, bytes) else enc) for enc in replies[1::2] if enc)
    return statistics.fmean(sizes), encodings


def owner_field_bytes(client: redis.Redis, records: Sequence[str]) -> float:
    """Mean bytes the owner and deadline fields add to a record: a copy's usage with them minus without."""
    scratch = "bench-memory-scratch"
    diffs = []
    for record in records:
        fields: dict[Any, Any] = client.hgetall(record)
        if not fields:
            continue
        client.delete(scratch)
        client.hset(scratch, mapping=fields)
        whole = usage(client, scratch)
        client.hdel(scratch, *OWNER_FIELDS)
        diffs.append(whole - usage(client, scratch))
    client.delete(scratch)
    return statistics.fmean(diffs) if diffs else 0.0


def v1_key(schema: KeySchema, kind: str, part: str = "") -> str:
    """A key of the stored format 1 that format 2 no longer writes (``idx``, ``idx:task:N``, ``hist:M``): 0 B now."""
    return f"{schema.prefix}:{kind}{part}"


def measure_state(
    client: redis.Redis, schema: KeySchema, keys: Keys, sample: Sequence[int], base: int, *, queue_key: str | None
) -> dict[str, Any]:
    """Bytes per key of every structure celery-dedup keeps, in the current state."""
    count = len(keys.members)
    members = [keys.members[i] for i in sample]
    namespace = task_namespace(TASK)
    shared = {
        "held": schema.held,
        "idx": v1_key(schema, "idx"),
        "idx_name": schema.name_index,
        "idx_task": v1_key(schema, "idx:task:", namespace),
        **{f"idx_state_{state}": schema.state_index(state) for state in ("queued", "started", "succeeded")},
    }
    per_key = {name: usage(client, key) / count for name, key in shared.items()}
    per_key["idx_state"] = sum(v for k, v in per_key.items() if k.startswith("idx_state_"))
    record, record_enc = sample_usage(client, [schema.record(m) for m in members])
    history, history_enc = sample_usage(client, [v1_key(schema, "hist:", m) for m in members])
    lock, _ = sample_usage(client, [schema.lock(m) for m in members])
    per_key.update(record=record, history=history, lock=lock)
    per_key["owner_fields"] = owner_field_bytes(client, [schema.record(m) for m in members])
    queue_bytes = usage(client, queue_key) / count if queue_key else 0.0
    total = used_memory(client) - base
    attributed = sum(per_key[k] for k in ATTRIBUTED)
    # Format 1 keeps the history in a list of its own; format 2 in the record (``h<n>`` fields, counted in ``record``).
    history_len = statistics.fmean(
        int(client.llen(v1_key(schema, "hist:", m))) + sum(1 for f in client.hkeys(schema.record(m)) if _is_entry(f))
        for m in members
    )
    name_bytes = statistics.fmean(sum(len(f) for f in client.hkeys(schema.record(m))) for m in members)
    record_fields = statistics.fmean(int(client.hlen(schema.record(m))) for m in members)
    return {
        "bytes_per_key": per_key,
        "record_encodings": dict(record_enc),
        "history_encodings": dict(history_enc),
        "record_fields_mean": record_fields,
        "record_field_name_bytes_mean": name_bytes,
        "history_entries_mean": history_len,
        "queue_bytes_per_message": queue_bytes,
        # Everything since the baseline, the queue included while it exists (measure_main takes it out).
        "used_memory_delta_per_key": total / count,
        "attributed_per_key": attributed,
    }


@dataclass
class Run:
    """Everything one run measured."""

    server_binary: str
    server_version: str
    config: dict[str, str]
    states: dict[str, dict[str, Any]]
    queue_used_memory_per_message: float
    message_bytes_mean: float
    #: Bytes of the message's ``"dedup": {...}`` header entry, as JSON.
    dedup_header_bytes: int
    variants: list[dict[str, Any]]
    #: Per mode: one key's bytes and kept outcomes after some of its runs.
    repeated: dict[str, list[dict[str, Any]]]
    elapsed_s: float


def clear(client: redis.Redis, prefix: str) -> None:
    batch: list[bytes] = []
    for key in client.scan_iter(match=f"{prefix}:*", count=1000):
        batch.append(key)
        if len(batch) >= 1000:
            client.delete(*batch)
            batch.clear()
    if batch:
        client.delete(*batch)


def measure_main(
    client: redis.Redis, url: str, args: argparse.Namespace, rng: random.Random
) -> tuple[dict[str, dict[str, Any]], float, float, int]:
    """The main run: ``--keys`` keys through queued, running and finished."""
    variant = Variant("main", "dedup", DEFAULT_HOST)
    app, task = build_app(url, variant)
    store = runtime.store_for(app)
    schema = store.schema
    try:
        # Warm-up: the queue's binding, the scripts and the shared keys exist before the baseline.
        enqueue(app, task, 1, note="", rng=rng)
        clear(client, variant.prefix)
        client.delete(QUEUE)
        base = used_memory(client)
        started = time.monotonic()
        keys = enqueue(app, task, args.keys, note="", rng=rng)
        print(f"enqueued {args.keys} keys in {time.monotonic() - started:.1f} s", file=sys.stderr)
        if int(client.llen(QUEUE)) != args.keys or int(client.scard(schema.held)) != args.keys:
            raise RuntimeError("the queue or the held set does not hold one entry per key")
        sample = rng.sample(range(args.keys), min(args.sample, args.keys))
        states = {"queued": measure_state(client, schema, keys, sample, base, queue_key=QUEUE)}
        message_bytes = statistics.fmean(len(client.lindex(QUEUE, i) or b"") for i in sample)
        message = json.loads(client.lindex(QUEUE, 0) or b"{}")
        header_bytes = len(json.dumps({"dedup": message["headers"]["dedup"]})) - 2
        with_queue = used_memory(client)
        client.delete(QUEUE)  # a worker would have taken the messages by the time they run
        queue_per_message = (with_queue - used_memory(client)) / args.keys
        # The queued state's celery-dedup share: its used_memory delta without the messages.
        states["queued"]["dedup_used_memory_per_key"] = (
            states["queued"]["used_memory_delta_per_key"] - queue_per_message
        )
        start_all(store, keys, variant.hostname)
        states["running"] = measure_state(client, schema, keys, sample, base, queue_key=None)
        finish_all(store, keys)
        states["finished"] = measure_state(client, schema, keys, sample, base, queue_key=None)
        for name in ("running", "finished"):
            states[name]["dedup_used_memory_per_key"] = states[name]["used_memory_delta_per_key"]
        for measured in states.values():
            measured["unattributed_per_key"] = measured["dedup_used_memory_per_key"] - measured["attributed_per_key"]
        if int(client.exists(schema.held)) or int(client.zcard(schema.state_index("succeeded"))) != args.keys:
            raise RuntimeError("after finish every key should be released and every record succeeded")
        clear(client, variant.prefix)
    finally:
        app.close()
    return states, queue_per_message, message_bytes, header_bytes


def measure_variants(client: redis.Redis, url: str, count: int, rng: random.Random) -> list[dict[str, Any]]:
    """The record alone, for ``count`` keys per variant: host names and argument sizes."""
    payload = "gift wrap, deliver after 18:00, leave with the concierge if nobody answers the door"
    variants = [
        # One prefix for all (each variant clears its keys first), so key names are the main run's.
        Variant(f"short host ({len(DEFAULT_HOST)} chars), short args", "dedup", DEFAULT_HOST),
        Variant("short host, dedup_record_args=False", "dedup", DEFAULT_HOST, record_args=False),
        Variant(f"Kubernetes pod host ({len(POD_HOST)} chars)", "dedup", POD_HOST),
        Variant(f"short host, a {len(payload)}-char string argument", "dedup", DEFAULT_HOST, note=payload),
    ]
    rows = []
    for variant in variants:
        clear(client, variant.prefix)
        app, task = build_app(url, variant)
        store = runtime.store_for(app)
        try:
            keys = enqueue(app, task, count, note=variant.note, rng=rng)
            client.delete(QUEUE)
            records = [store.schema.record(m) for m in keys.members]
            row: dict[str, Any] = {"variant": variant.name, "hostname": variant.hostname}
            for state in STATES:
                if state == "running":
                    start_all(store, keys, variant.hostname)
                elif state == "finished":
                    finish_all(store, keys)
                size, encodings = sample_usage(client, records)
                row[state] = {"record_bytes": size, "record_encodings": dict(encodings)}
            row["token_length"] = len(keys.tokens[0])
            rows.append(row)
            clear(client, variant.prefix)
        finally:
            app.close()
    return rows


#: The windowed modes that keep a run's return value after it succeeded, with their options (a short window).
REPEATED_MODES = {
    "throttle": {"dedup_mode": "throttle", "dedup_window": 0.02},
    "until_expired": {"dedup_mode": "until_expired", "dedup_ttl": 0.02},
}
#: Runs after which the repeated key is measured (those up to --runs).
CHECKPOINTS = (1, 2, 10, 29, 100, 1000)


def member_bytes(client: redis.Redis, schema: KeySchema, member: str) -> int:
    """``MEMORY USAGE`` of every key of one member (the held set and indexes are shared: not counted)."""
    keys = (schema.record, schema.lock, schema.ended, schema.followers, schema.outcomes)
    return sum(usage(client, key(member)) for key in keys) + usage(client, v1_key(schema, "hist:", member))


def run_repeatedly(
    client: redis.Redis, url: str, mode: str, options: dict[str, Any], runs: int, rng: random.Random
) -> list[dict[str, Any]]:
    """One key of a ``mode`` task run ``runs`` times as a worker would; what it holds at each checkpoint."""
    app = Celery(f"bench_memory_repeated_{mode}", set_as_current=False)
    app.conf.update(
        broker_url=url, task_default_queue=QUEUE, broker_connection_retry_on_startup=False, dedup_key_prefix="dedup"
    )
    celery_dedup.install(app)
    name = f"shop.orders.{mode}"

    @app.task(name=name, base=DedupTask, dedup_key="order:{order_id}", shared=False, **options)
    def charge(order_id: int, amount: int = 0) -> None:
        return None

    store = runtime.store_for(app)
    schema = store.schema
    member = member_for(name, f"order:{FIRST_ORDER}")
    rows = []
    try:
        clear(client, "dedup")
        for run in range(1, runs + 1):
            amount = rng.randrange(100, 100_000)
            result = charge.apply_async((FIRST_ORDER, amount))
            if result.deduplicated:
                raise RuntimeError(f"{mode} run {run}: the key was still held")
            client.delete(QUEUE)
            token = token_for(DEFAULT_HOST)
            harness.start_run(
                store,
                member,
                result.id,
                token,
                lock_ms=LOCK_MS,
                hostname=f"celery@{DEFAULT_HOST}",
                pid=DEFAULT_PID,
                key_mode="window",
            )
            # What such a run returns and the guard keeps for its window's followers.
            value = {"order_id": FIRST_ORDER, "amount": amount, "status": "charged", "receipt": secrets.token_hex(16)}
            store.finish(
                member,
                result.id,
                "succeeded",
                drop=False,
                record_ms=86_400_000,
                token=token,
                role="run",
                result=result_payload(app, value),
            )
            if run in CHECKPOINTS or run == runs:
                rows.append(
                    {
                        "runs": run,
                        "member_bytes": member_bytes(client, schema, member),
                        "outcomes": int(client.hlen(schema.outcomes(member))),
                        "outcomes_bytes": usage(client, schema.outcomes(member)),
                        "ended_bytes": usage(client, schema.ended(member)),
                    }
                )
            held_until = int(client.hget(schema.record(member), "held_until") or 0)
            while harness.server_ms(client) <= held_until:
                time.sleep(0.005)
        clear(client, "dedup")
    finally:
        app.close()
    return rows


def measure_repeated(client: redis.Redis, url: str, runs: int, rng: random.Random) -> dict[str, list[dict[str, Any]]]:
    """One key run ``runs`` times under each mode of ``REPEATED_MODES``."""
    return {mode: run_repeatedly(client, url, mode, options, runs, rng) for mode, options in REPEATED_MODES.items()}


def measure(script: harness.Script, args: argparse.Namespace) -> Run:
    rng = random.Random(args.seed)
    with RedisServer() as server:
        server_version = server.version()
        script.header(f"server: {server.binary} ({server_version})")
        client: redis.Redis = redis.Redis.from_url(server.url)
        config = {
            str(k): str(v)
            for k, v in client.config_get("*listpack*").items()
            if str(k).startswith(("hash-", "zset-", "set-", "list-"))
        }
        print("server encodings: " + ", ".join(f"{k} {v}" for k, v in sorted(config.items())), flush=True)
        started = time.monotonic()
        try:
            states, queue_per_message, message_bytes, header_bytes = measure_main(client, server.url, args, rng)
            variants = measure_variants(client, server.url, args.variant_keys, rng)
            repeated = measure_repeated(client, server.url, args.runs, rng)
        finally:
            client.close()
        return Run(
            server.binary,
            server_version,
            config,
            states,
            queue_per_message,
            message_bytes,
            header_bytes,
            variants,
            repeated,
            time.monotonic() - started,
        )


# --- output --------------------------------------------------------------------------------------

ROWS = (
    ("held", "held set member (`dedup:held`, SET)", "set / keys"),
    ("record", "status record (`dedup:rec:M`, HASH), whole key (format 2: history included)", "sample mean"),
    ("owner_fields", "\N{EM SPACE}of which owner + deadline fields (task_id, nonce, held_until)", "sample, copy minus"),
    ("history", "history list (`dedup:hist:M`, LIST; format 2: 0, its entries are in the record)", "sample mean"),
    ("idx", "index `dedup:idx` (ZSET, all records; format 1 only)", "zset / keys"),
    ("idx_state", "index `dedup:idx:state:<state>` (ZSET)", "zsets / keys"),
    ("idx_task", "index `dedup:idx:task:<task>` (ZSET; format 1 only)", "zset / keys"),
    ("idx_name", "index `dedup:idx:name` (ZSET, key-prefix search)", "zset / keys"),
    ("lock", "execution lock (`dedup:lock:M`, STRING)", "sample mean"),
)


def structure_table(run: Run) -> str:
    lines = [
        "| structure | queued | running | finished | measured as |",
        "|---|---:|---:|---:|---|",
    ]
    states = run.states
    for key, label, how in ROWS:
        values = " | ".join(f"{states[s]['bytes_per_key'][key]:.0f}" for s in STATES)
        lines.append(f"| {label} | {values} | {how} |")
    sums = " | ".join(f"{states[s]['attributed_per_key']:.0f}" for s in STATES)
    lines.append(f"| **sum of the above** (owner fields counted once, in the record) | {sums} | |")
    deltas = " | ".join(f"{states[s]['dedup_used_memory_per_key']:.0f}" for s in STATES)
    lines.append(f"| **used_memory delta per key**, celery-dedup state | {deltas} | INFO memory, all keys |")
    rest = " | ".join(f"{states[s]['unattributed_per_key']:.0f}" for s in STATES)
    lines.append(f"| \N{EM SPACE}not seen by MEMORY USAGE (keyspace and expiry tables) | {rest} | difference |")
    queued = states["queued"]
    lines.append(
        f"| queue message, for scale (kombu LIST entry) | {queued['queue_bytes_per_message']:.0f} | \N{EN DASH} "
        f"| \N{EN DASH} | list / keys ({run.queue_used_memory_per_message:.0f} by used_memory on DEL) |"
    )
    fields = " | ".join(f"{states[s]['record_fields_mean']:.0f}" for s in STATES)
    lines.append(f"| record fields (count) | {fields} | sample mean |")
    entries = " | ".join(f"{states[s]['history_entries_mean']:.0f}" for s in STATES)
    lines.append(f"| history entries (count) | {entries} | sample mean |")
    return "\n".join(lines)


def summary(run: Run) -> dict[str, float]:
    queued, finished = run.states["queued"]["bytes_per_key"], run.states["finished"]["bytes_per_key"]
    index_q = queued["idx"] + queued["idx_state"] + queued["idx_task"] + queued["idx_name"]
    index_f = finished["idx"] + finished["idx_state"] + finished["idx_task"] + finished["idx_name"]
    return {
        "in_flight_key": queued["held"] + queued["owner_fields"],
        "in_flight_key_with_record": queued["held"] + queued["record"],
        "status_record_queued": queued["record"] + queued["history"] + index_q,
        "status_record_finished": finished["record"] + finished["history"] + index_f,
        "index_entries_queued": index_q,
        "index_entries_finished": index_f,
        "all_state_queued_used_memory": run.states["queued"]["dedup_used_memory_per_key"],
        "all_state_finished_used_memory": run.states["finished"]["dedup_used_memory_per_key"],
        "queue_message_used_memory": run.queue_used_memory_per_message,
    }


def summary_table(run: Run) -> str:
    s = summary(run)
    verdict = "met" if s["in_flight_key"] <= TARGET_IN_FLIGHT else "NOT met"
    rows = [
        (
            "in-flight key: held-set member + owner/deadline fields of its record",
            s["in_flight_key"],
            f"target <= {TARGET_IN_FLIGHT}: {verdict}",
        ),
        ("in-flight key, counting the whole record hash it cannot exist without", s["in_flight_key_with_record"], ""),
        ("status record, queued: record + history + index entries", s["status_record_queued"], ""),
        (
            "status record, finished (kept dedup_record_ttl): record + history + index entries",
            s["status_record_finished"],
            "",
        ),
        (
            "\N{EM SPACE}of which index entries, queued",
            s["index_entries_queued"],
            f"finished: {s['index_entries_finished']:.0f}",
        ),
        ("all celery-dedup state per queued key (used_memory)", s["all_state_queued_used_memory"], ""),
        ("all celery-dedup state per finished key (used_memory)", s["all_state_finished_used_memory"], ""),
        (
            "the queue message itself, for scale (used_memory)",
            s["queue_message_used_memory"],
            f"{run.message_bytes_mean:.0f} B of JSON, {run.dedup_header_bytes} B of it the dedup header",
        ),
    ]
    lines = ["| what | bytes per key | note |", "|---|---:|---|"]
    lines += [f"| {what} | {value:.0f} | {note} |" for what, value, note in rows]
    return "\n".join(lines)


def variant_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| variant | lock token chars | record bytes queued | running | finished | record encoding finished |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        enc = ", ".join(f"{k} {v}" for k, v in row["finished"]["record_encodings"].items())
        lines.append(
            f"| {row['variant']} | {row['token_length']} | {row['queued']['record_bytes']:.0f} | "
            f"{row['running']['record_bytes']:.0f} | {row['finished']['record_bytes']:.0f} | {enc} |"
        )
    return "\n".join(lines)


def repeated_table(repeated: dict[str, list[dict[str, Any]]]) -> str:
    lines = [
        "| mode | runs of the key | bytes of the key (all its structures) | outcomes kept | bytes of its outcomes "
        "| bytes of its ended-run fingerprints |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for mode, rows in repeated.items():
        for row in rows:
            lines.append(
                f"| {mode} | {row['runs']} | {row['member_bytes']} | {row['outcomes']} | {row['outcomes_bytes']} "
                f"| {row['ended_bytes']} |"
            )
    return "\n".join(lines)


def print_report(args: argparse.Namespace, run: Run) -> None:
    print()
    print(
        f"Bytes per key, {args.keys} keys (task {TASK!r}, keys 'order:<8 digits>', worker host "
        f"{DEFAULT_HOST!r} pid {DEFAULT_PID}; MEMORY USAGE means over {args.sample} sampled keys)"
    )
    print()
    print(structure_table(run))
    print()
    print(summary_table(run))
    print()
    print(f"Record size by worker host name and arguments ({args.variant_keys} keys each)")
    print()
    print(variant_table(run.variants))
    print()
    print(f"One key run {args.runs} times (each run's return value kept for its window's followers)")
    print()
    print(repeated_table(run.repeated))
    print()
    hash_value = run.config.get("hash-max-listpack-value", "?")
    print(
        f"A hash stays a compact listpack while every value is at most hash-max-listpack-value ({hash_value}) bytes; "
        "one longer value (the lock token, a long argument repr, an error summary) turns it into a real hash table "
        "for good (HDEL of the long field does not turn it back). Record encodings per state: "
        + "; ".join(
            f"{s} " + ", ".join(f"{k} {v}" for k, v in run.states[s]["record_encodings"].items()) for s in STATES
        )
        + "."
    )
    for note in notes(run):
        print()
        print(note)


def notes(run: Run) -> list[str]:
    """What dominates, and what could shrink it (read from this run's numbers; no library change)."""
    s = summary(run)
    finished = run.states["finished"]
    per_key = finished["bytes_per_key"]
    total = s["all_state_finished_used_memory"]
    out = [
        f"Index entries are {s['index_entries_finished']:.0f} of the {total:.0f} bytes a finished key costs "
        f"({s['index_entries_finished'] / total:.0%}): format 2 keeps two sorted-set entries per key (its state's "
        "index and the key-prefix search's `idx:name`), each a skiplist node plus a hash-table entry plus the member "
        "string (the sets are far past zset-max-listpack-entries); the all-records list and the task filter are "
        "merged from the state indexes when read.",
        f"The record hash is {per_key['record']:.0f} bytes finished, {finished['record_field_name_bytes_mean']:.0f} "
        f"of them field names ({finished['record_fields_mean']:.0f} fields, its history entries included). The names "
        "stay readable on purpose (redis-cli, and the previous release reads the fields it decides on); one- or "
        "two-letter names would save most of them.",
        f"History is {per_key['history']:.0f} bytes for {finished['history_entries_mean']:.0f} entries, in a second "
        f"key with its own expiry; kept as a field of the record it would also save the per-key overhead that "
        f"MEMORY USAGE does not see ({finished['unattributed_per_key']:.0f} bytes per key here, two keys with TTLs)."
        if per_key["history"]
        else f"History is {finished['history_entries_mean']:.0f} entries, fields of the record (format 2): "
        "counted in the record's bytes.",
    ]
    by_name = {row["variant"]: row for row in run.variants}
    short = next(iter(by_name.values()), None)
    for row in run.variants[1:]:
        enc = row["finished"]["record_encodings"]
        if short is not None and "hashtable" in enc:
            out.append(
                f"{row['variant']}: the record is {row['finished']['record_bytes']:.0f} bytes finished, "
                f"{row['finished']['record_bytes'] / short['finished']['record_bytes']:.1f}x the short-host one, "
                "because one value passed hash-max-listpack-value. Keeping every value under it (a short lock token "
                "id instead of host:pid:rand:task_id, argument reprs cut to fit or dedup_record_args=False) or raising "
                "hash-max-listpack-value on the server keeps records compact."
            )
    return out


def parse_args(script: harness.Script, argv: Sequence[str] | None) -> argparse.Namespace:
    script.option("--keys", 100_000, "keys enqueued")
    script.option("--sample", 1000, "keys sampled for MEMORY USAGE")
    script.option("--variant-keys", 2000, "keys per record variant")
    script.option("--seed", 1, "random seed for amounts and the sample", minimum=None)
    script.option("--runs", 100, "runs of the one key measured under throttle and until_expired")
    return script.parse(argv)


def main(argv: Sequence[str] | None = None) -> int:
    script = harness.Script("memory", __doc__)
    args = parse_args(script, argv)
    run = measure(script, args)
    print_report(args, run)
    script.save(
        args,
        {
            "server": {"binary": run.server_binary, "version": run.server_version, "encodings": run.config},
            "memory_settings": {
                "keys": args.keys,
                "sample": args.sample,
                "variant_keys": args.variant_keys,
                "seed": args.seed,
                "runs": args.runs,
                "task": TASK,
                "hostname": DEFAULT_HOST,
                "pid": DEFAULT_PID,
            },
            "states": run.states,
            "queue_used_memory_per_message": run.queue_used_memory_per_message,
            "message_bytes_mean": run.message_bytes_mean,
            "dedup_header_bytes": run.dedup_header_bytes,
            "summary": summary(run),
            "variants": run.variants,
            "repeated": run.repeated,
            "notes": notes(run),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
