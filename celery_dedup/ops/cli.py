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

import datetime
import difflib
import getpass
import json
import os
import socket
import sys
import time
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import click
import redis
from celery import Celery
from celery.bin.base import CLIContext

import celery_dedup

from .. import limits as climits
from .. import operations, runtime
from ..decisions import DECISIONS
from ..exceptions import DedupError
from ..keys import member_for, split_member, task_from_namespace
from ..limits import GroupInfo, Override, Rate
from ..store import limits as limit_groups
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

OK, USAGE, NOT_FOUND, REFUSED, CHECK_FAILED, NOT_HELD = 0, 1, 2, 3, 4, 5


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


_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: str) -> str:
    """``text`` with what a terminal would act on escaped as Python does in ``repr``.

    Control characters (an ``ESC`` sequence clears the screen or sets the
    window title, a carriage return overwrites the line), bidi overrides and
    line separators become ``\\x1b``, ``\\u202e``...: stored text (keys, errors,
    worker names, notes) is shown, never obeyed. Backslashes stay as they are,
    so printed keys can be pasted back.
    """
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _NAMED.get(ch) or _escaped(ord(ch)) for ch in text)


def _escaped(code: int) -> str:
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


class CliError(click.ClickException):
    """A failure reported on stderr, exit code 1; what it quotes from Redis is escaped."""

    exit_code = USAGE

    def __init__(self, message: str) -> None:
        super().__init__(printable(message))


class NotFound(CliError):
    """Nothing to show or release: exit code 2."""

    exit_code = NOT_FOUND


class Refused(CliError):
    """A release refused because the key is executing: exit code 3."""

    exit_code = REFUSED


class NotHeld(CliError):
    """A release of a key that is not held and has no live lock: nothing to do, exit code 5."""

    exit_code = NOT_HELD


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
        _emit_json({"error": exc.format_message(), "code": exc.exit_code})
    return exc


@click.group(cls=_DedupGroup, help=_HELP)
def dedup() -> None:
    """Inspect and repair celery-dedup keys (the group's help is ``_HELP``)."""


def _app(ctx: click.Context) -> Celery:
    obj = ctx.find_object(CLIContext)
    if obj is None:
        raise CliError("run this as: celery -A <your app> dedup ...")
    return obj.app


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


