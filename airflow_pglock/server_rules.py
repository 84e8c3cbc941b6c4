"""What is at the other end of a lock connection, and the rules a lock server must pass.

Each rule is one pure function of :class:`ServerInfo` (what the connection found), the
lock scope and the declared ``pool_mode``; it returns a :class:`Violation` (what is wrong
and how to fix it) or None. The lock database raises the first violation as
:class:`~airflow_pglock.exceptions.UnsafeSetupError` before it takes a lock;
``airflow-pglock doctor`` lists the same violations as checks. One source per message.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from airflow_pglock.exceptions import StandbyServerError, UnsafeSetupError
from airflow_pglock.liveness import IDLE_SESSION_TIMEOUT_VERSION

Scope = Literal["session", "transaction"]

MIN_SERVER_VERSION = 120000  # tcp_user_timeout needs PostgreSQL 12


@dataclass(frozen=True)
class ServerInfo:
    """What a lock connection found at the other end.

    A lock connection reads most of it from the handshake (:func:`from_handshake`: the
    ``server_version`` parameter, the database and address it connected to, the pid of the
    key data) and the rest from its first statement, the lock statement itself
    (``pg_backend_pid()``, ``pg_is_in_recovery()``; see
    ``pg.take.first_try``). ``doctor`` reads all of it with ``pg.server.inspect_server``.

    :param backend_pid: ``pg_backend_pid()`` of the lock session.
    :param reported_pid: the backend pid the wire protocol reported; a pooler fakes it.
    :param version_num: ``server_version_num``, e.g. 150004.
    :param version: what the server says it is: ``version()`` (doctor), or the
        ``server_version`` parameter of the handshake (a lock connection).
    :param database: the database connected to.
    :param server_addr: the server's address (``inet_server_addr()``, or the host the
        connection reached); None over a local socket.
    :param server_port: its port; None over a local socket.
    :param in_recovery: ``pg_is_in_recovery()``: True on a standby (refused for locks).
    :param started_at: ``pg_postmaster_start_time()`` as ``doctor``'s inspection reads it; None for a
        lock session (its statement does not ask it: a loss is classified by the server's uptime).
    """

    backend_pid: int
    reported_pid: int
    version_num: int
    version: str
    database: str
    server_addr: str | None
    server_port: int | None
    in_recovery: bool
    started_at: dt.datetime | None

    @property
    def behind_pooler(self) -> bool:
        """True when a connection pooler (PgBouncer, Odyssey, RDS Proxy...) sits in between."""
        return self.reported_pid != self.backend_pid

    @property
    def server(self) -> str:
        return server_label(self.server_addr, self.server_port)


def server_label(addr: str | None, port: int | None) -> str:
    """``addr:port``, or "local socket" (no address)."""
    return "local socket" if addr is None else f"{addr}:{port}"


@dataclass(frozen=True)
class Violation:
    """A set-up where an advisory lock would exclude nobody (or not for long).

    :param check: the ``doctor`` check it belongs to (``server``, ``recovery``, ``pooler``).
    :param problem: what is wrong.
    :param fix: what to do about it.
    :param raises: the error a lock connection fails with (a standby's is retried: a failover under way).
    """

    check: str
    problem: str
    fix: str
    raises: type[UnsafeSetupError] = UnsafeSetupError

    def error(self) -> UnsafeSetupError:
        return self.raises(f"{self.problem}; {self.fix}")


Rule = Callable[[ServerInfo, Scope, "str | None"], "Violation | None"]

#: PostgreSQL's ``server_version`` parameter: ``16.2``, ``17beta1``, ``15.20 (Debian 15.20-0+deb12u1)``.
#: Not PgBouncer's admin console (``1.18.0/bouncer``), not YugabyteDB (``11.2-YB-2.18.0.0-b0``).
_SERVER_VERSION = r"\d+(\.\d+)*(devel|(alpha|beta|rc)\d+)?( .*)?"  # compiled at first use (re caches it)
_FORKS = ("Redshift", "CockroachDB", "YugabyteDB")


def from_handshake(
    *,
    reported_pid: int,
    version_num: int,
    server_version: str | None,
    crdb_version: str | None,
    database: str,
    host: str,
    port: int | None,
) -> ServerInfo:
    """What the handshake told about the server, before any statement ran.

    ``backend_pid`` is the reported one and ``in_recovery`` False until the session's first
    statement says otherwise: only the rules of :data:`HANDSHAKE_RULES` may judge this.

    :param crdb_version: the ``crdb_version`` parameter CockroachDB sends (it claims a
        PostgreSQL ``server_version``).
    :param host: the host the connection reached (a directory for a local socket).
    """
    version = f"CockroachDB {crdb_version}" if crdb_version else (server_version or "")
    local = host.startswith("/") or not host
    return ServerInfo(
        backend_pid=reported_pid,
        reported_pid=reported_pid,
        version_num=version_num,
        version=version,
        database=database,
        server_addr=None if local else host,
        server_port=None if local else port,
        in_recovery=False,
        started_at=None,
    )


def _looks_like_postgresql(version: str) -> bool:
    if version.startswith("PostgreSQL"):  # version()
        return not any(fork in version for fork in _FORKS)
    return re.fullmatch(_SERVER_VERSION, version) is not None  # the handshake's server_version


def not_postgresql(info: ServerInfo, scope: Scope, pool_mode: str | None) -> Violation | None:
    """A wire-compatible server that is not PostgreSQL (its advisory locks are not PostgreSQL's)."""
    if _looks_like_postgresql(info.version):
        return None
    return Violation(
        "server",
        f"the lock database does not look like PostgreSQL (it reports {info.version!r})",
        f"advisory locks need PostgreSQL {MIN_SERVER_VERSION // 10000}+ (directly, or through PgBouncer to a real "
        "database, not its admin console)",
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
        StandbyServerError,
    )


def safe_behind_pooler(scope: Scope, pool_mode: str | None) -> bool:
    """Whether a lock of ``scope`` may be taken through a pooler (the lock statement and
    :func:`session_lock_behind_pooler` ask the same question)."""
    return scope == "transaction" or pool_mode == "session"


def session_lock_behind_pooler(info: ServerInfo, scope: Scope, pool_mode: str | None) -> Violation | None:
    """A session lock through a pooler not declared to run session pooling."""
    if not info.behind_pooler or safe_behind_pooler(scope, pool_mode):
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


#: Every rule, in the order a lock connection checks them.
#: A standby last: the others are settings to fix, and a lock fails with the first (a standby's
#: error is retried, often a failover under way).
RULES: tuple[Rule, ...] = (not_postgresql, too_old, no_idle_session_timeout, session_lock_behind_pooler, hot_standby)
#: The rules the handshake alone can judge (checked before any statement runs).
HANDSHAKE_RULES: tuple[Rule, ...] = (not_postgresql, too_old, no_idle_session_timeout)


def violations(
    info: ServerInfo, scope: Scope, pool_mode: str | None, rules: tuple[Rule, ...] = RULES
) -> list[Violation]:
    """Every rule ``info`` breaks for a lock of ``scope``, in :data:`RULES` order."""
    return [found for rule in rules if (found := rule(info, scope, pool_mode)) is not None]


def check_server(info: ServerInfo, scope: Scope, pool_mode: str | None, rules: tuple[Rule, ...] = RULES) -> None:
    """Raise :class:`~airflow_pglock.exceptions.UnsafeSetupError` for the first rule ``info`` breaks."""
    found = violations(info, scope, pool_mode, rules)
    if found:
        raise found[0].error()
