"""``celery -A proj dedup``: look at dedup keys, free stuck ones, and check the setup, from a shell.

A ``celery.commands`` plugin (entry point ``dedup``), so it runs with the
project's own app and settings. Every action goes through
:mod:`celery_dedup.operations` and the store, as the Django admin's do.

Commands: ``list``, ``show``, ``release``, ``purge``, ``reap``, ``stats``,
``limits`` (with ``set``, ``clear``, ``pause`` and ``resume`` for named
groups), ``check`` and ``migrate``. Tables are for people, fitted to the terminal's width;
``--json`` prints one JSON document for scripts, whatever the outcome: a
failure prints ``{"error": <message>, "code": <exit code>}``, and never asks
for confirmation. Errors also go to stderr.

Exit codes::

    0  ok
    1  usage, configuration or connection error; a task name this app does not register
    2  nothing found: show or release of a key with no record, hold or lock;
       limits clear / resume of a group (or key) with no override / not paused
    3  refused: release of a key whose execution lock is alive, without --force
    4  check found an error (warnings too, with --strict)
    5  nothing held: release of a key that is not held and has no live lock
"""

from __future__ import annotations

import difflib
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import click
import redis
from celery import Celery
from celery.bin.base import CLIContext

import celery_dedup

from .. import operations
from ..decisions import DECISIONS
from ..exceptions import DedupError
from ..keys import member_for, split_member, task_from_namespace
from ..store.status import (
    ENDED_STATES,
    FIELD_DOC,
    FIELD_DOCS,
    STATES,
    HistoryEntry,
    Status,
    StepStatus,
    from_ms,
    is_history_field,
)
from ..store.store import KeyDetail, ReleaseResult
from ..task import DedupTask
from .checks import run_checks
from .limit_commands import limits_
from .output import (
    CHECK_FAILED,
    USAGE,
    CliError,
    NotFound,
    NotHeld,
    Refused,
    command_app,
    emit_json,
    format_table,
    json_flag,
    local_time,
    operator_name,
    printable,
    yes_flag,
)

_HELP = """Inspect and repair celery-dedup keys.

\b
Exit codes:
  0  ok
  1  usage, configuration or connection error
  2  nothing found (show/release of an unknown key; limits clear/resume with
     no override or pause)
  3  refused (release of a live execution lock without --force)
  4  check found an error (or a warning, with --strict)
  5  nothing held (release of a key neither held nor locked)

With --json, a failure prints {"error": ..., "code": <exit code>}.
"""


class _UsageError(click.UsageError):
    """A usage error shown as click shows it, with exit code 1 (click's 2 means "not found" here)."""

    exit_code = USAGE

    def __init__(self, original: click.UsageError) -> None:
        super().__init__(original.message, original.ctx)
        self.original = original

    def format_message(self) -> str:
        return self.original.format_message()

    def show(self, file: Any = None) -> None:
        self.original.show(file)


#: Where a command's context remembers that ``--json`` was given.
_JSON_META = "celery_dedup.json"


def _wants_json(args: Sequence[str]) -> bool:
    """Whether ``--json`` is among the command's arguments (read before they are parsed, for parse errors too)."""
    return "--json" in (args[: args.index("--")] if "--" in args else args)


class _DedupGroup(click.Group):
    """Gives usage errors exit code 1, reports Redis and celery-dedup errors without a traceback, and
    reports every failure of a ``--json`` command as a JSON document on stdout too."""

    def make_context(
        self, info_name: str | None, args: list[str], parent: click.Context | None = None, **extra: Any
    ) -> click.Context:
        as_json = _wants_json(args)
        try:
            ctx = super().make_context(info_name, args, parent, **extra)
        except click.ClickException as exc:
            failure = _failure(exc, as_json)
            if failure is exc:
                raise
            raise failure from exc
        ctx.meta[_JSON_META] = as_json
        return ctx

    def invoke(self, ctx: click.Context) -> Any:
        as_json = bool(ctx.meta.get(_JSON_META))
        try:
            return super().invoke(ctx)
        except click.ClickException as exc:
            failure = _failure(exc, as_json)
            if failure is exc:
                raise
            raise failure from exc
        except redis.RedisError as exc:
            raise _failure(CliError(f"Redis: {type(exc).__name__}: {exc}"), as_json) from exc
        except DedupError as exc:
            raise _failure(CliError(str(exc)), as_json) from exc


