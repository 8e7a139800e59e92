"""Per-group concurrency and rate limits (``limit_key``, ``limit_concurrency``, ``limit_rate``).

Three tiers: option parsing and validation (no server); the group scripts on
the real server (``celery_dedup.worker.limits`` against the store); and real prefork
workers (``celery -A tests.limits_app worker``) whose bodies record their
start and end on the server's clock, from which the limits are checked as
properties: never more than N of a group at once, never more than R starts
in any window of one period, every run once.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlparse

import pytest
import redis
from kombu.utils.json import loads

import celery_dedup.limits
from celery_dedup import DedupTask
from celery_dedup.exceptions import DedupArgumentError, DedupConfigError
from celery_dedup.keys import KeySchema, limit_group_member, limit_group_namespace, member_for
from celery_dedup.policy import LimitPolicy, Rate, parse_rate
from celery_dedup.runtime import store_for
from celery_dedup.store import limits as store_limits
from celery_dedup.store.limits import Denial, Grant
from celery_dedup.worker import limits, processes
from celery_dedup.worker.delivery import Delivery
from chaos.proxy import FaultProxy

from .. import limits_app
from ..conftest import AppFactory, Server, WorkerProcess, in_process_worker, wait_for

SCHEMA = KeySchema("dedup")

# --- options -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "rate"),
    [("30/m", Rate(30, 60_000)), ("5/s", Rate(5, 1000)), (" 2 / h ", Rate(2, 3_600_000)), ("100000/s", None)],
)
def test_rates_parse(text: str, rate: Rate | None) -> None:
    parsed = parse_rate(text)
    assert parsed == (rate or Rate(100_000, 1000))
    assert str(parsed) == text.replace(" ", "")


@pytest.mark.parametrize("bad", ["0/s", "5/w", "5", "five/s", "5/s/s", "-1/s", "100001/s", 5, None, b"5/s", ""])
def test_bad_rates_are_refused(bad: Any) -> None:
    with pytest.raises(DedupConfigError) as info:
        parse_rate(bad, task="shop.t")
    assert (info.value.setting, info.value.value, info.value.task) == ("limit_rate", bad, "shop.t")


def _define(app: Any, **options: Any) -> DedupTask:
    def work(order_id: int, tenant: str) -> int:
        return order_id

    task: DedupTask = app.task(
        name="shop.limited", base=DedupTask, shared=False, dedup_key="order:{order_id}", **options
    )(work)
    _ = task.dedup_policy  # resolved at registration (on_bound) or here, on first use
    return task


@pytest.mark.parametrize(
    ("options", "setting"),
    [
        pytest.param({"limit_concurrency": 0}, "limit_concurrency", id="concurrency-0"),
        pytest.param({"limit_concurrency": -2}, "limit_concurrency", id="concurrency-negative"),
        pytest.param({"limit_concurrency": True}, "limit_concurrency", id="concurrency-bool"),
        pytest.param({"limit_concurrency": "2"}, "limit_concurrency", id="concurrency-text"),
        pytest.param({"limit_concurrency": 1.5}, "limit_concurrency", id="concurrency-float"),
        pytest.param({"limit_rate": "10/day"}, "limit_rate", id="rate-unit"),
        pytest.param({"limit_rate": 10}, "limit_rate", id="rate-number"),
        pytest.param({"limit_key": "tenant:{tenant}"}, "limit_key", id="key-without-limit"),
        pytest.param({"limit_key": "t:{nope}", "limit_concurrency": 1}, "limit_key", id="key-unknown-argument"),
        pytest.param({"limit_key": 42, "limit_concurrency": 1}, "limit_key", id="key-not-a-key"),
    ],
)
def test_bad_limit_options_are_refused_at_registration(
    make_app: AppFactory, options: dict[str, Any], setting: str
) -> None:
    app = make_app()
    with pytest.raises(DedupConfigError) as info:
        _define(app, **options)
    assert (info.value.task, info.value.setting) == ("shop.limited", setting)
    assert "shop.limited" in str(info.value) and setting in str(info.value)


def test_limit_options_resolve(make_app: AppFactory) -> None:
    app = make_app()
    task = _define(app, limit_key="tenant:{tenant}", limit_concurrency=2, limit_rate="30/m")
    limit = task.dedup_policy.limit
    assert isinstance(limit, LimitPolicy)
    assert (limit.concurrency, limit.rates) == (2, (Rate(30, 60_000),))
    assert limit.spec is not None and limit.spec.business_key((1,), {"tenant": "acme"}) == "tenant:acme"

    def plain(n: int) -> int:
        return n

    assert app.task(name="shop.plain", base=DedupTask)(plain).dedup_policy.limit is None


def test_limits_only_mode_publishes_without_a_gate(make_app: AppFactory, r: redis.Redis) -> None:
    """``dedup_mode="off"``: every call is published (no key held, no record); limits still apply on the worker."""
    app = make_app()
    task = _define(app, dedup_mode="off", limit_key="tenant:{tenant}", limit_concurrency=1)
    first, second = task.delay(1, "a"), task.delay(1, "a")
    assert first.id != second.id and not first.deduplicated and not second.deduplicated
    assert r.smembers(SCHEMA.held) == set()
    assert r.keys("dedup:rec:*") == []


# --- the group scripts on the server -------------------------------------------------------

GROUP = "shop.limited:tenant:a"


def _ask(store: Any, token: str, run: str, policy: LimitPolicy, *, lease_ms: int = 60_000, **kw: Any) -> Grant | Denial:
    return store_limits.acquire(store, GROUP, token, run, policy, lease_ms=lease_ms, task_name="shop.limited", **kw)


def test_slots_are_given_in_arrival_order(make_app: AppFactory, r: redis.Redis) -> None:
    store = store_for(make_app())
    two = LimitPolicy(None, concurrency=2)
    assert isinstance(_ask(store, "h:1:a", "run-1", two), Grant)
    assert isinstance(_ask(store, "h:1:b", "run-2", two), Grant)
    early = _ask(store, "h:1:c", "run-3", two)
    late = _ask(store, "h:1:d", "run-4", two)
    assert isinstance(early, Denial) and isinstance(late, Denial)
    assert (early.reason, early.in_use, early.position) == ("concurrency", 2, 0)
    assert late.position == 1
    assert set(early.holders) == {"h:1:a", "h:1:b"}
    assert early.wait_ms > 0
    assert store_limits.release(store, GROUP, "h:1:a", ran=True)
    # A slot is free, but run-3 came first: run-4 (another delivery, another token) still waits.
    assert isinstance(_ask(store, "h:1:e", "run-4", two), Denial)
    granted = _ask(store, "h:1:f", "run-3", two)
    assert isinstance(granted, Grant) and granted.waited_ms >= 0
    assert r.zcard(SCHEMA.limit_waiting(GROUP)) == 1
    # Releasing twice, or a token that holds nothing, changes nothing.
    assert not store_limits.release(store, GROUP, "h:1:a", ran=True)
    assert r.zcard(SCHEMA.limit_slots(GROUP)) == 2
    counts = store.stats()["shop.limited"]
    assert counts["limited"] == 3


def test_runs_arriving_in_one_millisecond_keep_their_order_in_line(make_app: AppFactory, r: redis.Redis) -> None:
    """Forty runs asking back to back (several per millisecond), named so that run id order is the reverse."""
    store = store_for(make_app())
    one = LimitPolicy(None, concurrency=1)
    assert isinstance(_ask(store, "h:1:a", "run-holder", one), Grant)
    asked = [f"run-{n:02d}" for n in reversed(range(40))]
    for run in asked:
        assert isinstance(_ask(store, f"h:1:{run}", run, one), Denial)
    assert [m.decode() for m in r.zrange(SCHEMA.limit_waiting(GROUP), 0, -1)] == asked


def test_rate_counts_starts_in_a_sliding_window_and_takes_back_unused_ones(
    make_app: AppFactory, r: redis.Redis
) -> None:
    store = store_for(make_app())
    three = LimitPolicy(None, rates=(Rate(3, 60_000),))
    for n in range(3):
        assert isinstance(_ask(store, f"h:1:{n}", f"run-{n}", three), Grant)
    refused = _ask(store, "h:1:x", "run-x", three)
    assert isinstance(refused, Denial) and (refused.reason, refused.in_use) == ("rate", 3)
    assert 0 < refused.wait_ms <= 60_000
    # A start whose body never ran (a copy the execution guard refused) is taken back ...
    assert store_limits.release(store, GROUP, "h:1:1", ran=False)
    assert isinstance(_ask(store, "h:1:y", "run-x", three), Grant)
    # ... one whose body ran stays in the window.
    assert not store_limits.release(store, GROUP, "h:1:0", ran=True)
    assert isinstance(_ask(store, "h:1:z", "run-z", three), Denial)


def test_a_lease_nobody_renews_expires_and_renewal_keeps_one(make_app: AppFactory, r: redis.Redis) -> None:
    store = store_for(make_app())
    one = LimitPolicy(None, concurrency=1)
    grant = _ask(store, "h:1:old", "run-1", one, lease_ms=300)
    assert isinstance(grant, Grant)
    kept = limits.SlotLease(store, GROUP, "h:1:old", "run-old", 300, grant, now=0.0)
    assert store_limits.renew_leases([kept], lease_ms=60_000) == []
    assert isinstance(_ask(store, "h:1:new", "run-2", one), Denial)
    r.zadd(SCHEMA.limit_slots(GROUP), {"h:1:old": 1})  # its deadline passed (as if not renewed)
    assert isinstance(_ask(store, "h:1:new", "run-2", one), Grant)
    assert store_limits.renew_leases([kept], lease_ms=60_000) == [kept]


def token_of(pid: int) -> str:
    """A lock token naming process ``pid`` of this machine."""
    host, _, _, machine, rand = processes.token().split(":")
    return f"{host}:{pid}:{processes.start_time(pid) or 1}:{machine}:{rand}"


def test_holders_named_as_gone_are_evicted(make_app: AppFactory, r: redis.Redis) -> None:
    store = store_for(make_app())
    one = LimitPolicy(None, concurrency=1)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    token = token_of(dead.pid)
    assert isinstance(_ask(store, token, "run-1", one), Grant)
    refused = _ask(store, "h:1:b", "run-2", one)
    assert isinstance(refused, Denial) and refused.holders == (token,)
    assert limits.owner_gone(token)
    assert not limits.owner_gone(token_of(os.getppid()))
    assert isinstance(_ask(store, "h:1:b", "run-2", one, evict=[token]), Grant)
    assert store.stats()["shop.limited"]["limit_evicted"] == 1


def test_a_waiter_that_does_not_come_back_loses_its_place(make_app: AppFactory, r: redis.Redis) -> None:
    store = store_for(make_app())
    one = LimitPolicy(None, concurrency=1)
    assert isinstance(_ask(store, "h:1:a", "run-1", one), Grant)
    assert isinstance(_ask(store, "h:1:b", "run-gone", one), Denial)
    store_limits.release(store, GROUP, "h:1:a", ran=True)
    assert isinstance(_ask(store, "h:1:c", "run-new", one), Denial), "run-gone is ahead"
    r.zadd(SCHEMA.limit_deadlines(GROUP), {"run-gone": 1})  # it was due back long ago
    assert isinstance(_ask(store, "h:1:c", "run-new", one), Grant)


@pytest.mark.parametrize(
    "one", [LimitPolicy(None, concurrency=1), LimitPolicy(None, rates=(Rate(1, 60_000),))], ids=["slot", "start"]
)
def test_a_free_slot_waits_for_the_runs_ahead_only_until_they_are_due(
    make_app: AppFactory, r: redis.Redis, one: LimitPolicy
) -> None:
    """The line holds a free slot (or start) for the run ahead while it is expected back; once overdue, anyone takes it.

    The overdue run keeps its place: when it does come back, it is first for
    the next one that frees.
    """
    store = store_for(make_app())
    assert isinstance(_ask(store, "h:1:a", "run-1", one), Grant)
    assert isinstance(_ask(store, "h:1:b", "run-late", one), Denial)
    store_limits.release(store, GROUP, "h:1:a", ran=False)
    assert isinstance(_ask(store, "h:1:c", "run-new", one), Denial), "run-late is expected back: the slot is held"
    now = limits_app.server_ms(r)
    # run-late was due back 5 s ago (a countdown message held up), but may still come back within its lease.
    r.zadd(SCHEMA.limit_deadlines(GROUP), {"run-late": now - 5000 + 60_000})
    r.hdel(SCHEMA.limit_info(GROUP), "held_until")  # as if the slot had freed only now
    assert isinstance(_ask(store, "h:1:c", "run-new", one), Grant), "the free slot went to the one that asked"
    assert r.zrank(SCHEMA.limit_waiting(GROUP), "run-late") == 0, "it keeps its place"
    assert isinstance(_ask(store, "h:1:d", "run-other", one), Denial)
    store_limits.release(store, GROUP, "h:1:c", ran=False)
    assert isinstance(_ask(store, "h:1:e", "run-late", one), Grant), "back at last, it is first"
    assert r.zrange(SCHEMA.limit_waiting(GROUP), 0, -1) == [b"run-other"]


def test_groups_are_listed_with_their_usage(make_app: AppFactory, r: redis.Redis) -> None:
    store = store_for(make_app())
    both = LimitPolicy(None, concurrency=1, rates=(Rate(10, 1000),))
    _ask(store, "h:1:a", "run-1", both)
    _ask(store, "h:1:b", "run-2", both)
    (state,) = store_limits.groups(store)
    assert (state.task, state.key, state.concurrency, state.in_use, state.waiting) == (
        "shop.limited",
        "tenant:a",
        1,
        1,
        1,
    )
    assert state.rate == Rate(10, 1000) and state.starts == 1


# --- windows, overrides and pauses in the group script -------------------------------------

NAMED = limit_group_member("partner-api", "acme")
CONF = SCHEMA.limit_conf(limit_group_namespace("partner-api"))


def _ask_named(store: Any, token: str, run: str, policy: LimitPolicy, **kw: Any) -> Grant | Denial:
    return store_limits.acquire(store, NAMED, token, run, policy, lease_ms=60_000, task_name="shop.limited", **kw)


def test_a_start_needs_room_in_every_window(make_app: AppFactory, r: redis.Redis) -> None:
    """2/s and 3/m: the third start waits for the second's window, the fourth for the minute's."""
    store = store_for(make_app())
    two_windows = LimitPolicy(None, rates=(Rate(2, 1000), Rate(3, 60_000)))
    assert isinstance(_ask(store, "h:1:a", "run-a", two_windows), Grant)
    assert isinstance(_ask(store, "h:1:b", "run-b", two_windows), Grant)
    third = _ask(store, "h:1:c", "run-c", two_windows)
    assert isinstance(third, Denial) and third.reason == "rate" and third.window == Rate(2, 1000)
    assert third.in_use == 2 and 0 < third.wait_ms <= 1000
    assert limits.why_waiting(third) == "rate 2/2/s used for tenant:a"
    time.sleep(third.wait_ms / 1000 + 0.02)
    assert isinstance(_ask(store, "h:1:c", "run-c", two_windows), Grant)
    fourth = _ask(store, "h:1:d", "run-d", two_windows)
    assert isinstance(fourth, Denial) and fourth.window == Rate(3, 60_000) and fourth.in_use == 3
    assert 58_000 < fourth.wait_ms <= 60_000, "it comes back when the minute's first start leaves it"
    info = r.hgetall(SCHEMA.limit_info(GROUP))
    assert info[b"rates"] == b"2/1000,3/60000" and info[b"paused_until"] == b"0"
    (state,) = store_limits.groups(store)
    assert state.rates == (Rate(2, 1000), Rate(3, 60_000)) and state.starts_per_window == (1, 3)
    assert (state.rate, state.starts) == (Rate(2, 1000), 1)


def test_a_daily_window_of_ten_thousand_stays_cheap(make_app: AppFactory, r: redis.Redis) -> None:
    """A full 10000/d log: a refusal reads two entries of it by rank, never the whole log."""
    store = store_for(make_app())
    daily = LimitPolicy(None, rates=(Rate(10, 1000), Rate(10_000, 86_400_000)))
    now = limits_app.server_ms(r)
    r.zadd(SCHEMA.limit_starts(GROUP), {f"old:{n}": now - 86_000_000 + n * 8000 for n in range(10_000)})
    r.config_resetstat()
    rounds = 50
    began = time.perf_counter()
    for n in range(rounds):
        refused = _ask(store, f"h:1:{n}", f"run-{n}", daily)
        assert isinstance(refused, Denial) and refused.window == Rate(10_000, 86_400_000), refused
    elapsed = (time.perf_counter() - began) / rounds
    assert refused.position == rounds - 1
    # The 50th in line waits for the 50th oldest start to leave the day.
    assert abs(refused.wait_ms - (400_000 + 49 * 8000)) < 5000, refused.wait_ms
    stats = r.info("commandstats")
    per_call = stats["cmdstat_evalsha"]["usec_per_call"]
    print(f"10000/d refusal: {per_call:.0f} us per script on the server, {elapsed * 1e6:.0f} us per round trip")
    assert per_call < 1000, stats["cmdstat_evalsha"]
    assert r.zcard(SCHEMA.limit_starts(GROUP)) == 10_000


def test_overrides_take_effect_at_the_next_admission_key_over_group_over_declared(
    make_app: AppFactory, r: redis.Redis
) -> None:
    store = store_for(make_app())
    declared = LimitPolicy(None, concurrency=1, group="partner-api")
    assert isinstance(_ask_named(store, "h:1:a", "run-a", declared), Grant)
    assert isinstance(_ask_named(store, "h:1:b", "run-b", declared), Denial)
    r.hset(CONF, "concurrency", 2)
    granted = _ask_named(store, "h:1:b", "run-b", declared)
    assert isinstance(granted, Grant) and granted.slot
    r.hset(CONF, "k:acme:concurrency", 3)
    r.hset(CONF, "concurrency", 1)
    assert isinstance(_ask_named(store, "h:1:c", "run-c", declared), Grant), "the key's own value wins"
    refused = _ask_named(store, "h:1:d", "run-d", declared)
    assert isinstance(refused, Denial) and (refused.reason, refused.limit) == ("concurrency", "3")
    assert limits.why_waiting(refused) == "concurrency 3/3 in use for partner-api:acme"
    r.hdel(CONF, "k:acme:concurrency")
    lowered = _ask_named(store, "h:1:d", "run-d", declared)
    assert isinstance(lowered, Denial) and lowered.limit == "1", "back to the group's override"
    # A rate override on a group that declared none counts starts from then on, in its own window.
    r.hset(CONF, "k:acme:rates", "1/60000")
    r.hset(CONF, "k:acme:concurrency", 10)
    assert isinstance(_ask_named(store, "h:1:d", "run-d", declared), Grant)
    rated = _ask_named(store, "h:1:e", "run-e", declared)
    assert isinstance(rated, Denial) and rated.window == Rate(1, 60_000)
    (state,) = store_limits.groups(store)
    assert (state.name, state.task, state.key, state.concurrency) == ("partner-api", "", "acme", 10)
    assert state.rates == (Rate(1, 60_000),) and state.starts_per_window == (1,)


def test_a_pause_refuses_every_start_and_the_line_resumes_in_arrival_order(
    make_app: AppFactory, r: redis.Redis
) -> None:
    store = store_for(make_app())
    two = LimitPolicy(None, concurrency=2, group="partner-api")
    assert isinstance(_ask_named(store, "h:1:a", "run-a", two), Grant)
    r.hset(CONF, "paused_until", -1)
    first = _ask_named(store, "h:1:b", "run-b", two)
    assert isinstance(first, Denial) and (first.reason, first.limit, first.wait_ms) == ("paused", "-1", 5000)
    assert limits.why_waiting(first) == "paused for partner-api:acme until resumed"
    second = _ask_named(store, "h:1:c", "run-c", two)
    assert isinstance(second, Denial) and second.position == 1
    assert isinstance(_ask_named(store, "h:1:a", "run-a", two), Grant), "a delivery holding its slot keeps it"
    (state,) = store_limits.groups(store)
    assert state.paused_until == -1 and state.waiting == 2
    # A key's pause with an end: it comes back when the pause ends, if that is sooner than the poll.
    r.hdel(CONF, "paused_until")
    until = limits_app.server_ms(r) + 1500
    r.hset(CONF, "k:acme:paused_until", until)
    timed = _ask_named(store, "h:1:c", "run-c", two)
    assert isinstance(timed, Denial) and timed.reason == "paused" and timed.limit == str(until)
    assert 1000 < timed.wait_ms <= 1500
    r.hdel(CONF, "k:acme:paused_until")
    # Resumed: run-c asks first, but run-b came first and is expected back: the free slot is held for it.
    assert isinstance(_ask_named(store, "h:1:c", "run-c", two), Denial)
    assert isinstance(_ask_named(store, "h:1:b", "run-b", two), Grant)
    store_limits.release(store, NAMED, "h:1:a", ran=True)
    assert isinstance(_ask_named(store, "h:1:c", "run-c", two), Grant)
    # An ended pause is none.
    r.hset(CONF, "paused_until", limits_app.server_ms(r) - 1)
    assert isinstance(_ask_named(store, "h:1:d", "run-d", LimitPolicy(None, concurrency=5)), Grant)


# --- run-time control: override, clear_override, pause, resume, describe --------------------

PARTNER = {"partner-api": {"concurrency": 1, "rate": ["10/s", "10000/d"]}, "mail": {"rate": "100/m"}}


def test_override_and_clear_take_effect_at_the_next_admission(make_app: AppFactory, r: redis.Redis) -> None:
    app = make_app(dedup_limit_groups=PARTNER)
    store = store_for(app)
    declared = LimitPolicy(None, concurrency=1, rates=(Rate(10, 1000), Rate(10_000, 86_400_000)), group="partner-api")
    assert isinstance(_ask_named(store, "h:1:a", "run-a", declared), Grant)
    assert isinstance(_ask_named(store, "h:1:b", "run-b", declared), Denial)
    celery_dedup.limits.override(app, "partner-api", "acme", concurrency=2, by="ops")
    assert isinstance(_ask_named(store, "h:1:b", "run-b", declared), Grant), "raised: the next admission gets in"
    celery_dedup.limits.override(app, "partner-api", concurrency=5)
    celery_dedup.limits.override(app, "partner-api", "acme", rate=["20/s", "100/d"])
    refused = _ask_named(store, "h:1:c", "run-c", declared)
    assert isinstance(refused, Denial) and (refused.reason, refused.limit) == ("concurrency", "2"), "key over group"
    (info, mail) = celery_dedup.limits.describe(app)
    assert (info.name, info.concurrency, info.rates) == ("partner-api", 1, (Rate(10, 1000), Rate(10_000, 86_400_000)))
    assert info.override == celery_dedup.limits.Override(5, None) and info.paused_until is None
    acme = celery_dedup.limits.Override(2, (Rate(20, 1000), Rate(100, 86_400_000)))
    assert info.keys == {"acme": celery_dedup.limits.KeyConf(acme, None)}
    assert (mail.name, mail.override, mail.keys) == ("mail", None, {})
    assert celery_dedup.limits.clear_override(app, "partner-api", "acme")
    assert not celery_dedup.limits.clear_override(app, "partner-api", "acme")
    assert isinstance(_ask_named(store, "h:1:c", "run-c", declared), Grant), "the group's 5 applies to acme again"
    assert celery_dedup.limits.clear_override(app, "partner-api")
    lowered = _ask_named(store, "h:1:d", "run-d", declared)
    assert isinstance(lowered, Denial) and lowered.limit == "1", "lowered: back to the declared 1"
    assert celery_dedup.limits.describe(app)[0].override is None


@pytest.mark.parametrize(
    ("call", "parameter", "value"),
    [
        pytest.param({"concurrency": 0}, "concurrency", 0, id="concurrency-zero"),
        pytest.param({"concurrency": -2}, "concurrency", -2, id="concurrency-negative"),
        pytest.param({"concurrency": 2.5}, "concurrency", 2.5, id="concurrency-float"),
        pytest.param({"rate": "0/s"}, "rate", "0/s", id="rate-zero"),
        pytest.param({"rate": "10/w"}, "rate", "10/w", id="rate-unit"),
        pytest.param({"rate": []}, "rate", [], id="rate-empty-list"),
        pytest.param({}, "concurrency", None, id="nothing-to-set"),
        pytest.param({"key": "", "concurrency": 1}, "key", "", id="key-empty"),
        pytest.param({"group": "partner", "concurrency": 1}, "group", "partner", id="group-unknown"),
    ],
)
def test_bad_values_at_override_raise_naming_the_group_and_the_value(
    make_app: AppFactory, r: redis.Redis, call: dict[str, Any], parameter: str, value: Any
) -> None:
    app = make_app(dedup_limit_groups=PARTNER)
    group = call.pop("group", "partner-api")
    with pytest.raises(DedupArgumentError) as info:
        celery_dedup.limits.override(app, group, **call)
    assert (info.value.parameter, info.value.value) == (parameter, value)
    assert repr(group) in str(info.value) and repr(value) in str(info.value)
    assert r.keys("dedup:lim:conf:*") == [], "nothing written"


def test_pause_and_resume_a_key_or_the_group(make_app: AppFactory, r: redis.Redis) -> None:
    app = make_app(dedup_limit_groups=PARTNER)
    store = store_for(app)
    declared = LimitPolicy(None, concurrency=1, group="partner-api")
    limits_api = celery_dedup.limits
    limits_api.pause(app, "partner-api", "acme", by="ops")
    paused = _ask_named(store, "h:1:a", "run-a", declared)
    assert isinstance(paused, Denial) and (paused.reason, paused.limit) == ("paused", "-1")
    assert limits_api.describe(app)[0].keys == {"acme": limits_api.KeyConf(None, -1)}
    assert limits_api.resume(app, "partner-api", "acme") and not limits_api.resume(app, "partner-api", "acme")
    assert isinstance(_ask_named(store, "h:1:a", "run-a", declared), Grant)
    store_limits.release(store, NAMED, "h:1:a", ran=True)
    now = limits_app.server_ms(r)
    limits_api.pause(app, "partner-api", until=30)
    (info, _) = limits_api.describe(app)
    assert info.paused_until is not None and now + 29_000 < info.paused_until <= now + 31_000
    assert isinstance(_ask_named(store, "h:1:b", "run-b", declared), Denial)
    for until in (
        datetime.timedelta(minutes=1),
        datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=2),
        datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None) + datetime.timedelta(minutes=3),
    ):
        limits_api.pause(app, "partner-api", until=until)
        shown = limits_api.describe(app)[0].paused_until
        assert shown is not None and now + 50_000 < shown < now + 190_000, (until, shown)
    assert limits_api.resume(app, "partner-api")
    assert isinstance(_ask_named(store, "h:1:b", "run-b", declared), Grant)
    # A pause that has ended is no longer shown.
    limits_api.pause(app, "mail", "x", until=0.05)
    time.sleep(0.1)
    assert limits_api.describe(app)[1].keys == {}
    for bad in (0, -5, "soon", float("nan"), datetime.datetime(2000, 1, 1), True):
        with pytest.raises(DedupArgumentError) as info_bad:
            limits_api.pause(app, "partner-api", until=bad)
        assert info_bad.value.parameter == "until" and "'partner-api'" in str(info_bad.value)


def test_group_wide_values_go_to_every_shards_copy_a_keys_to_its_own(r: redis.Redis) -> None:
    from celery_dedup.store.store import DedupStore  # noqa: PLC0415

    store = DedupStore(r, "dedup", shards=16)
    store_limits.set_conf(store, "partner-api", None, {"paused_until": -1})
    store_limits.set_conf(store, "partner-api", "acme", {"concurrency": 3})
    namespace = limit_group_namespace("partner-api")
    copies = [at.limit_conf(namespace) for at in store.schema.shards_all()]
    assert all(r.hget(copy, "paused_until") == b"-1" for copy in copies)
    home = store.schema.shard_of(NAMED).limit_conf(namespace)
    assert [copy for copy in copies if r.hexists(copy, "k:acme:concurrency")] == [home]
    assert r.ttl(home) == -1, "no TTL"
    refused = store_limits.acquire(
        store, NAMED, "h:1:a", "run-a", LimitPolicy(None, concurrency=1), lease_ms=60_000, task_name="t"
    )
    assert isinstance(refused, Denial) and refused.reason == "paused"
    assert store_limits.clear_conf(store, "partner-api", None, ("paused_until",))
    granted = store_limits.acquire(
        store, NAMED, "h:1:a", "run-a", LimitPolicy(None, concurrency=1), lease_ms=60_000, task_name="t"
    )
    assert isinstance(granted, Grant)
    group, keys, _ = store_limits.read_conf(store, "partner-api")
    assert (group, keys) == ({}, {"acme": {"concurrency": "3"}})
    star = limit_group_member("partner-api", "*")
    store_limits.set_conf(store, "partner-api", "*", {"concurrency": 2})
    assert store_limits.read_conf(store, "partner-api")[1]["*"] == {"concurrency": "2"}
    assert r.hexists(store.schema.shard_of(star).limit_conf(namespace), "k:{*}:concurrency")


# --- real prefork workers ------------------------------------------------------------------


@contextmanager
def worker(
    server: Server, concurrency: int, *, pool: str = "prefork", url: str = "", **conf: Any
) -> Iterator[WorkerProcess]:
    process = WorkerProcess(
        url or server.url,
        app="tests.limits_app",
        pool=pool,
        concurrency=concurrency,
        env={"CELERY_DEDUP_LIMITS_CONF": json.dumps(conf)},
    )
    try:
        yield process.wait_ready()
    except BaseException:
        print("".join(process.output))
        raise
    finally:
        process.stop()


def runs(r: redis.Redis) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in r.lrange(limits_app.RUNS, 0, -1)]


def most_at_once(entries: list[dict[str, Any]]) -> int:
    """The most bodies running at the same time, from their recorded start and end (server ms)."""
    # At one millisecond an end comes before a start: a slot is given back after its body ended.
    events = sorted([(e["start"], 1) for e in entries] + [(e["end"], -1) for e in entries], key=lambda x: (x[0], x[1]))
    running = most = 0
    for _, step in events:
        running += step
        most = max(most, running)
    return most


@pytest.fixture
def tasks(make_app: AppFactory) -> limits_app.Tasks:
    return limits_app.register(make_app("limits_app", dedup_limit_groups=limits_app.GROUPS))


@pytest.mark.slow
def test_two_tenants_two_at_a_time_each_all_run_once_neither_starves(
    server: Server, r: redis.Redis, tasks: limits_app.Tasks
) -> None:
    with worker(server, concurrency=8) as process:
        for n in range(20):
            tasks.job.delay(n, "A")
            tasks.job.delay(100 + n, "B")
        wait_for(lambda: r.llen(limits_app.RUNS) >= 40, 120, lambda: f"{r.llen(limits_app.RUNS)} of 40 ran")
        wait_for(lambda: r.zcard(SCHEMA.limit_slots("tests.limits_app.job:tenant:B")) == 0, 10, "slots given back")
        done = runs(r)
        output = "".join(process.output)
    assert Counter(e["key"] for e in done) == Counter({f"job:{n}": 1 for n in [*range(20), *range(100, 120)]}), output
    by_tenant = {tenant: [e for e in done if e["group"] == tenant] for tenant in "AB"}
    for tenant, entries in by_tenant.items():
        assert most_at_once(entries) <= 2, (tenant, sorted((e["start"], e["end"]) for e in entries))
    # Each tenant ran two at once at times (the limit is not stricter than asked) ...
    assert all(most_at_once(entries) == 2 for entries in by_tenant.values())
    # ... and B went on while A did: each had half its runs started before the other's last ended.
    for one, other in ("AB", "BA"):
        tenth_start = sorted(e["start"] for e in by_tenant[one])[9]
        assert tenth_start < max(e["end"] for e in by_tenant[other]), (one, "starved")
    for group in ("tests.limits_app.job:tenant:A", "tests.limits_app.job:tenant:B"):
        assert r.zcard(SCHEMA.limit_slots(group)) == 0
        assert r.zcard(SCHEMA.limit_waiting(group)) == 0
    stats = store_for(tasks.job.app).stats()["tests.limits_app.job"]
    assert stats["limited"] > 0 and stats["waited_ms"] > 0
    statuses = {n: tasks.job.dedup_status(n, "A") for n in range(20)}
    assert all(s is not None and s.state == "succeeded" and s.attempts == 1 for s in statuses.values())
    waited = [n for n, s in statuses.items() if s is not None and int(s.fields.get("waited_ms", 0)) > 0]
    assert waited, "runs that waited say so in their record"
    history = store_for(tasks.job.app).history(f"tests.limits_app.job:job:{waited[0]}")
    assert any("waiting: concurrency 2/2 in use for tenant:A" in entry for entry in history), history


@pytest.mark.slow
def test_rate_five_per_second_spreads_starts_and_runs_each_once(
    server: Server, r: redis.Redis, tasks: limits_app.Tasks
) -> None:
    with worker(server, concurrency=4) as process:
        for n in range(30):
            tasks.rated.delay(n)
        wait_for(lambda: r.llen(limits_app.RUNS) >= 30, 60, lambda: f"{r.llen(limits_app.RUNS)} of 30 ran")
        done = runs(r)
        output = "".join(process.output)
    assert Counter(e["key"] for e in done) == Counter({f"call:{n}": 1 for n in range(30)}), output
    granted = sorted(e["granted"] for e in done)
    assert all(g is not None for g in granted)
    # At most 5 starts in any window of 1 s, on the server's clock: the 6th after any start is 1 s later.
    assert all(later - first >= 1000 for first, later in zip(granted, granted[5:], strict=False)), granted
    assert all(e["granted"] <= e["start"] for e in done), "the body starts after its grant"


@pytest.mark.slow
def test_a_worker_killed_holding_slots_gives_them_back_and_loses_nothing(
    server: Server, r: redis.Redis, tasks: limits_app.Tasks
) -> None:
    """Two runs hold both of tenant K's slots when their pool children are SIGKILLed.

    Their messages come back (acks_late, reject_on_worker_lost); the slots
    return, the waiting runs of K get them, and every run ends once. The
    lock TTL (the slots' lease) is 300 s and everything must end well within
    it: the slots come back because their holders are known dead (the main
    process saw its children die; a refused delivery proves it), not because
    their leases ran out.
    """
    conf: dict[str, Any] = {"task_acks_late": True, "task_reject_on_worker_lost": True, "dedup_lock_ttl": 300}
    r.sadd(limits_app.HANG, "hang:0", "hang:1")
    with worker(server, concurrency=4, **conf) as process:
        for n in range(6):
            tasks.hanging.delay(n, "K")
        group = "tests.limits_app.hanging:tenant:K"
        wait_for(lambda: r.scard(limits_app.HANG) == 0, 30, "both hanging runs started")
        holders = [member.decode() for member in r.zrange(SCHEMA.limit_slots(group), 0, -1)]
        assert len(holders) == 2, holders
        pids = {int(token.split(":")[1]) for token in holders}
        assert process.process.pid not in pids
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: r.llen(limits_app.RUNS) >= 6, 60, lambda: f"{r.llen(limits_app.RUNS)} of 6 ended")
        wait_for(lambda: r.zcard(SCHEMA.limit_slots(group)) == 0, 10, "every slot given back")
        done = runs(r)
        output = "".join(process.output)
    assert Counter(e["key"] for e in done) == Counter({f"hang:{n}": 1 for n in range(6)}), output
    assert most_at_once(done) <= 2
    for n in range(6):
        status = tasks.hanging.dedup_status(n, "K")
        assert status is not None and status.state == "succeeded", (n, status)


@pytest.mark.slow
def test_limits_combine_with_every_dedup_mode(server: Server, r: redis.Redis, tasks: limits_app.Tasks) -> None:
    """One run of a group at a time in every mode; each call runs once; duplicates are still answered."""
    with worker(server, concurrency=6) as process:
        published: dict[str, list[Any]] = {}
        for mode, task in tasks.by_mode.items():
            published[mode] = [task.delay(n, mode) for n in range(3)]
        again = tasks.by_mode["until_executed"].delay(0, "until_executed")
        assert again.deduplicated and again.id == published["until_executed"][0].id
        wait_for(lambda: r.llen(limits_app.RUNS) >= 21, 90, lambda: f"{r.llen(limits_app.RUNS)} of 21 ran")
        done = runs(r)
        output = "".join(process.output)
    for mode in tasks.by_mode:
        entries = [e for e in done if e["group"] == mode]
        assert Counter(e["key"] for e in entries) == Counter({f"{mode}:{n}": 1 for n in range(3)}), (mode, output)
        assert most_at_once(entries) == 1, mode


def test_a_run_revoked_while_it_waits_leaves_the_line(make_app: AppFactory, r: redis.Redis) -> None:
    """An ending reported from outside the body (here a revoke) takes the run out of its group's waiting line."""
    from celery_dedup.worker.delivery import settle_elsewhere  # noqa: PLC0415

    app = make_app("limits_app", dedup_limit_groups=limits_app.GROUPS)
    tasks = limits_app.register(app)
    store = store_for(app)
    group = "tests.limits_app.job:tenant:Z"
    two = LimitPolicy(None, concurrency=2)
    for n in range(2):  # held by deliveries on another host: alive as far as anyone here can tell
        store_limits.acquire(
            store, group, f"elsewhere:1:{n}", f"other-{n}", two, lease_ms=60_000, task_name=tasks.job.name
        )
    run = tasks.job.delay(1, "Z")
    refused = store_limits.acquire(store, group, "h:1:x", run.id, two, lease_ms=60_000, task_name=tasks.job.name)
    assert isinstance(refused, Denial) and r.zscore(SCHEMA.limit_waiting(group), run.id) is not None
    assert settle_elsewhere(tasks.job, "revoked", run.id, None, [1, "Z"], {}, stopping=False)
    assert r.zscore(SCHEMA.limit_waiting(group), run.id) is None
    assert r.zscore(SCHEMA.limit_deadlines(group), run.id) is None
    assert r.zcard(SCHEMA.limit_slots(group)) == 2, "the other deliveries keep their slots"


def test_a_call_whose_limit_group_cannot_be_derived_fails_at_the_call(make_app: AppFactory, r: redis.Redis) -> None:
    from celery_dedup.exceptions import DedupKeyError  # noqa: PLC0415

    app = make_app()

    def nobody(order_id: int, tenant: str) -> str | None:
        return None if tenant == "?" else tenant

    for mode in ("until_executed", "off"):
        task = _define(app, dedup_mode=mode, limit_key=nobody, limit_concurrency=1)
        with pytest.raises(DedupKeyError) as info:
            task.delay(1, "?")
        assert info.value.task == "shop.limited"
        assert r.llen("celery") == 0
        app.tasks.pop("shop.limited")


def test_prometheus_exposes_refusals_and_waited_seconds(make_app: AppFactory, r: redis.Redis) -> None:
    from prometheus_client import CollectorRegistry, generate_latest  # noqa: PLC0415
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    from celery_dedup.contrib.prometheus import DedupCollector  # noqa: PLC0415

    app = make_app()
    store = store_for(app)
    one = LimitPolicy(None, concurrency=1)
    _ask(store, "h:1:a", "run-1", one)
    _ask(store, "h:1:b", "run-2", one)
    r.zadd(SCHEMA.limit_waiting(GROUP), {"run-2": 1})  # it arrived long ago
    store_limits.release(store, GROUP, "h:1:a", ran=True)
    granted = _ask(store, "h:1:c", "run-2", one)
    assert isinstance(granted, Grant) and granted.waited_ms > 1000
    registry = CollectorRegistry()
    registry.register(DedupCollector(app))
    text = generate_latest(registry).decode()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    decisions = {s.labels["decision"]: s.value for s in families["celery_dedup_decisions"].samples}
    assert decisions["limited"] == 1 and "waited_ms" not in decisions
    (waited,) = [s for s in families["celery_dedup_limit_waited_seconds"].samples if s.name.endswith("_total")]
    assert waited.labels == {"task": "shop.limited"} and waited.value == granted.waited_ms / 1000


@pytest.mark.slow
def test_a_slot_outlives_its_lease_while_its_body_runs(server: Server, r: redis.Redis, tasks: limits_app.Tasks) -> None:
    """A body running several lock TTLs keeps its slot: the renewer extends it with the lock."""
    with worker(server, concurrency=2, dedup_lock_ttl=1) as process:
        tasks.long.delay(1)
        tasks.long.delay(2)
        wait_for(lambda: r.llen(limits_app.RUNS) >= 2, 30, lambda: f"{r.llen(limits_app.RUNS)} of 2 ran")
        done = runs(r)
        output = "".join(process.output)
    assert sorted(e["key"] for e in done) == ["long:1", "long:2"], output
    assert all(e["end"] - e["start"] > 3000 for e in done)
    assert most_at_once(done) == 1, [(e["start"], e["end"]) for e in done]
    assert "limit slot lost" not in output


@pytest.mark.slow
def test_a_body_that_ends_after_losing_its_slot_reports_the_loss(
    server: Server, r: redis.Redis, tasks: limits_app.Tasks
) -> None:
    """Two runs hold tenant K's slots; one slot is evicted, the other's lease lapses, before either body ends.

    Both bodies end before the renewer's next renewal (a third of the 30 s
    lease) could learn it: giving the slot back must say that the run went
    on beyond its group's limit, as a failed renewal does. A SIGSTOP past
    the lease ends the same way when the body returns first on waking.
    """
    group = "tests.limits_app.hanging:tenant:K"
    slots = SCHEMA.limit_slots(group)
    r.sadd(limits_app.HOLD, "hang:0", "hang:1")
    with worker(server, concurrency=2, dedup_lock_ttl=30) as process:
        tasks.hanging.delay(0, "K")
        tasks.hanging.delay(1, "K")
        wait_for(lambda: r.zcard(slots) == 2, 30, "both runs took their slots")
        evicted, lapsed = (member.decode() for member in r.zrange(slots, 0, -1))
        r.zrem(slots, evicted)
        r.zadd(slots, {lapsed: limits_app.server_ms(r) - 1}, xx=True)
        r.delete(limits_app.HOLD)
        wait_for(lambda: r.llen(limits_app.RUNS) >= 2, 30, lambda: f"{r.llen(limits_app.RUNS)} of 2 ended")
        wait_for(lambda: "limit slot lost" in "".join(process.output), 5, "the loss logged")
        output = "".join(process.output)
    assert output.count(f"limit slot lost in group {group!r}") == 2, output


def test_a_rate_only_run_holds_no_slot_and_reports_none_lost(
    server: Server, r: redis.Redis, tasks: limits_app.Tasks
) -> None:
    """A rate limit counts starts, it holds no place: a body running past many renewals has nothing to lose."""
    r.sadd(limits_app.HOLD, "call:0")
    with worker(server, concurrency=1, dedup_lock_ttl=1) as process:
        tasks.rated.delay(0)
        wait_for(lambda: r.exists(SCHEMA.limit_starts("tests.limits_app.rated:api")), 30, "the run started")
        time.sleep(1.5)  # several renewal passes (every third of the 1 s TTL) while the body is held
        r.delete(limits_app.HOLD)
        wait_for(lambda: r.llen(limits_app.RUNS) >= 1, 30, "the run ended")
        output = "".join(process.output)
    assert "limit slot lost" not in output, output


def test_a_limits_only_run_revoked_while_it_waits_leaves_the_line(make_app: AppFactory, r: redis.Redis) -> None:
    from celery_dedup.worker.delivery import settle_elsewhere  # noqa: PLC0415

    app = make_app("limits_app", dedup_limit_groups=limits_app.GROUPS)
    task = limits_app.register(app).by_mode["off"]
    store = store_for(app)
    group = f"{task.name}:group:g"
    one = LimitPolicy(None, concurrency=1)
    store_limits.acquire(store, group, "elsewhere:1:0", "other", one, lease_ms=60_000, task_name=task.name)
    run = task.delay(1, "g")
    assert isinstance(
        store_limits.acquire(store, group, "h:1:x", run.id, one, lease_ms=60_000, task_name=task.name), Denial
    )
    assert not settle_elsewhere(task, "revoked", run.id, None, [1, "g"], {}, stopping=False)
    assert r.zscore(SCHEMA.limit_waiting(group), run.id) is None
    assert r.keys("dedup:rec:*") == [], "a limits-only task has no record"


def test_eager_calls_take_no_place_in_their_group(make_app: AppFactory, r: redis.Redis) -> None:
    """Eager mode applies no limits: a limited task called inside its own body still runs, and no group is made."""
    app = make_app(task_always_eager=True)
    ran: list[int] = []

    @app.task(
        base=DedupTask, name="shop.eager_limited", dedup_key="job:{n}", limit_key="all", limit_concurrency=1,
        shared=False,
    )  # fmt: skip
    def nested(n: int) -> None:
        ran.append(n)
        if n < 2:
            nested.delay(n + 1)  # a second body of the group while the first still runs

    nested.delay(0)
    assert ran == [0, 1, 2]
    assert list(r.scan_iter(match="dedup:lim:*")) == []


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["threads", "gevent", "eventlet"])
def test_one_process_pools_run_one_body_of_a_group_at_a_time_and_evict_no_live_sibling(
    server: Server, r: redis.Redis, tasks: limits_app.Tasks, pool: str
) -> None:
    """Ten deliveries of one process race for a group's single slot: a sibling's fresh slot is never taken for dead.

    Every token of a one-process pool names the same pid, so only the process's
    own registry tells a live sibling from an ended one: a slot just granted
    must be in it before any sibling can see it in the group.
    """
    if pool != "threads":
        pytest.importorskip(pool)
    task = tasks.by_mode["until_executed"]
    calls = 30
    port = urlparse(server.url).port
    assert port is not None
    # Replies 20 ms late, as from a store across a network: a round trip a delivery makes between its
    # grant and its body is long enough for its siblings to come back, be refused and judge its slot.
    with FaultProxy(port) as proxy, worker(server, concurrency=10, pool=pool, url=proxy.url) as process:
        proxy.delay(0.02)
        for n in range(calls):
            task.delay(n, pool)
        wait_for(lambda: r.llen(limits_app.RUNS) >= calls, 120, lambda: f"{r.llen(limits_app.RUNS)} of {calls} ran")
        done = runs(r)
        output = "".join(process.output)
    assert Counter(e["key"] for e in done) == Counter({f"until_executed:{n}": 1 for n in range(calls)}), output
    assert len({e["pid"] for e in done}) == 1, "one process ran them all"
    assert most_at_once(done) == 1, sorted((e["start"], e["end"]) for e in done)
    assert store_for(task.app).stats()[task.name].get("limit_evicted", 0) == 0, "nothing died, nothing is evicted"


