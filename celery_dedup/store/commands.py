"""One command per Lua script: its fields, in order, are the script's ARGV; its reply codes, named.

A command is a named tuple, so it is sent as it is (no per-call
conversion). The script gets its ARGV as locals of the same names, made by
:func:`argv_prelude`: the order is stated here only. A field's type says
how the script reads it: :data:`Number` (``tonumber``), :data:`Flag`
(``"1"`` is true), :data:`Rest` (every ARGV from there on, as a table),
anything else as the string Redis gives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Annotated, Any, NamedTuple, TypeVar, get_args, get_type_hints

_NUMBER, _FLAG, _REST = "number", "flag", "rest"

#: Read with ``tonumber``.
Number = Annotated[int, _NUMBER]
#: ``"1"`` or ``"0"``: read as ``== '1'``.
Flag = Annotated[str, _FLAG]
#: The last field: every remaining ARGV, one per item, read as a Lua table.
Rest = Annotated[tuple[str, ...], _REST]


@dataclass(frozen=True)
class Spec:
    """What the loader and the store know of one script's command."""

    #: The script (``lua/<name>.lua``).
    name: str
    #: The command's fields, in ARGV order, each with how the script reads it ("" for a string).
    fields: tuple[tuple[str, str], ...]
    #: The names of its KEYS, in order (a trailing one may be optional or repeated).
    keys: tuple[str, ...]
    #: The last field stands for any number of ARGV.
    rest: bool


#: Every script's spec, by name.
SPECS: dict[str, Spec] = {}
#: The same, by command type (the store runs a command by its type).
BY_TYPE: dict[type[Any], Spec] = {}

_Command = TypeVar("_Command", bound=type[Any])


def script(name: str, *, keys: tuple[str, ...]) -> Callable[[_Command], _Command]:
    """Declare the command type of script ``name`` and the names of its KEYS."""

    def register(cls: _Command) -> _Command:
        hints = get_type_hints(cls, include_extras=True)
        kinds = [next((a for a in get_args(hints[f])[1:] if isinstance(a, str)), "") for f in cls._fields]
        if _REST in kinds[:-1]:
            raise TypeError(f"{cls.__name__}: only the last field may be Rest")
        spec = Spec(name, tuple(zip(cls._fields, kinds, strict=True)), keys, kinds[-1:] == [_REST])
        SPECS[name] = BY_TYPE[cls] = spec
        return cls

    return register


def argv_prelude(name: str) -> str:
    """The line that gives script ``name`` its ARGV as named locals ("" for a script without a command)."""
    spec = SPECS.get(name)
    if spec is None or not spec.fields:
        return ""
    names, values, rest = [], [], ""
    for i, (field, kind) in enumerate(spec.fields, 1):
        if kind == _REST:
            rest = f" local {field} = {{}} for i = {i}, #ARGV do {field}[#{field} + 1] = ARGV[i] end"
            continue
        names.append(field)
        values.append(
            f"tonumber(ARGV[{i}])" if kind == _NUMBER else f"ARGV[{i}] == '1'" if kind == _FLAG else f"ARGV[{i}]"
        )
    line = f"local {', '.join(names)} = {', '.join(values)}" if names else ""
    return (line + rest).strip() + "\n"


# --- the publish side ----------------------------------------------------------------------------


@script("gate", keys=("held", "record", "queue", "expire"))
class Gate(NamedTuple):
    member: str
    task_id: str
    nonce: str
    hold_ms: Number
    grace_ms: Number
    prefix: str
    history_len: Number
    argsrepr: str
    kwargsrepr: str
    #: "0" a call, "1" a continuation of its run, "2" a deferred copy.
    continuation: str
    max_followers: Number
    lease_ms: Number
    message: str = ""
    #: ms, or "" for none.
    expires_ms: str | int = ""
    tag: str = ""
    unacked: str = ""
    payload: str = ""
    window_ms: Number = 0
    max_wait_ms: Number = 0
    latest: Flag = "0"
    #: The call's arguments fingerprint, "" for a call that is not compared (``dedup_on_mismatch``).
    args_fp: str = ""


class GateCode(IntEnum):
    """``gate.lua``'s reply codes."""

    DUPLICATE = 0
    ACCEPTED = 1
    #: Nothing pushed, as nothing is needed: a retried publish, or a continuation of an ended run.
    NOTHING_TO_PUSH = 2
    #: Joined a debounced burst.
    JOINED = 3
    #: The run has its followers already.
    REFUSED = 4
    FOLLOWER = 5


@script("confirm", keys=("held", "record"))
class Confirm(NamedTuple):
    member: str
    task_id: str
    nonce: str
    hold_ms: Number
    grace_ms: Number
    prefix: str
    history_len: Number


class ConfirmCode(IntEnum):
    """``confirm.lua``'s reply codes."""

    #: The key passed to another run before this one began.
    PASSED = 0
    CONFIRMED = 1
    NOTHING_TO_DO = 2


@script("peek", keys=("held", "record"))
class Peek(NamedTuple):
    member: str
    prefix: str
    #: As the gate's.
    args_fp: str = ""


class PeekCode(IntEnum):
    """``peek.lua``'s reply codes."""

    FREE = -1
    DUPLICATE = 0


# --- reading -------------------------------------------------------------------------------------


@script("records", keys=("state_index",))
class Records(NamedTuple):
    """One page of records merged from the per-state indexes (KEYS: one index per state of ``states``)."""

    record_prefix: str
    #: ``"<escaped task name>:"``, or "" for every task.
    task_prefix: str
    #: The position the page starts after: score (ms) and member; ``""`` for the newest entry.
    after_score: str
    after_member: str
    limit: Number
    budget: Number
    states: Rest


