"""The admin's record pages in a real browser at 1280 px: readable, grouped, nothing cut off.

Drives Debian's Chromium (``/usr/bin/chromium``) through Playwright against
the test project served by Django's live-server thread, over records made by
the real scripts. Skipped without Chromium. With ``CELERY_DEDUP_SCREENSHOTS=1``
the record page is saved as ``docs/_static/admin-dedup-record.png`` (otherwise
into the test's temporary directory).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import django
import pytest
from celery import Celery
from django.conf import settings

if not settings.configured:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django_settings")
django.setup()

from django.contrib.admin.utils import quote  # noqa: E402
from django.contrib.auth.models import User  # noqa: E402
from django.contrib.staticfiles.handlers import StaticFilesHandler  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connections  # noqa: E402
from django.test import Client, override_settings  # noqa: E402
from django.test.testcases import LiveServerThread  # noqa: E402
from django.test.utils import setup_test_environment, teardown_test_environment  # noqa: E402

from celery_dedup import DedupTask  # noqa: E402

from .._records import Records  # noqa: E402
from ..conftest import CHROMIUM, AppFactory  # noqa: E402
from .test_demo_browser import CHROMIUM_ARGS  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STATIC = ROOT / "docs" / "_static"
LIST = "/admin/celery_dedup/record/"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("chromium"),  # skips without it, after run-tests had the chance to install it
]


@pytest.fixture(scope="module")
def live() -> Iterator[str]:
    """The test project served on a free port, sharing this thread's in-memory database; yields its base URL."""
    setup_test_environment()
    call_command("migrate", verbosity=0, interactive=False)
    shared = {c.alias: c for c in connections.all() if c.vendor == "sqlite" and c.settings_dict["NAME"] == ":memory:"}
    for connection in shared.values():
        connection.inc_thread_sharing()
    server = LiveServerThread("127.0.0.1", StaticFilesHandler, connections_override=shared, port=0)
    server.daemon = True
    server.start()
    server.is_ready.wait()
    if server.error:
        raise server.error
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        server.terminate()
        for connection in shared.values():
            connection.dec_thread_sharing()
        User.objects.filter(username="browser").delete()  # the database outlives the module
        teardown_test_environment()


@pytest.fixture
def browser_page(live: str) -> Iterator[Any]:
    """A 1280 x 800 page logged in as a superuser."""
    sync_api = pytest.importorskip("playwright.sync_api")
    user, _ = User.objects.get_or_create(username="browser", defaults={"is_staff": True, "is_superuser": True})
    client = Client()
    client.force_login(user)
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 800})
            context.add_cookies(
                [
                    {
                        "name": settings.SESSION_COOKIE_NAME,
                        "value": client.cookies[settings.SESSION_COOKIE_NAME].value,
                        "url": live,
                    }
                ]
            )
            yield context.new_page()
        finally:
            browser.close()


def demo_tasks(app: Celery) -> tuple[Any, Any]:
    """Tasks named as a project's are: long dotted names."""

    @app.task(name="demo_project.shop.tasks.charge_payment", base=DedupTask, dedup_key="order:{order_id}", shared=False)
    def charge(order_id: int) -> int:
        return order_id

    @app.task(
        name="demo_project.shop.tasks.send_confirmation_email",
        base=DedupTask,
        dedup_key="order:{order_id}",
        shared=False,
    )
    def email(order_id: int) -> int:
        return order_id

    return charge, email


def overflow(page: Any) -> dict[str, float]:
    """How far the page, and the record table, reach past where they should end (px; 0 or less is fine)."""
    return dict(
        page.evaluate(
            """() => {
        const doc = document.documentElement;
        const table = document.querySelector('#result_list, #dedup-record');
        const filter = document.querySelector('#changelist-filter');
        const main = document.querySelector('#content-main');
        const right = table.getBoundingClientRect().right;
        const limit = filter ? filter.getBoundingClientRect().left : main.getBoundingClientRect().right;
        return {page: doc.scrollWidth - doc.clientWidth, table: right - limit};
    }"""
        )
    )


