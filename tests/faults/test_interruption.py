"""How the protected work is interrupted when its lock is lost, in this very process (the
pytest main thread, like Airflow's task runner): what the work sees, what ``finally``
blocks can rely on, and that the interruption cannot escape the guard's own clean-up."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from typing import Any

import psycopg
import pytest

from airflow_pglock.exceptions import LockLostError, LockLostInterrupt
from airflow_pglock.guard import LockGuard
from airflow_pglock.handle import LockHandle
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.interruption import LOST_SIGNAL
from airflow_pglock.keys import LockKey
from airflow_pglock.liveness import Liveness
from airflow_pglock.pg.probe import probe
from airflow_pglock.pg.release import ROLLBACK_WAIT_SECONDS
from airflow_pglock.policy import LockPolicy
from tests.faults.conftest import FaultServer

pytestmark = [pytest.mark.faults, pytest.mark.slow]


def _guard(server: FaultServer, key: str, **policy: Any) -> LockGuard:
    hook = AdvisoryLockHook(dsn=server.dsn, liveness=Liveness(3))
    return LockGuard(hook.database, LockKey.from_name(key), LockPolicy(**policy))


def _terminate_soon(server: FaultServer, pid: int, delay: float = 0.2) -> threading.Thread:
    def terminate() -> None:
        time.sleep(delay)
        with server.admin() as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", [pid])

    thread = threading.Thread(target=terminate, daemon=True)
    thread.start()
    return thread


def test_work_is_interrupted_and_finally_runs_once(fault_server: FaultServer, fault_admin: Any) -> None:
    seen: list[str] = []

    def work(lock: LockHandle) -> None:
        _terminate_soon(fault_server, lock.backend_pid)
        try:
            try:
                time.sleep(30)
            except Exception:  # the interruption is not an Exception: ordinary handlers don't swallow it
                seen.append("caught by except Exception")
        finally:
            seen.append(f"finally: lost={lock.lost is not None}")
            time.sleep(1.5)  # longer than a heartbeat interval: a finally block is not interrupted again
            seen.append("finally completed")

    started = time.monotonic()
    with pytest.raises(LockLostError) as error:
        _guard(fault_server, "interrupt-finally").run(work)
    assert time.monotonic() - started < 10
    assert seen == ["finally: lost=True", "finally completed"]
    assert isinstance(error.value.__cause__, LockLostInterrupt)  # the traceback shows where the work was
    assert "terminated" in error.value.cause


def test_work_waiting_on_a_query_of_its_own_connection_is_interrupted(
    fault_server: FaultServer, fault_admin: Any
) -> None:
    """The work waits on a long query on another connection (psycopg's C wait, the default with
    psycopg[binary]): the loss interrupts it at once, not when the query returns. A resend of
    the interruption every 50 ms kept interrupting psycopg's poll before its 0.1 s interval
    ran out, so psycopg never returned to Python to run the handler (found by the campaign:
    a holder cut off while writing to its store learned of the loss only when the write failed)."""
    seen: list[float] = []
    left: list[psycopg.pq.TransactionStatus] = []

    def work(lock: LockHandle) -> None:
        with psycopg.connect(fault_server.dsn, autocommit=True, application_name="the work's own") as other:
            _terminate_soon(fault_server, lock.backend_pid, delay=0.5)
            started = time.monotonic()
            try:
                other.execute("SELECT pg_sleep(30)")
            finally:
                seen.append(time.monotonic() - started)
                left.append(other.info.transaction_status)
                fault_admin.execute("SELECT pg_terminate_backend(%s)", [other.info.backend_pid])  # its sleep

    with pytest.raises(LockLostError):
        _guard(fault_server, "interrupt-a-query").run(work)
    assert seen and seen[0] < 10, f"the query ran {seen} s before the loss interrupted it"
    # psycopg cancels and drains a query it was waiting on only for KeyboardInterrupt and SystemExit:
    # the work's connection is left with the query in flight (docs/failure-modes.md: close it).
    assert left == [psycopg.pq.TransactionStatus.ACTIVE]


def test_swallowed_interruption_still_fails(fault_server: FaultServer, fault_admin: Any) -> None:
    def work(lock: LockHandle) -> str:
        _terminate_soon(fault_server, lock.backend_pid)
        try:  # noqa: SIM105 - written the way careless code swallows everything
            time.sleep(30)
        except BaseException:
            pass
        return "pretends to have succeeded"

    with pytest.raises(LockLostError, match="this run is marked failed instead of successful"):
        _guard(fault_server, "interrupt-swallowed").run(work)


def test_with_block_form_is_interrupted_too(fault_server: FaultServer, fault_admin: Any) -> None:
    with pytest.raises(LockLostError), _guard(fault_server, "interrupt-with") as lock:
        _terminate_soon(fault_server, lock.backend_pid)
        time.sleep(30)


def test_nested_guards_the_lost_outer_lock_interrupts_the_inner_work(
    fault_server: FaultServer, fault_admin: Any
) -> None:
    outer = _guard(fault_server, "nested-outer")
    inner = _guard(fault_server, "nested-inner")

    def inner_work(lock: LockHandle) -> None:
        time.sleep(30)

    def outer_work(lock: LockHandle) -> None:
        _terminate_soon(fault_server, lock.backend_pid)
        inner.run(inner_work)

    with pytest.raises(LockLostError, match="nested-outer"):
        outer.run(outer_work)
    assert inner.outcome == "failed" and outer.outcome == "lost"


def test_a_child_process_being_started_is_not_orphaned(fault_server: FaultServer, fault_admin: Any) -> None:
    """The loss arrives while Popen waits for its child to exec (BashOperator starting its
    command): the interruption waits until Popen has returned, so the work's clean-up (an
    operator's on_kill) can reach the child."""
    started: list[subprocess.Popen[bytes]] = []

    def work(lock: LockHandle) -> None:
        _terminate_soon(fault_server, lock.backend_pid, delay=0.1)
        # The child sleeps before its exec: Popen waits for it all that time (what a loaded machine does).
        started.append(subprocess.Popen(["sleep", "30"], preexec_fn=lambda: time.sleep(2)))
        time.sleep(30)

    with pytest.raises(LockLostError):
        _guard(fault_server, "interrupt-popen").run(work)
    assert len(started) == 1, "the interruption was raised inside Popen: its child is out of reach"
    started[0].kill()
    started[0].wait()


