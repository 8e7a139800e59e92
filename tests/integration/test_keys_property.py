"""Business keys, property-based: two calls share a key exactly when their arguments are the same value.

"The same value" is the documented rule (docs/concepts.md), written here a
second time, independently of :mod:`celery_dedup.keys`, as :func:`canon`.
Hypothesis generates argument values (nested containers, every supported
scalar, strings that spell other values' keys) and checks every key form
against it. Only the last test needs the suite's server: a real worker
derives a key from the JSON arguments it received.
"""

from __future__ import annotations

import contextlib
import datetime
import decimal
import enum
import inspect
import json
import math
import urllib.parse
import uuid
from collections import Counter
from collections.abc import Callable, Hashable
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from kombu.serialization import dumps, loads

from celery_dedup import DedupKeyError, DedupTask
from celery_dedup.keys import KeyOption, KeySpec
from tests.conftest import AppFactory, in_process_worker, wait_for
from tests.unit.test_keys import assert_safe

TASK = "shop.charge"
UTC = datetime.timezone.utc
#: No time limit per example (tests make no timing assertions) and no example database on disk.
PROPERTY = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


class Color(enum.Enum):
    RED = "red"
    NONE = None
    DAY = datetime.date(2024, 1, 1)


class Level(enum.IntEnum):
    HIGH = 3


class Kind(str, enum.Enum):
    ORDER = "order"


# --- the rule ---------------------------------------------------------------------------------------


class Refused(Exception):
    """The value has no key: the rule says DedupKeyError."""


