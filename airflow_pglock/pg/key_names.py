"""The key-name registry (``pglock.key_names``, created by ``airflow-pglock init-db``): which name
each key was taken under, recorded with a hold's release; read by ``locks``, the UI page and
``doctor`` (a key taken under two names is a collision)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from airflow_pglock.keys import LockKey
from airflow_pglock.pg.release import BOUND_WRITE, BOUND_WRITE_ALONE, UNBOUND_WRITE
from airflow_pglock.pg.schema import REGISTRY_TABLE, SCHEMA, table_exists
from airflow_pglock.pg.sql import HORIZON_LIVE


def _registry_table() -> sql.Composed:
    return sql.SQL("{}.{}").format(sql.Identifier(SCHEMA), sql.Identifier(REGISTRY_TABLE))


def registry_installed(conn: psycopg.Connection[Any]) -> bool:
    """Whether ``pglock.key_names`` exists (whether this role may use it is another matter)."""
    return table_exists(conn, REGISTRY_TABLE)


#: What a lock statement asks about the registry (``take.first_try``): whether its schema
#: is there, without naming the table (a statement naming a missing table fails as a whole). Only
#: that: asking for the table and this role's privileges too cost a fresh backend 0.2 ms more
#: (medians of 150), paid by every named key without a registry; a registry this role may not use
#: makes the write at release fail instead, and that error is logged.
REGISTRY_ABSENT = "absent"
REGISTRY_PRESENT = "present"
#: The schema is there with the lock scopes' table (init-db version 5), and no scope is live
#: anywhere in the database now: the scope horizon (``pg/scopes.py``) is in the past.
SCOPES_IDLE = "present+scopes"
#: As :data:`SCOPES_IDLE`, but some scope may be live now: a guard of a named key reads its
#: key's scope row before its work (one more statement).
SCOPES_LIVE = "present+scopes-live"
#: What a lock statement asks about the registry and the scopes (``take.first_try``), without
#: naming a table (a statement naming a missing one fails as a whole): the horizon is read by
#: the sequence's oid, not MVCC, after the statement took its lock (it is a later column).
REGISTRY_STATE = sql.SQL(
    "CASE WHEN pg_catalog.to_regnamespace({schema}) IS NULL THEN {absent}"
    # No USAGE on the schema: its tables are out of reach (to_regclass would fail). No scope can
    # be live then: a scope is taken only where PUBLIC may read the scopes (pg/scopes.py).
    " WHEN NOT pg_catalog.has_schema_privilege(pg_catalog.to_regnamespace({schema}), 'USAGE') THEN {present}"
    " WHEN pg_catalog.to_regclass({horizon}) IS NULL THEN {present}"
    " WHEN {horizon_live} THEN {live} ELSE {idle} END"
).format(
    schema=sql.Literal(SCHEMA),
    absent=sql.Literal(REGISTRY_ABSENT),
    present=sql.Literal(REGISTRY_PRESENT),
    horizon=sql.Literal(f"{SCHEMA}.scope_horizon"),
    horizon_live=sql.SQL(HORIZON_LIVE),
    live=sql.Literal(SCOPES_LIVE),
    idle=sql.Literal(SCOPES_IDLE),
)


def registry_schema_present(state: str | None) -> bool:
    """Whether a lock statement's registry answer says the ``pglock`` schema is there."""
    return state in (REGISTRY_PRESENT, SCOPES_IDLE, SCOPES_LIVE)


def scopes_installed(state: str | None) -> bool:
    """Whether a lock statement's registry answer says the lock scopes' table is there."""
    return state in (SCOPES_IDLE, SCOPES_LIVE)


