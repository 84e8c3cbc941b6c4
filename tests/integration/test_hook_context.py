"""The hook's ways to hold a lock: ``lock`` (heartbeat, loss is an error), ``lock_session`` (see
test_lock_session.py) and the manual ``acquire`` (no heartbeat: its release says what it found)."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest

from airflow_pglock.exceptions import LockLostError
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.liveness import Liveness
from tests.helpers import advisory_locks


def _terminate(admin: Any, pid: int) -> None:
    admin.execute("SELECT pg_terminate_backend(%s)", [pid])
    deadline = time.monotonic() + 10
    while pid in [row[0] for row in advisory_locks(admin)]:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_lock_holds_with_a_heartbeat_and_yields_none_when_busy(hook: AdvisoryLockHook, admin: Any) -> None:
    with hook.lock("ctx-safe") as handle:
        assert handle is not None and handle.lost is None
        [(pid, *_)] = advisory_locks(admin)
        assert pid == handle.backend_pid
        with hook.lock("ctx-safe") as busy:
            assert busy is None
    assert advisory_locks(admin) == []


def _terminate_aside(dsn: str, pid: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", [pid])


def test_lock_raises_when_the_lock_is_lost_during_the_block(dsn: str, admin: Any) -> None:
    hook = AdvisoryLockHook(dsn=dsn, liveness=Liveness(lease=3))
    started = time.monotonic()
    with pytest.raises(LockLostError, match="ctx-lost"), hook.lock("ctx-lost") as handle:
        assert handle is not None
        # From another thread and connection: the loss is seen at once (the heartbeat's socket watch),
        # and its interruption must not land inside a query of the test's own admin connection.
        threading.Thread(target=_terminate_aside, args=(dsn, handle.backend_pid), daemon=True).start()
        while time.monotonic() - started < 30:  # the heartbeat interrupts this loop
            time.sleep(0.05)
        raise AssertionError("the lost lock did not interrupt the block")
    assert advisory_locks(admin) == []


def test_lock_in_transaction_mode_commits_the_work(hook: AdvisoryLockHook, admin: Any) -> None:
    admin.execute("DROP TABLE IF EXISTS ctx_work; CREATE TABLE ctx_work (n int)")
    with hook.lock("ctx-tx", mode="transaction") as handle:
        assert handle is not None and handle.connection is not None
        handle.connection.execute("INSERT INTO ctx_work VALUES (1)")
    assert admin.execute("SELECT array_agg(n) FROM ctx_work").fetchone()[0] == [1]
    admin.execute("DROP TABLE ctx_work")


def test_acquire_release_says_when_the_lock_was_lost(hook: AdvisoryLockHook, admin: Any) -> None:
    """The manual form has no heartbeat: its release is where a lost lock shows (False)."""
    held = hook.acquire("ctx-unsafe")
    assert held is not None and held.scope == "session"
    _terminate(admin, held.server.backend_pid)
    assert held.release() is False
    assert advisory_locks(admin) == []


def test_acquire_in_transaction_mode_commits_or_rolls_back(hook: AdvisoryLockHook, admin: Any) -> None:
    admin.execute("DROP TABLE IF EXISTS ctx_manual; CREATE TABLE ctx_manual (n int)")
    held = hook.acquire("ctx-manual", mode="transaction", shared=True)
    assert held is not None and held.scope == "transaction" and held.shared
    held.connection.execute("INSERT INTO ctx_manual VALUES (1)")
    held.commit()  # ends the lock with its transaction
    held.close()
    rolled_back = hook.acquire("ctx-manual", mode="transaction")
    assert rolled_back is not None
    rolled_back.connection.execute("INSERT INTO ctx_manual VALUES (2)")
    rolled_back.release()  # a transaction lock's release is a rollback
    assert admin.execute("SELECT array_agg(n) FROM ctx_manual").fetchone()[0] == [1]
    assert advisory_locks(admin) == []
    admin.execute("DROP TABLE ctx_manual")


def test_the_hook_offers_three_ways_to_hold_a_lock() -> None:
    """lock() (heartbeat), lock_session() (many keys, the same heartbeat) and acquire() (manual)."""
    takes_a_lock = {"lock", "lock_session", "acquire"}
    public = {
        name
        for name in vars(AdvisoryLockHook)
        if not name.startswith("_") and callable(getattr(AdvisoryLockHook, name))
    }
    assert (
        public & {"try_acquire", "acquire_lock", "lock_without_heartbeat", "session_lock", "transaction_lock"} == set()
    )
    assert takes_a_lock <= public
