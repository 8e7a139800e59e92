"""The nemesis: faults injected one after another, at random, from ``random.Random(seed)``.

Each fault is a method named after it; ``--faults`` picks which ones run.
Targets are chosen by index among what exists at that moment (worker slot,
pool child by pid order, a record from an index), so the same seed draws the
same schedule of faults; what they hit depends on the run's timing.

Every fault is recorded as a ``fault`` event when it begins (and, for faults
that last, ``fault_end`` when it is over); every process it kills first gets
a ``kill`` event naming its pids, so the checker knows when bodies died.
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery

import celery_dedup
from celery_dedup import limits, operations
from celery_dedup.exceptions import DedupError
from celery_dedup.keys import KeySchema, split_member
from celery_dedup.policy import check_rates, rates_text

from .app import LOCK_TTL, MODE_BY_TASK, QUOTA, QUOTA_KEYS
from .cluster import Cluster, Slot, group_pids, signal_group
from .history import History
from .proxy import SCRIPT_COMMANDS, Point

SCHEMA = KeySchema("dedup")
#: Producers given a skewed clock get one within this many seconds of the truth.
MAX_SKEW = 30.0
#: Signals ``revoke(terminate=True)`` is sent with.
REVOKE_SIGNALS = ("SIGTERM", "SIGKILL", "SIGUSR1", "SIGINT")
OPERATOR_ACTIONS = ("release", "purge", "reap", "requeue")

FAULTS = (
    "kill-child",
    "kill-worker",
    "restart-worker",
    "kill-producer",
    "stop-worker",
    "proxy",
    "slow-link",
    "restart",
    "revoke",
    "operator",
    "redeliver",
    "skew",
    "pause",
    "override",
)
#: What the ``override`` fault sets a key's (or the whole group's) values to: (concurrency, rate), None: kept.
OVERRIDES: tuple[tuple[int | None, tuple[str, ...] | None], ...] = (
    (1, None),
    (3, None),
    (None, ("2/s", "20/m")),
    (None, ("8/s", "60/m")),
    (1, ("2/s",)),
    (4, ("10/s", "100/m")),
)


class Nemesis:
    """Injects the chosen faults into a running :class:`Cluster` until stopped."""

    def __init__(self, cluster: Cluster, app: Celery, history: History, seed: int, faults: tuple[str, ...]) -> None:
        unknown = sorted(set(faults) - set(FAULTS))
        if unknown:
            raise ValueError(f"unknown faults {unknown}; choose from {', '.join(FAULTS)}")
        self.cluster = cluster
        self.app = app
        self.history = history
        self.rng = random.Random(seed)
        self.faults = tuple(fault for fault in FAULTS if fault in faults)
        self.stopped = threading.Event()
        self.count = 0
        self.ops = 0
        self.client = cluster.server.client()
        #: Records, locks and held keys: the broker's database, or the store's apart from it.
        self.store = cluster.store_client()
        self.skews: dict[int, float] = {}
        self._deck: list[str] = []
        #: Overrides and pauses of the named group not undone yet: (kind, key).
        self.changes: set[tuple[str, str | None]] = set()

    # --- the loop ---------------------------------------------------------------------------

    def draw(self) -> str:
        """The next fault: dealt from a shuffled deck of the chosen ones, so a short run still meets each."""
        if not self._deck:
            self._deck = list(self.faults)
            self.rng.shuffle(self._deck)
        return self._deck.pop()

    def run(self) -> None:
        """Fault after fault, with pauses between, until :meth:`stop`."""
        while self.faults and not self.stopped.wait(self.rng.uniform(0.5, 3.0)):
            fault = self.draw()
            method: Callable[[], None] = getattr(self, fault.replace("-", "_"))
            try:
                method()
            except (redis.RedisError, OSError, DedupError) as exc:
                self.history.emit("fault_error", kind=fault, error=f"{type(exc).__name__}: {exc}")

    def stop(self) -> None:
        self.stopped.set()

    def fault(self, kind: str, **fields: Any) -> None:
        self.count += 1
        self.history.emit("fault", kind=kind, **fields)

    def linger(self, low: float, high: float) -> None:
        """Sleep a drawn time (cut short by :meth:`stop`: a fault that lasts ends early then)."""
        self.stopped.wait(self.rng.uniform(low, high))

    def _slot(self, slots: list[Slot]) -> Slot:
        return slots[self.rng.randrange(len(slots))]

    def _busy_pids(self) -> set[int]:
        """Pids of the processes holding an execution lock now (a lock's token names its pid)."""
        pids = set()
        for key in self.store.scan_iter("dedup:lock:*", count=1000):
            token = _text(self.store.get(key) or b"")
            pid = token.split(":")[1] if token.count(":") >= 2 else ""
            if pid.isdigit():
                pids.add(int(pid))
        return pids

    def _target_worker(self, among: list[Slot] | None = None) -> Slot:
        """Mostly a worker (of ``among``) whose pool runs a body now (a fault there hits a live lock), else any."""
        slots = among or self.cluster.worker_slots
        prefer_busy = self.rng.random() < 0.8
        fallback = self._slot(slots)
        if prefer_busy:
            busy = self._busy_pids()
            candidates = [slot for slot in slots if busy.intersection(slot.body_pids())]
            if candidates:
                return candidates[self.rng.randrange(len(candidates))] if len(candidates) > 1 else candidates[0]
        return fallback

    # --- processes --------------------------------------------------------------------------

    def kill_child(self) -> None:
        """SIGKILL one prefork pool child (the task it runs dies mid-body); other pools have no children."""
        slot = self._target_worker()
        index = self.rng.randrange(self.cluster.concurrency)
        if slot.pool != "prefork":
            prefork = [s for s in self.cluster.worker_slots if s.pool == "prefork"]
            if not prefork:
                return
            slot = self._slot(prefork)
        children = slot.children()
        if not children:
            return
        busy = sorted(self._busy_pids().intersection(children))
        pid = busy[index % len(busy)] if busy else children[index % len(children)]
        self.fault("kill-child", slot=slot.name, pid=pid)
        self.cluster.kill_pid(slot, pid, "kill-child")

    def kill_worker(self) -> None:
        """SIGKILL a whole worker (main process and pool), then start a new one in its place."""
        slot = self._slot(self.cluster.worker_slots)
        down = self.rng.uniform(0.5, 2.0)
        self.fault("kill-worker", slot=slot.name)
        self.cluster.kill(slot, "kill-worker")
        self.linger(down, down)
        self.cluster.start_worker(slot)
        self.cluster.wait_ready(slot)
        self.history.emit("fault_end", kind="kill-worker", slot=slot.name)

    def restart_worker(self) -> None:
        """Restart a worker under its own node name while the old one still runs, then SIGKILL the old one.

        What systemd or Docker do with a worker slower to stop than their stop
        timeout, where the new worker keeps the node name and starts before
        the old one is gone: half the time the old one is stopped (SIGTERM, a
        warm shutdown that finishes its bodies) as the new one starts, else
        once the new one is ready; it is SIGKILLed after a stop timeout, with
        whatever it still runs. Mostly a late-acknowledging worker running a
        body: its runs are the ones a worker on this machine must put back.
        """
        late = [slot for slot in self.cluster.worker_slots if slot.acks_late]
        slot = self._target_worker(late if late and self.rng.random() < 0.8 else None)
        term_first = self.rng.random() < 0.5
        stop_timeout = self.rng.uniform(0.3, 1.5)
        old = self.cluster.detach(slot)
        if old is None or old.poll() is not None:
            slot.process = old
            return
        self.fault("restart-worker", slot=slot.name, node=slot.node, pids=group_pids(old.pid), term_first=term_first)
        signal_group(old.pid, signal.SIGCONT)
        try:
            if term_first:
                signal_group(old.pid, signal.SIGTERM)
            self.cluster.start_worker(slot, same_name=True)
            self.cluster.wait_ready(slot)
            if not term_first:
                signal_group(old.pid, signal.SIGTERM)
            self.linger(stop_timeout, stop_timeout)
        finally:
            self.cluster.kill_detached(slot, old, "restart-worker")
        self.history.emit("fault_end", kind="restart-worker", slot=slot.name)

    def kill_producer(self) -> None:
        """SIGKILL a producer; half the time frozen mid-publish, after the server ran its script."""
        slot = self._slot(self.cluster.producer_slots)
        mid_publish = self.rng.random() < 0.5
        fired = False
        if mid_publish:
            slot.store_link.arm("after", hold=True, commands=SCRIPT_COMMANDS)
            fired = slot.store_link.fired.wait(3.0)
        self.fault("kill-producer", slot=slot.name, mid_publish=mid_publish, frozen=fired)
        self.cluster.kill(slot, "kill-producer")
        slot.store_link.disarm()
        self.cluster.start_producer(slot, skew=self.skews.get(slot.index, 0.0))

    def stop_worker(self) -> None:
        """SIGSTOP a whole worker for longer than the lock TTL (a GC pause), then SIGCONT it."""
        slot = self._target_worker()
        if not slot.alive:
            return
        seconds = self.rng.uniform(LOCK_TTL + 1.0, LOCK_TTL + 5.0)
        self.fault("stop-worker", slot=slot.name, seconds=round(seconds, 2), pids=slot.pids())
        signal_group(slot.pid, signal.SIGSTOP)
        try:
            self.linger(seconds, seconds)
        finally:
            signal_group(slot.pid, signal.SIGCONT)
            self.history.emit("fault_end", kind="stop-worker", slot=slot.name)

    def skew(self) -> None:
        """Restart a producer on a clock up to ``MAX_SKEW`` seconds off."""
        slot = self._slot(self.cluster.producer_slots)
        skew = round(self.rng.uniform(-MAX_SKEW, MAX_SKEW), 1)
        self.skews[slot.index] = skew
        self.fault("skew", slot=slot.name, skew=skew)
        self.cluster.stop_process(slot, grace=5.0)
        self.cluster.start_producer(slot, skew=skew)

    # --- the network and the server ---------------------------------------------------------

    def proxy(self) -> None:
        """On one process's connections (or everyone's; to the broker and the store): delay replies, drop them,
        or reset connections."""
        everyone = self.rng.random() < 0.25
        slots = self.cluster.slots if everyone else [self._slot(self.cluster.slots)]
        action = self.rng.choice(("delay", "drop-reply", "drop-request", "reset"))
        target = "all" if everyone else slots[0].name
        if action == "delay":
            seconds, lasting = round(self.rng.uniform(0.05, 0.5), 3), self.rng.uniform(1.0, 4.0)
            self.fault("proxy", action=action, target=target, seconds=seconds)
            for proxy in (proxy for slot in slots for proxy in slot.proxies):
                proxy.delay(seconds)
            try:
                self.linger(lasting, lasting)
            finally:
                for proxy in (proxy for slot in slots for proxy in slot.proxies):
                    proxy.delay(0)
                self.history.emit("fault_end", kind="proxy", action=action, target=target)
        elif action in ("drop-reply", "drop-request"):
            times = self.rng.randint(1, 3)
            scripts_only = self.rng.random() < 0.7
            self.fault("proxy", action=action, target=target, times=times, scripts_only=scripts_only)
            point: Point = "after" if action == "drop-reply" else "before"
            for proxy in (proxy for slot in slots for proxy in slot.proxies):
                if scripts_only:
                    proxy.arm(point, times=times)
                else:
                    proxy.arm(point, times=times, commands=_ALL_COMMANDS)
            self.linger(1.0, 3.0)
            for proxy in (proxy for slot in slots for proxy in slot.proxies):
                proxy.disarm()
        else:
            self.fault("proxy", action=action, target=target)
            for proxy in (proxy for slot in slots for proxy in slot.proxies):
                proxy.reset()

    def slow_link(self) -> None:
        """A worker (mostly one running bodies) reaches the store over a slow link for a while.

        The link to the store (apart from the broker in a two-phase run, else
        the one link to both).
        Every reply to it comes 20 to 200 ms late, for 2 to 8 s: each step of a
        delivery (its group's slot, the guard, the notes it writes) takes that
        much longer, so what a sibling thread does meanwhile meets it half-way.
        Too short to let a lease renewed every third of its TTL expire.
        """
        slot = self._target_worker()
        seconds, lasting = round(self.rng.uniform(0.02, 0.2), 3), self.rng.uniform(2.0, 8.0)
        self.fault("slow-link", target=slot.name, seconds=seconds)
        slot.store_link.delay(seconds)
        try:
            self.linger(lasting, lasting)
        finally:
            slot.store_link.delay(0)
            self.history.emit("fault_end", kind="slow-link", target=slot.name)

    def restart(self) -> None:
        """Crash the server and start it again: from its append-only file, or (without persistence) empty."""
        wipe = not self.cluster.persistent or self.rng.random() < 1 / 3
        down = self.rng.uniform(0.3, 2.0)
        self.fault("restart", wipe=wipe, seconds=round(down, 2))
        self.cluster.server.crash(wipe=wipe)
        self.linger(down, down)
        self.cluster.server.start()
        self.history.emit("fault_end", kind="restart", wipe=wipe)

    # --- Celery and operators ---------------------------------------------------------------

    def _members(self, *states: str) -> list[str]:
        members: list[str] = []
        for state in states:
            members += [_text(m) for m in self.store.zrange(SCHEMA.state_index(state), 0, 200)]
        return sorted(m for m in members if split_member(m)[0] in MODE_BY_TASK)

    def _task_id(self, member: str) -> str:
        raw = self.store.hget(SCHEMA.record(member), "task_id")
        return _text(raw) if raw else ""

    def revoke(self) -> None:
        """``revoke`` a queued or running run, half the time with ``terminate=True`` and a drawn signal."""
        members = self._members("queued", "started", "retry")
        if not members:
            return
        member = members[self.rng.randrange(len(members))]
        terminate = self.rng.random() < 0.5
        sig = self.rng.choice(REVOKE_SIGNALS)
        task_id = self._task_id(member)
        if not task_id:
            return
        self.fault("revoke", member=member, task_id=task_id, terminate=terminate, signal=sig if terminate else None)
        self.app.control.revoke(task_id, terminate=terminate, signal=sig)

    def operator(self) -> None:
        """An operator's action from celery_dedup.operations: release, purge, reap or re-enqueue."""
        action = self.rng.choice(OPERATOR_ACTIONS)
        self.ops += 1
        if action == "purge":
            self.fault("operator", action=action)
            report = operations.purge(self.app, limit=50)
            self.history.emit("op", action=action, result=str(report))
        elif action == "reap":
            self.fault("operator", action=action)
            reaped = celery_dedup.reap(self.app)
            self.history.emit("op", action=action, result=str(reaped))
        elif action == "release":
            members = self._members("queued", "started", "retry", "pending", "lost", "succeeded")
            if not members:
                return
            member = members[self.rng.randrange(len(members))]
            # An operator who forces it was shown the lock's owner and deletes only that lock.
            force = self.rng.random() < 0.2
            token = (operations.detail(self.app, member).lock_token or "") if force else ""
            self.fault("operator", action=action, member=member, task_id=self._task_id(member), forced=bool(token))
            released = operations.release(self.app, member, force_token=token, by="chaos")
            self.history.emit("op", action=action, member=member, result=str(released))
        else:
            members = self._members(*operations.REQUEUE_STATES)
            if not members:
                return
            member = members[self.rng.randrange(len(members))]
            self.fault("operator", action=action, member=member)
            self.history.emit("call_start", call=f"requeue-{self.ops}", member=member, way="requeue")
            try:
                requeued = operations.requeue(self.app, member)
            except DedupError as exc:
                self.history.emit("op", action=action, member=member, result=f"refused: {exc}")
                return
            task = split_member(member)[0]
            spec = MODE_BY_TASK.get(task)
            outcome = "accepted" if not requeued.deduplicated else ("collapsed" if spec and spec.parks else "duplicate")
            self.history.emit(
                "call",
                call=f"requeue-{self.ops}",
                task=task,
                mode=spec.mode if spec else "",
                member=member,
                way="requeue",
                delay=0.0,
                outcome=outcome,
                id=requeued.task_id,
            )

    def redeliver(self) -> None:
        """Push a copy of a delivered, unacknowledged message back onto its queue (a manual re-push)."""
        tags = sorted(_text(tag) for tag in self.client.hkeys("unacked"))
        if not tags:
            return
        tag = tags[self.rng.randrange(len(tags))]
        raw = self.client.hget("unacked", tag)
        if raw is None:
            return
        message, _exchange, routing_key = json.loads(raw)
        task_id = (message.get("headers") or {}).get("id")
        self.fault("redeliver", task_id=task_id, queue=routing_key or "celery")
        self.client.lpush(routing_key or "celery", json.dumps(message))

    # --- a named group's operator ------------------------------------------------------------

    def _server_ms(self) -> int:
        seconds, micros = self.store.time()
        return int(seconds) * 1000 + int(micros) // 1000

    def _quota_key(self) -> str | None:
        """A tenant of the named group, or (one time in four) None: the whole group."""
        return None if self.rng.random() < 0.25 else QUOTA_KEYS[self.rng.randrange(len(QUOTA_KEYS))]

    def pause(self) -> None:
        """An operator pauses a tenant of the named group (or all of it) for a few seconds, then resumes it.

        Half the pauses end by themselves (``until``), half last until resumed. The ``fault`` and its
        ``fault_end`` give the server-clock interval each write happened in (``from_ms`` .. ``at_ms``).
        """
        key = self._quota_key()
        seconds = round(self.rng.uniform(1.0, 4.0), 2)
        until = seconds if self.rng.random() < 0.5 else None
        from_ms = self._server_ms()
        limits.pause(self.app, QUOTA, key, until=until, by="chaos")
        at_ms = self._server_ms()
        self.changes.add(("pause", key))
        self.fault("pause", group=QUOTA, key=key, until=until, from_ms=from_ms, at_ms=at_ms)
        try:
            self.linger(seconds, seconds + 0.5)
        finally:
            self._undo("pause", key)

    def override(self) -> None:
        """An operator lowers or raises a tenant's (or the whole group's) concurrency or windows for a while."""
        key = self._quota_key()
        concurrency, rate = OVERRIDES[self.rng.randrange(len(OVERRIDES))]
        from_ms = self._server_ms()
        limits.override(self.app, QUOTA, key, concurrency=concurrency, rate=None if rate is None else list(rate))
        at_ms = self._server_ms()
        self.changes.add(("override", key))
        rates = None if rate is None else rates_text(check_rates(list(rate)))
        self.fault("override", group=QUOTA, key=key, concurrency=concurrency, rates=rates, from_ms=from_ms, at_ms=at_ms)
        try:
            self.linger(2.0, 8.0)
        finally:
            self._undo("override", key)

    def _undo(self, kind: str, key: str | None) -> None:
        """Resume a pause or clear an override the nemesis made; recorded (``fault_end``) once it is done."""
        for attempt in range(5):
            try:
                from_ms = self._server_ms()
                if kind == "pause":
                    limits.resume(self.app, QUOTA, key, by="chaos")
                else:
                    limits.clear_override(self.app, QUOTA, key, by="chaos")
                at_ms = self._server_ms()
            except (redis.RedisError, OSError) as exc:
                self.history.emit("fault_error", kind=kind, error=f"{type(exc).__name__}: {exc}", attempt=attempt)
                time.sleep(0.5)
                continue
            self.changes.discard((kind, key))
            self.history.emit("fault_end", kind=kind, group=QUOTA, key=key, from_ms=from_ms, at_ms=at_ms)
            return

    # --- the end ----------------------------------------------------------------------------

    def heal(self) -> None:
        """Undo what lasts: every process running, every proxy clean, the server up."""
        for slot in self.cluster.slots:
            for proxy in slot.proxies:
                proxy.disarm()
                proxy.delay(0)
            if slot.alive:
                signal_group(slot.pid, signal.SIGCONT)
        if self.cluster.server.process.process is None or self.cluster.server.process.process.poll() is not None:
            self.cluster.server.start()
        for kind, key in sorted(self.changes, key=str):
            self._undo(kind, key)
        self.cluster.crashed()  # recorded before a new worker takes the slot
        for slot in self.cluster.worker_slots:
            if not slot.alive:
                self.cluster.start_worker(slot)
                self.cluster.wait_ready(slot)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


_ALL_COMMANDS = frozenset(
    {
        b"EVALSHA",
        b"EVAL",
        b"LPUSH",
        b"BRPOP",
        b"HSET",
        b"HDEL",
        b"HGETALL",
        b"HGET",
        b"ZADD",
        b"ZREM",
        b"GET",
        b"SET",
        b"PUBLISH",
        b"MULTI",
        b"EXEC",
        b"PING",
    }
)
