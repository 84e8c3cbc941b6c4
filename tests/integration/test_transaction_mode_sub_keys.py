"""Sub-keys beside a transaction lock (``mode="transaction"``) are transaction locks too: what the
work wrote under one is committed before anyone else can take it, and nothing the work does to
session locks, or to the server session behind a pooler, can keep one past the transaction.

With session locks (as before), a sub-key released inside the work, and every sub-key kept to the
end (released just before the lock's COMMIT), could be taken by another job that then read the
lock database without this task's writes; the work's ``pg_advisory_unlock_all()`` freed them
while the task went on as if it held them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from airflow_pglock.guard import LockGuard
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.keys import LockKey
from airflow_pglock.pg.held import HeldLock
from airflow_pglock.policy import LockPolicy

MAIN = LockKey.from_name("txn-sub-keys/main")
SUB = LockKey.from_name("txn-sub-keys/tenant")
ENDED_EARLY = r"no longer held key 'txn-sub-keys/tenant'.*one of its sub-keys"


@pytest.fixture
def table(admin: Any) -> Iterator[str]:
    admin.execute("DROP TABLE IF EXISTS txn_sub_keys")
    admin.execute("CREATE TABLE txn_sub_keys (tenant text)")
    yield "txn_sub_keys"
    admin.execute("DROP TABLE txn_sub_keys")


def _another_job(admin: Any) -> tuple[bool, int]:
    """Whether another job could take the sub-key now, and how many of the work's rows it reads."""
    taken = admin.execute("SELECT pg_try_advisory_lock(%s)", [SUB.int64]).fetchone()[0]
    if taken:
        admin.execute("SELECT pg_advisory_unlock(%s)", [SUB.int64])
    return bool(taken), int(admin.execute("SELECT count(*) FROM txn_sub_keys").fetchone()[0])


def _guard(hook: AdvisoryLockHook) -> LockGuard:
    return LockGuard(hook.database, MAIN, LockPolicy(mode="transaction"))


@pytest.mark.parametrize("how", ["with-block", "release", "release_all"])
def test_a_sub_key_given_back_stays_busy_until_the_transaction_commits(
    how: str, hook: AdvisoryLockHook, admin: Any, table: str
) -> None:
    guard = _guard(hook)
    with guard as handle:
        assert handle.connection is not None
        if how == "with-block":
            with handle.try_lock(SUB) as sub:
                assert sub is not None
                handle.connection.execute("INSERT INTO txn_sub_keys VALUES ('acme')")
        else:
            [sub] = handle.try_lock_many([SUB])
            handle.connection.execute("INSERT INTO txn_sub_keys VALUES ('acme')")
            assert (handle.release(sub) if how == "release" else handle.release_all()) is True
        assert handle.held() == []
        assert _another_job(admin) == (False, 0), "another job took the sub-key before the work's row was committed"
    assert guard.outcome == "completed"
    assert _another_job(admin) == (True, 1)


def test_a_sub_key_kept_to_the_end_is_free_only_once_the_work_is_committed(
    hook: AdvisoryLockHook, admin: Any, table: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[bool, int]] = []
    commit = HeldLock.commit_if_held

    def look_just_before_the_commit(self: HeldLock, record: Callable[[], bool]) -> bool:
        seen.append(_another_job(admin))
        return commit(self, record)

    monkeypatch.setattr(HeldLock, "commit_if_held", look_just_before_the_commit)
    guard = _guard(hook)
    with guard as handle:
        assert handle.connection is not None
        assert [sub.key for sub in handle.try_lock_many([SUB])] == [SUB]
        handle.connection.execute("INSERT INTO txn_sub_keys VALUES ('acme')")
    assert seen == [(False, 0)], "the sub-key was free before the lock's COMMIT"
    assert guard.outcome == "completed"
    assert _another_job(admin) == (True, 1)


