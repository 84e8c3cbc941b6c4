"""Who holds or waits for advisory keys: one query, one record (:class:`LockHolder`).

Used by everything that names a holder: the guard's busy message, the sensor, the
trigger, ``airflow-pglock locks`` and the UI page. The query reads ``pg_locks`` and
``pg_stat_activity`` only: it takes no lock, so a sensor can never make a contender skip
(invariant 5).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from airflow_pglock.keys import LockKey

EXCLUSIVE_MODE = "ExclusiveLock"  # pg_locks.mode of an exclusive advisory lock ("ShareLock" when shared)
#: Below this server version pg_locks has no waitstart.
WAITSTART_VERSION = 140000


@dataclass(frozen=True)
class LockHolder:
    """A session that holds or waits for a key, as ``pg_locks`` and ``pg_stat_activity`` see it.

    Columns of other roles' sessions (client address, session start, ...) are None unless
    the reading role has the privileges of ``pg_read_all_stats``. ``since`` is when the
    holder's session started; airflow-pglock opens a session per lock, so for its holders
    that is within milliseconds of the acquisition.

    :param database: the database the key belongs to (advisory keys are per database).
    :param classid: ``pg_locks.classid`` of the key.
    :param objid: ``pg_locks.objid`` of the key.
    :param objsubid: ``pg_locks.objsubid`` of the key (1: an int64 key, 2: a pair).
    :param pid: the session's backend pid (None for a prepared transaction).
    :param granted: True when it holds the key, False when it waits for it.
    :param mode: ``ExclusiveLock`` or ``ShareLock``.
    :param application_name: the session's application_name (airflow-pglock's names the DAG,
        task and run); None when hidden (another role without ``pg_read_all_stats``) or unset.
    :param client_addr: the client's address; None over a local socket or when hidden.
    :param client_port: the client's port.
    :param since: when the session started (``backend_start``).
    :param waiting_since: when a waiter started waiting (``pg_locks.waitstart``, PostgreSQL 14+).
    :param transaction_start: start of the session's current transaction, if any.
    :param user: the session's role.
    :param state: ``pg_stat_activity.state`` (``idle``, ``active``, ...).
    :param backend_type: ``pg_stat_activity.backend_type`` (``client backend``...).
    :param waiters: how many sessions wait for this key.
    :param blocked_by: for a waiter, the pids it waits for (``pg_blocking_pids``).
    """

    database: str
    classid: int
    objid: int
    objsubid: int
    pid: int | None
    granted: bool
    mode: str
    application_name: str | None
    client_addr: str | None
    client_port: int | None
    since: dt.datetime | None
    waiting_since: dt.datetime | None
    transaction_start: dt.datetime | None
    user: str | None
    state: str | None
    backend_type: str | None
    waiters: int
    blocked_by: tuple[int, ...]

    @property
    def coordinates(self) -> tuple[int, int, int]:
        return self.classid, self.objid, self.objsubid

    @property
    def shared(self) -> bool:
        return self.mode != EXCLUSIVE_MODE

    def describe(self, now: dt.datetime | None = None) -> str:
        """``pid 123 (application_name 'x', client 10.0.0.5) holding since 12:00:00 (3.1 s)``."""
        role = "holding" if self.granted else "waiting"
        start = self.since if self.granted else self.waiting_since
        since = ""
        if start is not None:
            since = f" since {start.isoformat(timespec='seconds')}"
            if now is not None:
                since += f" ({(now - start).total_seconds():.1f} s)"
        app = repr(self.application_name) if self.application_name else "unknown (no privilege or not set)"
        client = self.client_addr or "local socket or hidden"
        return f"pid {self.pid} (application_name {app}, client {client}) {role} {self.mode}{since}"


def describe_holders(holders: Sequence[LockHolder], now: dt.datetime, *, nobody: str = "nobody") -> str:
    """``pid 1 (...) holding since ... (3.0 s); pid 2 ...`` for the sessions holding a key.

    :param holders: holders and waiters of one key (waiters are left out).
    :param now: the time the durations run to.
    :param nobody: what to say when no session holds it.
    """
    return "; ".join(holder.describe(now) for holder in holders if holder.granted) or nobody


def blocking_holders(holders: Sequence[LockHolder], shared: bool) -> list[LockHolder]:
    """The granted holders that keep the key from being taken (only exclusive ones when ``shared``)."""
    return [h for h in holders if h.granted and (not shared or h.mode == EXCLUSIVE_MODE)]


@dataclass(frozen=True)
class LockSnapshot:
    """All advisory locks at one instant, and the server clock at that instant.

    :param taken_at: the server's clock when the snapshot was read.
    :param database: the database connected to.
    :param rows: every holder and waiter, holders before waiters, grouped by key.
    """

    taken_at: dt.datetime
    database: str
    rows: tuple[LockHolder, ...]


def _query(
    server_version: int, keys: Sequence[LockKey] | None, all_databases: bool
) -> tuple[sql.Composed, dict[str, Any]]:
    wait_start = sql.SQL("l.waitstart") if server_version >= WAITSTART_VERSION else sql.SQL("NULL::timestamptz")
    only_key = sql.SQL("")
    params: dict[str, Any] = {"all": all_databases}
    if keys is not None and len(keys) == 1:
        only_key = sql.SQL(" AND l.classid = %(classid)s AND l.objid = %(objid)s AND l.objsubid = %(objsubid)s")
        params.update(zip(("classid", "objid", "objsubid"), keys[0].pg_locks, strict=True))
    elif keys is not None:  # the slots of a pool
        only_key = sql.SQL(
            " AND (l.classid, l.objid, l.objsubid) IN (SELECT c::oid, o::oid, s::int2"
            " FROM unnest(%(classids)s::bigint[], %(objids)s::bigint[], %(objsubids)s::int[]) AS k(c, o, s))"
        )
        coordinates = [key.pg_locks for key in keys]
        params.update(
            classids=[c[0] for c in coordinates],
            objids=[c[1] for c in coordinates],
            objsubids=[c[2] for c in coordinates],
        )
    query = sql.SQL(
        "SELECT d.datname, l.classid::bigint, l.objid::bigint, l.objsubid::int, l.pid, l.granted, l.mode,"
        " a.application_name, host(a.client_addr), a.client_port, a.backend_start, {wait_start}, a.xact_start,"
        " a.usename, a.state, a.backend_type,"
        " count(*) FILTER (WHERE NOT l.granted) OVER (PARTITION BY l.database, l.classid, l.objid, l.objsubid),"
        " CASE WHEN l.granted OR l.pid IS NULL THEN ARRAY[]::int[] ELSE pg_blocking_pids(l.pid) END,"
        " current_database(), clock_timestamp()"
        " FROM pg_catalog.pg_locks l"
        " JOIN pg_catalog.pg_database d ON d.oid = l.database"
        " LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid"
        " WHERE l.locktype = 'advisory' AND (%(all)s OR d.datname = current_database()){only_key}"
        " ORDER BY d.datname, l.classid, l.objid, l.objsubid, l.granted DESC, {wait_start} NULLS FIRST, l.pid"
    ).format(wait_start=wait_start, only_key=only_key)
    return query, params


def _holder(row: Sequence[Any]) -> LockHolder:
    return LockHolder(
        database=row[0],
        classid=row[1],
        objid=row[2],
        objsubid=row[3],
        pid=row[4],
        granted=row[5],
        mode=row[6],
        application_name=row[7],
        client_addr=row[8],
        client_port=row[9],
        since=row[10],
        waiting_since=row[11],
        transaction_start=row[12],
        user=row[13],
        state=row[14],
        backend_type=row[15],
        waiters=int(row[16]),
        blocked_by=tuple(row[17] or ()),
    )


def read_holders(conn: psycopg.Connection[Any], key: LockKey, *more: LockKey) -> list[LockHolder]:
    """Holders and waiters of ``key`` (and of ``more`` keys: a pool's slots) in the connection's
    database, holders first."""
    query, params = _query(conn.info.server_version, [key, *more], all_databases=False)
    return [_holder(row) for row in conn.execute(query, params).fetchall()]


async def aread_holders(conn: psycopg.AsyncConnection[Any], key: LockKey, *more: LockKey) -> list[LockHolder]:
    """Async :func:`read_holders` (for triggers): reads ``pg_locks``, takes nothing."""
    query, params = _query(conn.info.server_version, [key, *more], all_databases=False)
    cursor = await conn.execute(query, params)
    return [_holder(row) for row in await cursor.fetchall()]


def advisory_locks(conn: psycopg.Connection[Any], *, all_databases: bool = False) -> LockSnapshot:
    """Every advisory lock held or awaited, holders before waiters, grouped by key.

    :param all_databases: include other databases of the cluster (advisory keys are
        per database: the same numbers in two databases are two different locks).
    """
    query, params = _query(conn.info.server_version, None, all_databases)
    rows = conn.execute(query, params).fetchall()
    if rows:
        database, taken_at = rows[0][18], rows[0][19]
    else:
        head = conn.execute("SELECT current_database(), clock_timestamp()").fetchone()
        assert head is not None
        database, taken_at = head
    return LockSnapshot(taken_at=taken_at, database=database, rows=tuple(_holder(row) for row in rows))
