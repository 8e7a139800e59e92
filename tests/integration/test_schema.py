"""The schema is the one statement of states, transitions, keys and fields: the Lua, KeySchema and the docs follow it.

The transitions the scripts make are checked over the whole session (see
conftest.py); here, that the check fails on a transition the table does not
allow, on a real server.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_dedup.keys import KeySchema
from celery_dedup.store import commands, schema
from celery_dedup.store.commands import argv_prelude
from celery_dedup.store.scripts import _WITH_LIB, load_script, with_lib
from celery_dedup.store.store import DedupStore
from celery_dedup.testing import RedisServer
from celery_dedup.worker import delivery

ROOT = Path(__file__).resolve().parents[2]
LUA = ROOT / "celery_dedup" / "store" / "lua"
CONCEPTS = ROOT / "docs" / "concepts.md"
#: Scripts that call lib.lua's ``transition``.
TRANSITION_SCRIPTS = frozenset(
    path.stem for path in LUA.glob("*.lua") if path.stem != "lib" and "transition(" in path.read_text()
)
#: Redis hash commands whose arguments after the key are field names (or, for HSET, field-value pairs).
HASH_COMMANDS = ("HSET", "HSETNX", "HGET", "HMGET", "HDEL", "HINCRBY", "HEXISTS")


def lua(name: str) -> str:
    return (LUA / f"{name}.lua").read_text(encoding="utf-8")


def code(source: str) -> str:
    """Lua source without its comments."""
    return re.sub(r"--[^\n]*", "", source)


def test_the_scripts_take_states_and_key_names_from_the_schema() -> None:
    source = load_script("gate")
    states = re.search(r"^local STATES = \{(.*?)\}$", source, re.M)
    ended = re.search(r"^local ENDED = \{(.*?)\}$", source, re.M)
    assert states and ended
    assert tuple(re.findall(r"'(\w+)'", states.group(1))) == schema.STATES
    assert tuple(re.findall(r"(\w+) = true", ended.group(1))) == schema.ENDED_STATES
    check = os.environ.get(schema.CHECK_VARIABLE) == "1"
    for name in sorted(_WITH_LIB):
        assert load_script(name).startswith(schema.lua_prelude(name, check=check)), name
    for path in sorted(LUA.glob("*.lua")):
        text = code(path.read_text(encoding="utf-8"))
        assert not re.search(r"local (STATES|ENDED)\b", text), f"{path.name} states its own copy"
        assert "prefix .. '" not in text, f"{path.name} builds a key by hand"
        for kind in schema.KEY_KINDS:
            fragment = re.split(r"\{\w+\}", kind.pattern)[1]
            assert f"'{fragment}" not in text, f"{path.name} builds a {kind.name} key by hand"
        for used in re.findall(r"\bKEY\.(\w+)\(", text):
            assert used in schema.KEY_KIND, f"{path.name}: KEY.{used} is not in the schema"


def test_the_key_schema_names_keys_as_the_schema_does() -> None:
    keys = KeySchema("P")
    names = [
        n for n in dir(KeySchema) if not n.startswith("_") and n not in {"prefix", "shards", "shard_of", "shards_all"}
    ]
    assert names
    for name in names:
        assert name in schema.KEY_KIND, f"KeySchema.{name} is not in the schema's KEY_KINDS"
        kind = schema.KEY_KIND[name]
        attribute = getattr(keys, name)
        parts = ("X", "Y:%")[: len(kind.parts)]
        built = attribute(*parts) if kind.parts else attribute
        assert built == kind.build("P", *parts), name
    assert {f.name for f in dataclasses.fields(KeySchema)} == {"prefix", "shards"}


def record_fields_in(source: str) -> set[str]:
    """The record fields a script's source names: in hash commands on the record, and in its field lists."""
    found: set[str] = set()
    text = code(source)
    if re.search(r"'h' \.\.", text):
        found.add("h<n>")  # a history entry's field, h0, h1, ...
        text = re.sub(r"'h' \.\.", "", text)
    for match in re.finditer(r"redis\.call\('(" + "|".join(HASH_COMMANDS) + r")', *(record|KEY\.record\()", text):
        depth, end = 1, match.end()
        if match.group(2) != "record":
            depth = 2
        while depth:
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            end += 1
        args = text[match.end() : end]
        if match.group(2) != "record":
            args = args[args.index(")") + 1 :]
        found.update(re.findall(r"'([a-z_]+)'", args))
    for line in text.splitlines():
        if re.search(r"\b(fields|carry)\[#\w+ \+ \d\]", line) or re.search(r"\badd\(|local fields = \{", line):
            found.update(re.findall(r"'([a-z_]+)'", line))
    return found


