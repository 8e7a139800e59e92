"""Setting an app up: misspelled options, install order, and what install leaves alone.

Each test here reproduces a way configuration used to be silently ignored or
to fail late, at the first call instead of at start-up.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import celery
import pytest
import redis
from celery import Celery, signals
from celery.backends.redis import RedisBackend
from kombu.transport import redis as kombu_redis

import celery_dedup
from celery_dedup import DedupConfigError, DedupTask
from celery_dedup.exceptions import DedupArgumentError
from celery_dedup.header import HEADER
from celery_dedup.keys import KeySchema, member_for
from celery_dedup.modes import MODES
from celery_dedup.runtime import config_for
from celery_dedup.transports.redis import Transport

from ..conftest import AppFactory, Server, queued_messages

NEVER_CONTACTED = "redis://127.0.0.1:6379/15"


@pytest.fixture
def offline_app() -> Iterator[Celery]:
    app = Celery("install", set_as_current=False, broker=NEVER_CONTACTED)
    yield app
    app.close()


# --------------------------------------------------------------------------- misspelled task options


@pytest.mark.parametrize(("typo", "meant"), [("dedup_keys", "dedup_key"), ("dedup_ttls", "dedup_ttl")])
def test_a_misspelled_task_option_fails_when_the_task_is_bound(offline_app: Celery, typo: str, meant: str) -> None:
    celery_dedup.install(offline_app)
    options: dict[str, Any] = {typo: "order:{order_id}" if typo == "dedup_keys" else 30}
    with pytest.raises(DedupConfigError) as info:

        @offline_app.task(base=DedupTask, name="install.charge", shared=False, **options)
        def charge(order_id: int) -> None: ...

        offline_app.finalize()
        charge.dedup_policy  # noqa: B018 - bound lazily on apps finalized before the task existed

    error = info.value
    assert error.task == "install.charge" and error.setting == typo
    assert f"did you mean {meant!r}" in str(error)


def test_a_misspelled_option_on_a_task_class_is_refused(offline_app: Celery) -> None:
    celery_dedup.install(offline_app)

    class Charge(DedupTask):
        name = "install.Charge"
        dedup_mode_ = "until_executed"

        def run(self, order_id: int) -> None: ...

    with pytest.raises(DedupConfigError, match=r"dedup_mode_.*unknown"):
        registered = offline_app.register_task(Charge())
        registered.dedup_policy  # noqa: B018


def test_dedup_methods_and_documented_options_are_not_taken_for_typos(offline_app: Celery) -> None:
    celery_dedup.install(offline_app)

    @offline_app.task(base=DedupTask, name="install.ok", dedup_key="k:{n}", dedup_ttl=5, shared=False)
    def ok(n: int) -> None: ...

    assert ok.dedup_policy.ttl == 5


# --------------------------------------------------------------------------- settings spelled otherwise


def test_a_wrong_store_url_scheme_fails_at_install(offline_app: Celery) -> None:
    offline_app.conf.dedup_redis_url = "http://cache:6379/0"
    with pytest.raises(DedupConfigError, match=r"dedup_redis_url.*http"):
        celery_dedup.install(offline_app)


def test_uppercase_settings_in_a_plain_config_module_are_read(offline_app: Celery) -> None:
    """Celery reads a plain config module's old uppercase names as its settings: so do we."""
    offline_app.config_from_object(SimpleNamespace(DEDUP_DEFAULT_TTL=5, DEDUP_KEY_PREFIX="shop"))
    celery_dedup.install(offline_app)
    config = config_for(offline_app)
    assert (config.default_ttl, config.key_prefix) == (5, "shop")


def test_one_setting_spelled_both_ways_is_refused(offline_app: Celery) -> None:
    offline_app.config_from_object(SimpleNamespace(DEDUP_DEFAULT_TTL=5, dedup_default_ttl=6))
    with pytest.raises(DedupConfigError, match="both"):
        celery_dedup.install(offline_app)


def test_uppercase_typos_are_refused_with_a_suggestion(offline_app: Celery) -> None:
    offline_app.config_from_object(SimpleNamespace(DEDUP_DEFAULT_TLL=5))
    with pytest.raises(DedupConfigError, match="did you mean 'dedup_default_ttl'"):
        celery_dedup.install(offline_app)


# --------------------------------------------------------------------------- install order


def keyed_task(app: Celery) -> Any:
    @app.task(base=DedupTask, name="install.keyed", dedup_key="order:{n}", shared=False)
    def keyed(n: int) -> int:
        return n

    return keyed


LATE_INSTALL = """
import json, sys
import celery
from celery import Celery
import celery_dedup
from celery_dedup import DedupTask

app = Celery("late", broker=sys.argv[1], set_as_current=False)

@app.task(name="install.plain")
def plain(n):
    return n

unkeyed = plain.delay(1)  # the app's pool now holds a connection of kombu's own transport
celery_dedup.install(app)

@app.task(base=DedupTask, name="install.keyed", dedup_key="order:{n}", shared=False)
def keyed(n):
    return n

first, second = keyed.delay(7), keyed.delay(7)
print(json.dumps({"unkeyed": unkeyed.id, "first": [first.id, first.deduplicated],
                  "second": [second.id, second.deduplicated]}))
"""


