"""What ``celery dedup check`` inspects: the live setup, against what the guarantees need.

Each finding says how it stands (ok, unknown, warning, error) and why, in one
line. ``unknown`` is for what the server will not tell (CONFIG disabled on a
managed Redis), never a failure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import redis
from celery import Celery
from kombu.transport import redis as kombu_redis

from .. import runtime
from ..exceptions import DedupError, DedupStoreFormatError
from ..store import format as store_format
from ..store import server
from ..store.connection import masked_url
from ..store.schema import FORMAT
from ..store.store import DedupStore
from ..task import DedupTask

#: kombu's Redis transport redelivers an unacknowledged message after this many seconds by default.
DEFAULT_VISIBILITY_TIMEOUT: float = kombu_redis.Channel.visibility_timeout
#: Server and local clocks further apart than this (seconds) are reported.
CLOCK_TOLERANCE = 1.0


@dataclass(frozen=True)
class Finding:
    """One thing ``check`` looked at: how it stands (ok, unknown, warning, error), and why, in one line."""

    check: str
    level: str
    message: str


def eviction_finding(policy: str, maxmemory: int) -> Finding:
    """Only ``noeviction`` keeps dedup keys: they carry TTLs, so ``volatile-*`` evicts them too."""
    if policy == "noeviction":
        return Finding("maxmemory-policy", "ok", "noeviction: the server refuses writes rather than evict keys")
    limit = " (maxmemory is 0 now: nothing is evicted until a limit is set)" if maxmemory == 0 else ""
    return Finding(
        "maxmemory-policy",
        "warning",
        f"{policy} can evict held keys and locks under memory pressure (they carry TTLs, so volatile-* "
        f"policies evict them too), letting a duplicate run; set noeviction{limit}",
    )


def persistence_finding(save: str, appendonly: str, *, on_broker: bool = True) -> Finding:
    """Whether a restart of the store's server keeps its keys; ``on_broker``: the queues live there too."""
    if save.strip() or appendonly != "no":
        return Finding("persistence", "ok", f"save {save!r}, appendonly {appendonly}")
    if on_broker:
        what = (
            "a restart empties the server: its queued messages are lost, and every held key, execution lock "
            "and status record is forgotten, so a new call of a key runs again beside a run still executing "
            "or within its until_expired or throttle window"
        )
    else:
        what = (
            "a restart forgets every held key, execution lock and status record while the broker keeps the "
            "queued messages: a new call of a key runs again beside its queued or executing run, and a "
            "message delivered again after its run ended runs again"
        )
    return Finding("persistence", "warning", f"off (save '' and appendonly no): {what}; turn on appendonly")


def clock_finding(offset: float) -> Finding:
    """``offset``: the server's clock minus this host's, seconds."""
    offset = round(offset, 3) or 0.0  # no "-0.000"
    if abs(offset) <= CLOCK_TOLERANCE:
        return Finding("clock", "ok", f"server and this host agree within {CLOCK_TOLERANCE:g} s ({offset:+.3f} s)")
    side = "ahead of" if offset > 0 else "behind"
    return Finding(
        "clock",
        "warning",
        f"the server's clock is {abs(offset):.1f} s {side} this host's: holds and locks use the server's, "
        "but countdowns and ETAs are computed on each client's clock",
    )


def visibility_finding(visibility: float, lock_ttls: Sequence[tuple[float, str]], countdown: float = 0) -> Finding:
    """Whether kombu redelivers messages too early for the longest lock TTL and countdown.

    ``lock_ttls``: (seconds, whose) of each task and the setting; the first longest is named.
    """
    lock, whose = max(lock_ttls, key=lambda pair: pair[0])
    problems = []
    if countdown > visibility:
        problems.append(
            (countdown, f"a message due in {countdown:g} s (--countdown) is delivered again before it is due")
        )
    if lock > visibility:
        problems.append(
            (
                lock,
                f"a message redelivered while its run still holds the lock ({whose}: {lock:g} s) "
                "is deferred until that lock expires, again and again for a long run",
            )
        )
    if problems:
        return Finding(
            "visibility_timeout",
            "warning",
            f"{visibility:g} s is too short: {'; '.join(why for _, why in problems)}. Raise "
            f"broker_transport_options['visibility_timeout'] to at least {max(problems)[0]:g}",
        )
    tail = (
        f" and --countdown {countdown:g} s"
        if countdown
        else f"; a countdown or ETA beyond {visibility:g} s would be delivered twice (check yours with --countdown)"
    )
    return Finding(
        "visibility_timeout", "ok", f"{visibility:g} s covers the longest execution lock ({whose}: {lock:g} s){tail}"
    )


