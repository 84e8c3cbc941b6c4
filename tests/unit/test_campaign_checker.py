"""The campaign's checker catches each kind of violation (synthetic histories, no servers).

A checker that cannot fail proves nothing: each rule gets a history that breaks it, next to
one that keeps it.
"""

from __future__ import annotations

from typing import Any

from devtools.campaign.checker import JITTER, check, overlap_bound, pg_locks_of
from devtools.campaign.nemesis import release_bound
from devtools.campaign.workers import SCOPE_LEASE_FACTOR

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


def _write(run: str, pid: int, key: str, t: float) -> dict[str, Any]:
    return {"t": t, "event": "write", "run": run, "key": key, "token": None, "accepted": True, "pid": pid}


def test_a_write_outside_every_hold_of_its_run_is_a_violation() -> None:
    """Rule 10: a lock session's early release that also freed its other key was never judged, because
    a done event before it had ended every hold of the run: its later writes lay outside any hold."""
    inside = [*_run("a", 1, "k", 10, 11, "completed"), _write("a", 1, "k", 10.5), _write("a", 1, "k", 11.0)]
    report = check(inside, [], lease=LEASE)
    assert report.passed, report.violations
    assert report.figures["writes_outside_holds"] == 0
    after_done = [*_run("a", 1, "k", 10, 11, "completed"), _write("a", 1, "k", 11.3)]
    assert any(v.startswith("write outside a hold: a") for v in check(after_done, [], lease=LEASE).violations)
    other_key = [*_run("a", 1, "k", 10, 11, "completed"), _write("a", 1, "j", 10.5)]
    assert any("wrote 'j'" in v for v in check(other_key, [], lease=LEASE).violations)
    released = [*_run("a", 1, "k", 10, 12, "completed"), {"t": 10.5, "event": "released", "run": "a", "key": "k"}]
    assert not check([*released, _write("a", 1, "k", 10.4)], [], lease=LEASE).violations
    assert check([*released, _write("a", 1, "k", 10.6)], [], lease=LEASE).violations


def test_a_killed_runs_writes_count_until_the_kill_landed() -> None:
    """The nemesis's fault starts before it picks and signals its target: a write in between is the
    dead run's last, inside its hold; a write after the fault's end cannot be."""
    killed = [e for e in _run("a", 1, "k", 9, 20, None) if e["event"] != "done"]
    kill = _fault("sigkill", 10.0, 10.02, [1])
    assert check([*killed, kill, _write("a", 1, "k", 10.01)], [], lease=LEASE).passed
    assert check([*killed, kill, _write("a", 1, "k", 10.5)], [], lease=LEASE).violations


def _skip(run: str, pid: int, tried: list[str], start: float, end: float, **refusal: Any) -> list[dict[str, Any]]:
    fields = {"tried": tried, "holders": [], "scope_row": False, "shared": False, **refusal}
    return [
        {"t": start, "event": "attempt", "run": run, "worker": pid, "pid": pid, "kind": "guard-session"},
        {"t": end, "event": "outcome", "run": run, "outcome": "skipped", "detail": "", "pid": pid, **fields},
    ]


def test_a_skip_that_names_no_holder_must_be_explained_by_another_runs_hold() -> None:
    """Rule 11: a database error reported as a busy skip names nobody, and nobody held the key."""
    nobody = _skip("s", 3, ["k"], 20.0, 20.01)
    report = check(nobody, [], lease=LEASE)
    assert any(v.startswith("error reported as a skip: s") for v in report.violations), report.violations
    assert report.figures["skips"]["unexplained"] == 1
    named = _skip("s", 3, ["k"], 20.0, 20.01, holders=[{"key": "k", "pid": 700, "application_name": "campaign w1"}])
    assert check(named, [], lease=LEASE).passed
    assert check(_skip("s", 3, ["k"], 20.0, 20.01, scope_row=True), [], lease=LEASE).passed
    held = [*_run("a", 1, "k", 18.0, 19.5, "completed"), *nobody]  # released 0.5 s before: within JITTER
    assert check(held, [], lease=LEASE).passed
    long_ago = [*_run("a", 1, "k", 10.0, 12.0, "completed"), *nobody]
    assert check(long_ago, [], lease=LEASE).violations
    # a hold that went on long after: its session would have been named (a hot key is nearly always held)
    went_on = [*_run("a", 1, "k", 18.0, 30.0, "completed"), *nobody]
    assert check(went_on, [], lease=LEASE).violations
    # a hold from before a restart held nothing after it, however long its run believed it
    restart = _fault("restart-fast", 19.5, 21.0, [])
    lost_late = [*_run("a", 1, "k", 18.0, 20.5, "lost", lost=True), restart, *nobody]
    assert check(lost_late, [], lease=LEASE).violations
    # a pool's name is busy when its slots are: a hold of a slot explains it; a lock session tries each key
    slot = [*_run("a", 1, "p#slot2", 19.0, 20.5, "completed"), *_skip("s", 3, ["p"], 20.0, 20.01)]
    assert check(slot, [], lease=LEASE).passed
    batch = [*_run("a", 1, "k", 19.0, 20.5, "completed"), *_skip("s", 3, ["k", "j"], 20.0, 20.01)]
    assert any("skipped ['j']" in v for v in check(batch, [], lease=LEASE).violations)


