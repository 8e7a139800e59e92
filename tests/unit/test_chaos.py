"""The chaos checker (run-chaos): its invariants on hand-written histories.

Each test feeds the checker a small history written by hand: each invariant
must flag the violation it exists for and let the allowed cases pass. Real
runs are in tests/integration/test_chaos_runs.py.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import pytest
from celery.exceptions import Reject

from celery_dedup.keys import limit_group_member
from celery_dedup.store import schema
from chaos.app import outcome_of
from chaos.checker import Report, check
from chaos.history import SERVER_LOG
from chaos.runner import history_strings

# --- the checker on hand-written histories ---------------------------------------------------

T0 = 1_800_000_000.0
MEMBER = "chaos.until_executed:k1"


class Story:
    """Builds a run directory event by event, as the processes of a run would write it."""

    def __init__(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        self.events: list[dict[str, Any]] = []
        self.members: dict[str, dict[str, Any]] = {}

    def add(self, t: float, ev: str, *, pid: int = 100, role: str = "worker-0.1", **fields: Any) -> Story:
        self.events.append({"t": T0 + t, "ev": ev, "pid": pid, "role": role, **fields})
        return self

    def call(self, t: float, task_id: str, outcome: str = "accepted", member: str = MEMBER, **fields: Any) -> Story:
        mode = member.split(":", maxsplit=1)[0].removeprefix("chaos.")
        call_id = fields.pop("call", f"c{len(self.events)}")
        way, replace = fields.pop("way", "delay"), fields.pop("replace", "")
        common = {"call": call_id, "member": member, "mode": mode, "way": way, "delay": 0.0, "replace": replace}
        self.add(t, "call_start", role="producer-0.1", pid=50, **common)
        return self.add(t + 0.01, "call", role="producer-0.1", pid=50, outcome=outcome, id=task_id, **common, **fields)

    def body(
        self, start: float, end: float | None, task_id: str, *, pid: int = 100, outcome: str = "succeeded", **extra: Any
    ) -> Story:
        common = {"task_id": task_id, "member": extra.pop("member", MEMBER), "call": extra.pop("call", "c")}
        common["tid"] = extra.pop("tid", 0)
        role = extra.pop("role", "worker-0.1")
        lock_lost = extra.pop("lock_lost", False)
        self.add(start, "body_start", pid=pid, role=role, **common, **extra)  # extra: a limited body's group
        if end is not None:
            self.add(end, "body_end", pid=pid, role=role, outcome=outcome, lock_lost=lock_lost, **common)
        return self

    def server(self, member: str, *entries: tuple[float, str, str, str]) -> Story:
        """Server history entries ``(t, state, task id, note)`` of ``member``."""
        info = self.members.setdefault(member, {"record": {}, "history": [], "held": False, "lock": None})
        for t, state, task_id, note in entries:
            info["history"].insert(0, f"{int((T0 + t) * 1000)} {state} {task_id} {note}".rstrip())
        return self

    def check(self) -> Report:
        self.add(100, "phase", role="runner", name="stopped")
        with (self.run_dir / "story-1.jsonl").open("w") as out:
            for event in self.events:
                out.write(json.dumps(event) + "\n")
        final = {"server_ms": int((T0 + 100) * 1000), "members": self.members, "queued_ids": [], "due_members": []}
        (self.run_dir / "final.json").write_text(json.dumps(final))
        return check(self.run_dir, seed=0)


def invariants(report: Report) -> list[str]:
    return [violation.invariant for violation in report.violations]


@pytest.fixture
def story(tmp_path: Path) -> Story:
    return Story(tmp_path)


def test_a_worker_exiting_on_its_own_because_of_the_library_is_a_crash(story: Story) -> None:
    story.add(0, "spawn", role="runner", slot="worker-0", generation=1, process=99)
    error = 'Unrecoverable error: TypeError("DedupUnavailableError.__init__() missing 2 required arguments")'
    story.add(5, "crash", role="runner", slot="worker-0", pids=[99], status=1, log=error, trace="")
    story.add(9, "crash", role="runner", slot="worker-1", pids=[98], status=1, log="AttributeError", trace="kombu")
    report = story.check()
    assert invariants(report) == ["crash"]
    assert "DedupUnavailableError" in report.violations[0].message
    assert [item.kind for item in report.explained] == ["crash"], "a crash in kombu alone is explained"


def test_two_bodies_of_one_key_at_once_is_an_overlap(story: Story) -> None:
    report = story.call(0, "a").body(1, 3, "a", pid=100).body(2, 4, "a", pid=200).check()  # a redelivered copy
    assert invariants(report) == ["overlap"]
    assert "never reported losing its lock" in report.violations[0].message
    assert any("body_start" in line for line in report.violations[0].excerpt), "the excerpt shows the history"


def test_a_body_that_lost_its_lock_to_a_sigstop_overlaps_explained(story: Story) -> None:
    story.call(0, "a").body(1, 9, "a", pid=100, lock_lost=True)
    story.add(1.5, "fault", role="nemesis", kind="stop-worker", pids=[99, 100])
    report = story.body(6, 7, "a", pid=200).check()
    assert invariants(report) == []
    assert [item.kind for item in report.explained] == ["overlap"]
    assert "SIGSTOPped" in report.explained[0].message


def test_a_lock_lost_without_any_fault_is_a_lock_taken(story: Story) -> None:
    story.call(0, "a").body(1, 9, "a", pid=100, lock_lost=True)
    report = story.body(2, 3, "a", pid=200).check()
    assert invariants(report) == ["overlap"]
    assert "a live lock was taken" in report.violations[0].message


def test_a_killed_body_ends_when_it_was_killed(story: Story) -> None:
    story.call(0, "a").body(1, None, "a", pid=100)
    story.add(2, "kill", role="runner", pids=[100], why="kill-child")
    report = story.body(5.5, 6, "a", pid=200).check()  # the acks_late copy, after the lock expired
    assert invariants(report) == []


def test_a_body_ends_when_its_process_exited_however_it_died(story: Story) -> None:
    story.call(0, "a").body(1, None, "a", pid=100)
    story.add(2, "exit", role="runner", pids=[100])
    assert invariants(story.body(5.5, 6, "a", pid=200).check()) == []


def test_a_run_executing_again_after_success(story: Story) -> None:
    report = story.call(0, "a").body(1, 2, "a", pid=100).body(5, 6, "a", pid=200).check()
    assert invariants(report) == ["again-after-end"]


def test_a_retry_or_a_wipe_of_the_server_allows_another_execution(story: Story) -> None:
    story.call(0, "a").body(1, 2, "a", pid=100, outcome="retry").body(3, 4, "a", pid=200)
    story.call(10, "b").body(11, 12, "b", pid=100)
    story.add(13, "fault", role="nemesis", kind="restart", wipe=True)
    report = story.body(15, 16, "b", pid=200).check()
    assert invariants(report) == []


def test_a_wipe_between_recording_an_ending_and_settling_it_allows_another_execution(tmp_path: Path) -> None:
    """The server recorded the ending, was killed and came back empty, and only then did the body's
    process settle it: the settle is a bound on when the ending was recorded, not the moment. Recorded
    while the server was down, it can only have been recorded before, and the wipe took it; a settle
    once the server was back can have recorded it there, and the run must not execute again."""

    def rerun(story: Story, *, settled_at: float) -> Report:
        story.call(0, "a").body(1, 2, "a", pid=100, tid=7)
        story.add(2.001, "fault", role="runner", kind="restart", wipe=True, seconds=1.0)
        story.add(settled_at, "settled", pid=100, task_id="a", state="SUCCESS", tid=7)
        story.add(3.2, "fault_end", role="runner", kind="restart", wipe=True)
        return story.body(6, 6.5, "a", pid=200, role="worker-1.1").check()

    assert invariants(rerun(Story(tmp_path / "during"), settled_at=2.002)) == []
    assert invariants(rerun(Story(tmp_path / "after"), settled_at=4.0)) == ["again-after-end"]


def test_only_the_bodys_own_process_settling_it_records_its_ending(tmp_path: Path) -> None:
    """Another worker's deferred copy settled (``IGNORED``) while the body's worker, through a server restart,
    was still recording the ending, and was killed before it did: the run had not ended, its re-run is right."""

    def rerun(story: Story, *, own_settle: bool) -> Report:
        story.call(0, "a").body(1, 2, "a", pid=100, tid=7)
        story.add(1.9, "fault", role="runner", kind="restart", wipe=False)
        if own_settle:
            story.add(2.5, "settled", pid=100, task_id="a", state="SUCCESS", tid=7)
        story.add(3, "settled", pid=200, role="worker-1.1", task_id="a", state="IGNORED", tid=1)
        story.add(3.5, "kill", role="runner", pids=[100], why="kill-worker")
        return story.body(5, 6, "a", pid=300).check()

    assert invariants(rerun(Story(tmp_path / "unsettled"), own_settle=False)) == []
    assert invariants(rerun(Story(tmp_path / "settled"), own_settle=True)) == ["again-after-end"]


def test_an_accepted_run_that_never_ran_and_left_no_ending_is_unresolved(story: Story) -> None:
    report = story.call(0, "a").call(0.5, "a", outcome="duplicate").check()
    assert sorted(invariants(report)) == ["unresolved-duplicate", "unresolved-run"]


def test_a_recorded_ending_resolves_a_run_that_never_ran(story: Story) -> None:
    story.call(0, "a").call(0.5, "a", outcome="duplicate")
    report = story.server(MEMBER, (0.0, "queued", "a", ""), (8.0, "lost", "a", "message lost by the transport")).check()
    assert invariants(report) == []


def test_a_run_queued_by_a_producer_killed_mid_publish_must_resolve(story: Story) -> None:
    report = story.server(MEMBER, (0.0, "queued", "orphan", "")).check()
    assert invariants(report) == ["unresolved-run"]


def test_an_ungated_run_lost_in_transit_is_explained_only_by_a_fault(tmp_path: Path) -> None:
    ungated = "chaos.while_executing:k1"
    assert invariants(Story(tmp_path / "calm").call(0, "a", member=ungated).check()) == ["unresolved-run"]
    story = Story(tmp_path / "cut").call(0, "a", member=ungated)
    report = story.add(0.5, "fault", role="runner", kind="proxy", action="reset", target="worker-0").check()
    assert invariants(report) == []
    assert [item.kind for item in report.explained] == ["transit"]


def test_an_ungated_run_lost_to_a_kill_that_came_after_its_fault_began_is_explained(tmp_path: Path) -> None:
    """A restart-worker fault starts at +0.2 and SIGKILLs the old worker at +1.2: a run accepted between is lost."""
    ungated = "chaos.while_executing:k1"

    def story_with(kill: float) -> Report:
        story = Story(tmp_path / f"kill-{kill}")
        story.add(0.2, "fault", role="nemesis", kind="restart-worker", slot="worker-0", pids=[99, 100])
        story.call(0.5, "a", member=ungated)
        return story.add(kill, "kill", role="runner", slot="worker-0", pids=[99, 100], why="restart-worker").check()

    report = story_with(1.2)
    assert invariants(report) == []
    assert [item.kind for item in report.explained] == ["transit"]
    assert "restart-worker" in report.explained[0].message
    assert invariants(story_with(0.4)) == ["unresolved-run"], "killed before the run was accepted"


def test_a_second_run_accepted_while_the_first_is_queued(story: Story) -> None:
    report = story.call(0, "a").call(1, "b").body(2, 3, "a").body(4, 5, "b").check()
    assert invariants(report) == ["double-accept"]


def test_a_second_run_after_the_first_ended_is_fine(story: Story) -> None:
    report = story.call(0, "a").body(1, 2, "a").call(3, "b").body(4, 5, "b").check()
    assert invariants(report) == []


def test_a_reject_without_requeue_ends_the_run_and_frees_its_key(tmp_path: Path) -> None:
    """Celery's retry rejects its message without requeue when it cannot publish the retry: the run ended
    ``rejected``. A reject with requeue redelivers the message: the first run still holds the key."""
    assert [outcome_of(Reject("publish failed", requeue=requeue)) for requeue in (False, True)] == [
        "rejected",
        "requeued",
    ], "the body records which it was"

    def rejected(story: Story, outcome: str, *, retry: bool = False) -> Report:
        story.call(0, "a", call="first", retry=retry).body(1, 2, "a", call="first", outcome=outcome)
        return story.call(3, "b").body(4, 5, "b").check()

    assert invariants(rejected(Story(tmp_path / "dropped"), "rejected")) == []
    assert invariants(rejected(Story(tmp_path / "requeued"), "requeued")) == ["double-accept"]
    # A history from before the two were told apart: a body told to retry raised it from Task.retry.
    assert invariants(rejected(Story(tmp_path / "retrying"), "Reject", retry=True)) == []
    assert invariants(rejected(Story(tmp_path / "unknown"), "Reject")) == ["double-accept"]


def test_a_body_whose_replace_failed_to_publish_ended_its_run(tmp_path: Path) -> None:
    """A body records ``replaced`` before ``Task.replace`` publishes; if the publish fails, the task raises and
    its process settles it ``FAILURE``: the run ended failed and freed its key, nothing replaced it."""

    def replaced(story: Story, state: str) -> Report:
        story.call(0, "a", call="first").body(1, 2, "a", call="first", outcome="replaced")
        story.add(2.5, "settled", task_id="a", state=state)
        return story.call(3, "b").body(4, 5, "b").check()

    assert invariants(replaced(Story(tmp_path / "failed"), "FAILURE")) == []
    assert invariants(replaced(Story(tmp_path / "handed-on"), "IGNORED")) == ["double-accept"]


def test_a_key_freed_at_start_is_free_a_little_before_the_bodys_event(tmp_path: Path) -> None:
    """until_executing frees its key when the server lets the run start, which the body's own event follows by
    the worker's own work: a call accepted between the two is no double accept; one well before it is."""
    starting = "chaos.until_executing:k1"

    def accepted_before_the_event(story: Story, gap: float) -> Report:
        story.call(0, "a", member=starting).body(2, 2.5, "a", member=starting)
        return story.call(2 - gap, "b", member=starting).body(3, 3.5, "b", member=starting).check()

    assert invariants(accepted_before_the_event(Story(tmp_path / "between"), 0.03)) == []
    assert invariants(accepted_before_the_event(Story(tmp_path / "before"), 0.5)) == ["double-accept"]


