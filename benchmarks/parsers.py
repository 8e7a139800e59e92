"""hiredis against redis-py's own parser: the enqueue cost and the worker's no-op throughput, both ways in one run.

redis-py uses hiredis wherever it can import it (hiredis 3.2 or later for
redis-py 6 and up), for every client in the process: celery-dedup's store,
kombu's broker channel and Celery's result backend alike. It then parses
replies with hiredis (``_HiredisParser``) and packs commands with it too
(``HiredisRespSerializer``). A ``parser_class`` in a pool's connection keywords
would swap the parser only, not the packer, and only in the pools whose keywords
can be reached; so "without hiredis" here is what redis-py sees when hiredis is
not installed: a directory put first on ``PYTHONPATH`` whose ``hiredis`` module
raises ImportError. Each measurement runs as a subprocess, with that directory
or without it; the prefork worker it starts inherits the environment, and each
result's versions name the parser its process used (checked here).

Per round both ways run, one after the other, the first alternating every
round so drift in the machine's load hits both alike:

- ``benchmarks.enqueue --no-peers --result-backend off``: µs per
  ``apply_async`` call, plain, a new key and a duplicate;
- ``benchmarks.worker --no-peers --no-round-trips --results off --body-ms ''``:
  no-op tasks/s, plain and DedupTask, on the solo and prefork pools.

The table: per measure, the median over the rounds of each run's median,
with hiredis and without, the ratio of those, and the range of the ratios
within a round (where both ways ran next to each other). It needs hiredis installed (the
``hiredis`` extra: ``pip install -e '.[bench,hiredis]'``); where it is not, it
says so and exits 0.

Run it from the repository root::

    .venv/bin/python -m benchmarks.parsers [--rounds 4] [--calls 1000] [--tasks 500] [--output FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import harness

WAYS = ("with hiredis", "without hiredis")
#: The module that stands in for hiredis on the way without it: importing it fails as a missing package does.
HIDING_MODULE = 'raise ImportError("hiredis is hidden from this process: the benchmark measures redis-py without it")\n'
ENQUEUE_CASES = ("plain", "dedup new key", "dedup duplicate")


def parse_args(script: harness.Script, argv: Sequence[str] | None) -> argparse.Namespace:
    script.option("--rounds", 4, "rounds; each runs both ways, the first alternating")
    script.option("--calls", 1000, "enqueue: timed calls per case per repeat")
    script.option("--repeats", 3, "repeats of enqueue and of the worker's drains, per run")
    script.option("--tasks", 500, "worker: tasks per drain")
    script.option("--pools", "solo,prefork", "worker pools, comma-separated", minimum=None)
    return script.parse(argv)


def run_way(way: str, name: str, options: Sequence[str], folder: Path, hiding: Path) -> dict[str, Any]:
    """Run ``benchmarks.<name>`` one way and return its JSON result; fail with its output if it fails."""
    output = folder / f"{name}-{len(list(folder.glob(f'{name}-*.json')))}.json"
    env = dict(os.environ)
    if way == "without hiredis":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hiding), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", f"benchmarks.{name}", *options, "--output", str(output)]
    done = subprocess.run(command, cwd=harness.ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command[1:])} ({way}) exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    result: dict[str, Any] = json.loads(output.read_text(encoding="utf-8"))
    parser = result["versions"]["parser"]
    if parser.startswith("hiredis") != (way == "with hiredis"):
        raise SystemExit(f"benchmarks.{name} ({way}) ran with parser {parser!r}")
    return result


def figures(enqueue: dict[str, Any], worker: dict[str, Any]) -> dict[str, float]:
    """The measures of one way's run: enqueue µs per call per case, worker tasks/s and ratio per pool."""
    found = {f"enqueue {row['case']}, µs/call": row["median_us"] for row in enqueue["timing"]}
    for row in worker["throughput"]:
        pool = row["pool"] if row["pool"] == "solo" else f"prefork ({row['concurrency']})"
        found[f"worker {pool}, plain tasks/s"] = row["plain_median"]
        found[f"worker {pool}, DedupTask tasks/s"] = row["dedup_median"]
        found[f"worker {pool}, DedupTask / plain"] = row["ratio_of_medians"]
    return found


