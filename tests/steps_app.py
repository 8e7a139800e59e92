"""An importable Celery app for the steps tests (tests/integration/test_steps.py): workers it runs get killed.

Configured from the environment as tests/crash_app.py is (``CELERY_DEDUP_TEST_BROKER``,
``CELERY_DEDUP_TEST_TRANSPORT_OPTIONS``, ``CELERY_DEDUP_CRASH_CONF``). Its
tasks charge an order in two steps through a fake provider that writes every
call down in Redis (the idempotency key it was called with, the process, the
receipt it returned), where the test reads it after the process that made
the call is gone. The test tells a task where to hang (until killed) or wait
(until the test lets it go) through keys of its own. The test process
registers the same tasks on its own app with :func:`register`.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery

import celery_dedup
from celery_dedup import DedupTask

#: How long a call told to hang sleeps: far longer than any test waits for it to be killed.
HANG_SECONDS = 60.0


def calls_key(n: int) -> str:
    """LIST of ``"<what> <idempotency key> <pid> <receipt>"``, one per provider call for order ``n``."""
    return f"test:steps:calls:{n}"


def hang_key(where: str, n: int) -> str:
    """Set by the test to N: the next N times order ``n`` gets ``where`` it hangs (until killed).

    ``where``: ``"in-charge"`` (inside the charge step's call), ``"after-charge"`` (in the body, after it).
    """
    return f"test:steps:hang:{where}:{n}"


def hold_key(where: str, n: int) -> str:
    """While set, order ``n`` waits ``where`` (as :func:`hang_key`) until the test deletes it."""
    return f"test:steps:hold:{where}:{n}"


def pid_key(where: str, n: int) -> str:
    """The pid of the process that last got ``where`` for order ``n``."""
    return f"test:steps:pid:{where}:{n}"


def bodies_key(n: int) -> str:
    """INCRed by every execution of a body for order ``n``."""
    return f"test:steps:bodies:{n}"


@dataclass(frozen=True)
class Call:
    """One call of the fake provider, as it wrote it down."""

    what: str
    key: str
    pid: int
    receipt: str


def calls(client: redis.Redis, n: int) -> list[Call]:
    found = []
    for raw in client.lrange(calls_key(n), 0, -1):
        what, key, pid, receipt = raw.decode().split(" ")
        found.append(Call(what, key, int(pid), receipt))
    return found


@dataclass(frozen=True)
class Tasks:
    """The steps tests' tasks, as registered on one app."""

    #: Charges (a step), may hang after it, sends the receipt (a step); returns the receipt.
    charge: DedupTask
    #: The same with ``on_doubt="raise"``.
    charge_or_raise: DedupTask
    #: Charges (a step), then retries once (its first delivery), then sends the receipt.
    charge_then_retry: DedupTask
    #: As ``charge``, with ``dedup_mode="until_executing"``: the key is free again once the body starts.
    charge_until_executing: DedupTask


def register(app: Celery) -> Tasks:
    """Register the steps tests' tasks on ``app`` (names are fixed, so every app agrees)."""
    client = redis.Redis.from_url(str(app.conf.broker_url))

    def wait(where: str, n: int) -> None:
        client.set(pid_key(where, n), os.getpid())
        if client.decr(hang_key(where, n)) >= 0:
            time.sleep(HANG_SECONDS)
        deadline = time.monotonic() + HANG_SECONDS
        while client.exists(hold_key(where, n)) and time.monotonic() < deadline:
            time.sleep(0.05)

    def provider(what: str, n: int, key: str) -> str:
        """A provider's call: written down (with the key it got) before it may hang, as a charge that went out."""
        receipt = f"{what}-{secrets.token_hex(4)}"
        client.rpush(calls_key(n), f"{what} {key} {os.getpid()} {receipt}")
        if what == "charge":
            wait("in-charge", n)
        return receipt

    def body(task: DedupTask, n: int, on_doubt: str) -> dict[str, Any]:
        client.incr(bodies_key(n))
        receipt = task.dedup_once("charge", lambda key: provider("charge", n, key), on_doubt=on_doubt)
        wait("after-charge", n)
        mail = task.dedup_once("send-receipt", lambda key: provider("mail", n, key), on_doubt=on_doubt)
        return {"receipt": receipt, "mail": mail}

    @app.task(
        name="tests.steps_app.charge", base=DedupTask, bind=True, shared=False, acks_late=True, dedup_key="order:{n}"
    )
    def charge(self: DedupTask, n: int) -> dict[str, Any]:
        return body(self, n, "retry")

    @app.task(
        name="tests.steps_app.charge_or_raise",
        base=DedupTask,
        bind=True,
        shared=False,
        acks_late=True,
        dedup_key="order:{n}",
    )
    def charge_or_raise(self: DedupTask, n: int) -> dict[str, Any]:
        return body(self, n, "raise")

    @app.task(
        name="tests.steps_app.charge_then_retry",
        base=DedupTask,
        bind=True,
        shared=False,
        acks_late=True,
        dedup_key="order:{n}",
    )
    def charge_then_retry(self: DedupTask, n: int) -> dict[str, Any]:
        client.incr(bodies_key(n))
        receipt = self.dedup_once("charge", lambda key: provider("charge", n, key))
        if not self.request.retries:
            raise self.retry(countdown=0.1, max_retries=1)
        mail = self.dedup_once("send-receipt", lambda key: provider("mail", n, key))
        return {"receipt": receipt, "mail": mail}

    @app.task(
        name="tests.steps_app.charge_until_executing",
        base=DedupTask,
        bind=True,
        shared=False,
        acks_late=True,
        dedup_key="order:{n}",
        dedup_mode="until_executing",
    )
    def charge_until_executing(self: DedupTask, n: int) -> dict[str, Any]:
        return body(self, n, "retry")

    return Tasks(charge, charge_or_raise, charge_then_retry, charge_until_executing)


def build() -> Celery:
    """The app a worker process runs, from the environment (see the module docstring)."""
    broker = os.environ.get("CELERY_DEDUP_TEST_BROKER", "redis://127.0.0.1:6379/0")
    steps_app = Celery("steps_app", broker=broker, backend=broker, set_as_current=False)
    steps_app.conf.update(
        broker_transport_options=json.loads(os.environ.get("CELERY_DEDUP_TEST_TRANSPORT_OPTIONS", "{}")),
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
    )
    steps_app.conf.update(json.loads(os.environ.get("CELERY_DEDUP_CRASH_CONF", "{}")))
    celery_dedup.install(steps_app)
    register(steps_app)
    return steps_app


app = build()
