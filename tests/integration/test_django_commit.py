"""Django's ``delay_on_commit`` / ``apply_async_on_commit`` on a DedupTask, in real database transactions.

The gate runs when the transaction commits; a rollback publishes nothing and
holds no key. Each test runs on SQLite (the test settings' database) and on
PostgreSQL when Debian's server binaries and psycopg are installed: the
``postgres`` fixture then starts a throw-away server on a Unix socket.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import django
import pytest
import redis
from celery import Celery
from django.conf import settings

if not settings.configured:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django_settings")
django.setup()

from celery.contrib.django.task import DjangoTask  # noqa: E402
from django.db import DEFAULT_DB_ALIAS, connections, transaction  # noqa: E402
from django.db.utils import OperationalError  # noqa: E402

from celery_dedup import DedupKeyError, DedupTask  # noqa: E402
from celery_dedup.keys import KeySchema, member_for  # noqa: E402

from ..conftest import AppFactory, queued_messages, wait_for  # noqa: E402

HELD = KeySchema("dedup").held
TABLE = "dedup_commit_orders"
PG_ALIAS = "postgres"
POSTGRES_ROOT = Path("/usr/lib/postgresql")


class Rollback(Exception):
    """Raised inside ``transaction.atomic()`` to roll it back."""


def postgres_bin() -> Path | None:
    """The newest installed Debian PostgreSQL server's bin directory, if any."""
    found = sorted(POSTGRES_ROOT.glob("*/bin/postgres"), key=lambda p: int(p.parent.parent.name), reverse=True)
    return found[0].parent if found else None


@pytest.fixture(scope="module")
def postgres() -> Iterator[str]:
    """A PostgreSQL server on a Unix socket in a fresh directory, as Django database alias ``postgres``.

    The test settings are shared by the whole process, so the alias is added to
    Django's connection handler for this module only. As root, the server runs
    as the ``postgres`` user (PostgreSQL refuses to run as root).
    """
    bindir = postgres_bin()
    if bindir is None:
        pytest.skip(f"no PostgreSQL server under {POSTGRES_ROOT} (Debian's postgresql package)")
    pytest.importorskip("psycopg", reason="PostgreSQL tests need psycopg (the test extra)")
    run_as: dict[str, Any] = {}
    if os.geteuid() == 0:
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no postgres user to run PostgreSQL as")
        run_as = {"user": owner.pw_uid, "group": owner.pw_gid, "extra_groups": []}
    directory = tempfile.mkdtemp(prefix="celery-dedup-pg-")
    server: subprocess.Popen[bytes] | None = None
    log = Path(directory) / "server.log"
    try:
        if run_as:
            os.chown(directory, run_as["user"], run_as["group"])
        data = os.path.join(directory, "data")
        initdb = [str(bindir / "initdb"), "-D", data, "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync"]
        subprocess.run(initdb, check=True, capture_output=True, cwd=directory, **run_as)
        with log.open("wb") as out:
            server = subprocess.Popen(
                [str(bindir / "postgres"), "-D", data, "-k", directory, "-c", "listen_addresses=", "-F"],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=directory,
                **run_as,
            )
        conf = {"ENGINE": "django.db.backends.postgresql", "NAME": "postgres", "USER": "postgres", "HOST": directory}
        both = {DEFAULT_DB_ALIAS: dict(settings.DATABASES[DEFAULT_DB_ALIAS]), PG_ALIAS: conf}
        connections.settings[PG_ALIAS] = connections.configure_settings(both)[PG_ALIAS]
        started = server
        wait_for(lambda: started.poll() is not None or _connects(PG_ALIAS), 30, "PostgreSQL accepting connections")
        if server.poll() is not None:
            raise RuntimeError(f"PostgreSQL exited:\n{log.read_text(errors='replace')}")
        yield PG_ALIAS
    finally:
        if PG_ALIAS in connections.settings:
            connections[PG_ALIAS].close()
            del connections[PG_ALIAS]
            del connections.settings[PG_ALIAS]
        if server is not None:
            server.send_signal(signal.SIGINT)  # fast shutdown
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        shutil.rmtree(directory, ignore_errors=True)


def _connects(alias: str) -> bool:
    try:
        connections[alias].ensure_connection()
    except OperationalError:
        connections[alias].close()
        return False
    return True


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request: pytest.FixtureRequest) -> str:
    """The alias of the database a test's transactions run on, with an empty orders table."""
    alias = DEFAULT_DB_ALIAS if request.param == "sqlite" else request.getfixturevalue("postgres")
    assert connections[alias].vendor == request.param
    with connections[alias].cursor() as cursor:
        cursor.execute(f"CREATE TABLE IF NOT EXISTS {TABLE} (id integer PRIMARY KEY, note varchar(50))")
        cursor.execute(f"DELETE FROM {TABLE}")
    return alias


def add_order(alias: str, order_id: int) -> None:
    with connections[alias].cursor() as cursor:
        cursor.execute(f"INSERT INTO {TABLE} (id, note) VALUES (%s, %s)", [order_id, "new"])


def orders(alias: str) -> list[int]:
    with connections[alias].cursor() as cursor:
        cursor.execute(f"SELECT id FROM {TABLE} ORDER BY id")
        return [row[0] for row in cursor.fetchall()]


