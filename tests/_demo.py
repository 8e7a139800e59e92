"""Run the demo through its one command (``run-demo``) and talk to it over HTTP, for the demo tests."""

from __future__ import annotations

import contextlib
import html
import http.cookiejar
import json
import os
import pty
import re
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from celery_dedup.testing import free_port
from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parent.parent
READY = "celery-dedup demo is running"
#: the admin's own links to the dedup app and its record list (sidebar, breadcrumbs)
NAVIGATION = ("/admin/celery_dedup/", "/admin/celery_dedup/record/")
#: record states of a charge that is not over yet
IN_FLIGHT = ("queued", "started", "retry")


def process_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, process group, state) of every process, from /proc."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        table[int(entry.name)] = (int(fields[1]), int(fields[2]), fields[0])
    return table


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    state = process_table().get(pid)
    return state is not None and state[2] != "Z"


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class DemoProcess:
    """``python3 run-demo --port <free port>`` with its own data directory, reusing this test venv."""

    def __init__(self, data_dir: Path, log: Path) -> None:
        self.port = free_port()
        self.data_dir = data_dir
        self.log = log
        env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
        env["CELERY_DEDUP_VENV"] = sys.prefix
        self._out = log.open("wb")
        command = [str(ROOT / "run-demo"), "--port", str(self.port), "--data-dir", str(data_dir), "--concurrency", "2"]
        self.process = subprocess.Popen(
            [sys.executable, *command],
            cwd=ROOT,
            env=env,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        self.base = f"http://127.0.0.1:{self.port}"
        self.redis_url = ""

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float = 120.0) -> DemoProcess:
        deadline = time.monotonic() + timeout
        while READY not in self.output():
            if self.process.poll() is not None:
                raise RuntimeError(f"run-demo exited with {self.process.returncode}:\n{self.output()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"run-demo not ready within {timeout:.0f} s:\n{self.output()}")
            time.sleep(0.2)
        found = re.search(r"^\s+redis\s+(redis://\S+)", self.output(), re.MULTILINE)
        assert found, self.output()
        self.redis_url = found.group(1)
        return self

    def descendants(self) -> set[int]:
        """The launcher, its descendants, and every member of the process groups they lead (live ones)."""
        table = process_table()
        found = {self.process.pid}
        grew = True
        while grew:
            grew = False
            for pid, (ppid, _, state) in table.items():
                if pid not in found and ppid in found and state != "Z":
                    found.add(pid)
                    grew = True
        groups = {pid for pid in found if table.get(pid, (0, 0, ""))[1] == pid}
        found |= {pid for pid, (_, pgid, state) in table.items() if pgid in groups and state != "Z"}
        return found

    def stop(self, sig: int = signal.SIGINT, timeout: float = 60.0) -> int:
        """Send ``sig`` to the launcher and wait for it; its exit status."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise
        self._out.close()
        return self.process.returncode

    def kill(self) -> None:
        """Last resort after a failed test: kill everything the demo started."""
        for pid in self.descendants():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait()
        self._out.close()


class Client:
    """A cookie-keeping HTTP client that fills in Django's CSRF token."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar))

    def get(self, path: str) -> tuple[str, str]:
        """(final URL, body) of a GET."""
        with self.opener.open(self.base + path, timeout=30) as response:
            return response.geturl(), response.read().decode()

    def get_json(self, path: str) -> Any:
        return json.loads(self.get(path)[1])

    def csrf_token(self, page: str) -> str:
        found = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)
        assert found, "no CSRF token in the page"
        return found.group(1)

    def post(self, path: str, fields: dict[str, str], token: str) -> tuple[str, str]:
        """(final URL, body) of a form POST, following the redirect."""
        data = urllib.parse.urlencode({**fields, "csrfmiddlewaretoken": token}).encode()
        request = urllib.request.Request(self.base + path, data=data, headers={"Referer": self.base + path})
        with self.opener.open(request, timeout=30) as response:
            return response.geturl(), response.read().decode()

    def place_order(self, email: str = "buyer@example.com", **quantities: int) -> int:
        """Order through the storefront form; the new order's id."""
        _, page = self.get("/")
        fields = {"email": email, **{f"qty_{sku}": "0" for sku in re.findall(r'name="qty_([^"]+)"', page)}}
        fields.update({f"qty_{sku.replace('_', '-')}": str(qty) for sku, qty in quantities.items()})
        url, _ = self.post("/", fields, self.csrf_token(page))
        found = re.search(r"/orders/(\d+)/$", url)
        assert found, f"placing the order did not lead to an order page: {url}"
        return int(found.group(1))

    def login(self, username: str = "demo", password: str = "demo") -> None:
        """Log in to the admin as ``username``."""
        _, page = self.get("/admin/login/?next=/admin/")
        fields = {"username": username, "password": password, "next": "/admin/"}
        url, _ = self.post("/admin/login/?next=/admin/", fields, self.csrf_token(page))
        assert url == f"{self.base}/admin/", f"login as {username!r} failed: {url}"

    def order(self, order_id: int) -> Any:
        return self.get_json(f"/orders/{order_id}.json")

    def settled(self, order_id: int, timeout: float = 60.0) -> Any:
        """The order's JSON once its charge key's run is over (and, when it charged, its e-mail sent)."""

        def over() -> Any:
            order = self.order(order_id)
            state = (order["charge_dedup"] or {}).get("state")
            if state is None or state in IN_FLIGHT or (order["charges"] and not order["emails"]):
                return None
            return order

        return wait_for(over, timeout, lambda: f"order {order_id}'s charge over: {self.order(order_id)}")

    def pay(self, order_id: int) -> Any:
        """Press "pay" once and wait until that charge is over; the order's JSON."""
        _, page = self.get(f"/orders/{order_id}/")
        self.post(f"/orders/{order_id}/pay/", {}, self.csrf_token(page))
        return self.settled(order_id)


