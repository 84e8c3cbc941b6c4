"""AdvisoryLockHook: the Airflow-facing entry point to the lock database.

Every lock gets its own dedicated psycopg 3 connection, opened for it and closed after
it (never a pooled one: ``pg_try_advisory_lock`` returns true again on a session that
already holds the key, so a reused session would let two tasks "both" hold it). The
lock statements and :class:`HeldLock` are in ``lock_session.py``; the other SQL of the
provider lives next to it in ``hooks/``: the holders query
(``holders.py``), the operators' views (``inspection.py``), the schema (``schema.py``,
``ledger.py``). Where the database is comes from ``connection.py``; whether the server
at the other end is safe for a lock, from the rules in ``server.py``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import warnings
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

import psycopg
from psycopg import sql

from airflow_pglock.compat import BaseHook
from airflow_pglock.exceptions import (
    LockBusyError,
    LockConfigurationError,
    LockConnectionError,
    LockLostError,
    PgLockError,
    UnsafeSetupError,
)
from airflow_pglock.hooks import connection as connection_settings
from airflow_pglock.hooks import lock_session
from airflow_pglock.hooks import server as server_rules
from airflow_pglock.hooks.connection import ConnectionSettings, redact
from airflow_pglock.hooks.holders import LockHolder, aread_holders, read_holders
from airflow_pglock.hooks.lock_session import (
    HELD_CONDITION,
    IN_LOCK_TRANSACTION,
    HeldLock,
    ProbeResult,
    check_wait_timeout,
    held_params,
    held_sql,
)
from airflow_pglock.hooks.server import MIN_SERVER_VERSION, Scope, ServerInfo
from airflow_pglock.keys import LockKey, slot_keys
from airflow_pglock.liveness import IDLE_SESSION_TIMEOUT_VERSION, Liveness

if TYPE_CHECKING:
    from airflow_pglock.guard import LockHandle, OnBusy, OnLost
    from airflow_pglock.lock_set import LockSession

__all__ = [
    "HELD_CONDITION",
    "IN_LOCK_TRANSACTION",
    "MIN_SERVER_VERSION",
    "AdvisoryLockHook",
    "HeldLock",
    "LockHolder",
    "ProbeResult",
    "Scope",
    "ServerInfo",
    "check_wait_timeout",
    "held_params",
    "held_sql",
    "redact",
]

DEFAULT_CONNECT_TIMEOUT = 10
#: application_name of the short sessions that only read who holds a key.
INSPECT_APPLICATION_NAME = "pglock inspect"

# The errors a server that only looks like PostgreSQL (PgBouncer's admin console, other
# wire-compatible systems) answers to the inspection query.
_NOT_POSTGRES_ERRORS: tuple[type[psycopg.Error], ...] = (
    psycopg.errors.UndefinedFunction,
    psycopg.errors.ProtocolViolation,
    psycopg.errors.FeatureNotSupported,
    psycopg.errors.SyntaxError,
)


class LockDatabase(BaseHook):
    """Where the lock database is, and how a dedicated lock connection to it is opened.

    The connection half of :class:`AdvisoryLockHook` (which adds the locks).

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
        try:
            with self.side_connection() as conn:
                return lock_session.held_seen_from_aside(conn, held)
        except (psycopg.OperationalError, PgLockError):
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
            raise self._not_postgresql(conn, error) from None
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
    def _not_postgresql(conn: psycopg.Connection[Any], error: psycopg.Error) -> UnsafeSetupError:
        """A server that answered PostgreSQL's functions with an error: it only looks like one."""
        claims = conn.info.parameter_status("server_version") or "unknown"
        return UnsafeSetupError(
            f"the lock database does not look like PostgreSQL (it reports server_version {claims!r} and "
            f"answered with: {str(error).strip()}); advisory locks need a PostgreSQL "
            "server (directly, or through PgBouncer to a real database, not its admin console)"
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
        conn.execute(self.liveness_statement(local=local, server_version_num=server_version_num))

    def liveness_statement(self, *, local: bool, server_version_num: int) -> sql.Composed:
        """``SELECT set_config(...), ...`` for the liveness settings, values inlined (no parameters,
        so that it can travel with other statements in one simple query)."""
        settings = self.liveness.server_settings(transaction=local, server_version_num=server_version_num)
        selects = sql.SQL(", ").join(
            sql.SQL("set_config({}, {}, {})").format(sql.Literal(name), sql.Literal(value), sql.Literal(local))
            for name, value in settings.items()
        )
        return sql.SQL("SELECT {}").format(selects)

    def server_from_handshake(self, conn: psycopg.Connection[Any]) -> ServerInfo:
        """What the handshake of ``conn`` told about the server (no statement; see :func:`server.from_handshake`)."""
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

    def open_lock_session(
        self, application_name: str | None, scope: Scope, *, inspect: bool = True
    ) -> tuple[psycopg.Connection[Any], ServerInfo]:
        """Connect, check the server and set liveness; on any error nothing is left open.

        A session lock's liveness settings go in the start-up packet (no statement of their
        own) unless the connection declares a pooler (``pool_mode``): a pooler refuses them or,
        configured to ignore them, drops them silently. Refused anyway (PgBouncer, or a server
        older than a setting), the connection is opened again without them and they are set by
        a statement, after the server was inspected, as through a declared pooler.

        :param inspect: False: check only what the handshake tells (version, not PostgreSQL) and
            leave the rest to the first lock statement (:func:`lock_session.take`), which
            answers the same questions; the returned facts are the handshake's then.
        """
        conn, info, _ = self._open_lock_session(application_name, scope, inspect=inspect)
        return conn, info

    def _open_lock_session(
        self, application_name: str | None, scope: Scope, *, inspect: bool
    ) -> tuple[psycopg.Connection[Any], ServerInfo, ConnectionSettings]:
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
            # Most likely a pooler: ask before a session setting could reach a pooled server session.
            inspect = True
        try:
            info = self.server_from_handshake(conn)
            server_rules.check_server(info, scope, settings.pool_mode, server_rules.HANDSHAKE_RULES)
            if inspect:
                info = self.inspect_server(conn)
                self.check_server(info, scope, settings.pool_mode)
                if info.behind_pooler:
                    conn.prepare_threshold = None  # see lock_session.take
            if scope == "session" and startup is None:
                self.apply_liveness(conn, local=False, server_version_num=info.version_num)
            return conn, info, settings
        except BaseException:
            conn.close()
            raise


class AdvisoryLockHook(LockDatabase):
    """PostgreSQL advisory locks on dedicated connections, read from an Airflow connection.

    The Airflow-facing entry point (``postgres_conn_id``, ``get_conn``, as the official
    providers' hooks). :meth:`lock` holds a key for a ``with`` block with a heartbeat and
    an error when the lock is lost; :meth:`try_acquire` / :meth:`acquire` return a
    :class:`HeldLock` to release yourself; :meth:`holders` says who holds a key.

    :param postgres_conn_id: the Airflow connection id (conn type ``postgres``).
    :param dsn: a libpq connection string or URI to use instead of an Airflow connection.
    :param connect_timeout: seconds to wait for a connection (default 10; the
        connection's own ``connect_timeout`` extra wins).
    :param liveness: lease-derived liveness settings (default: a 30 s lease).
    """

    # The lock statements (in lock_session.py), under the names callers know.
    try_lock = staticmethod(lock_session.try_lock)
    wait_lock = staticmethod(lock_session.wait_lock)
    unlock = staticmethod(lock_session.unlock)
    is_held = staticmethod(lock_session.is_held)
    commit = staticmethod(lock_session.commit)
    probe = staticmethod(lock_session.probe)
    _results_before = staticmethod(lock_session.results_before)

    def holders_on(self, conn: psycopg.Connection[Any], key: LockKey) -> list[LockHolder]:
        """Holders and waiters of ``key`` in the connection's database, holders first."""
        return read_holders(conn, key)

    async def aholders_on(self, conn: psycopg.AsyncConnection[Any], key: LockKey) -> list[LockHolder]:
        """Async :meth:`holders_on` (for triggers): reads ``pg_locks``, takes nothing."""
        return await aread_holders(conn, key)

    def holders(self, key: LockKey | str | int | tuple[int, int], *, slots: int = 1) -> list[LockHolder]:
        """Who holds or waits for ``key`` (pid, application_name, client, since), without touching it.

        :param slots: more than one: the holders of every slot of the pool ``key`` names.
        """
        keys = slot_keys(LockKey.coerce(key), slots)
        with self.connect(INSPECT_APPLICATION_NAME) as conn:
            return read_holders(conn, *keys)

    async def aholders(self, key: LockKey | str | int | tuple[int, int], *, slots: int = 1) -> list[LockHolder]:
        """Async :meth:`holders` on a short-lived connection of its own (closed even if cancelled)."""
        keys = slot_keys(LockKey.coerce(key), slots)
        async with await self.aconnect(INSPECT_APPLICATION_NAME) as conn:
            return await aread_holders(conn, *keys)

    def acquire_lock(
        self,
        key: LockKey | str | int | tuple[int, int],
        *,
        shared: bool,
        scope: Scope,
        timeout: float | None,
        application_name: str | None,
        record_name: bool = False,
        slots: int = 1,
    ) -> HeldLock | None:
        """Open a dedicated connection and take the lock on it; None (and no connection) if busy.

        :param scope: ``"session"`` (autocommit; held until released) or ``"transaction"``
            (a transaction is opened and stays open; the lock ends with it).
        :param timeout: None to try once, or seconds to wait (enforced by the server).
        :param record_name: record the key's name in the key-name registry, with the release
            (the guard does that itself, after logging the acquisition).
        :param slots: more than one: ``key`` names a pool of that many slots
            (:func:`~airflow_pglock.keys.slot_keys`); the lock held is any one free slot.
        """
        lock_key = LockKey.coerce(key)
        slot_keys(lock_key, slots)  # before any I/O, as the timeout
        if timeout is not None:
            check_wait_timeout(timeout)  # before any I/O: a bad setting is not a connection problem
        conn, info, settings = self._open_lock_session(application_name, scope, inspect=False)
        try:
            held = lock_session.take(
                self,
                conn,
                info,
                lock_key,
                shared=shared,
                scope=scope,
                timeout=timeout,
                slots=slots,
                pool_mode=settings.pool_mode,
            )
        except _NOT_POSTGRES_ERRORS as error:
            refusal = self._not_postgresql(conn, error)
            conn.close()
            raise refusal from None
        except BaseException:
            conn.close()
            raise
        if held is None:
            conn.close()
        elif record_name:
            from airflow_pglock.registry import record_acquisition  # registry imports this module

            try:  # never raises an Exception; an interrupt must not leave the lock held
                record_acquisition(held, held.connection.info.parameter_status("application_name"), self.log, slots)
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
        return self.acquire_lock(
            key, shared=shared, scope="session", timeout=None, application_name=application_name, record_name=True
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
        return self.acquire_lock(
            key, shared=shared, scope="session", timeout=timeout, application_name=application_name, record_name=True
        )

    @contextlib.contextmanager
    def lock(
        self,
        key: LockKey | str | int | tuple[int, int],
        *,
        mode: Scope = "session",
        shared: bool = False,
        timeout: float | None = None,
        on_lost: OnLost = "fail",
        application_name: str | None = None,
    ) -> Iterator[LockHandle | None]:
        """Hold ``key`` for the ``with`` block, as a guarded task does; yields None when busy.

        Safe by default: a heartbeat keeps the session alive and watches it; a lock lost
        during the block (the session was terminated, the server stopped answering)
        interrupts the block with :class:`~airflow_pglock.exceptions.LockLostInterrupt` and
        raises :class:`~airflow_pglock.exceptions.LockLostError` (``on_lost="warn"``: logs
        and goes on). The lock is released and its connection closed however the block ends.

        :param mode: ``"session"``, or ``"transaction"``: do the database work on
            ``handle.connection``; it commits when the block ends normally.
        :param timeout: None to try once, or seconds to wait for the key (server-side).
        :param on_lost: ``"fail"`` or ``"warn"``.
        """
        from airflow_pglock.guard import LockGuard, LockPolicy  # the guard builds on this module

        on_busy: OnBusy = "skip" if timeout is None else "wait"
        policy = LockPolicy(mode=mode, shared=shared, on_busy=on_busy, wait_timeout=timeout, on_lost=on_lost)
        guard = LockGuard(self, LockKey.coerce(key), policy, application_name=application_name, logger=self.log)
        try:
            handle = guard.__enter__()
        except LockBusyError as busy:
            if busy is not guard.refusal:
                raise
            yield None
            return
        try:
            yield handle
        except BaseException as error:
            guard.__exit__(type(error), error, error.__traceback__)
            raise
        guard.__exit__(None, None, None)

    @contextlib.contextmanager
    def lock_without_heartbeat(
        self,
        key: LockKey | str | int | tuple[int, int],
        *,
        mode: Scope = "session",
        shared: bool = False,
        timeout: float | None = None,
        application_name: str | None = None,
    ) -> Iterator[HeldLock | None]:
        """Hold ``key`` for a short ``with`` block, with no heartbeat; yields None when busy.

        Nothing keeps the session alive: a block that leaves its connection idle for longer
        than the lease loses the lock to the server, and that is found only when the block
        ends: then a session lock raises :class:`~airflow_pglock.exceptions.LockLostError`
        (if the block itself succeeded) and a transaction lock commits nothing and raises the
        driver's error. Use :meth:`lock` for anything that may take a while.

        :param mode: ``"session"``, or ``"transaction"``: do the database work on
            ``held.connection``; it commits when the block ends normally, rolls back if it raises.
        :param timeout: None to try once, or seconds to wait for the key (server-side).
        """
        held = self.acquire_lock(
            key, shared=shared, scope=mode, timeout=timeout, application_name=application_name, record_name=True
        )
        if held is None:
            yield None
            return
        try:
            yield held
            if mode == "transaction":
                held.commit()
            elif not held.released and not held.release():
                reason = "the session no longer held it when the block ended (lease expired or session ended)"
                raise LockLostError(f"lost {held.key.describe()}: {reason}", held.key, reason)
        finally:
            if mode == "session":
                held.release()
            else:
                # Roll an open transaction back before closing: the key is free when the block ends,
                # not when the server gets round to ending the closed session's backend.
                if not held.connection.closed and held.transaction_open:
                    with contextlib.suppress(psycopg.Error):
                        held.connection.execute("ROLLBACK")
                held.close()

    @contextlib.contextmanager
    def lock_session(self, *, application_name: str | None = None) -> Iterator[LockSession]:
        """A lock session for many keys: one dedicated connection, kept alive by a heartbeat.

        Yields a :class:`~airflow_pglock.lock_set.LockSession` (``try_lock``, ``lock``,
        ``try_lock_many``, ``release``, ``held``). When the block ends, however it ends, the
        heartbeat stops and the connection closes, releasing every key. A session lost during
        the block raises :class:`~airflow_pglock.exceptions.LockLostError` at its end (when
        the block itself did not raise).
        """
        from airflow_pglock.lock_set import LockSession  # it builds on this module's statements

        conn, info = self.open_lock_session(application_name, "session")
        try:
            session = LockSession(conn, info, self.liveness)
        except BaseException:
            conn.close()
            raise
        try:
            yield session
        finally:
            lost = session.lost
            session.close()
        if lost is not None:
            raise LockLostError(f"the lock session was lost: {lost}", LockKey.from_int(info.backend_pid), lost)

    def session_lock(self, key: LockKey | str | int | tuple[int, int], **options: Any) -> _HeldContext:
        """Deprecated: :meth:`lock` (with a heartbeat), or :meth:`lock_without_heartbeat`."""
        _deprecated("session_lock", "")
        return self.lock_without_heartbeat(key, mode="session", **options)

    def transaction_lock(self, key: LockKey | str | int | tuple[int, int], **options: Any) -> _HeldContext:
        """Deprecated: :meth:`lock` or :meth:`lock_without_heartbeat` with ``mode="transaction"``."""
        _deprecated("transaction_lock", 'mode="transaction", ')
        return self.lock_without_heartbeat(key, mode="transaction", **options)


_HeldContext = contextlib.AbstractContextManager[HeldLock | None]


def _deprecated(name: str, mode: str) -> None:
    warnings.warn(
        f"AdvisoryLockHook.{name}(key, ...) is deprecated: use hook.lock(key, {mode}...) (heartbeat; an error when "
        f"the lock is lost) or hook.lock_without_heartbeat(key, {mode}...) for short blocks",
        DeprecationWarning,
        stacklevel=3,
    )