@pytest.fixture
def app(make_app: AppFactory, monkeypatch: pytest.MonkeyPatch) -> Celery:
    """An app built as a Django project builds it: Celery's Django fix-up makes ``DjangoTask`` its base task."""
    monkeypatch.setenv("DJANGO_SETTINGS_MODULE", os.environ.get("DJANGO_SETTINGS_MODULE", "tests.django_settings"))
    return make_app()


def charge_task(app: Celery, **options: Any) -> Any:
    @app.task(base=DedupTask, dedup_key="order:{order_id}", shared=False, **options)
    def charge(order_id: int, amount: int = 0) -> int:
        return order_id

    return charge


def call_on_commit(task: Any, alias: str, *args: Any) -> None:
    """``delay_on_commit`` on the default database; ``apply_async_on_commit(using=...)`` on another."""
    if alias == DEFAULT_DB_ALIAS:
        assert task.delay_on_commit(*args) is None
    else:
        assert task.apply_async_on_commit(args, using=alias) is None


def test_two_calls_in_one_transaction_publish_one_message_at_commit(app: Celery, r: redis.Redis, database: str) -> None:
    assert issubclass(app.Task, DjangoTask)  # what the project's other tasks get
    charge = charge_task(app)
    member = member_for(charge.name, "order:42").encode()

    with transaction.atomic(using=database):
        add_order(database, 42)
        call_on_commit(charge, database, 42, 10)
        call_on_commit(charge, database, 42, 10)
        assert queued_messages(r) == [], "published before the commit"
        assert not r.smembers(HELD)
        assert charge.dedup_status(42) is None

    assert orders(database) == [42]
    messages = queued_messages(r)
    assert len(messages) == 1, messages
    assert r.smembers(HELD) == {member}
    record = charge.dedup_status(42)
    assert record is not None
    assert (record.state, record.task_id, record.duplicates) == ("queued", messages[0]["headers"]["id"], 1)


def test_rolled_back_transaction_publishes_nothing_and_holds_no_key(app: Celery, r: redis.Redis, database: str) -> None:
    charge = charge_task(app)

    with pytest.raises(Rollback), transaction.atomic(using=database):
        add_order(database, 42)
        call_on_commit(charge, database, 42, 10)
        call_on_commit(charge, database, 42, 10)
        raise Rollback

    assert orders(database) == []
    assert queued_messages(r) == []
    assert not r.smembers(HELD)
    assert charge.dedup_status(42) is None
    # The key was never held: the next committed call is accepted.
    with transaction.atomic(using=database):
        call_on_commit(charge, database, 42, 10)
    assert len(queued_messages(r)) == 1
    record = charge.dedup_status(42)
    assert record is not None
    assert (record.state, record.duplicates) == ("queued", 0)


def test_rolled_back_savepoint_drops_only_its_calls(app: Celery, r: redis.Redis, database: str) -> None:
    charge = charge_task(app)

    with transaction.atomic(using=database):
        call_on_commit(charge, database, 1)
        with pytest.raises(Rollback), transaction.atomic(using=database):
            call_on_commit(charge, database, 2)
            raise Rollback
        assert queued_messages(r) == []

    assert [m["headers"]["id"].split("~")[0] for m in queued_messages(r)] == ["order:1"]
    assert r.smembers(HELD) == {member_for(charge.name, "order:1").encode()}


def test_a_bad_key_raises_inside_the_transaction(app: Celery, r: redis.Redis, database: str) -> None:
    charge = charge_task(app)

    with pytest.raises(DedupKeyError), transaction.atomic(using=database):
        add_order(database, 42)
        call_on_commit(charge, database, object())

    assert orders(database) == []
    assert queued_messages(r) == []


def test_duplicate_under_raise_policy_is_answered_at_commit_and_later_callbacks_run(
    app: Celery, r: redis.Redis, database: str
) -> None:
    """An exception at commit would reach no caller, and Django would skip the transaction's later callbacks."""
    charge = charge_task(app, dedup_on_duplicate="raise")
    ran: list[str] = []

    with transaction.atomic(using=database):
        call_on_commit(charge, database, 42)
        call_on_commit(charge, database, 42)
        call_on_commit(charge, database, 43)
        transaction.on_commit(lambda: ran.append("later"), using=database)

    assert ran == ["later"]
    assert sorted(m["headers"]["id"].split("~")[0] for m in queued_messages(r)) == ["order:42", "order:43"]
    record = charge.dedup_status(42)
    assert record is not None and record.duplicates == 1


def test_own_on_commit_callback_gets_the_dedup_answer(app: Celery, r: redis.Redis) -> None:
    """The documented way to learn, at commit, whether a call was a duplicate and of which run."""
    charge = charge_task(app)
    results: list[Any] = []

    with transaction.atomic():
        transaction.on_commit(lambda: results.append(charge.delay(42, 10)))
        transaction.on_commit(lambda: results.append(charge.delay(42, 10)))
        assert results == []

    first, second = results
    assert (first.deduplicated, second.deduplicated) == (False, True)
    assert second.id == first.id == queued_messages(r)[0]["headers"]["id"]


def test_outside_a_transaction_the_call_is_published_at_once(app: Celery, r: redis.Redis) -> None:
    charge = charge_task(app)

    charge.delay_on_commit(42)
    charge.delay_on_commit(42)

    assert len(queued_messages(r)) == 1
    record = charge.dedup_status(42)
    assert record is not None and record.duplicates == 1
