"""Settings and task options: defaults, validation at start-up, and how install() gates the broker.

No test here needs a server: install() and task binding only read
configuration, and nothing here opens a connection.
"""

from __future__ import annotations

import inspect
import itertools
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

import celery_dedup
from celery_dedup import DedupConfigError, DedupTask, runtime
from celery_dedup.config import SETTINGS, DedupConfig
from celery_dedup.modes import MODES
from celery_dedup.runtime import config_for, runtime_for
from celery_dedup.task import TASK_OPTIONS
from celery_dedup.transports.redis import SentinelTransport, Transport

# Never contacted: these tests only read configuration.
REDIS = "redis://127.0.0.1:6379/15"
GATED = f"{Transport.__module__}:{Transport.__qualname__}"

BareApp = Callable[..., Celery]


@pytest.fixture
def bare_app() -> Iterator[BareApp]:
    """Build an un-installed Celery app that never connects; ``conf`` overrides settings."""
    apps: list[Celery] = []

    def factory(broker: str | None = REDIS, **conf: Any) -> Celery:
        app = Celery("cfg", set_as_current=False, broker=broker)
        app.conf.update(conf)
        apps.append(app)
        return app

    yield factory
    for app in apps:
        app.close()


# --- app settings -----------------------------------------------------------------------------------


def test_defaults(bare_app: BareApp) -> None:
    """An app with no dedup_* settings gets the documented defaults, and every setting is covered."""
    app = bare_app()
    celery_dedup.install(app)
    config = config_for(app)
    assert config == DedupConfig(
        redis_url=None,
        redis_options={},
        key_prefix="dedup",
        default_ttl=3600,
        default_mode="until_executed",
        on_duplicate="return_existing",
        on_mismatch="warn",
        on_redis_error="fail_closed",
        max_key_length=200,
        record_ttl=86400,
        lock_ttl=60,
        on_locked="skip",
        record_args=True,
        history_length=10,
        max_followers=1000,
        reap_interval=60,
        reap_grace=30,
        dispatch_interval=0.1,
        publish_lease=30,
        cluster_wait_replicas=1,
        step_result_limit=65536,
        limit_groups={},
    )
    assert {f"dedup_{field}" for field in vars(config)} == set(SETTINGS)


def test_good_values_are_kept(bare_app: BareApp) -> None:
    """Valid non-default values pass validation unchanged (the checks are not over-strict)."""
    app = bare_app(
        dedup_redis_url="unix:///tmp/dedup.sock",
        dedup_key_prefix="svc:dedup",
        dedup_default_ttl=0.5,
        dedup_default_mode="until_expired",
        dedup_on_duplicate="raise",
        dedup_on_redis_error="fail_open",
        dedup_max_key_length=64,
        dedup_record_ttl=60,
    )
    celery_dedup.install(app)
    config = config_for(app)
    assert (config.redis_url, config.key_prefix, config.default_ttl) == ("unix:///tmp/dedup.sock", "svc:dedup", 0.5)
    assert (config.default_mode, config.on_duplicate, config.on_redis_error) == ("until_expired", "raise", "fail_open")
    assert (config.max_key_length, config.record_ttl) == (64, 60)


BAD_SETTINGS = [
    ("dedup_redis_url", 6379),
    ("dedup_redis_url", b"redis://127.0.0.1"),
    ("dedup_redis_url", "127.0.0.1:6379"),
    ("dedup_redis_url", ""),
    ("dedup_key_prefix", "my prefix"),
    ("dedup_key_prefix", "dedup\n"),
    ("dedup_key_prefix", ""),
    ("dedup_key_prefix", 7),
    ("dedup_key_prefix", None),
    # On a Redis Cluster the prefix sits inside each key's hash tag: a brace would end it.
    ("dedup_key_prefix", "}dedup"),
    ("dedup_key_prefix", "de{dup"),
    ("dedup_key_prefix", "{tenant}"),
    ("dedup_key_prefix", "dedup\x00"),
    ("dedup_key_prefix", "dedup\x1b[0m"),
    ("dedup_key_prefix", "dedup\x7f"),
    ("dedup_default_ttl", -1),
    ("dedup_default_ttl", 0),
    ("dedup_default_ttl", True),
    ("dedup_default_ttl", "60"),
    ("dedup_default_ttl", None),
    ("dedup_default_ttl", float("nan")),
    ("dedup_default_ttl", float("inf")),
    ("dedup_record_ttl", -5),
    ("dedup_record_ttl", False),
    ("dedup_record_ttl", "1d"),
    ("dedup_record_ttl", float("inf")),
    ("dedup_default_mode", "forever"),
    ("dedup_default_mode", "UNTIL_EXECUTED"),
    ("dedup_default_mode", 1),
    ("dedup_default_mode", ["until_executed"]),
    ("dedup_on_duplicate", "ignore"),
    ("dedup_on_duplicate", None),
    ("dedup_on_duplicate", ["raise"]),
    ("dedup_on_mismatch", "error"),
    ("dedup_on_mismatch", None),
    ("dedup_on_redis_error", "retry"),
    ("dedup_on_redis_error", True),
    ("dedup_on_redis_error", {"fail_open"}),
    ("dedup_max_key_length", 63),
    ("dedup_max_key_length", 0),
    ("dedup_max_key_length", -1),
    ("dedup_max_key_length", True),
    ("dedup_max_key_length", 200.0),
    ("dedup_max_key_length", "200"),
    ("dedup_max_key_length", None),
    # Redis keeps times in whole milliseconds: less than 1 ms would reach it as 0 ms.
    ("dedup_default_ttl", 0.0004),
    ("dedup_record_ttl", 0.0009),
    ("dedup_reap_grace", 0.0001),
    ("dedup_dispatch_interval", 1e-6),
    ("dedup_reap_interval", 1e-5),
    ("dedup_reap_interval", -1),
    ("dedup_reap_interval", float("nan")),
    ("dedup_lock_ttl", 0.0004),
    ("dedup_lock_ttl", 0.5),  # renewed every third of it: below a second one slow reply loses it
    ("dedup_lock_ttl", 0),
    # Past 1e9 s, deadlines in ms would outgrow what Lua's doubles keep exact.
    ("dedup_default_ttl", 1e12),
    ("dedup_record_ttl", 10**10),
    ("dedup_redis_options", "ssl_cert_reqs=required"),
    ("dedup_redis_options", {1: "one"}),
    ("dedup_redis_options", [("socket_timeout", 1)]),
    # Bytes a step's value may take: at least one, at most what a Redis value holds.
    ("dedup_step_result_limit", 0),
    ("dedup_step_result_limit", 512 * 1024 * 1024),
    ("dedup_step_result_limit", 1024.0),
    ("dedup_step_result_limit", True),
]


