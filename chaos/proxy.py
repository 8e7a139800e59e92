"""A loopback TCP proxy in front of the test server that breaks connections on cue.

It understands just enough of RESP (the Redis request protocol) to find
command boundaries, so a test can say "cut the connection at the next
EVALSHA": either *before* the command reaches the server (nothing ran) or
*after* the server ran it but before its reply reaches the client (it ran, and
the client cannot know). With ``hold=True`` the proxy keeps the connection
frozen at that point until :meth:`FaultProxy.release`, so a test can kill the
publisher process in that exact state.

For the chaos checker it also delays every reply (:meth:`FaultProxy.delay`)
and resets every open connection at once (:meth:`FaultProxy.reset`).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

Point = Literal["before", "after"]
SCRIPT_COMMANDS = frozenset({b"EVALSHA", b"EVAL", b"EVALSHA_RO", b"EVAL_RO"})


def parse_command(buf: bytes | bytearray, pos: int = 0) -> tuple[bytes, int] | None:
    """``(upper-cased command name, end offset)`` of the request at ``pos``, or None if incomplete."""
    if pos >= len(buf):
        return None
    if buf[pos : pos + 1] != b"*":
        # Inline command: one line, words separated by spaces.
        end = buf.find(b"\r\n", pos)
        if end == -1:
            return None
        words = bytes(buf[pos:end]).split()
        return (words[0].upper() if words else b""), end + 2
    end = buf.find(b"\r\n", pos)
    if end == -1:
        return None
    count = int(buf[pos + 1 : end])
    cursor, name = end + 2, b""
    for index in range(count):
        if buf[cursor : cursor + 1] != b"$":
            if cursor >= len(buf):
                return None
            raise ValueError(f"unexpected RESP request byte {buf[cursor : cursor + 1]!r} at {cursor}")
        line_end = buf.find(b"\r\n", cursor)
        if line_end == -1:
            return None
        length = int(buf[cursor + 1 : line_end])
        start, stop = line_end + 2, line_end + 2 + length
        if len(buf) < stop + 2:
            return None
        if index == 0:
            name = bytes(buf[start:stop]).upper()
        cursor = stop + 2
    return name, cursor


@dataclass
class Fault:
    """One armed fault: cut the connection at ``point`` of the next matching command."""

    point: Point
    commands: frozenset[bytes]
    hold: bool


@dataclass
class Incident:
    """What the proxy did when a fault fired."""

    point: Point
    command: bytes
    #: For ``after``: the server's reply the client never got.
    swallowed: bytes = b""


@dataclass
class _Pair:
    client: socket.socket
    upstream: socket.socket
    swallow: Fault | None = None
    command: bytes = b""
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def close(self, *, reset: bool = False) -> None:
        """Close both sides; ``reset`` sends an RST instead of a FIN (SO_LINGER 0).

        A socket is only let go once no thread is in a call on it, and this
        proxy's own threads wait in ``recv`` on both sides of an idle
        connection: closing alone would leave the server holding it (a BRPOP
        still waiting there takes the next message for a client that is
        gone). Shutting the reading side wakes them and sends nothing, so the
        last one out sends the RST.
        """
        with self.lock:
            if self.closed:
                return
            self.closed = True
        for sock in (self.client, self.upstream):
            if reset:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RD)
            else:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            sock.close()


class FaultProxy:
    """Forwards ``127.0.0.1:<port>`` to ``127.0.0.1:<upstream_port>``; see the module docstring.

    Example:
        >>> with FaultProxy(server_port) as proxy:
        ...     proxy.arm("after")
        ...     # the next EVALSHA runs on the server, then the client's connection is cut
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self._pairs: list[_Pair] = []
        self._stopped = threading.Event()
        self._released = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="fault-proxy", daemon=True)
        self._delay = 0.0
        self._request_delay = 0.0
        #: Set when a fault fires (for ``hold``: once the connection is frozen at its point).
        self.fired = threading.Event()
        self.incidents: list[Incident] = []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def arm(
        self, point: Point, *, times: int = 1, hold: bool = False, commands: frozenset[bytes] = SCRIPT_COMMANDS
    ) -> None:
        """Cut the connection at ``point`` of each of the next ``times`` matching commands."""
        with self._lock:
            self._faults.extend(Fault(point, commands, hold) for _ in range(times))
            self.fired.clear()
            self._released.clear()

    @property
    def armed(self) -> int:
        with self._lock:
            return len(self._faults)

    def delay(self, seconds: float) -> None:
        """Hold every reply from the server this long before passing it on (0: no delay)."""
        self._delay = max(seconds, 0.0)

    def delay_requests(self, seconds: float) -> None:
        """Hold every command from a client this long before passing it on (0: no delay)."""
        self._request_delay = max(seconds, 0.0)

    def reset(self) -> int:
        """Reset every open connection now (the clients see ECONNRESET); returns how many."""
        with self._lock:
            pairs, self._pairs = [pair for pair in self._pairs if not pair.closed], []
        for pair in pairs:
            pair.close(reset=True)
        return len(pairs)

    def disarm(self) -> None:
        """Drop every armed fault that has not fired yet, and let a held one finish."""
        with self._lock:
            self._faults.clear()
        self._released.set()

    def release(self) -> None:
        """Let a held fault finish: the frozen connection is cut now."""
        self._released.set()

    def close(self) -> None:
        self._stopped.set()
        self._released.set()
        self._thread.join(5)
        self._listener.close()
        with self._lock:
            pairs = list(self._pairs)
        for pair in pairs:
            pair.close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            try:
                upstream = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            pair = _Pair(client, upstream)
            with self._lock:
                self._pairs = [known for known in self._pairs if not known.closed]
                self._pairs.append(pair)
            threading.Thread(target=self._client_to_server, args=(pair,), daemon=True).start()
            threading.Thread(target=self._server_to_client, args=(pair,), daemon=True).start()

    def _take_fault(self, command: bytes) -> Fault | None:
        with self._lock:
            for index, fault in enumerate(self._faults):
                if command in fault.commands:
                    return self._faults.pop(index)
        return None

    def _fire(self, pair: _Pair, fault: Fault, incident: Incident) -> None:
        with self._lock:
            self.incidents.append(incident)
        self.fired.set()
        if fault.hold:
            self._released.wait(30)
        pair.close()

    def _client_to_server(self, pair: _Pair) -> None:
        buf = bytearray()
        while True:
            try:
                data = pair.client.recv(65536)
            except OSError:
                data = b""
            if not data:
                pair.close()
                return
            buf += data
            while True:
                parsed = parse_command(buf)
                if parsed is None:
                    break
                command, end = parsed
                raw = bytes(buf[:end])
                del buf[:end]
                fault = self._take_fault(command)
                if fault is not None and fault.point == "before":
                    self._fire(pair, fault, Incident("before", command))
                    return
                if fault is not None:
                    # Set before forwarding, so the reply cannot slip through first.
                    pair.swallow, pair.command = fault, command
                if self._request_delay:
                    time.sleep(self._request_delay)
                try:
                    pair.upstream.sendall(raw)
                except OSError:
                    pair.close()
                    return

    def _server_to_client(self, pair: _Pair) -> None:
        while True:
            try:
                data = pair.upstream.recv(65536)
            except OSError:
                data = b""
            if not data:
                pair.close()
                return
            fault = pair.swallow
            if fault is not None:
                self._fire(pair, fault, Incident("after", pair.command, swallowed=data))
                return
            if self._delay:
                time.sleep(self._delay)
            try:
                pair.client.sendall(data)
            except OSError:
                pair.close()
                return