def test_throttle_one_run_per_window_unless_the_first_failed(story: Story) -> None:
    throttled = "chaos.throttle:k1"
    story.call(0, "a", member=throttled).body(0.2, 0.3, "a", member=throttled)
    story.call(1, "b", member=throttled).body(1.2, 1.3, "b", member=throttled)
    assert invariants(story.check()) == ["window"]


def test_throttle_a_failed_run_frees_its_window(tmp_path: Path) -> None:
    throttled = "chaos.throttle:k1"
    story = Story(tmp_path)
    story.call(0, "a", member=throttled).body(0.2, 0.3, "a", member=throttled, outcome="failed")
    story.call(1, "b", member=throttled).body(1.2, 1.3, "b", member=throttled)
    assert invariants(story.check()) == []


def test_debounce_runs_with_the_last_call_of_its_burst(story: Story) -> None:
    debounced = "chaos.debounce:k1"
    story.call(0, "r", member=debounced, call="first")
    story.call(0.2, "r", outcome="collapsed", member=debounced, call="last")
    report = story.body(1, 1.1, "r", member=debounced, call="first").check()
    assert invariants(report) == ["debounce-args"]


def test_debounce_calls_after_the_body_started_are_not_its_burst(story: Story) -> None:
    debounced = "chaos.debounce:k1"
    story.call(0, "r", member=debounced, call="first").body(1, 1.1, "r", member=debounced, call="first")
    assert invariants(story.call(1.05, "r", outcome="collapsed", member=debounced, call="late").check()) == []


