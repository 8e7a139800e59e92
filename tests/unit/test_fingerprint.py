"""Arguments fingerprints: one per call's bound arguments, stable, short, and "" where there is no canonical form.

Unit tests of :func:`celery_dedup.keys.arguments_fingerprint` and
``KeySpec.key_and_fingerprint``; no server is needed. The gate compares
these (``dedup_on_mismatch``): tests/integration/test_mismatch.py.
"""

from __future__ import annotations

import datetime
import decimal
import inspect
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from celery_dedup.keys import FINGERPRINT_CHARS, KeySpec, arguments_fingerprint

ROOT = Path(__file__).resolve().parents[2]


def charge(order_id: Any, amount: Any = 0, currency: Any = "EUR") -> None: ...


def notify(user: Any, **extra: Any) -> None: ...


def spread(first: Any, *rest: Any) -> None: ...


def fingerprint(fn: Any, *args: Any, **kwargs: Any) -> str:
    """The fingerprint of a call of ``fn``, keyed by its first argument (the others need no key form)."""
    signature = inspect.signature(fn)
    spec = KeySpec("shop.task", [next(iter(signature.parameters))], signature, 200)
    key, found = spec.key_and_fingerprint(args, kwargs)
    assert key
    return found


def test_a_fingerprint_is_sixteen_hex_digits() -> None:
    found = fingerprint(charge, 42, 10)
    assert len(found) == FINGERPRINT_CHARS == 16
    assert int(found, 16) >= 0 and found == found.lower()


def test_defaults_are_applied_so_every_spelling_of_a_call_agrees() -> None:
    spellings = {
        fingerprint(charge, 42),
        fingerprint(charge, 42, 0),
        fingerprint(charge, 42, amount=0),
        fingerprint(charge, order_id=42),
        fingerprint(charge, 42, 0, "EUR"),
        fingerprint(charge, currency="EUR", order_id=42, amount=0),
    }
    assert len(spellings) == 1, spellings


def test_any_other_value_gives_another_fingerprint() -> None:
    calls = [(42,), (42, 10), (42, 0, "USD"), (43,), ("42",), (42.0,), (True,), (None,), ([42],)]
    found = [fingerprint(charge, *args) for args in calls]
    assert len(set(found)) == len(calls), dict(zip(map(repr, calls), found, strict=True))


def test_keyword_order_does_not_matter_nor_does_it_in_var_keywords() -> None:
    assert fingerprint(charge, amount=1, order_id=2) == fingerprint(charge, order_id=2, amount=1)
    assert fingerprint(notify, 1, b=2, a=1) == fingerprint(notify, 1, a=1, b=2) == fingerprint(notify, user=1, a=1, b=2)
    assert fingerprint(notify, 1, a=1) != fingerprint(notify, 1, a=2)
    assert fingerprint(spread, 1, 2, 3) != fingerprint(spread, 1, 3, 2)


def test_nested_dicts_agree_whatever_their_order_and_differ_in_any_value() -> None:
    lines: list[dict[str, Any]] = [{"sku": "a", "qty": 1}, {"sku": "b", "qty": 2}]
    first = {"lines": lines, "meta": {"x": {"y": 1, "z": 2}}}
    second = {"meta": {"x": {"z": 2, "y": 1}}, "lines": [{"qty": 1, "sku": "a"}, {"qty": 2, "sku": "b"}]}
    assert fingerprint(charge, 1, first) == fingerprint(charge, 1, second)
    deeper = {"meta": {"x": {"z": 3, "y": 1}}, "lines": second["lines"]}
    assert fingerprint(charge, 1, deeper) != fingerprint(charge, 1, first)
    swapped = {"lines": lines[::-1], "meta": first["meta"]}
    assert fingerprint(charge, 1, swapped) != fingerprint(charge, 1, first), "a list keeps its order"


def test_values_json_cannot_carry_take_their_canonical_form() -> None:
    assert fingerprint(charge, 1, decimal.Decimal("12.50")) == fingerprint(charge, 1, decimal.Decimal("12.5"))
    assert fingerprint(charge, 1, decimal.Decimal("12.5")) != fingerprint(charge, 1, decimal.Decimal("12.6"))
    utc = datetime.timezone.utc
    moment = datetime.datetime(2024, 1, 2, 3, 4, tzinfo=utc)
    assert fingerprint(charge, 1, moment) == fingerprint(charge, 1, moment.astimezone(datetime.timezone.max))
    ident = uuid.UUID("12345678-1234-5678-1234-567812345678")
    assert fingerprint(charge, ident) == fingerprint(charge, ident)
    assert fingerprint(charge, 1, {3, 1, 2}) == fingerprint(charge, 1, frozenset({1, 2, 3}))
    assert fingerprint(charge, 1, b"A") == fingerprint(charge, 1, bytearray(b"A"))
    assert fingerprint(charge, 1, (1, 2)) == fingerprint(charge, 1, [1, 2]), "a tuple is its list, as in JSON"
    assert fingerprint(charge, "\ud83d\ude00") == fingerprint(charge, "\U0001f600"), "a surrogate pair is its character"


@pytest.mark.parametrize(
    "value",
    [object(), {1: "a", "b": 2}, {(1, 2): "tuple key"}, 10**5000],
    ids=["object", "mixed-dict-keys", "tuple-dict-key", "huge-int"],
)
def test_arguments_without_a_canonical_form_have_no_fingerprint(value: Any) -> None:
    assert fingerprint(charge, 1, value) == ""


def test_a_cycle_has_no_fingerprint() -> None:
    loop: list[Any] = []
    loop.append(loop)
    assert arguments_fingerprint({"a": loop}) == ""


def test_the_key_comes_without_a_fingerprint_when_none_is_asked_for() -> None:
    spec = KeySpec("shop.task", "order:{order_id}", inspect.signature(charge), 200)
    assert spec.key_and_fingerprint((42,), {"amount": 3}, fingerprint=False) == ("order:42", "")
    assert spec.business_key((42,), {"amount": 3}) == "order:42"


#: A call whose fingerprint is pinned: a change to the canonical form changes it, and fails here.
PINNED = {"order_id": 42, "amount": decimal.Decimal("10.50"), "tags": {"b", "a"}, "meta": {"z": [1, 2.5], "a": None}}


def test_the_fingerprint_is_the_same_in_every_process_and_pinned() -> None:
    """Another interpreter with another hash seed (set order) computes the same value, and so did this release."""
    code = (
        "from decimal import Decimal; from celery_dedup.keys import arguments_fingerprint; "
        f"print(arguments_fingerprint({PINNED!r}))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT, env=env)
    here = arguments_fingerprint(PINNED)
    assert other.stdout.strip() == here
    assert here == "081640b437b229ea"
