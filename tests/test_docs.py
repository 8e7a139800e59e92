"""The documentation: the settings reference matches the code, and the site builds without a warning.

The settings checks read ``docs/settings.md`` and need nothing else. The build
runs Sphinx as ``tox -e docs`` does (``-W``: any warning fails), and is skipped
where the docs extra is not installed.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from celery_dedup import DedupTask
from celery_dedup.config import DJANGO_ONLY, SETTINGS

DOCS = Path(__file__).resolve().parent.parent / "docs"
SETTINGS_PAGE = DOCS / "settings.md"
#: A ``dedup_*`` name, not part of a longer identifier (``celery_dedup_up``, ``CELERY_DEDUP_APP``).
DEDUP_NAME = re.compile(r"(?<![A-Za-z0-9_])dedup_[a-z0-9_]+")
#: What the docs' autodoc pages import, besides the package itself.
BUILD_NEEDS = ("sphinx", "myst_parser", "furo", "django", "prometheus_client")


def page_text() -> str:
    return SETTINGS_PAGE.read_text(encoding="utf-8")


def table_rows(text: str) -> dict[str, list[str]]:
    """Cells of every Markdown table row whose first cell is a code name: name -> cells after it."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.lstrip().startswith("|") and len(cells) > 1 and re.fullmatch(r"`[A-Za-z_]+`", cells[0]):
            rows.setdefault(cells[0].strip("`"), cells[1:])
    return rows


def task_options() -> list[str]:
    """The ``dedup_*`` and ``limit_*`` options DedupTask declares (annotated class attributes, not methods)."""
    return [name for name in DedupTask.__annotations__ if name.startswith(("dedup_", "limit_"))]


def test_every_setting_is_documented_with_its_default() -> None:
    rows = table_rows(page_text())
    missing = sorted(setting for setting in SETTINGS if setting not in rows)
    assert not missing, f"docs/settings.md has no table row for {missing}"
    for setting, (default, _) in SETTINGS.items():
        if default is None:
            continue  # documented in words ("the broker URL")
        shown = f'`"{default}"`' if isinstance(default, str) else f"`{default}`"
        type_, documented_default = rows[setting][0], rows[setting][1]
        assert shown in documented_default, f"{setting}: default {shown} not in its row's default cell"
        assert type_, f"{setting}: its row gives no type"


def test_every_task_option_is_documented() -> None:
    options = task_options()
    assert {"dedup_key", "dedup_mode", "limit_rate"} <= set(options), options  # the discovery itself works
    rows = table_rows(page_text())
    missing = sorted(option for option in options if option not in rows)
    assert not missing, f"docs/settings.md has no table row for the task options {missing}"


def test_every_documented_name_exists() -> None:
    known = set(SETTINGS) | set(DJANGO_ONLY) | {name for name in vars(DedupTask) if name.startswith("dedup_")}
    documented = set(DEDUP_NAME.findall(page_text()))
    assert documented >= set(SETTINGS), "the name pattern misses settings the page documents"
    unknown = sorted(documented - known)
    assert not unknown, f"docs/settings.md documents names the code does not have: {unknown}"


def test_sphinx_build_has_no_warnings(tmp_path: Path) -> None:
    absent = [module for module in BUILD_NEEDS if importlib.util.find_spec(module) is None]
    if absent:
        pytest.skip(f"the docs build needs {', '.join(absent)}: pip install '.[docs,django,prometheus]' or tox -e docs")
    command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(DOCS), str(tmp_path)]
    built = subprocess.run(command, capture_output=True, text=True, timeout=110, check=False)
    assert built.returncode == 0, f"sphinx-build failed:\n{built.stdout}\n{built.stderr}"
    assert (tmp_path / "guarantees.html").is_file(), "docs/guarantees.md is not a page of the site"