def test_a_skip_for_a_done_period_is_explained_by_its_record_only() -> None:
    recorded = _scope_run("a", 1, 10, 11, "p1", recorded=True)
    done = _skip("s", 3, ["k"], 15.0, 15.01, done_period="p1")
    assert check([*recorded, *done], [], lease=LEASE).passed
    assert check(done, [], lease=LEASE).violations


def test_a_terminated_hold_reported_completed_is_a_lost_hold_reported_as_success() -> None:
    """Rule 12: the nemesis terminated the session of a hold while its run believed it held the key;
    no other run took the key meanwhile (rule 3 sees nothing), and the run completed."""
    terminate = {**_fault("terminate", 10.0, 10.01, [500]), "terminated": True}
    completed = [*_run("a", 1, "k", 9, 11, "completed", backend=500), terminate]
    report = check(completed, [], lease=LEASE)
    assert any(v.startswith("lost hold reported as success: a") for v in report.violations), report.violations
    assert report.figures["lost_holds_reported_as_success"] == 1
    assert check([*_run("a", 1, "k", 9, 11, "lost", lost=True, backend=500), terminate], [], lease=LEASE).passed
    gone = {**terminate, "terminated": False}  # the backend had ended already: nothing was terminated
    assert check([*_run("a", 1, "k", 9, 11, "completed", backend=500), gone], [], lease=LEASE).passed
    after = [*_run("a", 1, "k", 9, 10.0, "completed", backend=500), terminate]  # its work was over
    assert check(after, [], lease=LEASE).passed
    scope = _run("a", 1, "k", 9, 11, "completed", backend=500)
    scope[0]["kind"] = "scope"  # a scope's hold moves between sessions: its row holds it
    assert check([*scope, terminate], [], lease=LEASE).passed


def test_a_run_whose_own_fault_ended_its_lock_must_not_complete() -> None:
    caught = {**_fault("caught-error", 10.5, 10.5, [1]), "target": "a"}
    assert check([*_run("a", 1, "k", 10, 11.6, "lost", lost=True), caught], [], lease=LEASE).passed
    report = check([*_run("a", 1, "k", 10, 11.6, "completed"), caught], [], lease=LEASE)
    assert any("completed after its own caught-error" in v for v in report.violations), report.violations


def test_shared_holds_may_overlap_but_not_a_shared_and_an_exclusive_one() -> None:
    def shared(events: list[dict[str, Any]], is_shared: bool = True) -> list[dict[str, Any]]:
        events[1]["shared"] = is_shared
        return events

    readers = [*shared(_run("a", 1, "k", 10, 12, "completed")), *shared(_run("b", 2, "k", 11, 13, "completed"))]
    report = check(readers, [], lease=LEASE)
    assert report.passed, report.violations
    assert report.figures["shared_holds"] == 2
    mixed = [*shared(_run("a", 1, "k", 10, 12, "completed")), *shared(_run("b", 2, "k", 11, 13, "completed"), False)]
    assert any("completed older holder" in v for v in check(mixed, [], lease=LEASE).violations)


def _idle(t: float, idle: float, name: str = "campaign w1") -> dict[str, Any]:
    return {"t": t, "event": "idle-session", "backend": 900, "application_name": name, "idle": idle}


def test_a_session_left_idle_holding_nothing_while_its_worker_runs_is_a_violation() -> None:
    """Rule 13: a guard that completed but kept its connection: the process's exit at the end closes it."""
    spawn = {"t": 1.0, "event": "spawn", "worker": 1, "pid": 11, "kind": "guard-session"}
    report = check([spawn, _idle(20.0, 2.6)], [], lease=LEASE)
    assert any(v.startswith("connection kept open for nothing: 'campaign w1'") for v in report.violations)
    assert check([spawn, _idle(20.0, 2.2)], [], lease=LEASE).passed  # within the bound (0.8 of the lease)
    frozen = _fault("sigstop-short", 18.5, 19.7, [11])
    assert check([spawn, frozen, _idle(20.0, 2.6)], [], lease=LEASE).passed
    other = _fault("sigstop-short", 18.5, 19.7, [12])  # another worker's freeze explains nothing
    assert check([spawn, other, _idle(20.0, 2.6)], [], lease=LEASE).violations
    hub = check([spawn, _idle(20.0, 2.6, "campaign w1 holds")], [], lease=LEASE)
    assert hub.violations and "'campaign w1 holds'" in hub.violations[0]