@pytest.mark.parametrize(("setting", "value"), BAD_SETTINGS, ids=[f"{s}={v!r}" for s, v in BAD_SETTINGS])
def test_bad_setting_is_refused_at_install(bare_app: BareApp, setting: str, value: Any) -> None:
    """install() refuses a bad value with DedupConfigError naming the setting and the value, and changes nothing."""
    app = bare_app(**{setting: value})
    with pytest.raises(DedupConfigError) as info:
        celery_dedup.install(app)
    assert info.value.setting == setting
    assert info.value.value is value
    assert setting in str(info.value)
    assert repr(value) in str(info.value)
    assert app.conf.broker_transport is None, "a refused install must not half-configure the app"


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("dedup_defualt_ttl", "dedup_default_ttl"),
        ("dedup_max_key_len", "dedup_max_key_length"),
        ("dedup_on_duplicates", "dedup_on_duplicate"),
        ("dedup_redis", "dedup_redis_url"),
    ],
)
def test_unknown_setting_suggests_the_right_name(bare_app: BareApp, typo: str, meant: str) -> None:
    """A misspelt dedup_* setting is an error (not silently ignored) that suggests the real name."""
    app = bare_app(**{typo: 30})
    with pytest.raises(DedupConfigError) as info:
        celery_dedup.install(app)
    assert info.value.setting == typo
    assert typo in str(info.value)
    assert meant in str(info.value)


#: Every setting that is a time: each reaches Redis in milliseconds (or paces a loop).
TIME_SETTINGS = [
    "dedup_default_ttl",
    "dedup_record_ttl",
    "dedup_lock_ttl",
    "dedup_reap_interval",
    "dedup_reap_grace",
    "dedup_dispatch_interval",
    "dedup_publish_lease",
]


def test_every_time_setting_refuses_less_than_a_millisecond(bare_app: BareApp) -> None:
    """0.0004 s would reach Redis as 0 ms ("invalid expire time" on every call): refused at install instead."""
    numeric = [
        n for n, (default, _) in SETTINGS.items() if isinstance(default, (int, float)) and not isinstance(default, bool)
    ]
    counts = {
        "dedup_max_key_length",
        "dedup_history_length",
        "dedup_max_followers",
        "dedup_cluster_wait_replicas",
        "dedup_step_result_limit",
    }
    assert sorted(TIME_SETTINGS) == sorted(set(numeric) - counts)
    for setting in TIME_SETTINGS:
        with pytest.raises(DedupConfigError) as info:
            celery_dedup.install(bare_app(**{setting: 0.0004}))
        assert info.value.setting == setting
        assert "seconds" in info.value.reason