def test_debounce_with_the_last_call_passes(story: Story) -> None:
    debounced = "chaos.debounce:k1"
    story.call(0, "r", member=debounced, call="first")
    story.call(0.2, "r", outcome="collapsed", member=debounced, call="last")
    assert invariants(story.body(1, 1.1, "r", member=debounced, call="last").check()) == []


def test_debounce_a_wipe_between_a_joining_call_and_the_body_explains_older_arguments(tmp_path: Path) -> None:
    """The joining call's arguments went with the server's record: the worker's copy ran with the ones it carried."""
    debounced = "chaos.debounce:k1"

    def burst(story: Story, wiped_at: float) -> Report:
        story.call(0, "r", member=debounced, call="first")
        story.call(0.2, "r", outcome="collapsed", member=debounced, call="last")
        story.add(wiped_at, "fault", role="runner", kind="restart", wipe=True)
        return story.body(1, 1.1, "r", member=debounced, call="first").check()

    explained = burst(Story(tmp_path / "before"), 0.5)
    assert invariants(explained) == [] and [item.kind for item in explained.explained] == ["wiped"]
    assert invariants(burst(Story(tmp_path / "after"), 1.5)) == ["debounce-args"]


def test_a_run_replaced_by_a_plain_task_frees_its_key(story: Story) -> None:
    story.call(0, "a", call="head", replace="plain").body(1, 1.1, "a", call="head", outcome="replaced")
    assert invariants(story.call(2, "b").body(3, 4, "b").check()) == []


def test_a_run_replaced_under_its_key_still_holds_it(story: Story) -> None:
    story.call(0, "a", call="head", replace="same").body(1, 1.1, "a", call="head", outcome="replaced")
    assert invariants(story.call(2, "b").body(3, 4, "b").body(5, 6, "a", call="head").check()) == ["double-accept"]


def test_a_chain_whose_run_succeeded_must_go_on(story: Story) -> None:
    story.call(0, "a", call="head", way="chain").body(1, 2, "a", call="head")
    story.call(0.5, "a", outcome="duplicate", call="follower", way="chain", own="f")
    story.add(2.5, "decision", pid=300, decision="followed", task_id="f", message="resolved as run a ended")
    report = story.add(2.6, "continued", pid=300, call="follower").check()
    assert [(v.invariant, v.message.split()[1]) for v in report.violations] == [("continuation", "head")]


def test_a_chain_goes_on_with_its_runs_result(story: Story) -> None:
    story.call(0, "a", call="head", way="chain").body(1, 2, "a", call="head")
    report = story.add(2.5, "continued", pid=300, call="head", result="some-other-call").check()
    assert invariants(report) == ["continuation"]
    assert "not the result of its run" in report.violations[0].message


def test_a_follower_of_a_run_declared_lost_that_finished_after_stops(story: Story) -> None:
    """The first ending settled for a run stands: its followers fail as lost; its late success changes nothing."""
    story.call(0, "a").body(1, None, "a", pid=100).add(2, "kill", role="runner", pids=[100])
    story.call(0.5, "a", outcome="duplicate", call="follower", way="chain", own="f")
    story.body(4, 5, "a", pid=200)
    story.server(MEMBER, (0.0, "queued", "a", ""), (1.0, "started", "a", ""), (3.0, "lost", "a", ""))
    story.server(MEMBER, (4.0, "started", "a", ""), (5.0, "succeeded", "a", ""))
    assert invariants(story.check()) == []


def test_a_follower_of_a_run_that_succeeded_first_still_must_go_on(story: Story) -> None:
    """A loss recorded only after the success settled nothing: the chain must go on."""
    story.call(0, "a").body(1, 2, "a", pid=100)
    story.call(0.5, "a", outcome="duplicate", call="follower", way="chain", own="f")
    story.server(MEMBER, (0.0, "queued", "a", ""), (1.0, "started", "a", ""), (2.0, "succeeded", "a", ""))
    story.server(MEMBER, (3.0, "lost", "a", ""))
    assert invariants(story.check()) == ["continuation"]


def test_a_wipe_before_a_follower_went_on_explains_another_runs_result(story: Story) -> None:
    """Its parked entry went with the server's data: redelivered, it followed the key's next run."""
    story.call(0, "a", call="first").body(1, 2, "a", call="first")
    story.call(0.5, "a", outcome="duplicate", call="follower", way="chain", own="f")
    story.add(2.5, "fault", role="runner", kind="restart", wipe=True)
    story.call(4, "b", call="second").body(5, 6, "b", call="second")
    report = story.add(6.5, "continued", pid=300, call="follower", result="second").check()
    assert invariants(report) == []
    assert [e.kind for e in report.explained] == ["wiped"]


def test_a_wipe_after_a_follower_went_on_explains_nothing(story: Story) -> None:
    story.call(0, "a", call="first").body(1, 2, "a", call="first")
    story.call(0.5, "a", outcome="duplicate", call="follower", way="chain", own="f")
    story.call(4, "b", call="second").body(5, 6, "b", call="second")
    story.add(6.5, "continued", pid=300, call="follower", result="second")
    report = story.add(7, "fault", role="runner", kind="restart", wipe=True).check()
    assert invariants(report) == ["continuation"]


def replaced_run(story: Story) -> Story:
    """Run ``a`` replaced itself by a plain task, which ran and returned the run's result; ``follower`` followed it."""
    story.call(0, "a", call="head", replace="plain").body(1, 1.1, "a", call="head", outcome="replaced")
    story.server(MEMBER, (0.0, "queued", "a", ""), (1.0, "started", "a", ""), (1.1, "replaced", "a", ""))
    story.add(1.3, "replacement_ran", pid=300, result="head")
    story.call(0.5, "a", outcome="duplicate", call="follower", way="chain", own="f")
    return story.add(1.4, "decision", pid=300, decision="followed", task_id="f", message="resolved as run a ended")


def test_a_follower_of_a_run_replaced_by_a_plain_task_must_go_on(story: Story) -> None:
    report = replaced_run(story).check()
    assert invariants(report) == ["continuation"]
    assert "its replacement ran" in report.violations[0].message


def test_a_follower_of_a_replaced_run_goes_on_with_the_replacements_result(tmp_path: Path) -> None:
    good = replaced_run(Story(tmp_path / "good")).add(1.5, "continued", pid=300, call="follower", result="head")
    assert invariants(good.check()) == []
    bad = replaced_run(Story(tmp_path / "bad")).add(1.5, "continued", pid=300, call="follower", result="replaced")
    assert invariants(bad.check()) == ["continuation"]


