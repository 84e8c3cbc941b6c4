"""What is at the other end of a lock connection, and the rules a lock server must pass.

Each rule is one pure function of :class:`ServerInfo` (what the connection found), the
lock scope and the declared ``pool_mode``; it returns a :class:`Violation` (what is wrong
and how to fix it) or None. The hook raises the first violation as
:class:`~airflow_pglock.exceptions.UnsafeSetupError` before it takes a lock;
``airflow-pglock doctor`` lists the same violations as checks. One source per message.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from airflow_pglock.exceptions import UnsafeSetupError
from airflow_pglock.liveness import IDLE_SESSION_TIMEOUT_VERSION

Scope = Literal["session", "transaction"]

MIN_SERVER_VERSION = 120000  # tcp_user_timeout needs PostgreSQL 12


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
class Violation:
    """A set-up where an advisory lock would exclude nobody (or not for long).

    :param check: the ``doctor`` check it belongs to (``server``, ``recovery``, ``pooler``).
    :param problem: what is wrong.
    :param fix: what to do about it.
    """

    check: str
    problem: str
    fix: str

    def error(self) -> UnsafeSetupError:
        return UnsafeSetupError(f"{self.problem}; {self.fix}")


Rule = Callable[[ServerInfo, Scope, "str | None"], "Violation | None"]


def not_postgresql(info: ServerInfo, scope: Scope, pool_mode: str | None) -> Violation | None:
    """A wire-compatible server that is not PostgreSQL (its advisory locks are not PostgreSQL's)."""
    if info.version.startswith("PostgreSQL") and not any(
        fork in info.version for fork in ("Redshift", "CockroachDB", "YugabyteDB")
    ):
        return None
    return Violation(
        "server",
        f"the lock database is not PostgreSQL ({info.version!r})",
        f"advisory locks need PostgreSQL {MIN_SERVER_VERSION // 10000}+",
    )


def too_old(info: ServerInfo, scope: Scope, pool_mode: str | None) -> Violation | None:
    """A server older than the liveness settings need."""
    if info.version_num >= MIN_SERVER_VERSION:
        return None
    return Violation(
        "server",
        f"PostgreSQL {info.version_num} is too old",
        f"airflow-pglock needs PostgreSQL {MIN_SERVER_VERSION // 10000} or newer",
    )


def no_idle_session_timeout(info: ServerInfo, scope: Scope, pool_mode: str | None) -> Violation | None:
    """A session lock on a server that cannot end a frozen holder's idle session."""
    if scope != "session" or info.version_num >= IDLE_SESSION_TIMEOUT_VERSION:
        return None
    return Violation(
        "server",
        f"PostgreSQL {info.version_num} has no idle_session_timeout (it appeared in PostgreSQL 14), so a "
        "frozen holder would keep a session lock until TCP keepalives give up, if ever",
        "use mode='transaction' (bounded by idle_in_transaction_session_timeout) or PostgreSQL 14+",
    )


def hot_standby(info: ServerInfo, scope: Scope, pool_mode: str | None) -> Violation | None:
    """A standby: advisory locks are not replicated, so a lock there excludes nobody."""
    if not info.in_recovery:
        return None
    return Violation(
        "recovery",
        f"the lock database {info.database!r} at {info.server} is a standby in recovery: advisory locks are not "
        "replicated, so a lock taken there excludes nobody",
        "point the connection at the primary; with several hosts use the libpq option "
        "target_session_attrs=read-write (connection extra) so a failover lands on the new primary",
    )


def session_lock_behind_pooler(info: ServerInfo, scope: Scope, pool_mode: str | None) -> Violation | None:
    """A session lock through a pooler not declared to run session pooling."""
    if scope != "session" or not info.behind_pooler or pool_mode == "session":
        return None
    return Violation(
        "pooler",
        f"a connection pooler is in between (it reported backend pid {info.reported_pid}, the server says "
        f"{info.backend_pid}): a session-level advisory lock is unsafe under transaction pooling (PgBouncer's "
        "pool_mode=transaction), where the next statement may run on another server session",
        "use mode='transaction' (transaction-level locks work through PgBouncer), connect directly to "
        "PostgreSQL, or, if the pooler really runs in session pooling, set the connection extra "
        '{"pool_mode": "session"}',
    )


#: Every rule, in the order the hook checks them.
RULES: tuple[Rule, ...] = (not_postgresql, too_old, no_idle_session_timeout, hot_standby, session_lock_behind_pooler)


def violations(info: ServerInfo, scope: Scope, pool_mode: str | None) -> list[Violation]:
    """Every rule ``info`` breaks for a lock of ``scope``, in :data:`RULES` order."""
    return [found for rule in RULES if (found := rule(info, scope, pool_mode)) is not None]


def check_server(info: ServerInfo, scope: Scope, pool_mode: str | None) -> None:
    """Raise :class:`~airflow_pglock.exceptions.UnsafeSetupError` for the first rule ``info`` breaks."""
    found = violations(info, scope, pool_mode)
    if found:
        raise found[0].error()