def test_smallest_times_are_accepted_and_are_at_least_a_millisecond(bare_app: BareApp) -> None:
    """The limits themselves pass: 1 ms for every time, 1 s for the lock TTL, 0 to turn the reaper off."""
    app = bare_app(
        dedup_default_ttl=0.001,
        dedup_record_ttl=0.001,
        dedup_lock_ttl=1,
        dedup_reap_interval=0,
        dedup_reap_grace=0.001,
        dedup_dispatch_interval=0.001,
        dedup_redis_options=None,
    )
    celery_dedup.install(app)
    config = config_for(app)
    assert config.reap_interval == 0
    assert config.redis_options == {}
    for seconds in (
        config.default_ttl,
        config.record_ttl,
        config.lock_ttl,
        config.reap_grace,
        config.dispatch_interval,
    ):
        assert int(seconds * 1000) >= 1
    app.finalize()
    task = _define(app, "plain", "shop.brief", dedup_key="order:{order_id}", dedup_ttl=0.001, dedup_lock_ttl=1)
    throttled = _define(
        app, "plain", "shop.throttled", dedup_key="order:{order_id}", dedup_mode="throttle", dedup_window=0.001
    )
    assert (task.dedup_policy.ttl, task.dedup_policy.lock_ttl) == (0.001, 1)
    assert throttled.dedup_policy.window == 0.001


# --- dedup_redis_options ----------------------------------------------------------------------------


def test_redis_options_are_kept_for_a_separate_store(bare_app: BareApp) -> None:
    """A store apart from the broker takes redis-py options; the config keeps its own copy."""
    options = {"socket_timeout": 2.5, "ssl_cert_reqs": "required", "health_check_interval": 10}
    app = bare_app(dedup_redis_url="rediss://127.0.0.1:6390/0", dedup_redis_options=options)
    celery_dedup.install(app)
    config = config_for(app)
    assert config.redis_options == options
    options["socket_timeout"] = 99
    assert config.redis_options["socket_timeout"] == 2.5


@pytest.mark.parametrize("store", [None, REDIS], ids=["unset", "the-broker-url"])
def test_redis_options_for_the_brokers_store_are_refused(bare_app: BareApp, store: str | None) -> None:
    """On the broker the store connects as the broker does: options of its own would be silently ignored."""
    app = bare_app(dedup_redis_url=store, dedup_redis_options={"socket_timeout": 1})
    with pytest.raises(DedupConfigError) as info:
        celery_dedup.install(app)
    assert info.value.setting == "dedup_redis_options"
    assert "broker_use_ssl" in info.value.reason and "broker_transport_options" in info.value.reason


@pytest.mark.parametrize(
    ("url", "options", "expected"),
    [
        ("redis://127.0.0.1:6390/0", {"socket_timout": 1}, "socket_timout"),
        ("rediss://127.0.0.1:6390/0", {"ssl_cert_reqs": "sometimes"}, "ssl"),
        ("sentinel://127.0.0.1:26379", {"socket_timeout": 1}, "master_name"),
    ],
    ids=["misspelt", "bad-tls-value", "sentinel-without-master"],
)
def test_redis_options_redis_py_refuses_fail_at_install(
    bare_app: BareApp, url: str, options: dict[str, Any], expected: str
) -> None:
    """An option redis-py would refuse at the first publish is refused at install, without connecting."""
    app = bare_app(dedup_redis_url=url, dedup_redis_options=options)
    with pytest.raises(DedupConfigError) as info:
        celery_dedup.install(app)
    assert info.value.setting == "dedup_redis_options"
    assert expected in str(info.value)


def test_sentinel_store_takes_master_name_from_its_options(bare_app: BareApp) -> None:
    app = bare_app(
        dedup_redis_url="sentinel://:pw@127.0.0.1:26379/2;sentinel://127.0.0.1:26380",
        dedup_redis_options={"master_name": "store", "socket_timeout": 3, "sentinel_kwargs": {"socket_timeout": 1}},
    )
    celery_dedup.install(app)
    pool = runtime_for(app).store.client.connection_pool
    assert pool.service_name == "store"  # type: ignore[attr-defined]
    assert pool.connection_kwargs["socket_timeout"] == 3
    assert (pool.connection_kwargs["db"], pool.connection_kwargs["password"]) == (2, "pw")


@pytest.mark.parametrize(
    ("url", "options"),
    [
        ("sentinel://:s3cret@127.0.0.1:26379/2", None),
        ("sentinel://127.0.0.1:26379;sentinel://127.0.0.1:26380", {"password": "s3cret"}),
    ],
    ids=["no-options", "options-without-master-name"],
)
def test_a_sentinel_store_without_master_name_is_refused_at_install(
    bare_app: BareApp, url: str, options: dict[str, Any] | None
) -> None:
    """Not at the first publish: the Sentinels cannot be asked for a master they were not told the name of."""
    app = bare_app(dedup_redis_url=url, dedup_redis_options=options)
    with pytest.raises(DedupConfigError) as info:
        celery_dedup.install(app)
    assert info.value.setting == "dedup_redis_options"
    assert "master_name" in info.value.reason
    assert "s3cret" not in str(info.value)


def test_a_store_url_redis_py_cannot_read_is_refused_at_install(bare_app: BareApp) -> None:
    """A port that is no number passes the scheme check; redis-py refuses it, at install, the password masked."""
    app = bare_app(dedup_redis_url="redis://shop:s3cret@127.0.0.1:63x9/0")
    with pytest.raises(DedupConfigError) as info:
        celery_dedup.install(app)
    assert info.value.setting == "dedup_redis_url"
    assert "s3cret" not in str(info.value)


