"""The Django admin over the status records: real Valkey, records made by the real scripts, Django's test client."""

from __future__ import annotations

import io
import os
import re
from collections.abc import Iterator
from typing import Any

import django
import pytest
import redis
from celery import Celery
from celery.app import app_or_default
from django.conf import settings

if not settings.configured:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django_settings")
django.setup()

from celery.result import AsyncResult  # noqa: E402
from django.contrib.admin.models import CHANGE, LogEntry  # noqa: E402
from django.contrib.admin.utils import quote  # noqa: E402
from django.contrib.auth.models import Permission, User  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.test import Client, override_settings  # noqa: E402
from django.test.utils import setup_test_environment, teardown_test_environment  # noqa: E402
from django.utils.html import escape  # noqa: E402

from celery_dedup import DedupTask, operations, runtime  # noqa: E402
from celery_dedup.contrib.django.conf import celery_app  # noqa: E402
from celery_dedup.exceptions import DedupConfigError  # noqa: E402
from celery_dedup.keys import KeySchema, member_for, new_nonce, new_task_id  # noqa: E402
from celery_dedup.store.format import old_history  # noqa: E402
from celery_dedup.store.status import FIELD_DOC  # noqa: E402

from .._records import Records, keyed_tasks  # noqa: E402
from ..conftest import AppFactory, Server, in_process_worker, wait_for  # noqa: E402

SCHEMA = KeySchema("dedup")
LIST = "/admin/celery_dedup/record/"
PURGE = LIST + "purge/"
STATS = LIST + "stats/"

#: Set by a test to check that ``CELERY_DEDUP_APP`` resolves a dotted path.
APP: Celery | None = None


def detail_url(member: str) -> str:
    return f"{LIST}{quote(member)}/change/"


def release_url(member: str) -> str:
    return f"{LIST}{quote(member)}/release/"


def requeue_url(member: str) -> str:
    return f"{LIST}{quote(member)}/requeue/"


@pytest.fixture(scope="module")
def users() -> Iterator[dict[str, User]]:
    """An in-memory database with one user per access level."""
    setup_test_environment()
    call_command("migrate", verbosity=0, interactive=False)
    view = Permission.objects.get(codename="view_record", content_type__app_label="celery_dedup")
    User.objects.all().delete()  # the in-memory database is the process's: another module may have used it
    made = {
        "root": User.objects.create_superuser("root", "root@example.com", "pw"),
        "nobody": User.objects.create_user("nobody", is_staff=True),
        "viewer": User.objects.create_user("viewer", is_staff=True),
    }
    made["viewer"].user_permissions.add(view)
    yield made
    teardown_test_environment()


def client_for(users: dict[str, User], name: str | None, **options: Any) -> Client:
    client = Client(**options)
    if name is not None:
        client.force_login(users[name])
    return client


@pytest.fixture
def app(make_app: AppFactory) -> Iterator[Celery]:
    app = make_app()
    with override_settings(CELERY_DEDUP_APP=app):
        yield app


@pytest.fixture
def tasks(app: Celery) -> tuple[Any, Any]:
    return keyed_tasks(app)


@pytest.fixture
def charges(app: Celery, tasks: tuple[Any, Any]) -> Records:
    return Records(app, tasks[0])


@pytest.fixture
def refunds(app: Celery, tasks: tuple[Any, Any]) -> Records:
    return Records(app, tasks[1])


@pytest.fixture
def root(users: dict[str, User]) -> Client:
    return client_for(users, "root")


def listed(response: Any) -> list[str]:
    """The members of the rows a list page rendered."""
    assert response.status_code == 200, response.status_code
    return [row.member for row in response.context["listing"].rows]


def record(app: Celery, member: str) -> dict[str, str]:
    found = runtime.store_for(app).record(member)
    assert found is not None
    return found


# --- setup ---------------------------------------------------------------------------------------


def test_no_migration_is_missing(users: dict[str, User]) -> None:
    out = io.StringIO()
    call_command("makemigrations", "celery_dedup", "--check", "--dry-run", stdout=out)
    assert "No changes detected" in out.getvalue()


def test_admin_index_has_the_section(app: Celery, root: Client) -> None:
    page = root.get("/admin/").content.decode()
    assert "Celery dedup" in page
    assert f'href="{LIST}"' in page and "Status records" in page


def test_app_setting_takes_a_dotted_path(make_app: AppFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    app = make_app()
    monkeypatch.setattr(f"{__name__}.APP", app)
    for path in (f"{__name__}:APP", f"{__name__}.APP"):
        with override_settings(CELERY_DEDUP_APP=path):
            assert celery_app() is app


def test_app_setting_defaults_to_the_current_app(make_app: AppFactory) -> None:
    previous = app_or_default()
    app = make_app()
    app.set_current()
    try:
        assert not hasattr(settings, "CELERY_DEDUP_APP")
        assert celery_app() is app
    finally:
        previous.set_current()


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("no_such_module.celery:app", "cannot import 'no_such_module.celery'"),
        ("tests.django_settings:nope", "has no attribute 'nope'"),
        ("tests.django_settings:SECRET_KEY", "names a str, not a Celery app"),
        ("app", 'must be "module:attribute"'),
        (42, "must be a dotted path"),
    ],
)
def test_app_setting_misconfigured_names_setting_and_value(value: Any, reason: str) -> None:
    with override_settings(CELERY_DEDUP_APP=value), pytest.raises(DedupConfigError) as caught:
        celery_app()
    assert caught.value.setting == "CELERY_DEDUP_APP" and caught.value.value == value
    assert reason in str(caught.value)


