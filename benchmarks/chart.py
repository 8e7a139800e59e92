"""Pictures of the comparison: enqueue, storm and recovery in one; worker throughput against body time in another.

Reads the JSON results of ``benchmarks/enqueue.py``, ``benchmarks/storm.py``
and (where present) ``benchmarks/recovery.py``, and draws one PNG:

- left: median µs per ``apply_async`` call for each case (no result
  backend), with the spread (min to max) of the per-repeat medians as error
  bars;
- middle: per library, the storm's duplicates executed, re-runs after kills,
  accepted calls lost and keys left stuck;
- right: per library, seconds from a worker's restart to the re-run of the
  task a SIGKILL interrupted, for a killed pool child and a killed worker.

From the body-time sweep of ``benchmarks/worker.py``'s result it draws a
second PNG, one column per pool: above, tasks/s of plain Celery, celery-dedup,
celery-once and celery-singleton at each body time (log scale); below, each
library's throughput over plain Celery's, with the per-repeat range as error
bars, so where the overhead stops mattering can be read off.

Run it from the repository root, after those::

    .venv/bin/python -m benchmarks.chart [--enqueue FILE] [--storm FILE] [--recovery FILE] [--output PNG ...]
        [--worker FILE] [--body-output PNG ...] [--figures comparison,body-time]

It writes ``docs/_static/benchmarks.png`` and ``benchmarks/results/benchmarks.png``,
and ``docs/_static/body_time.png`` and ``benchmarks/results/body_time.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display, no GUI toolkit
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.ticker import MaxNLocator

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_OUTPUTS = (ROOT / "docs" / "_static" / "benchmarks.png", RESULTS / "benchmarks.png")
DEFAULT_BODY_OUTPUTS = (ROOT / "docs" / "_static" / "body_time.png", RESULTS / "body_time.png")
FIGURES = ("comparison", "body-time")
#: The ratio issue 27 asks of a task with a real (5 ms) body, drawn as a guide on the body-time figure.
BODY_TARGET = 0.98
#: celery-dedup's colour; the peers and plain Celery get quieter ones.
COLOURS = {"plain": "#9e9e9e", "dedup": "#1f6fb2", "celery-dedup": "#1f6fb2", "celery-once": "#e08a1e"}
OTHER_COLOUR = "#6a9f3a"
#: (result field, legend, colour): what went wrong in red hues; re-runs a kill explains in grey.
STORM_MEASURES = (
    ("duplicates", "duplicates executed", "#d62728"),
    ("reruns_after_kill", "re-runs after kills", "#9e9e9e"),
    ("lost", "lost", "#7b3294"),
    ("stuck", "stuck keys", "#8c564b"),
)


def load(path: Path, benchmark: str) -> dict[str, Any]:
    try:
        result: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SystemExit(f"{path} not found: run benchmarks/{benchmark}.py first") from None
    if result.get("benchmark") != benchmark:
        raise SystemExit(f"{path} is not a {benchmark} result")
    return result


def colour(name: str) -> str:
    return next((c for prefix, c in COLOURS.items() if name.startswith(prefix)), OTHER_COLOUR)


def enqueue_panel(ax: Axes, result: dict[str, Any]) -> None:
    rows = [row for row in result["timing"] if not row.get("result_backend")]
    names = [row["case"] for row in rows]
    medians = [row["median_us"] for row in rows]
    low = [row["median_us"] - min(row["repeat_medians_us"]) for row in rows]
    high = [max(row["repeat_medians_us"]) - row["median_us"] for row in rows]
    positions = range(len(rows))
    ax.barh(positions, medians, xerr=[low, high], color=[colour(n) for n in names], capsize=3)
    for y, row in zip(positions, rows, strict=True):
        ax.text(
            max(row["repeat_medians_us"]), y, f"  {row['median_us']:.0f} µs ({row['ratio_to_plain']:.2f}x)", va="center"
        )
    ax.set_yticks(list(positions), names)
    ax.invert_yaxis()
    ax.set_xlabel("median µs per apply_async call (bars: min\N{EN DASH}max of per-repeat medians)")
    settings = result["settings"]
    ax.set_title(f"Enqueue: {settings['calls']} calls x {settings['repeats']} repeats per case")
    ax.set_xlim(0, max(medians) * 1.45)


def storm_panel(ax: Axes, result: dict[str, Any]) -> None:
    rows = result["libraries"]
    width = 0.8 / len(STORM_MEASURES)
    for i, (field, label, shade) in enumerate(STORM_MEASURES):
        xs = [j + (i - (len(STORM_MEASURES) - 1) / 2) * width for j in range(len(rows))]
        values = [row[field] for row in rows]
        bars = ax.bar(xs, values, width, label=label, color=shade)
        ax.bar_label(bars, labels=[str(v) for v in values], fontsize=8)
    ax.set_xticks(range(len(rows)), [row["library"] for row in rows])
    ax.set_ylabel("count")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    settings = result["settings"]
    ax.set_title(
        f"Storm: {settings['producers']} producers x {settings['keys']} keys x {settings['sends']} sends, "
        f"{settings['kills']} SIGKILLs"
    )
    ax.legend(fontsize=8)
    ax.margins(y=0.15)


def recovery_panel(ax: Axes, result: dict[str, Any]) -> None:
    """Seconds from the restart to the re-run, per library, for a killed pool child and a killed worker."""
    rows = result["scenarios"]
    libraries = list(dict.fromkeys(row["library"] for row in rows))
    kinds = list(dict.fromkeys(row["scenario"] for row in rows))
    width = 0.8 / len(kinds)
    for i, kind in enumerate(kinds):
        xs = [j + (i - (len(kinds) - 1) / 2) * width for j in range(len(libraries))]
        found = {row["library"]: row["from_restart_s"] for row in rows if row["scenario"] == kind}
        values = [max((found.get(name) or {}).get("median", 0.0), 0.0) for name in libraries]
        bars = ax.bar(xs, values, width, label=f"{kind} SIGKILLed", color=("#1f6fb2", "#9e9e9e")[i % 2])
        ax.bar_label(bars, labels=[f"{v:.2f} s" for v in values], fontsize=8)
    ax.set_xticks(range(len(libraries)), libraries)
    ax.set_ylabel("seconds from the worker's restart to the re-run")
    restart = float(result["settings"].get("restart_after", 2))
    ax.set_title(f"Crash recovery (acks_late; restarted {restart:g} s after the kill)")
    ax.legend(fontsize=8)
    ax.margins(y=0.15)


def draw(
    enqueue: dict[str, Any], storm: dict[str, Any], recovery: dict[str, Any] | None, outputs: Sequence[Path]
) -> None:
    panels = 3 if recovery is not None else 2
    ratios = [1.25, 1, 1][:panels]
    figure, axes = plt.subplots(1, panels, figsize=(7.5 * panels, 5.5), gridspec_kw={"width_ratios": ratios})
    enqueue_panel(axes[0], enqueue)
    storm_panel(axes[1], storm)
    if recovery is not None:
        recovery_panel(axes[2], recovery)
    server = enqueue["server"]["version"]
    versions = enqueue["versions"]
    figure.suptitle(
        f"celery-dedup {versions.get('celery-dedup')} vs celery-once {versions.get('celery-once', '?')} and "
        f"celery-singleton {versions.get('celery-singleton', '?')}: Celery {versions.get('celery')}, "
        f"redis-py {versions.get('redis')}, {server}, {enqueue['machine']['cpus']} cpus"
    )
    figure.tight_layout()
    for output in outputs:
        output.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(output, dpi=110)
        print(f"wrote {output}")
    plt.close(figure)


def sweeps(worker: dict[str, Any]) -> list[dict[str, Any]]:
    """The throughput rows of a worker result that hold a body-time sweep."""
    return [row for row in worker["throughput"] if row.get("body_sweep")]


def body_rate_panel(ax: Axes, row: dict[str, Any]) -> None:
    """Median tasks/s per library at each body time, the per-repeat range as error bars (log scale)."""
    bodies = row["body_sweep"]["rows"]
    positions = list(range(len(bodies)))
    for library in bodies[0]["tasks_per_s"]:
        rates = [body["tasks_per_s"][library] for body in bodies]
        medians = [statistics.median(r) for r in rates]
        spread = [
            [m - min(r) for m, r in zip(medians, rates, strict=True)],
            [max(r) - m for m, r in zip(medians, rates, strict=True)],
        ]
        ax.errorbar(positions, medians, yerr=spread, marker="o", capsize=3, label=library, color=colour(library))
    ax.set_yscale("log")
    ax.set_xticks(positions, [f"{body['body_ms']:g} ms" for body in bodies])
    ax.set_ylabel("tasks/s (median; bars: min\N{EN DASH}max)")
    pool = row["pool"] if row["pool"] == "solo" else f"prefork ({row['concurrency']})"
    ax.set_title(f"{pool} worker: throughput against the task's body time")
    ax.grid(True, which="both", axis="y", alpha=0.3)
    ax.legend(fontsize=8)


def body_ratio_panel(ax: Axes, row: dict[str, Any]) -> None:
    """Each library's tasks/s over plain Celery's in the same repeats, at each body time.

    Points and lines, not bars: the axis is zoomed to the ratios, where a bar's length would mislead.
    """
    sweep = row["body_sweep"]
    bodies = sweep["rows"]
    positions = list(range(len(bodies)))
    libraries = [name for name in bodies[0]["tasks_per_s"] if name != "plain"]
    offset = 0.06
    lowest, highest = BODY_TARGET, 1.0
    for i, library in enumerate(libraries):
        ratios = [
            [r / p for r, p in zip(body["tasks_per_s"][library], body["tasks_per_s"]["plain"], strict=True)]
            for body in bodies
        ]
        of_medians = [
            statistics.median(body["tasks_per_s"][library]) / statistics.median(body["tasks_per_s"]["plain"])
            for body in bodies
        ]
        spread = [
            [max(m - min(r), 0.0) for m, r in zip(of_medians, ratios, strict=True)],
            [max(max(r) - m, 0.0) for m, r in zip(of_medians, ratios, strict=True)],
        ]
        lowest = min(lowest, *(min(r) for r in ratios))
        highest = max(highest, *(max(r) for r in ratios))
        xs = [x + (i - (len(libraries) - 1) / 2) * offset for x in positions]
        ax.errorbar(xs, of_medians, yerr=spread, marker="o", capsize=3, label=library, color=colour(library))
        for x, value in zip(xs, of_medians, strict=True):
            ax.annotate(f"{value:.2f}", (x, value), textcoords="offset points", xytext=(6, -3), fontsize=7)
    ax.axhline(1.0, color=COLOURS["plain"], linewidth=1, label="plain Celery")
    ax.axhline(BODY_TARGET, color="#d62728", linewidth=1, linestyle="--", label=f"{BODY_TARGET:g}x of plain")
    ax.set_xticks(positions, [f"{body['body_ms']:g} ms" for body in bodies])
    ax.set_xlabel(f"the task's body (a sleep); {sweep['repeats']} drains per library and body time")
    ax.set_ylabel("tasks/s over plain Celery's (bars: per-repeat min\N{EN DASH}max)")
    ax.set_ylim(max(0.0, lowest - 0.05), highest + 0.08)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")


def draw_body_time(worker: dict[str, Any], outputs: Sequence[Path]) -> None:
    rows = sweeps(worker)
    figure, axes = plt.subplots(2, len(rows), figsize=(7.5 * len(rows), 9), squeeze=False)
    for column, row in enumerate(rows):
        body_rate_panel(axes[0][column], row)
        body_ratio_panel(axes[1][column], row)
    versions = worker["versions"]
    figure.suptitle(
        f"Worker throughput against the task's body time (no result backend, task_acks_late): "
        f"celery-dedup {versions.get('celery-dedup')}, celery-once {versions.get('celery-once', '?')}, "
        f"celery-singleton {versions.get('celery-singleton', '?')}\nCelery {versions.get('celery')}, "
        f"redis-py {versions.get('redis')} (parser: {versions.get('parser', '?')}), {worker['server']['version']}, "
        f"{worker['machine']['cpus']} cpus"
    )
    figure.tight_layout()
    for output in outputs:
        output.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(output, dpi=110)
        print(f"wrote {output}")
    plt.close(figure)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0] if __doc__ else None)
    parser.add_argument("--enqueue", type=Path, default=RESULTS / "enqueue.json", help="enqueue.py's JSON result")
    parser.add_argument("--storm", type=Path, default=RESULTS / "storm.json", help="storm.py's JSON result")
    parser.add_argument(
        "--recovery", type=Path, default=RESULTS / "recovery.json", help="recovery.py's JSON result (drawn if present)"
    )
    parser.add_argument(
        "--output", type=Path, action="append", help="PNG file (repeatable; default both docs and results)"
    )
    parser.add_argument(
        "--worker", type=Path, default=RESULTS / "worker.json", help="worker.py's JSON result (its body-time sweep)"
    )
    parser.add_argument(
        "--body-output",
        type=Path,
        action="append",
        help="PNG file of the body-time figure (repeatable; default both docs and results)",
    )
    parser.add_argument(
        "--figures", default=",".join(FIGURES), help=f"comma-separated: {', '.join(FIGURES)} (default both)"
    )
    args = parser.parse_args(argv)
    args.figures = [name.strip() for name in args.figures.split(",") if name.strip()]
    if not args.figures or any(name not in FIGURES for name in args.figures):
        parser.error(f"--figures takes {' and/or '.join(FIGURES)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if "comparison" in args.figures:
        recovery = load(args.recovery, "recovery") if args.recovery.exists() else None
        draw(load(args.enqueue, "enqueue"), load(args.storm, "storm"), recovery, args.output or DEFAULT_OUTPUTS)
    if "body-time" in args.figures:
        worker = load(args.worker, "worker")
        if not sweeps(worker):
            raise SystemExit(f"{args.worker} has no body-time sweep: run benchmarks/worker.py with --body-ms")
        draw_body_time(worker, args.body_output or DEFAULT_BODY_OUTPUTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