class DjangoSettings:
    """What ``django.conf:settings`` looks like to Celery with ``namespace="CELERY"``."""

    CELERY_BROKER_URL = REDIS
    CELERY_DEDUP_DEFAULT_TTL = 30
    CELERY_DEDUP_ON_DUPLICATE = "raise"
    CELERY_DEDUP_KEY_PREFIX = "shop"
    INSTALLED_APPS = ("shop",)  # non-Celery settings must not disturb anything


def test_django_style_namespaced_settings_are_read(bare_app: BareApp) -> None:
    """CELERY_DEDUP_X settings loaded with namespace="CELERY" configure celery-dedup and its tasks."""
    app = bare_app(broker=None)
    app.config_from_object(DjangoSettings, namespace="CELERY")
    assert app.conf.broker_url == REDIS
    celery_dedup.install(app)
    config = config_for(app)
    assert config.default_ttl == 30
    assert config.on_duplicate == "raise"
    assert config.key_prefix == "shop"
    with app.connection_for_write() as conn:
        assert type(conn.transport) is Transport

    @app.task(base=DedupTask, dedup_key="order:{order_id}", shared=False, name="django.charge")
    def charge(order_id: int) -> None: ...

    app.finalize()
    assert charge.dedup_policy.ttl == 30
    assert charge.dedup_policy.on_duplicate == "raise"


def test_django_style_typo_and_bad_value_are_refused(bare_app: BareApp) -> None:
    """Namespaced settings are validated like plain ones: typos get a suggestion, bad values an error."""

    class Typo:
        CELERY_BROKER_URL = REDIS
        CELERY_DEDUP_DEFUALT_TTL = 30

    class Negative:
        CELERY_BROKER_URL = REDIS
        CELERY_DEDUP_DEFAULT_TTL = -30

    typo = bare_app(broker=None)
    typo.config_from_object(Typo, namespace="CELERY")
    with pytest.raises(DedupConfigError) as info:
        celery_dedup.install(typo)
    assert "CELERY_DEDUP_DEFUALT_TTL" in str(info.value)
    assert "default_ttl" in str(info.value).lower()

    negative = bare_app(broker=None)
    negative.config_from_object(Negative, namespace="CELERY")
    with pytest.raises(DedupConfigError) as info:
        celery_dedup.install(negative)
    assert "default_ttl" in info.value.setting.lower()
    assert info.value.value == -30


# --- task options -----------------------------------------------------------------------------------

BAD_OPTIONS = [
    pytest.param({"dedup_mode": "forever"}, "dedup_mode", id="mode-unknown"),
    pytest.param({"dedup_ttl": -1}, "dedup_ttl", id="ttl-negative"),
    pytest.param({"dedup_ttl": 0}, "dedup_ttl", id="ttl-zero"),
    pytest.param({"dedup_ttl": "10"}, "dedup_ttl", id="ttl-str"),
    pytest.param({"dedup_ttl": True}, "dedup_ttl", id="ttl-bool"),
    pytest.param({"dedup_on_duplicate": "ignore"}, "dedup_on_duplicate", id="on-duplicate-unknown"),
    pytest.param({"dedup_on_mismatch": "drop"}, "dedup_on_mismatch", id="on-mismatch-unknown"),
    pytest.param({"dedup_on_mismatch": True}, "dedup_on_mismatch", id="on-mismatch-bool"),
    pytest.param({"dedup_key": "order:{id}"}, "dedup_key", id="key-unknown-argument"),
    pytest.param({"dedup_key": "order:{self}"}, "dedup_key", id="key-names-self"),
    pytest.param({"dedup_key": "order:{order_id!r}"}, "dedup_key", id="key-conversion"),
    pytest.param({"dedup_key": []}, "dedup_key", id="key-empty-list"),
    pytest.param({"dedup_ttl": 0.0004}, "dedup_ttl", id="ttl-below-1ms"),
    pytest.param({"dedup_ttl": 1e12}, "dedup_ttl", id="ttl-huge"),
    pytest.param({"dedup_lock_ttl": 0.0004}, "dedup_lock_ttl", id="lock-ttl-below-1ms"),
    pytest.param({"dedup_lock_ttl": 0.5}, "dedup_lock_ttl", id="lock-ttl-below-1s"),
    pytest.param({"dedup_mode": "throttle", "dedup_window": 0.0004}, "dedup_window", id="throttle-window-below-1ms"),
    pytest.param({"dedup_mode": "debounce", "dedup_window": 0.0004}, "dedup_window", id="debounce-window-below-1ms"),
]


def _run(self: Any, order_id: int, amount: int = 0) -> int:
    return order_id


def _define(app: Celery, style: str, name: str, **options: Any) -> Any:
    """Declare the same task in one of the four ways users write DedupTasks."""
    if style == "class":
        cls = type("Charge", (DedupTask,), {"name": name, "run": _run, **options})
        return app.register_task(cls())
    if style == "bind":

        @app.task(base=DedupTask, bind=True, shared=False, name=name, **options)
        def bound(self: Any, order_id: int, amount: int = 0) -> int:
            return order_id

        return bound

    @app.task(base=DedupTask, shared=False, name=name, **options)
    def plain(order_id: int, amount: int = 0) -> int:
        return order_id

    return plain


