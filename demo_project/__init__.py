"""A small Django shop whose payments, e-mails, stock syncs and reports run as deduplicated Celery tasks.

Run it with ``python3 run-demo`` from the repository root; other commands with
``python demo_project/manage.py``. Settings: ``demo_project.settings``; Celery
app: ``demo_project.celery``.
"""

from __future__ import annotations

from pathlib import Path

#: The file in the data directory where a running ``run-demo`` writes its Redis URL, for other commands.
REDIS_URL_FILE = "redis-url"

PROJECT_DIR = Path(__file__).resolve().parent


def without_project_dir(path: list[str]) -> list[str]:
    """``path`` (a ``sys.path``) without this package's own directory.

    There, its ``celery.py`` would hide the celery package from any process
    that has not imported celery yet. It gets there when a command runs in
    this directory: Python puts a script's directory first (``python
    manage.py``), and Celery's Django fixup the working directory, which a
    spawned process inherits.
    """
    return [entry for entry in path if Path(entry or ".").resolve() != PROJECT_DIR]