def test_the_works_unlock_all_leaves_the_sub_keys_held(hook: AdvisoryLockHook, admin: Any, table: str) -> None:
    guard = _guard(hook)
    with guard as handle:
        assert handle.connection is not None
        with handle.try_lock(SUB) as sub:
            assert sub is not None
            handle.connection.execute("SELECT pg_advisory_unlock_all()")  # session locks only
            assert _another_job(admin) == (False, 0)
            handle.connection.execute("INSERT INTO txn_sub_keys VALUES ('acme')")
    assert guard.outcome == "completed"
    assert _another_job(admin) == (True, 1)


def test_a_failed_work_frees_its_sub_keys_with_the_rollback(hook: AdvisoryLockHook, admin: Any, table: str) -> None:
    guard = _guard(hook)
    with pytest.raises(psycopg.errors.DivisionByZero), guard as handle:
        assert handle.connection is not None
        assert len(handle.try_lock_many([SUB])) == 1
        handle.connection.execute("INSERT INTO txn_sub_keys VALUES ('acme')")
        handle.connection.execute("SELECT 1 / 0")
    assert guard.outcome == "failed"
    assert _another_job(admin) == (True, 0)


def test_a_sub_key_is_taken_once_per_task_even_after_it_was_given_back(
    hook: AdvisoryLockHook, admin: Any, table: str
) -> None:
    """Given back, a transaction lock stays the session's until the commit: taking it again in
    the same task is allowed (nobody else can hold it meanwhile), and the task's own key never is."""
    with _guard(hook) as handle:
        with handle.try_lock(SUB) as first:
            assert first is not None
            with handle.try_lock(SUB) as twice:
                assert twice is None  # held by this task now: busy, as in session mode
        with handle.try_lock(SUB) as again:
            assert again is not None
        assert handle.try_lock_many([MAIN]) == []
    assert _another_job(admin)[0] is True


def test_waiting_triggers_hear_of_the_sub_keys_as_the_transaction_commits(
    hook: AdvisoryLockHook, dsn: str, admin: Any
) -> None:
    from airflow_pglock.pg.wakeups import RELEASED_CHANNEL, payload

    other = LockKey.from_name("txn-sub-keys/kept")
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute(f"LISTEN {RELEASED_CHANNEL}")

        def heard() -> set[str]:
            listener.execute("SELECT 1")  # reads what arrived meanwhile
            return {note.payload for note in listener.notifies(timeout=0.2, stop_after=10)}

        with _guard(hook) as handle:
            with handle.try_lock(SUB) as sub:
                assert sub is not None
            assert len(handle.try_lock_many([other])) == 1
            assert heard() == set(), "announced before the transaction ended the sub-keys"
        assert heard() >= {payload(SUB), payload(other)}


def test_a_sub_key_that_a_savepoint_rollback_ended_is_a_loss_at_its_release(
    hook: AdvisoryLockHook, admin: Any, table: str
) -> None:
    """A transaction lock taken inside a savepoint ends with ``ROLLBACK TO SAVEPOINT`` (psycopg's
    nested ``conn.transaction()`` block that raises): the task would believe it still holds it
    while another job may take it. Its with block ends with LockLostError."""
    from airflow_pglock.exceptions import LockLostError

    guard = _guard(hook)
    with pytest.raises(LockLostError, match="no longer held"), guard as handle:
        conn = handle.connection
        assert conn is not None
        hold = handle.try_lock(SUB)
        with conn.transaction():
            assert hold.__enter__() is not None
            raise psycopg.Rollback()  # the savepoint is rolled back, the key with it
        assert _another_job(admin) == (True, 0), "the server no longer held the sub-key"
        conn.execute("INSERT INTO txn_sub_keys VALUES ('acme')")
        hold.__exit__(None, None, None)
    assert guard.outcome in ("failed", "lost")
    assert _another_job(admin) == (True, 0), "nothing was committed"


