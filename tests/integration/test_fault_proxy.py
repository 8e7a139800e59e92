"""The fault proxy of the chaos nemesis and the atomicity tests, on a real server: its faults are what they say.

The chaos checker explains a message lost in transit by a fault that came
after the message was sent. That holds only if a reset cuts every connection
at once, on both sides: a server that still holds a connection the proxy had
given up would hand a message published later to a client that never gets it.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from urllib.parse import urlparse

import pytest
import redis

from chaos.proxy import FaultProxy

from ..conftest import Server


@pytest.fixture
def proxy(server: Server, r: redis.Redis) -> Iterator[FaultProxy]:
    port = urlparse(server.url).port
    assert port is not None
    with FaultProxy(port) as fault_proxy:
        yield fault_proxy


def command(*words: str) -> bytes:
    parts = [f"*{len(words)}\r\n".encode()]
    for word in words:
        parts.append(f"${len(word)}\r\n{word}\r\n".encode())
    return b"".join(parts)


def named(r: redis.Redis, name: str) -> list[dict[str, str]]:
    return [client for client in r.client_list() if client.get("name") == name]


def test_a_reset_cuts_a_connection_waiting_in_brpop_so_a_later_message_stays_queued(
    r: redis.Redis, proxy: FaultProxy
) -> None:
    # A worker waiting for its next message, as kombu's consumer does.
    client = socket.create_connection(("127.0.0.1", proxy.port))
    client.sendall(command("CLIENT", "SETNAME", "waiting") + command("BRPOP", "queue", "0"))
    assert client.recv(100) == b"+OK\r\n"
    deadline = time.monotonic() + 5
    while not any(c.get("cmd") == "brpop" for c in named(r, "waiting")):
        assert time.monotonic() < deadline, "the client never blocked in BRPOP"
        time.sleep(0.01)

    assert proxy.reset() == 1

    # The server lets the connection go at once, as a client sees it cut.
    deadline = time.monotonic() + 2
    while named(r, "waiting"):
        assert time.monotonic() < deadline, "the server still holds the connection the proxy reset"
        time.sleep(0.01)
    client.settimeout(2)
    with pytest.raises(ConnectionResetError):
        client.recv(100)
    client.close()
    # A message published after the reset waits for the next consumer: nobody took it.
    r.lpush("queue", "message")
    assert r.llen("queue") == 1
