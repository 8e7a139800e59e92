"""``run-tests`` and ``run-demo`` as a newcomer meets them: ``--help``, two first runs at once, system packages.

The scripts run as the user runs them, in processes of their own, on a
virtualenv of the test's own (``CELERY_DEDUP_VENV``), with no ``apt-get`` on
PATH so nothing here can install a system package.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from ..conftest import ROOT

RUN_TESTS = ROOT / "run-tests"
#: Every variable the suite reads that a newcomer may set.
VARIABLES = (
    "CELERY_DEDUP_VENV",
    "CELERY_DEDUP_TEST_REDIS_URL",
    "CELERY_DEDUP_TEST_SERVER",
    "CELERY_DEDUP_TEST_TLS_SERVER",
    "CELERY_DEDUP_TEST_RABBITMQ",
    "CELERY_DEDUP_SCREENSHOTS",
)


def bootstrap() -> ModuleType:
    """tools/bootstrap.py, as run-tests imports it (a module of the scripts, not of the package)."""
    spec = importlib.util.spec_from_file_location("bootstrap_under_test", ROOT / "tools" / "bootstrap.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def script_env(venv: Path, bin_dir: Path, **extra: str) -> dict[str, str]:
    """This environment, with the virtualenv at ``venv`` and only ``bin_dir`` on PATH (no apt-get)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    bin_dir.mkdir(exist_ok=True)
    env.update(CELERY_DEDUP_VENV=str(venv), PATH=str(bin_dir), **extra)
    return env


def finish(process: subprocess.Popen[str], timeout: float) -> tuple[int, str, str]:
    """Wait for ``process``; past ``timeout`` kill its whole session (a pip it started, too) and fail."""
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        pytest.fail(f"{process.args!r} still ran after {timeout:g} s:\n{out}\n{err}")
    return process.returncode, out, err


def start(argv: list[str], env: dict[str, str], cwd: Path = ROOT) -> subprocess.Popen[str]:
    return subprocess.Popen(
        argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_answers_with_run_tests_own_options_and_installs_nothing(tmp_path: Path, flag: str) -> None:
    venv = tmp_path / "venv"
    code, out, err = finish(start([sys.executable, str(RUN_TESTS), flag], script_env(venv, tmp_path / "bin")), 90)
    assert code == 0, f"run-tests {flag} failed ({code}):\n{out}\n{err}"
    assert not venv.exists(), f"run-tests {flag} created the virtualenv (and installed into it):\n{err}"
    assert "python3 run-tests" in out, f"run-tests {flag} does not say how it is called:\n{out}"
    missing = [name for name in VARIABLES if name not in out]
    assert not missing, f"run-tests {flag} does not name {missing}:\n{out}"
    assert "--pytest-help" in out, f"run-tests {flag} does not point at pytest's own help:\n{out}"
    assert "usage: " not in out.lower(), f"run-tests {flag} printed pytest's help instead of its own:\n{out}"


def test_pytest_help_is_one_flag_away(tmp_path: Path) -> None:
    """``--pytest-help`` is pytest's ``--help``, in the virtualenv, with no system package installed."""
    venv = Path(sys.prefix)
    if not (venv / ".celery-dedup-installed").exists():
        pytest.skip("this interpreter's virtualenv is not one run-tests made: it would install into it")
    code, out, err = finish(start([sys.executable, str(RUN_TESTS), "--pytest-help"], script_env(venv, tmp_path)), 120)
    assert code == 0, f"run-tests --pytest-help failed ({code}):\n{out}\n{err}"
    assert "usage: " in out and "--collect-only" in out, f"not pytest's help:\n{out}"
    assert "installing" not in err, f"run-tests --pytest-help installed something:\n{err}"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_first_runs_at_once_install_the_virtualenv_once(tmp_path: Path) -> None:
    """run-tests and run-demo started together on a fresh checkout (two terminals): one installs, the other waits.

    Both call ``ensure_venv`` in processes of their own. pip installs only the
    project itself (``PIP_NO_DEPS``), so the race takes seconds, not minutes;
    it is the same ``venv`` and ``pip install -e`` a first run does.
    """
    venv = tmp_path / "venv"
    env = script_env(venv, tmp_path / "bin", PIP_NO_DEPS="1")
    call = f"import sys; sys.path.insert(0, {str(ROOT / 'tools')!r}); import bootstrap; print(bootstrap.ensure_venv())"
    racers = [start([sys.executable, "-c", call], env) for _ in range(2)]
    ended = [finish(process, 540) for process in racers]
    for code, out, err in ended:
        assert code == 0, f"an ensure_venv failed ({code}):\n{out}\n{err}"
        assert out.strip() == str(venv / "bin" / "python"), out
    installs = sum(err.count("installing celery-dedup[") for _, _, err in ended)
    report = "\n---\n".join(err for _, _, err in ended)
    assert installs == 1, f"{installs} installers ran into one virtualenv:\n{report}"
    installed = "import importlib.metadata as m; print(m.distribution('celery-dedup').version)"
    check = subprocess.run([str(venv / "bin" / "python"), "-c", installed], capture_output=True, text=True, check=False)
    assert check.returncode == 0, f"celery-dedup is not installed in the virtualenv:\n{check.stderr}"


def test_system_packages_are_wanted_only_for_tests_that_use_them() -> None:
    """Collected tests name what they need through the fixtures they use; nothing else asks for a package."""
    module = bootstrap()
    needs = module.system_packages_for
    assert needs([{"r", "server"}, {"make_app", "tmp_path"}]) == []
    assert needs([{"r"}, {"tls", "tls_r"}]) == ["redis-server"]
    assert needs([{"make_rabbit_app", "rabbitmq"}, {"chromium", "live"}]) == ["chromium", "rabbitmq-server"]


@pytest.mark.parametrize(
    ("fixture", "module"), [("chromium", "conftest"), ("tls", "integration/test_tls"), ("rabbitmq", "conftest")]
)
def test_the_fixtures_that_name_system_packages_exist(fixture: str, module: str) -> None:
    """A renamed fixture would quietly stop its package being installed."""
    assert fixture in bootstrap().SYSTEM_PACKAGES
    source = (ROOT / "tests" / f"{module}.py").read_text(encoding="utf-8")
    assert f"\ndef {fixture}(" in source, f"tests/{module}.py defines no fixture {fixture!r}"
