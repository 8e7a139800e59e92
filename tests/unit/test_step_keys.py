"""Steps' pure parts: the idempotency key a step's function is called with, step names, and the scripts' states."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from celery_dedup.config import check_step_name
from celery_dedup.exceptions import DedupConfigError
from celery_dedup.keys import STEP_KEY_MAX, member_for, new_task_id, step_key
from celery_dedup.store.schema import IN_DOUBT, STEP_STATES
from celery_dedup.store.status import steps_of

LUA = Path(__file__).resolve().parents[2] / "celery_dedup" / "store" / "lua"
MEMBER = member_for("shop.charge", "order:42")


def test_the_key_names_task_business_key_run_and_step() -> None:
    run = new_task_id("order:42")
    key = step_key(MEMBER, run, "charge-card")
    assert key == f"shop.charge:order:42:{run.removeprefix('order:42')}:charge-card"
    assert step_key(MEMBER, run, "charge-card", scope="key") == "shop.charge:order:42:key:charge-card"


def test_the_key_is_the_same_for_every_delivery_and_differs_for_other_runs_and_steps() -> None:
    run, other = new_task_id("order:42"), new_task_id("order:42")
    assert step_key(MEMBER, run, "charge-card") == step_key(MEMBER, run, "charge-card")
    keys = {
        step_key(MEMBER, run, "charge-card"),
        step_key(MEMBER, other, "charge-card"),
        step_key(MEMBER, run, "send-receipt"),
        step_key(MEMBER, run, "charge-card", scope="key"),
        step_key(member_for("shop.refund", "order:42"), run, "charge-card"),
        step_key(member_for("shop.charge", "order:43"), run, "charge-card"),
    }
    assert len(keys) == 6


def test_run_ids_of_any_form_cannot_pass_for_one_another_or_for_the_key() -> None:
    """Separators in a run id are escaped: a ``:`` moved between business key and run id gives another key."""
    keys = {
        step_key(member_for("t", "a:b"), "c", "s"),
        step_key(member_for("t", "a"), "b:c", "s"),
        step_key(MEMBER, "key", "s"),
        step_key(MEMBER, "anything", "s", scope="key"),
        step_key(MEMBER, "~0123456789", "s"),  # a run id made for another key, with a suffix's shape
        step_key(MEMBER, "order:42~0123456789", "s"),
    }
    assert len(keys) == 6, keys
    assert step_key(MEMBER, "key", "s") == "shop.charge:order:42:%6Bey:s"
    assert step_key(MEMBER, "9f1c-uuid:x~y", "s") == "shop.charge:order:42:9f1c-uuid%3Ax%7Ey:s"


def test_the_key_is_printable_ascii_without_whitespace() -> None:
    member = member_for("shop.charge", "name=Zoë,city=Köln")
    key = step_key(member, "run id\twith space", "s")
    assert key.isascii() and key.isprintable() and not re.search(r"\s", key)
    assert "Zo%C3%AB" in key and "K%C3%B6ln" in key and "run%20id%09with%20space" in key


def test_a_long_key_is_cut_to_what_providers_take_and_stays_distinct() -> None:
    first = member_for("shop.charge", "x" * 300 + "1")
    second = member_for("shop.charge", "x" * 300 + "2")
    a, b = step_key(first, "r", "s"), step_key(second, "r", "s")
    assert len(a) == len(b) == STEP_KEY_MAX
    assert a != b
    assert re.fullmatch(r"shop\.charge:x+#[0-9a-f]{32}", a), a
    assert len(step_key(member_for("t", "é" * 200), "r", "s")) <= STEP_KEY_MAX


@pytest.mark.parametrize("name", ["charge-card", "a", "ship.item_3", "x" * 64, "0day"])
def test_step_names_that_are_taken(name: str) -> None:
    assert check_step_name("name", name) == name


@pytest.mark.parametrize("name", ["", "-lead", "has space", "has:colon", "x" * 65, "é", None, 3])
def test_step_names_that_are_refused(name: object) -> None:
    with pytest.raises(DedupConfigError, match="1 to 64 of"):
        check_step_name("name", name)


def test_the_scripts_write_only_the_step_states_of_the_schema() -> None:
    written: set[str] = set()
    for script in ("step_begin", "step_end", "step_renew"):
        for line in (LUA / f"{script}.lua").read_text(encoding="utf-8").splitlines():
            if line.lstrip().startswith("--") or "entry.state" not in line:
                continue
            written.update(re.findall(r"(?<!\[)'(\w+)'(?!\])", line.split("--")[0]))
    assert written, "the reader found no state"
    assert written <= set(STEP_STATES), sorted(written - set(STEP_STATES))
    assert set(STEP_STATES) <= written, sorted(set(STEP_STATES) - written)


def test_a_running_step_whose_lock_ran_out_reads_in_doubt() -> None:
    run = new_task_id("order:42")
    fields = {
        "run": run,
        "s:charge-card": '{"state":"running","token":"h:1:2:m:ab","until":1000,"attempts":1,"started_at":900}',
        "s:send-receipt": '{"state":"running","token":"h:1:2:m:ab","until":3000,"attempts":2,"started_at":950}',
        "k:welcome": '{"state":"done","attempts":1,"started_at":100,"finished_at":200,"result":"xyz"}',
        "s:broken": "not json",
    }
    found = {step.name: step for step in steps_of(MEMBER, fields, now_ms=2000)}
    assert found["charge-card"].state == IN_DOUBT
    assert found["send-receipt"].state == "running" and found["send-receipt"].attempts == 2
    assert (found["welcome"].scope, found["welcome"].run_id, found["welcome"].result_size) == ("key", "", 3)
    assert found["welcome"].key == step_key(MEMBER, "", "welcome", scope="key")
    assert found["charge-card"].key == step_key(MEMBER, run, "charge-card")
    assert (found["broken"].state, found["broken"].error) == ("?", "not json")
    assert [step.scope for step in steps_of(MEMBER, fields, now_ms=2000)][-1] == "key", "the run's steps first"
