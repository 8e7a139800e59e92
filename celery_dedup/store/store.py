"""DedupStore: every read and write of dedup state, each a Lua script or a read, and what they return."""

from __future__ import annotations

import base64
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot

from ..exceptions import STORE_ERRORS, DedupArgumentError, DedupStoreFormatError
from ..keys import CLUSTER_SHARDS, KeySchema, split_member, task_namespace
from . import commands
from . import format as store_format
from .commands import ConfirmCode, GateCode, PeekCode, ReleaseCode, StartCode, StepBeginCode
from .scripts import Scripts
from .status import (
    ENDED_STATES,
    STATES,
    Status,
    StepStatus,
    history_of,
    is_history_field,
    step_order,
    steps_of,
)

logger = logging.getLogger("celery_dedup")


def storable(text: str) -> str:
    """``text`` as Redis can take it: a lone surrogate (JSON's ``"\\ud800"`` decodes to one) is escaped.

    Celery publishes such arguments; the UTF-8 that redis-py sends cannot
    hold them, so what celery-dedup records of them keeps ``\\ud800`` instead.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _text(value: Any) -> str:
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else str(value)


_POSITION = re.compile(r"([0-9]{1,20})~([A-Za-z0-9_-]+)")


def _cursor_at(score: float, member: bytes) -> str:
    """A records page's cursor: the position after which the next page starts, ``"<ms>~<member, base64url>"``."""
    return f"{int(score)}~{base64.urlsafe_b64encode(member).decode('ascii').rstrip('=')}"


def _position(cursor: str | None) -> tuple[int, str] | None:
    """The ``(score, member)`` a cursor of :func:`_cursor_at` names; None for the first page (None or ``"0"``)."""
    if not cursor or cursor == "0":
        return None
    found = _POSITION.fullmatch(cursor)
    if found is not None:
        encoded = found.group(2)
        try:
            member = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
        except ValueError:
            member = b""
        if member and _cursor_at(int(found.group(1)), member) == cursor:
            return int(found.group(1)), member.decode("utf-8", "surrogateescape")
    raise DedupArgumentError("cursor", cursor, "must be the cursor of a page, or 0 for the first")


@dataclass(frozen=True)
class StartDecision:
    """What the delivery guard decided for one delivery (see ``start.lua``)."""

    RUN, LOCKED, DONE, SUPERSEDED = StartCode.RUN, StartCode.LOCKED_SAME_RUN, StartCode.DONE, StartCode.SUPERSEDED
    LOCKED_BY_OTHER_RUN, FOLLOW = StartCode.LOCKED_OTHER, StartCode.FOLLOWER

    code: StartCode
    #: RUN: attempts; LOCKED*: the lock's remaining ms; DONE: the ending;
    #: SUPERSEDED: the owner run; FOLLOW: the followed run.
    detail: str
    #: RUN: the payload a debounced run executes with (asked for, and
    #: present); FOLLOW: the followed run's outcome (JSON); else "".
    payload: str = ""
    #: LOCKED*: the token of the lock that refused this delivery; else "".
    holder: str = ""

    @property
    def run(self) -> bool:
        return self.code == self.RUN


#: The name of :class:`~celery_dedup.store.status.Status` before it was typed (same attributes, and more).
Record = Status


@dataclass(frozen=True)
class Page:
    """One page of records, newest update first (key order for a prefix search)."""

    records: list[Status]
    #: Pass back as ``cursor`` for the next page; None on the last page.
    cursor: str | None
    #: Entries in the index the page was read from (an upper bound on matches).
    total: int


@dataclass(frozen=True)
class ReapReport:
    """What one reaper call did."""

    released: int
    lost: int
    stale: int
    #: Queued runs whose message the transport lost after fetching it.
    vanished: int = 0
    #: ``(member, task id, why)`` of each run this call marked lost.
    runs: tuple[tuple[str, str, str], ...] = ()


@dataclass(frozen=True)
class Outcome:
    """What the gate decided: ``task_id`` is the accepted run's id either way."""

    accepted: bool
    task_id: str
    #: Not accepted, but joined the accepted run's burst (debounce): its
    #: arguments may be the ones that run.
    collapsed: bool = False
    #: Not accepted, but parked as a follower of the accepted run: its own
    #: message is delivered once that run ends, and resolves as it ended.
    followed: bool = False
    #: Not accepted, and not parked: the run has ``dedup_max_followers`` already.
    refused: bool = False
    #: Not accepted: the arguments fingerprint of run ``task_id`` ("" when it has none, see ``dedup_on_mismatch``).
    fingerprint: str = ""

    def mismatches(self, fingerprint: str) -> bool:
        """Whether a call with arguments fingerprint ``fingerprint`` was answered with a run of other arguments.

        Only where both have a fingerprint: a call or a run that was not
        fingerprinted is never a mismatch.
        """
        return not self.accepted and bool(fingerprint and self.fingerprint) and fingerprint != self.fingerprint


@dataclass(frozen=True)
class GateCall:
    """One prepared run of the gate script."""

    keys: list[str]
    command: commands.Gate


def _outcome(reply: Sequence[Any]) -> Outcome:
    """The gate's reply (see ``gate.lua``) as an Outcome."""
    code = GateCode(int(reply[0]))
    follower = code == GateCode.FOLLOWER
    return Outcome(
        accepted=code in (GateCode.ACCEPTED, GateCode.NOTHING_TO_PUSH),
        task_id=_text(reply[1]),
        collapsed=code == GateCode.JOINED or (follower and len(reply) > 3 and int(reply[3]) == 1),
        followed=follower,
        refused=code == GateCode.REFUSED,
        fingerprint=_text(reply[2]) if len(reply) > 2 else "",
    )


@dataclass(frozen=True)
class Dispatch:
    """What one dispatcher call did."""

    pushed: int
    #: Seconds until the next parked run is due; None when none is parked.
    next_due: float | None


