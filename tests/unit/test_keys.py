"""Business keys and task ids: canonical, type-stable, safe, injective, and clear when they cannot be built.

These are unit tests of :mod:`celery_dedup.keys`; no server is needed.
"""

from __future__ import annotations

import datetime
import decimal
import enum
import hashlib
import inspect
import random
import re
import socket
import subprocess
import sys
import urllib.parse
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from celery_dedup import DedupConfigError, DedupKeyError
from celery_dedup.keys import KeyOption, KeySpec, new_task_id, split_member, task_from_namespace, task_namespace

ROOT = Path(__file__).resolve().parents[2]
TASK = "shop.charge"
# Escapes are %XX with upper-case hex; a '%' outside that shape would make decoding ambiguous.
ESCAPED = re.compile(r"(?:[^%]|%[0-9A-F]{2})*")


def spec(option: KeyOption, fn: Callable[..., Any], max_length: int = 200, task: str = TASK) -> KeySpec:
    return KeySpec(task, option, inspect.signature(fn), max_length)


def charge(order_id: Any, amount: Any = 0, currency: Any = "EUR") -> None: ...


def pair(a: Any, b: Any) -> None: ...


def one(a: Any) -> None: ...


def assert_safe(key: str, max_length: int) -> None:
    """A key Redis, logs and Flower can carry: bounded, single-line, no blanks, well-formed escapes."""
    assert 0 < len(key) <= max_length, (len(key), key)
    bad = [c for c in key if c.isspace() or not c.isprintable()]
    assert not bad, f"whitespace/control characters {bad!r} in {key!r}"
    readable = key.split("#", 1)[0] if _is_hashed(key) else key
    assert ESCAPED.fullmatch(readable), f"broken %XX escape in {readable!r}"


def _is_hashed(key: str) -> bool:
    return re.search(r"#[0-9a-f]{16,}$", key) is not None


# --- canonical form ---------------------------------------------------------------------------------


def test_positional_keyword_and_default_filled_calls_agree() -> None:
    """Every spelling of the same call binds to the same arguments, so to the same key."""
    s = spec("order:{order_id}:{currency}", charge)
    keys = {
        s.business_key((42,), {}),
        s.business_key((), {"order_id": 42}),
        s.business_key((42, 0), {}),
        s.business_key((42,), {"currency": "EUR"}),
        s.business_key((42, 0, "EUR"), {}),
        s.business_key(None, {"currency": "EUR", "amount": 0, "order_id": 42}),
    }
    assert len(keys) == 1, keys
    assert s.business_key((42,), {"currency": "USD"}) not in keys


