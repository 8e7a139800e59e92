"""The Lua scripts: read from the package's ``lua`` folder, registered with a client."""

from __future__ import annotations

import os
from collections.abc import Sequence
from importlib import resources
from typing import Any

import redis
from redis.commands.core import Script

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
        self.step_begin: Script = client.register_script(load_script("step_begin"))
        self.step_end: Script = client.register_script(load_script("step_end"))
        self.step_renew: Script = client.register_script(load_script("step_renew"))
        self._by_type: dict[type[Any], tuple[Script, bool]] = {
            command: (getattr(self, spec.name), spec.rest) for command, spec in BY_TYPE.items()
        }

    def run(self, keys: Sequence[Any], command: tuple[Any, ...], *, client: Any = None) -> Any:
        """Run ``command`` (a type of :mod:`.commands`) on ``keys``: one round trip, the script's raw reply."""
        script, rest = self._by_type[type(command)]
        return script(keys, (*command[:-1], *command[-1]) if rest else command, client=client)
