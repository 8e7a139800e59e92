"""The stored format's version: checked once per store, and the move of format 1's leftovers to this format.

A store keeps its layout's number in the STRING ``{prefix}:format``
(``schema.FORMAT``). Format 1 had no such key. During a rolling deploy the
previous release (format 1) and this one share the store and work together:
the previous release keeps writing format 1's own structures (the all-records
index, the per-task indexes, the history lists), which this release reads
beside its own and :func:`migrate` moves once every producer and worker runs
this release. A store in a format newer than this release knows is refused
(:class:`~celery_dedup.exceptions.DedupStoreFormatError`): never read silently.

:meth:`DedupStore.check_format` runs :func:`check` once per store object, at
a worker's start and at the first use of the store in a process; ``celery -A
proj dedup check`` reports it, with a full scan for leftovers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import redis

from ..exceptions import DedupStoreFormatError
from ..keys import KeySchema
from .schema import FORMAT
from .status import HistoryEntry, to_ms


class DedupStore(Protocol):
    """What this module uses of ``store.DedupStore`` (which calls it)."""

    client: redis.Redis
    schema: KeySchema
    history_length: int

    def _each_shard(self, command: Callable[[Any, KeySchema], Any]) -> list[Any]: ...


logger = logging.getLogger("celery_dedup")

#: The format of a store with no ``format`` key: the layout before the key existed.
FIRST_FORMAT = 1
#: What a history entry's value may take, bytes: a hash stays a compact listpack while each value does.
ENTRY_BYTES = 64
#: SCAN's COUNT hint for the walks over the keyspace.
SCAN_COUNT = 1000


@dataclass(frozen=True)
class FormatState:
    """How a store's format stands, as one check found it."""

    prefix: str
    #: The ``format`` key's value (the lowest over a cluster's shards); None where no shard has one.
    stored: int | None
    #: Format 1's all-records index exists (the previous release wrote to the store).
    old_index: bool
    #: Format 1's history lists found by a scan (None: not scanned, as at a process's start).
    old_histories: int | None = None

    @property
    def leftovers(self) -> bool:
        """Whether format 1's structures are present, or the store says it is older than this release."""
        return self.old_index or bool(self.old_histories) or (self.stored is not None and self.stored < FORMAT)

    def describe(self) -> str:
        """What was found, for people."""
        found = []
        if self.stored is not None and self.stored < FORMAT:
            found.append(f"the store says format {self.stored}")
        if self.old_index:
            found.append(f"the index {self.prefix}:idx")
        if self.old_histories:
            found.append(f"{self.old_histories} history lists {self.prefix}:hist:*")
        return ", ".join(found)


def migrate_command(app_name: str | None) -> str:
    """The command that moves format 1's leftovers, for ``app_name`` (the Celery app's ``main``)."""
    return f"celery -A {app_name or '<your app>'} dedup migrate"


def leftovers_message(state: FormatState, app_name: str | None) -> str:
    return (
        f"dedup store {state.prefix!r}: format-1 structures are present ({state.describe()}): a previous "
        f"celery-dedup release may still be running. This release works together with it; once every "
        f"producer and worker runs this release, `{migrate_command(app_name)}` removes them"
    )


def _glob(text: str) -> str:
    """``text`` with the characters SCAN's MATCH treats as a pattern escaped."""
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)


def _int(value: Any) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return FORMAT + 1 if value else None  # what no release wrote is nothing this one may read


def read(store: DedupStore, *, scan: bool = False) -> FormatState:
    """The store's format key and format 1's index, over every shard, in one pipeline (``scan``: its history
    lists too, a walk of the keyspace, for the operator's commands)."""
    replies = store._each_shard(lambda pipe, at: (pipe.get(at.format), pipe.exists(f"{at.prefix}:idx")))
    stored = [_int(value) for value in replies[0::2]]
    known = [value for value in stored if value is not None]
    histories = sum(1 for _ in old_histories(store)) if scan else None
    return FormatState(
        prefix=store.schema.prefix,
        stored=(max(known) if any(v > FORMAT for v in known) else min(known)) if known else None,
        old_index=any(int(n) for n in replies[1::2]),
        old_histories=histories,
    )