def test_a_scopes_row_explains_a_skip_until_its_lease_after_the_scope_ended() -> None:
    """A scope whose teardown failed leaves its row until its lease (2 leases) ends: a guard that takes
    the key to read the row gives it back, and another's try finds it busy with nobody to name."""
    scope = _run("a", 1, "k", 10, 11, "completed")
    scope[0]["kind"] = "scope"
    read = _skip("r", 4, ["k"], 16.2, 16.21, scope_row=True)  # another's refusal read the row then
    assert check([*scope, *read, *_skip("s", 3, ["k"], 16.0, 16.01)], [], lease=LEASE).passed
    assert check([*scope, *_skip("s", 3, ["k"], 16.0, 16.01)], [], lease=LEASE).violations  # nobody read it
    late = _skip("r", 4, ["k"], 19.2, 19.21, scope_row=True)
    assert check([*scope, *late, *_skip("s", 3, ["k"], 19.0, 19.01)], [], lease=LEASE).violations  # lapsed


def test_a_holder_that_releases_late_after_its_work_explains_a_skip_at_its_release() -> None:
    """Rule 11: a holder frozen (or starved) between its work's end and its release holds the key until
    its outcome; a try just before that release and a look just after it name nobody."""
    held = _run("a", 1, "k", 10, 11, None)
    late = [*held, {"t": 14.0, "event": "outcome", "run": "a", "outcome": "completed", "pid": 1}]
    assert check([*late, *_skip("s", 3, ["k"], 13.98, 14.01)], [], lease=LEASE).passed
    prompt = _run("a", 1, "k", 10, 11, "completed")  # released at 11.01: long before the skip
    assert check([*prompt, *_skip("s", 3, ["k"], 13.98, 14.01)], [], lease=LEASE).violations


def _rules_run(
    run: str,
    pid: int,
    start: float,
    end: float,
    *,
    period: str | None = None,
    min_interval: float | None = None,
    recorded: float | None = None,
    outcome: str = "completed",
) -> list[dict[str, Any]]:
    """A plain guard's run with run rules on ``r``: its acquired event (written after the guard's check,
    at ``start``) says them; ``recorded``: the completion's time on the database clock (exact)."""
    events = _run(run, pid, "r", start, end, outcome)
    events[1].update(period=period, min_interval=min_interval)
    if recorded is not None:
        events.append(
            {
                "t": end + 0.005,
                "event": "recorded",
                "run": run,
                "key": "r",
                "period": period,
                "min_interval": min_interval,
                "at_lo": recorded,
                "at_hi": recorded,
                "exact": True,
                "pid": pid,
            }
        )
    return events


def test_a_guards_once_per_period_recorded_twice_or_run_again_is_a_violation() -> None:
    """Rule 7 judges a plain guard's once_per as a scope's: by its record's time on the database clock."""
    kept = [
        *_rules_run("a", 1, 10.0, 11.0, period="g1", recorded=11.001),
        *_skip("b", 2, ["r"], 11.2, 11.21, done_period="g1", done_record={"period": "g1", "at": 11.001, "token": 1}),
        *_rules_run("c", 1, 12.1, 13.0, period="g2", recorded=13.001),
    ]
    report = check(kept, [], lease=LEASE)
    assert report.passed, report.violations
    assert report.figures["periods_recorded"] == 2 and report.figures["run_rules"]["refused"] == 1
    # a check that let a second run work in a recorded period (the once_per check disabled)
    again = [
        *_rules_run("a", 1, 10.0, 11.0, period="g1", recorded=11.001),
        *_rules_run("d", 2, 11.1, 12.0, period="g1", recorded=12.001),
    ]
    violations = check(again, [], lease=LEASE).violations
    assert any("ran again" in v for v in violations) and any("recorded 2 times" in v for v in violations), violations
    # a run that worked in the period and failed before its record is still a run again
    failed = [*_rules_run("a", 1, 10.0, 11.0, period="g1", recorded=11.001)]
    failed += _rules_run("d", 2, 11.1, 12.0, period="g1", outcome="failed")
    assert any("ran again" in v for v in check(failed, [], lease=LEASE).violations)


def test_a_run_within_min_interval_of_a_record_on_the_database_clock_is_a_violation() -> None:
    """Rule 15: a min_interval run works only min_interval after the key's last record (any period);
    judged from the record's completed_at, not from the recording run's end."""
    legal = [
        *_rules_run("a", 1, 10.0, 11.0, min_interval=2.0, recorded=11.001),
        *_skip("b", 2, ["r"], 11.5, 11.51, done_record={"period": "", "at": 11.001, "token": 1}),
        *_rules_run("c", 1, 13.002, 14.0, min_interval=2.0, recorded=14.001),
        *_rules_run("d", 2, 16.5, 17.0, period="g9", min_interval=2.0, recorded=17.001),
    ]
    report = check(legal, [], lease=LEASE)
    assert report.passed, report.violations
    assert report.figures["run_rules"]["min_interval_holds"] == 3 and report.figures["run_rules"]["recorded"] == 3
    # an off-by-one check (age < min_interval - 1): c works 1.5 s after a's record
    early = [
        *_rules_run("a", 1, 10.0, 11.0, min_interval=2.0, recorded=11.001),
        *_rules_run("c", 1, 12.5, 14.0, min_interval=2.0, recorded=14.001),
    ]
    violations = check(early, [], lease=LEASE).violations
    assert any(v.startswith("run within min_interval: c") for v in violations), violations
    # a once_per record counts for min_interval too (the check reads the key's latest record of any period)
    after_period = [
        *_rules_run("a", 1, 10.0, 11.0, period="g1", recorded=11.001),
        *_rules_run("c", 1, 11.5, 12.0, min_interval=2.0, recorded=12.001),
    ]
    violations = check(after_period, [], lease=LEASE).violations
    assert any(v.startswith("run within min_interval: c") for v in violations), violations
    assert any(v.startswith("recorded within min_interval: c") for v in violations), violations


