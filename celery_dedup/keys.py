"""Business keys, task ids and Redis key names: the one place any of them is built.

A **business key** names a unit of work (``order:42``). It is rendered from a
task's bound arguments, so ``charge(42)``, ``charge(order_id=42)`` and
``charge(42, amount=<default>)`` agree. Each argument value has one canonical
rendering, and two values render alike only if they are the same value:

- strings percent-escape whatever could blur the key's structure (``%``,
  ``:``, ``{}``, ``[]``, ``#``, ``*``, ``,``, ``=``, whitespace, control
  characters), so bare braces and brackets are left to tags and containers;
- an int renders as its digits, a UUID as its canonical text: each agrees
  with that string (an id from a JSON webhook is the id from Python);
- other scalars are tagged (``{null}``, ``{true}``, ``{float}1.5``,
  ``{decimal}12.5``, ``{date}2024-01-02``, ``{bytes}41``, ...), equal
  values of one type agreeing (``-0.0`` is ``0.0``, ``12.50`` is ``12.5``);
- tuples and lists render as ``[a,b]``, dicts as ``{k=v,...}`` and sets as
  ``{set}[...]``, entries and members sorted by their rendering.

docs/concepts.md states the rules and why; tests/integration/test_keys_property.py checks
them. Keys longer than ``dedup_max_key_length`` keep a readable prefix
followed by ``#`` and a hash of the whole key.

Redis key schema (``P`` is ``dedup_key_prefix``; ``M`` a *member*: the escaped
task name, ``:``, and the business key)::

    P:held      SET of members whose key is currently held
    P:rec:M     HASH, the member's status record (owner task id, state, times)
    P:lock:M    STRING, the execution lock: the running delivery's token
    P:idx...    indexes over the records: per state, and by name (see store/lua/lib.lua)
    P:format    STRING, the stored format's version (store/schema.py's FORMAT)
    P:reaper:*  where the reaper stands in its walks (see store/lua/reap.lua)
    P:fol:M     HASH, the member's followers: follower task id -> JSON
                {run, queue, message, at} (message and queue gone once released)
    P:out:M     HASH, how runs of the member that had followers ended:
                run task id -> JSON {state, error, result} (state `replaced`
                while the run's replacement has yet to end, or `lost` with
                `relay_until` for a run lost while replacing itself); the
                first settled outcome stands; only runs a follower may still
                ask for (see lib.lua's record_outcome)
    P:following SET of members with followers (the reaper's list to look at)
    P:steps:M   HASH, the key's steps (dedup_once scope="key")
    P:runsteps:M:R  HASH, the steps of run R of the member (R escaped: schema.run_part)
    P:lim:*     limit groups (see store/schema.py's KEY_KINDS): a group's slots, starts,
                waiting line and info under its group id (a member-like
                ``<namespace>:<group key>``), and ``P:lim:conf:<namespace>``,
                the run-time overrides and pauses of a named group
"""

from __future__ import annotations

import base64
import datetime
import decimal
import enum
import functools
import hashlib
import inspect
import json
import math
import re
import secrets
import string
import uuid
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .exceptions import DedupConfigError, DedupKeyError

KeyOption = str | Sequence[str] | Callable[..., Any] | None

