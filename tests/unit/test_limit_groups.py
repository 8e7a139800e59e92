"""Named limit groups and windows as settings and task options: validated once, refused with a typed error.

No server: install() and task binding only read configuration. The group's
keys (``keys.limit_group_namespace``/``limit_group_member``) are checked here
too, as pure functions.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from hypothesis import given
from hypothesis import strategies as st

import celery_dedup
from celery_dedup import DedupConfigError, DedupTask
from celery_dedup.keys import (
    KeySpec,
    limit_group_member,
    limit_group_namespace,
    limit_group_of,
    split_member,
    task_namespace,
)
from celery_dedup.policy import LIMIT_OPTIONS, LimitGroup, Rate, parse_rates, rates_from_text, rates_text
from celery_dedup.runtime import config_for

REDIS = "redis://127.0.0.1:6379/15"  # never contacted
DAY = 86_400_000
GROUPS = {"partner-api": {"concurrency": 4, "rate": ["10/s", "10000/d"]}, "mail": {"rate": "100/m"}}

BareApp = Callable[..., Celery]


@pytest.fixture
def bare_app() -> Iterator[BareApp]:
    apps: list[Celery] = []

    def factory(**conf: Any) -> Celery:
        app = Celery("groups", set_as_current=False, broker=REDIS)
        app.conf.update(conf)
        apps.append(app)
        return app

    yield factory
    for app in apps:
        app.close()


# --- rates and windows ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "rates"),
    [
        ("10000/d", (Rate(10_000, DAY),)),
        (["10/s", "10000/d"], (Rate(10, 1000), Rate(10_000, DAY))),
        (("2/s", "3/m"), (Rate(2, 1000), Rate(3, 60_000))),
        ("30/m", (Rate(30, 60_000),)),
    ],
)
def test_one_rate_or_a_list_of_windows(value: Any, rates: tuple[Rate, ...]) -> None:
    assert parse_rates(value) == rates
    assert rates_from_text(rates_text(rates)) == rates
    assert str(Rate(10_000, DAY)) == "10000/d"


@pytest.mark.parametrize("bad", ["0/s", "10/w", "-1/d", [], ["5/s", "0/m"], ["5/s", 5], ["1/s"] * 9, {"5/s"}, None])
def test_bad_windows_are_refused_naming_the_task_and_the_value(bad: Any) -> None:
    with pytest.raises(DedupConfigError) as info:
        parse_rates(bad, task="shop.t")
    assert (info.value.setting, info.value.value, info.value.task) == ("limit_rate", bad, "shop.t")


# --- the setting ----------------------------------------------------------------------------


def test_groups_are_read_and_validated_at_install(bare_app: BareApp) -> None:
    app = bare_app(dedup_limit_groups=GROUPS)
    celery_dedup.install(app)
    assert config_for(app).limit_groups == {
        "partner-api": LimitGroup("partner-api", 4, (Rate(10, 1000), Rate(10_000, DAY))),
        "mail": LimitGroup("mail", None, (Rate(100, 60_000),)),
    }
    plain = bare_app()
    celery_dedup.install(plain)
    assert config_for(plain).limit_groups == {}


@pytest.mark.parametrize(
    ("groups", "value"),
    [
        pytest.param({"g": {"rate": "0/s"}}, "0/s", id="rate-zero"),
        pytest.param({"g": {"rate": "10/w"}}, "10/w", id="rate-unit"),
        pytest.param({"g": {"rate": []}}, [], id="rate-empty-list"),
        pytest.param({"g": {"rate": ["5/s", "1/w"]}}, ["5/s", "1/w"], id="rate-bad-window"),
        pytest.param({"g": {"concurrency": 0}}, 0, id="concurrency-zero"),
        pytest.param({"g": {"concurrency": -3}}, -3, id="concurrency-negative"),
        pytest.param({"g": {"concurrency": True}}, True, id="concurrency-bool"),
        pytest.param({"g": {"concurrency": "4"}}, "4", id="concurrency-text"),
        pytest.param({"g": ["4/s"]}, ["4/s"], id="group-not-a-dict"),
        pytest.param({"g": {}}, {}, id="group-no-limit"),
        pytest.param({"g": {"rate": "5/s", "burst": 2}}, {"rate": "5/s", "burst": 2}, id="group-unknown-field"),
    ],
)
def test_a_bad_group_is_refused_at_install_naming_the_group_and_the_value(
    bare_app: BareApp, groups: dict[str, Any], value: Any
) -> None:
    app = bare_app(dedup_limit_groups=groups)
    with pytest.raises(DedupConfigError) as info:
        celery_dedup.install(app)
    assert info.value.setting == "dedup_limit_groups"
    assert info.value.value == value
    assert "'g'" in str(info.value) and repr(value) in str(info.value)


@pytest.mark.parametrize("bad", [["g"], "g", {"": {"rate": "1/s"}}, {1: {"rate": "1/s"}}])
def test_a_bad_groups_setting_is_refused(bare_app: BareApp, bad: Any) -> None:
    with pytest.raises(DedupConfigError) as info:
        celery_dedup.install(bare_app(dedup_limit_groups=bad))
    assert info.value.setting == "dedup_limit_groups"


# --- binding --------------------------------------------------------------------------------


def _bind(app: Celery, **options: Any) -> DedupTask:
    @app.task(base=DedupTask, shared=False, name="shop.sync", dedup_key="order:{order_id}", **options)
    def sync(order_id: int, tenant: str) -> int:
        return order_id

    _ = sync.dedup_policy
    return sync


def _installed(bare_app: BareApp) -> Celery:
    app = bare_app(dedup_limit_groups=GROUPS)
    celery_dedup.install(app)
    app.finalize()
    return app


def test_limit_group_is_a_limit_option() -> None:
    assert "limit_group" in LIMIT_OPTIONS
    assert "limit_group" in DedupTask.__annotations__


def test_a_task_naming_a_group_draws_on_the_groups_values(bare_app: BareApp) -> None:
    app = _installed(bare_app)
    keyed = _bind(app, limit_group="partner-api", limit_key="{tenant}")
    limit = keyed.dedup_policy.limit
    assert limit is not None
    assert (limit.group, limit.concurrency, limit.rates) == ("partner-api", 4, (Rate(10, 1000), Rate(10_000, DAY)))
    assert limit.spec is not None and limit.spec.business_key((1,), {"tenant": "acme"}) == "acme"
    app.tasks.pop("shop.sync")
    whole = _bind(app, limit_group="mail")
    assert whole.dedup_policy.limit is not None and whole.dedup_policy.limit.spec is None, "one quota: the group"
    app.tasks.pop("shop.sync")
    agreeing = _bind(app, limit_group="partner-api", limit_concurrency=4, limit_rate=["10000/d", "10/s"])
    assert agreeing.dedup_policy.limit == limit.__class__(None, 4, (Rate(10, 1000), Rate(10_000, DAY)), "partner-api")


@pytest.mark.parametrize(
    ("options", "setting", "value"),
    [
        pytest.param({"limit_group": "partner"}, "limit_group", "partner", id="unknown-group"),
        pytest.param({"limit_group": 4}, "limit_group", 4, id="group-not-a-name"),
        pytest.param(
            {"limit_group": "partner-api", "limit_concurrency": 5}, "limit_concurrency", 5, id="concurrency-disagrees"
        ),
        pytest.param({"limit_group": "mail", "limit_concurrency": 2}, "limit_concurrency", 2, id="concurrency-added"),
        pytest.param({"limit_group": "partner-api", "limit_rate": "10/s"}, "limit_rate", "10/s", id="rate-disagrees"),
        pytest.param({"limit_group": "mail", "limit_rate": "0/s"}, "limit_rate", "0/s", id="rate-bad"),
        pytest.param({"limit_rate": "10/w"}, "limit_rate", "10/w", id="inline-rate-unit"),
        pytest.param({"limit_rate": []}, "limit_rate", [], id="inline-empty-list"),
        pytest.param({"limit_concurrency": -1}, "limit_concurrency", -1, id="inline-negative"),
    ],
)
def test_binding_refuses_an_unknown_group_and_an_inline_limit_that_disagrees(
    bare_app: BareApp, options: dict[str, Any], setting: str, value: Any
) -> None:
    app = _installed(bare_app)
    with pytest.raises(DedupConfigError) as info:
        _bind(app, **options)
    assert (info.value.task, info.value.setting, info.value.value) == ("shop.sync", setting, value)
    message = str(info.value)
    assert "shop.sync" in message and repr(value) in message
    group = options.get("limit_group")
    if isinstance(group, str):
        assert repr(group) in message, message


# --- the group's keys -----------------------------------------------------------------------


@given(st.text(min_size=1, max_size=20), st.text(min_size=1, max_size=20))
def test_a_groups_namespace_is_never_a_tasks(group: str, task: str) -> None:
    namespace = limit_group_namespace(group)
    assert namespace != task_namespace(task)
    assert ":" not in namespace
    assert limit_group_of(namespace) == group
    assert limit_group_of(task_namespace(task)) is None


def test_the_whole_group_key_is_no_rendered_key() -> None:
    whole = limit_group_member("g", None)
    assert split_member(whole) == (limit_group_namespace("g"), "*")

    def keyless() -> None: ...

    def tenant(tenant: Any) -> None: ...

    rendered = {
        KeySpec("t", None, inspect.signature(keyless), 200).business_key((), {}),  # no parts: "*"
        KeySpec("t", "{tenant}", inspect.signature(tenant), 200).business_key(("*",), {}),
        KeySpec("t", lambda tenant: "*", inspect.signature(tenant), 200).business_key(("x",), {}),
        KeySpec("t", "{tenant}", inspect.signature(tenant), 200).business_key(("{*}",), {}),
    }
    assert "*" in rendered
    members = {limit_group_member("g", key) for key in rendered}
    assert whole not in members
    assert len(members) == len(rendered), "distinct rendered keys stay distinct quotas"
