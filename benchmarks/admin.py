"""How long the Django admin takes to render the status record list over 100,000 records.

What it measures: the wall time of one ``GET`` of the record list through
Django's test client, logged in as a superuser (session, auth, template
rendering and the Redis reads all included), for

- ``first page``: no filter;
- ``state filter``: ``?state=failed`` (a tenth of the records);
- ``key search``: ``?q=order:0123`` (a business-key prefix matching 100 keys);
- ``later page``: the page reached by following "Next" ``--later`` times.

Records are made by the real scripts: ``--records`` runs gated (the gate
script, 1,000 per pipeline), a tenth of them then started and finished as
failed (the guard's start and finish scripts). Each case is rendered
``--renders`` times after one warm-up render, interleaved round-robin. Redis
commands per render come from ``INFO commandstats`` deltas (the deltas'
own INFO calls left out).

Run it from the repository root::

    .venv/bin/python -m benchmarks.admin [--records 100000] [--renders 20] [--output FILE]

It starts its own server, prints a Markdown table and writes
``benchmarks/results/admin.json``. Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import django
import redis
from celery import Celery
from django.apps import apps
from django.conf import settings
from django.contrib import admin
from django.core.management import call_command
from django.test import Client
from django.urls import path

import celery_dedup
from benchmarks import harness
from celery_dedup import DedupTask, runtime
from celery_dedup.keys import member_for, new_nonce, new_task_id
from celery_dedup.testing import RedisServer
from celery_dedup.worker.lock import new_token

LIST = "/admin/celery_dedup/record/"
TASKS = ("shop.charge", "shop.refund")

#: The benchmark's URLconf (it is its own ``ROOT_URLCONF``); filled once Django is set up.
urlpatterns: list[Any] = []


@dataclass
class Case:
    name: str
    url: str
    times_ms: list[float] = field(default_factory=list)
    rows: int = 0
    commands: float = 0.0


def build_app(url: str) -> Celery:
    app = Celery("bench_admin", set_as_current=False)
    app.conf.update(broker_url=url, broker_connection_retry_on_startup=False, task_ignore_result=True)
    celery_dedup.install(app)
    for name in TASKS:
        app.task(name=name, base=DedupTask, dedup_key="order:{order_id}", shared=False)(_order_task)
    return app


def _order_task(order_id: int) -> int:
    return order_id


def seed(app: Celery, count: int, *, batch: int = 1000) -> None:
    """``count`` gated runs (keys ``order:000000``...); every tenth then fails."""
    store = runtime.store_for(app)
    with store.client.pipeline(transaction=False) as pipe:
        for n in range(count):
            key, task = f"order:{n:06d}", TASKS[n % len(TASKS)]
            member = member_for(task, key)
            call = store.gate_call(member, new_task_id(key), new_nonce(), hold_ms=3_600_000, grace_ms=86_400_000)
            store.scripts.run(call.keys, call.command, client=pipe)
            if len(pipe) >= batch:
                pipe.execute()
        pipe.execute()
    for n in range(0, count, 10):
        member = member_for(TASKS[n % len(TASKS)], f"order:{n:06d}")
        record = store.record(member) or {}
        token = new_token()
        harness.start_run(store, member, record["task_id"], token, hostname="bench-worker", pid=1)
        store.finish(
            member, record["task_id"], "failed", drop=True, record_ms=86_400_000, token=token, role="run", error="bench"
        )


def configure_django(app: Celery) -> Any:
    """Django with the admin and celery-dedup's app on an in-memory database; returns a superuser client."""
    settings.configure(
        SECRET_KEY="celery-dedup-benchmark",
        ALLOWED_HOSTS=["testserver"],
        USE_TZ=True,
        ROOT_URLCONF=__name__,
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        INSTALLED_APPS=[
            "django.contrib.admin",
            "django.contrib.auth",
            "django.contrib.contenttypes",
            "django.contrib.sessions",
            "django.contrib.messages",
            "celery_dedup.contrib.django",
        ],
        MIDDLEWARE=[
            "django.contrib.sessions.middleware.SessionMiddleware",
            "django.middleware.csrf.CsrfViewMiddleware",
            "django.contrib.auth.middleware.AuthenticationMiddleware",
            "django.contrib.messages.middleware.MessageMiddleware",
        ],
        TEMPLATES=[
            {
                "BACKEND": "django.template.backends.django.DjangoTemplates",
                "APP_DIRS": True,
                "OPTIONS": {
                    "context_processors": [
                        "django.template.context_processors.request",
                        "django.contrib.auth.context_processors.auth",
                        "django.contrib.messages.context_processors.messages",
                    ]
                },
            }
        ],
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
        PASSWORD_HASHERS=["django.contrib.auth.hashers.MD5PasswordHasher"],
        STATIC_URL="/static/",
        CELERY_DEDUP_APP=app,
    )
    django.setup()
    urlpatterns.append(path("admin/", admin.site.urls))
    call_command("migrate", verbosity=0, interactive=False)
    client = Client()
    users = apps.get_model("auth", "User")
    client.force_login(users.objects.create_superuser("root", "root@example.com", "pw"))
    return client


