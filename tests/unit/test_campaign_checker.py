"""The campaign's checker catches each kind of violation (synthetic histories, no servers).

A checker that cannot fail proves nothing: each rule gets a history that breaks it, next to
one that keeps it.
"""

from __future__ import annotations

from typing import Any

from devtools.campaign.checker import JITTER, check, overlap_bound

LEASE = 3.0


def _run(run: str, pid: int, key: str, start: float, end: float, outcome: str | None, **extra: Any) -> list[dict]:
    """One run of one hold: attempt, acquired at ``start``, done (or lost) at ``end``, outcome."""
    token = extra.get("token")
    events = [
        {"t": start - 0.01, "event": "attempt", "run": run, "worker": pid, "pid": pid, "kind": "guard-session"},
        {"t": start, "event": "acquired", "run": run, "key": key, "token": token, "backend": extra.get("backend", pid)},
    ]
    if extra.get("lost"):
        events.append({"t": end, "event": "lost", "run": run, "pid": pid})
    events.append({"t": end, "event": "done", "run": run, "pid": pid})
    if outcome is not None:
        events.append({"t": end + 0.01, "event": "outcome", "run": run, "outcome": outcome, "pid": pid})
    return events


def _fault(kind: str, start: float, end: float, pids: list[int]) -> dict[str, Any]:
    return {"t": start, "event": "fault", "kind": kind, "start": start, "end": end, "target": "x", "pids": pids}


def test_a_clean_history_passes() -> None:
    events = [*_run("a", 1, "k", 10, 11, "completed"), *_run("b", 2, "k", 11.05, 12, "completed")]
    report = check(events, [], lease=LEASE)
    assert report.passed, report.violations
    assert report.figures["runs"] == 2 and report.figures["lost_holds_reported_as_success"] == 0


def test_an_overlap_with_a_completed_older_holder_is_a_lost_hold_reported_as_success() -> None:
    events = [*_run("a", 1, "k", 10, 12, "completed"), *_run("b", 2, "k", 11, 13, "completed")]
    report = check(events, [], lease=LEASE)
    assert any("completed older holder" in v for v in report.violations)
    assert report.figures["lost_holds_reported_as_success"] == 1


def test_an_overlap_no_fault_explains_is_a_violation_even_when_the_older_run_failed() -> None:
    events = [*_run("a", 1, "k", 10, 10.5, "lost", lost=True), *_run("b", 2, "k", 10.2, 11, "completed")]
    report = check(events, [], lease=LEASE)
    assert any("unexplained overlap" in v for v in report.violations)


def test_an_overlap_within_its_faults_bound_passes_and_one_beyond_fails() -> None:
    freeze = _fault("sigstop-long", 10.0, 16.0, [1])  # a 6 s freeze: the frozen holder believes meanwhile
    inside = [*_run("a", 1, "k", 9, 16.5, "lost", lost=True), *_run("b", 2, "k", 13, 17, "completed"), freeze]
    assert check(inside, [], lease=LEASE).passed
    assert overlap_bound("sigstop-long", 6.0, LEASE) == 6.0 + JITTER
    beyond = [*_run("a", 1, "k", 9, 22, "lost", lost=True), *_run("b", 2, "k", 13, 23, "completed"), freeze]
    assert any("longer than its bound" in v for v in check(beyond, [], lease=LEASE).violations)


def test_a_terminated_backend_explains_only_its_own_holder() -> None:
    kill = _fault("terminate", 10.0, 10.0, [500])
    own = [*_run("a", 1, "k", 9, 10.3, "lost", lost=True, backend=500), *_run("b", 2, "k", 10.1, 11, "completed")]
    assert check([*own, kill], [], lease=LEASE).passed
    other = [*_run("a", 1, "k", 9, 10.3, "lost", lost=True, backend=501), *_run("b", 2, "k", 10.1, 11, "completed")]
    assert any("unexplained" in v for v in check([*other, kill], [], lease=LEASE).violations)


def test_a_killed_holder_ends_at_its_kill() -> None:
    events = [
        *_run("a", 1, "k", 9, 20, None),
        _fault("sigkill", 10.0, 10.0, [1]),
        *_run("b", 2, "k", 10.2, 11, "completed"),
    ]
    events = [e for e in events if not (e["event"] == "done" and e["run"] == "a")]  # it died before its work ended
    assert check(events, [], lease=LEASE).passed


