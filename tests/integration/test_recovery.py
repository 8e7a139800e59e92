"""Crash recovery: a lock whose owner is provably dead is taken over at once, and its message comes back.

Unit tests prove :func:`celery_dedup.worker.processes.owner_gone` on real processes
(a live one, a dead one, a zombie, a reused pid, another pid namespace).
Integration tests run ``celery -A tests.crash_app worker`` subprocesses
(prefork), SIGKILL a pool child or a whole worker mid-task, restart the
worker (or start a second one under the same node name while the first
runs), and read what the tasks and the library left in Redis. The execution
lock TTL is long (``LOCK_TTL``) and kombu's visibility timeout is its default
hour, so a re-run inside a test's wait proves a takeover and a prompt
redelivery, never an expiry.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_dedup import runtime
from celery_dedup.keys import KeySchema
from celery_dedup.store.store import DedupStore
from celery_dedup.worker import processes, recovery
from celery_dedup.worker.lock import new_token

from .. import crash_app
from ..conftest import ROOT, AppFactory, Server, WorkerProcess, history, queued_messages, wait_for
from .test_crash import Fleet, executions, history_states, member, record, run_ids, started_pid

SCHEMA = KeySchema("dedup")
#: Execution lock TTL of every worker here (seconds): far beyond any wait of a test.
LOCK_TTL = 300
#: How long a test waits for a re-run: far below the lock TTL, generous for a loaded machine.
RERUN_WAIT = 45.0
HANG = member("hang", "hang:1")
TASK = HANG.partition(":")[0]


@pytest.fixture
def fleet(server: Server, r: redis.Redis, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Fleet]:
    workers = Fleet(server.url, monkeypatch, tmp_path)
    yield workers
    workers.stop_all()


@pytest.fixture
def tasks(make_app: AppFactory) -> crash_app.Tasks:
    return crash_app.register(make_app("recovery_publisher"))


# --- owner_gone ------------------------------------------------------------------------------------


def child_token() -> subprocess.Popen[str]:
    """A Python process that prints a lock token of its own and then waits for its stdin to close."""
    code = (
        "import sys; from celery_dedup.worker.lock import new_token; print(new_token(), flush=True); sys.stdin.read()"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
    )


def with_part(token: str, index: int, value: str) -> str:
    parts = token.split(":")
    parts[index] = value
    return ":".join(parts)


def test_a_token_of_this_process_is_not_gone() -> None:
    token = new_token()
    assert processes.token_pid(token) == os.getpid()
    assert not processes.owner_gone(token)


def test_a_dead_process_is_gone_a_live_one_is_not_and_a_zombie_is() -> None:
    child = child_token()
    assert child.stdout is not None
    token = child.stdout.readline().strip()
    assert processes.token_pid(token) == child.pid
    assert not processes.owner_gone(token), "a live process"
    child.kill()
    wait_for(lambda: processes.gone(child.pid), 10, "the child is a zombie")
    assert os.path.exists(f"/proc/{child.pid}"), "premise: not waited for yet, so still in the process table"
    assert processes.owner_gone(token), "a zombie runs nothing"
    child.wait()
    child.stdout.close()
    assert child.stdin is not None
    child.stdin.close()
    assert processes.owner_gone(token), "no such process"


def test_a_reused_pid_is_recognised_by_its_start_time() -> None:
    token = new_token()
    owner = processes.owner_of(token)
    assert owner is not None and owner.start > 0
    reused = with_part(token, 2, str(owner.start - 1))  # this pid, but an earlier process's
    assert processes.owner_gone(reused)


def test_another_machine_or_pid_namespace_is_never_proved_dead() -> None:
    token = new_token()
    owner = processes.owner_of(token)
    assert owner is not None
    other = "00000000" if owner.machine != "00000000" else "11111111"
    assert not processes.owner_gone(with_part(token, 3, other))
    assert not processes.owner_gone(with_part(with_part(token, 3, other), 1, "4194304"))  # no such pid here
    assert processes.token_pid(with_part(token, 3, other)) is None


def in_a_new_pid_namespace(code: str, *unshare: str) -> str:
    """What Python ``code`` prints as the first process of a new pid namespace (skips where none can be made)."""
    try:
        made = subprocess.run(
            ["unshare", "--pid", "--fork", *unshare, sys.executable, "-c", code],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
    except (FileNotFoundError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot make a pid namespace here: {exc}")
    if made.returncode != 0:
        pytest.skip(f"cannot make a pid namespace here: {made.stderr.strip()}")
    return made.stdout


def test_a_token_from_another_pid_namespace_on_this_host_is_not_gone() -> None:
    """Same kernel, same host name, another process table: its pid 1 is not ours."""
    code = "from celery_dedup.worker.lock import new_token; print(new_token())"
    token = in_a_new_pid_namespace(code, "--mount-proc").strip()
    owner = processes.owner_of(token)
    assert owner is not None and owner.pid == 1
    ours = processes.owner_of(new_token())
    assert ours is not None and owner.machine != ours.machine
    assert not processes.owner_gone(token), "our pid 1 is another process, but not provably the token's"
    assert processes.token_pid(token) is None


def test_a_proc_showing_another_pid_namespace_proves_nothing() -> None:
    """``unshare --pid`` without remounting ``/proc``: its entries are the parent namespace's processes, not ours.

    A judge there would read another process's start time for its own pids
    and take live processes for reused pids: such a table gives no machine
    id, so its tokens prove nothing, even of the judge's own live process.
    """
    code = (
        "import json, os; from celery_dedup.worker import processes; t = processes.token(); o = processes.owner_of(t); "
        "print(json.dumps([t, os.getpid(), processes.owner_gone(t.replace(f':{o.start}:', ':999999:', 1))]))"
    )
    token, pid, reused_gone = json.loads(in_a_new_pid_namespace(code))
    assert pid == 1, "premise: the first process of a new pid namespace"
    owner = processes.owner_of(token)
    assert owner is not None and owner.machine == "", token
    assert reused_gone is False


#: Loads processes.py alone (the standard library only: readable by any user) and prints owner_gone of each token.
BLIND_JUDGE = """
import importlib.util, json, os, sys
spec = importlib.util.spec_from_file_location("judge", "celery_dedup/worker/processes.py")
judge = importlib.util.module_from_spec(spec)
sys.modules["judge"] = judge
spec.loader.exec_module(judge)
tokens = sys.argv[1:]
print(json.dumps({
    "uid": os.getuid(),
    "visible": [os.path.exists(f"/proc/{judge.owner_of(t).pid}") for t in tokens],
    "gone": [judge.owner_gone(t) for t in tokens],
}))
"""


def judged_blind(hidepid: int, *tokens: str) -> dict[str, Any]:
    """``owner_gone`` of ``tokens``, judged by user ``nobody`` through a ``/proc`` mounted ``hidepid=<hidepid>``.

    A private mount namespace gets its own ``/proc`` instance, so the host's is untouched.
    """
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"):
        pytest.skip("needs root, unshare and setpriv to mount a hardened /proc")
    script = (
        f"mount -t proc -o hidepid={hidepid} proc /proc || exit 77; "
        'exec setpriv --reuid=65534 --regid=65534 --clear-groups "$0" -c "$@"'
    )
    command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, sys.executable, BLIND_JUDGE]
    made = subprocess.run([*command, *tokens], check=False, capture_output=True, text=True, timeout=60, cwd=ROOT)
    if made.returncode == 77 or made.stderr.startswith("unshare:"):
        pytest.skip(f"cannot mount a hardened /proc here: {made.stderr.strip()}")
    assert made.returncode == 0, made.stderr
    seen: dict[str, Any] = json.loads(made.stdout)
    assert seen["uid"] == 65534
    return seen


@pytest.mark.parametrize("hidepid", [1, 2])
def test_a_live_process_the_judge_cannot_see_is_alive(hidepid: int) -> None:
    """``/proc`` mounted ``hidepid``: another user's entries are unreadable (1) or missing (2); not seen is not dead.

    The neighbour: a dead process is still proved dead by a judge that sees nothing of it.
    """
    live = new_token()  # this test's process: root's
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    dead_token = with_part(with_part(live, 1, str(dead.pid)), 2, str(processes.start_time(os.getpid())))
    seen = judged_blind(hidepid, live, dead_token)
    if hidepid == 2:
        assert seen["visible"] == [False, False], "premise: the judge sees no entry of another user's process"
    assert seen["gone"] == [False, True], seen


def test_an_unreadable_process_table_proves_nothing_about_a_live_process(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The judge's logic where ``/proc`` holds no entry for a live pid: no proof of death, whatever else it reads."""
    token = new_token()
    child = child_token()
    assert child.stdout is not None
    child_token_ = child.stdout.readline().strip()
    try:
        processes._own()  # this process's identity, read before the table goes blind
        monkeypatch.setattr(processes, "_PROC", str(tmp_path))
        assert not processes.owner_gone(token)
        assert not processes.owner_gone(child_token_)
        assert not processes.gone(child.pid)
        assert not processes.gone(os.getpid())
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait()
        child.stdout.close()
    assert processes.owner_gone(child_token_), "and a pid with no process at all is dead, blind or not"
    assert processes.gone(child.pid)


