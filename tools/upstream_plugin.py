"""pytest plugin loaded (``-p upstream_plugin``) into both runs of an upstream suite by compare_upstream.py.

``CELERY_DEDUP_UPSTREAM_VARIANT`` says which run this is:

- ``plain``: nothing is changed, and celery_dedup must not even be imported;
- ``install``: ``celery_dedup.install`` is applied to every app Celery's
  pytest fixtures (``celery_app``, ``celery_session_app``) create, before any
  worker starts (``celery_session_worker`` depends on ``celery_session_app``),
  and once at start-up to an app on the suite's broker; and every ``redis://``
  connection of the process, kombu's own tests' included, resolves to the
  gated transport from the first one on (``install`` gates only the
  connections of the apps it is given: this run routes kombu's schemes to it
  itself).

Either way it writes ``CELERY_DEDUP_UPSTREAM_REPORT`` (JSON) at the end: what
the run really had (installed apps, the transport ``redis://`` resolved to)
and how many reruns each test needed.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

VARIANT = os.environ.get("CELERY_DEDUP_UPSTREAM_VARIANT", "plain")
#: The fixtures of ``celery.contrib.pytest`` that create the apps the suites publish and work with.
APP_FIXTURES = frozenset({"celery_app", "celery_session_app"})

#: Apps given ``install``, counted by where they came from (a fixture's name, or "start-up").
_installed: Counter[str] = Counter()
_reruns: Counter[str] = Counter()


def _install(app: Any, source: str) -> None:
    import celery_dedup  # noqa: PLC0415 - the plain run must not import it
    from celery_dedup import runtime  # noqa: PLC0415

    if not runtime.runtime_for(app).installed:
        celery_dedup.install(app)
        _installed[source] += 1


def pytest_configure(config: pytest.Config) -> None:
    if VARIANT not in ("plain", "install"):
        raise pytest.UsageError(f"CELERY_DEDUP_UPSTREAM_VARIANT must be plain or install, not {VARIANT!r}")
    # kombu's sdist lacks the conftest.py that registers its env marker (``-E``); every test runs.
    config.addinivalue_line("markers", "env(name): the environment a kombu integration test needs")
    broker = os.environ.get("CELERY_DEDUP_UPSTREAM_BROKER")
    if VARIANT == "install":
        _gate_every_redis_connection()
    if VARIANT == "install" and broker:
        from celery import Celery  # noqa: PLC0415

        _install(Celery("upstream-probe", broker=broker, set_as_current=False), "start-up")


def _gate_every_redis_connection() -> None:
    """Resolve kombu's Redis schemes to the gated transports for the whole process, apps or not."""
    from kombu import transport  # noqa: PLC0415

    from celery_dedup.runtime import TRANSPORTS  # noqa: PLC0415

    transport.TRANSPORT_ALIASES.update(TRANSPORTS)
    cache: dict[str | None, type | None] = vars(transport)["_transport_cache"]  # a scheme resolved already
    for scheme in TRANSPORTS:
        cache.pop(scheme, None)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(
    fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest
) -> Generator[None, Any, Any]:
    result = yield
    if VARIANT == "install" and fixturedef.argname in APP_FIXTURES:
        _install(result, fixturedef.argname)
    return result


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.outcome == "rerun":  # type: ignore[comparison-overlap]  # pytest-rerunfailures' outcome
        _reruns[report.nodeid] += 1


def _redis_transport() -> str:
    from kombu.transport import resolve_transport  # noqa: PLC0415

    cls: Any = resolve_transport("redis")
    return f"{cls.__module__}:{cls.__qualname__}"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = os.environ.get("CELERY_DEDUP_UPSTREAM_REPORT")
    if not path:
        return
    facts = {
        "variant": VARIANT,
        "installed_apps": dict(_installed),
        "celery_dedup_imported": "celery_dedup" in sys.modules,
        "redis_transport": _redis_transport(),
        "reruns": dict(_reruns),
    }
    Path(path).write_text(json.dumps(facts, indent=2), encoding="utf-8")
