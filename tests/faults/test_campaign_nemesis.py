"""The nemesis's release check (rule 9 of the campaign's checker) against a real server.

The randomized campaign freezes a waiter only when one happens to wait; here the scene is set:
a guard waits for a key a blocker holds, the nemesis finds and freezes it, the blocker lets the
key go to the frozen waiter, and at the release bound the nemesis looks at what the waiter's
sessions still hold. Before session locks set ``idle_in_transaction_session_timeout`` (0e93fa0)
the look found the key, and rule 9 failed the run.

A second scene freezes a scope's setup while another scope is being written: before a writer
tried the scope horizon's lock instead of waiting for it on the server, its session waited on
until the other writer let go, then for its own lease, and the look found its key.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from airflow_pglock.keys import LockKey
from airflow_pglock.pg import schema, scopes
from devtools.campaign.history import HistoryWriter
from devtools.campaign.nemesis import Nemesis, Target, release_bound
from devtools.campaign.workers import WAIT_TIMEOUT
from tests.faults.conftest import FaultServer

pytestmark = [pytest.mark.faults, pytest.mark.slow]

LEASE = 3.0


class _Pair:
    """The part of the campaign's FailoverPair the nemesis's looks use."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    def primary_dsn(self) -> str:
        return self.dsn


def _waiting_guard(dsn: str, key: str, mode: str, name: str) -> None:
    """A campaign worker's waiting guard (``guard-wait``), as a process of its own."""
    from airflow_pglock.guard import LockGuard
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
    from airflow_pglock.liveness import Liveness
    from airflow_pglock.policy import LockPolicy

    hook = AdvisoryLockHook(dsn=dsn, liveness=Liveness(LEASE), connect_timeout=2)
    policy = LockPolicy(mode=mode, on_busy="wait", wait_timeout=WAIT_TIMEOUT, on_wait_timeout="fail")  # type: ignore[arg-type]
    with contextlib.suppress(Exception):  # thawed, it finds its session gone (test_lock_loss checks how it ends)
        LockGuard(hook.database, LockKey.from_name(key), policy, application_name=name).run(lambda _: time.sleep(0.5))


