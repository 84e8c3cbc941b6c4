"""Read-only views of the lock database for operators: every advisory lock, and server facts.

Hook-level module (the SQL of ``airflow-pglock locks`` / ``doctor`` and of the UI page).
Every function takes an open connection and only reads ``pg_locks``, ``pg_stat_activity``
and settings: nothing here takes, waits for or releases a lock, except
:func:`probe_advisory_lock`, which tries a transaction-level lock on a key of its own and
rolls back.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from airflow_pglock.keys import LockKey

#: The key ``doctor`` tries (and releases at once) to prove the role can take advisory locks.
PROBE_KEY = LockKey.from_name("airflow-pglock/doctor-probe")


@dataclass(frozen=True)
class AdvisoryLockRow:
    """One row of ``pg_locks`` for an advisory lock, with its session from ``pg_stat_activity``.

    Columns of other roles' sessions (client address, session start, ...) are None unless
    the reading role has the privileges of ``pg_read_all_stats``.

    :param waiters: how many sessions wait for this key (same database and coordinates).
    :param blocked_by: for a waiter, the pids it waits for (``pg_blocking_pids``).
    """

    database: str
    pid: int | None
    classid: int
    objid: int
    objsubid: int
    mode: str
    granted: bool
    wait_started_at: dt.datetime | None
    application_name: str | None
    user: str | None
    client_addr: str | None
    client_port: int | None
    backend_start: dt.datetime | None
    xact_start: dt.datetime | None
    state: str | None
    backend_type: str | None
    waiters: int
    blocked_by: tuple[int, ...]

    @property
    def coordinates(self) -> tuple[int, int, int]:
        return self.classid, self.objid, self.objsubid


@dataclass(frozen=True)
class LockSnapshot:
    """All advisory locks at one instant, and the server clock at that instant."""

    taken_at: dt.datetime
    database: str
    rows: tuple[AdvisoryLockRow, ...]


def advisory_locks(conn: psycopg.Connection[Any], *, all_databases: bool = False) -> LockSnapshot:
    """Every advisory lock held or awaited, holders before waiters, grouped by key.

    :param all_databases: include other databases of the cluster (advisory keys are
        per database: the same numbers in two databases are two different locks).
    """
    version = conn.info.server_version
    wait_start = sql.SQL("l.waitstart") if version >= 140000 else sql.SQL("NULL::timestamptz")
    query = sql.SQL(
        "SELECT d.datname, l.pid, l.classid::bigint, l.objid::bigint, l.objsubid::int, l.mode, l.granted,"
        " {wait_start}, a.application_name, a.usename, host(a.client_addr), a.client_port, a.backend_start,"
        " a.xact_start, a.state, a.backend_type,"
        " count(*) FILTER (WHERE NOT l.granted) OVER (PARTITION BY l.database, l.classid, l.objid, l.objsubid),"
        " CASE WHEN l.granted OR l.pid IS NULL THEN ARRAY[]::int[] ELSE pg_blocking_pids(l.pid) END,"
        " current_database(), clock_timestamp()"
        " FROM pg_catalog.pg_locks l"
        " JOIN pg_catalog.pg_database d ON d.oid = l.database"
        " LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid"
        " WHERE l.locktype = 'advisory' AND (%(all)s OR d.datname = current_database())"
        " ORDER BY d.datname, l.classid, l.objid, l.objsubid, l.granted DESC, {wait_start} NULLS FIRST, l.pid"
    ).format(wait_start=wait_start)
    rows = conn.execute(query, {"all": all_databases}).fetchall()
    if rows:
        database, taken_at = rows[0][18], rows[0][19]
    else:
        head = conn.execute("SELECT current_database(), clock_timestamp()").fetchone()
        assert head is not None
        database, taken_at = head
    return LockSnapshot(
        taken_at=taken_at,
        database=database,
        rows=tuple(
            AdvisoryLockRow(
                database=r[0],
                pid=r[1],
                classid=r[2],
                objid=r[3],
                objsubid=r[4],
                mode=r[5],
                granted=r[6],
                wait_started_at=r[7],
                application_name=r[8],
                user=r[9],
                client_addr=r[10],
                client_port=r[11],
                backend_start=r[12],
                xact_start=r[13],
                state=r[14],
                backend_type=r[15],
                waiters=int(r[16]),
                blocked_by=tuple(r[17] or ()),
            )
            for r in rows
        ),
    )


def compute_name_key(conn: psycopg.Connection[Any], name: str) -> int:
    """The int64 PostgreSQL computes for ``name`` with the documented SQL expression."""
    from airflow_pglock.keys import NAME_TO_KEY_SQL

    row = conn.execute(f"SELECT {NAME_TO_KEY_SQL}", [name]).fetchone()  # type: ignore[arg-type]  # static SQL
    assert row is not None
    return int(row[0])


@dataclass(frozen=True)
class ServerFacts:
    """What ``doctor`` needs to know about the server and the connecting role.

    :param settings: liveness setting name -> (value in its base unit, unit) as in force
        on the inspecting session; settings the server does not have are absent.
    """

    user: str
    superuser: bool
    reads_all_stats: bool
    max_locks_per_transaction: int
    max_connections: int
    max_prepared_transactions: int
    lock_table_entries: int
    advisory_locks: int
    settings: dict[str, tuple[int, str | None]]
    application_name: str | None
    client_connections: int = 0
    superuser_reserved_connections: int = 0

    @property
    def free_connections(self) -> int:
        """Connection slots left for ordinary roles (each running guarded task takes one)."""
        return self.max_connections - self.superuser_reserved_connections - self.client_connections

    @property
    def lock_capacity(self) -> int:
        """``max_locks_per_transaction x (max_connections + max_prepared_transactions)``."""
        return self.max_locks_per_transaction * (self.max_connections + self.max_prepared_transactions)


def server_facts(conn: psycopg.Connection[Any], settings: Sequence[str] = ()) -> ServerFacts:
    """Role, privileges, lock-table capacity and use, and the given settings as in force.

    :param settings: names of settings to read (e.g. the liveness settings a lock session sets).
    """
    row = conn.execute(
        "SELECT current_user, coalesce((SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user), false),"
        " pg_has_role('pg_read_all_stats', 'USAGE'),"
        " current_setting('max_locks_per_transaction')::int, current_setting('max_connections')::int,"
        " current_setting('max_prepared_transactions')::int,"
        " (SELECT count(*) FROM pg_catalog.pg_locks WHERE NOT fastpath),"
        " (SELECT count(*) FROM pg_catalog.pg_locks WHERE locktype = 'advisory'),"
        " current_setting('application_name'),"
        " (SELECT count(*) FROM pg_catalog.pg_stat_activity WHERE backend_type = 'client backend'),"
        " current_setting('superuser_reserved_connections')::int"
    ).fetchone()
    assert row is not None
    in_force = {
        name: (int(setting), unit)
        for name, setting, unit in conn.execute(
            "SELECT name, setting, unit FROM pg_catalog.pg_settings WHERE name = ANY(%s)", [list(settings)]
        ).fetchall()
    }
    return ServerFacts(
        user=row[0],
        superuser=bool(row[1]),
        reads_all_stats=bool(row[2]),
        max_locks_per_transaction=row[3],
        max_connections=row[4],
        max_prepared_transactions=row[5],
        lock_table_entries=int(row[6]),
        advisory_locks=int(row[7]),
        settings=in_force,
        application_name=row[8] or None,
        client_connections=int(row[9]),
        superuser_reserved_connections=row[10],
    )


def probe_advisory_lock(conn: psycopg.Connection[Any]) -> tuple[bool, float]:
    """Try a transaction-level lock on :data:`PROBE_KEY` and roll back; (taken, seconds)."""
    started = time.perf_counter()
    with conn.transaction(force_rollback=True):
        row = conn.execute("SELECT pg_try_advisory_xact_lock(%s::bigint)", PROBE_KEY.numbers).fetchone()
    return bool(row and row[0]), time.perf_counter() - started
