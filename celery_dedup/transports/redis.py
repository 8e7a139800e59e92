"""kombu Redis transports whose publish runs the gate.

``celery_dedup.install`` gives the app connections (:class:`Connection`) that
resolve ``redis://``, ``rediss://`` and ``sentinel://`` to these, while
``broker_url`` and kombu's own alias table stay as they are. Messages without
a ``dedup`` header are published exactly as kombu does; gated ones go through
one Lua script that holds the key and LPUSHes the message together.
"""

from __future__ import annotations

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


class Transport(kombu_redis.Transport):
    """kombu's Redis transport with the gate (``broker_url="redis://..."``)."""

    Channel = Channel


class SentinelChannel(GatedChannelMixin, kombu_redis.SentinelChannel):
    """kombu's Sentinel channel with the gate."""


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
