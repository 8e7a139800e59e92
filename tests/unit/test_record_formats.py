"""Reading a status record of either stored format: format 1 (``hist:`` list, ``task`` and ``updated_at``
fields) and format 2 (history in the record's ``h<n>`` fields, task and last update derived).

Pure Python: the records are the field maps Redis would hand back.
"""

from __future__ import annotations

import datetime

from celery_dedup.store.status import HistoryEntry, Status, history_of, is_history_field

UTC = datetime.timezone.utc
Q = 1_700_000_000_000  # queued_at, ms


def at(ms: int) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(ms / 1000, UTC)


V2 = {
    "state": "succeeded",
    "task_id": "order:1~b",
    "queued_at": str(Q),
    "started_at": str(Q + 3),
    "finished_at": str(Q + 9),
    "hn": "5",
    "h1": "-40 queued order:1~a",
    "h2": "-20 lost order:1~a lock not renewed",
    "h3": "0 queued",
    "h4": "3 started -",
    "h5": "9 succeeded",
}


def test_a_format_2_record_reads_its_history_task_and_last_update_from_itself() -> None:
    status = Status.from_record("shop%3Aspecial:order:1", {**V2, "h5": "9 succeeded - by alice"})

    assert status.task == "shop:special" and status.key == "order:1"
    assert status.history == (
        HistoryEntry(at(Q + 9), "succeeded", "order:1~b", "by alice"),
        HistoryEntry(at(Q + 3), "started", "order:1~b", ""),
        HistoryEntry(at(Q), "queued", "order:1~b", ""),
        HistoryEntry(at(Q - 20), "lost", "order:1~a", "lock not renewed"),
        HistoryEntry(at(Q - 40), "queued", "order:1~a", ""),
    )
    assert status.updated_at == at(Q + 9)
    assert (status.duplicates, status.retries, status.debounced, status.attempts) == (0, 0, 0, 0)
    assert status.history[0].text() == f"{Q + 9} succeeded order:1~b by alice"


def test_h_fields_are_ordered_by_number_not_by_text() -> None:
    fields = {"task_id": "r", "queued_at": str(Q), "h9": "1 queued", "h10": "2 started", "h11": "5 succeeded"}
    assert [entry.state for entry in history_of(fields)] == ["succeeded", "started", "queued"]


def test_a_format_1_record_reads_as_before() -> None:
    fields = {"state": "started", "task": "shop.charge", "task_id": "k~1", "updated_at": str(Q + 7)}
    status = Status.from_record("shop.charge:k", fields, [f"{Q + 7} started k~1", f"{Q} queued k~1 attempt 1"])
    assert status.task == "shop.charge" and status.updated_at == at(Q + 7)
    assert [entry.text() for entry in status.history or ()] == [f"{Q + 7} started k~1", f"{Q} queued k~1 attempt 1"]


def test_a_record_with_both_merges_them_newest_first() -> None:
    """A run gated by one release and run by the other: entries in the record and in the list."""
    fields = {
        "state": "succeeded",
        "task_id": "k~1",
        "queued_at": str(Q),
        "hn": "2",
        "h0": "0 queued",
        "h1": "9 succeeded",
    }
    status = Status.from_record("t:k", fields, [f"{Q + 4} started k~1 old worker"])
    assert [(entry.state, entry.note) for entry in status.history or ()] == [
        ("succeeded", ""),
        ("started", "old worker"),
        ("queued", ""),
    ]
    assert status.updated_at == at(Q + 9)


def test_without_history_the_last_update_is_the_latest_time_field() -> None:
    fields = {"state": "started", "task_id": "k~1", "queued_at": str(Q), "started_at": str(Q + 5)}
    status = Status.from_record("t:k", fields)
    assert status.updated_at == at(Q + 5) and status.history is None


def test_history_fields_are_told_from_record_fields() -> None:
    assert all(is_history_field(name) for name in ("h0", "h1", "h17", "hn"))
    assert not any(is_history_field(name) for name in ("h", "h01", "held_until", "hold_ms", "hx", "h-1"))


def test_odd_entries_do_not_crash() -> None:
    fields = {"task_id": "r", "queued_at": "soon", "h0": "", "h1": "x y", "h2": "²3 queued"}
    assert [entry.at for entry in history_of(fields)] == [None, None, None]
