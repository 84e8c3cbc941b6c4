"""A randomized race: contenders with random faults and random timing, checked from PostgreSQL.

Each round, two or three guarded workers (threads) go for one key with a random mode,
policy, rule and fault: the session terminated at a random moment, the work committing on
the lock's connection (and taking the key again), unlocking it, a COPY or a pipeline on it,
a slow work the heartbeat must watch. Every worker records in a side-effect table, from its
own connection, when it entered and left the protected section (database clock). After
each round:

* no two workers that were inside at the same time both report success, and an overlap at
  all only where the older of them reports lost or failed (tests/faults/race_helpers.py);
* no worker whose session was terminated while it was inside reports success;
* a completion is recorded only for a worker that reports success, at most one per
  ``once_per`` period, and a row written on the lock's connection at the end of a
  transaction-mode work is committed only for a worker that reports success;
* nothing is left: no session, no advisory lock.

The seed is printed; replay a failure with ``PGLOCK_RACE_SEED=<seed>`` (and
``PGLOCK_RACE_ROUNDS=<n>``). Lock sessions, sub-keys and pools race in the sibling module
test_lifetime_race_holds.py, with the same rules.
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest

from airflow_pglock.guard import LockGuard
from airflow_pglock.handle import LockHandle
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.identity import TaskIdentity
from airflow_pglock.keys import LockKey
from airflow_pglock.liveness import Liveness
from airflow_pglock.pg import schema
from airflow_pglock.policy import LockPolicy
from airflow_pglock.run_rules import RunRules
from tests.faults.conftest import FaultServer, assert_nothing_left
from tests.faults.race_helpers import (
    QUIET,
    Fault,
    Span,
    Termination,
    backend_start,
    lost_hold_violations,
    overlap_violations,
    race_seed,
)

pytestmark = [pytest.mark.faults, pytest.mark.slow]

ROUNDS = int(os.environ.get("PGLOCK_RACE_ROUNDS", "200"))
SESSION_FAULTS = ("none", "none", "terminate", "unlock", "slow")
TRANSACTION_FAULTS = ("none", "terminate", "commit_begin", "retake", "copy", "pipeline", "slow")


@dataclass
class Plan:
    worker: int
    mode: str
    on_busy: str
    fault: str
    start_delay: float
    work_seconds: float
    fault_delay: float


@dataclass
class Round:
    number: int
    key: LockKey
    once_per: str | None
    plans: list[Plan]
    outcomes: dict[int, str | None] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    killers: list[Fault] = field(default_factory=list)
    terminations: list[Termination] = field(default_factory=list)


def _plan_round(rng: random.Random, number: int, seed: int) -> Round:
    mode = rng.choice(["session", "transaction"])
    faults = SESSION_FAULTS if mode == "session" else TRANSACTION_FAULTS
    plans = []
    for worker in range(rng.choice([2, 2, 3])):
        fault = rng.choice(faults)
        plans.append(
            Plan(
                worker=worker,
                mode=mode,
                on_busy=rng.choice(["skip", "wait"]),
                fault=fault,
                start_delay=rng.uniform(0, 0.1),
                work_seconds=rng.uniform(1.1, 1.3) if fault == "slow" else rng.uniform(0, 0.2),
                fault_delay=rng.uniform(0, 0.25),
            )
        )
    once_per = f"round-{number}" if rng.random() < 0.5 else None
    return Round(number, LockKey.from_name(f"race-{seed}-{number}"), once_per, plans)


def _work(server: FaultServer, plan: Plan, round_: Round, guard: LockGuard, side: Any) -> Any:
    def work(lock: LockHandle) -> None:
        side.execute(
            "INSERT INTO race_effects VALUES (%s, %s, 'enter', clock_timestamp())", [round_.number, plan.worker]
        )
        try:
            if plan.fault == "terminate":
                killer = Fault(server, plan.worker, "terminate", plan.fault_delay, round_.terminations, [])
                killer.start(lock.backend_pid, backend_start(side, lock.backend_pid))
                round_.killers.append(killer)
            conn = lock.connection
            if plan.fault == "unlock":
                time.sleep(plan.fault_delay)
                assert guard.held is not None
                guard.held.connection.execute("SELECT pg_advisory_unlock_all()")
            elif conn is not None and plan.fault in {"commit_begin", "retake"}:
                conn.execute("INSERT INTO race_rows VALUES (%s, %s, 'before commit')", [round_.number, plan.worker])
                time.sleep(plan.fault_delay)
                conn.execute("COMMIT")
                conn.execute("BEGIN")
                if plan.fault == "retake":
                    conn.execute("SELECT pg_try_advisory_xact_lock(%s::bigint)", lock.key.numbers)
            elif conn is not None and plan.fault == "copy":
                with conn.cursor().copy("COPY race_rows FROM STDIN") as copy:
                    for _ in range(3):
                        copy.write_row((round_.number, plan.worker, "copied"))
                        time.sleep(plan.fault_delay / 3)
            elif conn is not None and plan.fault == "pipeline":
                with conn.pipeline():
                    for _ in range(3):
                        conn.execute("INSERT INTO race_rows VALUES (%s, %s, 'piped')", [round_.number, plan.worker])
                        time.sleep(plan.fault_delay / 3)
            deadline = time.monotonic() + plan.work_seconds
            while time.monotonic() < deadline:
                time.sleep(0.02)
            if conn is not None:
                conn.execute("INSERT INTO race_rows VALUES (%s, %s, 'final')", [round_.number, plan.worker])
        finally:
            side.execute(
                "INSERT INTO race_effects VALUES (%s, %s, 'exit', clock_timestamp())", [round_.number, plan.worker]
            )

    return work


def _run_worker(server: FaultServer, round_: Round, plan: Plan) -> None:
    time.sleep(plan.start_delay)
    policy = LockPolicy(mode=plan.mode, on_busy=plan.on_busy, wait_timeout=2.0 if plan.on_busy == "wait" else None)  # type: ignore[arg-type]
    guard = LockGuard(
        AdvisoryLockHook(dsn=server.dsn, liveness=Liveness(3)).database,
        round_.key,
        policy,
        rules=RunRules(period=round_.once_per),
        identity=TaskIdentity(dag_id="race", task_id="worker", run_id=f"w{plan.worker}", map_index=round_.number),
        logger=QUIET,
        application_name=f"{round_.key.name} w{plan.worker}",
    )
    side = psycopg.connect(server.dsn, autocommit=True, application_name="race side effects")
    try:
        guard.run(_work(server, plan, round_, guard, side))
    except BaseException as error:  # every outcome is recorded and checked
        round_.errors[plan.worker] = f"{type(error).__name__}: {error}"[:300]
    finally:
        side.close()
    round_.outcomes[plan.worker] = guard.outcome


def _check_round(admin: Any, round_: Round, seed: int) -> None:
    where = (
        f"seed {seed}, round {round_.number}: plans {round_.plans}, outcomes {round_.outcomes}, errors {round_.errors}"
    )
    completed = {w for w, outcome in round_.outcomes.items() if outcome == "completed"}
    spans: dict[int, list[Any]] = {}
    for worker, phase, at in admin.execute(
        "SELECT worker, phase, at FROM race_effects WHERE round = %s", [round_.number]
    ).fetchall():
        spans.setdefault(worker, [None, None])[0 if phase == "enter" else 1] = at
    for worker in completed:
        assert worker in spans and None not in spans[worker], f"success without a full protected span: {where}"
    sections = [Span(worker, "key", 1, enter, exit_) for worker, (enter, exit_) in spans.items() if enter is not None]
    overlaps = overlap_violations(sections, completed)
    assert not overlaps, f"overlap reported as success: {overlaps}; {where}"
    lost = lost_hold_violations(sections, round_.terminations, completed)
    assert not lost, f"a lost hold reported as success: {lost}; {where}"
    recorded = admin.execute("SELECT run_id FROM pglock.completions WHERE key_name = %s", [round_.key.name]).fetchall()
    for (run_id,) in recorded:
        assert int(run_id[1:]) in completed, f"completion recorded for a run that did not succeed: {where}"
    if round_.once_per is not None:
        assert len(recorded) <= 1, where
        assert len(completed) <= 1, f"two runs completed one once_per period: {where}"
    finals = admin.execute(
        "SELECT worker FROM race_rows WHERE round = %s AND note <> 'before commit'", [round_.number]
    ).fetchall()
    for (worker,) in finals:
        assert worker in completed, f"the lock transaction of a failed run committed: {where}"
    deadline = time.monotonic() + 5  # a closed session's backend exits asynchronously
    while True:
        left = admin.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = %s", [round_.key.pg_locks[1]]
        ).fetchone()
        if left == (0,) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert left == (0,), f"an advisory lock outlived its round: {where}"


def test_random_faults_never_report_an_overlap_or_record_without_the_lock(
    fault_server: FaultServer, fault_admin: Any
) -> None:
    seed = race_seed()
    print(f"\nPGLOCK_RACE_SEED={seed} PGLOCK_RACE_ROUNDS={ROUNDS}")
    rng = random.Random(seed)
    schema.migrate(fault_admin)
    fault_admin.execute(
        "DROP TABLE IF EXISTS race_effects, race_rows;"
        " CREATE TABLE race_effects (round int, worker int, phase text, at timestamptz);"
        " CREATE TABLE race_rows (round int, worker int, note text)"
    )
    faults_seen: dict[str, int] = {}
    outcomes_seen: dict[str, int] = {}
    for number in range(ROUNDS):
        round_ = _plan_round(rng, number, seed)
        threads = [threading.Thread(target=_run_worker, args=(fault_server, round_, plan)) for plan in round_.plans]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
            assert not thread.is_alive(), f"seed {seed}, round {number}: a worker hangs"
        for killer in round_.killers:
            assert killer.join(timeout=60), f"seed {seed}, round {number}: a fault hangs"
        _check_round(fault_admin, round_, seed)
        for plan in round_.plans:
            faults_seen[plan.fault] = faults_seen.get(plan.fault, 0) + 1
            outcome = str(round_.outcomes.get(plan.worker))
            outcomes_seen[outcome] = outcomes_seen.get(outcome, 0) + 1
    print(f"faults {faults_seen}; outcomes {outcomes_seen}")
    assert assert_nothing_left(fault_admin) == ([], []), f"seed {seed}"
    # The mix really happened: every outcome the faults can cause was seen.
    assert {"completed", "lost", "skipped"} <= set(outcomes_seen), outcomes_seen
    fault_admin.execute("DROP TABLE race_effects, race_rows")