def _outcome(s: KeySpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    try:
        return s.business_key(args, kwargs)
    except DedupKeyError as exc:
        return f"error: {exc}"


@settings(max_examples=300, deadline=None)
@given(
    positional=st.lists(st.integers(0, 3), max_size=4),
    named=st.dictionaries(st.sampled_from(["order_id", "amount", "currency", "nope"]), st.integers(0, 3), max_size=4),
)
@pytest.mark.parametrize("option", ["o:{order_id}:{currency}", ["amount", "order_id"], None])
def test_a_plain_signature_binds_every_call_as_signature_bind_does(
    option: KeyOption, positional: list[int], named: dict[str, int]
) -> None:
    """Calls of a task whose parameters are all positional-or-keyword are bound without ``Signature.bind``:
    each gets the key (or the error) that binding it would give, defaults, repeats and unknowns included."""
    fast = spec(option, charge)
    bound = spec(option, charge)
    bound._plain = None  # what every other signature takes: Signature.bind
    assert fast._plain is not None
    args = tuple(positional)
    assert _outcome(fast, args, named) == _outcome(bound, args, named)


@pytest.mark.parametrize("option", ["o:{order_id}:{amount}:{currency}", ["order_id", "amount", "currency"], None])
def test_kwargs_order_is_irrelevant(option: KeyOption) -> None:
    """Keyword arguments in any order give one key, in every key form."""
    s = spec(option, charge)
    a = s.business_key((), {"order_id": 1, "amount": 2, "currency": "X"})
    b = s.business_key((), {"currency": "X", "amount": 2, "order_id": 1})
    assert a == b


def test_var_keyword_task_keyed_on_a_passed_kwarg() -> None:
    """A ``**kwargs`` task may name a key that callers pass by keyword; a call without it is refused."""

    def handler(**kwargs: Any) -> None: ...

    s = spec("user:{user_id}", handler)
    assert s.business_key((), {"user_id": 7}) == s.business_key((), {"other": 1, "user_id": 7})
    assert s.business_key((), {"user_id": 7}) != s.business_key((), {"user_id": 8})
    assert "7" in s.business_key((), {"user_id": 7})
    with pytest.raises(DedupKeyError) as info:
        s.business_key((), {"other": 1})
    assert info.value.task == TASK
    assert info.value.argument == "user_id"


def test_var_keyword_all_arguments_form_ignores_kwargs_order() -> None:
    """With ``dedup_key=None`` a ``**kwargs`` task's extra keywords are canonical, not in call order."""

    def handler(a: Any, **kwargs: Any) -> None: ...

    s = spec(None, handler)
    assert s.business_key((1,), {"x": 1, "y": 2}) == s.business_key((1,), {"y": 2, "x": 1})


def test_list_form_renders_name_equals_value() -> None:
    """A list of argument names renders ``name=value`` pairs in list order, defaults filled in."""
    s = spec(["order_id", "currency"], charge)
    key = s.business_key((42,), {})
    assert key == "order_id=42,currency=EUR"
    assert s.business_key((), {"order_id": 42, "amount": 999}) == key, "unnamed arguments do not count"


def test_none_form_renders_every_argument_in_signature_order() -> None:
    """``dedup_key=None`` uses every argument, in the order the task declares them."""

    def task(b: Any, a: Any = 1) -> None: ...

    s = spec(None, task)
    assert s.business_key((2,), {}) == "b=2,a=1"
    assert s.business_key((), {"a": 1, "b": 2}) == "b=2,a=1"
    assert s.business_key((2, 3), {}) != s.business_key((3, 2), {})


def test_callable_form_keys_by_the_callable_result() -> None:
    """A callable taking the task's arguments chooses the key; equal results mean equal keys."""
    seen: list[tuple[Any, ...]] = []

    def key_of(order_id: Any, amount: Any = 0, currency: Any = "EUR") -> str:
        seen.append((order_id, amount, currency))
        return f"ord-{order_id}/{currency}"

    s = spec(key_of, charge)
    key = s.business_key((42,), {})
    assert key == s.business_key((), {"order_id": 42, "amount": 5})
    assert key != s.business_key((42,), {"currency": "USD"})
    assert "ord-42" in key
    assert seen, "the callable was consulted"


def test_callable_result_is_made_safe() -> None:
    """Whatever a callable returns is escaped and bounded like any other key."""

    def key_of(order_id: Any, **_: Any) -> str:
        return f"order {order_id}\n\t{{x}}" + "y" * 1000

    key = spec(key_of, charge, max_length=80).business_key((1,), {})
    assert_safe(key, 80)


def test_callable_that_raises_gives_key_error_naming_the_task() -> None:
    """A failing key callable surfaces as DedupKeyError (with the cause kept), not a bare exception."""

    def key_of(order_id: Any, **_: Any) -> str:
        raise LookupError("no such order")

    with pytest.raises(DedupKeyError) as info:
        spec(key_of, charge).business_key((1,), {})
    assert info.value.task == TASK
    assert TASK in str(info.value)
    assert "no such order" in str(info.value)
    assert isinstance(info.value.__cause__, LookupError)


# --- type-stable rendering --------------------------------------------------------------------------


class Color(enum.Enum):
    RED = "red"


class Level(enum.IntEnum):
    HIGH = 3


class LoudInt(int):
    def __str__(self) -> str:
        return "not the number"

    __repr__ = __str__


def render(value: Any) -> str:
    """The rendered key of a one-field template, minus its literal prefix."""
    return spec("v:{a}", one, max_length=10_000).business_key((value,), {}).removeprefix("v:")


def test_scalars_render_in_a_type_stable_form() -> None:
    """Each scalar type has one documented text form, independent of its __str__/__repr__."""
    assert render(42) == "42"
    assert render(LoudInt(42)) == "42", "an int subclass renders as its value"
    assert render(True) == "{true}"
    assert render(False) == "{false}"
    assert render(True) != render(1), "bools do not collapse into ints"
    assert render(None) == "{null}", "tagged: the string 'null' keeps the plain form"
    assert render(-7) == "-7"


@pytest.mark.parametrize("value", [0.1, 0.1 + 0.2, -0.0, 1e300, 1.0, float("inf"), float("-inf")])
def test_floats_render_round_trippable(value: float) -> None:
    """Floats render, tagged, in their shortest round-trip form: equal floats agree, distinct ones differ."""
    text = render(value)
    assert text.startswith("{float}")
    assert float(text.removeprefix("{float}")) == value
    assert render(float(text.removeprefix("{float}"))) == text
    assert render(1.0) != render(1.5)
    assert render(float("nan")) == render(-float("nan")) == "{float}nan"


def test_decimal_uuid_and_time_values() -> None:
    """Decimal, UUID and dates render in canonical text; spellings of one UUID agree."""
    assert render(decimal.Decimal("12.50")) == render(decimal.Decimal("12.5")) == "{decimal}12.5"
    assert render(decimal.Decimal("100")) == "{decimal}100"
    assert render(decimal.Decimal("1E+40")) == "{decimal}1E+40", "long runs of zeros keep an exponent"
    assert render(decimal.Decimal("0.0001")) == "{decimal}0.0001"
    assert render(decimal.Decimal("1.0000000000000000000000000000001")) != render(decimal.Decimal(1)), "no rounding"
    braced = uuid.UUID("{12345678-1234-5678-1234-56789ABCDEF0}")
    bare = uuid.UUID("1234567812345678123456789ABCDEF0")
    assert render(braced) == render(bare) == "12345678-1234-5678-1234-56789abcdef0"
    assert render(uuid.UUID(int=braced.int + 1)) != render(braced)
    day = datetime.date(2024, 1, 2)
    moment = datetime.datetime(2024, 1, 2, 3, 4, 5, 6000, tzinfo=datetime.timezone.utc)
    assert render(day) == "{date}2024-01-02"
    assert urllib.parse.unquote(render(moment)) == "{datetime}" + moment.isoformat()
    assert urllib.parse.unquote(render(datetime.time(3, 4))) == "{time}03:04:00"
    assert render(day) != render(datetime.datetime(2024, 1, 2)), "a date is not midnight of that date"
    assert_safe(render(moment), 200)


def test_enums_render_as_their_values() -> None:
    """An Enum member renders as its value, so callers may pass the member or the raw value."""
    assert render(Color.RED) == render("red")
    assert render(Level.HIGH) == render(3)


def test_bytes_render_as_hex() -> None:
    """bytes and bytearray render alike as tagged hex, never as a Python repr."""
    assert render(b"A") == "{bytes}41"
    assert render(b"\x00\xff") == render(bytearray(b"\x00\xff"))
    assert render(b"\x00\xff") != render(b"\x00\xfe")
    assert "b'" not in render(b"\x00\xff")
    assert "ff" in render(b"\x00\xff").lower()


def test_containers_render_canonically() -> None:
    """Dicts sort their entries and sets their members, so construction order never changes a key.

    Lists and tuples render as ``[a,b]``, dicts as ``{k=v,...}``, sets as ``{set}[...]``;
    items render as argument values do, inside brackets no string can spell.
    """
    assert render({"b": 1, "a": 2}) == render({"a": 2, "b": 1}) == "{a=2,b=1}"
    assert render({"b": 1, "a": 2}) != render({"b": 2, "a": 1})
    words = [f"w{i}" for i in range(64)]
    forward, backward = set(words), set()
    for word in reversed(words):
        backward.add(word)
    assert render(forward) == render(backward) == render(frozenset(words))
    assert render([1, 2]) == render((1, 2)) == "[1,2]"
    assert render([1, 2]) != render([2, 1]), "sequences keep their order"
    assert render(["a:b", "c,d"]) == "[a%3Ab,c%2Cd]"
    nested = {"when": datetime.date(2024, 1, 2), "ids": {3, 1, 2}, "amount": decimal.Decimal("1.5"), "c": Color.RED}
    assert render(nested) == render(dict(reversed(list(nested.items()))))
    assert render(nested) == "{amount={decimal}1.5,c=red,ids={set}[1,2,3],when={date}2024-01-02}"


def test_set_and_dict_keys_agree_across_processes() -> None:
    """Publishers in other processes (other hash seeds) compute the same key for sets and dicts."""
    code = (
        "import inspect, sys\n"
        "from celery_dedup.keys import KeySpec\n"
        "def one(a): ...\n"
        "s = KeySpec('t', 'v:{a}', inspect.signature(one), 10_000)\n"
        "value = {'tags': {f'tag-{i}' for i in range(50)}, 'z': 1, 'a': frozenset({'x', 'y', 'q'})}\n"
        "sys.stdout.write(s.business_key((value,), {}))\n"
    )
    here = spec("v:{a}", one, max_length=10_000).business_key(
        ({"a": frozenset({"q", "y", "x"}), "tags": {f"tag-{i}" for i in reversed(range(50))}, "z": 1},), {}
    )
    for seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        assert out.stdout == here, f"PYTHONHASHSEED={seed}"


# --- strange input ----------------------------------------------------------------------------------

STRANGE = [
    "a:b",
    "{a}",
    "}{",
    "100%",
    "%3A",
    "line1\nline2",
    "tab\there",
    "two  spaces",
    " lead",
    "trail ",
    "\x00nul",
    "esc\x1b[31m",
    "del\x7f",
    "\u2028sep",
    "nb\u00a0sp",
    "zw\u200bsp",
    "\ud800lone",
    "😀",
    "",
    "*",
    "#",
    "~",
    "a=b,c=d",
    "[1,2]",
    "{null}",
]


@pytest.mark.parametrize("value", STRANGE)
def test_strange_values_give_safe_keys(value: str) -> None:
    """Separators, braces, percent signs, blanks and control characters are escaped away."""
    key = spec("x:{a}:{b}", pair).business_key((value, "end"), {})
    assert_safe(key, 200)
    assert key.startswith("x:") and key.endswith(":end")
    assert key.count(":") == 2, "a value can never add a field separator"


def test_readable_unicode_letters_are_kept() -> None:
    """Letters in any script stay as they are, so keys stay readable."""
    for word in ("café", "東京", "Ωmega", "Привет", "naïve-ß"):
        key = spec("city:{a}", one).business_key((word,), {})
        assert key == f"city:{word}"


def test_template_literals_are_made_safe() -> None:
    """Blanks and percent signs in the template's own text are escaped too."""

    key = spec("order {a} 100%", one).business_key((1,), {})
    assert_safe(key, 200)
    assert "1" in key


def test_huge_value_is_bounded_with_readable_prefix_and_hash() -> None:
    """A 10 kB value gives a key of at most dedup_max_key_length: readable prefix, '#', hash of the whole."""
    s = spec("doc:{a}", one, max_length=200)
    big = "hello world " * 850
    key = s.business_key((big,), {})
    assert_safe(key, 200)
    assert _is_hashed(key)
    assert key.startswith("doc:hello%20world%20hello")
    assert key != s.business_key((big + "!",), {}), "the hash covers the tail"
    assert key != s.business_key(("!" + big[1:],), {})
    assert key == s.business_key((big,), {}), "bounding is deterministic"
    full = spec("doc:{a}", one, max_length=10**9).business_key((big,), {})
    prefix, _, digest = key.partition("#")
    assert full.startswith(prefix)
    assert digest in hashlib.sha256(full.encode()).hexdigest()


@pytest.mark.parametrize("max_length", [64, 65, 66, 100, 200])
def test_bounded_key_never_ends_inside_an_escape(max_length: int) -> None:
    """Whatever the cut position, the readable prefix ends on a whole %XX escape before the '#'."""
    s = spec("k:{a}", one, max_length=max_length)
    for pad in range(12):
        for filler in (":", "\n", "%", "\u2028", "é:"):
            key = s.business_key(("a" * pad + filler * 200,), {})
            assert_safe(key, max_length)
            assert _is_hashed(key)
            prefix = key.split("#", 1)[0]
            assert ESCAPED.fullmatch(prefix), prefix
            assert not re.search(r"%[0-9A-F]?$", prefix), prefix


@pytest.mark.parametrize("max_length", [64, 65, 66, 67, 100])
def test_bounded_key_never_splits_an_escaped_character(max_length: int) -> None:
    """The readable prefix decodes to whole characters: a multi-byte escape (%E2%80%A8) is never cut."""
    s = spec("k:{a}", one, max_length=max_length)
    for pad in range(12):
        key = s.business_key(("a" * pad + "\u2028" * 100,), {})
        prefix = key.split("#", 1)[0]
        raw = urllib.parse.unquote_to_bytes(prefix)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            pytest.fail(f"prefix {prefix!r} ends inside a multi-byte character")


def test_kwarg_names_of_var_keyword_tasks_are_made_safe() -> None:
    """Keyword names a caller invents (``**kwargs``) cannot smuggle blanks or control characters into a key."""

    def handler(**kwargs: Any) -> None: ...

    key = spec(None, handler).business_key((), {"a b": 1, "x\ny": 2, "t\x00": 3})
    assert_safe(key, 200)


# Single characters that could blur structure, multi-byte letters, and text that looks like an escape.
_TOKENS = [*":{}[]%\n\t \r\x00\x1b\x7f,=#~*", "é", "東", "\u2028", "\u00a0", "😀", *"ab0", "%3A", "%25", "x:", "a="]


def _random_value(rng: random.Random) -> str:
    # Mostly short values (dense with separators), sometimes long ones that get hashed.
    size = rng.choice((0, 1, 1, 2, 3, 4, 6, 8, 60))
    return "".join(rng.choice(_TOKENS) for _ in range(size))


def _assert_injective(s: KeySpec, separator: str, seed: int) -> None:
    rng = random.Random(seed)
    inputs: set[tuple[str, str]] = set()
    for _ in range(2000):
        a, b, c = _random_value(rng), _random_value(rng), _random_value(rng)
        inputs.add((a, b))
        # Moving text (with or without the form's own separator) across the field boundary
        # is how a value could forge another field.
        inputs.add((a + separator + c, b))
        inputs.add((a, c + separator + b))
        if a:
            inputs.add((a[:-1], a[-1] + b))
    seen: dict[str, tuple[str, str]] = {}
    for a, b in inputs:
        key = s.business_key((a, b), {})
        assert_safe(key, s.max_length)
        other = seen.setdefault(key, (a, b))
        assert other == (a, b), f"{other!r} and {(a, b)!r} share key {key!r}"
    assert len(seen) == len(inputs) > 4000


@pytest.mark.parametrize("max_length", [200, 64])
def test_template_keys_are_injective(max_length: int) -> None:
    """Randomised: distinct argument pairs never share a key under ``"x:{a}:{b}"``, hashed or not."""
    _assert_injective(spec("x:{a}:{b}", pair, max_length=max_length), ":", seed=20240917 + max_length)


@pytest.mark.parametrize("option", [["a", "b"], None], ids=["names", "all-arguments"])
def test_name_list_and_all_argument_keys_are_injective(option: KeyOption) -> None:
    """Randomised: the ``name=value`` forms are injective too, whatever ',' and '=' the values hold."""
    _assert_injective(spec(option, pair), ",b=", seed=7)


def test_list_form_values_cannot_forge_another_field() -> None:
    """A value holding ``,b=`` must not read as a second field (targeted case of the check above)."""
    s = spec(["a", "b"], pair)
    assert s.business_key(("1,b=2", "3"), {}) != s.business_key(("1", "2,b=3"), {})


def test_hashed_key_cannot_be_forged_by_a_short_value() -> None:
    """A short value spelling '<prefix>#<hash>' must not collide with the long value that hashes to it."""
    s = spec("x:{a}", one, max_length=100)
    long_key = s.business_key(("a" * 300,), {})
    assert _is_hashed(long_key)
    forged = long_key.removeprefix("x:")
    assert s.business_key((forged,), {}) != long_key


def test_empty_value_and_placeholder_do_not_collide() -> None:
    """A key that renders empty is not confused with a value that is literally the placeholder."""
    s = spec("{a}", one)
    assert s.business_key(("",), {}) != s.business_key(("*",), {})


# --- distinct values, distinct keys ----------------------------------------------------------------

#: Pairs of distinct values whose plain text is alike: each must give two keys, in every key form.
LOOKALIKES = [
    pytest.param(None, "null", id="None-null"),
    pytest.param(True, "true", id="True-true"),
    pytest.param(False, "false", id="False-false"),
    pytest.param(b"A", "0x41", id="bytes-hex-text"),
    pytest.param(datetime.date(2024, 1, 1), "2024-01-01", id="date-iso-text"),
    pytest.param(datetime.datetime(2024, 1, 1, 3, 4), "2024-01-01T03:04:00", id="datetime-iso-text"),
    pytest.param(datetime.time(3, 4), "03:04:00", id="time-iso-text"),
    pytest.param({1: "a", "1": "b"}, {"1": "b"}, id="dict-losing-an-entry"),
    pytest.param(1.5, "1.5", id="float-text"),
    pytest.param(float("nan"), "nan", id="nan-text"),
    pytest.param(1.0, 1, id="float-int"),
    pytest.param(decimal.Decimal("1.5"), "1.5", id="decimal-text"),
    pytest.param(decimal.Decimal("1.5"), 1.5, id="decimal-float"),
    pytest.param(["a"], '["a"]', id="list-json-text"),
    pytest.param([1, 2], "[1,2]", id="int-list-json-text"),
    pytest.param({"a": 1}, '{"a":1}', id="dict-json-text"),
    pytest.param({1, 2}, [1, 2], id="set-list"),
    pytest.param([None], ["null"], id="None-in-list"),
    pytest.param([datetime.date(2024, 1, 1)], ["2024-01-01"], id="date-in-list"),
    pytest.param({True: 1}, {"true": 1}, id="bool-dict-key"),
    pytest.param([], [""], id="empty-list-and-empty-string-item"),
    pytest.param(set(), {""}, id="empty-set-and-empty-string-member"),
    pytest.param(10**5000, hex(10**5000), id="huge-int-hex-text"),
]


def _key_of(a: Any) -> Any:
    return a


KEY_FORMS = [
    pytest.param("v:{a}", id="template"),
    pytest.param(["a"], id="names"),
    pytest.param(None, id="all-arguments"),
    pytest.param(_key_of, id="callable"),
]


@pytest.mark.parametrize("option", KEY_FORMS)
@pytest.mark.parametrize(("a", "b"), LOOKALIKES)
def test_distinct_values_that_look_alike_get_distinct_keys(option: KeyOption, a: Any, b: Any) -> None:
    """A value never shares a key with a different value that prints alike (None/"null", b"A"/"0x41", ...)."""
    s = spec(option, one, max_length=100_000)
    if option is _key_of and (a is None or a in ([], set())):
        with pytest.raises(DedupKeyError):  # a callable returning nothing is refused, see below
            s.business_key((a,), {})
        return
    assert s.business_key((a,), {}) != s.business_key((b,), {})


#: Pairs of values that are the same unit of work however they were spelled or transported.
SAME_VALUE = [
    pytest.param(42, "42", id="int-and-its-digits"),
    pytest.param(-7, "-7", id="negative-int-and-its-digits"),
    pytest.param(
        uuid.UUID("12345678-1234-5678-1234-56789abcdef0"), "12345678-1234-5678-1234-56789abcdef0", id="uuid-and-text"
    ),
    pytest.param((1, "a"), [1, "a"], id="tuple-and-list"),
    pytest.param([(1, 2)], [[1, 2]], id="nested-tuple-and-list"),
    pytest.param({"b": 1, "a": 2}, {"a": 2, "b": 1}, id="dict-order"),
    pytest.param({1: "x"}, {"1": "x"}, id="int-dict-key-and-its-digits"),
    pytest.param(-0.0, 0.0, id="negative-zero"),
    pytest.param(decimal.Decimal("12.50"), decimal.Decimal("12.5"), id="decimal-trailing-zero"),
    pytest.param(decimal.Decimal("-0"), decimal.Decimal("0.00"), id="decimal-zeros"),
    pytest.param(decimal.Decimal("1E+2"), decimal.Decimal("100"), id="decimal-exponent"),
    pytest.param(b"ab", bytearray(b"ab"), id="bytes-and-bytearray"),
    pytest.param(frozenset({1, 2}), {2, 1}, id="frozenset-and-set"),
    pytest.param(Color.RED, "red", id="enum-and-value"),
    pytest.param([Level.HIGH], [3], id="int-enum-in-list-and-what-json-delivers"),
    pytest.param("\ud800\udc00", "\U00010000", id="surrogate-pair-and-what-json-delivers"),
    pytest.param(
        datetime.datetime(2024, 1, 1, 12, tzinfo=datetime.timezone.utc),
        datetime.datetime(2024, 1, 1, 13, tzinfo=datetime.timezone(datetime.timedelta(hours=1))),
        id="one-instant-two-zones",
    ),
]


@pytest.mark.parametrize("option", KEY_FORMS)
@pytest.mark.parametrize(("a", "b"), SAME_VALUE)
def test_equal_values_share_a_key(option: KeyOption, a: Any, b: Any) -> None:
    """Spellings of one value agree: an id as int or digits, a tuple or the list JSON makes of it, ..."""
    s = spec(option, one, max_length=100_000)
    assert s.business_key((a,), {}) == s.business_key((b,), {})


def test_ints_and_plain_strings_keep_their_readable_keys() -> None:
    """The common case reads as before: ``order:42``, ``order:abc``, ``order_id=42``."""
    assert spec("order:{a}", one).business_key((42,), {}) == "order:42"
    assert spec("order:{a}", one).business_key(("abc",), {}) == "order:abc"
    assert spec(["a"], one).business_key((42,), {}) == "a=42"
    assert spec(None, pair).business_key((42, "abc"), {}) == "a=42,b=abc"
    assert spec(lambda a: f"order:{a}", one).business_key((42,), {}) == "order:42"


# --- keys that carry nothing ------------------------------------------------------------------------


class Nothing(enum.Enum):
    NONE = None


@pytest.mark.parametrize(
    "result",
    [None, "", (), [], {}, set(), frozenset(), b"", Nothing.NONE],
    ids=[
        "None",
        "empty-str",
        "empty-tuple",
        "empty-list",
        "empty-dict",
        "empty-set",
        "empty-frozenset",
        "empty-bytes",
        "enum-of-None",
    ],
)
def test_callable_returning_no_key_is_refused(result: Any) -> None:
    """A dedup_key callable that returns None or an empty value (a forgotten ``return``, a missing field)
    would give every call one key; it is refused with DedupKeyError naming the task and the value."""

    def key_of(order_id: Any, **_: Any) -> Any:
        return result

    s = spec(key_of, charge)
    with pytest.raises(DedupKeyError) as info:
        s.business_key((1,), {})
    assert info.value.task == TASK
    assert TASK in str(info.value)
    assert repr(result) in str(info.value)
    assert "dedup_key" in str(info.value)


@pytest.mark.parametrize("option", ["order:{a}", ["a"], None], ids=["template", "names", "all-arguments"])
def test_empty_and_none_argument_values_are_keys(option: KeyOption) -> None:
    """Argument data is never refused for being empty: equal arguments are one call, and "" differs from None."""
    s = spec(option, one)
    keys = {s.business_key((value,), {}) for value in ("", None, "*", (), 0, False)}
    assert len(keys) == 6, keys


def test_a_task_without_arguments_has_the_key_star() -> None:
    """A task that takes no arguments has one key, ``*``, under the all-arguments form."""

    def tick() -> None: ...

    assert spec(None, tick).business_key((), {}) == "*"


# --- errors -----------------------------------------------------------------------------------------


class _Obj:
    pass


def _unserialisable() -> list[tuple[str, Callable[[], Any]]]:
    return [
        ("object", object),
        ("lambda", lambda: lambda: None),
        ("instance", _Obj),
        ("in-list", lambda: [1, object()]),
        ("in-dict-value", lambda: {"k": object()}),
        ("dict-key", lambda: {_Obj(): 1}),
        ("in-set", lambda: {1, _Obj()}),
    ]


@pytest.mark.parametrize("make", [m for _, m in _unserialisable()], ids=[n for n, _ in _unserialisable()])
@pytest.mark.parametrize("option", ["order:{order_id}", ["order_id"], None], ids=["template", "names", "all"])
def test_unserialisable_argument_names_task_and_argument(make: Callable[[], Any], option: KeyOption) -> None:
    """An argument with no canonical text form is refused with a DedupKeyError naming task and argument."""
    value = make()
    with pytest.raises(DedupKeyError) as info:
        spec(option, charge).business_key((value,), {})
    assert info.value.task == TASK
    assert info.value.argument == "order_id"
    assert TASK in str(info.value) and "order_id" in str(info.value)


def test_socket_argument_is_refused() -> None:
    """A live resource such as a socket is refused, not rendered by repr (which holds addresses)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        with pytest.raises(DedupKeyError) as info:
            spec("order:{order_id}", charge).business_key((sock,), {})
    finally:
        sock.close()
    assert (info.value.task, info.value.argument) == (TASK, "order_id")


def test_hostile_repr_does_not_hide_the_key_error() -> None:
    """An argument whose __repr__ raises still yields a readable DedupKeyError."""

    class Hostile:
        def __repr__(self) -> str:
            raise RuntimeError("boom")

    with pytest.raises(DedupKeyError) as info:
        spec("order:{order_id}", charge).business_key((Hostile(),), {})
    assert "order_id" in str(info.value)


@pytest.mark.parametrize(
    "value",
    [pytest.param(10**5000, id="int-with-5000-digits"), pytest.param([10**5000], id="huge-int-in-list")],
)
def test_huge_int_gives_a_key_or_a_key_error(value: Any) -> None:
    """An int too long for str() is bounded into a key or refused with DedupKeyError, never a ValueError."""
    s = spec("n:{a}", one)
    try:
        key = s.business_key((value,), {})
    except DedupKeyError as exc:
        assert exc.argument == "a"
    else:
        assert_safe(key, 200)
        assert key != s.business_key((value + 1 if isinstance(value, int) else [value[0] + 1],), {})


def test_self_referencing_container_gives_key_error() -> None:
    """A list containing itself is refused with DedupKeyError, not a RecursionError."""
    loop: list[Any] = [1]
    loop.append(loop)
    with pytest.raises(DedupKeyError) as info:
        spec("n:{a}", one).business_key((loop,), {})
    assert info.value.argument == "a"


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((), {}), ((1, 2, 3, 4), {}), ((1,), {"nope": 1}), ((1,), {"order_id": 1})],
    ids=["missing", "too-many", "unknown-kwarg", "given-twice"],
)
def test_arguments_that_do_not_fit_the_signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A call that the task itself would reject is refused with DedupKeyError naming the task."""
    with pytest.raises(DedupKeyError) as info:
        spec("order:{order_id}", charge).business_key(args, kwargs)
    assert info.value.task == TASK
    assert TASK in str(info.value)


@pytest.mark.parametrize(
    "option",
    [
        "order:{id}",
        "order:{0}",
        "order:{}",
        "order:{order_id!r}",
        "order:{order_id:>5}",
        "order:{order_id.real}",
        "order:{order_id[0]}",
        "order:{order_id",
        "order:}",
        "order:{order_id!}",
        ["order_id", "nope"],
        [],
        (),
        [1, 2],
        ["order_id", 3],
        {"order_id": 1},
        5,
        b"order_id",
    ],
)
def test_bad_key_option_is_a_config_error(option: Any) -> None:
    """A dedup_key that cannot work is refused when the spec is built, naming the task and the option."""
    with pytest.raises(DedupConfigError) as info:
        spec(option, charge)
    assert info.value.task == TASK
    assert info.value.setting == "dedup_key"
    assert TASK in str(info.value) and "dedup_key" in str(info.value)


def test_unknown_argument_error_lists_the_known_ones() -> None:
    """The error for an unknown template field says which arguments exist."""
    with pytest.raises(DedupConfigError) as info:
        spec("order:{id}", charge)
    assert "'id'" in str(info.value)
    assert "order_id" in info.value.reason


# --- task ids ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value", ["42", "line\nbreak and\ttab", "a" * 5000, "東京"], ids=["plain", "blanks", "long", "unicode"]
)
def test_task_ids_are_readable_unique_and_blank_free(value: str) -> None:
    """A task id starts with its business key, is new on each call, and carries no whitespace."""
    key = spec("order:{a}", one).business_key((value,), {})
    ids = [new_task_id(key) for _ in range(3000)]
    assert len(set(ids)) == len(ids)
    for task_id in ids:
        assert task_id.startswith(key)
        assert task_id != key
        assert not any(c.isspace() or not c.isprintable() for c in task_id), task_id