_ROW = re.compile(r'<tr class="state-')
_NEXT = re.compile(r'<a href="(\?[^"]*)" class="next-page">')


def render(client: Any, url: str) -> str:
    response = client.get(url)
    if response.status_code != 200:
        raise RuntimeError(f"GET {url}: HTTP {response.status_code}")
    return str(response.content.decode())


def later_page_url(client: Any, pages: int) -> str:
    """The URL "Next" leads to after ``pages`` clicks from the first page."""
    url = LIST
    for _ in range(pages):
        found = _NEXT.search(render(client, url))
        if not found:
            raise RuntimeError(f"no next page after {url}")
        url = LIST + found.group(1).replace("&amp;", "&")
    return url


def command_count(admin: redis.Redis) -> int:
    stats = admin.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info")


def measure_case(client: Any, admin: redis.Redis, case: Case, renders: int) -> None:
    before = command_count(admin)
    for _ in range(renders):
        render(client, case.url)
    case.commands = (command_count(admin) - before) / renders


def run(script: harness.Script, args: argparse.Namespace) -> dict[str, Any]:
    with RedisServer() as server:
        app = build_app(server.url)
        admin: redis.Redis = redis.Redis.from_url(server.url)
        script.header(f"server: {server.binary} ({server.version()}); django {django.get_version()}")
        started = time.monotonic()
        seed(app, args.records)
        seed_s = time.monotonic() - started
        harness.progress(f"seeded {args.records} records in {seed_s:.1f} s")
        client = configure_django(app)
        cases = [
            Case("first page", LIST),
            Case("state filter (failed)", LIST + "?state=failed"),
            Case("key search (order:0123)", LIST + "?q=order%3A0123"),
        ]
        cases.append(Case(f"later page ({args.later} x Next)", later_page_url(client, args.later)))
        for case in cases:
            case.rows = len(_ROW.findall(render(client, case.url)))  # warm-up, and what the page shows
        clock = time.perf_counter_ns
        for i in range(args.renders):
            for case in cases[i % len(cases) :] + cases[: i % len(cases)]:
                start = clock()
                render(client, case.url)
                case.times_ms.append((clock() - start) / 1e6)
        for case in cases:
            measure_case(client, admin, case, 5)
        admin.close()
        app.close()
        return {
            "server": {"binary": server.binary, "version": server.version()},
            "django": django.get_version(),
            "seed_s": seed_s,
            "cases": [
                {
                    "case": case.name,
                    "url": case.url,
                    "rows": case.rows,
                    "median_ms": statistics.median(case.times_ms),
                    "min_ms": min(case.times_ms),
                    "max_ms": max(case.times_ms),
                    "times_ms": case.times_ms,
                    "redis_commands_per_render": case.commands,
                }
                for case in cases
            ],
        }


def main(argv: Sequence[str] | None = None) -> int:
    script = harness.Script("admin", __doc__)
    script.option("--records", 100_000, "records seeded", minimum=10_000)
    script.option("--renders", 20, "timed renders per page")
    script.option("--later", 10, "Next clicks to the later page")
    args = script.parse(argv)
    result = run(script, args)
    print()
    print(f"admin record list: {args.records} records, {args.renders} renders per page")
    print()
    print(
        harness.table(
            ["page", "rows", "median ms", "min ms", "max ms", "Redis commands/render"],
            [
                [
                    row["case"],
                    row["rows"],
                    row["median_ms"],
                    row["min_ms"],
                    row["max_ms"],
                    row["redis_commands_per_render"],
                ]
                for row in result["cases"]
            ],
        )
    )
    script.save(args, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
