"""run-tests' choice of processes: CI calls it with no arguments at all."""

import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Loaded by path, as run-tests loads it: tools/ is a folder of scripts, not a package.
_testargs = runpy.run_path(str(ROOT / "tools" / "testargs.py"))
WORKERS = _testargs["WORKERS"]
parallel = _testargs["parallel"]

XDIST = ["-n", str(WORKERS), "--dist", "loadgroup"]


def test_no_arguments_run_the_whole_suite_in_parallel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CELERY_DEDUP_TEST_REDIS_URL", raising=False)
    assert parallel([]) == XDIST


@pytest.mark.parametrize(
    "args",
    [["-n", "0"], ["-n2"], ["--numprocesses=4"], ["--pdb"], ["-p", "no:xdist"], ["-pno:xdist"], ["tests/unit"]],
)
def test_these_run_in_one_process_or_as_chosen(args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CELERY_DEDUP_TEST_REDIS_URL", raising=False)
    monkeypatch.chdir(ROOT)
    assert parallel(args) == []


def test_a_flag_last_or_alone_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CELERY_DEDUP_TEST_REDIS_URL", raising=False)
    assert parallel(["-q"]) == XDIST
    assert parallel(["-q", "-p"]) == XDIST


def test_an_external_server_is_shared_so_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CELERY_DEDUP_TEST_REDIS_URL", "redis://localhost:1/0")
    assert parallel([]) == []
