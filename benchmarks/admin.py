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
import datetime
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
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

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as ``python benchmarks/<name>.py``: make ``benchmarks.*`` importable

import celery_dedup  # noqa: E402
from benchmarks.harness import save, versions  # noqa: E402
from celery_dedup import DedupTask, runtime  # noqa: E402
from celery_dedup.keys import member_for, new_nonce, new_task_id  # noqa: E402
from celery_dedup.lock import new_token  # noqa: E402
from celery_dedup.testing import RedisServer  # noqa: E402

DEFAULT_OUTPUT = ROOT / "benchmarks" / "results" / "admin.json"
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
            call = store.gate_call(
                member, new_task_id(key), new_nonce(), hold_ms=3_600_000, grace_ms=86_400_000, task_name=task
            )
            store.scripts.gate(call.keys, call.args, client=pipe)
            if len(pipe) >= batch:
                pipe.execute()
        pipe.execute()
    for n in range(0, count, 10):
        member = member_for(TASKS[n % len(TASKS)], f"order:{n:06d}")
        record = store.record(member) or {}
        token = new_token()
        decision = store.start(
            member,
            record["task_id"],
            token,
            lock_ms=60_000,
            gated=True,
            key_mode="lock",
            hostname="bench-worker",
            pid=1,
            retries=0,
            task_name=record["task"],
            record_ms=86_400_000,
        )
        if not decision.run:
            raise RuntimeError(f"start refused {member}: {decision}")
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    with RedisServer() as server:
        app = build_app(server.url)
        admin: redis.Redis = redis.Redis.from_url(server.url)
        print(f"server: {server.binary} ({server.version()})")
        print(", ".join(f"{k} {v}" for k, v in versions().items()))
        started = time.monotonic()
        seed(app, args.records)
        seed_s = time.monotonic() - started
        print(f"seeded {args.records} records in {seed_s:.1f} s", file=sys.stderr)
        client = configure_django(app)
        cases = [
            Case("first page", LIST),
            Case("state filter (failed)", LIST + "?state=failed"),
            Case("key search (order:0123)", LIST + "?q=order%3A0123"),
        ]
        cases.append(Case(f"later page ({args.later} x Next)", later_page_url(client, args.later)))
        for case in cases:
            case.rows = len(_ROW.findall(render(client, case.url)))  # warm-up, and what the page shows
        load_before = os.getloadavg()[0]
        clock = time.perf_counter_ns
        for i in range(args.renders):
            for case in cases[i % len(cases) :] + cases[: i % len(cases)]:
                start = clock()
                render(client, case.url)
                case.times_ms.append((clock() - start) / 1e6)
        load_after = os.getloadavg()[0]
        for case in cases:
            measure_case(client, admin, case, 5)
        admin.close()
        app.close()
        return {
            "benchmark": "admin",
            "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "server": {"binary": server.binary, "version": server.version()},
            "versions": {**versions(), "django": django.get_version()},
            "machine": {
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "loadavg_1m_before": load_before,
                "loadavg_1m_after": load_after,
            },
            "settings": {"records": args.records, "renders": args.renders, "later": args.later},
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


def table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| page | rows | median ms | min\N{EN DASH}max ms | Redis commands/render |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['case']} | {row['rows']} | {row['median_ms']:.1f} | "
            f"{row['min_ms']:.1f}\N{EN DASH}{row['max_ms']:.1f} | {row['redis_commands_per_render']:g} |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0] if __doc__ else None)
    parser.add_argument("--records", type=int, default=100_000, help="records seeded (default 100000)")
    parser.add_argument("--renders", type=int, default=20, help="timed renders per page (default 20)")
    parser.add_argument("--later", type=int, default=10, help="Next clicks to the later page (default 10)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON result file")
    args = parser.parse_args(argv)
    if args.records < 10_000 or args.renders < 1 or args.later < 1:
        parser.error("--records must be at least 10000, --renders and --later at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print()
    print(
        f"admin record list: {args.records} records, {args.renders} renders per page, "
        f"load average {result['machine']['loadavg_1m_before']:.2f} before, "
        f"{result['machine']['loadavg_1m_after']:.2f} after"
    )
    print()
    print(table(result["cases"]))
    save(args.output, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
