"""One picture of the comparison: enqueue cost per call, and what a storm with worker kills left behind.

Reads the JSON results of ``benchmarks/enqueue.py`` and ``benchmarks/storm.py``
and draws one PNG with two panels:

- left: median µs per ``apply_async`` call for each case, with the spread
  (min to max) of the per-repeat medians as error bars;
- right: per library, the storm's duplicates executed, re-runs after kills,
  accepted calls lost and keys left stuck.

Run it from the repository root, after those two::

    .venv/bin/python -m benchmarks.chart [--enqueue FILE] [--storm FILE] [--output PNG ...]

It writes ``docs/_static/benchmarks.png`` and ``benchmarks/results/benchmarks.png``.
"""

from __future__ import annotations

import argparse
import json
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
    rows = result["timing"]
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


def draw(enqueue: dict[str, Any], storm: dict[str, Any], outputs: Sequence[Path]) -> None:
    figure, (left, right) = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [1.25, 1]})
    enqueue_panel(left, enqueue)
    storm_panel(right, storm)
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


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0] if __doc__ else None)
    parser.add_argument("--enqueue", type=Path, default=RESULTS / "enqueue.json", help="enqueue.py's JSON result")
    parser.add_argument("--storm", type=Path, default=RESULTS / "storm.json", help="storm.py's JSON result")
    parser.add_argument(
        "--output", type=Path, action="append", help="PNG file (repeatable; default both docs and results)"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    draw(load(args.enqueue, "enqueue"), load(args.storm, "storm"), args.output or DEFAULT_OUTPUTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