@pytest.mark.parametrize(("options", "setting"), BAD_OPTIONS)
@pytest.mark.parametrize("style", ["plain", "bind", "class"])
def test_bad_task_option_fails_when_defined_on_a_finalized_app(
    bare_app: BareApp, style: str, options: dict[str, Any], setting: str
) -> None:
    """On a finalized app a bad option fails at the decorator / register_task, naming task and option."""
    app = bare_app()
    celery_dedup.install(app)
    app.finalize()
    with pytest.raises(DedupConfigError) as info:
        _define(app, style, "shop.bad", **{"dedup_key": "order:{order_id}", **options})
    assert info.value.task == "shop.bad"
    assert info.value.setting == setting
    assert "shop.bad" in str(info.value) and setting in str(info.value)


@pytest.mark.parametrize(("options", "setting"), BAD_OPTIONS)
@pytest.mark.parametrize("style", ["plain", "bind"])
def test_bad_task_option_fails_at_app_finalization(
    bare_app: BareApp, style: str, options: dict[str, Any], setting: str
) -> None:
    """Before finalization decorators are lazy; the bad option surfaces when the app finalizes (start-up)."""
    app = bare_app()
    celery_dedup.install(app)
    # Reaching the next line shows the decorator itself did not check anything yet.
    _define(app, style, "shop.bad", **{"dedup_key": "order:{order_id}", **options})
    with pytest.raises(DedupConfigError) as info:
        app.finalize()
    assert info.value.task == "shop.bad"
    assert info.value.setting == setting


@pytest.mark.parametrize(
    ("option", "value"),
    [("dedup_mode", ["until_executed"]), ("dedup_on_duplicate", {"raise": True}), ("dedup_ttl", float("inf"))],
    ids=["mode-list", "on-duplicate-dict", "ttl-inf"],
)
def test_unusable_task_option_values_are_config_errors(bare_app: BareApp, option: str, value: Any) -> None:
    """Unhashable choices and an infinite TTL are refused at definition, not met later as TypeError/OverflowError."""
    app = bare_app()
    celery_dedup.install(app)
    app.finalize()
    with pytest.raises(DedupConfigError) as info:
        _define(app, "plain", "shop.bad", dedup_key="order:{order_id}", **{option: value})
    assert info.value.task == "shop.bad"
    assert info.value.setting == option


def test_good_task_options_resolve_against_app_settings(bare_app: BareApp) -> None:
    """Task options override app settings; omitted ones fall back to them."""
    app = bare_app(dedup_default_mode="until_executing", dedup_default_ttl=12, dedup_on_duplicate="drop")
    celery_dedup.install(app)
    app.finalize()
    inherits = _define(app, "plain", "shop.inherits", dedup_key="order:{order_id}")
    overrides = _define(
        app,
        "class",
        "shop.overrides",
        dedup_key="order:{order_id}",
        dedup_mode="until_expired",
        dedup_ttl=0.25,
        dedup_on_duplicate="raise",
    )
    got = inherits.dedup_policy
    assert (got.mode, got.ttl, got.on_duplicate) == (MODES["until_executing"], 12, "drop")
    got = overrides.dedup_policy
    assert (got.mode, got.ttl, got.on_duplicate) == (MODES["until_expired"], 0.25, "raise")


def test_class_bind_and_plain_tasks_derive_the_same_keys(bare_app: BareApp) -> None:
    """A class-based task, a bind=True task and a plain decorator task key the same calls identically."""
    app = bare_app()
    celery_dedup.install(app)

    class Charge(DedupTask):
        name = "shop.charge_cls"
        dedup_key = "order:{order_id}"

        def run(self, order_id: int, amount: int = 0) -> int:
            return order_id

    tasks = [
        app.register_task(Charge()),
        _define(app, "bind", "shop.charge_bind", dedup_key="order:{order_id}"),
        _define(app, "plain", "shop.charge_plain", dedup_key="order:{order_id}"),
    ]
    app.finalize()
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((42,), {}),
        ((), {"order_id": 42}),
        ((42, 7), {}),
        ((), {"amount": 7, "order_id": 42}),
        ((43,), {}),
    ]
    keyed = [[task.dedup_business_key(*args, **kwargs) for args, kwargs in calls] for task in tasks]
    assert keyed[0] == keyed[1] == keyed[2]
    assert len(set(keyed[0][:4])) == 1
    assert keyed[0][4] != keyed[0][0]
    for task in tasks:
        assert list(inspect.signature(task.run).parameters)[-2:] == ["order_id", "amount"]
        with pytest.raises(celery_dedup.DedupKeyError):
            task.dedup_business_key(42, 7, "extra")


