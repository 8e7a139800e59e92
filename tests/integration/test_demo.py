"""The demo, run through its one command: double-paying charges once, storms stay exactly-once, Ctrl-C stops all."""

from __future__ import annotations

import contextlib
import html
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_dedup.testing import free_port
from tests._demo import (
    ROOT,
    Client,
    DemoProcess,
    alive,
    dedup_links,
    messages,
    port_free,
    record_page_key,
    run_in_terminal,
    screen_lines,
)
from tests.conftest import Server, wait_for

CHARGE_TASK = "demo_project.shop.tasks.charge_payment"
EMAIL_TASK = "demo_project.shop.tasks.send_confirmation_email"
PROJECT = ROOT / "demo_project"


def manage(*command: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python -m django <command>`` on the demo's settings."""
    return subprocess.run(
        [sys.executable, "-m", "django", *command],
        cwd=ROOT,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "demo_project.settings", **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_migrations_match_models(tmp_path: Path) -> None:
    done = manage("makemigrations", "--check", "--dry-run", env={"DEMO_DATA_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stdout + done.stderr


def test_storm_without_worker_says_so(server: Server, tmp_path: Path) -> None:
    done = manage("storm", "--orders", "1", env={"REDIS_URL": server.url, "DEMO_DATA_DIR": str(tmp_path)})
    assert done.returncode != 0
    assert "no Celery worker answered" in done.stderr


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoProcess]:
    base = tmp_path_factory.mktemp("demo")
    process = DemoProcess(base / "data", base / "demo.log")
    try:
        yield process.wait_ready()
    finally:
        if process.process.poll() is None:
            process.kill()


@pytest.mark.slow
def test_double_pay_charges_once(demo: DemoProcess) -> None:
    client = Client(demo.base)
    order_id = client.place_order(TEA_001=2, MUG_002=1)
    _, page = client.get(f"/orders/{order_id}/")
    token = client.csrf_token(page)
    start = threading.Barrier(2)
    answers: list[str] = []
    errors: list[BaseException] = []

    def press() -> None:
        start.wait()
        try:
            answers.append(client.post(f"/orders/{order_id}/pay/", {}, token)[0])
        except BaseException as exc:
            errors.append(exc)

    presses = [threading.Thread(target=press) for _ in range(2)]
    for thread in presses:
        thread.start()
    for thread in presses:
        thread.join(60)
    assert not errors, errors
    assert answers == [f"{demo.base}/orders/{order_id}/"] * 2

    def settled() -> Any:
        order = client.get_json(f"/orders/{order_id}.json")
        record = order["charge_dedup"] or {}
        return order if record.get("state") == "succeeded" and order["emails"] else None

    order = wait_for(settled, 60, lambda: f"order {order_id} settled: {client.get_json(f'/orders/{order_id}.json')}")
    assert order["charges"] == 1
    assert order["emails"] == 1
    assert order["status"] == "paid"
    assert order["charge_dedup"]["duplicates"] == 1


def query(demo: DemoProcess, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    """Rows from the demo's SQLite database, opened read-only."""
    with contextlib.closing(sqlite3.connect(f"file:{demo.data_dir / 'db.sqlite3'}?mode=ro", uri=True)) as db:
        return db.execute(sql, params).fetchall()


@pytest.mark.slow
def test_burst_of_orders_syncs_inventory_once(demo: DemoProcess) -> None:
    client = Client(demo.base)
    for quantity in (1, 2, 3):
        client.place_order(BIS_004=quantity)
    sql = "SELECT ordered FROM shop_inventorysync WHERE sku = ?"
    synced = wait_for(lambda: query(demo, sql, "BIS-004"), 30, "an inventory sync of BIS-004")
    assert synced == [(6,)], "one sync, after the burst, seeing all of it"


@pytest.mark.slow
def test_storm_charges_every_order_once(demo: DemoProcess) -> None:
    env = {"REDIS_URL": demo.redis_url, "DEMO_DATA_DIR": str(demo.data_dir)}
    done = manage("storm", "--orders", "4", "--processes", "3", "--sends", "10", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = (line.split("|") for line in done.stdout.splitlines() if line.startswith("| "))
    table = {cells[1].strip(): cells[2].strip() for cells in rows}
    assert table["calls"] == "40"
    assert table["accepted"] == "4"
    assert table["deduplicated"] == "36"
    assert table["charges per order (expected 1)"] == "1"
    assert table["orders not charged exactly once"] == "0"


@pytest.mark.slow
def test_pay_again_after_payment_charges_nothing(demo: DemoProcess) -> None:
    client = Client(demo.base)
    order_id = client.place_order(POT_003=1)
    _, unpaid_page = client.get(f"/orders/{order_id}/")
    paid = client.pay(order_id)
    assert paid["charges"] == 1
    first_run = paid["charge_dedup"]["task_id"]

    # "pay" pressed again on the page as it was before the payment (a second tab, the back button)
    _, answer = client.post(f"/orders/{order_id}/pay/", {}, client.csrf_token(unpaid_page))
    order = client.settled(order_id)
    assert order["charges"] == 1, f"a paid order was charged again: {order}"
    charge_id = order["charge_ids"][0]
    assert f"Order {paid['number']} is already paid (charge #{charge_id})" in " ".join(messages(answer))
    assert order["charge_dedup"]["task_id"] == first_run, "nothing is sent for a paid order"
    _, page = client.get(f"/orders/{order_id}/")
    assert 'id="pay"' not in page, "a paid order offers no Pay button"
    assert f"Paid (charge #{charge_id})" in page


@pytest.mark.slow
def test_charge_task_refuses_a_paid_order(demo: DemoProcess) -> None:
    """The dedup key is free once the charge ran: the order's state is what stops a later charge."""
    client = Client(demo.base)
    order_id = client.place_order(MUG_002=1)
    paid = client.pay(order_id)
    env = {"REDIS_URL": demo.redis_url, "DEMO_DATA_DIR": str(demo.data_dir)}
    code = (
        "from demo_project.shop.tasks import charge_payment\n"
        f"result = charge_payment.delay({order_id})\n"
        "print(result.id, result.deduplicated)"
    )
    done = manage("shell", "--verbosity", "0", "-c", code, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    run, deduplicated = done.stdout.split()
    assert deduplicated == "False", "the key is free once its run succeeded"

    def run_over() -> Any:
        order = client.order(order_id)
        record = order["charge_dedup"] or {}
        return order if record.get("task_id") == run and record.get("state") == "succeeded" else None

    order = wait_for(run_over, 60, lambda: f"run {run} over: {client.order(order_id)}")
    assert order["charges"] == 1, f"the task charged a paid order again: {order}"
    assert order["emails"] == 1
    assert order["charge_result"] == f"Order {paid['number']} is already paid (charge #{order['charge_ids'][0]})"


@pytest.mark.slow
def test_a_worker_killed_right_after_the_charge_step_charges_once(demo: DemoProcess) -> None:
    """ "Pay" with the kill flag: the pool process that charged the card SIGKILLs itself before the run ends.

    Proves: the message is delivered again (acks_late, rejected when its worker was lost) within seconds;
    the redelivered run of the same id skips the charge step (done) and gets its stored charge id, so the
    provider holds one charge, made with the step's idempotency key; the order ends paid and e-mailed once;
    the order page shows the charge, its key, both deliveries and the record's history.
    """
    client = Client(demo.base)
    order_id = client.place_order(TEA_001=1)
    _, page = client.get(f"/orders/{order_id}/")
    _, answer = client.post(f"/orders/{order_id}/pay/", {"kill": "1"}, client.csrf_token(page))
    assert "killed right after the charge" in " ".join(messages(answer))
    order = client.settled(order_id, timeout=90)
    assert (order["status"], order["charges"], order["emails"]) == ("paid", 1, 1), order
    run = order["charge_dedup"]["task_id"]
    (charge,) = order["charge_list"]
    key = charge["idempotency_key"]
    assert key == f"{CHARGE_TASK}:order:{order_id}:{run.removeprefix(f'order:{order_id}')}:charge-card"
    first, second = order["deliveries"]
    assert (first["task_id"], second["task_id"]) == (run, run), "one run, delivered twice"
    assert (first["step"], second["step"]) == ("charged", "skipped"), order["deliveries"]
    assert first["charge_id"] == second["charge_id"] == charge["id"]
    assert first["pid"] != second["pid"]
    assert not alive(first["pid"]), "the process that charged was killed"
    (step,) = order["steps"]
    assert (step["name"], step["state"], step["attempts"], step["key"]) == ("charge-card", "done", 1, key)
    history = [(entry["state"], entry["note"]) for entry in order["history"] if entry["task_id"] == run]
    assert [state for state, _ in history].count("started") == 2, history
    assert [note for state, note in history if state == "step"] == ["charge-card started", "charge-card done"]
    assert history[-1][0] == "succeeded"
    assert order["charge_result"] == f"charged {charge['amount']} (charge #{charge['id']})"

    _, page = client.get(f"/orders/{order_id}/")
    assert key in html.unescape(page)
    assert "skipped: done by an earlier delivery" in html.unescape(page)


@pytest.mark.slow
def test_dedup_links_lead_to_exactly_this_orders_records(demo: DemoProcess) -> None:
    client = Client(demo.base)
    client.login()
    order_id = client.place_order(TEA_001=1)
    order = client.pay(order_id)
    key = order["charge_key"]
    expected = {(CHARGE_TASK, key), (EMAIL_TASK, key)}

    def records_linked_from(path: str) -> set[tuple[str, str]]:
        _, page = client.get(path)
        found = set()
        for link in dedup_links(page):
            _, target = client.get(link)
            shown = record_page_key(target)
            assert shown, f"{path}: link {link} does not lead to one record's page"
            found.add(shown)
        return found

    assert records_linked_from(f"/orders/{order_id}/") == expected
    assert records_linked_from(f"/admin/shop/order/{order_id}/change/") == expected
    assert records_linked_from(f"/admin/shop/order/?q={order['number']}") == {(CHARGE_TASK, key)}


LIMITS_PAGE = "/admin/celery_dedup/record/limits/"


@pytest.mark.slow
def test_resend_confirmation_draws_on_the_mail_tasks_quota(demo: DemoProcess) -> None:
    """The "resend" view takes its place in the named group the mail tasks use: paused, it sends nothing."""
    client = Client(demo.base)
    client.login()
    order_id = client.place_order(TEA_001=1)
    assert client.pay(order_id)["emails"] == 1
    _, page = client.get(f"/orders/{order_id}/")

    _, done = client.post(f"/orders/{order_id}/resend/", {}, client.csrf_token(page))
    assert "Confirmation sent again to buyer@example.com." in messages(done)
    assert client.order(order_id)["emails"] == 2
    _, limits_page = client.get(LIMITS_PAGE)
    named = re.search(r"<td>mail-provider</td>\s*<td>\(all keys\)</td>\s*<td>(.*?)</td>", limits_page)
    assert named and named.group(1) == "concurrency 2, rate 5/s, 200/h", limits_page
    in_use = re.search(r"<td>group mail-provider</td>\s*<td>\*</td>(.*?)</tr>", limits_page, re.S)
    assert in_use, limits_page
    slots, _, windows = (html.unescape(cell).strip() for cell in re.findall(r"<td>(.*?)</td>", in_use.group(1))[:3])
    assert slots.endswith(" / 2") and re.fullmatch(r"\d+ / 5/s, (\d+) / 200/h", windows), (slots, windows)
    assert int(windows.split(", ")[1].split(" /")[0]) >= 2, "the task's start and the view's, in one window"

    token = client.csrf_token(limits_page)
    client.post(LIMITS_PAGE, {"action": "pause", "group": "mail-provider"}, token)
    try:
        _, refused = client.post(f"/orders/{order_id}/resend/", {}, client.csrf_token(page))
    finally:
        _, resumed = client.post(LIMITS_PAGE, {"action": "resume", "group": "mail-provider"}, token)
    assert "The mail provider's quota has no room now (in use, or paused): nothing sent, try again." in messages(
        refused
    )
    assert "Resumed limit group mail-provider." in messages(resumed)
    assert client.order(order_id)["emails"] == 2


@pytest.mark.slow
def test_order_page_names_products_and_the_order(demo: DemoProcess) -> None:
    client = Client(demo.base)
    order_id = client.place_order(TEA_001=2, POT_003=1)
    order = client.pay(order_id)
    _, page = client.get(f"/orders/{order_id}/")
    lines = re.findall(r'<tr class="line"><td>(.*?)</td>', page)
    assert lines == ["Green tea, 100 g", "Cast-iron teapot"], page
    heading = re.search(r'<h2 id="dedup-heading">(.*?)</h2>', page)
    assert heading, page
    assert f"order {order['number']}" in html.unescape(heading.group(1))


@pytest.mark.slow
def test_printed_storm_line_runs_when_pasted_anywhere(demo: DemoProcess, tmp_path: Path) -> None:
    found = re.search(r"^\s+storm\s+(.+)$", demo.output(), re.MULTILINE)
    assert found, demo.output()
    # a fresh terminal somewhere else: nothing of this test's environment but the basics
    env = {name: os.environ[name] for name in ("PATH", "HOME", "LANG") if name in os.environ}
    status, output = run_in_terminal(found.group(1), cwd=tmp_path, env=env)
    assert status == 0, output
    screen = [line for line in screen_lines(output) if line.strip()]
    table = [line for line in screen if line.startswith("|")]
    assert "| orders not charged exactly once | 0 |" in table, output
    assert len(screen) <= 24, f"the summary should fit one screen, it took {len(screen)} lines:\n{output}"
    assert "1000/1000" in output, f"no progress shown while it ran:\n{output}"


@pytest.mark.slow
def test_manage_py_works_from_its_directory_and_the_repository_root(demo: DemoProcess, tmp_path: Path) -> None:
    env = {name: os.environ[name] for name in ("PATH", "HOME", "LANG") if name in os.environ}
    env["DEMO_DATA_DIR"] = str(demo.data_dir)  # where the running demo keeps its database and says where Redis is

    def run(cwd: Path, *command: str, **extra: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [sys.executable, *command],
            cwd=cwd,
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, f"{' '.join(command)} in {cwd}:\n{done.stdout}{done.stderr}"
        return done

    assert "No migrations to apply" in run(ROOT, "demo_project/manage.py", "migrate").stdout
    run(PROJECT, "manage.py", "migrate")
    run(
        ROOT,
        *("demo_project/manage.py", "createsuperuser", "--noinput", "--username", "ops", "--email", "ops@example.com"),
        DJANGO_SUPERUSER_PASSWORD="ops-password",
    )
    assert query(demo, "SELECT is_superuser FROM auth_user WHERE username = 'ops'") == [(1,)]
    storm = run(PROJECT, "manage.py", "storm", "--orders", "2", "--processes", "2", "--sends", "4")
    assert "| orders not charged exactly once | 0 |" in storm.stdout

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "manage.py", "runserver", f"127.0.0.1:{port}"],
        cwd=PROJECT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "runserver.log").open("wb"),
        start_new_session=True,
    )
    try:
        client = Client(f"http://127.0.0.1:{port}")

        def storefront() -> str:
            if server.poll() is not None:
                raise AssertionError((tmp_path / "runserver.log").read_text())
            with contextlib.suppress(OSError):
                return client.get("/")[1]
            return ""

        page = wait_for(storefront, 60, "runserver answering", interval=0.2)
        assert "Tea shop" in page
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()


@pytest.mark.slow
def test_ctrl_c_stops_every_process_and_frees_the_port(demo: DemoProcess) -> None:
    processes = demo.descendants()
    redis_port = int(demo.redis_url.rsplit(":", 1)[1].split("/")[0])
    assert len(processes) >= 4, f"expected launcher, server, worker and web server: {processes}"
    assert not port_free(demo.port)
    assert demo.stop(signal.SIGINT) == 0, demo.output()
    survivors = [pid for pid in processes if alive(pid)]
    assert not survivors, f"still running after SIGINT: {survivors}\n{demo.output()}"
    assert port_free(demo.port)
    assert port_free(redis_port)
    assert not (demo.data_dir / "redis-url").exists(), "the stopped demo's Redis URL is left behind"
    assert "demo stopped" in demo.output()
