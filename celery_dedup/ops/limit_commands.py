"""``celery -A proj dedup limits``: limit groups as they are used, and run-time changes to named groups.

``limits`` lists the named groups (declared values, overrides, pauses, and
a row per key used) and the task groups used in the last day; ``set`` /
``clear`` override a named group's values, ``pause`` / ``resume`` stop and
restart its starts, for the whole group or one key. Every change goes
through :mod:`celery_dedup.limits`, as the Django admin's do.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import click
from celery import Celery

from .. import limits as climits
from .. import runtime
from ..limits import ALL_KEYS, GroupInfo, Override
from ..store import limits as limit_groups
from ..store.status import from_ms
from .output import (
    NotFound,
    command_app,
    emit_json,
    format_table,
    human_time,
    json_flag,
    local_time,
    operator_name,
    printable,
)


def _override(override: Override | None) -> str:
    """``concurrency 1, rate 10/s``; ``-`` for none."""
    return (str(override) if override is not None else "") or "-"


def _paused(until: int | None, now_ms: int) -> str:
    """A pause's end (ms, server clock) as local time and age; ``until resumed``; ``-`` when not paused."""
    if until is None or (until != -1 and until <= now_ms):
        return "-"
    if until == -1:
        return "until resumed"
    return "until " + local_time(from_ms(str(until)), now_ms / 1000)


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
    lines.append(format_table(rows, headers, indent="  ", shorten=(0, 5)))
    return "\n".join(lines)


@click.group("limits", invoke_without_command=True)
@click.option("--limit", type=click.IntRange(1, 10_000), default=100, show_default=True, help="Groups at most.")
@json_flag
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
    app = command_app(ctx)
    named = climits.describe(app)
    used = climits.groups(runtime.store_for(app), limit=limit)
    if as_json:
        emit_json({"named": [_named_json(info) for info in named], "groups": [_group_json(g) for g in used]})
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
        sections.append(format_table(rows, headers, shorten=(0, 1)))
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
@json_flag
@click.pass_context
def limits_set(
    ctx: click.Context, group: str, key: str | None, concurrency: int | None, rates: tuple[str, ...], as_json: bool
) -> None:
    """Override a named group's values, for one key or the whole group, from its next admission on."""
    if concurrency is None and not rates:
        raise click.UsageError("give --concurrency, --rate or both")
    climits.override(
        command_app(ctx), group, key, concurrency=concurrency, rate=list(rates) if rates else None, by=operator_name()
    )
    if as_json:
        emit_json({"group": group, "key": key, "concurrency": concurrency, "rates": list(rates) or None})
        return
    values = [] if concurrency is None else [f"concurrency {concurrency}"]
    values += [f"rate {', '.join(rates)}"] if rates else []
    click.echo(printable(f"override of {_scope(group, key)}: {', '.join(values)}"))


@limits_.command("clear")
@click.argument("group")
@_key_option
@json_flag
@click.pass_context
def limits_clear(ctx: click.Context, group: str, key: str | None, as_json: bool) -> None:
    """Go back to a named group's declared values (exit 2 when there was no override)."""
    if not climits.clear_override(command_app(ctx), group, key, by=operator_name()):
        raise NotFound(f"no override of {_scope(group, key)} to clear")
    if as_json:
        emit_json({"group": group, "key": key, "cleared": True})
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
@json_flag
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
    climits.pause(command_app(ctx), group, key, until=end, by=operator_name())
    if as_json:
        emit_json({"group": group, "key": key, "until": None if end is None else end.isoformat()})
        return
    click.echo(
        printable(f"paused {_scope(group, key)} " + ("until resumed" if end is None else f"until {local_time(end)}"))
    )


@limits_.command("resume")
@click.argument("group")
@_key_option
@json_flag
@click.pass_context
def limits_resume(ctx: click.Context, group: str, key: str | None, as_json: bool) -> None:
    """Let a paused named group (or key) start again; its waiting runs go in arrival order (exit 2: not paused)."""
    if not climits.resume(command_app(ctx), group, key, by=operator_name()):
        raise NotFound(f"{_scope(group, key)} is not paused")
    if as_json:
        emit_json({"group": group, "key": key, "resumed": True})
        return
    click.echo(printable(f"resumed {_scope(group, key)}"))