def _operator() -> str:
    """Who releases a key, for its history: ``user@host``."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no login name in the environment or the password database
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _emit_json(document: Any) -> None:
    click.echo(json.dumps(document, indent=2, sort_keys=True))


#: Columns a table is fitted to when stdout is no terminal and ``COLUMNS`` is unset: wide enough
#: for a list of ordinary keys whole, narrow enough that one long key does not widen a log or a pager.
DEFAULT_WIDTH = 120
#: A shortened column keeps at least its header and this many columns.
_MIN_SHORTENED = 8


def terminal_width() -> int:
    """``COLUMNS`` if set, else the width of the terminal stdout is, else :data:`DEFAULT_WIDTH`.

    As :func:`shutil.get_terminal_size`, but of the stream output is written
    to (``sys.stdout``), not the one the process started with.
    """
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    try:
        return os.get_terminal_size(sys.stdout.fileno()).columns or DEFAULT_WIDTH
    except (AttributeError, OSError, ValueError):  # no file descriptor, or not a terminal
        return DEFAULT_WIDTH


def _char_width(char: str) -> int:
    if unicodedata.combining(char):
        return 0
    return 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1


def _text_width(text: str) -> int:
    """Terminal columns ``text`` takes: wide (East Asian) characters two, combining marks none."""
    return sum(_char_width(char) for char in text)


def _shortened(text: str, width: int) -> str:
    """``text`` cut to ``width`` columns, its end replaced by an ellipsis if it was longer."""
    if _text_width(text) <= width:
        return text
    kept, used = [], 0
    for char in text:
        used += _char_width(char)
        if used > width - 1:
            break
        kept.append(char)
    return "".join(kept) + "…"


def _fitted(natural: Sequence[int], least: Sequence[int], width: int) -> list[int]:
    """Column widths whose sum (and the gaps) is within ``width``, taken from the widest columns first.

    No column goes below its ``least``; when even those do not fit, the table is wider than ``width``.
    """
    budget = width - 2 * (len(natural) - 1)
    if sum(natural) <= budget:
        return list(natural)
    low, high = 0, max(natural)  # the largest cap on column widths that fits
    while low < high:
        cap = (low + high + 1) // 2
        if sum(min(n, max(cap, m)) for n, m in zip(natural, least, strict=True)) <= budget:
            low = cap
        else:
            high = cap - 1
    widths = [min(n, max(low, m)) for n, m in zip(natural, least, strict=True)]
    spare = budget - sum(widths)
    for i in sorted(range(len(natural)), key=lambda i: -natural[i]):  # what the cap leaves: to the widest cut
        if spare > 0 and widths[i] < natural[i]:
            widths[i] += 1
            spare -= 1
    return widths


def _table(
    rows: Sequence[Sequence[str]], headers: Sequence[str] = (), indent: str = "", shorten: Sequence[int] = ()
) -> str:
    """Rows as aligned columns, two spaces apart, under ``headers`` if given; cells made :func:`printable`.

    ``shorten``: the columns whose values may be cut (with an ellipsis) so that
    the table fits :func:`terminal_width`; the others are always whole.
    """
    lines = [[printable(cell) for cell in line] for line in ([headers, *rows] if headers else rows)]
    widths = [max(_text_width(cell) for cell in column) for column in zip(*lines, strict=True)]
    if shorten:
        heads = [_text_width(cell) for cell in lines[0]] if headers else [0] * len(widths)
        least = [
            w if i not in shorten else min(w, max(h, _MIN_SHORTENED))
            for i, (w, h) in enumerate(zip(widths, heads, strict=True))
        ]
        widths = _fitted(widths, least, terminal_width() - len(indent))
        lines = [[_shortened(cell, w) for cell, w in zip(line, widths, strict=True)] for line in lines]
    return "\n".join(
        indent + "  ".join(c + " " * (w - _text_width(c)) for c, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def _age(seconds: float) -> str:
    future, seconds = seconds < 0, abs(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            amount = f"{int(seconds // size)}{unit}"
            break
    else:
        amount = f"{int(seconds)}s"
    return f"in {amount}" if future else f"{amount} ago"


def _when(moment: datetime.datetime | None, now: float | None = None) -> str:
    """A record's time as local time and age; ``-`` when unset."""
    if moment is None:
        return "-"
    local = moment.astimezone()
    return f"{local:%Y-%m-%d %H:%M:%S} ({_age((time.time() if now is None else now) - moment.timestamp())})"


def human_time(ms: str | None, now: float | None = None) -> str:
    """A record's millisecond timestamp as local time and age; ``-`` for missing or 0."""
    return _when(from_ms(ms), now)