# ``,`` and ``=`` separate ``name=value`` pairs and container items, ``{}``
# and ``[]`` delimit type tags and containers, ``#`` starts the hash of a
# bounded key and a lone ``*`` is the key of a call with no key parts: none of
# them may appear unescaped in a string, or two calls could render alike.
_UNSAFE_IN_VALUES = frozenset("%:{}#*,=[]")
# A callable's string result is a whole key: ``:``, ``,`` and ``=`` stay readable.
_UNSAFE_IN_RESULTS = frozenset("%{}#*[]")
_UNSAFE_IN_LITERALS = frozenset("%{}#*")
# Task names and keyword names: the escaping they always had.
_UNSAFE_IN_NAMES = frozenset("%:{}#*,=")
_ESCAPE_RUN = re.compile(r"(?:%[0-9A-F]{2})+$")
_HASH_CHARS = 32
_ID_ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"  # Crockford base32: no i, l, o, u
#: RFC 4648's base32 alphabet (what ``base64.b32encode`` writes) to :data:`_ID_ALPHABET`.
_TO_ID_ALPHABET = bytes.maketrans(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567", _ID_ALPHABET.encode("ascii"))
# Decimals with more zeros than this before or after their digits are written with an exponent.
_DECIMAL_ZEROS = 20


def _escape(text: str, unsafe: frozenset[str]) -> str:
    if text.isprintable() and not any(c in unsafe or c.isspace() for c in text):
        return text
    out = []
    for char in text:
        if char in unsafe or char.isspace() or not char.isprintable():
            out.append("".join(f"%{byte:02X}" for byte in char.encode("utf-8", "surrogatepass")))
        else:
            out.append(char)
    return "".join(out)


def escape_value(text: str) -> str:
    """Escape a string value so it cannot look like key structure, a tag or a container."""
    return _escape(text, _UNSAFE_IN_VALUES)


def escape_literal(text: str) -> str:
    """Escape template text; ``:`` stays as a separator."""
    return _escape(text, _UNSAFE_IN_LITERALS)


class _Unrenderable(Exception):
    """A value (possibly nested inside an argument) with no canonical key form."""

    def __init__(self, value: Any, reason: str) -> None:
        self.value = value
        self.reason = reason
        super().__init__(reason)


def _render_int(value: int) -> str:
    try:
        return str(int(value))
    except ValueError:  # beyond sys.get_int_max_str_digits(): no digits to agree with
        return "{int}" + hex(value)


def _render_float(value: float) -> str:
    if math.isnan(value):
        return "{float}nan"
    return "{float}" + repr(value + 0.0)  # + 0.0: -0.0 is 0.0


def _render_decimal(value: decimal.Decimal) -> str:
    """By value, exactly (no context rounding): ``12.50`` and ``12.5`` agree, ``100`` stays ``100``."""
    if value.is_nan():
        return "{decimal}NaN"
    if value.is_infinite():
        return "{decimal}" + ("-Infinity" if value.is_signed() else "Infinity")
    sign, digits, exponent = value.as_tuple()
    assert isinstance(exponent, int)
    coefficient = "".join(map(str, digits)).lstrip("0")
    if not coefficient:
        return "{decimal}0"
    stripped = coefficient.rstrip("0")
    exponent += len(coefficient) - len(stripped)
    point = len(stripped) + exponent  # digits before the decimal point
    if 0 <= exponent <= _DECIMAL_ZEROS:
        text = stripped + "0" * exponent
    elif exponent < 0 < point:
        text = f"{stripped[:point]}.{stripped[point:]}"
    elif exponent < 0 and point >= -_DECIMAL_ZEROS:
        text = "0." + "0" * -point + stripped
    else:
        text = f"{stripped}E{exponent:+d}"
    return "{decimal}" + ("-" if sign else "") + text


def _render_datetime(value: datetime.datetime) -> str:
    if value.utcoffset() is not None:
        try:
            value = value.astimezone(datetime.timezone.utc)  # one instant, one key
        except OverflowError:
            raise _Unrenderable(value, "is an instant outside the years 1-9999 in UTC") from None
    return "{datetime}" + escape_value(value.isoformat())


def _text(value: str) -> str:
    r"""The text of a string, with UTF-16 surrogate pairs joined into the character they encode.

    JSON joins them on the way to a worker (``"\ud800\udc00"`` arrives as ``"\U00010000"``),
    so the publisher must too. ``str.__str__`` ignores a subclass's ``__str__``.
    """
    text = str.__str__(value)
    if text.isprintable():
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")


#: Scalar types and their key forms, checked in order (bool before int, datetime before date).
_SCALARS: tuple[tuple[type | tuple[type, ...], Callable[[Any], str]], ...] = (
    (type(None), lambda _: "{null}"),
    (bool, lambda v: "{true}" if v else "{false}"),
    (int, _render_int),
    (uuid.UUID, str),
    (float, _render_float),
    (decimal.Decimal, _render_decimal),
    (datetime.datetime, _render_datetime),
    (datetime.date, lambda v: "{date}" + v.isoformat()),
    (datetime.time, lambda v: "{time}" + escape_value(v.isoformat())),
    ((bytes, bytearray), lambda v: "{bytes}" + bytes(v).hex()),
)
_CONTAINERS = (list, tuple, dict, set, frozenset)


def _render(value: Any, path: set[int], *, item: bool = False) -> str:
    """The canonical key form of ``value``: escaped, tagged where its text could be another value's.

    ``item``: inside a container, where an empty string is ``{empty}`` so ``[""]`` is not ``[]``.
    """
    while isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, str):
        return escape_value(_text(value)) if value or not item else "{empty}"
    for types, render in _SCALARS:
        if isinstance(value, types):
            return render(value)
    if isinstance(value, _CONTAINERS):
        return _render_container(value, path)
    raise _Unrenderable(
        value,
        f"a {type(value).__name__} has no canonical text form for a business key; "
        "pass primitives, or give dedup_key a callable that returns a string",
    )


