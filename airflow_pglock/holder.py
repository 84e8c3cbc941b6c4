"""Who holds or waits for an advisory key: the one record (:class:`LockHolder`), pure.

Used by everything that names a holder: the guard's busy message, the sensor, the
trigger, ``airflow-pglock locks`` and the UI page. The query that fills it is
:mod:`airflow_pglock.pg.holders`.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass

from airflow_pglock.identity import holder_where

#: ``pg_locks.mode`` of an advisory lock held exclusively, and shared.
EXCLUSIVE_MODE = "ExclusiveLock"
SHARED_MODE = "ShareLock"


@dataclass(frozen=True)
class LockHolder:
    """A session that holds or waits for a key, as ``pg_locks`` and ``pg_stat_activity`` see it.

    Columns of other roles' sessions (client address, session start, ...) are None unless
    the reading role has the privileges of ``pg_read_all_stats``. ``since`` is when the
    holder's session started; airflow-pglock opens a session per lock, so for its holders
    that is within milliseconds of the acquisition.

    :param database: the database the key belongs to (advisory keys are per database).
    :param classid: ``pg_locks.classid`` of the key.
    :param objid: ``pg_locks.objid`` of the key.
    :param objsubid: ``pg_locks.objsubid`` of the key (1: an int64 key, 2: a pair).
    :param pid: the session's backend pid (None for a prepared transaction).
    :param granted: True when it holds the key, False when it waits for it.
    :param mode: ``ExclusiveLock`` or ``ShareLock``.
    :param application_name: the session's application_name (airflow-pglock's names the DAG,
        task and run); None when hidden (another role without ``pg_read_all_stats``) or unset.
    :param client_addr: the client's address; None over a local socket or when hidden.
    :param client_port: the client's port.
    :param since: when the session started (``backend_start``).
    :param waiting_since: when a waiter started waiting (``pg_locks.waitstart``, PostgreSQL 14+).
    :param transaction_start: start of the session's current transaction, if any.
    :param user: the session's role.
    :param state: ``pg_stat_activity.state`` (``idle``, ``active``, ...).
    :param backend_type: ``pg_stat_activity.backend_type`` (``client backend``...).
    :param waiters: how many sessions wait for this key.
    :param blocked_by: for a waiter, the pids it waits for (``pg_blocking_pids``).
    """

    database: str
    classid: int
    objid: int
    objsubid: int
    pid: int | None
    granted: bool
    mode: str
    application_name: str | None
    client_addr: str | None
    client_port: int | None
    since: dt.datetime | None
    waiting_since: dt.datetime | None
    transaction_start: dt.datetime | None
    user: str | None
    state: str | None
    backend_type: str | None
    waiters: int
    blocked_by: tuple[int, ...]

    @property
    def client(self) -> str:
        """Where the session connects from: its address; ``local`` over a Unix socket; ``hidden``
        where the reading role may not see it (no ``pg_read_all_stats``: the role is shown, the
        session's start and address are not); ``?`` when nothing about the session is shown."""
        if self.client_addr:
            return self.client_addr
        if self.user is None:
            return "?"
        return "local" if self.since is not None else "hidden"

    @property
    def coordinates(self) -> tuple[int, int, int]:
        return self.classid, self.objid, self.objsubid

    @property
    def shared(self) -> bool:
        return self.mode != EXCLUSIVE_MODE

    @property
    def deployment(self) -> str | None:
        """The deployment its application_name names (the host when unnamed); None if unknown."""
        return holder_where(self.application_name)[0]

    @property
    def host(self) -> str | None:
        """The host its application_name names; None if unknown (not an airflow-pglock session)."""
        return holder_where(self.application_name)[1]

    def describe(self, now: dt.datetime | None = None) -> str:
        """``pid 123 of deployment 'prod' on host 'w1' (application_name 'x', client 10.0.0.5) holding
        since 12:00:00 (3.1 s)``; deployment and host only where the application_name names them."""
        role = "holding" if self.granted else "waiting"
        start = self.since if self.granted else self.waiting_since
        since = ""
        if start is not None:
            since = f" since {start.isoformat(timespec='seconds')}"
            if now is not None:
                since += f" ({(now - start).total_seconds():.1f} s)"
        app = repr(self.application_name) if self.application_name else "unknown (no privilege or not set)"
        client = self.client_addr or "local socket or hidden"
        deployment, host = holder_where(self.application_name)
        where = ""
        if host is not None and deployment is not None and deployment != host:
            where = f" of deployment {deployment!r} on host {host!r}"
        elif host is not None:
            where = f" on host {host!r}"
        return f"pid {self.pid}{where} (application_name {app}, client {client}) {role} {self.mode}{since}"


def describe_holders(holders: Sequence[LockHolder], now: dt.datetime, *, nobody: str = "nobody") -> str:
    """``pid 1 (...) holding since ... (3.0 s); pid 2 ...`` for the sessions holding a key.

    :param holders: holders and waiters of one key (waiters are left out).
    :param now: the time the durations run to.
    :param nobody: what to say when no session holds it.
    """
    return "; ".join(holder.describe(now) for holder in holders if holder.granted) or nobody


def blocking_holders(holders: Sequence[LockHolder], shared: bool) -> list[LockHolder]:
    """The sessions that keep the key from being taken: its granted holders; for a ``shared``
    lock, its exclusive holders and exclusive requests queued (PostgreSQL queues a new shared
    request behind a waiting exclusive one, so it cannot be taken now)."""
    if shared:
        return [h for h in holders if h.mode == EXCLUSIVE_MODE]
    return [h for h in holders if h.granted]


@dataclass(frozen=True)
class LockSnapshot:
    """All advisory locks at one instant, and the server clock at that instant.

    :param taken_at: the server's clock when the snapshot was read.
    :param database: the database connected to.
    :param rows: every holder and waiter, holders before waiters, grouped by key.
    :param in_recovery: the server is a standby in recovery: it holds no lock of the primary's
        sessions (advisory locks are not replicated), so an empty snapshot says nothing.
    """

    taken_at: dt.datetime
    database: str
    rows: tuple[LockHolder, ...]
    in_recovery: bool = False
