"""The processes of a chaos run: the server, the fault proxies, the workers and the producers.

Every client process talks to the server through a fault proxy of its own
(one per worker slot, one per producer slot, kept across restarts), so the
nemesis can break one process's connections without touching the others.
Workers and producers run in their own sessions (process groups), with the
``PYTHONPATH`` the run was given: that is how a run tests a patched copy of
the library.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import redis

from celery_dedup.testing import RedisServer

from .history import SERVER_LOG, History
from .proxy import FaultProxy

#: The database of the dedup store when it is apart from the broker's (database 0).
STORE_DB = 1
#: Every worker pool the run can start; slot i runs ``pools[i % len(pools)]``.
POOLS = ("prefork", "threads", "solo", "gevent")


def group_pids(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (a worker and its pool children), sorted."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(entry.name))
    return sorted(found)


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def last_error(log_path: Path, generation: int) -> tuple[str, str]:
    """The last ``Unrecoverable error`` (else CRITICAL) line a worker generation logged, and the traceback after it."""
    text = log_path.read_text(errors="replace")
    lines = text[text.rfind(f"=== generation {generation}:") :].splitlines()
    starts = [i for i, line in enumerate(lines) if "Unrecoverable error" in line]
    starts = starts or [i for i, line in enumerate(lines) if "CRITICAL" in line]
    if not starts:
        return "", ""
    first = starts[-1]
    end = next((i for i in range(first + 1, len(lines)) if lines[i].startswith("[")), len(lines))
    return lines[first], "\n".join(lines[first + 1 : end])


class DeathWatch:
    """Records the moment each worker process exits (``exit`` events), however it died.

    The nemesis records the kills it sends, but a pool child also dies when a
    revoke terminates it, and billiard's own kills come unannounced: a pidfd
    per process (Linux 5.3+) wakes this thread as soon as the process is gone.
    New pool children are picked up every ``interval`` seconds.
    """

    def __init__(self, history: History, slots: Callable[[], list[Slot]], interval: float = 0.2) -> None:
        self.history = history
        self.slots = slots
        self.interval = interval
        self.stopped = threading.Event()
        self._fds: dict[int, int] = {}
        self._thread = threading.Thread(target=self._run, name="death-watch", daemon=True)

    def start(self) -> DeathWatch:
        if hasattr(os, "pidfd_open"):
            self._thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        if self._thread.is_alive():
            self._thread.join(5)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _watch_new(self, poller: select.poll) -> None:
        for slot in self.slots():
            for pid in slot.pids():
                if pid in self._fds:
                    continue
                try:
                    fd = os.pidfd_open(pid)
                except OSError:
                    continue
                self._fds[pid] = fd
                poller.register(fd, select.POLLIN)

    def _run(self) -> None:
        poller = select.poll()
        while not self.stopped.is_set():
            self._watch_new(poller)
            by_fd = {fd: pid for pid, fd in self._fds.items()}
            for fd, _ in poller.poll(self.interval * 1000):
                pid = by_fd[fd]
                self.history.emit("exit", pids=[pid])
                poller.unregister(fd)
                os.close(fd)
                del self._fds[pid]


@dataclass
class Server:
    """The embedded Valkey, optionally with an append-only file (``fsync always``) to survive restarts."""

    data_dir: Path
    persistent: bool
    #: Where the server logs, outside ``data_dir`` (a wipe deletes that): the scripts' transition reports.
    log: Path
    process: RedisServer = field(init=False)

    def __post_init__(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        extra: tuple[str, ...] = ("--dir", str(self.data_dir), "--logfile", str(self.log))
        if self.persistent:
            extra += ("--appendonly", "yes", "--appendfsync", "always")
        self.process = RedisServer(extra=extra)

    @property
    def port(self) -> int:
        return self.process.port

    @property
    def url(self) -> str:
        return self.process.url

    def start(self) -> None:
        self.process.start()

    def crash(self, *, wipe: bool) -> None:
        """SIGKILL the server; ``wipe`` also deletes its data, as a restart without persistence would."""
        popen = self.process.process
        if popen is not None and popen.poll() is None:
            popen.kill()
            popen.wait()
        if popen is not None and popen.stderr:
            popen.stderr.close()
        if wipe:
            for path in sorted(self.data_dir.rglob("*"), reverse=True):
                if path.is_file():
                    path.unlink()

    def stop(self) -> None:
        self.process.stop()

    def client(self, db: int = 0) -> redis.Redis:
        return redis.Redis(port=self.port, db=db, socket_timeout=10)


@dataclass
class Slot:
    """A place for one worker or producer process: its proxy, its current process and generation."""

    role: str
    index: int
    proxy: FaultProxy
    process: subprocess.Popen[bytes] | None = None
    generation: int = 0
    log: IO[bytes] | None = None
    #: Set while the run itself stops or kills the process: an exit then is no crash.
    expected_exit: bool = False
    #: A worker's pool (``prefork``, ``threads``, ``solo``, ``gevent``) and whether it acknowledges late.
    pool: str = "prefork"
    acks_late: bool = False
    #: A worker's node name (kept when it restarts under its own name).
    node: str = ""
    #: The proxy to the store, in a run whose store is apart from the broker (two-phase).
    store_proxy: FaultProxy | None = None

    @property
    def proxies(self) -> list[FaultProxy]:
        return [self.proxy] if self.store_proxy is None else [self.proxy, self.store_proxy]

    @property
    def store_link(self) -> FaultProxy:
        """The proxy the process reaches the dedup store through."""
        return self.store_proxy or self.proxy

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def pid(self) -> int:
        return self.process.pid if self.process is not None else 0

    def pids(self) -> list[int]:
        return group_pids(self.pid) if self.alive else []

    def children(self) -> list[int]:
        return [pid for pid in self.pids() if pid != self.pid]

    def body_pids(self) -> list[int]:
        """The processes that run bodies: a prefork pool's children, else the worker's main process."""
        if self.pool == "prefork":
            return self.children()
        return [self.pid] if self.alive else []


@dataclass
class Cluster:
    """Starts, kills and restarts the run's processes; see the module docstring."""

    run_dir: Path
    pythonpath: str
    history: History
    workers: int = 2
    concurrency: int = 2
    producers: int = 3
    seed: int = 0
    keys: int = 35
    modes: str = ""
    persistent: bool = False
    #: Pools of the worker slots, in turn (see :meth:`worker_conf`).
    pools: tuple[str, ...] = POOLS
    #: The dedup store in a database of its own (``STORE_DB``), each process reaching it through a proxy of
    #: its own: the two-phase gate. Else the store is the broker (the atomic gate).
    store_apart: bool = False
    worker_slots: list[Slot] = field(default_factory=list)
    producer_slots: list[Slot] = field(default_factory=list)
    server: Server = field(init=False)

    def __post_init__(self) -> None:
        self.server = Server(self.run_dir / "server", self.persistent, self.run_dir / SERVER_LOG)

    # --- the whole --------------------------------------------------------------------------

    def start(self) -> None:
        self.server.start()
        self.worker_slots = [Slot("worker", i, FaultProxy(self.server.port).start()) for i in range(self.workers)]
        for slot in self.worker_slots:
            slot.pool = self.pools[slot.index % len(self.pools)]
            # Acknowledgement alternates by slot, and flips for each round of pools: with twice as many
            # workers as pools, every pool runs both ways.
            slot.acks_late = (slot.index + slot.index // len(self.pools)) % 2 == 0
        self.producer_slots = [Slot("producer", i, FaultProxy(self.server.port).start()) for i in range(self.producers)]
        for slot in self.slots if self.store_apart else ():
            slot.store_proxy = FaultProxy(self.server.port).start()
        for slot in self.worker_slots:
            self.start_worker(slot)
        for slot in self.worker_slots:
            self.wait_ready(slot)
        for slot in self.producer_slots:
            self.start_producer(slot)

    def stop(self) -> None:
        """Stop everything still running (idempotent)."""
        for slot in self.producer_slots + self.worker_slots:
            self.stop_process(slot, grace=0)
        for slot in self.producer_slots + self.worker_slots:
            for proxy in slot.proxies:
                proxy.close()
        self.server.stop()

    @property
    def slots(self) -> list[Slot]:
        return self.worker_slots + self.producer_slots

    @property
    def store_url(self) -> str:
        """The dedup store, reached directly (the runner's own app); the broker's URL unless the store is apart."""
        return f"redis://127.0.0.1:{self.server.port}/{STORE_DB}" if self.store_apart else self.server.url

    def store_client(self) -> redis.Redis:
        return self.server.client(STORE_DB if self.store_apart else 0)

    # --- processes --------------------------------------------------------------------------

    def _env(self, slot: Slot, conf: dict[str, Any] | None = None) -> dict[str, str]:
        env = dict(
            os.environ,
            PYTHONPATH=self.pythonpath,
            CHAOS_BROKER=slot.proxy.url,
            CHAOS_RUN_DIR=str(self.run_dir),
            CHAOS_ROLE=f"{slot.name}.{slot.generation}",
            CHAOS_CONF=json.dumps(conf or {}),
            CHAOS_STORE=f"redis://127.0.0.1:{slot.store_proxy.port}/{STORE_DB}" if slot.store_proxy else "",
        )
        env.pop("PYTHONSTARTUP", None)
        return env

    def _spawn(self, slot: Slot, command: list[str], env: dict[str, str]) -> None:
        if slot.log is not None:
            slot.log.close()
        slot.log = (self.run_dir / f"{slot.name}.log").open("ab")
        slot.log.write(f"=== generation {slot.generation}: {' '.join(command)}\n".encode())
        slot.log.flush()
        slot.process = subprocess.Popen(
            command,
            cwd=self.run_dir,  # not the repository: PYTHONPATH alone decides which library is imported
            env=env,
            stdout=slot.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def worker_conf(self, slot: Slot) -> dict[str, Any]:
        """Slots that acknowledge late also requeue on a lost child; the others acknowledge early."""
        return {"task_acks_late": slot.acks_late, "task_reject_on_worker_lost": slot.acks_late}

    def pool_concurrency(self, slot: Slot) -> int:
        """``solo`` runs one body; ``threads`` and ``gevent`` twice as many as a prefork pool (siblings race)."""
        if slot.pool == "solo":
            return 1
        return self.concurrency * (2 if slot.pool in ("threads", "gevent") else 1)

    def start_worker(self, slot: Slot, *, same_name: bool = False) -> None:
        """Start the slot's next worker: under a new node name, or (``same_name``) under its current one."""
        slot.generation += 1
        if not same_name or not slot.node:
            slot.node = f"{slot.name}.{slot.generation}"
        command = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "chaos.app",
            "worker",
            "--pool",
            slot.pool,
            "--concurrency",
            str(self.pool_concurrency(slot)),
            "--loglevel",
            "INFO",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "--hostname",
            f"{slot.node}@%h",
        ]
        self._spawn(slot, command, self._env(slot, self.worker_conf(slot)))
        slot.expected_exit = False
        self.history.emit(
            "spawn",
            slot=slot.name,
            generation=slot.generation,
            process=slot.pid,
            node=slot.node,
            pool=slot.pool,
            acks_late=slot.acks_late,
        )

    def wait_ready(self, slot: Slot, timeout: float = 90.0) -> bool:
        """Until the worker logged ``ready.`` (False if it died or the time ran out)."""
        deadline = time.monotonic() + timeout
        marker = f"{slot.node}@"
        path = self.run_dir / f"{slot.name}.log"
        while time.monotonic() < deadline:
            text = path.read_text(errors="replace")
            tail = text[text.rfind(f"=== generation {slot.generation}:") :]
            if marker in tail and " ready." in tail:
                return True
            if not slot.alive:
                return False
            time.sleep(0.2)
        return False

    def start_producer(self, slot: Slot, *, skew: float = 0.0) -> None:
        slot.generation += 1
        command = [
            sys.executable,
            "-m",
            "chaos.workload",
            "--index",
            str(slot.index),
            "--seed",
            str(self.seed + 1 + slot.index + 1000 * (slot.generation - 1)),
            "--generation",
            str(slot.generation),
            "--skew",
            str(skew),
            "--keys",
            str(self.keys),
            *(("--modes", self.modes) if self.modes else ()),
        ]
        self._spawn(slot, command, self._env(slot))
        slot.expected_exit = False
        self.history.emit("spawn", slot=slot.name, generation=slot.generation, process=slot.pid, skew=skew)

    def kill(self, slot: Slot, why: str) -> list[int]:
        """SIGKILL the slot's whole process group; returns the pids, recorded (``kill``) just before."""
        pids = slot.pids()
        if slot.process is None:
            return pids
        slot.expected_exit = True
        self.history.emit("kill", slot=slot.name, pids=pids, why=why)
        signal_group(slot.pid, signal.SIGKILL)
        slot.process.wait()
        return pids

    def crashed(self) -> list[Slot]:
        """Worker slots whose worker died on its own (each reported once, as a ``crash`` event).

        Dead: its process exited although nothing here stopped it, or it
        logged ``Unrecoverable error`` (Celery then shuts the worker down, but
        a warm shutdown can wait on its pool for long). A worker still
        running after such an error is killed, so the slot can be refilled.
        """
        found = []
        for slot in self.worker_slots:
            if slot.process is None or slot.expected_exit:
                continue
            error, trace = last_error(self.run_dir / f"{slot.name}.log", slot.generation)
            if slot.alive and "Unrecoverable error" not in error:
                continue
            pids = slot.pids() or [slot.pid]
            self.history.emit("crash", slot=slot.name, pids=pids, status=slot.process.poll(), log=error, trace=trace)
            if slot.alive:
                self.kill(slot, "crashed: it logged an unrecoverable error")
            slot.expected_exit = True
            found.append(slot)
        return found

    def detach(self, slot: Slot) -> subprocess.Popen[bytes] | None:
        """Take the slot's worker out of it (the run no longer watches it), to start another in its place."""
        old, slot.process = slot.process, None
        return old

    def kill_detached(self, slot: Slot, process: subprocess.Popen[bytes], why: str) -> list[int]:
        """SIGKILL a detached worker's whole process group, recorded (``kill``) just before; returns the pids."""
        pids = group_pids(process.pid)
        if pids or process.poll() is None:
            self.history.emit("kill", slot=slot.name, pids=pids or [process.pid], why=why)
            signal_group(process.pid, signal.SIGKILL)
        process.wait()
        return pids

    def kill_pid(self, slot: Slot, pid: int, why: str) -> None:
        """SIGKILL one process of the slot (a pool child), recorded (``kill``) just before."""
        self.history.emit("kill", slot=slot.name, pids=[pid], why=why)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def stop_process(self, slot: Slot, *, grace: float) -> None:
        """SIGTERM (a graceful stop), then SIGKILL whatever is left after ``grace`` seconds."""
        if slot.process is None:
            return
        slot.expected_exit = True
        if slot.process.poll() is None and grace > 0:
            signal_group(slot.pid, signal.SIGCONT)
            signal_group(slot.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                slot.process.wait(grace)
        if slot.process.poll() is None or group_pids(slot.pid):
            self.kill(slot, "did not stop in time")
        slot.process.wait()
