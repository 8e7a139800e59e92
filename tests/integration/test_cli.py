"""``celery -A <app> dedup ...`` run through celery's own click group, against the real server.

Most tests invoke the command in-process with click's runner (as ``celery``
would, entry point included); one runs ``python -m celery`` to prove the
plugin is registered for a real shell, and one releases a key a real worker
is executing.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import unicodedata
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest
import redis
from celery.bin.celery import celery as celery_cli
from click.testing import CliRunner, Result

from celery_dedup import DedupTask, runtime, testing
from celery_dedup.keys import KeySchema, member_for
from celery_dedup.ops import checks, cli, output

from .._records import Records
from ..conftest import ROOT, AppFactory, Server, WorkerProcess, wait_for

SCHEMA = KeySchema("dedup")
Invoke = Callable[..., Result]


@pytest.fixture
def apps(server: Server, r: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """tests/cli_app.py, built for the session's server (it reads the URL at import)."""
    monkeypatch.setenv("CELERY_DEDUP_TEST_BROKER", server.url)
    module = importlib.import_module("tests.cli_app")
    assert server.url == module.BROKER
    return module


@pytest.fixture
def dedup(apps: ModuleType) -> Invoke:
    """Run ``celery -A tests.cli_app[:<app>] dedup <args>`` in-process; returns click's result."""
    runner = CliRunner()

    def invoke(*args: str, app: str = "", input: str | None = None, columns: int | None = None) -> Result:
        """``columns``: the COLUMNS the command sees (unset by default: its output is no terminal)."""
        target = f"tests.cli_app:{app}" if app else "tests.cli_app"
        env = {"COLUMNS": None if columns is None else str(columns)}
        return runner.invoke(celery_cli, ["-A", target, "dedup", *args], input=input, env=env, catch_exceptions=False)

    return invoke


def as_json(result: Result) -> Any:
    assert result.exit_code == 0, (result.exit_code, result.stdout, result.stderr)
    return json.loads(result.stdout)


@pytest.fixture
def server_config(r: redis.Redis) -> Iterator[Callable[[str, str], None]]:
    """``set(name, value)`` a server setting for one test; every one set is restored after it."""
    saved: dict[str, str] = {}

    def set_config(name: str, value: str) -> None:
        if name not in saved:
            saved[name] = str(r.config_get(name)[name])
        r.config_set(name, value)

    yield set_config
    for name, value in saved.items():
        r.config_set(name, value)


def member(key: str, task: str = "cli.charge") -> str:
    return member_for(task, key)


# -- registration, usage, exit codes ------------------------------------------------------------


def test_dedup_is_registered_as_a_celery_command_plugin() -> None:
    assert celery_cli.commands["dedup"] is cli.dedup


def test_help_documents_every_exit_code(dedup: Invoke) -> None:
    result = dedup("--help")

    assert result.exit_code == 0
    for command in ("list", "show", "release", "purge", "reap", "stats", "check"):
        assert command in result.stdout
    meanings = ((0, "ok"), (1, "usage"), (2, "nothing found"), (3, "refused"), (4, "check found"), (5, "nothing held"))
    for code, meaning in meanings:
        assert f"{code}  {meaning}" in result.stdout
    assert "Exit codes" in (cli.__doc__ or "")


@pytest.mark.parametrize(
    "args",
    [
        ("nosuchcommand",),
        ("list", "--limit", "0"),
        ("list", "--cursor", "-1"),
        ("list", "--cursor", "²"),
        ("list", "--state", "bogus"),
        ("show", "no-colon-and-no-task"),
        ("purge", "--state", "queued", "--yes"),
        ("purge", "--yes"),
    ],
)
def test_usage_errors_exit_1_on_stderr(dedup: Invoke, args: tuple[str, ...]) -> None:
    result = dedup(*args)

    assert result.exit_code == output.USAGE
    assert "Error" in result.stderr
    assert result.stdout == ""


def test_unreachable_store_exits_1_with_the_reason(dedup: Invoke) -> None:
    result = dedup("list", app="unreachable")

    assert result.exit_code == output.USAGE
    assert "Redis: ConnectionError" in result.stderr


