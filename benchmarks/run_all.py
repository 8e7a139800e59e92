"""Run every benchmark, one after the other, then draw the chart; stop at the first that fails.

Each script runs as its own subprocess with this Python, from the repository
root, with its default options. ``--quick`` passes smaller sizes, for a smoke
run of the whole kit in a few minutes: its numbers are only indicative, so its
results and charts go to ``benchmarks/results/quick/`` and leave the full
results and the docs' charts alone. ``benchmarks/bulk.py`` runs when it exists;
``enqueue_rabbitmq`` says it skipped (and succeeds) where RabbitMQ is not
installed, and ``parsers`` where hiredis is not.

Run it from the repository root::

    .venv/bin/python -m benchmarks [--quick] [--only enqueue,storm,...]

(``python -m benchmarks.run_all`` is the same). Every script writes its JSON result to
``benchmarks/results/``; the charts go to ``docs/_static/benchmarks.png`` and
``docs/_static/body_time.png`` too.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = ROOT / "benchmarks"
QUICK_RESULTS = HERE / "results" / "quick"

#: (script, options for --quick), in running order; the chart last, as it reads enqueue's, storm's and worker's results.
SCRIPTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("enqueue", ("--calls", "1000", "--repeats", "3", "--warmup", "200", "--rt-calls", "100")),
    ("enqueue_rabbitmq", ("--calls", "500", "--repeats", "2", "--warmup", "50", "--rt-calls", "50")),
    ("bulk", ("--tasks", "2000", "--repeats", "2")),
    (
        "worker",
        (
            *("--tasks", "300", "--repeats", "3", "--rt-tasks", "50", "--warmup", "50", "--guard-pairs", "200"),
            *("--body-drain-s", "0.15", "--body-repeats", "2"),
        ),
    ),
    ("memory", ("--keys", "10000", "--sample", "200", "--variant-keys", "200")),
    ("storm", ("--producers", "2", "--keys", "200", "--sends", "2")),
    ("debounce", ("--rounds", "2", "--keys", "5", "--calls", "20")),
    ("admin", ("--records", "10000", "--renders", "5", "--later", "3")),
    ("followers", ("--followers", "50")),
    ("limits", ("--tasks", "200", "--calls", "200", "--repeats", "2")),
    ("steps", ("--calls", "200", "--repeats", "2", "--rt-calls", "20")),
    ("cluster", ("--calls", "300", "--repeats", "1", "--threads", "4")),
    ("scale", ("--quick", "--calls", "1000", "--passes", "3", "--renders", "5")),
    ("recovery", ("--repeats", "1", "--wait", "30")),
    ("parsers", ("--rounds", "1", "--calls", "300", "--repeats", "2", "--tasks", "200")),
    ("chart", ()),
)


def quick_outputs(name: str) -> list[str]:
    if name == "chart":
        return [
            *("--enqueue", str(QUICK_RESULTS / "enqueue.json")),
            *("--storm", str(QUICK_RESULTS / "storm.json")),
            *("--recovery", str(QUICK_RESULTS / "recovery.json")),
            *("--output", str(QUICK_RESULTS / "benchmarks.png")),
            *("--worker", str(QUICK_RESULTS / "worker.json")),
            *("--body-output", str(QUICK_RESULTS / "body_time.png")),
        ]
    return ["--output", str(QUICK_RESULTS / f"{name}.json")]


def plan(only: Sequence[str], quick: bool) -> list[tuple[str, list[str]]]:
    """The commands to run: scripts that exist, in order, with ``--quick`` sizes if asked."""
    commands = []
    for name, quick_options in SCRIPTS:
        script = HERE / f"{name}.py"
        if (only and name not in only) or not script.exists():
            continue
        options = [*quick_options, *quick_outputs(name)] if quick else []
        commands.append((name, [sys.executable, "-m", f"benchmarks.{name}", *options]))
    return commands


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="smaller sizes for every script")
    parser.add_argument("--only", default="", help="comma-separated script names (default all)")
    args = parser.parse_args(argv)
    names = [name for name, _ in SCRIPTS]
    args.only = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = [name for name in args.only if name not in names]
    if unknown:
        parser.error(f"unknown benchmarks {unknown}: choose from {', '.join(names)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    took: list[tuple[str, float]] = []
    for name, command in plan(args.only, args.quick):
        shown = " ".join(["python", *command[1:]])
        print(f"\n## {name}\n\n$ {shown}")
        print(flush=True)
        began = time.monotonic()
        returncode = subprocess.call(command, cwd=ROOT)
        took.append((name, time.monotonic() - began))
        if returncode != 0:
            print(f"\n{name} failed (exit status {returncode}); stopping.", file=sys.stderr)
            return returncode
    print("\n" + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in took))
    return 0


if __name__ == "__main__":
    sys.exit(main())