def test_a_run_refused_by_a_run_rule_must_not_work_and_its_refusal_names_the_record() -> None:
    """A refusal that names a recorded completion is no error (rule 11 counts it named); a refused run
    that held or wrote the key anyway is a violation (rule 15), and records nothing that rule 7 counts."""
    refusal = {"period": "", "at": 11.001, "token": 1}
    refused = _skip("b", 2, ["r"], 11.5, 11.6, done_record=refusal)
    assert check(refused, [], lease=LEASE).passed
    worked = [
        refused[0],
        {"t": 11.52, "event": "acquired", "run": "b", "key": "r", "token": None, "backend": 2, "pid": 2},
        {"t": 11.53, "event": "write", "run": "b", "key": "r", "token": None, "accepted": True, "at": 11.53},
        {"t": 11.54, "event": "done", "run": "b", "pid": 2},
        refused[1],
    ]
    violations = check(worked, [], lease=LEASE).violations
    assert any(v.startswith("refused by a run rule, worked anyway: b") for v in violations), violations


def test_a_record_a_cancelled_commit_may_have_lost_in_a_failover_excuses_the_next_run() -> None:
    """A commit whose wait for the synchronous standby was cancelled commits on the primary alone: a
    failover after it may lose the record (docs/safety.md), and the next run may do the work again."""
    events = [
        *_rules_run("a", 1, 10.0, 11.0, min_interval=2.0, recorded=11.001),
        {**_fault("cancel", 11.0, 11.0, [1])},
        _fault("failover", 11.2, 11.5, []),
        *_rules_run("c", 2, 12.0, 13.0, min_interval=2.0, recorded=13.001),
    ]
    assert check(events, [], lease=LEASE).passed
    without_failover = [e for e in events if e.get("kind") != "failover"]
    assert not check(without_failover, [], lease=LEASE).passed


def test_a_run_refused_by_a_run_rule_held_the_key_for_its_check_and_explains_a_skip_meanwhile() -> None:
    """Rule 11: a refused run took the key to check its rule and gave it back without working (no hold in
    the history); another run's try meanwhile found the key busy and its look found nobody."""
    refused = _skip("a", 1, ["r"], 20.0, 20.04, done_record={"period": "g1", "at": 15.0, "token": 1})
    nobody = _skip("s", 3, ["r"], 20.01, 20.05)
    assert check([*refused, *nobody], [], lease=LEASE).passed
    later = _skip("s", 3, ["r"], 25.0, 25.05)  # long after the refused run's check: still an error
    assert any(
        v.startswith("error reported as a skip: s") for v in check([*refused, *later], [], lease=LEASE).violations
    )


def _cleared_run(outcome: str, job_stops: float) -> list[dict[str, Any]]:
    """A deferred run through the GuardedTrigger whose task is cleared mid-hold: its trigger's
    cancellation lets the key go at 12.0 (``released``); its job stops (``lost``) at ``job_stops``."""
    events = [event for event in _run("a", 1, "k", 10, 13, outcome) if event["event"] != "done"]
    return [
        *events,
        {"t": 10.5, "event": "trigger", "run": "a", "clears": True, "ends_there": False, "pid": 1},
        _write("a", 1, "k", 11.0),
        {"t": job_stops, "event": "lost", "run": "a", "pid": 1},
        {"t": 12.0, "event": "released", "run": "a", "key": "k", "pid": 1},
        {"t": 12.01, "event": "cleared", "run": "a", "pid": 1},
    ]


def test_a_task_cleared_while_deferred_ends_lost_its_job_stopped_before_the_trigger_let_the_key_go() -> None:
    """A run whose GuardedTrigger was cancelled for a clear must not complete (rule 12), and a job that
    still wrote after the cancellation let the key go wrote outside its hold (rule 10)."""
    kept = check(_cleared_run("lost", 11.5), [], lease=LEASE)
    assert kept.passed, kept.violations
    assert kept.figures["guarded_triggers"] == {"runs": 1, "cleared": 1, "outcomes": {"lost": 1}}
    completed = check(_cleared_run("completed", 11.5), [], lease=LEASE)
    assert any("cleared while deferred" in v for v in completed.violations), completed.violations
    late = check([*_cleared_run("lost", 12.8), _write("a", 1, "k", 12.5)], [], lease=LEASE)
    assert any(v.startswith("write outside a hold: a") for v in late.violations), late.violations