def test_a_chain_goes_on_with_its_next_step(story: Story) -> None:
    story.call(0, "a", call="head", way="chain").body(1, 2, "a", call="head")
    assert invariants(story.add(2.5, "continued", pid=300, call="head").check()) == []


def test_a_chain_whose_run_failed_stops(story: Story) -> None:
    story.call(0, "a", call="head", way="chain").body(1, 2, "a", call="head", outcome="failed")
    assert invariants(story.check()) == []


def test_a_sent_next_step_that_never_ran_is_explained_only_by_a_transit_fault_soon_after(story: Story) -> None:
    story.call(0, "a", call="head", way="chain").body(1, 2, "a", call="head", pid=100)
    story.server(MEMBER, (0.0, "queued", "a", ""), (1.0, "started", "a", ""), (2.0, "succeeded", "a", ""))
    story.add(2.1, "continuation_sent", pid=100, call="head")
    story.add(5, "fault", role="runner", kind="kill-producer")  # a producer holds no worker's message
    story.add(60, "fault", role="runner", kind="kill-worker", slot="worker-1")  # a worker, but long after
    assert invariants(story.check()) == ["continuation"]


def test_a_sent_next_step_lost_in_transit_soon_after_is_explained(story: Story) -> None:
    story.call(0, "a", call="head", way="chain").body(1, 2, "a", call="head", pid=100)
    story.server(MEMBER, (0.0, "queued", "a", ""), (1.0, "started", "a", ""), (2.0, "succeeded", "a", ""))
    story.add(2.1, "continuation_sent", pid=100, call="head")
    report = story.add(4, "fault", role="runner", kind="restart").check()  # a fetch's reply cut by the restart
    assert invariants(report) == []
    assert [e.kind for e in report.explained] == ["continuation"]


def test_a_next_step_lost_with_a_kill_right_after_the_head_is_explained(story: Story) -> None:
    story.call(0, "a", call="head", way="chain").body(1, 2, "a", call="head", pid=100)
    story.server(MEMBER, (0.0, "queued", "a", ""), (1.0, "started", "a", ""), (2.0, "succeeded", "a", ""))
    report = story.add(2.5, "kill", role="runner", pids=[100]).check()
    assert invariants(report) == []
    assert [e.kind for e in report.explained] == ["continuation"]


def test_a_key_held_after_the_quiet_period_with_no_live_run_is_stuck(story: Story) -> None:
    story.call(0, "a").body(1, 2, "a")
    story.add(3, "phase", role="runner", name="producers_stopped")
    story.server(MEMBER, (0.0, "queued", "a", ""), (2.0, "succeeded", "a", ""))
    held_until = int((T0 + 500) * 1000)
    story.members[MEMBER].update(held=True, record={"task_id": "a", "state": "succeeded", "held_until": held_until})
    assert invariants(story.check()) == ["stuck-key"]


LIMITED = "chaos.limit1:g0"


def test_more_bodies_of_a_limit_group_than_its_limit_at_once(story: Story) -> None:
    """Two sibling threads of one process (one pid) in a group of limit 1: what a threads pool did."""
    group: dict[str, Any] = {"group": LIMITED, "limit": 1}
    story.call(0, "a", member="chaos.limit1:k0").call(0, "b", member="chaos.limit1:k3")
    story.body(1, 3, "a", pid=100, tid=1, member="chaos.limit1:k0", **group)
    report = story.body(2, 4, "b", pid=100, tid=2, member="chaos.limit1:k3", **group).check()
    assert invariants(report) == ["limit"]
    assert "2 bodies of a group of limit 1 ran at once" in report.violations[0].message


def test_bodies_of_a_limit_group_one_after_another_keep_its_limit(story: Story) -> None:
    group: dict[str, Any] = {"group": LIMITED, "limit": 1}
    story.call(0, "a", member="chaos.limit1:k0").call(0, "b", member="chaos.limit1:k3")
    story.body(1, 2, "a", pid=100, tid=1, member="chaos.limit1:k0", **group)
    report = story.body(2.5, 4, "b", pid=100, tid=2, member="chaos.limit1:k3", **group).check()
    assert invariants(report) == []
    assert report.checked["limit"] == 2


def test_a_slot_lost_to_a_sigstop_explains_a_group_over_its_limit(story: Story) -> None:
    group: dict[str, Any] = {"group": LIMITED, "limit": 1}
    story.call(0, "a", member="chaos.limit1:k0").call(0, "b", member="chaos.limit1:k3")
    story.body(1, 9, "a", pid=100, member="chaos.limit1:k0", **group)
    story.add(1.5, "fault", role="nemesis", kind="stop-worker", pids=[99, 100])
    story.add(6.5, "slot_lost_log", pid=100, group=LIMITED, message="limit slot lost")
    report = story.body(6, 7, "b", pid=200, member="chaos.limit1:k3", **group).check()
    assert invariants(report) == []
    assert [item.kind for item in report.explained] == ["limit"]


def test_a_slot_lost_reported_as_its_body_ends_explains_but_a_lost_lock_alone_does_not(tmp_path: Path) -> None:
    """A body SIGSTOPped past its lease wakes and ends before its renewer runs: the library reports the lost slot as
    it gives it back, after the newer body started. Its lost lock alone says nothing of its slot: no excuse."""

    def paused(story: Story, *, reported: bool) -> Story:
        group: dict[str, Any] = {"group": LIMITED, "limit": 1}
        story.call(0, "a", member="chaos.limit1:k0").call(0, "b", member="chaos.limit1:k3")
        story.body(1, 8, "a", pid=100, member="chaos.limit1:k0", **group)
        story.add(1.5, "fault", role="nemesis", kind="stop-worker", pids=[99, 100])
        lost = "lock_lost: chaos.limit1[a] key 'k0': ended succeeded after losing its execution lock"
        story.add(8.01, "decision", pid=100, decision="lock_lost", task_id="a", key="k0", message=lost)
        if reported:
            story.add(8.02, "slot_lost_log", pid=100, group=LIMITED, message="limit slot lost")
        return story.body(6, 6.5, "b", pid=200, member="chaos.limit1:k3", **group)

    explained = paused(Story(tmp_path / "reported"), reported=True).check()
    assert invariants(explained) == [] and [item.kind for item in explained.explained] == ["limit"]
    assert invariants(paused(Story(tmp_path / "unreported"), reported=False).check()) == ["limit"]


def test_a_slot_lost_without_a_fault_is_no_excuse(story: Story) -> None:
    """The evicted sibling's renewer reports the loss: without a fault to account for it, it is a violation."""
    group: dict[str, Any] = {"group": LIMITED, "limit": 1}
    story.call(0, "a", member="chaos.limit1:k0").call(0, "b", member="chaos.limit1:k3")
    story.body(1, 9, "a", pid=100, tid=1, member="chaos.limit1:k0", **group)
    story.add(2.5, "slot_lost_log", pid=100, group=LIMITED, message="limit slot lost")
    report = story.body(2, 3, "b", pid=100, tid=2, member="chaos.limit1:k3", **group).check()
    assert invariants(report) == ["limit"]


# --- a named group shared by two tasks: effective concurrency, windows, pauses, back-offs -----------------

QUOTA = "quota"
#: Declared windows of the story's group: 3 a second, 5 a minute (count/period ms).
QUOTA_RATES = "3/1000,5/60000"


def ms(t: float) -> int:
    """A story time as ms on the server's clock."""
    return int((T0 + t) * 1000)


