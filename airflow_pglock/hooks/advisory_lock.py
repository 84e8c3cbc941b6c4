"""AdvisoryLockHook: the only place in airflow-pglock that speaks SQL.

Every lock gets its own dedicated psycopg 3 connection, opened for it and closed after
it (never a pooled one: ``pg_try_advisory_lock`` returns true again on a session that
already holds the key, so a reused session would let two tasks "both" hold it).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import re
import select
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from airflow_pglock.compat import BaseHook
from airflow_pglock.exceptions import (
    LockConfigurationError,
    LockConnectionError,
    PgLockError,
    UnsafeSetupError,
)
from airflow_pglock.keys import LockKey
from airflow_pglock.liveness import IDLE_SESSION_TIMEOUT_VERSION, Liveness

Scope = Literal["session", "transaction"]

DEFAULT_CONNECT_TIMEOUT = 10
#: application_name of the short sessions that only read who holds a key.
INSPECT_APPLICATION_NAME = "pglock inspect"
MIN_SERVER_VERSION = 120000  # tcp_user_timeout needs PostgreSQL 12
POSTGRES_CONN_TYPES = frozenset({"postgres", "postgresql"})
#: What a heartbeat found: the key is held; it is not; the protected work is using the
#: connection (transaction mode: the session is busy, hence not idle); no answer in time.
ProbeResult = Literal["held", "not held", "busy", "no answer"]
# Whether this very session holds a key: pg_locks, filtered to our pid and database.
_HELD_SQL = (
    "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
    " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    " AND classid = {0}::oid AND objid = {1}::oid AND objsubid = {2}::int2 AND mode = {3} AND granted)"
)
# The errors a server that only looks like PostgreSQL (PgBouncer's admin console, other
# wire-compatible systems) answers to the inspection query.
_NOT_POSTGRES_ERRORS: tuple[type[psycopg.Error], ...] = (
    psycopg.errors.UndefinedFunction,
    psycopg.errors.ProtocolViolation,
    psycopg.errors.FeatureNotSupported,
    psycopg.errors.SyntaxError,
)
# PostgresHook extras that are not libpq parameters (it drops these too).
_NON_LIBPQ_EXTRAS = frozenset({"cursor", "pool_mode"})

# Holders and waiters of one key in the current database, holders first. Reads pg_locks
# and pg_stat_activity only: it takes no lock (a sensor must never make a contender skip).
_HOLDERS_SQL = (
    "SELECT l.pid, l.granted, l.mode, a.application_name, host(a.client_addr) AS client_addr,"
    " a.backend_start, l.waitstart, a.xact_start, a.usename, a.state"
    " FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid"
    " WHERE l.locktype = 'advisory'"
    " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    " AND l.classid = %s AND l.objid = %s AND l.objsubid = %s"
    " ORDER BY l.granted DESC, l.waitstart NULLS FIRST, l.pid"
)


_URI_PASSWORD = re.compile(r"(://[^:/@\s]*:)[^@\s]*@")
_KEYWORD_PASSWORD = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)


def redact(text: str) -> str:
    """``text`` with passwords in URIs (``://user:pw@``) and ``password=...`` replaced by ``***``.

    libpq repeats a malformed connection string word for word in its error message.
    """
    return _KEYWORD_PASSWORD.sub(r"\1***", _URI_PASSWORD.sub(r"\1***@", text))


@dataclass(frozen=True)
class ServerInfo:
    """What a lock connection found at the other end.

    :param backend_pid: ``pg_backend_pid()`` of the lock session.
    :param reported_pid: the backend pid the wire protocol reported; a pooler fakes it.
    :param version_num: ``server_version_num``, e.g. 150004.
    :param version: the server's version string.
    :param database: the database connected to.
    :param server_addr: ``inet_server_addr()``; None over a local socket.
    :param server_port: ``inet_server_port()``; None over a local socket.
    :param in_recovery: ``pg_is_in_recovery()``: True on a standby (refused for locks).
    :param started_at: ``pg_postmaster_start_time()``.
    """

    backend_pid: int
    reported_pid: int
    version_num: int
    version: str
    database: str
    server_addr: str | None
    server_port: int | None
    in_recovery: bool
    started_at: dt.datetime

    @property
    def behind_pooler(self) -> bool:
        """True when a connection pooler (PgBouncer, Odyssey, RDS Proxy...) sits in between."""
        return self.reported_pid != self.backend_pid

    @property
    def server(self) -> str:
        if self.server_addr is None:
            return "local socket"
        return f"{self.server_addr}:{self.server_port}"


@dataclass(frozen=True)
class LockHolder:
    """A session that holds or waits for a key, as ``pg_locks`` and ``pg_stat_activity`` see it.

    ``since`` is when the holder's session started; airflow-pglock opens a session per lock,
    so for its holders that is within milliseconds of the acquisition.

    :param pid: the holder's backend pid.
    :param granted: True when it holds the key, False when it waits for it.
    :param mode: ``ExclusiveLock`` or ``ShareLock``.
    :param application_name: the session's application_name (airflow-pglock's names the DAG,
        task and run); None when hidden (another role without ``pg_read_all_stats``) or unset.
    :param client_addr: the client's address; None over a local socket or when hidden.
    :param since: when the session started (``backend_start``).
    :param waiting_since: when a waiter started waiting (``pg_locks.waitstart``, PostgreSQL 14+).
    :param transaction_start: start of the session's current transaction, if any.
    :param user: the session's role.
    :param state: ``pg_stat_activity.state`` (``idle``, ``active``, ...).
    """

    pid: int
    granted: bool
    mode: str
    application_name: str | None
    client_addr: str | None
    since: dt.datetime | None
    waiting_since: dt.datetime | None
    transaction_start: dt.datetime | None
    user: str | None
    state: str | None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> LockHolder:
        """A holder from a row of the holders query (see ``AdvisoryLockHook.holders_on``)."""
        return cls(
            pid=row["pid"],
            granted=row["granted"],
            mode=row["mode"],
            application_name=row["application_name"],
            client_addr=row["client_addr"],
            since=row["backend_start"],
            waiting_since=row["waitstart"],
            transaction_start=row["xact_start"],
            user=row["usename"],
            state=row["state"],
        )

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
    """

    key: LockKey
    shared: bool
    scope: Scope
    connection: psycopg.Connection[Any]
    server: ServerInfo
    hook: AdvisoryLockHook
    acquired_at: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.timezone.utc))
    acquired_monotonic: float = field(default_factory=time.monotonic)
    released: bool = False

    def is_held(self) -> bool:
        """Ask the server whether this session still holds the key (a round trip)."""
        return self.hook.is_held(self.connection, self.key, self.shared)

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
                was_held = self.hook.is_held(self.connection, self.key, self.shared)
        except psycopg.Error:
            was_held = False  # the connection broke: the server has dropped the lock with it
        finally:
            self.connection.close()
        return was_held

    @property
    def held_seconds(self) -> float:
        return time.monotonic() - self.acquired_monotonic


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
        self._declared_pool_mode: str | None = None

    # ----------------------------------------------------------------- connections

    def connection_kwargs(self) -> dict[str, Any]:
        """libpq parameters of the configured connection (no liveness, no app name)."""
        if self.dsn is not None:
            try:
                return dict(psycopg.conninfo.conninfo_to_dict(self.dsn))
            except psycopg.ProgrammingError as error:
                raise LockConfigurationError(f"invalid DSN for the lock database: {redact(str(error))}") from None
        return self._airflow_connection_kwargs()

    def _airflow_connection_kwargs(self) -> dict[str, Any]:
        from airflow.providers.postgres.hooks.postgres import PostgresHook

        try:
            airflow_conn = self.get_connection(self.postgres_conn_id)
        except Exception as error:  # Airflow raises its own NotFound types, which differ by version
            raise LockConfigurationError(
                f"Airflow connection {self.postgres_conn_id!r} was not found ({type(error).__name__}: {error}); "
                "create a connection of type 'postgres' with that id in the Airflow UI or as "
                f"AIRFLOW_CONN_{self.postgres_conn_id.upper()}"
            ) from None
        conn_type = (airflow_conn.conn_type or "").lower()
        if conn_type not in POSTGRES_CONN_TYPES:
            raise LockConfigurationError(
                f"Airflow connection {self.postgres_conn_id!r} has conn_type {airflow_conn.conn_type!r}; "
                "advisory locks need a PostgreSQL connection (conn_type 'postgres')"
            )
        self._declared_pool_mode = airflow_conn.extra_dejson.get("pool_mode")

        captured: dict[str, Any] = {}

        class _ConnArgsOnly(PostgresHook):
            # PostgresHook.get_conn() resolves extras and IAM tokens, then hands the libpq
            # arguments to _create_connection: keep them, open nothing.
            def _create_connection(self, conn_args: dict[str, Any]) -> Any:
                captured.update(conn_args)
                return None

        # connection= (DbApiHook's own argument), not the deprecated setter, which logs a warning
        postgres_hook = _ConnArgsOnly(postgres_conn_id=self.postgres_conn_id, connection=airflow_conn)
        opened = postgres_hook.get_conn()
        if not captured:  # an older PostgresHook connected by itself instead of handing us its arguments
            if opened is not None:
                opened.close()
            raise LockConfigurationError(
                "this apache-airflow-providers-postgres is too old for airflow-pglock (PostgresHook has no "
                "_create_connection); upgrade it to 6.8 or newer"
            )
        return {k: v for k, v in captured.items() if v is not None and k not in _NON_LIBPQ_EXTRAS}

    def _lock_connection_kwargs(self, base: dict[str, Any], application_name: str | None) -> dict[str, Any]:
        kwargs = dict(base)
        kwargs.setdefault("connect_timeout", self.connect_timeout)
        # The lease's keepalive settings win over the connection's extras: they bound how long
        # a dead peer goes unnoticed, and a looser extra would silently break that bound.
        kwargs.update(self.liveness.client_settings())
        if application_name:
            kwargs["application_name"] = application_name
        return kwargs

    @staticmethod
    def _raise_connect_error(error: psycopg.Error, where: str) -> NoReturn:
        if isinstance(error, psycopg.ProgrammingError):
            raise LockConfigurationError(
                f"invalid connection settings for the lock database {where}: {redact(str(error))}"
            ) from None
        raise LockConnectionError(
            f"cannot connect to the lock database {where}: {redact(str(error))}".strip()
        ) from error

    def connect(self, application_name: str | None = None) -> psycopg.Connection[Any]:
        """Open a new dedicated autocommit connection for one lock.

        :param application_name: names the holder in ``pg_stat_activity``.
        """
        kwargs = self._lock_connection_kwargs(self.connection_kwargs(), application_name)
        # Kept for server_started_at(), which the heartbeat thread calls: it must not ask
        # Airflow for the connection again (the task's channel to Airflow is not thread-safe).
        self._resolved_kwargs = kwargs
        where = self.describe_target(kwargs)
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

        base = await sync_to_async(self.connection_kwargs)()
        kwargs = self._lock_connection_kwargs(base, application_name)
        where = self.describe_target(kwargs)
        try:
            return await psycopg.AsyncConnection.connect(autocommit=True, **kwargs)
        except psycopg.Error as error:
            self._raise_connect_error(error, where)

    def describe_target(self, kwargs: Mapping[str, Any] | None = None) -> str:
        """``'db' on host:port as user (conn id 'x')``; never the password."""
        kwargs = kwargs if kwargs is not None else self.connection_kwargs()
        source = "DSN" if self.dsn is not None else f"conn id {self.postgres_conn_id!r}"
        host = kwargs.get("host") or "local socket"
        port = kwargs.get("port") or 5432
        database = kwargs.get("dbname") or "(default database)"
        user = kwargs.get("user") or "(default user)"
        return f"{database!r} on {host}:{port} as {user!r} ({source})"

    def server_started_at(self) -> dt.datetime | None:
        """``pg_postmaster_start_time()`` on a fresh short connection; None if unreachable.

        Reuses the settings of the last :meth:`connect` (never asks Airflow again: it is
        called from the heartbeat thread), with a 2 s connect timeout.
        """
        try:
            kwargs = getattr(self, "_resolved_kwargs", None) or self.connection_kwargs()
            kwargs = {**kwargs, "connect_timeout": 2, "application_name": INSPECT_APPLICATION_NAME}
            with psycopg.Connection.connect(autocommit=True, **kwargs) as conn:
                row = conn.execute("SELECT pg_postmaster_start_time()").fetchone()
                return row[0] if row else None
        except (psycopg.Error, PgLockError):
            return None

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

    def check_server(self, info: ServerInfo, scope: Scope) -> None:
        """Refuse set-ups where an advisory lock would exclude nobody."""
        if not info.version.startswith("PostgreSQL") or any(
            fork in info.version for fork in ("Redshift", "CockroachDB", "YugabyteDB")
        ):
            raise UnsafeSetupError(
                f"the lock database is not PostgreSQL ({info.version!r}); "
                f"advisory locks need PostgreSQL {MIN_SERVER_VERSION // 10000}+"
            )
        if info.version_num < MIN_SERVER_VERSION:
            raise UnsafeSetupError(
                f"PostgreSQL {info.version_num} is too old; "
                f"airflow-pglock needs PostgreSQL {MIN_SERVER_VERSION // 10000} or newer"
            )
        if scope == "session" and info.version_num < IDLE_SESSION_TIMEOUT_VERSION:
            raise UnsafeSetupError(
                f"PostgreSQL {info.version_num} has no idle_session_timeout (it appeared in PostgreSQL 14), so a "
                "frozen holder would keep a session lock until TCP keepalives give up, if ever. Use mode='transaction' "
                "(bounded by idle_in_transaction_session_timeout) or PostgreSQL 14+"
            )
        if info.in_recovery:
            raise UnsafeSetupError(
                f"the lock database {info.database!r} at {info.server} is a standby in recovery: advisory locks "
                "are not replicated, so a lock taken there excludes nobody. Point the connection at the primary "
                "(with libpq, target_session_attrs=read-write)"
            )
        if scope == "session" and info.behind_pooler and self._declared_pool_mode != "session":
            raise UnsafeSetupError(
                f"the lock connection goes through a connection pooler (the pooler reported backend pid "
                f"{info.reported_pid}, the server says {info.backend_pid}). A session-level advisory lock is unsafe "
                "under transaction pooling (PgBouncer's pool_mode=transaction): the next statement may run on "
                "another server session. Use mode='transaction' (transaction-level locks work through PgBouncer), "
                "connect directly to PostgreSQL, or, if the pooler really runs in session pooling, set the "
                'connection extra {"pool_mode": "session"}'
            )

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
        """Connect, check the server and set liveness; on any error nothing is left open."""
        conn = self.connect(application_name)
        try:
            info = self.inspect_server(conn)
            self.check_server(info, scope)
            if info.behind_pooler:
                # Through PgBouncer, a server-side prepared statement may outlive the transaction on a
                # server session another client gets next: never prepare on a lock connection.
                conn.prepare_threshold = None
            if scope == "session":
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
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise LockConfigurationError(f"wait timeout must be a positive number of seconds, got {timeout!r}")
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

    def is_held(self, conn: psycopg.Connection[Any], key: LockKey, shared: bool = False) -> bool:
        """Whether this very session holds the key now (reads ``pg_locks``, takes nothing)."""
        classid, objid, objsubid = key.pg_locks
        row = conn.execute(
            _HELD_SQL.format("%s", "%s", "%s", "%s"),
            [classid, objid, objsubid, "ShareLock" if shared else "ExclusiveLock"],
        ).fetchone()
        return bool(row and row[0])

    def probe(self, conn: psycopg.Connection[Any], key: LockKey, shared: bool, timeout: float) -> ProbeResult:
        """The heartbeat: does this session still hold ``key``? Never blocks much longer than ``timeout``.

        Unlike :meth:`is_held`, it cannot hang on a dead network or a frozen server: when no
        answer has arrived after ``timeout`` seconds, it closes the connection (so the server
        drops the session as soon as it hears from it again) and returns ``"no answer"``.
        When the protected work is using the connection for that long (transaction mode),
        it returns ``"busy"``: a session running a statement is not idle, so the server keeps
        its lock. A session that ended raises the server's error (``AdminShutdown``,
        ``IdleSessionTimeout``...) or ``OperationalError`` when the connection broke.

        :param conn: the lock's own connection.
        :param key: the key it should hold.
        :param shared: whether it holds the key in shared mode.
        :param timeout: seconds to wait for the connection and the answer together.
        """
        deadline = time.monotonic() + max(0.0, timeout)
        lock = conn.lock  # psycopg serialises the use of a connection with this lock
        if not lock.acquire(timeout=max(0.0, timeout)):
            return "busy"
        try:
            if conn.closed:
                raise psycopg.OperationalError("the lock connection is closed")
            pgconn = conn.pgconn
            classid, objid, objsubid = key.pg_locks
            params = [str(classid), str(objid), str(objsubid), "ShareLock" if shared else "ExclusiveLock"]
            pgconn.send_query_params(
                _HELD_SQL.format("$1", "$2", "$3", "$4").encode(), [value.encode() for value in params]
            )
            results = self._results_before(pgconn, deadline)
            if results is None:
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
        """Every result of the query just sent on ``pgconn``; None if the deadline passed first."""

        def ready(events: int) -> bool:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
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
        with conn.cursor(row_factory=dict_row) as cur:
            rows = cur.execute(_HOLDERS_SQL, list(key.pg_locks)).fetchall()
        return [LockHolder.from_row(row) for row in rows]

    async def aholders_on(self, conn: psycopg.AsyncConnection[Any], key: LockKey) -> list[LockHolder]:
        """Async :meth:`holders_on` (for triggers): reads ``pg_locks``, takes nothing."""
        async with conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(_HOLDERS_SQL, list(key.pg_locks))
            rows = await cur.fetchall()
        return [LockHolder.from_row(row) for row in rows]

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
        conn, info = self.open_lock_session(application_name, scope)
        try:
            if scope == "transaction":
                conn.execute("BEGIN")
                self.apply_liveness(conn, local=True, server_version_num=info.version_num)
            if timeout is None:
                acquired = self.try_lock(conn, lock_key, shared=shared, scope=scope)
            else:
                acquired = self.wait_lock(conn, lock_key, timeout, shared=shared, scope=scope)
        except BaseException:
            conn.close()
            raise
        if not acquired:
            conn.close()
            return None
        return HeldLock(key=lock_key, shared=shared, scope=scope, connection=conn, server=info, hook=self)

    def try_acquire(
        self,
        key: LockKey | str | int | tuple[int, int],
        *,
        shared: bool = False,
        application_name: str | None = None,
    ) -> HeldLock | None:
        """Try once to take a session lock on a new dedicated connection; None if busy."""
        return self.acquire_lock(key, shared=shared, scope="session", timeout=None, application_name=application_name)

    def acquire(
        self,
        key: LockKey | str | int | tuple[int, int],
        *,
        timeout: float,
        shared: bool = False,
        application_name: str | None = None,
    ) -> HeldLock | None:
        """Wait at most ``timeout`` seconds (server-side) for a session lock; None if it ran out."""
        return self.acquire_lock(
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
        held = self.acquire_lock(
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
        held = self.acquire_lock(
            key, shared=shared, scope="transaction", timeout=timeout, application_name=application_name
        )
        if held is None:
            yield None
            return
        try:
            yield held
            self.commit(held.connection)
        finally:
            held.released = True
            held.connection.close()  # closing an open transaction rolls it back