def messages(page: str) -> list[str]:
    """The texts of the Django messages shown on a page."""
    return [html.unescape(text).strip() for text in re.findall(r'<li class="[^"]*">(.*?)</li>', page)]


def record_page_key(page: str) -> tuple[str, str] | None:
    """(task, business key) shown by a dedup record's admin page; None for any other page."""
    task = re.search(r"<dt>Task</dt><dd[^>]*>(.*?)</dd>", page)
    key = re.search(r"<dt>Business key</dt><dd[^>]*><code>(.*?)</code>", page)
    if not (task and key):
        return None
    words = re.sub(r"<[^>]+>", "", task.group(1))  # the admin lets long names break at dots
    return html.unescape(words), html.unescape(key.group(1))


def dedup_links(page: str) -> list[str]:
    """A page's links into the dedup records admin, in page order, without repeats or the admin's navigation."""
    found = (html.unescape(link) for link in re.findall(r'href="(/admin/celery_dedup/[^"]*)"', page))
    return list(dict.fromkeys(link for link in found if link not in NAVIGATION))


def run_in_terminal(command: str, cwd: Path, env: dict[str, str], timeout: float = 300.0) -> tuple[int, str]:
    """Run a shell command line on a pseudo-terminal, as typed at a prompt; (exit status, what it wrote)."""
    controller, terminal = pty.openpty()
    process = subprocess.Popen(
        ["/bin/sh", "-c", command],
        cwd=cwd,
        env=env,
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        start_new_session=True,
    )
    os.close(terminal)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([controller], [], [], 0.5)
            if not ready:
                continue
            try:
                data = os.read(controller, 65536)
            except OSError:  # EIO: every process holding the terminal has exited
                break
            if not data:
                break
            chunks.append(data)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
    finally:
        os.close(controller)
    status = process.wait(30)
    return status, b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")


def screen_lines(output: str) -> list[str]:
    """The lines a terminal is left showing: what a carriage return overwrote is gone."""
    return [line.rsplit("\r", 1)[-1] for line in output.split("\n")]