def record_key_name(
    conn: psycopg.Connection[Any],
    key: LockKey,
    recorded_by: str | None,
    slots: int = 1,
    *,
    installed: bool | None = None,
) -> list[str] | None:
    """Record ``key.name`` for ``key``; return the *other* names recorded for the same key.

    Returns None when the registry is not installed (nothing is written then). A non-empty
    list is a collision: those names and this one share one lock. Inside an open
    transaction (transaction-mode locks) the write runs in a savepoint, so an error here
    never aborts the caller's transaction. Only the first use of a name writes a row; with
    ``slots`` greater than 1, also a use that changes the pool's recorded size.

    :param conn: the lock's own connection (autocommit, or inside its transaction).
    :param key: a key with a name (keys without one are not recorded: returns []).
    :param recorded_by: who used it first (the lock connection's application_name).
    :param slots: the size of the pool ``key`` is a slot of (1: a plain key; its statement
        does not name the ``slots`` column, so it runs on every schema version).
    :param installed: True when the caller knows the registry is there (no check then).
    """
    if key.name is None:
        return []
    params = _record_params(key, recorded_by, slots)
    if slots > 1:
        try:
            return _run_registry(conn, _record_statement(pool=True), params, installed)
        except psycopg.errors.UndefinedColumn:  # init-db before version 4: the name alone
            pass
    return _run_registry(conn, _record_statement(pool=False), params, installed)


def record_key_name_statement(
    key: LockKey, recorded_by: str | None, slots: int = 1
) -> tuple[sql.Composed, dict[str, Any]]:
    """The statement of :func:`record_key_name` and its parameters, to send with another
    statement; its rows are the *other* names of the key. It needs an installed registry
    (and, with ``slots`` greater than 1, init-db version 4).

    :param key: a key with a name.
    """
    return _record_statement(pool=slots > 1), _record_params(key, recorded_by, slots)


def _record_params(key: LockKey, recorded_by: str | None, slots: int) -> dict[str, Any]:
    classid, objid, objsubid = key.pg_locks
    return {
        "objsubid": objsubid,
        "classid": classid,
        "objid": objid,
        "name": key.name,
        "by": recorded_by,
        "slots": slots,
    }


def _record_statement(*, pool: bool) -> sql.Composed:
    # A slot's row is written only by the session holding that slot (slots are exclusive), so
    # the resize never waits for another row lock; it writes only when N changed.
    resize = (
        ", resized AS (UPDATE {table} SET slots = %(slots)s WHERE objsubid = %(objsubid)s AND classid = %(classid)s"
        " AND objid = %(objid)s AND name = %(name)s AND slots IS DISTINCT FROM %(slots)s RETURNING 1)"
        if pool
        else ""
    )
    return sql.SQL(
        "WITH recorded AS (INSERT INTO {table} (objsubid, classid, objid, name, first_recorded_by"
        + (", slots" if pool else "")
        + ") VALUES (%(objsubid)s, %(classid)s, %(objid)s, %(name)s, %(by)s"
        + (", %(slots)s" if pool else "")
        + ") ON CONFLICT DO NOTHING RETURNING 1)"
        + resize
        + " SELECT name FROM {table} WHERE objsubid = %(objsubid)s AND classid = %(classid)s AND objid = %(objid)s"
        " AND name <> %(name)s ORDER BY name"
    ).format(table=_registry_table())


def _run_registry(
    conn: psycopg.Connection[Any], statement: sql.Composed, params: dict[str, Any], installed: bool | None
) -> list[str] | None:
    # Bounded as the write at release (release.BOUND_WRITE): it never waits long for a lock.
    in_transaction = conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE
    with conn.transaction(savepoint_name="pglock_registry" if in_transaction else None):
        if not installed and not registry_installed(conn):
            return None
        conn.execute(BOUND_WRITE if in_transaction else BOUND_WRITE_ALONE)
        rows = conn.execute(statement, params).fetchall()
        if in_transaction:
            conn.execute(UNBOUND_WRITE)
    return [row[0] for row in rows]


@dataclass(frozen=True)
class RegisteredName:
    """A row of the registry: a name recorded for the key at pg_locks ``(classid, objid, objsubid)``."""

    classid: int
    objid: int
    objsubid: int
    name: str
    first_recorded_at: dt.datetime
    first_recorded_by: str | None
    #: the size of the pool this name is a slot of (None: not a pool, or not known: init-db < 4)
    slots: int | None = None