def _failure(exc: click.ClickException, as_json: bool) -> click.ClickException:
    """``exc`` with click's usage exit code 2 made 1; with ``--json``, printed now as a JSON document.

    Click then shows it on stderr and exits with its code, as without ``--json``.
    """
    if isinstance(exc, click.UsageError) and not isinstance(exc, _UsageError):
        exc = _UsageError(exc)
    if as_json:
        emit_json({"error": exc.format_message(), "code": exc.exit_code})
    return exc


@click.group(cls=_DedupGroup, help=_HELP)
def dedup() -> None:
    """Inspect and repair celery-dedup keys (the group's help is ``_HELP``)."""


dedup.add_command(limits_)


def _lookup(app: Celery, key: str, task: str | None) -> KeyDetail:
    """Everything about ``key`` of ``task``; without a task, ``key`` must be a whole ``<task>:<key>`` member.

    A key with nothing stored under a task name this app does not register is
    a usage error naming close task names and the keyed tasks that do have
    the key: ``show order:42`` would otherwise read ``order`` as the task and
    answer "nothing found". Records of a task no longer registered are shown.
    """
    if task:
        name, business_key, member = task, key, member_for(task, key)
    else:
        namespace, business_key = split_member(key)
        if not namespace or not business_key:
            raise click.UsageError(f"{key!r}: give --task NAME, or the whole member '<task>:<key>'")
        name, member = task_from_namespace(namespace), key
    found = operations.detail(app, member)
    if not _is_absent(found):
        return found
    app.loader.import_default_modules()
    if name in app.tasks:
        return found
    keyed = sorted(task_name for task_name, each in app.tasks.items() if isinstance(each, DedupTask))
    message = f"no task {name!r} in this app"
    close = difflib.get_close_matches(name, keyed, n=3)
    if close:
        message += f" (close: {', '.join(close)})"
    guesses = dict.fromkeys(part for part in (business_key, key if not task else "") if part)
    holders = [
        (guess, each)
        for guess in guesses
        for each in keyed
        if not _is_absent(operations.detail(app, member_for(each, guess)))
    ]
    if holders:
        message += "; " + "; ".join(f"{guess!r} is a key of {each} (--task {each})" for guess, each in holders)
    elif not task:
        message += "; give --task NAME, or the whole member '<task>:<key>'"
    raise CliError(message)


