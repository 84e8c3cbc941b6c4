"""Releases under synchronous replication whose standby does not answer.

The cluster here (started by the test) requires a synchronous standby that never connects:
every commit of a transaction that wrote to the WAL waits for it for ever, as on a primary
whose standby is down (PostgreSQL does not wait for a transaction whose only record is its
commit, such as the unlock's: its ``pg_notify`` gives it an id but writes nothing). A release
must never wait there: not its unlock and announcement, not the key-name registry's row
that travels with it. The records that are the point of a synchronous standby (once_per,
fencing, lock scopes) wait as every other write does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.keys import LockKey
from airflow_pglock.pg import wakeups
from airflow_pglock.pg.key_names import record_key_name, registered_names
from airflow_pglock.pg.schema import migrate
from devtools.pgcluster import Cluster

#: Long enough for any release on a loaded machine; a release stuck on the standby never ends.
HANG = 30.0


@pytest.fixture(scope="module")
def standby_down() -> Iterator[Cluster]:
    cluster = Cluster({"synchronous_commit": "on", "synchronous_standby_names": "'pglock_never_connects'"})
    cluster.init().start()
    try:
        yield cluster
    finally:
        cluster.destroy()


def _sync_rep_waiters(admin: psycopg.Connection[Any]) -> list[int]:
    rows = admin.execute("SELECT pid FROM pg_stat_activity WHERE wait_event = 'SyncRep'").fetchall()
    return [row[0] for row in rows]


def _finishes(cluster: Cluster, work: Callable[[], Any], *, until_a_wait: bool = False) -> tuple[bool, list[int]]:
    """Run ``work`` in a thread: whether it finished within :data:`HANG` (or before the first wait
    for the standby, ``until_a_wait``), and the pids that waited for the standby meanwhile
    (cancelled at the end, so that a stuck ``work`` ends too)."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as error:  # re-raised below, in the test's thread
            failure.append(error)

    thread = threading.Thread(target=run, daemon=True)
    seen: set[int] = set()
    with psycopg.connect(cluster.dsn, autocommit=True) as admin:
        thread.start()
        deadline = time.monotonic() + HANG
        while thread.is_alive() and time.monotonic() < deadline and not (until_a_wait and seen):
            seen.update(_sync_rep_waiters(admin))
            thread.join(0.05)
        finished = not thread.is_alive()
        for pid in _sync_rep_waiters(admin):  # a cancelled wait commits locally, with a warning
            seen.add(pid)
            admin.execute("SELECT pg_cancel_backend(%s)", [pid])
    thread.join(HANG)
    if failure:
        raise failure[0]
    return finished, sorted(seen)


def test_the_cluster_makes_a_write_wait_for_the_standby(standby_down: Cluster) -> None:
    """The control: without it the other tests could pass on a cluster that waits for nothing."""

    def write() -> None:
        with psycopg.connect(standby_down.dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS sync_rep_control ()")

    finished, waited = _finishes(standby_down, write, until_a_wait=True)
    assert not finished and waited


def test_a_guarded_execution_releases_without_waiting_for_the_standby(standby_down: Cluster) -> None:
    key = LockKey.from_name("sync-rep/guarded")
    hook = AdvisoryLockHook(dsn=standby_down.dsn)
    with psycopg.connect(standby_down.dsn, autocommit=True) as listener:
        listener.execute(f"LISTEN {wakeups.RELEASED_CHANNEL}")

        def guarded() -> None:
            with hook.lock(key, application_name="sync-rep test") as handle:
                assert handle is not None

        finished, waited = _finishes(standby_down, guarded)
        notes = list(listener.notifies(timeout=5, stop_after=1))
    assert finished and not waited, f"the release waited for the synchronous standby (pids {waited})"
    assert [wakeups.coordinates(note.payload) for note in notes] == [key.pg_locks]


def test_a_lock_session_releases_its_keys_without_waiting_for_the_standby(standby_down: Cluster) -> None:
    hook = AdvisoryLockHook(dsn=standby_down.dsn)

    def keys_one_by_one() -> None:
        with hook.lock_session(application_name="sync-rep test") as session:
            for n in range(3):
                with session.try_lock(f"sync-rep/session/{n}") as sub:
                    assert sub is not None

    finished, waited = _finishes(standby_down, keys_one_by_one)
    assert finished and not waited, f"a release waited for the synchronous standby (pids {waited})"


def test_the_registry_write_at_release_does_not_wait_for_the_standby(standby_down: Cluster) -> None:
    # init-db itself commits without the standby, here only
    with psycopg.connect(standby_down.dsn, autocommit=True, options="-c synchronous_commit=local") as conn:
        migrate(conn)
    key = LockKey.from_name("sync-rep/registry")
    hook = AdvisoryLockHook(dsn=standby_down.dsn)

    def guarded() -> None:
        with hook.lock(key, application_name="sync-rep test") as handle:
            assert handle is not None

    finished, waited = _finishes(standby_down, guarded)
    assert finished and not waited, f"the release waited for the synchronous standby (pids {waited})"
    with psycopg.connect(standby_down.dsn, autocommit=True) as conn:
        assert [row.name for row in registered_names(conn, [key.pg_locks]) or []] == ["sync-rep/registry"]


def test_a_name_recorded_on_its_own_does_not_wait_for_the_standby(standby_down: Cluster) -> None:
    """The registry's write outside a release (a pool's slot on a registry before init-db 4)."""
    with psycopg.connect(standby_down.dsn, autocommit=True, options="-c synchronous_commit=local") as conn:
        migrate(conn)
    key = LockKey.from_name("sync-rep/recorded-alone")

    def record() -> None:
        with psycopg.connect(standby_down.dsn, autocommit=True) as conn:
            assert record_key_name(conn, key, "sync-rep test") == []

    finished, waited = _finishes(standby_down, record)
    assert finished and not waited, f"the write waited for the synchronous standby (pids {waited})"


def test_what_is_written_to_last_waits_for_the_standby(standby_down: Cluster) -> None:
    """The other side of the promise: a transaction-mode lock's work and a once_per record are
    writes meant to last, and wait for the standby as every other write on that server."""
    from airflow_pglock.guard import LockGuard
    from airflow_pglock.policy import LockPolicy
    from airflow_pglock.run_rules import RunRules

    with psycopg.connect(standby_down.dsn, autocommit=True, options="-c synchronous_commit=local") as conn:
        migrate(conn)
    hook = AdvisoryLockHook(dsn=standby_down.dsn)

    def work_in_the_lock_transaction() -> None:
        with hook.lock("sync-rep/transaction-work", mode="transaction") as handle:
            assert handle is not None and handle.connection is not None
            handle.connection.execute("CREATE TABLE sync_rep_work ()")

    def once_per_record() -> None:
        guard = LockGuard(
            hook.database, LockKey.from_name("sync-rep/once-per"), LockPolicy(), rules=RunRules(period="p")
        )
        with guard:
            pass

    for work in (work_in_the_lock_transaction, once_per_record):
        finished, waited = _finishes(standby_down, work, until_a_wait=True)
        assert waited and not finished, work.__name__
