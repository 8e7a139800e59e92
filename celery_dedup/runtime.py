"""Per-app state: the validated config, the store, and how publishes are gated.

``install`` (:mod:`.installer`) builds it once and keeps it on the app;
everything else asks for it through the functions here.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
import urllib.parse
import weakref
from collections import Counter
from typing import Any

import redis

from . import decisions
from .config import DedupConfig
from .exceptions import DedupArgumentError, DedupConfigError
from .keys import split_member, task_from_namespace
from .store.connection import broker_client, client_from_url
from .store.store import DedupStore, ReapReport

logger = logging.getLogger("celery_dedup")

_ATTR = "_celery_dedup_runtime"
#: URL scheme -> the gated transport an installed app's connections resolve it to (``transports.redis.GATED``).
TRANSPORTS = {
    "redis": "celery_dedup.transports.redis:Transport",
    "rediss": "celery_dedup.transports.redis:Transport",
    "sentinel": "celery_dedup.transports.redis:SentinelTransport",
}


class RecentKeys:
    """Members this process saw held lately, each until its hold would end.

    Only a hint that a call is probably a duplicate, so ``apply_async`` asks
    the server (one small script) before building a message. Bounded: the
    oldest entries make room.
    """

    def __init__(self, size: int = 10_000) -> None:
        self.size = size
        self._until: dict[str, float] = {}
        self._lock = threading.Lock()

    def hint(self, member: str) -> bool:
        until = self._until.get(member)
        return until is not None and until > time.monotonic()

    def saw(self, member: str, seconds: float) -> None:
        with self._lock:
            self._until.pop(member, None)
            self._until[member] = time.monotonic() + seconds
            if len(self._until) > self.size:
                del self._until[next(iter(self._until))]

    def forget(self, member: str) -> None:
        with self._lock:
            self._until.pop(member, None)


class Runtime:
    """What celery-dedup knows about one Celery app."""

    def __init__(self, app: Any, config: DedupConfig, installed: bool) -> None:
        self.app = app
        self.config = config
        self.installed = installed
        self.atomic = False
        self.fail_open: Counter[str] = Counter()
        self.unflushed: Counter[str] = Counter()
        self.recent = RecentKeys()
        #: kombu's unacknowledged hash for this app's deliveries, read once (see ``recovery.delivery``).
        self.unacked_key: str | None = None
        self._store: DedupStore | None = None
        self._lock = threading.Lock()
        _runtimes.add(self)

    @property
    def store(self) -> DedupStore:
        if self._store is None:
            with self._lock:
                if self._store is None:
                    self._store = DedupStore(
                        self._client(),
                        self.config.key_prefix,
                        history_length=self.config.history_length,
                        wait_replicas=self.config.cluster_wait_replicas,
                    )
        self._store.check_format(self.app.main)  # once per store: its first use in a process
        return self._store

    def _client(self) -> redis.Redis:
        """The store on the broker connects as the broker does; a separate one by its own URL and options."""
        url = separate_store(self.app, self.config)
        if url is not None:
            return client_from_url(url, self.config.redis_options)
        with self.app.connection_for_write() as connection:
            return broker_client(connection)


_runtimes: weakref.WeakSet[Runtime] = weakref.WeakSet()


def _new_locks_after_fork() -> None:
    """A child forked while another thread held a runtime's lock would wait for it forever."""
    for runtime in list(_runtimes):
        runtime._lock = threading.Lock()


os.register_at_fork(after_in_child=_new_locks_after_fork)


def _broker_url(app: Any) -> str:
    """The first URL of the broker (failover lists and Sentinel lists share a scheme)."""
    url = app.conf.broker_write_url or app.conf.broker_url or "amqp://"
    if isinstance(url, (list, tuple)):
        url = url[0]
    return str(url).split(";")[0]


def separate_store(app: Any, config: DedupConfig) -> str | None:
    """``dedup_redis_url`` if it names a store apart from the broker, else None.

    A URL that names the broker's server and database another way
    (``localhost`` for ``127.0.0.1``, no database for ``/0``, options in the
    query) is the broker: its keys and messages can be written in one script.
    """
    url = config.redis_url
    if url is None or same_database(url, _broker_url(app)):
        return None
    return url


@functools.lru_cache(maxsize=64)
def same_database(first: str, second: str) -> bool:
    """Whether two Redis URLs reach one database of one server.

    Host names are resolved, so a false "no" (an unresolvable name) only costs
    the atomic gate; a false "yes" would need two servers on one address.
    """
    if first == second:
        return True
    one, other = _location(first), _location(second)
    if one is None or other is None:
        return False
    (kind, addresses, port, db), (other_kind, other_addresses, other_port, other_db) = one, other
    return (kind, port, db) == (other_kind, other_port, other_db) and bool(addresses & other_addresses)


