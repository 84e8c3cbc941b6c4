"""The fault campaign's holders keep to the rules the checker reads them by (devtools/campaign/workers.py).

A holder that breaks them makes the campaign report what did not happen: a spurious failure,
or an overlap the product never made.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from airflow_pglock.exceptions import LockConfigurationError, LockLostError
from devtools.campaign.servers import Register
from devtools.campaign.workers import Worker, WorkerConfig
from tests.faults.conftest import FaultServer
from tests.faults.test_interruption import _guard, _terminate_soon
from tests.helpers import advisory_locks

pytestmark = [pytest.mark.faults, pytest.mark.slow]

DATABASE = "pglock_campaign_worker"


@pytest.fixture
def worker(fault_server: FaultServer, fault_admin: Any, tmp_path: Path) -> Iterator[Worker]:
    """A campaign worker whose lock database and fencing register are a database of their own
    on the fault server, with ``init-db`` run (as the campaign's is)."""
    from airflow_pglock.pg import schema

    fault_admin.execute(f"DROP DATABASE IF EXISTS {DATABASE}")
    fault_admin.execute(f"CREATE DATABASE {DATABASE}")
    dsn = fault_server.cluster.dsn_for(DATABASE)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(Register.SCHEMA)
        conn.execute("INSERT INTO register (key) VALUES ('k')")
        schema.migrate(conn)
    config = WorkerConfig(
        index=0,
        kind="deferred",
        lock_dsn=dsn,
        register_dsn=dsn,
        lease=3.0,
        history=tmp_path / "history.jsonl",
        stop_file=tmp_path / "stop",
        seed=1,
        hot_keys=("k",),
        pool="pool",
        pool_slots=2,
    )
    made = Worker(config, 0)
    try:
        yield made
    finally:
        if made._register is not None:
            made._register.close()
        made.history.close()
        fault_admin.execute(f"DROP DATABASE {DATABASE} WITH (FORCE)")


def test_a_write_the_loss_interrupted_leaves_the_next_run_a_usable_register(
    worker: Worker, fault_server: FaultServer, fault_admin: Any
) -> None:
    """The loss's interruption can land while a register write waits for its answer: psycopg
    cancels and drains a statement only for KeyboardInterrupt and SystemExit, so the connection
    is left with that statement in flight. A worker that kept it failed its next run's first
    write ("another command is already in progress"), after its key was taken: found by the
    short campaign as a failed run whose done event came after its release (an overlap)."""
    worker._write("warm-up", "k", 1)
    with psycopg.connect(worker.config.register_dsn) as blocker:  # holds the register's row: the next write waits
        blocker.execute("SELECT * FROM register WHERE key = 'k' FOR UPDATE")

        def work(lock: Any) -> None:
            _terminate_soon(fault_server, lock.backend_pid, delay=0.5)
            worker._write("interrupted", "k", 2)

        started = time.monotonic()
        with pytest.raises(LockLostError):
            _guard(fault_server, "campaign-worker-write").run(work)
        assert time.monotonic() - started < 10, "the write was not interrupted: it ended with the blocker"
        blocker.rollback()
    worker._write("next run", "k", 3)  # the next run's first write
    with psycopg.connect(worker.config.register_dsn) as register:
        accepted = register.execute("SELECT run, accepted FROM writes ORDER BY seq").fetchall()
    assert accepted == [("warm-up", True), ("next run", True)]  # the interrupted write was cancelled


def test_a_deferred_run_whose_work_failed_ends_its_hold_before_the_release(
    worker: Worker, fault_server: FaultServer, fault_admin: Any
) -> None:
    """The checker counts a hold from its acquired event to its done event. A ``deferred`` run
    whose first work failed wrote done only after the guard had released the key: another
    holder that took it at once overlapped it in the history, not on the server (found by
    the short campaign: a 0.000 s overlap)."""
    with psycopg.connect(worker.config.register_dsn, autocommit=True) as register:
        register.execute("ALTER TABLE writes RENAME TO writes_gone")  # every write fails
    watcher = psycopg.connect(worker.config.lock_dsn, autocommit=True)
    held_at_done: list[list[Any]] = []
    emit = worker.history.emit

    def emit_and_look(event: str, **data: Any) -> None:
        if event == "done":
            held_at_done.append(advisory_locks(watcher))
        emit(event, **data)

    worker.history.emit = emit_and_look  # type: ignore[method-assign]
    try:
        with pytest.raises(psycopg.errors.UndefinedTable):
            worker._deferred("failing", "k")
    finally:
        watcher.close()
    assert len(held_at_done) == 1, held_at_done
    assert held_at_done[0], "the key was released before the run's done event"


def test_a_deferred_run_whose_hand_over_failed_ends_its_hold_when_its_work_ended(
    worker: Worker, fault_server: FaultServer, fault_admin: Any
) -> None:
    """A ``deferred`` run whose work succeeded but whose hand-over failed learns of it only once
    the guard gave the key up: its done event may be written after the key is free. It carries the
    time the work ended (``at``), before the hand-over began, which the checker ends the hold at:
    else a holder that took the key at once could overlap it in the history, not on the server."""
    watcher = psycopg.connect(worker.config.lock_dsn, autocommit=True)
    first_free: list[float] = []
    stop = threading.Event()

    def watch() -> None:  # when the key is first seen free after it was held
        seen_held = False
        with psycopg.connect(worker.config.lock_dsn, autocommit=True) as looker:
            while not stop.is_set() and not first_free:
                if advisory_locks(looker):  # this database's: only the run's key
                    seen_held = True
                elif seen_held:
                    first_free.append(time.time())
                time.sleep(0.002)

    write = worker._write
    renamed: list[bool] = []

    def write_then_break_the_hand_over(run: str, key: str, token: int | None) -> None:
        write(run, key, token)
        if not renamed:  # the work goes on; the hand-over's statement will fail
            watcher.execute("SET lock_timeout = '5s'")  # fails, not hangs, should the guard hold the table
            watcher.execute("ALTER TABLE pglock.scopes RENAME TO scopes_gone")
            renamed.append(True)

    worker._write = write_then_break_the_hand_over  # type: ignore[method-assign]
    looking = threading.Thread(target=watch, daemon=True)
    looking.start()
    try:
        with pytest.raises(LockConfigurationError, match=r"pglock\.scopes"):
            worker._deferred("hand-over-fails", "k")
    finally:
        looking.join(10)  # the close frees the key once its backend exited, a moment later
        stop.set()
        watcher.execute("ALTER TABLE IF EXISTS pglock.scopes_gone RENAME TO scopes")
        watcher.close()
    worker.history.close()
    events = [json.loads(line) for line in worker.config.history.read_text().splitlines()]
    done = [e for e in events if e["event"] == "done"]
    assert len(done) == 1, events
    assert first_free, "the key was never seen free"
    # The event may be written before or after the key is free (it is freed by the close, when
    # the backend exits): the hold the checker reads ends when the work ended, before either.
    assert done[0].get("at") is not None and done[0]["at"] < first_free[0], (done, first_free)


class _Scripted:
    """A worker's random choices, scripted: ``random()`` and ``randint()`` answer in turn."""

    def __init__(self, randoms: list[float], randints: list[int]) -> None:
        self.randoms, self.randints = randoms, randints

    def random(self) -> float:
        return self.randoms.pop(0)

    def randint(self, low: int, high: int) -> int:
        return self.randints.pop(0)

    def uniform(self, low: float, high: float) -> float:
        return low

    def choice(self, items: Any) -> Any:
        return items[0]


def _events(worker: Worker) -> list[dict[str, Any]]:
    worker.history.close()
    return [json.loads(line) for line in worker.config.history.read_text().splitlines()]


def test_a_lock_sessions_early_release_leaves_its_other_holds_judged(
    worker: Worker, fault_server: FaultServer, fault_admin: Any
) -> None:
    """Review -66 (M2): the first work of a lock session wrote a done event, which ends every hold of
    the run; the early release and the second work came after it, so a release that also freed the
    other keys was judged by nothing. Now the done comes once, after the second work, and every write
    lies inside a hold of its key (the checker's rule 10)."""
    from devtools.campaign.checker import check

    # a bounded wait for the last key (0.1 < 0.4), 2 steps, give the first key back (0.1 < 0.5), 2 steps
    worker.rng = _Scripted([0.1, 0.1], [2, 2])  # type: ignore[assignment]
    worker.history.emit("attempt", run="r")
    worker._lock_session("r", ["a", "b", "c"])
    worker.history.emit("outcome", run="r", outcome="completed", detail="")
    events = _events(worker)
    kinds = [(e["event"], e.get("key")) for e in events]
    released = kinds.index(("released", "a"))
    assert ("done", None) not in kinds[:released], kinds
    # the batch (a, b and the worker's own two keys), the last key (c): a is given back, the others are worked on
    own = ["campaign/own/0/1", "campaign/own/0/2"]
    assert [k for e, k in kinds[released:] if e == "write"] == ["b", *own, "c"] * 2, kinds
    assert not [k for e, k in kinds if e == "unheld"], kinds  # still held: looked at
    report = check(events, [], lease=3.0)
    assert report.passed, report.violations
    assert report.figures["writes_outside_holds"] == 0 and report.figures["runs_that_held"] == 1


def test_a_skip_records_the_holders_its_refusal_named(
    worker: Worker, fault_server: FaultServer, fault_admin: Any
) -> None:
    """The checker's rule 11 reads what a skip's refusal named: a guard's LockBusyError names the
    holder's pid and application_name; hook.lock() says only "busy", so the worker looks at once."""
    from airflow_pglock.keys import LockKey

    number = LockKey.from_name("k").int64
    with psycopg.connect(worker.config.lock_dsn, autocommit=True, application_name="the holder") as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", [number])
        pid = holder.info.backend_pid
        worker.rng = _Scripted([0.0], [])  # type: ignore[assignment]
        worker.config = dataclasses.replace(worker.config, kind="guard-session")
        worker.one_run()
        # exclusive, session, no wait (no numeric key configured: no draw for it)
        worker.rng = _Scripted([0.9, 0.9, 0.9], [])  # type: ignore[assignment]
        worker.config = dataclasses.replace(worker.config, kind="hook-lock")
        worker.one_run()
    skips = [e for e in _events(worker) if e["event"] == "outcome"]
    assert [e["outcome"] for e in skips] == ["skipped", "skipped"], skips
    for skip in skips:
        assert skip["tried"] == ["k"] and not skip["scope_row"], skip
        assert skip["holders"] == [{"key": "k", "pid": pid, "application_name": "the holder"}], skip
    assert skips[1]["looked"] is True


def _guarded_run(worker: Worker, run: str, rules: Any) -> None:
    """One guard run of the rules key ``k`` with ``rules``, written as ``Worker.one_run`` writes it."""
    from devtools.campaign.workers import _Busy

    worker.history.emit("attempt", run=run)
    try:
        worker._guard(run, "k", rules=rules)
    except _Busy as busy:
        worker.history.emit("outcome", run=run, outcome="skipped", detail="", **busy.fields())
        return
    worker.history.emit("outcome", run=run, outcome="completed", detail="")


def _mutant(monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    """A deliberate fault in the guard's run rules check (the record is left alone): ``once_per`` the
    period's check disabled; ``min_interval`` an off-by-one second (``age < min_interval - 1``)."""
    import airflow_pglock.guard

    real = airflow_pglock.guard.check_before_work

    def check(rules: Any, *args: Any) -> Any:
        if fault == "once_per":
            rules = dataclasses.replace(rules, period=None)
        elif rules.min_interval is not None:
            rules = dataclasses.replace(rules, min_interval=rules.min_interval - 1.0)
        return real(rules, *args)

    monkeypatch.setattr(airflow_pglock.guard, "check_before_work", check)


@pytest.mark.parametrize("fault", [None, "once_per", "min_interval"])
def test_the_run_rules_refuse_their_runs_and_the_checker_catches_a_check_that_lets_a_run_through(
    worker: Worker, fault_server: FaultServer, fault_admin: Any, monkeypatch: pytest.MonkeyPatch, fault: str | None
) -> None:
    """Rules 7 and 15 on a real history: a second run of a recorded period, and a run 1.3 s after a
    completion under ``min_interval=2``, are refused and the history passes; with the check disabled
    (once_per) or off by one second (min_interval) they work, and the checker names them."""
    from airflow_pglock.run_rules import RunRules
    from devtools.campaign.checker import check

    if fault is not None:
        _mutant(monkeypatch, fault)
    worker.rng = _Scripted([], [2, 2, 2, 2])  # type: ignore[assignment]
    if fault in (None, "once_per"):
        period = RunRules(period="g1", fencing=True)
        _guarded_run(worker, "a", period)
        _guarded_run(worker, "b", period)  # the period is done: refused
    if fault in (None, "min_interval"):
        interval = RunRules(min_interval=2.0, fencing=True)
        if fault is None:
            time.sleep(2.1)  # a's record is the key's latest: min_interval reads every period's
        _guarded_run(worker, "c", interval)
        time.sleep(1.3)
        _guarded_run(worker, "d", interval)  # 1.3 s after c's record: refused
    events = _events(worker)
    recorded = [e for e in events if e["event"] == "recorded"]
    assert recorded and all(e["exact"] for e in recorded), recorded  # read back by the run's token
    report = check(events, [], lease=3.0)
    outcomes = {e["run"]: e["outcome"] for e in events if e["event"] == "outcome"}
    if fault is None:
        assert outcomes == {"a": "completed", "b": "skipped", "c": "completed", "d": "skipped"}, outcomes
        assert report.passed, report.violations
        assert report.figures["run_rules"]["refused"] == 2 and report.figures["skips"]["unexplained"] == 0
    elif fault == "once_per":
        assert outcomes == {"a": "completed", "b": "completed"}, outcomes
        assert any("ran again" in v for v in report.violations), report.violations
        assert any("recorded 2 times" in v for v in report.violations), report.violations
    else:
        assert outcomes == {"c": "completed", "d": "completed"}, outcomes
        assert any(v.startswith("run within min_interval: d") for v in report.violations), report.violations
        assert any(v.startswith("recorded within min_interval: d") for v in report.violations), report.violations


def _two_host_worker(worker: Worker, fault_server: FaultServer) -> Worker:
    """The fixture's worker with a lock DSN of two hosts and ports as the campaign's (primary and
    standby, ``target_session_attrs``): here a port nothing listens on first, then the fault server."""
    dead = fault_server.cluster.port + 1000
    dsn = (
        f"host=127.0.0.1,127.0.0.1 port={dead},{fault_server.cluster.port} dbname={DATABASE} user=postgres"
        " target_session_attrs=read-write connect_timeout=2"
    )
    made = Worker(dataclasses.replace(worker.config, lock_dsn=dsn), 1)
    made.history = worker.history
    return made


def _guarded_trigger_runs(
    worker: Worker, monkeypatch: pytest.MonkeyPatch, fault_server: FaultServer, clears: bool
) -> tuple[Worker, list[tuple[str, dict[str, Any], list[str]]]]:
    """Deferred runs through the real GuardedTrigger (every one; cleared mid-hold when ``clears``)
    until one ends as asked; each event with the sessions holding an advisory lock then."""
    from airflow_pglock.compat import KILLS_CLEARED_TRIGGERS
    from devtools.campaign import workers

    if clears and not KILLS_CLEARED_TRIGGERS:
        pytest.skip("before Airflow 3.3 the triggerer calls no on_kill() for a cleared task's trigger")
    monkeypatch.setattr(workers, "TRIGGER_SHARE", 1.0)
    monkeypatch.setattr(workers, "CLEAR_SHARE", 1.0 if clears else 0.0)
    made = _two_host_worker(worker, fault_server)
    watcher = psycopg.connect(fault_server.cluster.dsn_for(DATABASE), autocommit=True)
    seen: list[tuple[str, dict[str, Any], list[str]]] = []
    emit = made.history.emit

    def emit_and_look(event: str, **data: Any) -> None:
        names = watcher.execute(
            "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
            " WHERE l.locktype = 'advisory' AND l.granted"
        ).fetchall()
        seen.append((event, {**data, "t": time.time()}, [row[0] for row in names]))
        emit(event, **data)

    made.history.emit = emit_and_look  # type: ignore[method-assign]
    try:
        for _ in range(12):
            seen.clear()
            made.one_run()
            cleared = [data["run"] for event, data, _ in seen if event == "cleared"]
            followed = [data for event, data, _ in seen if event == "acquired" and data["run"].endswith("-next")]
            if bool(cleared) == clears and (followed or not clears):
                break
            if cleared and not followed:
                time.sleep(6.5)  # its row lapses (two 3 s leases; no next try took it over) before the next run
    finally:
        watcher.close()
        if made._register is not None:
            made._register.close()
    return made, seen


def test_a_deferred_run_through_the_guarded_trigger_resolves_the_two_hosts_and_writes_while_the_hub_holds(
    worker: Worker, fault_server: FaultServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ``deferred`` kind's GuardedTrigger runs: the Airflow connection it resolves carries the
    lock DSN's two hosts and ports and target_session_attrs (the ports as an extra, which
    PostgresHook passes on over the one-number Port field), and the job writes while the worker's
    hold hub holds the key (``campaign w<n> holds``, the worker's own session released)."""
    from airflow_pglock.compat import BaseHook
    from airflow_pglock.hooks.connection import from_airflow

    made, seen = _guarded_trigger_runs(worker, monkeypatch, fault_server, clears=False)
    params = from_airflow(made._airflow_connection(), BaseHook.get_connection).params
    ports = f"{fault_server.cluster.port + 1000},{fault_server.cluster.port}"
    assert params["host"] == "127.0.0.1,127.0.0.1" and params["port"] == ports, params
    assert params["target_session_attrs"] == "read-write", params
    events = [event for event, _, _ in seen]
    assert "trigger" in events and events[-1] == "outcome", events
    assert seen[-1][1]["outcome"] == "completed", seen[-1]
    triggered = events.index("trigger")
    in_triggerer = [names for event, _, names in seen[triggered + 1 :] if event == "write"]
    assert in_triggerer, events
    assert ["campaign w0 holds"] in in_triggerer, in_triggerer  # the hub's session held the key for the job


def test_a_deferred_run_cleared_mid_hold_kills_its_job_before_the_guarded_trigger_lets_the_key_go(
    worker: Worker, fault_server: FaultServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A task cleared while deferred (Airflow 3.3+: the triggerer cancels its trigger for a user's
    action, then calls its on_kill()): GuardedTrigger kills the operator's trigger's job under the
    hold, so the job's lost event comes while the hub still holds the key, the job writes nothing
    after it, the key is free at the ``released`` event, and the run ends lost. The task's next try,
    waiting for the key meanwhile, takes the row over and works only after the job stopped."""
    _, seen = _guarded_trigger_runs(worker, monkeypatch, fault_server, clears=True)
    cleared = next(data["run"] for event, data, _ in seen if event == "cleared")
    mine = [(event, data, names) for event, data, names in seen if data.get("run") == cleared]
    events = [event for event, _, _ in mine]
    assert "lost" in events, f"no on_kill() stopped the job (a write of it refused instead?): {events}"
    lost, released = events.index("lost"), events.index("released")
    assert lost < released, events
    assert mine[lost][2] == ["campaign w0 holds"], f"the job stopped after the key was let go: {mine[lost]}"
    assert "write" not in events[lost:], events
    assert mine[-1][1]["outcome"] == "lost", mine[-1]
    following = [(event, data) for event, data, _ in seen if data.get("run") == f"{cleared}-next"]
    acquired = next(data for event, data in following if event == "acquired")
    stopped = next(data["t"] for event, data, _ in mine if event == "lost")
    assert acquired["at"] > stopped, (acquired, stopped)
    assert following[-1][1]["outcome"] == "completed", following