def _json_flag(function: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")(function)


def _yes_flag(function: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")(function)


def _task_option(function: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--task", help="The task name; without it KEY is the whole member '<task>:<key>'.")(function)


@dedup.command("list")
@click.option("--state", type=click.Choice(STATES), help="Only records in this state.")
@click.option("--task", help="Only records of this task name.")
@click.option("--prefix", metavar="KEYPREFIX", help="Only business keys starting with this (key order then).")
@click.option("--limit", type=click.IntRange(1, 1000), default=50, show_default=True, help="Records per page.")
@click.option("--cursor", help="Where to go on: the cursor the previous page printed.")
@_json_flag
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
        page = celery_dedup.records(_app(ctx), state=state, task=task, prefix=prefix, cursor=cursor, limit=limit)
    except ValueError as exc:
        raise click.BadParameter(f"{cursor!r} is not a cursor this command printed", param_hint="--cursor") from exc
    if as_json:
        records = [status.as_dict() for status in page.records]
        _emit_json({"records": records, "cursor": page.cursor, "total": page.total})
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
                _when(status.updated_at, now),
                status.worker or "-",
                str(status.attempts),
                str(status.duplicates),
            )
            for status in page.records
        ]
        click.echo(_table(rows, headers, shorten=(0, 1, 3, 5)))
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
            rows.append((doc.name, _when(from_ms(value), now) if doc.time else value))
    rows += sorted(
        (name, value)
        for name, value in status.fields.items()
        if name not in FIELD_DOC and not is_history_field(name)  # the history is shown as its own table
    )
    return rows


@dedup.command()
@click.argument("key")
@_task_option
@_json_flag
@click.pass_context
def show(ctx: click.Context, key: str, task: str | None, as_json: bool) -> None:
    """Everything about one key: record, history, hold and execution lock."""
    found = _lookup(_app(ctx), key, task)
    if _is_absent(found):
        raise NotFound(f"{found.member!r} has no record, hold or lock")
    if as_json:
        _emit_json(_detail_json(found))
        return
    namespace, business_key = split_member(found.member)
    namespace = task_from_namespace(namespace)
    lock = f"{found.lock_token} ({found.lock_ttl_ms / 1000:.1f} s left)" if found.lock_token else "none"
    head = [("member", found.member), ("task", namespace), ("key", business_key)]
    head += [("held", "yes" if found.held else "no"), ("lock", lock)]
    click.echo(_table(head))
    now = time.time()
    status = found.status
    if status is None:
        click.echo("\nrecord: none")
    else:
        tombstone = " (purged: only the run id, how it ended and its nonces remain)" if status.purged else ""
        click.echo(f"\nrecord{tombstone}:")
        click.echo(_table(_field_rows(status, now), indent="  "))
    entries = _history(found)
    click.echo("\nhistory (newest first):" if entries else "\nhistory: none")
    if entries:
        rows = [(_when(e.at, now), e.state, e.task_id, e.note) for e in entries]
        click.echo(_table(rows, indent="  "))
    if found.steps:
        click.echo("\nsteps (dedup_once):")
        headers = ("step", "scope", "state", "attempts", "when", "idempotency key")
        click.echo(_table(_step_rows(found.steps, now), headers, indent="  "))


def _step_rows(steps: Sequence[StepStatus], now: float) -> list[tuple[str, ...]]:
    """One row per step: name, scope, state, attempts, when it last ended (or began), its idempotency key."""
    rows: list[tuple[str, ...]] = []
    for step in steps:
        when = _when(step.finished_at or step.started_at, now)
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
@_yes_flag
@_json_flag
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
    app = _app(ctx)
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
    result = operations.release(app, member, force_token=(token or "") if force else "", by=_operator())
    if result.code == ReleaseResult.REFUSED_LOCKED:
        raise Refused(f"refused: {member!r} started executing meanwhile ({int(result.detail) / 1000:.1f} s left)")
    if result.code == ReleaseResult.REFUSED_LOCK_CHANGED:
        raise Refused(f"refused: the lock of {member!r} now belongs to {result.detail}, not {token}")
    if result.code == ReleaseResult.NOTHING and result.detail:
        raise NotHeld(_not_held(member, result.detail))
    if result.code == ReleaseResult.NOTHING:
        raise NotFound(f"nothing to release: {member!r} has no record, hold or lock any more")
    if as_json:
        _emit_json({"member": member, "state": result.detail, "was_held": result.was_held, "forced": result.forced})
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
@_yes_flag
@_json_flag
@click.pass_context
def purge(ctx: click.Context, states: tuple[str, ...], limit: int, yes: bool, as_json: bool) -> None:
    """Delete status records of ended runs; held or locked keys keep theirs."""
    if as_json and not yes:
        raise click.UsageError("--json never asks for confirmation: add --yes to purge")
    if not yes:
        click.confirm(f"Delete up to {limit} records in state {', '.join(states)}?", abort=True, err=True)
    report = operations.purge(_app(ctx), states=states, limit=limit)
    if as_json:
        _emit_json(asdict(report))
        return
    click.echo(f"purged {report.purged} records; kept {report.kept} whose key is held or whose lock is alive")
    if report.more:
        click.echo("more remain: run purge again")


@dedup.command()
@_json_flag
@click.pass_context
def reap(ctx: click.Context, as_json: bool) -> None:
    """One clean-up pass, as workers run every dedup_reap_interval seconds."""
    report = celery_dedup.reap(_app(ctx))
    if as_json:
        _emit_json(asdict(report))
        return
    click.echo(
        f"released {report.released} expired holds; marked {report.lost} runs of dead workers lost; "
        f"removed {report.stale} stale index entries; marked {report.vanished} runs whose message vanished lost"
    )


@dedup.command()
@_json_flag
@click.pass_context
def stats(ctx: click.Context, as_json: bool) -> None:
    """Decisions per task, counted in Redis by every process of the app."""
    counts = celery_dedup.stats(_app(ctx))
    if as_json:
        _emit_json(counts)
        return
    if not counts:
        click.echo("no decisions counted yet")
        return
    seen = {decision for per_task in counts.values() for decision in per_task}
    columns = [*DECISIONS, *sorted(seen - set(DECISIONS))]
    rows = [(name, *(str(counts[name].get(d, 0)) for d in columns)) for name in sorted(counts)]
    click.echo(_table(rows, ("TASK", *(c.upper() for c in columns))))


#: How a key's row names the whole group (its group-wide override or pause): never a key, which is text.
ALL_KEYS = "(all keys)"


def _rates(rates: Sequence[Rate] | None) -> str:
    return ", ".join(str(rate) for rate in rates) if rates else "-"


def _override(override: Override | None) -> str:
    """``concurrency 1, rate 10/s``; ``-`` for none."""
    if override is None:
        return "-"
    parts = [] if override.concurrency is None else [f"concurrency {override.concurrency}"]
    parts += [] if override.rates is None else [f"rate {_rates(override.rates)}"]
    return ", ".join(parts) or "-"


def _paused(until: int | None, now_ms: int) -> str:
    """A pause's end (ms, server clock) as local time and age; ``until resumed``; ``-`` when not paused."""
    if until is None or (until != -1 and until <= now_ms):
        return "-"
    if until == -1:
        return "until resumed"
    return "until " + _when(from_ms(str(until)), now_ms / 1000)


def _server_ms(app: Celery) -> int:
    seconds, micros = runtime.store_for(app).client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def _windows(group: limit_groups.GroupState) -> str:
    """Starts in each window over its rate: ``3/5/s, 40/200/h``; ``-`` without a rate."""
    pairs = zip(group.starts_per_window, group.rates, strict=False)
    return ", ".join(f"{starts}/{rate}" for starts, rate in pairs) or "-"


def _override_json(override: Override | None) -> dict[str, Any] | None:
    if override is None:
        return None
    rates = None if override.rates is None else [str(rate) for rate in override.rates]
    return {"concurrency": override.concurrency, "rates": rates}


def _group_json(group: limit_groups.GroupState) -> dict[str, Any]:
    return {
        **asdict(group),
        "rate": None if group.rate is None else str(group.rate),
        "rates": [str(rate) for rate in group.rates],
        "starts_per_window": list(group.starts_per_window),
    }


def _named_json(info: GroupInfo) -> dict[str, Any]:
    return {
        "name": info.name,
        "concurrency": info.concurrency,
        "rates": [str(rate) for rate in info.rates],
        "override": _override_json(info.override),
        "paused_until": info.paused_until,
        "keys": {
            key: {"override": _override_json(conf.override), "paused_until": conf.paused_until}
            for key, conf in info.keys.items()
        },
    }


def _named_section(info: GroupInfo, used: Sequence[limit_groups.GroupState], now_ms: int) -> str:
    """One named group: its declared values, group-wide override and pause, then a row per key."""
    head = f"named group {info.name}: {_override(Override(info.concurrency, tuple(info.rates) or None))}"
    lines = [head]
    if info.override is not None:
        lines.append(f"  override {ALL_KEYS}: {_override(info.override)}")
    if _paused(info.paused_until, now_ms) != "-":
        lines.append(f"  paused {ALL_KEYS}: {_paused(info.paused_until, now_ms)}")
    by_key = {g.key: g for g in used}
    keys = [*by_key, *sorted(key for key in info.keys if key not in by_key)]
    if not keys:
        lines.append("  no key used in the last day")
        return "\n".join(lines)
    rows = []
    for key in keys:
        conf, state = info.keys.get(key), by_key.get(key)
        paused = _paused(conf.paused_until if conf else None, now_ms)
        if state is None:
            rows.append((key, "-", "-", "-", paused, _override(conf.override if conf else None), "-", "-"))
            continue
        rows.append(
            (
                key,
                "-" if state.concurrency is None else f"{state.in_use}/{state.concurrency}",
                str(state.waiting),
                _windows(state),
                paused,
                _override(conf.override if conf else None),
                f"{state.avg_ms} ms" if state.avg_ms else "-",
                human_time(str(state.last_used), now_ms / 1000),
            )
        )
    headers = ("KEY", "SLOTS", "WAITING", "STARTS/WINDOW", "PAUSED", "OVERRIDE", "MEAN BODY", "LAST USED")
    lines.append(_table(rows, headers, indent="  ", shorten=(0, 5)))
    return "\n".join(lines)


@dedup.group("limits", invoke_without_command=True)
@click.option("--limit", type=click.IntRange(1, 10_000), default=100, show_default=True, help="Groups at most.")
@_json_flag
@click.pass_context
def limits_(ctx: click.Context, limit: int, as_json: bool) -> None:
    """Limit groups: named groups with their values, overrides and pauses, and the groups used in the last day.

    Without a subcommand, lists them: slots in use, waiting runs, starts in
    each rate window, mean body time. The subcommands change a named group
    at run time, for the next admission: set / clear an override of its
    values, pause / resume its starts (the whole group, or one key of it).
    """
    if ctx.invoked_subcommand is not None:
        return
    app = _app(ctx)
    named = climits.describe(app)
    used = climits.groups(runtime.store_for(app), limit=limit)
    if as_json:
        _emit_json({"named": [_named_json(info) for info in named], "groups": [_group_json(g) for g in used]})
        return
    inline = [g for g in used if g.name is None]
    if not named and not inline:
        click.echo("no limit groups used in the last day")
        return
    now_ms = _server_ms(app)
    sections = [_named_section(info, [g for g in used if g.name == info.name], now_ms) for info in named]
    if inline:
        rows = [
            (
                g.task,
                g.key,
                "-" if g.concurrency is None else f"{g.in_use}/{g.concurrency}",
                str(g.waiting),
                _windows(g),
                f"{g.avg_ms} ms" if g.avg_ms else "-",
                human_time(str(g.last_used), now_ms / 1000),
            )
            for g in inline
        ]
        headers = ("TASK", "GROUP", "SLOTS", "WAITING", "RATE", "MEAN BODY", "LAST USED")
        sections.append(_table(rows, headers, shorten=(0, 1)))
    click.echo("\n\n".join(sections))


def _key_option(function: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--key", help="One key of the group (a limit_key value); without it, the whole group.")(
        function
    )


def _scope(group: str, key: str | None) -> str:
    return f"{group!r}" + (f" key {key!r}" if key is not None else f" {ALL_KEYS}")


@limits_.command("set")
@click.argument("group")
@_key_option
@click.option("--concurrency", type=int, help="Bodies of one key at a time.")
@click.option(
    "--rate", "rates", multiple=True, metavar="R/UNIT", help="R starts per s, m, h or d (repeat for several)."
)
@_json_flag
@click.pass_context
def limits_set(
    ctx: click.Context, group: str, key: str | None, concurrency: int | None, rates: tuple[str, ...], as_json: bool
) -> None:
    """Override a named group's values, for one key or the whole group, from its next admission on."""
    if concurrency is None and not rates:
        raise click.UsageError("give --concurrency, --rate or both")
    climits.override(
        _app(ctx), group, key, concurrency=concurrency, rate=list(rates) if rates else None, by=_operator()
    )
    if as_json:
        _emit_json({"group": group, "key": key, "concurrency": concurrency, "rates": list(rates) or None})
        return
    values = [] if concurrency is None else [f"concurrency {concurrency}"]
    values += [f"rate {', '.join(rates)}"] if rates else []
    click.echo(printable(f"override of {_scope(group, key)}: {', '.join(values)}"))


@limits_.command("clear")
@click.argument("group")
@_key_option
@_json_flag
@click.pass_context
def limits_clear(ctx: click.Context, group: str, key: str | None, as_json: bool) -> None:
    """Go back to a named group's declared values (exit 2 when there was no override)."""
    if not climits.clear_override(_app(ctx), group, key, by=_operator()):
        raise NotFound(f"no override of {_scope(group, key)} to clear")
    if as_json:
        _emit_json({"group": group, "key": key, "cleared": True})
        return
    click.echo(printable(f"cleared the override of {_scope(group, key)}"))


def _iso_time(value: str) -> datetime.datetime:
    """``--until``'s time, aware; naive is UTC, as ``pause`` reads it; a ``Z`` suffix too (Python 3.10 reads none)."""
    try:
        moment = datetime.datetime.fromisoformat(value[:-1] + "+00:00" if value.endswith(("z", "Z")) else value)
    except ValueError as exc:
        raise click.BadParameter(f"{value!r} is no ISO 8601 time", param_hint="--until") from exc
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=datetime.timezone.utc)


