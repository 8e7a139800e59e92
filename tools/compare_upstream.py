#!/usr/bin/env python3
"""Run Celery's and kombu's own integration suites plain and with celery_dedup.install, and compare outcomes.

    python3 tools/compare_upstream.py [--suite NAME ...] [--reruns N] [--recheck N] [-- PYTEST ARGS]

1. Fetches the sdists of the celery and kombu versions installed in the
   project's virtualenv (``pip download --no-binary :all:``) into a cache
   outside the repository, and unpacks their tests (``t/``, the pytest
   configuration, ``requirements/``), not their packages: the tests import
   the installed releases.
2. Builds a virtualenv of its own in that cache: the same celery, kombu,
   redis-py, billiard, vine and amqp versions, and the pytest plugins the
   suites' ``requirements/test*.txt`` pin. Neither celery-dedup nor its
   pytest plugin is installed there.
3. Runs every suite twice, each time on a fresh throw-away server
   (``celery_dedup.testing.RedisServer``) that is the broker, the result
   backend and the server the tests talk to directly: ``plain``, and
   ``install``, where ``upstream_plugin.py`` applies ``celery_dedup.install``
   to every app Celery's fixtures create before the session worker starts
   (and celery_dedup is put on ``sys.path`` for that run only). Both runs get
   the same ``--reruns``/``--timeout`` on top of Celery's own flaky markers.
4. Compares outcomes test by test from the ``--junitxml`` files. Tests whose
   outcome differs are run again on both sides (``--recheck`` times); a
   difference that does not come back is reported as flaky.

Prints a Markdown table and the differing tests; writes the same, with each
run's log and JUnit file, to ``--output`` (default ``build/upstream``).
Exit status: 0 when every outcome agrees, 1 when one differs, 2 when a run
did not give a result or did not run as it should (install not applied, or
celery_dedup imported in a plain run).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import venv
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))
from bootstrap import ROOT, VENV, ensure_venv  # noqa: E402

#: Releases whose versions the upstream virtualenv takes from the project's.
RUNTIME = ("celery", "kombu", "redis", "billiard", "vine", "amqp")
#: What the suites need from their requirements files. Of pytest-celery they use only the celery.contrib.pytest
#: fixtures its entry point loads; the runs load that module with -p instead of installing its Docker machinery.
TEST_NEEDS = ("pytest", "pytest-rerunfailures", "pytest-subtests", "pytest-timeout", "pydantic")
#: Requirements files read for TEST_NEEDS, per project, in order.
REQUIREMENTS = {
    "celery": ("requirements/test.txt", "requirements/test-integration.txt"),
    "kombu": ("requirements/test.txt", "requirements/test-integration.txt"),
}
#: The pytest configuration each project's tests run with.
PYTEST_CONFIG = {"celery": "pyproject.toml", "kombu": "setup.cfg"}
#: Outcomes, most telling first: a test reported twice (a subtest, a teardown error) keeps the first.
SEVERITY = ("error", "failed", "passed", "xfailed", "skipped", "absent")
#: More differing tests than this in one suite are not run again: something is broken, not flaky.
MAX_RECHECK = 50


@dataclass(frozen=True)
class Suite:
    slug: str
    name: str
    project: str
    files: tuple[str, ...]


SUITES = (
    Suite("tasks", "celery tasks", "celery", ("t/integration/test_tasks.py",)),
    Suite("canvas", "celery canvas", "celery", ("t/integration/test_canvas.py",)),
    Suite("inspect", "celery inspect", "celery", ("t/integration/test_inspect.py",)),
    Suite("kombu", "kombu redis", "kombu", ("t/integration/test_redis.py", "t/integration/test_redis_brpop_qos.py")),
)
VARIANTS = ("plain", "install")


@dataclass(frozen=True)
class Outcome:
    kind: str
    message: str = ""
    detail: str = ""


@dataclass
class Run:
    """One pytest run of a suite: its outcomes by node id, and what the plugin saw."""

    suite: Suite
    variant: str
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)
    problem: str = ""
    seconds: float = 0.0

    def count(self, *kinds: str) -> int:
        return sum(outcome.kind in kinds for outcome in self.outcomes.values())


def log(message: str) -> None:
    print(f"[{datetime.now():%H:%M:%S}] {message}", flush=True)


def default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "celery-dedup" / "upstream"


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path``: checkouts sharing the cache prepare it one at a time."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# --------------------------------------------------------------------------- sources and virtualenv


def fetch_tests(cache: Path, project: str, version: str) -> Path:
    """The unpacked tests of ``project==version`` (its sdist's ``t/``, pytest config, requirements)."""
    tree = cache / f"{project}-{version}"
    if (tree / ".unpacked").exists():
        return tree
    sdists = cache / "sdist"
    archive = sdists / f"{project}-{version}.tar.gz"
    if not archive.exists():
        log(f"downloading the {project} {version} sdist")
        pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "download", "--quiet"]
        subprocess.check_call([*pip, "--no-binary", ":all:", "--no-deps", "-d", str(sdists), f"{project}=={version}"])
    top = f"{project}-{version}/"
    wanted = ("t/", "requirements/", PYTEST_CONFIG[project])
    shutil.rmtree(tree, ignore_errors=True)
    with tarfile.open(archive) as sdist:
        members = [
            member
            for member in sdist.getmembers()
            if member.name.startswith(top) and member.name[len(top) :].startswith(wanted)
        ]
        sdist.extractall(cache, members=members, filter="data")
    (tree / ".unpacked").touch()
    return tree


