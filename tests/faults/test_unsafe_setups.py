"""Set-ups where an advisory lock would exclude nobody are refused, never run unprotected:
a session lock through PgBouncer's transaction pooling, a hot standby, a server that is
not PostgreSQL. And through PgBouncer, transaction-level locks work and exclude."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import random
import signal
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from airflow_pglock.exceptions import LockBusyError, LockLostError, PgLockError, UnsafeSetupError
from airflow_pglock.guard import LockGuard
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.keys import LockKey
from airflow_pglock.liveness import Liveness
from airflow_pglock.policy import LockPolicy
from devtools.holder import EXIT_LOST, Holder, HolderConfig
from devtools.pgbouncer import PgBouncer, PgBouncerUnavailableError
from devtools.standby import start_standby
from tests.faults.conftest import FAULT_DATABASE, FaultServer, lock_holder_pids, wait_until_released
from tests.helpers import run_dag, wait_until_no_sessions

pytestmark = [pytest.mark.faults, pytest.mark.slow]

OVERLAP_SQL = (
    "SELECT count(*) FROM bouncer_runs a JOIN bouncer_runs b ON a.id < b.id"
    " AND a.entered < b.exited AND b.entered < a.exited"
)


def _bouncer(fault_server: FaultServer, pool_mode: str) -> Iterator[PgBouncer]:
    try:
        bouncer = PgBouncer(fault_server.cluster.port, pool_mode=pool_mode, pool_size=4)
    except PgBouncerUnavailableError as error:
        pytest.skip(f"PgBouncer is not available: {error}")
    bouncer.start()
    try:
        yield bouncer
    finally:
        bouncer.stop()


@pytest.fixture
def bouncer(fault_server: FaultServer, fault_admin: Any) -> Iterator[PgBouncer]:
    """PgBouncer in transaction pooling (stopped before fault_admin checks for leftovers)."""
    yield from _bouncer(fault_server, "transaction")


@pytest.fixture
def session_bouncer(fault_server: FaultServer, fault_admin: Any) -> Iterator[PgBouncer]:
    yield from _bouncer(fault_server, "session")


def _guard(dsn: str, key: str, mode: str = "session") -> LockGuard:
    hook = AdvisoryLockHook(dsn=dsn, liveness=Liveness(3))
    return LockGuard(hook.database, LockKey.from_name(key), LockPolicy(mode=mode))  # type: ignore[arg-type]


def test_session_lock_through_transaction_pooling_is_refused(bouncer: PgBouncer, fault_admin: Any) -> None:
    guard = _guard(bouncer.dsn_for(FAULT_DATABASE), "bouncer-session")
    with pytest.raises(UnsafeSetupError) as error, guard:
        raise AssertionError("must not run")
    message = str(error.value)
    assert "connection pooler" in message and "mode='transaction'" in message and "pool_mode" in message
    assert guard.outcome == "failed"
    assert fault_admin.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'").fetchone() == (0,)


def test_pgbouncer_admin_console_is_not_postgres(bouncer: PgBouncer) -> None:
    guard = _guard(bouncer.dsn_for("pgbouncer"), "bouncer-admin", mode="transaction")
    with pytest.raises(UnsafeSetupError, match="does not look like PostgreSQL") as error, guard:
        raise AssertionError("must not run")
    assert "bouncer" in str(error.value)  # names what answered: PgBouncer's server_version


def test_session_pooling_declared_in_the_connection_extra_is_accepted(
    session_bouncer: PgBouncer, fault_server: FaultServer
) -> None:
    """A pooler in session pooling is safe; the Airflow connection says so with an extra."""
    conn_uri = {
        "conn_type": "postgres",
        "host": "127.0.0.1",
        "port": session_bouncer.port,
        "login": "postgres",
        "schema": FAULT_DATABASE,
    }
    os.environ["AIRFLOW_CONN_PGLOCK_BOUNCER_UNDECLARED"] = json.dumps(conn_uri)
    os.environ["AIRFLOW_CONN_PGLOCK_BOUNCER_SESSION"] = json.dumps({**conn_uri, "extra": {"pool_mode": "session"}})
    try:
        undeclared = LockGuard(
            AdvisoryLockHook("pglock_bouncer_undeclared").database, LockKey.from_name("b"), LockPolicy()
        )
        with pytest.raises(UnsafeSetupError, match="connection pooler"), undeclared:
            raise AssertionError("must not run")
        declared = AdvisoryLockHook("pglock_bouncer_session", liveness=Liveness(3))
        key = LockKey.from_name("bouncer-session-declared")
        with LockGuard(declared.database, key, LockPolicy()) as handle:
            assert handle.backend_pid > 0
            with pytest.raises(LockBusyError), _guard(fault_server.dsn, "bouncer-session-declared"):
                raise AssertionError("a direct contender must be refused while the pooled session holds the key")
    finally:
        os.environ.pop("AIRFLOW_CONN_PGLOCK_BOUNCER_UNDECLARED")
        os.environ.pop("AIRFLOW_CONN_PGLOCK_BOUNCER_SESSION")


def test_session_pooling_declared_to_a_dsn_hook_is_accepted(
    session_bouncer: PgBouncer, fault_server: FaultServer
) -> None:
    """A hook made from a DSN has no connection extra: ``pool_mode=`` declares the pooler instead."""
    dsn = session_bouncer.dsn_for(FAULT_DATABASE)
    key = LockKey.from_name("bouncer-session-dsn")
    with pytest.raises(UnsafeSetupError, match="connection pooler"), _guard(dsn, "bouncer-session-dsn"):
        raise AssertionError("must not run")
    declared = AdvisoryLockHook(dsn=dsn, liveness=Liveness(3), pool_mode="session")
    with LockGuard(declared.database, key, LockPolicy()) as handle:
        assert handle.backend_pid > 0
        with pytest.raises(LockBusyError), _guard(fault_server.dsn, "bouncer-session-dsn"):
            raise AssertionError("a direct contender must be refused while the pooled session holds the key")


def _bouncer_racer(bouncer_dsn: str, direct_dsn: str, worker: int, seconds: float) -> None:
    """Transaction-mode guards through PgBouncer; records each protected section directly."""
    rng = random.Random(worker)
    hook = AdvisoryLockHook(dsn=bouncer_dsn, liveness=Liveness(3))
    key = LockKey.from_name("bouncer-race")
    with psycopg.connect(direct_dsn, autocommit=True) as log:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                with LockGuard(hook.database, key, LockPolicy(mode="transaction")) as handle:
                    assert handle.connection is not None
                    row = log.execute(
                        "INSERT INTO bouncer_runs (worker, entered) VALUES (%s, clock_timestamp()) RETURNING id",
                        [worker],
                    ).fetchone()
                    # protected work on the lock's own transaction, through the pooler
                    handle.connection.execute("SELECT pg_sleep(%s)", [rng.uniform(0.002, 0.02)])
                    log.execute("UPDATE bouncer_runs SET exited = clock_timestamp() WHERE id = %s", [row[0]])
            except LockBusyError:
                time.sleep(rng.uniform(0.001, 0.005))


def test_transaction_locks_through_pgbouncer_exclude(
    bouncer: PgBouncer, fault_server: FaultServer, fault_admin: Any
) -> None:
    fault_admin.execute(
        "DROP TABLE IF EXISTS bouncer_runs;"
        " CREATE TABLE bouncer_runs (id serial PRIMARY KEY, worker int, entered timestamptz, exited timestamptz)"
    )
    bouncer_dsn = bouncer.dsn_for(FAULT_DATABASE)
    # One long holder through the pooler: its heartbeat runs inside its transaction (lease 3 s,
    # heartbeat every 1 s) and a contender, through the pooler too, is refused meanwhile.
    with _guard(bouncer_dsn, "bouncer-long", mode="transaction") as handle:
        time.sleep(2.5)
        assert handle.lost is None
        with pytest.raises(LockBusyError), _guard(bouncer_dsn, "bouncer-long", mode="transaction"):
            raise AssertionError("must not run")
    ctx = multiprocessing.get_context("fork")
    workers = [ctx.Process(target=_bouncer_racer, args=(bouncer_dsn, fault_server.dsn, n, 3.0)) for n in range(4)]
    for process in workers:
        process.start()
    for process in workers:
        process.join(60)
    assert [process.exitcode for process in workers] == [0] * 4
    runs, workers_seen = fault_admin.execute("SELECT count(*), count(DISTINCT worker) FROM bouncer_runs").fetchone()
    print(f"\nMEASURED PgBouncer transaction pooling: {runs} protected sections by {workers_seen} workers in 3 s")
    assert runs > 20 and workers_seen >= 2
    assert fault_admin.execute("SELECT count(*) FROM bouncer_runs WHERE exited IS NULL").fetchone() == (0,)
    assert fault_admin.execute(OVERLAP_SQL).fetchone() == (0,), "two workers were inside at once through PgBouncer"
    fault_admin.execute("DROP TABLE bouncer_runs")


def test_standby_is_refused(fault_server: FaultServer, fault_admin: Any) -> None:
    standby = start_standby(fault_server.cluster)
    try:
        dsn = standby.dsn_for(FAULT_DATABASE)
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert conn.execute("SELECT pg_is_in_recovery()").fetchone() == (True,)
        for mode in ("session", "transaction"):
            with pytest.raises(UnsafeSetupError, match="standby in recovery") as error, _guard(dsn, "standby", mode):
                raise AssertionError("must not run")
            assert "primary" in str(error.value)
        _reads_of_who_holds_are_refused(dsn, fault_server)
        with psycopg.connect(dsn, autocommit=True) as conn:
            # A closed client's backend exits a moment later (a 2.11 CI leg under load saw it still there).
            left = wait_until_no_sessions(conn)
            assert left == [], f"the refused lock connections were left open on the standby: {left}"
    finally:
        standby.destroy()


def _reads_of_who_holds_are_refused(standby_dsn: str, fault_server: FaultServer) -> None:
    """Review -59: hook.holders() (the sensor's poke), aholders() and the triggers' poll read the
    standby's pg_locks, which hold none of the primary's locks: a key held on the primary was
    reported free there, and the sensor succeeded while it was held."""
    import asyncio

    from airflow_pglock.pg import wakeups

    key = LockKey.from_name("standby-read")
    primary = AdvisoryLockHook(dsn=fault_server.cluster.dsn_for(FAULT_DATABASE))
    on_standby = AdvisoryLockHook(dsn=standby_dsn)

    async def triggers_poll() -> Any:
        async with await psycopg.AsyncConnection.connect(standby_dsn, autocommit=True) as conn:
            return await wakeups.aheld(conn, [key.pg_locks])

    with primary.lock(key) as held:
        assert held is not None
        for read in (
            lambda: on_standby.holders(key),
            lambda: asyncio.run(on_standby.aholders(key)),
            lambda: asyncio.run(triggers_poll()),
        ):
            with pytest.raises(UnsafeSetupError, match=r"standby in recovery: .* every key would look free"):
                read()
        # The triggerer's hub (review -62: LISTEN fails on a standby, and the hub reconnected every
        # second until the trigger's deadline, never saying why): its waiters report the standby once
        # the first-connect grace (30 s: a standby being promoted) has passed without a primary.
        from airflow_pglock.triggers.advisory_lock import AdvisoryLockTrigger

        async def first_event(trigger: AdvisoryLockTrigger) -> dict[str, Any]:
            async for event in trigger.run():
                return dict(event.payload)
            raise AssertionError("the trigger ended without an event")

        os.environ["AIRFLOW_CONN_PGLOCK_ON_A_STANDBY"] = standby_dsn
        try:
            trigger = AdvisoryLockTrigger.for_key(
                key, postgres_conn_id="pglock_on_a_standby", poll_interval=60, deadline=time.time() + 120, resume_hold=0
            )
            event = asyncio.run(asyncio.wait_for(first_event(trigger), 60))
            assert event["status"] == "error" and "standby in recovery" in event["message"], event

            # A standby promoted within the grace (a failover under way) is waited for (review -63:
            # one look at it failed every waiting trigger at once).
            async def promoted_meanwhile() -> dict[str, Any]:
                waiting = asyncio.ensure_future(first_event(again))
                await asyncio.sleep(3)
                assert not waiting.done(), "the hub gave up on a standby before the grace"
                with psycopg.connect(standby_dsn, autocommit=True) as standby:
                    standby.execute("SELECT pg_promote()")
                return await asyncio.wait_for(waiting, 60)

            again = AdvisoryLockTrigger.for_key(
                key, postgres_conn_id="pglock_on_a_standby", poll_interval=60, deadline=time.time() + 120, resume_hold=0
            )
            event = asyncio.run(promoted_meanwhile())
            assert event["status"] == "free", event  # the key is held on the old primary only
        finally:
            del os.environ["AIRFLOW_CONN_PGLOCK_ON_A_STANDBY"]


def test_frozen_holder_through_pgbouncer_loses_its_lock_within_the_lease(
    bouncer: PgBouncer, fault_server: FaultServer, fault_admin: Any
) -> None:
    """The lease works through the pooler: the server ends the frozen client's transaction
    (idle_in_transaction_session_timeout, set with SET LOCAL), which frees the lock."""
    lease = 3.0
    config = HolderConfig(bouncer.dsn_for(FAULT_DATABASE), "bouncer-frozen", lease=lease, mode="transaction")
    with Holder(config) as holder:
        pid = holder.wait_for("acquired", 30)["backend_pid"]
        assert pid in lock_holder_pids(fault_admin)  # the server-side pid, behind PgBouncer
        time.sleep(1.5)
        frozen = holder.signal(signal.SIGSTOP)
        released = wait_until_released(fault_admin, pid, lease + 5)
        assert released is not None, "the server kept the frozen pooled holder's lock"
        print(f"\nMEASURED SIGSTOP through PgBouncer (transaction) -> server releases: {released - frozen:.3f} s")
        assert released - frozen <= lease + 1.0
        holder.signal(signal.SIGCONT)
        outcome = holder.wait_for("outcome", 10)
        assert outcome["outcome"] == "lost", outcome
        assert holder.join(10) == EXIT_LOST


def _sub_key_held(fault_admin: Any, key: LockKey) -> bool:
    row = fault_admin.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = %s::bigint::oid", [key.pg_locks[1]]
    ).fetchone()
    return row != (0,)


@pytest.mark.parametrize("work_error", ["caught by the work", "raised by the work"])
def test_transaction_mode_sub_keys_never_outlive_an_aborted_transaction(
    bouncer: PgBouncer, fault_server: FaultServer, fault_admin: Any, work_error: str
) -> None:
    """In transaction mode the sub-keys are transaction locks, on the server session PgBouncer lends
    for the lock's transaction: a transaction the work's own SQL error aborted ends them with its
    rollback, before PgBouncer passes that session on (they were session locks once, which an
    aborted transaction could not unlock)."""
    hook = AdvisoryLockHook(dsn=bouncer.dsn_for(FAULT_DATABASE), liveness=Liveness(3))
    sub_key = LockKey.from_name("bouncer-sub-key")
    guard = LockGuard(hook.database, LockKey.from_name("bouncer-tx"), LockPolicy(mode="transaction"))
    # A work that raised fails with its own error; one that caught it is lost: the aborted
    # transaction ended the lock at the error (tests/integration/test_transaction_mode_work.py).
    expected = psycopg.errors.DivisionByZero if work_error.startswith("raised") else LockLostError
    with pytest.raises(expected), guard as handle:
        assert handle.connection is not None
        held = handle.try_lock(sub_key)
        assert held.__enter__() is not None  # held past the work's end (its block never exits)
        if work_error.startswith("caught"):
            with pytest.raises(psycopg.errors.DivisionByZero):
                handle.connection.execute("SELECT 1 / 0")
        else:
            handle.connection.execute("SELECT 1 / 0")
    assert guard.outcome == ("failed" if work_error.startswith("raised") else "lost")
    assert not _sub_key_held(fault_admin, sub_key), "the sub-key stayed held by a pooled server session"


def test_transaction_mode_sub_keys_end_with_the_works_own_commit_through_a_transaction_pooler(
    bouncer: PgBouncer, fault_server: FaultServer, fault_admin: Any
) -> None:
    """A COMMIT in the work (documented misuse, reported lost) hands the server session PgBouncer
    lent for the lock's transaction back to the pool, where another client's transaction may be
    given it at once. Session-lock sub-keys went with it, held by a pooled session nobody owned
    (reproduced with PgBouncer 1.18); transaction locks end with that COMMIT."""
    hook = AdvisoryLockHook(dsn=bouncer.dsn_for(FAULT_DATABASE), liveness=Liveness(3))
    sub_key, batch_key = LockKey.from_name("bouncer-committed-sub-key"), LockKey.from_name("bouncer-committed-batch")
    guard = LockGuard(hook.database, LockKey.from_name("bouncer-tx-commit"), LockPolicy(mode="transaction"))
    with contextlib.ExitStack() as stack:
        other = stack.enter_context(psycopg.connect(bouncer.dsn_for(FAULT_DATABASE), autocommit=True))
        with pytest.raises(PgLockError), guard as handle:
            assert handle.connection is not None
            assert handle.try_lock(sub_key).__enter__() is not None  # its block never exits
            assert [sub.key for sub in handle.try_lock_many([batch_key])] == [batch_key]
            assert _sub_key_held(fault_admin, sub_key) and _sub_key_held(fault_admin, batch_key)
            handle.connection.execute("COMMIT")
            # Another client's transaction is given the server session just freed (PgBouncer
            # reuses the last one freed), so the guard's next statements run on another.
            stack.enter_context(other.transaction())
            other.execute("SELECT 1")
        assert guard.outcome == "lost"
    for key in (sub_key, batch_key):
        assert not _sub_key_held(fault_admin, key), f"{key.describe()} stayed held by a pooled server session"


STANDBY_DAG = """
import datetime as dt

import pendulum
from airflow.sdk import dag, task


@dag(dag_id="on_a_standby", schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False,
     default_args={"retries": 1, "retry_delay": dt.timedelta(0)})
def on_a_standby():
    @task.advisory_lock(postgres_conn_id="pglock_standby", key="standby-task")
    def retried():
        raise AssertionError("must not run")

    @task.advisory_lock(postgres_conn_id="pglock_standby", key="standby-task", on_error="skip")
    def skipped():
        raise AssertionError("must not run")

    retried()
    skipped()


on_a_standby_dag = on_a_standby()
"""


def test_a_guarded_task_on_a_standby_fails_and_is_retried(
    fault_server: FaultServer, airflow_db: Any, admin: Any, capfd: Any
) -> None:
    """A standby is often a moment of a failover (an address that still leads to the demoted
    server, or to a standby not yet promoted): the task fails with the reason and Airflow's retries
    apply, as for a lock database that cannot be reached (before, it failed without a retry, as a
    setting to fix); on_error="skip" skips it."""
    standby = start_standby(fault_server.cluster)
    os.environ["AIRFLOW_CONN_PGLOCK_STANDBY"] = standby.dsn_for(FAULT_DATABASE)
    try:
        result = run_dag(STANDBY_DAG, "on_a_standby")
    finally:
        os.environ.pop("AIRFLOW_CONN_PGLOCK_STANDBY", None)
        standby.destroy()
    log = "".join(capfd.readouterr())
    assert result.states == {("retried", -1): "failed", ("skipped", -1): "skipped"}, result.states
    assert result.tries[("retried", -1)] == 2, "a standby was not retried"
    assert "StandbyServerError" in log and "standby in recovery" in log
    assert "on_error='skip'" in log


@pytest.mark.parametrize("promoted", [True, False], ids=["promoted-within-the-lease", "never-promoted"])
def test_the_triggerers_hold_hub_on_a_standby_waits_for_a_promotion_within_the_lease(
    fault_server: FaultServer, fault_admin: Any, promoted: bool
) -> None:
    """A deferred task's hold, taken up by the triggerer's hold hub whose first connection finds a
    standby (a failover under way): the hub waits, as the wake-ups do, and takes the key on the
    promoted server, whose replicated row still holds it (before, the hold was given up at once, as
    a setting to fix, and the deferred task was failed). Never promoted, the hold is lost at its
    lease, as for a lock database that cannot be reached."""
    import asyncio
    import uuid

    from airflow_pglock.pg import schema
    from airflow_pglock.scope_rules import HandOver, ScopeRole
    from airflow_pglock.triggers.holds import DeferredHold, HoldHub

    key = LockKey.from_name(f"standby-hold-{promoted}")
    schema.migrate(fault_admin)  # on the primary; the standby's base backup copies it
    holder = uuid.uuid4().hex
    role = ScopeRole(holder=holder, run="dep: dag run", task="op", lease=120.0, hands_over=True)
    LockGuard(AdvisoryLockHook(dsn=fault_server.dsn).database, key, LockPolicy(), scope=role).run(
        lambda handle: HandOver(None)
    )
    standby = start_standby(fault_server.cluster)
    lease = 30.0 if promoted else 4.0
    try:
        on_standby = AdvisoryLockHook(dsn=standby.dsn_for(FAULT_DATABASE))
        hub = HoldHub(lambda: on_standby.open_lock_session(application_name="pglock-test-hub"))
        hold = DeferredHold(key, holder, "dep.op run", lease)

        async def body() -> None:
            async with hub.holding(hold):
                await asyncio.sleep(3)
                assert hold.state == "taking", f"the hub gave the hold up on a standby: {hold.reason}"
                if promoted:
                    with psycopg.connect(standby.dsn_for(FAULT_DATABASE), autocommit=True) as conn:
                        conn.execute("SELECT pg_promote()")
                await asyncio.wait_for(hold.settled.wait(), lease + 30)
                if promoted:
                    assert hold.state == "held", hold.reason
                    assert await hub.end(hold)
                else:
                    assert hold.state == "lost" and "within the lease" in str(hold.reason), hold.reason

        asyncio.run(body())
    finally:
        standby.destroy()
        fault_admin.execute("DROP SCHEMA IF EXISTS pglock CASCADE")
