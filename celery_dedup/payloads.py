"""What a status record keeps of a call or a result: its payload, serialized as Celery would send it.

A debounced run's arguments, a failed run's arguments to re-enqueue, and a
run's return value for its followers are kept this way, and read back with
the app's accepted content types only.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

from kombu import serialization
from kombu.utils.json import dumps, loads


def message_payload(message: Mapping[str, Any]) -> str:
    """A published kombu message's body as a status record keeps it (debounce: the run's arguments)."""
    properties = message.get("properties") or {}
    return str(
        dumps(
            [
                message["body"],
                properties.get("body_encoding"),
                message.get("content-type"),
                message.get("content-encoding"),
            ]
        )
    )


def _encoded(value: Any, serializer: str) -> str:
    """``value`` serialized, as the JSON ``[base64 body, "base64", content type, content encoding]``."""
    content_type, content_encoding, data = serialization.dumps(value, serializer=serializer)
    raw = data if isinstance(data, bytes) else data.encode(content_encoding or "utf-8")
    return str(dumps([base64.b64encode(raw).decode("ascii"), "base64", content_type, content_encoding]))


def _decoded(payload: str, accept_content: Any) -> Any:
    """The value of a payload kept by :func:`_encoded` or :func:`message_payload`, if its type is accepted."""
    body, body_encoding, content_type, content_encoding = loads(payload)
    data = base64.b64decode(body) if body_encoding == "base64" else body
    accept = serialization.prepare_accept_content(accept_content)
    return serialization.loads(data, content_type, content_encoding, accept=accept)


def call_payload(app: Any, serializer: str | None, args: Any, kwargs: Any) -> str:
    """The payload of a call, serialized as its message body would be, to re-enqueue it later."""
    return _encoded([list(args or ()), dict(kwargs or {}), {}], serializer or app.conf.task_serializer)


def decode_payload(app: Any, payload: str) -> tuple[list[Any], dict[str, Any]]:
    """``(args, kwargs)`` of a payload kept by :func:`message_payload` or :func:`call_payload`.

    Only content types the app accepts (``accept_content``) are decoded.
    """
    decoded = _decoded(payload, app.conf.accept_content)
    if isinstance(decoded, Mapping):  # task message protocol 1
        return list(decoded.get("args") or ()), dict(decoded.get("kwargs") or {})
    return list(decoded[0]), dict(decoded[1])


def result_payload(app: Any, value: Any) -> str:
    """A run's return value serialized as its result would be (``result_serializer``), for its followers."""
    return _encoded(value, app.conf.result_serializer)


def decode_result(app: Any, payload: str) -> Any:
    """The return value kept by :func:`result_payload` (``result_accept_content``, else ``accept_content``)."""
    return _decoded(payload, app.conf.result_accept_content or app.conf.accept_content)


def step_payload(app: Any, serializer: str | None, value: Any) -> str:
    """A step's return value serialized as its task's messages are (``serializer``, else ``task_serializer``)."""
    return _encoded(value, serializer or app.conf.task_serializer)


def decode_step(app: Any, payload: str) -> Any:
    """The return value kept by :func:`step_payload` (the app's ``accept_content`` only)."""
    return _decoded(payload, app.conf.accept_content)