def test_class_based_task_with_callable_key(bare_app: BareApp) -> None:
    """A class-based task may declare its key as a method-like callable in the class body."""
    app = bare_app()
    celery_dedup.install(app)

    class Refund(DedupTask):
        name = "shop.refund"

        @staticmethod
        def dedup_key(order_id: int, amount: int = 0) -> str:
            return f"refund:{order_id}"

        def run(self, order_id: int, amount: int = 0) -> int:
            return order_id

    task = app.register_task(Refund())
    assert task.dedup_business_key(5) == task.dedup_business_key(order_id=5, amount=9)
    assert "refund:5" in task.dedup_business_key(5)


# --- install() --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("broker", "expected"),
    [
        ("redis://127.0.0.1:6379/0", Transport),
        ("redis://:secret@127.0.0.1:6379/3", Transport),
        ("rediss://127.0.0.1:6380/0", Transport),
        ("sentinel://127.0.0.1:26379;sentinel://127.0.0.1:26380", SentinelTransport),
    ],
)
def test_install_selects_the_gated_transport(bare_app: BareApp, broker: str, expected: type[Any]) -> None:
    """After install() kombu resolves the broker's scheme to the gated class, also after a failover switch."""
    app = bare_app(broker=broker)
    celery_dedup.install(app)
    with app.connection_for_write() as conn:
        assert type(conn.transport) is expected
        conn.switch(broker.rsplit(";", maxsplit=1)[-1])  # what kombu does on a connection error with alternates
        assert conn.transport_cls in ("redis", "rediss", "sentinel")
        assert type(conn.transport) is expected, "a failover switch must not drop the gate"
    assert runtime_for(app).atomic, "broker and dedup store are one server: the gate is atomic"
    assert app.conf.broker_url == broker, "the broker URL itself is left alone"


def test_install_keeps_tls_of_a_rediss_broker(bare_app: BareApp) -> None:
    """Swapping the transport class must not turn a rediss:// broker connection into plain TCP."""
    untouched = bare_app(broker="rediss://127.0.0.1:6380/0")
    with untouched.connection_for_write() as conn:
        tls_without_dedup = conn.ssl
    assert tls_without_dedup, "premise: kombu uses TLS for rediss:// on its own"
    app = bare_app(broker="rediss://127.0.0.1:6380/0")
    celery_dedup.install(app)
    with app.connection_for_write() as conn:
        assert conn.ssl == tls_without_dedup


@pytest.mark.parametrize(
    ("broker", "transport"),
    [("redis://127.0.0.1:6379/0", "redis"), ("sentinel://127.0.0.1:26379", "sentinel"), (REDIS, GATED)],
)
def test_install_accepts_the_plain_alias_or_its_own_class(bare_app: BareApp, broker: str, transport: str) -> None:
    """broker_transport naming the stock alias (or the gated class already) is accepted, and gated."""
    app = bare_app(broker=broker, broker_transport=transport)
    celery_dedup.install(app)
    with app.connection_for_write() as conn:
        assert type(conn.transport) in (Transport, SentinelTransport)


@pytest.mark.parametrize(
    ("broker", "custom"),
    [
        (REDIS, "myproj.transport:Custom"),
        (REDIS, "kombu.transport.redis:Transport"),
        ("sentinel://127.0.0.1:26379", "redis"),
    ],
)
def test_install_refuses_a_conflicting_custom_transport(bare_app: BareApp, broker: str, custom: str) -> None:
    """A custom broker_transport would bypass the gate, so install() refuses it instead of overriding it."""
    app = bare_app(broker=broker, broker_transport=custom)
    with pytest.raises(DedupConfigError) as info:
        celery_dedup.install(app)
    assert info.value.setting == "broker_transport"
    assert info.value.value == custom
    assert custom in str(info.value)
    assert app.conf.broker_transport == custom, "the user's choice is left as it was"


@pytest.mark.parametrize("broker", ["memory://", "amqp://guest@127.0.0.1:5672//"])
def test_install_on_a_non_redis_broker_keeps_its_transport(
    bare_app: BareApp, broker: str, caplog: pytest.LogCaptureFixture
) -> None:
    """On memory:// (or RabbitMQ) the transport is untouched, the two-phase gate is used, and install says so."""
    app = bare_app(broker=broker, dedup_redis_url=REDIS)
    with caplog.at_level(logging.WARNING, logger="celery_dedup"):
        celery_dedup.install(app)
    assert any("two phases" in rec.getMessage() for rec in caplog.records)
    assert app.conf.broker_transport is None
    state = runtime_for(app)
    assert state.installed
    assert not state.atomic
    with app.connection_for_write() as conn:
        assert type(conn.transport) not in (Transport, SentinelTransport)


def test_separate_dedup_store_makes_the_gate_two_phase(bare_app: BareApp, caplog: pytest.LogCaptureFixture) -> None:
    """With dedup_redis_url on another server the transport stays gated (for the broker's own keyed messages),
    but keyed calls of this app take the two-phase gate, and install says so."""
    app = bare_app(broker=REDIS, dedup_redis_url="redis://127.0.0.1:6390/0")
    with caplog.at_level(logging.WARNING, logger="celery_dedup"):
        celery_dedup.install(app)
    assert any("two phases" in rec.getMessage() for rec in caplog.records)
    with app.connection_for_write() as conn:
        assert type(conn.transport) is Transport
    assert not runtime_for(app).atomic


