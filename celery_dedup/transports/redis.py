"""kombu Redis transports whose publish runs the gate.

``celery_dedup.install`` gives the app connections (:class:`Connection`) that
resolve ``redis://``, ``rediss://`` and ``sentinel://`` to these, while
``broker_url`` and kombu's own alias table stay as they are. Messages without
a ``dedup`` header are published exactly as kombu does; gated ones go through
one Lua script that holds the key and LPUSHes the message together.
"""

from __future__ import annotations

import logging
import threading
from functools import cached_property
from typing import Any

import kombu
import redis
from kombu import connection as kombu_connection
from kombu.transport import redis as kombu_redis
from kombu.utils.json import dumps

from ..exceptions import DedupRoutingError
from ..header import GateHeader
from ..payloads import message_payload
from ..publish.ticket import report
from ..store.scripts import Scripts
from ..store.store import DedupStore, GateCall

logger = logging.getLogger("celery_dedup")


#: Delivery tags a closing channel could not put back on their queues (its server did not answer), by
#: server and unacknowledged hash. kombu would leave them there until ``visibility_timeout`` (an hour by
#: default); the next channel this process opens to that server puts them back (see :class:`RestoringQoS`).
_UNRESTORED: dict[tuple[Any, ...], set[str]] = {}
_UNRESTORED_LOCK = threading.Lock()


def _server_of(params: dict[str, Any]) -> tuple[Any, ...]:
    """Which server (and database) connection parameters reach: the key of :data:`_UNRESTORED`."""
    return tuple(params.get(name) for name in ("host", "port", "path", "db", "virtual_host", "service_name"))


class RestoringQoS(kombu_redis.QoS):
    """kombu's Redis QoS, whose messages a broker restart does not strand until the visibility timeout.

    A worker that loses its broker closes the connection, and each channel
    puts its unacknowledged messages (prefetched, or running with
    ``acks_late``) back as it closes. With the server down that fails, and
    kombu leaves them in its unacknowledged hash until ``visibility_timeout``
    has passed: an hour by default, however soon the server is back. Their
    tags are kept instead, and the channel Celery opens once it reconnects
    puts them back then (``restore_by_tag``: a transaction, so a message
    another worker's visibility restore took is not put back twice).
    """

    channel: Any

    def restore_unacked(self, client: Any = None) -> None:
        try:
            super().restore_unacked(client)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            delivered: dict[str, Any] = self._delivered or {}
            tags = set(delivered)
            delivered.clear()
            key = (_server_of(self.channel._connparams()), self.channel.unacked_key)
            with _UNRESTORED_LOCK:
                _UNRESTORED.setdefault(key, set()).update(tags)
            logger.warning(
                "could not put back %d unacknowledged message(s) (%s); they go back as this process reconnects",
                len(tags),
                exc,
            )