def test_an_overlap_is_judged_by_the_fault_that_allows_the_longest_not_only_the_latest() -> None:
    """The work's own error aborts a transaction lock (the server frees the key at once; the
    holder learns at its next probe and side look, up to ``caught-error``'s bound), then its
    host is cut off before it learns: the overlap is the caught error's, not the cut's (found by
    a 12-minute campaign). A cut alone still allows no more than the jitter."""
    caught = {**_fault("caught-error", 9.99, 9.99, [1]), "target": "a"}
    cut = _fault("netcut", 10.0, 16.0, [1])
    overlap = 1.5  # over the cut's bound, under the caught error's
    assert JITTER < overlap < overlap_bound("caught-error", 0.0, LEASE)
    runs = [*_run("a", 1, "k", 9.98, 10.1 + overlap, "lost", lost=True), *_run("b", 2, "k", 10.1, 13, "completed")]
    assert check([*runs, caught, cut], [], lease=LEASE).passed
    report = check([*runs, cut], [], lease=LEASE)
    assert any("overlap longer than its bound" in v and "after netcut" in v for v in report.violations), report


def test_a_hold_taken_after_a_failover_explains_a_skip_whose_try_came_late_in_the_run() -> None:
    """Rule 11 (a 12-minute campaign): a run's try came seconds after its start (its connect waited out
    a failover), met a hold taken on the new primary, and its look found the holder gone."""
    failover = _fault("failover", 18.5, 19.0, [])
    late = [*_run("a", 1, "k", 19.9, 21.7, "completed"), failover, *_skip("s", 3, ["k"], 18.0, 22.0)]
    assert check(late, [], lease=LEASE).passed
    went_on = [*_run("a", 1, "k", 19.9, 30.0, "completed"), failover, *_skip("s", 3, ["k"], 18.0, 22.0)]
    assert check(went_on, [], lease=LEASE).violations  # its holder would have been named
    before = [*_run("a", 1, "k", 17.0, 21.7, "lost", lost=True), failover, *_skip("s", 3, ["k"], 19.2, 22.0)]
    assert check(before, [], lease=LEASE).violations  # the failover ended it before the run began


def _tried(events: list[dict[str, Any]], keys: list[str]) -> list[dict[str, Any]]:
    tries = {"t": events[0]["t"] + 0.001, "event": "tries", "run": events[0]["run"], "keys": keys}
    return [events[0], tries, *events[1:]]


def test_a_run_that_failed_after_taking_its_key_explains_a_skip_it_overlaps() -> None:
    """Rule 11: a run whose statement after its try failed held the key with no acquired event."""
    failed = _tried(_skip("f", 1, ["k"], 19.0, 20.5), ["k"])
    failed[-1].update(outcome="failed", tried=None)
    assert check([*failed, *_skip("s", 3, ["k"], 20.0, 20.01)], [], lease=LEASE).passed
    assert check([*failed, *_skip("s", 3, ["j"], 20.0, 20.01)], [], lease=LEASE).violations  # another key
    waited = [e for e in failed if e["event"] != "tries"]  # a wait that timed out held nothing
    assert check([*waited, *_skip("s", 3, ["k"], 20.0, 20.01)], [], lease=LEASE).violations
    # its failure may be a fault's (its try never taking the key): the server's, begun before or during
    # it, or its own process's (cut off as the skip's worker was)
    for fault in (
        _fault("restart-fast", 19.5, 21.0, []),
        _fault("restart-fast", 18.0, 19.5, []),
        _fault("netcut", 18.5, 24.0, [1, 3]),
    ):
        assert check([*failed, fault, *_skip("s", 3, ["k"], 20.0, 20.01)], [], lease=LEASE).violations, fault


def test_a_skip_whose_look_failed_is_judged_as_one_that_named_nobody_and_says_so() -> None:
    """Rule 11: a look fails when the server is away, when errors happen too: no hold that merely went on
    explains it; the violation says the look failed."""
    unlooked = _skip("s", 3, ["k"], 20.0, 20.01, unlooked=["k"])
    report = check([*_run("a", 1, "k", 18.0, 30.0, "completed"), *unlooked], [], lease=LEASE)
    assert report.violations and "the worker's look at ['k'] failed" in report.violations[0]
    assert check([*_run("a", 1, "k", 18.0, 19.5, "completed"), *unlooked], [], lease=LEASE).passed