def quota_body(
    story: Story, start: float, end: float | None, task_id: str, *, key: str = "t0", task: str = "quota_a", **extra: Any
) -> Story:
    """A body of ``chaos.<task>`` in group key ``key`` of the named group (concurrency 2), granted just before it,
    in a process of its own."""
    fields: dict[str, Any] = {
        "group": limit_group_member(QUOTA, key),
        "limit": 2,
        "quota": QUOTA,
        "quota_key": key,
        "rates": QUOTA_RATES,
        "granted_at": ms(start - 0.01),
    }
    fields.update(extra)
    pid = fields.pop("pid", 1000 + len(story.events))  # a process of its own: bodies of one thread end each other
    return story.body(start, end, task_id, pid=pid, member=f"chaos.{task}:k{task_id}", **fields)


def operator(story: Story, kind: str, at: float, undone: float | None, key: str | None = "t0", **values: Any) -> Story:
    """An operator's ``kind`` (override, pause) of ``key`` (None: the whole group) written over [at, at+0.01] and
    undone over [undone, undone+0.01] (None: never)."""
    story.add(
        at, "fault", role="nemesis", kind=kind, group=QUOTA, key=key, from_ms=ms(at), at_ms=ms(at + 0.01), **values
    )
    if undone is not None:
        story.add(
            undone,
            "fault_end",
            role="nemesis",
            kind=kind,
            group=QUOTA,
            key=key,
            from_ms=ms(undone),
            at_ms=ms(undone + 0.01),
        )
    return story


def test_bodies_of_two_tasks_sharing_a_group_key_count_together(story: Story) -> None:
    """Concurrency 2 across ``chaos.quota_a`` and ``chaos.quota_b``: a third body of the key is one too many."""
    quota_body(story, 1, 5, "a", task="quota_a")
    quota_body(story, 2, 5, "b", task="quota_b")
    report = quota_body(story, 3, 4, "c", task="quota_a").check()
    assert invariants(report) == ["limit"]
    assert "3 bodies of a group of limit 2 ran at once" in report.violations[0].message


def test_bodies_of_other_keys_of_the_group_do_not_count(story: Story) -> None:
    quota_body(story, 1, 5, "a", key="t0")
    quota_body(story, 2, 5, "b", key="t0")
    assert invariants(quota_body(story, 3, 4, "c", key="t1").check()) == []


def test_an_override_lowering_a_keys_concurrency_holds_the_next_start(tmp_path: Path) -> None:
    """Under an override to 1 a second body may not start beside the first; the bodies already running go on."""

    def run(story: Story, *, override: bool) -> Report:
        if override:
            operator(story, "override", 0.5, 9, concurrency=1, rates=None)
        quota_body(story, 1, 5, "a")
        return quota_body(story, 2, 4, "b").check()

    lowered = run(Story(tmp_path / "lowered"), override=True)
    assert invariants(lowered) == ["limit"]
    assert "of limit 1" in lowered.violations[0].message
    assert invariants(run(Story(tmp_path / "declared"), override=False)) == []


def test_an_override_of_another_key_or_one_cleared_does_not_apply(tmp_path: Path) -> None:
    other = Story(tmp_path / "other")
    operator(other, "override", 0.5, 9, key="t1", concurrency=1)
    quota_body(other, 1, 5, "a")
    assert invariants(quota_body(other, 2, 4, "b").check()) == []
    cleared = Story(tmp_path / "cleared")
    operator(cleared, "override", 0.1, 0.5, concurrency=1)
    quota_body(cleared, 1, 5, "a")
    assert invariants(quota_body(cleared, 2, 4, "b").check()) == []


def test_a_start_granted_while_an_override_is_written_may_see_either_value(story: Story) -> None:
    """The script may run before or after the write: a grant inside it is judged by the larger value."""
    quota_body(story, 1, 5, "a")
    operator(story, "override", 2.0, 9, concurrency=1)
    assert invariants(quota_body(story, 2.1, 4, "b", granted_at=ms(2.005)).check()) == []


def test_a_group_wide_override_applies_to_every_key_and_a_keys_own_wins(tmp_path: Path) -> None:
    wide = Story(tmp_path / "wide")
    operator(wide, "override", 0.5, 9, key=None, concurrency=1)
    quota_body(wide, 1, 5, "a", key="t2")
    assert invariants(quota_body(wide, 2, 4, "b", key="t2").check()) == ["limit"]
    own = Story(tmp_path / "own")
    operator(own, "override", 0.5, 9, key=None, concurrency=1)
    operator(own, "override", 0.6, 9, key="t2", concurrency=3)
    quota_body(own, 1, 5, "a", key="t2")
    assert invariants(quota_body(own, 2, 4, "b", key="t2").check()) == []


def test_more_starts_in_a_second_than_the_window_allows(tmp_path: Path) -> None:
    """3/s: a fourth start within one second of the first breaks the window; one exactly a second later does not."""

    def run(story: Story, fourth: float) -> Report:
        for n, t in enumerate((1.0, 1.2, 1.4, fourth)):
            quota_body(story, t, t + 0.05, f"r{n}", task="quota_b" if n % 2 else "quota_a")
        return story.check()

    report = run(Story(tmp_path / "inside"), 1.9)
    assert invariants(report) == ["limit-window"]
    assert "4 starts within 1000 ms" in report.violations[0].message and "3/1000" in report.violations[0].message
    assert invariants(run(Story(tmp_path / "later"), 2.0)) == []


def test_more_starts_in_a_minute_than_the_long_window_allows(story: Story) -> None:
    for n in range(6):  # one every 2 s: the 3/s window holds, the 5/min one does not
        quota_body(story, 1 + 2 * n, 1.1 + 2 * n, f"r{n}")
    report = story.check()
    assert invariants(report) == ["limit-window"]
    assert "5/60000" in report.violations[0].message
    assert report.checked["limit-window"] == 6


def test_an_override_raising_the_rate_allows_more_starts_while_in_force(tmp_path: Path) -> None:
    def run(story: Story, cleared: float) -> Report:
        operator(story, "override", 0.5, cleared, rates="10/1000,100/60000")
        for n, t in enumerate((1.0, 1.1, 1.2, 1.3, 1.4)):
            quota_body(story, t, t + 0.05, f"r{n}")
        return story.check()

    assert invariants(run(Story(tmp_path / "raised"), 9)) == []
    assert invariants(run(Story(tmp_path / "cleared"), 1.25)) == ["limit-window"]


def test_a_wipe_of_the_server_explains_a_window_over_its_rate(story: Story) -> None:
    for n, t in enumerate((1.0, 1.2, 1.4)):
        quota_body(story, t, t + 0.05, f"r{n}")
    story.add(1.5, "fault", role="nemesis", kind="restart", wipe=True, seconds=0.1)
    report = quota_body(story, 1.8, 1.9, "r3").check()
    assert invariants(report) == []
    assert [item.kind for item in report.explained] == ["limit"]


def test_no_body_of_a_paused_key_starts_while_it_is_paused(tmp_path: Path) -> None:
    def run(story: Story, key: str | None, start: float, body_key: str = "t0") -> Report:
        operator(story, "pause", 1.0, 4.0, key=key, until=None)
        return quota_body(story, start, start + 0.5, "a", key=body_key).check()

    inside = run(Story(tmp_path / "inside"), "t0", 2.0)
    assert invariants(inside) == ["limit-pause"]
    assert "paused" in inside.violations[0].message
    assert invariants(run(Story(tmp_path / "group"), None, 2.0, "t2")) == ["limit-pause"]
    assert invariants(run(Story(tmp_path / "other-key"), "t1", 2.0)) == []
    assert invariants(run(Story(tmp_path / "after"), "t0", 4.1)) == []
    assert invariants(run(Story(tmp_path / "as-it-is-written"), "t0", 1.015)) == []