def test_two_deliveries_of_one_run_in_one_process_keep_their_own_slots(
    make_app: AppFactory, r: redis.Redis, tasks: limits_app.Tasks
) -> None:
    """Two deliveries of one run hold slots in one process a moment (a copy on its way to being refused).

    The copy giving its slot back leaves the other's alone: still its
    grant, still alive to a sibling asking for the group.
    """
    store = store_for(tasks.job.app)
    task: Any = tasks.job
    deliveries = []
    for _ in range(2):
        task.push_request(id="run-1", args=[1, "T"], kwargs={}, headers=None, is_eager=False)
        try:
            delivery = Delivery(task, (1, "T"), {}, task.run, member=None, store=store, gated=False)
            delivery.claim()
            assert limits.LIMITS.before_start(delivery)
            deliveries.append(delivery)
        finally:
            task.pop_request()
    copy, running = deliveries  # the copy came first: the order the registry keeps must not decide
    running.running = True  # as the delivery marks itself once its start lets it run
    granted = running.held[limits.LIMITS].grant
    try:
        assert limits.current("run-1") is granted, "while both hold a slot, the running delivery's grant"
        limits.LIMITS.after_end(copy, ran=False)
        copy.retire()
        assert limits.current("run-1") == granted
        assert not limits.owner_gone(running.token), "a delivery of this process that still holds its slot"
        assert limits.owner_gone(copy.token), "one that gave its slot back has ended"
    finally:
        limits.LIMITS.after_end(running, ran=True)
        running.retire()
    assert limits.current("run-1") is None
    assert r.zcard(SCHEMA.limit_slots("tests.limits_app.job:tenant:T")) == 0