def test_install_after_the_app_published_still_gates_every_keyed_call(server: Server, r: redis.Redis) -> None:
    """In a fresh process: the app publishes through kombu's own transport before install."""
    done = subprocess.run(
        [sys.executable, "-c", LATE_INSTALL, server.url], capture_output=True, text=True, timeout=60, check=True
    )
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["first"][1] is False and seen["second"] == [seen["first"][0], True], seen
    assert sorted(m["headers"]["id"] for m in queued_messages(r)) == sorted([seen["unkeyed"], seen["first"][0]])


def test_publish_settings_changed_after_install_are_honoured(make_app: AppFactory, r: redis.Redis) -> None:
    """install() must not snapshot Celery's publish settings: a change afterwards applies, as without it.

    (Celery reads them when it builds its message sender, at the first publish.)
    """
    app = make_app()

    @app.task(name="install.plain_after", shared=False)
    def plain(n: int) -> int:
        return n

    app.conf.task_default_delivery_mode = "transient"
    plain.delay(1)
    keyed_task(app).delay(2)
    modes = [m["properties"]["delivery_mode"] for m in queued_messages(r)]
    assert modes == [1, 1], "task_default_delivery_mode set after install was ignored"


@pytest.mark.parametrize("mode", sorted(MODES))
def test_dedup_task_on_an_app_without_install_is_refused(make_app: AppFactory, r: redis.Redis, mode: str) -> None:
    """Publishing a DedupTask before install() raises DedupConfigError and publishes nothing."""
    app = make_app("noinstall", install=False)

    @app.task(base=DedupTask, dedup_key="order:{order_id}", dedup_mode=mode, shared=False, name="noinstall.charge")
    def charge(order_id: int) -> int:
        return order_id

    with pytest.raises(DedupConfigError) as info:
        charge.delay(1)
    assert "install" in str(info.value)
    with pytest.raises(DedupConfigError):
        charge.apply_async((2,), countdown=1)
    assert queued_messages(r) == []
    assert r.exists(KeySchema("dedup").held) == 0


# --------------------------------------------------------------------------- out-of-range arguments


def test_a_key_callable_that_cannot_take_the_tasks_arguments_fails_when_bound(offline_app: Celery) -> None:
    celery_dedup.install(offline_app)
    with pytest.raises(DedupConfigError, match=r"cannot take the task's arguments \(order_id\)") as info:

        @offline_app.task(base=DedupTask, name="install.by_two", dedup_key=lambda a, b: f"{a}:{b}", shared=False)
        def by_two(order_id: int, amount: int = 0) -> None: ...

        offline_app.finalize()
        by_two.dedup_policy  # noqa: B018
    assert info.value.task == "install.by_two"


def test_a_key_callable_taking_what_the_task_requires_is_accepted(offline_app: Celery) -> None:
    celery_dedup.install(offline_app)

    @offline_app.task(base=DedupTask, name="install.by_order", dedup_key=lambda order_id, **_: order_id, shared=False)
    def by_order(order_id: int, amount: int = 0) -> None: ...

    assert by_order.dedup_business_key(7, amount=3) == "7"


@pytest.mark.parametrize("chunk", [0, -1, 2.5, True])
def test_apply_async_many_refuses_a_chunk_below_one(make_app: AppFactory, chunk: Any) -> None:
    keyed = keyed_task(make_app())
    with pytest.raises(DedupArgumentError, match="chunk") as info:
        keyed.apply_async_many([((1,), {})], chunk=chunk)
    assert (info.value.parameter, info.value.value) == ("chunk", chunk)


def test_checking_task_options_binds_no_app_to_the_dedup_task_base(offline_app: Celery) -> None:
    """Looking for misspelled options must not touch ``Task.app``, which binds a class to the current app.

    Bound, the abstract base would take that app's settings (``task_ignore_result``)
    for every DedupTask defined afterwards, on any app.
    """
    current = Celery("current", broker=NEVER_CONTACTED, set_as_current=False)
    current.conf.task_ignore_result = True
    previous = celery.current_app._get_current_object()  # type: ignore[attr-defined]
    current.set_current()
    try:
        celery_dedup.install(offline_app)

        @offline_app.task(base=DedupTask, name="install.bound", dedup_key="k:{n}", shared=False)
        def bound(n: int) -> None: ...

        offline_app.finalize()
        assert bound.dedup_policy.ttl > 0
    finally:
        previous.set_current()
        current.close()
    assert not vars(DedupTask).get("__bound__", False), "the abstract DedupTask was bound to the current app"
    assert bound.ignore_result is False


# --------------------------------------------------------------------------- nothing patched at import