def requirement_lines(path: Path) -> Iterator[str]:
    """The requirement lines of ``path``, following ``-r`` includes."""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.split("#", 1)[0].strip()
        if line.startswith(("-r ", "--requirement ")):
            yield from requirement_lines(path.parent / line.split(None, 1)[1])
        elif line and not line.startswith("-"):
            yield line


def requirement_name(line: str) -> str:
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", line)
    return re.sub(r"[-_.]+", "-", match.group(0)).lower() if match else ""


def upstream_requirements(trees: dict[str, Path]) -> list[str]:
    """The runtime releases as installed here, and TEST_NEEDS as the suites' requirements files pin them."""
    wanted = [f"{name}=={metadata.version(name)}" for name in RUNTIME]
    pins: dict[str, str] = {}
    for project, files in REQUIREMENTS.items():
        for name in files:
            path = trees[project] / name
            for line in requirement_lines(path) if path.exists() else ():
                pins.setdefault(requirement_name(line), line)
    return wanted + [pins.get(name, name) for name in TEST_NEEDS]


def ensure_upstream_venv(cache: Path, requirements: list[str]) -> Path:
    """A virtualenv with ``requirements`` (and nothing of celery-dedup); rebuilt when they change."""
    home = cache / f"venv-py{sys.version_info.major}{sys.version_info.minor}"
    python = home / "bin" / "python"
    stamp = home / ".requirements"
    wanted = "\n".join(requirements)
    if stamp.exists() and stamp.read_text(encoding="utf-8") == wanted:
        return python
    if not python.exists():
        log(f"creating the upstream virtualenv {home}")
        venv.create(home, with_pip=True)
    log("installing " + " ".join(requirements))
    subprocess.check_call(
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *requirements]
    )
    stamp.write_text(wanted, encoding="utf-8")
    return python


def installed_versions(python: Path, names: Iterable[str]) -> dict[str, str]:
    code = "import sys, importlib.metadata as m; print('\\n'.join(m.version(n) for n in sys.argv[1:]))"
    names = list(names)
    out = subprocess.check_output([str(python), "-c", code, *names], text=True)
    return dict(zip(names, out.split(), strict=True))


# --------------------------------------------------------------------------- running a suite


