"""A lock cannot outlive its holder, nor be lost in silence: faults injected into real
processes and a real server, each asserting the outcome, its delay and that nothing is
left behind (the ``fault_admin`` fixture checks sessions and locks after each test).

Delays are measured with ``time.monotonic()`` in the test and in the holder process (one
clock for the whole machine) and asserted against the documented bounds with a margin.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import psycopg
import pytest

from airflow_pglock import loss
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.keys import LockKey
from airflow_pglock.liveness import Liveness
from devtools.campaign.servers import FailoverPair
from devtools.holder import EXIT_COMPLETED, EXIT_ERROR, EXIT_LOST, Holder, HolderConfig
from tests.faults.conftest import FaultServer, lock_holder_pids, wait_until_released

pytestmark = [pytest.mark.faults, pytest.mark.slow]

LEASE = 3.0
INTERVAL = Liveness(LEASE).heartbeat_interval
# Scheduling noise on a loaded 2-core machine; the bounds themselves come from the lease.
MARGIN = 1.0


def measured(name: str, seconds: float) -> None:
    """Print a measurement (visible with ``pytest -s``; docs/failure-modes.md quotes them)."""
    print(f"\nMEASURED {name}: {seconds:.3f} s")


def contender_can_take(dsn: str, key: str) -> bool:
    held = AdvisoryLockHook(dsn=dsn).acquire(LockKey.from_name(key), application_name="pglock contender")
    if held is None:
        return False
    assert held.release() is True
    return True


def test_sigkill_holder_next_contender_acquires_within_2s(fault_server: FaultServer, fault_admin: Any) -> None:
    key = "fault-sigkill"
    with Holder(HolderConfig(fault_server.dsn, key, lease=LEASE)) as holder:
        holder.wait_for("acquired", 30)
        assert not contender_can_take(fault_server.dsn, key)
        killed = holder.signal(signal.SIGKILL)
        hook = AdvisoryLockHook(dsn=fault_server.dsn)
        acquired_at = None
        while time.monotonic() - killed < 5:
            held = hook.acquire(LockKey.from_name(key), application_name="pglock contender")
            if held is not None:
                acquired_at = time.monotonic()
                assert held.release()
                break
            time.sleep(0.01)
        assert acquired_at is not None, "no contender got the lock within 5 s of SIGKILL"
        measured("SIGKILL -> next contender acquires", acquired_at - killed)
        assert acquired_at - killed < 2.0
        assert holder.join(5) == -signal.SIGKILL


_PIPELINE_HOLDER = """
import sys, time
from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
from airflow_pglock.liveness import Liveness