def compare(rounds: Sequence[dict[str, dict[str, float]]]) -> list[dict[str, Any]]:
    """Per measure: each way's values over the rounds, their medians, the ratio with/without of the medians
    and the ratio within each round (the two ways ran next to each other there, under the same load)."""
    rows = []
    for measure in rounds[0][WAYS[0]]:
        values = {way: [one[way][measure] for one in rounds] for way in WAYS}
        medians = {way: statistics.median(values[way]) for way in WAYS}
        rows.append(
            {
                "measure": measure,
                "values": values,
                "medians": medians,
                "with_over_without": medians[WAYS[0]] / medians[WAYS[1]],
                "round_ratios": [w / wo for w, wo in zip(values[WAYS[0]], values[WAYS[1]], strict=True)],
            }
        )
    return rows


def spread(values: Sequence[float]) -> str:
    return f"{harness.cell(min(values))}\N{EN DASH}{harness.cell(max(values))}"


def comparison_table(rows: Sequence[dict[str, Any]]) -> str:
    return harness.table(
        [
            "measure",
            "with hiredis",
            "min\N{EN DASH}max",
            "without hiredis",
            "min\N{EN DASH}max",
            "with / without",
            "per round min\N{EN DASH}max",
        ],
        [
            [
                row["measure"],
                row["medians"][WAYS[0]],
                spread(row["values"][WAYS[0]]),
                row["medians"][WAYS[1]],
                spread(row["values"][WAYS[1]]),
                f"{row['with_over_without']:.2f}x",
                f"{min(row['round_ratios']):.2f}\N{EN DASH}{max(row['round_ratios']):.2f}",
            ]
            for row in rows
        ],
    )


def main(argv: Sequence[str] | None = None) -> int:
    script = harness.Script("parsers", __doc__, packages=("hiredis",))
    args = parse_args(script, argv)
    if not harness.redis_parser().startswith("hiredis"):
        print("redis-py finds no hiredis it can use here (pip install -e '.[bench,hiredis]'): skipped.")
        return 0
    script.header("each measurement a subprocess of its own, with hiredis and without it")
    enqueue_options = ["--no-peers", "--result-backend", "off", "--calls", str(args.calls)]
    enqueue_options += ["--repeats", str(args.repeats), "--rt-calls", "20"]
    worker_options = ["--no-peers", "--no-round-trips", "--results", "off", "--body-ms", "", "--pools", args.pools]
    worker_options += ["--tasks", str(args.tasks), "--repeats", str(args.repeats), "--guard-pairs", "200"]
    rounds: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="bench-parsers-") as scratch:
        folder = Path(scratch)
        hiding = folder / "without-hiredis"
        hiding.mkdir()
        (hiding / "hiredis.py").write_text(HIDING_MODULE, encoding="utf-8")
        for number in range(args.rounds):
            ways = WAYS if number % 2 == 0 else WAYS[::-1]
            found: dict[str, dict[str, float]] = {}
            for way in ways:
                enqueue = run_way(way, "enqueue", enqueue_options, folder, hiding)
                worker = run_way(way, "worker", worker_options, folder, hiding)
                found[way] = figures(enqueue, worker)
                harness.progress(f"round {number + 1}/{args.rounds}: {way} done")
            rounds.append(found)
    rows = compare(rounds)
    print()
    print(
        f"hiredis against redis-py's own parser: {args.rounds} rounds, each running both ways (the first "
        f"alternating); per run enqueue {args.calls} calls x {args.repeats} repeats per case (no result backend), "
        f"worker {args.tasks} no-op tasks x {args.repeats} drains per case (ignore_result). Medians over the rounds "
        "of each run's median; µs: lower is better, tasks/s: higher."
    )
    print()
    print(comparison_table(rows))
    script.save(args, {"ways": list(WAYS), "rounds": rounds, "comparison": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
