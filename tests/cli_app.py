"""Celery apps for tests/integration/test_cli.py, importable by ``celery -A tests.cli_app[:<name>]``.

Configured from ``CELERY_DEDUP_TEST_BROKER`` like tests/proj.py, so a
``celery`` subprocess and a worker subprocess build the same apps:

- ``app``: installed, the keyed tasks below;
- ``uninstalled``: ``celery_dedup.install`` never called;
- ``short_visibility``: a 10 s ``visibility_timeout`` under a 60 s lock TTL;
- ``separate_store``: keys in another database than the broker's;
- ``restricted``: connects as the ACL user ``RESTRICTED_USER`` (CONFIG denied),
  which the test creates;
- ``amqp_broker``: an AMQP broker (never connected to), keys on the test server;
- ``unreachable``: broker and keys on a port nothing listens on;
- ``bad_options``: a task whose ``dedup_mode`` does not exist (found when the
  app is finalized);
- ``grouped``: named limit groups (``dedup_limit_groups``): ``partner-api``
  (a quota per tenant) and ``mailer`` (one quota), each used by a task.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery

import celery_dedup
from celery_dedup import DedupTask

BROKER = os.environ.get("CELERY_DEDUP_TEST_BROKER", "redis://127.0.0.1:6379/0")
RESTRICTED_USER = "cli-restricted"


def _app(name: str, broker: str = BROKER, *, install: bool = True, **conf: Any) -> Celery:
    new = Celery(name, broker=broker, set_as_current=False)
    new.conf.update(worker_hijack_root_logger=False, broker_connection_retry_on_startup=True, **conf)
    if install:
        celery_dedup.install(new)
    return new


app = _app("cli", dedup_lock_ttl=3)
uninstalled = _app("cli_uninstalled", install=False)
short_visibility = _app("cli_short_visibility", broker_transport_options={"visibility_timeout": 10})
separate_store = _app("cli_separate", dedup_redis_url=BROKER.rsplit("/", 1)[0] + "/1")
restricted = _app("cli_restricted", BROKER.replace("://", f"://{RESTRICTED_USER}:{RESTRICTED_USER}@", 1))
amqp_broker = _app("cli_amqp", "amqp://guest@127.0.0.1:1//", dedup_redis_url=BROKER)
unreachable = _app("cli_unreachable", "redis://127.0.0.1:1/0")
bad_options = _app("cli_bad_options")
grouped = _app(
    "cli_grouped",
    dedup_limit_groups={
        "partner-api": {"concurrency": 2, "rate": ["10/s", "1000/d"]},
        "mailer": {"rate": "5/s"},
    },
)


@app.task(name="cli.charge", base=DedupTask, dedup_key="order:{order_id}", shared=False)
def charge(order_id: int) -> int:
    return order_id


@app.task(name="cli.slow", base=DedupTask, dedup_key="job:{job_id}", bind=True, shared=False)
def slow(self: DedupTask, job_id: int, seconds: float = 60.0) -> str:
    """Runs until ``seconds`` pass or its execution lock is lost (then says so)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if self.dedup_lock_lost:
            return "lock lost"
        time.sleep(0.05)
    return "done"


@short_visibility.task(name="cli.visible", base=DedupTask, dedup_key="{n}", dedup_lock_ttl=60, shared=False)
def visible(n: int) -> int:
    return n


@bad_options.task(name="cli.bad", base=DedupTask, dedup_mode="sometimes", shared=False)
def bad(n: int) -> int:
    return n


@grouped.task(
    name="cli.push", base=DedupTask, dedup_mode="off", limit_group="partner-api", limit_key="{tenant}", shared=False
)
def push(tenant: str) -> str:
    return tenant


@grouped.task(name="cli.mail", base=DedupTask, dedup_mode="off", limit_group="mailer", shared=False)
def mail(n: int) -> int:
    return n