def _location(url: str) -> tuple[str, frozenset[str], int, int] | None:
    """``(kind, addresses, port, database)`` of a redis://, rediss:// or unix:// URL; None for others."""
    try:
        parts = urllib.parse.urlsplit(url)
        query = urllib.parse.parse_qs(parts.query)
        scheme = parts.scheme.lower()
        if scheme == "unix":
            return "unix", frozenset({os.path.realpath(parts.path)}), 0, int(query.get("db", ["0"])[0])
        if scheme not in ("redis", "rediss"):
            return None
        path = parts.path.strip("/")
        db = int(path) if path else int(query.get("db", ["0"])[0])
        host, port = parts.hostname or "localhost", parts.port or 6379
    except ValueError:
        return None
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        addresses = frozenset(str(info[4][0]) for info in found)
    except OSError:
        addresses = frozenset({host})
    return "tcp", addresses, port, db


def _scheme(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else url.lower()


def not_atomic_reason(app: Any) -> str | None:
    """Why the installed app's keys and messages cannot be written in one script; None if they can."""
    runtime = runtime_for(app)
    if runtime.atomic:
        return None
    scheme = _scheme(_broker_url(app))
    if scheme not in TRANSPORTS:
        return f"the broker {scheme}:// is not Redis"
    return "dedup_redis_url names another server or database than the broker's"


def runtime_for(app: Any) -> Runtime:
    """The app's state; settings are read (not installed) if ``install`` was not called yet."""
    runtime: Runtime | None = getattr(app, _ATTR, None)
    if runtime is None:
        runtime = Runtime(app, DedupConfig.from_conf(app.conf), installed=False)
        setattr(app, _ATTR, runtime)
    return runtime


def is_installed(app: Any) -> bool:
    """Whether ``install`` set ``app`` up (receivers that every app's tasks reach act only for those)."""
    runtime: Runtime | None = getattr(app, _ATTR, None)
    return runtime is not None and runtime.installed


def config_for(app: Any) -> DedupConfig:
    return runtime_for(app).config


def store_for(app: Any) -> DedupStore:
    return runtime_for(app).store


def is_atomic(app: Any) -> bool:
    """Whether publishes are gated by the transport in one Lua script."""
    runtime = runtime_for(app)
    if not runtime.installed:
        raise DedupConfigError("app", app.main, "a DedupTask was called before celery_dedup.install(app)")
    return runtime.atomic and not app.conf.task_always_eager


def count_fail_open(app: Any, task_name: str) -> None:
    """Count a ``fail_open`` publish or run: in this process now, in Redis once it answers again."""
    runtime = runtime_for(app)
    with runtime._lock:
        runtime.fail_open[task_name] += 1
        runtime.unflushed[task_name] += 1


def flush_counts(app: Any) -> None:
    """Add this process's ``fail_open`` counts to the counters in Redis (raises RedisError if it is down)."""
    runtime = runtime_for(app)
    with runtime._lock:
        pending, runtime.unflushed = runtime.unflushed, Counter()
    try:
        for task_name, amount in pending.items():
            runtime.store.count(task_name, "fail_open", amount)
            pending[task_name] = 0
    finally:
        with runtime._lock:
            runtime.unflushed.update(+pending)


def stats(app: Any) -> dict[str, dict[str, int]]:
    """Decisions per task name, counted in Redis by every process of the app.

    Decisions: accepted, deduplicated, mismatched (duplicates whose arguments
    differed from their run's), collapsed (debounce), followed, skipped and
    deferred (deliveries), lock_lost, released (by an operator), reaped, and
    fail_open. This process's ``fail_open`` counts that could not reach Redis
    yet are included.
    """
    try:
        flush_counts(app)
    except redis.RedisError:
        logger.warning("could not add fail_open counts to the dedup store; they are kept in this process")
    counts = {
        task_from_namespace(namespace): dict(decisions) for namespace, decisions in store_for(app).stats().items()
    }
    for task_name, amount in runtime_for(app).unflushed.items():
        decisions = counts.setdefault(task_name, {})
        decisions["fail_open"] = decisions.get("fail_open", 0) + amount
    return counts


def reap(app: Any, *, budget: int = 500) -> ReapReport:
    """One bounded clean-up pass: expired holds, runs of dead workers, stale index entries,
    and queued runs whose message the transport lost.

    Each step examines at most ``budget`` entries, going on where the last
    pass (of any process) stopped: every record is looked at within
    ``ceil(records / budget)`` passes of a walk's start (see ``reap.lua``).
    Workers run it every ``dedup_reap_interval`` seconds; call it from cron or
    beat where no worker runs. Each run it marks lost gets its ``reaped`` log line.

    Raises:
        DedupArgumentError: ``budget`` is below 1.
    """
    if budget < 1:
        raise DedupArgumentError("budget", budget, "reap() examines at least 1 entry per step")
    config = config_for(app)
    report = store_for(app).reap(budget=budget, record_ms=config.record_ms, grace_ms=int(config.reap_grace * 1000))
    for member, task_id, why in report.runs:
        namespace, key = split_member(member)
        decisions.log("reaped", task_from_namespace(namespace), key, task_id, f"marked lost: {why}")
    return report
