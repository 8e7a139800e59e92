"""A rolling upgrade: the previous release and this one on one store, as a deploy meets them.

The previous release (:data:`PREVIOUS`, the last of format 1) is built from the
repository's history with ``git archive`` and installed into a virtualenv of
its own as users install it; its dependencies come from this project's
virtualenv (a ``.pth``). Its producers and workers run beside this release's
on the session's server: they race for the same keys, run each other's runs,
read each other's records. A store in a newer format is refused; ``dedup
migrate`` then leaves no format-1 structure, and this release keeps working.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

import celery_dedup
from celery_dedup import operations
from celery_dedup.exceptions import DedupStoreFormatError
from celery_dedup.keys import member_for
from celery_dedup.store import schema
from celery_dedup.store.schema import FORMAT

from ..conftest import ROOT, Server, new_app, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

#: The previous release: the last commit whose store has format 1.
PREVIOUS = "47f2acccdb4e1706c9d204876542102b4d9e5d38"
PREFIX = "dedup"
TASK = "upgrade_proj.charge"

#: The app both releases run: its module name is its own, so neither release's tests package is imported.
APP = """
import os
import redis
from celery import Celery
import celery_dedup
from celery_dedup import DedupTask

BROKER = os.environ["UPGRADE_BROKER"]
app = Celery("upgrade_proj", broker=BROKER, backend=BROKER)
app.conf.update(worker_hijack_root_logger=False, broker_connection_retry_on_startup=True)
celery_dedup.install(app)
_counter = redis.Redis.from_url(BROKER)


@app.task(base=DedupTask, dedup_key="order:{order_id}")
def charge(order_id):
    _counter.incr(f"test:executions:order:{order_id}")
    _counter.rpush(f"test:ran:order:{order_id}", celery_dedup.__file__)
    return order_id
"""

#: Publishes ``argv[2:]`` from ``argv[1]`` (a time to start at, for a race); prints {key: [id, deduplicated]}.
PRODUCE = """
import json, sys, time
from upgrade_proj import charge
start = float(sys.argv[1])
time.sleep(max(0.0, start - time.time()))
found = {}
for order in sys.argv[2:]:
    result = charge.delay(int(order))
    found[order] = [result.id, bool(result.deduplicated)]
print(json.dumps(found))
"""

#: What a release reads of the store: each key's status and history, and the listing's members.
READ = """
import json, sys
import celery_dedup
from upgrade_proj import app, charge
found = {}
for order in sys.argv[1:]:
    status = charge.dedup_status(int(order))
    found[order] = None if status is None else {
        "state": status.state, "task_id": status.task_id, "history": [e.state for e in status.history]
    }