def test_app_setting_refuses_an_app_never_installed(make_app: AppFactory, root: Client) -> None:
    """Refused as any setting the store cannot be used with: the 503 page says why."""
    bare = make_app(install=False)
    with override_settings(CELERY_DEDUP_APP=bare):
        response = root.get(LIST)
    assert response.status_code == 503
    assert "DedupConfigError" in response.content.decode() and "install(app) was not called" in (
        response.content.decode()
    )


# --- who may do what -----------------------------------------------------------------------------


def test_anonymous_is_sent_to_login(app: Celery, charges: Records, users: dict[str, User]) -> None:
    run = charges.queued(1)
    client = client_for(users, None)
    for url in (LIST, detail_url(run.member), release_url(run.member), requeue_url(run.member), PURGE):
        response = client.get(url)
        assert response.status_code == 302 and response["Location"].startswith("/admin/login/"), url
    assert client.post(release_url(run.member)).status_code == 302
    assert record(app, run.member)["state"] == "queued"


def test_staff_without_permission_is_forbidden(app: Celery, charges: Records, users: dict[str, User]) -> None:
    run = charges.queued(1)
    client = client_for(users, "nobody")
    for url in (LIST, detail_url(run.member), release_url(run.member), requeue_url(run.member), PURGE, STATS):
        assert client.get(url).status_code == 403, url
    assert client.post(release_url(run.member)).status_code == 403
    assert client.post(PURGE, {"states": ["succeeded"]}).status_code == 403
    assert "Celery dedup" not in client.get("/admin/").content.decode()


def test_view_permission_lists_and_shows_but_may_not_act(app: Celery, charges: Records, users: dict[str, User]) -> None:
    run = charges.queued(1)
    done = charges.ended(2, "succeeded")
    failed = charges.ended(3, "failed")
    client = client_for(users, "viewer")

    assert listed(client.get(LIST)) == [failed.member, done.member, run.member]
    page = client.get(detail_url(failed.member))
    assert page.status_code == 200
    assert "Release key" not in page.content.decode() and "Re-enqueue" not in page.content.decode()
    assert client.get(requeue_url(failed.member)).status_code == 403
    assert client.post(requeue_url(failed.member)).status_code == 403
    assert record(app, failed.member)["task_id"] == failed.task_id
    assert "Purge finished records" not in client.get(LIST).content.decode()
    assert client.get(release_url(run.member)).status_code == 403
    assert client.post(release_url(run.member), {"force": "on"}).status_code == 403
    assert client.get(PURGE).status_code == 403
    assert client.post(PURGE, {"states": ["succeeded"]}).status_code == 403
    assert record(app, run.member)["state"] == "queued"
    assert record(app, done.member)["state"] == "succeeded"


def test_post_without_csrf_token_is_rejected(app: Celery, charges: Records, users: dict[str, User]) -> None:
    run = charges.queued(1)
    client = client_for(users, "root", enforce_csrf_checks=True)

    assert client.post(release_url(run.member)).status_code == 403
    assert client.post(PURGE, {"states": ["succeeded"]}).status_code == 403
    assert record(app, run.member)["state"] == "queued"

    client.get(release_url(run.member))  # sets the CSRF cookie, as a browser would
    token = client.cookies["csrftoken"].value
    response = client.post(release_url(run.member), {"csrfmiddlewaretoken": token})
    assert response.status_code == 302
    assert record(app, run.member)["state"] == "released"


# --- the list ------------------------------------------------------------------------------------


def test_list_shows_every_column_and_links_to_the_record(app: Celery, charges: Records, root: Client) -> None:
    run = charges.started(7)
    charges.task.delay(7)

    response = root.get(LIST)

    assert listed(response) == [run.member]
    page = response.content.decode()
    for header in ("Key and task", "State", "Task id", "Last update", "Worker", "Counters"):
        assert f"<span>{header}</span>" in page
    assert f'<a href="{detail_url(run.member)}" class="field-key">order:7</a>' in page
    assert '<div class="field-task">shop.<wbr>charge</div>' in page
    assert "1 attempt · 1 duplicate" in page
    assert re.search(r'<span class="when" title="[^"]+">\d+ s ago</span>', page)
    row = response.context["listing"].rows[0].status
    assert (row.task, row.state, row.task_id, row.worker, row.attempts) == (
        "shop.charge",
        "started",
        run.task_id,
        "worker-1",
        1,
    )
    assert row.updated_at is not None and row.updated_at.year >= 2024


def test_list_filters_by_state_and_task_and_searches_by_key_prefix(
    app: Celery, charges: Records, refunds: Records, root: Client
) -> None:
    queued = charges.queued(10)
    failed = charges.ended(11, "failed", error="boom")
    refund = refunds.ended(12, "succeeded")
    other = charges.queued(200)
    charges.task.delay(10)  # a duplicate: counted on the record

    assert listed(root.get(LIST, {"state": "failed"})) == [failed.member]
    assert listed(root.get(LIST, {"state": "queued"})) == [other.member, queued.member]
    assert listed(root.get(LIST, {"task": "shop.refund"})) == [refund.member]
    assert set(listed(root.get(LIST, {"task": "shop.charge"}))) == {queued.member, failed.member, other.member}
    assert listed(root.get(LIST, {"q": "order:1"})) == [queued.member, failed.member, refund.member]
    assert listed(root.get(LIST, {"q": "order:1", "task": "shop.charge", "state": "queued"})) == [queued.member]
    assert listed(root.get(LIST, {"state": "revoked"})) == []
    assert listed(root.get(LIST, {"task": "shop.unknown"})) == []

    response = root.get(LIST, {"state": "queued"})
    listing = response.context["listing"]
    counts = {c.label: c.count for c in listing.state_choices}
    assert (counts["queued"], counts["failed"], counts["succeeded"], counts["started"]) == (2, 1, 1, 0)
    task_counts = {c.label: c.count for c in listing.task_choices}
    # No per-task index is kept: the task choices go without counts.
    assert (task_counts["All"], task_counts["shop.charge"], task_counts["shop.refund"]) == (None, None, None)
    assert [c.label for c in listing.state_choices if c.selected] == ["queued"]
    duplicates = {row.member: row.status.duplicates for row in listing.rows}
    assert duplicates[queued.member] == 1


