"""What is at the other end of a lock connection: the handshake's facts, and all of them asked.

A lock connection reads most of it from the handshake (:func:`server_from_handshake`, no
statement); its first lock statement completes the rest (:mod:`~airflow_pglock.pg.take`).
``doctor`` reads all of it with :func:`inspect_server`. The rules that judge it are
:mod:`~airflow_pglock.server_rules`.
"""

from __future__ import annotations

from typing import Any

import psycopg

from airflow_pglock import server_rules
from airflow_pglock.exceptions import UnsafeSetupError
from airflow_pglock.pg.sql import NOT_POSTGRES_ERRORS
from airflow_pglock.server_rules import ServerInfo


def server_from_handshake(conn: psycopg.Connection[Any]) -> ServerInfo:
    """What the handshake of ``conn`` told about the server (no statement; see
    :func:`~airflow_pglock.server_rules.from_handshake`)."""
    info = conn.info
    return server_rules.from_handshake(
        reported_pid=info.backend_pid,
        version_num=info.server_version,
        server_version=info.parameter_status("server_version"),
        crdb_version=info.parameter_status("crdb_version"),
        database=info.dbname,
        host=info.host,
        port=info.port,
    )


def inspect_server(conn: psycopg.Connection[Any]) -> ServerInfo:
    """Read what is at the other end of a lock connection, in one round trip."""
    try:
        row = conn.execute(
            "SELECT pg_catalog.pg_backend_pid(),"
            " pg_catalog.current_setting('server_version_num')::int, pg_catalog.version(),"
            " pg_catalog.current_database(), pg_catalog.host(pg_catalog.inet_server_addr()),"
            " pg_catalog.inet_server_port(), pg_catalog.pg_is_in_recovery(),"
            " pg_catalog.pg_postmaster_start_time()"
        ).fetchone()
    except NOT_POSTGRES_ERRORS as error:
        raise not_postgresql(conn, error) from None
    assert row is not None
    return ServerInfo(
        backend_pid=row[0],
        reported_pid=conn.info.backend_pid,
        version_num=row[1],
        version=row[2],
        database=row[3],
        server_addr=row[4],
        server_port=row[5],
        in_recovery=row[6],
        started_at=row[7],
    )


def not_postgresql(conn: psycopg.Connection[Any], error: psycopg.Error) -> UnsafeSetupError:
    """A server that answered PostgreSQL's functions with an error: it only looks like one."""
    claims = conn.info.parameter_status("server_version") or "unknown"
    return UnsafeSetupError(
        f"the lock database does not look like PostgreSQL (it reports server_version {claims!r} and "
        f"answered with: {str(error).strip()}); advisory locks need a PostgreSQL "
        "server (directly, or through PgBouncer to a real database, not its admin console)"
    )
