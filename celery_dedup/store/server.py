"""What the store's server says about itself: its settings that matter to the guarantees, and its clock.

Read for ``celery dedup check`` (``ops/checks.py`` judges them); a managed
service may forbid CONFIG or TIME, which is a fact too, not an error.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import redis
from redis.cluster import RedisCluster

#: The settings read: eviction, memory limit and persistence.
SETTINGS = ("maxmemory-policy", "maxmemory", "save", "appendonly")


@dataclass(frozen=True)
class ServerFacts:
    """One server's (a cluster's: one primary's) settings and clock, or why they could not be read."""

    #: The node's name on a cluster, "" for a single server.
    node: str
    #: ``SETTINGS`` by name; empty when CONFIG GET was refused (``config_error`` says why).
    config: dict[str, str]
    config_error: str
    #: The server's clock minus this host's, seconds; None when TIME was refused (``clock_error``).
    clock_offset: float | None
    clock_error: str


def facts(client: redis.Redis) -> list[ServerFacts]:
    """The facts of the store's server, or of each primary of a cluster."""
    if isinstance(client, RedisCluster):
        return [_facts(node.redis_connection, node.name) for node in client.get_primaries()]
    return [_facts(client, "")]


def _facts(client: redis.Redis, node: str) -> ServerFacts:
    config: dict[str, str] = {}
    config_error = ""
    try:
        for name in SETTINGS:
            config[name] = _config_get(client, name)
    except redis.ResponseError as exc:  # CONFIG renamed or forbidden, as on managed services
        config, config_error = {}, str(exc)
    before = time.time()
    try:
        seconds, micros = client.time()
    except redis.ResponseError as exc:
        return ServerFacts(node, config, config_error, None, str(exc))
    after = time.time()
    return ServerFacts(node, config, config_error, seconds + micros / 1e6 - (before + after) / 2, "")


def _config_get(client: redis.Redis, name: str) -> str:
    reply: dict[Any, Any] = client.config_get(name)
    for field, value in reply.items():
        text = field.decode() if isinstance(field, bytes) else str(field)
        if text == name:
            return value.decode() if isinstance(value, bytes) else str(value)
    raise redis.ResponseError(f"CONFIG GET {name} returned nothing")