def shell(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m celery -A tests.cli_app dedup <args>`` with tests.cli_app on ``url``, stdin closed."""
    env = dict(os.environ, CELERY_DEDUP_TEST_BROKER=url, PYTHONPATH=str(ROOT))
    env.pop("COLUMNS", None)
    command = [sys.executable, "-m", "celery", "-A", "tests.cli_app", "dedup", *args]
    return subprocess.run(
        command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, check=False
    )


def test_entry_point_works_from_a_real_shell(apps: ModuleType, server: Server) -> None:
    apps.charge.delay(7)

    def celery(*args: str) -> subprocess.CompletedProcess[str]:
        return shell(server.url, *args)

    listed = celery("list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [rec["member"] for rec in json.loads(listed.stdout)["records"]] == [member("order:7")]

    missing = celery("show", "order:8", "--task", "cli.charge")
    assert missing.returncode == output.NOT_FOUND
    assert "has no record, hold or lock" in missing.stderr
    assert missing.stdout == ""


# -- --json: one document for every outcome -----------------------------------------------------

#: (setup, args, app, exit code): every command's failures; ``{member}`` is the member ``setup`` made.
JSON_FAILURES = {
    "unknown command": (None, ("nosuchcommand", "--json"), "", output.USAGE),
    "unknown option": (None, ("list", "--bogus", "--json"), "", output.USAGE),
    "list: bad --limit": (None, ("list", "--limit", "0", "--json"), "", output.USAGE),
    "list: bad --cursor": (None, ("list", "--cursor", "-1", "--json"), "", output.USAGE),
    "list: unreachable": (None, ("list", "--json"), "unreachable", output.USAGE),
    "show: no KEY": (None, ("show", "--json"), "", output.USAGE),
    "show: no task": (None, ("show", "no-colon-and-no-task", "--json"), "", output.USAGE),
    "show: unknown task": ("queued", ("show", "order:1", "--json"), "", output.USAGE),
    "show: nothing found": (None, ("show", "order:404", "--task", "cli.charge", "--json"), "", output.NOT_FOUND),
    "show: unreachable": (None, ("show", "order:1", "--task", "cli.charge", "--json"), "unreachable", output.USAGE),
    "release: no --yes": ("queued", ("release", "{member}", "--json"), "", output.USAGE),
    "release: --force, no --yes": ("started", ("release", "{member}", "--force", "--json"), "", output.USAGE),
    "release: nothing found": (
        None,
        ("release", "order:404", "--task", "cli.charge", "-y", "--json"),
        "",
        output.NOT_FOUND,
    ),
    "release: refused": ("started", ("release", "{member}", "--yes", "--json"), "", output.REFUSED),
    "release: nothing held": ("succeeded", ("release", "{member}", "--yes", "--json"), "", output.NOT_HELD),
    "purge: no --yes": ("succeeded", ("purge", "--state", "succeeded", "--json"), "", output.USAGE),
    "purge: unended state": (None, ("purge", "--state", "queued", "--yes", "--json"), "", output.USAGE),
    "purge: unreachable": (None, ("purge", "--state", "failed", "--yes", "--json"), "unreachable", output.USAGE),
    "reap: unreachable": (None, ("reap", "--json"), "unreachable", output.USAGE),
    "stats: unreachable": (None, ("stats", "--json"), "unreachable", output.USAGE),
    "limits: bad --limit": (None, ("limits", "--limit", "0", "--json"), "", output.USAGE),
    "limits: unreachable": (None, ("limits", "--json"), "unreachable", output.USAGE),
    "check: bad --countdown": (None, ("check", "--countdown", "-1", "--json"), "", output.USAGE),
    "check: found an error": (None, ("check", "--json"), "uninstalled", output.CHECK_FAILED),
}


@pytest.mark.parametrize(("setup", "args", "app", "code"), list(JSON_FAILURES.values()), ids=list(JSON_FAILURES))
def test_json_prints_one_document_for_every_failure_with_its_exit_code(
    apps: ModuleType, dedup: Invoke, r: redis.Redis, setup: str | None, args: tuple[str, ...], app: str, code: int
) -> None:
    records = Records(apps.app, apps.charge)
    made = {
        "queued": lambda: records.queued(1),
        "started": lambda: records.started(1),
        "succeeded": lambda: records.ended(1, "succeeded"),
    }
    run = made[setup]() if setup else None
    held, lock = r.smembers(SCHEMA.held), r.get(SCHEMA.lock(run.member)) if run else None

    result = dedup(*(arg.replace("{member}", run.member if run else "") for arg in args), app=app)

    assert result.exit_code == code, (result.stdout, result.stderr)
    document = json.loads(result.stdout)
    assert document["code"] == code
    assert isinstance(document["error"], str) and document["error"]
    assert "[y/N]" not in result.stdout + result.stderr, "--json never asks"
    assert r.smembers(SCHEMA.held) == held
    assert (r.get(SCHEMA.lock(run.member)) if run else None) == lock


def test_release_json_fails_at_once_from_a_real_shell_with_stdin_closed(apps: ModuleType, server: Server) -> None:
    queued = Records(apps.app, apps.charge).queued(6)

    refused = shell(server.url, "release", queued.member, "--json")

    assert refused.returncode == output.USAGE, refused.stderr
    document = json.loads(refused.stdout)
    assert document["code"] == output.USAGE and "--yes" in document["error"]
    assert "[y/N]" not in refused.stderr
    released = shell(server.url, "release", queued.member, "--json", "--yes")
    assert released.returncode == 0, released.stderr
    assert json.loads(released.stdout)["was_held"] is True


# -- list ---------------------------------------------------------------------------------------


def test_list_shows_records_as_a_table_and_as_json(apps: ModuleType, dedup: Invoke) -> None:
    for order in (1, 2, 3):
        apps.charge.delay(order)
    assert apps.charge.delay(2).deduplicated

    table = dedup("list")
    assert table.exit_code == 0
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["KEY", "TASK", "STATE", "TASK", "ID", "UPDATED", "WORKER", "ATTEMPTS", "DUPLICATES"]
    rows = {line.split()[0]: line.split() for line in lines[1:4]}
    assert set(rows) == {"order:1", "order:2", "order:3"}
    assert rows["order:2"][1:3] == ["cli.charge", "queued"]
    assert rows["order:2"][3].startswith("order:2~")
    assert rows["order:2"][-1] == "1"  # one duplicate
    assert rows["order:1"][-1] == "0"
    assert lines[4] == "3 shown, index holds 3"
    columns = [lines[0].index(h) for h in ("KEY", "TASK", "STATE", "UPDATED", "DUPLICATES")]
    for line in lines[1:4]:  # aligned: every value starts under its header
        assert all(line[c - 1] == " " and line[c] != " " for c in columns[1:])

    document = as_json(dedup("list", "--json"))
    assert document["total"] == 3 and document["cursor"] is None
    by_key = {rec["key"]: rec for rec in document["records"]}
    assert by_key["order:2"]["member"] == member("order:2")
    assert by_key["order:2"]["fields"]["state"] == "queued"
    assert by_key["order:2"]["fields"]["duplicates"] == "1"


def test_list_filters_and_pages_with_the_printed_cursor(apps: ModuleType, dedup: Invoke) -> None:
    for order in (10, 11, 12, 20):
        apps.charge.delay(order)

    first = as_json(dedup("list", "--limit", "3", "--json"))
    assert len(first["records"]) == 3 and first["cursor"]
    rest = as_json(dedup("list", "--limit", "3", "--cursor", first["cursor"], "--json"))
    assert rest["cursor"] is None
    assert {rec["key"] for rec in first["records"] + rest["records"]} == {
        "order:10",
        "order:11",
        "order:12",
        "order:20",
    }
    assert f"next page: --cursor {first['cursor']}" in dedup("list", "--limit", "3").stdout

    by_prefix = as_json(dedup("list", "--prefix", "order:1", "--json"))
    assert sorted(rec["key"] for rec in by_prefix["records"]) == ["order:10", "order:11", "order:12"]
    assert len(as_json(dedup("list", "--state", "queued", "--task", "cli.charge", "--json"))["records"]) == 4
    assert as_json(dedup("list", "--task", "cli.other", "--json"))["records"] == []
    assert dedup("list", "--state", "succeeded").stdout.startswith("no records\n")
    assert dedup("list", "--cursor", "not-a-cursor").exit_code == output.USAGE


def display_width(line: str) -> int:
    """Terminal columns ``line`` takes: wide (East Asian) characters two, combining marks none."""
    return sum(0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in line)


def test_one_long_key_does_not_widen_every_row_of_the_list(apps: ModuleType, dedup: Invoke) -> None:
    apps.charge.delay(1)
    long_result = apps.charge.delay("x" * 300)
    wide_result = apps.charge.delay("注文" * 60)
    long_key = long_result.id.rsplit("~", 1)[0]

    for columns in (120, 160):
        table = dedup("list", columns=columns)
        assert table.exit_code == 0
        lines = table.stdout.splitlines()
        assert max(display_width(line) for line in lines) <= columns, table.stdout
        rows = {line.split()[0]: line for line in lines[1:4]}
        assert "order:1" in rows, "a short key is shown whole"
        shortened = [key for key in rows if key.endswith("…")]
        assert len(shortened) == 2, rows
        assert any(long_key.startswith(key[:-1]) for key in shortened)
        assert rows["order:1"].split()[1:3] == ["cli.charge", "queued"], "short columns stay whole"
        assert lines[0].split()[:2] == ["KEY", "TASK"]

    shown = dedup("show", long_key, "--task", "cli.charge", columns=100)
    assert f"key     {long_key}\n" in shown.stdout, "show keeps values whole"
    listed = as_json(dedup("list", "--json", columns=100))
    assert {long_key, wide_result.id.rsplit("~", 1)[0]} <= {rec["key"] for rec in listed["records"]}


def test_list_fits_a_default_width_when_its_output_is_no_terminal(apps: ModuleType, dedup: Invoke) -> None:
    apps.charge.delay("x" * 300)

    lines = dedup("list").stdout.splitlines()

    assert max(len(line) for line in lines) <= output.DEFAULT_WIDTH < 300


def test_limits_fits_long_group_keys_to_the_terminal(apps: ModuleType, dedup: Invoke) -> None:
    from celery_dedup.policy import LimitPolicy  # noqa: PLC0415 - only this test reads groups
    from celery_dedup.store import limits  # noqa: PLC0415

    store = runtime.store_for(apps.app)
    policy = LimitPolicy(None, concurrency=2)
    for group in ("tenant:acme", "tenant:" + "y" * 300):
        limits.acquire(store, f"cli.report:{group}", "h:1:1", "r1", policy, lease_ms=60_000, task_name="x")

    lines = dedup("limits", columns=90).stdout.splitlines()

    assert max(len(line) for line in lines) <= 90
    groups = sorted(line.split()[1] for line in lines[1:])
    assert groups[0] == "tenant:acme"
    assert groups[1].startswith("tenant:yyy") and groups[1].endswith("…")
    whole = {group["key"] for group in as_json(dedup("limits", "--json", columns=90))["groups"]}
    assert whole == {"tenant:acme", "tenant:" + "y" * 300}


# -- show ---------------------------------------------------------------------------------------


def test_show_prints_record_hold_lock_and_history(apps: ModuleType, dedup: Invoke) -> None:
    run = Records(apps.app, apps.charge).started(5)

    text = dedup("show", "order:5", "--task", "cli.charge")
    assert text.exit_code == 0
    assert f"member  {run.member}" in text.stdout
    assert "held    yes" in text.stdout
    assert f"lock    {run.token} (" in text.stdout
    assert re.search(r"^  state +started$", text.stdout, re.M)
    assert "history (newest first):" in text.stdout
    assert "  started  " in text.stdout and "  queued  " in text.stdout

    for args in (("order:5", "--task", "cli.charge"), (run.member,)):
        document = as_json(dedup("show", *args, "--json"))
        assert document["member"] == run.member
        assert (document["task"], document["key"], document["held"]) == ("cli.charge", "order:5", True)
        assert document["lock"]["token"] == run.token and 0 < document["lock"]["ttl_ms"] <= 60_000
        assert document["record"]["task_id"] == run.task_id
        assert [entry["state"] for entry in document["history"]] == ["started", "queued"]
        assert all(entry["task_id"] == run.task_id and entry["at_ms"] > 0 for entry in document["history"])


def test_show_unknown_key_exits_2(dedup: Invoke) -> None:
    result = dedup("show", "order:404", "--task", "cli.charge")

    assert result.exit_code == output.NOT_FOUND
    assert result.stdout == ""
    assert repr(member("order:404")) in result.stderr


def test_show_of_a_key_without_its_task_names_the_unknown_task_and_the_key_s_task(
    apps: ModuleType, dedup: Invoke
) -> None:
    apps.charge.delay(42)

    result = dedup("show", "order:42")

    assert result.exit_code == output.USAGE, result.stdout
    assert "no task 'order' in this app" in result.stderr
    assert "'order:42' is a key of cli.charge" in result.stderr
    document = json.loads(dedup("show", "order:42", "--json").stdout)
    assert document["code"] == output.USAGE and "no task 'order' in this app" in document["error"]


def test_show_with_a_misspelt_task_names_the_close_task_names(apps: ModuleType, dedup: Invoke) -> None:
    apps.charge.delay(42)

    misspelt = dedup("show", "order:42", "--task", "cli.chrage")
    as_member = dedup("show", member("order:42", "cli.chrage"))

    for result in (misspelt, as_member):
        assert result.exit_code == output.USAGE, result.stdout
        assert "no task 'cli.chrage' in this app" in result.stderr
        assert "close: cli.charge" in result.stderr
    absent = dedup("show", "order:404", "--task", "cli.chrage")
    assert absent.exit_code == output.USAGE and "close: cli.charge" in absent.stderr
    assert "is a key of" not in absent.stderr


def test_release_without_the_task_does_not_answer_nothing_found(
    apps: ModuleType, dedup: Invoke, r: redis.Redis
) -> None:
    apps.charge.delay(42)

    result = dedup("release", "order:42", "--yes")

    assert result.exit_code == output.USAGE
    assert "no task 'order' in this app" in result.stderr and "cli.charge" in result.stderr
    assert r.sismember(SCHEMA.held, member("order:42"))


def test_records_of_a_task_this_app_does_not_register_are_still_shown(apps: ModuleType, dedup: Invoke) -> None:
    store = runtime.store_for(apps.app)
    gone = member("order:1", "retired.task")
    assert store.gate(gone, "order:1~1", "n1", hold_ms=60_000, grace_ms=1000).accepted

    shown = as_json(dedup("show", gone, "--json"))

    assert (shown["task"], shown["key"], shown["held"]) == ("retired.task", "order:1", True)
    released = as_json(dedup("release", "order:1", "--task", "retired.task", "--yes", "--json"))
    assert released["was_held"] is True


HOSTILE = "\x1b[2J\x1b[H\rstate  succeeded\n\x1b]0;owned\x07\u202e\x9b"


def assert_inert(text: str) -> None:
    """No control character (C0, DEL, C1) and no bidi override reaches the terminal."""
    bad = [c for c in text if (ord(c) < 32 and c != "\n") or 0x7F <= ord(c) <= 0x9F or c in "\u202e\u2028"]
    assert not bad, bad


def test_stored_text_reaches_the_terminal_escaped(apps: ModuleType, dedup: Invoke, r: redis.Redis) -> None:
    records = Records(apps.app, apps.charge)
    failed = records.ended(HOSTILE, "failed", error=f"ValueError: {HOSTILE}")  # type: ignore[arg-type]
    store = runtime.store_for(apps.app)
    running = member(f"order:{HOSTILE}2")
    assert store.gate(running, "order:x~1", "n1", hold_ms=60_000, grace_ms=1000).accepted
    token = f"{HOSTILE}:1:ab"
    started = store.start(
        running,
        "order:x~1",
        token,
        lock_ms=60_000,
        gated=True,
        key_mode="lock",
        hostname=HOSTILE,
        pid=1,
        retries=0,
        record_ms=60_000,
    )
    assert started.run
    r.hset(SCHEMA.stats, f"{HOSTILE}:accepted", 1)

    shown = dedup("show", failed.member)
    listed = dedup("list")
    stats = dedup("stats")
    refused = dedup("release", running, "--yes")
    for result in (shown, listed, stats, refused):
        assert_inert(result.stdout)
        assert_inert(result.stderr)
    assert shown.exit_code == 0 and listed.exit_code == 0 and refused.exit_code == output.REFUSED
    assert "ValueError: \\x1b[2J\\x1b[H\\rstate  succeeded\\n\\x1b]0;owned\\x07\\u202e\\x9b" in shown.stdout
    assert re.search(r"^  worker +\\x1b\[2J", dedup("show", running).stdout, re.M)
    assert "order:\\x1b[2J" in listed.stdout and "\\x1b]0;owned" in stats.stdout
    assert "\\x1b[2J" in refused.stderr

    document = as_json(dedup("show", failed.member, "--json"))  # JSON escapes by itself and stays faithful
    assert document["record"]["error"] == f"ValueError: {HOSTILE}"
    assert as_json(dedup("show", running, "--json"))["record"]["worker"] == HOSTILE
    assert_inert(dedup("list", "--json").stdout)


# -- release ------------------------------------------------------------------------------------


def test_release_frees_a_queued_key_after_confirmation(apps: ModuleType, dedup: Invoke, r: redis.Redis) -> None:
    first = apps.charge.delay(1)

    declined = dedup("release", "order:1", "--task", "cli.charge", input="n\n")
    assert declined.exit_code == 1
    assert r.sismember(SCHEMA.held, member("order:1"))

    released = dedup("release", "order:1", "--task", "cli.charge", input="y\n")
    assert released.exit_code == 0, released.stderr
    assert f"released {member('order:1')!r}; run now released; key was held" in released.stdout
    assert not r.sismember(SCHEMA.held, member("order:1"))
    history = as_json(dedup("show", member("order:1"), "--json"))["history"]
    assert history[0]["state"] == "released"
    assert history[0]["note"] == f"released by {output.operator_name()}"
    assert "@" in history[0]["note"]
    again = apps.charge.delay(1)
    assert not again.deduplicated and again.id != first.id


def test_release_unknown_key_exits_2(dedup: Invoke) -> None:
    result = dedup("release", "order:404", "--task", "cli.charge", "--yes")

    assert result.exit_code == output.NOT_FOUND
    assert "nothing to release" in result.stderr


def test_release_of_a_key_nothing_holds_exits_5_and_writes_nothing(apps: ModuleType, dedup: Invoke) -> None:
    run = Records(apps.app, apps.charge).ended(4, "succeeded")
    history = as_json(dedup("show", run.member, "--json"))["history"]

    result = dedup("release", run.member, "--yes")

    assert result.exit_code == output.NOT_HELD == 5
    assert "nothing to release" in result.stderr and "not held" in result.stderr and "succeeded" in result.stderr
    assert as_json(dedup("show", run.member, "--json"))["history"] == history
    assert "released" not in as_json(dedup("stats", "--json")).get("cli.charge", {})


def test_nothing_to_release_says_its_run_s_state_in_a_sentence(apps: ModuleType, dedup: Invoke) -> None:
    for state in ("succeeded", "failed"):
        run = Records(apps.app, apps.charge).ended({"succeeded": 1, "failed": 2}[state], state)

        result = dedup("release", run.member, "--yes")

        assert result.exit_code == output.NOT_HELD
        assert f"(its run's state is {state})" in result.stderr
        assert "its run is" not in result.stderr


def test_release_refuses_a_live_lock_unless_forced(apps: ModuleType, dedup: Invoke, r: redis.Redis) -> None:
    run = Records(apps.app, apps.charge).started(3)

    refused = dedup("release", "order:3", "--task", "cli.charge", "--yes")
    assert refused.exit_code == output.REFUSED
    assert "refused" in refused.stderr and run.token in refused.stderr
    assert r.get(SCHEMA.lock(run.member)) == run.token.encode()
    assert r.sismember(SCHEMA.held, run.member)

    forced = dedup("release", "order:3", "--task", "cli.charge", "--force", "--yes", "--json")
    assert as_json(forced) == {"member": run.member, "state": "released", "was_held": True, "forced": True}
    assert r.get(SCHEMA.lock(run.member)) is None
    assert not r.sismember(SCHEMA.held, run.member)
    assert "forced" in as_json(dedup("show", run.member, "--json"))["history"][0]["note"]


@pytest.mark.slow
def test_release_of_a_key_a_real_worker_is_executing(apps: ModuleType, dedup: Invoke, server: Server) -> None:
    worker = WorkerProcess(server.url, app="tests.cli_app", pool="solo", concurrency=1).wait_ready()
    try:
        apps.slow.delay(1)
        slow = member("job:1", "cli.slow")

        def executing() -> Any:
            shown = dedup("show", slow, "--json")
            return shown.exit_code == 0 and json.loads(shown.stdout)["lock"]

        lock = wait_for(executing, 30, "the worker to start cli.slow")
        refused = dedup("release", slow, "--yes")
        assert refused.exit_code == output.REFUSED
        assert lock["token"] in refused.stderr

        forced = as_json(dedup("release", slow, "--force", "--yes", "--json"))
        assert forced["forced"] and forced["was_held"]
        # The running task notices its lock is gone (it returns early) and its ending counts as lock_lost.
        wait_for(
            lambda: as_json(dedup("stats", "--json")).get("cli.slow", {}).get("lock_lost") == 1,
            30,
            lambda: f"lock_lost counted; worker said:\n{''.join(worker.output[-20:])}",
        )
        assert as_json(dedup("stats", "--json"))["cli.slow"]["released"] == 1
    finally:
        worker.stop(signal.SIGTERM)


# -- purge, reap, stats -------------------------------------------------------------------------


def test_purge_deletes_ended_records_only(apps: ModuleType, dedup: Invoke) -> None:
    records = Records(apps.app, apps.charge)
    for order in (1, 2):
        records.ended(order, "succeeded")
    records.ended(3, "failed")
    records.queued(4)

    declined = dedup("purge", "--state", "succeeded", input="n\n")
    assert declined.exit_code == 1
    assert len(as_json(dedup("list", "--json"))["records"]) == 4

    report = as_json(dedup("purge", "--state", "succeeded", "--state", "failed", "--yes", "--json"))
    assert report == {"purged": 3, "kept": 0, "more": False}
    assert [rec["key"] for rec in as_json(dedup("list", "--json"))["records"]] == ["order:4"]
    text = dedup("purge", "--state", "succeeded", "--yes")
    assert text.stdout == "purged 0 records; kept 0 whose key is held or whose lock is alive\n"


def test_reap_marks_runs_of_dead_workers_lost(apps: ModuleType, dedup: Invoke, r: redis.Redis) -> None:
    run = Records(apps.app, apps.charge).started(9)
    r.delete(SCHEMA.lock(run.member))  # its worker died: the lock is gone, the record still says started

    report = as_json(dedup("reap", "--json"))

    assert report["lost"] == 1
    assert runtime.store_for(apps.app).record(run.member)["state"] == "lost"  # type: ignore[index]
    assert "marked 0 runs of dead workers lost" in dedup("reap").stdout


def test_stats_counts_decisions_per_task(apps: ModuleType, dedup: Invoke) -> None:
    assert dedup("stats").stdout == "no decisions counted yet\n"
    apps.charge.delay(1)
    apps.charge.delay(1)
    apps.charge.delay(2)

    counts = as_json(dedup("stats", "--json"))
    assert counts["cli.charge"]["accepted"] == 2
    assert counts["cli.charge"]["deduplicated"] == 1

    lines = dedup("stats").stdout.splitlines()
    assert lines[0].split()[:3] == ["TASK", "ACCEPTED", "DEDUPLICATED"]
    assert lines[1].split()[:3] == ["cli.charge", "2", "1"]


# -- check --------------------------------------------------------------------------------------


def findings_of(stdout: str) -> dict[str, tuple[str, str]]:
    return {f["check"]: (f["level"], f["message"]) for f in json.loads(stdout)["findings"]}


def findings(result: Result) -> dict[str, tuple[str, str]]:
    return findings_of(result.stdout)


def test_check_flags_an_evicting_policy_and_passes_noeviction(
    dedup: Invoke, server_config: Callable[[str, str], None]
) -> None:
    server_config("maxmemory-policy", "allkeys-lru")
    server_config("save", "3600 1")
    flagged = dedup("check", "--json")
    assert flagged.exit_code == 0  # warnings alone
    level, why = findings(flagged)["maxmemory-policy"]
    assert level == "warning" and "allkeys-lru" in why and "noeviction" in why
    assert dedup("check", "--strict").exit_code == output.CHECK_FAILED

    server_config("maxmemory-policy", "volatile-ttl")
    assert findings(dedup("check", "--json"))["maxmemory-policy"][0] == "warning"

    server_config("maxmemory-policy", "noeviction")
    passing = dedup("check", "--json", "--strict")
    assert passing.exit_code == 0, passing.stdout
    assert {name: level for name, (level, _) in findings(passing).items()} == {
        "install": "ok",
        "broker": "ok",
        "visibility_timeout": "ok",
        "maxmemory-policy": "ok",
        "persistence": "ok",
        "clock": "ok",
        "format": "ok",
    }
    assert json.loads(passing.stdout)["failed"] is False
    text = dedup("check").stdout.splitlines()
    assert any(line.split()[:2] == ["ok", "maxmemory-policy"] for line in text)


def test_check_warns_when_persistence_is_off(dedup: Invoke, server_config: Callable[[str, str], None]) -> None:
    server_config("save", "")
    server_config("appendonly", "no")

    level, why = findings(dedup("check", "--json"))["persistence"]

    assert level == "warning" and "restart" in why


def test_check_warns_that_a_server_without_persistence_forgets_keys_and_records(apps: ModuleType) -> None:
    with testing.RedisServer(extra=("--save", "", "--appendonly", "no")) as bare:
        without = shell(bare.url, "check", "--json")
        text = shell(bare.url, "check")
        redis.Redis.from_url(bare.url).config_set("appendonly", "yes")
        with_aof = shell(bare.url, "check", "--json")

    assert without.returncode == 0, without.stderr  # a warning fails only with --strict
    level, why = findings_of(without.stdout)["persistence"]
    assert level == "warning"
    assert "restart" in why and "status record" in why and "queued message" in why and "again" in why
    assert any(line.split()[:2] == ["warning", "persistence"] for line in text.stdout.splitlines())
    assert findings_of(with_aof.stdout)["persistence"][0] == "ok"


def test_check_errors_without_install(dedup: Invoke) -> None:
    result = dedup("check", "--json", app="uninstalled")

    assert result.exit_code == output.CHECK_FAILED
    assert findings(result)["install"][0] == "error"
    assert json.loads(result.stdout)["failed"] is True


def test_check_errors_on_a_task_with_bad_options(dedup: Invoke) -> None:
    result = dedup("check", "--json", app="bad_options")

    assert result.exit_code == output.CHECK_FAILED
    level, why = findings(result)["tasks"]
    assert level == "error" and "cli.bad" in why and "dedup_mode='sometimes'" in why
    assert findings(result)["maxmemory-policy"][0] == "ok"  # the other checks still ran


def test_check_errors_when_the_store_is_unreachable(dedup: Invoke) -> None:
    result = dedup("check", "--json", app="unreachable")

    assert result.exit_code == output.CHECK_FAILED
    assert findings(result)["server"][0] == "error"


def test_check_says_what_to_raise_visibility_timeout_to(dedup: Invoke) -> None:
    level, why = findings(dedup("check", "--json", app="short_visibility"))["visibility_timeout"]
    assert level == "warning" and "at least 60" in why and "cli.visible" in why

    level, why = findings(dedup("check", "--json", "--countdown", "7200"))["visibility_timeout"]
    assert level == "warning" and "at least 7200" in why


def test_check_warns_that_the_gate_has_two_phases(dedup: Invoke) -> None:
    level, why = findings(dedup("check", "--json", app="separate_store"))["broker"]
    assert level == "warning" and "two phases" in why

    amqp = findings(dedup("check", "--json", app="amqp_broker"))
    assert amqp["broker"][0] == "warning" and "amqp:// is not Redis" in amqp["broker"][1]
    assert "visibility_timeout" not in amqp
    assert amqp["clock"][0] == "ok"  # the store on dedup_redis_url is still inspected


def test_check_reports_unknown_where_config_is_not_allowed(apps: ModuleType, dedup: Invoke, r: redis.Redis) -> None:
    user = apps.RESTRICTED_USER
    r.acl_setuser(user, enabled=True, passwords=[f"+{user}"], keys=["*"], channels=["*"], commands=["+@all", "-config"])
    try:
        result = dedup("check", "--json", "--strict", app="restricted")
    finally:
        r.acl_deluser(user)

    assert result.exit_code == 0, result.stdout  # unknown never fails the check
    found = findings(result)
    assert found["maxmemory-policy"][0] == "unknown" and "CONFIG GET is not allowed" in found["maxmemory-policy"][1]
    assert found["persistence"][0] == "unknown"
    assert found["clock"][0] == "ok"


# -- pure logic ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "level"),
    [("noeviction", "ok"), ("allkeys-lru", "warning"), ("volatile-lru", "warning"), ("volatile-ttl", "warning")],
)
def test_only_noeviction_keeps_dedup_keys(policy: str, level: str) -> None:
    assert checks.eviction_finding(policy, 1 << 30).level == level


def test_clock_offsets_beyond_a_second_are_reported() -> None:
    assert checks.clock_finding(0.4).level == "ok"
    assert checks.clock_finding(-0.9).level == "ok"
    ahead = checks.clock_finding(2.5)
    assert ahead.level == "warning" and "2.5 s ahead of" in ahead.message
    assert "behind" in checks.clock_finding(-3).message


def test_human_time_shows_local_time_and_age() -> None:
    assert output.human_time("0") == "-"
    assert output.human_time(None) == "-"
    assert output.human_time("1700000000000", now=1700000090.0).endswith("(1m ago)")
    assert output.human_time("1700000000000", now=1699999990.0).endswith("(in 10s)")


def test_limits_lists_each_groups_usage(apps: ModuleType, dedup: Invoke) -> None:
    from celery_dedup.policy import LimitPolicy, Rate  # noqa: PLC0415 - only this test reads groups
    from celery_dedup.store import limits  # noqa: PLC0415

    assert dedup("limits").stdout == "no limit groups used in the last day\n"
    store = runtime.store_for(apps.app)
    policy = LimitPolicy(None, concurrency=2, rates=(Rate(30, 60_000),))
    for n in range(3):
        limits.acquire(store, "cli.report:tenant:acme", f"h:1:{n}", f"r{n}", policy, lease_ms=60_000, task_name="x")
    (group,) = as_json(dedup("limits", "--json"))["groups"]
    assert (group["task"], group["key"], group["in_use"], group["waiting"], group["rate"], group["starts"]) == (
        "cli.report",
        "tenant:acme",
        2,
        1,
        "30/m",
        2,
    )
    lines = dedup("limits").stdout.splitlines()
    assert lines[0].split()[:5] == ["TASK", "GROUP", "SLOTS", "WAITING", "RATE"]
    assert lines[1].split()[:5] == ["cli.report", "tenant:acme", "2/2", "1", "2/30/m"]


def test_values_are_shortened_to_terminal_columns_not_characters() -> None:
    assert output.shortened("order:42", 8) == "order:42"
    assert output.shortened("order:420", 8) == "order:4…"
    assert output.shortened("注文注文", 5) == "注文…"  # two columns each: a third would end in column 6
    assert output.shortened("注文注文", 6) == "注文…"
    assert display_width(output.shortened("e\u0301" * 20, 6)) == 6  # combining accents take no column


def test_the_widest_columns_are_cut_first_and_never_below_their_least() -> None:
    assert output.fitted_widths([10, 300, 5], [10, 8, 5], 100) == [10, 81, 5]  # 100 less two gaps of 2, 10 and 5
    assert output.fitted_widths([50, 60, 5], [8, 8, 5], 64) == [27, 28, 5]
    assert output.fitted_widths([50, 60, 5], [20, 20, 5], 30) == [20, 20, 5], "wider than asked rather than below least"
    assert output.fitted_widths([3, 4], [3, 4], 80) == [3, 4]


def test_show_lists_the_steps_of_a_key_with_their_idempotency_keys(
    apps: ModuleType, dedup: Invoke, make_app: AppFactory
) -> None:
    eager = make_app("cli_steps", task_always_eager=True, task_eager_propagates=True)

    @eager.task(base=DedupTask, bind=True, shared=False, name="cli.steps", dedup_key="order:{n}")
    def job(self: DedupTask, n: int) -> list[Any]:
        return [self.dedup_once("charge-card", lambda key: key), self.dedup_once("mail", lambda key: 1, scope="key")]

    key, _ = job.delay(3).get()
    member = member_for("cli.steps", "order:3")

    text = dedup("show", member)
    assert text.exit_code == 0
    assert "steps (dedup_once):" in text.stdout
    assert re.search(rf"^  charge-card +run +done +1 .* {re.escape(key)}$", text.stdout, re.M), text.stdout
    assert "  step " in text.stdout and "cli.steps:order:3:key:mail" in text.stdout
    document = as_json(dedup("show", member, "--json"))
    assert [(s["name"], s["scope"], s["state"], s["attempts"], s["key"]) for s in document["steps"]] == [
        ("charge-card", "run", "done", 1, key),
        ("mail", "key", "done", 1, "cli.steps:order:3:key:mail"),
    ]
    assert [entry["note"] for entry in document["history"] if entry["state"] == "step"][:2] == [
        "mail done",
        "mail started",
    ]


# -- limits of named groups: set, clear, pause, resume ------------------------------------------


def test_limits_set_and_clear_override_a_named_group_for_a_key_or_the_whole_group(
    apps: ModuleType, dedup: Invoke
) -> None:
    from celery_dedup import limits  # noqa: PLC0415 - only these tests read named groups

    done = dedup("limits", "set", "partner-api", "--key", "acme", "--concurrency", "1", "--rate", "5/s", app="grouped")
    assert done.exit_code == 0, done.stderr
    assert done.stdout == "override of 'partner-api' key 'acme': concurrency 1, rate 5/s\n"
    whole = as_json(dedup("limits", "set", "partner-api", "--rate", "3/s", "--rate", "500/d", "--json", app="grouped"))
    assert whole == {"group": "partner-api", "key": None, "concurrency": None, "rates": ["3/s", "500/d"]}

    (info,) = [g for g in limits.describe(apps.grouped) if g.name == "partner-api"]
    assert (info.override.concurrency, [str(r) for r in info.override.rates or ()]) == (None, ["3/s", "500/d"])
    acme = info.keys["acme"].override
    assert acme is not None and (acme.concurrency, [str(r) for r in acme.rates or ()]) == (1, ["5/s"])
    listed = as_json(dedup("limits", "--json", app="grouped"))
    (named,) = [g for g in listed["named"] if g["name"] == "partner-api"]
    assert named["override"] == {"concurrency": None, "rates": ["3/s", "500/d"]}
    assert named["keys"]["acme"]["override"] == {"concurrency": 1, "rates": ["5/s"]}
    text = dedup("limits", app="grouped").stdout
    assert "named group partner-api: concurrency 2, rate 10/s, 1000/d" in text
    assert "override (all keys): rate 3/s, 500/d" in text
    assert re.search(r"^  acme .*concurrency 1, rate 5/s", text, re.M), text

    cleared = dedup("limits", "clear", "partner-api", "--key", "acme", app="grouped")
    assert (cleared.exit_code, cleared.stdout) == (0, "cleared the override of 'partner-api' key 'acme'\n")
    again = dedup("limits", "clear", "partner-api", "--key", "acme", app="grouped")
    assert again.exit_code == output.NOT_FOUND
    assert "no override of 'partner-api' key 'acme' to clear" in again.stderr
    assert as_json(dedup("limits", "clear", "partner-api", "--json", app="grouped"))["cleared"] is True
    (info,) = [g for g in limits.describe(apps.grouped) if g.name == "partner-api"]
    assert info.override is None and (info.keys.get("acme") is None or info.keys["acme"].override is None)


def test_limits_pause_and_resume_a_named_group_for_a_time_or_until_resumed(apps: ModuleType, dedup: Invoke) -> None:
    from celery_dedup import limits  # noqa: PLC0415

    store = runtime.store_for(apps.grouped)
    seconds, micros = store.client.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000

    paused = dedup("limits", "pause", "partner-api", "--key", "acme", "--for", "120", app="grouped")
    assert paused.exit_code == 0, paused.stderr
    assert paused.stdout.startswith("paused 'partner-api' key 'acme' until ")
    whole = as_json(dedup("limits", "pause", "mailer", "--json", app="grouped"))
    assert whole == {"group": "mailer", "key": None, "until": None}
    until = as_json(
        dedup(
            "limits", "pause", "partner-api", "--key", "globex", "--until", "2999-01-01T00:00Z", "--json", app="grouped"
        )
    )
    assert until["until"] == "2999-01-01T00:00:00+00:00"

    named = {g.name: g for g in limits.describe(apps.grouped)}
    acme = named["partner-api"].keys["acme"].paused_until
    assert acme is not None and now_ms + 110_000 < acme < now_ms + 130_000
    year_2999 = datetime.datetime(2999, 1, 1, tzinfo=datetime.timezone.utc)
    assert named["partner-api"].keys["globex"].paused_until == int(year_2999.timestamp() * 1000)
    assert named["partner-api"].paused_until is None
    assert named["mailer"].paused_until == -1
    text = dedup("limits", app="grouped").stdout
    assert "paused (all keys): until resumed" in text
    assert re.search(r"^  acme .* until \d{4}-\d\d-\d\d \d\d:\d\d:\d\d \(in 1m\)", text, re.M), text

    resumed = dedup("limits", "resume", "mailer", app="grouped")
    assert (resumed.exit_code, resumed.stdout) == (0, "resumed 'mailer' (all keys)\n")
    assert as_json(dedup("limits", "resume", "partner-api", "--key", "acme", "--json", app="grouped"))["resumed"]
    not_paused = dedup("limits", "resume", "mailer", "--json", app="grouped")
    assert not_paused.exit_code == output.NOT_FOUND
    assert json.loads(not_paused.stdout) == {"error": "'mailer' (all keys) is not paused", "code": output.NOT_FOUND}
    named = {g.name: g for g in limits.describe(apps.grouped)}
    assert named["mailer"].paused_until is None
    assert named["partner-api"].keys.get("acme") is None or named["partner-api"].keys["acme"].paused_until is None


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("set", "partner-api", "--rate", "0/s"), "0/s"),
        (("set", "partner-api", "--rate", "10/w"), "10/w"),
        (("set", "partner-api", "--key", "acme", "--concurrency", "-1"), "-1"),
        (("set", "no-such-group", "--concurrency", "1"), "no-such-group"),
        (("pause", "no-such-group"), "no-such-group"),
        (("clear", "no-such-group"), "no-such-group"),
        (("resume", "no-such-group"), "no-such-group"),
    ],
)
def test_limits_changes_with_bad_values_fail_with_the_typed_error_naming_group_and_value(
    dedup: Invoke, args: tuple[str, ...], named: str
) -> None:
    result = dedup("limits", *args, app="grouped")

    assert result.exit_code == output.USAGE, (result.stdout, result.stderr)
    assert named in result.stderr
    if "no-such-group" not in args:
        assert "partner-api" in result.stderr
    failure = json.loads(dedup("limits", *args, "--json", app="grouped").stdout)
    assert failure["code"] == output.USAGE and named in failure["error"]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("set", "partner-api"), "give --concurrency, --rate or both"),
        (("pause", "partner-api", "--for", "5", "--until", "2999-01-01T00:00"), "not both"),
        (("pause", "partner-api", "--until", "2001-01-01T00:00"), "has passed"),
        (("pause", "partner-api", "--until", "soon"), "no ISO 8601 time"),
        (("pause", "partner-api", "--for", "0"), "--for"),
    ],
)
def test_limits_changes_refuse_usage_errors_before_changing_anything(
    apps: ModuleType, dedup: Invoke, args: tuple[str, ...], says: str
) -> None:
    from celery_dedup import limits  # noqa: PLC0415

    result = dedup("limits", *args, app="grouped")

    assert result.exit_code == output.USAGE
    assert says in result.stderr
    (info,) = [g for g in limits.describe(apps.grouped) if g.name == "partner-api"]
    assert (info.override, info.paused_until, info.keys) == (None, None, {})


def test_limits_lists_a_named_groups_keys_with_slots_and_starts_per_window(apps: ModuleType, dedup: Invoke) -> None:
    from celery_dedup import limits  # noqa: PLC0415

    assert dedup("limits", app="grouped").stdout.count("no key used in the last day") == 2
    with (
        limits.acquire(apps.grouped, "partner-api", "acme", timeout=5),
        limits.acquire(apps.grouped, "mailer", timeout=5),
    ):
        listed = as_json(dedup("limits", "--json", app="grouped"))
        text = dedup("limits", app="grouped").stdout
    used = {(g["name"], g["key"]): g for g in listed["groups"]}
    acme = used["partner-api", "acme"]
    assert (acme["in_use"], acme["concurrency"], acme["rates"], acme["starts_per_window"]) == (
        1,
        2,
        ["10/s", "1000/d"],
        [1, 1],
    )
    assert used["mailer", "*"]["rates"] == ["5/s"]
    assert re.search(r"^  acme +1/2 +0 +1/10/s, 1/1000/d +- +- ", text, re.M), text
    assert re.search(r"^  \* +- +0 +1/5/s ", text, re.M), text
    assert "TASK" not in text, "named groups' keys are not listed again as tasks' groups"