def test_a_hold_its_run_lost_explains_a_skip_it_overlaps() -> None:
    """Rule 11 (a 12-minute campaign): a stalled worker's transaction sat idle past its lease and the
    server ended it between another's try, which met it, and that one's look; the worker learnt of
    the loss 1.7 s later."""
    stalled = _run("a", 1, "k", 17.0, 21.7, "lost", lost=True)
    assert check([*stalled, *_skip("s", 3, ["k"], 20.0, 20.025)], [], lease=LEASE).passed
    believed = _run("a", 1, "k", 17.0, 21.7, "completed")  # a hold it kept would have been named
    assert check([*believed, *_skip("s", 3, ["k"], 20.0, 20.025)], [], lease=LEASE).violations
    restart = _fault("restart-fast", 18.0, 19.0, [])  # lost to a restart before the skip: it held nothing then
    assert check([*stalled, restart, *_skip("s", 3, ["k"], 20.0, 20.025)], [], lease=LEASE).violations


def test_a_run_lost_before_it_worked_held_its_key_from_its_try() -> None:
    """Rule 11 (a 12-minute campaign, seed 20261210): a transaction-mode run took the key, its token's
    commit waited for the standby after a restart, the server ended its idle transaction between
    another's try and that one's look, and the run was found lost before its work: no acquired event."""
    restart = _fault("restart-immediate", 15.5, 21.0, [])  # the nemesis's span: the server was back at once
    lost = _tried(_skip("a", 1, ["k"], 17.0, 20.6), ["k"])
    lost[-1].update(outcome="lost", tried=None)
    assert check([*lost, restart, *_skip("s", 3, ["k"], 20.0, 20.025)], [], lease=LEASE).passed
    earlier = _fault("restart-immediate", 18.0, 18.5, [])  # a restart after its try ended its session then
    assert check([*lost, earlier, *_skip("s", 3, ["k"], 20.0, 20.025)], [], lease=LEASE).violations
    assert check([*lost, *_skip("s", 3, ["k"], 21.8, 21.825)], [], lease=LEASE).violations  # long after its outcome


def test_a_fenced_transaction_guard_gets_no_overlap_allowance_until_the_server_is_back() -> None:
    """A guard-transaction holder whose token's commit waited for the standby after a restart started
    its work with its lock gone (review of 12-minute runs): only JITTER after a server fault for it;
    other ways keep the allowance until the fault's end."""
    restart = _fault("restart-fast", 10.0, 16.0, [])

    def overlap(kind: str) -> list[dict[str, Any]]:
        older = _run("a", 1, "k", 10.5, 13.5, "lost", lost=True)
        older[0]["kind"] = kind
        return [*older, restart, *_run("b", 2, "k", 11.0, 14.0, "completed")]

    assert check(overlap("guard-session"), [], lease=LEASE).passed
    report = check(overlap("guard-transaction"), [], lease=LEASE)
    assert any("overlap longer than its bound" in v for v in report.violations), report.violations


def test_a_run_that_worked_explains_nothing_by_the_keys_it_found_busy() -> None:
    """A lock session's batch takes what it can: a key it tried and did not get was busy, held by
    someone else; its run ending lost or failed later says nothing of that key."""
    batch = _tried(_run("a", 1, "j", 19.0, 20.5, None), ["j", "k"])
    batch.append({"t": 20.6, "event": "outcome", "run": "a", "outcome": "lost", "pid": 1})
    assert check([*batch, *_skip("s", 3, ["k"], 20.0, 20.01)], [], lease=LEASE).violations


def test_a_holder_cut_off_explains_a_skip_until_the_server_let_its_session_go() -> None:
    """Rule 11 (a 12-minute campaign, seed 20261212): a deferred holder cut off from the network gave
    its key up as lost at its heartbeat's deadline; the server kept its session, and the key, until
    its own timeout, so another's try met the key and that one's look, after the server let go, found
    nobody. Such a hold explains a skip until the release bound after the cut, no longer."""
    cut = _fault("netcut", 18.0, 30.0, [1])
    holder = _run("a", 1, "k", 17.0, 20.0, "lost", lost=True)
    holder[0]["kind"] = "deferred"
    bound = release_bound(LEASE)
    assert check([*holder, cut, *_skip("s", 3, ["k"], 21.5, 21.52)], [], lease=LEASE).passed
    assert check([*holder, *_skip("s", 3, ["k"], 21.5, 21.52)], [], lease=LEASE).violations  # no cut
    other = _fault("netcut", 18.0, 30.0, [2])  # another worker's cut
    assert check([*holder, other, *_skip("s", 3, ["k"], 21.5, 21.52)], [], lease=LEASE).violations
    late = 18.0 + bound + JITTER + 0.5  # past the bound the server had let it go (rule 9)
    assert check([*holder, cut, *_skip("s", 3, ["k"], late, late + 0.02)], [], lease=LEASE).violations
    restart = _fault("restart-fast", 20.5, 21.0, [])  # a restart in between ended its session
    assert check([*holder, cut, restart, *_skip("s", 3, ["k"], 21.5, 21.52)], [], lease=LEASE).violations


