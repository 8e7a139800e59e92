"""The exception hierarchy: everything celery-dedup raises derives from DedupError."""

from __future__ import annotations

from typing import Any


class DedupError(Exception):
    """Root of every error raised by celery-dedup."""


class DedupConfigError(DedupError):
    """A setting or task option has a value celery-dedup cannot work with.

    Raised at install or task registration, so misconfiguration fails at
    start-up instead of at the first publish.
    """

    def __init__(self, setting: str, value: Any, reason: str, *, task: str | None = None) -> None:
        self.setting = setting
        self.value = value
        self.reason = reason
        self.task = task
        where = f"task {task!r}: " if task else ""
        super().__init__(f"{where}{setting}={value!r}: {reason}")


class DedupKeyError(DedupError):
    """A business key could not be derived from a call's arguments."""

    def __init__(self, task: str, argument: str | None, value: Any, reason: str) -> None:
        self.task = task
        self.argument = argument
        self.value = value
        self.reason = reason
        shown = _short_repr(value)
        arg = f" argument {argument!r}" if argument else ""
        super().__init__(f"task {task!r}{arg} (value {shown}): {reason}")


class DuplicateTaskError(DedupError):
    """A call was a duplicate of an accepted task (``dedup_on_duplicate="raise"``)."""

    def __init__(self, task: str, key: str, task_id: str) -> None:
        self.task = task
        self.key = key
        self.task_id = task_id
        super().__init__(f"task {task!r} key {key!r} is already accepted as task id {task_id!r}")


class DedupUnavailableError(DedupError):
    """The dedup store (on a Redis broker: the broker) could not be reached.

    ``published`` is False when nothing was published, None when the
    connection broke at a point where that cannot be known (the key's record
    tells once the server answers again).
    """

    def __init__(self, task: str, key: str, cause: BaseException, *, published: bool | None) -> None:
        self.task = task
        self.key = key
        self.cause = cause
        self.published = published
        outcome = "nothing was published" if published is False else "whether it was published is unknown"
        super().__init__(
            f"task {task!r} key {key!r}: dedup store unreachable ({type(cause).__name__}: {cause}); {outcome}"
        )


class DedupRoutingError(DedupError):
    """A keyed task was routed in a way the gate cannot make atomic.

    For example to several queues at once, to a fanout exchange, or through
    ``Producer.batch``.
    """

    def __init__(self, task: str, key: str, reason: str) -> None:
        self.task = task
        self.key = key
        self.reason = reason
        super().__init__(f"task {task!r} key {key!r}: {reason}")


class DedupOperationError(DedupError):
    """An operator's action on a key (release, purge, re-enqueue) cannot be done."""

    def __init__(self, operation: str, target: str, reason: str) -> None:
        self.operation = operation
        self.target = target
        self.reason = reason
        super().__init__(f"{operation} {target!r}: {reason}")


class DedupArgumentError(DedupError, ValueError):
    """A function of celery-dedup was called with an argument it cannot take (``records(limit=0)``).

    A ``ValueError`` too, so code that catches bad values keeps working.
    """

    def __init__(self, parameter: str, value: Any, reason: str) -> None:
        self.parameter = parameter
        self.value = value
        self.reason = reason
        super().__init__(f"{parameter}={_short_repr(value)}: {reason}")


def _short_repr(value: Any, limit: int = 80) -> str:
    try:
        text = repr(value)
    except Exception as exc:  # a hostile __repr__ must not hide the real error
        text = f"<{type(value).__name__} with failing repr: {exc!r}>"
    return text if len(text) <= limit else f"{text[: limit - 3]}..."