@pytest.mark.slow
def test_free_slots_are_not_held_for_runs_ahead_that_do_not_come_back(
    server: Server, r: redis.Redis, tasks: limits_app.Tasks
) -> None:
    """Two runs ahead in line never come back (their countdown messages held up far beyond their turn).

    They keep their places for their whole lease (60 s), but both slots are
    free: the group's new runs must not wait behind them that long. Each
    run's message came back, was refused and re-published in turn; if the
    line blocked the free slots, none of them would start within the test.
    """
    group = "tests.limits_app.job:tenant:G"
    store = store_for(tasks.job.app)
    two = LimitPolicy(None, concurrency=2)
    for n in range(2):  # held elsewhere while the two runs arrive, then given back
        store_limits.acquire(
            store, group, f"elsewhere:1:{n}", f"other-{n}", two, lease_ms=60_000, task_name=tasks.job.name
        )
    for n in range(2):
        late = store_limits.acquire(
            store, group, f"gone:1:{n}", f"ahead-{n}", two, lease_ms=60_000, task_name=tasks.job.name
        )
        assert isinstance(late, Denial) and late.wait_ms <= 1000
    for n in range(2):
        store_limits.release(store, group, f"elsewhere:1:{n}", ran=False)
    with worker(server, concurrency=4) as process:
        for n in range(4):
            tasks.job.delay(n, "G")
        wait_for(lambda: r.llen(limits_app.RUNS) >= 4, 20, lambda: f"{r.llen(limits_app.RUNS)} of 4 ran")
        done = runs(r)
        output = "".join(process.output)
    assert Counter(e["key"] for e in done) == Counter({f"job:{n}": 1 for n in range(4)}), output
    assert most_at_once(done) <= 2
    assert [m.decode() for m in r.zrange(SCHEMA.limit_waiting(group), 0, -1)] == ["ahead-0", "ahead-1"], (
        "the runs ahead keep their places until their lease runs out"
    )