#: Worker names as Celery makes them (``celery@<host name>``) on a cloud VM, a Kubernetes pod and a bare host.
WORKERS = (
    "celery@ip-10-0-3-17.eu-west-1.compute.internal",
    "celery@orders-worker-7d9f8b6c5-x2k4p",
    "celery@vm-payments-worker-03.prod.example.com",
)


def wrapped_lines(page: Any, selector: str) -> list[list[str]]:
    """The text of each element ``selector`` finds, split where the browser wrapped it (one string per line box)."""
    return list(
        page.evaluate(
            """(selector) => [...document.querySelectorAll(selector)].map((cell) => {
        const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
        const lines = [];
        let line = '', top = null;
        for (let node = walker.nextNode(); node; node = walker.nextNode()) {
            for (let i = 0; i < node.length; i++) {
                const range = document.createRange();
                range.setStart(node, i);
                range.setEnd(node, i + 1);
                const box = range.getClientRects()[0];
                if (!box) continue;  // collapsed white space
                if (top !== null && box.top > top + 1) { lines.push(line); line = ''; }
                top = box.top;
                line += node.data[i];
            }
        }
        return [...lines, line];
    })""",
            selector,
        )
    )


def broken_words(page: Any, selector: str) -> list[list[str]]:
    """The wrapped texts of ``selector``'s elements where a line ends inside a word (a letter or digit on each side)."""
    return [
        lines
        for lines in wrapped_lines(page, selector)
        if any(a[-1:].isalnum() and b[:1].isalnum() for a, b in itertools.pairwise(lines))
    ]


def test_list_and_record_fit_1280_px_with_the_sidebar_open(
    make_app: AppFactory, live: str, browser_page: Any, tmp_path: Path
) -> None:
    app = make_app()
    charge, email = demo_tasks(app)
    charges, emails = Records(app, charge), Records(app, email)
    charges.ended(1, "succeeded", hostname=WORKERS[0])
    charge.delay(1)
    emails.ended(1, "succeeded", hostname=WORKERS[1])
    failed = charges.ended(
        2, "failed", error="CardDeclined: the issuer refused the charge (insufficient funds)", hostname=WORKERS[2]
    )
    charges.started(3, hostname=WORKERS[0])
    emails.queued(3)
    page = browser_page
    screenshots = STATIC if os.environ.get("CELERY_DEDUP_SCREENSHOTS") == "1" else tmp_path
    with override_settings(CELERY_DEDUP_APP=app):
        page.goto(f"{live}{LIST}")
        assert page.locator("#nav-sidebar").is_visible(), "judged with Django's navigation sidebar open"
        assert page.locator("#result_list tbody tr").count() == 5
        reach = overflow(page)
        assert reach["page"] <= 0, "the page scrolls sideways"
        assert reach["table"] <= 0, "the record table runs under the filters"
        shown = {"".join(lines) for lines in wrapped_lines(page, "#result_list td.field-worker")}
        assert set(WORKERS) <= shown, f"the list does not show every worker: {shown}"
        # docs/django.md: names wrap at their dots (host names at "@" and hyphens too), task ids before the run suffix.
        for column in ("td.field-worker", ".field-task", "td.field-task_id"):
            broken = broken_words(page, f"#result_list {column}")
            assert not broken, f"{column} wraps inside a word: {broken}"

        page.goto(f"{live}{LIST}{quote(failed.member)}/change/")
        assert overflow(page)["page"] <= 0
        assert ["".join(lines) for lines in wrapped_lines(page, "dd.field-worker")] == [WORKERS[2]]
        assert not broken_words(page, "dd.field-worker"), "the worker name wraps inside a word"
        assert (
            not page.locator("details.internals").get_attribute("open") and page.locator("dd.field-nonce").is_hidden()
        )
        page.locator("details.internals summary").click()
        assert page.locator("dd.field-nonce").is_visible()
        page.locator("details.internals summary").click()
        if page.locator("#toggle-nav-sidebar").count():
            page.click("#toggle-nav-sidebar")  # the screenshot shows the page itself
        page.screenshot(path=str(screenshots / "admin-dedup-record.png"), full_page=True)
