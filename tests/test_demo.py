"""The demo, run through its one command: double-paying charges once, storms stay exactly-once, Ctrl-C stops all."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._demo import ROOT, Client, DemoProcess, alive, port_free
from tests.conftest import Server, wait_for


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
    assert order["charge_dedup"]["duplicates"] == "1"


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
    assert table["executions per order (expected 1)"] == "1"
    assert table["orders not charged exactly once"] == "0"


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
    assert "demo stopped" in demo.output()