def test_list_pages_with_the_cursor(app: Celery, charges: Records, root: Client) -> None:
    runs = [charges.queued(n) for n in range(230)]
    client_redis: redis.Redis = runtime.store_for(app).client
    # Every record is queued: the listing is that state's index, newest first (ties: by member).
    newest_first = [m.decode() for m in client_redis.zrevrange(SCHEMA.state_index("queued"), 0, -1)]
    assert sorted(newest_first) == sorted(run.member for run in runs)

    first = root.get(LIST)
    second = root.get(LIST + first.context["listing"].next_url)
    third = root.get(LIST + second.context["listing"].next_url)

    assert listed(first) == newest_first[:100]
    assert listed(second) == newest_first[100:200]
    assert listed(third) == newest_first[200:]
    assert third.context["listing"].next_url is None
    back = root.get(LIST + third.context["listing"].previous_url)
    assert listed(back) == newest_first[100:200]
    assert listed(root.get(LIST + back.context["listing"].previous_url)) == newest_first[:100]
    assert listed(root.get(LIST + third.context["listing"].first_url)) == newest_first[:100]
    assert listed(root.get(LIST, {"cursor": "not-a-number"})) == newest_first[:100]


@pytest.mark.parametrize("cursor", ["²", "٣", "-1", "1.0", " 5"])
def test_list_reads_a_cursor_that_is_no_number_as_the_first_page(
    app: Celery, charges: Records, root: Client, cursor: str
) -> None:
    runs = [charges.queued(n) for n in range(3)]
    assert set(listed(root.get(LIST, {"cursor": cursor}))) == {run.member for run in runs}
    assert set(listed(root.get(LIST, {"cursor": "1", "trail": f"0,{cursor}"}))) <= {run.member for run in runs}


def test_list_past_the_end_is_an_empty_last_page(app: Celery, charges: Records, root: Client) -> None:
    charges.queued(1)
    response = root.get(LIST, {"cursor": "1~dDpr"})  # a place older than every record
    assert listed(response) == []
    assert response.context["listing"].next_url is None
    assert response.context["listing"].first_url is not None


# --- one record ----------------------------------------------------------------------------------


def test_detail_shows_fields_history_hold_and_lock(app: Celery, charges: Records, root: Client) -> None:
    run = charges.started("a/b_c%d")  # type: ignore[arg-type]  # odd characters survive the URL

    response = root.get(detail_url(run.member))

    assert response.status_code == 200
    page = response.content.decode()
    groups = {group.title: {row.name: row for row in group.rows} for group in response.context["groups"]}
    assert list(groups) == ["Run", "Timing", "Worker and lock", "Counters", "Internals"]
    assert {"task_id", "args", "kwargs"} <= set(groups["Run"])
    assert not {"state", "task"} & set(groups["Run"]), "the summary above shows them"
    assert {"queued_at", "started_at", "updated_at", "held_until"} <= set(groups["Timing"])
    assert {"worker", "pid", "lock"} <= set(groups["Worker and lock"])
    assert {"attempts", "retries", "duplicates"} <= set(groups["Counters"])
    assert {"nonce", "queue", "tag", "unacked"} <= set(groups["Internals"])
    assert '<span class="dedup-state state-started">started</span>' in page
    assert groups["Counters"]["attempts"].value == 1
    assert groups["Timing"]["started_at"].time is not None
    assert [(e.state, e.task_id) for e in response.context["history"]] == [
        ("started", run.task_id),
        ("queued", run.task_id),
    ]
    assert all(e.at is not None for e in response.context["history"])
    assert f'<code class="lock-token">{run.token}</code>' in page
    assert response.context["detail"].held
    assert 0 < response.context["lock_ttl_s"] <= 60
    assert '<dd class="key-held">yes, until' in page
    assert "Release key" in page


def test_detail_groups_fields_explains_them_and_folds_the_internals(
    app: Celery, charges: Records, root: Client
) -> None:
    done = charges.ended(4, "failed", error="ValueError: 4")

    response = root.get(detail_url(done.member))

    page = response.content.decode()
    for group in response.context["groups"]:
        for row in group.rows:
            assert escape(FIELD_DOC[row.name].help) in page, row.name
    assert re.search(r'<dd class="field-held_until">\s*not held', page), "held_until 0 is shown as not held"
    assert not re.search(r"<dd[^>]*>\s*0\s*</dd>", page.split('<details class="internals">')[0].split("Counters")[0])
    started = re.search(r'<dd class="field-started_at">(.*?)</dd>', page, re.S)
    assert started and re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", started.group(1)) and "ago" in started.group(1)
    internals = page.split('<details class="internals">', 1)
    assert len(internals) == 2, "internals are folded into a closed <details>"
    assert "field-nonce" in internals[1] and "field-nonce" not in internals[0]
    assert "field-payload" in internals[1]
    assert '<dd class="field-error"><code>ValueError: 4</code></dd>' in page


def test_detail_of_a_tombstone_says_what_is_left(app: Celery, charges: Records, root: Client) -> None:
    done = charges.ended(5, "succeeded")
    operations.purge(app, states=["succeeded"])

    page = root.get(detail_url(done.member)).content.decode()

    assert "purged" in page and "only the run id" in page
    assert done.task_id in page


