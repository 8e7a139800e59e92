"""The exception hierarchy: everything celery-dedup raises derives from DedupError."""

from __future__ import annotations

import pickle
from typing import Any

import redis
from kombu.exceptions import OperationalError
from redis.exceptions import RedisClusterException


class DedupError(Exception):
    """Root of every error raised by celery-dedup.

    Every one pickles with its message and attributes: a prefork pool child
    sends the errors of a task to the worker's main process that way (an
    attribute that cannot be pickled, such as an odd argument value, travels
    as its repr).
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.args, {name: _picklable(v) for name, v in vars(self).items()}))


def _rebuild(cls: type[DedupError], args: tuple[Any, ...], state: dict[str, Any]) -> DedupError:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    vars(error).update(state)
    return error


def _picklable(value: Any) -> Any:
    try:
        pickle.dumps(value)
    except Exception:  # any failure to pickle: the repr still says what it was
        return _short_repr(value)
    return value


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


class DedupArgumentsMismatch(DuplicateTaskError):
    """A duplicate call's arguments differ from those of the run it was answered with (``dedup_on_mismatch="raise"``).

    The call mapped to the key of accepted run ``task_id``, but its bound
    arguments' fingerprint (``fingerprint``) is not that run's
    (``accepted_fingerprint``): two different pieces of work share one key,
    and this call's work would not be done. Nothing was published for it;
    the mismatch is counted (``mismatched``) in the key's record and the
    stats. A :class:`DuplicateTaskError`, so code that catches duplicates
    catches it too.
    """

    def __init__(self, task: str, key: str, task_id: str, fingerprint: str, accepted_fingerprint: str) -> None:
        self.task = task
        self.key = key
        self.task_id = task_id
        self.fingerprint = fingerprint
        self.accepted_fingerprint = accepted_fingerprint
        # DuplicateTaskError's own message would hide the mismatch: its __init__ is passed over.
        DedupError.__init__(
            self,
            f"task {task!r} key {key!r} is already accepted as task id {task_id!r} with other arguments "
            f"(their fingerprint {accepted_fingerprint}, this call's {fingerprint})",
        )


class DedupFollowerError(DedupError):
    """The run a follower waited for did not succeed, so the follower fails with its ending.

    A follower is a duplicate call that carried something to continue (a
    group or chord member, callbacks, a chain): it resolves as the accepted
    run ``run_id`` ended; ``state`` is how (failed, revoked, lost, released,
    ...), ``reason`` its error or note.
    """

    def __init__(self, task: str, key: str, run_id: str, state: str, reason: str) -> None:
        self.task = task
        self.key = key
        self.run_id = run_id
        self.state = state
        self.reason = reason
        why = f": {reason}" if reason else ""
        super().__init__(f"task {task!r} key {key!r}: followed run {run_id!r}, which ended {state}{why}")


class DedupFollowerLimitError(DedupError):
    """A duplicate with something to continue found its run carrying ``dedup_max_followers`` followers already."""

    def __init__(self, task: str, key: str, run_id: str, limit: int) -> None:
        self.task = task
        self.key = key
        self.run_id = run_id
        self.limit = limit
        super().__init__(
            f"task {task!r} key {key!r}: run {run_id!r} has {limit} followers already (dedup_max_followers); "
            "nothing was published"
        )


class DedupStepError(DedupError):
    """A step (``DedupTask.dedup_once``) cannot be executed as asked.

    Called outside the body of a keyed task's delivery, with a name that is
    no step name, with a name this delivery used already for another step,
    with an unknown ``scope`` or ``on_doubt``, or with a function whose return
    value cannot be kept (not serializable, or larger than
    ``dedup_step_result_limit``).
    """

    def __init__(self, task: str, step: str, reason: str) -> None:
        self.task = task
        self.step = step
        self.reason = reason
        super().__init__(f"task {task!r} step {step!r}: {reason}")


class DedupStepInDoubt(DedupError):
    """A step's earlier executor died (or lost its lock) inside it: whether its work happened is unknown.

    Raised by ``dedup_once(..., on_doubt="raise")``, which leaves the step
    marked ``doubt`` for an operator: ask the provider what happened under
    ``idempotency_key``.
    """

    def __init__(self, task: str, key: str, run_id: str, step: str, idempotency_key: str, attempts: int) -> None:
        self.task = task
        self.key = key
        self.run_id = run_id
        self.step = step
        self.idempotency_key = idempotency_key
        self.attempts = attempts
        super().__init__(
            f"task {task!r} key {key!r} run {run_id!r}: step {step!r} is in doubt (its executor died or lost its "
            f"lock inside it, after {attempts} attempt{'s' if attempts != 1 else ''}); "
            f"settle it with idempotency key {idempotency_key!r}"
        )


class DedupLockLostError(DedupError):
    """The delivery executing a step lost its execution lock (it was paused past its TTL, or taken over).

    Another delivery of the run may be executing it now: this one stops.
    ``recorded`` says whether this delivery's ending of the step was recorded
    (nobody had taken the step over) or not (the other delivery executes the
    step itself, with the same ``idempotency_key``).
    """

    def __init__(
        self, task: str, key: str, run_id: str, step: str, idempotency_key: str, *, recorded: bool, why: str
    ) -> None:
        self.task = task
        self.key = key
        self.run_id = run_id
        self.step = step
        self.idempotency_key = idempotency_key
        self.recorded = recorded
        self.why = why
        super().__init__(f"task {task!r} key {key!r} run {run_id!r} step {step!r}: execution lock lost: {why}")


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


class DedupStoreError(DedupError):
    """The dedup store answered a command with an error reply.

    Out of memory (``OOM``), no permission (``NOPERM``), a key of the wrong
    type (``WRONGTYPE``), a read-only replica (``READONLY``)...: the server was
    reached, so this is never treated as unreachability (no ``fail_open``, no
    retry). ``reply`` is the server's reply, with its error code; ``cause`` the
    redis-py exception. ``published`` is False when the refused command
    published nothing, None when part of a batch may have been published.
    """

    def __init__(self, task: str, key: str, cause: BaseException, published: bool | None = False) -> None:
        self.task = task
        self.key = key
        self.cause = cause
        self.published = published
        self.reply = error_reply(cause)
        outcome = "; part of the batch may have been published" if published is None else ""
        super().__init__(f"task {task!r} key {key!r}: the dedup store refused the command: {self.reply}{outcome}")


#: Failures that mean the store could not be reached (or did not answer in
#: time); every other RedisError is an answer (see DedupStoreError).
UNREACHABLE: tuple[type[Exception], ...] = (redis.ConnectionError, redis.TimeoutError, OperationalError)

#: What a store command raises: redis-py's errors, and the refusals of its cluster client, which are
#: no RedisError (keys of one script in several slots, a cluster it cannot reach at all).
STORE_ERRORS: tuple[type[Exception], ...] = (redis.RedisError, RedisClusterException)


def unreachable(exc: BaseException) -> bool:
    """Whether a store failure means the store could not be reached, not that it (or its client) refused.

    redis-py's cluster client reports a cluster none of whose nodes answer as a
    RedisClusterException caused by the connection error.
    """
    if isinstance(exc, RedisClusterException):
        return isinstance(exc.__cause__, UNREACHABLE)
    return isinstance(exc, UNREACHABLE)


#: The error codes redis-py strips from the replies it raises as these classes.
_REPLY_CODES: tuple[tuple[type[Exception], str], ...] = (
    (redis.exceptions.OutOfMemoryError, "OOM"),
    (redis.exceptions.NoPermissionError, "NOPERM"),
    (redis.exceptions.ReadOnlyError, "READONLY"),
    (redis.exceptions.ExecAbortError, "EXECABORT"),
    (redis.exceptions.NoScriptError, "NOSCRIPT"),
)


def server_reply(exc: BaseException) -> redis.ResponseError | None:
    """The server's error reply behind ``exc`` (kombu wraps replies to the broker in OperationalError), if any."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, redis.ResponseError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def store_failure(exc: BaseException) -> str:
    """What went wrong, for a log line: an unreachable store, or the error reply of one that answered."""
    reply = server_reply(exc)
    if reply is not None:
        return f"the dedup store refused the command: {error_reply(reply)}"
    return f"dedup store unreachable ({type(exc).__name__}: {exc})"


