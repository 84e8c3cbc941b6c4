"""The lock statements of one lock session, each a function of its connection.

Take (``try_lock``, ``wait_lock``, a pool's ``try_slot`` / ``wait_slot``, batches of
``try_lock_many``), check (``is_held``, seen from another session), give back
(``unlock_many``, ``unlock_held_among``) and ``commit``. A session's first statement is
:mod:`~airflow_pglock.pg.take`'s; the release that announces itself is
:mod:`~airflow_pglock.pg.release`'s; the heartbeat's bounded check is
:mod:`~airflow_pglock.pg.probe`'s.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg import sql

from airflow_pglock import loss
from airflow_pglock.exceptions import LockConfigurationError
from airflow_pglock.holder import EXCLUSIVE_MODE, SHARED_MODE
from airflow_pglock.keys import LockKey
from airflow_pglock.pg import wakeups
from airflow_pglock.pg.sql import (
    HORIZON_LIVE,
    LIFT_TRANSACTION_TIMEOUT,
    call,
    call_text,
    catalog_function,
    held_condition,
    held_params,
    lock_function,
)
from airflow_pglock.policy import lock_timeout_ms, longest_wait_text, wait_timeout_problem
from airflow_pglock.server_rules import Scope


def check_wait_timeout(timeout: object) -> None:
    """Refuse a wait timeout that is not a positive number of seconds up to
    :data:`~airflow_pglock.policy.MAX_WAIT_TIMEOUT_SECONDS` (LockConfigurationError)."""
    if wait_timeout_problem(timeout) is not None:
        raise LockConfigurationError(
            f"wait timeout must be a positive number of seconds, got {timeout!r}; {longest_wait_text()}"
        )


def wait_seconds(timeout: float | dt.timedelta) -> float:
    """A wait timeout given in seconds or as a ``timedelta``, checked, in seconds."""
    seconds = timeout.total_seconds() if isinstance(timeout, dt.timedelta) else timeout
    if wait_timeout_problem(seconds) is not None:
        raise LockConfigurationError(
            f"wait timeout must be a positive number of seconds, got {timeout!r} (a timedelta is also taken); "
            f"{longest_wait_text()}"
        )
    return float(seconds)


def try_lock(
    conn: psycopg.Connection[Any],
    key: LockKey,
    *,
    shared: bool = False,
    scope: Scope = "session",
    cursor: psycopg.Cursor[Any] | None = None,
) -> bool:
    """One ``pg_try_advisory[_xact]_lock[_shared]`` on ``conn``; True if taken.

    :param cursor: a cursor of ``conn`` to run it on, kept by a caller that takes keys in a tight loop.
    """
    statement = call_text(lock_function("try", shared=shared, scope=scope), key.is_pair)
    row = (conn if cursor is None else cursor).execute(statement, key.numbers).fetchone()
    return bool(row and row[0])


def wait_lock(
    conn: psycopg.Connection[Any],
    key: LockKey,
    timeout: float,
    *,
    shared: bool = False,
    scope: Scope = "session",
) -> bool:
    """Wait at most ``timeout`` seconds for the key, enforced by the server (``lock_timeout``).

    Returns False when the wait timed out and the session does not hold the key (a timeout that
    fired as the key was granted is a success: see ``tests/faults/test_wait_timeout_race.py``).
    """
    check_wait_timeout(timeout)
    statement = call(lock_function("wait", shared=shared, scope=scope), key)
    timeout_ms = f"{lock_timeout_ms(timeout)}ms"
    # lock_timeout bounds the wait; statement_timeout is lifted so that a shorter one set
    # for the role cannot turn "still busy" into an error. Both are SET LOCAL: in session
    # scope they end with the short transaction (the session lock outlives its commit); in
    # transaction scope they are put back afterwards. In session scope the transaction is the
    # wait's own, so a shorter transaction_timeout is lifted too (in the same statement); a
    # transaction-scope lock ends with its transaction, whatever bounds that.
    lifted = f", {LIFT_TRANSACTION_TIMEOUT}" if scope == "session" else ""
    previous = None
    if scope == "transaction":
        previous = conn.execute(
            "SELECT pg_catalog.current_setting('lock_timeout'), pg_catalog.current_setting('statement_timeout')"
        ).fetchone()
    try:
        with conn.transaction(savepoint_name="pglock_wait" if scope == "transaction" else None):
            conn.execute(
                f"SELECT pg_catalog.set_config('lock_timeout', %s, true),"
                f" pg_catalog.set_config('statement_timeout', '0', true){lifted}",
                [timeout_ms],
            )
            conn.execute(statement, key.numbers)
        if previous is not None:
            conn.execute(
                "SELECT pg_catalog.set_config('lock_timeout', %s, true),"
                " pg_catalog.set_config('statement_timeout', %s, true)",
                list(previous),
            )
    except psycopg.errors.LockNotAvailable:
        # The timeout can fire as the lock is granted: PostgreSQL then keeps the lock it granted
        # and still raises (LockErrorCleanup -> GrantAwaitedLock), and a session lock outlives the
        # aborted statement. So the answer is what pg_locks says now, not the error.
        return is_held(conn, key, shared)
    return True


def first_free(function: str) -> sql.Composed:
    # Slot 1 is tried in the anchor; slot n + 1 only in the row the recursion makes from a
    # refused slot n (the WHERE filters the working table's one row before the target list
    # is computed). After a success the recursion has no row left to try from, so at most
    # one try returns true: one slot per statement, whatever the plan.
    return sql.SQL(
        "WITH RECURSIVE attempt(n, taken) AS ("
        " SELECT 1, {f}((%(slots)s::bigint[])[1])"
        " UNION ALL"
        " SELECT n + 1, {f}((%(slots)s::bigint[])[n + 1]) FROM attempt"
        " WHERE NOT taken AND n < pg_catalog.cardinality(%(slots)s::bigint[])"
        ") SELECT n FROM attempt WHERE taken"
    ).format(f=catalog_function(function))


def try_slot(conn: psycopg.Connection[Any], slots: list[LockKey], *, scope: Scope = "session") -> int | None:
    """Take the first free of ``slots`` (int64 keys, exclusive) in one statement, trying them in order.

    Returns the index of the slot taken, or None when every slot is held. Never takes more
    than one (see :func:`first_free`; ``tests/integration/test_slots.py`` races it).
    """
    function = lock_function("try", scope=scope)
    row = conn.execute(first_free(function), {"slots": [key.int64 for key in slots]}).fetchone()
    return None if row is None else int(row[0]) - 1


#: Seconds between two tries of a full pool with ``on_busy="wait"`` (no server-side wait for "any of N").
SLOT_POLL_SECONDS = 0.2


def wait_slot(
    conn: psycopg.Connection[Any], slots: list[LockKey], timeout: float, *, scope: Scope = "session"
) -> int | None:
    """Try the pool every :data:`SLOT_POLL_SECONDS` until a slot is taken or ``timeout`` s passed."""
    check_wait_timeout(timeout)
    deadline = time.monotonic() + timeout
    while True:
        slot = try_slot(conn, slots, scope=scope)
        remaining = deadline - time.monotonic()
        if slot is not None or remaining <= 0:
            return slot
        time.sleep(min(SLOT_POLL_SECONDS, remaining))


#: Keys per statement of :func:`try_lock_many` / :func:`unlock_many` (a few round trips for many thousands).
MANY_KEYS_PER_STATEMENT = 5000


_NO_MORE = sql.SQL("")


def _each_key(function: str, more: sql.Composable = _NO_MORE) -> sql.Composed:
    """``function`` applied to every key of three parallel arrays (int64s; or the two halves
    of a pair), in the order given: one statement, one round trip (``more``: further columns,
    each row's read after its key's call)."""
    call = sql.SQL(
        "SELECT CASE WHEN k.whole IS NOT NULL THEN {f}(k.whole) ELSE {f}(k.first, k.second) END{more}"
        " FROM ROWS FROM (pg_catalog.unnest(%s::bigint[]), pg_catalog.unnest(%s::integer[]),"
        " pg_catalog.unnest(%s::integer[])) WITH ORDINALITY AS"
        " k(whole, first, second, n)"
        " ORDER BY k.n"
    )
    return call.format(f=catalog_function(function), more=more)


def _for_each_key(conn: psycopg.Connection[Any], function: str, keys: list[LockKey]) -> list[bool]:
    answers: list[bool] = []
    for start in range(0, len(keys), MANY_KEYS_PER_STATEMENT):
        chunk = keys[start : start + MANY_KEYS_PER_STATEMENT]
        wholes = [key.int64 for key in chunk]
        pairs = [key.numbers if key.is_pair else (None, None) for key in chunk]
        firsts = [pair[0] for pair in pairs]
        seconds = [pair[-1] for pair in pairs]
        rows = conn.execute(_each_key(function), [wholes, firsts, seconds]).fetchall()
        answers += [bool(row[0]) for row in rows]
    return answers


def try_lock_many(
    conn: psycopg.Connection[Any], keys: list[LockKey], *, shared: bool = False, scope: Scope = "session"
) -> list[bool]:
    """``pg_try_advisory[_xact]_lock[_shared]`` for each key, in one round trip per
    :data:`MANY_KEYS_PER_STATEMENT` keys; whether each was taken, in order."""
    return _for_each_key(conn, lock_function("try", shared=shared, scope=scope), keys)


def scopes_installed(conn: psycopg.Connection[Any]) -> bool:
    """Whether the lock scopes' tables are in this database (init-db version 5)."""
    row = conn.execute("SELECT pg_catalog.to_regclass('pglock.scope_horizon') IS NOT NULL").fetchone()
    return bool(row and row[0])


