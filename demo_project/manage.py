#!/usr/bin/env python
"""Django's command line for the demo: ``python manage.py migrate|runserver|storm|createsuperuser|...``.

Works from this directory or any other (``python demo_project/manage.py``),
with the settings ``run-demo`` uses. While ``run-demo`` runs, commands reach
its Redis server (see ``demo_project.settings``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    # the project is a package of the directory above; this one must not be on the path (see below)
    sys.path.insert(0, str(HERE.parent))
    from demo_project import without_project_dir  # noqa: PLC0415 - importable only now

    sys.path[:] = without_project_dir(sys.path)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "demo_project.settings")
    from django.core.management import execute_from_command_line  # noqa: PLC0415

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