def test_a_kept_sub_key_that_a_savepoint_rollback_ended_fails_the_task_as_lost(
    hook: AdvisoryLockHook, admin: Any, table: str
) -> None:
    """Kept to the end (``try_lock_many``), a sub-key that a savepoint's rollback ended is found
    at the task's end: lost, nothing committed."""
    from airflow_pglock.exceptions import LockLostError

    guard = _guard(hook)
    with pytest.raises(LockLostError, match=ENDED_EARLY), guard as handle:
        conn = handle.connection
        assert conn is not None
        with conn.transaction():
            assert len(handle.try_lock_many([SUB])) == 1
            raise psycopg.Rollback()
        assert handle.held() == [SUB]  # as far as the task knows
        conn.execute("INSERT INTO txn_sub_keys VALUES ('acme')")
    assert guard.outcome == "lost"
    assert _another_job(admin) == (True, 0), "nothing was committed"


def test_a_sub_key_taken_before_a_savepoint_outlives_its_rollback(
    hook: AdvisoryLockHook, admin: Any, table: str
) -> None:
    """The usual nesting: a savepoint per tenant inside the tenant's block; its rollback undoes the
    tenant's writes and leaves the key held (it belongs to the enclosing transaction)."""
    guard = _guard(hook)
    with guard as handle:
        conn = handle.connection
        assert conn is not None
        with handle.try_lock(SUB) as sub:
            assert sub is not None
            with conn.transaction():
                conn.execute("INSERT INTO txn_sub_keys VALUES ('dropped')")
                raise psycopg.Rollback()
            assert _another_job(admin) == (False, 0)
            conn.execute("INSERT INTO txn_sub_keys VALUES ('acme')")
    assert guard.outcome == "completed"
    assert _another_job(admin) == (True, 1)


@pytest.mark.parametrize("ending", ["an error the work caught", "the work's own COMMIT"])
def test_a_sub_key_block_that_ends_after_its_transaction_ended_or_aborted_is_a_loss(
    ending: str, hook: AdvisoryLockHook, admin: Any, table: str
) -> None:
    """An error that aborts the transaction ends its locks at once (not at the ROLLBACK), and the
    work's own COMMIT ends them too: a block that goes on and ends normally ran without its key."""
    from airflow_pglock.exceptions import LockLostError

    guard = _guard(hook)
    # The task ends lost (its own key ended with the COMMIT) or failed (its transaction aborted).
    with pytest.raises((LockLostError, psycopg.Error)), guard as handle:
        conn = handle.connection
        assert conn is not None
        # After the COMMIT the key is known gone; in the aborted transaction nothing can be asked
        # (an error in a savepoint would end only the keys taken inside it): its error, never a success.
        expected = (
            (LockLostError, "transaction no longer held")
            if "COMMIT" in ending
            else (
                psycopg.errors.InFailedSqlTransaction,
                "",
            )
        )
        with pytest.raises(expected[0], match=expected[1]), handle.try_lock(SUB) as sub:
            assert sub is not None
            if ending == "the work's own COMMIT":
                conn.execute("COMMIT")
            else:
                with pytest.raises(psycopg.errors.DivisionByZero):
                    conn.execute("SELECT 1 / 0")
            assert _another_job(admin) == (True, 0), "the server ended the sub-key already"
    assert guard.outcome in ("failed", "lost")


