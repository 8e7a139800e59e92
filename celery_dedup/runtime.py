"""Per-app state: the validated config, the store, and how publishes are gated.

``install`` builds it once and keeps it on the app; everything else asks for
it through the functions here.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

from .config import DedupConfig
from .exceptions import DedupConfigError
from .store import DedupStore, client_from_url

logger = logging.getLogger("celery_dedup")

_ATTR = "_celery_dedup_runtime"
_REDIS_SCHEMES = {"redis", "rediss", "unix", "socket"}
TRANSPORTS = {
    "redis": "celery_dedup.transport:Transport",
    "sentinel": "celery_dedup.transport:SentinelTransport",
}


class Runtime:
    """What celery-dedup knows about one Celery app."""

    def __init__(self, app: Any, config: DedupConfig, installed: bool) -> None:
        self.app = app
        self.config = config
        self.installed = installed
        self.atomic = False
        self.fail_open: Counter[str] = Counter()
        self._store: DedupStore | None = None
        self._lock = threading.Lock()

    @property
    def store(self) -> DedupStore:
        if self._store is None:
            with self._lock:
                if self._store is None:
                    conf = self.app.conf
                    url = self.config.redis_url or _broker_url(self.app)
                    client = client_from_url(url, conf.broker_transport_options)
                    self._store = DedupStore(client, self.config.key_prefix)
        return self._store


def _broker_url(app: Any) -> str:
    url = app.conf.broker_write_url or app.conf.broker_url or "amqp://"
    if isinstance(url, (list, tuple)):
        url = url[0]
    return str(url).split(";")[0]


def _scheme(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else url.lower()


def install(app: Any) -> Runtime:
    """Validate settings, choose the gated transport, and keep the state on ``app``."""
    config = DedupConfig.from_conf(app.conf)
    runtime = Runtime(app, config, installed=True)
    broker = _broker_url(app)
    scheme = _scheme(broker)
    family = "sentinel" if scheme == "sentinel" else "redis" if scheme in _REDIS_SCHEMES else None
    if family is not None:
        wanted = TRANSPORTS[family]
        current = app.conf.broker_transport
        if current not in (None, wanted, scheme):
            raise DedupConfigError(
                "broker_transport", current, f"celery-dedup needs {wanted!r} to gate a {scheme}:// broker"
            )
        app.conf.broker_transport = wanted
        same_server = config.redis_url is None or config.redis_url == broker
        runtime.atomic = same_server
        if not same_server:
            logger.warning(
                "dedup_redis_url differs from the broker URL: keys and messages live apart, so the gate is "
                "not atomic (hold, publish, drop-on-failure); see the guarantees doc"
            )
    else:
        logger.warning(
            "broker %s:// is not Redis: the gate is not atomic (hold, publish, drop-on-failure); "
            "see the guarantees doc",
            scheme,
        )
    setattr(app, _ATTR, runtime)
    return runtime


def runtime_for(app: Any) -> Runtime:
    """The app's state; settings are read (not installed) if ``install`` was not called yet."""
    runtime: Runtime | None = getattr(app, _ATTR, None)
    if runtime is None:
        runtime = Runtime(app, DedupConfig.from_conf(app.conf), installed=False)
        setattr(app, _ATTR, runtime)
    return runtime


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
    runtime_for(app).fail_open[task_name] += 1