def test_a_pause_until_a_time_ends_then(story: Story) -> None:
    operator(story, "pause", 1.0, None, until=1.5)
    quota_body(story, 3.0, 3.5, "a")
    assert invariants(story.check()) == []


def test_a_wipe_of_the_server_explains_a_start_inside_a_pause(story: Story) -> None:
    operator(story, "pause", 1.0, 6.0, until=None)
    story.add(2.0, "fault", role="nemesis", kind="restart", wipe=True, seconds=0.1)
    report = quota_body(story, 3.0, 3.5, "a").check()
    assert invariants(report) == []
    assert [item.kind for item in report.explained] == ["limit"]


def backed_off(story: Story, **extra: Any) -> Story:
    """Run ``a`` of key t0 backs off for 2 s at +1.5 (asked at +1.49, the pause set by +1.5), ending ``Backoff``."""
    quota_body(story, 1.0, 1.5, "a", outcome="Backoff")
    fields = {"group": limit_group_member(QUOTA, "t0"), "quota": QUOTA, "quota_key": "t0", **extra}
    return story.add(1.5, "backoff", task_id="a", retry_after=2.0, asked=T0 + 1.49, **fields)


def test_a_back_off_pauses_its_key_for_every_run(tmp_path: Path) -> None:
    other = backed_off(Story(tmp_path / "other-run"))
    quota_body(other, 3.6, 4, "a").call(0, "a", member="chaos.quota_a:ka")
    assert invariants(quota_body(other, 2.0, 2.5, "b").check()) == ["limit-pause"]
    other_key = backed_off(Story(tmp_path / "other-key"))
    quota_body(other_key, 3.6, 4, "a").call(0, "a", member="chaos.quota_a:ka")
    assert invariants(quota_body(other_key, 2.0, 2.5, "b", key="t1").check()) == []


def test_a_back_off_the_library_could_not_write_pauses_nothing(story: Story) -> None:
    backed_off(story)
    story.add(1.5, "backoff_failed", task_id="a", message="could not pause group")
    quota_body(story, 3.6, 4, "a").call(0, "a", member="chaos.quota_a:ka")
    assert invariants(quota_body(story, 2.0, 2.5, "b").check()) == []


def test_a_run_that_backed_off_must_come_back_and_end(tmp_path: Path) -> None:
    lost = backed_off(Story(tmp_path / "lost")).call(0, "a", member="chaos.quota_a:ka")
    report = lost.check()
    assert invariants(report) == ["unresolved-run"]
    assert "backed off" in report.violations[0].message
    back = backed_off(Story(tmp_path / "back")).call(0, "a", member="chaos.quota_a:ka")
    assert invariants(quota_body(back, 3.6, 4, "a").check()) == []


def test_a_run_that_backed_off_after_a_newer_run_took_its_key_is_settled_by_its_skip(tmp_path: Path) -> None:
    """The back-off's re-publish was answered by the newer run: the skip it logged, during the body, settles it."""
    skip = "backed off after run b took its key: that run does its work"

    def story_with_skip(name: str, at: float) -> Report:
        story = backed_off(Story(tmp_path / name)).call(0, "a", member="chaos.quota_a:ka")
        story.add(at, "decision", pid=100, decision="skipped", task_id="a", key="ka", message=skip)
        return story.check()

    assert invariants(story_with_skip("during", 1.49)) == []
    assert invariants(story_with_skip("before", 0.9)) == ["unresolved-run"]


def recovery_story(story: Story, *, acks_late: bool = True, member: str = MEMBER) -> Story:
    """Worker-0 (pid 99, child 100) runs run ``a``; worker-1 (pid 199) is ready throughout; worker-0 is killed."""
    story.add(0, "spawn", role="runner", slot="worker-0", generation=1, process=99, pool="prefork", acks_late=acks_late)
    story.add(0, "spawn", role="runner", slot="worker-1", generation=1, process=199, pool="threads", acks_late=False)
    story.add(0.5, "worker_ready", pid=99, node="worker-0.1")
    story.add(0.5, "worker_ready", pid=199, role="worker-1.1", node="worker-1.1")
    story.call(1, "a", member=member).add(1.5, "received", pid=99, task_id="a").body(1.6, None, "a", member=member)
    story.add(2, "fault", role="nemesis", kind="restart-worker", slot="worker-0", pids=[99, 100])
    return story.add(3, "kill", role="runner", slot="worker-0", pids=[99, 100], why="restart-worker")


def test_a_run_killed_with_its_worker_must_be_put_back_before_its_lock_expires(story: Story) -> None:
    """Its message came back only with the visibility timeout: what a restart under the same node name did."""
    recovery_story(story).add(8.0, "received", pid=199, role="worker-1.1", task_id="a")
    report = story.body(8.1, 8.5, "a", pid=199, role="worker-1.1").check()
    assert invariants(report) == ["recovery"]
    assert "was not put back within 4s" in report.violations[0].message


def test_a_run_put_back_by_a_reaper_pass_keeps_the_promise(story: Story) -> None:
    recovery_story(story).add(3.8, "recovered", pid=199, role="worker-1.1", task_id="a", message="recovered: ...")
    report = story.add(3.9, "received", pid=199, role="worker-1.1", task_id="a").check()
    assert invariants(report) == []
    assert report.checked["recovery"] == 1


@pytest.mark.parametrize(
    "note",
    [
        pytest.param("passed on", id="format-2"),
        pytest.param("still running; key passed to the next run", id="format-1"),
    ],
)
def test_a_run_whose_record_passed_to_the_next_call_is_not_held_to_recovery(story: Story, note: str) -> None:
    """until_executing and debounce free the key as a body starts: recovery finds runs by record, and cannot see it.

    The note the history has for it: format 2's, or a format 1 history's (a store a previous release wrote).
    """
    recovery_story(story).server(MEMBER, (2.5, "started", "a", note))
    report = story.add(8.0, "received", pid=199, role="worker-1.1", task_id="a").check()
    assert invariants(report) == [] and report.checked["recovery"] == 0


@pytest.mark.parametrize("mode", ["debounce", "until_executing"])
def test_a_run_whose_key_took_a_new_run_while_its_body_ran_is_not_held_to_recovery_once_the_history_is_gone(
    story: Story, mode: str
) -> None:
    """A busy key's history keeps its last entries only: the passing is then known from the call that caused it.

    A call accepted as another run after the body started, in a mode that frees the key as a body starts,
    passed the record on: recovery, which finds runs by their records, cannot see the run any more.
    """
    member = f"chaos.{mode}:k1"
    recovery_story(story, member=member).call(2.5, "b", member=member)
    story.body(5, 6, "b", pid=199, role="worker-1.1", member=member).server(member, (60.0, "succeeded", "z", ""))
    report = story.add(8.0, "received", pid=199, role="worker-1.1", task_id="a").check()
    assert invariants(report) == [] and report.checked["recovery"] == 0


