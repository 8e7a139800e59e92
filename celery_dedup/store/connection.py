"""Clients of the store's server: from the broker's connection or a URL, and URLs masked for display."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, unquote, urlparse

import redis
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual as kombu_virtual
from kombu.utils.url import maybe_sanitize_url
from redis.cluster import ClusterNode, RedisCluster
from redis.sentinel import Sentinel

from ..exceptions import DedupConfigError


def broker_client(connection: Any) -> redis.Redis:
    """A client of the Redis broker that connects exactly as kombu's Redis transport does.

    ``connection`` is the app's ``connection_for_write()``. kombu's channel
    builds its connection pool from ``broker_use_ssl``, ``broker_transport_options``
    (timeouts, keepalive, health checks, Sentinel's ``master_name``...), the
    URL's credentials or ``broker_user``/``broker_password``, and a
    ``credential_provider``; the pool is built here by that same code, on a
    channel that is never connected, so the store cannot drift from the broker.

    Unlike kombu's per-channel pool (10 connections by default), the store's
    pool is shared by every thread of the process, so it is bounded only by an
    explicit ``max_connections`` transport option.
    """
    transport = connection.transport  # made without connecting
    channel_class = transport.Channel
    if not (isinstance(channel_class, type) and issubclass(channel_class, kombu_redis.Channel)):
        url = maybe_sanitize_url(connection.as_uri())
        raise DedupConfigError("dedup_redis_url", None, f"the broker {url} is not Redis: set dedup_redis_url")
    channel: Any = channel_class.__new__(channel_class)
    # The base class's __init__ only applies the transport options; kombu's
    # Redis channel would go on to connect and join the consumer's poller.
    kombu_virtual.Channel.__init__(channel, transport)
    if "max_connections" not in connection.transport_options:
        channel.max_connections = None
    pool = channel._get_pool()
    credential_provider = pool.connection_kwargs.get("credential_provider")
    if credential_provider is not None:  # as kombu's client is given it
        return redis.Redis(connection_pool=pool, credential_provider=credential_provider)
    return redis.Redis(connection_pool=pool)


def client_from_url(url: str, options: Mapping[str, Any] | None = None) -> redis.Redis:
    """A client of a dedup store apart from the broker (``dedup_redis_url``, ``dedup_redis_options``).

    ``url`` is ``redis://``, ``rediss://``, ``unix://``, ``sentinel://`` (several
    Sentinels joined by ``;``) or ``redis+cluster://`` (``rediss+cluster://``;
    seeds of a Redis Cluster, see :func:`cluster_client`). ``options`` are redis-py connection keywords
    (``ssl_ca_certs``, ``socket_timeout``, ``username``, ``credential_provider``...),
    over those of the URL's query string; a Sentinel URL also takes
    ``master_name`` (required) and ``sentinel_kwargs`` from them.
    """
    kwargs = dict(options or {})
    first = url.split(";", maxsplit=1)[0]
    if cluster_seeds(url) is not None:
        return cluster_client(url, kwargs)
    if not first.startswith("sentinel://"):
        return redis.Redis.from_url(first, **kwargs)
    master_name = kwargs.pop("master_name", None)
    sentinel_kwargs = kwargs.pop("sentinel_kwargs", None)
    sentinels, password, db = [], None, 0
    for part in url.split(";"):
        parsed = urlparse(part.strip())
        if parsed.hostname:
            sentinels.append((parsed.hostname, parsed.port or 26379))
        password = password or (unquote(parsed.password) if parsed.password else None)
        path = parsed.path.strip("/")
        db = int(path) if path.isdigit() else db
    if not master_name:
        raise DedupConfigError(
            "dedup_redis_options",
            masked_options(options),
            f"a sentinel:// dedup_redis_url ({masked_url(url)}) needs 'master_name' here: the Sentinels' name "
            "of the store's master",
        )
    kwargs.setdefault("db", db)
    if password is not None:
        kwargs.setdefault("password", password)
    sentinel = Sentinel(sentinels, sentinel_kwargs=sentinel_kwargs)  # type: ignore[no-untyped-call]
    client: redis.Redis = sentinel.master_for(master_name, **kwargs)  # type: ignore[no-untyped-call]
    return client


#: Schemes of a Redis Cluster store: ``redis+cluster://[user:password@]host:port[,host:port...][?options]``.
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")


def cluster_seeds(url: str) -> list[tuple[str, int]] | None:
    """The seed nodes of a ``redis+cluster://`` URL, or None for any other URL.

    Raises:
        DedupConfigError: a cluster URL without seeds, with a port that is no
            number, or naming a database other than 0 (a cluster has only 0).
    """
    scheme, _, rest = url.partition("://")
    if scheme.lower() not in CLUSTER_SCHEMES:
        return None
    location, _, _ = rest.partition("?")
    location, _, path = location.partition("/")
    hosts = location.rpartition("@")[2]
    seeds = []
    for host in hosts.split(","):
        name, _, port = host.strip().rpartition(":")
        if not name or not port.isdigit():
            raise DedupConfigError("dedup_redis_url", url, f"seed {host!r} is not host:port")
        seeds.append((name.strip("[]"), int(port)))
    if path.strip("/") not in ("", "0"):
        raise DedupConfigError("dedup_redis_url", url, "a Redis Cluster has database 0 only")
    return seeds


def cluster_client(url: str, options: Mapping[str, Any]) -> redis.Redis:
    """A Redis Cluster client from a ``redis+cluster://`` URL (:func:`cluster_seeds`) and redis-py options.

    The seeds are where discovery starts; the client follows the cluster's
    topology from there (MOVED, ASK, failovers) as redis-py's does. The
    URL's credentials and query string apply to every node; ``options``
    (``dedup_redis_options``) over them.
    """
    seeds = cluster_seeds(url) or []
    scheme, _, rest = url.partition("://")
    location, _, query = rest.partition("?")
    userinfo = location.partition("/")[0].rpartition("@")[0]
    kwargs: dict[str, Any] = dict(parse_qsl(query))
    for name in ("socket_timeout", "socket_connect_timeout"):
        if name in kwargs:
            kwargs[name] = float(kwargs[name])
    if userinfo:
        username, _, password = userinfo.partition(":")
        kwargs["username"], kwargs["password"] = unquote(username) or None, unquote(password) or None
    if scheme.lower().startswith("rediss"):
        kwargs["ssl"] = True
    kwargs.update(options)
    nodes = [ClusterNode(host, port) for host, port in seeds]  # type: ignore[no-untyped-call]
    return RedisCluster(startup_nodes=nodes, **kwargs)  # type: ignore[return-value]


def masked_url(url: str) -> str:
    """``url`` with its passwords masked, for logs, errors and pages (a cluster URL's, each of a ``;`` list's).

    A part that is not even a URL's shape shows its scheme only, in case the rest holds a password.
    """
    return ";".join(_masked_one(part.strip()) for part in url.split(";"))


def masked_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """redis-py options with their passwords masked, for errors and logs."""
    return {name: "**" if "password" in name.lower() else value for name, value in (options or {}).items()}


def _masked_one(url: str) -> str:
    try:
        return _masked_password(url)
    except (ValueError, DedupConfigError):
        return url.split("://", 1)[0] + "://..."


def _masked_password(url: str) -> str:
    if cluster_seeds(url) is None:
        return str(maybe_sanitize_url(url))
    scheme, _, rest = url.partition("://")
    userinfo, at, hosts = rest.rpartition("@")
    if at and ":" in userinfo:
        userinfo = userinfo.split(":", 1)[0] + ":**"
    return f"{scheme}://{userinfo}{at}{hosts}"