def test_a_stray_signal_after_the_guard_is_harmless(fault_server: FaultServer, fault_admin: Any) -> None:
    with _guard(fault_server, "stray-signal"):
        pass
    os.kill(os.getpid(), LOST_SIGNAL)  # no guard armed: the handler ignores it
    time.sleep(0.05)


def test_lost_reason_visible_to_the_work_with_warn(fault_server: FaultServer, fault_admin: Any) -> None:
    def work(lock: LockHandle) -> str | None:
        _terminate_soon(fault_server, lock.backend_pid)
        deadline = time.monotonic() + 10
        while lock.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(LockLostError):
            lock.check()
        return lock.lost

    guard = _guard(fault_server, "warn-visible", on_lost="warn")
    reason = guard.run(work)
    assert reason is not None and "terminated" in reason
    assert guard.outcome == "lost"


def test_transaction_mode_loss_rolls_back_the_work(fault_server: FaultServer, fault_admin: Any) -> None:
    fault_admin.execute("DROP TABLE IF EXISTS tx_work; CREATE TABLE tx_work (note text)")

    def work(lock: LockHandle) -> None:
        assert lock.connection is not None
        lock.connection.execute("INSERT INTO tx_work VALUES ('written under the lock')")
        _terminate_soon(fault_server, lock.backend_pid)
        time.sleep(30)

    with pytest.raises(LockLostError):
        _guard(fault_server, "tx-loss", mode="transaction").run(work)
    assert fault_admin.execute("SELECT count(*) FROM tx_work").fetchone() == (0,)
    fault_admin.execute("DROP TABLE tx_work")


def test_transaction_mode_long_statement_is_not_a_loss(fault_server: FaultServer, fault_admin: Any) -> None:
    """While the work runs a statement on the lock's connection, the heartbeat waits (the
    session is active, not idle) instead of calling the lock lost."""

    def work(lock: LockHandle) -> str | None:
        assert lock.connection is not None
        lock.connection.execute("SELECT pg_sleep(3.5)")  # longer than the loss deadline (2 s)
        time.sleep(1.2)  # and a heartbeat after it
        return lock.lost

    assert _guard(fault_server, "tx-long-statement", mode="transaction").run(work) is None


