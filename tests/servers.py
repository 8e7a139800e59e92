"""Servers the project's own tests and benchmarks start besides the throw-away Redis server of ``celery_dedup.testing``.

:class:`RabbitMQNode` starts a private RabbitMQ node from an installed
RabbitMQ (Debian's ``rabbitmq-server``); :class:`RedisCluster` a Redis
Cluster (three masters, three replicas) from the server binary, where it is
7.0 or later.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import redis
import redis.cluster
from redis.crc import key_slot

from celery_dedup.testing import RedisServer, find_server_binary

# --------------------------------------------------------------------------- a RabbitMQ node

#: The folder of RabbitMQ's scripts (``rabbitmq-server``, ``rabbitmqctl``...) to use instead of looking for them.
RABBITMQ_VARIABLE = "CELERY_DEDUP_TEST_RABBITMQ"
#: Where Debian's rabbitmq-server keeps the scripts. Its /usr/sbin entries wrap them to run as the
#: ``rabbitmq`` user with the system node's files; a private node runs them directly.
DEBIAN_RABBITMQ = Path("/usr/lib/rabbitmq/bin")


class RabbitMQNotFound(RuntimeError):
    """No RabbitMQ installation is available."""


def find_rabbitmq() -> Path:
    """The folder of RabbitMQ's scripts: ``$CELERY_DEDUP_TEST_RABBITMQ``, Debian's, or ``rabbitmq-server``'s on PATH."""
    explicit = os.environ.get(RABBITMQ_VARIABLE)
    found = shutil.which("rabbitmq-server", path=f"{os.environ.get('PATH', '')}:/usr/sbin")
    candidates = [Path(explicit)] if explicit else [DEBIAN_RABBITMQ, *([Path(found).resolve().parent] if found else [])]
    for folder in candidates:
        if (folder / "rabbitmq-server").exists() and (folder / "rabbitmqctl").exists():
            return folder
    raise RabbitMQNotFound(
        f"no rabbitmq-server: install Debian's rabbitmq-server, or set {RABBITMQ_VARIABLE} to the folder of its scripts"
    )


