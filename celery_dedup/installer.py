"""``celery_dedup.install``: validate an app's settings, gate its broker and its publishes by name, wire the worker.

The only place anything is connected or substituted, and for the app given
only: its AMQP class (gated sender and connections), its loader's name for
Celery's Redis result backend, its worker's bootsteps; the signal receivers it
connects act only for installed apps. The state it builds is kept on the app
and read through :mod:`.runtime`.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import redis
from redis.cluster import RedisCluster

from .config import DedupConfig
from .exceptions import DedupConfigError
from .publish import sender
from .runtime import _ATTR, TRANSPORTS, Runtime, _broker_url, _scheme, separate_store
from .store.connection import client_from_url, cluster_seeds, masked_options, masked_url
from .task import check_bound_tasks
from .worker import bootsteps, results, signals

logger = logging.getLogger("celery_dedup")


def install(app: Any) -> None:
    """Set ``app`` up for DedupTask: validate settings, gate the broker, connect hooks.

    Call once, after the app's configuration is loaded and before it connects
    to the broker. Raises :class:`DedupConfigError` for a bad setting.
    """
    install_runtime(app)
    check_bound_tasks(app)
    sender.gate_send_task(app)
    results.use_for(app)
    signals.connect()
    app.steps["worker"].add(bootsteps.ReaperStep)
    app.steps["worker"].add(bootsteps.DispatchStep)


def _check_store(app: Any, config: DedupConfig) -> None:
    """Refuse a separate store's URL and options its client could not be made of (a Sentinel URL
    without ``master_name``, say), and ``dedup_redis_options`` that would be ignored."""
    url = separate_store(app, config)
    if url is None:
        if not config.redis_options:
            return
        raise DedupConfigError(
            "dedup_redis_options",
            masked_options(config.redis_options),
            "applies only to a dedup_redis_url apart from the broker: the store on the broker connects "
            "as the broker does (broker_use_ssl, broker_transport_options)",
        )
    try:
        if cluster_seeds(url) is not None:  # a cluster client connects as it is made: check the names only
            _check_cluster_options(config.redis_options)
        else:  # builds a connection object, which checks the URL and every keyword, without connecting
            client_from_url(url, config.redis_options).connection_pool.make_connection()
    except (TypeError, ValueError, redis.RedisError) as exc:
        setting, value = (
            ("dedup_redis_options", masked_options(config.redis_options))
            if config.redis_options
            else ("dedup_redis_url", masked_url(url))
        )
        raise DedupConfigError(setting, value, f"refused by redis-py: {exc}") from exc


def _check_cluster_options(options: dict[str, Any]) -> None:
    """Refuse an option neither redis-py's cluster client nor its connections take."""
    known: set[str] = set()
    for accepts in (RedisCluster.__init__, redis.connection.AbstractConnection.__init__, redis.SSLConnection.__init__):
        known.update(inspect.signature(accepts).parameters)
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {', '.join(unknown)}")


def install_runtime(app: Any) -> Runtime:
    """Validate settings, check the broker's transport, and keep the state on ``app``."""
    config = DedupConfig.from_conf(app.conf)
    if app.conf.task_protocol == 1:
        raise DedupConfigError("task_protocol", 1, "celery-dedup needs task message protocol 2 (the default)")
    _check_store(app, config)
    runtime = Runtime(app, config, installed=True)
    broker = _broker_url(app)
    scheme = _scheme(broker)
    if scheme in TRANSPORTS:
        current = app.conf.broker_transport
        if current not in (None, scheme, TRANSPORTS[scheme]):
            raise DedupConfigError(
                "broker_transport", current, f"celery-dedup gates a {scheme}:// broker with {TRANSPORTS[scheme]!r}"
            )
        _replace_connections(app)
        runtime.atomic = separate_store(app, config) is None
        if not runtime.atomic:
            logger.warning(
                "dedup_redis_url is not the broker's database: keys and messages live apart, so the gate has "
                "two phases (hold with a %gs lease, publish, confirm); see the guarantees doc",
                config.publish_lease,
            )
    else:
        if config.redis_url is None:
            raise DedupConfigError(
                "dedup_redis_url",
                None,
                f"the broker {scheme}:// is not Redis: set dedup_redis_url to the Redis server that keeps the keys",
            )
        logger.warning(
            "broker %s:// is not Redis: the gate has two phases (hold with a %gs lease, publish, confirm); "
            "see the guarantees doc",
            scheme,
            config.publish_lease,
        )
        if scheme in AMQP_SCHEMES:
            _confirm_publishes(app)
    setattr(app, _ATTR, runtime)
    return runtime


#: Schemes of kombu's py-amqp transport, which takes ``confirm_publish``.
AMQP_SCHEMES = frozenset({"amqp", "amqps", "pyamqp"})


def _confirm_publishes(app: Any) -> None:
    """Turn on RabbitMQ publisher confirms unless the app chose otherwise.

    The two-phase gate gives a key its full hold once the publish returns;
    with confirms that means the broker has the message, so a message the
    broker dropped leaves its key held only for the publish lease.
    """
    options = dict(app.conf.broker_transport_options or {})
    if "confirm_publish" not in options:
        app.conf.broker_transport_options = {**options, "confirm_publish": True}
        _replace_connections(app)
    elif not options["confirm_publish"]:
        logger.warning(
            "broker_transport_options confirm_publish is off: a keyed message the broker drops keeps its key "
            "held for its whole dedup_ttl; see the guarantees doc"
        )


def _replace_connections(app: Any) -> None:
    """Drop the app's broker connection pool: made before ``install``, its connections publish ungated.

    Celery opens a new pool on demand, of the gated connections (or with the
    new transport options); kombu's registry keys those apart, so whoever
    else uses the old pool keeps it as it was.
    """
    app._pool = None
