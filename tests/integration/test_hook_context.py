"""The hook's ways to hold a lock: ``lock`` (heartbeat, loss is an error), ``lock_session`` (see
test_lock_session.py) and the manual ``acquire`` (no heartbeat: its release says what it found)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from airflow_pglock import loss
from airflow_pglock.exceptions import LockLostError
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.liveness import Liveness
from tests.helpers import advisory_locks, advisory_locks_left, relayed, wait_until_no_sessions


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


def _terminate_and_wait_to_be_interrupted(dsn: str, pid: int) -> None:
    """From another thread and connection: the loss is seen at once (the heartbeat's socket watch),
    and its interruption must not land inside a query of the test's own admin connection."""
    started = time.monotonic()
    threading.Thread(target=_terminate_aside, args=(dsn, pid), daemon=True).start()
    while time.monotonic() - started < 30:  # the heartbeat interrupts this loop
        time.sleep(0.05)
    raise AssertionError("the lost lock did not interrupt the block")


def test_lock_raises_when_the_lock_is_lost_during_the_block(dsn: str, admin: Any) -> None:
    hook = AdvisoryLockHook(dsn=dsn, liveness=Liveness(lease=3))
    with pytest.raises(LockLostError, match="ctx-lost"), hook.lock("ctx-lost") as handle:
        assert handle is not None
        _terminate_and_wait_to_be_interrupted(dsn, handle.backend_pid)
    assert advisory_locks(admin) == []


def test_a_loss_whose_reason_cannot_be_refined_still_interrupts_and_says_why(
    dsn: str, admin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Asking the server why (after a terminated session) may fail in an unforeseen way: the loss
    keeps its first reason and the block is still interrupted."""

    def broken(self: Any) -> None:
        raise RuntimeError("a bug while asking the server")

    monkeypatch.setattr("airflow_pglock.pg.database.LockDatabase.server_start", broken)
    hook = AdvisoryLockHook(dsn=dsn, liveness=Liveness(lease=3))
    warnings: list[str] = []
    monkeypatch.setattr(hook.log, "warning", lambda message, *args: warnings.append(message % args))
    with pytest.raises(LockLostError, match="the session was terminated") as lost, hook.lock("ctx-unrefined") as handle:
        assert handle is not None
        _terminate_and_wait_to_be_interrupted(dsn, handle.backend_pid)
    assert "ctx-unrefined" in str(lost.value) and loss.TERMINATED in str(lost.value)  # its first reason
    assert any("could not ask the server why the lock was lost" in line for line in warnings)
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


@pytest.fixture
def far_hook(dsn: str) -> Iterator[AdvisoryLockHook]:
    """A hook whose connections cross a network of 40 ms round trips (a relay): what the client
    sends last (its close) reaches the server 20 ms later."""
    with relayed(dsn, delay=0.02) as (_, relayed_dsn):
        yield AdvisoryLockHook(dsn=relayed_dsn)


def test_a_transaction_locks_release_frees_the_key_before_it_returns(far_hook: AdvisoryLockHook, admin: Any) -> None:
    """The release ends the transaction on the server (a ROLLBACK) before it closes: a contender
    that tries at once finds the key free. A close alone frees it only once the server has read
    it and the backend has exited."""
    for _ in range(3):
        held = far_hook.acquire("ctx-release-now", mode="transaction")
        assert held is not None
        assert held.release() is True
        assert advisory_locks(admin) == []  # asked at once, on a connection already open


def test_a_transaction_lock_whose_work_failed_frees_the_key_before_the_failure_is_reported(
    far_hook: AdvisoryLockHook, admin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failed work's transaction is rolled back on the server, not left to the close: when
    the outcome line says "failed", a contender can take the key."""
    seen_at_report: list[list[Any]] = []
    monkeypatch.setattr(far_hook.log, "error", lambda *args: seen_at_report.append(advisory_locks(admin)))
    for _ in range(3):
        with pytest.raises(ZeroDivisionError), far_hook.lock("ctx-failed-work", mode="transaction") as handle:
            assert handle is not None
            1 / 0  # noqa: B018
    assert seen_at_report == [[], [], []]
    assert advisory_locks_left(admin) == 0


def test_the_rollback_of_a_failed_transaction_waits_for_a_stalled_network_only_so_long(dsn: str, admin: Any) -> None:
    """A path to the server that stalls (a proxy that takes bytes and forwards them 6 s late)
    must not hold up the end of a failed work: the rollback waits its bound (2 s), then the
    connection is closed as before, and the key goes when the server hears of it."""
    with relayed(dsn) as (relay, relayed_dsn):
        hook = AdvisoryLockHook(dsn=relayed_dsn, liveness=Liveness(lease=30))
        with pytest.raises(ZeroDivisionError), hook.lock("ctx-stalled", mode="transaction") as handle:
            assert handle is not None
            relay.delay = 6.0
            started = time.monotonic()
            1 / 0  # noqa: B018
        assert time.monotonic() - started < 6.0  # before the stalled answer could have come
        relay.delay = 0.0
        assert advisory_locks_left(admin, timeout=30) == 0
        assert wait_until_no_sessions(admin, timeout=30) == []


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