@pytest.mark.parametrize(
    "token",
    ["", "garbage", "host:123:abcd1234", "host:x:1:abcd1234:abcd1234", "host:1:y:abcd1234:r", "a:1:2:3", "a:1:2:3:4:5"],
)
def test_a_malformed_or_old_token_is_never_gone(token: str) -> None:
    assert not processes.owner_gone(token)
    assert processes.token_pid(token) is None


def test_a_token_stays_short_with_a_long_host_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("socket.gethostname", lambda: "h" * 63)
    token = new_token()
    assert len(token) <= 64, token
    assert not processes.owner_gone(token)
    assert processes.token_pid(token) == os.getpid()


# --- the incarnation that delivered a run ----------------------------------------------------------


def test_a_worker_s_pool_children_deliver_for_its_main_process_and_no_other_process_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The main process's token passes to the children it forks; a process it did not fork has none."""
    monkeypatch.setattr(recovery, "_main", "")
    assert recovery.main_token() == "", "outside a worker"
    main = recovery.incarnate()
    owner = processes.owner_of(main)
    assert owner is not None and owner.pid == os.getpid()
    assert recovery.main_token() == main
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # a pool child, and a process it forks in turn
        try:
            mine = recovery.main_token()
            grandchild = os.fork()
            if grandchild == 0:
                os.write(write, (recovery.main_token() or "-").encode() + b"\n")
                os._exit(0)
            os.waitpid(grandchild, 0)
            os.write(write, mine.encode() + b"\n")
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    with os.fdopen(read) as lines:
        grandchild_saw, child_saw = lines.read().split()
    assert child_saw == main
    assert grandchild_saw == "-"


