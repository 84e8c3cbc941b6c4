"""Many processes racing for one key never overlap inside the protected section."""

from __future__ import annotations

import multiprocessing
from typing import Any

import psycopg
import pytest

from airflow_pglock.exceptions import LockBusyError
from airflow_pglock.guard import LockGuard
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.keys import LockKey
from airflow_pglock.policy import LockPolicy

PROCESSES = 8
ROUNDS = 200
FREE_RUNNING_ATTEMPTS = 150
OVERLAP_SQL = (
    "SELECT count(*) FROM protected a JOIN protected b ON a.id < b.id AND a.entered < b.exited AND b.entered < a.exited"
)


def _record(log: psycopg.Connection[Any], phase: str, round_no: int, worker: int, event: str) -> None:
    if event == "enter":
        log.execute(
            "INSERT INTO protected (phase, round, worker, entered) VALUES (%s, %s, %s, clock_timestamp())",
            [phase, round_no, worker],
        )
    else:
        log.execute(
            "UPDATE protected SET exited = clock_timestamp() WHERE phase = %s AND round = %s AND worker = %s",
            [phase, round_no, worker],
        )


def _racer(dsn: str, worker: int, start: Any, tried: Any, errors: Any) -> None:
    try:
        hook = AdvisoryLockHook(dsn=dsn)
        key = LockKey.from_name("race")
        policy = LockPolicy()
        with psycopg.connect(dsn, autocommit=True) as log:
            for round_no in range(ROUNDS):
                start.wait()
                try:
                    with LockGuard(hook.database, key, policy):
                        _record(log, "rounds", round_no, worker, "enter")
                        tried.wait()  # every contender has tried while this one holds the key
                        _record(log, "rounds", round_no, worker, "exit")
                except LockBusyError:
                    tried.wait()
            for attempt in range(FREE_RUNNING_ATTEMPTS):
                try:
                    with LockGuard(hook.database, key, policy):
                        _record(log, "free", attempt, worker, "enter")
                        log.execute("SELECT pg_sleep(0.001)")
                        _record(log, "free", attempt, worker, "exit")
                except LockBusyError:
                    pass
    except BaseException as error:  # report to the parent instead of hanging the barriers
        errors.put(f"worker {worker}: {type(error).__name__}: {error}")
        start.abort()
        tried.abort()


@pytest.mark.slow
def test_racing_processes_never_overlap(dsn: str, admin: Any) -> None:
    admin.execute(
        "DROP TABLE IF EXISTS protected; CREATE TABLE protected (id serial PRIMARY KEY, phase text,"
        " round int, worker int, entered timestamptz, exited timestamptz)"
    )
    ctx = multiprocessing.get_context("fork")
    start, tried, errors = ctx.Barrier(PROCESSES), ctx.Barrier(PROCESSES), ctx.Queue()
    workers = [ctx.Process(target=_racer, args=(dsn, n, start, tried, errors)) for n in range(PROCESSES)]
    for process in workers:
        process.start()
    for process in workers:
        process.join(timeout=240)
    assert errors.empty(), errors.get()
    assert all(process.exitcode == 0 for process in workers)

    runners = admin.execute(
        "SELECT round, count(*) FROM protected WHERE phase = 'rounds' GROUP BY round ORDER BY round"
    ).fetchall()
    assert [count for _, count in runners] == [1] * ROUNDS, "every round has exactly one runner"
    assert admin.execute("SELECT count(*) FROM protected WHERE exited IS NULL").fetchone()[0] == 0
    assert admin.execute("SELECT count(*) FROM protected WHERE phase = 'free'").fetchone()[0] > 0
    assert admin.execute(OVERLAP_SQL).fetchone()[0] == 0, "two workers were inside the protected section at once"
    admin.execute("DROP TABLE protected")
