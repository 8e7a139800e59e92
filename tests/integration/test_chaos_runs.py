"""Real runs of the chaos harness (run-chaos): a short mixed run keeps every promise, a broken library is caught.

These run ``python -m chaos`` for real (server, prefork workers, producers,
nemesis): on this build with a fixed seed, and on two deliberately broken
copies of the library, where a short run must report violations. The copies
are made here, in a temporary directory, by replacing one known line of a Lua
script; the workers and producers import them through ``--library``
(``PYTHONPATH``), so the library has no test hooks. The checker itself is
tested on hand-written histories in tests/unit/test_chaos.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from chaos.checker import Report, check

from ..conftest import ROOT

# Each run keeps both cores busy (prefork workers, producers, a nemesis): one at a time, with the other CPU-bound tests.
pytestmark = pytest.mark.xdist_group("cpu")

SUMMARY = re.compile(r"^chaos: (\d+) operations, (\d+) faults, (\d+) violations, seed (\d+)$", re.MULTILINE)


def run_chaos(tmp_path: Path, *args: str, timeout: float = 240) -> tuple[int, str, Report]:
    """``python -m chaos`` with ``args``, its history kept under ``tmp_path``; (status, output, report)."""
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "chaos", "--keep", str(run_dir), *args]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)
    output = done.stdout + done.stderr
    summary = SUMMARY.findall(output)
    assert summary, f"no summary line:\n{output[-3000:]}"
    assert output.rstrip().splitlines()[-1].startswith("chaos: "), "the summary is the last line"
    return done.returncode, output, check(run_dir)


def broken_copy(tmp_path: Path, script: str, line: str, replacement: str) -> Path:
    """A copy of the package with one line of ``store/lua/<script>`` replaced (asserting the line is there)."""
    copy = tmp_path / "broken"
    shutil.copytree(ROOT / "celery_dedup", copy / "celery_dedup", ignore=shutil.ignore_patterns("__pycache__"))
    path = copy / "celery_dedup" / "store" / "lua" / script
    source = path.read_text()
    assert source.count(line) == 1, f"{script} no longer has the line {line!r}: update this mutation"
    path.write_text(source.replace(line, replacement))
    return copy


def overlaps(report: Report) -> list[str]:
    return [v.message for v in report.violations if v.invariant == "overlap"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_fault_mixed_a_short_run_keeps_every_promise(tmp_path: Path) -> None:
    status, output, report = run_chaos(tmp_path, "--minutes", "0.6", "--seed", "20260101")
    assert report.faults > 5 and report.ops > 100, output[-3000:]
    assert report.violations == [], output[-6000:]
    assert status == 0


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_guard_that_ignores_the_execution_lock_is_caught(tmp_path: Path) -> None:
    """start.lua's "is the lock held?" answered "no": two runs of a while_executing key run side by side."""
    library = broken_copy(tmp_path, "start.lua", "local holder = redis.call('GET', lock)", "local holder = false")
    status, output, report = run_chaos(
        tmp_path, "--library", str(library), "--minutes", "0.25", "--seed", "3",
        "--faults", "none", "--keys", "2", "--modes", "while_executing,until_executed",
    )  # fmt: skip
    assert status == 1
    assert overlaps(report), output[-4000:]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_release_that_ignores_the_owner_token_is_caught(tmp_path: Path) -> None:
    """finish.lua deletes the lock whoever holds it: any ending, even a refused delivery's, frees a live lock."""
    library = broken_copy(
        tmp_path,
        "finish.lua",
        "local lock_kept, released = 1, false",
        "redis.call('DEL', lock)\nlocal lock_kept, released = 1, false",
    )
    status, output, report = run_chaos(
        tmp_path, "--library", str(library), "--minutes", "0.5", "--seed", "8",
        "--faults", "stop-worker", "--keys", "2", "--modes", "while_executing,until_executed",
    )  # fmt: skip
    assert status == 1
    assert overlaps(report), output[-4000:]