def test_detail_lists_the_steps_with_their_state_and_idempotency_key(
    app: Celery, make_app: AppFactory, r: redis.Redis, root: Client
) -> None:
    """Steps done by a run, and one left running whose lock ran out (its executor died): shown in doubt."""
    eager = make_app("admin_steps", task_always_eager=True, task_eager_propagates=True)

    @eager.task(base=DedupTask, bind=True, shared=False, name="shop.ship", dedup_key="order:{n}")
    def ship(self: DedupTask, n: int) -> str:
        return str(self.dedup_once("label", lambda key: key))

    run = ship.delay(6)
    member = member_for("shop.ship", "order:6")
    store = runtime.store_for(app)
    r.set(SCHEMA.lock(member), "h:1:2:m:dead")  # a delivery that began a step, then died
    begun = store.step_begin(
        member, run.id, "h:1:2:m:dead", "s:post", "post", lock_ms=1, record_ms=60_000, on_doubt="retry"
    )
    assert begun.detail == "1"
    r.delete(SCHEMA.lock(member))
    wait_for(lambda: store.steps(member)[-1].state == "in doubt", 2, "the step's lock ran out")

    response = root.get(detail_url(member))

    assert response.status_code == 200
    page = response.content.decode()
    assert "Steps (dedup_once)" in page
    steps = {step.name: step for step in response.context["detail"].steps}
    assert (steps["label"].state, steps["label"].key) == ("done", run.get())
    assert steps["post"].state == "in doubt"
    assert '<tr class="step-done"' in page and '<tr class="step-in-doubt"' in page
    assert "shop.<wbr>ship:order:6:<wbr>~" in page, "the key, breakable"
    assert [entry.note for entry in response.context["history"] if entry.state == "step"][:2] == [
        "post started",
        "label done",
    ]


def test_detail_of_an_unknown_key_is_not_found(app: Celery, root: Client) -> None:
    assert root.get(detail_url("shop.charge:order:none")).status_code == 404
    assert root.get(release_url("shop.charge:order:none")).status_code == 404


def test_short_record_url_redirects_to_the_record(app: Celery, charges: Records, root: Client) -> None:
    run = charges.queued(3)
    response = root.get(f"{LIST}{quote(run.member)}/")
    assert response.status_code == 302 and response["Location"] == detail_url(run.member)


# --- actions -------------------------------------------------------------------------------------


def test_release_confirms_then_frees_a_queued_key(app: Celery, charges: Records, root: Client) -> None:
    run = charges.queued(5)

    confirm = root.get(release_url(run.member))
    assert confirm.status_code == 200
    assert "ends as <strong>released</strong>" in confirm.content.decode()
    assert record(app, run.member)["state"] == "queued"  # GET changes nothing

    done = root.post(release_url(run.member), {"token": ""}, follow=True)

    assert done.redirect_chain == [(detail_url(run.member), 302)]
    assert "Released shop.charge:order:5" in done.content.decode()
    assert record(app, run.member)["state"] == "released"
    assert runtime.store_for(app).history(run.member)[0].endswith("released by root")
    assert not charges.task.delay(5).deduplicated


def test_release_is_offered_only_where_something_is_held(app: Celery, charges: Records, root: Client) -> None:
    done = charges.ended(5, "succeeded")
    window = charges.ended(6, "succeeded", keep_key=True)
    store = runtime.store_for(app)
    history = store.history(done.member)

    assert "Release key" not in root.get(detail_url(done.member)).content.decode()
    assert "Release key" in root.get(detail_url(window.member)).content.decode()
    confirm = root.get(release_url(done.member))
    assert confirm.status_code == 200
    page = confirm.content.decode()
    assert "Nothing to release" in page and "Yes, release it" not in page
    assert "(its run's state is succeeded)" in page and "its run is" not in page

    refused = root.post(release_url(done.member), {"token": ""}, follow=True)

    assert refused.redirect_chain == [(detail_url(done.member), 302)]
    assert "Nothing to release" in refused.content.decode()
    assert "(the run&#x27;s state is succeeded)" in refused.content.decode()
    assert store.history(done.member) == history
    assert store.stats().get("shop.charge", {}).get("released", 0) == 0


def test_release_refuses_a_live_lock_without_force(app: Celery, charges: Records, root: Client) -> None:
    run = charges.started(6)

    confirm = root.get(release_url(run.member))
    assert confirm.context["form"]["token"].value() == run.token
    assert 'name="force"' in confirm.content.decode()

    refused = root.post(release_url(run.member), {"token": run.token}, follow=True)

    assert refused.redirect_chain == [(release_url(run.member), 302)]
    assert "Not released: a worker holds the execution lock" in refused.content.decode()
    assert record(app, run.member)["state"] == "started"
    assert runtime.store_for(app).client.get(SCHEMA.lock(run.member)) == run.token.encode()


def test_forced_release_deletes_the_lock_it_was_shown_and_names_the_user(
    app: Celery, charges: Records, root: Client
) -> None:
    run = charges.started(8)
    stale = root.post(release_url(run.member), {"force": "on", "token": "gone:1:ffff"}, follow=True)
    assert f"the lock now belongs to {run.token}" in stale.content.decode()
    assert record(app, run.member)["state"] == "started"

    done = root.post(release_url(run.member), {"force": "on", "token": run.token}, follow=True)

    assert "its execution lock was deleted" in done.content.decode()
    store = runtime.store_for(app)
    assert record(app, run.member)["state"] == "released"
    assert store.client.get(SCHEMA.lock(run.member)) is None
    assert not store.is_held(run.member)
    _, state, task_id, note = store.history(run.member)[0].split(" ", 3)
    assert (state, task_id) == ("released", run.task_id)
    # Who released it comes first; the entry is cut to 64 bytes, in the lock token.
    assert note.startswith("forced release by root, lock ")
    assert run.token.startswith(note.removeprefix("forced release by root, lock ")[:10])
    page = done.content.decode()
    assert escape(note) in page


