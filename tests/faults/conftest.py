"""Fixtures of the fault-injection suite: a PostgreSQL cluster the suite owns (it restarts
it), reachable from a network namespace when this machine can make one."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest

from devtools.netns import NetNamespace, NetNamespaceUnavailableError
from devtools.pgcluster import Cluster
from tests.helpers import advisory_locks, other_sessions

FAULT_DATABASE = "pglock_faults"
#: The fault tests that read an Airflow connection or run a DAG: they run on every Airflow line.
#: The others exercise only the lock database and the lifetime layers, which import nothing of
#: Airflow (the import-linter contract says so): with PGLOCK_LINE_INDEPENDENT_ONCE=1 (.ci/run's
#: other whole-suite legs) they are left to the default line's run.
TOUCH_AIRFLOW = ("test_dag_faults.py", "test_unsafe_setups.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import os

    if os.environ.get("PGLOCK_LINE_INDEPENDENT_ONCE") != "1":
        return
    skip = pytest.mark.skip(reason="independent of the Airflow line: the default line's whole suite runs it")
    for item in items:
        if "/tests/faults/" in str(item.path) and item.path.name not in TOUCH_AIRFLOW:
            item.add_marker(skip)


@dataclass
class FaultServer:
    cluster: Cluster
    netns: NetNamespace | None
    netns_error: str | None

    @property
    def dsn(self) -> str:
        return self.cluster.dsn_for(FAULT_DATABASE)

    def dsn_from_netns(self) -> str:
        assert self.netns is not None
        return f"postgresql://postgres@{self.netns.host_addr}:{self.cluster.port}/{FAULT_DATABASE}"

    def admin(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.dsn, autocommit=True, application_name="pglock-faults admin")

    def wait_until_up(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with self.admin():
                    return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


@pytest.fixture(scope="session")
def fault_server() -> Iterator[FaultServer]:
    """A throwaway cluster (restartable), listening on 127.0.0.1 and, if possible, on a veth
    address that a process inside a network namespace can reach."""
    netns: NetNamespace | None = None
    netns_error = NetNamespace.unavailable_reason()
    if netns_error is None:
        try:
            netns = NetNamespace().create()
        except NetNamespaceUnavailableError as error:
            netns, netns_error = None, str(error)
    listen = "127.0.0.1" + (f",{netns.host_addr}" if netns else "")
    cluster = Cluster(settings={"listen_addresses": f"'{listen}'"}, trusted_subnets=[netns.subnet] if netns else [])
    try:
        cluster.init()
        cluster.start()
        with psycopg.connect(cluster.dsn, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {FAULT_DATABASE}")
        yield FaultServer(cluster, netns, netns_error)
    finally:
        cluster.destroy()
        if netns is not None:
            netns.destroy()


@pytest.fixture
def fault_admin(fault_server: FaultServer) -> Iterator[psycopg.Connection[Any]]:
    """An admin connection; after the test, no other session and no advisory lock may remain."""
    fault_server.wait_until_up()
    conn = fault_server.admin()
    try:
        yield conn
    finally:
        conn.close()
    fault_server.wait_until_up()
    with fault_server.admin() as check:
        left = assert_nothing_left(check)
    assert left == ([], []), f"left behind (sessions, advisory locks): {left}"


def assert_nothing_left(conn: psycopg.Connection[Any], timeout: float = 5.0) -> tuple[list[Any], list[Any]]:
    """(sessions, advisory locks) still there after ``timeout`` s (a backend exits asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        sessions, locks = other_sessions(conn), advisory_locks(conn)
        if (not sessions and not locks) or time.monotonic() > deadline:
            return sessions, locks
        time.sleep(0.05)


def lock_holder_pids(conn: psycopg.Connection[Any]) -> list[int]:
    """pids of the sessions holding a granted advisory lock in the fault database."""
    return [pid for pid, *_, granted in advisory_locks(conn) if granted]


def wait_until_released(conn: psycopg.Connection[Any], pid: int, timeout: float) -> float | None:
    """Poll pg_locks every 20 ms until ``pid`` holds no advisory lock; the monotonic time it
    was first seen released, or None after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pid not in lock_holder_pids(conn):
            return time.monotonic()
        time.sleep(0.02)
    return None
