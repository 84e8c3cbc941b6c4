"""AdvisoryLockHook: the Airflow-facing entry point to the lock database, and the lock SQL.

Every lock gets its own dedicated psycopg 3 connection, opened for it and closed after
it (never a pooled one: ``pg_try_advisory_lock`` returns true again on a session that
already holds the key, so a reused session would let two tasks "both" hold it). The
other SQL of the provider lives next to it in ``hooks/``: the holders query
(``holders.py``), the operators' views (``inspection.py``), the schema (``schema.py``,
``ledger.py``). Where the database is comes from ``connection.py``; whether the server
at the other end is safe for a lock, from the rules in ``server.py``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import select
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn

import psycopg
from psycopg import sql

from airflow_pglock.compat import BaseHook
from airflow_pglock.exceptions import (
    LockConfigurationError,
    LockConnectionError,
    PgLockError,
    UnsafeSetupError,
)
from airflow_pglock.hooks import connection as connection_settings
from airflow_pglock.hooks import server as server_rules
from airflow_pglock.hooks.connection import ConnectionSettings, redact
from airflow_pglock.hooks.holders import LockHolder, aread_holders, read_holders
from airflow_pglock.hooks.server import MIN_SERVER_VERSION, Scope, ServerInfo
from airflow_pglock.keys import LockKey
from airflow_pglock.liveness import IDLE_SESSION_TIMEOUT_VERSION, Liveness

__all__ = ["MIN_SERVER_VERSION", "AdvisoryLockHook", "HeldLock", "LockHolder", "Scope", "ServerInfo", "redact"]

DEFAULT_CONNECT_TIMEOUT = 10
#: application_name of the short sessions that only read who holds a key.
INSPECT_APPLICATION_NAME = "pglock inspect"
#: What a heartbeat found: the key is held; it is not; the protected work is using the
#: connection (transaction mode: the session is busy, hence not idle); no answer in time.
ProbeResult = Literal["held", "not held", "busy", "no answer"]
# Whether a session ({0}) holds a key in this database: pg_locks, filtered to that pid.
HELD_CONDITION = (
    "EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND pid = {0}"
    " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    " AND classid = {1}::oid AND objid = {2}::oid AND objsubid = {3}::int2 AND mode = {4} AND granted)"
)
# ...and, for a transaction lock, that the session is still in the transaction that took it
# (a COMMIT then BEGIN on the lock's connection ends the lock; the key may even be taken
# again in the new transaction, which is not the lock the guard holds).
IN_LOCK_TRANSACTION = " AND txid_current_if_assigned() IS NOT DISTINCT FROM {0}::bigint"
# The same seen from another session: the holder's current top-level transaction id (32 bits).
_SIDE_IN_LOCK_TRANSACTION = (
    " AND (SELECT backend_xid::text::bigint FROM pg_stat_activity WHERE pid = {0}) = mod({1}::bigint, 4294967296)"
)


def held_sql(pid: str, placeholders: tuple[str, str, str, str], xact: str | None) -> str:
    """``SELECT <pid holds the key [in transaction xact]>`` with the given placeholders."""
    condition = HELD_CONDITION.format(pid, *placeholders)
    if xact is not None:
        condition += IN_LOCK_TRANSACTION.format(xact)
    return f"SELECT {condition}"


def held_params(key: LockKey, shared: bool) -> list[Any]:
    classid, objid, objsubid = key.pg_locks
    return [classid, objid, objsubid, "ShareLock" if shared else "ExclusiveLock"]


# The errors a server that only looks like PostgreSQL (PgBouncer's admin console, other
# wire-compatible systems) answers to the inspection query.
_NOT_POSTGRES_ERRORS: tuple[type[psycopg.Error], ...] = (
    psycopg.errors.UndefinedFunction,
    psycopg.errors.ProtocolViolation,
    psycopg.errors.FeatureNotSupported,
    psycopg.errors.SyntaxError,
)


def check_wait_timeout(timeout: object) -> None:
    """Refuse a wait timeout that is not a positive number of seconds (LockConfigurationError)."""
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise LockConfigurationError(f"wait timeout must be a positive number of seconds, got {timeout!r}")


@dataclass
class HeldLock:
    """A lock held on its own dedicated connection. Release it (or let a context manager).

    :param key: the key held.
    :param shared: whether the lock is shared (readers) rather than exclusive.
    :param scope: ``"session"`` or ``"transaction"``.
    :param connection: the dedicated connection; in transaction scope, do your database
        work on it: it runs inside the transaction that holds the lock.
    :param server: what the connection found at the other end.
    :param hook: the hook that took the lock (used to release it).
    :param acquired_at: when the lock was taken (UTC).
    :param acquired_monotonic: ``time.monotonic()`` at acquisition, for durations.
    :param released: True once :meth:`release` ran.
    :param xact_id: transaction scope: the id (``txid_current()``) of the transaction that
        holds the lock; every later check verifies the session is still in it.
    """

    key: LockKey
    shared: bool
    scope: Scope
    connection: psycopg.Connection[Any]
    server: ServerInfo
    hook: AdvisoryLockHook
    acquired_at: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.UTC))
    acquired_monotonic: float = field(default_factory=time.monotonic)
    released: bool = False
    xact_id: int | None = None

    def is_held(self) -> bool:
        """Ask the server whether this session still holds the key (a round trip).

        False once the session has ended (the lease ran out while the connection sat idle,
        the session was terminated, the connection broke): the server released the lock
        with it. The reason is logged as a warning; the error never reaches the caller.
        """
        if self.connection.closed:
            return False
        try:
            return self.hook.is_held(self.connection, self.key, self.shared, self.xact_id)
        except psycopg.OperationalError as error:  # AdminShutdown, IdleSessionTimeout, a broken connection...
            self.hook.log.warning(
                "pglock %s is no longer held: its session ended (%s: %s)",
                self.key.describe(),
                type(error).__name__,
                str(error).strip(),
            )
            self.connection.close()
            return False

    def release(self) -> bool:
        """Release the lock and close its connection. Idempotent.

        Returns whether the lock was really held until now (False when it had been lost,
        e.g. the session was terminated, or when it was released already). A transaction
        lock is released by the end of its transaction: here that is a rollback.
        """
        if self.released:
            return False
        self.released = True
        was_held = False
        try:
            if self.scope == "session" and not self.connection.closed:
                was_held = self.hook.unlock(self.connection, self.key, shared=self.shared)
            elif self.scope == "transaction" and not self.connection.closed:
                was_held = self.hook.is_held(self.connection, self.key, self.shared, self.xact_id)
        except psycopg.Error:
            was_held = False  # the connection broke: the server has dropped the lock with it
        finally:
            self.connection.close()
        return was_held

    @property
    def held_seconds(self) -> float:
        return time.monotonic() - self.acquired_monotonic

    @property
    def transaction_open(self) -> bool:
        """Transaction scope: False once the lock's transaction was ended on its connection."""
        return self.connection.info.transaction_status != psycopg.pq.TransactionStatus.IDLE

    def commit_if_held(self, record: Callable[[], bool]) -> bool:
        """Transaction scope: commit the lock's transaction if the session is still in it and
        holds the key; ``record()`` runs first, inside it (e.g. the completion record; it
        returns False when it found the lock not held).

        Returns False, committing nothing, when the lock was not held any more (the work
        ended the transaction, or took the key again in another one). Raises the driver's
        error when the session ended or the transaction was aborted (nothing committed).
        """
        status = self.connection.info.transaction_status
        if status == psycopg.pq.TransactionStatus.IDLE:
            return False
        if status == psycopg.pq.TransactionStatus.INTRANS and not self.hook.is_held(
            self.connection, self.key, self.shared, self.xact_id
        ):
            return False
        if not record():
            return False
        self.hook.commit(self.connection)
        return True

    def unlock_checked(self) -> bool:
        """Session scope: unlock (the connection stays open); whether the key was still held."""
        return self.hook.unlock(self.connection, self.key, shared=self.shared)

    def close(self) -> None:
        """Close the connection: the session ends, an open transaction rolls back, the lock goes
        with them. Idempotent; no check (see :meth:`release` for that)."""
        self.released = True
        self.connection.close()


