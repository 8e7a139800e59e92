"""The Lua scripts: read from the package's ``lua`` folder, registered with a client.

A script is run (:meth:`Scripts.run`: one round trip) or sent (:meth:`Scripts.send`:
written at once, its reply read later). A thread that sent one reads its
reply before it runs or sends anything else, so the store sees this
thread's calls in the order they were made; :func:`read_sent` reads them
where nothing else comes first (the end of a task's trace).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

from .commands import BY_TYPE, argv_prelude
from .schema import CHECK_VARIABLE, lua_prelude

#: Scripts that change status records (and the steps') get the schema's constants and the shared helpers of
#: ``lib.lua`` first.
_WITH_LIB = frozenset(
    {
        "gate",
        "confirm",
        "start",
        "takeover",
        "finish",
        "reap",
        "dispatch",
        "peek",
        "release",
        "purge",
        "settle",
        "annotate",
        "limit_note",
        "step_begin",
        "step_end",
        "step_renew",
    }
)


def _read(name: str) -> str:
    return resources.files("celery_dedup.store").joinpath("lua").joinpath(f"{name}.lua").read_text(encoding="utf-8")


def with_lib(name: str, body: str, *, check: bool) -> str:
    """``body`` after the schema's prelude for script ``name`` and ``lib.lua``."""
    return lua_prelude(name, check=check) + _read("lib") + body


def load_script(name: str) -> str:
    """The source of ``lua/<name>.lua`` as it is sent to Redis: its ARGV as named locals first.

    With :data:`~.schema.CHECK_VARIABLE` set to ``1``, scripts report each transition they make.
    """
    body = argv_prelude(name) + _read(name)
    if name in _WITH_LIB:
        return with_lib(name, body, check=os.environ.get(CHECK_VARIABLE) == "1")
    return body


class Scripts:
    """Every Lua script, registered once with one client; run them with ``client=``."""

    def __init__(self, client: redis.Redis) -> None:
        self.gate: Script = client.register_script(load_script("gate"))
        self.confirm: Script = client.register_script(load_script("confirm"))
        self.start: Script = client.register_script(load_script("start"))
        self.takeover: Script = client.register_script(load_script("takeover"))
        self.finish: Script = client.register_script(load_script("finish"))
        self.renew: Script = client.register_script(load_script("renew"))
        self.reap: Script = client.register_script(load_script("reap"))
        self.dispatch: Script = client.register_script(load_script("dispatch"))
        self.peek: Script = client.register_script(load_script("peek"))
        self.release: Script = client.register_script(load_script("release"))
        self.purge: Script = client.register_script(load_script("purge"))
        self.settle: Script = client.register_script(load_script("settle"))
        self.annotate: Script = client.register_script(load_script("annotate"))
        self.records: Script = client.register_script(load_script("records"))
        self.replacing: Script = client.register_script(load_script("replacing"))
        self.limit_acquire: Script = client.register_script(load_script("limit_acquire"))
        self.limit_release: Script = client.register_script(load_script("limit_release"))
        self.limit_renew: Script = client.register_script(load_script("limit_renew"))
        self.limit_note: Script = client.register_script(load_script("limit_note"))
        self.limit_backoff: Script = client.register_script(load_script("limit_backoff"))
        self.step_begin: Script = client.register_script(load_script("step_begin"))
        self.step_end: Script = client.register_script(load_script("step_end"))
        self.step_renew: Script = client.register_script(load_script("step_renew"))
        self._by_type: dict[type[Any], tuple[Script, bool]] = {
            command: (getattr(self, spec.name), spec.rest) for command, spec in BY_TYPE.items()
        }

    def _script(self, command: tuple[Any, ...]) -> tuple[Script, tuple[Any, ...]]:
        script, rest = self._by_type[type(command)]
        return script, (*command[:-1], *command[-1]) if rest else command

    def run(self, keys: Sequence[Any], command: tuple[Any, ...], *, client: Any = None) -> Any:
        """Run ``command`` (a type of :mod:`.commands`) on ``keys``: one round trip, the script's raw reply.

        The replies of what this thread sent before are read first (:meth:`send`).
        """
        if _sent.replies:
            read_sent()
        script, args = self._script(command)
        return script(keys, args, client=client)

    def send(self, keys: Sequence[Any], command: tuple[Any, ...], then: Reply, *, client: redis.Redis) -> None:
        """Write ``command`` to the server now; ``then`` gets its raw reply (or the error) once it is read.

        The reply is read before this thread's next :meth:`run` or :meth:`send`,
        or by :func:`read_sent`, on a connection of its own meanwhile. ``then``
        gets a ``redis.RedisError`` where the command may not have run (the
        connection failed, the server refused it): a command sent must be
        safe to run again.
        """
        if _sent.replies:
            read_sent()
        script, args = self._script(command)
        pool = client.connection_pool
        try:
            connection: Any = pool.get_connection()
        except redis.RedisError as exc:
            then(exc)
            return
        # A reply nobody reads must not be NOSCRIPT: a script this socket has not seen loaded goes with it.
        loaded = _loaded_on(connection)
        commands: list[tuple[Any, ...]] = [] if script.sha in loaded else [("SCRIPT", "LOAD", script.script)]
        commands.append(("EVALSHA", script.sha, len(keys), *keys, *args))
        try:
            connection.send_packed_command(connection.pack_commands(commands))
        except redis.RedisError as exc:  # the connection broke: it may have run, ``then`` decides
            pool.release(connection)
            then(exc)
            return
        except BaseException:
            connection.disconnect()
            pool.release(connection)
            raise
        loaded.add(script.sha)
        _sent.replies.append(_Sent(script, keys, args, client, connection, then, len(commands) - 1))