def test_every_record_field_the_scripts_name_is_in_the_schema() -> None:
    written = {
        name: record_fields_in(lua(name))
        for name in sorted(p.stem for p in LUA.glob("*.lua"))
        if ("record" in code(lua(name)) and not name.startswith("limit_")) or name == "limit_note"
    }
    everything = set().union(*written.values())
    unknown = {name: sorted(fields - set(schema.FIELD_DOC)) for name, fields in written.items()}
    assert not {name: fields for name, fields in unknown.items() if fields}, "fields not in schema.FIELD_DOCS"
    assert len(everything) > 30, sorted(everything)
    stored = {doc.name for doc in schema.FIELD_DOCS if not doc.derived}
    assert stored <= everything, f"fields no script names: {sorted(stored - everything)}"
    derived = {doc.name for doc in schema.FIELD_DOCS if doc.derived}
    assert derived == {"task", "updated_at"}
    assert not derived & everything, f"derived fields a script writes: {sorted(derived & everything)}"


def test_the_field_reader_sees_every_way_a_script_names_a_field() -> None:
    source = """
    redis.call('HSET', record, 'a_one', 1, 'b_two', x)
    redis.call('HMGET', KEY.record(prefix, member), 'c_three')
    fields[#fields + 1], fields[#fields + 2] = 'd_four', 4
    add('e_five', 5)
    redis.call('HSET', other, 'not_a_field', 1)  -- 'nor_this'
    """
    assert record_fields_in(source) == {"a_one", "b_two", "c_three", "d_four", "e_five"}