@limits_.command("pause")
@click.argument("group")
@_key_option
@click.option("--for", "seconds", type=click.FloatRange(0, min_open=True), help="Seconds from now.")
@click.option("--until", "until", metavar="ISO", help="An ISO 8601 time (UTC unless it names its offset).")
@_json_flag
@click.pass_context
def limits_pause(
    ctx: click.Context, group: str, key: str | None, seconds: float | None, until: str | None, as_json: bool
) -> None:
    """No new start in a named group (or one key of it) until the time given, or until resumed.

    Waiting runs keep their place and hold no worker slot; running bodies go on.
    """
    if seconds is not None and until is not None:
        raise click.UsageError("give --for or --until, not both")
    end: datetime.datetime | None = None
    if until is not None:
        end = _iso_time(until)
        if end <= datetime.datetime.now(datetime.timezone.utc):
            raise click.BadParameter(f"{until!r} has passed", param_hint="--until")
    elif seconds is not None:
        end = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=seconds)
    climits.pause(_app(ctx), group, key, until=end, by=_operator())
    if as_json:
        _emit_json({"group": group, "key": key, "until": None if end is None else end.isoformat()})
        return
    click.echo(printable(f"paused {_scope(group, key)} " + ("until resumed" if end is None else f"until {_when(end)}")))