def test_purge_deletes_finished_records_and_leaves_queued_and_started(
    app: Celery, charges: Records, root: Client
) -> None:
    queued = charges.queued(1)
    started = charges.started(2)
    finished = [charges.ended(3, "succeeded"), charges.ended(4, "failed")]

    confirm = root.get(PURGE)
    assert confirm.status_code == 200
    assert confirm.context["counts"]["succeeded"] == 1 and confirm.context["counts"]["failed"] == 1
    assert len(listed(root.get(LIST))) == 4  # GET changes nothing

    done = root.post(PURGE, {"states": ["succeeded", "failed", "released"]}, follow=True)

    assert "Purged 2 finished records." in done.content.decode()
    assert set(listed(done)) == {queued.member, started.member}
    store = runtime.store_for(app)
    # A purge leaves a tombstone (run id, ending, nonces), out of every listing.
    tombstones = [store.status(run.member) for run in finished]
    assert all(status is not None and status.purged for status in tombstones)
    assert store.record(queued.member) is not None and store.record(started.member) is not None


def test_purge_refuses_states_that_are_not_ended(app: Celery, charges: Records, root: Client) -> None:
    run = charges.queued(1)
    response = root.post(PURGE, {"states": ["queued"]})
    assert response.status_code == 200 and response.context["form"].errors
    assert record(app, run.member)["state"] == "queued"


def test_requeue_publishes_a_run_that_a_worker_executes(make_app: AppFactory, users: dict[str, User]) -> None:
    app = make_app()
    calls: list[tuple[int, str]] = []

    @app.task(name="shop.flaky", base=DedupTask, dedup_key="order:{order_id}", shared=False)
    def flaky(order_id: int, note: str = "") -> int:
        calls.append((order_id, note))
        if len(calls) == 1:
            raise RuntimeError("the first run fails")
        return order_id

    store = runtime.store_for(app)
    member = member_for("shop.flaky", "order:9")
    root = client_for(users, "root")
    with override_settings(CELERY_DEDUP_APP=app), in_process_worker(app):
        first = flaky.delay(9, note="again")
        wait_for(lambda: (store.record(member) or {}).get("state") == "failed", 10, "the first run to fail")
        assert f'href="{requeue_url(member)}"' in root.get(detail_url(member)).content.decode()

        confirm = root.get(requeue_url(member))
        assert confirm.context["arguments"] == ([9], {"note": "again"})
        assert store.record(member)["task_id"] == first.id  # type: ignore[index]  # GET changes nothing

        done = root.post(requeue_url(member), follow=True)

        new_id = store.record(member)["task_id"]  # type: ignore[index]
        assert new_id != first.id
        assert f"Re-enqueued as task id {new_id}." in done.content.decode()
        assert AsyncResult(new_id, app=app).get(timeout=10) == 9
    assert calls == [(9, "again"), (9, "again")]
    assert store.record(member)["state"] == "succeeded"  # type: ignore[index]


def test_requeue_without_payload_is_refused_with_a_reason(make_app: AppFactory, users: dict[str, User]) -> None:
    app = make_app(dedup_record_args=False)
    charges = Records(app, keyed_tasks(app)[0])
    failed = charges.ended(1, "failed")
    root = client_for(users, "root")
    with override_settings(CELERY_DEDUP_APP=app):
        assert "Re-enqueue" not in root.get(detail_url(failed.member)).content.decode()
        assert "cannot be re-enqueued" in root.get(requeue_url(failed.member)).content.decode()
        done = root.post(requeue_url(failed.member), follow=True)
    assert "Not re-enqueued: the record keeps no payload" in done.content.decode()
    assert record(app, failed.member)["task_id"] == failed.task_id


def test_actions_leave_admin_log_entries_and_the_requeued_run_names_who_asked(
    app: Celery, charges: Records, root: Client, users: dict[str, User]
) -> None:
    LogEntry.objects.all().delete()
    held = charges.queued(1)
    failed = charges.ended(2, "failed", error="boom")
    done = charges.ended(3, "succeeded")
    charges.ended(4, "succeeded")
    store = runtime.store_for(app)

    root.post(release_url(held.member), {"token": ""})
    root.post(release_url(done.member), {"token": ""})  # nothing held: nothing done, nothing logged
    root.post(requeue_url(failed.member))
    new_id = record(app, failed.member)["task_id"]
    root.post(PURGE, {"states": ["succeeded"]})

    entries = list(LogEntry.objects.order_by("id"))
    assert [(e.user, e.action_flag, e.object_id) for e in entries] == [
        (users["root"], CHANGE, held.member),
        (users["root"], CHANGE, failed.member),
        (users["root"], CHANGE, None),
    ]
    released, requeued, purged = (e.get_change_message() for e in entries)
    assert released == "Released the key; its run's state is now released."
    assert requeued == f"Re-enqueued as task id {new_id} (was {failed.task_id})."
    assert purged == "Purged 2 records in states succeeded."
    assert entries[0].get_admin_url() == detail_url(held.member)
    assert {e.content_type.model for e in entries} == {"record"}

    assert new_id != failed.task_id
    newest = store.history(failed.member)[0].split(" ", 3)
    assert newest[1:] == ["queued", new_id, f"re-enqueued by root from {failed.task_id}"]
    assert [e.object_repr for e in entries] == [held.member, failed.member, "status records"]
    assert f'href="{detail_url(held.member)}">{held.member}</a>' in root.get("/admin/").content.decode()