def test_a_delivery_of_an_unknown_worker_leaves_no_earlier_delivery_s_main_process(r: redis.Redis) -> None:
    """A start that knows no main process must not keep the one an earlier delivery recorded.

    Else a run whose lock owner died under a live, unknown worker could be
    judged by the earlier (dead) worker's main process and put back.
    """
    store = DedupStore(r, "dedup")
    at = member("hang", "hang:9")

    def start(token: str, main: str) -> None:
        decision = store.start(
            at,
            "hang:9~run",
            token,
            lock_ms=60_000,
            gated=False,
            key_mode="lock",
            hostname="h",
            pid=1,
            retries=0,
            record_ms=86_400_000,
            main=main,
        )
        assert decision.run, decision

    first = new_token()
    start(first, first)
    assert record(r, at)["main"] == first
    r.delete(SCHEMA.lock(at))  # that delivery's lock is gone (expired, or taken over)
    start(new_token(), "")
    assert "main" not in record(r, at)
    assert record(r, at)["attempts"] == "2"


def test_a_delivery_records_its_message_where_the_gate_recorded_none(r: redis.Redis, tasks: crash_app.Tasks) -> None:
    """Each delivery of an ungated run records its own message; a gated run keeps what the gate recorded.

    Else recovery would look for an earlier delivery's message (a retry's
    copy has a new tag), or the reaper and recovery would lose the message
    the gate pushed.
    """
    store = runtime.store_for(tasks.hang.app)
    ungated, gated = member("hang_while", "hang_while:9"), member("hang", "hang:9")

    def start(at: str, task_id: str, gated: bool, tag: str) -> None:
        decision = store.start(
            at,
            task_id,
            new_token(),
            lock_ms=60_000,
            gated=gated,
            key_mode="lock",
            hostname="h",
            pid=1,
            retries=0,
            record_ms=86_400_000,
            delivery=(tag, "unacked") if tag else ("", ""),
        )
        assert decision.run, decision
        r.delete(SCHEMA.lock(at))  # that delivery is gone

    start(ungated, "run-9", False, "tag-1")
    assert (record(r, ungated)["tag"], record(r, ungated)["unacked"]) == ("tag-1", "unacked")
    start(ungated, "run-9", False, "tag-2")  # a retry: the same run, a new message
    assert record(r, ungated)["tag"] == "tag-2"
    start(ungated, "run-9", False, "")  # a delivery whose message recovery could not put back
    assert "tag" not in record(r, ungated) and "unacked" not in record(r, ungated)

    run = tasks.hang.apply_async((9,))
    pushed = record(r, gated)
    assert pushed["task_id"] == run.id and pushed["tag"] and pushed["queue"], "premise: the gate recorded its push"
    start(gated, run.id, True, "another-tag")
    fields = ("tag", "unacked", "queue")
    assert {k: record(r, gated)[k] for k in fields} == {k: pushed[k] for k in fields}