def _render_container(value: Any, path: set[int]) -> str:
    """``[a,b]`` for lists and tuples, ``{k=v,...}`` for dicts, ``{set}[...]`` for sets; unordered ones sorted."""
    if id(value) in path:
        raise _Unrenderable(value, "contains itself")
    path.add(id(value))
    try:
        if isinstance(value, (list, tuple)):
            return "[" + ",".join(_render(v, path, item=True) for v in value) + "]"
        if isinstance(value, dict):
            entries = (f"{_render(k, path, item=True)}={_render(v, path, item=True)}" for k, v in value.items())
            return "{" + ",".join(sorted(entries)) + "}"
        return "{set}[" + ",".join(sorted(_render(v, path, item=True) for v in value)) + "]"
    finally:
        path.discard(id(value))


def render_value(task: str, argument: str | None, value: Any) -> str:
    """Render one argument value in its canonical key form (already escaped).

    Raises:
        DedupKeyError: the value, or something inside it, has no canonical form.
    """
    try:
        return _render(value, set())
    except _Unrenderable as exc:
        raise DedupKeyError(task, argument, exc.value, exc.reason) from None
    except RecursionError:
        raise DedupKeyError(task, argument, value, "is nested too deeply to be rendered canonically") from None


#: Hex digits of an arguments fingerprint: 64 bits, short enough for a compact record field.
FINGERPRINT_CHARS = 16


def _fingerprint_default(value: Any) -> str:
    """What canonical JSON cannot encode, in the business key's canonical form (Decimal, datetime, UUID, bytes, set)."""
    try:
        return _render(value, set())
    except _Unrenderable:
        raise TypeError(f"{type(value).__name__} has no canonical form") from None


def arguments_fingerprint(arguments: Mapping[str, Any]) -> str:
    """A short, stable hash of a call's bound arguments (names and values): "" when they have no canonical form.

    The canonical JSON of ``arguments`` (keys sorted, no spaces, ASCII, so a
    UTF-16 surrogate pair and the character it encodes agree), hashed with
    BLAKE2b to :data:`FINGERPRINT_CHARS` hex digits. It depends on neither
    the serializer nor the process (no hash seed, no ``repr`` of objects),
    so every publisher computes the same fingerprint for the same call.
    Tuples are lists, as in JSON. Values JSON has no form for take the
    business key's (``Decimal("12.50")`` is ``"{decimal}12.5"``, a set its
    sorted members); a value neither can render (an arbitrary object), a
    dict whose keys cannot be sorted (``1`` beside ``"a"``), a cycle or an
    int too long for ``str()`` gives "": such a call is not compared.

    Example:
        >>> arguments_fingerprint({"order_id": 42, "amount": 10})
        '060c283830188245'
    """
    try:
        text = json.dumps(arguments, sort_keys=True, separators=(",", ":"), default=_fingerprint_default)
    except (TypeError, ValueError, RecursionError):
        return ""
    return hashlib.blake2b(text.encode("ascii"), digest_size=FINGERPRINT_CHARS // 2).hexdigest()


def _is_empty(value: Any) -> bool:
    while isinstance(value, enum.Enum):
        value = value.value
    return value is None or (isinstance(value, (str, bytes, bytearray, *_CONTAINERS)) and not value)


def bound_key(key: str, max_length: int) -> str:
    """Bound ``key`` to ``max_length`` characters: keep a prefix, append a hash."""
    if len(key) <= max_length:
        return key
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:_HASH_CHARS]
    return f"{_whole_chars(key[: max_length - _HASH_CHARS - 1])}#{digest}"