MARKUP = """<script>alert(1)</script>"><img src=x onerror=alert(2)>.x~y"""


def test_hostile_text_is_escaped_on_every_page(app: Celery, root: Client) -> None:
    store = runtime.store_for(app)
    member = member_for(f"shop.{MARKUP}", f"order:{MARKUP}")
    task_id = f"order:{MARKUP}~1"
    assert store.gate(member, task_id, "n1", hold_ms=60_000, grace_ms=1000).accepted
    token = f"{MARKUP}:1:ab"
    started = store.start(
        member,
        task_id,
        token,
        lock_ms=60_000,
        gated=True,
        key_mode="lock",
        hostname=MARKUP,
        pid=1,
        retries=0,
        record_ms=60_000,
    )
    assert started.run
    store.client.hset(store.schema.record(member), mapping={"error": MARKUP, "args": MARKUP, MARKUP: MARKUP})
    # The markup as a note in both formats: the record's own entry, and a previous release's history list.
    n = int(store.client.hget(store.schema.record(member), "hn") or 0)
    store.client.hset(store.schema.record(member), mapping={f"h{n}": f"5 started - {MARKUP}", "hn": n + 1})
    store.client.lpush(old_history(store.schema, member), f"1700000000000 started {task_id} {MARKUP}")

    pages = [root.get(url) for url in (LIST, detail_url(member), release_url(member), requeue_url(member))]
    pages.append(root.get(LIST, {"q": "order:<", "task": MARKUP, "state": MARKUP}))
    for response in pages:
        assert response.status_code == 200
        page = response.content.decode()
        assert "<script>alert(1)" not in page and "<img src=x" not in page, response.request["PATH_INFO"]
    detail = pages[1].content.decode()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in detail


# --- the store is down ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("conf", "shown"),
    [
        ({"broker_url": "redis://shop:s3cret@127.0.0.1:1/0"}, "redis://shop:**@127.0.0.1:1/0"),
        ({"dedup_redis_url": "redis://:s3cret@127.0.0.1:1/3"}, "redis://:**@127.0.0.1:1/3"),
    ],
)
def test_an_unreachable_store_is_a_page_that_says_so(
    make_app: AppFactory, users: dict[str, User], conf: dict[str, str], shown: str
) -> None:
    down = make_app(**conf)
    member = "shop.charge:order:1"
    root = client_for(users, "root")
    with override_settings(CELERY_DEDUP_APP=down):
        for method, url in [
            ("get", LIST),
            ("get", detail_url(member)),
            ("get", release_url(member)),
            ("post", release_url(member)),
            ("get", requeue_url(member)),
            ("post", requeue_url(member)),
            ("get", PURGE),
            ("post", PURGE),
            ("get", STATS),
        ]:
            response = getattr(root, method)(url, {"states": ["succeeded"]} if url == PURGE else {})
            page = response.content.decode()
            assert response.status_code == 503, (method, url, response.status_code)
            assert "cannot be reached" in page and f"<code>{shown}</code>" in page, (method, url)
            assert "s3cret" not in page
            assert "ConnectionError" in page
        assert client_for(users, "nobody").get(LIST).status_code == 403  # no address for those who may not look
        assert client_for(users, None).get(LIST).status_code == 302


def test_settings_the_store_cannot_be_used_with_are_a_page_that_says_so(
    make_app: AppFactory, users: dict[str, User]
) -> None:
    """A DedupConfigError (here: CELERY_DEDUP_APP names an app that was never installed, whose dedup_redis_url is
    no store URL) answers every page with the 503 page, not a server error; the URL in the error is masked, with
    DEBUG on too."""
    unusable = make_app("unusable", install=False, dedup_redis_url="http://shop:s3cret@127.0.0.1:1/0")
    member = "shop.charge:order:1"
    root = client_for(users, "root")
    with override_settings(CELERY_DEDUP_APP=unusable, DEBUG=True):
        for method, url in [("get", LIST), ("get", detail_url(member)), ("post", requeue_url(member)), ("get", STATS)]:
            response = getattr(root, method)(url)
            page = response.content.decode()
            assert response.status_code == 503, (method, url, response.status_code)
            assert "DedupConfigError" in page and "dedup_redis_url" in page, (method, url)
            assert "http://shop:**@127.0.0.1:1/0" in page
            assert "s3cret" not in page


NO_SCRIPTS = "noscripts"  # may read and write, but not run scripts: the gate's script is refused (NOPERM)


def test_a_store_refusal_during_an_action_is_a_page_that_says_so(
    make_app: AppFactory, users: dict[str, User], server: Server, r: redis.Redis
) -> None:
    """A DedupStoreError from an action (the gate's script refused while re-enqueueing) is the 503 page naming
    the refusal, with the store's password masked, not a server error."""
    app = make_app()
    failed = Records(app, keyed_tasks(app)[0]).ended(2, "failed", error="boom")
    r.acl_setuser(
        NO_SCRIPTS,
        enabled=True,
        passwords=["+pw-s3cret"],
        keys=["*"],
        channels=["*"],
        commands=["+@all", "-eval", "-evalsha"],
    )
    try:
        limited = make_app("limited", broker_url=server.url.replace("redis://", f"redis://{NO_SCRIPTS}:pw-s3cret@"))
        keyed_tasks(limited)
        with override_settings(CELERY_DEDUP_APP=limited, DEBUG=True):
            assert client_for(users, "root").get(requeue_url(failed.member)).status_code == 200
            response = client_for(users, "root").post(requeue_url(failed.member))
    finally:
        r.acl_deluser(NO_SCRIPTS)
    page = response.content.decode()
    assert response.status_code == 503, response.status_code
    assert "DedupStoreError" in page and "NOPERM" in page
    assert f"{NO_SCRIPTS}:**@" in page and "s3cret" not in page
    assert record(app, failed.member)["task_id"] == failed.task_id


