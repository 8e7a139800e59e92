"""The only code that runs Lua or reads dedup state in Redis."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any
from urllib.parse import unquote, urlparse

import redis
from redis.commands.core import Script
from redis.sentinel import Sentinel

from .exceptions import DedupConfigError
from .gate import Outcome
from .keys import KeySchema


def load_script(name: str) -> str:
    """The source of ``scripts/<name>.lua`` shipped in the package."""
    return resources.files("celery_dedup").joinpath("scripts").joinpath(f"{name}.lua").read_text(encoding="utf-8")


class Scripts:
    """The gate's Lua scripts registered once with one client; run them with ``client=``."""

    def __init__(self, client: redis.Redis[bytes]) -> None:
        self.gate: Script = client.register_script(load_script("gate"))
        self.finish: Script = client.register_script(load_script("finish"))


def _text(value: Any) -> str:
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else str(value)


class DedupStore:
    """Dedup state for one key prefix on one Redis server.

    Every method takes an optional ``client`` so the broker transport can run
    the same scripts on its own connection pool.
    """

    def __init__(self, client: redis.Redis[bytes], prefix: str, scripts: Scripts | None = None) -> None:
        self.client = client
        self.schema = KeySchema(prefix)
        self.scripts = scripts or Scripts(client)

    def with_prefix(self, prefix: str) -> DedupStore:
        """The same server and scripts under another key prefix (a message's own)."""
        return self if prefix == self.schema.prefix else DedupStore(self.client, prefix, self.scripts)

    def gate(
        self,
        member: str,
        task_id: str,
        nonce: str,
        *,
        hold_ms: int,
        grace_ms: int,
        task_name: str,
        queue: str | None = None,
        message: str | None = None,
        expire: Sequence[str] = (),
        expires_ms: int | None = None,
        client: redis.Redis[bytes] | None = None,
    ) -> Outcome:
        """Hold ``member`` for ``task_id`` and push ``message`` onto ``queue``, or neither.

        Without a queue this only holds the key (the non-atomic fallback).
        """
        keys = [self.schema.held, self.schema.record(member)]
        args: list[Any] = [member, task_id, nonce, hold_ms, task_name, grace_ms]
        if queue is not None:
            keys += [queue, *expire]
            args += [message, "" if expires_ms is None else expires_ms]
        code, owner = self.scripts.gate(keys, args, client=client or self.client)
        return Outcome(accepted=int(code) != 0, task_id=_text(owner))

    def finish(
        self,
        member: str,
        task_id: str,
        state: str,
        *,
        drop: bool,
        record_ms: int,
        client: redis.Redis[bytes] | None = None,
    ) -> bool:
        """Record ``state`` for the run ``task_id``; drop its key if ``drop``. Owner only."""
        keys = [self.schema.held, self.schema.record(member)]
        args = [member, task_id, state, "1" if drop else "0", record_ms]
        return bool(self.scripts.finish(keys, args, client=client or self.client))

    def unclaim(self, member: str, task_id: str) -> bool:
        """Undo a hold whose message was never published (owner only)."""
        return self.finish(member, task_id, "", drop=True, record_ms=0)

    def record(self, member: str) -> dict[str, str] | None:
        """The member's status record, or None if there is none."""
        raw = self.client.hgetall(self.schema.record(member))
        return {_text(k): _text(v) for k, v in raw.items()} or None

    def is_held(self, member: str) -> bool:
        return bool(self.client.sismember(self.schema.held, member))


def client_from_url(url: str, transport_options: Mapping[str, Any] | None = None) -> redis.Redis[bytes]:
    """A redis-py client for a ``redis://``, ``rediss://``, ``unix://`` or ``sentinel://`` URL.

    Sentinel URLs take ``master_name`` (and optional ``sentinel_kwargs``) from
    the broker transport options, as kombu does.
    """
    options = dict(transport_options or {})
    first = url.split(";", maxsplit=1)[0]
    if not first.startswith("sentinel://"):
        return redis.Redis.from_url(first)
    sentinels, password, db = [], None, 0
    for part in url.split(";"):
        parsed = urlparse(part.strip())
        if parsed.hostname:
            sentinels.append((parsed.hostname, parsed.port or 26379))
        password = password or (unquote(parsed.password) if parsed.password else None)
        path = parsed.path.strip("/")
        db = int(path) if path.isdigit() else db
    master_name = options.get("master_name")
    if not master_name:
        raise DedupConfigError("broker_transport_options", options, "a sentinel:// URL needs 'master_name'")
    sentinel = Sentinel(sentinels, sentinel_kwargs=options.get("sentinel_kwargs"))
    client: redis.Redis[bytes] = sentinel.master_for(master_name, db=db, password=password)
    return client