def _whole_chars(prefix: str) -> str:
    """``prefix`` without a trailing partial ``%XX`` escape or partial UTF-8 character."""
    cut = prefix.rfind("%", len(prefix) - 2)
    if cut != -1:
        prefix = prefix[:cut]
    run = _ESCAPE_RUN.search(prefix)
    if run is None:
        return prefix
    raw = bytes.fromhex(run.group(0).replace("%", ""))
    for keep in range(len(raw), max(len(raw) - 4, -1), -1):
        try:
            raw[:keep].decode("utf-8")
        except UnicodeDecodeError:
            continue
        return prefix[: run.start() + 3 * keep]
    return prefix[: run.start()]


@functools.lru_cache(maxsize=1024)
def task_namespace(task_name: str) -> str:
    """The escaped task name that prefixes every member of that task (escaped once per name)."""
    return _escape(task_name, _UNSAFE_IN_NAMES)


_ESCAPES = re.compile(r"(?:%[0-9A-Fa-f]{2})+")


def task_from_namespace(namespace: str) -> str:
    """The task name an escaped namespace stands for: the inverse of :func:`task_namespace`.

    Format 2 records keep no ``task`` field; their task is read back from
    their member with this. Every name comes back, lone surrogates included
    (they were escaped as their ``surrogatepass`` bytes); text that is no
    escape is kept as it is.
    """
    return _ESCAPES.sub(lambda run: _unescape(run.group()), namespace)


def _unescape(run: str) -> str:
    raw = bytes.fromhex(run.replace("%", ""))
    try:
        return raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:  # not escapes task_namespace made: read what can be read
        return raw.decode("utf-8", "replace")


def member_for(task_name: str, business_key: str) -> str:
    """The set member and record suffix for a task's business key."""
    return f"{task_namespace(task_name)}:{business_key}"


#: What every named limit group's namespace starts with. Task names have ``=`` escaped
#: (:func:`task_namespace`), so no task's namespace holds it: a group's keys are never a task's.
_GROUP_NAMESPACE = "group="
#: The group key of a named group's single quota (a task naming the group without ``limit_key``).
WHOLE_GROUP = "*"
#: What a ``limit_key`` rendering ``*`` (a key of no parts) stands as in a named group: rendered keys
#: never hold a brace outside a ``{tag}`` of letters, so it differs from every other rendering too.
_STAR_KEY = "{*}"


def limit_group_namespace(name: str) -> str:
    """The namespace of named limit group ``name`` (``group=<escaped name>``): never a task's namespace."""
    return _GROUP_NAMESPACE + _escape(name, _UNSAFE_IN_NAMES)


def limit_group_member(name: str, key: str | None) -> str:
    """The group id of key ``key`` of named group ``name`` (None: the whole group's single quota, ``*``).

    ``key`` is a rendered ``limit_key`` (the key as the group's tasks render it).
    A key rendering ``*`` is kept apart from the whole group's ``*``.
    """
    part = WHOLE_GROUP if key is None else _STAR_KEY if key == WHOLE_GROUP else key
    return f"{limit_group_namespace(name)}:{part}"


def limit_key_of(part: str) -> str:
    """The key :func:`limit_group_member` took for a group id's key part (the inverse, for a key given)."""
    return WHOLE_GROUP if part == _STAR_KEY else part


def limit_group_of(namespace: str) -> str | None:
    """The named group a namespace stands for (the inverse of :func:`limit_group_namespace`), None: a task's."""
    if not namespace.startswith(_GROUP_NAMESPACE):
        return None
    return task_from_namespace(namespace.removeprefix(_GROUP_NAMESPACE))


