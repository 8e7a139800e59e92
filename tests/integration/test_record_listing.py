"""Record listings over both stored formats, derived from the per-state indexes only.

Format 1 records are made by the real scripts; format 2 records are written
as format 2 lays them out (history in ``h<n>`` fields, no ``task`` or
``updated_at``, no ``idx`` or ``idx:task`` entries): test data on the real
server, read through the store's listing script.
"""

from __future__ import annotations

import random

import pytest
import redis

from celery_dedup.keys import CLUSTER_SHARDS, member_for, new_nonce
from celery_dedup.store.store import DedupStore, Page

T0 = 1_700_000_000_000


def write_v2(store: DedupStore, member: str, state: str, at_ms: int, run: str = "") -> None:
    """A format 2 record of ``member`` in ``state``, last updated at ``at_ms``, and its index entries."""
    at = store.schema.shard_of(member)
    namespace, key = member.split(":", 1)
    run = run or f"{key}~r"
    with store.client.pipeline(transaction=True) as pipe:
        pipe.delete(at.record(member))
        fields: dict[str, str] = {
            "state": state,
            "task_id": run,
            "queued_at": str(T0),
            "hn": "2",
            "h0": "0 queued",
            "h1": f"{at_ms - T0} {state}",
        }
        pipe.hset(at.record(member), items=[part for pair in fields.items() for part in pair])
        for each in ("queued", "started", "succeeded", "failed"):
            pipe.zrem(at.state_index(each), member)
        pipe.zadd(at.state_index(state), {member: at_ms})
        pipe.zadd(at.name_index, {f"{key}\0{namespace}": 0})
        pipe.execute()


def every_page(store: DedupStore, limit: int, between: object = None, **filters: str) -> list[list[str]]:
    pages: list[list[str]] = []
    cursor = None
    while True:
        page: Page = store.records(cursor=cursor, limit=limit, **filters)
        pages.append([status.member for status in page.records])
        if page.cursor is None:
            return pages
        cursor = page.cursor
        if callable(between):
            between(len(pages))


@pytest.fixture(params=[1, CLUSTER_SHARDS], ids=["one shard", "shards"])
def store(r: redis.Redis, request: pytest.FixtureRequest) -> DedupStore:
    return DedupStore(r, "dedup", shards=request.param)


def test_both_formats_list_together_newest_first(store: DedupStore) -> None:
    old = [member_for("shop.charge", f"order:{n}") for n in range(5)]
    for member in old:  # format 1, by the real gate: scored by the server's clock, now
        assert store.gate(member, f"{member}~1", new_nonce(), hold_ms=60_000, grace_ms=60_000, task_name="shop.charge")
    new = [member_for("shop:refund", f"order:{n}") for n in range(5)]
    for n, member in enumerate(new):  # format 2, older than the format 1 ones
        write_v2(store, member, "succeeded" if n % 2 else "queued", T0 + 10 * n)

    listed = [member for page in every_page(store, 3) for member in page]

    assert sorted(listed[:5]) == sorted(old)
    assert listed[5:] == new[::-1]
    (status,) = [s for s in store.records(limit=20).records if s.member == new[3]]
    assert (status.task, status.key, status.state) == ("shop:refund", "order:3", "succeeded")
    assert status.updated_at is not None and status.updated_at.timestamp() * 1000 == T0 + 30
    assert [entry.state for entry in status.history or ()] == ["succeeded", "queued"]
    assert store.records(state="succeeded").total == 2 and store.records().total == 10
    assert store.index_sizes().total == 10


def test_paging_is_stable_while_records_change_state(store: DedupStore) -> None:
    """Each record not touched while paging is listed exactly once; a touched one at most once."""
    members = [member_for("shop.charge", f"order:{n:03d}") for n in range(120)]
    for n, member in enumerate(members):
        write_v2(store, member, "queued", T0 + n // 3)  # three to a millisecond: ties are ordered too
    rng = random.Random(5)
    touched: set[str] = set()

    def change(_: int) -> None:
        for member in rng.sample(members, 4):  # some already listed, some not yet
            touched.add(member)
            write_v2(store, member, rng.choice(["started", "succeeded"]), T0 + 10_000 + len(touched))

    listed = [member for page in every_page(store, 7, between=change) for member in page]

    assert len(listed) == len(set(listed)), "no record twice"
    assert set(members) - touched <= set(listed), "no untouched record skipped"
    untouched = [m for m in listed if m not in touched]
    assert untouched == sorted(untouched, key=lambda m: (members.index(m) // 3, m), reverse=True)


def test_a_state_filter_pages_its_index(store: DedupStore) -> None:
    for n in range(40):
        write_v2(store, member_for("t", f"k{n:02d}"), ("failed", "succeeded")[n % 2], T0 + n)
    pages = every_page(store, 6, state="failed")
    assert [m for page in pages for m in page] == [member_for("t", f"k{n:02d}") for n in range(38, -1, -2)]
    assert all(len(page) == 6 for page in pages[:-1])


def test_a_task_filter_over_many_tasks(store: DedupStore) -> None:
    tasks = [f"app.task{n}" for n in range(30)] + ["app.task1:x", "app.task 10"]
    expected: dict[str, list[str]] = {task: [] for task in tasks}
    for n in range(640):
        task = tasks[n % len(tasks)]
        member = member_for(task, f"k{n:03d}")
        write_v2(store, member, ("queued", "started", "succeeded")[n % 3], T0 + n)
        expected[task].insert(0, member)
    for task in ("app.task1", "app.task1:x", "app.task 10", "app.task29"):
        pages = every_page(store, 4, task=task)
        assert [m for page in pages for m in page] == expected[task], task
    assert not any(every_page(store, 5, task="app.none")), "a task with no records: empty pages, to the end"


def test_a_sparse_task_filter_moves_on_without_filling_pages(store: DedupStore) -> None:
    """Looking at 20 entries per record wanted, a page of a rare task may come back short, with a cursor."""
    for n in range(300):
        write_v2(store, member_for("common", f"k{n:03d}"), "queued", T0 + 1000 + n)
    rare = [member_for("rare", f"k{n}") for n in range(3)]
    for n, member in enumerate(rare):
        write_v2(store, member, "queued", T0 + n)
    pages = every_page(store, 2, task="rare")
    assert [m for page in pages for m in page] == rare[::-1]
    if store.schema.shards == 1:
        assert [] in pages, "a page that found none of 40 entries looked at still moves on"
