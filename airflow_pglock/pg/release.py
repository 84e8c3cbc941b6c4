"""Giving a lock back: the unlock that announces the release, a transaction lock's checked
commit, and the write that travels with either (:class:`WriteAtRelease`).

Each is one round trip: the unlock carries its ``pg_notify`` (and a pool's markers); the
commit carries its "still held" check; the write at release (the key-name registry's)
rides in the same simple query, bounded so that it never holds the release up.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from airflow_pglock.keys import LockKey
from airflow_pglock.pg import wakeups
from airflow_pglock.pg.probe import results_before
from airflow_pglock.pg.sql import IN_TRANSACTION, call_text, held_condition, held_params, inline, lock_function
from airflow_pglock.server_rules import Scope

log = logging.getLogger("airflow_pglock")


#: The most the write at release waits for a lock (a row, the registry's table): past it the
#: write is skipped, logged, and the release goes on. It keeps the release from waiting on an
#: uncommitted ``UPDATE pglock.key_names`` in a manual-commit client, or on an ``ALTER`` of
#: ``init-db`` queued behind a reader (every later lock request on the table queues behind it).
AT_RELEASE_LOCK_TIMEOUT = "200ms"
#: ...and the most it runs at all (a backstop: the write is one small row).
AT_RELEASE_STATEMENT_TIMEOUT = "1s"
# Both are SET LOCAL. In transaction scope they must not outlive the write (the work's own
# COMMIT follows it, and a deferred constraint of the work must not fail on them): the values
# they replace are kept in the transaction's own placeholders and put back after the write; a
# write that fails is rolled back to its savepoint, which puts them back too.
BOUND_WRITE = (
    "SELECT pg_catalog.set_config('pglock.lock_timeout_before', pg_catalog.current_setting('lock_timeout'), true),"
    " pg_catalog.set_config('pglock.statement_timeout_before', pg_catalog.current_setting('statement_timeout'), true),"
    f" pg_catalog.set_config('lock_timeout', '{AT_RELEASE_LOCK_TIMEOUT}', true),"
    f" pg_catalog.set_config('statement_timeout', '{AT_RELEASE_STATEMENT_TIMEOUT}', true)"
)
# A write at release in a transaction of its own (session scope) also commits without waiting
# for a WAL flush or a synchronous standby: the row only names a key, a later hold writes it
# again, and under synchronous replication whose standby does not answer the commit would wait
# for ever (statement_timeout does not end that wait), and the task with it, after its unlock.
# Never in the work's transaction (transaction scope): its commit is the work's.
BOUND_WRITE_ALONE = BOUND_WRITE + ", pg_catalog.set_config('synchronous_commit', 'off', true)"
UNBOUND_WRITE = (
    "SELECT pg_catalog.set_config('lock_timeout', pg_catalog.current_setting('pglock.lock_timeout_before'), true),"
    " pg_catalog.set_config('statement_timeout', pg_catalog.current_setting('pglock.statement_timeout_before'), true)"
)
#: The errors of a write that hit its bound (a skipped write, not a refused one).
BOUND_ERRORS: tuple[type[psycopg.Error], ...] = (psycopg.errors.LockNotAvailable, psycopg.errors.QueryCanceled)


@dataclass(frozen=True)
class WriteAtRelease:
    """A write that travels with the lock's release, in its round trip (the key-name registry's
    record of the key's name: ``registry.record_acquisition``).

    The write never holds the release up: it waits at most :data:`AT_RELEASE_LOCK_TIMEOUT` for
    a lock (:data:`BOUND_WRITE`), and runs after the unlock and its announcement are committed
    (session scope) or in a savepoint before the commit (transaction scope).

    :param statement: the write, its values bound (psycopg's client-side binding); it returns rows.
    :param done: called with the write's rows once it ran with the release.
    :param failed: called instead, with the error, when the write failed there (one of
        :data:`BOUND_ERRORS` when it hit its bound): its transaction is rolled back and the
        connection usable (it may write again on its own); a session lock's unlock and its
        announcement have run, a transaction lock's commit follows.
    """

    statement: str
    done: Callable[[list[tuple[Any, ...]]], None]
    failed: Callable[[psycopg.Connection[Any], psycopg.Error], None]


def _run_together(conn: psycopg.Connection[Any], statements: list[str]) -> tuple[list[list[Any]], str | None]:
    """Send ``statements`` as one simple query (one round trip): the rows of each, and the
    status of the last. The first error stops the query (raised here), and aborts its
    (implicit or explicit) transaction."""
    cursor = conn.execute(sql.SQL("; ".join(statements)))
    rows = [cursor.fetchall() if cursor.description else []]
    while cursor.nextset():
        rows.append(cursor.fetchall() if cursor.description else [])
    return rows, cursor.statusmessage


# A transaction lock ends with its COMMIT, which must not run when the session no longer
# holds the key in that transaction (the work ended it and began another). The check and the
# COMMIT travel in one simple query: a key not held makes the check divide by zero (at run
# time: the divisor is no constant the planner could fold), and an error stops the query
# before its COMMIT.
_CHECK = "SELECT 1 / ({condition})::int"


def commit_if_held(
    conn: psycopg.Connection[Any],
    key: LockKey,
    shared: bool,
    xact_id: int | None,
    at_release: WriteAtRelease | None = None,
) -> bool:
    """COMMIT the lock's transaction if this session still holds ``key`` in it: one round trip.

    Returns False when it does not: nothing is committed, and the transaction is aborted
    (closing the connection rolls it back). Raises ``InFailedSqlTransaction`` when an earlier
    error had aborted the transaction, and the driver's error when the session ended.

    :param at_release: a write sent in the same round trip, after the check, in a savepoint.
    """
    if xact_id is not None:
        # A transaction-level lock lasts as long as its transaction (there is no unlock, and it was
        # taken before any savepoint the work could roll back to): still in that transaction is
        # still holding it. Cheaper than reading pg_locks, which a fresh backend pays ~1 ms for.
        condition, params = IN_TRANSACTION.format("%s"), [xact_id]
    else:
        condition, params = held_condition(None, ("%s", "%s", "%s", "%s"), None), held_params(key, shared)
    # Several statements in one simple query take no parameters: psycopg binds them client-side.
    statements = [inline(conn, _CHECK.format(condition=condition), params)]
    if at_release is not None:
        statements += [_SAVEPOINT, BOUND_WRITE, at_release.statement, UNBOUND_WRITE, f"RELEASE {_SAVEPOINT}"]
    try:
        rows, status = _run_together(conn, [*statements, "COMMIT"])
    except psycopg.errors.DivisionByZero:
        return False
    except psycopg.Error as error:
        if at_release is None or not _back_to_savepoint(conn):
            raise
        at_release.failed(conn, error)
        return commit_if_held(conn, key, shared, xact_id)
    if at_release is not None:
        at_release.done(rows[3])
    if status != "COMMIT":
        raise psycopg.errors.InFailedSqlTransaction(f"PostgreSQL answered COMMIT with {status}: nothing was committed")
    return True


_SAVEPOINT = "SAVEPOINT pglock_at_release"


def _back_to_savepoint(conn: psycopg.Connection[Any]) -> bool:
    """After a failed write at release: back to the savepoint before it; False when there is none."""
    if conn.closed or conn.info.transaction_status != psycopg.pq.TransactionStatus.INERROR:
        return False
    try:
        conn.execute(f"ROLLBACK TO {_SAVEPOINT}")
    except psycopg.Error:
        return False
    return True


@functools.cache
def _announced_unlock(function: str, pair: bool) -> str:
    # Text, built once per form: a lock session releases keys in a tight loop. The channel is
    # this package's constant, a plain name.
    return f"{call_text(function, pair)}, pg_catalog.pg_notify('{wakeups.RELEASED_CHANNEL}', %s)"


def _unlock_statement(key: LockKey, shared: bool, markers: tuple[LockKey, ...]) -> tuple[str, list[Any]]:
    statement = _announced_unlock(lock_function("unlock", shared=shared), key.is_pair)
    params: list[Any] = [*key.numbers, wakeups.payload(key)]
    for marker in markers:  # a pool's slot: its markers go with it
        statement += ", pg_catalog.pg_advisory_unlock_shared(%s::bigint)"
        params.append(marker.int64)
    return statement, params


def unlock(
    conn: psycopg.Connection[Any],
    key: LockKey,
    *,
    shared: bool = False,
    at_release: WriteAtRelease | None = None,
    markers: tuple[LockKey, ...] = (),
    cursor: psycopg.Cursor[Any] | None = None,
) -> bool:
    """``pg_advisory_unlock[_shared]``: True if this session held the key.

    The same statement announces the release to waiting triggers (``pg_notify``, see
    :mod:`~airflow_pglock.pg.wakeups`): no extra round trip.

    :param markers: keys held in shared mode that are given back in the same statement (a pool's markers).
    :param at_release: a write sent in the same round trip, in a transaction of its own after
        the unlock's, which commits first: the key is free, and its release announced, as soon
        as without it. The write waits for no lock longer than its bound
        (:data:`AT_RELEASE_LOCK_TIMEOUT`); one that fails is rolled back alone.
    :param cursor: a cursor of ``conn`` to run the unlock on, kept by a caller that releases
        keys in a tight loop (without ``at_release``).
    """
    statement, params = _unlock_statement(key, shared, markers)
    if at_release is not None and conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        # A transaction the caller left open on the lock's connection: the write's BEGIN/COMMIT would
        # commit it, after the key is free, where closing the connection rolls it back. Unlock alone;
        # a later hold records the name.
        log.debug("pglock: the name of %s is not recorded: a transaction is open on its connection", key.describe())
        at_release = None
    if at_release is None:
        row = (conn if cursor is None else cursor).execute(statement, params).fetchone()
        return bool(row and row[0])
    bound = inline(conn, statement, params)
    # BEGIN, unlock, COMMIT | BEGIN, bound, write, COMMIT: the server skips the rest of the query at an error.
    results = _results_of(conn, f"BEGIN; {bound}; COMMIT; BEGIN; {BOUND_WRITE_ALONE}; {at_release.statement}; COMMIT")
    encoding = conn.info.encoding
    failure = next((r for r in results if r.status == psycopg.pq.ExecStatus.FATAL_ERROR), None)
    if failure is not None:
        _roll_back_failed(conn)
    unlocked = results[1] if len(results) > 1 else results[0]
    if len(results) < 3 or unlocked.status != psycopg.pq.ExecStatus.TUPLES_OK:
        if failure is None:
            raise psycopg.OperationalError("the session ended before its unlock was committed")
        raise psycopg.errors.error_from_result(failure, encoding=encoding)
    written = results[5] if len(results) > 5 else None
    if failure is None and written is not None and len(results) == 7:
        at_release.done([(bytes(written.get_value(row, 0) or b"").decode(encoding),) for row in range(written.ntuples)])
    elif failure is not None:
        at_release.failed(conn, psycopg.errors.error_from_result(failure, encoding=encoding))
    else:
        at_release.failed(conn, psycopg.OperationalError("the session ended before the write at release ran"))
    return unlocked.ntuples > 0 and unlocked.get_value(0, 0) == b"t"


def _roll_back_failed(conn: psycopg.Connection[Any]) -> None:
    """After an error inside an explicit transaction of a simple query: ROLLBACK, so that the
    connection is usable again (a broken connection is left as it is)."""
    if not conn.closed and conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR:
        with contextlib.suppress(psycopg.Error):
            conn.execute("ROLLBACK")


def _results_of(conn: psycopg.Connection[Any], query: str) -> list[psycopg.pq.abc.PGresult]:
    """Every result of a simple query of several statements, an error's included (psycopg's
    ``execute`` raises at the first error and drops the results before it)."""
    with conn.lock:
        if conn.closed:
            raise psycopg.OperationalError("the lock connection is closed")
        pgconn = conn.pgconn
        pgconn.send_query(query.encode(conn.info.encoding))
        results = results_before(pgconn, time.monotonic() + _NO_CLIENT_DEADLINE)
    if not results:  # the server hung up without a word (its reason, if any, went to the notice handler)
        raise psycopg.OperationalError("the server closed the lock session")
    return results


# A release waits for its answer as a plain statement does: bounded by the server and TCP settings.
_NO_CLIENT_DEADLINE = 24 * 3600.0


#: The most a transaction lock's rollback, or the unlock of a holder that gave up before its work,
#: waits for its answer before the connection is just closed (the key then goes when the server
#: hears of the close): a stalled server, network or proxy must not hold up a failed work's end or a skip.
ROLLBACK_WAIT_SECONDS = 2.0


def roll_back_within(conn: psycopg.Connection[Any], timeout: float = ROLLBACK_WAIT_SECONDS) -> bool:
    """ROLLBACK the open transaction, waiting at most ``timeout`` s for the server's answer.

    True when the server answered: the transaction, and a transaction lock with it, has ended.
    False when it could not be sent (the connection is closed, or busy with a statement the work
    left running) or no answer came in time; the caller closes the connection then.
    """
    return _answered_within(conn, b"ROLLBACK", psycopg.pq.ExecStatus.COMMAND_OK, timeout)


def unlock_within(
    conn: psycopg.Connection[Any],
    key: LockKey,
    *,
    shared: bool = False,
    markers: tuple[LockKey, ...] = (),
    timeout: float = ROLLBACK_WAIT_SECONDS,
) -> bool:
    """The announced unlock (:func:`unlock`, with nothing written at release), waiting at most
    ``timeout`` s for the answer: for a holder that gives up before its work, whose skip a stalled
    server must not hold up. False as :func:`roll_back_within`; the caller closes the connection."""
    statement, params = _unlock_statement(key, shared, markers)
    bound = inline(conn, statement, params)
    return _answered_within(conn, bound.encode(conn.info.encoding), psycopg.pq.ExecStatus.TUPLES_OK, timeout)


def give_back_all(conn: psycopg.Connection[Any], scope: Scope, timeout: float = ROLLBACK_WAIT_SECONDS) -> bool:
    """Free now what a dedicated lock connection took before its holder was refused (a pool's
    markers, the key itself): the close alone frees it only once the backend has exited, and
    meanwhile another try could be refused for it. Session scope: every session-level advisory
    lock of the session, so only where the server rules were met (a server session of its own,
    never one a transaction pooler shares); transaction scope: the rollback. Bounded as
    :func:`roll_back_within`; False when it could not be done (the close frees them then)."""
    if scope == "transaction":
        return roll_back_within(conn, timeout)
    return _answered_within(
        conn, b"SELECT pg_catalog.pg_advisory_unlock_all()", psycopg.pq.ExecStatus.TUPLES_OK, timeout
    )


def _answered_within(
    conn: psycopg.Connection[Any], query: bytes, status: psycopg.pq.ExecStatus, timeout: float
) -> bool:
    """Send a simple query; whether every result came within ``timeout`` s with ``status``."""
    deadline = time.monotonic() + timeout
    if not conn.lock.acquire(timeout=timeout):
        return False
    try:
        if conn.closed or conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.ACTIVE:
            return False
        conn.pgconn.send_query(query)
        results = results_before(conn.pgconn, deadline)
    except psycopg.Error:
        return False
    finally:
        conn.lock.release()
    return results is not None and all(result.status == status for result in results)