class GatedChannelMixin:
    """Overrides ``basic_publish``: the single entry point of every publish.

    The gate is not put in ``_put`` because kombu's restore path also calls
    ``_put`` to re-queue a message, which must never be gated again.
    """

    # Provided by kombu's redis Channel.
    pool: redis.ConnectionPool
    global_keyprefix: str
    priority_steps: list[int]
    unacked_key: str
    connection: Any  # the channel's transport

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # kombu's channel: connects, or raises
        self._put_back_unrestored()

    def _put_back_unrestored(self) -> None:
        """Put back what a closed channel to this server could not (:class:`RestoringQoS`); a failure waits."""
        key = (_server_of(self._connparams()), self.unacked_key)
        with _UNRESTORED_LOCK:
            tags = _UNRESTORED.pop(key, set())
        if not tags:
            return
        qos: Any = self.qos  # type: ignore[attr-defined]
        left = set(tags)
        try:
            for tag in tags:
                qos.restore_by_tag(tag)  # to the head of its queue, as kombu's restore at close
                left.discard(tag)
        except redis.RedisError:
            with _UNRESTORED_LOCK:
                _UNRESTORED.setdefault(key, set()).update(left)
            return
        logger.warning("put back %d unacknowledged message(s) a lost connection had left behind", len(tags))

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        """kombu's connection parameters, remembered: a channel closing after its connection let go still has them.

        A worker that loses its broker closes the connection, and each channel
        puts its unacknowledged messages back as it closes. With the server
        down the first try fails; by the next, kombu's connection has let go
        of its transport (``transport.client`` is None), where kombu reads the
        server's address: the worker died of an ``AttributeError``. With the
        address kept, the messages go back once the server answers; while it
        is still down, :class:`RestoringQoS` keeps them for the next channel.
        """
        kept: dict[bool, dict[str, Any]] = self.__dict__.setdefault("_dedup_connparams", {})
        if self.connection.client is None and asynchronous in kept:
            return dict(kept[asynchronous])
        params: dict[str, Any] = super()._connparams(asynchronous)  # type: ignore[misc]
        kept[asynchronous] = dict(params)
        return params

    @cached_property
    def _dedup_client(self) -> redis.Redis:
        # A plain client: kombu's prefixing client would prefix only the first
        # EVALSHA key, so the gate prefixes queue keys itself.
        return redis.Redis(connection_pool=self.pool)

    @cached_property
    def _dedup_scripts(self) -> Scripts:
        return Scripts(self._dedup_client)

    def dedup_store(self, prefix: str, history_length: int) -> DedupStore:
        """The dedup store for messages of ``prefix``, on this channel's connection pool."""
        stores: dict[tuple[str, int], DedupStore] = self.__dict__.setdefault("_dedup_stores", {})
        key = (prefix, history_length)
        if key not in stores:
            stores[key] = DedupStore(self._dedup_client, prefix, self._dedup_scripts, history_length=history_length)
        stores[key].check_format()  # once per store: a newer format is refused before its first gate
        return stores[key]

    def basic_publish(self, message: dict[str, Any], exchange: str, routing_key: str, **kwargs: Any) -> Any:
        gate = GateHeader.decode(message.get("headers"))
        if gate is None or gate.held:  # not keyed, or gated already by a store apart from this broker
            return super().basic_publish(message, exchange, routing_key, **kwargs)  # type: ignore[misc]
        if kwargs.get("_publish_batch") is not None:
            raise DedupRoutingError(
                str(message["headers"].get("task")),
                gate.member,
                "Producer.batch cannot gate messages; use apply_async or apply_async_many",
            )
        store, call = self.gate_call(message, exchange, routing_key, gate)
        report(gate.nonce, store.run_gate(call))
        return None

    def gate_call(
        self, message: dict[str, Any], exchange: str, routing_key: str, gate: GateHeader
    ) -> tuple[DedupStore, GateCall]:
        """Finish ``message`` as kombu would publish it, and prepare the gate script that pushes it."""
        headers = message["headers"]
        task_name = str(headers.get("task"))
        self._inplace_augment_message(message, exchange, routing_key)  # type: ignore[attr-defined]
        queue = self._single_queue(task_name, gate, exchange, routing_key)
        priority = self._get_message_priority(message, reverse=False)  # type: ignore[attr-defined]
        prefix = self.global_keyprefix
        expire: list[str] = []
        expires_ms = None
        # The Redis transport honours x-expires since kombu 5.7: older channels have no such table.
        queue_expires: dict[str, int] = getattr(self, "_expires", None) or {}
        if queue in queue_expires:
            expire = [prefix + self._q_for_pri(queue, p) for p in self.priority_steps]  # type: ignore[attr-defined]
            expires_ms = queue_expires[queue]
        store = self.dedup_store(gate.prefix, gate.history)
        # A debounced run executes with its burst's newest payload, so it is kept
        # whatever dedup_record_args says; with it off, the run deletes it as it
        # starts (start.lua). Other records get a payload only when their run
        # fails (re-enqueue): a long value here would turn every queued record
        # from a listpack into a hash table.
        keep_payload = gate.debounce and gate.latest
        call = store.gate_call(
            gate.member,
            str(headers["id"]),
            gate.nonce,
            hold_ms=gate.hold_ms,
            grace_ms=gate.grace_ms,
            argsrepr=str(headers.get("argsrepr") or "") if gate.record_args else "",
            kwargsrepr=str(headers.get("kwargsrepr") or "") if gate.record_args else "",
            queue=prefix + self._q_for_pri(queue, priority),  # type: ignore[attr-defined]
            message=dumps(message),
            expire=expire,
            expires_ms=expires_ms,
            delivery_tag=str(message["properties"]["delivery_tag"]),
            unacked_key=prefix + self.unacked_key,
            payload=message_payload(message) if keep_payload else "",
            debounce=(gate.window_ms, gate.max_wait_ms, gate.latest) if gate.debounce else None,
            continues=gate.continues,
            defers=gate.defers,
            follow=gate.follow,
            fingerprint=gate.fingerprint,
        )
        return store, call

    def _single_queue(self, task_name: str, gate: GateHeader, exchange: str, routing_key: str) -> str:
        if not exchange:
            return routing_key or self.deadletter_queue  # type: ignore[attr-defined]
        exchange_type = self.typeof(exchange)  # type: ignore[attr-defined]
        if exchange_type.type == "fanout":
            raise DedupRoutingError(task_name, gate.member, f"exchange {exchange!r} is fanout: one key, many queues")
        queues = [q for q in self._lookup(exchange, routing_key) if q]  # type: ignore[attr-defined]
        if len(queues) != 1:
            raise DedupRoutingError(
                task_name,
                gate.member,
                f"exchange {exchange!r} routes {routing_key!r} to {len(queues)} queues {queues}; "
                "a keyed task must go to exactly one queue",
            )
        return str(queues[0])