def split_member(member: str) -> tuple[str, str]:
    """``(escaped task name, business key)`` of a member: the name holds no ``:``."""
    namespace, _, business_key = member.partition(":")
    return namespace, business_key


def new_task_id(business_key: str) -> str:
    """A readable task id for a new run of ``business_key``: the key and a run suffix.

    The suffix makes each run's id unique, so a result backend never answers a
    new run with an earlier run's result.
    """
    # 56 random bits; 10 base32 characters use 50 of them.
    suffix = base64.b32encode(secrets.token_bytes(7))[:10].translate(_TO_ID_ALPHABET).decode("ascii")
    return f"{business_key}~{suffix}"


#: The longest idempotency key :func:`step_key` makes: what Stripe takes, and most providers.
STEP_KEY_MAX = 255
#: A step's name: what a history note and an idempotency key can carry as they are.
STEP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
#: A run id :func:`new_task_id` made for the business key it starts with: its suffix stands for it.
_RUN_SUFFIX = re.compile(r"~[" + _ID_ALPHABET + r"]{10}")
#: What a run id that is not of that form may not hold as it is: the separators, the escape and ``~``.
_UNSAFE_IN_RUNS = frozenset("%:~")


def step_key(member: str, run_id: str, step: str, *, scope: str = "run") -> str:
    """The idempotency key of step ``step`` of run ``run_id`` of ``member`` (``scope="key"``: of the key).

    ``<task>:<business key>:<run>:<step>``: ``<run>`` is the run id's suffix
    (``~`` and ten characters) when :func:`new_task_id` made it for this
    business key, else the run id with ``%``, ``:`` and ``~`` escaped (so it
    never starts with ``~``, and a run id ``key`` reads ``%6Bey``), or ``key``
    for a step of the key. The task name and the step hold no ``:`` and the
    run part none either, so distinct runs and steps give distinct keys.
    Everything but printable ASCII is escaped (``%XX`` of its UTF-8 bytes),
    so the key is printable ASCII without whitespace, and at most
    :data:`STEP_KEY_MAX` characters: a longer one keeps its start and ends with
    ``#`` and 32 hex digits of the whole key's SHA-256. Deterministic: every
    delivery of the run computes the same key.

    Example:
        >>> step_key("shop.charge:order:42", "order:42~0123456789", "charge-card")
        'shop.charge:order:42:~0123456789:charge-card'
    """
    namespace, business_key = split_member(member)
    if scope == "key":
        run = "key"
    else:
        suffix = run_id[len(business_key) :] if run_id.startswith(business_key) else ""
        if _RUN_SUFFIX.fullmatch(suffix):
            run = suffix
        else:
            run = _escape(run_id, _UNSAFE_IN_RUNS)
            run = "%6Bey" if run == "key" else run
    text = "".join(
        char if char.isascii() and char.isprintable() and not char.isspace() else _escape(char, frozenset(char))
        for char in f"{namespace}:{business_key}:{run}:{step}"
    )
    if len(text) <= STEP_KEY_MAX:
        return text
    digest = hashlib.sha256(text.encode("ascii")).hexdigest()[:_HASH_CHARS]
    return f"{_whole_chars(text[: STEP_KEY_MAX - _HASH_CHARS - 1])}#{digest}"


def new_nonce() -> str:
    """A per-publish token; kombu's publish retries repeat it, new calls do not."""
    return secrets.token_hex(8)


#: Shards of a store on a Redis Cluster: fixed, so every process agrees where a key lives.
CLUSTER_SHARDS = 16


#: What a key's ``{run}`` part escapes, and how: a run id holds no ``:`` then, so ``<member>:<run>`` splits one way.
RUN_PART_ESCAPES = (("%", "%25"), (":", "%3A"))


def run_part(run: str) -> str:
    """A run id as a key's ``{run}`` part: ``%`` and ``:`` escaped (:data:`RUN_PART_ESCAPES`), so no two
    ``(member, run)`` pairs give one key name."""
    for char, escaped in RUN_PART_ESCAPES:
        run = run.replace(char, escaped)
    return run