def check(store: DedupStore, app_name: str | None = None, *, scan: bool = False, warn: bool = True) -> FormatState:
    """Check the store's format: mark a new store (SET NX), warn of format 1's leftovers (unless not
    ``warn``: the caller reports them), refuse a newer one.

    Raises:
        DedupStoreFormatError: the store's format is newer than :data:`~.schema.FORMAT`.
    """
    state = read(store, scan=scan)
    if state.stored is not None and state.stored > FORMAT:
        raise DedupStoreFormatError(state.prefix, state.stored, FORMAT)
    if state.stored is None or len(store.schema.shards_all()) > 1:
        store._each_shard(lambda pipe, at: pipe.set(at.format, FORMAT, nx=True))
    if state.leftovers and warn:
        logger.warning("%s", leftovers_message(state, app_name))
    return state


def old_histories(store: DedupStore) -> Iterator[str]:
    """The names of format 1's history lists, ``{prefix}:hist:<member>`` (a SCAN over every shard)."""
    for at in store.schema.shards_all():
        for key in store.client.scan_iter(match=_glob(f"{at.prefix}:hist:") + "*", count=SCAN_COUNT):
            yield key.decode("utf-8", "surrogateescape") if isinstance(key, bytes) else str(key)


def old_task_indexes(store: DedupStore) -> Iterator[str]:
    """The names of format 1's per-task indexes, ``{prefix}:idx:task:<namespace>``."""
    for at in store.schema.shards_all():
        for key in store.client.scan_iter(match=_glob(f"{at.prefix}:idx:task:") + "*", count=SCAN_COUNT):
            yield key.decode("utf-8", "surrogateescape") if isinstance(key, bytes) else str(key)


# Format 1's history, as this format's entries ------------------------------------------------------------------------


def entry(offset: int, state: str, run: str, note: str = "") -> str:
    """A history entry's value: ``<offset> <state>`` or ``<offset> <state> <run> [note]``, at most
    :data:`ENTRY_BYTES` bytes (the note is cut, never the run id)."""
    if run == "-" and not note:
        return f"{offset} {state}"
    head = f"{offset} {state} {run}"
    if not note:
        return head
    room = ENTRY_BYTES - len(head.encode("utf-8", "surrogateescape")) - 1
    if room <= 0:
        return head
    cut = note.encode("utf-8", "surrogateescape")[:room].decode("utf-8", "ignore")
    return f"{head} {cut}" if cut else head


def _timed(entries: Iterable[HistoryEntry]) -> list[tuple[int, HistoryEntry]]:
    """The entries that carry a time, with it in ms (one without a time cannot be placed, so is dropped)."""
    return [(to_ms(e.at), e) for e in entries if e.at is not None and e.state]


def folded(record: dict[str, str], old: list[str], length: int) -> tuple[dict[str, str], list[str]]:
    """The fields to write (``h<n>``, ``hn``, ``queued_at`` where missing) and to delete, that fold format 1's
    history list ``old`` (newest first) into ``record`` beside any entries it has, newest ``length`` kept."""
    run = record.get("task_id", "")
    entries = _timed(HistoryEntry.parse(value) for value in reversed(old))
    mine = [ms for ms, e in entries if e.task_id == run]
    queued_at = _int(record.get("queued_at"))
    write: dict[str, str] = {}
    if queued_at is None:
        queued_at = _int(record.get("started_at")) or min(mine or [ms for ms, _ in entries] or [0])
        write["queued_at"] = str(queued_at)
    next_n = _int(record.get("hn")) or 0
    present = [f"h{n}" for n in range(max(0, next_n - length), next_n) if f"h{n}" in record]
    entries += _timed(HistoryEntry.parse_field(record[f], queued_at, run) for f in present)
    entries.sort(key=lambda item: item[0])  # stable: an old entry stays before a new one of the same ms
    kept = entries[-length:] if length > 0 else []
    for n, (ms, e) in enumerate(kept):
        write[f"h{n}"] = entry(ms - queued_at, e.state, "-" if e.task_id in ("", run) else e.task_id, e.note)
    write["hn"] = str(len(kept))
    delete = [f for f in present if f not in write]
    if "updated_at" in record and kept:  # the newest entry says when the record changed
        delete.append("updated_at")
    return write, delete