def _server_findings(found: server.ServerFacts, on_broker: bool) -> list[Finding]:
    findings = []
    if found.config_error:
        for name in ("maxmemory-policy", "persistence"):
            findings.append(
                Finding(
                    name, "unknown", f"CONFIG GET is not allowed here ({found.config_error}): check it with your host"
                )
            )
    else:
        config = found.config
        findings.append(eviction_finding(config["maxmemory-policy"], int(config["maxmemory"])))
        findings.append(persistence_finding(config["save"], config["appendonly"], on_broker=on_broker))
    if found.clock_offset is None:
        findings.append(Finding("clock", "unknown", f"TIME is not allowed here ({found.clock_error})"))
    else:
        findings.append(clock_finding(found.clock_offset))
    return findings


def _store_findings(client: redis.Redis, on_broker: bool) -> list[Finding]:
    """The server's findings; a cluster's per primary, each named. ``on_broker``: the store is the broker."""
    each = server.facts(client)
    if len(each) == 1 and not each[0].node:
        return _server_findings(each[0], on_broker)
    return [
        Finding(found.check, found.level, f"{facts.node}: {found.message}")
        for facts in each
        for found in _server_findings(facts, on_broker=False)
    ]


def _task_findings(app: Celery, config_lock_ttl: float) -> tuple[list[Finding], list[tuple[float, str]]]:
    """Errors of DedupTasks whose options do not resolve, and the lock TTLs of the setting and each task."""
    findings: list[Finding] = []
    lock_ttls: list[tuple[float, str]] = []
    fallback = (config_lock_ttl, "setting dedup_lock_ttl")
    try:
        app.loader.import_default_modules()
        tasks = sorted(app.tasks.items())  # binding the tasks validates their options
    except DedupError as exc:
        return [Finding("tasks", "error", str(exc))], [fallback]
    for name, task in tasks:
        if isinstance(task, DedupTask):
            try:
                lock_ttls.append((task.dedup_policy.lock_ttl, name))
            except DedupError as exc:
                findings.append(Finding("tasks", "error", str(exc)))
    return findings, [*lock_ttls, fallback]


def run_checks(app: Celery, *, countdown: float = 0) -> list[Finding]:
    """Inspect ``app``'s settings, tasks and Redis server for what would break the guarantees."""
    try:
        state = runtime.runtime_for(app)
    except DedupError as exc:
        return [Finding("settings", "error", str(exc))]
    findings = []
    if state.installed:
        findings.append(Finding("install", "ok", "celery_dedup.install(app) was called"))
    else:
        findings.append(
            Finding("install", "error", "celery_dedup.install(app) was not called: keyed tasks refuse to publish")
        )
    broker = runtime._broker_url(app)
    scheme = runtime._scheme(broker)
    redis_broker = scheme in runtime.TRANSPORTS
    config = state.config
    on_broker = redis_broker and runtime.separate_store(app, config) is None
    if not redis_broker:
        findings.append(
            Finding(
                "broker", "warning", f"{scheme}:// is not Redis: the gate has two phases (hold with a lease, publish)"
            )
        )
    elif not on_broker:
        findings.append(
            Finding(
                "broker",
                "warning",
                f"dedup_redis_url {masked_url(str(config.redis_url))} is not the broker's database "
                f"{masked_url(broker)}: keys and messages live apart, so the gate has two phases",
            )
        )
    else:
        findings.append(Finding("broker", "ok", f"{scheme}:// broker, keys on it: the gate is atomic"))
    task_findings, lock_ttls = _task_findings(app, config.lock_ttl)
    findings += task_findings
    if redis_broker:
        options = app.conf.broker_transport_options or {}
        findings.append(
            visibility_finding(
                float(options.get("visibility_timeout", DEFAULT_VISIBILITY_TIMEOUT)), lock_ttls, countdown
            )
        )
    store_url = masked_url(config.redis_url or broker)
    try:
        findings.append(format_finding(state.store, app.main))
        findings += _store_findings(state.store.client, on_broker)
    except DedupStoreFormatError as exc:
        findings.append(Finding("format", "error", str(exc)))
    except (redis.RedisError, DedupError) as exc:
        findings.append(Finding("server", "error", f"cannot inspect the dedup store at {store_url}: {exc}"))
    return findings


def format_finding(store: DedupStore, app_name: str | None) -> Finding:
    """The store's format (see ``store/format.py``), with a scan for format 1's history lists."""
    found = store_format.check(store, app_name, scan=True, warn=False)
    if found.leftovers:
        return Finding("format", "warning", store_format.leftovers_message(found, app_name))
    return Finding("format", "ok", f"format {FORMAT}, no format-1 structures left")
