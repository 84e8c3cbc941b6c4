"""The key-name registry's write at release never holds the release up (issue "Lock lifetime
correctness, round two", row 4).

The write travels with the release (the unlock, or the commit in transaction mode). A
manual-commit client with an uncommitted ``UPDATE pglock.key_names ...`` (the slots how-to's
own command), or an ``init-db`` ``ALTER`` queued behind a reader, used to block every release
of that name with no limit; in transaction mode the key stayed held and the work uncommitted
meanwhile. Now the write waits at most a short bound; a skipped write is a warning naming the
key, and the unlock, the commit and the release's NOTIFY all happen.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from airflow_pglock.guard import LockGuard
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.keys import LockKey
from airflow_pglock.pg import key_names, schema, wakeups
from airflow_pglock.policy import LockPolicy
from tests.faults.conftest import FaultServer
from tests.helpers import advisory_locks

pytestmark = [pytest.mark.faults]

# Generous: the bound is well under a second; before the fix the release waited for ever.
RELEASE_DEADLINE = 30.0


@pytest.fixture
def registry(fault_server: FaultServer, fault_admin: psycopg.Connection[Any]) -> Iterator[str]:
    schema.migrate(fault_admin)
    fault_admin.execute("CREATE TABLE IF NOT EXISTS work_done (id int)")
    try:
        yield fault_server.dsn
    finally:
        fault_admin.execute("DROP SCHEMA pglock CASCADE")
        fault_admin.execute("DROP TABLE work_done")


def _guard(dsn: str, name: str, mode: str, slots: int, logger: logging.Logger) -> LockGuard:
    return LockGuard(
        AdvisoryLockHook(dsn=dsn).database, LockKey.from_name(name), LockPolicy(mode=mode, slots=slots), logger=logger
    )


def _release_in_thread(guard: LockGuard) -> tuple[threading.Thread, threading.Event, list[BaseException]]:
    """Enter the guard (here), do the work, and end the block in a thread (the release may block)."""
    handle = guard.__enter__()
    if handle.connection is not None:  # transaction mode: the work runs in the lock's transaction
        handle.connection.execute("INSERT INTO work_done VALUES (1)")
    ended, errors = threading.Event(), []

    def leave() -> None:
        try:
            guard.__exit__(None, None, None)
        except BaseException as error:  # reported by the test
            errors.append(error)
        finally:
            ended.set()

    thread = threading.Thread(target=leave, daemon=True)
    thread.start()
    return thread, ended, errors


def _listener(dsn: str) -> psycopg.Connection[Any]:
    conn = psycopg.connect(dsn, autocommit=True, application_name="pglock-tests listener")
    conn.execute(f"LISTEN {wakeups.RELEASED_CHANNEL}")
    return conn


def _announced(conn: psycopg.Connection[Any], key: LockKey, timeout: float = RELEASE_DEADLINE) -> bool:
    wanted = wakeups.payload(key)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for notice in conn.notifies(timeout=max(0.1, deadline - time.monotonic()), stop_after=1):
            if notice.payload == wanted:
                return True
    return False


@pytest.mark.parametrize("mode", ["session", "transaction"])
@pytest.mark.parametrize("slots", [1, 3])
def test_an_uncommitted_registry_update_does_not_hold_up_the_release(
    registry: str, fault_admin: psycopg.Connection[Any], caplog: Any, mode: str, slots: int
) -> None:
    name = f"reg-blocked-{mode}-{slots}"
    logger = logging.getLogger("pglock-test-registry-block")
    first = _guard(registry, name, mode, slots, logger)
    first.__enter__()
    first.__exit__(None, None, None)  # a first hold records the name (and the pool's size)
    assert [n.name for n in key_names.registered_names(fault_admin) or [] if n.name == name] == [name]
    # The how-to's command in a manual-commit client (psql with AUTOCOMMIT off, a GUI), not yet committed.
    manual = psycopg.connect(registry, application_name="pglock-tests manual client")
    listener = _listener(registry)
    try:
        manual.execute("UPDATE pglock.key_names SET slots = NULL WHERE name = %s", [name])
        guard = _guard(registry, name, mode, slots, logger)
        with caplog.at_level(logging.WARNING, logger=logger.name):
            thread, ended, errors = _release_in_thread(guard)
            released = ended.wait(RELEASE_DEADLINE)
            # While the other transaction is still open: the key is free, the work committed.
            locks_meanwhile = [lock for lock in advisory_locks(fault_admin) if lock[0] != manual.info.backend_pid]
            committed = fault_admin.execute("SELECT count(*) FROM work_done").fetchone()
            announced = _announced(listener, LockKey.from_name(name), 5 if mode == "session" else 1)
            manual.rollback()
            thread.join(RELEASE_DEADLINE)
    finally:
        manual.close()
        listener.close()
    assert released, "the release waited for the other client's transaction"
    assert errors == []
    assert guard.outcome == "completed"
    assert locks_meanwhile == []
    assert committed == ((1,) if mode == "transaction" else (0,))
    # A session lock's unlock announces the release (a transaction lock's commit never did: its
    # waiters see the key free at their next poll).
    assert announced == (mode == "session"), "the release was not announced on pglock_released"
    assert f"skipped recording the name of key {name!r}" in caplog.text


@pytest.mark.parametrize("mode", ["session", "transaction"])
def test_an_init_db_alter_queued_behind_a_reader_does_not_hold_up_the_release(
    registry: str, fault_admin: psycopg.Connection[Any], caplog: Any, mode: str
) -> None:
    name = f"reg-alter-{mode}"
    logger = logging.getLogger("pglock-test-registry-alter")
    guard = _guard(registry, name, mode, 1, logger)
    reader = psycopg.connect(registry, application_name="pglock-tests reader")
    alter = psycopg.connect(registry, application_name="pglock-tests init-db")
    listener = _listener(registry)
    altering = threading.Thread(
        target=lambda: alter.execute("ALTER TABLE pglock.key_names ADD COLUMN later_version integer"), daemon=True
    )
    try:
        with caplog.at_level(logging.WARNING, logger=logger.name):
            handle = guard.__enter__()
            reader.execute("SELECT count(*) FROM pglock.key_names")  # a long report: its transaction stays open
            altering.start()
            _wait_for_lock_wait(fault_admin, alter.info.backend_pid)  # the ALTER queues behind the reader
            if handle.connection is not None:
                handle.connection.execute("INSERT INTO work_done VALUES (1)")
            ended, errors = threading.Event(), []

            def leave() -> None:
                try:
                    guard.__exit__(None, None, None)
                except BaseException as error:
                    errors.append(error)
                finally:
                    ended.set()

            threading.Thread(target=leave, daemon=True).start()
            released = ended.wait(RELEASE_DEADLINE)
            locks_meanwhile = [
                lock for lock in advisory_locks(fault_admin) if lock[0] not in (reader.info.backend_pid,)
            ]
            committed = fault_admin.execute("SELECT count(*) FROM work_done").fetchone()
            announced = _announced(listener, LockKey.from_name(name), 5 if mode == "session" else 1)
            reader.rollback()
            altering.join(RELEASE_DEADLINE)
            alter.rollback()
            ended.wait(RELEASE_DEADLINE)
    finally:
        reader.close()
        alter.close()
        listener.close()
    assert released, "the release waited behind the queued ALTER"
    assert errors == [] and guard.outcome == "completed"
    assert locks_meanwhile == []
    assert committed == ((1,) if mode == "transaction" else (0,))
    assert announced == (mode == "session")
    assert f"skipped recording the name of key {name!r}" in caplog.text


def _wait_for_lock_wait(admin: psycopg.Connection[Any], pid: int) -> None:
    deadline = time.monotonic() + RELEASE_DEADLINE
    while time.monotonic() < deadline:
        row = admin.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone()
        if row is not None and row[0] == "Lock":
            return
        time.sleep(0.02)
    raise AssertionError(f"session {pid} never waited for a lock")


def test_a_release_never_commits_a_transaction_the_caller_left_open(
    registry: str, fault_admin: psycopg.Connection[Any]
) -> None:
    """A session lock's connection with a transaction the caller opened and did not commit (the
    work raised, or forgot): the release with the registry's write must not COMMIT it. It would
    make work committed that the close was to roll back, and visible only after the key was free."""
    hook = AdvisoryLockHook(dsn=registry)
    held = hook.acquire("open-transaction-at-release")
    assert held is not None
    held.connection.execute("BEGIN")
    held.connection.execute("INSERT INTO work_done VALUES (7)")
    assert held.release()  # the key was held to the end
    count = fault_admin.execute("SELECT count(*) FROM work_done WHERE id = 7").fetchone()
    assert count is not None and count[0] == 0, "the release committed the caller's open transaction"
    assert advisory_locks(fault_admin) == []
