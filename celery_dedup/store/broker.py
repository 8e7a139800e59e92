"""The broker's own structures the store touches: kombu's unacknowledged hash, for crash recovery.

Where the store is the Redis broker, a run whose whole worker died has its
message in kombu's unacknowledged hash until ``visibility_timeout``;
``worker/recovery.py`` decides that it may come back now, and this puts it
back as kombu's ``QoS.restore_by_tag`` would, in one transaction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis
from kombu.utils.json import dumps, loads

#: Where a kept message goes back to: ``route(message, exchange, routing_key)`` -> the lists to push it onto.
Route = Callable[[dict[str, Any], str, str], list[str]]


def restore_unacked(client: redis.Redis, unacked: str, index: str, tag: str, task_id: str, route: Route) -> bool:
    """Move the message kept under ``tag`` back onto its queue lists, marked redelivered; whether it moved.

    One transaction watching ``unacked``: out of the hash and its ``index``,
    pushed onto the lists ``route`` names. Nothing moves when the tag is no
    longer there (acknowledged, or restored already), when the kept message
    is not run ``task_id``'s, or when ``route`` names no list.
    """
    moved = False

    def move(pipe: Any) -> None:
        nonlocal moved
        moved = False
        kept = _kept(pipe.hget(unacked, tag))
        if kept is None or str(kept[0]["headers"].get("id")) != task_id:
            return
        message, exchange, routing_key = kept
        queues = route(message, exchange, routing_key)
        if not queues:
            return
        message["headers"]["redelivered"] = True
        delivery = message.get("properties", {}).get("delivery_info")
        if isinstance(delivery, dict):
            delivery["redelivered"] = True
        pipe.multi()
        pipe.zrem(index, tag)
        pipe.hdel(unacked, tag)
        for queue in queues:
            pipe.rpush(queue, dumps(message))
        moved = True

    client.transaction(move, unacked)
    return moved


def _kept(raw: bytes | str | None) -> tuple[dict[str, Any], str, str] | None:
    """What kombu keeps in its unacknowledged hash: ``[message, exchange, routing key]``."""
    if raw is None:
        return None
    try:
        message, exchange, routing_key = loads(raw)
    except (ValueError, TypeError):
        return None
    if not isinstance(message, dict) or not isinstance(message.get("headers"), dict):
        return None
    return message, str(exchange or ""), str(routing_key or "")
