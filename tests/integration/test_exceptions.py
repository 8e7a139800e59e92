"""Every DedupError survives pickling, as a prefork pool child sends it to the worker's main process.

An error that did not used to (its ``__init__`` takes more than the message)
made the worker's main process fail to read the child's result and shut down.
"""

from __future__ import annotations

import pickle
import signal
from typing import Any

import pytest
import redis

from celery_dedup import exceptions
from celery_dedup.exceptions import DedupError
from celery_dedup.keys import KeySchema, member_for

from ..conftest import Server, WorkerProcess, new_app, wait_for
from ..guard_app import register

CAUSE = redis.ConnectionError("connection refused")

EXAMPLES: list[DedupError] = [
    exceptions.DedupConfigError("dedup_ttl", -1, "must be positive", task="shop.charge"),
    exceptions.DedupKeyError("shop.charge", "order_id", lambda: None, "no canonical text form"),
    exceptions.DuplicateTaskError("shop.charge", "order:1", "order:1~abc"),
    exceptions.DedupArgumentsMismatch("shop.charge", "order:1", "order:1~abc", "0123456789abcdef", "fedcba9876543210"),
    exceptions.DedupUnavailableError("shop.charge", "order:1", CAUSE, published=None),
    exceptions.DedupStoreError("shop.charge", "order:1", redis.exceptions.OutOfMemoryError("command not allowed")),
    exceptions.DedupStoreFormatError("dedup", 3, 2),
    exceptions.DedupRoutingError("shop.charge", "order:1", "fanout"),
    exceptions.DedupOperationError("purge", "succeeded", "nothing to do"),
    exceptions.DedupArgumentError("limit", 0, "must be at least 1"),
    exceptions.DedupLimitTimeout("partner-api", "acme", 2.5),
    exceptions.DedupFollowerError("shop.charge", "order:1", "order:1~abc", "lost", "message lost by the transport"),
    exceptions.DedupFollowerLimitError("shop.charge", "order:1", "order:1~abc", 1000),
    exceptions.DedupStepError("shop.charge", "charge-card", "called outside a body"),
    exceptions.DedupStepInDoubt(
        "shop.charge", "order:1", "order:1~abc", "charge-card", "shop.charge:order:1:~abc:charge-card", 1
    ),
    exceptions.DedupLockLostError(
        "shop.charge",
        "order:1",
        "order:1~abc",
        "charge-card",
        "shop.charge:order:1:~abc:charge-card",
        recorded=False,
        why="taken over",
    ),
]


def test_every_error_class_has_an_example() -> None:
    classes = {cls for cls in vars(exceptions).values() if isinstance(cls, type) and issubclass(cls, DedupError)}
    assert classes - {DedupError} == {type(error) for error in EXAMPLES}


@pytest.mark.parametrize("error", EXAMPLES, ids=lambda error: type(error).__name__)
def test_an_error_round_trips_through_pickle(error: DedupError) -> None:
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error) and copy.args == error.args
    for name, value in vars(error).items():
        expected: Any = value if not callable(value) else exceptions._short_repr(value)
        got = getattr(copy, name)
        if isinstance(value, BaseException):
            assert (type(got), str(got)) == (type(value), str(value)), name
        else:
            assert got == expected, name


@pytest.mark.slow
def test_a_prefork_worker_survives_a_task_that_raises_a_dedup_error(server: Server, r: redis.Redis) -> None:
    app = new_app(server, "producer")
    work = register(app)["guard.work.until_executed"]
    member = member_for(work.name, "job:p")
    worker = WorkerProcess(server.url, app="tests.guard_app", concurrency=2).wait_ready()
    try:
        work.delay("p", "dedup_error")
        wait_for(lambda: r.hget(KeySchema("dedup").record(member), "state") == b"rejected", 10, "the record")
        assert work.delay("p").get(timeout=20) == "p", "the worker still runs tasks"
        assert worker.process.poll() is None
    finally:
        worker.stop(signal.SIGTERM)
        app.close()