def _free_ports(count: int) -> list[int]:
    """``count`` different TCP ports on 127.0.0.1 that are free right now."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]


class RabbitMQNode:
    """A private RabbitMQ node on loopback, stopped (and its files deleted) on exit.

    Everything is its own: a random node name, the AMQP, distribution and CLI
    ports, an epmd on a port of its own, data, logs, configuration (no
    plugins), and ``HOME`` (where the Erlang cookie is). A system node, if
    one runs, is neither seen nor touched. ``config`` is added to its
    ``rabbitmq.conf``. ``guest``/``guest`` may log in from loopback.

    :meth:`restart` stops and starts the node on the same ports and data:
    durable queues and their persistent messages survive it, connections do not.

    Example:
        >>> with RabbitMQNode() as node:
        ...     "celerydedup-" in node.run_ctl("status")
        True
    """

    def __init__(self, *, scripts: Path | None = None, config: str = "") -> None:
        self.scripts = scripts or find_rabbitmq()
        self.name = f"celerydedup-{secrets.token_hex(4)}@localhost"
        self.port, self.dist_port, self.epmd_port, self.ctl_port = _free_ports(4)
        self.config = config
        self.process: subprocess.Popen[bytes] | None = None
        self.epmd: subprocess.Popen[bytes] | None = None
        #: Seconds the last start took, until AMQP accepted a connection.
        self.started_in: float | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="celery-dedup-rabbitmq-")
        self.base = Path(self._dir.name)

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    @property
    def log(self) -> Path:
        """The node's output, every start appended."""
        return self.base / "node.log"

    def env(self) -> dict[str, str]:
        """The environment of the node and its CLI tools: this one, with every RabbitMQ and Erlang variable ours."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))}
        if not (env.get("LC_ALL") or env.get("LANG")):
            env["LANG"] = "C.UTF-8"  # the CLI tools warn on every call without a UTF-8 locale
        env.update(
            HOME=str(self.base / "home"),
            ERL_EPMD_PORT=str(self.epmd_port),
            ERL_EPMD_ADDRESS="127.0.0.1",
            RABBITMQ_NODENAME=self.name,
            RABBITMQ_NODE_IP_ADDRESS="127.0.0.1",
            RABBITMQ_NODE_PORT=str(self.port),
            RABBITMQ_DIST_PORT=str(self.dist_port),
            RABBITMQ_CTL_DIST_PORT_MIN=str(self.ctl_port),
            RABBITMQ_CTL_DIST_PORT_MAX=str(min(self.ctl_port + 10, 65535)),
            RABBITMQ_MNESIA_BASE=str(self.base / "data"),
            RABBITMQ_LOG_BASE=str(self.base / "logs"),
            RABBITMQ_LOGS="-",
            RABBITMQ_CONFIG_FILE=str(self.base / "rabbitmq.conf"),
            RABBITMQ_CONF_ENV_FILE=str(self.base / "rabbitmq-env.conf"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(self.base / "enabled_plugins"),
            # Distribution on loopback only; epmd is ours, so the VM must not start one of its own.
            RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1} -start_epmd false",
        )
        return env

    def _write_files(self) -> None:
        (self.base / "home").mkdir(exist_ok=True)
        (self.base / "rabbitmq-env.conf").write_text("")  # instead of /etc/rabbitmq/rabbitmq-env.conf
        (self.base / "enabled_plugins").write_text("[].\n")
        conf = f"listeners.tcp.default = 127.0.0.1:{self.port}\nloopback_users.guest = true\n"
        (self.base / "rabbitmq.conf").write_text(conf + self.config + ("\n" if self.config else ""))

    def start(self, timeout: float = 60.0) -> RabbitMQNode:
        """Start the node (and its epmd, the first time); return once AMQP accepts a connection."""
        began = time.monotonic()
        env = self.env()
        if self.epmd is None:
            self._write_files()
            epmd = shutil.which("epmd") or "epmd"
            self.epmd = subprocess.Popen(
                [epmd, "-port", str(self.epmd_port), "-address", "127.0.0.1"],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                [str(self.scripts / "rabbitmq-server")],
                env=env,
                cwd=self.base,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = began + timeout
        while not self._accepts_amqp():
            if self.process.poll() is not None:
                code, tail = self.process.returncode, self.log_tail()  # before stop() deletes the log
                self.stop()
                raise RuntimeError(f"rabbitmq-server exited with {code}:\n{tail}")
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop()
                raise TimeoutError(f"RabbitMQ node {self.name} did not accept AMQP within {timeout:g} s:\n{tail}")
            time.sleep(0.1)
        self.started_in = time.monotonic() - began
        return self

    def _accepts_amqp(self) -> bool:
        """Whether an AMQP connection opens (the port listens only late in the boot; the handshake confirms it)."""
        from kombu import Connection  # noqa: PLC0415 - only a RabbitMQ node needs it
        from kombu.exceptions import OperationalError  # noqa: PLC0415

        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
        except OSError:
            return False
        connection = Connection(self.url, connect_timeout=2)
        refused: tuple[type[BaseException], ...] = (OSError, OperationalError, *connection.connection_errors)
        try:
            connection.ensure_connection(max_retries=1, interval_start=0, interval_step=0, interval_max=0)
            return True
        except refused:
            return False
        finally:
            connection.release()

    def run_ctl(self, *args: str, tool: str = "rabbitmqctl", timeout: float = 60.0) -> str:
        """Run ``rabbitmqctl -n <node> *args`` (or another CLI tool, e.g. ``rabbitmq-diagnostics``); its output.

        Raises ``subprocess.CalledProcessError`` (with the output) when it fails.
        """
        done = subprocess.run(
            [str(self.scripts / tool), "-n", self.name, *args],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            raise subprocess.CalledProcessError(done.returncode, done.args, done.stdout, done.stderr)
        return done.stdout

    def stop_node(self, timeout: float = 30.0) -> None:
        """Stop the node (``rabbitmqctl stop``, then its process group is killed); keep its epmd, ports and data."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(subprocess.SubprocessError):
                self.run_ctl("stop", timeout=timeout)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout)
        # Whatever the VM left in its group (erl_child_setup, a port program), or the VM itself after a timeout.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()

    def restart(self, timeout: float = 60.0) -> RabbitMQNode:
        """Stop and start the node on the same ports and data (a broker restart, as clients see it)."""
        self.stop_node()
        return self.start(timeout)

    def stop(self) -> None:
        """Stop the node and its epmd, and delete its files."""
        self.stop_node()
        epmd, self.epmd = self.epmd, None
        if epmd is not None:
            epmd.terminate()
            try:
                epmd.wait(5)
            except subprocess.TimeoutExpired:
                epmd.kill()
                epmd.wait()
        self._dir.cleanup()

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the node's output."""
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no output)"

    def version(self) -> str:
        """``RabbitMQ <version>``, as the node reports it."""
        return "RabbitMQ " + self.run_ctl("-q", "server_version", tool="rabbitmq-diagnostics").strip()

    def __enter__(self) -> RabbitMQNode:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


