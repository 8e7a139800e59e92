"""The Celery app ``benchmarks/storm.py`` runs its workers and producers on: one library per process.

Importable by ``celery -A benchmarks.storm_app worker``, configured from the
environment so the spawned worker builds the same app as the benchmark:

- ``CELERY_DEDUP_BENCH_BROKER``: broker URL, also every library's lock store;
- ``CELERY_DEDUP_STORM_LIBRARY``: ``celery-dedup``, ``celery-once`` or ``celery-singleton``;
- ``CELERY_DEDUP_STORM_SETTINGS``: JSON of :class:`StormSettings`.

Every library gets the same Celery settings (late acks, requeue on a lost
worker, a short visibility timeout, kombu's restore sweep every second) and
one task ``bench.storm`` keyed on ``n``, configured the way its library
documents. The body sleeps a little (every ``slow_every``-th key longer than
the visibility timeout, so its message is redelivered while it runs); it logs
its start and its end in one Redis list, so the benchmark can tell, after the
processes are gone, which executions ran, where, and which never finished.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import redis
from celery import Celery, Task, signals

import celery_dedup
from benchmarks.harness import READY_MARKER
from celery_dedup import DedupTask

BROKER = os.environ.get("CELERY_DEDUP_BENCH_BROKER", "redis://127.0.0.1:6379/0")
LIBRARIES = ("celery-dedup", "celery-once", "celery-singleton")
QUEUE = "bench-storm"
TASK = "bench.storm"
DEDUP_PREFIX = "bench-storm-dedup"
SINGLETON_PREFIX = "bench-storm-singleton:"
#: celery-once names its locks ``qo_<task name>_<key>``; the prefix is not configurable.
ONCE_PREFIX = f"qo_{TASK}_"
#: RPUSHed by every execution: ``"S <task id> <n> <pid> <ppid>"`` when the body starts, ``"F ..."`` when it ends.
LOG = "bench-storm:log"
#: INCRed by every execution as it starts: the benchmark's progress meter for timing kills.
STARTED = "bench-storm:started"


@dataclass(frozen=True)
class StormSettings:
    """What every library's app shares; travels to worker processes as JSON."""

    body_s: float = 0.04
    #: Every ``slow_every``-th key (0: none) sleeps ``slow_s`` instead: longer than the visibility timeout.
    slow_every: int = 100
    slow_s: float = 6.0
    visibility_timeout: float = 4.0
    #: celery-dedup's execution lock TTL (the peers have no execution lock).
    lock_ttl: float = 2.0
    #: How long a queued key is held at most, for all three (dedup_ttl, default_timeout, lock_expiry).
    hold_ttl: int = 3600

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> StormSettings:
        return cls(**json.loads(text)) if text else cls()


def transport_options(settings: StormSettings) -> dict[str, Any]:
    """A short visibility timeout, and kombu's restore sweep every second instead of every 100 s."""
    return {
        "visibility_timeout": settings.visibility_timeout,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        # A worker killed holding the sweep's mutex blocks the others for 5 s, not 5 minutes.
        "unacked_mutex_expire": 5,
    }


def library_conf(url: str, library: str, settings: StormSettings) -> dict[str, Any]:
    """Each library's documented settings, on the broker's server."""
    if library == "celery-dedup":
        return {
            "dedup_key_prefix": DEDUP_PREFIX,
            "dedup_default_ttl": settings.hold_ttl,
            "dedup_lock_ttl": settings.lock_ttl,
            "dedup_reap_interval": 1,
            "dedup_reap_grace": settings.lock_ttl,
        }
    if library == "celery-once":
        return {
            "ONCE": {
                "backend": "celery_once.backends.Redis",
                "settings": {"url": url, "default_timeout": settings.hold_ttl},
            }
        }
    if library == "celery-singleton":
        return {
            "singleton_backend_url": url,
            "singleton_key_prefix": SINGLETON_PREFIX,
            "singleton_lock_expiry": settings.hold_ttl,
        }
    raise ValueError(f"unknown library {library!r}: expected one of {', '.join(LIBRARIES)}")


def task_base(library: str) -> tuple[type[Task[Any, Any]], dict[str, Any]]:
    """The library's task class and the options that key it on ``n``."""
    if library == "celery-dedup":
        return DedupTask, {"dedup_key": "storm:{n}"}
    if library == "celery-once":
        from celery_once import QueueOnce  # noqa: PLC0415 - optional: the bench extra

        return QueueOnce, {"once": {"keys": ["n"]}}
    if library == "celery-singleton":
        from celery_singleton import Singleton  # noqa: PLC0415 - optional: the bench extra

        return Singleton, {"unique_on": ["n"]}
    raise ValueError(f"unknown library {library!r}: expected one of {', '.join(LIBRARIES)}")


def build_app(url: str, library: str, settings: StormSettings, name: str = "bench_storm") -> tuple[Celery, Any]:
    """An app on ``url`` with ``library``'s storm task, and that task."""
    app = Celery(name, broker=url, set_as_current=False)
    app.conf.update(
        task_default_queue=QUEUE,
        task_ignore_result=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        broker_transport_options=transport_options(settings),
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        **library_conf(url, library, settings),
    )
    if library == "celery-dedup":
        celery_dedup.install(app)
    log: redis.Redis = redis.Redis.from_url(url)
    base, options = task_base(library)

    @app.task(name=TASK, base=base, bind=True, shared=False, **options)
    def storm(self: Task[Any, Any], n: int) -> None:
        pid, ppid = os.getpid(), os.getppid()
        with log.pipeline(transaction=False) as pipe:
            pipe.rpush(LOG, f"S {self.request.id} {n} {pid} {ppid}")
            pipe.incr(STARTED)
            pipe.execute()
        slow = settings.slow_every and n % settings.slow_every == 0
        time.sleep(settings.slow_s if slow else settings.body_s)
        log.rpush(LOG, f"F {self.request.id} {n} {pid} {ppid}")

    return app, storm


def _from_environment() -> Celery | None:
    library = os.environ.get("CELERY_DEDUP_STORM_LIBRARY")
    if library is None:
        return None
    settings = StormSettings.from_json(os.environ.get("CELERY_DEDUP_STORM_SETTINGS", ""))
    return build_app(BROKER, library, settings)[0]


#: The worker's app; None when imported without ``CELERY_DEDUP_STORM_LIBRARY`` (by the benchmark itself).
app = _from_environment()


@signals.worker_ready.connect
def _announce_ready(sender: Any = None, **_: Any) -> None:
    if app is not None and getattr(sender, "app", None) is app:
        print(READY_MARKER, flush=True)
