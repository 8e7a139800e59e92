"""Record listings over both stored formats, derived from the per-state indexes only.

Records are written as each format lays them out: format 1 as the previous
release's scripts did (``task`` and ``updated_at`` fields, a ``hist:`` list,
``idx`` and ``idx:task`` entries beside the state index), format 2 as this
release's do (history in ``h<n>`` fields, no ``task`` or ``updated_at``, no
``idx`` or ``idx:task`` entries): test data on the real server, read through
the store's listing script.
"""

from __future__ import annotations

import random

import pytest
import redis

from celery_dedup.keys import CLUSTER_SHARDS, member_for
from celery_dedup.store.format import old_history
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


def write_v1(store: DedupStore, member: str, task: str, state: str, at_ms: int) -> None:
    """A format 1 record of ``member`` in ``state``, last updated at ``at_ms``: as the previous release wrote it."""
    at = store.schema.shard_of(member)
    namespace, key = member.split(":", 1)
    run = f"{key}~1"
    with store.client.pipeline(transaction=True) as pipe:
        fields = {"state": state, "task": task, "task_id": run, "queued_at": str(T0), "updated_at": str(at_ms)}
        fields["attempts"] = "0"  # format 1 wrote its zero counters
        pipe.hset(at.record(member), items=[part for pair in fields.items() for part in pair])
        pipe.lpush(old_history(at, member), f"{T0} queued {run}", f"{at_ms} {state} {run}")  # newest first
        for index in (at.state_index(state), f"{at.prefix}:idx", f"{at.prefix}:idx:task:{namespace}"):
            pipe.zadd(index, {member: at_ms})
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
    for n, member in enumerate(old):  # format 1, newer than the format 2 ones
        write_v1(store, member, "shop.charge", "started" if n % 2 else "queued", T0 + 1000 + n)
    new = [member_for("shop:refund", f"order:{n}") for n in range(5)]
    for n, member in enumerate(new):  # format 2
        write_v2(store, member, "succeeded" if n % 2 else "queued", T0 + 10 * n)

    listed = [member for page in every_page(store, 3) for member in page]

    assert listed[:5] == old[::-1]
    assert listed[5:] == new[::-1]
    (former,) = [s for s in store.records(limit=20).records if s.member == old[1]]
    assert (former.task, former.key, former.state) == ("shop.charge", "order:1", "started")
    assert former.updated_at is not None and former.updated_at.timestamp() * 1000 == T0 + 1001
    full = store.status(old[1])
    assert full is not None and [entry.state for entry in full.history or ()] == ["started", "queued"]
    assert [member for page in every_page(store, 4, task="shop.charge") for member in page] == old[::-1]
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