def test_install_on_rabbitmq_turns_publisher_confirms_on_unless_the_app_chose(
    bare_app: BareApp, caplog: pytest.LogCaptureFixture
) -> None:
    """The two-phase gate confirms a run once the publish returns: with confirms, once the broker has it."""
    app = bare_app(
        broker="amqp://guest@127.0.0.1:5672//", dedup_redis_url=REDIS, broker_transport_options={"max_retries": 1}
    )
    celery_dedup.install(app)
    assert app.conf.broker_transport_options == {"max_retries": 1, "confirm_publish": True}

    chosen = bare_app(
        broker="amqp://guest@127.0.0.1:5672//",
        dedup_redis_url=REDIS,
        broker_transport_options={"confirm_publish": False},
    )
    with caplog.at_level(logging.WARNING, logger="celery_dedup"):
        celery_dedup.install(chosen)
    assert chosen.conf.broker_transport_options == {"confirm_publish": False}
    assert any("confirm_publish is off" in rec.getMessage() for rec in caplog.records)


@pytest.mark.parametrize(
    ("store", "broker", "same"),
    [
        ("redis://localhost:6379/0", "redis://127.0.0.1:6379/0", True),
        ("redis://127.0.0.1:6379", "redis://127.0.0.1:6379/0", True),
        ("redis://127.0.0.1/0?socket_timeout=5", "redis://127.0.0.1:6379/0", True),
        ("redis://:secret@127.0.0.1:6379/0", "redis://127.0.0.1:6379/0", True),
        ("redis://127.0.0.1:6379/?db=2", "redis://127.0.0.1:6379/2", True),
        ("unix:///tmp/../tmp/redis.sock", "unix:///tmp/redis.sock", True),
        ("redis://127.0.0.1:6379/1", "redis://127.0.0.1:6379/0", False),
        ("redis://127.0.0.1:6380/0", "redis://127.0.0.1:6379/0", False),
        ("redis://127.0.0.2:6379/0", "redis://127.0.0.1:6379/0", False),
        ("unix:///tmp/redis.sock", "redis://127.0.0.1:6379/0", False),
        ("redis://no-such-host.invalid:6379/0", "redis://127.0.0.1:6379/0", False),
        ("sentinel://127.0.0.1:26379/0", "sentinel://127.0.0.1:26379/0", True),
        ("sentinel://127.0.0.1:26379/0", "sentinel://localhost:26379/0", False),
    ],
)
def test_a_store_url_is_the_brokers_database_however_it_is_spelled(store: str, broker: str, same: bool) -> None:
    """Only the same server and database count; any doubt gives the two-phase gate, which is always safe."""
    assert runtime.same_database(store, broker) is same


@pytest.mark.parametrize("broker", ["memory://", "amqp://guest@127.0.0.1:5672//", "sqs://"])
def test_a_broker_that_is_not_redis_needs_a_store_at_install(bare_app: BareApp, broker: str) -> None:
    """Not at the first call: the keys need a Redis server, and none was named."""
    with pytest.raises(DedupConfigError) as info:
        celery_dedup.install(bare_app(broker=broker))
    assert info.value.setting == "dedup_redis_url"
    assert broker.split("://", maxsplit=1)[0] in info.value.reason


# --- options that apply to other modes --------------------------------------------------------------

#: A valid value of each task option, for a task of a mode that honours it.
OPTION_VALUES: dict[str, Any] = {
    "dedup_key": "order:{order_id}",
    "dedup_ttl": 5,
    "dedup_on_duplicate": "raise",
    "dedup_on_mismatch": "raise",
    "dedup_lock_ttl": 5,
    "dedup_on_locked": "reschedule",
    "dedup_window": 1,
    "dedup_max_wait": 20,
    "dedup_debounce": "first",
}


def documented_option_table() -> dict[tuple[str, str], bool]:
    """``(option, mode) -> applies``, as the settings doc's table of options by mode says."""
    lines = (Path(__file__).parents[2] / "docs" / "settings.md").read_text().splitlines()
    start = next(n for n, line in enumerate(lines) if line.startswith("| option | until_executed"))
    modes = [cell.strip() for cell in lines[start].strip("|").split("|")][1:]
    table = {}
    for line in itertools.takewhile(lambda text: text.startswith("|"), lines[start + 2 :]):
        option, *cells = (cell.strip() for cell in line.strip("|").split("|"))
        for mode, cell in zip(modes, cells, strict=True):
            assert cell.split()[0] in ("yes", "no"), (option, mode, cell)
            table[option.strip("`"), mode] = cell.startswith("yes")
    return table


DOCUMENTED = documented_option_table()


