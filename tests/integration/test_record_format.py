"""The stored format 2, as the scripts write it: the history inside the record, no per-record side keys.

Records are made through the real scripts (gate, start, finish, purge, reap) on a real server.
"""

from __future__ import annotations

import time

import redis

from celery_dedup.keys import KeySchema
from celery_dedup.store.store import DedupStore
from celery_dedup.worker.lock import new_token

SCHEMA = KeySchema("dedup")
MEMBER = "fmt.task:k"
DAY_MS = 86_400_000


def gate(store: DedupStore, run: str, hold_ms: int = 60_000) -> None:
    assert store.gate(MEMBER, run, f"nonce-{run}", hold_ms=hold_ms, grace_ms=DAY_MS).accepted


def start(store: DedupStore, run: str) -> str:
    token = new_token()
    decision = store.start(
        MEMBER,
        run,
        token,
        lock_ms=60_000,
        gated=True,
        key_mode="lock",
        hostname="h",
        pid=1,
        retries=0,
        record_ms=DAY_MS,
    )
    assert decision.run, decision
    return token


def finish(store: DedupStore, run: str, token: str, state: str = "succeeded", **kw: object) -> None:
    store.finish(MEMBER, run, state, drop=True, record_ms=DAY_MS, token=token, role="run", **kw)  # type: ignore[arg-type]


def entries(r: redis.Redis) -> dict[int, str]:
    """The record's history fields, by n."""
    fields = {k.decode(): v.decode() for k, v in r.hgetall(SCHEMA.record(MEMBER)).items()}
    return {int(name[1:]): value for name, value in fields.items() if name[0] == "h" and name[1:].isdigit()}


def test_a_finished_record_keeps_its_history_inside_and_no_side_keys(r: redis.Redis) -> None:
    store = DedupStore(r, "dedup")
    gate(store, "A")
    finish(store, "A", start(store, "A"))

    assert not r.exists(f"dedup:hist:{MEMBER}", "dedup:idx", "dedup:idx:task:fmt.task")
    record = store.record(MEMBER)
    assert record is not None
    assert "task" not in record and "updated_at" not in record
    assert "duplicates" not in record and "retries" not in record, "zero counters are not written"
    assert not {"tag", "unacked", "pushed_at", "main", "hold_ms", "message", "queue"} & set(record)
    found = entries(r)
    assert sorted(found) == [0, 1, 2] and record["hn"] == "3"
    assert [value.split(" ")[1:] for _, value in sorted(found.items())] == [["queued"], ["started"], ["succeeded"]]
    assert found[0] == "0 queued"
    assert r.object("encoding", SCHEMA.record(MEMBER)) == b"listpack"
    assert r.pttl(SCHEMA.record(MEMBER)) > 0
    status = store.status(MEMBER)
    assert status is not None and status.task == "fmt.task" and status.updated_at == status.finished_at


def test_the_history_is_capped_and_carried_rebased_into_the_next_run(r: redis.Redis) -> None:
    store = DedupStore(r, "dedup", history_length=4)
    gate(store, "A")
    finish(store, "A", start(store, "A"))
    gate(store, "B")
    found = entries(r)
    # A's three entries carried (its id in place of "-", offsets before B's queued_at), then B's own.
    assert sorted(found) == [0, 1, 2, 3]
    carried = [found[n].split(" ") for n in range(3)]
    assert [entry[1:] for entry in carried] == [["queued", "A"], ["started", "A"], ["succeeded", "A"]]
    assert all(int(entry[0]) <= 0 for entry in carried)
    assert found[3] == "0 queued"
    finish(store, "B", start(store, "B"))
    found = entries(r)
    assert sorted(found) == [2, 3, 4, 5], "at most history_length entries: h<n - length> is deleted"
    assert [entry.split(" ", 1)[1] for entry in store.history(MEMBER)] == [
        "succeeded B",
        "started B",
        "queued B",
        "succeeded A",
    ]


def test_the_gate_gives_a_new_record_no_expiry_and_start_ending_or_reaper_do(r: redis.Redis) -> None:
    store = DedupStore(r, "dedup")
    gate(store, "A")
    assert r.pttl(SCHEMA.record(MEMBER)) == -1, "a new record lives as long as its run may run"
    token = start(store, "A")
    assert r.pttl(SCHEMA.record(MEMBER)) > 0
    finish(store, "A", token)
    assert r.pttl(SCHEMA.record(MEMBER)) > 0
    # A run whose hold passed and whose message was sent where the store cannot watch it: the reaper expires it.
    other = "fmt.task:other"
    assert store.gate(other, "B", "nonce-b", hold_ms=1, grace_ms=DAY_MS).accepted
    assert r.pttl(SCHEMA.record(other)) == -1
    time.sleep(0.01)
    store.reap(record_ms=DAY_MS)
    assert 0 < r.pttl(SCHEMA.record(other)) <= DAY_MS


def test_purge_leaves_a_tombstone_of_a_record_without_expiry(r: redis.Redis) -> None:
    store = DedupStore(r, "dedup")
    gate(store, "A")
    finish(store, "A", start(store, "A"))
    r.persist(SCHEMA.record(MEMBER))
    assert store.purge(("succeeded",)).purged == 1
    record = store.record(MEMBER)
    assert record is not None and record["purged"] == "1" and record["task_id"] == "A"
    assert not entries(r)


def test_a_long_note_is_cut_and_the_record_stays_a_listpack(r: redis.Redis) -> None:
    store = DedupStore(r, "dedup")
    gate(store, "A")
    finish(store, "A", start(store, "A"), state="failed", note="é" * 200, error="boom")
    values = entries(r).values()
    assert all(len(value.encode()) <= 64 for value in values)
    assert any(value.split(" ")[1] == "failed" and "é" in value for value in values)
    value = next(v for v in values if v.split(" ")[1] == "failed")
    value.encode().decode("utf-8")  # cut on a character's boundary
    assert r.object("encoding", SCHEMA.record(MEMBER)) == b"listpack"