listed = [record.member for record in celery_dedup.records(app, limit=1000).records]
print(json.dumps({"status": found, "listed": listed}))
"""


@dataclass(frozen=True)
class Release:
    """A Python that imports one release of celery-dedup, with the app's folder on its path."""

    python: str
    folder: Path

    def env(self, server: Server) -> dict[str, str]:
        # Not the session's Django settings either (a Django test of the session may have set them): these apps
        # run without Django.
        dropped = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "DJANGO_SETTINGS_MODULE")
        env = {k: v for k, v in os.environ.items() if k not in dropped}
        return {**env, "PYTHONPATH": str(self.folder), "UPGRADE_BROKER": server.url, "PYTHONNOUSERSITE": "1"}

    def run(self, server: Server, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [self.python, *args],
            cwd=self.folder,
            env=self.env(server),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert not check or done.returncode == 0, f"{args} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
        return done

    def start(self, server: Server, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [self.python, *args],
            cwd=self.folder,
            env=self.env(server),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    def json(self, server: Server, *args: str) -> dict[str, object]:
        done = self.run(server, *args)
        document: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
        return document


def _write_app(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "upgrade_proj.py").write_text(textwrap.dedent(APP), encoding="utf-8")
    (folder / "produce.py").write_text(textwrap.dedent(PRODUCE), encoding="utf-8")
    (folder / "read.py").write_text(textwrap.dedent(READ), encoding="utf-8")
    return folder


def _quiet(command: Sequence[str | Path]) -> None:
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"


@pytest.fixture(scope="module")
def releases(tmp_path_factory: pytest.TempPathFactory) -> tuple[Release, Release]:
    """(previous, this): the previous release installed into a virtualenv as users would, and this one."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("the repository's git history is absent: the previous release cannot be built from it")
    known = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{PREVIOUS}^{{commit}}"], check=False)
    if known.returncode != 0:
        pytest.skip(f"the repository's git history lacks the previous release {PREVIOUS[:12]}")
    base = tmp_path_factory.mktemp("previous")
    source, venv = base / "source", base / "venv"
    source.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", PREVIOUS], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive.stdout, check=True)
    _quiet([sys.executable, "-m", "venv", venv])
    python = venv / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(site) / "project-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n", encoding="utf-8")
    has_wheel = subprocess.run([python, "-c", "import wheel"], capture_output=True, check=False).returncode == 0
    if not has_wheel:  # setuptools before 70.1 builds wheels with it
        _quiet([python, "-m", "pip", "install", "--quiet", "wheel"])
    _quiet([python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index", source])
    previous = Release(str(python), _write_app(base / "app"))
    where = previous.run(Server("redis://unused", None), "-c", "import celery_dedup; print(celery_dedup.__file__)")
    assert where.stdout.strip().startswith(str(venv)), f"the previous release imports {where.stdout}"
    current = Release(sys.executable, _write_app(tmp_path_factory.mktemp("current") / "app"))
    return previous, current


def _worker(release: Release, server: Server) -> subprocess.Popen[str]:
    return release.start(
        server,
        "-m",
        "celery",
        "-A",
        "upgrade_proj",
        "worker",
        "--pool",
        "solo",
        "--loglevel",
        "INFO",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
    )


def _stop(process: subprocess.Popen[str]) -> str:
    if process.poll() is None:
        os.killpg(process.pid, 15)
    try:
        out, _ = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        out, _ = process.communicate()
    return out


def _run_all(release: Release, server: Server, r: redis.Redis, orders: Sequence[int]) -> str:
    """Start a worker of ``release`` until every order's run has ended; its output."""
    worker = _worker(release, server)
    try:
        wait_for(
            lambda: all(
                (r.hget(f"{PREFIX}:rec:{member_for(TASK, f'order:{o}')}", "state") or b"") == b"succeeded"
                for o in orders
            ),
            60,
            lambda: f"runs of {orders} not all succeeded",
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- the worker's output:\n{_stop(worker)}") from None
    return _stop(worker)


def _is_subsequence(part: Sequence[str], whole: Sequence[str]) -> bool:
    rest = iter(whole)
    return all(item in rest for item in part)


def _legacy_keys(r: redis.Redis) -> list[bytes]:
    return [
        *r.scan_iter(match=f"{PREFIX}:hist:*"),
        *r.scan_iter(match=f"{PREFIX}:idx:task:*"),
        *([f"{PREFIX}:idx".encode()] if r.exists(f"{PREFIX}:idx") else []),
    ]


def test_the_previous_release_and_this_one_share_a_store(
    releases: tuple[Release, Release], server: Server, r: redis.Redis
) -> None:
    previous, current = releases

    # Producers of both releases race for the same keys: each key accepted once, both learn its run.
    keys = [str(n) for n in range(1, 21)]
    start = str(time.time() + 3)
    racers = [p.start(server, "produce.py", start, *keys) for p in (previous, current)]
    outputs = [racer.communicate(timeout=120)[0] for racer in racers]
    assert all(racer.returncode == 0 for racer in racers), outputs
    old, new = (json.loads(out.strip().splitlines()[-1]) for out in outputs)
    for key in keys:
        assert old[key][0] == new[key][0], f"order {key}: the releases learnt different runs"
        assert [old[key][1], new[key][1]].count(False) == 1, f"order {key}: accepted {old[key]} {new[key]}"
    assert r.llen("celery") == len(keys)

    # A worker of the previous release runs them all: the runs this release's producer gated too.
    _run_all(previous, server, r, [int(k) for k in keys])
    for key in keys:
        assert int(r.get(f"test:executions:order:{key}") or 0) == 1
    # This release's worker runs what the previous release's producer gated, and says format 1 is here.
    previous.json(server, "produce.py", "0", "101", "102")
    output = _run_all(current, server, r, [101, 102])
    assert "format-1 structures are present" in output, output
    assert "dedup migrate" in output
    for order in ("101", "102"):
        assert int(r.get(f"test:executions:order:{order}") or 0) == 1
        assert [ran.decode() for ran in r.lrange(f"test:ran:order:{order}", 0, -1)] == [celery_dedup.__file__]

    # Each release reads the other's records. This one reads both formats whole: status, history, listing.
    views = [release.json(server, "read.py", "1", "2", "101") for release in (previous, current)]
    (old_found, old_listed), (found, listed) = ((view["status"], view["listed"]) for view in views)
    assert isinstance(found, dict) and isinstance(listed, list)
    assert isinstance(old_found, dict) and isinstance(old_listed, list)
    for order in ("1", "2", "101"):
        assert found[order]["state"] == "succeeded", found[order]
        assert found[order]["history"][0] == "succeeded" and "queued" in found[order]["history"], found[order]
        assert member_for(TASK, f"order:{order}") in listed
    # The previous release reads each record's state and run; of the history and the listing, what it wrote
    # itself (its lists and its index: it knows no h<n> field), never an entry that did not happen.
    for order in ("1", "2", "101"):
        seen = f"order {order}: the previous release reads {old_found[order]}, this one {found[order]}"
        assert (old_found[order]["state"], old_found[order]["task_id"]) == ("succeeded", found[order]["task_id"]), seen
        assert _is_subsequence(old_found[order]["history"], found[order]["history"]), seen
    assert old_found["1"]["history"][0] == old_found["2"]["history"][0] == "succeeded", "the runs it ran itself"
    assert old_found["101"]["history"] == ["queued"], "the run it gated, which this release ran"
    assert member_for(TASK, "order:101") in old_listed and set(old_listed) <= set(listed)
    app = new_app(server, "reader")
    try:
        detail = operations.detail(app, member_for(TASK, "order:1"))
        assert detail.status is not None and [e.state for e in detail.status.history][:2] == ["succeeded", "started"]
    finally:
        app.close()

    # A store in a newer format is refused: by a worker at its start, by a process at its first use.
    r.set(f"{PREFIX}:format", FORMAT + 1)
    refused = _worker(current, server)
    try:
        output = refused.communicate(timeout=60)[0]
    except subprocess.TimeoutExpired:
        output = _stop(refused)
    assert refused.returncode != 0 and "DedupStoreFormatError" in output, output
    assert f"format {FORMAT + 1}" in output and "pip install --upgrade celery-dedup" in output
    app = new_app(server, "refused")
    try:
        with pytest.raises(DedupStoreFormatError, match="pip install --upgrade celery-dedup") as raised:
            celery_dedup.records(app)
        assert (raised.value.stored, raised.value.supported) == (FORMAT + 1, FORMAT)
    finally:
        app.close()
    r.set(f"{PREFIX}:format", 1)  # as an operator would put it back, had they marked it wrongly

    # migrate: a dry run changes nothing; the real one leaves no format-1 structure; again, nothing to do.
    assert _legacy_keys(r)
    dry = current.run(server, "-m", "celery", "-A", "upgrade_proj", "dedup", "migrate", "--dry-run", "--json")
    assert json.loads(dry.stdout)["dry_run"] is True and _legacy_keys(r) and r.get(f"{PREFIX}:format") == b"1"
    done = json.loads(current.run(server, "-m", "celery", "-A", "upgrade_proj", "dedup", "migrate", "--json").stdout)
    assert done["folded"] >= 22 and done["format"] == FORMAT, done
    assert _legacy_keys(r) == []
    assert r.get(f"{PREFIX}:format") == str(FORMAT).encode()
    folded = {k.decode(): v.decode() for k, v in r.hgetall(f"{PREFIX}:rec:{member_for(TASK, 'order:1')}").items()}
    entries = [folded[f"h{n}"] for n in range(int(folded["hn"]))]
    assert entries[0] == "0 queued" and entries[-1].split(" ")[1] == "succeeded", folded
    again = json.loads(current.run(server, "-m", "celery", "-A", "upgrade_proj", "dedup", "migrate", "--json").stdout)
    assert (again["folded"], again["deleted"], again["indexes"]) == (0, 0, 0), again

    # This release keeps working on the migrated store.
    current.json(server, "produce.py", "0", "201")
    output = _run_all(current, server, r, [201])
    assert int(r.get("test:executions:order:201") or 0) == 1
    if "index" not in schema.KEY_KIND:  # once this release no longer writes format 1's index itself
        assert "format-1 structures are present" not in output, output