def _registered(row: Sequence[Any]) -> RegisteredName:
    return RegisteredName(*row)  # the registry's columns, in the record's order (slots: init-db 4+)


def registered_names(
    conn: psycopg.Connection[Any], coordinates: Sequence[tuple[int, int, int]] | None = None
) -> list[RegisteredName] | None:
    """Names recorded for the given pg_locks coordinates (all when None); None if no registry.

    :param coordinates: ``(classid, objid, objsubid)`` triples to look up.
    """
    if not registry_installed(conn):
        return None
    # The slots column by way of the row's JSON: the same query reads a registry of any version.
    query = sql.SQL(
        "SELECT classid, objid, objsubid, name, first_recorded_at, first_recorded_by,"
        " (pg_catalog.to_jsonb(r) ->> 'slots')::integer FROM {} r"
    ).format(_registry_table())
    params: list[Any] = []
    if coordinates is not None:
        if not coordinates:
            return []
        query = query + sql.SQL(
            " WHERE (r.classid, r.objid, r.objsubid) IN"
            " (SELECT * FROM ROWS FROM (pg_catalog.unnest(%s::bigint[]),"
            " pg_catalog.unnest(%s::bigint[]), pg_catalog.unnest(%s::smallint[])))"
        )
        params = [[c[0] for c in coordinates], [c[1] for c in coordinates], [c[2] for c in coordinates]]
    query = query + sql.SQL(" ORDER BY classid, objid, objsubid, name")
    return [_registered(r) for r in conn.execute(query, params).fetchall()]


def registry_collisions(conn: psycopg.Connection[Any]) -> list[list[RegisteredName]] | None:
    """Every key recorded under two or more names (each a list of its rows); None if no registry."""
    if not registry_installed(conn):
        return None
    rows = conn.execute(
        sql.SQL(
            "SELECT classid, objid, objsubid, name, first_recorded_at, first_recorded_by FROM {t}"
            " WHERE (classid, objid, objsubid) IN (SELECT classid, objid, objsubid FROM {t}"
            " GROUP BY classid, objid, objsubid HAVING pg_catalog.count(*) > 1)"
            " ORDER BY classid, objid, objsubid, name"
        ).format(t=_registry_table())
    ).fetchall()
    groups: dict[tuple[int, int, int], list[RegisteredName]] = {}
    for r in rows:
        groups.setdefault((r[0], r[1], r[2]), []).append(_registered(r))
    return list(groups.values())


def registry_privileges(conn: psycopg.Connection[Any]) -> dict[str, bool] | None:
    """Whether the current role may ``SELECT`` / ``INSERT`` the registry and ``UPDATE`` its
    ``slots`` column (a pool's size; True when that column is not installed yet); None if no registry."""
    if not registry_installed(conn):
        return None
    row = conn.execute(
        # By oid: resolving the name 'pglock.key_names' would itself need USAGE on the schema.
        "SELECT pg_catalog.has_schema_privilege(n.oid, 'USAGE'), pg_catalog.has_table_privilege(c.oid, 'SELECT'),"
        " pg_catalog.has_table_privilege(c.oid, 'INSERT'),"
        " CASE WHEN EXISTS (SELECT 1 FROM pg_catalog.pg_attribute a WHERE a.attrelid = c.oid"
        " AND a.attname = 'slots' AND NOT a.attisdropped) THEN"
        " pg_catalog.has_column_privilege(c.oid, 'slots', 'UPDATE') END"
        " FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = %s AND c.relname = %s",
        [SCHEMA, REGISTRY_TABLE],
    ).fetchone()
    assert row is not None
    return {
        "usage": bool(row[0]),
        "select": bool(row[0] and row[1]),
        "insert": bool(row[0] and row[2]),
        "update_slots": bool(row[0] and row[3] is not False),
    }