@dataclass(frozen=True)
class MigrateReport:
    """What a migration did (or, dry, would do)."""

    prefix: str
    #: The format the store said it was in before (None: no format key).
    was: int | None
    #: History lists folded into their records.
    folded: int
    #: History lists deleted: their record is gone.
    deleted: int
    #: Format 1 indexes deleted: the all-records one (per shard) and the per-task ones.
    indexes: int
    #: The format the store is in now (dry: still ``was``).
    format: int | None
    dry_run: bool


def fold(store: DedupStore, history_key: str) -> bool | None:
    """Fold one history list into its record, atomically (WATCH): True folded, False deleted (no record),
    None gone meanwhile."""
    at, member = _split_history(store, history_key)
    record_key = at.record(member)
    while True:
        with store.client.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(history_key, record_key)  # type: ignore[no-untyped-call]
                old = [_text(v) for v in pipe.lrange(history_key, 0, -1)]
                if not old:
                    return None
                raw = pipe.hgetall(record_key)
                record = {_text(k): _text(v) for k, v in raw.items()}
                pipe.multi()
                if record:
                    write, delete = folded(record, old, store.history_length)
                    if delete:
                        pipe.hdel(record_key, *delete)
                    pipe.hset(record_key, mapping=dict(write.items()))
                pipe.delete(history_key)
                pipe.execute()
                return bool(record)
            except redis.WatchError:
                continue


def old_history(at: KeySchema, member: str) -> str:
    """Format 1's history list of ``member``: read beside the record's own until :func:`migrate` folds it."""
    return f"{at.prefix}:hist:{member}"


def _split_history(store: DedupStore, history_key: str) -> tuple[KeySchema, str]:
    for at in store.schema.shards_all():
        head = f"{at.prefix}:hist:"
        if history_key.startswith(head):
            return at, history_key[len(head) :]
    raise ValueError(f"{history_key!r} is no history list of {store.schema.prefix!r}")


def _text(value: Any) -> str:
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else str(value)


def migrate(store: DedupStore, *, dry_run: bool = False) -> MigrateReport:
    """Move format 1's leftovers to this format, then mark the store: idempotent, SCAN-based, safe while
    this release's workers run (each record's fold is one optimistic transaction).

    Raises:
        DedupStoreFormatError: the store's format is newer than this release's.
    """
    state = read(store)
    if state.stored is not None and state.stored > FORMAT:
        raise DedupStoreFormatError(state.prefix, state.stored, FORMAT)
    folds = deleted = 0
    for key in old_histories(store):
        if dry_run:
            at, member = _split_history(store, key)
            exists = store.client.exists(at.record(member))
            folds, deleted = (folds + 1, deleted) if exists else (folds, deleted + 1)
            continue
        done = fold(store, key)
        if done is not None:
            folds, deleted = (folds + 1, deleted) if done else (folds, deleted + 1)
    indexes = list(old_task_indexes(store))
    alls = [f"{at.prefix}:idx" for at in store.schema.shards_all()]
    found = sum(int(store.client.exists(key)) for key in alls) + len(indexes)
    if not dry_run:
        for key in [*alls, *indexes]:
            store.client.delete(key)
        store._each_shard(lambda pipe, at: pipe.set(at.format, FORMAT))
    now = state.stored if dry_run else FORMAT
    return MigrateReport(state.prefix, state.stored, folds, deleted, found, now, dry_run)