# --- named groups, windows, overrides and pauses on real workers ----------------------------


def _starts_in_order(entries: list[dict[str, Any]]) -> list[str]:
    return [e["key"] for e in sorted(entries, key=lambda e: e["start"])]


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_two_tasks_sharing_a_group_never_run_more_than_its_limit_of_a_key(
    server: Server, r: redis.Redis, tasks: limits_app.Tasks, pool: str
) -> None:
    """Group "shared" allows 2 bodies per tenant: tasks a and b together never run a third of one tenant."""
    task_a, task_b = tasks.shared
    with worker(server, concurrency=8, pool=pool) as process:
        for n in range(8):
            for tenant in "AB":
                task_a.delay(n, tenant)
                task_b.delay(n, tenant)
        wait_for(lambda: r.llen(limits_app.RUNS) >= 32, 120, lambda: f"{r.llen(limits_app.RUNS)} of 32 ran")
        done = runs(r)
        output = "".join(process.output)
    expected = Counter({(t, f"{name}:{n}", tenant): 1 for t, name in (("shared_a", "a"), ("shared_b", "b"))
                        for n in range(8) for tenant in "AB"})  # fmt: skip
    assert Counter((e["task"], e["key"], e["group"]) for e in done) == expected, output
    for tenant in "AB":
        entries = [e for e in done if e["group"] == tenant]
        assert {e["task"] for e in entries} == {"shared_a", "shared_b"}
        assert most_at_once(entries) == 2, (tenant, sorted((e["start"], e["end"], e["task"]) for e in entries))
    assert most_at_once(done) > 2, "the tenants are separate quotas"
    for tenant in "AB":
        assert r.zcard(SCHEMA.limit_slots(limit_group_member("shared", tenant))) == 0