def _scope_setup(dsn: str, key: str, name: str) -> None:
    """A campaign worker's scope setup (``scope``), as a process of its own."""
    from airflow_pglock.guard import LockGuard
    from airflow_pglock.hooks.advisory_lock import AdvisoryLockHook
    from airflow_pglock.liveness import Liveness
    from airflow_pglock.policy import LockPolicy
    from airflow_pglock.scope_rules import ScopeRole

    hook = AdvisoryLockHook(dsn=dsn, liveness=Liveness(LEASE), connect_timeout=2)
    role = ScopeRole(kind="enter", holder=uuid.uuid4().hex, run=f"{name} run", task="setup", lease=2 * LEASE)
    guard = LockGuard(hook.database, LockKey.from_name(key), LockPolicy(), application_name=name, scope=role)
    with contextlib.suppress(Exception), guard:  # thawed, it finds its session gone
        pass


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _wait_until(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.mark.parametrize("mode", ["session", "transaction"])
def test_the_nemesis_freezes_a_waiter_and_finds_its_key_freed_by_the_release_bound(
    fault_server: FaultServer, fault_admin: Any, tmp_path: Path, mode: str
) -> None:
    key = f"nemesis-frozen-waiter-{mode}"
    numbers = LockKey.from_name(key).numbers
    arguments = ", ".join(["%s"] * len(numbers))
    name = "campaign w7"

    def waiting() -> bool:
        query = (
            "SELECT 1 FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
            " WHERE l.locktype = 'advisory' AND NOT l.granted AND a.application_name = %s"
        )
        return fault_admin.execute(query, [name]).fetchone() is not None

    def granted_to_the_waiter() -> bool:
        query = (
            "SELECT 1 FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
            " WHERE l.locktype = 'advisory' AND l.granted AND a.application_name = %s"
        )
        return fault_admin.execute(query, [name]).fetchone() is not None

    blocker = psycopg.connect(fault_server.dsn, autocommit=True, application_name="pglock blocker")
    process = multiprocessing.get_context("spawn").Process(
        target=_waiting_guard, args=(fault_server.dsn, key, mode, name), daemon=True
    )
    try:
        blocker.execute(f"SELECT pg_advisory_lock({arguments})", numbers)
        process.start()
        assert process.pid is not None
        _wait_until(waiting, 60, "the guard never queued for the key")
        history = HistoryWriter(tmp_path / "nemesis.jsonl")
        nemesis = Nemesis(_Pair(fault_server.dsn), LEASE, lambda: [Target(7, process.pid, None)], {}, history, seed=1)  # type: ignore[arg-type]
        injecting = threading.Thread(target=nemesis.inject, args=("sigstop-waiter",))
        injecting.start()
        _wait_until(lambda: _state(process.pid) == "T", WAIT_TIMEOUT, "the nemesis did not freeze the waiter")
        blocker.execute(f"SELECT pg_advisory_unlock({arguments})", numbers)
        _wait_until(granted_to_the_waiter, 1, "the key did not go to the frozen waiter")
        injecting.join(3 * LEASE + 10)
        assert not injecting.is_alive()
        history.close()
        (fault,) = [json.loads(line) for line in (tmp_path / "nemesis.jsonl").read_text().splitlines()]
        assert fault["kind"] == "sigstop-waiter" and fault["waiter"] is True, fault
        assert fault["waited"] == ["/".join(map(str, LockKey.from_name(key).pg_locks))], fault  # what it waited for
        assert fault["end"] - fault["start"] >= release_bound(LEASE), fault
        assert fault["kept"] == [], f"the frozen waiter's session kept the key past the release bound: {fault}"
        process.join(30)
        assert process.exitcode == 0
    finally:
        blocker.close()
        if process.is_alive():
            process.kill()
            process.join(10)


def test_the_look_names_the_locks_of_the_given_workers_sessions_only(
    fault_server: FaultServer, fault_admin: Any, tmp_path: Path
) -> None:
    history = HistoryWriter(tmp_path / "nemesis.jsonl")
    nemesis = Nemesis(_Pair(fault_server.dsn), LEASE, lambda: [], {}, history, seed=1)  # type: ignore[arg-type]
    sessions = [
        psycopg.connect(fault_server.dsn, autocommit=True, application_name=name)
        for name in ("campaign w7", "campaign w7 holds", "campaign w70")
    ]
    try:
        for number, session in enumerate(sessions, start=1):
            session.execute("SELECT pg_advisory_lock(%s, %s)", [4242, number])
        seven = nemesis.held_by([7])
        assert len(seven) == 2 and all("'campaign w7" in entry for entry in seven), seven
        assert any("(4242, 1, 2)" in entry for entry in seven) and any("(4242, 2, 2)" in entry for entry in seven)
        assert [entry.split(" (")[0] for entry in nemesis.held_by([70])] == ["'campaign w70'"]
        assert nemesis.held_by([1]) == []
    finally:
        for session in sessions:
            session.close()
    unreachable = Nemesis(_Pair("host=127.0.0.1 port=1 user=postgres"), LEASE, lambda: [], {}, history, seed=1)  # type: ignore[arg-type]
    (failed,) = unreachable.held_by([7])
    assert failed.startswith("the look failed: "), failed
    history.close()


def test_a_scope_setup_frozen_while_another_scope_is_written_loses_its_key_by_the_release_bound(
    fault_server: FaultServer, fault_admin: Any, tmp_path: Path
) -> None:
    """Another writer holds the scope horizon's lock (frozen itself, it would hold it for its
    lease); the setup, its key taken and its row written, needs that lock to raise the horizon.
    Frozen meanwhile, its session must end a lease after its last statement, as any holder's."""
    schema.migrate(fault_admin)
    name = "campaign w8"
    writing = (  # its key taken, its row written (the INSERT's lock on the table is the transaction's)
        "SELECT 1 FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
        " WHERE l.locktype = 'relation' AND l.relation = 'pglock.scopes'::regclass AND l.mode = 'RowExclusiveLock'"
        " AND l.granted AND a.application_name = %s"
    )
    other_writer = psycopg.connect(fault_server.dsn, application_name="pglock other scope writer")
    process = multiprocessing.get_context("spawn").Process(
        target=_scope_setup, args=(fault_server.dsn, "nemesis-frozen-scope-setup", name), daemon=True
    )
    try:
        other_writer.execute("SELECT pg_advisory_xact_lock(%s)", [scopes.HORIZON_LOCK_KEY.int64])
        process.start()
        assert process.pid is not None
        _wait_until(lambda: fault_admin.execute(writing, [name]).fetchone() is not None, 60, "the setup wrote no row")
        time.sleep(0.3)  # then it is after the horizon's lock
        history = HistoryWriter(tmp_path / "nemesis.jsonl")
        nemesis = Nemesis(_Pair(fault_server.dsn), LEASE, lambda: [], {}, history, seed=1)  # type: ignore[arg-type]
        os.kill(process.pid, signal.SIGSTOP)
        try:
            assert nemesis.held_by([8]), "the setup held no key when it was frozen: the scene was not set"
            time.sleep(release_bound(LEASE))
            kept = nemesis.held_by([8])
        finally:
            os.kill(process.pid, signal.SIGCONT)
            history.close()
        assert kept == [], f"the frozen setup's session kept its key past the release bound: {kept}"
        process.join(30)
        assert process.exitcode == 0
    finally:
        other_writer.close()
        if process.is_alive():
            process.kill()
            process.join(10)
        fault_admin.execute("DELETE FROM pglock.scopes")