# --- takeover and redelivery with real workers -----------------------------------------------------


def under_the_same_name(fleet: Fleet, server: Server) -> WorkerProcess:
    """Start a worker under the node name of the fleet's first (with the fleet's last settings), ready."""
    worker = WorkerProcess(server.url, app="tests.crash_app", transport_options={}, extra=("--hostname", "crash0@%h"))
    fleet.workers.append(worker)
    return worker.wait_ready(timeout=60)


def delivered_by(r: redis.Redis) -> int | None:
    """The pid of the main process the running delivery's record names."""
    owner = processes.owner_of(record(r, HANG).get("main", ""))
    return None if owner is None else owner.pid


def recovery_conf(*, reject_on_worker_lost: bool) -> dict[str, Any]:
    return {
        "task_acks_late": True,
        "task_reject_on_worker_lost": reject_on_worker_lost,
        "dedup_lock_ttl": LOCK_TTL,
    }


def counter(r: redis.Redis, decision: str) -> int:
    return int(r.hget(SCHEMA.stats, f"{TASK}:{decision}") or 0)


@contextmanager
def showing_logs(fleet: Fleet) -> Iterator[None]:
    """Print the workers' logs when an assertion inside fails: what they did is the failure's story."""
    try:
        yield
    except AssertionError:
        print(fleet.logs())
        raise