def kill_group(process: subprocess.Popen[bytes]) -> None:
    """End what is left of the run's process group (pool children of the session worker)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def run_suite(
    suite: Suite,
    variant: str,
    *,
    python: Path,
    tree: Path,
    output: Path,
    targets: Sequence[str],
    options: argparse.Namespace,
    label: str,
) -> Run:
    """Run ``targets`` of ``suite`` once, on a fresh server, and read back its outcomes."""
    from celery_dedup.testing import RedisServer  # noqa: PLC0415 - the project's virtualenv has it

    stem = output / f"{suite.slug}-{variant}{label}"
    xml, facts, log_file = stem.with_suffix(".xml"), stem.with_suffix(".json"), stem.with_suffix(".log")
    for path in (xml, facts):
        path.unlink(missing_ok=True)
    paths = [str(TOOLS)]
    if variant == "install":
        paths.append(str(output / "path"))  # holds only a link to the celery_dedup package
    command = [
        str(python),
        "-m",
        "pytest",
        *targets,
        # What pytest-celery's entry point loads for these suites (its Docker fixtures serve Celery's smoke tests).
        "-p",
        "celery.contrib.pytest",
        "-p",
        "upstream_plugin",
        "-p",
        "no:cacheprovider",
        f"--junitxml={xml}",
        "-o",
        "junit_family=xunit2",
        f"--reruns={options.reruns}",
        "--reruns-delay=1",
        f"--timeout={options.timeout}",
        "-v",
        "-rfEs",
        *options.pytest_args,
    ]
    run = Run(suite, variant)
    started = time.monotonic()
    with RedisServer() as server:
        env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(
            TEST_BROKER=server.url,
            TEST_BACKEND=server.url,
            REDIS_HOST="127.0.0.1",
            REDIS_PORT=str(server.port),
            REDIS_6379_TCP=str(server.port),
            PYTHONPATH=os.pathsep.join(paths),
            PYTHONDONTWRITEBYTECODE="1",
            WORKER_LOGLEVEL="INFO",  # as Celery's tox.ini sets it: some tests read the worker's INFO lines
            CELERY_DEDUP_UPSTREAM_VARIANT=variant,
            CELERY_DEDUP_UPSTREAM_BROKER=server.url,
            CELERY_DEDUP_UPSTREAM_REPORT=str(facts),
        )
        with log_file.open("wb") as sink:
            sink.write(f"$ {' '.join(command)}\n# server {server.version()} at {server.url}\n".encode())
            sink.flush()
            process = subprocess.Popen(
                command, cwd=tree, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                process.wait(options.suite_timeout)
            except subprocess.TimeoutExpired:
                run.problem = f"did not finish within {options.suite_timeout} s (killed)"
            finally:
                kill_group(process)
                process.wait()
    run.seconds = time.monotonic() - started
    if xml.exists():
        run.outcomes = read_junit(xml, suite.files)
    elif not run.problem:
        run.problem = f"pytest exited with {process.returncode} and wrote no JUnit file (see {log_file.name})"
    if facts.exists():
        run.facts = json.loads(facts.read_text(encoding="utf-8"))
    elif not run.problem:
        run.problem = "the plugin wrote no report"
    run.problem = run.problem or check_facts(run)
    return run


def check_facts(run: Run) -> str:
    """What went wrong with the variant itself, if anything: the comparison is meaningless then."""
    facts = run.facts
    if run.variant == "plain":
        if facts.get("celery_dedup_imported"):
            return "celery_dedup was imported in the plain run"
        if not str(facts.get("redis_transport", "")).startswith("kombu."):
            return f"redis:// resolved to {facts.get('redis_transport')} in the plain run"
        return ""
    if facts.get("redis_transport") != "celery_dedup.transports.redis:Transport":
        return f"redis:// resolved to {facts.get('redis_transport')}, not the gated transport"
    installed = facts.get("installed_apps", {})
    if run.suite.project == "celery" and not {"celery_app", "celery_session_app"} <= installed.keys():
        return f"install was applied only to {installed}, not to the apps of both of Celery's fixtures"
    return ""


def node_id(classname: str, name: str, files: Sequence[str]) -> str:
    """The pytest node id of a JUnit test case (``t.integration.test_x.test_class`` + ``test_y``)."""
    for path in files:
        module = path.removesuffix(".py").replace("/", ".")
        if classname == module or classname.startswith(module + "."):
            inner = classname[len(module) + 1 :].replace(".", "::")
            return "::".join(part for part in (path, inner, name) if part)
    return f"{classname}::{name}" if classname else name


def read_junit(path: Path, files: Sequence[str]) -> dict[str, Outcome]:
    outcomes: dict[str, Outcome] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        nodeid = node_id(case.get("classname", ""), case.get("name", ""), files)
        outcome = Outcome("passed")
        for tag, kind in (("error", "error"), ("failure", "failed"), ("skipped", "skipped")):
            element = case.find(tag)
            if element is not None:
                xfail = kind == "skipped" and element.get("type") == "pytest.xfail"
                outcome = Outcome("xfailed" if xfail else kind, element.get("message") or "", element.text or "")
                break
        seen = outcomes.get(nodeid)
        if seen is None or SEVERITY.index(outcome.kind) < SEVERITY.index(seen.kind):
            outcomes[nodeid] = outcome
    return outcomes


# --------------------------------------------------------------------------- comparing and reporting


@dataclass
class Difference:
    suite: Suite
    nodeid: str
    plain: Outcome
    install: Outcome
    rechecks: list[tuple[str, str]] = field(default_factory=list)

    @property
    def flaky(self) -> bool:
        """Both sides agreed in a recheck."""
        return any(plain == install for plain, install in self.rechecks)


def differences(plain: Run, install: Run) -> list[Difference]:
    absent = Outcome("absent")
    found = []
    for nodeid in sorted(plain.outcomes.keys() | install.outcomes.keys()):
        a, b = plain.outcomes.get(nodeid, absent), install.outcomes.get(nodeid, absent)
        if a.kind != b.kind:
            found.append(Difference(plain.suite, nodeid, a, b))
    return found


def one_line(outcome: Outcome, width: int = 240) -> str:
    text = outcome.message or outcome.detail or ""
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def installed(run: Run) -> str:
    return ", ".join(f"{where} {times}" for where, times in run.facts.get("installed_apps", {}).items()) or "none"


def counts(run: Run) -> str:
    if run.problem and not run.outcomes:
        return "no result"
    return f"{run.count('passed')} / {run.count('failed', 'error')} / {run.count('skipped', 'xfailed')}"


def report(
    runs: dict[tuple[str, str], Run], found: list[Difference], header: list[str], options: argparse.Namespace
) -> str:
    lines = [*header, ""]
    lines += [
        "| suite | tests | plain: passed / failed / skipped | install: passed / failed / skipped | differ |",
        "|---|---:|---|---|---:|",
    ]
    for suite in selected(options):
        plain, install = runs[suite.name, "plain"], runs[suite.name, "install"]
        tests = len(plain.outcomes.keys() | install.outcomes.keys())
        differ = sum(d.suite == suite and not d.flaky for d in found)
        lines.append(f"| {suite.name} | {tests} | {counts(plain)} | {counts(install)} | {differ} |")
    lines += [
        "",
        "failed counts errors too; skipped counts expected failures (xfail) too; passed counts unexpected "
        "passes (xpass) too, as JUnit files do not tell them apart.",
        f"Both sides ran with --reruns {options.reruns} --reruns-delay 1 --timeout {options.timeout} "
        "(and Celery's own flaky markers); tests whose outcome differed were run again on both sides "
        f"{options.recheck} time(s).",
    ]
    applied = "; ".join(f"{suite.name}: {installed(runs[suite.name, 'install'])}" for suite in selected(options))
    lines += [
        "",
        "Apps given install, by the fixture that made them (start-up: one app installed first; every "
        f"redis:// connection of the process resolves to the gated transport): {applied}.",
    ]
    problems = [f"- {run.suite.name}, {run.variant}: {run.problem}" for run in runs.values() if run.problem]
    if problems:
        lines += ["", "Runs that did not give a usable result:", *problems]
    for title, wanted in (("Outcomes that differ", False), ("Differed once, agreed when run again (flaky)", True)):
        chosen = [d for d in found if d.flaky is wanted]
        if not chosen:
            continue
        lines += ["", f"{title}:"]
        for d in chosen:
            lines.append(f"- {d.nodeid} ({d.suite.name}): plain {d.plain.kind}, install {d.install.kind}")
            for side, outcome in (("plain", d.plain), ("install", d.install)):
                if outcome.kind not in ("passed", "absent"):
                    lines.append(f"    {side}: {one_line(outcome)}")
            if d.rechecks:
                again = ", ".join(f"plain {a} / install {b}" for a, b in d.rechecks)
                lines.append(f"    run again: {again}")
    rerun_lines = []
    for run in runs.values():
        for nodeid, times in sorted(run.facts.get("reruns", {}).items()):
            rerun_lines.append(f"- {run.suite.name}, {run.variant}: {nodeid} ({times} rerun(s))")
    if rerun_lines:
        lines += ["", "Tests that were rerun (their outcome above is their last attempt's):", *rerun_lines]
    return "\n".join(lines)


def selected(options: argparse.Namespace) -> list[Suite]:
    return [suite for suite in SUITES if not options.suite or suite.slug in options.suite]


# --------------------------------------------------------------------------- main


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--suite",
        action="append",
        choices=[suite.slug for suite in SUITES],
        help="run only this suite (repeatable; default: all)",
    )
    parser.add_argument("--reruns", type=int, default=2, help="--reruns for every test, both sides (default 2)")
    parser.add_argument("--recheck", type=int, default=1, help="times a differing test is run again (default 1)")
    parser.add_argument("--timeout", type=int, default=300, help="pytest-timeout per test, seconds (default 300)")
    parser.add_argument(
        "--suite-timeout", type=int, default=5400, help="seconds one pytest run may take before it is killed"
    )
    parser.add_argument("--cache", type=Path, default=default_cache(), help="sdists, tests, virtualenv")
    parser.add_argument("--output", type=Path, default=ROOT / "build" / "upstream", help="logs, JUnit files, report")
    parser.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments for every run (e.g. -k)")
    return parser.parse_args(argv)


def stop_on_term(signum: int, frame: Any) -> None:
    """SIGTERM unwinds like Ctrl-C, so the running suite's processes and server are stopped."""
    raise KeyboardInterrupt