@script("annotate", keys=("record",))
class Annotate(NamedTuple):
    task_id: str
    note: str
    history_len: Number


@script("dispatch", keys=("due_key",))
class Dispatch(NamedTuple):
    prefix: str
    limit: Number
    history_len: Number


# --- the worker side -----------------------------------------------------------------------------


@script("start", keys=("held", "record", "lock"))
class Start(NamedTuple):
    member: str
    task_id: str
    token: str
    lock_ms: Number
    gated: Flag
    key_mode: str
    hostname: str
    pid: int
    retries: Number
    prefix: str
    history_len: Number
    record_ms: Number
    want_payload: Flag
    on_locked: str
    keep_payload: Flag
    main: str
    tag: str
    unacked: str


class StartCode(IntEnum):
    """``start.lua``'s reply codes."""

    LOCKED_SAME_RUN = 0
    RUN = 1
    DONE = 2
    SUPERSEDED = 3
    LOCKED_OTHER = 4
    FOLLOWER = 5


@script("takeover", keys=("record", "lock"))
class Takeover(NamedTuple):
    member: str
    dead: str
    prefix: str
    history_len: Number
    refused: str


@script("finish", keys=("held", "record", "lock", "result_key"))
class Finish(NamedTuple):
    member: str
    task_id: str
    state: str
    drop: Flag
    record_ms: Number
    token: str
    prefix: str
    history_len: Number
    err: str
    payload: str
    role: str
    note: str
    result: str
    #: With ``result_key``: the result as the backend encodes it.
    result_value: str | bytes = ""
    #: With ``result_key``: its expiry, seconds (0: none).
    result_expires: Number = 0


@script("renew", keys=("lock", "record"))
class Renew(NamedTuple):
    lock_ms: Number
    record_ms: Number
    tokens: Rest


@script("settle", keys=("followers",))
class Settle(NamedTuple):
    member: str
    run: str
    result: str
    unkept: str
    prefix: str
    ttl_ms: Number
    state: str = "succeeded"


@script("replacing", keys=("record", "lock"))
class Replacing(NamedTuple):
    task_id: str
    token: str
    by: str


# --- steps inside a body (worker/steps.py) --------------------------------------------------------


@script("step_begin", keys=("lock", "record", "steps", "run_steps"))
class StepBegin(NamedTuple):
    run: str
    token: str
    field: str
    name: str
    lock_ms: Number
    record_ms: Number
    history_len: Number
    on_doubt: str
    dead: str = ""


class StepBeginCode(IntEnum):
    """``step_begin.lua``'s reply codes."""

    #: The delivery does not hold the execution lock (any more).
    LOCK_LOST = 0
    RUN = 1
    #: In doubt, executed again (``on_doubt="retry"``).
    RUN_AGAIN = 2
    DONE = 3
    #: In doubt, not executed (``on_doubt="raise"``).
    IN_DOUBT = 4
    #: Another delivery's step lock is alive.
    BUSY = 5


@script("step_end", keys=("lock", "record", "steps", "run_steps"))
class StepEnd(NamedTuple):
    run: str
    token: str
    field: str
    name: str
    outcome: str
    result: str
    err: str
    lock_ms: Number
    record_ms: Number
    history_len: Number


@script("step_renew", keys=("lock", "record", "steps", "run_steps"))
class StepRenew(NamedTuple):
    """KEYS: one ``(lock, record, steps, run_steps)`` quadruple per lease."""

    lock_ms: Number
    record_ms: Number
    #: Two per lease, in order: its token, and the field of the step it executes ("" between steps).
    leases: Rest


# --- operators and clean-up ----------------------------------------------------------------------


@script("reap", keys=("held",))
class Reap(NamedTuple):
    prefix: str
    budget: Number
    record_ms: Number
    history_len: Number
    grace_ms: Number


@script("release", keys=("held", "record", "lock"))
class Release(NamedTuple):
    member: str
    prefix: str
    history_len: Number
    record_ms: Number
    force: str
    who: str


class ReleaseCode(IntEnum):
    """``release.lua``'s reply codes."""

    REFUSED_LOCKED = 0
    RELEASED = 1
    REFUSED_LOCK_CHANGED = 2
    NOTHING = 3


@script("purge", keys=("held",))
class Purge(NamedTuple):
    prefix: str
    budget: Number
    states: Rest


# --- limits --------------------------------------------------------------------------------------


@script("limit_acquire", keys=("slots", "starts", "waiting", "deadlines", "info", "index", "stats", "conf"))
class LimitAcquire(NamedTuple):
    group: str
    token: str
    run: str
    limit: Number
    #: The declared windows, ``"count/period_ms,..."`` (``policy.rates_text``; "" for none).
    rates: str
    lease: Number
    ns: str
    evict: Rest


class AcquireCode(IntEnum):
    """``limit_acquire.lua``'s reply codes."""

    REFUSED = 0
    GRANTED = 1


@script("limit_release", keys=("slots", "starts", "info"))
class LimitRelease(NamedTuple):
    token: str
    ran: Flag


class GiveBackCode(IntEnum):
    """``limit_release.lua``'s replies: what the token held."""

    NONE = 0
    HELD = 1
    LAPSED = 2


@script("limit_renew", keys=("slots", "info"))
class LimitRenew(NamedTuple):
    lease: Number
    tokens: Rest


@script("limit_backoff", keys=("conf", "waiting", "deadlines"))
class LimitBackoff(NamedTuple):
    key: str
    run: str
    after: Number
    lease: Number


@script("limit_note", keys=("record",))
class LimitNote(NamedTuple):
    task_id: str
    what: str
    detail: str
    history_len: Number