@pytest.mark.slow
def test_two_windows_on_workers_two_a_second_and_three_a_minute(
    server: Server, r: redis.Redis, tasks: limits_app.Tasks
) -> None:
    """Group "windows" (2/s and 3/m, one quota): of six runs of two tasks, three start, at most two in any second."""
    task_a, task_b = tasks.windowed
    with worker(server, concurrency=4):
        for n in range(3):
            task_a.delay(n)
            task_b.delay(n)
        wait_for(lambda: r.llen(limits_app.RUNS) >= 3, 30, lambda: f"{r.llen(limits_app.RUNS)} of 3 ran")
        time.sleep(2.5)  # room in the second's window again and again: the minute's holds the rest
        done = runs(r)
        waiting = [m.decode() for m in r.zrange(SCHEMA.limit_waiting(limit_group_member("windows", None)), 0, -1)]
    assert len(done) == 3, done
    granted = sorted(e["granted"] for e in done)
    assert granted[2] - granted[0] >= 1000, f"no second holds three starts: {granted}"
    assert len(waiting) == 3, waiting
    records = [store_for(task_a.app).record(f"{t.name}:n:{n}") for t in (task_a, task_b) for n in range(3)]
    notes = [rec.get("limit_wait") for rec in records if rec and rec.get("state") == "queued"]
    assert len(notes) == 3, records
    # Each was last refused while the minute's window filled (2 or 3 of 3): it waits for that window.
    assert all(note and note.startswith("rate ") and note.endswith("/3/m used for windows") for note in notes), notes