# --------------------------------------------------------------------------- a Redis Cluster

#: Hash slots of a Redis Cluster.
HASH_SLOTS = 16384
#: The oldest server that can run :class:`RedisCluster`: ``cluster-port`` and ``CLUSTER ADDSLOTSRANGE`` came in 7.0.
CLUSTER_MIN_VERSION = (7, 0)


class ClusterNotSupported(RuntimeError):
    """The server binary cannot run :class:`RedisCluster` (Redis or Valkey 7.0 or later is needed)."""


def server_version(binary: str) -> tuple[int, ...]:
    """``(major, minor, patch)`` of a Redis-compatible server binary, from its ``--version``."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    found = re.search(r"v=(\d+)\.(\d+)\.(\d+)", out)
    if found is None:
        raise ClusterNotSupported(f"{binary} --version does not say its version: {out.strip()!r}")
    return tuple(int(part) for part in found.groups())


@dataclass(frozen=True)
class ClusterNodeInfo:
    """One node as ``CLUSTER NODES`` shows it.

    ``role`` is ``"master"`` or ``"replica"``; ``master_id`` names a
    replica's master. ``slots`` are inclusive ``(first, last)`` ranges.
    ``open_slots`` are slots being migrated from or imported to the node;
    a node shows them only in its own line.
    """

    node_id: str
    port: int
    role: str
    master_id: str | None
    slots: tuple[tuple[int, int], ...]
    flags: frozenset[str]
    open_slots: tuple[int, ...] = ()

    @property
    def slot_count(self) -> int:
        return sum(last - first + 1 for first, last in self.slots)

    def owns(self, slot: int) -> bool:
        return any(first <= slot <= last for first, last in self.slots)

    @property
    def failed(self) -> bool:
        """Whether the cluster agreed that this node is down (``fail``; a single node's ``fail?`` is not enough)."""
        return "fail" in self.flags


def parse_cluster_nodes(text: str) -> list[ClusterNodeInfo]:
    """The nodes of a ``CLUSTER NODES`` reply."""
    nodes = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 8:
            continue
        node_id, address, flags, master = fields[:4]
        slots: list[tuple[int, int]] = []
        open_slots: list[int] = []
        for field in fields[8:]:
            if field.startswith("["):  # [slot->-target] or [slot-<-source]
                open_slots.append(int(field[1:].split("-", 1)[0]))
            else:
                first, _, last = field.partition("-")
                slots.append((int(first), int(last or first)))
        flag_set = frozenset(flags.split(","))
        nodes.append(
            ClusterNodeInfo(
                node_id=node_id,
                port=int(address.split("@", 1)[0].rsplit(":", 1)[1] or 0),
                role="replica" if "slave" in flag_set else "master",
                master_id=None if master == "-" else master,
                slots=tuple(slots),
                flags=flag_set,
                open_slots=tuple(open_slots),
            )
        )
    return nodes


class RedisCluster:
    """A Redis Cluster on loopback: ``masters`` masters, each with ``replicas_per_master`` replicas; stopped on exit.

    Every node is a :class:`RedisServer` of its own (port, cluster bus port,
    directory, log) with cluster mode on and persistence off; the cluster is
    built with plain commands (ADDSLOTSRANGE, MEET, REPLICATE), so any server
    binary 7.0 or later will do, with no command-line tool. The slots are
    split evenly over the masters. :meth:`start` returns once every node says
    ``cluster_state:ok``, all of them show the same roles and slots, and every
    replica is in sync with its master.

    Roles change: :meth:`kill_master` and :meth:`wait_failover` promote a
    replica, :meth:`restart_node` brings the killed node back as a replica;
    :meth:`masters` and :meth:`replicas` read the roles of the moment from
    ``CLUSTER NODES``. :meth:`migrate_slots` and :meth:`reshard` move slots
    with their keys while clients run. :meth:`reset` brings back the layout
    of the start with no keys, for the next test.

    ``node_timeout`` (ms) is ``cluster-node-timeout``: a dead master is
    replaced about two to three times that long after it died.

    Example:
        >>> with RedisCluster() as cluster:
        ...     with cluster.client() as client:
        ...         _ = client.set("order:1", "x")
        ...     cluster.node_of_key("order:1").port in cluster.master_ports()
        True
    """

    def __init__(
        self,
        masters: int = 3,
        replicas_per_master: int = 1,
        *,
        binary: str | None = None,
        node_timeout: int = 2000,
    ) -> None:
        self.binary = binary or find_server_binary()
        version = server_version(self.binary)
        if version[:2] < CLUSTER_MIN_VERSION:
            raise ClusterNotSupported(
                f"{self.binary} is version {'.'.join(map(str, version))}; a cluster needs 7.0 or later"
            )
        if masters < 1 or replicas_per_master < 0:
            raise ValueError("a cluster needs at least one master and no negative number of replicas")
        self.node_timeout = node_timeout
        count = masters * (1 + replicas_per_master)
        ports = _free_ports(2 * count)
        self.bus_ports = dict(zip(ports[:count], ports[count:], strict=True))
        #: The masters of the start, in slot order; ``replica_ports[i]`` replicate ``initial_masters[i]`` at the start.
        self.initial_masters = ports[:masters]
        self.initial_replicas = [
            ports[masters + i * replicas_per_master : masters + (i + 1) * replicas_per_master] for i in range(masters)
        ]
        self.initial_slots = {
            port: (HASH_SLOTS * i // masters, HASH_SLOTS * (i + 1) // masters - 1)
            for i, port in enumerate(self.initial_masters)
        }
        self.node_ids: dict[int, str] = {}
        #: Seconds the last :meth:`start` took, until the cluster was ready.
        self.started_in: float | None = None
        #: Seconds from the last :meth:`kill_master` to the end of :meth:`wait_failover`.
        self.last_failover_in: float | None = None
        self._servers: dict[int, RedisServer] = {}
        self._admins: dict[int, redis.Redis] = {}
        self._down: dict[int, float] = {}  # port of a killed node -> when
        self._down_slots: dict[int, tuple[tuple[int, int], ...]] = {}
        self._dir = tempfile.TemporaryDirectory(prefix="celery-dedup-cluster-")

    # ------------------------------------------------------------------ where it is

    @property
    def ports(self) -> list[int]:
        """Every node's port."""
        return list(self.bus_ports)

    @property
    def seeds(self) -> list[tuple[str, int]]:
        """``(host, port)`` of the masters of the start: where a client finds the cluster."""
        return [("127.0.0.1", port) for port in self.initial_masters]

    @property
    def url(self) -> str:
        """``redis+cluster://127.0.0.1:p1,127.0.0.1:p2,...``: the seeds."""
        return "redis+cluster://" + ",".join(f"{host}:{port}" for host, port in self.seeds)

    def client(self, **kwargs: Any) -> redis.cluster.RedisCluster:
        """A new ``redis.cluster.RedisCluster`` on the seeds (close it when done); ``kwargs`` go to it.

        Socket timeouts are bounded (5 s, 2 s to connect) unless given, so a
        stopped node fails a call instead of hanging it.
        """
        kwargs = {"socket_timeout": 5.0, "socket_connect_timeout": 2.0, **kwargs}
        nodes = [redis.cluster.ClusterNode(host, port) for host, port in self.seeds]
        return redis.cluster.RedisCluster(startup_nodes=nodes, **kwargs)

    def log(self, port: int) -> Path:
        """The log of the node on ``port``, every start appended."""
        return Path(self._dir.name) / f"node-{port}.log"

    # ------------------------------------------------------------------ start and stop

    def _node(self, port: int) -> RedisServer:
        base = Path(self._dir.name)
        options = {
            "cluster-enabled": "yes",
            "cluster-config-file": str(base / f"nodes-{port}.conf"),  # the node id survives a restart
            "cluster-port": str(self.bus_ports[port]),
            "cluster-node-timeout": str(self.node_timeout),
            # A replica may always take over, however long its link was down: tests kill nodes at will.
            "cluster-replica-validity-factor": "0",
            # Roles change only by failover: a master emptied by a reshard keeps its role and its replicas.
            "cluster-allow-replica-migration": "no",
            "repl-diskless-sync": "yes",
            "repl-diskless-sync-delay": "0",
            "logfile": str(self.log(port)),
        }
        extra = tuple(arg for key, value in options.items() for arg in (f"--{key}", value))
        return RedisServer(port, binary=self.binary, extra=extra)

    def _admin(self, port: int) -> redis.Redis:
        client = self._admins.get(port)
        if client is None:
            client = redis.Redis(port=port, socket_timeout=2.0, socket_connect_timeout=0.5)
            self._admins[port] = client
        return client

    def _command(self, port: int, *command: str | int | bytes) -> Any:
        """Run a command on the node on ``port``, its reply unparsed."""
        return self._admin(port).execute_command(*command)

    def _text(self, port: int, *command: str | int) -> str:
        reply = self._command(port, *command)
        return reply.decode() if isinstance(reply, bytes) else str(reply)

    def start(self, timeout: float = 60.0) -> RedisCluster:
        """Start the nodes, give the masters their slots, attach the replicas; return once the cluster is ready."""
        began = time.monotonic()
        try:
            for port in self.ports:
                self._servers[port] = self._node(port).start()
                self.node_ids[port] = self._text(port, "CLUSTER", "MYID")
            for epoch, port in enumerate(self.ports, 1):
                self._text(port, "CLUSTER", "SET-CONFIG-EPOCH", epoch)  # distinct epochs: no collision to settle
            for port, (first, last) in self.initial_slots.items():
                self._text(port, "CLUSTER", "ADDSLOTSRANGE", first, last)
            first_port = self.ports[0]
            for port in self.ports[1:]:
                self._text(first_port, "CLUSTER", "MEET", "127.0.0.1", port, self.bus_ports[port])
            self._wait(self._all_known, began + timeout, "every node did not learn of every other")
            for master, replicas in zip(self.initial_masters, self.initial_replicas, strict=True):
                for port in replicas:
                    self._text(port, "CLUSTER", "REPLICATE", self.node_ids[master])
            self._wait(self._unsettled, began + timeout, "the cluster did not settle")
        except BaseException:
            self.stop()
            raise
        self.started_in = time.monotonic() - began
        return self

    def stop(self) -> None:
        """Stop every node and delete their files."""
        for client in self._admins.values():
            client.close()
        self._admins.clear()
        for server in self._servers.values():
            if server.process is not None and server.process.poll() is None:
                server.process.send_signal(signal.SIGCONT)  # a node stopped with SIGSTOP must run to end
            server.stop()
        self._servers.clear()
        self._dir.cleanup()

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------ what it looks like

    def live_ports(self) -> list[int]:
        """The ports of the nodes not killed (or killed and restarted)."""
        return [port for port in self.ports if port not in self._down]

    def nodes(self) -> list[ClusterNodeInfo]:
        """Every node as the first live node that answers sees it (failed ones too)."""
        error: Exception | None = None
        for port in self.live_ports():
            try:
                return parse_cluster_nodes(self._text(port, "CLUSTER", "NODES"))
            except redis.RedisError as exc:
                error = exc
        raise RuntimeError(f"no node of the cluster answers: {error}")

    def masters(self) -> list[ClusterNodeInfo]:
        """The masters of the moment that are not failed, in slot order (a master with no slot last)."""
        found = [node for node in self.nodes() if node.role == "master" and not node.failed]
        return sorted(found, key=lambda node: node.slots[0][0] if node.slots else HASH_SLOTS)

    def master_ports(self) -> list[int]:
        return [node.port for node in self.masters()]

    def replicas(self) -> list[ClusterNodeInfo]:
        """The replicas of the moment that are not failed, by port."""
        return sorted((n for n in self.nodes() if n.role == "replica" and not n.failed), key=lambda n: n.port)

    @staticmethod
    def slot_of(key: str | bytes) -> int:
        """The hash slot of ``key`` (its ``{hash tag}`` if it has one)."""
        return key_slot(key.encode() if isinstance(key, str) else key)

    def master_port_for_slot(self, slot: int) -> int:
        """The port of the master that serves ``slot`` now."""
        for node in self.masters():
            if node.owns(slot):
                return node.port
        raise LookupError(f"no master serves slot {slot}")

    def node_of_key(self, key: str | bytes) -> ClusterNodeInfo:
        """The master that serves ``key`` now."""
        slot = self.slot_of(key)
        for node in self.masters():
            if node.owns(slot):
                return node
        raise LookupError(f"no master serves slot {slot} of {key!r}")

    # ------------------------------------------------------------------ waiting for a state

    def _wait(self, check: Callable[[], str | None], deadline: float, what: str) -> None:
        """Poll ``check`` (None once done, else what is missing) until ``deadline``; else TimeoutError with the logs."""
        reason: str | None = "not checked"
        while True:
            try:
                reason = check()
            except redis.RedisError as exc:
                reason = f"{type(exc).__name__}: {exc}"
            if reason is None:
                return
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- node {port}:\n{self._log_tail(port)}" for port in self.ports)
                raise TimeoutError(f"{what}: {reason}\n{tails}")
            time.sleep(0.05)

    def _log_tail(self, port: int, lines: int = 6) -> str:
        try:
            return "\n".join(self.log(port).read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def _all_known(self) -> str | None:
        for port in self.live_ports():
            known = [n for n in parse_cluster_nodes(self._text(port, "CLUSTER", "NODES")) if "handshake" not in n.flags]
            if len(known) < len(self.ports):
                return f"node {port} knows {len(known)} of {len(self.ports)} nodes"
        return None

    def _unsettled(self) -> str | None:
        """What keeps the live nodes from being settled, or None.

        Settled: every live node says ``cluster_state:ok`` and shows the same
        roles and slots (a killed node failed, a live one not), and every live
        replica has finished its sync and its master sees it online.
        """
        live = self.live_ports()
        views: dict[int, list[ClusterNodeInfo]] = {}
        for port in live:
            info = self._text(port, "CLUSTER", "INFO")
            if "cluster_state:ok" not in info:
                return f"node {port} says cluster_state is not ok"
            views[port] = parse_cluster_nodes(self._text(port, "CLUSTER", "NODES"))
        shapes = {
            port: sorted((n.node_id, n.port, n.role, n.master_id, n.slots, n.failed) for n in view)
            for port, view in views.items()
        }
        first = shapes[live[0]]
        for port, shape in shapes.items():
            if shape != first:
                return f"nodes {live[0]} and {port} disagree on roles or slots"
            if len(shape) != len(self.ports):
                return f"node {port} knows {len(shape)} of {len(self.ports)} nodes"
        return self._unsynced(views[live[0]])

    def _unsynced(self, view: list[ClusterNodeInfo]) -> str | None:
        """Which node of ``view`` is not where a settled cluster has it: down but not failed, up but flagged,
        a replica not in sync, a master not seeing its replicas online; None if none."""
        for node in view:
            if node.port in self._down:
                if not node.failed:
                    return f"killed node {node.port} is not marked failed yet"
                continue
            if node.flags & {"fail", "fail?", "handshake", "noaddr"}:
                return f"live node {node.port} is flagged {','.join(sorted(node.flags))}"
            replication = self._admin(node.port).info("replication")
            if node.role == "replica":
                if replication.get("master_link_status") != "up" or replication.get("master_sync_in_progress"):
                    return f"replica {node.port} is not in sync with its master"
                continue
            wanted = {n.port for n in view if n.master_id == node.node_id and n.port not in self._down}
            online = {
                int(value["port"])
                for key, value in replication.items()
                if key.startswith("slave") and isinstance(value, dict) and value.get("state") == "online"
            }
            if not wanted <= online:
                return f"master {node.port} does not see replicas {sorted(wanted - online)} online"
        return None

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Wait until the live nodes are settled (see :meth:`start`); TimeoutError, with the nodes' logs, if not."""
        self._wait(self._unsettled, time.monotonic() + timeout, "the cluster did not settle")

    def wait_replicated(self, timeout: float = 5.0) -> None:
        """Wait until every live replica has every write its master took so far (``WAIT``); TimeoutError if not."""
        for master in self.masters():
            replicas = [n for n in self.replicas() if n.master_id == master.node_id]
            if not replicas:
                continue
            acked = self._command(master.port, "WAIT", len(replicas), int(timeout * 1000))
            if int(acked) < len(replicas):
                raise TimeoutError(f"{acked} of {len(replicas)} replicas of {master.port} took its writes")

    # ------------------------------------------------------------------ failures

    def kill_master(self, port: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the master on ``port`` (SIGKILL: it dies at once; SIGSTOP: it hangs)."""
        node = next((n for n in self.masters() if n.port == port), None)
        if node is None or port in self._down:
            raise ValueError(f"{port} is not a live master of the cluster")
        process = self._servers[port].process
        assert process is not None
        process.send_signal(sig)
        if sig == signal.SIGKILL:
            process.wait()
        self._down[port] = time.monotonic()
        self._down_slots[port] = node.slots
        admin = self._admins.pop(port, None)
        if admin is not None:
            admin.close()

    def wait_failover(self, old_master_port: int, timeout: float = 30.0) -> int:
        """Wait until a replica has taken over the slots of the killed master and the cluster is settled; its port."""
        if old_master_port not in self._down:
            raise ValueError(f"{old_master_port} was not killed")
        slot = self._down_slots[old_master_port][0][0]
        old_id = self.node_ids[old_master_port]
        promoted: list[int] = []

        def taken_over() -> str | None:
            owner = next((n for n in self.masters() if n.owns(slot)), None)
            if owner is None or owner.node_id == old_id:
                return f"slot {slot} is still served by the killed master"
            promoted[:] = [owner.port]
            return self._unsettled()

        self._wait(taken_over, time.monotonic() + timeout, f"no replica took over from {old_master_port}")
        self.last_failover_in = time.monotonic() - self._down[old_master_port]
        return promoted[0]

    def restart_node(self, port: int, timeout: float = 30.0) -> ClusterNodeInfo:
        """Start the killed node on ``port`` again, with its node id; return its role once the cluster is settled.

        A master that was replaced comes back as a replica of the node that
        replaced it (it starts empty: persistence is off, it syncs from it).
        """
        self._start_again(port)
        self.wait_healthy(timeout)
        return self._myself(port)

    def _start_again(self, port: int) -> None:
        if port not in self._down:
            raise ValueError(f"{port} was not killed")
        old = self._servers[port]
        if old.process is not None and old.process.poll() is None:
            old.process.kill()  # stopped with SIGSTOP, say: a restart is a new process
            old.process.wait()
        old.stop()
        self._servers[port] = self._node(port).start()
        del self._down[port]
        self._down_slots.pop(port, None)

    # ------------------------------------------------------------------ moving slots

    @contextlib.contextmanager
    def migrating(self, slot: int, to_port: int, *, batch: int = 100) -> Iterator[Callable[[int], int]]:
        """Move ``slot`` to the master on ``to_port``: open the migration, run the body, move the keys, close it.

        While the body runs, the slot is MIGRATING on its master and
        IMPORTING on ``to_port``: a key of it that its master does not hold
        (any more) is answered with ASK. The body gets ``move(count)``, which
        moves up to ``count`` of the slot's keys now and says how many it
        moved. On exit the other keys are moved (MIGRATE, ``batch`` at a
        time) and the slot is given to ``to_port`` on every master, after
        which its old master answers MOVED.
        """
        source = self.master_port_for_slot(slot)
        if to_port not in self.master_ports():
            raise ValueError(f"{to_port} is not a live master of the cluster")

        def move(count: int) -> int:
            moved = 0
            while moved < count and source != to_port:
                keys = self._command(source, "CLUSTER", "GETKEYSINSLOT", slot, min(batch, count - moved))
                if not keys:
                    break
                self._command(source, "MIGRATE", "127.0.0.1", to_port, "", 0, 5000, "KEYS", *keys)
                moved += len(keys)
            return moved

        if source == to_port:
            yield move
            return
        target_id = self.node_ids[to_port]
        self._text(to_port, "CLUSTER", "SETSLOT", slot, "IMPORTING", self.node_ids[source])
        self._text(source, "CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
        try:
            yield move
        finally:
            while move(batch):
                pass
            # The new owner first, so that the old one never redirects to a node that does not know yet.
            others = [port for port in self.master_ports() if port not in (source, to_port)]
            for port in [to_port, source, *others]:
                self._text(port, "CLUSTER", "SETSLOT", slot, "NODE", target_id)

    def migrate_slots(self, slots: Iterable[int], to_port: int, *, batch: int = 100) -> None:
        """Move each of ``slots`` with its keys to the master on ``to_port`` (see :meth:`migrating`), one at a time."""
        for slot in slots:
            with self.migrating(slot, to_port, batch=batch):
                pass

    def reshard(self, count: int, from_port: int, to_port: int, *, batch: int = 100) -> list[int]:
        """Move the first ``count`` slots of the master on ``from_port`` to the one on ``to_port``; the slots moved."""
        source = next((n for n in self.masters() if n.port == from_port), None)
        if source is None:
            raise ValueError(f"{from_port} is not a live master of the cluster")
        slots = [slot for first, last in source.slots for slot in range(first, last + 1)][:count]
        self.migrate_slots(slots, to_port, batch=batch)
        return slots

    # ------------------------------------------------------------------ cleaning up

    def flushall(self) -> None:
        """Delete every key on every master, and wait until the replicas have deleted them too."""
        for node in self.masters():
            self._admin(node.port).flushall()
        self.wait_replicated()

    def reset(self, timeout: float = 60.0) -> None:
        """Back to the layout of the start, with no keys.

        Killed nodes are restarted, open migrations closed, the first masters
        take their role back (a manual failover: nothing is lost), the first
        replicas follow them again, and every slot goes back to its first
        master. Cheap when nothing changed: for per-test cleanup.
        """
        for port in list(self._down):
            self._start_again(port)
        self.wait_healthy(timeout)
        for port in self.master_ports():
            for slot in self._myself(port).open_slots:
                self._text(port, "CLUSTER", "SETSLOT", slot, "STABLE")
        self.flushall()
        deadline = time.monotonic() + timeout
        for index, master in enumerate(self.initial_masters):
            if self._myself(master).role != "master":
                self._text(master, "CLUSTER", "FAILOVER")
                self._wait(functools.partial(self._not_master, master), deadline, f"{master} did not become master")
            for replica in self.initial_replicas[index]:
                node = self._myself(replica)
                if node.role != "replica" or node.master_id != self.node_ids[master]:
                    self._text(replica, "CLUSTER", "REPLICATE", self.node_ids[master])
        self.wait_healthy(timeout)
        for master, (first, last) in self.initial_slots.items():
            strays = [
                slot
                for node in self.masters()
                if node.port != master
                for low, high in node.slots
                for slot in range(max(low, first), min(high, last) + 1)
            ]
            self.migrate_slots(strays, master)
        self.wait_healthy(timeout)

    def _myself(self, port: int) -> ClusterNodeInfo:
        """The node on ``port`` as it sees itself (the only view with its open slots)."""
        return next(n for n in parse_cluster_nodes(self._text(port, "CLUSTER", "NODES")) if "myself" in n.flags)

    def _not_master(self, port: int) -> str | None:
        return None if self._myself(port).role == "master" else f"{port} is still a replica"
