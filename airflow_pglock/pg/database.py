"""The lock database: where it is, and how a dedicated lock connection to it is opened.

Every lock gets its own dedicated psycopg 3 connection, opened for it and closed after it
(never a pooled one: ``pg_try_advisory_lock`` returns true again on a session that
already holds the key, so a reused session would let two tasks "both" hold it). Each
lock connection differs from a plain one in three ways, each needed for a correct lock:
autocommit (an aborted transaction can never block the unlock), an ``application_name``
naming the holder, and liveness settings that bound how long a dead holder keeps the lock.

:class:`LockDatabase` knows no Airflow: it is given a function that says where the
database is (``resolve``; the hook reads an Airflow connection there).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, TypeVar

import psycopg

from airflow_pglock import forks, loss, server_rules
from airflow_pglock.exceptions import LockConfigurationError, LockConnectionError, PgLockError
from airflow_pglock.holder import LockHolder
from airflow_pglock.identity import check_application_name, hook_application_name
from airflow_pglock.keys import LockKey
from airflow_pglock.liveness import Liveness
from airflow_pglock.pg import scopes, statements
from airflow_pglock.pg import settings as connection_settings
from airflow_pglock.pg.held import HeldLock
from airflow_pglock.pg.holders import read_holders
from airflow_pglock.pg.scopes import ScopeRow
from airflow_pglock.pg.server import inspect_server, not_postgresql, server_from_handshake
from airflow_pglock.pg.settings import ConnectionSettings, redact
from airflow_pglock.pg.sql import NOT_POSTGRES_ERRORS, liveness_statement
from airflow_pglock.pg.statements import check_wait_timeout
from airflow_pglock.pg.take import take
from airflow_pglock.policy import check_mode
from airflow_pglock.server_rules import Scope, ServerInfo

DEFAULT_CONNECT_TIMEOUT = 10
#: application_name of the short sessions that only read who holds a key.
INSPECT_APPLICATION_NAME = "pglock inspect"
#: After a transaction lock's COMMIT whose answer was lost: how long the server is given to settle
#: the transaction (end the session, finish the commit) before what it says is taken as it is.
COMMIT_SETTLE_SECONDS = 2.0


class SeenFromAside(Protocol):
    """A held lock (or lock session) that can be looked at from another session."""

    def seen_from_aside(self, side: psycopg.Connection[Any]) -> bool: ...


class LockDatabase:
    """Where the lock database is, and how a dedicated lock connection to it is opened.

    :param resolve: says where the database is (called for each lock connection, so that a
        rotated password or an IAM token is fresh each time).
    :param liveness: lease-derived liveness settings (default: a 30 s lease).
    :param connect_timeout: seconds to wait for a connection (the connection's own
        ``connect_timeout`` wins).
    :param application_name: the name of a lock session whose caller gives none.
    :param label: how outcome lines name the connection (an Airflow conn id, or ``dsn``).
    """

    def __init__(
        self,
        resolve: Callable[[], ConnectionSettings],
        *,
        liveness: Liveness | None = None,
        connect_timeout: int = DEFAULT_CONNECT_TIMEOUT,
        application_name: Callable[[], str] = hook_application_name,
        label: str = "dsn",
    ) -> None:
        if isinstance(connect_timeout, bool) or not isinstance(connect_timeout, int) or connect_timeout < 1:
            raise LockConfigurationError(
                f"connect_timeout must be a whole number of seconds >= 1, got {connect_timeout!r}"
            )
        if liveness is not None and not isinstance(liveness, Liveness):
            raise LockConfigurationError(
                f"liveness must be a Liveness (e.g. Liveness(lease=60)) or None, got {liveness!r}"
            )
        self._resolve = resolve
        self.liveness = liveness or Liveness()
        self.connect_timeout = connect_timeout
        self.label = label
        self._application_name = application_name
        self._default_application_name: str | None = None
        self._last_settings: ConnectionSettings | None = None
        #: The server (or a pooler not declared) refused the provider's start-up options once: its
        #: later connections go without them, at no refused attempt each.
        self._startup_options_refused = False

    @classmethod
    def from_dsn(cls, dsn: str, **options: Any) -> LockDatabase:
        """The lock database a libpq connection string or URI names (checked when first used)."""
        return cls(lambda: connection_settings.from_dsn(dsn), **options)

    # ----------------------------------------------------------------- connections

    def resolve_settings(self) -> ConnectionSettings:
        """Where the lock database is (as the resolver given says: the hook's resolves once per hook)."""
        return self._resolve()

    def default_application_name(self) -> str:
        """A lock session's name when its caller gives none."""
        if self._default_application_name is None:
            self._default_application_name = self._application_name()
        return self._default_application_name

    def describe_target(self) -> str:
        """``'db' on host:port as user (conn id 'x')``; never the password."""
        return self.resolve_settings().describe()

    @staticmethod
    def _raise_connect_error(failed: _NotConnected) -> NoReturn:
        error, where = failed.error, failed.where
        if isinstance(error, psycopg.ProgrammingError):
            raise LockConfigurationError(
                f"invalid connection settings for the lock database {where}: {redact(str(error))}"
            ) from None
        # Without psycopg's frames (or its own chain): a console that prints each frame's local
        # variables (Airflow 3.0's) would show connect()'s arguments, the password among them.
        cause = _without_frames(error)
        raise LockConnectionError(
            f"cannot connect to the lock database {where}: {redact(str(error))}".strip()
        ) from cause

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
        :param server_settings: server settings to send in the start-up packet (left out when
            the server or a pooler refuses them: :meth:`_connect` says whether they went).
        """
        return self._connect(application_name, settings, server_settings=server_settings)[0]

    def _connect(
        self,
        application_name: str | None,
        settings: ConnectionSettings | None,
        *,
        server_settings: Mapping[str, str] | None = None,
    ) -> tuple[psycopg.Connection[Any], bool]:
        """:meth:`connect`, and whether ``server_settings`` went in the start-up packet."""
        check_application_name(application_name)  # before any I/O
        settings = settings or self.resolve_settings()
        self._last_settings = settings  # for side_connection(), see there
        name = application_name or self.default_application_name()
        opened, sent = self._open_trying(
            settings,
            server_settings,
            lambda options, extra: settings.session_params(
                name, self.liveness, self.connect_timeout, server_settings=extra, startup_options=options
            ),
        )
        if isinstance(opened, _NotConnected):
            self._raise_connect_error(opened)  # from here: no frame of the error holds the password
        return opened, sent

    def _startup_tries(
        self, settings: ConnectionSettings, server_settings: Mapping[str, str] | None
    ) -> list[tuple[bool, Mapping[str, str] | None]]:
        """The start-up options to connect with, in order, each try after a refusal of the one before:
        (the provider's own settings :data:`~airflow_pglock.pg.settings.READABLE_SERVER_SETTINGS`,
        ``server_settings``). A server older than a setting refuses only ``server_settings``; a
        pooler (PgBouncer without ``ignore_startup_parameters = options``) refuses any ``options``.
        """
        if settings.pool_mode is not None or self._startup_options_refused:
            return [(False, None)]  # nothing the caller asked for goes: it sets it by a statement then
        tries: list[tuple[bool, Mapping[str, str] | None]] = [(True, server_settings or None)]
        if server_settings:
            tries.append((True, None))
        tries.append((False, None))
        return tries

    def _open_trying(
        self,
        settings: ConnectionSettings,
        server_settings: Mapping[str, str] | None,
        params: Callable[[bool, Mapping[str, str] | None], dict[str, Any]],
    ) -> tuple[psycopg.Connection[Any] | _NotConnected, bool]:
        """:func:`_open` with the :meth:`_startup_tries` in turn (the libpq parameters of each by
        ``params``); and whether ``server_settings`` went in the start-up packet."""
        *earlier, last = self._startup_tries(settings, server_settings)
        for options, extra in earlier:
            opened = _open(settings, params(options, extra))
            if not _refused_for_options(opened):
                return opened, extra is not None
        if earlier:  # refused for any start-up options: a pooler not declared, most likely
            self._startup_options_refused = True
        return _open(settings, params(*last)), last[1] is not None

    async def aconnect(
        self, settings: ConnectionSettings, application_name: str | None = None
    ) -> psycopg.AsyncConnection[Any]:
        """Async :meth:`connect` (for triggers): same settings, same errors.

        :param settings: where to connect, resolved by the caller off the event loop
            (reading an Airflow connection, or an IAM token, is blocking I/O).
        :param application_name: names the session in ``pg_stat_activity``.
        """
        name = application_name or self.default_application_name()
        *earlier, last = self._startup_tries(settings, None)
        for options, _ in earlier:
            opened = await _aopen(
                settings, settings.session_params(name, self.liveness, self.connect_timeout, startup_options=options)
            )
            if not _refused_for_options(opened):
                break
        else:
            if earlier:  # refused for any start-up options (see _open_trying)
                self._startup_options_refused = True
            opened = await _aopen(
                settings, settings.session_params(name, self.liveness, self.connect_timeout, startup_options=last[0])
            )
        if isinstance(opened, _NotConnected):
            self._raise_connect_error(opened)
        return opened

    def side_connection(
        self, application_name: str = INSPECT_APPLICATION_NAME, connect_timeout: int = 2
    ) -> psycopg.Connection[Any]:
        """A short autocommit connection next to a lock's.

        Reuses the settings of the last :meth:`connect`: it is called from the heartbeat
        thread, which must not ask Airflow for the connection again (the task's channel to
        Airflow is not thread-safe).
        """
        settings = self._last_settings or self.resolve_settings()
        opened, _ = self._open_trying(
            settings,
            None,
            lambda options, _: {
                **settings.session_params(
                    application_name, self.liveness, self.connect_timeout, startup_options=options
                ),
                "connect_timeout": connect_timeout,
            },
        )
        if isinstance(opened, _NotConnected):  # the driver's error, as before, from a frame with no password
            raise _without_frames(opened.error)
        return opened

    def transaction_status(self, xact_id: int, settle_seconds: float = COMMIT_SETTLE_SECONDS) -> str | None:
        """What the server says of transaction ``xact_id`` (``txid_status``: ``committed``,
        ``aborted`` or ``in progress``), asked on a :meth:`side_connection`; for at most
        ``settle_seconds`` while it is in progress (a session whose end the server has not yet
        taken in). None when it cannot be asked (unreachable, an id it does not know)."""
        deadline = time.monotonic() + settle_seconds
        try:
            with self.side_connection() as conn:
                while True:
                    status = statements.transaction_status(conn, xact_id)
                    if status != "in progress" or time.monotonic() >= deadline:
                        return status
                    time.sleep(0.05)
        except (psycopg.Error, PgLockError):
            return None

    def holds_seen_aside(self, held: SeenFromAside) -> bool | None:
        """Whether ``held``'s session still holds its key (transaction scope: in the transaction
        that took it; a lock session: lives), asked on a :meth:`side_connection`; None when the
        server cannot be reached."""
        try:
            with self.side_connection() as side:
                return held.seen_from_aside(side)
        except (psycopg.OperationalError, PgLockError):
            return None

    def server_start(self) -> loss.ServerStart | None:
        """The server's start (its time, and the uptime on its own clock) and its address, asked
        on a :meth:`side_connection`; None if unreachable."""
        try:
            with self.side_connection() as conn:
                asked_at = loss.held_clock()
                row = conn.execute(
                    "SELECT pg_catalog.pg_postmaster_start_time(),"
                    " extract(epoch FROM pg_catalog.clock_timestamp() - pg_catalog.pg_postmaster_start_time()),"
                    " pg_catalog.host(pg_catalog.inet_server_addr()),"
                    " pg_catalog.inet_server_port(), pg_catalog.pg_is_in_recovery()"
                ).fetchone()
                seen_at = loss.held_clock()
                reached = server_from_handshake(conn).server
        except (psycopg.Error, PgLockError):
            return None
        if row is None:
            return None
        addresses = frozenset({reached, server_rules.server_label(row[2], row[3])})
        return loss.ServerStart(
            started_at=row[0],
            uptime=float(row[1]),
            asked_at=asked_at,
            seen_at=seen_at,
            server=reached,
            addresses=addresses,
            in_recovery=bool(row[4]),
        )

    # ----------------------------------------------------------------- the server

    def apply_liveness(
        self, conn: psycopg.Connection[Any], *, local: bool, server_version_num: int, session_lock: bool | None = None
    ) -> None:
        """Set the server-side liveness settings; ``local`` = for the current transaction only.

        :param server_version_num: settings this server version lacks are left out.
        :param session_lock: a session lock's settings or a transaction lock's (by default ``not local``).
        """
        statement = liveness_statement(
            self.liveness, local=local, server_version_num=server_version_num, session_lock=session_lock
        )
        conn.execute(statement)

    # ----------------------------------------------------------------- lock sessions

    def open_lock_session(
        self, application_name: str | None, scope: Scope, *, inspect: bool = True
    ) -> tuple[psycopg.Connection[Any], ServerInfo, ConnectionSettings]:
        """Connect, check the server and set liveness; on any error nothing is left open.

        A session lock's liveness settings go in the start-up packet (no statement of their
        own) unless the connection declares a pooler (``pool_mode``): a pooler refuses them or,
        configured to ignore them, drops them silently. Refused anyway (PgBouncer, or a server
        older than a setting), the connection is opened again without them and they are set by
        a statement, after the server was inspected, as through a declared pooler.

        :param inspect: False: check only what the handshake tells (version, not PostgreSQL) and
            leave the rest to the first lock statement (:func:`~airflow_pglock.pg.take.take`),
            which answers the same questions; the returned facts are the handshake's then.
        """
        check_mode(scope)  # anything but "transaction" would take a session lock, with no lease
        settings = self.resolve_settings()
        startup = None
        if scope == "session" and settings.pool_mode is None:
            startup = self.liveness.server_settings(transaction=False)
        conn, sent = self._connect(application_name, settings, server_settings=startup)
        if startup is not None and not sent:  # refused (now or before): set by a statement below
            startup = None
            # Most likely a pooler: ask before a session setting could reach a pooled server session.
            inspect = True
        try:
            info = server_from_handshake(conn)
            server_rules.check_server(info, scope, settings.pool_mode, server_rules.HANDSHAKE_RULES)
            if inspect:
                info = inspect_server(conn)
                server_rules.check_server(info, scope, settings.pool_mode)
                if info.behind_pooler:
                    conn.prepare_threshold = None  # see take.take
            if scope == "session" and startup is None:
                self.apply_liveness(conn, local=False, server_version_num=info.version_num)
            return conn, info, settings
        except BaseException:
            conn.close()
            raise

    def acquire_lock(
        self,
        pool: Sequence[LockKey],
        *,
        shared: bool,
        scope: Scope,
        timeout: float | None,
        application_name: str | None,
        candidates: Sequence[int] | None = None,
    ) -> HeldLock | None:
        """Open a dedicated connection and take the lock on it; None (and no connection) if busy.

        :param pool: the key, or the slots of a pool (:func:`~airflow_pglock.keys.slot_keys`,
            slot 1 first); the lock held is then any one free slot.
        :param scope: ``"session"`` (autocommit; held until released) or ``"transaction"``
            (a transaction is opened and stays open; the lock ends with it).
        :param timeout: None to try once, or seconds to wait (enforced by the server).
        :param application_name: names the holder in ``pg_stat_activity``.
        :param candidates: a pool: the indexes of the slots that may be taken (default: all).
        """
        if timeout is not None:
            check_wait_timeout(timeout)  # before any I/O: a bad setting is not a connection problem
        conn, info, settings = self.open_lock_session(application_name, scope, inspect=False)
        try:
            held = take(
                conn,
                info,
                pool,
                shared=shared,
                scope=scope,
                timeout=timeout,
                liveness=self.liveness,
                pool_mode=settings.pool_mode,
                candidates=candidates,
            )
        except NOT_POSTGRES_ERRORS as error:
            refusal = not_postgresql(conn, error)
            conn.close()
            raise refusal from None
        except BaseException:
            conn.close()
            raise
        if held is None:
            conn.close()
        return held

    def holders(self, pool: Sequence[LockKey]) -> list[LockHolder]:
        """Who holds or waits for the keys (a key, or a pool's slots), without touching them."""
        with self.connect(INSPECT_APPLICATION_NAME) as conn:
            return read_holders(conn, *pool)

    def live_scope(self, key: LockKey) -> ScopeRow | None:
        """The live lock scope row of ``key`` (a scope, or a deferred task's hold), read without the key."""
        with self.connect(INSPECT_APPLICATION_NAME) as conn:
            return scopes.live_scope(conn, key)

    def live_scopes(self, pool: Sequence[LockKey]) -> dict[LockKey, ScopeRow]:
        """The live lock scope rows among a pool's slots, read without the keys."""
        with self.connect(INSPECT_APPLICATION_NAME) as conn:
            return scopes.live_scopes_of(conn, list(pool))


AnyConnection = TypeVar("AnyConnection", psycopg.Connection[Any], psycopg.AsyncConnection[Any])


@functools.cache
def _devnull() -> int:
    """/dev/null, opened once in the parent (close-on-exec): a child forked at its descriptor
    limit could not open it then."""
    return os.open(os.devnull, os.O_RDWR)


def _left_to_the_parent_in_a_fork(conn: AnyConnection) -> AnyConnection:
    _devnull()
    forks.after_fork_in_child(conn, _leave_to_the_parent)
    return conn


def _leave_to_the_parent(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    """In a forked child: /dev/null in place of the connection's socket, then the connection
    closed, so nothing of the child's reaches the parent's session: the close's Terminate
    message goes to /dev/null, and a closed connection sends no cancel request (which would
    travel on a new socket, with the parent backend's cancel key). A fresh lock in place of
    psycopg's, which a thread of the parent (the heartbeat, in a probe) may have held."""
    if conn.closed:
        return  # its descriptor number may belong to something else by now
    os.dup2(_devnull(), conn.pgconn.socket, inheritable=False)  # stays close-on-exec, as libpq's socket was
    if isinstance(conn, psycopg.Connection):
        conn.lock = threading.Lock()
    conn.pgconn.finish()


@dataclass(frozen=True)
class _NotConnected:
    """A connection attempt that failed: the driver's error and where it tried (no password)."""

    error: psycopg.Error
    where: str


def _refused_for_options(opened: psycopg.Connection[Any] | psycopg.AsyncConnection[Any] | _NotConnected) -> bool:
    """Whether a connection attempt failed because the server or a pooler refused its start-up ``options``."""
    return isinstance(opened, _NotConnected) and connection_settings.refused_startup_options(opened.error)


def _without_frames(error: psycopg.Error) -> psycopg.Error:
    """``error`` without its traceback and chain, whose frames hold the connect arguments."""
    error = error.with_traceback(None)
    error.__cause__, error.__suppress_context__ = None, True
    return error


def _open(settings: ConnectionSettings, kwargs: dict[str, Any]) -> psycopg.Connection[Any] | _NotConnected:
    """Connect with ``kwargs``; a failure is returned rather than raised, so that the error raised
    for it has no frame whose local variables hold the password (see ``_raise_connect_error``)."""
    try:
        return _left_to_the_parent_in_a_fork(psycopg.Connection.connect(autocommit=True, **kwargs))
    except psycopg.Error as error:
        return _NotConnected(_redacted(error, kwargs), connection_settings.describe_params(kwargs, settings.source))


async def _aopen(settings: ConnectionSettings, kwargs: dict[str, Any]) -> psycopg.AsyncConnection[Any] | _NotConnected:
    """Async :func:`_open`."""
    try:
        return _left_to_the_parent_in_a_fork(await psycopg.AsyncConnection.connect(autocommit=True, **kwargs))
    except psycopg.Error as error:
        return _NotConnected(_redacted(error, kwargs), connection_settings.describe_params(kwargs, settings.source))


def _redacted(error: psycopg.Error, params: Mapping[str, Any]) -> psycopg.Error:
    """``error``, or one of its class whose message hides what may be a password
    (:func:`~airflow_pglock.pg.settings.redact_params`): it is raised, chained or logged as it is."""
    message = str(error)
    safe = connection_settings.redact_params(message, params)
    if safe == message:
        return error
    try:
        return type(error)(safe)
    except Exception:  # a class that wants other arguments
        return psycopg.OperationalError(safe)