def test_a_call_accepted_before_the_body_or_of_a_key_that_stays_held_excuses_nothing(tmp_path: Path) -> None:
    before = recovery_story(Story(tmp_path / "before"), member="chaos.debounce:k1").call(
        1.2, "b", member="chaos.debounce:k1"
    )
    before.body(5, 6, "b", pid=199, role="worker-1.1", member="chaos.debounce:k1")
    before.server("chaos.debounce:k1", (60.0, "succeeded", "z", ""))
    held = recovery_story(Story(tmp_path / "held")).call(2.5, "b").body(5, 6, "b", pid=199, role="worker-1.1")
    held.server(MEMBER, (60.0, "succeeded", "z", ""))
    for story in (before, held):
        report = story.add(8.0, "received", pid=199, role="worker-1.1", task_id="a").check()
        assert "recovery" in invariants(report)  # (a second run of the held key is a double accept too)


def test_a_run_whose_history_only_mentions_a_passing_is_still_held_to_recovery(story: Story) -> None:
    """Only the note a passed-on record gets excuses the run: not a note that merely contains the words."""
    recovery_story(story).server(MEMBER, (2.5, "started", "a", "passed once"))
    report = story.add(8.0, "received", pid=199, role="worker-1.1", task_id="a").check()
    assert invariants(report) == ["recovery"]


def test_an_early_acknowledged_run_or_a_fault_in_between_is_not_held_to_recovery(tmp_path: Path) -> None:
    early = recovery_story(Story(tmp_path / "early"), acks_late=False).check()
    assert invariants(early) == [] and early.checked["recovery"] == 0
    stopped = recovery_story(Story(tmp_path / "stopped"))
    stopped.add(3.5, "fault", role="nemesis", kind="stop-worker", pids=[199])
    report = stopped.check()
    assert invariants(report) == [] and report.checked["recovery"] == 0


# --- steps (dedup_once) -------------------------------------------------------------------------

KEY = "chaos.until_executed:k1:a:s1"


class Step:
    """The step events of one ``dedup_once("s1", ...)`` in a body of run ``a``, as the chaos body writes them."""

    def __init__(self, story: Story, pid: int, *, on_doubt: str = "retry") -> None:
        self.story, self.pid = story, pid
        self.common: dict[str, Any] = {"task_id": "a", "member": MEMBER, "call": "c", "tid": 0, "step": "s1"}
        self.common["on_doubt"] = on_doubt

    def enter(self, t: float) -> Step:
        self.story.add(t, "step_enter", pid=self.pid, **self.common)
        return self

    def call(self, t: float, key: str = KEY) -> Step:
        self.story.add(t, "step_call", pid=self.pid, key=key, **self.common)
        return self

    def returned(self, t: float, value: str) -> Step:
        self.story.add(t, "step_return", pid=self.pid, value=value, **self.common)
        self.story.add(t + 0.01, "step_exit", pid=self.pid, outcome="done", called=True, value=value, **self.common)
        return self

    def skipped(self, t: float, value: str) -> Step:
        self.story.add(t, "step_exit", pid=self.pid, outcome="done", called=False, value=value, **self.common)
        return self

    def raised(self, t: float, outcome: str, *, called: bool = False, fn_error: str = "") -> Step:
        self.story.add(t, "step_exit", pid=self.pid, outcome=outcome, called=called, fn_error=fn_error, **self.common)
        return self

    def doubt_reported(self, t: float) -> Step:
        message = f"chaos.until_executed[a] step 's1' in doubt (attempt 1): called again with idempotency key {KEY!r}"
        self.story.add(t, "step_doubt_log", pid=self.pid, task_id="a", step="s1", key=KEY, message=message)
        return self


def killed_in_step(story: Story) -> Story:
    """Run ``a``: its first body (pid 100) is SIGKILLed inside step s1; a redelivered body (pid 200) runs from 5 s."""
    story.call(0, "a").body(1, None, "a", pid=100)
    Step(story, 100).enter(1.1).call(1.1)
    story.add(2, "kill", role="runner", pids=[100], why="kill-child")
    return story.body(5, 6, "a", pid=200)


def test_a_step_recorded_done_and_executed_again_breaks_step_once(tmp_path: Path) -> None:
    """Done is done: a later delivery of the run that reaches a done step gets its value, it does not call it."""

    def story(name: str, *, again: bool, wipe: bool = False) -> Story:
        told = Story(tmp_path / name).call(0, "a").body(1, None, "a", pid=100)
        Step(told, 100).enter(1.1).call(1.1).returned(1.5, "v1")
        told.add(2, "kill", role="runner", pids=[100], why="kill-child")
        if wipe:
            told.add(3, "fault", role="nemesis", kind="restart", wipe=True, seconds=0.5)
        told.body(5, 6, "a", pid=200)
        second = Step(told, 200).enter(5.1)
        if again:
            second.doubt_reported(5.1).call(5.1).returned(5.5, "v2")
        else:
            second.skipped(5.1, "v1")
        return told

    report = story("again", again=True).check()
    assert invariants(report) == ["step-once"]
    assert "recorded done at +1.51" in report.violations[0].message
    skipped = story("skipped", again=False).check()
    assert invariants(skipped) == [] and skipped.checked["step-once"] == 2
    assert invariants(story("wiped", again=True, wipe=True).check()) == [], "a wipe forgets the step"


def test_a_skipped_step_returns_the_value_a_completed_call_returned(story: Story) -> None:
    """A step killed inside its call never completed: a delivery that skips it as done breaks step-once."""
    killed_in_step(story)
    Step(story, 200).enter(5.1).skipped(5.1, "made-up")
    report = story.check()
    assert invariants(report) == ["step-once"]
    assert "which no completed call of it returned" in report.violations[0].message


def test_a_step_called_again_after_an_unfinished_call_must_be_reported_in_doubt(tmp_path: Path) -> None:
    unreported = killed_in_step(Story(tmp_path / "unreported"))
    Step(unreported, 200).enter(5.1).call(5.1).returned(5.5, "v2")
    report = unreported.check()
    assert invariants(report) == ["step-doubt"]
    assert "nothing reported it in doubt" in report.violations[0].message

    logged = killed_in_step(Story(tmp_path / "logged"))
    Step(logged, 200).enter(5.1).doubt_reported(5.1).call(5.1).returned(5.5, "v2")
    assert invariants(logged.check()) == []

    history = killed_in_step(Story(tmp_path / "history"))
    history.server(MEMBER, (1.1, "step", "a", "s1 started"), (5.1, "step", "a", "s1 in doubt, again"))
    Step(history, 200).enter(5.1).call(5.1).returned(5.5, "v2")
    assert invariants(history.check()) == []


def test_a_step_whose_call_raised_is_called_again_without_doubt(tmp_path: Path) -> None:
    """A call that raised was recorded failed: calling it again is no doubt. One killed (SystemExit) was not."""

    def story(name: str, fn_error: str) -> Story:
        outcome = "retry" if fn_error == "SoftTimeLimitExceeded" else fn_error  # the body retried, or its process went
        told = Story(tmp_path / name).call(0, "a").body(1, 2, "a", pid=100, outcome=outcome)
        Step(told, 100).enter(1.1).call(1.1).raised(1.9, fn_error, called=True, fn_error=fn_error)
        told.body(5, 6, "a", pid=200)
        Step(told, 200).enter(5.1).call(5.1).returned(5.5, "v2")
        return told

    assert invariants(story("failed", "SoftTimeLimitExceeded").check()) == []
    assert invariants(story("interrupted", "SystemExit").check()) == ["step-doubt"]


def test_a_step_in_doubt_with_on_doubt_raise_raises_and_is_not_called_again(tmp_path: Path) -> None:
    raised = killed_in_step(Story(tmp_path / "raised"))
    Step(raised, 200, on_doubt="raise").enter(5.1).raised(5.1, "DedupStepInDoubt")
    report = raised.check()
    assert invariants(report) == [] and report.checked["step-doubt"] == 1

    called = killed_in_step(Story(tmp_path / "called"))
    Step(called, 200, on_doubt="raise").enter(5.1).doubt_reported(5.1).call(5.1).returned(5.5, "v2")
    report = called.check()
    assert invariants(report) == ["step-doubt"]
    assert "on_doubt='raise'" in report.violations[0].message