@pytest.mark.parametrize("name", ["shop.charge", "a:b", "50%off", "x%41y", "tâche {1}", "sp ace"])
def test_a_task_namespace_gives_its_task_name_back(name: str) -> None:
    """Counters and log lines name the task from the escaped namespace kept in Redis."""
    namespace = task_namespace(name)
    assert ":" not in namespace
    assert task_from_namespace(namespace) == name


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet=st.one_of(st.characters(), st.characters(categories=["Cs"]), st.sampled_from("%:{}#*,= "))))
@example("\ud800").via("a lone surrogate, as JSON's \\ud800 decodes to")
def test_a_task_namespace_round_trips_for_any_name(name: str) -> None:
    """Records of format 2 keep no ``task`` field: every name, lone surrogates included, comes back from its member."""
    namespace = task_namespace(name)
    assert ":" not in namespace and split_member(f"{namespace}:k") == (namespace, "k")
    assert task_from_namespace(namespace) == name


@pytest.mark.parametrize("namespace", ["a%3", "a%zz", "%", "50%25", "%e2%82%ac"])
def test_reading_a_namespace_no_escaping_made_keeps_what_it_cannot_read(namespace: str) -> None:
    """A namespace written by hand (or garbled) is read as far as it is escapes, never raising."""
    assert isinstance(task_from_namespace(namespace), str)