def assert_rerun_once_and_succeeded(r: redis.Redis, run_id: str, at: str = HANG) -> None:
    key = at.partition(":")[2]
    wait_for(lambda: record(r, at).get("state") == "succeeded", RERUN_WAIT, "the killed run re-ran and succeeded")
    assert executions(r, key) == 2, "the work re-ran exactly once"
    assert run_ids(r, key) == [run_id, run_id], "the re-run is the same run"
    final = record(r, at)
    assert final["task_id"] == run_id
    assert final["attempts"] == "2"
    assert "lost" in history_states(r, at)
    notes = history(r, at)
    assert any("taken over from" in entry for entry in notes), notes
    assert int(r.hget(SCHEMA.stats, f"{at.partition(':')[0]}:taken_over") or 0) == 1
    assert r.get(SCHEMA.lock(at)) is None
    assert not r.sismember(SCHEMA.held, at)


@pytest.mark.slow
def test_a_killed_pool_child_reruns_at_once_after_a_restart(
    fleet: Fleet, tasks: crash_app.Tasks, r: redis.Redis
) -> None:
    """SIGKILL the pool child running a keyed acks_late task; restart the worker 2 s later.

    With ``task_reject_on_worker_lost`` the main process requeues the message
    (else Celery acknowledges it as failed and nothing re-runs). Proves: the
    copy takes over the dead child's lock at once instead of waiting out the
    lock TTL, runs once more, and the run ends succeeded.
    """
    conf = recovery_conf(reject_on_worker_lost=True)
    (worker,) = fleet.start(conf=conf, transport={})
    r.set(crash_app.hang_key("hang:1"), 1)
    run = tasks.hang.apply_async((1,))
    pid = started_pid(r, "hang:1")
    assert pid != worker.process.pid
    os.kill(pid, signal.SIGKILL)
    time.sleep(2)
    worker.stop()
    fleet.start(conf=conf, transport={})
    with showing_logs(fleet):
        assert_rerun_once_and_succeeded(r, run.id)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["same", "another"])
def test_a_killed_worker_reruns_at_once_after_a_restart_on_the_same_host(
    name: str, fleet: Fleet, tasks: crash_app.Tasks, r: redis.Redis, server: Server
) -> None:
    """SIGKILL a whole worker (its process group) mid-task; start a new one on the same host.

    Nobody acknowledged the message: kombu would hand it out again only after
    its visibility timeout (an hour here). Proves: the new worker, under the
    same node name (a restart) or another one, sees that the run's owner and
    its worker's main process are dead, restores the message at once, and the
    copy takes the lock over and runs once more.
    """
    conf = recovery_conf(reject_on_worker_lost=False)
    (worker,) = fleet.start(conf=conf, transport={})
    r.set(crash_app.hang_key("hang:1"), 1)
    run = tasks.hang.apply_async((1,))
    started_pid(r, "hang:1")
    worker.stop(signal.SIGKILL)
    assert r.hlen("unacked") == 1, "premise: the message waits, unacknowledged"
    if name == "same":
        under_the_same_name(fleet, server)
    else:
        fleet.start(conf=conf, transport={})
    with showing_logs(fleet):
        assert_rerun_once_and_succeeded(r, run.id)
        assert r.hlen("unacked") == 0


@pytest.mark.slow
def test_a_killed_worker_s_ungated_run_reruns_at_once_after_a_restart(
    fleet: Fleet, tasks: crash_app.Tasks, r: redis.Redis
) -> None:
    """As above, for a ``while_executing`` run: no enqueue gate wrote where its message went.

    Proves: the delivery itself records its message's tag as it starts, so
    the new worker puts the message back at once, routed as kombu restores
    it, and the copy takes the lock over and runs once more; its record ends
    succeeded.
    """
    at = member("hang_while", "hang_while:1")
    conf = recovery_conf(reject_on_worker_lost=True)
    (worker,) = fleet.start(conf=conf, transport={})
    r.set(crash_app.hang_key("hang_while:1"), 1)
    run = tasks.hang_while.apply_async((1,))
    started_pid(r, "hang_while:1")
    worker.stop(signal.SIGKILL)
    assert r.hlen("unacked") == 1, "premise: the message waits, unacknowledged"
    assert "queue" not in record(r, at), "premise: no gate recorded where the message went"
    fleet.start(conf=conf, transport={})
    with showing_logs(fleet):
        assert_rerun_once_and_succeeded(r, run.id, at)
        assert r.hlen("unacked") == 0
        assert not queued_messages(r)


