"""A measured proposal, NOT the provider's code: set a session lock's connection up in one statement.

Today a guarded execution sends five statements on its fresh connection: the server
inspection, the liveness ``set_config`` calls, the try-lock, the key-name registry
lookup and the unlock. This hook folds the first two and the registry's existence check
into one statement, so a guarded execution sends three (like the floor's two, plus one):

* the liveness settings are chosen from the ``server_version`` the server reported at
  start-up (no round trip) and applied only ``WHERE pg_backend_pid()`` equals the pid the
  wire protocol reported: behind a pooler (which fakes that pid) nothing is set, exactly
  as today, where the settings are applied only after :meth:`check_server` passed;
  PostgreSQL older than 12 (no ``tcp_user_timeout``) takes the old two-statement path;
* whether the registry's schema exists (``to_regnamespace('pglock')``: a cache lookup,
  unlike today's catalog join, which a fresh backend must plan against cold caches) is
  read in the same statement; when it does not, the guard skips its separate lookup
  (measured here with an int64 key, which has no name to record and therefore does no
  lookup either). With the registry installed, the lookup stays as it is.

:func:`benchmarks.overhead.build_variants` measures it next to today's LockGuard.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from airflow_pglock.hooks.advisory_lock import (
    MIN_SERVER_VERSION,
    AdvisoryLockHook,
    Scope,
    ServerInfo,
)

_INSPECT_COLUMNS = (
    "pg_backend_pid(), current_setting('server_version_num')::int, version(), current_database(),"
    " host(inet_server_addr()), inet_server_port(), pg_is_in_recovery(), pg_postmaster_start_time(),"
    " to_regnamespace('pglock') IS NOT NULL"  # a syscache lookup: no catalog query to plan on a cold backend
)


class OneStatementSetupHook(AdvisoryLockHook):
    """AdvisoryLockHook whose session-lock set-up is one statement instead of two (plus the registry check)."""

    registry_installed: bool | None = None

    def open_lock_session(
        self, application_name: str | None, scope: Scope
    ) -> tuple[psycopg.Connection[Any], ServerInfo]:
        reported_version = 0
        conn = self.connect(application_name)
        try:
            reported_version = conn.info.server_version
            if scope != "session" or reported_version < MIN_SERVER_VERSION:
                conn.close()
                return super().open_lock_session(application_name, scope)
            settings = self.liveness.server_settings(transaction=False, server_version_num=reported_version)
            apply = sql.SQL(", ").join(
                sql.SQL("set_config({}, {}, false)").format(sql.Literal(name), sql.Literal(value))
                for name, value in settings.items()
            )
            statement = sql.SQL("SELECT {}, CASE WHEN pg_backend_pid() = {} THEN concat({}) END").format(
                sql.SQL(_INSPECT_COLUMNS), sql.Literal(conn.info.backend_pid), apply
            )
            row = conn.execute(statement).fetchone()
            assert row is not None
            info = ServerInfo(
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
            self.registry_installed = row[8]
            self.check_server(info, scope)
            if info.behind_pooler:  # declared session pooling: nothing was set in the statement above
                conn.prepare_threshold = None
                self.apply_liveness(conn, local=False, server_version_num=info.version_num)
            return conn, info
        except BaseException:
            conn.close()
            raise