def test_the_doc_table_covers_every_option_and_mode_as_the_modes_declare_them() -> None:
    """The settings doc, ``Mode.options`` and the task's options name the same pairs."""
    assert {option for option, _ in DOCUMENTED} == set(TASK_OPTIONS)
    assert {mode for _, mode in DOCUMENTED} == set(MODES)
    assert {pair for pair, applies in DOCUMENTED.items() if applies} == {
        (option, name) for name, mode in MODES.items() for option in mode.options
    }


@pytest.mark.parametrize(("option", "mode"), sorted(DOCUMENTED), ids=[f"{o}-{m}" for o, m in sorted(DOCUMENTED)])
def test_an_option_is_taken_exactly_by_the_modes_it_applies_to(bare_app: BareApp, option: str, mode: str) -> None:
    """Every option x mode pair: taken where the doc says it applies, refused (naming task, option and mode) where
    it would do nothing."""
    app = bare_app()
    celery_dedup.install(app)
    app.finalize()
    options: dict[str, Any] = {"dedup_mode": mode}
    if MODES[mode].windowed:
        options["dedup_window"] = OPTION_VALUES["dedup_window"]
    if option != "dedup_mode":
        options[option] = OPTION_VALUES[option]
    if DOCUMENTED[option, mode]:
        task = _define(app, "plain", "shop.pair", **options)
        assert task.dedup_policy.mode is MODES[mode]
        return
    with pytest.raises(DedupConfigError) as info:
        _define(app, "plain", "shop.pair", **options)
    assert (info.value.task, info.value.setting) == ("shop.pair", option)
    assert f"dedup_mode={mode!r}" in info.value.reason


def test_an_option_of_another_mode_is_refused_by_the_default_mode_too(bare_app: BareApp) -> None:
    """A task that names no mode has the app's default mode, whose table row counts."""
    app = bare_app(dedup_default_mode="while_executing")
    celery_dedup.install(app)
    app.finalize()
    with pytest.raises(DedupConfigError) as info:
        _define(app, "class", "shop.pair", dedup_key="order:{order_id}", dedup_ttl=60)
    assert (info.value.task, info.value.setting) == ("shop.pair", "dedup_ttl")


# --- debounce where runs cannot be parked ---------------------------------------------------------------

#: Apps whose keys cannot live beside their messages: (broker, dedup_redis_url, what the refusal says).
UNPARKABLE = [
    pytest.param("memory://", REDIS, "memory:// is not Redis", id="memory"),
    pytest.param("amqp://guest@127.0.0.1:5672//", REDIS, "amqp:// is not Redis", id="rabbitmq"),
    pytest.param(REDIS, "redis://127.0.0.1:6379/14", "another server or database", id="store-on-another-database"),
]


def _debounced(app: Celery) -> Any:
    @app.task(
        base=DedupTask, shared=False, name="shop.sync", dedup_key="sku:{sku}", dedup_mode="debounce", dedup_window=1
    )
    def sync(sku: int) -> int:
        return sku

    return sync


@pytest.mark.parametrize(("broker", "store", "why"), UNPARKABLE)
@pytest.mark.parametrize("when", ["defined-after-install", "finalized-after-install", "bound-before-install"])
def test_a_debounced_task_is_refused_at_start_up_where_it_cannot_be_parked(
    bare_app: BareApp, broker: str, store: str, why: str, when: str
) -> None:
    """Not at its first .delay(): where the task is bound on an installed app, or at install for one bound before.

    The refusal names the task and what is missing; a Redis broker is never said not to be Redis."""
    app = bare_app(broker=broker, dedup_redis_url=store)
    with pytest.raises(DedupConfigError) as info:
        if when == "bound-before-install":
            app.finalize()
            _debounced(app)
            celery_dedup.install(app)
        elif when == "finalized-after-install":
            celery_dedup.install(app)
            _debounced(app)
            app.finalize()
        else:
            celery_dedup.install(app)
            app.finalize()
            _debounced(app)
    assert (info.value.task, info.value.setting, info.value.value) == ("shop.sync", "dedup_mode", "debounce")
    assert why in info.value.reason
    assert "Redis broker's database" in info.value.reason
    if broker == REDIS:
        assert "is not Redis" not in info.value.reason


def test_a_debounced_task_is_taken_where_it_can_be_parked_or_runs_eagerly(bare_app: BareApp) -> None:
    """The broker's own database (however spelled) parks runs; an eager app parks nothing; throttle never parks."""
    for app in (
        bare_app(),
        bare_app(dedup_redis_url=REDIS.replace("127.0.0.1", "localhost")),
        bare_app(broker="memory://", dedup_redis_url=REDIS, task_always_eager=True),
    ):
        celery_dedup.install(app)
        app.finalize()
        assert _debounced(app).dedup_policy.mode is MODES["debounce"]
    app = bare_app(broker="memory://", dedup_redis_url=REDIS)
    celery_dedup.install(app)
    app.finalize()
    throttled = _define(
        app, "plain", "shop.throttled", dedup_key="order:{order_id}", dedup_mode="throttle", dedup_window=1
    )
    assert throttled.dedup_policy.mode is MODES["throttle"]
