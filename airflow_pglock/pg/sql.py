"""The SQL fragments more than one statement uses, each written once.

The statements themselves live next to their callers in this package; what they share
is here: which ``pg_locks`` rows are this database's advisory locks, the condition "a
session holds a key" (in its transaction, for a transaction lock), the lock function of
a scope and mode, a call of it composed for a key, a statement run without aborting
the transaction it runs in, and the lift of ``transaction_timeout`` in this package's own transactions.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql
from psycopg.adapt import Dumper

from airflow_pglock.exceptions import StandbyServerError
from airflow_pglock.holder import EXCLUSIVE_MODE, SHARED_MODE
from airflow_pglock.keys import LockKey
from airflow_pglock.liveness import Liveness
from airflow_pglock.server_rules import Scope

#: The first ``server_version_num`` with ``transaction_timeout``.
TRANSACTION_TIMEOUT_VERSION = 170000
#: A select-list item that lifts ``transaction_timeout`` (PostgreSQL 17+; it ends the *session* of a
#: transaction that outlasts it) for the rest of the transaction it runs in; NULL, and nothing set,
#: on a server without it (so a version a pooler misreports does no harm). Only for transactions of
#: this package's own on a session lock's connection, each bounded by its own timeouts: a
#: transaction-mode lock's transaction keeps whatever bounds it.
LIFT_TRANSACTION_TIMEOUT = (
    "CASE WHEN pg_catalog.current_setting('transaction_timeout', true) IS NOT NULL"
    " THEN pg_catalog.set_config('transaction_timeout', '0', true) END"
)


class _IntLiteral(Dumper):
    """An integer inlined into a statement: a negative one in parentheses, so that a cast after it
    casts the number (``-2147483648::integer`` is ``-(2147483648::integer)``, out of range)."""

    def dump(self, obj: int) -> bytes:
        return str(int(obj)).encode()  # an int subclass (an IntEnum member) by its number, not its name

    def quote(self, obj: int) -> bytes:
        text = self.dump(obj)
        return b"(" + text + b")" if obj < 0 else text


def inline(conn: psycopg.Connection[Any], statement: str | sql.Composable, params: Any) -> str:
    """``statement`` with its parameters bound client-side, for several statements sent in one
    simple query (which takes no parameters)."""
    cursor = psycopg.ClientCursor(conn)
    cursor.adapters.register_dumper(int, _IntLiteral)
    return cursor.mogrify(statement, params)  # type: ignore[arg-type]  # static SQL from this package


def execute_contained(conn: psycopg.Connection[Any], statement: str, params: dict[str, Any], savepoint: str) -> Any:
    """Run one of this package's statements; inside a transaction (a transaction lock's), in the
    savepoint ``savepoint``, so that its error does not abort the transaction that holds the lock."""
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        with conn.transaction(savepoint_name=savepoint):
            return conn.execute(statement, params)  # type: ignore[arg-type]  # static SQL from this package
    return conn.execute(statement, params)  # type: ignore[arg-type]


def advisory_here(alias: str = "") -> str:
    """The ``pg_locks`` rows of advisory locks in the connected database (an advisory key's
    numbers are per database: the same numbers in two databases are two locks).

    :param alias: the ``pg_locks`` alias of the statement, with its dot (``"l."``), if any.
    """
    return (
        f"{alias}locktype = 'advisory'"
        f" AND {alias}database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database())"
    )


# Whether a session ({0}) holds a key in this database: pg_locks, filtered to that pid.
HELD_CONDITION = (
    "EXISTS (SELECT 1 FROM pg_catalog.pg_locks WHERE " + advisory_here() + " AND pid = {0}"
    " AND classid = {1}::oid AND objid = {2}::oid AND objsubid = {3}::int2 AND mode = {4} AND granted)"
)
# ...and, for a transaction lock, that the session is still in the transaction that took it
# (a COMMIT then BEGIN on the lock's connection ends the lock; the key may even be taken
# again in the new transaction, which is not the lock the guard holds).
IN_TRANSACTION = "pg_catalog.txid_current_if_assigned() IS NOT DISTINCT FROM {0}::bigint"
# The same seen from another session: the holder's current top-level transaction id (32 bits).
SIDE_IN_TRANSACTION = (
    "(SELECT backend_xid::text::bigint FROM pg_catalog.pg_stat_activity WHERE pid = {0}) ="
    " pg_catalog.mod({1}::bigint, 4294967296)"
)


def held_condition(pid: str | None, placeholders: tuple[str, str, str, str], xact: str | None) -> str:
    """The condition "session ``pid`` holds the key [in transaction ``xact``]", with the given
    placeholders for the key's ``pg_locks`` coordinates and mode; ``pid`` None: the session that
    runs the statement, else another session (its transaction as ``pg_stat_activity`` shows it)."""
    if pid is None:
        condition = HELD_CONDITION.format("pg_catalog.pg_backend_pid()", *placeholders)
        return condition + (" AND " + IN_TRANSACTION.format(xact) if xact is not None else "")
    condition = HELD_CONDITION.format(pid, *placeholders)
    return condition + (" AND " + SIDE_IN_TRANSACTION.format(pid, xact) if xact is not None else "")


def held_params(key: LockKey, shared: bool) -> list[Any]:
    """The parameters of :func:`held_condition`'s four key placeholders."""
    classid, objid, objsubid = key.pg_locks
    return [classid, objid, objsubid, SHARED_MODE if shared else EXCLUSIVE_MODE]