@dataclass(frozen=True)
class ReleaseResult:
    """What an operator's release of a key did (see ``release.lua``)."""

    REFUSED_LOCKED, RELEASED = ReleaseCode.REFUSED_LOCKED, ReleaseCode.RELEASED
    REFUSED_LOCK_CHANGED, NOTHING = ReleaseCode.REFUSED_LOCK_CHANGED, ReleaseCode.NOTHING

    code: ReleaseCode
    #: RELEASED: the record's state now ("" without a record); REFUSED_LOCKED:
    #: the lock's remaining ms; REFUSED_LOCK_CHANGED: the lock's current token;
    #: NOTHING (neither the key nor a lock was held): the record's state, or "".
    detail: str
    #: Whether the key was in the held set.
    was_held: bool = False
    #: Whether a live execution lock was deleted.
    forced: bool = False

    @property
    def released(self) -> bool:
        return self.code == self.RELEASED


@dataclass(frozen=True)
class PurgeReport:
    """What one purge call did."""

    purged: int
    #: Ended records kept because their key is held or their lock is alive.
    kept: int
    #: True when the budget ran out first: call again for the rest.
    more: bool


@dataclass(frozen=True)
class KeyDetail:
    """Everything about one member, read in one round trip."""

    member: str
    record: dict[str, str] | None
    history: list[str]
    held: bool
    #: The execution lock's owner token, None when no lock is alive.
    lock_token: str | None
    #: The lock's remaining time, ms (0 without a lock).
    lock_ttl_ms: int
    #: The steps kept for the key: its run's (``dedup_once``), then its key's (``scope="key"``).
    steps: tuple[StepStatus, ...] = ()

    @property
    def status(self) -> Status | None:
        """The record with its history as typed values, or None without a record."""
        if self.record is None:
            return None
        # ``history`` holds the record's own entries already, merged with format 1's list.
        fields = {name: value for name, value in self.record.items() if not is_history_field(name)}
        return Status.from_record(self.member, fields, self.history)


@dataclass(frozen=True)
class IndexSizes:
    """Entries per index: all records, and per state."""

    total: int
    states: dict[str, int]


@dataclass
class BackendResult:
    """A result as Celery's Redis backend writes it: key, encoded value, expiry in seconds (0: none)."""

    key: bytes | str
    value: bytes | str
    expires: int
    #: Set once :meth:`DedupStore.finish` has written it.
    written: bool = False


class Finished(NamedTuple):
    """What recording a run's ending did (see ``finish.lua``)."""

    #: The record named this run.
    owned: bool
    #: A ``"run"`` caller still held its lock (False: it was lost meanwhile).
    lock_kept: bool
    #: The run succeeded and has followers waiting for its return value: call :meth:`DedupStore.settle`.
    wants_result: bool


def _finished(reply: Sequence[Any]) -> Finished:
    owned, lock_kept, wants_result = reply
    return Finished(bool(owned), bool(lock_kept), bool(wants_result))


@dataclass(frozen=True)
class LockRef:
    """One held execution lock, as the renewer sees it."""

    lock_key: str
    record_key: str
    token: str


@dataclass(frozen=True)
class StepRef:
    """The keys of one delivery's steps, as the renewer sees them, and the delivery's token."""

    lock_key: str
    record_key: str
    #: The key's steps (``scope="key"``).
    steps_key: str
    #: The run's steps.
    run_steps_key: str
    token: str

    @property
    def keys(self) -> tuple[str, str, str, str]:
        """The step scripts' KEYS."""
        return self.lock_key, self.record_key, self.steps_key, self.run_steps_key


@dataclass(frozen=True)
class StepBegun:
    """What ``step_begin.lua`` decided for one step of one delivery."""

    code: StepBeginCode
    #: RUN, RUN_AGAIN, IN_DOUBT: the step's attempts; DONE: its stored result; BUSY: the other lock's ms left.
    detail: str
    #: BUSY: the token of the delivery whose step lock is alive; else "".
    holder: str = ""


class StepEnded(NamedTuple):
    """What recording a step's ending did (``step_end.lua``)."""

    #: The ending was recorded: the step's entry still named this delivery (nobody took the step over).
    recorded: bool
    #: The delivery still held the execution lock.
    lock_kept: bool


#: The longest a decision waits for its replicas on a Redis Cluster (see ``DedupStore._replicated``), ms.
WAIT_MS = 100

#: A store that could not be reached for its format check is tried again after this many seconds.
FORMAT_RETRY = 5.0

#: Cursors beyond this read from here: past any index, and within the range Redis takes.
_MAX_OFFSET = 2**62


