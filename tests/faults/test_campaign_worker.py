"""The fault campaign's holders keep to the rules the checker reads them by (devtools/campaign/workers.py).

A holder that breaks them makes the campaign report what did not happen: a spurious failure,
or an overlap the product never made.
"""

from __future__ import annotations

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