class AdvisoryLockHook(BaseHook):
    """PostgreSQL advisory locks on dedicated connections, read from an Airflow connection.

    Reads a standard Airflow Postgres connection (host, port, schema = database, login,
    password and libpq extras such as ``sslmode``, ``sslrootcert``, ``options``; IAM
    tokens as ``PostgresHook`` does). Each lock connection differs from PostgresHook's in
    three ways, each needed for a correct lock: autocommit (an aborted transaction can
    never block the unlock), an ``application_name`` naming the holder, and liveness
    settings that bound how long a dead holder keeps the lock.

    :param postgres_conn_id: the Airflow connection id (conn type ``postgres``).
    :param dsn: a libpq connection string or URI to use instead of an Airflow connection.
    :param connect_timeout: seconds to wait for a connection (default 10; the
        connection's own ``connect_timeout`` extra wins).
    :param liveness: lease-derived liveness settings (default: a 30 s lease).
    """

    conn_name_attr = "postgres_conn_id"
    default_conn_name = "postgres_default"
    conn_type = "postgres"
    hook_name = "PostgreSQL advisory lock"

    def __init__(
        self,
        postgres_conn_id: str = default_conn_name,
        *,
        dsn: str | None = None,
        connect_timeout: int = DEFAULT_CONNECT_TIMEOUT,
        liveness: Liveness | None = None,
    ) -> None:
        super().__init__()
        if dsn is None and (not isinstance(postgres_conn_id, str) or not postgres_conn_id.strip()):
            raise LockConfigurationError(f"postgres_conn_id must be a non-empty string, got {postgres_conn_id!r}")
        if isinstance(connect_timeout, bool) or not isinstance(connect_timeout, int) or connect_timeout < 1:
            raise LockConfigurationError(
                f"connect_timeout must be a whole number of seconds >= 1, got {connect_timeout!r}"
            )
        self.postgres_conn_id = postgres_conn_id
        self.dsn = dsn
        self.connect_timeout = connect_timeout
        self.liveness = liveness or Liveness()
        self._last_settings: ConnectionSettings | None = None

    # ----------------------------------------------------------------- connections

    def resolve_settings(self) -> ConnectionSettings:
        """Where the lock database is (the DSN, or the Airflow connection as PostgresHook reads it).

        Resolved anew for each lock connection, as ``PostgresHook.get_conn`` does: an IAM
        token or a rotated password is fresh each time.
        """
        if self.dsn is not None:
            return connection_settings.from_dsn(self.dsn)
        return connection_settings.from_airflow(self.postgres_conn_id, self.get_connection)

    def get_conn(self) -> psycopg.Connection[Any]:
        """A new dedicated autocommit connection to the lock database (Airflow's hook API); close it."""
        return self.connect()

    def connection_kwargs(self) -> dict[str, Any]:
        """libpq parameters of the configured connection (no liveness, no app name)."""
        return dict(self.resolve_settings().params)

    @staticmethod
    def _raise_connect_error(error: psycopg.Error, where: str) -> NoReturn:
        if isinstance(error, psycopg.ProgrammingError):
            raise LockConfigurationError(
                f"invalid connection settings for the lock database {where}: {redact(str(error))}"
            ) from None
        raise LockConnectionError(
            f"cannot connect to the lock database {where}: {redact(str(error))}".strip()
        ) from error

    def connect(
        self,
        application_name: str | None = None,
        settings: ConnectionSettings | None = None,
        *,
        server_settings: Mapping[str, str] | None = None,
    ) -> psycopg.Connection[Any]:
        """Open a new dedicated autocommit connection for one lock.

        :param application_name: names the holder in ``pg_stat_activity``.
        :param settings: where to connect (default: :meth:`resolve_settings`).
        :param server_settings: server settings to send in the start-up packet.
        """
        settings = settings or self.resolve_settings()
        self._last_settings = settings  # for side_connection(), see there
        kwargs = settings.session_params(
            application_name, self.liveness, self.connect_timeout, server_settings=server_settings
        )
        where = connection_settings.describe_params(kwargs, settings.source)
        try:
            return psycopg.Connection.connect(autocommit=True, **kwargs)
        except psycopg.Error as error:
            self._raise_connect_error(error, where)

    async def aconnect(self, application_name: str | None = None) -> psycopg.AsyncConnection[Any]:
        """Async :meth:`connect` (for triggers): same settings, same errors.

        The Airflow connection is resolved in a worker thread (``sync_to_async``), as the
        official providers' triggers do: reading it (and an IAM token) is blocking I/O.

        :param application_name: names the session in ``pg_stat_activity``.
        """
        from asgiref.sync import sync_to_async

        settings = await sync_to_async(self.resolve_settings)()
        kwargs = settings.session_params(application_name, self.liveness, self.connect_timeout)
        where = connection_settings.describe_params(kwargs, settings.source)
        try:
            return await psycopg.AsyncConnection.connect(autocommit=True, **kwargs)
        except psycopg.Error as error:
            self._raise_connect_error(error, where)

    def describe_target(self) -> str:
        """``'db' on host:port as user (conn id 'x')``; never the password."""
        return self.resolve_settings().describe()

    def server_started_at(self) -> dt.datetime | None:
        """``pg_postmaster_start_time()`` on a :meth:`side_connection`; None if unreachable."""
        try:
            with self.side_connection() as conn:
                row = conn.execute("SELECT pg_postmaster_start_time()").fetchone()
                return row[0] if row else None
        except (psycopg.Error, PgLockError):
            return None

    def side_connection(
        self, application_name: str = INSPECT_APPLICATION_NAME, connect_timeout: int = 2
    ) -> psycopg.Connection[Any]:
        """A short autocommit connection next to a lock's.

        Reuses the settings of the last :meth:`connect`: it is called from the heartbeat
        thread, which must not ask Airflow for the connection again (the task's channel to
        Airflow is not thread-safe).
        """
        settings = self._last_settings or self.resolve_settings()
        kwargs = {
            **settings.session_params(application_name, self.liveness, self.connect_timeout),
            "connect_timeout": connect_timeout,
        }
        return psycopg.Connection.connect(autocommit=True, **kwargs)

    def holds_seen_from_aside(self, held: HeldLock) -> bool | None:
        """Whether ``held``'s session still holds its key (in its transaction), asked from a
        side connection: for when the lock's own connection is busy with the work (COPY,
        streaming). None when the server cannot be reached."""
        pid = held.server.backend_pid
        statement = "SELECT " + HELD_CONDITION.format("%s", "%s", "%s", "%s", "%s")
        params: list[Any] = [pid, *held_params(held.key, held.shared)]
        if held.xact_id is not None:
            statement += _SIDE_IN_LOCK_TRANSACTION.format("%s", "%s")
            params += [pid, held.xact_id]
        try:
            with self.side_connection() as conn:
                row = conn.execute(statement, params).fetchone()  # type: ignore[arg-type]  # static SQL
        except (psycopg.OperationalError, PgLockError):
            return None
        return bool(row and row[0])

    def inspect_server(self, conn: psycopg.Connection[Any]) -> ServerInfo:
        """Read what is at the other end of a lock connection, in one round trip."""
        try:
            row = conn.execute(
                "SELECT pg_backend_pid(), current_setting('server_version_num')::int, version(),"
                " current_database(), host(inet_server_addr()), inet_server_port(), pg_is_in_recovery(),"
                " pg_postmaster_start_time()"
            ).fetchone()
        except _NOT_POSTGRES_ERRORS as error:
            claims = conn.info.parameter_status("server_version") or "unknown"
            raise UnsafeSetupError(
                f"the lock database does not look like PostgreSQL (it reports server_version {claims!r} and "
                f"answered the inspection query with: {str(error).strip()}); advisory locks need a PostgreSQL "
                "server (directly, or through PgBouncer to a real database, not its admin console)"
            ) from None
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

    @staticmethod
    def check_server(info: ServerInfo, scope: Scope, pool_mode: str | None = None) -> None:
        """Refuse set-ups where an advisory lock would exclude nobody (the rules of ``hooks/server.py``).

        :param info: what the lock connection found at the other end.
        :param scope: the lock's scope (``"session"`` or ``"transaction"``).
        :param pool_mode: the connection's declared ``pool_mode`` extra, if any.
        """
        server_rules.check_server(info, scope, pool_mode)

    def apply_liveness(
        self, conn: psycopg.Connection[Any], *, local: bool, server_version_num: int = IDLE_SESSION_TIMEOUT_VERSION
    ) -> None:
        """Set the server-side liveness settings; ``local`` = for the current transaction only.

        :param server_version_num: settings this server version lacks are left out.
        """
        settings = self.liveness.server_settings(transaction=local, server_version_num=server_version_num)
        selects = sql.SQL(", ").join(
            sql.SQL("set_config({}, {}, {})").format(sql.Literal(name), sql.Placeholder(), sql.Literal(local))
            for name in settings
        )
        conn.execute(sql.SQL("SELECT {}").format(selects), list(settings.values()))

    def open_lock_session(
        self, application_name: str | None, scope: Scope
    ) -> tuple[psycopg.Connection[Any], ServerInfo]:
        """Connect, check the server and set liveness; on any error nothing is left open.

        A session lock's liveness settings go in the start-up packet (no statement of their
        own) unless the connection declares a pooler (``pool_mode``): a pooler refuses them or,
        configured to ignore them, drops them silently. Refused anyway (PgBouncer, or a server
        older than a setting), the connection is opened again without them and they are set by
        a statement, as through a declared pooler.
        """
        settings = self.resolve_settings()
        startup = None
        if scope == "session" and settings.pool_mode is None:
            startup = self.liveness.server_settings(transaction=False)
        try:
            conn = self.connect(application_name, settings, server_settings=startup)
        except LockConnectionError as error:
            if startup is None or not connection_settings.refused_startup_options(error):
                raise
            startup = None
            conn = self.connect(application_name, settings)
        try:
            info = self.inspect_server(conn)
            self.check_server(info, scope, settings.pool_mode)
            if info.behind_pooler:
                # Through PgBouncer, a server-side prepared statement may outlive the transaction on a
                # server session another client gets next: never prepare on a lock connection.
                conn.prepare_threshold = None
            if scope == "session" and (startup is None or info.behind_pooler):
                self.apply_liveness(conn, local=False, server_version_num=info.version_num)
            return conn, info
        except BaseException:
            conn.close()
            raise

    # ------------------------------------------------------------------ primitives

    @staticmethod
    def _call(function: str, key: LockKey) -> sql.Composed:
        casts = [sql.SQL("%s::bigint")] if not key.is_pair else [sql.SQL("%s::integer")] * 2
        return sql.SQL("SELECT {}({})").format(sql.Identifier(function), sql.SQL(", ").join(casts))

    @staticmethod
    def _function(base: str, shared: bool) -> str:
        return f"{base}_shared" if shared else base

    def try_lock(
        self, conn: psycopg.Connection[Any], key: LockKey, *, shared: bool = False, scope: Scope = "session"
    ) -> bool:
        """One ``pg_try_advisory[_xact]_lock[_shared]`` on ``conn``; True if taken."""
        base = "pg_try_advisory_lock" if scope == "session" else "pg_try_advisory_xact_lock"
        row = conn.execute(self._call(self._function(base, shared), key), key.numbers).fetchone()
        return bool(row and row[0])

    def wait_lock(
        self,
        conn: psycopg.Connection[Any],
        key: LockKey,
        timeout: float,
        *,
        shared: bool = False,
        scope: Scope = "session",
    ) -> bool:
        """Wait at most ``timeout`` seconds for the key, enforced by the server (``lock_timeout``).

        Returns False when the wait timed out; a timed-out wait holds nothing.
        """
        check_wait_timeout(timeout)
        base = "pg_advisory_lock" if scope == "session" else "pg_advisory_xact_lock"
        statement = self._call(self._function(base, shared), key)
        timeout_ms = f"{max(1, round(timeout * 1000))}ms"
        # lock_timeout bounds the wait; statement_timeout is lifted so that a shorter one set
        # for the role cannot turn "still busy" into an error. Both are SET LOCAL: in session
        # scope they end with the short transaction (the session lock outlives its commit); in
        # transaction scope they are put back afterwards.
        previous = None
        if scope == "transaction":
            previous = conn.execute(
                "SELECT current_setting('lock_timeout'), current_setting('statement_timeout')"
            ).fetchone()
        try:
            with conn.transaction(savepoint_name="pglock_wait" if scope == "transaction" else None):
                conn.execute(
                    "SELECT set_config('lock_timeout', %s, true), set_config('statement_timeout', '0', true)",
                    [timeout_ms],
                )
                conn.execute(statement, key.numbers)
            if previous is not None:
                conn.execute(
                    "SELECT set_config('lock_timeout', %s, true), set_config('statement_timeout', %s, true)",
                    list(previous),
                )
        except psycopg.errors.LockNotAvailable:
            return False
        return True

    @staticmethod
    def commit(conn: psycopg.Connection[Any]) -> None:
        """COMMIT the lock's transaction; fail loudly if it was already ended or PostgreSQL rolled back."""
        if conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
            raise psycopg.errors.NoActiveSqlTransaction(
                "the lock's transaction was already ended on its connection (a COMMIT or ROLLBACK by the work): "
                "the lock ended with it, and whatever ran afterwards ran without the lock"
            )
        status = conn.execute("COMMIT").statusmessage
        if status != "COMMIT":
            raise psycopg.errors.InFailedSqlTransaction(
                f"the lock transaction was aborted by an earlier error, so PostgreSQL answered COMMIT with {status}: "
                "nothing was committed"
            )

    def unlock(self, conn: psycopg.Connection[Any], key: LockKey, *, shared: bool = False) -> bool:
        """``pg_advisory_unlock[_shared]``: True if this session held the key."""
        row = conn.execute(self._call(self._function("pg_advisory_unlock", shared), key), key.numbers).fetchone()
        return bool(row and row[0])

    def is_held(
        self, conn: psycopg.Connection[Any], key: LockKey, shared: bool = False, xact_id: int | None = None
    ) -> bool:
        """Whether this very session holds the key now (reads ``pg_locks``, takes nothing).

        :param xact_id: for a transaction lock, the transaction that took it: also check
            that the session is still in that transaction.
        """
        params = held_params(key, shared) + ([] if xact_id is None else [xact_id])
        statement = held_sql("pg_backend_pid()", ("%s", "%s", "%s", "%s"), None if xact_id is None else "%s")
        row = conn.execute(statement, params).fetchone()  # type: ignore[arg-type]  # static SQL from this module
        return bool(row and row[0])

    def probe(
        self,
        conn: psycopg.Connection[Any],
        key: LockKey,
        shared: bool,
        timeout: float,
        *,
        xact_id: int | None = None,
        before_giving_up: Callable[[], None] | None = None,
    ) -> ProbeResult:
        """The heartbeat: does this session still hold ``key``? Never blocks much longer than ``timeout``.

        Unlike :meth:`is_held`, it cannot hang on a dead network or a frozen server: when no
        answer has arrived after ``timeout`` seconds, it closes the connection (so the server
        drops the session as soon as it hears from it again) and returns ``"no answer"``.
        When the protected work is using the connection for that long (transaction mode),
        it returns ``"busy"``: a session running a statement is not idle, so the server keeps
        its lock; also while the work has a pipeline open on it (a query sent now would be
        queued behind the work's). A session that ended raises the server's error
        (``AdminShutdown``, ``IdleSessionTimeout``...) or ``OperationalError`` when the
        connection broke.

        :param conn: the lock's own connection.
        :param key: the key it should hold.
        :param shared: whether it holds the key in shared mode.
        :param timeout: seconds to wait for the connection and the answer together.
        :param xact_id: transaction scope: the lock's transaction (see :meth:`is_held`).
        :param before_giving_up: called when there is no answer, before the connection is
            closed (closing lets the server release the lock: interrupt the work first).
        """
        deadline = time.monotonic() + max(0.0, timeout)
        lock = conn.lock  # psycopg serialises the use of a connection with this lock
        if not lock.acquire(timeout=max(0.0, timeout)):
            return "busy"
        try:
            if conn.closed:
                raise psycopg.OperationalError("the lock connection is closed")
            pgconn = conn.pgconn
            if pgconn.pipeline_status != psycopg.pq.PipelineStatus.OFF:
                return "busy"
            params = [str(value) for value in held_params(key, shared)]
            if xact_id is not None:
                params.append(str(xact_id))
            statement = held_sql("pg_backend_pid()", ("$1", "$2", "$3", "$4"), None if xact_id is None else "$5")
            pgconn.send_query_params(statement.encode(), [value.encode() for value in params])
            results = self._results_before(pgconn, deadline)
            if results is None:
                if before_giving_up is not None:
                    before_giving_up()
                conn.close()  # the query is still in flight: this connection can never be used again
                return "no answer"
        finally:
            lock.release()
        for result in results:
            if result.status != psycopg.pq.ExecStatus.TUPLES_OK:
                raise psycopg.errors.error_from_result(result, encoding=conn.info.encoding)
        return "held" if results and results[-1].get_value(0, 0) == b"t" else "not held"

    @staticmethod
    def _results_before(pgconn: psycopg.pq.abc.PGconn, deadline: float) -> list[psycopg.pq.abc.PGresult] | None:
        """Every result of the query just sent on ``pgconn``; None if the deadline passed first.

        Past the deadline the socket is still polled once, without waiting: a thread that
        was stalled (GIL held by a C call, CPU starvation) past its deadline must not give up
        on an answer that arrived meanwhile.
        """

        def ready(events: int) -> bool:
            remaining = max(0.0, deadline - time.monotonic())
            poller = select.poll()
            poller.register(pgconn.socket, events)
            return bool(poller.poll(remaining * 1000))

        while pgconn.flush() != 0:
            if not ready(select.POLLOUT):
                return None
        results: list[psycopg.pq.abc.PGresult] = []
        while True:
            while pgconn.is_busy():
                if not ready(select.POLLIN):
                    return None
                try:
                    pgconn.consume_input()
                except psycopg.OperationalError:
                    # The server sent its reason (e.g. FATAL: terminating connection) and hung up.
                    if any(r.status == psycopg.pq.ExecStatus.FATAL_ERROR for r in results):
                        return results
                    raise
            result = pgconn.get_result()
            if result is None:
                return results
            results.append(result)

    def holders_on(self, conn: psycopg.Connection[Any], key: LockKey) -> list[LockHolder]:
        """Holders and waiters of ``key`` in the connection's database, holders first."""
        return read_holders(conn, key)

    async def aholders_on(self, conn: psycopg.AsyncConnection[Any], key: LockKey) -> list[LockHolder]:
        """Async :meth:`holders_on` (for triggers): reads ``pg_locks``, takes nothing."""
        return await aread_holders(conn, key)

    # --------------------------------------------------------------- lock objects

    def holders(self, key: LockKey | str | int | tuple[int, int]) -> list[LockHolder]:
        """Who holds or waits for ``key`` (pid, application_name, client, since), without touching it."""
        lock_key = LockKey.coerce(key)
        with self.connect(INSPECT_APPLICATION_NAME) as conn:
            return self.holders_on(conn, lock_key)

    async def aholders(self, key: LockKey | str | int | tuple[int, int]) -> list[LockHolder]:
        """Async :meth:`holders` on a short-lived connection of its own (closed even if cancelled)."""
        lock_key = LockKey.coerce(key)
        async with await self.aconnect(INSPECT_APPLICATION_NAME) as conn:
            return await self.aholders_on(conn, lock_key)

    def acquire_lock(
        self,
        key: LockKey | str | int | tuple[int, int],
        *,
        shared: bool,
        scope: Scope,
        timeout: float | None,
        application_name: str | None,
    ) -> HeldLock | None:
        """Open a dedicated connection and take the lock on it; None (and no connection) if busy.

        :param scope: ``"session"`` (autocommit; held until released) or ``"transaction"``
            (a transaction is opened and stays open; the lock ends with it).
        :param timeout: None to try once, or seconds to wait (enforced by the server).
        """
        lock_key = LockKey.coerce(key)
        if timeout is not None:
            check_wait_timeout(timeout)  # before any I/O: a bad setting is not a connection problem
        conn, info = self.open_lock_session(application_name, scope)
        try:
            xact_id = None
            if scope == "transaction":
                # READ COMMITTED whatever the database's or role's default: under REPEATABLE READ or
                # SERIALIZABLE the snapshot would be taken before the lock is granted, and the work
                # (and the once_per check) would read what was there before the previous holder
                # committed.
                conn.execute("BEGIN ISOLATION LEVEL READ COMMITTED")
                self.apply_liveness(conn, local=True, server_version_num=info.version_num)
            if timeout is None:
                acquired = self.try_lock(conn, lock_key, shared=shared, scope=scope)
            else:
                acquired = self.wait_lock(conn, lock_key, timeout, shared=shared, scope=scope)
            if not acquired:
                conn.close()
                return None
            if scope == "transaction":
                row = conn.execute("SELECT txid_current()").fetchone()
                xact_id = int(row[0]) if row else None
            return HeldLock(
                key=lock_key, shared=shared, scope=scope, connection=conn, server=info, hook=self, xact_id=xact_id
            )
        except BaseException:
            conn.close()
            raise

    def _acquire_and_record(
        self,
        key: LockKey | str | int | tuple[int, int],
        *,
        shared: bool,
        scope: Scope,
        timeout: float | None,
        application_name: str | None,
    ) -> HeldLock | None:
        """:meth:`acquire_lock`, then record the key's name in the key-name registry, as guarded tasks do."""
        held = self.acquire_lock(key, shared=shared, scope=scope, timeout=timeout, application_name=application_name)
        if held is not None:
            from airflow_pglock.registry import record_acquisition  # registry imports this module

            try:  # never raises an Exception; an interrupt must not leave the lock held
                record_acquisition(held, held.connection.info.parameter_status("application_name"), self.log)
            except BaseException:
                held.release()
                raise
        return held

    def try_acquire(
        self,
        key: LockKey | str | int | tuple[int, int],
        *,
        shared: bool = False,
        application_name: str | None = None,
    ) -> HeldLock | None:
        """Try once to take a session lock on a new dedicated connection; None if busy."""
        return self._acquire_and_record(
            key, shared=shared, scope="session", timeout=None, application_name=application_name
        )

    def acquire(
        self,
        key: LockKey | str | int | tuple[int, int],
        *,
        timeout: float,
        shared: bool = False,
        application_name: str | None = None,
    ) -> HeldLock | None:
        """Wait at most ``timeout`` seconds (server-side) for a session lock; None if it ran out."""
        return self._acquire_and_record(
            key, shared=shared, scope="session", timeout=timeout, application_name=application_name
        )

    @contextlib.contextmanager
    def session_lock(
        self,
        key: LockKey | str | int | tuple[int, int],
        *,
        shared: bool = False,
        timeout: float | None = None,
        application_name: str | None = None,
    ) -> Iterator[HeldLock | None]:
        """Hold a session lock for the ``with`` block; yields None when the key is busy.

        The lock is released and its connection closed when the block ends, however it ends.
        """
        held = self._acquire_and_record(
            key, shared=shared, scope="session", timeout=timeout, application_name=application_name
        )
        try:
            yield held
        finally:
            if held is not None:
                held.release()

    @contextlib.contextmanager
    def transaction_lock(
        self,
        key: LockKey | str | int | tuple[int, int],
        *,
        shared: bool = False,
        timeout: float | None = None,
        application_name: str | None = None,
    ) -> Iterator[HeldLock | None]:
        """Hold a transaction lock; do your database work on ``held.connection``.

        The transaction commits when the block ends normally (releasing the lock with it)
        and rolls back when it raises. Yields None when the key is busy.
        """
        held = self._acquire_and_record(
            key, shared=shared, scope="transaction", timeout=timeout, application_name=application_name
        )
        if held is None:
            yield None
            return
        try:
            yield held
            in_transaction = held.connection.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
            if in_transaction and not self.is_held(held.connection, held.key, held.shared, held.xact_id):
                raise psycopg.errors.NoActiveSqlTransaction(
                    "the lock's transaction was ended on its connection (a COMMIT or ROLLBACK by the work): the lock "
                    "ended with it, and whatever ran afterwards ran without the lock; not committed"
                )
            self.commit(held.connection)
        finally:
            held.released = True
            held.connection.close()  # closing an open transaction rolls it back