def _stall(pid: int, start: float, end: float, machine: bool = True) -> list[dict[str, Any]]:
    """A worker's stall, with the machine watch's (unless ``machine`` is false)."""
    own = {"t": end, "event": "stall", "start": start, "end": end, "pid": pid, "worker": pid, "cpu": 0.0}
    seen = {"t": end, "event": "stall", "start": start + 0.1, "end": end - 0.1, "pid": 99, "watch": "machine"}
    return [own, seen] if machine else [own]


def test_a_workers_own_stall_is_judged_as_a_freeze_of_that_worker_and_no_other() -> None:
    """A freeze of the whole machine (a 12-minute campaign, seed 20261211: 8 s with no event from any
    worker) stops a holder as a SIGSTOP does; the worker records it, and the overlap it opened is
    bounded by it, where the machine watch stalled too. A stall inside a short freeze the nemesis
    injected leaves that freeze's bound; one the machine watch did not see is the worker's own."""
    overlap = [*_run("a", 1, "k", 9, 16.5, "lost", lost=True), *_run("b", 2, "k", 13, 17, "completed")]
    assert check(overlap, [], lease=LEASE).violations  # nothing explains it
    report = check([*overlap, *_stall(1, 10.0, 16.0)], [], lease=LEASE)
    assert report.passed, report.violations
    assert report.figures["faults"]["stall"] == 1
    assert check([*overlap, *_stall(2, 10.0, 16.0)], [], lease=LEASE).violations  # another worker's stall
    longer = [*_run("a", 1, "k", 9, 22, "lost", lost=True), *_run("b", 2, "k", 13, 23, "completed")]
    report = check([*longer, *_stall(1, 10.0, 16.0)], [], lease=LEASE)
    assert any("longer than its bound" in v for v in report.violations), report.violations
    short = _fault("sigstop-short", 10.0, 11.0, [1])  # injected: a short freeze keeps its bound (JITTER)
    report = check([*overlap, short, *_stall(1, 10.0, 11.0)], [], lease=LEASE)
    assert any("longer than its bound" in v and "sigstop-short" in v for v in report.violations), report.violations
    assert report.figures["faults"]["stall"] == 0
    alone = check([*overlap, *_stall(1, 10.0, 16.0, machine=False)], [], lease=LEASE)  # the machine ran meanwhile:
    assert alone.violations and alone.figures["faults"]["stall"] == 0  # its interpreter was kept waiting


def test_a_cut_off_holder_explains_only_a_look_after_the_server_could_have_let_it_go() -> None:
    """The allowance for a cut-off holder (review of 9448b88): not a look before the server could end
    its session (2L/3 after the cut: the holder is named then), not a skipper cut off with it (its
    own try failing is the error rule 11 looks for), not a hold released before the cut (its unlock
    reached the server), not a one-session hold a restart had ended before the cut."""
    cut = _fault("netcut", 18.0, 30.0, [1])
    holder = _run("a", 1, "k", 17.0, 20.0, "lost", lost=True)
    assert check([*holder, cut, *_skip("s", 3, ["k"], 21.5, 21.52)], [], lease=LEASE).passed
    failed = _run("a", 1, "k", 17.0, 20.0, "failed")  # (a hold its run lost explains a skip it overlaps anyway)
    assert check([*failed, cut, *_skip("s", 3, ["k"], 21.5, 21.52)], [], lease=LEASE).passed
    assert check([*failed, cut, *_skip("s", 3, ["k"], 18.1, 18.12)], [], lease=LEASE).violations  # early look
    both = _fault("netcut", 18.0, 30.0, [1, 3])
    assert check([*failed, both, *_skip("s", 3, ["k"], 21.5, 21.52)], [], lease=LEASE).violations  # cut too
    released = _run("a", 1, "k", 15.0, 17.5, "completed")
    assert check([*released, cut, *_skip("s", 3, ["k"], 21.5, 21.52)], [], lease=LEASE).violations
    restart = _fault("restart-fast", 17.5, 17.8, [])  # ended the guard's session before the cut
    assert check([*failed, restart, cut, *_skip("s", 3, ["k"], 21.5, 21.52)], [], lease=LEASE).violations


def test_a_stall_counts_only_where_the_machine_stalled_too_and_only_while_it_could_cost_a_lock() -> None:
    """Review of d4488f5: a worker's long stall that the machine watch shared for a moment only is
    judged by that moment (a stall shorter than half the lease costs no lock); a long stall does not
    explain an overlap that began well after it."""
    overlap = [*_run("a", 1, "k", 9, 21, "lost", lost=True), *_run("b", 2, "k", 13, 22, "completed")]
    own = {"t": 20.0, "event": "stall", "start": 10.0, "end": 20.0, "pid": 1, "worker": 1, "cpu": 0.0}
    brief = {"t": 20.05, "event": "stall", "start": 19.5, "end": 20.05, "pid": 99, "watch": "machine"}
    assert check([*overlap, own, brief], [], lease=LEASE).violations
    later = [*_run("a", 1, "k", 4, 42, "lost", lost=True), *_run("b", 2, "k", 40, 41.5, "completed")]
    assert check([*later, *_stall(1, 5.0, 7.5)], [], lease=LEASE).violations  # the stall was long over