_HORIZON_COLUMN = sql.SQL(", " + HORIZON_LIVE)


def try_lock_seeing_scopes(
    conn: psycopg.Connection[Any], keys: list[LockKey], *, shared: bool = False, scope: Scope = "session"
) -> list[bool]:
    """:func:`try_lock_many` that also says, after taking them, whether some lock scope may be
    live (the horizon, read in the same statement after the tries): a last element."""
    answers: list[bool] = []
    live = False
    for start in range(0, len(keys), MANY_KEYS_PER_STATEMENT):
        chunk = keys[start : start + MANY_KEYS_PER_STATEMENT]
        wholes = [key.int64 for key in chunk]
        pairs = [key.numbers if key.is_pair else (None, None) for key in chunk]
        statement = _each_key(lock_function("try", shared=shared, scope=scope), _HORIZON_COLUMN)
        rows = conn.execute(statement, [wholes, [p[0] for p in pairs], [p[-1] for p in pairs]]).fetchall()
        answers += [bool(row[0]) for row in rows]
        live = live or any(bool(row[1]) for row in rows)
    return [*answers, live]


# Transaction locks given back: their release announced (sent as the transaction commits, which
# ends them) and the positions of those this session still holds in one mode, in one row whatever
# happens. The session's locks are read once (a hashed subplan), not once per key.
_GIVEN_BACK = (
    f"SELECT (SELECT pg_catalog.count(pg_catalog.pg_notify('{wakeups.RELEASED_CHANNEL}', p))"
    f" FROM pg_catalog.unnest(%s::text[]) AS p),"
    " ARRAY(SELECT k.n FROM ROWS FROM (pg_catalog.unnest(%s::bigint[]),"
    " pg_catalog.unnest(%s::bigint[]), pg_catalog.unnest(%s::integer[])) WITH"
    " ORDINALITY AS k(c, o, s, n)"
    " WHERE (k.c, k.o, k.s) IN (SELECT classid::bigint, objid::bigint, objsubid::integer FROM pg_catalog.pg_locks"
    " WHERE locktype = 'advisory' AND pid = pg_catalog.pg_backend_pid() AND granted AND mode = %s))"
)


