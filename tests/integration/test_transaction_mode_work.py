"""Transaction mode through the public ``hook.lock(key, mode="transaction")``: what the work may do
on the lock's own connection, and what ends the lock.

The lock is the transaction's: whatever ends that transaction ends the lock, and the block must
then fail as lost (nothing after it committed); what stays inside it completes. Held-up cases of
the second lifetime review (its e4 sketch), kept as regression tests.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import psycopg
import pytest

from airflow_pglock.exceptions import LockLostError
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.keys import LockKey
from tests.helpers import advisory_locks, advisory_locks_once_exited, allow_connections

KEY = "txn-work"

#: The work's statements on the lock's connection, and how the block must end.
CASES: dict[str, tuple[list[str] | str, str]] = {
    "commit-then-begin": (["COMMIT", "BEGIN"], "lost"),
    "commit-and-chain": (["COMMIT AND CHAIN"], "lost"),
    "rollback-and-chain": (["ROLLBACK AND CHAIN"], "lost"),
    # A new transaction that takes the key again holds a lock, but not the guard's.
    "commit-begin-and-take-the-key-again": (["COMMIT", "BEGIN", "SELECT pg_advisory_xact_lock({key})"], "lost"),
    "psycopg-commit": ("commit", "lost"),
    "savepoint-and-rollback-to": (["SAVEPOINT a", "INSERT INTO txn_work VALUES ('dropped')", "ROLLBACK TO a"], "done"),
    "set-local": (["SET LOCAL statement_timeout = '10s'"], "done"),
    "psycopg-transaction-block": ("transaction block", "done"),
    # Session locks only: the transaction's lock stays.
    "unlock-all-session-locks": (["SELECT pg_advisory_unlock_all()"], "done"),
    # An error the work catches (!): outside a savepoint it aborts the transaction, whose locks
    # PostgreSQL releases at the error, not at its later ROLLBACK. It ended as failed.
    "an-error-caught": (["!SELECT 1/0"], "lost"),
    "an-error-caught-in-a-savepoint": (["SAVEPOINT a", "!SELECT 1/0", "ROLLBACK TO a"], "done"),
}


_no_suppression = contextlib.nullcontext()


def _run_work(conn: psycopg.Connection[Any], steps: list[str] | str) -> None:
    if steps == "commit":
        conn.execute("INSERT INTO txn_work VALUES ('before')")
        conn.commit()
    elif steps == "transaction block":
        with conn.transaction():
            conn.execute("INSERT INTO txn_work VALUES ('inside')")
    else:
        for statement in steps:
            with contextlib.suppress(psycopg.errors.DivisionByZero) if statement.startswith("!") else _no_suppression:
                conn.execute(statement.lstrip("!").format(key=LockKey.from_name(KEY).int64))  # type: ignore[arg-type]
    # The lock connection is autocommit outside the lock's transaction: after a psycopg commit()
    # a statement would commit on its own, so 'after' is written only inside a transaction.
    if conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS:
        conn.execute("INSERT INTO txn_work VALUES ('after')")


@pytest.mark.parametrize("case", list(CASES))
def test_what_ends_the_locks_transaction_is_a_loss_and_what_stays_inside_it_completes(
    case: str, hook: AdvisoryLockHook, admin: Any
) -> None:
    steps, expected = CASES[case]
    admin.execute("DROP TABLE IF EXISTS txn_work; CREATE TABLE txn_work (v text)")
    try:
        if expected == "lost":
            with pytest.raises(LockLostError), hook.lock(KEY, mode="transaction") as handle:
                assert handle is not None and handle.connection is not None
                _run_work(handle.connection, steps)
        else:
            with hook.lock(KEY, mode="transaction") as handle:
                assert handle is not None and handle.connection is not None
                _run_work(handle.connection, steps)
        committed = [row[0] for row in admin.execute("SELECT v FROM txn_work ORDER BY v").fetchall()]
        # Never committed after a loss: what ran once the lock's transaction had ended.
        assert ("after" in committed) == (expected == "done"), committed
        if case == "psycopg-commit":
            assert committed == ["before"]  # the work's own commit, while it still held the lock
        assert "dropped" not in committed
        assert advisory_locks(admin) == []
    finally:
        admin.execute("DROP TABLE IF EXISTS txn_work")


def test_a_loss_the_heartbeat_finds_after_the_works_own_commit_never_says_nothing_was_committed(
    dsn: str, admin: Any
) -> None:
    """The work committed on lock.connection and went on: the heartbeat found the key gone, and the
    message ended "nothing written on the lock's connection was committed" next to a committed row."""
    from airflow_pglock.liveness import Liveness

    hook = AdvisoryLockHook(dsn=dsn, liveness=Liveness(3.0))
    admin.execute("DROP TABLE IF EXISTS txn_work; CREATE TABLE txn_work (v text)")
    try:
        with pytest.raises(LockLostError) as lost, hook.lock(KEY, mode="transaction") as handle:
            assert handle is not None and handle.connection is not None
            handle.connection.execute("INSERT INTO txn_work VALUES ('committed by the work')")
            handle.connection.execute("COMMIT")
            deadline = time.monotonic() + 10
            while handle.lost is None and time.monotonic() < deadline:  # the heartbeat finds it (L/3)
                time.sleep(0.05)
            assert handle.lost is not None
        assert admin.execute("SELECT count(*) FROM txn_work").fetchone() == (1,)
        assert "nothing written" not in str(lost.value)
        assert "the guard committed nothing" in str(lost.value)
    finally:
        admin.execute("DROP TABLE IF EXISTS txn_work")


@pytest.mark.parametrize("before_closing", [["INSERT"], ["INSERT", "COMMIT", "BEGIN", "INSERT", "COMMIT"]])
def test_work_that_closes_the_lock_connection_is_lost_and_told_the_guard_committed_nothing(
    hook: AdvisoryLockHook, admin: Any, before_closing: list[str]
) -> None:
    """The work closed lock.connection: the loss said the COMMIT may have committed ("check the
    writes before the work runs again"), although none was sent; what the work committed itself
    (which ends the lock) stays committed, and the message may not say otherwise."""
    admin.execute("DROP TABLE IF EXISTS txn_work; CREATE TABLE txn_work (v text)")
    try:
        with (
            pytest.raises(LockLostError, match="closed before its COMMIT") as lost,
            hook.lock(KEY, mode="transaction") as handle,
        ):
            assert handle is not None and handle.connection is not None
            for step in before_closing:
                handle.connection.execute("INSERT INTO txn_work VALUES ('written')" if step == "INSERT" else step)
            handle.connection.close()
        assert "may have been committed" not in str(lost.value) and "unknown" not in str(lost.value)
        assert "what the work committed itself stays committed; the guard committed nothing" in str(lost.value)
        committed = admin.execute("SELECT count(*) FROM txn_work").fetchone()[0]
        assert committed == before_closing.count("COMMIT")
        assert advisory_locks_once_exited(admin) == []
    finally:
        admin.execute("DROP TABLE IF EXISTS txn_work")


@pytest.mark.parametrize(
    ("statement", "expected"),
    [
        ("COMMIT; BEGIN; INSERT INTO txn_work VALUES ('after'); SELECT pg_sleep(0.5)", "lost"),
        ("INSERT INTO txn_work VALUES ('inside'); SELECT pg_sleep(0.5)", "done"),
    ],
    ids=["ends-the-transaction", "stays-inside"],
)
def test_a_statement_still_running_when_the_block_ends_is_waited_for_and_checked(
    statement: str, expected: str, hook: AdvisoryLockHook, admin: Any
) -> None:
    """A thread of the work still runs a statement on the lock's connection as the block ends
    (the connection is busy, neither in nor out of a transaction): the end waits for it, and a
    statement that ended the lock's transaction makes the block lost, its new transaction
    uncommitted. It was committed unchecked, and the block ended as completed."""
    admin.execute("DROP TABLE IF EXISTS txn_work; CREATE TABLE txn_work (v text)")
    threads: list[threading.Thread] = []
    try:

        def work(conn: psycopg.Connection[Any]) -> None:
            def run() -> None:
                with contextlib.suppress(psycopg.Error):  # the block's end may abort its transaction
                    conn.execute(statement)

            threads.append(threading.Thread(target=run))
            threads[0].start()
            deadline = time.monotonic() + 5
            while conn.info.transaction_status != psycopg.pq.TransactionStatus.ACTIVE:  # sent, running
                assert time.monotonic() < deadline, "the thread's statement did not start"
                time.sleep(0.001)

        if expected == "lost":
            with pytest.raises(LockLostError), hook.lock(KEY, mode="transaction") as handle:
                assert handle is not None and handle.connection is not None
                work(handle.connection)
        else:
            with hook.lock(KEY, mode="transaction") as handle:
                assert handle is not None and handle.connection is not None
                work(handle.connection)
        threads[0].join(10)
        committed = [row[0] for row in admin.execute("SELECT v FROM txn_work ORDER BY v").fetchall()]
        assert committed == ([] if expected == "lost" else ["inside"]), committed
        assert advisory_locks(admin) == []
    finally:
        for thread in threads:
            thread.join(10)
        admin.execute("DROP TABLE IF EXISTS txn_work")


def test_an_error_the_work_caught_outside_a_savepoint_interrupts_it_as_lost(dsn: str, admin: Any) -> None:
    """The key is free from the error on (another holder could take it at once); the heartbeat's
    probe, answered "current transaction is aborted", took that for a live session, and the work
    went on beside the next holder to its end."""
    from airflow_pglock.liveness import Liveness

    hook = AdvisoryLockHook(dsn=dsn, liveness=Liveness(lease=3))
    free_after_the_error: list[bool] = []
    with pytest.raises(LockLostError, match="aborted by an error"), hook.lock(KEY, mode="transaction") as handle:
        assert handle is not None and handle.connection is not None
        with contextlib.suppress(psycopg.errors.DivisionByZero):
            handle.connection.execute("SELECT 1/0")
        free_after_the_error.append(advisory_locks(admin) == [])  # another holder could take it now
        deadline = time.monotonic() + 30  # the heartbeat beats every second
        while time.monotonic() < deadline:
            time.sleep(0.05)
        pytest.fail("the work went on after its lock was gone")
    assert free_after_the_error == [True]
    assert advisory_locks(admin) == []


def test_a_failed_savepoint_keeps_the_lock_across_heartbeats(dsn: str, admin: Any) -> None:
    """An error inside a savepoint leaves the transaction, and its lock, in place: probes are
    answered with an error meanwhile, and the side connection's look says the lock is held."""
    from airflow_pglock.liveness import Liveness

    hook = AdvisoryLockHook(dsn=dsn, liveness=Liveness(lease=3))
    key = LockKey.from_name(KEY)
    admin.execute("DROP TABLE IF EXISTS txn_work; CREATE TABLE txn_work (v text)")
    try:
        with hook.lock(KEY, mode="transaction") as handle:
            assert handle is not None and handle.connection is not None
            conn = handle.connection
            conn.execute("SAVEPOINT a")
            with contextlib.suppress(psycopg.errors.DivisionByZero):
                conn.execute("SELECT 1/0")
            time.sleep(3.5)  # three heartbeats, each answered by an error
            assert not admin.execute("SELECT pg_try_advisory_lock(%s)", [key.int64]).fetchone()[0]
            conn.execute("ROLLBACK TO SAVEPOINT a")
            conn.execute("INSERT INTO txn_work VALUES ('after')")
        assert [row[0] for row in admin.execute("SELECT v FROM txn_work").fetchall()] == ["after"]
        assert advisory_locks(admin) == []
    finally:
        admin.execute("DROP TABLE IF EXISTS txn_work")


def test_a_failed_savepoint_nobody_can_look_at_from_aside_is_given_up_as_unverified(
    dsn: str, admin: Any, pg_server: str
) -> None:
    """The probes are answered with an error (a failed savepoint: the key may still be held) and
    the database takes no new connection, so the side look cannot tell: the heartbeat gives the
    lock up at 2L/3, saying so, rather than trusting an answer that proves nothing. Meanwhile it
    looks again at a pace (``SIDE_LOOK_PAUSE``), not in a loop of refused connections."""
    from airflow_pglock.heartbeat import SIDE_LOOK_PAUSE
    from airflow_pglock.liveness import Liveness

    liveness = Liveness(lease=3)
    hook = AdvisoryLockHook(dsn=dsn, liveness=liveness)
    looks: list[bool | None] = []
    look_aside = hook.database.holds_seen_aside

    def counted_look(held: Any) -> bool | None:
        looks.append(seen := look_aside(held))
        return seen

    hook.database.holds_seen_aside = counted_look  # type: ignore[method-assign]  # counts, the look is real
    server = psycopg.connect(pg_server, autocommit=True)
    try:
        with (
            pytest.raises(LockLostError, match="no side connection could tell"),
            hook.lock(KEY, mode="transaction") as handle,
        ):
            assert handle is not None and handle.connection is not None
            handle.connection.execute("SAVEPOINT a")
            with contextlib.suppress(psycopg.errors.DivisionByZero):
                handle.connection.execute("SELECT 1/0")
            allow_connections(server, admin.info.dbname, False)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                time.sleep(0.05)
            pytest.fail("the heartbeat went on trusting probes answered with an error")
    finally:
        allow_connections(server, admin.info.dbname, True)
        server.close()
    assert advisory_locks(admin) == []
    # The looks fit in the loss deadline (2L/3) since the last answer that counted, one per pause,
    # plus the first and the block's own at its end; a loop without the pause makes hundreds.
    assert looks and set(looks) == {None}, looks
    assert len(looks) <= liveness.loss_deadline / SIDE_LOOK_PAUSE + 2, looks


def test_a_cancel_of_the_heartbeats_own_probe_is_a_loss(dsn: str, admin: Any) -> None:
    """A cancel (``pg_cancel_backend``, a ``statement_timeout``) of the heartbeat's own probe aborts
    the lock's transaction as a work's error would, and frees the key at once: the heartbeat must
    see that, not take the cancel for an answer of a live lock.

    The probe is held up by a lock on the ``pg_locks`` view it reads, taken before its first beat
    (afterwards the lock's transaction holds the view itself), and cancelled while it waits."""
    from airflow_pglock.liveness import Liveness

    hook = AdvisoryLockHook(dsn=dsn, liveness=Liveness(lease=3))
    blocker = psycopg.connect(dsn, autocommit=True, application_name="pglock-tests probe blocker")
    cancelled: list[bool] = []
    try:
        with pytest.raises(LockLostError, match="aborted by an error"), hook.lock(KEY, mode="transaction") as handle:
            assert handle is not None and handle.connection is not None
            pid = handle.connection.info.backend_pid
            blocker.execute("SET lock_timeout = '500ms'")
            blocker.execute("BEGIN")
            blocker.execute("LOCK TABLE pg_catalog.pg_locks IN ACCESS EXCLUSIVE MODE")
            waiting = "SELECT wait_event_type = 'Lock' FROM pg_catalog.pg_stat_activity WHERE pid = %s"
            deadline = time.monotonic() + 10  # the first beat comes a second after the take
            while not admin.execute(waiting, [pid]).fetchone()[0]:
                assert time.monotonic() < deadline, "the heartbeat's probe never waited for pg_locks"
                time.sleep(0.01)
            cancelled.append(admin.execute("SELECT pg_cancel_backend(%s)", [pid]).fetchone()[0])
            key = LockKey.from_name(KEY).int64
            deadline = time.monotonic() + 5  # the signal is sent, not yet handled, when the call returns
            while not (free := admin.execute("SELECT pg_try_advisory_lock(%s)", [key]).fetchone()[0]):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            if free:  # freed by the cancel; the heartbeat's side look waits for pg_locks: give it back
                admin.execute("SELECT pg_advisory_unlock(%s)", [key])
            cancelled.append(free)
            blocker.execute("ROLLBACK")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                time.sleep(0.05)
            pytest.fail("the work went on after its probe was cancelled")
    finally:
        blocker.close()
    assert cancelled == [True, True]
    assert advisory_locks(admin) == []