class DedupStore:
    """Dedup state for one key prefix on one Redis server.

    Methods that run on the publish path take an optional ``client`` so the
    broker transport can run the same scripts on its own connection pool.
    """

    def __init__(
        self,
        client: redis.Redis,
        prefix: str,
        scripts: Scripts | None = None,
        *,
        history_length: int = 10,
        shards: int | None = None,
        wait_replicas: int = 0,
    ) -> None:
        self.client = client
        if shards is None:
            shards = CLUSTER_SHARDS if isinstance(client, RedisCluster) else 1
        #: The store's keys; on a Redis Cluster in ``shards`` hash-tagged shards (see KeySchema).
        self.schema = KeySchema(prefix, shards)
        self.scripts = scripts or Scripts(client)
        self.history_length = history_length
        #: On a Redis Cluster: replicas that must have a decision's writes before it is answered.
        self.wait_replicas = wait_replicas if isinstance(client, RedisCluster) else 0
        #: How the store's format stood when this object first checked it (None: not checked yet).
        self.format_state: store_format.FormatState | None = None
        self._format_tried = -FORMAT_RETRY
        self._format_error: DedupStoreFormatError | None = None

    def check_format(self, app_name: str | None = None) -> store_format.FormatState | None:
        """Check the store's format once for this object (see ``format.py``): a new store is marked,
        format 1's leftovers are warned of, a newer format is refused.

        A store that cannot be reached is checked again on a later call, at most every
        :data:`FORMAT_RETRY` seconds; None until then.

        Raises:
            DedupStoreFormatError: the store's format is newer than this release reads.
        """
        if self._format_error is not None:
            raise self._format_error
        if self.format_state is None and time.monotonic() - self._format_tried >= FORMAT_RETRY:
            self._format_tried = time.monotonic()
            try:
                self.format_state = store_format.check(self, app_name)
            except STORE_ERRORS as exc:
                logger.debug("dedup store format not checked: %s", exc)
            except DedupStoreFormatError as exc:
                self._format_error = exc  # refused for good: this release cannot read the store
                raise
        return self.format_state

    def with_prefix(self, prefix: str) -> DedupStore:
        """The same server and scripts under another key prefix (a message's own)."""
        if prefix == self.schema.prefix:
            return self
        return DedupStore(
            self.client,
            prefix,
            self.scripts,
            history_length=self.history_length,
            shards=self.schema.shards,
            wait_replicas=self.wait_replicas,
        )

    def _replicated(self, key: str) -> None:
        """Wait until ``wait_replicas`` replicas of ``key``'s master have its writes (at most ``WAIT_MS``).

        Redis replicates asynchronously: a decision a master answered and
        lost in a failover before any replica had it would be undone on the
        promoted replica, and a second run of its key could be accepted. A
        degraded cluster (fewer replicas in sync) answers after ``WAIT_MS``,
        with a warning.
        """
        if not self.wait_replicas:
            return
        cluster = cast(RedisCluster, self.client)
        node = cluster.get_node_from_key(key)  # type: ignore[no-untyped-call]
        wait = ("WAIT", self.wait_replicas, WAIT_MS)
        acked = int(cluster.execute_command(*wait, target_nodes=node))  # type: ignore[no-untyped-call]
        if acked < self.wait_replicas:
            logger.warning(
                "dedup store: %d of %d replicas of %s acknowledged a decision within %d ms",
                acked,
                self.wait_replicas,
                node.name,
                WAIT_MS,
            )

    def _at(self, member: str) -> KeySchema:
        """The key names of ``member``'s shard (the store's own, on a single server)."""
        return self.schema.shard_of(member)

    def gate_call(
        self,
        member: str,
        task_id: str,
        nonce: str,
        *,
        hold_ms: int,
        grace_ms: int,
        argsrepr: str = "",
        kwargsrepr: str = "",
        queue: str | None = None,
        message: str | None = None,
        expire: Sequence[str] = (),
        expires_ms: int | None = None,
        delivery_tag: str = "",
        unacked_key: str = "",
        payload: str = "",
        debounce: tuple[int, int, bool] | None = None,
        continues: bool = False,
        defers: bool = False,
        follow: int = 0,
        lease_ms: int = 0,
        fingerprint: str = "",
    ) -> GateCall:
        """The gate script's keys and arguments: hold ``member`` for ``task_id``, push ``message`` onto ``queue``.

        Without a queue it only holds the key: the two-phase gate, for a
        broker apart from the store, holds a new run for ``lease_ms`` in state
        ``publishing`` until :meth:`confirm` (0: no lease, the full hold).
        ``debounce`` is ``(window_ms, max_wait_ms, latest)``: the message is
        parked until due instead of pushed, and calls while held join its run.
        ``continues``: the publish continues run ``task_id`` (a retry, a
        deferred copy) instead of being a call that names it; ``defers``: it
        is a deferred copy, which does not hold a key its run freed as it
        started. ``follow``: as
        a duplicate, park the message as one of at most this many followers
        of the accepted run (0: the call has nothing to continue).
        ``fingerprint``: the call's arguments fingerprint, kept by a new run
        and compared by a duplicate ("" for neither); a duplicate's
        :class:`Outcome` carries the accepted run's.
        """
        at = self._at(member)
        keys = [at.held, at.record(member)]
        if queue is None:  # what goes with a message is left out with it
            message, expires_ms, delivery_tag, unacked_key, payload, debounce = "", None, "", "", "", None
        else:
            keys += [queue, *expire]
        window_ms, max_wait_ms, latest = debounce or (0, 0, False)
        command = commands.Gate(
            member=member,
            task_id=task_id,
            nonce=nonce,
            hold_ms=hold_ms,
            grace_ms=grace_ms,
            prefix=at.prefix,
            history_len=self.history_length,
            argsrepr=storable(argsrepr),
            kwargsrepr=storable(kwargsrepr),
            continuation="2" if defers else "1" if continues else "0",
            max_followers=follow,
            lease_ms=lease_ms,
            message=message or "",
            expires_ms="" if expires_ms is None else expires_ms,
            tag=delivery_tag,
            unacked=unacked_key,
            payload=payload,
            window_ms=window_ms,
            max_wait_ms=max_wait_ms,
            latest="1" if latest else "0",
            args_fp=fingerprint,
        )
        return GateCall(keys, command)

    def gate(
        self, member: str, task_id: str, nonce: str, *, client: redis.Redis | None = None, **fields: Any
    ) -> Outcome:
        """Run the gate once (one round trip); ``fields`` as for :meth:`gate_call`."""
        return self.run_gate(self.gate_call(member, task_id, nonce, **fields), client=client)

    def run_gate(self, call: GateCall, *, client: redis.Redis | None = None) -> Outcome:
        """Run one prepared gate call (one round trip)."""
        outcome = _outcome(self.scripts.run(call.keys, call.command, client=client or self.client))
        if outcome.accepted:  # a duplicate's answer changes nothing a lost write could undo
            self._replicated(call.keys[1])
        return outcome

    def confirm(self, member: str, task_id: str, nonce: str, *, hold_ms: int, grace_ms: int) -> Outcome:
        """Second step of the two-phase gate: the broker took run ``task_id``'s message.

        The key gets its full hold. ``Outcome.accepted`` is False only when
        the lease ended and the key passed to another run (``task_id`` names
        it, "" if none) before this run began, which then stands for this
        call: see ``confirm.lua``.
        """
        at = self._at(member)
        command = commands.Confirm(
            member=member,
            task_id=task_id,
            nonce=nonce,
            hold_ms=hold_ms,
            grace_ms=grace_ms,
            prefix=at.prefix,
            history_len=self.history_length,
        )
        code, owner = self.scripts.run([at.held, at.record(member)], command)
        self._replicated(at.record(member))
        return Outcome(ConfirmCode(int(code)) != ConfirmCode.PASSED, _text(owner))

    def stats(self) -> dict[str, dict[str, int]]:
        """Decision counters: escaped task name -> decision -> count (see lib.lua's ``count``)."""
        found: dict[str, dict[str, int]] = {}
        for shard in self._each_shard(lambda pipe, at: pipe.hgetall(at.stats)):
            for field, value in shard.items():
                namespace, _, decision = _text(field).rpartition(":")
                counts = found.setdefault(namespace, {})
                counts[decision] = counts.get(decision, 0) + int(value)
        return found

    def _each_shard(self, command: Callable[[Any, KeySchema], Any]) -> list[Any]:
        """``command(pipe, shard)`` for every shard, in one pipeline; the replies in shard order."""
        with self.client.pipeline(transaction=False) as pipe:
            for at in self.schema.shards_all():
                command(pipe, at)
            return list(pipe.execute())

    def count(self, task_name: str, decision: str, amount: int = 1) -> None:
        """Add to a decision counter from Python (for decisions made without Redis: fail_open)."""
        field = f"{task_namespace(task_name)}:{decision}"
        self.client.hincrby(self.schema.shard_of(field).stats, field, amount)

    def peek(self, member: str, fingerprint: str = "") -> Outcome | None:
        """A duplicate's outcome if ``member`` is held (its duplicate counter incremented), or None if it is free.

        ``fingerprint``: the call's arguments fingerprint, compared with the
        run's as the gate compares it; the outcome carries the run's.
        """
        at = self._at(member)
        command = commands.Peek(member=member, prefix=at.prefix, args_fp=fingerprint)
        reply = self.scripts.run([at.held, at.record(member)], command)
        if PeekCode(int(reply[0])) != PeekCode.DUPLICATE:
            return None
        return Outcome(False, _text(reply[1]), fingerprint=_text(reply[2]))

    def gate_many(self, chunks: Iterable[Sequence[GateCall]], *, client: redis.Redis | None = None) -> list[Outcome]:
        """Run gate calls chunk by chunk on one connection; each call is atomic on its own.

        A chunk is sent before the previous chunk's replies are read, so the
        server runs one chunk while the caller builds the next (``chunks``
        may be a generator). One extra round trip makes sure the script is
        loaded. On an error the connection is dropped: which calls of the
        chunks in flight ran is unknown (their records' nonces tell).
        """
        client = client or self.client
        sha = client.script_load(self.scripts.gate.script)
        pool = client.connection_pool
        connection = pool.get_connection()
        outcomes: list[Outcome] = []
        unread = 0
        try:
            for chunk in chunks:
                sent = [("EVALSHA", sha, len(call.keys), *call.keys, *call.command) for call in chunk]
                packed = connection.pack_commands(sent)  # type: ignore[no-untyped-call]
                connection.send_packed_command(packed)  # type: ignore[no-untyped-call]
                outcomes += [_outcome(connection.read_response()) for _ in range(unread)]
                unread = len(sent)
            outcomes += [_outcome(connection.read_response()) for _ in range(unread)]
        except BaseException:
            connection.disconnect()  # type: ignore[no-untyped-call]
            raise
        finally:
            pool.release(connection)
        return outcomes

    def start(
        self,
        member: str,
        task_id: str,
        token: str,
        *,
        lock_ms: int,
        gated: bool,
        key_mode: str,
        hostname: str,
        pid: int,
        retries: int,
        record_ms: int,
        want_payload: bool = False,
        on_locked: str = "skip",
        keep_payload: bool = True,
        main: str = "",
        delivery: tuple[str, str] = ("", ""),
    ) -> StartDecision:
        """The delivery guard: may this delivery run? If so the lock is taken (one round trip).

        ``keep_payload=False`` deletes the record's payload once the delivery runs.
        ``main``: the token of the main process of the worker that delivered
        it (see ``recovery.py``), "" where unknown. ``delivery``: its message's
        delivery tag and kombu's unacknowledged hash (``recovery.delivery``),
        recorded where the gate recorded none.
        """
        at = self._at(member)
        keys = [at.held, at.record(member), at.lock(member)]
        command = commands.Start(
            member=member,
            task_id=task_id,
            token=token,
            lock_ms=lock_ms,
            gated="1" if gated else "0",
            key_mode=key_mode,
            hostname=hostname,
            pid=pid,
            retries=retries,
            prefix=at.prefix,
            history_len=self.history_length,
            record_ms=record_ms,
            want_payload="1" if want_payload else "0",
            on_locked=on_locked,
            keep_payload="1" if keep_payload else "0",
            main=main,
            tag=delivery[0],
            unacked=delivery[1],
        )
        reply = self.scripts.run(keys, command)
        code = StartCode(int(reply[0]))
        if code == StartCode.RUN:  # a refusal takes nothing a lost write could give back
            self._replicated(keys[1])
        third = _text(reply[2]) if len(reply) > 2 else ""
        if code in (StartCode.LOCKED_SAME_RUN, StartCode.LOCKED_OTHER):
            return StartDecision(code, _text(reply[1]), holder=third)
        return StartDecision(code, _text(reply[1]), third)

    def take_over(self, member: str, dead: str, *, refused: str) -> bool:
        """Free ``member``'s lock if it still holds ``dead``, a token whose process is provably gone.

        ``refused``: the decision the refused start counted ("deferred" or
        "skipped"), uncounted here. See ``takeover.lua``.
        """
        at = self._at(member)
        command = commands.Takeover(
            member=member, dead=dead, prefix=at.prefix, history_len=self.history_length, refused=refused
        )
        return bool(self.scripts.run([at.record(member), at.lock(member)], command))

    def finish(
        self,
        member: str,
        task_id: str,
        state: str,
        *,
        drop: bool,
        record_ms: int,
        role: str,
        token: str = "",
        error: str = "",
        payload: str = "",
        note: str = "",
        result: str = "",
        backend_result: BackendResult | None = None,
    ) -> Finished:
        """Record ``state`` for the run ``task_id``, release the lock ``token``, drop its key if ``drop``.

        ``role`` says who calls (see ``finish.lua``): ``"run"``, the delivery
        that ran the body with its own token; ``"report"``, an ending reported
        from outside the body (``token``: a lock whose process is gone, or "");
        ``"stop"``, a report of a delivery being stopped, which keeps its lock
        and key until it is through. ``result``: the run's return value, kept
        for its followers (see :class:`Finished`). ``backend_result``: the
        result Celery's Redis backend would write next, written by the same
        script after the ending (the backend must be on this server).
        An ending sent again after its reply was lost is not recorded twice
        (the lock it released the first time then reads as lost).
        """
        keys, command = self._finish_call(
            member, task_id, state, drop, record_ms, role, token, error, payload, note, result, backend_result
        )
        finished = _finished(self.scripts.run(keys, command))
        if backend_result is not None:
            backend_result.written = True
        return finished

    @property
    def sends(self) -> bool:
        """Whether :meth:`send_finish` writes without waiting: a single server, no replica to wait for."""
        return isinstance(self.client, redis.Redis) and not self.wait_replicas

    def send_finish(
        self,
        then: Callable[[Finished | redis.RedisError], None],
        member: str,
        task_id: str,
        state: str,
        *,
        drop: bool,
        record_ms: int,
        role: str,
        token: str = "",
        error: str = "",
        payload: str = "",
        note: str = "",
        result: str = "",
    ) -> None:
        """:meth:`finish`, written to the server now; ``then`` gets what it did once its reply is read.

        The reply is read before this thread's next store call, or at the end
        of the task's trace (:func:`~.scripts.read_sent`). ``then`` gets a
        ``redis.RedisError`` where the ending may not be recorded (the
        connection failed: recording it again is safe). Where the store
        cannot send without waiting (:attr:`sends`), ``then`` is called before
        this returns.
        """
        keys, command = self._finish_call(
            member, task_id, state, drop, record_ms, role, token, error, payload, note, result, None
        )
        if not self.sends:
            try:
                finished: Finished | redis.RedisError = _finished(self.scripts.run(keys, command))
            except redis.RedisError as exc:
                finished = exc
            then(finished)
            return

        def decoded(reply: Any) -> None:
            then(reply if isinstance(reply, redis.RedisError) else _finished(reply))

        self.scripts.send(keys, command, decoded, client=self.client)

    def _finish_call(
        self,
        member: str,
        task_id: str,
        state: str,
        drop: bool,
        record_ms: int,
        role: str,
        token: str,
        error: str,
        payload: str,
        note: str,
        result: str,
        backend_result: BackendResult | None,
    ) -> tuple[list[Any], commands.Finish]:
        at = self._at(member)
        keys: list[Any] = [at.held, at.record(member), at.lock(member)]
        if backend_result is not None:
            keys.append(backend_result.key)
        command = commands.Finish(
            member=member,
            task_id=task_id,
            state=state,
            drop="1" if drop else "0",
            record_ms=record_ms,
            token=token,
            prefix=at.prefix,
            history_len=self.history_length,
            err=storable(error),
            payload=payload,
            role=role,
            note=storable(note),
            result=result,
            result_value="" if backend_result is None else backend_result.value,
            result_expires=0 if backend_result is None else backend_result.expires,
        )
        return keys, command

    def settle(
        self, member: str, run_id: str, *, result: str, unkept: str = "", record_ms: int, state: str = "succeeded"
    ) -> int:
        """Give a run's followers how it ended (a success: its return value) and release them (see ``settle.lua``).

        ``unkept``: why a success's value could not be kept, or the error the run ended with.
        """
        at = self._at(member)
        command = commands.Settle(
            member=member,
            run=run_id,
            result=result,
            unkept=storable(unkept),
            prefix=at.prefix,
            ttl_ms=record_ms,
            state=state,
        )
        return int(self.scripts.run([at.followers(member)], command))

    def is_follower(self, member: str, run_id: str) -> bool:
        """Whether run ``run_id`` is parked as a follower of ``member``'s run (``gate.lua`` parks them)."""
        return bool(self.client.hexists(self._at(member).followers(member), run_id))

    def unclaim(self, member: str, task_id: str) -> bool:
        """Undo a hold whose message was never published (owner only, and only before its run began)."""
        return self.finish(member, task_id, "", drop=True, record_ms=0, role="report").owned

    def renew(self, locks: Sequence[LockRef], *, lock_ms: int, record_ms: int) -> list[LockRef]:
        """Extend every lock in one call; returns the ones no longer held by their token."""
        if self.schema.shards > 1:  # one call per slot: a script's keys share one
            by_slot: dict[int, list[LockRef]] = {}
            for ref in locks:
                by_slot.setdefault(key_slot(ref.lock_key.encode("utf-8", "surrogatepass")), []).append(ref)
            return [ref for group in by_slot.values() for ref in self._renew(group, lock_ms, record_ms)]
        return self._renew(locks, lock_ms, record_ms)

    def _renew(self, locks: Sequence[LockRef], lock_ms: int, record_ms: int) -> list[LockRef]:
        if not locks:
            return []
        keys = [k for ref in locks for k in (ref.lock_key, ref.record_key)]
        command = commands.Renew(lock_ms=lock_ms, record_ms=record_ms, tokens=tuple(ref.token for ref in locks))
        lost = self.scripts.run(keys, command)
        return [locks[int(i) - 1] for i in lost]

    # -- steps inside a body (worker/steps.py) -------------------------------------------------

    def step_ref(self, member: str, run_id: str, token: str) -> StepRef:
        at = self._at(member)
        return StepRef(at.lock(member), at.record(member), at.steps(member), at.run_steps(member, run_id), token)

    def step_begin(
        self,
        member: str,
        run_id: str,
        token: str,
        field: str,
        name: str,
        *,
        lock_ms: int,
        record_ms: int,
        on_doubt: str,
        dead: str = "",
    ) -> StepBegun:
        """May the delivery holding lock ``token`` execute step ``field`` of run ``run_id``? (``step_begin.lua``)

        If so it holds the step's lock now. ``dead``: a step lock's token whose process is provably gone.
        """
        ref = self.step_ref(member, run_id, token)
        command = commands.StepBegin(
            run=run_id,
            token=token,
            field=field,
            name=name,
            lock_ms=lock_ms,
            record_ms=record_ms,
            history_len=self.history_length,
            on_doubt=on_doubt,
            dead=dead,
        )
        reply = self.scripts.run(ref.keys, command)
        code = StepBeginCode(int(reply[0]))
        if code in (StepBeginCode.RUN, StepBeginCode.RUN_AGAIN, StepBeginCode.IN_DOUBT):
            self._replicated(ref.steps_key)
        detail = _text(reply[1]) if len(reply) > 1 else ""
        return StepBegun(code, detail, _text(reply[2]) if len(reply) > 2 else "")

    def step_end(
        self,
        member: str,
        run_id: str,
        token: str,
        field: str,
        name: str,
        *,
        result: str = "",
        error: str = "",
        lock_ms: int,
        record_ms: int,
    ) -> StepEnded:
        """Record that step ``field`` ended, done with ``result`` or failed with ``error`` (``step_end.lua``).

        Only while the step's entry names ``token``: see :class:`StepEnded`.
        """
        ref = self.step_ref(member, run_id, token)
        command = commands.StepEnd(
            run=run_id,
            token=token,
            field=field,
            name=name,
            outcome="failed" if error else "done",
            result=result,
            err=storable(error),
            lock_ms=lock_ms,
            record_ms=record_ms,
            history_len=self.history_length,
        )
        recorded, lock_kept = self.scripts.run(ref.keys, command)
        if recorded:
            self._replicated(ref.steps_key)
        return StepEnded(bool(recorded), bool(lock_kept))

    def renew_steps(
        self, leases: Sequence[tuple[StepRef, str]], *, lock_ms: int, record_ms: int
    ) -> list[tuple[StepRef, str]]:
        """Extend the step lock (field, "" for none) and the steps of every lease in one call; returns those lost."""
        if self.schema.shards > 1:  # one call per slot: a script's keys share one
            by_slot: dict[int, list[tuple[StepRef, str]]] = {}
            for lease in leases:
                by_slot.setdefault(key_slot(lease[0].lock_key.encode("utf-8", "surrogatepass")), []).append(lease)
            return [lease for group in by_slot.values() for lease in self._renew_steps(group, lock_ms, record_ms)]
        return self._renew_steps(leases, lock_ms, record_ms)

    def _renew_steps(
        self, leases: Sequence[tuple[StepRef, str]], lock_ms: int, record_ms: int
    ) -> list[tuple[StepRef, str]]:
        if not leases:
            return []
        keys = [key for ref, _ in leases for key in ref.keys]
        flat = tuple(value for ref, field in leases for value in (ref.token, field))
        lost = self.scripts.run(keys, commands.StepRenew(lock_ms=lock_ms, record_ms=record_ms, leases=flat))
        return [leases[int(i) - 1] for i in lost]

    def steps(self, member: str) -> tuple[StepStatus, ...]:
        """The steps the store keeps for ``member``: its record's run's, then its key's, as of the server's clock
        now (a later run's steps hide no earlier run's, which stay in their own hashes)."""
        at = self._at(member)
        run = self.client.hget(at.record(member), "task_id")
        return self._steps(member, None if run is None else _text(run), self.client.hgetall(at.steps(member)))

    def _steps(self, member: str, run: str | None, raw_key: Mapping[Any, Any]) -> tuple[StepStatus, ...]:
        """The steps of the key's hash ``raw_key`` and of run ``run``'s (read here), its own first."""
        raw_run = self.client.hgetall(self._at(member).run_steps(member, run)) if run is not None else {}
        if not raw_key and not raw_run:
            return ()
        now_ms = self._server_ms(member)
        found = steps_of(member, {_text(k): _text(v) for k, v in raw_key.items()}, now_ms)
        if raw_run:
            assert run is not None
            found += steps_of(member, {_text(k): _text(v) for k, v in raw_run.items()}, now_ms, run=run)
        return tuple(sorted(found, key=step_order))

    def _server_ms(self, member: str) -> int:
        """The server's clock (ms), on the server that holds ``member``'s keys."""
        if isinstance(self.client, RedisCluster):
            node = self.client.get_node_from_key(self._at(member).held)
            seconds, micros = self.client.execute_command("TIME", target_nodes=node)
        else:
            seconds, micros = self.client.time()
        return int(seconds) * 1000 + int(micros) // 1000

    def lock_holder(self, member: str) -> str | None:
        """The token of ``member``'s live execution lock, or None."""
        token = self.client.get(self._at(member).lock(member))
        return None if token is None else _text(token)

    def lock_ref(self, member: str, token: str) -> LockRef:
        return LockRef(self._at(member).lock(member), self._at(member).record(member), token)

    def record(self, member: str) -> dict[str, str] | None:
        """The member's status record, or None if there is none."""
        raw = self.client.hgetall(self._at(member).record(member))
        return {_text(k): _text(v) for k, v in raw.items()} or None

    def status(self, member: str) -> Status | None:
        """The member's record and history as a :class:`Status` (one round trip), or None without a record."""
        fields, listed = self._record_and_old_history(member)
        return Status.from_record(member, fields, listed) if fields else None

    def history(self, member: str) -> list[str]:
        """The member's recent transitions, newest first: ``"<ms> <state> <task id> [note]"``."""
        fields, listed = self._record_and_old_history(member)
        return [entry.text() for entry in history_of(fields, listed)]

    def _record_and_old_history(self, member: str) -> tuple[dict[str, str], list[str]]:
        """The record's fields and format 1's history list of the member (a rolling upgrade's), in one round trip."""
        at = self._at(member)
        with self.client.pipeline(transaction=True) as pipe:
            pipe.hgetall(at.record(member))
            pipe.lrange(store_format.old_history(at, member), 0, -1)
            raw, listed = pipe.execute()
        return {_text(k): _text(v) for k, v in raw.items()}, [_text(entry) for entry in listed]

    def replacing(self, member: str, task_id: str, token: str, by: str) -> bool:
        """Mark run ``task_id``, run by the delivery holding lock ``token``, as replacing itself with ``by``.

        So a ``lost`` ending recorded before ``replaced`` leaves its followers
        waiting for the replacement (see ``replacing.lua``). False, and nothing
        written, unless that delivery holds the run's lock.
        """
        at = self._at(member)
        command = commands.Replacing(task_id=task_id, token=token, by=storable(by))
        return bool(self.scripts.run([at.record(member), at.lock(member)], command))

    def annotate(self, member: str, task_id: str, note: str) -> bool:
        """Add ``note`` to the history entry run ``task_id``'s publish wrote (see ``annotate.lua``).

        False, and nothing written, once the record names another run.
        """
        keys = [self._at(member).record(member)]
        return bool(
            self.scripts.run(keys, commands.Annotate(task_id=task_id, note=note, history_len=self.history_length))
        )

    def is_held(self, member: str) -> bool:
        return bool(self.client.sismember(self._at(member).held, member))

    def holder(self, member: str) -> str | None:
        """The run whose hold on ``member`` a call made now would meet, or None when the key is free.

        The gate's test (see ``peek.lua``) read in one transaction, without
        counting anything: held, with a record whose hold has not passed on
        the server's clock.
        """
        at = self._at(member)
        with self.client.pipeline(transaction=True) as pipe:
            pipe.sismember(at.held, member)
            pipe.hmget(at.record(member), "task_id", "held_until")
            if self.schema.shards == 1:
                pipe.time()
            held, (task_id, held_until), *clock = pipe.execute()
        if not clock:  # a cluster pipeline takes no keyless command: ask the key's master
            cluster = cast(RedisCluster, self.client)
            node = cluster.get_node_from_key(at.held)  # type: ignore[no-untyped-call]
            clock = [cluster.execute_command("TIME", target_nodes=node)]  # type: ignore[no-untyped-call]
        seconds, micros = clock[0]
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        if not held or task_id is None or int(held_until or 0) <= now_ms:
            return None
        return _text(task_id)

    def detail(self, member: str) -> KeyDetail:
        """The member's record, history, hold, execution lock and steps, in one pipeline (and the server's
        clock, for a key with steps)."""
        schema = self._at(member)
        with self.client.pipeline(transaction=True) as pipe:
            pipe.hgetall(schema.record(member))
            pipe.lrange(store_format.old_history(schema, member), 0, -1)
            pipe.sismember(schema.held, member)
            pipe.get(schema.lock(member))
            pipe.pttl(schema.lock(member))
            pipe.hgetall(schema.steps(member))
            raw, listed, held, token, pttl, raw_steps = pipe.execute()
        record = {_text(k): _text(v) for k, v in raw.items()}
        steps = self._steps(member, record.get("task_id"), raw_steps)
        return KeyDetail(
            member=member,
            record=record or None,
            history=[entry.text() for entry in history_of(record, [_text(entry) for entry in listed])],
            held=bool(held),
            lock_token=None if token is None else _text(token),
            lock_ttl_ms=max(int(pttl), 0) if token is not None else 0,
            steps=steps,
        )

    def index_sizes(self, *, states: Sequence[str] = STATES) -> IndexSizes:
        """How many records there are in all and in each of ``states``, from the per-state indexes.

        One round trip of ZCARDs (constant time each); counts include entries
        whose record expired and the reaper has not removed yet. There is no
        per-task count: format 2 keeps no per-task index.
        """
        with self.client.pipeline(transaction=False) as pipe:
            for schema in self.schema.shards_all():
                for state in STATES:
                    pipe.zcard(schema.state_index(state))
            replies = [int(n) for n in pipe.execute()]
        width = len(STATES)
        sizes = dict(zip(STATES, (sum(replies[i::width]) for i in range(width)), strict=True))
        return IndexSizes(total=sum(sizes.values()), states={state: sizes.get(state, 0) for state in states})

    def records(
        self,
        *,
        state: str | None = None,
        task: str | None = None,
        prefix: str | None = None,
        cursor: str | None = None,
        limit: int = 50,
    ) -> Page:
        """A page of records filtered by state, task name and business-key prefix.

        Newest update first, merged from the per-state indexes (both stored
        formats keep them) by one read-only script per shard (``records.lua``),
        looking at most at ``20 * limit`` index entries per shard and page; the
        cursor is a position in that order, so records that change state while
        one pages neither repeat nor push others off a page. A key-prefix
        search reads the name index in key order instead. Entries whose record
        expired are skipped (the reaper removes them). A cursor past the end
        gives an empty last page.

        Raises:
            DedupArgumentError: ``limit`` below 1, or ``cursor`` not one a page gave.
        """
        if limit < 1:
            raise DedupArgumentError("limit", limit, "must be at least 1")
        if prefix is not None:
            return self._by_name(state, task, prefix, cursor, limit)
        after = _position(cursor)
        states = (state,) if state else STATES
        command = commands.Records(
            record_prefix="",
            task_prefix=f"{task_namespace(task)}:" if task is not None else "",
            after_score=str(after[0]) if after else "",
            after_member=after[1] if after else "",
            limit=limit,
            budget=20 * limit,
            states=tuple(states),
        )
        calls = [
            ([at.state_index(each) for each in states], command._replace(record_prefix=at.record("")))
            for at in self.schema.shards_all()
        ]
        if isinstance(self.client, RedisCluster):  # a cluster's pipeline runs no script: a round trip per shard
            replies = [self.scripts.run(keys, call) for keys, call in calls]
        else:
            with self.client.pipeline(transaction=False) as pipe:
                for keys, call in calls:
                    self.scripts.run(keys, call, client=pipe)
                replies = pipe.execute()
        found: list[tuple[float, bytes, Status]] = []
        frontier: tuple[float, bytes] | None = None  # the newest place some shard stopped looking short of its end
        total = 0
        for done, score, member, count, flat in replies:
            total += int(count)
            for i in range(0, len(flat), 3):
                name = _text(flat[i + 1])
                fields = flat[i + 2]
                record = {_text(fields[j]): _text(fields[j + 1]) for j in range(0, len(fields), 2)}
                found.append((float(flat[i]), bytes(flat[i + 1]), Status.from_record(name, record)))
            if not int(done):
                stop = (float(score), bytes(member))
                frontier = stop if frontier is None or stop > frontier else frontier
        found.sort(key=lambda item: (item[0], item[1]), reverse=True)
        shown = [item for item in found if frontier is None or (item[0], item[1]) >= frontier][:limit]
        if len(shown) == limit and (frontier is not None or len(found) > limit):
            last = shown[-1]
            return Page([item[2] for item in shown], _cursor_at(last[0], last[1]), total)
        if frontier is not None:
            return Page([item[2] for item in shown], _cursor_at(*frontier), total)
        return Page([item[2] for item in shown], None, total)

    def _by_name(self, state: str | None, task: str | None, prefix: str, cursor: str | None, limit: int) -> Page:
        """A key-prefix search: the name index in key order, merged over the shards; offsets as the cursor."""
        offsets = self._offsets(cursor)
        namespace = task_namespace(task) if task is not None else None
        found: list[Status] = []
        scanned = 0
        total = 0
        while scanned < 20 * limit:
            batch = limit - len(found)  # each page reads what it shows, more only for skipped entries
            entries, total = self._index_slice(prefix, offsets, batch)
            members = [member for _, member in entries]
            wanted = [m for m in members if namespace is None or split_member(m)[0] == namespace]
            fetched = dict(zip(wanted, self._fetch(wanted), strict=True))
            for shard, member in entries:
                offsets[shard] += 1  # the cursor moves past exactly what this page consumed
                scanned += 1
                fields = fetched.get(member)
                if fields and (state is None or fields.get("state") == state):
                    found.append(Status.from_record(member, fields))
                    if len(found) == limit:
                        more = sum(offsets) < total
                        return Page(found, self._cursor(offsets) if more else None, total)
            if len(entries) < batch:
                return Page(found, None, total)
        return Page(found, self._cursor(offsets), total)

    def _offsets(self, cursor: str | None) -> list[int]:
        """Each shard's offset in its index, from a page's cursor: ``"N"``, or ``"N.N.N..."`` with shards."""
        shards = self.schema.shards
        if not cursor or cursor == "0":  # the first page's, whatever the layout
            return [0] * shards
        parts = cursor.split(".")
        if len(parts) != shards or not all(part.isascii() and part.isdigit() for part in parts):
            raise DedupArgumentError("cursor", cursor, "must be the cursor of a page: a number, 0 or more")
        return [min(int(part), _MAX_OFFSET) for part in parts]  # past any index, still what Redis accepts

    @staticmethod
    def _cursor(offsets: Sequence[int]) -> str:
        return ".".join(str(offset) for offset in offsets)

    def _index_slice(self, prefix: str, offsets: Sequence[int], count: int) -> tuple[list[tuple[int, str]], int]:
        """The next ``count`` entries of the name index by business key, merged over the shards: ``(shard, member)``."""
        shards = self.schema.shards_all()
        low, high = f"[{prefix}".encode(), f"[{prefix}".encode() + b"\xff"
        with self.client.pipeline(transaction=False) as pipe:
            for at, offset in zip(shards, offsets, strict=True):
                pipe.zrangebylex(at.name_index, low, high, start=offset, num=count)
                pipe.zlexcount(at.name_index, low, high)
            replies = pipe.execute()
        merged: list[tuple[bytes, int, str]] = []
        for shard, entries in enumerate(replies[0::2]):
            for entry in entries:  # in the index's own order: by the entry's bytes
                key, _, ns = _text(entry).rpartition("\0")
                merged.append((bytes(entry), shard, f"{ns}:{key}"))
        merged.sort(key=lambda item: item[0])  # stable: ties keep each shard's own order
        total = sum(int(n) for n in replies[1::2])
        return [(shard, member) for _, shard, member in merged[:count]], total

    def _state_sizes(self, at: KeySchema) -> list[int]:
        with self.client.pipeline(transaction=False) as pipe:
            for state in STATES:
                pipe.zcard(at.state_index(state))
            return [int(n) for n in pipe.execute()]

    def _fetch(self, members: Sequence[str]) -> list[dict[str, str]]:
        with self.client.pipeline(transaction=False) as pipe:
            for member in members:
                pipe.hgetall(self._at(member).record(member))
            raw = pipe.execute()
        return [{_text(k): _text(v) for k, v in item.items()} for item in raw]

    def dispatch(self, *, limit: int = 100) -> Dispatch:
        """Push the parked messages of debounced runs that are due (see ``dispatch.lua``), shard by shard."""
        total, soonest = 0, None
        for at in self.schema.shards_all():
            command = commands.Dispatch(prefix=at.prefix, limit=limit, history_len=self.history_length)
            pushed, next_ms = self.scripts.run([at.due], command)
            total += int(pushed)
            if int(next_ms) >= 0:
                soonest = int(next_ms) if soonest is None else min(soonest, int(next_ms))
        return Dispatch(total, None if soonest is None else soonest / 1000)

    def reap(self, *, budget: int = 500, record_ms: int, grace_ms: int = 30_000) -> ReapReport:
        """One bounded clean-up pass (see ``reap.lua``) over every shard, ``budget`` per shard and step."""
        totals = [0, 0, 0, 0]
        runs: list[tuple[str, str, str]] = []
        for at in self.schema.shards_all():
            command = commands.Reap(
                prefix=at.prefix, budget=budget, record_ms=record_ms, history_len=self.history_length, grace_ms=grace_ms
            )
            *counts, reaped = self.scripts.run([at.held], command)
            totals = [total + int(n) for total, n in zip(totals, counts, strict=True)]
            flat = [_text(item) for item in reaped]
            runs += [(flat[i], flat[i + 1], flat[i + 2]) for i in range(0, len(flat), 3)]
        released, lost, stale, vanished = totals
        return ReapReport(released, lost, stale, vanished, tuple(runs))

    def release(self, member: str, *, record_ms: int, force_token: str = "", by: str = "") -> ReleaseResult:
        """Free ``member``'s key (see ``release.lua``): owner-safe, noted in its history as ``by``.

        A live execution lock refuses the release unless ``force_token`` is the
        lock's current token; the lock is then deleted.
        """
        at = self._at(member)
        keys = [at.held, at.record(member), at.lock(member)]
        command = commands.Release(
            member=member,
            prefix=at.prefix,
            history_len=self.history_length,
            record_ms=record_ms,
            force=force_token,
            who=by,
        )
        code, detail, was_held, forced = self.scripts.run(keys, command)
        return ReleaseResult(ReleaseCode(int(code)), _text(detail), bool(was_held), bool(forced))

    def purge(self, states: Sequence[str] = ENDED_STATES, *, budget: int = 500) -> PurgeReport:
        """Delete up to ``budget`` examined records in ended ``states`` (see ``purge.lua``).

        Records whose key is held or whose lock is alive are kept.
        """
        purged = kept = 0
        more = False
        for at in self.schema.shards_all():
            command = commands.Purge(prefix=at.prefix, budget=budget, states=tuple(states))
            done, spared, left = self.scripts.run([at.held], command)
            purged, kept, more = purged + int(done), kept + int(spared), more or bool(left)
        return PurgeReport(purged, kept, more)