def test_a_session_idle_through_a_stall_is_judged_by_its_idle_time_less_the_stall() -> None:
    """Rule 13: a worker cannot close a session while the machine does not run it: the stall is taken
    off the idle time, and nothing more."""
    spawn = {"t": 1.0, "event": "spawn", "worker": 1, "pid": 1}

    def idle(seconds: float) -> dict[str, Any]:
        return {"t": 20.0, "event": "idle-session", "idle": seconds, "application_name": "campaign w1", "backend": 5}

    assert check([spawn, idle(2.9)], [], lease=LEASE).violations  # bound 0.8 L = 2.4 s
    assert check([spawn, idle(2.9), *_stall(1, 18.0, 18.8)], [], lease=LEASE).passed
    assert check([spawn, idle(2.9), *_stall(1, 18.0, 18.3)], [], lease=LEASE).violations


def test_a_waiter_frozen_and_granted_the_key_explains_a_skip_of_that_key_after_the_server_could_end_it() -> None:
    """Rule 11 (a 12-minute campaign, seed 20261214): a waiter frozen while it waited was granted the key
    during the freeze (no event: it was frozen); its session held the key, idle in its wait's
    transaction, until the server ended that a lease later. Another's try met the key, its look after
    that named nobody. The nemesis records what the waiter waited for: such a freeze explains a skip of
    that key only, by another worker, tried by the thaw and looked at a lease after the freeze began or
    later."""
    frozen = {**_fault("sigstop-waiter", 10.0, 17.0, [1]), "waiter": True, "waited": [pg_locks_of("k")]}
    assert check([frozen, *_skip("s", 3, ["k"], 14.0, 14.1)], [], lease=LEASE).passed
    assert check([*_skip("s", 3, ["k"], 14.0, 14.1)], [], lease=LEASE).violations  # no freeze
    assert check([frozen, *_skip("s", 3, ["j"], 14.0, 14.1)], [], lease=LEASE).violations  # another key
    assert check([frozen, *_skip("s", 1, ["k"], 14.0, 14.1)], [], lease=LEASE).violations  # the frozen one's own
    early = 10.0 + LEASE - 2 * JITTER  # the server could not have ended it yet: the look names the waiter
    assert check([frozen, *_skip("s", 3, ["k"], early - 0.1, early)], [], lease=LEASE).violations
    thawed = 17.0 + JITTER + 0.1  # tried after the thaw: a grant then was recorded (the waiter went on)
    assert check([frozen, *_skip("s", 3, ["k"], thawed, thawed + 0.1)], [], lease=LEASE).violations
    unknown = {**_fault("sigstop-waiter", 10.0, 17.0, [1]), "waiter": True}  # what it waited for not recorded
    assert check([unknown, *_skip("s", 3, ["k"], 14.0, 14.1)], [], lease=LEASE).violations


def test_the_pair_key_and_the_numeric_key_have_the_coordinates_pg_locks_shows() -> None:
    from airflow_pglock.keys import LockKey
    from devtools.campaign.workers import PAIR_KEY, PAIR_NUMBERS

    assert pg_locks_of(PAIR_KEY) == "/".join(map(str, LockKey.from_pair(*PAIR_NUMBERS).pg_locks))
    number = LockKey.from_name("campaign/numeric").int64  # the numeric key: taken by its name's number
    assert pg_locks_of("campaign/numeric") == "/".join(map(str, LockKey.from_int(number).pg_locks))


def test_a_deferred_holds_row_explains_a_late_look_after_a_server_fault_only_if_live_at_the_try() -> None:
    """Rule 11 (a 12-minute campaign, seed 20261215): ``hook.lock()`` met a key that a deferred
    operator's row held (the product's refusal named it), then the worker's own look waited out a
    connect to the frozen old primary of a failover, and found the row lapsed. A scope's or deferred
    operator's row explains such a skip when it could be live at the try and a fault of the server
    began during the run; not without that fault, nor for a try after the row's lease."""
    holder = _run("a", 1, "k", 10.0, 12.0, "completed")
    holder[0]["kind"] = "deferred"
    row_end = 12.0 + SCOPE_LEASE_FACTOR * LEASE  # its row's lease after its end
    failover = _fault("failover-frozen", 14.5, 20.0, [])
    assert check([*holder, failover, *_skip("s", 3, ["k"], 14.0, row_end + 2)], [], lease=LEASE).passed
    assert check([*holder, *_skip("s", 3, ["k"], 14.0, row_end + 2)], [], lease=LEASE).violations  # no fault
    late = row_end + JITTER + 0.5  # tried once the row had lapsed
    later = _fault("failover-frozen", late + 0.2, late + 5, [])
    assert check([*holder, later, *_skip("s", 3, ["k"], late, late + 3)], [], lease=LEASE).violations
