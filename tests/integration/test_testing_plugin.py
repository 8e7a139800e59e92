"""The pytest plugin for users (``celery_dedup.testing``), run the way a user's suite runs it.

Each test writes a user's test files and runs pytest on them in a subprocess,
where the plugin loads through its ``pytest11`` entry point as it would in a
project that installed celery-dedup: no ``pytest_plugins`` line, no conftest
wiring. The user's server is the session's server, named by
``CELERY_DEDUP_TEST_REDIS_URL`` (which the plugin honours).
"""

from __future__ import annotations

import re

import pytest
import redis

from ..conftest import ROOT, Server

pytest_plugins = ("pytester",)

TASKS = """
import pytest
from celery_dedup import DedupTask


@pytest.fixture
def charge(celery_dedup_app):
    @celery_dedup_app.task(base=DedupTask, dedup_key="order:{order_id}")
    def charge(order_id, amount=0):
        return order_id * 10 + amount

    return charge
"""


@pytest.fixture(autouse=True)
def _plain_celery_project(monkeypatch: pytest.MonkeyPatch) -> None:
    """The user's project is plain Celery: this suite's Django tests leave their settings module in the environment."""
    monkeypatch.delenv("DJANGO_SETTINGS_MODULE", raising=False)


@pytest.fixture
def user_suite(
    pytester: pytest.Pytester, server: Server, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> pytest.Pytester:
    """A user's project whose tests reach the session's server through the plugin's environment variable."""
    monkeypatch.setenv("CELERY_DEDUP_TEST_REDIS_URL", server.url)
    pytester.makeconftest(TASKS)
    return pytester


def run_suite(suite: pytest.Pytester, *args: str) -> pytest.RunResult:
    """pytest in a subprocess, in the user's directory: this repository's ini and conftest do not apply."""
    return suite.runpytest_subprocess(*args, timeout=120)


def test_fixtures_and_assertions_hold_for_a_users_tasks(user_suite: pytest.Pytester, server: Server) -> None:
    user_suite.makepyfile(
        test_orders=f"""
        from celery_dedup.testing import (
            assert_deduplicated, assert_held, assert_not_held, assert_published, assert_state,
        )


        def test_the_server_is_the_one_named(celery_dedup_server):
            assert celery_dedup_server.url == {server.url!r} and celery_dedup_server.process is None


        def test_a_double_click_is_deduplicated(charge):
            first = charge.delay(42, amount=5)
            again = charge.delay(order_id=42, amount=5)
            assert_published(first)
            assert_deduplicated(again, of=first)
            assert_held(charge.s(42, amount=5), by=first)
            assert_not_held(charge.s(43))
            status = assert_state(charge.s(42, amount=5), "queued", run=first)
            assert status.duplicates == 1


        def test_a_run_ends_and_frees_its_key(charge, celery_dedup_worker):
            first = charge.delay(7, amount=1)
            assert first.get(timeout=20) == 71
            assert_state(charge.s(7, amount=1), "succeeded", run=first, timeout=20)
            assert_not_held(charge.s(7, amount=1))
            second = charge.delay(7, amount=1)
            assert_published(second)
            assert second.id != first.id


        def test_each_test_starts_empty(charge):
            assert_not_held(charge.s(42, amount=5))
        """
    )
    result = run_suite(user_suite, "-v")
    result.assert_outcomes(passed=4)


def test_each_tests_worker_runs_countdowns_and_the_reaper(user_suite: pytest.Pytester) -> None:
    """Two tests in a row, each with its own worker: the second worker's timer still fires.

    A countdown run and the reaper both wait on the worker's timer. On kombu
    5.5 a stopped worker's closed event loop stayed the process's, and the next
    worker in the process adopted it, timer and all, so its own timer never
    fired: the second test's countdown never ran.
    """
    user_suite.makeconftest(
        TASKS
        + """

@pytest.fixture(scope="session")
def celery_dedup_config():
    return {"dedup_reap_interval": 0.2}
"""
    )
    user_suite.makepyfile(
        test_timers="""
        import time

        import pytest
        from celery_dedup import runtime
        from celery_dedup.keys import member_for
        from celery_dedup.testing import assert_not_held, assert_state


        @pytest.mark.parametrize("order", [1, 2])
        def test_countdown_and_reaper(charge, celery_dedup_worker, order):
            run = charge.apply_async((order,), countdown=0.3)
            assert run.get(timeout=10) == order * 10
            assert_state(charge.s(order), "succeeded", run=run, timeout=10)

            # A key held for 0.1 s whose message never existed: only the worker's reaper frees it.
            abandoned = charge.s(order + 100)
            store = runtime.store_for(charge.app)
            member = member_for(charge.name, f"order:{order + 100}")
            assert store.gate(member, "gone", "nonce", hold_ms=100, grace_ms=60_000).accepted
            deadline = time.monotonic() + 10
            while True:
                try:
                    assert_not_held(abandoned)
                    break
                except AssertionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        """
    )
    run_suite(user_suite, "-v").assert_outcomes(passed=2)


def test_failed_assertions_say_what_happened(user_suite: pytest.Pytester) -> None:
    user_suite.makepyfile(
        test_wrong="""
        from celery_dedup.testing import assert_deduplicated, assert_held, assert_state


        def test_other_orders_are_not_duplicates(charge):
            first = charge.delay(1)
            other = charge.delay(2)
            assert_deduplicated(other, of=first)


        def test_a_free_key_is_not_held(charge):
            assert_held(charge.s(3))


        def test_a_queued_run_has_not_succeeded(charge):
            charge.delay(4)
            assert_state(charge.s(4), "succeeded", timeout=0.3)


        def test_a_plain_call_is_refused(celery_dedup_app):
            @celery_dedup_app.task
            def plain(n):
                return n

            assert_held(plain.s(1))
        """
    )
    result = run_suite(user_suite)
    result.assert_outcomes(failed=4)
    result.stdout.fnmatch_lines(
        [
            "E * AssertionError: the call was not deduplicated: it published run order:2~*",
            "E * AssertionError: key 'order:3' of conftest.charge is not held; no status record",
            "E * AssertionError: key 'order:4' of conftest.charge: not 'succeeded' within 0.3 s; record: state "
            "'queued', run order:4~*; history (oldest first): queued order:4~*",
            "E * TypeError: *plain* is not a call of a DedupTask*",
        ],
        consecutive=False,
    )


def test_a_users_config_reaches_the_app(user_suite: pytest.Pytester, r: redis.Redis) -> None:
    user_suite.makeconftest(
        TASKS
        + """

@pytest.fixture(scope="session")
def celery_dedup_config():
    return {"dedup_key_prefix": "mine", "dedup_default_ttl": 30}
"""
    )
    user_suite.makepyfile(
        test_config="""
        from celery_dedup.testing import assert_held


        def test_settings_apply(charge):
            charge.delay(9)
            assert_held(charge.s(9))
        """
    )
    run_suite(user_suite).assert_outcomes(passed=1)
    assert r.smembers("mine:held") and not r.exists("dedup:held"), "the user's key prefix was not used"


def test_the_plugin_is_inert_where_no_test_asks_for_it(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CELERY_DEDUP_TEST_REDIS_URL", "redis://127.0.0.1:1/0")  # nothing listens there
    pytester.makepyfile(test_plain="def test_plain():\n    assert True\n")
    listed = run_suite(pytester, "--fixtures").stdout.str()
    for fixture in ("celery_dedup_server", "celery_dedup_config", "celery_dedup_app", "celery_dedup_worker"):
        assert f"{fixture} " in listed, f"the plugin did not load: pytest --fixtures does not list {fixture}"
    run_suite(pytester).assert_outcomes(passed=1)


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.DOTALL)


def test_the_documented_examples_pass(user_suite: pytest.Pytester) -> None:
    user_suite.makeconftest("")  # the examples define their own tasks
    readme = next(block for block in python_blocks((ROOT / "README.md").read_text()) if "celery_dedup.testing" in block)
    page = python_blocks((ROOT / "docs" / "testing.md").read_text())[0]
    user_suite.makepyfile(test_readme=readme, test_page=page)
    run_suite(user_suite, "-v").assert_outcomes(passed=3)


def test_without_a_url_the_plugin_starts_its_own_server(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CELERY_DEDUP_TEST_REDIS_URL", raising=False)
    pytester.makeconftest(TASKS)
    pytester.makepyfile(
        test_own="""
        from celery_dedup.testing import assert_deduplicated


        def test_own_server(celery_dedup_server, charge):
            assert celery_dedup_server.process is not None
            assert celery_dedup_server.url == celery_dedup_server.process.url
            first = charge.delay(1)
            assert_deduplicated(charge.delay(1), of=first)
        """
    )
    run_suite(pytester).assert_outcomes(passed=1)


def test_a_users_run_of_the_documented_example_ends_with_its_summary(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The page's example, run as a user runs it (the plugin's own server): nothing follows pytest's summary.

    A result the example dropped stays in a reference cycle of Celery's until
    the garbage collector runs, at exit, after the session's server stopped.
    Collecting it unsubscribed from the result backend: on Celery 5.5 and 5.6
    that retried for about 20 s and printed the ConnectionError it gave up on.
    Whether the collector ran before the server stopped was chance; here it
    runs only at exit, as it may in any suite.
    """
    monkeypatch.delenv("CELERY_DEDUP_TEST_REDIS_URL", raising=False)
    pytester.makeconftest("import gc\n\ngc.disable()\n")
    pytester.makepyfile(test_orders=python_blocks((ROOT / "docs" / "testing.md").read_text())[0])
    result = run_suite(pytester, "-q")
    result.assert_outcomes(passed=2)
    assert result.stderr.str() == "", f"pytest wrote to stderr after the tests:\n{result.stderr.str()}"
    assert re.fullmatch(r"=* ?2 passed in [\d.]+s ?=*", result.stdout.lines[-1]), (
        f"pytest's summary is not its last word:\n{result.stdout.str()}"
    )


def test_results_kept_past_their_test_leave_quietly(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """Results a session fixture keeps (one ended, one still queued) are dropped after the server stopped."""
    monkeypatch.delenv("CELERY_DEDUP_TEST_REDIS_URL", raising=False)
    pytester.makeconftest(TASKS)
    pytester.makepyfile(
        test_kept="""
        import pytest


        @pytest.fixture(scope="session")
        def kept():
            results = []
            yield results
            results.clear()  # the server, set up after this fixture, has stopped


        def test_keep_results(kept, charge, celery_dedup_worker):
            ended = charge.delay(1)
            assert ended.get(timeout=20) == 10
            kept.extend([ended, charge.delay(2, amount=1)])


        def test_keep_a_queued_one(kept, charge):
            kept.append(charge.delay(3))
        """
    )
    result = run_suite(pytester, "-q")
    result.assert_outcomes(passed=2)
    assert result.stderr.str() == "", f"pytest wrote to stderr after the tests:\n{result.stderr.str()}"