def test_a_step_done_is_never_reported_in_doubt(story: Story) -> None:
    story.call(0, "a").body(1, None, "a", pid=100)
    Step(story, 100).enter(1.1).call(1.1).returned(1.5, "v1")
    story.add(2, "kill", role="runner", pids=[100], why="kill-child")
    story.body(5, 6, "a", pid=200, outcome="DedupStepInDoubt")
    Step(story, 200, on_doubt="raise").enter(5.1).raised(5.1, "DedupStepInDoubt")
    report = story.check()
    assert invariants(report) == ["step-doubt"]
    assert "was done" in report.violations[0].message


def test_a_steps_key_never_changes_within_its_run(tmp_path: Path) -> None:
    same = killed_in_step(Story(tmp_path / "same"))
    Step(same, 200).enter(5.1).doubt_reported(5.1).call(5.1).returned(5.5, "v2")
    report = same.check()
    assert invariants(report) == [] and report.checked["step-key"] == 1

    changed = killed_in_step(Story(tmp_path / "changed"))
    Step(changed, 200).enter(5.1).doubt_reported(5.1).call(5.1, key=KEY + "-2").returned(5.5, "v2")
    report = changed.check()
    assert invariants(report) == ["step-key"]
    assert KEY + "-2" in report.violations[0].message


def test_a_later_run_using_steps_does_not_explain_a_done_step_called_again(tmp_path: Path) -> None:
    """Each run keeps its steps apart: a lost run delivered again after a later run of its key used steps finds
    its done steps, gated key or not; calling one again is a violation either way."""

    def story(name: str, member: str) -> Report:
        told = Story(tmp_path / name).call(0, "a", member=member).body(1, None, "a", pid=100, member=member)
        first = Step(told, 100)
        first.common["member"] = member
        first.enter(1.1).call(1.1).returned(1.5, "v1")
        told.add(2, "kill", role="runner", pids=[100], why="kill-child")
        told.call(2.5, "b", member=member).body(3, 4, "b", pid=300, member=member)
        later = Step(told, 300)
        later.common.update(member=member, task_id="b")
        later.enter(3.1).call(3.1, key="b-key").returned(3.5, "w1")
        told.body(5, 6, "a", pid=200, member=member)
        again = Step(told, 200)
        again.common["member"] = member
        again.enter(5.1).call(5.1).returned(5.5, "v2")
        return told.check()

    # Each run keeps its steps apart: a later run of the key explains nothing, gated or not.
    assert invariants(story("ungated", "chaos.while_executing:k1")) == ["step-once"]
    assert invariants(story("gated", MEMBER)) == ["step-once"]


def test_a_transition_the_schema_does_not_allow_is_a_violation(tmp_path: Path) -> None:
    story = Story(tmp_path / "run").call(0, "a")
    (story.run_dir / SERVER_LOG).write_text(
        f"1:M 27 Nov 2026 06:00:00.000 # {schema.REPORT_MARK} gate none queued m:a\n"
        f"1:M 27 Nov 2026 06:00:01.000 # {schema.REPORT_MARK} finish succeeded started m:a\n"
    )
    report = story.check()
    assert [(v.invariant, v.member) for v in report.violations if v.invariant == "transition"] == [
        ("transition", "m:a")
    ]
    assert "finish moved a record succeeded -> started" in report.render()
    assert report.checked["transition"] == 2


def test_allowed_transitions_are_no_violation(tmp_path: Path) -> None:
    story = Story(tmp_path / "run").call(0, "a")
    (story.run_dir / SERVER_LOG).write_text(
        f"1:M 27 Nov 2026 06:00:00.000 # {schema.REPORT_MARK} gate none queued m:a\n"
    )
    assert [v for v in story.check().violations if v.invariant == "transition"] == []


def test_the_snapshot_hands_the_checker_format_1_strings_from_either_format() -> None:
    """A format 2 record's history (in its h<n> fields) reads as the list format 1 kept, merged with one."""
    listed = [f"{T1 + 5} started k~1 old worker", f"{T1} queued k~1"]
    assert history_strings({"state": "started", "task_id": "k~1"}, listed) == listed
    record = {"task_id": "k~2", "queued_at": str(T1 + 100), "hn": "3", "h1": "-97 started k~1", "h2": "0 queued"}
    assert history_strings(record, []) == [f"{T1 + 100} queued k~2", f"{T1 + 3} started k~1"]
    record["h3"] = "7 succeeded - by alice"
    assert history_strings(record, listed) == [
        f"{T1 + 107} succeeded k~2 by alice",
        f"{T1 + 100} queued k~2",
        f"{T1 + 5} started k~1 old worker",
        f"{T1 + 3} started k~1",
        f"{T1} queued k~1",
    ]


T1 = 1_700_000_000_000


def server_line(t: float, script: str, old: str, new: str, member: str) -> str:
    stamp = datetime.datetime.fromtimestamp(T0 + t, datetime.timezone.utc).strftime("%d %b %Y %H:%M:%S.%f")[:-3]
    return f"1:M {stamp} # {schema.REPORT_MARK} {script} {old} {new} {member}\n"


@pytest.mark.parametrize("wiped", [True, False])
def test_a_record_a_copy_made_again_after_a_wipe_under_a_running_body_explains_its_ending(
    tmp_path: Path, wiped: bool
) -> None:
    """A wipe took run a's record while its body ran; a copy of the run made it again (queued) before the body
    ended, and the body's ending moved it queued -> succeeded: the wipe explains it. Without the wipe it is a
    violation."""
    story = Story(tmp_path / "run").call(0, "a").body(1, 5, "a")
    if wiped:
        story.add(2, "fault", role="nemesis", kind="restart", wipe=True, seconds=1.0)
    (story.run_dir / SERVER_LOG).write_text(
        server_line(0.01, "gate", "none", "queued", MEMBER)
        + server_line(1.0, "start", "queued", "started", MEMBER)
        + server_line(4.9, "gate", "none", "queued", MEMBER)
        + server_line(5.01, "finish", "queued", "succeeded", MEMBER)
    )
    report = story.check()
    found = [v.invariant for v in report.violations if v.invariant == "transition"]
    assert found == ([] if wiped else ["transition"])
    assert [e.kind for e in report.explained if e.kind == "transition"] == (["transition"] if wiped else [])


@pytest.mark.parametrize("logged", [True, False])
def test_a_key_freed_at_start_is_free_from_the_servers_start_not_from_the_bodys_later_event(
    tmp_path: Path, logged: bool
) -> None:
    """until_executing frees its key as the server lets the run start; on a loaded machine the body's own event
    comes well after (137 ms in a 30-minute run). A busy key's kept history no longer has the start: the server's
    log does. Without either, a call accepted 100 ms before the body's event is a double accept."""
    member = "chaos.until_executing:k1"
    story = Story(tmp_path / "run").call(0, "a", member=member).call(1.1, "b", member=member)
    story.body(1.25, 2, "a", member=member).body(3, 4, "b", member=member, pid=101)
    if logged:
        (story.run_dir / SERVER_LOG).write_text(server_line(1.0, "start", "queued", "started", member))
    report = story.check()
    assert invariants(report) == ([] if logged else ["double-accept"])
