"""The sharded key layout of a Redis Cluster store, exercised on one server (every shard on it).

Each member's keys share its shard's hash tag; everything global is per
shard, and listing, counting, reaping and purging merge or walk the shards.
The real cluster is in test_cluster.py.
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from celery_dedup.exceptions import DedupArgumentError
from celery_dedup.keys import CLUSTER_SHARDS, KeySchema, new_nonce
from celery_dedup.store.store import DedupStore

TASKS = ("shop.charge", "shop.refund")


@pytest.fixture
def store(r: redis.Redis) -> DedupStore:
    return DedupStore(r, "dedup", shards=CLUSTER_SHARDS)


def gate(store: DedupStore, member: str, run: str, hold_ms: int = 60_000) -> None:
    assert store.gate(member, run, new_nonce(), hold_ms=hold_ms, grace_ms=60_000).accepted


def members(count: int) -> list[str]:
    return [f"{TASKS[n % 2]}:order:{n:04d}" for n in range(count)]


def test_every_key_of_a_member_is_in_its_shards_slot() -> None:
    schema = KeySchema("dedup", CLUSTER_SHARDS)
    slots_used = set()
    for member in members(200):
        at = schema.shard_of(member)
        names = [at.held, at.record(member), at.lock(member), at.ended(member), at.format, at.name_index]
        names += [at.state_index("queued"), at.stats, at.due, at.followers(member)]
        slots = {key_slot(name.encode()) for name in names}
        assert len(slots) == 1, (member, names)
        slots_used |= slots
    assert len(slots_used) == CLUSTER_SHARDS, "200 members use every shard"
    assert KeySchema("dedup").shard_of("shop.charge:order:1").record("m") == "dedup:rec:m", "one shard: plain names"


def test_pages_list_every_record_once_newest_first_across_shards(store: DedupStore) -> None:
    names = members(300)
    for member in random.Random(7).sample(names, len(names)):
        gate(store, member, f"{member}~run")
    seen: list[str] = []
    updated: list[Any] = []
    cursor = None
    pages = 0
    while True:
        page = store.records(cursor=cursor, limit=7)
        pages += 1
        seen += [status.member for status in page.records]
        updated += [status.updated_at for status in page.records]
        assert page.total == 300
        if page.cursor is None:
            break
        cursor = page.cursor  # one place in the merged order, whatever the number of shards
    assert sorted(seen) == sorted(names) and len(seen) == 300, "each record exactly once"
    assert updated == sorted(updated, reverse=True), "newest update first, across shards"
    assert pages == 43


def test_filters_and_prefix_search_merge_the_shards(store: DedupStore) -> None:
    names = members(120)
    for member in names:
        gate(store, member, f"{member}~run")
    for member in names[:30]:
        store.finish(member, f"{member}~run", "failed", drop=True, record_ms=60_000, role="report")

    def listed(**filters: str) -> list[str]:
        found, cursor = [], None
        while True:
            page = store.records(cursor=cursor, limit=4, **filters)
            found += [status.member for status in page.records]
            if page.cursor is None:
                return found
            cursor = page.cursor

    assert sorted(listed(state="failed")) == sorted(names[:30])
    assert sorted(listed(state="queued")) == sorted(names[30:])
    assert sorted(listed(task="shop.refund")) == sorted(m for m in names if m.startswith("shop.refund"))
    by_key = listed(prefix="order:00")
    assert by_key == sorted(by_key, key=lambda m: m.split(":", 1)[1]), "key order across shards"
    assert sorted(by_key) == sorted(m for m in names if m.split(":", 1)[1].startswith("order:00"))
    sizes = store.index_sizes(states=("queued", "failed"))
    assert (sizes.total, sizes.states) == (120, {"queued": 90, "failed": 30})


def test_a_cursor_of_another_layout_is_refused(store: DedupStore) -> None:
    with pytest.raises(DedupArgumentError):
        store.records(prefix="order:", cursor="12")
    with pytest.raises(DedupArgumentError):
        store.records(prefix="order:", cursor=".".join(["1"] * (CLUSTER_SHARDS - 1)))
    with pytest.raises(DedupArgumentError):
        store.records(cursor="12")


def test_stats_reaper_and_purge_cover_every_shard(store: DedupStore, r: redis.Redis) -> None:
    names = members(64)
    for member in names:
        gate(store, member, f"{member}~run", hold_ms=1)
    stats = store.stats()
    assert sum(counts["accepted"] for counts in stats.values()) == 64
    time.sleep(0.01)
    report = store.reap(record_ms=60_000)
    assert report.released == 64, "expired holds of every shard released"
    for member in names:
        store.finish(member, f"{member}~run", "failed", drop=True, record_ms=60_000, role="report")
    purged = store.purge(budget=1000)
    assert (purged.purged, purged.more) == (64, False)
    assert store.records().total == 0


def test_the_first_page_cursor_is_zero_whatever_the_layout(store: DedupStore) -> None:
    gate(store, "shop.charge:order:1", "run")
    assert [status.member for status in store.records(cursor="0").records] == ["shop.charge:order:1"]


def test_the_admin_list_follows_a_sharded_cursor() -> None:
    from celery_dedup.contrib.django.listing import Query  # noqa: PLC0415 - Django is optional

    query = Query.parse({"cursor": "1.0.2", "trail": "0,1.0.0"})
    assert (query.cursor, query.trail) == ("1.0.2", ("0", "1.0.0"))
    assert Query.parse({"cursor": "1.²"}).cursor == "", "not a cursor: the first page"