@pytest.mark.slow
def test_an_override_takes_effect_at_the_next_admission_lower_and_raise(
    server: Server, r: redis.Redis, tasks: limits_app.Tasks
) -> None:
    task_a, task_b = tasks.shared
    with worker(server, concurrency=6):
        celery_dedup.limits.override(task_a.app, "shared", "L", concurrency=1)
        celery_dedup.limits.override(task_a.app, "shared", "H", concurrency=4)
        for n in range(4):
            for tenant in "LH":
                task_a.delay(n, tenant)
                task_b.delay(n, tenant)
        wait_for(lambda: r.llen(limits_app.RUNS) >= 16, 90, lambda: f"{r.llen(limits_app.RUNS)} of 16 ran")
        done = runs(r)
    lowered = [e for e in done if e["group"] == "L"]
    raised = [e for e in done if e["group"] == "H"]
    assert len(lowered) == len(raised) == 8
    assert most_at_once(lowered) == 1, sorted((e["start"], e["end"]) for e in lowered)
    assert 2 < most_at_once(raised) <= 4, sorted((e["start"], e["end"]) for e in raised)


@pytest.mark.slow
def test_a_pause_holds_no_worker_slot_survives_a_restart_and_resume_keeps_arrival_order(
    server: Server, r: redis.Redis, tasks: limits_app.Tasks
) -> None:
    """Group "pausable" paused: its runs wait as countdown messages (a free task still runs on the worker's
    only process), a new worker (threads pool) still holds them, and after resume they run in arrival order."""
    app = tasks.pausable.app
    group = limit_group_member("pausable", None)
    celery_dedup.limits.pause(app, "pausable", by="test")
    with worker(server, concurrency=1):
        for n in range(4):
            tasks.pausable.delay(n)
        wait_for(lambda: r.zcard(SCHEMA.limit_waiting(group)) == 4, 30, "all four wait")
        tasks.free.delay(1)
        wait_for(lambda: r.llen(limits_app.RUNS) >= 1, 10, "the free task ran beside the paused ones")
    with worker(server, concurrency=2, pool="threads"):
        tasks.free.delay(2)
        wait_for(lambda: r.llen(limits_app.RUNS) >= 2, 15, "the free task ran on the new worker")
        time.sleep(6)  # more than one look again of every paused run
        assert [e["key"] for e in runs(r)] == ["free:1", "free:2"], "nothing of the paused group started"
        line = [m.decode() for m in r.zrange(SCHEMA.limit_waiting(group), 0, -1)]
        assert len(line) == 4
        assert celery_dedup.limits.resume(app, "pausable")
        wait_for(lambda: r.llen(limits_app.RUNS) >= 6, 30, lambda: f"{r.llen(limits_app.RUNS)} of 6 ran")
        done = [e for e in runs(r) if e["group"] == "pausable"]
    assert [e["id"] for e in sorted(done, key=lambda e: e["start"])] == line, "they start in arrival order"
    assert most_at_once(done) == 1