def _task_option(function: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--task", help="The task name; without it KEY is the whole member '<task>:<key>'.")(function)


@dedup.command("list")
@click.option("--state", type=click.Choice(STATES), help="Only records in this state.")
@click.option("--task", help="Only records of this task name.")
@click.option("--prefix", metavar="KEYPREFIX", help="Only business keys starting with this (key order then).")
@click.option("--limit", type=click.IntRange(1, 1000), default=50, show_default=True, help="Records per page.")
@click.option("--cursor", help="Where to go on: the cursor the previous page printed.")
@json_flag
@click.pass_context
def list_(
    ctx: click.Context,
    state: str | None,
    task: str | None,
    prefix: str | None,
    limit: int,
    cursor: str | None,
    as_json: bool,
) -> None:
    """List status records, newest update first."""
    try:
        page = celery_dedup.records(command_app(ctx), state=state, task=task, prefix=prefix, cursor=cursor, limit=limit)
    except ValueError as exc:
        raise click.BadParameter(f"{cursor!r} is not a cursor this command printed", param_hint="--cursor") from exc
    if as_json:
        records = [status.as_dict() for status in page.records]
        emit_json({"records": records, "cursor": page.cursor, "total": page.total})
        return
    if not page.records:
        click.echo("no records")
    else:
        headers = ("KEY", "TASK", "STATE", "TASK ID", "UPDATED", "WORKER", "ATTEMPTS", "DUPLICATES")
        now = time.time()
        rows = [
            (
                status.key,
                status.task,
                status.state,
                status.task_id,
                local_time(status.updated_at, now),
                status.worker or "-",
                str(status.attempts),
                str(status.duplicates),
            )
            for status in page.records
        ]
        click.echo(format_table(rows, headers, shorten=(0, 1, 3, 5)))
    click.echo(f"{len(page.records)} shown, index holds {page.total}")
    if page.cursor:
        click.echo(f"next page: --cursor {page.cursor}")


def _is_absent(found: KeyDetail) -> bool:
    return found.record is None and not found.held and found.lock_token is None


def _detail_json(found: KeyDetail) -> dict[str, Any]:
    namespace, key = split_member(found.member)
    lock = {"token": found.lock_token, "ttl_ms": found.lock_ttl_ms} if found.lock_token is not None else None
    status = found.status
    return {
        "member": found.member,
        "task": task_from_namespace(namespace),
        "key": key,
        "held": found.held,
        "lock": lock,
        "record": found.record,
        "status": status.as_dict() if status is not None else None,
        "history": [entry.as_dict() for entry in _history(found)],
        "steps": [step.as_dict() for step in found.steps],
    }


def _history(found: KeyDetail) -> tuple[HistoryEntry, ...]:
    """The key's history, newest first, from both formats (a list without a record is still shown)."""
    status = found.status
    if status is not None:
        return status.history or ()
    return tuple(HistoryEntry.parse(entry) for entry in found.history)


def _field_rows(status: Status, now: float) -> list[tuple[str, str]]:
    """The record's fields in the order of their groups, times as local time and age; unknown fields last."""
    rows = []
    for doc in FIELD_DOCS:
        value = status.fields.get(doc.name)
        if value is not None:
            rows.append((doc.name, local_time(from_ms(value), now) if doc.time else value))
    rows += sorted(
        (name, value)
        for name, value in status.fields.items()
        if name not in FIELD_DOC and not is_history_field(name)  # the history is shown as its own table
    )
    return rows


@dedup.command()
@click.argument("key")
@_task_option
@json_flag
@click.pass_context
def show(ctx: click.Context, key: str, task: str | None, as_json: bool) -> None:
    """Everything about one key: record, history, hold and execution lock."""
    found = _lookup(command_app(ctx), key, task)
    if _is_absent(found):
        raise NotFound(f"{found.member!r} has no record, hold or lock")
    if as_json:
        emit_json(_detail_json(found))
        return
    namespace, business_key = split_member(found.member)
    namespace = task_from_namespace(namespace)
    lock = f"{found.lock_token} ({found.lock_ttl_ms / 1000:.1f} s left)" if found.lock_token else "none"
    head = [("member", found.member), ("task", namespace), ("key", business_key)]
    head += [("held", "yes" if found.held else "no"), ("lock", lock)]
    click.echo(format_table(head))
    now = time.time()
    status = found.status
    if status is None:
        click.echo("\nrecord: none")
    else:
        tombstone = " (purged: only the run id, how it ended and its nonces remain)" if status.purged else ""
        click.echo(f"\nrecord{tombstone}:")
        click.echo(format_table(_field_rows(status, now), indent="  "))
    entries = _history(found)
    click.echo("\nhistory (newest first):" if entries else "\nhistory: none")
    if entries:
        rows = [(local_time(e.at, now), e.state, e.task_id, e.note) for e in entries]
        click.echo(format_table(rows, indent="  "))
    if found.steps:
        click.echo("\nsteps (dedup_once):")
        headers = ("step", "scope", "state", "attempts", "when", "idempotency key")
        click.echo(format_table(_step_rows(found.steps, now), headers, indent="  "))


def _step_rows(steps: Sequence[StepStatus], now: float) -> list[tuple[str, ...]]:
    """One row per step: name, scope, state, attempts, when it last ended (or began), its idempotency key."""
    rows: list[tuple[str, ...]] = []
    for step in steps:
        when = local_time(step.finished_at or step.started_at, now)
        state = step.state + (f" ({step.error})" if step.error else "")
        rows.append((step.name, step.scope, state, str(step.attempts), when, step.key))
    return rows


@dedup.command()
@click.argument("key")
@_task_option
@click.option(
    "--force",
    is_flag=True,
    help="Also delete a live execution lock (compare-and-delete of the token read now). Only if its worker is gone.",
)
@yes_flag
@json_flag
@click.pass_context
def release(ctx: click.Context, key: str, task: str | None, force: bool, yes: bool, as_json: bool) -> None:
    """Free a stuck key; its unfinished run ends as 'released'.

    Refused (exit 3) while a worker holds the key's execution lock, unless
    --force: the lock whose token is read now is then deleted, and only if it
    still holds that token. A key that is not held and has no live lock is
    left alone (exit 5): there is nothing to release.
    """
    if as_json and not yes:
        raise click.UsageError("--json never asks for confirmation: add --yes to release")
    app = command_app(ctx)
    found = _lookup(app, key, task)
    member = found.member
    if _is_absent(found):
        raise NotFound(f"nothing to release: {member!r} has no record, hold or lock")
    token = found.lock_token
    if not found.held and not token:
        raise NotHeld(_not_held(member, (found.record or {}).get("state", "")))
    if token and not force:
        raise Refused(
            f"refused: {member!r} is executing: lock {token} ({found.lock_ttl_ms / 1000:.1f} s left). "
            "Pass --force only if that worker is gone."
        )
    if not yes:
        what = f" and delete the live lock {token}" if token else ""
        click.confirm(printable(f"Release {member!r}{what}?"), abort=True, err=True)
    result = operations.release(app, member, force_token=(token or "") if force else "", by=operator_name())
    if result.code == ReleaseResult.REFUSED_LOCKED:
        raise Refused(f"refused: {member!r} started executing meanwhile ({int(result.detail) / 1000:.1f} s left)")
    if result.code == ReleaseResult.REFUSED_LOCK_CHANGED:
        raise Refused(f"refused: the lock of {member!r} now belongs to {result.detail}, not {token}")
    if result.code == ReleaseResult.NOTHING and result.detail:
        raise NotHeld(_not_held(member, result.detail))
    if result.code == ReleaseResult.NOTHING:
        raise NotFound(f"nothing to release: {member!r} has no record, hold or lock any more")
    if as_json:
        emit_json({"member": member, "state": result.detail, "was_held": result.was_held, "forced": result.forced})
        return
    parts = [f"released {member!r}", f"run now {result.detail or 'without a record'}"]
    parts.append("key was held" if result.was_held else "key was not held")
    if result.forced:
        parts.append(f"lock {token} deleted")
    click.echo(printable("; ".join(parts)))


def _not_held(member: str, state: str) -> str:
    why = f" (its run's state is {state})" if state else ""
    return f"nothing to release: {member!r} is not held and no execution lock is alive{why}"


@dedup.command()
@click.option(
    "--state",
    "states",
    multiple=True,
    required=True,
    type=click.Choice(ENDED_STATES),
    help="An ended state to purge (repeat for several).",
)
@click.option("--limit", type=click.IntRange(1), default=10_000, show_default=True, help="About this many at most.")
@yes_flag
@json_flag
@click.pass_context
def purge(ctx: click.Context, states: tuple[str, ...], limit: int, yes: bool, as_json: bool) -> None:
    """Delete status records of ended runs; held or locked keys keep theirs."""
    if as_json and not yes:
        raise click.UsageError("--json never asks for confirmation: add --yes to purge")
    if not yes:
        click.confirm(f"Delete up to {limit} records in state {', '.join(states)}?", abort=True, err=True)
    report = operations.purge(command_app(ctx), states=states, limit=limit)
    if as_json:
        emit_json(asdict(report))
        return
    click.echo(f"purged {report.purged} records; kept {report.kept} whose key is held or whose lock is alive")
    if report.more:
        click.echo("more remain: run purge again")


@dedup.command()
@json_flag
@click.pass_context
def reap(ctx: click.Context, as_json: bool) -> None:
    """One clean-up pass, as workers run every dedup_reap_interval seconds."""
    report = celery_dedup.reap(command_app(ctx))
    if as_json:
        emit_json(asdict(report))
        return
    click.echo(
        f"released {report.released} expired holds; marked {report.lost} runs of dead workers lost; "
        f"removed {report.stale} stale index entries; marked {report.vanished} runs whose message vanished lost"
    )


@dedup.command()
@json_flag
@click.pass_context
def stats(ctx: click.Context, as_json: bool) -> None:
    """Decisions per task, counted in Redis by every process of the app."""
    counts = celery_dedup.stats(command_app(ctx))
    if as_json:
        emit_json(counts)
        return
    if not counts:
        click.echo("no decisions counted yet")
        return
    seen = {decision for per_task in counts.values() for decision in per_task}
    columns = [*DECISIONS, *sorted(seen - set(DECISIONS))]
    rows = [(name, *(str(counts[name].get(d, 0)) for d in columns)) for name in sorted(counts)]
    click.echo(format_table(rows, ("TASK", *(c.upper() for c in columns))))


@dedup.command()
@click.option("--dry-run", is_flag=True, help="Print what it would do; change nothing.")
@json_flag
@click.pass_context
def migrate(ctx: click.Context, dry_run: bool, as_json: bool) -> None:
    """Move the store's format-1 leftovers to this release's format, once every producer and worker runs it.

    Folds the history lists into their records, deletes the old indexes and
    marks the store's format. Safe to run again, and while workers run.
    """
    report = operations.migrate(command_app(ctx), dry_run=dry_run)
    if as_json:
        emit_json(asdict(report))
        return
    would = "would " if dry_run else ""
    was = "no format key" if report.was is None else f"format {report.was}"
    click.echo(
        f"{report.prefix}: {was}; {would}fold {report.folded} history lists into their records, "
        f"{would}delete {report.deleted} history lists whose record is gone and {report.indexes} old indexes"
    )
    if not dry_run:
        click.echo(f"{report.prefix}: format {report.format}")


@dedup.command()
@click.option(
    "--countdown",
    type=click.FloatRange(0),
    default=0,
    help="The longest countdown or ETA (seconds) your code uses, checked against visibility_timeout.",
)
@click.option("--strict", is_flag=True, help="Exit 4 on warnings too.")
@json_flag
@click.pass_context
def check(ctx: click.Context, countdown: float, strict: bool, as_json: bool) -> None:
    """Warn about what would break the guarantees in this app's setup.

    Looks at: install, the broker and dedup_redis_url, task options,
    visibility_timeout, the server's maxmemory-policy and persistence, and
    its clock. 'unknown' (CONFIG not allowed) never fails the check.
    """
    findings = run_checks(command_app(ctx), countdown=countdown)
    failing = {"error", "warning"} if strict else {"error"}
    failed = [f.check for f in findings if f.level in failing]
    if as_json:
        document: dict[str, Any] = {"findings": [asdict(f) for f in findings], "failed": bool(failed)}
        if failed:
            document.update(error=f"check failed: {', '.join(dict.fromkeys(failed))}", code=CHECK_FAILED)
        emit_json(document)
    else:
        obj = ctx.find_object(CLIContext)
        colors = {"ok": "green", "unknown": "yellow", "warning": "yellow", "error": "red"}
        width = max(len(f.check) for f in findings)
        for f in findings:
            level = f.level.ljust(7)
            styled = obj.style(level, fg=colors[f.level]) if obj is not None else level
            click.echo(f"{styled}  {printable(f.check.ljust(width))}  {printable(f.message)}")
    if failed:
        ctx.exit(CHECK_FAILED)