def table(markdown: str, header: str) -> list[list[str]]:
    """The rows of the Markdown table whose header row starts with ``header``, cells stripped."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def states_table() -> str:
    """The states table docs/concepts.md holds, as the schema states it."""
    rows = [
        f"| `{state}` | {'yes' if state in schema.ENDED_STATES else 'no'} | {schema.STATE_HELP[state]} |"
        for state in schema.STATES
    ]
    return "\n".join(["| state | ended | meaning |", "|-------|-------|---------|", *rows])


def test_the_docs_state_table_is_the_schemas() -> None:
    docs = CONCEPTS.read_text(encoding="utf-8")
    assert states_table() in docs, (
        f"docs/concepts.md's states table differs from the schema's; it reads:\n{states_table()}"
    )
    assert set(schema.STATE_HELP) == set(schema.STATES)


def test_the_readme_names_every_state() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    paragraph = readme[readme.index("States: ") :].split("\n\n", 1)[0]
    assert re.findall(r"`(\w+)`", paragraph) == list(schema.STATES)


def test_the_docs_field_table_names_every_field_of_the_schema() -> None:
    rows = table(CONCEPTS.read_text(encoding="utf-8"), "| field | meaning |")
    named = [name for row in rows for name in re.findall(r"`(\w+(?:<n>)?)`", row[0])]
    assert len(named) == len(set(named)), "a field listed twice"
    assert set(named) == set(schema.FIELD_DOC), (
        f"only in the docs: {sorted(set(named) - set(schema.FIELD_DOC))}; "
        f"only in the schema: {sorted(set(schema.FIELD_DOC) - set(named))}"
    )


def test_the_table_names_only_states_and_scripts_that_make_transitions() -> None:
    for transition in schema.TRANSITIONS:
        assert transition.old in (*schema.STATES, schema.NO_RECORD), transition
        assert transition.new in schema.STATES, transition
        assert set(transition.scripts) <= TRANSITION_SCRIPTS, transition
    assert {s for t in schema.TRANSITIONS for s in t.scripts} == TRANSITION_SCRIPTS
    assert not [t for t in schema.TRANSITIONS if t.old in schema.ENDED_STATES and t.new != t.old], "an ended run moved"
    assert {t.new for t in schema.TRANSITIONS} == set(schema.STATES), "a state no transition leads to"


def test_the_worker_names_only_states_of_the_schema() -> None:
    names = ("SUCCEEDED", "FAILED", "RETRY", "REVOKED", "REJECTED", "IGNORED", "LOST", "SKIPPED", "QUEUED", "REPLACED")
    assert {getattr(delivery, name) for name in names} <= set(schema.STATES)


def run_checked(client: redis.Redis, name: str, body: str, keys: list[str], args: list[str | int]) -> object:
    return client.register_script(with_lib(name, body, check=True))(keys, args)


def test_the_check_fails_on_a_transition_the_table_does_not_allow(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    with RedisServer(extra=("--logfile", str(log))) as server:
        client = redis.Redis.from_url(server.url)
        member, record = "t:k", "P:rec:t:k"
        # A real script, making a transition the table allows: none -> queued by the gate.
        gate = commands.Gate(member, "run-1", "nonce-1", 60000, 1000, "P", 10, "", "", "0", 0, 0)
        assert run_checked(client, "gate", argv_prelude("gate") + lua("gate"), ["P:held", record], list(gate)) == [
            1,
            b"run-1",
        ]
        # A script that is wrong: it moves the ended run back to started.
        client.hset(record, "state", "succeeded")
        body = "transition(ARGV[1], KEYS[1], ARGV[2], 'started', now_ms(), '', 10)\nreturn 1"
        assert run_checked(client, "wrong", body, [record], ["P", member]) == 1
        client.close()
    reports = schema.reported(log.read_text())
    print("reported:", *reports, sep="\n  ")

    assert [(r.script, r.old, r.new, r.member) for r in reports] == [
        ("gate", "none", "queued", member),
        ("wrong", "succeeded", "started", member),
    ]
    wrong = schema.unexpected(reports)
    print("not allowed:", *wrong, sep="\n  ")
    assert [str(r) for r in wrong] == ["wrong: succeeded -> started (e.g. t:k)"]
    # The table with the gate's transition taken out: the real script's report fails too.
    without = [t for t in schema.TRANSITIONS if (t.old, t.new) != (schema.NO_RECORD, "queued")]
    print("not allowed by a table without none -> queued:", *schema.unexpected(reports, without), sep="\n  ")
    assert [(r.script, r.old, r.new) for r in schema.unexpected(reports, without)] == [
        ("gate", "none", "queued"),
        ("wrong", "succeeded", "started"),
    ]
    # The same script allowed, but not to another script.
    moved = [*schema.TRANSITIONS, schema.Transition("succeeded", "started", ("start",), "")]
    assert [r.script for r in schema.unexpected(reports, moved)] == ["wrong"]


def test_the_scripts_report_only_when_the_variable_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(schema.CHECK_VARIABLE, "0")
    assert "local SCRIPT, CHECK, REPORT_MARK = 'finish', false," in load_script("finish")
    monkeypatch.delenv(schema.CHECK_VARIABLE)
    assert "local SCRIPT, CHECK, REPORT_MARK = 'finish', false," in load_script("finish")
    monkeypatch.setenv(schema.CHECK_VARIABLE, "1")
    assert "local SCRIPT, CHECK, REPORT_MARK = 'finish', true," in load_script("finish")
    assert "if CHECK then" in lua("lib")


def _reporting_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[RedisServer, Path]:
    monkeypatch.setenv(schema.CHECK_VARIABLE, "1")
    log = tmp_path / "server.log"
    return RedisServer(extra=("--logfile", str(log))), log


#: The key and the hold of these tests, and what a worker's start passes besides them.
MEMBER, MS = "t:k", 60_000
START: dict[str, Any] = {"lock_ms": MS, "gated": True, "hostname": "w", "pid": 1, "record_ms": MS, "retries": 0}


def _gated_and_started(store: DedupStore, run: str, token: str, key_mode: str) -> None:
    """Run ``run`` accepted by the gate and started by a worker holding lock ``token``."""
    assert store.gate(MEMBER, run, f"nonce-{run}", hold_ms=MS, grace_ms=MS).accepted
    assert store.start(MEMBER, run, token, key_mode=key_mode, **START).run


def _moves(log: Path) -> list[tuple[str, str, str]]:
    reports = schema.reported(log.read_text())
    assert schema.unexpected(reports) == [], reports
    return [(r.script, r.old, r.new) for r in reports]


def test_a_retry_whose_publish_gave_its_run_a_new_record_leaves_that_record_queued(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """until_executing frees the key as run A starts; B takes it and is refused (A holds the lock); A retries.

    A's retry publish (a continuation) finds B's ended record and gives A a new one, queued: the retry's
    message is out. A's ending, recorded after it, leaves that record to the retry (found by a chaos run,
    which saw ``finish: queued -> retry``).
    """
    server, log = _reporting_server(tmp_path, monkeypatch)
    with server:
        client = redis.Redis.from_url(server.url)
        store = DedupStore(client, "P")
        member, ms = MEMBER, MS
        _gated_and_started(store, "A", "w:1:a", "release")
        assert store.gate(member, "B", "nonce-b", hold_ms=ms, grace_ms=ms).accepted, "the key passed on"
        assert not store.start(member, "B", "w:1:b", key_mode="release", **START).run
        owned, *_ = store.finish(member, "B", "skipped", drop=True, record_ms=ms, token="", role="report")
        assert owned
        assert store.gate(member, "A", "nonce-a2", hold_ms=ms, grace_ms=ms, continues=True).accepted
        owned, *_ = store.finish(member, "A", "retry", drop=False, record_ms=ms, token="w:1:a", role="run")
        record = store.record(member) or {}
        assert owned and (record.get("state"), record.get("task_id")) == ("queued", "A")
        assert not client.exists("P:lock:t:k"), "the body's lock is given back all the same"
        client.close()
    assert ("finish", "queued", "retry") not in _moves(log)


def test_a_debounced_retry_parked_after_a_wipe_is_still_pushed_when_due(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A debounced run retries after the server lost its data: the retry's publish finds no record and parks
    the run anew (pending, due later); the body's ending comes after. Before, it recorded ``retry`` over
    ``pending`` and the parked message was never pushed (dispatch pushes pending records only)."""
    server, log = _reporting_server(tmp_path, monkeypatch)
    with server:
        client = redis.Redis.from_url(server.url)
        store = DedupStore(client, "P")
        member, ms = "t:k", 60_000
        parked: dict[str, Any] = {"queue": "celery", "message": "retry-message", "debounce": (50, 1_000, False)}
        assert store.gate(member, "A", "nonce-a2", hold_ms=ms, grace_ms=ms, continues=True, **parked).accepted
        assert (store.record(member) or {}).get("state") == "pending"
        owned, *_ = store.finish(member, "A", "retry", drop=False, record_ms=ms, token="w:1:a", role="run")
        assert owned and (store.record(member) or {}).get("state") == "pending"
        time.sleep(0.1)
        assert store.dispatch().pushed == 1
        assert client.lrange("celery", 0, -1) == [b"retry-message"]
        assert (store.record(member) or {}).get("state") == "queued"
        client.close()
    assert ("finish", "pending", "retry") not in _moves(log)


def test_an_ending_reported_twice_after_a_lost_reply_is_recorded_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """finish's reply is lost after the server acted; the worker sends it again: no second entry, no
    ``retry -> retry`` (a chaos run's proxy dropped such a reply)."""
    server, log = _reporting_server(tmp_path, monkeypatch)
    with server:
        client = redis.Redis.from_url(server.url)
        store = DedupStore(client, "P")
        member, ms = MEMBER, MS
        _gated_and_started(store, "A", "w:1:a", "lock")
        for _ in range(2):
            owned, *_ = store.finish(member, "A", "retry", drop=False, record_ms=ms, token="w:1:a", role="run")
            assert owned
        states = [entry.split(" ")[1] for entry in store.history(member)]
        assert states == ["retry", "started", "queued"], states
        client.close()
    assert ("finish", "retry", "retry") not in _moves(log)