# --- 100,000 records -----------------------------------------------------------------------------


def seed(app: Celery, tasks: tuple[str, ...], count: int, *, batch: int = 1000) -> None:
    """``count`` queued records (keys ``order:000000``...), gated by the real script, ``batch`` per pipeline."""
    store = runtime.store_for(app)
    with store.client.pipeline(transaction=False) as pipe:
        for n in range(count):
            task = tasks[n % len(tasks)]
            key = f"order:{n:06d}"
            member = member_for(task, key)
            call = store.gate_call(member, new_task_id(key), new_nonce(), hold_ms=3_600_000, grace_ms=60_000)
            store.scripts.run(call.keys, call.command, client=pipe)
            if len(pipe) >= batch:
                assert all(code == 1 for code, _ in pipe.execute())
        assert all(code == 1 for code, _ in pipe.execute())


@pytest.mark.slow
def test_list_stays_correct_over_100k_records(app: Celery, tasks: tuple[Any, Any], root: Client) -> None:
    seed(app, ("shop.charge", "shop.refund"), 100_000)
    store = runtime.store_for(app)
    # Every record is queued: the listing is that state's index, newest first.
    index = [m.decode() for m in store.client.zrevrange(SCHEMA.state_index("queued"), 0, 199)]

    first = root.get(LIST)
    second = root.get(LIST + first.context["listing"].next_url)

    assert listed(first) == index[:100]
    assert listed(second) == index[100:200]
    assert not set(listed(first)) & set(listed(second))
    assert first.context["total"] == 100_000

    queued = (m.decode() for m in store.client.zrevrange(SCHEMA.state_index("queued"), 0, -1))
    refunds = [member for member in queued if member.startswith("shop.refund:")][:200]
    page = root.get(LIST, {"task": "shop.refund"})
    assert listed(page) == refunds[:100]
    assert listed(root.get(LIST + page.context["listing"].next_url)) == refunds[100:200]

    found = listed(root.get(LIST, {"q": "order:01234"}))
    assert found == [member_for(("shop.charge", "shop.refund")[n % 2], f"order:{n:06d}") for n in range(12340, 12350)]
    assert listed(root.get(LIST, {"state": "queued"})) == index[:100]
    assert listed(root.get(LIST, {"state": "failed"})) == []


def test_decision_counters_page_shows_what_the_gate_counted(
    app: Celery, tasks: tuple[Any, Any], users: dict[str, User]
) -> None:
    charge = tasks[0]
    charge.delay(1)
    charge.delay(1)
    charge.delay(1)
    page = client_for(users, "viewer").get(STATS)
    assert page.status_code == 200
    row = re.search(rf"<tr><td>{re.escape(charge.name)}</td>(.*?)</tr>", page.content.decode())
    assert row is not None
    cells = re.findall(r"<td>(\d+)</td>", row.group(1))
    assert cells[:2] == ["1", "2"], "accepted 1, deduplicated 2"
    assert STATS in client_for(users, "viewer").get(LIST).content.decode()


def test_limit_groups_page_shows_each_groups_usage(app: Celery, users: dict[str, User]) -> None:
    from celery_dedup.policy import LimitPolicy, Rate  # noqa: PLC0415 - only this test reads groups
    from celery_dedup.store import limits  # noqa: PLC0415

    store = runtime.store_for(app)
    policy = LimitPolicy(None, concurrency=2, rates=(Rate(30, 60_000),))
    for n in range(3):
        limits.acquire(
            store, "shop.report:tenant:acme", f"h:1:{n}", f"run-{n}", policy, lease_ms=60_000, task_name="shop.report"
        )
    page = client_for(users, "viewer").get(LIST + "limits/")
    assert page.status_code == 200
    text = page.content.decode()
    row = re.search(r"<td>shop\.report</td>\s*<td>tenant:acme</td>(.*?)</tr>", text, re.S)
    assert row is not None, text
    cells = [cell.strip() for cell in re.findall(r"<td>(.*?)</td>", row.group(1), re.S)]
    assert cells[:3] == ["2 / 2", "1", "2 / 30/m"], cells
    assert LIST + "limits/" in client_for(users, "viewer").get(LIST).content.decode()


# --- named limit groups: what the Limit groups page shows and changes ----------------------------

LIMITS = LIST + "limits/"
PARTNER = {"partner-api": {"concurrency": 2, "rate": ["10/s", "1000/d"]}, "mailer": {"rate": "5/s"}}


@pytest.fixture
def grouped(make_app: AppFactory) -> Iterator[Celery]:
    """An app with two named groups, shown by the admin."""
    app = make_app(dedup_limit_groups=PARTNER)
    with override_settings(CELERY_DEDUP_APP=app):
        yield app


def cells(text: str, table: str, first: str, second: str) -> list[str]:
    """The cells after the first two of the row of ``table`` starting with ``first``, ``second``."""
    body = re.search(rf'<table id="{table}">(.*?)</table>', text, re.S)
    assert body is not None, text
    row = re.search(rf"<td>{re.escape(first)}</td>\s*<td>{re.escape(second)}</td>(.*?)</tr>", body.group(1), re.S)
    assert row is not None, (first, second, body.group(1))
    return [re.sub(r"\s+", " ", cell).strip() for cell in re.findall(r"<td>(.*?)</td>", row.group(1), re.S)]


def named(app: Celery, name: str) -> Any:
    from celery_dedup import limits  # noqa: PLC0415

    (info,) = [info for info in limits.describe(app) if info.name == name]
    return info


