"""AdvisoryLockHook: PostgreSQL advisory locks from an Airflow connection.

The Airflow facade of the lock database (:class:`~airflow_pglock.pg.database.LockDatabase`):
it reads the Airflow connection the way ``PostgresHook`` does and offers the documented ways
to hold a lock: :meth:`~AdvisoryLockHook.lock` (a ``with`` block, heartbeat, the guarded
task's semantics), :meth:`~AdvisoryLockHook.lock_session` (many keys on one connection, the
same heartbeat) and :meth:`~AdvisoryLockHook.acquire` (a held lock to release yourself, no
heartbeat). :meth:`~AdvisoryLockHook.holders` says who holds a key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg

from airflow_pglock.compat import BaseHook, deployment_name, get_stats
from airflow_pglock.exceptions import LockBusyError, LockConfigurationError, LockLostError
from airflow_pglock.guard import SCOPE_POLL_SECONDS, LockGuard
from airflow_pglock.handle import LockHandle
from airflow_pglock.holder import LockHolder
from airflow_pglock.hooks import DEFAULT_CONN_ID, connection
from airflow_pglock.identity import hook_application_name
from airflow_pglock.keys import AnyKey, LockKey, slot_keys
from airflow_pglock.liveness import Liveness
from airflow_pglock.lock_set import LockSession
from airflow_pglock.pg.database import DEFAULT_CONNECT_TIMEOUT, INSPECT_APPLICATION_NAME, LockDatabase
from airflow_pglock.pg.held import HeldLock
from airflow_pglock.pg.holders import aread_holders
from airflow_pglock.pg.scopes import ScopeRow, live_scope, live_scopes_of
from airflow_pglock.pg.settings import POOL_MODES, ConnectionSettings, from_dsn
from airflow_pglock.pg.statements import wait_seconds
from airflow_pglock.policy import LockPolicy, OnBusy, OnLost, check_mode, check_slots
from airflow_pglock.registry import record_acquisition
from airflow_pglock.scope_rules import OUTSIDE
from airflow_pglock.scope_rules import check_before_work as check_scope
from airflow_pglock.server_rules import Scope


class AdvisoryLockHook(BaseHook):
    """PostgreSQL advisory locks on dedicated connections, read from an Airflow connection.

    Reads a standard Airflow Postgres connection (host, port, schema = database, login,
    password and libpq extras such as ``sslmode``, ``sslrootcert``, ``options``; IAM tokens
    as ``PostgresHook`` does). Each lock gets a connection of its own, opened for it and
    closed after it; it differs from PostgresHook's in three ways, each needed for a correct
    lock: autocommit (an aborted transaction can never block the unlock), an
    ``application_name`` naming the holder, and liveness settings that bound how long a dead
    holder keeps the lock.

    :param postgres_conn_id: the Airflow connection id (conn type ``postgres``).
    :param dsn: a libpq connection string or URI to use instead of an Airflow connection.
    :param connect_timeout: seconds to wait for a connection (default 10; the
        connection's own ``connect_timeout`` extra wins).
    :param liveness: lease-derived liveness settings (default: a 30 s lease).
    :param pool_mode: the pooling mode of a pooler between this hook and PostgreSQL
        (``"session"``, ``"transaction"`` or ``"statement"``), as the connection extra
        ``pool_mode`` declares it; given here, it wins over the extra (a ``dsn`` has none).
    """

    conn_name_attr = "postgres_conn_id"
    default_conn_name = DEFAULT_CONN_ID
    conn_type = "postgres"
    hook_name = "PostgreSQL advisory lock"

    def __init__(
        self,
        postgres_conn_id: str = default_conn_name,
        *,
        dsn: str | None = None,
        connect_timeout: int = DEFAULT_CONNECT_TIMEOUT,
        liveness: Liveness | None = None,
        pool_mode: str | None = None,
    ) -> None:
        super().__init__()
        if dsn is None and (not isinstance(postgres_conn_id, str) or not postgres_conn_id.strip()):
            raise LockConfigurationError(f"postgres_conn_id must be a non-empty string, got {postgres_conn_id!r}")
        if pool_mode is not None and pool_mode not in POOL_MODES:
            raise LockConfigurationError(
                f"pool_mode must be one of {', '.join(map(repr, POOL_MODES))} (a pooler's pooling mode) or None, "
                f"got {pool_mode!r}"
            )
        self.pool_mode = pool_mode
        self.postgres_conn_id = postgres_conn_id
        self.dsn = dsn
        self._settings: ConnectionSettings | None = None
        #: The lock database this hook's locks are taken in (the layer below: no Airflow).
        self.database = LockDatabase(
            self.resolve_settings,
            liveness=liveness,
            connect_timeout=connect_timeout,
            application_name=lambda: hook_application_name(deployment_name()),
            label="dsn" if dsn is not None else postgres_conn_id,
        )

    @property
    def liveness(self) -> Liveness:
        """The lease-derived liveness settings of this hook's locks."""
        return self.database.liveness

    def resolve_settings(self) -> ConnectionSettings:
        """Where the lock database is (the DSN, or the Airflow connection as PostgresHook reads it).

        Resolved once per hook, as ``DbApiHook.connection`` is: a changed connection (a rotated
        password) is read by a new hook (a guarded task makes one per run). A connection with an
        IAM token (extra ``iam``) is resolved anew for each lock connection: the token expires.
        """
        if self._settings is not None:
            return self._settings
        if self.dsn is not None:
            settings = from_dsn(self.dsn)
        else:
            settings = connection.from_airflow(self.postgres_conn_id, self.get_connection)
        if self.pool_mode is not None:
            settings = dataclasses.replace(settings, pool_mode=self.pool_mode)
        if settings.reusable:
            self._settings = settings
        return settings

    def get_conn(self) -> psycopg.Connection[Any]:
        """A new dedicated autocommit connection to the lock database (Airflow's hook API); close it."""
        return self.database.connect()

    async def aconnect(self, application_name: str | None = None) -> psycopg.AsyncConnection[Any]:
        """Async :meth:`get_conn` (for triggers), on the lock connection's settings.

        The Airflow connection is resolved in a worker thread (``sync_to_async``), as the
        official providers' triggers do: reading it (and an IAM token) is blocking I/O.

        :param application_name: names the session in ``pg_stat_activity``.
        """
        from asgiref.sync import sync_to_async

        settings = await sync_to_async(self.resolve_settings)()
        return await self.database.aconnect(settings, application_name)

    # ----------------------------------------------------------------- the ways to hold a lock

    @contextlib.contextmanager
    def lock(
        self,
        key: AnyKey,
        *,
        mode: Scope = "session",
        shared: bool = False,
        timeout: float | dt.timedelta | None = None,
        on_lost: OnLost = "fail",
        application_name: str | None = None,
    ) -> Iterator[LockHandle | None]:
        """Hold ``key`` for the ``with`` block, as a guarded task does; yields None when busy.

        A heartbeat keeps the session alive and watches it; a lock lost during the block
        (the session was terminated, the server stopped answering) interrupts the block with
        :class:`~airflow_pglock.exceptions.LockLostInterrupt` and raises
        :class:`~airflow_pglock.exceptions.LockLostError` (``on_lost="warn"``: logs and goes
        on). The lock is released and its connection closed however the block ends.

        :param key: a name, an int64, an (int32, int32) pair or a :class:`~airflow_pglock.keys.LockKey`.
        :param mode: ``"session"``, or ``"transaction"``: do the database work on
            ``handle.connection``; it commits when the block ends normally.
        :param shared: take the key in shared mode (readers; an exclusive holder excludes them).
        :param timeout: None to try once, or seconds (or a ``timedelta``) to wait for the key (server-side).
        :param on_lost: ``"fail"`` or ``"warn"``.
        :param application_name: names the holder in ``pg_stat_activity`` (default: this
            deployment, host, program and pid).
        """
        if timeout is not None:
            timeout = wait_seconds(timeout)  # its own words: the policy's would name on_busy and wait_timeout
        on_busy: OnBusy = "skip" if timeout is None else "wait"
        policy = LockPolicy(mode=mode, shared=shared, on_busy=on_busy, wait_timeout=timeout, on_lost=on_lost)
        guard = LockGuard(
            self.database,
            LockKey.coerce(key),
            policy,
            application_name=application_name,
            logger=self.log,
            stats=get_stats,
        )
        try:
            handle = guard.__enter__()
        except LockBusyError as busy:
            if busy is not guard.refusal:
                raise
            yield None
            return

        def end(error: BaseException | None) -> None:  # a lost lock raises LockLostError from the error
            if error is None:
                guard.__exit__(None, None, None)
            else:
                guard.__exit__(type(error), error, error.__traceback__)

        with _ended_by(end):
            yield handle

    @contextlib.contextmanager
    def lock_session(self, *, application_name: str | None = None) -> Iterator[LockSession]:
        """A lock session for many keys: one dedicated connection, kept alive by a heartbeat.

        Yields a :class:`~airflow_pglock.lock_set.LockSession` (``try_lock``, ``lock``,
        ``try_lock_many``, ``release``, ``held``). When the block ends, however it ends, the
        heartbeat stops and the connection closes, releasing every key. A session lost during
        the block (found by the heartbeat, by the watch on its socket, or by the final
        release: the session ended, or a key was no longer held) raises
        :class:`~airflow_pglock.exceptions.LockLostError` at its end, as :meth:`lock` does: also
        when the block raised (a skip, an error decided after the loss), from that error. A lost
        session is never a success, nor a skip.

        :param application_name: names the session in ``pg_stat_activity``.
        """
        session = self.open_lock_session(application_name=application_name)
        info = session.server

        def end(error: BaseException | None) -> None:
            session.close()  # its release checks every key: it may find the session lost
            lost = session.lost
            if lost is not None:
                key = LockKey.from_int(info.backend_pid)
                raise LockLostError(f"the lock session was lost: {lost}", key, lost) from error

        with _ended_by(end):
            yield session

    def open_lock_session(self, *, application_name: str | None = None) -> LockSession:
        """A lock session that outlives a ``with`` block (the triggerer's holds): its owner calls
        ``close()``. :meth:`lock_session` is the form for everyone else."""
        conn, info, _ = self.database.open_lock_session(application_name, "session")
        try:
            return LockSession(conn, info, self.database)
        except BaseException:
            conn.close()
            raise

    def acquire(
        self,
        key: AnyKey,
        *,
        timeout: float | dt.timedelta | None = None,
        shared: bool = False,
        mode: Scope = "session",
        slots: int = 1,
        application_name: str | None = None,
    ) -> HeldLock | None:
        """Take ``key`` on a dedicated connection and return it held; None (and no connection) when busy.

        The manual form, with no heartbeat: nothing keeps the session alive or watches it, so
        a lock held longer than the lease with its connection idle is lost to the server, and
        that is found only by :meth:`HeldLock.release <airflow_pglock.pg.held.HeldLock.release>`
        (it returns False) or :meth:`HeldLock.is_held <airflow_pglock.pg.held.HeldLock.is_held>`.
        Release it yourself, in a ``finally``; use :meth:`lock` for anything that may take a while.

        :param key: a name, an int64, an (int32, int32) pair or a :class:`~airflow_pglock.keys.LockKey`.
        :param timeout: None to try once, or seconds (or a ``timedelta``) to wait for the key (server-side).
        :param shared: take the key in shared mode.
        :param mode: ``"session"``, or ``"transaction"``: a transaction is opened and stays
            open on ``held.connection``; ``held.commit()`` commits it (and ends the lock),
            ``held.release()`` rolls it back.
        :param slots: more than one: ``key`` names a pool of that many slots
            (:func:`~airflow_pglock.keys.slot_keys`); the lock held is any one free slot.
        :param application_name: names the holder in ``pg_stat_activity``.

        A named key that another run's lock scope holds between its tasks (docs/scopes.md) is
        busy: None, at once (the wait is for the key, not for the scope's lease). Of a pool, the
        slots that scopes hold are passed over; with a ``timeout`` every slot is tried again
        about every second until one is taken or the time is up.
        """
        check_mode(mode)  # before any I/O, as the key and the timeout
        check_slots(slots, shared)
        pool = slot_keys(LockKey.coerce(key), slots)
        if timeout is not None:
            timeout = wait_seconds(timeout)  # before any I/O, and before the deadline is computed from it
        every_slot = None if slots == 1 else list(range(slots))
        passed_over: set[int] = set()  # slots that other runs' lock scopes hold between their tasks
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            candidates = None if every_slot is None else [i for i in every_slot if i not in passed_over]
            wait = None if deadline is None else max(0.001, deadline - time.monotonic())
            if passed_over and wait is not None:
                wait = min(wait, SCOPE_POLL_SECONDS)  # a scoped slot frees by its row: try every slot again soon
            held = None
            if candidates != []:
                held = self.database.acquire_lock(
                    pool,
                    shared=shared,
                    scope=mode,
                    timeout=wait,
                    application_name=application_name,
                    candidates=candidates,
                )
            if held is None:
                left = None if deadline is None else deadline - time.monotonic()
                if not passed_over or left is None or left <= 0:
                    return None
                if candidates == []:
                    time.sleep(min(SCOPE_POLL_SECONDS, left))
                passed_over.clear()
                continue
            name = held.connection.info.parameter_status("application_name")
            try:
                check_scope(OUTSIDE, held.key, held, name)
            except LockBusyError:  # another run's lock scope holds the key (a pool: this slot) between its tasks
                held.release()
                if held.slot is None:
                    return None
                passed_over.add(held.slot - 1)
                continue  # another slot of the pool may be free
            except BaseException:
                held.release()
                raise
            try:  # never raises an Exception; an interrupt must not leave the lock held
                record_acquisition(held, name, self.log, slots)
            except BaseException:
                held.release()
                raise
            return held

    # ----------------------------------------------------------------- who holds

    def holders(self, key: AnyKey, *, slots: int = 1) -> list[LockHolder]:
        """Who holds or waits for ``key`` (pid, application_name, client, since), without touching it.

        :param slots: more than one: the holders of every slot of the pool ``key`` names.
        """
        return self.database.holders(slot_keys(LockKey.coerce(key), slots))

    def scope(self, key: AnyKey) -> ScopeRow | None:
        """The live lock scope that holds the named ``key`` (docs/scopes.md), without touching the key;
        None when there is none (also before ``airflow-pglock init-db`` version 5)."""
        with self.database.connect(INSPECT_APPLICATION_NAME) as conn:
            return live_scope(conn, LockKey.coerce(key))

    def scopes(self, key: AnyKey, *, slots: int) -> dict[LockKey, ScopeRow]:
        """The live lock scopes that hold slots of the pool the named ``key`` names, by slot key
        (a scope over a pool holds one slot between its tasks); read as :meth:`scope`."""
        pool = slot_keys(LockKey.coerce(key), slots)
        with self.database.connect(INSPECT_APPLICATION_NAME) as conn:
            return live_scopes_of(conn, pool)

    async def aholders(self, key: AnyKey, *, slots: int = 1) -> list[LockHolder]:
        """Async :meth:`holders` on a short-lived connection of its own (closed even if cancelled)."""
        keys = slot_keys(LockKey.coerce(key), slots)
        async with await self.aconnect(INSPECT_APPLICATION_NAME) as conn:
            return await aread_holders(conn, *keys)


@contextlib.contextmanager
def _ended_by(end: Callable[[BaseException | None], None]) -> Iterator[None]:
    """Around the ``with`` block of :meth:`AdvisoryLockHook.lock` and :meth:`~AdvisoryLockHook.lock_session`:
    ``end`` is called once, however the block ends, with what it raised (None: nothing). A lock found
    lost there raises :class:`~airflow_pglock.exceptions.LockLostError` from the block's error (a lost
    lock is never a success, nor a skip); else the block's own error goes on."""
    try:
        yield
    except BaseException as error:
        end(error)
        raise
    end(None)