@pytest.mark.parametrize("how", ["the block's LockLostError caught", "release() answering False, ignored"])
def test_a_sub_key_ended_early_makes_the_task_lost_whatever_the_work_does_with_the_news(
    how: str, hook: AdvisoryLockHook, admin: Any, table: str
) -> None:
    from airflow_pglock.exceptions import LockLostError

    guard = _guard(hook)
    with pytest.raises(LockLostError, match=ENDED_EARLY), guard as handle:
        conn = handle.connection
        assert conn is not None
        if how.startswith("the block's"):
            hold = handle.try_lock(SUB)
            with conn.transaction():
                assert hold.__enter__() is not None
                raise psycopg.Rollback()
            conn.execute("INSERT INTO txn_sub_keys VALUES ('acme')")
            with pytest.raises(LockLostError):
                hold.__exit__(None, None, None)  # caught by the work, which goes on
        else:
            with conn.transaction():
                [sub] = handle.try_lock_many([SUB])
                raise psycopg.Rollback()
            conn.execute("INSERT INTO txn_sub_keys VALUES ('acme')")
            assert handle.release(sub) is False  # and ignored
        assert handle.sub_key_ended_early == SUB
    assert guard.outcome == "lost"
    assert _another_job(admin) == (True, 0), "nothing was committed"


def test_giving_back_checks_each_key_in_its_own_mode_and_form(hook: AdvisoryLockHook, admin: Any, table: str) -> None:
    """Shared and exclusive, an int64, a pair and a name, in one release: each found as held, and
    each one a savepoint's rollback ended found gone."""
    from airflow_pglock.exceptions import LockLostError

    pair, number, shared_name = LockKey.from_pair(7, 8), LockKey.from_int(424242), LockKey.from_name("txn-sub/s")
    guard = _guard(hook)
    with pytest.raises(LockLostError, match="one of its sub-keys"), guard as handle:
        conn = handle.connection
        assert conn is not None
        kept = handle.try_lock_many([SUB, pair]) + handle.try_lock_many([shared_name, number], shared=True)
        assert len(kept) == 4
        assert handle.release(*kept) is True
        with conn.transaction():
            again = handle.try_lock_many([pair]) + handle.try_lock_many([number], shared=True)
            assert len(again) == 2  # given back, taken again (the same transaction's)
            raise psycopg.Rollback()  # ends the second takes only: the first still hold them
        assert handle.release(*again) is True
        with conn.transaction():
            fresh = handle.try_lock_many([LockKey.from_pair(9, 9)]) + handle.try_lock_many(
                [LockKey.from_int(77)], shared=True
            )
            raise psycopg.Rollback()
        assert handle.release(*fresh) is False
        assert handle.sub_key_ended_early == LockKey.from_pair(9, 9)  # and the task ends lost


def test_a_sub_key_that_a_lock_scope_holds_is_busy_and_stays_taken_until_the_commit(
    hook: AdvisoryLockHook, scopes_db: Any
) -> None:
    """Another run's lock scope holds its key by a row between its tasks: a sub-key of that name is
    busy here. A transaction lock cannot be given back, so the one the statement took stays taken
    by the task's transaction until it ends (the scope's next task waits for it); the free keys of
    the same batch are held. A savepoint rolled back around the take would free it at once, but
    would also undo whatever another thread of the work wrote on the connection meanwhile."""
    from airflow_pglock.pg import scopes
    from tests.helpers import advisory_locks_left

    scoped = LockKey.from_name("txn-sub-keys/scoped")
    taken, _ = scopes.enter(scopes_db, scoped, "f" * 32, "dep: the scope's run", 300)
    assert taken

    def free_to_others(key: LockKey) -> bool:
        got = scopes_db.execute("SELECT pg_try_advisory_xact_lock(%s)", [key.int64]).fetchone()[0]
        return bool(got)  # autocommit: the statement's transaction ends it at once

    guard = _guard(hook)
    with guard as handle:
        with handle.try_lock(scoped) as sub:
            assert sub is None, "the scope holds it: busy"
        assert [sub.key for sub in handle.try_lock_many([scoped, SUB])] == [SUB]
        assert not free_to_others(scoped), "taken by the transaction, unused"
        assert not free_to_others(SUB), "the free key of the batch is held"
        assert handle.held() == [SUB]
    assert guard.outcome == "completed"
    assert free_to_others(scoped)
    assert advisory_locks_left(scopes_db) == 0