# The errors a server that only looks like PostgreSQL (PgBouncer's admin console, other
# wire-compatible systems) answers to a statement naming PostgreSQL's functions.
NOT_POSTGRES_ERRORS: tuple[type[psycopg.Error], ...] = (
    psycopg.errors.UndefinedFunction,
    psycopg.errors.ProtocolViolation,
    psycopg.errors.FeatureNotSupported,
    psycopg.errors.SyntaxError,
)


def catalog_function(name: str) -> sql.Identifier:
    """A built-in function by its schema: a function of that name elsewhere on the search_path (an
    exact match of the arguments' types in ``public``, or a schema put ahead of ``pg_catalog``) would
    otherwise be called instead."""
    return sql.Identifier("pg_catalog", name)


def lock_function(base: str, *, shared: bool = False, scope: Scope = "session") -> str:
    """The advisory lock function: ``base`` is ``try`` (``pg_try_advisory_lock``), ``wait``
    (``pg_advisory_lock``) or ``unlock``; its transaction-level and shared forms as asked."""
    xact = "_xact" if scope == "transaction" else ""
    name = {"try": f"pg_try_advisory{xact}_lock", "wait": f"pg_advisory{xact}_lock", "unlock": "pg_advisory_unlock"}
    return name[base] + ("_shared" if shared else "")


# Each call written once, as text (quoted as sql.Identifier quotes these names): psycopg caches
# the conversion of a text query, and would render a composed one anew at each execution of a
# tight loop. :func:`call` wraps the same text for statements composed around it.
_CALL_TEXTS = {
    (function, pair): f'SELECT "pg_catalog"."{function}"('
    + ("%s::integer, %s::integer" if pair else "%s::bigint")
    + ")"
    for function in {
        lock_function(base, shared=shared, scope=scope)
        for base in ("try", "wait", "unlock")
        for scope in ("session", "transaction")
        for shared in (False, True)
    }
    for pair in (False, True)
}
_CALLS = {form: sql.SQL(text) for form, text in _CALL_TEXTS.items()}


def call(function: str, key: LockKey) -> sql.SQL:
    """``SELECT function(<key>)``, positional parameters: the key's numbers."""
    return _CALLS[(function, key.is_pair)]


def call_text(function: str, pair: bool) -> str:
    """:func:`call` as plain text, for the statements of a tight loop."""
    return _CALL_TEXTS[(function, pair)]


def named_call_text(function: str, pair: bool) -> sql.Composed:
    """``function(<key>)`` with named parameters ``k1`` (and ``k2`` for a pair): :func:`key_params`."""
    if pair:
        return sql.SQL("{}(%(k1)s::integer, %(k2)s::integer)").format(catalog_function(function))
    return sql.SQL("{}(%(k1)s::bigint)").format(catalog_function(function))


def key_params(key: LockKey) -> dict[str, Any]:
    """:func:`named_call_text`'s parameters: the key's numbers."""
    if key.is_pair:
        return {"k1": key.numbers[0], "k2": key.numbers[-1]}
    return {"k1": key.int64}


def liveness_statement(
    liveness: Liveness, *, local: bool, server_version_num: int, session_lock: bool | None = None
) -> sql.Composed:
    """``SELECT set_config(...), ...`` for the lease's server settings, values inlined (no
    parameters, so that it can travel with other statements in one simple query).

    :param local: for the current transaction only (a transaction lock), else for the session.
    :param server_version_num: settings this server version lacks are left out.
    :param session_lock: whose settings: a session lock's or a transaction lock's (by default
        ``not local``). A session lock's set ``local``ly are ``doctor``'s check, which leaves nothing.
    """
    session = not local if session_lock is None else session_lock
    settings = liveness.server_settings(transaction=not session, server_version_num=server_version_num)
    selects = sql.SQL(", ").join(
        sql.SQL("pg_catalog.set_config({}, {}, {})").format(sql.Literal(name), sql.Literal(value), sql.Literal(local))
        for name, value in settings.items()
    )
    return sql.SQL("SELECT {}").format(selects)


#: Whether some lock scope may be live now: the scope horizon (``pg/scopes.py``) has not passed.
#: Read by the sequence's oid, not MVCC (never stale), and false where the sequence is missing.
#: Compared with the transaction's start (``now()``, never later than the read: it errs towards a
#: read of the rows), as timestamps: ``extract(epoch ...)`` and a numeric comparison cost a fresh
#: backend 0.4 ms more to plan (measured), paid by every lock statement of a named key.
HORIZON_LIVE = (
    "pg_catalog.to_timestamp(coalesce(pg_catalog.pg_sequence_last_value(pg_catalog.to_regclass('pglock.scope_horizon')),"
    " 0)) >= pg_catalog.now()"
)


# Asked when a read of pg_locks finds a key free (the answer a standby must not give: it holds none
# of the primary's locks), so a busy key costs no round trip more; and by the wake-ups' connection
# as it connects (a standby cannot LISTEN).
IN_RECOVERY = "SELECT pg_catalog.pg_is_in_recovery()"


def refuse_a_standby(info: psycopg.ConnectionInfo, in_recovery: bool) -> None:
    """Raise :class:`~airflow_pglock.exceptions.StandbyServerError` when the server is in recovery."""
    if in_recovery:
        raise StandbyServerError(
            f"the lock database {info.dbname!r} at {info.host}:{info.port} is a standby in recovery: advisory "
            "locks are not replicated, so it shows none of the primary's holders and every key would look free; "
            "point the connection at the primary (with several hosts: target_session_attrs=read-write)"
        )