dsn, key, synced = sys.argv[1], sys.argv[2], sys.argv[3] == "synced"
hook = AdvisoryLockHook(dsn=dsn, liveness=Liveness(float(sys.argv[4])))
with hook.lock(key, mode="transaction") as handle, handle.connection.pipeline() as pipeline:
    handle.connection.execute("SELECT 1")
    if synced:
        pipeline.sync()
    print(f"backend pid {handle.backend_pid}", flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("pipeline", ["synced", "unsynced"])
def test_a_holder_frozen_inside_a_pipeline(fault_server: FaultServer, fault_admin: Any, pipeline: str) -> None:
    """docs/failure-modes.md: a pipeline synced and left idle leaves the session idle in its
    transaction, which the server ends at the lease; one with statements sent but not synced keeps it
    active, waiting for the client (as inside COPY), and a frozen holder keeps the key: not bounded."""
    import subprocess
    import sys

    key = f"fault-pipeline-{pipeline}"
    holder = subprocess.Popen(
        [sys.executable, "-c", _PIPELINE_HOLDER, fault_server.dsn, key, pipeline, str(LEASE)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        lines = iter(holder.stdout.readline, "")
        pid = next(int(line.split()[-1]) for line in lines if line.startswith("backend pid "))
        holder.send_signal(signal.SIGSTOP)
        frozen = time.monotonic()
        released = wait_until_released(fault_admin, pid, LEASE + 3)
        if pipeline == "synced":
            assert released is not None and released - frozen <= LEASE + MARGIN
        else:
            assert released is None, "the server ended a session waiting for its client mid-pipeline"
            state = fault_admin.execute("SELECT state, wait_event FROM pg_stat_activity WHERE pid = %s", [pid])
            assert state.fetchone() == ("active", "ClientRead")
    finally:
        holder.kill()
        holder.wait(10)
    assert wait_until_released(fault_admin, pid, 10) is not None


@pytest.mark.parametrize("mode", ["session", "transaction"])
def test_sigstop_holder_server_releases_within_the_lease(
    fault_server: FaultServer, fault_admin: Any, mode: str
) -> None:
    key = f"fault-sigstop-{mode}"
    with Holder(HolderConfig(fault_server.dsn, key, lease=LEASE, mode=mode)) as holder:
        pid = holder.wait_for("acquired", 30)["backend_pid"]
        time.sleep(INTERVAL * 1.5)  # let a heartbeat or two pass: the freeze lands between two of them
        frozen = holder.signal(signal.SIGSTOP)
        released = wait_until_released(fault_admin, pid, LEASE + 5)
        assert released is not None, f"the server still holds the frozen holder's lock after {LEASE + 5} s"
        measured(f"SIGSTOP ({mode}) -> server releases (lease {LEASE:g} s)", released - frozen)
        assert released - frozen <= LEASE + MARGIN
        assert contender_can_take(fault_server.dsn, key)
        # Thawed, the holder learns that its session is gone and fails instead of succeeding.
        holder.signal(signal.SIGCONT)
        outcome = holder.wait_for("outcome", 10)
        assert outcome["outcome"] == "lost", outcome
        assert "lease" in outcome["cause"], outcome
        assert holder.wait_for("interrupted", 1)
        assert holder.join(10) == EXIT_LOST


@pytest.mark.parametrize("mode", ["session", "transaction"])
def test_a_waiter_frozen_as_the_key_is_granted_loses_it_within_the_lease(
    fault_server: FaultServer, fault_admin: Any, mode: str
) -> None:
    """on_busy="wait": the wait runs in a transaction (session locks too), and the key granted
    to a frozen waiter leaves its session idle in that transaction, where idle_session_timeout
    does not apply; nor do TCP keepalives, which a stopped process's kernel answers. Before the
    fix the frozen waiter kept the key for as long as it stayed frozen (20 s and more, lease 3 s)."""
    key = f"fault-frozen-waiter-{mode}"
    numbers = LockKey.from_name(key).numbers
    arguments = ", ".join(["%s"] * len(numbers))
    blocker = psycopg.connect(fault_server.dsn, autocommit=True, application_name="pglock blocker")
    try:
        blocker.execute(f"SELECT pg_advisory_lock({arguments})", numbers)
        config = HolderConfig(fault_server.dsn, key, lease=LEASE, mode=mode, wait_timeout=120, work_seconds=0.5)
        with Holder(config) as waiter:
            asking = f"pglock holder {waiter.pid}"
            waiting_pid = None
            deadline = time.monotonic() + 30
            while waiting_pid is None and time.monotonic() < deadline:
                row = fault_admin.execute(
                    "SELECT a.pid FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
                    "WHERE l.locktype = 'advisory' AND NOT l.granted AND a.application_name = %s",
                    [asking],
                ).fetchone()
                waiting_pid = None if row is None else int(row[0])
                time.sleep(0.02)
            assert waiting_pid is not None, "the waiter never queued for the key"
            waiter.signal(signal.SIGSTOP)
            time.sleep(0.2)  # the stop has landed: the grant below reaches a frozen process
            blocker.execute(f"SELECT pg_advisory_unlock({arguments})", numbers)
            granted = time.monotonic()
            assert waiting_pid in lock_holder_pids(fault_admin), "the key went to the frozen waiter"
            released = wait_until_released(fault_admin, waiting_pid, LEASE + 10)
            assert released is not None, f"the frozen waiter still holds the key {LEASE + 10:g} s after it was granted"
            measured(f"a waiter frozen as the key is granted ({mode}) -> server releases", released - granted)
            assert released - granted <= LEASE + MARGIN
            assert contender_can_take(fault_server.dsn, key)
            # Thawed, it learns that its session is gone: never a success, never the work.
            waiter.signal(signal.SIGCONT)
            outcome = waiter.wait_for("outcome", 10)
            assert outcome["outcome"] in ("error", "lost"), outcome
            assert not any(event["event"] == "acquired" for event in waiter.events), waiter.events
            assert waiter.join(10) in (EXIT_ERROR, EXIT_LOST)
    finally:
        blocker.close()


def test_terminated_session_fails_within_one_heartbeat(fault_server: FaultServer, fault_admin: Any) -> None:
    key = "fault-terminate"
    with Holder(HolderConfig(fault_server.dsn, key, lease=LEASE)) as holder:
        pid = holder.wait_for("acquired", 30)["backend_pid"]
        time.sleep(0.2)  # into the work's loop: the loss is seen at once, it must land where the work can see it
        terminated = time.monotonic()
        assert fault_admin.execute("SELECT pg_terminate_backend(%s)", [pid]).fetchone() == (True,)
        interrupted = holder.wait_for("interrupted", INTERVAL + 5)
        measured("pg_terminate_backend -> work interrupted", interrupted["t"] - terminated)
        assert interrupted["t"] - terminated <= INTERVAL + MARGIN
        outcome = holder.wait_for("outcome", 10)
        assert outcome["outcome"] == "lost"
        assert "terminated by pg_terminate_backend()" in outcome["cause"]
        assert "Another worker may now run the same work" in outcome["error"]
        assert holder.join(10) == EXIT_LOST
        assert contender_can_take(fault_server.dsn, key)


@pytest.mark.parametrize("mode", ["session", "transaction"])
def test_a_session_the_server_ends_is_noticed_at_once_not_at_the_next_heartbeat(
    fault_server: FaultServer, fault_admin: Any, mode: str
) -> None:
    """The default lease (30 s: a heartbeat every 10 s): the server's FATAL on the socket is
    seen by the socket watch, long before the next probe would ask."""
    key = f"fault-terminate-watch-{mode}"
    with Holder(HolderConfig(fault_server.dsn, key, lease=30.0, mode=mode)) as holder:
        pid = holder.wait_for("acquired", 30)["backend_pid"]
        time.sleep(0.2)  # the heartbeat thread is waiting for its first probe
        terminated = time.monotonic()
        assert fault_admin.execute("SELECT pg_terminate_backend(%s)", [pid]).fetchone() == (True,)
        interrupted = holder.wait_for("interrupted", 10)
        measured(f"pg_terminate_backend -> work interrupted (lease 30 s, {mode})", interrupted["t"] - terminated)
        assert interrupted["t"] - terminated <= 1.0 + MARGIN  # the next probe would come ~10 s after acquiring
        outcome = holder.wait_for("outcome", 10)
        assert outcome["outcome"] == "lost"
        assert "terminated" in outcome["cause"], outcome
        assert holder.join(10) == EXIT_LOST


def test_terminated_session_interrupts_work_in_a_non_main_thread(fault_server: FaultServer, fault_admin: Any) -> None:
    key = "fault-terminate-thread"
    with Holder(HolderConfig(fault_server.dsn, key, lease=LEASE, in_thread=True)) as holder:
        pid = holder.wait_for("acquired", 30)["backend_pid"]
        time.sleep(0.2)  # into the work's loop: the loss is seen at once, it must land where the work can see it
        terminated = time.monotonic()
        fault_admin.execute("SELECT pg_terminate_backend(%s)", [pid])
        interrupted = holder.wait_for("interrupted", INTERVAL + 5)
        measured("pg_terminate_backend -> work interrupted (non-main thread)", interrupted["t"] - terminated)
        assert interrupted["t"] - terminated <= INTERVAL + MARGIN
        assert holder.wait_for("outcome", 10)["outcome"] == "lost"
        assert holder.join(10) == EXIT_LOST


def test_on_lost_warn_logs_and_lets_the_work_finish(fault_server: FaultServer, fault_admin: Any) -> None:
    key = "fault-warn"
    config = HolderConfig(fault_server.dsn, key, lease=LEASE, on_lost="warn", work_seconds=INTERVAL * 4)
    with Holder(config) as holder:
        pid = holder.wait_for("acquired", 30)["backend_pid"]
        fault_admin.execute("SELECT pg_terminate_backend(%s)", [pid])
        outcome = holder.wait_for("outcome", INTERVAL * 4 + 10)
        assert outcome["outcome"] == "completed" and outcome["lost"] is True, outcome
        assert not any(event["event"] == "interrupted" for event in holder.events)
        assert holder.join(10) == EXIT_COMPLETED


def _crash_a_backend(fault_server: FaultServer) -> None:
    """SIGKILL an unrelated backend: the postmaster then ends every session and recovers."""
    victim = psycopg.connect(fault_server.dsn, autocommit=True, application_name="pglock crash victim")
    pid = victim.info.backend_pid
    os.kill(pid, signal.SIGKILL)
    victim.close()


@pytest.mark.parametrize("how", ["restart", "immediate", "crash"])
def test_postgres_restart_or_crash_fails_the_task_and_says_so(
    fault_server: FaultServer, fault_admin: Any, how: str
) -> None:
    key = f"fault-restart-{how}"
    with Holder(HolderConfig(fault_server.dsn, key, lease=LEASE)) as holder:
        holder.wait_for("acquired", 30)
        began = time.monotonic()
        if how == "restart":
            fault_server.cluster.restart()  # pg_ctl stop -m fast; start
        elif how == "immediate":
            fault_server.cluster.stop("immediate")
            fault_server.cluster.start()
        else:
            _crash_a_backend(fault_server)
        interrupted = holder.wait_for("interrupted", INTERVAL + 10)
        measured(f"PostgreSQL {how} -> work interrupted", interrupted["t"] - began)
        outcome = holder.wait_for("outcome", 10)
        assert outcome["outcome"] == "lost"
        cause = outcome["cause"]
        assert any(word in cause for word in ("restarted", "shut down", "crashed")), cause
        assert holder.join(10) == EXIT_LOST
    fault_server.wait_until_up()
    assert contender_can_take(fault_server.dsn, key)


def test_a_loss_is_told_from_a_restart_by_the_servers_uptime(fault_server: FaultServer, fault_admin: Any) -> None:
    """The lock statement does not ask the server's start time: after a loss, the server's uptime
    (its own clock) against the time the lock was held (this process's) tells a restart."""
    database = AdvisoryLockHook(dsn=fault_server.dsn).database
    held_since = loss.held_clock()
    time.sleep(0.5)  # more than loss.RESTART_MARGIN
    before = database.server_start()
    assert before is not None and before.uptime > before.seen_at - held_since
    lock_server = before.server
    assert "terminated by pg_terminate_backend()" in loss.refine_with_server_start(
        loss.TERMINATED, before, held_since, lock_server
    )
    fault_server.cluster.restart()
    fault_server.wait_until_up()
    after = database.server_start()
    assert after is not None and after.started_at > before.started_at
    assert after.server == lock_server
    refined = loss.refine_with_server_start(loss.TERMINATED, after, held_since, lock_server)
    when = after.started_at.isoformat(timespec="seconds")
    assert refined == f"the PostgreSQL server restarted at {when} (the lock session ended with it)"


def test_a_loss_after_a_failover_names_the_server_that_answers_now() -> None:
    """A connection string with several hosts leads, after a failover, to another server: its
    uptime (it ran as a standby all along) says nothing about the lock's server, which did not
    simply have its session terminated."""
    pair = FailoverPair().start()
    try:
        hook = AdvisoryLockHook(dsn=pair.dsn())
        held = hook.acquire("faults/failover-wording")
        assert held is not None
        lock_server = held.server.server
        try:
            pair.failover(freeze=False)
            after = hook.database.server_start()
        finally:
            held.connection.close()
        assert after is not None and after.server != lock_server, (lock_server, after)
        assert after.uptime > after.seen_at - held.acquired_clock  # up before the lock: it was the standby
        assert not after.in_recovery
        refined = loss.refine_with_server_start(loss.TERMINATED, after, held.acquired_clock, lock_server)
        assert refined.startswith(
            f"the connection now leads to another address ({after.server}, a primary) than the lock's "
            f"({lock_server}): a failover or switchover"
        ), refined
    finally:
        pair.destroy()


def test_network_cut_server_releases_within_lease_and_holder_fails(fault_server: FaultServer, fault_admin: Any) -> None:
    if fault_server.netns is None:
        pytest.skip(f"no network namespace on this machine: {fault_server.netns_error}")
    netns = fault_server.netns
    key = "fault-netcut"
    config = HolderConfig(fault_server.dsn_from_netns(), key, lease=LEASE, netns=netns.name)
    with Holder(config) as holder:
        pid = holder.wait_for("acquired", 30)["backend_pid"]
        client = fault_admin.execute("SELECT host(client_addr) FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone()
        assert client == (netns.ns_addr,), "the holder must reach the server through the namespace"
        time.sleep(INTERVAL * 1.5)
        cut = time.monotonic()
        netns.cut()
        try:
            interrupted = holder.wait_for("interrupted", LEASE + 5)
            released = wait_until_released(fault_admin, pid, LEASE + 5)
        finally:
            netns.restore()
        assert released is not None, "the server kept the cut-off holder's lock"
        measured(f"network cut -> holder's work interrupted (lease {LEASE:g} s)", interrupted["t"] - cut)
        measured(f"network cut -> server releases (lease {LEASE:g} s)", released - cut)
        # The holder gives up before the server can let another worker in.
        assert interrupted["t"] - cut <= Liveness(LEASE).loss_deadline + MARGIN
        assert interrupted["t"] <= released
        assert released - cut <= LEASE + MARGIN
        outcome = holder.wait_for("outcome", 10)
        assert outcome["outcome"] == "lost"
        assert "no answer from the lock database" in outcome["cause"]
        assert holder.join(10) == EXIT_LOST
    assert lock_holder_pids(fault_admin) == []
    assert contender_can_take(fault_server.dsn, key)
