"""tools/compare_upstream.py reads outcomes back from the JUnit files pytest writes, and compares them.

A real pytest session (in a subprocess) writes the JUnit file: a parsing
mistake would hide a difference between the plain and the installed run.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ..conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import compare_upstream as compare

SUITE_FILE = """
import pytest


class test_group:
    @pytest.mark.parametrize("n", [1, 2])
    def test_param(self, n):
        assert n == 1, "two is not one"

    @pytest.mark.xfail(reason="known", strict=True)
    def test_xfail(self):
        raise RuntimeError("expected")


@pytest.fixture
def broken():
    raise OSError("no server")


def test_error(broken):
    pass


def test_skip():
    pytest.skip("not here")


def test_pass():
    pass
"""
FILES = ("t/integration/test_sample.py",)


def junit_of(tmp_path: Path, source: str) -> Path:
    tests = tmp_path / "t" / "integration"
    tests.mkdir(parents=True)
    for package in (tmp_path / "t", tests):
        (package / "__init__.py").write_text("")
    (tests / "test_sample.py").write_text(source)
    xml = tmp_path / "junit.xml"
    command = [sys.executable, "-m", "pytest", FILES[0], "-p", "no:cacheprovider", "-p", "no:celery_dedup"]
    command += [f"--junitxml={xml}", "-o", "junit_family=xunit2", "-o", "python_classes=test_*", "-q"]  # as Celery
    subprocess.run(command, cwd=tmp_path, capture_output=True, check=False, timeout=60)
    return xml


def test_outcomes_are_read_by_node_id(tmp_path: Path) -> None:
    outcomes = compare.read_junit(junit_of(tmp_path, SUITE_FILE), FILES)
    kinds = {nodeid: outcome.kind for nodeid, outcome in outcomes.items()}
    base = FILES[0]
    assert kinds == {
        f"{base}::test_group::test_param[1]": "passed",
        f"{base}::test_group::test_param[2]": "failed",
        f"{base}::test_group::test_xfail": "xfailed",
        f"{base}::test_error": "error",
        f"{base}::test_skip": "skipped",
        f"{base}::test_pass": "passed",
    }
    assert "two is not one" in compare.one_line(outcomes[f"{base}::test_group::test_param[2]"])
    assert "no server" in outcomes[f"{base}::test_error"].detail


def test_a_teardown_error_after_a_pass_counts_as_an_error(tmp_path: Path) -> None:
    source = """
import pytest


@pytest.fixture
def leaky():
    yield
    raise RuntimeError("left a worker running")


def test_leaky(leaky):
    pass
"""
    outcomes = compare.read_junit(junit_of(tmp_path, source), FILES)
    assert {nodeid: outcome.kind for nodeid, outcome in outcomes.items()} == {f"{FILES[0]}::test_leaky": "error"}


def test_differences_name_every_test_whose_outcome_differs() -> None:
    suite = compare.SUITES[0]
    plain = compare.Run(suite, "plain", {"a": compare.Outcome("passed"), "b": compare.Outcome("skipped")})
    install = compare.Run(suite, "install", {"a": compare.Outcome("failed", "boom"), "c": compare.Outcome("passed")})
    found = {(d.nodeid, d.plain.kind, d.install.kind) for d in compare.differences(plain, install)}
    assert found == {("a", "passed", "failed"), ("b", "skipped", "absent"), ("c", "absent", "passed")}
    same = compare.Run(suite, "install", dict(plain.outcomes))
    assert compare.differences(plain, same) == []