@pytest.mark.slow
def test_a_killed_holder_of_a_named_groups_slot_gives_it_back(
    server: Server, r: redis.Redis, tasks: limits_app.Tasks
) -> None:
    """Both of tenant K's slots in group "shared" are held by hanging bodies of two tasks when their children are
    SIGKILLed: the slots come back (long before the 300 s lease) and every run ends once."""
    conf: dict[str, Any] = {"task_acks_late": True, "task_reject_on_worker_lost": True, "dedup_lock_ttl": 300}
    task_a, task_b = tasks.shared
    r.sadd(limits_app.HANG, "a:0", "b:0")
    slots = SCHEMA.limit_slots(limit_group_member("shared", "K"))
    with worker(server, concurrency=4, **conf) as process:
        task_a.delay(0, "K")
        task_b.delay(0, "K")
        wait_for(lambda: r.scard(limits_app.HANG) == 0, 30, "both hanging runs started")
        for n in range(1, 3):
            task_a.delay(n, "K")
            task_b.delay(n, "K")
        holders = [member.decode() for member in r.zrange(slots, 0, -1)]
        assert len(holders) == 2, holders
        for pid in {int(token.split(":")[1]) for token in holders}:
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: r.llen(limits_app.RUNS) >= 6, 60, lambda: f"{r.llen(limits_app.RUNS)} of 6 ended")
        wait_for(lambda: r.zcard(slots) == 0, 10, "every slot given back")
        done = runs(r)
        output = "".join(process.output)
    assert Counter(e["key"] for e in done) == Counter({f"{t}:{n}": 1 for t in "ab" for n in range(3)}), output
    assert most_at_once(done) <= 2