def error_reply(exc: BaseException) -> str:
    """The server's error reply behind a redis-py exception, its code included (``OOM command not allowed...``)."""
    text = str(exc)
    code = getattr(exc, "status_code", None) or next((c for cls, c in _REPLY_CODES if isinstance(exc, cls)), None)
    return f"{code} {text}" if code and not text.startswith(code) else text


class DedupStoreFormatError(DedupError):
    """The dedup store's keys are in a newer format than this release of celery-dedup reads.

    A release never guesses at a layout it does not know: it refuses, at
    worker start and at its first use of the store, until it is upgraded.
    """

    def __init__(self, prefix: str, stored: int, supported: int) -> None:
        self.prefix = prefix
        self.stored = stored
        self.supported = supported
        super().__init__(
            f"the dedup store under prefix {prefix!r} has format {stored}, but this celery-dedup release reads "
            f"format {supported}: a newer release wrote it. Upgrade celery-dedup on this host "
            "(pip install --upgrade celery-dedup) before it uses this store"
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


class DedupLimitTimeout(DedupError):
    """``celery_dedup.limits.acquire`` got no place in its group key within ``timeout`` seconds.

    The caller left the group key's waiting line: it holds nothing.
    """

    def __init__(self, group: str, key: str | None, timeout: float) -> None:
        self.group = group
        self.key = key
        self.timeout = timeout
        where = f"limit group {group!r}" + (f" key {key!r}" if key is not None else "")
        super().__init__(f"{where}: no place within {timeout:g}s")


class DedupOperationError(DedupError):
    """An operator's action on a key (release, purge, re-enqueue) cannot be done."""

    def __init__(self, operation: str, target: str, reason: str) -> None:
        self.operation = operation
        self.target = target
        self.reason = reason
        super().__init__(f"{operation} {target!r}: {reason}")


class DedupArgumentError(DedupError, ValueError):
    """A function of celery-dedup was called with an argument it cannot take.

    ``records(limit=0)``, ``reap(budget=0)``, ``apply_async_many(chunk=0)``.

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
