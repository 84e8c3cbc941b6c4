"""The 8-process race of tests/integration/test_concurrency.py, with holders killed at random
inside the protected section: still never two runners inside at once, and the next
contender gets in quickly after each kill.

Each worker records its protected sections (entered/exited, server clock) on its own log
connection. To kill a holder *inside* its section, the test freezes it (SIGSTOP), checks
that its section is still open, stamps the section's end with the server clock, then
SIGKILLs it; it cannot have done anything since the freeze, so that stamp bounds its
section from below while its lock is still held (the kernel closes its socket after the
kill). A replacement worker is forked for each one killed.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from typing import Any

import psycopg
import pytest

from airflow_pglock.exceptions import LockBusyError
from airflow_pglock.guard import LockGuard
from airflow_pglock.handle import LockHandle
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.keys import LockKey
from airflow_pglock.liveness import Liveness
from airflow_pglock.policy import LockPolicy
from tests.faults.conftest import FaultServer

pytestmark = [pytest.mark.faults, pytest.mark.slow]

PROCESSES = 8
DURATION = 15.0
MAX_DURATION = 60.0
MIN_KILLS = 10
KILL_EVERY = 0.3
OVERLAP_SQL = (
    "SELECT a.worker, a.entered, a.exited, b.worker, b.entered, b.exited"
    " FROM stress_runs a JOIN stress_runs b ON a.id < b.id AND a.entered < b.exited AND b.entered < a.exited"
)


def _worker(dsn: str, seed: int, stop: Any) -> None:
    rng = random.Random(seed)
    hook = AdvisoryLockHook(dsn=dsn, liveness=Liveness(6))  # not about the lease: SIGKILL frees at once
    key = LockKey.from_name("stress-kills")
    try:
        with psycopg.connect(dsn, autocommit=True) as log:

            def work(handle: LockHandle) -> None:
                row = log.execute(
                    "INSERT INTO stress_runs (worker, entered) VALUES (%s, clock_timestamp()) RETURNING id",
                    [os.getpid()],
                ).fetchone()
                assert row is not None
                time.sleep(rng.uniform(0.005, 0.04))
                log.execute("UPDATE stress_runs SET exited = clock_timestamp() WHERE id = %s", [row[0]])

            while not stop.value:
                try:
                    LockGuard(hook.database, key, LockPolicy()).run(work)
                except LockBusyError:
                    time.sleep(rng.uniform(0.001, 0.004))
    except BaseException as error:
        with psycopg.connect(dsn, autocommit=True) as report:
            report.execute(
                "INSERT INTO stress_errors VALUES (%s, %s)", [os.getpid(), f"{type(error).__name__}: {error}"]
            )
        raise


def test_random_holder_kills_never_let_two_in(fault_server: FaultServer, fault_admin: Any) -> None:
    fault_admin.execute(
        "DROP TABLE IF EXISTS stress_runs, stress_errors;"
        " CREATE TABLE stress_runs (id serial PRIMARY KEY, worker int, entered timestamptz, exited timestamptz,"
        " killed boolean NOT NULL DEFAULT false);"
        " CREATE TABLE stress_errors (worker int, error text)"
    )
    ctx = multiprocessing.get_context("fork")
    stop = ctx.RawValue("b", 0)  # no lock: a worker killed while holding one would hang the others
    rng = random.Random(1234)
    spawned = 0

    def spawn() -> multiprocessing.process.BaseProcess:
        nonlocal spawned
        spawned += 1
        process = ctx.Process(target=_worker, args=(fault_server.dsn, spawned, stop), daemon=True)
        process.start()
        return process

    workers = {process.pid: process for process in (spawn() for _ in range(PROCESSES))}
    kills = 0
    try:
        # Run for DURATION, and on a slow machine longer (up to MAX_DURATION) until MIN_KILLS holders died inside.
        started = time.monotonic()
        while (elapsed := time.monotonic() - started) < DURATION or (kills < MIN_KILLS and elapsed < MAX_DURATION):
            time.sleep(rng.uniform(0.5, 1.5) * KILL_EVERY)
            open_rows = fault_admin.execute("SELECT worker FROM stress_runs WHERE exited IS NULL").fetchall()
            candidates = [worker for (worker,) in open_rows if worker in workers]
            if not candidates:
                continue
            victim = rng.choice(candidates)
            os.kill(victim, signal.SIGSTOP)
            # Frozen: if its section is still open now, it is inside it, holding the lock.
            stamped = fault_admin.execute(
                "UPDATE stress_runs SET exited = clock_timestamp(), killed = true"
                " WHERE worker = %s AND exited IS NULL RETURNING id",
                [victim],
            ).fetchall()
            if not stamped:
                os.kill(victim, signal.SIGCONT)
                continue
            os.kill(victim, signal.SIGKILL)
            workers.pop(victim).join(10)
            kills += 1
            replacement = spawn()
            workers[replacement.pid] = replacement
    finally:
        stop.value = 1
        for process in workers.values():
            process.join(30)
            if process.is_alive():
                process.kill()
                process.join(10)

    assert fault_admin.execute("SELECT * FROM stress_errors").fetchall() == []
    assert [process.exitcode for process in workers.values()] == [0] * PROCESSES
    assert fault_admin.execute("SELECT count(*) FROM stress_runs WHERE exited IS NULL").fetchone() == (0,)
    overlaps = fault_admin.execute(OVERLAP_SQL).fetchall()
    assert overlaps == [], f"two workers were inside the protected section at once: {overlaps[:5]}"

    runs, runners = fault_admin.execute("SELECT count(*), count(DISTINCT worker) FROM stress_runs").fetchone()
    # After each kill, how long until the next section began (someone was always trying).
    gaps = [
        gap
        for (gap,) in fault_admin.execute(
            "SELECT extract(epoch FROM (SELECT min(b.entered) FROM stress_runs b WHERE b.entered >= a.exited)"
            " - a.exited)::float FROM stress_runs a WHERE a.killed"
        ).fetchall()
        if gap is not None
    ]
    gaps.sort()
    print(
        f"\nMEASURED stress with kills: {runs} sections by {runners} processes, {kills} holders SIGKILLed inside; "
        f"kill -> next section median {gaps[len(gaps) // 2]:.3f} s, max {gaps[-1]:.3f} s"
    )
    assert kills >= MIN_KILLS, f"only {kills} holders were killed inside the section in {MAX_DURATION:g} s"
    assert runs >= 100 and runners >= PROCESSES
    assert gaps and max(gaps) < 2.0
    fault_admin.execute("DROP TABLE stress_runs, stress_errors")