def main(argv: Sequence[str]) -> int:
    signal.signal(signal.SIGTERM, stop_on_term)
    options = parse(argv)
    output: Path = options.output.resolve()
    output.mkdir(parents=True, exist_ok=True)
    link = output / "path" / "celery_dedup"
    link.parent.mkdir(exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(ROOT / "celery_dedup", target_is_directory=True)

    cache: Path = options.cache.resolve()
    versions = {name: metadata.version(name) for name in ("celery", "kombu")}
    with locked(cache / ".lock"):
        trees = {project: fetch_tests(cache, project, version) for project, version in versions.items()}
        python = ensure_upstream_venv(cache, upstream_requirements(trees))
    used = installed_versions(python, [*RUNTIME, *TEST_NEEDS])
    from celery_dedup.testing import RedisServer  # noqa: PLC0415

    with RedisServer() as probe:
        server = probe.version()
    header = [
        " ".join(["python3 tools/compare_upstream.py", *argv]),
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, Python {sys.version.split()[0]}, server {server}",
        "celery " + used["celery"] + ", kombu " + used["kombu"] + ", redis-py " + used["redis"],
        ", ".join(f"{name} {used[name]}" for name in TEST_NEEDS),
    ]
    log(" | ".join(header))

    runs: dict[tuple[str, str], Run] = {}
    found: list[Difference] = []
    for suite in selected(options):
        tree = trees[suite.project]
        for variant in VARIANTS:
            log(f"{suite.name}, {variant}: running")
            run = run_suite(
                suite, variant, python=python, tree=tree, output=output, targets=suite.files, options=options, label=""
            )
            runs[suite.name, variant] = run
            note = f" ({run.problem})" if run.problem else ""
            log(f"{suite.name}, {variant}: {counts(run)} passed / failed / skipped in {run.seconds:.0f} s{note}")
        plain, install = runs[suite.name, "plain"], runs[suite.name, "install"]
        if plain.problem or install.problem:
            continue
        suite_found = differences(plain, install)
        rechecks = options.recheck if 0 < len(suite_found) <= MAX_RECHECK else 0
        for attempt in range(1, rechecks + 1):
            targets = [d.nodeid for d in suite_found]
            log(f"{suite.name}: {len(targets)} differing test(s), running them again on both sides ({attempt})")
            again = {
                variant: run_suite(
                    suite,
                    variant,
                    python=python,
                    tree=tree,
                    output=output,
                    targets=targets,
                    options=options,
                    label=f"-recheck{attempt}",
                )
                for variant in VARIANTS
            }
            for d in suite_found:
                plain_again = again["plain"].outcomes.get(d.nodeid, Outcome("absent"))
                install_again = again["install"].outcomes.get(d.nodeid, Outcome("absent"))
                d.rechecks.append((plain_again.kind, install_again.kind))
        found += suite_found

    text = report(runs, found, header, options)
    (output / "report.md").write_text(text + "\n", encoding="utf-8")
    details = [
        {
            "suite": d.suite.name,
            "test": d.nodeid,
            "plain": [d.plain.kind, d.plain.detail],
            "install": [d.install.kind, d.install.detail],
            "rechecks": d.rechecks,
        }
        for d in found
    ]
    (output / "differences.json").write_text(json.dumps(details, indent=2), encoding="utf-8")
    print()
    print(text)
    print(f"\nlogs, JUnit files and this report: {output}")
    if any(run.problem for run in runs.values()):
        return 2
    return 1 if any(not d.flaky for d in found) else 0


if __name__ == "__main__":
    python = ensure_venv()
    if Path(sys.prefix).resolve() != VENV.resolve():
        os.execv(python, [str(python), __file__, *sys.argv[1:]])
    sys.exit(main(sys.argv[1:]))
