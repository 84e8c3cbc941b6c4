"""The holders query: who holds or waits for advisory keys, read from ``pg_locks``.

It reads ``pg_locks`` and ``pg_stat_activity`` only: it takes no lock, so a sensor can
never make a contender skip (invariant 5).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql

from airflow_pglock.holder import LockHolder, LockSnapshot
from airflow_pglock.keys import LockKey
from airflow_pglock.pg.sql import refuse_a_standby

#: Below this server version pg_locks has no waitstart.
WAITSTART_VERSION = 140000


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
            " FROM ROWS FROM (pg_catalog.unnest(%(classids)s::bigint[]),"
            " pg_catalog.unnest(%(objids)s::bigint[]), pg_catalog.unnest(%(objsubids)s::int[])) AS k(c, o, s))"
        )
        coordinates = [key.pg_locks for key in keys]
        params.update(
            classids=[c[0] for c in coordinates],
            objids=[c[1] for c in coordinates],
            objsubids=[c[2] for c in coordinates],
        )
    # At least one row (all NULL but the server's facts when no lock matches): the standby check travels
    # with the read of pg_locks, in one statement (two behind a pooler could reach two different servers).
    query = sql.SQL(
        "SELECT h.*, r.standby, pg_catalog.current_database(), pg_catalog.clock_timestamp()"
        " FROM (SELECT pg_catalog.pg_is_in_recovery() AS standby) r LEFT JOIN LATERAL ("
        "SELECT d.datname, l.classid::bigint AS classid, l.objid::bigint AS objid, l.objsubid::int AS objsubid,"
        " l.pid, l.granted, l.mode, a.application_name, pg_catalog.host(a.client_addr), a.client_port, a.backend_start,"
        " {wait_start} AS waitstart, a.xact_start, a.usename, a.state, a.backend_type,"
        " pg_catalog.count(*) FILTER (WHERE NOT l.granted) OVER (PARTITION BY l.database,"
        " l.classid, l.objid, l.objsubid),"
        " CASE WHEN l.granted OR l.pid IS NULL THEN ARRAY[]::int[] ELSE pg_catalog.pg_blocking_pids(l.pid) END"
        " FROM pg_catalog.pg_locks l"
        " JOIN pg_catalog.pg_database d ON d.oid = l.database"
        " LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid"
        " WHERE l.locktype = 'advisory' AND (%(all)s OR d.datname = pg_catalog.current_database()){only_key}"
        ") h ON true"
        " ORDER BY h.datname, h.classid, h.objid, h.objsubid, h.granted DESC, h.waitstart NULLS FIRST, h.pid"
    ).format(wait_start=wait_start, only_key=only_key)
    return query, params


def _holder(row: Sequence[Any]) -> LockHolder:
    # The query's columns are the record's fields, in order; the last two need a conversion.
    return LockHolder(*(*row[:16], int(row[16]), tuple(row[17] or ())))


def _holders(rows: Sequence[Sequence[Any]]) -> list[LockHolder]:
    return [_holder(row) for row in rows if row[0] is not None]  # datname is NULL only in the row of no lock


def _standby(rows: Sequence[Sequence[Any]]) -> bool:
    return bool(rows[0][18])


def read_holders(conn: psycopg.Connection[Any], key: LockKey, *more: LockKey) -> list[LockHolder]:
    """Holders and waiters of ``key`` (and of ``more`` keys: a pool's slots) in the connection's
    database, holders first. Nobody is an answer only from a primary (a standby has none of its locks)."""
    query, params = _query(conn.info.server_version, [key, *more], all_databases=False)
    rows = conn.execute(query, params).fetchall()
    holders = _holders(rows)
    if not holders:
        refuse_a_standby(conn.info, _standby(rows))
    return holders


async def aread_holders(conn: psycopg.AsyncConnection[Any], key: LockKey, *more: LockKey) -> list[LockHolder]:
    """Async :func:`read_holders` (for triggers): reads ``pg_locks``, takes nothing."""
    query, params = _query(conn.info.server_version, [key, *more], all_databases=False)
    rows = await (await conn.execute(query, params)).fetchall()
    holders = _holders(rows)
    if not holders:
        refuse_a_standby(conn.info, _standby(rows))
    return holders


def advisory_locks(conn: psycopg.Connection[Any], *, all_databases: bool = False) -> LockSnapshot:
    """Every advisory lock held or awaited, holders before waiters, grouped by key.

    :param all_databases: include other databases of the cluster (advisory keys are
        per database: the same numbers in two databases are two different locks).
    """
    query, params = _query(conn.info.server_version, None, all_databases)
    rows = conn.execute(query, params).fetchall()
    return LockSnapshot(
        taken_at=rows[0][20], database=rows[0][19], rows=tuple(_holders(rows)), in_recovery=_standby(rows)
    )