@pytest.mark.slow
def test_an_ungated_run_s_message_goes_back_where_kombu_would_restore_it(
    fleet: Fleet, tasks: crash_app.Tasks, r: redis.Redis
) -> None:
    """A ``while_executing`` run sent with a priority dies with its whole worker; this process recovers it.

    Proves: the message goes back once, redelivered, onto the list of its
    queue for its priority (as kombu's restore routes it, by the exchange and
    routing key it kept), out of the unacknowledged hash and its index; a
    second pass finds nothing more to do; a new worker re-runs it once.
    """
    at = member("hang_while", "hang_while:1")
    conf = recovery_conf(reject_on_worker_lost=True)
    (worker,) = fleet.start(conf=conf, transport={})
    r.set(crash_app.hang_key("hang_while:1"), 1)
    run = tasks.hang_while.apply_async((1,), priority=5)
    child = started_pid(r, "hang_while:1")
    worker.stop(signal.SIGKILL)
    # SIGKILL is delivered asynchronously: on a busy machine the pool child may still run for a moment after
    # the main process is reaped, and recovery acts only on proof of death.
    wait_for(lambda: processes.gone(child), 10, "the pool child is dead")
    assert r.hlen("unacked") == 1, "premise: the message waits, unacknowledged"
    app = tasks.hang_while.app
    store = runtime.store_for(app)
    with showing_logs(fleet):
        assert recovery.recover(app, store) == 1
        assert recovery.recover(app, store) == 0, "a message was put back twice"
        assert r.hlen("unacked") == 0 and r.zcard("unacked_index") == 0
        assert r.llen("celery") == 0
        (raw,) = r.lrange("celery\x06\x163", 0, -1)  # kombu's list for priorities 3 to 5
        message = json.loads(raw)
        assert message["headers"]["id"] == run.id
        assert message["headers"]["redelivered"] is True
        fleet.start(conf=conf, transport={})
        assert_rerun_once_and_succeeded(r, run.id, at)


@pytest.mark.slow
def test_a_live_owner_is_never_taken_over(fleet: Fleet, tasks: crash_app.Tasks, r: redis.Redis) -> None:
    """A run executes on worker A; worker B starts, and a copy of the run's message is pushed again.

    Proves: B's start-up leaves the live run's message alone, and the copy,
    refused by a lock whose owner is alive, is deferred rather than run: the
    body ran once, the lock is still the first delivery's, nothing was taken over.
    """
    conf = recovery_conf(reject_on_worker_lost=True)
    fleet.start(conf=conf, transport={})
    r.set(crash_app.hang_key("hang:1"), 1)
    tasks.hang.apply_async((1,))
    pid = started_pid(r, "hang:1")
    holder = r.get(SCHEMA.lock(HANG))
    assert holder is not None and holder.decode().split(":")[1] == str(pid)
    fleet.start(conf=conf, transport={})
    with showing_logs(fleet):
        assert r.hlen("unacked") == 1, "the second worker's start-up restored a live run's message"
        (raw,) = r.hvals("unacked")
        payload = json.loads(raw)[0]
        r.lpush("celery", json.dumps(payload))  # a manual re-push: a copy of the running run
        wait_for(lambda: counter(r, "deferred") >= 1, RERUN_WAIT, "the copy was refused and deferred")
        assert executions(r, "hang:1") == 1, "a copy ran beside its live owner"
        assert r.get(SCHEMA.lock(HANG)) == holder
        assert record(r, HANG)["state"] == "started"
        assert counter(r, "taken_over") == 0
        assert processes.owner_of(holder.decode()) is not None
        assert not processes.owner_gone(holder.decode())