@pytest.mark.slow
@pytest.mark.parametrize(
    ("pool", "how"),
    [("prefork", how) for how in limits_app.ENDINGS] + [("threads", how) for how in ("succeed", "fail", "retry")],
)
def test_a_named_groups_slot_comes_back_on_every_ending(
    server: Server, r: redis.Redis, tasks: limits_app.Tasks, pool: str, how: str
) -> None:
    """Success, failure, retry, a hard time limit and a revoke that terminates: the slot comes back at the ending.

    The lease (the lock TTL) is 300 s, so its expiry cannot be what frees it; the next run of the group starts.
    """
    slots = SCHEMA.limit_slots(limit_group_member("endings", None))
    with worker(server, concurrency=2, pool=pool, dedup_lock_ttl=300) as process:
        first = tasks.ending.apply_async((1, how), time_limit=1 if how == "time_limit" else None)
        wait_for(lambda: r.llen(limits_app.ENDING_STARTS) >= 1, 30, "the first body started")
        if how in ("time_limit", "revoke"):
            assert r.zcard(slots) == 1, "the hanging body holds the slot"
        if how == "revoke":
            tasks.ending.app.control.revoke(first.id, terminate=True, signal="SIGKILL")
        tasks.ending.delay(2, "succeed")
        wanted = 3 if how == "retry" else 2
        wait_for(
            lambda: r.llen(limits_app.ENDING_STARTS) >= wanted,
            30,
            lambda: f"the next run of the group starts: {r.lrange(limits_app.ENDING_STARTS, 0, -1)}",
        )
        wait_for(lambda: r.zcard(slots) == 0, 10, "every slot given back")
        output = "".join(process.output)
    starts = [raw.decode() for raw in r.lrange(limits_app.ENDING_STARTS, 0, -1)]
    assert starts[0] == f"1:{how}:0", output
    assert "2:succeed:0" in starts, output
    if how == "retry":
        assert "1:retry:1" in starts, output


def test_a_copy_of_a_started_run_refused_by_its_paused_group_does_not_come_back_as_a_new_run(
    make_app: AppFactory, r: redis.Redis
) -> None:
    """until_executing in a named group: run A's body runs (the key freed as it started); B of the key is
    accepted and ends (refused by A's lock); the group key is paused; then a copy of A's message arrives
    (a redelivery: the visibility timeout passed while A ran). The limits refuse the copy before the guard
    sees it and re-publish it as a deferred copy of A.

    Proves: the re-publish pushes nothing and leaves the key's record (B's) as it was: no new `queued`
    record for A, whose finish would end it; the key stays free, so the next call is a new run, which
    runs once the key is resumed; A's body runs once, the copy never.
    """
    app = make_app(dedup_limit_groups={"tenants": {"concurrency": 2}})
    ran, hold = "test:limits:copy:ran", "test:limits:copy:hold"

    @app.task(
        name="tests.limits.freeing",
        base=DedupTask,
        bind=True,
        shared=False,
        dedup_key="{tenant}:{n}",
        dedup_mode="until_executing",
        limit_group="tenants",
        limit_key="{tenant}",
    )
    def freeing(self: DedupTask, n: int, tenant: str) -> str:
        r.rpush(ran, str(self.request.id))
        while r.sismember(hold, str(self.request.id)):
            time.sleep(0.02)
        return str(self.request.id)

    member = member_for(freeing.name, "t:1")
    record = SCHEMA.record(member)
    waiting = SCHEMA.limit_waiting(limit_group_member("tenants", "t"))

    def state() -> tuple[str, str]:
        return tuple(v.decode() if v else "" for v in r.hmget(record, "task_id", "state"))  # type: ignore[return-value]

    first = freeing.delay(1, "t")
    copy = next(raw for raw in r.lrange("celery", 0, -1) if loads(raw)["headers"]["id"] == first.id)
    r.sadd(hold, first.id)
    with in_process_worker(app, pool="threads", concurrency=3):
        wait_for(lambda: state() == (first.id, "started"), 15, "A's body to start")
        second = freeing.delay(1, "t")
        assert not second.deduplicated, "the key was freed as A started"
        wait_for(lambda: state() == (second.id, "skipped"), 15, lambda: f"B to end (refused by A's lock): {state()}")
        celery_dedup.limits.pause(app, "tenants", "t", by="test")
        r.rpush("celery", copy)
        wait_for(lambda: r.zscore(waiting, first.id) is not None, 15, "the copy to be refused by the pause")
        time.sleep(0.5)  # its re-publish follows the refusal at once
        assert state() == (second.id, "skipped"), "the copy's re-publish made a record for the running A"
        assert not r.sismember(SCHEMA.held, member), "the copy's re-publish held the key"
        third = freeing.delay(1, "t")
        assert not third.deduplicated and third.id not in (first.id, second.id), "answered as a duplicate of A"
        r.srem(hold, first.id)
        assert first.get(timeout=15) == first.id
        assert state() == (third.id, "queued"), "A's finish ended the record of another run"
        assert celery_dedup.limits.resume(app, "tenants", "t")
        assert third.get(timeout=20) == third.id
    assert [entry.decode() for entry in r.lrange(ran, 0, -1)] == [first.id, third.id]
    assert state() == (third.id, "succeeded")