#: What a sent script's reply is handed to: the raw reply, or the error that took its place.
Reply = Callable[[Any], None]


class _Sent:
    """A script written to ``connection`` whose reply is not read yet."""

    __slots__ = ("args", "client", "connection", "keys", "loads", "script", "then")

    def __init__(
        self,
        script: Script,
        keys: Sequence[Any],
        args: tuple[Any, ...],
        client: redis.Redis,
        connection: Any,
        then: Reply,
        loads: int,
    ) -> None:
        self.script, self.keys, self.args = script, keys, args
        self.client, self.connection, self.then = client, connection, then
        #: Replies of ``SCRIPT LOAD`` sent before the script (0 or 1).
        self.loads = loads

    def read(self) -> None:
        """Read the reply and hand it on; a script the server no longer knows is run again, loaded."""
        pool = self.client.connection_pool
        reply: Any = None
        try:
            for _ in range(self.loads + 1):  # every reply is read, or the connection is not reused
                try:
                    reply = self.connection.read_response()
                except redis.ResponseError as exc:
                    reply = exc
        except redis.RedisError as exc:  # the connection failed (redis-py disconnected it)
            reply = exc
        except BaseException:
            self.connection.disconnect()
            pool.release(self.connection)
            raise
        if isinstance(reply, NoScriptError):  # the server ran nothing (flushed meanwhile): run it the usual way
            _loaded_on(self.connection).discard(self.script.sha)
            pool.release(self.connection)
            try:
                reply = self.script(self.keys, self.args, client=self.client)
            except redis.RedisError as exc:
                reply = exc
            self.then(reply)
            return
        pool.release(self.connection)
        self.then(reply)


#: The scripts each open socket has had loaded: a new socket (a reconnect, maybe to a restarted server) has none.
_loaded: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


def _loaded_on(connection: Any) -> set[str]:
    sock = getattr(connection, "_sock", None)
    if sock is None:
        return set()
    try:
        return _loaded.setdefault(sock, set())
    except TypeError:  # a socket that takes no weak reference: load every time
        return set()


class _Replies(threading.local):
    """The scripts this thread (or greenlet: the pools patch ``threading.local``) sent and has not read."""

    def __init__(self) -> None:
        self.replies: list[_Sent] = []


_sent = _Replies()


def read_sent() -> None:
    """Read the replies of every script this thread sent (:meth:`Scripts.send`), oldest first."""
    replies = _sent.replies
    while replies:
        replies.pop(0).read()