class Channel(GatedChannelMixin, kombu_redis.Channel):
    """kombu's Redis channel with the gate."""

    QoS = RestoringQoS


class Transport(kombu_redis.Transport):
    """kombu's Redis transport with the gate (``broker_url="redis://..."``)."""

    Channel = Channel


class SentinelChannel(GatedChannelMixin, kombu_redis.SentinelChannel):
    """kombu's Sentinel channel with the gate."""

    QoS = RestoringQoS


class SentinelTransport(kombu_redis.SentinelTransport):
    """kombu's Sentinel transport with the gate (``broker_url="sentinel://..."``)."""

    Channel = SentinelChannel


#: URL scheme -> its gated transport.
GATED: dict[str, type[kombu_redis.Transport]] = {
    "redis": Transport,
    "rediss": Transport,
    "sentinel": SentinelTransport,
}


class Connection(kombu.Connection):
    """kombu's connection, with the Redis schemes resolved to the gated transports: an installed app's connections.

    Per connection, not through kombu's process-wide alias table, so other
    apps keep kombu's transports. ``transport_cls`` stays the scheme's name:
    kombu's URLs and its ``rediss`` TLS default key on it, and a failover
    switch to another broker URL sets it to that URL's scheme, resolved here
    again.
    """

    def get_transport_cls(self) -> Any:
        name = self.transport_cls
        gated = GATED.get(name) if isinstance(name, str) else None
        return gated if gated is not None else super().get_transport_cls()

    def __eqhash__(self) -> Any:
        # kombu keeps one pool per equal connection for the whole process: gated ones apart from plain ones.
        return (__name__, super().__eqhash__())

    def Pool(self, limit: int | None = None, **kwargs: Any) -> ConnectionPool:
        """A pool of gated connections like this one."""
        return ConnectionPool(self, limit=limit, **kwargs)


class PooledConnection(Connection, kombu_connection.PooledConnection):
    """kombu's pooled connection, gated."""


class ConnectionPool(kombu_connection.ConnectionPool):
    """kombu's pool of connections, of gated ones."""

    def new(self) -> PooledConnection:
        # As kombu's own pool makes its connections (celery-types has no PooledConnection.__init__).
        return PooledConnection(self, **dict(self.connection._info(resolve=False)))  # type: ignore[arg-type]