def canon(value: Any) -> Hashable:  # noqa: PLR0912 - one branch per rule, as documented
    """The identity a key must stand for: equal results, equal keys; different results, different keys.

    - an Enum member is its value;
    - a str, an int and a UUID are their text (``42`` and ``"42"`` are one order id;
      a surrogate pair in a str is the character it encodes);
      an int too long for ``str()`` is its own kind;
    - None, bools, floats, Decimals, dates, times, datetimes and bytes are each their
      own kind, never equal to any text or to each other;
    - floats and Decimals compare by value (``-0.0`` is ``0.0``, ``12.50`` is ``12.5``,
      every NaN is one NaN);
    - an aware datetime is its instant (refused if that instant has no UTC datetime),
      a naive one its wall time; a time keeps its offset;
    - a tuple is the list of its items; dicts and sets are multisets of their entries.
    """
    while isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        return ("none",)
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int):
        try:
            return ("text", str(int(value)))
        except ValueError:
            return ("bigint", int(value))
    if isinstance(value, uuid.UUID):
        return ("text", str(value))
    if isinstance(value, str):  # a UTF-16 surrogate pair is the character it encodes, as JSON makes it
        return ("text", value.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass"))
    if isinstance(value, float):
        return ("float", "nan" if math.isnan(value) else value + 0.0)
    if isinstance(value, decimal.Decimal):
        if value.is_nan():
            return ("decimal", "nan")
        if value.is_infinite():
            return ("decimal", "-inf" if value.is_signed() else "inf")
        return ("decimal", Fraction(value))
    if isinstance(value, datetime.datetime):
        if value.utcoffset() is None:
            return ("datetime", value.replace(tzinfo=None, fold=0), False)
        try:
            instant = value.astimezone(UTC)
        except OverflowError:
            raise Refused from None
        return ("datetime", instant.replace(tzinfo=None), True)
    if isinstance(value, datetime.date):
        return ("date", value)
    if isinstance(value, datetime.time):
        return ("time", value.replace(tzinfo=None, fold=0), value.utcoffset())
    if isinstance(value, (bytes, bytearray)):
        return ("bytes", bytes(value))
    if isinstance(value, (list, tuple)):
        return ("list", tuple(canon(item) for item in value))
    if isinstance(value, dict):
        return ("dict", frozenset(Counter((canon(k), canon(v)) for k, v in value.items()).items()))
    if isinstance(value, (set, frozenset)):
        return ("set", frozenset(Counter(canon(item) for item in value).items()))
    raise AssertionError(f"the strategies made a value the rule does not cover: {value!r}")


#: What a ``dedup_key`` callable may not return: it would give every call one key.
EMPTY: set[Hashable] = {
    ("none",),
    ("text", ""),
    ("bytes", b""),
    ("list", ()),
    ("dict", frozenset()),
    ("set", frozenset()),
}


# --- the key forms ----------------------------------------------------------------------------------


def one(a: Any) -> None: ...


def pair(a: Any, b: Any) -> None: ...


def _itself(a: Any) -> Any:
    return a


def _both(a: Any, b: Any) -> Any:
    return (a, b)


def _spec(option: KeyOption, fn: Callable[..., Any], max_length: int = 10**9) -> KeySpec:
    return KeySpec(TASK, option, inspect.signature(fn), max_length)


ONE_VALUE = {
    "template": _spec("v:{a}", one),
    "names": _spec(["a"], one),
    "all-arguments": _spec(None, one),
    "callable": _spec(_itself, one),
}
TWO_VALUES = {
    "template": _spec("x:{a}:{b}", pair),
    "names": _spec(["a", "b"], pair),
    "all-arguments": _spec(None, pair),
    "callable": _spec(_both, pair),
}


def key_of(spec: KeySpec, *values: Any) -> str | None:
    """The key of a call with ``values``, or None when it is refused with DedupKeyError."""
    try:
        key = spec.business_key(values, {})
    except DedupKeyError as exc:
        assert exc.task == TASK
        return None
    assert_safe(key, spec.max_length)
    return key


def expected(form: str, *values: Any) -> Hashable | None:
    """The rule's identity for a call with ``values`` under ``form``, or None when the rule refuses it."""
    try:
        identity = tuple(canon(value) for value in values)
    except Refused:
        return None
    if form == "callable" and len(values) == 1 and identity[0] in EMPTY:
        return None
    return identity


def check(specs: dict[str, KeySpec], first: tuple[Any, ...], second: tuple[Any, ...]) -> None:
    """In every form: refused iff the rule refuses; one key iff one identity."""
    for form, spec in specs.items():
        identities = expected(form, *first), expected(form, *second)
        keys = key_of(spec, *first), key_of(spec, *second)
        for identity, key, values in zip(identities, keys, (first, second), strict=True):
            assert (identity is None) == (key is None), f"{form}: {values!r} gave key {key!r}"
        if None in identities:
            continue
        same = identities[0] == identities[1]
        assert (keys[0] == keys[1]) == same, (
            f"{form}: {first!r} -> {keys[0]!r} and {second!r} -> {keys[1]!r}, but the values are "
            + ("the same" if same else "different")
        )


# --- generated values -------------------------------------------------------------------------------

#: Text that is structure somewhere: separators, tags, escapes, brackets, blanks, lone surrogates.
TRICKY_TEXT = [
    *"%:{}[]#*,=~\n\t ",
    "",
    "null",
    "None",
    "true",
    "false",
    "nan",
    "-0.0",
    "0.0",
    "1.0",
    "{null}",
    "{true}",
    "[]",
    "{}",
    "%25",
    "%3A",
    "a=b,c=d",
    "\ud800",
    "\udfff",
    "\ud800\udc00",
    "\U00010000",
    "😀",
    "東京",
    "0x41",
    "2024-01-01",
]
texts = st.one_of(
    st.text(st.characters(exclude_categories=()), max_size=12),
    st.lists(st.sampled_from(TRICKY_TEXT), max_size=4).map("".join),
)
#: Fixed UTC offsets in whole minutes (Python parses finer ISO offsets back inexactly).
offsets = st.integers(-(24 * 60 - 1), 24 * 60 - 1).map(lambda m: datetime.timezone(datetime.timedelta(minutes=m)))
zones = st.one_of(st.none(), st.just(UTC), offsets, st.timezones())


def _respell_decimal(value: decimal.Decimal, zeros: int) -> decimal.Decimal:
    """The same Decimal written with ``zeros`` more trailing zeros (exactly, no context rounding)."""
    if not value.is_finite():
        return value
    sign, digits, exponent = value.as_tuple()
    assert isinstance(exponent, int)
    return decimal.Decimal((sign, (*digits, *([0] * zeros)), exponent - zeros))


hashable_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-3, 40),  # small ints share hash buckets, so a set's order follows insertion
    texts,
    st.binary(max_size=6),
    st.floats(),
    st.decimals().filter(lambda d: not d.is_snan()),  # a signalling NaN cannot be hashed
    st.uuids(),
    st.dates(),
    st.datetimes(timezones=zones),
    st.times(timezones=st.one_of(st.none(), offsets)),
    st.sampled_from([*Color, *Level, *Kind]),
)
scalars = st.one_of(hashable_scalars, st.binary(max_size=6).map(bytearray), st.decimals())
hashables = st.recursive(hashable_scalars, lambda inner: st.lists(inner, max_size=3).map(tuple), max_leaves=4)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(hashables, inner, max_size=4),
        st.sets(hashable_scalars, max_size=4),
        st.frozensets(hashable_scalars, max_size=4),
    ),
    max_leaves=12,
)