@dataclass(frozen=True)
class KeySchema:
    """Every Redis key name celery-dedup uses, from one prefix.

    A store on a Redis Cluster splits its keys into ``shards``: the schema of
    shard ``n`` (:meth:`shard_of`, :meth:`shards_all`) has the prefix
    ``{<prefix>:<nn>}``, a hash tag, so every key of one shard, the global
    structures of that shard (held set, indexes, stats) and every key of its
    members included, is in one slot, and each script touches one slot. A
    member's shard follows from the member. With one shard (a single
    server) the schema is its own shard and the names are the plain ones.
    """

    prefix: str
    shards: int = 1

    def shard_of(self, member: str) -> KeySchema:
        """The schema of the shard that holds ``member``'s keys."""
        if self.shards == 1:
            return self
        return self._shard(zlib.crc32(member.encode("utf-8", "surrogatepass")) % self.shards)

    def shards_all(self) -> list[KeySchema]:
        """Every shard's schema, in order."""
        if self.shards == 1:
            return [self]
        return [self._shard(n) for n in range(self.shards)]

    def _shard(self, n: int) -> KeySchema:
        return KeySchema(f"{{{self.prefix}:{n:02d}}}")

    @property
    def held(self) -> str:
        return f"{self.prefix}:held"

    @property
    def format(self) -> str:
        """STRING: the layout of the keys under the prefix (``schema.FORMAT``, see ``store/format.py``)."""
        return f"{self.prefix}:format"

    def record(self, member: str) -> str:
        return f"{self.prefix}:rec:{member}"

    def lock(self, member: str) -> str:
        return f"{self.prefix}:lock:{member}"

    def ended(self, member: str) -> str:
        """ZSET of the key's ended runs pushed out of its record's memory (lib.lua's ``remember_ended``)."""
        return f"{self.prefix}:ended:{member}"

    def state_index(self, state: str) -> str:
        return f"{self.prefix}:idx:state:{state}"

    @property
    def stats(self) -> str:
        """HASH of decision counters, fields ``<escaped task name>:<decision>``."""
        return f"{self.prefix}:stats"

    @property
    def due(self) -> str:
        """ZSET of members whose debounced run is parked, scored by when it is due (ms)."""
        return f"{self.prefix}:due"

    def followers(self, member: str) -> str:
        return f"{self.prefix}:fol:{member}"

    def outcomes(self, member: str) -> str:
        return f"{self.prefix}:out:{member}"

    def steps(self, member: str) -> str:
        """HASH of the steps of the member's key (``scope="key"``; entries: ``schema.STEP_FIELDS``)."""
        return f"{self.prefix}:steps:{member}"

    def run_steps(self, member: str, run: str) -> str:
        """HASH of the steps of run ``run`` of the member (``worker/steps.py``), the run id escaped (``run_part``)."""
        return f"{self.prefix}:runsteps:{member}:{run_part(run)}"

    @property
    def following(self) -> str:
        """SET of members that have followers."""
        return f"{self.prefix}:following"

    @property
    def name_index(self) -> str:
        """ZSET of every member with score 0, for prefix search with ZRANGEBYLEX."""
        return f"{self.prefix}:idx:name"

    # Limits (see limits.py): one group's keys, in the shard of its group
    # (named like a member: ``<escaped task name>:<group key>``).

    def limit_slots(self, group: str) -> str:
        """ZSET of the group's slot leases: token -> lease deadline (ms)."""
        return f"{self.prefix}:lim:slots:{group}"

    def limit_starts(self, group: str) -> str:
        """ZSET of the group's starts in its rate window: token -> start (ms)."""
        return f"{self.prefix}:lim:starts:{group}"

    def limit_waiting(self, group: str) -> str:
        """ZSET of the group's waiting runs: run id -> first arrival (ms)."""
        return f"{self.prefix}:lim:wait:{group}"

    def limit_deadlines(self, group: str) -> str:
        """ZSET of the group's waiting runs: run id -> when it must be back to keep its place (ms)."""
        return f"{self.prefix}:lim:due:{group}"

    def limit_info(self, group: str) -> str:
        """HASH of the group's slot start times, mean body time, last limits and how long free places are held."""
        return f"{self.prefix}:lim:info:{group}"

    @property
    def limit_groups(self) -> str:
        """ZSET of the shard's limit groups: group -> last acquire (ms)."""
        return f"{self.prefix}:lim:groups"

    def limit_conf(self, namespace: str) -> str:
        """HASH of a named group's run-time overrides and pauses, one copy per shard (``schema.LIMIT_CONF_FIELDS``)."""
        return f"{self.prefix}:lim:conf:{namespace}"


