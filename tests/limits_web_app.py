"""An importable app for the tests of one group quota drawn from outside tasks and from tasks (test_limits_web.py).

Configured from the environment, as tests/limits_app.py is
(``CELERY_DEDUP_TEST_BROKER``: broker, result backend and store). Run as a
module it is a process drawing on a group's quota from outside any task:

- ``python -m tests.limits_web_app race <threads> <rounds> <seconds>``: that
  many threads each hold the ``partner`` group's key ``acme`` ``rounds`` times
  for ``seconds``;
- ``python -m tests.limits_web_app hang <group> <lease>``: holds one place in
  ``<group>`` and says so (``HELD``), then sleeps until it is killed.

Every holder and every body records, in Redis, when it began and ended on the
server's clock, so the test checks the limits from what the server saw.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, cast

import redis
from celery import Celery

import celery_dedup
from celery_dedup import DedupTask, limits

#: LIST of JSON ``{"who", "start", "end"}`` per place held (a caller's block or a body).
HOLDS = "test:limweb:holds"
#: HASH pid -> token of the processes holding a place until killed.
HELD = "test:limweb:held"
#: LIST of JSON ``{"who", "start", "retries"}`` per body that backs off.
BACKED_OFF = "test:limweb:backed_off"
#: SET of the bodies that wait (at most 30 s) until the test takes them out.
HOLD = "test:limweb:hold"
#: SET of the bodies that back off once.
BACKOFF = "test:limweb:backoff"
#: How long a body backs off (seconds).
BACKOFF_SECONDS = 2.0
#: How long a body runs (seconds).
BODY_SECONDS = 0.1
#: The named groups of the tests.
GROUPS: dict[str, dict[str, Any]] = {
    "partner": {"concurrency": 3},
    "single": {"concurrency": 1},
}


@dataclass(frozen=True)
class Tasks:
    #: A keyed task of group ``partner`` (limit key: its tenant).
    partner: DedupTask
    #: A keyed task of group ``single``, and one with deduplication off: they back off when told to.
    single: DedupTask
    single_off: DedupTask
    #: A task of group ``single`` that frees its key as its body starts (``until_executing``).
    single_started: DedupTask
    #: A task with limits of its own (no group).
    inline: DedupTask


def server_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def hold(app: Celery, client: redis.Redis, who: str, seconds: float, *, group: str = "partner") -> None:
    """Hold a place in ``group``'s key ``acme`` for ``seconds``, recording when, on the server's clock."""
    with limits.acquire(app, group, key="acme", timeout=60):
        start = server_ms(client)
        time.sleep(seconds)
        client.rpush(HOLDS, json.dumps({"who": who, "start": start, "end": server_ms(client)}))


def register(app: Celery) -> Tasks:
    """Register the tests' tasks on ``app`` (fixed names, so every app agrees)."""
    client = redis.Redis.from_url(str(app.conf.broker_url))

    def body(task: DedupTask, who: str, tenant: str) -> str:
        deadline = time.monotonic() + 30
        while client.sismember(HOLD, who) and time.monotonic() < deadline:
            time.sleep(0.02)
        start = server_ms(client)
        if client.srem(BACKOFF, who):
            client.rpush(BACKED_OFF, json.dumps({"who": who, "start": start, "retries": task.request.retries}))
            raise task.dedup_backoff(retry_after=BACKOFF_SECONDS)
        time.sleep(BODY_SECONDS)
        entry = {
            "who": who,
            "tenant": tenant,
            "start": start,
            "end": server_ms(client),
            "retries": task.request.retries,
            "id": task.request.id,
        }
        client.rpush(HOLDS, json.dumps(entry))
        return who

    @app.task(
        name="tests.limits_web_app.partner",
        base=DedupTask,
        bind=True,
        shared=False,
        dedup_key="call:{n}",
        limit_group="partner",
        limit_key="{tenant}",
    )
    def partner(self: DedupTask, n: int, tenant: str) -> str:
        return body(self, f"task:{n}", tenant)

    def of_single(name: str, **options: Any) -> DedupTask:
        """A task of group ``single`` (limit key: its tenant) that backs off when told to; no Celery retry."""

        def run(self: DedupTask, n: int, tenant: str) -> str:
            return body(self, f"{tenant}{n}", tenant)

        decorate = app.task(
            name=f"tests.limits_web_app.{name}",
            base=DedupTask,
            bind=True,
            shared=False,
            limit_group="single",
            limit_key="{tenant}",
            max_retries=0,
            **options,
        )
        return cast(DedupTask, decorate(run))

    single = of_single("single", dedup_key="call:{tenant}:{n}")
    single_off = of_single("single_off", dedup_mode="off")
    single_started = of_single("single_started", dedup_mode="until_executing", dedup_key="call:{tenant}:{n}")

    @app.task(
        name="tests.limits_web_app.inline",
        base=DedupTask,
        bind=True,
        shared=False,
        dedup_key="call:{n}",
        limit_concurrency=1,
    )
    def inline(self: DedupTask, n: int) -> str:
        return body(self, f"inline{n}", "")

    return Tasks(partner, single, single_off, single_started, inline)


def build() -> Celery:
    broker = os.environ.get("CELERY_DEDUP_TEST_BROKER", "redis://127.0.0.1:6379/0")
    web_app = Celery("limits_web_app", broker=broker, backend=broker, set_as_current=False)
    web_app.conf.update(
        worker_hijack_root_logger=False, broker_connection_retry_on_startup=True, dedup_limit_groups=GROUPS
    )
    celery_dedup.install(web_app)
    register(web_app)
    return web_app


app = build()


def main(argv: list[str]) -> None:
    client = redis.Redis.from_url(str(app.conf.broker_url))
    if argv[0] == "race":
        threads, rounds, seconds = int(argv[1]), int(argv[2]), float(argv[3])

        def loop(n: int) -> None:
            for _ in range(rounds):
                hold(app, client, f"process:{os.getpid()}:{n}", seconds)

        workers = [threading.Thread(target=loop, args=(n,)) for n in range(threads)]
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join()
    elif argv[0] == "hang":
        with limits.acquire(app, argv[1], key="acme", timeout=60, lease=float(argv[2])) as holding:
            client.hset(HELD, str(os.getpid()), holding.token)
            print("HELD", flush=True)
            time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1:])