def test_the_register_accepting_a_stale_token_is_a_violation() -> None:
    writes = [(1, "k", "b", 8, True, 11.0), (2, "k", "a", 7, True, 12.0), (3, "k", "a", 7, False, 12.1)]
    report = check([], writes, lease=LEASE)
    assert report.figures["stale_writes_accepted"] == 1
    assert any("stale write accepted" in v for v in report.violations)
    assert check([], [writes[0], writes[2]], lease=LEASE).passed  # a refused stale write is the register working


def test_a_completed_run_with_a_refused_write_is_a_lost_hold_reported_as_success() -> None:
    events = _run("a", 1, "k", 10, 11, "completed", token=7)
    events.append({"t": 10.5, "event": "write", "run": "a", "key": "k", "token": 7, "accepted": False, "pid": 1})
    report = check(events, [], lease=LEASE)
    assert any("refused write in a completed run" in v for v in report.violations)


def test_a_fencing_token_that_goes_backwards_is_a_violation() -> None:
    backwards = [*_run("a", 1, "k", 10, 11, "completed", token=9), *_run("b", 2, "k", 11.5, 12, "completed", token=8)]
    assert any("token went backwards" in v for v in check(backwards, [], lease=LEASE).violations)
    forwards = [*_run("a", 1, "k", 10, 11, "completed", token=8), *_run("b", 2, "k", 11.5, 12, "completed", token=9)]
    assert check(forwards, [], lease=LEASE).passed


def test_leftovers_are_violations() -> None:
    report = check([], [], lease=LEASE, leftovers=["advisory lock (1, 2, 3, 1)"])
    assert report.violations == ["left behind: advisory lock (1, 2, 3, 1)"]


def test_figures_count_detection_and_freeing_by_fault_kind() -> None:
    events = [
        *_run("a", 1, "k", 9, 10.4, "lost", lost=True, backend=500),
        _fault("terminate", 10.0, 10.0, [500]),
        *_run("b", 2, "k", 10.5, 11, "completed"),
    ]
    figures = check(events, [], lease=LEASE).figures
    assert (
        figures["detect_seconds"]["terminate"]["n"] == 1
        and abs(figures["detect_seconds"]["terminate"]["max"] - 0.4) < 1e-6
    )
    assert abs(figures["freed_seconds"]["terminate"]["p50"] - 0.5) < 1e-6
    assert figures["faults"]["terminate"] == 1


def _scope_run(run: str, pid: int, start: float, end: float, period: str, recorded: bool) -> list[dict]:
    events = _run(run, pid, "k", start, end, "completed")
    events[1]["period"] = period
    if recorded:
        events.append({"t": end + 0.005, "event": "recorded", "run": run, "key": "k", "period": period, "pid": pid})
    return events


def test_a_period_recorded_once_passes_and_one_run_again_or_recorded_twice_fails() -> None:
    # a, unrecorded (a task failed), then b records: the period's first record; c runs the next period
    kept = [
        *_scope_run("a", 1, 10, 11, "p1", recorded=False),
        *_scope_run("b", 2, 11.05, 12, "p1", recorded=True),
        *_scope_run("c", 1, 12.1, 13, "p2", recorded=True),
    ]
    report = check(kept, [], lease=LEASE)
    assert report.passed, report.violations
    assert report.figures["periods_recorded"] == 2
    again = [*_scope_run("b", 2, 11.05, 12, "p1", recorded=True), *_scope_run("d", 1, 12.1, 13, "p1", recorded=False)]
    assert any("ran again" in v for v in check(again, [], lease=LEASE).violations)
    twice = [*_scope_run("b", 2, 11.05, 12, "p1", recorded=True), *_scope_run("d", 1, 12.1, 13, "p1", recorded=True)]
    assert any("recorded 2 times" in v for v in check(twice, [], lease=LEASE).violations)


def test_a_savepoint_rollback_of_the_workers_own_explains_an_overlap_of_its_run_only_if_the_run_ends_lost() -> None:
    """The worker writes it itself (its target is the run): the keys it ended are found only at
    their release, so the overlap may last until then, but never with a run reported completed."""
    rollback = {"t": 10.5, "event": "fault", "kind": "savepoint-rollback", "start": 10.5, "end": 10.5}
    rollback |= {"target": "a", "pids": [1], "pid": 1, "worker": 1}
    lost = [*_run("a", 1, "k", 10, 19, "lost", lost=True), *_run("b", 2, "k", 11, 12, "completed"), rollback]
    report = check(lost, [], lease=LEASE)
    assert report.passed, report.violations
    assert report.figures["faults"]["savepoint-rollback"] == 1
    completed = [*_run("a", 1, "k", 10, 19, "completed"), *_run("b", 2, "k", 11, 12, "completed"), rollback]
    assert any("completed older holder" in v for v in check(completed, [], lease=LEASE).violations)
    # Another run of the same worker process is not explained by it.
    other = {**rollback, "target": "c"}
    unexplained = [*_run("a", 1, "k", 10, 19, "lost", lost=True), *_run("b", 2, "k", 11, 12, "completed"), other]
    assert any("unexplained overlap" in v for v in check(unexplained, [], lease=LEASE).violations)