@pytest.mark.slow
def test_a_worker_killed_after_a_successor_took_its_name_reruns_at_once(
    fleet: Fleet, tasks: crash_app.Tasks, r: redis.Redis, server: Server
) -> None:
    """Worker A runs a run; B starts under A's node name while A still drains; then A is SIGKILLed.

    A restart whose old worker is killed when its stop timeout runs out, as
    systemd and Docker do. Proves: the run's record names the main process
    that delivered it, so B's next recovery pass (after a reaper pass) sees
    that process dead though B, alive, now goes by the same name; the
    message is back at once, and its copy takes the lock over and runs once
    more, long before the hour of ``visibility_timeout``.
    """
    conf = {**recovery_conf(reject_on_worker_lost=False), "dedup_reap_interval": 1}
    (old,) = fleet.start(conf=conf, transport={})
    r.set(crash_app.hang_key("hang:1"), 1)
    run = tasks.hang.apply_async((1,))
    started_pid(r, "hang:1")
    assert delivered_by(r) == old.process.pid, "premise: the record names the old worker's main process"
    successor = under_the_same_name(fleet, server)
    time.sleep(2)  # the successor has made its start-up pass, and works on, when the old worker is killed
    old.stop(signal.SIGKILL)
    assert successor.process.poll() is None, "premise: the successor lives on"
    assert r.hlen("unacked") == 1, "premise: the message waits, unacknowledged"
    with showing_logs(fleet):
        assert_rerun_once_and_succeeded(r, run.id)
        assert r.hlen("unacked") == 0


@pytest.mark.slow
def test_a_successor_killed_under_the_same_name_leaves_the_live_worker_s_run_alone(
    fleet: Fleet, tasks: crash_app.Tasks, r: redis.Redis, server: Server
) -> None:
    """Worker A runs a run; B starts under A's node name and is SIGKILLed; A lives on.

    Then A's pool child dies while A's main process, stopped (SIGSTOP) so that
    it cannot settle it yet, still lives: the run's owner is provably dead,
    its worker's main process is not. Proves: a recovery pass on this machine
    restores nothing, neither before nor after the child's death; A settles
    its lost child as Celery's settings say (acknowledged as failed, as
    ``task_reject_on_worker_lost`` is off); the body ran once and nothing
    was taken over.
    """
    conf = recovery_conf(reject_on_worker_lost=False)
    (old,) = fleet.start(conf=conf, transport={})
    r.set(crash_app.hang_key("hang:1"), 1)
    tasks.hang.apply_async((1,))
    child = started_pid(r, "hang:1")
    assert delivered_by(r) == old.process.pid, "premise: the record names the old worker's main process"
    successor = under_the_same_name(fleet, server)
    time.sleep(2)  # the successor runs a while, as a restarted worker does, before it dies
    successor.stop(signal.SIGKILL)
    app = tasks.hang.app
    store = runtime.store_for(app)
    holder = r.get(SCHEMA.lock(HANG))
    assert holder is not None
    with showing_logs(fleet):
        assert recovery.recover(app, store) == 0, "a live run's message was put back"
        os.kill(old.process.pid, signal.SIGSTOP)
        try:
            os.kill(child, signal.SIGKILL)
            wait_for(lambda: processes.gone(child), 10, "the pool child is dead")
            assert processes.owner_gone(holder.decode()), "premise: the run's owner is provably dead"
            assert recovery.recover(app, store) == 0, "a live worker's run was put back"
            assert r.hlen("unacked") == 1
        finally:
            os.kill(old.process.pid, signal.SIGCONT)
        wait_for(lambda: r.hlen("unacked") == 0, RERUN_WAIT, "the live worker acknowledged its lost child's message")
        wait_for(lambda: record(r, HANG).get("state") == "lost", RERUN_WAIT, "the run is recorded lost")
        assert executions(r, "hang:1") == 1, "the body ran twice"
        assert not queued_messages(r)
        assert counter(r, "taken_over") == 0