def lookalikes(value: Any) -> list[Any]:
    """Other values that print like ``value``: its text forms and the text of its key."""
    found: list[Any] = []
    for render in (str, repr, lambda v: json.dumps(v, default=str, sort_keys=True, separators=(",", ":"))):
        with contextlib.suppress(TypeError, ValueError, ArithmeticError, RecursionError):  # no such text form
            found.append(render(value))
    for attribute in ("isoformat", "hex"):
        method = getattr(value, attribute, None)
        if callable(method):
            try:
                text = method()
            except TypeError:
                continue
            found += [text, "0x" + text]
    key = key_of(ONE_VALUE["template"], value)
    if key is not None:
        rendered = key.removeprefix("v:")
        found += [rendered, urllib.parse.unquote(rendered)]
    if isinstance(value, (list, tuple)):
        found.append([next(iter(lookalikes(item)), item) for item in value])
    if isinstance(value, (list, tuple, set, frozenset)):  # one empty item more or less
        found += [[*value, ""], [item for item in value if item != ""]]
        with contextlib.suppress(TypeError):  # unhashable items
            found.append({*value, ""})
    return found


def respellings(value: Any, zone: datetime.tzinfo, zeros: int) -> list[Any]:
    """Other spellings of the same value: what a caller or the transport may turn it into."""
    while isinstance(value, enum.Enum):
        value = value.value
    found: list[Any] = []
    if isinstance(value, bool) or value is None:
        return [value]
    if isinstance(value, int):
        found.append(int(value))
        with contextlib.suppress(ValueError):  # too long for str()
            found.append(str(value))
    elif isinstance(value, uuid.UUID):
        found.append(str(value))
    elif isinstance(value, str) and value.lstrip("-").isdigit() and value == str(_int_or_none(value)):
        found.append(int(value))
    elif isinstance(value, float):
        found.append(-value if value == 0 else value)
    elif isinstance(value, decimal.Decimal):
        found += [_respell_decimal(value, zeros), -value if value.is_zero() else value]
    elif isinstance(value, datetime.datetime) and value.utcoffset() is not None:
        with contextlib.suppress(OverflowError):
            found.append(value.astimezone(zone))
    elif isinstance(value, (bytes, bytearray)):
        found += [bytes(value), bytearray(value)]
    elif isinstance(value, (list, tuple)):
        items = [respellings(item, zone, zeros)[-1] for item in value]
        found += [items, tuple(items)]
    elif isinstance(value, dict):
        found.append({k: respellings(v, zone, zeros)[-1] for k, v in reversed(list(value.items()))})
    elif isinstance(value, (set, frozenset)):
        backwards = list(value)[::-1]  # colliding members iterate in insertion order
        found += [set(backwards), frozenset(backwards)]
    return found or [value]


