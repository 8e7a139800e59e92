"""The demo in a real browser: log in, order, double-click "pay", pay again in a stale tab, find one charge;
and pay with the worker killed right after the charge, find one charge and the redelivery that skipped it.

Drives Debian's Chromium (``/usr/bin/chromium``) through Playwright; skipped
without it (``python3 run-tests`` installs it when run as root). The admin
page is saved as ``docs/_static/admin-dedup-records.png`` when
``CELERY_DEDUP_SCREENSHOTS=1`` (otherwise into the test's temporary
directory, so a test run leaves the work tree alone).
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._demo import ROOT, Client, DemoProcess, alive, port_free
from tests.conftest import CHROMIUM, wait_for

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOT = ROOT / "docs" / "_static" / "admin-dedup-records.png"
CHARGE_TASK = "demo_project.shop.tasks.charge_payment"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("chromium"),  # skips without it, after run-tests had the chance to install it
]


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[DemoProcess]:
    process = DemoProcess(tmp_path / "data", tmp_path / "demo.log")
    try:
        yield process.wait_ready()
    finally:
        if process.process.poll() is None:
            process.kill()


@pytest.fixture
def page(tmp_path: Path) -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser.new_page(viewport={"width": 1600, "height": 800})
        finally:
            browser.close()


def test_double_click_pay_leaves_one_succeeded_record(demo: DemoProcess, page: Any, tmp_path: Path) -> None:
    page.goto(f"{demo.base}/admin/login/?next=/admin/")
    page.fill("#id_username", "demo")
    page.fill("#id_password", "demo")
    page.click("input[type=submit]")
    page.wait_for_url(f"{demo.base}/admin/")

    page.goto(f"{demo.base}/")
    page.fill("#id_qty_POT-003", "1")
    page.fill("#id_email", "browser@example.com")
    page.click("#place-order")
    page.wait_for_url(re.compile(r"/orders/\d+/$"))
    order_id = int(page.url.rstrip("/").rsplit("/", 1)[1])

    stale = page.context.browser.new_page()  # another window on the unpaid order, pressed after the payment
    stale.goto(page.url)

    # Presses 10 ms apart: the first request leaves, the second press cancels its navigation and posts
    # again, as on a slow page. (Two presses in the same tick make Chromium send only the second; and
    # now and then the first is cancelled before it left: the requests sent are counted.)
    posted: list[str] = []
    page.on("request", lambda request: posted.append(request.url) if request.method == "POST" else None)
    page.dblclick("#pay", delay=10)
    client = Client(demo.base)

    def settled() -> Any:
        order = client.get_json(f"/orders/{order_id}.json")
        return order if (order["charge_dedup"] or {}).get("state") == "succeeded" and order["emails"] else None

    order = wait_for(settled, 60, f"order {order_id}'s charge succeeded")
    # The sync API hands events to listeners only while a Playwright call is in flight: one round trip
    # after the server answered delivers every request event the browser sent before it.
    page.wait_for_load_state("load")
    page.evaluate("0")
    # Chromium reports the second request, and the first only when it was not cancelled on the way:
    # the server may have seen one more press than counted here, never fewer.
    presses = sum(url.endswith(f"/orders/{order_id}/pay/") for url in posted)
    duplicates = int(order["charge_dedup"]["duplicates"])
    assert presses >= 1 and presses - 1 <= duplicates <= 1, (posted, duplicates)
    assert order["charges"] == 1, "one charge, however the presses arrived"

    page.goto(f"{demo.base}/orders/{order_id}/")
    assert page.locator("#pay").count() == 0, "a paid order offers no Pay button"
    charge_id = order["charge_ids"][0]
    assert page.locator("#paid").inner_text().strip() == f"Paid (charge #{charge_id})"
    page.screenshot(path=str(tmp_path / "order-paid.png"), full_page=True)

    with stale.expect_navigation():
        stale.click("#pay")
    assert f"Order {order['number']} is already paid (charge #{charge_id})" in stale.locator(".messages").inner_text()
    stale.screenshot(path=str(tmp_path / "order-paid-again.png"), full_page=True)
    assert client.get_json(f"/orders/{order_id}.json")["charges"] == 1

    page.click(f"#dedup-records a[data-task='{CHARGE_TASK}']")
    page.wait_for_selector("#dedup-record")
    assert page.locator("#dedup-record .dedup-state").first.inner_text().strip() == "succeeded"
    assert page.locator("code", has_text=order["charge_key"]).count() >= 1
    page.screenshot(path=str(tmp_path / "record.png"), full_page=True)

    page.goto(f"{demo.base}/admin/celery_dedup/record/")
    page.wait_for_selector("#result_list")
    rows = page.locator("#result_list tbody tr")
    charges = [
        rows.nth(i).locator(".field-state").inner_text().strip()
        for i in range(rows.count())
        if rows.nth(i).locator(".field-key").inner_text().strip() == order["charge_key"]
        and rows.nth(i).locator(".field-task").inner_text().strip().endswith("charge_payment")
    ]
    assert charges == ["succeeded"]
    if page.locator("#toggle-nav-sidebar").count():
        page.click("#toggle-nav-sidebar")  # room for every column in the screenshot
    target = SCREENSHOT if os.environ.get("CELERY_DEDUP_SCREENSHOTS") == "1" else tmp_path / SCREENSHOT.name
    target.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(target), full_page=True)

    page.goto(f"{demo.base}/admin/shop/order/")
    assert page.locator(".field-charge_key_state").first.inner_text().strip() == "succeeded"
    page.goto(f"{demo.base}/admin/shop/order/{order_id}/change/")
    record = page.locator(".field-dedup_records").inner_text()
    assert "state=succeeded" in record
    # The summary leaves out fields the record does not have: no duplicate (one press reached the server), none.
    assert (f"duplicates={duplicates}" in record) if duplicates else ("duplicates=" not in record), record

    processes = demo.descendants()
    assert demo.stop(signal.SIGTERM) == 0, demo.output()
    assert not [pid for pid in processes if alive(pid)]
    assert port_free(demo.port)


def test_pay_and_kill_the_worker_shows_one_charge_and_the_redelivery_that_skipped_it(
    demo: DemoProcess, page: Any, tmp_path: Path
) -> None:
    """The second button: the worker process that charged the card is SIGKILLed right after the charge step.

    The order page then shows one charge at the provider with the step's idempotency key, the two
    deliveries of the one run (the first charged, the redelivered one skipped the step) and the
    key's history with both starts and the step's entries.
    """
    page.goto(f"{demo.base}/")
    page.fill("#id_qty_TEA-001", "1")
    page.fill("#id_email", "kill@example.com")
    page.click("#place-order")
    page.wait_for_url(re.compile(r"/orders/\d+/$"))
    order_id = int(page.url.rstrip("/").rsplit("/", 1)[1])
    with page.expect_navigation():
        page.click("#pay-and-kill")
    assert "killed right after the charge" in page.locator(".messages").inner_text()

    client = Client(demo.base)
    order = client.settled(order_id, timeout=90)
    page.goto(f"{demo.base}/orders/{order_id}/")
    assert page.locator("#paid").inner_text().strip() == f"Paid (charge #{order['charge_ids'][0]})"

    charges = page.locator("#provider-charges tbody tr")
    assert charges.count() == 1, "one charge at the provider"
    key = charges.first.locator("code.key").inner_text().strip()
    run = order["charge_dedup"]["task_id"]
    assert key.startswith(f"{CHARGE_TASK}:order:{order_id}:~") and key.endswith(":charge-card")

    deliveries = page.locator("#deliveries tbody tr")
    assert deliveries.count() == 2
    first, second = deliveries.nth(0).inner_text(), deliveries.nth(1).inner_text()
    assert run in first and run in second, "one run, delivered twice"
    assert "called the provider: charge #" in first
    assert "skipped: done by an earlier delivery" in second

    step = page.locator("#charge-steps tbody tr")
    assert step.count() == 1
    assert step.first.locator("td").nth(1).inner_text().strip() == "done"
    assert step.first.locator("code.key").inner_text().strip() == key

    states = [cell.strip() for cell in page.locator("#charge-history td.state").all_inner_texts()]
    assert states.count("started") == 2 and states[-1] == "succeeded", states
    history = page.locator("#charge-history").inner_text()
    assert "charge-card started" in history and "charge-card done" in history
    page.screenshot(path=str(tmp_path / "order-killed-after-charge.png"), full_page=True)

    assert client.order(order_id)["charges"] == 1
    assert demo.stop(signal.SIGTERM) == 0, demo.output()
