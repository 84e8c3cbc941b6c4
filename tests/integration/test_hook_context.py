"""The hook's context managers: ``lock`` (heartbeat, loss is an error) and the explicitly named
``lock_without_heartbeat``; the old ``session_lock`` / ``transaction_lock`` are deprecated aliases."""

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


def test_lock_without_heartbeat_raises_when_the_lock_was_lost(hook: AdvisoryLockHook, admin: Any) -> None:
    """The trap of the old ``session_lock``: a release that finds the lock gone was ignored."""
    with pytest.raises(LockLostError, match="no longer held"), hook.lock_without_heartbeat("ctx-unsafe") as held:
        assert held is not None
        _terminate(admin, held.server.backend_pid)
    assert advisory_locks(admin) == []


def test_lock_without_heartbeat_keeps_the_error_of_the_block(hook: AdvisoryLockHook, admin: Any) -> None:
    with pytest.raises(RuntimeError, match="work failed"), hook.lock_without_heartbeat("ctx-unsafe") as held:
        assert held is not None
        _terminate(admin, held.server.backend_pid)
        raise RuntimeError("work failed")


def test_session_and_transaction_lock_are_deprecated_aliases(hook: AdvisoryLockHook, admin: Any) -> None:
    with pytest.warns(DeprecationWarning, match=r"hook\.lock\(key, \.\.\.\)"), hook.session_lock("old") as held:
        assert held is not None and held.scope == "session"
    with (
        pytest.warns(DeprecationWarning, match='mode="transaction"'),
        hook.transaction_lock("old", shared=True) as held,
    ):
        assert held is not None and held.scope == "transaction" and held.shared
    with pytest.raises(LockLostError), hook.session_lock("old-lost") as held:
        assert held is not None
        _terminate(admin, held.server.backend_pid)
    assert advisory_locks(admin) == []