def given_back(conn: psycopg.Connection[Any], keys: list[LockKey], *, shared: bool = False) -> list[bool]:
    """Transaction locks given back before their transaction ends (no statement can end one
    sooner): whether this session still holds each (``pg_locks``: a ``ROLLBACK TO SAVEPOINT`` ends
    one taken after the savepoint), and their release announced to waiting triggers (``pg_notify``,
    sent as the transaction commits, when they end). One statement."""
    mode = SHARED_MODE if shared else EXCLUSIVE_MODE
    coordinates = [key.pg_locks for key in keys]
    params = [[wakeups.payload(key) for key in keys], *([c[i] for c in coordinates] for i in range(3)), mode]
    row = conn.execute(_GIVEN_BACK, params).fetchone()
    held = set(row[1]) if row else set()
    return [position in held for position in range(1, len(keys) + 1)]


def unlock_many(conn: psycopg.Connection[Any], keys: list[LockKey], *, shared: bool = False) -> list[bool]:
    """``pg_advisory_unlock[_shared]`` for each key (as :func:`try_lock_many`); whether each was held.

    Not announced to waiting triggers: they see these keys free at their next poll.
    """
    return _for_each_key(conn, lock_function("unlock", shared=shared), keys)


# This very session's advisory locks in one mode. No catalog is read: a session's own locks
# are all in its database, and a shared catalog's lock would need room in the lock table,
# which a batch that ran out of shared memory has just filled.
_OWN_LOCKS = (
    "SELECT classid::bigint, objid::bigint, objsubid::integer FROM pg_catalog.pg_locks"
    " WHERE locktype = 'advisory' AND pid = pg_catalog.pg_backend_pid() AND granted AND mode = %s"
)