def test_probe_gives_up_on_a_silent_server(fault_server: FaultServer, fault_admin: Any) -> None:
    """The heartbeat's probe is bounded: a server that does not answer (frozen backend)
    is 'no answer' after the timeout, and the connection is closed."""
    hook = AdvisoryLockHook(dsn=fault_server.dsn, liveness=Liveness(3))
    key = LockKey.from_name("frozen-backend")
    held = hook.acquire(key)
    assert held is not None
    try:
        os.kill(held.server.backend_pid, 19)  # SIGSTOP the server process of this session
        started = time.monotonic()
        assert probe(held.connection, key, False, timeout=0.5) == "no answer"
        assert 0.4 < time.monotonic() - started < 3
        assert held.connection.closed
    finally:
        os.kill(held.server.backend_pid, 18)  # SIGCONT
        held.release()
    with pytest.raises(psycopg.OperationalError):
        probe(held.connection, key, False, timeout=0.5)


def test_transaction_mode_loss_fails_even_with_warn(fault_server: FaultServer, fault_admin: Any) -> None:
    """on_lost="warn" skips the interruption, but a lost transaction lock means the work's
    writes were rolled back: the run cannot be reported as a success."""
    fault_admin.execute("DROP TABLE IF EXISTS tx_warn; CREATE TABLE tx_warn (note text)")
    finished: list[bool] = []

    def work(lock: LockHandle) -> None:
        assert lock.connection is not None
        lock.connection.execute("INSERT INTO tx_warn VALUES ('written under the lock')")
        _terminate_soon(fault_server, lock.backend_pid)
        time.sleep(2.0)  # not interrupted (warn)
        finished.append(True)

    with pytest.raises(LockLostError, match="the guard committed nothing; only a COMMIT the work ran itself"):
        _guard(fault_server, "tx-warn", mode="transaction", on_lost="warn").run(work)
    assert finished == [True]
    assert fault_admin.execute("SELECT count(*) FROM tx_warn").fetchone() == (0,)
    fault_admin.execute("DROP TABLE tx_warn")


@pytest.mark.parametrize("mode", ["session", "transaction"])
def test_a_give_back_on_a_silent_server_is_bounded(fault_server: FaultServer, fault_admin: Any, mode: str) -> None:
    """A guard that gives up before its work frees the key with a bounded unlock (transaction mode:
    rollback): a frozen backend (a paused server, a stalled proxy) must not hold up a skip; the
    close frees the key then."""
    hook = AdvisoryLockHook(dsn=fault_server.dsn, liveness=Liveness(3))
    held = hook.acquire(LockKey.from_name(f"give-back-frozen-{mode}"), mode=mode)
    assert held is not None
    pid = held.server.backend_pid
    os.kill(pid, signal.SIGSTOP)
    try:
        giving = threading.Thread(target=held.give_back, daemon=True)
        started = time.monotonic()
        giving.start()
        giving.join(timeout=15)
        took = time.monotonic() - started
        assert not giving.is_alive(), "the give-back waited on the frozen server"
        assert took >= ROLLBACK_WAIT_SECONDS * 0.9 and held.connection.closed, took
    finally:
        os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize("mode", ["session", "transaction"])
def test_an_interruption_landing_as_the_release_begins_still_gives_the_lock_up(
    fault_server: FaultServer, fault_admin: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any, mode: str
) -> None:
    """A signal handler's exception (Airflow's timeout, SIGTERM's handler, Ctrl-C) can land as
    run() enters __exit__, at its first instruction, before any try of its own (CPython runs
    pending handlers at a function's entry). Simulated: an __exit__ that raises as it is called.
    Before the fix the heartbeat went on, the session and the key stayed, and no outcome line
    was logged (review helper-39)."""
    key = f"fault-exit-entry-{mode}"
    guard = _guard(fault_server, key, mode=mode)

    def interrupted_at_entry(*exc: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(guard, "__exit__", interrupted_at_entry)  # run() calls self.__exit__
    caplog.set_level("INFO")
    with pytest.raises(KeyboardInterrupt):
        guard.run(lambda lock: "done")
    assert guard.outcome == "failed", caplog.text
    assert "the clean-up was interrupted before it said how it ended: KeyboardInterrupt" in caplog.text
    assert guard.held is not None and guard.held.connection.closed
    contender = AdvisoryLockHook(dsn=fault_server.dsn).acquire(LockKey.from_name(key))
    assert contender is not None, "the key is free again"
    assert contender.release()