class KeySpec:
    """A task's compiled ``dedup_key`` option: turns call arguments into a business key.

    ``dedup_key`` may be a format string over argument names
    (``"order:{order_id}"``), a list of argument names (``["order_id"]``,
    rendered ``order_id=42``), a callable taking the task's arguments and
    returning the key (never None or empty), or ``None`` (every argument, in
    signature order).

    Example:
        >>> def charge(order_id, amount=0): ...
        >>> spec = KeySpec("shop.charge", "order:{order_id}", inspect.signature(charge), 200)
        >>> spec.business_key((42,), {"amount": 10})
        'order:42'
    """

    def __init__(self, task: str, option: KeyOption, signature: inspect.Signature, max_length: int) -> None:
        self.task = task
        self.signature = signature
        self.max_length = max_length
        self._var_keyword = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)
        params = list(signature.parameters.values())
        #: The parameter names in order and the defaults, for a signature of positional-or-keyword
        #: parameters only (the common one): its calls are bound without ``Signature.bind``.
        self._plain: tuple[tuple[str, ...], dict[str, Any]] | None = (
            (tuple(p.name for p in params), {p.name: p.default for p in params if p.default is not p.empty})
            if all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params)
            else None
        )
        self._render: Callable[[Mapping[str, Any], tuple[Any, ...], dict[str, Any]], str]
        if option is None:
            self._render = self._render_all
        elif isinstance(option, str):
            self._parts = self._parse_template(option)
            self._render = self._render_template
        elif callable(option):
            self._check_callable(option)
            self._callable = option
            self._render = self._render_callable
        elif isinstance(option, Sequence) and option and all(isinstance(n, str) for n in option):
            for name in option:
                self._check_name(name, option)
            self._names = tuple(option)
            self._render = self._render_names
        else:
            raise DedupConfigError(
                "dedup_key", option, "must be a format string, a list of argument names, or a callable", task=task
            )

    def business_key(self, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None) -> str:
        """The canonical, bounded business key for one call.

        Raises:
            DedupKeyError: the arguments do not fit the task or cannot be rendered.
        """
        return self.key_and_fingerprint(args, kwargs, fingerprint=False)[0]

    def key_and_fingerprint(
        self, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None, *, fingerprint: bool = True
    ) -> tuple[str, str]:
        """The call's business key and the :func:`arguments_fingerprint` of its bound arguments, binding once.

        ``fingerprint=False`` (or arguments it cannot take) gives "" for the fingerprint.

        Raises:
            DedupKeyError: the arguments do not fit the task or cannot be rendered.
        """
        args = tuple(args or ())
        kwargs = dict(kwargs or {})
        arguments = self._bound_plainly(args, kwargs)
        if arguments is None:
            try:
                bound = self.signature.bind(*args, **kwargs)
            except TypeError as exc:
                raise DedupKeyError(
                    self.task, None, (args, kwargs), f"arguments do not match the task: {exc}"
                ) from None
            bound.apply_defaults()
            arguments = dict(bound.arguments)
            if self._var_keyword:
                arguments.update(arguments.pop(self._var_keyword))
        key = self._render(arguments, args, kwargs) or "*"
        return bound_key(key, self.max_length), arguments_fingerprint(arguments) if fingerprint else ""

    def _bound_plainly(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
        """The arguments by name, defaults applied, as ``Signature.bind`` binds a call that fits a plain signature.

        None for any other signature or call (too many arguments, one given twice, unknown or
        missing): ``Signature.bind`` then binds it, or says why it does not fit.
        """
        plain = self._plain
        if plain is None:
            return None
        names, defaults = plain
        if len(args) > len(names):
            return None
        arguments = dict(zip(names, args, strict=False))
        for name, value in kwargs.items():
            if name in arguments:
                return None
            arguments[name] = value
        for name in names[len(args) :]:
            if name not in arguments:
                if name not in defaults:
                    return None
                arguments[name] = defaults[name]
        return arguments if len(arguments) == len(names) else None

    def _check_name(self, name: str, option: Any) -> None:
        params = self.signature.parameters
        if name in params and params[name].kind not in (params[name].VAR_POSITIONAL, params[name].VAR_KEYWORD):
            return
        if self._var_keyword is None:
            known = ", ".join(params) or "none"
            raise DedupConfigError(
                "dedup_key", option, f"names unknown argument {name!r} (the task takes: {known})", task=self.task
            )

    def _parse_template(self, template: str) -> list[tuple[str, str | None]]:
        parts: list[tuple[str, str | None]] = []
        try:
            parsed = list(string.Formatter().parse(template))
        except ValueError as exc:
            raise DedupConfigError(
                "dedup_key", template, f"is not a valid format string: {exc}", task=self.task
            ) from None
        for literal, field, spec, conversion in parsed:
            if field is not None:
                if not field.isidentifier() or spec or conversion:
                    raise DedupConfigError(
                        "dedup_key",
                        template,
                        f"field {{{field}}} must be a plain argument name (no index, attribute, "
                        "conversion or format spec: values are rendered canonically)",
                        task=self.task,
                    )
                self._check_name(field, template)
            parts.append((escape_literal(literal), field))
        return parts

    def _value(self, arguments: Mapping[str, Any], name: str) -> Any:
        try:
            return arguments[name]
        except KeyError:
            raise DedupKeyError(
                self.task, name, None, "the key names this argument but the call did not pass it"
            ) from None

    def _render_template(self, arguments: Mapping[str, Any], *_: Any) -> str:
        out = []
        for literal, field in self._parts:
            out.append(literal)
            if field is not None:
                out.append(render_value(self.task, field, self._value(arguments, field)))
        return "".join(out)

    def _render_names(self, arguments: Mapping[str, Any], *_: Any) -> str:
        return ",".join(f"{name}={render_value(self.task, name, self._value(arguments, name))}" for name in self._names)

    def _render_all(self, arguments: Mapping[str, Any], *_: Any) -> str:
        named = [n for n in self.signature.parameters if n in arguments]
        extra = sorted(n for n in arguments if n not in self.signature.parameters)  # **kwargs: any order
        return ",".join(
            f"{_escape(name, _UNSAFE_IN_NAMES)}={render_value(self.task, name, arguments[name])}"
            for name in named + extra
        )

    def _check_callable(self, key: Callable[..., Any]) -> None:
        """Refuse, at start-up, a callable that cannot take the task's required arguments."""
        try:
            accepts = inspect.signature(key)
        except (TypeError, ValueError):  # no signature to read (some builtins): it is tried at each call
            return
        params = self.signature.parameters.values()
        positional = [
            p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        keyword = {p.name: None for p in params if p.default is p.empty and p.kind is p.KEYWORD_ONLY}
        try:
            accepts.bind(*positional, **keyword)
        except TypeError as exc:
            taken = ", ".join([*positional, *keyword]) or "none"
            raise DedupConfigError(
                "dedup_key", key, f"the callable cannot take the task's arguments ({taken}): {exc}", task=self.task
            ) from None

    def _render_callable(self, _: Mapping[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        try:
            result = self._callable(*args, **kwargs)
        except DedupKeyError:
            raise
        except Exception as exc:
            raise DedupKeyError(
                self.task, None, (args, kwargs), f"the dedup_key callable raised {type(exc).__name__}: {exc}"
            ) from exc
        if _is_empty(result):
            raise DedupKeyError(
                self.task,
                None,
                result,
                "the dedup_key callable returned an empty key, which every such call would share; "
                "return a value that identifies the call (a constant, if the task should run once at a time)",
            )
        value = result
        while isinstance(value, enum.Enum):
            value = value.value
        if isinstance(value, str):
            return _escape(_text(value), _UNSAFE_IN_RESULTS)
        return render_value(self.task, None, value)
