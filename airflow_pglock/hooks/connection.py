"""An Airflow Postgres connection read the way ``PostgresHook`` reads it (SSL extras, IAM tokens,
``options``), into the lock database's :class:`~airflow_pglock.pg.settings.ConnectionSettings`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from airflow_pglock.compat import is_connection_not_found
from airflow_pglock.exceptions import LockConfigurationError, LockConnectionError
from airflow_pglock.pg.settings import POOL_MODES, ConnectionSettings

POSTGRES_CONN_TYPES = frozenset({"postgres", "postgresql"})
# PostgresHook extras that are not libpq parameters (it drops these too).
_NON_LIBPQ_EXTRAS = frozenset({"cursor", "pool_mode"})


def from_airflow(conn_id: str, get_connection: Callable[[str], Any]) -> ConnectionSettings:
    """Settings from an Airflow Postgres connection, as ``PostgresHook.get_conn`` would connect.

    :param conn_id: the Airflow connection id.
    :param get_connection: the hook's ``get_connection`` (secrets backends, env variables...).
    """
    from airflow.providers.postgres.hooks.postgres import PostgresHook

    try:
        airflow_conn = get_connection(conn_id)
    except Exception as error:
        if not is_connection_not_found(error):  # a secrets backend or the API server failing now: a retry may do
            raise LockConnectionError(
                f"Airflow connection {conn_id!r} could not be read ({type(error).__name__}: {error})"
            ) from error
        raise LockConfigurationError(
            f"Airflow connection {conn_id!r} was not found ({type(error).__name__}: {error}); "
            "create a connection of type 'postgres' with that id in the Airflow UI or as "
            f"AIRFLOW_CONN_{conn_id.upper()}"
        ) from None
    conn_type = (airflow_conn.conn_type or "").lower()
    if conn_type not in POSTGRES_CONN_TYPES:
        raise LockConfigurationError(
            f"Airflow connection {conn_id!r} has conn_type {airflow_conn.conn_type!r}; "
            "advisory locks need a PostgreSQL connection (conn_type 'postgres')"
        )
    # Checked before PostgresHook resolves the password into this frame: Airflow 3.0's console
    # prints a failing frame's local variables.
    pool_mode = airflow_conn.extra_dejson.get("pool_mode")
    if pool_mode is not None and pool_mode not in POOL_MODES:  # a typo would read as "no pooler declared"
        raise LockConfigurationError(
            f"Airflow connection {conn_id!r} has extra pool_mode {pool_mode!r}; expected one of "
            f"{', '.join(map(repr, POOL_MODES))} (the pooler's pooling mode), or no pool_mode without a pooler"
        )
    captured: dict[str, Any] = {}

    class _ConnArgsOnly(PostgresHook):
        # PostgresHook.get_conn() resolves extras and IAM tokens, then hands the libpq
        # arguments to _create_connection: keep them, open nothing.
        def _create_connection(self, conn_args: dict[str, Any]) -> Any:
            captured.update(conn_args)
            return None

    # connection= (DbApiHook's own argument), not the deprecated setter, which logs a warning
    opened = _ConnArgsOnly(postgres_conn_id=conn_id, connection=airflow_conn).get_conn()
    if not captured:  # an older PostgresHook connected by itself instead of handing us its arguments
        if opened is not None:
            opened.close()
        raise LockConfigurationError(
            "this apache-airflow-providers-postgres is too old for airflow-pglock (PostgresHook has no "
            "_create_connection); upgrade it to 7.1 or newer"
        )
    return ConnectionSettings(
        params={k: v for k, v in captured.items() if v is not None and k not in _NON_LIBPQ_EXTRAS},
        source=f"conn id {conn_id!r}",
        pool_mode=pool_mode,
        # PostgresHook fetches an IAM token when the extra is truthy (a string "false" too): it expires.
        reusable=not airflow_conn.extra_dejson.get("iam", False),
    )