def _int_or_none(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


# --- properties -------------------------------------------------------------------------------------


@PROPERTY
@given(a=values, b=values)
def test_independent_values_share_a_key_only_when_equal(a: Any, b: Any) -> None:
    """Any two generated values: same key in every form iff the rule calls them the same value."""
    check(ONE_VALUE, (a,), (b,))


@PROPERTY
@given(a=values, data=st.data())
def test_a_value_never_shares_a_key_with_its_lookalikes(a: Any, data: st.DataObject) -> None:
    """Strings spelling a value (its str, repr, JSON, ISO or hex text, its very key) are other values."""
    candidates = lookalikes(a)
    assume(candidates)
    b = data.draw(st.sampled_from(candidates))
    check(ONE_VALUE, (a,), (b,))


@PROPERTY
@given(a=values, zone=st.one_of(st.just(UTC), offsets, st.timezones()), zeros=st.integers(0, 3))
def test_spellings_of_one_value_share_its_key(a: Any, zone: datetime.tzinfo, zeros: int) -> None:
    """An int or its digits, a tuple or a list, a datetime in another zone, 12.5 or 12.50, ...: one key."""
    for b in respellings(a, zone, zeros):
        check(ONE_VALUE, (a,), (b,))


@PROPERTY
@given(a=values, b=values, c=values, d=values)
def test_two_field_keys_are_injective(a: Any, b: Any, c: Any, d: Any) -> None:
    """With two fields, values never leak across the boundary: (a, b) and (c, d) agree iff both pairs do."""
    check(TWO_VALUES, (a, b), (c, d))
    check(TWO_VALUES, (a, b), (b, a))


@PROPERTY
@given(a=values, data=st.data())
def test_two_field_keys_resist_lookalikes(a: Any, data: st.DataObject) -> None:
    """A lookalike in either field, beside the other value, still gives another key."""
    candidates = lookalikes(a)
    assume(candidates)
    b = data.draw(st.sampled_from(candidates))
    other = data.draw(values)
    check(TWO_VALUES, (a, other), (b, other))
    check(TWO_VALUES, (other, a), (other, b))


# --- publisher and worker agree ---------------------------------------------------------------------

#: What Celery's JSON serializer carries (kombu's encoder: datetimes, dates, times, Decimals, UUIDs
#: and bytes keep their type; tuples become lists; dict keys must be strings, or ints that become
#: their digits). Sets, bytearrays and plain Enums cannot be sent as JSON at all.
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    texts,
    st.binary(max_size=6),
    st.floats(),
    st.decimals(),
    st.uuids(),
    st.dates(),
    st.datetimes(timezones=zones),
    st.times(timezones=st.one_of(st.none(), offsets)),
    st.sampled_from([*Level, *Kind]),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(st.one_of(texts, st.integers()), inner, max_size=4).filter(
            lambda d: len({str(k) for k in d}) == len(d) and set(d) != {"__type__", "__value__"}
        ),
    ),
    max_leaves=12,
)


def delivered(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """The arguments a worker gets: the message body through Celery's default (JSON) serializer."""
    content_type, encoding, body = dumps((args, kwargs, {}), serializer="json")
    got_args, got_kwargs, _ = loads(body, content_type, encoding)
    return got_args, got_kwargs


@pytest.mark.parametrize("form", list(TWO_VALUES))
@PROPERTY
@given(a=json_values, b=json_values)
def test_the_worker_derives_the_publishers_key_from_json_arguments(form: str, a: Any, b: Any) -> None:
    """A key derived from delivered JSON arguments (the guard's fallback) equals the publisher's."""
    spec = TWO_VALUES[form]
    args, kwargs = delivered((a,), {"b": b})
    try:
        published = spec.business_key((a,), {"b": b})
    except DedupKeyError:
        with pytest.raises(DedupKeyError):
            spec.business_key(args, kwargs)
        return
    assert spec.business_key(args, kwargs) == published, (a, b, args, kwargs)


def test_a_worker_keys_a_delivery_without_header_as_its_publisher_did(make_app: AppFactory) -> None:
    """A while_executing delivery carries no ``dedup`` header: the worker derives its key from the JSON
    arguments it received (tuples now lists, a zoned datetime now a fixed offset, int dict keys now
    strings), and the publisher's ``dedup_status`` with the original arguments finds that run's record."""
    app = make_app("keys_worker")

    @app.task(base=DedupTask, name="keys.ship", dedup_mode="while_executing", shared=False)
    def ship(order: Any, when: Any, lines: Any) -> str:
        return "shipped"

    args = (
        (uuid.UUID("12345678-1234-5678-1234-56789abcdef0"), 42),
        datetime.datetime(2024, 3, 31, 2, 30, tzinfo=datetime.timezone(datetime.timedelta(hours=2))),
        {7: [decimal.Decimal("12.50"), b"\xff", Level.HIGH, Kind.ORDER, (1, ("a", ""))]},
    )
    with in_process_worker(app):
        assert ship.delay(*args).get(timeout=20) == "shipped"
    record = wait_for(lambda: ship.dedup_status(*args), 10, "a record under the publisher's key")
    assert record is not None and record.state == "succeeded", record
