"""Run the whole demo from one command: ``python -m demo_project.launch [--port 8000]``.

Starts, in order: an embedded Valkey server (unless ``REDIS_URL`` is set),
the database migrations, the demo superuser, a Celery worker and Django's
web server, each server in its own process group. SIGINT (Ctrl-C) or SIGTERM
stops them all: each group leader is asked to stop, then whatever is left of
its group is killed, so no process outlives the launcher and the port is
free when it returns. While it runs, a file in the data directory names the
Redis URL, so ``manage.py`` commands in another terminal reach the server.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from celery_dedup.testing import RedisServer
from demo_project import REDIS_URL_FILE

PROJECT = Path(__file__).resolve().parent
ROOT = PROJECT.parent
MANAGE = PROJECT / "manage.py"
DEFAULT_DATA_DIR = PROJECT / "var"
USERNAME = PASSWORD = "demo"


class LaunchError(RuntimeError):
    """The demo could not start; the message says which part failed."""


@dataclass
class Child:
    """A server process leading its own process group."""

    name: str
    process: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        return self.process.pid

    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace: float) -> None:
        """Ask the leader to stop (SIGTERM), wait ``grace`` seconds, then kill what is left of the group."""
        if self.running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                print(f"{self.name} did not stop within {grace:.0f} s: killing it", file=sys.stderr, flush=True)
        deadline = time.monotonic() + 5.0
        while group_members(self.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                raise LaunchError(f"{self.name}: processes {group_members(self.pid)} survived SIGKILL")
            time.sleep(0.05)
        self.process.wait()


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``, read from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


class Stopped(Exception):
    """SIGINT or SIGTERM arrived."""


@contextlib.contextmanager
def sigint_blocked() -> Iterator[None]:
    """Block SIGINT here, and so in processes started meanwhile (a blocked signal mask is inherited).

    The embedded server stays in the launcher's process group, which is the
    terminal's foreground group: without this a Ctrl-C would stop it at once,
    under a worker that is still finishing its tasks.
    """
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
        return False


def accepts(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=0.5).close()
    except OSError:
        return False
    return True


def has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def worker_answers(redis_url: str) -> bool:
    """True when a worker on this broker answers a ping."""
    from celery import Celery  # noqa: PLC0415 - only this check needs Celery in the launcher

    probe = Celery("demo-launcher", broker=redis_url, set_as_current=False)
    try:
        return bool(probe.control.ping(timeout=1.0))
    finally:
        probe.close()


class Demo:
    """The running demo: what was started, so that it can all be stopped."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.children: list[Child] = []
        self.redis_server: RedisServer | None = None
        self.env = dict(os.environ, DJANGO_SETTINGS_MODULE="demo_project.settings", DEMO_DATA_DIR=str(args.data_dir))
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))

    def redis_url(self) -> str:
        url = os.environ.get("REDIS_URL")
        if url:
            return url
        server = self.redis_server = RedisServer()
        with sigint_blocked():
            server.start()
        return server.url

    def manage(self, *command: str) -> None:
        subprocess.run([sys.executable, str(MANAGE), *command], cwd=ROOT, env=self.env, check=True)

    @property
    def redis_url_file(self) -> Path:
        return Path(self.args.data_dir) / REDIS_URL_FILE

    def spawn(self, name: str, *command: str) -> Child:
        process = subprocess.Popen([sys.executable, *command], cwd=ROOT, env=self.env, start_new_session=True)
        child = Child(name, process)
        self.children.append(child)
        return child

    def wait_until(self, child: Child, ready: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if not child.running():
                raise LaunchError(f"{child.name} exited with {child.process.returncode} before {what}")
            if time.monotonic() > deadline:
                raise LaunchError(f"{child.name}: not {what} within {timeout:.0f} s")
            time.sleep(0.2)

    def start(self) -> None:
        args = self.args
        if port_in_use(args.host, args.port):
            raise LaunchError(f"port {args.port} on {args.host} is in use: pass --port to choose another")
        args.data_dir.mkdir(parents=True, exist_ok=True)
        url = self.env["REDIS_URL"] = self.redis_url()
        self.redis_url_file.write_text(url + "\n")
        self.manage("migrate", "--noinput", "--verbosity", "0")
        self.manage("demo_user", "--username", USERNAME, "--password", PASSWORD)
        worker = self.spawn(
            "celery worker",
            *("-m", "celery", "-A", "demo_project.celery", "worker", "--loglevel", "INFO"),
            *("--pool", "prefork", "--concurrency", str(args.concurrency), "--without-gossip", "--without-mingle"),
        )
        web = self.spawn("web server", str(MANAGE), "runserver", "--noreload", f"{args.host}:{args.port}")
        self.wait_until(worker, lambda: worker_answers(url), "answering a ping")
        self.wait_until(web, lambda: accepts(args.host, args.port), f"listening on port {args.port}")
        self.announce(url)

    def announce(self, redis_url: str) -> None:
        base = f"http://{self.args.host}:{self.args.port}"
        lines = [
            "",
            "celery-dedup demo is running",
            f"  storefront     {base}/",
            f"  admin          {base}/admin/  (user {USERNAME!r}, password {PASSWORD!r})",
        ]
        if has_module("celery_dedup.contrib.django"):
            lines.append(f"  dedup records  {base}/admin/celery_dedup/")
        embedded = " (embedded, stopped on exit)" if self.redis_server else ""
        data_dir = Path(self.args.data_dir).resolve()
        manage = f"DEMO_DATA_DIR={shlex.quote(str(data_dir))} {shlex.join([sys.executable, str(MANAGE)])}"
        lines += [
            f"  redis          {redis_url}{embedded}",
            f"  database       {data_dir / 'db.sqlite3'}",
            f"  storm          {manage} storm --orders 20 --processes 4 --sends 50",
            "Press Ctrl-C to stop.",
            "",
        ]
        print("\n".join(lines), flush=True)

    def watch(self, stop: threading.Event) -> None:
        """Until ``stop`` is set; a server that exits on its own ends the demo."""
        while not stop.wait(0.5):
            for child in self.children:
                if not child.running():
                    raise LaunchError(f"{child.name} exited with {child.process.returncode}")

    def stop(self) -> None:
        for child in reversed(self.children):
            child.stop(grace=20.0)
        self.children.clear()
        self.redis_url_file.unlink(missing_ok=True)
        if self.redis_server is not None:
            self.redis_server.stop()
            self.redis_server = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="run-demo", description="Run the celery-dedup Django demo until Ctrl-C.")
    parser.add_argument("--port", type=int, default=8000, help="web server port (default 8000)")
    parser.add_argument("--host", default="127.0.0.1", help="web server address (default 127.0.0.1)")
    parser.add_argument("--concurrency", type=int, default=4, help="worker processes (default 4)")
    parser.add_argument(
        "--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="where the SQLite database lives (default %(default)s)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if not stop.is_set():
            stop.set()
            print(f"\n{signal.Signals(signum).name}: stopping the demo", file=sys.stderr, flush=True)
            raise Stopped

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    demo = Demo(parse_args(argv))
    status = 0
    try:
        demo.start()
        demo.watch(stop)
    except Stopped:
        pass
    except (LaunchError, subprocess.CalledProcessError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr, flush=True)
        status = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        demo.stop()
    print("demo stopped", file=sys.stderr, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