SNAPSHOT = """
import json, pkgutil, sys, importlib, types
import celery.signals, kombu.pools, kombu.transport, redis
from celery.app import amqp, backends, base, task
from celery.backends import redis as redis_backend
from celery.loaders import app as app_loader, base as base_loader
from celery.utils.dispatch import Signal
from kombu import connection
from kombu.transport import redis as kombu_redis

OWNERS = [
    redis_backend, redis_backend.RedisBackend, redis_backend.SentinelBackend, backends, base.Celery, amqp.AMQP,
    task.Task, base_loader.BaseLoader, app_loader.AppLoader, connection.Connection, kombu.transport, kombu.pools,
    kombu_redis, kombu_redis.Transport, kombu_redis.SentinelTransport, kombu_redis.Channel,
    kombu_redis.SentinelChannel, redis.Redis, redis.ConnectionPool,
]

def snapshot():
    seen = {}
    for owner in OWNERS:
        for name, value in vars(owner).items():
            if not isinstance(value, types.ModuleType):  # a submodule imported meanwhile is no substitution
                seen[f"{owner.__name__}.{name}"] = f"{type(value).__name__} {id(value)}"
    tables = {
        "TRANSPORT_ALIASES": kombu.transport.TRANSPORT_ALIASES,
        "_transport_cache": kombu.transport._transport_cache,
        "BACKEND_ALIASES": backends.BACKEND_ALIASES,
        "override_backends": base_loader.BaseLoader.override_backends,
        "pools": {"connections": len(kombu.pools.connections), "producers": len(kombu.pools.producers)},
    }
    for name, table in tables.items():
        seen[name] = repr(sorted(table.items(), key=repr))
    for name, value in vars(celery.signals).items():
        if isinstance(value, Signal):
            seen[f"signal {name}"] = repr([key for key, _ in value.receivers])
    return seen

before = snapshot()
import celery_dedup
for module in pkgutil.walk_packages(celery_dedup.__path__, "celery_dedup."):
    if not module.name.startswith("celery_dedup.contrib."):  # integrations with other libraries
        importlib.import_module(module.name)
after = snapshot()
changed = {k: [before.get(k), after.get(k)] for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k)}
print(json.dumps(changed))
"""


def test_importing_celery_dedup_changes_nothing_in_celery_kombu_or_redis() -> None:
    """Classes, alias tables, pools and signal receivers are as they were: install() is where anything changes."""
    done = subprocess.run([sys.executable, "-c", SNAPSHOT], capture_output=True, text=True, timeout=60, check=True)
    changed = json.loads(done.stdout.strip().splitlines()[-1])
    assert changed == {}, changed


SCHEMA = KeySchema("dedup")


def test_an_app_not_installed_keeps_celerys_backend_and_kombus_transport(make_app: AppFactory, r: redis.Redis) -> None:
    """Two apps in one process, one installed: the other's result backend and broker transport are the stock ones.

    A message with a ``dedup`` header published by the plain app is kombu's
    plain publish: no key is held and no record written.
    """
    installed = make_app("installed", dedup_default_ttl=60)
    keyed = keyed_task(installed)
    plain = make_app("plain", install=False, dedup_default_ttl=5)
    assert type(plain.backend) is RedisBackend
    assert RedisBackend.__dict__["_set"].__module__ == "celery.backends.redis", "RedisBackend._set was replaced"
    with plain.connection_for_write() as conn:
        assert type(conn.transport) is kombu_redis.Transport
    with installed.connection_for_write() as conn:
        assert type(conn.transport) is Transport
    backend = type(installed.backend)
    assert issubclass(backend, RedisBackend) and backend is not RedisBackend, "the installed app writes its results"

    member = member_for(keyed.name, "order:9")
    header = keyed.dedup_gate_header(member).encode()
    plain.send_task(keyed.name, args=(9,), headers={HEADER: header})
    assert [m["headers"].get(HEADER) for m in queued_messages(r)] == [header], "published as kombu publishes"
    assert not r.sismember(SCHEMA.held, member)
    assert not r.exists(SCHEMA.record(member))
    assert config_for(plain).default_ttl == 5 and config_for(installed).default_ttl == 60


class Consumer:
    """What a worker's consumer gives the ``task_rejected`` receivers: its app."""

    def __init__(self, app: Celery) -> None:
        self.app = app


def test_signal_receivers_leave_an_app_not_installed_alone(make_app: AppFactory, r: redis.Redis) -> None:
    """A worker of an app that was not installed rejecting a gated message frees no key (the store is not its own)."""
    installed = make_app("installed")
    plain = make_app("plain", install=False)
    keyed = keyed_task(installed)
    keyed.delay(3)
    member = member_for(keyed.name, "order:3")
    (message,) = queued_messages(r)
    assert r.sismember(SCHEMA.held, member), "premise: the installed app's call holds its key"
    rejected = SimpleNamespace(headers=message["headers"])
    signals.task_rejected.send(sender=Consumer(plain), message=rejected, exc=None)
    assert r.sismember(SCHEMA.held, member), "an app that was not installed released another app's key"
    signals.task_rejected.send(sender=Consumer(installed), message=rejected, exc=None)
    assert not r.sismember(SCHEMA.held, member), "the installed app's worker frees the key of a rejected message"