def test_an_error_caught_in_a_transaction_mode_guard_explains_an_overlap_until_the_next_heartbeat_only() -> None:
    """The worker writes it itself: the lock's transaction, aborted by the error, ended its lock
    at once; the next heartbeat (L/3) looks from a side connection and interrupts the work. An
    overlap that lasts longer (a work that went on to its end) is a violation, lost or not."""
    caught = {"t": 10.5, "event": "fault", "kind": "caught-error", "start": 10.5, "end": 10.5}
    caught |= {"target": "a", "pids": [1], "pid": 1, "worker": 1}
    interrupted = [*_run("a", 1, "k", 10, 11.6, "lost", lost=True), *_run("b", 2, "k", 10.6, 12, "completed"), caught]
    assert check(interrupted, [], lease=LEASE).passed
    went_on = [*_run("a", 1, "k", 10, 19, "failed"), *_run("b", 2, "k", 10.6, 18, "completed"), caught]
    assert any("overlap longer than its bound" in v for v in check(went_on, [], lease=LEASE).violations)


def _pool_run(run: str, pid: int, slot_key: str, size: int, start: float, end: float, outcome: str) -> list[dict]:
    events = _run(run, pid, slot_key, start, end, outcome)
    events[1].update(pool="p", size=size)
    return events


def test_one_pools_name_held_in_two_sizes_at_once_is_a_violation_on_different_slots_too() -> None:
    """Rule 8: a pool of 2 on its second slot and a pool of 3 on its third hold different keys,
    so only the size rule sees them overlap; one size at a time, or in turn, passes."""
    same_size = [*_pool_run("a", 1, "p", 2, 10, 12, "completed"), *_pool_run("b", 2, "p#slot2", 2, 11, 13, "completed")]
    assert check(same_size, [], lease=LEASE).passed
    in_turn = [
        *_pool_run("a", 1, "p#slot2", 2, 10, 11, "completed"),
        *_pool_run("b", 2, "p#slot3", 3, 11.1, 13, "completed"),
    ]
    assert check(in_turn, [], lease=LEASE).passed
    two_sizes = [
        *_pool_run("a", 1, "p#slot2", 2, 10, 12, "completed"),
        *_pool_run("b", 2, "p#slot3", 3, 11, 13, "completed"),
    ]
    report = check(two_sizes, [], lease=LEASE)
    assert any(v.startswith("one pool in two sizes: overlap with a completed older holder") for v in report.violations)
    assert report.figures["lost_holds_reported_as_success"] == 1
    plain = [*_pool_run("a", 1, "p#slot2", 2, 10, 12, "failed"), *_pool_run("b", 2, "p", 1, 11, 13, "completed")]
    assert any("one pool in two sizes: unexplained overlap" in v for v in check(plain, [], lease=LEASE).violations)


def test_a_lock_kept_past_the_release_bound_by_a_frozen_worker_is_a_violation() -> None:
    looked = {**_fault("sigstop-waiter", 10.0, 17.0, [1]), "detail": "6.50 s, a waiter", "kept": [], "waiter": True}
    report = check([looked], [], lease=LEASE)
    assert report.passed, report.violations
    assert report.figures["release_checks"] == {"looked": 1, "kept": 0, "frozen_waiters": 1}

    kept = {**looked, "kept": ["'campaign w2' (backend 700, idle in transaction) holds (1, 2, 1)"]}
    cut = {**_fault("netcut", 20.0, 27.0, [3, 4]), "kept": ["the look failed: connection refused"]}
    unlooked = _fault("sigstop-long", 30.0, 35.0, [1])  # too short to look: no kept
    report = check([kept, cut, unlooked], [], lease=LEASE)
    assert len(report.violations) == 2, report.violations
    assert report.violations[0].startswith("kept past the lease: 5.5 s after sigstop-waiter on x at 10.000")
    assert "backend 700, idle in transaction" in report.violations[0]
    assert "the look failed" in report.violations[1]
    assert report.figures["release_checks"] == {"looked": 2, "kept": 2, "frozen_waiters": 1}


def test_a_frozen_waiters_overlap_is_bounded_by_its_freeze() -> None:
    assert overlap_bound("sigstop-waiter", 6.5, LEASE) == 6.5 + JITTER