def test_limit_groups_page_shows_named_groups_and_their_keys_in_use(grouped: Celery, root: Client) -> None:
    from celery_dedup import limits  # noqa: PLC0415

    limits.override(grouped, "partner-api", "acme", concurrency=1, rate=["3/s"], by="ops")
    limits.pause(grouped, "mailer", until=None, by="ops")
    with limits.acquire(grouped, "partner-api", "acme", timeout=5):
        text = root.get(LIMITS).content.decode()

    assert cells(text, "named-groups", "partner-api", "(all keys)")[:3] == [
        "concurrency 2, rate 10/s, 1000/d",
        "-",
        "-",
    ]
    assert cells(text, "named-groups", "partner-api", "acme")[:3] == ["-", "concurrency 1, rate 3/s", "-"]
    assert cells(text, "named-groups", "mailer", "(all keys)")[:3] == ["rate 5/s", "-", "until resumed"]
    in_use = cells(text, "limit-groups", "group partner-api", "acme")
    assert in_use[:6] == ["1 / 1", "0", "1 / 3/s", "-", "-", "concurrency 1, rate 3/s"], in_use


def test_limit_group_actions_change_the_group_and_are_logged(
    grouped: Celery, root: Client, users: dict[str, User]
) -> None:
    LogEntry.objects.all().delete()

    done = root.post(
        LIMITS, {"action": "set", "group": "partner-api", "key": "acme", "concurrency": "1", "rate": "3/s, 100/d"}
    )
    assert done.status_code == 302 and done["Location"] == LIMITS
    acme = named(grouped, "partner-api").keys["acme"].override
    assert (acme.concurrency, [str(rate) for rate in acme.rates]) == (1, ["3/s", "100/d"])
    root.post(LIMITS, {"action": "pause", "group": "partner-api", "seconds": "60"})
    assert named(grouped, "partner-api").paused_until > 0
    root.post(LIMITS, {"action": "pause", "group": "mailer", "key": "*"})
    assert named(grouped, "mailer").keys["*"].paused_until == -1
    page = root.post(LIMITS, {"action": "resume", "group": "mailer", "key": "*"}, follow=True).content.decode()
    assert "Resumed limit group mailer key *." in page
    root.post(LIMITS, {"action": "resume", "group": "partner-api"})
    root.post(LIMITS, {"action": "clear", "group": "partner-api", "key": "acme"})
    nothing = root.post(LIMITS, {"action": "clear", "group": "partner-api", "key": "acme"}, follow=True)
    assert "Nothing to clear: limit group partner-api key acme has no override." in nothing.content.decode()

    info = named(grouped, "partner-api")
    assert info.paused_until is None and (info.keys.get("acme") is None or info.keys["acme"].override is None)
    entries = [(e.user, e.action_flag, e.object_id, e.object_repr) for e in LogEntry.objects.order_by("id")]
    root_user = users["root"]
    assert entries == [
        (root_user, CHANGE, None, "limit group partner-api key acme"),
        (root_user, CHANGE, None, "limit group partner-api"),
        (root_user, CHANGE, None, "limit group mailer key *"),
        (root_user, CHANGE, None, "limit group mailer key *"),
        (root_user, CHANGE, None, "limit group partner-api"),
        (root_user, CHANGE, None, "limit group partner-api key acme"),
    ]
    messages_ = [e.get_change_message() for e in LogEntry.objects.order_by("id")]
    assert messages_[0] == "Set the override of limit group partner-api key acme: concurrency 1, rate 3/s, 100/d."
    assert messages_[1].startswith("Paused limit group partner-api until ")
    assert messages_[2:] == [
        "Paused limit group mailer key * until resumed.",
        "Resumed limit group mailer key *.",
        "Resumed limit group partner-api.",
        "Cleared the override of limit group partner-api key acme.",
    ]


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ({"action": "set", "group": "partner-api", "rate": "0/s"}, "0/s"),
        ({"action": "set", "group": "partner-api", "rate": "10/w"}, "10/w"),
        ({"action": "set", "group": "partner-api", "concurrency": "-1"}, "-1"),
        ({"action": "set", "group": "no-such-group", "concurrency": "1"}, "no-such-group"),
        ({"action": "set", "group": "partner-api"}, "Give a concurrency, a rate or both."),
        ({"action": "pause", "group": "partner-api", "seconds": "5", "until": "2999-01-01 00:00"}, "not both"),
    ],
)
def test_limit_group_actions_refuse_bad_values_and_change_nothing(
    grouped: Celery, root: Client, data: dict[str, str], says: str
) -> None:
    LogEntry.objects.all().delete()

    page = root.post(LIMITS, data, follow=True).content.decode()

    assert "Nothing changed:" in page and escape(says) in page, page
    info = named(grouped, "partner-api")
    assert (info.override, info.paused_until, info.keys) == (None, None, {})
    assert not LogEntry.objects.exists()


def test_limit_group_actions_need_change_permission_and_the_csrf_token(grouped: Celery, users: dict[str, User]) -> None:
    viewer = client_for(users, "viewer")
    page = viewer.get(LIMITS)
    assert page.status_code == 200
    assert 'id="limit-actions"' not in page.content.decode() and "partner-api" in page.content.decode()
    assert viewer.post(LIMITS, {"action": "pause", "group": "partner-api"}).status_code == 403
    assert client_for(users, "nobody").get(LIMITS).status_code == 403
    unchecked = client_for(users, "root", enforce_csrf_checks=True)
    assert 'id="limit-actions"' in unchecked.get(LIMITS).content.decode()
    assert unchecked.post(LIMITS, {"action": "pause", "group": "partner-api"}).status_code == 403
    assert named(grouped, "partner-api").paused_until is None