def unlock_held_among(conn: psycopg.Connection[Any], keys: list[LockKey], *, shared: bool = False) -> int:
    """Release those of ``keys`` this session holds (as ``pg_locks`` says); how many.

    For keys a failed statement may have left either way (a batch cancelled part-way, an
    unlock refused); only those held are unlocked (an unlock of a key not held warns, once
    per key). The session's locks are read once and matched here: a join in SQL would
    compare every key with every lock. It runs with ``statement_timeout`` lifted (and put
    back afterwards), so that the timeout that cancelled that statement cannot cancel these.
    """
    mode = SHARED_MODE if shared else EXCLUSIVE_MODE
    with _statement_timeout_lifted(conn):
        own = {(row[0], row[1], row[2]) for row in conn.execute(_OWN_LOCKS, [mode]).fetchall()}
        held = [key for key in keys if key.pg_locks in own]
        if held:
            unlock_many(conn, held, shared=shared)
    return len(held)


@contextlib.contextmanager
def _statement_timeout_lifted(conn: psycopg.Connection[Any]) -> Iterator[None]:
    # A plain SET, put back afterwards, not SET LOCAL in a transaction: other threads use this
    # connection between these statements (a heartbeat's probe), and an error of theirs
    # would abort the transaction. The fenced subquery reads the old value before the change.
    row = conn.execute(
        "SELECT previous, pg_catalog.set_config('statement_timeout', '0', false)"
        " FROM (SELECT pg_catalog.current_setting('statement_timeout') AS previous OFFSET 0) AS setting"
    ).fetchone()
    try:
        yield
    finally:
        usable = not conn.closed and conn.info.transaction_status != psycopg.pq.TransactionStatus.INERROR
        if row is not None and usable:  # in a failed transaction, its rollback puts the value back
            conn.execute("SELECT pg_catalog.set_config('statement_timeout', %s, false)", [row[0]])


def session_alive_seen_from_aside(conn: psycopg.Connection[Any], pid: int) -> bool:
    """Whether the session ``pid`` still exists, asked on another session ``conn`` (for a lock
    session whose own connection is busy: its keys can end only with it, or by its unlock)."""
    row = conn.execute("SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_stat_activity WHERE pid = %s)", [pid]).fetchone()
    return bool(row and row[0])


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
            f"PostgreSQL answered COMMIT with {status}, nothing was committed: {loss.ABORTED_UNLESS_IN_A_SAVEPOINT}"
        )


def transaction_status(conn: psycopg.Connection[Any], xact_id: int) -> str | None:
    """``txid_status(xact_id)`` on ``conn``: ``committed``, ``aborted``, ``in progress``, or None
    (too old to tell)."""
    row = conn.execute("SELECT pg_catalog.txid_status(%s::bigint)", [xact_id]).fetchone()
    return None if row is None else row[0]


def is_held(conn: psycopg.Connection[Any], key: LockKey, shared: bool = False, xact_id: int | None = None) -> bool:
    """Whether this very session holds the key now (reads ``pg_locks``, takes nothing).

    :param xact_id: for a transaction lock, the transaction that took it: also check
        that the session is still in that transaction.
    """
    params = held_params(key, shared) + ([] if xact_id is None else [xact_id])
    statement = "SELECT " + held_condition(None, ("%s", "%s", "%s", "%s"), None if xact_id is None else "%s")
    row = conn.execute(statement, params).fetchone()  # type: ignore[arg-type]  # static SQL from this module
    return bool(row and row[0])


def held_seen_from_aside(
    conn: psycopg.Connection[Any], pid: int, key: LockKey, shared: bool, xact_id: int | None
) -> bool:
    """Whether the session ``pid`` still holds ``key`` (in its transaction ``xact_id``), asked on
    another session ``conn``: for when the lock's own connection is busy with the work."""
    statement = "SELECT " + held_condition("%s", ("%s", "%s", "%s", "%s"), None if xact_id is None else "%s")
    params: list[Any] = [pid, *held_params(key, shared)]
    if xact_id is not None:
        params += [pid, xact_id]
    row = conn.execute(statement, params).fetchone()  # type: ignore[arg-type]  # static SQL from this module
    return bool(row and row[0])