@limits_.command("resume")
@click.argument("group")
@_key_option
@_json_flag
@click.pass_context
def limits_resume(ctx: click.Context, group: str, key: str | None, as_json: bool) -> None:
    """Let a paused named group (or key) start again; its waiting runs go in arrival order (exit 2: not paused)."""
    if not climits.resume(_app(ctx), group, key, by=_operator()):
        raise NotFound(f"{_scope(group, key)} is not paused")
    if as_json:
        _emit_json({"group": group, "key": key, "resumed": True})
        return
    click.echo(printable(f"resumed {_scope(group, key)}"))


@dedup.command()
@click.option("--dry-run", is_flag=True, help="Print what it would do; change nothing.")
@_json_flag
@click.pass_context
def migrate(ctx: click.Context, dry_run: bool, as_json: bool) -> None:
    """Move the store's format-1 leftovers to this release's format, once every producer and worker runs it.

    Folds the history lists into their records, deletes the old indexes and
    marks the store's format. Safe to run again, and while workers run.
    """
    report = operations.migrate(_app(ctx), dry_run=dry_run)
    if as_json:
        _emit_json(asdict(report))
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
@_json_flag
@click.pass_context
def check(ctx: click.Context, countdown: float, strict: bool, as_json: bool) -> None:
    """Warn about what would break the guarantees in this app's setup.

    Looks at: install, the broker and dedup_redis_url, task options,
    visibility_timeout, the server's maxmemory-policy and persistence, and
    its clock. 'unknown' (CONFIG not allowed) never fails the check.
    """
    findings = run_checks(_app(ctx), countdown=countdown)
    failing = {"error", "warning"} if strict else {"error"}
    failed = [f.check for f in findings if f.level in failing]
    if as_json:
        document: dict[str, Any] = {"findings": [asdict(f) for f in findings], "failed": bool(failed)}
        if failed:
            document.update(error=f"check failed: {', '.join(dict.fromkeys(failed))}", code=CHECK_FAILED)
        _emit_json(document)
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
