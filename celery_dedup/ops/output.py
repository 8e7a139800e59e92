"""What the ``dedup`` commands share: exit codes, errors, the app, and output for people and for scripts.

Tables are fitted to the terminal's width, and everything quoted from Redis
is made :func:`printable` first; ``--json`` output is one document.
"""

from __future__ import annotations

import datetime
import getpass
import json
import os
import socket
import sys
import time
import unicodedata
from collections.abc import Callable, Sequence
from typing import Any

import click
from celery import Celery
from celery.bin.base import CLIContext

from ..store.status import from_ms

OK, USAGE, NOT_FOUND, REFUSED, CHECK_FAILED, NOT_HELD = 0, 1, 2, 3, 4, 5


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


def command_app(ctx: click.Context) -> Celery:
    obj = ctx.find_object(CLIContext)
    if obj is None:
        raise CliError("run this as: celery -A <your app> dedup ...")
    return obj.app


def operator_name() -> str:
    """Who releases a key, for its history: ``user@host``."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no login name in the environment or the password database
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def emit_json(document: Any) -> None:
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


def text_width(text: str) -> int:
    """Terminal columns ``text`` takes: wide (East Asian) characters two, combining marks none."""
    return sum(_char_width(char) for char in text)


def shortened(text: str, width: int) -> str:
    """``text`` cut to ``width`` columns, its end replaced by an ellipsis if it was longer."""
    if text_width(text) <= width:
        return text
    kept, used = [], 0
    for char in text:
        used += _char_width(char)
        if used > width - 1:
            break
        kept.append(char)
    return "".join(kept) + "…"


def fitted_widths(natural: Sequence[int], least: Sequence[int], width: int) -> list[int]:
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


def format_table(
    rows: Sequence[Sequence[str]], headers: Sequence[str] = (), indent: str = "", shorten: Sequence[int] = ()
) -> str:
    """Rows as aligned columns, two spaces apart, under ``headers`` if given; cells made :func:`printable`.

    ``shorten``: the columns whose values may be cut (with an ellipsis) so that
    the table fits :func:`terminal_width`; the others are always whole.
    """
    lines = [[printable(cell) for cell in line] for line in ([headers, *rows] if headers else rows)]
    widths = [max(text_width(cell) for cell in column) for column in zip(*lines, strict=True)]
    if shorten:
        heads = [text_width(cell) for cell in lines[0]] if headers else [0] * len(widths)
        least = [
            w if i not in shorten else min(w, max(h, _MIN_SHORTENED))
            for i, (w, h) in enumerate(zip(widths, heads, strict=True))
        ]
        widths = fitted_widths(widths, least, terminal_width() - len(indent))
        lines = [[shortened(cell, w) for cell, w in zip(line, widths, strict=True)] for line in lines]
    return "\n".join(
        indent + "  ".join(c + " " * (w - text_width(c)) for c, w in zip(line, widths, strict=True)).rstrip()
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


def local_time(moment: datetime.datetime | None, now: float | None = None) -> str:
    """A record's time as local time and age; ``-`` when unset."""
    if moment is None:
        return "-"
    local = moment.astimezone()
    return f"{local:%Y-%m-%d %H:%M:%S} ({_age((time.time() if now is None else now) - moment.timestamp())})"


def human_time(ms: str | None, now: float | None = None) -> str:
    """A record's millisecond timestamp as local time and age; ``-`` for missing or 0."""
    return local_time(from_ms(ms), now)


def json_flag(function: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")(function)


def yes_flag(function: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")(function)
