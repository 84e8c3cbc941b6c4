"""Read-only views of the lock database for operators: server facts, and the doctor's probe.

Hook-level module (the SQL of ``airflow-pglock doctor`` and ``key``; who holds what is
``pg/holders.py``). Every function takes an open connection and only reads settings
and catalogs: nothing here takes, waits for or releases a lock, except
:func:`probe_advisory_lock`, which tries a transaction-level lock on a key of its own and
rolls back.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from airflow_pglock.keys import NAME_TO_KEY_SQL, LockKey
from airflow_pglock.pg.sql import advisory_here

#: The key ``doctor`` tries (and releases at once) to prove the role can take advisory locks.
PROBE_KEY = LockKey.from_name("airflow-pglock/doctor-probe")


def key_statements(key: LockKey) -> dict[str, str]:
    """Standalone SQL for ``key``, for other applications (what ``airflow-pglock key`` prints):
    its arguments, a try, an unlock, and who holds it."""
    classid, objid, objsubid = key.pg_locks
    return {
        "key": key.sql,
        "try_lock": f"SELECT pg_catalog.pg_try_advisory_lock({key.sql})",
        "unlock": f"SELECT pg_catalog.pg_advisory_unlock({key.sql})",
        "holders": f"SELECT pid, granted, mode FROM pg_catalog.pg_locks WHERE {advisory_here()}"
        f" AND classid = {classid} AND objid = {objid} AND objsubid = {objsubid}",
    }


def compute_name_key(conn: psycopg.Connection[Any], name: str) -> int:
    """The int64 PostgreSQL computes for ``name`` with the documented SQL expression."""
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
        " pg_catalog.pg_has_role('pg_read_all_stats', 'USAGE'),"
        " pg_catalog.current_setting('max_locks_per_transaction')::int,"
        " pg_catalog.current_setting('max_connections')::int,"
        " pg_catalog.current_setting('max_prepared_transactions')::int,"
        " (SELECT pg_catalog.count(*) FROM pg_catalog.pg_locks WHERE NOT fastpath),"
        " (SELECT pg_catalog.count(*) FROM pg_catalog.pg_locks WHERE locktype = 'advisory'),"
        " pg_catalog.current_setting('application_name'),"
        " (SELECT pg_catalog.count(*) FROM pg_catalog.pg_stat_activity WHERE backend_type = 'client backend'),"
        " pg_catalog.current_setting('superuser_reserved_connections')::int"
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
        row = conn.execute("SELECT pg_catalog.pg_try_advisory_xact_lock(%s::bigint)", PROBE_KEY.numbers).fetchone()
    return bool(row and row[0]), time.perf_counter() - started
